//! The bad-input table: what bad input gets over WebSocket, REST and NATS from the whole
//! running broker (registry, gateway, session service), and that nobody else notices.
//!
//! Each [`Case`] is sent to the real services, over the network on NATS + PostgreSQL, and
//! must get its [`Answer`]: the HTTP status, the NATS `Aip-Error-Code` header or the ERROR
//! frame's `metadata.error_code`, and a message containing the expected text. A message on a
//! subject nobody answers (the frames stream, presence) must be logged, or shown harmless.
//! Every case is run and every difference reported together. Then a well-behaved device and
//! constellation complete a scripted task (their first frames since the table are that
//! task's), the clients that sent bad frames get exactly their heartbeat answers, every
//! client is still online, and every service is still ready.
//!
//! The README's `## Errors` table lists every case as [`Case::row`] writes it (checked by
//! `the_readme_lists_every_case`). Both backends.

use std::fmt;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use aip_bus::Headers;
use aip_testkit::frames::{
    self, command_results_for, constellation_register, constellation_task, device_register,
    one_step,
};
use aip_testkit::{Backend, Client, Options, Stack, WAIT, both_backends, eventually, get_json};
use proto_schemas::Subjects;
use serde_json::{Value, json};

/// The gateway's frame limit in this test (small, so that the oversized frame is cheap).
const FRAME_LIMIT: usize = 64 * 1024;
/// A device that only behaves.
const GOOD_DEVICE: &str = "pc-good";
/// The constellation bound to it.
const GOOD_GALAXY: &str = "g@pc-good";
/// The device that sends bad frames.
const BAD_DEVICE: &str = "pc-bad";
/// The constellation that sends bad frames (bound to the bad device).
const BAD_GALAXY: &str = "g@pc-bad";
/// A task that completed before the table: the cases about ended tasks use it.
const DONE: &str = "done-1";

/// One of the REST services.
#[derive(Debug, Clone, Copy)]
enum Api {
    Sessions,
    Registry,
}

/// Which registered client sends a frame.
#[derive(Debug, Clone, Copy)]
enum Sender {
    /// [`BAD_DEVICE`].
    Device,
    /// [`BAD_GALAXY`].
    Constellation,
}

