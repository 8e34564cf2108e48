//! Scheduling: periodic jobs, snoozes that do not count as attempts, scheduled retention.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{Harness, claim, enqueue, record};
use crate::admin::Admin;
use crate::backend::Backend;
use crate::handler::{Handler, JobContext, JobError};
use crate::retry::RetryPolicy;
use crate::schedule::{
    Clock, ManualClock, Missed, Retention, Schedule, Scheduler, SchedulerHandle,
};
use crate::types::{Finalize, FinalizeOutcome, JobStatus, RunAt};
use crate::worker::{Worker, WorkerConfig};

const MINUTE: Duration = Duration::from_secs(60);
/// How long a case waits for a scheduler's pass before it fails.
const PATIENCE: Duration = Duration::from_secs(30);

fn at(s: &str) -> DateTime<Utc> {
    s.parse().expect("an RFC 3339 instant")
}

fn minutely(name: &str, missed: Missed) -> Schedule {
    Schedule::every(name, MINUTE).unwrap().missed(missed)
}

fn start<B: Admin>(b: &B, clock: &ManualClock, schedules: &[Schedule]) -> SchedulerHandle {
    let mut scheduler = Scheduler::new(b.clone()).clock(clock.clone());
    for schedule in schedules {
        scheduler = scheduler.schedule(schedule.clone()).unwrap();
    }
    scheduler.start().unwrap()
}

/// Waits until `scheduler` has finished a pass that began at `seen` or later.
async fn passed(
    scheduler: &SchedulerHandle,
    seen: DateTime<Utc>,
) -> crate::schedule::SchedulerStats {
    scheduler
        .wait_for_timeout(PATIENCE, |s| s.seen >= Some(seen))
        .await
        .unwrap_or_else(|last| panic!("no pass at {seen} within {PATIENCE:?}: {last:?}"))
}

/// The period jobs of `schedule` at each of `periods` exist, due at their period; returns how
/// many jobs the queue holds in all.
async fn assert_one_job_per_period<B: Admin>(
    b: &B,
    schedule: &Schedule,
    periods: &[DateTime<Utc>],
) {
    for period in periods {
        let key = schedule.unique_key(*period);
        let job = b
            .find_by_unique_key(&key)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no job for period {period} of {}", schedule.name()));
        assert_eq!(
            job.next_attempt_at, *period,
            "the job of {key} is due at its period"
        );
    }
}

/// Snoozes each job `times` times, then completes it; counts the runs.
struct SnoozesThenCompletes {
    times: u32,
    runs: Arc<Mutex<u32>>,
}

impl Handler for SnoozesThenCompletes {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        let run = {
            let mut runs = self.runs.lock().unwrap();
            *runs += 1;
            *runs
        };
        if run <= self.times {
            return Err(JobError::snooze(Duration::ZERO));
        }
        Ok(())
    }
}

