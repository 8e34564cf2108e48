//! Periodic jobs and scheduled retention: a [`Scheduler`] enqueues one job per period of each
//! [`Schedule`], however many processes run it, and purges finished jobs on a timetable.
//!
//! No leader is elected. Every scheduler enqueues every period it sees, and the period's job
//! carries a unique key made of the schedule's name and the period's instant, so the store
//! keeps the first and reports the rest as duplicates. A scheduler restarted in the middle of a
//! period finds that period's job already there; one that starts after every process was down
//! looks back as far as the schedule's [`Missed`] policy says.
//!
//! ```
//! use std::time::Duration;
//! use queue_core::schedule::{ManualClock, Schedule, Scheduler};
//! use queue_core::{Backend, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let queue = MemoryBackend::new();
//! let clock = ManualClock::new("2026-01-01T00:00:30Z".parse()?);
//! let scheduler = Scheduler::new(queue.clone())
//!     .schedule(Schedule::every("refresh-rates", Duration::from_secs(60))?)?
//!     .clock(clock.clone())
//!     .start()?;
//! clock.advance(Duration::from_secs(60)); // 00:01:30: the period of 00:01 is due
//! let stats = scheduler
//!     .wait_for(|s| s.schedules["refresh-rates"].through >= Some("2026-01-01T00:01:00Z".parse().unwrap()))
//!     .await;
//! assert_eq!(stats.schedules["refresh-rates"].enqueued, 1);
//! scheduler.shutdown().await;
//! assert_eq!(queue.counts().await?.pending, 1);
//! # Ok(()) }
//! ```

mod clock;
mod retention;
mod spec;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use clock::{Clock, ManualClock, Sleep, SystemClock};
pub use retention::Retention;
pub use spec::{MAX_SCHEDULE_NAME, MIN_INTERVAL, Missed, Schedule, valid_name};

use crate::admin::Admin;
use crate::error::{ConfigError, Error};
use crate::events;
use crate::types::NewJob;

/// The most periods one pass enqueues for one schedule (in one statement); a longer catch-up
/// goes on at once in the next pass.
pub const MAX_PERIODS_PER_PASS: usize = 1_000;

/// The most periods a pass walks to find a skipping schedule's latest one, or to count what it
/// skipped: a one-second interval skipping a day of downtime.
const MAX_PERIODS_WALKED: usize = 100_000;

/// The pause after a failed enqueue or purge doubles from one second up to this.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What one schedule of a scheduler has done since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScheduleStats {
    /// Periods this scheduler enqueued a job for.
    pub enqueued: u64,
    /// Periods whose job was already there (another process, or this one before a restart).
    pub duplicates: u64,
    /// Missed periods left out ([`Missed`]), and periods whose job the store refused for good.
    pub skipped: u64,
    /// Enqueues that failed and will be tried again.
    pub failures: u64,
    /// The latest period handled (enqueued, found there, or skipped).
    pub through: Option<DateTime<Utc>>,
    /// The next period, by the scheduler's clock.
    pub next: Option<DateTime<Utc>>,
}

/// What a scheduler has done since it started ([`SchedulerHandle::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Passes finished (each looks at every schedule, and at retention when it is due).
    pub passes: u64,
    /// The clock's time as the latest pass began.
    pub seen: Option<DateTime<Utc>>,
    /// Per schedule, by name.
    pub schedules: BTreeMap<String, ScheduleStats>,
    /// Retention runs finished.
    pub retention_runs: u64,
    /// Jobs retention deleted.
    pub purged: u64,
    /// Retention runs that failed (tried again at the next).
    pub retention_failures: u64,
    /// When retention runs next, by the scheduler's clock (`None` without retention).
    pub retention_next: Option<DateTime<Utc>>,
}

/// How a scheduler runs its retention: bound where the backend's admin API is known.
type Purge<B> = Arc<
    dyn Fn(
            B,
            Retention,
            CancellationToken,
        ) -> Pin<Box<dyn Future<Output = crate::Result<u64>> + Send>>
        + Send
        + Sync,
