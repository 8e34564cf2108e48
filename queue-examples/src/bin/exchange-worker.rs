//! `exchange-worker`: the long-running send worker of the exchange.
//!
//! ```text
//! exchange-worker --partner acme=https://partner.example/transmissions [--partner …]
//!                 [--partner-ca acme=/etc/exchange/acme-ca.pem] [--unresolvable NAME …]
//!                 [--database-url URL] [--driver sqlx|tokio-postgres]
//!                 [--lease-secs 90] [--concurrency 16]
//!                 [--send-timeout-secs 30] [--max-attempts 5] [--migrate]
//!                 [--lease-margin-secs 10] [--retry-base-ms 1000] [--poll-ms 1000]
//!                 [--metrics-addr 127.0.0.1:9464]
//! ```
//! With `--metrics-addr` it serves `/metrics` (the framework's metrics, Prometheus text),
//! `/healthz` and `/readyz` (not ready while the database does not answer, and from the first
//! moment of a drain).
//! `DATABASE_URL` and `EXCHANGE_PARTNERS` (`name=url,name=url`) work as well as the flags.
//! A URL with several hosts (`postgres://u@h1:5432,h2:5432/db`) reaches a high-availability
//! cluster: both drivers write only to the host that takes writes and follow it across a
//! failover (sqlx through `queue_postgres::PrimaryPool`, tokio-postgres by itself).
//! Start-up refuses a partner URL that can never work (not `http`/`https`, no host, does not
//! parse) and an unreadable CA file, naming the partner, and a duration flag that is zero or
//! out of its range, naming the flag (`--help` gives the ranges). Partner URLs are logged
//! without their credentials.
//! SIGTERM or SIGINT starts a graceful drain: no new claims, claimed-but-unstarted sends are
//! released at once, running sends finish (or are released after the shutdown deadline).
//! Start-up refuses a lease below 2 × the largest send timeout + margin, and a send-jobs table
//! that is not on the lease schema.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use queue_core::{Lease, Worker, WorkerHandle};
use queue_examples::cli::{PgDriver, WorkerArgs};
use queue_examples::exchange::{
    ExchangeConfig, ExchangeStore, Partners, PgExchange, SendHandler, events, log_configured,
    send_queue_config,
};
use queue_postgres::{PostgresQueue, PrimaryPool, TokioPostgres};
use sqlx::postgres::PgPoolOptions;
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // From the first moment: a SIGTERM that arrives while the worker connects is kept, and
    // drains it as soon as it runs, instead of killing it.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let args = WorkerArgs::parse();
    let url = args
        .database_url
        .clone()
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .context("set DATABASE_URL or --database-url")?;
    let timeout = Duration::from_secs(args.send_timeout_secs);
    // Every endpoint is checked before anything else: a URL that can never work is refused
    // here, with its partner's name, not found out one send at a time.
    let configured = args.http_partners(std::env::var("EXCHANGE_PARTNERS").ok().as_deref())?;
    let partner_count = configured.len();
    let mut partners = Partners::new();
    for (name, partner) in configured {
        let partner = partner
            .with_timeout(timeout)
            .with_user_agent(format!("exchange-worker (pid {})", std::process::id()));
        log_configured(&name, &partner);
        partners = partners.with(name, partner);
    }
    for name in &args.unresolvable {
        partners = partners.with_unresolvable(name, "configured as unresolvable");
    }
    let config = ExchangeConfig {
        lease: Lease::from_secs(args.lease_secs)?,
        concurrency: usize::try_from(args.concurrency)?,
        max_attempts: args.max_attempts,
        lease_margin: Duration::from_secs(args.lease_margin_secs),
        retry_base: Duration::from_millis(args.retry_base_ms),
        poll_interval: Duration::from_millis(args.poll_ms),
        batch_outcomes: true,
    };
    let worker_config = config.worker_config(&partners)?;
    // Before any queue or worker exists: they take their metric handles when they start.
    let metrics = match args.metrics_addr {
        Some(_) => Some(queue_examples::ops::install_recorder()?),
        None => None,
    };

    // A connection per running send and its hook, and one for claims and outcomes.
    let pool_size = (config.concurrency as u32 + 2).clamp(3, 64);
    // Ready once the schema check passed (connect) and the worker runs. The probe has a
    // connection of its own: a pool busy with sends is not a database that does not answer.
    // Both follow the primary of a multi-host URL.
    let probe = PrimaryPool::connect(&url, PgPoolOptions::new().max_connections(1))
        .await
        .context("the readiness probe's connection")?;
    let readiness = queue_examples::ops::Readiness::new(probe.pool().clone());
    if args.migrate {
        PgExchange::migrate_and_connect(probe.pool().clone()).await?;
    }
    let (_primary, worker) = match args.driver {
        PgDriver::Sqlx => {
            let primary =
                PrimaryPool::connect(&url, PgPoolOptions::new().max_connections(pool_size))
                    .await
                    .context("connecting to the database")?;
            let store = PgExchange::connect(primary.pool().clone()).await?;
            (Some(primary), start(store, partners, worker_config)?)
        }
        PgDriver::TokioPostgres => {
            let mut pg_config: tokio_postgres::Config =
                url.parse().context("the database URL (tokio-postgres)")?;
            // Several hosts: write only to the one that takes writes, whatever the URL says.
            if pg_config.get_hosts().len() > 1 {
                pg_config
                    .target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
            }
            let manager = deadpool_postgres::Manager::new(pg_config.clone(), tokio_postgres::NoTls);
            let pool = deadpool_postgres::Pool::builder(manager)
                .max_size(pool_size as usize)
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .wait_timeout(Some(Duration::from_secs(30)))
                .build()
                .context("the tokio-postgres pool")?;
            let queue =
                PostgresQueue::<TokioPostgres>::connect(pool, send_queue_config()?, pg_config)
                    .await?;
            (
                None,
                start(PgExchange::from_queue(queue), partners, worker_config)?,
            )
        }
    };
    if let (Some(addr), Some(metrics)) = (args.metrics_addr, metrics) {
        queue_examples::ops::serve(addr, metrics, readiness.clone())
            .await
            .with_context(|| format!("serving metrics on {addr}"))?;
    }
    tracing::info!(
        name: events::WORKER_STARTED,
        partners = partner_count,
        concurrency = config.concurrency,
        lease_s = config.lease.duration().as_secs(),
        "{}",
        events::WORKER_STARTED
    );

    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    readiness.draining();
    tracing::info!(name: events::WORKER_DRAINING, "{}", events::WORKER_DRAINING);
    let report = worker.shutdown().await?;
    tracing::info!(
        name: events::WORKER_STOPPED,
        released_unstarted = report.released_unstarted,
        finished_in_time = report.finished_in_time,
        aborted = report.aborted,
        completed = report.stats.completed,
        stale = report.stats.stale,
        "{}",
        events::WORKER_STOPPED
    );
    drop(probe);
    Ok(())
}

/// The send worker on `store`, started.
fn start<S: ExchangeStore>(
    store: S,
    partners: Partners,
    config: queue_core::WorkerConfig,
) -> Result<WorkerHandle> {
    Ok(Worker::new(
        store.queue().clone(),
        SendHandler::new(store.clone(), partners),
        config,
    )?
    .hooks(store.hooks())
    .start())
}
