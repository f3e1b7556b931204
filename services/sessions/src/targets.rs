//! The registry's records of recent explicit targets, kept for a moment.
//!
//! A constellation's task names its device, and the registry says whether that device is
//! connected and on which connection: a request over the bus and a database read, the
//! largest single step of a task at one client (about 0.9 ms of 3.3). A device that runs one
//! task after another is asked about again and again, so the answer is kept for [`FRESH_FOR`].
//!
//! A kept record can only be wrong one way: the device's connection ended. A gateway announces
//! the end of every connection that sent the session service a frame or was sent one, as a
//! `closed` event in the frames stream (so does the registry when the gateway is gone or the
//! device registered again), and the consumer forgets the device's record as it reads one.
//! The end of a connection that did neither is not announced (the gateway's `events` module),
//! so a record is used only once a frame came from its connection ([`TargetCache::heard`]):
//! the task its lookup was for sent a command there, and the device answered. Until then the
//! registry is asked each time. A task prepared with a record that was already stale is
//! caught when it is applied: the leader remembers the connections that closed and refuses
//! to start a task on one (`Machine::choose`), as the registry would have. A lookup that was
//! under way when the record was forgotten does not put its answer back. Only devices that
//! can take a task are kept: an unknown or offline target is asked about every time, so a
//! device that comes online is found at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use proto_schemas::ClientType;
use proto_schemas::registry::{AgentRecord, AgentStatus};

/// How long a record is used without asking the registry again.
pub const FRESH_FOR: Duration = Duration::from_secs(2);

/// Records (and forgotten devices) kept at most; past it, the old ones go, then all.
pub const MAX_KEPT: usize = 16_384;

/// What is known of one device.
#[derive(Debug)]
enum Slot {
    /// The registry's record (boxed: most slots are forgotten devices), when it was asked for,
    /// and whether a frame came from its connection since (only then is it used).
    Known(Box<AgentRecord>, Instant, bool),
    /// A connection of this device ended at this time: answers asked for before it are stale.
    Forgotten(Instant),
}

/// The records, by agent id.
#[derive(Debug, Default)]
pub struct TargetCache {
    slots: HashMap<String, Slot>,
    /// Everything was dropped at this time (the bound was reached): older answers are stale.
    cleared_at: Option<Instant>,
}

impl TargetCache {
    /// A fresh record of `agent_id`, if one is kept.
    pub fn get(&self, agent_id: &str, now: Instant) -> Option<&AgentRecord> {
        match self.slots.get(agent_id)? {
            Slot::Known(record, asked, true) if now.duration_since(*asked) < FRESH_FOR => {
                Some(record)
            }
            Slot::Known(..) | Slot::Forgotten(_) => None,
        }
    }

    /// Keeps `record`, the registry's answer to a lookup begun at `asked`, unless a connection
    /// of the device ended since (the answer may predate the end) or it cannot take a task.
    pub fn put(&mut self, record: &AgentRecord, asked: Instant) {
        if record.status == AgentStatus::Offline || record.client_type != ClientType::Device {
            self.slots.remove(&record.agent_id);
            return;
        }
        if self.cleared_at.is_some_and(|at| asked <= at) {
            return;
        }
        let newer = match self.slots.get(&record.agent_id) {
            None => true,
            Some(Slot::Known(_, at, _)) => *at <= asked,
            Some(Slot::Forgotten(at)) => *at < asked,
        };
        if newer {
            self.make_room(asked);
            self.slots.insert(
                record.agent_id.clone(),
                Slot::Known(Box::new(record.clone()), asked, false),
            );
        }
    }

    /// A frame came from `connection_id` of `agent_id`: its gateway will announce the
    /// connection's end, so a kept record of that connection may be used from now on.
    pub fn heard(&mut self, agent_id: &str, connection_id: &str) {
        if let Some(Slot::Known(record, _, heard)) = self.slots.get_mut(agent_id)
            && record.connection_id == connection_id
        {
            *heard = true;
        }
    }

    /// A connection of `agent_id` ended at `now`: its record is no longer used, and lookups
    /// begun before now do not bring it back.
    pub fn forget(&mut self, agent_id: &str, now: Instant) {
        self.make_room(now);
        self.slots.insert(agent_id.to_owned(), Slot::Forgotten(now));
    }