/// What is sent.
enum Input {
    /// An HTTP request.
    Rest {
        api: Api,
        method: &'static str,
        path: String,
        content_type: Option<&'static str>,
        body: Vec<u8>,
    },
    /// A NATS request, which gets a reply.
    Request {
        subject: fn(&Subjects) -> String,
        payload: Vec<u8>,
    },
    /// A message into the frames stream (stored, then consumed by the session service).
    Stream {
        subject: fn(&Subjects) -> String,
        payload: Vec<u8>,
    },
    /// A plain NATS publish nobody answers.
    Publish {
        subject: fn(&Subjects) -> String,
        payload: Vec<u8>,
    },
    /// A frame from a registered client.
    Frame { from: Sender, frame: Value },
    /// A frame from a device registered just for it (the frame ends its connection).
    FrameOnItsOwnConnection { device: &'static str, frame: Value },
}

/// What must come back.
enum Answer {
    /// An HTTP error body `{"detail", "error_code"}` with this status, `detail` containing
    /// the text.
    Http {
        status: u16,
        code: &'static str,
        detail: &'static str,
    },
    /// A NATS error reply (code in the `Aip-Error-Code` header and the body), `detail`
    /// containing the text.
    ErrorReply {
        code: &'static str,
        detail: &'static str,
    },
    /// A NATS reply `{"ok": …}` including this JSON (an object's other keys are not checked).
    OkReply(&'static str),
    /// An ERROR frame with the code, its text containing this; for a refused `task`, then a
    /// failed `task_end` of its session with the same text.
    Error {
        code: &'static str,
        text: &'static str,
        task_end: bool,
    },
    /// An ERROR frame, then the connection closed with `close`.
    Closed {
        code: &'static str,
        text: &'static str,
        close: u16,
    },
    /// No reply (nobody answers this subject): the service logs a line containing the text,
    /// naming the subject.
    Logged(&'static str),
    /// No reply: the registry goes on writing every gateway's presence (the bad device,
    /// which then sends a heartbeat, gets a later `last_seen`).
    PresenceStillWritten,
}

/// One bad input and its answer.
struct Case {
    /// As the README's table shows it.
    what: &'static str,
    input: Input,
    answer: Answer,
}

impl Input {
    fn transport(&self) -> &'static str {
        match self {
            Input::Rest { .. } => "REST",
            Input::Request { .. } | Input::Stream { .. } | Input::Publish { .. } => "NATS",
            Input::Frame { .. } | Input::FrameOnItsOwnConnection { .. } => "WebSocket",
        }
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Http {
                status,
                code,
                detail,
            } => write!(f, "{status} `{code}`: {detail}"),
            Answer::ErrorReply { code, detail } => write!(f, "error reply `{code}`: {detail}"),
            Answer::OkReply(body) => write!(f, "reply `{{\"ok\": …}}` with `{body}`"),
            Answer::Error {
                code,
                text,
                task_end,
            } => {
                write!(f, "ERROR `{code}`: {text}")?;
                if *task_end {
                    write!(f, "; then a failed `task_end`")?;
                }
                Ok(())
            }
            Answer::Closed { code, text, close } => {
                write!(f, "ERROR `{code}`: {text}; then close {close}")
            }
            Answer::Logged(text) => write!(f, "no reply; the service logs: {text}"),
            Answer::PresenceStillWritten => {
                write!(
                    f,
                    "no reply; the registry goes on writing every gateway's presence"
                )
            }
        }
    }
}

impl Case {
    /// The case's row in the README's table.
    fn row(&self) -> String {
        format!(
            "| {} | {} | {} |",
            self.input.transport(),
            self.what,
            self.answer
        )
    }
}

fn rest(api: Api, method: &'static str, path: &str) -> Input {
    Input::Rest {
        api,
        method,
        path: path.to_owned(),
        content_type: None,
        body: Vec::new(),
    }
}

fn rest_json(api: Api, method: &'static str, path: &str, body: impl Into<Vec<u8>>) -> Input {
    Input::Rest {
        api,
        method,
        path: path.to_owned(),
        content_type: Some("application/json"),
        body: body.into(),
    }
}

fn http(status: u16, code: &'static str, detail: &'static str) -> Answer {
    Answer::Http {
        status,
        code,
        detail,
    }
}

fn error_reply(code: &'static str, detail: &'static str) -> Answer {
    Answer::ErrorReply { code, detail }
}

fn refused_task(code: &'static str, text: &'static str) -> Answer {
    Answer::Error {
        code,
        text,
        task_end: true,
    }
}

fn refused_frame(code: &'static str, text: &'static str) -> Answer {
    Answer::Error {
        code,
        text,
        task_end: false,
    }
}

/// A valid TaskRequest for the good device, with `change` applied.
fn task_request(change: Value) -> Vec<u8> {
    let mut request = json!({ "version": 1, "description": "say hi", "originating_agent_id": "tester",
        "target_id": GOOD_DEVICE, "steps": one_step("echo", json!({})) });
    for (key, value) in change.as_object().expect("an object") {
        request[key] = value.clone();
    }
    request.to_string().into_bytes()
}

/// A valid `registry.register` request, with `change` applied.
fn register_request(change: Value) -> Vec<u8> {
    let mut request = json!({ "version": 1, "agent_id": "pc-nats", "client_type": "device",
        "gateway_id": "gw-nats", "connection_id": "c-nats", "principal": "anonymous", "platform": "linux" });
    for (key, value) in change.as_object().expect("an object") {
        request[key] = value.clone();
    }
    request.to_string().into_bytes()
}

/// A client `task` frame of the bad device (UFO's device-initiated task).
fn device_task(target: &str, session: &str) -> Value {
    frames::client(
        json!({ "type": "task", "status": "continue", "client_id": BAD_DEVICE,
        "target_id": target, "request": "do it", "session_id": session }),
    )
}

/// Every case, in the order they are sent.
fn cases() -> Vec<Case> {
    use Api::{Registry, Sessions};
    let over_the_body_limit = {
        let mut body = task_request(json!({}));
        body.truncate(body.len() - 1);
        body.extend(format!(", \"data\": \"{}\"}}", "x".repeat(3 * 1024 * 1024)).bytes());
        body
    };
    let mut no_target = constellation_task(BAD_GALAXY, BAD_DEVICE, "s-no-target", "t", None);
    no_target["target_id"] = Value::Null;
    let mut oversized = device_task("pc-big", "s-big");
    oversized["client_id"] = json!("pc-big");
    oversized["metadata"] = json!({ "padding": "x".repeat(FRAME_LIMIT) });
    vec![
        // ----- REST: the session service -----
        Case {
            what: "`POST /api/tasks` body `{`",
            input: rest_json(Sessions, "POST", "/api/tasks", "{"),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid JSON body: Failed to parse the request body as JSON: EOF while parsing an object at line 1 column 1",
            ),
        },
        Case {
            what: "`POST /api/tasks` as `text/plain`",
            input: Input::Rest {
                api: Sessions,
                method: "POST",
                path: "/api/tasks".to_owned(),
                content_type: Some("text/plain"),
                body: task_request(json!({})),
            },
            answer: http(
                415,
                "INVALID_REQUEST",
                "send the body as JSON, with the header Content-Type: application/json",
            ),
        },
        Case {
            what: "`POST /api/tasks` without `description`",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks",
                r#"{"version": 1, "originating_agent_id": "t", "target_id": "pc-good"}"#,
            ),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid JSON body: missing field `description`",
            ),
        },
        Case {
            what: "`POST /api/tasks` with `\"version\": 2`",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks",
                task_request(json!({ "version": 2 })),
            ),
            answer: http(
                400,
                "INVALID_REQUEST",
                "unsupported payload version 2; this build speaks version 1",
            ),
        },
        Case {
            what: "`POST /api/tasks` with `steps` not lists of Commands",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks",
                task_request(json!({ "steps": "oops" })),
            ),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid JSON body: invalid type: string \"oops\", expected a sequence",
            ),
        },
        Case {
            what: "`POST /api/tasks` with `steps` and `\"driver\": true`",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks",
                task_request(json!({ "driver": true })),
            ),
            answer: http(
                400,
                "INVALID_REQUEST",
                "give `steps` or `driver: true`, not both",
            ),
        },
        Case {
            what: "`POST /api/tasks` for an offline device",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks",
                task_request(json!({ "target_id": "ghost" })),
            ),
            answer: http(404, "DEVICE_NOT_FOUND", "Device 'ghost' is not connected"),
        },
        Case {
            what: "`POST /api/tasks` with the `task_id` of an existing task",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks",
                task_request(json!({ "task_id": DONE })),
            ),
            answer: http(409, "CONFLICT", "session_id 'done-1' is already in use"),
        },
        Case {
            what: "`POST /api/tasks` body over 2 MiB",
            input: rest_json(Sessions, "POST", "/api/tasks", over_the_body_limit),
            answer: http(
                413,
                "FRAME_TOO_LARGE",
                "invalid JSON body: Failed to buffer the request body: length limit exceeded",
            ),
        },
        Case {
            what: "`GET /api/tasks/nope` (no such task)",
            input: rest(Sessions, "GET", "/api/tasks/nope"),
            answer: http(404, "NOT_FOUND", "no task 'nope'"),
        },
        Case {
            what: "`GET /api/tasks?state=finished`",
            input: rest(Sessions, "GET", "/api/tasks?state=finished"),
            answer: http(400, "INVALID_REQUEST", "unknown state \"finished\""),
        },
        Case {
            what: "`GET /api/tasks?cursor=yesterday`",
            input: rest(Sessions, "GET", "/api/tasks?cursor=yesterday"),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid cursor: use next_cursor as given",
            ),
        },
        Case {
            what: "`GET /api/tasks?limit=-1`",
            input: rest(Sessions, "GET", "/api/tasks?limit=-1"),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid query string: Failed to deserialize query string: limit: invalid digit found in string",
            ),
        },
        Case {
            what: "`GET /api/tasks/{id}/events?after=-1`",
            input: rest(Sessions, "GET", "/api/tasks/done-1/events?after=-1"),
            answer: http(400, "INVALID_REQUEST", "`after` must be 0 or more (got -1)"),
        },
        Case {
            what: "`POST /api/tasks/{id}/cancel` of a completed task",
            input: rest_json(Sessions, "POST", "/api/tasks/done-1/cancel", "{}"),
            answer: http(
                409,
                "CONFLICT",
                "task 'done-1' has already ended (completed)",
            ),
        },
        Case {
            what: "`POST /api/tasks/nope/cancel` (no such task)",
            input: rest(Sessions, "POST", "/api/tasks/nope/cancel"),
            answer: http(404, "NOT_FOUND", "no task 'nope'"),
        },
        Case {
            what: "`POST /api/tasks/{id}/commands` with `\"actions\": []`",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks/done-1/commands",
                r#"{"actions": []}"#,
            ),
            answer: http(400, "INVALID_REQUEST", "`actions` must not be empty"),
        },
        Case {
            what: "`POST /api/tasks/{id}/commands` to a completed task",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks/done-1/commands",
                r#"{"actions": [{"tool_name": "echo", "tool_type": "action"}]}"#,
            ),
            answer: http(
                409,
                "CONFLICT",
                "task 'done-1' has already ended (completed)",
            ),
        },
        Case {
            what: "`POST /api/tasks/{id}/complete` with an unknown field",
            input: rest_json(
                Sessions,
                "POST",
                "/api/tasks/done-1/complete",
                r#"{"outcome": "fine"}"#,
            ),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid JSON body: unknown field `outcome`",
            ),
        },
        Case {
            what: "`POST /api/dispatch` body `[1]`",
            input: rest_json(Sessions, "POST", "/api/dispatch", "[1]"),
            answer: http(422, "INVALID_REQUEST", "the body must be a JSON object"),
        },
        Case {
            what: "`GET /api/task_result/.hidden`",
            input: rest(Sessions, "GET", "/api/task_result/.hidden"),
            answer: http(400, "INVALID_REQUEST", "Invalid task_name: must be a non-empty string of characters [A-Za-z0-9._-] and must not start with '.'"),
        },
        Case {
            what: "`GET /api/nothing` on the session service",
            input: rest(Sessions, "GET", "/api/nothing"),
            answer: http(404, "NOT_FOUND", "no such path: /api/nothing"),
        },
        Case {
            what: "`DELETE /api/tasks` (no such method)",
            input: rest(Sessions, "DELETE", "/api/tasks"),
            answer: http(
                405,
                "INVALID_REQUEST",
                "DELETE is not allowed on /api/tasks",
            ),
        },
        // ----- REST: the registry -----
        Case {
            what: "`GET /api/agents?status=Available`",
            input: rest(Registry, "GET", "/api/agents?status=Available"),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid status `Available`: expected `available`, `busy` or `offline`",
            ),
        },
        Case {
            what: "`GET /api/agents?type=robot`",
            input: rest(Registry, "GET", "/api/agents?type=robot"),
            answer: http(400, "INVALID_REQUEST", "invalid type `robot`: expected `device`, `constellation`"),
        },
        Case {
            what: "`GET /api/agents?limit=many`",
            input: rest(Registry, "GET", "/api/agents?limit=many"),
            answer: http(
                400,
                "INVALID_REQUEST",
                "invalid limit `many`: expected a whole number",
            ),
        },
        Case {
            what: "`GET /api/agents?colour=red`",
            input: rest(Registry, "GET", "/api/agents?colour=red"),
            answer: http(
                400,
                "INVALID_REQUEST",
                "unknown query parameter `colour`: use capability, status, type or limit",
            ),
        },
        Case {
            what: "`GET /api/agents/ghost` (never registered)",
            input: rest(Registry, "GET", "/api/agents/ghost"),
            answer: http(404, "NOT_FOUND", "agent 'ghost' is not registered"),
        },
        Case {
            what: "`GET /api/nothing` on the registry",
            input: rest(Registry, "GET", "/api/nothing"),
            answer: http(404, "NOT_FOUND", "no such path: /api/nothing"),
        },
        Case {
            what: "`POST /api/agents` (no such method)",
            input: rest_json(Registry, "POST", "/api/agents", "{}"),
            answer: http(
                405,
                "INVALID_REQUEST",
                "POST is not allowed on /api/agents",
            ),
        },
        // ----- NATS: sessions.submit -----
        Case {
            what: "`sessions.submit` payload `hello` (not JSON)",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: b"hello".to_vec(),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "not a TaskRequest: expected value at line 1 column 1",
            ),
        },
        Case {
            what: "`sessions.submit` with `\"version\": 2`",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: task_request(json!({ "version": 2 })),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "not a TaskRequest: unsupported payload version 2; this build speaks version 1",
            ),
        },
        Case {
            what: "`sessions.submit` without `originating_agent_id`",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: br#"{"version": 1, "description": "x", "target_id": "pc-good"}"#.to_vec(),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "not a TaskRequest: missing field `originating_agent_id`",
            ),
        },
        Case {
            what: "`sessions.submit` with a blank `description`",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: task_request(json!({ "description": "  " })),
            },
            answer: error_reply("INVALID_REQUEST", "`description` must not be empty"),
        },
        Case {
            what: "`sessions.submit` with neither `target_id` nor capabilities",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: task_request(json!({ "target_id": null })),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "give `target_id` or `required_capabilities`",
            ),
        },
        Case {
            what: "`sessions.submit` for a capability nobody has",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: task_request(
                    json!({ "target_id": null, "required_capabilities": ["quantum"] }),
                ),
            },
            answer: error_reply(
                "CAPABILITY_MISMATCH",
                "no available agent has the capabilities [\"quantum\"]",
            ),
        },
        Case {
            // A driver task: its executor gets no frame until commands are sent.
            what: "`sessions.submit` with a NUL in `task_id`",
            input: Input::Request {
                subject: Subjects::sessions_submit,
                payload: json!({ "version": 1, "description": "x", "originating_agent_id": "tester",
                    "target_id": BAD_DEVICE, "driver": true, "task_id": "t\u{0}" })
                .to_string()
                .into_bytes(),
            },
            answer: Answer::OkReply(r#"{"task_id":"t\uFFFD","executor_id":"pc-bad"}"#),
        },
        // ----- NATS: the registry -----
        Case {
            what: "`registry.register` payload `42`",
            input: Input::Request {
                subject: Subjects::registry_register,
                payload: b"42".to_vec(),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "invalid registry.register request: invalid type: integer `42`, expected struct RegisterAgent",
            ),
        },
        Case {
            what: "`registry.register` with an empty `agent_id`",
            input: Input::Request {
                subject: Subjects::registry_register,
                payload: register_request(json!({ "agent_id": "" })),
            },
            answer: error_reply("INVALID_REQUEST", "agent_id must not be empty"),
        },
        Case {
            what: "`registry.register` with a NUL in `system_info`",
            input: Input::Request {
                subject: Subjects::registry_register,
                payload: register_request(json!({ "system_info": { "hostname": "a\u{0}b" } })),
            },
            answer: Answer::OkReply(
                r#"{"agent":{"agent_id":"pc-nats","system_info":{"hostname":"a\uFFFDb"}}}"#,
            ),
        },
        Case {
            what: "`registry.register` with `\"platform\": \"amiga\"`",
            input: Input::Request {
                subject: Subjects::registry_register,
                payload: register_request(json!({ "platform": "amiga" })),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "invalid registry.register request at `platform`: unknown variant `amiga`",
            ),
        },
        Case {
            what: "`registry.register` of a constellation for an offline device",
            input: Input::Request {
                subject: Subjects::registry_register,
                payload: register_request(
                    json!({ "agent_id": "g@ghost", "client_type": "constellation", "target_id": "ghost" }),
                ),
            },
            answer: error_reply(
                "REGISTRATION_FAILED",
                "Target device 'ghost' is not connected",
            ),
        },
        Case {
            what: "`registry.register` of a live id from another connection",
            input: Input::Request {
                subject: Subjects::registry_register,
                payload: register_request(json!({ "agent_id": GOOD_DEVICE })),
            },
            answer: error_reply(
                "REGISTRATION_FAILED",
                "client_id 'pc-good' is already registered; duplicate registrations are not allowed",
            ),
        },
        Case {
            what: "`registry.unregister` without `connection_id`",
            input: Input::Request {
                subject: Subjects::registry_unregister,
                payload: br#"{"version": 1, "agent_id": "pc-good", "reason": "x"}"#.to_vec(),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "invalid registry.unregister request: missing field `connection_id`",
            ),
        },
        Case {
            what: "`registry.unregister` of a live id by another connection",
            input: Input::Request {
                subject: Subjects::registry_unregister,
                payload: br#"{"version": 1, "agent_id": "pc-good", "connection_id": "forged", "reason": "x"}"#
                    .to_vec(),
            },
            answer: Answer::OkReply(r#"{"went_offline":false}"#),
        },
        Case {
            what: "`registry.get` with `\"version\": 2`",
            input: Input::Request {
                subject: Subjects::registry_get,
                payload: br#"{"version": 2, "agent_id": "pc-good"}"#.to_vec(),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "invalid registry.get request at `version`: unsupported payload version 2",
            ),
        },
        Case {
            what: "`registry.get` of an id never registered",
            input: Input::Request {
                subject: Subjects::registry_get,
                payload: br#"{"version": 1, "agent_id": "ghost"}"#.to_vec(),
            },
            answer: error_reply("NOT_FOUND", "agent 'ghost' is not registered"),
        },
        Case {
            what: "`registry.get` with a NUL in `agent_id`",
            input: Input::Request {
                subject: Subjects::registry_get,
                payload: br#"{"version": 1, "agent_id": "a\u0000"}"#.to_vec(),
            },
            answer: error_reply("NOT_FOUND", "agent 'a\u{FFFD}' is not registered"),
        },
        Case {
            what: "`registry.lookup` with a NUL in a capability",
            input: Input::Request {
                subject: Subjects::registry_lookup,
                payload: br#"{"version": 1, "capabilities": ["a\u0000"]}"#.to_vec(),
            },
            answer: Answer::OkReply("[]"),
        },
        Case {
            what: "`registry.lookup` with `\"client_type\": \"robot\"`",
            input: Input::Request {
                subject: Subjects::registry_lookup,
                payload: br#"{"version": 1, "client_type": "robot"}"#.to_vec(),
            },
            answer: error_reply(
                "INVALID_REQUEST",
                "invalid registry.lookup request at `client_type`: unknown variant `robot`",
            ),
        },
        // ----- NATS: subjects nobody answers -----
        Case {
            what: "`frames.{client}` stream message that is not a GatewayEvent",
            input: Input::Stream {
                subject: |s| s.frames(BAD_DEVICE),
                payload: b"not a gateway event".to_vec(),
            },
            answer: Answer::Logged("unreadable event in the frames stream, dropped"),
        },
        Case {
            what: "`frames.{client}` GatewayEvent with `\"version\": 2`",
            input: Input::Stream {
                subject: |s| s.frames(BAD_DEVICE),
                payload: br#"{"event": "closed", "version": 2, "gateway_id": "gw", "connection_id": "c", "client_id": "pc-bad", "client_type": "device", "reason": "x"}"#
                    .to_vec(),
            },
            answer: Answer::Logged("unsupported payload version 2"),
        },
        Case {
            what: "`presence.{gateway}` that is not a PresenceBatch",
            input: Input::Publish {
                subject: |s| s.presence("gw-bad"),
                payload: br#"{"version": 1, "gateway_id": "gw-bad"}"#.to_vec(),
            },
            answer: Answer::Logged("ignoring an invalid presence batch"),
        },
        Case {
            what: "`presence.{gateway}` with a NUL in `gateway_id`",
            input: Input::Publish {
                subject: |s| s.presence("gw-nul"),
                payload: br#"{"version": 1, "gateway_id": "gw\u0000", "interval_ms": 300, "alive": []}"#
                    .to_vec(),
            },
            answer: Answer::PresenceStillWritten,
        },
        // ----- WebSocket: frames the session service refuses -----
        Case {
            what: "`task` with `metadata.steps` not lists of Commands",
            input: Input::Frame {
                from: Sender::Constellation,
                frame: constellation_task(
                    BAD_GALAXY,
                    BAD_DEVICE,
                    "s-bad-steps",
                    "t",
                    Some(json!("oops")),
                ),
            },
            answer: refused_task(
                "PROTOCOL_ERROR",
                "task frame: field `metadata.steps`: must be a list of lists of Commands: invalid type: string \"oops\", expected a sequence",
            ),
        },
        Case {
            what: "`task` for an offline device",
            input: Input::Frame {
                from: Sender::Constellation,
                frame: constellation_task(
                    BAD_GALAXY,
                    "ghost",
                    "s-ghost",
                    "t",
                    Some(one_step("x", json!({}))),
                ),
            },
            answer: refused_task("DEVICE_NOT_FOUND", "Target device 'ghost' is not connected"),
        },
        Case {
            what: "constellation `task` without `target_id`",
            input: Input::Frame {
                from: Sender::Constellation,
                frame: no_target,
            },
            answer: refused_task(
                "PROTOCOL_ERROR",
                "Constellation task requests require target_id",
            ),
        },
        Case {
            what: "`task` reusing the `session_id` of an ended task",
            input: Input::Frame {
                from: Sender::Constellation,
                frame: constellation_task(
                    BAD_GALAXY,
                    BAD_DEVICE,
                    DONE,
                    "t",
                    Some(one_step("x", json!({}))),
                ),
            },
            answer: refused_task("CONFLICT", "session_id 'done-1' is owned by another client"),
        },
        Case {
            what: "device `task` for another device",
            input: Input::Frame {
                from: Sender::Device,
                frame: device_task(GOOD_DEVICE, "s-other"),
            },
            answer: refused_task("FORBIDDEN", "Device clients may not target other devices"),
        },
        Case {
            what: "`command_results` for an unknown session",
            input: Input::Frame {
                from: Sender::Device,
                frame: command_results_for(
                    BAD_DEVICE,
                    &json!({ "session_id": "nope", "response_id": "r-1", "actions": [] }),
                ),
            },
            answer: refused_frame(
                "NOT_FOUND",
                "command_results for unknown session 'nope'",
            ),
        },
        Case {
            what: "`command_results` for another device's ended task",
            input: Input::Frame {
                from: Sender::Device,
                frame: command_results_for(
                    BAD_DEVICE,
                    &json!({ "session_id": DONE, "response_id": "r-1", "actions": [] }),
                ),
            },
            answer: refused_frame(
                "FORBIDDEN",
                "command_results refused: 'pc-bad' is not the executor of session 'done-1'",
            ),
        },
        Case {
            what: "`task_end` from a device without the `task_end_result` extension",
            input: Input::Frame {
                from: Sender::Device,
                frame: frames::client(json!({ "type": "task_end", "status": "completed",
                    "client_id": BAD_DEVICE, "session_id": "nope" })),
            },
            answer: refused_frame(
                "PROTOCOL_ERROR",
                "Unknown message type: task_end (announce the `task_end_result` extension at register to end tasks yourself)",
            ),
        },
        Case {
            what: "a frame naming another `client_id`",
            input: Input::Frame {
                from: Sender::Device,
                frame: command_results_for(
                    GOOD_DEVICE,
                    &json!({ "session_id": DONE, "response_id": "r-1", "actions": [] }),
                ),
            },
            answer: refused_frame(
                "FORBIDDEN",
                "client_id does not match the registered connection",
            ),
        },
        Case {
            what: "`task` frame over the gateway's frame limit",
            input: Input::FrameOnItsOwnConnection {
                device: "pc-big",
                frame: oversized,
            },
            answer: Answer::Closed {
                code: "FRAME_TOO_LARGE",
                text: "frame larger than the limit of 65536 bytes",
                close: 1009,
            },
        },
    ]
}

