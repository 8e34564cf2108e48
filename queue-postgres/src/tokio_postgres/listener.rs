//! The `LISTEN` side of wake-ups for the tokio-postgres driver: a dedicated connection (outside
//! the pool, so its notifications can be read), kept up by [`crate::wake::spawn`]; polling
//! covers the gaps.

use std::convert::Infallible;
use std::sync::Arc;

use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use tokio::sync::{Notify, mpsc};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, Client, Socket};

use crate::driver::BoxFuture;

use crate::LISTENER_APPLICATION_NAME;
use crate::wake::{self, ListenerGuard, Session};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The server's messages on a `LISTEN` connection, its stream type erased.
type Messages = Pin<Box<dyn Stream<Item = Result<AsyncMessage, tokio_postgres::Error>> + Send>>;

/// A TLS connector the `LISTEN` connection can open through: any connector a deadpool `Manager`
/// takes (`NoTls`, `tokio-postgres-rustls`, `postgres-native-tls`, `postgres-openssl`).
pub trait ListenTls: Send + Sync + 'static {
    /// Opens a connection from `config`.
    #[doc(hidden)]
    fn open(
        &self,
        config: &tokio_postgres::Config,
    ) -> BoxFuture<'static, Result<(Client, Messages), tokio_postgres::Error>>;
}

impl<T> ListenTls for T
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn open(
        &self,
        config: &tokio_postgres::Config,
    ) -> BoxFuture<'static, Result<(Client, Messages), tokio_postgres::Error>> {
        let config = config.clone();
        let tls = self.clone();
        Box::pin(async move {
            let (client, mut connection) = config.connect(tls).await?;
            let messages: Messages = Box::pin(futures_util::stream::poll_fn(move |cx| {
                connection.poll_message(cx)
            }));
            Ok((client, messages))
        })
    }
}

/// Starts listening on a connection opened from `pg_config` through `tls`.
pub(crate) fn spawn(
    mut pg_config: tokio_postgres::Config,
    tls: Arc<dyn ListenTls>,
    channel: String,
    queue: String,
    wake: Arc<Notify>,
) -> ListenerGuard {
    pg_config.application_name(LISTENER_APPLICATION_NAME);
    wake::spawn(channel, queue, wake, move |mut session| {
        let pg_config = pg_config.clone();
        let tls = tls.clone();
        async move {
            let ended = listen(&pg_config, &*tls, &mut session).await;
            (session, ended)
        }
    })
}

async fn listen(
    pg_config: &tokio_postgres::Config,
    tls: &dyn ListenTls,
    session: &mut Session,
) -> Result<Infallible, BoxError> {
    let (client, mut messages) = tls.open(pg_config).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    // The connection must be polled for the client's requests to progress; this task does it and
    // forwards what the server pushes.
    let pump = tokio::spawn(async move {
        loop {
            match messages.next().await {
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
