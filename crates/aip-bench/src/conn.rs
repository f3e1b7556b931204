//! One client's WebSocket: connect, send a text frame, read the next text frame before a
//! deadline, register. Straight on tokio-tungstenite, one socket per task, nothing shared.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message, Utf8Bytes};

use crate::target::Gateway;
use crate::wire::Inbound;

/// Why a client's exchange with the broker failed. The text goes into the report.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum WireError {
    /// The TCP connection could not be opened.
    #[error("connect failed: {0}")]
    Connect(String),
    /// The WebSocket handshake was refused.
    #[error("WebSocket handshake refused with HTTP {0}")]
    Handshake(u16),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The run's --max-seconds passed while waiting.
    #[error("--max-seconds reached while waiting for an answer")]
    Deadline,
    /// The broker closed the connection.
    #[error("connection closed by the broker{}", close_text(*code, reason))]
    Closed {
        /// The close code, if one was sent.
        code: Option<u16>,
        /// The close reason.
        reason: String,
    },
    /// Reading or writing failed.
    #[error("connection failed: {0}")]
    Io(String),
    /// The broker refused with an error frame.
    #[error("{0}")]
    Refused(String),
    /// The broker sent something the bench does not expect here.
    #[error("unexpected frame: {0}")]
    Unexpected(String),
}

fn close_text(code: Option<u16>, reason: &str) -> String {
    match (code, reason.is_empty()) {
        (None, _) => String::new(),
        (Some(code), true) => format!(" (code {code})"),
        (Some(code), false) => format!(" (code {code}: {reason})"),
    }
}

impl WireError {
    /// Whether the connection is unusable after this.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, WireError::Refused(_) | WireError::Unexpected(_))
    }
}

/// An AIP client connection.
pub(crate) struct Conn {
    ws: WebSocketStream<TcpStream>,
}

/// Small buffers: thousands of idle clients must stay cheap for the generator too.
fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .write_buffer_size(0)
}

impl Conn {
    /// Opens the WebSocket to `gateway` (TCP with Nagle off, then the handshake).
    pub async fn connect(gateway: &Gateway) -> Result<Conn, WireError> {
        Self::connect_from(gateway, None).await
    }

    /// Like [`Conn::connect`], from the local address `source`.
    pub async fn connect_from(
        gateway: &Gateway,
        source: Option<std::net::IpAddr>,
    ) -> Result<Conn, WireError> {
        let stream = gateway
            .addr
            .connect(source)
            .await
            .map_err(|e| WireError::Connect(e.to_string()))?;
        match tokio_tungstenite::client_async_with_config(
            gateway.ws.as_str(),
            stream,
            Some(config()),
        )
        .await
        {
            Ok((ws, _)) => Ok(Conn { ws }),
            Err(tungstenite::Error::Http(response)) => {
                Err(WireError::Handshake(response.status().as_u16()))
            }
            Err(e) => Err(WireError::Connect(format!(
                "WebSocket handshake failed: {e}"
            ))),
        }
    }

    /// Sends one text frame.
    pub async fn send(&mut self, text: String) -> Result<(), WireError> {
        self.ws
            .send(Message::Text(text.into()))
            .await
            .map_err(io_error)
    }

    /// The next text frame; control frames are skipped (pings are answered by tungstenite).
    /// Waits forever: for use in a `select!`.
    pub async fn next_text(&mut self) -> Result<Utf8Bytes, WireError> {
        loop {
            match self.ws.next().await {
                None => {
                    return Err(WireError::Closed {
                        code: None,
                        reason: String::new(),
                    });
                }
                Some(Err(e)) => return Err(io_error(e)),
                Some(Ok(Message::Text(text))) => return Ok(text),
                Some(Ok(Message::Close(frame))) => {
                    return Err(WireError::Closed {
                        code: frame.as_ref().map(|f| u16::from(f.code)),
                        reason: frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                    });
                }
                Some(Ok(Message::Binary(_))) => {
                    return Err(WireError::Unexpected(
                        "a binary frame (AIP frames are text)".to_owned(),
                    ));
                }
                Some(Ok(_)) => {}
            }
        }
    }

    /// The next text frame within `timeout`, and before `deadline`.
    pub async fn recv(
        &mut self,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Utf8Bytes, WireError> {
        let by = Instant::now() + timeout;
        let (until, error) = if by <= deadline {
            (by, WireError::Timeout(timeout))
        } else {
            (deadline, WireError::Deadline)
        };
        match tokio::time::timeout_at(until, self.next_text()).await {
            Ok(result) => result,
            Err(_) => Err(error),
        }
    }

    /// Sends a REGISTER and waits for its answer: the first frame the server sends is the
    /// confirmation (a `heartbeat`) or the refusal (an `error`, then a close).
    pub async fn register(
        &mut self,
        frame: String,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<(), WireError> {
        self.send(frame).await?;
        let text = self.recv(timeout, deadline).await?;
        let answer = Inbound::parse(text.as_str()).map_err(WireError::Unexpected)?;
        match answer.kind.as_ref() {
            "heartbeat" if !answer.status_is("error") => Ok(()),
            "error" | "heartbeat" => Err(WireError::Refused(format!(
                "registration refused: {}",
                answer.error_text()
            ))),
            other => Err(WireError::Unexpected(format!(
                "`{other}` frame instead of the registration answer"
            ))),
        }
    }

    /// Connects to `gateway` and registers.
    pub async fn registered(
        gateway: &Gateway,
        frame: String,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Conn, WireError> {
        let mut conn = tokio::time::timeout_at(
            deadline.min(Instant::now() + timeout),
            Conn::connect(gateway),
        )
        .await
        .map_err(|_| WireError::Timeout(timeout))??;
        conn.register(frame, timeout, deadline).await?;
        Ok(conn)
    }

    /// Says goodbye (a close frame), without waiting for the broker's answer for long.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ws.close(None)).await;
    }
}

fn io_error(e: tungstenite::Error) -> WireError {
    match e {
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            WireError::Closed {
                code: None,
                reason: String::new(),
            }
        }
        other => WireError::Io(other.to_string()),
    }
}
