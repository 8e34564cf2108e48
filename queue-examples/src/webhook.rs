//! Webhook delivery: a second queue, unrelated to the exchange, built from the framework's
//! public API alone. Any backend works; deliveries carry the event id as their idempotency key.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use queue_core::{
    Backend, Enqueued, Handler, JobContext, JobError, NewJob, Worker, WorkerConfig, WorkerHandle,
};
use serde::{Deserialize, Serialize};

/// One delivery: POST `body` to `url`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Webhook {
    /// The event's id: the unique key of its job and the receiver's idempotency key.
    pub event_id: String,
    /// Where to deliver.
    pub url: String,
    /// The JSON body.
    pub body: serde_json::Value,
}

/// Enqueues a delivery once per event id (a second enqueue of the same event is a no-op).
pub async fn enqueue<B: Backend>(queue: &B, hook: &Webhook) -> queue_core::Result<Enqueued> {
    queue
        .enqueue(NewJob::new(hook)?.unique_key(hook.event_id.clone()))
        .await
}

/// Delivers webhooks over HTTP.
#[derive(Clone)]
pub struct Deliverer {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl Deliverer {
    /// A deliverer giving each POST `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Deliverer {
            client: Client::builder(TokioExecutor::new()).build_http(),
            timeout,
        }
    }
}

impl Handler for Deliverer {
    type Payload = Webhook;

    async fn handle(&self, ctx: JobContext, hook: Webhook) -> Result<(), JobError> {
        let request = Request::post(hook.url.as_str())
            .header("content-type", "application/json")
            .header("idempotency-key", hook.event_id.as_str())
            .header("x-delivery-attempt", ctx.attempts().to_string())
            .body(Full::new(Bytes::from(hook.body.to_string())))
            .map_err(JobError::fail)?;
        let response = tokio::time::timeout(self.timeout, self.client.request(request))
            .await
            .map_err(|_| JobError::retry("receiver timed out"))??;
        let status = response.status();
        let _ = response.into_body().collect().await;
        match status.as_u16() {
            200..=299 => Ok(()),
            // The receiver says the subscription is gone: nothing to retry, nothing failed.
            410 => Err(JobError::cancel("receiver answered 410 Gone")),
            408 | 429 | 500..=599 => Err(JobError::retry(format!("receiver answered {status}"))),
            _ => Err(JobError::fail(format!("receiver answered {status}"))),
        }
    }
}

/// Starts a delivery worker on `queue`: 10 s per POST, 8 at once, the framework's defaults
/// for everything else (90 s lease, graceful shutdown, backoff with jitter).
pub fn start_worker<B: Backend>(queue: B) -> queue_core::Result<WorkerHandle> {
    let config = WorkerConfig {
        job_timeout: Duration::from_secs(15),
        ..WorkerConfig::default()
    };
    Ok(Worker::new(queue, Deliverer::new(Duration::from_secs(10)), config)?.start())
}
