//! One function per named statement: typed values in, typed rows out, one error type, on any
//! [`Driver`] and any connection (pooled, a transaction, or the caller's own). The SQL is in
//! `sql/`; what the rows mean is here, once.

use std::time::Duration;

use chrono::{DateTime, Utc};
use queue_core::{
    CANCELLED_BY_OPERATOR, Claim, ClaimGeneration, ClaimRequest, ClaimToken, ClaimedJob, Enqueued,
    ErrorEntry, Finalize, FinalizeOutcome, FinishedCounts, Heartbeat, JobFilter, JobId, JobRecord,
    JobStatus, Lease, MinuteCounts, NewJob, PurgeRequest, QueueControl, QueueCounts, QueueLimits,
    QueueName, QueueStats, RetryTarget, ScheduleInfo, ScheduleReport,
};
use serde_json::Value;

use crate::driver::{Chain, Column, Driver, Params};
use crate::encode::{self, EnqueueColumns, FinalizeColumns, parse_status};
use crate::error::PgError;
use crate::ident::TableName;
use crate::schema::TableFacts;
use crate::sql::{self, Sql, col};

/// Where an enqueue goes: the queue, its table (for the id sequence) and the wake-up channel
/// (`None`: no `NOTIFY`).
pub(crate) struct EnqueueTarget<'a> {
    pub(crate) queue: &'a QueueName,
    pub(crate) quoted_table: &'a str,
    pub(crate) channel: Option<&'a str>,
}

/// The fewest jobs without unique keys that [`enqueue_copy`] sends by `COPY`: below it,
/// `enqueue_plain.sql` is as fast or faster (`docs/performance.md`: at 1 000 jobs a call,
/// `COPY` moved 0.77× the statement's jobs through tokio-postgres; its extra round trips cost
/// more than it saves).
pub(crate) const COPY_AT_LEAST: usize = 10_000;

/// Whether `jobs` go by [`enqueue_copy`]: enough of them, and none with a unique key.
pub(crate) fn copies(jobs: &[NewJob]) -> bool {
    jobs.len() >= COPY_AT_LEAST && jobs.iter().all(|job| job.unique_key.is_none())
}

/// A bulk enqueue of jobs without unique keys on `conn`, which must be inside a transaction
/// (ids, rows and wake-up commit together): `enqueue_ids.sql`, then `enqueue_copy.sql`, then
/// `notify.sql`. `Ok(None)` when a due time is out of range: the statement path reports it.
pub(crate) async fn enqueue_copy<D: Driver>(
    mut conn: D::Conn<'_>,
    sql: &Sql,
    target: &EnqueueTarget<'_>,
    jobs: &[NewJob],
) -> Result<Option<Vec<Enqueued>>, PgError> {
    let count = i64::try_from(jobs.len()).unwrap_or(i64::MAX);
    let rows = D::query(
        D::reborrow(&mut conn),
        &sql.enqueue_ids,
        &(target.quoted_table, count),
    )
    .await?;
    let no_row = PgError::NoRow {
        statement: "enqueue_ids",
    };
    let row = rows.first().ok_or(no_row)?;
    let ids: Vec<i64> = get::<D, _>(row, "ids")?;
    let now: DateTime<Utc> = get::<D, _>(row, "now")?;
    if jobs.is_empty() {
        return Ok(Some(Vec::new()));
    }
    // Fewer ids than jobs would leave jobs out of the COPY.
    if ids.len() != jobs.len() {
        return Err(PgError::IdsDrawn {
            drawn: ids.len(),
            jobs: jobs.len(),
        });
    }
    let Some(data) = encode::copy_rows(&ids, now, target.queue.as_str(), jobs) else {
        return Ok(None);
    };
    D::copy_in(D::reborrow(&mut conn), &sql.enqueue_copy, data).await?;
    if let Some(channel) = target.channel {
        notify::<D>(conn, sql, channel, target.queue).await?;
    }
    Ok(Some(
        ids.into_iter()
            .map(|id| Enqueued::inserted(JobId(id)))
            .collect(),
    ))
}

/// `enqueue.sql`, or `enqueue_plain.sql` when no job has a unique key: all the jobs or none,
/// one result per job in input order.
pub(crate) async fn enqueue<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    target: &EnqueueTarget<'_>,
    jobs: Vec<NewJob>,
) -> Result<Vec<Enqueued>, PgError> {
    let expected = jobs.len();
    let c = EnqueueColumns::new(jobs);
    let rows = if c.keys.iter().all(Option::is_none) {
        let params = (
            target.queue.as_str(),
            target.quoted_table,
            &c.payloads,
            &c.priorities,
            &c.run_ats,
            &c.delays,
            target.channel,
            &c.partitions,
        );
        D::query(conn, &sql.enqueue_plain, &params).await?
    } else {
        let params = (
            target.queue.as_str(),
            target.quoted_table,
            &c.payloads,
            &c.priorities,
            &c.run_ats,
            &c.delays,
            &c.keys,
            target.channel,
            &c.held_while,
            &c.held_for,
            &c.replaces,
            &c.partitions,
        );
        D::query(conn, &sql.enqueue, &params).await?
    };
    if rows.len() != expected {
        return Err(PgError::RowsAnswered {
            statement: "enqueue",
            rows: rows.len(),
            expected,
        });
    }
    rows.iter()
        .map(|row| {
            let id = JobId(get::<D, i64>(row, "id")?);
            if get::<D, bool>(row, "inserted")? {
                Ok(Enqueued::inserted(id))
            } else {
                Ok(Enqueued::existing(id, get::<D, bool>(row, "replaced")?))
            }
        })
        .collect()
}

