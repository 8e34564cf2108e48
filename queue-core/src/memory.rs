//! The in-memory backend: fully conforming, for adopters' unit tests and for demos.
//!
//! One [`MemoryBackend`] store can hold several queues ([`MemoryBackend::with_queue`]). Its clock
//! is the system clock plus an offset that tests move with [`MemoryBackend::advance_clock`]:
//! leases expire without sleeping.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::sync::{Mutex, Notify, OwnedMutexGuard};

use crate::backend::{Backend, BackendTx};
use crate::error::Result;
use crate::partition::PartitionWalk;
use crate::types::{
    CANCELLED_BY_OPERATOR, CancelTarget, Claim, ClaimBatch, ClaimGeneration, ClaimRequest,
    ClaimToken, ClaimedJob, Enqueued, Finalize, FinalizeOutcome, Heartbeat, JobId, JobRecord,
    JobStatus, Lease, NewJob, QueueCounts, QueueName, RunAt,
};

/// A queue held in process memory. Cloning gives another handle on the same store and queue.
///
/// ```
/// use queue_core::{Backend, ClaimRequest, Finalize, FinalizeOutcome, Lease, MemoryBackend, NewJob};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> queue_core::Result<()> {
/// let queue = MemoryBackend::new();
/// queue.enqueue(NewJob::new(&"hello")?).await?;
/// let batch = queue.claim(ClaimRequest::new(10, Lease::DEFAULT)).await?;
/// let job = &batch.jobs[0];
/// assert_eq!(queue.finalize(job.claim(), &Finalize::Complete).await?, FinalizeOutcome::Applied);
/// // The same claim cannot write twice: the job is no longer in flight.
/// assert_eq!(queue.finalize(job.claim(), &Finalize::Complete).await?, FinalizeOutcome::Stale);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryBackend {
    store: Arc<Store>,
    queue: QueueName,
    max_payload_bytes: usize,
}

struct Store {
    state: Arc<Mutex<State>>,
    clock_offset: StdMutex<chrono::Duration>,
    wake: Arc<Notify>,
}

#[derive(Default)]
struct State {
    next_id: i64,
    jobs: HashMap<i64, JobRecord>,
    /// Pending jobs per queue, in claim order.
    due: BTreeMap<String, BTreeSet<(DateTime<Utc>, i16, i64)>>,
    /// In-flight jobs per queue (few: bounded by the workers' concurrency).
    in_flight: BTreeMap<String, BTreeSet<i64>>,
    unique: HashMap<(String, String), i64>,
    /// Paused queues, with when they were paused.
    paused: HashMap<String, DateTime<Utc>>,
    /// Stale fences per queue: how many, and the last one's time.
    stale: HashMap<String, (u64, DateTime<Utc>)>,
    /// Queues a worker served.
    served: BTreeSet<String>,
    /// Limits per queue, and each limited queue's recent claims (when, how many) for its rate.
    limits: HashMap<String, crate::admin::QueueLimits>,
    started: HashMap<String, Vec<(DateTime<Utc>, u64)>>,
    /// Pending jobs with a partition key, per queue and key, in claim order (a key with none
    /// is removed), and each queue's partition cursor (`crate::partition`).
    partitions: BTreeMap<String, BTreeMap<String, BTreeSet<Due>>>,
    partition_cursor: HashMap<String, String>,
    /// Each partition's recent claims (when, how many), per queue and key, for the queue's
    /// rate per partition; a claim drops those older than the window of the keys it logs.
    partition_started: HashMap<(String, String), StartLog>,
    /// The schedules schedulers recorded, per queue and name.
    schedules: BTreeMap<(String, String), crate::admin::ScheduleInfo>,
}

/// A pending job's place in claim order: due time, priority, id.
type Due = (DateTime<Utc>, i16, i64);

/// Recent claims (when, how many jobs), for a rate limit.
type StartLog = Vec<(DateTime<Utc>, u64)>;

impl State {
    fn control(&self, queue: &str) -> crate::admin::QueueControl {
        let stale = self.stale.get(queue);
        crate::admin::QueueControl {
            paused_at: self.paused.get(queue).copied(),
            stale_fences: stale.map_or(0, |(n, _)| *n),
            last_stale_at: stale.map(|(_, at)| *at),
            limits: self.limits.get(queue).copied().unwrap_or_default(),
            room_grants: false,
        }
    }

    /// What a claim of `batch` may take from `queue` now, by its limits.
    fn room(&mut self, queue: &str, batch: u32, now: DateTime<Utc>) -> crate::admin::ClaimRoom {
        let Some(limits) = self.limits.get(queue).copied() else {
            return crate::admin::ClaimRoom {
                all: batch,
                new: batch,
            };
        };
        let in_flight = self.in_flight.get(queue).map_or(0, |ids| ids.len() as u64);
        let started = match limits.rate {
            Some(rate) => {
                let since = now - chrono::Duration::from_std(rate.per()).unwrap_or_default();
                let log = self.started.entry(queue.to_owned()).or_default();
                log.retain(|(at, _)| *at > since);
                log.iter().map(|(_, n)| n).sum()
            }
            None => 0,
        };
        limits.room(batch, in_flight, started)
    }

    /// How many of partition `key`'s jobs were claimed within `queue`'s rate per partition's
    /// window before `now` (0 without one).
    fn partition_started(&self, queue: &str, key: &str, now: DateTime<Utc>) -> u64 {
        let Some(rate) = self.limits.get(queue).and_then(|l| l.rate_per_partition) else {
            return 0;
        };
        let since = now - chrono::Duration::from_std(rate.per()).unwrap_or_default();
        self.partition_started
            .get(&(queue.to_owned(), key.to_owned()))
            .map_or(0, |log| {
                log.iter()
                    .filter(|(at, _)| *at > since)
                    .map(|(_, n)| n)
                    .sum()
            })
    }

