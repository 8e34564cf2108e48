//! Placing an order: the order row and its receipt job commit together, or neither does.

use queue_core::{Backend, BoxError, Enqueued, NewJob, UniqueScope};
use queue_postgres::PgQueue;
use sqlx::PgPool;

use crate::receipt::SendReceipt;

/// Stores an order and enqueues its receipt in the same transaction.
pub async fn place_order(pool: &PgPool, queue: &PgQueue, email: &str) -> Result<i64, BoxError> {
    let mut tx = pool.begin().await?;
    let order_id: i64 = sqlx::query_scalar("INSERT INTO orders (email) VALUES ($1) RETURNING id")
        .bind(email)
        .fetch_one(&mut *tx)
        .await?;
    let receipt = SendReceipt {
        order_id,
        email: email.to_owned(),
    };
    let job = NewJob::new(&receipt)?
        .unique_key(format!("receipt-{order_id}"))
        .partition_key(recipient_domain(email));
    // Any `&mut PgConnection` works: here, the order's own transaction.
    queue.enqueue_with(&mut tx, vec![job]).await?;
    tx.commit().await?; // the NOTIFY that wakes idle workers is delivered now
    Ok(order_id)
}

/// The same with your own INSERT (for a table with extra columns the framework does not
/// know): send the wake-up yourself.
pub async fn place_order_own_insert(
    pool: &PgPool,
    queue: &PgQueue,
    email: &str,
) -> Result<i64, BoxError> {
    let mut tx = pool.begin().await?;
    let order_id: i64 = sqlx::query_scalar("INSERT INTO orders (email) VALUES ($1) RETURNING id")
        .bind(email)
        .fetch_one(&mut *tx)
        .await?;
    let payload = serde_json::to_value(SendReceipt {
        order_id,
        email: email.to_owned(),
    })?;
    sqlx::query("INSERT INTO receipt_jobs (queue, payload) VALUES ($1, $2)")
        .bind(queue.config().queue.as_str())
        .bind(payload)
        .execute(&mut *tx)
        .await?;
    queue.notify_in(&mut tx).await?;
    tx.commit().await?;
    Ok(order_id)
}

/// Sends an order's receipt again: the customer's "resend" button. However often it is
/// pressed, one resend of an order waits or runs at a time; a press while one waits gives it
/// the newest address instead of queueing another, and once it was sent the next press sends
/// again.
pub async fn resend_receipt<B: Backend>(
    queue: &B,
    order_id: i64,
    email: &str,
) -> Result<Enqueued, BoxError> {
    let receipt = SendReceipt {
        order_id,
        email: email.to_owned(),
    };
    let job = NewJob::new(&receipt)?
        .unique_key(format!("resend-{order_id}"))
        .unique_while(&UniqueScope::UNFINISHED)
        .replace_pending()
        .partition_key(recipient_domain(email));
    Ok(queue.enqueue(job).await?)
}

/// A receipt's partition: the recipient's mail domain, lowercased (the queue lets at most so
/// many mails at once go to one domain, `crate::limits`). A partition key is at most 200 bytes
/// (`queue_core::limits::MAX_PARTITION_KEY_BYTES`); a domain is at most 253.
pub fn recipient_domain(email: &str) -> String {
    let domain = email.rsplit_once('@').map_or("", |(_, domain)| domain);
    let mut key: String = domain.to_lowercase();
    while key.len() > queue_core::limits::MAX_PARTITION_KEY_BYTES {
        key.pop();
    }
    if key.is_empty() {
        "no-domain".to_owned()
    } else {
        key
    }
}
