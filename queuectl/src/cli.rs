//! The command line: global options and subcommands (clap).

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use queue_core::{JobStatus, QueueName};
use queue_postgres::TableName;

/// Operate the queues of a queue-framework table.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "queuectl",
    version,
    about = "Operate the queues of a queue-framework table: status, pause, drain, limit, \
             list, show, retry, cancel and purge jobs, see and forget schedules, migrate and \
             upgrade tables.",
    after_help = "Exit codes: 0 done, 1 failed, 2 bad usage or value, 3 not found, 4 refused \
                  (nothing changed), 5 not confirmed, 6 timed out, 130 interrupted."
)]
pub struct Cli {
    /// The database, as a postgres:// URL (printed without its password).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,

    /// The queue table.
    #[arg(long, global = true, default_value = TableName::DEFAULT, value_parser = parse_table)]
    pub table: TableName,

    /// The queue inside the table.
    #[arg(long, global = true, default_value = QueueName::DEFAULT, value_parser = parse_queue)]
    pub queue: QueueName,

    /// Print JSON instead of tables (one document on stdout).
    #[arg(long, global = true)]
    pub json: bool,

    /// Do not ask before destructive commands (cancel, bulk retry, purge, upgrade).
    #[arg(long, short = 'y', global = true)]
    pub yes: bool,

    /// The room grants of a queue whose row this command writes first (its first limits or
    /// pause, the dashboard's too): on, the default, or off while workers of a release without
    /// the fence of room grants may still serve new queues (docs/operations.md, "Room
    /// grants"). A queue that has its row keeps its switch (`queue grants` changes it).
    #[arg(long, global = true, value_enum, default_value = "on")]
    pub room_grants_for_new_queues: Switch,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Create the queue table: the standard `queue_jobs` (its own migrations table), or the
    /// table named by --table.
    Migrate,
    /// Upgrade a legacy queue table in place, in phases the legacy release can run beside
    /// (short-locked columns, batched backfill, concurrent index builds); run it again to resume.
    UpgradeLegacy(UpgradeArgs),
    /// Every queue of the table: backlog, lag, leases, the last hour's outcomes, paused or not,
    /// and a line per queue with recorded schedules (how many, how many look stale).
    Status(StatusArgs),
    /// Pause, resume or drain a queue, or set its limits.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// List, show, retry or cancel jobs.
    #[command(subcommand)]
    Jobs(JobsCommand),
    /// The schedules the schedulers recorded, or forget one's record.
    ///
    /// Without a subcommand: one row per schedule of every queue `status` lists (and of
    /// --queue): its queue, name, spec (when its periods fall), what happens to missed periods,
    /// the latest period handled (through), the next, and when and by which scheduler it was
    /// last reported (seen, by the database's clock). A schedule is marked `stale?` when its
    /// last report is older than twice its period (next - through; next - seen before a first
    /// period) or 10 minutes, whichever is longer: no scheduler has reported it lately (it was
    /// removed from the code, or its schedulers are down or cannot reach the database).
    Schedules(SchedulesArgs),
    /// Delete terminal jobs older than an age, in bounded batches.
    Purge(PurgeArgs),
    /// The jobs in flight: their holders, partitions, generations, time left on their leases,
    /// reclaims.
    Lease(LeaseArgs),
    /// Serve the web dashboard (read-only unless --allow-actions).
    Serve(ServeArgs),
}

/// `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Where to listen. Anything but a loopback address needs --token or --basic-auth (or
    /// --no-auth, said out loud).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: std::net::SocketAddr,
    /// Allow retry, cancel, bulk retry, pause, resume and forgetting a schedule's record from
    /// the pages.
    #[arg(long)]
    pub allow_actions: bool,
    /// Show job payloads on job pages (they may hold personal or secret data).
    #[arg(long)]
    pub show_payloads: bool,
    /// Require `Authorization: Bearer <TOKEN>` (set it in the environment, not on a command
    /// line others can read).
    #[arg(
        long,
        env = "QUEUECTL_DASHBOARD_TOKEN",
        hide_env_values = true,
        conflicts_with = "basic_auth"
    )]
    pub token: Option<String>,
    /// Require basic authentication, `USER:PASSWORD` (browsers ask for it).
    #[arg(
        long,
        env = "QUEUECTL_DASHBOARD_BASIC_AUTH",
        hide_env_values = true,
        value_name = "USER:PASSWORD"
    )]
    pub basic_auth: Option<String>,
    /// Serve without authentication on an address that is not loopback.
    #[arg(long)]
    pub no_auth: bool,
    /// An origin the dashboard is reached at besides its own address (a reverse proxy's,
    /// `https://dash.example.com`; repeatable). Requests for any other host are refused, so
    /// that a page whose name points at this address (DNS rebinding) cannot use it.
    #[arg(long = "public-origin", value_name = "URL")]
    pub public_origins: Vec<String>,
    /// How often pages reload themselves (0s: never).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub refresh: Duration,
}

