//! The pages: the overview (with each queue's schedules), a queue's jobs, a job, and the
//! confirmation pages of the actions that need one. Every value goes through maud, which escapes
//! it; links carry ids, queue names and states, and a schedule's name percent-encoded.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, PreEscaped, html};
use queue_core::{
    Admin, JobFilter, JobId, JobPage, JobRecord, JobStatus, QueueName, RETRYABLE, ScheduleInfo,
};
use serde::Deserialize;

use crate::{Shared, chart};

/// A failure shown as a page.
pub(crate) struct PageError {
    status: StatusCode,
    message: String,
}

impl PageError {
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        PageError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        PageError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
        }
    }
}

/// Event: a page or an action failed on the store (warn; the page shows a short message).
pub const PAGE_FAILED: &str = "queue_dashboard.page_failed";

impl From<queue_core::Error> for PageError {
    fn from(err: queue_core::Error) -> Self {
        // The details (a database's own words) go to the log, not to whoever reads the page.
        tracing::warn!(name: PAGE_FAILED, error = %err, "{PAGE_FAILED}");
        PageError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: if err.is_transient() {
                "The queue store did not answer. This page tries again in a few seconds.".to_owned()
            } else {
                "The queue store refused the request; the dashboard's log says why.".to_owned()
            },
        }
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let body = html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    @if self.status == StatusCode::SERVICE_UNAVAILABLE { meta http-equiv="refresh" content="5"; }
                    title { "error" } style { (PreEscaped(STYLE)) }
                }
                body { main {
                    h1 { "Something went wrong" }
                    p.error { (self.message) }
                } }
            }
        };
        (self.status, Html(body.into_string())).into_response()
    }
}

pub(crate) type PageResult = Result<Response, PageError>;

