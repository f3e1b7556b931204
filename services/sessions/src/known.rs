//! The task ids the database may hold, so that a new task's id is looked up there only when
//! it may be taken.
//!
//! A `task` frame that names its `session_id` (Galaxy's always do) must be refused when that
//! id belongs to a task that has ended and left the leader's memory. Asking the database for
//! every such frame cost a read per chunk of frames: 500 µs of a task's latency at one client,
//! and an eighth of a core at 100 clients. Almost every id is new, so the leader keeps a Bloom
//! filter of the ids it may have written: an id the filter has never seen is not in the
//! database, and only the others are looked up.
//!
//! The filter is built again at the start of every term of leadership, from the ids in the
//! database (read page by page beside the leader's work), plus every id the leader writes
//! meanwhile (added before its group is written). Until it is built, every id is looked up, as
//! before. Its memory is fixed ([`KnownIds::new`]); past the ids it was sized for, more ids
//! are looked up (more false positives), never fewer.

use std::sync::Mutex;

use fastbloom::BloomFilter;

/// Ids the filter is sized for per MiB: 2,000,000 ids in 4 MiB gave 0.03 % false positives,
/// twice as many 3 %.
const IDS_PER_MIB: usize = 500_000;

/// Ids written while the filter is being built that are kept to add to it once built; past
/// this many the filter is given up for the term (every id is looked up).
const ADDED_WHILE_LOADING: usize = 1_000_000;

/// What the leader knows of the ids in the database.
#[derive(Debug)]
pub struct KnownIds {
    /// The filter's size in bits; 0: no filter, every id is looked up.
    bits: usize,
    state: Mutex<State>,
}

#[derive(Debug)]
enum State {
    /// No term has started, or the filter is off or was given up: every id may be taken.
    Unknown,
    /// The term's filter is being built: the ids written meanwhile.
    Loading { term: u64, added: Vec<String> },
    /// Built: an id it does not hold is not in the database.
    Ready(BloomFilter),
}

impl KnownIds {
    /// A filter of `bytes` bytes (rounded to whole 64-bit words); 0 turns it off.
    pub fn new(bytes: usize) -> Self {
        KnownIds {
            bits: bytes / 8 * 64,
            state: Mutex::new(State::Unknown),
        }
    }

    /// Starts a term of leadership: the filter is built anew. `None` if it is off.
    pub fn begin_term(&self, term: u64) -> Option<BloomFilter> {
        if self.bits == 0 {
            return None;
        }
        *self.lock() = State::Loading {
            term,
            added: Vec::new(),
        };
        let items = (self.bits / 8 * IDS_PER_MIB / (1 << 20)).max(1);
        Some(BloomFilter::with_num_bits(self.bits).expected_items(items))
    }

    /// The filter of `term` holds every id the database held when its reading began: with
    /// the ids written since, it answers from now on (unless the term has changed).
    pub fn loaded(&self, term: u64, mut filter: BloomFilter) {
        let mut state = self.lock();
        match &mut *state {
            State::Loading {
                term: loading,
                added,
            } if *loading == term => {
                for id in added.drain(..) {
                    filter.insert(id.as_str());
                }
                *state = State::Ready(filter);
            }
            _ => {}
        }
    }

    /// Ids about to be written: from now on they may be taken.
    pub fn add<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        let mut state = self.lock();
        match &mut *state {
            State::Unknown => {}
            State::Ready(filter) => {
                for id in ids {
                    filter.insert(id);
                }
            }
            State::Loading { added, .. } => {
                added.extend(ids.into_iter().map(str::to_owned));
                if added.len() > ADDED_WHILE_LOADING {
                    tracing::warn!(
                        "more than {ADDED_WHILE_LOADING} tasks written before the known task ids were read: every new task's id is looked up in the database this term"
                    );
                    *state = State::Unknown;
                }
            }
        }
    }

    /// The term of leadership ended: until the next, every id may be taken (another replica
    /// may lead meanwhile and write ids this filter never sees).
    pub fn end_term(&self) {
        *self.lock() = State::Unknown;
    }

    /// Whether the database may hold a task with this id (false: it certainly does not).
    pub fn may_hold(&self, id: &str) -> bool {
        match &*self.lock() {
            State::Ready(filter) => filter.contains(id),
            State::Unknown | State::Loading { .. } => true,
        }
    }

    /// Whether the filter answers (it is built for the current term).
    pub fn ready(&self) -> bool {
        matches!(&*self.lock(), State::Ready(_))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is replaced whole under the lock, so a panic elsewhere cannot leave it
        // half changed.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}-{i}")).collect()
    }

    #[test]
    fn off_or_not_built_every_id_may_be_taken() {
        let off = KnownIds::new(0);
        assert!(off.begin_term(1).is_none());
        assert!(off.may_hold("anything"));
        let known = KnownIds::new(1 << 16);
        assert!(known.may_hold("before any term"));
        let _filter = known.begin_term(1).expect("a filter");
        assert!(known.may_hold("while it is built"));
        assert!(!known.ready());
    }

    #[test]
    fn ids_read_and_ids_written_meanwhile_are_held_and_new_ones_mostly_not() {
        let known = KnownIds::new(1 << 16);
        let mut filter = known.begin_term(7).expect("a filter");
        let read = ids("read", 2_000);
        for id in &read {
            filter.insert(id.as_str());
        }
        let written = ids("written", 500);
        known.add(written.iter().map(String::as_str));
        known.loaded(7, filter);
        assert!(known.ready());
        let later = ids("later", 500);
        known.add(later.iter().map(String::as_str));
        for id in read.iter().chain(&written).chain(&later) {
            assert!(known.may_hold(id), "{id} was written, so it may be taken");
        }
        let new = ids("new", 10_000);
        let false_positives = new.iter().filter(|id| known.may_hold(id)).count();
        assert!(
            false_positives < 100,
            "{false_positives} of 10,000 new ids were taken for known ones"
        );
    }

    #[test]
    fn a_filter_built_for_an_earlier_term_is_not_used() {
        let known = KnownIds::new(1 << 16);
        let stale = known.begin_term(1).expect("a filter");
        let _current = known.begin_term(2).expect("a filter");
        known.loaded(1, stale);
        assert!(!known.ready());
        assert!(known.may_hold("an id the stale filter never saw"));
    }

    #[test]
    fn too_many_ids_written_while_building_gives_the_filter_up_for_the_term() {
        let known = KnownIds::new(1 << 16);
        let filter = known.begin_term(3).expect("a filter");
        let many = ids("w", ADDED_WHILE_LOADING + 1);
        known.add(many.iter().map(String::as_str));
        known.loaded(3, filter);
        assert!(!known.ready());
        assert!(known.may_hold("anything"));
    }
}
