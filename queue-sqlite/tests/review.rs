//! Review: demonstrations of defects (temporary file).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use queue_core::{
    Admin, Backend, BoxError, ClaimRequest, Finalize, FinalizeEvent, FinalizeHook, FinalizeOutcome,
    Hooks, JobFilter, JobId, JobStatus, Lease, NewJob, PurgeRequest,
};
use queue_sqlite::{OpenOptions, SqliteQueue, SqliteQueueConfig, SqliteTx, TableName};
use serde_json::{Value, json};

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("queue-sqlite-review-{name}-{}", std::process::id()));
        let _ = std::process::Command::new("chattr")
            .arg("-R")
            .arg("-i")
            .arg(&dir)
            .status();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn db(&self) -> PathBuf {
        self.0.join("queue.db")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .arg("-R")
            .arg("-i")
            .arg(&self.0)
            .status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn queue_at(path: &Path, options: &OpenOptions) -> SqliteQueue {
    let pool = queue_sqlite::open_pool(path, options).await.expect("open");
    queue_sqlite::migrate(&pool).await.expect("migrate");
    SqliteQueue::connect(pool, SqliteQueueConfig::default())
        .await
        .expect("connect")
}

fn lease() -> Lease {
    Lease::from_secs(30).unwrap()
}

/// Several worker processes start at once on a fresh file, each running `migrate` as the crate
/// docs show: all must succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_concurrent_migrate_on_a_fresh_file() {
    for round in 0..5 {
        let scratch = Scratch::new(&format!("migrate{round}"));
        let mut pools = Vec::new();
        for _ in 0..6 {
            pools.push(
                queue_sqlite::open_pool(scratch.db(), &OpenOptions::default())
                    .await
                    .unwrap(),
            );
        }
        let tasks: Vec<_> = pools
            .into_iter()
            .map(|pool| tokio::spawn(async move { queue_sqlite::migrate(&pool).await }))
            .collect();
        for task in tasks {
            let result = task.await.unwrap();
            if let Err(err) = result {
                let text = err.to_string();
                let core: queue_core::Error = err.into();
                panic!(
                    "round {round}: a concurrent migrate failed: {text} (transient: {})",
                    core.is_transient()
                );
            }
        }
    }
}

/// A hand-made table without AUTOINCREMENT passes the schema check; after a purge the id is
/// reused and a stale holder's (id, generation) fence matches a different job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_recycled_id_lets_a_stale_fence_apply_to_another_job() {
    let scratch = Scratch::new("recycle");
    let pool = queue_sqlite::open_pool(scratch.db(), &OpenOptions::default())
        .await
        .unwrap();
    let ddl = queue_sqlite::create_table_sql(&TableName::default()).replace(" AUTOINCREMENT", "");
    sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
        .execute(&pool)
        .await
        .unwrap();
    let queue = SqliteQueue::connect(pool, SqliteQueueConfig::default())
        .await
        .expect("the schema check accepts a table whose ids are recycled");
    let first = queue
        .enqueue(NewJob::new(&json!({"job": "A"})).unwrap())
        .await
        .unwrap()
        .id;
    // Worker A claims (generation 1) and stalls past its lease.
    let a = queue
        .claim(ClaimRequest::new(1, lease()))
        .await
        .unwrap()
        .jobs
        .remove(0);
    sqlx::query("UPDATE queue_jobs SET lease_expires_at = lease_expires_at - 60")
        .execute(queue.pool())
        .await
        .unwrap();
    // Worker B takes it over (generation 2) and completes it; an operator purges completed jobs.
    let b = queue
        .claim(ClaimRequest::new(1, lease()))
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!(
        queue
            .finalize(b.claim(), &Finalize::Complete)
            .await
            .unwrap(),
        FinalizeOutcome::Applied
    );
    sqlx::query("UPDATE queue_jobs SET finished_at = finished_at - 60")
        .execute(queue.pool())
        .await
        .unwrap();
    let purge = PurgeRequest::new(&[JobStatus::Completed], Duration::from_secs(1)).unwrap();
    assert_eq!(queue.purge_batch(&purge).await.unwrap(), 1);
    // A new, unrelated job gets the same id and its first claim is generation 1 again.
    let second = queue
        .enqueue(NewJob::new(&json!({"job": "B"})).unwrap())
        .await
        .unwrap()
        .id;
    let c = queue
        .claim(ClaimRequest::new(1, lease()))
        .await
        .unwrap()
        .jobs
        .remove(0);
    println!(
        "first {first:?} second {second:?}; A {:?} C {:?}",
        a.claim(),
        c.claim()
    );
    // A wakes up and fails "its" job: the fence must refuse it.
    let late = queue
        .finalize(
            a.claim(),
            &Finalize::Fail {
                error: "A's late failure".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        late,
        FinalizeOutcome::Stale,
        "A's stale write ended C's job"
    );
}

