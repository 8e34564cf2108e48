//! Behaviour only a SQLite file can show: the claim's plan, worker processes racing on one file,
//! a worker killed mid-job, and the files the backend refuses.

use std::path::{Path, PathBuf};
use std::time::Duration;

use queue_core::{
    Backend, ClaimGeneration, ClaimRequest, Finalize, FinalizeOutcome, JobId, JobStatus, Lease,
    NewJob,
};
use queue_sqlite::{
    OpenFailure, OpenOptions, SqliteError, SqliteQueue, SqliteQueueConfig, TableName,
};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

/// A directory of the test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("queue-sqlite-{name}-{}", std::process::id()));
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
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A value a plan's query binds.
enum Bind<'a> {
    Text(&'a str),
    Int(Option<i64>),
}

/// The plan of `sql` with `binds`, one line per step (`EXPLAIN QUERY PLAN`'s `detail`).
async fn plan(queue: &SqliteQueue, sql: &str, binds: &[Bind<'_>]) -> Vec<String> {
    let text = format!("EXPLAIN QUERY PLAN {sql}");
    let mut query = sqlx::query(sqlx::AssertSqlSafe(text));
    for bind in binds {
        query = match bind {
            Bind::Text(text) => query.bind(text.to_string()),
            Bind::Int(n) => query.bind(*n),
        };
    }
    let rows = query.fetch_all(queue.pool()).await.unwrap();
    rows.iter()
        .map(|row| sqlx::Row::get::<String, _>(row, "detail"))
        .collect()
}

async fn queue_at(path: &Path, options: &OpenOptions) -> SqliteQueue {
    let pool = queue_sqlite::open_pool(path, options).await.expect("open");
    queue_sqlite::migrate(&pool).await.expect("migrate");
    SqliteQueue::connect(pool, SqliteQueueConfig::default())
        .await
        .expect("the schema check")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_reads_its_partial_indexes_whatever_the_backlog() {
    let scratch = Scratch::new("plan");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
         INSERT INTO queue_jobs (queue, status, finished_at, next_attempt_at)
             SELECT 'default', 'completed', unixepoch('subsec') - 86400, unixepoch('subsec') - 90000 FROM n;
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
         INSERT INTO queue_jobs (queue, next_attempt_at) SELECT 'default', unixepoch('subsec') - i FROM n;
         ANALYZE;",
    )
    .execute(queue.pool())
    .await
    .unwrap();
    let pick = queue_sqlite::pick_sql(&TableName::default());
    let binds = [
        Bind::Text("default"),
        Bind::Int(Some(10)),
        Bind::Int(Some(10)),
    ];
    let plan = plan(&queue, &pick, &binds).await;
    let text = plan.join("\n");
    assert!(text.contains("USING INDEX queue_jobs_due_idx"), "{text}");
    // Both expired picks are bounded ranges of the expiry index, not a read of every lease.
    assert!(
        text.contains("expiry_idx (queue=? AND lease_expires_at=?)"),
        "the pick of rows without a lease: {text}"
    );
    assert!(
        text.contains("expiry_idx (queue=? AND lease_expires_at<?)"),
        "the pick of passed leases: {text}"
    );
    assert!(
        !plan
            .iter()
            .any(|step| step.starts_with("SCAN queue_jobs") && !step.contains("INDEX")),
        "a pick scans the table: {text}"
    );
    // The picks' own order comes from their indexes; only the merge of two batches sorts.
    assert!(
        plan.iter().filter(|s| s.contains("TEMP B-TREE")).count() <= 1,
        "{text}"
    );
    let started = std::time::Instant::now();
    let batch = queue
        .claim(ClaimRequest::new(100, Lease::DEFAULT))
        .await
        .unwrap();
    assert_eq!(batch.jobs.len(), 100);
    println!(
        "claim of 100 among 100k due and 100k completed: {:?}",
        started.elapsed()
    );
}

/// The child side of the process tests: a worker process on the file named by the
/// environment. Runs only when the parent test starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of the process tests, started by them"]
async fn child_worker() {
    let db = std::env::var("QUEUE_SQLITE_CHILD_DB").expect("started by a parent test");
    let mode = std::env::var("QUEUE_SQLITE_CHILD_MODE").unwrap_or_default();
    let queue = {
        let pool = queue_sqlite::open_pool(&db, &OpenOptions::default())
            .await
            .unwrap();
        SqliteQueue::connect(pool, SqliteQueueConfig::default())
            .await
            .unwrap()
    };
    let holder = format!("child:{}", std::process::id());
    if mode == "hold" {
        // Claim one job, say so, and hang on to it until killed.
        let job = queue
            .claim(ClaimRequest::new(1, Lease::from_secs(30).unwrap()).holder(&holder))
            .await
            .unwrap()
            .jobs
            .remove(0);
        println!("claimed {} {}", job.id.0, job.generation.0);
        std::future::pending::<()>().await;
    }
    let mut empty = 0;
    while empty < 3 {
        let jobs = queue
            .claim(ClaimRequest::new(25, Lease::DEFAULT).holder(&holder))
            .await
            .unwrap()
            .jobs;
        if jobs.is_empty() {
            empty += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        empty = 0;
        let items: Vec<_> = jobs
            .iter()
            .map(|j| (j.claim(), Finalize::Complete))
            .collect();
        let outcomes = queue.finalize_many(&items).await.unwrap();
        for (job, outcome) in jobs.iter().zip(outcomes) {
            assert_eq!(outcome, FinalizeOutcome::Applied);
            println!("done {} {}", job.id.0, job.generation.0);
        }
    }
}

/// What follows `marker` on a child's line: libtest writes `test child_worker ... ` with no
/// newline, so the child's first line of its own follows that on the same line.
fn marked<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    line.find(marker).map(|at| &line[at + marker.len()..])
}

fn child(db: &Path, mode: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "child_worker",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("QUEUE_SQLITE_CHILD_DB", db)
        .env("QUEUE_SQLITE_CHILD_MODE", mode)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Four worker processes drain one file at once: every job is claimed and completed exactly
/// once, none is lost, each under generation 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_racing_on_one_file_take_each_job_once() {
    let scratch = Scratch::new("race");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    const JOBS: usize = 2_000;
    queue
        .enqueue_many(
            (0..JOBS)
                .map(|n| NewJob::new(&json!({ "n": n })).unwrap())
                .collect(),
        )
        .await
        .unwrap();
    let mut children = Vec::new();
    for _ in 0..4 {
        children.push(
            child(&scratch.db(), "drain")
                .spawn()
                .expect("a worker process"),
        );
    }
    let mut done: Vec<(i64, i64)> = Vec::new();
    for mut worker in children {
        let mut lines = BufReader::new(worker.stdout.take().unwrap()).lines();
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = marked(&line, "done ") {
                let (id, generation) = rest.split_once(' ').unwrap();
                done.push((id.parse().unwrap(), generation.parse().unwrap()));
            }
        }
        assert!(
            worker.wait().await.unwrap().success(),
            "a worker process failed"
        );
    }
    done.sort_unstable();
    let ids: Vec<i64> = done.iter().map(|(id, _)| *id).collect();
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "a job was completed twice");
    assert_eq!(ids.len(), JOBS, "jobs were lost");
    assert!(done.iter().all(|(_, generation)| *generation == 1));
    let counts = queue.counts().await.unwrap();
    assert_eq!(
        (counts.completed, counts.pending, counts.in_flight),
        (JOBS as u64, 0, 0)
    );
}

