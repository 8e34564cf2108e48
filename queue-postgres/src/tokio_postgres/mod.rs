//! The tokio-postgres + deadpool-postgres driver: statements prepared once per connection
//! (deadpool's statement cache), values in the binary protocol, a transaction that is a pooled
//! connection inside `BEGIN`, and its own `LISTEN` connection.

mod listener;
mod transaction;

pub use listener::ListenTls;

use transaction::OpenTransaction;

use std::ops::{Deref, DerefMut};

use deadpool_postgres::{Object, Pool, Transaction};
use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, ToSql};

use crate::config::PgQueueConfig;
use crate::driver::{BoxFuture, Column, Driver, Param, ParamVisitor, Params, Sealed};
use crate::error::PgError;
use crate::queue::{PostgresQueue, PostgresTx};

/// The tokio-postgres + deadpool-postgres driver (feature `tokio-postgres`):
/// [`TokioPostgresQueue`] on a [`deadpool_postgres::Pool`].
#[derive(Debug, Clone, Copy)]
pub struct TokioPostgres;

/// A queue on tokio-postgres + deadpool-postgres: [`PostgresQueue`] with the [`TokioPostgres`]
/// driver.
///
/// ```no_run
/// use queue_core::{Backend, NewJob};
/// use queue_postgres::{PgQueueConfig, TableName, TokioPostgresQueue};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pg: tokio_postgres::Config = "host=127.0.0.1 user=postgres dbname=app".parse()?;
/// let manager = deadpool_postgres::Manager::new(pg.clone(), tokio_postgres::NoTls);
/// let pool = deadpool_postgres::Pool::builder(manager).max_size(16).build()?;
/// TokioPostgresQueue::install_table(&pool, &TableName::default()).await?;
/// // `pg` opens the dedicated LISTEN connection (`connect_with_tls` gives it the pool's TLS
/// // connector; set `listen: false` to poll only).
/// let queue = TokioPostgresQueue::connect(pool, PgQueueConfig::default(), pg).await?;
/// queue.enqueue(NewJob::new(&"hello")?).await?;
/// # Ok(()) }
/// ```
pub type TokioPostgresQueue = PostgresQueue<TokioPostgres>;

/// A transaction on tokio-postgres. It dereferences to the pooled client, so a hook can also
/// write with `tx.execute(…)` or `tx.prepare_cached(…)`.
pub type TokioPostgresTx = PostgresTx<TokioPostgres>;

/// The earlier name of [`TokioPostgresQueue`].
#[deprecated(since = "0.2.0", note = "renamed TokioPostgresQueue")]
pub type TpQueue = TokioPostgresQueue;

/// The earlier name of [`TokioPostgresTx`].
#[deprecated(since = "0.2.0", note = "renamed TokioPostgresTx")]
pub type TpTx = TokioPostgresTx;

/// What tokio-postgres statements run on: a pooled client, or the caller's own transaction.
#[derive(Clone, Copy)]
pub enum TokioPostgresConn<'c> {
    /// A pooled client (also what a [`TokioPostgresTx`] runs on, inside `BEGIN`).
    Client(&'c Object),
    /// A transaction of the caller's.
    Transaction(&'c Transaction<'c>),
}

impl<'c> From<&'c Object> for TokioPostgresConn<'c> {
    fn from(client: &'c Object) -> Self {
        TokioPostgresConn::Client(client)
    }
}

impl<'c> From<&'c Transaction<'c>> for TokioPostgresConn<'c> {
    fn from(tx: &'c Transaction<'c>) -> Self {
        TokioPostgresConn::Transaction(tx)
    }
}

/// Runs `$body` with `$c` bound to the client inside `$conn`, whichever kind it is.
macro_rules! on_client {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            TokioPostgresConn::Client($c) => $body,
            TokioPostgresConn::Transaction($c) => $body,
        }
    };
}

/// The values tokio-postgres can bind.
pub trait TokioPostgresParam: ToSql + Sync {}
impl<T: ToSql + Sync + ?Sized> TokioPostgresParam for T {}

/// The values tokio-postgres can read.
pub trait TokioPostgresColumn: for<'a> FromSql<'a> {}
impl<T: for<'a> FromSql<'a>> TokioPostgresColumn for T {}

impl Sealed for TokioPostgres {}

impl Driver for TokioPostgres {
    type Pool = Pool;
    type Pooled = Object;
    type Tx = OpenTransaction;
    type Conn<'c> = TokioPostgresConn<'c>;
    type Row = Row;

    async fn acquire(pool: &Pool) -> Result<Object, PgError> {
        Ok(pool.get().await?)
    }

