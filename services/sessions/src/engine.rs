//! The task state machine.
//!
//! Every change to a task runs as one transaction: lock the task, check the transition, write
//! the task and its events, queue the frames it sends (outbox), commit; then publish the
//! frames. Planning a step (which may wait for a remote planner) happens between
//! transactions: a task whose step was answered is marked `needs_plan`, the planner is asked,
//! and its answer is applied in a new transaction if nothing else changed the task meanwhile.
//! A crash anywhere leaves a state from which the sweepers in [`crate::workers`] resume.

use std::time::Duration;

use aip_bus::{BusError, Headers, SharedBus};
use proto_schemas::registry::{
    AgentRecord, AgentStatus, GetAgent, GetAgentReply, LookupAgents, LookupReply,
};
use proto_schemas::server::{self, CommandTarget};
use proto_schemas::sessions::{
    ConnectionClosed, GatewayEvent, InboundFrame, PlanRequest, PlanStep, TaskState,
};
use proto_schemas::{
    ActionResult, ClientMessageType, ClientType, Command, ErrorBody, ErrorCode, Platform,
    ServerMessage, Subjects, TaskStatus, V1,
};
use serde_json::{Value, json};
use sqlx::types::Json;

use crate::settings::SessionSettings;
use crate::store::{StoreError, TaskRow, TaskStore, Tx, now_ms};

/// Why an event could not be processed. Transient errors are retried (the frame is
/// redelivered); the rest are reported to whoever sent the request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The database failed; retry later.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The request is refused, with a code.
    #[error("{0}")]
    Refused(ErrorBody),
}

impl EngineError {
    fn refused(code: ErrorCode, detail: impl Into<String>) -> Self {
        EngineError::Refused(ErrorBody::new(code, detail))
    }
}

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

/// What was created.
#[derive(Debug, Clone)]
pub struct Started {
    /// The task.
    pub task: TaskRow,
}

/// Frames to publish once the transaction that queued them has committed.
#[derive(Debug, Default)]
struct Effects {
    published: Vec<(i64, String, Vec<u8>)>,
    plan: Vec<String>,
}

/// The state machine, shared by the frame consumer, REST and the sweepers.
#[derive(Clone)]
pub struct Engine {
    /// Tables.
    pub store: TaskStore,
    bus: SharedBus,
    subjects: Subjects,
    settings: SessionSettings,
    outbox_done: tokio::sync::mpsc::Sender<i64>,
    plans: tokio::sync::mpsc::Sender<String>,
    blobs: aip_bus::BlobStore,
}

impl Engine {
    /// An engine; `outbox_done` receives the ids of published outbox rows for deletion,
    /// `plans` the ids of tasks whose next step is to be planned.
    pub fn new(
        store: TaskStore,
        bus: SharedBus,
        subjects: Subjects,
        settings: SessionSettings,
        outbox_done: tokio::sync::mpsc::Sender<i64>,
        plans: tokio::sync::mpsc::Sender<String>,
    ) -> Self {
        let blobs = aip_bus::BlobStore::for_subjects(&subjects);
        Engine {
            store,
            bus,
            subjects,
            settings,
            outbox_done,
            plans,
            blobs,
        }
    }

    /// The bus.
    pub fn bus(&self) -> &SharedBus {
        &self.bus
    }

    /// Where large bodies go.
    pub fn blobs(&self) -> &aip_bus::BlobStore {
        &self.blobs
    }

    /// The subjects.
    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    // ----- effects -----

    async fn queue(
        &self,
        tx: &mut Tx,
        effects: &mut Effects,
        client_id: &str,
        frame: &ServerMessage,
    ) -> Result<(), StoreError> {
        let subject = self.subjects.deliver(client_id);
        let payload = serde_json::to_vec(frame).unwrap_or_default();
        let id = tx.enqueue(&subject, &payload).await?;
        effects.published.push((id, subject, payload));
        Ok(())
    }

    /// Commits a transaction, then publishes the frames it queued and schedules planning.
    async fn commit(&self, tx: Tx, effects: Effects) -> Result<(), StoreError> {
        tx.commit().await?;
        self.finish_effects(effects).await;
        Ok(())
    }