/// A worker process killed (SIGKILL) while it holds a job: the file is intact, the job is taken
/// over once its lease has passed, under the next generation, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_process_loses_nothing_and_its_job_is_taken_over() {
    let scratch = Scratch::new("kill");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    for n in 0..5 {
        queue
            .enqueue(NewJob::new(&json!({ "n": n })).unwrap())
            .await
            .unwrap();
    }
    let mut worker = child(&scratch.db(), "hold").spawn().unwrap();
    let mut lines = BufReader::new(worker.stdout.take().unwrap()).lines();
    let (held, generation) = loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the worker claims")
            .unwrap()
            .expect("a line");
        if let Some(rest) = marked(&line, "claimed ") {
            let (id, generation) = rest.split_once(' ').unwrap();
            break (
                JobId(id.parse().unwrap()),
                generation.parse::<i64>().unwrap(),
            );
        }
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(worker.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    worker.wait().await.unwrap();
    // Not before its lease: the job is the dead worker's still.
    let early = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert!(
        early.iter().all(|j| j.id != held),
        "taken over before its lease passed"
    );
    for job in &early {
        let released = queue
            .finalize(job.claim(), &Finalize::Release)
            .await
            .unwrap();
        assert_eq!(released, FinalizeOutcome::Applied);
    }
    // Its 30 s lease passes (the stored expiry moved back, by SQLite's clock).
    sqlx::query("UPDATE queue_jobs SET lease_expires_at = lease_expires_at - 31 WHERE id = ?1")
        .bind(held.0)
        .execute(queue.pool())
        .await
        .unwrap();
    let taken = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    let job = taken
        .iter()
        .find(|j| j.id == held)
        .expect("taken over after its lease");
    assert_eq!(job.generation, ClaimGeneration(generation + 1));
    assert!(job.taken_over);
    assert_eq!(taken.len(), 5, "every job is still there");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_files_are_refused_with_a_typed_error() {
    let scratch = Scratch::new("bad");
    // A directory that does not exist.
    let err = queue_sqlite::open_pool(scratch.0.join("nowhere/queue.db"), &OpenOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::Open {
                reason: OpenFailure::MissingDirectory,
                ..
            }
        ),
        "{err}"
    );
    // A file that is not a database.
    let garbage = scratch.0.join("garbage.db");
    std::fs::write(&garbage, vec![0x5a; 8192]).unwrap();
    let err = queue_sqlite::open_pool(&garbage, &OpenOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::Open {
                reason: OpenFailure::Corrupt,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("garbage.db"), "{err}");
    // A database opened read-only: reads work, every write is refused, typed.
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    queue.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    queue.pool().close().await;
    let read_only = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let pool = queue_sqlite::open_pool(scratch.db(), &read_only)
        .await
        .unwrap();
    let reader = SqliteQueue::connect(pool, SqliteQueueConfig::default())
        .await
        .unwrap();
    assert_eq!(reader.counts().await.unwrap().pending, 1);
    let refused = reader.enqueue(NewJob::new(&2).unwrap()).await.unwrap_err();
    assert!(refused.to_string().contains("read-only"), "{refused}");
    assert!(!refused.is_transient());
    // Locked by another writer past the busy timeout: Busy, transient, nothing written.
    let patient = OpenOptions {
        busy_timeout: Duration::from_millis(200),
        ..OpenOptions::default()
    };
    let queue = queue_at(&scratch.db(), &patient).await;
    let other = queue_at(&scratch.db(), &patient).await;
    let mut holder = queue.pool().acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let busy = other.enqueue(NewJob::new(&3).unwrap()).await.unwrap_err();
    assert!(busy.is_transient(), "{busy}");
    assert!(busy.to_string().contains("locked"), "{busy}");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);
    assert_eq!(
        other.counts().await.unwrap().pending,
        1,
        "the refused enqueue wrote nothing"
    );
    let status = other.get(JobId(1)).await.unwrap().unwrap().status;
    assert_eq!(status, JobStatus::Pending);
}