/// `claim.sql`.
pub(crate) async fn claim<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &ClaimRequest,
) -> Result<Vec<ClaimedJob>, PgError> {
    let rows = claim_rows::<D>(conn, &sql.claim, queue, request).await?;
    rows.iter().map(claimed_job::<D>).collect()
}

/// The rows of a rendering of `claim.sql` (`statement`) run for `request`.
async fn claim_rows<D: Driver>(
    conn: D::Conn<'_>,
    statement: &str,
    queue: &QueueName,
    request: &ClaimRequest,
) -> Result<Vec<D::Row>, PgError> {
    let none = Vec::new();
    let params = claim_params(queue, request, &none);
    D::query(conn, statement, &params).await
}

/// [`crate::sql::claim_checked`]: `claim.sql`'s picks on a queue with limits, none applied, in
/// the transaction `conn` is in; [`claim_check`] follows, after [`lock_queue`]. Returns the jobs
/// and their partition keys, each once.
pub(crate) async fn claim_checked<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &ClaimRequest,
) -> Result<(Vec<ClaimedJob>, Vec<String>), PgError> {
    let rows = claim_rows::<D>(conn, &sql.claim_checked, queue, request).await?;
    let jobs = rows
        .iter()
        .map(claimed_job::<D>)
        .collect::<Result<_, _>>()?;
    let mut keys = std::collections::BTreeSet::new();
    for row in &rows {
        if let Some(key) = get::<D, Option<String>>(row, "partition_key")? {
            keys.insert(key);
        }
    }
    Ok((jobs, keys.into_iter().collect()))
}

/// `claim_check.sql` for a claim of jobs of the partitions `keys`, after [`lock_queue`] in the
/// claim's transaction: whether it puts the queue over a limit in flight (roll it back then).
pub(crate) async fn claim_check<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    keys: &[String],
) -> Result<bool, PgError> {
    let rows = D::query(conn, &sql.claim_check, &(queue.as_str(), keys)).await?;
    // The statement returns one row; none (never seen) counts as over: nothing stays.
    rows.first()
        .map_or(Ok(true), |row| get::<D, bool>(row, "over"))
}

/// `claim.sql`'s parameters: `$7` the ids the claim must not take over.
fn claim_params<'a>(
    queue: &'a QueueName,
    request: &'a ClaimRequest,
    not_taken_over: &'a Vec<i64>,
) -> impl Params<'a> + 'a {
    (
        queue.as_str(),
        i64::from(request.batch_size.max(1)),
        request.lease.as_secs_f64(),
        i32::try_from(request.max_reclaims).unwrap_or(i32::MAX),
        request.holder.as_deref(),
        ClaimToken::random().0,
        not_taken_over,
    )
}

/// `finalize.sql`'s parameters, `$1` to `$10`.
fn finalize_params<'a>(c: &'a FinalizeColumns<'_>) -> impl Params<'a> + 'a {
    (
        &c.ids,
        &c.generations,
        &c.statuses,
        &c.give_backs,
        &c.run_ats,
        &c.delays,
        &c.errors,
        &c.terminals,
        &c.kinds,
        &c.tokens,
    )
}

/// `finalize_claim.sql`: the outcomes of `items` (as [`finalize`]) and a claim (as [`claim`])
/// in one statement.
pub(crate) async fn finalize_claim<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    items: &[(Claim, Finalize)],
    request: &ClaimRequest,
) -> Result<(Vec<FinalizeOutcome>, Vec<ClaimedJob>), PgError> {
    let c = FinalizeColumns::new(items);
    // The claim's $7 (never taking over what this statement finalizes) is the outcomes' ids.
    let params = Chain(finalize_params(&c), claim_params(queue, request, &c.ids));
    let rows = D::query(conn, &sql.finalize_claim, &params).await?;
    let mut applied = Vec::new();
    let mut jobs = Vec::with_capacity(rows.len());
    for row in &rows {
        if get::<D, bool>(row, "finalized")? {
            applied.push(applied_write::<D>(row)?);
        } else {
            jobs.push(claimed_job::<D>(row)?);
        }
    }
    Ok((encode::outcomes(items, applied), jobs))
}

/// A row of the writes that applied: `(id, generation, token)`.
fn applied_write<D: Driver>(row: &D::Row) -> Result<(i64, i64, i64), PgError> {
    Ok((
        get::<D, i64>(row, "id")?,
        get::<D, i64>(row, "claim_generation")?,
        get::<D, i64>(row, "claim_token")?,
    ))
}

