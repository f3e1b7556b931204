//! The socket of one client, as typed AIP frames.
//!
//! Reading yields client frames parsed and checked by proto-schemas (and the few WebSocket
//! messages the gateway must notice). Writing puts server frames on a bounded outbound queue
//! that a writer task drains into the socket, one flush for all frames queued at once, so a
//! handler never waits on a slow client: a client that lets the queue fill up is closed.
//! Nothing here knows what a frame means; that is for [`crate::handlers`].

use std::time::Duration;

use bytes::Bytes;
use flume::TrySendError;
use futures::stream::SplitStream;
use futures::{SinkExt, StreamExt};
use proto_schemas::{ClientMessage, FrameError, ServerMessage, parse_client_frame};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::error::CapacityError;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use crate::rate::ByteRate;
use crate::upgrade::Socket;

/// The upgrade handler in `lib.rs` hands each socket to this.
pub use crate::client::serve;

/// WebSocket close codes used by the gateway.
pub mod close {
    /// Normal closure (after a refused registration, as UFO does).
    pub const NORMAL: u16 = 1000;
    /// Going away: the gateway shuts down; reconnect elsewhere.
    pub const GOING_AWAY: u16 = 1001;
    /// Protocol error: the first frame is not a valid REGISTER.
    pub const PROTOCOL: u16 = 1002;
    /// Policy violation: identity, slow consumer, rate.
    pub const POLICY: u16 = 1008;
    /// A frame over the size limit.
    pub const TOO_BIG: u16 = 1009;
    /// Internal error or a dependency unavailable; try again later.
    pub const TRY_AGAIN: u16 = 1013;
}

/// How long a close may wait for room in a full outbound queue: long enough for the writer
/// to drain a burst into a socket that still moves, short enough that a client that stopped
/// reading does not hold the connection.
const CLOSE_QUEUE_WAIT: Duration = Duration::from_secs(1);

/// How long an ended connection may take to finish the closing handshake.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long the socket is held after the close when part of an oversized frame is still
/// unread: dropping it then resets the connection, and a reset overtakes the ERROR and close
/// frames still on their way to the client.
const UNREAD_INPUT_HOLD: Duration = Duration::from_millis(500);

/// A message larger than this is sent in fragments of this size (RFC 6455, section 5.4),
/// which the client joins into the one message. Whole, it would be copied into the WebSocket
/// library's write buffer at once and shifted forward after each partial write to the socket
/// (time quadratic in its size), and the buffer would keep its size for the rest of the
/// connection.
pub(crate) const FRAGMENT_BYTES: usize = 256 * 1024;

/// What the client sent, as far as the gateway cares.
pub(crate) enum Inbound {
    /// A text frame, parsed and checked (or why it is not a valid AIP frame). Boxed: a
    /// client frame is large, and an idle connection should not hold room for one.
    Frame {
        frame: Result<Box<ClientMessage>, FrameError>,
        /// Its size on the wire, for the budget of inbound bytes in flight.
        bytes: usize,
    },
    /// AIP frames are JSON text; a binary frame is answered with an error.
    Binary,
    /// The WebSocket layer answers pings itself; a ping or pong is a sign of life only.
    Control,
}

/// Why reading stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    /// The client sent more than the configured frame size.
    #[error("frame larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    /// The socket failed (reset, protocol violation at the WebSocket level).
    #[error("read failed: {0}")]
    Failed(String),
}

/// Why a frame could not be queued for the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    /// The client does not read fast enough; the connection has been asked to close.
    #[error("outbound queue full ({capacity} frames): the client does not read fast enough")]
    QueueFull { capacity: usize },
    /// The writer stopped because the socket failed or closed.
    #[error("the socket is closed: a write failed")]
    Closed,
}

/// What the writer task is asked to write.
enum Outbound {
    Frame(Utf8Bytes),
    Ping,
    Close(u16, String),
}

