//! The framework's migrator for the standard table, on sqlx's migration machinery.

use std::sync::LazyLock;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, PgPool, SqlSafeStr};

use crate::error::PgError;
use crate::ident::TableName;
use crate::schema::MIGRATIONS_TABLE;
use crate::sql;

/// The framework's migrations of the standard table `queue_jobs`, recorded in their own table
/// ([`MIGRATIONS_TABLE`]) so that they coexist with a service's own migrator.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let table = TableName::default();
    let migrations = sql::TABLE_MIGRATIONS
        .iter()
        .map(|(version, description, template)| {
            let text = sql::for_table(*template, &table).expect("the standard table renders");
            Migration::new(
                *version,
                (*description).into(),
                MigrationType::Simple,
                AssertSqlSafe(text).into_sql_str(),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
});

/// Applies the framework's migrations (idempotent; safe to run from every replica at start-up:
/// the migrator takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), PgError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard table's migration is byte for byte what earlier releases applied: a database
    /// migrated by them must not see its checksum change.
    #[test]
    fn the_standard_migration_keeps_its_checksum() {
        let migration = MIGRATOR.iter().next().expect("one migration");
        assert_eq!(migration.version, 20261130000001);
        let hex: String = migration
            .checksum
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "53863fd27796268632544b754acf9f0132e673ef92e47f7061d4aab71c632a83aa6b981ed23f70c3c6a6357eecb4ac2e"
        );
    }
}