/// `finalize.sql`: one outcome per item, in order; an item repeated in one call applies at
/// most once.
pub(crate) async fn finalize<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    items: &[(Claim, Finalize)],
) -> Result<Vec<FinalizeOutcome>, PgError> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let c = FinalizeColumns::new(items);
    let applied = D::query(conn, &sql.finalize, &finalize_params(&c))
        .await?
        .iter()
        .map(applied_write::<D>)
        .collect::<Result<Vec<_>, PgError>>()?;
    Ok(encode::outcomes(items, applied))
}

/// `extend_lease.sql`.
pub(crate) async fn extend_lease<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    claim: Claim,
    lease: Lease,
) -> Result<Heartbeat, PgError> {
    let params = (
        claim.id.0,
        claim.generation.0,
        lease.as_secs_f64(),
        claim.token.0,
    );
    let rows = D::query(conn, &sql.extend_lease, &params).await?;
    Ok(match rows.first() {
        None => Heartbeat::Lost,
        Some(row) if get::<D, bool>(row, "cancel_requested")? => Heartbeat::CancelRequested,
        Some(_) => Heartbeat::Held,
    })
}

/// `extend_leases.sql`: one answer per claim, in order (`None`: its row was locked by another
/// transaction, ask again alone with [`extend_lease`]).
pub(crate) async fn extend_leases<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    claims: &[Claim],
    lease: Lease,
) -> Result<Vec<Option<Heartbeat>>, PgError> {
    let ids: Vec<i64> = claims.iter().map(|c| c.id.0).collect();
    let generations: Vec<i64> = claims.iter().map(|c| c.generation.0).collect();
    let tokens: Vec<i64> = claims.iter().map(|c| c.token.0).collect();
    let params = (&ids, &generations, lease.as_secs_f64(), &tokens);
    let rows = D::query(conn, &sql.extend_leases, &params).await?;
    let mut answers = std::collections::HashMap::with_capacity(rows.len());
    for row in &rows {
        let claim = (
            get::<D, i64>(row, "id")?,
            get::<D, i64>(row, "claim_generation")?,
            get::<D, i64>(row, "claim_token")?,
        );
        let answer = match get::<D, String>(row, "answer")?.as_str() {
            "held" => Some(Heartbeat::Held),
            "cancel_requested" => Some(Heartbeat::CancelRequested),
            "lost" => Some(Heartbeat::Lost),
            _ => None,
        };
        answers.insert(claim, answer);
    }
    claims
        .iter()
        .map(|c| {
            answers
                .get(&(c.id.0, c.generation.0, c.token.0))
                .copied()
                .ok_or(PgError::NoRow {
                    statement: "extend_leases.sql",
                })
        })
        .collect()
}

/// What `cancel.sql` did: `None` when there is no such job; otherwise whether it cancelled the
/// job, whether it requested its cancel, and the status the statement saw.
pub(crate) async fn cancel<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    id: JobId,
) -> Result<Option<(bool, bool, JobStatus)>, PgError> {
    let params = (id.0, queue.as_str(), CANCELLED_BY_OPERATOR);
    let rows = D::query(conn, &sql.cancel, &params).await?;
    rows.first()
        .map(|row| {
            let status = parse_status(id.0, get::<D, String>(row, "status")?)?;
            let cancelled = get::<D, bool>(row, "cancelled")?;
            Ok((cancelled, get::<D, bool>(row, "requested")?, status))
        })
        .transpose()
}

/// `get.sql`.
pub(crate) async fn get_job<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    id: JobId,
) -> Result<Option<JobRecord>, PgError> {
    let rows = D::query(conn, &sql.get, &(id.0, queue.as_str())).await?;
    rows.first().map(job_record::<D>).transpose()
}

/// `counts.sql`.
pub(crate) async fn counts<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
) -> Result<QueueCounts, PgError> {
    let mut counts = QueueCounts::default();
    for row in D::query(conn, &sql.counts, &(queue.as_str(),)).await? {
        let status = parse_status(-1, get::<D, String>(&row, "status")?)?;
        counts.add(status, get::<D, i64>(&row, "jobs")? as u64);
    }
    Ok(counts)
}

/// `stats.sql`.
pub(crate) async fn stats<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    window: Duration,
) -> Result<QueueStats, PgError> {
    let params = (
        queue.as_str(),
        window.as_secs_f64(),
        queue_core::Lease::DEFAULT.duration().as_secs_f64(),
        QueueStats::COUNT_CAP as i64,
    );
    let rows = D::query(conn, &sql.stats, &params).await?;
    let row = rows.first().ok_or(PgError::NoRow {
        statement: "stats.sql",
    })?;
    let count = |column| get::<D, i64>(row, column).map(|n| n.max(0) as u64);
    let wait: Option<f64> = get::<D, _>(row, "oldest_due_wait_secs")?;
    Ok(QueueStats {
        due: count("due")?,
        scheduled: count("scheduled")?,
        in_flight: count("in_flight")?,
        lease_expired: count("expired")?,
        lease_expiring: count("expiring")?,
        oldest_due_wait: wait.map(|secs| Duration::from_secs_f64(secs.max(0.0))),
        finished_last_hour: FinishedCounts {
            completed: count("completed")?,
            failed: count("failed")?,
            dead: count("dead")?,
            cancelled: count("cancelled")?,
        },
    })
}

