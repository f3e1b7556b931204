//! The budget of inbound bytes in flight: client frames read but not yet handled, across
//! every connection of the gateway.
//!
//! A connection reads one frame at a time and handles it (publishes it to the bus and waits
//! for the stream to store it, or answers it) before reading the next, so each connection
//! holds at most one frame. With many connections sending large frames at once that is still
//! many frames, each held several times over while it is parsed, wrapped and published. The
//! budget bounds their sum: before handling a frame, its connection takes the frame's size
//! from the budget, waiting (and reading nothing more from its socket) until there is room;
//! the size is given back when the frame has been handled. A frame larger than the whole
//! budget takes all of it, so it waits until it is alone and then goes through: no frame the
//! size limit allows is refused, and nothing deadlocks, since a connection never holds budget
//! while it waits for more.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget counts whole KiB (a semaphore's permits are counted in `u32` per acquisition).
const UNIT: usize = 1024;

/// The bytes of client frames in flight, bounded.
#[derive(Debug)]
pub struct InboundBudget {
    units: Arc<Semaphore>,
    /// The budget in units: what a frame larger than the budget takes.
    capacity: u32,
    /// Bytes of the frames in flight now (the `aip_gateway_inbound_bytes_in_flight` gauge).
    in_flight: AtomicUsize,
    /// The most bytes that were ever in flight at once.
    peak: AtomicUsize,
    /// Frames that had to wait for room.
    waits: AtomicU64,
}

/// One frame's share of the budget, given back when dropped.
#[derive(Debug)]
pub struct InFlight {
    budget: Arc<InboundBudget>,
    bytes: usize,
    /// `None` only if the semaphore were closed, which it never is.
    _units: Option<OwnedSemaphorePermit>,
}

impl InboundBudget {
    /// A budget of `bytes` (rounded down to whole KiB, at least one).
    pub fn new(bytes: usize) -> Arc<Self> {
        let capacity = u32::try_from(bytes / UNIT).unwrap_or(u32::MAX).max(1);
        Arc::new(InboundBudget {
            units: Arc::new(Semaphore::new(capacity as usize)),
            capacity,
            in_flight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
        })
    }

    /// Takes room for a frame of `bytes`, waiting until there is some. Waiters are served in
    /// order, so a large frame is not overtaken forever by small ones.
    pub async fn admit(self: &Arc<Self>, bytes: usize) -> InFlight {
        let units = self.units_for(bytes);
        let permit = match self.units.clone().try_acquire_many_owned(units) {
            Ok(permit) => Some(permit),
            Err(_) => {
                self.waits.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("aip_gateway_inbound_budget_waits_total").increment(1);
                // Fails only on a closed semaphore, and this one is never closed.
                self.units.clone().acquire_many_owned(units).await.ok()
            }
        };
        let now = self.in_flight.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        metrics::gauge!("aip_gateway_inbound_bytes_in_flight").increment(bytes as f64);
        InFlight {
            budget: self.clone(),
            bytes,
            _units: permit,
        }
    }

    fn units_for(&self, bytes: usize) -> u32 {
        let units = u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX);
        units.clamp(1, self.capacity)
    }

    /// Bytes of the frames in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The most bytes that were in flight at once since the gateway started.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// How many frames had to wait for room.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.budget
            .in_flight
            .fetch_sub(self.bytes, Ordering::Relaxed);
        metrics::gauge!("aip_gateway_inbound_bytes_in_flight").decrement(self.bytes as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_frame_waits_for_room_and_gets_it_when_another_is_handled() {
        let budget = InboundBudget::new(10 * UNIT);
        let first = budget.admit(6 * UNIT).await;
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.admit(6 * UNIT).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "no room for the second frame yet");
        assert_eq!(budget.in_flight(), 6 * UNIT);
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("admitted once the first is handled")
            .expect("joined");
        assert_eq!(budget.in_flight(), 6 * UNIT);
        assert_eq!(budget.peak(), 6 * UNIT);
        assert_eq!(budget.waits(), 1);
        drop(second);
        assert_eq!(budget.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_frame_larger_than_the_budget_goes_alone() {
        let budget = InboundBudget::new(4 * UNIT);
        let small = budget.admit(UNIT).await;
        let large = tokio::spawn({
            let budget = budget.clone();
            async move { budget.admit(100 * UNIT).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!large.is_finished(), "waits until it is alone");
        drop(small);
        let large = tokio::time::timeout(Duration::from_secs(5), large)
            .await
            .expect("goes through alone")
            .expect("joined");
        assert_eq!(budget.in_flight(), 100 * UNIT);
        drop(large);
        assert_eq!(budget.in_flight(), 0);
    }
}
