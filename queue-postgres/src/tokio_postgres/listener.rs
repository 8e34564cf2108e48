//! The `LISTEN` side of wake-ups for the tokio-postgres driver: a dedicated connection (outside
//! the pool, so its notifications can be read), kept up by [`crate::wake::spawn`]; polling
//! covers the gaps.

use std::convert::Infallible;
use std::sync::Arc;

use tokio::sync::{Notify, mpsc};
use tokio_postgres::{AsyncMessage, NoTls};

use crate::LISTENER_APPLICATION_NAME;
use crate::wake::{self, ListenerGuard, Session};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Starts listening on a connection opened from `pg_config` (without TLS).
pub(crate) fn spawn(
    mut pg_config: tokio_postgres::Config,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> ListenerGuard {
    pg_config.application_name(LISTENER_APPLICATION_NAME);
    wake::spawn(channel, queue, wake, move |mut session| {
        let pg_config = pg_config.clone();
        async move {
            let ended = listen(&pg_config, &mut session).await;
            (session, ended)
        }
    })
}

async fn listen(
    pg_config: &tokio_postgres::Config,
    session: &mut Session,
) -> Result<Infallible, BoxError> {
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
        .batch_execute(&format!("LISTEN \"{}\"", session.channel))
        .await?;
    session.listening();
    loop {
        match rx.recv().await {
            Some(Ok(note)) => session.notified(note.payload()),
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
