//! The structured `tracing` events the framework emits, each under a stable name.
//!
//! Names are part of the public contract (dashboards and alerts key on them): every event is
//! emitted through the constant of its name, by one function of this module. Payloads are never
//! logged. See `docs/operations.md` for what each means and which to alert on.

use std::time::Duration;

use crate::error::Error;
use crate::types::{Claim, ClaimedJob, Finalize, FinalizeOutcome, JobId, QueueName};

/// A lease holder's write was refused by the generation fence (warn).
pub const STALE_FINALIZE_FENCED: &str = "queue.stale_finalize_fenced";
/// A heartbeat found the lease already lost; the handler's cancellation token fired (warn).
pub const LEASE_LOST: &str = "queue.lease_lost";
/// A job went to `dead`: its lease expired past the reclaim cap, or a finalize hook kept failing
/// (then `queue.hook_gave_up` comes first) (error).
pub const JOB_DEAD: &str = "queue.job_dead";
/// A claim took a job over from an expired lease (info).
pub const JOB_RECLAIMED: &str = "queue.job_reclaimed";
/// A handler failed and the job was scheduled again (info).
pub const JOB_RETRY_SCHEDULED: &str = "queue.job_retry_scheduled";
/// A handler snoozed its job: back to `pending` for later, the run not counted as an attempt
/// (debug).
pub const JOB_SNOOZED: &str = "queue.job_snoozed";
/// A job failed terminally (warn).
pub const JOB_FAILED: &str = "queue.job_failed";
/// A payload did not deserialise into the handler's type; the job failed terminally, its payload
/// kept in the row (error).
pub const PAYLOAD_MALFORMED: &str = "queue.payload_malformed";
/// A finalize (or its hooks) failed and will be tried again (warn).
pub const FINALIZE_RETRY: &str = "queue.finalize_retry";
/// A finalize failed for good; the job stays in flight until its lease lapses (error).
pub const FINALIZE_FAILED: &str = "queue.finalize_failed";
/// A finalize's commit result was lost and the job has moved on since: its outcome may or may
/// not have been written (warn).
pub const FINALIZE_UNKNOWN: &str = "queue.finalize_unknown";
/// A finalize hook kept failing until the job's lease was nearly over: the job is ended `dead`
/// without the hooks, and the domain side is left to the operator (error).
pub const HOOK_GAVE_UP: &str = "queue.hook_gave_up";
/// A claim succeeded again after an outage (info).
pub const CLAIM_RECOVERED: &str = "queue.claim_recovered";
/// A long job's heartbeats have not applied for five sixths of the lease: the worker can no
/// longer trust its lease and cancels the handler (warn).
pub const LEASE_UNTRUSTED: &str = "queue.lease_untrusted";
/// A claim failed: the first of an outage (warn). The worker then backs off, doubling the pause
/// from the poll interval up to 30 s, and logs again only at `queue.claim_recovered`.
pub const CLAIM_FAILED: &str = "queue.claim_failed";
/// An operator cancelled a job: `outcome` says whether it was cancelled at once (pending) or
/// requested of its holder (in flight) (info).
pub const JOB_CANCELLED: &str = "queue.job_cancelled";
/// A worker learned that an operator asked to cancel a job it holds, and is ending it (info).
pub const CANCEL_REQUESTED: &str = "queue.cancel_requested";
/// A claimed job was released unstarted: at shutdown, or because too little lease was left, or
/// aborted at the shutdown deadline (info).
pub const CLAIM_RELEASED: &str = "queue.claim_released";
/// A handler panicked; treated as a retryable handler error (error).
pub const HANDLER_PANICKED: &str = "queue.handler_panicked";
/// A handler ran past the job timeout; treated as a retryable handler error (warn).
pub const HANDLER_TIMED_OUT: &str = "queue.handler_timed_out";
/// A heartbeat (`extend_lease`) failed; it is tried again at the next tick (warn).
pub const HEARTBEAT_FAILED: &str = "queue.heartbeat_failed";
/// A `LISTEN` connection (PostgreSQL) is up and listening (info).
pub const LISTENER_CONNECTED: &str = "queue.listener_connected";
/// A `LISTEN` connection was lost; workers poll until it is back (warn).
pub const LISTENER_LOST: &str = "queue.listener_lost";
/// A pool that follows the primary of several hosts moved its new connections to another host:
/// a failover (info; fields `from`, `to`).
pub const PRIMARY_CHANGED: &str = "queue.primary_changed";
/// No host of a pool's URL takes writes: a failover is under way or the cluster is down
/// (warn, once per outage; field `last`).
pub const PRIMARY_MISSING: &str = "queue.primary_missing";
/// Graceful shutdown finished (info).
pub const WORKER_STOPPED: &str = "queue.worker_stopped";
/// An operator reopened a dead, failed or cancelled job (info).
pub const JOB_RETRIED_BY_OPERATOR: &str = "queue.job_retried_by_operator";
/// An operator paused or resumed a queue (info).
pub const QUEUE_PAUSED: &str = "queue.queue_paused";
/// See [`QUEUE_PAUSED`].
pub const QUEUE_RESUMED: &str = "queue.queue_resumed";
/// A scheduler started, with how many schedules (info).
pub const SCHEDULER_STARTED: &str = "queue.scheduler_started";
/// A scheduler stopped (info).
pub const SCHEDULER_STOPPED: &str = "queue.scheduler_stopped";
/// A schedule's period enqueued its job (info); `duplicate = true` at debug when the job was
/// already there (another process enqueued it first).
pub const SCHEDULE_ENQUEUED: &str = "queue.schedule_enqueued";
/// Missed periods of a schedule were left out, as its `Missed` policy says (warn).
pub const SCHEDULE_SKIPPED: &str = "queue.schedule_skipped";
/// A schedule's enqueue failed; the scheduler tries again, backing off up to 30 s (warn).
pub const SCHEDULE_FAILED: &str = "queue.schedule_failed";
/// The store refused a period's job for good (its payload too large, say): the period is
/// skipped (error).
pub const SCHEDULE_REFUSED: &str = "queue.schedule_refused";
/// A retention run failed; it runs again at its next interval (warn).
pub const RETENTION_FAILED: &str = "queue.retention_failed";
/// A scheduler could not record its schedules for operators (`Admin::record_schedules`); its
/// periods are enqueued all the same, and it records them again after its next pass (warn).
pub const SCHEDULES_UNRECORDED: &str = "queue.schedules_unrecorded";
/// An operator set a queue's limits (info).
pub const QUEUE_LIMITS_SET: &str = "queue.queue_limits_set";
/// An operator switched a queue's room grants on or off (info; PostgreSQL).
pub const ROOM_GRANTS_SET: &str = "queue.room_grants_set";
/// Terminal jobs purged by an operator (info).
pub const JOBS_PURGED: &str = "queue.jobs_purged";

