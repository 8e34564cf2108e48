//! Operating a queue: listing and finding jobs, retrying, cancelling and purging them, pausing,
//! resuming and draining the queue. Every backend implements [`Admin`], and the conformance
//! suite holds each to the same semantics.
//!
//! The changes that end or reopen a job go through the adopter's finalize hooks, so that domain
//! state follows the job: [`retry_with_hooks`] runs [`FinalizeHook::after_reopened`], and
//! [`cancel_with_hooks`](crate::cancel_with_hooks) runs [`FinalizeHook::after_applied`] with a
//! cancel. A hook may refuse (an exchange transaction that is not failed cannot be reopened): its
//! error rolls the change back.
//!
//! ```
//! use queue_core::{Admin, Backend, ClaimRequest, Finalize, Hooks, JobFilter, JobStatus, Lease,
//!                  MemoryBackend, MemoryTx, NewJob, RetryTarget, retry_with_hooks};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> queue_core::Result<()> {
//! let queue = MemoryBackend::new();
//! let id = queue.enqueue(NewJob::new(&"card 42")?).await?.id;
//! let job = queue.claim(ClaimRequest::new(1, Lease::DEFAULT)).await?.jobs.remove(0);
//! queue.finalize(job.claim(), &Finalize::Dead { reason: "poison".into() }).await?;
//!
//! // An operator lists the dead jobs and retries one: back to pending, attempts reset.
//! let dead = queue.list_jobs(&JobFilter::new().status(JobStatus::Dead)).await?;
//! assert_eq!(dead.jobs[0].id, id);
//! let hooks: Hooks<MemoryTx, String> = Hooks::new();
//! let retried = retry_with_hooks(&queue, &hooks, id, JobStatus::Dead).await?;
//! assert!(matches!(retried, RetryTarget::Retried(ref job) if job.attempts == 0));
//! assert_eq!(queue.get(id).await?.unwrap().status, JobStatus::Pending);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;

use crate::backend::{Backend, BackendTx};
use crate::error::{ConfigError, InvalidInput, Result};
use crate::events;
use crate::hooks::{Hooks, Payload, ReopenEvent};
use crate::types::{JobId, JobRecord, JobStatus, QueueName};

/// The most jobs one page of [`Admin::list_jobs`] returns.
pub const MAX_PAGE: u32 = 1_000;

/// What [`Admin::list_jobs`] lists: jobs of the handle's queue in the given statuses (all when
/// none is given), newest first (by id), after a cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFilter {
    /// Statuses to list; empty lists every status.
    pub statuses: Vec<JobStatus>,
    /// Only jobs with an id below this one: the [`JobPage::next`] of the previous page.
    pub before: Option<JobId>,
    /// At most this many jobs (1 to [`MAX_PAGE`]; default 50).
    pub limit: u32,
}

impl JobFilter {
    /// Every job, newest first, 50 per page.
    pub fn new() -> Self {
        JobFilter {
            statuses: Vec::new(),
            before: None,
            limit: 50,
        }
    }

    /// Adds a status to list (kept sorted, so one set of statuses is one statement).
    pub fn status(mut self, status: JobStatus) -> Self {
        if !self.statuses.contains(&status) {
            self.statuses.push(status);
            self.statuses.sort_by_key(|s| s.as_str());
        }
        self
    }

    /// Starts after `cursor` (the previous page's [`JobPage::next`]).
    pub fn before(mut self, cursor: JobId) -> Self {
        self.before = Some(cursor);
        self
    }

    /// At most `limit` jobs, kept between 1 and [`MAX_PAGE`].
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit.clamp(1, MAX_PAGE);
        self
    }

    /// Whether `job` passes the filter (for backends that filter in memory).
    pub fn matches(&self, job: &JobRecord) -> bool {
        (self.statuses.is_empty() || self.statuses.contains(&job.status))
            && self.before.is_none_or(|before| job.id < before)
    }
}

impl Default for JobFilter {
    fn default() -> Self {
        JobFilter::new()
    }
}

/// One page of jobs.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPage {
    /// The jobs, newest first.
    pub jobs: Vec<JobRecord>,
    /// The cursor of the next page ([`JobFilter::before`]); `None` when this page is the last.
    pub next: Option<JobId>,
}

