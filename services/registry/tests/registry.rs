//! Conformance tests of the registry, run against both backends: (NATS + PostgreSQL) and
//! (in-process bus + SQLite). Each test is one async fn taking the test kit's [`Backend`];
//! its `both_backends!` macro turns it into `<name>::nats_postgres` and `<name>::local_sqlite`.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use aip_testkit::{Backend, WAIT, both_backends, wait_until, within};
use common::{Options, TestApp, constellation, device, publish_presence};
use futures::StreamExt;
use proto_schemas::registry::{
    Accepted, AgentRecord, AgentStatus, GetAgents, MAX_GET_MANY, MAX_WRITES, Registered,
    RegistryWrite, RegistryWrites, Reply, UnregisterAgent, WriteAnswer,
};
use proto_schemas::{ClientType, ErrorCode, Extension, McpToolInfo, V1};
use serde_json::{Value, json};

both_backends!(
    register_get_and_lookup,
    get_many_answers_the_known_ids_in_one_request,
    lookup_offers_only_available_live_agents_least_loaded_first,
    duplicate_live_id_is_refused_with_ufo_text,
    same_principal_takes_over_its_registration,
    dead_stale_or_offline_entries_are_replaced,
    constellation_target_must_be_a_connected_device,
    unregister_by_a_stale_connection_is_ignored,
    agents_offline_past_the_retention_are_forgotten,
    writes_sent_together_are_each_answered_as_alone,
    presence_keeps_agents_alive_and_silent_gateways_expire,
    stopping_gateway_takes_its_agents_offline_at_once,
    presence_revives_expired_agents_but_not_unregistered_ones,
    presence_is_batched_and_written_on_shutdown,
    malformed_requests_get_invalid_request,
    rest_ufo_clients_and_health_shapes,
    rest_agents_filters_and_not_found,
    rest_requires_an_api_key,
    replicas_share_the_queue_group,
);

/// A registry liveness window far beyond [`WAIT`]: no agent expires while a test waits.
const NEVER_EXPIRES_MS: u64 = 600_000;

async fn register_get_and_lookup(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    let mut req = device("pc.1 *>", "gw-1", "conn-1", "alice");
    req.capabilities = vec!["excel".into(), "word".into()];
    req.tools = vec![McpToolInfo {
        tool_key: "action::click".into(),
        tool_name: "click".into(),
        title: None,
        namespace: "ui".into(),
        tool_type: "action".into(),
        description: Some("clicks".into()),
        input_schema: None,
        output_schema: None,
        meta: None,
        annotations: None,
    }];
    req.system_info = Some(json!({"device_id": "pc.1 *>", "cpu_count": 8}));
    req.metadata =
        Some(json!({"platform": "windows", "registration_time": "2026-01-01T00:00:00+00:00"}));
    req.extensions = vec![Extension::Progress];
    let registered: Registered = app.register(&req).await.expect("registered");
    assert_eq!(registered.replaced_connection, None);
    let agent = registered.agent;
    assert_eq!(agent.agent_id, "pc.1 *>");
    assert_eq!(agent.status, AgentStatus::Available);
    assert_eq!(agent.load, 0);

    let got: AgentRecord = app.get("pc.1 *>").await.expect("get");
    assert_eq!(got, agent);
    assert_eq!(got.tools[0].tool_key, "action::click");
    assert_eq!(got.system_info, req.system_info);
    assert_eq!(got.metadata, req.metadata);
    assert_eq!(got.extensions, [Extension::Progress]);
    assert_eq!(
        (got.gateway_id.as_str(), got.connection_id.as_str()),
        ("gw-1", "conn-1")
    );

    let missing = app.get("nobody").await.expect_err("unknown id");
    assert_eq!(missing.error_code, ErrorCode::NotFound);
    assert!(missing.detail.contains("nobody"), "{}", missing.detail);

    assert_eq!(app.lookup(&["excel"], None, None).await, ["pc.1 *>"]);
    assert_eq!(
        app.lookup(&["excel", "word"], None, None).await,
        ["pc.1 *>"]
    );
    assert_eq!(app.lookup(&[], None, None).await, ["pc.1 *>"]);
    assert!(
        app.lookup(&["excel", "powerpoint"], None, None)
            .await
            .is_empty()
    );
    app.stop().await;
}

