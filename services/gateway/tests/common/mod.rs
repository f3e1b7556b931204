//! Shared helpers of the gateway's integration tests.
//!
//! - [`Ws`]: the test kit's WebSocket client, checking **every** frame the server sends
//!   against UFO's own `ServerMessage` schema (`proto-schemas/tests/data/ufo-aip.schema.json`)
//!   before the test sees it, with panicking shortcuts and exact-shape assertions;
//! - REST helpers for the registry (`/api/clients`, `/api/agents/{id}`);
//! - assertions on the exact shapes of the registration answer and of ERROR frames.
//!
//! Every test binary includes this module (`mod common;`) and uses a different part of it.

#![allow(dead_code, missing_docs)]

use std::path::Path;
use std::sync::LazyLock;
use std::time::Duration;

use aip_testkit::{Client, ConnectError, RunningGateway, Stack, eventually};
pub use aip_testkit::{Closed, Refusal, get_json};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

/// UFO's `ServerMessage` model as a JSON Schema validator, built once.
fn server_message_schema() -> &'static jsonschema::Validator {
    static VALIDATOR: LazyLock<jsonschema::Validator> = LazyLock::new(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../proto-schemas/tests/data/ufo-aip.schema.json");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let document: Value = serde_json::from_slice(&bytes).expect("UFO's schema is JSON");
        let schema = document
            .get("ServerMessage")
            .expect("UFO's schema has a ServerMessage model");
        jsonschema::validator_for(schema).expect("UFO's ServerMessage schema compiles")
    });
    &VALIDATOR
}

/// Panics unless `frame` is a valid UFO `ServerMessage` (what a UFO client can parse).
pub fn assert_ufo_server_message(frame: &Value) {
    let errors: Vec<String> = server_message_schema()
        .iter_errors(frame)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "the gateway sent a frame UFO's ServerMessage schema refuses:\n  {}\n{frame:#}",
        errors.join("\n  ")
    );
}

/// A WebSocket client (the test kit's) whose every received text frame is validated
/// against UFO's schema, with panicking shortcuts for the gateway's tests.
pub struct Ws {
    client: Client,
}

impl Ws {
    fn new(client: Client) -> Ws {
        Ws {
            client: client.checked(assert_ufo_server_message),
        }
    }

    /// Connects; panics if the handshake is refused.
    pub async fn connect(url: &str) -> Ws {
        Self::try_connect(url)
            .await
            .unwrap_or_else(|e| panic!("connecting to {url}: {e:?}"))
    }

    /// Connects with an `Authorization: Bearer` header.
    pub async fn connect_bearer(url: &str, token: &str) -> Result<Ws, Refusal> {
        let bearer = format!("Bearer {token}");
        Self::handshake(url, &[("Authorization", &bearer)]).await
    }

    /// Connects, returning the refusal if the handshake is refused.
    pub async fn try_connect(url: &str) -> Result<Ws, Refusal> {
        Self::handshake(url, &[]).await
    }

    async fn handshake(url: &str, headers: &[(&str, &str)]) -> Result<Ws, Refusal> {
        match Client::connect_with(url, headers).await {
            Ok(client) => Ok(Ws::new(client)),
            Err(ConnectError::Refused(refusal)) => Err(refusal),
            Err(e) => panic!("handshake failed without an HTTP answer: {e}"),
        }
    }

    /// Expects the handshake to be refused.
    pub async fn refused(url: &str) -> Refusal {
        match Self::try_connect(url).await {
            Ok(_) => panic!("the handshake to {url} was accepted"),
            Err(refusal) => refusal,
        }
    }

    pub async fn send(&mut self, frame: &Value) {
        self.client.send(frame).await.expect("sending a text frame");
    }

    pub async fn send_text(&mut self, text: &str) {
        self.client
            .send_text(text)
            .await
            .expect("sending a text frame");
    }

    pub async fn send_binary(&mut self, bytes: Vec<u8>) {
        self.client
            .send_binary(bytes)
            .await
            .expect("sending a binary frame");
    }

    pub async fn send_ping(&mut self) -> anyhow::Result<()> {
        self.client.send_ping().await
    }

    /// Sends a raw message, reporting failure (e.g. the server already closed).
    pub async fn try_send(&mut self, message: Message) -> anyhow::Result<()> {
        self.client.send_message(message).await
    }

    /// The next text frame (pings and pongs skipped) within `WAIT`, validated.
    pub async fn recv(&mut self) -> anyhow::Result<Value> {
        self.client.recv().await
    }

    /// The next frame, which must be of type `kind`.
    pub async fn recv_kind(&mut self, kind: &str) -> Value {
        let frame = self
            .recv()
            .await
            .unwrap_or_else(|e| panic!("expected a `{kind}` frame: {e}"));
        assert_eq!(
            frame["type"], kind,
            "expected a `{kind}` frame, got {frame}"
        );
        frame
    }

