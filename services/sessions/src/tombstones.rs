//! Ids of tasks that ended recently.
//!
//! An ended task leaves the leader's memory once its end is committed, but its id stays
//! reserved here for a while: a request prepared before that commit (its database read found
//! no row yet) must not reuse the id when it reaches the leader.
//!
//! The record has a fixed size, allocated once: ids are kept as 128-bit keyed hashes, not
//! strings, so its memory neither grows with the task rate nor steps when a table doubles.
//! Two ids share a hash with a probability near 2⁻¹²⁸ per pair, and the keys are drawn at
//! random per process, so no client can craft a collision.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

/// How long an ended task's id stays reserved: longer than a request takes from its
/// preparation (which read the database) to the leader.
pub const TOMBSTONE_MS: i64 = 120_000;
/// How many ids are reserved at most; beyond it the oldest go first. Bounds the memory
/// (about 17 MiB) under any task rate.
pub const TOMBSTONE_MAX: usize = 200_000;

/// A task id as kept here.
type Key = [u64; 2];

/// Whose task an id was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The same requester asks again.
    Same,
    /// Another requester owned it.
    Other,
}

/// The reserved ids, oldest first.
#[derive(Debug)]
pub struct Tombstones {
    /// Id → its owner's hash. Sized for twice the bound: a table at most half full cleans
    /// out removed entries in place instead of growing.
    owners: HashMap<Key, u32>,
    /// (ended at, id), in the order they ended.
    order: VecDeque<(i64, Key)>,
    keys: [RandomState; 2],
    owner_key: RandomState,
    window_ms: i64,
    max: usize,
}

impl Default for Tombstones {
    fn default() -> Self {
        Tombstones::new(TOMBSTONE_MS, TOMBSTONE_MAX)
    }
}

impl Tombstones {
    /// A record keeping ids `window_ms` long, at most `max` of them.
    pub fn new(window_ms: i64, max: usize) -> Self {
        Tombstones {
            owners: HashMap::with_capacity(2 * (max + 1)),
            order: VecDeque::with_capacity(max + 1),
            keys: [RandomState::new(), RandomState::new()],
            owner_key: RandomState::new(),
            window_ms,
            max,
        }
    }

    /// An owner as kept here: enough to tell "yours" from "another's" in a refusal's text.
    fn owner_hash(&self, owner: &str) -> u32 {
        self.owner_key.hash_one(owner) as u32
    }

    fn key(&self, task_id: &str) -> Key {
        [
            self.keys[0].hash_one(task_id),
            self.keys[1].hash_one(task_id),
        ]
    }

    /// Reserves `task_id`, which `owner` held, from `now`; forgets what is older than the
    /// window or beyond the bound.
    pub fn add(&mut self, task_id: &str, owner: &str, now: i64) {
        let key = self.key(task_id);
        self.owners.insert(key, self.owner_hash(owner));
        self.order.push_back((now, key));
        while let Some(&(at, oldest)) = self.order.front() {
            if at >= now - self.window_ms && self.order.len() <= self.max {
                break;
            }
            // An id ends once: the database refuses to start a task under a used id.
            self.order.pop_front();
            self.owners.remove(&oldest);
        }
    }

    /// Whether `task_id` is reserved, and whether `requester` owned it.
    pub fn owner(&self, task_id: &str, requester: &str) -> Option<Owner> {
        let owner = self.owners.get(&self.key(task_id))?;
        Some(if *owner == self.owner_hash(requester) {
            Owner::Same
        } else {
            Owner::Other
        })
    }

    /// Ids reserved now.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no id is reserved now.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_reserved_for_the_window_and_knows_its_owner() {
        let mut stones = Tombstones::new(1_000, 10);
        assert!(stones.is_empty());
        stones.add("t1", "alice", 0);
        assert_eq!(stones.owner("t1", "alice"), Some(Owner::Same));
        assert_eq!(stones.owner("t1", "bob"), Some(Owner::Other));
        assert_eq!(stones.owner("t2", "alice"), None);
        stones.add("t2", "bob", 1_000);
        assert_eq!(
            stones.owner("t1", "alice"),
            Some(Owner::Same),
            "still inside the window"
        );
        stones.add("t3", "bob", 1_001);
        assert_eq!(stones.owner("t1", "alice"), None, "out of the window");
        assert_eq!(stones.owner("t2", "bob"), Some(Owner::Same));
        assert_eq!(stones.len(), 2);
    }

    #[test]
    fn the_oldest_go_first_beyond_the_bound_and_memory_is_allocated_once() {
        let mut stones = Tombstones::new(i64::MAX / 2, 1_000);
        let (owners, order) = (stones.owners.capacity(), stones.order.capacity());
        for i in 0..50_000 {
            stones.add(&format!("task-{i}"), "me", i);
        }
        assert_eq!(stones.len(), 1_000);
        assert_eq!(stones.owner("task-48999", "me"), None);
        assert_eq!(stones.owner("task-49000", "me"), Some(Owner::Same));
        // Removed entries take room until the table is cleaned in place, so its capacity can
        // read lower for a while; it never reads higher.
        assert!(stones.owners.capacity() <= owners, "the table never grows");
        assert_eq!(stones.order.capacity(), order, "the queue never grows");
    }
}
