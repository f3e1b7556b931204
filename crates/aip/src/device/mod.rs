//! `aip device`: a reference device agent speaking UFO-format AIP over a WebSocket.
//!
//! It registers like UFO's device client (`metadata.system_info`, `platform`, plus
//! `capabilities` and `tools`), sends heartbeats, answers every `command` frame with one
//! `command_results` frame (one Result per Command, see [`tools`]), echoes a server `task`
//! frame as UFO's device does (so `POST /api/dispatch` works), logs each `task_end`, and
//! reconnects with exponential backoff when the connection drops. It prints plain lines of
//! what it does on stdout.

pub mod tools;

use std::time::Duration;

use anyhow::{Context, bail};
use futures::{SinkExt, StreamExt};
use proto_schemas::server::{new_id, timestamp_now};
use proto_schemas::{
    ClientMessage, ClientMessageType, ClientType, JsonObject, Platform, ServerMessage,
    ServerMessageType, TaskStatus,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_util::sync::CancellationToken;

use crate::cli::{DeviceArgs, PlatformArg};
use crate::output::compact;
use tools::Toolbox;

/// How long the broker has to answer REGISTER.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);
/// First reconnection delay; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest reconnection delay.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Prints a line of what the device does, at once (stdout may be a pipe).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}

/// The device: who it is and what it offers.
#[derive(Debug, Clone)]
pub struct Device {
    /// Its client id.
    pub id: String,
    pub platform: Platform,
    /// Announced capabilities.
    pub capabilities: Vec<String>,
    pub toolbox: Toolbox,
    /// Between heartbeats.
    pub heartbeat: Duration,
}

/// How one connection ended.
#[derive(Debug)]
enum Ended {
    /// Ctrl-C or SIGTERM.
    Stopped,
    /// The broker refused REGISTER (e.g. the id is live elsewhere).
    Refused(String),
    /// The connection dropped after registration.
    Lost(String),
}

/// Why a connection could not be made.
#[derive(Debug)]
enum ConnectError {
    /// The handshake was refused for good (bad or missing token).
    Forbidden(String),
    /// Anything worth retrying.
    Retry(String),
}

impl Device {
    /// The REGISTER frame: UFO's device registration, plus capabilities and tools.
    pub fn register_frame(&self) -> ClientMessage {
        let mut metadata = JsonObject::new();
        metadata.insert(
            "system_info".into(),
            serde_json::to_value(&self.toolbox.system_info).unwrap_or(Value::Null),
        );
        metadata.insert("registration_time".into(), json!(timestamp_now()));
        metadata.insert("platform".into(), json!(self.platform.as_str()));
        metadata.insert("capabilities".into(), json!(self.capabilities));
        metadata.insert("tools".into(), json!(tools::catalogue()));
        let mut frame = self.frame(ClientMessageType::Register, TaskStatus::Ok);
        frame.metadata = Some(metadata);
        frame
    }

    /// A frame from this device with identity and timestamp filled in.
    fn frame(&self, kind: ClientMessageType, status: TaskStatus) -> ClientMessage {
        let mut frame = ClientMessage::new(kind, status);
        frame.client_type = Some(ClientType::Device);
        frame.client_id = Some(self.id.clone());
        frame.timestamp = Some(timestamp_now());
        frame
    }

    fn heartbeat_frame(&self) -> ClientMessage {
        let mut frame = self.frame(ClientMessageType::Heartbeat, TaskStatus::Ok);
        frame.metadata = Some(
            [("device_id".to_owned(), json!(self.id))]
                .into_iter()
                .collect(),
        );
        frame
    }

    /// Answers a `command` frame: runs its Commands and builds the `command_results` frame.
    pub async fn answer(&self, command: &ServerMessage) -> ClientMessage {
        let actions = command.actions.clone().unwrap_or_default();
        let results = self.toolbox.run_all(&actions).await;
        let mut frame = self.frame(ClientMessageType::CommandResults, command.status);
        frame.session_id = command.session_id.clone();
        frame.prev_response_id = command.response_id.clone();
        frame.request_id = Some(new_id());
        frame.action_results = Some(results);
        frame
    }

    /// UFO's answer to a server `task` frame (from `POST /api/dispatch`): a client `task`
    /// echoing the request; the broker then drives the session with `command` frames.
    fn echo_task(&self, task: &ServerMessage) -> ClientMessage {
        let mut frame = self.frame(ClientMessageType::Task, TaskStatus::Continue);
        frame.request = task.user_request.clone();
        frame.task_name = task.task_name.clone();
        frame.metadata = Some(
            [("platform".to_owned(), json!(self.platform.as_str()))]
                .into_iter()
                .collect(),
        );
        frame
    }

    /// One connection: connect, register, then serve until it ends.
    async fn connection(&self, url: &str, stop: &CancellationToken) -> Result<Ended, ConnectError> {
        let (ws, _) = tokio::select! {
            connected = tokio_tungstenite::connect_async(url) => connected.map_err(connect_error)?,
            () = stop.cancelled() => return Ok(Ended::Stopped),
        };
        let (mut sink, mut stream) = ws.split();
        let register = text_message(&self.register_frame()).ok_or_else(|| {
            ConnectError::Retry("the REGISTER frame could not be encoded".to_owned())
        })?;
        sink.send(register)
            .await
            .map_err(|e| ConnectError::Retry(format!("cannot send REGISTER: {e}")))?;
        let first = tokio::select! {
            first = tokio::time::timeout(REGISTER_TIMEOUT, first_frame(&mut stream)) => first,
            () = stop.cancelled() => return Ok(Ended::Stopped),
        };
        let answer = match first {
            Err(_) => {
                return Err(ConnectError::Retry(format!(
                    "no answer to REGISTER within {} s",
                    REGISTER_TIMEOUT.as_secs()
                )));
            }
            Ok(Err(reason)) => return Err(ConnectError::Retry(reason)),
            Ok(Ok(answer)) => answer,
        };
        match answer.kind {
            ServerMessageType::Heartbeat if answer.status == TaskStatus::Ok => {}
            _ => {
                let reason = answer
                    .error
                    .clone()
                    .unwrap_or_else(|| format!("unexpected answer: {answer:?}"));
                return Ok(Ended::Refused(reason));
            }
        }
        say!(
            "registered as {} (platform {}, capabilities: {}; tools: {})",
            self.id,
            self.platform.as_str(),
            if self.capabilities.is_empty() {
                "none".to_owned()
            } else {
                self.capabilities.join(", ")
            },
            tools::catalogue()
                .iter()
                .map(|t| t.tool_name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );

        // The writer owns the sink; command tasks and heartbeats queue frames for it.
        let (out_tx, mut out_rx) = mpsc::channel::<Message>(64);
        let writer = tokio::spawn(async move {
            while let Some(message) = out_rx.recv().await {
                let closing = matches!(message, Message::Close(_));
                if sink.send(message).await.is_err() || closing {
                    break;
                }
            }
        });
        let mut heartbeat = tokio::time::interval(self.heartbeat);
        heartbeat.tick().await;
        let ended = loop {
            tokio::select! {
                () = stop.cancelled() => {
                    let _ = out_tx.send(Message::Close(Some(CloseFrame {
                        code: CloseCode::Normal,
                        reason: "device stopping".into(),
                    }))).await;
                    break Ended::Stopped;
                }
                _ = heartbeat.tick() => {
                    if let Some(heartbeat) = text_message(&self.heartbeat_frame()) {
                        let _ = out_tx.send(heartbeat).await;
                    }
                }
                next = stream.next() => match next {
                    Some(Ok(Message::Text(text))) => self.on_text(text.as_str(), &out_tx),
                    Some(Ok(Message::Close(frame))) => {
                        break Ended::Lost(match frame {
                            Some(f) => format!("closed by the broker ({}: {})", u16::from(f.code), f.reason),
                            None => "closed by the broker".to_owned(),
                        });
                    }
                    Some(Ok(Message::Binary(_))) => say!("ignoring a binary frame"),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break Ended::Lost(e.to_string()),
                    None => break Ended::Lost("connection closed".to_owned()),
                },
            }
        };
        drop(out_tx);
        let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
        Ok(ended)
    }

    /// Handles one frame from the broker.
    fn on_text(&self, text: &str, out: &mpsc::Sender<Message>) {
        let frame: ServerMessage = match serde_json::from_str(text) {
            Ok(frame) => frame,
            Err(e) => {
                say!(
                    "ignoring a frame I do not understand ({e}): {}",
                    crate::output::truncate(text, 200)
                );
                return;
            }
        };
        let session = frame.session_id.clone().unwrap_or_else(|| "-".to_owned());
        match frame.kind {
            ServerMessageType::Command => {
                let device = self.clone();
                let out = out.clone();
                tokio::spawn(async move {
                    let agent = frame.agent_name.clone().unwrap_or_default();
                    let answer = device.answer(&frame).await;
                    let actions = frame.actions.as_deref().unwrap_or_default();
                    for (action, result) in actions
                        .iter()
                        .zip(answer.action_results.as_deref().unwrap_or_default())
                    {
                        let params = action
                            .parameters
                            .as_ref()
                            .map(|p| format!(" {}", compact(&Value::Object(p.clone()), 80)))
                            .unwrap_or_default();
                        let outcome = match (&result.error, &result.result) {
                            (Some(error), _) => format!("{}: {error}", result.status.as_str()),
                            (None, Some(value)) => {
                                format!("{} {}", result.status.as_str(), compact(value, 80))
                            }
                            (None, None) => result.status.as_str().to_owned(),
                        };
                        say!(
                            "task {session}: {agent} ran {}{params} → {outcome}",
                            action.tool_name
                        );
                    }
                    let Some(answer) = text_message(&answer) else {
                        return;
                    };
                    if out.send(answer).await.is_err() {
                        say!(
                            "task {session}: the connection closed before the results could be sent"
                        );
                    }
                    if matches!(frame.status, TaskStatus::Completed | TaskStatus::Failed) {
                        say!(
                            "task {session}: that was the last step ({})",
                            frame.status.as_str()
                        );
                    }
                });
            }
            ServerMessageType::Task => {
                say!(
                    "task {session}: dispatched to me (name {}): {}",
                    frame.task_name.as_deref().unwrap_or("-"),
                    frame.user_request.as_deref().unwrap_or("")
                );
                let Some(echo) = text_message(&self.echo_task(&frame)) else {
                    return;
                };
                if out.try_send(echo).is_err() {
                    say!("task {session}: could not answer (connection busy or closed)");
                }
            }
            ServerMessageType::TaskEnd => {
                let mut line = format!("task {session}: task_end {}", frame.status.as_str());
                if let Some(error) = &frame.error {
                    line.push_str(&format!(": {error}"));
                }
                if let Some(result) = &frame.result {
                    line.push_str(&format!(" result {}", compact(result, 200)));
                }
                say!("{line}");
            }
            ServerMessageType::Error => {
                say!(
                    "broker error{}: {}",
                    frame
                        .error_code()
                        .map(|c| format!(" ({c})"))
                        .unwrap_or_default(),
                    frame.error.as_deref().unwrap_or("(no text)")
                );
            }
            ServerMessageType::Heartbeat => {
                if frame.session_id.is_some() {
                    say!("task {session}: accepted");
                }
            }
            other => say!("ignoring a `{}` frame", other.as_str()),
        }
    }
}

/// The first text frame of a connection, as a ServerMessage.
async fn first_frame<S>(stream: &mut S) -> Result<ServerMessage, String>
where
    S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        match stream.next().await {
            Some(Ok(Message::Text(text))) => {
                return serde_json::from_str(text.as_str()).map_err(|e| {
                    format!("the answer to REGISTER is not an AIP frame ({e}): {text}")
                });
            }
            Some(Ok(Message::Close(frame))) => {
                return Err(format!(
                    "closed during registration{}",
                    frame
                        .map(|f| format!(" ({}: {})", u16::from(f.code), f.reason))
                        .unwrap_or_default()
                ));
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.to_string()),
            None => return Err("closed during registration".to_owned()),
        }
    }
}