/// A table whose ids SQLite may reuse (no AUTOINCREMENT) is refused: a purged job's id would
/// come back at generation 1, and the purged job's stale worker could write to the new job with
/// its old `(id, generation)`. On the framework's table the stale write stays stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_never_reused_so_a_purged_jobs_fence_never_matches_a_new_job() {
    let scratch = Scratch::new("recycle");
    let pool = queue_sqlite::open_pool(scratch.db(), &OpenOptions::default())
        .await
        .unwrap();
    let reusing =
        queue_sqlite::create_table_sql(&TableName::default()).replace(" AUTOINCREMENT", "");
    sqlx::raw_sql(sqlx::AssertSqlSafe(reusing))
        .execute(&pool)
        .await
        .unwrap();
    let refused = SqliteQueue::connect(pool.clone(), SqliteQueueConfig::default())
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("AUTOINCREMENT"), "{refused}");
    sqlx::raw_sql("DROP TABLE queue_jobs; DROP TABLE queue_jobs_queues")
        .execute(&pool)
        .await
        .unwrap();
    let not_strict =
        queue_sqlite::create_table_sql(&TableName::default()).replace(") STRICT;", ");");
    sqlx::raw_sql(sqlx::AssertSqlSafe(not_strict))
        .execute(&pool)
        .await
        .unwrap();
    let refused = SqliteQueue::connect(pool.clone(), SqliteQueueConfig::default())
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("STRICT"), "{refused}");
    pool.close().await;

    let scratch = Scratch::new("recycle-ours");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    let lease = Lease::from_secs(30).unwrap();
    queue.enqueue(NewJob::new(&"a").unwrap()).await.unwrap();
    let stale = queue
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    sqlx::query("UPDATE queue_jobs SET lease_expires_at = lease_expires_at - 60")
        .execute(queue.pool())
        .await
        .unwrap();
    let taker = queue
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let done = queue
        .finalize(taker.claim(), &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(done, FinalizeOutcome::Applied);
    sqlx::query("UPDATE queue_jobs SET finished_at = finished_at - 60")
        .execute(queue.pool())
        .await
        .unwrap();
    let request =
        queue_core::PurgeRequest::new(&[JobStatus::Completed], Duration::from_secs(1)).unwrap();
    assert_eq!(
        queue_core::Admin::purge_batch(&queue, &request)
            .await
            .unwrap(),
        1
    );
    let next = queue.enqueue(NewJob::new(&"b").unwrap()).await.unwrap();
    assert_ne!(next.id, stale.id, "a purged job's id was reused");
    let _new = queue
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let late = queue
        .finalize(
            stale.claim(),
            &Finalize::Fail {
                error: "late".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(late, FinalizeOutcome::Stale);
}

/// A statement that makes SQLite roll the whole transaction back by itself (`INSERT OR
/// ROLLBACK`) in a hook: the finalize fails, and the connection it used does not go back to the
/// pool believing a transaction is open, so every later claim works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_sqlite_rolled_back_by_itself_leaves_no_connection_broken() {
    struct RollingBack;
    impl queue_core::FinalizeHook<queue_sqlite::SqliteTx, serde_json::Value> for RollingBack {
        async fn after_applied(
            &self,
            tx: &mut queue_sqlite::SqliteTx,
            _: &queue_core::FinalizeEvent<'_, serde_json::Value>,
        ) -> Result<(), queue_core::BoxError> {
            sqlx::query("INSERT OR ROLLBACK INTO outbox (k) VALUES ('taken')")
                .execute(tx.conn())
                .await?;
            Ok(())
        }
    }
    let scratch = Scratch::new("rolled-back");
    let one = OpenOptions {
        max_connections: 1,
        ..OpenOptions::default()
    };
    let queue = queue_at(&scratch.db(), &one).await;
    sqlx::raw_sql("CREATE TABLE outbox (k TEXT PRIMARY KEY); INSERT INTO outbox VALUES ('taken');")
        .execute(queue.pool())
        .await
        .unwrap();
    for n in 0..3 {
        queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
    }
    let lease = Lease::from_secs(30).unwrap();
    let job = queue
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let hooks = queue_core::Hooks::new().with(RollingBack);
    let failed = queue_core::finalize_with_hooks(&queue, &hooks, &job, &Finalize::Complete).await;
    assert!(failed.is_err(), "{failed:?}");
    for _ in 0..2 {
        let next = queue.claim(ClaimRequest::new(1, lease)).await.unwrap().jobs;
        assert_eq!(next.len(), 1);
        let done = queue
            .finalize(next[0].claim(), &Finalize::Complete)
            .await
            .unwrap();
        assert_eq!(done, FinalizeOutcome::Applied);
    }
    // The hook's job is still the first worker's: nothing of the failed finalize stayed.
    assert_eq!(
        queue.get(job.id).await.unwrap().unwrap().status,
        JobStatus::InFlight
    );
}

/// A caller that gives up on a transaction while its `BEGIN IMMEDIATE` waits for another
/// writer's lock (the worker drops a renewal call nobody waits for any more) leaves no
/// connection behind holding the write lock once that BEGIN runs: the next write goes through,
/// and other processes can write again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_dropped_while_its_begin_waits_leaves_no_lock_behind() {
    let scratch = Scratch::new("dropped-begin");
    // A busy timeout far past the caller's patience: the BEGIN is still waiting when the
    // caller gives up, however slowly the machine hands over the pooled connection.
    let one = OpenOptions {
        max_connections: 1,
        busy_timeout: Duration::from_secs(60),
        ..OpenOptions::default()
    };
    let queue = queue_at(&scratch.db(), &one).await;
    let other = queue_sqlite::open_pool(scratch.db(), &OpenOptions::default())
        .await
        .unwrap();
    let mut holder = other.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    // The BEGIN reaches SQLite at once and waits for the holder's lock; the caller stops
    // waiting after two seconds.
    let gave_up = tokio::time::timeout(Duration::from_secs(2), queue.begin()).await;
    assert!(gave_up.is_err(), "the BEGIN could not have taken the lock");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
    // The abandoned BEGIN now takes the lock on its connection; the queue's next write must
    // not find it open (the pool has that one connection).
    let id = queue
        .enqueue(NewJob::new(&json!({"n": 1})).unwrap())
        .await
        .expect("a write after the abandoned transaction")
        .id;
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .expect("another process can take the write lock");
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_jobs WHERE id = ?1")
        .bind(id.0)
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
    assert_eq!(seen, 1, "the write committed");
}

