//! The health and metrics endpoints: `/metrics` scraped after a run with known outcomes equals
//! them; `/readyz` says not ready while a worker drains and while the database is gone; the
//! `exchange-worker` process serves them with `--metrics-addr`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use queue_core::{
    Backend, ClaimRequest, Handler, JobContext, JobError, Lease, MemoryBackend, NewJob, QueueName,
    RetryPolicy, Worker, WorkerConfig,
};
use queue_examples::exchange::partner_server::{Behavior, PartnerServer};
use queue_examples::exchange::{ExchangeStore, PgExchange};
use queue_examples::ops::{self, Readiness};
use queue_postgres::testing::{ScratchDb, StopMode, TempCluster};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

/// A plain HTTP/1.1 GET: the status code and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of the sample `name{queue="<queue>"}` in a Prometheus text page (0 when absent).
fn sample(page: &str, name: &str, queue: &str) -> f64 {
    let labels = format!("{name}{{queue=\"{queue}\"}}");
    page.lines()
        .find_map(|line| line.strip_prefix(&labels))
        .map(|value| value.trim().parse().expect("a number"))
        .unwrap_or(0.0)
}

#[derive(serde::Deserialize)]
struct Step {
    kind: String,
}

struct Steps {
    started: Arc<Notify>,
    release: Arc<Notify>,
}

impl Handler for Steps {
    type Payload = Step;
    async fn handle(&self, ctx: JobContext, step: Step) -> Result<(), JobError> {
        match step.kind.as_str() {
            "fail" => Err(JobError::fail("refused")),
            "retry-once" if ctx.attempts() == 1 => Err(JobError::retry("not yet")),
            "hang" => {
                self.started.notify_one();
                self.release.notified().await;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn config(poll: Duration) -> WorkerConfig {
    WorkerConfig {
        concurrency: 2,
        poll_interval: poll,
        retry: RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            jitter: false,
        },
        ..WorkerConfig::default()
    }
}

/// A run with known outcomes, then a scrape: three completions, a failure, a retry, a takeover
/// of an expired lease and a write refused by the fence, each counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_counts_what_the_worker_did() {
    let handle = ops::install_recorder().expect("the only recorder of this test binary");
    let db = ScratchDb::new().await;
    let addr = ops::serve(
        "127.0.0.1:0".parse().unwrap(),
        handle,
        Readiness::new(db.pool.clone()),
    )
    .await
    .unwrap();
    let name = "scraped";
    let queue = MemoryBackend::new().with_queue(QueueName::new(name).unwrap());
    let lease = Lease::from_secs(10).unwrap();
    // A job whose worker died: claimed, its lease left to expire.
    queue
        .enqueue(NewJob::from_value(json!({ "kind": "ok" })))
        .await
        .unwrap();
    queue.claim(ClaimRequest::new(1, lease)).await.unwrap();
    queue.advance_clock(Duration::from_secs(11));
    for kind in ["ok", "fail", "retry-once"] {
        queue
            .enqueue(NewJob::from_value(json!({ "kind": kind })))
            .await
            .unwrap();
    }
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let steps = || Steps {
        started: started.clone(),
        release: release.clone(),
    };
    let worker = Worker::new(queue.clone(), steps(), config(Duration::from_millis(10)))
        .unwrap()
        .start();
    worker
        .wait_for_timeout(Duration::from_secs(20), |s| {
            s.completed == 3 && s.failed == 1
        })
        .await
        .expect("every job ends");
    worker.shutdown().await.unwrap();
    // A holder that loses its job while the handler runs: its write is fenced.
    let worker = Worker::new(queue.clone(), steps(), config(Duration::from_secs(3600)))
        .unwrap()
        .start();
    queue
        .enqueue(NewJob::from_value(json!({ "kind": "hang" })))
        .await
        .unwrap();
    started.notified().await;
    queue.advance_clock(WorkerConfig::default().lease.duration() + Duration::from_secs(1));
    assert_eq!(
        queue
            .claim(ClaimRequest::new(1, lease))
            .await
            .unwrap()
            .jobs
            .len(),
        1
    );
    release.notify_one();
    worker
        .wait_for_timeout(Duration::from_secs(20), |s| s.stale == 1)
        .await
        .expect("the holder's write is fenced");
    worker.shutdown().await.unwrap();

    let (status, page) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    let count = |metric| sample(&page, metric, name);
    use queue_core::metrics as m;
    assert_eq!(count(m::JOBS_ENQUEUED), 5.0, "{page}");
    assert_eq!(count(m::JOBS_COMPLETED), 3.0);
    assert_eq!(count(m::JOBS_FAILED), 1.0);
    assert_eq!(count(m::JOBS_RETRIED), 1.0);
    assert_eq!(count(m::JOBS_RECLAIMED), 1.0);
    assert_eq!(count(m::FINALIZE_STALE), 1.0);
    assert_eq!(count(m::JOBS_DEAD), 0.0);
    assert_eq!(count(m::JOBS_IN_FLIGHT), 0.0);
    assert!(
        page.contains(&format!(
            "{}_count{{queue=\"{name}\"}}",
            m::JOB_RUN_DURATION
        )),
        "{page}"
    );
    let (status, body) = get(addr, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    db.drop_db().await;
}

/// `/readyz` answers for the database and the drain: ready, not ready while the database is
/// stopped, ready again once it is back, not ready from the moment a drain starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_not_ready_while_the_database_is_gone_or_the_worker_drains() {
    let cluster = tokio::task::spawn_blocking(TempCluster::start)
        .await
        .unwrap()
        .expect("a cluster of the test's own");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy(&cluster.url("postgres"))
        .unwrap();
    let readiness = Readiness::new(pool);
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    let addr = ops::serve("127.0.0.1:0".parse().unwrap(), metrics, readiness.clone())
        .await
        .unwrap();
    assert_eq!(get(addr, "/readyz").await.0, 200);

    let cluster = Arc::new(cluster);
    let stopping = cluster.clone();
    tokio::task::spawn_blocking(move || stopping.stop(StopMode::Immediate))
        .await
        .unwrap()
        .unwrap();
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("database"), "{body}");
    assert_eq!(
        get(addr, "/healthz").await.0,
        200,
        "the process is alive all the same"
    );
    let restarting = cluster.clone();
    tokio::task::spawn_blocking(move || restarting.restart())
        .await
        .unwrap()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while get(addr, "/readyz").await.0 != 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not ready after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    readiness.draining();
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (503, "not ready: draining\n"));
}

