//! Payloads of the session service's subjects: frames from gateways, task submission, the
//! remote planner, and task state.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::enums::{ClientType, Extension, Platform};
use crate::error::ErrorCode;
use crate::flow::ClarificationRequest;
use crate::frames::{ActionResult, ClientMessage, Command};
use crate::version::V1;

/// What a gateway puts into the `frames` stream for the session service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
#[expect(
    clippy::large_enum_variant,
    reason = "one event per stream message, moved a few times: a box would cost an allocation per frame"
)]
pub enum GatewayEvent {
    /// A frame from a registered client that the session service handles (task,
    /// command_results, task_end and the extension frames).
    Frame(InboundFrame),
    /// A registered client's connection ended; its sessions end with it.
    Closed(ConnectionClosed),
    /// Several registered clients' connections ended; each as its `closed` event would say,
    /// in order. A gateway sends the ends that came while the report of an earlier one was on
    /// its way together; a lone end goes as `closed`.
    ClosedMany(ConnectionsClosed),
    /// Several frames from one gateway's clients, each as its `frame` event would say, in the
    /// order they are to be applied. A gateway stores the frames that came while an earlier
    /// one was on its way to the stream together; a lone frame, and one that needs the blob
    /// store, goes as `frame`.
    FramesMany(InboundFrames),
}

/// One client frame, with the identity the gateway pinned to its connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InboundFrame {
    /// Always 1.
    pub version: V1,
    /// The gateway that received it.
    pub gateway_id: String,
    /// The connection it came on.
    pub connection_id: String,
    /// The registered client id (not what the frame claims: the gateway already checked that).
    pub client_id: String,
    /// The registered client type.
    pub client_type: ClientType,
    /// The client's platform (from its REGISTER).
    pub platform: Platform,
    /// Extensions the client negotiated.
    #[serde(default)]
    pub extensions: Vec<Extension>,
    /// When the gateway received it (ISO 8601).
    pub received_at: String,
    /// The frame, validated.
    pub frame: ClientMessage,
    /// The gateway reads [`DeliveryBatch`]es on its delivery subject, so frames for its
    /// clients may travel to it together. Absent (false) from a gateway of an earlier
    /// version, which is sent one message per frame.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delivery_batches: bool,
}

/// `sessions.acks.{replica}`: a gateway wrote these frames from the session service's outbox
/// to their clients' sockets (or had written them before). Until it hears this, the session
/// service keeps a frame and sends it again. A gateway sends what it wrote meanwhile together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeliveryAck {
    /// Always 1.
    pub version: V1,
    /// The frames' `Nats-Msg-Id`s (at least one, at most 1,000).
    pub msg_ids: Vec<String>,
}

/// `deliver.{gateway}` with `Aip-Control: batch`: frames from the session service's outbox
/// for several of one gateway's clients, in one message (the frames of one group commit for
/// that gateway). The gateway handles each delivery as the message it stands for: a message
/// with the delivery's `Nats-Msg-Id`, `Aip-Client`, `Aip-Connection` and `traceparent`, the
/// batch's `Aip-Ack`, and the frame as its payload. Sent only to a gateway whose frames say
/// it reads them ([`InboundFrame::delivery_batches`]).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct DeliveryBatch<'a> {
    /// Always 1.
    pub version: V1,
    /// The frames, in the order they are to be written (at least one, at most
    /// [`MAX_DELIVERIES`]).
    #[serde(borrow)]
    pub deliveries: Vec<BatchedFrame<'a>>,
}

/// One frame of a [`DeliveryBatch`], with what the message it stands for would carry.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct BatchedFrame<'a> {
    /// The frame's outbox id (`Nats-Msg-Id`): what the gateway acknowledges and de-duplicates.
    pub msg_id: String,
    /// The client it is for.
    pub client_id: String,
    /// The one connection of the client that may receive it, if only one may.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_id: Option<String>,
    /// The W3C trace context the frame continues, when tracing is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The frame, as the client receives it.
    #[serde(borrow)]
    #[schemars(with = "serde_json::Value")]
    pub frame: &'a serde_json::value::RawValue,
}

/// Deliveries one [`DeliveryBatch`] carries at most.
pub const MAX_DELIVERIES: usize = 256;

/// A registered connection ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConnectionClosed {
    /// Always 1.
    pub version: V1,
    /// The gateway that held it.
    pub gateway_id: String,
    /// The connection.
    pub connection_id: String,
    /// The client.
    pub client_id: String,
    /// The client's type.
    pub client_type: ClientType,
    /// Why it ended.
    pub reason: String,
}

/// Several connections' ends in one event (at least two, at most [`MAX_CLOSED_MANY`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConnectionsClosed {
    /// Always 1.
    pub version: V1,
    /// The ends, in the order they happened.
    pub connections: Vec<ConnectionClosed>,
}

/// Ends one [`ConnectionsClosed`] carries at most.
pub const MAX_CLOSED_MANY: usize = 256;

/// Several clients' frames in one event (at least two, at most [`MAX_FRAMES_MANY`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InboundFrames {
    /// Always 1.
    pub version: V1,
    /// The frames, in the order the gateway stored them.
    pub frames: Vec<GatheredFrame>,
}

/// One frame of an [`InboundFrames`] event, with what its own stream message would carry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GatheredFrame {
    /// The frame's own `Nats-Msg-Id`: what the session service de-duplicates it by.
    pub msg_id: String,
    /// The W3C trace context the frame continues, when tracing is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The frame, as its `frame` event would carry it.
    pub inbound: InboundFrame,
}

/// Frames one [`InboundFrames`] carries at most.
pub const MAX_FRAMES_MANY: usize = 256;