/// Six processes' pools migrating one new file at once (services starting together): every
/// one succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_pools_migrating_a_new_file_at_once_all_succeed() {
    for round in 0..3 {
        let scratch = Scratch::new(&format!("migrate-{round}"));
        let mut pools = Vec::new();
        for _ in 0..6 {
            pools.push(
                queue_sqlite::open_pool(scratch.db(), &OpenOptions::default())
                    .await
                    .unwrap(),
            );
        }
        let runs: Vec<_> = pools
            .into_iter()
            .map(|pool| tokio::spawn(async move { queue_sqlite::migrate(&pool).await }))
            .collect();
        for run in runs {
            run.await
                .unwrap()
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
}

/// A table from before the rates per partition (migration 20261207000001) is refused, naming
/// what it lacks: the controls' columns, the table of starts per partition, its index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_partition_rates_is_refused_naming_what_it_lacks() {
    let scratch = Scratch::new("no-partition-rates");
    let pool = queue_sqlite::open_pool(scratch.db(), &OpenOptions::default())
        .await
        .unwrap();
    queue_sqlite::migrate(&pool).await.unwrap();
    sqlx::raw_sql(
        "ALTER TABLE queue_jobs_queues DROP COLUMN partition_rate_per_ms;
         DROP TABLE queue_jobs_starts;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let refused = SqliteQueue::connect(pool.clone(), SqliteQueueConfig::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("columns partition_rate_per_ms of queue_jobs_queues")
            && refused.contains("migration 20261207000001"),
        "{refused}"
    );
    assert!(
        !refused.contains("partition_rate_starts"),
        "only what is missing: {refused}"
    );
    assert!(refused.contains("the table queue_jobs_starts"), "{refused}");
    sqlx::raw_sql(
        "ALTER TABLE queue_jobs_queues ADD COLUMN partition_rate_per_ms INTEGER;
         CREATE TABLE queue_jobs_starts (
             queue TEXT NOT NULL, partition_key TEXT NOT NULL,
             rate_log TEXT NOT NULL DEFAULT '[]', last_at REAL NOT NULL,
             PRIMARY KEY (queue, partition_key)) STRICT;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let refused = SqliteQueue::connect(pool.clone(), SqliteQueueConfig::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("missing: index queue_jobs_starts_idx."),
        "the claim prunes through it: {refused}"
    );
    pool.close().await;
}

/// A claim of a queue with a rate per partition logs its starts per partition in its own
/// transaction, each key's log keeping the window's claims, and deletes the rows of partitions
/// whose last claim left the window: the table holds about the partitions of one window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_log_the_starts_per_partition_and_prune_those_past_the_window() {
    let scratch = Scratch::new("partition-starts");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    let enqueue = |keys: &'static [&'static str]| {
        let queue = queue.clone();
        async move {
            let jobs = keys
                .iter()
                .map(|key| NewJob::new(key).unwrap().partition_key(*key))
                .collect();
            queue.enqueue_many(jobs).await.unwrap();
        }
    };
    let logs = || async {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT partition_key, (SELECT json_group_array(json_extract(e.value, '$[1]'))
                                    FROM json_each(rate_log) AS e)
             FROM queue_jobs_starts WHERE queue = 'default' ORDER BY partition_key",
        )
        .fetch_all(queue.pool())
        .await
        .unwrap();
        rows
    };
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(5, Duration::from_secs(60)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    queue_core::Admin::set_limits(&queue, limits).await.unwrap();
    let claim = || queue.claim(ClaimRequest::new(10, Lease::DEFAULT));
    enqueue(&["a", "b", "a", "c"]).await;
    assert_eq!(claim().await.unwrap().jobs.len(), 4);
    enqueue(&["a"]).await;
    assert_eq!(claim().await.unwrap().jobs.len(), 1);
    let pairs = |rows: &[(&str, &str)]| -> Vec<(String, String)> {
        rows.iter()
            .map(|(k, log)| (k.to_string(), log.to_string()))
            .collect()
    };
    assert_eq!(
        logs().await,
        pairs(&[("a", "[2,1]"), ("b", "[1]"), ("c", "[1]")])
    );
    // Two minutes on, every partition's last claim has left the window.
    sqlx::query(
        "UPDATE queue_jobs_starts SET last_at = last_at - 120, rate_log = (
             SELECT json_group_array(json_array(json_extract(e.value, '$[0]') - 120000,
                                                json_extract(e.value, '$[1]')))
             FROM json_each(queue_jobs_starts.rate_log) AS e)",
    )
    .execute(queue.pool())
    .await
    .unwrap();
    enqueue(&["d", "a"]).await;
    assert_eq!(claim().await.unwrap().jobs.len(), 2);
    assert_eq!(
        logs().await,
        pairs(&[("a", "[1]"), ("d", "[1]")]),
        "b and c pruned, a's old claims dropped from its log"
    );
}

