//! The values every backend speaks: ids, the fence token, the lease, jobs and outcomes.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ConfigError;

/// A job's primary key in its queue table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub i64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// How many times a job has been claimed: the readable, monotonic half of the fence.
///
/// Every claim increments it in the same statement that stamps `claimed_at`, so two holders of the
/// same job on one store always hold different generations. Every write a lease holder makes is a
/// compare-and-set on `(id, status = in_flight, claim_generation, claim_token)`: the holder of an
/// older generation gets [`FinalizeOutcome::Stale`] and writes nothing. The [`ClaimToken`] beside
/// it covers what a number alone cannot: a store that lost committed writes (a PostgreSQL failover
/// with asynchronous replication) hands the same generation out a second time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClaimGeneration(pub i64);

impl fmt::Display for ClaimGeneration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The other half of the fence: 64 random bits the claimer draws for each claim and the store
/// keeps beside the [`ClaimGeneration`] (`claim_token`).
///
/// A generation is a counter, so a store that loses committed writes can count to the same
/// number twice: after a failover with asynchronous replication, the new primary never saw the
/// claim that gave generation N to worker A and gives generation N to worker B. Their tokens
/// differ (two independent 64-bit draws), so A's writes, compared on generation *and* token, come
/// back [`FinalizeOutcome::Stale`]. `0` is never drawn: it marks a row no claim of this
/// version stamped (never claimed, or claimed by a release from before tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClaimToken(pub i64);

impl ClaimToken {
    /// A fresh token: 64 bits from a per-thread generator seeded from the operating system's
    /// random numbers (so two processes, or two machines, started at the same instant draw
    /// apart), never `0`. One claim draws one token for all the jobs it takes; a job's next
    /// claim, by any worker on any store, draws another.
    pub fn random() -> ClaimToken {
        thread_local! {
            static RNG: std::cell::RefCell<fastrand::Rng> = std::cell::RefCell::new(
                fastrand::Rng::with_seed(getrandom::u64().unwrap_or_else(|_| fastrand::u64(..))),
            );
        }
        RNG.with(|rng| {
            let mut rng = rng.borrow_mut();
            loop {
                let token = rng.i64(..);
                if token != 0 {
                    return ClaimToken(token);
                }
            }
        })
    }
}

impl fmt::Display for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Hex: a token is an opaque value, not a count.
        write!(f, "{:016x}", self.0 as u64)
    }
}

/// How long a claim protects a job from being claimed again.
///
/// The lease is stored with the claim (`lease_expires_at`, by the backend's clock) and renewed
/// by heartbeats; once it has passed, the job is claimable again by any worker, whatever that
/// worker's own lease: this is the whole recovery mechanism, folded into the claim, so
/// it runs continuously and needs no boot-time sweep. Size it at three times the worst-case
/// handler time: see [`Lease::DEFAULT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lease(Duration);

impl Lease {
    /// The default lease: 90 seconds.
    ///
    /// Three times the 30 s worst-case handler time that the first adopter (a partner HTTP
    /// send, every send capped at 30 s) has: two full timeouts plus margin for the finalize
    /// transaction and pool waits. A lease shorter than the handler's worst case lets a second
    /// worker claim a job that is still being worked on.
    pub const DEFAULT: Lease = Lease(Duration::from_secs(90));

    /// A lease of `duration`; zero is refused (a zero lease would let every claim be stolen at
    /// once), as is anything longer than a day (almost certainly a unit mistake).
    pub fn new(duration: Duration) -> Result<Self, ConfigError> {
        if duration.is_zero() {
            return Err(ConfigError::ZeroLease);
        }
        if duration > Duration::from_secs(24 * 3600) {
            return Err(ConfigError::LeaseTooLong(duration));
        }
        Ok(Lease(duration))
    }

    /// A lease of whole seconds; see [`Lease::new`].
    pub fn from_secs(secs: u64) -> Result<Self, ConfigError> {
        Lease::new(Duration::from_secs(secs))
    }

    /// The lease as a [`Duration`].
    pub fn duration(self) -> Duration {
        self.0
    }

    /// The lease in seconds, with sub-second precision (how SQL backends bind it).
    pub fn as_secs_f64(self) -> f64 {
        self.0.as_secs_f64()
    }
}

impl Default for Lease {
    fn default() -> Self {
        Lease::DEFAULT
    }
}

