//! The reaper: marks offline the agents that stopped being live.
//!
//! A gateway killed without a word sends no `stopping` batch and no unregister; its agents go
//! offline when its presence is older than the gateway window (or their own last sign of life
//! older than the agent window), within one reap interval after that. Every replica reaps;
//! the statement is idempotent.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::{AgentStore, Windows};

/// Gateways silent this long, holding no live agent, are forgotten.
pub const FORGET_GATEWAYS_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Reaps every `interval` until `stop` is cancelled. The first reap waits `grace` (one
/// liveness window after start), so that after a registry outage gateways get the chance to
/// report before their agents are judged.
pub async fn run(
    store: Arc<dyn AgentStore>,
    windows: Windows,
    interval: Duration,
    grace: Duration,
    stop: CancellationToken,
) {
    tokio::select! {
        () = stop.cancelled() => return,
        () = tokio::time::sleep(grace) => {}
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        match store.reap(&windows, FORGET_GATEWAYS_AFTER).await {
            Ok(reaped) if !reaped.is_empty() => {
                tracing::info!(count = reaped.len(), agents = ?reaped, "agents no longer live: marked offline");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("reaping failed, retrying at the next interval: {e}"),
        }
    }
}
