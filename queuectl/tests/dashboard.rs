//! The dashboard as a person uses it: `queuectl serve` on a scratch database with known jobs,
//! driven by a real headless Chromium through chromedriver (WebDriver). `.ci/run` installs
//! Debian's `chromium` and `chromium-driver` when they are missing; without them this test fails,
//! it never skips.
//!
//! With `DASHBOARD_SCREENSHOTS=<dir>` the screenshots are written there too (the README's come
//! from `DASHBOARD_SCREENSHOTS=docs/img`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use queue_core::{
    Admin, Backend, ClaimRequest, Finalize, FinalizeOutcome, JobId, JobStatus, Lease, NewJob,
    ScheduleReport,
};
use queue_postgres::PgQueue;
use queue_postgres::testing::ScratchDb;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// What the page must show literally and never run.
const SCRIPT_IN_ERROR: &str = "<script>document.title='pwned'</script> partner said no";
const SCRIPT_IN_SCHEDULER: &str = "<script>window.__xss = 2</script>:7";
const SCRIPT_IN_PAYLOAD: &str = "<script>window.__xss = 1</script>";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `queuectl serve` on `db`; returns the process and the dashboard's base URL.
async fn serve(db: &ScratchDb, extra: &[&str]) -> (Child, String) {
    let url = format!("{}/{}", queue_postgres::testing::server_url(), db.name);
    let mut child = Command::new(env!("CARGO_BIN_EXE_queuectl"))
        .env("DATABASE_URL", url)
        .args(["serve", "--addr", "127.0.0.1:0", "--refresh", "0s"])
        .args(extra)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start queuectl serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("queuectl serve says where it listens")
        .unwrap()
        .expect("a line");
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim_end_matches('/')
        .to_owned();
    (child, base)
}

/// chromedriver on a free port, and a headless Chromium session through it.
async fn browser() -> (Child, Client, tempdir::Dir) {
    for tool in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            Path::new(tool).exists(),
            "{tool} is missing: apt-get install -y chromium chromium-driver (.ci/run does)"
        );
    }
    let port = free_port();
    let driver = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start chromedriver");
    let profile = tempdir::Dir::new();
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,1000",
                format!("--user-data-dir={}", profile.path().display()),
            ],
        }),
    );
    // A workspace build enables both of rustls' providers (ring for the exchange, aws-lc-rs
    // through the WebDriver client), and rustls then picks neither by itself.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let webdriver = format!("http://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let client = loop {
        let attempt = ClientBuilder::rustls()
            .expect("a WebDriver client")
            .capabilities(caps.clone())
            .connect(&webdriver)
            .await;
        match attempt {
            Ok(client) => break client,
            Err(err) if tokio::time::Instant::now() < deadline => {
                let _ = err;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("no WebDriver session: {err}"),
        }
    };
    (driver, client, profile)
}

/// A scratch directory, removed when dropped.
mod tempdir {
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            let path = std::env::temp_dir().join(format!(
                "queuectl-dashboard-{}-{}",
                std::process::id(),
                fastrand_suffix()
            ));
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn fastrand_suffix() -> u128 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    }
}

async fn text(client: &Client, css: &str) -> String {
    client
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css}: {e}"))
        .text()
        .await
        .unwrap()
}

/// The script planted in the data never ran: the title is the dashboard's, no global was set.
async fn assert_no_script_ran(client: &Client) {
    let ran = client
        .execute("return [document.title, typeof window.__xss];", vec![])
        .await
        .unwrap();
    assert_ne!(ran[0], json!("pwned"), "the error's script ran");
    assert_eq!(ran[1], json!("undefined"), "the payload's script ran");
}

fn screenshots_dir() -> Option<PathBuf> {
    std::env::var_os("DASHBOARD_SCREENSHOTS").map(PathBuf::from)
}

async fn screenshot(client: &Client, name: &str, scratch: &Path) {
    let png = client.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    std::fs::write(scratch.join(name), &png).unwrap();
    if let Some(dir) = screenshots_dir() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), &png).unwrap();
    }
}

/// Whether the page fits its window's width (no horizontal scrolling of the whole page).
async fn fits_width(client: &Client) -> bool {
    let widths = client
        .execute(
            "return [document.documentElement.scrollWidth, window.innerWidth];",
            vec![],
        )
        .await
        .unwrap();
    widths[0].as_i64().unwrap() <= widths[1].as_i64().unwrap()
}

