//! What the commands print: tables for people, one JSON document with `--json`. Payloads are
//! printed only when asked for (`jobs show --show-payload`); error texts are the stored ones,
//! which the framework keeps free of payload values.

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use comfy_table::{Table, presets};
use queue_core::{
    Admin, Backend, JobFilter, JobPage, JobRecord, JobStatus, QueueControl, QueueName, ScheduleInfo,
};
use queue_postgres::PgQueue;
use serde_json::{Value, json};

use crate::commands::{CtlError, Exit, ItemResult};

/// Where the output goes, and in which form.
pub(crate) struct Out {
    json: bool,
}

impl Out {
    pub(crate) fn new(json: bool) -> Self {
        Out { json }
    }

    /// Prints `text` for people, or `document` as JSON.
    pub(crate) fn done(&self, text: &str, document: &Value) -> Result<(), CtlError> {
        let mut stdout = std::io::stdout().lock();
        if self.json {
            serde_json::to_writer_pretty(&mut stdout, document).map_err(std::io::Error::from)?;
            writeln!(stdout)?;
        } else {
            writeln!(stdout, "{text}")?;
        }
        Ok(())
    }

    /// A job or a schedule that is not there: the message on stderr, and with `--json` a
    /// document on stdout.
    pub(crate) fn not_found(&self, text: &str) -> Result<(), CtlError> {
        eprintln!("{text}");
        if self.json {
            self.done(
                text,
                &json!({ "error": text, "exit": Exit::NotFound as u8 }),
            )?;
        }
        Ok(())
    }

    /// A failed command: with `--json`, a document on stdout as well as the message on stderr.
    pub(crate) fn error(json: bool, err: &CtlError) {
        if json {
            let document = json!({ "error": err.to_string(), "exit": err.exit() as u8 });
            println!("{document}");
        }
    }

    fn table(&self, table: Table, document: &Value) -> Result<(), CtlError> {
        let text = table.to_string();
        self.done(&text, document)
    }
}

fn new_table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(presets::UTF8_BORDERS_ONLY);
    table.set_header(header.to_vec());
    table
}

fn seconds(duration: Duration) -> String {
    humantime::format_duration(Duration::from_secs(duration.as_secs())).to_string()
}

fn instant(at: Option<DateTime<Utc>>) -> String {
    at.map_or_else(
        || "-".to_owned(),
        |at| at.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string(),
    )
}

pub(crate) fn control_json(queue: &QueueName, control: &QueueControl) -> Value {
    json!({
        "queue": queue.as_str(),
        "paused": control.is_paused(),
        "paused_at": control.paused_at,
        "limits": limits_json(&control.limits),
        "room_grants": control.room_grants,
    })
}

/// A queue's limits as JSON: `max_in_flight`, `rate` as `{starts, per_ms}`,
/// `max_per_partition` and `rate_per_partition` as `{starts, per_ms}` (null: none).
pub(crate) fn limits_json(limits: &queue_core::QueueLimits) -> Value {
    let rate_json = |rate: queue_core::RateLimit| {
        json!({
            "starts": rate.starts(),
            "per_ms": rate.per().as_millis() as u64,
        })
    };
    json!({
        "max_in_flight": limits.max_in_flight,
        "rate": limits.rate.map(rate_json),
        "max_per_partition": limits.max_per_partition,
        "rate_per_partition": limits.rate_per_partition.map(rate_json),
    })
}

/// The queues `status` and `schedules` show: every queue of the table with work, a pause, a
/// worker that served it or a stale fence ([`Admin::queues`]), and the queue asked for.
async fn queues_shown(queue: &PgQueue) -> Result<Vec<QueueName>, CtlError> {
    let mut names = queue.queues().await?;
    if !names.contains(queue.queue()) {
        names.push(queue.queue().clone());
        names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    }
    Ok(names)
}

/// The database's clock, which stamps what the commands compare with (leases, schedules).
async fn database_now(queue: &PgQueue) -> Result<DateTime<Utc>, CtlError> {
    Ok(queue
        .query("SELECT now() AS now", ())
        .await?
        .first()
        .map(|row| row.get("now"))
        .transpose()?
        .unwrap_or_else(Utc::now))
}

