//! Presence at scale: 5,000 connections with 256-byte ids that all show life in every
//! presence interval make a gateway's presence report larger than NATS carries in one message
//! (1 MiB). The gateway sends it in parts, and every agent stays online for several gateway
//! windows, kept alive by presence alone. Before, the bus refused the report, the registry
//! took the gateway for silent, and every agent on it went offline. Both backends.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use aip_testkit::frames::device_register;
use aip_testkit::{Backend, Options, Stack, both_backends, eventually};
use common::{Ws, online_clients, registered};

const CLIENTS: usize = 5_000;
/// Clients driven by one task, one heartbeat after the other.
const PER_TASK: usize = 125;

/// One variant at a time: each holds 10,000 sockets (both ends of every connection), and the
/// process's descriptor limit (`scripts/test.sh` raises it to the hard limit) is shared.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn a_presence_report_larger_than_a_message_keeps_every_agent_online(backend: Backend) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let interval = Duration::from_millis(2_000);
    let options = Options {
        sessions: false,
        presence_interval_ms: 2_000,
        liveness_ms: 5_000,
        ..Options::default()
    };
    let window = Duration::from_millis(options.liveness_ms);
    let stack = Stack::start(backend, options).await.expect("stack");
    let url = stack.ws_url(0);
    let ids: Vec<String> = (0..CLIENTS).map(|i| format!("{i:0>256}")).collect();
    let mut clients: Vec<(String, Ws)> = Vec::with_capacity(CLIENTS);
    for chunk in ids.chunks(100) {
        let frames: Vec<_> = chunk
            .iter()
            .map(|id| device_register(id, "windows"))
            .collect();
        let connected =
            futures::future::join_all(frames.iter().map(|frame| registered(&url, frame))).await;
        clients.extend(chunk.iter().cloned().zip(connected));
    }
    let base = stack.registry_url();
    let expected: HashSet<String> = ids.iter().cloned().collect();
    eventually("every client online in the registry", || {
        let (base, expected) = (base.clone(), &expected);
        async move {
            let online: HashSet<String> = online_clients(&base).await.into_iter().collect();
            (online == *expected).then_some(())
        }
    })
    .await
    .expect("online");

    // Every client heartbeats about twice per presence interval for three gateway windows,
    // so each interval's report names all 5,000 (about 1.6 MB as one message).
    let until = tokio::time::Instant::now() + 3 * window;
    let mut beating = Vec::new();
    while !clients.is_empty() {
        let mut group: Vec<(String, Ws)> =
            clients.split_off(clients.len().saturating_sub(PER_TASK));
        beating.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < until {
                let round = tokio::time::Instant::now();
                for (id, ws) in &mut group {
                    ws.heartbeat(id, "device").await;
                }
                tokio::time::sleep_until(round + interval / 2).await;
            }
            group
        }));
    }
    let mut clients = Vec::with_capacity(CLIENTS);
    for task in beating {
        clients.extend(task.await.expect("heartbeats"));
    }
    let online: HashSet<String> = online_clients(&base).await.into_iter().collect();
    let lost = expected.difference(&online).count();
    assert_eq!(lost, 0, "{lost} of {CLIENTS} agents went offline");
    drop(clients);
    stack.stop().await;
}
both_backends!(a_presence_report_larger_than_a_message_keeps_every_agent_online);