/// A frame as a WebSocket text message. A frame that cannot be encoded is reported and not
/// sent: an empty message would reach the broker as a protocol error.
fn text_message<T: serde::Serialize>(frame: &T) -> Option<Message> {
    match serde_json::to_string(frame) {
        Ok(text) => Some(Message::Text(text.into())),
        Err(e) => {
            say!("a frame could not be encoded and is not sent: {e}");
            None
        }
    }
}

fn connect_error(error: tokio_tungstenite::tungstenite::Error) -> ConnectError {
    use tokio_tungstenite::tungstenite::Error;
    match error {
        Error::Http(response) => {
            let status = response.status();
            let body = response
                .body()
                .as_deref()
                .map(String::from_utf8_lossy)
                .unwrap_or_default()
                .to_string();
            let detail = serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| v.get("detail").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or(body);
            let text = format!(
                "the broker refused the connection (HTTP {}): {detail}",
                status.as_u16()
            );
            if status.as_u16() == 401 || status.as_u16() == 403 {
                ConnectError::Forbidden(format!(
                    "{text}. Pass the right token with --token or AIP_TOKEN"
                ))
            } else {
                ConnectError::Retry(text)
            }
        }
        Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => ConnectError::Retry(
            "connection refused: is the broker running? Start it with `aip dev`".to_owned(),
        ),
        other => ConnectError::Retry(other.to_string()),
    }
}