    async fn finish_effects(&self, effects: Effects) {
        for (id, subject, payload) in effects.published {
            match self
                .blobs
                .publish(
                    self.bus.as_ref(),
                    subject.clone(),
                    delivery_headers(id),
                    payload.into(),
                )
                .await
            {
                Ok(()) => {
                    let _ = self.outbox_done.send(id).await;
                }
                // The sweeper re-publishes it.
                Err(e) => {
                    tracing::warn!(%subject, "publish after commit failed, left in the outbox: {e}")
                }
            }
        }
        for task_id in effects.plan {
            // A full queue is not lost work: the sweeper plans tasks left with `needs_plan`.
            if self.plans.try_send(task_id).is_err() {
                tracing::warn!("planning queue full; the sweeper will plan the task");
            }
        }
    }

    // ----- frames from gateways -----

    /// Applies one event from the frames stream. `msg_id` makes it idempotent.
    pub async fn handle_event(&self, event: GatewayEvent, msg_id: &str) -> Result<(), EngineError> {
        match event {
            GatewayEvent::Frame(frame) => self.handle_frame(frame, msg_id).await,
            GatewayEvent::Closed(closed) => self.handle_closed(closed, msg_id).await,
        }
    }

    async fn handle_frame(&self, inbound: InboundFrame, msg_id: &str) -> Result<(), EngineError> {
        let client = inbound.client_id.clone();
        let session = inbound.frame.session_id.clone();
        let result = match inbound.frame.kind {
            ClientMessageType::Task => self.on_task(&inbound, msg_id).await.map(|_| ()),
            ClientMessageType::CommandResults => self.on_results(&inbound, msg_id).await,
            ClientMessageType::TaskEnd => self.on_client_task_end(&inbound, msg_id).await,
            other => Err(EngineError::refused(
                ErrorCode::ProtocolError,
                format!("`{other}` frames are not handled by this broker yet"),
            )),
        };
        match result {
            Err(EngineError::Refused(body)) => {
                // Tell the sender; the frame is consumed.
                let mut frame = match &session {
                    Some(sid) => server::session_error(body.error_code, &body.detail, sid),
                    None => server::error(body.error_code, &body.detail),
                };
                if inbound.frame.kind == ClientMessageType::Task {
                    // Do better than UFO: end Galaxy's pending task at once.
                    if let Some(sid) = &session {
                        self.notify(&client, &frame).await;
                        frame = server::task_end(
                            sid,
                            TaskStatus::Failed,
                            None,
                            Some(body.detail.clone()),
                            &server::new_id(),
                        );
                    }
                }
                self.notify(&client, &frame).await;
                Ok(())
            }
            other => other,
        }
    }

    /// Publishes a frame to a client directly (for refusals, which change no task).
    async fn notify(&self, client_id: &str, frame: &ServerMessage) {
        let payload = serde_json::to_vec(frame).unwrap_or_default();
        if let Err(e) = self
            .bus
            .publish(
                self.subjects.deliver(client_id),
                Headers::new(),
                payload.into(),
            )
            .await
        {
            tracing::warn!(client = %client_id, "could not send a refusal: {e}");
        }
    }

    async fn on_task(
        &self,
        inbound: &InboundFrame,
        msg_id: &str,
    ) -> Result<Option<Started>, EngineError> {
        let frame = &inbound.frame;
        let request = frame.request.clone().unwrap_or_default();
        let target = frame.target_id.clone().filter(|t| !t.is_empty());
        let requester = Requester::Client {
            id: inbound.client_id.clone(),
            client_type: inbound.client_type,
        };
        let placement = match inbound.client_type {
            ClientType::Constellation => {
                let Some(target) = target else {
                    return Err(EngineError::refused(
                        ErrorCode::ProtocolError,
                        "Constellation task requests require target_id",
                    ));
                };
                Placement::Target(target)
            }
            ClientType::Device => {
                if let Some(target) = &target {
                    if *target != inbound.client_id {
                        return Err(EngineError::refused(
                            ErrorCode::Forbidden,
                            "Device clients may not target other devices",
                        ));
                    }
                }
                // The echo of a UFO dispatch continues the dispatched session.
                if let Some(task_name) = &frame.task_name {
                    if let Some(done) = self.on_echo(inbound, task_name, msg_id).await? {
                        return Ok(Some(done));
                    }
                }
                Placement::Target(inbound.client_id.clone())
            }
        };
        let plan = match frame.metadata_value("steps") {
            Some(steps) => Plan::Scripted(serde_json::from_value(steps.clone()).map_err(|e| {
                EngineError::refused(
                    ErrorCode::ProtocolError,
                    format!("task frame: field `metadata.steps`: must be a list of lists of Commands: {e}"),
                )
            })?),
            None => Plan::Remote,
        };
        let new = NewTask {
            task_id: frame.session_id.clone().filter(|s| !s.is_empty()),
            task_name: Some(sanitize_task_name(frame.task_name.as_deref())),
            request,
            data: frame.metadata_value("data").cloned(),
            requester,
            placement,
            plan,
            priority: frame
                .metadata_value("priority")
                .and_then(Value::as_i64)
                .map(|p| p as i32)
                .unwrap_or(0),
            callback_url: None,
            timeout_secs: frame.metadata_value("timeout_secs").and_then(Value::as_u64),
            ufo_dispatch: false,
        };
        self.submit(new, Some(msg_id)).await.map(Some)
    }

