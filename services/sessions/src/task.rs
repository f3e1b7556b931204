//! The task model: what a task is, typed.
//!
//! [`Task`] is the live state the leader changes and the store reads and writes; every kind,
//! role and state in it is an enum. Text appears only at the database edge
//! ([`crate::store`]) and on the wire. State changes go through [`Task::enter`], which holds
//! them to the state machine of [`TaskState::can_become`].

use std::collections::BTreeMap;

use proto_schemas::flow::ClarificationRequest;
use proto_schemas::sessions::{TaskState, TaskView};
use proto_schemas::{ClientType, Command, ErrorCode, Extension, PlannerName, Platform, V1};
use serde_json::Value;

/// Who asked for a task; a client requester is told of its task's end by frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requester {
    /// A WebSocket client (constellation or device).
    Client {
        /// The client id it registered with.
        id: String,
        /// Galaxy's constellations and UFO's devices are held to different rules.
        client_type: ClientType,
        /// The connection the request came on: only that connection's end cancels the task
        /// (`None` in tasks stored before connections were recorded: any of the client's).
        connection: Option<String>,
        /// The extensions it announced at REGISTER: extension frames go only to those.
        extensions: Vec<Extension>,
    },
    /// A REST caller, by the id it gave.
    Rest(String),
    /// A NATS client, by the agent id it gave.
    Nats(String),
}

/// The transport a requester used, as stored in `tasks.requester_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequesterKind {
    /// `client`
    Client,
    /// `rest`
    Rest,
    /// `nats`
    Nats,
}

impl RequesterKind {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            RequesterKind::Client => "client",
            RequesterKind::Rest => "rest",
            RequesterKind::Nats => "nats",
        }
    }

    /// Parses the stored text.
    pub fn from_db(s: &str) -> Option<Self> {
        [
            RequesterKind::Client,
            RequesterKind::Rest,
            RequesterKind::Nats,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

impl Requester {
    pub fn kind(&self) -> RequesterKind {
        match self {
            Requester::Client { .. } => RequesterKind::Client,
            Requester::Rest(_) => RequesterKind::Rest,
            Requester::Nats(_) => RequesterKind::Nats,
        }
    }

    /// The id it gave; the owner of the task's id.
    pub fn id(&self) -> &str {
        match self {
            Requester::Client { id, .. } | Requester::Rest(id) | Requester::Nats(id) => id,
        }
    }

    /// The client to tell of the task's end by frame (REST and NATS callers ask instead).
    pub fn client_id(&self) -> Option<&str> {
        match self {
            Requester::Client { id, .. } => Some(id),
            Requester::Rest(_) | Requester::Nats(_) => None,
        }
    }

    /// As REST shows it: a client's id, or `rest:<id>` / `nats:<id>`.
    pub fn display(&self) -> String {
        match self {
            Requester::Client { id, .. } => id.clone(),
            other => format!("{}:{}", other.kind().as_str(), other.id()),
        }
    }
}

/// How the steps of a task are decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// The task carries its steps; the service sends them one by one.
    Scripted(Vec<Vec<Command>>),
    /// A planner decides each step from the last results.
    Planner(PlannerName),
    /// The requester sends commands itself (REST) and ends the task.
    Driver,
}

/// The kind of a [`Plan`], as stored in `tasks.planner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannerKind {
    /// `scripted`
    Scripted,
    /// `nats`, `http` or `llm`
    Planner(PlannerName),
    /// `driver`
    Driver,
}

impl PlannerKind {
    /// The stored text (also used in messages to users).
    pub fn as_str(self) -> &'static str {
        match self {
            PlannerKind::Scripted => "scripted",
            PlannerKind::Planner(name) => name.as_str(),
            PlannerKind::Driver => "driver",
        }
    }

    /// Parses the stored text (`remote`, from before planners had names, is `nats`).
    pub fn from_db(s: &str) -> Option<Self> {
        match s {
            "scripted" => Some(PlannerKind::Scripted),
            "driver" => Some(PlannerKind::Driver),
            "remote" => Some(PlannerKind::Planner(PlannerName::Nats)),
            other => PlannerName::from_wire(other).map(PlannerKind::Planner),
        }
    }
}

