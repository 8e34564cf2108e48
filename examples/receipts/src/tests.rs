//! Tests of the receipt queue: on the in-memory backend, and on a scratch PostgreSQL database.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use queue_core::{
    Backend, BoxError, ClaimRequest, Finalize, FinalizeEvent, FinalizeHook, FinalizeOutcome,
    JobStatus, Lease, MemoryBackend, MemoryTx, NewJob, QueueName, RateLimit, Worker, WorkerConfig,
};
use queue_postgres::testing::{ScratchDb, age_rows};
use queue_postgres::{PgQueue, PgQueueConfig, TableName};

use crate::receipt::{Mailer, ReceiptHandler, SendReceipt};

fn receipt(order_id: i64, email: &str) -> Result<NewJob, BoxError> {
    let email = email.to_owned();
    Ok(NewJob::new(&SendReceipt { order_id, email })?)
}

/// Polls often, so that tests do not wait a second for each retry.
fn quick() -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_millis(20),
        ..WorkerConfig::default()
    }
}

/// Long enough for any of these tests; a broken one fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_receipt_is_sent_once_and_a_bounce_fails_without_retry() -> Result<(), BoxError> {
    let queue = MemoryBackend::new();
    let good = queue.enqueue(receipt(7, "ada@example.com")?).await?.id;
    let bounced = queue.enqueue(receipt(8, "bob@bounce.example")?).await?.id;
    let mailer = Mailer::default();
    let handler = ReceiptHandler::new(mailer.clone());
    let worker = Worker::new(queue.clone(), handler, quick())?.start();
    worker
        .wait_for_timeout(PATIENCE, |s| s.completed == 1 && s.failed == 1)
        .await?;
    worker.shutdown().await?;
    assert_eq!(queue.get(good).await?.unwrap().status, JobStatus::Completed);
    let failed = queue.get(bounced).await?.unwrap();
    assert_eq!((failed.status, failed.attempts), (JobStatus::Failed, 1));
    assert_eq!(mailer.sent(), vec!["receipt-7".to_owned()]);
    Ok(())
}

/// Counts completions; the count moves only when the finalize transaction commits.
struct CountSent(Arc<AtomicU64>);

impl FinalizeHook<MemoryTx, SendReceipt> for CountSent {
    async fn after_applied(
        &self,
        tx: &mut MemoryTx,
        event: &FinalizeEvent<'_, SendReceipt>,
    ) -> Result<(), BoxError> {
        if matches!(event.action, Finalize::Complete) {
            let count = self.0.clone();
            tx.on_commit(move || {
                count.fetch_add(1, Ordering::SeqCst);
            });
        }
        Ok(())
    }
}

#[tokio::test]
async fn the_hook_runs_once_per_applied_completion() -> Result<(), BoxError> {
    let queue = MemoryBackend::new();
    for order_id in 1..=3 {
        queue.enqueue(receipt(order_id, "ada@example.com")?).await?;
    }
    let count = Arc::new(AtomicU64::new(0));
    let handler = ReceiptHandler::new(Mailer::default());
    let worker = Worker::new(queue.clone(), handler, quick())?
        .hook(CountSent(count.clone()))
        .start();
    worker
        .wait_for_timeout(PATIENCE, |s| s.completed == 3)
        .await?;
    worker.shutdown().await?;
    assert_eq!(count.load(Ordering::SeqCst), 3);
    Ok(())
}

#[tokio::test]
async fn a_worker_that_lost_its_lease_cannot_finalize() -> Result<(), BoxError> {
    let queue = MemoryBackend::new();
    queue.enqueue(receipt(9, "ada@example.com")?).await?;
    let request = ClaimRequest::new(1, Lease::DEFAULT);
    let old = queue.claim(request.clone()).await?.jobs.remove(0);
    // The backend's clock moves; the lease (90 s) expires; another worker takes the job over.
    queue.advance_clock(Duration::from_secs(91));
    let new = queue.claim(request.clone()).await?.jobs.remove(0);
    assert_eq!(new.generation.0, old.generation.0 + 1);
    let stale = queue.finalize(old.claim(), &Finalize::Complete).await?;
    assert_eq!(stale, FinalizeOutcome::Stale);
    let applied = queue.finalize(new.claim(), &Finalize::Complete).await?;
    assert_eq!(applied, FinalizeOutcome::Applied);
    Ok(())
}

