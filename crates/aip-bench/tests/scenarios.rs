//! `aip bench` itself, on tiny counts, against the whole broker in this process (in-process
//! bus and SQLite): every scenario runs and counts correctly, also over two gateways,
//! refusals show up as failures with the broker's reason, and an unreachable broker is a
//! clear error. Timings are never asserted.

use aip_bench::{BenchArgs, Report};
use aip_testkit::{Backend, Client, Options, Stack, frames, get_json};
use clap::Parser;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

/// Parses `aip bench …` as the `aip` binary would, aimed at the stack's first gateway.
fn bench(stack: &Stack, words: &[&str]) -> BenchArgs {
    bench_on(stack, &[stack.ws_url(0)], words)
}

/// Parses `aip bench …` aimed at these gateways (one `--url` each).
fn bench_on(stack: &Stack, urls: &[String], words: &[&str]) -> BenchArgs {
    let rest = stack
        .sessions_http
        .map(|_| stack.sessions_url())
        .unwrap_or_else(|| "http://127.0.0.1:9".to_owned());
    let mut argv = vec!["bench"];
    argv.extend_from_slice(words);
    for url in urls {
        argv.extend_from_slice(&["--url", url]);
    }
    argv.extend_from_slice(&["--rest", &rest, "--quiet", "--max-seconds", "60"]);
    Cli::try_parse_from(argv).expect("arguments").bench
}

async fn stack(sessions: bool) -> Stack {
    Stack::start(
        Backend::LocalSqlite,
        Options {
            sessions,
            ..Options::default()
        },
    )
    .await
    .expect("stack")
}

