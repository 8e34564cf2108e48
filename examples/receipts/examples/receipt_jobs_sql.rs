//! Prints the DDL of the queue table `receipt_jobs`. Run once, commit the output as a migration:
//! cargo run --example receipt_jobs_sql > migrations/20260301000002_receipt_jobs.sql
fn main() -> Result<(), queue_postgres::PgError> {
    let table = queue_postgres::TableName::new("receipt_jobs")?;
    print!("{}", queue_postgres::create_table_sql(&table));
    Ok(())
}
