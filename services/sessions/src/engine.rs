//! The applier: one leader applies every change, in memory, and commits them in groups.
//!
//! Replicas of the session service run active/standby. The leader holds the leadership
//! (a lease in PostgreSQL, renewed by every write; on SQLite the one process leads)
//! and with it every live task in memory ([`crate::core`]). Everything that changes a task,
//! whether a frame from a gateway, a REST call, a NATS submission, a planner's answer or a
//! deadline, becomes an [`Op`] on one bounded channel. The applier takes whatever ops are
//! waiting, applies them in order, and writes all their changes in one transaction on the
//! leader's connection (group commit). Only after that commit are frames published, frames
//! from the stream acknowledged and REST callers answered. If the write fails, nothing of
//! the batch was told to anyone: the ops fail (frames are redelivered), the leadership is
//! given up, and the state is reloaded from the database.
//!
//! Standby replicas serve every read from the database, refuse changes with UNAVAILABLE
//! (their `/readyz` is not ready, so a load balancer sends changes to the leader), and take
//! over within `standby_retry_ms` once the leader's connection is gone.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aip_bus::registry::{RegistryClient, RegistryError};
use aip_bus::{Headers, SharedBus};
use futures::FutureExt;
use proto_schemas::flow::{TaskRequest, TaskResponse};
use proto_schemas::registry::{AgentRecord, AgentStatus, LookupAgents, MAX_GET_MANY};
use proto_schemas::server;
use proto_schemas::sessions::{InboundFrame, PlanStep};
use proto_schemas::{ClientType, ErrorBody, ErrorCode, PlannerName, ServerMessage, Subjects, V1};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::batches::{self, Gathered};
use crate::callbacks::Callbacks;
use crate::known::KnownIds;
use crate::machine::{Answer, CommandStep, HandoffAsk, Machine, Refusal};
pub use crate::machine::{NewTask, Placement, Plan, Prepared, Requester, TaskFrame};
use crate::outbox::Acknowledged;
use crate::planners::{PlanJob, Planned, Planners};
use crate::routes::Routes;
use crate::settings::SessionSettings;
use crate::store::{LeaseSpec, OutFrame, ProcessedHalf, StoreError, TaskStore, Writer};
use crate::targets::TargetCache;
use crate::task::{Task, now_ms};

/// A frame larger than this goes to its gateway alone, never in a batch: batching it would
/// copy it into the batch's body for nothing (on NATS such a frame goes by blob reference
/// anyway; `aip dev`'s bus carries bodies up to 256 MiB as themselves).
const GATHERED_FRAME_BYTES: usize = 1 << 20;

/// Why a change could not be made. Transient errors are retried (a frame is redelivered);
/// the rest are reported to whoever asked.
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

/// What was created.
#[derive(Debug, Clone)]
pub struct Started {
    /// The task as its creation committed it.
    pub task: Task,
}

/// How an op ended, as the applier reports it.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Not applied; the refusal says what to answer.
    Refused(Refusal),
    /// The batch could not be written (or this replica stopped leading).
    Store(String),
}

type Reply<T> = oneshot::Sender<Result<T, Failure>>;

/// A client's connection that ended, as the frames stream reported it.
pub(crate) struct ConnectionEnd {
    pub(crate) client_id: String,
    pub(crate) connection_id: String,
}

/// A change for the leader to apply.
pub(crate) enum Op {
    /// A client frame from the stream (a `task` frame comes prepared).
    Frame {
        inbound: Box<InboundFrame>,
        msg_id: String,
        task: Option<Box<TaskFrame>>,
        /// A `handoff` frame's candidates.
        handoff: Option<Result<Vec<AgentRecord>, ErrorBody>>,
        reply: Reply<()>,
    },
    /// Clients' connections ended (one or several), in order.
    Closed {
        ends: Vec<ConnectionEnd>,
        reply: Reply<()>,
    },
    /// A task from REST or NATS.
    Submit {
        prepared: Box<Prepared>,
        reply: Reply<Task>,
    },
    /// A planner's answer.
    Planned {
        task_id: String,
        step: i32,
        planned: Planned,
    },
    /// Commands into a driven task.
    Commands {
        task_id: String,
        step: CommandStep,
        reply: Reply<(String, i64)>,
    },
    /// A driven task ends.
    Complete {
        task_id: String,
        result: Option<serde_json::Value>,
        error: Option<String>,
        reply: Reply<Task>,
    },
    /// A task is canceled.
    Cancel {
        task_id: String,
        reason: String,
        reply: Reply<Task>,
    },
    /// A handoff over REST or NATS, its candidates looked up.
    Handoff {
        task_id: String,
        ask: HandoffAsk,
        reply: Reply<Task>,
    },
    /// A question from the driver of a requester-driven task.
    Ask {
        task_id: String,
        question: crate::machine::DriverQuestion,
        reply: Reply<Task>,
    },
    /// An answer to a task's open question, over REST or NATS.
    Answer {
        task_id: String,
        answer: Answer,
        reply: Reply<Task>,
    },
}

/// A reply to send once the batch that holds its change has committed. Short-lived (one per
/// op, dropped at the commit), so its size matters less than an allocation per op.
#[allow(clippy::large_enum_variant)]
enum Waiter {
    Unit(Reply<()>, Result<(), Refusal>),
    Task(Reply<Task>, Result<Task, Refusal>),
    Sent(Reply<(String, i64)>, Result<(String, i64), Refusal>),
}

impl Waiter {
    /// Answers: the batch committed. (A caller that went away is no error.)
    fn succeed(self) {
        match self {
            Waiter::Unit(tx, r) => drop(tx.send(r.map_err(Failure::Refused))),
            Waiter::Task(tx, r) => drop(tx.send(r.map_err(Failure::Refused))),
            Waiter::Sent(tx, r) => drop(tx.send(r.map_err(Failure::Refused))),
        }
    }

    /// Answers: the batch was not written.
    fn fail(self, error: &str) {
        let error = error.to_owned();
        match self {
            Waiter::Unit(tx, _) => drop(tx.send(Err(Failure::Store(error)))),
            Waiter::Task(tx, _) => drop(tx.send(Err(Failure::Store(error)))),
            Waiter::Sent(tx, _) => drop(tx.send(Err(Failure::Store(error)))),
        }
    }
}

/// How long a task waits for the agent registry to come back: longer than a restart or a
/// failover takes (a few seconds), short enough that the frames behind a waiting task frame in
/// the stream are not held long.
const REGISTRY_OUTAGE_WAIT: Duration = Duration::from_secs(8);
/// The first pause between asks; it doubles up to [`REGISTRY_RETRY_MAX_DELAY`].
const REGISTRY_RETRY_FIRST_DELAY: Duration = Duration::from_millis(100);
/// The longest pause between asks.
const REGISTRY_RETRY_MAX_DELAY: Duration = Duration::from_secs(1);

/// Agents a capability lookup considers at most; the least loaded of them runs the task.
const CAPABILITY_CANDIDATES: u32 = 50;

/// How the leader's frames consumer is doing, for readiness: a consumer that holds unsettled
/// frames and has acknowledged none for [`FRAMES_STALL`] makes no progress, and the replica
/// says so instead of reporting ready while nothing moves.
#[derive(Debug, Default)]
pub struct FramesProgress {
    /// Frames handed to the applier and not yet acknowledged or released.
    unsettled: std::sync::atomic::AtomicI64,
    /// When a frame was last acknowledged, or the consumer went from idle to busy (epoch ms).
    last_progress_ms: std::sync::atomic::AtomicI64,
}

/// How long a consumer holding frames may go without acknowledging one before readiness fails.
pub const FRAMES_STALL: Duration = Duration::from_secs(30);

impl FramesProgress {
    /// A frame was handed to the applier.
    pub fn received(&self) {
        if self.unsettled.fetch_add(1, Ordering::AcqRel) == 0 {
            self.last_progress_ms.store(now_ms(), Ordering::Release);
        }
    }

    /// A frame was acknowledged: progress.
    pub fn acked(&self) {
        self.unsettled.fetch_sub(1, Ordering::AcqRel);
        self.last_progress_ms.store(now_ms(), Ordering::Release);
    }

    /// A frame was handed back for redelivery: no progress.
    pub fn released(&self) {
        self.unsettled.fetch_sub(1, Ordering::AcqRel);
    }

    /// `None` when the consumer progresses (or holds nothing); otherwise why not.
    pub fn stalled(&self, now_ms: i64) -> Option<String> {
        let unsettled = self.unsettled.load(Ordering::Acquire);
        let idle_ms = now_ms - self.last_progress_ms.load(Ordering::Acquire);
        let limit = i64::try_from(FRAMES_STALL.as_millis()).unwrap_or(i64::MAX);
        (unsettled > 0 && idle_ms > limit).then(|| {
            format!(
                "{unsettled} frames held and none acknowledged for {} s",
                idle_ms / 1000
            )
        })
    }
}