/// Whether a schedule's record looks stale: the dashboard's rule
/// ([`queue_dashboard::schedule_looks_stale`]), against the database's clock.
fn looks_stale(info: &ScheduleInfo, now: DateTime<Utc>) -> bool {
    queue_dashboard::schedule_looks_stale(info, now)
}

/// `status`: one row per queue of the table (and the queue asked for, even when idle); below
/// the table, a line per queue with recorded schedules.
pub(crate) async fn status(out: &Out, queue: &PgQueue, window: Duration) -> Result<Exit, CtlError> {
    let names = queues_shown(queue).await?;
    let now = database_now(queue).await?;
    let mut schedule_lines = Vec::new();
    let mut table = new_table(&[
        "queue",
        "state",
        "due",
        "scheduled",
        "running",
        "expired",
        "ending soon",
        "lag",
        "done 1h",
        "failed 1h",
        "dead 1h",
        "cancelled 1h",
        "stale",
        "limits",
    ]);
    let mut documents = Vec::new();
    for name in names {
        let handle = queue.for_queue(name.clone());
        let stats = handle.stats(window).await?;
        let control = handle.control().await?;
        let schedules = handle.schedules().await?;
        let stale = schedules.iter().filter(|s| looks_stale(s, now)).count();
        if !schedules.is_empty() {
            schedule_lines.push(format!(
                "schedules of {name}: {}{}",
                schedules.len(),
                if stale > 0 {
                    format!(" ({stale} stale?)")
                } else {
                    String::new()
                }
            ));
        }
        let capped = |n: u64| {
            if n >= queue_core::QueueStats::COUNT_CAP {
                format!("{n}+")
            } else {
                n.to_string()
            }
        };
        let finished = stats.finished_last_hour;
        table.add_row(vec![
            name.to_string(),
            if control.is_paused() {
                "paused"
            } else {
                "running"
            }
            .to_owned(),
            capped(stats.due),
            capped(stats.scheduled),
            stats
                .in_flight
                .saturating_sub(stats.lease_expired)
                .to_string(),
            stats.lease_expired.to_string(),
            stats.lease_expiring.to_string(),
            stats
                .oldest_due_wait
                .map_or_else(|| "-".to_owned(), seconds),
            finished.completed.to_string(),
            finished.failed.to_string(),
            finished.dead.to_string(),
            finished.cancelled.to_string(),
            match control.last_stale_at {
                Some(at) => format!("{} (last {})", control.stale_fences, at.format("%H:%M:%S")),
                None => "0".to_owned(),
            },
            match (control.limits.is_none(), control.room_grants) {
                (true, _) => "-".to_owned(),
                (false, false) => control.limits.to_string(),
                (false, true) => format!("{} (room grants on)", control.limits),
            },
        ]);
        documents.push(json!({
            "queue": name.as_str(),
            "paused": control.is_paused(),
            "paused_at": control.paused_at,
            "due": stats.due,
            "due_capped": stats.due >= queue_core::QueueStats::COUNT_CAP,
            "scheduled": stats.scheduled,
            "in_flight": stats.in_flight,
            "lease_expired": stats.lease_expired,
            "lease_expiring": stats.lease_expiring,
            "lag_seconds": stats.oldest_due_wait.map(|d| d.as_secs_f64()),
            "stale_fences": control.stale_fences,
            "last_stale_at": control.last_stale_at,
            "limits": limits_json(&control.limits),
            "room_grants": control.room_grants,
            "schedules": schedules.len(),
            "schedules_stale": stale,
            "finished_last_hour": {
                "completed": finished.completed,
                "failed": finished.failed,
                "dead": finished.dead,
                "cancelled": finished.cancelled,
            },
        }));
    }
    let mut text = table.to_string();
    if !schedule_lines.is_empty() {
        text.push('\n');
        text.push_str(&schedule_lines.join("\n"));
    }
    out.done(&text, &json!({ "queues": documents }))?;
    Ok(Exit::Done)
}