/// The keyset listing: a deep page must cost what the first page costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_deep_list_page_scans_the_table() {
    let scratch = Scratch::new("list");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500000)
         INSERT INTO queue_jobs (queue, status, finished_at) SELECT 'default', 'completed', unixepoch('subsec') FROM n;
         ANALYZE;",
    )
    .execute(queue.pool()).await.unwrap();
    let time = |filter: JobFilter| {
        let queue = queue.clone();
        async move {
            let started = Instant::now();
            let page = queue.list_jobs(&filter).await.unwrap();
            (started.elapsed(), page.jobs.len())
        }
    };
    let (first, n1) = time(JobFilter::new()).await;
    let (deep, n2) = time(JobFilter::new().before(JobId(60))).await;
    let rows = sqlx::query(
        "EXPLAIN QUERY PLAN SELECT id FROM \"queue_jobs\" WHERE queue = ?1 AND (?2 IS NULL OR id < ?2) ORDER BY id DESC LIMIT ?3",
    )
    .bind("default").bind(60_i64).bind(51_i64)
    .fetch_all(queue.pool()).await.unwrap();
    let plan: Vec<String> = rows
        .iter()
        .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
        .collect();
    println!("first page {first:?} ({n1}), page before id 60 {deep:?} ({n2}); plan {plan:?}");
    assert!(
        plan.iter().any(|step| step.contains("rowid<?")),
        "a deep page scans the table: {plan:?}, {deep:?} vs {first:?}"
    );
}

/// A payload that is not JSON: get() says Corrupt, the claim hands the handler `null`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_claim_turns_a_corrupt_payload_into_null() {
    let scratch = Scratch::new("payload");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    sqlx::query("INSERT INTO queue_jobs (queue, payload) VALUES ('default', '{\"card\": 41')")
        .execute(queue.pool())
        .await
        .unwrap();
    let got = queue.get(JobId(1)).await;
    println!("get: {got:?}");
    assert!(got.is_err());
    let job = queue
        .claim(ClaimRequest::new(1, lease()))
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_ne!(
        job.payload,
        Value::Null,
        "the handler was given null for a payload it never saw"
    );
}

struct RollbackHook;

impl FinalizeHook<SqliteTx, Value> for RollbackHook {
    async fn after_applied(
        &self,
        tx: &mut SqliteTx,
        _: &FinalizeEvent<'_, Value>,
    ) -> Result<(), BoxError> {
        // An outbox insert whose conflict clause is ROLLBACK (or a trigger's RAISE(ROLLBACK)),
        // or any error after which SQLite rolls the transaction back on its own (SQLITE_FULL,
        // SQLITE_IOERR, SQLITE_NOMEM, an interrupt).
        sqlx::query("INSERT OR ROLLBACK INTO outbox (k) VALUES ('dup')")
            .execute(tx.conn())
            .await?;
        Ok(())
    }
}

