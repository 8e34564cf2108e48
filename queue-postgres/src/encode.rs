//! Turning jobs and outcomes into the statements' array parameters, and their result rows back
//! into per-item results. What each outcome writes is decided here, once, from
//! [`queue_core::Finalize`]; `finalize.sql` only applies it.

use std::borrow::Cow;
use std::collections::HashSet;

use chrono::{DateTime, Utc};
use queue_core::limits::{storable_run_at, storable_text};
use queue_core::{Claim, Finalize, FinalizeOutcome, JobStatus, NewJob, RunAt};
use serde_json::Value;

use crate::error::PgError;

/// The array parameters of `enqueue.sql` (`$3` … `$7`).
#[derive(Debug, Default)]
pub(crate) struct EnqueueColumns {
    pub payloads: Vec<Value>,
    pub priorities: Vec<i16>,
    pub run_ats: Vec<Option<DateTime<Utc>>>,
    pub delays: Vec<Option<f64>>,
    pub keys: Vec<Option<String>>,
    /// Each job's [`queue_core::UniqueScope`]: the statuses a holder keeps the key in, as a
    /// text array literal (`None`: every status); how long it keeps it, in seconds; whether a
    /// duplicate replaces a pending holder.
    pub held_while: Vec<Option<String>>,
    pub held_for: Vec<Option<f64>>,
    pub replaces: Vec<bool>,
    /// Each job's partition key.
    pub partitions: Vec<Option<String>>,
}

impl EnqueueColumns {
    pub fn new(jobs: Vec<NewJob>) -> Self {
        let mut columns = EnqueueColumns::default();
        for job in jobs {
            let (at, delay) = split_run_at(job.run_at);
            columns.payloads.push(job.payload);
            columns.priorities.push(job.priority);
            columns.run_ats.push(at);
            columns.delays.push(delay);
            columns.keys.push(job.unique_key);
            let statuses = job.unique.held_while.map(|statuses| {
                let names: Vec<&str> = statuses.iter().map(|s| s.as_str()).collect();
                format!("{{{}}}", names.join(","))
            });
            columns.held_while.push(statuses);
            columns
                .held_for
                .push(job.unique.held_for.map(|period| period.as_secs_f64()));
            columns.replaces.push(job.unique.replace);
            columns.partitions.push(job.partition_key);
        }
        columns
    }
}

/// The array parameters of `finalize.sql`, one element per write.
#[derive(Debug, Default)]
pub(crate) struct FinalizeColumns<'a> {
    pub ids: Vec<i64>,
    pub generations: Vec<i64>,
    pub tokens: Vec<i64>,
    /// The status the write leaves the job in.
    pub statuses: Vec<&'static str>,
    /// Whether the claim's attempt is given back (a release: the job did not run).
    pub give_backs: Vec<bool>,
    /// A retry's instant, or its delay; both `None` keep `next_attempt_at`.
    pub run_ats: Vec<Option<DateTime<Utc>>>,
    pub delays: Vec<Option<f64>>,
    /// The error or reason kept in `last_error` (made storable); `None` keeps the previous one.
    pub errors: Vec<Option<Cow<'a, str>>>,
    /// Whether the status is terminal (stamps `finished_at`).
    pub terminals: Vec<bool>,
    /// The outcome's name ([`Finalize::kind`]), kept in the error history.
    pub kinds: Vec<&'static str>,
}

