//! The reaper: marks offline the agents that stopped being live.
//!
//! A gateway killed without a word sends no `stopping` batch and no unregister; its agents go
//! offline when its presence is older than the gateway window (or their own last sign of life
//! older than the agent window), within one reap interval after that. Every replica reaps;
//! the statement is idempotent, and only the replica whose statement changed an agent hears of
//! it.
//!
//! Such a gateway never reports its connections closed either, so for each connection it marks
//! offline the reaper publishes its end into the frames stream, as a gateway would
//! ([`crate::notices`]): the session service fails the tasks placed on it and cancels the
//! tasks it asked for, instead of leaving them `working` until their command timeout. The
//! announcement names the connection, so a client that registered again meanwhile keeps the
//! tasks of its new connection.
//!
//! Silence is only evidence while the registry itself can hear: presence travels on the bus,
//! so while this registry's bus connection is down every gateway looks silent. The reaper
//! therefore reaps only after its bus has answered for a whole liveness window, as it does
//! after its own start. Without this, a NATS restart longer than the window took every live
//! agent offline the moment the registry reconnected, and failed their tasks.
//!
//! Nor is the database's record of it while presence cannot be written there: during a
//! database outage the signs of life wait in memory ([`crate::presence`]), so the reaper does
//! not reap while the last write of presence failed. Without this, a database outage longer
//! than the window took live agents offline when it ended, if the reaper ran before the first
//! flush did.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::notices::Notices;
use crate::store::{AgentStore, Windows};

/// The reason the session service sees for a connection whose gateway went silent.
pub const LIVENESS_EXPIRED: &str = "liveness_expired";

/// Gateways silent this long, holding no live agent, are forgotten.
pub const FORGET_GATEWAYS_AFTER: Duration = Duration::from_secs(24 * 3600);

/// How often agents offline past `forget_offline_after_ms` are deleted at most: the statement
/// reads the offline rows without an index (one would cost every unregistration a write), so
/// it runs far less often than the reaper.
pub const FORGET_AGENTS_EVERY: Duration = Duration::from_secs(60);

/// Agents deleted by one statement at most; a round that deleted this many goes on at the
/// next reap instead of waiting [`FORGET_AGENTS_EVERY`], so a backlog drains in short
/// statements.
pub const FORGET_AGENTS_LIMIT: u32 = 10_000;

/// When the reaper runs.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    /// Between two reaps.
    pub interval: Duration,
    /// Before the first reap, and after the bus answers again (one liveness window).
    pub grace: Duration,
    /// Agents offline and unseen this long are deleted; `None` keeps them.
    pub forget_offline_after: Option<Duration>,
}

/// How long the reaper waits for its bus to flush before it takes the bus as down: far above
/// a flush on a live connection (sub-millisecond locally), far below any liveness window.
const BUS_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether the registry has heard the bus long enough for silence to mean something.
#[derive(Debug)]
struct Hearing {
    /// Since when the bus has answered every probe; `None` while it does not.
    since: Option<Instant>,
}

impl Hearing {
    /// Heard from `start` on: the first window after the start is the start's grace.
    fn new(start: Instant) -> Self {
        Hearing { since: Some(start) }
    }

    /// Records one probe of the bus.
    fn probe(&mut self, reachable: bool, now: Instant) {
        match (reachable, self.since) {
            (true, None) => self.since = Some(now),
            (false, _) => self.since = None,
            (true, Some(_)) => {}
        }
    }

    /// Whether gateways silent now were silent while the registry could hear them: the bus has
    /// answered for at least `window`.
    fn may_reap(&self, now: Instant, window: Duration) -> bool {
        self.since
            .is_some_and(|since| now.saturating_duration_since(since) >= window)
    }
}