/// A migration that meets another writer's lock past the busy timeout is transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_behind_a_held_lock_is_transient() {
    let scratch = Scratch::new("migrate-busy");
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
    assert!(err.is_transient(), "{err}");
    queue_sqlite::migrate(&pool).await.unwrap();
}

/// The admin listings read a bounded range, not the table: a page before an id is a rowid
/// range, and a listing of dead jobs reads the failed index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listings_read_a_range_not_the_table() {
    let scratch = Scratch::new("listing");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
         INSERT INTO queue_jobs (queue, status, finished_at)
             SELECT 'default', 'completed', unixepoch('subsec') FROM n;
         INSERT INTO queue_jobs (queue, status, finished_at) VALUES ('default', 'dead', unixepoch('subsec'));
         ANALYZE;",
    )
    .execute(queue.pool())
    .await
    .unwrap();
    let table = TableName::default();
    let binds = [
        Bind::Text("default"),
        Bind::Int(Some(60)),
        Bind::Int(Some(51)),
    ];
    let all = plan(&queue, &queue_sqlite::list_sql(&table, &[]), &binds)
        .await
        .join("\n");
    assert!(all.contains("rowid<?"), "a page before an id: {all}");
    let dead = queue_sqlite::list_sql(&table, &[JobStatus::Dead]);
    let first_page = [Bind::Text("default"), Bind::Int(None), Bind::Int(Some(51))];
    let dead_plan = plan(&queue, &dead, &first_page).await.join("\n");
    assert!(
        dead_plan.contains("queue_jobs_failed_idx"),
        "the dead jobs: {dead_plan}"
    );
    let page = queue_core::Admin::list_jobs(
        &queue,
        &queue_core::JobFilter::new().status(JobStatus::Dead),
    )
    .await
    .unwrap();
    assert_eq!(page.jobs.len(), 1);
}

