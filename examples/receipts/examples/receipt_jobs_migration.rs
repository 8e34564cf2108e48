//! Prints one of the framework's later table migrations for `receipt_jobs`, to commit as a new
//! migration when a framework release adds one (the drift test in src/tests.rs says when):
//! cargo run --example receipt_jobs_migration 20261201000001 > migrations/<next>_receipt_jobs_….sql
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let version: i64 = std::env::args()
        .nth(1)
        .ok_or("usage: receipt_jobs_migration VERSION")?
        .parse()?;
    let table = queue_postgres::TableName::new("receipt_jobs")?;
    print!("{}", queue_postgres::table_migration_sql(&table, version)?);
    Ok(())
}
