//! The session store, every function, on PostgreSQL and on SQLite.
//!
//! Rows are made the way the service makes them: tasks submitted to the leader's state
//! machine, whose batches the leader's writer commits. Every read is then checked against
//! what was written, with rows that match and rows that do not.

use aip_sessions::machine::{Machine, NewTask, Placement, Plan, Prepared, Requester};
use aip_sessions::outbox::{Split, Stored};
use aip_sessions::settings::SessionSettings;
use aip_sessions::store::ProcessedHalf;
use std::time::Duration;

use aip_sessions::store::{
    Batch, LeaseSpec, ListFilter, OutFrame, StoreError, TaskStore, Writer, now_ms,
};
use aip_store::testing::TestDatabase;
use aip_testkit::{Backend, both_backends, test_database};
use proto_schemas::sessions::TaskState;
use proto_schemas::{ClientType, Command, ErrorCode};
use serde_json::json;

fn scripted(steps: usize) -> Plan {
    let command: Command = serde_json::from_value(
        json!({ "tool_name": "echo", "tool_type": "action", "parameters": {"x": 1} }),
    )
    .expect("a command");
    Plan::Scripted(vec![vec![command]; steps])
}

fn new_task(id: &str, name: &str, requester: Requester, executor: &str, plan: Plan) -> Prepared {
    Prepared {
        new: NewTask {
            task_id: Some(id.to_owned()),
            task_name: Some(name.to_owned()),
            data: Some(json!({ "k": [1, 2] })),
            priority: 3,
            callback_url: Some("https://example.invalid/cb".to_owned()),
            // The store keeps whatever priority a task has; who may give it is not tested here.
            allowance: aip_sessions::machine::Allowance::Operator,
            ..NewTask::new(
                format!("do {id}"),
                requester,
                Placement::Target(executor.to_owned()),
                plan,
            )
        },
        candidates: vec![aip_testkit::device_record(executor)],
        existing_owner: None,
    }
}

fn lease(holder: &str, duration: Duration) -> LeaseSpec {
    LeaseSpec {
        name: "store-suite".to_owned(),
        holder: holder.to_owned(),
        duration,
    }
}

async fn lead(store: &TaskStore) -> Writer {
    let mut spare = None;
    store
        .try_lead(&lease("only", Duration::from_secs(30)), &mut spare)
        .await
        .expect("the database answers")
        .expect("nobody else leads")
}

/// The key of an outbox row: its frame's id, or its group's key.
fn key(stored: &Stored) -> String {
    match stored {
        Stored::Alone(frame) => frame.msg_id.clone(),
        Stored::Group { key, .. } => key.clone(),
    }
}

/// Every frame of the outbox rows, in their order.
fn frames_of(stored: &[Stored]) -> Vec<&OutFrame> {
    stored
        .iter()
        .flat_map(|row| match row {
            Stored::Alone(frame) => std::slice::from_ref(frame),
            Stored::Group { frames, .. } => frames.as_slice(),
        })
        .collect()
}

async fn commit(machine: &mut Machine, writer: &mut Writer) -> Batch {
    let pending = machine.take();
    writer
        .write(&pending.batch)
        .await
        .expect("the batch is written");
    machine.committed(&pending);
    pending.batch
}

/// A migrated test database, its store, the leader's writer and an empty state machine.
async fn leading(
    backend: Backend,
) -> (
    TestDatabase,
    aip_store::Database,
    TaskStore,
    Writer,
    Machine,
) {
    let db = test_database(backend).await.expect("a test database");
    let database = db.connect().await.expect("connects");
    database.migrate().await.expect("migrates");
    let store = TaskStore::new(database.clone());
    let writer = lead(&store).await;
    let machine = Machine::new(SessionSettings::default(), Vec::new());
    (db, database, store, writer, machine)
}

/// The constellation `galaxy` on its connection.
fn galaxy() -> Requester {
    Requester::Client {
        id: "galaxy".to_owned(),
        client_type: ClientType::Constellation,
        connection: Some("galaxy-connection".to_owned()),
        extensions: Vec::new(),
    }
}

