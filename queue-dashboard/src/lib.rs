//! # queue-dashboard
//!
//! A web dashboard for the queues of one store (a PostgreSQL table, a memory store), built on
//! the admin API ([`queue_core::Admin`]): an overview of every queue (counts, lag, throughput of
//! the last half hour, dead jobs, stale fences, the schedules its schedulers recorded), the jobs
//! of a queue by state, a job's page, and (only when allowed) the operator's actions, retry,
//! cancel, bulk retry, pause, resume and forgetting a schedule's record, through the adopter's
//! finalize hooks so that domain state follows.
//!
//! ```
//! use queue_core::{Hooks, MemoryBackend, MemoryTx};
//! use queue_dashboard::{DashboardConfig, router};
//!
//! let queue = MemoryBackend::new();
//! let hooks: Hooks<MemoryTx, serde_json::Value> = Hooks::new();
//! // Read-only, mounted under /queues of a service's own axum app.
//! let dashboard = router(queue, hooks, DashboardConfig::new().base_path("/queues"));
//! let app: axum::Router = axum::Router::new().nest("/queues", dashboard);
//! # let _ = app;
//! ```
//!
//! Safe by default: read-only unless [`DashboardConfig::allow_actions`]; payloads hidden unless
//! [`DashboardConfig::show_payloads`]; every value HTML-escaped (maud); actions are POST forms
//! with a per-process CSRF token and a same-origin check; optional bearer or basic
//! authentication ([`Auth`]); no payload ever in a URL. `queuectl serve` serves it on loopback.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod actions;
mod auth;
mod chart;
mod guard;
mod pages;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use chrono::{DateTime, TimeDelta, Utc};
use queue_core::{Admin, Hooks, ScheduleInfo};
use serde::de::DeserializeOwned;

pub use auth::{AUTH_REFUSED, Auth};

/// How the dashboard behaves.
#[derive(Debug, Clone)]
pub struct DashboardConfig {
    base_path: String,
    allow_actions: bool,
    show_payloads: bool,
    refresh: Option<Duration>,
    auth: Option<Auth>,
    title: String,
    allowed_origins: Vec<String>,
}

impl DashboardConfig {
    /// Read-only, payloads hidden, refreshed every 5 s, no authentication, served at the root.
    pub fn new() -> Self {
        DashboardConfig {
            base_path: String::new(),
            allow_actions: false,
            show_payloads: false,
            refresh: Some(Duration::from_secs(5)),
            auth: None,
            title: "queues".to_owned(),
            allowed_origins: Vec::new(),
        }
    }

    /// The path the router is mounted under (`/queues` for `Router::nest("/queues", …)`), so
    /// that its links and redirects stay inside it. A trailing `/` is dropped.
    pub fn base_path(mut self, path: &str) -> Self {
        self.base_path = path.trim_end_matches('/').to_owned();
        self
    }

    /// Allow the operator's actions (retry, cancel, bulk retry, pause, resume, forget a
    /// schedule's record).
    pub fn allow_actions(mut self, allow: bool) -> Self {
        self.allow_actions = allow;
        self
    }

    /// Show job payloads on a job's page (they may hold personal or secret data).
    pub fn show_payloads(mut self, show: bool) -> Self {
        self.show_payloads = show;
        self
    }

    /// How often pages reload themselves (`None`: never); the URL, and so the filters, stay.
    pub fn refresh(mut self, every: Option<Duration>) -> Self {
        self.refresh = every.filter(|d| !d.is_zero());
        self
    }

    /// Require a bearer token or basic authentication on every request.
    pub fn auth(mut self, auth: Option<Auth>) -> Self {
        self.auth = auth;
        self
    }

    /// The origins (`http://127.0.0.1:8080`, `https://dash.example.com`) the dashboard is
    /// reached at. When any is given, a request whose `Host` is none of them is refused (DNS
    /// rebinding: a hostile page whose name points at 127.0.0.1 cannot read or drive it), and an
    /// action's `Origin` must be one of them exactly. Empty (the default for a router mounted in
    /// a service): the `Origin` of an action must match its `Host`.
    pub fn allowed_origins(mut self, origins: impl IntoIterator<Item = String>) -> Self {
        self.allowed_origins = origins
            .into_iter()
            .map(|o| o.trim_end_matches('/').to_ascii_lowercase())
            .collect();
        self
    }