    /// A device's client `task` that answers a UFO dispatch: acknowledge with the dispatched
    /// session id and start planning.
    async fn on_echo(
        &self,
        inbound: &InboundFrame,
        task_name: &str,
        msg_id: &str,
    ) -> Result<Option<Started>, EngineError> {
        let mut tx = self.store.begin().await?;
        let Some(task_id) = tx.awaiting_echo(&inbound.client_id, task_name).await? else {
            return Ok(None);
        };
        if !tx.first_time(msg_id).await? {
            return Ok(None);
        }
        let Some(mut task) = tx.lock_task(&task_id).await? else {
            return Ok(None);
        };
        let mut effects = Effects::default();
        task.awaiting_echo = false;
        task.needs_plan = true;
        task.state = TaskState::Working.as_str().to_owned();
        task.updated_ms = now_ms();
        tx.append_event(
            &mut task,
            "echoed",
            Some(json!({ "client_id": inbound.client_id })),
        )
        .await?;
        tx.update_task(&task).await?;
        self.queue(
            &mut tx,
            &mut effects,
            &inbound.client_id,
            &server::task_accepted(&task.task_id),
        )
        .await?;
        tx.commit().await?;
        effects.plan.push(task.task_id.clone());
        self.finish_effects(effects).await;
        Ok(Some(Started { task }))
    }

    /// Starts a task from any transport: resolves the executor, records the task, dispatches
    /// it if its executor is free, acknowledges a client requester.
    pub async fn submit(&self, new: NewTask, msg_id: Option<&str>) -> Result<Started, EngineError> {
        let executor = self.resolve(&new).await?;
        let now = now_ms();
        let timeout = new
            .timeout_secs
            .unwrap_or(self.settings.task_timeout_secs)
            .min(self.settings.task_timeout_secs);
        let task_deadline =
            now + i64::try_from(timeout.saturating_mul(1000)).unwrap_or(i64::MAX / 2);
        let (requester_kind, requester_id, requester_type) = match &new.requester {
            Requester::Client { id, client_type } => {
                ("client", id.clone(), Some(client_type.as_str().to_owned()))
            }
            Requester::Rest(id) => ("rest", id.clone(), None),
            Requester::Nats(id) => ("nats", id.clone(), None),
        };
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

        let mut tx = self.store.begin().await?;
        if let Some(msg_id) = msg_id {
            if !tx.first_time(msg_id).await? {
                // Redelivered: the task exists already.
                let existing = tx.lock_task(&task.task_id).await?;
                return existing.map(|task| Started { task }).ok_or_else(|| {
                    EngineError::refused(
                        ErrorCode::Conflict,
                        "this task frame was processed before",
                    )
                });
            }
        }
        if !tx.insert_task(&task).await? {
            let owner = tx.lock_task(&task.task_id).await?;
            let same_requester = owner
                .as_ref()
                .is_some_and(|o| o.requester_id == task.requester_id);
            let detail = if same_requester {
                format!(
                    "session_id '{}' is already in use by one of your tasks",
                    task.task_id
                )
            } else {
                format!("session_id '{}' is owned by another client", task.task_id)
            };
            return Err(EngineError::refused(ErrorCode::Conflict, detail));
        }
        let mut effects = Effects::default();
        let data = json!({ "requester": task.view().requester, "executor_id": executor.agent_id, "planner": planner });
        tx.append_event(&mut task, "submitted", Some(data)).await?;
        tx.lock_executor(&executor.agent_id).await?;
        if tx.count_active(&executor.agent_id).await? < self.settings.max_tasks_per_agent {
            self.dispatch(&mut tx, &mut effects, &mut task).await?;
        }
        tx.update_task(&task).await?;
        if let Requester::Client { id, .. } = &new.requester {
            self.queue(
                &mut tx,
                &mut effects,
                id,
                &server::task_accepted(&task.task_id),
            )
            .await?;
        }
        self.commit(tx, effects).await?;
        Ok(Started { task })
    }

