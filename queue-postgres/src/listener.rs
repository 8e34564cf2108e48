//! The `LISTEN` side of wake-ups: one dedicated connection per queue handle, re-established
//! when lost; polling covers the gap.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::LISTENER_APPLICATION_NAME;

/// Stops the listener task when the last queue handle is dropped.
#[derive(Debug)]
pub(crate) struct ListenerGuard(CancellationToken);

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Starts listening on `channel` for notifications whose payload is `queue`; each one fires
/// `wake`. A lost connection also fires `wake` (notifications sent meanwhile are gone, so the
/// workers should poll) and the task reconnects with a capped backoff.
pub(crate) fn spawn(
    pool: &PgPool,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> ListenerGuard {
    let stop = CancellationToken::new();
    // Its own one-connection pool: the listener never takes a slot of the queue's pool.
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .application_name(LISTENER_APPLICATION_NAME);
    let listener_pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options);
    tokio::spawn(run(listener_pool, channel, queue, wake, stop.clone()));
    ListenerGuard(stop)
}

async fn run(
    pool: PgPool,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        let mut connected = false;
        let result = tokio::select! {
            _ = stop.cancelled() => break,
            result = session(&pool, &channel, &queue, &wake, &mut connected) => result,
        };
        if connected {
            backoff = Duration::from_millis(100);
        }
        let err = match result {
            Ok(never) => match never {},
            Err(err) => err,
        };
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
    pool.close().await;
}

/// One listening session; returns only with the error that ended it.
async fn session(
    pool: &PgPool,
    channel: &str,
    queue: &str,
    wake: &Notify,
    connected: &mut bool,
) -> Result<std::convert::Infallible, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    *connected = true;
    tracing::info!(name: "queue.listener_connected", channel = %channel, "queue.listener_connected");
    // Anything enqueued while nobody listened was not announced: let the workers poll once.
    wake.notify_waiters();
    loop {
        match listener.try_recv().await? {
            Some(note) if note.payload() == queue => wake.notify_waiters(),
            Some(_) => {}
            None => {
                // The connection dropped and was re-established (and re-listened) by the
                // listener; notifications in between are lost.
                tracing::warn!(name: "queue.listener_lost", channel = %channel, "queue.listener_lost: reconnected");
                wake.notify_waiters();
            }
        }
    }
}
