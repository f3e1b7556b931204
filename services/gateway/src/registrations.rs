//! Registrations and unregistrations sent to the registry, gathered.
//!
//! Every connection's REGISTER and every connection's end is a registry write. Under load many
//! are waiting at once: they go as one `registry.write` request ([`RegistryWrites`]) and come
//! back as one reply with an answer for each, where each would otherwise cost its own request
//! and reply (four bus messages, and a wake-up of the gateway, NATS and the registry for each).
//! No delay is added to gather them, as for device info between gateways ([`crate::peers`]):
//! a write leaves at once when none is on its way, and otherwise waits for the one on its way
//! to return, so batches grow with the load and a lone write goes alone, on its own subject
//! (`registry.register` or `registry.unregister`).
//!
//! Registrations are answered without their stored records (`without_records`: the gateway
//! acts only on a replaced connection); a registry of an earlier version answers with them,
//! which is understood too. A registry of a still earlier version has no responder on
//! `registry.write`; a request it cannot read is refused whole. Either way the writes are
//! sent again one by one on their own subjects, so a gateway of this version works beside a
//! registry of the last (a rolling update). So are writes too large together for one bus
//! message (registrations with large tool lists): each then fares as it would alone. When the
//! registry does not answer a batch in time, the writes that gathered meanwhile get the same
//! answer at once rather than waiting as long again.

use std::sync::Arc;

use aip_bus::BusError;
use aip_bus::registry::{RegistryClient, RegistryError};
use proto_schemas::V1;
use proto_schemas::registry::{
    Accepted, MAX_WRITES, RegisterAgent, RegistryWrite, RegistryWrites, UnregisterAgent,
    Unregistered, WriteAnswer,
};
use serde::de::Error as _;
use tokio::sync::oneshot;

/// Writes waiting at most; more wait to be queued (each connection has at most one write
/// waiting, so this only bounds memory).
const QUEUE_CAPACITY: usize = 4096;

/// The gathering queue of one gateway's registry writes.
pub struct Registrations {
    queue: flume::Sender<Pending>,
}

/// One write waiting to be sent, and where its answer goes.
struct Pending {
    write: RegistryWrite,
    answer: Answer,
}

/// Where the answer to one write goes.
enum Answer {
    Register(oneshot::Sender<Result<Accepted, RegistryError>>),
    Unregister(oneshot::Sender<Result<Unregistered, RegistryError>>),
}

impl Registrations {
    /// Starts the task sending the writes to `registry`; it ends once the queue is dropped and
    /// what was queued is answered. Must be called within a Tokio runtime.
    pub fn start(registry: RegistryClient) -> Self {
        let (queue, waiting) = flume::bounded(QUEUE_CAPACITY);
        tokio::spawn(send_batches(registry, waiting));
        Registrations { queue }
    }

    /// `registry.register`, with whatever else is waiting: whether it replaced a connection.
    pub async fn register(&self, request: RegisterAgent) -> Result<Accepted, RegistryError> {
        let (answer, answered) = oneshot::channel();
        let write = RegistryWrite::Register(request);
        self.submit(write, Answer::Register(answer), answered).await
    }

    /// `registry.unregister`, with whatever else is waiting.
    pub async fn unregister(
        &self,
        request: UnregisterAgent,
    ) -> Result<Unregistered, RegistryError> {
        let (answer, answered) = oneshot::channel();
        let write = RegistryWrite::Unregister(request);
        self.submit(write, Answer::Unregister(answer), answered)
            .await
    }

    async fn submit<T>(
        &self,
        write: RegistryWrite,
        answer: Answer,
        answered: oneshot::Receiver<Result<T, RegistryError>>,
    ) -> Result<T, RegistryError> {
        // The task ends only when the queue is dropped, which outlives every caller; were it
        // gone (a panic), the write is not sent: say so rather than wait.
        let stopped = || RegistryError::Gathered(Arc::new(RegistryError::NotRunning));
        self.queue
            .send_async(Pending { write, answer })
            .await
            .map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }
}