impl Plan {
    pub fn kind(&self) -> PlannerKind {
        match self {
            Plan::Scripted(_) => PlannerKind::Scripted,
            Plan::Planner(name) => PlannerKind::Planner(*name),
            Plan::Driver => PlannerKind::Driver,
        }
    }
}

/// What a live task waits for before it can move on. One at a time: a UFO dispatch waits
/// for the device's echo, then for its first plan, then for the results of each command.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Waiting {
    /// Nothing the service drives: queued, ended, or a driven task between commands.
    #[default]
    Nothing,
    /// A UFO dispatch: the device's client `task` frame echoing the server's.
    Echo,
    /// The next step is to be planned.
    Plan,
    /// The results of the command frame with this `response_id`.
    Results {
        /// The `response_id` of the command in flight.
        response_id: String,
    },
    /// The answer to a question (the task is `input_required`).
    Answer(Box<Question>),
}

/// An open question of a task, as stored while it waits for the answer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Question {
    /// The `clarification_id`.
    pub id: String,
    /// The question.
    pub text: String,
    /// Structured detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Who asked, and where the answer goes.
    pub asked_by: Asker,
    /// The task fails unless answered by then (epoch ms).
    pub deadline_ms: i64,
}

/// Who asked a question; the answer goes back there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Asker {
    /// The executor, while running the command with this `response_id`: it gets a
    /// `clarification_response` frame, and the command's results are awaited again.
    Executor { id: String, response_id: String },
    /// The task's planner: its next request carries the answer, as a Result with `call_id`.
    Planner {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        call_id: Option<String>,
    },
    /// The driver of a requester-driven task (over REST), between commands: it follows the
    /// answer in the event log; the task then waits for its next command again.
    Driver { by: String },
}

impl Asker {
    /// As `requested_by` shows it.
    pub fn display(&self) -> String {
        match self {
            Asker::Executor { id, .. } => id.clone(),
            Asker::Planner { .. } => "planner".to_owned(),
            Asker::Driver { by } => by.clone(),
        }
    }
}

impl Question {
    /// As the requester sees it.
    pub fn request(&self, task_id: &str) -> ClarificationRequest {
        ClarificationRequest {
            version: V1,
            task_id: task_id.to_owned(),
            clarification_id: self.id.clone(),
            question: self.text.clone(),
            data: self.data.clone(),
            requested_by: self.asked_by.display(),
            expires_at: Some(rfc3339(self.deadline_ms)),
        }
    }
}

impl Waiting {
    /// The command in flight, if results are awaited.
    pub fn response_id(&self) -> Option<&str> {
        match self {
            Waiting::Results { response_id } => Some(response_id),
            _ => None,
        }
    }

    /// The open question, if an answer is awaited.
    pub fn question(&self) -> Option<&Question> {
        match self {
            Waiting::Answer(question) => Some(question),
            _ => None,
        }
    }
}

/// Why a task ended badly, with the code every transport reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskError {
    /// The code of ERROR frames, HTTP bodies and NATS error headers.
    pub code: ErrorCode,
    /// What a person reads.
    pub detail: String,
}

impl TaskError {
    /// An error with its code.
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> Self {
        TaskError {
            code,
            detail: detail.into(),
        }
    }
}

/// The agent a task runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorRef {
    /// Its client id (commands go to its delivery subject).
    pub id: String,
    /// Decides the default UFO agent name of its commands.
    pub platform: Platform,
    /// The connection it held when the task was placed on it: only that connection's end
    /// fails the task (`None` in tasks stored before connections were recorded).
    pub connection: Option<String>,
}

impl ExecutorRef {
    /// Whether the end of `connection_id` of `client_id` ends this executor's part.
    pub fn held_by(&self, client_id: &str, connection_id: &str) -> bool {
        self.id == client_id
            && self
                .connection
                .as_deref()
                .is_none_or(|c| c == connection_id)
    }
}

impl Requester {
    /// Whether the requester is a client that announced `extension`.
    pub fn understands(&self, extension: Extension) -> bool {
        matches!(self, Requester::Client { extensions, .. } if extensions.contains(&extension))
    }

