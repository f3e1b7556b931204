//! Group commit ([`aip_registry::group_commit`]) against real databases: writes queued while
//! a transaction commits share the next transaction, every one is answered, and every one
//! the caller was told about is committed. Each test runs on PostgreSQL and on SQLite (the
//! databases of the test kit's two backends; no bus is involved).
//!
//! The store is wrapped so that its first transaction waits for the test: the writes sent
//! meanwhile are queued, and the test sees exactly which batches were written.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_registry::group_commit::WriteQueue;
use aip_registry::registry::admit;
use aip_registry::store::{
    self, AgentStore, BatchOutcome, RegisterOutcome, StoreError, Unregister, Windows, WriteBatch,
};
use aip_store::Database;
use aip_store::testing::TestDatabase;
use aip_testkit::{Backend, WAIT, both_backends, eventually, test_database, wait_until, within};
use futures::future::BoxFuture;
use futures::{FutureExt, future};
use proto_schemas::registry::{AgentStatus, RegisterAgent};
use proto_schemas::{ErrorCode, Platform};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

const WINDOWS: Windows = Windows {
    gateway: Duration::from_secs(15),
    agent: Duration::from_secs(100),
};

/// A store whose first transaction waits until the test opens the gate, and which records
/// the agents of every batch it is given.
struct GatedStore {
    inner: Arc<dyn AgentStore>,
    gate: Semaphore,
    batches: Mutex<Vec<Vec<String>>>,
}

impl GatedStore {
    /// The agents of each batch so far.
    fn batches(&self) -> Vec<Vec<String>> {
        self.batches.lock().expect("not poisoned").clone()
    }

    /// The size of each batch so far.
    fn sizes(&self) -> Vec<usize> {
        self.batches().iter().map(Vec::len).collect()
    }

    fn open_gate(&self) {
        self.gate.add_permits(1_000);
    }
}

impl AgentStore for GatedStore {
    fn write_batch<'a>(
        &'a self,
        batch: &'a WriteBatch,
        windows: &'a Windows,
        admit: &'a store::Admit,
    ) -> BoxFuture<'a, Result<BatchOutcome, StoreError>> {
        async move {
            let agents = batch.agent_ids().map(str::to_owned).collect();
            self.batches.lock().expect("not poisoned").push(agents);
            let _permit = self.gate.acquire().await.expect("gate open");
            self.inner.write_batch(batch, windows, admit).await
        }
        .boxed()
    }
    fn is_live_device<'a>(
        &'a self,
        agent_id: &'a str,
        windows: &'a Windows,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.is_live_device(agent_id, windows)
    }
    fn get<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<proto_schemas::registry::AgentRecord>, StoreError>> {
        self.inner.get(agent_id)
    }
    fn get_many<'a>(
        &'a self,
        agent_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<proto_schemas::registry::AgentRecord>, StoreError>> {
        self.inner.get_many(agent_ids)
    }
    fn lookup<'a>(
        &'a self,
        query: &'a store::LookupQuery,
    ) -> BoxFuture<'a, Result<Vec<proto_schemas::registry::AgentRecord>, StoreError>> {
        self.inner.lookup(query)
    }
    fn list<'a>(
        &'a self,
        filter: &'a store::AgentFilter,
    ) -> BoxFuture<'a, Result<Vec<proto_schemas::registry::AgentRecord>, StoreError>> {
        self.inner.list(filter)
    }
    fn online_ids(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        self.inner.online_ids()
    }
    fn apply_presence<'a>(
        &'a self,
        flush: &'a store::PresenceFlush,
    ) -> BoxFuture<'a, Result<store::PresenceApplied, StoreError>> {
        self.inner.apply_presence(flush)
    }
    fn reap<'a>(
        &'a self,
        windows: &'a Windows,
        forget_gateways_after: Duration,
    ) -> BoxFuture<'a, Result<Vec<store::Ended>, StoreError>> {
        self.inner.reap(windows, forget_gateways_after)
    }
    fn forget_offline(
        &self,
        unseen_for: Duration,
        limit: u32,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.inner.forget_offline(unseen_for, limit)
    }
    fn end_gateway<'a>(
        &'a self,
        gateway_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<store::Ended>, StoreError>> {
        self.inner.end_gateway(gateway_id)
    }
    fn register_addressed<'a>(
        &'a self,
        registration: &'a proto_schemas::registry::AgentRegistration,
        registered_by: &'a str,
    ) -> BoxFuture<'a, Result<Option<proto_schemas::registry::AddressedAgent>, StoreError>> {
        self.inner.register_addressed(registration, registered_by)
    }
    fn find_addressed<'a>(
        &'a self,
        capabilities: &'a [String],
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<proto_schemas::registry::AddressedAgent>, StoreError>> {
        self.inner.find_addressed(capabilities, limit)
    }
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.ping()
    }
}

/// A migrated database of `backend`, a gated store over it and a write queue on that store.
struct Harness {
    store: Arc<GatedStore>,
    queue: WriteQueue,
    db: Database,
    test_db: TestDatabase,
}