>;

/// Runs schedules (and retention) against one queue. See the [module](self).
pub struct Scheduler<B: Admin> {
    backend: B,
    schedules: Vec<Schedule>,
    retention: Option<(Retention, Purge<B>)>,
    clock: Arc<dyn Clock>,
    name: String,
}

impl<B: Admin> Scheduler<B> {
    /// A scheduler for `backend`'s queue, on the system clock, with no schedule yet, named
    /// `<host>:<pid>`.
    pub fn new(backend: B) -> Self {
        Scheduler {
            backend,
            schedules: Vec::new(),
            retention: None,
            clock: Arc::new(SystemClock),
            name: crate::worker::config::default_worker_name(),
        }
    }

    /// Names this scheduler in the schedules it records for operators
    /// ([`Admin::schedules`]: who ran each last); default `<host>:<pid>`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Adds a schedule; refused when one of the same name is already there.
    pub fn schedule(mut self, schedule: Schedule) -> Result<Self, ConfigError> {
        if self.schedules.iter().any(|s| s.name() == schedule.name()) {
            return Err(ConfigError::OutOfRange {
                name: "schedule name",
                detail: format!("{:?} is registered twice", schedule.name()),
            });
        }
        self.schedules.push(schedule);
        Ok(self)
    }

    /// Purges the queue's finished jobs as `retention` says, at start and then on its interval.
    pub fn retention(mut self, retention: Retention) -> Self {
        let purge: Purge<B> = Arc::new(|backend, retention, stop| {
            Box::pin(async move { retention.run(&backend, move || !stop.is_cancelled()).await })
        });
        self.retention = Some((retention, purge));
        self
    }

    /// Reads the time from `clock` instead of the system's (a [`ManualClock`] in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Starts the scheduler's task. Refused when retention would delete a schedule's finished
    /// jobs sooner than the schedule looks back for missed periods: a scheduler starting then
    /// would find a purged period's job gone and enqueue it again.
    pub fn start(self) -> Result<SchedulerHandle, ConfigError> {
        if let Some((retention, _)) = &self.retention {
            for schedule in &self.schedules {
                retention.check_keeps(schedule)?;
            }
        }
        let stop = CancellationToken::new();
        let mut stats = SchedulerStats::default();
        for schedule in &self.schedules {
            stats
                .schedules
                .insert(schedule.name().to_owned(), ScheduleStats::default());
        }
        let (tx, rx) = watch::channel(stats);
        events::scheduler_started(self.backend.queue(), self.schedules.len());
        let task = tokio::spawn(Run::new(self, stop.clone(), tx).run());
        Ok(SchedulerHandle {
            stop,
            task: Some(task),
            stats: rx,
        })
    }
}

/// A running scheduler. Dropping it stops the scheduler; [`SchedulerHandle::shutdown`] also
/// waits for it.
pub struct SchedulerHandle {
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    stats: watch::Receiver<SchedulerStats>,
}

impl SchedulerHandle {
    /// What it has done so far.
    pub fn stats(&self) -> SchedulerStats {
        self.stats.borrow().clone()
    }

    /// Waits until the stats satisfy `condition` (how tests await a pass without sleeping).
    pub async fn wait_for(&self, condition: impl FnMut(&SchedulerStats) -> bool) -> SchedulerStats {
        let mut rx = self.stats.clone();
        rx.wait_for(condition)
            .await
            .expect("the scheduler keeps its stats channel open while its handle lives")
            .clone()
    }

    /// Like [`SchedulerHandle::wait_for`], but gives up after `timeout` with the last stats.
    pub async fn wait_for_timeout(
        &self,
        timeout: Duration,
        condition: impl FnMut(&SchedulerStats) -> bool,
    ) -> Result<SchedulerStats, SchedulerStats> {
        tokio::time::timeout(timeout, self.wait_for(condition))
            .await
            .map_err(|_| self.stats())
    }

