//! The partner adapter end to end: endpoints checked at start-up, bounded duration flags, HTTPS
//! against a local partner with a certificate made here, credentials kept out of every log line
//! and stored error, and ambiguous sends retried under their own idempotency key (on both
//! exchange stores).

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;
use queue_core::{Backend, CancellationToken, JobId, JobStatus, Worker, WorkerHandle};
use queue_examples::exchange::partner_server::{Behavior, PartnerServer};
use queue_examples::exchange::{
    EventType, ExchangeConfig, ExchangeStore, FailureKind, HttpPartner, MemExchange, Partner,
    Partners, PgExchange, RetryOutcome, SendError, SendHandler, SendPayload, TransactionStatus,
    Transmission, log_configured,
};
use queue_postgres::testing::ScratchDb;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;

/// Every test's tracing output, from every thread: the redaction test reads it whole.
static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A global subscriber (the workers' tasks run on every thread) writing everything, at every
/// level, to [`LOGS`].
fn capture_logs() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
    });
}

fn logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap()).into_owned()
}

async fn exchange_db() -> (ScratchDb, PgExchange) {
    let db = ScratchDb::with_prefix("partner_test").await;
    let store = PgExchange::migrate_and_connect(db.pool.clone())
        .await
        .expect("the exchange's migrations apply");
    (db, store)
}

fn quick(max_attempts: u32) -> ExchangeConfig {
    ExchangeConfig {
        max_attempts,
        retry_base: Duration::from_millis(10),
        poll_interval: Duration::from_millis(50),
        ..ExchangeConfig::default()
    }
}

fn start<S: ExchangeStore>(
    store: &S,
    partners: &Partners,
    config: &ExchangeConfig,
) -> WorkerHandle {
    Worker::new(
        store.queue().clone(),
        SendHandler::new(store.clone(), partners.clone()),
        config.worker_config(partners).unwrap(),
    )
    .unwrap()
    .hooks(store.hooks())
    .start()
}