/// What the services log at WARN and above, in this test process.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// The log of this process at WARN and above, captured (not printed) from the first call
    /// on.
    fn capture() -> Logs {
        static LOGS: OnceLock<Logs> = OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let writer = logs.clone();
            let _ = tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::WARN)
                .try_init();
            logs
        })
        .clone()
    }

    /// Whether a line contains both texts.
    fn has_line_with(&self, text: &str, subject: &str) -> bool {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        String::from_utf8_lossy(&bytes)
            .lines()
            .any(|line| line.contains(text) && line.contains(subject))
    }
}

/// The running broker and the clients that send the bad frames.
struct World {
    stack: Stack,
    subjects: Subjects,
    http: reqwest::Client,
    logs: Logs,
    bad_device: Client,
    bad_galaxy: Client,
}

impl World {
    /// Sends `case` and checks its answer; the difference, if any.
    async fn check(&mut self, case: &Case) -> Result<(), String> {
        match (&case.input, &case.answer) {
            (
                Input::Rest {
                    api,
                    method,
                    path,
                    content_type,
                    body,
                },
                Answer::Http {
                    status,
                    code,
                    detail,
                },
            ) => {
                let base = match api {
                    Api::Sessions => self.stack.sessions_url(),
                    Api::Registry => self.stack.registry_url(),
                };
                let method = reqwest::Method::from_bytes(method.as_bytes()).expect("a method");
                let mut request = self.http.request(method, format!("{base}{path}"));
                if let Some(content_type) = content_type {
                    request = request.header("content-type", *content_type);
                }
                let response = request
                    .body(body.clone())
                    .send()
                    .await
                    .map_err(|e| format!("no answer: {e}"))?;
                let got_status = response.status().as_u16();
                let text = response.text().await.unwrap_or_default();
                let got: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                let matches = got_status == *status
                    && got["error_code"] == *code
                    && text_contains(&got["detail"], detail);
                expect(matches, || format!("{got_status} {text}"))
            }
            (Input::Request { subject, payload }, answer) => {
                let reply = self
                    .stack
                    .bus
                    .request(
                        subject(&self.subjects),
                        Headers::new(),
                        payload.clone().into(),
                        WAIT,
                    )
                    .await
                    .map_err(|e| format!("no reply: {e}"))?;
                let header = reply.headers.get("Aip-Error-Code").map(str::to_owned);
                let got: Value = serde_json::from_slice(&reply.payload).unwrap_or(Value::Null);
                let shown = || format!("header {header:?}, body {got}");
                match answer {
                    Answer::ErrorReply { code, detail } => expect(
                        header.as_deref() == Some(*code)
                            && got["error"]["error_code"] == *code
                            && text_contains(&got["error"]["detail"], detail),
                        shown,
                    ),
                    Answer::OkReply(body) => {
                        let body: Value = serde_json::from_str(body).expect("JSON");
                        expect(header.is_none() && includes(&got["ok"], &body), shown)
                    }
                    _ => Err("a request is answered by a reply".to_owned()),
                }
            }
            (Input::Stream { subject, payload } | Input::Publish { subject, payload }, answer) => {
                let subject = subject(&self.subjects);
                let sent_at = chrono::Utc::now();
                let sent = if matches!(case.input, Input::Stream { .. }) {
                    self.stack
                        .bus
                        .publish_durable(subject.clone(), Headers::new(), payload.clone().into())
                        .await
                } else {
                    self.stack
                        .bus
                        .publish(subject.clone(), Headers::new(), payload.clone().into())
                        .await
                };
                sent.map_err(|e| format!("not published: {e}"))?;
                match answer {
                    Answer::Logged(text) => {
                        let logs = self.logs.clone();
                        eventually("the log line", || async {
                            logs.has_line_with(text, &subject).then_some(())
                        })
                        .await
                        .map_err(|e| format!("{e}; nothing logged about {subject}"))
                    }
                    Answer::PresenceStillWritten => {
                        // A sign of life after the batch: written, unless presence is stuck.
                        let device = &mut self.bad_device;
                        device
                            .send(&frames::heartbeat(BAD_DEVICE, "device"))
                            .await
                            .map_err(|e| format!("not sent: {e}"))?;
                        let answer = device.recv().await.map_err(|e| e.to_string())?;
                        expect(answer["type"] == "heartbeat", || answer.to_string())?;
                        let url = format!("{}/api/agents/{BAD_DEVICE}", self.stack.registry_url());
                        eventually("the device's sign of life written", || async {
                            let (_, agent) = get_json(&url).await;
                            let last_seen = agent["last_seen"].as_str()?;
                            let last_seen = chrono::DateTime::parse_from_rfc3339(last_seen).ok()?;
                            (last_seen > sent_at).then_some(())
                        })
                        .await
                        .map_err(|e| e.to_string())
                    }
                    _ => Err("a message nobody answers gets no reply".to_owned()),
                }
            }
            (Input::Frame { from, frame }, Answer::Error { .. }) => {
                let client = match from {
                    Sender::Device => &mut self.bad_device,
                    Sender::Constellation => &mut self.bad_galaxy,
                };
                client
                    .send(frame)
                    .await
                    .map_err(|e| format!("not sent: {e}"))?;
                check_refusal(client, frame, &case.answer).await
            }
            (
                Input::FrameOnItsOwnConnection { device, frame },
                Answer::Closed { code, text, close },
            ) => {
                let mut client =
                    Client::registered(&self.stack.ws_url(0), device_register(device, "linux"))
                        .await;
                client
                    .send(frame)
                    .await
                    .map_err(|e| format!("not sent: {e}"))?;
                let closed = client.closed().await.map_err(|e| e.to_string())?;
                let error = closed.frames.first().cloned().unwrap_or(Value::Null);
                expect(
                    closed.code == Some(*close)
                        && closed.frames.len() == 1
                        && error["type"] == "error"
                        && error["metadata"]["error_code"] == *code
                        && text_contains(&error["error"], text),
                    || format!("{closed:?}"),
                )
            }
            _ => Err("this input cannot get this answer".to_owned()),
        }
    }
}

