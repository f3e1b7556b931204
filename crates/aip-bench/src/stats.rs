//! What clients record while they run: latencies in HDR histograms and failures by reason.
//! Each client keeps its own and they are merged at the end, so nothing is shared while
//! measuring.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::report::{FailureReason, LatencySummary, SecondFigures};

/// Latencies of one kind of operation, in microseconds, 3 significant figures.
#[derive(Debug, Clone)]
pub(crate) struct Latency {
    histogram: Histogram<u64>,
}

impl Default for Latency {
    fn default() -> Self {
        Latency::new()
    }
}

impl Latency {
    /// An empty, auto-resizing histogram.
    pub fn new() -> Self {
        let histogram = Histogram::new(3).unwrap_or_else(|_| {
            Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
        });
        Latency { histogram }
    }

    /// Records one duration (at least 1 µs).
    pub fn record(&mut self, elapsed: Duration) {
        let micros = u64::try_from(elapsed.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        // `record` grows an auto-resizing histogram; `saturating_record` would clamp to its
        // current top instead.
        if self.histogram.record(micros).is_err() {
            self.histogram.saturating_record(micros);
        }
    }

    /// Adds another client's latencies.
    pub fn merge(&mut self, other: &Latency) {
        // Auto-resizing histograms always add; value by value is the fallback all the same.
        if self.histogram.add(&other.histogram).is_err() {
            for value in other.histogram.iter_recorded() {
                let (v, n) = (value.value_iterated_to(), value.count_at_value());
                if self.histogram.record_n(v, n).is_err() {
                    self.histogram.saturating_record_n(v, n);
                }
            }
        }
    }

    /// The percentiles, in milliseconds.
    pub fn summary(&self, name: &str) -> LatencySummary {
        let h = &self.histogram;
        let ms = |micros: u64| micros as f64 / 1000.0;
        let round = |ms: f64| (ms * 1000.0).round() / 1000.0;
        let empty = h.is_empty();
        let at = |q: f64| {
            if empty {
                0.0
            } else {
                ms(h.value_at_quantile(q))
            }
        };
        LatencySummary {
            name: name.to_owned(),
            count: h.len(),
            mean_ms: if empty { 0.0 } else { round(h.mean() / 1000.0) },
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p99_ms: at(0.99),
            p999_ms: at(0.999),
            max_ms: if empty { 0.0 } else { ms(h.max()) },
        }
    }
}

/// Completions second by second since the run started: how many, and their mean and longest
/// latency, so that a slow moment can be laid beside the servers' logs (the report's
/// `started_at` is second 0). A few words per second per client: no histogram.
#[derive(Debug, Clone, Default)]
pub(crate) struct Timeline {
    seconds: Vec<Second>,
}

/// One second of a [`Timeline`].
#[derive(Debug, Clone, Copy, Default)]
struct Second {
    completed: u64,
    total_us: u64,
    max_us: u64,
}

impl Timeline {
    /// Records an operation that took `elapsed` and completed `since_start` after the run
    /// started.
    pub fn record(&mut self, since_start: Duration, elapsed: Duration) {
        let index = usize::try_from(since_start.as_secs()).unwrap_or(usize::MAX);
        // A run is bounded by --max-seconds; this only keeps a wrong clock from allocating.
        if index >= MAX_TIMELINE_SECONDS {
            return;
        }
        if self.seconds.len() <= index {
            self.seconds.resize(index + 1, Second::default());
        }
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.seconds[index].add(Second {
            completed: 1,
            total_us: micros,
            max_us: micros,
        });
    }

    /// Adds another client's.
    pub fn merge(&mut self, other: &Timeline) {
        if self.seconds.len() < other.seconds.len() {
            self.seconds.resize(other.seconds.len(), Second::default());
        }
        for (mine, theirs) in self.seconds.iter_mut().zip(&other.seconds) {
            mine.add(*theirs);
        }
    }

