//! The contract every storage backend implements, and the fenced-finalize-with-hooks procedure
//! built on it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::Result;
use crate::types::{
    CancelOutcome, CancelTarget, Claim, ClaimBatch, ClaimRequest, Enqueued, Finalize,
    FinalizeOutcome, Heartbeat, JobId, JobRecord, Lease, NewJob, QueueCounts, QueueName,
    QueueStats,
};

/// A transaction of a backend: the fenced write and every hook commit together or not at all.
///
/// Dropping a transaction without committing rolls it back.
pub trait BackendTx: Send + 'static {
    /// Makes everything done in the transaction durable and visible.
    fn commit(self) -> impl Future<Output = Result<()>> + Send;
    /// Discards everything done in the transaction.
    fn rollback(self) -> impl Future<Output = Result<()>> + Send;

    /// Marks the point that [`BackendTx::rollback_to_savepoint`] returns to: how one
    /// transaction finalizes many jobs with their hooks, each job's writes undone alone when
    /// its hook fails. Savepoints nest; the latest is the one rolled back to. Only for a
    /// backend whose [`Backend::savepoints`] is true; refused by default.
    fn savepoint(&mut self) -> impl Future<Output = Result<()>> + Send {
        async { Err(no_savepoints()) }
    }

    /// Undoes everything done since the latest [`BackendTx::savepoint`], which stays set; the
    /// transaction goes on (after a failed statement too). Refused by default.
    fn rollback_to_savepoint(&mut self) -> impl Future<Output = Result<()>> + Send {
        async { Err(no_savepoints()) }
    }
}

fn no_savepoints() -> crate::error::Error {
    crate::error::Error::Backend {
        source: "this backend's transactions have no savepoints".into(),
        transient: false,
    }
}

