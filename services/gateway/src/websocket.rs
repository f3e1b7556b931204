//! WebSocket framing (RFC 6455, section 5) after the opening handshake ([`crate::upgrade`]):
//! the frames a client sends, read into messages, and the frames the gateway writes.
//!
//! The gateway does this itself rather than through a WebSocket library because of large
//! messages. The library read a frame into one buffer that grew to the frame's size and was
//! then kept, at that size, for the rest of the connection: a device that had sent one 90 MiB
//! screenshot held 90 MiB of the gateway while it stayed connected. It also read every frame
//! 1 KiB per system call (its read size is the idle buffer's size). And it wrote a message by
//! copying it whole into its output buffer. Here a frame larger than the read buffer is read
//! straight into a buffer of its own, in reads as large as the socket gives, and handed over
//! whole; that buffer grows with the bytes that arrive (not with the size the header
//! announces: [`FIRST_FRAME_ROOM`]); the read buffer stays at [`READ_BUFFER_BYTES`]. A
//! message is written as its header followed by the message's own bytes (a large one in
//! fragments, each a header and a slice of the message).
//!
//! Only what a server needs: client frames must be masked, no extension is negotiated (so
//! the reserved bits must be clear), control frames are at most 125 bytes and not
//! fragmented, text must be UTF-8 once joined. A violation ends the connection with the close
//! code RFC 6455 names for it.

use bytes::Bytes;
use sync_wrapper::SyncWrapper;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes read from the socket at a time into the read buffer (which is let go whenever a
/// message is read and nothing more is buffered). AIP frames are mostly far smaller; a larger
/// frame is read into a buffer of its own.
pub(crate) const READ_BUFFER_BYTES: usize = 1024;

/// The room a frame's own buffer starts with, at most. It then doubles as the frame's bytes
/// arrive, so a header alone (which may announce up to the size limit) never makes the
/// gateway set aside more than this for a frame whose bytes do not come.
pub(crate) const FIRST_FRAME_ROOM: usize = 64 * 1024;

/// The close code for a protocol violation.
const CLOSE_PROTOCOL: u16 = 1002;
/// The close code for text that is not UTF-8.
const CLOSE_INVALID_DATA: u16 = 1007;

/// A frame's opcode (RFC 6455, section 5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpCode {
    Continuation,
    Text,
    Binary,
    Close,
    Ping,
    Pong,
}

impl OpCode {
    fn from_bits(bits: u8) -> Option<Self> {
        Some(match bits {
            0x0 => OpCode::Continuation,
            0x1 => OpCode::Text,
            0x2 => OpCode::Binary,
            0x8 => OpCode::Close,
            0x9 => OpCode::Ping,
            0xA => OpCode::Pong,
            _ => return None,
        })
    }

    fn bits(self) -> u8 {
        match self {
            OpCode::Continuation => 0x0,
            OpCode::Text => 0x1,
            OpCode::Binary => 0x2,
            OpCode::Close => 0x8,
            OpCode::Ping => 0x9,
            OpCode::Pong => 0xA,
        }
    }

    fn is_control(self) -> bool {
        matches!(self, OpCode::Close | OpCode::Ping | OpCode::Pong)
    }
}

/// A whole message from the client.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// A text message, checked to be UTF-8.
    Text(Bytes),
    Binary(Bytes),
    Ping(Bytes),
    Pong,
    /// The client's close frame: its status code and reason, if it gave one.
    Close(Option<(u16, String)>),
}

