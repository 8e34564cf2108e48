//! The driver-independent halves of enqueue and finalize: turning jobs and outcomes into the
//! statements' array parameters, and their result rows back into per-item results. Both drivers
//! bind the same columns to the same statements.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use queue_core::{Claim, Enqueued, Finalize, FinalizeOutcome, JobId, JobStatus, NewJob, RunAt};
use serde_json::Value;

use crate::error::PgError;

/// The array parameters of [`crate::sql::ENQUEUE`] (`$3` … `$7`).
#[derive(Debug, Default)]
pub(crate) struct EnqueueColumns {
    pub payloads: Vec<Value>,
    pub priorities: Vec<i16>,
    pub run_ats: Vec<Option<DateTime<Utc>>>,
    pub delays: Vec<Option<f64>>,
    pub keys: Vec<Option<String>>,
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
        }
        columns
    }
}

/// The rows of [`crate::sql::ENQUEUE`] turned into results: duplicates of a key inserted earlier
/// in the same batch get that job's id; the keys returned still need a lookup
/// ([`crate::sql::LOOKUP_UNIQUE`]) and [`resolve_duplicates`].
pub(crate) fn enqueued_from_rows(
    rows: impl IntoIterator<Item = (i64, bool, Option<String>)>,
) -> (Vec<Enqueued>, Vec<(usize, String)>) {
    let mut out = Vec::new();
    let mut first_by_key: HashMap<String, JobId> = HashMap::new();
    let mut unresolved = Vec::new();
    for (index, (id, inserted, key)) in rows.into_iter().enumerate() {
        let id = JobId(id);
        if inserted {
            if let Some(key) = key {
                first_by_key.entry(key).or_insert(id);
            }
            out.push(Enqueued {
                id,
                duplicate: false,
            });
        } else {
            // Only a unique-key conflict skips an insert, so a skipped row has a key.
            let key = key.unwrap_or_default();
            let id = first_by_key.get(&key).copied().unwrap_or(id);
            out.push(Enqueued {
                id,
                duplicate: true,
            });
            if !first_by_key.contains_key(&key) {
                unresolved.push((index, key));
            }
        }
    }
    (out, unresolved)
}

/// Points the unresolved duplicates at the jobs that hold their keys.
pub(crate) fn resolve_duplicates(
    out: &mut [Enqueued],
    unresolved: Vec<(usize, String)>,
    holders: HashMap<String, i64>,
) -> Result<(), PgError> {
    for (index, key) in unresolved {
        let id = holders
            .get(&key)
            .copied()
            .ok_or(PgError::UniqueKeyHolderMissing { key })?;
        out[index].id = JobId(id);
    }
    Ok(())
}

/// The array parameters of [`crate::sql::FINALIZE`].
#[derive(Debug, Default)]
pub(crate) struct FinalizeColumns<'a> {
    pub ids: Vec<i64>,
    pub generations: Vec<i64>,
    pub kinds: Vec<&'static str>,
    pub run_ats: Vec<Option<DateTime<Utc>>>,
    pub delays: Vec<Option<f64>>,
    pub errors: Vec<Option<&'a str>>,
}

impl<'a> FinalizeColumns<'a> {
    pub fn new(items: &'a [(Claim, Finalize)]) -> Self {
        let mut columns = FinalizeColumns::default();
        for (claim, action) in items {
            let (at, delay, error) = match action {
                Finalize::RetryAt { at, error } => {
                    let (at, delay) = split_run_at(*at);
                    (at, delay, Some(error.as_str()))
                }
                Finalize::FailTerminal { error } => (None, None, Some(error.as_str())),
                Finalize::Cancel { reason } | Finalize::Bury { reason } => {
                    (None, None, Some(reason.as_str()))
                }
                Finalize::Complete | Finalize::Release => (None, None, None),
            };
            columns.ids.push(claim.id.0);
            columns.generations.push(claim.generation.0);
            columns.kinds.push(action.kind());
            columns.run_ats.push(at);
            columns.delays.push(delay);
            columns.errors.push(error);
        }
        columns
    }
}

