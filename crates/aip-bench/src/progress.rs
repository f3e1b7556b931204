//! The progress line on stderr: what phase the run is in, how far it got, how fast. Shown
//! only when stderr is a terminal (and not `--quiet`); clients only bump counters.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Counters of the current phase.
#[derive(Debug)]
pub(crate) struct Progress {
    done: AtomicU64,
    failed: AtomicU64,
    phase: Mutex<Phase>,
}

#[derive(Debug, Clone)]
struct Phase {
    label: String,
    total: u64,
    started: Instant,
}

impl Progress {
    /// Fresh counters.
    pub fn new() -> Arc<Progress> {
        Arc::new(Progress {
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            phase: Mutex::new(Phase {
                label: "starting".to_owned(),
                total: 0,
                started: Instant::now(),
            }),
        })
    }

    /// Starts a phase of `total` operations, counters at zero.
    pub fn phase(&self, label: &str, total: u64) {
        if let Ok(mut phase) = self.phase.lock() {
            *phase = Phase {
                label: label.to_owned(),
                total,
                started: Instant::now(),
            };
        }
        self.done.store(0, Ordering::Relaxed);
        self.failed.store(0, Ordering::Relaxed);
    }

    /// Sets the count of successes (a phase that starts with some done).
    pub fn set_done(&self, n: u64) {
        self.done.store(n, Ordering::Relaxed);
    }

    /// One operation succeeded.
    pub fn done(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    /// One operation failed.
    pub fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    fn line(&self) -> String {
        let phase = self.phase.lock().map(|p| p.clone()).ok();
        let Some(phase) = phase else {
            return String::new();
        };
        let done = self.done.load(Ordering::Relaxed);
        let failed = self.failed.load(Ordering::Relaxed);
        let secs = phase.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
        format!(
            "{}: {done}/{} done, {failed} failed, {rate:.0}/s, {secs:.0} s",
            phase.label, phase.total
        )
    }
}

/// Prints the line every half second until stopped.
pub(crate) struct Printer {
    stop: watch::Sender<bool>,
    handle: Option<JoinHandle<()>>,
}

impl Printer {
    /// Starts printing if `wanted` and stderr is a terminal.
    pub fn start(progress: Arc<Progress>, wanted: bool) -> Printer {
        let (stop, mut stopped) = watch::channel(false);
        let handle = (wanted && std::io::stderr().is_terminal()).then(|| {
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_millis(500));
                loop {
                    tokio::select! {
                        _ = every.tick() => {
                            let mut err = std::io::stderr().lock();
                            let _ = write!(err, "\r\x1b[2K{}", progress.line());
                            let _ = err.flush();
                        }
                        _ = stopped.changed() => break,
                    }
                }
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K");
                let _ = err.flush();
            })
        });
        Printer { stop, handle }
    }

    /// Clears the line.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(handle) = self.handle.take() {
            let _ = handle.await;
        }
    }
}
