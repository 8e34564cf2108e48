//! The PostgreSQL queue, written once for every driver: [`PostgresQueue`] and its
//! [`Backend`] implementation, [`PostgresTx`], and the adopter-facing statements.

use std::sync::Arc;
use std::time::Duration;

use queue_core::{
    Backend, BackendTx, CancelTarget, Claim, ClaimBatch, ClaimRequest, Enqueued, Finalize,
    FinalizeOutcome, Heartbeat, JobFilter, JobId, JobPage, JobRecord, JobStatus, Lease,
    MinuteCounts, NewJob, PurgeRequest, QueueControl, QueueCounts, QueueLimits, QueueName,
    QueueStats, RetryTarget,
};
use tokio::sync::Notify;
use tracing::Instrument;

use crate::config::PgQueueConfig;
use crate::driver::{Column, Driver, Params};
use crate::error::PgError;
use crate::ident::TableName;
use crate::schema;
use crate::sql::{self, Sql};
use crate::statement::{self, EnqueueTarget, LimitedForm};
use crate::wake::ListenerGuard;

/// A queue in a PostgreSQL table, on driver `D`'s pool. Cloning is cheap and shares everything.
///
/// Name it by its driver's alias: [`PgQueue`](crate::PgQueue) (sqlx) or
/// [`TokioPostgresQueue`](crate::TokioPostgresQueue) (tokio-postgres + deadpool-postgres).
pub struct PostgresQueue<D: Driver> {
    inner: Arc<Inner<D>>,
}

/// The most jobs `request` asks for.
fn batch(request: &ClaimRequest) -> usize {
    request.batch_size.max(1) as usize
}

/// `request` for what is left of its batch after `taken` jobs.
fn rest_of(request: &ClaimRequest, taken: usize) -> ClaimRequest {
    let mut rest = request.clone();
    rest.batch_size = (batch(request) - taken.min(batch(request))).max(1) as u32;
    rest
}

struct Inner<D: Driver> {
    pool: D::Pool,
    config: PgQueueConfig,
    sql: Sql,
    /// The table name as `pg_get_serial_sequence` wants it.
    quoted_table: String,
    channel: String,
    wake: Arc<Notify>,
    /// Whether the queue had limits when this handle last looked, and when that was.
    limits_seen: std::sync::Mutex<LimitsSeen>,
    /// How this handle's claims ahead of the queue's row lock (`claim_ahead.sql`) fared.
    ahead: std::sync::Mutex<AheadState>,
    /// The room granted to this handle (`grant.sql`), and when it last went without.
    grants: std::sync::Mutex<GrantState>,
    /// Whether its claims under the queue's lock take the lock first.
    lock_turns: std::sync::Mutex<LockTurns>,
    _listener: Option<ListenerGuard>,
}

/// Whether a queue with `limits` and its switch `room_grants` grants room to its handles: the
/// Rust twin of the statements' `GRANTING` (sql.rs), which reads the queue's row alike.
fn grants_room(limits: &QueueLimits, room_grants: bool) -> bool {
    room_grants
        && (limits.max_in_flight.is_some()
            || limits.max_per_partition.is_some()
            || limits.rate.is_some()
            || limits.rate_per_partition.is_some())
}

/// How many times a claim under the queue's lock folds the claims logged for the rate per
/// partition before it counts per partition (`fold_starts.sql`): claims on grants may log 64
/// more meanwhile, each fold takes them all.
const MOST_FOLDS_UNDER_THE_LOCK: u32 = 4;

/// How many claims a grant is for at most (`grant.sql`; fewer under a low `max_per_partition`):
/// its count of the queue's jobs in flight and its write of the queue's row are shared by so
/// many claims. Workers whose slots free a few at a time make many small claims: eight claims
/// a grant drained jobs of 10 ms at 0.92 × an unlimited queue, 32 at 0.945 ×, with noop jobs
/// alike (docs/performance.md).
const GRANT_CLAIMS: u32 = 32;

/// How long a grant lives unless spent or returned first (by the database's clock): the most
/// a crashed handle's room stays out of the others' reach.
const GRANT_LIFE: Duration = Duration::from_secs(2);

/// How long a handle that went without a grant (none given near a limit, or its claim found
/// nothing due and it returned the grant) claims under the lock before it asks again.
const GRANT_PAUSE: Duration = Duration::from_millis(250);

/// How many claims of a queue with limits go straight to the lock (`lock_queue.sql`, then
/// `claim_limited.sql` in the same transaction) after a claim by the one statement alone came
/// back stale. Under contention most claims by the statement alone find their snapshot stale
/// (another claim committed while they waited for the row's lock): each then waited twice and
/// read the queue twice, its first read wasted. Three handles of eight workers under a
/// `max_per_partition` of 2 drained at 0.554 × an unlimited queue that way and at 0.584 × with
/// this (docs/performance.md, "Stale claims under the lock").
/// A claimer alone never comes back stale and keeps the statement's one round trip; after
/// these many claims the handle tries the statement alone again.
const LOCK_FIRST_CLAIMS: u32 = 16;

/// Whether the next claims under the lock take it first ([`LOCK_FIRST_CLAIMS`]).
#[derive(Debug, Default)]
struct LockTurns {
    /// Claims left that take the lock first.
    lock_first: u32,
}

impl LockTurns {
    /// Whether the next claim takes the lock first; counts it.
    fn take_lock_first(&mut self) -> bool {
        if self.lock_first == 0 {
            return false;
        }
        self.lock_first -= 1;
        true
    }

    /// A claim by the statement alone came back stale.
    fn came_back_stale(&mut self) {
        self.lock_first = LOCK_FIRST_CLAIMS;
    }
}

/// The room granted to a queue handle: grants no claim is spending now (each claim running
/// spends a grant of its own, so that claims of one handle never wait for one another's grant
/// row), the ones spent to their end (the next grant statement deletes them), and when the
/// handle last went without one.
#[derive(Debug, Default)]
struct GrantState {
    /// Grant ids.
    idle: Vec<i64>,
    spent: Vec<i64>,
    without_at: Option<std::time::Instant>,
    /// The largest batch a claim of the handle asked for: grants are sized for claims of it
    /// (a worker whose slots free one at a time asks for small batches, then large ones).
    most_asked: u32,
}

impl GrantState {
    /// Whether the handle may ask for a grant now.
    fn may_ask(&self, now: std::time::Instant) -> bool {
        self.without_at
            .is_none_or(|at| now.duration_since(at) >= GRANT_PAUSE)
    }
}

/// What `claim_ahead.sql` came to.
enum Ahead {
    /// Committed.
    Claimed(ClaimBatch),
    /// The room was not ample: nothing claimed.
    Binding,
    /// Its jobs would have put the queue over a limit: it failed, undone.
    Over,
}

/// How long a handle whose claim found its queue near a limit claims under the queue's row
/// lock before it tries `claim_ahead.sql` again: near the limit that try mostly comes back
/// empty-handed, a statement and a count for nothing.
const AHEAD_PAUSE: Duration = Duration::from_millis(250);

/// Claims ahead that must fit before the margin narrows by one claim again.
const AHEAD_MARGIN_EASE: u32 = 16;