    /// Every second from the first with a completion to the last, in milliseconds (a second
    /// in between with none is listed with 0: a stall shows).
    pub fn figures(&self) -> Vec<SecondFigures> {
        let first = self.seconds.iter().position(|s| s.completed > 0);
        let Some(first) = first else {
            return Vec::new();
        };
        let round = |ms: f64| (ms * 1000.0).round() / 1000.0;
        self.seconds[first..]
            .iter()
            .enumerate()
            .map(|(i, s)| SecondFigures {
                second: (first + i) as u64,
                completed: s.completed,
                mean_ms: if s.completed == 0 {
                    0.0
                } else {
                    round(s.total_us as f64 / s.completed as f64 / 1000.0)
                },
                max_ms: round(s.max_us as f64 / 1000.0),
            })
            .collect()
    }
}

impl Second {
    fn add(&mut self, other: Second) {
        self.completed += other.completed;
        self.total_us = self.total_us.saturating_add(other.total_us);
        self.max_us = self.max_us.max(other.max_us);
    }
}

/// Seconds a [`Timeline`] keeps at most (a day).
const MAX_TIMELINE_SECONDS: usize = 86_400;

/// Most distinct failure texts kept; the rest are counted under one line.
const MAX_REASONS: usize = 20;
/// The reason under which failures beyond [`MAX_REASONS`] are counted.
const OTHER: &str = "(other reasons)";

/// Failures by reason.
#[derive(Debug, Clone, Default)]
pub(crate) struct Failures {
    count: u64,
    reasons: BTreeMap<String, u64>,
}

impl Failures {
    /// Counts one failure.
    pub fn add(&mut self, reason: impl std::fmt::Display) {
        self.add_many(reason.to_string(), 1);
    }

    fn add_many(&mut self, reason: String, n: u64) {
        self.count += n;
        if self.reasons.contains_key(&reason) || self.reasons.len() < MAX_REASONS {
            *self.reasons.entry(reason).or_default() += n;
        } else {
            *self.reasons.entry(OTHER.to_owned()).or_default() += n;
        }
    }

    /// Adds another client's failures.
    pub fn merge(&mut self, other: Failures) {
        for (reason, n) in other.reasons {
            self.add_many(reason, n);
        }
    }

    /// How many.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The reasons, most frequent first.
    pub fn reasons(&self) -> Vec<FailureReason> {
        let mut reasons: Vec<FailureReason> = self
            .reasons
            .iter()
            .map(|(reason, count)| FailureReason {
                reason: reason.clone(),
                count: *count,
            })
            .collect();
        reasons.sort_by(|a, b| b.count.cmp(&a.count).then(a.reason.cmp(&b.reason)));
        reasons
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_merged_histograms() {
        let mut a = Latency::new();
        let mut b = Latency::new();
        for ms in 1..=99 {
            a.record(Duration::from_millis(ms));
        }
        b.record(Duration::from_millis(1000));
        a.merge(&b);
        let s = a.summary("x");
        assert_eq!(s.count, 100);
        assert!((s.p50_ms - 50.0).abs() < 0.1, "{s:?}");
        assert!((s.max_ms - 1000.0).abs() < 1.0, "{s:?}");
        assert_eq!(Latency::new().summary("empty").p99_ms, 0.0);
    }

    #[test]
    fn a_timeline_counts_each_second_and_shows_the_empty_ones() {
        let mut a = Timeline::default();
        let mut b = Timeline::default();
        a.record(Duration::from_millis(1_200), Duration::from_millis(10));
        a.record(Duration::from_millis(1_900), Duration::from_millis(30));
        b.record(Duration::from_millis(1_500), Duration::from_millis(50));
        b.record(Duration::from_millis(3_100), Duration::from_millis(400));
        a.merge(&b);
        let seconds = a.figures();
        let summary: Vec<(u64, u64, f64, f64)> = seconds
            .iter()
            .map(|s| (s.second, s.completed, s.mean_ms, s.max_ms))
            .collect();
        assert_eq!(
            summary,
            vec![(1, 3, 30.0, 50.0), (2, 0, 0.0, 0.0), (3, 1, 400.0, 400.0)]
        );
        assert!(Timeline::default().figures().is_empty());
    }

    #[test]
    fn failures_are_grouped_and_bounded() {
        let mut f = Failures::default();
        for i in 0..30 {
            f.add(format!("reason {i}"));
        }
        f.add("reason 3");
        let mut g = Failures::default();
        g.add("reason 3");
        f.merge(g);
        assert_eq!(f.count(), 32);
        let reasons = f.reasons();
        assert_eq!(reasons[0].count, 10, "the overflow line: {reasons:?}");
        assert_eq!(reasons[0].reason, OTHER);
        assert_eq!(
            (reasons[1].reason.as_str(), reasons[1].count),
            ("reason 3", 3)
        );
        assert_eq!(reasons.len(), MAX_REASONS + 1);
    }
}