impl JobPage {
    /// The page of `jobs` (newest first, at most `limit + 1` of them: one more than asked
    /// says there is a next page).
    pub fn from_rows(mut jobs: Vec<JobRecord>, limit: u32) -> Self {
        let more = jobs.len() > limit as usize;
        jobs.truncate(limit as usize);
        let next = if more {
            jobs.last().map(|j| j.id)
        } else {
            None
        };
        JobPage { jobs, next }
    }
}

/// What [`Admin::retry_in`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryTarget {
    /// The job is `pending` again (attempts and reclaims reset, due now), as returned.
    Retried(Box<JobRecord>),
    /// No job of this queue has the id.
    NotFound,
    /// The job was not in the status the operator saw: it is in this one, and nothing changed.
    WrongState(JobStatus),
}

/// Whether a queue is paused ([`Admin::pause`]), and the stale fences its workers met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueControl {
    /// Since when the queue is paused, by the store's clock; `None` when it runs.
    pub paused_at: Option<DateTime<Utc>>,
    /// Outcomes of this queue's workers refused by the fence, since the store began counting
    /// ([`Backend::record_stale`]).
    pub stale_fences: u64,
    /// When the last of them was recorded.
    pub last_stale_at: Option<DateTime<Utc>>,
    /// The limits in force on the queue's claims ([`Admin::set_limits`]).
    pub limits: QueueLimits,
    /// Whether room grants are on for the queue (PostgreSQL: the switch its row started with,
    /// from the configuration of the handle that wrote it first, or the one
    /// `PostgresQueue::set_room_grants` set since; handles then claim on room granted for
    /// several claims while the limits are in flight only). `false` for a queue without a row
    /// yet, and always on a backend without grants.
    pub room_grants: bool,
}

/// Limits on a queue's claims across every worker process of every binary, stored with the
/// queue ([`Admin::set_limits`]) and enforced by the claim itself. No limit by default.
///
/// ```
/// use std::time::Duration;
/// use queue_core::{QueueLimits, RateLimit};
///
/// // One partner takes at most 8 requests at once and 100 a minute.
/// let limits = QueueLimits {
///     max_in_flight: Some(8),
///     rate: Some(RateLimit::new(100, Duration::from_secs(60))?),
///     ..QueueLimits::NONE
/// };
/// assert_eq!(limits.to_string(), "at most 8 in flight, 100 starts per 60s");
///
/// // Many partners in one queue: one request at a time to each, partners taking turns.
/// let one_each = QueueLimits { max_per_partition: Some(1), ..QueueLimits::NONE };
/// assert_eq!(one_each.to_string(), "at most 1 in flight per partition");
///
/// // And at most 10 requests a second to each of them.
/// let paced = QueueLimits {
///     rate_per_partition: Some(RateLimit::new(10, Duration::from_secs(1))?),
///     ..one_each
/// };
/// assert_eq!(
///     paced.to_string(),
///     "at most 1 in flight per partition, 10 starts per 1s per partition"
/// );
/// # Ok::<(), queue_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueLimits {
    /// At most this many of the queue's jobs in flight at once, across every worker. A job
    /// whose lease expired still counts until it ends or is taken over (its holder may yet
    /// renew the lease); taking it over is free, so a queue full of expired leases still
    /// moves. At least 1.
    pub max_in_flight: Option<u32>,
    /// At most so many claims of the queue's jobs within any window of the given length.
    pub rate: Option<RateLimit>,
    /// At most this many jobs of one partition ([`NewJob::partition_key`]) in flight at once,
    /// counted as `max_in_flight` is. Partitions take turns: each claim goes on from the
    /// partition where the last one stopped, in key order, so a partition's backlog never
    /// holds back another's. Jobs without a partition key are not limited by it. At least 1.
    ///
    /// [`NewJob::partition_key`]: crate::NewJob#structfield.partition_key
    pub max_per_partition: Option<u32>,
    /// At most so many claims of one partition's jobs within any window of the given length,
    /// takeovers of expired leases included (each is a start of the job again). Partitions take
    /// turns as under `max_per_partition`: a partition that used its starts is passed over
    /// until its window slides, and the others go on. Jobs without a partition key are not
    /// limited by it.
    pub rate_per_partition: Option<RateLimit>,
}

