//! The queue-core conformance suite against PostgreSQL, once per driver (sqlx, and
//! tokio-postgres + deadpool-postgres), one scratch database per case.

mod support;

use std::time::Duration;

use queue_core::JobId;
use queue_core::conformance::Harness;
use queue_postgres::PostgresQueue;
use serde_json::Value;
use support::{TestDb, TestDriver};

/// A scratch database with the framework's migrations, and a queue on its standard table (its
/// queue rows start with room grants on, the default).
struct Pg<D: TestDriver> {
    db: TestDb,
    queue: PostgresQueue<D>,
}

impl<D: TestDriver> Harness for Pg<D> {
    type Backend = PostgresQueue<D>;

    async fn setup() -> Self {
        let db = TestDb::new().await;
        let queue = support::connect_default(&db).await;
        Pg { db, queue }
    }

    fn backend(&self) -> &PostgresQueue<D> {
        &self.queue
    }

    async fn advance_clock(&self, by: Duration) {
        support::shift_time(&self.db.pool, "queue_jobs", by).await;
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        support::insert_legacy_in_flight(&self.db.pool, "queue_jobs", "default", payload).await
    }

    fn other_queue(&self, queue: queue_core::QueueName) -> PostgresQueue<D> {
        queue_core::Admin::for_queue(&self.queue, queue)
    }

    async fn teardown(&self) {
        self.db.drop_db().await;
    }
}

/// [`Pg`] with the queue's row starting with room grants off (as every queue did before
/// grants were on by default; docs/operations.md, "Room grants"): the limits' and partitions'
/// topics hold whether claims go ahead of the queue's row lock or take it.
struct PgClaimingAhead<D: TestDriver>(Pg<D>);

impl<D: TestDriver> Harness for PgClaimingAhead<D> {
    type Backend = PostgresQueue<D>;

    async fn setup() -> Self {
        let db = TestDb::new().await;
        let queue = support::connect_claiming_ahead(&db).await;
        PgClaimingAhead(Pg { db, queue })
    }

    fn backend(&self) -> &PostgresQueue<D> {
        self.0.backend()
    }

    async fn advance_clock(&self, by: Duration) {
        self.0.advance_clock(by).await;
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        self.0.insert_legacy_in_flight(payload).await
    }

    fn other_queue(&self, queue: queue_core::QueueName) -> PostgresQueue<D> {
        self.0.other_queue(queue)
    }

    async fn teardown(&self) {
        self.0.teardown().await;
    }
}

mod sqlx_driver {
    queue_core::conformance_suite!(super::Pg<queue_postgres::Sqlx>);
}

mod sqlx_claiming_ahead {
    queue_core::__conformance_limits!(super::PgClaimingAhead<queue_postgres::Sqlx>);
    queue_core::__conformance_partitions!(super::PgClaimingAhead<queue_postgres::Sqlx>);
}

#[cfg(feature = "tokio-postgres")]
mod tokio_postgres_driver {
    queue_core::conformance_suite!(super::Pg<queue_postgres::TokioPostgres>);
}

#[cfg(feature = "tokio-postgres")]
mod tokio_postgres_claiming_ahead {
    queue_core::__conformance_limits!(super::PgClaimingAhead<queue_postgres::TokioPostgres>);
    queue_core::__conformance_partitions!(super::PgClaimingAhead<queue_postgres::TokioPostgres>);
}
