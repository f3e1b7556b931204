//! Batched presence: which clients of this gateway showed life.
//!
//! A heartbeat costs one atomic store on the connection; every `presence_interval_ms` one
//! message lists every connection that showed life since the last batch. The same message is
//! the gateway's own heartbeat to the registry, which takes a silent gateway as dead.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_bus::{Headers, SharedBus};
use proto_schemas::registry::{PresenceBatch, PresenceEntry};
use proto_schemas::{Subjects, V1};
use tokio_util::sync::CancellationToken;

/// Shared liveness flag of one connection.
#[derive(Debug, Default)]
pub struct Liveness {
    seen: AtomicBool,
}

impl Liveness {
    /// Records a sign of life.
    pub fn touch(&self) {
        self.seen.store(true, Ordering::Relaxed);
    }

    fn take(&self) -> bool {
        self.seen.swap(false, Ordering::Relaxed)
    }
}

/// The registered connections of this gateway.
#[derive(Debug, Default)]
pub struct PresenceTable {
    /// connection id → (client id, liveness)
    connections: Mutex<HashMap<String, (String, Arc<Liveness>)>>,
}

impl PresenceTable {
    /// Adds a registered connection.
    pub fn insert(&self, connection_id: &str, client_id: &str) -> Arc<Liveness> {
        let liveness = Arc::new(Liveness::default());
        liveness.touch();
        self.lock().insert(
            connection_id.to_owned(),
            (client_id.to_owned(), liveness.clone()),
        );
        liveness
    }

    /// Removes a connection.
    pub fn remove(&self, connection_id: &str) {
        self.lock().remove(connection_id);
    }

    /// How many registered connections there are.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Arc<Liveness>)>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn drain_alive(&self) -> Vec<PresenceEntry> {
        self.lock()
            .iter()
            .filter(|(_, (_, liveness))| liveness.take())
            .map(|(connection_id, (agent_id, _))| PresenceEntry {
                agent_id: agent_id.clone(),
                connection_id: connection_id.clone(),
            })
            .collect()
    }
}

/// Room left in a message for its subject and headers.
const HEADROOM: usize = 16 * 1024;
/// The smallest budget for one message, whatever the bus reports.
const MIN_BATCH_BYTES: usize = 4 * 1024;

/// The report of one interval as messages of at most `budget` bytes each (one entry larger
/// than that alone goes alone): at 50,000 connections a report is several MiB, and NATS
/// refuses a message over its `max_payload` (1 MiB by default). The registry merges the
/// messages of one gateway, so a report in several parts counts as one. A stopping report is
/// a single message, last.
fn batches(
    gateway_id: &str,
    interval_ms: u64,
    alive: Vec<PresenceEntry>,
    stopping: bool,
    budget: usize,
) -> Vec<Vec<u8>> {
    let batch = |alive: Vec<PresenceEntry>| PresenceBatch {
        version: V1,
        gateway_id: gateway_id.to_owned(),
        interval_ms,
        alive,
        stopping,
    };
    let encode = |batch: &PresenceBatch| match serde_json::to_vec(batch) {
        Ok(body) => Some(body),
        Err(e) => {
            tracing::error!("presence batch not serialisable: {e}");
            None
        }
    };
    let Some(empty) = encode(&batch(Vec::new())) else {
        return Vec::new();
    };
    if alive.is_empty() {
        return vec![empty];
    }
    let mut bodies = Vec::new();
    let mut part = Vec::new();
    let mut size = empty.len();
    for entry in alive {
        // The entry as it appears in the list, with its separating comma.
        let len = serde_json::to_vec(&entry).map_or(0, |e| e.len()) + 1;
        if !part.is_empty() && size + len > budget {
            bodies.extend(encode(&batch(std::mem::take(&mut part))));
            size = empty.len();
        }
        size += len;
        part.push(entry);
    }
    bodies.extend(encode(&batch(part)));
    bodies
}

/// Publishes presence batches until `stop` is cancelled, then one last batch with
/// `stopping: true` so the registry marks this gateway's agents offline at once.
pub async fn run(
    bus: SharedBus,
    subjects: Subjects,
    gateway_id: String,
    table: Arc<PresenceTable>,
    interval: Duration,
    stop: CancellationToken,
) {
    let subject = subjects.presence(&gateway_id);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            _ = ticker.tick() => false,
            () = stop.cancelled() => true,
        };
        let interval_ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
        // A stopping gateway's agents all go offline: the last word names none of them.
        let alive = if stopping {
            Vec::new()
        } else {
            table.drain_alive()
        };
        let budget = bus
            .max_payload()
            .saturating_sub(HEADROOM)
            .max(MIN_BATCH_BYTES);
        for body in batches(&gateway_id, interval_ms, alive, stopping, budget) {
            if let Err(e) = bus
                .publish(subject.clone(), Headers::new(), body.into())
                .await
            {
                tracing::warn!("presence batch not sent: {e}");
            }
        }
        if stopping {
            if let Err(e) = bus.flush().await {
                tracing::warn!("could not flush the last presence batch: {e}");
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(n: usize, id_len: usize) -> Vec<PresenceEntry> {
        (0..n)
            .map(|i| PresenceEntry {
                agent_id: format!("{i:0>id_len$}"),
                connection_id: format!("c{i}"),
            })
            .collect()
    }

    #[test]
    fn a_large_report_is_split_under_the_budget_and_loses_nobody() {
        let alive = entries(5_000, 256);
        let bodies = batches("gw", 1_000, alive.clone(), false, 64 * 1024);
        assert!(bodies.len() > 1, "5,000 long ids do not fit in 64 KiB");
        let mut seen = Vec::new();
        for body in &bodies {
            assert!(body.len() <= 64 * 1024, "a part of {} bytes", body.len());
            let batch: PresenceBatch = serde_json::from_slice(body).expect("a presence batch");
            assert_eq!(
                (batch.gateway_id.as_str(), batch.interval_ms),
                ("gw", 1_000)
            );
            assert!(!batch.stopping);
            seen.extend(batch.alive);
        }
        assert_eq!(seen, alive);
    }

    #[test]
    fn a_quiet_or_stopping_report_is_one_message() {
        let quiet = batches("gw", 1_000, Vec::new(), false, 64 * 1024);
        assert_eq!(
            quiet.len(),
            1,
            "an empty report is still the gateway's heartbeat"
        );
        let last = batches("gw", 1_000, Vec::new(), true, 64 * 1024);
        let batch: PresenceBatch = serde_json::from_slice(&last[0]).expect("a presence batch");
        assert!(batch.stopping && batch.alive.is_empty());
    }
}