impl QueueLimits {
    /// No limit: every claim takes what its batch asks for.
    pub const NONE: QueueLimits = QueueLimits {
        max_in_flight: None,
        rate: None,
        max_per_partition: None,
        rate_per_partition: None,
    };

    /// Whether no limit is set.
    pub fn is_none(&self) -> bool {
        self.max_in_flight.is_none() && self.rate.is_none() && !self.partitioned()
    }

    /// Whether a limit per partition is set (`max_per_partition` or `rate_per_partition`): the
    /// claim then counts each partition's jobs and the partitions take turns
    /// ([`crate::partition`]).
    pub fn partitioned(&self) -> bool {
        self.max_per_partition.is_some() || self.rate_per_partition.is_some()
    }

    /// How many more jobs of one partition a claim may start, when `in_flight` of its jobs are
    /// in flight and `started` were claimed within `rate_per_partition`'s window: the smaller
    /// of what each limit per partition leaves (`u64::MAX` without one). The one rule every
    /// backend applies.
    ///
    /// ```
    /// use std::time::Duration;
    /// use queue_core::{QueueLimits, RateLimit};
    ///
    /// let limits = QueueLimits {
    ///     max_per_partition: Some(4),
    ///     rate_per_partition: Some(RateLimit::new(10, Duration::from_secs(60))?),
    ///     ..QueueLimits::NONE
    /// };
    /// assert_eq!(limits.partition_room(1, 0), 3, "three more in flight");
    /// assert_eq!(limits.partition_room(1, 8), 2, "two more starts this minute");
    /// assert_eq!(limits.partition_room(4, 0), 0);
    /// # Ok::<(), queue_core::ConfigError>(())
    /// ```
    pub fn partition_room(&self, in_flight: u64, started: u64) -> u64 {
        let mut room = u64::MAX;
        if let Some(max) = self.max_per_partition {
            room = room.min(u64::from(max).saturating_sub(in_flight));
        }
        if let Some(rate) = self.rate_per_partition {
            room = room.min(u64::from(rate.starts).saturating_sub(started));
        }
        room
    }

    /// How many more starts of one partition `rate_per_partition` allows when `started` were
    /// claimed within its window (`u64::MAX` without one): what bounds the takeovers of a
    /// partition's expired leases, which add no job in flight.
    pub fn partition_starts_left(&self, started: u64) -> u64 {
        self.rate_per_partition.map_or(u64::MAX, |rate| {
            u64::from(rate.starts).saturating_sub(started)
        })
    }

    /// The limits as a store keeps them (`max_in_flight`, `rate_starts`, `rate_per_ms`,
    /// `max_per_partition`, `partition_rate_starts`, `partition_rate_per_ms`; a rate needs both
    /// of its columns). Values a [`RateLimit`] would refuse, set by hand, are brought into its
    /// range rather than dropped: a limit is never lifted by a read.
    pub fn from_stored(
        max_in_flight: Option<i64>,
        rate_starts: Option<i64>,
        rate_per_ms: Option<i64>,
        max_per_partition: Option<i64>,
        partition_rate_starts: Option<i64>,
        partition_rate_per_ms: Option<i64>,
    ) -> Self {
        let rate = |starts: Option<i64>, per_ms: Option<i64>| match (starts, per_ms) {
            (Some(starts), Some(per_ms)) => RateLimit::new(
                starts.clamp(1, i64::from(RateLimit::MAX_STARTS)) as u32,
                Duration::from_millis(per_ms.max(1) as u64).min(RateLimit::MAX_WINDOW),
            )
            .ok(),
            _ => None,
        };
        let count = |n: i64| n.clamp(1, i64::from(u32::MAX)) as u32;
        QueueLimits {
            max_in_flight: max_in_flight.map(count),
            rate: rate(rate_starts, rate_per_ms),
            max_per_partition: max_per_partition.map(count),
            rate_per_partition: rate(partition_rate_starts, partition_rate_per_ms),
        }
    }

