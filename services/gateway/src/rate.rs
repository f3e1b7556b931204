//! A token bucket per connection.

use std::time::Instant;

/// Allows `rate` frames per second on average, bursts of up to twice that.
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
            capacity: rate * 2.0,
            tokens: rate * 2.0,
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

#[cfg(test)]
mod tests {
    use super::RateLimiter;

    #[test]
    fn bursts_up_to_twice_the_rate_then_refuses() {
        let mut limiter = RateLimiter::new(10);
        let allowed = (0..100).filter(|_| limiter.allow()).count();
        assert!((20..=21).contains(&allowed), "{allowed}");
        assert!(RateLimiter::new(0).allow());
    }
}
