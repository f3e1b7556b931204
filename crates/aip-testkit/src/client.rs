//! The one WebSocket client of the tests: an AIP client over a real socket that can also do
//! what well-behaved clients never do (binary frames, raw pings, oversized frames, an
//! `Authorization` header, not reading at all). Every read has a deadline.

use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::client::Request;
use tokio_tungstenite::tungstenite::http::{HeaderName, HeaderValue};
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use anyhow::{Context, anyhow, bail};

use crate::wait::WAIT;

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Run on every text frame the server sends, before the test sees it; panics if the frame
/// is wrong (for example, a check against UFO's own schema).
pub type FrameCheck = fn(&Value);

/// An AIP client over a real WebSocket.
pub struct Client {
    ws: Socket,
    check: Option<FrameCheck>,
}

/// What a refused handshake returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub status: u16,
    /// The body, as JSON if it is JSON (`null` otherwise).
    pub body: Value,
}

/// Why a connection was not made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The server answered the handshake with an HTTP error.
    #[error("the handshake was refused with HTTP {}: {}", .0.status, .0.body)]
    Refused(Refusal),
    /// No HTTP answer at all (bad URL, nothing listening, broken connection).
    #[error("the handshake failed: {0}")]
    Failed(#[source] tungstenite::Error),
}

/// How a connection ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// The close code, if the server sent a close frame with one.
    pub code: Option<u16>,
    pub reason: String,
    /// Text frames received before the close (each already checked).
    pub frames: Vec<Value>,
}

impl Client {
    /// Connects; fails with the HTTP status if the handshake is refused.
    pub async fn connect(url: &str) -> anyhow::Result<Client> {
        Ok(Client::connect_with(url, &[]).await?)
    }