#[test]
fn the_receipt_jobs_migrations_are_what_the_framework_generates() {
    // Statements only: comments may change between framework releases, and a migration that
    // has been applied must never be edited (its checksum is recorded).
    let statements = |sql: &str| -> Vec<String> {
        sql.lines()
            .filter(|line| !line.trim_start().starts_with("--") && !line.trim().is_empty())
            .map(str::to_owned)
            .collect()
    };
    let committed = [
        include_str!("../migrations/20260301000002_receipt_jobs.sql"),
        include_str!("../migrations/20260301000003_receipt_jobs_lease_and_cancel_request.sql"),
        include_str!(
            "../migrations/20260301000004_receipt_jobs_holder_errors_and_queue_controls.sql"
        ),
        include_str!("../migrations/20260301000005_receipt_jobs_claim_token.sql"),
        include_str!("../migrations/20260301000006_receipt_jobs_queue_limits.sql"),
        include_str!("../migrations/20260301000007_receipt_jobs_partitions_and_schedules.sql"),
        include_str!("../migrations/20260301000008_receipt_jobs_partition_rates.sql"),
        include_str!("../migrations/20260301000009_receipt_jobs_partition_rate_tally.sql"),
        include_str!("../migrations/20260301000010_receipt_jobs_partition_slots.sql"),
        include_str!("../migrations/20260301000011_receipt_jobs_claim_counts.sql"),
        include_str!("../migrations/20260301000012_receipt_jobs_claim_slots.sql"),
        include_str!("../migrations/20260301000013_receipt_jobs_room_grants.sql"),
        include_str!("../migrations/20260301000014_receipt_jobs_grant_fence.sql"),
    ]
    .join("\n");
    let table = TableName::new("receipt_jobs").unwrap();
    let generated = queue_postgres::create_table_sql(&table);
    assert_eq!(
        statements(&committed),
        statements(&generated),
        "the framework added a table migration: commit table_migration_sql as a new migration"
    );
}

/// Needs PostgreSQL: QUEUE_TEST_PG_URL, or postgres://postgres@127.0.0.1:5432 (no database
/// name: each test creates its own database).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_and_its_receipt_commit_together_on_postgres() -> Result<(), BoxError> {
    let db = ScratchDb::empty().await;
    sqlx::migrate!().run(&db.pool).await?;
    let table = TableName::new("receipt_jobs")?;
    let config = PgQueueConfig::new(table.clone(), QueueName::new("receipts")?);
    let queue = PgQueue::connect(db.pool.clone(), config).await?;

    let order_id = crate::orders::place_order(&db.pool, &queue, "ada@example.com").await?;
    let handler = ReceiptHandler::new(Mailer::default());
    let worker = Worker::new(queue.clone(), handler, quick())?
        .hook(crate::hooks::MarkReceiptSent)
        .start();
    worker
        .wait_for_timeout(PATIENCE, |s| s.completed == 1)
        .await?;
    worker.shutdown().await?;
    let sql = "SELECT receipt_sent_at IS NOT NULL FROM orders WHERE id = $1";
    let marked: bool = sqlx::query_scalar(sql)
        .bind(order_id)
        .fetch_one(&db.pool)
        .await?;
    assert!(marked, "the hook's write committed with the job");

    // Expire a lease without sleeping: move the table's timestamps back.
    crate::orders::place_order_own_insert(&db.pool, &queue, "bob@example.com").await?;
    let request = ClaimRequest::new(1, Lease::DEFAULT);
    let old = queue.claim(request.clone()).await?.jobs.remove(0);
    age_rows(&db.pool, &table, Duration::from_secs(91)).await;
    let new = queue.claim(request.clone()).await?.jobs.remove(0);
    let mut conn = db.pool.acquire().await?;
    let items = [
        (old.claim(), Finalize::Complete),
        (new.claim(), Finalize::Complete),
    ];
    let outcomes = queue.finalize_with(&mut conn, &items).await?;
    assert_eq!(outcomes, [FinalizeOutcome::Stale, FinalizeOutcome::Applied]);
    drop(conn);
    db.drop_db().await;
    Ok(())
}

/// The canary is enqueued once a day at 07:00 Berlin time (06:00 UTC in winter), a receipt the
/// handler sends like any other; the scheduler's clock is moved, not waited for.
#[tokio::test]
async fn the_daily_canary_is_enqueued_at_seven_in_berlin() -> Result<(), BoxError> {
    use queue_core::schedule::{Clock, ManualClock};
    let queue = MemoryBackend::new();
    let clock = ManualClock::new("2026-01-10T05:59:00Z".parse()?);
    let scheduler = crate::schedule::scheduler(queue.clone())?
        .clock(clock.clone())
        .start()?;
    let seven: chrono::DateTime<chrono::Utc> = "2026-01-10T06:00:00Z".parse()?;
    let before = scheduler.wait_for(|s| s.seen >= Some(clock.now())).await;
    assert_eq!(before.schedules["canary-receipt"].next, Some(seven));
    clock.advance(Duration::from_secs(60));
    let after = scheduler.wait_for(|s| s.seen >= Some(clock.now())).await;
    assert_eq!(after.schedules["canary-receipt"].enqueued, 1);
    scheduler.shutdown().await;
    let canary = queue
        .claim(ClaimRequest::new(1, Lease::DEFAULT))
        .await?
        .jobs
        .remove(0);
    let payload: SendReceipt = serde_json::from_value(canary.payload)?;
    assert_eq!(payload.email, "ops@example.com");
    assert_eq!(payload.order_id, -(seven.timestamp() / 86_400));
    Ok(())
}

