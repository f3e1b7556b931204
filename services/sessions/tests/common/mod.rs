//! The session service as a real process (the `aip-sessions` binary) on a test stack's NATS
//! and database, for tests that kill it.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};

use aip_testkit::{Backend, Options, Stack, eventually, nats_url};

/// Kills the process when the test ends, however it ends.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of the series `series` (a metric name with its labels, e.g.
/// `aip_sessions_frames_published_total{form="batched"}`) in the service's metrics at `base`;
/// 0 when the service has not reported it yet.
pub async fn metric(base: &str, series: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// A free loopback port, never one this test process was given before.
pub fn free_port() -> u16 {
    aip_testkit::free_port()
}

/// Starts `aip-sessions` for `stack` on `port`, with `envs` added to its environment.
pub fn start_sessions(stack: &Stack, port: u16, envs: &[(&str, &str)]) -> Process {
    let child = Command::new(env!("CARGO_BIN_EXE_aip-sessions"))
        .env("AIP_NATS_URL", nats_url())
        .env("AIP_DATABASE_URL", &stack.database_url)
        .env("AIP_SUBJECT_PREFIX", &stack.prefix)
        .env(
            "AIP_NATS_FRAMES_MAX_BYTES",
            aip_testkit::TEST_FRAMES_MAX_BYTES.to_string(),
        )
        .env(
            "AIP_NATS_BLOBS_MAX_BYTES",
            aip_testkit::TEST_BLOBS_MAX_BYTES.to_string(),
        )
        .env("AIP_SESSIONS__LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .envs(envs.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start aip-sessions");
    Process(child)
}

/// A stack on NATS and PostgreSQL whose session service the test starts (and kills) itself.
pub async fn stack_without_sessions() -> Stack {
    Stack::start(
        Backend::NatsPostgres,
        Options {
            sessions: false,
            ..Options::default()
        },
    )
    .await
    .expect("stack")
}

/// Starts `aip-sessions` as [`start_sessions`] does, and waits until it is ready.
pub async fn start_ready_sessions(stack: &Stack, port: u16, envs: &[(&str, &str)]) -> Process {
    let process = start_sessions(stack, port, envs);
    let ready = format!("http://127.0.0.1:{port}/readyz");
    eventually("the session service to be ready", || async {
        reqwest::get(&ready)
            .await
            .ok()
            .filter(|r| r.status().is_success())
            .map(|_| ())
    })
    .await
    .expect("ready");
    process
}
