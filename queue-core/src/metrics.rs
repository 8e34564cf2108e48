//! The metrics the framework records through the [`metrics`](https://docs.rs/metrics) facade,
//! each under a stable name with a `queue` label.
//!
//! `queue-core` records and never exports: install a recorder in your binary (the Prometheus
//! exporter, `metrics-exporter-prometheus`, serves them on `/metrics`) **before** starting
//! workers or opening queues, which take their metric handles when they start. Without a
//! recorder, recording costs next to nothing. `docs/operations.md` lists them with alert rules.
//!
//! Counters count what was written: an outcome is counted once the fence applied it, a fenced
//! write as `queue_finalize_stale_total`, never both.

use std::time::Duration;

use ::metrics::{Counter, Gauge, Histogram};

use crate::types::{Finalize, FinalizeOutcome, QueueName};

/// The label every metric carries: the queue's name.
pub const QUEUE_LABEL: &str = "queue";

/// Jobs written by enqueue calls that returned `Ok`, duplicates of a held unique key left out
/// (counter). An enqueue in a caller's transaction counts when its statement succeeds, whether
/// or not the caller then commits.
pub const JOBS_ENQUEUED: &str = "queue_jobs_enqueued_total";
/// Jobs claimed by workers (counter).
pub const JOBS_CLAIMED: &str = "queue_jobs_claimed_total";
/// Claims that took a job over from an expired lease: its worker died, hung or lost the
/// database (counter).
pub const JOBS_RECLAIMED: &str = "queue_jobs_reclaimed_total";
/// Jobs completed (counter).
pub const JOBS_COMPLETED: &str = "queue_jobs_completed_total";
/// Jobs failed terminally (counter).
pub const JOBS_FAILED: &str = "queue_jobs_failed_total";
/// Jobs scheduled for another attempt after a handler error (counter).
pub const JOBS_RETRIED: &str = "queue_jobs_retried_total";
/// Claims given back unstarted or aborted (counter).
pub const JOBS_RELEASED: &str = "queue_jobs_released_total";
/// Jobs their handler snoozed: due again later, the run not counted as an attempt (counter).
pub const JOBS_SNOOZED: &str = "queue_jobs_snoozed_total";
/// Jobs cancelled by their holder: by the handler, or on an operator's request (counter).
pub const JOBS_CANCELLED: &str = "queue_jobs_cancelled_total";
/// Jobs ended `dead`: past the reclaim cap, or after a finalize hook kept failing (counter).
pub const JOBS_DEAD: &str = "queue_jobs_dead_total";
/// Lease-holder writes refused by the generation fence: a worker that had lost its job
/// (counter). Each one is a run whose outcome was thrown away; a steady rate means leases are
/// too short for the handlers.
pub const FINALIZE_STALE: &str = "queue_finalize_stale_total";
/// Outcomes that could not be written before their lease deadline: the job runs again after
/// its lease (counter).
pub const FINALIZE_ERRORS: &str = "queue_finalize_errors_total";
/// Outcomes whose commit result was lost and the job moved on: written or not, nobody can tell
/// (counter).
pub const FINALIZE_UNKNOWN: &str = "queue_finalize_unknown_total";
/// Finalize hook failures, each try counted (counter).
pub const HOOK_FAILURES: &str = "queue_hook_failures_total";
/// Claim statements that failed (counter).
pub const CLAIM_FAILURES: &str = "queue_claim_failures_total";
/// Claims of a queue with limits that ran again under the queue's lock (counter): on
/// PostgreSQL, a claim ahead of the lock that found the limits used up by the claims that
/// committed while it ran, or a claim that waited for the lock and found its snapshot stale.
/// Each is a claim's work done twice; a steady share of the claims means the queue's claimers
/// take turns (several workers on a limit near binding).
pub const LIMITED_CLAIMS_RERUN: &str = "queue_limited_claims_rerun_total";
/// The round trip of a claim statement, in seconds (histogram).
pub const CLAIM_DURATION: &str = "queue_claim_duration_seconds";
/// The round trip of a finalize (one job with its hooks, or one batch), in seconds
/// (histogram).
pub const FINALIZE_DURATION: &str = "queue_finalize_duration_seconds";
/// How long handlers ran, in seconds (histogram).
pub const JOB_RUN_DURATION: &str = "queue_job_run_duration_seconds";
/// From when a job was due to when a claim took it, by the database's clock, in seconds;
/// takeovers left out (histogram). The queue's lag as the workers see it.
pub const JOB_START_LAG: &str = "queue_job_start_lag_seconds";
/// Periods whose job a scheduler enqueued, labelled `queue` and `schedule` (counter).
pub const SCHEDULE_ENQUEUED: &str = "queue_schedule_enqueued_total";
/// Periods a scheduler left out: missed past its policy, or refused by the store, labelled
/// `queue` and `schedule` (counter).
pub const SCHEDULE_SKIPPED: &str = "queue_schedule_skipped_total";
/// The label naming a schedule.
pub const SCHEDULE_LABEL: &str = "schedule";
/// Handlers running now in this process (gauge).
pub const JOBS_IN_FLIGHT: &str = "queue_jobs_in_flight";