/// `upgrade-legacy`.
#[derive(Debug, Clone, Args)]
pub struct UpgradeArgs {
    /// A legacy index the lease schema supersedes, dropped at the end (repeatable).
    #[arg(long = "retire-index", value_name = "INDEX")]
    pub retire_index: Vec<String>,
    /// How long the ALTER may wait for its lock per try (readers and writers queue behind it).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub lock_timeout: Duration,
    /// Tries of the ALTER before giving up.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub lock_attempts: u32,
    /// Rows of the primary key per backfill batch.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub batch_size: u32,
}

/// `status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Leases ending within this window are counted as ending soon.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub window: Duration,
}

/// `queue …`.
#[derive(Debug, Clone, Subcommand)]
pub enum QueueCommand {
    /// Stop every worker of every process from claiming the queue's jobs (running jobs finish).
    Pause,
    /// Let workers claim the queue's jobs again.
    Resume,
    /// Pause the queue and wait until none of its jobs runs.
    Drain {
        /// Give up waiting after this long (exit 6); the queue stays paused.
        #[arg(long, default_value = "5m", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Set the queue's limits, for every worker of every process: at most so many jobs in
    /// flight, at most so many starts per window, at most so many jobs of one partition in
    /// flight, at most so many starts of one partition per window. What is not given is removed
    /// (no option at all: no limits).
    Limit {
        /// At most this many of the queue's jobs in flight at once.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_in_flight: Option<u32>,
        /// At most this many starts per window: STARTS/WINDOW, such as 100/1m or 5/1s.
        #[arg(long, value_parser = parse_rate)]
        rate: Option<queue_core::RateLimit>,
        /// At most this many jobs of one partition (the job's partition key) in flight at once;
        /// partitions take turns. Jobs without a partition key are not limited by it.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_per_partition: Option<u32>,
        /// At most this many starts of one partition's jobs per window, takeovers of expired
        /// leases included: STARTS/WINDOW, such as 10/1s; partitions take turns. Jobs without a
        /// partition key are not limited by it.
        #[arg(long, value_parser = parse_rate)]
        rate_per_partition: Option<queue_core::RateLimit>,
    },
    /// Switch room grants on or off: with limits in flight or a queue rate (no rate per
    /// partition), each worker's queue handle takes room for several claims at once and spends
    /// it without the queue's row lock. While it is on, claims of an older release that
    /// does not count them fail (the fence, table migration 20261213000001; docs/operations.md,
    /// "Room grants"). A change returns every grant.
    Grants {
        /// `on` or `off`.
        #[arg(value_enum)]
        switch: Switch,
    },
}

/// A switch's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// Switched on.
    On,
    /// Switched off.
    Off,
}

/// `schedules [forget NAME]`.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SchedulesArgs {
    /// Without one: list the schedules.
    #[command(subcommand)]
    pub command: Option<SchedulesCommand>,
}

/// `schedules …`.
#[derive(Debug, Clone, Subcommand)]
pub enum SchedulesCommand {
    /// Forget the record of a schedule of --queue that no scheduler runs any more (its jobs
    /// stay). A scheduler that still runs it records it again at its next pass. Exit 3 when it
    /// was not recorded.
    Forget {
        /// The schedule's name.
        name: String,
    },
}