    /// Below the bound: drops what is older than [`FRESH_FOR`] (a forgotten device's lookups
    /// have all returned by then), and everything if that is not enough.
    fn make_room(&mut self, now: Instant) {
        if self.slots.len() < MAX_KEPT {
            return;
        }
        self.slots.retain(|_, slot| match slot {
            Slot::Known(_, at, _) | Slot::Forgotten(at) => now.duration_since(*at) < FRESH_FOR,
        });
        if self.slots.len() >= MAX_KEPT {
            self.slots.clear();
            self.cleared_at = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str, connection: &str) -> AgentRecord {
        let mut record = aip_testkit::device_record(id);
        record.connection_id = connection.to_owned();
        record
    }

    /// Keeps `record` and hears a frame from its connection, so it is used.
    fn put_heard(cache: &mut TargetCache, record: &AgentRecord, asked: Instant) {
        cache.put(record, asked);
        cache.heard(&record.agent_id, &record.connection_id);
    }

    #[test]
    fn a_record_is_used_while_fresh() {
        let mut cache = TargetCache::default();
        let t0 = Instant::now();
        put_heard(&mut cache, &device("d1", "c1"), t0);
        assert_eq!(cache.get("d1", t0).expect("kept").connection_id, "c1");
        assert_eq!(
            cache
                .get("d1", t0 + FRESH_FOR / 2)
                .expect("still fresh")
                .connection_id,
            "c1"
        );
        assert!(
            cache.get("d1", t0 + FRESH_FOR).is_none(),
            "stale: ask again"
        );
        assert!(cache.get("d2", t0).is_none());
    }

    #[test]
    fn a_record_is_used_only_once_its_connection_sent_a_frame() {
        // Its gateway announces the end of such a connection only.
        let mut cache = TargetCache::default();
        let t0 = Instant::now();
        cache.put(&device("d1", "c1"), t0);
        assert!(cache.get("d1", t0).is_none(), "no frame from c1 yet");
        cache.heard("d1", "c0");
        assert!(
            cache.get("d1", t0).is_none(),
            "a frame from another connection"
        );
        cache.heard("d1", "c1");
        assert_eq!(cache.get("d1", t0).expect("used").connection_id, "c1");
        // A newer lookup's record of another connection waits for a frame of its own.
        let later = t0 + Duration::from_millis(1);
        cache.put(&device("d1", "c2"), later);
        assert!(cache.get("d1", later).is_none());
    }

    #[test]
    fn a_closed_connection_forgets_the_device_and_older_answers_stay_out() {
        let mut cache = TargetCache::default();
        let t0 = Instant::now();
        put_heard(&mut cache, &device("d1", "c1"), t0);
        let closed = t0 + Duration::from_millis(5);
        cache.forget("d1", closed);
        assert!(cache.get("d1", closed).is_none());
        // A lookup begun before the end answers late: it may still name the old connection.
        put_heard(
            &mut cache,
            &device("d1", "c1"),
            t0 + Duration::from_millis(1),
        );
        assert!(cache.get("d1", closed).is_none());
        // A lookup begun after it is kept.
        let later = closed + Duration::from_millis(1);
        put_heard(&mut cache, &device("d1", "c2"), later);
        assert_eq!(cache.get("d1", later).expect("kept").connection_id, "c2");
    }

    #[test]
    fn only_devices_that_can_take_a_task_are_kept() {
        let mut cache = TargetCache::default();
        let t0 = Instant::now();
        let mut offline = device("d1", "c1");
        offline.status = AgentStatus::Offline;
        cache.put(&offline, t0);
        assert!(cache.get("d1", t0).is_none());
        let mut constellation = device("g1", "c2");
        constellation.client_type = ClientType::Constellation;
        put_heard(&mut cache, &constellation, t0);
        assert!(cache.get("g1", t0).is_none());
        // An offline answer also drops what was kept.
        put_heard(&mut cache, &device("d1", "c1"), t0);
        cache.put(&offline, t0);
        assert!(cache.get("d1", t0).is_none());
    }

    #[test]
    fn memory_is_bounded_and_clearing_keeps_older_answers_out() {
        let mut cache = TargetCache::default();
        let t0 = Instant::now();
        for i in 0..MAX_KEPT + 10 {
            cache.put(&device(&format!("d{i}"), "c"), t0);
        }
        assert!(cache.slots.len() <= MAX_KEPT);
        // Everything was as fresh as everything else: it all went, and an answer to a lookup
        // begun before that does not come back.
        put_heard(&mut cache, &device("late", "c"), t0);
        assert!(cache.get("late", t0).is_none());
        let later = t0 + Duration::from_millis(1);
        put_heard(&mut cache, &device("late", "c"), later);
        assert!(cache.get("late", later).is_some());
    }
}
