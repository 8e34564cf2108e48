//! The conformance suite against the in-memory backend.

use std::time::Duration;

use queue_core::conformance::Harness;
use queue_core::{Backend, JobId, MemoryBackend, NewJob};
use serde_json::Value;

struct Memory(MemoryBackend);

impl Harness for Memory {
    type Backend = MemoryBackend;

    async fn setup() -> Self {
        Memory(MemoryBackend::new())
    }

    fn backend(&self) -> &MemoryBackend {
        &self.0
    }

    async fn advance_clock(&self, by: Duration) {
        self.0.advance_clock(by);
    }

    async fn insert_legacy_in_flight(&self, payload: Value) -> JobId {
        self.0.import_legacy_in_flight(payload).await
    }

    fn other_queue(&self, queue: queue_core::QueueName) -> MemoryBackend {
        self.0.with_queue(queue)
    }

    async fn teardown(&self) {}
}

queue_core::conformance_suite!(Memory);

#[tokio::test]
async fn queues_in_one_store_are_isolated() {
    let store = MemoryBackend::new();
    let other = store.with_queue(queue_core::QueueName::new("other").unwrap());
    store
        .enqueue(NewJob::from_value(Value::Null))
        .await
        .unwrap();
    assert_eq!(other.counts().await.unwrap().total(), 0);
    let batch = other
        .claim(queue_core::ClaimRequest::new(
            10,
            queue_core::Lease::DEFAULT,
        ))
        .await
        .unwrap();
    assert!(batch.jobs.is_empty());
}
