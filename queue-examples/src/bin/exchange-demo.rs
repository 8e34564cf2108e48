//! `exchange-demo`: the exchange send queue under a rolling restart, against a local partner
//! server that counts duplicate POSTs. On PostgreSQL when `DATABASE_URL` is set (in a scratch
//! database it creates and drops), otherwise on the in-memory backend.
//!
//! ```text
//! exchange-demo [--jobs 3000] [--workers 4] [--concurrency 16] [--fail-rate 0.05]
//!               [--database-url URL] [--keep-db] [--no-progress]
//! ```
//! The last line is `summary: jobs=N sent=S failed=F duplicate_posts=D conflicting_events=C
//! stale_fenced=K backend=B elapsed_ms=T`; the exit status is non-zero if a guarantee broke.

use anyhow::{Context, Result, bail};
use clap::Parser;
use queue_examples::cli::DemoArgs;
use queue_examples::exchange::demo::{self, DemoConfig};
use queue_examples::exchange::{MemExchange, PgExchange};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions};

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = DemoArgs::parse();
    let config = DemoConfig {
        jobs: usize::try_from(args.jobs)?,
        workers: usize::try_from(args.workers)?,
        concurrency: usize::try_from(args.concurrency)?,
        fail_rate: args.fail_rate,
        progress: !args.no_progress,
        ..DemoConfig::default()
    };
    let url = args.database_url.clone().filter(|u| !u.is_empty());
    println!(
        "exchange-demo: {} transmissions, {} workers × {} sends, partners fail {:.0}% of POSTs (retried); \
         a rolling restart at {:.0}%",
        config.jobs,
        config.workers,
        config.concurrency,
        config.fail_rate * 100.0,
        config.restart_at * 100.0
    );
    let report = match url {
        Some(url) => {
            let base: PgConnectOptions =
                url.parse().context("DATABASE_URL is not a postgres URL")?;
            let base = base.disable_statement_logging();
            let scratch = format!("exchange_demo_{}", std::process::id());
            let mut admin = base
                .clone()
                .connect()
                .await
                .context("connecting to DATABASE_URL")?;
            sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{scratch}\"")))
                .execute(&mut admin)
                .await
                .context("creating the demo database")?;
            println!("backend: postgres (DATABASE_URL is set), in the scratch database {scratch}");
            let pool = PgPoolOptions::new()
                .max_connections((config.workers * 3 + 4) as u32)
                .connect_with(base.clone().database(&scratch))
                .await?;
            let result = async {
                let store = PgExchange::migrate_and_connect(pool.clone()).await?;
                demo::run(store, "postgres", &config).await
            }
            .await;
            pool.close().await;
            if args.keep_db {
                println!("kept the database {scratch}");
            } else {
                sqlx::query(AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS \"{scratch}\" WITH (FORCE)"
                )))
                .execute(&mut admin)
                .await?;
            }
            result?
        }
        None => {
            println!("backend: memory (DATABASE_URL is not set; set it to run on PostgreSQL)");
            demo::run(MemExchange::new(), "memory", &config).await?
        }
    };
    println!(
        "released {} unstarted claims during the restart; duplicate events {}",
        report.released, report.duplicate_events
    );
    println!("{report}");
    if !report.is_clean() {
        bail!("a guarantee broke: see the summary");
    }
    Ok(())
}