/// The name of a queue inside a table; one table can hold several queues.
///
/// Between 1 and 128 characters out of ASCII letters, digits, `_`, `-`, `.` and `:`. Queue names
/// are always bound as values, never spliced into SQL; the rule keeps names readable in logs and
/// metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueName(String);

impl QueueName {
    /// The queue name used when none is configured.
    pub const DEFAULT: &'static str = "default";

    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
        if name.is_empty() || name.len() > 128 || !name.chars().all(valid_char) {
            return Err(ConfigError::InvalidQueueName(name));
        }
        Ok(QueueName(name))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for QueueName {
    fn default() -> Self {
        QueueName(Self::DEFAULT.to_owned())
    }
}

impl fmt::Display for QueueName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a job stands. Only `Pending` and `InFlight` are live; the rest are terminal.
///
/// See `docs/state-machine.md` for the transitions and which of them are fenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Waiting until `next_attempt_at`, then claimable.
    Pending,
    /// Claimed by a worker; claimable again once its lease has expired.
    InFlight,
    /// The handler finished it (terminal).
    Completed,
    /// The handler failed it terminally, or it ran out of attempts (terminal).
    Failed,
    /// Its lease expired more often than the reclaim cap allows: a poison job that kills its
    /// worker (terminal, visible, never re-run on its own).
    Dead,
    /// Cancelled before it finished (terminal).
    Cancelled,
}

impl JobStatus {
    /// Every status, live ones first.
    pub const ALL: [JobStatus; 6] = [
        JobStatus::Pending,
        JobStatus::InFlight,
        JobStatus::Completed,
        JobStatus::Failed,
        JobStatus::Dead,
        JobStatus::Cancelled,
    ];

    /// The text stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Pending => "pending",
            JobStatus::InFlight => "in_flight",
            JobStatus::Completed => "completed",
            JobStatus::Failed => "failed",
            JobStatus::Dead => "dead",
            JobStatus::Cancelled => "cancelled",
        }
    }

    /// Parses the text stored in the `status` column.
    pub fn parse(s: &str) -> Option<JobStatus> {
        JobStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
    }

    /// True for states a job never leaves on its own.
    pub fn is_terminal(self) -> bool {
        !matches!(self, JobStatus::Pending | JobStatus::InFlight)
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// When a job (or a retry) becomes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunAt {
    /// Due now, by the backend's clock.
    Now,
    /// Due this long after now, by the backend's clock (no client clock skew involved).
    After(Duration),
    /// Due at this instant, compared with the backend's clock.
    At(DateTime<Utc>),
}

/// A job to enqueue. Build it with [`NewJob::new`] and the builder methods.
///
/// ```
/// use std::time::Duration;
/// use queue_core::{NewJob, RunAt};
///
/// let job = NewJob::new(&serde_json::json!({"to": "ops@example.com"}))?
///     .priority(-1)
///     .run_at(RunAt::After(Duration::from_secs(30)))
///     .unique_key("welcome-mail:42");
/// assert_eq!(job.priority, -1);
/// # Ok::<(), queue_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    /// The job's arguments, stored as JSON.
    pub payload: Value,
    /// Lower runs first among jobs due at the same instant; default 0.
    pub priority: i16,
    /// When the job first becomes due; default [`RunAt::Now`].
    pub run_at: RunAt,
    /// With a key, a second enqueue of the same key into the same queue returns the first job's
    /// id instead of inserting, for as long as the first job's row exists (retention deletes it)
    /// unless [`NewJob::unique`] narrows that.
    pub unique_key: Option<String>,
    /// How long a job already holding [`NewJob::unique_key`] keeps it against this enqueue, and
    /// what this enqueue does to a pending holder. Default: the holder keeps the key in every
    /// status and this enqueue is dropped as a duplicate.
    pub unique: UniqueScope,
    /// The partition the job belongs to (a partner, a tenant, an account): in a queue with a
    /// limit per partition ([`QueueLimits::max_per_partition`](crate::QueueLimits)), at most
    /// so many jobs of one partition run at once, and partitions take turns. `None`: the job
    /// belongs to no partition and only the queue's own limits apply to it.
    pub partition_key: Option<String>,
}

