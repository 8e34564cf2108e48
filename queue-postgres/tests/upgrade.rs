//! The legacy upgrade on a real PostgreSQL: it heals what the old claim stranded, ends on the
//! same schema as a table created new, retries its short lock, repairs an index a failed build
//! left invalid, and keeps a live table readable and writable on a million rows.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use queue_core::{Backend, ClaimGeneration, ClaimRequest, Lease, QueueName};
use queue_postgres::{
    LegacyUpgrade, PgError, PgQueueConfig, PostgresQueue, TableName, UpgradePhase, UpgradeProgress,
};
use sqlx::PgPool;
use support::{TestDb, TestDriver};

per_driver!(
    schema_check_rejects_a_legacy_table_and_the_upgrade_heals_its_stranded_rows,
    the_upgraded_table_has_the_schema_of_a_table_created_new,
    an_alter_that_cannot_get_its_lock_gives_up_and_changes_nothing,
    an_index_left_invalid_by_a_failed_build_is_refused_then_rebuilt,
    the_upgrade_reaches_every_id_and_refuses_what_it_cannot_finish,
    an_upgrade_its_caller_drops_goes_on_and_then_lets_go_of_its_lock,
);

/// An adopter's own queue table before the lease, in the pre-lease pattern ADR 0001 describes:
/// status + attempts + `next_attempt_at`, a stuck-job index for a boot-time sweep, no claim stamp,
/// and a domain column of its own. A made-up fixture for the generic upgrade; the exchange's
/// real legacy table is upgraded through its real migrations in queue-examples' tests.
const PRE_LEASE_TABLE: &str = r#"
CREATE TABLE invoice_jobs (
    id              bigserial PRIMARY KEY,
    invoice_id      bigint      NOT NULL,
    status          text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX invoice_jobs_stuck ON invoice_jobs (next_attempt_at) WHERE status = 'in_flight';
"#;

/// What the old claim left behind: two jobs in flight with no claim stamp, one pending, one
/// completed.
const STRANDED_ROWS: &str = r#"
INSERT INTO invoice_jobs (invoice_id, status, attempts, next_attempt_at) VALUES
    (1, 'in_flight', 1, now() - interval '2 hours'),
    (2, 'in_flight', 3, now() - interval '1 hour'),
    (3, 'pending',   0, now() - interval '5 minutes'),
    (4, 'completed', 1, now() - interval '1 day');
"#;

fn table() -> TableName {
    TableName::new("invoice_jobs").unwrap()
}

fn queue_name() -> QueueName {
    QueueName::new("invoices").unwrap()
}

fn upgrade() -> LegacyUpgrade {
    LegacyUpgrade::new(table(), queue_name())
        .retire_index("invoice_jobs_stuck")
        .unwrap()
}

async fn legacy_db(rows: &str) -> TestDb {
    let db = TestDb::empty().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("{PRE_LEASE_TABLE}{rows}")))
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

async fn indexes(pool: &PgPool, table: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT indexname::text FROM pg_indexes WHERE tablename = $1 ORDER BY 1")
        .bind(table)
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn schema_check_rejects_a_legacy_table_and_the_upgrade_heals_its_stranded_rows<
    D: TestDriver,
>() {
    let db = legacy_db(STRANDED_ROWS).await;
    let config = PgQueueConfig::new(table(), queue_name());

    let err = support::connect::<D>(&db, config.clone())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, PgError::Schema { .. }), "{err}");
    for named in [
        "column claimed_at",
        "column claim_generation",
        "index invoice_jobs_expiry_idx",
    ] {
        assert!(
            text.contains(named),
            "the refusal must name {named:?}: {text}"
        );
    }

    let pool = support::pool::<D>(&db, 2);
    let mut seen = Vec::new();
    let report =
        PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |p| seen.push(p.phase))
            .await
            .unwrap();
    assert!(report.columns_added);
    assert_eq!(report.rows_stamped, 1, "the completed row gets finished_at");
    assert_eq!(report.indexes_built.len(), 7, "{report:?}");
    assert_eq!(report.indexes_retired, ["invoice_jobs_stuck"]);
    seen.dedup();
    assert_eq!(
        seen,
        [
            UpgradePhase::Columns,
            UpgradePhase::Backfill,
            UpgradePhase::Indexes,
            UpgradePhase::RetireIndexes,
            UpgradePhase::TableMigrations
        ]
    );
    let names = indexes(&db.pool, "invoice_jobs").await;
    assert!(
        !names.iter().any(|i| i.contains("stuck")),
        "the old stuck index survived: {names:?}"
    );
    let unstamped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM invoice_jobs WHERE status = 'in_flight' AND claimed_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(unstamped, 2, "the upgrade must not backfill claimed_at");

    let queue = support::connect::<D>(&db, config)
        .await
        .expect("upgraded table passes");
    let claimed = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert_eq!(
        claimed.len(),
        3,
        "stranded in-flight rows are re-claimable at once"
    );
    let legacy: Vec<_> = claimed.iter().filter(|j| j.reclaims == 1).collect();
    assert_eq!(legacy.len(), 2);
    assert!(legacy.iter().all(|j| j.generation == ClaimGeneration(1)));

    // Run again, every phase finds its work done: no lock on the table taken, nothing built
    // or stamped (the later table migrations run again on the companion tables).
    let again = PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |_| {})
        .await
        .unwrap();
    assert!(!again.columns_added);
    assert_eq!(again.rows_stamped, 0);
    assert!(again.indexes_built.is_empty(), "{again:?}");
    db.drop_db().await;
}

