//! The chaos suite: the exchange's `exchange-worker` processes against a PostgreSQL cluster of
//! the suite's own and a real local HTTP partner, through an operator's bad day: `kill -9` at
//! random points (and while or just after the partner answers), `SIGSTOP` past the lease then
//! `SIGCONT`, `pg_terminate_backend` of the workers' connections, PostgreSQL crashing and
//! restarting, a partner that hangs past the send timeout, and poison payloads. After each
//! scenario the faults stop, the queue drains, the workers get SIGTERM, and an [`Audit`] checks
//! the promise: no job lost or stranded, one outcome and one event per transaction, no status
//! flip, no success the partner did not accept, and every duplicate or overlapping send tied to
//! an injected fault or a send timeout.
//!
//! [`ChaosConfig::quick`] runs in CI (`tests/chaos.rs`); [`ChaosConfig::full`] is the
//! `exchange-chaos` binary's default (see `docs/reliability.md`).

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use queue_core::CancellationToken;
use queue_postgres::testing::{AutoFailoverCluster, ClusterError, TempCluster};
use queue_postgres::{PgQueueConfig, PostgresQueue, PrimaryPool, Sqlx};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, PgPool};

pub(crate) mod audit;
pub(crate) mod faults;
pub(crate) mod fleet;

pub use audit::Audit;
pub use faults::{Fault, FaultKind};

use crate::exchange::partner_server::{Behavior, PartnerServer};
use crate::exchange::{ExchangeError, ExchangeStore, PgExchange};
use faults::{AtPartner, FaultLog, Targets};
use fleet::Fleet;

/// The harness's own connections (`application_name`), spared by `pg_terminate_backend`.
const HARNESS: &str = "exchange-chaos";
/// The partner every transaction goes to.
const PARTNER: &str = "acme";

/// A scenario: which faults are injected while the load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Scenario {
    /// `kill -9` of workers: at random moments, while the partner holds their POST, and just
    /// after it answered. The supervisor starts a new worker for each.
    Kill,
    /// `SIGSTOP` of a worker for longer than the lease, then `SIGCONT`.
    Stop,
    /// `pg_terminate_backend` of every worker connection, again and again.
    Terminate,
    /// PostgreSQL crashes (`pg_ctl stop -m immediate`) and comes back.
    Restart,
    /// The partner answers only after three send timeouts, for a while.
    Hang,
    /// Send jobs with poison payloads (`{}`, `[1,2,3]`, `null`, a wrong type, another
    /// transaction's payload) among the load.
    Poison,
    /// Every fault above at once, poison payloads included.
    All,
    /// PostgreSQL failovers on a pg_auto_failover formation: planned switchovers
    /// (`pg_autoctl perform failover`), kills of the primary's postmaster (its keeper restarts
    /// it) and the loss of the primary's machine (its keeper and postmaster killed, the standby
    /// promoted, the lost node rejoined as the standby), the workers on the multi-host URL. Run by [`run_failover`], not [`run`].
    Failover,
}

impl Scenario {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Scenario::Kill => "kill",
            Scenario::Stop => "stop",
            Scenario::Terminate => "terminate",
            Scenario::Restart => "restart",
            Scenario::Hang => "hang",
            Scenario::Poison => "poison",
            Scenario::All => "all",
            Scenario::Failover => "failover",
        }
    }

    fn plants_poison(self) -> bool {
        matches!(self, Scenario::Poison | Scenario::All)
    }
}

/// How a chaos run goes.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// The `exchange-worker` binary.
    pub worker_bin: PathBuf,
    /// The scenarios, in order.
    pub scenarios: Vec<Scenario>,
    /// Worker processes kept running.
    pub workers: usize,
    /// Sends at once per worker.
    pub concurrency: usize,
    /// Transactions created per scenario, spread over `load_for`.
    pub transactions: usize,
    /// How long the load is created for.
    pub load_for: Duration,
    /// Faults of each kind per scenario.
    pub rounds: usize,
    /// The workers' lease (whole seconds).
    pub lease: Duration,
    /// The partner adapter's send timeout (whole seconds).
    pub send_timeout: Duration,
    /// How long the partner takes to answer.
    pub partner_latency: Duration,
    /// The share of POSTs the partner answers 503 (retried).
    pub fail_rate: f64,
    /// Give up waiting for the queue to drain after this.
    pub drain_deadline: Duration,
    /// The workers' PostgreSQL driver.
    pub driver: crate::cli::PgDriver,
}

