//! The `LISTEN` side of wake-ups for the sqlx driver: one dedicated connection per queue handle,
//! kept up by [`crate::wake::spawn`]; polling covers the gaps.

use std::convert::Infallible;
use std::sync::Arc;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::Notify;

use crate::LISTENER_APPLICATION_NAME;
use crate::wake::{self, ListenerGuard, Session};

/// Starts listening with `options` (the queue pool's) on a one-connection pool of its own, so
/// the listener never takes a slot of the queue's pool.
pub(crate) fn spawn(
    options: PgConnectOptions,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> ListenerGuard {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options.application_name(LISTENER_APPLICATION_NAME));
    wake::spawn(channel, queue, wake, move |mut session| {
        let pool = pool.clone();
        async move {
            let ended = listen(&pool, &mut session).await;
            (session, ended)
        }
    })
}

async fn listen(pool: &PgPool, session: &mut Session) -> Result<Infallible, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(&session.channel).await?;
    session.listening();
    loop {
        match listener.try_recv().await? {
            Some(note) => session.notified(note.payload()),
            // PgListener re-established (and re-listened) the connection by itself.
            None => session.reconnected(),
        }
    }
}