/// `(column, type, not null)` and the index definitions with the table's name taken out.
async fn shape(pool: &PgPool, table: &str) -> (Vec<(String, String, bool)>, Vec<String>) {
    let columns = sqlx::query_as(
        "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull
         FROM pg_attribute a
         WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
         ORDER BY 1",
    )
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap();
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT replace(pg_get_indexdef(i.indexrelid), $1, 'T')
         FROM pg_index i WHERE i.indrelid = to_regclass($1) AND NOT i.indisprimary
         ORDER BY 1",
    )
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap();
    (columns, indexes)
}

async fn the_upgraded_table_has_the_schema_of_a_table_created_new<D: TestDriver>() {
    let db = legacy_db("").await;
    let pool = support::pool::<D>(&db, 2);
    PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |_| {})
        .await
        .unwrap();
    let fresh = TableName::new("fresh_jobs").unwrap();
    PostgresQueue::<D>::install_table(&pool, &fresh)
        .await
        .unwrap();
    let (mut upgraded_columns, upgraded_indexes) = shape(&db.pool, "invoice_jobs").await;
    let (fresh_columns, fresh_indexes) = shape(&db.pool, "fresh_jobs").await;
    // The legacy table keeps its own domain column.
    upgraded_columns.retain(|(name, _, _)| name != "invoice_id");
    assert_eq!(upgraded_columns, fresh_columns);
    assert_eq!(upgraded_indexes, fresh_indexes);
    db.drop_db().await;
}

/// A legacy table with no rows, brought to the lease schema by the upgrade, and a pool of two
/// connections on its database (the upgrade's advisory lock holds one).
async fn upgraded_legacy_db() -> (TestDb, sqlx::PgPool) {
    let db = legacy_db("").await;
    let pool = support::pool::<queue_postgres::Sqlx>(&db, 2);
    PostgresQueue::<queue_postgres::Sqlx>::upgrade_legacy_table(&pool, &upgrade(), |_| {})
        .await
        .unwrap();
    (db, pool)
}