/// `exchange-worker --metrics-addr` serves the endpoints; after SIGTERM, while a send is still
/// at the partner, `/readyz` says not ready, and the process exits once the send ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_binary_serves_the_endpoints_and_is_not_ready_while_it_drains() {
    let db = ScratchDb::with_prefix("ops_test").await;
    let store = PgExchange::migrate_and_connect(db.pool.clone())
        .await
        .unwrap();
    let server = PartnerServer::start(HashMap::from([("acme".to_owned(), Behavior::Held(201))]))
        .await
        .unwrap();
    store
        .create_transactions(&[("acme".into(), 1)])
        .await
        .unwrap();
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let url = format!("{}/{}", queue_postgres::testing::server_url(), db.name);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_exchange-worker"))
        .args(["--database-url", &url, "--metrics-addr", &addr.to_string()])
        .arg("--partner")
        .arg(format!("acme={}", server.endpoint("acme")))
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start exchange-worker");
    server.wait_posts(1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let answered = tokio::net::TcpStream::connect(addr).await.is_ok();
        if answered && get(addr, "/readyz").await.0 == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the endpoints never came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, page) = get(addr, "/metrics").await;
    assert_eq!(
        sample(&page, queue_core::metrics::JOBS_CLAIMED, "exchange.send"),
        1.0,
        "{page}"
    );
    assert_eq!(
        sample(&page, queue_core::metrics::JOBS_IN_FLIGHT, "exchange.send"),
        1.0
    );

    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = get(addr, "/readyz").await;
        if status == 503 {
            assert_eq!(body, "not ready: draining\n");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never said draining"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.release();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the worker drains and exits")
        .unwrap();
    assert!(status.success(), "exit status {status}");
    assert_eq!(store.summary().await.unwrap().success, 1);
    db.drop_db().await;
}
