//! The `LISTEN` side of wake-ups for the tokio-postgres driver: a dedicated connection (outside
//! the pool, so its notifications can be read), re-established when lost; polling covers the gap.

use std::sync::Arc;
use std::time::Duration;

use queue_core::CancellationToken;
use tokio::sync::{Notify, mpsc};
use tokio_postgres::{AsyncMessage, NoTls};

use crate::LISTENER_APPLICATION_NAME;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Stops the listener task when the last queue handle is dropped.
#[derive(Debug)]
pub(crate) struct ListenerGuard(CancellationToken);

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Starts listening on `channel` for notifications whose payload is `queue`; each one fires
/// `wake`, and so does a lost connection (its notifications are gone: poll once).
pub(crate) fn spawn(
    mut pg_config: tokio_postgres::Config,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> ListenerGuard {
    pg_config.application_name(LISTENER_APPLICATION_NAME);
    let stop = CancellationToken::new();
    tokio::spawn(run(pg_config, channel, queue, wake, stop.clone()));
    ListenerGuard(stop)
}

async fn run(
    pg_config: tokio_postgres::Config,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        let mut connected = false;
        let err = tokio::select! {
            _ = stop.cancelled() => break,
            result = session(&pg_config, &channel, &queue, &wake, &mut connected) => match result {
                Ok(never) => match never {},
                Err(err) => err,
            },
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

/// One listening session; returns only with the error that ended it.
async fn session(
    pg_config: &tokio_postgres::Config,
    channel: &str,
    queue: &str,
    wake: &Notify,
    connected: &mut bool,
) -> Result<std::convert::Infallible, BoxError> {
    let (client, mut connection) = pg_config.connect(NoTls).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    // The connection must be polled for the client's requests to progress; this task does it and
    // forwards what the server pushes.
    let pump = tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(note))) => {
                    if tx.send(Ok(note)).is_err() {
                        return;
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(err)) => {
                    let _ = tx.send(Err(err));
                    return;
                }
                None => return,
            }
        }
    });
    let _pump = AbortOnDrop(pump);
    // The channel name derives from a validated table name: letters, digits and '_' only.
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await?;
    *connected = true;
    tracing::info!(name: "queue.listener_connected", channel = %channel, "queue.listener_connected");
    // Anything enqueued while nobody listened was not announced: let the workers poll once.
    wake.notify_waiters();
    loop {
        match rx.recv().await {
            Some(Ok(note)) if note.payload() == queue => wake.notify_waiters(),
            Some(Ok(_)) => {}
            Some(Err(err)) => return Err(err.into()),
            None => return Err("the LISTEN connection closed".into()),
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
