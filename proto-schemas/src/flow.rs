//! The flow messages of seed 004, as versioned subject payloads.
//!
//! These move tasks, handoffs, clarifications and callbacks between services and to agents
//! that talk to the broker over NATS or REST instead of a WebSocket.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::enums::PlannerName;
use crate::error::ErrorCode;
use crate::frames::Command;
use crate::sessions::TaskState;
use crate::version::V1;

/// Ask for work to be done (REST `POST /api/tasks`, NATS submit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct TaskRequest {
    /// Always 1.
    pub version: V1,
    /// The task's id; chosen by the broker when absent.
    // 256 is `MAX_ID_BYTES`, which counts UTF-8 bytes; the REST document can count characters.
    #[schema(min_length = 1, max_length = 256)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// What to do, in words (sent to a UFO device as the task's request).
    // Not blank: at least one character that `str::trim` keeps.
    #[schema(
        pattern = r"[^\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    )]
    pub description: String,
    /// Structured input for the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Who asks (an agent id, or a REST caller's name).
    pub originating_agent_id: String,
    /// Where to POST the outcome (validated, signed, retried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_url: Option<String>,
    /// Or send the CallbackNotifications to this agent as `callback` frames (it must have
    /// announced the `callback` extension); kept until it connects. Not with `callback_url`.
    #[schema(min_length = 1, max_length = 256)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_agent: Option<String>,
    /// Besides the end (always) and a question (always), the states whose entry is also
    /// POSTed to `callback_url` (e.g. `dispatched`, `working`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub callback_on: Vec<TaskState>,
    /// Higher runs first when an agent is busy (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Run on this agent (must be online).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Otherwise, run on an available agent with all of these.
    #[serde(default)]
    pub required_capabilities: Vec<String>,
    /// A name for the task (`[A-Za-z0-9._-]`, not starting with `.`); UFO's result lookup uses it.
    #[schema(pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]*$")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_name: Option<String>,
    /// Scripted planner: the command rounds to send, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<Vec<Command>>>,
    /// The requester drives the task itself (no planner): it sends commands with
    /// `POST /api/tasks/{id}/commands` and ends the task with `POST /api/tasks/{id}/complete`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub driver: bool,
    /// Who plans a task without `steps` (default: the session service's configured one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerName>,
    /// Fail with TASK_TIMEOUT after this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// The status of a [`TaskResponse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskResponseStatus {
    /// Done.
    Success,
    /// Ended badly.
    Failed,
    /// Still running.
    InProgress,
}

/// The outcome (or progress) of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskResponse {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The result data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Where the task stands.
    pub status: TaskResponseStatus,
    /// The agent that did (or does) the work.
    pub agent_id: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A task moved from one agent to another.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HandoffNotification {
    /// Always 1.
    pub version: V1,
    /// The task (its id does not change).
    pub task_id: String,
    /// The agent giving it up.
    pub current_agent_id: String,
    /// The agent taking it.
    pub new_agent_id: String,
    /// Why.
    pub reason: String,
}

/// Hand a task to another agent: by id, or any available agent with the capabilities
/// (NATS `sessions.handoff`; REST `POST /api/tasks/{id}/handoff` takes the same fields but
/// `task_id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct HandoffRequest {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The agent to take it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Otherwise, an available agent with all of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_capabilities: Vec<String>,
    /// Why.
    pub reason: String,
    /// Who asks.
    pub requested_by: String,
}

/// The executor needs an answer before it can go on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct ClarificationRequest {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// Identifies this question; the answer names it.
    pub clarification_id: String,
    /// The question.
    pub question: String,
    /// Structured detail of what is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The agent asking.
    pub requested_by: String,
    /// When the task fails unless the question is answered (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

/// The answer to a [`ClarificationRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct ClarificationResponse {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The question answered.
    pub clarification_id: String,
    /// The answer.
    pub answer: String,
    /// Structured additional information.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Who answered.
    pub provided_by: String,
}

/// The status of a [`CallbackNotification`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallbackStatus {
    /// The task completed.
    Complete,
    /// The task failed (or was cancelled, rejected, timed out).
    Failed,
    /// A progress update.
    InProgress,
}

/// What is delivered to a task's callback URL or originating agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CallbackNotification {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The result data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Where the task stands.
    pub status: CallbackStatus,
    /// The callback URL or agent id it goes to.
    pub sent_to: String,
    /// The task's state (`completed`, `failed`, `canceled`, `rejected`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The open question, when the task waits for an answer (`input_required`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clarification: Option<ClarificationRequest>,
}

/// An error about a task (or none), from any party.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorMessage {
    /// Always 1.
    pub version: V1,
    /// The task, if the error is about one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// What went wrong.
    pub error: String,
    /// The machine-readable code.
    pub error_code: ErrorCode,
    /// Who reports it.
    pub originating_agent_id: String,
}