/// How long a unique key holds against a new enqueue, and what a duplicate does; set on the
/// new job ([`NewJob::unique_while`], [`NewJob::unique_for`], [`NewJob::replace_pending`]).
///
/// A holder out of the new job's scope (in a status not listed, or enqueued longer ago than the
/// period) gives its key up: it keeps its row and history, without the key, and the new job is
/// inserted with the key. Concurrent enqueues of one key still insert at most one job.
///
/// ```
/// use std::time::Duration;
/// use queue_core::{JobStatus, NewJob, UniqueScope};
///
/// // One sync per account at a time: a finished sync no longer blocks the next.
/// let sync = NewJob::from_value(serde_json::json!({"account": 7}))
///     .unique_key("sync:7")
///     .unique_while(&[JobStatus::Pending, JobStatus::InFlight]);
/// assert_eq!(sync.unique.held_while, Some(UniqueScope::UNFINISHED.to_vec()));
/// // A digest at most once an hour; a newer one waiting replaces the waiting one's payload.
/// let digest = NewJob::from_value(serde_json::json!({"user": 7}))
///     .unique_key("digest:7")
///     .unique_for(Duration::from_secs(3600))
///     .replace_pending();
/// assert!(digest.unique.replace);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UniqueScope {
    /// The statuses in which a holder keeps its key; `None`: every status (until retention
    /// deletes the row).
    pub held_while: Option<Vec<JobStatus>>,
    /// How long after its enqueue a holder keeps its key; `None`: for ever.
    pub held_for: Option<Duration>,
    /// A duplicate whose holder is pending (and in scope) replaces the holder's payload,
    /// priority and due time with its own instead of being dropped: a debounce. A holder that a
    /// worker has claimed already is left as it is, and the enqueue reports a plain duplicate
    /// (`Enqueued::replaced` false), as it may on PostgreSQL when the holder itself was
    /// inserted by a concurrent enqueue while this one ran: enqueue again to apply it.
    pub replace: bool,
}

impl UniqueScope {
    /// The statuses of a job not yet finished: pending and in flight. With
    /// [`NewJob::unique_while`], a key that a finished job gives up.
    pub const UNFINISHED: [JobStatus; 2] = [JobStatus::Pending, JobStatus::InFlight];

    /// Whether this is the default scope (held in every status, for ever, no replace).
    pub fn is_default(&self) -> bool {
        self.held_while.is_none() && self.held_for.is_none() && !self.replace
    }

    /// Whether a holder in `status`, enqueued `age` ago, keeps its key against this scope.
    pub fn holds(&self, status: JobStatus, age: Duration) -> bool {
        self.held_while
            .as_ref()
            .is_none_or(|statuses| statuses.contains(&status))
            && self.held_for.is_none_or(|period| age < period)
    }
}

impl NewJob {
    /// A job carrying `payload`, serialised to JSON.
    pub fn new<T: Serialize + ?Sized>(payload: &T) -> crate::Result<Self> {
        let payload = serde_json::to_value(payload).map_err(crate::Error::Payload)?;
        Ok(NewJob::from_value(payload))
    }

    /// A job carrying an already-built JSON payload.
    pub fn from_value(payload: Value) -> Self {
        NewJob {
            payload,
            priority: 0,
            run_at: RunAt::Now,
            unique_key: None,
            unique: UniqueScope::default(),
            partition_key: None,
        }
    }

    /// Puts the job in a partition (see
    /// [`NewJob::partition_key`](NewJob#structfield.partition_key)): at most
    /// [`MAX_PARTITION_KEY_BYTES`](crate::limits::MAX_PARTITION_KEY_BYTES), no NUL.
    pub fn partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Sets the priority (lower runs first among jobs due at the same instant).
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }

    /// Sets when the job first becomes due.
    pub fn run_at(mut self, run_at: RunAt) -> Self {
        self.run_at = run_at;
        self
    }

    /// Sets a unique key (see [`NewJob::unique_key`](NewJob#structfield.unique_key)).
    pub fn unique_key(mut self, key: impl Into<String>) -> Self {
        self.unique_key = Some(key.into());
        self
    }

    /// Lets a holder of the unique key keep it only while in one of `statuses` (see
    /// [`UniqueScope::held_while`]); [`UniqueScope::UNFINISHED`] makes the key free again once
    /// its job has finished. Kept in the order of [`JobStatus::ALL`], without repeats; an empty
    /// list is refused at enqueue.
    pub fn unique_while(mut self, statuses: &[JobStatus]) -> Self {
        let mut statuses = statuses.to_vec();
        statuses.sort_by_key(|s| JobStatus::ALL.iter().position(|all| all == s));
        statuses.dedup();
        self.unique.held_while = Some(statuses);
        self
    }

    /// Lets a holder of the unique key keep it only for `period` after its enqueue (by the
    /// backend's clock): at most one job per key and period.
    pub fn unique_for(mut self, period: Duration) -> Self {
        self.unique.held_for = Some(period);
        self
    }

    /// Makes a duplicate of a pending holder replace its payload, priority and due time (see
    /// [`UniqueScope::replace`]): with [`RunAt::After`], a debounce.
    pub fn replace_pending(mut self) -> Self {
        self.unique.replace = true;
        self
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The job's id: the new one, or the existing one for a duplicate unique key.
    pub id: JobId,
    /// True when a job with the same unique key already existed and nothing was inserted.
    pub duplicate: bool,
    /// True when that job was pending and took this enqueue's payload, priority and due time
    /// ([`NewJob::replace_pending`]); `duplicate` is true as well.
    pub replaced: bool,
}

