//! Constructors for every frame the server sends.
//!
//! Each function fills exactly the fields UFO's clients read for that frame (see the wire
//! contract), a timestamp and, where UFO sends one, a fresh `response_id`.

use serde_json::{Value, json};

use crate::enums::{ClientMessageType, Extension, ServerMessageType as T, TaskStatus};
use crate::error::ErrorCode;
use crate::flow::{
    CallbackNotification, CallbackStatus, ClarificationRequest, ClarificationResponse,
    HandoffNotification,
};
use crate::frames::{Command, ServerMessage};

/// The current time in UFO's format: ISO 8601, microseconds, `+00:00`.
pub fn timestamp_now() -> String {
    chrono::Utc::now()
        .format("%Y-%m-%dT%H:%M:%S%.6f+00:00")
        .to_string()
}

/// A fresh uuid4, as UFO uses for `response_id`, `session_id` and `call_id`.
pub fn new_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn stamped(kind: T, status: TaskStatus) -> ServerMessage {
    let mut m = ServerMessage::new(kind, status);
    m.timestamp = Some(timestamp_now());
    m.response_id = Some(new_id());
    m
}

/// Registration accepted: `{type:heartbeat,status:ok,timestamp,response_id}`, the first frame
/// the server sends. When the client announced extensions, the ones this server speaks are
/// confirmed in `result.aip_extensions`; a UFO client (no extensions) gets UFO's exact frame.
pub fn registered(extensions: &[Extension]) -> ServerMessage {
    let mut m = stamped(T::Heartbeat, TaskStatus::Ok);
    if !extensions.is_empty() {
        let names: Vec<&str> = extensions.iter().map(|e| e.as_str()).collect();
        m.result = Some(json!({ "aip_extensions": names }));
    }
    m
}

/// Answer to a client heartbeat: `{type:heartbeat,status:ok,timestamp,response_id}`.
pub fn heartbeat() -> ServerMessage {
    stamped(T::Heartbeat, TaskStatus::Ok)
}

/// Task accepted, to the requester only: a heartbeat carrying the session id.
pub fn task_accepted(session_id: &str) -> ServerMessage {
    let mut m = stamped(T::Heartbeat, TaskStatus::Ok);
    m.session_id = Some(session_id.to_owned());
    m
}

/// An ERROR frame: human text in `error`, the code in `metadata.error_code`.
pub fn error(code: ErrorCode, text: impl Into<String>) -> ServerMessage {
    let mut m = stamped(T::Error, TaskStatus::Error);
    m.error = Some(text.into());
    m.metadata = Some(
        [("error_code".to_owned(), Value::from(code.as_str()))]
            .into_iter()
            .collect(),
    );
    m
}

/// An ERROR frame about one session.
pub fn session_error(code: ErrorCode, text: impl Into<String>, session_id: &str) -> ServerMessage {
    let mut m = error(code, text);
    m.session_id = Some(session_id.to_owned());
    m
}

/// A device's system information, answering `request_id`.
pub fn device_info(request_id: Option<&str>, system_info: Value) -> ServerMessage {
    let mut m = ServerMessage::new(T::DeviceInfoResponse, TaskStatus::Ok);
    m.timestamp = Some(timestamp_now());
    m.response_id = request_id.map(str::to_owned);
    m.result = Some(system_info);
    m
}

/// A device-info request that cannot be answered: a `device_info_response` with
/// `status:error` (not a bare ERROR: Galaxy completes a pending request only from a
/// `device_info_response` carrying its `response_id`).
pub fn device_info_error(
    request_id: Option<&str>,
    text: impl Into<String>,
    code: ErrorCode,
) -> ServerMessage {
    let mut m = ServerMessage::new(T::DeviceInfoResponse, TaskStatus::Error);
    m.timestamp = Some(timestamp_now());
    m.response_id = request_id.map(str::to_owned);
    m.error = Some(text.into());
    m.metadata = Some(
        [("error_code".to_owned(), Value::from(code.as_str()))]
            .into_iter()
            .collect(),
    );
    m
}

/// What a `command` frame carries besides its Commands.
#[derive(Debug, Clone, Default)]
pub struct CommandTarget {
    /// The session.
    pub session_id: String,
    /// The task's name.
    pub task_name: Option<String>,
    /// The UFO agent that runs the Commands; required in practice by UFO devices.
    pub agent_name: String,
    /// Passed through.
    pub process_name: Option<String>,
    /// Passed through.
    pub root_name: Option<String>,
}

/// A `command` frame. Commands without a `call_id` get a fresh one. `status` is `continue`,
/// or `completed`/`failed` for a last step (the device then treats its task as over).
pub fn command(
    target: &CommandTarget,
    mut actions: Vec<Command>,
    status: TaskStatus,
    response_id: String,
) -> ServerMessage {
    for action in &mut actions {
        if action.call_id.is_none() {
            action.call_id = Some(new_id());
        }
    }
    let mut m = ServerMessage::new(T::Command, status);
    m.timestamp = Some(timestamp_now());
    m.response_id = Some(response_id);
    m.session_id = Some(target.session_id.clone());
    m.task_name = target.task_name.clone();
    m.agent_name = Some(target.agent_name.clone());
    m.process_name = target.process_name.clone();
    m.root_name = target.root_name.clone();
    m.actions = Some(actions);
    m
}

