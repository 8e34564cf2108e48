//! # queue-examples
//!
//! Concrete queues built on `queue-core` and `queue-postgres`:
//!
//! * [`exchange`]: the partner send queue that double-sent during a rolling restart, rebuilt on
//!   the framework: its legacy table upgraded to the lease schema, its transaction terminal
//!   guard and its outbox events as finalize hooks. Binaries: `exchange-demo` (a rolling restart
//!   under load, against a local partner server that counts duplicate POSTs) and
//!   `exchange-worker` (the long-running worker).
//! * [`webhook`]: a small webhook delivery queue using only the public API.
//! * [`chaos`]: the exchange's workers as processes, through kills, pauses, killed connections,
//!   database crashes, a hanging partner and poison payloads, with an audit of every promise
//!   (binary `exchange-chaos`).
//!
//! ```
//! use queue_examples::exchange::{ExchangeStore, MemExchange};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let exchange = MemExchange::new();
//! let ids = exchange.create_transactions(&[("acme".to_owned(), 1250)]).await?;
//! let tx = exchange.transaction(ids[0]).await?.expect("created");
//! assert_eq!(tx.status.as_str(), "pending");
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod chaos;
pub mod cli;
pub mod exchange;
pub mod ops;
pub mod webhook;