const STYLE: &str = r#"
:root { --fg: #1d2330; --muted: #5b6478; --line: #d9dee8; --ok: #2f9e55; --bad: #cf3b3b; --bg: #f6f7fa; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg); }
header { display: flex; flex-wrap: wrap; gap: .5rem 1.5rem; align-items: baseline; padding: .75rem 1rem;
         background: #fff; border-bottom: 1px solid var(--line); }
header a { color: var(--fg); text-decoration: none; font-weight: 600; }
header .mode { color: var(--muted); font-size: 12px; }
main { padding: 1rem; max-width: 1400px; margin: 0 auto; }
h1 { font-size: 20px; margin: .25rem 0 1rem; } h2 { font-size: 16px; margin: 0 0 .5rem; }
.cards { display: flex; flex-wrap: wrap; gap: 1rem; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: .75rem 1rem; flex: 1 1 360px; min-width: 0; }
.counts { display: flex; flex-wrap: wrap; gap: .25rem 1rem; margin: .25rem 0 .5rem; }
.counts div { min-width: 5.5rem; } .counts b { display: block; font-size: 18px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { text-align: left; padding: .35rem .5rem; border-bottom: 1px solid var(--line); vertical-align: top; white-space: nowrap; }
td.text { white-space: normal; word-break: break-word; min-width: 12rem; }
td.text time { white-space: nowrap; }
th { color: var(--muted); font-weight: 600; font-size: 12px; }
.status { display: inline-block; padding: 0 .4rem; border-radius: 3px; font-size: 12px; background: #e9edf4; }
.status.dead, .status.failed { background: #fbe2e2; color: #8c1f1f; }
.status.completed { background: #e0f3e7; color: #1d6b39; }
.status.in_flight { background: #e2ecfb; }
.paused, .stale { color: #8c5a00; font-weight: 600; }
.card.wide { margin-top: 1rem; }
.muted { color: var(--muted); } .error { color: #8c1f1f; }
.notice { background: #fff8e1; border: 1px solid #f0d98c; padding: .5rem .75rem; border-radius: 4px; margin-bottom: 1rem; }
form.inline { display: inline; } button { font: inherit; padding: .15rem .6rem; cursor: pointer; }
a.button { display: inline-block; padding: .1rem .6rem; border: 1px solid #767676; border-radius: 3px;
           background: #efefef; color: var(--fg); text-decoration: none; }
form.filters { display: flex; flex-wrap: wrap; gap: .5rem; align-items: end; margin-bottom: 1rem; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
pre { background: #fff; border: 1px solid var(--line); padding: .75rem; overflow-x: auto; white-space: pre-wrap; word-break: break-word; }
dl.fields { display: grid; grid-template-columns: max-content 1fr; gap: .25rem 1rem; background: #fff;
            border: 1px solid var(--line); padding: .75rem 1rem; border-radius: 6px; }
dl.fields dt { color: var(--muted); } dl.fields dd { margin: 0; word-break: break-word; }
svg.chart rect.ok { fill: var(--ok); } svg.chart rect.bad { fill: var(--bad); }
svg.chart { max-width: 100%; height: auto; background: #fafbfd; border: 1px solid var(--line); }
@media (max-width: 600px) { main { padding: .5rem; } dl.fields { grid-template-columns: 1fr; } }
"#;

/// The page frame: the title, the navigation, the refresh (the overview, a queue's jobs and a
/// job's page: the same URL again, so the queue, state and cursor filters stay; never a page
/// that asks for a confirmation). Links and forms name jobs by id, so a list that moved under
/// the pointer still opens the job that was shown.
fn layout<B: Admin, P>(
    d: &Shared<B, P>,
    title: &str,
    notice: Option<&str>,
    body: Markup,
    refreshes: bool,
) -> Response {
    let refresh = d
        .config
        .refresh
        .filter(|_| refreshes)
        .map(|every| every.as_secs().max(1));
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(secs) = refresh { meta http-equiv="refresh" content=(secs); }
                title { (title) " · " (d.config.title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    a href=(d.href("/")) { (d.config.title) }
                    a href=(d.href("/jobs")) { "jobs" }
                    form.inline method="get" action=(d.href("/jobs")) {
                        input type="search" name="q" placeholder="job id or unique key" aria-label="find a job";
                    }
                    span.mode {
                        @if d.config.allow_actions { "actions on" } @else { "read-only" }
                        @if let Some(secs) = refresh { " · refreshes every " (secs) " s" }
                    }
                }
                main {
                    @if let Some(notice) = notice { p.notice role="status" { (notice) } }
                    (body)
                }
            }
        }
    };
    Html(page.into_string()).into_response()
}

fn status_badge(status: JobStatus) -> Markup {
    html! { span class=(format!("status {}", status.as_str())) { (status.as_str()) } }
}

fn when(at: Option<DateTime<Utc>>) -> Markup {
    match at {
        Some(at) => {
            html! { time datetime=(at.to_rfc3339()) { (at.format("%Y-%m-%d %H:%M:%S UTC")) } }
        }
        None => html! { span.muted { "–" } },
    }
}

fn seconds(wait: Option<Duration>) -> String {
    match wait {
        Some(wait) if wait.as_secs() >= 3600 => {
            format!("{}h {}m", wait.as_secs() / 3600, wait.as_secs() % 3600 / 60)
        }
        Some(wait) if wait.as_secs() >= 60 => {
            format!("{}m {}s", wait.as_secs() / 60, wait.as_secs() % 60)
        }
        Some(wait) => format!("{:.1}s", wait.as_secs_f64()),
        None => "–".to_owned(),
    }
}

/// The first line of an error text, cut for a table cell.
pub(crate) fn short(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    let mut cut: String = line.chars().take(120).collect();
    if cut.len() < line.len() {
        cut.push('…');
    }
    cut
}

/// A queue named in a request, validated.
pub(crate) fn queue_named<B: Admin, P>(
    d: &Shared<B, P>,
    name: Option<&str>,
) -> Result<B, PageError> {
    match name.filter(|n| !n.is_empty()) {
        None => Ok(d.queue.clone()),
        Some(name) => {
            let queue = QueueName::new(name).map_err(|e| PageError::bad_request(e.to_string()))?;
            Ok(d.queue.for_queue(queue))
        }
    }
}

/// A hidden CSRF field and a `back` path for a form.
pub(crate) fn form_fields<B: Admin, P>(d: &Shared<B, P>, back: &str) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(d.csrf);
        input type="hidden" name="back" value=(back);
    }
}

/// `?flash=…` of a page reached after an action: the key of its result.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Notice {
    flash: Option<String>,
}

pub(crate) async fn overview<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Query(notice): Query<Notice>,
) -> PageResult {
    let mut names = d.queue.queues().await?;
    if !names.contains(d.queue.queue()) {
        names.push(d.queue.queue().clone());
        names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    }
    // A few queues at a time: each card is five statements, and a table may hold many queues.
    use futures_util::stream::{StreamExt, TryStreamExt};
    let cards: Vec<(Markup, Vec<(QueueName, ScheduleInfo)>)> = futures_util::stream::iter(names)
        .map(|name| queue_card(&d, name))
        .buffered(4)
        .try_collect()
        .await?;
    let (cards, schedules): (Vec<Markup>, Vec<_>) = cards.into_iter().unzip();
    let schedules: Vec<(QueueName, ScheduleInfo)> = schedules.into_iter().flatten().collect();
    let body = html! {
        h1 { "Queues" }
        div.cards { @for card in cards { (card) } }
        @if !schedules.is_empty() {
            (schedule_table(&d, &schedules, Utc::now()))
        }
    };
    let flash = notice.flash.as_deref().and_then(|k| d.flashes.get(k));
    Ok(layout(&d, "overview", flash.as_deref(), body, true))
}

/// A queue's card, and its recorded schedules for the overview's table of schedules.
async fn queue_card<B: Admin, P>(
    d: &Shared<B, P>,
    name: QueueName,
) -> Result<(Markup, Vec<(QueueName, ScheduleInfo)>), PageError> {
    let queue = d.queue.for_queue(name.clone());
    let stats = queue.stats(Duration::from_secs(60)).await?;
    let control = queue.control().await?;
    let minutes = queue.throughput(30).await?;
    let dead = queue
        .list_jobs(&JobFilter::new().status(JobStatus::Dead).limit(5))
        .await?;
    let schedules = queue.schedules().await?;
    let now = Utc::now();
    let stale = schedules
        .iter()
        .filter(|s| crate::schedule_looks_stale(s, now))
        .count();
    let capped = |n: u64| {
        if n >= queue_core::QueueStats::COUNT_CAP {
            format!("{n}+")
        } else {
            n.to_string()
        }
    };
    let jobs = |state: &str| d.href(&format!("/jobs?queue={}&state={state}", name.as_str()));
    let finished = stats.finished_last_hour;
    let back = d.href("/");
    let card = html! {
        section.card data-queue=(name.as_str()) {
            h2 {
                a href=(d.href(&format!("/jobs?queue={}", name.as_str()))) { (name.as_str()) }
                @if control.is_paused() { " " span.paused { "paused" } }
            }
            @if !control.limits.is_none() {
                p.muted data-limits=(control.limits.to_string()) {
                    "Limits: " (control.limits.to_string())
                    @if control.room_grants { " (room grants on)" }
                }
            }
            @if !schedules.is_empty() {
                p.muted data-schedules=(schedules.len()) {
                    a href=(format!("#schedules-{}", name.as_str())) { "Schedules: " (schedules.len()) }
                    @if stale > 0 { " " span.stale title=(STALE_HINT) { "(" (stale) " stale?)" } }
                }
            }
            div.counts {
                div { b data-count="due" { a href=(jobs("pending")) { (capped(stats.due)) } } "due" }
                div { b data-count="scheduled" { (capped(stats.scheduled)) } "scheduled" }
                div { b data-count="running" { a href=(jobs("in_flight")) { (stats.in_flight.saturating_sub(stats.lease_expired)) } } "running" }
                div { b data-count="expired" { (stats.lease_expired) } "leases expired" }
                div { b data-count="lag" { (seconds(stats.oldest_due_wait)) } "lag" }
            }
            div.counts {
                div { b data-count="completed" { a href=(jobs("completed")) { (finished.completed) } } "completed 1h" }
                div { b data-count="failed" { a href=(jobs("failed")) { (finished.failed) } } "failed 1h" }
                div { b data-count="dead" { a href=(jobs("dead")) { (finished.dead) } } "dead 1h" }
                div { b data-count="cancelled" { (finished.cancelled) } "cancelled 1h" }
                div {
                    b data-count="stale" { (control.stale_fences) }
                    "stale fences"
                    @if let Some(at) = control.last_stale_at { br; span.muted { "last " (when(Some(at))) } }
                }
            }
            p.muted { "jobs ended per minute, last 30 minutes" }
            (chart::throughput(&minutes))
            @if !dead.jobs.is_empty() {
                h2 { "Dead jobs" }
                div.scroll {
                    table.dead {
                        tr { th { "id" } th { "ended" } th { "error" } }
                        @for job in &dead.jobs {
                            tr data-job=(job.id.0) {
                                td { a href=(d.href(&format!("/jobs/{}?queue={}", job.id.0, name.as_str()))) { (job.id.0) } }
                                td { (when(job.finished_at)) }
                                td.text.error { (job.last_error.as_deref().map(short).unwrap_or_default()) }
                            }
                        }
                    }
                }
            }
            @if d.config.allow_actions {
                p {
                    @if control.is_paused() {
                        form.inline method="post" action=(d.href(&format!("/queues/{}/resume", name.as_str()))) {
                            (form_fields(d, &back)) button type="submit" { "Resume" }
                        }
                    } @else {
                        form.inline method="post" action=(d.href(&format!("/queues/{}/pause", name.as_str()))) {
                            (form_fields(d, &back)) button type="submit" { "Pause" }
                        }
                    }
                    " "
                    @if !dead.jobs.is_empty() {
                        a.button href=(d.href(&format!("/queues/{}/retry-dead", name.as_str()))) { "Retry every dead job…" }
                    }
                }
            }
        }
    };
    let schedules = schedules.into_iter().map(|s| (name.clone(), s)).collect();
    Ok((card, schedules))
}

/// What a stale marker says when pointed at.
const STALE_HINT: &str = "no scheduler has reported it for more than twice its period \
    (next − through) or 10 minutes, whichever is longer: removed from the code, or its \
    schedulers are down or cannot reach the store";

/// The schedules recorded for the queues of the overview, below their cards: a table, a stale
/// marker on those no scheduler reported lately (by this process's clock against the store's
/// `seen_at`), and with actions allowed a link to forget each.
fn schedule_table<B: Admin, P>(
    d: &Shared<B, P>,
    schedules: &[(QueueName, ScheduleInfo)],
    now: DateTime<Utc>,
) -> Markup {
    // The first row of each queue is the target of its card's link.
    let rows = schedules.iter().enumerate().map(|(i, (queue, info))| {
        let first = i == 0 || schedules[i - 1].0 != *queue;
        (queue, info, first)
    });
    html! {
        section.card.wide {
            h2 { "Schedules" }
            div.scroll {
                table.schedules {
                    tr {
                        th { "queue" } th { "name" } th { "spec" } th { "missed periods" }
                        th { "through" } th { "next" } th { "last seen" }
                        @if d.config.allow_actions { th {} }
                    }
                    @for (queue, info, first) in rows {
                        @let stale = crate::schedule_looks_stale(info, now);
                        tr id=[first.then(|| format!("schedules-{}", queue.as_str()))]
                            data-queue=(queue.as_str()) data-schedule=(info.report.name) data-stale[stale] {
                            td { a href=(d.href(&format!("/jobs?queue={}", queue.as_str()))) { (queue.as_str()) } }
                            td {
                                (info.report.name)
                                @if stale { " " span.stale title=(STALE_HINT) { "stale?" } }
                            }
                            td.text data-field="spec" { (info.report.spec) }
                            td data-field="missed" { (info.report.missed) }
                            td { (when(info.report.through)) }
                            td { (when(info.report.next)) }
                            td.text data-field="seen" { (when(Some(info.seen_at))) br; "by " (info.seen_by) }
                            @if d.config.allow_actions {
                                td { a.button href=(forget_href(d, queue, &info.report.name)) { "Forget…" } }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The confirmation page of forgetting the schedule `name` of `queue`.
fn forget_href<B: Admin, P>(d: &Shared<B, P>, queue: &QueueName, name: &str) -> String {
    d.href(&format!(
        "/queues/{}/forget-schedule?name={}",
        queue.as_str(),
        percent_encoded(name)
    ))
}

/// `text` for a URL's query: every byte but the unreserved ones (`A-Z a-z 0-9 - . _ ~`) as
/// `%XX`.
fn percent_encoded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `/queues/{queue}/forget-schedule` query: the schedule's name.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ScheduleQuery {
    name: Option<String>,
}

/// The confirmation of forgetting a schedule's record: what was recorded, whether it looks
/// stale, and the button (actions allowed only).
pub(crate) async fn confirm_forget_schedule<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Path(queue): Path<String>,
    Query(query): Query<ScheduleQuery>,
) -> PageResult {
    let name = QueueName::new(queue).map_err(|e| PageError::bad_request(e.to_string()))?;
    let wanted = query.name.unwrap_or_default();
    let schedules = d.queue.for_queue(name.clone()).schedules().await?;
    // The name came in a link: not repeated when nothing matches it.
    let Some(info) = schedules.iter().find(|s| s.report.name == wanted) else {
        return Err(PageError::not_found(format!(
            "that schedule is not recorded for queue {} (forgotten already?)",
            name.as_str()
        )));
    };
    let now = Utc::now();
    let stale = crate::schedule_looks_stale(info, now);
    let back = d.href("/");
    let body = html! {
        h1 { "Forget the schedule " (info.report.name) " of " (name.as_str()) "?" }
        p { "Its record goes; the schedule's jobs stay. A scheduler that still runs it records it "
            "again at its next pass, so forget only a schedule removed from the code." }
        @if stale {
            p.stale { "stale? " span.muted { (STALE_HINT) } }
        } @else {
            p.muted { "A scheduler reported it lately: it probably still runs." }
        }
        dl.fields {
            dt { "spec" } dd data-field="spec" { (info.report.spec) }
            dt { "missed periods" } dd data-field="missed" { (info.report.missed) }
            dt { "through" } dd { (when(info.report.through)) }
            dt { "next" } dd { (when(info.report.next)) }
            dt { "last seen" } dd data-field="seen" { (when(Some(info.seen_at))) " by " (info.seen_by) }
        }
        @if d.config.allow_actions {
            form method="post" action=(d.href(&format!("/queues/{}/forget-schedule", name.as_str()))) style="margin-top:1rem" {
                (form_fields(&d, &back))
                input type="hidden" name="name" value=(info.report.name);
                button type="submit" data-action="forget-schedule" { "Forget it" }
                " " a href=(back) { "Cancel" }
            }
        }
    };
    Ok(layout(&d, "forget a schedule", None, body, false))
}

/// The most jobs one press of "retry every dead job" retries.
pub(crate) const BULK_RETRY_MOST: u32 = 1_000;

/// The confirmation of a bulk retry: how many dead jobs the queue has, and the button.
pub(crate) async fn confirm_retry_dead<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Path(queue): Path<String>,
) -> PageResult {
    let name = QueueName::new(queue).map_err(|e| PageError::bad_request(e.to_string()))?;
    let queue = d.queue.for_queue(name.clone());
    let dead = queue
        .list_jobs(
            &JobFilter::new()
                .status(JobStatus::Dead)
                .limit(BULK_RETRY_MOST),
        )
        .await?;
    let count = if dead.next.is_some() {
        format!("more than {BULK_RETRY_MOST}")
    } else {
        dead.jobs.len().to_string()
    };
    let body = html! {
        h1 { "Retry the dead jobs of " (name.as_str()) "?" }
        p { "The queue has " (count) " dead jobs. Each goes back to pending, attempts reset, "
            "through the hooks; at most " (BULK_RETRY_MOST) " per press." }
        @if d.config.allow_actions && !dead.jobs.is_empty() {
            form method="post" action=(d.href(&format!("/queues/{}/retry-dead", name.as_str()))) {
                (form_fields(&d, &d.href("/")))
                button type="submit" data-action="retry-dead" { "Retry them" }
                " " a href=(d.href("/")) { "Cancel" }
            }
        }
    };
    Ok(layout(&d, "retry dead jobs", None, body, false))
}

/// `/jobs` query: the queue, the state, the cursor, a search.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct JobsQuery {
    queue: Option<String>,
    state: Option<String>,
    before: Option<i64>,
    q: Option<String>,
    flash: Option<String>,
}

pub(crate) async fn jobs<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Query(query): Query<JobsQuery>,
) -> PageResult {
    let queue = queue_named(&d, query.queue.as_deref())?;
    let name = queue.queue().clone();
    if let Some(search) = query.q.as_deref().map(str::trim).filter(|q| !q.is_empty()) {
        return find(&d, &queue, search).await;
    }
    let state = match query.state.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(
            JobStatus::parse(s).ok_or_else(|| PageError::bad_request(format!("no state {s:?}")))?,
        ),
    };
    let mut filter = JobFilter::new().limit(50);
    if let Some(state) = state {
        filter = filter.status(state);
    }
    if let Some(before) = query.before {
        filter = filter.before(JobId(before));
    }
    let page = queue.list_jobs(&filter).await?;
    let queues = {
        let mut all = d.queue.queues().await?;
        if !all.contains(&name) {
            all.push(name.clone());
        }
        all.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        all
    };
    let here = d.href(&format!(
        "/jobs?queue={}{}{}",
        name.as_str(),
        state
            .map(|s| format!("&state={}", s.as_str()))
            .unwrap_or_default(),
        query
            .before
            .map(|b| format!("&before={b}"))
            .unwrap_or_default()
    ));
    let body = html! {
        h1 { "Jobs of " (name.as_str()) }
        form.filters method="get" action=(d.href("/jobs")) {
            label { "queue"
                select name="queue" {
                    @for q in &queues {
                        option value=(q.as_str()) selected[*q == name] { (q.as_str()) }
                    }
                }
            }
            label { "state"
                select name="state" {
                    option value="" selected[state.is_none()] { "every state" }
                    @for s in JobStatus::ALL {
                        option value=(s.as_str()) selected[state == Some(s)] { (s.as_str()) }
                    }
                }
            }
            button type="submit" { "Show" }
        }
        (job_table(&d, &name, &page, &here))
        @if let Some(cursor) = page.next {
            p {
                a.next href=(d.href(&format!(
                    "/jobs?queue={}{}&before={}",
                    name.as_str(),
                    state.map(|s| format!("&state={}", s.as_str())).unwrap_or_default(),
                    cursor.0
                ))) { "Older jobs →" }
            }
        }
    };
    let flash = query.flash.as_deref().and_then(|k| d.flashes.get(k));
    Ok(layout(&d, "jobs", flash.as_deref(), body, true))
}

fn job_table<B: Admin, P>(
    d: &Shared<B, P>,
    queue: &QueueName,
    page: &JobPage,
    back: &str,
) -> Markup {
    html! {
        @if page.jobs.is_empty() {
            p.muted { "No jobs." }
        } @else {
            div.scroll {
                table.jobs {
                    tr {
                        th { "id" } th { "status" } th { "attempts" } th { "reclaims" } th { "generation" }
                        th { "next attempt" } th { "last error" }
                        @if d.config.allow_actions { th {} }
                    }
                    @for job in &page.jobs {
                        tr data-job=(job.id.0) data-status=(job.status.as_str()) {
                            td { a href=(d.href(&format!("/jobs/{}?queue={}", job.id.0, queue.as_str()))) { (job.id.0) } }
                            td { (status_badge(job.status)) }
                            td { (job.attempts) }
                            td { (job.reclaims) }
                            td { (job.claim_generation.0) }
                            td { (when(Some(job.next_attempt_at))) }
                            td.text.error { (job.last_error.as_deref().map(short).unwrap_or_default()) }
                            @if d.config.allow_actions { td { (actions_for(d, queue, job, back)) } }
                        }
                    }
                }
            }
        }
    }
}

/// The buttons a job's state allows.
fn actions_for<B: Admin, P>(
    d: &Shared<B, P>,
    queue: &QueueName,
    job: &JobRecord,
    back: &str,
) -> Markup {
    html! {
        @if RETRYABLE.contains(&job.status) {
            form.inline method="post" action=(d.href(&format!("/jobs/{}/retry", job.id.0))) {
                (form_fields(d, back))
                input type="hidden" name="queue" value=(queue.as_str());
                input type="hidden" name="seen" value=(job.status.as_str());
                button type="submit" data-action="retry" { "Retry" }
            }
        }
        @if !job.status.is_terminal() {
            form.inline method="post" action=(d.href(&format!("/jobs/{}/cancel", job.id.0))) {
                (form_fields(d, back))
                input type="hidden" name="queue" value=(queue.as_str());
                button type="submit" data-action="cancel" { "Cancel" }
            }
        }
    }
}

/// A search: a number is a job id, anything else a unique key; the queue shown first, then
/// every queue of the store.
async fn find<B: Admin, P>(d: &Shared<B, P>, queue: &B, search: &str) -> PageResult {
    let mut candidates = vec![queue.clone()];
    for name in d.queue.queues().await? {
        if name != *queue.queue() {
            candidates.push(d.queue.for_queue(name));
        }
    }
    let id = search.parse::<i64>().ok();
    for candidate in &candidates {
        let found = match id {
            Some(id) => candidate.get(JobId(id)).await?,
            None => candidate.find_by_unique_key(search).await?,
        };
        if let Some(job) = found {
            let to = d.href(&format!(
                "/jobs/{}?queue={}",
                job.id.0,
                candidate.queue().as_str()
            ));
            return Ok(Redirect::to(&to).into_response());
        }
    }
    Err(PageError::not_found(match id {
        Some(id) => format!("no job {id} in the queues listed"),
        None => "no job of the queues listed holds that unique key".to_owned(),
    }))
}

/// `/jobs/{id}` query.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct JobQuery {
    queue: Option<String>,
    flash: Option<String>,
}

pub(crate) async fn job<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Path(id): Path<i64>,
    Query(query): Query<JobQuery>,
) -> PageResult {
    let queue = queue_named(&d, query.queue.as_deref())?;
    let name = queue.queue().clone();
    let Some(job) = queue.get(JobId(id)).await? else {
        return Err(PageError::not_found(format!(
            "job {id} is not in queue {}",
            name.as_str()
        )));
    };
    let back = d.href(&format!("/jobs/{id}?queue={}", name.as_str()));
    let payload = d
        .config
        .show_payloads
        .then(|| serde_json::to_string_pretty(&job.payload).unwrap_or_default());
    let body = html! {
        h1 { "Job " (job.id.0) " " (status_badge(job.status)) }
        @if d.config.allow_actions { p { (actions_for(&d, &name, &job, &back)) } }
        dl.fields {
            dt { "queue" } dd { a href=(d.href(&format!("/jobs?queue={}", name.as_str()))) { (name.as_str()) } }
            dt { "status" } dd data-field="status" { (job.status.as_str()) }
            dt { "attempts" } dd data-field="attempts" { (job.attempts) }
            dt { "reclaims" } dd { (job.reclaims) }
            dt { "generation" } dd data-field="generation" { (job.claim_generation.0) }
            dt { "priority" } dd { (job.priority) }
            dt { "next attempt" } dd { (when(Some(job.next_attempt_at))) }
            dt { "claimed" } dd { (when(job.claimed_at)) " by " (job.claimed_by.as_deref().unwrap_or("–")) }
            dt { "lease ends" } dd { (when(job.lease_expires_at)) }
            dt { "cancel requested" } dd { (when(job.cancel_requested_at)) }
            dt { "unique key" } dd data-field="unique_key" { (job.unique_key.as_deref().unwrap_or("–")) }
            dt { "partition" } dd data-field="partition_key" { (job.partition_key.as_deref().unwrap_or("–")) }
            dt { "created" } dd { (when(Some(job.created_at))) }
            dt { "updated" } dd { (when(Some(job.updated_at))) }
            dt { "finished" } dd { (when(job.finished_at)) }
            dt { "last error" } dd.error data-field="last_error" { (job.last_error.as_deref().unwrap_or("–")) }
        }
        h2 style="margin-top:1rem" { "Errors (the last " (job.errors.len()) ")" }
        @if job.errors.is_empty() {
            p.muted { "None." }
        } @else {
            div.scroll {
                table.errors {
                    tr { th { "attempt" } th { "generation" } th { "at" } th { "outcome" } th { "worker" } th { "error" } }
                    @for entry in job.errors.iter().rev() {
                        tr {
                            td { (entry.attempt) } td { (entry.generation) } td { (when(Some(entry.at))) }
                            td { (entry.outcome) } td { (entry.worker.as_deref().unwrap_or("–")) }
                            td.text.error { (entry.error) }
                        }
                    }
                }
            }
        }
        h2 style="margin-top:1rem" { "Payload" }
        @match payload {
            Some(text) => pre data-field="payload" { (text) },
            None => p.muted { "Hidden: start the dashboard with payloads shown (queuectl serve --show-payloads) to see it." },
        }
    };
    let flash = query.flash.as_deref().and_then(|k| d.flashes.get(k));
    Ok(layout(
        &d,
        &format!("job {id}"),
        flash.as_deref(),
        body,
        true,
    ))
}
