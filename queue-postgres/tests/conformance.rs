//! The queue-core conformance suite against PostgreSQL, once per driver (sqlx, and
//! tokio-postgres + deadpool-postgres), one scratch database per case.

mod support;

use std::time::Duration;

use queue_core::JobId;
use queue_core::conformance::Harness;
use queue_postgres::PgQueue;
use serde_json::Value;
use support::TestDb;

/// What both harnesses share: the scratch database and its time travel.
async fn age(db: &TestDb, by: Duration) {
    support::shift_time(&db.pool, "queue_jobs", by).await;
}

async fn legacy(db: &TestDb, payload: Value) -> JobId {
    support::insert_legacy_in_flight(&db.pool, "queue_jobs", "default", payload).await
}

struct Sqlx {
    db: TestDb,
    queue: PgQueue,
}

impl Harness for Sqlx {
    type Backend = PgQueue;

    async fn setup() -> Self {
        let db = TestDb::new().await;
        let queue = db.queue().await;
        Sqlx { db, queue }
    }

    fn backend(&self) -> &PgQueue {
        &self.queue
    }

    async fn advance_clock(&self, by: Duration) {
        age(&self.db, by).await;
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        legacy(&self.db, payload).await
    }

    async fn teardown(&self) {
        self.db.drop_db().await;
    }
}

mod sqlx_driver {
    queue_core::conformance_suite!(super::Sqlx);
}

#[cfg(feature = "tokio-postgres")]
struct TokioPostgres {
    db: TestDb,
    queue: queue_postgres::TpQueue,
}

#[cfg(feature = "tokio-postgres")]
impl Harness for TokioPostgres {
    type Backend = queue_postgres::TpQueue;

    async fn setup() -> Self {
        let db = TestDb::new().await;
        let queue = <support::TokioPostgres as support::Driver>::connect_default(&db).await;
        TokioPostgres { db, queue }
    }

    fn backend(&self) -> &queue_postgres::TpQueue {
        &self.queue
    }

    async fn advance_clock(&self, by: Duration) {
        age(&self.db, by).await;
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        legacy(&self.db, payload).await
    }

    async fn teardown(&self) {
        self.db.drop_db().await;
    }
}

#[cfg(feature = "tokio-postgres")]
mod tokio_postgres_driver {
    queue_core::conformance_suite!(super::TokioPostgres);
}
