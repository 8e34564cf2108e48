//! The queue on a SQLite file: [`SqliteQueue`], its transaction, and every statement.
//!
//! SQLite has one writer at a time. Every write that must see what it changes (a claim, a
//! batch of outcomes, a cancel, a retry) runs in a `BEGIN IMMEDIATE` transaction, which takes
//! the write lock first: no two claims can pick the same job, and no `SKIP LOCKED` is needed.
//! Other processes wait for the lock up to the busy timeout. Instants are SQLite's own clock,
//! `unixepoch('subsec')`, in every statement; the worker's clock never reaches the table.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use queue_core::partition::PartitionWalk;
use queue_core::{
    Backend, BackendTx, CANCELLED_BY_OPERATOR, CancelTarget, Claim, ClaimBatch, ClaimGeneration,
    ClaimRequest, ClaimRoom, ClaimToken, ClaimedJob, Enqueued, ErrorEntry, Finalize,
    FinalizeOutcome, FinishedCounts, Heartbeat, JobFilter, JobId, JobPage, JobRecord, JobStatus,
    Lease, MinuteCounts, NewJob, PurgeRequest, QueueControl, QueueCounts, QueueLimits, QueueName,
    QueueStats, RetryTarget, RunAt,
};
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row as _, Sqlite, SqlitePool};
use tokio::sync::Notify;
use tracing::Instrument;

use crate::error::SqliteError;
use crate::schema::{self, COLUMNS, TableName};

/// How a [`SqliteQueue`] handle works.
#[derive(Debug, Clone)]
pub struct SqliteQueueConfig {
    /// The queue table (default `queue_jobs`, created by [`crate::migrate`]).
    pub table: TableName,
    /// The queue inside the table (default `default`).
    pub queue: QueueName,
    /// The largest payload an enqueue accepts, as JSON text (default 1 MiB).
    pub max_payload_bytes: usize,
}

impl Default for SqliteQueueConfig {
    fn default() -> Self {
        SqliteQueueConfig {
            table: TableName::default(),
            queue: QueueName::default(),
            max_payload_bytes: queue_core::limits::DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl SqliteQueueConfig {
    /// The largest `max_payload_bytes`: SQLite's default limit on a value (`SQLITE_MAX_LENGTH`).
    pub const MAX_PAYLOAD_BYTES: usize = 1_000_000_000;

    /// The queue `queue` of the table `table`.
    pub fn new(table: TableName, queue: QueueName) -> Self {
        SqliteQueueConfig {
            table,
            queue,
            ..SqliteQueueConfig::default()
        }
    }
}

/// How a database file is opened ([`open_pool`]).
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Open for reading only (an inspection tool, a read-only dashboard): every write is
    /// refused with [`SqliteError::Open`] and [`OpenFailure::ReadOnly`](crate::OpenFailure).
    pub read_only: bool,
    /// How long a writer waits for another's lock before [`SqliteError::Busy`] (default 5 s; at
    /// most a day).
    pub busy_timeout: Duration,
    /// Connections of the pool (default 4; SQLite writes one at a time whatever the number).
    pub max_connections: u32,
    /// Create the file if it does not exist (default true; its directory must exist).
    pub create_if_missing: bool,
    /// `synchronous = FULL` (default): a committed outcome survives a power loss. `false`
    /// keeps `NORMAL`, which survives a process crash but may lose the last commits on power
    /// loss.
    pub full_sync: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            busy_timeout: Duration::from_secs(5),
            max_connections: 4,
            create_if_missing: true,
            full_sync: true,
        }
    }
}

impl OpenOptions {
    /// The longest busy timeout accepted: beyond it a locked file looks like a hung process.
    pub const MAX_BUSY_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

    fn validate(&self) -> Result<(), SqliteError> {
        if self.busy_timeout > Self::MAX_BUSY_TIMEOUT {
            return Err(SqliteError::InvalidOption {
                name: "busy_timeout",
                reason: format!("{:?} is over a day", self.busy_timeout),
            });
        }
        if self.max_connections == 0 {
            return Err(SqliteError::InvalidOption {
                name: "max_connections",
                reason: "a pool needs at least one connection".to_owned(),
            });
        }
        Ok(())
    }
}

/// A pool on the database file at `path`, in WAL mode with the busy timeout, so that several
/// processes can share the file. Refused here, with [`SqliteError::Open`]: a missing
/// directory, a directory or file that cannot be written (unless `read_only`), a file that is
/// not a database. Out-of-range options are [`SqliteError::InvalidOption`].
pub async fn open_pool(
    path: impl AsRef<Path>,
    options: &OpenOptions,
) -> Result<SqlitePool, SqliteError> {
    options.validate()?;
    let path = path.as_ref();
    let shown = path.display().to_string();
    let connect = SqliteConnectOptions::from_str("sqlite:")
        .map_err(|e| SqliteError::from_sqlx(e, &shown))?
        .filename(path)
        .create_if_missing(options.create_if_missing && !options.read_only)
        .read_only(options.read_only);
    // A read-only connection cannot switch the journal mode; the file keeps the one its
    // writers gave it.
    let connect = if options.read_only {
        connect
    } else {
        connect.journal_mode(SqliteJournalMode::Wal)
    };
    let connect = connect
        .synchronous(if options.full_sync {
            SqliteSynchronous::Full
        } else {
            SqliteSynchronous::Normal
        })
        .busy_timeout(options.busy_timeout)
        .foreign_keys(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(options.max_connections)
        .min_connections(1)
        .connect_with(connect)
        .await
        .map_err(|e| SqliteError::from_sqlx(e, &shown))?;
    // A file that opens but cannot be read as a database, or written, says so now rather than
    // at the first claim.
    sqlx::query("SELECT count(*) FROM sqlite_master")
        .execute(&pool)
        .await
        .map_err(|e| SqliteError::from_sqlx(e, &shown))?;
    if !options.read_only {
        write_probe(&pool, &shown).await?;
    }
    Ok(pool)
}

/// Writes to the file and rolls the write back: SQLite opens a file it may not write (its
/// permissions, an immutable file, a read-only mount) for reading without a word, and only a
/// write finds that out.
async fn write_probe(pool: &SqlitePool, path: &str) -> Result<(), SqliteError> {
    let err = |e| SqliteError::from_sqlx(e, path);
    let mut tx = SqliteTx::begin(pool, path).await?;
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(tx.conn())
        .await
        .map_err(err)?;
    let written = sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA user_version = {version}")))
        .execute(tx.conn())
        .await;
    // Whatever a failed ROLLBACK leaves open ends with the connection (the guard's drop).
    tx.rollback_now().await;
    written.map_err(err)?;
    Ok(())
}

/// A queue in a SQLite table. Cloning is cheap and shares everything.
#[derive(Clone)]
pub struct SqliteQueue {
    inner: Arc<Inner>,
}

struct Inner {
    pool: SqlitePool,
    config: SqliteQueueConfig,
    /// The database's file name, for errors.
    path: String,
    sql: Arc<Sql>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for SqliteQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteQueue")
            .field("table", &self.inner.config.table)
            .field("queue", &self.inner.config.queue)
            .finish_non_exhaustive()
    }
}

/// Every statement, rendered for one table.
struct Sql {
    insert: String,
    holder: String,
    release_unique: String,
    replace_unique: String,
    pick: String,
    claim: String,
    fence_read: String,
    finalize: String,
    extend: String,
    get: String,
    status_of: String,
    cancel_pending: String,
    request_cancel: String,
    counts: String,
    stats: String,
    finished_hour: String,
    list: String,
    find_unique: String,
    retry: String,
    purge: String,
    pause: String,
    control: String,
    set_limits: String,
    /// Deletes a queue's logs of claims per partition: its rate per partition was removed (a
    /// rate set later counts from then on).
    forget_partition_starts: String,
    quota: String,
    /// The partitions' statements (see `queue_core::partition`).
    partitions: PartitionSql,
    record_schedule: String,
    schedules: String,
    forget_schedule: String,
    log_starts: String,
    queues: String,
    throughput: String,
    record_stale: String,
    note_served: String,
}

/// The statements of a claim of a queue with a limit per partition, each a bounded read of an
/// index: the in-flight jobs per partition; a probe for the first partition key in a range
/// (`[lower][upper]`: with a key strictly below it, with a key it must not pass) with the key's
/// starts within its rate's window; a partition's earliest due jobs; the due jobs without a
/// partition among the queue's earliest; the cursor; and, for a rate per partition, the starts
/// of a list of keys, the log of a claim's starts and the pruning of partitions whose last
/// claim left the window.
struct PartitionSql {
    earliest: String,
    held: String,
    probe: [[String; 2]; 2],
    offers: String,
    loose: String,
    set_cursor: String,
    started: String,
    log_starts: String,
    prune_starts: String,
}

/// The starts of the partition `key` (an SQL expression; of the queue ?1) within the window of
/// `per_ms` milliseconds, by the clock `now`: its row's log in `<table>_starts`, read by primary
/// key. A NULL window (no rate per partition) counts none.
fn started_of(table: &TableName, now: &str, key: &str, per_ms: &str) -> String {
    format!(
        "(SELECT coalesce(sum(json_extract(e.value, '$[1]')), 0)
          FROM \"{table}_starts\" AS ps, json_each(ps.rate_log) AS e
          WHERE ps.queue = ?1 AND ps.partition_key = {key}
            AND json_extract(e.value, '$[0]') > {now} * 1000 - {per_ms})"
    )
}

