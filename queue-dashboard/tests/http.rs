//! The dashboard over HTTP, on the in-memory backend: what it shows, what it refuses (actions
//! when read-only, a wrong CSRF token, another origin, no credentials) and that it stays
//! inside the path it is mounted under.

use std::net::SocketAddr;
use std::time::Duration;

use queue_core::{
    Admin, Backend, ClaimRequest, Finalize, FinalizeOutcome, Hooks, JobId, JobStatus, Lease,
    MemoryBackend, MemoryTx, NewJob, QueueLimits, QueueName, RateLimit, ScheduleReport,
};
use queue_dashboard::{Auth, DashboardConfig, router};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Response {
    status: u16,
    headers: String,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    }
}

async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut text = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        text.push_str(&format!("Host: {addr}\r\n"));
    }
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    if method == "POST" {
        text.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
        text.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    text.push_str("\r\n");
    text.push_str(body);
    stream.write_all(text.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Response {
        status,
        headers: head.to_owned(),
        body: body.to_owned(),
    }
}

async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A queue with one dead job whose error holds markup; returns the dead job's id.
async fn queue_with_a_dead_job() -> (MemoryBackend, JobId) {
    let queue = MemoryBackend::new();
    queue
        .enqueue(NewJob::new(&json!({ "secret": "4111 1111 1111 1111" })).unwrap())
        .await
        .unwrap();
    let job = queue
        .claim(ClaimRequest::new(1, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs
        .remove(0);
    let dead = Finalize::Dead {
        reason: "<img src=x onerror=alert(1)> failed".into(),
    };
    assert_eq!(
        queue.finalize(job.claim(), &dead).await.unwrap(),
        FinalizeOutcome::Applied
    );
    (queue, job.id)
}

fn hooks() -> Hooks<MemoryTx, Value> {
    Hooks::new()
}

/// A schedule's report: every minute, the last period handled a minute ago.
fn report(name: &str, spec: &str) -> ScheduleReport {
    let now = chrono::Utc::now();
    ScheduleReport {
        name: name.to_owned(),
        spec: spec.to_owned(),
        missed: "skip after 60s".to_owned(),
        through: Some(now - chrono::TimeDelta::minutes(1)),
        next: Some(now),
    }
}

fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a token")
        + 19;
    page[at..at + 64].to_owned()
}

#[tokio::test]
async fn pages_escape_what_they_show_and_hide_payloads() {
    let (queue, dead) = queue_with_a_dead_job().await;
    let partitioned = queue
        .enqueue(NewJob::from_value(json!({ "n": 1 })).partition_key("p<1>"))
        .await
        .unwrap()
        .id;
    let addr = serve(router(queue, hooks(), DashboardConfig::new())).await;
    let overview = request(addr, "GET", "/", &[], "").await;
    assert_eq!(overview.status, 200);
    assert!(
        overview
            .body
            .contains("&lt;img src=x onerror=alert(1)&gt; failed"),
        "{}",
        overview.body
    );
    assert!(
        !overview.body.contains("<img src=x"),
        "markup from an error reached the page"
    );
    let job = request(addr, "GET", &format!("/jobs/{}", dead.0), &[], "").await;
    assert_eq!(job.status, 200);
    assert!(!job.body.contains("4111"), "the payload is shown unasked");
    assert!(
        !job.body.contains("method=\"post\""),
        "a read-only page has action forms"
    );
    assert!(
        job.body
            .contains(r#"<dt>partition</dt><dd data-field="partition_key">–</dd>"#),
        "a job without a partition shows –: {}",
        job.body
    );
    let job = request(addr, "GET", &format!("/jobs/{}", partitioned.0), &[], "").await;
    assert_eq!(job.status, 200);
    assert!(
        job.body
            .contains(r#"<dt>partition</dt><dd data-field="partition_key">p&lt;1&gt;</dd>"#),
        "the partition key is shown, escaped, next to the unique key: {}",
        job.body
    );
    assert!(
        !job.body.contains("<1>"),
        "markup from a partition key reached the page"
    );
    let missing = request(addr, "GET", "/jobs/999", &[], "").await;
    assert_eq!(missing.status, 404);
    let bad = request(addr, "GET", "/jobs?queue=has%20space", &[], "").await;
    assert_eq!(bad.status, 400);
}

/// The overview shows every limit in force on a queue, the rate per partition included, and
/// nothing when none is.
#[tokio::test]
async fn the_overview_shows_every_limit_of_a_queue() {
    let queue = MemoryBackend::new();
    let addr = serve(router(queue.clone(), hooks(), DashboardConfig::new())).await;
    let limits_of = |body: &str| {
        let at = body.find("data-limits=\"")? + "data-limits=\"".len();
        Some(body[at..].split('"').next()?.to_owned())
    };
    let overview = request(addr, "GET", "/", &[], "").await;
    assert_eq!(overview.status, 200);
    assert_eq!(limits_of(&overview.body), None, "{}", overview.body);

    let rate = |starts, secs| RateLimit::new(starts, Duration::from_secs(secs)).unwrap();
    let all = QueueLimits {
        max_in_flight: Some(8),
        rate: Some(rate(100, 60)),
        max_per_partition: Some(2),
        rate_per_partition: Some(rate(10, 1)),
    };
    queue.set_limits(all).await.unwrap();
    let overview = request(addr, "GET", "/", &[], "").await;
    let shown = "at most 8 in flight, 100 starts per 60s, at most 2 in flight per partition, \
                 10 starts per 1s per partition";
    assert_eq!(limits_of(&overview.body).as_deref(), Some(shown));
    assert!(
        overview.body.contains(&format!("Limits: {shown}</p>")),
        "{}",
        overview.body
    );

    let alone = QueueLimits {
        rate_per_partition: Some(rate(3, 3600)),
        ..QueueLimits::NONE
    };
    queue.set_limits(alone).await.unwrap();
    let overview = request(addr, "GET", "/", &[], "").await;
    assert_eq!(
        limits_of(&overview.body).as_deref(),
        Some("3 starts per 3600s per partition")
    );

    queue.set_limits(QueueLimits::NONE).await.unwrap();
    let overview = request(addr, "GET", "/", &[], "").await;
    assert_eq!(limits_of(&overview.body), None, "{}", overview.body);
}

/// The overview, a filtered list and a job's page reload themselves at the same URL (the
/// filters and the cursor stay); a confirmation page does not.
#[tokio::test]
async fn lists_and_jobs_refresh_themselves_keeping_their_filters() {
    let (queue, dead) = queue_with_a_dead_job().await;
    let config = DashboardConfig::new()
        .refresh(Some(std::time::Duration::from_secs(7)))
        .allow_actions(true);
    let addr = serve(router(queue, hooks(), config)).await;
    let meta = "<meta http-equiv=\"refresh\" content=\"7\">";
    for path in [
        "/".to_owned(),
        "/jobs?queue=default&state=dead".to_owned(),
        format!("/jobs?queue=default&state=dead&before={}", dead.0 + 1),
        format!("/jobs/{}", dead.0),
    ] {
        let page = request(addr, "GET", &path, &[], "").await;
        assert_eq!(page.status, 200, "{path}");
        assert!(page.body.contains(meta), "{path} does not refresh");
        // A refresh without a URL reloads this one: nothing may point elsewhere.
        assert!(!page.body.contains("content=\"7;"), "{path}");
    }
    let list = request(addr, "GET", "/jobs?queue=default&state=dead", &[], "").await;
    assert!(
        list.body.contains(&format!("/jobs/{}", dead.0)),
        "{}",
        list.body
    );
    let confirm = request(addr, "GET", "/queues/default/retry-dead", &[], "").await;
    assert_eq!(confirm.status, 200, "{}", confirm.body);
    assert!(
        !confirm.body.contains(meta),
        "a confirmation page refreshes"
    );
}

#[tokio::test]
async fn a_read_only_dashboard_refuses_every_action() {
    let (queue, dead) = queue_with_a_dead_job().await;
    queue
        .record_schedules(
            "host-a:1",
            &[report("rates", "every 60s from 1970-01-01T00:00:00Z")],
        )
        .await
        .unwrap();
    let addr = serve(router(queue.clone(), hooks(), DashboardConfig::new())).await;
    for path in [
        format!("/jobs/{}/retry", dead.0),
        format!("/jobs/{}/cancel", dead.0),
        "/queues/default/pause".to_owned(),
        "/queues/default/retry-dead".to_owned(),
        "/queues/default/forget-schedule".to_owned(),
    ] {
        let refused = request(addr, "POST", &path, &[], "csrf=x&seen=dead&name=rates").await;
        assert_eq!(refused.status, 403, "{path}");
    }
    assert_eq!(
        queue.get(dead).await.unwrap().unwrap().status,
        JobStatus::Dead
    );
    assert!(!queue.control().await.unwrap().is_paused());
    assert_eq!(
        queue.schedules().await.unwrap().len(),
        1,
        "a schedule forgotten"
    );
}

#[tokio::test]
async fn actions_need_the_pages_token_and_its_origin_and_report_back() {
    let (queue, dead) = queue_with_a_dead_job().await;
    let config = DashboardConfig::new().allow_actions(true);
    let addr = serve(router(queue.clone(), hooks(), config)).await;
    let page = request(
        addr,
        "GET",
        &format!("/jobs/{}?queue=default", dead.0),
        &[],
        "",
    )
    .await;
    let token = csrf_of(&page.body);
    let retry = format!("/jobs/{}/retry", dead.0);
    let wrong = request(addr, "POST", &retry, &[], "csrf=00&queue=default&seen=dead").await;
    assert_eq!(wrong.status, 403);
    let form = format!(
        "csrf={token}&queue=default&seen=dead&back=%2Fjobs%2F{}%3Fqueue%3Ddefault",
        dead.0
    );
    let foreign = request(
        addr,
        "POST",
        &retry,
        &[("Origin", "http://evil.example")],
        &form,
    )
    .await;
    assert_eq!(foreign.status, 403);
    assert_eq!(
        queue.get(dead).await.unwrap().unwrap().status,
        JobStatus::Dead
    );

    let origin = format!("http://{addr}");
    let done = request(addr, "POST", &retry, &[("Origin", origin.as_str())], &form).await;
    assert_eq!(done.status, 303, "{}", done.body);
    let location = done.header("location").unwrap();
    assert!(
        location.starts_with(&format!("/jobs/{}?queue=default&flash=", dead.0)),
        "{location}"
    );
    assert_eq!(
        queue.get(dead).await.unwrap().unwrap().status,
        JobStatus::Pending
    );
    let shown = request(addr, "GET", &location, &[], "").await;
    assert!(
        shown.body.contains("retried: pending again"),
        "{}",
        shown.body
    );
    // A flash key nobody was given shows nothing; a guessed message cannot be planted.
    let planted = request(addr, "GET", "/?flash=Your%20session%20expired", &[], "").await;
    assert!(!planted.body.contains("session expired"));

    // A second retry of the same job: refused by the guard, said so.
    let again = request(addr, "POST", &retry, &[], &form).await;
    let shown = request(addr, "GET", &again.header("location").unwrap(), &[], "").await;
    assert!(shown.body.contains("it is pending now"), "{}", shown.body);

    // Pause and resume through the overview's forms.
    let pause = request(
        addr,
        "POST",
        "/queues/default/pause",
        &[],
        &format!("csrf={token}&back=%2F"),
    )
    .await;
    assert_eq!(pause.status, 303);
    assert!(queue.control().await.unwrap().is_paused());
    let overview = request(addr, "GET", "/", &[], "").await;
    assert!(overview.body.contains("paused"));
    request(
        addr,
        "POST",
        "/queues/default/resume",
        &[],
        &format!("csrf={token}&back=%2F"),
    )
    .await;
    assert!(!queue.control().await.unwrap().is_paused());
}

#[tokio::test]
async fn credentials_are_required_when_configured() {
    let (queue, _) = queue_with_a_dead_job().await;
    let basic = DashboardConfig::new().auth(Auth::basic("ops:open sesame"));
    let addr = serve(router(queue.clone(), hooks(), basic)).await;
    let refused = request(addr, "GET", "/", &[], "").await;
    assert_eq!(refused.status, 401);
    assert!(
        refused
            .header("www-authenticate")
            .unwrap()
            .starts_with("Basic")
    );
    // base64("ops:open sesame")
    let admitted = request(
        addr,
        "GET",
        "/",
        &[("Authorization", "Basic b3BzOm9wZW4gc2VzYW1l")],
        "",
    )
    .await;
    assert_eq!(admitted.status, 200);
    let bearer = DashboardConfig::new().auth(Some(Auth::Bearer("t0ken".into())));
    let addr = serve(router(queue, hooks(), bearer)).await;
    assert_eq!(
        request(
            addr,
            "GET",
            "/jobs",
            &[("Authorization", "Bearer nope")],
            ""
        )
        .await
        .status,
        401
    );
    assert_eq!(
        request(
            addr,
            "GET",
            "/jobs",
            &[("Authorization", "Bearer t0ken")],
            ""
        )
        .await
        .status,
        200
    );
}

#[tokio::test]
async fn mounted_under_a_prefix_it_stays_inside_it() {
    let (queue, dead) = queue_with_a_dead_job().await;
    let config = DashboardConfig::new()
        .base_path("/ops/queues/")
        .allow_actions(true);
    let app = axum::Router::new().nest("/ops/queues", router(queue.clone(), hooks(), config));
    let addr = serve(app).await;
    let overview = request(addr, "GET", "/ops/queues", &[], "").await;
    assert_eq!(overview.status, 200, "{}", overview.body);
    assert!(overview.body.contains("href=\"/ops/queues/jobs\""));
    assert!(
        !overview.body.contains("href=\"/jobs"),
        "a link leaves the prefix"
    );
    let token = csrf_of(&overview.body);
    // A `back` outside the dashboard is not followed.
    let form = format!("csrf={token}&queue=default&seen=dead&back=https%3A%2F%2Fevil.example%2F");
    let done = request(
        addr,
        "POST",
        &format!("/ops/queues/jobs/{}/retry", dead.0),
        &[],
        &form,
    )
    .await;
    let location = done.header("location").unwrap();
    assert!(location.starts_with("/ops/queues?flash="), "{location}");
    // Nor is one that only looks like it.
    let form = format!("csrf={token}&queue=default&seen=dead&back=%2Fops%2Fqueues-evil%2F");
    let done = request(
        addr,
        "POST",
        &format!("/ops/queues/jobs/{}/retry", dead.0),
        &[],
        &form,
    )
    .await;
    assert!(
        done.header("location")
            .unwrap()
            .starts_with("/ops/queues?flash=")
    );
}

#[tokio::test]
async fn only_its_own_hosts_are_served_with_safe_headers() {
    let (queue, _) = queue_with_a_dead_job().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = DashboardConfig::new().allow_actions(true).allowed_origins([
        format!("http://{addr}"),
        "https://dash.example.com".to_owned(),
    ]);
    let app = router(queue.clone(), hooks(), config);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let page = request(addr, "GET", "/", &[], "").await;
    assert_eq!(page.status, 200);
    for (name, value) in [
        ("x-frame-options", "DENY"),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "same-origin"),
    ] {
        assert_eq!(page.header(name).as_deref(), Some(value), "{name}");
    }
    assert!(
        page.header("content-security-policy")
            .unwrap()
            .contains("frame-ancestors 'none'")
    );
    // A page whose name was rebound to this address: refused, reads nothing.
    let rebound = request(addr, "GET", "/", &[("Host", "evil.example:8080")], "").await;
    assert_eq!(rebound.status, 421);
    assert!(!rebound.body.contains("csrf"));
    // Behind the proxy it was told of, an action from the proxy's origin goes through.
    let token = csrf_of(&page.body);
    let proxied = request(
        addr,
        "POST",
        "/queues/default/pause",
        &[
            ("Host", "dash.example.com"),
            ("Origin", "https://dash.example.com"),
        ],
        &format!("csrf={token}&back=%2F"),
    )
    .await;
    assert_eq!(proxied.status, 303, "{}", proxied.body);
    let http_origin = request(
        addr,
        "POST",
        "/queues/default/resume",
        &[
            ("Host", "dash.example.com"),
            ("Origin", "http://dash.example.com"),
        ],
        &format!("csrf={token}&back=%2F"),
    )
    .await;
    assert_eq!(http_origin.status, 403, "the scheme counts");
}

#[tokio::test]
async fn bulk_retry_asks_first_and_unknown_queues_are_refused() {
    let (queue, dead) = queue_with_a_dead_job().await;
    let other = queue.for_queue(queue_core::QueueName::new("mail").unwrap());
    let unique = other
        .enqueue(NewJob::new(&1).unwrap().unique_key("order-12"))
        .await
        .unwrap()
        .id;
    let addr = serve(router(
        queue.clone(),
        hooks(),
        DashboardConfig::new().allow_actions(true),
    ))
    .await;
    let confirm = request(addr, "GET", "/queues/default/retry-dead", &[], "").await;
    assert_eq!(confirm.status, 200);
    assert!(confirm.body.contains("has 1 dead jobs"), "{}", confirm.body);
    assert_eq!(
        queue.get(dead).await.unwrap().unwrap().status,
        JobStatus::Dead,
        "a GET changed it"
    );
    let token = csrf_of(&confirm.body);
    let done = request(
        addr,
        "POST",
        "/queues/default/retry-dead",
        &[],
        &format!("csrf={token}&back=%2F"),
    )
    .await;
    let shown = request(addr, "GET", &done.header("location").unwrap(), &[], "").await;
    assert!(
        shown
            .body
            .contains("1 dead jobs of default retried, 0 had moved on, 0 refused"),
        "{}",
        shown.body
    );
    assert_eq!(
        queue.get(dead).await.unwrap().unwrap().status,
        JobStatus::Pending
    );
    let unknown = request(
        addr,
        "POST",
        "/queues/no-such-queue/pause",
        &[],
        &format!("csrf={token}"),
    )
    .await;
    assert_eq!(unknown.status, 404);
    // The search box finds a job of another queue, by its unique key and by its id.
    for search in ["order-12".to_owned(), unique.0.to_string()] {
        let found = request(addr, "GET", &format!("/jobs?q={search}"), &[], "").await;
        assert_eq!(found.status, 303, "{search}");
        assert_eq!(
            found.header("location").unwrap(),
            format!("/jobs/{}?queue=mail", unique.0)
        );
    }
}

/// The overview shows each queue's recorded schedules, every value escaped; with actions
/// allowed, a schedule is forgotten only after its confirmation page, with the page's token.
#[tokio::test]
async fn schedules_are_shown_escaped_and_forgotten_after_a_confirmation() {
    let (queue, _) = queue_with_a_dead_job().await;
    let hostile = "every 60s from <img src=x onerror=alert(1)>";
    queue
        .record_schedules(
            "host<script>alert(1)</script>:1",
            &[
                report("nightly.v2", hostile),
                report("a b&c", "cron 0 2 * * * UTC"),
            ],
        )
        .await
        .unwrap();
    let mail = queue.for_queue(QueueName::new("mail").unwrap());
    mail.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    mail.record_schedules("host-b:2", &[report("digest", "cron 0 7 * * 1 UTC")])
        .await
        .unwrap();

    let addr = serve(router(queue.clone(), hooks(), DashboardConfig::new())).await;
    let overview = request(addr, "GET", "/", &[], "").await;
    assert_eq!(overview.status, 200);
    let body = &overview.body;
    for shown in [
        r#"data-queue="default" data-schedule="nightly.v2">"#,
        r#"<td class="text" data-field="spec">every 60s from &lt;img src=x onerror=alert(1)&gt;</td>"#,
        r#"<td data-field="missed">skip after 60s</td>"#,
        "<br>by host&lt;script&gt;alert(1)&lt;/script&gt;:1</td>",
        r#"data-queue="default" data-schedule="a b&amp;c">"#,
        r#"data-queue="mail" data-schedule="digest">"#,
        // Each card counts its queue's schedules and links to their rows.
        r##"<a href="#schedules-default">Schedules: 2</a>"##,
        r##"<a href="#schedules-mail">Schedules: 1</a>"##,
        r##"<tr id="schedules-mail" data-queue="mail""##,
    ] {
        assert!(body.contains(shown), "{shown} not in {body}");
    }
    assert!(
        !body.contains("<img src=x"),
        "markup from a spec reached the page"
    );
    assert!(
        !body.contains("<script>alert"),
        "markup from seen_by reached the page"
    );
    assert!(
        !body.contains("stale?"),
        "just reported, yet marked stale: {body}"
    );
    assert!(
        !body.contains("forget-schedule"),
        "a read-only page offers to forget"
    );

    let addr = serve(router(
        queue.clone(),
        hooks(),
        DashboardConfig::new().allow_actions(true),
    ))
    .await;
    let overview = request(addr, "GET", "/", &[], "").await;
    assert!(
        overview
            .body
            .contains(r#"href="/queues/default/forget-schedule?name=nightly.v2""#),
        "{}",
        overview.body
    );
    // A name that needs it is percent-encoded in the link, and found again.
    assert!(
        overview
            .body
            .contains(r#"href="/queues/default/forget-schedule?name=a%20b%26c""#),
        "{}",
        overview.body
    );
    let confirm = request(
        addr,
        "GET",
        "/queues/default/forget-schedule?name=a%20b%26c",
        &[],
        "",
    )
    .await;
    assert_eq!(confirm.status, 200, "{}", confirm.body);
    assert!(
        confirm.body.contains(r#"name="name" value="a b&amp;c""#),
        "{}",
        confirm.body
    );

    let confirm = request(
        addr,
        "GET",
        "/queues/default/forget-schedule?name=nightly.v2",
        &[],
        "",
    )
    .await;
    assert_eq!(confirm.status, 200, "{}", confirm.body);
    assert!(
        confirm.body.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{}",
        confirm.body
    );
    assert!(!confirm.body.contains("<img src=x"));
    assert!(!confirm.body.contains("<script>alert"));
    assert!(confirm.body.contains(r#"data-action="forget-schedule""#));
    assert!(
        !confirm.body.contains("http-equiv=\"refresh\""),
        "a confirmation page refreshes"
    );
    assert_eq!(
        queue.schedules().await.unwrap().len(),
        2,
        "a GET changed it"
    );
    // A name nobody recorded: not found, and not repeated on the page.
    let missing = request(
        addr,
        "GET",
        "/queues/default/forget-schedule?name=%3Cmarquee%3E",
        &[],
        "",
    )
    .await;
    assert_eq!(missing.status, 404);
    assert!(!missing.body.contains("marquee"), "{}", missing.body);
    let bad = request(
        addr,
        "GET",
        "/queues/has%20space/forget-schedule?name=x",
        &[],
        "",
    )
    .await;
    assert_eq!(bad.status, 400);

    let token = csrf_of(&confirm.body);
    let path = "/queues/default/forget-schedule";
    let wrong = request(addr, "POST", path, &[], "csrf=00&name=nightly.v2&back=%2F").await;
    assert_eq!(wrong.status, 403);
    let form = format!("csrf={token}&name=nightly.v2&back=%2F");
    let foreign = request(
        addr,
        "POST",
        path,
        &[("Origin", "http://evil.example")],
        &form,
    )
    .await;
    assert_eq!(foreign.status, 403);
    assert_eq!(
        queue.schedules().await.unwrap().len(),
        2,
        "a refused POST changed it"
    );
    let nameless = request(addr, "POST", path, &[], &format!("csrf={token}&back=%2F")).await;
    assert_eq!(nameless.status, 400);

    let done = request(addr, "POST", path, &[], &form).await;
    assert_eq!(done.status, 303, "{}", done.body);
    let location = done.header("location").unwrap();
    assert!(location.starts_with("/?flash="), "{location}");
    let names: Vec<String> = queue
        .schedules()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.report.name)
        .collect();
    assert_eq!(names, ["a b&c"]);
    assert_eq!(
        mail.schedules().await.unwrap().len(),
        1,
        "another queue's stays"
    );
    let shown = request(addr, "GET", &location, &[], "").await;
    assert!(
        shown
            .body
            .contains("schedule nightly.v2 of default forgotten"),
        "{}",
        shown.body
    );
    assert!(!shown.body.contains(r#"data-schedule="nightly.v2""#));
    let again = request(addr, "POST", path, &[], &form).await;
    let shown = request(addr, "GET", &again.header("location").unwrap(), &[], "").await;
    assert!(
        shown
            .body
            .contains("schedule nightly.v2 of default was not recorded"),
        "{}",
        shown.body
    );
}
