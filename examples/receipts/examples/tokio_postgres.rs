//! The receipt queue on tokio-postgres + deadpool-postgres: the pool, the start-up check, an
//! enqueue in the caller's transaction, the same hook as on sqlx, a worker.
//! DATABASE_URL=postgres://… cargo run --example tokio_postgres (after the service's migrations)

use queue_core::{BoxError, NewJob, QueueName, Worker, WorkerConfig};
use queue_postgres::{PgQueueConfig, TableName, TokioPostgresQueue};
use receipts::{hooks, receipt};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let pg: tokio_postgres::Config = std::env::var("DATABASE_URL")?.parse()?;
    let manager = deadpool_postgres::Manager::new(pg.clone(), tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(12)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()?;

    let table = TableName::new("receipt_jobs")?;
    let config = PgQueueConfig::new(table, QueueName::new("receipts")?);
    // The same schema check as on sqlx; `pg` opens the LISTEN connection (use
    // `connect_with_tls` with the Manager's TLS connector when the database needs TLS).
    let queue = TokioPostgresQueue::connect(pool.clone(), config, pg).await?;

    // An order and its receipt job in one transaction of yours.
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let email = "ada@example.com";
    let sql = "INSERT INTO orders (email) VALUES ($1) RETURNING id";
    let order_id: i64 = tx.query_one(sql, &[&email]).await?.get(0);
    let receipt = receipt::SendReceipt {
        order_id,
        email: email.to_owned(),
    };
    let job = NewJob::new(&receipt)?.unique_key(format!("receipt-{order_id}"));
    queue.enqueue_with((&tx).into(), vec![job]).await?;
    tx.commit().await?; // the NOTIFY is delivered now
    drop(client);

    let handler = receipt::ReceiptHandler::new(receipt::Mailer::default());
    let worker = Worker::new(queue.clone(), handler, WorkerConfig::default())?
        .hook(hooks::MarkReceiptSent)
        .start();
    worker.wait_for(|s| s.completed >= 1).await;
    let report = worker.shutdown().await?;
    println!("{} completed", report.stats.completed);
    Ok(())
}