impl PartitionSql {
    fn new(table: &TableName, t: &str, q: &str, now: &str) -> Self {
        let s = format!("\"{table}_starts\"");
        let started_of = |key: &str, per_ms: &str| started_of(table, now, key, per_ms);
        let probe = |lower: bool, upper: bool| {
            // The started column is computed for the one row the probe returns.
            format!(
                "SELECT partition_key, next_attempt_at <= {now} AS due,
                        {} AS started
                 FROM {t} INDEXED BY \"{table}_partition_idx\"
                 WHERE queue = ?1 AND status = 'pending' AND partition_key IS NOT NULL
                   {} {}
                 ORDER BY partition_key, next_attempt_at LIMIT 1",
                started_of(&format!("{t}.partition_key"), "?4"),
                if lower { "AND partition_key > ?2" } else { "" },
                if upper { "AND partition_key <= ?3" } else { "" },
            )
        };
        PartitionSql {
            // The partitions of the earliest due jobs: what a claim would take without them.
            earliest: format!(
                "SELECT partition_key FROM {t} INDEXED BY \"{table}_due_idx\"
                 WHERE queue = ?1 AND status = 'pending' AND next_attempt_at <= {now}
                 ORDER BY next_attempt_at, priority, id LIMIT ?2"
            ),
            held: format!(
                "SELECT partition_key, count(*) AS n FROM {t} INDEXED BY \"{table}_expiry_idx\"
                 WHERE queue = ?1 AND status = 'in_flight' AND partition_key IS NOT NULL
                 GROUP BY partition_key"
            ),
            probe: [
                [probe(false, false), probe(false, true)],
                [probe(true, false), probe(true, true)],
            ],
            offers: format!(
                "SELECT id, next_attempt_at, priority, reclaims, partition_key,
                        cancel_requested_at IS NOT NULL AS cancel_requested
                 FROM {t} INDEXED BY \"{table}_partition_idx\"
                 WHERE queue = ?1 AND status = 'pending' AND partition_key = ?2
                   AND next_attempt_at <= {now}
                 ORDER BY next_attempt_at, priority, id LIMIT ?3"
            ),
            loose: format!(
                "SELECT id, next_attempt_at, priority, reclaims, partition_key, cancel_requested FROM (
                     SELECT id, next_attempt_at, priority, reclaims, partition_key,
                            cancel_requested_at IS NOT NULL AS cancel_requested
                     FROM {t} INDEXED BY \"{table}_due_idx\"
                     WHERE queue = ?1 AND status = 'pending' AND next_attempt_at <= {now}
                     ORDER BY next_attempt_at, priority, id LIMIT ?3)
                 WHERE partition_key IS NULL
                 ORDER BY next_attempt_at, priority, id LIMIT ?2"
            ),
            set_cursor: format!(
                "UPDATE {q} SET partition_cursor = ?2 WHERE queue = ?1
                   AND partition_cursor IS NOT ?2"
            ),
            // ?2 the keys (a JSON array of distinct keys), ?3 the window in milliseconds.
            started: format!(
                "SELECT k.value AS partition_key, {} AS started FROM json_each(?2) AS k",
                started_of("k.value", "?3")
            ),
            // A claim's starts: ?2 a JSON array of [key, jobs] pairs, ?3 the window in
            // milliseconds. Each key's log keeps the window's claims and this one. (The WHERE
            // of the SELECT tells SQLite's parser the ON CONFLICT is the upsert's.)
            log_starts: format!(
                "INSERT INTO {s} AS ps (queue, partition_key, rate_log, last_at)
                 SELECT ?1, k.value ->> '$[0]',
                        json_array(json_array(round({now} * 1000), k.value ->> '$[1]')), {now}
                 FROM json_each(?2) AS k WHERE true
                 ON CONFLICT (queue, partition_key) DO UPDATE
                 SET rate_log = json_insert(
                         (SELECT json_group_array(json(e.value)) FROM json_each(ps.rate_log) AS e
                          WHERE json_extract(e.value, '$[0]') > {now} * 1000 - ?3),
                         '$[#]', excluded.rate_log -> '$[0]'),
                     last_at = excluded.last_at"
            ),
            // At most ?3 rows of partitions whose last claim is older than the window of ?2
            // milliseconds (a millisecond's margin: the log's instants are rounded to one), the
            // oldest first, a range of the index: what keeps the table to about the partitions
            // claimed within one window, at a bounded cost per claim.
            prune_starts: format!(
                "DELETE FROM {s} WHERE rowid IN (
                     SELECT rowid FROM {s} INDEXED BY \"{table}_starts_idx\"
                     WHERE queue = ?1 AND last_at < {now} - ?2 / 1000.0 - 0.001
                     ORDER BY last_at LIMIT ?3)"
            ),
        }
    }
}

/// How many rows of partitions whose last claim left the window of the queue's rate per
/// partition a claim deletes at most, or as many as it claimed jobs if more: a claim adds at
/// most a row per job, so the pruning keeps up, and no claim pays for a large backlog at once.
const PRUNED_PER_CLAIM: i64 = 100;

/// A job a claim may take: its place in claim order, its partition (for the limits per
/// partition), and what the claim reports of it.
#[derive(Debug, Clone)]
struct Pick {
    due: f64,
    priority: i64,
    id: i64,
    reclaims: i64,
    expired: bool,
    cancel_requested: bool,
    partition_key: Option<String>,
}

impl Pick {
    /// The pick in `row`, whose claim order is in the columns `due` and `priority`.
    fn of(row: &SqliteRow, expired: bool, due: &str, priority: &str) -> Result<Self, SqliteError> {
        let db = SqliteError::Database;
        Ok(Pick {
            due: row.try_get(due).map_err(db)?,
            priority: row.try_get(priority).map_err(db)?,
            id: row.try_get("id").map_err(db)?,
            reclaims: row.try_get("reclaims").map_err(db)?,
            expired,
            cancel_requested: row.try_get("cancel_requested").map_err(db)?,
            partition_key: row.try_get("partition_key").map_err(db)?,
        })
    }

    /// Claim order: due time, priority, id.
    fn cmp(a: &Pick, b: &Pick) -> std::cmp::Ordering {
        a.due
            .total_cmp(&b.due)
            .then(a.priority.cmp(&b.priority))
            .then(a.id.cmp(&b.id))
    }
}

fn select_columns() -> String {
    COLUMNS.map(|(name, _)| name).join(", ")
}

