//! `exchange-admin`: `queuectl`'s commands on the exchange's send queue, with the exchange's
//! hooks, so that an operator's retry of a send job reopens its transaction by
//! `retry_failed_transaction`'s rules (the idempotency key kept or repointed, the outbox right)
//! and a cancel fails the transaction with its event. Defaults: table `exchange_send_jobs`,
//! queue `exchange.send`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let settings = queuectl::Settings::new("exchange-admin")
        .default_table(queue_examples::exchange::SEND_JOBS_TABLE)
        .default_queue(queue_examples::exchange::QUEUE);
    queuectl::main_with(
        settings,
        queue_examples::exchange::send_hooks::<queue_postgres::Sqlx>(),
    )
}
