//! Running one claimed job: parse its payload, run the handler (with its timeout, panic capture
//! and heartbeat), turn the result into the fenced write to make, and hand that to the
//! finalizer.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use super::Shared;
use crate::backend::Backend;
use crate::events;
use crate::handler::{Cancel, CancelReason, ErrorAction, Handler, JobContext, JobError};
use crate::retry::RetryPolicy;
use crate::types::{
    CANCEL_REQUESTED_MESSAGE, Claim, ClaimedJob, Finalize, Heartbeat, RECLAIM_CAP_MESSAGE, RunAt,
};

/// The worker's own view of when a job's lease ends: from the instant the claim was sent, moved
/// by every applied heartbeat (from the instant it was sent), so that it errs early.
#[derive(Clone)]
pub(super) struct LeaseClock {
    lease: Duration,
    expires: Arc<Mutex<Instant>>,
}

impl LeaseClock {
    /// The lease of a claim sent at `sent`.
    pub(super) fn new(lease: Duration, sent: Instant) -> Self {
        LeaseClock {
            lease,
            expires: Arc::new(Mutex::new(sent + lease)),
        }
    }

    /// When the lease ends, by the local clock.
    pub(super) fn expires(&self) -> Instant {
        *self.expires.lock().expect("lease clock")
    }

    /// How much of the lease is left.
    pub(super) fn left(&self) -> Duration {
        self.expires().saturating_duration_since(Instant::now())
    }

    /// A heartbeat sent at `sent` applied: the lease runs anew from then.
    pub(super) fn renewed(&self, sent: Instant) {
        *self.expires.lock().expect("lease clock") = sent + self.lease;
    }
}

/// Runs one job to its outcome.
pub(super) async fn run_job<B: Backend, H: Handler>(
    shared: Arc<Shared<B, H>>,
    job: Arc<ClaimedJob>,
    cancel: Cancel,
    clock: LeaseClock,
) {
    let span = tracing::info_span!(
        "queue.job",
        queue = %shared.backend.queue(),
        job_id = job.id.0,
        attempt = job.attempts,
        generation = job.generation.0,
    );
    async move {
        let action = outcome_of(&shared, &job, cancel, &clock).await;
        let action = cancel_if_requested(&shared, &job, action).await;
        shared.finalizer.finish(&job, action, clock.expires()).await;
    }
    .instrument(span)
    .await
}

/// The fenced write a job's run leads to.
async fn outcome_of<B: Backend, H: Handler>(
    shared: &Arc<Shared<B, H>>,
    job: &ClaimedJob,
    cancel: Cancel,
    clock: &LeaseClock,
) -> Finalize {
    if job.over_reclaim_cap {
        // A poison job: its worker kept dying. Do not run it again; end it dead, fenced and with
        // the hooks, like any other terminal outcome.
        return Finalize::Dead {
            reason: RECLAIM_CAP_MESSAGE.to_owned(),
        };
    }
    if job.cancel_requested {
        // An operator asked an earlier holder to cancel it: do not run it.
        events::cancel_requested(shared.backend.queue(), job.claim());
        return Finalize::Cancel {
            reason: CANCEL_REQUESTED_MESSAGE.to_owned(),
        };
    }
    match crate::limits::parse_payload::<H::Payload>(&job.payload) {
        Err(err) => {
            // The error text names no payload value: payloads may carry secrets.
            let error = err.to_string();
            events::payload_malformed(shared.backend.queue(), job.id, &error);
            Finalize::Fail {
                error: format!("malformed payload: {error}"),
            }
        }
        Ok(payload) => {
            let result = run_handler(shared, job, payload, cancel.clone(), clock).await;
            match (cancel.reason(), result) {
                // Stopped on an operator's request: the job is cancelled, not retried.
                (Some(CancelReason::CancelRequested), Err(_)) => Finalize::Cancel {
                    reason: CANCEL_REQUESTED_MESSAGE.to_owned(),
                },
                (_, result) => decide(&shared.config.retry, job, result),
            }
        }
    }
}

