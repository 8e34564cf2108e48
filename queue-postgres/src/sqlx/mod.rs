//! The sqlx driver: binds and row reading on sqlx's `PgPool`, its `LISTEN` connection, and the
//! framework's migrator.

mod listener;
mod migrate;
mod primary;

pub use migrate::{MIGRATOR, migrate};
pub use primary::PrimaryPool;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row as _};
use std::ops::{Deref, DerefMut};

use crate::config::PgQueueConfig;
use crate::driver::{BoxFuture, Column, Driver, Param, ParamVisitor, Params, Sealed};
use crate::error::PgError;
use crate::queue::{PostgresQueue, PostgresTx};

/// The sqlx driver (feature `sqlx`): [`PgQueue`] on a [`sqlx::PgPool`].
#[derive(Debug, Clone, Copy)]
pub struct Sqlx;

/// A queue on sqlx: [`PostgresQueue`] with the [`Sqlx`] driver.
///
/// ```no_run
/// use queue_postgres::{PgQueue, PgQueueConfig};
/// use queue_core::{Backend, NewJob};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
/// queue_postgres::migrate(&pool).await?; // the standard table `queue_jobs`
/// let queue = PgQueue::connect(pool, PgQueueConfig::default()).await?; // checks the schema
/// queue.enqueue(NewJob::new(&"hello")?).await?;
/// # Ok(()) }
/// ```
pub type PgQueue = PostgresQueue<Sqlx>;

/// A transaction on sqlx. It dereferences to [`PgConnection`], so a hook can also write with
/// `sqlx::query(…).execute(&mut **tx)`.
pub type PgTx = PostgresTx<Sqlx>;

/// The values sqlx can bind.
pub trait SqlxParam<'p>: sqlx::Encode<'p, Postgres> + sqlx::Type<Postgres> {}
impl<'p, T: sqlx::Encode<'p, Postgres> + sqlx::Type<Postgres> + ?Sized> SqlxParam<'p> for T {}

/// The values sqlx can read.
pub trait SqlxColumn: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres> {}
impl<T: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>> SqlxColumn for T {}

impl Sealed for Sqlx {}

impl Driver for Sqlx {
    type Pool = PgPool;
    type Pooled = PoolConnection<Postgres>;
    type Tx = sqlx::Transaction<'static, Postgres>;
    type Conn<'c> = &'c mut PgConnection;
    type Row = PgRow;

    async fn acquire(pool: &PgPool) -> Result<Self::Pooled, PgError> {
        Ok(pool.acquire().await?)
    }

    fn pooled(conn: &mut Self::Pooled) -> &mut PgConnection {
        conn
    }

    fn discard(mut conn: Self::Pooled) {
        conn.close_on_drop();
    }

    async fn begin(pool: &PgPool) -> Result<Self::Tx, PgError> {
        Ok(pool.begin().await?)
    }

    fn in_tx(tx: &mut Self::Tx) -> &mut PgConnection {
        tx
    }

    async fn commit(tx: Self::Tx) -> Result<(), PgError> {
        Ok(tx.commit().await?)
    }

    async fn rollback(tx: Self::Tx) -> Result<(), PgError> {
        Ok(tx.rollback().await?)
    }

    fn reborrow<'a>(conn: &'a mut &mut PgConnection) -> &'a mut PgConnection {
        conn
    }

    fn query<'c: 'q, 'q, 'p: 'q, P: Params<'p> + 'q>(
        conn: &'c mut PgConnection,
        sql: &'q str,
        params: &'q P,
    ) -> BoxFuture<'q, Result<Vec<PgRow>, PgError>> {
        Box::pin(async move { Ok(bind(sql, params).fetch_all(conn).await?) })
    }

    fn execute<'c: 'q, 'q, 'p: 'q, P: Params<'p> + 'q>(
        conn: &'c mut PgConnection,
        sql: &'q str,
        params: &'q P,
    ) -> BoxFuture<'q, Result<u64, PgError>> {
        Box::pin(async move { Ok(bind(sql, params).execute(conn).await?.rows_affected()) })
    }

    fn batch_execute<'c: 'q, 'q>(
        conn: &'c mut PgConnection,
        sql: &'q str,
    ) -> BoxFuture<'q, Result<(), PgError>> {
        Box::pin(async move {
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(conn).await?;
            Ok(())
        })
    }

    fn copy_in<'c: 'q, 'q>(
        conn: &'c mut PgConnection,
        statement: &'q str,
        data: Vec<u8>,
    ) -> BoxFuture<'q, Result<u64, PgError>> {
        Box::pin(async move {
            let mut copy = conn.copy_in_raw(statement).await?;
            for chunk in data.chunks(crate::driver::COPY_CHUNK) {
                copy.send(chunk).await?;
            }
            Ok(copy.finish().await?)
        })
    }

    fn get<T: Column>(row: &PgRow, column: &str) -> Result<T, PgError> {
        Ok(row.try_get(column)?)
    }
}

/// `sql` with `params` bound, `$1` first.
fn bind<'p, P: Params<'p>>(sql: &str, params: &P) -> Query<'static, Postgres, PgArguments> {
    struct Binder(Option<Query<'static, Postgres, PgArguments>>);
    impl<'s, 'p> ParamVisitor<'s, 'p> for Binder {
        fn param<T: Param<'p>>(&mut self, value: &'s T) {
            self.0 = self.0.take().map(|query| query.bind(value));
        }
    }
    let mut binder = Binder(Some(sqlx::query(AssertSqlSafe(sql))));
    params.visit(&mut binder);
    binder.0.expect("the binder keeps its query")
}

impl PostgresQueue<Sqlx> {
    /// A queue handle on `pool`. Checks the table's schema first and refuses a table that is not
    /// on the lease schema ([`PgError::Schema`]); with `config.listen`, starts a `LISTEN`
    /// connection with the pool's connect options (its own one-connection pool).
    pub async fn connect(pool: PgPool, config: PgQueueConfig) -> Result<Self, PgError> {
        let options = pool.connect_options().as_ref().clone();
        let listen =
            Box::new(move |channel, queue, wake| listener::spawn(options, channel, queue, wake));
        Self::open(pool, config, listen).await
    }
}

impl PostgresTx<Sqlx> {
    /// The sqlx transaction inside.
    pub fn into_inner(self) -> sqlx::Transaction<'static, Postgres> {
        self.tx
    }
}

impl From<sqlx::Transaction<'static, Postgres>> for PostgresTx<Sqlx> {
    /// Wraps a transaction the caller began, so that the queue's writes join the caller's own.
    fn from(tx: sqlx::Transaction<'static, Postgres>) -> Self {
        PostgresTx { tx }
    }
}

impl Deref for PostgresTx<Sqlx> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for PostgresTx<Sqlx> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}
