//! The leader's in-memory state machine.
//!
//! The leading replica holds every live task in memory and applies each change here, without
//! waiting for the database: a change updates the task, appends its events with the next
//! gap-free sequence numbers and queues the frames it sends, all into the open [`Batch`].
//! The applier ([`crate::engine`]) writes the batch in one transaction (group commit) and only
//! then publishes the frames, acknowledges the frames that caused the changes and answers
//! REST callers: nothing anyone is told about is uncommitted. If the write fails, the whole
//! state is dropped and reloaded from the database.
//!
//! Everything here is synchronous and deterministic given its inputs; I/O (registry lookups,
//! the remote planner, database reads for refusals) happens before or after.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use aip_bus::RecentIds;
use proto_schemas::flow::{
    ClarificationResponse, HandoffNotification, TaskResponse, TaskResponseStatus,
};
use proto_schemas::registry::AgentRecord;
use proto_schemas::server::{self, CommandTarget};
use proto_schemas::sessions::{InboundFrame, PlanRequest, PlanStep, TaskState};
use proto_schemas::{
    ActionResult, ClientMessageType, ClientType, Command, ErrorBody, ErrorCode, Extension,
    ResultStatus, ServerMessage, TaskStatus, V1,
};
use serde_json::{Value, json};

use crate::planners::{PlanJob, Planned, PlannerError};
use crate::settings::SessionSettings;
use crate::store::{Batch, EventData, NewEvent, OutFrame, ProcessedHalf, TaskEndOf};
use crate::task::{
    Asker, EventKind, ExecutorRef, InvalidTransition, Question, Task, TaskError, TaskResult,
    Waiting, now_ms,
};
pub use crate::task::{Plan, Requester};
use crate::tombstones::{Owner, Tombstones};

/// Ended connections the leader remembers ([`Machine::choose`]): far more than end while a
/// record of one can still be on its way (the registry hears of an end within milliseconds,
/// and a kept record is dropped when the end is read). About 2 MiB.
const CLOSED_CONNECTIONS_KEPT: usize = 16_384;

/// Where a task should run.
#[derive(Debug, Clone)]
pub enum Placement {
    /// On this agent, which must be an online device.
    Target(String),
    /// On an available agent with all these capabilities.
    Capabilities(Vec<String>),
}

/// The refusal of a task whose explicit target is not connected, in UFO's words.
pub(crate) fn not_connected(new: &NewTask, target: &str) -> ErrorBody {
    let text = match new.requester {
        Requester::Client {
            client_type: ClientType::Constellation,
            ..
        } => format!("Target device '{target}' is not connected"),
        _ => format!("Device '{target}' is not connected"),
    };
    ErrorBody::new(ErrorCode::DeviceNotFound, text)
}

/// A task to start.
#[derive(Debug, Clone)]
pub struct NewTask {
    /// Its id (kept as given; a uuid when absent).
    pub task_id: Option<String>,
    /// Its name (a uuid when absent).
    pub task_name: Option<String>,
    /// What to do.
    pub request: String,
    /// Structured input.
    pub data: Option<Value>,
    /// Who asks.
    pub requester: Requester,
    /// Where it runs.
    pub placement: Placement,
    /// How steps are decided.
    pub plan: Plan,
    /// Higher first.
    pub priority: i32,
    /// Where to report the outcome: [`crate::callbacks::CallbackTarget::stored`].
    pub callback_url: Option<String>,
    /// The states besides the end that are reported there too.
    pub callback_on: Vec<TaskState>,
    /// Fail after this long (capped by the service's task timeout).
    pub timeout_secs: Option<u64>,
    /// A UFO `POST /api/dispatch`: the device is sent a server `task` frame and echoes it.
    pub ufo_dispatch: bool,
    /// What its requester may ask of the service.
    pub allowance: Allowance,
}

/// What a requester may ask of the service beyond what every task may: how many live tasks
/// it holds and how high a priority it gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowance {
    /// An operator (a plain API key, or REST without keys): no quota, any priority.
    Operator,
    /// Everyone else (clients, NATS, limited keys): the service's
    /// `max_live_tasks_per_requester` and `max_client_priority`, or these when given.
    Requester {
        /// Live tasks per requester id at most.
        max_live: Option<usize>,
        /// The highest priority.
        max_priority: Option<i32>,
    },
}

impl Allowance {
    /// The service's quota and ceiling.
    pub const DEFAULT: Allowance = Allowance::Requester {
        max_live: None,
        max_priority: None,
    };
}

impl NewTask {
    /// A task with the defaults every transport shares: ids and name chosen by the service,
    /// no data, priority 0, no callback, the service's timeout, not a UFO dispatch.
    pub fn new(request: String, requester: Requester, placement: Placement, plan: Plan) -> Self {
        NewTask {
            task_id: None,
            task_name: None,
            request,
            data: None,
            requester,
            placement,
            plan,
            priority: 0,
            callback_url: None,
            callback_on: Vec::new(),
            timeout_secs: None,
            ufo_dispatch: false,
            allowance: Allowance::DEFAULT,
        }
    }
}

/// A task to start, with what was looked up for it before it reached the leader.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub new: NewTask,
    /// Agents it may run on (one for an explicit target), from the registry.
    pub candidates: Vec<AgentRecord>,
    /// For a given task id: the requester of the task that already has it in the database.
    pub existing_owner: Option<String>,
}

/// A client `task` frame, prepared.
// The answer is the small, rare case; a prepared frame travels boxed (`Op::Frame`).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum TaskFrame {
    /// A task to start.
    Start {
        /// A device's frame with a task name: the echo of a dispatch of that name, if one
        /// waits.
        echo_name: Option<String>,
        /// Otherwise the task to start, or why it cannot start.
        start: Result<Prepared, ErrorBody>,
    },
    /// Seed 004's agent management from a client that announced `agent_management`,
    /// answered by the registry: no task starts; the client gets `task_end` with this
    /// TaskResponse as its result.
    Answered(TaskResponse),
    /// The database could not say whether its task id is taken (it is unreachable): not
    /// applied, and delivered again until it can, never refused for that.
    Unprepared(String),
}

/// Why a change was not applied.
#[derive(Debug, Clone)]
pub enum Refusal {
    /// Refused, with this answer.
    Now(ErrorBody),
    /// Refused with this answer, unless the frame (this id) was applied before: a redelivered
    /// frame is dropped silently.
    UnlessSeen(ErrorBody, String),
    /// The task is not live on this leader; the answer depends on the database (it ended,
    /// it never existed, or the frame was applied before it ended).
    NotLive { task_id: String },
    /// Not applied for a passing cause (the database could not be read): the frame is
    /// delivered again, and the cause is never sent as a refusal.
    Retry(String),
}

impl Refusal {
    fn now(code: ErrorCode, detail: impl Into<String>) -> Self {
        Refusal::Now(ErrorBody::new(code, detail))
    }
}

impl From<InvalidTransition> for Refusal {
    fn from(e: InvalidTransition) -> Self {
        tracing::error!("{e}");
        Refusal::now(ErrorCode::Internal, e.to_string())
    }
}

/// An executor's share of the live tasks: how many of its tasks run, and which wait.
#[derive(Debug, Default)]
struct Load {
    running: i64,
    /// Highest priority first, then oldest.
    queued: BTreeSet<(Reverse<i32>, i64, String)>,
}

/// What a committed batch leaves to do.
#[derive(Debug, Default)]
pub struct Pending {
    /// What to write.
    pub batch: Batch,
    /// Steps to ask a planner for.
    pub plans: Vec<PlanJob>,
    /// The traces of the ops applied (empty while tracing is off): the group commit links them.
    pub links: Vec<aip_bus::trace::Context>,
    ended: Vec<String>,
}

/// The live state of the leader.
pub struct Machine {
    settings: SessionSettings,
    /// Shared with the batch being written: [`Machine::take`] hands over each changed task
    /// without copying it (a task's history can hold results of tens of MiB), and a task
    /// changed again while its batch is written is copied then ([`Arc::make_mut`]).
    tasks: HashMap<String, Arc<Task>>,
    /// Client id → live tasks it takes part in (as a client requester or as executor).
    clients: HashMap<String, HashSet<String>>,
    executors: HashMap<String, Load>,
    /// Requester id → its live tasks (for the per-requester quota).
    live_per_requester: HashMap<String, usize>,
    tombstones: Tombstones,
    /// Connections whose end was applied: a task prepared with an older record of its
    /// executor (`crate::targets`, or a registry that had not heard of the end yet) must not
    /// start on one.
    closed_connections: RecentIds,
    /// Remote planning asked for: task → when.
    planning: HashMap<String, i64>,
    pending: Pending,
    /// Where processed-frame ids go now.
    processed_into: ProcessedHalf,
    dirty: Vec<String>,
    dirty_set: HashSet<String>,
}

impl Machine {
    /// The state of a new leader: every live task from the database.
    pub fn new(settings: SessionSettings, live: Vec<Task>) -> Self {
        let mut core = Machine {
            settings,
            tasks: HashMap::with_capacity(live.len()),
            clients: HashMap::new(),
            executors: HashMap::new(),
            live_per_requester: HashMap::new(),
            tombstones: Tombstones::default(),
            closed_connections: RecentIds::new(CLOSED_CONNECTIONS_KEPT),
            planning: HashMap::new(),
            pending: Pending::default(),
            processed_into: ProcessedHalf::at(now_ms()),
            dirty: Vec::new(),
            dirty_set: HashSet::new(),
        };
        let mut unplanned = Vec::new();
        for task in live {
            core.index(&task);
            core.count_live(task.requester.id(), true);
            if task.waiting == Waiting::Plan {
                unplanned.push(task.task_id.clone());
            }
            core.tasks.insert(task.task_id.clone(), Arc::new(task));
        }
        // Steps a crash left unplanned (a scripted one is planned at once, a remote one
        // after the first commit).
        for id in unplanned {
            if let Err(e) = core.with_task(&id, |core, task| core.plan(task)) {
                tracing::error!(task = %id, "a step left unplanned by a crash stays unplanned: {e:?}");
            }
        }
        core
    }