    /// Whether the end of `connection_id` of `client_id` is this requester going away.
    pub fn held_by(&self, client_id: &str, connection_id: &str) -> bool {
        match self {
            Requester::Client { id, connection, .. } => {
                id == client_id && connection.as_deref().is_none_or(|c| c == connection_id)
            }
            Requester::Rest(_) | Requester::Nats(_) => false,
        }
    }
}

/// A state change the state machine does not allow: a bug in the caller, refused rather than
/// written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("task '{task_id}' cannot go from {} to {}", from.as_str(), to.as_str())]
pub struct InvalidTransition {
    pub task_id: String,
    /// Where it stands.
    pub from: TaskState,
    /// Where it was asked to go.
    pub to: TaskState,
}

/// A task, live or ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// Also its AIP `session_id`; Galaxy's ids are kept as given.
    pub task_id: String,
    /// UFO's `task_name`, by which `GET /api/task_result/{name}` finds it.
    pub task_name: String,
    /// Changed only through [`Task::enter`].
    pub(crate) state: TaskState,
    /// What was asked, in words.
    pub request: String,
    /// Structured input, passed to planners.
    pub data: Option<Value>,
    /// Who asked; owns the task id.
    pub requester: Requester,
    /// Who runs it.
    pub executor: ExecutorRef,
    /// What a capability lookup asked for (empty for an explicit target).
    pub required_capabilities: Vec<String>,
    /// Who decides the steps.
    pub plan: Plan,
    /// Index of the next step to plan.
    pub step: i32,
    /// What it waits for.
    pub waiting: Waiting,
    /// Started by UFO's `POST /api/dispatch`: dispatching sends a server `task` frame.
    pub ufo_dispatch: bool,
    /// Commands and results of every step, the default result of a scripted task.
    pub history: Vec<Value>,
    /// Higher runs first when the executor is busy.
    pub priority: i32,
    /// Set when it completed (or failed with a result).
    pub result: Option<TaskResult>,
    /// Set when it failed or was canceled.
    pub error: Option<TaskError>,
    /// Where to report the outcome.
    pub callback_url: Option<String>,
    /// The states besides the end whose entry is also sent to the callback.
    pub callback_on: Vec<TaskState>,
    /// The state the last event recorded (not stored: the stored state, when loaded): an
    /// event in another state is a transition.
    pub(crate) evented_state: TaskState,
    /// When the whole task times out (epoch ms).
    pub task_deadline_ms: i64,
    /// The nearest deadline: the task's, or the command's in flight (epoch ms).
    pub deadline_ms: i64,
    /// Epoch ms.
    pub created_ms: i64,
    /// Epoch ms.
    pub updated_ms: i64,
    /// The sequence number of the next event (gap-free from 1).
    pub next_seq: i64,
    /// How many times it was handed to another agent.
    pub handoffs: i32,
    /// The large results of `history`, encoded once when they came (not stored).
    pub encoded_results: EncodedResults,
}

/// What an ended task gives back.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskResult {
    /// Its history: every step's commands and results (a scripted task's result). Named, not
    /// copied: a 90 MiB screenshot in a step's results is held, compared and written once.
    History,
    /// A value of its own: a planner's summary, a REST completion, an executor's `task_end`.
    Value(Value),
}

impl TaskResult {
    /// The result planned: the value given, or else the history.
    pub fn planned(value: Option<Value>) -> Self {
        value.map_or(TaskResult::History, TaskResult::Value)
    }
}

/// Results that take [`KEPT_ENCODED_BYTES`] or more as JSON are kept encoded.
pub const KEPT_ENCODED_BYTES: usize = crate::apart::APART_BYTES;

/// The JSON text of a task's large history results, by history entry, encoded once when they
/// came. A device's 90 MiB screenshot was encoded again for the `task_end` and again for the
/// store, each time by walking the whole value; now both copy this text. Entries never change
/// once in the history, so the text stays right. Results whose text holds an escaped NUL are
/// not kept: the store writes them otherwise ([`aip_store::text::json_text`]).
#[derive(Debug, Clone, Default)]
pub struct EncodedResults(BTreeMap<usize, bytes::Bytes>);

