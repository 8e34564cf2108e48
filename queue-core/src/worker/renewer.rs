//! The worker's lease renewals, many to a call: the heartbeats of long jobs, the renewals before
//! a buffered job starts and the cancel check before a requeue all ask one task, which sends
//! what is waiting as one [`Backend::extend_leases`] (one statement on PostgreSQL) instead of
//! one round trip per job. While [`CALLS_IN_FLIGHT`] calls are out, the renewals asked meanwhile
//! wait and go together in the next call: under load the calls grow, while quiet each renewal
//! goes at once, alone. No timer delays a renewal.
//!
//! A call stuck on a dead connection stops counting against that cap after a sixth of the lease
//! (the others go on in calls of their own), and is dropped once every asker it carries has
//! stopped waiting, or after five sixths of the lease at most. A claim whose row another
//! transaction holds is asked again alone, beside the calls. Everything the task started ends
//! with it, when the worker's last handle on it is dropped.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{Claim, Heartbeat, Lease};

/// The most claims one call renews.
const MOST_PER_CALL: usize = 1_000;

/// The most calls out at once that are younger than a sixth of the lease.
const CALLS_IN_FLIGHT: usize = 4;

/// One renewal asked: the claim, and where its answer goes.
struct Ask {
    claim: Claim,
    reply: oneshot::Sender<Result<Heartbeat>>,
}

/// The handle the worker's tasks renew leases through; the task ends when every handle is
/// dropped.
pub(super) struct Renewer {
    asks: mpsc::UnboundedSender<Ask>,
}

impl Renewer {
    /// Starts the task renewing `lease` on `backend`.
    pub(super) fn start<B: Backend>(backend: B, lease: Lease) -> Self {
        let (asks, received) = mpsc::unbounded_channel();
        tokio::spawn(serve(backend, lease, received));
        Renewer { asks }
    }

    /// The claim's heartbeat, sent with whatever other renewals are waiting.
    pub(super) async fn renew(&self, claim: Claim) -> Result<Heartbeat> {
        let (reply, answer) = oneshot::channel();
        if self.asks.send(Ask { claim, reply }).is_err() {
            return Err(Error::Shutdown);
        }
        answer.await.unwrap_or(Err(Error::Shutdown))
    }
}

/// Takes what is waiting, up to [`MOST_PER_CALL`], and sends it as one call, until every
/// handle is gone; then ends every call still out.
async fn serve<B: Backend>(backend: B, lease: Lease, mut received: mpsc::UnboundedReceiver<Ask>) {
    let young = Arc::new(Semaphore::new(CALLS_IN_FLIGHT));
    let mut calls = JoinSet::new();
    let mut asks = Vec::new();
    loop {
        while calls.try_join_next().is_some() {}
        let Ok(permit) = young.clone().acquire_owned().await else {
            return;
        };
        if received.recv_many(&mut asks, MOST_PER_CALL).await == 0 {
            return;
        }
        // An asker that stopped waiting (its own timeout) needs no renewal.
        asks.retain(|ask: &Ask| !ask.reply.is_closed());
        if asks.is_empty() {
            continue;
        }
        let batch = std::mem::take(&mut asks);
        let backend = backend.clone();
        calls.spawn(async move {
            let lease_length = lease.duration();
            let work = call(&backend, lease, batch);
            tokio::pin!(work);
            tokio::select! {
                () = &mut work => return,
                () = tokio::time::sleep(lease_length / 6) => {}
            }
            // Slow: no longer counted against the cap, so that the renewals after it go on.
            drop(permit);
            work.await;
        });
    }
}