/// The handle every part of a replica shares.
#[derive(Clone)]
pub struct Engine {
    /// Tables (reads; the leader's writes go through the applier).
    pub store: TaskStore,
    bus: SharedBus,
    registry: RegistryClient,
    subjects: Subjects,
    settings: SessionSettings,
    planners: Arc<Planners>,
    callbacks: Arc<Callbacks>,
    blobs: aip_bus::BlobStore,
    ops: mpsc::Sender<Traced>,
    leading: Arc<AtomicBool>,
    /// Another replica held the leadership when this one last tried.
    standby: Arc<AtomicBool>,
    /// The frames consumer's progress, for readiness.
    pub frames: Arc<FramesProgress>,
    /// REST requests waiting for tasks' next events, woken by the leader's commits.
    pub watch: crate::watch::EventWatch,
    published: Arc<std::sync::Mutex<Vec<String>>>,
    /// The groups of outbox frames this term stored whose frames are not all acknowledged.
    groups: Arc<std::sync::Mutex<crate::outbox::Groups>>,
    /// Stale groups the sweeper split, written with the next group commit.
    splits: Arc<std::sync::Mutex<Vec<crate::outbox::Split>>>,
    /// Outbox frames published and not acknowledged yet, with when they were published: the
    /// outbox sweeper leaves them alone until their acknowledgement is overdue. (A group
    /// holding a 90 MiB result takes seconds to write; its frames must not count as stale
    /// from the time the write began.)
    unacknowledged: Arc<std::sync::Mutex<HashMap<String, std::time::Instant>>>,
    /// Frames sent outside the outbox whose acknowledgement someone waits for.
    acks_awaited: Arc<std::sync::Mutex<std::collections::HashMap<String, oneshot::Sender<()>>>>,
    /// This replica (unique per process): its lease holder id and the token of its
    /// delivery-acknowledgement subject.
    replica: Arc<str>,
    /// The registry's records of recent explicit targets.
    targets: Arc<std::sync::Mutex<TargetCache>>,
    /// The gateway holding each client frames are published for.
    routes: Arc<Routes>,
    /// The task ids the database may hold, so that new ids are not looked up.
    known: Arc<KnownIds>,
}

/// The receiving end of the applier's channel, for [`run_applier`].
pub struct Applier {
    ops: mpsc::Receiver<Traced>,
}

impl Engine {
    /// An engine and its applier's channel.
    pub fn new(
        store: TaskStore,
        bus: SharedBus,
        subjects: Subjects,
        settings: SessionSettings,
        planners: Planners,
        callbacks: Callbacks,
    ) -> (Self, Applier) {
        let blobs = aip_bus::BlobStore::for_subjects(&subjects);
        let (tx, rx) = mpsc::channel(settings.max_in_flight.max(MIN_IN_FLIGHT) * OP_QUEUE_FACTOR);
        let registry = RegistryClient::new(
            bus.clone(),
            subjects.clone(),
            Duration::from_millis(settings.request_timeout_ms),
        );
        let watch = crate::watch::EventWatch::new(settings.max_event_watchers);
        let engine = Engine {
            store,
            registry,
            bus,
            subjects,
            planners: Arc::new(planners),
            callbacks: Arc::new(callbacks),
            blobs,
            ops: tx,
            leading: Arc::new(AtomicBool::new(false)),
            standby: Arc::new(AtomicBool::new(false)),
            frames: Arc::default(),
            watch,
            published: Arc::default(),
            groups: Arc::default(),
            splits: Arc::default(),
            unacknowledged: Arc::default(),
            acks_awaited: Arc::default(),
            replica: uuid::Uuid::new_v4().simple().to_string().into(),
            targets: Arc::default(),
            routes: Arc::default(),
            known: Arc::new(KnownIds::new(settings.known_task_ids_bytes)),
            settings,
        };
        (engine, Applier { ops: rx })
    }

    pub fn bus(&self) -> &SharedBus {
        &self.bus
    }