/// Reads and writes the frames of one WebSocket.
pub(crate) struct Connection {
    stream: SplitStream<Socket>,
    /// The outbound queue. A flume channel: it allocates room for frames only while they
    /// wait, where Tokio's allocates a block of 32 slots per channel up front (1.3 KiB of
    /// every idle connection's memory).
    out: flume::Sender<Outbound>,
    writer: JoinHandle<()>,
    /// For the error answering a frame over the limit.
    max_frame_bytes: usize,
    /// Set when the rest of an oversized frame is left unread (the socket cannot be drained),
    /// so that the close is given time to arrive.
    input_left_unread: bool,
    /// Bytes per second read from the socket: reading pauses while over it.
    byte_rate: ByteRate,
}

impl Connection {
    /// Starts the writer task; at most `queue` frames wait for it; reads at most
    /// `bytes_per_second` on average (0: no limit).
    pub(crate) fn new(
        socket: Socket,
        queue: usize,
        max_frame_bytes: usize,
        bytes_per_second: u64,
    ) -> Self {
        let (sink, stream) = socket.split();
        let (out, queued) = flume::bounded(queue);
        Connection {
            stream,
            out,
            writer: tokio::spawn(write_queued(sink, queued)),
            max_frame_bytes,
            input_left_unread: false,
            byte_rate: ByteRate::new(bytes_per_second),
        }
    }

    /// The next thing the client sent; `None` once it closed the connection. While the
    /// client is over its byte rate, this first waits (reading nothing) until it is back
    /// under. Cancel-safe: dropped before it returns, nothing has been read.
    pub(crate) async fn read(&mut self) -> Result<Option<Inbound>, ReadError> {
        if let Some(until) = self.byte_rate.paused_until() {
            tokio::time::sleep_until(until).await;
        }
        let message = match self.stream.next().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(self.read_error(e)),
            Some(Ok(message)) => message,
        };
        let bytes = match &message {
            Message::Text(text) => text.len(),
            Message::Binary(data) | Message::Ping(data) | Message::Pong(data) => data.len(),
            Message::Close(_) | Message::Frame(_) => 0,
        };
        if self.byte_rate.charge(bytes) {
            metrics::counter!("aip_gateway_reads_paused_total", "reason" => "byte_rate")
                .increment(1);
        }
        Ok(match message {
            Message::Text(text) => {
                let started = std::time::Instant::now();
                let frame = parse_client_frame(text.as_bytes()).map(Box::new);
                if bytes >= crate::client::LARGE_FRAME_BYTES {
                    tracing::debug!(
                        bytes,
                        parse_us = started.elapsed().as_micros() as u64,
                        "large frame read"
                    );
                }
                Some(Inbound::Frame { frame, bytes })
            }
            Message::Binary(_) => Some(Inbound::Binary),
            Message::Close(_) => None,
            // Reading never yields a raw frame.
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => Some(Inbound::Control),
        })
    }

    /// Whether reading is paused because the client is over its byte rate: it is not
    /// silent then, the gateway is not listening.
    pub(crate) fn reading_paused(&self) -> bool {
        self.byte_rate.paused_until().is_some()
    }

    fn read_error(&mut self, e: WsError) -> ReadError {
        match e {
            WsError::Capacity(CapacityError::MessageTooLong { .. }) => {
                self.input_left_unread = true;
                ReadError::TooLarge {
                    limit: self.max_frame_bytes,
                }
            }
            e => ReadError::Failed(e.to_string()),
        }
    }

    /// Queues a frame for the client. A frame that cannot be serialised (a bug) is logged
    /// and not sent; the connection goes on.
    pub(crate) fn write(&self, frame: &ServerMessage) -> Result<(), WriteError> {
        metrics::counter!("aip_gateway_frames_sent_total", "type" => frame.kind.as_str())
            .increment(1);
        if let Some(code) = frame
            .metadata
            .as_ref()
            .and_then(|m| m.get("error_code"))
            .and_then(serde_json::Value::as_str)
        {
            metrics::counter!("aip_gateway_errors_total", "code" => code.to_owned()).increment(1);
        }
        match serde_json::to_string(frame) {
            Ok(text) => self.write_text(text),
            Err(e) => {
                tracing::error!(kind = %frame.kind, "server frame not serialisable; not sent: {e}");
                Ok(())
            }
        }
    }

    /// Queues a frame already serialised (a delivery, a prepared reply).
    pub(crate) fn write_text(&self, text: String) -> Result<(), WriteError> {
        self.write_utf8(Utf8Bytes::from(text))
    }

    /// Queues a frame already serialised, as the bytes it is in (a body read back).
    pub(crate) fn write_utf8(&self, text: Utf8Bytes) -> Result<(), WriteError> {
        self.queue(Outbound::Frame(text))
    }

    /// Queues a ping; the client's pong shows it still reads.
    pub(crate) fn ping(&self) -> Result<(), WriteError> {
        self.queue(Outbound::Ping)
    }

    fn queue(&self, item: Outbound) -> Result<(), WriteError> {
        match self.out.try_send(item) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.close(close::POLICY, "too slow: outbound queue full");
                Err(WriteError::QueueFull {
                    capacity: self.out.capacity().unwrap_or_default(),
                })
            }
            Err(TrySendError::Disconnected(_)) => Err(WriteError::Closed),
        }
    }

    /// Queues the close frame. It must get through even when the queue is full, so it waits
    /// (in its own task) up to [`CLOSE_QUEUE_WAIT`] for room.
    pub(crate) fn close(&self, code: u16, reason: &str) {
        let out = self.out.clone();
        let reason = reason.to_owned();
        tokio::spawn(async move {
            let queued = tokio::time::timeout(
                CLOSE_QUEUE_WAIT,
                out.send_async(Outbound::Close(code, reason)),
            )
            .await;
            if !matches!(queued, Ok(Ok(()))) {
                tracing::debug!(code, "close frame not queued: the socket is gone or full");
            }
        });
    }

    /// The last frame before closing: the ERROR saying why. If it cannot be queued, the
    /// connection ends anyway (a full queue has already asked for the close).
    pub(crate) fn write_last(&self, frame: &ServerMessage, code: u16, reason: &str) {
        match self.write(frame) {
            Ok(()) => self.close(code, reason),
            Err(e) => tracing::debug!("last frame before closing not sent: {e}"),
        }
    }

    /// The closing handshake: reads (and discards) until the client answers the close frame
    /// or goes away, while the writer sends what is queued and the close. Dropping the
    /// socket with unread input would reset the connection and lose the last frames (the
    /// ERROR saying why); a client that does not finish within [`CLOSE_GRACE`] (one that
    /// stopped reading, say) is dropped anyway, so it cannot keep its connection slot.
    /// Without `await_answer` (the gateway shuts down) the close is sent but not awaited.
    pub(crate) async fn finish(self, await_answer: bool) {
        let Connection {
            mut stream,
            out,
            mut writer,
            input_left_unread,
            ..
        } = self;
        // The writer ends once the queue is empty and every sender is gone.
        drop(out);
        let drain = async {
            if !await_answer {
                return;
            }
            while let Some(Ok(message)) = stream.next().await {
                if let Message::Close(_) = message {
                    break;
                }
            }
        };
        if tokio::time::timeout(CLOSE_GRACE, futures::future::join(drain, &mut writer))
            .await
            .is_err()
        {
            writer.abort();
        } else if input_left_unread {
            tokio::time::sleep(UNREAD_INPUT_HOLD).await;
        }
    }
}

