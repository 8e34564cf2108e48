//! `TpQueue`: the tokio-postgres + deadpool-postgres driver. Same statements ([`crate::sql`]),
//! same semantics and the same conformance suite as the sqlx driver.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{GenericClient, Object, Pool};
use queue_core::{
    Backend, BackendTx, CancelOutcome, Claim, ClaimBatch, ClaimRequest, ClaimedJob, Enqueued,
    Finalize, FinalizeOutcome, JobId, JobRecord, JobStatus, NewJob, QueueCounts, QueueName,
};
use tokio::sync::Notify;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::batch::{self, EnqueueColumns, FinalizeColumns, parse_status};
use crate::config::PgQueueConfig;
use crate::error::PgError;
use crate::ident::TableName;
use crate::schema::{self, TableFacts};
use crate::sql::{self, Statements};
use crate::tp_listener;
use crate::wake::ListenerGuard;

/// Outcomes of a batched finalize are written in chunks of this size, pipelined on one
/// connection: the server works on one chunk while the next is on the wire.
const PIPELINE_CHUNK: usize = 128;

/// A queue in a PostgreSQL table, on a deadpool-postgres pool. Cloning is cheap and shares
/// everything. Statements are prepared once per connection (deadpool's statement cache) and
/// arrays travel in the binary protocol.
///
/// ```no_run
/// use queue_core::{Backend, NewJob};
/// use queue_postgres::{PgQueueConfig, TableName, TpQueue};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pg: tokio_postgres::Config = "host=127.0.0.1 user=postgres dbname=app".parse()?;
/// let manager = deadpool_postgres::Manager::new(pg.clone(), tokio_postgres::NoTls);
/// let pool = deadpool_postgres::Pool::builder(manager).max_size(16).build()?;
/// TpQueue::install_table(&pool, &TableName::default()).await?;
/// // `pg` opens the dedicated LISTEN connection (no TLS; set `listen: false` to poll only).
/// let queue = TpQueue::connect(pool, PgQueueConfig::default(), pg).await?;
/// queue.enqueue(NewJob::new(&"hello")?).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TpQueue {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    config: PgQueueConfig,
    sql: Statements,
    quoted_table: String,
    channel: String,
    wake: Arc<Notify>,
    _listener: Option<ListenerGuard>,
}

impl std::fmt::Debug for TpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpQueue")
            .field("table", &self.inner.config.table)
            .field("queue", &self.inner.config.queue)
            .finish_non_exhaustive()
    }
}

/// A transaction of the tokio-postgres driver: a pooled connection inside `BEGIN`. Hooks receive
/// it and write through it (`tx.execute(…)`, `tx.prepare_cached(…)`: it dereferences to the
/// pooled client). Dropping it without commit rolls back before the connection is reused.
pub struct TpTx {
    client: Option<Object>,
}

impl std::fmt::Debug for TpTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpTx")
            .field("open", &self.client.is_some())
            .finish()
    }
}

impl TpTx {
    /// Begins a transaction on a connection of `pool`.
    pub async fn begin(pool: &Pool) -> Result<TpTx, PgError> {
        let client = pool.get().await?;
        client.batch_execute("BEGIN").await?;
        Ok(TpTx {
            client: Some(client),
        })
    }

    async fn finish(mut self, statement: &str) -> Result<(), PgError> {
        let client = self.client.take().expect("an open transaction");
        match client.batch_execute(statement).await {
            Ok(()) => Ok(()),
            Err(err) => {
                // The connection's state is unknown: never hand it out again.
                let _ = Object::take(client);
                Err(err.into())
            }
        }
    }
}

impl Deref for TpTx {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.client.as_ref().expect("an open transaction")
    }
}

impl DerefMut for TpTx {
    fn deref_mut(&mut self) -> &mut Object {
        self.client.as_mut().expect("an open transaction")
    }
}