async fn get_many_answers_the_known_ids_in_one_request(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    for (id, conn) in [("pc-a", "conn-a"), ("pc-b", "conn-b")] {
        app.register(&device(id, "gw-1", conn, "alice"))
            .await
            .expect("registered");
    }
    app.register(&constellation("galaxy", None, "gw-1", "conn-g"))
        .await
        .expect("registered");
    let get_many = |ids: Vec<String>| {
        let app = &app;
        async move {
            let request = GetAgents {
                version: V1,
                agent_ids: ids,
            };
            app.call::<_, Vec<AgentRecord>>(app.subjects.registry_get_many(), &request)
                .await
        }
    };
    let ids = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();

    let mut found = get_many(ids(&["pc-b", "nobody", "galaxy", "pc-b", "pc-a"]))
        .await
        .expect("answered");
    found.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
    let found: Vec<(&str, ClientType, &str)> = found
        .iter()
        .map(|a| (a.agent_id.as_str(), a.client_type, a.connection_id.as_str()))
        .collect();
    assert_eq!(
        found,
        [
            ("galaxy", ClientType::Constellation, "conn-g"),
            ("pc-a", ClientType::Device, "conn-a"),
            ("pc-b", ClientType::Device, "conn-b"),
        ],
        "each known id once, the unknown one absent"
    );
    assert_eq!(get_many(vec![]).await.expect("answered"), []);

    let too_many = (0..=MAX_GET_MANY).map(|i| format!("id-{i}")).collect();
    let refused = get_many(too_many).await.expect_err("over the limit");
    assert_eq!(refused.error_code, ErrorCode::InvalidRequest);
    assert!(
        refused.detail.contains("at most 1000"),
        "{}",
        refused.detail
    );
    app.stop().await;
}

async fn lookup_offers_only_available_live_agents_least_loaded_first(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    for (id, caps) in [
        ("busy-one", &["ocr"][..]),
        ("loaded", &["ocr"]),
        ("idle-old", &["ocr"]),
        ("idle-new", &["ocr"]),
        ("stale", &["ocr"]),
        ("gone", &["ocr"]),
        ("no-ocr", &["excel"]),
    ] {
        let mut req = device(id, "gw-1", &format!("conn-{id}"), "p");
        req.capabilities = caps.iter().map(|c| (*c).to_owned()).collect();
        app.register(&req).await.expect("registered");
    }
    let mut galaxy = constellation("task@pc", None, "gw-1", "conn-galaxy");
    galaxy.capabilities = vec!["ocr".into()];
    app.register(&galaxy)
        .await
        .expect("constellation registered");

    app.set_status("busy-one", AgentStatus::Busy).await;
    app.set_load("loaded", 3).await;
    app.age_agent("idle-old", 5_000).await;
    app.age_agent("stale", 60_000).await; // beyond the 15 s window, still stored as available
    app.unregister("gone", "conn-gone")
        .await
        .expect("unregistered");

    assert_eq!(
        app.lookup(&["ocr"], None, None).await,
        ["idle-new", "idle-old", "loaded"]
    );
    assert_eq!(
        app.lookup(&["ocr"], Some(ClientType::Device), Some(2))
            .await,
        ["idle-new", "idle-old"]
    );
    assert_eq!(
        app.lookup(&["ocr"], Some(ClientType::Constellation), None)
            .await,
        ["task@pc"]
    );
    assert_eq!(app.lookup(&[], None, Some(0)).await, Vec::<String>::new());
    assert_eq!(
        app.lookup(&[], None, Some(1_000_000)).await.len(),
        4,
        "limit is capped, not refused"
    );
    app.stop().await;
}

async fn duplicate_live_id_is_refused_with_ufo_text(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    app.register(&device("pc-1", "gw-1", "c1", "alice"))
        .await
        .expect("first");
    let refused = app
        .register(&device("pc-1", "gw-2", "c2", "bob"))
        .await
        .expect_err("duplicate");
    assert_eq!(refused.error_code, ErrorCode::RegistrationFailed);
    assert_eq!(
        refused.detail,
        "client_id 'pc-1' is already registered; duplicate registrations are not allowed"
    );
    let holder = app.get("pc-1").await.expect("still there");
    assert_eq!(
        holder.connection_id, "c1",
        "the refused registration changed nothing"
    );

    // Python's repr quoting of ids with quotes and backslashes.
    app.register(&device("it's", "gw-1", "c3", "alice"))
        .await
        .expect("first");
    let refused = app
        .register(&device("it's", "gw-1", "c4", "bob"))
        .await
        .expect_err("duplicate");
    assert_eq!(
        refused.detail,
        "client_id \"it's\" is already registered; duplicate registrations are not allowed"
    );
    app.register(&device("a\\b'\"", "gw-1", "c5", "alice"))
        .await
        .expect("first");
    let refused = app
        .register(&device("a\\b'\"", "gw-1", "c6", "bob"))
        .await
        .expect_err("duplicate");
    assert_eq!(
        refused.detail,
        "client_id 'a\\\\b\\'\"' is already registered; duplicate registrations are not allowed"
    );

    // The same connection registering again (a retried request) is not a duplicate.
    let again = app
        .register(&device("pc-1", "gw-1", "c1", "alice"))
        .await
        .expect("retry is idempotent");
    assert_eq!(again.replaced_connection, None);
    app.stop().await;
}