    /// The next frame, which must be an ERROR with exactly `text` and `code`.
    pub async fn expect_error(&mut self, code: &str, text: &str) -> Value {
        let frame = self
            .recv()
            .await
            .unwrap_or_else(|e| panic!("expected ERROR `{text}`: {e}"));
        assert_error(&frame, code, text);
        frame
    }

    /// Sends a heartbeat and expects the server's exact heartbeat answer.
    pub async fn heartbeat(&mut self, id: &str, client_type: &str) {
        self.send(&aip_testkit::frames::heartbeat(id, client_type))
            .await;
        let answer = self
            .recv()
            .await
            .unwrap_or_else(|e| panic!("heartbeat of {id} not answered: {e}"));
        assert_heartbeat_answer(&answer);
    }

    /// Reads until the server closes; returns the close code, reason and frames before it.
    pub async fn closed(&mut self) -> Closed {
        self.client
            .closed()
            .await
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Reads (answering pings) for `quiet`; fails if anything but a ping or pong arrives.
    pub async fn idle(&mut self, quiet: Duration) -> anyhow::Result<()> {
        self.client.expect_silence(quiet).await
    }

    pub async fn close(self) {
        self.client.close().await;
    }
}

/// The answer to a heartbeat: `{type:heartbeat,status:ok,timestamp,response_id}`.
pub fn assert_heartbeat_answer(frame: &Value) {
    assert_eq!(frame["type"], "heartbeat", "{frame}");
    assert_eq!(frame["status"], "ok", "{frame}");
    assert_timestamp(frame);
    assert_uuid(&frame["response_id"], frame);
}

/// UFO's registration answer, exactly: `{type:heartbeat,status:ok,timestamp,response_id}`
/// and no other key.
pub fn assert_registration_answer(frame: &Value) {
    assert_heartbeat_answer(frame);
    let mut keys: Vec<&str> = frame
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["response_id", "status", "timestamp", "type"],
        "UFO's exact registration answer: {frame}"
    );
}

/// An ERROR frame: `{type:error,status:error,error:<text>,timestamp,response_id}` with the
/// code in `metadata.error_code`.
pub fn assert_error(frame: &Value, code: &str, text: &str) {
    assert_eq!(
        frame["type"], "error",
        "expected ERROR `{text}`, got {frame}"
    );
    assert_eq!(frame["status"], "error", "{frame}");
    assert_eq!(frame["error"], text, "{frame}");
    assert_eq!(frame["metadata"]["error_code"], code, "{frame}");
    assert_timestamp(frame);
    assert_uuid(&frame["response_id"], frame);
}

/// `timestamp` is ISO 8601 with an offset, as UFO writes it.
pub fn assert_timestamp(frame: &Value) {
    let t = frame["timestamp"]
        .as_str()
        .unwrap_or_else(|| panic!("no timestamp: {frame}"));
    assert!(
        chrono::DateTime::parse_from_rfc3339(t).is_ok(),
        "timestamp `{t}` is not ISO 8601 with an offset: {frame}"
    );
}

fn assert_uuid(value: &Value, frame: &Value) {
    let s = value
        .as_str()
        .unwrap_or_else(|| panic!("expected a uuid, got {value}: {frame}"));
    assert!(uuid::Uuid::parse_str(s).is_ok(), "not a uuid: {s}: {frame}");
}

/// Connects to `url`, sends `frame` (a REGISTER) and checks UFO's exact registration answer.
pub async fn registered(url: &str, frame: &Value) -> Ws {
    let mut ws = Ws::connect(url).await;
    ws.send(frame).await;
    let answer = ws
        .recv()
        .await
        .unwrap_or_else(|e| panic!("no registration answer to {frame}: {e}"));
    assert_registration_answer(&answer);
    ws
}

/// Connects, sends a REGISTER and expects ERROR `text` (code `code`) and then a close.
pub async fn refused_registration(url: &str, frame: &Value, code: &str, text: &str) -> Closed {
    let mut ws = Ws::connect(url).await;
    ws.send(frame).await;
    ws.expect_error(code, text).await;
    let closed = ws.closed().await;
    assert!(
        closed.frames.is_empty(),
        "nothing after the refusal but the close: {closed:?}"
    );
    closed
}

// ---------------------------------------------------------------------------------------
// REST

/// `/api/clients`'s `online_clients`.
pub async fn online_clients(base: &str) -> Vec<String> {
    let (status, body) = get_json(&format!("{base}/api/clients")).await;
    assert_eq!(status, 200, "{body}");
    body["online_clients"]
        .as_array()
        .unwrap_or_else(|| panic!("UFO's shape {{online_clients: [...]}}: {body}"))
        .iter()
        .map(|c| c.as_str().expect("ids are strings").to_owned())
        .collect()
}