impl PartialEq for EncodedResults {
    /// The same as `history`, in other form: it never makes two tasks differ.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl EncodedResults {
    /// Keeps the text of history entry `entry`'s results if they are large.
    pub fn keep(&mut self, entry: usize, results: &Value) {
        if let Some(text) = aip_store::text::large_json_text(results, KEPT_ENCODED_BYTES) {
            self.0.insert(entry, bytes::Bytes::from(text));
        }
    }

    /// The text of history entry `entry`'s results, if kept.
    pub fn get(&self, entry: usize) -> Option<&bytes::Bytes> {
        self.0.get(&entry)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The size of the texts kept.
    pub fn bytes(&self) -> usize {
        self.0.values().map(bytes::Bytes::len).sum()
    }
}

impl Task {
    /// The `task_end` frame of this ended task, with `response_id` (the requester and the
    /// executor get the same one).
    pub fn task_end(&self, response_id: &str) -> proto_schemas::ServerMessage {
        proto_schemas::server::task_end(
            &self.task_id,
            self.task_end_status(),
            self.result_value(),
            self.error.as_ref().map(|e| e.detail.clone()),
            response_id,
        )
    }

    /// [`Task::task_end`], encoded without copying the result: a value is lent to the frame,
    /// and the history is written in place, its large results from their kept text.
    pub fn encode_task_end(&mut self, response_id: &str) -> Result<Vec<u8>, serde_json::Error> {
        let (value, history) = match self.result.take() {
            Some(TaskResult::Value(value)) => (Some(value), false),
            Some(TaskResult::History) => (None, true),
            None => (None, false),
        };
        let mut frame = proto_schemas::server::task_end(
            &self.task_id,
            self.task_end_status(),
            value,
            self.error.as_ref().map(|e| e.detail.clone()),
            response_id,
        );
        let encoded = if history && frame.metadata.is_none() {
            // Without `metadata` and a result, the frame ends before where `result` goes.
            serde_json::to_vec(&frame).and_then(|mut out| {
                out.pop();
                out.extend_from_slice(br#","result":"#);
                self.write_history(&mut out)?;
                out.push(b'}');
                Ok(out)
            })
        } else {
            if history {
                frame.result = Some(Value::Array(self.history.clone()));
            }
            serde_json::to_vec(&frame)
        };
        self.result = match history {
            true => Some(TaskResult::History),
            false => frame.result.take().map(TaskResult::Value),
        };
        encoded
    }

    /// The result as a value (the history copied, when it is the result).
    pub fn result_value(&self) -> Option<Value> {
        match self.result.as_ref()? {
            TaskResult::History => Some(Value::Array(self.history.clone())),
            TaskResult::Value(value) => Some(value.clone()),
        }
    }

    /// Writes the history as JSON, as `serde_json` would, with the kept texts of its results.
    pub fn write_history(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        // Room for the kept texts up front: a 90 MiB buffer is not grown by doubling.
        out.reserve(self.encoded_results.bytes() + 4096);
        out.push(b'[');
        for (index, entry) in self.history.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            match (self.encoded_results.get(index), entry.as_object()) {
                (Some(results), Some(fields)) => {
                    out.push(b'{');
                    for (i, (key, value)) in fields.iter().enumerate() {
                        if i > 0 {
                            out.push(b',');
                        }
                        serde_json::to_writer(&mut *out, key)?;
                        out.push(b':');
                        if key == "results" {
                            out.extend_from_slice(results);
                        } else {
                            serde_json::to_writer(&mut *out, value)?;
                        }
                    }
                    out.push(b'}');
                }
                _ => serde_json::to_writer(&mut *out, entry)?,
            }
        }
        out.push(b']');
        Ok(())
    }

    fn task_end_status(&self) -> proto_schemas::TaskStatus {
        if self.state == TaskState::Completed {
            proto_schemas::TaskStatus::Completed
        } else {
            proto_schemas::TaskStatus::Failed
        }
    }

    /// Where it stands.
    pub fn state(&self) -> TaskState {
        self.state
    }

    /// Moves the task to `next`, if the state machine allows it.
    pub fn enter(&mut self, next: TaskState) -> Result<(), InvalidTransition> {
        if !self.state.can_become(next) {
            return Err(InvalidTransition {
                task_id: self.task_id.clone(),
                from: self.state,
                to: next,
            });
        }
        self.state = next;
        Ok(())
    }