/// `sweep_finished.sql`, once: how many rows it deleted.
pub(crate) async fn sweep_finished<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    older_than: Duration,
    limit: i64,
) -> Result<u64, PgError> {
    D::execute(
        conn,
        &sql.sweep_finished,
        &(older_than.as_secs_f64(), limit),
    )
    .await
}

/// `notify.sql`: the queue's wake-up, delivered when `conn`'s transaction commits.
pub(crate) async fn notify<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    channel: &str,
    queue: &QueueName,
) -> Result<(), PgError> {
    D::query(conn, &sql.notify, &(channel, queue.as_str())).await?;
    Ok(())
}

/// `table_columns.sql`, `table_indexes.sql` and `table_id_sequence.sql`: what the schema check
/// judges.
/// `table_exists.sql` (rendered as `exists`): whether the relation `quoted` is on the search path.
async fn relation_exists<D: Driver>(
    conn: D::Conn<'_>,
    exists: &str,
    quoted: &str,
) -> Result<bool, PgError> {
    let rows = D::query(conn, exists, &(quoted,)).await?;
    match rows.first() {
        Some(row) => get::<D, bool>(row, "present"),
        None => Ok(false),
    }
}

pub(crate) async fn table_facts<D: Driver>(
    mut conn: D::Conn<'_>,
    table: &TableName,
) -> Result<TableFacts, PgError> {
    let quoted = table.quoted();
    let text = |template| sql::for_table(template, table);
    let params = (quoted.as_str(),);
    let columns = D::query(D::reborrow(&mut conn), &text(sql::TABLE_COLUMNS)?, &params)
        .await?
        .iter()
        .map(|row| {
            Ok((
                get::<D, String>(row, "name")?,
                get::<D, String>(row, "type")?,
            ))
        })
        .collect::<Result<Vec<_>, PgError>>()?;
    let mut indexes = Vec::new();
    let mut invalid_indexes = Vec::new();
    for row in D::query(D::reborrow(&mut conn), &text(sql::TABLE_INDEXES)?, &params).await? {
        let name = get::<D, String>(&row, "name")?;
        if get::<D, bool>(&row, "valid")? {
            indexes.push(name);
        } else {
            invalid_indexes.push(name);
        }
    }
    // pg_get_serial_sequence fails on a table without `id`: ask only when there is one.
    let id_has_sequence = if columns.iter().any(|(name, _)| name == col::ID) {
        let rows = D::query(
            D::reborrow(&mut conn),
            &text(sql::TABLE_ID_SEQUENCE)?,
            &params,
        )
        .await?;
        match rows.first() {
            Some(row) => get::<D, Option<bool>>(row, "has_sequence")? == Some(true),
            None => false,
        }
    } else {
        false
    };
    let controls = table.controls_quoted();
    let exists = sql::for_table(sql::TABLE_EXISTS, table)?;
    let has_controls_table =
        relation_exists::<D>(D::reborrow(&mut conn), &exists, &controls).await?;
    let schedules = format!("\"{table}_schedules\"");
    let has_schedules_table =
        relation_exists::<D>(D::reborrow(&mut conn), &exists, &schedules).await?;
    let starts = format!("\"{table}_starts\"");
    let has_partition_starts_table =
        relation_exists::<D>(D::reborrow(&mut conn), &exists, &starts).await?;
    let claim_starts = format!("\"{table}_claim_starts\"");
    let has_claim_starts_table =
        relation_exists::<D>(D::reborrow(&mut conn), &exists, &claim_starts).await?;
    let grants = format!("\"{table}_grants\"");
    let has_grants_table = relation_exists::<D>(D::reborrow(&mut conn), &exists, &grants).await?;
    let (controls_columns, controls_triggers) = if has_controls_table {
        let columns = D::query(
            D::reborrow(&mut conn),
            &text(sql::TABLE_COLUMNS)?,
            &(controls.as_str(),),
        )
        .await?
        .iter()
        .map(|row| get::<D, String>(row, "name"))
        .collect::<Result<Vec<_>, PgError>>()?;
        let triggers = D::query(conn, &text(sql::TABLE_TRIGGERS)?, &(controls.as_str(),))
            .await?
            .iter()
            .map(|row| get::<D, String>(row, "name"))
            .collect::<Result<Vec<_>, PgError>>()?;
        (columns, triggers)
    } else {
        (Vec::new(), Vec::new())
    };
    Ok(TableFacts {
        columns,
        indexes,
        invalid_indexes,
        has_controls_table,
        controls_columns,
        controls_triggers,
        has_schedules_table,
        has_partition_starts_table,
        has_claim_starts_table,
        has_grants_table,
        id_has_sequence,
    })
}

fn get<D: Driver, T: Column>(row: &D::Row, column: &str) -> Result<T, PgError> {
    D::get(row, column)
}

