//! The reaper: marks offline the agents that stopped being live.
//!
//! A gateway killed without a word sends no `stopping` batch and no unregister; its agents go
//! offline when its presence is older than the gateway window (or their own last sign of life
//! older than the agent window), within one reap interval after that. Every replica reaps;
//! the statement is idempotent, and only the replica whose statement changed an agent hears of
//! it.
//!
//! Such a gateway never reports its connections closed either, so for each agent it marks
//! offline the reaper publishes the end of the agent's connection into the frames stream, as a
//! gateway would: the session service fails the tasks it executes and cancels the tasks it
//! asked for, instead of leaving them `working` until their command timeout.

use std::sync::Arc;
use std::time::Duration;

use aip_bus::{BusError, Headers, SharedBus, names};
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent};
use proto_schemas::{Subjects, V1};
use tokio_util::sync::CancellationToken;

use crate::store::{AgentStore, Windows};

/// The reason the session service sees for a connection whose gateway went silent.
pub const LIVENESS_EXPIRED: &str = "liveness_expired";

/// Where the reaper tells the session service of connections that ended unreported.
#[derive(Clone)]
pub struct Notices {
    /// The bus with the frames stream.
    pub bus: SharedBus,
    /// The deployment's subjects.
    pub subjects: Subjects,
}

/// Gateways silent this long, holding no live agent, are forgotten.
pub const FORGET_GATEWAYS_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Reaps every `interval` until `stop` is cancelled. The first reap waits `grace` (one
/// liveness window after start), so that after a registry outage gateways get the chance to
/// report before their agents are judged.
pub async fn run(
    store: Arc<dyn AgentStore>,
    notices: Notices,
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
                for agent_id in &reaped {
                    announce_end(store.as_ref(), &notices, agent_id).await;
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("reaping failed, retrying at the next interval: {e}"),
        }
    }
}

/// Publishes the end of a reaped agent's connection into the frames stream, de-duplicated on
/// its connection id (so a gateway's own report, or a second reap, changes nothing twice).
/// A failure is logged: the tasks then end at their own deadlines, as before.
async fn announce_end(store: &dyn AgentStore, notices: &Notices, agent_id: &str) {
    let agent = match store.get(agent_id).await {
        Ok(Some(agent)) => agent,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(agent = %agent_id, "cannot read a reaped agent to end its tasks: {e}");
            return;
        }
    };
    let event = GatewayEvent::Closed(ConnectionClosed {
        version: V1,
        gateway_id: agent.gateway_id.clone(),
        connection_id: agent.connection_id.clone(),
        client_id: agent.agent_id.clone(),
        client_type: agent.client_type,
        reason: LIVENESS_EXPIRED.to_owned(),
    });
    let body = match serde_json::to_vec(&event) {
        Ok(body) => body,
        Err(e) => {
            tracing::error!(agent = %agent_id, "the end of a reaped connection could not be encoded: {e}");
            return;
        }
    };
    let msg_id = format!("{}:{LIVENESS_EXPIRED}", agent.connection_id);
    let headers = Headers::new().with(names::MSG_ID, msg_id);
    let subject = notices.subjects.frames(agent_id);
    match notices
        .bus
        .publish_durable(subject, headers, body.into())
        .await
    {
        Ok(()) => {}
        Err(BusError::NoStream { .. }) => {
            tracing::debug!("no frames stream (no session service has started): nothing to end");
        }
        Err(e) => {
            tracing::warn!(agent = %agent_id, "the end of a reaped connection was not published: {e}")
        }
    }
}