/// Values the table's types or checks do not allow are refused at the write (a STRICT table,
/// JSON checked), so no claim meets a row it cannot read; out-of-range options are typed errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_the_model_cannot_hold_are_refused_at_the_write() {
    let scratch = Scratch::new("strict");
    let queue = queue_at(&scratch.db(), &OpenOptions::default()).await;
    for (what, insert) in [
        (
            "a payload that is not JSON",
            "INSERT INTO queue_jobs (queue, payload) VALUES ('default', '{\"card\": 41')",
        ),
        (
            "an instant as text",
            "INSERT INTO queue_jobs (queue, next_attempt_at) VALUES ('default', datetime('now'))",
        ),
        (
            "a priority out of range",
            "INSERT INTO queue_jobs (queue, priority) VALUES ('default', 100000)",
        ),
        (
            "negative attempts",
            "INSERT INTO queue_jobs (queue, attempts) VALUES ('default', -1)",
        ),
    ] {
        let refused = sqlx::query(sqlx::AssertSqlSafe(insert))
            .execute(queue.pool())
            .await;
        assert!(refused.is_err(), "{what} was stored");
    }
    assert_eq!(queue.counts().await.unwrap().pending, 0);
    let absurd = OpenOptions {
        busy_timeout: Duration::from_secs(30 * 24 * 3600),
        ..OpenOptions::default()
    };
    let err = queue_sqlite::open_pool(scratch.0.join("other.db"), &absurd)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::InvalidOption {
                name: "busy_timeout",
                ..
            }
        ),
        "{err}"
    );
    let none = OpenOptions {
        max_connections: 0,
        ..OpenOptions::default()
    };
    let err = queue_sqlite::open_pool(scratch.0.join("other.db"), &none)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::InvalidOption {
                name: "max_connections",
                ..
            }
        ),
        "{err}"
    );
    let huge = SqliteQueueConfig {
        max_payload_bytes: 2_000_000_000,
        ..SqliteQueueConfig::default()
    };
    let err = SqliteQueue::connect(queue.pool().clone(), huge)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::InvalidOption {
                name: "max_payload_bytes",
                ..
            }
        ),
        "{err}"
    );
}

