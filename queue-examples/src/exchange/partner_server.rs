//! A local partner HTTP server that records every POST with its idempotency key: the witness
//! for "no duplicate send".

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use queue_core::CancellationToken;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

use super::http::IDEMPOTENCY_KEY;

/// How the partner at `/partners/<name>` answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Behavior {
    /// Accepts (201) after `latency`, except a fraction answered 503 at random.
    Flaky {
        /// The fraction of POSTs answered 503, in `[0, 1]`.
        fail_rate: f64,
        /// How long each answer takes.
        latency: Duration,
    },
    /// Always answers this status.
    Always(u16),
    /// Answers 201 after this delay (longer than the adapter's timeout: a timeout).
    Slow(Duration),
    /// Holds every POST until [`PartnerServer::release`], then answers this status: a partner
    /// that hangs for as long as a test needs, with no timing involved.
    Held(u16),
}

/// What the partner saw of one idempotency key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyRecord {
    /// POSTs received (counted on arrival, so a POST whose sender gave up still counts).
    pub received: u32,
    /// POSTs answered 2xx: more than one is a duplicate send.
    pub accepted: u32,
    /// POSTs answered otherwise.
    pub rejected: u32,
}

#[derive(Default)]
struct Recorded {
    keys: HashMap<String, KeyRecord>,
    posts: u64,
}

struct State {
    recorded: Mutex<Recorded>,
    /// Fired at every POST's arrival.
    arrived: Notify,
    /// Opens the held POSTs ([`Behavior::Held`]).
    released: watch::Sender<bool>,
}

/// A running partner server.
pub struct PartnerServer {
    addr: SocketAddr,
    state: Arc<State>,
    shutdown: CancellationToken,
}

impl PartnerServer {
    /// Starts a server on `127.0.0.1` (a free port) with a behaviour per partner name; unknown
    /// names get 404.
    pub async fn start(behaviors: HashMap<String, Behavior>) -> std::io::Result<PartnerServer> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            recorded: Mutex::new(Recorded::default()),
            arrived: Notify::new(),
            released: watch::Sender::new(false),
        });
        let behaviors = Arc::new(behaviors);
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let served = state.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(_) => continue,
                    },
                };
                let behaviors = behaviors.clone();
                let state = served.clone();
                tokio::spawn(async move {
                    let service =
                        service_fn(move |req| answer(req, behaviors.clone(), state.clone()));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(PartnerServer {
            addr,
            state,
            shutdown,
        })
    }

    /// The endpoint of partner `name`.
    pub fn endpoint(&self, name: &str) -> String {
        format!("http://{}/partners/{name}/transmissions", self.addr)
    }

    /// Every idempotency key seen, with what happened to its POSTs.
    pub fn keys(&self) -> HashMap<String, KeyRecord> {
        self.state.recorded.lock().unwrap().keys.clone()
    }

    /// POSTs received.
    pub fn posts(&self) -> u64 {
        self.state.recorded.lock().unwrap().posts
    }

    /// Waits until at least `n` POSTs have arrived.
    pub async fn wait_posts(&self, n: u64) {
        loop {
            let arrived = self.state.arrived.notified();
            tokio::pin!(arrived);
            // Registered before the count is read, so an arrival in between is not missed.
            arrived.as_mut().enable();
            if self.posts() >= n {
                return;
            }
            arrived.await;
        }
    }

    /// Lets every held POST ([`Behavior::Held`]) answer, and those to come answer at once.
    pub fn release(&self) {
        self.state.released.send_replace(true);
    }

    /// Accepted POSTs beyond the first for the same key: transmissions sent twice.
    pub fn duplicate_posts(&self) -> u64 {
        self.keys()
            .values()
            .map(|r| u64::from(r.accepted.saturating_sub(1)))
            .sum()
    }
}

impl Drop for PartnerServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn answer(
    req: Request<Incoming>,
    behaviors: Arc<HashMap<String, Behavior>>,
    state: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let name = req
        .uri()
        .path()
        .strip_prefix("/partners/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    let key = req
        .headers()
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    {
        let mut recorded = state.recorded.lock().unwrap();
        recorded.posts += 1;
        if let Some(key) = &key {
            recorded.keys.entry(key.clone()).or_default().received += 1;
        }
    }
    state.arrived.notify_waiters();
    let status = match (behaviors.get(&name), &key) {
        (None, _) => StatusCode::NOT_FOUND,
        (Some(_), None) => StatusCode::BAD_REQUEST,
        (Some(Behavior::Always(code)), _) => {
            StatusCode::from_u16(*code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }
        (Some(Behavior::Slow(delay)), _) => {
            tokio::time::sleep(*delay).await;
            StatusCode::CREATED
        }
        (Some(Behavior::Held(code)), _) => {
            let mut released = state.released.subscribe();
            // The sender lives as long as the state this task holds.
            let _ = released.wait_for(|open| *open).await;
            StatusCode::from_u16(*code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }
        (Some(Behavior::Flaky { fail_rate, latency }), _) => {
            tokio::time::sleep(*latency).await;
            if fastrand::f64() < *fail_rate {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CREATED
            }
        }
    };
    if let Some(key) = key {
        let mut recorded = state.recorded.lock().unwrap();
        let record = recorded.keys.entry(key).or_default();
        if status.is_success() {
            record.accepted += 1;
        } else {
            record.rejected += 1;
        }
    }
    Ok(Response::builder()
        .status(status)
        .body(Full::new(Bytes::new()))
        .expect("a static response"))
}