/// `schedules`: one row per schedule recorded for the queues `status` shows, with a `stale?`
/// hint by the database's clock.
pub(crate) async fn schedules(out: &Out, queue: &PgQueue) -> Result<Exit, CtlError> {
    let names = queues_shown(queue).await?;
    let now = database_now(queue).await?;
    let mut table = new_table(&[
        "queue", "name", "spec", "missed", "through", "next", "seen", "by", "hint",
    ]);
    let mut documents = Vec::new();
    for name in names {
        for info in queue.for_queue(name.clone()).schedules().await? {
            let stale = looks_stale(&info, now);
            let report = &info.report;
            table.add_row(vec![
                name.to_string(),
                report.name.clone(),
                report.spec.clone(),
                report.missed.clone(),
                instant(report.through),
                instant(report.next),
                instant(Some(info.seen_at)),
                info.seen_by.clone(),
                if stale { "stale?" } else { "" }.to_owned(),
            ]);
            documents.push(json!({
                "queue": name.as_str(),
                "name": report.name,
                "spec": report.spec,
                "missed": report.missed,
                "through": report.through,
                "next": report.next,
                "seen_at": info.seen_at,
                "seen_by": info.seen_by,
                "stale": stale,
            }));
        }
    }
    if documents.is_empty() {
        out.done(
            "no schedule recorded (a scheduler records its schedules after each pass)",
            &json!({ "schedules": documents }),
        )?;
    } else {
        out.table(table, &json!({ "schedules": documents }))?;
    }
    Ok(Exit::Done)
}

/// One job as JSON; the payload only when asked for.
fn job_json(job: &JobRecord, show_payload: bool) -> Value {
    let mut document = json!({
        "id": job.id.0,
        "queue": job.queue,
        "status": job.status.as_str(),
        "priority": job.priority,
        "attempts": job.attempts,
        "reclaims": job.reclaims,
        "generation": job.claim_generation.0,
        "next_attempt_at": job.next_attempt_at,
        "claimed_at": job.claimed_at,
        "claimed_by": job.claimed_by,
        "lease_expires_at": job.lease_expires_at,
        "cancel_requested_at": job.cancel_requested_at,
        "last_error": job.last_error,
        "unique_key": job.unique_key,
        "partition_key": job.partition_key,
        "created_at": job.created_at,
        "updated_at": job.updated_at,
        "finished_at": job.finished_at,
        "errors": job.errors,
    });
    if show_payload {
        document["payload"] = job.payload.clone();
    }
    document
}

/// The first line of an error text, cut for a table cell.
fn short(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    let mut cut: String = line.chars().take(60).collect();
    if cut.len() < line.len() {
        cut.push('…');
    }
    cut
}

pub(crate) fn job_page(out: &Out, page: &JobPage) -> Result<(), CtlError> {
    let mut table = new_table(&[
        "id",
        "status",
        "attempts",
        "reclaims",
        "generation",
        "next attempt",
        "last error",
    ]);
    for job in &page.jobs {
        table.add_row(vec![
            job.id.0.to_string(),
            job.status.as_str().to_owned(),
            job.attempts.to_string(),
            job.reclaims.to_string(),
            job.claim_generation.0.to_string(),
            instant(Some(job.next_attempt_at)),
            job.last_error.as_deref().map(short).unwrap_or_default(),
        ]);
    }
    let mut text = table.to_string();
    match page.next {
        Some(cursor) => text.push_str(&format!("\nmore: --before {}", cursor.0)),
        None if page.jobs.is_empty() => text = "no jobs".to_owned(),
        None => {}
    }
    let jobs: Vec<Value> = page.jobs.iter().map(|j| job_json(j, false)).collect();
    out.done(
        &text,
        &json!({ "jobs": jobs, "next": page.next.map(|c| c.0) }),
    )
}