/// A table the legacy upgrade of an earlier release brought to the lease schema, before room
/// grants (table migration 20261212000001) and their fence (20261213000001): the schema check
/// names both migrations, and running the upgrade again adds their objects (the columns phase
/// is not skipped while a companion is missing, and the fence is a step of its own), after
/// which the grants' triggers work on the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_run_again_adds_what_later_migrations_brought() {
    type D = queue_postgres::Sqlx;
    let (db, pool) = upgraded_legacy_db().await;
    sqlx::raw_sql(
        "DROP TRIGGER invoice_jobs_grants_fence ON invoice_jobs_queues;
         DROP FUNCTION invoice_jobs_grants_fence();
         DROP TRIGGER invoice_jobs_grants_switch ON invoice_jobs_queues;
         DROP FUNCTION invoice_jobs_grants_switch();
         ALTER TABLE invoice_jobs_queues DROP COLUMN grants_counted;
         DROP TABLE invoice_jobs_grants;
         DROP TRIGGER invoice_jobs_grants_reset ON invoice_jobs_queues;
         DROP TRIGGER invoice_jobs_grants_gone ON invoice_jobs_queues;
         DROP FUNCTION invoice_jobs_grants_reset();
         ALTER TABLE invoice_jobs_queues DROP COLUMN room_grants;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let err = PostgresQueue::<D>::check_schema(&pool, &table())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("20261212000001"), "{err}");
    assert!(err.contains("20261213000001"), "{err}");
    let mut seen = Vec::new();
    PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |p| seen.push(p.phase))
        .await
        .unwrap();
    assert!(seen.contains(&UpgradePhase::TableMigrations), "{seen:?}");
    PostgresQueue::<D>::check_schema(&pool, &table())
        .await
        .unwrap();
    sqlx::raw_sql(
        "INSERT INTO invoice_jobs_queues (queue, max_in_flight, room_grants)
             VALUES ('invoices', 10, true);
         INSERT INTO invoice_jobs_grants (queue, jobs_left, claims_left, per_claim, expires_at)
             VALUES ('invoices', 2, 8, 1, now() + interval '1 second');
         UPDATE invoice_jobs_queues SET max_in_flight = 5;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let grants: i64 = sqlx::query_scalar("SELECT count(*) FROM invoice_jobs_grants")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        grants, 0,
        "the trigger deleted the grant when the limit changed"
    );
    // The fence is back: a write of the claims counter that does not say it counts grants
    // fails while the switch is on.
    let fenced = sqlx::raw_sql("UPDATE invoice_jobs_queues SET claims = claims + 1")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(
        fenced.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("QG001"),
        "{fenced}"
    );
    db.drop_db().await;
}

/// The backend process of a transaction that holds `ACCESS SHARE` on the table (a long read),
/// which the `ALTER` must wait for.
async fn hold_the_table(db: &TestDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM invoice_jobs")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

async fn an_alter_that_cannot_get_its_lock_gives_up_and_changes_nothing<D: TestDriver>() {
    let db = legacy_db(STRANDED_ROWS).await;
    let pool = support::pool::<D>(&db, 2);
    let holder = hold_the_table(&db).await;
    let timeout = Duration::from_millis(100);
    let careful = upgrade().lock_timeout(timeout).unwrap().lock_attempts(3);
    let err = PostgresQueue::<D>::upgrade_legacy_table(&pool, &careful, |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(err, PgError::LockNotAvailable { attempts: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("nothing changed"), "{err}");
    let claimed_at: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_attribute
         WHERE attrelid = 'invoice_jobs'::regclass AND attname = 'claimed_at'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(claimed_at, 0, "the refused upgrade added a column");

    // While an ALTER waits for its lock, a reader queues behind it: no longer than the timeout.
    let timeout = Duration::from_millis(600);
    let alter = {
        let pool = pool.clone();
        let careful = careful
            .clone()
            .lock_timeout(timeout)
            .unwrap()
            .lock_attempts(1);
        tokio::spawn(async move {
            PostgresQueue::<D>::upgrade_legacy_table(&pool, &careful, |_| {}).await
        })
    };
    wait_for_a_waiting_alter(&db).await;
    let started = Instant::now();
    sqlx::query("SELECT count(*) FROM invoice_jobs")
        .execute(&db.pool)
        .await
        .unwrap();
    let blocked = started.elapsed();
    assert!(alter.await.unwrap().is_err());
    assert!(
        blocked < timeout + Duration::from_millis(300),
        "a reader waited {blocked:?} behind an ALTER with a {timeout:?} lock_timeout"
    );

    // Once the table is free, the same upgrade goes through.
    holder.rollback().await.unwrap();
    let report = PostgresQueue::<D>::upgrade_legacy_table(&pool, &careful, |_| {})
        .await
        .unwrap();
    assert!(report.columns_added);
    db.drop_db().await;
}

/// An upgrade its caller stops waiting for (a timeout, an aborted task) goes on to its end,
/// holding the table's upgrade lock until its last step ended, and then lets go of it: a lock
/// left on a pooled connection would refuse every later upgrade as one in progress, and one
/// let go of early would let a second upgrade meet the first one's steps.
async fn an_upgrade_its_caller_drops_goes_on_and_then_lets_go_of_its_lock<D: TestDriver>() {
    let db = legacy_db(STRANDED_ROWS).await;
    let pool = support::pool::<D>(&db, 3);
    let holder = hold_the_table(&db).await;
    let patient = upgrade()
        .lock_timeout(Duration::from_secs(60))
        .unwrap()
        .lock_attempts(1);
    let running = {
        let (pool, patient) = (pool.clone(), patient.clone());
        tokio::spawn(async move {
            PostgresQueue::<D>::upgrade_legacy_table(&pool, &patient, |_| {}).await
        })
    };
    wait_for_a_waiting_alter(&db).await;
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    // Its ALTER still waits for the table: the upgrade holds its lock.
    let err = PostgresQueue::<D>::upgrade_legacy_table(&pool, &patient, |_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, PgError::UpgradeInProgress { .. }), "{err}");
    holder.rollback().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // pg_locks is the whole server's: this database's advisory locks only.
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks
             WHERE locktype = 'advisory'
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if held == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dropped upgrade kept its lock"
        );
        tokio::task::yield_now().await;
    }
    let stamped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM invoice_jobs WHERE status = 'completed' AND finished_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(stamped, 1, "the dropped upgrade ran to its end");
    PostgresQueue::<D>::upgrade_legacy_table(&pool, &patient, |_| {})
        .await
        .expect("the next upgrade is not refused as one in progress");
    db.drop_db().await;
}