impl ChaosConfig {
    /// The CI run: every single-fault scenario, small (about two minutes).
    pub fn quick(worker_bin: PathBuf) -> ChaosConfig {
        ChaosConfig {
            worker_bin,
            scenarios: vec![
                Scenario::Kill,
                Scenario::Stop,
                Scenario::Terminate,
                Scenario::Restart,
                Scenario::Hang,
                Scenario::Poison,
            ],
            workers: 3,
            concurrency: 6,
            transactions: 240,
            load_for: Duration::from_secs(4),
            rounds: 3,
            lease: Duration::from_secs(4),
            send_timeout: Duration::from_secs(1),
            partner_latency: Duration::from_millis(25),
            fail_rate: 0.05,
            drain_deadline: Duration::from_secs(120),
            driver: crate::cli::PgDriver::Sqlx,
        }
    }

    /// The failover run in CI: two each of switchovers, kills of the primary's postmaster and
    /// lost primaries under a small load,
    /// with `driver`. The lease (10 s) is longer than a failover (about 2 s to 5 s here), so
    /// workers ride through it: their outcomes are tried again until the new primary takes
    /// them.
    pub fn failover(worker_bin: PathBuf, driver: crate::cli::PgDriver) -> ChaosConfig {
        let mut config = ChaosConfig::quick(worker_bin);
        config.scenarios = vec![Scenario::Failover];
        config.transactions = 600;
        config.load_for = Duration::from_secs(30);
        config.rounds = 6;
        config.lease = Duration::from_secs(10);
        config.driver = driver;
        config
    }

    /// The full run: every scenario, the combined one included, larger and longer.
    pub fn full(worker_bin: PathBuf) -> ChaosConfig {
        let mut config = ChaosConfig::quick(worker_bin);
        config.scenarios.push(Scenario::All);
        config.workers = 4;
        config.concurrency = 8;
        config.transactions = 3000;
        config.load_for = Duration::from_secs(30);
        config.rounds = 12;
        config.drain_deadline = Duration::from_secs(300);
        config
    }

    fn partner_behavior(&self) -> Behavior {
        Behavior::Flaky {
            fail_rate: self.fail_rate,
            latency: self.partner_latency,
        }
    }