fn assert_clean(report: &Report, expected: u64) {
    assert_eq!(report.expected, expected, "{}", report.to_table());
    assert_eq!(report.completed, expected, "{}", report.to_table());
    assert_eq!(report.failures, 0, "{}", report.to_table());
    assert!(report.failure_reasons.is_empty(), "{}", report.to_table());
    assert_eq!(report.stopped_early, None);
    assert_eq!(report.latencies[0].count, expected, "{}", report.to_table());
    // The timeline: every completion in some second, the seconds in a row from the run's
    // start, each second's mean within its longest.
    let timeline = &report.timeline;
    assert_eq!(
        timeline.iter().map(|s| s.completed).sum::<u64>(),
        expected,
        "{timeline:?}"
    );
    let first = timeline.first().expect("a timeline").second;
    for (i, second) in timeline.iter().enumerate() {
        assert_eq!(second.second, first + i as u64, "{timeline:?}");
        assert!(second.mean_ms <= second.max_ms, "{timeline:?}");
    }
    assert!(timeline.iter().any(|s| s.max_ms > 0.0), "{timeline:?}");
    let table = report.to_table();
    assert!(
        table.contains(&format!("{expected} of {expected}")),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_round_trips_are_counted() {
    let stack = stack(false).await;
    let args = bench(&stack, &["heartbeat", "--clients", "3", "--count", "5"]);
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_clean(&report, 15);
    assert_eq!(report.unit, "round trips");
    assert_eq!(report.parameters["clients"], 3);
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_counted() {
    let stack = stack(false).await;
    let args = bench(&stack, &["register", "--clients", "3", "--count", "5"]);
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_clean(&report, 15);
    assert_eq!(
        report.latencies.len(),
        2,
        "connect + register, and register alone"
    );
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_info_requests_are_counted() {
    let stack = stack(false).await;
    let args = bench(
        &stack,
        &[
            "devinfo",
            "--devices",
            "2",
            "--clients",
            "3",
            "--count",
            "5",
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_clean(&report, 15);
    let devices = report.devices.expect("device figures");
    assert_eq!((devices.devices, devices.drops), (2, 0));
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_complete_and_every_event_log_is_verified() {
    let stack = stack(true).await;
    let args = bench(
        &stack,
        &[
            "tasks",
            "--devices",
            "2",
            "--clients",
            "3",
            "--count",
            "5",
            "--commands",
            "2",
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_clean(&report, 15);
    let verification = report.verification.clone().expect("logs checked");
    assert_eq!(
        (
            verification.checked,
            verification.complete,
            verification.incomplete
        ),
        (15, 15, 0),
        "{verification:?}"
    );
    assert_eq!(verification.not_checked, 0);
    let devices = report.devices.clone().expect("device figures");
    assert_eq!(
        devices.commands_answered, 30,
        "K = 2 command rounds per task"
    );
    assert_eq!(devices.drops, 0);
    assert!(report.to_table().contains("15 of 15 complete and gap-free"));

    // The JSON for scripts carries the same report.
    let json = serde_json::to_string(&report).expect("JSON");
    let back: Report = serde_json::from_str(&json).expect("parses back");
    assert_eq!(back, report);
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_over_two_gateways_cross_from_one_to_the_other() {
    let stack = Stack::start(
        Backend::LocalSqlite,
        Options {
            gateways: 2,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let urls = [stack.ws_url(0), stack.ws_url(1)];
    let args = bench_on(
        &stack,
        &urls,
        &[
            "tasks",
            "--devices",
            "2",
            "--clients",
            "4",
            "--count",
            "3",
            "--commands",
            "2",
            "--id-prefix",
            "twogw",
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_clean(&report, 12);
    assert_eq!(report.urls, urls, "the report names both gateways");
    assert!(
        report.to_table().contains(&urls[1]),
        "{}",
        report.to_table()
    );
    let verification = report.verification.clone().expect("logs checked");
    assert_eq!(
        (
            verification.checked,
            verification.complete,
            verification.incomplete,
            verification.not_checked
        ),
        (12, 12, 0, 0),
        "{verification:?}"
    );
    let devices = report.devices.clone().expect("device figures");
    assert_eq!((devices.devices, devices.drops), (2, 0));
    assert_eq!(
        devices.commands_answered, 24,
        "12 tasks of 2 command rounds"
    );

    // The registry keeps the gateway each client last registered on: devices alternate
    // between the gateways, and every constellation is on the other one than its device.
    let gateway_of = |id: String| {
        let url = format!("{}/api/agents/{id}", stack.registry_url());
        async move {
            let (status, body) = get_json(&url).await;
            assert_eq!(status, 200, "{url}: {body}");
            body["gateway_id"].as_str().expect("gateway_id").to_owned()
        }
    };
    let ids = [stack.gateways[0].id.clone(), stack.gateways[1].id.clone()];
    for (d, id) in ids.iter().enumerate() {
        assert_eq!(
            &gateway_of(format!("twogw-dev-{d}")).await,
            id,
            "device {d}"
        );
    }
    for c in 0..4 {
        let d = c % 2;
        let constellation = gateway_of(format!("twogw-g{c}@twogw-dev-{d}")).await;
        assert_eq!(constellation, ids[1 - d], "constellation {c} of device {d}");
    }
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_info_requests_over_two_gateways_are_counted() {
    let stack = Stack::start(
        Backend::LocalSqlite,
        Options {
            gateways: 2,
            sessions: false,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let urls = [stack.ws_url(0), stack.ws_url(1)];
    let args = bench_on(
        &stack,
        &urls,
        &[
            "devinfo",
            "--devices",
            "1",
            "--clients",
            "3",
            "--count",
            "4",
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    // One device on the first gateway, its three constellations all on the second.
    assert_clean(&report, 12);
    assert_eq!(report.urls, urls);
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_tasks_complete_and_every_event_log_is_verified() {
    let stack = stack(true).await;
    let args = bench(
        &stack,
        &[
            "rest",
            "--count",
            "6",
            "--devices",
            "2",
            "--concurrency",
            "3",
            "--commands",
            "2",
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_clean(&report, 6);
    let verification = report.verification.expect("logs checked");
    assert_eq!((verification.checked, verification.complete), (6, 6));
    assert_eq!(report.devices.expect("devices").commands_answered, 12);
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_devices_are_held_and_the_broker_process_is_read() {
    let stack = stack(false).await;
    // The broker runs in this test's process: its pid is ours.
    let pid = std::process::id().to_string();
    let args = bench(
        &stack,
        &[
            "connect",
            "--n",
            "5",
            "--hold",
            "1",
            "--heartbeat-secs",
            "1",
            "--server-pid",
            &pid,
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    let connect = report.connect.clone().expect("connect figures");
    assert_eq!(
        (connect.requested, connect.connected, connect.drops),
        (5, 5, 0)
    );
    assert_eq!(
        (report.completed, report.failures),
        (5, 0),
        "{}",
        report.to_table()
    );
    assert!(connect.rss_per_connection_bytes.is_some(), "{connect:?}");
    assert_eq!(report.broker.len(), 1);
    assert!(report.broker[0].rss_after_kb.is_some());
    assert_eq!(report.latencies[0].count, 5);
    assert!(report.to_table().contains("broker RSS per connection"));
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_is_reported_with_the_brokers_reason() {
    const HOLDER: &str = "holder-token";
    const BENCH: &str = "bench-token";
    let hash = aip_gateway::auth::hash_token;
    let credentials = format!(
        "[[credential]]\nname = \"holder\"\ntoken_sha256 = \"{}\"\nclient_ids = [\"dup-*\"]\nroles = [\"device\"]\n\n\
         [[credential]]\nname = \"bench\"\ntoken_sha256 = \"{}\"\nclient_ids = [\"dup-*\"]\nroles = [\"device\"]\n",
        hash(HOLDER),
        hash(BENCH)
    );
    let stack = Stack::start(
        Backend::LocalSqlite,
        Options {
            sessions: false,
            credentials: Some(credentials),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    // Another credential holds the id the bench's first registration will use.
    let mut holder = Client::connect(&format!("{}?token={HOLDER}", stack.ws_url(0)))
        .await
        .expect("connect");
    holder
        .send(&frames::device_register("dup-reg-0-0", "linux"))
        .await
        .expect("register");
    assert_eq!(holder.recv().await.expect("answer")["type"], "heartbeat");

    let args = bench(
        &stack,
        &[
            "register",
            "--clients",
            "1",
            "--count",
            "3",
            "--id-prefix",
            "dup",
            "--token",
            BENCH,
        ],
    );
    let report = aip_bench::run(args).await.expect("run");
    println!("{}", report.to_table());
    assert_eq!(
        (report.expected, report.completed, report.failures),
        (3, 2, 1)
    );
    let reason = &report.failure_reasons[0];
    assert_eq!(reason.count, 1);
    assert!(
        reason
            .reason
            .contains("'dup-reg-0-0' is already registered"),
        "{reason:?}"
    );
    assert!(
        report.to_table().contains("already registered"),
        "{}",
        report.to_table()
    );
    holder.close().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_is_a_clear_error() {
    // A port nothing listens on.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let url = format!("ws://127.0.0.1:{port}/ws");
    let args = Cli::try_parse_from([
        "bench",
        "heartbeat",
        "--clients",
        "1",
        "--count",
        "1",
        "--url",
        &url,
        "--quiet",
    ])
    .expect("arguments")
    .bench;
    let error = aip_bench::run(args)
        .await
        .expect_err("nothing is there")
        .to_string();
    assert!(error.contains("cannot reach the broker at"), "{error}");
    assert!(error.contains(&url), "{error}");
    assert!(error.contains("aip dev"), "{error}");
}