    /// Logs a claim's starts per partition (`keys`: the partition of each job claimed), for
    /// the queue's rate per partition.
    fn log_partition_starts<'a>(
        &mut self,
        queue: &str,
        keys: impl IntoIterator<Item = &'a str>,
        now: DateTime<Utc>,
    ) {
        let Some(rate) = self.limits.get(queue).and_then(|l| l.rate_per_partition) else {
            return;
        };
        let since = now - chrono::Duration::from_std(rate.per()).unwrap_or_default();
        let mut counts: HashMap<&str, u64> = HashMap::new();
        for key in keys {
            *counts.entry(key).or_default() += 1;
        }
        for (key, n) in counts {
            let log = self
                .partition_started
                .entry((queue.to_owned(), key.to_owned()))
                .or_default();
            log.retain(|(at, _)| *at > since);
            log.push((now, n));
        }
        // Partitions whose claims all left the window are forgotten, as the SQL stores prune
        // their rows (here all at once: the map is in memory).
        self.partition_started
            .retain(|(q, _), log| q != queue || log.last().is_some_and(|(at, _)| *at > since));
    }
}

impl State {
    /// The due jobs a claim of a queue with `limits` per partition may take, at most `wanted`,
    /// in claim order (see [`crate::partition`]): the earliest due jobs when they
    /// [`fit`](crate::partition::fits); otherwise those without a partition among the earliest,
    /// and the offers of the partitions a [`PartitionWalk`] visits, with the walk, for the
    /// cursor.
    fn partitioned_due(
        &self,
        queue: &str,
        limits: crate::admin::QueueLimits,
        wanted: usize,
        now: DateTime<Utc>,
    ) -> (Vec<Due>, Option<PartitionWalk>) {
        let mut running: HashMap<&str, u64> = HashMap::new();
        for id in self.in_flight.get(queue).into_iter().flatten() {
            if let Some(key) = self.jobs.get(id).and_then(|j| j.partition_key.as_deref()) {
                *running.entry(key).or_default() += 1;
            }
        }
        let earliest = |n: usize| -> Vec<Due> {
            self.due
                .get(queue)
                .into_iter()
                .flatten()
                .take_while(|(at, _, _)| *at <= now)
                .take(n)
                .copied()
                .collect()
        };
        let plain = earliest(wanted);
        let keys_of = plain
            .iter()
            .map(|(_, _, id)| self.jobs[id].partition_key.as_deref());
        let held = |key: &str| running.get(key).copied().unwrap_or(0);
        let room =
            |key: &str| limits.partition_room(held(key), self.partition_started(queue, key, now));
        if crate::partition::fits(keys_of, room) {
            return (plain, None);
        }
        let mut due: Vec<Due> = earliest(crate::partition::loose_read_ahead(wanted as u32))
            .into_iter()
            .filter(|(_, _, id)| self.jobs[id].partition_key.is_none())
            .take(wanted)
            .collect();
        let cursor = self.partition_cursor.get(queue).cloned();
        let mut walk = PartitionWalk::new(cursor, wanted as u32);
        let empty = BTreeMap::new();
        let keys = self.partitions.get(queue).unwrap_or(&empty);
        while let Some(probe) = walk.probe() {
            use std::ops::Bound;
            let lower = probe.after.map_or(Bound::Unbounded, Bound::Excluded);
            let upper = probe.up_to.map_or(Bound::Unbounded, Bound::Included);
            let found = keys
                .range::<str, _>((lower, upper))
                .next()
                .map(|(key, set)| {
                    let is_due = set.first().is_some_and(|(at, _, _)| *at <= now);
                    (key.clone(), is_due, room(key))
                });
            walk.found(found);
        }
        for visit in walk.visits().iter().filter(|v| v.room > 0) {
            let offers = keys[&visit.key]
                .iter()
                .take_while(|(at, _, _)| *at <= now)
                .take((visit.room as usize).min(wanted));
            due.extend(offers);
        }
        due.sort();
        due.truncate(wanted);
        (due, Some(walk))
    }

    fn unindex(&mut self, job: &JobRecord) {
        match job.status {
            JobStatus::Pending => {
                let due = (job.next_attempt_at, job.priority, job.id.0);
                if let Some(set) = self.due.get_mut(&job.queue) {
                    set.remove(&due);
                }
                if let Some(key) = &job.partition_key
                    && let Some(keys) = self.partitions.get_mut(&job.queue)
                    && let Some(set) = keys.get_mut(key)
                {
                    set.remove(&due);
                    if set.is_empty() {
                        keys.remove(key);
                    }
                }
            }
            JobStatus::InFlight => {
                if let Some(set) = self.in_flight.get_mut(&job.queue) {
                    set.remove(&job.id.0);
                }
            }
            _ => {}
        }
    }

    fn index(&mut self, job: &JobRecord) {
        match job.status {
            JobStatus::Pending => {
                let due = (job.next_attempt_at, job.priority, job.id.0);
                self.due.entry(job.queue.clone()).or_default().insert(due);
                if let Some(key) = &job.partition_key {
                    self.partitions
                        .entry(job.queue.clone())
                        .or_default()
                        .entry(key.clone())
                        .or_default()
                        .insert(due);
                }
            }
            JobStatus::InFlight => {
                self.in_flight
                    .entry(job.queue.clone())
                    .or_default()
                    .insert(job.id.0);
            }
            _ => {}
        }
    }

