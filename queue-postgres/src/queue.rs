//! `PgQueue`: the sqlx driver of the PostgreSQL backend.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use queue_core::{
    Backend, BackendTx, CancelOutcome, Claim, ClaimBatch, ClaimRequest, ClaimedJob, Enqueued,
    Finalize, FinalizeOutcome, JobId, JobRecord, JobStatus, NewJob, QueueCounts, QueueName,
};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};
use tokio::sync::Notify;

use crate::batch::{self, EnqueueColumns, FinalizeColumns, parse_status};
use crate::config::PgQueueConfig;
use crate::error::PgError;
use crate::listener;
use crate::schema;
use crate::sql::Statements;
use crate::wake::ListenerGuard;

/// A queue in a PostgreSQL table, on a sqlx pool. Cloning is cheap and shares everything.
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
#[derive(Clone)]
pub struct PgQueue {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    config: PgQueueConfig,
    sql: Statements,
    /// The table name as `pg_get_serial_sequence` wants it.
    quoted_table: String,
    channel: String,
    wake: Arc<Notify>,
    _listener: Option<ListenerGuard>,
}

impl std::fmt::Debug for PgQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgQueue")
            .field("table", &self.inner.config.table)
            .field("queue", &self.inner.config.queue)
            .finish_non_exhaustive()
    }
}

/// A transaction of the PostgreSQL backend. Hooks receive it; it dereferences to
/// [`PgConnection`], so a hook writes with `sqlx::query(…).execute(&mut **tx)`.
/// Dropping it without commit rolls back.
#[derive(Debug)]
pub struct PgTx(sqlx::Transaction<'static, Postgres>);

impl PgTx {
    /// The sqlx transaction inside.
    pub fn into_inner(self) -> sqlx::Transaction<'static, Postgres> {
        self.0
    }
}

impl From<sqlx::Transaction<'static, Postgres>> for PgTx {
    /// Wraps a transaction the caller began, so that the queue's writes join the caller's own.
    fn from(tx: sqlx::Transaction<'static, Postgres>) -> Self {
        PgTx(tx)
    }
}

impl Deref for PgTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl BackendTx for PgTx {
    async fn commit(self) -> queue_core::Result<()> {
        self.0.commit().await.map_err(PgError::from)?;
        Ok(())
    }

    async fn rollback(self) -> queue_core::Result<()> {
        self.0.rollback().await.map_err(PgError::from)?;
        Ok(())
    }
}