/// Waits until an `ALTER TABLE` of the upgrade waits for its lock (seen in `pg_stat_activity`).
async fn wait_for_a_waiting_alter(db: &TestDb) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE 'ALTER TABLE%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        if Instant::now() > deadline {
            let activity: Vec<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT state, wait_event_type, left(query, 200) FROM pg_stat_activity
                 WHERE datname = current_database()",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap();
            panic!("the ALTER never waited: {activity:?}");
        }
        tokio::task::yield_now().await;
    }
}

async fn an_index_left_invalid_by_a_failed_build_is_refused_then_rebuilt<D: TestDriver>() {
    let db = legacy_db(STRANDED_ROWS).await;
    let pool = support::pool::<D>(&db, 2);
    let columns_only = LegacyUpgrade::new(table(), queue_name());
    PostgresQueue::<D>::upgrade_legacy_table(&pool, &columns_only, |_| {})
        .await
        .unwrap();
    // A concurrent build that fails (a unique index over duplicates) leaves its index invalid,
    // under the name of the due index.
    sqlx::query("DROP INDEX CONCURRENTLY invoice_jobs_due_idx")
        .execute(&db.pool)
        .await
        .unwrap();
    let failed = sqlx::query(
        "CREATE UNIQUE INDEX CONCURRENTLY invoice_jobs_due_idx ON invoice_jobs (queue)",
    )
    .execute(&db.pool)
    .await;
    assert!(failed.is_err(), "the build over duplicates must fail");

    let err = support::connect::<D>(&db, PgQueueConfig::new(table(), queue_name()))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("index invoice_jobs_due_idx is invalid"),
        "{err}"
    );
    let report = PostgresQueue::<D>::upgrade_legacy_table(&pool, &columns_only, |_| {})
        .await
        .unwrap();
    assert_eq!(report.invalid_indexes_dropped, ["invoice_jobs_due_idx"]);
    assert_eq!(report.indexes_built, ["invoice_jobs_due_idx"]);
    support::connect::<D>(&db, PgQueueConfig::new(table(), queue_name()))
        .await
        .expect("the rebuilt index passes the schema check");
    db.drop_db().await;
}

/// The slowest of a loop's operations, and how many it ran.
#[derive(Debug, Default, Clone, Copy)]
struct Latency {
    ops: u64,
    worst: Duration,
}

impl Latency {
    fn record(&mut self, started: Instant) {
        self.ops += 1;
        self.worst = self.worst.max(started.elapsed());
    }
}

/// A reader of the legacy release: point reads by id, as its API serves them.
async fn legacy_reader(pool: PgPool, max_id: i64, stop: Arc<AtomicBool>) -> Latency {
    let mut latency = Latency::default();
    while !stop.load(Ordering::Relaxed) {
        let id = fastrand::i64(1..=max_id);
        let started = Instant::now();
        let _: Option<String> = sqlx::query_scalar("SELECT status FROM invoice_jobs WHERE id = $1")
            .bind(id)
            .fetch_optional(&pool)
            .await
            .unwrap();
        latency.record(started);
    }
    latency
}

/// What the legacy writer did, to check afterwards that none of it was lost.
#[derive(Debug, Default)]
struct Written {
    latency: Latency,
    inserted: Vec<i64>,
    completed: Vec<i64>,
}

