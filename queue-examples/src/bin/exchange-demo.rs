//! `exchange-demo`: the exchange send queue under a rolling restart, against a local partner
//! server that counts duplicate POSTs. On a SQLite file by default (in a temporary directory it
//! removes after), on PostgreSQL when `DATABASE_URL` is set (in a scratch database it creates and
//! drops), in memory with `--backend memory`. With `--kill` the workers are processes of their
//! own and some are killed with SIGKILL mid-send.
//!
//! ```text
//! exchange-demo [--jobs 3000] [--workers 4] [--concurrency 16] [--fail-rate 0.05]
//!               [--backend sqlite|postgres|memory] [--database-url URL] [--db-path FILE]
//!               [--keep-db] [--kill [--kills 6]] [--no-progress] [--one-transaction-per-send]
//! ```
//! The last line is `summary: jobs=N sent=S failed=F duplicate_posts=D explained=E
//! conflicting_events=C stale_fenced=K kills=X backend=B mode=M elapsed_ms=T`; the exit status
//! is non-zero if a guarantee broke (a duplicate POST no kill explains, a conflicting or
//! duplicate event, a job not terminal).

use anyhow::{Context, Result, bail};
use clap::Parser;
use queue_examples::cli::{DemoArgs, DemoBackend};
use queue_examples::exchange::demo::kill::{self, KillConfig, StoreSpec, WorkerSpec};
use queue_examples::exchange::demo::{self, DemoConfig, DemoReport};
use queue_examples::exchange::{ExchangeStore, MemExchange, PgExchange, SqliteExchange};
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
    if args.worker {
        return worker().await;
    }
    let config = DemoConfig {
        jobs: usize::try_from(args.jobs)?,
        workers: usize::try_from(args.workers)?,
        concurrency: usize::try_from(args.concurrency)?,
        fail_rate: args.fail_rate,
        progress: !args.no_progress,
        batch_outcomes: !args.one_transaction_per_send,
        ..DemoConfig::default()
    };
    let backend = args.backend();
    if args.kill && backend == DemoBackend::Memory {
        bail!(
            "--kill runs the workers as processes, which need a store they share: use the \
             default SQLite file or a PostgreSQL database, not --backend memory"
        );
    }
    let disruption = if args.kill {
        format!("up to {} worker processes killed mid-send", args.kills)
    } else {
        format!("a rolling restart at {:.0}%", config.restart_at * 100.0)
    };
    println!(
        "exchange-demo: {} transmissions, {} workers × {} sends, partners fail {:.0}% of POSTs \
         (retried); {disruption}",
        config.jobs,
        config.workers,
        config.concurrency,
        config.fail_rate * 100.0,
    );
    let report = match backend {
        DemoBackend::Sqlite => on_sqlite(&args, &config).await?,
        DemoBackend::Postgres => on_postgres(&args, &config).await?,
        DemoBackend::Memory => {
            println!("backend: memory (no durability; the default is a SQLite file)");
            demo::run(MemExchange::new(), "memory", &config).await?
        }
    };
    if report.mode == "restart" {
        println!(
            "released {} unstarted claims during the restart; duplicate events {}",
            report.released, report.duplicate_events
        );
    } else {
        println!(
            "{} kills; {} duplicate POSTs, {} of them explained (a kill, or a timed-out send retried); duplicate events {}",
            report.kills,
            report.duplicate_posts,
            report.duplicates_explained,
            report.duplicate_events
        );
    }
    println!("{report}");
    if !report.is_clean() {
        bail!("a guarantee broke: see the summary");
    }
    Ok(())
}

/// Runs `store` in the mode asked for: the rolling restart, or worker processes killed.
async fn run<S: ExchangeStore>(
    store: S,
    spec: StoreSpec,
    backend: &'static str,
    args: &DemoArgs,
    config: &DemoConfig,
) -> Result<DemoReport> {
    if !args.kill {
        return Ok(demo::run(store, backend, config).await?);
    }
    let program = std::env::current_exe().context("finding the demo's own binary")?;
    let kills = usize::try_from(args.kills)?;
    let kill_config = KillConfig::new(program, vec!["--worker".to_owned()], kills);
    Ok(kill::run(store, spec, backend, config, &kill_config).await?)
}

async fn on_sqlite(args: &DemoArgs, config: &DemoConfig) -> Result<DemoReport> {
    let (path, scratch) = match &args.db_path {
        Some(path) => (path.clone(), None),
        None => {
            let dir = std::env::temp_dir().join(format!("exchange-demo-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            (dir.join("exchange.db"), Some(dir))
        }
    };
    println!("backend: sqlite, the file {}", path.display());
    let options = queue_sqlite::OpenOptions {
        max_connections: (config.workers * 2 + 2) as u32,
        ..Default::default()
    };
    let result = async {
        let store = SqliteExchange::open(&path, &options).await?;
        let report = run(
            store.clone(),
            StoreSpec::Sqlite(path.clone()),
            "sqlite",
            args,
            config,
        )
        .await;
        store.pool().close().await;
        report
    }
    .await;
    match scratch {
        Some(dir) if !args.keep_db => {
            let _ = std::fs::remove_dir_all(dir);
        }
        _ => println!("kept the database file {}", path.display()),
    }
    result
}

async fn on_postgres(args: &DemoArgs, config: &DemoConfig) -> Result<DemoReport> {
    let url = args
        .database_url
        .clone()
        .filter(|u| !u.is_empty())
        .context("--backend postgres needs --database-url or DATABASE_URL")?;
    let base: PgConnectOptions = url.parse().context("DATABASE_URL is not a postgres URL")?;
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
    println!("backend: postgres, in the scratch database {scratch}");
    let pool = PgPoolOptions::new()
        .max_connections((config.workers * 3 + 4) as u32)
        .connect_with(base.clone().database(&scratch))
        .await?;
    let result = async {
        let store = PgExchange::migrate_and_connect(pool.clone()).await?;
        let mut worker_url = url::Url::parse(&url).context("DATABASE_URL is not a URL")?;
        worker_url.set_path(&scratch);
        run(
            store,
            StoreSpec::Postgres(worker_url.to_string()),
            "postgres",
            args,
            config,
        )
        .await
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
    result
}

/// One of `--kill`'s worker processes: the store its parent named, until SIGTERM.
async fn worker() -> Result<()> {
    let spec = WorkerSpec::from_env()?;
    match &spec.store {
        StoreSpec::Sqlite(path) => {
            let options = queue_sqlite::OpenOptions {
                create_if_missing: false,
                max_connections: (spec.concurrency as u32 + 2).clamp(2, 32),
                ..Default::default()
            };
            let pool = queue_sqlite::open_pool(path, &options).await?;
            kill::serve_worker(SqliteExchange::connect(pool).await?, &spec).await?;
        }
        StoreSpec::Postgres(url) => {
            let pool = PgPoolOptions::new()
                .max_connections((spec.concurrency as u32 + 2).clamp(3, 64))
                .connect(url)
                .await
                .context("connecting to the demo database")?;
            kill::serve_worker(PgExchange::connect(pool).await?, &spec).await?;
        }
    }
    Ok(())
}
