//! What a schedule is: when its periods fall, what each enqueues, what happens to missed ones.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use chrono_tz::Tz;
use serde_json::json;

use crate::error::ConfigError;
use crate::types::{NewJob, RunAt};

/// The longest schedule name, in bytes.
pub const MAX_SCHEDULE_NAME: usize = 128;

/// The shortest interval a schedule runs at: one second.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// What a scheduler does with periods whose instant passed while no scheduler looked (every
/// process was down, or the store unreachable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missed {
    /// Run the latest missed period only, and only when it is at most `grace` old; the others
    /// are skipped (`queue.schedule_skipped` counts them). For work that only matters now:
    /// a cache refresh, a health probe. A restart shorter than `grace` loses nothing.
    Skip {
        /// How late a period may still be enqueued.
        grace: Duration,
    },
    /// Run every missed period at most `within` old, oldest first, each once; older ones are
    /// skipped. For work every period must see: a nightly report, an hourly export.
    CatchUp {
        /// How far back missed periods are enqueued.
        within: Duration,
    },
}

impl Default for Missed {
    /// [`Missed::Skip`] with a grace of one minute.
    fn default() -> Self {
        Missed::Skip {
            grace: Duration::from_secs(60),
        }
    }
}

/// `skip after 60s`, `catch up within 21600s`.
impl std::fmt::Display for Missed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missed::Skip { grace } => write!(f, "skip after {}s", grace.as_secs_f64()),
            Missed::CatchUp { within } => write!(f, "catch up within {}s", within.as_secs_f64()),
        }
    }
}

impl Missed {
    /// How far back a scheduler looks for periods: the grace or the catch-up window.
    pub fn window(self) -> Duration {
        match self {
            Missed::Skip { grace } => grace,
            Missed::CatchUp { within } => within,
        }
    }
}

/// When a schedule's periods fall.
#[derive(Clone)]
pub(crate) enum Every {
    Cron {
        cron: Box<croner::Cron>,
        expression: String,
        zone: Tz,
    },
    Interval {
        every: TimeDelta,
        anchor: DateTime<Utc>,
    },
}

impl Every {
    /// The first period strictly after `after`; `None` when the expression has no more.
    pub(crate) fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Every::Cron { cron, zone, .. } => cron
                .find_next_occurrence(&after.with_timezone(zone), false)
                .ok()
                .map(|at| at.with_timezone(&Utc)),
            Every::Interval { every, anchor } => {
                let step = every.num_milliseconds();
                let since = (after - *anchor).num_milliseconds();
                let k = since.div_euclid(step).checked_add(1)?;
                anchor.checked_add_signed(TimeDelta::try_milliseconds(k.checked_mul(step)?)?)
            }
        }
    }
}

/// A periodic job: a name, when its periods fall, and the job each period enqueues.
///
/// Each period enqueues exactly one job however many processes run the schedule: the job's
/// unique key is the schedule's name and the period's instant ([`Schedule::unique_key`]), so
/// every scheduler but the first finds the period's job already there. The job is due at the
/// period's instant.
///
/// ```
/// use std::time::Duration;
/// use queue_core::NewJob;
/// use queue_core::schedule::{Missed, Schedule};
///
/// // Every night at 02:00 in Berlin (daylight saving time included), none missed within 6 h.
/// let nightly = Schedule::cron("nightly-report", "0 2 * * *")?
///     .time_zone("Europe/Berlin")?
///     .missed(Missed::CatchUp { within: Duration::from_secs(6 * 3600) })
///     .job(|at| NewJob::from_value(serde_json::json!({ "report_for": at })));
/// // Every five minutes; a period missed by more than the default minute is skipped.
/// let refresh = Schedule::every("refresh-rates", Duration::from_secs(300))?;
/// assert_eq!(nightly.name(), "nightly-report");
/// assert_eq!(
///     refresh.unique_key("2026-01-01T00:05:00Z".parse().unwrap()),
///     "schedule:refresh-rates:2026-01-01T00:05:00.000Z"
/// );
/// # Ok::<(), queue_core::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Schedule {
    name: String,
    pub(crate) every: Every,
    missed: Missed,
    build: Arc<dyn Fn(DateTime<Utc>) -> NewJob + Send + Sync>,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("name", &self.name)
            .field("spec", &self.spec())
            .field("missed", &self.missed)
            .finish_non_exhaustive()
    }
}