/// After SQLite rolled a transaction back on its own, the pooled connection must still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r5_a_transaction_sqlite_rolled_back_poisons_the_pooled_connection() {
    let scratch = Scratch::new("poison");
    let options = OpenOptions {
        max_connections: 1,
        ..OpenOptions::default()
    };
    let queue = queue_at(&scratch.db(), &options).await;
    sqlx::raw_sql("CREATE TABLE outbox (k TEXT PRIMARY KEY); INSERT INTO outbox VALUES ('dup');")
        .execute(queue.pool())
        .await
        .unwrap();
    for n in 0..3 {
        queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
    }
    let job = queue
        .claim(ClaimRequest::new(1, lease()))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let hooks: Hooks<SqliteTx, Value> = Hooks::new().with(RollbackHook);
    let err = queue_core::finalize_with_hooks(&queue, &hooks, &job, &Finalize::Complete)
        .await
        .unwrap_err();
    println!("hook error (expected): {err}");
    let next = queue.claim(ClaimRequest::new(1, lease())).await;
    println!("next claim: {next:?}");
    assert!(
        next.is_ok(),
        "every later transaction on the connection fails"
    );
}

/// A database in a directory the process cannot write (no -wal/-shm can be created).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r6_read_only_directory_and_file() {
    let scratch = Scratch::new("rodir");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    queue.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    queue.pool().close().await;
    drop(queue);
    let status = std::process::Command::new("chattr")
        .arg("+i")
        .arg(&scratch.0)
        .status()
        .unwrap();
    assert!(status.success());
    let default = queue_sqlite::open_pool(scratch.db(), &OpenOptions::default()).await;
    println!(
        "read-only dir, default options: {:?}",
        default.as_ref().map(|_| ())
    );
    let ro = queue_sqlite::open_pool(
        scratch.db(),
        &OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .await;
    println!("read-only dir, read_only: {:?}", ro.as_ref().map(|_| ()));
    if let Ok(pool) = ro {
        let q = SqliteQueue::connect(pool, SqliteQueueConfig::default()).await;
        println!("connect: {:?}", q.as_ref().map(|_| ()));
        if let Ok(q) = q {
            println!("counts: {:?}", q.counts().await);
        }
    }
    std::process::Command::new("chattr")
        .arg("-i")
        .arg(&scratch.0)
        .status()
        .unwrap();
    // The file itself immutable, its directory writable.
    std::process::Command::new("chattr")
        .arg("+i")
        .arg(scratch.db())
        .status()
        .unwrap();
    let file = queue_sqlite::open_pool(scratch.db(), &OpenOptions::default()).await;
    println!(
        "read-only file, default options: {:?}",
        file.as_ref().map(|_| ())
    );
    if let Ok(pool) = file.as_ref().cloned() {
        let q = SqliteQueue::connect(pool, SqliteQueueConfig::default())
            .await
            .unwrap();
        let e = q.enqueue(NewJob::new(&2).unwrap()).await;
        println!("enqueue on the immutable file: {e:?}");
        let c = q.claim(ClaimRequest::new(5, lease())).await;
        println!("claim on the immutable file: {c:?}");
        q.pool().close().await;
    }
    std::process::Command::new("chattr")
        .arg("-i")
        .arg(scratch.db())
        .status()
        .unwrap();
    assert!(
        file.is_err(),
        "open_pool accepted a read-only file (refused only at the first write)"
    );
    match default {
        Err(queue_sqlite::SqliteError::Open {
            reason: queue_sqlite::OpenFailure::ReadOnly,
            ..
        }) => {}
        other => panic!("a read-only directory: {:?}", other.map(|_| ())),
    }
}

struct FullHook;

impl FinalizeHook<SqliteTx, Value> for FullHook {
    async fn after_applied(
        &self,
        tx: &mut SqliteTx,
        _: &FinalizeEvent<'_, Value>,
    ) -> Result<(), BoxError> {
        // The disk fills up while the hook writes its outbox row.
        let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
            .fetch_one(tx.conn())
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "PRAGMA max_page_count = {}",
            pages + 2
        )))
        .execute(tx.conn())
        .await?;
        let r = sqlx::query("INSERT INTO outbox (k) SELECT hex(randomblob(100000)) FROM (SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3)")
            .execute(tx.conn())
            .await;
        let auto: bool = tx
            .conn()
            .lock_handle()
            .await
            .map(|mut h| h.as_raw_handle().as_ptr() as usize != 0)
            .unwrap_or(false);
        let _ = auto;
        r?;
        Ok(())
    }
}

