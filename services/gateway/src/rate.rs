//! The frame rate of one connection: a token bucket, and what a client over it is told.

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
}
