//! The socket of one client, as typed AIP frames.
//!
//! Reading yields client frames parsed and checked by proto-schemas (and the few WebSocket
//! messages the gateway must notice). Writing puts server frames on an outbound queue, bounded
//! in frames and in bytes, that a writer task drains into the socket, one flush for all frames
//! queued at once, so a handler never waits on a slow client: a client that lets the queue
//! fill up is closed.
//! Nothing here knows what a frame means; that is for [`crate::handlers`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use flume::TrySendError;
use proto_schemas::{ClientMessage, FrameError, ServerMessage, parse_client_frame};
use tokio::io::{AsyncWrite, ReadHalf};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Utf8Bytes;

use crate::outbound::{Charge, OutboundBudget, QueueBytes, Refused};
use crate::rate::ByteRate;
use crate::upgrade::Socket;
use crate::websocket::{FrameReader, FrameWriter, Incoming, OpCode, ReadFailure};

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
    /// A ping (answered here) or a pong: a sign of life only.
    Control,
}

/// Why reading stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    /// The client sent more than the configured frame size.
    #[error("frame larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    /// The client broke the WebSocket protocol; `code` is the close code that says so.
    #[error("WebSocket protocol violation: {reason}")]
    Violation { code: u16, reason: &'static str },
    /// The socket failed or ended inside a frame.
    #[error("read failed: {0}")]
    Failed(String),
}

/// Why a frame could not be queued for the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    /// The client does not read fast enough; the connection has been asked to close.
    #[error("outbound queue full ({capacity} frames): the client does not read fast enough")]
    QueueFull { capacity: usize },
    /// The frames waiting for the client would pass the queue's byte limit; the connection
    /// has been asked to close.
    #[error(
        "outbound queue full ({queued} bytes waiting, {limit} at most): the client does not read fast enough"
    )]
    QueueBytesFull { queued: usize, limit: usize },
    /// The frames waiting for all clients of the gateway would pass its budget, and this
    /// client has frames waiting; the connection has been asked to close.
    #[error(
        "the gateway's outbound budget is spent ({queued} bytes waiting for all clients, {limit} at most) and this client does not read fast enough"
    )]
    GatewayQueueFull { queued: usize, limit: usize },
    /// The writer stopped because the socket failed or closed.
    #[error("the socket is closed: a write failed")]
    Closed,
}

/// What the writer task is asked to write.
enum Outbound {
    /// A frame, with its bytes counted until it is written or dropped.
    Frame(Utf8Bytes, Charge),
    Ping,
    Pong(Bytes),
    /// The close frame, with its code and reason (none: an empty close frame).
    Close(Option<(u16, String)>),
}

/// How much may wait in a connection's outbound queue.
#[derive(Debug, Clone)]
pub(crate) struct OutboundLimits {
    /// Frames (and control messages).
    pub(crate) frames: usize,
    /// Bytes of frames; a frame larger than this passes when nothing else waits.
    pub(crate) bytes: usize,
    /// The gateway's budget of bytes waiting for all clients.
    pub(crate) gateway: Arc<OutboundBudget>,
}

/// Reads and writes the frames of one WebSocket.
pub(crate) struct Connection {
    reader: FrameReader<ReadHalf<Socket>>,
    /// The outbound queue. A flume channel: it allocates room for frames only while they
    /// wait, where Tokio's allocates a block of 32 slots per channel up front (1.3 KiB of
    /// every idle connection's memory).
    out: flume::Sender<Outbound>,
    /// Bytes of the frames in `out` (and the one being written), for this connection's
    /// bound and the gateway's.
    queued_bytes: Arc<QueueBytes>,
    /// Set once the connection is closed for not reading what it is sent.
    closed_as_slow: AtomicBool,
    writer: JoinHandle<()>,
    /// For the error answering a frame over the limit.
    max_frame_bytes: usize,
    /// Set when the rest of an oversized frame is left unread (the socket cannot be drained),
    /// so that the close is given time to arrive.
    input_left_unread: bool,
    /// Set once the client's close frame is read (and answered).
    peer_closed: bool,
    /// Bytes per second read from the socket: reading pauses while over it.
    byte_rate: ByteRate,
}

