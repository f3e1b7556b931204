//! The registry store ([`aip_registry::store`]) against real databases: every function of
//! [`AgentStore`], on PostgreSQL (`DATABASE_URL`) and on SQLite, with rows that are found and
//! not found, filtered, limited and expired. Rows are aged by writing their times directly,
//! so nothing waits on the clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_registry::store::{
    self, Admit, AgentFilter, AgentStore, BatchOutcome, Ended, Holder, LookupQuery,
    PresenceApplied, PresenceFlush, RegisterOutcome, StoreError, Unregister, Windows, WriteBatch,
};
use aip_store::testing::TestDatabase;
use aip_store::{Backend, Database, Sql, Timestamp};
use chrono::Utc;
use proto_schemas::registry::{AgentRecord, AgentStatus, RegisterAgent};
use proto_schemas::{ClientType, ErrorBody, ErrorCode, Extension, McpToolInfo, Platform};
use serde_json::json;

macro_rules! both_databases {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn postgres() {
                super::$name(super::Backend::Postgres).await
            }

            #[tokio::test]
            async fn sqlite() {
                super::$name(super::Backend::Sqlite).await
            }
        }
    )*};
}

both_databases!(
    a_presence_write_that_fails_is_kept_and_marked_so_the_reaper_waits,
    registrations_are_stored_and_read_back,
    the_same_connection_keeps_its_state_and_another_takes_over,
    refused_and_failed_registrations_write_nothing,
    unregistrations_take_only_their_connection_offline,
    a_batch_answers_each_write_in_order,
    a_batch_written_again_leaves_its_agents_as_the_first_write_did,
    live_devices_are_told_from_the_rest,
    lookup_offers_live_available_agents_least_loaded_first,
    list_filters_by_status_type_and_capabilities,
    online_ids_are_the_agents_not_offline,
    presence_refreshes_revives_and_stops,
    one_flush_refreshes_a_whole_burst_of_connections,
    reaping_expires_silent_agents_and_forgets_dead_gateways,
    long_offline_agents_are_deleted_a_bounded_number_at_a_time,
    a_restarted_gateway_ends_the_connections_it_held,
    unreadable_rows_are_reported_as_corrupt,
    ping_answers,
);

/// Wide enough that nothing written by a test expires unless the test ages it.
const WINDOWS: Windows = Windows {
    gateway: Duration::from_secs(60),
    agent: Duration::from_secs(60),
};

/// Older than [`WINDOWS`].
const LONG_AGO: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

/// A migrated throwaway database and the store on it.
struct Fixture {
    test_db: TestDatabase,
    db: Database,
    store: Arc<dyn AgentStore>,
}

impl Fixture {
    async fn open(backend: Backend) -> Fixture {
        let test_db = match backend {
            Backend::Postgres => TestDatabase::postgres()
                .await
                .expect("PostgreSQL must be running (DATABASE_URL)"),
            Backend::Sqlite => TestDatabase::sqlite().expect("temporary SQLite file"),
        };
        let db = test_db.connect().await.expect("connect");
        db.migrate().await.expect("migrate");
        let store = store::for_database(&db);
        Fixture { test_db, db, store }
    }

    async fn close(self) {
        self.db.close().await;
        self.test_db.cleanup().await;
    }

    async fn write(&self, batch: WriteBatch, admit: &Admit) -> BatchOutcome {
        self.store
            .write_batch(&batch, &WINDOWS, admit)
            .await
            .expect("the batch commits")
    }

    /// Registers with the registry's own rule and expects it written.
    async fn register(&self, request: RegisterAgent) -> AgentRecord {
        let batch = WriteBatch {
            registers: vec![request],
            ..WriteBatch::default()
        };
        match self
            .write(batch, &aip_registry::registry::admit)
            .await
            .registered
            .remove(0)
        {
            Ok(RegisterOutcome::Registered(r)) => r.agent,
            other => panic!("not registered: {other:?}"),
        }
    }

    async fn unregister(&self, agent_id: &str, connection_id: &str) -> bool {
        let batch = WriteBatch {
            unregisters: vec![Unregister {
                agent_id: agent_id.to_owned(),
                connection_id: connection_id.to_owned(),
            }],
            ..WriteBatch::default()
        };
        self.write(batch, &aip_registry::registry::admit)
            .await
            .unregistered
            .remove(0)
            .expect("unregistered")
    }

    async fn get(&self, agent_id: &str) -> AgentRecord {
        self.store
            .get(agent_id)
            .await
            .expect("read")
            .unwrap_or_else(|| panic!("{agent_id} is stored"))
    }

    async fn lookup(
        &self,
        capabilities: &[&str],
        client_type: ClientType,
        limit: u32,
    ) -> Vec<String> {
        let query = LookupQuery {
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            client_type,
            limit,
            windows: WINDOWS,
        };
        ids(self.store.lookup(&query).await.expect("lookup"))
    }

    async fn list(&self, filter: AgentFilter) -> Vec<String> {
        ids(self.store.list(&filter).await.expect("list"))
    }

    async fn live(&self, agent_id: &str) -> bool {
        self.store
            .is_live_device(agent_id, &WINDOWS)
            .await
            .expect("is_live_device")
    }

    async fn presence(&self, flush: PresenceFlush) -> PresenceApplied {
        self.store.apply_presence(&flush).await.expect("presence")
    }

    /// Runs one statement written for both databases.
    async fn exec(&self, sql: &'static str, text: &str, id: &str) {
        let changed = self
            .db
            .query(&Sql::same(sql))
            .bind(text)
            .bind(id)
            .execute()
            .await
            .expect("statement");
        assert_eq!(changed, 1, "{sql} changes {id}");
    }