/// The same with SQLITE_FULL (a full disk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r5b_a_full_disk_in_a_hook() {
    let scratch = Scratch::new("full");
    let options = OpenOptions {
        max_connections: 1,
        ..OpenOptions::default()
    };
    let queue = queue_at(&scratch.db(), &options).await;
    sqlx::raw_sql("CREATE TABLE outbox (k TEXT PRIMARY KEY)")
        .execute(queue.pool())
        .await
        .unwrap();
    for n in 0..3 {
        queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
    }
    let job = queue
        .claim(ClaimRequest::new(1, lease()))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let hooks: Hooks<SqliteTx, Value> = Hooks::new().with(FullHook);
    let err = queue_core::finalize_with_hooks(&queue, &hooks, &job, &Finalize::Complete)
        .await
        .unwrap_err();
    println!("hook error (expected): {err}");
    let next = queue.claim(ClaimRequest::new(1, lease())).await;
    println!("next claim: {next:?}");
    assert!(
        next.is_ok(),
        "every later transaction on the connection fails"
    );
}

async fn plan(queue: &SqliteQueue, sql: &str, binds: &[&str]) -> Vec<String> {
    let text = format!("EXPLAIN QUERY PLAN {sql}");
    let mut q = sqlx::query(sqlx::AssertSqlSafe(text));
    for b in binds {
        q = q.bind(b.to_string());
    }
    let rows = q.fetch_all(queue.pool()).await.unwrap();
    rows.iter()
        .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r7_plans_and_costs() {
    let scratch = Scratch::new("plans");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300000)
         INSERT INTO queue_jobs (queue, status, finished_at) SELECT 'q' || (i % 50), 'completed', unixepoch('subsec') FROM n;
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
         INSERT INTO queue_jobs (queue, status, claimed_at, lease_expires_at, claim_generation, attempts)
             SELECT 'default', 'in_flight', unixepoch('subsec'), unixepoch('subsec') + 3600, 1, 1 FROM n;
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
         INSERT INTO queue_jobs (queue, status) SELECT 'p' || (i % 20), 'pending' FROM n;
         ANALYZE;",
    )
    .execute(queue.pool()).await.unwrap();
    let expired = "SELECT id FROM queue_jobs INDEXED BY queue_jobs_expiry_idx WHERE queue = ?1 AND status = 'in_flight' AND (lease_expires_at IS NULL OR lease_expires_at < unixepoch('subsec')) ORDER BY lease_expires_at LIMIT 10";
    println!(
        "expired pick: {:?}",
        plan(&queue, expired, &["default"]).await
    );
    let started = Instant::now();
    let batch = queue.claim(ClaimRequest::new(10, lease())).await.unwrap();
    println!(
        "claim with 20k live in-flight leases and nothing due: {:?} ({} jobs)",
        started.elapsed(),
        batch.jobs.len()
    );
    let started = Instant::now();
    let queues = queue.queues().await.unwrap();
    println!(
        "queues(): {:?} ({} queues)",
        started.elapsed(),
        queues.len()
    );
    let started = Instant::now();
    let page = queue
        .for_queue(queue_core::QueueName::new("q7").unwrap())
        .list_jobs(&JobFilter::new().status(JobStatus::Dead))
        .await
        .unwrap();
    println!(
        "dead listing of q7: {:?} ({})",
        started.elapsed(),
        page.jobs.len()
    );
    let started = Instant::now();
    let t = queue.throughput(60).await.unwrap();
    println!("throughput(60): {:?} ({})", started.elapsed(), t.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r8_claim_cost_with_large_payloads() {
    let scratch = Scratch::new("big");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    let big = "x".repeat(1_000_000);
    for _ in 0..60 {
        queue.enqueue(NewJob::new(&big).unwrap()).await.unwrap();
    }
    let started = Instant::now();
    let rows = sqlx::query(sqlx::AssertSqlSafe(queue_sqlite::pick_sql(
        &TableName::default(),
    )))
    .bind("default")
    .bind(50_i64)
    .fetch_all(queue.pool())
    .await
    .unwrap();
    println!(
        "pick alone of 50 x 1 MB: {:?} ({})",
        started.elapsed(),
        rows.len()
    );
    let started = Instant::now();
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM queue_jobs WHERE status = 'pending' ORDER BY next_attempt_at LIMIT 50",
    )
    .fetch_all(queue.pool())
    .await
    .unwrap();
    println!("id-only select: {:?} ({})", started.elapsed(), ids.len());
    let started = Instant::now();
    let batch = queue.claim(ClaimRequest::new(50, lease())).await.unwrap();
    println!(
        "claim 50 x 1 MB: {:?} ({})",
        started.elapsed(),
        batch.jobs.len()
    );
}