/// The ERROR frame (and `task_end`) a refused frame gets, and nothing before them.
async fn check_refusal(client: &mut Client, sent: &Value, answer: &Answer) -> Result<(), String> {
    let Answer::Error {
        code,
        text,
        task_end,
    } = answer
    else {
        return Err("a frame is answered by an ERROR".to_owned());
    };
    let error = client.recv().await.map_err(|e| e.to_string())?;
    expect(
        error["type"] == "error"
            && error["status"] == "error"
            && error["metadata"]["error_code"] == *code
            && text_contains(&error["error"], text),
        || error.to_string(),
    )?;
    if !task_end {
        return Ok(());
    }
    let end = client.recv().await.map_err(|e| e.to_string())?;
    expect(
        end["type"] == "task_end"
            && end["status"] == "failed"
            && end["session_id"] == sent["session_id"]
            && end["error"] == error["error"],
        || format!("then {end}"),
    )
}

/// Whether `got` is `expected`, but for keys of objects that `expected` does not name.
fn includes(got: &Value, expected: &Value) -> bool {
    match (got, expected) {
        (Value::Object(got), Value::Object(expected)) => expected
            .iter()
            .all(|(key, value)| got.get(key).is_some_and(|got| includes(got, value))),
        _ => got == expected,
    }
}