    /// Live tasks held.
    pub fn live(&self) -> usize {
        self.tasks.len()
    }

    /// Whether the open batch has changes.
    pub fn has_changes(&self) -> bool {
        !self.dirty.is_empty() || !self.pending.batch.is_empty() || !self.pending.plans.is_empty()
    }

    /// Changes in the open batch (to bound its size).
    pub fn changes(&self) -> usize {
        self.pending.batch.events.len() + self.pending.batch.processed.len()
    }

    /// Closes the open batch: what to write, and what to do once written.
    pub fn take(&mut self) -> Pending {
        let mut pending = std::mem::take(&mut self.pending);
        pending.batch.processed_into = self.processed_into;
        self.dirty_set.clear();
        for id in self.dirty.drain(..) {
            if let Some(task) = self.tasks.get(&id) {
                pending.batch.tasks.push(Arc::clone(task));
            }
        }
        pending
    }

    /// The batch is committed: ended tasks leave memory.
    pub fn committed(&mut self, pending: &Pending) {
        let now = now_ms();
        for id in &pending.ended {
            if self.tasks.get(id).is_some_and(|t| t.state().is_terminal())
                && let Some(task) = self.tasks.remove(id)
            {
                self.count_live(task.requester.id(), false);
                self.tombstones.add(&task.task_id, task.requester.id(), now);
            }
        }
    }

    /// Records a published outbox row for deletion in the next batch.
    pub fn published(&mut self, msg_ids: impl IntoIterator<Item = String>) {
        self.pending.batch.published.extend(msg_ids);
    }

    /// Stale groups of outbox frames split in the next batch (each group once).
    pub fn split(&mut self, splits: Vec<crate::outbox::Split>) {
        for split in splits {
            if !self.pending.batch.split.iter().any(|s| s.key == split.key) {
                self.pending.batch.split.push(split);
            }
        }
    }

    /// The processed-frame ids of the next batches go to `half`; when that is not where
    /// they went so far, the next batch empties it first (a new period began).
    pub fn processed_into(&mut self, half: ProcessedHalf) {
        if self.processed_into != half {
            self.processed_into = half;
            self.pending.batch.clear_processed = true;
        }
    }

    fn index(&mut self, task: &Task) {
        if let Some(requester) = task.requester.client_id() {
            self.clients
                .entry(requester.to_owned())
                .or_default()
                .insert(task.task_id.clone());
        }
        let executor = &task.executor.id;
        self.clients
            .entry(executor.clone())
            .or_default()
            .insert(task.task_id.clone());
        let entry = self.executors.entry(executor.clone()).or_default();
        match task.state() {
            TaskState::Submitted => {
                entry.queued.insert((
                    Reverse(task.priority),
                    task.created_ms,
                    task.task_id.clone(),
                ));
            }
            state if !state.is_terminal() => entry.running += 1,
            _ => {}
        }
    }