#[tokio::test]
async fn a_resend_waits_once_takes_the_newest_address_and_sends_again_later() -> Result<(), BoxError>
{
    let queue = MemoryBackend::new();
    let first = crate::orders::resend_receipt(&queue, 7, "ada@example.com").await?;
    let again = crate::orders::resend_receipt(&queue, 7, "ada@new.example").await?;
    assert!(!first.duplicate);
    assert!(again.replaced && again.id == first.id, "{again:?}");
    let claimed = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await?
        .jobs;
    assert_eq!(claimed.len(), 1, "one resend, however often pressed");
    assert_eq!(claimed[0].payload["email"], "ada@new.example");
    let running = crate::orders::resend_receipt(&queue, 7, "ada@third.example").await?;
    assert!(
        running.duplicate && !running.replaced,
        "the running one keeps its address"
    );
    let sent = queue
        .finalize(claimed[0].claim(), &Finalize::Complete)
        .await?;
    assert!(sent.is_applied());
    let later = crate::orders::resend_receipt(&queue, 7, "ada@new.example").await?;
    assert!(!later.duplicate, "sent: the next press sends again");
    Ok(())
}

#[tokio::test]
async fn the_mail_servers_limits_hold_for_every_worker() -> Result<(), BoxError> {
    let queue = MemoryBackend::new();
    for n in 0..30 {
        queue.enqueue(receipt(n, "ada@example.com")?).await?;
    }
    let control = crate::limits::apply(&queue).await?;
    assert_eq!(control.limits.max_in_flight, Some(10));
    assert_eq!(control.limits.max_per_partition, Some(2));
    assert_eq!(
        control.limits.rate_per_partition,
        Some(RateLimit::new(30, Duration::from_secs(60))?)
    );
    let request = || ClaimRequest::new(25, Lease::DEFAULT);
    let (one, other) = (queue.clone(), queue.clone());
    let (a, b) = tokio::join!(one.claim(request()), other.claim(request()));
    assert_eq!(
        a?.jobs.len() + b?.jobs.len(),
        10,
        "10 at once, however many claim"
    );
    Ok(())
}

/// One domain gets 30 receipts a minute however fast they are sent: the 31st waits for the
/// window to slide, while another domain's receipt goes out at once.
#[tokio::test]
async fn a_domain_gets_thirty_receipts_a_minute() -> Result<(), BoxError> {
    let queue = MemoryBackend::new();
    crate::limits::apply(&queue).await?;
    for n in 0..40 {
        crate::orders::resend_receipt(&queue, n, "buyer@big.example").await?;
    }
    let mut sent = 0;
    loop {
        let jobs = queue
            .claim(ClaimRequest::new(10, Lease::DEFAULT))
            .await?
            .jobs;
        if jobs.is_empty() {
            break;
        }
        for job in &jobs {
            assert!(
                queue
                    .finalize(job.claim(), &Finalize::Complete)
                    .await?
                    .is_applied()
            );
        }
        sent += jobs.len();
    }
    assert_eq!(sent, 30, "a minute's receipts to big.example, and no more");
    crate::orders::resend_receipt(&queue, 100, "ada@small.example").await?;
    let other = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await?
        .jobs;
    assert_eq!(other.len(), 1, "small.example's receipt is not held back");
    Ok(())
}

/// A burst of receipts to one domain takes two slots at a time; the other domains' receipts run
/// beside it instead of waiting behind it.
#[tokio::test]
async fn one_domains_burst_does_not_hold_back_the_others() -> Result<(), BoxError> {
    let queue = MemoryBackend::new();
    crate::limits::apply(&queue).await?;
    for n in 0..20 {
        crate::orders::resend_receipt(&queue, n, "buyer@Big.example").await?;
    }
    crate::orders::resend_receipt(&queue, 100, "ada@small.example").await?;
    crate::orders::resend_receipt(&queue, 101, "bob@other.example").await?;
    let jobs = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await?
        .jobs;
    let mut domains = Vec::new();
    for job in &jobs {
        domains.push(queue.get(job.id).await?.and_then(|j| j.partition_key));
    }
    domains.sort();
    assert_eq!(
        domains,
        [
            Some("big.example".to_owned()),
            Some("big.example".to_owned()),
            Some("other.example".to_owned()),
            Some("small.example".to_owned()),
        ],
        "two of the burst, and the receipt of each other domain"
    );
    assert_eq!(crate::orders::recipient_domain("no at sign"), "no-domain");
    Ok(())
}