async fn same_principal_takes_over_its_registration(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    let first = app
        .register(&device("pc-1", "gw-1", "old-socket", "lab"))
        .await
        .expect("first");
    app.set_load("pc-1", 2).await;
    let second = app
        .register(&device("pc-1", "gw-2", "new-socket", "lab"))
        .await
        .expect("takeover");
    assert_eq!(second.replaced_connection.as_deref(), Some("old-socket"));
    assert_eq!(second.agent.connection_id, "new-socket");
    assert_eq!(second.agent.gateway_id, "gw-2");
    assert_eq!(second.agent.load, 0, "a new connection starts unloaded");
    assert!(second.agent.connected_at >= first.agent.connected_at);
    assert_eq!(
        app.get("pc-1").await.expect("get").connection_id,
        "new-socket"
    );
    app.stop().await;
}

async fn dead_stale_or_offline_entries_are_replaced(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    // Held via a gateway that died (no presence for longer than the window).
    app.register(&device("pc-1", "gw-dead", "c1", "alice"))
        .await
        .expect("first");
    app.age_gateway("gw-dead", 60_000).await;
    let replaced = app
        .register(&device("pc-1", "gw-2", "c2", "bob"))
        .await
        .expect("dead gateway's entry replaced");
    assert_eq!(
        replaced.replaced_connection.as_deref(),
        Some("c1"),
        "the old holder is named so it gets closed"
    );

    // Silent agent on a live gateway.
    app.register(&device("pc-2", "gw-2", "c3", "alice"))
        .await
        .expect("first");
    app.age_agent("pc-2", 60_000).await;
    app.register(&device("pc-2", "gw-2", "c4", "bob"))
        .await
        .expect("stale entry replaced");

    // Offline.
    app.register(&device("pc-3", "gw-2", "c5", "alice"))
        .await
        .expect("first");
    app.unregister("pc-3", "c5").await.expect("unregistered");
    let replaced = app
        .register(&device("pc-3", "gw-2", "c6", "bob"))
        .await
        .expect("offline entry replaced");
    assert_eq!(replaced.replaced_connection, None);
    assert_eq!(replaced.agent.status, AgentStatus::Available);
    app.stop().await;
}

async fn constellation_target_must_be_a_connected_device(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    let refused = app
        .register(&constellation("t@pc-x", Some("pc-x"), "gw-1", "g1"))
        .await
        .expect_err("no such device");
    assert_eq!(refused.error_code, ErrorCode::RegistrationFailed);
    assert_eq!(refused.detail, "Target device 'pc-x' is not connected");

    app.register(&device("pc-x", "gw-1", "d1", "lab"))
        .await
        .expect("device");
    let ok = app
        .register(&constellation("t@pc-x", Some("pc-x"), "gw-1", "g1"))
        .await
        .expect("target online");
    assert_eq!(ok.agent.target_id.as_deref(), Some("pc-x"));
    assert_eq!(ok.agent.client_type, ClientType::Constellation);

    // A constellation is not a device.
    let refused = app
        .register(&constellation("t2@x", Some("t@pc-x"), "gw-1", "g2"))
        .await
        .expect_err("not a device");
    assert_eq!(refused.detail, "Target device 't@pc-x' is not connected");

    // The target check comes before the duplicate check (UFO's order).
    app.unregister("pc-x", "d1").await.expect("device gone");
    let refused = app
        .register(&constellation("t@pc-x", Some("pc-x"), "gw-1", "g9"))
        .await
        .expect_err("offline target");
    assert_eq!(refused.detail, "Target device 'pc-x' is not connected");

    // No target: nothing to check.
    app.register(&constellation("free@x", None, "gw-1", "g3"))
        .await
        .expect("no target");
    app.stop().await;
}

async fn unregister_by_a_stale_connection_is_ignored(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    app.register(&device("pc-1", "gw-1", "c1", "lab"))
        .await
        .expect("first");
    app.register(&device("pc-1", "gw-1", "c2", "lab"))
        .await
        .expect("takeover");
    let stale = app.unregister("pc-1", "c1").await.expect("answered");
    assert!(!stale.went_offline);
    assert_eq!(app.status("pc-1").await, AgentStatus::Available);
    let current = app.unregister("pc-1", "c2").await.expect("answered");
    assert!(current.went_offline);
    assert_eq!(app.status("pc-1").await, AgentStatus::Offline);
    let again = app.unregister("pc-1", "c2").await.expect("answered");
    assert!(!again.went_offline, "already offline");
    let unknown = app.unregister("nobody", "c").await.expect("answered");
    assert!(!unknown.went_offline);
    app.stop().await;
}