/// The state of a task. `completed`, `failed`, `canceled` and `rejected` are terminal.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Accepted, waiting for its executor to be free.
    Submitted,
    /// Sent to its executor.
    Dispatched,
    /// The executor is working on it (commands in flight).
    Working,
    /// Paused until a clarification is answered.
    InputRequired,
    /// Ended well.
    Completed,
    /// Ended badly (including timeouts, error code TASK_TIMEOUT).
    Failed,
    /// Cancelled by a requester, over REST, or by a disconnect.
    Canceled,
    /// Never started: no executor, bad request.
    Rejected,
}

impl TaskState {
    /// Every state.
    pub const ALL: &'static [TaskState] = &[
        TaskState::Submitted,
        TaskState::Dispatched,
        TaskState::Working,
        TaskState::InputRequired,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Canceled,
        TaskState::Rejected,
    ];

    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Submitted => "submitted",
            TaskState::Dispatched => "dispatched",
            TaskState::Working => "working",
            TaskState::InputRequired => "input_required",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Canceled => "canceled",
            TaskState::Rejected => "rejected",
        }
    }

    /// Parses the wire string.
    pub fn from_wire(s: &str) -> Option<Self> {
        TaskState::ALL.iter().copied().find(|t| t.as_str() == s)
    }

    /// Whether the task is over (nothing changes it any more).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Failed | TaskState::Canceled | TaskState::Rejected
        )
    }

    /// Whether a transition from `self` to `next` is allowed by the state machine.
    pub fn can_become(self, next: TaskState) -> bool {
        use TaskState::*;
        if self.is_terminal() {
            return false;
        }
        matches!(
            (self, next),
            (_, Failed | Canceled)
                | (Submitted, Dispatched | Rejected)
                | (Dispatched, Working | Completed | Submitted | InputRequired)
                | (Working, InputRequired | Completed | Working | Dispatched)
                | (InputRequired, Working)
        )
    }
}

/// `sessions.submit` reply payload: the task was accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskAccepted {
    /// The task's id (also its session id on the wire).
    pub task_id: String,
    /// Its name.
    pub task_name: String,
    /// The chosen executor.
    pub executor_id: String,
    /// Its state now (submitted if the executor is busy, else dispatched).
    pub state: TaskState,
}

/// `planner.next`: what the session service asks a remote planner for each step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PlanRequest {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// Its name.
    pub task_name: String,
    /// What the task is to achieve, in words.
    pub request: String,
    /// Structured input of the task, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The device that executes the commands.
    pub executor_id: String,
    /// Its platform (decides the UFO agent).
    pub platform: Platform,
    /// Which step this is (0 for the first).
    pub step: u32,
    /// The results of the previous step's commands (empty for the first step).
    #[serde(default)]
    pub last_results: Vec<ActionResult>,
}

/// The planner's decision for one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum PlanStep {
    /// Send these commands to the executor, then ask again with their results.
    Commands {
        /// The commands.
        actions: Vec<Command>,
        /// The UFO agent to run them (default: the platform's agent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent_name: Option<String>,
        /// Passed through to the device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        process_name: Option<String>,
        /// Passed through to the device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root_name: Option<String>,
    },
    /// The task is done.
    Complete {
        /// Its result.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
    },
    /// The task cannot be done.
    Fail {
        /// Why.
        error: String,
    },
    /// Hand the task to another agent (by id, or any available agent with the capabilities);
    /// the next request names the new executor. Refused (nobody available, the bound of
    /// handoffs reached): the next request's `last_results` holds one failed Result saying why.
    Handoff {
        /// The agent to take it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target_id: Option<String>,
        /// Otherwise, an available agent with all of these.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        required_capabilities: Vec<String>,
        /// Why.
        reason: String,
    },
    /// Ask the requester a question; the task waits in `input_required`. The next request's
    /// `last_results` holds one Result with the answer (`clarification_id`, `question`,
    /// `answer`, `data`), carrying `call_id`.
    Clarify {
        /// The question.
        question: String,
        /// Structured detail of what is needed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<Value>,
        /// Fail the task if no answer comes within this many seconds (at most the service's
        /// `clarification_timeout_secs`, also the default).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_secs: Option<u64>,
        /// Returned as the answer's Result's `call_id` (the built-in agent's tool call id).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        call_id: Option<String>,
    },
}

/// One entry of a task's event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct TaskEvent {
    /// The task.
    pub task_id: String,
    /// Gap-free sequence number within the task, from 1.
    pub seq: i64,
    /// When it happened (RFC 3339).
    pub at: String,
    /// What happened (`submitted`, `dispatched`, `command_sent`, `results_received`, `planned`,
    /// the terminal state, …).
    pub kind: String,
    /// The task's state after this event.
    pub state: TaskState,
    /// Details.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// A task as the REST API and NATS show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct TaskView {
    /// The task's id; also its AIP `session_id`.
    pub task_id: String,
    /// Its name.
    pub task_name: String,
    /// Where it stands.
    pub state: TaskState,
    /// What was asked.
    pub request: String,
    /// Who asked (client id, or `rest:<caller>`, `nats:<agent>`).
    pub requester: String,
    /// Who executes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_id: Option<String>,
    /// Higher first when the executor is busy.
    pub priority: i32,
    /// The result, once completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why it failed, was cancelled or rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The code that goes with `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<ErrorCode>,
    /// Created (RFC 3339).
    pub created_at: String,
    /// Last changed (RFC 3339).
    pub updated_at: String,
    /// Events so far.
    pub events: i64,
    /// The open question, while the task is `input_required`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clarification: Option<ClarificationRequest>,
}

/// One chunk of a stored large body (raw bytes of the original payload, not JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(
    description = "Raw bytes: one chunk of a body too large for one message. Joined in the order of the `Aip-Blob` reference's sequences, the chunks give the original payload."
)]
pub struct BlobChunk(pub String);
