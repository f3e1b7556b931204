//! The outcome of a run: [`Report`], serialisable as JSON for scripts and printed as an
//! aligned table for people.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// Everything a run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `connect`, `heartbeat`, `register`, `devinfo`, `tasks` or `rest`.
    pub scenario: String,
    /// The scenario's own arguments (clients, count, …).
    pub parameters: serde_json::Value,
    /// The gateways' WebSocket URLs (without the token), in the order the clients were spread
    /// over them (`--url`).
    pub urls: Vec<String>,
    /// The REST base URL, for scenarios that use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rest: Option<String>,
    /// The prefix of every client id of the run.
    pub id_prefix: String,
    /// When the run started (RFC 3339).
    pub started_at: String,
    /// What one operation is (`tasks`, `round trips`, `registrations`, `requests`,
    /// `connections`).
    pub unit: String,
    /// Operations the scenario was asked for.
    pub expected: u64,
    /// Operations that succeeded.
    pub completed: u64,
    /// Operations (and client setups) that failed.
    pub failures: u64,
    /// Why they failed, most frequent first.
    pub failure_reasons: Vec<FailureReason>,
    /// Length of the measured window, seconds.
    pub window_secs: f64,
    /// `completed / window_secs` (for `connect`: connections set up per second).
    pub throughput_per_sec: f64,
    /// Latency percentiles, one line per kind of operation.
    pub latencies: Vec<LatencySummary>,
    /// Completions of the main operation second by second since `started_at` (second 0),
    /// from the first second with one to the last: lays a slow moment beside the servers'
    /// logs. Not for `connect`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<SecondFigures>,
    /// `connect` only: setup and hold figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect: Option<ConnectFigures>,
    /// `tasks` and `rest`: the check of every completed task's event log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<Verification>,
    /// The bench's own devices (`devinfo`, `tasks`, `rest`): commands answered and drops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<DeviceFigures>,
    /// The broker's processes (`--server-pid`) over the window.
    pub broker: Vec<ProcessUsage>,
    /// The load generator (this process) over the window.
    pub generator: ProcessUsage,
    /// CPU cores of this machine (for reading the CPU percentages).
    pub cores: usize,
    /// Why the run stopped before doing everything, if it did (e.g. `--max-seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_early: Option<String>,
    /// Things a reader should know (a generator-bound run, a rate-limited broker, …).
    pub notes: Vec<String>,
}

/// Latency percentiles of one kind of operation, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// What was timed, e.g. `task (TASK → task_end)`.
    pub name: String,
    /// How many were timed.
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    pub max_ms: f64,
}

/// One second of a run's timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecondFigures {
    /// Whole seconds since the run started: this one covers `[second, second + 1)`.
    pub second: u64,
    /// Operations that completed in it.
    pub completed: u64,
    /// Their mean latency (0 when none completed).
    pub mean_ms: f64,
    /// Their longest.
    pub max_ms: f64,
}

/// A failure text and how often it happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureReason {
    /// What went wrong.
    pub reason: String,
    /// How many times.
    pub count: u64,
}

/// CPU and memory of one process over the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessUsage {
    pub pid: u32,
    /// Its name (/proc/PID/comm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether it was still there at the end of the window.
    pub alive_at_end: bool,
    /// CPU seconds used in the window (user + system).
    pub cpu_secs: f64,
    /// `cpu_secs` over the window, percent of one core (200 = two cores busy).
    pub cpu_percent: f64,
    /// RSS at the start of the window, KiB.
    pub rss_before_kb: Option<u64>,
    /// RSS at the end of the window, KiB.
    pub rss_after_kb: Option<u64>,
    /// Highest RSS seen, KiB.
    pub rss_peak_kb: Option<u64>,
    /// Of the RSS at the start, KiB in shared memory (`RssShmem`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shmem_before_kb: Option<u64>,
    /// Of the RSS at the end, KiB in shared memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shmem_after_kb: Option<u64>,
    /// Samples every half second.
    pub samples: Vec<UsageSample>,
}

impl ProcessUsage {
    /// Growth of the RSS outside shared memory over the window, KiB; `None` if either end is
    /// unknown. Shared memory (PostgreSQL's shared buffers) is left out: every process that
    /// maps it counts the pages it touched, so a sum over processes would count them again
    /// for each, and it is a pool sized by configuration, not memory a connection costs.
    pub fn private_growth_kb(&self) -> Option<i64> {
        let private = |rss: Option<u64>, shmem: Option<u64>| {
            rss.map(|rss| rss as i64 - shmem.unwrap_or(0) as i64)
        };
        Some(
            private(self.rss_after_kb, self.shmem_after_kb)?
                - private(self.rss_before_kb, self.shmem_before_kb)?,
        )
    }

    /// Nothing known about `pid`.
    pub fn empty(pid: u32) -> Self {
        ProcessUsage {
            pid,
            name: None,
            alive_at_end: false,
            cpu_secs: 0.0,
            cpu_percent: 0.0,
            rss_before_kb: None,
            rss_after_kb: None,
            rss_peak_kb: None,
            shmem_before_kb: None,
            shmem_after_kb: None,
            samples: Vec::new(),
        }
    }
}