/// `chattr` on `path`: immutable files and directories stand for read-only ones, which root
/// (as the tests run) could write whatever their permissions.
fn immutable(path: &Path, on: bool) {
    let status = std::process::Command::new("chattr")
        .arg(if on { "+i" } else { "-i" })
        .arg(path)
        .status()
        .expect("chattr (e2fsprogs) runs");
    assert!(
        status.success(),
        "chattr {} {}",
        if on { "+i" } else { "-i" },
        path.display()
    );
}

/// A directory the WAL files cannot be created in, and a file that cannot be written, are
/// refused at open with `ReadOnly`, not found out at the first claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_directory_or_file_is_refused_at_open() {
    let scratch = Scratch::new("read-only");
    let dir = scratch.0.join("jobs");
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("queue.db");
    let queue = queue_at(&db, &OpenOptions::default()).await;
    queue.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    queue.pool().close().await;
    for file in ["queue.db-wal", "queue.db-shm"] {
        let _ = std::fs::remove_file(dir.join(file));
    }

    immutable(&dir, true);
    let in_dir = queue_sqlite::open_pool(&db, &OpenOptions::default()).await;
    immutable(&dir, false);
    let err = in_dir.unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::Open {
                reason: OpenFailure::ReadOnly,
                ..
            }
        ),
        "{err}"
    );

    immutable(&db, true);
    let file = queue_sqlite::open_pool(&db, &OpenOptions::default()).await;
    immutable(&db, false);
    let err = file.unwrap_err();
    assert!(
        matches!(
            err,
            SqliteError::Open {
                reason: OpenFailure::ReadOnly,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("queue.db"), "{err}");
}