/// Before a job goes back to `pending` (a retry, a release), asks the store whether an operator
/// requested its cancel meanwhile (a fenced heartbeat): then it ends `cancelled` instead.
async fn cancel_if_requested<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    job: &ClaimedJob,
    action: Finalize,
) -> Finalize {
    if !action.requeues() {
        return action;
    }
    // Bounded like a heartbeat: no answer within a sixth of the lease keeps the outcome.
    let renewal = shared.renewer.renew(job.claim());
    match tokio::time::timeout(shared.config.lease.duration() / 6, renewal).await {
        Ok(Ok(Heartbeat::CancelRequested)) => {
            events::cancel_requested(shared.backend.queue(), job.claim());
            Finalize::Cancel {
                reason: CANCEL_REQUESTED_MESSAGE.to_owned(),
            }
        }
        // Held: as decided. Lost or unanswered: the fenced write finds out.
        _ => action,
    }
}

/// Runs the handler under the job timeout, with panics caught and, for long runners, the
/// heartbeat.
async fn run_handler<B: Backend, H: Handler>(
    shared: &Arc<Shared<B, H>>,
    job: &ClaimedJob,
    payload: H::Payload,
    cancel: Cancel,
    clock: &LeaseClock,
) -> Result<(), JobError> {
    let queue = shared.backend.queue();
    let mut ctx = JobContext::running(queue.clone(), job, &cancel);
    if !shared.handler.runs_long() {
        ctx = ctx.with_lease_deadline(clock.expires());
    }
    // Caught in place rather than in a task of its own: a panic becomes a retryable error
    // without a spawn per job.
    let run = CatchUnwind(Box::pin(shared.handler.handle(ctx, payload)));
    let _heartbeat = shared.handler.runs_long().then(|| {
        let beat = heartbeat(shared.clone(), job.claim(), cancel, clock.clone());
        AbortOnDrop(tokio::spawn(beat))
    });
    let timeout = shared.config.job_timeout;
    let started = tokio::time::Instant::now();
    let ran = tokio::time::timeout(timeout, run).await;
    shared.metrics.ran(started.elapsed());
    match ran {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => {
            let message = panic_message(&*panic);
            events::handler_panicked(queue, job.id, &message);
            Err(JobError::retry(format!("handler panicked: {message}")))
        }
        Err(_) => {
            events::handler_timed_out(queue, job.id, timeout);
            Err(JobError::retry(format!(
                "handler timed out after {timeout:?}"
            )))
        }
    }
}

/// Aborts the wrapped task when dropped, so the heartbeat ends with its job.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Polls a future, turning a panic inside it into an error.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".to_owned())
}

/// Extends the lease every third of it. A stale heartbeat means the lease is lost; heartbeats
/// that have not applied for five sixths of the lease (two missed beats, and half a beat of
/// margin before the lease may expire) mean it can no longer be trusted. Either way the handler
/// is cancelled, told why.
async fn heartbeat<B: Backend, H: Handler>(
    shared: Arc<Shared<B, H>>,
    claim: Claim,
    cancel: Cancel,
    clock: LeaseClock,
) {
    let queue = shared.backend.queue();
    let lease = clock.lease;
    let every = lease / 3;
    let mut next_beat = Instant::now() + every;
    loop {
        let untrusted_at = clock.expires() - lease / 6;
        tokio::time::sleep_until(next_beat.min(untrusted_at)).await;
        if Instant::now() >= untrusted_at {
            let since = lease - clock.left().min(lease);
            events::lease_untrusted(queue, claim, since);
            cancel.fire(CancelReason::LeaseUntrusted);
            return;
        }
        let sent = Instant::now();
        next_beat = sent + every;
        let beat = shared.renewer.renew(claim);
        match tokio::time::timeout_at(untrusted_at, beat).await {
            Ok(Ok(Heartbeat::Held)) => clock.renewed(sent),
            Ok(Ok(Heartbeat::CancelRequested)) => {
                clock.renewed(sent);
                if cancel.reason().is_none() {
                    events::cancel_requested(queue, claim);
                    cancel.fire(CancelReason::CancelRequested);
                }
            }
            Ok(Ok(Heartbeat::Lost)) => {
                events::lease_lost(queue, claim);
                cancel.fire(CancelReason::LeaseLost);
                return;
            }
            Ok(Err(err)) => events::heartbeat_failed(queue, claim, &err),
            // Still unanswered when the lease stops being trusted: the loop's top says so.
            Err(_) => {}
        }
    }
}