async fn every_store_function(backend: Backend) {
    let (db, database, store, mut writer, mut machine) = leading(backend).await;

    // Three tasks on two devices: a constellation's scripted task (runs), a REST task queued
    // behind it, and a NATS driver task on another device; then the first is canceled.
    let constellation = galaxy();
    machine
        .submit(
            new_task("t1", "name-a", constellation, "d1", scripted(2)),
            Some("frame-1"),
        )
        .expect("t1 starts");
    machine
        .submit(
            new_task(
                "t2",
                "name-a",
                Requester::Rest("ops".into()),
                "d1",
                scripted(1),
            ),
            None,
        )
        .expect("t2 is queued");
    machine
        .submit(
            new_task(
                "t3",
                "name-b",
                Requester::Nats("agent".into()),
                "d2",
                Plan::Driver,
            ),
            None,
        )
        .expect("t3 starts");
    let first = commit(&mut machine, &mut writer).await;
    assert_eq!(first.tasks.len(), 3);
    assert!(
        !first.outbox.is_empty(),
        "the first step and the acknowledgement are queued"
    );

    // The written rows read back as the typed tasks the machine holds.
    for written in &first.tasks {
        let read = store
            .get(&written.task_id)
            .await
            .expect("get")
            .expect("found");
        assert_eq!(
            &read, &**written,
            "a task survives the round trip unchanged"
        );
    }
    assert!(store.get("nope").await.expect("get").is_none());
    let t1 = store.get("t1").await.expect("get").expect("t1");
    assert_eq!(t1.state(), TaskState::Working);
    assert_eq!(t1.requester.display(), "galaxy");
    let t3 = store.get("t3").await.expect("get").expect("t3");
    assert_eq!(t3.requester.display(), "nats:agent");
    assert_eq!(t3.plan, Plan::Driver);

    // Ending t1 dispatches t2; the error and its code are stored typed.
    machine.cancel("t1", "operator").expect("cancel");
    commit(&mut machine, &mut writer).await;
    let t1 = store.get("t1").await.expect("get").expect("t1");
    assert_eq!(t1.state(), TaskState::Canceled);
    let error = t1.error.expect("an error");
    assert_eq!(error.code, ErrorCode::TaskCanceled);
    assert_eq!(error.detail, "canceled: operator");
    assert_eq!(
        store.get("t2").await.expect("get").expect("t2").state(),
        TaskState::Working
    );

    // The newest task of a name.
    let named = store.get_by_name("name-a").await.expect("by name");
    assert!(named.is_some_and(|t| t.task_name == "name-a"));
    assert!(
        store
            .get_by_name("name-z")
            .await
            .expect("by name")
            .is_none()
    );

    // Listing: filters, and pages that together hold every row once.
    let all = |f: ListFilter| ListFilter { limit: 10, ..f };
    let ids = |tasks: Vec<aip_sessions::task::Task>| {
        tasks.into_iter().map(|t| t.task_id).collect::<Vec<_>>()
    };
    assert_eq!(
        ids(store
            .list(all(ListFilter {
                state: Some(TaskState::Canceled),
                ..ListFilter::default()
            }))
            .await
            .expect("list")),
        ["t1"]
    );
    assert_eq!(
        ids(store
            .list(all(ListFilter {
                executor: Some("d2".into()),
                ..ListFilter::default()
            }))
            .await
            .expect("list")),
        ["t3"]
    );
    assert_eq!(
        ids(store
            .list(all(ListFilter {
                requester: Some("ops".into()),
                ..ListFilter::default()
            }))
            .await
            .expect("list")),
        ["t2"]
    );
    let mut by_name = ids(store
        .list(all(ListFilter {
            task_name: Some("name-a".into()),
            ..ListFilter::default()
        }))
        .await
        .expect("list"));
    by_name.sort();
    assert_eq!(by_name, ["t1", "t2"]);
    assert!(
        store
            .list(all(ListFilter {
                state: Some(TaskState::Completed),
                ..ListFilter::default()
            }))
            .await
            .expect("list")
            .is_empty()
    );
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = store
            .list(ListFilter {
                cursor: cursor.clone(),
                limit: 2,
                ..ListFilter::default()
            })
            .await
            .expect("a page");
        let Some(last) = page.last() else { break };
        cursor = Some((last.created_ms, last.task_id.clone()));
        let full = page.len() == 2;
        seen.extend(ids(page));
        if !full {
            break;
        }
    }
    seen.sort();
    assert_eq!(seen, ["t1", "t2", "t3"], "paging returns every task once");

    // Events: gap-free, after a sequence number, at most a limit.
    let events = store.events("t1", 0, 100).await.expect("events");
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert_eq!(events[0].kind, "submitted");
    assert_eq!(events.last().expect("one").state, TaskState::Canceled);
    let later = store.events("t1", 2, 1).await.expect("events");
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].seq, 3);
    assert!(
        store
            .events("nope", 0, 10)
            .await
            .expect("events")
            .is_empty()
    );

    // Owners, one and many.
    assert_eq!(
        store.owner("t1").await.expect("owner").as_deref(),
        Some("galaxy")
    );
    assert_eq!(store.owner("nope").await.expect("owner"), None);
    let owners = store
        .owners(&["t2".to_owned(), "t3".to_owned(), "nope".to_owned()])
        .await
        .expect("owners");
    assert_eq!(owners.len(), 2);
    assert_eq!(owners["t2"], "ops");
    assert_eq!(owners["t3"], "agent");

    // Every task id, page by page: each page starts at the last id of the one before (the
    // leader's filter of known ids is built so).
    let first = store.task_ids_from("", 2).await.expect("task ids");
    assert_eq!(first, ["t1", "t2"]);
    let next = store.task_ids_from("t2", 2).await.expect("task ids");
    assert_eq!(next, ["t2", "t3"]);
    let last = store.task_ids_from("t3", 2).await.expect("task ids");
    assert_eq!(last, ["t3"], "the last page is short");

    // A frame applied is recognised (the redelivery check), an unknown one is not.
    assert!(store.processed("frame-1").await.expect("processed"));
    assert!(!store.processed("frame-2").await.expect("processed"));

    // The outbox: a row older than the cut is returned until it is marked published.
    let stale = store
        .stale_outbox(now_ms() + 60_000, &[], 100)
        .await
        .expect("stale outbox");
    assert!(!stale.is_empty(), "unpublished frames are found");
    // Frames published a moment ago (their acknowledgement may be on its way) are left out.
    let just_published: Vec<String> = stale.iter().map(key).collect();
    assert!(
        store
            .stale_outbox(now_ms() + 60_000, &just_published, 100)
            .await
            .expect("stale outbox")
            .is_empty(),
        "frames in the list are not sent again"
    );
    let but_first = store
        .stale_outbox(now_ms() + 60_000, &just_published[1..], 100)
        .await
        .expect("stale outbox");
    assert_eq!(
        but_first.iter().map(key).collect::<Vec<_>>(),
        vec![just_published[0].clone()],
        "only the frames in the list are left out"
    );
    assert!(
        store
            .stale_outbox(0, &[], 100)
            .await
            .expect("stale outbox")
            .is_empty(),
        "nothing is older than the epoch"
    );
    let published: Vec<String> = stale.iter().map(key).collect();
    machine.published(published);
    // A new period: ids go to the other half; those of the first stay until its turn comes
    // round again, and then they are forgotten.
    let first = ProcessedHalf::at(now_ms());
    let other = match first {
        ProcessedHalf::A => ProcessedHalf::B,
        ProcessedHalf::B => ProcessedHalf::A,
    };
    machine.processed_into(other);
    machine
        .submit(
            new_task("t9", "n", galaxy(), "d9", scripted(1)),
            Some("frame-9"),
        )
        .expect("t9 starts");
    commit(&mut machine, &mut writer).await;
    assert!(
        store
            .stale_outbox(now_ms() + 60_000, &[], 100)
            .await
            .expect("stale outbox")
            .iter()
            .all(|row| key(row).ends_with(":frames")),
        "published rows leave the outbox (t9's frames are new)"
    );
    for id in ["frame-1", "frame-9"] {
        assert!(
            store.processed(id).await.expect("processed"),
            "{id} is known"
        );
    }
    machine.processed_into(first);
    commit(&mut machine, &mut writer).await;
    assert!(
        !store.processed("frame-1").await.expect("processed"),
        "ids of two periods ago are forgotten"
    );
    assert!(store.processed("frame-9").await.expect("processed"));

    // A new leader takes over the live tasks only, as they were.
    let live = writer.load_live().await.expect("live");
    let mut live_ids: Vec<&str> = live.iter().map(|t| t.task_id.as_str()).collect();
    live_ids.sort();
    assert_eq!(live_ids, ["t2", "t3", "t9"]);

    drop(writer);
    database.close().await;
    db.cleanup().await;
}