    /// Finds the executor: an explicit target must be an online device; otherwise the
    /// registry's available agents with the capabilities, the one with fewest running tasks.
    async fn resolve(&self, new: &NewTask) -> Result<AgentRecord, EngineError> {
        match &new.placement {
            Placement::Target(target) => {
                let reply: GetAgentReply = self
                    .registry_request(
                        self.subjects.registry_get(),
                        &GetAgent {
                            version: V1,
                            agent_id: target.clone(),
                        },
                    )
                    .await?;
                let constellation = matches!(
                    new.requester,
                    Requester::Client {
                        client_type: ClientType::Constellation,
                        ..
                    }
                );
                let not_connected = if constellation {
                    format!("Target device '{target}' is not connected")
                } else {
                    format!("Device '{target}' is not connected")
                };
                match reply.into_result() {
                    Ok(agent) if agent.status == AgentStatus::Offline => Err(EngineError::refused(
                        ErrorCode::DeviceNotFound,
                        not_connected,
                    )),
                    Ok(agent) if agent.client_type != ClientType::Device => {
                        Err(EngineError::refused(
                            ErrorCode::DeviceNotFound,
                            "Constellation tasks may only target device clients",
                        ))
                    }
                    Ok(agent) => Ok(agent),
                    Err(_) => Err(EngineError::refused(
                        ErrorCode::DeviceNotFound,
                        not_connected,
                    )),
                }
            }
            Placement::Capabilities(capabilities) => {
                let lookup = LookupAgents {
                    version: V1,
                    capabilities: capabilities.clone(),
                    client_type: None,
                    limit: Some(50),
                };
                let reply: LookupReply = self
                    .registry_request(self.subjects.registry_lookup(), &lookup)
                    .await?;
                let candidates = reply.into_result().map_err(EngineError::Refused)?;
                let mut best: Option<(i64, AgentRecord)> = None;
                for agent in candidates {
                    let mut tx = self.store.begin().await?;
                    let load = tx.count_active(&agent.agent_id).await?;
                    tx.commit().await?;
                    if best.as_ref().is_none_or(|(l, _)| load < *l) {
                        best = Some((load, agent));
                    }
                }
                best.map(|(_, a)| a).ok_or_else(|| {
                    EngineError::refused(
                        ErrorCode::CapabilityMismatch,
                        format!("no available agent has the capabilities {capabilities:?}"),
                    )
                })
            }
        }
    }