/// The answer to a refused client frame: an ERROR (about its session when it names one) and,
/// for a refused `task` with a session id, the failed `task_end` the wire contract promises,
/// so that Galaxy's pending task ends at once instead of timing out.
pub fn refusal(
    kind: ClientMessageType,
    session_id: Option<&str>,
    code: ErrorCode,
    text: &str,
) -> Vec<ServerMessage> {
    match session_id {
        None => vec![error(code, text)],
        Some(sid) if kind == ClientMessageType::Task => vec![
            session_error(code, text, sid),
            task_end(
                sid,
                TaskStatus::Failed,
                None,
                Some(text.to_owned()),
                &new_id(),
            ),
        ],
        Some(sid) => vec![session_error(code, text, sid)],
    }
}

/// `task_end`: the end of a session, to requester and executor. A failed end always says why.
pub fn task_end(
    session_id: &str,
    status: TaskStatus,
    result: Option<Value>,
    error: Option<String>,
    response_id: &str,
) -> ServerMessage {
    let mut m = ServerMessage::new(T::TaskEnd, status);
    m.timestamp = Some(timestamp_now());
    m.response_id = Some(response_id.to_owned());
    m.session_id = Some(session_id.to_owned());
    m.result = result;
    m.error = error;
    m
}

/// Extension `clarification_request`, to a requester that announced `clarification`: the task
/// waits for the answer. The question is in `metadata` (a ClarificationRequest) and, as text,
/// in `user_request`.
pub fn clarification_request(request: &ClarificationRequest) -> ServerMessage {
    let mut m = stamped(T::ClarificationRequest, TaskStatus::Continue);
    m.session_id = Some(request.task_id.clone());
    m.user_request = Some(request.question.clone());
    m.metadata = as_object(request);
    m
}

/// Extension `clarification_response`, to the executor that asked: the answer is in
/// `metadata` (a ClarificationResponse) and, as text, in `user_request`.
pub fn clarification_response(response: &ClarificationResponse) -> ServerMessage {
    let mut m = stamped(T::ClarificationResponse, TaskStatus::Continue);
    m.session_id = Some(response.task_id.clone());
    m.user_request = Some(response.answer.clone());
    m.metadata = as_object(response);
    m
}

/// Extension `handoff`, to a requester that announced `handoff`: the task moved to another
/// agent (a HandoffNotification in `metadata`).
pub fn handoff(notification: &HandoffNotification) -> ServerMessage {
    let mut m = stamped(T::Handoff, TaskStatus::Continue);
    m.session_id = Some(notification.task_id.clone());
    m.metadata = as_object(notification);
    m
}

/// Extension `callback`, to the agent a task named as its callback: the CallbackNotification
/// in `metadata`, its result in `result`, its outcome in `status`.
pub fn callback(notification: &CallbackNotification) -> ServerMessage {
    let status = match notification.status {
        CallbackStatus::Complete => TaskStatus::Completed,
        CallbackStatus::Failed => TaskStatus::Failed,
        CallbackStatus::InProgress => TaskStatus::Continue,
    };
    let mut m = stamped(T::Callback, status);
    m.session_id = Some(notification.task_id.clone());
    m.result = notification.result.clone();
    m.error = notification.error.clone();
    m.metadata = as_object(notification);
    m
}

fn as_object(value: &impl serde::Serialize) -> Option<crate::frames::JsonObject> {
    match serde_json::to_value(value) {
        Ok(Value::Object(object)) => Some(object),
        _ => None,
    }
}

/// A server `task` frame: what `POST /api/dispatch` sends a UFO device, which answers by
/// echoing a client `task`. Never sent to the executor of a constellation's session.
pub fn dispatch_task(user_request: &str, task_name: &str, session_id: &str) -> ServerMessage {
    let mut m = stamped(T::Task, TaskStatus::Continue);
    m.user_request = Some(user_request.to_owned());
    m.task_name = Some(task_name.to_owned());
    m.session_id = Some(session_id.to_owned());
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_task_also_ends_and_other_refusals_only_explain() {
        let task = refusal(
            ClientMessageType::Task,
            Some("s1"),
            ErrorCode::Conflict,
            "taken",
        );
        let kinds: Vec<T> = task.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, [T::Error, T::TaskEnd]);
        assert_eq!(task[1].status, TaskStatus::Failed);
        assert_eq!(task[1].error.as_deref(), Some("taken"));
        assert_eq!(task[0].session_id.as_deref(), Some("s1"));

        let results = refusal(
            ClientMessageType::CommandResults,
            Some("s1"),
            ErrorCode::Forbidden,
            "not yours",
        );
        assert_eq!(results.len(), 1);
        let anonymous = refusal(ClientMessageType::Task, None, ErrorCode::Forbidden, "no");
        assert_eq!(
            anonymous.len(),
            1,
            "without a session there is no task to end"
        );
        assert_eq!(anonymous[0].session_id, None);
    }

    #[test]
    fn timestamps_look_like_ufos() {
        let t = timestamp_now();
        assert!(chrono::DateTime::parse_from_rfc3339(&t).is_ok(), "{t}");
        assert!(t.ends_with("+00:00"));
        assert_eq!(t.len(), "2026-06-26T09:00:00.123456+00:00".len());
    }

    #[test]
    fn ufo_clients_get_ufos_registration_frame() {
        let v = serde_json::to_value(registered(&[])).expect("serialises");
        let mut keys: Vec<_> = v
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        assert_eq!(keys, ["response_id", "status", "timestamp", "type"]);
    }

    #[test]
    fn errors_carry_the_code() {
        let m = error(ErrorCode::ProtocolError, "bad");
        assert_eq!(m.error_code(), Some("PROTOCOL_ERROR"));
        assert_eq!(m.status, TaskStatus::Error);
    }
}
