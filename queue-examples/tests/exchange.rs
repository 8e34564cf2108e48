//! The exchange end to end, against real PostgreSQL (a scratch database with the exchange's own
//! migrations) and a real local HTTP partner server.

use std::collections::HashMap;
use std::time::Duration;

use queue_core::{
    Backend, BackendTx, CancelOutcome, ClaimRequest, Finalize, FinalizeEvent, FinalizeOutcome,
    JobId, JobStatus, Lease, Payload, RetryTarget, Worker, WorkerHandle, finalize_with_hooks,
    retry_with_hooks,
};
use queue_examples::exchange::demo::{self, DemoConfig};
use queue_examples::exchange::partner_server::{Behavior, PartnerServer};
use queue_examples::exchange::{
    EventType, ExchangeConfig, ExchangeStore, HttpPartner, MIGRATOR, MemExchange, Partners,
    PgExchange, RetryOutcome, SendHandler, SendPayload, SqliteExchange, TransactionStatus,
    TransactionView,
};
use queue_postgres::testing::ScratchDb;
use queue_postgres::{LegacyUpgrade, TableName};
use serde_json::{Value, json};
use sqlx::Row;

async fn exchange_db() -> (ScratchDb, PgExchange) {
    let db = ScratchDb::with_prefix("exchange_test").await;
    let store = PgExchange::migrate_and_connect(db.pool.clone())
        .await
        .expect("the exchange's migrations apply and the upgraded table passes the schema check");
    (db, store)
}

/// A directory of the test's own for a SQLite file, removed when dropped.
struct SqliteDir(std::path::PathBuf);

impl Drop for SqliteDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The exchange on a SQLite file of the test's own, with the exchange's SQLite migrations.
async fn sqlite_exchange(name: &str) -> (SqliteDir, SqliteExchange) {
    let dir = std::env::temp_dir().join(format!("exchange-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteExchange::open(dir.join("exchange.db"), &Default::default())
        .await
        .expect("the exchange's SQLite migrations apply and the table passes the schema check");
    (SqliteDir(dir), store)
}

/// A local partner `acme` that accepts every POST after `latency`.
async fn acme_server(latency: Duration) -> PartnerServer {
    let accepting = Behavior::Flaky {
        fail_rate: 0.0,
        latency,
    };
    PartnerServer::start(HashMap::from([("acme".to_owned(), accepting)]))
        .await
        .expect("start the partner server")
}

fn quick(config: ExchangeConfig) -> ExchangeConfig {
    ExchangeConfig {
        retry_base: Duration::from_millis(10),
        poll_interval: Duration::from_millis(50),
        ..config
    }
}

fn start<S: ExchangeStore>(
    store: &S,
    partners: &Partners,
    config: &ExchangeConfig,
) -> WorkerHandle {
    Worker::new(
        store.queue().clone(),
        SendHandler::new(store.clone(), partners.clone()),
        config.worker_config(partners).unwrap(),
    )
    .unwrap()
    .hooks(store.hooks())
    .start()
}

async fn wait_terminal<S: ExchangeStore>(store: &S, n: u64) {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let s = store.summary().await.unwrap();
            if s.success + s.failed >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every transaction should end");
}

fn small_demo() -> DemoConfig {
    DemoConfig {
        jobs: 600,
        workers: 3,
        concurrency: 8,
        fail_rate: 0.1,
        progress: false,
        deadline: Duration::from_secs(120),
        ..DemoConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_under_load_on_postgres_sends_each_transmission_once() {
    let (db, store) = exchange_db().await;
    let report = demo::run(store.clone(), "postgres", &small_demo())
        .await
        .unwrap();
    assert_eq!(report.duplicate_posts, 0, "{report}");
    assert_eq!(report.conflicting_events, 0, "{report}");
    assert_eq!(report.duplicate_events, 0, "{report}");
    assert_eq!(report.sent + report.failed, 600, "{report}");
    // Whether the restart found prefetched claims to release depends on the instant it came
    // (a worker's buffer empties within a send's latency): the release itself is proven
    // deterministically by the conformance case
    // `graceful_shutdown_releases_unstarted_claims` on every backend.
    // One event per transaction, matching its status.
    let summary = store.summary().await.unwrap();
    assert_eq!(summary.sent_events, summary.success);
    assert_eq!(summary.failed_events, summary.failed);
    db.drop_db().await;
}

/// The same store and hook on the tokio-postgres driver: one exchange hook serves both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_under_load_on_tokio_postgres_sends_each_transmission_once() {
    let (db, _) = exchange_db().await;
    let config = queue_examples::exchange::send_queue_config().unwrap();
    let queue = queue_postgres::TokioPostgresQueue::connect(
        db.tokio_postgres_pool(16),
        config,
        db.tokio_postgres_config(),
    )
    .await
    .unwrap();
    let store = PgExchange::from_queue(queue);
    let report = demo::run(store.clone(), "tokio-postgres", &small_demo())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.sent + report.failed, 600, "{report}");
    let summary = store.summary().await.unwrap();
    assert_eq!(summary.sent_events, summary.success);
    assert_eq!(summary.failed_events, summary.failed);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_under_load_in_memory_sends_each_transmission_once() {
    let store = MemExchange::new();
    let report = demo::run(store.clone(), "memory", &small_demo())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report}");
    let summary = store.summary().await.unwrap();
    assert_eq!(summary.sent_events + summary.failed_events, 600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_under_load_on_sqlite_sends_each_transmission_once() {
    let (_dir, store) = sqlite_exchange("restart").await;
    let report = demo::run(store.clone(), "sqlite", &small_demo())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.sent + report.failed, 600, "{report}");
    let summary = store.summary().await.unwrap();
    assert_eq!(summary.sent_events, summary.success);
    assert_eq!(summary.failed_events, summary.failed);
}

/// The `summary:` line of an `exchange-demo` run, as `key=value` pairs.
fn demo_summary(stdout: &[u8]) -> HashMap<String, String> {
    let text = String::from_utf8_lossy(stdout);
    let line = text
        .lines()
        .find_map(|line| line.strip_prefix("summary: "))
        .unwrap_or_else(|| panic!("no summary line in:\n{text}"));
    line.split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `exchange-demo` with nothing but cargo: a SQLite file in a temporary directory, the rolling
/// restart, every transmission sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_on_a_sqlite_file_by_default() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_exchange-demo"))
        .args(["--jobs", "400", "--no-progress"])
        .env_remove("DATABASE_URL")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let summary = demo_summary(&output.stdout);
    assert_eq!(summary["backend"], "sqlite");
    assert_eq!(summary["mode"], "restart");
    assert_eq!(summary["duplicate_posts"], "0");
    assert_eq!(summary["conflicting_events"], "0");
    let ended: u64 =
        summary["sent"].parse::<u64>().unwrap() + summary["failed"].parse::<u64>().unwrap();
    assert_eq!(ended, 400);
}

/// `exchange-demo --kill` on its SQLite file: worker processes killed with SIGKILL mid-send,
/// replaced, and the run still ends with every job terminal, no conflicting or duplicate event,
/// and every duplicate POST tied to a kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demos_kill_mode_explains_every_duplicate_post_by_a_kill() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_exchange-demo"))
        .args([
            "--jobs",
            "800",
            "--workers",
            "3",
            "--kill",
            "--kills",
            "4",
            "--no-progress",
        ])
        .env_remove("DATABASE_URL")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let summary = demo_summary(&output.stdout);
    assert_eq!(
        (summary["backend"].as_str(), summary["mode"].as_str()),
        ("sqlite", "kill")
    );
    let kills: u64 = summary["kills"].parse().unwrap();
    assert!(kills >= 1, "no worker was killed: {stdout}");
    assert_eq!(summary["duplicate_posts"], summary["explained"], "{stdout}");
    assert_eq!(summary["conflicting_events"], "0");
    let ended: u64 =
        summary["sent"].parse::<u64>().unwrap() + summary["failed"].parse::<u64>().unwrap();
    assert_eq!(ended, 800);
    assert_eq!(
        stdout.matches("killed worker process").count() as u64,
        kills,
        "{stdout}"
    );
}

/// The terminal guard and the only exit from `failed` on SQLite, as on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_the_terminal_guard_refuses_flips_and_retry_is_the_only_exit_from_failed() {
    use queue_core::BackendTx;
    use queue_examples::exchange::StampOutcome;
    let (_dir, store) = sqlite_exchange("guard").await;
    let ids = store
        .create_transactions(&[("acme".into(), 1), ("acme".into(), 2)])
        .await
        .unwrap();
    let mut tx = store.queue().begin().await.unwrap();
    use TransactionStatus::*;
    for (id, status, expected) in [
        (ids[0], Success, StampOutcome::Applied),
        (ids[0], Failed, StampOutcome::Refused),
        (ids[1], Failed, StampOutcome::Applied),
        (ids[1], Success, StampOutcome::Refused),
    ] {
        assert_eq!(
            store.stamp_transaction(&mut tx, id, status).await.unwrap(),
            expected
        );
    }
    tx.commit().await.unwrap();
    assert_eq!(
        store.retry_failed_transaction(ids[0]).await.unwrap(),
        RetryOutcome::NotFailed(Success)
    );
    let before = store.transaction(ids[1]).await.unwrap().unwrap();
    let RetryOutcome::Retried {
        correlation_id,
        key_kept,
        send_job_id,
    } = store.retry_failed_transaction(ids[1]).await.unwrap()
    else {
        panic!("a failed transaction must be retryable");
    };
    let after = store.transaction(ids[1]).await.unwrap().unwrap();
    assert_eq!((after.status, after.retries), (Pending, 1));
    assert!(key_kept, "an unknown failure keeps its key");
    assert_eq!(after.correlation_id, before.correlation_id);
    assert_eq!(after.correlation_id, correlation_id);
    assert_eq!(
        store.send_jobs(ids[1]).await.unwrap().last(),
        Some(&send_job_id)
    );
    let payload = store
        .queue()
        .get(JobId(send_job_id))
        .await
        .unwrap()
        .unwrap()
        .payload;
    assert_eq!(payload["correlation_id"], json!(correlation_id));
    assert_eq!(payload["transaction_id"], json!(ids[1]));
    assert_eq!(
        store.retry_failed_transaction(999_999).await.unwrap(),
        RetryOutcome::NotFound
    );
}

/// A send under a definitive failure is repointed to a new key on SQLite too, and the
/// key is a fresh 128-bit one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_refused_send_fails_and_its_retry_goes_under_a_new_key() {
    let (_dir, store) = sqlite_exchange("rekey").await;
    let server = PartnerServer::start(HashMap::from([("acme".to_owned(), Behavior::Always(422))]))
        .await
        .unwrap();
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let id = store
        .create_transactions(&[("acme".into(), 11)])
        .await
        .unwrap()[0];
    let first = store.transaction(id).await.unwrap().unwrap();
    assert_eq!(first.correlation_id.len(), 32, "{}", first.correlation_id);
    let worker = start(&store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(&store, 1).await;
    worker.shutdown().await.unwrap();
    let failed = store.transaction(id).await.unwrap().unwrap();
    assert_eq!(failed.status, TransactionStatus::Failed);
    let RetryOutcome::Retried {
        correlation_id,
        key_kept,
        ..
    } = store.retry_failed_transaction(id).await.unwrap()
    else {
        panic!("retryable");
    };
    assert!(!key_kept, "a definitive failure repoints the key");
    assert_ne!(correlation_id, first.correlation_id);
    assert_eq!(correlation_id.len(), 32);
    let events = store.events(id).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.event_type).collect::<Vec<_>>(),
        vec![EventType::Failed]
    );
}