impl Schedule {
    /// A schedule on a cron expression: five fields (minute, hour, day of month, month, day of
    /// week), or six with seconds first, as the `croner` crate reads them (`L`, `W` and `#`
    /// included). In UTC unless [`Schedule::time_zone`] says otherwise. Refused: a name outside
    /// [`valid_name`]'s rules, an expression that does not parse or never fires.
    pub fn cron(name: &str, expression: &str) -> Result<Self, ConfigError> {
        let name = valid_name(name)?;
        let cron = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Optional)
            .build()
            .parse(expression)
            .map_err(|err| ConfigError::InvalidCron {
                expression: expression.to_owned(),
                reason: err.to_string(),
            })?;
        let schedule = Schedule::with(
            name,
            Every::Cron {
                cron: Box::new(cron),
                expression: expression.to_owned(),
                zone: Tz::UTC,
            },
        );
        schedule.check_fires()?;
        Ok(schedule)
    }

    /// A schedule every `every` (at least [`MIN_INTERVAL`], in whole milliseconds), its periods
    /// counted from the Unix epoch unless [`Schedule::anchor`] says otherwise: every hour falls
    /// on the hour, every day at midnight UTC.
    pub fn every(name: &str, every: Duration) -> Result<Self, ConfigError> {
        let name = valid_name(name)?;
        if every < MIN_INTERVAL || !every.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::OutOfRange {
                name: "schedule interval",
                detail: format!("{every:?} is not a whole number of milliseconds of 1 s or more"),
            });
        }
        let every = TimeDelta::from_std(every).map_err(|_| ConfigError::OutOfRange {
            name: "schedule interval",
            detail: format!("{every:?} is too long"),
        })?;
        Ok(Schedule::with(
            name,
            Every::Interval {
                every,
                anchor: DateTime::UNIX_EPOCH,
            },
        ))
    }

    fn with(name: String, every: Every) -> Self {
        let label = name.clone();
        Schedule {
            name,
            every,
            missed: Missed::default(),
            build: Arc::new(move |at| NewJob::from_value(json!({ "schedule": label, "at": at }))),
        }
    }

    /// The time zone a cron expression is read in, by IANA name (`Europe/Berlin`): a period
    /// skipped by a daylight-saving jump forward is not run, one repeated by a jump back runs
    /// once. Refused for an unknown zone, and for an interval schedule (use
    /// [`Schedule::anchor`]).
    pub fn time_zone(mut self, zone: &str) -> Result<Self, ConfigError> {
        let parsed =
            Tz::from_str(zone).map_err(|_| ConfigError::UnknownTimeZone(zone.to_owned()))?;
        match &mut self.every {
            Every::Cron { zone: z, .. } => *z = parsed,
            Every::Interval { .. } => {
                return Err(ConfigError::OutOfRange {
                    name: "schedule time zone",
                    detail: "an interval schedule has no time zone; anchor it instead".to_owned(),
                });
            }
        }
        self.check_fires()?;
        Ok(self)
    }

    /// Counts an interval schedule's periods from `anchor` instead of the Unix epoch (an
    /// interval of a day anchored at 06:00 Berlin time runs at 06:00 UTC+1 every day, daylight
    /// saving time ignored). Ignored by a cron schedule.
    pub fn anchor(mut self, anchor: DateTime<Utc>) -> Self {
        if let Every::Interval { anchor: a, .. } = &mut self.every {
            *a = anchor;
        }
        self
    }

    /// What to do with missed periods; [`Missed::default`] unless set.
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// The job each period enqueues, built from the period's instant. Its unique key and run
    /// time are the scheduler's ([`Schedule::unique_key`], the period's instant); its payload
    /// and priority are yours. By default the payload is `{"schedule": name, "at": instant}`.
    pub fn job(mut self, build: impl Fn(DateTime<Utc>) -> NewJob + Send + Sync + 'static) -> Self {
        self.build = Arc::new(build);
        self
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How missed periods are handled.
    pub fn missed_policy(&self) -> Missed {
        self.missed
    }

    /// The schedule as text: `cron 0 2 * * * Europe/Berlin`, or `every 300s from
    /// 1970-01-01T00:00:00Z`.
    pub fn spec(&self) -> String {
        match &self.every {
            Every::Cron {
                expression, zone, ..
            } => format!("cron {expression} {zone}"),
            Every::Interval { every, anchor } => format!(
                "every {}s from {}",
                every.num_milliseconds() as f64 / 1000.0,
                anchor.to_rfc3339_opts(SecondsFormat::AutoSi, true)
            ),
        }
    }

    /// The unique key of the job for the period at `at`:
    /// `schedule:<name>:<instant in UTC, milliseconds>`.
    pub fn unique_key(&self, at: DateTime<Utc>) -> String {
        format!(
            "schedule:{}:{}",
            self.name,
            at.to_rfc3339_opts(SecondsFormat::Millis, true)
        )
    }

    /// The first period strictly after `after`.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.every.next_after(after)
    }

    /// The job for the period at `at`, keyed and due at the period.
    pub(crate) fn job_for(&self, at: DateTime<Utc>) -> NewJob {
        (self.build)(at)
            .unique_key(self.unique_key(at))
            .run_at(RunAt::At(at))
    }

    fn check_fires(&self) -> Result<(), ConfigError> {
        match &self.every {
            Every::Cron { expression, .. } if self.next_after(Utc::now()).is_none() => {
                Err(ConfigError::InvalidCron {
                    expression: expression.clone(),
                    reason: "it never fires".to_owned(),
                })
            }
            _ => Ok(()),
        }
    }
}

