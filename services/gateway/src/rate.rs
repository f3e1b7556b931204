//! The rates of one connection: frames per second (a token bucket, and what a client over
//! it is told) and bytes per second (a token bucket that pauses reading instead).

use std::time::Instant;

/// A full bucket holds this many seconds' worth of frames, so a client may send a burst
/// (a task's results after a long step) without being refused.
const BURST_SECONDS: f64 = 2.0;

/// A client refused more than this many frames in a row (or more than one second's worth,
/// if that is more) is closed: it ignores the RATE_LIMITED errors.
const MIN_REFUSALS_BEFORE_CLOSE: u32 = 10;

/// Allows `rate` frames per second on average, bursts of up to [`BURST_SECONDS`] of that.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    capacity: f64,
    tokens: f64,
    last: Instant,
}

impl RateLimiter {
    /// A full bucket for `rate` frames per second (0 disables the limit).
    pub fn new(rate: u32) -> Self {
        let rate = f64::from(rate);
        RateLimiter {
            rate,
            capacity: rate * BURST_SECONDS,
            tokens: rate * BURST_SECONDS,
            last: Instant::now(),
        }
    }

    /// Takes one token if there is one.
    pub fn allow(&mut self) -> bool {
        if self.rate == 0.0 {
            return true;
        }
        let now = Instant::now();
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What to do with a client's next frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    Allowed,
    /// Refuse it with RATE_LIMITED; the client may slow down.
    Refused,
    /// Refuse it and close the connection: the client keeps on regardless.
    RefusedPersistently,
}

/// The rate limit of one connection, with the refusals counted since its last allowed frame.
#[derive(Debug)]
pub(crate) struct FrameRate {
    limiter: RateLimiter,
    per_second: u32,
    refused_in_a_row: u32,
}

impl FrameRate {
    /// `per_second` frames per second (0 disables the limit).
    pub(crate) fn new(per_second: u32) -> Self {
        FrameRate {
            limiter: RateLimiter::new(per_second),
            per_second,
            refused_in_a_row: 0,
        }
    }

    /// The configured limit, for the error text.
    pub(crate) fn per_second(&self) -> u32 {
        self.per_second
    }

    pub(crate) fn admit(&mut self) -> Admission {
        if self.limiter.allow() {
            self.refused_in_a_row = 0;
            return Admission::Allowed;
        }
        self.refused_in_a_row = self.refused_in_a_row.saturating_add(1);
        if self.refused_in_a_row > self.per_second.max(MIN_REFUSALS_BEFORE_CLOSE) {
            Admission::RefusedPersistently
        } else {
            Admission::Refused
        }
    }
}

/// The byte rate of one connection: how long to stop reading its socket.
///
/// A frame's size is known only once it has been read, so a frame is always read whole (up to
/// the frame size limit) and charged afterwards; the bucket may then go into debt, and the
/// connection reads nothing more until the debt is paid back at the sustained rate. While the
/// gateway does not read, the socket's buffers fill and TCP slows the client down: nothing is
/// refused, and a client that floods only waits. A full bucket holds [`BURST_SECONDS`] of the
/// rate, read at full speed.
#[derive(Debug)]
pub(crate) struct ByteRate {
    /// Bytes per second; 0 is no limit.
    rate: f64,
    capacity: f64,
    /// Negative: debt.
    tokens: f64,
    /// When `tokens` was last brought up to date.
    last: tokio::time::Instant,
}

impl ByteRate {
    /// `per_second` bytes per second (0 disables the limit).
    pub(crate) fn new(per_second: u64) -> Self {
        let rate = per_second as f64;
        ByteRate {
            rate,
            capacity: rate * BURST_SECONDS,
            tokens: rate * BURST_SECONDS,
            last: tokio::time::Instant::now(),
        }
    }

    /// Charges `bytes` just read; returns true if that put the connection into debt (its
    /// reading pauses).
    pub(crate) fn charge(&mut self, bytes: usize) -> bool {
        if self.rate == 0.0 {
            return false;
        }
        let now = tokio::time::Instant::now();
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity) - bytes as f64;
        self.tokens < 0.0
    }

    /// Until when reading pauses, if the connection is in debt.
    pub(crate) fn paused_until(&self) -> Option<tokio::time::Instant> {
        if self.rate == 0.0 || self.tokens >= 0.0 {
            return None;
        }
        let debt = std::time::Duration::from_secs_f64(-self.tokens / self.rate);
        let until = self.last + debt;
        (until > tokio::time::Instant::now()).then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_up_to_twice_the_rate_then_refuses() {
        let mut limiter = RateLimiter::new(10);
        let allowed = (0..100).filter(|_| limiter.allow()).count();
        assert!((20..=21).contains(&allowed), "{allowed}");
        assert!(RateLimiter::new(0).allow());
    }

    #[test]
    fn a_client_that_keeps_on_is_refused_persistently() {
        let mut rate = FrameRate::new(5);
        let admissions: Vec<Admission> = (0..30).map(|_| rate.admit()).collect();
        let first_refused = admissions
            .iter()
            .position(|a| *a != Admission::Allowed)
            .expect("the burst ends");
        assert!((10..=11).contains(&first_refused), "{admissions:?}");
        let refused = &admissions[first_refused..];
        assert!(
            refused[..MIN_REFUSALS_BEFORE_CLOSE as usize]
                .iter()
                .all(|a| *a == Admission::Refused),
            "{admissions:?}"
        );
        assert_eq!(
            refused[MIN_REFUSALS_BEFORE_CLOSE as usize],
            Admission::RefusedPersistently
        );
    }

    #[tokio::test]
    async fn reading_pauses_for_the_debt_of_a_burst_then_resumes() {
        let mut rate = ByteRate::new(100_000);
        // Two seconds' worth is read at once.
        assert!(!rate.charge(150_000));
        assert!(!rate.charge(40_000));
        assert_eq!(rate.paused_until(), None);
        // A frame far larger than the bucket is read whole, then paid for: about 0.3 s of debt.
        assert!(rate.charge(40_000));
        let until = rate.paused_until().expect("in debt");
        let pause = until - tokio::time::Instant::now();
        assert!((0.25..=0.31).contains(&pause.as_secs_f64()), "{pause:?}");
        tokio::time::sleep_until(until).await;
        assert_eq!(rate.paused_until(), None, "the debt is paid");
        assert!(!rate.charge(0));
    }

    #[test]
    fn no_byte_rate_never_pauses() {
        let mut rate = ByteRate::new(0);
        assert!(!rate.charge(usize::MAX));
        assert_eq!(rate.paused_until(), None);
    }
}
