//! The webhook queue (the second, unrelated instance) against PostgreSQL and a local receiver.

use std::collections::HashMap;
use std::time::Duration;

use queue_core::{Backend, JobStatus, QueueName};
use queue_examples::exchange::partner_server::{Behavior, PartnerServer};
use queue_examples::webhook::{self, Webhook};
use queue_postgres::testing::ScratchDb;
use queue_postgres::{PgQueue, PgQueueConfig, TableName};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_are_delivered_once_per_event_and_a_gone_receiver_cancels() {
    let db = ScratchDb::new().await;
    let queue = PgQueue::connect(
        db.pool.clone(),
        PgQueueConfig::new(TableName::default(), QueueName::new("webhooks").unwrap()),
    )
    .await
    .unwrap();
    let receiver = PartnerServer::start(HashMap::from([
        (
            "shop".to_owned(),
            Behavior::Flaky {
                fail_rate: 0.0,
                latency: Duration::ZERO,
            },
        ),
        ("gone".to_owned(), Behavior::Always(410)),
    ]))
    .await
    .unwrap();
    let hook = |event: &str, to: &str| Webhook {
        event_id: event.to_owned(),
        url: receiver.endpoint(to),
        body: json!({ "event": event }),
    };
    let first = webhook::enqueue(&queue, &hook("order-1.paid", "shop"))
        .await
        .unwrap();
    let again = webhook::enqueue(&queue, &hook("order-1.paid", "shop"))
        .await
        .unwrap();
    assert!(
        again.duplicate && again.id == first.id,
        "one delivery per event"
    );
    let gone = webhook::enqueue(&queue, &hook("order-2.paid", "gone"))
        .await
        .unwrap();

    let worker = webhook::start_worker(queue.clone()).unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        worker.wait_for(|s| s.completed + s.cancelled == 2),
    )
    .await
    .expect("both deliveries should end");
    worker.shutdown().await.unwrap();
    assert_eq!(
        queue.get(first.id).await.unwrap().unwrap().status,
        JobStatus::Completed
    );
    assert_eq!(
        queue.get(gone.id).await.unwrap().unwrap().status,
        JobStatus::Cancelled
    );
    assert_eq!(receiver.keys()["order-1.paid"].accepted, 1);
    db.drop_db().await;
}
