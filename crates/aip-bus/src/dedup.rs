//! Remembering recent message ids, to drop duplicates.

use std::collections::{HashSet, VecDeque};

/// The last `capacity` ids seen; older ones are forgotten.
#[derive(Debug)]
pub struct RecentIds {
    capacity: usize,
    set: HashSet<String>,
    order: VecDeque<String>,
}

impl RecentIds {
    /// Remembers up to `capacity` ids.
    pub fn new(capacity: usize) -> Self {
        RecentIds {
            capacity,
            set: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// Whether `id` is among the recent ones.
    pub fn contains(&self, id: &str) -> bool {
        self.set.contains(id)
    }

    /// Records `id`; false if it is among the recent ones (a duplicate).
    pub fn first_time(&mut self, id: &str) -> bool {
        if self.set.contains(id) {
            return false;
        }
        self.set.insert(id.to_owned());
        self.order.push_back(id.to_owned());
        if self.order.len() > self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::RecentIds;

    #[test]
    fn remembers_a_bounded_window() {
        let mut ids = RecentIds::new(2);
        assert!(ids.first_time("a"));
        assert!(!ids.first_time("a"));
        assert!(ids.first_time("b"));
        assert!(ids.first_time("c"));
        assert!(ids.first_time("a"), "forgotten after two newer ones");
    }
}