pub(crate) fn job(out: &Out, job: &JobRecord, show_payload: bool) -> Result<(), CtlError> {
    let mut lines = vec![
        format!("job {} of queue {}", job.id, job.queue),
        format!("  status        {}", job.status.as_str()),
        format!(
            "  attempts      {} ({} taken over from expired leases)",
            job.attempts, job.reclaims
        ),
        format!("  generation    {}", job.claim_generation.0),
        format!("  next attempt  {}", instant(Some(job.next_attempt_at))),
        format!(
            "  claimed       {} by {}",
            instant(job.claimed_at),
            job.claimed_by.as_deref().unwrap_or("-")
        ),
        format!("  lease ends    {}", instant(job.lease_expires_at)),
        format!("  cancel asked  {}", instant(job.cancel_requested_at)),
        format!(
            "  unique key    {}",
            job.unique_key.as_deref().unwrap_or("-")
        ),
        format!(
            "  partition     {}",
            job.partition_key.as_deref().unwrap_or("-")
        ),
        format!("  created       {}", instant(Some(job.created_at))),
        format!("  finished      {}", instant(job.finished_at)),
        format!(
            "  last error    {}",
            job.last_error.as_deref().unwrap_or("-")
        ),
    ];
    if job.errors.is_empty() {
        lines.push("  errors        none".to_owned());
    } else {
        lines.push(format!("  errors        the last {}:", job.errors.len()));
        for entry in &job.errors {
            lines.push(format!(
                "    attempt {} gen {} {} {} by {}: {}",
                entry.attempt,
                entry.generation,
                entry.at.format("%Y-%m-%d %H:%M:%S"),
                entry.outcome,
                entry.worker.as_deref().unwrap_or("-"),
                short(&entry.error)
            ));
        }
    }
    if show_payload {
        lines.push(format!("  payload       {}", job.payload));
    } else {
        lines.push("  payload       hidden (--show-payload)".to_owned());
    }
    out.done(&lines.join("\n"), &job_json(job, show_payload))
}

/// The results of a command on several jobs; the exit code is the worst of them.
pub(crate) fn items(out: &Out, results: &[ItemResult]) -> Result<Exit, CtlError> {
    let mut table = new_table(&["id", "result", "detail"]);
    let mut documents = Vec::new();
    for item in results {
        table.add_row(vec![
            item.id.to_string(),
            item.result.to_owned(),
            item.detail.clone(),
        ]);
        documents.push(json!({ "id": item.id, "result": item.result, "detail": item.detail }));
    }
    let text = if results.is_empty() {
        "no jobs".to_owned()
    } else {
        table.to_string()
    };
    out.done(&text, &json!({ "jobs": documents }))?;
    Ok(results.iter().map(|i| i.exit).max().unwrap_or(Exit::Done))
}

/// `lease`: the jobs in flight, their partitions (what a limit per partition counts), the time
/// left on each lease by the database's clock.
pub(crate) async fn leases(out: &Out, queue: &PgQueue, limit: u32) -> Result<Exit, CtlError> {
    let now = database_now(queue).await?;
    let page = queue
        .list_jobs(&JobFilter::new().status(JobStatus::InFlight).limit(limit))
        .await?;
    let mut table = new_table(&[
        "id",
        "holder",
        "partition",
        "generation",
        "attempts",
        "reclaims",
        "lease left",
        "cancel asked",
    ]);
    let mut documents = Vec::new();
    for job in &page.jobs {
        let left = job.lease_expires_at.map(|at| (at - now).num_milliseconds());
        let shown = match left {
            Some(ms) if ms >= 0 => seconds(Duration::from_millis(ms as u64)),
            Some(ms) => format!(
                "expired {} ago",
                seconds(Duration::from_millis(ms.unsigned_abs()))
            ),
            None => "none stored".to_owned(),
        };
        table.add_row(vec![
            job.id.0.to_string(),
            job.claimed_by.clone().unwrap_or_else(|| "-".to_owned()),
            job.partition_key.clone().unwrap_or_else(|| "-".to_owned()),
            job.claim_generation.0.to_string(),
            job.attempts.to_string(),
            job.reclaims.to_string(),
            shown,
            if job.cancel_requested_at.is_some() {
                "yes"
            } else {
                "no"
            }
            .to_owned(),
        ]);
        documents.push(json!({
            "id": job.id.0,
            "holder": job.claimed_by,
            "partition_key": job.partition_key,
            "generation": job.claim_generation.0,
            "attempts": job.attempts,
            "reclaims": job.reclaims,
            "lease_expires_at": job.lease_expires_at,
            "lease_left_ms": left,
            "cancel_requested": job.cancel_requested_at.is_some(),
        }));
    }
    if page.jobs.is_empty() {
        out.done("no job in flight", &json!({ "jobs": documents }))?;
    } else {
        out.table(table, &json!({ "jobs": documents }))?;
    }
    Ok(Exit::Done)
}
