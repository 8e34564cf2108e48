//! What each command does, through the admin API (so the hooks run), and how it ends.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use queue_core::{
    Admin, Backend, CancelOutcome, Hooks, JobFilter, JobId, JobStatus, PurgeRequest, RetryTarget,
    cancel_with_hooks, drain, purge, retry_with_hooks,
};
use queue_postgres::{
    LegacyUpgrade, PgError, PgQueue, PgQueueConfig, PgTx, UpgradeProgress, redact_url,
};
use serde::de::DeserializeOwned;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::cli::{Cli, Command, JobsCommand, QueueCommand, SchedulesCommand};
use crate::output::{self, Out};

/// How a command ended: the process's exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Exit {
    /// Done.
    Done = 0,
    /// Failed: the database, or an unexpected error.
    Failed = 1,
    /// Bad usage or a bad value.
    Usage = 2,
    /// A job was not found, or a schedule was not recorded.
    NotFound = 3,
    /// Refused, nothing changed: a job in another state, or a hook's refusal.
    Refused = 4,
    /// A destructive command was not confirmed.
    NotConfirmed = 5,
    /// A drain timed out with jobs still running.
    TimedOut = 6,
    /// Interrupted (Ctrl-C) after part of the work.
    Interrupted = 130,
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// No database named.
    #[error("no database: pass --database-url or set DATABASE_URL")]
    NoDatabase,
    /// The database URL does not parse (printed without its password).
    #[error("the database URL {url} is not a postgres:// URL or connection string: {reason}")]
    InvalidUrl {
        /// The URL, redacted.
        url: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The database could not be reached (the URL is printed without its password).
    #[error("cannot reach the database at {url}: {source}")]
    Connect {
        /// The URL, redacted.
        url: String,
        /// What failed.
        source: sqlx::Error,
    },
    /// A value was refused.
    #[error("{0}")]
    Invalid(String),
    /// The destructive command was not confirmed.
    #[error("not confirmed: {0}")]
    NotConfirmed(String),
    /// The queue backend failed.
    #[error(transparent)]
    Queue(#[from] queue_core::Error),
    /// The PostgreSQL backend failed.
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// Writing the output failed.
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
}

impl CtlError {
    /// The exit code of this error.
    pub fn exit(&self) -> Exit {
        match self {
            CtlError::NoDatabase | CtlError::Invalid(_) | CtlError::InvalidUrl { .. } => {
                Exit::Usage
            }
            CtlError::NotConfirmed(_) => Exit::NotConfirmed,
            CtlError::Queue(queue_core::Error::Invalid(_) | queue_core::Error::Config(_)) => {
                Exit::Usage
            }
            CtlError::Queue(queue_core::Error::Hook { .. }) => Exit::Refused,
            CtlError::Postgres(
                PgError::InvalidIdentifier { .. } | PgError::Setting { .. } | PgError::Invalid(_),
            ) => Exit::Usage,
            CtlError::Postgres(
                PgError::LockNotAvailable { .. } | PgError::UpgradeInProgress { .. },
            ) => Exit::Refused,
            _ => Exit::Failed,
        }
    }
}

type Result<T> = std::result::Result<T, CtlError>;

/// Runs `cli`'s command.
pub(crate) async fn run<P>(cli: &Cli, hooks: &Hooks<PgTx, P>) -> Result<Exit>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    let out = Out::new(cli.json);
    let pool = connect(cli).await?;
    match &cli.command {
        Command::Migrate => migrate(cli, &pool, &out).await,
        Command::UpgradeLegacy(args) => upgrade_legacy(cli, &pool, &out, args).await,
        Command::Status(args) => {
            let queue = open(cli, &pool).await?;
            output::status(&out, &queue, args.window).await
        }
        Command::Queue(command) => queue_command(cli, &pool, &out, command).await,
        Command::Jobs(command) => jobs_command(cli, &pool, &out, command, hooks).await,
        Command::Schedules(args) => {
            let queue = open(cli, &pool).await?;
            match &args.command {
                None => output::schedules(&out, &queue).await,
                Some(SchedulesCommand::Forget { name }) => {
                    forget_schedule(cli, &queue, &out, name).await
                }
            }
        }
        Command::Purge(args) => {
            let queue = open(cli, &pool).await?;
            let statuses: Vec<JobStatus> = args.states.iter().map(|&s| s.into()).collect();
            let request =
                PurgeRequest::new(&statuses, args.older_than)?.batch_size(args.batch_size);
            purge_jobs(cli, &queue, &out, &request).await
        }
        Command::Lease(args) => {
            let queue = open(cli, &pool).await?;
            output::leases(&out, &queue, args.limit).await
        }
        Command::Serve(args) => serve(cli, &pool, args, hooks).await,
    }
}