/// One sample of a process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageSample {
    /// Seconds since the window started.
    pub at_secs: f64,
    /// CPU since the previous sample, percent of one core.
    pub cpu_percent: f64,
    /// RSS, KiB.
    pub rss_kb: Option<u64>,
}

/// `connect`: setting up and holding idle devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectFigures {
    /// Devices asked for.
    pub requested: u64,
    /// Devices registered.
    pub connected: u64,
    /// Seconds from the first connect to the last registration answer.
    pub setup_secs: f64,
    /// `connected / setup_secs`.
    pub setup_per_sec: f64,
    /// Seconds the devices were held.
    pub held_secs: f64,
    /// Heartbeats sent while holding.
    pub heartbeats_sent: u64,
    /// Connections the broker closed while they were held.
    pub drops: u64,
    /// Broker RSS growth per connected device, bytes: every `--server-pid`'s RSS outside
    /// shared memory, end minus start of the window ([`ProcessUsage::private_growth_kb`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_per_connection_bytes: Option<f64>,
}

/// `tasks` and `rest`: whether the broker's event logs match what the clients saw.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    /// Tasks whose log was read.
    pub checked: u64,
    /// Logs that were complete (completed, K `command_sent`, K `results_received`) and
    /// gap-free (seq 1..n).
    pub complete: u64,
    /// Logs that were not.
    pub incomplete: u64,
    /// Tasks not checked (the check ran out of time, or could not read the log).
    pub not_checked: u64,
    /// What was wrong, for the first few.
    pub problems: Vec<String>,
}

/// The bench's own devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceFigures {
    /// How many.
    pub devices: u64,
    /// `command` frames answered.
    pub commands_answered: u64,
    /// Devices the broker disconnected during the run.
    pub drops: u64,
}

impl Report {
    /// The table for people.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "aip bench {}: {}", self.scenario, self.urls.join(", "));
        if self.urls.len() > 1 {
            let how = match self.scenario.as_str() {
                "devinfo" | "tasks" => ", every constellation on another gateway than its device",
                _ => "",
            };
            let _ = writeln!(
                out,
                "  clients spread over {} gateways round robin{how}",
                self.urls.len()
            );
        }
        if let Some(rest) = &self.rest {
            let _ = writeln!(out, "  REST {rest}");
        }
        let _ = writeln!(
            out,
            "  {}  (ids {}-*, started {})",
            parameters_line(&self.parameters),
            self.id_prefix,
            self.started_at
        );
        out.push('\n');

        let mut summary = Table::new(&[]);
        summary.row(vec![
            self.unit.clone(),
            format!("{} of {}", self.completed, self.expected),
        ]);
        summary.row(vec!["failures".into(), self.failures.to_string()]);
        summary.row(vec!["window".into(), format!("{:.2} s", self.window_secs)]);
        summary.row(vec![
            "throughput".into(),
            format!("{} {}/s", rate(self.throughput_per_sec), self.unit),
        ]);
        if let Some(c) = &self.connect {
            summary.row(vec![
                "setup".into(),
                format!(
                    "{} of {} in {:.2} s ({} /s)",
                    c.connected,
                    c.requested,
                    c.setup_secs,
                    rate(c.setup_per_sec)
                ),
            ]);
            summary.row(vec![
                "held".into(),
                format!("{:.1} s, {} heartbeats", c.held_secs, c.heartbeats_sent),
            ]);
            summary.row(vec!["drops".into(), c.drops.to_string()]);
            summary.row(vec![
                "broker RSS per connection (shared memory aside)".into(),
                c.rss_per_connection_bytes
                    .map_or_else(|| "- (pass --server-pid)".to_owned(), bytes),
            ]);
        }
        if let Some(d) = &self.devices {
            summary.row(vec![
                "bench devices".into(),
                format!(
                    "{} ({} commands answered, {} dropped)",
                    d.devices, d.commands_answered, d.drops
                ),
            ]);
        }
        if let Some(v) = &self.verification {
            summary.row(vec![
                "event logs".into(),
                format!(
                    "{} of {} complete and gap-free ({} incomplete, {} not checked)",
                    v.complete, v.checked, v.incomplete, v.not_checked
                ),
            ]);
        }
        if let Some(why) = &self.stopped_early {
            summary.row(vec!["stopped early".into(), why.clone()]);
        }
        out.push_str(&summary.render());

        if !self.latencies.is_empty() {
            out.push('\n');
            let mut t = Table::new(&[
                "latency (ms)",
                "count",
                "p50",
                "p90",
                "p99",
                "p99.9",
                "max",
                "mean",
            ]);
            for l in &self.latencies {
                t.row(vec![
                    l.name.clone(),
                    l.count.to_string(),
                    ms(l.p50_ms),
                    ms(l.p90_ms),
                    ms(l.p99_ms),
                    ms(l.p999_ms),
                    ms(l.max_ms),
                    ms(l.mean_ms),
                ]);
            }
            out.push_str(&t.render());
        }