/// `url` with `?token=` (or `&token=`) appended when a token is given.
pub fn url_with_token(url: &str, token: Option<&str>) -> String {
    match token.filter(|t| !t.is_empty()) {
        None => url.to_owned(),
        Some(token) => {
            let separator = if url.contains('?') { '&' } else { '?' };
            format!("{url}{separator}token={}", crate::rest::path_segment(token))
        }
    }
}

/// Runs `aip device` until Ctrl-C or SIGTERM.
pub async fn run(args: DeviceArgs) -> anyhow::Result<()> {
    if !(args.url.starts_with("ws://") || args.url.starts_with("wss://")) {
        bail!(crate::UsageError(format!(
            "--url must be a WebSocket URL such as ws://127.0.0.1:5000/ws, got {}",
            args.url
        )));
    }
    let id = args.id.clone().unwrap_or_else(tools::hostname);
    if id.trim().is_empty() {
        bail!(crate::UsageError("--id must not be empty".to_owned()));
    }
    let platform = args
        .platform
        .unwrap_or_else(PlatformArg::this_machine)
        .platform();
    let device = Device {
        toolbox: Toolbox {
            system_info: tools::system_info(&id, platform.as_str()),
        },
        id,
        platform,
        capabilities: args.capabilities.clone(),
        heartbeat: Duration::from_secs(args.heartbeat_secs),
    };
    let url = url_with_token(&args.url, args.token.as_deref());
    let stop = CancellationToken::new();
    let signal = stop.clone();
    tokio::spawn(async move {
        aip_runtime::shutdown::signal().await;
        signal.cancel();
    });
    say!("aip device {}: connecting to {}", device.id, args.url);
    let mut backoff = FIRST_BACKOFF;
    loop {
        let outcome = device.connection(&url, &stop).await;
        let reason = match outcome {
            Ok(Ended::Stopped) => {
                say!("stopped");
                return Ok(());
            }
            Ok(Ended::Lost(reason)) => {
                backoff = FIRST_BACKOFF;
                format!("connection lost: {reason}")
            }
            Ok(Ended::Refused(reason)) => format!("registration refused: {reason}"),
            Err(ConnectError::Forbidden(reason)) => {
                return Err(anyhow::anyhow!(reason))
                    .context(format!("cannot connect to {}", args.url));
            }
            Err(ConnectError::Retry(reason)) => format!("cannot connect to {}: {reason}", args.url),
        };
        say!("{reason}; reconnecting in {} s", backoff.as_secs());
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop.cancelled() => {
                say!("stopped");
                return Ok(());
            }
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::{Command, ToolType, parse_client_frame, register_details};

    fn device() -> Device {
        Device {
            id: "demo-pc".into(),
            platform: Platform::Linux,
            capabilities: vec!["demo".into()],
            toolbox: Toolbox {
                system_info: tools::system_info("demo-pc", "linux"),
            },
            heartbeat: Duration::from_secs(30),
        }
    }

    #[test]
    fn register_is_a_valid_device_registration_with_capabilities_and_tools() {
        let text = serde_json::to_string(&device().register_frame()).expect("encodes");
        let frame = parse_client_frame(text.as_bytes()).expect("valid frame");
        let details = register_details(&frame).expect("valid registration");
        assert!(
            details.capabilities.contains(&"demo".to_owned()),
            "{details:?}"
        );
        assert_eq!(details.tools.len(), 4);
        assert_eq!(frame.metadata_value("platform"), Some(&json!("linux")));
        let info = frame.metadata_value("system_info").expect("system_info");
        assert!(info["hostname"].as_str().is_some_and(|h| !h.is_empty()));
        assert!(info["cpu_count"].as_u64().is_some());
    }

    #[tokio::test]
    async fn results_answer_the_command() {
        let mut command = proto_schemas::server::command(
            &proto_schemas::server::CommandTarget {
                session_id: "s-1".into(),
                agent_name: "LinuxAgent".into(),
                ..Default::default()
            },
            vec![Command {
                tool_name: "echo".into(),
                parameters: json!({"text": "hi"}).as_object().cloned(),
                tool_type: ToolType::Action,
                call_id: None,
            }],
            TaskStatus::Continue,
            "r-1".into(),
        );
        command.task_name = Some("t".into());
        let answer = device().answer(&command).await;
        let text = serde_json::to_string(&answer).expect("encodes");
        let frame = parse_client_frame(text.as_bytes()).expect("valid frame");
        assert_eq!(frame.kind, ClientMessageType::CommandResults);
        assert_eq!(frame.status, TaskStatus::Continue);
        assert_eq!(frame.session_id.as_deref(), Some("s-1"));
        assert_eq!(frame.prev_response_id.as_deref(), Some("r-1"));
        let results = frame.action_results.expect("results");
        assert_eq!(results.len(), 1);
        assert_eq!(
            results[0].call_id,
            command.actions.expect("actions")[0].call_id
        );
    }

    #[test]
    fn tokens_go_in_the_query() {
        assert_eq!(url_with_token("ws://h/ws", None), "ws://h/ws");
        assert_eq!(
            url_with_token("ws://h/ws", Some("a b")),
            "ws://h/ws?token=a%20b"
        );
        assert_eq!(
            url_with_token("ws://h/ws?x=1", Some("k")),
            "ws://h/ws?x=1&token=k"
        );
    }
}