    fn worker_args(&self, database_url: &str, partner: &str) -> Vec<String> {
        // The exchange's lease rule (2 × send timeout + margin) with a margin of half the lease:
        // a local database answers in milliseconds.
        let margin = self
            .lease
            .saturating_sub(self.send_timeout * 2)
            .as_secs()
            .max(1);
        [
            "--database-url",
            database_url,
            "--partner",
            &format!("{PARTNER}={partner}"),
            "--lease-secs",
            &self.lease.as_secs().to_string(),
            "--send-timeout-secs",
            &self.send_timeout.as_secs().to_string(),
            "--lease-margin-secs",
            &margin.to_string(),
            "--concurrency",
            &self.concurrency.to_string(),
            "--max-attempts",
            "8",
            "--retry-base-ms",
            "100",
            "--poll-ms",
            "200",
            "--driver",
            match self.driver {
                crate::cli::PgDriver::Sqlx => "sqlx",
                crate::cli::PgDriver::TokioPostgres => "tokio-postgres",
            },
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

/// Why a chaos run could not be carried out (a broken promise is not an error: it is in the
/// [`Audit`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// The suite's PostgreSQL cluster failed.
    #[error("the chaos cluster: {0}")]
    Cluster(#[from] ClusterError),
    /// The exchange failed.
    #[error(transparent)]
    Exchange(#[from] ExchangeError),
    /// The harness's own database work failed.
    #[error("the harness's database work: {0}")]
    Database(#[from] sqlx::Error),
    /// Starting worker processes or the partner failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A task of the harness panicked.
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
    /// The queue did not drain by the deadline even after the faults stopped.
    #[error("scenario {scenario}: not drained after {deadline:?} ({left} left)")]
    NotDrained {
        /// The scenario.
        scenario: &'static str,
        /// The deadline.
        deadline: Duration,
        /// Transactions and send jobs not terminal.
        left: i64,
    },
}

/// One scenario's outcome.
#[derive(Debug, Clone)]
pub struct ScenarioReport {
    /// The scenario.
    pub scenario: Scenario,
    /// Its audit.
    pub audit: Audit,
    /// From the first transaction to the last terminal one.
    pub elapsed: Duration,
    /// Where the workers' logs are.
    pub logs: PathBuf,
    /// The longest time between two POSTs reaching the partner while the load ran: the
    /// pause the workers' clients saw (a failover's, in the failover scenario).
    pub longest_post_gap: Duration,
    /// How many times the workers' `LISTEN` connections connected (once each at start,
    /// again after each loss).
    pub listener_connects: usize,
}

/// A chaos run's outcome.
#[derive(Debug, Clone, Default)]
pub struct ChaosReport {
    /// One report per scenario, in order.
    pub scenarios: Vec<ScenarioReport>,
}

impl ChaosReport {
    /// Every broken promise, named with its scenario.
    pub fn violations(&self) -> Vec<String> {
        self.scenarios
            .iter()
            .flat_map(|s| {
                s.audit
                    .violations()
                    .into_iter()
                    .map(move |v| format!("{}: {v}", s.scenario.as_str()))
            })
            .collect()
    }
}

impl fmt::Display for ChaosReport {
    /// A Markdown table, one row per scenario.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| scenario | faults injected | transactions (poison) | success / failed | jobs \
             taken over | POSTs (2xx) | duplicate sends (unexplained) | overlapping sends \
             (unexplained) | lost | stranded | event errors | flips | other violations | \
             seconds |"
        )?;
        writeln!(f, "|{}", "---|".repeat(14))?;
        for s in &self.scenarios {
            let a = &s.audit;
            let faults = a
                .faults
                .iter()
                .map(|(kind, n)| format!("{n} × {}", kind.as_str()))
                .collect::<Vec<_>>()
                .join(", ");
            let other = a.unsent_successes
                + a.unbacked_successes
                + a.foreign_posts
                + a.poison_not_failed
                + a.unclean_exits;
            writeln!(
                f,
                "| {} | {} | {} ({}) | {} / {} | {} | {} ({}) | {} ({}) | {} ({}) | {} | {} | {} \
                 | {} | {} | {:.1} |",
                s.scenario.as_str(),
                if faults.is_empty() {
                    "none".into()
                } else {
                    faults
                },
                a.transactions,
                a.poison,
                a.success,
                a.failed,
                a.taken_over,
                a.posts,
                a.accepted,
                a.duplicates_explained + a.unexplained_duplicates,
                a.unexplained_duplicates,
                a.overlaps_explained + a.unexplained_overlaps,
                a.unexplained_overlaps,
                a.lost,
                a.stranded,
                a.missing_events + a.double_events + a.conflicting_events,
                a.flips,
                other,
                s.elapsed.as_secs_f64()
            )?;
        }
        Ok(())
    }
}

/// Runs every scenario of `config` on a PostgreSQL cluster of its own (created here, removed
/// at the end), one scenario after the other.
pub async fn run(config: &ChaosConfig) -> Result<ChaosReport, ChaosError> {
    let cluster = Cluster::Single(Arc::new(
        tokio::task::spawn_blocking(TempCluster::start).await??,
    ));
    run_on(config, &cluster).await
}

/// Runs the [`Scenario::Failover`] scenario of `config` on a pg_auto_failover formation of
/// its own (created here, removed at the end).
pub async fn run_failover(config: &ChaosConfig) -> Result<ChaosReport, ChaosError> {
    let cluster = Cluster::Ha(Arc::new(
        tokio::task::spawn_blocking(AutoFailoverCluster::start).await??,
    ));
    run_on(config, &cluster).await
}

async fn run_on(config: &ChaosConfig, cluster: &Cluster) -> Result<ChaosReport, ChaosError> {
    let (admin, _admin_follower) = harness_pool(cluster, "postgres", 2).await?;
    let mut report = ChaosReport::default();
    for scenario in &config.scenarios {
        let outcome = run_scenario(config, cluster, &admin, *scenario).await?;
        tracing::info!(scenario = scenario.as_str(), audit = %outcome.audit, "chaos scenario done");
        report.scenarios.push(outcome);
    }
    admin.close().await;
    Ok(report)
}

/// The server the suite runs on: one cluster, or a high-availability formation.
pub(crate) enum Cluster {
    Single(Arc<TempCluster>),
    Ha(Arc<AutoFailoverCluster>),
}

impl Cluster {
    fn url(&self, database: &str) -> String {
        match self {
            Cluster::Single(c) => c.url(database),
            Cluster::Ha(c) => c.url(database),
        }
    }
}

/// A pool of the harness's own on `database` (on a formation, one that follows the primary,
/// with its follower).
async fn harness_pool(
    cluster: &Cluster,
    database: &str,
    size: u32,
) -> Result<(PgPool, Option<PrimaryPool>), ChaosError> {
    let options = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10));
    match cluster {
        Cluster::Single(c) => Ok((
            options
                .connect_with(harness_options(&c.url(database))?)
                .await?,
            None,
        )),
        Cluster::Ha(c) => {
            let url = format!("{}&application_name={HARNESS}", c.url(database));
            let primary = PrimaryPool::connect(&url, options)
                .await
                .map_err(ExchangeError::from)?;
            Ok((primary.pool().clone(), Some(primary)))
        }
    }
}

fn harness_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(url
        .parse::<PgConnectOptions>()?
        .application_name(HARNESS)
        .disable_statement_logging())
}

