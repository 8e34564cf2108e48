//! Secrets planted in a payload and in a database URL never reach a log line, an error or a
//! stored `last_error`, whichever failure path they take. The only test of its binary: it
//! captures every log line of the process, at every level.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use queue_core::{Backend, Handler, JobContext, JobError, JobStatus, NewJob, Worker, WorkerConfig};
use queue_postgres::testing::ScratchDb;
use queue_postgres::{PgQueue, PgQueueConfig, redact_url};
use serde_json::json;

const CARD: &str = "4111 1111 1111 1111";
const PASSWORD: &str = "hunter2-db-password";

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct Charge {
    amount: i64,
    card: String,
}

struct Charger;

impl Handler for Charger {
    type Payload = Charge;
    async fn handle(&self, _ctx: JobContext, _charge: Charge) -> Result<(), JobError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_log_line_an_error_or_a_stored_error() {
    let lines = Lines::default();
    let writer = lines.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let mut said = Vec::<String>::new();

    let db = ScratchDb::new().await;
    let queue = PgQueue::connect(db.pool.clone(), PgQueueConfig::default())
        .await
        .unwrap();

    // A payload whose secret sits in a mistyped field: the job fails, naming the field.
    let id = queue
        .enqueue(NewJob::from_value(json!({ "amount": CARD, "card": CARD })))
        .await
        .unwrap()
        .id;
    let worker = Worker::new(queue.clone(), Charger, WorkerConfig::default())
        .unwrap()
        .start();
    worker
        .wait_for_timeout(Duration::from_secs(20), |s| s.failed == 1)
        .await
        .expect("the malformed job fails");
    worker.shutdown().await.unwrap();
    let job = queue.get(id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Failed);
    let last_error = job.last_error.unwrap();
    assert!(last_error.contains("at amount"), "{last_error}");
    said.push(last_error);

    // Payloads refused at enqueue: a NUL beside the secret, a payload over the limit.
    for refused in [
        NewJob::from_value(json!({ "card": format!("{CARD}\u{0}") })),
        NewJob::from_value(json!({ "card": CARD, "pad": "x".repeat(2 << 20) })),
        NewJob::from_value(json!({})).unique_key(CARD.repeat(100)),
    ] {
        let err = queue.enqueue(refused).await.unwrap_err();
        said.push(format!("{err} {err:?}"));
    }

    // A database URL with a password that cannot connect, and the URL as printed.
    let url = format!("postgres://queue:{PASSWORD}@127.0.0.1:1/app?password={PASSWORD}");
    let err = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap_err();
    said.push(format!("{err} {err:?}"));
    said.push(redact_url(&url).into_owned());
    let pool_err = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&url)
        .unwrap();
    let queue_err = PgQueue::connect(pool_err, PgQueueConfig::default())
        .await
        .unwrap_err();
    said.push(format!("{queue_err} {queue_err:?}"));
    db.drop_db().await;

    let logged = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains("queue.payload_malformed") && logged.contains("at amount"),
        "the capture missed the worker's events:\n{logged}"
    );
    for text in said.iter().chain([&logged]) {
        assert!(!text.contains("4111"), "a card number leaked: {text}");
        assert!(
            !text.contains(PASSWORD),
            "a database password leaked: {text}"
        );
    }
}