/// Why reading stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadFailure {
    /// A frame, or a message joined from frames, over the limit; the rest is left unread.
    #[error("message of at least {size} bytes is over the limit of {limit} bytes")]
    TooLarge { size: u64, limit: usize },
    /// The client broke RFC 6455; `code` is the close code that says so.
    #[error("{reason}")]
    Violation { code: u16, reason: &'static str },
    /// The connection ended inside a frame.
    #[error("the connection ended in the middle of a frame")]
    Truncated,
    #[error("read failed: {0}")]
    Io(#[from] std::io::Error),
}

/// A frame header read off the wire.
#[derive(Debug, Clone, Copy)]
struct Header {
    fin: bool,
    opcode: OpCode,
    mask: [u8; 4],
    len: usize,
}

/// A frame whose header is read and whose payload is still arriving.
#[derive(Debug)]
struct Partial {
    header: Header,
    payload: Vec<u8>,
}

/// Reads client frames and joins them into messages.
///
/// Cancel-safe: everything read is kept in the reader, so a [`FrameReader::next`] dropped
/// before it returns (a `select!` that took another branch) loses nothing, and the next call
/// goes on where it stopped.
pub(crate) struct FrameReader<R> {
    /// The socket's reading half. Only ever used through `&mut self`, so wrapped to let the
    /// reader be shared by reference (a connection's handlers take `&Client`) although an
    /// upgraded connection is not `Sync`.
    io: SyncWrapper<R>,
    /// Bytes read and not yet taken, from `start`.
    buf: Vec<u8>,
    start: usize,
    /// The frame being read.
    frame: Option<Partial>,
    /// A fragmented data message being joined: its opcode and the payloads so far.
    message: Option<(OpCode, Vec<u8>)>,
    /// Largest frame or message accepted.
    limit: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(io: R, limit: usize) -> Self {
        FrameReader {
            io: SyncWrapper::new(io),
            buf: Vec::new(),
            start: 0,
            frame: None,
            message: None,
            limit,
        }
    }

    /// The next message; `None` when the client closed the connection between frames
    /// without a close frame.
    pub(crate) async fn next(&mut self) -> Result<Option<Incoming>, ReadFailure> {
        loop {
            if self.frame.is_none() {
                match parse_header(&self.buf[self.start..])? {
                    Some((header, used)) => {
                        self.start += used;
                        self.check(&header)?;
                        self.frame = Some(Partial {
                            header,
                            payload: Vec::with_capacity(header.len.min(FIRST_FRAME_ROOM)),
                        });
                    }
                    None => {
                        if self.fill().await? == 0 {
                            return if self.buf.len() == self.start && self.message.is_none() {
                                Ok(None)
                            } else {
                                Err(ReadFailure::Truncated)
                            };
                        }
                        continue;
                    }
                }
            }
            let Some(frame) = self.frame.as_mut() else {
                continue;
            };
            let wanted = frame.header.len - frame.payload.len();
            let buffered = (self.buf.len() - self.start).min(wanted);
            frame
                .payload
                .extend_from_slice(&self.buf[self.start..self.start + buffered]);
            self.start += buffered;
            let wanted = wanted - buffered;
            if wanted > 0 {
                // A large rest goes straight into the frame's own buffer, never past the
                // frame's end; the buffer doubles when full (up to the frame's size).
                let read = if wanted >= READ_BUFFER_BYTES {
                    let payload = &mut frame.payload;
                    if payload.len() == payload.capacity() {
                        // Exact: `reserve` could round up past the frame's end.
                        payload.reserve_exact(wanted.min(payload.len().max(FIRST_FRAME_ROOM)));
                    }
                    let room = payload.capacity() - payload.len();
                    self.io
                        .get_mut()
                        .take(wanted.min(room) as u64)
                        .read_buf(payload)
                        .await?
                } else {
                    self.fill().await?
                };
                if read == 0 {
                    return Err(ReadFailure::Truncated);
                }
                continue;
            }
            let Some(Partial {
                header,
                mut payload,
            }) = self.frame.take()
            else {
                continue;
            };
            unmask(&mut payload, header.mask);
            if let Some(message) = self.complete(header, payload)? {
                if self.start == self.buf.len() {
                    // Nothing left to parse: an idle connection holds no read buffer.
                    self.buf = Vec::new();
                    self.start = 0;
                }
                return Ok(Some(message));
            }
        }
    }

    /// The capacity of the read buffer.
    #[cfg(test)]
    fn buffered_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// The capacity of the buffer of the frame being read.
    #[cfg(test)]
    fn frame_capacity(&self) -> usize {
        self.frame.as_ref().map_or(0, |f| f.payload.capacity())
    }

    /// Refuses a header that breaks the protocol or the size limit.
    fn check(&self, header: &Header) -> Result<(), ReadFailure> {
        let violation = |reason| {
            Err(ReadFailure::Violation {
                code: CLOSE_PROTOCOL,
                reason,
            })
        };
        if header.opcode.is_control() {
            if !header.fin {
                return violation("a control frame must not be fragmented");
            }
            if header.len > 125 {
                return violation("a control frame carries at most 125 bytes");
            }
            return Ok(());
        }
        match (header.opcode, &self.message) {
            (OpCode::Continuation, None) => {
                return violation("a continuation frame without a message to continue");
            }
            (OpCode::Text | OpCode::Binary, Some(_)) => {
                return violation("a new message before the fragmented one ended");
            }
            _ => {}
        }
        let joined = self.message.as_ref().map_or(0, |(_, data)| data.len());
        let size = joined as u64 + header.len as u64;
        if size > self.limit as u64 {
            return Err(ReadFailure::TooLarge {
                size,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// A frame read whole: the message it ends, if any.
    fn complete(
        &mut self,
        header: Header,
        payload: Vec<u8>,
    ) -> Result<Option<Incoming>, ReadFailure> {
        let data = match header.opcode {
            OpCode::Ping => return Ok(Some(Incoming::Ping(Bytes::from(payload)))),
            OpCode::Pong => return Ok(Some(Incoming::Pong)),
            OpCode::Close => return close_frame(&payload).map(|c| Some(Incoming::Close(c))),
            OpCode::Continuation => {
                let Some((opcode, mut data)) = self.message.take() else {
                    return Err(ReadFailure::Violation {
                        code: CLOSE_PROTOCOL,
                        reason: "a continuation frame without a message to continue",
                    });
                };
                data.extend_from_slice(&payload);
                (opcode, data)
            }
            opcode => (opcode, payload),
        };
        if !header.fin {
            self.message = Some(data);
            return Ok(None);
        }
        let (opcode, data) = data;
        if opcode == OpCode::Text && std::str::from_utf8(&data).is_err() {
            return Err(ReadFailure::Violation {
                code: CLOSE_INVALID_DATA,
                reason: "a text message that is not UTF-8",
            });
        }
        let data = Bytes::from(data);
        Ok(Some(match opcode {
            OpCode::Text => Incoming::Text(data),
            _ => Incoming::Binary(data),
        }))
    }

    /// Reads what the socket has into the read buffer (first moving what is left to its
    /// front); the number of bytes read, 0 at the end of the stream.
    async fn fill(&mut self) -> Result<usize, ReadFailure> {
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf
            .reserve(READ_BUFFER_BYTES.saturating_sub(self.buf.len()).max(1));
        // Into the spare capacity only: a `Vec` read into does not grow.
        Ok(self.io.get_mut().read_buf(&mut self.buf).await?)
    }
}

/// A header at the start of `bytes`, with its length in bytes; `None` if more is needed.
fn parse_header(bytes: &[u8]) -> Result<Option<(Header, usize)>, ReadFailure> {
    let [first, second, ..] = *bytes else {
        return Ok(None);
    };
    let violation = |reason| {
        Err(ReadFailure::Violation {
            code: CLOSE_PROTOCOL,
            reason,
        })
    };
    if first & 0x70 != 0 {
        return violation("reserved bits set, and no extension was agreed");
    }
    let Some(opcode) = OpCode::from_bits(first & 0x0f) else {
        return violation("an unknown opcode");
    };
    if second & 0x80 == 0 {
        return violation("a client's frame must be masked");
    }
    let (len, at) = match second & 0x7f {
        126 => match bytes.get(2..4) {
            Some(&[a, b]) => (u64::from(u16::from_be_bytes([a, b])), 4),
            _ => return Ok(None),
        },
        127 => match bytes.get(2..10).map(<[u8; 8]>::try_from) {
            Some(Ok(len)) => (u64::from_be_bytes(len), 10),
            _ => return Ok(None),
        },
        len => (u64::from(len), 2),
    };
    let Some(&[a, b, c, d]) = bytes.get(at..at + 4) else {
        return Ok(None);
    };
    let Ok(len) = usize::try_from(len) else {
        return Err(ReadFailure::TooLarge {
            size: len,
            limit: usize::MAX,
        });
    };
    let header = Header {
        fin: first & 0x80 != 0,
        opcode,
        mask: [a, b, c, d],
        len,
    };
    Ok(Some((header, at + 4)))
}

/// A close frame's status code and reason.
fn close_frame(payload: &[u8]) -> Result<Option<(u16, String)>, ReadFailure> {
    match payload {
        [] => Ok(None),
        [_] => Err(ReadFailure::Violation {
            code: CLOSE_PROTOCOL,
            reason: "a close frame with a one-byte body",
        }),
        [a, b, reason @ ..] => match std::str::from_utf8(reason) {
            Ok(reason) => {
                let code = u16::from_be_bytes([*a, *b]);
                // The codes an endpoint may send (RFC 6455, section 7.4; 1005, 1006 and 1015
                // only stand for what happened, and the others below 3000 are unassigned).
                if !matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999) {
                    return Err(ReadFailure::Violation {
                        code: CLOSE_PROTOCOL,
                        reason: "a close code an endpoint may not send",
                    });
                }
                Ok(Some((code, reason.to_owned())))
            }
            Err(_) => Err(ReadFailure::Violation {
                code: CLOSE_INVALID_DATA,
                reason: "a close reason that is not UTF-8",
            }),
        },
    }
}

/// Removes the client's mask (RFC 6455, section 5.3), eight bytes at a time.
fn unmask(payload: &mut [u8], mask: [u8; 4]) {
    let [a, b, c, d] = mask;
    let wide = [a, b, c, d, a, b, c, d];
    let mut chunks = payload.chunks_exact_mut(8);
    for chunk in &mut chunks {
        for (byte, m) in chunk.iter_mut().zip(wide) {
            *byte ^= m;
        }
    }
    // The rest starts at a multiple of 8, so at the mask's first byte.
    for (byte, m) in chunks.into_remainder().iter_mut().zip(wide) {
        *byte ^= m;
    }
}

/// Appends a server frame's header (unmasked) for a payload of `len` bytes.
fn push_header(out: &mut Vec<u8>, fin: bool, opcode: OpCode, len: usize) {
    out.push(if fin { 0x80 } else { 0 } | opcode.bits());
    if len < 126 {
        out.push(len as u8);
    } else if let Ok(len) = u16::try_from(len) {
        out.push(126);
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
}

/// A payload at most this large is copied beside its header into the write buffer (so that
/// frames queued together go in one write); a larger one is written from its own bytes.
const COPIED_PAYLOAD_BYTES: usize = 16 * 1024;

/// A larger message is sent in fragments of this size (RFC 6455, section 5.4), which every
/// client joins into the one message. Python's `websockets` (UFO's clients) receives a 90 MiB
/// message some 0.1 s sooner so than as one frame.
pub(crate) const FRAGMENT_BYTES: usize = 256 * 1024;

/// Frames added are written once they reach this size, or at the next flush.
const WRITE_BUFFER_BYTES: usize = 16 * 1024;

/// Writes server frames; frames added between two [`FrameWriter::flush`]es go out together.
pub(crate) struct FrameWriter<W> {
    io: W,
    out: Vec<u8>,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(crate) fn new(io: W) -> Self {
        FrameWriter {
            io,
            out: Vec::new(),
        }
    }

    /// Adds a message as one frame. A large payload is written at once, from its own bytes,
    /// after what was added before it, in fragments of [`FRAGMENT_BYTES`].
    pub(crate) async fn frame(&mut self, opcode: OpCode, payload: &[u8]) -> std::io::Result<()> {
        if payload.len() <= COPIED_PAYLOAD_BYTES {
            push_header(&mut self.out, true, opcode, payload.len());
            self.out.extend_from_slice(payload);
            if self.out.len() >= WRITE_BUFFER_BYTES {
                self.io.write_all(&self.out).await?;
                self.out.clear();
            }
            return Ok(());
        }
        let mut fragments = payload.chunks(FRAGMENT_BYTES).peekable();
        let mut opcode = opcode;
        while let Some(fragment) = fragments.next() {
            push_header(
                &mut self.out,
                fragments.peek().is_none(),
                opcode,
                fragment.len(),
            );
            self.io.write_all(&self.out).await?;
            self.out.clear();
            self.io.write_all(fragment).await?;
            opcode = OpCode::Continuation;
        }
        Ok(())
    }

    /// Adds a close frame with `code` and `reason` (cut to what fits in a control frame), or
    /// none.
    pub(crate) async fn close(&mut self, close: Option<(u16, &str)>) -> std::io::Result<()> {
        let mut body = Vec::new();
        if let Some((code, reason)) = close {
            body.extend_from_slice(&code.to_be_bytes());
            let mut end = reason.len().min(123);
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            body.extend_from_slice(&reason.as_bytes()[..end]);
        }
        self.frame(OpCode::Close, &body).await
    }

    /// Writes what was added; a write buffer grown by a burst goes back to nothing.
    pub(crate) async fn flush(&mut self) -> std::io::Result<()> {
        self.io.write_all(&self.out).await?;
        self.out.clear();
        if self.out.capacity() > 2 * WRITE_BUFFER_BYTES {
            self.out = Vec::new();
        }
        self.io.flush().await
    }

    /// Flushes, then ends the sending side of the connection.
    pub(crate) async fn shutdown(&mut self) -> std::io::Result<()> {
        self.flush().await?;
        self.io.shutdown().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode as WsOpCode};
    use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};

    const LIMIT: usize = 8 << 20;

    /// A client (another WebSocket implementation) and a reader of what it sends.
    async fn client_and_reader() -> (
        WebSocketStream<tokio::io::DuplexStream>,
        FrameReader<tokio::io::DuplexStream>,
    ) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        (client, FrameReader::new(server, LIMIT))
    }

    /// A masked client frame, built by hand.
    fn raw_frame(first: u8, payload: &[u8]) -> Vec<u8> {
        let mask = [1, 2, 3, 4];
        let mut out = vec![first];
        match payload.len() {
            len @ 0..=125 => out.push(0x80 | len as u8),
            len @ 126..=0xFFFF => {
                out.push(0x80 | 126);
                out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            len => {
                out.push(0x80 | 127);
                out.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(&mask);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        out
    }

    #[tokio::test]
    async fn messages_from_a_client_are_read_whole() {
        let (mut client, mut reader) = client_and_reader().await;
        let large = "\u{e9}x".repeat(1 << 20);
        let sending = tokio::spawn(async move {
            let fragment = |payload: &'static str, opcode, fin| {
                Message::Frame(Frame::message(payload, opcode, fin))
            };
            let messages = [
                Message::text("small"),
                Message::text(large.clone()),
                Message::binary(vec![0u8, 1, 2]),
                Message::Ping(Bytes::from_static(b"hi")),
                // A fragmented message, with a ping between its fragments.
                fragment("frag", WsOpCode::Data(Data::Text), false),
                fragment("men", WsOpCode::Data(Data::Continue), false),
                Message::Ping(Bytes::from_static(b"mid")),
                fragment("ted", WsOpCode::Data(Data::Continue), true),
                Message::Close(Some(CloseFrame {
                    code: 1000.into(),
                    reason: "bye".into(),
                })),
            ];
            for message in messages {
                client.send(message).await.expect("sent");
            }
            (client, large)
        });
        let mut got = Vec::new();
        for _ in 0..7 {
            got.push(reader.next().await.expect("read").expect("a message"));
            // A large frame is read into a buffer of its own and handed over: the read
            // buffer never grows past its size.
            assert!(
                reader.buffered_capacity() <= READ_BUFFER_BYTES,
                "read buffer of {} bytes after {:?}",
                reader.buffered_capacity(),
                got.last().map(std::mem::discriminant)
            );
        }
        let (_client, large) = sending.await.expect("client");
        assert_eq!(
            got,
            [
                Incoming::Text(Bytes::from_static(b"small")),
                Incoming::Text(Bytes::from(large)),
                Incoming::Binary(Bytes::from_static(&[0, 1, 2])),
                Incoming::Ping(Bytes::from_static(b"hi")),
                Incoming::Ping(Bytes::from_static(b"mid")),
                Incoming::Text(Bytes::from_static(b"fragmented")),
                Incoming::Close(Some((1000, "bye".to_owned()))),
            ]
        );
        // Everything read: the reader holds no buffer while the connection is idle.
        assert_eq!(reader.buffered_capacity(), 0);
    }

    #[tokio::test]
    async fn a_read_cancelled_midway_loses_nothing() {
        let (mut wire, server) = tokio::io::duplex(64 * 1024);
        let mut reader = FrameReader::new(server, LIMIT);
        let text = "y".repeat(40_000);
        let frame = raw_frame(0x81, text.as_bytes());
        // Header and part of the payload, then a read given up (as a select! would).
        wire.write_all(&frame[..10_000]).await.expect("written");
        let gave_up =
            tokio::time::timeout(std::time::Duration::from_millis(50), reader.next()).await;
        assert!(gave_up.is_err(), "the frame is not complete yet");
        wire.write_all(&frame[10_000..]).await.expect("written");
        assert_eq!(
            reader.next().await.expect("read"),
            Some(Incoming::Text(Bytes::from(text)))
        );
        drop(wire);
        assert_eq!(reader.next().await.expect("clean end"), None);
    }

    #[tokio::test]
    async fn a_frame_buffer_grows_with_the_bytes_that_arrive() {
        let (mut wire, server) = tokio::io::duplex(64 * 1024);
        let mut reader = FrameReader::new(server, LIMIT);
        let text = "z".repeat(LIMIT - 1);
        let frame = raw_frame(0x81, text.as_bytes());
        // A header announcing nearly the limit, and a few bytes: little is set aside.
        wire.write_all(&frame[..1000]).await.expect("written");
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(50), reader.next()).await;
        assert!(waiting.is_err(), "the frame is not complete yet");
        assert!(
            (1..=FIRST_FRAME_ROOM).contains(&reader.frame_capacity()),
            "{} bytes set aside for a frame of which 1000 bytes came",
            reader.frame_capacity()
        );
        // All but the last byte comes: the buffer grows, never past the frame's size.
        let last = frame.len() - 1;
        let sending = tokio::spawn(async move {
            wire.write_all(&frame[1000..last]).await.expect("written");
            (wire, frame)
        });
        while !sending.is_finished() {
            let waiting =
                tokio::time::timeout(std::time::Duration::from_millis(5), reader.next()).await;
            assert!(waiting.is_err(), "the frame is not complete yet");
            assert!(
                reader.frame_capacity() < LIMIT,
                "{}",
                reader.frame_capacity()
            );
        }
        let (mut wire, frame) = sending.await.expect("sender");
        // The last byte: the frame is read whole.
        let (read, written) = tokio::join!(reader.next(), wire.write_all(&frame[last..]));
        written.expect("written");
        assert_eq!(read.expect("read"), Some(Incoming::Text(Bytes::from(text))));
    }

    #[tokio::test]
    async fn protocol_violations_and_oversized_frames_are_refused() {
        let unmasked = {
            let mut frame = raw_frame(0x81, b"hi");
            frame[1] &= 0x7f;
            frame
        };
        let oversized_ping = raw_frame(0x89, &[0; 126]);
        let cases: [(&str, Vec<u8>, u16); 7] = [
            ("unmasked", unmasked, CLOSE_PROTOCOL),
            (
                "close code 1005",
                raw_frame(0x88, &1005u16.to_be_bytes()),
                CLOSE_PROTOCOL,
            ),
            ("reserved bit", raw_frame(0xC1, b"hi"), CLOSE_PROTOCOL),
            ("unknown opcode", raw_frame(0x83, b"hi"), CLOSE_PROTOCOL),
            ("lone continuation", raw_frame(0x80, b"hi"), CLOSE_PROTOCOL),
            ("long ping", oversized_ping, CLOSE_PROTOCOL),
            (
                "not UTF-8",
                raw_frame(0x81, &[0xff, 0xfe]),
                CLOSE_INVALID_DATA,
            ),
        ];
        for (what, bytes, expected) in cases {
            let (mut wire, server) = tokio::io::duplex(64 * 1024);
            let mut reader = FrameReader::new(server, LIMIT);
            wire.write_all(&bytes).await.expect("written");
            match reader.next().await {
                Err(ReadFailure::Violation { code, .. }) => assert_eq!(code, expected, "{what}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        // Over the limit: refused from the header, before the payload is read; and fragments
        // that together go over it.
        let header_only = raw_frame(0x81, &[b'a'; 200])[..8].to_vec();
        let fragments = [raw_frame(0x01, &[b'a'; 60]), raw_frame(0x80, &[b'a'; 60])].concat();
        for (bytes, size) in [(header_only, 200), (fragments, 120)] {
            let (mut wire, server) = tokio::io::duplex(64 * 1024);
            let mut reader = FrameReader::new(server, 100);
            wire.write_all(&bytes).await.expect("written");
            match reader.next().await {
                Err(ReadFailure::TooLarge { size: got, limit }) => {
                    assert_eq!((got, limit), (size, 100));
                }
                other => panic!("{size} bytes: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn frames_written_are_read_by_a_client() {
        let (server, client) = tokio::io::duplex(64 * 1024);
        let mut client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        let large = "z".repeat(3 << 20);
        let expected = large.clone();
        let writing = tokio::spawn(async move {
            let mut writer = FrameWriter::new(server);
            writer.frame(OpCode::Text, b"one").await.expect("added");
            writer
                .frame(OpCode::Text, large.as_bytes())
                .await
                .expect("added");
            writer.frame(OpCode::Ping, b"").await.expect("added");
            writer
                .frame(OpCode::Text, &[b'm'; 300])
                .await
                .expect("added");
            let reason = "\u{e9}".repeat(100);
            writer.close(Some((1008, &reason))).await.expect("added");
            writer.shutdown().await.expect("written");
            // Kept open for the client's answers to the ping and the close.
            writer
        });
        let mut texts = Vec::new();
        let mut close = None;
        while let Some(message) = client.next().await {
            match message.expect("a valid frame") {
                Message::Text(text) => texts.push(text.to_string()),
                Message::Close(frame) => close = frame,
                _ => {}
            }
        }
        drop(writing.await.expect("writer"));
        assert_eq!(texts, ["one".to_owned(), expected, "m".repeat(300)]);
        let close = close.expect("a close frame");
        assert_eq!(u16::from(close.code), 1008);
        // Cut at a character boundary to fit in a control frame.
        assert_eq!(close.reason.as_str(), "\u{e9}".repeat(61));
    }

    #[tokio::test]
    async fn a_large_message_goes_in_fragments() {
        let mut wire = Vec::new();
        let mut writer = FrameWriter::new(&mut wire);
        let text = vec![b'q'; 2 * FRAGMENT_BYTES + 10];
        writer.frame(OpCode::Text, &text).await.expect("written");
        writer.flush().await.expect("flushed");
        // (FIN, opcode, payload length) of each frame on the wire.
        let mut shape = Vec::new();
        let mut rest = &wire[..];
        while let [first, second, tail @ ..] = rest {
            let (len, tail) = match second & 0x7f {
                126 => (
                    usize::from(u16::from_be_bytes([tail[0], tail[1]])),
                    &tail[2..],
                ),
                127 => {
                    let len: [u8; 8] = tail[..8].try_into().expect("8 bytes");
                    (u64::from_be_bytes(len) as usize, &tail[8..])
                }
                len => (usize::from(len), tail),
            };
            shape.push((first & 0x80 != 0, first & 0x0f, len));
            rest = &tail[len..];
        }
        assert_eq!(
            shape,
            [
                (false, 0x1, FRAGMENT_BYTES),
                (false, 0x0, FRAGMENT_BYTES),
                (true, 0x0, 10)
            ]
        );
    }
}
