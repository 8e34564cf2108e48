//! The `LISTEN` side of wake-ups for the tokio-postgres driver: a dedicated connection (outside
//! the pool, so its notifications can be read), re-established when lost
//! ([`crate::wake::supervise`]); polling covers the gap.

use std::sync::Arc;

use queue_core::CancellationToken;
use tokio::sync::{Notify, mpsc};
use tokio_postgres::{AsyncMessage, NoTls};

use crate::LISTENER_APPLICATION_NAME;
use crate::wake::{self, ListenerGuard};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
    let supervised = wake::supervise(channel.clone(), wake.clone(), stop.clone(), move || {
        session(
            pg_config.clone(),
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
    pg_config: tokio_postgres::Config,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> (bool, BoxError) {
    let mut connected = false;
    match listen(&pg_config, &channel, &queue, &wake, &mut connected).await {
        Ok(never) => match never {},
        Err(err) => (connected, err),
    }
}

async fn listen(
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
    wake::listening(channel, wake);
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