/// `jobs …`.
#[derive(Debug, Clone, Subcommand)]
pub enum JobsCommand {
    /// List the queue's jobs, newest first.
    List {
        /// Only jobs in this state (repeatable).
        #[arg(long = "state", value_enum)]
        states: Vec<State>,
        /// At most this many.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Only jobs with an id below this one (the cursor a previous page printed).
        #[arg(long)]
        before: Option<i64>,
    },
    /// Show one job: its state, attempts, lease, unique and partition keys, error history.
    Show {
        /// The job's id.
        id: i64,
        /// Show the payload too (it may hold personal or secret data).
        #[arg(long)]
        show_payload: bool,
    },
    /// Retry dead, failed or cancelled jobs: back to pending, attempts reset, with the hooks.
    Retry(RetryArgs),
    /// Cancel jobs: a pending one at once, one in flight through its holder, with the hooks.
    Cancel {
        /// The jobs' ids.
        #[arg(required = true)]
        ids: Vec<i64>,
    },
    /// Find the job holding a unique key.
    Find {
        /// The unique key.
        key: String,
    },
}

/// `jobs retry`.
#[derive(Debug, Clone, Args)]
#[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all"]))]
pub struct RetryArgs {
    /// The jobs' ids.
    pub ids: Vec<i64>,
    /// Every job of the queue in --state.
    #[arg(long, requires = "state")]
    pub all: bool,
    /// The state to retry with --all.
    #[arg(long, value_enum)]
    pub state: Option<RetryState>,
}

/// `purge`.
#[derive(Debug, Clone, Args)]
pub struct PurgeArgs {
    /// Only jobs finished longer ago than this (7d, 12h, 30m).
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Duration,
    /// The terminal states to purge (repeatable).
    #[arg(long = "state", value_enum, required = true)]
    pub states: Vec<TerminalState>,
    /// Rows per statement.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_size: u32,
}

/// `lease`.
#[derive(Debug, Clone, Args)]
pub struct LeaseArgs {
    /// At most this many jobs.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,
}

/// A job state on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum State {
    /// Waiting to be claimed.
    Pending,
    /// Claimed, under a lease.
    InFlight,
    /// Done.
    Completed,
    /// Failed for good.
    Failed,
    /// Buried (poison, or a hook that kept failing).
    Dead,
    /// Cancelled.
    Cancelled,
}

impl From<State> for JobStatus {
    fn from(state: State) -> Self {
        match state {
            State::Pending => JobStatus::Pending,
            State::InFlight => JobStatus::InFlight,
            State::Completed => JobStatus::Completed,
            State::Failed => JobStatus::Failed,
            State::Dead => JobStatus::Dead,
            State::Cancelled => JobStatus::Cancelled,
        }
    }
}

/// A state an operator may retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RetryState {
    /// Failed for good.
    Failed,
    /// Buried.
    Dead,
    /// Cancelled.
    Cancelled,
}

impl From<RetryState> for JobStatus {
    fn from(state: RetryState) -> Self {
        match state {
            RetryState::Failed => JobStatus::Failed,
            RetryState::Dead => JobStatus::Dead,
            RetryState::Cancelled => JobStatus::Cancelled,
        }
    }
}

/// A terminal state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TerminalState {
    /// Done.
    Completed,
    /// Failed for good.
    Failed,
    /// Buried.
    Dead,
    /// Cancelled.
    Cancelled,
}

impl From<TerminalState> for JobStatus {
    fn from(state: TerminalState) -> Self {
        match state {
            TerminalState::Completed => JobStatus::Completed,
            TerminalState::Failed => JobStatus::Failed,
            TerminalState::Dead => JobStatus::Dead,
            TerminalState::Cancelled => JobStatus::Cancelled,
        }
    }
}

fn parse_table(value: &str) -> Result<TableName, String> {
    TableName::new(value).map_err(|err| err.to_string())
}

fn parse_queue(value: &str) -> Result<QueueName, String> {
    QueueName::new(value).map_err(|err| err.to_string())
}