/// `/api/agents/{id}`, or None on 404. Sent as raw HTTP/1.1 so the id reaches the server
/// exactly as percent-encoded (URL libraries drop `.` and `%2E` path segments).
pub async fn agent(base: &str, id: &str) -> Option<Value> {
    let (status, body) = raw_get(base, &format!("/api/agents/{}", urlencode_all(id))).await;
    match status {
        200 => Some(body),
        404 => None,
        other => panic!("GET /api/agents/{id}: {other} {body}"),
    }
}

/// The agent's registry status (`available`, `busy`, `offline`), if it is known.
pub async fn agent_status(base: &str, id: &str) -> Option<String> {
    agent(base, id)
        .await
        .and_then(|a| a["status"].as_str().map(str::to_owned))
}

/// Waits until the registry lists `id` in `/api/clients` and as `available`.
pub async fn until_online(stack: &Stack, id: &str) {
    let base = stack.registry_url();
    eventually(&format!("`{id}` online in the registry"), || {
        let base = base.clone();
        async move {
            let listed = online_clients(&base).await.iter().any(|c| c == id);
            (listed && agent_status(&base, id).await.as_deref() == Some("available")).then_some(())
        }
    })
    .await
    .expect("online");
}

/// Waits until the registry has `id` offline (and not in `/api/clients`).
pub async fn until_offline(stack: &Stack, id: &str) {
    until_offline_at(&stack.registry_url(), id).await;
}

/// [`until_offline`] against a registry base URL.
pub async fn until_offline_at(base: &str, id: &str) {
    eventually(&format!("`{id}` offline in the registry"), || async move {
        let listed = online_clients(base).await.iter().any(|c| c == id);
        (!listed && agent_status(base, id).await.as_deref() == Some("offline")).then_some(())
    })
    .await
    .expect("offline");
}

/// GET `path` (already encoded) from `base` (`http://host:port`) over a plain HTTP/1.1
/// connection → (status, JSON body or null).
pub async fn raw_get(base: &str, path: &str) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.strip_prefix("http://").expect("an http:// base URL");
    let mut tcp = TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    tcp.write_all(request.as_bytes())
        .await
        .expect("request sent");
    let mut response = Vec::new();
    tcp.read_to_end(&mut response).await.expect("response read");
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {text}"));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head}"));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut decoded = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if size == 0 {
                break;
            }
            let (Some(chunk), Some(next)) = (after.get(..size), after.get(size..)) else {
                panic!("malformed chunked body: {body}");
            };
            decoded.push_str(chunk);
            rest = next.trim_start_matches("\r\n");
        }
        decoded
    } else {
        body.to_owned()
    };
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// Percent-encodes every byte but ASCII letters and digits.
pub fn urlencode_all(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Percent-encodes everything but unreserved characters (for ids in URL paths).
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A free TCP port on 127.0.0.1, never one this test process was given before.
pub fn free_port() -> u16 {
    aip_testkit::free_port()
}

/// Starts a gateway of `stack` with modified settings (for knobs the test kit lacks); the
/// test stops it (a failure of the gateway then fails the test).
pub async fn custom_gateway(
    stack: &Stack,
    change: impl FnOnce(&mut aip_gateway::Settings),
) -> RunningGateway {
    stack
        .start_gateway(change)
        .await
        .expect("the gateway builds")
}

/// A TCP connection to `url` (`ws://host:port/path`) after a WebSocket handshake made by
/// hand, for frames no WebSocket client would send.
#[allow(dead_code)]
pub async fn raw_handshake(url: &str) -> TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("ws://").expect("a ws:// URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut tcp = TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    let request = format!(
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    tcp.write_all(request.as_bytes()).await.expect("sent");
    // The response head, byte by byte so that nothing after it is taken.
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = tcp.read_u8().await.expect("a response");
        head.push(byte);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "not upgraded: {head}");
    tcp
}

/// Reads the server's frames until its close frame: the close code (`None` if the frame has
/// none, or the connection ends first).
#[allow(dead_code)]
pub async fn read_close_code(tcp: &mut TcpStream) -> Option<u16> {
    use tokio::io::AsyncReadExt;
    let read = async {
        loop {
            let mut head = [0u8; 2];
            tcp.read_exact(&mut head).await.ok()?;
            let len = match head[1] & 0x7f {
                126 => usize::from(tcp.read_u16().await.ok()?),
                127 => usize::try_from(tcp.read_u64().await.ok()?).ok()?,
                len => usize::from(len),
            };
            let mut payload = vec![0u8; len];
            tcp.read_exact(&mut payload).await.ok()?;
            if head[0] & 0x0f == 0x8 {
                return payload
                    .get(..2)
                    .map(|code| u16::from_be_bytes([code[0], code[1]]));
            }
        }
    };
    tokio::time::timeout(aip_testkit::WAIT, read)
        .await
        .expect("the server closes within the wait")
}
