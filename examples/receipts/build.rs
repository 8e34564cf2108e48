//! Rebuilds the crate when a migration is added.

// `sqlx::migrate!()` embeds `migrations/` when the crate compiles: without this line, a new
// migration file is not picked up until something else changes.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
