//! The demo's kill mode: the workers are processes of their own (the demo binary started again
//! in its worker mode, on the same database), and a few are killed with SIGKILL while the
//! partner holds their POST or just after it answered, each replaced at once as an
//! orchestrator would. The audit is the rolling restart's, except that a duplicate POST is
//! allowed when a kill explains it: the killed worker's send reached the partner but its
//! outcome never committed, so the job was taken over after its lease and sent again under the
//! same idempotency key. Events never repeat or conflict, and every job ends terminal.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use queue_core::{Admin, Lease, Worker};
use serde::{Deserialize, Serialize};
use tokio::signal::unix::{SignalKind, signal};

use super::{
    DemoConfig, DemoReport, LIVE_PARTNERS, UNRESOLVABLE_PARTNER, create_transactions,
    partner_server, progress_bar,
};
use crate::chaos::audit::{describe_duplicate, duplicate_sends, unexplained_duplicates};
use crate::chaos::faults::{AtPartner, FaultLog};
use crate::chaos::fleet::{self, Fleet};
use crate::exchange::{
    ExchangeConfig, ExchangeError, ExchangeStore, HttpPartner, Partners, SendHandler,
};

/// The environment variable that hands a worker process its [`WorkerSpec`] (JSON). Not an
/// argument: the spec may hold a database URL, which a process listing would show.
pub const WORKER_SPEC_ENV: &str = "EXCHANGE_DEMO_WORKER_SPEC";

/// How the kill mode goes.
#[derive(Debug, Clone)]
pub struct KillConfig {
    /// The most workers killed; each strike lands on a POST, at random, while the budget lasts.
    pub kills: usize,
    /// The workers' lease: a killed worker's job is taken over once it has passed.
    pub lease: Duration,
    /// The partner adapter's send timeout.
    pub send_timeout: Duration,
    /// The program a worker process runs (the demo binary) and its arguments (its worker mode).
    pub program: PathBuf,
    /// See `program`.
    pub args: Vec<String>,
}

impl KillConfig {
    /// Kills `kills` workers of `program args`, with an 8 s lease and a 1 s send timeout (the
    /// exchange's lease rule, 2 × the timeout and a margin: 6 s, so that a loaded machine's
    /// stalls do not lapse a live worker's lease): a killed worker's job comes back within
    /// seconds.
    pub fn new(program: PathBuf, args: Vec<String>, kills: usize) -> KillConfig {
        KillConfig {
            kills,
            lease: Duration::from_secs(8),
            send_timeout: Duration::from_secs(1),
            program,
            args,
        }
    }
}

/// Where a worker process finds the exchange.
#[derive(Clone, Serialize, Deserialize)]
pub enum StoreSpec {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL database (its URL).
    Postgres(String),
}

impl std::fmt::Debug for StoreSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreSpec::Sqlite(path) => f.debug_tuple("Sqlite").field(path).finish(),
            // The URL may carry a password.
            StoreSpec::Postgres(_) => f.write_str("Postgres(<url>)"),
        }
    }
}

/// What a worker process of the kill mode runs with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// The store.
    pub store: StoreSpec,
    /// The live partners: name and endpoint.
    pub partners: Vec<(String, String)>,
    /// Partners known by name whose endpoint cannot be resolved.
    pub unresolvable: Vec<String>,
    /// Sends at once.
    pub concurrency: usize,
    /// The lease, in milliseconds.
    pub lease_ms: u64,
    /// The send timeout, in milliseconds.
    pub send_timeout_ms: u64,
}

impl WorkerSpec {
    /// The spec handed over in [`WORKER_SPEC_ENV`].
    pub fn from_env() -> Result<WorkerSpec, ExchangeError> {
        let text = std::env::var(WORKER_SPEC_ENV).map_err(|_| {
            ExchangeError::Corrupt(format!("a demo worker needs {WORKER_SPEC_ENV}"))
        })?;
        serde_json::from_str(&text)
            .map_err(|e| ExchangeError::Corrupt(format!("{WORKER_SPEC_ENV} is not a spec: {e}")))
    }

    fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms)
    }
}

/// A worker process of the kill mode: sends until SIGTERM, then drains and returns. Its POSTs
/// name its process id in their `User-Agent`, which is how the partner's observer finds whom
/// to kill.
pub async fn serve_worker<S: ExchangeStore>(
    store: S,
    spec: &WorkerSpec,
) -> Result<(), ExchangeError> {
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| ExchangeError::Corrupt(format!("cannot watch SIGTERM: {e}")))?;
    let agent = format!("exchange-demo worker (pid {})", std::process::id());
    let mut partners = Partners::new();
    for (name, endpoint) in &spec.partners {
        let partner = HttpPartner::new(endpoint)
            .map_err(|e| ExchangeError::Corrupt(e.to_string()))?
            .with_timeout(spec.send_timeout())
            .with_user_agent(agent.clone());
        partners = partners.with(name.clone(), partner);
    }
    for name in &spec.unresolvable {
        partners = partners.with_unresolvable(name, "endpoint withdrawn");
    }
    let lease = Lease::new(spec.lease()).map_err(queue_core::Error::from)?;
    let config = ExchangeConfig {
        lease,
        concurrency: spec.concurrency,
        retry_base: Duration::from_millis(20),
        poll_interval: Duration::from_millis(250),
        lease_margin: spec
            .lease()
            .saturating_sub(spec.send_timeout() * 2)
            .max(Duration::from_millis(1)),
        ..ExchangeConfig::default()
    };
    let worker = Worker::new(
        store.queue().clone(),
        SendHandler::new(store.clone(), partners.clone()),
        config.worker_config(&partners)?,
    )?
    .hooks(store.hooks())
    .start();
    term.recv().await;
    worker.shutdown().await?;
    Ok(())
}

