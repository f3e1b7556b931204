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
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use proto_schemas::registry::AgentRecord;
use proto_schemas::server::{self, CommandTarget};
use proto_schemas::sessions::{InboundFrame, PlanRequest, PlanStep, TaskState};
use proto_schemas::{
    ActionResult, ClientMessageType, ClientType, Command, ErrorBody, ErrorCode, Extension,
    Platform, ServerMessage, Subjects, TaskStatus, V1,
};
use serde_json::{Value, json};
use sqlx::types::Json;

use crate::settings::SessionSettings;
use crate::store::{Batch, NewEvent, OutFrame, TaskRow, now_ms};

/// Who asked for a task.
#[derive(Debug, Clone)]
pub enum Requester {
    /// A WebSocket client (constellation or device).
    Client {
        /// Its id.
        id: String,
        /// Its type.
        client_type: ClientType,
    },
    /// A REST caller.
    Rest(String),
    /// A NATS client.
    Nats(String),
}

/// How the steps of a task are decided.
#[derive(Debug, Clone)]
pub enum Plan {
    /// The steps are carried by the task.
    Scripted(Vec<Vec<Command>>),
    /// The remote planner decides each step.
    Remote,
    /// The requester sends commands itself (REST) and ends the task.
    Driver,
}

/// Where a task should run.
#[derive(Debug, Clone)]
pub enum Placement {
    /// On this agent, which must be an online device.
    Target(String),
    /// On an available agent with all these capabilities.
    Capabilities(Vec<String>),
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
    /// Where to report the outcome.
    pub callback_url: Option<String>,
    /// Fail after this long (capped by the service's task timeout).
    pub timeout_secs: Option<u64>,
    /// A UFO `POST /api/dispatch`: the device is sent a server `task` frame and echoes it.
    pub ufo_dispatch: bool,
}

/// A task to start, with what was looked up for it before it reached the leader.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The task.
    pub new: NewTask,
    /// Agents it may run on (one for an explicit target), from the registry.
    pub candidates: Vec<AgentRecord>,
    /// For a given task id: the requester of the task that already has it in the database.
    pub existing_owner: Option<String>,
}

/// A client `task` frame, prepared: what to start, and whether it may echo a UFO dispatch.
#[derive(Debug, Clone)]
pub struct TaskFrame {
    /// A device's frame with a task name: the echo of a dispatch of that name, if one waits.
    pub echo_name: Option<String>,
    /// Otherwise the task to start, or why it cannot start.
    pub start: Result<Prepared, ErrorBody>,
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
    NotLive {
        /// The task.
        task_id: String,
    },
}

impl Refusal {
    fn now(code: ErrorCode, detail: impl Into<String>) -> Self {
        Refusal::Now(ErrorBody::new(code, detail))
    }
}

/// A live task's executor: how many of its tasks run, and which wait.
#[derive(Debug, Default)]
struct Executor {
    running: i64,
    /// Highest priority first, then oldest.
    queued: BTreeSet<(Reverse<i32>, i64, String)>,
}

/// What a committed batch leaves to do.
#[derive(Debug, Default)]
pub struct Pending {
    /// What to write.
    pub batch: Batch,
    /// Steps to ask the remote planner for.
    pub plans: Vec<PlanRequest>,
    ended: Vec<String>,
}

/// Ids of tasks that ended recently, kept a while after they leave memory so that a request
/// prepared before their commit cannot reuse their id.
#[derive(Debug, Default)]
struct Tombstones {
    owners: HashMap<String, String>,
    order: VecDeque<(i64, String)>,
}

const TOMBSTONE_MS: i64 = 120_000;
const TOMBSTONE_MAX: usize = 200_000;

impl Tombstones {
    fn add(&mut self, task_id: String, owner: String, now: i64) {
        self.owners.insert(task_id.clone(), owner);
        self.order.push_back((now, task_id));
        while self
            .order
            .front()
            .is_some_and(|(at, _)| *at < now - TOMBSTONE_MS || self.order.len() > TOMBSTONE_MAX)
        {
            if let Some((_, id)) = self.order.pop_front() {
                self.owners.remove(&id);
            }
        }
    }
}