impl Enqueued {
    /// A job this enqueue inserted.
    pub fn inserted(id: JobId) -> Self {
        Enqueued {
            id,
            duplicate: false,
            replaced: false,
        }
    }

    /// A job that held the key already (`replaced`: and took this enqueue's values).
    pub fn existing(id: JobId, replaced: bool) -> Self {
        Enqueued {
            id,
            duplicate: true,
            replaced,
        }
    }
}

/// The fence of one claim: the job's id, the generation the claim produced and its token.
///
/// Every finalizer takes a `Claim`, never a bare id, so a write that ignores the fence cannot be
/// written. A `Claim` comes only from a backend's claim (or from a record of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claim {
    /// The claimed job.
    pub id: JobId,
    /// The generation this claim stamped.
    pub generation: ClaimGeneration,
    /// The token this claim stamped beside it.
    pub token: ClaimToken,
}

/// A job as a claim returned it: the payload together with the fence token.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedJob {
    /// The job's id.
    pub id: JobId,
    /// The generation stamped by this claim: with [`ClaimedJob::token`], the fence for every
    /// later write.
    pub generation: ClaimGeneration,
    /// The token stamped by this claim.
    pub token: ClaimToken,
    /// How many times the job has been claimed, this claim included (releases do not count).
    pub attempts: i32,
    /// How many of those claims took the job over from an expired lease.
    pub reclaims: i32,
    /// Whether this claim took the job over from an expired lease (a worker died or hung).
    pub taken_over: bool,
    /// Whether this takeover went past the claim's reclaim cap: a poison job that keeps killing
    /// its worker. It must not run again: its holder ends it with [`Finalize::Dead`] (the worker
    /// runtime does), so that the move to `dead` is fenced and runs the finalize hooks.
    pub over_reclaim_cap: bool,
    /// An operator asked to cancel the job while an earlier holder had it: it must not run.
    /// Its holder ends it with [`Finalize::Cancel`] (the worker runtime does).
    pub cancel_requested: bool,
    /// When this claim was stamped, by the backend's clock.
    pub claimed_at: DateTime<Utc>,
    /// When the job was due (`next_attempt_at`), by the backend's clock: `claimed_at - due_at`
    /// is how long it waited for a worker.
    pub due_at: DateTime<Utc>,
    /// The job's priority.
    pub priority: i16,
    /// The job's arguments.
    pub payload: Value,
}

impl ClaimedJob {
    /// The fence token for finalizing this claim.
    pub fn claim(&self) -> Claim {
        Claim {
            id: self.id,
            generation: self.generation,
            token: self.token,
        }
    }

    /// How many earlier attempts ended in a handler error (retry): claims minus this one minus
    /// lease takeovers. Lease expiries are not handler errors and do not count against
    /// `max_attempts`; they count against the reclaim cap instead.
    pub fn handler_errors(&self) -> u32 {
        u32::try_from(self.attempts - 1 - self.reclaims).unwrap_or(0)
    }
}

/// A fenced write that ends (or pauses) a claim. Every variant is applied only when the job is
/// still in flight under the claim's generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Finalize {
    /// The job is done: `completed`.
    Complete,
    /// The job failed for good: `failed`, with the error kept in `last_error`.
    Fail {
        /// Why; stored in `last_error`.
        error: String,
    },
    /// Try again later: back to `pending`, due at `at`, with the error kept in `last_error`.
    Retry {
        /// When the retry becomes due.
        at: RunAt,
        /// Why; stored in `last_error`.
        error: String,
    },
    /// Give the job back unstarted: `pending`, keeping its place in line, without counting the
    /// attempt (graceful shutdown uses this for claims it never started).
    Release,
    /// Run the job again later without counting this run: `pending`, due at `at`, the attempt
    /// given back and no error stored, so a job that waits on something (a partner's rate
    /// window, a file not there yet) can wait as often as it needs without nearing
    /// `max_attempts`. A job that snoozes forever never ends: bound it in the handler.
    Snooze {
        /// When the job becomes due again.
        at: RunAt,
    },
    /// The lease holder decided the job must not run: `cancelled`.
    Cancel {
        /// Why; stored in `last_error`.
        reason: String,
    },
    /// The job went past the reclaim cap (see [`ClaimedJob::over_reclaim_cap`]): `dead`,
    /// terminal, never run again on its own.
    Dead {
        /// Why; stored in `last_error`.
        reason: String,
    },
}