    async fn set_status(&self, agent_id: &str, status: AgentStatus) {
        self.exec(
            "UPDATE agents SET status = $1 WHERE agent_id = $2",
            status.as_str(),
            agent_id,
        )
        .await;
    }

    async fn set_load(&self, agent_id: &str, load: i32) {
        let changed = self
            .db
            .query(&Sql::same(
                "UPDATE agents SET load = $1 WHERE agent_id = $2",
            ))
            .bind(load)
            .bind(agent_id)
            .execute()
            .await
            .expect("set load");
        assert_eq!(changed, 1);
    }

    async fn set_last_seen(&self, agent_id: &str, at: chrono::DateTime<Utc>) {
        let changed = self
            .db
            .query(&Sql::same(
                "UPDATE agents SET last_seen = $1 WHERE agent_id = $2",
            ))
            .bind(Timestamp(at))
            .bind(agent_id)
            .execute()
            .await
            .expect("set last_seen");
        assert_eq!(changed, 1);
    }

    async fn age_gateway(&self, gateway_id: &str) {
        let changed = self
            .db
            .query(&Sql::same(
                "UPDATE gateways SET last_seen = $1 WHERE gateway_id = $2",
            ))
            .bind(Timestamp(Utc::now() - LONG_AGO))
            .bind(gateway_id)
            .execute()
            .await
            .expect("age gateway");
        assert_eq!(changed, 1);
    }

    async fn offline_reason(&self, agent_id: &str) -> Option<String> {
        let (reason,): (Option<String>,) = self
            .db
            .query(&Sql::same(
                "SELECT offline_reason FROM agents WHERE agent_id = $1",
            ))
            .bind(agent_id)
            .fetch_one()
            .await
            .expect("offline_reason");
        reason
    }

    /// The gateway's row, if it is known: when it was last seen and its interval.
    async fn gateway(&self, gateway_id: &str) -> Option<(Timestamp, i64)> {
        self.db
            .query(&Sql::same(
                "SELECT last_seen, interval_ms FROM gateways WHERE gateway_id = $1",
            ))
            .bind(gateway_id)
            .fetch_optional()
            .await
            .expect("gateway")
    }
}

fn ids(agents: Vec<AgentRecord>) -> Vec<String> {
    agents.into_iter().map(|a| a.agent_id).collect()
}

fn device(agent_id: &str, gateway_id: &str, connection_id: &str, principal: &str) -> RegisterAgent {
    RegisterAgent::device(
        agent_id,
        gateway_id,
        connection_id,
        principal,
        Platform::Linux,
    )
}

fn with_capabilities(mut request: RegisterAgent, capabilities: &[&str]) -> RegisterAgent {
    request.capabilities = capabilities.iter().map(|c| c.to_string()).collect();
    request
}

fn constellation(agent_id: &str, target: &str) -> RegisterAgent {
    RegisterAgent {
        client_type: ClientType::Constellation,
        target_id: Some(target.to_owned()),
        ..device(agent_id, "gw-1", &format!("conn-{agent_id}"), "lab")
    }
}

fn all() -> AgentFilter {
    AgentFilter {
        limit: 100,
        ..AgentFilter::default()
    }
}

async fn registrations_are_stored_and_read_back(backend: Backend) {
    let f = Fixture::open(backend).await;
    assert!(
        f.store.get("pc").await.expect("read").is_none(),
        "not found"
    );
    assert!(f.gateway("gw-1").await.is_none());

    let tool: McpToolInfo = serde_json::from_value(json!({
        "tool_key": "action::click", "tool_name": "click", "namespace": "ui",
        "tool_type": "action", "input_schema": {"type": "object"}
    }))
    .expect("tool");
    let request = RegisterAgent {
        platform: Platform::Windows,
        capabilities: vec!["ocr".to_owned(), "excel".to_owned()],
        tools: vec![tool],
        system_info: Some(json!({"cpu_count": 8, "os": "Windows 11"})),
        metadata: Some(json!({"system_info": {"cpu_count": 8}, "extra": [1, 2]})),
        extensions: vec![Extension::Progress, Extension::Handoff],
        ..device("pc", "gw-1", "c1", "alice")
    };
    let written = f.register(request.clone()).await;
    assert_eq!(written.agent_id, "pc");
    assert_eq!(written.client_type, ClientType::Device);
    assert_eq!(written.platform, Platform::Windows);
    assert_eq!(written.status, AgentStatus::Available);
    assert_eq!(written.capabilities, request.capabilities);
    assert_eq!(written.tools, request.tools);
    assert_eq!(written.system_info, request.system_info);
    assert_eq!(written.metadata, request.metadata);
    assert_eq!(written.extensions, request.extensions);
    assert_eq!(written.target_id, None);
    assert_eq!(written.gateway_id, "gw-1");
    assert_eq!(written.connection_id, "c1");
    assert_eq!(written.load, 0);
    assert_eq!(written.connected_at, written.last_seen);
    let age = Utc::now() - written.last_seen;
    assert!(
        age.abs() < chrono::TimeDelta::seconds(5),
        "seen now ({age})"
    );
    assert_eq!(f.get("pc").await, written, "read back as written");

    let (gateway_seen, interval) = f.gateway("gw-1").await.expect("the gateway is recorded");
    assert!((Utc::now() - gateway_seen.0).abs() < chrono::TimeDelta::seconds(5));
    assert_eq!(interval, 0, "no presence report yet");

    let target = f.register(constellation("galaxy", "pc")).await;
    assert_eq!(target.client_type, ClientType::Constellation);
    assert_eq!(target.target_id.as_deref(), Some("pc"));
    f.close().await;
}