/// A row of `claim.sql` as a claimed job.
fn claimed_job<D: Driver>(row: &D::Row) -> Result<ClaimedJob, PgError> {
    Ok(ClaimedJob {
        id: JobId(get::<D, _>(row, "id")?),
        generation: ClaimGeneration(get::<D, _>(row, "claim_generation")?),
        token: ClaimToken(get::<D, _>(row, "claim_token")?),
        attempts: get::<D, _>(row, "attempts")?,
        reclaims: get::<D, _>(row, "reclaims")?,
        taken_over: get::<D, _>(row, "taken_over")?,
        over_reclaim_cap: get::<D, _>(row, "over_reclaim_cap")?,
        cancel_requested: get::<D, _>(row, "cancel_requested")?,
        claimed_at: get::<D, _>(row, "claimed_at")?,
        due_at: get::<D, _>(row, "due_at")?,
        priority: get::<D, _>(row, "priority")?,
        payload: get::<D, _>(row, "payload")?,
    })
}

/// A row of `get.sql` (the table's [`sql::COLUMNS`]) as a job record.
/// `list_jobs.sql`: up to `filter.limit + 1` rows, newest first.
pub(crate) async fn list_jobs<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    filter: &JobFilter,
) -> Result<Vec<JobRecord>, PgError> {
    let text = sql.list_jobs(&filter.statuses)?;
    let params = (
        queue.as_str(),
        filter.before.map(|id| id.0),
        i64::from(filter.limit) + 1,
    );
    D::query(conn, &text, &params)
        .await?
        .iter()
        .map(job_record::<D>)
        .collect()
}

/// `find_unique.sql`.
pub(crate) async fn find_unique<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    key: &str,
) -> Result<Option<JobRecord>, PgError> {
    let rows = D::query(conn, &sql.find_unique, &(queue.as_str(), key)).await?;
    rows.first().map(job_record::<D>).transpose()
}

/// `retry.sql`.
pub(crate) async fn retry<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    id: JobId,
    seen: JobStatus,
) -> Result<RetryTarget, PgError> {
    let rows = D::query(conn, &sql.retry, &(id.0, queue.as_str(), seen.as_str())).await?;
    let Some(row) = rows.first() else {
        return Ok(RetryTarget::NotFound);
    };
    let job = job_record::<D>(row)?;
    Ok(if get::<D, bool>(row, "reopened")? {
        RetryTarget::Retried(Box::new(job))
    } else {
        RetryTarget::WrongState(job.status)
    })
}

/// `purge.sql`: one batch.
pub(crate) async fn purge<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &PurgeRequest,
) -> Result<u64, PgError> {
    let statuses: Vec<&str> = request.statuses().iter().map(|s| s.as_str()).collect();
    let params = (
        queue.as_str(),
        &statuses,
        request.older_than().as_secs_f64(),
        i64::from(request.rows_per_batch()),
    );
    let rows = D::query(conn, &sql.purge, &params).await?;
    let row = rows.first().ok_or(PgError::NoRow {
        statement: "purge.sql",
    })?;
    Ok(get::<D, i64>(row, "deleted")?.max(0) as u64)
}

/// `pause.sql`: pauses (`true`) or resumes the queue; returns its controls after the change.
/// A queue without a row gets one with room grants switched as `grants_if_new` says.
pub(crate) async fn pause<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    paused: bool,
    grants_if_new: bool,
) -> Result<QueueControl, PgError> {
    let rows = D::query(conn, &sql.pause, &(queue.as_str(), paused, grants_if_new)).await?;
    let row = rows.first().ok_or(PgError::NoRow {
        statement: "pause.sql",
    })?;
    queue_control::<D>(row)
}

/// `queue_control.sql`.
pub(crate) async fn control<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
) -> Result<QueueControl, PgError> {
    let rows = D::query(conn, &sql.queue_control, &(queue.as_str(),)).await?;
    match rows.first() {
        Some(row) => queue_control::<D>(row),
        None => Ok(QueueControl::default()),
    }
}

fn queue_control<D: Driver>(row: &D::Row) -> Result<QueueControl, PgError> {
    Ok(QueueControl {
        paused_at: get::<D, _>(row, "paused_at")?,
        stale_fences: get::<D, i64>(row, "stale_fences")?.max(0) as u64,
        last_stale_at: get::<D, _>(row, "last_stale_at")?,
        limits: queue_limits::<D>(row)?,
        room_grants: get::<D, bool>(row, "room_grants")?,
    })
}

/// The limits columns of a `"{table}_queues"` row (see [`QueueLimits::from_stored`]).
pub(crate) fn queue_limits<D: Driver>(row: &D::Row) -> Result<QueueLimits, PgError> {
    Ok(QueueLimits::from_stored(
        get::<D, Option<i32>>(row, "max_in_flight")?.map(i64::from),
        get::<D, Option<i32>>(row, "rate_starts")?.map(i64::from),
        get::<D, Option<i64>>(row, "rate_per_ms")?,
        get::<D, Option<i32>>(row, "max_per_partition")?.map(i64::from),
        get::<D, Option<i32>>(row, "partition_rate_starts")?.map(i64::from),
        get::<D, Option<i64>>(row, "partition_rate_per_ms")?,
    ))
}