    /// Where large bodies go.
    pub fn blobs(&self) -> &aip_bus::BlobStore {
        &self.blobs
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    pub fn settings(&self) -> &SessionSettings {
        &self.settings
    }

    /// How callbacks are delivered.
    pub fn callbacks(&self) -> &Callbacks {
        &self.callbacks
    }

    pub(crate) fn callbacks_arc(&self) -> Arc<Callbacks> {
        self.callbacks.clone()
    }

    /// The planners this replica reaches.
    pub fn planners(&self) -> &Planners {
        &self.planners
    }

    /// Where gateways acknowledge the frames this replica sends.
    pub fn ack_subject(&self) -> String {
        self.subjects.sessions_acks(&self.replica)
    }

    /// Whether this replica leads (applies changes).
    pub fn is_leading(&self) -> bool {
        self.leading.load(Ordering::Acquire)
    }

    /// Whether this replica found another one leading at its last try (false while it has
    /// not tried yet, and while it leads).
    pub fn is_standby(&self) -> bool {
        self.standby.load(Ordering::Acquire)
    }

    /// Records outbox frames gateways acknowledged, and rows dropped: their rows are deleted
    /// with the next group (a group's row once all its frames are acknowledged).
    pub(crate) fn mark_published(&self, ids: impl IntoIterator<Item = String>) {
        let mut ids: Vec<String> = ids.into_iter().collect();
        if let Ok(mut unacknowledged) = self.unacknowledged.lock()
            && !unacknowledged.is_empty()
        {
            for id in &ids {
                unacknowledged.remove(id);
            }
        }
        if let Ok(mut waiting) = self.acks_awaited.lock()
            && !waiting.is_empty()
        {
            ids.retain(|id| match waiting.remove(id) {
                Some(written) => {
                    let _ = written.send(());
                    false
                }
                None => true,
            });
        }
        if let Ok(mut groups) = self.groups.lock()
            && !groups.is_empty()
        {
            ids = ids
                .into_iter()
                .filter_map(|id| match groups.acknowledged(&id) {
                    Acknowledged::Row => Some(id),
                    Acknowledged::InGroup => None,
                    Acknowledged::GroupDone(key) => Some(key.to_string()),
                })
                .collect();
        }
        if let Ok(mut list) = self.published.lock() {
            list.extend(ids);
        }
    }

    /// Outbox rows dropped after the retention: deleted with the next group, and groups among
    /// them forgotten.
    pub(crate) fn mark_dropped(&self, keys: Vec<String>) {
        if let Ok(mut groups) = self.groups.lock() {
            for key in &keys {
                groups.forget(key);
            }
        }
        if let Ok(mut list) = self.published.lock() {
            list.extend(keys);
        }
    }

    /// A stale group of outbox frames found by the sweeper: its frames not acknowledged yet,
    /// which the next group commit writes again as rows of their own while it deletes the
    /// group's row.
    pub(crate) fn split_group(&self, key: &str, frames: Vec<OutFrame>) -> Vec<OutFrame> {
        let Ok(mut groups) = self.groups.lock() else {
            return Vec::new();
        };
        let split = groups.split(key, frames);
        let unacknowledged = split.frames.clone();
        if let Ok(mut splits) = self.splits.lock() {
            splits.push(split);
        }
        unacknowledged
    }

    /// Publishes a frame for a client's connection outside the outbox (a callback frame) and
    /// waits up to `timeout` for its gateway to acknowledge writing it.
    pub(crate) async fn send_acknowledged(
        &self,
        to: &AgentRecord,
        msg_id: &str,
        frame: Vec<u8>,
        timeout: Duration,
    ) -> Result<(), String> {
        let (written, acked) = oneshot::channel();
        if let Ok(mut waiting) = self.acks_awaited.lock() {
            waiting.insert(msg_id.to_owned(), written);
        }
        let headers = delivery_headers(
            msg_id,
            &self.ack_subject(),
            &to.agent_id,
            Some(&to.connection_id),
        );
        let subject = self.subjects.deliver(&to.gateway_id);
        let sent = self
            .blobs
            .publish(self.bus.as_ref(), subject, headers, frame.into())
            .await;
        let outcome = match sent {
            Err(e) => Err(format!("cannot publish the frame: {e}")),
            Ok(()) => match tokio::time::timeout(timeout, acked).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) | Err(_) => Err(format!(
                    "no gateway acknowledged writing the frame within {} ms",
                    timeout.as_millis()
                )),
            },
        };
        if let Ok(mut waiting) = self.acks_awaited.lock() {
            waiting.remove(msg_id);
        }
        outcome
    }

    /// The registry client.
    pub(crate) fn registry(&self) -> &RegistryClient {
        &self.registry
    }

    /// Sends an op to the leader's applier.
    async fn apply<T>(&self, op: impl FnOnce(Reply<T>) -> Op) -> Result<T, Failure> {
        if !self.is_leading() {
            return Err(Failure::Refused(Refusal::Now(ErrorBody::new(
                ErrorCode::Unavailable,
                "this session service replica is a standby: changes go to the leading replica \
                 (its /readyz is ready); retry there, or retry here in a second",
            ))));
        }
        let (tx, rx) = oneshot::channel();
        if self.ops.send((op(tx), current_span())).await.is_err() {
            return Err(Failure::Store("the session service is stopping".into()));
        }
        rx.await
            .unwrap_or_else(|_| Err(Failure::Store("the session service is stopping".into())))
    }

    pub(crate) async fn send_op(&self, op: Op) -> bool {
        self.ops.send((op, current_span())).await.is_ok()
    }

    /// The span of a frame from the stream (`process aip.frames.{client}`), child of the
    /// gateway's publish; none while tracing is off or the frame carries no trace.
    pub(crate) fn frame_span(&self, message: &aip_bus::Message) -> tracing::Span {
        aip_bus::trace::continuing(
            aip_bus::trace::Operation::Process,
            &self.subjects.template(&message.subject),
            &message.subject,
            aip_bus::trace::extract(&message.headers),
        )
    }

    /// The span a frame of a `frames_many` event is handled in: it continues the frame's own
    /// trace, as [`Engine::frame_span`] does a message's.
    pub(crate) fn gathered_frame_span(
        &self,
        message: &aip_bus::Message,
        traceparent: Option<&str>,
    ) -> tracing::Span {
        aip_bus::trace::continuing(
            aip_bus::trace::Operation::Process,
            &self.subjects.template(&message.subject),
            &message.subject,
            traceparent.and_then(aip_bus::trace::from_traceparent),
        )
    }

    /// Turns a failure of a REST or NATS request into its answer (reading the database for a
    /// task that is not live).
    async fn answer<T>(&self, result: Result<T, Failure>) -> Result<T, EngineError> {
        match result {
            Ok(v) => Ok(v),
            Err(Failure::Store(e) | Failure::Refused(Refusal::Retry(e))) => {
                Err(EngineError::refused(
                    ErrorCode::Unavailable,
                    format!("the change was not saved ({e}); retry"),
                ))
            }
            Err(Failure::Refused(Refusal::Now(body) | Refusal::UnlessSeen(body, _))) => {
                Err(EngineError::Refused(body))
            }
            Err(Failure::Refused(Refusal::NotLive { task_id })) => {
                match self.store.get(&task_id).await? {
                    Some(task) => Err(EngineError::refused(
                        ErrorCode::Conflict,
                        format!(
                            "task '{task_id}' has already ended ({})",
                            task.state().as_str()
                        ),
                    )),
                    None => Err(EngineError::refused(
                        ErrorCode::NotFound,
                        format!("no task '{task_id}'"),
                    )),
                }
            }
        }
    }

    // ----- requests -----

    /// Starts a task from REST or NATS: resolves the executor, then the leader records it,
    /// dispatches it if its executor is free, and acknowledges a client requester.
    pub async fn submit(&self, new: NewTask) -> Result<Started, EngineError> {
        let prepared = self.prepare(new).await.map_err(EngineError::Refused)?;
        let result = self
            .apply(|reply| Op::Submit {
                prepared: Box::new(prepared),
                reply,
            })
            .await;
        self.answer(result).await.map(|task| Started { task })
    }

    /// Sends commands into a requester-driven task; returns the command's `response_id`
    /// and the sequence number of its `command_sent` event.
    pub async fn send_commands(
        &self,
        task_id: &str,
        step: PlanStep,
    ) -> Result<(String, i64), EngineError> {
        let PlanStep::Commands {
            actions,
            agent_name,
            process_name,
            root_name,
        } = step
        else {
            return Err(EngineError::refused(
                ErrorCode::InvalidRequest,
                "a driver sends commands; it ends its task with `complete`",
            ));
        };
        let step = CommandStep {
            actions,
            agent_name,
            process_name,
            root_name,
        };
        let task_id = task_id.to_owned();
        let result = self
            .apply(|reply| Op::Commands {
                task_id,
                step,
                reply,
            })
            .await;
        self.answer(result).await
    }

    /// Ends a requester-driven task.
    pub async fn complete(
        &self,
        task_id: &str,
        result: Option<serde_json::Value>,
        error: Option<String>,
    ) -> Result<Task, EngineError> {
        let task_id = task_id.to_owned();
        let result = self
            .apply(|reply| Op::Complete {
                task_id,
                result,
                error,
                reply,
            })
            .await;
        self.answer(result).await
    }

    /// Cancels a live task; the executor and a client requester are told.
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Result<Task, EngineError> {
        let task_id = task_id.to_owned();
        let reason = reason.to_owned();
        let result = self
            .apply(|reply| Op::Cancel {
                task_id,
                reason,
                reply,
            })
            .await;
        self.answer(result).await
    }

    /// Hands a task to another agent (by id, or any available agent with the capabilities).
    pub async fn handoff(
        &self,
        task_id: &str,
        to: Placement,
        reason: String,
        by: String,
    ) -> Result<Task, EngineError> {
        let candidates = self.handoff_candidates(&to).await;
        let task_id = task_id.to_owned();
        let ask = HandoffAsk {
            to,
            reason,
            by,
            candidates,
        };
        let result = self
            .apply(|reply| Op::Handoff {
                task_id,
                ask,
                reply,
            })
            .await;
        self.answer(result).await
    }

    /// The agents that could take a task handed off to `to`: the named device if it is
    /// connected, or the available agents with the capabilities.
    pub async fn handoff_candidates(&self, to: &Placement) -> Result<Vec<AgentRecord>, ErrorBody> {
        match to {
            Placement::Target(target) => match self.patiently(|| self.registry.get(target)).await {
                Ok(agent)
                    if agent.status != AgentStatus::Offline
                        && agent.client_type == ClientType::Device =>
                {
                    self.found([&agent]);
                    Ok(vec![agent])
                }
                Ok(_) | Err(RegistryError::Refused(_)) => Ok(Vec::new()),
                Err(e) => Err(e.into_error_body()),
            },
            Placement::Capabilities(capabilities) if capabilities.is_empty() => Ok(Vec::new()),
            Placement::Capabilities(capabilities) => {
                let lookup = LookupAgents {
                    version: V1,
                    capabilities: capabilities.clone(),
                    client_type: Some(ClientType::Device),
                    limit: Some(CAPABILITY_CANDIDATES),
                };
                let candidates = self
                    .patiently(|| self.registry.lookup(&lookup))
                    .await
                    .map_err(RegistryError::into_error_body)?;
                self.found(&candidates);
                Ok(candidates)
            }
        }
    }

    /// Answers a task's open question; the task goes on.
    pub async fn answer_question(
        &self,
        task_id: &str,
        answer: Answer,
    ) -> Result<Task, EngineError> {
        let task_id = task_id.to_owned();
        let result = self
            .apply(|reply| Op::Answer {
                task_id,
                answer,
                reply,
            })
            .await;
        self.answer(result).await
    }

    /// The driver of a requester-driven task asks a question.
    pub async fn ask_as_driver(
        &self,
        task_id: &str,
        question: crate::machine::DriverQuestion,
    ) -> Result<Task, EngineError> {
        let task_id = task_id.to_owned();
        let result = self
            .apply(|reply| Op::Ask {
                task_id,
                question,
                reply,
            })
            .await;
        self.answer(result).await
    }

    // ----- preparing tasks -----

    /// Looks up what starting a task needs: its executor candidates, and the owner of its
    /// id if that id is taken in the database.
    pub async fn prepare(&self, new: NewTask) -> Result<Prepared, ErrorBody> {
        let candidates = self.resolve(&new).await?;
        let existing_owner = match &new.task_id {
            Some(id) if self.may_be_taken(id) => self
                .store
                .owner(id)
                .await
                .map_err(|e| ErrorBody::new(ErrorCode::Unavailable, e.to_string()))?,
            Some(_) | None => None,
        };
        Ok(Prepared {
            new,
            candidates,
            existing_owner,
        })
    }

    /// Prepares the `task` frames of a chunk of stream messages together: each frame's task
    /// (UFO's rules for who may ask what), its executor candidates (registry requests run
    /// concurrently) and, in one database read for the whole chunk that runs beside them, the
    /// owners of the task ids that are taken.
    pub async fn prepare_frames(&self, frames: &[&InboundFrame]) -> Vec<TaskFrame> {
        // Seed 004's agent management, from clients that announced it, is answered now.
        let answers = futures::future::join_all(frames.iter().map(|f| self.agent_answer(f))).await;
        let tasks: Vec<&InboundFrame> = frames
            .iter()
            .zip(&answers)
            .filter(|(_, answer)| answer.is_none())
            .map(|(frame, _)| *frame)
            .collect();
        let mut started = self.prepare_tasks(&tasks).await.into_iter();
        answers
            .into_iter()
            .map(|answer| match answer {
                Some(Ok(response)) => TaskFrame::Answered(response),
                Some(Err(body)) => TaskFrame::Start {
                    echo_name: None,
                    start: Err(body),
                },
                None => started.next().unwrap_or_else(|| TaskFrame::Start {
                    echo_name: None,
                    start: Err(ErrorBody::new(
                        ErrorCode::Internal,
                        "task frame was not prepared",
                    )),
                }),
            })
            .collect()
    }

    /// Seed 004's agent management asked in a client's `task` frame (its `request`, with
    /// `metadata.data` and `metadata.required_capabilities`), answered by the registry;
    /// `None` for any other frame, and for every frame of a client that did not announce
    /// `agent_management` (a UFO client's task that mentions "find an agent" is a task).
    async fn agent_answer(
        &self,
        inbound: &InboundFrame,
    ) -> Option<Result<TaskResponse, ErrorBody>> {
        if !inbound
            .extensions
            .contains(&proto_schemas::Extension::AgentManagement)
        {
            return None;
        }
        let frame = &inbound.frame;
        let capabilities: Vec<String> = frame
            .metadata_value("required_capabilities")
            .and_then(serde_json::Value::as_array)
            .map(|list| {
                list.iter()
                    .filter_map(serde_json::Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let request: TaskRequest = serde_json::from_value(serde_json::json!({
            "version": 1,
            "description": frame.request.clone().unwrap_or_default(),
            "data": frame.metadata_value("data"),
            "originating_agent_id": inbound.client_id,
            "required_capabilities": capabilities,
        }))
        .ok()?;
        let action = request.agent_action()?;
        let task_id = frame.session_id.clone().filter(|s| !s.is_empty());
        let requested_by = format!("client:{}", inbound.client_id);
        Some(crate::workers::answer_agent_request(self, task_id, action, requested_by).await)
    }

    /// The tasks of client `task` frames, prepared together.
    async fn prepare_tasks(&self, frames: &[&InboundFrame]) -> Vec<TaskFrame> {
        let planned: Vec<(Option<String>, Result<NewTask, ErrorBody>)> = frames
            .iter()
            .map(|f| task_of_frame(f, &self.planners))
            .collect();
        let ids: Vec<String> = planned
            .iter()
            .filter_map(|(_, new)| new.as_ref().ok()?.task_id.clone())
            .filter(|id| self.may_be_taken(id))
            .collect();
        // The database read and the registry requests run at the same time.
        let owners = async {
            if ids.is_empty() {
                Ok(Default::default())
            } else {
                self.store.owners(&ids).await
            }
        };
        let targets =
            self.targets(planned.iter().filter_map(
                |(_, new)| match &new.as_ref().ok()?.placement {
                    Placement::Target(target) => Some(target.clone()),
                    Placement::Capabilities(_) => None,
                },
            ));
        let (owners, targets) = tokio::join!(owners, targets);
        let resolved = futures::future::join_all(planned.iter().map(|(_, new)| {
            let targets = &targets;
            async move {
                let new = new.as_ref().map_err(Clone::clone)?;
                match &new.placement {
                    Placement::Target(target) => {
                        let found = targets
                            .as_ref()
                            .map(|found| found.get(target.as_str()).cloned())
                            .map_err(Clone::clone);
                        judge_target(new, target, found)
                    }
                    Placement::Capabilities(_) => self.resolve(new).await,
                }
            }
        }))
        .await;
        planned
            .into_iter()
            .zip(resolved)
            .map(|((echo_name, new), candidates)| {
                // Refused for an unreachable database, a frame whose earlier delivery was
                // committed although the write reported an error would contradict its
                // running task: it waits for the database instead.
                if let (
                    Ok(NewTask {
                        task_id: Some(id), ..
                    }),
                    Err(e),
                ) = (&new, &owners)
                    && ids.contains(id)
                {
                    return TaskFrame::Unprepared(e.to_string());
                }
                let start = new.and_then(|new| {
                    let candidates = candidates?;
                    let existing_owner = match (&new.task_id, &owners) {
                        (Some(id), Ok(owners)) => owners.get(id).cloned(),
                        _ => None,
                    };
                    Ok(Prepared {
                        new,
                        candidates,
                        existing_owner,
                    })
                });
                TaskFrame::Start { echo_name, start }
            })
            .collect()
    }

    /// Whether a new task's id must be looked up in the database: false when the leader's
    /// filter has never seen it ([`crate::known`]).
    fn may_be_taken(&self, id: &str) -> bool {
        let may = self.known.may_hold(id);
        let outcome = if may { "asked" } else { "skipped" };
        metrics::counter!("aip_sessions_task_id_lookups_total", "outcome" => outcome).increment(1);
        may
    }

    /// The registry's records of the explicit targets of a chunk's tasks, in one request per
    /// [`MAX_GET_MANY`] ids (an unknown id is absent), or why the registry could not say.
    async fn targets(
        &self,
        targets: impl Iterator<Item = String>,
    ) -> Result<HashMap<String, AgentRecord>, ErrorBody> {
        let mut ids: Vec<String> = targets.collect();
        ids.sort_unstable();
        ids.dedup();
        let mut found = HashMap::with_capacity(ids.len());
        let asked = std::time::Instant::now();
        if let Ok(cache) = self.targets.lock() {
            ids.retain(|id| match cache.get(id, asked) {
                Some(record) => {
                    found.insert(id.clone(), record.clone());
                    false
                }
                None => true,
            });
        }
        for chunk in ids.chunks(MAX_GET_MANY) {
            let agents = self
                .patiently(|| self.registry.get_many(chunk))
                .await
                .map_err(RegistryError::into_error_body)?;
            if let Ok(mut cache) = self.targets.lock() {
                for agent in &agents {
                    cache.put(agent, asked);
                }
            }
            found.extend(agents.into_iter().map(|a| (a.agent_id.clone(), a)));
        }
        self.found(found.values());
        Ok(found)
    }

    /// Where the clients of these records are, unless known better ([`Routes::found`]).
    fn found<'r>(&self, records: impl IntoIterator<Item = &'r AgentRecord>) {
        for record in records {
            self.routes.found(record);
        }
    }

    /// Where frames for clients go ([`crate::routes`]).
    pub(crate) fn routes(&self) -> &Routes {
        &self.routes
    }

    /// A connection of `agent_id` ended: its record is asked for again (`crate::targets`).
    pub(crate) fn forget_target(&self, agent_id: &str) {
        if let Ok(mut cache) = self.targets.lock() {
            cache.forget(agent_id, std::time::Instant::now());
        }
    }

    /// A frame came from `connection_id` of `agent_id`: a kept record of that connection may
    /// be used (`crate::targets`).
    pub(crate) fn target_heard(&self, agent_id: &str, connection_id: &str) {
        if let Ok(mut cache) = self.targets.lock() {
            cache.heard(agent_id, connection_id);
        }
    }

    /// Finds the executor candidates: an explicit target must be an online device; otherwise
    /// the registry's available agents with the capabilities.
    async fn resolve(&self, new: &NewTask) -> Result<Vec<AgentRecord>, ErrorBody> {
        let candidates = self.resolve_candidates(new).await?;
        self.found(&candidates);
        Ok(candidates)
    }

    async fn resolve_candidates(&self, new: &NewTask) -> Result<Vec<AgentRecord>, ErrorBody> {
        match &new.placement {
            Placement::Target(target) => {
                let found = match self.patiently(|| self.registry.get(target)).await {
                    Ok(agent) => Ok(Some(agent)),
                    Err(RegistryError::Refused(_)) => Ok(None),
                    Err(e) => Err(e.into_error_body()),
                };
                judge_target(new, target, found)
            }
            Placement::Capabilities(capabilities) => {
                let lookup = LookupAgents {
                    version: V1,
                    capabilities: capabilities.clone(),
                    client_type: None,
                    limit: Some(CAPABILITY_CANDIDATES),
                };
                self.patiently(|| self.registry.lookup(&lookup))
                    .await
                    .map_err(RegistryError::into_error_body)
            }
        }
    }

    /// Runs a registry request, and runs it again while no registry answers (none running, or
    /// the bus itself restarting), for up to [`REGISTRY_OUTAGE_WAIT`]: an outage of a few
    /// seconds delays the tasks that need the registry instead of refusing them. A refusal by
    /// the registry is final.
    async fn patiently<T, F, Fut>(&self, request: F) -> Result<T, RegistryError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, RegistryError>>,
    {
        let deadline = tokio::time::Instant::now() + REGISTRY_OUTAGE_WAIT;
        let mut delay = REGISTRY_RETRY_FIRST_DELAY;
        loop {
            match request().await {
                Err(e @ (RegistryError::NotRunning | RegistryError::Unanswered(_)))
                    if tokio::time::Instant::now() + delay < deadline =>
                {
                    tracing::debug!("{e}; asking the registry again in {delay:?}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(REGISTRY_RETRY_MAX_DELAY);
                }
                other => return other,
            }
        }
    }

    // ----- refusals of frames -----

    /// Answers a refused client frame (after its batch committed): a redelivered frame that
    /// was applied before is dropped silently (unless `checked` is false: the database
    /// checks are skipped for a frame whose refusal failed too often); anything else gets an ERROR frame, and a
    /// refused `task` also gets `task_end` (failed) so that Galaxy's pending task ends.
    pub(crate) async fn refuse_frame(
        &self,
        inbound: &InboundFrame,
        msg_id: &str,
        refusal: Refusal,
        checked: bool,
    ) -> Result<(), StoreError> {
        let body = match refusal {
            Refusal::Now(body) => body,
            // Not a refusal: the frame is retried (`workers::settle`).
            Refusal::Retry(cause) => ErrorBody::new(ErrorCode::Unavailable, cause),
            Refusal::UnlessSeen(body, _) if !checked => body,
            Refusal::UnlessSeen(body, id) => {
                if self.store.processed(&id).await? {
                    return Ok(());
                }
                body
            }
            Refusal::NotLive { task_id } if !checked => ErrorBody::new(
                ErrorCode::Conflict,
                format!(
                    "{} for session '{task_id}', which is not running",
                    inbound.frame.kind
                ),
            ),
            Refusal::NotLive { task_id } => {
                if self.store.processed(msg_id).await? {
                    return Ok(());
                }
                let kind = inbound.frame.kind;
                match self.store.get(&task_id).await? {
                    None => ErrorBody::new(
                        ErrorCode::NotFound,
                        format!("{kind} for unknown session '{task_id}'"),
                    ),
                    Some(task) if task.executor.id != inbound.client_id => ErrorBody::new(
                        ErrorCode::Forbidden,
                        format!(
                            "{kind} refused: '{}' is not the executor of session '{task_id}'",
                            inbound.client_id
                        ),
                    ),
                    Some(task) => ErrorBody::new(
                        ErrorCode::Conflict,
                        format!(
                            "session '{task_id}' has already ended ({})",
                            task.state().as_str()
                        ),
                    ),
                }
            }
        };
        let frames = server::refusal(
            inbound.frame.kind,
            inbound.frame.session_id.as_deref(),
            body.error_code,
            &body.detail,
        );
        for frame in &frames {
            self.notify(inbound, frame).await;
        }
        Ok(())
    }

    /// Publishes a frame directly to the client that sent `inbound`, through the gateway it
    /// came from (for refusals, which change no task).
    async fn notify(&self, inbound: &InboundFrame, frame: &ServerMessage) {
        let client_id = &inbound.client_id;
        let payload = match serde_json::to_vec(frame) {
            Ok(payload) => payload,
            Err(e) => {
                tracing::error!(client = %client_id, "a refusal could not be encoded and is not sent: {e}");
                return;
            }
        };
        if let Err(e) = self
            .bus
            .publish(
                self.subjects.deliver(&inbound.gateway_id),
                Headers::new().with(aip_bus::names::CLIENT, client_id.as_str()),
                payload.into(),
            )
            .await
        {
            tracing::warn!(client = %client_id, "could not send a refusal: {e}");
        }
    }

    /// Publishes outbox frames in order. A frame stays in the outbox until the gateway that
    /// wrote it to the client's socket acknowledges it ([`crate::workers::run_ack_listener`]):
    /// a publish that succeeds has only reached the client library's buffer, which a NATS
    /// restart loses. The outbox sweeper sends it again until then.
    ///
    /// These are frames sent again: their clients' routes are asked of the registry anew (a
    /// frame no gateway acknowledged may have gone to a gateway its client had left), and each
    /// travels alone (the gateway may be one of an earlier version now, under the same id).
    pub(crate) async fn publish_frames(&self, frames: Vec<OutFrame>) {
        for frame in &frames {
            self.routes.forget(&frame.client_id);
        }
        self.publish_frames_stored(frames, StoredBodies::new(), false)
            .await;
    }

    /// The gateway holding each client of `frames`: known ([`crate::routes`]), or asked of the
    /// registry, in one request per [`MAX_GET_MANY`] clients. A client the registry does not
    /// know as connected (or a registry that does not answer) has none: its frames wait in
    /// the outbox for the sweeper.
    async fn gateways_of(&self, frames: &[OutFrame]) -> HashMap<String, String> {
        let mut gateways = HashMap::new();
        let mut unknown = std::collections::BTreeSet::new();
        for frame in frames {
            if gateways.contains_key(&frame.client_id) || unknown.contains(&frame.client_id) {
                continue;
            }
            match self.routes.gateway(&frame.client_id) {
                Some(gateway) => {
                    gateways.insert(frame.client_id.clone(), gateway);
                }
                None => {
                    unknown.insert(frame.client_id.clone());
                }
            }
        }
        let unknown: Vec<String> = unknown.into_iter().collect();
        for chunk in unknown.chunks(MAX_GET_MANY) {
            match self.registry.get_many(chunk).await {
                Ok(records) => {
                    self.found(&records);
                    for record in records {
                        if record.status != AgentStatus::Offline {
                            gateways.insert(record.agent_id, record.gateway_id);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(
                        clients = chunk.len(),
                        "the registry did not say where clients are; their frames wait in the outbox: {e}"
                    );
                }
            }
        }
        gateways
    }

    /// Stores the bodies of a group's frames too large for one bus message in the blob
    /// stream, while the group commits: each body once (a task's `task_end` to its requester
    /// and to its executor is one body). A failure leaves the frame to be stored as it is
    /// published.
    fn store_large_frames(
        &self,
        frames: &[OutFrame],
    ) -> Option<tokio::task::JoinHandle<StoredBodies>> {
        let large: Vec<(String, bytes::Bytes)> = frames
            .iter()
            .filter(|f| aip_bus::BlobStore::needed(self.bus.as_ref(), &f.payload))
            .map(|f| (f.msg_id.clone(), f.payload.clone()))
            .collect();
        if large.is_empty() {
            return None;
        }
        let engine = self.clone();
        Some(tokio::spawn(async move {
            let mut stored = StoredBodies::new();
            let mut by_body: HashMap<(usize, usize), String> = HashMap::new();
            for (msg_id, payload) in large {
                // Frames sharing one encoding share its bytes: the same address and length.
                let key = (payload.as_ptr() as usize, payload.len());
                if let Some(reference) = by_body.get(&key) {
                    stored.insert(msg_id, reference.clone());
                    continue;
                }
                match engine.blobs.put(engine.bus.as_ref(), payload).await {
                    Ok(Some(reference)) => {
                        by_body.insert(key, reference.clone());
                        stored.insert(msg_id, reference);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!("a large frame was not stored ahead of its publish: {e}")
                    }
                }
            }
            stored
        }))
    }

    /// Publishes frames, each to the gateway holding its client; those in `stored` by
    /// reference to their body, stored beforehand. A frame whose client is not connected
    /// anywhere stays in the outbox. With `gather`, the frames for a gateway that reads
    /// delivery batches travel together ([`crate::batches`]), in their order among that
    /// gateway's other frames.
    async fn publish_frames_stored(
        &self,
        frames: Vec<OutFrame>,
        mut stored: StoredBodies,
        gather: bool,
    ) {
        let ack_subject = self.ack_subject();
        let gateways = self.gateways_of(&frames).await;
        // Which frames may travel in a batch: those of a gateway that reads them and has more
        // than one such frame here.
        let mut batchable: HashMap<&str, usize> = HashMap::new();
        let may_gather = |frame: &OutFrame, gateway: &str| {
            gather
                && frame.payload.len() <= GATHERED_FRAME_BYTES
                && !stored.contains_key(&frame.msg_id)
                && self.routes.takes_batches(gateway)
        };
        for frame in &frames {
            if let Some(gateway) = gateways.get(&frame.client_id)
                && may_gather(frame, gateway)
            {
                *batchable.entry(gateway.as_str()).or_default() += 1;
            }
        }
        let limit = self.bus.max_payload() / 2;
        let mut gathered: HashMap<&str, Gathered<'_>> = HashMap::new();
        for frame in &frames {
            let Some(gateway) = gateways.get(&frame.client_id) else {
                tracing::debug!(client = %frame.client_id, "a frame for a client connected nowhere waits in the outbox");
                metrics::counter!("aip_sessions_frames_unrouted_total").increment(1);
                continue;
            };
            let subject = self.subjects.deliver(gateway);
            let span = aip_bus::trace::continuing(
                aip_bus::trace::Operation::Publish,
                &self.subjects.template(&subject),
                &subject,
                frame.trace.clone(),
            );
            if batchable.get(gateway.as_str()).is_some_and(|n| *n > 1) {
                let delivery = batches::delivery(
                    &frame.msg_id,
                    &frame.client_id,
                    frame.connection.as_deref(),
                    aip_bus::trace::traceparent_of(&span),
                    &frame.payload,
                );
                if let Some(delivery) = delivery.filter(|d| !batches::too_large(d, limit)) {
                    let batch = gathered.entry(gateway.as_str()).or_default();
                    if !batch.fits(&delivery, limit) {
                        self.publish_batch(subject.clone(), &ack_subject, batch)
                            .await;
                    }
                    batch.push(delivery, span);
                    continue;
                }
            }
            // Whatever was gathered for this gateway goes first: frames keep their order.
            if let Some(batch) = gathered.get_mut(gateway.as_str())
                && !batch.is_empty()
            {
                self.publish_batch(subject.clone(), &ack_subject, batch)
                    .await;
            }
            let headers = delivery_headers(
                &frame.msg_id,
                &ack_subject,
                &frame.client_id,
                frame.connection.as_deref(),
            );
            let publish = match stored.remove(&frame.msg_id) {
                Some(reference) => self
                    .blobs
                    .publish_stored(self.bus.as_ref(), subject.clone(), headers, reference)
                    .boxed(),
                None => self
                    .blobs
                    .publish(
                        self.bus.as_ref(),
                        subject.clone(),
                        headers,
                        frame.payload.clone(),
                    )
                    .boxed(),
            };
            match publish.instrument(span).await {
                Ok(()) => {
                    metrics::counter!("aip_sessions_frames_published_total", "form" => "alone")
                        .increment(1);
                    self.published([frame.msg_id.clone()]);
                }
                Err(e) => {
                    tracing::warn!(%subject, "publish after commit failed, left in the outbox: {e}")
                }
            }
        }
        for (gateway, mut batch) in gathered {
            if !batch.is_empty() {
                let subject = self.subjects.deliver(gateway);
                self.publish_batch(subject, &ack_subject, &mut batch).await;
            }
        }
    }

    /// Publishes the frames gathered for one gateway as one [`DeliveryBatch`] message.
    ///
    /// [`DeliveryBatch`]: proto_schemas::sessions::DeliveryBatch
    async fn publish_batch(&self, subject: String, ack_subject: &str, batch: &mut Gathered<'_>) {
        let taken = batch.take();
        let count = taken.msg_ids.len();
        let payload = match taken.payload {
            Ok(payload) => payload,
            Err(e) => {
                tracing::error!(
                    count,
                    "a delivery batch could not be encoded; its frames wait in the outbox: {e}"
                );
                return;
            }
        };
        let headers = Headers::new()
            .with(aip_bus::names::CONTROL, aip_bus::names::BATCH)
            .with(aip_bus::names::ACK, ack_subject.to_owned())
            .with(aip_bus::names::READS, aip_bus::names::FRAMES_MANY);
        match self
            .bus
            .publish(subject.clone(), headers, payload.into())
            .await
        {
            Ok(()) => {
                metrics::counter!("aip_sessions_delivery_batches_total").increment(1);
                metrics::counter!("aip_sessions_frames_published_total", "form" => "batched")
                    .increment(count as u64);
                self.published(taken.msg_ids);
            }
            Err(e) => {
                tracing::warn!(%subject, count, "publish of a delivery batch after commit failed, its frames left in the outbox: {e}")
            }
        }
        drop(taken.spans);
    }

    /// Frames just published: the sweeper leaves them alone until they are acknowledged or
    /// old enough to send again.
    fn published(&self, msg_ids: impl IntoIterator<Item = String>) {
        if let Ok(mut unacknowledged) = self.unacknowledged.lock() {
            let now = std::time::Instant::now();
            for msg_id in msg_ids {
                unacknowledged.insert(msg_id, now);
            }
        }
    }

    /// The outbox frames published less than `within` ago and not acknowledged yet: the
    /// sweeper does not send them again. Older ones are forgotten here (the sweeper sends
    /// them again, which records them anew).
    pub(crate) fn recently_published(&self, within: Duration) -> Vec<String> {
        let Ok(mut unacknowledged) = self.unacknowledged.lock() else {
            return Vec::new();
        };
        unacknowledged.retain(|_, at| at.elapsed() < within);
        unacknowledged.keys().cloned().collect()
    }
}

/// The executor of a task with an explicit target, from what the registry knows of it
/// (`None`: nothing): it must be a device that is not offline.
fn judge_target(
    new: &NewTask,
    target: &str,
    found: Result<Option<AgentRecord>, ErrorBody>,
) -> Result<Vec<AgentRecord>, ErrorBody> {
    let not_connected = || crate::machine::not_connected(new, target);
    match found? {
        None => Err(not_connected()),
        Some(agent) if agent.status == AgentStatus::Offline => Err(not_connected()),
        Some(agent) if agent.client_type != ClientType::Device => Err(ErrorBody::new(
            ErrorCode::DeviceNotFound,
            "Constellation tasks may only target device clients",
        )),
        Some(agent) => Ok(vec![agent]),
    }
}

/// The task a client `task` frame asks for, by UFO's rules (a constellation names its target
/// device; a device may only target itself), and for a device's frame with a task name the
/// name of the UFO dispatch it may echo.
fn task_of_frame(
    inbound: &InboundFrame,
    planners: &Planners,
) -> (Option<String>, Result<NewTask, ErrorBody>) {
    let frame = &inbound.frame;
    let target = frame.target_id.clone().filter(|t| !t.is_empty());
    let (placement, echo_name) = match inbound.client_type {
        ClientType::Constellation => {
            let Some(target) = target else {
                return (
                    None,
                    Err(ErrorBody::new(
                        ErrorCode::ProtocolError,
                        "Constellation task requests require target_id",
                    )),
                );
            };
            (Placement::Target(target), None)
        }
        ClientType::Device => {
            if target.as_ref().is_some_and(|t| *t != inbound.client_id) {
                return (
                    None,
                    Err(ErrorBody::new(
                        ErrorCode::Forbidden,
                        "Device clients may not target other devices",
                    )),
                );
            }
            (
                Placement::Target(inbound.client_id.clone()),
                frame.task_name.clone(),
            )
        }
    };
    let plan = match frame.metadata_value("steps") {
        Some(steps) => match serde_json::from_value(steps.clone()) {
            Ok(steps) => Plan::Scripted(steps),
            Err(e) => {
                return (
                    echo_name,
                    Err(ErrorBody::new(
                        ErrorCode::ProtocolError,
                        format!(
                            "task frame: field `metadata.steps`: must be a list of lists of Commands: {e}"
                        ),
                    )),
                );
            }
        },
        None => {
            let requested = match frame.metadata_value("planner") {
                None | Some(serde_json::Value::Null) => None,
                Some(value) => match value.as_str().and_then(PlannerName::from_wire) {
                    Some(name) => Some(name),
                    None => {
                        return (
                            echo_name,
                            Err(ErrorBody::new(
                                ErrorCode::ProtocolError,
                                format!(
                                    "task frame: field `metadata.planner`: must be one of {} (got {value})",
                                    PlannerName::expected()
                                ),
                            )),
                        );
                    }
                },
            };
            match planners.choose(requested) {
                Ok(name) => Plan::Planner(name),
                Err(refusal) => return (echo_name, Err(refusal)),
            }
        }
    };
    let requester = Requester::Client {
        id: inbound.client_id.clone(),
        client_type: inbound.client_type,
        connection: Some(inbound.connection_id.clone()),
        extensions: inbound.extensions.clone(),
    };
    let request = frame.request.clone().unwrap_or_default();
    let new = NewTask {
        task_id: frame.session_id.clone().filter(|s| !s.is_empty()),
        task_name: Some(sanitize_task_name(frame.task_name.as_deref())),
        data: frame.metadata_value("data").cloned(),
        priority: frame
            .metadata_value("priority")
            .and_then(serde_json::Value::as_i64)
            // Out of range: the nearest i32, which the priority ceiling then judges.
            .map(|p| i32::try_from(p).unwrap_or(if p < 0 { i32::MIN } else { i32::MAX }))
            .unwrap_or(0),
        callback_url: None,
        timeout_secs: frame
            .metadata_value("timeout_secs")
            .and_then(serde_json::Value::as_u64),
        ..NewTask::new(request, requester, placement, plan)
    };
    (echo_name, Ok(new))
}

/// Runs the applier until `stop`: waits to lead, then applies ops in batches; gives up the
/// leadership (and waits to lead again) when a batch cannot be written. `on_lead` is called
/// with a token that is cancelled when this term of leadership ends, to run the leader's
/// workers.
pub async fn run_applier(
    engine: Engine,
    applier: Applier,
    stop: CancellationToken,
    on_lead: impl Fn(CancellationToken),
) {
    let mut ops = applier.ops;
    let lease = LeaseSpec {
        name: format!("aip-sessions:{}", engine.subjects.prefix()),
        holder: engine.replica.to_string(),
        duration: Duration::from_millis(engine.settings.leader_lease_ms),
    };
    let retry = Duration::from_millis(engine.settings.standby_retry_ms.max(MIN_STANDBY_RETRY_MS));
    let (frames_tx, frames_rx) = mpsc::channel::<Committed>(PUBLISH_QUEUE_BATCHES);
    let (plans_tx, plans_rx) =
        mpsc::channel(engine.settings.max_in_flight.max(MIN_IN_FLIGHT) * PLAN_QUEUE_FACTOR);
    let publisher = tokio::spawn(run_publisher(engine.clone(), frames_rx));
    let planner = tokio::spawn(crate::planners::run_planner(
        engine.clone(),
        engine.planners.clone(),
        plans_rx,
        engine.settings.max_in_flight,
    ));
    let outputs = Outputs {
        frames: frames_tx,
        plans: plans_tx,
    };
    let mut spare = None;
    let mut terms: u64 = 0;
    while let Some(mut writer) = wait_to_lead(&engine, &lease, &mut spare, retry, &stop).await {
        // Before anything of this term is written: the filter then misses no id.
        terms += 1;
        let known_ids = engine.known.begin_term(terms);
        let live = match writer.load_live().await {
            Ok(live) => live,
            Err(e) => {
                tracing::warn!("cannot load the live tasks: {e}");
                tokio::time::sleep(retry).await;
                continue;
            }
        };
        tracing::info!(live = live.len(), "leading: this replica applies changes");
        let core = Machine::new(engine.settings.clone(), live);
        engine.standby.store(false, Ordering::Release);
        engine.leading.store(true, Ordering::Release);
        let term = stop.child_token();
        if let Some(filter) = known_ids {
            tokio::spawn(load_known_ids(
                engine.clone(),
                terms,
                filter,
                term.clone(),
                retry,
            ));
        }
        on_lead(term.clone());
        // What an earlier term stored is split when the sweeper finds it stale.
        if let Ok(mut groups) = engine.groups.lock() {
            groups.clear();
        }
        let mut leader = Leader {
            engine: &engine,
            core,
            writer,
            waiters: Vec::new(),
            next_tick: tokio::time::Instant::now() + TICK,
        };
        let ended = leader.run(&mut ops, &stop, &outputs).await;
        if matches!(ended, TermEnd::Stopped) {
            leader.writer.resign().await;
        }
        // Closes the leader's connection before anything waits.
        drop(leader);
        engine.leading.store(false, Ordering::Release);
        // Another replica may lead next and write ids this filter never sees.
        engine.known.end_term();
        term.cancel();
        match ended {
            TermEnd::Stopped => break,
            TermEnd::WriteFailed => tokio::time::sleep(retry).await,
        }
    }
    engine.leading.store(false, Ordering::Release);
    drop(outputs);
    let _ = publisher.await;
    planner.abort();
}

/// Task ids read per page when the filter of known ids is built.
const KNOWN_IDS_PAGE: usize = 10_000;

/// Builds the term's filter of known task ids from every id in the database, page by page
/// beside the leader's work; a failed read is tried again until the term ends. New tasks' ids
/// are looked up until it is built.
async fn load_known_ids(
    engine: Engine,
    term: u64,
    mut filter: fastbloom::BloomFilter,
    stop: CancellationToken,
    retry: Duration,
) {
    let started = std::time::Instant::now();
    let mut from = String::new();
    let mut read: usize = 0;
    loop {
        let page = tokio::select! {
            page = engine.store.task_ids_from(&from, KNOWN_IDS_PAGE) => page,
            () = stop.cancelled() => return,
        };
        match page {
            Ok(ids) => {
                let last_page = ids.len() < KNOWN_IDS_PAGE;
                // A page after the first starts with the last id of the one before.
                let again = usize::from(!from.is_empty() && ids.first() == Some(&from));
                read += ids.len() - again;
                for id in &ids {
                    filter.insert(id.as_str());
                }
                match ids.into_iter().last() {
                    Some(last) if !last_page => from = last,
                    _ => break,
                }
            }
            Err(e) => {
                tracing::warn!(
                    "cannot read the task ids (new tasks' ids are looked up in the database until they are read): {e}"
                );
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = stop.cancelled() => return,
                }
            }
        }
    }
    engine.known.loaded(term, filter);
    tracing::info!(
        read,
        ms = started.elapsed().as_millis() as u64,
        "known task ids read: a new task's id is looked up only if one like it may exist"
    );
}

/// Ops queued per in-flight frame: room for the frames of one full consumer window, and as
/// many REST and planner ops, before senders wait.
const OP_QUEUE_FACTOR: usize = 2;

/// Deadlines and lost planner requests are looked at this often, also under a load that never
/// lets the applier wait.
const TICK: Duration = Duration::from_millis(500);
/// A standby asks for the leadership at most this often, whatever the setting says.
const MIN_STANDBY_RETRY_MS: u64 = 10;
/// Floor of `max_in_flight` when sizing queues, so that a tiny setting still lets a group form.
pub(crate) const MIN_IN_FLIGHT: usize = 64;
/// Committed groups whose frames wait to be published; the applier waits when it is full
/// (publishing is the slower side only when NATS is).
const PUBLISH_QUEUE_BATCHES: usize = 256;
/// Planning requests queued per in-flight frame; a full queue drops the request, and the task
/// is asked for again by [`Machine::replan_stalled`].
const PLAN_QUEUE_FACTOR: usize = 4;

/// Where a committed group's work goes.
struct Outputs {
    frames: mpsc::Sender<Committed>,
    plans: mpsc::Sender<PlanJob>,
}

/// Why a term of leadership ended.
enum TermEnd {
    /// The service stops (or every sender of ops is gone).
    Stopped,
    /// A group could not be written: the leadership is given up and the state reloaded.
    WriteFailed,
}

/// Waits until this replica holds the leadership, or `None` once `stop` fires.
async fn wait_to_lead(
    engine: &Engine,
    lease: &LeaseSpec,
    spare: &mut Option<sqlx::PgConnection>,
    retry: Duration,
    stop: &CancellationToken,
) -> Option<Writer> {
    loop {
        match engine.store.try_lead(lease, spare).await {
            Ok(Some(writer)) => return Some(writer),
            Ok(None) => engine.standby.store(true, Ordering::Release),
            Err(e) => tracing::warn!("cannot reach the database to lead: {e}"),
        }
        tokio::select! {
            () = tokio::time::sleep(retry) => {}
            () = stop.cancelled() => return None,
        }
    }
}

/// One term of leadership: the live state, the leader's connection, and the replies that
/// wait for the group being formed.
struct Leader<'e> {
    engine: &'e Engine,
    core: Machine,
    writer: Writer,
    waiters: Vec<Waiter>,
    next_tick: tokio::time::Instant,
}

impl Leader<'_> {
    /// Applies ops and writes them in groups until the service stops or a write fails.
    async fn run(
        &mut self,
        ops: &mut mpsc::Receiver<Traced>,
        stop: &CancellationToken,
        outputs: &Outputs,
    ) -> TermEnd {
        loop {
            if !self.wait_for_work(ops, stop).await {
                return TermEnd::Stopped;
            }
            if let Err(e) = self.writer.renew_if_due().await {
                tracing::error!("the leadership could not be renewed, giving it up: {e}");
                for waiter in self.waiters.drain(..) {
                    waiter.fail(&e.to_string());
                }
                return TermEnd::WriteFailed;
            }
            self.on_tick();
            self.take_ready_ops(ops);
            self.collect_published();
            if !self.core.has_changes() && self.waiters.is_empty() {
                if stop.is_cancelled() {
                    return TermEnd::Stopped;
                }
                continue;
            }
            match self.write_group(ops, outputs).await {
                Ok(GroupEnd::Continue) => {}
                Ok(GroupEnd::ChannelClosed) => return TermEnd::Stopped,
                Err(()) => return TermEnd::WriteFailed,
            }
            // On stop, what was applied meanwhile is still written before the term ends.
        }
    }

    /// Waits for an op, a tick or the stop, unless there is something to write already (ops
    /// applied while the last group was written are written at once). False when every
    /// sender of ops is gone.
    async fn wait_for_work(
        &mut self,
        ops: &mut mpsc::Receiver<Traced>,
        stop: &CancellationToken,
    ) -> bool {
        if !self.waiters.is_empty() || self.core.has_changes() {
            return true;
        }
        tokio::select! {
            biased;
            () = stop.cancelled() => true,
            op = ops.recv() => match op {
                Some(op) => {
                    apply_op(&mut self.core, op, &mut self.waiters);
                    true
                }
                None => false,
            },
            () = tokio::time::sleep_until(self.next_tick) => true,
        }
    }

    /// Deadlines, lost planner requests and the turn of the processed ids' period
    /// ([`ProcessedHalf`]), when a tick is due.
    fn on_tick(&mut self) {
        if tokio::time::Instant::now() < self.next_tick {
            return;
        }
        self.next_tick = tokio::time::Instant::now() + TICK;
        let now = now_ms();
        self.core.expire_due(now);
        self.core.replan_stalled(now);
        self.core.processed_into(ProcessedHalf::at(now));
    }

    /// Applies the ops already waiting, up to the group's size limit.
    fn take_ready_ops(&mut self, ops: &mut mpsc::Receiver<Traced>) {
        while self.core.changes() < self.engine.settings.max_batch {
            match ops.try_recv() {
                Ok(op) => apply_op(&mut self.core, op, &mut self.waiters),
                Err(_) => break,
            }
        }
    }

    /// Outbox rows whose frames were acknowledged (or dropped) are deleted with the next
    /// group, which also splits the stale groups the sweeper found.
    fn collect_published(&mut self) {
        let published = self
            .engine
            .published
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        self.core.published(published);
        let splits = self
            .engine
            .splits
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        self.core.split(splits);
    }

    /// Writes the open group in one transaction while applying the ops that arrive meanwhile
    /// to the next one; then answers, publishes and plans, or (the write failed) fails every
    /// reply of both groups.
    async fn write_group(
        &mut self,
        ops: &mut mpsc::Receiver<Traced>,
        outputs: &Outputs,
    ) -> Result<GroupEnd, ()> {
        let mut pending = self.core.take();
        let started = std::time::Instant::now();
        let mut next_waiters: Vec<Waiter> = Vec::new();
        let mut channel_closed = false;
        let max_batch = self.engine.settings.max_batch;
        let commit_span = aip_bus::trace::linked_span("group commit", &pending.links);
        // Before the write: a task id the filter misses must not be in the database.
        self.engine
            .known
            .add(pending.batch.tasks.iter().map(|t| t.task_id.as_str()));
        let stored = self.engine.store_large_frames(&pending.batch.outbox);
        let written = {
            let write = self.writer.write(&pending.batch).instrument(commit_span);
            tokio::pin!(write);
            loop {
                tokio::select! {
                    biased;
                    written = &mut write => break written,
                    op = ops.recv(), if !channel_closed && self.core.changes() < max_batch => {
                        match op {
                            Some(op) => apply_op(&mut self.core, op, &mut next_waiters),
                            None => channel_closed = true,
                        }
                    }
                }
            }
        };
        tracing::debug!(
            replies = self.waiters.len(),
            tasks = pending.batch.tasks.len(),
            events = pending.batch.events.len(),
            frames = pending.batch.outbox.len(),
            applied_meanwhile = next_waiters.len(),
            write_us = started.elapsed().as_micros() as u64,
            "batch written"
        );
        metrics::histogram!("aip_sessions_group_commit_seconds")
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!("aip_sessions_group_commit_changes")
            .record((pending.batch.tasks.len() + pending.batch.events.len()) as f64);
        let grouped = match written {
            Ok(grouped) => grouped,
            Err(e) => {
                if let Some(stored) = stored {
                    stored.abort();
                }
                metrics::counter!("aip_sessions_group_commit_failures_total").increment(1);
                tracing::error!(
                    "a batch of changes could not be written, giving up the leadership: {e}"
                );
                // The group applied meanwhile built on this one: it fails too.
                let error = e.to_string();
                for waiter in self.waiters.drain(..).chain(next_waiters) {
                    waiter.fail(&error);
                }
                return Err(());
            }
        };
        self.core.committed(&pending);
        if let Some(grouped) = grouped
            && let Ok(mut groups) = self.engine.groups.lock()
        {
            let frames = &pending.batch.outbox;
            groups.stored(
                &grouped.key,
                grouped.members.iter().map(|&i| frames[i].msg_id.clone()),
            );
        }
        self.engine
            .watch
            .committed(pending.batch.events.iter().map(|e| e.task_id.as_str()));
        metrics::gauge!("aip_sessions_live_tasks").set(self.core.live() as f64);
        for waiter in std::mem::replace(&mut self.waiters, next_waiters) {
            waiter.succeed();
        }
        let frames = std::mem::take(&mut pending.batch.outbox);
        if !frames.is_empty()
            && outputs
                .frames
                .send(Committed { frames, stored })
                .await
                .is_err()
        {
            return Ok(GroupEnd::ChannelClosed);
        }
        for plan in pending.plans.drain(..) {
            if outputs.plans.try_send(plan).is_err() {
                tracing::warn!("planning queue full; the task is planned again later");
            }
        }
        Ok(if channel_closed {
            GroupEnd::ChannelClosed
        } else {
            GroupEnd::Continue
        })
    }
}

/// What follows a committed group.
enum GroupEnd {
    /// More groups.
    Continue,
    /// Every sender of ops is gone (or the publisher): the term ends.
    ChannelClosed,
}

/// An op and the span it was sent from (none while tracing is off): the core applies it in
/// that span, so the frames it sends continue that trace, and the group commit links it.
pub(crate) type Traced = (Op, tracing::Span);

/// The caller's span, if traces are exported.
fn current_span() -> tracing::Span {
    if aip_bus::trace::enabled() {
        tracing::Span::current()
    } else {
        tracing::Span::none()
    }
}

/// Applies one op to the core and keeps its reply for after the commit.
fn apply_op(core: &mut Machine, (op, span): Traced, waiters: &mut Vec<Waiter>) {
    let _entered = span.enter();
    core.link(&span);
    match op {
        Op::Frame {
            mut inbound,
            msg_id,
            task,
            handoff,
            reply,
        } => {
            let result = core.frame(&mut inbound, &msg_id, task.map(|t| *t), handoff);
            waiters.push(Waiter::Unit(reply, result));
        }
        Op::Closed { ends, reply } => {
            for end in &ends {
                core.closed(&end.client_id, &end.connection_id);
            }
            waiters.push(Waiter::Unit(reply, Ok(())));
        }
        Op::Submit { prepared, reply } => {
            let result = core.submit(*prepared, None);
            waiters.push(Waiter::Task(reply, result));
        }
        Op::Planned {
            task_id,
            step,
            planned,
        } => core.planned(&task_id, step, planned),
        Op::Commands {
            task_id,
            step,
            reply,
        } => {
            let result = core.send_commands(&task_id, step);
            waiters.push(Waiter::Sent(reply, result));
        }
        Op::Complete {
            task_id,
            result,
            error,
            reply,
        } => {
            let result = core.complete(&task_id, result, error);
            waiters.push(Waiter::Task(reply, result));
        }
        Op::Cancel {
            task_id,
            reason,
            reply,
        } => {
            let result = core.cancel(&task_id, &reason);
            waiters.push(Waiter::Task(reply, result));
        }
        Op::Handoff {
            task_id,
            ask,
            reply,
        } => {
            let result = core.handoff(&task_id, ask);
            waiters.push(Waiter::Task(reply, result));
        }
        Op::Answer {
            task_id,
            answer,
            reply,
        } => {
            let result = core.answer(&task_id, answer, None);
            waiters.push(Waiter::Task(reply, result));
        }
        Op::Ask {
            task_id,
            question,
            reply,
        } => {
            let result = core.ask_as_driver(&task_id, question);
            waiters.push(Waiter::Task(reply, result));
        }
    }
}

/// The frames of a committed group, and the bodies of its large ones, stored in the blob
/// stream while the group was written.
struct Committed {
    frames: Vec<OutFrame>,
    stored: Option<tokio::task::JoinHandle<StoredBodies>>,
}

/// Blob references of frames stored ahead of their publish, by message id.
type StoredBodies = HashMap<String, String>;

/// Publishes the frames of committed batches, in commit order.
async fn run_publisher(engine: Engine, mut batches: mpsc::Receiver<Committed>) {
    while let Some(Committed { frames, stored }) = batches.recv().await {
        let stored = match stored {
            Some(handle) => handle.await.unwrap_or_default(),
            None => StoredBodies::new(),
        };
        engine.publish_frames_stored(frames, stored, true).await;
    }
}

/// Headers of a frame from the outbox: its client; its message id, so that a frame sent again
/// is recognised (and dropped) by the gateway that already wrote it to the client; where that
/// gateway acknowledges it; that this service reads `frames_many` events; and the one
/// connection that may receive it, if only one may.
pub fn delivery_headers(
    msg_id: &str,
    ack_subject: &str,
    client_id: &str,
    connection: Option<&str>,
) -> Headers {
    let headers = Headers::new()
        .with(aip_bus::names::CLIENT, client_id.to_owned())
        .with(aip_bus::names::MSG_ID, msg_id.to_owned())
        .with(aip_bus::names::ACK, ack_subject.to_owned())
        .with(aip_bus::names::READS, aip_bus::names::FRAMES_MANY);
    match connection {
        Some(connection) => headers.with(aip_bus::names::CONNECTION, connection.to_owned()),
        None => headers,
    }
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

/// What a task name must be, as UFO's server says when it refuses one.
pub const TASK_NAME_RULE: &str = "Invalid task_name: must be a non-empty string of characters [A-Za-z0-9._-] and must not start with '.'";

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
    fn a_consumer_holding_frames_without_acking_any_is_stalled() {
        let progress = FramesProgress::default();
        let later = now_ms() + 31_000;
        assert_eq!(progress.stalled(later), None, "an idle consumer is fine");
        progress.received();
        progress.received();
        assert!(progress.stalled(now_ms()).is_none(), "not yet");
        let why = progress.stalled(later).expect("stalled");
        assert!(why.starts_with("2 frames held"), "{why}");
        progress.released();
        assert!(
            progress.stalled(later).is_some(),
            "a frame handed back is no progress"
        );
        progress.acked();
        assert_eq!(progress.stalled(later), None, "nothing held any more");
    }

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