impl Sql {
    fn new(table: &TableName) -> Self {
        let t = format!("\"{table}\"");
        let q = format!("\"{table}_queues\"");
        let cols = select_columns();
        let now = "unixepoch('subsec')";
        // Qualified: inside the read of the log, a bare partition_key is the log's.
        let within_starts = format!(
            "(?4 IS NULL OR {t}.partition_key IS NULL OR {} < ?4)",
            started_of(table, now, &format!("{t}.partition_key"), "?5")
        );
        Sql {
            insert: format!(
                "INSERT INTO {t} (queue, payload, priority, next_attempt_at, unique_key, partition_key,
                                 created_at, updated_at)
                 VALUES (?1, ?2, ?3, CASE WHEN ?4 IS NOT NULL THEN ?4 ELSE {now} + coalesce(?5, 0) END,
                         ?6, ?7, {now}, {now})
                 ON CONFLICT (queue, unique_key) WHERE unique_key IS NOT NULL DO NOTHING
                 RETURNING id"
            ),
            holder: format!("SELECT id FROM {t} WHERE queue = ?1 AND unique_key = ?2"),
            // A holder out of the new job's scope (?3: the statuses it keeps the key in, a JSON
            // array, NULL for all; ?4: seconds after its enqueue it keeps it, NULL for ever)
            // gives the key up, keeping its row.
            release_unique: format!(
                "UPDATE {t} SET unique_key = NULL
                 WHERE queue = ?1 AND unique_key = ?2
                   AND ((?3 IS NOT NULL AND status NOT IN (SELECT value FROM json_each(?3)))
                        OR (?4 IS NOT NULL AND created_at <= {now} - ?4))"
            ),
            // A pending holder takes a replacing duplicate's payload, priority and due time.
            replace_unique: format!(
                "UPDATE {t} SET payload = ?3, priority = ?4,
                        next_attempt_at = CASE WHEN ?5 IS NOT NULL THEN ?5 ELSE {now} + coalesce(?6, 0) END,
                        updated_at = {now}
                 WHERE queue = ?1 AND unique_key = ?2 AND status = 'pending'
                 RETURNING id"
            ),
            // The three picks, each an ordered scan of a bounded range of its partial index that
            // stops after the batch (due rows; in-flight rows without a stored lease; in-flight
            // rows whose lease has passed), merged in claim order. A paused queue gives nothing.
            // With a rate per partition (?4 its starts, ?5 its window in milliseconds), a
            // partition with no start left has no takeover: they would fill the batch only to be
            // dropped by the claim's count of each partition's starts.
            pick: format!(
                "SELECT id, reclaims, expired, cancel_requested, partition_key,
                        next_attempt_at + 0 AS pick_due, priority + 0 AS pick_priority FROM (
                     SELECT id, next_attempt_at, priority, reclaims, partition_key, 0 AS expired,
                            cancel_requested_at IS NOT NULL AS cancel_requested
                     FROM (SELECT * FROM {t} INDEXED BY \"{table}_due_idx\"
                           WHERE queue = ?1 AND status = 'pending' AND next_attempt_at <= {now}
                           ORDER BY next_attempt_at, priority, id LIMIT ?3)
                     UNION ALL
                     SELECT id, next_attempt_at, priority, reclaims, partition_key, 1 AS expired,
                            cancel_requested_at IS NOT NULL AS cancel_requested
                     FROM (SELECT * FROM {t} INDEXED BY \"{table}_expiry_idx\"
                           WHERE queue = ?1 AND status = 'in_flight' AND lease_expires_at IS NULL
                             AND {within_starts}
                           LIMIT ?2)
                     UNION ALL
                     SELECT id, next_attempt_at, priority, reclaims, partition_key, 1 AS expired,
                            cancel_requested_at IS NOT NULL AS cancel_requested
                     FROM (SELECT * FROM {t} INDEXED BY \"{table}_expiry_idx\"
                           WHERE queue = ?1 AND status = 'in_flight' AND lease_expires_at < {now}
                             AND {within_starts}
                           ORDER BY lease_expires_at LIMIT ?2)
                 )
                 WHERE NOT EXISTS (SELECT 1 FROM {q} WHERE queue = ?1 AND paused_at IS NOT NULL)
                 ORDER BY next_attempt_at, priority, id LIMIT ?2"
            ),
            claim: format!(
                "UPDATE {t} SET status = 'in_flight', attempts = attempts + 1,
                        reclaims = reclaims + (id IN (SELECT value FROM json_each(?2))),
                        claimed_at = {now}, claimed_by = ?3, lease_expires_at = {now} + ?4,
                        claim_generation = claim_generation + 1, claim_token = ?5,
                        updated_at = {now}
                 WHERE id IN (SELECT value FROM json_each(?1))
                 RETURNING id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at,
                           priority, payload"
            ),
            fence_read: format!(
                "SELECT attempts, claim_generation, claim_token, claimed_by, errors, status,
                        {now} AS now
                 FROM {t} WHERE id = ?1"
            ),
            finalize: format!(
                "UPDATE {t} SET status = ?3, attempts = attempts - ?4,
                        next_attempt_at = CASE WHEN ?5 IS NOT NULL THEN ?5
                                               WHEN ?6 IS NOT NULL THEN {now} + ?6
                                               ELSE next_attempt_at END,
                        last_error = coalesce(?7, last_error), errors = coalesce(?8, errors),
                        lease_expires_at = NULL, updated_at = {now},
                        finished_at = CASE WHEN ?9 THEN {now} END
                 WHERE id = ?1 AND status = 'in_flight' AND claim_generation = ?2
                   AND claim_token = ?10"
            ),
            extend: format!(
                "UPDATE {t} SET claimed_at = {now}, lease_expires_at = {now} + ?3, updated_at = {now}
                 WHERE id = ?1 AND status = 'in_flight' AND claim_generation = ?2
                   AND claim_token = ?4
                 RETURNING cancel_requested_at IS NOT NULL AS cancel_requested"
            ),
            get: format!("SELECT {cols} FROM {t} WHERE id = ?1 AND queue = ?2"),
            status_of: format!("SELECT status FROM {t} WHERE id = ?1 AND queue = ?2"),
            cancel_pending: format!(
                "UPDATE {t} SET status = 'cancelled', last_error = ?3, updated_at = {now},
                        finished_at = {now}, lease_expires_at = NULL
                 WHERE id = ?1 AND queue = ?2 AND status = 'pending'
                 RETURNING {cols}"
            ),
            request_cancel: format!(
                "UPDATE {t} SET cancel_requested_at = coalesce(cancel_requested_at, {now}),
                        updated_at = {now}
                 WHERE id = ?1 AND queue = ?2 AND status = 'in_flight'"
            ),
            counts: format!(
                "SELECT status, count(*) AS jobs FROM {t} WHERE queue = ?1 GROUP BY status"
            ),
            stats: format!(
                "SELECT
                   (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE queue = ?1 AND status = 'pending'
                                           AND next_attempt_at <= {now} LIMIT ?2)) AS due,
                   (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE queue = ?1 AND status = 'pending'
                                           AND next_attempt_at > {now} LIMIT ?2)) AS scheduled,
                   (SELECT count(*) FROM {t} WHERE queue = ?1 AND status = 'in_flight') AS in_flight,
                   (SELECT count(*) FROM {t} WHERE queue = ?1 AND status = 'in_flight'
                      AND (lease_expires_at IS NULL OR lease_expires_at < {now})) AS expired,
                   (SELECT count(*) FROM {t} WHERE queue = ?1 AND status = 'in_flight'
                      AND lease_expires_at >= {now} AND lease_expires_at < {now} + ?3) AS expiring,
                   (SELECT {now} - min(next_attempt_at) FROM {t} WHERE queue = ?1
                      AND status = 'pending' AND next_attempt_at <= {now}) AS oldest_wait"
            ),
            finished_hour: format!(
                "SELECT status, count(*) AS jobs FROM {t}
                 WHERE finished_at IS NOT NULL AND finished_at > {now} - 3600 AND queue = ?1
                 GROUP BY status"
            ),
            list: format!(
                "SELECT {cols} FROM {t}
                 WHERE queue = ?1 {{statuses}} AND id < coalesce(?2, 9223372036854775807)
                 ORDER BY id DESC LIMIT ?3"
            ),
            find_unique: format!("SELECT {cols} FROM {t} WHERE queue = ?1 AND unique_key = ?2"),
            retry: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, reclaims = 0,
                        next_attempt_at = {now}, claimed_at = NULL, lease_expires_at = NULL,
                        cancel_requested_at = NULL, finished_at = NULL, updated_at = {now}
                 WHERE id = ?1 AND queue = ?2 AND status = ?3
                 RETURNING {cols}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE id IN (
                     SELECT id FROM {t} INDEXED BY \"{table}_finished_idx\"
                     WHERE finished_at IS NOT NULL AND finished_at < {now} - ?3 AND queue = ?1
                       AND status IN (SELECT value FROM json_each(?2))
                     ORDER BY finished_at LIMIT ?4)"
            ),
            pause: format!(
                "INSERT INTO {q} (queue, paused_at, updated_at)
                 VALUES (?1, CASE WHEN ?2 THEN {now} END, {now})
                 ON CONFLICT (queue) DO UPDATE
                 SET paused_at = CASE WHEN ?2 THEN coalesce(paused_at, {now}) END, updated_at = {now}
                 RETURNING paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms,
                           max_per_partition, partition_rate_starts, partition_rate_per_ms"
            ),
            control: format!(
                "SELECT paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms,
                        max_per_partition, partition_rate_starts, partition_rate_per_ms
                 FROM {q} WHERE queue = ?1"
            ),
            partitions: PartitionSql::new(table, &t, &q, now),
            // One schedule of a scheduler's report; the latest period handled never goes back.
            record_schedule: format!(
                "INSERT INTO \"{table}_schedules\" AS s
                     (queue, name, spec, missed, through, next_at, seen_at, seen_by)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, {now}, ?7)
                 ON CONFLICT (queue, name) DO UPDATE
                 SET spec = excluded.spec, missed = excluded.missed,
                     through = CASE WHEN s.through IS NULL THEN excluded.through
                                    WHEN excluded.through IS NULL THEN s.through
                                    ELSE max(s.through, excluded.through) END,
                     next_at = excluded.next_at, seen_at = excluded.seen_at,
                     seen_by = excluded.seen_by"
            ),
            schedules: format!(
                "SELECT name, spec, missed, through, next_at, seen_at, seen_by
                 FROM \"{table}_schedules\" WHERE queue = ?1 ORDER BY name"
            ),
            forget_schedule: format!(
                "DELETE FROM \"{table}_schedules\" WHERE queue = ?1 AND name = ?2"
            ),
            forget_partition_starts: format!(
                "DELETE FROM \"{table}_starts\" WHERE queue = ?1"
            ),
            set_limits: format!(
                "INSERT INTO {q} (queue, max_in_flight, rate_starts, rate_per_ms, max_per_partition,
                                 partition_rate_starts, partition_rate_per_ms, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, {now})
                 ON CONFLICT (queue) DO UPDATE
                 SET max_in_flight = ?2, rate_starts = ?3, rate_per_ms = ?4, max_per_partition = ?5,
                     partition_rate_starts = ?6, partition_rate_per_ms = ?7, updated_at = {now}
                 RETURNING paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms,
                           max_per_partition, partition_rate_starts, partition_rate_per_ms"
            ),
            // A limited queue's counts, read inside the claim's write transaction: jobs with a
            // live lease, and claims within the rate's window ([epoch ms, jobs] pairs).
            quota: format!(
                "SELECT max_in_flight, rate_starts, rate_per_ms, max_per_partition, partition_rate_starts,
                        partition_rate_per_ms, partition_cursor,
                        (SELECT count(*) FROM {t} INDEXED BY \"{table}_expiry_idx\"
                         WHERE queue = ?1 AND status = 'in_flight') AS in_flight,
                        (SELECT coalesce(sum(json_extract(e.value, '$[1]')), 0)
                         FROM json_each(c.rate_log) AS e
                         WHERE json_extract(e.value, '$[0]') > {now} * 1000 - c.rate_per_ms) AS started
                 FROM {q} AS c
                 WHERE queue = ?1
                   AND (max_in_flight IS NOT NULL OR (rate_starts IS NOT NULL AND rate_per_ms IS NOT NULL)
                        OR max_per_partition IS NOT NULL
                        OR (partition_rate_starts IS NOT NULL AND partition_rate_per_ms IS NOT NULL))"
            ),
            // A rate-limited queue's claim of ?2 jobs: the log keeps the window's claims and
            // this one.
            log_starts: format!(
                "UPDATE {q} SET rate_log = json_insert(
                     (SELECT json_group_array(json(e.value)) FROM json_each({q}.rate_log) AS e
                      WHERE json_extract(e.value, '$[0]') > {now} * 1000 - {q}.rate_per_ms),
                     '$[#]', json_array(round({now} * 1000), ?2))
                 WHERE queue = ?1 AND rate_starts IS NOT NULL"
            ),
            // One index probe per queue and family (SQLite's min() reads an index's first
            // entry), not a scan of the rows.
            queues: format!(
                "WITH RECURSIVE
                 pending(queue) AS (
                     SELECT min(queue) FROM {t} WHERE status = 'pending'
                     UNION ALL
                     SELECT (SELECT min(queue) FROM {t} WHERE status = 'pending' AND queue > p.queue)
                     FROM pending AS p WHERE p.queue IS NOT NULL),
                 running(queue) AS (
                     SELECT min(queue) FROM {t} WHERE status = 'in_flight'
                     UNION ALL
                     SELECT (SELECT min(queue) FROM {t} WHERE status = 'in_flight' AND queue > r.queue)
                     FROM running AS r WHERE r.queue IS NOT NULL),
                 ended(queue) AS (
                     SELECT min(queue) FROM {t} WHERE status IN ('failed', 'dead', 'cancelled')
                     UNION ALL
                     SELECT (SELECT min(queue) FROM {t}
                             WHERE status IN ('failed', 'dead', 'cancelled') AND queue > e.queue)
                     FROM ended AS e WHERE e.queue IS NOT NULL)
                 SELECT queue FROM pending WHERE queue IS NOT NULL
                 UNION SELECT queue FROM running WHERE queue IS NOT NULL
                 UNION SELECT queue FROM ended WHERE queue IS NOT NULL
                 UNION SELECT queue FROM {q}
                       WHERE paused_at IS NOT NULL OR served_at IS NOT NULL OR stale_fences > 0
                 UNION SELECT queue FROM \"{table}_schedules\"
                 ORDER BY 1"
            ),
            // One read: the current minute and the counts of the window up to its end (a row
            // finished after the read's now is not in it). `?2` minutes.
            throughput: format!(
                "WITH b AS (SELECT CAST({now} / 60 AS INTEGER) AS current)
                 SELECT b.current AS current, CAST(j.finished_at / 60 AS INTEGER) AS minute,
                        j.status AS status, count(j.id) AS jobs
                 FROM b LEFT JOIN {t} AS j
                   ON j.finished_at IS NOT NULL AND j.queue = ?1
                  AND j.finished_at >= (b.current - ?2 + 1) * 60.0
                  AND j.finished_at < (b.current + 1) * 60.0
                 GROUP BY 1, 2, 3"
            ),
            record_stale: format!(
                "INSERT INTO {q} (queue, stale_fences, last_stale_at, updated_at)
                 VALUES (?1, ?2, {now}, {now})
                 ON CONFLICT (queue) DO UPDATE
                 SET stale_fences = stale_fences + excluded.stale_fences, last_stale_at = {now},
                     updated_at = {now}"
            ),
            note_served: format!(
                "INSERT INTO {q} (queue, served_at, updated_at) VALUES (?1, {now}, {now})
                 ON CONFLICT (queue) DO UPDATE SET served_at = {now}, updated_at = {now}"
            ),
        }
    }
}