impl Connection {
    /// Starts the writer task; at most `queue` waits for it; reads at most
    /// `bytes_per_second` on average (0: no limit).
    pub(crate) fn new(
        socket: Socket,
        queue: OutboundLimits,
        max_frame_bytes: usize,
        bytes_per_second: u64,
    ) -> Self {
        let (read, write) = tokio::io::split(socket);
        let (out, queued) = flume::bounded(queue.frames);
        Connection {
            reader: FrameReader::new(read, max_frame_bytes),
            out,
            writer: tokio::spawn(write_queued(write, queued)),
            queued_bytes: QueueBytes::new(queue.bytes, queue.gateway),
            closed_as_slow: AtomicBool::new(false),
            max_frame_bytes,
            input_left_unread: false,
            peer_closed: false,
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
        let message = match self.reader.next().await {
            Ok(None) => return Ok(None),
            Err(e) => return Err(self.read_error(e)),
            Ok(Some(message)) => message,
        };
        let bytes = match &message {
            Incoming::Text(data) | Incoming::Binary(data) | Incoming::Ping(data) => data.len(),
            Incoming::Pong | Incoming::Close(_) => 0,
        };
        if self.byte_rate.charge(bytes) {
            metrics::counter!("aip_gateway_reads_paused_total", "reason" => "byte_rate")
                .increment(1);
        }
        Ok(match message {
            Incoming::Text(text) => {
                let started = std::time::Instant::now();
                let frame = parse_client_frame(&text).map(Box::new);
                if bytes >= crate::client::LARGE_FRAME_BYTES {
                    tracing::debug!(
                        bytes,
                        parse_us = started.elapsed().as_micros() as u64,
                        "large frame read"
                    );
                }
                Some(Inbound::Frame { frame, bytes })
            }
            Incoming::Binary(_) => Some(Inbound::Binary),
            Incoming::Ping(payload) => {
                // A pong that finds the queue full is dropped: a client that does not read
                // what it is sent gains nothing from one more.
                let _ = self.out.try_send(Outbound::Pong(payload));
                Some(Inbound::Control)
            }
            Incoming::Pong => Some(Inbound::Control),
            Incoming::Close(close) => {
                // Answered with the client's own code (RFC 6455, section 5.5.1).
                self.peer_closed = true;
                self.queue_close(close.map(|(code, _)| (code, String::new())));
                None
            }
        })
    }

    /// Whether reading is paused because the client is over its byte rate: it is not
    /// silent then, the gateway is not listening.
    pub(crate) fn reading_paused(&self) -> bool {
        self.byte_rate.paused_until().is_some()
    }

    fn read_error(&mut self, e: ReadFailure) -> ReadError {
        match e {
            ReadFailure::TooLarge { .. } => {
                self.input_left_unread = true;
                ReadError::TooLarge {
                    limit: self.max_frame_bytes,
                }
            }
            ReadFailure::Violation { code, reason } => ReadError::Violation { code, reason },
            e @ (ReadFailure::Truncated | ReadFailure::Io(_)) => ReadError::Failed(e.to_string()),
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
        let charge = match self.queued_bytes.charge(text.len()) {
            Ok(charge) => charge,
            Err(refused) => {
                let (bound, error) = match refused {
                    Refused::Connection { queued, limit } => {
                        ("bytes", WriteError::QueueBytesFull { queued, limit })
                    }
                    Refused::Gateway { queued, limit } => (
                        "gateway_bytes",
                        WriteError::GatewayQueueFull { queued, limit },
                    ),
                };
                self.too_slow(bound);
                return Err(error);
            }
        };
        self.queue(Outbound::Frame(text, charge))
    }

    /// Queues a ping; the client's pong shows it still reads.
    pub(crate) fn ping(&self) -> Result<(), WriteError> {
        self.queue(Outbound::Ping)
    }

    fn queue(&self, item: Outbound) -> Result<(), WriteError> {
        match self.out.try_send(item) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.too_slow("frames");
                Err(WriteError::QueueFull {
                    capacity: self.out.capacity().unwrap_or_default(),
                })
            }
            Err(TrySendError::Disconnected(_)) => Err(WriteError::Closed),
        }
    }

    /// Closes the connection of a client that does not read what it is sent (it passed
    /// `bound`). Counted once per connection: frames for it may still come until it ends.
    fn too_slow(&self, bound: &'static str) {
        if self.closed_as_slow.swap(true, Ordering::Relaxed) {
            return;
        }
        metrics::counter!("aip_gateway_slow_clients_closed_total", "bound" => bound).increment(1);
        self.close(close::POLICY, "too slow: outbound queue full");
    }

    /// Queues the close frame. It must get through even when the queue is full, so it waits
    /// (in its own task) up to [`CLOSE_QUEUE_WAIT`] for room.
    pub(crate) fn close(&self, code: u16, reason: &str) {
        self.queue_close(Some((code, reason.to_owned())));
    }

    fn queue_close(&self, close: Option<(u16, String)>) {
        let out = self.out.clone();
        tokio::spawn(async move {
            let code = close.as_ref().map(|(code, _)| *code);
            let queued =
                tokio::time::timeout(CLOSE_QUEUE_WAIT, out.send_async(Outbound::Close(close)))
                    .await;
            if !matches!(queued, Ok(Ok(()))) {
                tracing::debug!(?code, "close frame not queued: the socket is gone or full");
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
            mut reader,
            out,
            mut writer,
            input_left_unread,
            peer_closed,
            ..
        } = self;
        // The writer ends once the queue is empty and every sender is gone.
        drop(out);
        let drain = async {
            if !await_answer || peer_closed {
                return;
            }
            while let Ok(Some(message)) = reader.next().await {
                if let Incoming::Close(_) = message {
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
/// frames queued at once, until a close is written, the socket fails or the queue closes;
/// then ends the sending side (after an empty close frame if none was written).
async fn write_queued<W: AsyncWrite + Unpin>(io: W, queued: flume::Receiver<Outbound>) {
    let mut writer = FrameWriter::new(io);
    let mut close_written = false;
    'queue: while let Ok(first) = queued.recv_async().await {
        let mut next = Some(first);
        while let Some(item) = next {
            let added = match item {
                // The charge goes with the frame, once written.
                Outbound::Frame(text, _charge) => writer.frame(OpCode::Text, text.as_bytes()).await,
                Outbound::Ping => writer.frame(OpCode::Ping, &[]).await,
                Outbound::Pong(payload) => writer.frame(OpCode::Pong, &payload).await,
                Outbound::Close(close) => {
                    close_written = true;
                    let close = close
                        .as_ref()
                        .map(|(code, reason)| (*code, reason.as_str()));
                    if let Err(e) = writer.close(close).await {
                        tracing::debug!("close frame not written: {e}");
                    }
                    break 'queue;
                }
            };
            if let Err(e) = added {
                tracing::debug!("write to the socket failed: {e}");
                return;
            }
            next = queued.try_recv().ok();
        }
        if let Err(e) = writer.flush().await {
            tracing::debug!("write to the socket failed: {e}");
            return;
        }
    }
    if !close_written && let Err(e) = writer.close(None).await {
        tracing::debug!("close frame not written: {e}");
        return;
    }
    if let Err(e) = writer.shutdown().await {
        tracing::debug!("socket not closed cleanly: {e}");
    }
}
