//! Which gateway holds each client, so that a frame for the client is published to that
//! gateway's delivery subject (`deliver.{gateway}`).
//!
//! Learnt, newest first, from the frames a client sends (each names the gateway and the
//! connection it came on); else from the registry's records (of a task's executor, of the
//! candidates of a placement), which never replace what a frame said. A route is forgotten
//! when its connection's `closed` event is read, and before a frame is sent again (a frame no
//! gateway acknowledged may have gone to a gateway the client left): the registry is then
//! asked ([`crate::engine::Engine`] publishes).
//!
//! A route can be wrong for a moment, when a client moved to another gateway and the session
//! service has not heard yet: the frame is dropped by the gateway it reached, unacknowledged,
//! and sent again after the outbox's resend delay, to the gateway the registry names then.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use proto_schemas::registry::{AgentRecord, AgentStatus};

/// Clients kept at most; past it the table starts again empty (each client is then found in
/// the registry once more).
const MAX_ROUTES: usize = 200_000;

/// The routes, by client id.
#[derive(Debug, Default)]
pub struct Routes {
    table: Mutex<HashMap<String, Route>>,
}

#[derive(Debug, Clone)]
struct Route {
    gateway_id: String,
    connection_id: String,
}

impl Routes {
    /// `client_id` sent a frame on `connection_id` through `gateway_id`: its newest route.
    pub fn heard(&self, client_id: &str, gateway_id: &str, connection_id: &str) {
        let mut table = self.lock();
        if let Some(route) = table.get(client_id)
            && route.connection_id == connection_id
            && route.gateway_id == gateway_id
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

    /// The registry's record of a client: its route, unless one is known (a frame the client
    /// sent is newer than any record) or it is offline.
    pub fn found(&self, record: &AgentRecord) {
        if record.status == AgentStatus::Offline {
            return;
        }
        let mut table = self.lock();
        if table.contains_key(&record.agent_id) {
            return;
        }
        make_room(&mut table, &record.agent_id);
        table.insert(
            record.agent_id.clone(),
            Route {
                gateway_id: record.gateway_id.clone(),
                connection_id: record.connection_id.clone(),
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
    fn a_frame_outranks_a_record_and_an_end_removes_only_its_own_route() {
        let routes = Routes::default();
        routes.found(&record("pc", "gw-a", "c1"));
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-a"));
        // The client moved: its frame says so, and an older record does not undo it.
        routes.heard("pc", "gw-b", "c2");
        routes.found(&record("pc", "gw-a", "c1"));
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-b"));
        // The old connection's end comes late: the new route stays.
        routes.closed("pc", "c1");
        assert_eq!(routes.gateway("pc").as_deref(), Some("gw-b"));
        routes.closed("pc", "c2");
        assert_eq!(routes.gateway("pc"), None);
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