    /// The name shown in the pages' title.
    pub fn title(mut self, title: &str) -> Self {
        self.title = title.to_owned();
        self
    }
}

impl Default for DashboardConfig {
    fn default() -> Self {
        DashboardConfig::new()
    }
}

/// What every handler shares.
pub(crate) struct Dashboard<B: Admin, P> {
    pub(crate) queue: B,
    pub(crate) hooks: Hooks<B::Tx, P>,
    pub(crate) config: DashboardConfig,
    /// The per-process CSRF token every form carries.
    pub(crate) csrf: String,
    /// The results of recent actions, shown once redirected back.
    pub(crate) flashes: Flashes,
}

/// Results of actions, kept for a minute under random keys (at most 1 000 of them).
#[derive(Default)]
pub(crate) struct Flashes(
    std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
);

impl Flashes {
    const KEEP: Duration = Duration::from_secs(60);
    const MOST: usize = 1_000;

    pub(crate) fn put(&self, notice: &str) -> String {
        let key = actions::random_hex::<16>();
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, (_, at)| at.elapsed() < Self::KEEP);
        if map.len() >= Self::MOST {
            map.clear();
        }
        map.insert(key.clone(), (notice.to_owned(), std::time::Instant::now()));
        key
    }

    pub(crate) fn get(&self, key: &str) -> Option<String> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key)
            .filter(|(_, at)| at.elapsed() < Self::KEEP)
            .map(|(notice, _)| notice.clone())
    }
}

impl<B: Admin, P> Dashboard<B, P> {
    /// A path inside the dashboard. Its root is the mount path itself (`/queues`, which a
    /// nested axum router answers; `/queues/` it does not).
    pub(crate) fn href(&self, path: &str) -> String {
        if path == "/" && !self.config.base_path.is_empty() {
            return self.config.base_path.clone();
        }
        format!("{}{path}", self.config.base_path)
    }

    /// Whether `path` is a path of the dashboard (for redirects back after an action).
    pub(crate) fn is_inside(&self, path: &str) -> bool {
        let base = &self.config.base_path;
        let inside = if base.is_empty() {
            path.starts_with('/')
        } else {
            path == base.as_str()
                || path.starts_with(&format!("{base}/"))
                || path.starts_with(&format!("{base}?"))
        };
        // Printable ASCII only: a tab or a newline in a path makes browsers read it otherwise.
        let plain = path
            .bytes()
            .all(|b| (0x21..0x7f).contains(&b) && b != b'\\');
        inside && plain && !path.contains("//")
    }
}

pub(crate) type Shared<B, P> = Arc<Dashboard<B, P>>;

/// The dashboard's router for the store `queue` belongs to (its other queues are reached with
/// [`Admin::for_queue`]); `hooks` run on every retry and cancel made through it.
pub fn router<B, P>(queue: B, hooks: Hooks<B::Tx, P>, config: DashboardConfig) -> Router
where
    B: Admin,
    P: DeserializeOwned + Send + Sync + 'static,
{
    let auth = config.auth.clone();
    let origins = Arc::new(config.allowed_origins.clone());
    let shared: Shared<B, P> = Arc::new(Dashboard {
        queue,
        hooks,
        config,
        csrf: actions::new_token(),
        flashes: Flashes::default(),
    });
    let router = Router::new()
        .route("/", get(pages::overview::<B, P>))
        .route("/jobs", get(pages::jobs::<B, P>))
        .route("/jobs/{id}", get(pages::job::<B, P>))
        .route("/jobs/{id}/retry", post(actions::retry::<B, P>))
        .route("/jobs/{id}/cancel", post(actions::cancel::<B, P>))
        .route(
            "/queues/{queue}/retry-dead",
            get(pages::confirm_retry_dead::<B, P>).post(actions::retry_dead::<B, P>),
        )
        .route(
            "/queues/{queue}/forget-schedule",
            get(pages::confirm_forget_schedule::<B, P>).post(actions::forget_schedule::<B, P>),
        )
        .route("/queues/{queue}/pause", post(actions::pause::<B, P>))
        .route("/queues/{queue}/resume", post(actions::resume::<B, P>))
        .with_state(shared);
    let router = match auth {
        Some(auth) => router.layer(axum::middleware::from_fn_with_state(
            Arc::new(auth),
            auth::require,
        )),
        None => router,
    };
    // Outermost: the host check and the security headers apply to every answer, 401s too.
    router
        .layer(axum::middleware::from_fn_with_state(origins, guard::hosts))
        .layer(axum::middleware::from_fn(guard::headers))
}