/// `set_limits.sql`: stores the queue's limits; returns its controls after the change. A
/// queue without a row gets one with room grants switched as `grants_if_new` says.
pub(crate) async fn set_limits<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    limits: &QueueLimits,
    grants_if_new: bool,
) -> Result<QueueControl, PgError> {
    let max_in_flight = limits
        .max_in_flight
        .map(|n| i32::try_from(n).unwrap_or(i32::MAX));
    let starts = limits.rate.map(|r| r.starts() as i32);
    let per_ms = limits.rate.map(|r| r.per().as_millis() as i64);
    let per_partition = limits
        .max_per_partition
        .map(|n| i32::try_from(n).unwrap_or(i32::MAX));
    let partition_starts = limits.rate_per_partition.map(|r| r.starts() as i32);
    let partition_per_ms = limits
        .rate_per_partition
        .map(|r| r.per().as_millis() as i64);
    let params = (
        queue.as_str(),
        max_in_flight,
        starts,
        per_ms,
        per_partition,
        partition_starts,
        partition_per_ms,
        grants_if_new,
    );
    let rows = D::query(conn, &sql.set_limits, &params).await?;
    let row = rows.first().ok_or(PgError::NoRow {
        statement: "set_limits.sql",
    })?;
    queue_control::<D>(row)
}

/// `lock_queue.sql`: locks the queue's controls row for the transaction `conn` is in and
/// returns its limits (none when it has no row).
pub(crate) async fn lock_queue<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
) -> Result<(QueueLimits, bool), PgError> {
    let rows = D::query(conn, &sql.lock_queue, &(queue.as_str(),)).await?;
    match rows.first() {
        Some(row) => Ok((queue_limits::<D>(row)?, get::<D, bool>(row, "room_grants")?)),
        None => Ok((QueueLimits::NONE, false)),
    }
}

/// `fold_starts.sql`: moves the claims the queue made while its tally left room for whole
/// claims into its partitions' logs, in the transaction of [`lock_queue`], after it.
pub(crate) async fn fold_starts<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
) -> Result<(), PgError> {
    D::execute(conn, &sql.fold_starts, &(queue.as_str(),)).await?;
    Ok(())
}

pub(crate) use crate::sql::LimitedForm;

/// What a claim of a queue with limits did.
#[derive(Debug, Default)]
pub(crate) struct LimitedClaim {
    pub(crate) jobs: Vec<ClaimedJob>,
    /// A claim of the queue committed after the statement's snapshot was taken: it claimed
    /// nothing (never after [`lock_queue`] in the same transaction).
    pub(crate) stale: bool,
    /// Its pick would have put a partition over its limit: it took no pending job, and
    /// `claim_turns.sql` should claim the rest of the batch.
    pub(crate) turns: bool,
    /// Claims made while the queue's tally left room for whole claims are not yet in its
    /// partitions' logs, and this claim counts per partition: it claimed nothing; run
    /// [`fold_starts`] after [`lock_queue`], then claim again in that transaction.
    pub(crate) fold: bool,
    /// The lean form met a queue with limits per partition: it claimed nothing; claim with
    /// the full form.
    pub(crate) partitioned: bool,
    /// `claim_ahead.sql` found the room not ample: it claimed nothing; claim under the lock.
    pub(crate) binding: bool,
    /// `claim_ahead.sql`'s jobs would have put the queue over a limit: it failed, and nothing
    /// it wrote stays.
    pub(crate) over: bool,
}

impl LimitedClaim {
    /// The claimed jobs and the markers among a limited claim's rows.
    fn read<D: Driver>(rows: &[D::Row]) -> Result<Self, PgError> {
        let mut claim = LimitedClaim::default();
        for row in rows {
            match get::<D, Option<String>>(row, "marker")?.as_deref() {
                None => claim.jobs.push(claimed_job::<D>(row)?),
                Some("stale") => claim.stale = true,
                Some("fold") => claim.fold = true,
                Some("partitioned") => claim.partitioned = true,
                Some("binding") => claim.binding = true,
                Some(_) => claim.turns = true,
            }
        }
        Ok(claim)
    }
}

/// `claim_limited.sql` (either form) or `claim_turns.sql`.
pub(crate) async fn claim_limited<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &ClaimRequest,
    form: LimitedForm,
) -> Result<LimitedClaim, PgError> {
    let none = Vec::new();
    let params = claim_params(queue, request, &none);
    let statement = match form {
        LimitedForm::Lean => &sql.claim_limited_lean,
        LimitedForm::Pick => &sql.claim_limited,
        LimitedForm::Turns => &sql.claim_turns,
    };
    let rows = D::query(conn, statement, &params).await?;
    LimitedClaim::read::<D>(&rows)
}

/// `claim_ahead.sql` with its margin (`$8`), a transaction of its own (`conn` in none).
pub(crate) async fn claim_ahead<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &ClaimRequest,
    margin: u32,
) -> Result<LimitedClaim, PgError> {
    let none = Vec::new();
    let params = Chain(claim_params(queue, request, &none), (i64::from(margin),));
    match D::query(conn, &sql.claim_ahead, &params).await {
        Ok(rows) => LimitedClaim::read::<D>(&rows),
        Err(err) if is_ahead_over(&err) => Ok(LimitedClaim {
            over: true,
            ..LimitedClaim::default()
        }),
        Err(err) => Err(err),
    }
}

/// Whether `err` is `claim_ahead.sql`'s own refusal of a claim over the queue's limits.
fn is_ahead_over(err: &PgError) -> bool {
    is_refusal(err, crate::sql::AHEAD_OVER)
}

