//! A registry that restarts delays the tasks that need it; it does not refuse them.

use aip_bus::{Headers, respond};
use aip_sessions::callbacks::Callbacks;
use aip_sessions::engine::{Engine, NewTask, Placement, Plan, Requester};
use aip_sessions::planners::Planners;
use aip_sessions::settings::SessionSettings;
use aip_sessions::store::TaskStore;
use aip_testkit::{Backend, Infra, both_backends, within};
use futures::StreamExt;
use proto_schemas::Subjects;
use proto_schemas::registry::Reply;
use std::time::Duration;

async fn a_task_waits_for_a_registry_that_comes_back(backend: Backend) {
    let infra = Infra::start(backend).await.expect("infra");
    let db = infra.connect_db().await.expect("database");
    db.migrate().await.expect("migrations");
    let subjects = Subjects::new(&infra.prefix).expect("prefix");
    let (engine, _applier) = Engine::new(
        TaskStore::new(db.clone()),
        infra.bus.clone(),
        subjects.clone(),
        SessionSettings::default(),
        Planners::new(&SessionSettings::default(), &|_| None).expect("planners"),
        Callbacks::new(&SessionSettings::default()).expect("callbacks"),
    );

    // No registry runs when the task arrives; one starts a second and a half later.
    let bus = infra.bus.clone();
    let registry = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let mut requests = bus
            .queue_subscribe(subjects.registry_get(), "registry".to_owned())
            .await
            .expect("subscribed");
        let request = requests.next().await.expect("a request");
        let reply =
            serde_json::to_vec(&Reply::Ok(aip_testkit::device_record("pc"))).expect("encodes");
        respond(bus.as_ref(), &request, Headers::new(), reply.into())
            .await
            .expect("answered");
    });

    let new = NewTask::new(
        "do it".to_owned(),
        Requester::Rest("ops".to_owned()),
        Placement::Target("pc".to_owned()),
        Plan::Driver,
    );
    let prepared = within(
        Duration::from_secs(15),
        "the task prepared",
        engine.prepare(new),
    )
    .await
    .expect("the task is prepared once the registry is back, not refused");
    assert_eq!(prepared.candidates.len(), 1);
    assert_eq!(prepared.candidates[0].agent_id, "pc");
    registry.await.expect("the registry answered");
    db.close().await;
    infra.cleanup().await;
}

both_backends!(a_task_waits_for_a_registry_that_comes_back);