    fn pooled(conn: &mut Object) -> TokioPostgresConn<'_> {
        TokioPostgresConn::Client(conn)
    }

    fn discard(conn: Object) {
        // Out of the pool, the client closes its connection when dropped.
        drop(Object::take(conn));
    }

    async fn begin(pool: &Pool) -> Result<OpenTransaction, PgError> {
        // The guard exists before the BEGIN: a caller that drops this future while the BEGIN
        // is on the wire has its connection rolled back before the pool lends it again (the
        // next borrower's statements would otherwise run inside a transaction nobody ends).
        let tx = OpenTransaction {
            client: Some(pool.get().await?),
        };
        tx.client().batch_execute("BEGIN").await?;
        Ok(tx)
    }

    fn in_tx(tx: &mut OpenTransaction) -> TokioPostgresConn<'_> {
        TokioPostgresConn::Client(tx.client())
    }

    async fn commit(tx: OpenTransaction) -> Result<(), PgError> {
        tx.finish("COMMIT").await
    }

    async fn rollback(tx: OpenTransaction) -> Result<(), PgError> {
        tx.finish("ROLLBACK").await
    }

    fn reborrow<'a>(conn: &'a mut TokioPostgresConn<'_>) -> TokioPostgresConn<'a> {
        *conn
    }

    fn query<'c: 'q, 'q, 'p: 'q, P: Params<'p> + 'q>(
        conn: TokioPostgresConn<'c>,
        sql: &'q str,
        params: &'q P,
    ) -> BoxFuture<'q, Result<Vec<Row>, PgError>> {
        Box::pin(async move {
            let params = refs(params);
            let statement = conn.prepare(sql).await?;
            Ok(on_client!(conn, c => c.query(&statement, &params).await?))
        })
    }

    fn execute<'c: 'q, 'q, 'p: 'q, P: Params<'p> + 'q>(
        conn: TokioPostgresConn<'c>,
        sql: &'q str,
        params: &'q P,
    ) -> BoxFuture<'q, Result<u64, PgError>> {
        Box::pin(async move {
            let params = refs(params);
            let statement = conn.prepare(sql).await?;
            Ok(on_client!(conn, c => c.execute(&statement, &params).await?))
        })
    }

    fn batch_execute<'c: 'q, 'q>(
        conn: TokioPostgresConn<'c>,
        sql: &'q str,
    ) -> BoxFuture<'q, Result<(), PgError>> {
        Box::pin(async move {
            on_client!(conn, c => c.batch_execute(sql).await?);
            Ok(())
        })
    }

    fn copy_in<'c: 'q, 'q>(
        conn: TokioPostgresConn<'c>,
        statement: &'q str,
        data: Vec<u8>,
    ) -> BoxFuture<'q, Result<u64, PgError>> {
        use futures_util::SinkExt;
        Box::pin(async move {
            let sink = on_client!(conn, c => c.copy_in(statement).await?);
            let mut sink = std::pin::pin!(sink);
            for chunk in data.chunks(crate::driver::COPY_CHUNK) {
                sink.send(std::io::Cursor::new(chunk.to_vec())).await?;
            }
            Ok(sink.as_mut().finish().await?)
        })
    }

    fn get<T: Column>(row: &Row, column: &str) -> Result<T, PgError> {
        Ok(row.try_get(column)?)
    }
}

type Refs<'a> = Vec<&'a (dyn ToSql + Sync)>;

/// `params` as tokio-postgres takes them, `$1` first.
fn refs<'s, 'p, P: Params<'p>>(params: &'s P) -> Refs<'s> {
    struct Collect<'s>(Refs<'s>);
    impl<'s, 'p> ParamVisitor<'s, 'p> for Collect<'s> {
        fn param<T: Param<'p>>(&mut self, value: &'s T) {
            self.0.push(value);
        }
    }
    let mut collect = Collect(Vec::new());
    params.visit(&mut collect);
    collect.0
}

impl TokioPostgresConn<'_> {
    /// `sql` prepared on this connection, once per connection (deadpool's statement cache).
    async fn prepare(self, sql: &str) -> Result<tokio_postgres::Statement, PgError> {
        Ok(on_client!(self, c => c.prepare_cached(sql).await?))
    }
}

impl PostgresQueue<TokioPostgres> {
    /// A queue handle on `pool`. Checks the table's schema first and refuses a table that is not
    /// on the lease schema ([`PgError::Schema`]). With `config.listen`, opens a dedicated
    /// `LISTEN` connection from `pg_config` (without TLS).
    pub async fn connect(
        pool: Pool,
        config: PgQueueConfig,
        pg_config: tokio_postgres::Config,
    ) -> Result<Self, PgError> {
        Self::connect_with_tls(pool, config, pg_config, tokio_postgres::NoTls).await
    }

    /// [`TokioPostgresQueue::connect`] with the `LISTEN` connection opened through `tls`: give
    /// it the connector the pool's `Manager` has, so that wake-ups travel as the queries do
    /// (and work on a server that accepts only TLS).
    pub async fn connect_with_tls(
        pool: Pool,
        config: PgQueueConfig,
        pg_config: tokio_postgres::Config,
        tls: impl ListenTls,
    ) -> Result<Self, PgError> {
        let tls: std::sync::Arc<dyn ListenTls> = std::sync::Arc::new(tls);
        let listen = Box::new(move |channel, queue, wake| {
            listener::spawn(pg_config, tls, channel, queue, wake)
        });
        Self::open(pool, config, listen).await
    }
}

impl Deref for PostgresTx<TokioPostgres> {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.tx.client()
    }
}

impl DerefMut for PostgresTx<TokioPostgres> {
    fn deref_mut(&mut self) -> &mut Object {
        self.tx.client.as_mut().expect("an open transaction")
    }
}