async fn the_same_connection_keeps_its_state_and_another_takes_over(backend: Backend) {
    let f = Fixture::open(backend).await;
    let first = f.register(device("pc", "gw-1", "c1", "alice")).await;
    f.set_status("pc", AgentStatus::Busy).await;
    f.set_load("pc", 2).await;
    f.set_last_seen("pc", Utc::now() - chrono::TimeDelta::seconds(30))
        .await;

    // The holders the registrations were judged against.
    let seen: Arc<Mutex<Vec<Option<Holder>>>> = Arc::default();
    let last_holder = |seen: &Mutex<Vec<Option<Holder>>>| {
        seen.lock()
            .expect("lock")
            .pop()
            .flatten()
            .expect("a holder")
    };
    let admit_and_record = {
        let seen = seen.clone();
        move |request: &RegisterAgent, holder: Option<&Holder>| {
            seen.lock().expect("lock").push(holder.cloned());
            aip_registry::registry::admit(request, holder)
        }
    };
    let again = WriteBatch {
        registers: vec![with_capabilities(
            device("pc", "gw-2", "c1", "alice"),
            &["new"],
        )],
        ..WriteBatch::default()
    };
    let outcome = f.write(again, &admit_and_record).await;
    let Ok(RegisterOutcome::Registered(again)) = &outcome.registered[0] else {
        panic!("registered again: {outcome:?}");
    };
    assert_eq!(again.replaced_connection, None);
    assert_eq!(again.agent.status, AgentStatus::Busy, "busy is kept");
    assert_eq!(again.agent.load, 2, "load is kept");
    assert_eq!(
        again.agent.connected_at, first.connected_at,
        "same connection"
    );
    assert!(again.agent.last_seen > first.last_seen - chrono::TimeDelta::seconds(1));
    assert_eq!(again.agent.capabilities, ["new"]);
    assert_eq!(again.agent.gateway_id, "gw-2");
    let holder = last_holder(&seen);
    assert_eq!(
        holder,
        Holder {
            connection_id: "c1".to_owned(),
            gateway_id: "gw-1".to_owned(),
            principal: "alice".to_owned(),
            status: AgentStatus::Busy,
            live: true,
        }
    );

    // Another connection of the same principal takes the live id over, from fresh.
    let takeover = WriteBatch {
        registers: vec![device("pc", "gw-2", "c2", "alice")],
        ..WriteBatch::default()
    };
    let outcome = f.write(takeover, &admit_and_record).await;
    let Ok(RegisterOutcome::Registered(taken)) = &outcome.registered[0] else {
        panic!("taken over: {outcome:?}");
    };
    assert_eq!(taken.replaced_connection.as_deref(), Some("c1"));
    assert_eq!(taken.agent.connection_id, "c2");
    assert_eq!(taken.agent.status, AgentStatus::Available);
    assert_eq!(taken.agent.load, 0);
    assert!(taken.agent.connected_at >= first.connected_at);
    assert_eq!(f.get("pc").await, taken.agent);

    // An expired holder is judged not live: its gateway went silent.
    f.age_gateway("gw-2").await;
    let late = WriteBatch {
        registers: vec![device("pc", "gw-3", "c3", "bob")],
        ..WriteBatch::default()
    };
    let outcome = f.write(late, &admit_and_record).await;
    assert!(
        matches!(&outcome.registered[0], Ok(RegisterOutcome::Registered(r)) if r.replaced_connection.as_deref() == Some("c2")),
        "{outcome:?}"
    );
    let holder = last_holder(&seen);
    assert!(!holder.live, "a holder on a silent gateway is not live");
    f.close().await;
}

async fn refused_and_failed_registrations_write_nothing(backend: Backend) {
    let f = Fixture::open(backend).await;
    let first = f.register(device("pc", "gw-1", "c1", "alice")).await;
    let refuse =
        |request: &RegisterAgent, _: Option<&Holder>| -> Result<Option<String>, ErrorBody> {
            Err(aip_registry::registry::duplicate(&request.agent_id))
        };
    let batch = WriteBatch {
        registers: vec![
            device("pc", "gw-1", "c2", "bob"),
            device("new", "gw-1", "c3", "bob"),
        ],
        ..WriteBatch::default()
    };
    let outcome = f.write(batch, &refuse).await;
    for result in &outcome.registered {
        let Ok(RegisterOutcome::Refused(refusal)) = result else {
            panic!("refused: {result:?}");
        };
        assert_eq!(refusal.error_code, ErrorCode::RegistrationFailed);
    }
    assert_eq!(f.get("pc").await, first, "unchanged");
    assert!(
        f.store.get("new").await.expect("read").is_none(),
        "not created"
    );

    // The registry's own rule: another principal cannot take a live id.
    let batch = WriteBatch {
        registers: vec![device("pc", "gw-1", "c2", "bob")],
        ..WriteBatch::default()
    };
    let outcome = f.write(batch, &aip_registry::registry::admit).await;
    assert!(
        matches!(&outcome.registered[0], Ok(RegisterOutcome::Refused(_))),
        "{outcome:?}"
    );
    assert_eq!(f.get("pc").await, first, "unchanged");
    f.close().await;
}

async fn unregistrations_take_only_their_connection_offline(backend: Backend) {
    let f = Fixture::open(backend).await;
    f.register(device("pc", "gw-1", "c1", "alice")).await;
    assert!(!f.unregister("nobody", "c1").await, "unknown id");
    assert!(!f.unregister("pc", "c-other").await, "another connection");
    assert_eq!(f.get("pc").await.status, AgentStatus::Available);
    assert_eq!(f.offline_reason("pc").await, None);

    assert!(f.unregister("pc", "c1").await, "went offline");
    assert_eq!(f.get("pc").await.status, AgentStatus::Offline);
    assert_eq!(
        f.offline_reason("pc").await.as_deref(),
        Some("unregistered")
    );
    assert!(!f.unregister("pc", "c1").await, "offline already");

    // An expired agent unregistered is final: its reason becomes `unregistered`.
    f.register(device("old", "gw-1", "c2", "alice")).await;
    f.set_last_seen("old", Utc::now() - LONG_AGO).await;
    assert_eq!(
        ended_ids(
            f.store
                .reap(&WINDOWS, Duration::from_secs(3600))
                .await
                .expect("reap")
        ),
        ["old"]
    );
    assert!(!f.unregister("old", "c2").await, "offline already");
    assert_eq!(
        f.offline_reason("old").await.as_deref(),
        Some("unregistered")
    );
    f.close().await;
}