/// A schedule name as accepted: 1 to [`MAX_SCHEDULE_NAME`] bytes of ASCII letters, digits, `_`,
/// `-` and `.` (it is part of every unique key and metric label the schedule makes).
pub fn valid_name(name: &str) -> Result<String, ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SCHEDULE_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(name.to_owned())
    } else {
        Err(ConfigError::InvalidScheduleName(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn names_expressions_zones_and_intervals_are_validated() {
        for bad in ["", "has space", "colon:", "ü", &"x".repeat(129)] {
            assert!(
                matches!(
                    Schedule::every(bad, MIN_INTERVAL),
                    Err(ConfigError::InvalidScheduleName(_))
                ),
                "{bad:?} accepted"
            );
        }
        assert!(matches!(
            Schedule::cron("x", "61 * * * *"),
            Err(ConfigError::InvalidCron { .. })
        ));
        assert!(matches!(
            Schedule::cron("x", "0 0 31 2 *"),
            Err(ConfigError::InvalidCron { reason, .. }) if reason.contains("never")
        ));
        assert!(matches!(
            Schedule::cron("x", "0 * * * *")
                .unwrap()
                .time_zone("Mars/Olympus"),
            Err(ConfigError::UnknownTimeZone(_))
        ));
        assert!(
            Schedule::every("x", MIN_INTERVAL)
                .unwrap()
                .time_zone("UTC")
                .is_err()
        );
        for bad in [Duration::from_millis(999), Duration::from_micros(1_000_500)] {
            assert!(Schedule::every("x", bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn intervals_fall_on_multiples_of_their_anchor() {
        let hourly = Schedule::every("h", Duration::from_secs(3600)).unwrap();
        assert_eq!(
            hourly.next_after(at("2026-03-01T10:15:00Z")),
            Some(at("2026-03-01T11:00:00Z"))
        );
        // Strictly after: an instant on a period gives the next one.
        assert_eq!(
            hourly.next_after(at("2026-03-01T11:00:00Z")),
            Some(at("2026-03-01T12:00:00Z"))
        );
        let anchored = Schedule::every("a", Duration::from_secs(90))
            .unwrap()
            .anchor(at("2026-03-01T00:00:10Z"));
        assert_eq!(
            anchored.next_after(at("2026-03-01T00:00:00Z")),
            Some(at("2026-03-01T00:00:10Z"))
        );
        assert_eq!(
            anchored.next_after(at("2026-03-01T00:00:10Z")),
            Some(at("2026-03-01T00:01:40Z"))
        );
        assert_eq!(hourly.spec(), "every 3600s from 1970-01-01T00:00:00Z");
    }

    #[test]
    fn cron_reads_its_time_zone_through_daylight_saving_time() {
        let nightly = Schedule::cron("n", "30 2 * * *")
            .unwrap()
            .time_zone("Europe/Berlin")
            .unwrap();
        // Winter: 02:30 CET is 01:30 UTC.
        assert_eq!(
            nightly.next_after(at("2026-01-10T00:00:00Z")),
            Some(at("2026-01-10T01:30:00Z"))
        );
        // Summer: 02:30 CEST is 00:30 UTC.
        assert_eq!(
            nightly.next_after(at("2026-07-10T00:00:00Z")),
            Some(at("2026-07-10T00:30:00Z"))
        );
        // 2026-03-29 has no 02:30 in Berlin (clocks jump from 02:00 to 03:00).
        let spring = nightly.next_after(at("2026-03-28T23:00:00Z")).unwrap();
        assert_ne!(spring, at("2026-03-29T01:30:00Z"));
        assert_eq!(nightly.spec(), "cron 30 2 * * * Europe/Berlin");
        let seconds = Schedule::cron("s", "*/10 * * * * *").unwrap();
        assert_eq!(
            seconds.next_after(at("2026-01-01T00:00:01Z")),
            Some(at("2026-01-01T00:00:10Z"))
        );
    }

    #[test]
    fn a_period_job_is_keyed_and_due_at_its_instant() {
        let s = Schedule::every("rates", Duration::from_secs(60))
            .unwrap()
            .job(|at| {
                NewJob::from_value(json!({ "for": at }))
                    .priority(-2)
                    .unique_key("mine")
            });
        let job = s.job_for(at("2026-01-01T00:01:00Z"));
        assert_eq!(
            job.unique_key.as_deref(),
            Some("schedule:rates:2026-01-01T00:01:00.000Z")
        );
        assert_eq!(job.run_at, RunAt::At(at("2026-01-01T00:01:00Z")));
        assert_eq!(job.priority, -2);
        assert!(job.check().is_ok());
        let default = Schedule::every("d", Duration::from_secs(60)).unwrap();
        assert_eq!(
            default.job_for(at("2026-01-01T00:01:00Z")).payload,
            json!({ "schedule": "d", "at": "2026-01-01T00:01:00Z" })
        );
    }
}