/// `serve`: the dashboard on `args.addr` until Ctrl-C or SIGTERM.
async fn serve<P>(
    cli: &Cli,
    pool: &PgPool,
    args: &crate::cli::ServeArgs,
    hooks: &Hooks<PgTx, P>,
) -> Result<Exit>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    use queue_dashboard::{Auth, DashboardConfig};
    let auth = match (&args.token, &args.basic_auth) {
        (Some(token), _) if token.is_empty() => {
            return Err(CtlError::Invalid("--token is empty".to_owned()));
        }
        (Some(token), _) => Some(Auth::Bearer(token.clone())),
        (None, Some(credentials)) => Some(Auth::basic(credentials).ok_or_else(|| {
            CtlError::Invalid("--basic-auth must be USER:PASSWORD, both non-empty".to_owned())
        })?),
        (None, None) => None,
    };
    if auth.is_none() && !args.addr.ip().is_loopback() && !args.no_auth {
        return Err(CtlError::Invalid(format!(
            "{} is not a loopback address: pass --token or --basic-auth (or --no-auth)",
            args.addr
        )));
    }
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    let bound = listener.local_addr()?;
    let mut origins = vec![format!("http://{bound}")];
    if bound.ip().is_loopback() {
        origins.push(format!("http://localhost:{}", bound.port()));
    }
    for origin in &args.public_origins {
        let valid = (origin.starts_with("http://") || origin.starts_with("https://"))
            && !origin
                .trim_start_matches("https://")
                .trim_start_matches("http://")
                .contains('/');
        if !valid {
            return Err(CtlError::Invalid(format!(
                "--public-origin {origin:?} must be scheme://host[:port], without a path"
            )));
        }
        origins.push(origin.clone());
    }
    let queue = open(cli, pool).await?;
    let config = DashboardConfig::new()
        .allowed_origins(origins)
        .allow_actions(args.allow_actions)
        .show_payloads(args.show_payloads)
        .refresh(Some(args.refresh))
        .auth(auth)
        .title(cli.table.as_str());
    let app = queue_dashboard::router(queue, hooks.clone(), config);
    // The one line a script waits for: where the dashboard listens.
    eprintln!(
        "dashboard on http://{bound}/ ({}{})",
        if args.allow_actions {
            "actions on"
        } else {
            "read-only"
        },
        if args.show_payloads {
            ", payloads shown"
        } else {
            ""
        }
    );
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(Exit::Done)
}

async fn connect(cli: &Cli) -> Result<PgPool> {
    use sqlx::ConnectOptions;
    let url = cli.database_url.as_deref().ok_or(CtlError::NoDatabase)?;
    let failed = |source| CtlError::Connect {
        url: redact_url(url).into_owned(),
        source,
    };
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .map_err(|err| CtlError::InvalidUrl {
            url: redact_url(url).into_owned(),
            // sqlx's parse errors name the part that failed, not the URL.
            reason: match err {
                sqlx::Error::Configuration(reason) => reason.to_string(),
                other => other.to_string(),
            },
        })?
        .disable_statement_logging();
    // One connection first, so that a refused or unreachable database says why (a pool only
    // says that it timed out).
    let first = tokio::time::timeout(Duration::from_secs(10), options.connect())
        .await
        .map_err(|_| failed(sqlx::Error::PoolTimedOut))?
        .map_err(failed)?;
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options);
    drop(first);
    Ok(pool)
}