/// The listing of dead jobs of a queue that has few: it must read the failed index, not the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r9_dead_listing_scans_the_table() {
    let scratch = Scratch::new("dead");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500000)
         INSERT INTO queue_jobs (queue, status, finished_at) SELECT 'default', 'completed', unixepoch('subsec') FROM n;
         INSERT INTO queue_jobs (queue, status, finished_at) VALUES ('default', 'dead', unixepoch('subsec'));
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500000)
         INSERT INTO queue_jobs (queue, status, finished_at) SELECT 'default', 'completed', unixepoch('subsec') FROM n;
         ANALYZE;",
    )
    .execute(queue.pool()).await.unwrap();
    let sql = "SELECT id FROM \"queue_jobs\" WHERE queue = ?1 AND status IN ('dead') AND (?2 IS NULL OR id < ?2) ORDER BY id DESC LIMIT 51";
    let p = plan(&queue, sql, &["default"]).await;
    let started = Instant::now();
    let page = queue
        .list_jobs(&JobFilter::new().status(JobStatus::Dead))
        .await
        .unwrap();
    let took = started.elapsed();
    println!(
        "dead listing: {took:?} ({} jobs), plan {p:?}",
        page.jobs.len()
    );
    assert_eq!(page.jobs.len(), 1);
    assert!(
        p.iter().any(|s| s.contains("queue_jobs_failed_idx")),
        "{p:?} {took:?}"
    );
}

/// migrate() while another process holds the write lock past the busy timeout: a transient Busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r10_migrate_under_a_held_lock_is_not_transient() {
    let scratch = Scratch::new("migbusy");
    let patient = OpenOptions {
        busy_timeout: Duration::from_millis(200),
        ..OpenOptions::default()
    };
    let holder_pool = queue_sqlite::open_pool(scratch.db(), &patient)
        .await
        .unwrap();
    let pool = queue_sqlite::open_pool(scratch.db(), &patient)
        .await
        .unwrap();
    let mut holder = holder_pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let err = queue_sqlite::migrate(&pool).await.unwrap_err();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
    println!(
        "migrate under a held lock: {err} / {err:?}; is_transient {}",
        err.is_transient()
    );
    assert!(err.is_transient(), "{err}");
}

/// An absurd busy timeout is not refused: sqlx panics in its connection thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r11_busy_timeout_out_of_range() {
    let scratch = Scratch::new("timeout");
    let options = OpenOptions {
        busy_timeout: Duration::from_secs(30 * 24 * 3600),
        ..OpenOptions::default()
    };
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        queue_sqlite::open_pool(scratch.db(), &options),
    )
    .await;
    println!(
        "open_pool with a 30-day busy timeout: {:?}",
        r.as_ref().map(|r| r.as_ref().map(|_| ()))
    );
    assert!(
        matches!(r, Ok(Err(queue_sqlite::SqliteError::Config(_)))),
        "not refused as configuration"
    );
}