/// An agent offline and unseen for `forget_offline_after_ms` is deleted by the reaper (its id
/// then registers as a new one); an agent offline for less, and a live one, stay.
async fn agents_offline_past_the_retention_are_forgotten(backend: Backend) {
    let app = TestApp::spawn(
        backend,
        Options {
            liveness_ms: NEVER_EXPIRES_MS,
            forget_offline_after_ms: 10_000,
            ..Options::default()
        },
    )
    .await;
    for (id, connection) in [("gone", "c1"), ("recent", "c2"), ("live", "c3")] {
        app.register(&device(id, "gw-1", connection, "lab"))
            .await
            .expect("registered");
    }
    app.unregister("gone", "c1").await.expect("unregistered");
    app.unregister("recent", "c2").await.expect("unregistered");
    app.age_agent("gone", 20_000).await;
    app.age_agent("live", 20_000).await;

    wait_until("the long-offline agent is forgotten", || async {
        app.get("gone").await.is_err()
    })
    .await;
    let gone = app.get("gone").await.expect_err("forgotten");
    assert_eq!(gone.error_code, ErrorCode::NotFound, "{gone:?}");
    assert_eq!(app.status("recent").await, AgentStatus::Offline);
    assert_eq!(app.status("live").await, AgentStatus::Available);

    app.register(&device("gone", "gw-1", "c4", "lab"))
        .await
        .expect("a forgotten id registers as a new one");
    assert_eq!(app.status("gone").await, AgentStatus::Available);
    app.stop().await;
}

/// `registry.write`: a gateway's writes that were waiting at once, in one request; each is
/// answered, in its order, as its own subject would have answered it.
async fn writes_sent_together_are_each_answered_as_alone(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    app.register(&device("pc-1", "gw-1", "c1", "alice"))
        .await
        .expect("first");
    app.register(&device("pc-3", "gw-1", "c3", "alice"))
        .await
        .expect("first");
    let unregister = |agent_id: &str, connection_id: &str| {
        RegistryWrite::Unregister(UnregisterAgent {
            version: V1,
            agent_id: agent_id.to_owned(),
            connection_id: connection_id.to_owned(),
            reason: "client closed the connection".to_owned(),
        })
    };
    let mut nameless = device("", "gw-1", "c0", "alice");
    nameless.agent_id = String::new();
    let writes = RegistryWrites {
        version: V1,
        writes: vec![
            RegistryWrite::Register(device("pc-2", "gw-1", "c2", "alice")),
            RegistryWrite::Register(device("pc-1", "gw-2", "c9", "bob")),
            unregister("pc-1", "stale"),
            unregister("pc-3", "c3"),
            RegistryWrite::Register(nameless),
            unregister("nobody", "c"),
        ],
        without_records: false,
    };
    let answers: Vec<WriteAnswer> = app
        .call(app.subjects.registry_write(), &writes)
        .await
        .expect("answered");
    assert_eq!(answers.len(), 6, "{answers:?}");
    match &answers[0] {
        WriteAnswer::Registered(registered) => {
            assert_eq!(registered.agent.agent_id, "pc-2");
            assert_eq!(registered.agent.connection_id, "c2");
        }
        other => panic!("pc-2: {other:?}"),
    }
    match &answers[1] {
        WriteAnswer::Error(refusal) => {
            assert_eq!(refusal.error_code, ErrorCode::RegistrationFailed);
            assert_eq!(
                refusal.detail,
                "client_id 'pc-1' is already registered; duplicate registrations are not allowed"
            );
        }
        other => panic!("pc-1 by bob: {other:?}"),
    }
    assert!(
        matches!(&answers[2], WriteAnswer::Unregistered(u) if !u.went_offline),
        "a stale connection: {:?}",
        answers[2]
    );
    assert!(
        matches!(&answers[3], WriteAnswer::Unregistered(u) if u.went_offline),
        "pc-3's own connection: {:?}",
        answers[3]
    );
    assert!(
        matches!(&answers[4], WriteAnswer::Error(e) if e.error_code == ErrorCode::InvalidRequest),
        "no agent_id: {:?}",
        answers[4]
    );
    assert!(
        matches!(&answers[5], WriteAnswer::Unregistered(u) if !u.went_offline),
        "an unknown agent: {:?}",
        answers[5]
    );
    // Written, as answered.
    assert_eq!(
        app.get("pc-2").await.expect("pc-2").status,
        AgentStatus::Available
    );
    let pc1 = app.get("pc-1").await.expect("pc-1");
    assert_eq!(
        (pc1.connection_id.as_str(), pc1.status),
        ("c1", AgentStatus::Available)
    );
    assert_eq!(app.status("pc-3").await, AgentStatus::Offline);

    // Asked without records, an accepted registration says only which connection it
    // replaced; refusals are as before, and the writes are stored all the same.
    let without_records = RegistryWrites {
        version: V1,
        writes: vec![
            RegistryWrite::Register(device("pc-4", "gw-1", "c4", "alice")),
            RegistryWrite::Register(device("pc-2", "gw-2", "c5", "alice")),
            RegistryWrite::Register(device("pc-1", "gw-2", "c9", "bob")),
        ],
        without_records: true,
    };
    let answers: Vec<WriteAnswer> = app
        .call(app.subjects.registry_write(), &without_records)
        .await
        .expect("answered");
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert_eq!(answers[0], WriteAnswer::Accepted(Accepted::default()));
    let took_over = Accepted {
        replaced_connection: Some("c2".to_owned()),
        replaced_gateway: Some("gw-1".to_owned()),
    };
    assert_eq!(answers[1], WriteAnswer::Accepted(took_over));
    assert!(
        matches!(&answers[2], WriteAnswer::Error(e) if e.error_code == ErrorCode::RegistrationFailed),
        "pc-1 by bob: {:?}",
        answers[2]
    );
    let pc2 = app.get("pc-2").await.expect("pc-2");
    assert_eq!(
        (pc2.connection_id.as_str(), pc2.gateway_id.as_str()),
        ("c5", "gw-2")
    );
    assert_eq!(app.status("pc-4").await, AgentStatus::Available);

    // More than a request may hold is refused whole, and nothing of it is written.
    let too_many = RegistryWrites {
        version: V1,
        writes: (0..=MAX_WRITES)
            .map(|i| RegistryWrite::Register(device(&format!("many-{i}"), "gw-1", "c", "alice")))
            .collect(),
        without_records: true,
    };
    let refusal = app
        .call::<_, Vec<WriteAnswer>>(app.subjects.registry_write(), &too_many)
        .await
        .expect_err("too many");
    assert_eq!(refusal.error_code, ErrorCode::InvalidRequest);
    assert_eq!(
        refusal.detail,
        format!(
            "writes holds {} writes; at most {MAX_WRITES} per request",
            MAX_WRITES + 1
        )
    );
    let missing = app.get("many-0").await.expect_err("not written");
    assert_eq!(missing.error_code, ErrorCode::NotFound);
    app.stop().await;
}

