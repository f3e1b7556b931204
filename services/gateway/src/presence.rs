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
        let batch = PresenceBatch {
            version: V1,
            gateway_id: gateway_id.clone(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            alive: table.drain_alive(),
            stopping,
        };
        match serde_json::to_vec(&batch) {
            Ok(body) => {
                if let Err(e) = bus
                    .publish(subject.clone(), Headers::new(), body.into())
                    .await
                {
                    tracing::warn!("presence batch not sent: {e}");
                }
            }
            Err(e) => tracing::error!("presence batch not serialisable: {e}"),
        }
        if stopping {
            if let Err(e) = bus.flush().await {
                tracing::warn!("could not flush the last presence batch: {e}");
            }
            return;
        }
    }
}