async fn a_batch_answers_each_write_in_order(backend: Backend) {
    let f = Fixture::open(backend).await;
    f.register(device("leaving", "gw-1", "c1", "alice")).await;
    f.register(device("held", "gw-1", "c2", "alice")).await;
    f.register(device("again", "gw-1", "c3", "alice")).await;
    let batch = WriteBatch {
        unregisters: vec![
            Unregister {
                agent_id: "leaving".to_owned(),
                connection_id: "c1".to_owned(),
            },
            Unregister {
                agent_id: "ghost".to_owned(),
                connection_id: "c9".to_owned(),
            },
        ],
        registers: vec![
            device("fresh-b", "gw-2", "c4", "bob"),
            device("held", "gw-2", "c5", "bob"),
            device("again", "gw-1", "c3", "alice"),
            device("fresh-a", "gw-2", "c6", "bob"),
        ],
    };
    let outcome = f.write(batch, &aip_registry::registry::admit).await;
    let unregistered: Vec<bool> = outcome
        .unregistered
        .into_iter()
        .map(|r| r.expect("unregistered"))
        .collect();
    assert_eq!(unregistered, [true, false]);
    let registered: Vec<&str> = outcome
        .registered
        .iter()
        .map(|r| match r {
            Ok(RegisterOutcome::Registered(r)) => r.agent.agent_id.as_str(),
            Ok(RegisterOutcome::Refused(_)) => "refused",
            Err(e) => panic!("failed: {e}"),
        })
        .collect();
    assert_eq!(registered, ["fresh-b", "refused", "again", "fresh-a"]);
    assert_eq!(f.get("leaving").await.status, AgentStatus::Offline);
    assert_eq!(f.get("held").await.connection_id, "c2");
    assert_eq!(f.get("fresh-a").await.gateway_id, "gw-2");
    assert!(
        f.gateway("gw-2").await.is_some(),
        "the new gateway is recorded"
    );
    let empty = f
        .write(WriteBatch::default(), &aip_registry::registry::admit)
        .await;
    assert!(empty.registered.is_empty() && empty.unregistered.is_empty());
    f.close().await;
}

/// A batch whose answer was lost is written again whole (the group commit does so when a
/// PostgreSQL batch's second part fails after its first committed): each registration is
/// still its connection's, each unregistered agent still offline, and nothing is refused.
async fn a_batch_written_again_leaves_its_agents_as_the_first_write_did(backend: Backend) {
    let f = Fixture::open(backend).await;
    f.register(device("leaving", "gw-1", "c1", "anonymous"))
        .await;
    f.register(device("again", "gw-1", "c2", "alice")).await;
    let batch = WriteBatch {
        unregisters: vec![Unregister {
            agent_id: "leaving".to_owned(),
            connection_id: "c1".to_owned(),
        }],
        registers: vec![
            device("fresh", "gw-1", "c3", "anonymous"),
            device("again", "gw-1", "c4", "alice"),
        ],
    };
    let first = f.write(batch.clone(), &aip_registry::registry::admit).await;
    let second = f.write(batch, &aip_registry::registry::admit).await;
    let went_offline = |outcome: &BatchOutcome| -> Vec<bool> {
        outcome
            .unregistered
            .iter()
            .map(|r| *r.as_ref().expect("unregistered"))
            .collect()
    };
    assert_eq!(went_offline(&first), [true]);
    assert_eq!(went_offline(&second), [false], "offline already");
    for outcome in [&first, &second] {
        let holders: Vec<&str> = outcome
            .registered
            .iter()
            .map(|r| match r {
                Ok(RegisterOutcome::Registered(r)) => r.agent.connection_id.as_str(),
                other => panic!("registered: {other:?}"),
            })
            .collect();
        assert_eq!(holders, ["c3", "c4"]);
    }
    assert_eq!(f.get("leaving").await.status, AgentStatus::Offline);
    assert_eq!(f.get("fresh").await.connection_id, "c3");
    assert_eq!(f.get("again").await.connection_id, "c4");
    f.close().await;
}

async fn live_devices_are_told_from_the_rest(backend: Backend) {
    let f = Fixture::open(backend).await;
    assert!(!f.live("nobody").await, "unknown");
    f.register(device("pc", "gw-1", "c1", "lab")).await;
    assert!(f.live("pc").await);
    f.register(constellation("galaxy", "pc")).await;
    assert!(!f.live("galaxy").await, "a constellation is no device");

    f.register(device("busy", "gw-1", "c2", "lab")).await;
    f.set_status("busy", AgentStatus::Busy).await;
    assert!(f.live("busy").await, "busy is live");

    f.register(device("silent", "gw-1", "c3", "lab")).await;
    f.set_last_seen("silent", Utc::now() - LONG_AGO).await;
    assert!(!f.live("silent").await, "seen too long ago");

    f.register(device("gone", "gw-1", "c4", "lab")).await;
    f.unregister("gone", "c4").await;
    assert!(!f.live("gone").await, "offline");

    f.register(device("cut-off", "gw-dead", "c5", "lab")).await;
    assert!(f.live("cut-off").await);
    f.age_gateway("gw-dead").await;
    assert!(!f.live("cut-off").await, "its gateway went silent");
    f.close().await;
}