    /// Stops the scheduler and waits for its task: an enqueue or purge under way is dropped
    /// (its transaction rolls back, or committed already: either way nothing is lost, the next
    /// scheduler finds what it needs by the unique keys). Bounded even when the store hangs.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for SchedulerHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A schedule and where its scheduler stands in it.
struct Cursor {
    schedule: Schedule,
    /// Every period at or before this instant is handled.
    through: DateTime<Utc>,
}

/// What one pass of one schedule did.
enum Pass {
    Done,
    /// More periods are due than one pass enqueues: go again at once.
    More,
    Failed,
}

struct Run<B: Admin> {
    backend: B,
    clock: Arc<dyn Clock>,
    name: String,
    cursors: Vec<Cursor>,
    retention: Option<(Retention, Purge<B>, DateTime<Utc>)>,
    stop: CancellationToken,
    stats: watch::Sender<SchedulerStats>,
    backoff: Duration,
}

impl<B: Admin> Run<B> {
    fn new(
        scheduler: Scheduler<B>,
        stop: CancellationToken,
        stats: watch::Sender<SchedulerStats>,
    ) -> Self {
        let start = scheduler.clock.now();
        let cursors = scheduler
            .schedules
            .into_iter()
            .map(|schedule| Cursor {
                through: before(start, schedule.missed_policy().window()),
                schedule,
            })
            .collect();
        Run {
            backend: scheduler.backend,
            clock: scheduler.clock,
            name: scheduler.name,
            cursors,
            retention: scheduler.retention.map(|(r, purge)| (r, purge, start)),
            stop,
            stats,
            backoff: Duration::ZERO,
        }
    }

