//! CPU and memory of the broker's processes (`--server-pid`) and of the load generator
//! itself, from /proc, over the measured window: a reading at the start and at the end, and
//! samples in between (peak RSS, CPU over time).
//!
//! CPU is `utime + stime` of /proc/PID/stat in clock ticks of 1/100 s (Linux's USER_HZ on
//! every architecture it exposes to user space); RSS is `VmRSS` of /proc/PID/status, and the
//! part of it in shared memory `RssShmem` (PostgreSQL's shared buffers: each backend counts
//! the pages it touched, so summing backends' RSS counts the same pages many times).

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::report::{ProcessUsage, UsageSample};
use crate::target::TargetError;

/// Clock ticks per second in /proc/PID/stat.
const USER_HZ: f64 = 100.0;
/// Time between two samples.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// At most this many samples per process are kept (the rest are thinned out).
const MAX_SAMPLES: usize = 600;

/// Which process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proc {
    /// This process: the load generator.
    This,
    /// A broker process.
    Pid(u32),
}

impl Proc {
    fn dir(self) -> String {
        match self {
            Proc::This => "/proc/self".to_owned(),
            Proc::Pid(pid) => format!("/proc/{pid}"),
        }
    }
}

/// One look at a process.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// CPU seconds used so far (user + system).
    cpu_secs: f64,
    /// Resident memory, KiB.
    rss_kb: Option<u64>,
    /// Of which in shared memory, KiB.
    shmem_kb: Option<u64>,
}

fn read(process: Proc) -> std::io::Result<Reading> {
    let dir = process.dir();
    let stat = std::fs::read_to_string(format!("{dir}/stat"))?;
    // The command name is in parentheses and may contain anything: fields start after the
    // last `)`; utime and stime are fields 14 and 15, i.e. 12th and 13th after it.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| std::io::Error::other("unreadable stat"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu_secs = (tick(11) + tick(12)) as f64 / USER_HZ;
    let status = std::fs::read_to_string(format!("{dir}/status")).unwrap_or_default();
    let kb = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Ok(Reading {
        cpu_secs,
        rss_kb: kb("VmRSS:"),
        shmem_kb: kb("RssShmem:"),
    })
}

fn name_of(process: Proc) -> Option<String> {
    std::fs::read_to_string(format!("{}/comm", process.dir()))
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Checks that every pid can be read (before the run starts).
pub(crate) fn check_pids(pids: &[u32]) -> Result<(), TargetError> {
    for &pid in pids {
        if let Err(e) = read(Proc::Pid(pid)) {
            return Err(TargetError::NoSuchProcess {
                pid,
                reason: e.to_string(),
            });
        }
    }
    Ok(())
}

struct Watched {
    process: Proc,
    name: Option<String>,
    start: Option<Reading>,
}

/// Watches processes over a window.
pub(crate) struct Monitor {
    started: Instant,
    watched: Vec<Watched>,
    stop: watch::Sender<bool>,
    sampler: JoinHandle<Vec<Vec<UsageSample>>>,
}

impl Monitor {
    /// Takes the first readings and starts sampling: the broker's pids and this process.
    pub fn start(pids: &[u32]) -> Monitor {
        let processes: Vec<Proc> = pids
            .iter()
            .map(|&p| Proc::Pid(p))
            .chain([Proc::This])
            .collect();
        let started = Instant::now();
        let watched: Vec<Watched> = processes
            .iter()
            .map(|&process| Watched {
                process,
                name: name_of(process),
                start: read(process).ok(),
            })
            .collect();
        let (stop, mut stopped) = watch::channel(false);
        let mut last: Vec<Option<Reading>> = watched.iter().map(|w| w.start).collect();
        let sampler = tokio::spawn(async move {
            let mut samples: Vec<Vec<UsageSample>> = vec![Vec::new(); processes.len()];
            let mut every = tokio::time::interval(SAMPLE_EVERY);
            every.tick().await;
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    _ = stopped.changed() => break,
                }
                let at = started.elapsed().as_secs_f64();
                for (i, &process) in processes.iter().enumerate() {
                    let Ok(now) = read(process) else { continue };
                    let cpu_percent = last[i].map_or(0.0, |before| {
                        100.0 * (now.cpu_secs - before.cpu_secs).max(0.0)
                            / SAMPLE_EVERY.as_secs_f64()
                    });
                    last[i] = Some(now);
                    let kept = &mut samples[i];
                    if kept.len() >= MAX_SAMPLES {
                        // Keep every other one: the timeline stays even, just coarser.
                        let thinned: Vec<UsageSample> = kept.iter().step_by(2).cloned().collect();
                        *kept = thinned;
                    }
                    kept.push(UsageSample {
                        at_secs: round3(at),
                        cpu_percent: round1(cpu_percent),
                        rss_kb: now.rss_kb,
                    });
                }
            }
            samples
        });
        Monitor {
            started,
            watched,
            stop,
            sampler,
        }
    }

    /// Takes the last readings: the broker's processes, then the generator.
    pub async fn finish(self) -> (Vec<ProcessUsage>, ProcessUsage) {
        let window = self.started.elapsed().as_secs_f64().max(1e-9);
        let _ = self.stop.send(true);
        let samples = self.sampler.await.unwrap_or_default();
        let mut usages: Vec<ProcessUsage> = self
            .watched
            .into_iter()
            .zip(samples.into_iter().chain(std::iter::repeat_with(Vec::new)))
            .map(|(w, samples)| {
                let end = read(w.process).ok();
                let cpu_secs = match (w.start, end) {
                    (Some(a), Some(b)) => (b.cpu_secs - a.cpu_secs).max(0.0),
                    _ => 0.0,
                };
                let rss_before_kb = w.start.and_then(|r| r.rss_kb);
                let rss_after_kb = end.and_then(|r| r.rss_kb);
                let rss_peak_kb = samples
                    .iter()
                    .filter_map(|s| s.rss_kb)
                    .chain(rss_before_kb)
                    .chain(rss_after_kb)
                    .max();
                ProcessUsage {
                    pid: match w.process {
                        Proc::This => std::process::id(),
                        Proc::Pid(p) => p,
                    },
                    name: w.name,
                    alive_at_end: end.is_some(),
                    cpu_secs: round3(cpu_secs),
                    cpu_percent: round1(100.0 * cpu_secs / window),
                    rss_before_kb,
                    rss_after_kb,
                    rss_peak_kb,
                    shmem_before_kb: w.start.and_then(|r| r.shmem_kb),
                    shmem_after_kb: end.and_then(|r| r.shmem_kb),
                    samples,
                }
            })
            .collect();
        let generator = usages
            .pop()
            .unwrap_or_else(|| ProcessUsage::empty(std::process::id()));
        (usages, generator)
    }
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_can_be_read() {
        let reading = read(Proc::This).expect("/proc/self");
        assert!(reading.rss_kb.is_some_and(|kb| kb > 0));
        assert!(reading.shmem_kb.is_some(), "RssShmem of /proc/self/status");
        assert!(check_pids(&[std::process::id()]).is_ok());
        assert!(check_pids(&[u32::MAX]).is_err());
    }
}