/// Reaps every `schedule.interval` until `stop` is cancelled. The first reap waits
/// `schedule.grace` (one liveness window after start), so that after a registry outage
/// gateways get the chance to report before their agents are judged. Every
/// [`forget_period`] it also deletes the agents offline past
/// `schedule.forget_offline_after`.
pub async fn run(
    store: Arc<dyn AgentStore>,
    presence: Arc<crate::presence::PresenceBuffer>,
    notices: Notices,
    windows: Windows,
    schedule: Schedule,
    stop: CancellationToken,
) {
    let Schedule {
        interval,
        grace,
        forget_offline_after,
    } = schedule;
    // The first window after the start is the start's grace (see `Hearing::new`).
    let mut hearing = Hearing::new(Instant::now());
    let mut forget_due = Instant::now();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        // Offline is a fact of the database, not a judgement of silence: no grace needed.
        if let Some(unseen_for) = forget_offline_after
            && Instant::now() >= forget_due
        {
            let more = forget_offline(&*store, unseen_for).await;
            if !more {
                forget_due = Instant::now() + forget_period(unseen_for);
            }
        }
        let reachable = matches!(
            tokio::time::timeout(BUS_PROBE_TIMEOUT, notices.bus.flush()).await,
            Ok(Ok(()))
        );
        let was_hearing = hearing.since.is_some();
        hearing.probe(reachable, Instant::now());
        if was_hearing && !reachable {
            tracing::warn!(
                "the bus does not answer: no agent is reaped until it has answered for a liveness window"
            );
        }
        if !hearing.may_reap(Instant::now(), grace) {
            continue;
        }
        if presence.last_write_failed() {
            tracing::warn!(
                "presence could not be written to the database: no agent is reaped until it is"
            );
            continue;
        }
        match store.reap(&windows, FORGET_GATEWAYS_AFTER).await {
            Ok(reaped) if !reaped.is_empty() => {
                let agents: Vec<&str> = reaped.iter().map(|e| e.agent_id.as_str()).collect();
                tracing::info!(
                    count = reaped.len(),
                    ?agents,
                    "agents no longer live: marked offline"
                );
                notices.announce_all(&reaped, LIVENESS_EXPIRED).await;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("reaping failed, retrying at the next interval: {e}"),
        }
    }
}

/// Between two rounds of deleting long-offline agents: [`FORGET_AGENTS_EVERY`], or a tenth
/// of the time they are kept if that is shorter, so an agent is deleted within 10 % of it.
fn forget_period(unseen_for: Duration) -> Duration {
    FORGET_AGENTS_EVERY.min(unseen_for / 10)
}

/// Deletes one round of agents offline and unseen for `unseen_for`; whether more may be
/// left (the round was full).
async fn forget_offline(store: &dyn AgentStore, unseen_for: Duration) -> bool {
    match store.forget_offline(unseen_for, FORGET_AGENTS_LIMIT).await {
        Ok(0) => false,
        Ok(forgotten) => {
            metrics::counter!("aip_registry_agents_forgotten_total").increment(forgotten);
            tracing::info!(
                count = forgotten,
                unseen_for_s = unseen_for.as_secs(),
                "agents offline and unseen that long: deleted"
            );
            forgotten >= u64::from(FORGET_AGENTS_LIMIT)
        }
        Err(e) => {
            tracing::warn!("deleting long-offline agents failed, retrying later: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(15);

    #[test]
    fn reaps_only_after_hearing_the_bus_for_a_whole_window() {
        let start = Instant::now();
        let mut hearing = Hearing::new(start);
        assert!(!hearing.may_reap(start, WINDOW), "the start's grace");
        assert!(hearing.may_reap(start + WINDOW, WINDOW));

        // The bus goes down: nothing is reaped while it is down.
        hearing.probe(false, start + Duration::from_secs(1));
        assert!(!hearing.may_reap(start + Duration::from_secs(30), WINDOW));

        // Back at 20 s: gateways get one window to report before anyone is judged.
        let back = start + Duration::from_secs(20);
        hearing.probe(true, back);
        hearing.probe(true, back + Duration::from_secs(5));
        assert!(!hearing.may_reap(back + Duration::from_secs(14), WINDOW));
        assert!(hearing.may_reap(back + WINDOW, WINDOW));
    }
}