async fn lookup_offers_live_available_agents_least_loaded_first(backend: Backend) {
    let f = Fixture::open(backend).await;
    let now = Utc::now();
    for (id, gateway, capabilities) in [
        ("idle-new", "gw-1", &["ocr", "excel"][..]),
        ("idle-old", "gw-1", &["ocr"][..]),
        ("loaded", "gw-1", &["ocr"][..]),
        ("busy", "gw-1", &["ocr"][..]),
        ("stale", "gw-1", &["ocr"][..]),
        ("cut-off", "gw-dead", &["ocr"][..]),
        ("gone", "gw-1", &["ocr"][..]),
        ("other", "gw-1", &["excel"][..]),
    ] {
        f.register(with_capabilities(
            device(id, gateway, &format!("c-{id}"), "lab"),
            capabilities,
        ))
        .await;
    }
    f.register(constellation("galaxy", "idle-new")).await;
    f.set_last_seen("idle-new", now - chrono::TimeDelta::seconds(1))
        .await;
    f.set_last_seen("idle-old", now - chrono::TimeDelta::seconds(5))
        .await;
    f.set_last_seen("other", now - chrono::TimeDelta::seconds(5))
        .await;
    f.set_load("loaded", 3).await;
    f.set_status("busy", AgentStatus::Busy).await;
    f.set_last_seen("stale", now - LONG_AGO).await;
    f.age_gateway("gw-dead").await;
    f.unregister("gone", "c-gone").await;

    assert_eq!(
        f.lookup(&["ocr"], ClientType::Device, 10).await,
        ["idle-new", "idle-old", "loaded"]
    );
    assert_eq!(
        f.lookup(&["ocr"], ClientType::Device, 2).await,
        ["idle-new", "idle-old"],
        "limited"
    );
    assert_eq!(
        f.lookup(&["ocr", "excel"], ClientType::Device, 10).await,
        ["idle-new"]
    );
    assert_eq!(
        f.lookup(&[], ClientType::Device, 10).await,
        ["idle-new", "idle-old", "other", "loaded"],
        "least loaded, then most recently seen, then by id"
    );
    assert!(f.lookup(&["gpu"], ClientType::Device, 10).await.is_empty());
    assert_eq!(
        f.lookup(&[], ClientType::Constellation, 10).await,
        ["galaxy"]
    );
    f.close().await;
}

async fn list_filters_by_status_type_and_capabilities(backend: Backend) {
    let f = Fixture::open(backend).await;
    assert!(f.list(all()).await.is_empty(), "empty table");
    f.register(with_capabilities(
        device("d-1", "gw-1", "c1", "lab"),
        &["ocr"],
    ))
    .await;
    f.register(with_capabilities(
        device("d-2", "gw-1", "c2", "lab"),
        &["ocr", "excel"],
    ))
    .await;
    f.register(device("d-3", "gw-1", "c3", "lab")).await;
    f.register(constellation("c-1", "d-1")).await;
    f.set_status("d-2", AgentStatus::Busy).await;
    f.unregister("d-3", "c3").await;
    // Stored status, not liveness: a silent agent is listed as it is stored.
    f.set_last_seen("d-1", Utc::now() - LONG_AGO).await;

    assert_eq!(f.list(all()).await, ["c-1", "d-1", "d-2", "d-3"], "by id");
    let status = |status| AgentFilter {
        status: Some(status),
        ..all()
    };
    assert_eq!(f.list(status(AgentStatus::Available)).await, ["c-1", "d-1"]);
    assert_eq!(f.list(status(AgentStatus::Busy)).await, ["d-2"]);
    assert_eq!(f.list(status(AgentStatus::Offline)).await, ["d-3"]);
    let devices = AgentFilter {
        client_type: Some(ClientType::Device),
        ..all()
    };
    assert_eq!(f.list(devices.clone()).await, ["d-1", "d-2", "d-3"]);
    let ocr = AgentFilter {
        capabilities: vec!["ocr".to_owned()],
        ..devices.clone()
    };
    assert_eq!(f.list(ocr.clone()).await, ["d-1", "d-2"]);
    let both = AgentFilter {
        capabilities: vec!["excel".to_owned(), "ocr".to_owned()],
        ..devices.clone()
    };
    assert_eq!(f.list(both).await, ["d-2"]);
    let available_ocr = AgentFilter {
        status: Some(AgentStatus::Available),
        ..ocr.clone()
    };
    assert_eq!(f.list(available_ocr).await, ["d-1"]);
    assert_eq!(
        f.list(AgentFilter { limit: 2, ..all() }).await,
        ["c-1", "d-1"]
    );
    assert!(f.list(AgentFilter { limit: 0, ..all() }).await.is_empty());
    let none = AgentFilter {
        capabilities: vec!["gpu".to_owned()],
        ..all()
    };
    assert!(f.list(none).await.is_empty());
    f.close().await;
}

async fn online_ids_are_the_agents_not_offline(backend: Backend) {
    let f = Fixture::open(backend).await;
    assert!(f.store.online_ids().await.expect("ids").is_empty());
    f.register(device("b", "gw-1", "c1", "lab")).await;
    f.register(device("a", "gw-1", "c2", "lab")).await;
    f.register(device("c", "gw-1", "c3", "lab")).await;
    f.register(constellation("galaxy", "a")).await;
    f.set_status("b", AgentStatus::Busy).await;
    f.unregister("c", "c3").await;
    assert_eq!(
        f.store.online_ids().await.expect("ids"),
        ["a", "b", "galaxy"]
    );
    f.close().await;
}

