//! Which gateway holds each client, so that a frame for the client is published to that
//! gateway's delivery subject (`deliver.{gateway}`).
//!
//! Learnt from the frames a client sends (each names the gateway and the connection it came
//! on) and from the registry's records (of a task's executor, of the candidates of a
//! placement). Of two routes the one of the newer connection wins: gateways name connections
//! by UUIDv7, whose text sorts by creation time, so a late frame from a connection the client
//! left, or a record older than the frame just read, changes nothing, while the record of a
//! device that connected again elsewhere replaces the old route at once. A route is forgotten
//! when its connection's `closed` event is read, and before a frame is sent again (a frame no
//! gateway acknowledged may have gone to a gateway the client left): the registry is then
//! asked ([`crate::engine::Engine`] publishes).
//!
//! A route can be wrong for a moment, when a client moved to another gateway and the session
//! service has neither heard from it nor read its new record: the frame is dropped by the
//! gateway it reached, unacknowledged, and sent again after the outbox's resend delay, to the
//! gateway the registry names then.
//!
//! It also keeps which gateways read [`proto_schemas::sessions::DeliveryBatch`]es, as their
//! frames say (`InboundFrame.delivery_batches`): only those are sent several frames in one
//! message ([`crate::batches`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use proto_schemas::registry::{AgentRecord, AgentStatus};

/// Clients kept at most; past it the table starts again empty (each client is then found in
/// the registry once more).
const MAX_ROUTES: usize = 200_000;

/// Gateways remembered as reading batches at most (ids of gateways gone are forgotten all at
/// once past it; their successors say so again with their next frame).
const MAX_BATCHING_GATEWAYS: usize = 10_000;

/// The routes, by client id.
#[derive(Debug, Default)]
pub struct Routes {
    table: Mutex<HashMap<String, Route>>,
    batching: Mutex<HashSet<String>>,
}

#[derive(Debug, Clone)]
struct Route {
    gateway_id: String,
    connection_id: String,
}

impl Routes {
    /// `client_id` sent a frame on `connection_id` through `gateway_id`.
    pub fn heard(&self, client_id: &str, gateway_id: &str, connection_id: &str) {
        self.learn(client_id, gateway_id, connection_id);
    }

    /// The registry's record of a client (nothing if it is offline).
    pub fn found(&self, record: &AgentRecord) {
        if record.status != AgentStatus::Offline {
            self.learn(&record.agent_id, &record.gateway_id, &record.connection_id);
        }
    }

    /// Keeps the route unless the one known is of a newer connection.
    fn learn(&self, client_id: &str, gateway_id: &str, connection_id: &str) {
        let mut table = self.lock();
        if let Some(route) = table.get(client_id)
            && route.connection_id.as_str() >= connection_id
        {
            return;
        }
        make_room(&mut table, client_id);
        table.insert(
            client_id.to_owned(),
            Route {
                gateway_id: gateway_id.to_owned(),
                connection_id: connection_id.to_owned(),
            },
        );
    }

    /// `connection_id` of `client_id` ended: its route goes, unless a newer one replaced it.
    pub fn closed(&self, client_id: &str, connection_id: &str) {
        let mut table = self.lock();
        if table
            .get(client_id)
            .is_some_and(|r| r.connection_id == connection_id)
        {
            table.remove(client_id);
        }
    }

    /// Forgets `client_id`'s route: the registry is asked next time.
    pub fn forget(&self, client_id: &str) {
        self.lock().remove(client_id);
    }

    /// The gateway holding `client_id`, if known.
    pub fn gateway(&self, client_id: &str) -> Option<String> {
        self.lock().get(client_id).map(|r| r.gateway_id.clone())
    }

    /// A frame from `gateway_id` said that it reads delivery batches.
    pub fn reads_batches(&self, gateway_id: &str) {
        let mut batching = self.batching.lock().unwrap_or_else(|p| p.into_inner());
        if batching.contains(gateway_id) {
            return;
        }
        if batching.len() >= MAX_BATCHING_GATEWAYS {
            batching.clear();
        }
        batching.insert(gateway_id.to_owned());
    }

    /// Whether `gateway_id` is known to read delivery batches.
    pub fn takes_batches(&self, gateway_id: &str) -> bool {
        self.batching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(gateway_id)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Route>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn make_room(table: &mut HashMap<String, Route>, client_id: &str) {
    if table.len() >= MAX_ROUTES && !table.contains_key(client_id) {
        table.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, gateway: &str, connection: &str) -> AgentRecord {
        let mut record = aip_testkit::device_record(id);
        record.gateway_id = gateway.to_owned();
        record.connection_id = connection.to_owned();
        record
    }

    #[test]
    fn the_newer_connection_wins_and_an_end_removes_only_its_own_route() {
        let routes = Routes::default();
        // Connection ids as gateways make them (UUIDv7), one second apart.
        let [c1, c2, c3] = [1, 2, 3].map(|second| {
            let at = uuid::Timestamp::from_unix(uuid::NoContext, 1_800_000_000 + second, 0);
            uuid::Uuid::new_v7(at).to_string()
        });
        routes.found(&record("pc", "gw-a", &c1));
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-a"));
        // The client moved: its frame says so, and an older record does not undo it, nor
        // does a late frame from the connection it left.
        routes.heard("pc", "gw-b", &c2);
        routes.found(&record("pc", "gw-a", &c1));
        routes.heard("pc", "gw-a", &c1);
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-b"));
        // It moved again: the registry's record says so before any frame of it.
        routes.found(&record("pc", "gw-c", &c3));
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-c"));
        // The old connections' ends come late: the newest route stays.
        routes.closed("pc", &c1);
        routes.closed("pc", &c2);
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-c"));
        routes.closed("pc", &c3);
        assert_eq!(routes.gateway("pc"), None);
    }

    #[test]
    fn only_a_gateway_whose_frames_said_so_is_sent_batches() {
        let routes = Routes::default();
        routes.heard("pc", "gw-old", "c1");
        assert!(
            !routes.takes_batches("gw-old"),
            "a gateway of an earlier version"
        );
        routes.reads_batches("gw-new");
        assert!(routes.takes_batches("gw-new"));
        assert!(!routes.takes_batches("gw-old"));
    }

    #[test]
    fn offline_records_give_no_route_and_forgetting_asks_again() {
        let routes = Routes::default();
        let mut offline = record("pc", "gw-a", "c1");
        offline.status = AgentStatus::Offline;
        routes.found(&offline);
        assert_eq!(routes.gateway("pc"), None);
        routes.heard("pc", "gw-a", "c1");
        routes.forget("pc");
        assert_eq!(routes.gateway("pc"), None);
    }
}
