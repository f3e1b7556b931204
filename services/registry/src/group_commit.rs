//! Group commit: the registrations and unregistrations of concurrent requests, written many
//! per database transaction.
//!
//! Each request puts its write on a bounded queue and waits. A writer task takes whatever is
//! queued (up to [`MAX_BATCH`] writes) and applies it with [`AgentStore::write_batch`], one
//! transaction, one commit; each request is answered only after that commit, so nothing a
//! client was told about is lost. No delay is added to gather a batch: while a transaction
//! commits, the next batch queues up, so batches grow with the load and a lone request goes
//! straight through.
//!
//! Two writes naming the same agent never share a batch (the later one waits for the next),
//! so a batch has one outcome per agent. A batch whose transaction fails for another reason
//! than the database being unavailable is written again one write per transaction, so that a
//! single write the database refuses fails alone.

use std::collections::HashSet;
use std::sync::Arc;

use proto_schemas::registry::RegisterAgent;
use tokio::sync::{mpsc, oneshot};

use crate::store::{
    Admit, AgentStore, BatchOutcome, RegisterOutcome, StoreError, Unregister, Windows, WriteBatch,
};

/// Most writes in one transaction.
pub const MAX_BATCH: usize = 256;

/// Writes waiting for a batch. Requests are bounded already (`max_in_flight`); this bounds the
/// queue whatever the callers do: a full queue makes them wait.
pub const QUEUE_CAPACITY: usize = 1024;

/// The writing side: cheap to clone, one per registry.
#[derive(Clone)]
pub struct WriteQueue {
    jobs: mpsc::Sender<Job>,
}

/// One write and where its result goes (a registration is boxed: it is large).
enum Job {
    Register(
        Box<RegisterAgent>,
        oneshot::Sender<Result<RegisterOutcome, StoreError>>,
    ),
    Unregister(Unregister, oneshot::Sender<Result<bool, StoreError>>),
}

impl Job {
    fn agent_id(&self) -> &str {
        match self {
            Job::Register(request, _) => &request.agent_id,
            Job::Unregister(u, _) => &u.agent_id,
        }
    }
}

impl WriteQueue {
    /// Starts the task writing batches to `store`, judging registrations with `admit`. It ends
    /// once every clone of the queue is dropped and what was queued is written. Must be called
    /// within a Tokio runtime.
    ///
    /// One task, one transaction at a time: two writers overlapping their transactions were
    /// measured no faster (batches simply grow while one commits), and one writer keeps the
    /// writes of an agent in the order they were queued.
    pub fn start(store: Arc<dyn AgentStore>, windows: Windows, admit: &'static Admit) -> Self {
        let (jobs, queue) = mpsc::channel(QUEUE_CAPACITY);
        let gatherer = Gatherer {
            queue,
            postponed: Vec::new(),
        };
        tokio::spawn(write_batches(store, windows, admit, gatherer));
        WriteQueue { jobs }
    }

    /// Registers `request`; returns once the outcome is committed.
    pub async fn register(&self, request: RegisterAgent) -> Result<RegisterOutcome, StoreError> {
        let (reply, outcome) = oneshot::channel();
        self.submit(Job::Register(Box::new(request), reply), outcome)
            .await
    }

    /// Unregisters; returns once committed, whether the agent went offline.
    pub async fn unregister(&self, unregister: Unregister) -> Result<bool, StoreError> {
        let (reply, outcome) = oneshot::channel();
        self.submit(Job::Unregister(unregister, reply), outcome)
            .await
    }

    /// Writes queued and not yet taken into a batch.
    pub fn queued(&self) -> usize {
        QUEUE_CAPACITY - self.jobs.capacity()
    }

    async fn submit<T>(
        &self,
        job: Job,
        outcome: oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.jobs.send(job).await.map_err(|_| StoreError::Stopped)?;
        outcome.await.map_err(|_| StoreError::Stopped)?
    }
}

/// Writes batches taken off the queue until it is closed and empty.
async fn write_batches(
    store: Arc<dyn AgentStore>,
    windows: Windows,
    admit: &'static Admit,
    mut gatherer: Gatherer,
) {
    while let Some(batch) = gatherer.next_batch().await {
        batch.write(&*store, &windows, admit).await;
    }
}

/// The receiving end of the queue.
struct Gatherer {
    queue: mpsc::Receiver<Job>,
    /// Jobs naming an agent already in the batch being gathered: they open the next batch.
    postponed: Vec<Job>,
}

