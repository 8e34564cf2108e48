//! The exchange demo as a library function: the `exchange-demo` binary and the end-to-end tests
//! run the same code. [`run`] restarts worker tasks of this process one after the other;
//! [`kill::run`] runs the workers as processes and kills some mid-send.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use queue_core::{Worker, WorkerHandle, WorkerStats};

use super::partner_server::{Behavior, PartnerServer};
use super::{ExchangeConfig, ExchangeError, ExchangeStore, HttpPartner, Partners, SendHandler};

pub mod kill;

/// The partners the demo registers: two live ones behind the local server, one whose endpoint
/// cannot be resolved (the "resolve miss" arm); transactions also go to a partner that does not
/// exist at all (the "partner missing" arm).
pub const LIVE_PARTNERS: [&str; 2] = ["acme", "globex"];
/// A registered partner that cannot be resolved.
pub const UNRESOLVABLE_PARTNER: &str = "umbrella";
/// A partner that is not registered.
pub const MISSING_PARTNER: &str = "initech";

/// What the demo does.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Transmissions to send.
    pub jobs: usize,
    /// Worker tasks.
    pub workers: usize,
    /// Sends at once per worker.
    pub concurrency: usize,
    /// The share of POSTs the partners answer 503 (retried).
    pub fail_rate: f64,
    /// How long the partners take to answer.
    pub partner_latency: Duration,
    /// Every `nth` transaction goes to the missing partner, and the one after it to the
    /// unresolvable one (0: none).
    pub doomed_every: usize,
    /// Rolling-restart the workers when this share of the jobs is terminal.
    pub restart_at: f64,
    /// Draw a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    /// Give up if not every job is terminal by then.
    pub deadline: Duration,
    /// Write outcomes many to a transaction ([`ExchangeConfig::batch_outcomes`]).
    pub batch_outcomes: bool,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            jobs: 3000,
            workers: 4,
            concurrency: 16,
            fail_rate: 0.05,
            partner_latency: Duration::from_millis(10),
            doomed_every: 100,
            restart_at: 0.5,
            progress: true,
            deadline: Duration::from_secs(600),
            batch_outcomes: true,
        }
    }
}

/// What the demo measured. `Display` prints the summary line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoReport {
    /// Transmissions.
    pub jobs: usize,
    /// Transactions that ended in success.
    pub sent: u64,
    /// Transactions that ended in failed.
    pub failed: u64,
    /// POSTs the partner accepted more than once for the same idempotency key.
    pub duplicate_posts: u64,
    /// Idempotency keys with both an `exchange.sent` and an `exchange.failed` event.
    pub conflicting_events: u64,
    /// Events beyond one of a type per idempotency key.
    pub duplicate_events: u64,
    /// Of `duplicate_posts`, those tied to a worker killed during or just after the first
    /// accepted POST of their key (or to a send that outlived its timeout): always 0 without
    /// kills, where every duplicate is a broken guarantee.
    pub duplicates_explained: u64,
    /// Finalizes refused by the generation fence.
    pub stale_fenced: u64,
    /// Claims released unstarted during the rolling restart.
    pub released: u64,
    /// `sqlite`, `postgres` or `memory`.
    pub backend: &'static str,
    /// `restart` (worker tasks restarted one after the other) or `kill` (worker processes
    /// killed with SIGKILL mid-send).
    pub mode: &'static str,
    /// Worker processes killed.
    pub kills: u64,
    /// Wall time.
    pub elapsed_ms: u128,
}

impl DemoReport {
    /// True when the run kept every guarantee: no duplicate send but those a kill explains, no
    /// conflicting or duplicate event, every job terminal.
    pub fn is_clean(&self) -> bool {
        self.duplicate_posts == self.duplicates_explained
            && self.conflicting_events == 0
            && self.duplicate_events == 0
            && self.sent + self.failed == self.jobs as u64
    }
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "summary: jobs={} sent={} failed={} duplicate_posts={} explained={} conflicting_events={} stale_fenced={} kills={} backend={} mode={} elapsed_ms={}",
            self.jobs,
            self.sent,
            self.failed,
            self.duplicate_posts,
            self.duplicates_explained,
            self.conflicting_events,
            self.stale_fenced,
            self.kills,
            self.backend,
            self.mode,
            self.elapsed_ms
        )
    }
}

fn start_worker<S: ExchangeStore>(
    store: &S,
    partners: &Partners,
    config: &ExchangeConfig,
) -> Result<WorkerHandle, ExchangeError> {
    let worker_config = config.worker_config(partners)?;
    Ok(Worker::new(
        store.queue().clone(),
        SendHandler::new(store.clone(), partners.clone()),
        worker_config,
    )?
    .hooks(store.hooks())
    .start())
}

