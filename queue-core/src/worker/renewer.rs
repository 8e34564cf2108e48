//! The worker's lease renewals, many to a call: the heartbeats of long jobs, the renewals before
//! a buffered job starts and the cancel check before a requeue all ask one task, which sends
//! what is waiting as one [`Backend::extend_leases`] (one statement on PostgreSQL) instead of
//! one round trip per job. A renewal asked while a call is out waits for the next one, so no
//! timer delays it: under load the calls grow, idle each renewal goes alone.
//!
//! A call that does not return holds up only its own renewals: calls run side by side (at most
//! [`CALLS_IN_FLIGHT`]), each bounded by the time its askers wait. A claim whose row another
//! transaction holds is asked again alone, off the task, so that it holds up no other.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{Claim, Heartbeat, Lease};

/// The most claims one call renews.
const MOST_PER_CALL: usize = 1_000;

/// The most calls out at once: a call stuck on a dead connection leaves the others running.
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
    /// Starts the task renewing `lease` on `backend`; a call that has not answered within
    /// `patience` (the longest any asker waits) is given up and its askers told so.
    pub(super) fn start<B: Backend>(backend: B, lease: Lease, patience: Duration) -> Self {
        let (asks, received) = mpsc::unbounded_channel();
        tokio::spawn(serve(backend, lease, patience, received));
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
/// handle is gone.
async fn serve<B: Backend>(
    backend: B,
    lease: Lease,
    patience: Duration,
    mut received: mpsc::UnboundedReceiver<Ask>,
) {
    let calls = Arc::new(Semaphore::new(CALLS_IN_FLIGHT));
    let mut asks = Vec::new();
    loop {
        let Ok(permit) = calls.clone().acquire_owned().await else {
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
        tokio::spawn(async move {
            let _permit = permit;
            call(&backend, lease, patience, batch).await;
        });
    }
}

/// One call for `batch`, each asker answered.
async fn call<B: Backend>(backend: &B, lease: Lease, patience: Duration, batch: Vec<Ask>) {
    let claims: Vec<Claim> = batch.iter().map(|ask| ask.claim).collect();
    let answers = match tokio::time::timeout(patience, backend.extend_leases(&claims, lease)).await
    {
        Ok(Ok(answers)) if answers.len() == claims.len() => answers,
        Ok(Ok(answers)) => {
            let error = format!(
                "the store answered {} of {} renewals",
                answers.len(),
                claims.len()
            );
            return tell_all(batch, &error, false);
        }
        Ok(Err(err)) => return tell_all(batch, &err.to_string(), err.is_transient()),
        Err(_) => return tell_all(batch, "no answer to the renewals in time", true),
    };
    // One answer per claim; the same claim asked twice (a heartbeat and a cancel check) gets
    // the same answer.
    let mut busy = HashMap::new();
    for (ask, answer) in batch.into_iter().zip(answers) {
        match answer {
            Some(beat) => {
                let _ = ask.reply.send(Ok(beat));
            }
            None => busy
                .entry(ask.claim)
                .or_insert_with(Vec::new)
                .push(ask.reply),
        }
    }
    for (claim, replies) in busy {
        // Its row is locked by another transaction: ask alone (which waits for the lock), off
        // this call, so that the renewals after it go on.
        let backend = backend.clone();
        tokio::spawn(async move {
            let answer = tokio::time::timeout(patience, backend.extend_lease(claim, lease)).await;
            for reply in replies {
                let answer = match &answer {
                    Ok(Ok(beat)) => Ok(*beat),
                    Ok(Err(err)) => Err(Error::backend(err.to_string(), err.is_transient())),
                    Err(_) => Err(Error::backend("no answer to the renewal in time", true)),
                };
                let _ = reply.send(answer);
            }
        });
    }
}

/// Tells every asker of `batch` that the call failed with `error`.
fn tell_all(batch: Vec<Ask>, error: &str, transient: bool) {
    for ask in batch {
        let _ = ask
            .reply
            .send(Err(Error::backend(error.to_owned(), transient)));
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
        let renewer = Arc::new(Renewer::start(
            backend.clone(),
            Lease::DEFAULT,
            Duration::from_secs(10),
        ));
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