/// One call for `batch`, each asker answered; a claim whose row was busy asked again alone.
/// Dropped once no asker waits any more, and given up after five sixths of the lease (no
/// asker waits longer).
async fn call<B: Backend>(backend: &B, lease: Lease, mut batch: Vec<Ask>) {
    let patience = lease.duration() - lease.duration() / 6;
    let deadline = tokio::time::Instant::now() + patience;
    let claims: Vec<Claim> = batch.iter().map(|ask| ask.claim).collect();
    let answered = tokio::select! {
        answered = tokio::time::timeout_at(deadline, backend.extend_leases(&claims, lease)) => answered,
        () = all_gone(&mut batch) => return,
    };
    let answers = match answered {
        Ok(Ok(answers)) if answers.len() == claims.len() => answers,
        Ok(Ok(answers)) => {
            let error = Error::backend(
                format!(
                    "the store answered {} of {} renewals",
                    answers.len(),
                    claims.len()
                ),
                false,
            );
            return tell_all(batch, &error);
        }
        Ok(Err(err)) => return tell_all(batch, &err),
        Err(_) => {
            let error = Error::backend("no answer to the renewals in time", true);
            return tell_all(batch, &error);
        }
    };
    // One answer per claim; the same claim asked twice (a heartbeat and a cancel check) gets
    // the same answer.
    let mut busy: HashMap<Claim, Vec<Ask>> = HashMap::new();
    for (ask, answer) in batch.into_iter().zip(answers) {
        match answer {
            Some(beat) => {
                let _ = ask.reply.send(Ok(beat));
            }
            None => busy.entry(ask.claim).or_default().push(ask),
        }
    }
    // Rows another transaction holds: each asked alone (which waits for its lock), side by
    // side, each dropped once its askers stopped waiting.
    let mut alone = JoinSet::new();
    for (claim, mut asks) in busy {
        let backend = backend.clone();
        alone.spawn(async move {
            let answered = tokio::select! {
                answered = tokio::time::timeout_at(deadline, backend.extend_lease(claim, lease)) => answered,
                () = all_gone(&mut asks) => return,
            };
            match answered {
                Ok(Ok(beat)) => {
                    for ask in asks {
                        let _ = ask.reply.send(Ok(beat));
                    }
                }
                Ok(Err(err)) => tell_all(asks, &err),
                Err(_) => tell_all(asks, &Error::backend("no answer to the renewal in time", true)),
            }
        });
    }
    alone.join_all().await;
}

/// Returns once every asker of `asks` has stopped waiting.
async fn all_gone(asks: &mut [Ask]) {
    for ask in asks {
        ask.reply.closed().await;
    }
}

/// Tells every asker of `batch` that the call failed with `error`.
fn tell_all(batch: Vec<Ask>, error: &Error) {
    for ask in batch {
        let _ = ask.reply.send(Err(same_error(error)));
    }
}

/// An error like `error` for one more asker (an error is not `Clone`): a backend error keeps
/// its driver's text and whether it is transient.
fn same_error(error: &Error) -> Error {
    match error {
        Error::Backend { source, transient } => Error::backend(source.to_string(), *transient),
        Error::Shutdown => Error::Shutdown,
        other => Error::backend(other.to_string(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobStatus;
    use crate::memory::MemoryBackend;
    use crate::types::{ClaimRequest, NewJob};

    /// Many renewals asked at once are answered, each for its own claim and fenced: a claim of
    /// another generation is lost, a job an operator asked to cancel says so.
    #[tokio::test]
    async fn renewals_asked_together_get_their_own_answers() {
        let backend = MemoryBackend::new();
        for n in 0..50 {
            backend.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
        }
        let jobs = backend
            .claim(ClaimRequest::new(50, Lease::DEFAULT))
            .await
            .unwrap()
            .jobs;
        backend.cancel(jobs[7].id).await.unwrap();
        let renewer = Arc::new(Renewer::start(backend.clone(), Lease::DEFAULT));
        let mut asks = tokio::task::JoinSet::new();
        for (n, job) in jobs.iter().enumerate() {
            let renewer = renewer.clone();
            let mut claim = job.claim();
            if n == 3 {
                claim.generation.0 += 1;
            }
            asks.spawn(async move { (n, renewer.renew(claim).await.unwrap()) });
        }
        let mut answers: Vec<(usize, Heartbeat)> = asks.join_all().await;
        answers.sort_by_key(|(n, _)| *n);
        for (n, beat) in answers {
            let expected = match n {
                3 => Heartbeat::Lost,
                7 => Heartbeat::CancelRequested,
                _ => Heartbeat::Held,
            };
            assert_eq!(beat, expected, "job {n}");
        }
        assert_eq!(
            backend.get(jobs[0].id).await.unwrap().unwrap().status,
            JobStatus::InFlight
        );
    }

    /// Once every handle is dropped, the task ends; a renewal asked of a handle whose task is
    /// gone is told the worker shut down.
    #[tokio::test]
    async fn a_renewal_after_the_task_ended_is_told_so() {
        let (asks, received) = mpsc::unbounded_channel::<Ask>();
        drop(received);
        let renewer = Renewer { asks };
        let claim = Claim {
            id: crate::types::JobId(1),
            generation: crate::types::ClaimGeneration(1),
            token: crate::types::ClaimToken(1),
        };
        assert!(matches!(renewer.renew(claim).await, Err(Error::Shutdown)));
    }
}
