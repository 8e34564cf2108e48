//! The HTTP partner adapter.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::{DEFAULT_SEND_TIMEOUT, Partner, SendError, Transmission};

/// The header carrying the transmission's idempotency key (its correlation id).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// A diagnostic header: the claim generation of the attempt (changes on every claim).
pub const CLAIM_GENERATION: &str = "x-claim-generation";
/// A diagnostic header: the send job.
pub const SEND_JOB_ID: &str = "x-send-job-id";

/// A partner reached by `POST <endpoint>` with a JSON body.
#[derive(Clone)]
pub struct HttpPartner {
    endpoint: hyper::Uri,
    timeout: Duration,
    user_agent: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl HttpPartner {
    /// A partner at `endpoint` (an `http://` URL) with the default 30 s send timeout.
    pub fn new(endpoint: &str) -> Result<Self, SendError> {
        let endpoint: hyper::Uri = endpoint
            .parse()
            .map_err(|e| SendError::Transport(format!("invalid endpoint {endpoint:?}: {e}")))?;
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build_http();
        Ok(HttpPartner {
            endpoint,
            timeout: DEFAULT_SEND_TIMEOUT,
            user_agent: None,
            client,
        })
    }

    /// Sets the send timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends this `User-Agent` (the worker names its process, so the partner's records say
    /// which process sent what).
    pub fn with_user_agent(mut self, user_agent: impl Into<String>) -> Self {
        self.user_agent = Some(user_agent.into());
        self
    }

    async fn post(&self, transmission: Transmission<'_>) -> Result<(), SendError> {
        let body = serde_json::to_vec(transmission.payload)
            .map_err(|e| SendError::Transport(e.to_string()))?;
        let mut request = Request::builder();
        if let Some(agent) = &self.user_agent {
            request = request.header(hyper::header::USER_AGENT, agent);
        }
        let request = request
            .method(Method::POST)
            .uri(self.endpoint.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(IDEMPOTENCY_KEY, &transmission.payload.correlation_id)
            .header(CLAIM_GENERATION, transmission.generation.to_string())
            .header(SEND_JOB_ID, transmission.job_id.to_string())
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| SendError::Transport(e.to_string()))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| SendError::Transport(e.to_string()))?;
        let status = response.status();
        // Read the body so the connection goes back to the pool.
        let _ = response.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(SendError::Status(status.as_u16()))
        }
    }
}

#[async_trait]
impl Partner for HttpPartner {
    fn send_timeout(&self) -> Duration {
        self.timeout
    }

    async fn send(&self, transmission: Transmission<'_>) -> Result<(), SendError> {
        tokio::time::timeout(self.timeout, self.post(transmission))
            .await
            .map_err(|_| SendError::Timeout(self.timeout))?
    }
}