impl PgQueue {
    /// A queue handle on `pool`. Checks the table's schema first and refuses a table that is not
    /// on the lease schema ([`PgError::Schema`]); starts the `LISTEN` connection if configured.
    pub async fn connect(pool: PgPool, config: PgQueueConfig) -> Result<Self, PgError> {
        schema::check_schema(&pool, &config.table).await?;
        let wake = Arc::new(Notify::new());
        let channel = config.table.channel();
        let listener = config.listen.then(|| {
            listener::spawn(
                &pool,
                channel.clone(),
                config.queue.as_str().to_owned(),
                wake.clone(),
            )
        });
        Ok(PgQueue {
            inner: Arc::new(Inner {
                sql: Statements::new(&config.table),
                quoted_table: config.table.quoted(),
                pool,
                channel,
                wake,
                _listener: listener,
                config,
            }),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The configuration.
    pub fn config(&self) -> &PgQueueConfig {
        &self.inner.config
    }

    /// The statements this handle runs (rendered for its table).
    pub fn statements(&self) -> &Statements {
        &self.inner.sql
    }

    fn q(
        &self,
        sql: &Arc<str>,
    ) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(AssertSqlSafe(sql.clone()))
    }

    /// Enqueues `jobs` on `conn`: any connection or transaction of the caller, so the jobs
    /// commit with the caller's own writes. One statement, whatever the number of jobs.
    pub async fn enqueue_with(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<Enqueued>, PgError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let columns = EnqueueColumns::new(jobs);
        let channel = self
            .inner
            .config
            .notify_on_enqueue
            .then(|| self.inner.channel.clone());
        let rows = self
            .q(&self.inner.sql.enqueue)
            .bind(self.inner.config.queue.as_str())
            .bind(&self.inner.quoted_table)
            .bind(columns.payloads)
            .bind(columns.priorities)
            .bind(columns.run_ats)
            .bind(columns.delays)
            .bind(columns.keys)
            .bind(channel)
            .fetch_all(&mut *conn)
            .await?;
        let rows = rows
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        let (mut out, unresolved) = batch::enqueued_from_rows(rows);
        if !unresolved.is_empty() {
            let keys: Vec<&str> = unresolved.iter().map(|(_, key)| key.as_str()).collect();
            let holders = self
                .q(&self.inner.sql.lookup_unique)
                .bind(self.inner.config.queue.as_str())
                .bind(&keys)
                .fetch_all(&mut *conn)
                .await?
                .iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .collect::<Result<_, sqlx::Error>>()?;
            batch::resolve_duplicates(&mut out, unresolved, holders)?;
        }
        Ok(out)
    }

    /// Sends this queue's wake-up on `conn`, delivered when its transaction commits: for jobs
    /// inserted by the adopter's own SQL (a legacy table with domain columns), so idle workers
    /// start them at once instead of at their next poll.
    pub async fn notify_in(&self, conn: &mut PgConnection) -> Result<(), PgError> {
        sqlx::query(crate::sql::NOTIFY)
            .bind(&self.inner.channel)
            .bind(self.inner.config.queue.as_str())
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Applies fenced writes on `conn` (the caller's connection or transaction), one outcome per
    /// item in order. Each item is a compare-and-set on `(id, in_flight, generation)`; an item
    /// repeated in the same call applies at most once.
    pub async fn finalize_with(
        &self,
        conn: &mut PgConnection,
        items: &[(Claim, Finalize)],
    ) -> Result<Vec<FinalizeOutcome>, PgError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let columns = FinalizeColumns::new(items);
        let rows = self
            .q(&self.inner.sql.finalize)
            .bind(&columns.ids)
            .bind(&columns.generations)
            .bind(&columns.kinds)
            .bind(&columns.run_ats)
            .bind(&columns.delays)
            .bind(&columns.errors)
            .fetch_all(&mut *conn)
            .await?;
        let applied = rows
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<Vec<(i64, i64)>, sqlx::Error>>()?;
        Ok(batch::outcomes(items, applied))
    }

    /// Deletes terminal jobs (of every queue in the table) that finished longer ago than
    /// `older_than`, in batches of `batch_size` rows so no statement holds many locks, until none
    /// is left. Returns how many rows were deleted.
    pub async fn sweep_finished(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, PgError> {
        let mut total = 0;
        loop {
            let deleted = self
                .q(&self.inner.sql.sweep_finished)
                .bind(older_than.as_secs_f64())
                .bind(i64::from(batch_size.max(1)))
                .execute(&self.inner.pool)
                .await?
                .rows_affected();
            total += deleted;
            if deleted < u64::from(batch_size.max(1)) {
                return Ok(total);
            }
        }
    }
}

fn claimed_job(row: &PgRow) -> Result<ClaimedJob, sqlx::Error> {
    Ok(batch::claimed_job_from_row!(row))
}

fn job_record(row: &PgRow) -> Result<JobRecord, PgError> {
    Ok(batch::job_record_from_row!(row))
}

impl Backend for PgQueue {
    type Tx = PgTx;

    fn queue(&self) -> &QueueName {
        &self.inner.config.queue
    }

    async fn enqueue(&self, job: NewJob) -> queue_core::Result<Enqueued> {
        let mut out = self.enqueue_many(vec![job]).await?;
        Ok(out.remove(0))
    }

    async fn enqueue_many(&self, jobs: Vec<NewJob>) -> queue_core::Result<Vec<Enqueued>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.inner.pool.acquire().await.map_err(PgError::from)?;
        Ok(self.enqueue_with(&mut conn, jobs).await?)
    }

    async fn enqueue_in(&self, tx: &mut PgTx, job: NewJob) -> queue_core::Result<Enqueued> {
        let mut out = self.enqueue_with(tx, vec![job]).await?;
        Ok(out.remove(0))
    }

    async fn begin(&self) -> queue_core::Result<PgTx> {
        Ok(PgTx(self.inner.pool.begin().await.map_err(PgError::from)?))
    }

    async fn claim(&self, request: ClaimRequest) -> queue_core::Result<ClaimBatch> {
        let rows = self
            .q(&self.inner.sql.claim)
            .bind(self.inner.config.queue.as_str())
            .bind(i64::from(request.batch_size.max(1)))
            .bind(request.lease.as_secs_f64())
            .bind(i32::try_from(request.max_reclaims).unwrap_or(i32::MAX))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(PgError::from)?;
        let jobs = rows
            .iter()
            .map(claimed_job)
            .collect::<Result<_, _>>()
            .map_err(PgError::from)?;
        let batch = ClaimBatch { jobs };
        Ok(batch)
    }

    async fn finalize_in(
        &self,
        tx: &mut PgTx,
        claim: Claim,
        action: &Finalize,
    ) -> queue_core::Result<FinalizeOutcome> {
        let outcomes = self
            .finalize_with(tx, std::slice::from_ref(&(claim, action.clone())))
            .await?;
        Ok(outcomes[0])
    }

    async fn finalize(
        &self,
        claim: Claim,
        action: &Finalize,
    ) -> queue_core::Result<FinalizeOutcome> {
        // A single statement commits on its own: no BEGIN/COMMIT round trips.
        Ok(self.finalize_many(&[(claim, action.clone())]).await?[0])
    }

    async fn finalize_many(
        &self,
        items: &[(Claim, Finalize)],
    ) -> queue_core::Result<Vec<FinalizeOutcome>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.inner.pool.acquire().await.map_err(PgError::from)?;
        Ok(self.finalize_with(&mut conn, items).await?)
    }

    async fn extend_lease(&self, claim: Claim) -> queue_core::Result<FinalizeOutcome> {
        let done = self
            .q(&self.inner.sql.extend_lease)
            .bind(claim.id.0)
            .bind(claim.generation.0)
            .execute(&self.inner.pool)
            .await
            .map_err(PgError::from)?;
        Ok(FinalizeOutcome::from_rows_affected(done.rows_affected()))
    }

    async fn cancel(&self, id: JobId) -> queue_core::Result<CancelOutcome> {
        let queue = self.inner.config.queue.as_str();
        loop {
            let done = self
                .q(&self.inner.sql.cancel_pending)
                .bind(id.0)
                .bind(queue)
                .execute(&self.inner.pool)
                .await
                .map_err(PgError::from)?;
            if done.rows_affected() == 1 {
                return Ok(CancelOutcome::Cancelled);
            }
            let status: Option<String> = self
                .q(&self.inner.sql.status_of)
                .bind(id.0)
                .bind(queue)
                .fetch_optional(&self.inner.pool)
                .await
                .map_err(PgError::from)?
                .map(|row| row.get(0));
            return Ok(match status {
                None => CancelOutcome::NotFound,
                Some(status) => match parse_status(id.0, status)? {
                    JobStatus::InFlight => CancelOutcome::InFlight,
                    // Released or retried between the two statements: pending again, try again.
                    JobStatus::Pending => continue,
                    terminal => CancelOutcome::AlreadyTerminal(terminal),
                },
            });
        }
    }

    async fn get(&self, id: JobId) -> queue_core::Result<Option<JobRecord>> {
        let row = self
            .q(&self.inner.sql.get)
            .bind(id.0)
            .bind(self.inner.config.queue.as_str())
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(PgError::from)?;
        Ok(row.as_ref().map(job_record).transpose()?)
    }

    async fn counts(&self) -> queue_core::Result<QueueCounts> {
        let rows = self
            .q(&self.inner.sql.counts)
            .bind(self.inner.config.queue.as_str())
            .fetch_all(&self.inner.pool)
            .await
            .map_err(PgError::from)?;
        let mut counts = QueueCounts::default();
        for row in rows {
            let status: String = row.get(0);
            let n: i64 = row.get(1);
            counts.add(parse_status(-1, status)?, n as u64);
        }
        Ok(counts)
    }

    fn wake_signal(&self) -> Option<Arc<Notify>> {
        self.inner.config.listen.then(|| self.inner.wake.clone())
    }
}