/// Every metric's name, for documentation and tests.
pub const ALL: [&str; 23] = [
    JOBS_ENQUEUED,
    JOBS_CLAIMED,
    JOBS_RECLAIMED,
    JOBS_COMPLETED,
    JOBS_FAILED,
    JOBS_RETRIED,
    JOBS_RELEASED,
    JOBS_SNOOZED,
    JOBS_CANCELLED,
    JOBS_DEAD,
    FINALIZE_STALE,
    FINALIZE_ERRORS,
    FINALIZE_UNKNOWN,
    HOOK_FAILURES,
    CLAIM_FAILURES,
    LIMITED_CLAIMS_RERUN,
    CLAIM_DURATION,
    FINALIZE_DURATION,
    JOB_RUN_DURATION,
    JOB_START_LAG,
    JOBS_IN_FLIGHT,
    SCHEDULE_ENQUEUED,
    SCHEDULE_SKIPPED,
];

/// Counts `jobs` newly written to `queue` by an enqueue ([`JOBS_ENQUEUED`]): what backends call
/// after an enqueue statement succeeded.
pub fn record_enqueued(queue: &QueueName, jobs: u64) {
    if jobs > 0 {
        ::metrics::counter!(JOBS_ENQUEUED, QUEUE_LABEL => queue.as_str().to_owned())
            .increment(jobs);
    }
}

/// Counts a claim of a limited `queue` that runs again under the queue's lock
/// ([`LIMITED_CLAIMS_RERUN`]): what backends call when they send it again.
pub fn record_limited_claim_rerun(queue: &QueueName) {
    ::metrics::counter!(LIMITED_CLAIMS_RERUN, QUEUE_LABEL => queue.as_str().to_owned())
        .increment(1);
}

/// Counts a scheduler's pass of one schedule: periods enqueued, and periods refused.
pub(crate) fn record_schedule(queue: &QueueName, schedule: &str, enqueued: u64, refused: u64) {
    let labels = || {
        [
            (QUEUE_LABEL, queue.as_str().to_owned()),
            (SCHEDULE_LABEL, schedule.to_owned()),
        ]
    };
    if enqueued > 0 {
        ::metrics::counter!(SCHEDULE_ENQUEUED, &labels()).increment(enqueued);
    }
    if refused > 0 {
        ::metrics::counter!(SCHEDULE_SKIPPED, &labels()).increment(refused);
    }
}

/// Counts periods a schedule skipped as its policy says.
pub(crate) fn record_schedule_skipped(queue: &QueueName, schedule: &str, skipped: u64) {
    record_schedule(queue, schedule, 0, skipped);
}

/// One queue's metric handles, taken once (a worker at its start, a backend handle when
/// opened), so that recording is an atomic add.
#[derive(Clone)]
pub(crate) struct QueueMetrics {
    claimed: Counter,
    reclaimed: Counter,
    completed: Counter,
    failed: Counter,
    retried: Counter,
    released: Counter,
    snoozed: Counter,
    cancelled: Counter,
    dead: Counter,
    stale: Counter,
    finalize_errors: Counter,
    finalize_unknown: Counter,
    hook_failures: Counter,
    claim_failures: Counter,
    claim_duration: Histogram,
    finalize_duration: Histogram,
    run_duration: Histogram,
    start_lag: Histogram,
    in_flight: Gauge,
}