    /// As REST shows it.
    pub fn view(&self) -> TaskView {
        TaskView {
            task_id: self.task_id.clone(),
            task_name: self.task_name.clone(),
            state: self.state,
            request: self.request.clone(),
            requester: self.requester.display(),
            executor_id: Some(self.executor.id.clone()),
            priority: self.priority,
            result: self.result_value(),
            error: self.error.as_ref().map(|e| e.detail.clone()),
            error_code: self.error.as_ref().map(|e| e.code),
            created_at: rfc3339(self.created_ms),
            updated_at: rfc3339(self.updated_ms),
            events: self.next_seq - 1,
            clarification: self.waiting.question().map(|q| q.request(&self.task_id)),
        }
    }
}

/// Milliseconds since the epoch as RFC 3339.
pub fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Now, in epoch milliseconds.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// What an event in a task's log records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The task was accepted.
    Submitted,
    /// It was sent to its executor.
    Dispatched,
    /// A device echoed a UFO dispatch.
    Echoed,
    /// A command frame was sent.
    CommandSent,
    /// The executor answered a command.
    ResultsReceived,
    /// A planner decided a step and left a note (the agent's conversation turn).
    Planned,
    /// A question was asked; the task waits for the answer.
    ClarificationRequested,
    /// The question was answered.
    ClarificationAnswered,
    /// Someone asked to hand the task to another agent.
    HandoffRequested,
    /// Another agent took it.
    HandoffAccepted,
    /// It ended in this (terminal) state.
    Ended(TaskState),
}