impl Harness {
    async fn start(backend: Backend) -> Harness {
        let test_db = test_database(backend)
            .await
            .expect("PostgreSQL must be running (DATABASE_URL)");
        let db = test_db.connect().await.expect("test database connects");
        db.migrate().await.expect("migrated");
        let store = Arc::new(GatedStore {
            inner: store::for_database(&db),
            gate: Semaphore::new(0),
            batches: Mutex::new(Vec::new()),
        });
        let queue = WriteQueue::start(store.clone(), WINDOWS, &admit);
        Harness {
            store,
            queue,
            db,
            test_db,
        }
    }

    /// Sends `first` and waits until its batch is being written (and held at the gate).
    async fn hold_first(&self, first: RegisterAgent) -> JoinHandle<RegisterOutcome> {
        let queue = self.queue.clone();
        let first =
            tokio::spawn(async move { queue.register(first).await.expect("first registration") });
        wait_until("the first batch reaches the store", || async {
            self.store.sizes() == [1]
        })
        .await;
        first
    }

    /// Waits until the store holds its first batch and `n` more writes are queued.
    async fn until_queued(&self, n: usize) {
        eventually(
            &format!("{n} writes queued behind the held batch"),
            || async { (self.store.sizes() == [1] && self.queue.queued() == n).then_some(()) },
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}; batches {:?}, queued {}",
                self.store.batches(),
                self.queue.queued()
            )
        });
    }

    async fn stop(self) {
        drop(self.queue);
        self.db.close().await;
        self.test_db.cleanup().await;
    }
}

fn device(agent_id: &str, connection_id: &str, principal: &str) -> RegisterAgent {
    RegisterAgent {
        capabilities: vec!["echo".to_owned()],
        system_info: Some(json!({"device_id": agent_id, "cpu_count": 2})),
        ..RegisterAgent::device(agent_id, "gw-1", connection_id, principal, Platform::Linux)
    }
}

/// What a spawned write returned, within [`WAIT`].
async fn joined<T>(what: &str, write: JoinHandle<T>) -> T {
    within(WAIT, what, write)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// What every spawned write returned, within [`WAIT`] in all.
async fn all_joined<T>(what: &str, writes: Vec<JoinHandle<T>>) -> Vec<T> {
    within(WAIT, what, future::join_all(writes))
        .await
        .into_iter()
        .map(|joined| joined.unwrap_or_else(|e| panic!("{what}: {e}")))
        .collect()
}

fn registered(outcome: RegisterOutcome) -> Option<String> {
    match outcome {
        RegisterOutcome::Registered(r) => r.replaced_connection,
        RegisterOutcome::Refused(refusal) => panic!("refused: {refusal:?}"),
    }
}

async fn queued_registrations_share_one_transaction_and_all_are_committed(backend: Backend) {
    let h = Harness::start(backend).await;
    let first = h.hold_first(device("first", "c-first", "lab")).await;
    let sends: Vec<_> = (0..20)
        .map(|i| {
            let queue = h.queue.clone();
            tokio::spawn(async move {
                queue
                    .register(device(&format!("pc-{i}"), &format!("c-{i}"), "lab"))
                    .await
            })
        })
        .collect();
    h.until_queued(20).await;
    h.store.open_gate();
    assert_eq!(registered(joined("the first write", first).await), None);
    for outcome in all_joined("the queued writes", sends).await {
        let outcome = outcome.expect("written");
        assert_eq!(registered(outcome), None);
    }
    assert_eq!(
        h.store.sizes(),
        [1, 20],
        "one transaction for the 20 queued"
    );
    for i in 0..20 {
        let agent = h
            .store
            .get(&format!("pc-{i}"))
            .await
            .expect("read")
            .expect("committed");
        assert_eq!(agent.connection_id, format!("c-{i}"));
        assert_eq!(agent.status, AgentStatus::Available);
        assert_eq!(
            agent.system_info,
            Some(json!({"device_id": format!("pc-{i}"), "cpu_count": 2}))
        );
    }
    h.stop().await;
}

async fn one_agent_twice_is_written_in_two_batches_in_order(backend: Backend) {
    let h = Harness::start(backend).await;
    let first = h.hold_first(device("held", "c-held", "anonymous")).await;
    // Queued while the first batch is held: the registration of a new id twice (anonymous,
    // so the second is a live duplicate), and the end of `held` with its re-registration on
    // another connection.
    let queue = h.queue.clone();
    let twice_1 =
        tokio::spawn(async move { queue.register(device("twice", "c1", "anonymous")).await });
    h.until_queued(1).await;
    let queue = h.queue.clone();
    let twice_2 =
        tokio::spawn(async move { queue.register(device("twice", "c2", "anonymous")).await });
    h.until_queued(2).await;
    let queue = h.queue.clone();
    let gone = tokio::spawn(async move {
        queue
            .unregister(Unregister {
                agent_id: "held".to_owned(),
                connection_id: "c-held".to_owned(),
            })
            .await
    });
    h.until_queued(3).await;
    let queue = h.queue.clone();
    let back =
        tokio::spawn(async move { queue.register(device("held", "c-back", "anonymous")).await });
    h.until_queued(4).await;
    h.store.open_gate();

    assert_eq!(registered(joined("the first write", first).await), None);
    assert_eq!(
        registered(joined("twice, first", twice_1).await.expect("written")),
        None
    );
    match joined("twice, second", twice_2).await.expect("written") {
        RegisterOutcome::Refused(refusal) => {
            assert_eq!(refusal.error_code, ErrorCode::RegistrationFailed);
            assert_eq!(
                refusal.detail,
                "client_id 'twice' is already registered; duplicate registrations are not allowed"
            );
        }
        other => panic!("a live anonymous id was registered twice: {other:?}"),
    }
    assert!(
        joined("the unregistration", gone).await.expect("written"),
        "went offline"
    );
    // The same id again waited for the next batch, where its holder had already gone.
    assert_eq!(
        registered(joined("held, again", back).await.expect("written")),
        None
    );
    assert_eq!(
        h.store.batches(),
        [vec!["held"], vec!["held", "twice"], vec!["twice", "held"]],
        "unregistrations first in a batch; the second write of an agent in the next batch"
    );
    let twice = h.store.get("twice").await.expect("read").expect("stored");
    assert_eq!(twice.connection_id, "c1");
    let held = h.store.get("held").await.expect("read").expect("stored");
    assert_eq!(held.connection_id, "c-back");
    assert_eq!(held.status, AgentStatus::Available);
    h.stop().await;
}

async fn a_write_the_database_refuses_fails_alone(backend: Backend) {
    let h = Harness::start(backend).await;
    let first = h.hold_first(device("first", "c-first", "lab")).await;
    let mut bad = device("bad", "c-bad", "lab");
    // PostgreSQL's jsonb cannot hold U+0000; SQLite stores it.
    bad.system_info = Some(json!({"name": "nul \u{0} inside"}));
    let mut requests: Vec<RegisterAgent> = (0..5)
        .map(|i| device(&format!("ok-{i}"), &format!("c-{i}"), "lab"))
        .collect();
    requests.insert(2, bad);
    let sends: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let queue = h.queue.clone();
            tokio::spawn(async move { queue.register(r).await })
        })
        .collect();
    h.until_queued(6).await;
    h.store.open_gate();
    registered(joined("the first write", first).await);
    let outcomes = all_joined("the queued writes", sends).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        match (i, backend, outcome) {
            (2, Backend::NatsPostgres, Err(e)) => {
                assert!(!e.is_unavailable(), "{e}");
            }
            (_, _, Ok(RegisterOutcome::Registered(_))) => {}
            (i, backend, other) => panic!("write {i} on {backend:?}: {other:?}"),
        }
    }
    for i in 0..5 {
        assert!(
            h.store
                .get(&format!("ok-{i}"))
                .await
                .expect("read")
                .is_some(),
            "ok-{i} committed"
        );
    }
    let batches = h.store.sizes();
    match backend {
        // The batch of six failed, then each write was written alone.
        Backend::NatsPostgres => assert_eq!(batches, [1, 6, 1, 1, 1, 1, 1, 1]),
        Backend::LocalSqlite => assert_eq!(batches, [1, 6]),
    }
    h.stop().await;
}