/// Whether `err` is a statement's own refusal named `text` (SQLSTATE 22P02, the text cast to a
/// number), which undid everything it wrote.
fn is_refusal(err: &PgError, text: &str) -> bool {
    err.sqlstate().as_deref() == Some("22P02")
        && err
            .server_message()
            .is_some_and(|message| message.contains(text))
}

/// `grant.sql`, in the transaction of [`lock_queue`], after it: a grant of `claims` claims of
/// `request`'s batch, living `life`, deleting the holder's `spent` grants: its `grant_id`, or
/// `None` when none is granted.
pub(crate) async fn grant<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &ClaimRequest,
    claims: u32,
    life: Duration,
    spent: &Vec<i64>,
) -> Result<Option<i64>, PgError> {
    let life_ms = i64::try_from(life.as_millis()).unwrap_or(i64::MAX);
    let params = (
        queue.as_str(),
        request.holder.as_deref(),
        i64::from(request.batch_size.max(1)),
        i64::from(claims.max(1)),
        life_ms,
        spent,
    );
    let rows = D::query(conn, &sql.grant, &params).await?;
    rows.first()
        .map(|row| get::<D, i64>(row, "grant_id"))
        .transpose()
}

/// What a claim on a grant (`claim_granted.sql`) came to.
#[derive(Debug)]
pub(crate) enum GrantedClaim {
    /// Committed; the grant as the claim left it (`None` when the claim took nothing and
    /// spent nothing).
    Claimed(Vec<ClaimedJob>, Option<(i64, i32)>),
    /// The grant is gone, expired, or has not the room: nothing stays.
    Over,
}

/// `claim_granted.sql`: a claim of `request` on the grant `grant`.
pub(crate) async fn claim_granted<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    request: &ClaimRequest,
    grant: i64,
) -> Result<GrantedClaim, PgError> {
    let none = Vec::new();
    let params = Chain(claim_params(queue, request, &none), (grant,));
    match D::query(conn, &sql.claim_granted, &params).await {
        Ok(rows) => {
            let mut jobs = Vec::new();
            let mut left = None;
            for row in &rows {
                match get::<D, Option<i64>>(row, "jobs_left")? {
                    Some(jobs_left) => {
                        left = Some((jobs_left, get::<D, i32>(row, "claims_left")?));
                    }
                    None => jobs.push(claimed_job::<D>(row)?),
                }
            }
            Ok(GrantedClaim::Claimed(jobs, left))
        }
        Err(err) if is_refusal(&err, crate::sql::GRANT_OVER) => Ok(GrantedClaim::Over),
        Err(err) => Err(err),
    }
}

/// `return_grant.sql`: deletes the grant `grant`, its room back.
pub(crate) async fn return_grant<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    grant: i64,
) -> Result<(), PgError> {
    D::execute(conn, &sql.return_grant, &(queue.as_str(), grant)).await?;
    Ok(())
}

/// `set_room_grants.sql`: switches room grants on or off for `queue`.
pub(crate) async fn set_room_grants<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    on: bool,
) -> Result<bool, PgError> {
    let rows = D::query(conn, &sql.set_room_grants, &(queue.as_str(), on)).await?;
    match rows.first() {
        Some(row) => get::<D, bool>(row, "room_grants"),
        None => Ok(on),
    }
}

/// `record_schedules.sql`: the scheduler `seen_by`'s schedules of `queue`.
pub(crate) async fn record_schedules<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    seen_by: &str,
    reports: &[ScheduleReport],
) -> Result<(), PgError> {
    let column = |f: fn(&ScheduleReport) -> String| reports.iter().map(f).collect::<Vec<_>>();
    let names = column(|r| r.name.clone());
    let specs = column(|r| queue_core::limits::storable_text(&r.spec).into_owned());
    let missed = column(|r| r.missed.clone());
    let through: Vec<Option<DateTime<Utc>>> = reports.iter().map(|r| r.through).collect();
    let next: Vec<Option<DateTime<Utc>>> = reports.iter().map(|r| r.next).collect();
    let seen_by = queue_core::limits::storable_holder(seen_by);
    let params = (
        queue.as_str(),
        seen_by.as_str(),
        &names,
        &specs,
        &missed,
        &through,
        &next,
    );
    D::execute(conn, &sql.record_schedules, &params).await?;
    Ok(())
}

/// `schedules.sql`: the schedules recorded for `queue`, by name.
pub(crate) async fn schedules<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
) -> Result<Vec<ScheduleInfo>, PgError> {
    let rows = D::query(conn, &sql.schedules, &(queue.as_str(),)).await?;
    rows.iter()
        .map(|row| {
            Ok(ScheduleInfo {
                report: ScheduleReport {
                    name: get::<D, _>(row, "name")?,
                    spec: get::<D, _>(row, "spec")?,
                    missed: get::<D, _>(row, "missed")?,
                    through: get::<D, _>(row, "through")?,
                    next: get::<D, _>(row, "next_at")?,
                },
                seen_at: get::<D, _>(row, "seen_at")?,
                seen_by: get::<D, _>(row, "seen_by")?,
            })
        })
        .collect()
}