impl Drop for TpTx {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        // Dropped inside BEGIN: roll back before the pool reuses the connection; without a
        // runtime to do that, take the connection out of the pool instead.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if client.batch_execute("ROLLBACK").await.is_err() {
                        let _ = Object::take(client);
                    }
                });
            }
            Err(_) => {
                let _ = Object::take(client);
            }
        }
    }
}

impl BackendTx for TpTx {
    async fn commit(self) -> queue_core::Result<()> {
        Ok(self.finish("COMMIT").await?)
    }

    async fn rollback(self) -> queue_core::Result<()> {
        Ok(self.finish("ROLLBACK").await?)
    }
}

async fn read_facts(client: &Object, table: &TableName) -> Result<TableFacts, PgError> {
    let quoted = table.quoted();
    let columns = client
        .query(sql::SCHEMA_COLUMNS, &[&quoted])
        .await?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect::<Result<_, tokio_postgres::Error>>()?;
    let indexes = client
        .query(sql::SCHEMA_INDEXES, &[&quoted])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    let id_has_sequence = client
        .query_one(sql::SCHEMA_ID_SEQUENCE, &[&quoted])
        .await
        .ok()
        .and_then(|row| row.try_get::<_, Option<bool>>(0).ok().flatten())
        == Some(true);
    Ok(TableFacts {
        columns,
        indexes,
        id_has_sequence,
    })
}

