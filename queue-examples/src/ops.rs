//! What an orchestrator and a Prometheus server ask a worker process: `/metrics` (the
//! framework's metrics in Prometheus' text format), `/healthz` (the process answers) and
//! `/readyz` (the database answers, the schema was checked at start-up, the worker is not
//! draining), as Kubernetes probes expect. `exchange-worker --metrics-addr` serves them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

/// How long `/readyz` waits for the database before it says not ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Event: the health and metrics endpoints are served (info).
pub const OPS_SERVING: &str = "exchange.ops_serving";

/// What `/readyz` reads: the pool to ping and whether the process drains.
#[derive(Debug)]
pub struct Readiness {
    pool: PgPool,
    draining: AtomicBool,
}

impl Readiness {
    /// Ready while `pool` answers, until [`Readiness::draining`] is called. Build it once the
    /// schema check passed (the queue's `connect`).
    pub fn new(pool: PgPool) -> Arc<Self> {
        Arc::new(Readiness {
            pool,
            draining: AtomicBool::new(false),
        })
    }

    /// From now on `/readyz` says not ready (the process drains: send it no more traffic).
    pub fn draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Why the process is not ready, or `None` when it is.
    pub async fn check(&self) -> Option<&'static str> {
        if self.draining.load(Ordering::SeqCst) {
            return Some("draining");
        }
        let ping = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&self.pool);
        match tokio::time::timeout(READY_TIMEOUT, ping).await {
            Ok(Ok(_)) => None,
            _ => Some("the database does not answer"),
        }
    }
}

/// Installs the Prometheus recorder for the process (before any worker starts: workers take
/// their metric handles when they start). Fails if a recorder is installed already.
pub fn install_recorder() -> Result<PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    PrometheusBuilder::new().install_recorder()
}

#[derive(Clone)]
struct Ops {
    metrics: PrometheusHandle,
    readiness: Arc<Readiness>,
}

/// The three endpoints, to serve or to mount under a path of a service's own router.
pub fn router(metrics: PrometheusHandle, readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(Ops { metrics, readiness })
}

async fn metrics_text(State(ops): State<Ops>) -> String {
    ops.metrics.render()
}

async fn ready(State(ops): State<Ops>) -> (StatusCode, String) {
    match ops.readiness.check().await {
        None => (StatusCode::OK, "ready\n".to_owned()),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Serves [`router`] on `addr` in a task of its own; returns the address it listens on (port 0
/// picks a free one).
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    readiness: Arc<Readiness>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = router(metrics, readiness);
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(name: OPS_SERVING, error = %err, "{OPS_SERVING}: the server stopped");
        }
    });
    tracing::info!(name: OPS_SERVING, addr = %bound, "{OPS_SERVING}");
    Ok(bound)
}
