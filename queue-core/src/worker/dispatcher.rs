//! The dispatcher: claims jobs while slots are free, buffers what a claim returned, starts
//! buffered jobs as handlers finish, wakes on a backend signal or the poll interval, and backs
//! off while claims fail.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::{Id, JoinError, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::runner::{LeaseClock, run_job};
use crate::backend::Backend;
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::events;
use crate::handler::{Cancel, Handler};
use crate::types::{
    CANCEL_REQUESTED_MESSAGE, ClaimBatch, ClaimRequest, ClaimedJob, Finalize, Heartbeat,
};

/// The longest pause between two claims while they fail.
const LONGEST_CLAIM_PAUSE: Duration = Duration::from_secs(30);

/// A claimed job waiting for a free slot, with when its lease started (measured locally before
/// the claim was sent, so the estimate errs on the short side).
pub(super) struct Buffered {
    pub(super) job: ClaimedJob,
    pub(super) lease_started: Instant,
}

/// A job being run, as the dispatcher keeps it: the job (to release it if its task is aborted)
/// and the token that asks its handler to stop.
pub(super) struct Running {
    pub(super) job: Arc<ClaimedJob>,
    pub(super) cancel: Cancel,
}

/// What a claim in flight resolves to: how many jobs it asked for, when it was sent, and what
/// came back. The dispatcher keeps starting buffered jobs while it runs.
pub(super) type ClaimInFlight =
    Pin<Box<dyn Future<Output = (u32, Instant, Result<ClaimBatch>)> + Send>>;

type Wake = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Claims while they fail: how many in a row, since when, and when to try again.
struct Outage {
    failures: u32,
    since: Instant,
    backoff: Backoff,
    retry_at: Instant,
}

pub(super) struct Dispatcher<B: Backend, H: Handler> {
    pub(super) shared: Arc<Shared<B, H>>,
    pub(super) buffer: VecDeque<Buffered>,
    pub(super) running: JoinSet<()>,
    pub(super) owners: HashMap<Id, Running>,
    pub(super) claiming: Option<ClaimInFlight>,
    /// Whether work may be waiting: at start, after a full batch, a wake-up or a poll tick.
    poll_due: bool,
    /// Claim again once this many slots are free (or when idle): many small claims cost a
    /// round trip and a commit each, one larger claim costs little more.
    refill_at: usize,
    outage: Option<Outage>,
    /// The worker's stats, watched for outcomes written: after a claim that came back short
    /// (the queue ran dry, or its limits held jobs back), each outcome may free room under the
    /// queue's limits, so it makes a claim due, without waiting for the poll.
    outcomes: tokio::sync::watch::Receiver<crate::worker::WorkerStats>,
    /// Whether the last claim came back with fewer jobs than it asked for.
    short: bool,
    /// The outcomes written when the dispatcher last looked.
    finished_seen: u64,
    /// The outcomes written when the claim in flight was sent.
    finished_at_claim: u64,
}

impl<B: Backend, H: Handler> Dispatcher<B, H> {
    pub(super) fn new(shared: Arc<Shared<B, H>>) -> Self {
        let config = &shared.config;
        let refill_at = (config.slots().min(config.max_batch as usize) / 2).max(1);
        let outcomes = shared.stats.subscribe();
        Dispatcher {
            outcomes,
            short: false,
            finished_seen: 0,
            finished_at_claim: 0,
            shared,
            buffer: VecDeque::new(),
            running: JoinSet::new(),
            owners: HashMap::new(),
            claiming: None,
            poll_due: true,
            refill_at,
            outage: None,
        }
    }

