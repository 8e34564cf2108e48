//! The one retry schedule of the runtime's writes and claims: capped exponential backoff with
//! jitter (backon's), bounded by a deadline.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio::time::Instant;

/// Pauses that double from `first` up to `cap`, each with jitter, never past a deadline.
pub(crate) struct Backoff {
    pauses: ExponentialBackoff,
}

impl Backoff {
    pub(crate) fn new(first: Duration, cap: Duration) -> Self {
        let pauses = ExponentialBuilder::new()
            .with_min_delay(first)
            .with_max_delay(cap.max(first))
            .with_jitter()
            .without_max_times()
            .build();
        Backoff { pauses }
    }

    /// The next pause, unless sleeping it would reach `deadline`.
    pub(crate) fn pause_before(&mut self, deadline: Instant) -> Option<Duration> {
        let pause = self.pauses.next()?;
        (Instant::now() + pause < deadline).then_some(pause)
    }

    /// The next pause, whatever the time.
    pub(crate) fn pause(&mut self) -> Duration {
        self.pauses.next().unwrap_or(Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn pauses_double_up_to_the_cap_and_stop_at_the_deadline() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let pauses: Vec<Duration> = (0..8).map(|_| backoff.pause()).collect();
        assert!(pauses[0] >= Duration::from_millis(100), "{pauses:?}");
        assert!(pauses[3] >= Duration::from_millis(800), "{pauses:?}");
        // Jitter adds at most the pause itself.
        assert!(
            pauses.iter().all(|p| *p <= Duration::from_secs(2)),
            "{pauses:?}"
        );
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(
            Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).pause_before(soon),
            None
        );
    }
}