async fn presence_keeps_agents_alive_and_silent_gateways_expire(backend: Backend) {
    let app = TestApp::spawn(backend, Options::fast()).await;
    app.register(&device("kept", "gw-live", "c1", "lab"))
        .await
        .expect("registered");
    app.register(&device("dropped", "gw-silent", "c2", "lab"))
        .await
        .expect("registered");
    let first_seen = app.get("kept").await.expect("get").last_seen;

    // gw-live reports every 300 ms; gw-silent never does (as if killed with -9).
    let (bus, subjects) = (app.bus.clone(), app.subjects.clone());
    let reporter = tokio::spawn(async move {
        loop {
            publish_presence(&bus, &subjects, "gw-live", &[("kept", "c1")], false).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });

    let started = tokio::time::Instant::now();
    wait_until("the silent gateway's agent is offline", || async {
        app.status("dropped").await == AgentStatus::Offline
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(1_000),
        "not reaped before its window"
    );
    let kept = app.get("kept").await.expect("get");
    assert_eq!(
        kept.status,
        AgentStatus::Available,
        "the reporting gateway's agent stays available"
    );
    assert!(kept.last_seen > first_seen, "presence refreshed last_seen");
    assert_eq!(app.lookup(&[], None, None).await, ["kept"]);

    // Now gw-live goes silent too.
    reporter.abort();
    wait_until("the second gateway's agent is offline", || async {
        app.status("kept").await == AgentStatus::Offline
    })
    .await;
    assert!(app.lookup(&[], None, None).await.is_empty());
    app.stop().await;
}

async fn stopping_gateway_takes_its_agents_offline_at_once(backend: Backend) {
    // A liveness window far beyond the test's patience (WAIT): going offline while the test
    // waits can only be the stopping batch.
    let options = Options {
        liveness_ms: NEVER_EXPIRES_MS,
        ..Options::default()
    };
    let app = TestApp::spawn(backend, options).await;
    app.register(&device("a", "gw-1", "c1", "lab"))
        .await
        .expect("registered");
    app.register(&device("b", "gw-1", "c2", "lab"))
        .await
        .expect("registered");
    app.register(&device("other", "gw-2", "c3", "lab"))
        .await
        .expect("registered");
    app.presence("gw-1", &[("a", "c1")], true).await;
    wait_until("gw-1's agents are offline", || async {
        app.status("a").await == AgentStatus::Offline
            && app.status("b").await == AgentStatus::Offline
    })
    .await;
    assert_eq!(app.status("other").await, AgentStatus::Available);
    // A late report of the stopped gateway does not bring them back.
    let other_seen = app.get("other").await.expect("get").last_seen;
    app.presence("gw-1", &[("a", "c1")], false).await;
    app.presence("gw-2", &[("other", "c3")], false).await;
    wait_until("both reports were written", || async {
        app.get("other").await.expect("get").last_seen > other_seen
    })
    .await;
    assert_eq!(app.status("a").await, AgentStatus::Offline);
    app.stop().await;
}

async fn presence_revives_expired_agents_but_not_unregistered_ones(backend: Backend) {
    let app = TestApp::spawn(backend, Options::fast()).await;
    app.register(&device("comeback", "gw-1", "c1", "lab"))
        .await
        .expect("registered");
    app.register(&device("closed", "gw-1", "c2", "lab"))
        .await
        .expect("registered");
    wait_until("both expired", || async {
        app.status("comeback").await == AgentStatus::Offline
            && app.status("closed").await == AgentStatus::Offline
    })
    .await;
    app.unregister("closed", "c2").await.expect("unregistered");
    // The gateway was only cut off (say, the registry was down); it reports again.
    app.presence("gw-1", &[("comeback", "c1"), ("closed", "c2")], false)
        .await;
    wait_until("the expired agent is back", || async {
        app.status("comeback").await == AgentStatus::Available
    })
    .await;
    assert_eq!(
        app.status("closed").await,
        AgentStatus::Offline,
        "an unregistered connection stays offline"
    );
    app.stop().await;
}

async fn presence_is_batched_and_written_on_shutdown(backend: Backend) {
    // One flush every 10 s (the first at start): a report arriving after that first flush is
    // written only by the drain on shutdown.
    let options = Options {
        liveness_ms: 60_000,
        presence_flush_ms: 10_000,
        ..Options::default()
    };
    let mut app = TestApp::spawn(backend, options).await;
    app.register(&device("pc", "gw-1", "c1", "lab"))
        .await
        .expect("registered");
    app.age_agent("pc", 20_000).await;
    let before = app.get("pc").await.expect("get").last_seen;
    app.presence("gw-1", &[("pc", "c1")], false).await;
    // A request after the report on the same connection: the report has reached the registry.
    assert_eq!(
        app.get("pc").await.expect("get").last_seen,
        before,
        "not written per heartbeat"
    );
    app.main.stop().await;
    let store = aip_registry::store::for_database(&app.db);
    let after = store
        .get("pc")
        .await
        .expect("store")
        .expect("agent")
        .last_seen;
    assert!(
        after > before,
        "the drain wrote the pending report ({before} -> {after})"
    );
    app.stop().await;
}

async fn malformed_requests_get_invalid_request(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    let err = app
        .call_raw::<Value>(app.subjects.registry_get(), b"not json".to_vec())
        .await
        .expect_err("refused");
    assert_eq!(err.error_code, ErrorCode::InvalidRequest);
    assert!(err.detail.contains("registry.get"), "{}", err.detail);
    let err = app
        .call::<_, Value>(
            app.subjects.registry_get(),
            &json!({"version": 2, "agent_id": "x"}),
        )
        .await
        .expect_err("wrong version");
    assert_eq!(err.error_code, ErrorCode::InvalidRequest);
    assert!(err.detail.contains("version"), "{}", err.detail);
    let err = app
        .call::<_, Value>(
            app.subjects.registry_register(),
            &json!({"version": 1, "agent_id": "x"}),
        )
        .await
        .expect_err("missing fields");
    assert_eq!(err.error_code, ErrorCode::InvalidRequest);
    let mut empty = device("", "gw", "c", "p");
    empty.agent_id = String::new();
    let err = app.register(&empty).await.expect_err("empty id");
    assert_eq!(err.error_code, ErrorCode::InvalidRequest);
    app.stop().await;
}

async fn rest_ufo_clients_and_health_shapes(backend: Backend) {
    let app = TestApp::spawn(backend, Options::with_keys(&["secret"])).await;
    app.register(&device("pc-b", "gw-1", "c1", "lab"))
        .await
        .expect("registered");
    app.register(&device("pc-a", "gw-1", "c2", "lab"))
        .await
        .expect("registered");
    app.register(&device("pc-off", "gw-1", "c3", "lab"))
        .await
        .expect("registered");
    app.register(&constellation("t@pc-a", Some("pc-a"), "gw-1", "c4"))
        .await
        .expect("registered");
    app.set_status("pc-b", AgentStatus::Busy).await;
    app.unregister("pc-off", "c3").await.expect("unregistered");

    let clients: Value = app
        .http
        .get(app.url("/api/clients"))
        .header("X-API-Key", "secret")
        .send()
        .await
        .expect("request")
        .error_for_status()
        .expect("200")
        .json()
        .await
        .expect("json");
    assert_eq!(
        clients,
        json!({"online_clients": ["pc-a", "pc-b", "t@pc-a"]})
    );

    let health: Value = app
        .http
        .get(app.url("/api/health"))
        .bearer_auth("secret")
        .send()
        .await
        .expect("request")
        .error_for_status()
        .expect("200")
        .json()
        .await
        .expect("json");
    assert_eq!(
        health,
        json!({"status": "healthy", "online_clients": ["pc-a", "pc-b", "t@pc-a"]})
    );
    app.stop().await;
}

async fn rest_agents_filters_and_not_found(backend: Backend) {
    let app = TestApp::spawn(backend, Options::default()).await;
    for (id, caps) in [("a", &["x", "y"][..]), ("b", &["x"]), ("c", &["y"])] {
        let mut req = device(id, "gw-1", &format!("c-{id}"), "lab");
        req.capabilities = caps.iter().map(|c| (*c).to_owned()).collect();
        app.register(&req).await.expect("registered");
    }
    let mut galaxy = constellation("g@a", Some("a"), "gw-1", "c-g");
    galaxy.capabilities = vec!["x".into()];
    app.register(&galaxy).await.expect("registered");
    app.unregister("c", "c-c").await.expect("unregistered");

    let ids = |query: &'static str| {
        let app = &app;
        async move {
            let response = app
                .http
                .get(app.url(&format!("/api/agents{query}")))
                .send()
                .await
                .expect("request");
            assert_eq!(response.status(), 200, "{query}");
            let agents: Vec<AgentRecord> = response.json().await.expect("a list of AgentRecord");
            agents.into_iter().map(|a| a.agent_id).collect::<Vec<_>>()
        }
    };
    assert_eq!(ids("").await, ["a", "b", "c", "g@a"]);
    assert_eq!(ids("?capability=x").await, ["a", "b", "g@a"]);
    assert_eq!(ids("?capability=x&capability=y").await, ["a"]);
    assert_eq!(ids("?capability=x,y").await, ["a"]);
    assert_eq!(ids("?status=offline").await, ["c"]);
    assert_eq!(ids("?status=available&type=device").await, ["a", "b"]);
    assert_eq!(ids("?type=constellation").await, ["g@a"]);
    assert_eq!(ids("?limit=1").await, ["a"]);

    let bad = app
        .http
        .get(app.url("/api/agents?status=asleep"))
        .send()
        .await
        .expect("request");
    assert_eq!(bad.status(), 400);
    let body: Value = bad.json().await.expect("json");
    assert_eq!(body["error_code"], "INVALID_REQUEST");

    let one = app
        .http
        .get(app.url("/api/agents/g@a"))
        .send()
        .await
        .expect("request");
    assert_eq!(one.status(), 200);
    let record: AgentRecord = one.json().await.expect("AgentRecord");
    assert_eq!(record.target_id.as_deref(), Some("a"));
    // Ids with `/`, spaces and `%` travel percent-encoded.
    app.register(&device("odd/id 100%", "gw-1", "c-odd", "lab"))
        .await
        .expect("registered");
    let odd = app
        .http
        .get(app.url("/api/agents/odd%2Fid%20100%25"))
        .send()
        .await
        .expect("request");
    assert_eq!(odd.status(), 200);

    let missing = app
        .http
        .get(app.url("/api/agents/nobody"))
        .send()
        .await
        .expect("request");
    assert_eq!(missing.status(), 404);
    let body: Value = missing.json().await.expect("json");
    assert_eq!(body["error_code"], "NOT_FOUND");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("nobody")),
        "{body}"
    );
    assert_eq!(
        body.as_object().map(|o| o.len()),
        Some(2),
        "only detail and error_code: {body}"
    );
    app.stop().await;
}