/// The event of a finalize's outcome: the fence refused it, or it applied an outcome an
/// operator may want to see (a retry, a failure, a dead job). Completions and releases are too
/// frequent to log one by one; the worker's counters carry them.
pub(crate) fn finalized(
    queue: &QueueName,
    claim: Claim,
    action: &Finalize,
    outcome: FinalizeOutcome,
) {
    if outcome == FinalizeOutcome::Stale {
        tracing::warn!(
            name: STALE_FINALIZE_FENCED,
            queue = %queue,
            job_id = claim.id.0,
            generation = claim.generation.0,
            action = action.kind(),
            "{STALE_FINALIZE_FENCED}: the job is no longer held under this generation; nothing written"
        );
        return;
    }
    match action {
        Finalize::Retry { error, .. } => tracing::info!(
            name: JOB_RETRY_SCHEDULED,
            queue = %queue,
            job_id = claim.id.0,
            error = %error,
            "{JOB_RETRY_SCHEDULED}"
        ),
        Finalize::Fail { error } => tracing::warn!(
            name: JOB_FAILED,
            queue = %queue,
            job_id = claim.id.0,
            error = %error,
            "{JOB_FAILED}"
        ),
        Finalize::Dead { reason } => tracing::error!(
            name: JOB_DEAD,
            queue = %queue,
            job_id = claim.id.0,
            reason = %reason,
            "{JOB_DEAD}: the job is dead"
        ),
        Finalize::Snooze { at } => tracing::debug!(
            name: JOB_SNOOZED,
            queue = %queue,
            job_id = claim.id.0,
            due = ?at,
            "{JOB_SNOOZED}"
        ),
        Finalize::Complete | Finalize::Release | Finalize::Cancel { .. } => {}
    }
}