    /// Replaces (or inserts, or with `None` removes) a row, keeping the indexes in step, and
    /// returns the previous row for an undo log.
    fn put(&mut self, id: i64, row: Option<JobRecord>) -> Option<JobRecord> {
        let old = self.jobs.remove(&id);
        if let Some(old) = &old {
            self.unindex(old);
            if let Some(key) = &old.unique_key {
                self.unique.remove(&(old.queue.clone(), key.clone()));
            }
        }
        if let Some(row) = row {
            self.index(&row);
            if let Some(key) = &row.unique_key {
                self.unique.insert((row.queue.clone(), key.clone()), id);
            }
            self.jobs.insert(id, row);
        }
        old
    }

    /// Inserts `job`, or finds (or replaces) the job holding its unique key; a holder out of
    /// the job's scope gives its key up first. Returns what happened and each row it changed,
    /// as it was before (`None`: the row is new), for an undo log.
    fn insert(
        &mut self,
        queue: &QueueName,
        job: NewJob,
        now: DateTime<Utc>,
    ) -> (Enqueued, Vec<(i64, Option<JobRecord>)>) {
        let mut changed = Vec::new();
        if let Some(key) = &job.unique_key
            && let Some(&id) = self.unique.get(&(queue.as_str().to_owned(), key.clone()))
        {
            let holder = self.jobs[&id].clone();
            let age = (now - holder.created_at).to_std().unwrap_or_default();
            if job.unique.holds(holder.status, age) {
                let replaced = job.unique.replace && holder.status == JobStatus::Pending;
                if replaced {
                    let mut row = holder.clone();
                    row.payload = job.payload;
                    row.priority = job.priority;
                    row.next_attempt_at = resolve(job.run_at, now);
                    row.updated_at = now;
                    changed.push((id, self.put(id, Some(row))));
                }
                return (Enqueued::existing(JobId(id), replaced), changed);
            }
            let mut released = holder;
            released.unique_key = None;
            changed.push((id, self.put(id, Some(released))));
        }
        self.next_id += 1;
        let id = self.next_id;
        let row = JobRecord {
            id: JobId(id),
            queue: queue.as_str().to_owned(),
            status: JobStatus::Pending,
            payload: job.payload,
            priority: job.priority,
            attempts: 0,
            reclaims: 0,
            next_attempt_at: resolve(job.run_at, now),
            claimed_at: None,
            lease_expires_at: None,
            cancel_requested_at: None,
            claim_generation: ClaimGeneration(0),
            claim_token: ClaimToken(0),
            last_error: None,
            unique_key: job.unique_key,
            partition_key: job.partition_key,
            created_at: now,
            updated_at: now,
            finished_at: None,
            claimed_by: None,
            errors: Vec::new(),
        };
        changed.push((id, self.put(id, Some(row))));
        (Enqueued::inserted(JobId(id)), changed)
    }

    /// The fenced write: applies only to a job of `queue` in flight under `claim.generation`.
    /// Returns the previous row when it applied.
    fn finalize(
        &mut self,
        queue: &QueueName,
        claim: Claim,
        action: &Finalize,
        now: DateTime<Utc>,
    ) -> Option<JobRecord> {
        let current = self.jobs.get(&claim.id.0)?;
        if current.queue != queue.as_str()
            || current.status != JobStatus::InFlight
            || current.claim_generation != claim.generation
            || current.claim_token != claim.token
        {
            return None;
        }
        let action = &action.storable();
        let mut row = current.clone();
        if let Some(error) = action.error_text() {
            if row.errors.len() >= crate::limits::ERROR_HISTORY_LEN {
                row.errors.remove(0);
            }
            row.errors.push(crate::types::ErrorEntry {
                attempt: row.attempts,
                generation: row.claim_generation.0,
                at: now,
                worker: row.claimed_by.clone(),
                outcome: action.kind().to_owned(),
                error: crate::limits::history_text(error),
            });
        }
        row.status = action.target_status();
        row.lease_expires_at = None;
        row.updated_at = now;
        match action {
            Finalize::Complete => {}
            Finalize::Fail { error } => row.last_error = Some(error.clone()),
            Finalize::Cancel { reason } | Finalize::Dead { reason } => {
                row.last_error = Some(reason.clone())
            }
            Finalize::Retry { at, error } => {
                row.next_attempt_at = resolve(*at, now);
                row.last_error = Some(error.clone());
            }
            Finalize::Release => row.attempts -= 1,
            Finalize::Snooze { at } => {
                row.next_attempt_at = resolve(*at, now);
                row.attempts -= 1;
            }
        }
        if row.status.is_terminal() {
            row.finished_at = Some(now);
        }
        self.put(claim.id.0, Some(row))
    }
}

fn to_delta(duration: Duration) -> chrono::TimeDelta {
    chrono::TimeDelta::from_std(duration).unwrap_or(chrono::TimeDelta::MAX)
}

fn resolve(run_at: RunAt, now: DateTime<Utc>) -> DateTime<Utc> {
    match run_at {
        RunAt::Now => now,
        RunAt::After(delay) => {
            now + chrono::Duration::from_std(delay).unwrap_or(chrono::TimeDelta::MAX)
        }
        RunAt::At(at) => at,
    }
}