impl EventKind {
    /// The `kind` of the event on the wire and in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Submitted => "submitted",
            EventKind::Dispatched => "dispatched",
            EventKind::Echoed => "echoed",
            EventKind::CommandSent => "command_sent",
            EventKind::ResultsReceived => "results_received",
            EventKind::Planned => "planned",
            EventKind::ClarificationRequested => "clarification_requested",
            EventKind::ClarificationAnswered => "clarification_answered",
            EventKind::HandoffRequested => "handoff_requested",
            EventKind::HandoffAccepted => "handoff_accepted",
            EventKind::Ended(state) => state.as_str(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn task(state: TaskState) -> Task {
        Task {
            task_id: "t".into(),
            task_name: "n".into(),
            state,
            request: "r".into(),
            data: None,
            requester: Requester::Rest("me".into()),
            executor: ExecutorRef {
                id: "d".into(),
                platform: Platform::Linux,
                connection: Some("c1".into()),
            },
            required_capabilities: Vec::new(),
            plan: Plan::Driver,
            step: 0,
            waiting: Waiting::Nothing,
            ufo_dispatch: false,
            history: Vec::new(),
            priority: 0,
            result: None,
            error: None,
            callback_url: None,
            callback_on: Vec::new(),
            evented_state: state,
            task_deadline_ms: 0,
            deadline_ms: 0,
            created_ms: 0,
            updated_ms: 0,
            next_seq: 1,
            handoffs: 0,
            encoded_results: EncodedResults::default(),
        }
    }

    #[test]
    fn a_task_end_written_from_kept_results_is_the_one_encoded_from_the_history() {
        let mut t = task(TaskState::Completed);
        // A large result (kept encoded) with characters that need escaping, then a small one.
        let large: String = (0..40_000)
            .map(|i| format!("\"{i:025}\"\n\u{e9}"))
            .collect();
        for (step, results) in [
            json!([{ "result": { "png": large } }]),
            json!([{ "ok": 1 }]),
        ]
        .into_iter()
        .enumerate()
        {
            t.encoded_results.keep(t.history.len(), &results);
            t.history
                .push(json!({ "step": step, "status": "completed", "results": results }));
        }
        assert!(t.encoded_results.get(0).is_some() && t.encoded_results.get(1).is_none());
        t.result = Some(TaskResult::History);
        let encoded = t.encode_task_end("r1").expect("encoded");
        // Byte for byte what encoding the whole frame gives (but its timestamp).
        let mut frame = t.task_end("r1");
        let written: proto_schemas::ServerMessage =
            serde_json::from_slice(&encoded).expect("a server frame");
        frame.timestamp = written.timestamp.clone();
        assert_eq!(encoded, serde_json::to_vec(&frame).expect("json"));
        assert_eq!(
            t.result,
            Some(TaskResult::History),
            "the result is given back"
        );

        let mut history = Vec::new();
        t.write_history(&mut history).expect("history");
        assert_eq!(history, serde_json::to_vec(&t.history).expect("json"));

        // A result that is not the history is encoded as it is.
        t.result = Some(TaskResult::Value(json!({ "summary": "done" })));
        let encoded = t.encode_task_end("r2").expect("encoded");
        let written: serde_json::Value = serde_json::from_slice(&encoded).expect("json");
        assert_eq!(written["result"], json!({ "summary": "done" }));
    }

    #[test]
    fn the_lifecycle_of_a_task_is_allowed_step_by_step() {
        let mut t = task(TaskState::Submitted);
        for next in [
            TaskState::Dispatched,
            TaskState::Working,
            TaskState::Working,
            TaskState::Completed,
        ] {
            t.enter(next).expect("allowed");
            assert_eq!(t.state(), next);
        }
    }

    #[test]
    fn an_ended_task_never_changes_and_a_refused_change_leaves_the_state() {
        for end in [
            TaskState::Completed,
            TaskState::Failed,
            TaskState::Canceled,
            TaskState::Rejected,
        ] {
            let mut t = task(end);
            for next in TaskState::ALL {
                let refused = t.enter(*next).expect_err("terminal");
                assert_eq!((refused.from, refused.to), (end, *next));
                assert_eq!(t.state(), end);
            }
        }
        let mut queued = task(TaskState::Submitted);
        assert!(
            queued.enter(TaskState::Working).is_err(),
            "a queued task is dispatched before it works"
        );
        assert_eq!(queued.state(), TaskState::Submitted);
    }

    #[test]
    fn any_live_task_can_fail_or_be_canceled() {
        for from in TaskState::ALL.iter().filter(|s| !s.is_terminal()) {
            for end in [TaskState::Failed, TaskState::Canceled] {
                task(*from).enter(end).expect("always allowed while live");
            }
        }
    }

    #[test]
    fn kinds_round_trip_through_their_stored_text() {
        for kind in [
            RequesterKind::Client,
            RequesterKind::Rest,
            RequesterKind::Nats,
        ] {
            assert_eq!(RequesterKind::from_db(kind.as_str()), Some(kind));
        }
        for kind in [
            PlannerKind::Scripted,
            PlannerKind::Planner(PlannerName::Nats),
            PlannerKind::Planner(PlannerName::Http),
            PlannerKind::Planner(PlannerName::Llm),
            PlannerKind::Driver,
        ] {
            assert_eq!(PlannerKind::from_db(kind.as_str()), Some(kind));
        }
        assert_eq!(
            PlannerKind::from_db("remote"),
            Some(PlannerKind::Planner(PlannerName::Nats)),
            "tasks stored before planners had names"
        );
        assert_eq!(PlannerKind::from_db("LLM"), None);
        assert_eq!(
            Requester::Nats("agent".into()).display(),
            "nats:agent",
            "REST shows who asked with its transport"
        );
        assert_eq!(
            Requester::Client {
                id: "c".into(),
                client_type: ClientType::Device,
                connection: None,
                extensions: Vec::new(),
            }
            .display(),
            "c"
        );
    }

    #[test]
    fn only_the_recorded_connection_ends_a_part() {
        let executor = task(TaskState::Working).executor;
        assert!(executor.held_by("d", "c1"));
        assert!(
            !executor.held_by("d", "c2"),
            "a newer connection of the same device"
        );
        assert!(!executor.held_by("e", "c1"));
        let unknown = ExecutorRef {
            connection: None,
            ..executor
        };
        assert!(
            unknown.held_by("d", "any"),
            "tasks stored without a connection"
        );
        let requester = Requester::Client {
            id: "g".into(),
            client_type: ClientType::Constellation,
            connection: Some("k1".into()),
            extensions: Vec::new(),
        };
        assert!(requester.held_by("g", "k1"));
        assert!(!requester.held_by("g", "k2"));
        assert!(!Requester::Rest("g".into()).held_by("g", "k1"));
    }
}
