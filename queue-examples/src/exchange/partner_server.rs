//! A local partner HTTP server that records every POST with its idempotency key, its send job,
//! claim generation and sender, and when it arrived and was answered: the witness for "no
//! duplicate send". An observer can hold a POST before it is answered (the chaos suite kills its
//! sender there), and behaviours can change while it runs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

use super::http::{CLAIM_GENERATION, IDEMPOTENCY_KEY, SEND_JOB_ID};

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

/// One POST as the partner saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostRecord {
    /// Its place in arrival order, from 0.
    pub seq: usize,
    /// The partner's name (from the path).
    pub partner: String,
    /// The idempotency key.
    pub key: Option<String>,
    /// The send job (diagnostic header).
    pub job_id: Option<i64>,
    /// The claim generation of the attempt (diagnostic header).
    pub generation: Option<i64>,
    /// The sender's `User-Agent`.
    pub agent: Option<String>,
    /// When it arrived.
    pub arrived: Instant,
    /// When its answer was ready, and the status: `None` while it is held or being answered.
    pub answered: Option<(Instant, u16)>,
}

impl PostRecord {
    /// Whether it was answered 2xx.
    pub fn accepted(&self) -> bool {
        self.answered
            .is_some_and(|(_, status)| (200..300).contains(&status))
    }
}

/// Sees every POST before and after the partner answers it.
pub trait PostObserver: Send + Sync + 'static {
    /// A POST arrived (already recorded); its answer waits for the returned future.
    fn arrived(&self, post: &PostRecord) -> Pin<Box<dyn Future<Output = ()> + Send>>;
    /// The answer to a POST is ready and about to be written.
    fn answered(&self, post: &PostRecord);
}

#[derive(Default)]
struct Recorded {
    keys: HashMap<String, KeyRecord>,
    log: Vec<PostRecord>,
}

struct State {
    recorded: Mutex<Recorded>,
    behaviors: Mutex<HashMap<String, Behavior>>,
    observer: Mutex<Option<Arc<dyn PostObserver>>>,
    /// Fired at every POST's arrival.
    arrived: Notify,
    /// Fired at every POST's answer.
    answered: Notify,
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
            behaviors: Mutex::new(behaviors),
            observer: Mutex::new(None),
            arrived: Notify::new(),
            answered: Notify::new(),
            released: watch::Sender::new(false),
        });
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
                let state = served.clone();
                tokio::spawn(async move {
                    // Each POST is answered on a task of its own: like a real partner, it
                    // carries on (and is recorded) when its sender hangs up or dies.
                    let service = service_fn(move |req| {
                        let answering = tokio::spawn(answer(req, state.clone()));
                        async move {
                            answering.await.unwrap_or_else(|_| {
                                Ok(Response::builder()
                                    .status(StatusCode::INTERNAL_SERVER_ERROR)
                                    .body(Full::new(Bytes::new()))
                                    .expect("a static response"))
                            })
                        }
                    });
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
        self.state.recorded.lock().unwrap().log.len() as u64
    }

    /// Every POST so far, in arrival order.
    pub fn log(&self) -> Vec<PostRecord> {
        self.state.recorded.lock().unwrap().log.clone()
    }

    /// Changes how partner `name` answers from now on (POSTs already held keep their way).
    pub fn set_behavior(&self, name: &str, behavior: Behavior) {
        self.state
            .behaviors
            .lock()
            .unwrap()
            .insert(name.to_owned(), behavior);
    }

    /// Shows every POST from now on to `observer`.
    pub fn observe(&self, observer: Arc<dyn PostObserver>) {
        *self.state.observer.lock().unwrap() = Some(observer);
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

    /// Waits until every POST received so far has been answered, for at most `limit`; returns
    /// whether they all were.
    pub async fn wait_answered(&self, limit: Duration) -> bool {
        let all_answered = || {
            let recorded = self.state.recorded.lock().unwrap();
            recorded.log.iter().all(|post| post.answered.is_some())
        };
        tokio::time::timeout(limit, async {
            loop {
                let answered = self.state.answered.notified();
                tokio::pin!(answered);
                // Registered before the check, so an answer in between is not missed.
                answered.as_mut().enable();
                if all_answered() {
                    return;
                }
                answered.await;
            }
        })
        .await
        .is_ok()
    }

    /// Stops showing POSTs to the observer.
    pub fn stop_observing(&self) {
        *self.state.observer.lock().unwrap() = None;
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
    state: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let name = req
        .uri()
        .path()
        .strip_prefix("/partners/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let key = header(IDEMPOTENCY_KEY);
    let mut post = PostRecord {
        seq: 0,
        partner: name.clone(),
        key: key.clone(),
        job_id: header(SEND_JOB_ID).and_then(|v| v.parse().ok()),
        generation: header(CLAIM_GENERATION).and_then(|v| v.parse().ok()),
        agent: header(hyper::header::USER_AGENT.as_str()),
        arrived: Instant::now(),
        answered: None,
    };
    {
        let mut recorded = state.recorded.lock().unwrap();
        post.seq = recorded.log.len();
        recorded.log.push(post.clone());
        if let Some(key) = &key {
            recorded.keys.entry(key.clone()).or_default().received += 1;
        }
    }
    state.arrived.notify_waiters();
    let observer = state.observer.lock().unwrap().clone();
    if let Some(observer) = &observer {
        observer.arrived(&post).await;
    }
    let behavior = state.behaviors.lock().unwrap().get(&name).copied();
    let status = match (behavior, &key) {
        (None, _) => StatusCode::NOT_FOUND,
        (Some(_), None) => StatusCode::BAD_REQUEST,
        (Some(Behavior::Always(code)), _) => {
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }
        (Some(Behavior::Slow(delay)), _) => {
            tokio::time::sleep(delay).await;
            StatusCode::CREATED
        }
        (Some(Behavior::Held(code)), _) => {
            let mut released = state.released.subscribe();
            // The sender lives as long as the state this task holds.
            let _ = released.wait_for(|open| *open).await;
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }
        (Some(Behavior::Flaky { fail_rate, latency }), _) => {
            tokio::time::sleep(latency).await;
            if fastrand::f64() < fail_rate {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CREATED
            }
        }
    };
    post.answered = Some((Instant::now(), status.as_u16()));
    {
        let mut recorded = state.recorded.lock().unwrap();
        recorded.log[post.seq].answered = post.answered;
        if let Some(key) = key {
            let record = recorded.keys.entry(key).or_default();
            if status.is_success() {
                record.accepted += 1;
            } else {
                record.rejected += 1;
            }
        }
    }
    state.answered.notify_waiters();
    if let Some(observer) = &observer {
        observer.answered(&post);
    }
    Ok(Response::builder()
        .status(status)
        .body(Full::new(Bytes::new()))
        .expect("a static response"))
}
