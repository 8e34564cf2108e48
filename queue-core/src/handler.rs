//! Handlers and the typed intent they return.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::error::BoxError;
use crate::types::{Claim, ClaimGeneration, ClaimToken, ClaimedJob, JobId, QueueName};

/// The code that runs a job.
///
/// Return `Ok(())` when the job is done, or a [`JobError`] that says what should happen next:
/// retry under the [`crate::RetryPolicy`], retry after a given delay, fail terminally or cancel.
/// Any `std::error::Error` converts into a retryable `JobError` with `?`; use
/// [`ResultExt::fail`] for errors that retrying cannot fix.
///
/// ```
/// use queue_core::{Handler, JobContext, JobError, ResultExt};
/// use serde::Deserialize;
///
/// #[derive(Deserialize)]
/// struct Resize { width: u32 }
///
/// struct Resizer;
///
/// impl Handler for Resizer {
///     type Payload = Resize;
///     async fn handle(&self, ctx: JobContext, job: Resize) -> Result<(), JobError> {
///         if job.width == 0 {
///             return Err(JobError::fail("width 0 can never succeed"));
///         }
///         let parsed: u32 = "640".parse().fail()?; // a parse error is not worth a retry
///         std::fs::metadata("/").retry()?;      // an I/O error may pass
///         if ctx.cancellation().is_cancelled() {
///             return Err(JobError::retry("lease lost, stopping early"));
///         }
///         let _ = parsed;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The job's arguments, deserialised from the stored JSON payload. A payload that does not
    /// fit fails the job terminally with the event `queue.payload_malformed`; the row keeps the
    /// payload for inspection.
    type Payload: DeserializeOwned + Send + Sync + 'static;

    /// Runs one job.
    fn handle(
        &self,
        ctx: JobContext,
        payload: Self::Payload,
    ) -> impl Future<Output = Result<(), JobError>> + Send;

    /// Whether jobs of this handler may run longer than the lease allows. When true, the worker
    /// heartbeats (`extend_lease`) every third of the lease and the job timeout is not bounded by
    /// the lease; when a heartbeat finds the lease lost, the context's cancellation token fires.
    fn runs_long(&self) -> bool {
        false
    }
}

/// Why a handler's cancellation token fired ([`JobContext::cancel_reason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CancelReason {
    /// A heartbeat found the job held under a newer claim: the lease was lost.
    LeaseLost,
    /// Heartbeats have not applied for five sixths of the lease (the database is unreachable
    /// or too slow): the worker can no longer trust its lease.
    LeaseUntrusted,
    /// The worker is shutting down and its shutdown timeout passed.
    Shutdown,
    /// An operator asked to cancel the job: stop; an error returned now ends the job
    /// `cancelled`.
    CancelRequested,
}

/// A job's cancellation token together with why it fired: the runtime fires it, the handler's
/// [`JobContext`] reads it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cancel {
    token: CancellationToken,
    reason: Arc<OnceLock<CancelReason>>,
}

impl Cancel {
    /// Fires the token, recording `reason` unless an earlier one was recorded.
    pub(crate) fn fire(&self, reason: CancelReason) {
        let _ = self.reason.set(reason);
        self.token.cancel();
    }

    /// Why it fired, if it has.
    pub(crate) fn reason(&self) -> Option<CancelReason> {
        self.reason.get().copied()
    }
}

/// What a handler is told about the job it runs, and how it learns that it should stop.
#[derive(Debug, Clone)]
pub struct JobContext {
    queue: QueueName,
    id: JobId,
    generation: ClaimGeneration,
    token: ClaimToken,
    attempts: i32,
    reclaims: i32,
    claimed_at: DateTime<Utc>,
    cancellation: CancellationToken,
    cancel_reason: Arc<OnceLock<CancelReason>>,
    lease_deadline: Option<tokio::time::Instant>,
}

