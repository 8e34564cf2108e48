//! `queuectl`: the framework's admin commands on a queue table, without domain hooks. A service
//! whose jobs have domain side effects embeds the same commands with its hooks
//! (`queuectl::main_with`), so that its retries and cancels keep its domain right.

use std::process::ExitCode;

fn main() -> ExitCode {
    let hooks: queue_core::Hooks<queue_postgres::PgTx, serde_json::Value> =
        queue_core::Hooks::new();
    queuectl::main_with(queuectl::Settings::new("queuectl"), hooks)
}