/// The shortest silence after which a schedule's record looks stale ([`schedule_looks_stale`]).
pub const SCHEDULE_STALE_FLOOR: TimeDelta = TimeDelta::minutes(10);

/// How long a schedule's record may go without a report before it looks stale: twice its
/// period (`next − through`; before its first period is handled, `next − seen_at`: its
/// scheduler wakes for `next` at the latest and reports again), and at least
/// [`SCHEDULE_STALE_FLOOR`].
pub fn schedule_stale_after(info: &ScheduleInfo) -> TimeDelta {
    let period = match (info.report.through, info.report.next) {
        (Some(through), Some(next)) => next - through,
        (None, Some(next)) => next - info.seen_at,
        (_, None) => TimeDelta::zero(),
    };
    period
        .checked_mul(2)
        .unwrap_or(TimeDelta::MAX)
        .max(SCHEDULE_STALE_FLOOR)
}

/// Whether no scheduler has reported the schedule lately, at `now`: its last report
/// (`seen_at`, by the store's clock) is older than [`schedule_stale_after`]. A hint, not a
/// verdict: the schedule may have been removed from the code (forget its record), or its
/// schedulers may be down or unable to reach the store.
pub fn schedule_looks_stale(info: &ScheduleInfo, now: DateTime<Utc>) -> bool {
    now - info.seen_at > schedule_stale_after(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use queue_core::ScheduleReport;

    fn info(through: Option<&str>, next: Option<&str>, seen_at: &str) -> ScheduleInfo {
        let at = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
        ScheduleInfo {
            report: ScheduleReport {
                name: "s".into(),
                spec: "every 60s from 1970-01-01T00:00:00Z".into(),
                missed: "skip after 60s".into(),
                through: through.map(at),
                next: next.map(at),
            },
            seen_at: at(seen_at),
            seen_by: "host:1".into(),
        }
    }

    #[test]
    fn a_schedule_looks_stale_after_twice_its_period_or_ten_minutes() {
        let at = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
        // Every minute: the floor, ten minutes.
        let minutely = info(
            Some("2026-01-01T00:00:00Z"),
            Some("2026-01-01T00:01:00Z"),
            "2026-01-01T00:00:01Z",
        );
        assert_eq!(schedule_stale_after(&minutely), SCHEDULE_STALE_FLOOR);
        assert!(!schedule_looks_stale(&minutely, at("2026-01-01T00:10:01Z")));
        assert!(schedule_looks_stale(&minutely, at("2026-01-01T00:10:02Z")));
        // Daily: two days.
        let daily = info(
            Some("2026-01-01T02:00:00Z"),
            Some("2026-01-02T02:00:00Z"),
            "2026-01-01T02:00:00Z",
        );
        assert_eq!(schedule_stale_after(&daily), TimeDelta::days(2));
        assert!(!schedule_looks_stale(&daily, at("2026-01-02T02:00:00Z")));
        assert!(schedule_looks_stale(&daily, at("2026-01-03T02:00:01Z")));
        // No period handled yet: the wait for the next one counts.
        let first = info(None, Some("2026-01-02T02:00:00Z"), "2026-01-01T14:00:00Z");
        assert_eq!(schedule_stale_after(&first), TimeDelta::days(1));
        // Nothing next: the floor.
        let over = info(Some("2026-01-01T02:00:00Z"), None, "2026-01-01T02:00:00Z");
        assert_eq!(schedule_stale_after(&over), SCHEDULE_STALE_FLOOR);
    }
}
