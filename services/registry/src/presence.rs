//! Presence: gateways' liveness batches, gathered in memory and written in one statement per
//! flush interval, never one database write per heartbeat.
//!
//! `presence.*` is queue-subscribed in the registry's group, so each batch reaches one
//! replica; each replica flushes what it received. A batch with `stopping: true` (a gateway's
//! last word before a graceful exit) triggers a flush at once, taking its agents offline.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_bus::Subscription;
use futures::{FutureExt, StreamExt};
use proto_schemas::registry::PresenceBatch;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::store::{AgentStore, PresenceFlush};

/// Presence received since the last flush.
#[derive(Debug, Default)]
pub struct PresenceBuffer {
    inner: Mutex<Pending>,
    stopping_arrived: Notify,
    /// Whether the last flush that had something to write failed: the database then holds
    /// older signs of life than the gateways sent ([`crate::reaper`] waits).
    last_write_failed: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct Pending {
    /// gateway → (interval, agent → connection)
    gateways: BTreeMap<String, (u64, BTreeMap<String, String>)>,
    stopping: BTreeSet<String>,
}

impl PresenceBuffer {
    /// Adds a batch. A later batch of the same gateway wins for each agent it names.
    pub fn add(&self, batch: PresenceBatch) {
        let stopping = batch.stopping;
        {
            let mut pending = self.lock();
            let entry = pending
                .gateways
                .entry(batch.gateway_id.clone())
                .or_default();
            entry.0 = batch.interval_ms;
            for alive in batch.alive {
                entry.1.insert(alive.agent_id, alive.connection_id);
            }
            if stopping {
                pending.stopping.insert(batch.gateway_id);
            }
        }
        if stopping {
            self.stopping_arrived.notify_one();
        }
    }

    /// Takes everything gathered so far, as one flush. Agents of a stopping gateway are not
    /// listed as alive.
    pub fn take(&self) -> PresenceFlush {
        let pending = std::mem::take(&mut *self.lock());
        let mut flush = PresenceFlush::default();
        for (gateway_id, (interval, agents)) in pending.gateways {
            if !pending.stopping.contains(&gateway_id) {
                for (agent_id, connection_id) in agents {
                    flush
                        .alive
                        .push((agent_id, connection_id, gateway_id.clone()));
                }
            }
            flush.gateways.push((gateway_id, interval));
        }
        flush.stopping = pending.stopping.into_iter().collect();
        flush
    }

    /// Puts back a flush that could not be written, under anything newer.
    pub fn restore(&self, flush: PresenceFlush) {
        let mut pending = self.lock();
        for (gateway_id, interval) in flush.gateways {
            pending
                .gateways
                .entry(gateway_id)
                .or_insert((interval, BTreeMap::new()));
        }
        for (agent_id, connection_id, gateway_id) in flush.alive {
            let entry = pending.gateways.entry(gateway_id).or_default();
            entry.1.entry(agent_id).or_insert(connection_id);
        }
        pending.stopping.extend(flush.stopping);
    }

    /// Whether the last write of presence failed (none written is no failure).
    pub fn last_write_failed(&self) -> bool {
        self.last_write_failed
            .load(std::sync::atomic::Ordering::Acquire)
    }

    fn wrote(&self, ok: bool) {
        self.last_write_failed
            .store(!ok, std::sync::atomic::Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Reads presence batches into `buffer` until `stop` is cancelled, then takes the batches
/// already received (but not yet read) too, so the last flush holds them.
pub async fn listen(
    mut subscription: Subscription,
    buffer: Arc<PresenceBuffer>,
    stop: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            message = subscription.next() => match message {
                Some(message) => message,
                None => return,
            },
        };
        take(&buffer, &message);
    }
    while let Some(Some(message)) = subscription.next().now_or_never() {
        take(&buffer, &message);
    }
}

fn take(buffer: &PresenceBuffer, message: &aip_bus::Message) {
    match crate::bus_api::read_payload::<PresenceBatch>(&message.payload) {
        Ok(batch) => buffer.add(batch),
        Err(e) => {
            tracing::warn!(subject = %message.subject, "ignoring an invalid presence batch{e}")
        }
    }
}

/// Writes the buffer every `interval` (and at once when a gateway stops) until `stop` is
/// cancelled, then writes what is left one last time.
pub async fn flush_periodically(
    buffer: Arc<PresenceBuffer>,
    store: Arc<dyn AgentStore>,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticker.tick() => {}
            () = buffer.stopping_arrived.notified() => {}
        }
        flush_once(&buffer, &*store).await;
    }
    flush_once(&buffer, &*store).await;
}

/// Writes what the buffer holds; on failure puts it back for the next flush.
pub async fn flush_once(buffer: &PresenceBuffer, store: &dyn AgentStore) {
    let flush = buffer.take();
    if flush.is_empty() {
        return;
    }
    let written = store.apply_presence(&flush).await;
    buffer.wrote(written.is_ok());
    match written {
        Ok(applied) => {
            if applied.stopped > 0 {
                tracing::info!(gateways = ?flush.stopping, agents = applied.stopped, "gateways stopping: their agents are offline");
            }
            tracing::trace!(
                gateways = flush.gateways.len(),
                refreshed = applied.refreshed,
                "presence written"
            );
        }
        Err(e) => {
            tracing::warn!("presence not written, retrying at the next flush: {e}");
            buffer.restore(flush);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::V1;
    use proto_schemas::registry::PresenceEntry;

    fn batch(gateway: &str, alive: &[(&str, &str)], stopping: bool) -> PresenceBatch {
        PresenceBatch {
            version: V1,
            gateway_id: gateway.to_owned(),
            interval_ms: 1000,
            alive: alive
                .iter()
                .map(|(a, c)| PresenceEntry {
                    agent_id: (*a).to_owned(),
                    connection_id: (*c).to_owned(),
                })
                .collect(),
            stopping,
        }
    }

    #[test]
    fn batches_merge_and_stopping_gateways_list_no_agents() {
        let buffer = PresenceBuffer::default();
        buffer.add(batch("g1", &[("a", "c1"), ("b", "c2")], false));
        buffer.add(batch("g1", &[("a", "c3")], false));
        buffer.add(batch("g2", &[("x", "c9")], false));
        buffer.add(batch("g2", &[], true));
        let flush = buffer.take();
        assert_eq!(
            flush.gateways,
            [("g1".to_owned(), 1000), ("g2".to_owned(), 1000)]
        );
        assert_eq!(
            flush.alive,
            [
                ("a".into(), "c3".into(), "g1".into()),
                ("b".into(), "c2".into(), "g1".into())
            ]
        );
        assert_eq!(flush.stopping, ["g2"]);
        assert!(buffer.take().is_empty());
    }

    #[test]
    fn restored_flushes_do_not_override_newer_reports() {
        let buffer = PresenceBuffer::default();
        buffer.add(batch("g1", &[("a", "old")], false));
        let failed = buffer.take();
        buffer.add(batch("g1", &[("a", "new")], false));
        buffer.restore(failed);
        assert_eq!(
            buffer.take().alive,
            [("a".into(), "new".into(), "g1".into())]
        );
    }
}