both_backends!(every_store_function);

/// Tries to lead until it does, at most `within`.
async fn lead_within(
    store: &TaskStore,
    lease: &LeaseSpec,
    spare: &mut Option<sqlx::PgConnection>,
    within: Duration,
) -> Option<Writer> {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if let Some(writer) = store
            .try_lead(lease, spare)
            .await
            .expect("the database answers")
        {
            return Some(writer);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_one_replica_leads_on_postgres() {
    let db = TestDatabase::postgres().await.expect("a test database");
    let database = db.connect().await.expect("connects");
    database.migrate().await.expect("migrates");
    let store = TaskStore::new(database.clone());
    let short = Duration::from_millis(1500);
    let (a, b) = (lease("a", short), lease("b", short));
    let mut a_spare = None;
    let mut leader = store
        .try_lead(&a, &mut a_spare)
        .await
        .expect("the database answers")
        .expect("nobody leads yet");
    let mut spare = None;
    let second = store
        .try_lead(&b, &mut spare)
        .await
        .expect("the database answers");
    assert!(second.is_none(), "the lease is held");
    assert!(spare.is_some(), "the standby keeps its connection");

    // A leader that renews keeps the lease past its length.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        leader.renew_if_due().await.expect("still leading");
    }
    assert!(
        store
            .try_lead(&b, &mut spare)
            .await
            .expect("the database answers")
            .is_none(),
        "renewed: still held after more than one lease"
    );

    // A leader that stops renewing (frozen) loses it within a lease; its next write fails.
    let mut taken = lead_within(&store, &b, &mut spare, Duration::from_secs(5))
        .await
        .expect("the standby leads once the lease ran out");
    let mut machine = Machine::new(SessionSettings::default(), Vec::new());
    machine
        .submit(
            new_task(
                "fenced",
                "n",
                Requester::Rest("ops".into()),
                "d1",
                scripted(1),
            ),
            None,
        )
        .expect("accepted");
    let pending = machine.take();
    let refused = leader
        .write(&pending.batch)
        .await
        .expect_err("the old term writes nothing");
    // Fenced by the lease, or its session already ended by the standby that took over.
    assert!(
        matches!(
            refused,
            StoreError::LeaseLost { .. } | StoreError::Database(_)
        ),
        "{refused}"
    );
    assert!(store.get("fenced").await.expect("reads").is_none());
    taken
        .write(&pending.batch)
        .await
        .expect("the new term writes");
    assert!(store.get("fenced").await.expect("reads").is_some());

    // A graceful stop hands the lease over at once.
    taken.resign().await;
    drop(taken);
    let mut c_spare = None;
    assert!(
        store
            .try_lead(&lease("c", short), &mut c_spare)
            .await
            .expect("the database answers")
            .is_some(),
        "resigned: taken at the first try"
    );
    drop(leader);
    database.close().await;
    db.cleanup().await;
}

/// A leader frozen in the middle of a transaction keeps the lease row locked (PostgreSQL's
/// idle-in-transaction timeout does not cover a half-sent statement). A standby ends that
/// database session once the lease ran out, and takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_leader_frozen_mid_transaction() {
    use sqlx::Connection;
    let db = TestDatabase::postgres().await.expect("a test database");
    let database = db.connect().await.expect("connects");
    database.migrate().await.expect("migrates");
    let store = TaskStore::new(database.clone());
    let short = Duration::from_millis(1500);
    let mut a_spare = None;
    let leader = store
        .try_lead(&lease("a", short), &mut a_spare)
        .await
        .expect("the database answers")
        .expect("nobody leads yet");
    // The frozen leader, as the database sees it: a session of the lease's holder with the
    // row locked in an open transaction, which never sends anything again.
    let aip_store::Database::Postgres(pool) = &database else {
        unreachable!("a PostgreSQL database")
    };
    let mut frozen = pool.acquire().await.expect("a connection").detach();
    sqlx::query(
        "UPDATE session_leader SET holder_pid = pg_backend_pid(), \
         holder_backend_start = (SELECT backend_start FROM pg_stat_activity \
             WHERE pid = pg_backend_pid()) WHERE name = 'store-suite'",
    )
    .execute(&mut frozen)
    .await
    .expect("the frozen session holds the lease");
    let mut tx = frozen.begin().await.expect("begins");
    sqlx::query("UPDATE session_leader SET expires_ms = expires_ms WHERE name = 'store-suite'")
        .execute(&mut *tx)
        .await
        .expect("locks the row");
    let mut spare = None;
    let taken = lead_within(
        &store,
        &lease("b", short),
        &mut spare,
        Duration::from_secs(10),
    )
    .await;
    assert!(
        taken.is_some(),
        "the standby ended the frozen session and leads"
    );
    assert!(
        sqlx::query("SELECT 1").execute(&mut *tx).await.is_err(),
        "the frozen session was ended"
    );
    drop((leader, taken, tx));
    database.close().await;
    db.cleanup().await;
}