    /// Claims and runs jobs until `stop` fires. A claim still in flight then stays in
    /// `claiming`, for shutdown to receive within its deadline.
    pub(super) async fn run(&mut self, stop: &CancellationToken) {
        let wake = self.shared.backend.wake_signal();
        let mut woken = arm_wake(&wake);
        let poll = tokio::time::sleep(self.shared.config.poll_interval);
        tokio::pin!(poll);
        loop {
            self.start_buffered();
            if stop.is_cancelled() {
                return;
            }
            self.claim_if_room();
            // While claims fail, the next try waits for the outage's pause, not the poll.
            if let Some(outage) = &self.outage
                && poll.deadline() != outage.retry_at
            {
                poll.as_mut().reset(outage.retry_at);
            }
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                (want, sent, result) = async { self.claiming.as_mut().expect("guarded").await },
                    if self.claiming.is_some() =>
                {
                    self.claiming = None;
                    self.accept(want, sent, result);
                }
                Some(joined) = self.running.join_next_with_id(), if !self.running.is_empty() => {
                    self.reap(joined);
                }
                _ = &mut woken => {
                    woken = arm_wake(&wake);
                    self.poll_due = true;
                }
                Ok(()) = self.outcomes.changed(), if self.short && !self.poll_due => {
                    let finished = self.outcomes.borrow_and_update().finished();
                    if finished > self.finished_seen {
                        self.finished_seen = finished;
                        self.poll_due = true;
                    }
                }
                _ = &mut poll => {
                    poll.as_mut().reset(Instant::now() + self.shared.config.poll_interval);
                    self.poll_due = true;
                }
            }
        }
    }

    /// Sends a claim when work may be waiting, enough slots are free, and no outage's pause is
    /// running.
    fn claim_if_room(&mut self) {
        if self.claiming.is_some() || !self.poll_due {
            return;
        }
        if self
            .outage
            .as_ref()
            .is_some_and(|o| Instant::now() < o.retry_at)
        {
            return;
        }
        let config = &self.shared.config;
        let held = self.running.len() + self.buffer.len();
        let capacity = config.slots().saturating_sub(held);
        if capacity < self.refill_at && !(held == 0 && capacity > 0) {
            return;
        }
        let want = capacity.min(config.max_batch as usize) as u32;
        let request = ClaimRequest::new(want, config.lease)
            .max_reclaims(config.max_reclaims)
            .holder(config.name.as_str());
        let shared = self.shared.clone();
        self.poll_due = false;
        self.finished_at_claim = self.outcomes.borrow().finished();
        self.claiming = Some(Box::pin(async move {
            let sent = Instant::now();
            (want, sent, shared.finalizer.claim(request).await)
        }));
    }

    /// Buffers what a claim returned. A full batch means more work is likely waiting: claim
    /// again as soon as there is room. A failed claim starts (or continues) an outage: one
    /// warning, then pauses doubling from the poll interval to 30 s, and one info at recovery.
    pub(super) fn accept(&mut self, want: u32, sent: Instant, result: Result<ClaimBatch>) {
        let queue = self.shared.backend.queue();
        self.shared.stats.send_modify(|s| s.claim_passes += 1);
        let batch = match result {
            Ok(batch) => batch,
            Err(err) => {
                self.shared.metrics.claim_failed();
                self.shared.stats.send_modify(|s| s.claim_failures += 1);
                let outage = self.outage.get_or_insert_with(|| Outage {
                    failures: 0,
                    since: sent,
                    backoff: Backoff::new(self.shared.config.poll_interval, LONGEST_CLAIM_PAUSE),
                    retry_at: sent,
                });
                let pause = outage.backoff.pause();
                outage.failures += 1;
                outage.retry_at = Instant::now() + pause;
                if outage.failures == 1 {
                    events::claim_failed(queue, &err, pause);
                }
                self.poll_due = true;
                return;
            }
        };
        if let Some(outage) = self.outage.take() {
            events::claim_recovered(queue, outage.failures, outage.since.elapsed());
        }
        self.shared.metrics.claim(sent.elapsed());
        let got = batch.jobs.len();
        self.shared.stats.send_modify(|s| s.claimed += got as u64);
        for job in batch.jobs {
            self.shared
                .metrics
                .claimed(job.taken_over, job.claimed_at - job.due_at);
            if job.taken_over {
                events::job_reclaimed(queue, &job);
            }
            self.buffer.push_back(Buffered {
                job,
                lease_started: sent,
            });
        }
        // A wake-up that came while the claim ran stays due: its job may be newer than the
        // claim's snapshot.
        self.poll_due |= got == want as usize;
        self.short = got < want as usize;
        self.finished_seen = self.outcomes.borrow_and_update().finished();
        // An outcome written while the claim ran may have freed room the claim did not see.
        self.poll_due |= self.short && self.finished_seen > self.finished_at_claim;
    }

    /// Starts buffered jobs while slots are free, each only while the worker knows it still
    /// holds the job's lease with enough left; gives back those it cannot vouch for.
    fn start_buffered(&mut self) {
        let config = &self.shared.config;
        while self.running.len() < config.concurrency {
            let Some(next) = self.buffer.pop_front() else {
                return;
            };
            let clock = LeaseClock::new(config.lease.duration(), next.lease_started);
            let cancel = Cancel::default();
            let job = Arc::new(next.job);
            let shared = self.shared.clone();
            let (for_task, cancel_for_task) = (job.clone(), cancel.clone());
            // The check before the start runs in the job's own task: a database slow to
            // answer it holds one slot, never the dispatcher (claims, reaping, shutdown).
            let run = async move {
                if still_held(&shared, &for_task, &clock).await {
                    shared.stats.send_modify(|s| s.started += 1);
                    shared.metrics.started();
                    let metrics = shared.metrics.clone();
                    run_job(shared, for_task, cancel_for_task, clock).await;
                    metrics.stopped();
                }
            };
            let task = self.running.spawn(run);
            self.owners.insert(task.id(), Running { job, cancel });
        }
    }

    /// Forgets a job task that ended; returns its job if the task ended abnormally.
    pub(super) fn reap(&mut self, joined: Result<(Id, ()), JoinError>) -> Option<Arc<ClaimedJob>> {
        let id = match &joined {
            Ok((id, ())) => *id,
            Err(err) => err.id(),
        };
        let owner = self.owners.remove(&id)?;
        let Err(err) = joined else {
            return None;
        };
        if !err.is_cancelled() {
            // run_job catches handler panics itself; reaching here means the finalize path
            // panicked.
            let error = format!("job task ended abnormally: {err}");
            let queue = self.shared.backend.queue();
            events::finalize_failed(queue, Some(owner.job.claim()), 1, &error);
        }
        Some(owner.job)
    }
}