async fn open(cli: &Cli, pool: &PgPool) -> Result<PgQueue> {
    // No LISTEN connection: a command never waits for wake-ups.
    let config = PgQueueConfig {
        listen: false,
        room_grants_for_new_queues: cli.room_grants_for_new_queues == crate::cli::Switch::On,
        ..PgQueueConfig::new(cli.table.clone(), cli.queue.clone())
    };
    Ok(PgQueue::connect(pool.clone(), config).await?)
}

/// Asks before a destructive change: `--yes`, or "y" typed at a terminal; refused otherwise.
fn confirm(cli: &Cli, what: &str) -> Result<()> {
    if cli.yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(CtlError::NotConfirmed(format!(
            "{what}; pass --yes to run it without asking"
        )));
    }
    eprint!("{what}. Go on? [y/N] ");
    let mut answer = String::new();
    stdin.read_line(&mut answer)?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(CtlError::NotConfirmed(what.to_owned()))
    }
}

/// Set by the first Ctrl-C, after which long commands stop between steps; a second Ctrl-C
/// ends the process at once (exit 130), a statement in flight or not.
fn interrupt_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            set.store(true, Ordering::SeqCst);
            eprintln!("stopping after the current step (Ctrl-C again to stop at once)");
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(Exit::Interrupted as i32);
            }
        }
    });
    flag
}

fn spinner(message: &str, json: bool) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} {pos}").expect("a valid template"));
    bar.set_message(message.to_owned());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

async fn migrate(cli: &Cli, pool: &PgPool, out: &Out) -> Result<Exit> {
    if cli.table == queue_postgres::TableName::default() {
        queue_postgres::migrate(pool).await?;
    } else {
        PgQueue::install_table(pool, &cli.table).await?;
    }
    PgQueue::check_schema(pool, &cli.table).await?;
    out.done(
        &format!("table {} is on the lease schema", cli.table),
        &serde_json::json!({ "table": cli.table.as_str(), "ready": true }),
    )?;
    Ok(Exit::Done)
}

async fn upgrade_legacy(
    cli: &Cli,
    pool: &PgPool,
    out: &Out,
    args: &crate::cli::UpgradeArgs,
) -> Result<Exit> {
    let mut upgrade = LegacyUpgrade::new(cli.table.clone(), cli.queue.clone())
        .lock_timeout(args.lock_timeout)?
        .lock_attempts(args.lock_attempts)
        .batch_size(args.batch_size)?;
    for index in &args.retire_index {
        upgrade = upgrade.retire_index(index)?;
    }
    confirm(
        cli,
        &format!(
            "this upgrades the legacy table {} in place for queue {}",
            cli.table, cli.queue
        ),
    )?;
    let bar = if cli.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:30} {bar:30} {pos}/{len}").expect("a valid template"),
    );
    let interrupted = interrupt_flag();
    let on_progress = |p: &UpgradeProgress| {
        bar.set_message(format!("{}: {}", p.phase.as_str(), p.step));
        bar.set_length(p.total.unwrap_or(0));
        bar.set_position(p.done);
    };
    let run = PgQueue::upgrade_legacy_table(pool, &upgrade, on_progress);
    tokio::pin!(run);
    let report = loop {
        tokio::select! {
            report = &mut run => break report?,
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                if interrupted.load(Ordering::SeqCst) {
                    bar.abandon();
                    eprintln!(
                        "interrupted: a statement in flight may finish on the server (an index \
                         build); every phase can run again: run the same command to resume"
                    );
                    return Ok(Exit::Interrupted);
                }
            }
        }
    };
    bar.finish_and_clear();
    let phases: Vec<serde_json::Value> = report
        .phase_times
        .iter()
        .map(|(phase, took)| serde_json::json!({ "phase": phase.as_str(), "ms": took.as_millis() as u64 }))
        .collect();
    let summary = format!(
        "upgraded {}: columns {}, {} rows stamped, {} indexes built ({} rebuilt), {} retired, {} lock retries",
        cli.table,
        if report.columns_added {
            "added"
        } else {
            "already there"
        },
        report.rows_stamped,
        report.indexes_built.len(),
        report.invalid_indexes_dropped.len(),
        report.indexes_retired.len(),
        report.lock_retries,
    );
    out.done(
        &summary,
        &serde_json::json!({
            "table": cli.table.as_str(),
            "columns_added": report.columns_added,
            "rows_stamped": report.rows_stamped,
            "indexes_built": report.indexes_built,
            "invalid_indexes_dropped": report.invalid_indexes_dropped,
            "indexes_retired": report.indexes_retired,
            "lock_retries": report.lock_retries,
            "phases": phases,
        }),
    )?;
    Ok(Exit::Done)
}

