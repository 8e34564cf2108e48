//! The framework's conformance suite against this service's queue table, `receipt_jobs`: one
//! test per guarantee, each on a scratch database with the service's own migrations applied.

use std::time::Duration;

use queue_core::conformance::Harness;
use queue_core::{JobId, QueueName};
use queue_postgres::testing::{ScratchDb, age_rows};
use queue_postgres::{PgQueue, PgQueueConfig, TableName};
use serde_json::Value;

struct ReceiptJobs {
    db: ScratchDb,
    queue: PgQueue,
}

fn table() -> TableName {
    TableName::new("receipt_jobs").expect("a valid table name")
}

impl Harness for ReceiptJobs {
    type Backend = PgQueue;

    async fn setup() -> Self {
        let db = ScratchDb::empty().await;
        sqlx::migrate!()
            .run(&db.pool)
            .await
            .expect("the service's migrations");
        let config = PgQueueConfig::new(table(), QueueName::new("receipts").unwrap());
        let queue = PgQueue::connect(db.pool.clone(), config)
            .await
            .expect("the schema check");
        ReceiptJobs { db, queue }
    }

    fn backend(&self) -> &PgQueue {
        &self.queue
    }

    async fn advance_clock(&self, by: Duration) {
        age_rows(&self.db.pool, &table(), by).await;
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO receipt_jobs (queue, status, payload, attempts, next_attempt_at)
             VALUES ('receipts', 'in_flight', $1, 1, now() - interval '1 hour') RETURNING id",
        )
        .bind(payload)
        .fetch_one(&self.db.pool)
        .await
        .expect("insert a legacy row");
        JobId(id)
    }

    fn other_queue(&self, queue: QueueName) -> PgQueue {
        queue_core::Admin::for_queue(&self.queue, queue)
    }

    async fn teardown(&self) {
        self.db.drop_db().await;
    }
}

queue_core::conformance_suite!(ReceiptJobs);