impl<'a> FinalizeColumns<'a> {
    pub fn new(items: &'a [(Claim, Finalize)]) -> Self {
        let mut columns = FinalizeColumns::default();
        for (claim, action) in items {
            let text = |s: &'a String| Some(storable_text(s));
            let (at, delay, error) = match action {
                // A retry always moves next_attempt_at: "now" is a delay of zero.
                Finalize::Retry { at, error } => match split_run_at(storable_run_at(*at)) {
                    (None, None) => (None, Some(0.0), text(error)),
                    (at, delay) => (at, delay, text(error)),
                },
                Finalize::Fail { error } => (None, None, text(error)),
                Finalize::Cancel { reason } | Finalize::Dead { reason } => {
                    (None, None, text(reason))
                }
                // A snooze, as a retry, always moves next_attempt_at.
                Finalize::Snooze { at } => match split_run_at(storable_run_at(*at)) {
                    (None, None) => (None, Some(0.0), None),
                    (at, delay) => (at, delay, None),
                },
                Finalize::Complete | Finalize::Release => (None, None, None),
            };
            let status = action.target_status();
            columns.ids.push(claim.id.0);
            columns.generations.push(claim.generation.0);
            columns.tokens.push(claim.token.0);
            columns.statuses.push(status.as_str());
            columns.give_backs.push(action.gives_back_attempt());
            columns.run_ats.push(at);
            columns.delays.push(delay);
            columns.errors.push(error);
            columns.terminals.push(status.is_terminal());
            columns.kinds.push(action.kind());
        }
        columns
    }
}

/// One outcome per item from the `(id, generation, token)` triples the statement returned (a
/// batch never holds one claim twice: see `queue_core::limits::check_batch`; two claims of one
/// job that differ only in their token, as after a failover that reissued a generation, are
/// told apart).
pub(crate) fn outcomes(
    items: &[(Claim, Finalize)],
    applied: impl IntoIterator<Item = (i64, i64, i64)>,
) -> Vec<FinalizeOutcome> {
    let mut applied: HashSet<(i64, i64, i64)> = applied.into_iter().collect();
    items
        .iter()
        .map(|(claim, _)| {
            FinalizeOutcome::from_rows_affected(applied.remove(&(
                claim.id.0,
                claim.generation.0,
                claim.token.0,
            )) as u64)
        })
        .collect()
}