impl Finalize {
    /// The status the job is left in when this write applies.
    pub fn target_status(&self) -> JobStatus {
        match self {
            Finalize::Complete => JobStatus::Completed,
            Finalize::Fail { .. } => JobStatus::Failed,
            Finalize::Retry { .. } | Finalize::Release | Finalize::Snooze { .. } => {
                JobStatus::Pending
            }
            Finalize::Cancel { .. } => JobStatus::Cancelled,
            Finalize::Dead { .. } => JobStatus::Dead,
        }
    }

    /// The error text this outcome stores (`last_error`): a fail or retry's error, a cancel or
    /// dead reason; `None` for complete and release.
    pub fn error_text(&self) -> Option<&str> {
        match self {
            Finalize::Fail { error } | Finalize::Retry { error, .. } => Some(error),
            Finalize::Cancel { reason } | Finalize::Dead { reason } => Some(reason),
            Finalize::Complete | Finalize::Release | Finalize::Snooze { .. } => None,
        }
    }

    /// Whether this write gives the claim's attempt back (`attempts` decremented): a release
    /// and a snooze, which are not runs that count.
    pub fn gives_back_attempt(&self) -> bool {
        matches!(self, Finalize::Release | Finalize::Snooze { .. })
    }

    /// When the job is due again, for the writes that move `next_attempt_at` (a retry, a
    /// snooze); `None` for the others (a release keeps the job's place in line).
    pub fn due_again(&self) -> Option<RunAt> {
        match self {
            Finalize::Retry { at, .. } | Finalize::Snooze { at } => Some(*at),
            _ => None,
        }
    }

    /// Whether this write puts the job back in line (`pending`): idle workers are woken.
    pub fn requeues(&self) -> bool {
        self.target_status() == JobStatus::Pending
    }

    /// A short stable name for logs and the error history: `complete`, `fail`, `retry`,
    /// `release`, `snooze`, `cancel`, `dead`.
    pub fn kind(&self) -> &'static str {
        match self {
            Finalize::Complete => "complete",
            Finalize::Fail { .. } => "fail",
            Finalize::Retry { .. } => "retry",
            Finalize::Release => "release",
            Finalize::Snooze { .. } => "snooze",
            Finalize::Cancel { .. } => "cancel",
            Finalize::Dead { .. } => "dead",
        }
    }
}

/// What a heartbeat ([`crate::Backend::extend_lease`]) found.
#[must_use = "a heartbeat that finds the lease lost means the handler must stop"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Heartbeat {
    /// The job is still held under this claim; its lease runs anew.
    Held,
    /// Still held, and an operator asked to cancel it: stop, and end it with
    /// [`Finalize::Cancel`].
    CancelRequested,
    /// Another claim holds the job, or it left `in_flight`: the lease is lost (a fenced write
    /// refused, like [`FinalizeOutcome::Stale`]).
    Lost,
}

/// What an administrative cancel found, inside the transaction that made it
/// ([`crate::Backend::cancel_in`]).
#[derive(Debug, Clone, PartialEq)]
pub enum CancelTarget {
    /// The job was pending and is now cancelled in the transaction: the job as it stands, for
    /// the finalize hooks.
    Cancelled(ClaimedJob),
    /// The job is in flight: the cancel was requested of its holder.
    Requested,
    /// The job has already ended.
    AlreadyTerminal(JobStatus),
    /// No such job in this queue.
    NotFound,
}

impl CancelTarget {
    /// What the cancel did, as its caller is told.
    pub fn outcome(&self) -> CancelOutcome {
        match self {
            CancelTarget::Cancelled(_) => CancelOutcome::Cancelled,
            CancelTarget::Requested => CancelOutcome::Requested,
            CancelTarget::AlreadyTerminal(status) => CancelOutcome::AlreadyTerminal(*status),
            CancelTarget::NotFound => CancelOutcome::NotFound,
        }
    }
}