/// How a handle's claims ahead fared: when one last found its queue near a limit or failed
/// (it then claims under the lock until [`AHEAD_PAUSE`] has passed), and the margin they ask
/// for. A claim ahead that fails has met more claims committing while it ran than its margin
/// left room for (more workers claim than the margin assumed): the margin doubles, up to
/// [`sql::AHEAD_MARGIN_MOST`] (once per pause: claims that failed together count once). It
/// narrows by one claim for every [`AHEAD_MARGIN_EASE`] claims ahead that took jobs and fit,
/// and by half when the queue's room is short of it ('binding': a margin wider than the room
/// the queue usually has would keep every claim under the lock), down to
/// [`sql::AHEAD_MARGIN_LEAST`]. Failures stay rare whatever the number of workers, and the
/// margin no wider than they need.
#[derive(Debug)]
struct AheadState {
    near_limit_at: Option<std::time::Instant>,
    widened_at: Option<std::time::Instant>,
    margin: u32,
    fits: u32,
}

impl Default for AheadState {
    fn default() -> Self {
        AheadState {
            near_limit_at: None,
            widened_at: None,
            margin: sql::AHEAD_MARGIN_LEAST,
            fits: 0,
        }
    }
}

impl AheadState {
    /// The margin of the next claim ahead, or `None` while it should claim under the lock.
    fn margin(&self, now: std::time::Instant) -> Option<u32> {
        match self.near_limit_at {
            Some(at) if now.duration_since(at) < AHEAD_PAUSE => None,
            _ => Some(self.margin),
        }
    }

    fn came_to(&mut self, ahead: &Ahead, now: std::time::Instant) {
        match ahead {
            // A claim that found nothing due says nothing of the claims around it.
            Ahead::Claimed(batch) if batch.jobs.is_empty() => {}
            Ahead::Claimed(_) => {
                self.fits += 1;
                if self.fits >= AHEAD_MARGIN_EASE {
                    self.fits = 0;
                    self.margin = (self.margin - 1).max(sql::AHEAD_MARGIN_LEAST);
                }
            }
            Ahead::Over => {
                self.near_limit_at = Some(now);
                self.fits = 0;
                if self
                    .widened_at
                    .is_none_or(|at| now.duration_since(at) >= AHEAD_PAUSE)
                {
                    self.widened_at = Some(now);
                    self.margin = (self.margin * 2).min(sql::AHEAD_MARGIN_MOST);
                }
            }
            Ahead::Binding => {
                self.near_limit_at = Some(now);
                self.margin = (self.margin / 2).max(sql::AHEAD_MARGIN_LEAST);
            }
        }
    }
}

/// How long a handle trusts what it last read of its queue's limits. Claims of a queue with
/// limits take the locked path (`lock_queue.sql`, `claim_limited.sql`); a handle that has not
/// yet seen a queue's new limits claims nothing from it meanwhile (`claim.sql` refuses a
/// limited queue), so the limits hold from the moment they commit for the claims that start
/// after it (a claim already running may still take its batch: docs/operations.md, "Queue
/// limits").
const LIMITS_RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
struct LimitsSeen {
    at: Option<std::time::Instant>,
    limited: bool,
    /// Room may be granted to the queue's handles (`grant.sql`): its switch is on, it has a
    /// limit in flight and no rate. Read by [`PostgresQueue::limited`] only.
    granting: bool,
    /// Limits per partition among them: claims start with the full form of
    /// `claim_limited.sql`, not the lean one.
    partitioned: bool,
    /// Limits in flight only, no rate: a claim may be checked under the lock after it
    /// ([`PostgresQueue::claim_checked`]).
    checkable: bool,
}

/// Whether `limits` are in flight only (`max_in_flight`, `max_per_partition`; no rate), which
/// `claim_check.sql` counts exactly after the queue's lock.
fn checkable(limits: &QueueLimits) -> bool {
    limits.rate.is_none()
        && limits.rate_per_partition.is_none()
        && (limits.max_in_flight.is_some() || limits.max_per_partition.is_some())
}

/// What a claim checked under the lock after it came to.
enum Checked {
    /// It fit the limits and committed (no job when none was due).
    Claimed(ClaimBatch),
    /// It would have put the queue over a limit: rolled back.
    Over,
    /// The queue's limits are no longer in flight only: rolled back.
    NotCheckable,
}

impl<D: Driver> Clone for PostgresQueue<D> {
    fn clone(&self) -> Self {
        PostgresQueue {
            inner: self.inner.clone(),
        }
    }
}

impl<D: Driver> std::fmt::Debug for PostgresQueue<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresQueue")
            .field("driver", &std::any::type_name::<D>())
            .field("table", &self.inner.config.table)
            .field("queue", &self.inner.config.queue)
            .finish_non_exhaustive()
    }
}

/// What starts a driver's `LISTEN` connection: `(channel, queue, wake)` to a guard that stops it.
pub(crate) type Listen = Box<dyn FnOnce(String, String, Arc<Notify>) -> ListenerGuard + Send>;