/// The live state of the leader.
pub struct Machine {
    settings: SessionSettings,
    subjects: Subjects,
    tasks: HashMap<String, TaskRow>,
    /// Client id → live tasks it takes part in (as a client requester or as executor).
    clients: HashMap<String, HashSet<String>>,
    executors: HashMap<String, Executor>,
    tombstones: Tombstones,
    /// Remote planning asked for: task → when.
    planning: HashMap<String, i64>,
    pending: Pending,
    dirty: Vec<String>,
    dirty_set: HashSet<String>,
}

impl Machine {
    /// The state of a new leader: every live task from the database.
    pub fn new(settings: SessionSettings, subjects: Subjects, live: Vec<TaskRow>) -> Self {
        let mut core = Machine {
            settings,
            subjects,
            tasks: HashMap::with_capacity(live.len()),
            clients: HashMap::new(),
            executors: HashMap::new(),
            tombstones: Tombstones::default(),
            planning: HashMap::new(),
            pending: Pending::default(),
            dirty: Vec::new(),
            dirty_set: HashSet::new(),
        };
        let mut unplanned = Vec::new();
        for task in live {
            core.index(&task);
            if task.needs_plan {
                unplanned.push(task.task_id.clone());
            }
            core.tasks.insert(task.task_id.clone(), task);
        }
        // Steps a crash left unplanned (a scripted one is planned at once, a remote one
        // after the first commit).
        for id in unplanned {
            let _ = core.with_task(&id, |core, task| {
                core.plan(task);
                Ok(())
            });
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
        self.dirty_set.clear();
        for id in self.dirty.drain(..) {
            if let Some(task) = self.tasks.get(&id) {
                pending.batch.tasks.push(task.clone());
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
                self.tombstones.add(task.task_id, task.requester_id, now);
            }
        }
    }

    /// Records a published outbox row for deletion in the next batch.
    pub fn published(&mut self, msg_ids: impl IntoIterator<Item = String>) {
        self.pending.batch.published.extend(msg_ids);
    }

    /// Forgets processed-frame ids older than `before` in the next batch.
    pub fn prune_processed(&mut self, before: i64) {
        self.pending.batch.prune_processed_before = Some(before);
    }

    fn index(&mut self, task: &TaskRow) {
        if task.requester_kind == "client" {
            self.clients
                .entry(task.requester_id.clone())
                .or_default()
                .insert(task.task_id.clone());
        }
        if let Some(executor) = &task.executor_id {
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

    fn event(&mut self, task: &mut TaskRow, kind: &str, data: Option<Value>) -> i64 {
        let seq = task.next_seq;
        task.next_seq += 1;
        self.pending.batch.events.push(NewEvent {
            task_id: task.task_id.clone(),
            seq,
            at_ms: now_ms(),
            kind: kind.to_owned(),
            state: task.state.clone(),
            data,
        });
        seq
    }

    fn send(&mut self, client_id: &str, frame: &ServerMessage) {
        self.pending.batch.outbox.push(OutFrame {
            msg_id: server::new_id(),
            subject: self.subjects.deliver(client_id),
            payload: serde_json::to_vec(frame).unwrap_or_default(),
        });
    }

    fn applied(&mut self, msg_id: Option<&str>) {
        if let Some(id) = msg_id {
            self.pending.batch.processed.push(id.to_owned());
        }
    }

    /// Runs `change` on a live task, then stores it back and marks it changed.
    fn with_task<T>(
        &mut self,
        task_id: &str,
        change: impl FnOnce(&mut Self, &mut TaskRow) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let Some(mut task) = self.tasks.remove(task_id) else {
            return Err(Refusal::NotLive {
                task_id: task_id.to_owned(),
            });
        };
        let result = change(self, &mut task);
        let changed = result.is_ok();
        self.tasks.insert(task_id.to_owned(), task);
        if changed {
            self.touch(task_id);
        }
        result
    }

    // ----- starting tasks -----

    /// Starts a task: records it, dispatches it if its executor has room (or queues it),
    /// and acknowledges a client requester.
    pub fn submit(&mut self, prepared: Prepared, msg_id: Option<&str>) -> Result<TaskRow, Refusal> {
        let Prepared {
            new,
            candidates,
            existing_owner,
        } = prepared;
        if let Some(task_id) = &new.task_id {
            let owner = self
                .tasks
                .get(task_id)
                .map(|t| t.requester_id.clone())
                .or_else(|| self.tombstones.owners.get(task_id).cloned())
                .or(existing_owner);
            if let Some(owner) = owner {
                let requester_id = requester_parts(&new.requester).1;
                let detail = if owner == requester_id {
                    format!("session_id '{task_id}' is already in use by one of your tasks")
                } else {
                    format!("session_id '{task_id}' is owned by another client")
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
        let executor = self.choose(&new, candidates)?;
        let now = now_ms();
        let timeout = new
            .timeout_secs
            .unwrap_or(self.settings.task_timeout_secs)
            .min(self.settings.task_timeout_secs);
        let task_deadline =
            now + i64::try_from(timeout.saturating_mul(1000)).unwrap_or(i64::MAX / 2);
        let (requester_kind, requester_id, requester_type) = requester_parts(&new.requester);
        let (planner, steps) = match &new.plan {
            Plan::Scripted(steps) => ("scripted", Some(Json(steps.clone()))),
            Plan::Remote => ("remote", None),
            Plan::Driver => ("driver", None),
        };
        let capabilities = match &new.placement {
            Placement::Capabilities(c) => c.clone(),
            Placement::Target(_) => Vec::new(),
        };
        let mut task = TaskRow {
            task_id: new.task_id.clone().unwrap_or_else(server::new_id),
            task_name: new.task_name.clone().unwrap_or_else(server::new_id),
            state: TaskState::Submitted.as_str().to_owned(),
            request: new.request.clone(),
            data: new.data.clone().map(Json),
            requester_kind: requester_kind.to_owned(),
            requester_id,
            requester_type,
            executor_id: Some(executor.agent_id.clone()),
            executor_platform: Some(executor.platform.as_str().to_owned()),
            required_capabilities: Json(capabilities),
            planner: planner.to_owned(),
            steps,
            step: 0,
            pending_response_id: None,
            needs_plan: false,
            ufo_dispatch: new.ufo_dispatch,
            awaiting_echo: false,
            history: Json(Vec::new()),
            priority: new.priority,
            result: None,
            error: None,
            error_code: None,
            callback_url: new.callback_url.clone(),
            task_deadline_ms: task_deadline,
            deadline_ms: task_deadline,
            created_ms: now,
            updated_ms: now,
            next_seq: 1,
        };
        self.applied(msg_id);
        let data = json!({ "requester": task.view().requester, "executor_id": executor.agent_id, "planner": planner });
        self.event(&mut task, "submitted", Some(data));
        self.index(&task);
        let task_id = task.task_id.clone();
        self.tasks.insert(task_id.clone(), task);
        self.touch(&task_id);
        if let Requester::Client { id, .. } = &new.requester {
            self.send(id, &server::task_accepted(&task_id));
        }
        self.release(&executor.agent_id);
        self.tasks.get(&task_id).cloned().ok_or_else(|| {
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
            Placement::Target(t) => Refusal::now(
                ErrorCode::DeviceNotFound,
                format!("Device '{t}' is not connected"),
            ),
        })
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
            let _ = self.with_task(&next, |core, task| {
                core.dispatch(task);
                Ok(())
            });
        }
    }

    /// Submitted → dispatched: a UFO dispatch sends the server `task` frame and waits for the
    /// echo; a scripted task gets its first step at once; a remote one is planned after
    /// commit. (The caller has counted the task as running.)
    fn dispatch(&mut self, task: &mut TaskRow) {
        task.state = TaskState::Dispatched.as_str().to_owned();
        task.updated_ms = now_ms();
        let executor = task.executor_id.clone().unwrap_or_default();
        if task.ufo_dispatch {
            task.awaiting_echo = true;
            let frame = server::dispatch_task(&task.request, &task.task_name, &task.task_id);
            self.send(&executor, &frame);
        } else if task.planner != "driver" {
            task.needs_plan = true;
        }
        self.event(task, "dispatched", Some(json!({ "executor_id": executor })));
        if task.needs_plan {
            self.plan(task);
        }
    }

    // ----- planning -----

    /// Plans the next step of a task that needs one: a scripted step at once, a remote one
    /// after commit.
    fn plan(&mut self, task: &mut TaskRow) {
        match task.planner.as_str() {
            "scripted" => {
                let step = usize::try_from(task.step).unwrap_or(0);
                let next = task.steps.as_ref().and_then(|s| s.0.get(step).cloned());
                let decision = match next {
                    Some(actions) => PlanStep::Commands {
                        actions,
                        agent_name: None,
                        process_name: None,
                        root_name: None,
                    },
                    None => PlanStep::Complete { result: None },
                };
                self.apply_plan(task, decision);
            }
            "remote" => {
                self.pending.plans.push(plan_request(task));
                self.planning.insert(task.task_id.clone(), now_ms());
            }
            _ => {}
        }
    }

    /// The remote planner's answer for `step` of a task; ignored if the task moved on.
    pub fn planned(&mut self, task_id: &str, step: i32, decision: PlanStep) {
        let _ = self.with_task(task_id, |core, task| {
            if !task.needs_plan || task.step != step || task.state().is_terminal() {
                return Err(Refusal::NotLive {
                    task_id: String::new(),
                });
            }
            core.planning.remove(&task.task_id);
            core.apply_plan(task, decision);
            Ok(())
        });
    }

    fn apply_plan(&mut self, task: &mut TaskRow, decision: PlanStep) {
        match decision {
            step @ PlanStep::Commands { .. } => {
                self.apply_commands(task, step);
            }
            PlanStep::Complete { result } => {
                let result = result.unwrap_or_else(|| Value::Array(task.history.0.clone()));
                self.finish(task, TaskState::Completed, Some(result), None);
            }
            PlanStep::Fail { error } => {
                let code = if error.starts_with("no planner") {
                    ErrorCode::Unavailable
                } else {
                    ErrorCode::CommandFailed
                };
                self.finish(task, TaskState::Failed, None, Some((code, error)));
            }
        }
    }

    /// Sends one step's commands: a `command` frame with a fresh `response_id`, now pending;
    /// the command's deadline starts. Returns the `response_id` and the event's sequence.
    fn apply_commands(&mut self, task: &mut TaskRow, step: PlanStep) -> (String, i64) {
        let PlanStep::Commands {
            actions,
            agent_name,
            process_name,
            root_name,
        } = step
        else {
            return (String::new(), 0);
        };
        let executor = task.executor_id.clone().unwrap_or_default();
        let platform = task
            .executor_platform
            .as_deref()
            .and_then(Platform::from_wire)
            .unwrap_or(Platform::Windows);
        let target = CommandTarget {
            session_id: task.task_id.clone(),
            task_name: Some(task.task_name.clone()),
            agent_name: agent_name.unwrap_or_else(|| platform.default_agent_name().to_owned()),
            process_name,
            root_name,
        };
        let response_id = server::new_id();
        let frame = server::command(&target, actions, TaskStatus::Continue, response_id.clone());
        task.pending_response_id = Some(response_id.clone());
        task.needs_plan = false;
        task.state = TaskState::Working.as_str().to_owned();
        let now = now_ms();
        task.updated_ms = now;
        let command_deadline =
            now + i64::try_from(self.settings.command_timeout_secs * 1000).unwrap_or(i64::MAX / 2);
        task.deadline_ms = task.task_deadline_ms.min(command_deadline);
        let data =
            json!({ "step": task.step, "response_id": response_id, "actions": frame.actions });
        let seq = self.event(task, "command_sent", Some(data));
        self.send(&executor, &frame);
        (response_id, seq)
    }

    /// Tasks whose remote planning was asked for long ago without an answer (a lost request),
    /// asked again.
    pub fn replan_stalled(&mut self, now: i64) {
        let wait = i64::try_from(self.settings.planner_timeout_ms).unwrap_or(30_000) + 5_000;
        let stalled: Vec<PlanRequest> = self
            .tasks
            .values()
            .filter(|t| t.needs_plan && t.planner == "remote" && !t.state().is_terminal())
            .filter(|t| {
                self.planning
                    .get(&t.task_id)
                    .is_none_or(|at| *at < now - wait)
            })
            .map(plan_request)
            .collect();
        for request in stalled {
            self.planning.insert(request.task_id.clone(), now);
            self.pending.plans.push(request);
        }
    }

    // ----- frames from clients -----

    /// Applies a client frame the session service handles.
    pub fn frame(
        &mut self,
        inbound: &InboundFrame,
        msg_id: &str,
        task: Option<TaskFrame>,
    ) -> Result<(), Refusal> {
        match inbound.frame.kind {
            ClientMessageType::Task => {
                let Some(task) = task else {
                    return Err(Refusal::now(
                        ErrorCode::Internal,
                        "task frame was not prepared",
                    ));
                };
                if let Some(name) = &task.echo_name
                    && self.echo(inbound, name, msg_id)
                {
                    return Ok(());
                }
                let prepared = task.start.map_err(Refusal::Now)?;
                self.submit(prepared, Some(msg_id)).map(|_| ())
            }
            ClientMessageType::CommandResults => self.results(inbound, msg_id),
            ClientMessageType::TaskEnd => self.client_task_end(inbound, msg_id),
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
                t.awaiting_echo
                    && t.task_name == task_name
                    && t.executor_id.as_deref() == Some(client.as_str())
                    && matches!(t.state(), TaskState::Submitted | TaskState::Dispatched)
            })
            .min_by_key(|t| (t.created_ms, t.task_id.clone()))
            .map(|t| t.task_id.clone());
        let Some(task_id) = waiting else {
            return false;
        };
        let client = client.clone();
        self.applied(Some(msg_id));
        self.with_task(&task_id, |core, task| {
            task.awaiting_echo = false;
            task.needs_plan = true;
            task.state = TaskState::Working.as_str().to_owned();
            task.updated_ms = now_ms();
            core.event(task, "echoed", Some(json!({ "client_id": client })));
            core.send(&client, &server::task_accepted(&task.task_id));
            core.plan(task);
            Ok(())
        })
        .is_ok()
    }

    /// Checks that a frame's sender is the executor of a live session.
    fn check_executor(task: &TaskRow, inbound: &InboundFrame) -> Result<(), Refusal> {
        if task.executor_id.as_deref() != Some(inbound.client_id.as_str()) {
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

    fn results(&mut self, inbound: &InboundFrame, msg_id: &str) -> Result<(), Refusal> {
        let frame = &inbound.frame;
        let session = frame.session_id.clone().unwrap_or_default();
        self.with_task(&session, |core, task| {
            Self::check_executor(task, inbound)?;
            let answered = frame.prev_response_id.as_deref();
            if task.pending_response_id.as_deref() != answered {
                let body = ErrorBody::new(
                    ErrorCode::ProtocolError,
                    format!(
                        "command_results answer `{}`, but session '{session}' is waiting for `{}`",
                        answered.unwrap_or(""),
                        task.pending_response_id.as_deref().unwrap_or("nothing")
                    ),
                );
                return Err(Refusal::UnlessSeen(body, msg_id.to_owned()));
            }
            core.applied(Some(msg_id));
            let results = frame.action_results.clone().unwrap_or_default();
            let entry = json!({ "step": task.step, "response_id": answered, "status": frame.status, "results": results });
            task.history.0.push(entry.clone());
            task.step += 1;
            task.pending_response_id = None;
            task.needs_plan = task.planner != "driver";
            task.state = TaskState::Working.as_str().to_owned();
            task.deadline_ms = task.task_deadline_ms;
            task.updated_ms = now_ms();
            core.event(task, "results_received", Some(entry));
            if task.needs_plan {
                core.plan(task);
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
                core.finish(task, TaskState::Completed, frame.result.clone(), None);
            } else {
                let error = frame
                    .error
                    .clone()
                    .unwrap_or_else(|| "the executor reported a failure".to_owned());
                core.finish(
                    task,
                    TaskState::Failed,
                    frame.result.clone(),
                    Some((ErrorCode::CommandFailed, error)),
                );
            }
            Ok(())
        })
    }

    /// A client's connection ended: its tasks as executor fail, its requests are canceled.
    pub fn closed(&mut self, client_id: &str) {
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
            let _ = self.with_task(&id, |core, task| {
                if task.state().is_terminal() {
                    return Err(Refusal::NotLive {
                        task_id: String::new(),
                    });
                }
                if task.executor_id.as_deref() == Some(client_id) {
                    let error = "Task was cancelled because target device disconnected".to_owned();
                    core.finish(
                        task,
                        TaskState::Failed,
                        None,
                        Some((ErrorCode::ConnectionFailed, error)),
                    );
                } else {
                    let error = format!(
                        "Task was cancelled because its requester '{client_id}' disconnected"
                    );
                    core.finish(
                        task,
                        TaskState::Canceled,
                        None,
                        Some((ErrorCode::TaskCanceled, error)),
                    );
                }
                Ok(())
            });
        }
    }

    // ----- REST -----

    fn live_check(task: &TaskRow) -> Result<(), Refusal> {
        if task.state().is_terminal() {
            return Err(Refusal::NotLive {
                task_id: task.task_id.clone(),
            });
        }
        Ok(())
    }

    fn driven_check(task: &TaskRow) -> Result<(), Refusal> {
        Self::live_check(task)?;
        if task.planner != "driver" {
            return Err(Refusal::now(
                ErrorCode::Conflict,
                format!(
                    "task '{}' is driven by its {} planner; submit it with \"driver\": true to drive it over REST",
                    task.task_id, task.planner
                ),
            ));
        }
        Ok(())
    }

    /// Sends commands into a requester-driven task; returns the command's `response_id` and
    /// the sequence number of its `command_sent` event. One command at a time.
    pub fn send_commands(
        &mut self,
        task_id: &str,
        step: PlanStep,
    ) -> Result<(String, i64), Refusal> {
        self.with_task(task_id, |core, task| {
            Self::driven_check(task)?;
            if task.state() == TaskState::Submitted {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!("task '{task_id}' waits for its executor to be free"),
                ));
            }
            if let Some(pending) = &task.pending_response_id {
                return Err(Refusal::now(
                    ErrorCode::Conflict,
                    format!("task '{task_id}' still waits for the results of command `{pending}`"),
                ));
            }
            Ok(core.apply_commands(task, step))
        })
    }

    /// Ends a requester-driven task.
    pub fn complete(
        &mut self,
        task_id: &str,
        result: Option<Value>,
        error: Option<String>,
    ) -> Result<TaskRow, Refusal> {
        let (state, error) = match error {
            None => (TaskState::Completed, None),
            Some(e) => (TaskState::Failed, Some((ErrorCode::CommandFailed, e))),
        };
        self.with_task(task_id, |core, task| {
            Self::driven_check(task)?;
            core.finish(task, state, result, error);
            Ok(task.clone())
        })
    }

    /// Cancels a live task; the executor and a client requester are told.
    pub fn cancel(&mut self, task_id: &str, reason: &str) -> Result<TaskRow, Refusal> {
        self.with_task(task_id, |core, task| {
            Self::live_check(task)?;
            let error = Some((ErrorCode::TaskCanceled, format!("canceled: {reason}")));
            core.finish(task, TaskState::Canceled, None, error);
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
        for id in due {
            let command_timeout = self.settings.command_timeout_secs;
            let _ = self.with_task(&id, |core, task| {
                let error = if task.task_deadline_ms < now {
                    format!(
                        "task timed out after {} s",
                        (task.task_deadline_ms - task.created_ms) / 1000
                    )
                } else {
                    format!(
                        "no results for command `{}` within {command_timeout} s",
                        task.pending_response_id.as_deref().unwrap_or("?"),
                    )
                };
                core.finish(
                    task,
                    TaskState::Failed,
                    None,
                    Some((ErrorCode::TaskTimeout, error)),
                );
                Ok(())
            });
        }
    }

    // ----- ending -----

    /// Ends a task: state, result or error, the event, `task_end` to the requester (a client)
    /// and to the executor, then the executor's next queued task.
    fn finish(
        &mut self,
        task: &mut TaskRow,
        state: TaskState,
        result: Option<Value>,
        error: Option<(ErrorCode, String)>,
    ) {
        let was_running = !matches!(task.state(), TaskState::Submitted);
        task.state = state.as_str().to_owned();
        task.result = result.clone().map(Json);
        task.pending_response_id = None;
        task.needs_plan = false;
        task.awaiting_echo = false;
        task.updated_ms = now_ms();
        if let Some((code, text)) = &error {
            task.error = Some(text.clone());
            task.error_code = Some(code.as_str().to_owned());
        }
        let data = json!({ "result": result, "error": task.error, "error_code": task.error_code });
        self.event(task, state.as_str(), Some(data));
        self.planning.remove(&task.task_id);

        let status = if state == TaskState::Completed {
            TaskStatus::Completed
        } else {
            TaskStatus::Failed
        };
        let frame = server::task_end(
            &task.task_id,
            status,
            result,
            task.error.clone(),
            &server::new_id(),
        );
        let requester_client = (task.requester_kind == "client").then(|| task.requester_id.clone());
        if let Some(requester) = &requester_client {
            self.send(requester, &frame);
            self.unindex_client(requester, &task.task_id);
        }
        self.pending.ended.push(task.task_id.clone());
        if let Some(executor) = task.executor_id.clone() {
            self.unindex_client(&executor, &task.task_id);
            if was_running && requester_client.as_deref() != Some(executor.as_str()) {
                self.send(&executor, &frame);
            }
            if let Some(entry) = self.executors.get_mut(&executor) {
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
            self.release(&executor);
        }
    }
}

fn requester_parts(requester: &Requester) -> (&'static str, String, Option<String>) {
    match requester {
        Requester::Client { id, client_type } => {
            ("client", id.clone(), Some(client_type.as_str().to_owned()))
        }
        Requester::Rest(id) => ("rest", id.clone(), None),
        Requester::Nats(id) => ("nats", id.clone(), None),
    }
}

/// What the remote planner is asked about a task.
fn plan_request(task: &TaskRow) -> PlanRequest {
    let last_results: Vec<ActionResult> = task
        .history
        .0
        .last()
        .and_then(|h| h.get("results"))
        .and_then(|r| serde_json::from_value(r.clone()).ok())
        .unwrap_or_default();
    PlanRequest {
        version: V1,
        task_id: task.task_id.clone(),
        task_name: task.task_name.clone(),
        request: task.request.clone(),
        data: task.data.as_ref().map(|d| d.0.clone()),
        executor_id: task.executor_id.clone().unwrap_or_default(),
        platform: task
            .executor_platform
            .as_deref()
            .and_then(Platform::from_wire)
            .unwrap_or(Platform::Windows),
        step: u32::try_from(task.step).unwrap_or(0),
        last_results,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::registry::AgentStatus;

    fn device(id: &str) -> AgentRecord {
        AgentRecord {
            agent_id: id.to_owned(),
            client_type: ClientType::Device,
            status: AgentStatus::Available,
            platform: Platform::Linux,
            capabilities: Vec::new(),
            tools: Vec::new(),
            system_info: None,
            metadata: None,
            extensions: Vec::new(),
            target_id: None,
            gateway_id: "gw".to_owned(),
            connection_id: "c".to_owned(),
            load: 0,
            connected_at: chrono::Utc::now(),
            last_seen: chrono::Utc::now(),
        }
    }

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
                timeout_secs: None,
                ufo_dispatch: false,
            },
            candidates: vec![device(executor)],
            existing_owner: None,
        }
    }

    fn machine() -> Machine {
        Machine::new(SessionSettings::default(), Subjects::default(), Vec::new())
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
            first.state, "working",
            "a scripted first step is sent at once"
        );
        m.submit(task("low", "d", 1, 1), None).expect("low");
        m.submit(task("high", "d", 5, 1), None).expect("high");
        commit(&mut m);
        assert_eq!(m.tasks["low"].state, "submitted");
        assert_eq!(m.tasks["high"].state, "submitted");

        m.cancel("a", "test").expect("cancel");
        let pending = commit(&mut m);
        assert!(
            !m.tasks.contains_key("a"),
            "an ended task leaves memory once committed"
        );
        assert_eq!(
            m.tasks["high"].state, "working",
            "the higher priority goes next"
        );
        assert_eq!(m.tasks["low"].state, "submitted");
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
        assert_eq!(pending.batch.tasks[0].state, "canceled");
    }

    #[test]
    fn an_id_stays_taken_after_its_task_ended_and_left_memory() {
        let mut m = machine();
        m.submit(task("x", "d", 0, 1), None).expect("x");
        m.closed("d");
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
        let mut m = Machine::new(settings, Subjects::default(), Vec::new());
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
            Subjects::default(),
            pending.batch.tasks.clone(),
        );
        reloaded.cancel("a", "x").expect("cancel");
        commit(&mut reloaded);
        assert_eq!(
            reloaded.tasks["b"].state, "working",
            "the queued task runs next"
        );
    }
}