/// Whether a buffered job may start. A job without heartbeats needs its timeout's worth of
/// lease left, or it is released. A long job that waited in the buffer (more than a hundredth
/// of its lease) first renews it with a fenced heartbeat: if another worker took it over
/// meanwhile, it does not run here, and if an operator asked to cancel it meanwhile, it ends
/// cancelled without running.
async fn still_held<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    job: &ClaimedJob,
    clock: &LeaseClock,
) -> bool {
    let config = &shared.config;
    let lease = config.lease.duration();
    if !shared.handler.runs_long() {
        if clock.left() >= config.job_timeout {
            return true;
        }
        // Starting now could outlive the lease and race a second holder: give it back.
        let reason = "too little lease left to start";
        shared.finalizer.release(job, reason, clock.expires()).await;
        return false;
    }
    if clock.left() >= lease - lease / 100 {
        // Started as it was claimed: the claim itself reported a cancel request.
        return true;
    }
    let sent = Instant::now();
    // A renewal that does not answer within a sixth of the lease cannot be counted on.
    let renewal = shared.renewer.renew(job.claim());
    let answer = tokio::time::timeout(lease / 6, renewal)
        .await
        .unwrap_or_else(|_| Err(Error::backend("no answer to the renewal in time", true)));
    match answer {
        Ok(Heartbeat::Held) => {
            clock.renewed(sent);
            true
        }
        Ok(Heartbeat::CancelRequested) => {
            // Do not start it: end it as the operator asked, fenced and with the hooks.
            events::cancel_requested(shared.backend.queue(), job.claim());
            let cancel = Finalize::Cancel {
                reason: CANCEL_REQUESTED_MESSAGE.to_owned(),
            };
            shared
                .finalizer
                .finish_now(job, cancel, clock.expires())
                .await;
            false
        }
        Ok(Heartbeat::Lost) => {
            events::lease_lost(shared.backend.queue(), job.claim());
            shared.metrics.stale();
            shared.stats.send_modify(|s| s.stale += 1);
            super::finalizer::record_stale(&shared.backend, 1);
            false
        }
        Err(err) => {
            events::heartbeat_failed(shared.backend.queue(), job.claim(), &err);
            let reason = "the lease could not be renewed before start";
            shared.finalizer.release(job, reason, clock.expires()).await;
            false
        }
    }
}

/// A wake-up future, or one that never comes for backends without a signal.
fn arm_wake(wake: &Option<Arc<Notify>>) -> Wake {
    match wake {
        // An owned `Notified` receives `notify_waiters` from the moment it exists, so a
        // wake-up landing between an empty claim and the wait is not lost.
        Some(notify) => Box::pin(notify.clone().notified_owned()),
        None => Box::pin(std::future::pending()),
    }
}
