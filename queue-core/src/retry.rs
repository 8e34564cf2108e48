//! Retry policy: exponential backoff with jitter, bounded by handler errors only.

use std::time::Duration;

use crate::error::ConfigError;

/// How handler errors are retried.
///
/// `max_attempts` counts handler runs that ended in an error (or a timeout, or a panic), never
/// lease expiries: a job whose worker died is governed by the reclaim cap instead
/// ([`crate::ClaimRequest::max_reclaims`]).
///
/// ```
/// use std::time::Duration;
/// use queue_core::RetryPolicy;
///
/// let policy = RetryPolicy { max_attempts: 5, jitter: false, ..RetryPolicy::default() };
/// assert_eq!(policy.backoff(0), Duration::from_secs(1));
/// assert_eq!(policy.backoff(3), Duration::from_secs(8));
/// assert!(policy.gives_up_after(4)); // the 5th failing run is the last
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Handler runs allowed in all (at least 1; 1 means never retry).
    pub max_attempts: u32,
    /// The delay after the first error; doubled after each further one.
    pub base_delay: Duration,
    /// The delay never exceeds this.
    pub max_delay: Duration,
    /// With jitter, the delay is drawn uniformly from `[d/2, d]` so that jobs failing together
    /// (a partner outage) do not retry together.
    pub jitter: bool,
}

impl Default for RetryPolicy {
    /// 10 runs; 1 s, 2 s, 4 s … capped at 1 hour; with jitter.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 10,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(3600),
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// Checks the policy.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_attempts == 0 {
            return Err(ConfigError::Zero("retry max_attempts"));
        }
        if self.max_delay < self.base_delay {
            return Err(ConfigError::OutOfRange {
                name: "retry max_delay",
                detail: format!(
                    "{:?} is below base_delay {:?}",
                    self.max_delay, self.base_delay
                ),
            });
        }
        Ok(())
    }

    /// True when a job that has already had `previous_errors` failing runs must fail terminally
    /// if this run fails too.
    pub fn gives_up_after(&self, previous_errors: u32) -> bool {
        previous_errors.saturating_add(1) >= self.max_attempts
    }

    /// The delay before the next run after `previous_errors` earlier failing runs (this run's
    /// failure not included).
    pub fn backoff(&self, previous_errors: u32) -> Duration {
        let factor = 2u32.saturating_pow(previous_errors.min(31));
        let delay = self
            .base_delay
            .checked_mul(factor)
            .unwrap_or(self.max_delay)
            .min(self.max_delay);
        if self.jitter && !delay.is_zero() {
            let half = delay / 2;
            half + half.mul_f64(fastrand::f64())
        } else {
            delay
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let policy = RetryPolicy {
            max_attempts: 100,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            jitter: false,
        };
        assert_eq!(policy.backoff(0), Duration::from_millis(100));
        assert_eq!(policy.backoff(1), Duration::from_millis(200));
        assert_eq!(policy.backoff(3), Duration::from_millis(800));
        assert_eq!(policy.backoff(4), Duration::from_secs(1));
        assert_eq!(policy.backoff(60), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_half_and_full_delay_and_varies() {
        let policy = RetryPolicy {
            max_attempts: 10,
            base_delay: Duration::from_secs(8),
            max_delay: Duration::from_secs(60),
            jitter: true,
        };
        let draws: Vec<Duration> = (0..200).map(|_| policy.backoff(0)).collect();
        assert!(
            draws
                .iter()
                .all(|d| *d >= Duration::from_secs(4) && *d <= Duration::from_secs(8))
        );
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(distinct.len() > 100, "jitter hardly varies: {distinct:?}");
    }

    #[test]
    fn max_attempts_counts_failing_runs() {
        let policy = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        assert!(!policy.gives_up_after(0));
        assert!(!policy.gives_up_after(1));
        assert!(policy.gives_up_after(2));
        let never_retry = RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        };
        assert!(never_retry.gives_up_after(0));
    }

    #[test]
    fn validation_refuses_nonsense() {
        let zero = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert_eq!(
            zero.validate(),
            Err(ConfigError::Zero("retry max_attempts"))
        );
        let inverted = RetryPolicy {
            base_delay: Duration::from_secs(10),
            max_delay: Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        assert!(inverted.validate().is_err());
        assert!(RetryPolicy::default().validate().is_ok());
    }
}