    async fn registry_request<Req: serde::Serialize, Rep: serde::de::DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
    ) -> Result<Rep, EngineError> {
        let payload = serde_json::to_vec(body).unwrap_or_default();
        let timeout = Duration::from_millis(self.settings.request_timeout_ms);
        match self
            .bus
            .request(subject, Headers::new(), payload.into(), timeout)
            .await
        {
            Ok(reply) => serde_json::from_slice(&reply.payload).map_err(|e| {
                EngineError::refused(
                    ErrorCode::Internal,
                    format!("invalid reply from the registry: {e}"),
                )
            }),
            Err(BusError::NoResponders { .. }) => Err(EngineError::refused(
                ErrorCode::Unavailable,
                "the agent registry is not running; try again later",
            )),
            Err(e) => Err(EngineError::refused(
                ErrorCode::Unavailable,
                format!("the agent registry did not answer: {e}"),
            )),
        }
    }

    /// Moves a submitted task to dispatched: a UFO dispatch sends the server `task` frame and
    /// waits for the echo; anything else is planned right after commit.
    async fn dispatch(
        &self,
        tx: &mut Tx,
        effects: &mut Effects,
        task: &mut TaskRow,
    ) -> Result<(), StoreError> {
        task.state = TaskState::Dispatched.as_str().to_owned();
        task.updated_ms = now_ms();
        let executor = task.executor_id.clone().unwrap_or_default();
        if task.ufo_dispatch {
            task.awaiting_echo = true;
            let frame = server::dispatch_task(&task.request, &task.task_name, &task.task_id);
            self.queue(tx, effects, &executor, &frame).await?;
        } else if task.planner != "driver" {
            task.needs_plan = true;
            effects.plan.push(task.task_id.clone());
        }
        tx.append_event(task, "dispatched", Some(json!({ "executor_id": executor })))
            .await?;
        Ok(())
    }

    // ----- planning -----

    /// Decides and applies the next step of a task that needs one.
    pub async fn plan(&self, task_id: &str) -> Result<(), EngineError> {
        let Some(task) = self.store.get(task_id).await? else {
            return Ok(());
        };
        if !task.needs_plan || task.state().is_terminal() {
            return Ok(());
        }
        let decision = self.decide(&task).await;
        let mut tx = self.store.begin().await?;
        let Some(mut current) = tx.lock_task(task_id).await? else {
            return Ok(());
        };
        if !current.needs_plan || current.step != task.step || current.state().is_terminal() {
            return Ok(()); // someone else planned or ended it meanwhile
        }
        let mut effects = Effects::default();
        match decision {
            step @ PlanStep::Commands { .. } => {
                self.apply_commands(&mut tx, &mut effects, &mut current, step)
                    .await?;
            }
            PlanStep::Complete { result } => {
                let result = result.unwrap_or_else(|| Value::Array(current.history.0.clone()));
                self.finish(
                    &mut tx,
                    &mut effects,
                    &mut current,
                    TaskState::Completed,
                    Some(result),
                    None,
                )
                .await?;
            }
            PlanStep::Fail { error } => {
                let code = if error.starts_with("no planner") {
                    ErrorCode::Unavailable
                } else {
                    ErrorCode::CommandFailed
                };
                self.finish(
                    &mut tx,
                    &mut effects,
                    &mut current,
                    TaskState::Failed,
                    None,
                    Some((code, error)),
                )
                .await?;
            }
        }
        self.commit(tx, effects).await?;
        Ok(())
    }

    /// Sends one step's commands to the executor: a `command` frame with a fresh
    /// `response_id`, now pending; the command's deadline starts. Returns the `response_id`.
    async fn apply_commands(
        &self,
        tx: &mut Tx,
        effects: &mut Effects,
        task: &mut TaskRow,
        step: PlanStep,
    ) -> Result<String, StoreError> {
        let PlanStep::Commands {
            actions,
            agent_name,
            process_name,
            root_name,
        } = step
        else {
            return Ok(String::new());
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
        tx.append_event(task, "command_sent", Some(data)).await?;
        tx.update_task(task).await?;
        self.queue(tx, effects, &executor, &frame).await?;
        Ok(response_id)
    }

    async fn decide(&self, task: &TaskRow) -> PlanStep {
        let step = usize::try_from(task.step).unwrap_or(0);
        match task.planner.as_str() {
            "scripted" => {
                let steps = task.steps.as_ref().map(|s| s.0.clone()).unwrap_or_default();
                match steps.get(step) {
                    Some(actions) => PlanStep::Commands {
                        actions: actions.clone(),
                        agent_name: None,
                        process_name: None,
                        root_name: None,
                    },
                    None => PlanStep::Complete { result: None },
                }
            }
            _ => self.ask_planner(task).await,
        }
    }

    async fn ask_planner(&self, task: &TaskRow) -> PlanStep {
        let last_results: Vec<ActionResult> = task
            .history
            .0
            .last()
            .and_then(|h| h.get("results"))
            .and_then(|r| serde_json::from_value(r.clone()).ok())
            .unwrap_or_default();
        let request = PlanRequest {
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
        };
        let subject = self.subjects.planner_next();
        let payload = serde_json::to_vec(&request).unwrap_or_default();
        let timeout = Duration::from_millis(self.settings.planner_timeout_ms);
        match self
            .bus
            .request(subject.clone(), Headers::new(), payload.into(), timeout)
            .await
        {
            Ok(reply) => match serde_json::from_slice::<proto_schemas::registry::Reply<PlanStep>>(
                &reply.payload,
            ) {
                Ok(reply) => reply.into_result().unwrap_or_else(|e| PlanStep::Fail {
                    error: format!("the planner refused: {}", e.detail),
                }),
                Err(e) => PlanStep::Fail {
                    error: format!("the planner's answer is not a PlanReply: {e}"),
                },
            },
            Err(BusError::NoResponders { .. }) => PlanStep::Fail {
                error: format!(
                    "no planner is running on `{subject}`: start a remote planner, or give the task its steps \
                     (metadata.steps over WebSocket, `steps` over REST)"
                ),
            },
            Err(e) => PlanStep::Fail {
                error: format!("the planner did not answer: {e}"),
            },
        }
    }

    // ----- results and ends -----

    /// Locks the live session a frame from its executor is about; refuses a frame for an
    /// unknown session, from anyone but the executor, or for a session that has ended.
    async fn lock_for_executor(
        &self,
        tx: &mut Tx,
        session: &str,
        inbound: &InboundFrame,
    ) -> Result<TaskRow, EngineError> {
        let kind = inbound.frame.kind;
        let Some(task) = tx.lock_task(session).await? else {
            return Err(EngineError::refused(
                ErrorCode::NotFound,
                format!("{kind} for unknown session '{session}'"),
            ));
        };
        if task.executor_id.as_deref() != Some(inbound.client_id.as_str()) {
            return Err(EngineError::refused(
                ErrorCode::Forbidden,
                format!(
                    "{kind} refused: '{}' is not the executor of session '{session}'",
                    inbound.client_id
                ),
            ));
        }
        if task.state().is_terminal() {
            return Err(EngineError::refused(
                ErrorCode::Conflict,
                format!("session '{session}' has already ended ({})", task.state),
            ));
        }
        Ok(task)
    }

    async fn on_results(&self, inbound: &InboundFrame, msg_id: &str) -> Result<(), EngineError> {
        let frame = &inbound.frame;
        let session = frame.session_id.clone().unwrap_or_default();
        let mut tx = self.store.begin().await?;
        if !tx.first_time(msg_id).await? {
            return Ok(());
        }
        let mut task = self.lock_for_executor(&mut tx, &session, inbound).await?;
        let answered = frame.prev_response_id.as_deref();
        if task.pending_response_id.as_deref() != answered {
            return Err(EngineError::refused(
                ErrorCode::ProtocolError,
                format!(
                    "command_results answer `{}`, but session '{session}' is waiting for `{}`",
                    answered.unwrap_or(""),
                    task.pending_response_id.as_deref().unwrap_or("nothing")
                ),
            ));
        }
        let results = frame.action_results.clone().unwrap_or_default();
        let entry = json!({ "step": task.step, "response_id": answered, "status": frame.status, "results": results });
        task.history.0.push(entry.clone());
        task.step += 1;
        task.pending_response_id = None;
        task.needs_plan = task.planner != "driver";
        task.state = TaskState::Working.as_str().to_owned();
        task.deadline_ms = task.task_deadline_ms;
        task.updated_ms = now_ms();
        tx.append_event(&mut task, "results_received", Some(entry))
            .await?;
        tx.update_task(&task).await?;
        tx.commit().await?;
        let plan = if task.needs_plan {
            vec![task.task_id.clone()]
        } else {
            Vec::new()
        };
        self.finish_effects(Effects {
            published: Vec::new(),
            plan,
        })
        .await;
        Ok(())
    }

    async fn on_client_task_end(
        &self,
        inbound: &InboundFrame,
        msg_id: &str,
    ) -> Result<(), EngineError> {
        let frame = &inbound.frame;
        if !inbound
            .extensions
            .contains(&proto_schemas::Extension::TaskEndResult)
        {
            return Err(EngineError::refused(
                ErrorCode::ProtocolError,
                "Unknown message type: task_end (announce the `task_end_result` extension at register to end tasks yourself)",
            ));
        }
        let session = frame.session_id.clone().unwrap_or_default();
        let mut tx = self.store.begin().await?;
        if !tx.first_time(msg_id).await? {
            return Ok(());
        }
        let mut task = self.lock_for_executor(&mut tx, &session, inbound).await?;
        let mut effects = Effects::default();
        if frame.status == TaskStatus::Completed {
            self.finish(
                &mut tx,
                &mut effects,
                &mut task,
                TaskState::Completed,
                frame.result.clone(),
                None,
            )
            .await?;
        } else {
            let error = frame
                .error
                .clone()
                .unwrap_or_else(|| "the executor reported a failure".to_owned());
            self.finish(
                &mut tx,
                &mut effects,
                &mut task,
                TaskState::Failed,
                frame.result.clone(),
                Some((ErrorCode::CommandFailed, error)),
            )
            .await?;
        }
        self.commit(tx, effects).await?;
        Ok(())
    }

    async fn handle_closed(
        &self,
        closed: ConnectionClosed,
        msg_id: &str,
    ) -> Result<(), EngineError> {
        let mut tx = self.store.begin().await?;
        if !tx.first_time(msg_id).await? {
            return Ok(());
        }
        let mut effects = Effects::default();
        for task_id in tx.live_tasks_of(&closed.client_id).await? {
            let Some(mut task) = tx.lock_task(&task_id).await? else {
                continue;
            };
            if task.state().is_terminal() {
                continue;
            }
            let is_executor = task.executor_id.as_deref() == Some(closed.client_id.as_str());
            if is_executor {
                let error = "Task was cancelled because target device disconnected".to_owned();
                self.finish(
                    &mut tx,
                    &mut effects,
                    &mut task,
                    TaskState::Failed,
                    None,
                    Some((ErrorCode::ConnectionFailed, error)),
                )
                .await?;
            } else {
                let error = format!(
                    "Task was cancelled because its requester '{}' disconnected",
                    closed.client_id
                );
                self.finish(
                    &mut tx,
                    &mut effects,
                    &mut task,
                    TaskState::Canceled,
                    None,
                    Some((ErrorCode::TaskCanceled, error)),
                )
                .await?;
            }
        }
        self.commit(tx, effects).await?;
        Ok(())
    }

    /// Locks a task that must exist and still be live (for REST actions on it).
    async fn lock_live(&self, tx: &mut Tx, task_id: &str) -> Result<TaskRow, EngineError> {
        let Some(task) = tx.lock_task(task_id).await? else {
            return Err(EngineError::refused(
                ErrorCode::NotFound,
                format!("no task '{task_id}'"),
            ));
        };
        if task.state().is_terminal() {
            return Err(EngineError::refused(
                ErrorCode::Conflict,
                format!("task '{task_id}' has already ended ({})", task.state),
            ));
        }
        Ok(task)
    }

    /// Locks a live requester-driven task.
    async fn lock_driven(&self, tx: &mut Tx, task_id: &str) -> Result<TaskRow, EngineError> {
        let task = self.lock_live(tx, task_id).await?;
        if task.planner != "driver" {
            return Err(EngineError::refused(
                ErrorCode::Conflict,
                format!(
                    "task '{task_id}' is driven by its {} planner; submit it with \"driver\": true to drive it over REST",
                    task.planner
                ),
            ));
        }
        Ok(task)
    }

    /// Sends commands into a requester-driven task (REST); returns the command's `response_id`
    /// and the sequence number of its `command_sent` event. One command at a time.
    pub async fn send_commands(
        &self,
        task_id: &str,
        step: PlanStep,
    ) -> Result<(String, i64), EngineError> {
        let mut tx = self.store.begin().await?;
        let mut task = self.lock_driven(&mut tx, task_id).await?;
        if task.state() == TaskState::Submitted {
            return Err(EngineError::refused(
                ErrorCode::Conflict,
                format!("task '{task_id}' waits for its executor to be free"),
            ));
        }
        if let Some(pending) = &task.pending_response_id {
            return Err(EngineError::refused(
                ErrorCode::Conflict,
                format!("task '{task_id}' still waits for the results of command `{pending}`"),
            ));
        }
        let mut effects = Effects::default();
        let response_id = self
            .apply_commands(&mut tx, &mut effects, &mut task, step)
            .await?;
        let seq = task.next_seq - 1;
        self.commit(tx, effects).await?;
        Ok((response_id, seq))
    }

    /// Ends a requester-driven task (REST).
    pub async fn complete(
        &self,
        task_id: &str,
        result: Option<Value>,
        error: Option<String>,
    ) -> Result<TaskRow, EngineError> {
        let (state, error) = match error {
            None => (TaskState::Completed, None),
            Some(e) => (TaskState::Failed, Some((ErrorCode::CommandFailed, e))),
        };
        let mut tx = self.store.begin().await?;
        let mut task = self.lock_driven(&mut tx, task_id).await?;
        let mut effects = Effects::default();
        self.finish(&mut tx, &mut effects, &mut task, state, result, error)
            .await?;
        self.commit(tx, effects).await?;
        Ok(task)
    }

    /// Cancels a live task (REST); the executor and a client requester are told.
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Result<TaskRow, EngineError> {
        let mut tx = self.store.begin().await?;
        let mut task = self.lock_live(&mut tx, task_id).await?;
        let mut effects = Effects::default();
        let error = Some((ErrorCode::TaskCanceled, format!("canceled: {reason}")));
        self.finish(
            &mut tx,
            &mut effects,
            &mut task,
            TaskState::Canceled,
            None,
            error,
        )
        .await?;
        self.commit(tx, effects).await?;
        Ok(task)
    }

    /// Fails a task whose deadline has passed.
    pub async fn expire(&self, task_id: &str) -> Result<(), EngineError> {
        let mut tx = self.store.begin().await?;
        let Some(mut task) = tx.lock_task(task_id).await? else {
            return Ok(());
        };
        let now = now_ms();
        if task.state().is_terminal() || task.deadline_ms >= now {
            return Ok(());
        }
        let error = if task.task_deadline_ms < now {
            format!(
                "task timed out after {} s",
                (task.task_deadline_ms - task.created_ms) / 1000
            )
        } else {
            format!(
                "no results for command `{}` within {} s",
                task.pending_response_id.as_deref().unwrap_or("?"),
                self.settings.command_timeout_secs
            )
        };
        let mut effects = Effects::default();
        self.finish(
            &mut tx,
            &mut effects,
            &mut task,
            TaskState::Failed,
            None,
            Some((ErrorCode::TaskTimeout, error)),
        )
        .await?;
        self.commit(tx, effects).await?;
        Ok(())
    }

    /// Ends a task: state, result or error, the event, `task_end` to the requester (a client)
    /// and to the executor, then the executor's next queued task.
    async fn finish(
        &self,
        tx: &mut Tx,
        effects: &mut Effects,
        task: &mut TaskRow,
        state: TaskState,
        result: Option<Value>,
        error: Option<(ErrorCode, String)>,
    ) -> Result<(), StoreError> {
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
        tx.append_event(task, state.as_str(), Some(data)).await?;
        tx.update_task(task).await?;

        let status = if state == TaskState::Completed {
            TaskStatus::Completed
        } else {
            TaskStatus::Failed
        };
        let response_id = server::new_id();
        let frame = server::task_end(
            &task.task_id,
            status,
            result,
            task.error.clone(),
            &response_id,
        );
        let requester_client = (task.requester_kind == "client").then(|| task.requester_id.clone());
        if let Some(requester) = &requester_client {
            self.queue(tx, effects, requester, &frame).await?;
        }
        if let Some(executor) = task.executor_id.clone() {
            if was_running && requester_client.as_deref() != Some(executor.as_str()) {
                self.queue(tx, effects, &executor, &frame).await?;
            }
            if was_running {
                self.release(tx, effects, &executor).await?;
            }
        }
        Ok(())
    }

    /// Dispatches the executor's next queued task, if it has room.
    async fn release(
        &self,
        tx: &mut Tx,
        effects: &mut Effects,
        executor: &str,
    ) -> Result<(), StoreError> {
        tx.lock_executor(executor).await?;
        if tx.count_active(executor).await? >= self.settings.max_tasks_per_agent {
            return Ok(());
        }
        let Some(next) = tx.next_queued(executor).await? else {
            return Ok(());
        };
        let Some(mut task) = tx.lock_task(&next).await? else {
            return Ok(());
        };
        if task.state() != TaskState::Submitted {
            return Ok(());
        }
        self.dispatch(tx, effects, &mut task).await?;
        tx.update_task(&task).await
    }
}

