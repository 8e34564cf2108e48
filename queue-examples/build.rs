//! Rebuilds the crate when a migration is added or changed.

// `sqlx::migrate!("../migrations")` embeds the exchange's migrations when the crate compiles:
// without this line, a new migration file is not picked up until something else changes.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