/// Sends the queued writes in batches, one batch at a time, until the queue is dropped. (Two
/// batches on their way at once were measured no faster, and cost more CPU per write: the
/// registry commits one batch at a time anyway.)
async fn send_batches(registry: RegistryClient, waiting: flume::Receiver<Pending>) {
    while let Ok(first) = waiting.recv_async().await {
        let mut batch = vec![first];
        batch.extend(waiting.try_iter().take(MAX_WRITES - 1));
        if let Some(unanswered) = send(&registry, batch).await {
            for pending in waiting.try_iter() {
                pending
                    .answer
                    .fail(RegistryError::Gathered(unanswered.clone()));
            }
        }
    }
}

/// Sends `batch` and answers each of its writes. When the registry did not answer in time:
/// that failure, for the writes waiting now.
async fn send(registry: &RegistryClient, mut batch: Vec<Pending>) -> Option<Arc<RegistryError>> {
    if batch.len() == 1 {
        let Pending { write, answer } = batch.remove(0);
        return send_alone(registry, write, answer).await;
    }
    counted("batch", batch.len());
    let (writes, answers): (Vec<_>, Vec<_>) = batch
        .into_iter()
        .map(|pending| (pending.write, pending.answer))
        .unzip();
    let request = RegistryWrites {
        version: V1,
        writes,
        without_records: true,
    };
    match registry.write(&request).await {
        Ok(replies) if replies.len() == answers.len() => {
            for (answer, reply) in answers.into_iter().zip(replies) {
                answer.give(reply);
            }
            None
        }
        Ok(replies) => {
            let text = format!(
                "the registry answered {} writes of {} sent",
                replies.len(),
                answers.len()
            );
            tracing::warn!("{text}");
            let error = Arc::new(RegistryError::InvalidReply(serde_json::Error::custom(text)));
            for answer in answers {
                answer.fail(RegistryError::Gathered(error.clone()));
            }
            None
        }
        // A registry of an earlier version (or none: then each write hears so on its own), or
        // writes too large together for one bus message.
        Err(
            RegistryError::NotRunning
            | RegistryError::Refused(_)
            | RegistryError::Unanswered(BusError::PayloadTooLarge { .. }),
        ) => {
            let alone = request
                .writes
                .into_iter()
                .zip(answers)
                .map(|(write, answer)| send_alone(registry, write, answer));
            futures::future::join_all(alone).await;
            None
        }
        Err(e) => {
            let error = Arc::new(e);
            for answer in answers {
                answer.fail(RegistryError::Gathered(error.clone()));
            }
            Some(error)
        }
    }
}

/// Sends one write on its own subject and answers it. A failure to get an answer in time is
/// also returned, for the writes waiting meanwhile.
async fn send_alone(
    registry: &RegistryClient,
    write: RegistryWrite,
    answer: Answer,
) -> Option<Arc<RegistryError>> {
    counted("single", 1);
    match (write, answer) {
        (RegistryWrite::Register(request), Answer::Register(reply)) => {
            let registered = registry.register(&request).await.map(Accepted::from);
            let (result, unanswered) = split_unanswered(registered);
            let _ = reply.send(result);
            unanswered
        }
        (RegistryWrite::Unregister(request), Answer::Unregister(reply)) => {
            let (result, unanswered) = split_unanswered(registry.unregister(&request).await);
            let _ = reply.send(result);
            unanswered
        }
        // Never: `Registrations::register` and `unregister` make them in pairs.
        (_, answer) => {
            let text = "a registry write paired with another kind's answer";
            tracing::error!("{text}");
            answer.fail(RegistryError::Encode(serde_json::Error::custom(text)));
            None
        }
    }
}

impl Answer {
    /// Answers the write with the registry's answer to it.
    fn give(self, reply: WriteAnswer) {
        match (self, reply) {
            (Answer::Register(answer), WriteAnswer::Accepted(accepted)) => {
                let _ = answer.send(Ok(accepted));
            }
            // A registry of an earlier version answers with the whole record.
            (Answer::Register(answer), WriteAnswer::Registered(registered)) => {
                let _ = answer.send(Ok((*registered).into()));
            }
            (Answer::Unregister(answer), WriteAnswer::Unregistered(unregistered)) => {
                let _ = answer.send(Ok(unregistered));
            }
            (answer, WriteAnswer::Error(body)) => answer.fail(RegistryError::Refused(body)),
            (answer, reply) => {
                let text = format!("the registry answered a write with {reply:?}");
                tracing::warn!("{text}");
                answer.fail(RegistryError::InvalidReply(serde_json::Error::custom(text)));
            }
        }
    }