    /// Refuses a `max_in_flight` or `max_per_partition` of 0 (a queue nobody may run is a
    /// pause: [`Admin::pause`]).
    pub fn check(&self) -> std::result::Result<(), ConfigError> {
        if self.max_in_flight == Some(0) {
            return Err(ConfigError::OutOfRange {
                name: "max_in_flight",
                detail: "0 would stop the queue; pause it instead".to_owned(),
            });
        }
        if self.max_per_partition == Some(0) {
            return Err(ConfigError::OutOfRange {
                name: "max_per_partition",
                detail: "0 would stop every partition; pause the queue instead".to_owned(),
            });
        }
        Ok(())
    }

    /// What a claim may take now, of `batch` asked for, when `in_flight` of the queue's jobs
    /// are in flight (their leases expired or not: a holder may still renew one that passed)
    /// and `started` were claimed within the rate's window. The one rule every backend
    /// applies.
    pub fn room(&self, batch: u32, in_flight: u64, started: u64) -> ClaimRoom {
        let left = |limit: u32, used: u64| u64::from(limit).saturating_sub(used);
        let mut all = u64::from(batch);
        if let Some(rate) = self.rate {
            all = all.min(left(rate.starts, started));
        }
        let mut new = all;
        if let Some(max) = self.max_in_flight {
            new = new.min(left(max, in_flight));
        }
        ClaimRoom {
            all: all as u32,
            new: new as u32,
        }
    }
}

/// What a claim of a limited queue may take ([`QueueLimits::room`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRoom {
    /// Jobs in all: new ones and takeovers of expired leases (a takeover counts as a start).
    pub all: u32,
    /// Pending jobs among them: a takeover adds no job in flight, a pending job does.
    pub new: u32,
}

/// `at most 8 in flight, 100 starts per 60s, at most 1 in flight per partition, 10 starts per
/// 1s per partition`, or `no limits`.
impl std::fmt::Display for QueueLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(max) = self.max_in_flight {
            parts.push(format!("at most {max} in flight"));
        }
        if let Some(rate) = self.rate {
            parts.push(rate.to_string());
        }
        if let Some(max) = self.max_per_partition {
            parts.push(format!("at most {max} in flight per partition"));
        }
        if let Some(rate) = self.rate_per_partition {
            parts.push(format!("{rate} per partition"));
        }
        if parts.is_empty() {
            f.write_str("no limits")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// `100 starts per 60s` (milliseconds when the window is not whole seconds).
impl std::fmt::Display for RateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.per.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{} starts per {}s", self.starts, ms / 1000)
        } else {
            write!(f, "{} starts per {ms}ms", self.starts)
        }
    }
}

/// At most `starts` claims within any window of length `per` (a sliding window, not a
/// refilling bucket: no burst past `starts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    starts: u32,
    per: Duration,
}

impl RateLimit {
    /// The longest window: a day.
    pub const MAX_WINDOW: Duration = Duration::from_secs(24 * 3600);
    /// The most starts per window: 100 000.
    pub const MAX_STARTS: u32 = 100_000;

    /// `starts` claims (1 to [`RateLimit::MAX_STARTS`]) per `per` (a millisecond to
    /// [`RateLimit::MAX_WINDOW`]).
    pub fn new(starts: u32, per: Duration) -> std::result::Result<Self, ConfigError> {
        if starts == 0 || starts > Self::MAX_STARTS {
            return Err(ConfigError::OutOfRange {
                name: "rate limit starts",
                detail: format!("{starts} is outside 1 to {}", Self::MAX_STARTS),
            });
        }
        if per < Duration::from_millis(1) || per > Self::MAX_WINDOW {
            return Err(ConfigError::OutOfRange {
                name: "rate limit window",
                detail: format!("{per:?} is outside 1 ms to a day"),
            });
        }
        Ok(RateLimit {
            starts,
            per: Duration::from_millis(per.as_millis() as u64),
        })
    }

    /// Claims allowed per window.
    pub fn starts(&self) -> u32 {
        self.starts
    }

    /// The window, in whole milliseconds.
    pub fn per(&self) -> Duration {
        self.per
    }
}