/// A group that fails (here: an event that is already written) writes none of its changes,
/// and the leader's connection takes the next group as if nothing had happened.
async fn a_failed_group_writes_nothing_and_the_next_one_is_written(backend: Backend) {
    let (db, _database, store, mut writer, mut machine) = leading(backend).await;
    machine
        .submit(
            new_task(
                "first",
                "n",
                Requester::Rest("ops".into()),
                "d1",
                scripted(1),
            ),
            None,
        )
        .expect("starts");
    let written = commit(&mut machine, &mut writer).await;

    machine
        .submit(
            new_task(
                "second",
                "n",
                Requester::Rest("ops".into()),
                "d2",
                scripted(1),
            ),
            None,
        )
        .expect("starts");
    let mut failing = machine.take();
    failing.batch.events.push(written.events[0].clone());
    writer
        .write(&failing.batch)
        .await
        .expect_err("an event written twice fails the group");
    assert!(
        store.get("second").await.expect("reads").is_none(),
        "nothing of the failed group is written"
    );

    failing.batch.events.pop();
    writer
        .write(&failing.batch)
        .await
        .expect("the writer takes the next group");
    assert!(store.get("second").await.expect("reads").is_some());
    assert_eq!(
        store.events("second", 0, 10).await.expect("events").len(),
        failing.batch.events.len()
    );
    drop(writer);
    db.cleanup().await;
}

