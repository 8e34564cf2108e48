//! The queue-core conformance suite against SQLite: one database file per case, in a temporary
//! directory, WAL mode, the framework's migrations applied.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use queue_core::conformance::Harness;
use queue_core::{JobId, QueueName};
use queue_sqlite::{OpenOptions, SqliteQueue, SqliteQueueConfig};
use serde_json::Value;

struct Sqlite {
    dir: PathBuf,
    queue: SqliteQueue,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl Harness for Sqlite {
    type Backend = SqliteQueue;

    async fn setup() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "queue-sqlite-conformance-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let pool = queue_sqlite::open_pool(dir.join("queue.db"), &OpenOptions::default())
            .await
            .expect("a database file");
        queue_sqlite::migrate(&pool).await.expect("the migrations");
        let queue = SqliteQueue::connect(pool, SqliteQueueConfig::default())
            .await
            .expect("the schema check");
        Sqlite { dir, queue }
    }

    fn backend(&self) -> &SqliteQueue {
        &self.queue
    }

    async fn advance_clock(&self, by: Duration) {
        sqlx::query(
            "UPDATE queue_jobs SET
                 next_attempt_at = next_attempt_at - ?1,
                 claimed_at = claimed_at - ?1,
                 lease_expires_at = lease_expires_at - ?1,
                 created_at = created_at - ?1,
                 updated_at = updated_at - ?1,
                 finished_at = finished_at - ?1",
        )
        .bind(by.as_secs_f64())
        .execute(self.queue.pool())
        .await
        .expect("age the rows");
        // The rate limits' logs of recent claims ([epoch ms, jobs] pairs) age with them.
        sqlx::query(
            "UPDATE queue_jobs_queues SET rate_log = (
                 SELECT json_group_array(json_array(json_extract(e.value, '$[0]') - ?1 * 1000,
                                                    json_extract(e.value, '$[1]')))
                 FROM json_each(queue_jobs_queues.rate_log) AS e)",
        )
        .bind(by.as_secs_f64())
        .execute(self.queue.pool())
        .await
        .expect("age the rate logs");
        // And the partitions' logs, with the last claim each logged.
        sqlx::query(
            "UPDATE queue_jobs_starts SET last_at = last_at - ?1, rate_log = (
                 SELECT json_group_array(json_array(json_extract(e.value, '$[0]') - ?1 * 1000,
                                                    json_extract(e.value, '$[1]')))
                 FROM json_each(queue_jobs_starts.rate_log) AS e)",
        )
        .bind(by.as_secs_f64())
        .execute(self.queue.pool())
        .await
        .expect("age the partitions' rate logs");
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO queue_jobs (queue, status, payload, attempts, next_attempt_at)
             VALUES ('default', 'in_flight', ?1, 1, unixepoch('subsec') - 3600) RETURNING id",
        )
        .bind(payload.to_string())
        .fetch_one(self.queue.pool())
        .await
        .expect("a legacy row");
        JobId(id)
    }

    fn other_queue(&self, queue: QueueName) -> SqliteQueue {
        queue_core::Admin::for_queue(&self.queue, queue)
    }

    async fn teardown(&self) {
        self.queue.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

queue_core::conformance_suite!(Sqlite);