/// The writer task: writes what is queued, one flush (one write to the socket) for all
/// frames queued at once, until a close is written, the socket fails or the queue closes.
async fn write_queued<S>(mut sink: S, queued: flume::Receiver<Outbound>)
where
    S: futures::Sink<Message, Error = WsError> + Unpin,
{
    'queue: while let Ok(first) = queued.recv_async().await {
        let mut next = Some(first);
        while let Some(item) = next {
            let fed = match item {
                Outbound::Frame(text) if text.len() > FRAGMENT_BYTES => {
                    feed_fragments(&mut sink, Bytes::from(text)).await
                }
                Outbound::Frame(text) => sink.feed(Message::Text(text)).await,
                Outbound::Ping => sink.feed(Message::Ping(Bytes::new())).await,
                Outbound::Close(code, reason) => {
                    let frame = CloseFrame {
                        code: code.into(),
                        reason: Utf8Bytes::from(reason),
                    };
                    if let Err(e) = sink.send(Message::Close(Some(frame))).await {
                        tracing::debug!("close frame not written: {e}");
                    }
                    break 'queue;
                }
            };
            if let Err(e) = fed {
                tracing::debug!("write to the socket failed: {e}");
                break 'queue;
            }
            next = queued.try_recv().ok();
        }
        if let Err(e) = sink.flush().await {
            tracing::debug!("write to the socket failed: {e}");
            break;
        }
    }
    if let Err(e) = sink.close().await {
        tracing::debug!("socket not closed cleanly: {e}");
    }
}