/// The reason written when an operator cancels a pending job.
pub const CANCELLED_BY_OPERATOR: &str = "cancelled by an operator";

/// The reason written when the holder of a job ends it on an operator's request.
pub const CANCEL_REQUESTED_MESSAGE: &str = "cancelled by an operator while in flight";

/// What a fenced write did.
///
/// `Stale` is not an error: it means another worker holds the job now (the lease expired and the
/// job was claimed again) or the job already left `in_flight`. The caller must treat its claim as
/// lost: roll back, stage no side effect.
#[must_use = "a Stale outcome means the claim was lost and its side effects must not be staged"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinalizeOutcome {
    /// The job was in flight under this claim's generation and the write took effect.
    Applied,
    /// The fence refused the write: nothing changed.
    Stale,
}

impl FinalizeOutcome {
    /// True for [`FinalizeOutcome::Applied`].
    pub fn is_applied(self) -> bool {
        self == FinalizeOutcome::Applied
    }

    /// Maps a row count from a fenced single-row write (0 or 1) to an outcome.
    pub fn from_rows_affected(rows: u64) -> Self {
        if rows > 0 {
            FinalizeOutcome::Applied
        } else {
            FinalizeOutcome::Stale
        }
    }
}

/// What an administrative cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelOutcome {
    /// The job was pending and is now cancelled (its hooks ran, when the cancel had hooks).
    Cancelled,
    /// The job is in flight: its holder was asked to cancel it. The holder learns it at its
    /// next heartbeat, or before it would give the job back; a worker that takes the job over
    /// does not run it. Either ends it `cancelled` with a fenced write and the hooks, unless the
    /// holder completes or fails it first.
    Requested,
    /// The job has already ended.
    AlreadyTerminal(JobStatus),
    /// No such job in this queue.
    NotFound,
}

/// A job's full row, for inspection (tests, admin tools, dashboards).
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// The job's id.
    pub id: JobId,
    /// The queue it belongs to.
    pub queue: String,
    /// Where it stands.
    pub status: JobStatus,
    /// Its arguments.
    pub payload: Value,
    /// Its priority.
    pub priority: i16,
    /// Claims so far (releases do not count).
    pub attempts: i32,
    /// Claims that took the job over from an expired lease.
    pub reclaims: i32,
    /// When it is (or was) due.
    pub next_attempt_at: DateTime<Utc>,
    /// When the current (or last) claim was stamped, or its last heartbeat; `None` if never
    /// claimed, or a legacy row.
    pub claimed_at: Option<DateTime<Utc>>,
    /// When the holder's lease ends, by the store's clock: set by the claim and by every
    /// heartbeat from the holder's own lease. `None` when not in flight, or for a claim made
    /// before leases were stored (its claimer's lease then counts from `claimed_at`).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// When an operator asked to cancel the job while it was in flight, if one did.
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// The generation of the current (or last) claim; 0 if never claimed.
    pub claim_generation: ClaimGeneration,
    /// The token of the current (or last) claim; 0 if never claimed (or last claimed by a
    /// release from before tokens).
    pub claim_token: ClaimToken,
    /// The last handler error, fail reason or cancel reason.
    pub last_error: Option<String>,
    /// The unique key, if any.
    pub unique_key: Option<String>,
    /// The partition it belongs to ([`NewJob::partition_key`](NewJob#structfield.partition_key)), if any.
    pub partition_key: Option<String>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// When it reached a terminal state.
    pub finished_at: Option<DateTime<Utc>>,
    /// Who holds (or last held) it: the claimer's [`ClaimRequest::holder`].
    pub claimed_by: Option<String>,
    /// Its last errors, oldest first, at most [`crate::limits::ERROR_HISTORY_LEN`]: each
    /// failed, retried, cancelled or dead outcome of a holder adds one.
    pub errors: Vec<ErrorEntry>,
}

/// One error of a job's history ([`JobRecord::errors`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorEntry {
    /// The claim's attempt number (`attempts` when the holder reported it).
    pub attempt: i32,
    /// The claim's generation.
    pub generation: i64,
    /// When the outcome was written, by the store's clock.
    pub at: DateTime<Utc>,
    /// The holder that reported it, when it had a name.
    pub worker: Option<String>,
    /// The outcome: `fail`, `retry`, `cancel` or `dead` ([`Finalize::kind`]).
    pub outcome: String,
    /// The error text, as stored in `last_error`.
    pub error: String,
}