impl<D: Driver> PostgresQueue<D> {
    /// Checks the table's schema, renders its statements and starts the listener (each
    /// driver's `connect` passes its own).
    pub(crate) async fn open(
        pool: D::Pool,
        config: PgQueueConfig,
        listen: Listen,
    ) -> Result<Self, PgError> {
        Self::check_schema(&pool, &config.table).await?;
        let sql = Sql::new(&config.table)?;
        let wake = Arc::new(Notify::new());
        let channel = config.table.channel();
        let listener = config.listen.then(|| {
            listen(
                channel.clone(),
                config.queue.as_str().to_owned(),
                wake.clone(),
            )
        });
        Ok(PostgresQueue {
            inner: Arc::new(Inner {
                pool,
                quoted_table: config.table.quoted(),
                config,
                sql,
                channel,
                wake,
                limits_seen: Default::default(),
                ahead: Default::default(),
                grants: Default::default(),
                lock_turns: Default::default(),
                _listener: listener,
            }),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &D::Pool {
        &self.inner.pool
    }

    /// The configuration.
    pub fn config(&self) -> &PgQueueConfig {
        &self.inner.config
    }

    /// Enqueues `jobs` on `conn`: any connection or transaction of the caller, so the jobs
    /// commit with the caller's own writes. One statement, whatever the number of jobs: all
    /// of them or none, and each result exact (a unique key already held reports its holder).
    pub async fn enqueue_with(
        &self,
        conn: D::Conn<'_>,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<Enqueued>, PgError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let target = self.enqueue_target(&jobs)?;
        let enqueued = statement::enqueue::<D>(conn, &self.inner.sql, &target, jobs).await?;
        let new = enqueued.iter().filter(|e| !e.duplicate).count();
        queue_core::metrics::record_enqueued(&self.inner.config.queue, new as u64);
        Ok(enqueued)
    }

    /// Where `jobs` go, once each is checked against the queue's payload limit.
    fn enqueue_target(&self, jobs: &[NewJob]) -> Result<EnqueueTarget<'_>, PgError> {
        let config = &self.inner.config;
        for job in jobs {
            job.check_within(config.max_payload_bytes)?;
        }
        queue_core::limits::check_enqueue_batch(jobs)?;
        Ok(EnqueueTarget {
            queue: &config.queue,
            quoted_table: &self.inner.quoted_table,
            channel: config
                .notify_on_enqueue
                .then_some(self.inner.channel.as_str()),
        })
    }

    /// A bulk enqueue by `COPY` in a transaction of its own (see [`statement::enqueue_copy`]);
    /// `None` when the statement path must take the jobs.
    async fn enqueue_by_copy(&self, jobs: &[NewJob]) -> Result<Option<Vec<Enqueued>>, PgError> {
        let target = self.enqueue_target(jobs)?;
        let mut tx = D::begin(&self.inner.pool).await?;
        let copied =
            statement::enqueue_copy::<D>(D::in_tx(&mut tx), &self.inner.sql, &target, jobs).await?;
        let Some(enqueued) = copied else {
            D::rollback(tx).await?;
            return Ok(None);
        };
        D::commit(tx).await?;
        queue_core::metrics::record_enqueued(&self.inner.config.queue, enqueued.len() as u64);
        Ok(Some(enqueued))
    }

    /// A bulk enqueue by `COPY`, or by the statements when `COPY` cannot take the jobs.
    async fn enqueue_copying(&self, jobs: Vec<NewJob>) -> queue_core::Result<Vec<Enqueued>> {
        if let Some(enqueued) = self.enqueue_by_copy(&jobs).await? {
            return Ok(enqueued);
        }
        Ok(self.enqueue_pooled(jobs).await?)
    }

    /// The enqueue statements on a pooled connection; one that answered with the wrong number
    /// of rows is out of step with its server and is closed, not pooled.
    async fn enqueue_pooled(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>, PgError> {
        let mut conn = D::acquire(&self.inner.pool).await?;
        let enqueued = self.enqueue_with(D::pooled(&mut conn), jobs).await;
        if let Err(PgError::RowsAnswered { .. }) = enqueued {
            D::discard(conn);
        }
        enqueued
    }

    /// Applies fenced writes on `conn` (the caller's connection or transaction), one outcome
    /// per item in order. Each item is a compare-and-set on `(id, in_flight, generation)`; each
    /// is written as [`Finalize::storable`] makes it; two items for one claim are refused
    /// ([`queue_core::InvalidInput::DuplicateClaim`]) before any SQL runs.
    pub async fn finalize_with(
        &self,
        conn: D::Conn<'_>,
        items: &[(Claim, Finalize)],
    ) -> Result<Vec<FinalizeOutcome>, PgError> {
        queue_core::limits::check_batch(items)?;
        statement::finalize::<D>(conn, &self.inner.sql, items).await
    }

    /// Sends this queue's wake-up on `conn`, delivered when its transaction commits: for jobs
    /// inserted by the adopter's own SQL (a legacy table with domain columns), so idle workers
    /// start them at once instead of at their next poll.
    pub async fn notify_in(&self, conn: D::Conn<'_>) -> Result<(), PgError> {
        let inner = &self.inner;
        statement::notify::<D>(conn, &inner.sql, &inner.channel, &inner.config.queue).await
    }

    /// Deletes terminal jobs (of every queue in the table) that finished longer ago than
    /// `older_than`, in batches of `batch_size` rows so no statement holds many locks, until
    /// none is left. Returns how many rows were deleted.
    pub async fn sweep_finished(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, PgError> {
        let limit = i64::from(batch_size.max(1));
        let mut conn = D::acquire(&self.inner.pool).await?;
        let mut total = 0;
        loop {
            let deleted = statement::sweep_finished::<D>(
                D::pooled(&mut conn),
                &self.inner.sql,
                older_than,
                limit,
            )
            .await?;
            total += deleted;
            if deleted < limit as u64 {
                return Ok(total);
            }
        }
    }

    /// Switches room grants on or off for this handle's queue (docs/operations.md, "Room
    /// grants"): while on, a queue with limits in flight (`max_in_flight`,
    /// `max_per_partition`) or a rate (per queue or per partition) grants each worker's handle
    /// room for several claims at once, which it spends without the queue's row lock, and every
    /// other claim counts that room against the limits. A queue's row starts with the switch
    /// of the handle that writes it first ([`PgQueueConfig::room_grants_for_new_queues`], on
    /// by default); this changes it after.
    ///
    /// An older release's claims do not count grants, and could pass the limits beside a
    /// handle that holds room: the fence (table migration `20261213000001`) fails them while
    /// the switch is on, so switch it on once every worker runs this release (older workers
    /// claim nothing while it is on). A change deletes the queue's grants (their claims fail and claim
    /// again under the lock). Returns whether it is on. Each handle sees the change within a
    /// second.
    pub async fn set_room_grants(&self, on: bool) -> Result<bool, PgError> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let on = statement::set_room_grants::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            on,
        )
        .await?;
        // This handle's next claim reads the switch again.
        inner.limits_seen.lock().expect("limits lock").at = None;
        queue_core::events::room_grants_set(&inner.config.queue, on);
        Ok(on)
    }

    /// Whether room grants are on for this handle's queue ([`Self::set_room_grants`]).
    pub async fn room_grants(&self) -> Result<bool, PgError> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let control =
            statement::control::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue).await?;
        Ok(control.room_grants)
    }

    /// Runs a statement of your own on the pool and returns its rows: the same code for every
    /// driver. Values are always bound, never spliced into `sql`.
    pub async fn query<'p, P: Params<'p>>(
        &self,
        sql: &'static str,
        params: P,
    ) -> Result<Vec<Row<D>>, PgError> {
        let mut conn = D::acquire(&self.inner.pool).await?;
        let rows = D::query(D::pooled(&mut conn), sql, &params).await?;
        Ok(rows.into_iter().map(Row).collect())
    }

    /// Creates (if missing) a queue table named `table`: the framework's migrations, rendered
    /// for it ([`crate::create_table_sql`]). On a table that exists without
    /// `<table>_lease_idx`, which no statement needs any more, it does not build that index
    /// again (docs/operations.md, "Dropping `<table>_lease_idx`").
    pub async fn install_table(pool: &D::Pool, table: &TableName) -> Result<(), PgError> {
        let mut conn = D::acquire(pool).await?;
        let facts = statement::table_facts::<D>(D::pooled(&mut conn), table).await?;
        let ddl = schema::install_table_sql(table, &facts)?;
        D::batch_execute(D::pooled(&mut conn), &ddl).await
    }

    /// Refuses, naming what is missing, a table that is not on the lease schema
    /// ([`PgError::Schema`]). Every `connect` runs it: a half-deployed fleet fails loudly
    /// instead of double-running.
    pub async fn check_schema(pool: &D::Pool, table: &TableName) -> Result<(), PgError> {
        let mut conn = D::acquire(pool).await?;
        let facts = statement::table_facts::<D>(D::pooled(&mut conn), table).await?;
        schema::evaluate_schema(table, &facts)
    }