fn parse_rate(value: &str) -> Result<queue_core::RateLimit, String> {
    let (starts, per) = value
        .split_once('/')
        .ok_or_else(|| "expected STARTS/WINDOW, such as 100/1m".to_owned())?;
    let starts: u32 = starts
        .trim()
        .parse()
        .map_err(|err| format!("starts {starts:?}: {err}"))?;
    queue_core::RateLimit::new(starts, parse_duration(per.trim())?).map_err(|err| err.to_string())
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|err| format!("{err} (try 500ms, 90s, 12h, 7d)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        let err = Cli::try_parse_from(["queuectl", "--table", "Bad Name", "status"]).unwrap_err();
        assert!(err.to_string().contains("--table"), "{err}");
        let err = Cli::try_parse_from([
            "queuectl",
            "purge",
            "--older-than",
            "soon",
            "--state",
            "dead",
        ])
        .unwrap_err();
        assert!(err.to_string().contains("--older-than"), "{err}");
        assert!(Cli::try_parse_from(["queuectl", "jobs", "retry"]).is_err());
        assert!(Cli::try_parse_from(["queuectl", "jobs", "retry", "--all"]).is_err());
        let ok = Cli::try_parse_from(["queuectl", "jobs", "retry", "--all", "--state", "dead"]);
        assert!(ok.is_ok());
        for limit in ["--max-in-flight", "--max-per-partition"] {
            let err = Cli::try_parse_from(["queuectl", "queue", "limit", limit, "0"]).unwrap_err();
            assert!(err.to_string().contains(limit), "{err}");
        }
        let listed = Cli::try_parse_from(["queuectl", "schedules"]).unwrap();
        assert!(matches!(
            listed.command,
            Command::Schedules(SchedulesArgs { command: None })
        ));
        let forget = Cli::try_parse_from(["queuectl", "schedules", "forget", "nightly"]).unwrap();
        assert!(matches!(
            forget.command,
            Command::Schedules(SchedulesArgs {
                command: Some(SchedulesCommand::Forget { ref name }),
            }) if name == "nightly"
        ));
        assert!(Cli::try_parse_from(["queuectl", "schedules", "forget"]).is_err());
        let set = Cli::try_parse_from(["queuectl", "queue", "limit", "--max-per-partition", "2"]);
        assert!(
            matches!(
                set.unwrap().command,
                Command::Queue(QueueCommand::Limit {
                    max_in_flight: None,
                    rate: None,
                    max_per_partition: Some(2),
                    rate_per_partition: None,
                })
            ),
            "--max-per-partition alone sets only it"
        );
    }

    #[test]
    fn a_rate_per_partition_parses_as_the_rate_does() {
        let set = Cli::try_parse_from([
            "queuectl",
            "queue",
            "limit",
            "--rate-per-partition",
            "10/1s",
        ])
        .unwrap();
        let Command::Queue(QueueCommand::Limit {
            max_in_flight,
            rate,
            max_per_partition,
            rate_per_partition,
        }) = set.command
        else {
            panic!("not queue limit: {set:?}");
        };
        assert_eq!((max_in_flight, rate, max_per_partition), (None, None, None));
        let rate_per_partition = rate_per_partition.expect("--rate-per-partition is set");
        assert_eq!(rate_per_partition.starts(), 10);
        assert_eq!(rate_per_partition.per(), Duration::from_secs(1));

        let both = Cli::try_parse_from([
            "queuectl",
            "queue",
            "limit",
            "--rate",
            "100/1m",
            "--max-per-partition",
            "1",
            "--rate-per-partition",
            "5 / 250ms",
        ])
        .unwrap();
        let Command::Queue(QueueCommand::Limit {
            rate,
            max_per_partition,
            rate_per_partition,
            ..
        }) = both.command
        else {
            panic!("not queue limit: {both:?}");
        };
        assert_eq!(rate.unwrap().per(), Duration::from_secs(60));
        assert_eq!(max_per_partition, Some(1));
        let rate_per_partition = rate_per_partition.unwrap();
        assert_eq!(
            (rate_per_partition.starts(), rate_per_partition.per()),
            (5, Duration::from_millis(250))
        );

        for (bad, why) in [
            ("0/1s", "starts"),
            ("5/0s", "window"),
            ("100001/1s", "starts"),
            ("5/2d", "window"),
            ("fast", "STARTS/WINDOW"),
            ("ten/1s", "starts"),
            ("5/soon", "try 500ms"),
        ] {
            let err =
                Cli::try_parse_from(["queuectl", "queue", "limit", "--rate-per-partition", bad])
                    .unwrap_err();
            let text = err.to_string();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{bad}: {text}"
            );
            assert!(
                text.contains("--rate-per-partition") && text.contains(bad) && text.contains(why),
                "{bad}: {text}"
            );
        }
    }
}