/// What a scheduler reports of one of its schedules after each pass
/// ([`Admin::record_schedules`]), for operators to see the schedules in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleReport {
    /// The schedule's name ([`Schedule::name`](crate::schedule::Schedule::name)).
    pub name: String,
    /// When its periods fall: `cron 0 7 * * * Europe/Berlin`, or `every 60s from …`
    /// ([`Schedule::spec`](crate::schedule::Schedule::spec)).
    pub spec: String,
    /// What happens to missed periods: `skip after 60s`, `catch up within 21600s`
    /// ([`Missed`](crate::schedule::Missed)).
    pub missed: String,
    /// The latest period this scheduler handled (enqueued or found enqueued).
    pub through: Option<DateTime<Utc>>,
    /// The next period, by the scheduler's clock.
    pub next: Option<DateTime<Utc>>,
}

/// A schedule of the queue as its schedulers last reported it ([`Admin::schedules`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleInfo {
    /// What the last scheduler to pass reported (`through` is the latest any reported).
    pub report: ScheduleReport,
    /// When a scheduler last reported it, by the store's clock: a schedule no scheduler runs
    /// any more keeps its row, and this says since when nobody ran it.
    pub seen_at: DateTime<Utc>,
    /// The name of that scheduler ([`Scheduler::name`](crate::schedule::Scheduler::name)).
    pub seen_by: String,
}

/// The jobs of a queue that ended in one minute ([`Admin::throughput`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinuteCounts {
    /// The minute's start, by the store's clock.
    pub minute: DateTime<Utc>,
    /// The jobs that ended in it, by status.
    pub finished: crate::types::FinishedCounts,
}

impl QueueControl {
    /// True when workers do not claim from the queue.
    pub fn is_paused(&self) -> bool {
        self.paused_at.is_some()
    }
}

/// What [`Admin::purge_batch`] deletes: terminal jobs of the queue, in the given statuses,
/// finished longer ago than `older_than`, at most `batch_size` per call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PurgeRequest {
    statuses: Vec<JobStatus>,
    older_than: Duration,
    batch_size: u32,
}

impl PurgeRequest {
    /// The most rows one purge statement deletes.
    pub const MAX_BATCH: u32 = 10_000;

    /// Terminal jobs in `statuses` finished more than `older_than` ago, 1 000 per batch.
    /// Refused for an empty list or a live status (`pending`, `in_flight`: only the holder or
    /// a cancel may end those).
    pub fn new(statuses: &[JobStatus], older_than: Duration) -> Result<Self> {
        if statuses.is_empty() {
            return Err(InvalidInput::NotPurgeable { status: None }.into());
        }
        if let Some(live) = statuses.iter().find(|s| !s.is_terminal()) {
            return Err(InvalidInput::NotPurgeable {
                status: Some(*live),
            }
            .into());
        }
        if older_than > crate::limits::MAX_DELAY * 100 {
            return Err(InvalidInput::DelayTooLong(older_than).into());
        }
        let mut unique = statuses.to_vec();
        unique.sort_by_key(|s| s.as_str());
        unique.dedup();
        Ok(PurgeRequest {
            statuses: unique,
            older_than,
            batch_size: 1_000,
        })
    }

    /// Rows per statement, kept between 1 and [`PurgeRequest::MAX_BATCH`].
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.clamp(1, Self::MAX_BATCH);
        self
    }

    /// The statuses purged.
    pub fn statuses(&self) -> &[JobStatus] {
        &self.statuses
    }

    /// The age past which a terminal job is purged.
    pub fn older_than(&self) -> Duration {
        self.older_than
    }

    /// Rows per statement.
    pub fn rows_per_batch(&self) -> u32 {
        self.batch_size
    }
}

/// The statuses an operator may retry: `dead`, `failed` and `cancelled`.
pub const RETRYABLE: [JobStatus; 3] = [JobStatus::Dead, JobStatus::Failed, JobStatus::Cancelled];

/// Listing and steering a queue: what an operator needs besides [`Backend`]. Every backend
/// implements it; the conformance suite (`admin` cases) is its executable specification.
pub trait Admin: Backend {
    /// One page of this queue's jobs (see [`JobFilter`]): keyset-paginated on the id, never an
    /// offset. On PostgreSQL a page of failed, dead or cancelled jobs reads only those rows
    /// (their own index); other listings walk the primary key backwards from the cursor and
    /// read the rows of other queues and statuses on the way (see `docs/operations.md`).
    fn list_jobs(&self, filter: &JobFilter) -> impl Future<Output = Result<JobPage>> + Send;

