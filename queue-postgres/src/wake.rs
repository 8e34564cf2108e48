//! What both drivers' `LISTEN` connections share: the guard that stops them with the last queue
//! handle, and the loop that re-establishes a lost session with a capped backoff.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Stops the listener task when the last queue handle is dropped.
#[derive(Debug)]
pub(crate) struct ListenerGuard(pub(crate) CancellationToken);

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Runs listening sessions until `stop`: each returns whether it got as far as listening and
/// the error that ended it. A lost session fires `wake` (notifications sent meanwhile are gone,
/// so the workers should poll) and the next one starts after a backoff of 100 ms doubling to
/// 5 s, back to 100 ms after a session that did listen.
pub(crate) async fn supervise<S, Fut, E>(
    channel: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
    mut session: S,
) where
    S: FnMut() -> Fut,
    Fut: Future<Output = (bool, E)>,
    E: Display,
{
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        let (connected, err) = tokio::select! {
            _ = stop.cancelled() => break,
            end = session() => end,
        };
        if connected {
            backoff = Duration::from_millis(100);
        }
        tracing::warn!(
            name: "queue.listener_lost",
            channel = %channel,
            error = %err,
            retry_in_ms = backoff.as_millis() as u64,
            "queue.listener_lost: workers poll until it is back"
        );
        wake.notify_waiters();
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Logs a session that is listening and lets the workers poll once: anything enqueued while
/// nobody listened was not announced.
pub(crate) fn listening(channel: &str, wake: &Notify) {
    tracing::info!(name: "queue.listener_connected", channel = %channel, "queue.listener_connected");
    wake.notify_waiters();
}
