//! The queue-core conformance suite against PostgreSQL (the sqlx driver), one scratch database
//! per case.

mod support;

use std::time::Duration;

use queue_core::JobId;
use queue_core::conformance::Harness;
use queue_postgres::PgQueue;
use serde_json::Value;
use support::TestDb;

struct Postgres {
    db: TestDb,
    queue: PgQueue,
}

impl Harness for Postgres {
    type Backend = PgQueue;

    async fn setup() -> Self {
        let db = TestDb::new().await;
        let queue = db.queue().await;
        Postgres { db, queue }
    }

    fn backend(&self) -> &PgQueue {
        &self.queue
    }

    async fn advance_clock(&self, by: Duration) {
        support::shift_time(&self.db.pool, "queue_jobs", by).await;
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        support::insert_legacy_in_flight(&self.db.pool, "queue_jobs", "default", payload).await
    }

    async fn teardown(&self) {
        self.db.drop_db().await;
    }
}

queue_core::conformance_suite!(Postgres);