async fn presence_refreshes_revives_and_stops(backend: Backend) {
    let f = Fixture::open(backend).await;
    assert_eq!(
        f.presence(PresenceFlush::default()).await,
        PresenceApplied::default()
    );

    f.register(device("kept", "gw-1", "c1", "lab")).await;
    f.register(device("expired", "gw-1", "c2", "lab")).await;
    f.register(device("closed", "gw-1", "c3", "lab")).await;
    f.register(device("moved", "gw-1", "c4", "lab")).await;
    f.register(device("s-1", "gw-stop", "c5", "lab")).await;
    f.register(device("s-2", "gw-stop", "c6", "lab")).await;
    let long_ago = Utc::now() - LONG_AGO;
    f.set_last_seen("kept", long_ago).await;
    f.set_last_seen("expired", long_ago).await;
    let mut reaped = ended_ids(
        f.store
            .reap(&WINDOWS, Duration::from_secs(3600))
            .await
            .expect("reap"),
    );
    reaped.sort();
    assert_eq!(reaped, ["expired", "kept"]);
    f.unregister("closed", "c3").await;

    let applied = f
        .presence(PresenceFlush {
            gateways: vec![("gw-1".to_owned(), 2_000), ("gw-new".to_owned(), 500)],
            alive: vec![
                ("kept".to_owned(), "c1".to_owned(), "gw-1".to_owned()),
                ("expired".to_owned(), "c2".to_owned(), "gw-1".to_owned()),
                ("closed".to_owned(), "c3".to_owned(), "gw-1".to_owned()),
                ("moved".to_owned(), "c-old".to_owned(), "gw-1".to_owned()),
                ("nobody".to_owned(), "c9".to_owned(), "gw-1".to_owned()),
            ],
            stopping: vec!["gw-stop".to_owned()],
        })
        .await;
    assert_eq!(
        applied,
        PresenceApplied {
            refreshed: 2,
            stopped: 2
        }
    );
    for id in ["kept", "expired"] {
        let agent = f.get(id).await;
        assert_eq!(agent.status, AgentStatus::Available, "{id} is back");
        assert!(
            agent.last_seen > long_ago + chrono::TimeDelta::minutes(5),
            "{id} seen now"
        );
        assert_eq!(f.offline_reason(id).await, None);
    }
    assert_eq!(
        f.get("closed").await.status,
        AgentStatus::Offline,
        "unregistered stays"
    );
    assert_eq!(f.get("moved").await.status, AgentStatus::Available);
    for id in ["s-1", "s-2"] {
        assert_eq!(f.get(id).await.status, AgentStatus::Offline);
        assert_eq!(
            f.offline_reason(id).await.as_deref(),
            Some("gateway_stopped")
        );
    }
    let (_, interval) = f.gateway("gw-1").await.expect("gw-1");
    assert_eq!(interval, 2_000);
    let (seen, interval) = f
        .gateway("gw-new")
        .await
        .expect("a new gateway is recorded");
    assert_eq!(interval, 500);
    assert!((Utc::now() - seen.0).abs() < chrono::TimeDelta::seconds(5));

    // A stopped gateway's report does not bring its agents back.
    let applied = f
        .presence(PresenceFlush {
            alive: vec![("s-1".to_owned(), "c5".to_owned(), "gw-stop".to_owned())],
            ..PresenceFlush::default()
        })
        .await;
    assert_eq!(applied.refreshed, 0);
    assert_eq!(f.get("s-1").await.status, AgentStatus::Offline);
    f.close().await;
}

/// `forget_offline` deletes only agents offline and unseen for the time asked, at most the
/// number asked, and leaves live agents however old their last sign of life.
async fn long_offline_agents_are_deleted_a_bounded_number_at_a_time(backend: Backend) {
    let f = Fixture::open(backend).await;
    let old = Utc::now() - LONG_AGO;
    for i in 0..3 {
        let id = format!("old-{i}");
        f.register(device(&id, "gw-1", &format!("c-{id}"), "lab"))
            .await;
        f.unregister(&id, &format!("c-{id}")).await;
        f.set_last_seen(&id, old).await;
    }
    f.register(device("recent", "gw-1", "c-recent", "lab"))
        .await;
    f.unregister("recent", "c-recent").await;
    f.register(device("live", "gw-1", "c-live", "lab")).await;
    f.set_last_seen("live", old).await;
    let unseen_for = Duration::from_secs(300);

    assert_eq!(
        f.store.forget_offline(unseen_for, 2).await.expect("forget"),
        2
    );
    assert_eq!(
        f.store.forget_offline(unseen_for, 2).await.expect("forget"),
        1
    );
    assert_eq!(
        f.store.forget_offline(unseen_for, 2).await.expect("forget"),
        0
    );
    for i in 0..3 {
        let id = format!("old-{i}");
        assert!(
            f.store.get(&id).await.expect("read").is_none(),
            "{id} deleted"
        );
    }
    assert_eq!(f.get("recent").await.status, AgentStatus::Offline);
    assert_eq!(f.get("live").await.status, AgentStatus::Available);
    f.close().await;
}

