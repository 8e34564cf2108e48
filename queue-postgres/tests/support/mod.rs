//! What the PostgreSQL tests share beyond `queue_postgres::testing`.

#![allow(dead_code)]

use std::time::Duration;

use queue_core::JobId;
use queue_postgres::TableName;
use serde_json::Value;
use sqlx::PgPool;

pub use queue_postgres::testing::ScratchDb as TestDb;

/// Ages the rows of `table` by `by` (see `queue_postgres::testing::age_rows`).
pub async fn shift_time(pool: &PgPool, table: &str, by: Duration) {
    let table = TableName::new(table).expect("a valid table name");
    queue_postgres::testing::age_rows(pool, &table, by).await;
}

/// A row as a pre-lease release leaves it: in flight, no claim stamp, generation 0.
pub async fn insert_legacy_in_flight(
    pool: &PgPool,
    table: &str,
    queue: &str,
    payload: Value,
) -> JobId {
    let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{table}\" (queue, status, payload, attempts, next_attempt_at)
         VALUES ($1, 'in_flight', $2, 1, now() - interval '1 hour') RETURNING id"
    )))
    .bind(queue)
    .bind(payload)
    .fetch_one(pool)
    .await
    .expect("insert a legacy in-flight row");
    JobId(id)
}
