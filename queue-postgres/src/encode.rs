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

/// The rows of `enqueue_copy.sql` in COPY's text format: one line per job with its id, the
/// queue, the payload, the priority, the due time (`now` plus the delay, or the instant
/// given) and the partition key, every text escaped as COPY reads it. `None` when a delay puts a due time out of
/// range (the statement path then reports it as the database does).
pub(crate) fn copy_rows(
    ids: &[i64],
    now: DateTime<Utc>,
    queue: &str,
    jobs: &[NewJob],
) -> Option<Vec<u8>> {
    let mut out = String::with_capacity(ids.len() * 64);
    for (id, job) in ids.iter().zip(jobs) {
        let due = match split_run_at(job.run_at) {
            (Some(at), _) => at,
            (None, Some(delay)) if delay.is_finite() && delay.abs() < 1e15 => {
                now.checked_add_signed(chrono::TimeDelta::microseconds((delay * 1e6) as i64))?
            }
            (None, Some(_)) => return None,
            (None, None) => now,
        };
        out.push_str(&id.to_string());
        out.push('\t');
        escape_copy_text(&mut out, queue);
        out.push('\t');
        escape_copy_text(&mut out, &job.payload.to_string());
        out.push('\t');
        out.push_str(&job.priority.to_string());
        out.push('\t');
        out.push_str(&due.format("%Y-%m-%d %H:%M:%S%.6f+00").to_string());
        out.push('\t');
        match &job.partition_key {
            Some(key) => escape_copy_text(&mut out, key),
            // COPY's text format reads \N as NULL.
            None => out.push_str("\\N"),
        }
        out.push('\n');
    }
    Some(out.into_bytes())
}

/// Appends `text` escaped for COPY's text format: a backslash, tab, newline or carriage
/// return would otherwise end a field or a row, or start an escape.
fn escape_copy_text(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
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

    #[test]
    fn copy_rows_escape_what_would_end_a_field_or_a_row() {
        // A tab, a backslash, a newline and a carriage return in a payload string.
        let job = NewJob::from_value(serde_json::json!({ "s": "a\tb\\n\nc\r" }));
        let now = DateTime::parse_from_rfc3339("2026-12-02T01:02:03.5Z")
            .unwrap()
            .with_timezone(&Utc);
        let keyed = NewJob::from_value(serde_json::json!(1)).partition_key("p\t\\1");
        let rows = copy_rows(&[7, 8], now, r"q\1", &[job, keyed]).unwrap();
        let text = String::from_utf8(rows).unwrap();
        // The JSON text keeps its own escapes, each backslash doubled for COPY; the queue's and
        // the partition key's too. No partition key is \N, COPY's NULL.
        let expected = [
            "7",
            r"q\\1",
            r#"{"s":"a\\tb\\\\n\\nc\\r"}"#,
            "0",
            "2026-12-02 01:02:03.500000+00",
            r"\N",
        ]
        .join("\t")
            + "\n"
            + &[
                "8",
                r"q\\1",
                "1",
                "0",
                "2026-12-02 01:02:03.500000+00",
                r"p\t\\1",
            ]
            .join("\t")
            + "\n";
        assert_eq!(text, expected);
        let far = NewJob::from_value(serde_json::json!({}))
            .run_at(RunAt::After(std::time::Duration::from_secs(u64::MAX / 2)));
        assert!(copy_rows(&[1], now, "q", &[far]).is_none());
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