async fn run_scenario(
    config: &ChaosConfig,
    cluster: &Cluster,
    admin: &PgPool,
    scenario: Scenario,
) -> Result<ScenarioReport, ChaosError> {
    // Runs in one process (tests in parallel) each have a database and a log folder of their own.
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let database = format!(
        "chaos_{}_{}_{}",
        scenario.as_str(),
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    sqlx::query(AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    )))
    .execute(admin)
    .await?;
    sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{database}\"")))
        .execute(admin)
        .await?;
    let url = cluster.url(&database);
    let (pool, _follower) = harness_pool(cluster, &database, 6).await?;
    crate::exchange::MIGRATOR
        .run(&pool)
        .await
        .map_err(queue_postgres::PgError::from)
        .map_err(ExchangeError::from)?;
    // The harness only creates transactions: no LISTEN connection of its own.
    let queue_config = PgQueueConfig {
        listen: false,
        ..crate::exchange::send_queue_config()?
    };
    let store = PgExchange::from_queue(
        PostgresQueue::<Sqlx>::connect(pool.clone(), queue_config)
            .await
            .map_err(ExchangeError::from)?,
    );
    sqlx::raw_sql(audit::STATUS_LOG).execute(&pool).await?;

    let partner = PartnerServer::start(
        [(PARTNER.to_owned(), config.partner_behavior())]
            .into_iter()
            .collect(),
    )
    .await?;
    let log = FaultLog::default();
    // Strikes at the partner: kills in `kill`, pauses in `stop`, one or the other in `all`.
    let at_partner = match scenario {
        Scenario::Kill => Some(AtPartner::kill(log.clone(), config.rounds * 2, 0.02)),
        Scenario::Stop => Some(AtPartner::stop(
            log.clone(),
            config.rounds,
            0.02,
            config.lease,
        )),
        Scenario::All if fastrand::bool() => {
            Some(AtPartner::kill(log.clone(), config.rounds * 2, 0.02))
        }
        Scenario::All => Some(AtPartner::stop(
            log.clone(),
            config.rounds,
            0.02,
            config.lease,
        )),
        _ => None,
    };
    let at_partner = at_partner.map(Arc::new);
    if let Some(observer) = &at_partner {
        partner.observe(observer.clone());
    }
    let logs = std::env::temp_dir().join(format!("{database}-logs"));
    std::fs::create_dir_all(&logs)?;
    let fleet = Mutex::new(Fleet::new(
        config.worker_bin.clone(),
        config.worker_args(&url, &partner.endpoint(PARTNER)),
        logs.clone(),
    ));
    fleet.lock().unwrap().top_up(config.workers)?;

    let started = Instant::now();
    let stop = CancellationToken::new();
    let targets = Targets {
        config,
        fleet: &fleet,
        cluster,
        admin,
        database: &database,
        partner: &partner,
        log: &log,
    };
    let supervise = async {
        // Keeps the fleet at its size: a killed worker is replaced, as an orchestrator would.
        while !stop.is_cancelled() {
            fleet.lock().unwrap().top_up(config.workers)?;
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        Ok::<(), ChaosError>(())
    };
    let work = async {
        let worked = async {
            // A fault loop that fails stops the load too, instead of leaving it to wait for a
            // database that may not come back.
            let failed = CancellationToken::new();
            let load = load(config, &store, &pool, scenario, &failed);
            let injected = async {
                let injected = faults::inject(scenario, &targets, &stop).await;
                if injected.is_err() {
                    failed.cancel();
                }
                injected
            };
            let (created, injected) = tokio::join!(load, injected);
            injected?;
            let created = created?;
            // The faults are over, those at the partner included: every job must now reach
            // a terminal state.
            partner.stop_observing();
            if let Some(observer) = &at_partner {
                observer.settle().await;
            }
            drain(config, &pool, scenario).await?;
            Ok::<_, ChaosError>(created)
        }
        .await;
        // Ends the supervisor whatever happened, so that an error is reported, not waited on.
        stop.cancel();
        worked
    };
    let (supervised, worked) = tokio::join!(supervise, work);
    stop.cancel();
    let elapsed = started.elapsed();
    let children = fleet.lock().unwrap().take();
    let statuses = fleet::drain(children, Duration::from_secs(30)).await;
    supervised?;
    let (created, poison) = worked?;
    let unclean_exits = statuses
        .iter()
        .filter(|status| !status.is_some_and(|s| s.success()))
        .count();

    // A POST the partner still holds (a hang) is answered before the audit reads the log.
    partner.wait_answered(config.send_timeout * 4).await;
    let posts = partner.log();
    let faults = log.all();
    let guard_refusals = count_in_logs(&logs, crate::exchange::events::TRANSACTION_GUARD_REFUSED)?;
    let listener_connects = count_in_logs(&logs, queue_core::events::LISTENER_CONNECTED)?;
    let mut arrivals: Vec<Instant> = posts.iter().map(|p| p.arrived).collect();
    arrivals.sort();
    let longest_post_gap = arrivals
        .windows(2)
        .map(|pair| pair[1] - pair[0])
        .max()
        .unwrap_or_default();
    let evidence = audit::Evidence {
        created: &created,
        poison: &poison,
        posts: &posts,
        faults: &faults,
        lease: config.lease,
        send_timeout: config.send_timeout,
        unclean_exits,
        guard_refusals,
    };
    let audit = audit::audit(&pool, &evidence).await?;
    pool.close().await;
    if audit.violations().is_empty() {
        let _ = std::fs::remove_dir_all(&logs);
        sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
        )))
        .execute(admin)
        .await?;
    }
    Ok(ScenarioReport {
        scenario,
        audit,
        elapsed,
        logs,
        longest_post_gap,
        listener_connects,
    })
}