    /// Whether the queue has limits, as last read (again once [`LIMITS_RECHECK`] has passed).
    async fn limited(&self) -> Result<bool, PgError> {
        {
            let seen = self.inner.limits_seen.lock().expect("limits lock");
            if seen.at.is_some_and(|at| at.elapsed() < LIMITS_RECHECK) {
                return Ok(seen.limited);
            }
        }
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let control =
            statement::control::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue).await?;
        let limits = &control.limits;
        self.saw_limits(limits, control.room_grants);
        if !grants_room(limits, control.room_grants) {
            self.drop_grants().await?;
        }
        Ok(!limits.is_none())
    }

    /// Records `limits` as this handle's latest read of them, with the switch of room grants
    /// read with them: the handle reads the row again only once [`LIMITS_RECHECK`] has passed
    /// since, so a read that leaves the switch out must not count as one (a handle whose claims
    /// took the lock at least once a second would never see the switch change).
    fn saw_limits(&self, limits: &QueueLimits, room_grants: bool) {
        let mut seen = self.inner.limits_seen.lock().expect("limits lock");
        *seen = LimitsSeen {
            at: Some(std::time::Instant::now()),
            limited: !limits.is_none(),
            partitioned: limits.partitioned(),
            granting: grants_room(limits, room_grants),
            checkable: checkable(limits),
        };
    }

    /// Whether the handle last saw its queue granting room.
    fn granting(&self) -> bool {
        self.inner.limits_seen.lock().expect("limits lock").granting
    }

    /// Returns the grants the handle holds and no claim is spending, and those it spent to
    /// their end, so that their room comes back at once (the queue stopped granting).
    async fn drop_grants(&self) -> Result<(), PgError> {
        let returned: Vec<i64> = {
            let mut state = self.inner.grants.lock().expect("grants lock");
            let idle = std::mem::take(&mut state.idle);
            idle.into_iter()
                .chain(std::mem::take(&mut state.spent))
                .collect()
        };
        for grant in returned {
            if let Err(err) = self.return_grant(grant).await {
                // Deleted by the next grant statement, or counted until it expires.
                self.inner
                    .grants
                    .lock()
                    .expect("grants lock")
                    .spent
                    .push(grant);
                return Err(err);
            }
        }
        Ok(())
    }

    /// Deletes the grant `grant` (`return_grant.sql`): its room back for the others.
    async fn return_grant(&self, grant: i64) -> Result<(), PgError> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        statement::return_grant::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue, grant)
            .await
    }

    /// A grant for one claim to spend: one no other claim of the handle is spending, or a new
    /// one (`grant.sql`, after the queue's row lock, deleting the grants the handle spent);
    /// `None` when the handle goes without ([`GRANT_PAUSE`] after the queue last gave none).
    async fn take_grant(&self, request: &ClaimRequest) -> Result<Option<i64>, PgError> {
        let now = std::time::Instant::now;
        let (spent, sized) = {
            let mut state = self.inner.grants.lock().expect("grants lock");
            state.most_asked = state.most_asked.max(request.batch_size);
            // The oldest first: a grant left idle still counts against the limits.
            if !state.idle.is_empty() {
                return Ok(Some(state.idle.remove(0)));
            }
            if !state.may_ask(now()) {
                return Ok(None);
            }
            let mut sized = request.clone();
            sized.batch_size = state.most_asked;
            (std::mem::take(&mut state.spent), sized)
        };
        let inner = &self.inner;
        let queue = &inner.config.queue;
        let asked = async {
            let mut tx = D::begin(&inner.pool).await?;
            statement::lock_queue::<D>(D::in_tx(&mut tx), &inner.sql, queue).await?;
            let grant = statement::grant::<D>(
                D::in_tx(&mut tx),
                &inner.sql,
                queue,
                &sized,
                GRANT_CLAIMS,
                GRANT_LIFE,
                &spent,
            )
            .await?;
            D::commit(tx).await?;
            Ok::<_, PgError>(grant)
        }
        .await;
        let mut state = inner.grants.lock().expect("grants lock");
        match asked {
            Ok(grant) => {
                if grant.is_none() {
                    state.without_at = Some(now());
                }
                Ok(grant)
            }
            Err(err) => {
                // Still to be deleted by the next grant statement.
                state.spent.extend(spent);
                Err(err)
            }
        }
    }

    /// A claim on room granted to the handle (`claim_granted.sql`), while the queue grants it;
    /// `None` when the handle goes without a grant (claim under the lock then).
    async fn claim_on_grant(&self, request: &ClaimRequest) -> Result<Option<ClaimBatch>, PgError> {
        let inner = &self.inner;
        let queue = &inner.config.queue;
        // A grant gone or short of room (expired, the limits changed) is dropped and another
        // taken once.
        for _ in 0..2 {
            let Some(grant) = self.take_grant(request).await? else {
                return Ok(None);
            };
            let claim = async {
                let mut conn = D::acquire(&inner.pool).await?;
                statement::claim_granted::<D>(
                    D::pooled(&mut conn),
                    &inner.sql,
                    queue,
                    request,
                    grant,
                )
                .await
            }
            .await;
            let claim = match claim {
                Ok(claim) => claim,
                Err(err) => {
                    // The claim may or may not have spent it: the grant statement deletes it.
                    inner.grants.lock().expect("grants lock").spent.push(grant);
                    return Err(err);
                }
            };
            match claim {
                statement::GrantedClaim::Claimed(jobs, left) => {
                    let idle = jobs.is_empty();
                    let spent = left.is_none_or(|(jobs_left, claims_left)| {
                        claims_left == 0 || jobs_left < i64::from(request.batch_size.max(1))
                    });
                    if idle {
                        // Nothing due: the room goes back to the others at once while this
                        // handle idles.
                        if self.return_grant(grant).await.is_err() {
                            // The next grant statement deletes it.
                            inner.grants.lock().expect("grants lock").spent.push(grant);
                        }
                        inner.grants.lock().expect("grants lock").without_at =
                            Some(std::time::Instant::now());
                    } else if spent {
                        // Spent to its end: what is left of it counts until a grant statement
                        // deletes it (this handle's next, unless it goes without grants
                        // meanwhile: then any handle's once it expired), which, under a rate,
                        // logs the jobs its claims took (grant_log.sql).
                        inner.grants.lock().expect("grants lock").spent.push(grant);
                    } else {
                        inner.grants.lock().expect("grants lock").idle.push(grant);
                    }
                    return Ok(Some(ClaimBatch { jobs }));
                }
                statement::GrantedClaim::Over => {
                    // Gone, or kept (its room short, a takeover over its cap a slot): the next
                    // grant statement deletes it and gives back what it left.
                    inner.grants.lock().expect("grants lock").spent.push(grant);
                    queue_core::metrics::record_limited_claim_rerun(queue);
                }
            }
        }
        Ok(None)
    }

    /// A claim of a queue whose limits are in flight only, taken without waiting for the queue's
    /// row and checked under it after (`claim_checked`, then `lock_queue.sql` and
    /// `claim_check.sql` in the same transaction, which commits only when the claim fits):
    /// under a small `max_per_partition` no claim goes ahead or gets a grant, and a claim under
    /// the lock holds it for its whole pick and write, so the claims of every worker took turns
    /// there even far from the limit. The check holds the lock for a count of the claim's
    /// partitions alone. Its jobs are the earliest due, as a claim ahead takes them; the
    /// partitions take turns only under the lock (the caller's next claims take it first when
    /// this one comes back over).
    async fn claim_checked(&self, request: &ClaimRequest) -> Result<Checked, PgError> {
        let inner = &self.inner;
        let queue = &inner.config.queue;
        let mut tx = D::begin(&inner.pool).await?;
        let (jobs, keys) =
            statement::claim_checked::<D>(D::in_tx(&mut tx), &inner.sql, queue, request).await?;
        if jobs.is_empty() {
            // Nothing due (or the queue paused): nothing to check.
            D::rollback(tx).await?;
            return Ok(Checked::Claimed(ClaimBatch { jobs }));
        }
        let (limits, room_grants) =
            statement::lock_queue::<D>(D::in_tx(&mut tx), &inner.sql, queue).await?;
        if !checkable(&limits) {
            D::rollback(tx).await?;
            self.saw_limits(&limits, room_grants);
            return Ok(Checked::NotCheckable);
        }
        if statement::claim_check::<D>(D::in_tx(&mut tx), &inner.sql, queue, &keys).await? {
            D::rollback(tx).await?;
            return Ok(Checked::Over);
        }
        D::commit(tx).await?;
        self.saw_limits(&limits, room_grants);
        Ok(Checked::Claimed(ClaimBatch { jobs }))
    }

    /// Whether the handle last saw its queue's limits in flight only.
    fn checkable(&self) -> bool {
        self.inner
            .limits_seen
            .lock()
            .expect("limits lock")
            .checkable
    }

    fn lock_turns(&self) -> std::sync::MutexGuard<'_, LockTurns> {
        self.inner.lock_turns.lock().expect("lock turns lock")
    }

    /// The form a limited claim starts with: the lean one unless the queue was last seen with
    /// limits per partition (the lean form refuses a queue that has them since).
    fn first_limited_form(&self) -> LimitedForm {
        let seen = self.inner.limits_seen.lock().expect("limits lock");
        if seen.partitioned {
            LimitedForm::Pick
        } else {
            LimitedForm::Lean
        }
    }

    /// A claim found limits per partition the handle had not seen: the full form from now on,
    /// until the limits are read again.
    fn saw_partitions(&self) {
        self.inner
            .limits_seen
            .lock()
            .expect("limits lock")
            .partitioned = true;
    }

    /// The claim of a queue with limits, while they leave ample room (`claim_ahead.sql`, which
    /// fails, undone, when its jobs would pass the limits); `None` while the handle claims under
    /// the lock ([`AheadState`]).
    async fn claim_ahead(&self, request: &ClaimRequest) -> Result<Option<Ahead>, PgError> {
        let inner = &self.inner;
        let now = std::time::Instant::now;
        let Some(margin) = inner.ahead.lock().expect("ahead lock").margin(now()) else {
            return Ok(None);
        };
        let mut conn = D::acquire(&inner.pool).await?;
        let queue = &inner.config.queue;
        let claim =
            statement::claim_ahead::<D>(D::pooled(&mut conn), &inner.sql, queue, request, margin)
                .await?;
        let ahead = if claim.over {
            Ahead::Over
        } else if claim.binding {
            Ahead::Binding
        } else {
            Ahead::Claimed(ClaimBatch { jobs: claim.jobs })
        };
        inner
            .ahead
            .lock()
            .expect("ahead lock")
            .came_to(&ahead, now());
        Ok(Some(ahead))
    }

    /// A claim of a queue with limits: first a claim ahead of the queue's row lock
    /// ([`Self::claim_ahead`]), which serves it while the limits leave ample room. Otherwise one
    /// statement that takes the queue's row lock and claims within the limits
    /// (`claim_limited.sql`), and a second one when its pick would put a partition over its
    /// limit (`claim_turns.sql`, for the rest of the batch). When another
    /// claim of the queue committed after a statement's snapshot (it waited for that claim's
    /// lock), its counts are stale and it claims nothing: then the lock first and the
    /// statements after it, in one transaction, so that the counts are read after the lock
    /// (and so the handle's next [`LOCK_FIRST_CLAIMS`] claims, at once). The same path when the
    /// claims made while the rate per partition could not bind must be folded into the
    /// partitions' logs first (`fold_starts.sql`, after the lock).
    async fn claim_limited(&self, request: &ClaimRequest) -> Result<ClaimBatch, PgError> {
        let inner = &self.inner;
        let queue = &inner.config.queue;
        let mut jobs = Vec::new();
        let mut form = self.first_limited_form();
        let mut contended = false;
        let ahead = if self.granting() {
            if let Some(batch) = self.claim_on_grant(request).await? {
                return Ok(batch);
            }
            // The queue refuses claims ahead while it grants room (they do not count it).
            None
        } else {
            self.claim_ahead(request).await?
        };
        match ahead {
            Some(Ahead::Claimed(batch)) => return Ok(batch),
            Some(Ahead::Binding) | None => {}
            // Claims committed while it ran: a statement alone would most likely find its
            // snapshot stale too.
            Some(Ahead::Over) => {
                queue_core::metrics::record_limited_claim_rerun(queue);
                contended = true;
            }
        }
        // The handle's claims came back stale or over of late: the lock first, in one
        // transaction.
        let mut lock_first = contended || self.lock_turns().take_lock_first();
        if !lock_first && self.checkable() {
            match self.claim_checked(request).await? {
                Checked::Claimed(batch) => return Ok(batch),
                Checked::Over => {
                    queue_core::metrics::record_limited_claim_rerun(queue);
                    self.lock_turns().came_back_stale();
                    lock_first = true;
                }
                Checked::NotCheckable => form = self.first_limited_form(),
            }
        }
        let fold = if lock_first {
            false
        } else {
            let mut conn = D::acquire(&inner.pool).await?;
            loop {
                let rest = rest_of(request, jobs.len());
                let claim = statement::claim_limited::<D>(
                    D::pooled(&mut conn),
                    &inner.sql,
                    queue,
                    &rest,
                    form,
                )
                .await?;
                jobs.extend(claim.jobs);
                if claim.stale {
                    queue_core::metrics::record_limited_claim_rerun(queue);
                    self.lock_turns().came_back_stale();
                }
                if claim.stale || claim.fold {
                    break claim.fold;
                }
                if claim.partitioned {
                    self.saw_partitions();
                    form = LimitedForm::Pick;
                    continue;
                }
                if !claim.turns || form == LimitedForm::Turns || jobs.len() >= batch(request) {
                    return Ok(ClaimBatch { jobs });
                }
                form = LimitedForm::Turns;
            }
        };
        let mut tx = D::begin(&inner.pool).await?;
        let (limits, room_grants) =
            statement::lock_queue::<D>(D::in_tx(&mut tx), &inner.sql, queue).await?;
        if form == LimitedForm::Lean && limits.partitioned() {
            // The lock's read of the limits shows what a lean claim would refuse.
            form = LimitedForm::Pick;
        }
        if fold {
            statement::fold_starts::<D>(D::in_tx(&mut tx), &inner.sql, queue).await?;
        }
        let mut folds = u32::from(fold);
        loop {
            let rest = rest_of(request, jobs.len());
            let claim =
                statement::claim_limited::<D>(D::in_tx(&mut tx), &inner.sql, queue, &rest, form)
                    .await?;
            jobs.extend(claim.jobs);
            if claim.partitioned {
                self.saw_partitions();
                form = LimitedForm::Pick;
                continue;
            }
            // A claim that came here stale may find it must fold first. Under the lock only
            // claims on grants, which take no lock, add rows to fold (claim_to_fold.sql asks
            // once 64 of them are there): a few folds at most, then claiming nothing is the
            // safe answer.
            if claim.fold && folds < MOST_FOLDS_UNDER_THE_LOCK {
                statement::fold_starts::<D>(D::in_tx(&mut tx), &inner.sql, queue).await?;
                folds += 1;
                continue;
            }
            if !claim.turns || form == LimitedForm::Turns || jobs.len() >= batch(request) {
                break;
            }
            form = LimitedForm::Turns;
        }
        D::commit(tx).await?;
        self.saw_limits(&limits, room_grants);
        Ok(ClaimBatch { jobs })
    }

    async fn claim_jobs(&self, request: &ClaimRequest) -> Result<ClaimBatch, PgError> {
        if self.limited().await? {
            return self.claim_limited(request).await;
        }
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let jobs = statement::claim::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            request,
        )
        .await?;
        Ok(ClaimBatch { jobs })
    }

    async fn finalize_pooled(
        &self,
        items: &[(Claim, Finalize)],
    ) -> Result<Vec<FinalizeOutcome>, PgError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = D::acquire(&self.inner.pool).await?;
        self.finalize_with(D::pooled(&mut conn), items).await
    }

    async fn cancel_target(
        &self,
        tx: &mut PostgresTx<D>,
        id: JobId,
    ) -> Result<CancelTarget, PgError> {
        let inner = &self.inner;
        let queue = &inner.config.queue;
        loop {
            let seen = statement::cancel::<D>(tx.conn(), &inner.sql, queue, id).await?;
            return Ok(match seen {
                None => CancelTarget::NotFound,
                Some((true, _, _)) => {
                    let row = statement::get_job::<D>(tx.conn(), &inner.sql, queue, id).await?;
                    let row = row.ok_or(PgError::UnknownStatus {
                        id: id.0,
                        status: "vanished within its own cancel".to_owned(),
                    })?;
                    CancelTarget::Cancelled(row.as_claimed())
                }
                Some((false, true, _)) => CancelTarget::Requested,
                // Claimed, released or requested between the statement's snapshot and its
                // updates: ask again.
                Some((false, false, JobStatus::Pending | JobStatus::InFlight)) => continue,
                Some((false, false, terminal)) => CancelTarget::AlreadyTerminal(terminal),
            });
        }
    }
}