async fn rest_requires_an_api_key(backend: Backend) {
    let app = TestApp::spawn(backend, Options::with_keys(&["k1", "k2"])).await;
    for path in [
        "/api/agents",
        "/api/agents/x",
        "/api/clients",
        "/api/health",
    ] {
        let missing = app.http.get(app.url(path)).send().await.expect("request");
        assert_eq!(missing.status(), 401, "{path}");
        let body: Value = missing.json().await.expect("json");
        assert!(
            body["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with("Missing API key")),
            "{body}"
        );
        assert_eq!(body["error_code"], "UNAUTHORIZED");

        let wrong = app
            .http
            .get(app.url(path))
            .header("X-API-Key", "nope")
            .send()
            .await
            .expect("request");
        assert_eq!(wrong.status(), 401, "{path}");
        let body: Value = wrong.json().await.expect("json");
        assert_eq!(body["detail"], "Invalid API key");

        let wrong_bearer = app
            .http
            .get(app.url(path))
            .bearer_auth("nope")
            .send()
            .await
            .expect("request");
        assert_eq!(wrong_bearer.status(), 401, "{path}");
    }
    let ok = app
        .http
        .get(app.url("/api/clients"))
        .header("X-API-Key", "k2")
        .send()
        .await
        .expect("request");
    assert_eq!(ok.status(), 200);
    let ok = app
        .http
        .get(app.url("/api/agents"))
        .bearer_auth("k1")
        .send()
        .await
        .expect("request");
    assert_eq!(ok.status(), 200);
    // Probes need no key.
    for path in ["/healthz", "/readyz"] {
        let probe = app.http.get(app.url(path)).send().await.expect("request");
        assert_eq!(probe.status(), 200, "{path}");
    }
    app.stop().await;
}

async fn replicas_share_the_queue_group(backend: Backend) {
    let mut app = TestApp::spawn(backend, Options::default()).await;
    let replica_http = app.spawn_replica().await;

    // 40 different principals race for one id: exactly one wins, on whichever replica.
    let attempts = futures::future::join_all((0..40).map(|i| {
        let app = &app;
        async move {
            app.register(&device(
                "contested",
                "gw-1",
                &format!("c{i}"),
                &format!("p{i}"),
            ))
            .await
        }
    }))
    .await;
    let winners: Vec<_> = attempts.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(
        winners.len(),
        1,
        "exactly one registration wins: {attempts:?}"
    );
    for refusal in attempts.iter().filter_map(|r| r.as_ref().err()) {
        assert_eq!(
            refusal.error_code,
            ErrorCode::RegistrationFailed,
            "{refusal:?}"
        );
    }
    assert_eq!(
        app.get("contested").await.expect("get").connection_id,
        winners[0].agent.connection_id
    );

    // Many distinct registrations at once: all succeed, once each.
    let results = futures::future::join_all((0..60).map(|i| {
        let app = &app;
        async move {
            app.register(&device(
                &format!("dev-{i}"),
                "gw-1",
                &format!("d{i}"),
                "lab",
            ))
            .await
        }
    }))
    .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(app.agent_rows().await, 61);

    // On NATS, check on the wire that each request gets exactly one reply (a request handled
    // by both replicas would be answered twice).
    if let Some(nats) = &app.nats {
        let client = nats.client();
        let inbox = format!("{}.test-inbox", app.subjects.prefix());
        let mut replies = client
            .subscribe(format!("{inbox}.*"))
            .await
            .expect("subscribe");
        client.flush().await.expect("flush");
        for i in 0..30 {
            let body = serde_json::to_vec(&json!({"version": 1, "agent_id": format!("dev-{i}")}))
                .expect("json");
            client
                .publish_with_reply(
                    app.subjects.registry_get(),
                    format!("{inbox}.{i}"),
                    body.into(),
                )
                .await
                .expect("publish");
        }
        let mut counts: HashMap<String, usize> = HashMap::new();
        for _ in 0..30 {
            let reply = within(WAIT, "the replies", replies.next())
                .await
                .expect("subscription open");
            let parsed: Reply<AgentRecord> = serde_json::from_slice(&reply.payload).expect("Reply");
            assert!(matches!(parsed, Reply::Ok(_)));
            *counts.entry(reply.subject.to_string()).or_default() += 1;
        }
        assert_eq!(counts.len(), 30, "every request answered");
        let extra = tokio::time::timeout(Duration::from_millis(500), replies.next()).await;
        assert!(extra.is_err(), "a request was answered twice: {extra:?}");
    }

    // Both replicas serve REST from the same database.
    let clients: Value = app
        .http
        .get(format!("http://{replica_http}/api/clients"))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json");
    assert_eq!(clients["online_clients"].as_array().map(Vec::len), Some(61));

    // One replica stops: the other takes every request.
    app.main.stop().await;
    for i in 0..10 {
        app.register(&device(
            &format!("late-{i}"),
            "gw-1",
            &format!("l{i}"),
            "lab",
        ))
        .await
        .expect("served by the replica");
    }
    app.stop().await;
}