pub(crate) fn finalize_unknown(queue: &QueueName, claim: Claim, action: &Finalize) {
    tracing::warn!(
        name: FINALIZE_UNKNOWN,
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        action = action.kind(),
        "{FINALIZE_UNKNOWN}: the commit's result was lost and the job has moved on"
    );
}

pub(crate) fn hook_gave_up(
    queue: &QueueName,
    claim: Claim,
    wanted: &Finalize,
    hook: &str,
    error: &Error,
) {
    tracing::error!(
        name: HOOK_GAVE_UP,
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        action = wanted.kind(),
        hook,
        error = %error,
        "{HOOK_GAVE_UP}: the job is ended dead without the hooks; its domain side needs an operator"
    );
}

pub(crate) fn claim_recovered(queue: &QueueName, failures: u32, outage: Duration) {
    tracing::info!(
        name: CLAIM_RECOVERED,
        queue = %queue,
        failures,
        outage_ms = outage.as_millis() as u64,
        "{CLAIM_RECOVERED}"
    );
}

pub(crate) fn lease_untrusted(queue: &QueueName, claim: Claim, since_last_beat: Duration) {
    tracing::warn!(
        name: LEASE_UNTRUSTED,
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        since_last_heartbeat_ms = since_last_beat.as_millis() as u64,
        "{LEASE_UNTRUSTED}: heartbeats have not applied; cancelling the handler"
    );
}

pub(crate) fn cancelled(queue: &QueueName, id: JobId, outcome: crate::types::CancelOutcome) {
    tracing::info!(
        name: JOB_CANCELLED,
        queue = %queue,
        job_id = id.0,
        outcome = ?outcome,
        "{JOB_CANCELLED}"
    );
}

pub(crate) fn retried_by_operator(queue: &QueueName, id: JobId, seen: crate::JobStatus) {
    tracing::info!(
        name: JOB_RETRIED_BY_OPERATOR,
        queue = %queue,
        job_id = id.0,
        was = seen.as_str(),
        "{JOB_RETRIED_BY_OPERATOR}"
    );
}

/// A queue paused (`true`) or resumed, for backends to emit when the change applied.
pub fn queue_paused(queue: &QueueName, paused: bool) {
    if paused {
        tracing::info!(name: QUEUE_PAUSED, queue = %queue, "{QUEUE_PAUSED}");
    } else {
        tracing::info!(name: QUEUE_RESUMED, queue = %queue, "{QUEUE_RESUMED}");
    }
}

pub(crate) fn scheduler_started(queue: &QueueName, schedules: usize) {
    tracing::info!(name: SCHEDULER_STARTED, queue = %queue, schedules, "{SCHEDULER_STARTED}");
}

pub(crate) fn scheduler_stopped(queue: &QueueName) {
    tracing::info!(name: SCHEDULER_STOPPED, queue = %queue, "{SCHEDULER_STOPPED}");
}

pub(crate) fn schedule_enqueued(
    queue: &QueueName,
    schedule: &str,
    period: chrono::DateTime<chrono::Utc>,
    id: JobId,
) {
    tracing::info!(
        name: SCHEDULE_ENQUEUED,
        queue = %queue,
        schedule,
        period = %period,
        job_id = id.0,
        duplicate = false,
        "{SCHEDULE_ENQUEUED}"
    );
}

pub(crate) fn schedule_found(
    queue: &QueueName,
    schedule: &str,
    period: chrono::DateTime<chrono::Utc>,
    id: JobId,
) {
    tracing::debug!(
        name: SCHEDULE_ENQUEUED,
        queue = %queue,
        schedule,
        period = %period,
        job_id = id.0,
        duplicate = true,
        "{SCHEDULE_ENQUEUED}: the period's job was already there"
    );
}