impl<D: Driver> Backend for PostgresQueue<D> {
    type Tx = PostgresTx<D>;

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
        if statement::copies(&jobs) {
            // To its end on a task of its own, whatever the caller does: sqlx does not read the
            // end of a COPY dropped after its data went out, and hands the connection back
            // one answer behind the server (its next statements read each other's rows).
            let queue = self.clone();
            let copying = async move { queue.enqueue_copying(jobs).await };
            return tokio::spawn(copying.instrument(tracing::Span::current()))
                .await
                .map_err(|e| PgError::Task {
                    task: "bulk enqueue",
                    message: e.to_string(),
                })?;
        }
        Ok(self.enqueue_pooled(jobs).await?)
    }

    async fn enqueue_in(
        &self,
        tx: &mut PostgresTx<D>,
        job: NewJob,
    ) -> queue_core::Result<Enqueued> {
        let mut out = self.enqueue_with(tx.conn(), vec![job]).await?;
        Ok(out.remove(0))
    }

    async fn begin(&self) -> queue_core::Result<PostgresTx<D>> {
        Ok(PostgresTx {
            tx: D::begin(&self.inner.pool).await?,
        })
    }

    async fn claim(&self, request: ClaimRequest) -> queue_core::Result<ClaimBatch> {
        Ok(self.claim_jobs(&request).await?)
    }

    async fn finalize_in(
        &self,
        tx: &mut PostgresTx<D>,
        claim: Claim,
        action: &Finalize,
    ) -> queue_core::Result<FinalizeOutcome> {
        let item = [(claim, action.clone())];
        Ok(self.finalize_with(tx.conn(), &item).await?[0])
    }

    async fn finalize(
        &self,
        claim: Claim,
        action: &Finalize,
    ) -> queue_core::Result<FinalizeOutcome> {
        // A single statement commits on its own: no BEGIN/COMMIT round trips.
        Ok(self.finalize_pooled(&[(claim, action.clone())]).await?[0])
    }

    async fn finalize_many_in(
        &self,
        tx: &mut PostgresTx<D>,
        items: &[(Claim, Finalize)],
    ) -> queue_core::Result<Vec<FinalizeOutcome>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.finalize_with(tx.conn(), items).await?)
    }

    async fn finalize_many(
        &self,
        items: &[(Claim, Finalize)],
    ) -> queue_core::Result<Vec<FinalizeOutcome>> {
        Ok(self.finalize_pooled(items).await?)
    }

    async fn finalize_and_claim(
        &self,
        items: &[(Claim, Finalize)],
        request: ClaimRequest,
    ) -> queue_core::Result<(Vec<FinalizeOutcome>, ClaimBatch)> {
        if items.is_empty() {
            return Ok((Vec::new(), self.claim_jobs(&request).await?));
        }
        queue_core::limits::check_batch(items)?;
        if self.limited().await? {
            // A limited queue's claim takes its turn under the queue's lock: not fused.
            let written = self.finalize_pooled(items).await?;
            return Ok((written, self.claim_limited(&request).await?));
        }
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let (written, jobs) = statement::finalize_claim::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            items,
            &request,
        )
        .await?;
        Ok((written, ClaimBatch { jobs }))
    }

    fn fuses_claims(&self) -> bool {
        true
    }

    fn savepoints(&self) -> bool {
        true
    }

    async fn extend_lease(&self, claim: Claim, lease: Lease) -> queue_core::Result<Heartbeat> {
        let mut conn = D::acquire(&self.inner.pool).await?;
        let sql = &self.inner.sql;
        Ok(statement::extend_lease::<D>(D::pooled(&mut conn), sql, claim, lease).await?)
    }

    async fn extend_leases(
        &self,
        claims: &[Claim],
        lease: Lease,
    ) -> queue_core::Result<Vec<Option<Heartbeat>>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = D::acquire(&self.inner.pool).await?;
        let sql = &self.inner.sql;
        Ok(statement::extend_leases::<D>(D::pooled(&mut conn), sql, claims, lease).await?)
    }

    async fn cancel_in(
        &self,
        tx: &mut PostgresTx<D>,
        id: JobId,
    ) -> queue_core::Result<CancelTarget> {
        Ok(self.cancel_target(tx, id).await?)
    }

    async fn get(&self, id: JobId) -> queue_core::Result<Option<JobRecord>> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(
            statement::get_job::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue, id)
                .await?,
        )
    }

    async fn counts(&self) -> queue_core::Result<QueueCounts> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(statement::counts::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue).await?)
    }

    async fn stats(&self, window: std::time::Duration) -> queue_core::Result<QueueStats> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let queue = &inner.config.queue;
        Ok(statement::stats::<D>(D::pooled(&mut conn), &inner.sql, queue, window).await?)
    }

    fn wake_signal(&self) -> Option<Arc<Notify>> {
        self.inner.config.listen.then(|| self.inner.wake.clone())
    }

    async fn note_served(&self) -> queue_core::Result<()> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let params = (
            inner.config.queue.as_str(),
            inner.config.room_grants_for_new_queues,
        );
        D::execute(D::pooled(&mut conn), &inner.sql.note_served, &params).await?;
        Ok(())
    }

    async fn record_stale(&self, count: u64) -> queue_core::Result<()> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        statement::record_stale::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            count,
            inner.config.room_grants_for_new_queues,
        )
        .await?;
        Ok(())
    }
}

