//! `exchange-worker`: the long-running send worker of the exchange.
//!
//! ```text
//! exchange-worker --partner acme=http://partner.example/transmissions [--partner …]
//!                 [--unresolvable NAME …] [--database-url URL] [--lease-secs 90]
//!                 [--concurrency 16] [--send-timeout-secs 30] [--max-attempts 5] [--migrate]
//!                 [--lease-margin-secs 10] [--retry-base-ms 1000] [--poll-ms 1000]
//! ```
//! `DATABASE_URL` and `EXCHANGE_PARTNERS` (`name=url,name=url`) work as well as the flags.
//! SIGTERM or SIGINT starts a graceful drain: no new claims, claimed-but-unstarted sends are
//! released at once, running sends finish (or are released after the shutdown deadline).
//! Start-up refuses a lease below 2 × the largest send timeout + margin, and a send-jobs table
//! that is not on the lease schema.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use queue_core::{Lease, Worker};
use queue_examples::cli::Args;
use queue_examples::exchange::{
    ExchangeConfig, ExchangeStore, HttpPartner, Partners, PgExchange, SendHandler, events,
};
use sqlx::postgres::PgPoolOptions;
use tokio::signal::unix::{SignalKind, signal};

const FLAGS: &[&str] = &[
    "database-url",
    "partner",
    "unresolvable",
    "lease-secs",
    "concurrency",
    "send-timeout-secs",
    "max-attempts",
    "migrate",
    "lease-margin-secs",
    "retry-base-ms",
    "poll-ms",
    "help",
];

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    // From the first moment: a SIGTERM that arrives while the worker connects is kept, and
    // drains it as soon as it runs, instead of killing it.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let args = Args::parse(std::env::args().skip(1), FLAGS)?;
    if args.has("help") {
        println!("flags: --{}", FLAGS.join(" --"));
        return Ok(());
    }
    let url = args
        .opt("database-url")
        .map(str::to_owned)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .context("set DATABASE_URL or --database-url")?;
    let timeout = Duration::from_secs(args.get("send-timeout-secs", 30u64)?);
    let mut specs: Vec<String> = args.all("partner").to_vec();
    if let Ok(env) = std::env::var("EXCHANGE_PARTNERS") {
        specs.extend(env.split(',').filter(|s| !s.is_empty()).map(str::to_owned));
    }
    if specs.is_empty() {
        bail!("no partner configured: --partner name=url or EXCHANGE_PARTNERS");
    }
    let mut partners = Partners::new();
    for spec in &specs {
        let (name, endpoint) = spec
            .split_once('=')
            .with_context(|| format!("partner {spec:?} must look like name=url"))?;
        let partner = HttpPartner::new(endpoint)?
            .with_timeout(timeout)
            .with_user_agent(format!("exchange-worker (pid {})", std::process::id()));
        partners = partners.with(name, partner);
    }
    for name in args.all("unresolvable") {
        partners = partners.with_unresolvable(name, "configured as unresolvable");
    }
    let config = ExchangeConfig {
        lease: Lease::from_secs(args.get("lease-secs", 90u64)?)?,
        concurrency: args.get("concurrency", 16usize)?,
        max_attempts: args.get("max-attempts", 5u32)?,
        lease_margin: Duration::from_secs(args.get("lease-margin-secs", 10u64)?),
        retry_base: Duration::from_millis(args.get("retry-base-ms", 1000u64)?),
        poll_interval: Duration::from_millis(args.get("poll-ms", 1000u64)?),
    };
    let worker_config = config.worker_config(&partners)?;

    let pool = PgPoolOptions::new()
        .max_connections((config.concurrency as u32).clamp(2, 32))
        .connect(&url)
        .await
        .context("connecting to the database")?;
    let store = if args.has("migrate") {
        PgExchange::migrate_and_connect(pool).await?
    } else {
        PgExchange::connect(pool).await?
    };
    let worker = Worker::new(
        store.queue().clone(),
        SendHandler::new(store.clone(), partners),
        worker_config,
    )?
    .hooks(store.hooks())
    .start();
    tracing::info!(
        name: events::WORKER_STARTED,
        partners = specs.len(),
        concurrency = config.concurrency,
        lease_s = config.lease.duration().as_secs(),
        "{}",
        events::WORKER_STARTED
    );

    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!(name: events::WORKER_DRAINING, "{}", events::WORKER_DRAINING);
    let report = worker.shutdown().await?;
    tracing::info!(
        name: "exchange.worker_stopped",
        released_unstarted = report.released_unstarted,
        finished_in_time = report.finished_in_time,
        aborted = report.aborted,
        completed = report.stats.completed,
        stale = report.stats.stale,
        "{}",
        events::WORKER_STOPPED
    );
    Ok(())
}