impl JobContext {
    /// The context of `job` in `queue`, cancelled through `cancellation`. The worker builds
    /// these; tests of a handler can too.
    pub fn new(queue: QueueName, job: &ClaimedJob, cancellation: CancellationToken) -> Self {
        JobContext {
            queue,
            id: job.id,
            generation: job.generation,
            token: job.token,
            attempts: job.attempts,
            reclaims: job.reclaims,
            claimed_at: job.claimed_at,
            cancellation,
            cancel_reason: Arc::default(),
            lease_deadline: None,
        }
    }

    /// The context of a job the runtime runs, cancelled through `cancel`.
    pub(crate) fn running(queue: QueueName, job: &ClaimedJob, cancel: &Cancel) -> Self {
        JobContext {
            cancel_reason: cancel.reason.clone(),
            ..JobContext::new(queue, job, cancel.token.clone())
        }
    }

    /// Sets the local estimate of when the lease ends (the worker measures it from just before
    /// the claim was sent, so it errs early).
    pub fn with_lease_deadline(mut self, deadline: tokio::time::Instant) -> Self {
        self.lease_deadline = Some(deadline);
        self
    }

    /// How much of the lease is left, by the local estimate; `Duration::MAX` when unknown (a
    /// context built by hand, or a heartbeating handler whose lease keeps moving). A handler
    /// about to make an external call that could outlive the lease should not start it: return
    /// [`JobError::release`] instead, so the job goes back unharmed.
    pub fn lease_remaining(&self) -> Duration {
        self.lease_deadline
            .map(|deadline| deadline.saturating_duration_since(tokio::time::Instant::now()))
            .unwrap_or(Duration::MAX)
    }

    /// The queue.
    pub fn queue(&self) -> &QueueName {
        &self.queue
    }

    /// The job's id.
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The generation of this claim: send it to downstream systems as a diagnostic, never use it
    /// as an idempotency key (it changes on every claim; use a key of the job's own).
    pub fn generation(&self) -> ClaimGeneration {
        self.generation
    }

    /// The fence token of this run.
    pub fn claim(&self) -> Claim {
        Claim {
            id: self.id,
            generation: self.generation,
            token: self.token,
        }
    }

    /// Claims so far, this one included.
    pub fn attempts(&self) -> i32 {
        self.attempts
    }

    /// Claims that took the job over from an expired lease.
    pub fn reclaims(&self) -> i32 {
        self.reclaims
    }

    /// When this claim was stamped, by the backend's clock.
    pub fn claimed_at(&self) -> DateTime<Utc> {
        self.claimed_at
    }

    /// Fires when the handler should stop: the lease was lost (a heartbeat came back stale),
    /// could no longer be trusted (heartbeats failed), or a shutdown deadline passed
    /// ([`JobContext::cancel_reason`] says which). Whatever the handler writes afterwards is fenced anyway; the
    /// token lets it stop spending effort, and stop external side effects that the fence cannot
    /// reach.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }

    /// Why the cancellation token fired, once it has: the lease was lost, could no longer be
    /// trusted, or the worker is shutting down. `None` while it has not fired (or when a
    /// context built by hand was cancelled by its owner).
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        self.cancel_reason.get().copied()
    }
}

/// What should happen after a failed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorAction {
    /// Retry under the worker's retry policy (backoff, max attempts).
    Retry,
    /// Retry after this delay (still bounded by max attempts).
    RetryAfter(Duration),
    /// Fail terminally now (the job ends `failed`).
    Fail,
    /// Cancel the job: it must not run again, and it did not fail.
    Cancel,
    /// Give the job back untouched (it did not run): `pending` at its place in line, the
    /// attempt not counted.
    Release,
    /// Run the job again after this delay without counting this run: no error is stored and
    /// `max_attempts` is not neared ([`JobError::snooze`]).
    Snooze(Duration),
}

/// A handler's failure, carrying the intent for what happens next.
pub struct JobError {
    action: ErrorAction,
    source: BoxError,
}

impl JobError {
    /// A failure with an explicit intent.
    pub fn new(action: ErrorAction, source: impl Into<BoxError>) -> Self {
        JobError {
            action,
            source: source.into(),
        }
    }