/// A transaction of the PostgreSQL backend: the finalize's fenced write and its hooks' writes
/// commit together. Dropping it without commit rolls back.
///
/// A hook writes through it with [`PostgresTx::execute`] and [`PostgresTx::query`] (the same
/// code for both drivers), or with its driver's own API: a `PgTx` dereferences to sqlx's
/// `PgConnection`, a `TokioPostgresTx` to deadpool-postgres' pooled client.
pub struct PostgresTx<D: Driver> {
    pub(crate) tx: D::Tx,
}

impl<D: Driver> std::fmt::Debug for PostgresTx<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTx")
            .field("driver", &std::any::type_name::<D>())
            .finish_non_exhaustive()
    }
}

impl<D: Driver> PostgresTx<D> {
    /// The transaction's connection, for [`PostgresQueue::enqueue_with`] and friends.
    pub fn conn(&mut self) -> D::Conn<'_> {
        D::in_tx(&mut self.tx)
    }

    /// Runs a statement of your own in the transaction; returns how many rows it changed.
    pub async fn execute<'p, P: Params<'p>>(
        &mut self,
        sql: &'static str,
        params: P,
    ) -> Result<u64, PgError> {
        D::execute(self.conn(), sql, &params).await
    }

    /// Runs a statement of your own in the transaction; returns its rows.
    pub async fn query<'p, P: Params<'p>>(
        &mut self,
        sql: &'static str,
        params: P,
    ) -> Result<Vec<Row<D>>, PgError> {
        let rows = D::query(self.conn(), sql, &params).await?;
        Ok(rows.into_iter().map(Row).collect())
    }
}

