//! # queuectl
//!
//! Operating queue-framework queues without hand-written SQL: the `queuectl` binary, and the same
//! commands as a library for a service that embeds them in a binary of its own, with its own
//! finalize hooks, so that retries and cancels keep its domain right (the exchange's
//! `exchange-admin` does).
//!
//! ```no_run
//! use queue_core::Hooks;
//! use queue_postgres::PgTx;
//!
//! // A service's admin binary: its table and queue by default, its hooks on every retry and cancel.
//! fn main() -> std::process::ExitCode {
//!     let settings = queuectl::Settings::new("orders-admin")
//!         .default_table("order_jobs")
//!         .default_queue("orders");
//!     let hooks: Hooks<PgTx, serde_json::Value> = Hooks::new(); // the service's own hooks
//!     queuectl::main_with(settings, hooks)
//! }
//! ```
//!
//! Exit codes ([`Exit`]): 0 done; 1 failed (the database, an unexpected error); 2 bad usage or a
//! bad value; 3 not found (a job, a schedule's record); 4 refused, nothing changed (a job in
//! another state, a hook's refusal); 5 not confirmed (a destructive command without `--yes` and
//! no terminal to ask); 6 timed out (a drain with jobs still running); 130 interrupted (Ctrl-C),
//! after what was done so far. With `--json`, stdout holds one JSON document whatever the outcome
//! (an error is `{"error": …, "exit": …}`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cli;
mod commands;
mod output;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use queue_core::Hooks;
use queue_postgres::PgTx;
use serde::de::DeserializeOwned;

pub use cli::{Cli, Command, JobsCommand, QueueCommand, SchedulesArgs, SchedulesCommand};
pub use commands::{CtlError, Exit};

/// How an embedding binary presents the commands: its name and its defaults.
#[derive(Debug, Clone)]
pub struct Settings {
    name: &'static str,
    table: Option<&'static str>,
    queue: Option<&'static str>,
}

impl Settings {
    /// A binary called `name` (shown in `--help`).
    pub fn new(name: &'static str) -> Self {
        Settings {
            name,
            table: None,
            queue: None,
        }
    }

    /// The table `--table` defaults to (otherwise `queue_jobs`).
    pub fn default_table(mut self, table: &'static str) -> Self {
        self.table = Some(table);
        self
    }

    /// The queue `--queue` defaults to (otherwise `default`).
    pub fn default_queue(mut self, queue: &'static str) -> Self {
        self.queue = Some(queue);
        self
    }

    /// The command line, with these defaults.
    pub fn command(&self) -> clap::Command {
        let mut command = Cli::command().name(self.name).bin_name(self.name);
        if let Some(table) = self.table {
            command = command.mut_arg("table", |arg| arg.default_value(table));
        }
        if let Some(queue) = self.queue {
            command = command.mut_arg("queue", |arg| arg.default_value(queue));
        }
        command
    }

    /// Parses `args` (the first is the binary's name); exits on `--help`, `--version` and bad
    /// usage, as clap does.
    pub fn parse_from<I, T>(&self, args: I) -> Cli
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = self.command().get_matches_from(args);
        Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit())
    }
}

/// Parses the process's arguments, runs the command with `hooks` on a runtime of its own, prints
/// the result, and returns the exit code: the whole of an admin binary's `main`.
pub fn main_with<P>(settings: Settings, hooks: Hooks<PgTx, P>) -> ExitCode
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    let cli = settings.parse_from(std::env::args_os());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            return ExitCode::from(Exit::Failed as u8);
        }
    };
    let exit = runtime.block_on(run(cli, hooks));
    ExitCode::from(exit as u8)
}

/// Runs one parsed command with `hooks` and prints its result (tables, or JSON with `--json`;
/// errors on stderr). Returns the exit code.
pub async fn run<P>(cli: Cli, hooks: Hooks<PgTx, P>) -> Exit
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    match commands::run(&cli, &hooks).await {
        Ok(exit) => exit,
        Err(err) => {
            eprintln!("error: {err}");
            output::Out::error(cli.json, &err);
            err.exit()
        }
    }
}