impl Gatherer {
    /// The next batch: the postponed jobs, then whatever is queued (waiting for one job if
    /// there is nothing); `None` once the queue is closed and empty.
    async fn next_batch(&mut self) -> Option<Batch> {
        let mut batch = Batch::default();
        for job in std::mem::take(&mut self.postponed) {
            self.postponed.extend(batch.add(job));
        }
        if batch.is_empty() {
            let job = self.queue.recv().await?;
            self.postponed.extend(batch.add(job));
        }
        while batch.len() < MAX_BATCH {
            match self.queue.try_recv() {
                Ok(job) => self.postponed.extend(batch.add(job)),
                Err(_) => break,
            }
        }
        Some(batch)
    }
}

/// Jobs gathered for one transaction.
#[derive(Default)]
struct Batch {
    agents: HashSet<String>,
    writes: WriteBatch,
    register_replies: Vec<oneshot::Sender<Result<RegisterOutcome, StoreError>>>,
    unregister_replies: Vec<oneshot::Sender<Result<bool, StoreError>>>,
}

impl Batch {
    fn len(&self) -> usize {
        self.writes.len()
    }

    fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Adds `job`, or gives it back if its agent is already in the batch (or the batch is
    /// full).
    fn add(&mut self, job: Job) -> Option<Job> {
        if self.len() >= MAX_BATCH || !self.agents.insert(job.agent_id().to_owned()) {
            return Some(job);
        }
        match job {
            Job::Register(request, reply) => {
                self.writes.registers.push(*request);
                self.register_replies.push(reply);
            }
            Job::Unregister(unregister, reply) => {
                self.writes.unregisters.push(unregister);
                self.unregister_replies.push(reply);
            }
        }
        None
    }

    /// Writes the batch and answers every job; records its size and how long it took.
    async fn write(self, store: &dyn AgentStore, windows: &Windows, admit: &Admit) {
        let started = std::time::Instant::now();
        let changes = self.len();
        self.write_and_answer(store, windows, admit).await;
        metrics::histogram!("aip_registry_group_commit_seconds")
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!("aip_registry_group_commit_changes").record(changes as f64);
    }

    async fn write_and_answer(self, store: &dyn AgentStore, windows: &Windows, admit: &Admit) {
        let Batch {
            writes,
            register_replies,
            unregister_replies,
            ..
        } = self;
        match store.write_batch(&writes, windows, admit).await {
            Ok(outcome) => answer(outcome, register_replies, unregister_replies),
            Err(e) if writes.len() > 1 && !e.is_unavailable() => {
                tracing::warn!(
                    writes = writes.len(),
                    "a batch of registry writes failed ({e}); writing them one by one"
                );
                let singles = writes
                    .unregisters
                    .into_iter()
                    .map(|u| WriteBatch {
                        unregisters: vec![u],
                        ..WriteBatch::default()
                    })
                    .chain(writes.registers.into_iter().map(|r| WriteBatch {
                        registers: vec![r],
                        ..WriteBatch::default()
                    }));
                let mut unregister_replies = unregister_replies.into_iter();
                let mut register_replies = register_replies.into_iter();
                for single in singles {
                    let outcome = match store.write_batch(&single, windows, admit).await {
                        Ok(outcome) => outcome,
                        Err(e) => failed(&single, e),
                    };
                    let unregister_replies = unregister_replies
                        .by_ref()
                        .take(single.unregisters.len())
                        .collect();
                    let register_replies = register_replies
                        .by_ref()
                        .take(single.registers.len())
                        .collect();
                    answer(outcome, register_replies, unregister_replies);
                }
            }
            Err(e) => answer(failed(&writes, e), register_replies, unregister_replies),
        }
    }
}

/// Every write of `batch` failing with `error`.
fn failed(batch: &WriteBatch, error: StoreError) -> BatchOutcome {
    let error = Arc::new(error);
    BatchOutcome {
        unregistered: batch
            .unregisters
            .iter()
            .map(|_| Err(StoreError::Batch(error.clone())))
            .collect(),
        registered: batch
            .registers
            .iter()
            .map(|_| Err(StoreError::Batch(error.clone())))
            .collect(),
    }
}

/// Sends each result to its job (a job whose request was abandoned is skipped).
fn answer(
    outcome: BatchOutcome,
    register_replies: Vec<oneshot::Sender<Result<RegisterOutcome, StoreError>>>,
    unregister_replies: Vec<oneshot::Sender<Result<bool, StoreError>>>,
) {
    for (reply, result) in register_replies.into_iter().zip(outcome.registered) {
        let _ = reply.send(result);
    }
    for (reply, result) in unregister_replies.into_iter().zip(outcome.unregistered) {
        let _ = reply.send(result);
    }
}