async fn two_replicas_registering_the_same_new_ids_admit_one_each(backend: Backend) {
    let h = Harness::start(backend).await;
    h.store.open_gate();
    // A second replica: its own store and queue over the same database.
    let other = WriteQueue::start(store::for_database(&h.db), WINDOWS, &admit);
    let ids: Vec<String> = (0..40).map(|i| format!("contested-{i}")).collect();
    let register = |queue: &WriteQueue, id: &str, connection: &str| {
        let queue = queue.clone();
        let request = device(id, connection, "anonymous");
        tokio::spawn(async move { queue.register(request).await })
    };
    let mut sends = Vec::new();
    for id in &ids {
        sends.push((
            id.clone(),
            register(&h.queue, id, "c-one"),
            register(&other, id, "c-two"),
        ));
    }
    for (id, one, two) in sends {
        let one = joined(&id, one).await.expect("written");
        let two = joined(&id, two).await.expect("written");
        let winner = match (&one, &two) {
            (RegisterOutcome::Registered(_), RegisterOutcome::Refused(refusal))
            | (RegisterOutcome::Refused(refusal), RegisterOutcome::Registered(_)) => {
                assert_eq!(refusal.error_code, ErrorCode::RegistrationFailed, "{id}");
                if matches!(one, RegisterOutcome::Registered(_)) {
                    "c-one"
                } else {
                    "c-two"
                }
            }
            other => panic!("{id}: one registration must win, the other be refused: {other:?}"),
        };
        let stored = h.store.get(&id).await.expect("read").expect("stored");
        assert_eq!(stored.connection_id, winner, "{id}: the winner is stored");
    }
    h.stop().await;
}

both_backends!(
    queued_registrations_share_one_transaction_and_all_are_committed,
    two_replicas_registering_the_same_new_ids_admit_one_each,
    one_agent_twice_is_written_in_two_batches_in_order,
    a_write_the_database_refuses_fails_alone,
);
