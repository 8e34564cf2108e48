//! Creating, upgrading and checking queue tables: the DDL (rendered from the templates in
//! `migrations/` and `sql/`) and the judgement of the start-up check. Running them is the
//! queue's ([`crate::PostgresQueue::install_table`] and friends), for every driver.

use queue_core::QueueName;

use crate::error::PgError;
use crate::ident::TableName;
use crate::sql::{self, COLUMNS};

/// The name of the table in which the framework records its own applied migrations, so that
/// they coexist with a service's own migrator (which keeps `_sqlx_migrations`): neither sees
/// the other's versions as missing.
pub const MIGRATIONS_TABLE: &str = "_queue_framework_migrations";

/// The DDL of a new queue table named `table`: the framework's migrations, rendered for it.
/// Put it in your own migrations, or run it with
/// [`PostgresQueue::install_table`](crate::PostgresQueue::install_table).
pub fn create_table_sql(table: &TableName) -> String {
    sql::TABLE_MIGRATIONS
        .iter()
        .map(|(_, _, template)| {
            sql::for_table(*template, table).expect("the table migrations render for any table")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The DDL that upgrades a legacy queue table in place to the lease schema: adds `claimed_at`
/// (no backfill: NULL counts as an expired lease, so rows stranded in flight by the old release
/// are re-claimable at once) and `claim_generation`, the framework's other columns with
/// defaults (`queue` defaults to `queue`, so legacy rows belong to it), drops the old stuck-job
/// index if named, creates the partial indexes (lease: `WHERE status = 'in_flight'`), and stamps
/// `finished_at` on terminal rows so retention reaches them.
///
/// Legacy status values outside the framework's vocabulary (`pending`, `in_flight`,
/// `completed`, `failed`, `dead`, `cancelled`) must be mapped by the adopter's own migration.
/// The upgrade locks the table while it runs; see `docs/operations.md` before running it on a
/// large live table.
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
    ddl.push_str(&sql::render(
        sql::UPGRADE_LEGACY,
        &[("table", table.as_str()), ("queue", queue.as_str())],
    )?);
    Ok(ddl)
}

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
pub(crate) struct TableFacts {
    /// `(column, format_type)` pairs; empty when the table does not exist.
    pub(crate) columns: Vec<(String, String)>,
    /// Index names.
    pub(crate) indexes: Vec<String>,
    /// Whether `id` draws from a sequence or identity.
    pub(crate) id_has_sequence: bool,
}

/// Refuses, naming what is missing, a table that is not on the lease schema.
pub(crate) fn evaluate_schema(table: &TableName, facts: &TableFacts) -> Result<(), PgError> {
    if facts.columns.is_empty() {
        return Err(PgError::Schema {
            table: table.to_string(),
            missing: vec!["the table itself (not found on the search_path)".to_owned()],
        });
    }
    let mut missing = Vec::new();
    for (name, ty) in COLUMNS {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_table_sql_is_the_migration_rendered() {
        let ddl = create_table_sql(&TableName::new("mail_jobs").unwrap());
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS \"mail_jobs\""));
        assert!(ddl.contains("\"mail_jobs_lease_idx\""));
        assert!(!ddl.contains("\"queue_jobs"));
        assert!(!ddl.contains("{{"));
    }

    #[test]
    fn the_upgrade_adds_the_lease_without_backfilling_it() {
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

    #[test]
    fn the_schema_check_names_what_is_missing() {
        let table = TableName::default();
        let missing_table = evaluate_schema(&table, &TableFacts::default()).unwrap_err();
        assert!(missing_table.to_string().contains("not found"));
        let legacy = TableFacts {
            columns: vec![
                ("id".into(), "bigint".into()),
                ("status".into(), "text".into()),
            ],
            indexes: vec![],
            id_has_sequence: true,
        };
        let text = evaluate_schema(&table, &legacy).unwrap_err().to_string();
        assert!(text.contains("column claimed_at") && text.contains("queue_jobs_lease_idx"));
    }
}