impl<D: Driver> BackendTx for PostgresTx<D> {
    async fn commit(self) -> queue_core::Result<()> {
        Ok(D::commit(self.tx).await?)
    }

    async fn rollback(self) -> queue_core::Result<()> {
        Ok(D::rollback(self.tx).await?)
    }

    async fn savepoint(&mut self) -> queue_core::Result<()> {
        Ok(D::batch_execute(D::in_tx(&mut self.tx), sql::SAVEPOINT.text).await?)
    }

    async fn rollback_to_savepoint(&mut self) -> queue_core::Result<()> {
        let text = sql::ROLLBACK_TO_SAVEPOINT.text;
        Ok(D::batch_execute(D::in_tx(&mut self.tx), text).await?)
    }
}

/// A row of a statement run through [`PostgresQueue::query`] or [`PostgresTx::query`].
pub struct Row<D: Driver>(D::Row);

impl<D: Driver> Row<D> {
    /// Reads `column` (by name) as `T`.
    pub fn get<T: Column>(&self, column: &str) -> Result<T, PgError> {
        D::get(&self.0, column)
    }
}

impl<D: Driver> std::fmt::Debug for Row<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Row").finish_non_exhaustive()
    }
}

impl<D: Driver> queue_core::Admin for PostgresQueue<D> {
    async fn list_jobs(&self, filter: &JobFilter) -> queue_core::Result<JobPage> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let rows = statement::list_jobs::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            filter,
        )
        .await?;
        Ok(JobPage::from_rows(rows, filter.limit))
    }

    async fn find_by_unique_key(&self, key: &str) -> queue_core::Result<Option<JobRecord>> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(
            statement::find_unique::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue, key)
                .await?,
        )
    }

    async fn retry_in(
        &self,
        tx: &mut PostgresTx<D>,
        id: JobId,
        seen: JobStatus,
    ) -> queue_core::Result<RetryTarget> {
        let inner = &self.inner;
        let queue = &inner.config.queue;
        let mut target = statement::retry::<D>(tx.conn(), &inner.sql, queue, id, seen).await?;
        // The statement's fallback read uses the snapshot it started with: after waiting for
        // a concurrent change of the row (another retry, a purge), it can report the status
        // the row had before. Read again, in a new statement, until the answer is current.
        for _ in 0..3 {
            match target {
                RetryTarget::WrongState(status) if status == seen => {
                    target = statement::retry::<D>(tx.conn(), &inner.sql, queue, id, seen).await?;
                }
                _ => break,
            }
        }
        if matches!(target, RetryTarget::Retried(_)) {
            // Idle workers hear of it when the transaction commits.
            self.notify_in(tx.conn()).await?;
        }
        Ok(target)
    }

    async fn purge_batch(&self, request: &PurgeRequest) -> queue_core::Result<u64> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let deleted = statement::purge::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            request,
        )
        .await?;
        queue_core::events::jobs_purged(&inner.config.queue, deleted);
        Ok(deleted)
    }

    async fn pause(&self) -> queue_core::Result<QueueControl> {
        self.set_paused(true).await
    }

    async fn resume(&self) -> queue_core::Result<QueueControl> {
        self.set_paused(false).await
    }

    async fn control(&self) -> queue_core::Result<QueueControl> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(statement::control::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue).await?)
    }

    async fn record_schedules(
        &self,
        seen_by: &str,
        reports: &[queue_core::ScheduleReport],
    ) -> queue_core::Result<()> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let queue = &inner.config.queue;
        Ok(statement::record_schedules::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            queue,
            seen_by,
            reports,
        )
        .await?)
    }

    async fn schedules(&self) -> queue_core::Result<Vec<queue_core::ScheduleInfo>> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(
            statement::schedules::<D>(D::pooled(&mut conn), &inner.sql, &inner.config.queue)
                .await?,
        )
    }

    async fn forget_schedule(&self, name: &str) -> queue_core::Result<bool> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        let queue = &inner.config.queue;
        Ok(statement::forget_schedule::<D>(D::pooled(&mut conn), &inner.sql, queue, name).await?)
    }

    async fn set_limits(&self, limits: QueueLimits) -> queue_core::Result<QueueControl> {
        limits.check()?;
        let inner = &self.inner;
        let queue = &inner.config.queue;
        // The queue's row lock first, so that the statement's snapshot comes after every claim
        // that held it: the partitions' logs it deletes with a rate per partition include the
        // last claim's.
        let mut tx = D::begin(&inner.pool).await?;
        statement::lock_queue::<D>(D::in_tx(&mut tx), &inner.sql, queue).await?;
        let control = statement::set_limits::<D>(
            D::in_tx(&mut tx),
            &inner.sql,
            queue,
            &limits,
            inner.config.room_grants_for_new_queues,
        )
        .await?;
        D::commit(tx).await?;
        self.saw_limits(&control.limits, control.room_grants);
        queue_core::events::queue_limits_set(queue, &limits);
        Ok(control)
    }

    async fn queues(&self) -> queue_core::Result<Vec<QueueName>> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(statement::queues::<D>(D::pooled(&mut conn), &inner.sql).await?)
    }

    /// A handle on another queue of the same table, sharing the pool and the statements; it
    /// keeps no `LISTEN` connection (its workers poll, or use a handle of their own), so it
    /// suits admin tools that visit every queue of a table.
    fn for_queue(&self, queue: QueueName) -> Self {
        let inner = &self.inner;
        PostgresQueue {
            inner: Arc::new(Inner {
                pool: inner.pool.clone(),
                config: PgQueueConfig {
                    queue,
                    listen: false,
                    ..inner.config.clone()
                },
                sql: inner.sql.clone(),
                quoted_table: inner.quoted_table.clone(),
                channel: inner.channel.clone(),
                wake: Arc::new(Notify::new()),
                limits_seen: Default::default(),
                ahead: Default::default(),
                grants: Default::default(),
                lock_turns: Default::default(),
                _listener: None,
            }),
        }
    }

    async fn throughput(&self, minutes: u32) -> queue_core::Result<Vec<MinuteCounts>> {
        let inner = &self.inner;
        let mut conn = D::acquire(&inner.pool).await?;
        Ok(statement::throughput::<D>(
            D::pooled(&mut conn),
            &inner.sql,
            &inner.config.queue,
            minutes,
        )
        .await?)
    }

    async fn settle_claims(&self) -> queue_core::Result<()> {
        // Claims are single statements of milliseconds; one that runs for longer than this is
        // stuck on something else, and the drain's own deadline takes over.
        const LONGEST_WAIT: Duration = Duration::from_secs(10);
        let mut conn = D::acquire(&self.inner.pool).await?;
        let since = statement::clock::<D>(D::pooled(&mut conn)).await?;
        let started = tokio::time::Instant::now();
        while statement::claims_running::<D>(D::pooled(&mut conn), since).await? > 0
            && started.elapsed() < LONGEST_WAIT
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }
}