/// The SQLite send-jobs table is the framework's, generated: the committed migration is what
/// `queue_sqlite::create_table_sql` makes of it today.
#[test]
fn the_committed_sqlite_send_jobs_table_is_what_the_framework_generates() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/migrations-sqlite/20261203000002_exchange_send_jobs.sql"
    );
    let generated = format!(
        "-- GENERATED from queue_sqlite::create_table_sql: the framework's SQLite queue table, named\n\
         -- for the exchange. A test fails if it drifts; regenerate with\n\
         -- REGENERATE_EXCHANGE_SQLITE=1 cargo test -p queue-examples --test exchange\n\
         -- the_committed_sqlite_send_jobs_table, never edit it.\n{}",
        queue_sqlite::create_table_sql(
            &queue_sqlite::TableName::new("exchange_send_jobs").unwrap()
        )
    );
    if std::env::var_os("REGENERATE_EXCHANGE_SQLITE").is_some() {
        std::fs::write(path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == generated,
        "{path} drifted from queue_sqlite::create_table_sql; regenerate it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_terminal_guard_refuses_flips_and_retry_is_the_only_exit_from_failed() {
    use queue_core::BackendTx;
    use queue_examples::exchange::StampOutcome;
    let (db, store) = exchange_db().await;
    let ids = store
        .create_transactions(&[("acme".into(), 1), ("acme".into(), 2)])
        .await
        .unwrap();
    let mut tx = store.queue().begin().await.unwrap();
    use TransactionStatus::*;
    for (id, status, expected) in [
        (ids[0], Success, StampOutcome::Applied),
        (ids[0], Failed, StampOutcome::Refused),
        (ids[1], Failed, StampOutcome::Applied),
        (ids[1], Success, StampOutcome::Refused),
    ] {
        assert_eq!(
            store.stamp_transaction(&mut tx, id, status).await.unwrap(),
            expected
        );
    }
    tx.commit().await.unwrap();
    assert_eq!(
        store.transaction(ids[0]).await.unwrap().unwrap().status,
        Success
    );
    assert_eq!(
        store.transaction(ids[1]).await.unwrap().unwrap().status,
        Failed
    );
    assert_eq!(
        store.retry_failed_transaction(ids[0]).await.unwrap(),
        RetryOutcome::NotFailed(Success)
    );
    let before = store.transaction(ids[1]).await.unwrap().unwrap();
    let RetryOutcome::Retried {
        correlation_id,
        key_kept,
        ..
    } = store.retry_failed_transaction(ids[1]).await.unwrap()
    else {
        panic!("a failed transaction must be retryable");
    };
    let after = store.transaction(ids[1]).await.unwrap().unwrap();
    assert_eq!(after.status, Pending);
    // Failed without a recorded send failure (stamped here, or by hand): whether the partner
    // acted is unknown, so the key is kept (docs/adr/0003).
    assert!(key_kept);
    assert_eq!(
        after.correlation_id, before.correlation_id,
        "an unknown failure keeps its key"
    );
    assert_eq!(after.correlation_id, correlation_id);
    assert_eq!(after.retries, 1);
    assert_eq!(
        store.retry_failed_transaction(999_999).await.unwrap(),
        RetryOutcome::NotFound
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_flip_is_logged_and_stages_no_event_but_the_job_still_finalizes() {
    let (db, store) = exchange_db().await;
    // Already terminal (say an operator marked it): flipping is refused, and so is restamping the
    // same status; either way the job's own outcome applies (it is the source of truth) and no
    // event is staged.
    for preset in ["success", "failed"] {
        let id = store
            .create_transactions(&[("acme".into(), 5)])
            .await
            .unwrap()[0];
        sqlx::query("UPDATE exchange_transactions SET status = $2 WHERE id = $1")
            .bind(id)
            .bind(preset)
            .execute(&db.pool)
            .await
            .unwrap();
        let job = store
            .queue()
            .claim(ClaimRequest::new(1, Lease::DEFAULT))
            .await
            .unwrap()
            .jobs
            .remove(0);
        let failed = Finalize::Fail {
            error: "partner said no".into(),
        };
        let outcome = finalize_with_hooks(store.queue(), &store.hooks(), &job, &failed)
            .await
            .unwrap();
        assert_eq!(outcome, FinalizeOutcome::Applied);
        let status = store.transaction(id).await.unwrap().unwrap().status;
        assert_eq!(status.as_str(), preset);
        assert!(
            store.events(id).await.unwrap().is_empty(),
            "a refused stamp staged an event ({preset})"
        );
    }
    db.drop_db().await;
}

#[tokio::test]
async fn in_memory_a_refused_stamp_stages_no_event_either() {
    use queue_core::BackendTx;
    let store = MemExchange::new();
    let id = store
        .create_transactions(&[("acme".into(), 5)])
        .await
        .unwrap()[0];
    let mut tx = store.queue().begin().await.unwrap();
    assert!(store.stamp_transaction(&mut tx, id, TransactionStatus::Failed));
    tx.commit().await.unwrap();
    let job = store
        .queue()
        .claim(ClaimRequest::new(1, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let failed = Finalize::Fail {
        error: "again".into(),
    };
    let outcome = finalize_with_hooks(store.queue(), &store.hooks(), &job, &failed)
        .await
        .unwrap();
    assert_eq!(outcome, FinalizeOutcome::Applied);
    assert!(store.events(id).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_send_job_ends_dead_and_its_transaction_fails_with_an_event() {
    let (db, store) = exchange_db().await;
    let id = store
        .create_transactions(&[("acme".into(), 7)])
        .await
        .unwrap()[0];
    let table = TableName::new("exchange_send_jobs").unwrap();
    // Six workers died holding the send (the default cap allows five takeovers).
    for _ in 0..6 {
        let jobs = store
            .queue()
            .claim(ClaimRequest::new(1, Lease::DEFAULT))
            .await
            .unwrap()
            .jobs;
        assert_eq!(jobs.len(), 1);
        queue_postgres::testing::age_rows(&db.pool, &table, Lease::DEFAULT.duration() * 2).await;
    }
    let server = acme_server(Duration::ZERO).await;
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let worker = start(&store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(&store, 1).await;
    let report = worker.shutdown().await.unwrap();
    assert_eq!(report.stats.dead, 1);
    assert_eq!(server.posts(), 0, "a buried job must not be sent again");
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Failed
    );
    let events = store.events(id).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.event_type).collect::<Vec<_>>(),
        vec![EventType::Failed]
    );
    let status: String =
        sqlx::query_scalar("SELECT status FROM exchange_send_jobs WHERE transaction_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "dead");
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_early_terminal_arms_stamp_failed_and_stage_the_event_without_sending() {
    let (db, store) = exchange_db().await;
    let server = acme_server(Duration::ZERO).await;
    let partners = Partners::new()
        .with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap())
        .with_unresolvable("umbrella", "endpoint withdrawn");
    let ids = store
        .create_transactions(&[
            ("initech".into(), 1),
            ("umbrella".into(), 2),
            ("acme".into(), 3),
        ])
        .await
        .unwrap();
    let worker = start(&store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(&store, 3).await;
    worker.shutdown().await.unwrap();
    for (id, why) in [(ids[0], "missing"), (ids[1], "cannot be resolved")] {
        let tx = store.transaction(id).await.unwrap().unwrap();
        assert_eq!(tx.status, TransactionStatus::Failed);
        let events = store.events(id).await.unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].event_type, EventType::Failed);
        assert_eq!(events[0].correlation_id, tx.correlation_id);
        let error: Option<String> = sqlx::query_scalar(
            "SELECT last_error FROM exchange_send_jobs WHERE transaction_id = $1",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(error.unwrap_or_default().contains(why));
    }
    assert_eq!(
        store.transaction(ids[2]).await.unwrap().unwrap().status,
        TransactionStatus::Success
    );
    assert_eq!(
        server.posts(),
        1,
        "the doomed transmissions must not reach any partner"
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partner_timeouts_and_5xx_retry_then_end_terminal_at_max_attempts() {
    let (db, store) = exchange_db().await;
    let server = PartnerServer::start(HashMap::from([
        ("slow".to_owned(), Behavior::Slow(Duration::from_secs(2))),
        ("down".to_owned(), Behavior::Always(503)),
        ("picky".to_owned(), Behavior::Always(422)),
    ]))
    .await
    .unwrap();
    let timeout = Duration::from_millis(150);
    let partners = Partners::new()
        .with(
            "slow",
            HttpPartner::new(&server.endpoint("slow"))
                .unwrap()
                .with_timeout(timeout),
        )
        .with(
            "down",
            HttpPartner::new(&server.endpoint("down"))
                .unwrap()
                .with_timeout(timeout),
        )
        .with(
            "picky",
            HttpPartner::new(&server.endpoint("picky"))
                .unwrap()
                .with_timeout(timeout),
        );
    let ids = store
        .create_transactions(&[("slow".into(), 1), ("down".into(), 2), ("picky".into(), 3)])
        .await
        .unwrap();
    let config = quick(ExchangeConfig {
        max_attempts: 3,
        lease: Lease::from_secs(15).unwrap(),
        ..ExchangeConfig::default()
    });
    let worker = start(&store, &partners, &config);
    wait_terminal(&store, 3).await;
    worker.shutdown().await.unwrap();
    let keys = server.keys();
    for (id, posts) in [(ids[0], 3), (ids[1], 3), (ids[2], 1)] {
        let tx = store.transaction(id).await.unwrap().unwrap();
        assert_eq!(tx.status, TransactionStatus::Failed, "transaction {id}");
        let record = keys[&tx.correlation_id];
        assert_eq!(record.received, posts, "POSTs for transaction {id}");
        let events = store.events(id).await.unwrap();
        assert_eq!(
            events.iter().map(|e| e.event_type).collect::<Vec<_>>(),
            vec![EventType::Failed]
        );
    }
    let row = sqlx::query(
        "SELECT attempts, last_error FROM exchange_send_jobs WHERE transaction_id = $1",
    )
    .bind(ids[0])
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<i32, _>(0), 3);
    assert!(row.get::<String, _>(1).contains("did not answer"));
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrying_a_failed_transaction_sends_it_under_a_new_key_without_conflicting_events() {
    let (db, store) = exchange_db().await;
    let server = acme_server(Duration::ZERO).await;
    // First the partner is unknown to the worker: the transaction fails terminally.
    let id = store
        .create_transactions(&[("acme".into(), 9)])
        .await
        .unwrap()[0];
    let none = Partners::new();
    let worker = start(&store, &none, &quick(ExchangeConfig::default()));
    wait_terminal(&store, 1).await;
    worker.shutdown().await.unwrap();
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Failed
    );
    // Fixed configuration, retried: a missing partner is a definitive failure, so the key is
    // repointed.
    let first_key = store.transaction(id).await.unwrap().unwrap().correlation_id;
    let RetryOutcome::Retried {
        correlation_id,
        key_kept,
        ..
    } = store.retry_failed_transaction(id).await.unwrap()
    else {
        panic!("retry refused");
    };
    assert!(!key_kept);
    assert_ne!(correlation_id, first_key);
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let worker = start(&store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(&store, 1).await;
    tokio::time::timeout(Duration::from_secs(30), async {
        while store.transaction(id).await.unwrap().unwrap().status != TransactionStatus::Success {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the retried transaction should succeed");
    worker.shutdown().await.unwrap();
    let events = store.events(id).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.event_type).collect::<Vec<_>>(),
        vec![EventType::Failed, EventType::Sent]
    );
    assert_eq!(events[1].correlation_id, correlation_id);
    assert_eq!(store.summary().await.unwrap().conflicting_events, 0);
    assert_eq!(server.keys()[&correlation_id].accepted, 1);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_legacy_upgrade_heals_in_flight_legacy_rows() {
    let db = ScratchDb::with_prefix("exchange_test").await;
    // The service as it was: up to the outbox, before the lease.
    MIGRATOR.run_to(20260101000003, &db.pool).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO exchange_transactions (partner, amount_minor, status) VALUES
             ('acme', 10, 'pending'), ('acme', 20, 'pending'), ('acme', 30, 'success');
         INSERT INTO exchange_send_jobs (transaction_id, status, attempts, next_attempt_at) VALUES
             (1, 'in_flight', 1, now() - interval '3 hours'),
             (2, 'in_flight', 2, now() - interval '2 hours'),
             (3, 'sent',      1, now() - interval '1 day');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The old binary's table fails the new binary's start-up check.
    assert!(PgExchange::connect(db.pool.clone()).await.is_err());
    // Deploy: the lease upgrade and the adoption migration.
    let store = PgExchange::migrate_and_connect(db.pool.clone())
        .await
        .unwrap();
    let statuses: Vec<(i64, String, Option<chrono::DateTime<chrono::Utc>>)> = sqlx::query_as(
        "SELECT transaction_id, status, claimed_at FROM exchange_send_jobs ORDER BY transaction_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(statuses[0].1, "in_flight");
    assert_eq!(statuses[0].2, None, "no backfill of claimed_at");
    assert_eq!(
        statuses[2].1, "completed",
        "'sent' maps to the framework's 'completed'"
    );

    let server = acme_server(Duration::ZERO).await;
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let worker = start(&store, &partners, &quick(ExchangeConfig::default()));
    // The stranded in-flight rows are re-claimed at once (NULL claimed_at = expired lease).
    wait_terminal(&store, 3).await;
    let report = worker.shutdown().await.unwrap();
    assert_eq!(report.stats.completed, 2);
    for id in [1, 2] {
        let tx = store.transaction(id).await.unwrap().unwrap();
        assert_eq!(tx.status, TransactionStatus::Success);
        assert_eq!(store.events(id).await.unwrap().len(), 1);
        assert_eq!(server.keys()[&tx.correlation_id].accepted, 1);
    }
    let reclaims: Vec<i32> = sqlx::query_scalar(
        "SELECT reclaims FROM exchange_send_jobs WHERE transaction_id IN (1, 2) ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        reclaims,
        vec![1, 1],
        "legacy in-flight rows are taken over as expired leases"
    );
    db.drop_db().await;
}

/// The exchange's legacy upgrade, as the framework generates it for its table.
fn exchange_upgrade() -> LegacyUpgrade {
    LegacyUpgrade::new(
        TableName::new("exchange_send_jobs").unwrap(),
        queue_examples::exchange::queue_name(),
    )
    .retire_index("idx_exchange_send_jobs_stuck_in_flight")
    .unwrap()
    .retire_index("idx_exchange_send_jobs_pending")
    .unwrap()
}

/// The versions under which the exchange commits the generated files, in their order (0005,
/// between the columns and the backfill, is the exchange's own; the partition index, which a
/// later framework release added, came after the exchange's 0015, and the fence of room
/// grants, a later table migration, after it).
const GENERATED_VERSIONS: [i64; 12] = [
    20260101000004,
    20260101000006,
    20260101000007,
    20260101000008,
    20260101000009,
    20260101000010,
    20260101000011,
    20260101000012,
    20260101000016,
    20260101000013,
    20260101000014,
    20260101000017,
];

/// A generated migration as committed: sqlx's `-- no-transaction` first where there is one,
/// then a header saying where it comes from.
fn committed_text(sql: &str) -> String {
    let (no_tx, body) = match sql.strip_prefix("-- no-transaction\n") {
        Some(body) => ("-- no-transaction\n", body),
        None => ("", sql),
    };
    format!(
        "{no_tx}-- GENERATED by queue_postgres::LegacyUpgrade for exchange_send_jobs (queue \
         exchange.send,\n-- retiring idx_exchange_send_jobs_stuck_in_flight and \
         idx_exchange_send_jobs_pending): one step of\n-- the framework's online legacy \
         upgrade, committed as this service's migration. A test\n-- fails if it drifts; \
         regenerate with REGENERATE_EXCHANGE_UPGRADE=1 cargo test -p queue-examples\n-- \
         --test exchange the_committed_legacy_upgrade, never edit it.\n{body}"
    )
}

#[test]
fn the_committed_legacy_upgrade_is_what_the_framework_generates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let files = exchange_upgrade().migration_files().unwrap();
    assert_eq!(files.len(), GENERATED_VERSIONS.len());
    let regenerate = std::env::var_os("REGENERATE_EXCHANGE_UPGRADE").is_some();
    for (version, file) in GENERATED_VERSIONS.iter().zip(&files) {
        let path = dir.join(format!("{version}_{}.sql", file.description));
        let expected = committed_text(&file.sql);
        if regenerate {
            std::fs::write(&path, &expected).unwrap();
            continue;
        }
        let committed = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (regenerate the upgrade)", path.display()));
        assert_eq!(
            committed,
            expected,
            "{} drifted from what the framework generates; regenerate it",
            path.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_sender_stamps_nothing_and_stages_nothing() {
    let (db, store) = exchange_db().await;
    let id = store
        .create_transactions(&[("acme".into(), 1)])
        .await
        .unwrap()[0];
    let lease = Lease::DEFAULT;
    let old = store
        .queue()
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    queue_postgres::testing::age_rows(
        &db.pool,
        &TableName::new("exchange_send_jobs").unwrap(),
        lease.duration() * 2,
    )
    .await;
    let new = store
        .queue()
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let hooks = store.hooks();
    // The stale holder reports failure late: fenced, nothing stamped, no event.
    let failed = Finalize::Fail {
        error: "late".into(),
    };
    let stale = finalize_with_hooks(store.queue(), &hooks, &old, &failed)
        .await
        .unwrap();
    assert_eq!(stale, FinalizeOutcome::Stale);
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Pending
    );
    assert!(store.events(id).await.unwrap().is_empty());
    let applied = finalize_with_hooks(store.queue(), &hooks, &new, &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(applied, FinalizeOutcome::Applied);
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Success
    );
    let events = store.events(id).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].claim_generation, new.generation.0);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_binary_sends_and_drains_on_sigterm() {
    let (db, store) = exchange_db().await;
    let server = acme_server(Duration::from_millis(5)).await;
    store
        .create_transactions(&(0..50).map(|i| ("acme".to_owned(), i)).collect::<Vec<_>>())
        .await
        .unwrap();
    let url = format!("{}/{}", queue_postgres::testing::server_url(), db.name);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_exchange-worker"))
        .arg("--database-url")
        .arg(&url)
        .arg("--partner")
        .arg(format!("acme={}", server.endpoint("acme")))
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start exchange-worker");
    wait_terminal(&store, 50).await;
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the worker drains and exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "exit status {status}");
    let summary = store.summary().await.unwrap();
    assert_eq!((summary.success, summary.sent_events), (50, 50));
    assert_eq!(server.duplicate_posts(), 0);
    db.drop_db().await;
}

#[tokio::test]
async fn the_worker_binary_refuses_a_lease_too_short_for_its_partners() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_exchange-worker"))
        .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
        .args([
            "--partner",
            "acme=http://127.0.0.1:9/x",
            "--lease-secs",
            "60",
        ])
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("2 × the largest partner send timeout"),
        "{stderr}"
    );
}

/// A payload made of the transaction it is planted on (so that it can name its own id with
/// another key, for instance).
type MakePayload = dyn Fn(&TransactionView) -> Value + Send + Sync;

/// Plants a transaction whose send job carries a payload of the test's making instead of its
/// own: on PostgreSQL by rewriting the row the way a bad deploy or a hand edit would, in memory
/// through the store.
trait Planter {
    async fn plant(&self, payload: &MakePayload) -> i64;
}

struct PgPlanter<'a>(&'a ScratchDb, &'a PgExchange);

impl Planter for PgPlanter<'_> {
    async fn plant(&self, payload: &MakePayload) -> i64 {
        let PgPlanter(db, store) = self;
        let id = store
            .create_transactions(&[("acme".into(), 9)])
            .await
            .unwrap()[0];
        let view = store.transaction(id).await.unwrap().unwrap();
        sqlx::query("UPDATE exchange_send_jobs SET payload = $2 WHERE transaction_id = $1")
            .bind(id)
            .bind(payload(&view))
            .execute(&db.pool)
            .await
            .unwrap();
        id
    }
}

impl Planter for SqliteExchange {
    async fn plant(&self, payload: &MakePayload) -> i64 {
        let id = self
            .create_transactions(&[("acme".into(), 9)])
            .await
            .unwrap()[0];
        let view = self.transaction(id).await.unwrap().unwrap();
        sqlx::query("UPDATE exchange_send_jobs SET payload = ?2 WHERE transaction_id = ?1")
            .bind(id)
            .bind(payload(&view).to_string())
            .execute(self.pool())
            .await
            .unwrap();
        id
    }
}

impl Planter for MemExchange {
    async fn plant(&self, payload: &MakePayload) -> i64 {
        self.create_with_payload("acme", 9, payload).await.unwrap()
    }
}

/// The payload a transaction's send job should carry.
fn own_payload(view: &TransactionView) -> SendPayload {
    SendPayload {
        transaction_id: view.id,
        correlation_id: view.correlation_id.clone(),
        partner: view.partner.clone(),
        amount_minor: view.amount_minor,
    }
}

/// The status and `last_error` of a transaction's only send job.
async fn send_job_of<S: ExchangeStore>(store: &S, id: i64) -> (JobStatus, Option<String>) {
    let jobs = store.send_jobs(id).await.unwrap();
    assert_eq!(jobs.len(), 1, "transaction {id} has one send job");
    let job = store.queue().get(JobId(jobs[0])).await.unwrap().unwrap();
    (job.status, job.last_error)
}

/// Poison payloads (`{}`, an array, `null`), another transaction's payload, and the job's own
/// transaction with another key or amount: none is sent, each fails its own transaction with
/// one `exchange.failed`, and the job says why.
async fn hostile_payloads_fail_their_own_transaction<S: ExchangeStore>(
    store: &S,
    planter: &impl Planter,
) {
    let server = acme_server(Duration::ZERO).await;
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let good = store
        .create_transactions(&[("acme".into(), 1)])
        .await
        .unwrap()[0];
    let good_view = store.transaction(good).await.unwrap().unwrap();
    let mut poisoned = Vec::new();
    for payload in [json!({}), json!([1, 2, 3]), Value::Null] {
        poisoned.push(planter.plant(&move |_| payload.clone()).await);
    }
    let value = |payload: SendPayload| serde_json::to_value(payload).unwrap();
    // Another transaction's payload, key included: sending it would send `good` again.
    let borrowed = value(own_payload(&good_view));
    // The job's own transaction under another's key: the partner would take it for `good`.
    let good_key = good_view.correlation_id.clone();
    let foreign_key = move |view: &TransactionView| {
        value(SendPayload {
            correlation_id: good_key.clone(),
            ..own_payload(view)
        })
    };
    let other_amount = move |view: &TransactionView| {
        value(SendPayload {
            amount_minor: view.amount_minor + 1,
            ..own_payload(view)
        })
    };
    let mut mismatched = vec![planter.plant(&move |_| borrowed.clone()).await];
    mismatched.push(planter.plant(&foreign_key).await);
    mismatched.push(planter.plant(&other_amount).await);
    let worker = start(store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(store, 7).await;
    worker.shutdown().await.unwrap();

    assert_eq!(server.posts(), 1, "only the good transaction is sent");
    assert_eq!(server.keys()[&good_view.correlation_id].accepted, 1);
    let good_now = store.transaction(good).await.unwrap().unwrap();
    assert_eq!(good_now.status, TransactionStatus::Success);
    for (id, why) in poisoned.iter().map(|id| (*id, "malformed payload")).chain(
        mismatched
            .iter()
            .map(|id| (*id, "is not the transmission of its own transaction")),
    ) {
        let view = store.transaction(id).await.unwrap().unwrap();
        assert_eq!(view.status, TransactionStatus::Failed, "transaction {id}");
        let events = store.events(id).await.unwrap();
        assert_eq!(events.len(), 1, "transaction {id}: {events:?}");
        assert_eq!(events[0].event_type, EventType::Failed);
        assert_eq!(events[0].correlation_id, view.correlation_id);
        let (status, error) = send_job_of(store, id).await;
        assert_eq!(status, JobStatus::Failed);
        assert!(error.unwrap_or_default().contains(why), "transaction {id}");
    }
    let summary = store.summary().await.unwrap();
    assert_eq!(
        (summary.conflicting_events, summary.duplicate_events),
        (0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_payloads_are_never_sent_and_fail_their_own_transaction_on_postgres() {
    let (db, store) = exchange_db().await;
    hostile_payloads_fail_their_own_transaction(&store, &PgPlanter(&db, &store)).await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_payloads_are_never_sent_and_fail_their_own_transaction_on_sqlite() {
    let (_dir, store) = sqlite_exchange("hostile_payloads_are_nev").await;
    hostile_payloads_fail_their_own_transaction(&store, &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_payloads_are_never_sent_and_fail_their_own_transaction_in_memory() {
    let store = MemExchange::new();
    hostile_payloads_fail_their_own_transaction(&store, &store).await;
}

/// Behind the handler's check, the hook's own: a success reported under another transaction's
/// payload, or under the job's own transaction with another key (by code that finalizes
/// without the handler), fails the job's own transaction.
async fn a_success_under_a_foreign_payload_fails_the_own_transaction<S: ExchangeStore>(
    store: &S,
    planter: &impl Planter,
) {
    let elsewhere = |view: &TransactionView| {
        json!({ "transaction_id": 999_999, "correlation_id": "k", "partner": "acme",
                "amount_minor": view.amount_minor })
    };
    let another_key = |view: &TransactionView| {
        serde_json::to_value(SendPayload {
            correlation_id: "someone-else".into(),
            ..own_payload(view)
        })
        .unwrap()
    };
    for make in [&elsewhere as &MakePayload, &another_key] {
        let id = planter.plant(make).await;
        let job = store
            .queue()
            .claim(ClaimRequest::new(1, Lease::DEFAULT))
            .await
            .unwrap()
            .jobs
            .remove(0);
        let outcome = finalize_with_hooks(store.queue(), &store.hooks(), &job, &Finalize::Complete)
            .await
            .unwrap();
        assert_eq!(outcome, FinalizeOutcome::Applied);
        assert_eq!(
            store.transaction(id).await.unwrap().unwrap().status,
            TransactionStatus::Failed
        );
        let events = store.events(id).await.unwrap();
        assert_eq!(
            events.iter().map(|e| e.event_type).collect::<Vec<_>>(),
            vec![EventType::Failed]
        );
    }
}

#[tokio::test]
async fn a_success_under_a_foreign_payload_fails_the_own_transaction_on_postgres() {
    let (db, store) = exchange_db().await;
    a_success_under_a_foreign_payload_fails_the_own_transaction(&store, &PgPlanter(&db, &store))
        .await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_success_under_a_foreign_payload_fails_the_own_transaction_on_sqlite() {
    let (_dir, store) = sqlite_exchange("a_success_under_a_foreig").await;
    a_success_under_a_foreign_payload_fails_the_own_transaction(&store, &store).await;
}

#[tokio::test]
async fn a_success_under_a_foreign_payload_fails_the_own_transaction_in_memory() {
    let store = MemExchange::new();
    a_success_under_a_foreign_payload_fails_the_own_transaction(&store, &store).await;
}

/// An operator cancels a pending send job: the hooks fail its transaction with an event in the
/// same transaction, and `retry_failed_transaction` sends it again under a new key.
async fn cancelling_a_pending_send_fails_its_transaction<S: ExchangeStore>(store: &S) {
    let id = store
        .create_transactions(&[("acme".into(), 3)])
        .await
        .unwrap()[0];
    let first_key = store.transaction(id).await.unwrap().unwrap().correlation_id;
    let job = store.send_jobs(id).await.unwrap()[0];
    assert_eq!(
        store.cancel_send_job(job).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Failed
    );
    assert_eq!(send_job_of(store, id).await.0, JobStatus::Cancelled);
    assert_eq!(
        store.cancel_send_job(job).await.unwrap(),
        CancelOutcome::AlreadyTerminal(JobStatus::Cancelled),
        "a second cancel changes nothing"
    );
    assert_eq!(store.events(id).await.unwrap().len(), 1);

    let RetryOutcome::Retried { correlation_id, .. } =
        store.retry_failed_transaction(id).await.unwrap()
    else {
        panic!("a cancelled send's transaction can be retried");
    };
    let server = acme_server(Duration::ZERO).await;
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let worker = start(store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(store, 1).await;
    worker.shutdown().await.unwrap();
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Success
    );
    let events: Vec<_> = store
        .events(id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.event_type, e.correlation_id))
        .collect();
    assert_eq!(
        events,
        vec![
            (EventType::Failed, first_key),
            (EventType::Sent, correlation_id)
        ]
    );
    assert_eq!(server.posts(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_pending_send_fails_its_transaction_on_postgres() {
    let (db, store) = exchange_db().await;
    cancelling_a_pending_send_fails_its_transaction(&store).await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_pending_send_fails_its_transaction_on_sqlite() {
    let (_dir, store) = sqlite_exchange("cancelling_a_pending_sen").await;
    cancelling_a_pending_send_fails_its_transaction(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_pending_send_fails_its_transaction_in_memory() {
    cancelling_a_pending_send_fails_its_transaction(&MemExchange::new()).await;
}

/// An operator's retry of an ended send job goes through `retry_failed_transaction`'s rules:
/// the transaction must be failed and the job its latest; the key is repointed after a
/// definitive failure (an operator's cancel of a pending send), the job carries the new
/// transmission, and the partner receives it once. A refused retry changes nothing.
async fn an_operators_retry_of_a_send_job_keeps_the_transaction_right<S: ExchangeStore>(store: &S) {
    let ids = store
        .create_transactions(&[("acme".into(), 5), ("acme".into(), 6)])
        .await
        .unwrap();
    let (id, other) = (ids[0], ids[1]);
    let first_key = store.transaction(id).await.unwrap().unwrap().correlation_id;
    let job = store.send_jobs(id).await.unwrap()[0];
    assert_eq!(
        store.cancel_send_job(job).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let hooks = store.hooks();
    let retried = retry_with_hooks(store.queue(), &hooks, JobId(job), JobStatus::Cancelled)
        .await
        .unwrap();
    assert!(matches!(retried, RetryTarget::Retried(_)), "{retried:?}");
    let reopened = store.transaction(id).await.unwrap().unwrap();
    assert_eq!(reopened.status, TransactionStatus::Pending);
    assert_eq!(reopened.retries, 1);
    assert_ne!(
        reopened.correlation_id, first_key,
        "a definitive failure repoints the key"
    );
    let payload = store
        .queue()
        .get(JobId(job))
        .await
        .unwrap()
        .unwrap()
        .payload;
    assert_eq!(payload["correlation_id"], json!(reopened.correlation_id));

    // The other transaction was retried the usual way: its first job is superseded.
    let old = store.send_jobs(other).await.unwrap()[0];
    assert_eq!(
        store.cancel_send_job(old).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert!(matches!(
        store.retry_failed_transaction(other).await.unwrap(),
        RetryOutcome::Retried { .. }
    ));
    let before = store.transaction(other).await.unwrap().unwrap();
    let refused = retry_with_hooks(store.queue(), &hooks, JobId(old), JobStatus::Cancelled).await;
    let err = refused.unwrap_err().to_string();
    assert!(err.contains("is not the latest"), "{err}");
    assert_eq!(store.transaction(other).await.unwrap().unwrap(), before);
    assert_eq!(send_job_of_id(store, old).await, JobStatus::Cancelled);

    let server = acme_server(Duration::ZERO).await;
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let worker = start(store, &partners, &quick(ExchangeConfig::default()));
    wait_terminal(store, 2).await;
    worker.shutdown().await.unwrap();
    for transaction in [id, other] {
        assert_eq!(
            store
                .transaction(transaction)
                .await
                .unwrap()
                .unwrap()
                .status,
            TransactionStatus::Success
        );
    }
    assert_eq!(server.posts(), 2, "each transaction sent once");
}

async fn send_job_of_id<S: ExchangeStore>(store: &S, job: i64) -> JobStatus {
    store.queue().get(JobId(job)).await.unwrap().unwrap().status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_retry_of_a_send_job_keeps_the_transaction_right_on_postgres() {
    let (db, store) = exchange_db().await;
    an_operators_retry_of_a_send_job_keeps_the_transaction_right(&store).await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_retry_of_a_send_job_keeps_the_transaction_right_on_sqlite() {
    let (_dir, store) = sqlite_exchange("an_operators_retry_of_a_").await;
    an_operators_retry_of_a_send_job_keeps_the_transaction_right(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_retry_of_a_send_job_keeps_the_transaction_right_in_memory() {
    an_operators_retry_of_a_send_job_keeps_the_transaction_right(&MemExchange::new()).await;
}

/// An operator cancels a send job while its send is at the partner: the worker learns it before
/// it would schedule the retry the partner's 503 asks for, and ends the job cancelled, its
/// transaction failed with one event, without sending again.
async fn cancelling_a_send_in_flight_ends_it_at_its_worker<S: ExchangeStore>(store: &S) {
    let server = PartnerServer::start(HashMap::from([("acme".to_owned(), Behavior::Held(503))]))
        .await
        .unwrap();
    let partners =
        Partners::new().with("acme", HttpPartner::new(&server.endpoint("acme")).unwrap());
    let id = store
        .create_transactions(&[("acme".into(), 4)])
        .await
        .unwrap()[0];
    let job = store.send_jobs(id).await.unwrap()[0];
    let worker = start(store, &partners, &quick(ExchangeConfig::default()));
    server.wait_posts(1).await;
    assert_eq!(
        store.cancel_send_job(job).await.unwrap(),
        CancelOutcome::Requested
    );
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Pending,
        "the holder ends the job, not the operator"
    );
    server.release();
    wait_terminal(store, 1).await;
    let report = worker.shutdown().await.unwrap();
    assert_eq!(report.stats.cancelled, 1, "{:?}", report.stats);
    assert_eq!(send_job_of(store, id).await.0, JobStatus::Cancelled);
    assert_eq!(
        store.transaction(id).await.unwrap().unwrap().status,
        TransactionStatus::Failed
    );
    assert_eq!(
        store
            .events(id)
            .await
            .unwrap()
            .iter()
            .map(|e| e.event_type)
            .collect::<Vec<_>>(),
        vec![EventType::Failed]
    );
    assert_eq!(server.posts(), 1, "a cancelled send is not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_send_in_flight_ends_it_at_its_worker_on_postgres() {
    let (db, store) = exchange_db().await;
    cancelling_a_send_in_flight_ends_it_at_its_worker(&store).await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_send_in_flight_ends_it_at_its_worker_on_sqlite() {
    let (_dir, store) = sqlite_exchange("cancelling_a_send_in_fli").await;
    cancelling_a_send_in_flight_ends_it_at_its_worker(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_send_in_flight_ends_it_at_its_worker_in_memory() {
    cancelling_a_send_in_flight_ends_it_at_its_worker(&MemExchange::new()).await;
}

/// `exchange-admin` runs queuectl's commands with the exchange's hooks: a cancel fails the
/// transaction with its event, a retry reopens it by `retry_failed_transaction`'s rules, and a
/// retry the rules refuse exits 4 and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_admin_keeps_transactions_right() {
    let (db, store) = exchange_db().await;
    let id = store
        .create_transactions(&[("acme".into(), 7)])
        .await
        .unwrap()[0];
    let first_key = store.transaction(id).await.unwrap().unwrap().correlation_id;
    let job = store.send_jobs(id).await.unwrap()[0].to_string();
    let admin = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_exchange-admin"))
            .env(
                "DATABASE_URL",
                format!("{}/{}", queue_postgres::testing::server_url(), db.name),
            )
            .arg("--json")
            .args(args)
            .output()
            .expect("run exchange-admin");
        let stdout: Value = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
        (output.status.code(), stdout)
    };
    let (code, out) = admin(&["jobs", "cancel", "--yes", &job]);
    assert_eq!(code, Some(0), "{out}");
    let failed = store.transaction(id).await.unwrap().unwrap();
    assert_eq!(failed.status, TransactionStatus::Failed);
    assert_eq!(
        store.events(id).await.unwrap().len(),
        1,
        "the cancel staged its event"
    );

    let (code, out) = admin(&["jobs", "retry", &job]);
    assert_eq!(code, Some(0), "{out}");
    let reopened = store.transaction(id).await.unwrap().unwrap();
    assert_eq!(reopened.status, TransactionStatus::Pending);
    assert_ne!(
        reopened.correlation_id, first_key,
        "the cancel was definitive: a new key"
    );

    // A job whose transaction is not failed (the job failed by hand, behind the hooks' back,
    // so its transaction is still pending) is refused: exit 4, nothing changed.
    sqlx::query(
        "UPDATE exchange_send_jobs SET status = 'failed', finished_at = now() WHERE id = $1",
    )
    .bind(job.parse::<i64>().unwrap())
    .execute(&db.pool)
    .await
    .unwrap();
    let (code, out) = admin(&["jobs", "retry", &job]);
    assert_eq!(code, Some(4), "{out}");
    assert!(
        out["jobs"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("only a failed transaction"),
        "{out}"
    );
    assert_eq!(store.transaction(id).await.unwrap().unwrap(), reopened);
    db.drop_db().await;
}

/// The send outcome on PostgreSQL for a batch of jobs in one transaction (how the worker
/// writes outcomes with hooks): each transaction is stamped with its own job's outcome through
/// the guard, with one event of the right generation each, and a stale job of the batch
/// stamps nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_outcomes_stamps_each_transaction_once() {
    let (db, store) = exchange_db().await;
    let ids = store
        .create_transactions(&[("acme".into(), 1), ("acme".into(), 2), ("acme".into(), 3)])
        .await
        .unwrap();
    let jobs = store
        .queue()
        .claim(ClaimRequest::new(3, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert_eq!(jobs.len(), 3);
    let payloads: Vec<SendPayload> = jobs
        .iter()
        .map(|j| serde_json::from_value(j.payload.clone()).unwrap())
        .collect();
    let failed = Finalize::Fail {
        error: "refused by the partner".into(),
    };
    let actions = [Finalize::Complete, failed, Finalize::Complete];
    let hooks = store.hooks();
    let mut tx = store.queue().begin().await.unwrap();
    let writes: Vec<_> = jobs
        .iter()
        .zip(&actions)
        .map(|(j, a)| (j.claim(), a.clone()))
        .collect();
    let outcomes = store
        .queue()
        .finalize_many_in(&mut tx, &writes)
        .await
        .unwrap();
    assert!(outcomes.iter().all(|o| *o == FinalizeOutcome::Applied));
    let events: Vec<FinalizeEvent<'_, SendPayload>> = (0..3)
        .map(|i| FinalizeEvent {
            job: &jobs[i],
            payload: Payload::Parsed(&payloads[i]),
            action: &actions[i],
        })
        .collect();
    hooks.run_batch(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let by_transaction: HashMap<i64, usize> = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| (p.transaction_id, i))
        .collect();
    for id in ids {
        let i = by_transaction[&id];
        let view = store.transaction(id).await.unwrap().unwrap();
        let wanted = match actions[i] {
            Finalize::Complete => TransactionStatus::Success,
            _ => TransactionStatus::Failed,
        };
        assert_eq!(view.status, wanted, "transaction {id}");
        let events = store.events(id).await.unwrap();
        assert_eq!(events.len(), 1, "transaction {id}: {events:?}");
        assert_eq!(events[0].claim_generation, jobs[i].generation.0);
    }
    db.drop_db().await;
}

/// A send job's partition is its partner: with one send at a time per partner
/// (`max_per_partition`), a claim takes one job of each partner, on every store.
async fn sends_take_turns_by_partner<S: ExchangeStore>(store: &S) {
    use queue_core::{Admin, QueueLimits};
    let partners = [("acme", 1), ("acme", 2), ("acme", 3), ("globex", 4)];
    let partners: Vec<(String, i64)> = partners.iter().map(|(p, a)| (p.to_string(), *a)).collect();
    store.create_transactions(&partners).await.unwrap();
    let queue = store.queue();
    queue
        .set_limits(QueueLimits {
            max_per_partition: Some(1),
            ..QueueLimits::NONE
        })
        .await
        .unwrap();
    let jobs = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    let mut keys = Vec::new();
    for job in &jobs {
        keys.push(queue.get(job.id).await.unwrap().unwrap().partition_key);
    }
    keys.sort();
    assert_eq!(
        keys,
        [Some("acme".to_owned()), Some("globex".to_owned())],
        "one send at a time per partner"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_take_turns_by_partner_on_every_store() {
    let (db, pg) = exchange_db().await;
    sends_take_turns_by_partner(&pg).await;
    db.drop_db().await;
    let (_dir, sqlite) = sqlite_exchange("partner-turns").await;
    sends_take_turns_by_partner(&sqlite).await;
    sends_take_turns_by_partner(&MemExchange::new()).await;
}
