//! What both drivers' `LISTEN` connections share: the task that re-establishes a lost session
//! with a capped backoff, what a session does with what it hears, and the guard that stops the
//! task with the last queue handle. A driver supplies only how to connect and listen.

use std::convert::Infallible;
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use queue_core::events::{LISTENER_CONNECTED, LISTENER_LOST};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Stops the listener task when the last queue handle is dropped.
#[derive(Debug)]
pub(crate) struct ListenerGuard(CancellationToken);

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// One listening session's view: where to listen, whom to wake.
pub(crate) struct Session {
    pub(crate) channel: String,
    queue: String,
    wake: Arc<Notify>,
    connected: bool,
}

impl Session {
    /// The session is listening: anything enqueued while nobody listened was not announced,
    /// so the workers poll once.
    pub(crate) fn listening(&mut self) {
        self.connected = true;
        tracing::info!(name: LISTENER_CONNECTED, channel = %self.channel, "{LISTENER_CONNECTED}");
        self.wake.notify_waiters();
    }

    /// A notification arrived; it wakes the workers if it names this queue.
    pub(crate) fn notified(&self, payload: &str) {
        if payload == self.queue {
            self.wake.notify_waiters();
        }
    }

    /// The driver re-established the connection by itself; notifications in between are lost.
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub(crate) fn reconnected(&self) {
        tracing::warn!(name: LISTENER_LOST, channel = %self.channel, "{LISTENER_LOST}: reconnected");
        self.wake.notify_waiters();
    }
}

/// Starts a task that listens on `channel` for notifications whose payload is `queue`, each of
/// which fires `wake`. `listen` runs one session until it fails; a failed session also fires
/// `wake` (its notifications are gone, so the workers should poll) and the next one starts after
/// a backoff of 100 ms doubling to 5 s, back to 100 ms after a session that did listen.
pub(crate) fn spawn<L, Fut, E>(
    channel: String,
    queue: String,
    wake: Arc<Notify>,
    mut listen: L,
) -> ListenerGuard
where
    L: FnMut(Session) -> Fut + Send + 'static,
    Fut: Future<Output = (Session, Result<Infallible, E>)> + Send,
    E: Display + Send,
{
    let stop = CancellationToken::new();
    let guard = ListenerGuard(stop.clone());
    let mut session = Session {
        channel,
        queue,
        wake,
        connected: false,
    };
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        while !stop.is_cancelled() {
            session.connected = false;
            let (ended, Err(err)) = tokio::select! {
                _ = stop.cancelled() => break,
                ended = listen(session) => ended,
            };
            session = ended;
            if session.connected {
                backoff = Duration::from_millis(100);
            }
            tracing::warn!(
                name: LISTENER_LOST,
                channel = %session.channel,
                error = %err,
                retry_in_ms = backoff.as_millis() as u64,
                "{LISTENER_LOST}: workers poll until it is back"
            );
            session.wake.notify_waiters();
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    });
    guard
}