/// Waits until transaction `id` is `status` (polling the store, bounded).
async fn wait_status<S: ExchangeStore>(store: &S, id: i64, status: TransactionStatus) {
    tokio::time::timeout(Duration::from_secs(60), async {
        while store.transaction(id).await.unwrap().unwrap().status != status {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("transaction {id} should end {status:?}"));
}

/// The status, attempts and `last_error` of a transaction's latest send job.
async fn latest_send_job<S: ExchangeStore>(store: &S, id: i64) -> (JobStatus, i32, String) {
    let jobs = store.send_jobs(id).await.unwrap();
    let job = store
        .queue()
        .get(JobId(*jobs.last().unwrap()))
        .await
        .unwrap()
        .unwrap();
    (job.status, job.attempts, job.last_error.unwrap_or_default())
}

/// `endpoint` with `user:secret@` in front of its host.
fn with_credentials(endpoint: &str) -> String {
    let (scheme, rest) = endpoint.split_once("://").unwrap();
    format!("{scheme}://user:secret@{rest}")
}

/// A CA and a certificate for `127.0.0.1` signed by it, made for this test.
struct TestPki {
    ca_pem: String,
    server_cert: rustls::pki_types::CertificateDer<'static>,
    server_key: rustls::pki_types::PrivateKeyDer<'static>,
}

fn test_pki() -> TestPki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "exchange test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let server_key = rcgen::KeyPair::generate().unwrap();
    let server_params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    let server_cert = server_params.signed_by(&server_key, &ca).unwrap();
    TestPki {
        ca_pem: ca.pem(),
        server_cert: server_cert.der().clone(),
        server_key: rustls::pki_types::PrivateKeyDer::Pkcs8(server_key.serialize_der().into()),
    }
}

/// A local HTTPS partner that accepts every POST (201) and records its idempotency key.
struct TlsPartner {
    addr: SocketAddr,
    keys: Arc<Mutex<Vec<String>>>,
    stop: CancellationToken,
}

impl TlsPartner {
    async fn start(pki: &TestPki) -> TlsPartner {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![pki.server_cert.clone()], pki.server_key.clone_key())
            .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let keys = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (served, stopped) = (keys.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stopped.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let (acceptor, keys) = (acceptor.clone(), served.clone());
                tokio::spawn(async move {
                    // A client that refuses the certificate ends the handshake here.
                    let Ok(tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let service = service_fn(move |req: hyper::Request<_>| {
                        let key = req
                            .headers()
                            .get("idempotency-key")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        keys.lock().unwrap().push(key);
                        async {
                            Ok::<_, std::convert::Infallible>(
                                Response::builder()
                                    .status(StatusCode::CREATED)
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        TlsPartner { addr, keys, stop }
    }

    fn endpoint(&self) -> String {
        format!("https://{}/partners/acme/transmissions", self.addr)
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }
}

impl Drop for TlsPartner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn run_worker(args: &[&str]) -> (bool, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_exchange-worker"))
        .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
        .args(args)
        .env("RUST_LOG", "trace")
        .env_remove("EXCHANGE_PARTNERS")
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[tokio::test]
async fn the_worker_refuses_a_partner_url_that_can_never_work_naming_the_partner() {
    for (url, reason) in [
        ("127.0.0.1:9", "does not parse"),
        ("/transmissions", "does not parse"),
        ("partner:9/transmissions", "scheme"),
        ("ftp://partner/transmissions", "scheme"),
        ("http://[::1/transmissions", "does not parse"),
    ] {
        let (ok, out) = run_worker(&["--partner", &format!("acme={url}")]).await;
        assert!(!ok, "{url} was accepted");
        assert!(
            out.contains("partner \"acme\" refused") && out.contains(reason),
            "{url}: {out}"
        );
    }
}

#[tokio::test]
async fn the_worker_refuses_zero_and_absurd_durations_naming_the_flag() {
    for (flag, value) in [
        ("--send-timeout-secs", "0"),
        ("--send-timeout-secs", "86400"),
        ("--lease-secs", "0"),
        ("--lease-secs", "864000"),
        ("--lease-margin-secs", "0"),
        ("--retry-base-ms", "0"),
        ("--retry-base-ms", "86400000"),
        ("--poll-ms", "0"),
        ("--poll-ms", "3600000"),
    ] {
        let (ok, out) = run_worker(&["--partner", "acme=http://127.0.0.1:9/x", flag, value]).await;
        assert!(!ok, "{flag} {value} was accepted");
        assert!(out.contains(flag), "{flag} {value}: {out}");
        assert!(
            !out.contains("connecting to the database"),
            "{flag} {value} was found out only after start-up: {out}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_partner_is_sent_to_with_its_ca_and_refused_at_once_without_it() {
    capture_logs();
    let pki = test_pki();
    let server = TlsPartner::start(&pki).await;
    let dir = std::env::temp_dir().join(format!("partner-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).unwrap();

    // With the test's CA on top of the system's roots: sent, with the transmission's key.
    let store = MemExchange::new();
    let trusted = HttpPartner::configured("acme", &server.endpoint(), Some(&ca_file)).unwrap();
    let partners = Partners::new().with("acme", trusted);
    let id = store
        .create_transactions(&[("acme".into(), 7)])
        .await
        .unwrap()[0];
    let worker = start(&store, &partners, &quick(5));
    wait_status(&store, id, TransactionStatus::Success).await;
    worker.shutdown().await.unwrap();
    let key = store.transaction(id).await.unwrap().unwrap().correlation_id;
    assert_eq!(server.keys(), vec![key]);

    // Without it the certificate is refused: the job fails at its first attempt, nothing sent.
    let store = MemExchange::new();
    let untrusted = HttpPartner::new(&server.endpoint()).unwrap();
    let partners = Partners::new().with("acme", untrusted);
    let id = store
        .create_transactions(&[("acme".into(), 8)])
        .await
        .unwrap()[0];
    let worker = start(&store, &partners, &quick(5));
    wait_status(&store, id, TransactionStatus::Failed).await;
    worker.shutdown().await.unwrap();
    let (status, attempts, error) = latest_send_job(&store, id).await;
    assert_eq!((status, attempts), (JobStatus::Failed, 1), "{error}");
    assert!(error.starts_with("definitive: TLS refused"), "{error}");
    assert_eq!(server.keys().len(), 1, "no POST got through");
    let view = store.transaction(id).await.unwrap().unwrap();
    assert_eq!(view.send_failure, Some(FailureKind::Definitive));

    // A CA file that is not one is refused at start-up, with the partner's name.
    let refused = HttpPartner::configured("acme", &server.endpoint(), Some(&dir.join("missing")))
        .unwrap_err();
    assert_eq!(refused.name, "acme");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partner_credentials_reach_no_log_line_and_no_stored_error() {
    capture_logs();
    let pki = test_pki();
    let tls = TlsPartner::start(&pki).await;
    let plain = PartnerServer::start(HashMap::from([("down".to_owned(), Behavior::Always(503))]))
        .await
        .unwrap();
    // A port nobody listens on: connections are refused.
    let closed = TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let endpoints = [
        ("refused", with_credentials(&format!("http://{closed}/x"))),
        ("untrusted", with_credentials(&tls.endpoint())),
        ("down", with_credentials(&plain.endpoint("down"))),
    ];
    let store = MemExchange::new();
    let mut partners = Partners::new();
    for (name, endpoint) in &endpoints {
        let partner = HttpPartner::configured(name, endpoint, None)
            .unwrap()
            .with_timeout(Duration::from_secs(5));
        assert!(!format!("{partner:?}").contains("secret"));
        log_configured(name, &partner);
        partners = partners.with(*name, partner);
    }
    let requests: Vec<(String, i64)> = endpoints.iter().map(|(n, _)| (n.to_string(), 1)).collect();
    let ids = store.create_transactions(&requests).await.unwrap();
    let worker = start(&store, &partners, &quick(2));
    for id in &ids {
        wait_status(&store, *id, TransactionStatus::Failed).await;
    }
    worker.shutdown().await.unwrap();
    assert!(plain.posts() >= 1, "the 5xx path was taken");
    for id in &ids {
        let (_, _, error) = latest_send_job(&store, *id).await;
        assert!(!error.is_empty());
        assert!(!error.contains("secret"), "transaction {id}: {error}");
    }

    // Start-up: a refused URL and a configured one, in the worker's own output.
    let (ok, out) = run_worker(&["--partner", "acme=ftp://user:secret@partner/x"]).await;
    assert!(!ok && out.contains("partner \"acme\" refused"), "{out}");
    assert!(!out.contains("secret"), "{out}");
    // (A lease too short for the send timeout stops it right after the partners are logged.)
    let configured = format!("acme={}", endpoints[2].1);
    let (ok, out) = run_worker(&["--partner", &configured, "--lease-secs", "60"]).await;
    assert!(!ok && out.contains("exchange.partner_configured"), "{out}");
    assert!(!out.contains("secret"), "{out}");

    let logs = logs();
    // Every failure path was logged, each URL printed without its credentials.
    for seen in [
        "exchange.partner_configured",
        "TLS refused",
        "partner answered HTTP 503",
        &format!("connect: http://{closed}/x"),
    ] {
        assert!(logs.contains(seen), "{seen} is not in the logs: {logs}");
    }
    assert!(!logs.contains("secret"), "{logs}");
}

#[tokio::test]
async fn a_connection_lost_after_the_request_was_written_is_ambiguous_a_refused_one_definitive() {
    let payload = SendPayload {
        transaction_id: 1,
        correlation_id: "k-1".into(),
        partner: "acme".into(),
        amount_minor: 5,
    };
    let transmission = Transmission {
        job_id: 1,
        generation: 1,
        payload: &payload,
    };
    // A partner that reads the whole request, then hangs up without answering.
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hung_up = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        // The JSON body is the request's last byte.
        while !request.ends_with(b"}") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request was cut short");
            request.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(request).unwrap()
    });
    let partner = HttpPartner::new(&format!("http://user:secret@{addr}/x")).unwrap();
    let err = partner.send(transmission).await.unwrap_err();
    let request = hung_up.await.unwrap();
    assert!(request.contains("idempotency-key: k-1"), "{request}");
    assert!(matches!(err, SendError::Transport(_)), "{err:?}");
    assert_eq!(err.failure_kind(), FailureKind::Ambiguous);
    assert!(!err.to_string().contains("secret"), "{err}");

    // Nobody listens: nothing reached the partner.
    let closed = TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let partner = HttpPartner::new(&format!("http://user:secret@{closed}/x")).unwrap();
    let err = partner.send(transmission).await.unwrap_err();
    assert!(matches!(err, SendError::Connect(_)), "{err:?}");
    assert_eq!(err.failure_kind(), FailureKind::Definitive);
    assert!(!err.to_string().contains("secret"), "{err}");
}

/// An ambiguous failure keeps the key through `retry_failed_transaction`; a definitive one
/// repoints it.
async fn ambiguous_sends_keep_their_key<S: ExchangeStore>(store: &S) {
    capture_logs();
    // `acme` records each POST and holds its answer past the send timeout: the partner acted,
    // the sender cannot know. `picky` rejects (422): it did not act.
    let server = PartnerServer::start(HashMap::from([
        ("acme".to_owned(), Behavior::Held(201)),
        ("picky".to_owned(), Behavior::Always(422)),
    ]))
    .await
    .unwrap();
    let timeout = Duration::from_millis(300);
    let partner = |name: &str| {
        HttpPartner::new(&server.endpoint(name))
            .unwrap()
            .with_timeout(timeout)
    };
    let partners = Partners::new()
        .with("acme", partner("acme"))
        .with("picky", partner("picky"));
    let ids = store
        .create_transactions(&[("acme".into(), 10), ("picky".into(), 11)])
        .await
        .unwrap();
    let (held, rejected) = (ids[0], ids[1]);
    let first_keys: Vec<String> = {
        let mut keys = Vec::new();
        for id in &ids {
            keys.push(
                store
                    .transaction(*id)
                    .await
                    .unwrap()
                    .unwrap()
                    .correlation_id,
            );
        }
        keys
    };
    let worker = start(store, &partners, &quick(1));
    wait_status(store, held, TransactionStatus::Failed).await;
    wait_status(store, rejected, TransactionStatus::Failed).await;
    worker.shutdown().await.unwrap();

    let view = store.transaction(held).await.unwrap().unwrap();
    assert_eq!(view.send_failure, Some(FailureKind::Ambiguous));
    let (_, _, error) = latest_send_job(store, held).await;
    assert!(
        error.starts_with("ambiguous: partner did not answer"),
        "{error}"
    );
    let view = store.transaction(rejected).await.unwrap().unwrap();
    assert_eq!(view.send_failure, Some(FailureKind::Definitive));

    // Ambiguous: the retry sends under the same key.
    let RetryOutcome::Retried {
        correlation_id,
        key_kept,
        ..
    } = store.retry_failed_transaction(held).await.unwrap()
    else {
        panic!("retry refused");
    };
    assert!(key_kept);
    assert_eq!(correlation_id, first_keys[0]);
    // Definitive: a new key.
    let RetryOutcome::Retried {
        correlation_id: repointed,
        key_kept,
        ..
    } = store.retry_failed_transaction(rejected).await.unwrap()
    else {
        panic!("retry refused");
    };
    assert!(!key_kept);
    assert_ne!(repointed, first_keys[1]);

    // The held POST is answered (the partner had acted), and the retry reaches it under the
    // same key: the partner sees the key twice and can deduplicate.
    server.release();
    let worker = start(store, &partners, &quick(1));
    wait_status(store, held, TransactionStatus::Success).await;
    wait_status(store, rejected, TransactionStatus::Failed).await;
    worker.shutdown().await.unwrap();
    assert_eq!(server.keys()[&first_keys[0]].received, 2);
    assert_eq!(server.keys()[&repointed].received, 1);
    let events: Vec<_> = store
        .events(held)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.event_type, e.correlation_id))
        .collect();
    assert_eq!(
        events,
        vec![
            (EventType::Failed, first_keys[0].clone()),
            (EventType::Sent, first_keys[0].clone())
        ]
    );
    let summary = store.summary().await.unwrap();
    assert_eq!(
        (summary.conflicting_events, summary.duplicate_events),
        (0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_sends_keep_their_key_on_postgres() {
    let (db, store) = exchange_db().await;
    ambiguous_sends_keep_their_key(&store).await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_sends_keep_their_key_in_memory() {
    ambiguous_sends_keep_their_key(&MemExchange::new()).await;
}