/// Runs the demo on `store`: a local partner server, `config.jobs` transmissions, several
/// workers, a rolling restart midway, until every job is terminal.
pub async fn run<S: ExchangeStore>(
    store: S,
    backend: &'static str,
    config: &DemoConfig,
) -> Result<DemoReport, ExchangeError> {
    let started = Instant::now();
    let server = partner_server(config).await?;
    let mut partners =
        Partners::new().with_unresolvable(UNRESOLVABLE_PARTNER, "endpoint withdrawn");
    for name in LIVE_PARTNERS {
        let partner = HttpPartner::new(&server.endpoint(name))
            .map_err(|e| ExchangeError::Corrupt(e.to_string()))?;
        partners = partners.with(name, partner);
    }
    create_transactions(&store, config).await?;

    let exchange_config = ExchangeConfig {
        concurrency: config.concurrency,
        retry_base: Duration::from_millis(20),
        poll_interval: Duration::from_millis(250),
        batch_outcomes: config.batch_outcomes,
        ..ExchangeConfig::default()
    };
    let mut workers: Vec<WorkerHandle> = (0..config.workers.max(1))
        .map(|_| start_worker(&store, &partners, &exchange_config))
        .collect::<Result<_, _>>()?;

    let bar = progress_bar(config.jobs, config.progress);
    let mut stopped = WorkerStats::default();
    let mut released = 0;
    let mut restarted = false;
    loop {
        let summary = store.summary().await?;
        let terminal = summary.success + summary.failed;
        bar.set_position(terminal);
        if terminal as usize >= config.jobs {
            break;
        }
        if started.elapsed() > config.deadline {
            bar.abandon();
            return Err(ExchangeError::Corrupt(format!(
                "only {terminal} of {} jobs terminal after {:?}",
                config.jobs, config.deadline
            )));
        }
        if !restarted && terminal as f64 >= config.jobs as f64 * config.restart_at {
            restarted = true;
            bar.set_message("rolling restart");
            for (slot, worker) in workers.iter_mut().enumerate() {
                let replacement = start_worker(&store, &partners, &exchange_config)?;
                let old = std::mem::replace(worker, replacement);
                let report = old.shutdown().await?;
                released += report.released_unstarted + report.aborted;
                add(&mut stopped, &report.stats);
                bar.suspend(|| {
                    println!(
                        "restarted worker {}: released {} unstarted claims, {} running sends finished in time",
                        slot + 1,
                        report.released_unstarted,
                        report.finished_in_time
                    )
                });
            }
            bar.set_message("");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.finish();
    for worker in workers {
        add(&mut stopped, &worker.shutdown().await?.stats);
    }
    let summary = store.summary().await?;
    Ok(DemoReport {
        jobs: config.jobs,
        sent: summary.success,
        failed: summary.failed,
        duplicate_posts: server.duplicate_posts(),
        duplicates_explained: 0,
        conflicting_events: summary.conflicting_events,
        duplicate_events: summary.duplicate_events,
        stale_fenced: stopped.stale,
        released,
        backend,
        mode: "restart",
        kills: 0,
        elapsed_ms: started.elapsed().as_millis(),
    })
}

/// The local partner server: the live partners, each answering after the configured latency
/// and failing the configured share of POSTs with 503.
async fn partner_server(config: &DemoConfig) -> Result<PartnerServer, ExchangeError> {
    let behaviors: HashMap<String, Behavior> = LIVE_PARTNERS
        .iter()
        .map(|name| {
            let behavior = Behavior::Flaky {
                fail_rate: config.fail_rate,
                latency: config.partner_latency,
            };
            (name.to_string(), behavior)
        })
        .collect();
    PartnerServer::start(behaviors)
        .await
        .map_err(|e| ExchangeError::Corrupt(format!("cannot start the partner server: {e}")))
}

/// The demo's transactions, created in batches: most to the live partners, every
/// `doomed_every`th to the missing partner and the one before it to the unresolvable one.
async fn create_transactions<S: ExchangeStore>(
    store: &S,
    config: &DemoConfig,
) -> Result<(), ExchangeError> {
    let requests: Vec<(String, i64)> = (0..config.jobs)
        .map(|i| {
            let partner = match (config.doomed_every, i) {
                (0, _) => LIVE_PARTNERS[i % 2],
                (every, i) if i % every == every - 1 => MISSING_PARTNER,
                (every, i) if i % every == every - 2 => UNRESOLVABLE_PARTNER,
                _ => LIVE_PARTNERS[i % 2],
            };
            (partner.to_owned(), 100 + i as i64)
        })
        .collect();
    for chunk in requests.chunks(500) {
        store.create_transactions(chunk).await?;
    }
    Ok(())
}

/// A progress bar of `jobs` (hidden unless `shown`).
fn progress_bar(jobs: usize, shown: bool) -> ProgressBar {
    let bar = if shown {
        ProgressBar::new(jobs as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    bar
}

fn add(total: &mut WorkerStats, stats: &WorkerStats) {
    total.stale += stats.stale;
    total.completed += stats.completed;
    total.failed += stats.failed;
    total.retried += stats.retried;
    total.released += stats.released;
}
