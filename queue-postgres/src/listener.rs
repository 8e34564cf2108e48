//! The `LISTEN` side of wake-ups for the sqlx driver: one dedicated connection per queue handle,
//! re-established when lost ([`crate::wake::supervise`]); polling covers the gap.

use std::sync::Arc;

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::LISTENER_APPLICATION_NAME;
use crate::wake::{self, ListenerGuard};

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
    let supervised = wake::supervise(channel.clone(), wake.clone(), stop.clone(), move || {
        session(
            listener_pool.clone(),
            channel.clone(),
            queue.clone(),
            wake.clone(),
        )
    });
    tokio::spawn(supervised);
    ListenerGuard(stop)
}

/// One listening session: whether it got as far as listening, and the error that ended it.
async fn session(
    pool: PgPool,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> (bool, sqlx::Error) {
    let mut connected = false;
    match listen(&pool, &channel, &queue, &wake, &mut connected).await {
        Ok(never) => match never {},
        Err(err) => (connected, err),
    }
}

async fn listen(
    pool: &PgPool,
    channel: &str,
    queue: &str,
    wake: &Notify,
    connected: &mut bool,
) -> Result<std::convert::Infallible, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    *connected = true;
    wake::listening(channel, wake);
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
