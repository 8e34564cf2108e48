//! The receipts service: a queue in a table of its own, a worker, a graceful shutdown.

use std::time::Duration;

use queue_core::{BoxError, QueueName, Worker, WorkerConfig};
use queue_postgres::{PgQueue, PgQueueConfig, TableName};
use receipts::{hooks, limits, orders, receipt, schedule};
use sqlx::postgres::PgPoolOptions;
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")?;
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await?;
    // The service's own migrations: `orders`, then the queue table `receipt_jobs`.
    sqlx::migrate!().run(&pool).await?;

    let table = TableName::new("receipt_jobs")?;
    let config = PgQueueConfig::new(table, QueueName::new("receipts")?);
    // Checks the table's schema first: refuses a table without the lease columns and indexes.
    let queue = PgQueue::connect(pool.clone(), config).await?;
    // What the mail server takes, for every worker of every process.
    limits::apply(&queue).await?;

    let worker_config = WorkerConfig {
        concurrency: 8,
        job_timeout: Duration::from_secs(30), // lease 90 s (default) >= 2 × 30 s
        ..WorkerConfig::default()
    };
    let mailer = receipt::Mailer::default();
    let handler = receipt::ReceiptHandler::new(mailer.clone());
    // Refuses an invalid configuration (queue_core::Error::Config) before anything runs.
    let worker = Worker::new(queue.clone(), handler, worker_config)?
        .hook(hooks::MarkReceiptSent)
        .start();
    // The daily canary and retention; refuses retention shorter than a schedule looks back.
    let scheduler = schedule::scheduler(queue.clone())?.start()?;

    // For the demo, two orders; a real service enqueues from its request handlers.
    let first = orders::place_order(&pool, &queue, "ada@example.com").await?;
    let second = orders::place_order_own_insert(&pool, &queue, "bob@example.com").await?;
    println!("placed orders {first} and {second}");

    // Kubernetes and systemd stop a process with SIGTERM; Ctrl-C sends SIGINT.
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    scheduler.shutdown().await;
    let report = worker.shutdown().await?;
    println!(
        "stopped: {} released unstarted, {} finished in time, {} aborted; {} completed in all",
        report.released_unstarted, report.finished_in_time, report.aborted, report.stats.completed
    );
    println!("idempotency keys sent: {:?}", mailer.sent());
    Ok(())
}