impl QueueMetrics {
    pub(crate) fn new(queue: &QueueName) -> Self {
        let label = || [(QUEUE_LABEL, queue.as_str().to_owned())];
        QueueMetrics {
            claimed: ::metrics::counter!(JOBS_CLAIMED, &label()),
            reclaimed: ::metrics::counter!(JOBS_RECLAIMED, &label()),
            completed: ::metrics::counter!(JOBS_COMPLETED, &label()),
            failed: ::metrics::counter!(JOBS_FAILED, &label()),
            retried: ::metrics::counter!(JOBS_RETRIED, &label()),
            released: ::metrics::counter!(JOBS_RELEASED, &label()),
            snoozed: ::metrics::counter!(JOBS_SNOOZED, &label()),
            cancelled: ::metrics::counter!(JOBS_CANCELLED, &label()),
            dead: ::metrics::counter!(JOBS_DEAD, &label()),
            stale: ::metrics::counter!(FINALIZE_STALE, &label()),
            finalize_errors: ::metrics::counter!(FINALIZE_ERRORS, &label()),
            finalize_unknown: ::metrics::counter!(FINALIZE_UNKNOWN, &label()),
            hook_failures: ::metrics::counter!(HOOK_FAILURES, &label()),
            claim_failures: ::metrics::counter!(CLAIM_FAILURES, &label()),
            claim_duration: ::metrics::histogram!(CLAIM_DURATION, &label()),
            finalize_duration: ::metrics::histogram!(FINALIZE_DURATION, &label()),
            run_duration: ::metrics::histogram!(JOB_RUN_DURATION, &label()),
            start_lag: ::metrics::histogram!(JOB_START_LAG, &label()),
            in_flight: ::metrics::gauge!(JOBS_IN_FLIGHT, &label()),
        }
    }

    pub(crate) fn claim(&self, took: Duration) {
        self.claim_duration.record(took.as_secs_f64());
    }

    pub(crate) fn claim_failed(&self) {
        self.claim_failures.increment(1);
    }

    /// A claimed job: a takeover, or a fresh claim `lag` after it was due.
    pub(crate) fn claimed(&self, taken_over: bool, lag: chrono::TimeDelta) {
        self.claimed.increment(1);
        if taken_over {
            self.reclaimed.increment(1);
        } else {
            self.start_lag
                .record(lag.to_std().unwrap_or(Duration::ZERO).as_secs_f64());
        }
    }

    pub(crate) fn started(&self) {
        self.in_flight.increment(1.0);
    }

    pub(crate) fn stopped(&self) {
        self.in_flight.decrement(1.0);
    }

    pub(crate) fn ran(&self, took: Duration) {
        self.run_duration.record(took.as_secs_f64());
    }

    pub(crate) fn finalize(&self, took: Duration) {
        self.finalize_duration.record(took.as_secs_f64());
    }

    pub(crate) fn written(&self, action: &Finalize, outcome: FinalizeOutcome) {
        let counter = match (outcome, action) {
            (FinalizeOutcome::Stale, _) => &self.stale,
            (_, Finalize::Complete) => &self.completed,
            (_, Finalize::Retry { .. }) => &self.retried,
            (_, Finalize::Fail { .. }) => &self.failed,
            (_, Finalize::Cancel { .. }) => &self.cancelled,
            (_, Finalize::Release) => &self.released,
            (_, Finalize::Snooze { .. }) => &self.snoozed,
            (_, Finalize::Dead { .. }) => &self.dead,
        };
        counter.increment(1);
    }

    pub(crate) fn stale(&self) {
        self.stale.increment(1);
    }

    pub(crate) fn unknown(&self) {
        self.finalize_unknown.increment(1);
    }

    pub(crate) fn finalize_failed(&self, jobs: u64) {
        self.finalize_errors.increment(jobs);
    }

    pub(crate) fn hook_failed(&self) {
        self.hook_failures.increment(1);
    }
}