both_backends!(a_failed_group_writes_nothing_and_the_next_one_is_written);

/// Groups of every size are written whole and nothing else: on SQLite a group is padded to one
/// of a few statement sizes (up to 256 rows per table) with rows that must not be written,
/// and a larger group is written in slices.
async fn groups_of_every_size_are_written_whole(backend: Backend) {
    let (db, _database, store, mut writer, mut machine) = leading(backend).await;
    let mut ids = Vec::new();
    let mut events = 0;
    let mut outbox = 0;
    for size in [1usize, 4, 5, 17, 64, 65, 300] {
        for i in 0..size {
            let id = format!("g{size}-{i}");
            machine
                .submit(
                    new_task(
                        &id,
                        "n",
                        Requester::Rest("ops".into()),
                        &format!("d{size}-{i}"),
                        scripted(1),
                    ),
                    None,
                )
                .expect("starts");
            ids.push(id);
        }
        let batch = commit(&mut machine, &mut writer).await;
        assert_eq!(batch.tasks.len(), size, "a group of {size} tasks");
        events += batch.events.len();
        outbox += batch.outbox.len();
    }
    let listed = store
        .list(ListFilter {
            limit: 10_000,
            ..ListFilter::default()
        })
        .await
        .expect("lists");
    let mut listed: Vec<String> = listed.into_iter().map(|t| t.task_id).collect();
    listed.sort();
    ids.sort();
    assert_eq!(listed, ids, "every task once, and no other row");
    let mut stored_events = 0;
    for id in &ids {
        let task_events = store.events(id, 0, 100).await.expect("events");
        assert!(!task_events.is_empty(), "{id} has its events");
        stored_events += task_events.len();
    }
    assert_eq!(stored_events, events, "every event once");
    let stored = store
        .stale_outbox(now_ms() + 60_000, &[], 10_000)
        .await
        .expect("reads the outbox");
    let frames = frames_of(&stored);
    assert_eq!(frames.len(), outbox, "every outgoing frame once");
    let mut ids: Vec<&str> = frames.iter().map(|f| f.msg_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), outbox, "each with its own id");
    drop(writer);
    db.cleanup().await;
}

both_backends!(groups_of_every_size_are_written_whole);

/// A client's NUL (which PostgreSQL's text and jsonb refuse) is stored as U+FFFD, so it cannot
/// fail the group commit it shares with other clients' changes.
async fn text_with_nul_is_stored(backend: Backend) {
    let (db, database, store, mut writer, mut machine) = leading(backend).await;
    let mut nul = new_task(
        "nul",
        "nul",
        Requester::Rest("ops".into()),
        "d1",
        scripted(1),
    );
    nul.new.request = "open\0notepad".to_owned();
    nul.new.data = Some(json!({ "k\0": ["v\0"] }));
    machine.submit(nul, None).expect("starts");
    machine
        .submit(
            new_task(
                "other",
                "other",
                Requester::Rest("ops".into()),
                "d2",
                scripted(1),
            ),
            None,
        )
        .expect("starts");
    commit(&mut machine, &mut writer).await;
    let stored = store.get("nul").await.expect("get").expect("stored");
    assert_eq!(stored.request, "open\u{FFFD}notepad");
    assert_eq!(stored.data, Some(json!({ "k\u{FFFD}": ["v\u{FFFD}"] })));
    assert!(
        store.get("other").await.expect("get").is_some(),
        "the rest of the group is written"
    );
    drop(writer);
    database.close().await;
    db.cleanup().await;
}

both_backends!(text_with_nul_is_stored);