    /// The job of this queue holding the unique key `key`, if one does.
    fn find_by_unique_key(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<JobRecord>>> + Send;

    /// Reopens a job the operator saw in status `seen` (one of [`RETRYABLE`]), inside `tx`:
    /// back to `pending`, due now, `attempts` and `reclaims` reset, its lease and cancel
    /// request cleared; its generation keeps counting (a fence token is never reused) and its
    /// error history stays. Guarded on `seen`: a job that moved on meanwhile is left alone
    /// ([`RetryTarget::WrongState`]). [`retry_with_hooks`] runs the hooks.
    fn retry_in(
        &self,
        tx: &mut Self::Tx,
        id: JobId,
        seen: JobStatus,
    ) -> impl Future<Output = Result<RetryTarget>> + Send;

    /// Deletes at most one batch of the jobs `request` names; returns how many it deleted.
    /// [`purge`] repeats it until none is left.
    fn purge_batch(&self, request: &PurgeRequest) -> impl Future<Output = Result<u64>> + Send;

    /// Pauses the queue: no worker of any process claims from it (each sees it at its next
    /// claim), running jobs go on and finish. Stored, so it outlives restarts. Pausing a paused
    /// queue keeps its first `paused_at`.
    fn pause(&self) -> impl Future<Output = Result<QueueControl>> + Send;

    /// Resumes a paused queue, and wakes its idle workers where the backend can.
    fn resume(&self) -> impl Future<Output = Result<QueueControl>> + Send;

    /// Whether the queue is paused, and the limits in force.
    fn control(&self) -> impl Future<Output = Result<QueueControl>> + Send;

    /// Sets the queue's limits ([`QueueLimits::NONE`] removes them). Stored, so they hold for
    /// every worker of every process and outlive restarts; each worker's claims obey them from
    /// its next claim on (on PostgreSQL within a second: a worker that has not yet seen them
    /// claims nothing from a limited queue until it has).
    fn set_limits(&self, limits: QueueLimits) -> impl Future<Output = Result<QueueControl>> + Send;

    /// The queues of this handle's store (a PostgreSQL table, a memory store) that have a
    /// pending, running, failed, dead or cancelled job, a pause, a stale fence, a worker that
    /// served them ([`Backend::note_served`]), or a recorded schedule, sorted by name.
    fn queues(&self) -> impl Future<Output = Result<Vec<QueueName>>> + Send;

    /// A handle on another queue of the same store, sharing its connections.
    fn for_queue(&self, queue: QueueName) -> Self;

    /// The jobs that ended in each of the last `minutes` minutes (the current one included),
    /// oldest first, one entry per minute (zeros included), at most 1 440.
    fn throughput(&self, minutes: u32) -> impl Future<Output = Result<Vec<MinuteCounts>>> + Send;

    /// Stores what the scheduler `seen_by` runs on this queue (see [`ScheduleReport`]), one row
    /// per schedule name, stamped with the store's clock; `through` never goes back (another
    /// scheduler may lag). A [`Scheduler`](crate::schedule::Scheduler) calls it after each pass.
    fn record_schedules(
        &self,
        seen_by: &str,
        reports: &[ScheduleReport],
    ) -> impl Future<Output = Result<()>> + Send;

    /// The schedules recorded for this queue ([`Admin::record_schedules`]), by name.
    fn schedules(&self) -> impl Future<Output = Result<Vec<ScheduleInfo>>> + Send;

    /// Forgets a schedule no scheduler runs any more; true when it was recorded. A scheduler
    /// that still runs it records it again at its next pass.
    fn forget_schedule(&self, name: &str) -> impl Future<Output = Result<bool>> + Send;

    /// Waits until no claim that started before this call is still running: a claim that
    /// started before a pause committed read the queue as running and may still take jobs.
    /// [`drain`] calls it after pausing. Backends whose claims see a pause at once (the memory
    /// backend) return at once.
    fn settle_claims(&self) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }
}