/// Feeds a text message as fragments of [`FRAGMENT_BYTES`] (slices of it, not copies): a text
/// frame, then continuation frames, the last one final. A fragment may end inside a UTF-8
/// sequence; the client checks the text once joined.
async fn feed_fragments<S>(sink: &mut S, text: Bytes) -> Result<(), WsError>
where
    S: futures::Sink<Message, Error = WsError> + Unpin,
{
    let mut start = 0;
    while start < text.len() {
        let end = text.len().min(start + FRAGMENT_BYTES);
        let opcode = match start {
            0 => OpCode::Data(Data::Text),
            _ => OpCode::Data(Data::Continue),
        };
        let fragment = Frame::message(text.slice(start..end), opcode, end == text.len());
        sink.feed(Message::Frame(fragment)).await?;
        start = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::protocol::Role;

    /// The frames in a server's bytes: (FIN, opcode, payload) each.
    fn frames(mut bytes: &[u8]) -> Vec<(bool, u8, Vec<u8>)> {
        let mut frames = Vec::new();
        while !bytes.is_empty() {
            let (fin, opcode) = (bytes[0] & 0x80 != 0, bytes[0] & 0x0f);
            assert_eq!(bytes[1] & 0x80, 0, "a server's frames are not masked");
            let (len, header) = match bytes[1] & 0x7f {
                126 => (u16::from_be_bytes([bytes[2], bytes[3]]) as usize, 4),
                127 => {
                    let len: [u8; 8] = bytes[2..10].try_into().expect("8 bytes");
                    (u64::from_be_bytes(len) as usize, 10)
                }
                len => (len as usize, 2),
            };
            frames.push((fin, opcode, bytes[header..header + len].to_vec()));
            bytes = &bytes[header + len..];
        }
        frames
    }

    #[tokio::test]
    async fn a_large_message_is_written_in_fragments_that_a_client_joins_whole() {
        // Larger than two fragments, with a two-byte character across the first boundary.
        let mut text = "a".repeat(FRAGMENT_BYTES - 1);
        text.push('\u{e9}');
        text.push_str(&"b".repeat(FRAGMENT_BYTES + 10));
        let small = r#"{"type":"heartbeat"}"#;

        let (server, mut wire) = tokio::io::duplex(64 * 1024);
        let socket = WebSocketStream::from_raw_socket(server, Role::Server, None).await;
        let (queue, queued) = flume::bounded(8);
        let writer = tokio::spawn(write_queued(socket, queued));
        queue
            .send(Outbound::Frame(Utf8Bytes::from(text.clone())))
            .expect("queued");
        queue
            .send(Outbound::Frame(Utf8Bytes::from(small)))
            .expect("queued");
        drop(queue);
        let mut bytes = Vec::new();
        wire.read_to_end(&mut bytes).await.expect("read");
        writer.await.expect("the writer ends");

        let written = frames(&bytes);
        let shape: Vec<(bool, u8, usize)> = written
            .iter()
            .map(|(fin, opcode, payload)| (*fin, *opcode, payload.len()))
            .collect();
        assert_eq!(
            shape[..4],
            [
                (false, 1, FRAGMENT_BYTES),
                (false, 0, FRAGMENT_BYTES),
                (true, 0, text.len() - 2 * FRAGMENT_BYTES),
                // A small message is one frame, as before.
                (true, 1, small.len()),
            ]
        );
        assert_eq!(shape[4].1, 8, "then the close");

        // A client reads the fragments as the one message, then the small one.
        let (client, mut server_side) = tokio::io::duplex(64 * 1024);
        let mut reader = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        let feeding = tokio::spawn(async move {
            server_side.write_all(&bytes).await.expect("written");
            server_side
        });
        for expected in [text.as_str(), small] {
            match reader.next().await {
                Some(Ok(Message::Text(got))) => assert!(got.as_str() == expected),
                other => panic!("not the text message: {other:?}"),
            }
        }
        drop(feeding.await);
    }
}