fn text_contains(value: &Value, text: &str) -> bool {
    value.as_str().is_some_and(|v| v.contains(text))
}

fn expect(holds: bool, got: impl FnOnce() -> String) -> Result<(), String> {
    if holds { Ok(()) } else { Err(got()) }
}

/// Registers the device and the constellation bound to it.
async fn pair(stack: &Stack, device: &str, galaxy: &str) -> (Client, Client) {
    let dev = Client::registered(&stack.ws_url(0), device_register(device, "linux")).await;
    stack.wait_online(device).await;
    let constellation = Client::registered(
        &stack.ws_url(0),
        constellation_register(galaxy, Some(device)),
    )
    .await;
    (dev, constellation)
}

/// Answers the next `count` commands of `device`, which must come before anything else.
async fn answer_commands(device: &mut Client, id: &str, count: usize) {
    for _ in 0..count {
        let command = device.recv().await.expect("a command");
        assert_eq!(command["type"], "command", "{command}");
        device
            .send(&command_results_for(id, &command))
            .await
            .expect("results");
    }
}

async fn every_bad_input_gets_its_answer_and_disturbs_nothing(backend: Backend) {
    let logs = Logs::capture();
    let stack = Stack::start(
        backend,
        Options {
            max_frame_bytes: Some(FRAME_LIMIT),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let (mut good_device, mut good_galaxy) = pair(&stack, GOOD_DEVICE, GOOD_GALAXY).await;
    let (bad_device, bad_galaxy) = pair(&stack, BAD_DEVICE, BAD_GALAXY).await;

    // A task that has ended, for the cases about ended tasks.
    let (status, task) = aip_testkit::post_json(
        &format!("{}/api/tasks", stack.sessions_url()),
        &serde_json::from_slice(&task_request(json!({ "task_id": DONE }))).expect("JSON"),
    )
    .await;
    assert_eq!(status, 201, "{task}");
    answer_commands(&mut good_device, GOOD_DEVICE, 1).await;
    let end = good_device.recv().await.expect("task_end");
    assert_eq!(end["status"], "completed", "{end}");
    let url = format!("{}/api/tasks/{DONE}", stack.sessions_url());
    eventually("the task completed", || async {
        (get_json(&url).await.1["state"] == "completed").then_some(())
    })
    .await
    .expect("completed");

    let subjects = Subjects::new(&stack.prefix).expect("a valid prefix");
    let mut world = World {
        stack,
        subjects,
        // A connection per request: the server closes one whose body it refused unread.
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .expect("an HTTP client"),
        logs,
        bad_device,
        bad_galaxy,
    };
    let cases = cases();
    let mut differences = Vec::new();
    for case in &cases {
        if let Err(got) = world.check(case).await {
            differences.push(format!("{}\n    got: {got}", case.row()));
        }
    }
    assert!(
        differences.is_empty(),
        "{} of {} cases answered otherwise:\n{}",
        differences.len(),
        cases.len(),
        differences.join("\n")
    );

    // Nothing else noticed. The good pair completes a scripted task, and its first frames are
    // the task's.
    let World {
        stack,
        mut bad_device,
        mut bad_galaxy,
        ..
    } = world;
    let steps = json!([[{ "tool_name": "type_text", "tool_type": "action", "parameters": { "text": "hi" } }],
        [{ "tool_name": "screenshot", "tool_type": "data_collection" }]]);
    good_galaxy
        .send(&constellation_task(
            GOOD_GALAXY,
            GOOD_DEVICE,
            "s-good",
            "good",
            Some(steps),
        ))
        .await
        .expect("task");
    let ack = good_galaxy.recv().await.expect("ack");
    assert_eq!(
        (ack["type"].as_str(), ack["session_id"].as_str()),
        (Some("heartbeat"), Some("s-good")),
        "{ack}"
    );
    answer_commands(&mut good_device, GOOD_DEVICE, 2).await;
    for client in [&mut good_galaxy, &mut good_device] {
        let end = client.recv().await.expect("task_end");
        assert_eq!(
            (end["type"].as_str(), end["status"].as_str()),
            (Some("task_end"), Some("completed")),
            "{end}"
        );
    }
    // The clients that sent bad frames are still registered, and nothing else is waiting for
    // them: their next frame is the answer to a heartbeat.
    for (client, id) in [(&mut bad_device, BAD_DEVICE), (&mut bad_galaxy, BAD_GALAXY)] {
        client
            .send(&frames::heartbeat(id, "device"))
            .await
            .expect("heartbeat");
        let answer = client.recv().await.expect("heartbeat answer");
        assert_eq!(answer["type"], "heartbeat", "{answer}");
    }
    for id in [GOOD_DEVICE, GOOD_GALAXY, BAD_DEVICE, BAD_GALAXY] {
        stack.wait_online(id).await;
    }
    for url in [
        stack.sessions_url(),
        stack.registry_url(),
        format!("http://{}", stack.gateways[0].addr),
    ] {
        let (status, body) = get_json(&format!("{url}/readyz")).await;
        assert_eq!(status, 200, "{url}/readyz: {body}");
    }
    stack.stop().await;
}
both_backends!(every_bad_input_gets_its_answer_and_disturbs_nothing);

#[test]
fn there_are_at_least_thirty_cases_on_every_transport() {
    let cases = cases();
    assert!(cases.len() >= 30, "{}", cases.len());
    for transport in ["WebSocket", "REST", "NATS"] {
        assert!(
            cases.iter().any(|c| c.input.transport() == transport),
            "{transport}"
        );
    }
}

#[test]
fn the_readme_lists_every_case() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("the README");
    // Everything after the heading, up to the next section (all of it missing without one).
    let section = readme.split("\n## Errors\n").nth(1).unwrap_or_default();
    let section = section.split("\n## ").next().unwrap_or_default();
    let missing: Vec<String> = cases()
        .iter()
        .map(Case::row)
        .filter(|row| !section.lines().any(|line| line == row))
        .collect();
    assert!(
        missing.is_empty(),
        "rows missing from the README's `## Errors` table:\n{}",
        missing.join("\n")
    );
}
