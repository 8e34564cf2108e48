//! The clock a scheduler reads: the system's, or one a test moves by hand.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;

/// A future a [`Clock`] returns.
pub type Sleep<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What a [`Scheduler`](super::Scheduler) reads the time from.
///
/// The scheduler only decides *when to look* by it: which periods exist comes from the
/// schedule, and each period's job is due at the period's own instant, by the store's clock. So
/// two processes whose clocks disagree by a few seconds still enqueue one job per period; the
/// one running ahead enqueues it a little early, to become due on time.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;

    /// Completes once [`Clock::now`] has reached `at` (at once if it has), or earlier: the
    /// scheduler looks at the time again after every wake-up.
    fn sleep_until(&self, at: DateTime<Utc>) -> Sleep<'_>;
}

/// The system clock. A sleep lasts at most a minute, so that a wall clock set forward or back
/// is noticed within one.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }

    fn sleep_until(&self, at: DateTime<Utc>) -> Sleep<'_> {
        let wait = (at - Utc::now())
            .to_std()
            .unwrap_or(Duration::ZERO)
            .min(Duration::from_secs(60));
        Box::pin(tokio::time::sleep(wait))
    }
}

/// A clock that moves only when told to: how tests run a schedule through many periods without
/// sleeping. Clones share the time.
///
/// ```
/// use std::time::Duration;
/// use queue_core::schedule::{Clock, ManualClock};
///
/// let clock = ManualClock::new("2026-01-01T00:00:00Z".parse().unwrap());
/// clock.advance(Duration::from_secs(90));
/// assert_eq!(clock.now().to_rfc3339(), "2026-01-01T00:01:30+00:00");
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: watch::Sender<DateTime<Utc>>,
}

impl ManualClock {
    /// A clock standing at `at`.
    pub fn new(at: DateTime<Utc>) -> Self {
        ManualClock {
            now: watch::Sender::new(at),
        }
    }

    /// Moves the clock forward by `by`, waking every sleep it reaches.
    pub fn advance(&self, by: Duration) {
        let by = chrono::TimeDelta::from_std(by).unwrap_or(chrono::TimeDelta::MAX);
        self.now.send_modify(|now| *now += by);
    }

    /// Sets the clock to `at` (back as well as forward).
    pub fn set(&self, at: DateTime<Utc>) {
        self.now.send_replace(at);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.borrow()
    }

    fn sleep_until(&self, at: DateTime<Utc>) -> Sleep<'_> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            // The sender lives as long as the clock this borrows: the wait ends only on time.
            let _ = rx.wait_for(|now| *now >= at).await;
        })
    }
}
