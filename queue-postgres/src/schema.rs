//! Creating, upgrading and checking queue tables.

#[cfg(feature = "sqlx")]
use std::sync::LazyLock;

use queue_core::QueueName;
#[cfg(feature = "sqlx")]
use sqlx::migrate::Migrator;
#[cfg(feature = "sqlx")]
use sqlx::{AssertSqlSafe, PgPool, Row};

use crate::error::PgError;
use crate::ident::{TableName, render};
use crate::sql;

/// The name of the table in which the framework records its own applied migrations, so that
/// they coexist with a service's own migrator (which keeps `_sqlx_migrations`): neither sees
/// the other's versions as missing.
pub const MIGRATIONS_TABLE: &str = "_queue_framework_migrations";

/// The framework's migrations, embedded from this crate's `migrations/` folder (so
/// `cargo package` carries them). They create the standard table `queue_jobs`.
#[cfg(feature = "sqlx")]
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
});

/// Applies the framework's migrations (idempotent; safe to run from every replica at start-up:
/// the migrator takes an advisory lock).
#[cfg(feature = "sqlx")]
pub async fn migrate(pool: &PgPool) -> Result<(), PgError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// The DDL of a new queue table named `table`: the framework's migrations, rendered for it.
/// Put it in your own migrations, or run it with [`install_table`].
pub fn create_table_sql(table: &TableName) -> String {
    sql::TABLE_MIGRATIONS
        .iter()
        .map(|(_, text)| render(text, table))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Creates (if missing) a queue table named `table` with the framework's schema.
#[cfg(feature = "sqlx")]
pub async fn install_table(pool: &PgPool, table: &TableName) -> Result<(), PgError> {
    sqlx::raw_sql(AssertSqlSafe(create_table_sql(table)))
        .execute(pool)
        .await?;
    Ok(())
}

/// The DDL that upgrades a legacy queue table in place to the lease schema (the seed's D1):
/// adds `claimed_at` (no backfill: NULL counts as an expired lease, so rows stranded in flight by
/// the old release are re-claimable at once) and `claim_generation`, the framework's other
/// columns with defaults (`queue` defaults to `queue`, so legacy rows belong to it), drops the old
/// stuck-job index if named, creates the partial indexes (lease: `WHERE status =
/// 'in_flight'`), and stamps `finished_at` on terminal rows so retention reaches them. The
/// indexes are built without `CONCURRENTLY` (a migration runs in a transaction): on a large
/// table, build them concurrently beforehand under the same names and the upgrade skips them.
///
/// Legacy status values outside the framework's vocabulary (`pending`, `in_flight`,
/// `completed`, `failed`, `dead`, `cancelled`) must be mapped by the adopter's own migration.
pub fn upgrade_legacy_sql(
    table: &TableName,
    queue: &QueueName,
    drop_index: Option<&str>,
) -> Result<String, PgError> {
    let mut ddl = String::new();
    if let Some(index) = drop_index {
        let valid = !index.is_empty()
            && index.len() <= 63
            && index
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid {
            return Err(PgError::InvalidIdentifier {
                what: "index name",
                value: index.to_owned(),
                reason: "use 1 to 63 lowercase ASCII letters, digits and '_'",
            });
        }
        ddl.push_str(&format!("DROP INDEX IF EXISTS \"{index}\";\n"));
    }
    // Queue names are validated to letters, digits and `_-.:`, so they cannot close the literal.
    ddl.push_str(&render(sql::UPGRADE_LEGACY, table).replace(
        "DEFAULT 'default'",
        &format!("DEFAULT '{}'", queue.as_str()),
    ));
    Ok(ddl)
}

/// Runs [`upgrade_legacy_sql`] in one transaction.
#[cfg(feature = "sqlx")]
pub async fn upgrade_legacy_table(
    pool: &PgPool,
    table: &TableName,
    queue: &QueueName,
    drop_index: Option<&str>,
) -> Result<(), PgError> {
    let ddl = upgrade_legacy_sql(table, queue, drop_index)?;
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(AssertSqlSafe(ddl)).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// The columns the lease protocol needs, with the type `format_type` reports.
const REQUIRED_COLUMNS: [(&str, &str); 15] = [
    ("id", "bigint"),
    ("queue", "text"),
    ("status", "text"),
    ("payload", "jsonb"),
    ("priority", "smallint"),
    ("attempts", "integer"),
    ("reclaims", "integer"),
    ("next_attempt_at", "timestamp with time zone"),
    ("claimed_at", "timestamp with time zone"),
    ("claim_generation", "bigint"),
    ("last_error", "text"),
    ("unique_key", "text"),
    ("created_at", "timestamp with time zone"),
    ("updated_at", "timestamp with time zone"),
    ("finished_at", "timestamp with time zone"),
];

/// The indexes the statements rely on, by suffix, with what each is for.
const REQUIRED_INDEXES: [(&str, &str); 4] = [
    ("due_idx", "the due pick of the claim"),
    (
        "lease_idx",
        "the partial lease index WHERE status = 'in_flight'",
    ),
    ("unique_idx", "unique keys"),
    ("finished_idx", "the retention sweep"),
];

/// What a driver read of a table, for [`evaluate_schema`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableFacts {
    /// `(column, format_type)` pairs; empty when the table does not exist.
    pub columns: Vec<(String, String)>,
    /// Index names.
    pub indexes: Vec<String>,
    /// Whether `id` draws from a sequence or identity.
    pub id_has_sequence: bool,
}

/// Refuses, naming what is missing, a table that is not on the lease schema: the judgement of
/// the start-up check, shared by both drivers (each reads the facts with [`sql::SCHEMA_COLUMNS`],
/// [`sql::SCHEMA_INDEXES`] and [`sql::SCHEMA_ID_SEQUENCE`]).
pub fn evaluate_schema(table: &TableName, facts: &TableFacts) -> Result<(), PgError> {
    if facts.columns.is_empty() {
        return Err(PgError::Schema {
            table: table.to_string(),
            missing: vec!["the table itself (not found on the search_path)".to_owned()],
        });
    }
    let mut missing = Vec::new();
    for (name, ty) in REQUIRED_COLUMNS {
        match facts.columns.iter().find(|(n, _)| n == name) {
            None => missing.push(format!("column {name} ({ty})")),
            Some((_, actual)) if actual != ty => {
                missing.push(format!("column {name} must be {ty}, found {actual}"))
            }
            Some(_) => {}
        }
    }
    for (suffix, purpose) in REQUIRED_INDEXES {
        let name = format!("{table}_{suffix}");
        if !facts.indexes.contains(&name) {
            missing.push(format!("index {name} ({purpose})"));
        }
    }
    if !facts.id_has_sequence {
        missing.push("a sequence or identity default on id".to_owned());
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(PgError::Schema {
            table: table.to_string(),
            missing,
        })
    }
}

/// Refuses, naming what is missing, a table that is not on the lease schema. Run at start-up
/// by [`crate::PgQueue::connect`]: a half-deployed fleet fails loudly instead of double-running.
#[cfg(feature = "sqlx")]
pub async fn check_schema(pool: &PgPool, table: &TableName) -> Result<(), PgError> {
    let quoted = table.quoted();
    let columns = sqlx::query(sql::SCHEMA_COLUMNS)
        .bind(&quoted)
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let indexes = sqlx::query(sql::SCHEMA_INDEXES)
        .bind(&quoted)
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    let id_has_sequence = sqlx::query_scalar::<_, Option<bool>>(sql::SCHEMA_ID_SEQUENCE)
        .bind(&quoted)
        .fetch_one(pool)
        .await
        .ok()
        .flatten()
        == Some(true);
    evaluate_schema(
        table,
        &TableFacts {
            columns,
            indexes,
            id_has_sequence,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "sqlx")]
    #[test]
    fn the_migrator_embeds_exactly_the_listed_table_migrations() {
        let embedded: Vec<(i64, &str)> = MIGRATOR
            .iter()
            .map(|m| (m.version, m.sql.as_str()))
            .collect();
        assert_eq!(embedded, sql::TABLE_MIGRATIONS.to_vec());
    }

    #[test]
    fn create_table_sql_is_the_migration_rendered() {
        let ddl = create_table_sql(&TableName::new("mail_jobs").unwrap());
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS \"mail_jobs\""));
        assert!(ddl.contains("\"mail_jobs_lease_idx\""));
        assert!(!ddl.contains("\"queue_jobs"));
    }

    #[test]
    fn upgrade_is_the_seed_d1_generalised() {
        let table = TableName::new("exchange_send_jobs").unwrap();
        let queue = QueueName::new("exchange.send").unwrap();
        let ddl = upgrade_legacy_sql(
            &table,
            &queue,
            Some("idx_exchange_send_jobs_stuck_in_flight"),
        )
        .unwrap();
        let squashed = ddl.split_whitespace().collect::<Vec<_>>().join(" ");
        for needle in [
            "DROP INDEX IF EXISTS \"idx_exchange_send_jobs_stuck_in_flight\"",
            "ADD COLUMN IF NOT EXISTS claimed_at timestamptz,",
            "ADD COLUMN IF NOT EXISTS claim_generation bigint NOT NULL DEFAULT 0",
            "queue text NOT NULL DEFAULT 'exchange.send'",
            "ON \"exchange_send_jobs\" (queue, claimed_at NULLS FIRST) WHERE status = 'in_flight'",
        ] {
            assert!(squashed.contains(needle), "missing {needle:?}");
        }
        assert!(
            !squashed.contains("SET claimed_at"),
            "the upgrade must not backfill claimed_at"
        );
        assert!(squashed.contains("SET finished_at = now() WHERE finished_at IS NULL"));
        assert!(
            upgrade_legacy_sql(&table, &queue, Some("bad\"; drop")).is_err(),
            "an injected index name was accepted"
        );
    }
}