/// The rows of `enqueue_copy.sql` in COPY's binary format: one tuple per job with its id, the
/// queue, the payload, the priority, the due time (`now` plus the delay, or the instant given)
/// and the partition key. Binary, so the server parses no number, time or escape; only the
/// payload's JSON text, which `jsonb` reads in either format. `None` when a due time falls
/// outside what PostgreSQL stores (the statement path then reports it as the database does).
///
/// Written here rather than through a driver's binary writer so both drivers send the same
/// bytes (sqlx has no binary COPY encoder).
pub(crate) fn copy_rows(
    ids: &[i64],
    now: DateTime<Utc>,
    queue: &str,
    jobs: &[NewJob],
) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(COPY_HEADER.len() + 2 + ids.len() * 96);
    out.extend_from_slice(COPY_HEADER);
    for (id, job) in ids.iter().zip(jobs) {
        let due = match split_run_at(job.run_at) {
            (Some(at), _) => at,
            (None, Some(delay)) if delay.is_finite() && delay.abs() < 1e15 => {
                now.checked_add_signed(chrono::TimeDelta::microseconds((delay * 1e6) as i64))?
            }
            (None, Some(_)) => return None,
            (None, None) => now,
        };
        let due = pg_timestamp(due)?;
        out.extend_from_slice(&COPY_FIELDS.to_be_bytes());
        copy_field(&mut out, &id.to_be_bytes());
        copy_field(&mut out, queue.as_bytes());
        // jsonb's binary form: a version byte, then the JSON text, written in place.
        let at = begin_field(&mut out);
        out.push(JSONB_VERSION);
        serde_json::to_writer(&mut out, &job.payload).ok()?;
        end_field(&mut out, at)?;
        copy_field(&mut out, &job.priority.to_be_bytes());
        copy_field(&mut out, &due.to_be_bytes());
        match &job.partition_key {
            Some(key) => copy_field(&mut out, key.as_bytes()),
            None => out.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    out.extend_from_slice(&(-1i16).to_be_bytes());
    Some(out)
}

/// COPY's binary signature, then no flags and no header extension.
const COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
/// The columns `enqueue_copy.sql` names.
const COPY_FIELDS: i16 = 6;
const JSONB_VERSION: u8 = 1;
/// PostgreSQL's earliest timestamp (4714-11-24 BC) and the first it cannot store (294277 AD),
/// in microseconds from 2000-01-01, its binary epoch.
const PG_MIN_MICROS: i64 = -211_813_488_000_000_000;
const PG_END_MICROS: i64 = 9_223_371_331_200_000_000;

/// `at` as a binary `timestamptz`: microseconds from 2000-01-01 UTC, `None` out of range.
fn pg_timestamp(at: DateTime<Utc>) -> Option<i64> {
    let epoch = DateTime::from_timestamp(946_684_800, 0)?;
    let micros = (at - epoch).num_microseconds()?;
    (PG_MIN_MICROS..PG_END_MICROS)
        .contains(&micros)
        .then_some(micros)
}

fn copy_field(out: &mut Vec<u8>, bytes: &[u8]) {
    // Every field is far below 2 GiB: the payload, the only large one, is written in place.
    out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Reserves a field's length; [`end_field`] writes it once the field is written.
fn begin_field(out: &mut Vec<u8>) -> usize {
    out.extend_from_slice(&[0; 4]);
    out.len()
}

fn end_field(out: &mut [u8], start: usize) -> Option<()> {
    let len = i32::try_from(out.len() - start).ok()?;
    out[start - 4..start].copy_from_slice(&len.to_be_bytes());
    Some(())
}

pub(crate) fn split_run_at(run_at: RunAt) -> (Option<DateTime<Utc>>, Option<f64>) {
    match run_at {
        RunAt::Now => (None, None),
        RunAt::After(delay) => (None, Some(delay.as_secs_f64())),
        RunAt::At(at) => (Some(at), None),
    }
}

pub(crate) fn parse_status(id: i64, status: String) -> Result<JobStatus, PgError> {
    JobStatus::parse(&status).ok_or(PgError::UnknownStatus { id, status })
}

#[cfg(test)]
mod tests {
    use super::*;
    use queue_core::{ClaimGeneration, ClaimToken, JobId};

    /// Reads COPY's binary format back: the tuples' fields (`None` for NULL).
    fn read_copy(mut data: &[u8]) -> Vec<Vec<Option<Vec<u8>>>> {
        let mut take = |n: usize| {
            let (head, rest) = data.split_at(n);
            data = rest;
            head.to_vec()
        };
        assert_eq!(take(11), b"PGCOPY\n\xff\r\n\0", "the signature");
        assert_eq!(take(8), [0; 8], "no flags, no header extension");
        let mut tuples = Vec::new();
        loop {
            let fields = i16::from_be_bytes(take(2).try_into().unwrap());
            if fields == -1 {
                assert!(take(0).is_empty());
                break;
            }
            let tuple = (0..fields)
                .map(|_| {
                    let len = i32::from_be_bytes(take(4).try_into().unwrap());
                    (len >= 0).then(|| take(len as usize))
                })
                .collect();
            tuples.push(tuple);
        }
        assert!(data.is_empty(), "nothing after the trailer");
        tuples
    }

    #[test]
    fn copy_rows_are_binary_tuples_of_the_named_columns() {
        // Text a row format could mistake for a separator or an escape stays as it is.
        let job = NewJob::from_value(serde_json::json!({ "s": "a\tb\\N\nc\r" }));
        let now = DateTime::parse_from_rfc3339("2026-12-02T01:02:03.5Z")
            .unwrap()
            .with_timezone(&Utc);
        let keyed = NewJob::from_value(serde_json::json!(1))
            .partition_key("p\t\\1")
            .priority(-3)
            .run_at(RunAt::After(std::time::Duration::from_micros(1_500_001)));
        let rows = copy_rows(&[7, 8], now, r"q\1", &[job, keyed]).unwrap();
        let tuples = read_copy(&rows);
        // 2026-12-02T01:02:03.5Z in microseconds from 2000-01-01 UTC.
        let due = 849_488_523_500_000i64;
        let field = |bytes: &[u8]| Some(bytes.to_vec());
        assert_eq!(
            tuples,
            [
                vec![
                    field(&7i64.to_be_bytes()),
                    field(b"q\\1"),
                    field(&[b"\x01".as_slice(), br#"{"s":"a\tb\\N\nc\r"}"#].concat()),
                    field(&0i16.to_be_bytes()),
                    field(&due.to_be_bytes()),
                    None,
                ],
                vec![
                    field(&8i64.to_be_bytes()),
                    field(b"q\\1"),
                    field(b"\x011"),
                    field(&(-3i16).to_be_bytes()),
                    field(&(due + 1_500_001).to_be_bytes()),
                    field(b"p\t\\1"),
                ],
            ]
        );
        assert_eq!(
            read_copy(&copy_rows(&[], now, "q", &[]).unwrap()),
            Vec::<Vec<_>>::new()
        );
    }

    #[test]
    fn copy_rows_leave_a_due_time_out_of_range_to_the_statement_path() {
        let now = Utc::now();
        let far = NewJob::from_value(serde_json::json!({}))
            .run_at(RunAt::After(std::time::Duration::from_secs(u64::MAX / 2)));
        assert!(copy_rows(&[1], now, "q", &[far]).is_none());
        let day = |y, m, d| {
            chrono::NaiveDate::from_ymd_opt(y, m, d)
                .unwrap()
                .and_hms_opt(0, 0, 0)
                .unwrap()
                .and_utc()
        };
        let before_postgres = day(-4713, 11, 23);
        let ancient = NewJob::from_value(serde_json::json!({})).run_at(RunAt::At(before_postgres));
        assert!(copy_rows(&[1], now, "q", &[ancient]).is_none());
        let earliest = day(-4713, 11, 24);
        let first = NewJob::from_value(serde_json::json!({})).run_at(RunAt::At(earliest));
        assert!(
            copy_rows(&[1], now, "q", &[first]).is_some(),
            "PostgreSQL's first day"
        );
    }

    #[test]
    fn each_outcome_writes_its_status_and_only_what_it_owns() {
        let claim = Claim {
            id: JobId(1),
            generation: ClaimGeneration(2),
            token: ClaimToken(3),
        };
        let items = [
            (claim, Finalize::Complete),
            (claim, Finalize::Fail { error: "no".into() }),
            (
                claim,
                Finalize::Retry {
                    at: RunAt::Now,
                    error: "later".into(),
                },
            ),
            (claim, Finalize::Release),
            (
                claim,
                Finalize::Cancel {
                    reason: "moot".into(),
                },
            ),
            (
                claim,
                Finalize::Dead {
                    reason: "poison".into(),
                },
            ),
        ];
        let c = FinalizeColumns::new(&items);
        assert_eq!(
            c.statuses,
            [
                "completed",
                "failed",
                "pending",
                "pending",
                "cancelled",
                "dead"
            ]
        );
        assert_eq!(c.give_backs, [false, false, false, true, false, false]);
        assert_eq!(c.terminals, [true, true, false, false, true, true]);
        let errors: Vec<Option<&str>> = c.errors.iter().map(|e| e.as_deref()).collect();
        assert_eq!(
            errors,
            [
                None,
                Some("no"),
                Some("later"),
                None,
                Some("moot"),
                Some("poison")
            ]
        );
        // Only a retry moves next_attempt_at; "now" is a delay of zero.
        assert_eq!(c.delays, [None, None, Some(0.0), None, None, None]);
        assert!(c.run_ats.iter().all(Option::is_none));
        for (item, status) in items.iter().zip(&c.statuses) {
            assert_eq!(item.1.target_status().as_str(), *status);
        }
    }
}