async fn queue_command(
    cli: &Cli,
    pool: &PgPool,
    out: &Out,
    command: &QueueCommand,
) -> Result<Exit> {
    let queue = open(cli, pool).await?;
    match command {
        QueueCommand::Pause => {
            if !queue.queues().await?.contains(&cli.queue) {
                eprintln!(
                    "warning: queue {} has no pending, running or failed job in {}: paused all \
                     the same (is the name right?)",
                    cli.queue, cli.table
                );
            }
            let control = queue.pause().await?;
            out.done(
                &format!("queue {} paused", cli.queue),
                &output::control_json(&cli.queue, &control),
            )?;
            Ok(Exit::Done)
        }
        QueueCommand::Resume => {
            let control = queue.resume().await?;
            out.done(
                &format!("queue {} resumed", cli.queue),
                &output::control_json(&cli.queue, &control),
            )?;
            Ok(Exit::Done)
        }
        QueueCommand::Limit {
            max_in_flight,
            rate,
            max_per_partition,
            rate_per_partition,
        } => {
            let limits = queue_core::QueueLimits {
                max_in_flight: *max_in_flight,
                rate: *rate,
                max_per_partition: *max_per_partition,
                rate_per_partition: *rate_per_partition,
            };
            let control = queue.set_limits(limits).await?;
            out.done(
                &format!("queue {}: {}", cli.queue, control.limits),
                &output::control_json(&cli.queue, &control),
            )?;
            Ok(Exit::Done)
        }
        QueueCommand::Grants { switch } => {
            let on = queue
                .set_room_grants(*switch == crate::cli::Switch::On)
                .await?;
            let json = serde_json::json!({
                "queue": cli.queue.as_str(),
                "room_grants": on,
            });
            let word = if on { "on" } else { "off" };
            out.done(&format!("queue {}: room grants {word}", cli.queue), &json)?;
            Ok(Exit::Done)
        }
        QueueCommand::Drain { timeout } => {
            let bar = spinner("waiting for running jobs", cli.json);
            let report = drain(&queue, *timeout, Duration::from_millis(500)).await?;
            bar.finish_and_clear();
            let json = serde_json::json!({
                "queue": cli.queue.as_str(),
                "paused": true,
                "running": report.running,
                "stranded": report.stranded,
                "drained": report.drained,
            });
            let text = if report.drained {
                format!(
                    "queue {} drained and paused ({} stranded: their leases passed; they are taken over on resume)",
                    cli.queue, report.stranded
                )
            } else {
                format!(
                    "queue {} paused; {} jobs still running after {}",
                    cli.queue,
                    report.running,
                    humantime::format_duration(*timeout)
                )
            };
            out.done(&text, &json)?;
            Ok(if report.drained {
                Exit::Done
            } else {
                Exit::TimedOut
            })
        }
    }
}

/// `schedules forget NAME`: the record goes (a scheduler that still runs it records it again);
/// not recorded: exit 3, as a job not found.
async fn forget_schedule(cli: &Cli, queue: &PgQueue, out: &Out, name: &str) -> Result<Exit> {
    if queue.forget_schedule(name).await? {
        out.done(
            &format!(
                "schedule {name} of queue {} forgotten (a scheduler that still runs it records it \
                 again at its next pass)",
                cli.queue
            ),
            &serde_json::json!({
                "queue": cli.queue.as_str(),
                "name": name,
                "forgotten": true,
            }),
        )?;
        Ok(Exit::Done)
    } else {
        out.not_found(&format!(
            "no schedule {name:?} is recorded for queue {} (queuectl schedules lists them)",
            cli.queue
        ))?;
        Ok(Exit::NotFound)
    }
}

