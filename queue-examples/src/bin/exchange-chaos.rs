//! `exchange-chaos`: the chaos suite's full mode (or any part of it) against `exchange-worker`
//! processes, a PostgreSQL cluster it creates on a free port (never the shared server) and a
//! local partner. Prints one Markdown row per scenario; exits non-zero if a promise broke.
//!
//! ```text
//! cargo build --release -p queue-examples --bins
//! target/release/exchange-chaos                      # the full run (docs/reliability.md)
//! target/release/exchange-chaos --quick              # what CI runs
//! target/release/exchange-chaos --scenario kill --scenario restart --transactions 5000
//! ```

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use queue_examples::chaos::{self, ChaosConfig, Scenario};
use queue_examples::cli::PgDriver;

/// Runs the exchange through kills, pauses, killed connections, database crashes, a hanging
/// partner and poison payloads, and audits every promise after each scenario.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The small run CI does instead of the full one.
    #[arg(long)]
    quick: bool,
    /// Only these scenarios, in this order (repeatable).
    #[arg(long, value_enum)]
    scenario: Vec<Scenario>,
    /// Worker processes.
    #[arg(long)]
    workers: Option<usize>,
    /// Transactions per scenario.
    #[arg(long)]
    transactions: Option<usize>,
    /// Faults of each kind per scenario.
    #[arg(long)]
    rounds: Option<usize>,
    /// Seconds over which each scenario's transactions are created (1 s to a day).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    load_secs: Option<u64>,
    /// The `exchange-worker` binary (default: next to this one).
    #[arg(long)]
    worker_bin: Option<PathBuf>,
    /// The workers' PostgreSQL driver.
    #[arg(long, value_enum, default_value_t = PgDriver::Sqlx)]
    driver: PgDriver,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let worker_bin = match args.worker_bin {
        Some(path) => path,
        None => std::env::current_exe()
            .context("locating this binary")?
            .with_file_name("exchange-worker"),
    };
    if !worker_bin.is_file() {
        bail!(
            "no exchange-worker at {} (build it: cargo build --release -p queue-examples --bins, \
             or pass --worker-bin)",
            worker_bin.display()
        );
    }
    // The failover scenario needs a high-availability formation: it runs on its own.
    let failover = args.scenario == [Scenario::Failover];
    if !failover && args.scenario.contains(&Scenario::Failover) {
        bail!("--scenario failover runs alone (on a pg_auto_failover formation of its own)");
    }
    let mut config = if failover {
        ChaosConfig::failover(worker_bin, args.driver)
    } else if args.quick {
        ChaosConfig::quick(worker_bin)
    } else {
        ChaosConfig::full(worker_bin)
    };
    config.driver = args.driver;
    if !args.scenario.is_empty() {
        config.scenarios = args.scenario;
    }
    config.workers = args.workers.unwrap_or(config.workers);
    config.transactions = args.transactions.unwrap_or(config.transactions);
    config.rounds = args.rounds.unwrap_or(config.rounds);
    if let Some(secs) = args.load_secs {
        config.load_for = Duration::from_secs(secs);
    }
    let report = if failover {
        chaos::run_failover(&config).await?
    } else {
        chaos::run(&config).await?
    };
    println!("{report}");
    for scenario in &report.scenarios {
        println!(
            "{}: longest pause between POSTs {:.2} s",
            scenario.scenario.as_str(),
            scenario.longest_post_gap.as_secs_f64()
        );
    }
    let violations = report.violations();
    if !violations.is_empty() {
        for scenario in &report.scenarios {
            if !scenario.audit.violations().is_empty() {
                eprintln!(
                    "{}: worker logs kept in {}",
                    scenario.scenario.as_str(),
                    scenario.logs.display()
                );
            }
        }
        bail!("broken promises: {violations:#?}");
    }
    Ok(())
}