/// `forget_schedule.sql`: whether the schedule was recorded.
pub(crate) async fn forget_schedule<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    name: &str,
) -> Result<bool, PgError> {
    let rows = D::query(conn, &sql.forget_schedule, &(queue.as_str(), name)).await?;
    Ok(!rows.is_empty())
}

/// `record_stale.sql`; a queue without a row gets one with room grants switched as
/// `grants_if_new` says.
pub(crate) async fn record_stale<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    count: u64,
    grants_if_new: bool,
) -> Result<(), PgError> {
    let count = i64::try_from(count).unwrap_or(i64::MAX);
    D::execute(
        conn,
        &sql.record_stale,
        &(queue.as_str(), count, grants_if_new),
    )
    .await?;
    Ok(())
}

/// `throughput.sql`.
pub(crate) async fn throughput<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
    queue: &QueueName,
    minutes: u32,
) -> Result<Vec<MinuteCounts>, PgError> {
    let minutes = i32::try_from(minutes.clamp(1, 1_440)).unwrap_or(1_440);
    let rows = D::query(conn, &sql.throughput, &(queue.as_str(), minutes)).await?;
    rows.iter()
        .map(|row| {
            let n = |column| get::<D, i64>(row, column).map(|n| n.max(0) as u64);
            Ok(MinuteCounts {
                minute: get::<D, _>(row, "minute")?,
                finished: FinishedCounts {
                    completed: n("completed")?,
                    failed: n("failed")?,
                    dead: n("dead")?,
                    cancelled: n("cancelled")?,
                },
            })
        })
        .collect()
}

/// `queues.sql`.
pub(crate) async fn queues<D: Driver>(
    conn: D::Conn<'_>,
    sql: &Sql,
) -> Result<Vec<QueueName>, PgError> {
    D::query(conn, &sql.queues, &())
        .await?
        .iter()
        .map(|row| Ok(QueueName::new(get::<D, String>(row, "queue")?)?))
        .collect()
}

/// The database's clock (`clock_timestamp()`: now, not the transaction's start).
pub(crate) async fn clock<D: Driver>(conn: D::Conn<'_>) -> Result<DateTime<Utc>, PgError> {
    let rows = D::query(conn, "SELECT clock_timestamp() AS now", &()).await?;
    let row = rows.first().ok_or(PgError::NoRow { statement: "clock" })?;
    get::<D, _>(row, "now")
}

/// `claims_running.sql`: claim statements still running that started before `since`.
pub(crate) async fn claims_running<D: Driver>(
    conn: D::Conn<'_>,
    since: DateTime<Utc>,
) -> Result<i64, PgError> {
    let text = sql::render(sql::CLAIMS_RUNNING, &[])?;
    let rows = D::query(conn, &text, &(since, sql::claim_first_line())).await?;
    let row = rows.first().ok_or(PgError::NoRow {
        statement: sql::CLAIMS_RUNNING.name,
    })?;
    get::<D, i64>(row, "running")
}

/// A job's error history as stored (a JSON array written by `finalize.sql`). A value edited by
/// hand into something else reads as no history, entry by entry: the job stays readable.
fn error_history(_id: i64, errors: Value) -> Result<Vec<ErrorEntry>, PgError> {
    Ok(match errors {
        Value::Array(entries) => entries
            .into_iter()
            .filter_map(|entry| serde_json::from_value(entry).ok())
            .collect(),
        _ => Vec::new(),
    })
}

fn job_record<D: Driver>(row: &D::Row) -> Result<JobRecord, PgError> {
    let id: i64 = get::<D, _>(row, col::ID)?;
    Ok(JobRecord {
        id: JobId(id),
        queue: get::<D, _>(row, col::QUEUE)?,
        status: parse_status(id, get::<D, _>(row, col::STATUS)?)?,
        payload: get::<D, _>(row, col::PAYLOAD)?,
        priority: get::<D, _>(row, col::PRIORITY)?,
        attempts: get::<D, _>(row, col::ATTEMPTS)?,
        reclaims: get::<D, _>(row, col::RECLAIMS)?,
        next_attempt_at: get::<D, _>(row, col::NEXT_ATTEMPT_AT)?,
        claimed_at: get::<D, _>(row, col::CLAIMED_AT)?,
        lease_expires_at: get::<D, _>(row, col::LEASE_EXPIRES_AT)?,
        cancel_requested_at: get::<D, _>(row, col::CANCEL_REQUESTED_AT)?,
        claim_generation: ClaimGeneration(get::<D, _>(row, col::CLAIM_GENERATION)?),
        claim_token: ClaimToken(get::<D, _>(row, col::CLAIM_TOKEN)?),
        last_error: get::<D, _>(row, col::LAST_ERROR)?,
        unique_key: get::<D, _>(row, col::UNIQUE_KEY)?,
        partition_key: get::<D, _>(row, col::PARTITION_KEY)?,
        claimed_by: get::<D, _>(row, col::CLAIMED_BY)?,
        errors: error_history(id, get::<D, Value>(row, col::ERRORS)?)?,
        created_at: get::<D, _>(row, col::CREATED_AT)?,
        updated_at: get::<D, _>(row, col::UPDATED_AT)?,
        finished_at: get::<D, _>(row, col::FINISHED_AT)?,
    })
}