    /// One more (`true`) or one fewer live task of `requester`.
    fn count_live(&mut self, requester: &str, more: bool) {
        if more {
            *self
                .live_per_requester
                .entry(requester.to_owned())
                .or_default() += 1;
        } else if let Some(count) = self.live_per_requester.get_mut(requester) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.live_per_requester.remove(requester);
            }
        }
    }

    /// Refuses a task its requester's allowance does not cover: a priority above its ceiling,
    /// or one live task more than its quota.
    fn check_allowance(&self, new: &NewTask) -> Result<(), Refusal> {
        let Allowance::Requester {
            max_live,
            max_priority,
        } = new.allowance
        else {
            return Ok(());
        };
        let ceiling = max_priority.unwrap_or(self.settings.max_client_priority);
        if new.priority > ceiling {
            return Err(Refusal::now(
                ErrorCode::Forbidden,
                format!(
                    "priority {} is above the ceiling of {ceiling} for `{}` (sessions.max_client_priority, or its key's max_priority)",
                    new.priority,
                    new.requester.id()
                ),
            ));
        }
        let quota = max_live.unwrap_or(self.settings.max_live_tasks_per_requester);
        let live = self
            .live_per_requester
            .get(new.requester.id())
            .copied()
            .unwrap_or(0);
        if live >= quota {
            return Err(Refusal::now(
                ErrorCode::RateLimited,
                format!(
                    "`{}` already has {live} live tasks, its quota (sessions.max_live_tasks_per_requester, or its key's max_live_tasks); retry when one ends",
                    new.requester.id()
                ),
            ));
        }
        Ok(())
    }

    fn unindex_client(&mut self, client: &str, task_id: &str) {
        if let Some(set) = self.clients.get_mut(client) {
            set.remove(task_id);
            if set.is_empty() {
                self.clients.remove(client);
            }
        }
    }

    fn touch(&mut self, task_id: &str) {
        if self.dirty_set.insert(task_id.to_owned()) {
            self.dirty.push(task_id.to_owned());
        }
    }

    fn event(&mut self, task: &mut Task, kind: EventKind, data: Option<Value>) -> i64 {
        self.record_event(task, kind, data.map(EventData::Value))
    }

    /// Appends an event whose data may refer to the task ([`EventData`]).
    fn record_event(&mut self, task: &mut Task, kind: EventKind, data: Option<EventData>) -> i64 {
        let seq = task.next_seq;
        task.next_seq += 1;
        let state = task.state();
        self.pending.batch.events.push(NewEvent {
            task_id: task.task_id.clone(),
            seq,
            at_ms: now_ms(),
            kind,
            state,
            data,
        });
        // A transition the requester asked to hear of (the end and questions always are).
        if state != task.evented_state {
            task.evented_state = state;
            if state.is_terminal()
                || state == TaskState::InputRequired
                || task.callback_on.contains(&state)
            {
                self.notify(task, seq);
            }
        }
        seq
    }

    /// Records the trace of an op being applied, for the group commit's links.
    pub fn link(&mut self, span: &tracing::Span) {
        if let Some(cx) = aip_bus::trace::context_of(span) {
            self.pending.links.push(cx);
        }
    }

    /// Queues the task's callback (if it has one) for the event `seq`, once.
    fn notify(&mut self, task: &Task, seq: i64) {
        let Some(callback) = crate::callbacks::notification(task, seq) else {
            return;
        };
        let queued = &self.pending.batch.callbacks;
        if queued
            .last()
            .is_none_or(|c| c.callback_id != callback.callback_id)
        {
            self.pending.batch.callbacks.push(callback);
        }
    }

    /// Queues a frame for the outbox, for whichever connection `client_id` has when it is
    /// delivered (a requester's `task_end` still reaches a client that connected again).
    fn send(&mut self, client_id: &str, frame: &ServerMessage) {
        self.send_on(client_id, None, frame);
    }

    /// Queues a frame for the executor, for the connection its task is bound to only: a
    /// command sent again after a gateway's crash must not reach the device's next
    /// connection, which would run it twice (the task fails when the bound connection's end
    /// is announced).
    fn send_to_executor(&mut self, executor: &ExecutorRef, frame: &ServerMessage) {
        self.send_on(&executor.id, executor.connection.as_deref(), frame);
    }

    /// Queues a frame for the outbox. A frame that cannot be encoded is logged and not
    /// sent (an empty payload would reach the client as garbage).
    fn send_on(&mut self, client_id: &str, connection: Option<&str>, frame: &ServerMessage) {
        match serde_json::to_vec(frame) {
            Ok(payload) => self.queue(client_id, connection, payload.into(), None),
            Err(e) => tracing::error!(
                client = %client_id,
                kind = %frame.kind,
                "a frame could not be encoded and is not sent: {e}"
            ),
        }
    }

    /// Queues an encoded frame for the outbox.
    fn queue(
        &mut self,
        client_id: &str,
        connection: Option<&str>,
        payload: bytes::Bytes,
        task_end_of: Option<TaskEndOf>,
    ) {
        self.pending.batch.outbox.push(OutFrame {
            msg_id: server::new_id(),
            client_id: client_id.to_owned(),
            connection: connection.map(str::to_owned),
            payload,
            task_end_of,
            trace: aip_bus::trace::context_of(&tracing::Span::current()),
        });
    }

    fn applied(&mut self, msg_id: Option<&str>) {
        if let Some(id) = msg_id {
            self.pending.batch.processed.push(id.to_owned());
        }
    }

    /// Runs `change` on a live task, then stores it back, marked changed when `change`
    /// succeeded. A change checks before it changes anything: a refused change leaves the
    /// task as it was.
    fn with_task<T>(
        &mut self,
        task_id: &str,
        change: impl FnOnce(&mut Self, &mut Task) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let Some(mut task) = self.tasks.remove(task_id) else {
            return Err(Refusal::NotLive {
                task_id: task_id.to_owned(),
            });
        };
        let result = change(self, Arc::make_mut(&mut task));
        let changed = result.is_ok();
        self.tasks.insert(task_id.to_owned(), task);
        if changed {
            self.touch(task_id);
        }
        result
    }

    /// Like [`Machine::with_task`] for changes the service makes itself (a deadline, a
    /// release, a disconnect): a refusal there is a bug, logged.
    fn change_internally(
        &mut self,
        task_id: &str,
        why: &str,
        change: impl FnOnce(&mut Self, &mut Task) -> Result<(), Refusal>,
    ) {
        if let Err(refusal) = self.with_task(task_id, change) {
            tracing::error!(task = %task_id, "{why}: not applied: {refusal:?}");
        }
    }

    // ----- starting tasks -----

    /// Starts a task: records it, dispatches it if its executor has room (or queues it),
    /// and acknowledges a client requester.
    pub fn submit(&mut self, prepared: Prepared, msg_id: Option<&str>) -> Result<Task, Refusal> {
        let Prepared {
            new,
            candidates,
            existing_owner,
        } = prepared;
        if let Some(task_id) = &new.task_id {
            let requester = new.requester.id();
            let same = |owner: &str| match owner == requester {
                true => Owner::Same,
                false => Owner::Other,
            };
            let owner = self
                .tasks
                .get(task_id)
                .map(|t| same(t.requester.id()))
                .or_else(|| self.tombstones.owner(task_id, requester))
                .or_else(|| existing_owner.as_deref().map(same));
            if let Some(owner) = owner {
                let detail = match owner {
                    Owner::Same => {
                        format!("session_id '{task_id}' is already in use by one of your tasks")
                    }
                    Owner::Other => format!("session_id '{task_id}' is owned by another client"),
                };
                let body = ErrorBody::new(ErrorCode::Conflict, detail);
                return Err(match msg_id {
                    Some(id) => Refusal::UnlessSeen(body, id.to_owned()),
                    None => Refusal::Now(body),
                });
            }
        }
        if self.tasks.len() >= self.settings.max_live_tasks {
            return Err(Refusal::now(
                ErrorCode::Unavailable,
                format!(
                    "the session service already runs {} live tasks, its limit (sessions.max_live_tasks); retry later",
                    self.tasks.len()
                ),
            ));
        }
        self.check_allowance(&new)?;
        let executor = self.choose(&new, candidates)?;
        let now = now_ms();
        let timeout = new
            .timeout_secs
            .unwrap_or(self.settings.task_timeout_secs)
            .min(self.settings.task_timeout_secs);
        let task_deadline =
            now + i64::try_from(timeout.saturating_mul(1000)).unwrap_or(i64::MAX / 2);
        let required_capabilities = match &new.placement {
            Placement::Capabilities(c) => c.clone(),
            Placement::Target(_) => Vec::new(),
        };
        let mut task = Task {
            task_id: new.task_id.clone().unwrap_or_else(server::new_id),
            task_name: new.task_name.clone().unwrap_or_else(server::new_id),
            state: TaskState::Submitted,
            request: new.request.clone(),
            data: new.data.clone(),
            requester: new.requester.clone(),
            executor: ExecutorRef {
                id: executor.agent_id.clone(),
                platform: executor.platform,
                connection: Some(executor.connection_id.clone()),
            },
            required_capabilities,
            plan: new.plan.clone(),
            step: 0,
            waiting: Waiting::Nothing,
            ufo_dispatch: new.ufo_dispatch,
            history: Vec::new(),
            priority: new.priority,
            result: None,
            error: None,
            callback_url: new.callback_url.clone(),
            callback_on: new.callback_on.clone(),
            evented_state: TaskState::Submitted,
            task_deadline_ms: task_deadline,
            deadline_ms: task_deadline,
            created_ms: now,
            updated_ms: now,
            next_seq: 1,
            handoffs: 0,
            encoded_results: Default::default(),
        };
        self.applied(msg_id);
        metrics::counter!("aip_sessions_tasks_started_total", "planner" => task.plan.kind().as_str())
            .increment(1);
        let data = json!({
            "requester": task.requester.display(),
            "executor_id": executor.agent_id,
            "planner": task.plan.kind().as_str(),
        });
        self.event(&mut task, EventKind::Submitted, Some(data));
        self.index(&task);
        self.count_live(task.requester.id(), true);
        let task_id = task.task_id.clone();
        self.tasks.insert(task_id.clone(), Arc::new(task));
        self.touch(&task_id);
        if let Some(client) = new.requester.client_id() {
            self.send(client, &server::task_accepted(&task_id));
        }
        self.release(&executor.agent_id);
        self.tasks
            .get(&task_id)
            .map(|t| Task::clone(t))
            .ok_or_else(|| {
                Refusal::now(
                    ErrorCode::Internal,
                    format!("task '{task_id}' vanished while it was started"),
                )
            })
    }

    /// The executor: the one candidate of an explicit target, or the candidate with the
    /// fewest running tasks.
    fn choose(&self, new: &NewTask, candidates: Vec<AgentRecord>) -> Result<AgentRecord, Refusal> {
        let load = |agent: &AgentRecord| {
            self.executors
                .get(&agent.agent_id)
                .map_or(0, |e| e.running + e.queued.len() as i64)
        };
        let mut best: Option<(i64, AgentRecord)> = None;
        for agent in candidates {
            if self.closed_connections.contains(&agent.connection_id) {
                continue;
            }
            let l = load(&agent);
            if best.as_ref().is_none_or(|(b, _)| l < *b) {
                best = Some((l, agent));
            }
        }
        best.map(|(_, a)| a).ok_or_else(|| match &new.placement {
            Placement::Capabilities(c) => Refusal::now(
                ErrorCode::CapabilityMismatch,
                format!("no available agent has the capabilities {c:?}"),
            ),
            Placement::Target(t) => Refusal::Now(not_connected(new, t)),
        })
    }

    /// An executor's share no longer holds `task`: one task fewer running, or out of its
    /// queue.
    fn let_go(&mut self, executor: &str, task: &Task, was_running: bool) {
        let Some(entry) = self.executors.get_mut(executor) else {
            return;
        };
        if was_running {
            entry.running -= 1;
        } else {
            entry.queued.remove(&(
                Reverse(task.priority),
                task.created_ms,
                task.task_id.clone(),
            ));
        }
    }

    /// Dispatches an executor's queued tasks while it has room.
    fn release(&mut self, executor: &str) {
        loop {
            let Some(entry) = self.executors.get_mut(executor) else {
                return;
            };
            if entry.running >= self.settings.max_tasks_per_agent {
                return;
            }
            let Some((_, _, next)) = entry.queued.pop_first() else {
                if entry.running == 0 {
                    self.executors.remove(executor);
                }
                return;
            };
            entry.running += 1;
            self.change_internally(&next, "dispatching a queued task", |core, task| {
                core.dispatch(task)
            });
        }
    }

    /// Submitted → dispatched: a UFO dispatch sends the server `task` frame and waits for the
    /// echo; a scripted task gets its first step at once; a remote one is planned after
    /// commit. (The caller has counted the task as running.)
    fn dispatch(&mut self, task: &mut Task) -> Result<(), Refusal> {
        task.enter(TaskState::Dispatched)?;
        task.updated_ms = now_ms();
        if task.ufo_dispatch {
            task.waiting = Waiting::Echo;
            let frame = server::dispatch_task(&task.request, &task.task_name, &task.task_id);
            self.send_to_executor(&task.executor, &frame);
        } else if task.plan != Plan::Driver {
            task.waiting = Waiting::Plan;
        }
        self.event(
            task,
            EventKind::Dispatched,
            Some(json!({ "executor_id": task.executor.id })),
        );
        if task.waiting == Waiting::Plan {
            self.plan(task)?;
        }
        Ok(())
    }

    // ----- planning -----

    /// Plans the next step of a task that needs one: a scripted step at once, a remote one
    /// after commit.
    fn plan(&mut self, task: &mut Task) -> Result<(), Refusal> {
        match &task.plan {
            Plan::Scripted(steps) => {
                let step = usize::try_from(task.step).unwrap_or(0);
                let decision = match steps.get(step).cloned() {
                    Some(actions) => PlanStep::Commands {
                        actions,
                        agent_name: None,
                        process_name: None,
                        root_name: None,
                    },
                    None => PlanStep::Complete { result: None },
                };
                self.apply_plan(task, Ok(decision), None)
            }
            Plan::Planner(planner) => {
                let planner = *planner;
                self.pending.plans.push(PlanJob {
                    planner,
                    request: plan_request(task),
                });
                self.planning.insert(task.task_id.clone(), now_ms());
                Ok(())
            }
            Plan::Driver => Ok(()),
        }
    }

    /// A planner's answer for `step` of a task, with its note for the event log; ignored if
    /// the task moved on.
    pub fn planned(&mut self, task_id: &str, step: i32, planned: Planned) {
        let awaited = self.tasks.get(task_id).is_some_and(|t| {
            t.waiting == Waiting::Plan && t.step == step && !t.state().is_terminal()
        });
        if !awaited {
            return;
        }
        self.change_internally(task_id, "applying a plan", |core, task| {
            core.planning.remove(&task.task_id);
            if let Some(note) = planned.note {
                core.event(task, EventKind::Planned, Some(note));
            }
            core.apply_plan(task, planned.decision, planned.handoff_candidates)
        });
    }

    fn apply_plan(
        &mut self,
        task: &mut Task,
        decision: Result<PlanStep, PlannerError>,
        handoff_candidates: Option<Result<Vec<AgentRecord>, ErrorBody>>,
    ) -> Result<(), Refusal> {
        match decision {
            Ok(PlanStep::Commands {
                actions,
                agent_name,
                process_name,
                root_name,
            }) => {
                let step = CommandStep {
                    actions,
                    agent_name,
                    process_name,
                    root_name,
                };
                self.apply_commands(task, step).map(|_| ())
            }
            Ok(PlanStep::Complete { result }) => {
                let result = TaskResult::planned(result);
                self.finish(task, TaskState::Completed, Some(result), None)
            }
            Ok(PlanStep::Fail { error }) => {
                let error = TaskError::new(ErrorCode::CommandFailed, error);
                self.finish(task, TaskState::Failed, None, Some(error))
            }
            Ok(PlanStep::Handoff {
                target_id,
                required_capabilities,
                reason,
            }) => {
                let to = match target_id {
                    Some(target) => Placement::Target(target),
                    None => Placement::Capabilities(required_capabilities),
                };
                let ask = HandoffAsk {
                    to,
                    reason,
                    by: "planner".to_owned(),
                    candidates: handoff_candidates.unwrap_or_else(|| {
                        Err(ErrorBody::new(
                            ErrorCode::Internal,
                            "the handoff's candidates were not looked up",
                        ))
                    }),
                };
                match self.check_handoff(task, &ask) {
                    Ok(agent) => self.hand_off(task, ask, agent, None),
                    // The planner hears why, and plans again.
                    Err(refusal) => {
                        let detail = match refusal {
                            Refusal::Now(body) | Refusal::UnlessSeen(body, _) => body.detail,
                            Refusal::NotLive { .. } => "the task has ended".to_owned(),
                            Refusal::Retry(cause) => cause,
                        };
                        let result = ActionResult {
                            status: ResultStatus::Failure,
                            error: Some(format!("handoff refused: {detail}")),
                            result: None,
                            namespace: None,
                            call_id: None,
                        };
                        task.history.push(json!({
                            "step": task.step, "handoff_refused": detail, "results": [result],
                        }));
                        task.step += 1;
                        task.updated_ms = now_ms();
                        self.plan(task)
                    }
                }
            }
            Ok(PlanStep::Clarify {
                question,
                data,
                timeout_secs,
                call_id,
            }) => self.ask(
                task,
                Asking {
                    id: None,
                    text: question,
                    data,
                    asked_by: Asker::Planner { call_id },
                    timeout_secs,
                },
            ),
            Err(e) => {
                let error = TaskError::new(e.code(), e.to_string());
                self.finish(task, TaskState::Failed, None, Some(error))
            }
        }
    }

    /// Sends one step's commands: a `command` frame with a fresh `response_id`, now pending;
    /// the command's deadline starts. Returns the `response_id` and the event's sequence.
    fn apply_commands(
        &mut self,
        task: &mut Task,
        step: CommandStep,
    ) -> Result<(String, i64), Refusal> {
        task.enter(TaskState::Working)?;
        let target = CommandTarget {
            session_id: task.task_id.clone(),
            task_name: Some(task.task_name.clone()),
            agent_name: step
                .agent_name
                .unwrap_or_else(|| task.executor.platform.default_agent_name().to_owned()),
            process_name: step.process_name,
            root_name: step.root_name,
        };
        let response_id = server::new_id();
        let frame = server::command(
            &target,
            step.actions,
            TaskStatus::Continue,
            response_id.clone(),
        );
        task.waiting = Waiting::Results {
            response_id: response_id.clone(),
        };
        let now = now_ms();
        task.updated_ms = now;
        let command_deadline =
            now + i64::try_from(self.settings.command_timeout_secs * 1000).unwrap_or(i64::MAX / 2);
        task.deadline_ms = task.task_deadline_ms.min(command_deadline);
        let data =
            json!({ "step": task.step, "response_id": response_id, "actions": frame.actions });
        let seq = self.event(task, EventKind::CommandSent, Some(data));
        self.send_to_executor(&task.executor, &frame);
        Ok((response_id, seq))
    }

    /// Tasks whose remote planning was asked for long ago without an answer (a lost request),
    /// asked again.
    pub fn replan_stalled(&mut self, now: i64) {
        let stalled: Vec<PlanJob> = self
            .tasks
            .values()
            .filter(|t| t.waiting == Waiting::Plan && !t.state().is_terminal())
            .filter_map(|t| match t.plan {
                Plan::Planner(planner) => {
                    let wait = i64::try_from(self.settings.planning_window_ms(planner))
                        .unwrap_or(i64::MAX / 4)
                        + REPLAN_MARGIN_MS;
                    let lost = self
                        .planning
                        .get(&t.task_id)
                        .is_none_or(|at| *at < now - wait);
                    lost.then(|| PlanJob {
                        planner,
                        request: plan_request(t),
                    })
                }
                Plan::Scripted(_) | Plan::Driver => None,
            })
            .collect();
        for job in stalled {
            self.planning.insert(job.request.task_id.clone(), now);
            self.pending.plans.push(job);
        }
    }

    // ----- frames from clients -----

    /// The answer to seed 004's agent management asked in a `task` frame: `task_end` to the
    /// client, `completed` with the TaskResponse when it succeeded, else `failed` with its
    /// error too.
    fn answer_agent_frame(
        &mut self,
        inbound: &InboundFrame,
        msg_id: &str,
        response: &TaskResponse,
    ) {
        self.applied(Some(msg_id));
        let (status, error) = match response.status {
            TaskResponseStatus::Failed => (TaskStatus::Failed, response.error.clone()),
            TaskResponseStatus::Success | TaskResponseStatus::InProgress => {
                (TaskStatus::Completed, None)
            }
        };
        let frame = server::task_end(
            &response.task_id,
            status,
            serde_json::to_value(response).ok(),
            error,
            &server::new_id(),
        );
        self.send(&inbound.client_id, &frame);
    }

    /// Applies a client frame the session service handles.
    pub fn frame(
        &mut self,
        inbound: &mut InboundFrame,
        msg_id: &str,
        task: Option<TaskFrame>,
        handoff_candidates: Option<Result<Vec<AgentRecord>, ErrorBody>>,
    ) -> Result<(), Refusal> {
        match inbound.frame.kind {
            ClientMessageType::Task => {
                let (echo_name, start) = match task {
                    None => {
                        return Err(Refusal::now(
                            ErrorCode::Internal,
                            "task frame was not prepared",
                        ));
                    }
                    Some(TaskFrame::Answered(response)) => {
                        self.answer_agent_frame(inbound, msg_id, &response);
                        return Ok(());
                    }
                    Some(TaskFrame::Unprepared(cause)) => return Err(Refusal::Retry(cause)),
                    Some(TaskFrame::Start { echo_name, start }) => (echo_name, start),
                };
                if let Some(name) = &echo_name
                    && self.echo(inbound, name, msg_id)
                {
                    return Ok(());
                }
                // Unless applied before: a frame whose group was written although the write
                // reported an error (the database went away after committing) comes back,
                // and its task already runs; a refusal (say, the registry is down now)
                // would contradict it.
                let prepared =
                    start.map_err(|body| Refusal::UnlessSeen(body, msg_id.to_owned()))?;
                self.submit(prepared, Some(msg_id)).map(|_| ())
            }
            ClientMessageType::CommandResults => self.results(inbound, msg_id),
            ClientMessageType::TaskEnd => self.client_task_end(inbound, msg_id),
            ClientMessageType::ClarificationRequest => self.executor_asks(inbound, msg_id),
            ClientMessageType::Handoff => {
                Self::extension_check(inbound, Extension::Handoff)?;
                let frame = &inbound.frame;
                let ask = HandoffAsk {
                    to: handoff_placement(inbound),
                    reason: frame
                        .metadata_value("reason")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .unwrap_or_else(|| "asked by the executor".to_owned()),
                    by: inbound.client_id.clone(),
                    candidates: handoff_candidates.unwrap_or_else(|| {
                        Err(ErrorBody::new(
                            ErrorCode::Internal,
                            "the handoff's candidates were not looked up",
                        ))
                    }),
                };
                let session = frame.session_id.clone().unwrap_or_default();
                self.with_task(&session, |core, task| {
                    Self::check_executor(task, inbound)?;
                    let agent = core.check_handoff(task, &ask)?;
                    core.hand_off(task, ask, agent, Some(msg_id))
                })
            }
            ClientMessageType::ClarificationResponse => {
                let frame = &inbound.frame;
                Self::extension_check(inbound, Extension::Clarification)?;
                let meta = |key: &str| frame.metadata_value(key);
                let Some(clarification_id) = meta("clarification_id").and_then(Value::as_str)
                else {
                    return Err(Refusal::now(
                        ErrorCode::ProtocolError,
                        "clarification_response: `metadata.clarification_id` is required",
                    ));
                };
                let answer = frame
                    .request
                    .clone()
                    .or_else(|| meta("answer").and_then(Value::as_str).map(str::to_owned))
                    .unwrap_or_default();
                let answer = Answer {
                    clarification_id: clarification_id.to_owned(),
                    text: answer,
                    data: meta("data").cloned(),
                    by: Answerer::Client(inbound.client_id.clone()),
                };
                let session = frame.session_id.clone().unwrap_or_default();
                self.answer(&session, answer, Some(msg_id)).map(|_| ())
            }
            other => Err(Refusal::now(
                ErrorCode::ProtocolError,
                format!("`{other}` frames are not handled by this broker yet"),
            )),
        }
    }

    /// A device's client `task` that answers a UFO dispatch: acknowledge with the dispatched
    /// session id and start planning. False if no dispatch of that name waits for it.
    fn echo(&mut self, inbound: &InboundFrame, task_name: &str, msg_id: &str) -> bool {
        let client = &inbound.client_id;
        let Some(candidates) = self.clients.get(client) else {
            return false;
        };
        let waiting = candidates
            .iter()
            .filter_map(|id| self.tasks.get(id))
            .filter(|t| {
                t.waiting == Waiting::Echo
                    && t.task_name == task_name
                    && t.executor.id == *client
                    && t.state() == TaskState::Dispatched
            })
            .min_by_key(|t| (t.created_ms, t.task_id.clone()))
            .map(|t| t.task_id.clone());
        let Some(task_id) = waiting else {
            return false;
        };
        let client = client.clone();
        let echoed = self.with_task(&task_id, |core, task| {
            task.enter(TaskState::Working)?;
            task.waiting = Waiting::Plan;
            task.updated_ms = now_ms();
            core.event(
                task,
                EventKind::Echoed,
                Some(json!({ "client_id": client })),
            );
            core.send(&client, &server::task_accepted(&task.task_id));
            core.plan(task)
        });
        if echoed.is_ok() {
            self.applied(Some(msg_id));
        }
        echoed.is_ok()
    }

    /// Checks that a frame's sender is the executor of a live session.
    fn check_executor(task: &Task, inbound: &InboundFrame) -> Result<(), Refusal> {
        if task.executor.id != inbound.client_id {
            let session = &task.task_id;
            return Err(Refusal::now(
                ErrorCode::Forbidden,
                format!(
                    "{} refused: '{}' is not the executor of session '{session}'",
                    inbound.frame.kind, inbound.client_id
                ),
            ));
        }
        Ok(())
    }

    fn results(&mut self, inbound: &mut InboundFrame, msg_id: &str) -> Result<(), Refusal> {
        let session = inbound.frame.session_id.clone().unwrap_or_default();
        let answered = inbound.frame.prev_response_id.clone();
        self.with_task(&session, |core, task| {
            Self::check_executor(task, inbound)?;
            let answered = answered.as_deref();
            let awaited = task.waiting.response_id();
            if awaited.is_none() || awaited != answered {
                let body = ErrorBody::new(
                    ErrorCode::ProtocolError,
                    format!(
                        "command_results answer `{}`, but session '{session}' is waiting for `{}`",
                        answered.unwrap_or(""),
                        awaited.unwrap_or("nothing")
                    ),
                );
                return Err(Refusal::UnlessSeen(body, msg_id.to_owned()));
            }
            task.enter(TaskState::Working)?;
            core.applied(Some(msg_id));
            // Moved from the frame into the entry: a large result (a screenshot) is not
            // copied on the way.
            let results = Value::Array(
                inbound
                    .frame
                    .action_results
                    .take()
                    .unwrap_or_default()
                    .into_iter()
                    .map(ActionResult::into_value)
                    .collect(),
            );
            task.encoded_results.keep(task.history.len(), &results);
            let mut entry =
                json!({ "step": task.step, "response_id": answered, "status": inbound.frame.status });
            if let Some(fields) = entry.as_object_mut() {
                fields.insert("results".to_owned(), results);
            }
            task.history.push(entry);
            let entry = task.history.len() - 1;
            task.step += 1;
            task.waiting = if task.plan == Plan::Driver {
                Waiting::Nothing
            } else {
                Waiting::Plan
            };
            task.deadline_ms = task.task_deadline_ms;
            task.updated_ms = now_ms();
            core.record_event(task, EventKind::ResultsReceived, Some(EventData::Entry(entry)));
            if task.waiting == Waiting::Plan {
                core.plan(task)?;
            }
            Ok(())
        })
    }

    fn client_task_end(&mut self, inbound: &InboundFrame, msg_id: &str) -> Result<(), Refusal> {
        let frame = &inbound.frame;
        if !inbound.extensions.contains(&Extension::TaskEndResult) {
            return Err(Refusal::now(
                ErrorCode::ProtocolError,
                "Unknown message type: task_end (announce the `task_end_result` extension at register to end tasks yourself)",
            ));
        }
        let session = frame.session_id.clone().unwrap_or_default();
        self.with_task(&session, |core, task| {
            Self::check_executor(task, inbound)?;
            core.applied(Some(msg_id));
            if frame.status == TaskStatus::Completed {
                let result = frame.result.clone().map(TaskResult::Value);
                core.finish(task, TaskState::Completed, result, None)
            } else {
                let error = frame
                    .error
                    .clone()
                    .unwrap_or_else(|| "the executor reported a failure".to_owned());
                core.finish(
                    task,
                    TaskState::Failed,
                    frame.result.clone().map(TaskResult::Value),
                    Some(TaskError::new(ErrorCode::CommandFailed, error)),
                )
            }
        })
    }

    /// A client's connection ended: the tasks placed on that connection fail, the tasks it
    /// asked for are canceled. A newer connection of the same client keeps its tasks (the
    /// end of a connection can be announced after the client registered again).
    pub fn closed(&mut self, client_id: &str, connection_id: &str) {
        self.closed_connections.first_time(connection_id);
        let Some(ids) = self.clients.get(client_id) else {
            return;
        };
        let mut ids: Vec<String> = ids.iter().cloned().collect();
        ids.sort_by_key(|id| {
            self.tasks
                .get(id)
                .map(|t| (t.created_ms, t.task_id.clone()))
        });
        for id in ids {
            let Some(task) = self.tasks.get(&id) else {
                continue;
            };
            if task.state().is_terminal() {
                continue;
            }
            let as_executor = task.executor.held_by(client_id, connection_id);
            if !as_executor && !task.requester.held_by(client_id, connection_id) {
                continue;
            }
            self.change_internally(&id, "ending a task of a closed connection", |core, task| {
                if as_executor {
                    let error = TaskError::new(
                        ErrorCode::ConnectionFailed,
                        "Task was cancelled because target device disconnected",
                    );
                    core.finish(task, TaskState::Failed, None, Some(error))
                } else {
                    let error = TaskError::new(
                        ErrorCode::TaskCanceled,
                        format!(
                            "Task was cancelled because its requester '{client_id}' disconnected"
                        ),
                    );
                    core.finish(task, TaskState::Canceled, None, Some(error))
                }
            });
        }
    }

    // ----- REST -----

    fn live_check(task: &Task) -> Result<(), Refusal> {
        if task.state().is_terminal() {
            return Err(Refusal::NotLive {
                task_id: task.task_id.clone(),
            });
        }
        Ok(())
    }

    fn driven_check(task: &Task) -> Result<(), Refusal> {
        Self::live_check(task)?;
        if task.plan != Plan::Driver {
            return Err(Refusal::now(
                ErrorCode::Conflict,
                format!(
                    "task '{}' is driven by its {} planner; submit it with \"driver\": true to drive it over REST",
                    task.task_id,
                    task.plan.kind().as_str()
                ),
            ));
        }
        Ok(())
    }

    /// The driver of a requester-driven task asks its requester a question between commands:
    /// the task waits in `input_required` for the answer, as for any other question.
    pub fn ask_as_driver(
        &mut self,
        task_id: &str,
        question: DriverQuestion,
    ) -> Result<Task, Refusal> {
        self.with_task(task_id, |core, task| {
            Self::driven_check(task)?;
            if task.state() == TaskState::Submitted {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!("task '{task_id}' waits for its executor to be free"),
                ));
            }
            match &task.waiting {
                Waiting::Nothing => {}
                Waiting::Results { response_id } => {
                    return Err(Refusal::now(
                        ErrorCode::Conflict,
                        format!(
                            "task '{task_id}' waits for the results of command `{response_id}`; ask once they are in"
                        ),
                    ));
                }
                Waiting::Answer(open) => {
                    return Err(Refusal::now(
                        ErrorCode::Conflict,
                        format!(
                            "task '{task_id}' already has an open question (`{}`)",
                            open.id
                        ),
                    ));
                }
                Waiting::Echo | Waiting::Plan => {
                    return Err(Refusal::now(
                        ErrorCode::Conflict,
                        format!("task '{task_id}' cannot take a question now"),
                    ));
                }
            }
            if question.text.trim().is_empty() {
                return Err(Refusal::now(
                    ErrorCode::InvalidRequest,
                    "the question is empty",
                ));
            }
            let asking = Asking {
                id: question.id,
                text: question.text,
                data: question.data,
                asked_by: Asker::Driver { by: question.by },
                timeout_secs: question.timeout_secs,
            };
            core.ask(task, asking)?;
            Ok(task.clone())
        })
    }

    /// Sends commands into a requester-driven task; returns the command's `response_id` and
    /// the sequence number of its `command_sent` event. One command at a time.
    pub fn send_commands(
        &mut self,
        task_id: &str,
        step: CommandStep,
    ) -> Result<(String, i64), Refusal> {
        self.with_task(task_id, |core, task| {
            Self::driven_check(task)?;
            if task.state() == TaskState::Submitted {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!("task '{task_id}' waits for its executor to be free"),
                ));
            }
            if let Some(pending) = task.waiting.response_id() {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!("task '{task_id}' still waits for the results of command `{pending}`"),
                ));
            }
            if let Some(open) = task.waiting.question() {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!(
                        "task '{task_id}' waits for the answer to question `{}`; send commands once it is answered",
                        open.id
                    ),
                ));
            }
            core.apply_commands(task, step)
        })
    }

    /// Ends a requester-driven task.
    pub fn complete(
        &mut self,
        task_id: &str,
        result: Option<Value>,
        error: Option<String>,
    ) -> Result<Task, Refusal> {
        let (state, error) = match error {
            None => (TaskState::Completed, None),
            Some(e) => (
                TaskState::Failed,
                Some(TaskError::new(ErrorCode::CommandFailed, e)),
            ),
        };
        self.with_task(task_id, |core, task| {
            Self::driven_check(task)?;
            core.finish(task, state, result.map(TaskResult::Value), error)?;
            Ok(task.clone())
        })
    }

    /// Cancels a live task; the executor and a client requester are told.
    pub fn cancel(&mut self, task_id: &str, reason: &str) -> Result<Task, Refusal> {
        self.with_task(task_id, |core, task| {
            Self::live_check(task)?;
            let error = TaskError::new(ErrorCode::TaskCanceled, format!("canceled: {reason}"));
            core.finish(task, TaskState::Canceled, None, Some(error))?;
            Ok(task.clone())
        })
    }

    /// Fails every task whose deadline has passed.
    pub fn expire_due(&mut self, now: i64) {
        let due: Vec<String> = self
            .tasks
            .values()
            .filter(|t| !t.state().is_terminal() && t.deadline_ms < now)
            .map(|t| t.task_id.clone())
            .collect();
        let command_timeout = self.settings.command_timeout_secs;
        for id in due {
            self.change_internally(&id, "expiring a task", |core, task| {
                let detail = if let Some(q) = task.waiting.question() {
                    format!(
                        "the question `{}` ({:?}) was not answered in time",
                        q.id, q.text
                    )
                } else if task.task_deadline_ms < now {
                    format!(
                        "task timed out after {} s",
                        (task.task_deadline_ms - task.created_ms) / 1000
                    )
                } else {
                    format!(
                        "no results for command `{}` within {command_timeout} s",
                        task.waiting.response_id().unwrap_or("?"),
                    )
                };
                let error = TaskError::new(ErrorCode::TaskTimeout, detail);
                core.finish(task, TaskState::Failed, None, Some(error))
            });
        }
    }

    // ----- handoffs -----

    /// Hands a task to another agent (REST, NATS).
    pub fn handoff(&mut self, task_id: &str, ask: HandoffAsk) -> Result<Task, Refusal> {
        self.with_task(task_id, |core, task| {
            let agent = core.check_handoff(task, &ask)?;
            core.hand_off(task, ask, agent, None)?;
            Ok(task.clone())
        })
    }

    /// Whether a task can be handed off as asked, and to whom: changes nothing.
    fn check_handoff(&self, task: &Task, ask: &HandoffAsk) -> Result<AgentRecord, Refusal> {
        Self::live_check(task)?;
        let task_id = &task.task_id;
        if task.ufo_dispatch {
            return Err(Refusal::now(
                ErrorCode::Conflict,
                format!(
                    "task '{task_id}' is a UFO dispatch, which runs on the device that took it"
                ),
            ));
        }
        if task.waiting.question().is_some() {
            return Err(Refusal::now(
                ErrorCode::Conflict,
                format!("task '{task_id}' waits for an answer; answer its open question first"),
            ));
        }
        let max = i32::try_from(self.settings.max_handoffs).unwrap_or(i32::MAX);
        if task.handoffs >= max {
            return Err(Refusal::now(
                ErrorCode::Conflict,
                format!(
                    "task '{task_id}' was handed off {} times, the limit (sessions.max_handoffs)",
                    task.handoffs
                ),
            ));
        }
        if ask.reason.trim().is_empty() {
            return Err(Refusal::now(
                ErrorCode::InvalidRequest,
                "a handoff needs a `reason`",
            ));
        }
        let candidates = ask.candidates.clone().map_err(Refusal::Now)?;
        let offered = !candidates.is_empty();
        let load = |id: &str| self.executors.get(id).map_or(0, |e| e.running);
        let old = &task.executor.id;
        let chosen = candidates
            .into_iter()
            .filter(|a| a.agent_id != *old && load(&a.agent_id) < self.settings.max_tasks_per_agent)
            .min_by_key(|a| load(&a.agent_id));
        chosen.ok_or_else(|| match &ask.to {
            Placement::Target(target) if target == old => Refusal::now(
                ErrorCode::Conflict,
                format!("task '{task_id}' already runs on '{target}'"),
            ),
            Placement::Target(target) if offered => Refusal::now(
                ErrorCode::Conflict,
                format!("'{target}' cannot take task '{task_id}' now: it runs all the tasks it may"),
            ),
            Placement::Target(target) => Refusal::now(
                ErrorCode::DeviceNotFound,
                format!("Device '{target}' is not connected"),
            ),
            Placement::Capabilities(c) if c.is_empty() => Refusal::now(
                ErrorCode::InvalidRequest,
                "a handoff needs `target_id` or `required_capabilities`",
            ),
            Placement::Capabilities(c) => Refusal::now(
                ErrorCode::CapabilityMismatch,
                format!("no other available agent with the capabilities {c:?} can take task '{task_id}' now"),
            ),
        })
    }

    /// Moves a task to `agent` (checked by [`Machine::check_handoff`]): the events, the old
    /// executor released and told (`task_end`, failed, saying where the task went), the
    /// requester told (a `handoff` frame if it announced the extension; a callback), and the
    /// task going on from where it was: the current step again for scripted steps, the next
    /// request to the planner naming the new executor.
    fn hand_off(
        &mut self,
        task: &mut Task,
        ask: HandoffAsk,
        agent: AgentRecord,
        msg_id: Option<&str>,
    ) -> Result<(), Refusal> {
        self.applied(msg_id);
        let was_running = task.state() != TaskState::Submitted;
        let to = match &ask.to {
            Placement::Target(target) => json!({ "target_id": target }),
            Placement::Capabilities(c) => json!({ "required_capabilities": c }),
        };
        self.event(
            task,
            EventKind::HandoffRequested,
            Some(json!({ "to": to, "reason": ask.reason, "requested_by": ask.by })),
        );
        let old_executor = task.executor.clone();
        let old = old_executor.id.clone();
        let notification = HandoffNotification {
            version: V1,
            task_id: task.task_id.clone(),
            current_agent_id: old.clone(),
            new_agent_id: agent.agent_id.clone(),
            reason: ask.reason.clone(),
        };
        // The old executor lets go.
        if task.requester.client_id() != Some(old.as_str()) {
            self.unindex_client(&old, &task.task_id);
        }
        self.let_go(&old, task, was_running);
        if was_running {
            let frame = server::task_end(
                &task.task_id,
                TaskStatus::Failed,
                None,
                Some(format!(
                    "the task was handed off to '{}': {}",
                    agent.agent_id, ask.reason
                )),
                &server::new_id(),
            );
            self.send_to_executor(&old_executor, &frame);
        }
        // The new one takes it.
        task.executor = ExecutorRef {
            id: agent.agent_id.clone(),
            platform: agent.platform,
            connection: Some(agent.connection_id.clone()),
        };
        self.clients
            .entry(agent.agent_id.clone())
            .or_default()
            .insert(task.task_id.clone());
        self.executors
            .entry(agent.agent_id.clone())
            .or_default()
            .running += 1;
        task.handoffs += 1;
        metrics::counter!("aip_sessions_handoffs_total").increment(1);
        if task.state() != TaskState::Dispatched {
            task.enter(TaskState::Dispatched)?;
        }
        let now = now_ms();
        task.updated_ms = now;
        task.deadline_ms = task.task_deadline_ms;
        let seq = self.event(
            task,
            EventKind::HandoffAccepted,
            serde_json::to_value(&notification).ok(),
        );
        if task.requester.understands(Extension::Handoff)
            && let Some(client) = task.requester.client_id().map(str::to_owned)
        {
            self.send(&client, &server::handoff(&notification));
        }
        // A new executor that speaks the extension gets the task's context first.
        if agent.extensions.contains(&Extension::Handoff) {
            let mut frame = server::handoff(&notification);
            if let Some(metadata) = frame.metadata.as_mut() {
                metadata.insert(
                    "context".to_owned(),
                    json!({ "request": task.request, "data": task.data, "results": task.history }),
                );
            }
            self.send_to_executor(&task.executor, &frame);
        }
        self.notify(task, seq);
        match task.plan {
            Plan::Driver => task.waiting = Waiting::Nothing,
            Plan::Scripted(_) => {
                task.waiting = Waiting::Plan;
                self.plan(task)?;
            }
            Plan::Planner(_) => {
                // A new step: an answer planned for the old executor is stale.
                task.history.push(json!({
                    "step": task.step, "handoff": notification, "results": [],
                }));
                task.step += 1;
                task.waiting = Waiting::Plan;
                self.plan(task)?;
            }
        }
        self.release(&old);
        Ok(())
    }

    // ----- clarifications -----

    /// An extension frame from a client that did not announce the extension is refused as UFO
    /// refuses an unknown type.
    fn extension_check(inbound: &InboundFrame, extension: Extension) -> Result<(), Refusal> {
        if inbound.extensions.contains(&extension) {
            return Ok(());
        }
        Err(Refusal::now(
            ErrorCode::ProtocolError,
            format!(
                "Unknown message type: {} (announce the `{extension}` extension at register to \
                 use it)",
                inbound.frame.kind
            ),
        ))
    }

    /// The executor asks a question while it runs a command (`clarification_request`).
    fn executor_asks(&mut self, inbound: &InboundFrame, msg_id: &str) -> Result<(), Refusal> {
        Self::extension_check(inbound, Extension::Clarification)?;
        let frame = &inbound.frame;
        let meta = |key: &str| frame.metadata_value(key);
        let text = frame
            .request
            .clone()
            .or_else(|| meta("question").and_then(Value::as_str).map(str::to_owned))
            .filter(|q| !q.trim().is_empty());
        let Some(text) = text else {
            return Err(Refusal::now(
                ErrorCode::ProtocolError,
                "clarification_request: the question (`request` or `metadata.question`) is empty",
            ));
        };
        let session = frame.session_id.clone().unwrap_or_default();
        self.with_task(&session, |core, task| {
            Self::check_executor(task, inbound)?;
            Self::live_check(task)?;
            let Some(response_id) = task.waiting.response_id().map(str::to_owned) else {
                return Err(Refusal::UnlessSeen(
                    ErrorBody::new(
                        ErrorCode::Conflict,
                        format!(
                            "session '{session}' runs no command of yours now, so there is \
                             nothing to ask about"
                        ),
                    ),
                    msg_id.to_owned(),
                ));
            };
            core.applied(Some(msg_id));
            let asking = Asking {
                id: meta("clarification_id")
                    .and_then(Value::as_str)
                    .filter(|id| !id.is_empty() && id.len() <= proto_schemas::MAX_ID_BYTES)
                    .map(str::to_owned),
                text,
                data: meta("data").cloned(),
                asked_by: Asker::Executor {
                    id: inbound.client_id.clone(),
                    response_id,
                },
                timeout_secs: meta("timeout_secs").and_then(Value::as_u64),
            };
            core.ask(task, asking)
        })
    }

    /// Pauses a task on a question: `input_required` until the answer or the question's
    /// deadline; the event; the question to the requester (a frame if it announced
    /// `clarification`); a callback when the task has one.
    fn ask(&mut self, task: &mut Task, asking: Asking) -> Result<(), Refusal> {
        task.enter(TaskState::InputRequired)?;
        metrics::counter!("aip_sessions_clarifications_total", "event" => "asked").increment(1);
        let now = now_ms();
        let limit = self.settings.clarification_timeout_secs.max(1);
        let secs = asking.timeout_secs.unwrap_or(limit).clamp(1, limit);
        let question = Question {
            id: asking.id.unwrap_or_else(server::new_id),
            text: asking.text,
            data: asking.data,
            asked_by: asking.asked_by,
            deadline_ms: now + i64::try_from(secs * 1000).unwrap_or(i64::MAX / 4),
        };
        let request = question.request(&task.task_id);
        task.deadline_ms = task.task_deadline_ms.min(question.deadline_ms);
        task.updated_ms = now;
        task.waiting = Waiting::Answer(Box::new(question));
        self.planning.remove(&task.task_id);
        self.event(
            task,
            EventKind::ClarificationRequested,
            serde_json::to_value(&request).ok(),
        );
        if task.requester.understands(Extension::Clarification)
            && let Some(client) = task.requester.client_id().map(str::to_owned)
        {
            self.send(&client, &server::clarification_request(&request));
        }
        Ok(())
    }

    /// The answer to a task's open question, from its requester (a frame, REST or NATS): the
    /// task goes on in `working`, the answer going where the question came from.
    pub fn answer(
        &mut self,
        task_id: &str,
        answer: Answer,
        msg_id: Option<&str>,
    ) -> Result<Task, Refusal> {
        self.with_task(task_id, |core, task| {
            Self::live_check(task)?;
            if let Answerer::Client(client) = &answer.by
                && task.requester.client_id() != Some(client.as_str())
            {
                return Err(Refusal::now(
                    ErrorCode::Forbidden,
                    format!("'{client}' is not the requester of task '{task_id}' and cannot answer its questions"),
                ));
            }
            let Some(question) = task.waiting.question().cloned() else {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!(
                        "task '{task_id}' has no open question (it is {}); `{}` was answered \
                         already or never asked",
                        task.state().as_str(),
                        answer.clarification_id
                    ),
                ));
            };
            if question.id != answer.clarification_id {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!(
                        "`{}` is not the open question of task '{task_id}' (that is `{}`: {:?})",
                        answer.clarification_id, question.id, question.text
                    ),
                ));
            }
            if answer.text.trim().is_empty() {
                return Err(Refusal::now(
                    ErrorCode::InvalidRequest,
                    "the answer is empty",
                ));
            }
            core.applied(msg_id);
            task.enter(TaskState::Working)?;
            let now = now_ms();
            task.updated_ms = now;
            let provided_by = answer.by.display();
            let answered = json!({
                "clarification_id": question.id,
                "question": question.text,
                "answer": answer.text,
                "data": answer.data,
                "provided_by": provided_by,
            });
            core.event(task, EventKind::ClarificationAnswered, Some(answered.clone()));
            metrics::counter!("aip_sessions_clarifications_total", "event" => "answered")
                .increment(1);
            match question.asked_by {
                Asker::Planner { call_id } => {
                    let result = ActionResult {
                        status: ResultStatus::Success,
                        error: None,
                        result: Some(answered),
                        namespace: None,
                        call_id,
                    };
                    task.history.push(json!({
                        "step": task.step,
                        "clarification_id": question.id,
                        "results": [result],
                    }));
                    task.step += 1;
                    task.waiting = Waiting::Plan;
                    task.deadline_ms = task.task_deadline_ms;
                    core.plan(task)?;
                }
                Asker::Driver { .. } => {
                    task.waiting = Waiting::Nothing;
                    task.deadline_ms = task.task_deadline_ms;
                }
                Asker::Executor { id, response_id } => {
                    let command_timeout = i64::try_from(core.settings.command_timeout_secs * 1000)
                        .unwrap_or(i64::MAX / 4);
                    task.waiting = Waiting::Results { response_id };
                    task.deadline_ms = task.task_deadline_ms.min(now + command_timeout);
                    let response = ClarificationResponse {
                        version: V1,
                        task_id: task.task_id.clone(),
                        clarification_id: question.id,
                        answer: answer.text,
                        data: answer.data,
                        provided_by,
                    };
                    let frame = server::clarification_response(&response);
                    if id == task.executor.id {
                        core.send_to_executor(&task.executor, &frame);
                    } else {
                        core.send(&id, &frame);
                    }
                }
            }
            Ok(task.clone())
        })
    }

    // ----- ending -----

    /// Ends a task: state, result or error, the event, `task_end` to the requester (a client)
    /// and to the executor, then the executor's next queued task.
    fn finish(
        &mut self,
        task: &mut Task,
        state: TaskState,
        result: Option<TaskResult>,
        error: Option<TaskError>,
    ) -> Result<(), Refusal> {
        let was_running = task.state() != TaskState::Submitted;
        task.enter(state)?;
        let code = error.as_ref().map_or("", |e| e.code.as_str());
        metrics::counter!("aip_sessions_tasks_ended_total", "state" => state.as_str(), "error_code" => code)
            .increment(1);
        metrics::histogram!("aip_sessions_task_duration_seconds")
            .record((now_ms() - task.created_ms).max(0) as f64 / 1000.0);
        task.waiting = Waiting::Nothing;
        task.updated_ms = now_ms();
        if error.is_some() {
            task.error = error;
        }
        // The event refers to the result rather than copying it.
        let mut fields = serde_json::Map::new();
        fields.insert(
            "error".to_owned(),
            task.error.as_ref().map(|e| e.detail.clone()).into(),
        );
        fields.insert(
            "error_code".to_owned(),
            task.error.as_ref().map(|e| e.code.as_str()).into(),
        );
        task.result = result;
        self.record_event(
            task,
            EventKind::Ended(state),
            Some(EventData::Ended(fields)),
        );
        self.planning.remove(&task.task_id);

        let response_id = server::new_id();
        // Encoded once for both: a result can be tens of MiB.
        let payload = match task.encode_task_end(&response_id) {
            Ok(payload) => Some(bytes::Bytes::from(payload)),
            Err(e) => {
                tracing::error!(task = %task.task_id, "the task_end frame could not be encoded and is not sent: {e}");
                None
            }
        };
        let task_end_of = TaskEndOf {
            task_id: task.task_id.clone(),
            response_id,
        };
        let requester_client = task.requester.client_id().map(str::to_owned);
        if let (Some(requester), Some(payload)) = (&requester_client, &payload) {
            self.queue(requester, None, payload.clone(), Some(task_end_of.clone()));
        }
        if let Some(requester) = &requester_client {
            self.unindex_client(requester, &task.task_id);
        }
        self.pending.ended.push(task.task_id.clone());
        let executor = task.executor.id.clone();
        self.unindex_client(&executor, &task.task_id);
        if was_running
            && requester_client.as_deref() != Some(executor.as_str())
            && let Some(payload) = payload
        {
            let connection = task.executor.connection.clone();
            self.queue(&executor, connection.as_deref(), payload, Some(task_end_of));
        }
        self.let_go(&executor, task, was_running);
        self.release(&executor);
        Ok(())
    }
}