/// How many lines of the workers' logs in `dir` name `event`.
fn count_in_logs(dir: &std::path::Path, event: &str) -> std::io::Result<usize> {
    let mut count = 0;
    for entry in std::fs::read_dir(dir)? {
        let text = std::fs::read_to_string(entry?.path())?;
        count += text.lines().filter(|line| line.contains(event)).count();
    }
    Ok(count)
}

/// Creates the scenario's transactions over `config.load_for`, through the store as a service
/// would (and, for the poison scenarios, plants poison send jobs as a bad deploy or a hand edit
/// would). Returns the ids of the transactions created, then of the poison ones.
async fn load(
    config: &ChaosConfig,
    store: &PgExchange,
    pool: &PgPool,
    scenario: Scenario,
    failed: &CancellationToken,
) -> Result<(Vec<i64>, Vec<i64>), ChaosError> {
    const TICK: Duration = Duration::from_millis(100);
    let ticks = (config.load_for.as_millis() / TICK.as_millis()).max(1) as usize;
    let per_tick = config.transactions.div_ceil(ticks);
    let mut created = Vec::with_capacity(config.transactions);
    let mut poison = Vec::new();
    let mut tick = tokio::time::interval(TICK);
    while created.len() < config.transactions && !failed.is_cancelled() {
        tick.tick().await;
        let n = per_tick.min(config.transactions - created.len());
        let batch: Vec<(String, i64)> = (0..n)
            .map(|i| (PARTNER.to_owned(), (created.len() + i) as i64 + 1))
            .collect();
        // The database may be down (a restart): the batch is created again later. A batch
        // whose commit reply was lost may exist without its ids here; the audit reads the
        // database for stranded rows, so those count as well.
        if let Ok(ids) = store.create_transactions(&batch).await {
            created.extend(ids);
        }
        if scenario.plants_poison() && !created.is_empty() && poison.len() < 12 {
            let victim = created[fastrand::usize(..created.len())];
            if let Ok(id) = plant_poison(pool, poison_payload(pool, victim).await).await {
                poison.push(id);
            }
        }
    }
    Ok((created, poison))
}