/// A writer of the legacy release: inserts jobs, claims them with its old claim and completes
/// them, one statement per step.
async fn legacy_writer(pool: PgPool, stop: Arc<AtomicBool>) -> Written {
    let mut written = Written::default();
    let mut n = 0i64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let started = Instant::now();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO invoice_jobs (invoice_id, status, next_attempt_at)
             VALUES ($1, 'pending', now() - interval '10 years') RETURNING id",
        )
        .bind(1_000_000 + n)
        .fetch_one(&pool)
        .await
        .unwrap();
        written.latency.record(started);
        written.inserted.push(id);
        let started = Instant::now();
        let claimed: Option<i64> = sqlx::query_scalar(
            "UPDATE invoice_jobs SET status = 'in_flight', attempts = attempts + 1
             WHERE id = (SELECT id FROM invoice_jobs WHERE id = $1 AND status = 'pending'
                         FOR UPDATE SKIP LOCKED)
             RETURNING id",
        )
        .bind(id)
        .fetch_optional(&pool)
        .await
        .unwrap();
        written.latency.record(started);
        let Some(claimed) = claimed else { continue };
        let started = Instant::now();
        sqlx::query("UPDATE invoice_jobs SET status = 'completed' WHERE id = $1")
            .bind(claimed)
            .execute(&pool)
            .await
            .unwrap();
        written.latency.record(started);
        written.completed.push(claimed);
    }
    written
}

const LARGE_ROWS: i64 = 1_000_000;

/// The upgrade of a table of a million rows while the legacy release reads and writes it: no
/// reader or writer is held up for a second, nothing they wrote is lost or changed, and every
/// terminal row that was there before ends with `finished_at`. Prints the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_million_row_upgrade_keeps_the_legacy_release_reading_and_writing() {
    let db = legacy_db("").await;
    // A legacy backlog: mostly completed, some failed, pending and stranded in flight.
    sqlx::query(
        "INSERT INTO invoice_jobs (invoice_id, status, attempts, next_attempt_at)
         SELECT g,
                CASE WHEN g % 100 = 0 THEN 'pending' WHEN g % 100 = 1 THEN 'in_flight'
                     WHEN g % 100 = 2 THEN 'failed' ELSE 'completed' END,
                1, now() - interval '1 day'
         FROM generate_series(1, $1) AS g",
    )
    .bind(LARGE_ROWS)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE invoice_jobs")
        .execute(&db.pool)
        .await
        .unwrap();
    let terminal_before: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM invoice_jobs WHERE status IN ('completed', 'failed')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn(legacy_reader(
        support::pool::<queue_postgres::Sqlx>(&db, 1),
        LARGE_ROWS,
        stop.clone(),
    ));
    let writer = tokio::spawn(legacy_writer(
        support::pool::<queue_postgres::Sqlx>(&db, 1),
        stop.clone(),
    ));

    let pool = support::pool::<queue_postgres::Sqlx>(&db, 2);
    let mut backfill_reports = 0u32;
    let started = Instant::now();
    let report = PostgresQueue::<queue_postgres::Sqlx>::upgrade_legacy_table(
        &pool,
        &upgrade(),
        |p: &UpgradeProgress| {
            if p.phase == UpgradePhase::Backfill {
                backfill_reports += 1;
            }
        },
    )
    .await
    .unwrap();
    let upgrade_time = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let read = reader.await.unwrap();
    let written = writer.await.unwrap();

    println!(
        "legacy upgrade of {LARGE_ROWS} rows: {upgrade_time:?} ({:?}); reader {} reads, longest \
         {:?}; writer {} statements, longest {:?}; {} rows stamped, {} lock retries",
        report.phase_times,
        read.ops,
        read.worst,
        written.latency.ops,
        written.latency.worst,
        report.rows_stamped,
        report.lock_retries,
    );
    assert!(read.ops > 100 && written.latency.ops > 100, "the load ran");
    assert!(
        backfill_reports > 50,
        "the backfill reports progress per batch"
    );
    assert!(
        read.worst < Duration::from_secs(1),
        "a reader was held up {:?}",
        read.worst
    );
    assert!(
        written.latency.worst < Duration::from_secs(1),
        "a writer was held up {:?}",
        written.latency.worst
    );
    assert!(report.rows_stamped >= terminal_before as u64);

    // Nothing the legacy release wrote is lost or changed.
    let inserted: i64 = sqlx::query_scalar("SELECT count(*) FROM invoice_jobs WHERE id = ANY($1)")
        .bind(&written.inserted)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(inserted, written.inserted.len() as i64);
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM invoice_jobs WHERE id = ANY($1) AND status = 'completed'",
    )
    .bind(&written.completed)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(completed, written.completed.len() as i64);
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM invoice_jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, LARGE_ROWS + written.inserted.len() as i64);
    // Every row that was terminal before the upgrade can be reached by retention.
    let unstamped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM invoice_jobs
         WHERE id <= $1 AND status IN ('completed', 'failed') AND finished_at IS NULL",
    )
    .bind(LARGE_ROWS)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(unstamped, 0);
    // The legacy rows belong to the queue, and the table passes the schema check.
    let queued: i64 =
        sqlx::query_scalar("SELECT count(*) FROM invoice_jobs WHERE queue = 'invoices'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(queued, total);
    PostgresQueue::<queue_postgres::Sqlx>::check_schema(&pool, &table())
        .await
        .unwrap();
    db.drop_db().await;
}