    async fn run(mut self) {
        let stop = self.stop.clone();
        loop {
            let now = self.clock.now();
            let pass = tokio::select! {
                _ = stop.cancelled() => break,
                pass = self.pass(now) => pass,
            };
            let wake = match pass {
                Pass::More => now,
                Pass::Done => {
                    self.backoff = Duration::ZERO;
                    self.next_wake(now)
                }
                Pass::Failed => {
                    self.backoff = (self.backoff * 2).clamp(Duration::from_secs(1), MAX_BACKOFF);
                    self.next_wake(now).min(after(now, self.backoff))
                }
            };
            // Recorded before the pass counts, so that whoever waits for a pass finds it.
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.record() => {}
            }
            self.stats.send_modify(|s| {
                s.passes += 1;
                s.seen = Some(now);
            });
            if wake > now {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = self.clock.sleep_until(wake) => {}
                }
            } else {
                tokio::task::yield_now().await;
            }
        }
        events::scheduler_stopped(self.backend.queue());
    }

    /// One pass over every schedule, then retention if it is due.
    async fn pass(&mut self, now: DateTime<Utc>) -> Pass {
        let mut outcome = Pass::Done;
        for i in 0..self.cursors.len() {
            match self.pass_one(i, now).await {
                Pass::Done => {}
                Pass::More => {
                    if !matches!(outcome, Pass::Failed) {
                        outcome = Pass::More;
                    }
                }
                Pass::Failed => outcome = Pass::Failed,
            }
        }
        if let Some((retention, purge, due)) = &self.retention
            && *due <= now
        {
            let (retention, purge) = (retention.clone(), purge.clone());
            let next = after(now, retention.interval());
            let ok = self.purge(&purge, &retention, next).await;
            self.retention = Some((retention, purge, next));
            if !ok {
                outcome = Pass::Failed;
            }
        }
        outcome
    }

    /// The next instant anything is due: a period of some schedule, or retention.
    fn next_wake(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        let periods = self
            .cursors
            .iter()
            .filter_map(|c| c.schedule.next_after(now));
        let retention = self.retention.as_ref().map(|(_, _, due)| *due);
        periods
            .chain(retention)
            .min()
            .unwrap_or_else(|| after(now, Duration::from_secs(3600)))
    }

    async fn pass_one(&mut self, i: usize, now: DateTime<Utc>) -> Pass {
        let cursor = &self.cursors[i];
        let schedule = cursor.schedule.clone();
        let missed = schedule.missed_policy();
        let floor = before(now, missed.window());
        let mut skipped = if cursor.through < floor {
            walk(&schedule, cursor.through, floor, MAX_PERIODS_WALKED).1
        } else {
            0
        };
        let from = cursor.through.max(floor);
        let (due, more) = match missed {
            Missed::Skip { .. } => {
                let (latest, walked) = walk(&schedule, from, now, MAX_PERIODS_WALKED);
                skipped += walked.saturating_sub(1);
                (latest.into_iter().collect(), false)
            }
            Missed::CatchUp { .. } => periods(&schedule, from, now, MAX_PERIODS_PER_PASS),
        };
        if skipped > 0 {
            events::schedule_skipped(self.backend.queue(), schedule.name(), skipped, from);
        }
        let name = schedule.name().to_owned();
        if due.is_empty() {
            self.cursors[i].through = now;
            self.note(&name, None, skipped, 0, 0, &schedule);
            return Pass::Done;
        }
        match self.enqueue(&schedule, &due).await {
            Ok((inserted, duplicates, refused)) => {
                let through = if more {
                    *due.last().unwrap_or(&now)
                } else {
                    now
                };
                self.cursors[i].through = through;
                let last = due.last().copied();
                self.note(
                    &name,
                    last,
                    skipped + refused,
                    inserted,
                    duplicates,
                    &schedule,
                );
                if more { Pass::More } else { Pass::Done }
            }
            Err(err) => {
                events::schedule_failed(self.backend.queue(), &name, &err);
                self.stats.send_modify(|s| {
                    let entry = s.schedules.entry(name).or_default();
                    entry.failures += 1;
                    entry.skipped += skipped;
                });
                // The skipped periods are behind us whatever happens to the due ones.
                self.cursors[i].through = from;
                Pass::Failed
            }
        }
    }

    /// Enqueues the jobs of `due`: how many were inserted, found there, and refused for good
    /// (a job the store can never hold is logged and left out, so it cannot block the rest).
    async fn enqueue(
        &self,
        schedule: &Schedule,
        due: &[DateTime<Utc>],
    ) -> Result<(u64, u64, u64), Error> {
        let queue = self.backend.queue();
        let mut jobs: Vec<(DateTime<Utc>, NewJob)> = Vec::with_capacity(due.len());
        let mut refused = 0;
        for at in due {
            let job = schedule.job_for(*at);
            match job.check() {
                Ok(()) => jobs.push((*at, job)),
                Err(err) => {
                    refused += 1;
                    events::schedule_refused(queue, schedule.name(), *at, &err.into());
                }
            }
        }
        let batch: Vec<NewJob> = jobs.iter().map(|(_, job)| job.clone()).collect();
        let results = match self.backend.enqueue_many(batch).await {
            Ok(results) => results.into_iter().map(Ok).collect::<Vec<_>>(),
            // The store refused one of them: find which, one at a time.
            Err(Error::Invalid(_)) if jobs.len() > 1 => {
                let mut one_by_one = Vec::with_capacity(jobs.len());
                for (_, job) in &jobs {
                    match self.backend.enqueue(job.clone()).await {
                        Err(err @ Error::Invalid(_)) => one_by_one.push(Err(err)),
                        other => one_by_one.push(Ok(other?)),
                    }
                }
                one_by_one
            }
            Err(err @ Error::Invalid(_)) => vec![Err(err)],
            Err(err) => return Err(err),
        };
        let (mut inserted, mut duplicates) = (0, 0);
        for ((at, _), result) in jobs.iter().zip(results) {
            match result {
                Ok(done) if done.duplicate => {
                    duplicates += 1;
                    events::schedule_found(queue, schedule.name(), *at, done.id);
                }
                Ok(done) => {
                    inserted += 1;
                    events::schedule_enqueued(queue, schedule.name(), *at, done.id);
                }
                Err(err) => {
                    refused += 1;
                    events::schedule_refused(queue, schedule.name(), *at, &err);
                }
            }
        }
        crate::metrics::record_schedule(queue, schedule.name(), inserted, refused);
        Ok((inserted, duplicates, refused))
    }

    fn note(
        &self,
        name: &str,
        through: Option<DateTime<Utc>>,
        skipped: u64,
        inserted: u64,
        duplicates: u64,
        schedule: &Schedule,
    ) {
        if skipped > 0 {
            crate::metrics::record_schedule_skipped(self.backend.queue(), name, skipped);
        }
        self.stats.send_modify(|s| {
            let entry = s.schedules.entry(name.to_owned()).or_default();
            entry.enqueued += inserted;
            entry.duplicates += duplicates;
            entry.skipped += skipped;
            entry.through = entry.through.max(through);
            entry.next = schedule.next_after(self.clock.now());
        });
    }

    /// Records the schedules for operators ([`Admin::record_schedules`]): what each runs on,
    /// how far it got, and its next period. A failure is logged; the schedules run on.
    async fn record(&self) {
        if self.cursors.is_empty() {
            return;
        }
        let stats = self.stats.borrow().clone();
        let reports: Vec<crate::admin::ScheduleReport> = self
            .cursors
            .iter()
            .map(|cursor| {
                let schedule = &cursor.schedule;
                let seen = stats.schedules.get(schedule.name());
                crate::admin::ScheduleReport {
                    name: schedule.name().to_owned(),
                    spec: schedule.spec(),
                    missed: schedule.missed_policy().to_string(),
                    through: seen.and_then(|s| s.through),
                    next: seen.and_then(|s| s.next),
                }
            })
            .collect();
        if let Err(err) = self.backend.record_schedules(&self.name, &reports).await {
            events::schedules_unrecorded(self.backend.queue(), &err);
        }
    }

    /// One retention run, the next due at `next`; false when a purge failed.
    async fn purge(&self, purge: &Purge<B>, retention: &Retention, next: DateTime<Utc>) -> bool {
        let result = purge(self.backend.clone(), retention.clone(), self.stop.clone()).await;
        if let Err(err) = &result {
            events::retention_failed(self.backend.queue(), err);
        }
        self.stats.send_modify(|s| {
            match &result {
                Ok(deleted) => {
                    s.retention_runs += 1;
                    s.purged += deleted;
                }
                Err(_) => s.retention_failures += 1,
            }
            s.retention_next = Some(next);
        });
        result.is_ok()
    }
}