/// A queue's storage: one queue (a queue name in a table) of one backend.
///
/// Implementations: `queue_core::MemoryBackend` here, `queue_postgres::PgQueue` for PostgreSQL.
/// Every implementation must pass the conformance suite (`queue_core::conformance`, feature
/// `conformance`), which is the executable form of the guarantees below.
///
/// # Guarantees
/// * **Claim** ([`Backend::claim`]) takes, in one atomic step, jobs that are either `pending` and
///   due, or `in_flight` with an expired lease (its stored `lease_expires_at` passed, by the
///   backend's clock; a claim made before leases were stored counts from `claimed_at` and the
///   claimer's lease; a row with neither counts as expired), in `next_attempt_at` then
///   `priority` order. It bumps `attempts` and `claim_generation`, stores a fresh
///   [`ClaimToken`](crate::ClaimToken) as `claim_token`, stamps `claimed_at`, stores the lease,
///   and never hands one job to two concurrent claims.
/// * **Every lease-holder write** ([`Backend::finalize_in`], [`Backend::finalize_many`],
///   [`Backend::extend_lease`]) is a compare-and-set on `(id, status = in_flight,
///   claim_generation, claim_token)` and reports [`FinalizeOutcome::Stale`] when it did nothing:
///   a generation the store handed out twice (after losing committed writes) still fences,
///   because the two claims drew different tokens.
/// * Clock: lease arithmetic uses the backend's clock only, never the caller's.
/// * **Cancellation**: a caller may drop any call's future at any point (the worker drops
///   renewals nobody waits for any more; callers wrap calls in timeouts). A dropped call leaves
///   no connection in a state the next caller would inherit: a transaction its `BEGIN` opened
///   is rolled back or its connection closed, never pooled open. Whether the dropped write
///   happened is unknown, as for any write whose answer was lost: a claim's jobs come back
///   after their lease, a fenced write is fenced, an enqueue retried may enqueue twice (unique
///   keys make the retry a duplicate instead). PostgreSQL's bulk enqueue by `COPY` runs to its
///   end on a task of its own once started.
pub trait Backend: Clone + Send + Sync + 'static {
    /// The transaction type in which finalizes and hooks run. Hooks receive `&mut Self::Tx` so
    /// they can stage their own writes (an outbox row, a domain status) atomically with the job.
    type Tx: BackendTx;

    /// The queue this handle serves.
    fn queue(&self) -> &QueueName;

    /// Enqueues one job.
    fn enqueue(&self, job: NewJob) -> impl Future<Output = Result<Enqueued>> + Send;

    /// Enqueues many jobs in one round trip and one transaction; results in input order.
    fn enqueue_many(&self, jobs: Vec<NewJob>)
    -> impl Future<Output = Result<Vec<Enqueued>>> + Send;

    /// Enqueues one job inside the caller's transaction: it becomes visible, and claimable, only
    /// when that transaction commits.
    fn enqueue_in(
        &self,
        tx: &mut Self::Tx,
        job: NewJob,
    ) -> impl Future<Output = Result<Enqueued>> + Send;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx>> + Send;

    /// Claims up to `request.batch_size` jobs (see the trait docs for the semantics). A takeover
    /// of a job whose lease had already expired `request.max_reclaims` times comes back flagged
    /// [`ClaimedJob::over_reclaim_cap`](crate::ClaimedJob::over_reclaim_cap): do not run it, end
    /// it with [`Finalize::Dead`].
    fn claim(&self, request: ClaimRequest) -> impl Future<Output = Result<ClaimBatch>> + Send;

    /// Applies `action` to the claimed job inside `tx`, fenced on `(id, in_flight, generation,
    /// token)`.
    fn finalize_in(
        &self,
        tx: &mut Self::Tx,
        claim: Claim,
        action: &Finalize,
    ) -> impl Future<Output = Result<FinalizeOutcome>> + Send;

    /// Applies `action` in its own transaction. Same fence as [`Backend::finalize_in`].
    fn finalize(
        &self,
        claim: Claim,
        action: &Finalize,
    ) -> impl Future<Output = Result<FinalizeOutcome>> + Send {
        async move {
            let mut tx = self.begin().await?;
            let outcome = self.finalize_in(&mut tx, claim, action).await?;
            tx.commit().await?;
            Ok(outcome)
        }
    }

    /// [`Backend::finalize_many`] inside `tx`: how many outcomes and their hooks share one
    /// transaction. By default [`Backend::finalize_in`] for each item in turn.
    fn finalize_many_in(
        &self,
        tx: &mut Self::Tx,
        items: &[(Claim, Finalize)],
    ) -> impl Future<Output = Result<Vec<FinalizeOutcome>>> + Send {
        async move {
            crate::limits::check_batch(items)?;
            let mut outcomes = Vec::with_capacity(items.len());
            for (claim, action) in items {
                outcomes.push(self.finalize_in(tx, *claim, action).await?);
            }
            Ok(outcomes)
        }
    }

    /// Applies many fenced writes at once (one statement where the backend can), one outcome per
    /// item in input order. For jobs without hooks; each item is fenced on its own.
    fn finalize_many(
        &self,
        items: &[(Claim, Finalize)],
    ) -> impl Future<Output = Result<Vec<FinalizeOutcome>>> + Send;

    /// Writes `items` as [`Backend::finalize_many`] does, then claims as [`Backend::claim`]
    /// does: in one statement and one commit where the backend says so
    /// ([`Backend::fuses_claims`]), so that a busy worker pays one round trip per batch
    /// instead of two. A job among `items` is never taken over by the same call (its outcome is
    /// written instead). The outcomes come back in input order, as `finalize_many`'s.
    ///
    /// An error means nothing is known of either part: the outcomes may have been written (a
    /// lost reply, or by default a claim that failed after the writes), and must be written
    /// again and their refusals checked, as after any lost reply. By default the two calls,
    /// one after the other.
    fn finalize_and_claim(
        &self,
        items: &[(Claim, Finalize)],
        request: ClaimRequest,
    ) -> impl Future<Output = Result<(Vec<FinalizeOutcome>, ClaimBatch)>> + Send {
        async move {
            let written = self.finalize_many(items).await?;
            let batch = self.claim(request).await?;
            Ok((written, batch))
        }
    }

    /// Whether this backend's transactions have savepoints ([`BackendTx::savepoint`]): then a
    /// worker writes the outcomes of jobs with hooks many to a transaction, one savepoint per
    /// job. False by default.
    fn savepoints(&self) -> bool {
        false
    }

    /// Whether [`Backend::finalize_and_claim`] is one statement: then a worker carries its
    /// batched outcomes with its next claim ([`crate::WorkerConfig::fuse_claims`]). False by
    /// default.
    fn fuses_claims(&self) -> bool {
        false
    }

    /// Heartbeat: the job is held for `lease` more from now, by the backend's clock
    /// (`lease_expires_at`, and `claimed_at` restamped). Fenced like a finalizer:
    /// [`Heartbeat::Lost`] means the lease was already lost; [`Heartbeat::CancelRequested`]
    /// that it is still held and an operator asked to cancel the job.
    fn extend_lease(
        &self,
        claim: Claim,
        lease: Lease,
    ) -> impl Future<Output = Result<Heartbeat>> + Send;

    /// Heartbeats of many claims at once, each fenced as [`Backend::extend_lease`] is: one
    /// answer per claim, in order. `None` means the store did not answer for that claim because
    /// another transaction holds its row (a finalize with hooks, an operator's cancel) and it
    /// did not wait, so that one locked row holds up no other renewal: ask again for that claim
    /// alone with [`Backend::extend_lease`], which waits. An error means nothing is known of any
    /// of them (renewals may have applied: a renewal is safe to send again). By default one
    /// [`Backend::extend_lease`] after another (never `None`).
    fn extend_leases(
        &self,
        claims: &[Claim],
        lease: Lease,
    ) -> impl Future<Output = Result<Vec<Option<Heartbeat>>>> + Send {
        async move {
            let mut answers = Vec::with_capacity(claims.len());
            for claim in claims {
                answers.push(Some(self.extend_lease(*claim, lease).await?));
            }
            Ok(answers)
        }
    }

    /// Administrative cancel inside `tx`: a `pending` job is cancelled (its reason
    /// [`CANCELLED_BY_OPERATOR`](crate::CANCELLED_BY_OPERATOR)) and returned for the finalize
    /// hooks; a job in flight gets a cancel request for its holder, who alone may end it (so an
    /// administrative cancel never races a running handler). [`crate::cancel_with_hooks`] runs
    /// the hooks.
    fn cancel_in(
        &self,
        tx: &mut Self::Tx,
        id: JobId,
    ) -> impl Future<Output = Result<CancelTarget>> + Send;

    /// [`Backend::cancel_in`] in a transaction of its own, without hooks.
    fn cancel(&self, id: JobId) -> impl Future<Output = Result<CancelOutcome>> + Send {
        async move {
            let mut tx = self.begin().await?;
            let target = self.cancel_in(&mut tx, id).await?;
            tx.commit().await?;
            Ok(target.outcome())
        }
    }

    /// Reads one job of this queue.
    fn get(&self, id: JobId) -> impl Future<Output = Result<Option<JobRecord>>> + Send;

    /// Counts this queue's jobs by status, every row of the queue read: exact, and slow on a
    /// large table (use [`Backend::stats`] for monitoring).
    fn counts(&self) -> impl Future<Output = Result<QueueCounts>> + Send;

    /// This queue's health, cheap on large tables ([`QueueStats`]): backlog, lag, leases
    /// expired or ending within `window`, jobs ended in the last hour.
    fn stats(&self, window: Duration) -> impl Future<Output = Result<QueueStats>> + Send;

    /// A worker starts serving this queue, so that the admin API lists it
    /// ([`crate::Admin::queues`]) even when every job of it has completed. Best effort: the
    /// worker calls it once when it starts and ignores its failure. Does nothing by default.
    fn note_served(&self) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Counts `count` outcomes of this queue's workers that the fence refused, for operators
    /// ([`crate::QueueControl::stale_fences`]). Best effort: the worker calls it after the
    /// fact and ignores its failure. Counts nothing by default.
    fn record_stale(&self, count: u64) -> impl Future<Output = Result<()>> + Send {
        let _ = count;
        async { Ok(()) }
    }

    /// A signal the backend fires when new work may be available (an in-process enqueue, a
    /// PostgreSQL `NOTIFY`). Workers wait on it as well as on their poll interval. `None` means
    /// polling only.
    fn wake_signal(&self) -> Option<Arc<Notify>> {
        None
    }
}