/// Headers of a frame from the outbox: its row id, so that a frame re-sent after a crash is
/// recognised (and dropped) by the gateway that already wrote it to the client.
pub fn delivery_headers(outbox_id: i64) -> Headers {
    Headers::new().with(aip_bus::names::MSG_ID, format!("outbox-{outbox_id}"))
}

/// UFO's rule for task names from WebSocket frames: every character outside `[A-Za-z0-9._-]`
/// becomes `_`, leading dots are stripped, and an empty name becomes a uuid4.
pub fn sanitize_task_name(name: Option<&str>) -> String {
    let cleaned: String = name
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let trimmed = cleaned.trim_start_matches('.');
    if trimmed.is_empty() {
        server::new_id()
    } else {
        trimmed.to_owned()
    }
}

/// Whether a task name is acceptable over HTTP (UFO refuses, rather than cleans, bad ones).
pub fn valid_task_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_names_follow_ufos_rules() {
        assert_eq!(sanitize_task_name(Some("a b/c")), "a_b_c");
        assert_eq!(sanitize_task_name(Some("..x")), "x");
        assert_eq!(sanitize_task_name(Some("")).len(), 36);
        assert!(valid_task_name("task-1.v2_x"));
        assert!(!valid_task_name(".hidden"));
        assert!(!valid_task_name("a b"));
        assert!(!valid_task_name(""));
    }
}