/// An instant of job `id`'s row (seconds since the epoch) as a time; one no time can hold (a
/// hand-written 1e300) is corrupt, never a silent 1970.
fn instant(id: i64, secs: f64) -> Result<DateTime<Utc>, SqliteError> {
    let micros = secs * 1e6;
    let at = (micros.is_finite() && micros.abs() < i64::MAX as f64)
        .then(|| DateTime::from_timestamp_micros(micros.round() as i64))
        .flatten();
    at.ok_or_else(|| SqliteError::Corrupt {
        id,
        what: format!("the instant {secs}"),
    })
}

fn optional_instant(id: i64, secs: Option<f64>) -> Result<Option<DateTime<Utc>>, SqliteError> {
    secs.map(|secs| instant(id, secs)).transpose()
}

/// A count or priority of job `id`'s row in the width the model gives it.
fn narrow<T: TryFrom<i64>>(id: i64, column: &str, value: i64) -> Result<T, SqliteError> {
    T::try_from(value).map_err(|_| SqliteError::Corrupt {
        id,
        what: format!("{column} {value}"),
    })
}

/// A time as an instant of the table.
fn seconds(at: DateTime<Utc>) -> f64 {
    at.timestamp_micros() as f64 / 1e6
}

fn status_of(id: i64, text: &str) -> Result<JobStatus, SqliteError> {
    JobStatus::parse(text).ok_or_else(|| SqliteError::Corrupt {
        id,
        what: format!("the status {text:?}"),
    })
}

fn record(row: &SqliteRow) -> Result<JobRecord, SqliteError> {
    let db = SqliteError::Database;
    let id: i64 = row.try_get("id").map_err(db)?;
    let get_text = |c: &str| row.try_get::<String, _>(c).map_err(SqliteError::Database);
    let payload_text = get_text("payload")?;
    let payload: Value = serde_json::from_str(&payload_text).map_err(|_| SqliteError::Corrupt {
        id,
        what: "a payload that is not JSON".to_owned(),
    })?;
    let errors: Vec<ErrorEntry> = match serde_json::from_str::<Value>(&get_text("errors")?) {
        Ok(Value::Array(entries)) => entries
            .into_iter()
            .filter_map(|e| serde_json::from_value(e).ok())
            .collect(),
        _ => Vec::new(),
    };
    let f = |c: &str| row.try_get::<f64, _>(c).map_err(SqliteError::Database);
    let of = |c: &str| {
        row.try_get::<Option<f64>, _>(c)
            .map_err(SqliteError::Database)
    };
    Ok(JobRecord {
        id: JobId(id),
        queue: get_text("queue")?,
        status: status_of(id, &get_text("status")?)?,
        payload,
        priority: narrow(id, "priority", row.try_get("priority").map_err(db)?)?,
        attempts: narrow(id, "attempts", row.try_get("attempts").map_err(db)?)?,
        reclaims: narrow(id, "reclaims", row.try_get("reclaims").map_err(db)?)?,
        next_attempt_at: instant(id, f("next_attempt_at")?)?,
        claimed_at: optional_instant(id, of("claimed_at")?)?,
        lease_expires_at: optional_instant(id, of("lease_expires_at")?)?,
        cancel_requested_at: optional_instant(id, of("cancel_requested_at")?)?,
        claim_generation: ClaimGeneration(row.try_get("claim_generation").map_err(db)?),
        claim_token: ClaimToken(row.try_get("claim_token").map_err(db)?),
        last_error: row.try_get("last_error").map_err(db)?,
        unique_key: row.try_get("unique_key").map_err(db)?,
        partition_key: row.try_get("partition_key").map_err(db)?,
        created_at: instant(id, f("created_at")?)?,
        updated_at: instant(id, f("updated_at")?)?,
        finished_at: optional_instant(id, of("finished_at")?)?,
        claimed_by: row.try_get("claimed_by").map_err(db)?,
        errors,
    })
}

fn control_of(row: Option<&SqliteRow>) -> Result<QueueControl, SqliteError> {
    let Some(row) = row else {
        return Ok(QueueControl::default());
    };
    let db = SqliteError::Database;
    Ok(QueueControl {
        paused_at: optional_instant(-1, row.try_get("paused_at").map_err(db)?)?,
        stale_fences: row.try_get::<i64, _>("stale_fences").map_err(db)?.max(0) as u64,
        last_stale_at: optional_instant(-1, row.try_get("last_stale_at").map_err(db)?)?,
        limits: queue_limits(row)?,
        room_grants: false,
    })
}

/// The limits columns of a controls row (see [`QueueLimits::from_stored`]).
fn queue_limits(row: &SqliteRow) -> Result<QueueLimits, SqliteError> {
    let db = SqliteError::Database;
    Ok(QueueLimits::from_stored(
        row.try_get("max_in_flight").map_err(db)?,
        row.try_get("rate_starts").map_err(db)?,
        row.try_get("rate_per_ms").map_err(db)?,
        row.try_get("max_per_partition").map_err(db)?,
        row.try_get("partition_rate_starts").map_err(db)?,
        row.try_get("partition_rate_per_ms").map_err(db)?,
    ))
}

/// `run_at` as the insert's two parameters: an instant, or a delay from SQLite's now.
fn split_run_at(run_at: RunAt) -> (Option<f64>, Option<f64>) {
    match queue_core::limits::storable_run_at(run_at) {
        RunAt::Now => (None, None),
        RunAt::After(delay) => (None, Some(delay.as_secs_f64())),
        RunAt::At(at) => (Some(seconds(at)), None),
    }
}

/// A transaction of the SQLite backend: `BEGIN IMMEDIATE`, so it holds the write lock from its
/// first statement. Dropped without commit, it rolls back.
///
/// The transaction is SQLite's own (`BEGIN`/`COMMIT` on a pooled connection), not sqlx's: a
/// statement can make SQLite roll the whole transaction back by itself (`INSERT OR ROLLBACK`,
/// a trigger's `RAISE(ROLLBACK)`, some I/O errors), after which sqlx would believe it still
/// open and refuse every later transaction on that connection. Here, whenever a transaction did
/// not end with a `COMMIT` or `ROLLBACK` that succeeded, its connection is closed instead of
/// going back to the pool, and SQLite rolls back whatever it left.
pub struct SqliteTx {
    conn: PoolConnection<Sqlite>,
    /// `BEGIN` was sent (or may have been: it counts from before the statement), and no
    /// `COMMIT` or `ROLLBACK` has succeeded since.
    open: bool,
    path: String,
    wake: Option<Arc<Notify>>,
}

impl std::fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTx")
            .field("path", &self.path)
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl SqliteTx {
    async fn begin(pool: &SqlitePool, path: &str) -> Result<SqliteTx, SqliteError> {
        let conn = pool
            .acquire()
            .await
            .map_err(|e| SqliteError::from_sqlx(e, path))?;
        // The guard exists before the BEGIN and counts it as open: a caller that drops this
        // future while the BEGIN waits for the lock cannot tell whether SQLite ran it (sqlx
        // runs it on the connection's own thread), so the connection is closed rather than
        // pooled, and never hands a later caller a transaction holding the write lock.
        let mut tx = SqliteTx {
            conn,
            open: true,
            path: path.to_owned(),
            wake: None,
        };
        match sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut *tx.conn)
            .await
        {
            Ok(_) => Ok(tx),
            Err(e) => {
                // A BEGIN that fails (busy past the timeout) opens nothing: the connection
                // goes back to the pool.
                tx.open = false;
                Err(SqliteError::from_sqlx(e, path))
            }
        }
    }

    /// The transaction's connection, for a hook's own statements (its domain writes).
    pub fn conn(&mut self) -> &mut SqliteConnection {
        &mut self.conn
    }

    async fn commit_now(mut self) -> Result<(), SqliteError> {
        sqlx::raw_sql("COMMIT")
            .execute(&mut *self.conn)
            .await
            .map_err(|e| SqliteError::from_sqlx(e, &self.path))?;
        self.open = false;
        if let Some(wake) = self.wake.take() {
            wake.notify_waiters();
        }
        Ok(())
    }

    /// Runs one statement without parameters inside the transaction.
    async fn run(&mut self, text: &'static str) -> Result<(), SqliteError> {
        sqlx::raw_sql(text)
            .execute(&mut *self.conn)
            .await
            .map_err(|e| SqliteError::from_sqlx(e, &self.path))?;
        Ok(())
    }

    async fn rollback_now(mut self) {
        // A ROLLBACK that fails finds the transaction already ended by SQLite, or cannot end
        // it: either way the connection is closed (see the type's docs), which ends it.
        if sqlx::raw_sql("ROLLBACK")
            .execute(&mut *self.conn)
            .await
            .is_ok()
        {
            self.open = false;
        }
    }
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}

impl BackendTx for SqliteTx {
    async fn commit(self) -> queue_core::Result<()> {
        Ok(self.commit_now().await?)
    }

    async fn rollback(self) -> queue_core::Result<()> {
        self.rollback_now().await;
        Ok(())
    }

    async fn savepoint(&mut self) -> queue_core::Result<()> {
        Ok(self.run("SAVEPOINT queue_job").await?)
    }