        out.push('\n');
        let mut t = Table::new(&[
            "process",
            "pid",
            "cpu s",
            "cpu %",
            "rss start",
            "rss end",
            "rss peak",
        ]);
        let kb = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |kb| bytes(kb as f64 * 1024.0));
        for (role, p) in self
            .broker
            .iter()
            .map(|p| ("broker", p))
            .chain([("generator (aip bench)", &self.generator)])
        {
            let name = match &p.name {
                Some(n) if role == "broker" => format!("broker: {n}"),
                _ => role.to_owned(),
            };
            t.row(vec![
                name,
                p.pid.to_string(),
                format!("{:.2}", p.cpu_secs),
                format!("{:.0}", p.cpu_percent),
                kb(p.rss_before_kb),
                kb(p.rss_after_kb),
                kb(p.rss_peak_kb),
            ]);
        }
        out.push_str(&t.render());
        let _ = writeln!(
            out,
            "  (cpu %: of one core; this machine has {} cores)",
            self.cores
        );

        if !self.failure_reasons.is_empty() {
            out.push('\n');
            let mut t = Table::new(&["failures", "reason"]);
            for f in self.failure_reasons.iter().take(10) {
                t.row(vec![f.count.to_string(), f.reason.clone()]);
            }
            out.push_str(&t.render());
        }
        if let Some(v) = &self.verification {
            for p in v.problems.iter().take(10) {
                let _ = writeln!(out, "  event log: {p}");
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        out
    }

    /// Prints [`Report::to_table`] on stdout.
    pub fn print_table(&self) {
        print!("{}", self.to_table());
    }

    /// Prints the report as pretty JSON on stdout.
    pub fn print_json(&self) -> anyhow::Result<()> {
        println!("{}", serde_json::to_string_pretty(self)?);
        Ok(())
    }
}

fn parameters_line(parameters: &serde_json::Value) -> String {
    match parameters.as_object() {
        Some(map) => map
            .iter()
            .map(|(k, v)| format!("{}={}", k.replace('_', "-"), v))
            .collect::<Vec<_>>()
            .join(" "),
        None => parameters.to_string(),
    }
}

fn rate(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn bytes(v: f64) -> String {
    let sign = if v < 0.0 { "-" } else { "" };
    let v = v.abs();
    if v >= 1024.0 * 1024.0 {
        format!("{sign}{:.1} MiB", v / (1024.0 * 1024.0))
    } else if v >= 1024.0 {
        format!("{sign}{:.1} KiB", v / 1024.0)
    } else {
        format!("{sign}{v:.0} B")
    }
}

/// Aligned columns: the first left-aligned, the others right-aligned.
struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        // No headers: as many columns as the widest row, and no header line.
        let columns = if self.headers.is_empty() {
            self.rows.iter().map(Vec::len).max().unwrap_or(0)
        } else {
            self.headers.len()
        };
        let mut widths: Vec<usize> = (0..columns)
            .map(|i| self.headers.get(i).map_or(0, |h| h.chars().count()))
            .collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let line = |cells: &[String], out: &mut String| {
            let mut text = String::from(" ");
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                let pad = width - cell.chars().count().min(*width);
                text.push(' ');
                if i == 0 || columns == 2 {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad));
                } else {
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                }
                text.push(' ');
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        if !self.headers.is_empty() {
            line(&self.headers, &mut out);
        }
        for row in &self.rows {
            line(row, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_growth_leaves_shared_memory_out() {
        // A PostgreSQL backend that touched 150 MiB more of the shared buffers and grew by
        // 2 MiB of its own: 2 MiB.
        let backend = ProcessUsage {
            rss_before_kb: Some(10_000),
            rss_after_kb: Some(163_648),
            shmem_before_kb: Some(5_000),
            shmem_after_kb: Some(156_600),
            ..ProcessUsage::empty(1)
        };
        assert_eq!(backend.private_growth_kb(), Some(2_048));
        // A process without shared memory (no `RssShmem` read): its RSS growth.
        let gateway = ProcessUsage {
            rss_before_kb: Some(15_000),
            rss_after_kb: Some(85_000),
            ..ProcessUsage::empty(2)
        };
        assert_eq!(gateway.private_growth_kb(), Some(70_000));
        // Either end unknown: unknown.
        let gone = ProcessUsage {
            rss_before_kb: Some(15_000),
            ..ProcessUsage::empty(3)
        };
        assert_eq!(gone.private_growth_kb(), None);
    }

    #[test]
    fn columns_line_up() {
        let mut t = Table::new(&["name", "a", "b"]);
        t.row(vec!["x".into(), "1".into(), "22".into()]);
        t.row(vec!["longer".into(), "333".into(), "4".into()]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "  name      a   b");
        assert_eq!(lines[1], "  x         1  22");
        assert_eq!(lines[2], "  longer  333   4");
    }

    #[test]
    fn sizes_are_readable() {
        assert_eq!(bytes(16_000.0), "15.6 KiB");
        assert_eq!(bytes(-512.0), "-512 B");
        assert_eq!(ms(0.1234), "0.123");
    }
}