/// One outcome per item from the `(id, generation)` pairs the statement returned; an item
/// repeated in the same call applies at most once.
pub(crate) fn outcomes(
    items: &[(Claim, Finalize)],
    applied: impl IntoIterator<Item = (i64, i64)>,
) -> Vec<FinalizeOutcome> {
    let mut applied: HashSet<(i64, i64)> = applied.into_iter().collect();
    items
        .iter()
        .map(|(claim, _)| {
            FinalizeOutcome::from_rows_affected(
                applied.remove(&(claim.id.0, claim.generation.0)) as u64
            )
        })
        .collect()
}

/// Builds a [`queue_core::ClaimedJob`] from a row of [`crate::sql::CLAIM`]. A macro, not a
/// function: both drivers' rows read columns with `try_get(name)`, through different traits.
macro_rules! claimed_job_from_row {
    ($row:expr) => {
        queue_core::ClaimedJob {
            id: queue_core::JobId($row.try_get("id")?),
            generation: queue_core::ClaimGeneration($row.try_get("claim_generation")?),
            attempts: $row.try_get("attempts")?,
            reclaims: $row.try_get("reclaims")?,
            taken_over: $row.try_get("taken_over")?,
            over_reclaim_cap: $row.try_get("over_reclaim_cap")?,
            claimed_at: $row.try_get("claimed_at")?,
            priority: $row.try_get("priority")?,
            payload: $row.try_get("payload")?,
        }
    };
}

/// Builds a [`queue_core::JobRecord`] from a row of [`crate::sql::GET`] (see
/// `claimed_job_from_row!` for why a macro).
macro_rules! job_record_from_row {
    ($row:expr) => {{
        let id: i64 = $row.try_get("id")?;
        queue_core::JobRecord {
            id: queue_core::JobId(id),
            queue: $row.try_get("queue")?,
            status: $crate::batch::parse_status(id, $row.try_get("status")?)?,
            payload: $row.try_get("payload")?,
            priority: $row.try_get("priority")?,
            attempts: $row.try_get("attempts")?,
            reclaims: $row.try_get("reclaims")?,
            next_attempt_at: $row.try_get("next_attempt_at")?,
            claimed_at: $row.try_get("claimed_at")?,
            claim_generation: queue_core::ClaimGeneration($row.try_get("claim_generation")?),
            last_error: $row.try_get("last_error")?,
            unique_key: $row.try_get("unique_key")?,
            created_at: $row.try_get("created_at")?,
            updated_at: $row.try_get("updated_at")?,
            finished_at: $row.try_get("finished_at")?,
        }
    }};
}

pub(crate) use {claimed_job_from_row, job_record_from_row};

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
    use queue_core::ClaimGeneration;

    #[test]
    fn duplicates_within_a_batch_point_at_the_first_holder() {
        let rows = vec![
            (10, true, Some("a".to_owned())),
            (11, false, Some("a".to_owned())),
            (12, false, Some("b".to_owned())),
            (13, true, None),
        ];
        let (mut out, unresolved) = enqueued_from_rows(rows);
        assert_eq!(
            out[1],
            Enqueued {
                id: JobId(10),
                duplicate: true
            }
        );
        assert_eq!(unresolved, vec![(2, "b".to_owned())]);
        resolve_duplicates(&mut out, unresolved, HashMap::from([("b".to_owned(), 7)])).unwrap();
        assert_eq!(
            out[2],
            Enqueued {
                id: JobId(7),
                duplicate: true
            }
        );
        assert!(!out[3].duplicate);
        let gone = resolve_duplicates(&mut out, vec![(0, "z".into())], HashMap::new());
        assert!(matches!(gone, Err(PgError::UniqueKeyHolderMissing { .. })));
    }

    #[test]
    fn a_repeated_item_applies_once() {
        let claim = Claim {
            id: JobId(1),
            generation: ClaimGeneration(2),
        };
        let items = [(claim, Finalize::Complete), (claim, Finalize::Complete)];
        assert_eq!(
            outcomes(&items, [(1, 2)]),
            vec![FinalizeOutcome::Applied, FinalizeOutcome::Stale]
        );
    }
}