/// The first flush after a burst of registrations names every new connection: each agent
/// is refreshed (and only the connection that holds it), and agents that expired meanwhile
/// come back, in one flush of thousands of entries.
async fn one_flush_refreshes_a_whole_burst_of_connections(backend: Backend) {
    const BURST: usize = 2_000;
    let f = Fixture::open(backend).await;
    let ids: Vec<String> = (0..BURST).map(|i| format!("burst-{i:04}")).collect();
    for chunk in ids.chunks(250) {
        let batch = WriteBatch {
            registers: chunk
                .iter()
                .map(|id| device(id, "gw-1", &format!("c-{id}"), "lab"))
                .collect(),
            ..WriteBatch::default()
        };
        let outcome = f.write(batch, &aip_registry::registry::admit).await;
        assert!(outcome.registered.iter().all(Result::is_ok));
    }
    let long_ago = Utc::now() - LONG_AGO;
    for id in &ids[..10] {
        f.set_last_seen(id, long_ago).await;
    }
    let reaped = f
        .store
        .reap(&WINDOWS, Duration::from_secs(3600))
        .await
        .expect("reap");
    assert_eq!(reaped.len(), 10, "the aged agents expire");
    let aged =
        f.db.query(&Sql::same("UPDATE agents SET last_seen = $1"))
            .bind(Timestamp(long_ago))
            .execute()
            .await
            .expect("age every agent");
    assert_eq!(aged, BURST as u64);

    let mut alive: Vec<(String, String, String)> = ids
        .iter()
        .map(|id| (id.clone(), format!("c-{id}"), "gw-1".to_owned()))
        .collect();
    // A connection that no longer holds its agent refreshes nothing.
    alive.push((ids[0].clone(), "c-gone".to_owned(), "gw-1".to_owned()));
    let applied = f
        .presence(PresenceFlush {
            gateways: vec![("gw-1".to_owned(), 1_000)],
            alive,
            stopping: Vec::new(),
        })
        .await;
    assert_eq!(applied.refreshed, BURST as u64);
    for id in [&ids[0], &ids[9], &ids[10], &ids[BURST - 1]] {
        let agent = f.get(id).await;
        assert_eq!(agent.status, AgentStatus::Available, "{id}");
        assert!(
            agent.last_seen > long_ago + chrono::TimeDelta::minutes(5),
            "{id} seen now"
        );
    }
    f.close().await;
}

/// Presence that cannot be written (the database is down) is kept for the next flush, and the
/// buffer says the last write failed: the reaper does not reap then, since the database holds
/// older signs of life than the gateways sent. The next flush that is written refreshes the
/// agent and clears it.
async fn a_presence_write_that_fails_is_kept_and_marked_so_the_reaper_waits(backend: Backend) {
    use aip_registry::presence::{PresenceBuffer, flush_once};
    use proto_schemas::registry::{PresenceBatch, PresenceEntry};

    let f = Fixture::open(backend).await;
    f.register(device("alive", "gw-1", "c1", "lab")).await;
    f.set_last_seen("alive", Utc::now() - LONG_AGO).await;
    let buffer = PresenceBuffer::default();
    assert!(!buffer.last_write_failed(), "nothing written is no failure");
    buffer.add(PresenceBatch {
        version: proto_schemas::V1,
        gateway_id: "gw-1".to_owned(),
        interval_ms: 1_000,
        alive: vec![PresenceEntry {
            agent_id: "alive".to_owned(),
            connection_id: "c1".to_owned(),
        }],
        stopping: false,
    });

    let down = f.test_db.connect().await.expect("connect");
    let unreachable = store::for_database(&down);
    down.close().await;
    flush_once(&buffer, &*unreachable).await;
    assert!(buffer.last_write_failed());

    flush_once(&buffer, &*f.store).await;
    assert!(!buffer.last_write_failed());
    let reaped = f
        .store
        .reap(&WINDOWS, Duration::from_secs(3600))
        .await
        .expect("reap");
    assert_eq!(
        ended_ids(reaped),
        Vec::<String>::new(),
        "the kept flush was written"
    );
    f.close().await;
}

async fn reaping_expires_silent_agents_and_forgets_dead_gateways(backend: Backend) {
    let f = Fixture::open(backend).await;
    let keep_gateways = Duration::from_secs(3600);
    assert!(
        f.store
            .reap(&WINDOWS, keep_gateways)
            .await
            .expect("reap")
            .is_empty()
    );
    f.register(device("live", "gw-1", "c1", "lab")).await;
    f.register(device("silent", "gw-1", "c2", "lab")).await;
    f.register(device("cut-off-a", "gw-dead", "c3", "lab"))
        .await;
    f.register(device("cut-off-b", "gw-dead", "c4", "lab"))
        .await;
    f.register(device("gone", "gw-gone", "c5", "lab")).await;
    f.set_status("cut-off-b", AgentStatus::Busy).await;
    f.set_last_seen("silent", Utc::now() - LONG_AGO).await;
    f.age_gateway("gw-dead").await;
    f.unregister("gone", "c5").await;
    f.age_gateway("gw-gone").await;

    let ended = f.store.reap(&WINDOWS, keep_gateways).await.expect("reap");
    let silent = ended
        .iter()
        .find(|e| e.agent_id == "silent")
        .expect("silent is reaped");
    assert_eq!(
        (silent.gateway_id.as_str(), silent.connection_id.as_str()),
        ("gw-1", "c2"),
        "the reaper names the connection that ended, for its announcement"
    );
    let reaped = ended_ids(ended);
    let mut sorted = reaped.clone();
    sorted.sort();
    assert_eq!(sorted, ["cut-off-a", "cut-off-b", "silent"]);
    for id in &reaped {
        assert_eq!(f.get(id).await.status, AgentStatus::Offline);
        assert_eq!(
            f.offline_reason(id).await.as_deref(),
            Some("liveness_expired")
        );
    }
    assert_eq!(f.get("live").await.status, AgentStatus::Available);
    assert!(
        f.store
            .reap(&WINDOWS, keep_gateways)
            .await
            .expect("reap")
            .is_empty(),
        "once"
    );
    assert!(f.gateway("gw-dead").await.is_some(), "kept for a day");

    // Forgotten: silent gateways holding no live agent. gw-1 holds one.
    assert!(
        f.store
            .reap(&WINDOWS, Duration::from_secs(1))
            .await
            .expect("reap")
            .is_empty()
    );
    assert!(f.gateway("gw-dead").await.is_none());
    assert!(f.gateway("gw-gone").await.is_none());
    assert!(f.gateway("gw-1").await.is_some());
    f.close().await;
}