async fn seed(queue: &PgQueue) -> JobId {
    for n in 0..5 {
        queue
            .enqueue(NewJob::new(&json!({ "n": n })).unwrap())
            .await
            .unwrap();
    }
    let ends = [
        (json!({ "n": "done-1" }), Finalize::Complete),
        (json!({ "n": "done-2" }), Finalize::Complete),
        (
            json!({ "note": SCRIPT_IN_PAYLOAD }),
            Finalize::Dead {
                reason: SCRIPT_IN_ERROR.into(),
            },
        ),
    ];
    let mut dead = JobId(0);
    for (payload, action) in ends {
        let id = queue
            .enqueue(
                NewJob::new(&payload)
                    .unwrap()
                    .run_at(queue_core::RunAt::Now),
            )
            .await
            .unwrap()
            .id;
        let jobs = queue
            .claim(ClaimRequest::new(10, Lease::DEFAULT).holder("worker-7:4242"))
            .await
            .unwrap()
            .jobs;
        // The claim takes the pending ones too: give those back, end this one.
        for job in jobs {
            let outcome = if job.id == id {
                action.clone()
            } else {
                Finalize::Release
            };
            assert_eq!(
                queue.finalize(job.claim(), &outcome).await.unwrap(),
                FinalizeOutcome::Applied
            );
        }
        if matches!(action, Finalize::Dead { .. }) {
            dead = id;
        }
    }
    dead
}