impl TpQueue {
    /// A queue handle on `pool`. Checks the table's schema first and refuses a table that is not
    /// on the lease schema ([`PgError::Schema`]). With `config.listen`, opens a dedicated `LISTEN`
    /// connection from `pg_config` (without TLS).
    pub async fn connect(
        pool: Pool,
        config: PgQueueConfig,
        pg_config: tokio_postgres::Config,
    ) -> Result<TpQueue, PgError> {
        let facts = read_facts(&pool.get().await?, &config.table).await?;
        schema::evaluate_schema(&config.table, &facts)?;
        let wake = Arc::new(Notify::new());
        let channel = config.table.channel();
        let listener = config.listen.then(|| {
            tp_listener::spawn(
                pg_config,
                channel.clone(),
                config.queue.as_str().to_owned(),
                wake.clone(),
            )
        });
        Ok(TpQueue {
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

    /// Creates (if missing) a queue table named `table` (the framework's migrations, rendered).
    pub async fn install_table(pool: &Pool, table: &TableName) -> Result<(), PgError> {
        let client = pool.get().await?;
        client
            .batch_execute(&schema::create_table_sql(table))
            .await?;
        Ok(())
    }

    /// Upgrades a legacy table in place ([`crate::upgrade_legacy_sql`]), in one transaction.
    pub async fn upgrade_legacy_table(
        pool: &Pool,
        table: &TableName,
        queue: &QueueName,
        drop_index: Option<&str>,
    ) -> Result<(), PgError> {
        let ddl = schema::upgrade_legacy_sql(table, queue, drop_index)?;
        let client = pool.get().await?;
        client
            .batch_execute(&format!("BEGIN;\n{ddl}\nCOMMIT;"))
            .await?;
        Ok(())
    }

    /// Refuses a table that is not on the lease schema (what [`TpQueue::connect`] runs).
    pub async fn check_schema(pool: &Pool, table: &TableName) -> Result<(), PgError> {
        let facts = read_facts(&pool.get().await?, table).await?;
        schema::evaluate_schema(table, &facts)
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
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

    fn queue_str(&self) -> &str {
        self.inner.config.queue.as_str()
    }

    /// Enqueues `jobs` through `client`: a pooled connection, or the caller's own
    /// `deadpool_postgres::Transaction`, so the jobs commit with the caller's writes.
    pub async fn enqueue_with<C: GenericClient>(
        &self,
        client: &C,
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
            .then(|| self.inner.channel.as_str());
        let statement = client.prepare_cached(&self.inner.sql.enqueue).await?;
        let rows = client
            .query(
                &statement,
                &[
                    &self.queue_str(),
                    &self.inner.quoted_table,
                    &columns.payloads,
                    &columns.priorities,
                    &columns.run_ats,
                    &columns.delays,
                    &columns.keys,
                    &channel,
                ],
            )
            .await?;
        let rows = rows
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
            .collect::<Result<Vec<_>, tokio_postgres::Error>>()?;
        let (mut out, unresolved) = batch::enqueued_from_rows(rows);
        if !unresolved.is_empty() {
            let keys: Vec<&str> = unresolved.iter().map(|(_, key)| key.as_str()).collect();
            let statement = client.prepare_cached(&self.inner.sql.lookup_unique).await?;
            let holders = client
                .query(&statement, &[&self.queue_str(), &keys])
                .await?
                .iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .collect::<Result<_, tokio_postgres::Error>>()?;
            batch::resolve_duplicates(&mut out, unresolved, holders)?;
        }
        Ok(out)
    }

    /// Applies fenced writes through `client` (a pooled connection or the caller's own
    /// transaction), one outcome per item in order. Large batches go in chunks pipelined on the
    /// one connection.
    pub async fn finalize_with<C: GenericClient>(
        &self,
        client: &C,
        items: &[(Claim, Finalize)],
    ) -> Result<Vec<FinalizeOutcome>, PgError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let statement = client.prepare_cached(&self.inner.sql.finalize).await?;
        let chunks: Vec<_> = items.chunks(PIPELINE_CHUNK).collect();
        let columns: Vec<FinalizeColumns<'_>> = chunks
            .iter()
            .map(|chunk| FinalizeColumns::new(chunk))
            .collect();
        // Issued together, the queries share the connection's pipeline: their results come
        // back in order without a round trip each.
        let params: Vec<[&(dyn ToSql + Sync); 6]> = columns
            .iter()
            .map(|c| -> [&(dyn ToSql + Sync); 6] {
                [
                    &c.ids,
                    &c.generations,
                    &c.kinds,
                    &c.run_ats,
                    &c.delays,
                    &c.errors,
                ]
            })
            .collect();
        let results =
            futures_util::future::try_join_all(params.iter().map(|p| client.query(&statement, p)))
                .await?;
        let mut applied = Vec::with_capacity(items.len());
        for row in results.iter().flatten() {
            applied.push((row.try_get(0)?, row.try_get(1)?));
        }
        Ok(batch::outcomes(items, applied))
    }

    /// Sends this queue's wake-up through `client`, delivered when its transaction commits: for
    /// jobs inserted by the adopter's own SQL.
    pub async fn notify_in<C: GenericClient>(&self, client: &C) -> Result<(), PgError> {
        client
            .execute(sql::NOTIFY, &[&self.inner.channel, &self.queue_str()])
            .await?;
        Ok(())
    }

    /// Deletes terminal jobs (of every queue in the table) that finished longer ago than
    /// `older_than`, `batch_size` rows per statement, until none is left. Returns how many.
    pub async fn sweep_finished(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, PgError> {
        let client = self.inner.pool.get().await?;
        let statement = client
            .prepare_cached(&self.inner.sql.sweep_finished)
            .await?;
        let limit = i64::from(batch_size.max(1));
        let mut total = 0;
        loop {
            let deleted = client
                .execute(&statement, &[&older_than.as_secs_f64(), &limit])
                .await?;
            total += deleted;
            if deleted < limit as u64 {
                return Ok(total);
            }
        }
    }
}

fn claimed_job(row: &Row) -> Result<ClaimedJob, tokio_postgres::Error> {
    Ok(batch::claimed_job_from_row!(row))
}

fn job_record(row: &Row) -> Result<JobRecord, PgError> {
    Ok(batch::job_record_from_row!(row))
}

impl Backend for TpQueue {
    type Tx = TpTx;

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
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        Ok(self.enqueue_with(&client, jobs).await?)
    }

    async fn enqueue_in(&self, tx: &mut TpTx, job: NewJob) -> queue_core::Result<Enqueued> {
        let mut out = self.enqueue_with(&**tx, vec![job]).await?;
        Ok(out.remove(0))
    }

    async fn begin(&self) -> queue_core::Result<TpTx> {
        Ok(TpTx::begin(&self.inner.pool).await?)
    }

    async fn claim(&self, request: ClaimRequest) -> queue_core::Result<ClaimBatch> {
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        let statement = client
            .prepare_cached(&self.inner.sql.claim)
            .await
            .map_err(PgError::from)?;
        let max_reclaims = i32::try_from(request.max_reclaims).unwrap_or(i32::MAX);
        let rows = client
            .query(
                &statement,
                &[
                    &self.queue_str(),
                    &i64::from(request.batch_size.max(1)),
                    &request.lease.as_secs_f64(),
                    &max_reclaims,
                ],
            )
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
        tx: &mut TpTx,
        claim: Claim,
        action: &Finalize,
    ) -> queue_core::Result<FinalizeOutcome> {
        let outcomes = self
            .finalize_with(&**tx, std::slice::from_ref(&(claim, action.clone())))
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
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        Ok(self.finalize_with(&client, items).await?)
    }

    async fn extend_lease(&self, claim: Claim) -> queue_core::Result<FinalizeOutcome> {
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        let statement = client
            .prepare_cached(&self.inner.sql.extend_lease)
            .await
            .map_err(PgError::from)?;
        let rows = client
            .execute(&statement, &[&claim.id.0, &claim.generation.0])
            .await
            .map_err(PgError::from)?;
        Ok(FinalizeOutcome::from_rows_affected(rows))
    }

    async fn cancel(&self, id: JobId) -> queue_core::Result<CancelOutcome> {
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        let cancel = client
            .prepare_cached(&self.inner.sql.cancel_pending)
            .await
            .map_err(PgError::from)?;
        let status_of = client
            .prepare_cached(&self.inner.sql.status_of)
            .await
            .map_err(PgError::from)?;
        let queue = self.queue_str();
        let params: [&(dyn ToSql + Sync); 2] = [&id.0, &queue];
        loop {
            // Both statements go out together (pipelined); the read runs after the update.
            let (cancelled, status) = tokio::join!(
                client.execute(&cancel, &params),
                client.query_opt(&status_of, &params),
            );
            if cancelled.map_err(PgError::from)? == 1 {
                return Ok(CancelOutcome::Cancelled);
            }
            let status: Option<String> = status
                .map_err(PgError::from)?
                .map(|row| row.try_get(0))
                .transpose()
                .map_err(PgError::from)?;
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
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        let statement = client
            .prepare_cached(&self.inner.sql.get)
            .await
            .map_err(PgError::from)?;
        let row = client
            .query_opt(&statement, &[&id.0, &self.queue_str()])
            .await
            .map_err(PgError::from)?;
        Ok(row.as_ref().map(job_record).transpose()?)
    }

    async fn counts(&self) -> queue_core::Result<QueueCounts> {
        let client = self.inner.pool.get().await.map_err(PgError::from)?;
        let statement = client
            .prepare_cached(&self.inner.sql.counts)
            .await
            .map_err(PgError::from)?;
        let rows = client
            .query(&statement, &[&self.queue_str()])
            .await
            .map_err(PgError::from)?;
        let mut counts = QueueCounts::default();
        for row in rows {
            let status: String = row.try_get(0).map_err(PgError::from)?;
            let n: i64 = row.try_get(1).map_err(PgError::from)?;
            counts.add(parse_status(-1, status)?, n as u64);
        }
        Ok(counts)
    }

    fn wake_signal(&self) -> Option<Arc<Notify>> {
        self.inner.config.listen.then(|| self.inner.wake.clone())
    }
}