impl JobRecord {
    /// The job as finalize hooks see it when no claim ran it (an operator's cancel): its
    /// current generation, its payload, no takeover.
    pub fn as_claimed(&self) -> ClaimedJob {
        ClaimedJob {
            id: self.id,
            generation: self.claim_generation,
            token: self.claim_token,
            attempts: self.attempts,
            reclaims: self.reclaims,
            taken_over: false,
            over_reclaim_cap: false,
            cancel_requested: false,
            claimed_at: self.claimed_at.unwrap_or(self.created_at),
            due_at: self.next_attempt_at,
            priority: self.priority,
            payload: self.payload.clone(),
        }
    }
}

/// How many jobs a queue holds in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueCounts {
    /// `pending`, due or not.
    pub pending: u64,
    /// `in_flight`, leases live or expired.
    pub in_flight: u64,
    /// `completed`.
    pub completed: u64,
    /// `failed`.
    pub failed: u64,
    /// `dead`.
    pub dead: u64,
    /// `cancelled`.
    pub cancelled: u64,
}

impl QueueCounts {
    /// Adds `n` to the counter of `status`.
    pub fn add(&mut self, status: JobStatus, n: u64) {
        let slot = match status {
            JobStatus::Pending => &mut self.pending,
            JobStatus::InFlight => &mut self.in_flight,
            JobStatus::Completed => &mut self.completed,
            JobStatus::Failed => &mut self.failed,
            JobStatus::Dead => &mut self.dead,
            JobStatus::Cancelled => &mut self.cancelled,
        };
        *slot += n;
    }

    /// Jobs still live (`pending` + `in_flight`).
    pub fn live(&self) -> u64 {
        self.pending + self.in_flight
    }

    /// All jobs.
    pub fn total(&self) -> u64 {
        self.live() + self.completed + self.failed + self.dead + self.cancelled
    }
}

/// A queue's health at a glance: what [`crate::Backend::stats`] reads, every number from an
/// index so that the cost does not grow with the queue's history (on PostgreSQL: the partial
/// indexes `<table>_due_idx`, `<table>_expiry_idx` and `<table>_finished_idx`; see
/// `docs/operations.md` for the cost at a million rows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Pending jobs due now: exact up to [`QueueStats::COUNT_CAP`], the cap beyond.
    pub due: u64,
    /// Pending jobs scheduled for later: exact up to [`QueueStats::COUNT_CAP`], the cap beyond.
    pub scheduled: u64,
    /// Jobs in flight (exact; bounded by the workers' concurrency).
    pub in_flight: u64,
    /// In-flight jobs whose lease has passed: their worker died, hangs or lost the database;
    /// the next claim takes them over (exact).
    pub lease_expired: u64,
    /// In-flight jobs whose lease ends within the window asked for (exact).
    pub lease_expiring: u64,
    /// How long the oldest due job has waited: the queue's lag (`None` when nothing is due).
    pub oldest_due_wait: Option<std::time::Duration>,
    /// Jobs that ended in the last hour, by status (exact: only the last hour's rows are read).
    pub finished_last_hour: FinishedCounts,
}

impl QueueStats {
    /// The most `due` and `scheduled` count: a larger backlog reports this many, so that
    /// reading the statistics of a queue a million jobs behind costs what 100 000 cost.
    pub const COUNT_CAP: u64 = 100_000;
}

/// Jobs that reached each terminal status in a period.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FinishedCounts {
    /// `completed`.
    pub completed: u64,
    /// `failed`.
    pub failed: u64,
    /// `dead`.
    pub dead: u64,
    /// `cancelled`.
    pub cancelled: u64,
}

impl FinishedCounts {
    /// Adds `n` to the counter of `status`; live statuses are not counted.
    pub fn add(&mut self, status: JobStatus, n: u64) {
        match status {
            JobStatus::Completed => self.completed += n,
            JobStatus::Failed => self.failed += n,
            JobStatus::Dead => self.dead += n,
            JobStatus::Cancelled => self.cancelled += n,
            JobStatus::Pending | JobStatus::InFlight => {}
        }
    }
}

/// What one claim asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// At most this many jobs (at least 1).
    pub batch_size: u32,
    /// The lease the claimed jobs are held under, stored with each claim. (In-flight jobs are
    /// taken over once their own stored lease has passed, whatever this one is.)
    pub lease: Lease,
    /// A job whose lease expired after this many takeovers comes back flagged
    /// [`ClaimedJob::over_reclaim_cap`] (a poison job that kills its worker every time): its
    /// holder buries it instead of running it.
    pub max_reclaims: u32,
    /// Who claims: stored with the claim (`claimed_by`), shown by the admin API as the job's
    /// holder and recorded with each error the holder reports. `None` stores no name.
    pub holder: Option<String>,
}