/// Ids of zero and below are backfilled too; a table the upgrade cannot finish (an `integer`
/// id, a lease column of another type) is refused before anything changes; a second upgrade of
/// the same table while one runs is refused.
async fn the_upgrade_reaches_every_id_and_refuses_what_it_cannot_finish<D: TestDriver>() {
    let db = legacy_db(
        "INSERT INTO invoice_jobs (id, invoice_id, status) VALUES
            (-5, 1, 'completed'), (0, 2, 'failed'), (9, 3, 'completed');",
    )
    .await;
    let pool = support::pool::<D>(&db, 2);

    // Another runner holds the table's upgrade lock: refused, nothing done.
    let mut other = db.pool.acquire().await.unwrap();
    let held: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtext('queue_framework.upgrade'), hashtext('invoice_jobs'))",
    )
    .fetch_one(&mut *other)
    .await
    .unwrap();
    assert!(held);
    let err = PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, PgError::UpgradeInProgress { .. }), "{err}");
    // The other runner finishes and lets go of its lock.
    let released: bool = sqlx::query_scalar(
        "SELECT pg_advisory_unlock(hashtext('queue_framework.upgrade'), hashtext('invoice_jobs'))",
    )
    .fetch_one(&mut *other)
    .await
    .unwrap();
    assert!(released);
    drop(other);

    let report = PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |_| {})
        .await
        .unwrap();
    assert_eq!(
        report.rows_stamped, 3,
        "every terminal row, whatever its id"
    );

    // An integer id, or a lease column already there with another type: refused up front.
    sqlx::raw_sql(
        "CREATE TABLE small_jobs (id serial PRIMARY KEY, status text NOT NULL, attempts integer,
                                  next_attempt_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE odd_jobs (id bigserial PRIMARY KEY, status text NOT NULL, attempts integer,
                                next_attempt_at timestamptz NOT NULL DEFAULT now(),
                                claimed_at text);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for (name, named) in [
        ("small_jobs", "column id must be bigint, found integer"),
        (
            "odd_jobs",
            "column claimed_at must be timestamp with time zone, found text",
        ),
    ] {
        let upgrade = LegacyUpgrade::new(TableName::new(name).unwrap(), queue_name());
        let err = PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains(named), "{name}: {err}");
        let columns: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0",
        )
        .bind(name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(columns <= 5, "{name} was changed before the refusal");
    }
    db.drop_db().await;
}

/// A trigger of room grants dropped by hand from a table the upgrade brought to the lease
/// schema (its columns all there): the schema check names it, and running the upgrade again
/// brings it back (the columns phase is not skipped while a trigger it creates is missing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_run_again_brings_back_a_trigger_dropped_by_hand() {
    type D = queue_postgres::Sqlx;
    let (db, pool) = upgraded_legacy_db().await;
    sqlx::raw_sql("DROP TRIGGER invoice_jobs_grants_reset ON invoice_jobs_queues")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = PostgresQueue::<D>::check_schema(&pool, &table())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("trigger invoice_jobs_grants_reset") && err.contains("20261212000001"),
        "{err}"
    );
    let report = PostgresQueue::<D>::upgrade_legacy_table(&pool, &upgrade(), |_| {})
        .await
        .unwrap();
    assert!(report.columns_added, "the columns phase ran again");
    PostgresQueue::<D>::check_schema(&pool, &table())
        .await
        .unwrap();
    db.drop_db().await;
}