    fn fail(self, error: RegistryError) {
        match self {
            Answer::Register(answer) => {
                let _ = answer.send(Err(error));
            }
            Answer::Unregister(answer) => {
                let _ = answer.send(Err(error));
            }
        }
    }
}

/// The result to answer with, and a failure to get any answer in time (which the writes
/// waiting meanwhile share).
fn split_unanswered<T>(
    result: Result<T, RegistryError>,
) -> (Result<T, RegistryError>, Option<Arc<RegistryError>>) {
    match result {
        Err(RegistryError::Unanswered(e)) => {
            let shared = Arc::new(RegistryError::Unanswered(e));
            (Err(RegistryError::Gathered(shared.clone())), Some(shared))
        }
        other => (other, None),
    }
}

/// Counts a request to the registry carrying `writes` writes.
fn counted(form: &'static str, writes: usize) {
    metrics::counter!("aip_gateway_registry_write_requests_total", "form" => form).increment(1);
    metrics::counter!("aip_gateway_registry_writes_total").increment(writes as u64);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use aip_bus::{Headers, LocalBus, SharedBus};
    use bytes::Bytes;
    use chrono::Utc;
    use futures::StreamExt;
    use proto_schemas::registry::{AgentRecord, AgentStatus, Registered, Reply};
    use proto_schemas::{ErrorBody, ErrorCode, Platform, Subjects};

    use super::*;

    fn registration(agent_id: &str) -> RegisterAgent {
        let connection = format!("conn-{agent_id}");
        RegisterAgent::device(agent_id, "gw-1", &connection, "anonymous", Platform::Linux)
    }

    fn unregistration(agent_id: &str) -> UnregisterAgent {
        UnregisterAgent {
            version: V1,
            agent_id: agent_id.to_owned(),
            connection_id: format!("conn-{agent_id}"),
            reason: "client closed the connection".to_owned(),
        }
    }

    /// What a registry answers: ids starting with `x` are taken, any other replaces the
    /// connection `old-{id}`; an unregistration takes its agent offline when its id ends in an
    /// even digit.
    fn judge(write: &RegistryWrite) -> WriteAnswer {
        match write {
            RegistryWrite::Register(request) if request.agent_id.starts_with('x') => {
                WriteAnswer::Error(ErrorBody::new(
                    ErrorCode::RegistrationFailed,
                    format!("{} is taken", request.agent_id),
                ))
            }
            RegistryWrite::Register(request) => WriteAnswer::Registered(Box::new(Registered {
                agent: AgentRecord {
                    agent_id: request.agent_id.clone(),
                    client_type: request.client_type,
                    status: AgentStatus::Available,
                    platform: request.platform,
                    capabilities: vec![],
                    tools: vec![],
                    system_info: None,
                    metadata: None,
                    extensions: vec![],
                    target_id: None,
                    gateway_id: request.gateway_id.clone(),
                    connection_id: request.connection_id.clone(),
                    load: 0,
                    connected_at: Utc::now(),
                    last_seen: Utc::now(),
                },
                replaced_connection: Some(format!("old-{}", request.agent_id)),
                replaced_gateway: Some("gw-0".to_owned()),
            })),
            RegistryWrite::Unregister(request) => WriteAnswer::Unregistered(Unregistered {
                went_offline: request.agent_id.ends_with(['0', '2', '4', '6', '8']),
            }),
        }
    }

    /// Requests a fake registry received: on `registry.write`, and on the single subjects.
    #[derive(Default)]
    struct Counts {
        batches: AtomicUsize,
        singles: AtomicUsize,
        /// Batches asking for answers without records.
        without_records: AtomicUsize,
    }

    /// Which registry the fake one is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Version {
        /// Only the single subjects.
        WithoutBatches,
        /// `registry.write`, answering registrations with their records whatever is asked.
        WithRecords,
        /// This version: `registry.write`, honouring `without_records`.
        Current,
    }

    /// A registry answering as [`judge`] says, on the single subjects, and on
    /// `registry.write` as `version` does.
    async fn registry(bus: &SharedBus, subjects: &Subjects, version: Version) -> Arc<Counts> {
        let counts = Arc::new(Counts::default());
        let mut listened = vec![
            bus.subscribe(subjects.registry_register())
                .await
                .expect("subscribe"),
            bus.subscribe(subjects.registry_unregister())
                .await
                .expect("subscribe"),
        ];
        if version != Version::WithoutBatches {
            listened.push(
                bus.subscribe(subjects.registry_write())
                    .await
                    .expect("subscribe"),
            );
        }
        let mut requests = futures::stream::select_all(listened);
        let (bus, subjects, counted) = (bus.clone(), subjects.clone(), counts.clone());
        tokio::spawn(async move {
            while let Some(message) = requests.next().await {
                let payload = if message.subject == subjects.registry_write() {
                    counted.batches.fetch_add(1, Ordering::SeqCst);
                    let request: RegistryWrites =
                        serde_json::from_slice(&message.payload).expect("writes");
                    if request.without_records {
                        counted.without_records.fetch_add(1, Ordering::SeqCst);
                    }
                    let brief = request.without_records && version == Version::Current;
                    let answers: Vec<WriteAnswer> = request
                        .writes
                        .iter()
                        .map(|write| match judge(write) {
                            WriteAnswer::Registered(r) if brief => {
                                WriteAnswer::Accepted((*r).into())
                            }
                            answer => answer,
                        })
                        .collect();
                    serde_json::to_vec(&Reply::Ok(answers))
                } else {
                    counted.singles.fetch_add(1, Ordering::SeqCst);
                    let write = if message.subject == subjects.registry_register() {
                        RegistryWrite::Register(
                            serde_json::from_slice(&message.payload).expect("a registration"),
                        )
                    } else {
                        RegistryWrite::Unregister(
                            serde_json::from_slice(&message.payload).expect("an unregistration"),
                        )
                    };
                    match judge(&write) {
                        WriteAnswer::Registered(r) => serde_json::to_vec(&Reply::Ok(*r)),
                        WriteAnswer::Accepted(a) => serde_json::to_vec(&Reply::Ok(a)),
                        WriteAnswer::Unregistered(u) => serde_json::to_vec(&Reply::Ok(u)),
                        WriteAnswer::Error(e) => serde_json::to_vec(&Reply::<()>::Error(e)),
                    }
                };
                let reply = message.reply.expect("a request");
                let payload = Bytes::from(payload.expect("encoded"));
                bus.publish(reply, Headers::new(), payload)
                    .await
                    .expect("answered");
            }
        });
        counts
    }

    /// Sends 30 registrations and 30 unregistrations at once and checks every answer;
    /// returns the registry's counts: batches, single requests, batches asking for answers
    /// without records.
    async fn write_at_once(version: Version) -> (usize, usize, usize) {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        let counts = registry(&bus, &subjects, version).await;
        let client = RegistryClient::new(bus, subjects, Duration::from_secs(5));
        let registrations = Registrations::start(client);
        let ids: Vec<String> = (0..30)
            .map(|i| {
                if i % 7 == 0 {
                    format!("x{i}")
                } else {
                    format!("d{i}")
                }
            })
            .collect();
        let registered = futures::future::join_all(
            ids.iter()
                .map(|id| registrations.register(registration(id))),
        );
        let unregistered = futures::future::join_all(
            ids.iter()
                .map(|id| registrations.unregister(unregistration(id))),
        );
        let (registered, unregistered) = tokio::join!(registered, unregistered);
        for (id, result) in ids.iter().zip(registered) {
            match result {
                Ok(accepted) => {
                    assert!(!id.starts_with('x'), "{id} registered");
                    let replaced = format!("old-{id}");
                    assert_eq!(accepted.replaced_connection.as_deref(), Some(&*replaced));
                    assert_eq!(accepted.replaced_gateway.as_deref(), Some("gw-0"));
                }
                Err(RegistryError::Refused(body)) => {
                    assert!(id.starts_with('x'), "{id} refused: {body:?}");
                    assert_eq!(body.detail, format!("{id} is taken"));
                }
                Err(e) => panic!("{id}: {e}"),
            }
        }
        for (id, result) in ids.iter().zip(unregistered) {
            let even = id.ends_with(['0', '2', '4', '6', '8']);
            assert_eq!(result.expect("unregistered").went_offline, even, "{id}");
        }
        (
            counts.batches.load(Ordering::SeqCst),
            counts.singles.load(Ordering::SeqCst),
            counts.without_records.load(Ordering::SeqCst),
        )
    }

    #[tokio::test]
    async fn writes_waiting_together_go_as_one_request_and_each_gets_its_answer() {
        // All 60 are queued before the queue is first read: one bus request.
        assert_eq!(write_at_once(Version::Current).await, (1, 0, 1));
    }

    #[tokio::test]
    async fn a_registry_answering_with_whole_records_is_understood() {
        assert_eq!(write_at_once(Version::WithRecords).await, (1, 0, 1));
    }

    #[tokio::test]
    async fn a_registry_without_the_gathered_subject_gets_each_write_alone() {
        // The batch is refused (no responder): each write goes alone.
        assert_eq!(write_at_once(Version::WithoutBatches).await, (0, 60, 0));
    }

    #[tokio::test]
    async fn a_lone_write_goes_on_its_own_subject() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        let counts = registry(&bus, &subjects, Version::Current).await;
        let registrations =
            Registrations::start(RegistryClient::new(bus, subjects, Duration::from_secs(5)));
        let registered = registrations.register(registration("d1")).await;
        let replaced = registered.expect("registered").replaced_connection;
        assert_eq!(replaced.as_deref(), Some("old-d1"));
        let unregistered = registrations.unregister(unregistration("d2")).await;
        assert!(unregistered.expect("unregistered").went_offline);
        assert_eq!(counts.batches.load(Ordering::SeqCst), 0);
        assert_eq!(counts.singles.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn no_registry_running_is_said_to_each_write() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        let registrations =
            Registrations::start(RegistryClient::new(bus, subjects, Duration::from_secs(5)));
        let results = futures::future::join_all(
            (0..5).map(|i| registrations.register(registration(&format!("d{i}")))),
        )
        .await;
        for result in results {
            let error = result.expect_err("no registry");
            assert!(matches!(error, RegistryError::NotRunning), "{error:?}");
            assert_eq!(error.error_code(), ErrorCode::Unavailable);
        }
    }

    // On a paused clock: time moves only when every task waits, so the writes gather the
    // same way on every run.
    #[tokio::test(start_paused = true)]
    async fn writes_gathered_while_the_registry_does_not_answer_are_not_held_as_long_again() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        // Subscribed, never answering.
        let mut silent = bus
            .subscribe(subjects.registry_register())
            .await
            .expect("subscribe");
        let _silent_batches = bus
            .subscribe(subjects.registry_write())
            .await
            .expect("subscribe");
        let patience = Duration::from_millis(300);
        let registrations = Arc::new(Registrations::start(RegistryClient::new(
            bus, subjects, patience,
        )));
        let started = tokio::time::Instant::now();
        let register = |i: usize| {
            let registrations = registrations.clone();
            tokio::spawn(
                async move { registrations.register(registration(&format!("d{i}"))).await },
            )
        };
        // The first leaves alone; once it is on its way, the others gather behind it.
        let mut sent = vec![register(0)];
        silent.next().await.expect("the first request");
        sent.extend((1..20).map(register));
        for result in futures::future::join_all(sent).await {
            let error = result.expect("sent").expect_err("unanswered");
            assert_eq!(error.error_code(), ErrorCode::Unavailable, "{error}");
            assert!(error.to_string().contains("did not answer"), "{error}");
        }
        // One wait for the request on its way, not one more for the writes behind it.
        assert_eq!(started.elapsed(), patience);
    }
}