/// Runs the demo with worker processes on `store` (which `spec_store` names for them), killing
/// up to `kill.kills` of them mid-send, until every job is terminal.
pub async fn run<S: ExchangeStore>(
    store: S,
    spec_store: StoreSpec,
    backend: &'static str,
    config: &DemoConfig,
    kill: &KillConfig,
) -> Result<DemoReport, ExchangeError> {
    let started = Instant::now();
    let server = partner_server(config).await?;
    let spec = WorkerSpec {
        store: spec_store,
        partners: LIVE_PARTNERS
            .iter()
            .map(|name| (name.to_string(), server.endpoint(name)))
            .collect(),
        unresolvable: vec![UNRESOLVABLE_PARTNER.to_owned()],
        concurrency: config.concurrency,
        lease_ms: kill.lease.as_millis() as u64,
        send_timeout_ms: kill.send_timeout.as_millis() as u64,
    };
    create_transactions(&store, config).await?;

    // About two strikes per kill over the first half of the POSTs, so the kills spread over
    // the run instead of landing at its start.
    let chance = (kill.kills as f64 * 4.0 / config.jobs.max(1) as f64).min(1.0);
    let faults = FaultLog::default();
    let observer = Arc::new(AtPartner::kill(faults.clone(), kill.kills, chance));
    server.observe(observer.clone());
    let logs = std::env::temp_dir().join(format!("exchange-demo-{}-logs", std::process::id()));
    std::fs::create_dir_all(&logs).map_err(io)?;
    let spec_json = serde_json::to_string(&spec)
        .map_err(|e| ExchangeError::Corrupt(format!("the worker spec: {e}")))?;
    let mut fleet = Fleet::new(kill.program.clone(), kill.args.clone(), logs.clone())
        .env(WORKER_SPEC_ENV, spec_json);
    let workers = config.workers.max(1);

    let bar = progress_bar(config.jobs, config.progress);
    let mut announced = 0;
    let outcome = loop {
        // A killed worker is replaced at once; one that ended on its own is a failure.
        if let Err(e) = fleet.top_up(workers) {
            break Err(io(e));
        }
        let killed: HashSet<u32> = faults.all().iter().filter_map(|f| f.pid).collect();
        if let Some((pid, status)) = fleet.exited.iter().find(|(pid, _)| !killed.contains(pid)) {
            break Err(ExchangeError::Corrupt(format!(
                "worker process {pid} ended on its own ({status}); its log is in {}",
                logs.display()
            )));
        }
        let kills = faults.all();
        for fault in &kills[announced..] {
            bar.suspend(|| {
                println!(
                    "killed worker process {} ({})",
                    fault.pid.unwrap_or_default(),
                    fault.kind.as_str()
                )
            });
        }
        announced = kills.len();
        let summary = store.summary().await?;
        let terminal = summary.success + summary.failed;
        bar.set_position(terminal);
        if terminal as usize >= config.jobs {
            break Ok(());
        }
        if started.elapsed() > config.deadline {
            break Err(ExchangeError::Corrupt(format!(
                "only {terminal} of {} jobs terminal after {:?}",
                config.jobs, config.deadline
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // No strike lands on the drain: the observer stops, and the kills under way finish first.
    observer.settle().await;
    server.stop_observing();
    let statuses = fleet::drain(fleet.take(), Duration::from_secs(30)).await;
    match outcome {
        Ok(()) => bar.finish(),
        Err(e) => {
            bar.abandon();
            return Err(e);
        }
    }
    let unclean = statuses
        .iter()
        .filter(|status| !status.is_some_and(|s| s.success()))
        .count();
    if unclean > 0 {
        return Err(ExchangeError::Corrupt(format!(
            "{unclean} worker processes did not drain cleanly on SIGTERM; logs in {}",
            logs.display()
        )));
    }
    let summary = store.summary().await?;
    let kills = faults.all();
    let posts = server.log();
    let (duplicate_posts, mut duplicates_explained) =
        duplicate_sends(&posts, &kills, kill.lease, kill.send_timeout);
    for (first, previous, later) in
        unexplained_duplicates(&posts, &kills, kill.lease, kill.send_timeout)
    {
        // The previous send's own worker gave up on it (its timeout fired: the partner's
        // answer, ready in time at the partner, reached the worker late on a loaded machine)
        // and retried under the same key, as the exchange does after an ambiguous failure
        // (ADR 0003): the job's error history holds a retry for that send's generation, and
        // the later POST is the same job's, from a later claim.
        if gave_up_on(&store, previous, later).await? {
            duplicates_explained += 1;
        } else {
            println!(
                "unexplained duplicate: {}",
                describe_duplicate(first, later, &kills)
            );
        }
    }
    let stale_fenced = store.queue().control().await?.stale_fences;
    let _ = std::fs::remove_dir_all(&logs);
    Ok(DemoReport {
        jobs: config.jobs,
        sent: summary.success,
        failed: summary.failed,
        duplicate_posts,
        duplicates_explained,
        conflicting_events: summary.conflicting_events,
        duplicate_events: summary.duplicate_events,
        stale_fenced,
        released: 0,
        backend,
        mode: "kill",
        kills: kills.len() as u64,
        elapsed_ms: started.elapsed().as_millis(),
    })
}

/// Whether `later` is the same job sent again by a later claim after the worker of
/// `previous`'s attempt ended that attempt with a retry (the job's error history has a retry
/// under `previous`'s generation).
async fn gave_up_on<S: ExchangeStore>(
    store: &S,
    previous: &crate::exchange::partner_server::PostRecord,
    later: &crate::exchange::partner_server::PostRecord,
) -> Result<bool, ExchangeError> {
    let (Some(job), Some(generation)) = (previous.job_id, previous.generation) else {
        return Ok(false);
    };
    if later.job_id != Some(job) || later.generation.is_none_or(|g| g <= generation) {
        return Ok(false);
    }
    let Some(record) = queue_core::Backend::get(store.queue(), queue_core::JobId(job)).await?
    else {
        return Ok(false);
    };
    Ok(record
        .errors
        .iter()
        .any(|e| e.generation == generation && e.outcome == "retry"))
}

fn io(err: std::io::Error) -> ExchangeError {
    ExchangeError::Corrupt(format!("worker processes: {err}"))
}