/// How much longer than the planner's own timeout a lost planning request waits before it is
/// asked again (the answer may be on its way).
const REPLAN_MARGIN_MS: i64 = 5_000;

/// Where a `handoff` frame asks the task to go: `target_id` (or `metadata.new_agent_id`), else
/// `metadata.required_capabilities`.
pub fn handoff_placement(inbound: &InboundFrame) -> Placement {
    let frame = &inbound.frame;
    let meta = |key: &str| frame.metadata_value(key);
    let target = frame.target_id.clone().or_else(|| {
        meta("new_agent_id")
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    match target {
        Some(target) => Placement::Target(target),
        None => Placement::Capabilities(
            meta("required_capabilities")
                .and_then(|c| serde_json::from_value(c.clone()).ok())
                .unwrap_or_default(),
        ),
    }
}

/// A handoff to apply: where to, why, who asks, and the agents the registry offered.
#[derive(Debug, Clone)]
pub struct HandoffAsk {
    pub to: Placement,
    pub reason: String,
    pub by: String,
    pub candidates: Result<Vec<AgentRecord>, ErrorBody>,
}

/// A question to ask.
struct Asking {
    /// The asker's own id for it, if it gave one.
    id: Option<String>,
    text: String,
    data: Option<Value>,
    asked_by: Asker,
    timeout_secs: Option<u64>,
}

/// A question the driver of a requester-driven task asks.
#[derive(Debug, Clone)]
pub struct DriverQuestion {
    /// The driver's own id for it (else one is made).
    pub id: Option<String>,
    /// The question.
    pub text: String,
    /// Structured detail.
    pub data: Option<Value>,
    /// Who asks (`rest:<name>`).
    pub by: String,
    /// How long to wait for the answer (at most `clarification_timeout_secs`).
    pub timeout_secs: Option<u64>,
}

/// An answer to a task's open question.
#[derive(Debug, Clone)]
pub struct Answer {
    pub clarification_id: String,
    pub text: String,
    pub data: Option<Value>,
    pub by: Answerer,
}

/// Who answers a question.
#[derive(Debug, Clone)]
pub enum Answerer {
    /// A client by frame: it must be the task's requester.
    Client(String),
    /// A REST caller (an API key holder), by the name it gave.
    Rest(String),
    /// A NATS client, by the agent id it gave.
    Nats(String),
}

impl Answerer {
    /// As `provided_by` shows it.
    pub fn display(&self) -> String {
        match self {
            Answerer::Client(id) => id.clone(),
            Answerer::Rest(name) => format!("rest:{name}"),
            Answerer::Nats(name) => format!("nats:{name}"),
        }
    }
}

/// One step's commands, from a planner or a driver.
#[derive(Debug, Clone)]
pub struct CommandStep {
    pub actions: Vec<Command>,
    /// The UFO agent to run them (default: the platform's agent).
    pub agent_name: Option<String>,
    /// Passed through to the device.
    pub process_name: Option<String>,
    /// Passed through to the device.
    pub root_name: Option<String>,
}

/// What the remote planner is asked about a task.
fn plan_request(task: &Task) -> PlanRequest {
    let last_results: Vec<ActionResult> = task
        .history
        .last()
        .and_then(|h| h.get("results"))
        .and_then(|r| serde_json::from_value(r.clone()).ok())
        .unwrap_or_default();
    PlanRequest {
        version: V1,
        task_id: task.task_id.clone(),
        task_name: task.task_name.clone(),
        request: task.request.clone(),
        data: task.data.clone(),
        executor_id: task.executor.id.clone(),
        platform: task.executor.platform,
        step: u32::try_from(task.step).unwrap_or(0),
        last_results,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str, executor: &str, priority: i32, steps: usize) -> Prepared {
        let command: Command = serde_json::from_value(
            json!({ "tool_name": "echo", "tool_type": "action", "parameters": {} }),
        )
        .expect("command");
        let step = vec![command];
        Prepared {
            new: NewTask {
                task_id: Some(id.to_owned()),
                task_name: None,
                request: "r".to_owned(),
                data: None,
                requester: Requester::Rest("me".to_owned()),
                placement: Placement::Target(executor.to_owned()),
                plan: Plan::Scripted(vec![step; steps]),
                priority,
                callback_url: None,
                callback_on: Vec::new(),
                timeout_secs: None,
                ufo_dispatch: false,
                allowance: Allowance::Operator,
            },
            candidates: vec![aip_testkit::device_record(executor)],
            existing_owner: None,
        }
    }

    fn machine() -> Machine {
        Machine::new(SessionSettings::default(), Vec::new())
    }

    #[test]
    fn a_task_frame_the_database_could_not_check_is_retried_not_refused() {
        let mut m = machine();
        let mut inbound: InboundFrame = serde_json::from_value(json!({
            "version": 1, "gateway_id": "gw", "connection_id": "c1", "client_id": "g@d",
            "client_type": "constellation", "platform": "linux",
            "received_at": "2026-11-26T00:00:00Z",
            "frame": {
                "type": "task", "client_type": "constellation", "client_id": "g@d",
                "target_id": "d", "session_id": "t1", "request": "do it", "status": "continue",
            },
        }))
        .expect("an inbound frame");
        let unreachable = "database error: connection refused".to_owned();
        let outcome = m.frame(
            &mut inbound,
            "m1",
            Some(TaskFrame::Unprepared(unreachable.clone())),
            None,
        );
        assert!(
            matches!(&outcome, Err(Refusal::Retry(cause)) if *cause == unreachable),
            "{outcome:?}"
        );
        assert!(
            !m.has_changes(),
            "nothing applied, nothing sent: the frame comes again"
        );
    }

    /// Commits the open batch, as the applier does after a successful write.
    fn commit(m: &mut Machine) -> Pending {
        let pending = m.take();
        m.committed(&pending);
        pending
    }

    #[test]
    fn one_task_runs_per_device_and_the_queue_goes_by_priority() {
        let mut m = machine();
        let first = m.submit(task("a", "d", 0, 1), None).expect("a");
        assert_eq!(
            first.state(),
            TaskState::Working,
            "a scripted first step is sent at once"
        );
        m.submit(task("low", "d", 1, 1), None).expect("low");
        m.submit(task("high", "d", 5, 1), None).expect("high");
        commit(&mut m);
        assert_eq!(m.tasks["low"].state(), TaskState::Submitted);
        assert_eq!(m.tasks["high"].state(), TaskState::Submitted);

        m.cancel("a", "test").expect("cancel");
        let pending = commit(&mut m);
        assert!(
            !m.tasks.contains_key("a"),
            "an ended task leaves memory once committed"
        );
        assert_eq!(
            m.tasks["high"].state(),
            TaskState::Working,
            "the higher priority goes next"
        );
        assert_eq!(m.tasks["low"].state(), TaskState::Submitted);
        let kinds: Vec<&str> = pending
            .batch
            .events
            .iter()
            .map(|e| e.kind.as_str())
            .collect();
        assert_eq!(kinds, ["canceled", "dispatched", "command_sent"]);
    }

    #[test]
    fn events_are_gap_free_and_every_changed_task_is_written_once() {
        let mut m = machine();
        m.submit(task("t", "d", 0, 2), None).expect("t");
        m.cancel("t", "x").expect("cancel");
        let pending = commit(&mut m);
        let seqs: Vec<i64> = pending.batch.events.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            [1, 2, 3, 4],
            "submitted, dispatched, command_sent, canceled"
        );
        assert_eq!(pending.batch.tasks.len(), 1);
        assert_eq!(pending.batch.tasks[0].next_seq, 5);
        assert_eq!(pending.batch.tasks[0].state(), TaskState::Canceled);
    }

    #[test]
    fn the_end_of_an_older_connection_leaves_the_tasks_of_a_newer_one() {
        let mut m = machine();
        // Placed on the device's connection "c" (its registry record).
        m.submit(task("t", "d", 0, 2), None).expect("t");
        commit(&mut m);
        m.closed("d", "an-older-connection");
        assert!(!m.has_changes(), "a stale end changes nothing");
        assert_eq!(m.tasks["t"].state(), TaskState::Working);
        m.closed("d", "c");
        let pending = commit(&mut m);
        assert_eq!(pending.batch.tasks[0].state(), TaskState::Failed);
        assert_eq!(
            pending.batch.tasks[0].error.as_ref().map(|e| e.code),
            Some(ErrorCode::ConnectionFailed)
        );
    }

    #[test]
    fn a_task_is_not_started_on_a_connection_that_ended() {
        let mut m = machine();
        // The end of the device's connection "c" was applied, and nothing of the device was
        // live: it changed nothing to write.
        m.closed("d", "c");
        assert!(!m.has_changes());
        // A task prepared with a record from before the end (a kept one, or a registry that had
        // not heard of it yet) names that connection: it is refused as the registry would have.
        let refused = m.submit(task("t", "d", 0, 1), None);
        assert!(
            matches!(&refused, Err(Refusal::Now(body))
                if body.error_code == ErrorCode::DeviceNotFound
                    && body.detail == "Device 'd' is not connected"),
            "{refused:?}"
        );
        assert!(m.tasks.is_empty());
        // The device's next connection takes tasks.
        let mut again = task("t", "d", 0, 1);
        again.candidates[0].connection_id = "c2".to_owned();
        let started = m.submit(again, None).expect("on the new connection");
        assert_eq!(started.executor.connection.as_deref(), Some("c2"));
    }

    #[test]
    fn an_id_stays_taken_after_its_task_ended_and_left_memory() {
        let mut m = machine();
        m.submit(task("x", "d", 0, 1), None).expect("x");
        m.closed("d", "c");
        commit(&mut m);
        assert!(m.tasks.is_empty());
        let again = m.submit(task("x", "d", 0, 1), None);
        assert!(
            matches!(&again, Err(Refusal::Now(body)) if body.error_code == ErrorCode::Conflict),
            "{again:?}"
        );
        // From a frame, a refusal that may be a redelivery is checked against the frames
        // applied before it is sent.
        let again = m.submit(task("x", "d", 0, 1), Some("conn:7"));
        assert!(matches!(again, Err(Refusal::UnlessSeen(_, id)) if id == "conn:7"));
    }

    #[test]
    fn a_full_leader_refuses_new_tasks() {
        let settings = SessionSettings {
            max_live_tasks: 1,
            ..SessionSettings::default()
        };
        let mut m = Machine::new(settings, Vec::new());
        m.submit(task("one", "d1", 0, 1), None).expect("one");
        let refused = m.submit(task("two", "d2", 0, 1), None);
        assert!(
            matches!(&refused, Err(Refusal::Now(body)) if body.error_code == ErrorCode::Unavailable),
            "{refused:?}"
        );
    }

    #[test]
    fn a_new_leader_rebuilds_the_queues_from_the_live_rows() {
        // What a new leader rebuilds from the database: live rows only.
        let mut m = machine();
        m.submit(task("a", "d", 0, 1), None).expect("a");
        m.submit(task("b", "d", 3, 1), None).expect("b");
        let pending = commit(&mut m);
        let mut reloaded = Machine::new(
            SessionSettings::default(),
            pending.batch.tasks.iter().map(|t| Task::clone(t)).collect(),
        );
        reloaded.cancel("a", "x").expect("cancel");
        commit(&mut reloaded);
        assert_eq!(
            reloaded.tasks["b"].state(),
            TaskState::Working,
            "the queued task runs next"
        );
    }
}