/// A poison payload: one that does not parse, another transaction's, or another transaction's
/// with the planted job's own transaction id (so only its key is foreign). The flag says
/// whether to put the own id in.
async fn poison_payload(pool: &PgPool, victim: i64) -> (Value, bool) {
    let victims = async || {
        sqlx::query_scalar("SELECT payload FROM exchange_send_jobs WHERE transaction_id = $1")
            .bind(victim)
            .fetch_one(pool)
            .await
            .unwrap_or(Value::Null)
    };
    match fastrand::usize(..6) {
        0 => (json!({}), false),
        1 => (json!([1, 2, 3]), false),
        2 => (Value::Null, false),
        3 => (
            json!({ "transaction_id": "seven", "correlation_id": 7 }),
            false,
        ),
        4 => (victims().await, false),
        _ => (victims().await, true),
    }
}

/// A transaction whose send job carries `payload` (with the transaction's own id in it when
/// `own_id`).
async fn plant_poison(pool: &PgPool, (payload, own_id): (Value, bool)) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "WITH t AS (INSERT INTO exchange_transactions (partner, amount_minor) \
                    VALUES ($1, 1) RETURNING id) \
         INSERT INTO exchange_send_jobs (transaction_id, queue, payload) \
         SELECT id, $2, CASE WHEN $4 AND jsonb_typeof($3) = 'object' \
                             THEN jsonb_set($3, '{transaction_id}', to_jsonb(id)) \
                             ELSE $3 END \
         FROM t RETURNING transaction_id",
    )
    .bind(PARTNER)
    .bind(crate::exchange::QUEUE)
    .bind(payload)
    .bind(own_id)
    .fetch_one(pool)
    .await
}

/// Waits until no transaction is pending and no send job is pending or in flight.
async fn drain(config: &ChaosConfig, pool: &PgPool, scenario: Scenario) -> Result<(), ChaosError> {
    let deadline = Instant::now() + config.drain_deadline;
    let mut left = i64::MAX;
    while Instant::now() < deadline {
        if let Ok(n) = sqlx::query_scalar::<_, i64>(
            "SELECT (SELECT count(*) FROM exchange_transactions WHERE status = 'pending') + \
                    (SELECT count(*) FROM exchange_send_jobs \
                     WHERE status IN ('pending', 'in_flight'))",
        )
        .fetch_one(pool)
        .await
        {
            left = n;
            if n == 0 {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(ChaosError::NotDrained {
        scenario: scenario.as_str(),
        deadline: config.drain_deadline,
        left,
    })
}