/// The default reclaim cap: a job may be taken over from an expired lease five times; after the
/// sixth expiry it ends `dead`. Rolling restarts with graceful shutdown release claims and never
/// count; only a worker that died (or hung past its lease) does.
pub const DEFAULT_MAX_RECLAIMS: u32 = 5;

/// The `last_error` the worker runtime writes when it buries a job at the reclaim cap.
pub const RECLAIM_CAP_MESSAGE: &str =
    "lease expired past the reclaim cap: the job kept losing its worker; it is dead";

impl ClaimRequest {
    /// A claim of up to `batch_size` jobs under `lease`, with [`DEFAULT_MAX_RECLAIMS`].
    pub fn new(batch_size: u32, lease: Lease) -> Self {
        ClaimRequest {
            batch_size: batch_size.max(1),
            lease,
            max_reclaims: DEFAULT_MAX_RECLAIMS,
            holder: None,
        }
    }

    /// Names the claimer (a worker's [`WorkerConfig::name`](crate::WorkerConfig::name)); the
    /// name is cut to [`crate::limits::MAX_HOLDER_BYTES`] and stripped of control characters.
    pub fn holder(mut self, name: impl Into<String>) -> Self {
        self.holder = Some(crate::limits::storable_holder(&name.into()));
        self
    }

    /// Sets the reclaim cap.
    pub fn max_reclaims(mut self, max_reclaims: u32) -> Self {
        self.max_reclaims = max_reclaims;
        self
    }
}

/// What a claim returned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimBatch {
    /// The jobs now held under a lease, in claim order.
    pub jobs: Vec<ClaimedJob>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_refuses_zero_and_absurd_values() {
        assert_eq!(Lease::new(Duration::ZERO), Err(ConfigError::ZeroLease));
        assert!(matches!(
            Lease::from_secs(2 * 24 * 3600),
            Err(ConfigError::LeaseTooLong(_))
        ));
        assert_eq!(Lease::default().duration(), Duration::from_secs(90));
        assert_eq!(Lease::from_secs(5).unwrap().as_secs_f64(), 5.0);
    }

    #[test]
    fn queue_names_are_validated() {
        assert!(QueueName::new("exchange.send:v2").is_ok());
        for bad in ["", "has space", "semi;colon", "quote'", &"x".repeat(129)] {
            assert!(
                matches!(QueueName::new(bad), Err(ConfigError::InvalidQueueName(_))),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn status_text_round_trips() {
        for status in JobStatus::ALL {
            assert_eq!(JobStatus::parse(status.as_str()), Some(status));
        }
        assert_eq!(JobStatus::parse("sent"), None);
        assert!(!JobStatus::InFlight.is_terminal());
        assert!(JobStatus::Dead.is_terminal());
    }

    #[test]
    fn a_token_is_never_the_unclaimed_mark_and_two_claims_draw_apart() {
        let tokens: std::collections::HashSet<ClaimToken> =
            (0..10_000).map(|_| ClaimToken::random()).collect();
        assert_eq!(tokens.len(), 10_000);
        assert!(!tokens.contains(&ClaimToken(0)));
        assert_eq!(ClaimToken(-1).to_string(), "ffffffffffffffff");
        assert_eq!(ClaimToken(10).to_string(), "000000000000000a");
    }

    #[test]
    fn handler_errors_exclude_lease_takeovers() {
        let job = ClaimedJob {
            id: JobId(1),
            generation: ClaimGeneration(6),
            token: ClaimToken(7),
            attempts: 6,
            reclaims: 2,
            taken_over: false,
            over_reclaim_cap: false,
            cancel_requested: false,
            claimed_at: Utc::now(),
            due_at: Utc::now(),
            priority: 0,
            payload: Value::Null,
        };
        // 6 claims = this one + 2 takeovers + 3 handler errors.
        assert_eq!(job.handler_errors(), 3);
    }

    #[test]
    fn outcome_from_rows() {
        assert_eq!(
            FinalizeOutcome::from_rows_affected(1),
            FinalizeOutcome::Applied
        );
        assert_eq!(
            FinalizeOutcome::from_rows_affected(0),
            FinalizeOutcome::Stale
        );
    }
}
