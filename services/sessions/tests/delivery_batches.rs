//! Frames travel together both ways: those one group commit releases for clients of the same
//! gateway reach it as one delivery batch, and (on NATS) those a gateway's clients send while
//! one is on its way to the frames stream are stored as one `frames_many` event. Each client
//! still receives exactly its own frames: many constellations on one gateway drive their
//! devices at once, and every task ends completed with its own `task_end`.

use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register, one_step,
};
use aip_testkit::{Backend, Client, Options, Stack, both_backends};
use serde_json::json;

mod common;
use common::metric;

const PAIRS: usize = 16;

async fn frames_of_one_group_travel_together(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let url = stack.ws_url(0);
    let mut devices = Vec::new();
    let mut galaxies = Vec::new();
    for i in 0..PAIRS {
        let device = format!("batch-pc-{i}");
        devices.push(Client::registered(&url, device_register(&device, "linux")).await);
        stack.wait_online(&device).await;
        let galaxy = format!("batch-galaxy-{i}");
        galaxies
            .push(Client::registered(&url, constellation_register(&galaxy, Some(&device))).await);
    }

    let sessions = stack.sessions_url();
    let mut rounds = 0;
    loop {
        rounds += 1;
        // Every constellation asks at once, so their commands are released together.
        for (i, galaxy) in galaxies.iter_mut().enumerate() {
            let task = constellation_task(
                &format!("batch-galaxy-{i}"),
                &format!("batch-pc-{i}"),
                &format!("batch-r{rounds}-{i}"),
                "t",
                Some(one_step("echo", json!({ "pair": i }))),
            );
            galaxy.send(&task).await.expect("task");
        }
        for (i, device) in devices.iter_mut().enumerate() {
            let command = device.recv_type("command").await.expect("a command");
            assert_eq!(
                command["session_id"],
                format!("batch-r{rounds}-{i}"),
                "each device gets its own task's command"
            );
            let actions = command["actions"].to_string();
            assert!(actions.contains(&format!("\"pair\":{i}")), "{actions}");
            device
                .send(&command_results_for(&format!("batch-pc-{i}"), &command))
                .await
                .expect("results");
        }
        for (i, galaxy) in galaxies.iter_mut().enumerate() {
            let end = galaxy.recv_type("task_end").await.expect("a task_end");
            assert_eq!(end["session_id"], format!("batch-r{rounds}-{i}"));
            assert_eq!(end["status"], "completed", "{end}");
        }
        let in_batches = metric(
            &sessions,
            "aip_sessions_frames_published_total{form=\"batched\"}",
        )
        .await;
        // The gateway runs in this process: its metrics are served with the session service's.
        // On the in-process bus it stores every frame alone.
        let stored = metric(&sessions, "aip_gateway_frames_stored_total").await;
        let events = metric(&sessions, "aip_gateway_frame_events_total").await;
        let gathered = match backend {
            Backend::NatsPostgres => stored > events,
            Backend::LocalSqlite => true,
        };
        if (in_batches > 0.0 && gathered) || rounds == 20 {
            let batches = metric(&sessions, "aip_sessions_delivery_batches_total").await;
            assert!(
                in_batches >= 2.0 * batches && batches >= 1.0,
                "after {rounds} rounds of {PAIRS} tasks at once: {in_batches} frames in {batches} batches"
            );
            assert!(
                gathered && events >= 1.0,
                "after {rounds} rounds of {PAIRS} tasks at once: {stored} frames stored in {events} stream messages"
            );
            break;
        }
    }
    stack.stop().await;
}
both_backends!(frames_of_one_group_travel_together);