/// A large `task_end` is stored as a reference to its task (whose row holds the result), for
/// the requester and the executor alike, and is built again, whole, when it must be re-sent.
async fn a_large_task_end_is_stored_once(backend: Backend) {
    let (db, database, store, mut writer, mut machine) = leading(backend).await;
    let constellation = galaxy();
    machine
        .submit(
            new_task("big", "big", constellation, "d1", Plan::Driver),
            None,
        )
        .expect("starts");
    commit(&mut machine, &mut writer).await;
    let screenshot = "A".repeat(512 * 1024);
    machine
        .complete("big", Some(json!({ "png": screenshot })), None)
        .expect("completes");
    let ended = commit(&mut machine, &mut writer).await;
    assert_eq!(
        ended.outbox.len(),
        2,
        "to the requester and to the executor"
    );

    let largest = number(
        &database,
        "SELECT CAST(COALESCE(MAX(LENGTH(payload)), 0) AS BIGINT) FROM task_outbox",
    )
    .await;
    assert!(largest < 1024, "an outbox payload holds {largest} bytes");

    let resent = store
        .stale_outbox(now_ms() + 60_000, &[], 100)
        .await
        .expect("stale outbox");
    let resent = frames_of(&resent);
    let frames: Vec<serde_json::Value> = resent
        .iter()
        .filter(|f| f.task_end_of.is_some())
        .map(|f| serde_json::from_slice(&f.payload).expect("a frame"))
        .collect();
    assert_eq!(frames.len(), 2, "{resent:?}");
    for frame in &frames {
        assert_eq!(frame["type"], "task_end");
        assert_eq!(frame["status"], "completed");
        assert_eq!(frame["session_id"], "big");
        assert_eq!(
            frame["result"]["png"].as_str().map(str::len),
            Some(screenshot.len())
        );
    }
    assert_eq!(
        frames[0]["response_id"], frames[1]["response_id"],
        "both are the same task_end"
    );
    let mut clients: Vec<&str> = resent.iter().map(|f| f.client_id.as_str()).collect();
    clients.sort_unstable();
    clients.dedup();
    assert_eq!(clients, ["d1", "galaxy"]);
    db.cleanup().await;
}
both_backends!(a_large_task_end_is_stored_once);

/// A device's `command_results` frame on its connection, answering `response_id`.
fn results_frame(
    session: &str,
    response_id: &str,
    result: serde_json::Value,
) -> proto_schemas::sessions::InboundFrame {
    let frame = json!({
        "type": "command_results", "status": "continue", "client_type": "device",
        "client_id": "d1", "session_id": session, "prev_response_id": response_id,
        "action_results": [{ "status": "success", "result": result }],
    });
    serde_json::from_value(json!({
        "version": 1, "gateway_id": "gw", "connection_id": "d1-connection", "client_id": "d1",
        "client_type": "device", "platform": "linux", "received_at": "2026-11-26T00:00:00Z",
        "frame": frame,
    }))
    .expect("an inbound frame")
}

/// The device answers the command its task waits for (frame `msg_id`) with `result`, and
/// the group is committed.
async fn answer(
    store: &TaskStore,
    machine: &mut Machine,
    writer: &mut Writer,
    task_id: &str,
    msg_id: &str,
    result: serde_json::Value,
) {
    let task = store.get(task_id).await.expect("get").expect("stored");
    let awaited = task.waiting.response_id().expect("waiting for results");
    machine
        .frame(
            &mut results_frame(task_id, awaited, result),
            msg_id,
            None,
            None,
        )
        .expect("results applied");
    commit(machine, writer).await;
}

/// The one number a query (the same text on both databases) answers.
/// Starts tasks `t1`…`tn`, one step each on devices `d1`…`dn`, in one group commit; the
/// frames it sent.
async fn start_one_step_tasks(
    machine: &mut Machine,
    writer: &mut Writer,
    n: usize,
) -> Vec<OutFrame> {
    for i in 1..=n {
        machine
            .submit(
                new_task(
                    &format!("t{i}"),
                    "n",
                    Requester::Rest("ops".into()),
                    &format!("d{i}"),
                    scripted(1),
                ),
                None,
            )
            .expect("starts");
    }
    commit(machine, writer).await.outbox
}

/// The small frames of a group commit are stored in one row. A stale group is split: its
/// frames not acknowledged are written again, each in a row of its own with its id and bytes,
/// and the group's row is deleted, in one transaction.
async fn a_group_of_frames_is_stored_in_one_row_and_split_when_stale(backend: Backend) {
    let (db, database, store, mut writer, mut machine) = leading(backend).await;
    let sent = start_one_step_tasks(&mut machine, &mut writer, 3).await;
    assert_eq!(sent.len(), 3, "a command for each device");
    assert_eq!(
        number(&database, "SELECT COUNT(*) FROM task_outbox").await,
        1,
        "one row"
    );

    let stored = store
        .stale_outbox(now_ms() + 60_000, &[], 100)
        .await
        .expect("stale outbox");
    let [Stored::Group { key, frames }] = stored.as_slice() else {
        panic!("one group: {stored:?}");
    };
    assert_eq!(key, &format!("{}:frames", sent[0].msg_id));
    assert_eq!(frames.len(), 3);
    for (read, written) in frames.iter().zip(&sent) {
        assert_eq!(read.msg_id, written.msg_id);
        assert_eq!(read.client_id, written.client_id);
        assert_eq!(read.connection, written.connection);
        assert_eq!(read.payload, written.payload, "byte for byte");
    }

    // The first frame was acknowledged; the other two are not.
    machine.split(vec![Split {
        key: key.clone(),
        frames: frames[1..].to_vec(),
    }]);
    commit(&mut machine, &mut writer).await;
    let stored = store
        .stale_outbox(now_ms() + 60_000, &[], 100)
        .await
        .expect("stale outbox");
    let alone: Vec<&OutFrame> = stored
        .iter()
        .map(|row| match row {
            Stored::Alone(frame) => frame,
            Stored::Group { key, .. } => panic!("the group {key} is still there"),
        })
        .collect();
    let ids: Vec<&str> = alone.iter().map(|f| f.msg_id.as_str()).collect();
    assert_eq!(ids, [sent[1].msg_id.as_str(), sent[2].msg_id.as_str()]);
    for (read, written) in alone.iter().zip(&sent[1..]) {
        assert_eq!(read.payload, written.payload, "byte for byte");
        assert_eq!(read.connection, written.connection);
    }

    // Acknowledged, they go too.
    machine.published(ids.iter().map(|id| id.to_string()));
    commit(&mut machine, &mut writer).await;
    assert_eq!(
        number(&database, "SELECT COUNT(*) FROM task_outbox").await,
        0
    );
    db.cleanup().await;
}
both_backends!(a_group_of_frames_is_stored_in_one_row_and_split_when_stale);