impl MemoryBackend {
    /// An empty store, serving the queue `default`.
    pub fn new() -> Self {
        MemoryBackend {
            store: Arc::new(Store {
                state: Arc::new(Mutex::new(State::default())),
                clock_offset: StdMutex::new(chrono::Duration::zero()),
                wake: Arc::new(Notify::new()),
            }),
            queue: QueueName::default(),
            max_payload_bytes: crate::limits::DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }

    /// Another handle on the same store, serving `queue`.
    pub fn with_queue(&self, queue: QueueName) -> Self {
        MemoryBackend {
            store: self.store.clone(),
            queue,
            max_payload_bytes: self.max_payload_bytes,
        }
    }

    /// This handle refuses payloads over `bytes` of JSON text
    /// (default [`crate::limits::DEFAULT_MAX_PAYLOAD_BYTES`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use queue_core::{Backend, Error, InvalidInput, MemoryBackend, NewJob};
    ///
    /// let queue = MemoryBackend::new().with_max_payload_bytes(16);
    /// let payload = "x".repeat(21); // 23 bytes as JSON, with its quotes
    /// let err = queue.enqueue(NewJob::new(&payload).unwrap()).await.unwrap_err();
    /// assert!(matches!(err, Error::Invalid(InvalidInput::PayloadTooLarge { size: 23, limit: 16 })));
    /// assert_eq!(queue.counts().await.unwrap().total(), 0);
    /// # }
    /// ```
    pub fn with_max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// The backend's clock: system time plus the offset moved by [`MemoryBackend::advance_clock`].
    pub fn now(&self) -> DateTime<Utc> {
        Utc::now() + *self.store.clock_offset.lock().expect("clock lock")
    }

    /// Moves the backend's clock forward, so that leases expire and scheduled jobs become due
    /// without sleeping.
    pub fn advance_clock(&self, by: Duration) {
        let by = chrono::Duration::from_std(by).expect("clock advance out of range");
        *self.store.clock_offset.lock().expect("clock lock") += by;
    }

    /// Stores a row as given (its `queue` is set to this handle's queue; a new id is assigned).
    /// For tests that need states no public operation produces, such as a legacy in-flight row
    /// with no `claimed_at`.
    pub async fn import(&self, mut record: JobRecord) -> JobId {
        let mut state = self.store.state.lock().await;
        state.next_id += 1;
        let id = state.next_id;
        record.id = JobId(id);
        record.queue = self.queue.as_str().to_owned();
        state.put(id, Some(record));
        JobId(id)
    }

    /// Stores a legacy in-flight row, as a pre-lease release leaves them: `in_flight`, no
    /// `claimed_at`, generation 0, one attempt, due an hour ago. For tests of the upgrade path.
    pub async fn import_legacy_in_flight(&self, payload: Value) -> JobId {
        let now = self.now();
        self.import(JobRecord {
            id: JobId(0),
            queue: String::new(),
            status: JobStatus::InFlight,
            payload,
            priority: 0,
            attempts: 1,
            reclaims: 0,
            next_attempt_at: now - chrono::Duration::hours(1),
            claimed_at: None,
            lease_expires_at: None,
            cancel_requested_at: None,
            claim_generation: ClaimGeneration(0),
            claim_token: ClaimToken(0),
            last_error: None,
            unique_key: None,
            partition_key: None,
            created_at: now,
            updated_at: now,
            finished_at: None,
            claimed_by: None,
            errors: Vec::new(),
        })
        .await
    }

    fn wake(&self) {
        self.store.wake.notify_waiters();
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        MemoryBackend::new()
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

type Effect = Box<dyn FnOnce() + Send>;

/// A transaction of the in-memory backend.
///
/// It holds the store's lock from [`Backend::begin`] until commit or rollback, so everything in
/// it is atomic and isolated. While it is open, other operations on the same store wait: a hook
/// must therefore write through the transaction ([`Backend::enqueue_in`], [`MemoryTx::on_commit`])
/// and never through a second handle, which would wait forever.
pub struct MemoryTx {
    state: Option<OwnedMutexGuard<State>>,
    undo: Vec<(i64, Option<JobRecord>)>,
    on_commit: Vec<Effect>,
    on_rollback: Vec<Effect>,
    /// Each savepoint: how long `undo`, `on_commit` and `on_rollback` were when it was set.
    savepoints: Vec<(usize, usize, usize)>,
    wake: Option<Arc<Notify>>,
    now: DateTime<Utc>,
}

impl MemoryTx {
    /// Runs `effect` after the transaction commits, and never if it rolls back: how an in-memory
    /// hook stages domain writes (a status map, an outbox vector) atomically with the job.
    pub fn on_commit(&mut self, effect: impl FnOnce() + Send + 'static) {
        self.on_commit.push(Box::new(effect));
    }

    /// Runs `undo` if the transaction rolls back (or is dropped uncommitted), and never if it
    /// commits: how an in-memory hook takes back a write it made in place, so that later hooks
    /// of the same transaction see it (as they would in a database transaction). Undo effects run
    /// in reverse order of registration.
    pub fn on_rollback(&mut self, undo: impl FnOnce() + Send + 'static) {
        self.on_rollback.push(Box::new(undo));
    }

    /// Replaces the payload of job `id` inside the transaction (undone on rollback), as a hook's
    /// `UPDATE … SET payload` would in a database; false when there is no such job.
    pub fn update_payload(&mut self, id: JobId, payload: Value) -> bool {
        let state = self.state();
        let Some(mut row) = state.jobs.get(&id.0).cloned() else {
            return false;
        };
        row.payload = payload;
        let previous = state.put(id.0, Some(row));
        self.undo.push((id.0, previous));
        true
    }

    fn state(&mut self) -> &mut State {
        self.state.as_mut().expect("transaction already finished")
    }

    /// Undoes what was done since the latest savepoint; the savepoint stays.
    fn undo_to_savepoint(&mut self) {
        let Some(&(undo, commit, rollback)) = self.savepoints.last() else {
            return;
        };
        if let Some(state) = self.state.as_mut() {
            for (id, row) in self.undo.drain(undo..).rev() {
                state.put(id, row);
            }
        }
        self.on_commit.truncate(commit);
        for undo in self.on_rollback.drain(rollback..).rev() {
            undo();
        }
    }

    fn undo_all(&mut self) {
        if let Some(state) = self.state.as_mut() {
            for (id, row) in self.undo.drain(..).rev() {
                state.put(id, row);
            }
        }
        self.on_commit.clear();
        for undo in self.on_rollback.drain(..).rev() {
            undo();
        }
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        // Dropped without commit: roll back, as a database transaction would.
        self.undo_all();
    }
}

impl BackendTx for MemoryTx {
    async fn commit(mut self) -> Result<()> {
        self.undo.clear();
        self.on_rollback.clear();
        self.state.take();
        for effect in self.on_commit.drain(..) {
            effect();
        }
        if let Some(wake) = self.wake.take() {
            wake.notify_waiters();
        }
        Ok(())
    }

    async fn rollback(mut self) -> Result<()> {
        self.undo_all();
        Ok(())
    }

    async fn savepoint(&mut self) -> Result<()> {
        let mark = (
            self.undo.len(),
            self.on_commit.len(),
            self.on_rollback.len(),
        );
        self.savepoints.push(mark);
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<()> {
        self.undo_to_savepoint();
        Ok(())
    }
}

impl Backend for MemoryBackend {
    type Tx = MemoryTx;

    fn savepoints(&self) -> bool {
        true
    }

    fn queue(&self) -> &QueueName {
        &self.queue
    }

    async fn enqueue(&self, job: NewJob) -> Result<Enqueued> {
        job.check_within(self.max_payload_bytes)?;
        let now = self.now();
        let (enqueued, _) = self.store.state.lock().await.insert(&self.queue, job, now);
        crate::metrics::record_enqueued(&self.queue, u64::from(!enqueued.duplicate));
        self.wake();
        Ok(enqueued)
    }

    async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>> {
        for job in &jobs {
            job.check_within(self.max_payload_bytes)?;
        }
        crate::limits::check_enqueue_batch(&jobs)?;
        let now = self.now();
        let mut state = self.store.state.lock().await;
        let out: Vec<Enqueued> = jobs
            .into_iter()
            .map(|job| state.insert(&self.queue, job, now).0)
            .collect();
        drop(state);
        let new = out.iter().filter(|e| !e.duplicate).count();
        crate::metrics::record_enqueued(&self.queue, new as u64);
        self.wake();
        Ok(out)
    }

    async fn enqueue_in(&self, tx: &mut MemoryTx, job: NewJob) -> Result<Enqueued> {
        job.check_within(self.max_payload_bytes)?;
        let now = tx.now;
        let (enqueued, changed) = tx.state().insert(&self.queue, job, now);
        crate::metrics::record_enqueued(&self.queue, u64::from(!enqueued.duplicate));
        if !enqueued.duplicate || enqueued.replaced {
            tx.wake = Some(self.store.wake.clone());
        }
        tx.undo.extend(changed);
        Ok(enqueued)
    }

    async fn begin(&self) -> Result<MemoryTx> {
        let guard = self.store.state.clone().lock_owned().await;
        Ok(MemoryTx {
            state: Some(guard),
            undo: Vec::new(),
            on_commit: Vec::new(),
            on_rollback: Vec::new(),
            savepoints: Vec::new(),
            wake: None,
            now: self.now(),
        })
    }

    async fn claim(&self, request: ClaimRequest) -> Result<ClaimBatch> {
        let now = self.now();
        let lease = chrono::Duration::from_std(request.lease.duration()).expect("lease in range");
        let mut state = self.store.state.lock().await;
        let queue = self.queue.as_str();
        if state.paused.contains_key(queue) {
            return Ok(ClaimBatch::default());
        }
        let room = state.room(queue, request.batch_size, now);
        let (limit, new_limit) = (room.all as usize, room.new as usize);
        if limit == 0 {
            return Ok(ClaimBatch::default());
        }

        // The two picks of the SQL claim: due pending jobs in order, and expired leases.
        let limits = state.limits.get(queue).copied().unwrap_or_default();
        let (due, walk) = match limits.partitioned() {
            false => {
                let due: Vec<Due> = state
                    .due
                    .get(queue)
                    .map(|set| {
                        set.iter()
                            .take_while(|(at, _, _)| *at <= now)
                            .take(new_limit)
                            .copied()
                            .collect()
                    })
                    .unwrap_or_default();
                (due, None)
            }
            true => state.partitioned_due(queue, limits, new_limit, now),
        };
        let mut expired: Vec<(DateTime<Utc>, i16, i64)> = state
            .in_flight
            .get(queue)
            .into_iter()
            .flatten()
            .filter_map(|id| state.jobs.get(id))
            .filter(|job| match job.lease_expires_at {
                Some(expires) => expires < now,
                // A claim from before leases were stored: the claimer's lease, from claimed_at.
                None => job.claimed_at.is_none_or(|at| at < now - lease),
            })
            .map(|job| (job.next_attempt_at, job.priority, job.id.0))
            .collect();
        expired.sort();

        let mut batch = ClaimBatch::default();
        let token = ClaimToken::random();
        let mut live: Vec<(DateTime<Utc>, i16, i64)> = due;
        live.extend(expired);
        live.sort();
        if limits.rate_per_partition.is_some() {
            // Takeovers are starts too: each partition within the starts its rate leaves, before
            // the batch is cut, as the SQL claim does.
            let mut keyed: Vec<(Due, Option<String>)> = live
                .iter()
                .map(|due| (*due, state.jobs[&due.2].partition_key.clone()))
                .collect();
            crate::partition::keep_within_starts(
                &mut keyed,
                |(_, key)| key.as_deref(),
                |key| limits.partition_starts_left(state.partition_started(queue, key, now)),
            );
            live = keyed.into_iter().map(|(due, _)| due).collect();
        }
        live.truncate(limit);

        for (_, _, id) in live {
            let mut row = state.jobs[&id].clone();
            let taken_over = row.status == JobStatus::InFlight;
            let cancel_requested = row.cancel_requested_at.is_some();
            let over_reclaim_cap = taken_over && row.reclaims >= request.max_reclaims as i32;
            if taken_over {
                row.reclaims += 1;
            }
            row.status = JobStatus::InFlight;
            row.attempts += 1;
            row.claim_generation.0 += 1;
            row.claim_token = token;
            row.claimed_at = Some(now);
            row.claimed_by = request.holder.clone();
            row.lease_expires_at = Some(now + lease);
            row.updated_at = now;
            batch.jobs.push(ClaimedJob {
                id: row.id,
                generation: row.claim_generation,
                token,
                attempts: row.attempts,
                reclaims: row.reclaims,
                taken_over,
                over_reclaim_cap,
                cancel_requested,
                claimed_at: now,
                due_at: row.next_attempt_at,
                priority: row.priority,
                payload: row.payload.clone(),
            });
            state.put(id, Some(row));
        }
        if let Some(walk) = walk {
            // Only the partitions' offers: a takeover is no partition's turn.
            let taken: HashSet<&str> = batch
                .jobs
                .iter()
                .filter(|job| !job.taken_over)
                .filter_map(|job| state.jobs[&job.id.0].partition_key.as_deref())
                .collect();
            match walk.cursor_after(|key| taken.contains(key)) {
                Some(cursor) => state.partition_cursor.insert(queue.to_owned(), cursor),
                None => state.partition_cursor.remove(queue),
            };
        }
        if limits.rate_per_partition.is_some() {
            let keys: Vec<String> = batch
                .jobs
                .iter()
                .filter_map(|job| state.jobs[&job.id.0].partition_key.clone())
                .collect();
            state.log_partition_starts(queue, keys.iter().map(String::as_str), now);
        }
        if state.limits.get(queue).is_some_and(|l| l.rate.is_some()) && !batch.jobs.is_empty() {
            let log = state.started.entry(queue.to_owned()).or_default();
            log.push((now, batch.jobs.len() as u64));
        }
        Ok(batch)
    }

    async fn finalize_in(
        &self,
        tx: &mut MemoryTx,
        claim: Claim,
        action: &Finalize,
    ) -> Result<FinalizeOutcome> {
        let now = tx.now;
        let previous = tx.state().finalize(&self.queue, claim, action, now);
        Ok(match previous {
            Some(previous) => {
                tx.undo.push((claim.id.0, Some(previous)));
                if action.requeues() {
                    tx.wake = Some(self.store.wake.clone());
                }
                FinalizeOutcome::Applied
            }
            None => FinalizeOutcome::Stale,
        })
    }

    async fn finalize_many(&self, items: &[(Claim, Finalize)]) -> Result<Vec<FinalizeOutcome>> {
        crate::limits::check_batch(items)?;
        let now = self.now();
        let mut state = self.store.state.lock().await;
        let outcomes = items
            .iter()
            .map(
                |(claim, action)| match state.finalize(&self.queue, *claim, action, now) {
                    Some(_) => FinalizeOutcome::Applied,
                    None => FinalizeOutcome::Stale,
                },
            )
            .collect();
        drop(state);
        self.wake();
        Ok(outcomes)
    }

    async fn extend_lease(&self, claim: Claim, lease: Lease) -> Result<Heartbeat> {
        let now = self.now();
        let mut state = self.store.state.lock().await;
        let Some(job) = state.jobs.get(&claim.id.0) else {
            return Ok(Heartbeat::Lost);
        };
        if job.queue != self.queue.as_str()
            || job.status != JobStatus::InFlight
            || job.claim_generation != claim.generation
            || job.claim_token != claim.token
        {
            return Ok(Heartbeat::Lost);
        }
        let mut row = job.clone();
        row.claimed_at = Some(now);
        row.lease_expires_at = Some(now + to_delta(lease.duration()));
        row.updated_at = now;
        let requested = row.cancel_requested_at.is_some();
        state.put(claim.id.0, Some(row));
        Ok(if requested {
            Heartbeat::CancelRequested
        } else {
            Heartbeat::Held
        })
    }

    async fn cancel_in(&self, tx: &mut MemoryTx, id: JobId) -> Result<CancelTarget> {
        let now = tx.now;
        let queue = self.queue.as_str();
        let state = tx.state();
        let Some(job) = state.jobs.get(&id.0).filter(|j| j.queue == queue) else {
            return Ok(CancelTarget::NotFound);
        };
        let mut row = job.clone();
        let target = match row.status {
            JobStatus::Pending => {
                row.status = JobStatus::Cancelled;
                row.last_error = Some(CANCELLED_BY_OPERATOR.to_owned());
                row.finished_at = Some(now);
                CancelTarget::Cancelled(row.as_claimed())
            }
            JobStatus::InFlight => {
                row.cancel_requested_at.get_or_insert(now);
                CancelTarget::Requested
            }
            terminal => return Ok(CancelTarget::AlreadyTerminal(terminal)),
        };
        row.updated_at = now;
        let previous = state.put(id.0, Some(row));
        tx.undo.push((id.0, previous));
        Ok(target)
    }

    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        let state = self.store.state.lock().await;
        Ok(state
            .jobs
            .get(&id.0)
            .filter(|j| j.queue == self.queue.as_str())
            .cloned())
    }

    async fn counts(&self) -> Result<QueueCounts> {
        let state = self.store.state.lock().await;
        let mut counts = QueueCounts::default();
        for job in state
            .jobs
            .values()
            .filter(|j| j.queue == self.queue.as_str())
        {
            counts.add(job.status, 1);
        }
        Ok(counts)
    }

    async fn stats(&self, window: std::time::Duration) -> Result<crate::types::QueueStats> {
        let now = self.now();
        let window = chrono::Duration::from_std(window).unwrap_or(chrono::TimeDelta::MAX);
        let hour_ago = now - chrono::Duration::hours(1);
        let state = self.store.state.lock().await;
        let mut stats = crate::types::QueueStats::default();
        let mut oldest_due: Option<DateTime<Utc>> = None;
        for job in state
            .jobs
            .values()
            .filter(|j| j.queue == self.queue.as_str())
        {
            match job.status {
                JobStatus::Pending if job.next_attempt_at <= now => {
                    stats.due += 1;
                    oldest_due = Some(
                        oldest_due.map_or(job.next_attempt_at, |o| o.min(job.next_attempt_at)),
                    );
                }
                JobStatus::Pending => stats.scheduled += 1,
                JobStatus::InFlight => {
                    stats.in_flight += 1;
                    match job.lease_expires_at {
                        Some(at) if at < now => stats.lease_expired += 1,
                        None => stats.lease_expired += 1,
                        Some(at)
                            if at
                                < now
                                    .checked_add_signed(window)
                                    .unwrap_or(DateTime::<Utc>::MAX_UTC) =>
                        {
                            stats.lease_expiring += 1
                        }
                        Some(_) => {}
                    }
                }
                status => {
                    if job.finished_at.is_some_and(|at| at > hour_ago) {
                        stats.finished_last_hour.add(status, 1);
                    }
                }
            }
        }
        stats.oldest_due_wait = oldest_due.map(|at| (now - at).to_std().unwrap_or_default());
        stats.due = stats.due.min(crate::types::QueueStats::COUNT_CAP);
        stats.scheduled = stats.scheduled.min(crate::types::QueueStats::COUNT_CAP);
        Ok(stats)
    }

    fn wake_signal(&self) -> Option<Arc<Notify>> {
        Some(self.store.wake.clone())
    }

    async fn note_served(&self) -> Result<()> {
        self.store
            .state
            .lock()
            .await
            .served
            .insert(self.queue.as_str().to_owned());
        Ok(())
    }

    async fn record_stale(&self, count: u64) -> Result<()> {
        let now = self.now();
        let mut state = self.store.state.lock().await;
        let entry = state
            .stale
            .entry(self.queue.as_str().to_owned())
            .or_insert((0, now));
        entry.0 += count;
        entry.1 = now;
        Ok(())
    }
}

impl crate::admin::Admin for MemoryBackend {
    async fn list_jobs(&self, filter: &crate::admin::JobFilter) -> Result<crate::admin::JobPage> {
        let state = self.store.state.lock().await;
        let mut rows: Vec<JobRecord> = state
            .jobs
            .values()
            .filter(|j| j.queue == self.queue.as_str() && filter.matches(j))
            .cloned()
            .collect();
        rows.sort_by_key(|j| std::cmp::Reverse(j.id));
        rows.truncate(filter.limit as usize + 1);
        Ok(crate::admin::JobPage::from_rows(rows, filter.limit))
    }

    async fn find_by_unique_key(&self, key: &str) -> Result<Option<JobRecord>> {
        let state = self.store.state.lock().await;
        Ok(state
            .unique
            .get(&(self.queue.as_str().to_owned(), key.to_owned()))
            .and_then(|id| state.jobs.get(id))
            .cloned())
    }

    async fn retry_in(
        &self,
        tx: &mut MemoryTx,
        id: JobId,
        seen: JobStatus,
    ) -> Result<crate::admin::RetryTarget> {
        use crate::admin::RetryTarget;
        let now = tx.now;
        let queue = self.queue.as_str();
        let state = tx.state();
        let Some(job) = state.jobs.get(&id.0).filter(|j| j.queue == queue) else {
            return Ok(RetryTarget::NotFound);
        };
        if job.status != seen {
            return Ok(RetryTarget::WrongState(job.status));
        }
        let mut row = job.clone();
        row.status = JobStatus::Pending;
        row.attempts = 0;
        row.reclaims = 0;
        row.next_attempt_at = now;
        row.claimed_at = None;
        row.lease_expires_at = None;
        row.cancel_requested_at = None;
        row.finished_at = None;
        row.updated_at = now;
        let previous = state.put(id.0, Some(row.clone()));
        tx.undo.push((id.0, previous));
        tx.wake = Some(self.store.wake.clone());
        Ok(RetryTarget::Retried(Box::new(row)))
    }

    async fn purge_batch(&self, request: &crate::admin::PurgeRequest) -> Result<u64> {
        let now = self.now();
        let cutoff = now - to_delta(request.older_than());
        let mut state = self.store.state.lock().await;
        let mut doomed: Vec<(DateTime<Utc>, i64)> = state
            .jobs
            .values()
            .filter(|j| {
                j.queue == self.queue.as_str()
                    && request.statuses().contains(&j.status)
                    && j.finished_at.is_some_and(|at| at < cutoff)
            })
            .map(|j| (j.finished_at.unwrap_or(now), j.id.0))
            .collect();
        doomed.sort();
        doomed.truncate(request.rows_per_batch() as usize);
        for (_, id) in &doomed {
            state.put(*id, None);
        }
        drop(state);
        crate::events::jobs_purged(&self.queue, doomed.len() as u64);
        Ok(doomed.len() as u64)
    }

    async fn pause(&self) -> Result<crate::admin::QueueControl> {
        let now = self.now();
        let mut state = self.store.state.lock().await;
        state
            .paused
            .entry(self.queue.as_str().to_owned())
            .or_insert(now);
        let control = state.control(self.queue.as_str());
        drop(state);
        crate::events::queue_paused(&self.queue, true);
        Ok(control)
    }

    async fn resume(&self) -> Result<crate::admin::QueueControl> {
        let mut state = self.store.state.lock().await;
        state.paused.remove(self.queue.as_str());
        let control = state.control(self.queue.as_str());
        drop(state);
        crate::events::queue_paused(&self.queue, false);
        self.wake();
        Ok(control)
    }

    async fn control(&self) -> Result<crate::admin::QueueControl> {
        Ok(self.store.state.lock().await.control(self.queue.as_str()))
    }

    async fn record_schedules(
        &self,
        seen_by: &str,
        reports: &[crate::admin::ScheduleReport],
    ) -> Result<()> {
        let now = self.now();
        let mut state = self.store.state.lock().await;
        for report in reports {
            let key = (self.queue.as_str().to_owned(), report.name.clone());
            let through = state
                .schedules
                .get(&key)
                .and_then(|info| info.report.through)
                .max(report.through);
            let mut report = report.clone();
            report.through = through;
            state.schedules.insert(
                key,
                crate::admin::ScheduleInfo {
                    report,
                    seen_at: now,
                    seen_by: crate::limits::storable_holder(seen_by),
                },
            );
        }
        Ok(())
    }

    async fn schedules(&self) -> Result<Vec<crate::admin::ScheduleInfo>> {
        let state = self.store.state.lock().await;
        Ok(state
            .schedules
            .iter()
            .filter(|((queue, _), _)| queue == self.queue.as_str())
            .map(|(_, info)| info.clone())
            .collect())
    }

    async fn forget_schedule(&self, name: &str) -> Result<bool> {
        let mut state = self.store.state.lock().await;
        let key = (self.queue.as_str().to_owned(), name.to_owned());
        Ok(state.schedules.remove(&key).is_some())
    }

    async fn set_limits(
        &self,
        limits: crate::admin::QueueLimits,
    ) -> Result<crate::admin::QueueControl> {
        limits.check()?;
        let mut state = self.store.state.lock().await;
        let queue = self.queue.as_str().to_owned();
        if limits.is_none() {
            state.limits.remove(&queue);
        } else {
            state.limits.insert(queue.clone(), limits);
        }
        if limits.rate_per_partition.is_none() {
            // As the SQL stores do: the partitions' logs go with their rate.
            state.partition_started.retain(|(q, _), _| *q != queue);
        }
        let control = state.control(&queue);
        drop(state);
        crate::events::queue_limits_set(&self.queue, &limits);
        self.wake();
        Ok(control)
    }

    fn for_queue(&self, queue: QueueName) -> Self {
        self.with_queue(queue)
    }

    async fn throughput(&self, minutes: u32) -> Result<Vec<crate::admin::MinuteCounts>> {
        use chrono::{DurationRound, TimeDelta};
        let minutes = minutes.clamp(1, 1_440);
        let now = self.now();
        let current = now.duration_trunc(TimeDelta::minutes(1)).unwrap_or(now);
        let first = current - TimeDelta::minutes(i64::from(minutes) - 1);
        let mut out: Vec<crate::admin::MinuteCounts> = (0..minutes)
            .map(|i| crate::admin::MinuteCounts {
                minute: first + TimeDelta::minutes(i64::from(i)),
                finished: crate::types::FinishedCounts::default(),
            })
            .collect();
        let state = self.store.state.lock().await;
        for job in state
            .jobs
            .values()
            .filter(|j| j.queue == self.queue.as_str())
        {
            let Some(at) = job.finished_at.filter(|at| *at >= first) else {
                continue;
            };
            let slot = ((at - first).num_minutes()).clamp(0, i64::from(minutes) - 1) as usize;
            out[slot].finished.add(job.status, 1);
        }
        Ok(out)
    }

    async fn queues(&self) -> Result<Vec<QueueName>> {
        let state = self.store.state.lock().await;
        // As on PostgreSQL: queues with a live, failed, dead or cancelled job, or a pause.
        let mut names: BTreeSet<&str> = state
            .jobs
            .values()
            .filter(|j| j.status != JobStatus::Completed)
            .map(|j| j.queue.as_str())
            .collect();
        names.extend(state.paused.keys().map(String::as_str));
        names.extend(state.served.iter().map(String::as_str));
        names.extend(state.stale.keys().map(String::as_str));
        names.extend(state.schedules.keys().map(|(queue, _)| queue.as_str()));
        names
            .into_iter()
            .map(|name| QueueName::new(name).map_err(Into::into))
            .collect()
    }
}