impl<D: Driver> PostgresQueue<D> {
    /// Pauses or resumes the queue in one transaction; a resume wakes the idle workers of
    /// every process (`NOTIFY` on commit).
    async fn set_paused(&self, paused: bool) -> queue_core::Result<QueueControl> {
        let inner = &self.inner;
        let mut tx = D::begin(&inner.pool).await?;
        let control = statement::pause::<D>(
            D::in_tx(&mut tx),
            &inner.sql,
            &inner.config.queue,
            paused,
            inner.config.room_grants_for_new_queues,
        )
        .await?;
        if !paused {
            statement::notify::<D>(
                D::in_tx(&mut tx),
                &inner.sql,
                &inner.channel,
                &inner.config.queue,
            )
            .await?;
        }
        D::commit(tx).await?;
        queue_core::events::queue_paused(&inner.config.queue, paused);
        Ok(control)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim by the statement alone that came back stale sends the handle's next
    /// [`LOCK_FIRST_CLAIMS`] claims to the lock first, then the statement alone is tried again.
    #[test]
    fn a_stale_claim_sends_the_next_claims_to_the_lock_first() {
        let mut turns = LockTurns::default();
        assert!(
            !turns.take_lock_first(),
            "a claimer alone: the statement alone"
        );
        turns.came_back_stale();
        for _ in 0..LOCK_FIRST_CLAIMS {
            assert!(turns.take_lock_first());
        }
        assert!(!turns.take_lock_first(), "then the statement alone again");
        turns.came_back_stale();
        assert!(turns.take_lock_first(), "stale again: the lock first again");
    }

    /// A failed claim ahead doubles the margin (once per pause) and sends the claims under the
    /// lock for a while; claims ahead that take jobs and fit narrow it by one for every
    /// [`AHEAD_MARGIN_EASE`], a queue found short of room by half, never below the least nor
    /// above the most; claims that find nothing due leave it as it is.
    #[test]
    fn the_claims_ahead_widen_their_margin_when_one_fails_and_narrow_it_again() {
        let start = std::time::Instant::now();
        let job = queue_core::ClaimedJob {
            id: JobId(1),
            generation: queue_core::ClaimGeneration(1),
            token: queue_core::ClaimToken(1),
            attempts: 1,
            reclaims: 0,
            taken_over: false,
            over_reclaim_cap: false,
            cancel_requested: false,
            claimed_at: chrono::Utc::now(),
            due_at: chrono::Utc::now(),
            priority: 0,
            payload: serde_json::Value::Null,
        };
        let claimed = || {
            Ahead::Claimed(ClaimBatch {
                jobs: vec![job.clone()],
            })
        };
        let idle = || Ahead::Claimed(ClaimBatch { jobs: Vec::new() });
        let mut state = AheadState::default();
        assert_eq!(state.margin(start), Some(sql::AHEAD_MARGIN_LEAST));
        state.came_to(&claimed(), start);
        state.came_to(&Ahead::Over, start);
        state.came_to(&Ahead::Over, start);
        assert_eq!(state.margin(start), None, "under the lock for a while");
        let later = start + AHEAD_PAUSE;
        assert_eq!(
            state.margin(later),
            Some(8),
            "two failures at once widen it once"
        );
        for _ in 0..AHEAD_MARGIN_EASE - 1 {
            state.came_to(&claimed(), later);
            state.came_to(&idle(), later);
        }
        assert_eq!(
            state.margin(later),
            Some(8),
            "the failure reset the count of fits"
        );
        state.came_to(&claimed(), later);
        assert_eq!(state.margin(later), Some(7));
        let mut at = later;
        for _ in 0..10 {
            at += AHEAD_PAUSE;
            state.came_to(&Ahead::Over, at);
        }
        let latest = at + AHEAD_PAUSE;
        assert_eq!(state.margin(latest), Some(sql::AHEAD_MARGIN_MOST));
        state.came_to(&Ahead::Binding, latest);
        assert_eq!(state.margin(latest), None);
        assert_eq!(
            state.margin(latest + AHEAD_PAUSE),
            Some(sql::AHEAD_MARGIN_MOST / 2),
            "short of room: halved"
        );
        for _ in 0..AHEAD_MARGIN_EASE * sql::AHEAD_MARGIN_MOST {
            state.came_to(&claimed(), latest);
        }
        assert_eq!(
            state.margin(latest + AHEAD_PAUSE),
            Some(sql::AHEAD_MARGIN_LEAST)
        );
        for _ in 0..4 {
            state.came_to(&Ahead::Binding, latest);
        }
        assert_eq!(
            state.margin(latest + AHEAD_PAUSE),
            Some(sql::AHEAD_MARGIN_LEAST)
        );
    }
}