    /// A failure worth retrying under the retry policy.
    pub fn retry(source: impl Into<BoxError>) -> Self {
        JobError::new(ErrorAction::Retry, source)
    }

    /// A failure worth retrying after `delay`.
    pub fn retry_after(delay: Duration, source: impl Into<BoxError>) -> Self {
        JobError::new(ErrorAction::RetryAfter(delay), source)
    }

    /// A failure no retry can fix: the job ends `failed`.
    pub fn fail(source: impl Into<BoxError>) -> Self {
        JobError::new(ErrorAction::Fail, source)
    }

    /// The job should not run again (it became moot).
    pub fn cancel(reason: impl Into<BoxError>) -> Self {
        JobError::new(ErrorAction::Cancel, reason)
    }

    /// The job did not run and should go back as it was (for example: too little lease left to
    /// start an external call safely).
    pub fn release(reason: impl Into<BoxError>) -> Self {
        JobError::new(ErrorAction::Release, reason)
    }

    /// Not a failure: the job should run again after `delay`, this run not counted against
    /// `max_attempts` and no error stored (Oban's and River's "snooze"). For a job that waits on
    /// something outside it: a partner's rate window, a file that is not there yet. A job that
    /// snoozes forever never ends; bound it in the handler (its payload, or
    /// [`JobContext::attempts`] which snoozes leave unchanged, cannot count snoozes for you).
    ///
    /// ```
    /// use std::time::Duration;
    /// use queue_core::{ErrorAction, JobError};
    ///
    /// let later = JobError::snooze(Duration::from_secs(30));
    /// assert_eq!(later.action(), ErrorAction::Snooze(Duration::from_secs(30)));
    /// ```
    pub fn snooze(delay: Duration) -> Self {
        JobError::new(ErrorAction::Snooze(delay), "snoozed")
    }

    /// The intent.
    pub fn action(&self) -> ErrorAction {
        self.action
    }

    /// The underlying error.
    pub fn source_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobError")
            .field("action", &self.action)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

/// `?` on any standard error gives a retryable [`JobError`]. (Like `anyhow::Error`, `JobError`
/// does not implement `std::error::Error` itself, which is what makes this blanket conversion
/// possible.)
impl<E> From<E> for JobError
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn from(err: E) -> Self {
        JobError::retry(err)
    }
}

/// Marks the intent of an error at the point where it happens.
pub trait ResultExt<T> {
    /// The error is worth retrying under the retry policy.
    fn retry(self) -> Result<T, JobError>;
    /// The error is worth retrying after `delay`.
    fn retry_after(self, delay: Duration) -> Result<T, JobError>;
    /// The error cannot be fixed by retrying: the job ends `failed`.
    fn fail(self) -> Result<T, JobError>;
}

impl<T, E: Into<BoxError>> ResultExt<T> for Result<T, E> {
    fn retry(self) -> Result<T, JobError> {
        self.map_err(JobError::retry)
    }

    fn retry_after(self, delay: Duration) -> Result<T, JobError> {
        self.map_err(|e| JobError::retry_after(delay, e))
    }

    fn fail(self) -> Result<T, JobError> {
        self.map_err(JobError::fail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<u32, JobError> {
        Ok(s.parse::<u32>()?)
    }

    #[test]
    fn question_mark_defaults_to_retry_and_helpers_set_intent() {
        assert_eq!(parse("x").unwrap_err().action(), ErrorAction::Retry);
        let failed: Result<u32, JobError> = "x".parse::<u32>().fail();
        assert_eq!(failed.unwrap_err().action(), ErrorAction::Fail);
        let later: Result<(), JobError> = Err::<(), _>("busy").retry_after(Duration::from_secs(3));
        let err = later.unwrap_err();
        assert_eq!(
            err.action(),
            ErrorAction::RetryAfter(Duration::from_secs(3))
        );
        assert_eq!(err.to_string(), "busy");
        assert_eq!(JobError::cancel("moot").action(), ErrorAction::Cancel);
    }
}