    /// Connects with extra HTTP headers on the handshake request.
    pub async fn connect_with(url: &str, headers: &[(&str, &str)]) -> Result<Client, ConnectError> {
        let mut request = url.into_client_request().map_err(ConnectError::Failed)?;
        for (name, value) in headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| ConnectError::Failed(tungstenite::Error::HttpFormat(e.into())))?;
            let value = HeaderValue::from_str(value)
                .map_err(|e| ConnectError::Failed(tungstenite::Error::HttpFormat(e.into())))?;
            request.headers_mut().insert(name, value);
        }
        Client::handshake(request).await
    }

    async fn handshake(request: Request) -> Result<Client, ConnectError> {
        match tokio_tungstenite::connect_async(request).await {
            Ok((ws, _)) => Ok(Client { ws, check: None }),
            Err(tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let body = response
                    .body()
                    .as_deref()
                    .and_then(|b| serde_json::from_slice(b).ok())
                    .unwrap_or(Value::Null);
                Err(ConnectError::Refused(Refusal { status, body }))
            }
            Err(e) => Err(ConnectError::Failed(e)),
        }
    }

    /// Runs `check` on every text frame received from now on.
    pub fn checked(mut self, check: FrameCheck) -> Client {
        self.check = Some(check);
        self
    }

    /// Connects, sends `register` and expects the registration heartbeat.
    pub async fn registered(url: &str, register: Value) -> Client {
        let mut client = Client::connect(url)
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        client
            .send(&register)
            .await
            .unwrap_or_else(|e| panic!("send register: {e}"));
        let reply = client
            .recv()
            .await
            .unwrap_or_else(|e| panic!("registration answer: {e}"));
        assert_eq!(reply["type"], "heartbeat", "registration refused: {reply}");
        client
    }

    /// Connects and expects the handshake to be refused; returns the HTTP status.
    pub async fn refused(url: &str) -> anyhow::Result<u16> {
        Ok(Client::refusal(url).await?.status)
    }

    /// Connects and expects the handshake to be refused; returns the refusal.
    pub async fn refusal(url: &str) -> anyhow::Result<Refusal> {
        match Client::connect_with(url, &[]).await {
            Ok(_) => bail!("the handshake to {url} was accepted"),
            Err(ConnectError::Refused(refusal)) => Ok(refusal),
            Err(e) => bail!("unexpected error: {e}"),
        }
    }

    pub async fn send(&mut self, frame: &Value) -> anyhow::Result<()> {
        self.send_text(&frame.to_string()).await
    }

    pub async fn send_text(&mut self, text: &str) -> anyhow::Result<()> {
        self.send_message(Message::Text(text.into())).await
    }

    pub async fn send_binary(&mut self, bytes: Vec<u8>) -> anyhow::Result<()> {
        self.send_message(Message::Binary(bytes.into())).await
    }

    pub async fn send_ping(&mut self) -> anyhow::Result<()> {
        self.send_message(Message::Ping(Default::default())).await
    }

    /// Sends any WebSocket message; fails if the server already closed.
    pub async fn send_message(&mut self, message: Message) -> anyhow::Result<()> {
        self.ws.send(message).await?;
        Ok(())
    }

    /// The next JSON frame (pings and pongs skipped), within [`WAIT`].
    pub async fn recv(&mut self) -> anyhow::Result<Value> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| anyhow!("no frame within {WAIT:?}"))?;
            match next {
                None => bail!("connection closed"),
                Some(Err(e)) => bail!("connection failed: {e}"),
                Some(Ok(Message::Text(text))) => return self.frame(text.as_str()),
                Some(Ok(Message::Close(frame))) => bail!(
                    "connection closed: {:?}",
                    frame.map(|f| (u16::from(f.code), f.reason.to_string()))
                ),
                Some(Ok(Message::Binary(b))) => {
                    bail!("the server sent a binary frame ({} bytes)", b.len())
                }
                Some(Ok(_)) => {}
            }
        }
    }

    /// The next frame of a given `type` (others skipped), within [`WAIT`] in all.
    pub async fn recv_type(&mut self, kind: &str) -> anyhow::Result<Value> {
        tokio::time::timeout(WAIT, async {
            loop {
                let frame = self.recv().await?;
                if frame["type"] == kind {
                    return Ok(frame);
                }
            }
        })
        .await
        .map_err(|_| anyhow!("no `{kind}` frame within {WAIT:?}"))?
    }

    /// Reads (answering pings) for `quiet`; fails if anything but a ping or pong arrives.
    pub async fn expect_silence(&mut self, quiet: std::time::Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + quiet;
        loop {
            match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return Ok(()),
                Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
                Ok(Some(Ok(Message::Text(text)))) => {
                    bail!("expected nothing, got {}", self.frame(text.as_str())?)
                }
                Ok(other) => bail!("expected nothing, got {other:?}"),
            }
        }
    }

    /// Reads until the server closes, within [`WAIT`]; returns the close code, reason and
    /// the frames before it.
    pub async fn closed(&mut self) -> anyhow::Result<Closed> {
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut frames = Vec::new();
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| anyhow!("not closed within {WAIT:?}; frames so far: {frames:?}"))?;
            match next {
                None | Some(Err(_)) => {
                    return Ok(Closed {
                        code: None,
                        reason: String::new(),
                        frames,
                    });
                }
                Some(Ok(Message::Close(frame))) => {
                    // Send the answer tungstenite queued, completing the closing handshake.
                    let _ = self.ws.flush().await;
                    return Ok(Closed {
                        code: frame.as_ref().map(|f| u16::from(f.code)),
                        reason: frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                        frames,
                    });
                }
                Some(Ok(Message::Text(text))) => frames.push(self.frame(text.as_str())?),
                Some(Ok(_)) => {}
            }
        }
    }

    pub async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }

    /// A received text frame, parsed and checked.
    fn frame(&self, text: &str) -> anyhow::Result<Value> {
        let frame: Value = serde_json::from_str(text)
            .with_context(|| format!("the server sent text that is not JSON: {text}"))?;
        if let Some(check) = self.check {
            check(&frame);
        }
        Ok(frame)
    }
}