/// Reopens a job the operator saw in status `seen` ([`Admin::retry_in`]) and runs the hooks'
/// [`FinalizeHook::after_reopened`](crate::FinalizeHook::after_reopened) in the same
/// transaction; a hook error rolls the retry back. `seen` outside [`RETRYABLE`] is refused
/// before anything is read.
pub async fn retry_with_hooks<B, P>(
    backend: &B,
    hooks: &Hooks<B::Tx, P>,
    id: JobId,
    seen: JobStatus,
) -> Result<RetryTarget>
where
    B: Admin,
    P: DeserializeOwned + Sync,
{
    if !RETRYABLE.contains(&seen) {
        return Err(InvalidInput::NotRetryable { status: seen }.into());
    }
    let mut tx = backend.begin().await?;
    let target = backend.retry_in(&mut tx, id, seen).await?;
    if let RetryTarget::Retried(job) = &target
        && !hooks.is_empty()
    {
        let parsed = P::deserialize(&job.payload).ok();
        let event = ReopenEvent {
            job,
            previous: seen,
            payload: parsed.as_ref().map_or(Payload::Malformed, Payload::Parsed),
        };
        if let Err(err) = hooks.run_reopened(&mut tx, &event).await {
            let _ = tx.rollback().await;
            return Err(err);
        }
    }
    tx.commit().await?;
    if matches!(target, RetryTarget::Retried(_)) {
        events::retried_by_operator(backend.queue(), id, seen);
    }
    Ok(target)
}

/// Purges every job `request` names, one bounded batch per statement, calling `progress` with
/// the running total after each; returns the total. Stops early, between batches, when
/// `keep_going` returns false (an operator's Ctrl-C), with what was deleted so far.
pub async fn purge<B: Admin>(
    backend: &B,
    request: &PurgeRequest,
    mut progress: impl FnMut(u64) + Send,
    mut keep_going: impl FnMut() -> bool + Send,
) -> Result<u64> {
    let mut total = 0;
    loop {
        let deleted = backend.purge_batch(request).await?;
        total += deleted;
        progress(total);
        if deleted < u64::from(request.rows_per_batch()) || !keep_going() {
            return Ok(total);
        }
    }
}

/// What [`drain`] saw when it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Jobs still running under a live lease (0 when the drain finished).
    pub running: u64,
    /// Jobs in flight whose lease had already passed: their worker is gone, and they will be
    /// taken over when the queue resumes.
    pub stranded: u64,
    /// Whether every running job finished before the deadline.
    pub drained: bool,
}

/// Pauses the queue and waits until no job of it runs under a live lease, or until `timeout`;
/// checks every `poll` (jobs whose lease passed do not count: nobody runs them). The queue
/// stays paused: [`Admin::resume`] it when the work is done.
pub async fn drain<B: Admin>(
    backend: &B,
    timeout: Duration,
    poll: Duration,
) -> Result<DrainReport> {
    backend.pause().await?;
    backend.settle_claims().await?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let stats = backend.stats(Duration::ZERO).await?;
        let running = stats.in_flight.saturating_sub(stats.lease_expired);
        let report = DrainReport {
            running,
            stranded: stats.lease_expired,
            drained: running == 0,
        };
        if report.drained || tokio::time::Instant::now() >= deadline {
            return Ok(report);
        }
        tokio::time::sleep(poll.min(deadline - tokio::time::Instant::now())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn purge_refuses_live_statuses_and_nothing() {
        assert!(PurgeRequest::new(&[], Duration::ZERO).is_err());
        assert!(PurgeRequest::new(&[JobStatus::Pending], Duration::ZERO).is_err());
        let request = PurgeRequest::new(
            &[JobStatus::Dead, JobStatus::Completed, JobStatus::Dead],
            Duration::ZERO,
        )
        .unwrap()
        .batch_size(0);
        assert_eq!(request.statuses(), [JobStatus::Completed, JobStatus::Dead]);
        assert_eq!(request.rows_per_batch(), 1);
    }

    #[test]
    fn a_filter_keeps_its_limit_in_range() {
        assert_eq!(JobFilter::new().limit(0).limit, 1);
        assert_eq!(JobFilter::new().limit(1_000_000).limit, MAX_PAGE);
    }
}