pub(crate) fn schedule_skipped(
    queue: &QueueName,
    schedule: &str,
    skipped: u64,
    after: chrono::DateTime<chrono::Utc>,
) {
    tracing::warn!(
        name: SCHEDULE_SKIPPED,
        queue = %queue,
        schedule,
        skipped,
        after = %after,
        "{SCHEDULE_SKIPPED}: missed periods left out, as the schedule's policy says"
    );
}

pub(crate) fn schedule_failed(queue: &QueueName, schedule: &str, error: &Error) {
    tracing::warn!(
        name: SCHEDULE_FAILED,
        queue = %queue,
        schedule,
        error = %error,
        transient = error.is_transient(),
        "{SCHEDULE_FAILED}: the periods stay due and are tried again"
    );
}

pub(crate) fn schedule_refused(
    queue: &QueueName,
    schedule: &str,
    period: chrono::DateTime<chrono::Utc>,
    error: &Error,
) {
    tracing::error!(
        name: SCHEDULE_REFUSED,
        queue = %queue,
        schedule,
        period = %period,
        error = %error,
        "{SCHEDULE_REFUSED}: the store cannot hold this period's job; the period is skipped"
    );
}

pub(crate) fn schedules_unrecorded(queue: &QueueName, error: &Error) {
    tracing::warn!(
        name: SCHEDULES_UNRECORDED,
        queue = %queue,
        error = %error,
        "{SCHEDULES_UNRECORDED}: the schedules run; operators see the last record until the next"
    );
}

pub(crate) fn retention_failed(queue: &QueueName, error: &Error) {
    tracing::warn!(
        name: RETENTION_FAILED,
        queue = %queue,
        error = %error,
        "{RETENTION_FAILED}: it runs again at its next interval"
    );
}

/// Logs [`QUEUE_LIMITS_SET`] (every backend's `Admin::set_limits`).
pub fn queue_limits_set(queue: &QueueName, limits: &crate::admin::QueueLimits) {
    tracing::info!(
        name: QUEUE_LIMITS_SET,
        queue = %queue,
        max_in_flight = limits.max_in_flight,
        rate_starts = limits.rate.map(|r| r.starts()),
        rate_per_ms = limits.rate.map(|r| r.per().as_millis() as u64),
        max_per_partition = limits.max_per_partition,
        partition_rate_starts = limits.rate_per_partition.map(|r| r.starts()),
        partition_rate_per_ms = limits.rate_per_partition.map(|r| r.per().as_millis() as u64),
        "{QUEUE_LIMITS_SET}"
    );
}

/// Logs [`ROOM_GRANTS_SET`] (a backend's switch of room grants, PostgreSQL's).
pub fn room_grants_set(queue: &QueueName, on: bool) {
    tracing::info!(name: ROOM_GRANTS_SET, queue = %queue, on, "{ROOM_GRANTS_SET}");
}

/// Jobs purged, for backends to emit after each batch.
pub fn jobs_purged(queue: &QueueName, deleted: u64) {
    tracing::info!(name: JOBS_PURGED, queue = %queue, deleted, "{JOBS_PURGED}");
}

pub(crate) fn cancel_requested(queue: &QueueName, claim: Claim) {
    tracing::info!(
        name: CANCEL_REQUESTED,
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        "{CANCEL_REQUESTED}: an operator asked to cancel the job; ending it"
    );
}

pub(crate) fn lease_lost(queue: &QueueName, claim: Claim) {
    tracing::warn!(
        name: LEASE_LOST,
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        "{LEASE_LOST}: another worker holds the job now; cancelling the handler"
    );
}

pub(crate) fn job_reclaimed(queue: &QueueName, job: &ClaimedJob) {
    tracing::info!(
        name: JOB_RECLAIMED,
        queue = %queue,
        job_id = job.id.0,
        generation = job.generation.0,
        reclaims = job.reclaims,
        "{JOB_RECLAIMED}"
    );
}

/// `error` is serde's message; it names the mismatch and where it is.
pub(crate) fn payload_malformed(queue: &QueueName, id: JobId, error: &str) {
    tracing::error!(
        name: PAYLOAD_MALFORMED,
        queue = %queue,
        job_id = id.0,
        error = %error,
        "{PAYLOAD_MALFORMED}: failing the job terminally; its payload stays in the row"
    );
}

