//! The receipts service of `docs/adopting.md`: it stores orders and mails a receipt for each
//! one through a queue in a table of its own, `receipt_jobs`.

pub mod hooks;
pub mod limits;
pub mod orders;
pub mod receipt;
pub mod schedule;
#[cfg(test)]
mod tests;