/// Turns a handler result into the fenced write to make.
pub(super) fn decide(
    policy: &RetryPolicy,
    job: &ClaimedJob,
    result: Result<(), JobError>,
) -> Finalize {
    let err = match result {
        Ok(()) => return Finalize::Complete,
        Err(err) => err,
    };
    let previous = job.handler_errors();
    let error = err.to_string();
    match err.action() {
        ErrorAction::Fail => Finalize::Fail { error },
        ErrorAction::Cancel => Finalize::Cancel { reason: error },
        ErrorAction::Release => Finalize::Release,
        ErrorAction::Snooze(delay) => Finalize::Snooze {
            at: RunAt::After(delay),
        },
        ErrorAction::Retry | ErrorAction::RetryAfter(_) if policy.gives_up_after(previous) => {
            Finalize::Fail {
                error: format!(
                    "{error} (gave up after {} failing runs)",
                    previous.saturating_add(1)
                ),
            }
        }
        ErrorAction::Retry => Finalize::Retry {
            at: RunAt::After(policy.backoff(previous)),
            error,
        },
        ErrorAction::RetryAfter(delay) => Finalize::Retry {
            at: RunAt::After(delay),
            error,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ClaimGeneration, ClaimToken, JobId};

    fn job(attempts: i32, reclaims: i32) -> ClaimedJob {
        ClaimedJob {
            id: JobId(1),
            generation: ClaimGeneration(attempts as i64),
            token: ClaimToken(1),
            attempts,
            reclaims,
            taken_over: false,
            over_reclaim_cap: false,
            cancel_requested: false,
            claimed_at: chrono::Utc::now(),
            due_at: chrono::Utc::now(),
            priority: 0,
            payload: serde_json::Value::Null,
        }
    }

    #[test]
    fn decide_maps_intents_and_counts_handler_errors_only() {
        let policy = RetryPolicy {
            max_attempts: 3,
            jitter: false,
            ..RetryPolicy::default()
        };
        assert_eq!(decide(&policy, &job(1, 0), Ok(())), Finalize::Complete);
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::retry("x"))),
            Finalize::Retry {
                at: RunAt::After(d),
                ..
            } if d == Duration::from_secs(1)
        ));
        // Third failing run (two earlier errors) gives up.
        assert!(matches!(
            decide(&policy, &job(3, 0), Err(JobError::retry("x"))),
            Finalize::Fail { error } if error.contains("gave up after 3")
        ));
        // Same attempts, but two of them were lease takeovers: only one handler error so far.
        assert!(matches!(
            decide(&policy, &job(4, 2), Err(JobError::retry("x"))),
            Finalize::Retry { .. }
        ));
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::fail("no"))),
            Finalize::Fail { error } if error == "no"
        ));
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::cancel("moot"))),
            Finalize::Cancel { .. }
        ));
        assert_eq!(
            decide(&policy, &job(9, 0), Err(JobError::release("no lease left"))),
            Finalize::Release
        );
        // A snooze is not a handler error: not even past max_attempts does it fail the job.
        assert_eq!(
            decide(
                &policy,
                &job(9, 0),
                Err(JobError::snooze(Duration::from_secs(5)))
            ),
            Finalize::Snooze {
                at: RunAt::After(Duration::from_secs(5))
            }
        );
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::retry_after(Duration::from_secs(7), "later"))),
            Finalize::Retry { at: RunAt::After(d), .. } if d == Duration::from_secs(7)
        ));
    }
}