/// A finalize of `jobs` outcomes failed and is tried again after `retry_in`.
pub(crate) fn finalize_retry(queue: &QueueName, jobs: usize, error: &Error, retry_in: Duration) {
    tracing::warn!(
        name: FINALIZE_RETRY,
        queue = %queue,
        jobs,
        error = %error,
        retry_in_ms = retry_in.as_millis() as u64,
        "{FINALIZE_RETRY}"
    );
}

/// A finalize failed for good; `claim` names the job when it was one.
pub(crate) fn finalize_failed(
    queue: &QueueName,
    claim: Option<Claim>,
    jobs: usize,
    error: &dyn std::fmt::Display,
) {
    tracing::error!(
        name: FINALIZE_FAILED,
        queue = %queue,
        job_id = claim.map(|c| c.id.0),
        generation = claim.map(|c| c.generation.0),
        jobs,
        error = %error,
        "{FINALIZE_FAILED}: the job stays in flight until its lease lapses"
    );
}

pub(crate) fn claim_failed(queue: &QueueName, error: &Error, retry_in: Duration) {
    tracing::warn!(
        name: CLAIM_FAILED,
        queue = %queue,
        error = %error,
        transient = error.is_transient(),
        retry_in_ms = retry_in.as_millis() as u64,
        "{CLAIM_FAILED}: backing off until claims work again"
    );
}

pub(crate) fn claim_released(queue: &QueueName, claim: Claim, reason: &str) {
    tracing::info!(
        name: CLAIM_RELEASED,
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        reason,
        "{CLAIM_RELEASED}"
    );
}

pub(crate) fn handler_panicked(queue: &QueueName, id: JobId, message: &str) {
    tracing::error!(
        name: HANDLER_PANICKED,
        queue = %queue,
        job_id = id.0,
        error = message,
        "{HANDLER_PANICKED}"
    );
}

pub(crate) fn handler_timed_out(queue: &QueueName, id: JobId, timeout: Duration) {
    tracing::warn!(
        name: HANDLER_TIMED_OUT,
        queue = %queue,
        job_id = id.0,
        timeout_ms = timeout.as_millis() as u64,
        "{HANDLER_TIMED_OUT}"
    );
}

pub(crate) fn heartbeat_failed(queue: &QueueName, claim: Claim, error: &Error) {
    tracing::warn!(
        name: HEARTBEAT_FAILED,
        queue = %queue,
        job_id = claim.id.0,
        error = %error,
        "{HEARTBEAT_FAILED}: tried again at the next tick"
    );
}

pub(crate) fn worker_stopped(queue: &QueueName, released: u64, finished: u64, aborted: u64) {
    tracing::info!(
        name: WORKER_STOPPED,
        queue = %queue,
        released_unstarted = released,
        finished_in_time = finished,
        aborted,
        "{WORKER_STOPPED}"
    );
}

#[cfg(test)]
pub(crate) mod capture {
    //! A subscriber that records event names, for tests that assert an event fired.

    use std::sync::{Arc, Mutex};

    use tracing::Subscriber;
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::{Context, SubscriberExt};

    #[derive(Clone, Default)]
    pub struct Captured(Arc<Mutex<Vec<String>>>);

    impl Captured {
        pub fn names(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }

        pub fn count(&self, name: &str) -> usize {
            self.names().iter().filter(|n| *n == name).count()
        }

        pub fn subscriber(&self) -> impl Subscriber + Send + Sync + 'static {
            // Tests run in parallel, each with a thread-local subscriber. A callsite first hit
            // where no subscriber listens caches "never" for every thread, and a test's own
            // subscriber then misses its events. A global subscriber interested in everything
            // (it records nothing) keeps every callsite's interest open.
            static GLOBAL: std::sync::Once = std::sync::Once::new();
            GLOBAL.call_once(|| {
                let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
            });
            tracing_subscriber::registry().with(self.clone())
        }
    }

    impl<S: Subscriber> Layer<S> for Captured {
        fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
            self.0
                .lock()
                .unwrap()
                .push(event.metadata().name().to_owned());
        }
    }
}