/// On PostgreSQL a group's row is stored compressed: the frames of 100 tasks (their field
/// names repeated in every frame) take less than a third of their bytes in the table, and
/// read back byte for byte. Uncompressed, the row was a fifth of the WAL a task writes.
#[tokio::test]
async fn a_group_of_frames_is_stored_compressed_on_postgres() {
    let (db, database, store, mut writer, mut machine) = leading(Backend::NatsPostgres).await;
    let sent = start_one_step_tasks(&mut machine, &mut writer, 100).await;
    assert_eq!(sent.len(), 100, "a command for each device");
    let plain = number(
        &database,
        "SELECT octet_length(payload)::bigint FROM task_outbox",
    )
    .await;
    let stored = number(
        &database,
        "SELECT pg_column_size(payload)::bigint FROM task_outbox",
    )
    .await;
    assert!(
        stored * 3 < plain,
        "{plain} bytes of frames take {stored} bytes in the table"
    );

    let read = store
        .stale_outbox(now_ms() + 60_000, &[], 100)
        .await
        .expect("stale outbox");
    let [Stored::Group { frames, .. }] = read.as_slice() else {
        panic!("one group: {read:?}");
    };
    assert_eq!(frames.len(), sent.len());
    for (read, written) in frames.iter().zip(&sent) {
        assert_eq!(read.msg_id, written.msg_id);
        assert_eq!(read.payload, written.payload, "byte for byte");
    }
    db.cleanup().await;
}

/// An outbox row written before rows named their client (it names the per-client subject it
/// was to be published on) is sent again to that client; a new row names its client.
async fn outbox_rows_from_before_the_client_column_are_sent_to_their_client(backend: Backend) {
    let (_db, database, store, mut writer, mut machine) = leading(backend).await;
    let frame = br#"{"type":"heartbeat","status":"ok"}"#;
    let payload = match backend {
        Backend::NatsPostgres => format!("'\\x{}'::bytea", hex(frame)),
        Backend::LocalSqlite => format!("X'{}'", hex(frame)),
    };
    let legacy = format!(
        "INSERT INTO task_outbox (msg_id, subject, connection_id, payload, payload_kind, \
         created_ms) VALUES ('legacy-1', 't1.aip.deliver.pc~2E1', NULL, {payload}, 'frame', 1)"
    );
    database
        .query(&aip_store::Sql::render(|_| legacy.clone()))
        .execute()
        .await
        .expect("a row as an earlier version wrote it");
    machine
        .submit(new_task("t1", "t1", galaxy(), "d1", scripted(1)), None)
        .expect("starts");
    commit(&mut machine, &mut writer).await;

    let resent = store
        .stale_outbox(now_ms() + 60_000, &[], 100)
        .await
        .expect("stale outbox");
    let resent = frames_of(&resent);
    let legacy = resent
        .iter()
        .find(|f| f.msg_id == "legacy-1")
        .expect("the earlier row");
    assert_eq!(legacy.client_id, "pc.1");
    assert_eq!(legacy.payload.as_ref(), frame);
    let mut clients: Vec<&str> = resent.iter().map(|f| f.client_id.as_str()).collect();
    clients.sort_unstable();
    assert_eq!(clients, ["d1", "galaxy", "pc.1"], "{resent:?}");
}
both_backends!(outbox_rows_from_before_the_client_column_are_sent_to_their_client);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn number(database: &aip_store::Database, sql: &str) -> i64 {
    let (n,): (i64,) = database
        .query(&aip_store::Sql::render(|_| sql.to_owned()))
        .fetch_one()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    n
}

/// The parts of a task's results kept apart (PostgreSQL).
async fn parts_kept_apart(database: &aip_store::Database, task_id: &str) -> i64 {
    let sql = format!("SELECT COUNT(*) FROM task_results WHERE task_id = '{task_id}'");
    number(database, &sql).await
}