    async fn rollback_to_savepoint(&mut self) -> queue_core::Result<()> {
        Ok(self.run("ROLLBACK TO queue_job").await?)
    }
}

/// The claim's pick rendered for `table`, for tests that read its plan (`EXPLAIN QUERY PLAN`):
/// `?1` queue, `?2` batch size, `?3` how many pending jobs among them.
#[doc(hidden)]
pub fn pick_sql(table: &TableName) -> String {
    Sql::new(table).pick
}

/// The admin listing rendered for `table` and `statuses`, for tests that read its plan: `?1`
/// queue, `?2` the page's `before` id (NULL: the first page), `?3` the page size.
#[doc(hidden)]
pub fn list_sql(table: &TableName, statuses: &[JobStatus]) -> String {
    list_text(&Sql::new(table), statuses)
}

fn list_text(sql: &Sql, statuses: &[JobStatus]) -> String {
    sql.list.replace("{statuses}", &status_filter(statuses))
}

impl SqliteQueue {
    /// A handle on `config.queue` of `config.table` in the database of `pool` (see
    /// [`open_pool`]); refuses a table that is not on the lease schema.
    pub async fn connect(pool: SqlitePool, config: SqliteQueueConfig) -> Result<Self, SqliteError> {
        if config.max_payload_bytes > SqliteQueueConfig::MAX_PAYLOAD_BYTES {
            return Err(SqliteError::InvalidOption {
                name: "max_payload_bytes",
                reason: format!(
                    "{} is over SQLite's largest value ({} bytes)",
                    config.max_payload_bytes,
                    SqliteQueueConfig::MAX_PAYLOAD_BYTES
                ),
            });
        }
        let path = pool.connect_options().get_filename().display().to_string();
        schema::check(&pool, &config.table, &path).await?;
        let sql = Arc::new(Sql::new(&config.table));
        Ok(SqliteQueue {
            inner: Arc::new(Inner {
                pool,
                config,
                path,
                sql,
                wake: Arc::new(Notify::new()),
            }),
        })
    }

    /// Creates (if missing) a queue table named `table` in the database of `pool`.
    pub async fn install_table(pool: &SqlitePool, table: &TableName) -> Result<(), SqliteError> {
        let path = pool.connect_options().get_filename().display().to_string();
        schema::install(pool, table, &path).await
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.inner.pool
    }

    /// The database's file name, as errors name it.
    pub fn path(&self) -> &str {
        &self.inner.path
    }

    /// Wakes this process's workers when `tx` commits: for jobs a caller inserted with its own
    /// statements in `tx` (the framework's own enqueues wake them already).
    pub fn notify_in(&self, tx: &mut SqliteTx) {
        tx.wake = Some(self.inner.wake.clone());
    }

    /// The configuration.
    pub fn config(&self) -> &SqliteQueueConfig {
        &self.inner.config
    }

    fn err(&self, e: sqlx::Error) -> SqliteError {
        SqliteError::from_sqlx(e, &self.inner.path)
    }

    async fn begin_immediate(&self) -> Result<SqliteTx, SqliteError> {
        SqliteTx::begin(&self.inner.pool, &self.inner.path).await
    }

    fn queue_str(&self) -> &str {
        self.inner.config.queue.as_str()
    }