/// A second queue with a history: completions spread over the last 25 minutes, failures, a
/// backlog and a job in flight, so that the overview's chart has something to draw.
async fn seed_mail(db: &ScratchDb) {
    sqlx::raw_sql(
        "INSERT INTO queue_jobs (queue, status, payload, attempts, claim_generation, finished_at, created_at)
             SELECT 'mail', CASE WHEN g % 13 = 0 THEN 'failed' ELSE 'completed' END, '{}', 1, 1,
                    now() - make_interval(secs => (g * 37) % 1500), now() - interval '30 minutes'
             FROM generate_series(1, 140) g;
         INSERT INTO queue_jobs (queue, payload) SELECT 'mail', '{}' FROM generate_series(1, 12);
         INSERT INTO queue_jobs (queue, status, payload, attempts, claim_generation, claimed_at,
                                 lease_expires_at, lease_generation, claimed_by)
             VALUES ('mail', 'in_flight', '{}', 1, 1, now(), now() + interval '80 seconds', 1,
                     'worker-3:977');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_reads_the_overview_and_retries_a_dead_job_in_a_browser() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    let dead = seed(&queue).await;
    seed_mail(&db).await;
    let mail_limits = queue_core::QueueLimits {
        max_in_flight: Some(4),
        rate: Some(queue_core::RateLimit::new(100, Duration::from_secs(60)).unwrap()),
        max_per_partition: Some(1),
        rate_per_partition: Some(queue_core::RateLimit::new(10, Duration::from_secs(1)).unwrap()),
    };
    let mail = Admin::for_queue(&queue, queue_core::QueueName::new("mail").unwrap());
    mail.set_limits(mail_limits).await.unwrap();
    // Shown with the limits (one job of a partition at a time gets no grant: nothing else
    // changes).
    assert!(mail.set_room_grants(true).await.unwrap());
    // Two schedules of mail: one reported just now, one no scheduler reported for a day.
    let now = chrono::Utc::now();
    let schedule = |name: &str, spec: &str| ScheduleReport {
        name: name.to_owned(),
        spec: spec.to_owned(),
        missed: "catch up within 21600s".to_owned(),
        through: Some(now - chrono::TimeDelta::minutes(1)),
        next: Some(now),
    };
    mail.record_schedules(
        SCRIPT_IN_SCHEDULER,
        &[
            schedule("fx-rates", "every 60s from 1970-01-01T00:00:00Z"),
            schedule("nightly", "cron 0 2 * * * Europe/Berlin"),
        ],
    )
    .await
    .unwrap();
    sqlx::query(
        "UPDATE queue_jobs_schedules SET seen_at = now() - interval '1 day' WHERE name = 'fx-rates'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_server, base) = serve(&db, &["--allow-actions", "--show-payloads"]).await;
    let (_driver, client, profile) = browser().await;

    // The overview's counts are the database's, and the limits in force are shown.
    client.goto(&format!("{base}/")).await.unwrap();
    assert_eq!(
        text(&client, "section[data-queue='mail'] p[data-limits]").await,
        "Limits: at most 4 in flight, 100 starts per 60s, at most 1 in flight per partition, \
         10 starts per 1s per partition (room grants on)"
    );
    let stats = queue.stats(Duration::from_secs(60)).await.unwrap();
    let card = "section[data-queue='default']";
    for (count, expected) in [
        ("due", stats.due),
        ("running", 0),
        ("completed", stats.finished_last_hour.completed),
        ("dead", stats.finished_last_hour.dead),
    ] {
        assert_eq!(
            text(&client, &format!("{card} b[data-count='{count}']")).await,
            expected.to_string(),
            "overview count {count}"
        );
    }
    assert_eq!(
        (
            stats.due,
            stats.finished_last_hour.completed,
            stats.finished_last_hour.dead
        ),
        (5, 2, 1)
    );
    // The dead job is listed with its error, shown as text, never run.
    let row = format!("{card} table.dead tr[data-job='{}']", dead.0);
    let listed = text(&client, &row).await;
    assert!(
        listed.contains(SCRIPT_IN_ERROR),
        "the dead job's error: {listed:?}"
    );
    // Mail's schedules, the one no scheduler reported lately marked, the scheduler's name
    // shown as text.
    let stale_row = "table.schedules tr[data-queue='mail'][data-schedule='fx-rates']";
    let stale = text(&client, stale_row).await;
    for shown in [
        "fx-rates stale?",
        "every 60s from 1970-01-01T00:00:00Z",
        SCRIPT_IN_SCHEDULER,
    ] {
        assert!(stale.contains(shown), "{shown} in {stale:?}");
    }
    let fresh = text(
        &client,
        "table.schedules tr[data-queue='mail'][data-schedule='nightly']",
    )
    .await;
    assert_eq!(
        text(&client, "section[data-queue='mail'] p[data-schedules]").await,
        "Schedules: 2 (1 stale?)"
    );
    assert!(fresh.contains("cron 0 2 * * * Europe/Berlin"), "{fresh:?}");
    assert!(!fresh.contains("stale?"), "{fresh:?}");
    assert_no_script_ran(&client).await;
    assert!(fits_width(&client).await, "the overview overflows 1280 px");
    screenshot(&client, "dashboard-overview.png", profile.path()).await;

    // Forget the stale one: its confirmation page says it looks stale, then the record goes.
    client
        .find(Locator::Css(&format!("{stale_row} a.button")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(text(&client, "h1").await.contains("fx-rates"));
    assert!(text(&client, "p.stale").await.starts_with("stale?"));
    assert_no_script_ran(&client).await;
    client
        .find(Locator::Css("button[data-action='forget-schedule']"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    if client
        .wait()
        .for_element(Locator::Css("p.notice"))
        .await
        .is_err()
    {
        let url = client.current_url().await.unwrap();
        let page = client.source().await.unwrap();
        panic!("the forget's result is not shown at {url}: {page}");
    }
    assert!(
        text(&client, "p.notice")
            .await
            .contains("schedule fx-rates of mail forgotten")
    );
    let names: Vec<String> = mail
        .schedules()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.report.name)
        .collect();
    assert_eq!(names, ["nightly"]);
    assert!(
        client
            .find_all(Locator::Css(stale_row))
            .await
            .unwrap()
            .is_empty(),
        "the forgotten schedule is still shown"
    );

    // The job's page: its fields, its payload as text (started with --show-payloads).
    client
        .find(Locator::Css(&format!("{row} a")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(text(&client, "dd[data-field='status']").await, "dead");
    assert_eq!(text(&client, "dd[data-field='partition_key']").await, "–");
    assert_eq!(
        text(&client, "dd[data-field='last_error']").await,
        SCRIPT_IN_ERROR
    );
    assert!(
        text(&client, "pre[data-field='payload']")
            .await
            .contains(SCRIPT_IN_PAYLOAD)
    );
    assert!(
        text(&client, "table.errors")
            .await
            .contains("worker-7:4242")
    );
    assert_no_script_ran(&client).await;
    screenshot(&client, "dashboard-job.png", profile.path()).await;

    // Retry through the page: the database has the job pending again.
    client
        .find(Locator::Css("button[data-action='retry']"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    if client
        .wait()
        .for_element(Locator::Css("p.notice"))
        .await
        .is_err()
    {
        let url = client.current_url().await.unwrap();
        let page = client.source().await.unwrap();
        panic!("the retry's result is not shown at {url}: {page}");
    }
    assert!(text(&client, "p.notice").await.contains("retried"));
    assert_eq!(text(&client, "dd[data-field='status']").await, "pending");
    let row = queue.get(dead).await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts), (JobStatus::Pending, 0));

    // A narrow window: the pages still fit, tables scroll inside themselves.
    client.set_window_size(420, 900).await.unwrap();
    client.goto(&format!("{base}/")).await.unwrap();
    assert!(fits_width(&client).await, "the overview overflows 420 px");
    client
        .goto(&format!("{base}/jobs?queue=default"))
        .await
        .unwrap();
    assert!(fits_width(&client).await, "the jobs page overflows 420 px");
    screenshot(&client, "dashboard-narrow.png", profile.path()).await;
    client.close().await.unwrap();
    db.drop_db().await;
}

/// Read-only by default, payloads hidden: no action button, a forged POST refused, nothing
/// changed; a token-protected dashboard refuses a browser without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_dashboard_shows_and_changes_nothing_it_should_not() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    let dead = seed(&queue).await;
    queue
        .record_schedules(
            "host-a:1",
            &[ScheduleReport {
                name: "rates".to_owned(),
                spec: "every 60s from 1970-01-01T00:00:00Z".to_owned(),
                missed: "skip after 60s".to_owned(),
                through: None,
                next: None,
            }],
        )
        .await
        .unwrap();
    let (_server, base) = serve(&db, &[]).await;
    let (_driver, client, _profile) = browser().await;
    client.goto(&format!("{base}/")).await.unwrap();
    assert!(
        text(&client, "tr[data-schedule='rates']")
            .await
            .contains("host-a:1")
    );
    assert!(
        client
            .find_all(Locator::Css("a.button, button"))
            .await
            .unwrap()
            .is_empty(),
        "a read-only overview offers actions"
    );
    client
        .goto(&format!("{base}/jobs/{}?queue=default", dead.0))
        .await
        .unwrap();
    assert!(
        client
            .find_all(Locator::Css("button"))
            .await
            .unwrap()
            .is_empty(),
        "a read-only page offers actions"
    );
    let page = client.source().await.unwrap();
    assert!(
        !page.contains("window.__xss"),
        "the payload is shown without --show-payloads"
    );
    assert!(page.contains("Hidden"), "{page}");
    // A form a hostile page would post (no token of the dashboard's): refused, the job stays
    // dead. The page's own CSP forbids scripts from fetching, so the form is submitted.
    let target = format!("{base}/jobs/{}/retry", dead.0);
    client
        .execute(
            "const form = document.createElement('form');
             form.method = 'post'; form.action = arguments[0];
             for (const [name, value] of [['csrf', 'guess'], ['queue', 'default'], ['seen', 'dead']]) {
                 const input = document.createElement('input');
                 input.name = name; input.value = value; form.appendChild(input);
             }
             document.body.appendChild(form); form.submit();",
            vec![json!(target)],
        )
        .await
        .unwrap();
    client
        .wait()
        .for_url(&url::Url::parse(&target).unwrap())
        .await
        .unwrap();
    let refused = client.source().await.unwrap();
    assert!(refused.contains("read-only"), "{refused}");
    assert_eq!(
        queue.get(dead).await.unwrap().unwrap().status,
        JobStatus::Dead
    );
    client.close().await.unwrap();

    let (_guarded, guarded) = serve(&db, &["--token", "s3cret-token"]).await;
    let (_driver, client, _profile) = browser().await;
    client.goto(&format!("{guarded}/")).await.unwrap();
    let page = client.source().await.unwrap();
    assert!(page.contains("authentication required"), "{page}");
    assert!(
        !page.contains("data-queue"),
        "the overview was shown without the token"
    );
    client.close().await.unwrap();
    db.drop_db().await;
}