cases! {
    $ __conformance_scheduling;

    /// A snooze puts the job back for later, fenced: pending, due at the snooze's instant, the
    /// attempt given back, the last error and the history untouched, so the next run sees
    /// the same handler errors as before the snooze.
    pub async fn a_snooze_runs_later_without_counting_an_attempt<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let first = claim(b, 1).await.jobs.remove(0);
        let retry = Finalize::Retry {
            at: RunAt::Now,
            error: "503".into(),
        };
        assert!(b.finalize(first.claim(), &retry).await.unwrap().is_applied());
        let second = claim(b, 1).await.jobs.remove(0);
        assert_eq!((second.attempts, second.handler_errors()), (2, 1));
        let snooze = Finalize::Snooze {
            at: RunAt::After(Duration::from_secs(60)),
        };
        assert!(b.finalize(second.claim(), &snooze).await.unwrap().is_applied());
        let rec = record(b, id).await;
        assert_eq!((rec.status, rec.attempts), (JobStatus::Pending, 1));
        assert_eq!(rec.last_error.as_deref(), Some("503"), "a snooze is not an error");
        assert_eq!(rec.errors.len(), 1, "a snooze adds nothing to the history");
        assert!(rec.lease_expires_at.is_none());
        // The fence holds for snoozes too: the old claim cannot snooze the job again.
        assert_eq!(
            b.finalize(second.claim(), &snooze).await.unwrap(),
            FinalizeOutcome::Stale
        );
        assert!(claim(b, 1).await.jobs.is_empty(), "a snoozed job ran before its time");
        h.advance_clock(Duration::from_secs(61)).await;
        let third = claim(b, 1).await.jobs.remove(0);
        assert_eq!(third.id, id);
        assert_eq!(
            (third.attempts, third.handler_errors()),
            (2, 1),
            "the snoozed run counted"
        );
        // In a batch, a snooze applies as it does alone.
        let written = b
            .finalize_many(&[(third.claim(), Finalize::Snooze { at: RunAt::Now })])
            .await
            .unwrap();
        assert_eq!(written, vec![FinalizeOutcome::Applied]);
        let again = claim(b, 1).await.jobs.remove(0);
        assert_eq!((again.id, again.attempts), (id, 2));
    }

    /// A worker whose handler snoozes a job more often than `max_attempts` allows runs it to
    /// completion: snoozes never near the limit.
    pub async fn a_handler_may_snooze_past_max_attempts<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let runs = Arc::new(Mutex::new(0));
        let config = WorkerConfig {
            concurrency: 1,
            poll_interval: Duration::from_millis(10),
            retry: RetryPolicy {
                max_attempts: 1,
                ..RetryPolicy::default()
            },
            ..WorkerConfig::default()
        };
        let handler = SnoozesThenCompletes {
            times: 3,
            runs: runs.clone(),
        };
        let worker = Worker::new(b.clone(), handler, config).unwrap().start();
        let stats = worker.wait_for(|s| s.completed == 1).await;
        worker.shutdown().await.unwrap();
        assert_eq!((stats.snoozed, stats.failed), (3, 0), "{stats:?}");
        assert_eq!(*runs.lock().unwrap(), 4);
        let rec = record(b, id).await;
        assert_eq!((rec.status, rec.attempts), (JobStatus::Completed, 1));
        assert!(rec.last_error.is_none());
    }

    /// Three schedulers (clocks a few seconds apart, as three hosts' are) run one schedule
    /// through six periods: each period has exactly one job, none is missed, and a scheduler
    /// restarted in the middle of a period enqueues nothing new.
    pub async fn three_schedulers_enqueue_each_period_once<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let schedule = minutely("rates", Missed::default());
        let t0 = at("2026-01-01T00:00:30Z");
        let skews = [0i64, 2, -3];
        let clocks: Vec<ManualClock> = skews
            .iter()
            .map(|s| ManualClock::new(t0 + chrono::TimeDelta::seconds(*s)))
            .collect();
        let mut schedulers: Vec<SchedulerHandle> =
            clocks.iter().map(|c| start(b, c, std::slice::from_ref(&schedule))).collect();
        let mut periods = vec![at("2026-01-01T00:00:00Z")];
        for (scheduler, clock) in schedulers.iter().zip(&clocks) {
            passed(scheduler, clock.now()).await;
        }
        for step in 1..=5 {
            for clock in &clocks {
                clock.advance(MINUTE);
            }
            periods.push(periods[0] + chrono::TimeDelta::minutes(step));
            for (scheduler, clock) in schedulers.iter().zip(&clocks) {
                passed(scheduler, clock.now()).await;
            }
        }
        let stats: Vec<_> = schedulers.iter().map(|s| s.stats().schedules["rates"].clone()).collect();
        let enqueued: u64 = stats.iter().map(|s| s.enqueued).sum();
        let duplicates: u64 = stats.iter().map(|s| s.duplicates).sum();
        assert_eq!((enqueued, duplicates), (6, 12), "{stats:?}");
        assert!(stats.iter().all(|s| s.through == Some(periods[5]) && s.skipped == 0), "{stats:?}");
        assert_eq!(b.counts().await.unwrap().pending, 6);
        assert_one_job_per_period(b, &schedule, &periods).await;

        // A restart in the middle of the period of 00:05: its job is there already.
        schedulers.remove(0).shutdown().await;
        let restarted_clock = ManualClock::new(at("2026-01-01T00:05:45Z"));
        let restarted = start(b, &restarted_clock, std::slice::from_ref(&schedule));
        let after = passed(&restarted, restarted_clock.now()).await;
        assert_eq!(
            (after.schedules["rates"].enqueued, after.schedules["rates"].duplicates),
            (0, 1)
        );
        assert_eq!(b.counts().await.unwrap().pending, 6);
        restarted.shutdown().await;
        for scheduler in schedulers {
            scheduler.shutdown().await;
        }
    }

    /// The schedules a scheduler runs are recorded with the queue for operators: when their
    /// periods fall, what happens to missed ones, how far they got (never back, whichever
    /// scheduler lags), their next period, and who ran them last, by the store's clock; per
    /// queue; forgotten on request.
    pub async fn schedules_are_recorded_for_operators<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let rates = minutely("rates", Missed::CatchUp { within: 5 * MINUTE });
        let nightly = Schedule::cron("nightly", "0 2 * * *")
            .unwrap()
            .time_zone("Europe/Berlin")
            .unwrap();
        let clock = ManualClock::new(at("2026-01-01T00:00:30Z"));
        let scheduler = Scheduler::new(b.clone())
            .clock(clock.clone())
            .name("host-a:1")
            .schedule(rates.clone())
            .unwrap()
            .schedule(nightly.clone())
            .unwrap()
            .start()
            .unwrap();
        passed(&scheduler, clock.now()).await;
        clock.advance(MINUTE);
        passed(&scheduler, clock.now()).await;
        let shown = b.schedules().await.unwrap();
        let names: Vec<&str> = shown.iter().map(|s| s.report.name.as_str()).collect();
        assert_eq!(names, ["nightly", "rates"]);
        let (nightly_info, rates_info) = (&shown[0], &shown[1]);
        assert_eq!(rates_info.report.spec, rates.spec());
        assert_eq!(rates_info.report.missed, "catch up within 300s");
        assert_eq!(rates_info.report.through, Some(at("2026-01-01T00:01:00Z")));
        assert_eq!(rates_info.report.next, Some(at("2026-01-01T00:02:00Z")));
        assert_eq!(rates_info.seen_by, "host-a:1");
        assert_eq!(nightly_info.report.spec, "cron 0 2 * * * Europe/Berlin");
        assert_eq!(nightly_info.report.missed, "skip after 60s");
        assert_eq!(nightly_info.report.next, Some(at("2026-01-01T01:00:00Z")), "02:00 in Berlin");
        scheduler.shutdown().await;

        // A scheduler that lags reports an older period: the record keeps the latest.
        let mut lagging = rates_info.report.clone();
        lagging.through = Some(at("2026-01-01T00:00:00Z"));
        b.record_schedules("host-b:2", &[lagging]).await.unwrap();
        let shown = b.schedules().await.unwrap();
        assert_eq!(shown[1].report.through, Some(at("2026-01-01T00:01:00Z")));
        assert_eq!(shown[1].seen_by, "host-b:2");
        let other = h.other_queue(crate::types::QueueName::new("other").unwrap());
        assert!(other.schedules().await.unwrap().is_empty(), "per queue");
        let scheduled = h.other_queue(crate::types::QueueName::new("scheduled").unwrap());
        scheduled.record_schedules("host-c:3", &[shown[1].report.clone()]).await.unwrap();
        let queues = b.queues().await.unwrap();
        assert!(
            queues.iter().any(|q| q.as_str() == "scheduled"),
            "a queue whose only trace is a schedule is listed: {queues:?}"
        );

        assert!(b.forget_schedule("nightly").await.unwrap());
        assert!(!b.forget_schedule("nightly").await.unwrap(), "already forgotten");
        let names: Vec<String> =
            b.schedules().await.unwrap().into_iter().map(|s| s.report.name).collect();
        assert_eq!(names, ["rates"]);
    }

    /// Missed periods: a skipping schedule enqueues only the latest one within its grace, a
    /// catching-up one every period within its window, after downtime (a new scheduler) and
    /// after a stall of a running one (its clock jumping ten minutes).
    pub async fn missed_periods_are_skipped_or_caught_up_as_each_schedule_says<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let skips = minutely("skips", Missed::Skip { grace: MINUTE });
        let catches_up = minutely("catches-up", Missed::CatchUp { within: 5 * MINUTE });
        let both = [skips.clone(), catches_up.clone()];
        let minutes = |from: &str, n: i64| -> Vec<DateTime<Utc>> {
            (0..n).map(|k| at(from) + chrono::TimeDelta::minutes(k)).collect()
        };

        // Down until 00:10:30: the skipping schedule runs 00:10 only; the other looks back
        // five minutes, 00:06 to 00:10.
        let clock = ManualClock::new(at("2026-01-01T00:10:30Z"));
        let scheduler = start(b, &clock, &both);
        let first = passed(&scheduler, clock.now()).await;
        assert_eq!(first.schedules["skips"].enqueued, 1);
        assert_eq!(first.schedules["catches-up"].enqueued, 5);
        assert_one_job_per_period(b, &skips, &minutes("2026-01-01T00:10:00Z", 1)).await;
        assert_one_job_per_period(b, &catches_up, &minutes("2026-01-01T00:06:00Z", 5)).await;
        assert!(b.find_by_unique_key(&skips.unique_key(at("2026-01-01T00:09:00Z"))).await.unwrap().is_none());

        // Stalled ten minutes: the skipping schedule runs 00:20 and counts nine skipped; the
        // other runs 00:16 to 00:20 and counts 00:11 to 00:15 skipped.
        clock.advance(10 * MINUTE);
        let stalled = passed(&scheduler, clock.now()).await;
        let (s, c) = (&stalled.schedules["skips"], &stalled.schedules["catches-up"]);
        assert_eq!((s.enqueued, s.skipped), (2, 9), "{s:?}");
        assert_eq!((c.enqueued, c.skipped), (10, 5), "{c:?}");
        assert_eq!(s.through, Some(at("2026-01-01T00:20:00Z")));
        assert_one_job_per_period(b, &catches_up, &minutes("2026-01-01T00:16:00Z", 5)).await;
        assert_eq!(b.counts().await.unwrap().pending, 12);
        scheduler.shutdown().await;
    }

    /// Retention purges finished jobs per status and age, at start and then on its interval,
    /// in bounded batches; a scheduler is refused retention that would purge a schedule's
    /// jobs before the schedule stops looking back for them.
    pub async fn retention_purges_finished_jobs_on_its_interval<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let mut completed = Vec::new();
        for n in 0..5 {
            let id = enqueue(b, n).await;
            let job = claim(b, 1).await.jobs.remove(0);
            assert!(b.finalize(job.claim(), &Finalize::Complete).await.unwrap().is_applied());
            completed.push(id);
        }
        let failed = enqueue(b, 9).await;
        let job = claim(b, 1).await.jobs.remove(0);
        let fail = Finalize::Fail { error: "no".into() };
        assert!(b.finalize(job.claim(), &fail).await.unwrap().is_applied());
        let waiting = enqueue(b, 10).await;
        h.advance_clock(2 * 3600 * Duration::from_secs(1)).await;

        let retention = Retention::every(10 * MINUTE)
            .unwrap()
            .keep(&[JobStatus::Completed], Duration::from_secs(3600))
            .unwrap()
            .keep(&[JobStatus::Failed], Duration::from_secs(86_400))
            .unwrap()
            .batch_size(2);
        let clock = ManualClock::new(at("2026-01-01T00:00:00Z"));
        let scheduler = Scheduler::new(b.clone())
            .retention(retention.clone())
            .clock(clock.clone())
            .start()
            .unwrap();
        let first = scheduler
            .wait_for_timeout(PATIENCE, |s| s.retention_runs == 1)
            .await
            .unwrap();
        assert_eq!(first.purged, 5);
        for id in &completed {
            assert!(b.get(*id).await.unwrap().is_none(), "completed job {id} was kept");
        }
        assert!(b.get(failed).await.unwrap().is_some(), "a failed job is kept a day");
        assert!(b.get(waiting).await.unwrap().is_some());

        // The next run comes at the interval, not before.
        let late = enqueue(b, 11).await;
        let job = claim(b, 1).await.jobs.remove(0);
        assert_eq!(job.id, waiting);
        assert!(b.finalize(job.claim(), &Finalize::Complete).await.unwrap().is_applied());
        h.advance_clock(2 * 3600 * Duration::from_secs(1)).await;
        assert_eq!(first.retention_next, Some(at("2026-01-01T00:10:00Z")));
        clock.advance(10 * MINUTE);
        let second = scheduler
            .wait_for_timeout(PATIENCE, |s| s.retention_runs == 2)
            .await
            .unwrap();
        assert_eq!(second.purged, 6);
        assert!(b.get(waiting).await.unwrap().is_none());
        assert!(b.get(late).await.unwrap().is_some());
        scheduler.shutdown().await;

        let catches_up = minutely("daily", Missed::CatchUp { within: Duration::from_secs(7200) });
        let refused = Scheduler::new(b.clone())
            .schedule(catches_up)
            .unwrap()
            .retention(retention)
            .start();
        assert!(
            matches!(&refused, Err(crate::ConfigError::OutOfRange { name: "retention", .. })),
            "retention shorter than a catch-up window was accepted"
        );
    }
}