    async fn insert(
        &self,
        conn: &mut SqliteConnection,
        job: NewJob,
    ) -> Result<Enqueued, SqliteError> {
        job.check_within(self.inner.config.max_payload_bytes)?;
        let (at, delay) = split_run_at(job.run_at);
        let payload = job.payload.to_string();
        if let Some(key) = job.unique_key.as_deref()
            && !job.unique.is_default()
        {
            let held_while = job.unique.held_while.as_ref().map(|statuses| {
                Value::from(statuses.iter().map(|s| s.as_str()).collect::<Vec<_>>()).to_string()
            });
            sqlx::query(AssertSqlSafe(self.inner.sql.release_unique.as_str()))
                .bind(self.queue_str())
                .bind(key)
                .bind(held_while)
                .bind(job.unique.held_for.map(|period| period.as_secs_f64()))
                .execute(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            if job.unique.replace {
                let replaced: Option<i64> =
                    sqlx::query_scalar(AssertSqlSafe(self.inner.sql.replace_unique.as_str()))
                        .bind(self.queue_str())
                        .bind(key)
                        .bind(&payload)
                        .bind(i64::from(job.priority))
                        .bind(at)
                        .bind(delay)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| self.err(e))?;
                if let Some(id) = replaced {
                    return Ok(Enqueued::existing(JobId(id), true));
                }
            }
        }
        let inserted: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(self.inner.sql.insert.as_str()))
                .bind(self.queue_str())
                .bind(&payload)
                .bind(i64::from(job.priority))
                .bind(at)
                .bind(delay)
                .bind(job.unique_key.as_deref())
                .bind(job.partition_key.as_deref())
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
        if let Some(id) = inserted {
            return Ok(Enqueued::inserted(JobId(id)));
        }
        let key = job.unique_key.as_deref().unwrap_or_default();
        let holder: i64 = sqlx::query_scalar(AssertSqlSafe(self.inner.sql.holder.as_str()))
            .bind(self.queue_str())
            .bind(key)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(Enqueued::existing(JobId(holder), false))
    }

    async fn enqueue_rows(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>, SqliteError> {
        for job in &jobs {
            job.check_within(self.inner.config.max_payload_bytes)?;
        }
        queue_core::limits::check_enqueue_batch(&jobs)?;
        let mut tx = self.begin_immediate().await?;
        let mut out = Vec::with_capacity(jobs.len());
        for job in jobs {
            out.push(self.insert(tx.conn(), job).await?);
        }
        tx.commit_now().await?;
        let new = out.iter().filter(|e| !e.duplicate).count() as u64;
        queue_core::metrics::record_enqueued(&self.inner.config.queue, new);
        self.inner.wake.notify_waiters();
        Ok(out)
    }

    async fn claim_jobs(&self, request: &ClaimRequest) -> Result<ClaimBatch, SqliteError> {
        let sql = &self.inner.sql;
        let mut tx = self.begin_immediate().await?;
        // Claims write one at a time (BEGIN IMMEDIATE), so a limited queue's counts read here
        // hold until this claim commits.
        let quota = sqlx::query(AssertSqlSafe(sql.quota.as_str()))
            .bind(self.queue_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        let batch = request.batch_size.max(1);
        let db = SqliteError::Database;
        let (room, limits, cursor) = match quota {
            None => (
                ClaimRoom {
                    all: batch,
                    new: batch,
                },
                QueueLimits::NONE,
                None,
            ),
            Some(row) => {
                let limits = queue_limits(&row)?;
                let in_flight: i64 = row.try_get("in_flight").map_err(db)?;
                let started: i64 = row.try_get("started").map_err(db)?;
                let cursor: Option<String> = row.try_get("partition_cursor").map_err(db)?;
                let room = limits.room(batch, in_flight.max(0) as u64, started.max(0) as u64);
                (room, limits, cursor)
            }
        };
        if room.all == 0 {
            tx.rollback_now().await;
            return Ok(ClaimBatch::default());
        }
        let rows = sqlx::query(AssertSqlSafe(sql.pick.as_str()))
            .bind(self.queue_str())
            .bind(i64::from(room.all))
            .bind(i64::from(room.new))
            .bind(
                limits
                    .rate_per_partition
                    .map(|rate| i64::from(rate.starts())),
            )
            .bind(
                limits
                    .rate_per_partition
                    .map(|rate| rate.per().as_millis() as i64),
            )
            .fetch_all(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        let mut picked = Vec::with_capacity(rows.len());
        for row in &rows {
            let expired: bool = row.try_get("expired").map_err(db)?;
            // The claim order comes under other names: selected as they are, they would let
            // SQLite sort each pick before merging them instead of sorting the merge once.
            picked.push(Pick::of(row, expired, "pick_due", "pick_priority")?);
        }
        // With limits per partition, the earliest due jobs are taken as they are when they fit;
        // otherwise the partitions take turns (queue_core::partition). A partition's room is
        // what its limit in flight and its rate leave.
        let window = limits
            .rate_per_partition
            .map(|rate| rate.per().as_millis() as i64);
        let mut walked = None;
        if limits.partitioned() {
            // Jobs in flight matter only to a limit in flight.
            let held = match limits.max_per_partition {
                Some(_) => self.partitions_held(&mut tx).await?,
                None => HashMap::new(),
            };
            let in_flight = |key: &str| held.get(key).copied().unwrap_or(0).max(0) as u64;
            let earliest: Vec<Option<String>> =
                sqlx::query_scalar(AssertSqlSafe(sql.partitions.earliest.as_str()))
                    .bind(self.queue_str())
                    .bind(i64::from(room.new))
                    .fetch_all(tx.conn())
                    .await
                    .map_err(|e| self.err(e))?;
            let started = self
                .partitions_started(&mut tx, earliest.iter().flatten(), window)
                .await?;
            let partition_room = |key: &str| {
                limits.partition_room(in_flight(key), started.get(key).copied().unwrap_or(0))
            };
            let keys = earliest.iter().map(Option::as_deref);
            if !queue_core::partition::fits(keys, partition_room) {
                picked.retain(|p| p.expired);
                let (due, walk) = self
                    .partition_picks(&mut tx, &limits, room.new, cursor, &in_flight)
                    .await?;
                picked.extend(due);
                picked.sort_by(Pick::cmp);
                walked = Some(walk);
            }
        }
        if window.is_some() {
            // Takeovers are starts too, and add no job in flight: each partition's picks are
            // kept within the starts its rate leaves, the earliest first.
            let keys = picked.iter().filter_map(|p| p.partition_key.as_ref());
            let started = self.partitions_started(&mut tx, keys, window).await?;
            queue_core::partition::keep_within_starts(
                &mut picked,
                |p| p.partition_key.as_deref(),
                |key| limits.partition_starts_left(started.get(key).copied().unwrap_or(0)),
            );
        }
        // Cut to the batch after each partition kept within its starts, as every store does.
        picked.truncate(room.all as usize);
        if picked.is_empty() {
            if let Some(walk) = &walked {
                self.move_cursor(&mut tx, walk, |_| false).await?;
                tx.commit_now().await?;
            } else {
                tx.rollback_now().await;
            }
            return Ok(ClaimBatch::default());
        }
        let order: Vec<i64> = picked.iter().map(|p| p.id).collect();
        let expired: Vec<i64> = picked.iter().filter(|p| p.expired).map(|p| p.id).collect();
        let flags: HashMap<i64, Pick> = picked.iter().map(|p| (p.id, p.clone())).collect();
        let json = |ids: &[i64]| Value::from(ids.to_vec()).to_string();
        let rows = sqlx::query(AssertSqlSafe(sql.claim.as_str()))
            .bind(json(&order))
            .bind(json(&expired))
            .bind(request.holder.as_deref())
            .bind(request.lease.as_secs_f64())
            .bind(ClaimToken::random().0)
            .fetch_all(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        // Every row is read before the claim commits: a row that cannot be read leaves the
        // jobs as they were, not claimed by a worker that never got them.
        let mut jobs = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.try_get("id").map_err(db)?;
            let pick = flags.get(&id);
            let taken_over = pick.is_some_and(|p| p.expired);
            let reclaims_before = pick.map_or(0, |p| p.reclaims);
            let payload_text: String = row.try_get("payload").map_err(db)?;
            let payload =
                serde_json::from_str(&payload_text).map_err(|_| SqliteError::Corrupt {
                    id,
                    what: "a payload that is not JSON".to_owned(),
                })?;
            jobs.push(ClaimedJob {
                id: JobId(id),
                generation: ClaimGeneration(row.try_get("claim_generation").map_err(db)?),
                token: ClaimToken(row.try_get("claim_token").map_err(db)?),
                attempts: narrow(id, "attempts", row.try_get("attempts").map_err(db)?)?,
                reclaims: narrow(id, "reclaims", row.try_get("reclaims").map_err(db)?)?,
                taken_over,
                over_reclaim_cap: taken_over && reclaims_before >= i64::from(request.max_reclaims),
                cancel_requested: pick.is_some_and(|p| p.cancel_requested),
                claimed_at: instant(id, row.try_get("claimed_at").map_err(db)?)?,
                due_at: instant(id, row.try_get("next_attempt_at").map_err(db)?)?,
                priority: narrow(id, "priority", row.try_get("priority").map_err(db)?)?,
                payload,
            });
        }
        if limits.rate.is_some() && !jobs.is_empty() {
            sqlx::query(AssertSqlSafe(sql.log_starts.as_str()))
                .bind(self.queue_str())
                .bind(jobs.len() as i64)
                .execute(tx.conn())
                .await
                .map_err(|e| self.err(e))?;
        }
        if let Some(window) = window {
            self.log_partition_starts(&mut tx, &jobs, &flags, window)
                .await?;
        }
        if let Some(walk) = &walked {
            // Only the partitions' offers: a takeover is no partition's turn.
            let taken: HashSet<&str> = jobs
                .iter()
                .filter(|job| !job.taken_over)
                .filter_map(|job| flags.get(&job.id.0)?.partition_key.as_deref())
                .collect();
            self.move_cursor(&mut tx, walk, |key| taken.contains(key))
                .await?;
        }
        tx.commit_now().await?;
        let position: HashMap<i64, usize> =
            order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        jobs.sort_by_key(|j| position.get(&j.id.0).copied().unwrap_or(usize::MAX));
        Ok(ClaimBatch { jobs })
    }

    /// The due jobs a claim of a queue with `limits` per partition may take, at most `wanted`,
    /// in claim order: those without a partition among the queue's earliest, and the offers of
    /// the partitions a [`PartitionWalk`] visits (`queue_core::partition`), each partition's
    /// room what its jobs `in_flight` and its starts within the rate's window leave; and the
    /// walk, for the cursor.
    async fn partition_picks(
        &self,
        tx: &mut SqliteTx,
        limits: &QueueLimits,
        wanted: u32,
        cursor: Option<String>,
        in_flight: &impl Fn(&str) -> u64,
    ) -> Result<(Vec<Pick>, PartitionWalk), SqliteError> {
        let sql = &self.inner.sql.partitions;
        let queue = self.queue_str();
        let window = limits
            .rate_per_partition
            .map(|rate| rate.per().as_millis() as i64);
        let mut picks = Vec::new();
        let mut walk = PartitionWalk::new(cursor, wanted);
        if wanted == 0 {
            return Ok((picks, walk));
        }
        while let Some(probe) = walk.probe() {
            let statement =
                &sql.probe[usize::from(probe.after.is_some())][usize::from(probe.up_to.is_some())];
            let found: Option<(String, bool, i64)> =
                sqlx::query_as(AssertSqlSafe(statement.as_str()))
                    .bind(queue)
                    .bind(probe.after)
                    .bind(probe.up_to)
                    .bind(window)
                    .fetch_optional(tx.conn())
                    .await
                    .map_err(|e| self.err(e))?;
            let found = found.map(|(key, due, started)| {
                let room = limits.partition_room(in_flight(&key), started.max(0) as u64);
                (key, due, room)
            });
            walk.found(found);
        }
        for visit in walk.visits().iter().filter(|v| v.room > 0) {
            let rows = sqlx::query(AssertSqlSafe(sql.offers.as_str()))
                .bind(queue)
                .bind(&visit.key)
                .bind(i64::from(visit.room.min(wanted)))
                .fetch_all(tx.conn())
                .await
                .map_err(|e| self.err(e))?;
            for row in &rows {
                picks.push(Pick::of(row, false, "next_attempt_at", "priority")?);
            }
        }
        let read_ahead = queue_core::partition::loose_read_ahead(wanted) as i64;
        let rows = sqlx::query(AssertSqlSafe(sql.loose.as_str()))
            .bind(queue)
            .bind(i64::from(wanted))
            .bind(read_ahead)
            .fetch_all(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        for row in &rows {
            picks.push(Pick::of(row, false, "next_attempt_at", "priority")?);
        }
        picks.sort_by(Pick::cmp);
        picks.truncate(wanted as usize);
        Ok((picks, walk))
    }

    /// The queue's jobs in flight per partition key.
    async fn partitions_held(
        &self,
        tx: &mut SqliteTx,
    ) -> Result<HashMap<String, i64>, SqliteError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as(AssertSqlSafe(self.inner.sql.partitions.held.as_str()))
                .bind(self.queue_str())
                .fetch_all(tx.conn())
                .await
                .map_err(|e| self.err(e))?;
        Ok(rows.into_iter().collect())
    }

    /// How many of each partition's jobs (of `keys`) were claimed within the window of the
    /// queue's rate per partition (`window`, in milliseconds; `None`: no rate, none counted),
    /// by SQLite's clock: one statement for all the keys.
    async fn partitions_started<'k>(
        &self,
        tx: &mut SqliteTx,
        keys: impl IntoIterator<Item = &'k String>,
        window: Option<i64>,
    ) -> Result<HashMap<String, u64>, SqliteError> {
        let keys: BTreeSet<&str> = keys.into_iter().map(String::as_str).collect();
        let Some(window) = window.filter(|_| !keys.is_empty()) else {
            return Ok(HashMap::new());
        };
        let rows: Vec<(String, i64)> =
            sqlx::query_as(AssertSqlSafe(self.inner.sql.partitions.started.as_str()))
                .bind(self.queue_str())
                .bind(Value::from(Vec::from_iter(keys)).to_string())
                .bind(window)
                .fetch_all(tx.conn())
                .await
                .map_err(|e| self.err(e))?;
        Ok(rows
            .into_iter()
            .map(|(key, started)| (key, started.max(0) as u64))
            .collect())
    }

    /// Logs the starts of a claim of a queue with a rate per partition (`window` milliseconds)
    /// per partition of the claimed `jobs` (`picks` has their keys), and prunes the queue's
    /// partitions whose last claim left the window (see [`PRUNED_PER_CLAIM`]).
    async fn log_partition_starts(
        &self,
        tx: &mut SqliteTx,
        jobs: &[ClaimedJob],
        picks: &HashMap<i64, Pick>,
        window: i64,
    ) -> Result<(), SqliteError> {
        let sql = &self.inner.sql.partitions;
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for job in jobs {
            if let Some(key) = picks
                .get(&job.id.0)
                .and_then(|p| p.partition_key.as_deref())
            {
                *counts.entry(key).or_default() += 1;
            }
        }
        if !counts.is_empty() {
            let pairs: Vec<Value> = counts
                .into_iter()
                .map(|(key, n)| serde_json::json!([key, n]))
                .collect();
            sqlx::query(AssertSqlSafe(sql.log_starts.as_str()))
                .bind(self.queue_str())
                .bind(Value::from(pairs).to_string())
                .bind(window)
                .execute(tx.conn())
                .await
                .map_err(|e| self.err(e))?;
        }
        sqlx::query(AssertSqlSafe(sql.prune_starts.as_str()))
            .bind(self.queue_str())
            .bind(window)
            .bind(PRUNED_PER_CLAIM.max(jobs.len() as i64))
            .execute(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Stores the queue's partition cursor after a claim whose walk was `walk`.
    async fn move_cursor(
        &self,
        tx: &mut SqliteTx,
        walk: &PartitionWalk,
        taken: impl Fn(&str) -> bool,
    ) -> Result<(), SqliteError> {
        let cursor = walk.cursor_after(taken);
        sqlx::query(AssertSqlSafe(self.inner.sql.partitions.set_cursor.as_str()))
            .bind(self.queue_str())
            .bind(cursor)
            .execute(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The status job `id` of this queue is in now, on `conn` (`None`: no such job): what a
    /// cancel or a retry that changed nothing reports.
    async fn status_now(
        &self,
        conn: &mut SqliteConnection,
        id: JobId,
    ) -> Result<Option<JobStatus>, SqliteError> {
        let status: Option<String> =
            sqlx::query_scalar(AssertSqlSafe(self.inner.sql.status_of.as_str()))
                .bind(id.0)
                .bind(self.queue_str())
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
        status.map(|s| status_of(id.0, &s)).transpose()
    }

    /// The fenced heartbeat of `claim`, on `conn`.
    async fn extend_on(
        &self,
        conn: &mut sqlx::SqliteConnection,
        claim: Claim,
        lease: Lease,
    ) -> queue_core::Result<Heartbeat> {
        let row: Option<bool> = sqlx::query_scalar(AssertSqlSafe(self.inner.sql.extend.as_str()))
            .bind(claim.id.0)
            .bind(claim.generation.0)
            .bind(lease.as_secs_f64())
            .bind(claim.token.0)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(match row {
            None => Heartbeat::Lost,
            Some(true) => Heartbeat::CancelRequested,
            Some(false) => Heartbeat::Held,
        })
    }

    /// The fenced write of one outcome, on a connection inside a write transaction.
    async fn finalize_one(
        &self,
        conn: &mut SqliteConnection,
        claim: Claim,
        action: &Finalize,
    ) -> Result<FinalizeOutcome, SqliteError> {
        let sql = &self.inner.sql;
        let action = action.storable();
        // Only an outcome with an error reads the row first (its history grows by an entry
        // with the claim's attempt and holder); the others are the fenced update alone.
        let errors = match action.error_text() {
            None => None,
            Some(error) => match self.history_with(conn, claim, &action, error).await? {
                Some(errors) => Some(errors),
                None => return Ok(FinalizeOutcome::Stale),
            },
        };
        // A retry or snooze always moves next_attempt_at: "now" is a delay of zero.
        let (at, delay) = match action.due_again().map(split_run_at) {
            Some((None, None)) => (None, Some(0.0)),
            Some(other) => other,
            None => (None, None),
        };
        let target = action.target_status();
        let done = sqlx::query(AssertSqlSafe(sql.finalize.as_str()))
            .bind(claim.id.0)
            .bind(claim.generation.0)
            .bind(target.as_str())
            .bind(i64::from(action.gives_back_attempt()))
            .bind(at)
            .bind(delay)
            .bind(action.error_text())
            .bind(errors)
            .bind(target.is_terminal())
            .bind(claim.token.0)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(FinalizeOutcome::from_rows_affected(done.rows_affected()))
    }

    /// The job's error history with `error` appended (the last
    /// [`queue_core::limits::ERROR_HISTORY_LEN`] kept), as JSON text; `None` when the claim no
    /// longer holds the job.
    async fn history_with(
        &self,
        conn: &mut SqliteConnection,
        claim: Claim,
        action: &Finalize,
        error: &str,
    ) -> Result<Option<String>, SqliteError> {
        let Some(row) = sqlx::query(AssertSqlSafe(self.inner.sql.fence_read.as_str()))
            .bind(claim.id.0)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.err(e))?
        else {
            return Ok(None);
        };
        let db = SqliteError::Database;
        let status: String = row.try_get("status").map_err(db)?;
        let generation: i64 = row.try_get("claim_generation").map_err(db)?;
        let token: i64 = row.try_get("claim_token").map_err(db)?;
        if status != JobStatus::InFlight.as_str()
            || generation != claim.generation.0
            || token != claim.token.0
        {
            return Ok(None);
        }
        let attempts: i64 = row.try_get("attempts").map_err(db)?;
        let holder: Option<String> = row.try_get("claimed_by").map_err(db)?;
        let now: f64 = row.try_get("now").map_err(db)?;
        let errors_text: String = row.try_get("errors").map_err(db)?;
        // A history that is not an array (edited by hand) starts again from empty.
        let mut errors: Vec<Value> = match serde_json::from_str(&errors_text) {
            Ok(Value::Array(entries)) => entries,
            _ => Vec::new(),
        };
        errors.push(serde_json::json!({
            "attempt": attempts,
            "generation": generation,
            "at": instant(claim.id.0, now)?,
            "worker": holder,
            "outcome": action.kind(),
            "error": queue_core::limits::history_text(error),
        }));
        let keep = queue_core::limits::ERROR_HISTORY_LEN;
        if errors.len() > keep {
            errors.drain(..errors.len() - keep);
        }
        Ok(Some(Value::Array(errors).to_string()))
    }

    async fn fetch_records(
        &self,
        sql: &str,
        binds: impl FnOnce(
            sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
        )
            -> sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> Result<Vec<JobRecord>, SqliteError> {
        let rows = binds(sqlx::query(AssertSqlSafe(sql)))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter().map(record).collect()
    }
}

impl Backend for SqliteQueue {
    type Tx = SqliteTx;

    fn savepoints(&self) -> bool {
        true
    }

    fn queue(&self) -> &QueueName {
        &self.inner.config.queue
    }

    async fn enqueue(&self, job: NewJob) -> queue_core::Result<Enqueued> {
        let mut out = self.enqueue_rows(vec![job]).await?;
        Ok(out.remove(0))
    }

    async fn enqueue_many(&self, jobs: Vec<NewJob>) -> queue_core::Result<Vec<Enqueued>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.enqueue_rows(jobs).await?)
    }

    async fn enqueue_in(&self, tx: &mut SqliteTx, job: NewJob) -> queue_core::Result<Enqueued> {
        let enqueued = self.insert(tx.conn(), job).await?;
        queue_core::metrics::record_enqueued(
            &self.inner.config.queue,
            u64::from(!enqueued.duplicate),
        );
        if !enqueued.duplicate || enqueued.replaced {
            tx.wake = Some(self.inner.wake.clone());
        }
        Ok(enqueued)
    }

    async fn begin(&self) -> queue_core::Result<SqliteTx> {
        Ok(self.begin_immediate().await?)
    }

    async fn claim(&self, request: ClaimRequest) -> queue_core::Result<ClaimBatch> {
        Ok(self.claim_jobs(&request).await?)
    }

    async fn finalize_in(
        &self,
        tx: &mut SqliteTx,
        claim: Claim,
        action: &Finalize,
    ) -> queue_core::Result<FinalizeOutcome> {
        let outcome = self.finalize_one(tx.conn(), claim, action).await?;
        if outcome.is_applied() && action.requeues() {
            tx.wake = Some(self.inner.wake.clone());
        }
        Ok(outcome)
    }

    async fn finalize_many(
        &self,
        items: &[(Claim, Finalize)],
    ) -> queue_core::Result<Vec<FinalizeOutcome>> {
        queue_core::limits::check_batch(items)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.begin_immediate().await?;
        let mut outcomes = Vec::with_capacity(items.len());
        for (claim, action) in items {
            outcomes.push(self.finalize_one(tx.conn(), *claim, action).await?);
        }
        tx.commit_now().await?;
        self.inner.wake.notify_waiters();
        Ok(outcomes)
    }

    async fn extend_lease(&self, claim: Claim, lease: Lease) -> queue_core::Result<Heartbeat> {
        let mut conn = self.inner.pool.acquire().await.map_err(|e| self.err(e))?;
        self.extend_on(&mut conn, claim, lease).await
    }

    /// Many heartbeats in one write transaction (one wait for the write lock, one sync of the
    /// file), each fenced as one is; never `None` (the transaction holds the write lock).
    async fn extend_leases(
        &self,
        claims: &[Claim],
        lease: Lease,
    ) -> queue_core::Result<Vec<Option<Heartbeat>>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        // On a task of its own: the worker drops a renewal call its askers stopped waiting
        // for, and the transaction's guard would then close the connection (safe, but a new
        // connection for every call dropped while it waited for the write lock).
        let (queue, claims) = (self.clone(), claims.to_vec());
        let renewing = async move {
            let mut tx = queue.begin_immediate().await?;
            let mut answers = Vec::with_capacity(claims.len());
            for claim in claims {
                answers.push(Some(queue.extend_on(tx.conn(), claim, lease).await?));
            }
            tx.commit_now().await?;
            Ok::<_, queue_core::Error>(answers)
        };
        tokio::spawn(renewing.instrument(tracing::Span::current()))
            .await
            .map_err(|e| {
                queue_core::Error::backend(format!("the renewal task ended: {e}"), false)
            })?
    }

    async fn cancel_in(&self, tx: &mut SqliteTx, id: JobId) -> queue_core::Result<CancelTarget> {
        let sql = &self.inner.sql;
        let cancelled = sqlx::query(AssertSqlSafe(sql.cancel_pending.as_str()))
            .bind(id.0)
            .bind(self.queue_str())
            .bind(CANCELLED_BY_OPERATOR)
            .fetch_optional(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        if let Some(row) = cancelled {
            return Ok(CancelTarget::Cancelled(record(&row)?.as_claimed()));
        }
        let requested = sqlx::query(AssertSqlSafe(sql.request_cancel.as_str()))
            .bind(id.0)
            .bind(self.queue_str())
            .execute(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        if requested.rows_affected() > 0 {
            return Ok(CancelTarget::Requested);
        }
        Ok(match self.status_now(tx.conn(), id).await? {
            None => CancelTarget::NotFound,
            Some(status) => CancelTarget::AlreadyTerminal(status),
        })
    }

    async fn get(&self, id: JobId) -> queue_core::Result<Option<JobRecord>> {
        let queue = self.queue_str().to_owned();
        let rows = self
            .fetch_records(&self.inner.sql.get, |q| q.bind(id.0).bind(queue))
            .await?;
        Ok(rows.into_iter().next())
    }

    async fn counts(&self) -> queue_core::Result<QueueCounts> {
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.counts.as_str()))
            .bind(self.queue_str())
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        let mut counts = QueueCounts::default();
        for row in rows {
            let status: String = row.try_get("status").map_err(SqliteError::Database)?;
            let jobs: i64 = row.try_get("jobs").map_err(SqliteError::Database)?;
            counts.add(status_of(-1, &status)?, jobs.max(0) as u64);
        }
        Ok(counts)
    }

    async fn stats(&self, window: Duration) -> queue_core::Result<QueueStats> {
        let sql = &self.inner.sql;
        let row = sqlx::query(AssertSqlSafe(sql.stats.as_str()))
            .bind(self.queue_str())
            .bind(QueueStats::COUNT_CAP as i64)
            .bind(window.as_secs_f64())
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        let db = SqliteError::Database;
        let n = |c: &str| row.try_get::<i64, _>(c).map(|n| n.max(0) as u64);
        let wait: Option<f64> = row.try_get("oldest_wait").map_err(db)?;
        let mut stats = QueueStats {
            due: n("due").map_err(SqliteError::Database)?,
            scheduled: n("scheduled").map_err(SqliteError::Database)?,
            in_flight: n("in_flight").map_err(SqliteError::Database)?,
            lease_expired: n("expired").map_err(SqliteError::Database)?,
            lease_expiring: n("expiring").map_err(SqliteError::Database)?,
            oldest_due_wait: wait.map(|w| Duration::from_secs_f64(w.max(0.0))),
            finished_last_hour: FinishedCounts::default(),
        };
        let rows = sqlx::query(AssertSqlSafe(sql.finished_hour.as_str()))
            .bind(self.queue_str())
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        for row in rows {
            let status: String = row.try_get("status").map_err(SqliteError::Database)?;
            let jobs: i64 = row.try_get("jobs").map_err(SqliteError::Database)?;
            stats
                .finished_last_hour
                .add(status_of(-1, &status)?, jobs.max(0) as u64);
        }
        Ok(stats)
    }

    fn wake_signal(&self) -> Option<Arc<Notify>> {
        Some(self.inner.wake.clone())
    }

    async fn note_served(&self) -> queue_core::Result<()> {
        sqlx::query(AssertSqlSafe(self.inner.sql.note_served.as_str()))
            .bind(self.queue_str())
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn record_stale(&self, count: u64) -> queue_core::Result<()> {
        sqlx::query(AssertSqlSafe(self.inner.sql.record_stale.as_str()))
            .bind(self.queue_str())
            .bind(i64::try_from(count).unwrap_or(i64::MAX))
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }
}

/// The `AND status IN (…)` of a listing, from [`JobStatus`] values only.
fn status_filter(statuses: &[JobStatus]) -> String {
    if statuses.is_empty() {
        return String::new();
    }
    let list: Vec<String> = statuses
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    let mut filter = format!("AND status IN ({})", list.join(", "));
    // SQLite uses a partial index only when the query repeats its condition: a listing of
    // failed, dead or cancelled jobs says so, and reads the failed index instead of the table.
    let ended = [JobStatus::Failed, JobStatus::Dead, JobStatus::Cancelled];
    if statuses.iter().all(|s| ended.contains(s)) {
        filter.push_str(" AND status IN ('failed', 'dead', 'cancelled')");
    }
    filter
}

impl queue_core::Admin for SqliteQueue {
    async fn list_jobs(&self, filter: &JobFilter) -> queue_core::Result<JobPage> {
        let text = list_text(&self.inner.sql, &filter.statuses);
        let queue = self.queue_str().to_owned();
        let rows = self
            .fetch_records(&text, |q| {
                q.bind(queue)
                    .bind(filter.before.map(|id| id.0))
                    .bind(i64::from(filter.limit) + 1)
            })
            .await?;
        Ok(JobPage::from_rows(rows, filter.limit))
    }

    async fn find_by_unique_key(&self, key: &str) -> queue_core::Result<Option<JobRecord>> {
        let (queue, key) = (self.queue_str().to_owned(), key.to_owned());
        let rows = self
            .fetch_records(&self.inner.sql.find_unique, |q| q.bind(queue).bind(key))
            .await?;
        Ok(rows.into_iter().next())
    }

    async fn retry_in(
        &self,
        tx: &mut SqliteTx,
        id: JobId,
        seen: JobStatus,
    ) -> queue_core::Result<RetryTarget> {
        let sql = &self.inner.sql;
        let reopened = sqlx::query(AssertSqlSafe(sql.retry.as_str()))
            .bind(id.0)
            .bind(self.queue_str())
            .bind(seen.as_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(|e| self.err(e))?;
        if let Some(row) = reopened {
            tx.wake = Some(self.inner.wake.clone());
            return Ok(RetryTarget::Retried(Box::new(record(&row)?)));
        }
        Ok(match self.status_now(tx.conn(), id).await? {
            None => RetryTarget::NotFound,
            Some(status) => RetryTarget::WrongState(status),
        })
    }

    async fn purge_batch(&self, request: &PurgeRequest) -> queue_core::Result<u64> {
        let statuses: Vec<&str> = request.statuses().iter().map(|s| s.as_str()).collect();
        let deleted = sqlx::query(AssertSqlSafe(self.inner.sql.purge.as_str()))
            .bind(self.queue_str())
            .bind(serde_json::to_string(&statuses).unwrap_or_default())
            .bind(request.older_than().as_secs_f64())
            .bind(i64::from(request.rows_per_batch()))
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        queue_core::events::jobs_purged(&self.inner.config.queue, deleted);
        Ok(deleted)
    }

    async fn pause(&self) -> queue_core::Result<QueueControl> {
        Ok(self.set_paused(true).await?)
    }

    async fn resume(&self) -> queue_core::Result<QueueControl> {
        let control = self.set_paused(false).await?;
        self.inner.wake.notify_waiters();
        Ok(control)
    }

    async fn control(&self) -> queue_core::Result<QueueControl> {
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.control.as_str()))
            .bind(self.queue_str())
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(control_of(row.as_ref())?)
    }

    async fn record_schedules(
        &self,
        seen_by: &str,
        reports: &[queue_core::ScheduleReport],
    ) -> queue_core::Result<()> {
        let sql = &self.inner.sql;
        let seen_by = queue_core::limits::storable_holder(seen_by);
        let mut tx = self.begin_immediate().await?;
        for report in reports {
            sqlx::query(AssertSqlSafe(sql.record_schedule.as_str()))
                .bind(self.queue_str())
                .bind(&report.name)
                .bind(queue_core::limits::storable_text(&report.spec).as_ref())
                .bind(&report.missed)
                .bind(report.through.map(seconds))
                .bind(report.next.map(seconds))
                .bind(&seen_by)
                .execute(tx.conn())
                .await
                .map_err(|e| self.err(e))?;
        }
        tx.commit_now().await?;
        Ok(())
    }

    async fn schedules(&self) -> queue_core::Result<Vec<queue_core::ScheduleInfo>> {
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.schedules.as_str()))
            .bind(self.queue_str())
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        let db = SqliteError::Database;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            out.push(queue_core::ScheduleInfo {
                report: queue_core::ScheduleReport {
                    name: row.try_get("name").map_err(db)?,
                    spec: row.try_get("spec").map_err(db)?,
                    missed: row.try_get("missed").map_err(db)?,
                    through: optional_instant(-1, row.try_get("through").map_err(db)?)?,
                    next: optional_instant(-1, row.try_get("next_at").map_err(db)?)?,
                },
                seen_at: instant(-1, row.try_get("seen_at").map_err(db)?)?,
                seen_by: row.try_get("seen_by").map_err(db)?,
            });
        }
        Ok(out)
    }

    async fn forget_schedule(&self, name: &str) -> queue_core::Result<bool> {
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.forget_schedule.as_str()))
            .bind(self.queue_str())
            .bind(name)
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() > 0)
    }

    async fn set_limits(&self, limits: QueueLimits) -> queue_core::Result<QueueControl> {
        limits.check()?;
        if limits.rate_per_partition.is_none() {
            sqlx::query(AssertSqlSafe(
                self.inner.sql.forget_partition_starts.as_str(),
            ))
            .bind(self.queue_str())
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        }
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.set_limits.as_str()))
            .bind(self.queue_str())
            .bind(limits.max_in_flight.map(i64::from))
            .bind(limits.rate.map(|r| i64::from(r.starts())))
            .bind(limits.rate.map(|r| r.per().as_millis() as i64))
            .bind(limits.max_per_partition.map(i64::from))
            .bind(limits.rate_per_partition.map(|r| i64::from(r.starts())))
            .bind(
                limits
                    .rate_per_partition
                    .map(|r| r.per().as_millis() as i64),
            )
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        let control = control_of(Some(&row))?;
        queue_core::events::queue_limits_set(&self.inner.config.queue, &limits);
        self.inner.wake.notify_waiters();
        Ok(control)
    }

    async fn queues(&self) -> queue_core::Result<Vec<QueueName>> {
        let names: Vec<String> = sqlx::query_scalar(AssertSqlSafe(self.inner.sql.queues.as_str()))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        names
            .into_iter()
            .map(|name| QueueName::new(name).map_err(Into::into))
            .collect()
    }

    fn for_queue(&self, queue: QueueName) -> Self {
        let inner = &self.inner;
        SqliteQueue {
            inner: Arc::new(Inner {
                pool: inner.pool.clone(),
                config: SqliteQueueConfig {
                    queue,
                    ..inner.config.clone()
                },
                path: inner.path.clone(),
                sql: inner.sql.clone(),
                wake: inner.wake.clone(),
            }),
        }
    }

    async fn throughput(&self, minutes: u32) -> queue_core::Result<Vec<MinuteCounts>> {
        let minutes = i64::from(minutes.clamp(1, 1_440));
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.throughput.as_str()))
            .bind(self.queue_str())
            .bind(minutes)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        let db = SqliteError::Database;
        let current: i64 = match rows.first() {
            Some(row) => row.try_get("current").map_err(db)?,
            None => return Err(SqliteError::Database(sqlx::Error::RowNotFound).into()),
        };
        let first = current - minutes + 1;
        let mut out = Vec::with_capacity(minutes as usize);
        for m in first..=current {
            out.push(MinuteCounts {
                minute: instant(-1, (m * 60) as f64)?,
                finished: FinishedCounts::default(),
            });
        }
        for row in rows {
            let Some(minute) = row.try_get::<Option<i64>, _>("minute").map_err(db)? else {
                continue;
            };
            let status: String = row.try_get("status").map_err(db)?;
            let jobs: i64 = row.try_get("jobs").map_err(db)?;
            if let Some(slot) = usize::try_from(minute - first)
                .ok()
                .and_then(|i| out.get_mut(i))
            {
                slot.finished
                    .add(status_of(-1, &status)?, jobs.max(0) as u64);
            }
        }
        Ok(out)
    }

    // A claim holds the write lock for its whole transaction, and a pause waits for it: once
    // the pause committed, no claim that read the queue as running is still running. Nothing to
    // wait for.
    async fn settle_claims(&self) -> queue_core::Result<()> {
        Ok(())
    }
}

impl SqliteQueue {
    async fn set_paused(&self, paused: bool) -> Result<QueueControl, SqliteError> {
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.pause.as_str()))
            .bind(self.queue_str())
            .bind(paused)
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        queue_core::events::queue_paused(&self.inner.config.queue, paused);
        control_of(Some(&row))
    }
}