async fn jobs_command<P>(
    cli: &Cli,
    pool: &PgPool,
    out: &Out,
    command: &JobsCommand,
    hooks: &Hooks<PgTx, P>,
) -> Result<Exit>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    let queue = open(cli, pool).await?;
    match command {
        JobsCommand::List {
            states,
            limit,
            before,
        } => {
            let mut filter = JobFilter::new().limit(*limit);
            for &state in states {
                filter = filter.status(state.into());
            }
            if let Some(before) = before {
                filter = filter.before(JobId(*before));
            }
            let page = queue.list_jobs(&filter).await?;
            output::job_page(out, &page)?;
            Ok(Exit::Done)
        }
        JobsCommand::Show { id, show_payload } => match queue.get(JobId(*id)).await? {
            Some(job) => {
                output::job(out, &job, *show_payload)?;
                Ok(Exit::Done)
            }
            None => {
                out.not_found(&format!("job {id} not found in queue {}", cli.queue))?;
                Ok(Exit::NotFound)
            }
        },
        JobsCommand::Find { key } => match queue.find_by_unique_key(key).await? {
            Some(job) => {
                output::job(out, &job, false)?;
                Ok(Exit::Done)
            }
            None => {
                out.not_found(&format!(
                    "no job of queue {} holds that unique key",
                    cli.queue
                ))?;
                Ok(Exit::NotFound)
            }
        },
        JobsCommand::Retry(args) if args.all => {
            let state: JobStatus = args.state.expect("clap requires --state with --all").into();
            retry_all(cli, &queue, out, hooks, state).await
        }
        JobsCommand::Retry(args) => {
            let expected = args.state.map(JobStatus::from);
            retry_ids(&queue, out, hooks, &args.ids, expected).await
        }
        JobsCommand::Cancel { ids } => {
            confirm(
                cli,
                &format!("this cancels {} job(s) of queue {}", ids.len(), cli.queue),
            )?;
            cancel_ids(&queue, out, hooks, ids).await
        }
    }
}

/// What one job's retry or cancel came to, for the output and the exit code.
pub(crate) struct ItemResult {
    pub(crate) id: i64,
    pub(crate) result: &'static str,
    pub(crate) detail: String,
    pub(crate) exit: Exit,
}

async fn retry_ids<P>(
    queue: &PgQueue,
    out: &Out,
    hooks: &Hooks<PgTx, P>,
    ids: &[i64],
    expected: Option<JobStatus>,
) -> Result<Exit>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    let mut results = Vec::new();
    for &id in ids {
        match retry_one(queue, hooks, id, expected).await {
            Ok(result) => results.push(result),
            Err(err) => return partial(out, &results, err),
        }
    }
    output::items(out, &results)
}

/// Prints what was done before `err` stopped a command on several jobs, then fails with it.
fn partial(out: &Out, results: &[ItemResult], err: CtlError) -> Result<Exit> {
    if !results.is_empty() {
        eprintln!("done before the error:");
        output::items(out, results)?;
    }
    Err(err)
}

/// Retries job `id`, guarded on the state it is seen in now (or on `expected`).
async fn retry_one<P>(
    queue: &PgQueue,
    hooks: &Hooks<PgTx, P>,
    id: i64,
    expected: Option<JobStatus>,
) -> Result<ItemResult>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    let item = |result, detail: String, exit| ItemResult {
        id,
        result,
        detail,
        exit,
    };
    let seen = match expected {
        Some(status) => status,
        None => match queue.get(JobId(id)).await? {
            Some(job) => job.status,
            None => return Ok(item("not found", String::new(), Exit::NotFound)),
        },
    };
    if !queue_core::RETRYABLE.contains(&seen) {
        return Ok(item(
            "refused",
            format!(
                "it is {}: only dead, failed or cancelled jobs can be retried",
                seen.as_str()
            ),
            Exit::Refused,
        ));
    }
    match retry_with_hooks(queue, hooks, JobId(id), seen).await {
        Ok(RetryTarget::Retried(_)) => Ok(item(
            "retried",
            format!("was {}", seen.as_str()),
            Exit::Done,
        )),
        Ok(RetryTarget::NotFound) => Ok(item("not found", String::new(), Exit::NotFound)),
        Ok(RetryTarget::WrongState(now)) => Ok(item(
            "refused",
            format!("it is {} now", now.as_str()),
            Exit::Refused,
        )),
        Err(queue_core::Error::Hook { hook, source }) => Ok(item(
            "refused",
            format!("hook {hook}: {source}"),
            Exit::Refused,
        )),
        Err(err) => Err(err.into()),
    }
}