fn before(at: DateTime<Utc>, by: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(by)
        .ok()
        .and_then(|by| at.checked_sub_signed(by))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

fn after(at: DateTime<Utc>, by: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(by)
        .ok()
        .and_then(|by| at.checked_add_signed(by))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The periods in `(from, until]`, oldest first, at most `limit`; and whether more were left.
fn periods(
    schedule: &Schedule,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    limit: usize,
) -> (Vec<DateTime<Utc>>, bool) {
    let mut out = Vec::new();
    let mut at = from;
    while let Some(next) = schedule.next_after(at).filter(|next| *next <= until) {
        if out.len() == limit {
            return (out, true);
        }
        out.push(next);
        at = next;
    }
    (out, false)
}

/// The latest period in `(from, until]` and how many there are (walking at most `limit`; past
/// it, the latest is found by stepping back from `until`).
fn walk(
    schedule: &Schedule,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    limit: usize,
) -> (Option<DateTime<Utc>>, u64) {
    let (seen, more) = periods(schedule, from, until, limit);
    if !more {
        return (seen.last().copied(), seen.len() as u64);
    }
    // Too many to walk: the latest is the last period before `until` found from a little
    // earlier, looking back in growing steps.
    let mut back = Duration::from_secs(1);
    loop {
        let start = before(until, back).max(from);
        let (tail, more) = periods(schedule, start, until, limit);
        if let (Some(latest), false) = (tail.last(), more) {
            return (Some(*latest), seen.len() as u64 + 1);
        }
        back *= 2;
    }
}

#[cfg(test)]
mod tests;