/// Results over 1 MiB are written apart from their task's row on PostgreSQL (the row holds a
/// marker), and every read puts them back whole: the task, its result, its events, and a new
/// leader's live tasks. On SQLite they stay in the row; the reads are the same.
async fn large_results_are_kept_apart_and_read_back_whole(backend: Backend) {
    let (db, database, store, mut writer, mut machine) = leading(backend).await;
    machine
        .submit(new_task("shot", "shot", galaxy(), "d1", scripted(2)), None)
        .expect("starts");
    commit(&mut machine, &mut writer).await;
    // 1.5 MiB that no shortcut could fake: every line numbered.
    let screenshot: String = (0..48_000).map(|i| format!("{i:031}\n")).collect();
    let png = json!({ "png": screenshot });
    answer(&store, &mut machine, &mut writer, "shot", "m1", png).await;

    let postgres = matches!(backend, Backend::NatsPostgres);
    let row_bytes = number(
        &database,
        "SELECT CAST(LENGTH(CAST(history AS TEXT)) AS BIGINT) FROM tasks WHERE task_id = 'shot'",
    )
    .await;
    if postgres {
        assert!(
            row_bytes < 4096,
            "the row's history holds {row_bytes} bytes"
        );
        assert_eq!(
            parts_kept_apart(&database, "shot").await,
            2,
            "1.5 MiB in parts of 1 MiB"
        );
    } else {
        assert!(row_bytes > screenshot.len() as i64, "{row_bytes}");
    }

    // A new leader's live tasks hold the results whole (and the writer remembers where they
    // are, so the next group does not write them again).
    let live = writer.load_live().await.expect("live tasks");
    let shot = live.iter().find(|t| t.task_id == "shot").expect("live");
    assert_eq!(
        shot.history[0]["results"][0]["result"]["png"].as_str(),
        Some(screenshot.as_str())
    );

    let ok = json!({ "ok": true });
    answer(&store, &mut machine, &mut writer, "shot", "m2", ok).await;

    let done = store.get("shot").await.expect("get").expect("stored");
    assert_eq!(done.state(), TaskState::Completed);
    assert_eq!(done.history.len(), 2);
    assert_eq!(
        done.history[0]["results"][0]["result"]["png"].as_str(),
        Some(screenshot.as_str())
    );
    assert_eq!(
        done.history[1]["results"][0]["result"],
        json!({ "ok": true })
    );
    assert_eq!(
        done.result_value(),
        Some(serde_json::Value::Array(done.history.clone()))
    );
    let by_name = store
        .get_by_name("shot")
        .await
        .expect("get by name")
        .expect("stored");
    assert_eq!(by_name.history, done.history);
    let listed = store
        .list(ListFilter {
            limit: 10,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    let listed = listed.iter().find(|t| t.task_id == "shot").expect("listed");
    assert_eq!(listed.history, done.history);
    let events = store.events("shot", 0, 100).await.expect("events");
    let received = events
        .iter()
        .find(|e| e.kind == "results_received")
        .expect("results event");
    assert_eq!(
        received.data.as_ref().map(|d| &d["results"]),
        Some(&done.history[0]["results"])
    );
    if postgres {
        assert_eq!(
            parts_kept_apart(&database, "shot").await,
            2,
            "written once, whatever the groups after"
        );
    }
    db.cleanup().await;
}
both_backends!(large_results_are_kept_apart_and_read_back_whole);

/// A part missing from under a marker is a clear error on read, not a task with a hole.
async fn a_missing_part_of_kept_apart_results_is_reported(backend: Backend) {
    let (db, database, store, mut writer, mut machine) = leading(backend).await;
    machine
        .submit(new_task("lost", "lost", galaxy(), "d1", scripted(2)), None)
        .expect("starts");
    commit(&mut machine, &mut writer).await;
    let png = json!({ "png": "Q".repeat(1536 * 1024) });
    answer(&store, &mut machine, &mut writer, "lost", "m1", png).await;
    assert_eq!(parts_kept_apart(&database, "lost").await, 2);
    database
        .query(&aip_store::Sql::same(
            "DELETE FROM task_results WHERE part = 1",
        ))
        .execute()
        .await
        .expect("parts deleted");
    match store.get("lost").await {
        Err(StoreError::Corrupt {
            task_id, column, ..
        }) => {
            assert_eq!((task_id.as_str(), column), ("lost", "task_results.body"));
        }
        other => panic!("expected a corrupt-row error, got {other:?}"),
    }
    db.cleanup().await;
}

#[tokio::test]
async fn a_missing_part_of_kept_apart_results_is_reported_postgres() {
    a_missing_part_of_kept_apart_results_is_reported(Backend::NatsPostgres).await;
}