async fn retry_all<P>(
    cli: &Cli,
    queue: &PgQueue,
    out: &Out,
    hooks: &Hooks<PgTx, P>,
    state: JobStatus,
) -> Result<Exit>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    confirm(
        cli,
        &format!(
            "this retries every {} job of queue {}",
            state.as_str(),
            cli.queue
        ),
    )?;
    let interrupted = interrupt_flag();
    let bar = spinner(&format!("retrying {} jobs", state.as_str()), cli.json);
    let mut results = Vec::new();
    let mut filter = JobFilter::new().status(state).limit(200);
    'pages: loop {
        let page = match queue.list_jobs(&filter).await {
            Ok(page) => page,
            Err(err) => return partial(out, &results, err.into()),
        };
        for job in &page.jobs {
            if interrupted.load(Ordering::SeqCst) {
                break 'pages;
            }
            match retry_one(queue, hooks, job.id.0, Some(state)).await {
                Ok(result) => results.push(result),
                Err(err) => return partial(out, &results, err),
            }
            bar.inc(1);
        }
        match page.next {
            Some(cursor) => filter = filter.before(cursor),
            None => break,
        }
    }
    bar.finish_and_clear();
    let exit = output::items(out, &results)?;
    Ok(if interrupted.load(Ordering::SeqCst) {
        Exit::Interrupted
    } else {
        exit
    })
}

async fn cancel_ids<P>(
    queue: &PgQueue,
    out: &Out,
    hooks: &Hooks<PgTx, P>,
    ids: &[i64],
) -> Result<Exit>
where
    P: DeserializeOwned + Send + Sync + 'static,
{
    let mut results = Vec::new();
    for &id in ids {
        let item = |result, detail: String, exit| ItemResult {
            id,
            result,
            detail,
            exit,
        };
        results.push(match cancel_with_hooks(queue, hooks, JobId(id)).await {
            Ok(CancelOutcome::Cancelled) => item("cancelled", String::new(), Exit::Done),
            Ok(CancelOutcome::Requested) => item(
                "requested",
                "in flight: its holder ends it at its next heartbeat or outcome".to_owned(),
                Exit::Done,
            ),
            Ok(CancelOutcome::AlreadyTerminal(status)) => item(
                "refused",
                format!("it is {} already", status.as_str()),
                Exit::Refused,
            ),
            Ok(CancelOutcome::NotFound) => item("not found", String::new(), Exit::NotFound),
            Err(queue_core::Error::Hook { hook, source }) => {
                item("refused", format!("hook {hook}: {source}"), Exit::Refused)
            }
            Err(err) => return partial(out, &results, err.into()),
        });
    }
    output::items(out, &results)
}

async fn purge_jobs(cli: &Cli, queue: &PgQueue, out: &Out, request: &PurgeRequest) -> Result<Exit> {
    let states: Vec<&str> = request.statuses().iter().map(|s| s.as_str()).collect();
    confirm(
        cli,
        &format!(
            "this deletes the {} jobs of queue {} that finished more than {} ago",
            states.join(", "),
            cli.queue,
            humantime::format_duration(request.older_than())
        ),
    )?;
    let interrupted = interrupt_flag();
    let bar = spinner("purged", cli.json);
    let deleted = purge(
        queue,
        request,
        |total| bar.set_position(total),
        || !interrupted.load(Ordering::SeqCst),
    )
    .await?;
    bar.finish_and_clear();
    let stopped = interrupted.load(Ordering::SeqCst);
    out.done(
        &format!(
            "purged {deleted} jobs of queue {}{}",
            cli.queue,
            if stopped { " (interrupted)" } else { "" }
        ),
        &serde_json::json!({
            "queue": cli.queue.as_str(),
            "states": states,
            "deleted": deleted,
            "interrupted": stopped,
        }),
    )?;
    Ok(if stopped {
        Exit::Interrupted
    } else {
        Exit::Done
    })
}