/// A gateway that starts again ends every connection its previous process held, and only
/// those; a late presence report of one of them does not bring it back.
async fn a_restarted_gateway_ends_the_connections_it_held(backend: Backend) {
    let f = Fixture::open(backend).await;
    f.register(device("a", "gw-1", "c1", "lab")).await;
    f.register(device("b", "gw-1", "c2", "lab")).await;
    f.register(device("other", "gw-2", "c3", "lab")).await;
    f.unregister("b", "c2").await;
    let ended = f.store.end_gateway("gw-1").await.expect("ends");
    assert_eq!(
        ended,
        [Ended {
            agent_id: "a".to_owned(),
            client_type: ClientType::Device,
            gateway_id: "gw-1".to_owned(),
            connection_id: "c1".to_owned(),
        }],
        "the one still online; the unregistered one had ended already"
    );
    assert_eq!(f.get("a").await.status, AgentStatus::Offline);
    assert_ne!(f.get("other").await.status, AgentStatus::Offline);
    assert!(
        f.store.end_gateway("gw-1").await.expect("ends").is_empty(),
        "once"
    );
    let applied = f
        .store
        .apply_presence(&PresenceFlush {
            alive: vec![("a".to_owned(), "c1".to_owned(), "gw-1".to_owned())],
            ..PresenceFlush::default()
        })
        .await
        .expect("presence");
    assert_eq!(applied.refreshed, 0, "a late report does not revive it");
    assert_eq!(f.get("a").await.status, AgentStatus::Offline);
    f.close().await;
}

async fn unreadable_rows_are_reported_as_corrupt(backend: Backend) {
    let f = Fixture::open(backend).await;
    f.register(device("pc", "gw-1", "c1", "lab")).await;
    let changed =
        f.db.query(&Sql::same(
            "UPDATE agents SET tools = $1 WHERE agent_id = $2",
        ))
        .bind(sqlx::types::Json(json!({"not": "a list"})))
        .bind("pc")
        .execute()
        .await
        .expect("spoil the tools");
    assert_eq!(changed, 1);
    let err = f.store.get("pc").await.expect_err("tools cannot be read");
    assert!(
        matches!(&err, StoreError::Corrupt { agent_id, .. } if agent_id == "pc"),
        "{err:?}"
    );
    assert!(!err.is_unavailable());
    let err = f
        .store
        .list(&all())
        .await
        .expect_err("listing reads it too");
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
    f.close().await;
}

async fn ping_answers(backend: Backend) {
    let f = Fixture::open(backend).await;
    f.store.ping().await.expect("ping");
    f.db.close().await;
    let err = f.store.ping().await.expect_err("closed pool");
    assert!(err.is_unavailable(), "{err:?}");
    f.test_db.cleanup().await;
}

/// Two replicas registering the same new id at once (PostgreSQL only: SQLite's write
/// transaction holds the whole database, so its registrations never overlap). Both read "no
/// holder" before either inserts (their admit functions wait for each other); one insert
/// wins, and the other registration is judged again against the row the winner wrote.
///
/// Each replica runs on a thread of its own with its own runtime and pool, so that an admit
/// function blocking its thread holds up nothing but its own registration.
#[tokio::test]
async fn a_first_registration_beaten_to_its_id_is_judged_again() {
    let f = Fixture::open(Backend::Postgres).await;
    let both_read = Arc::new(Rendezvous::default());
    let replica = |connection: &'static str, principal: &'static str| {
        let url = f.test_db.url().to_owned();
        let both_read = both_read.clone();
        std::thread::spawn(move || {
            let admit = move |request: &RegisterAgent, holder: Option<&Holder>| {
                if holder.is_none() {
                    both_read.meet();
                }
                aip_registry::registry::admit(request, holder)
            };
            let batch = WriteBatch {
                registers: vec![device("pc", "gw-1", connection, principal)],
                ..WriteBatch::default()
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let db = Database::connect(&url).await.expect("connect");
                let outcome = store::for_database(&db)
                    .write_batch(&batch, &WINDOWS, &admit)
                    .await
                    .expect("the batch commits")
                    .registered
                    .remove(0)
                    .expect("judged");
                db.close().await;
                outcome
            })
        })
    };
    let alice = replica("c-alice", "alice");
    let bob = replica("c-bob", "bob");
    let alice = alice.join().expect("alice's replica");
    let bob = bob.join().expect("bob's replica");
    let (winner, refused) = match (&alice, &bob) {
        (RegisterOutcome::Registered(won), RegisterOutcome::Refused(refusal))
        | (RegisterOutcome::Refused(refusal), RegisterOutcome::Registered(won)) => (won, refusal),
        other => panic!("one registration wins, the other is refused: {other:?}"),
    };
    assert_eq!(refused.error_code, ErrorCode::RegistrationFailed);
    assert_eq!(winner.replaced_connection, None);
    assert_eq!(f.get("pc").await, winner.agent, "the winner is stored");
    f.close().await;
}

/// How long a replica waits for the other to read the id before the test fails.
const RENDEZVOUS_DEADLINE: Duration = Duration::from_secs(10);

/// Two threads waiting for each other, within [`RENDEZVOUS_DEADLINE`].
#[derive(Default)]
struct Rendezvous {
    arrived: Mutex<usize>,
    changed: std::sync::Condvar,
}

impl Rendezvous {
    fn meet(&self) {
        let mut arrived = self.arrived.lock().expect("lock");
        *arrived += 1;
        self.changed.notify_all();
        let (_arrived, wait) = self
            .changed
            .wait_timeout_while(arrived, RENDEZVOUS_DEADLINE, |arrived| *arrived < 2)
            .expect("lock");
        assert!(!wait.timed_out(), "the other replica never read the id");
    }
}

/// The agent ids of ended connections.
fn ended_ids(ended: Vec<aip_registry::store::Ended>) -> Vec<String> {
    ended.into_iter().map(|e| e.agent_id).collect()
}
