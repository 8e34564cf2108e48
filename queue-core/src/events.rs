//! The structured `tracing` events the framework emits, each under a stable name.
//!
//! Names are part of the public contract (dashboards and alerts key on them); payloads are never
//! logged. See `docs/operations.md` for what each means and which to alert on.

use crate::types::{Claim, Finalize, JobId, QueueName};

/// A lease holder's write was refused by the generation fence (warn).
pub const STALE_FINALIZE_FENCED: &str = "queue.stale_finalize_fenced";
/// A heartbeat found the lease already lost; the handler's cancellation token fired (warn).
pub const LEASE_LOST: &str = "queue.lease_lost";
/// A job was buried (`dead`): its lease expired past the reclaim cap (error).
pub const JOB_DEAD: &str = "queue.job_dead";
/// A claim took a job over from an expired lease (info).
pub const JOB_RECLAIMED: &str = "queue.job_reclaimed";
/// A handler failed and the job was scheduled again (info).
pub const JOB_RETRY_SCHEDULED: &str = "queue.job_retry_scheduled";
/// A job failed terminally (warn).
pub const JOB_FAILED: &str = "queue.job_failed";
/// A payload did not deserialise into the handler's type; the job failed terminally, its payload
/// kept in the row (error).
pub const PAYLOAD_MALFORMED: &str = "queue.payload_malformed";
/// A finalize (or its hooks) failed and will be tried again (warn).
pub const FINALIZE_RETRY: &str = "queue.finalize_retry";
/// A finalize failed for good; the job stays in flight until its lease lapses (error).
pub const FINALIZE_FAILED: &str = "queue.finalize_failed";
/// A claim failed; the worker polls again later (warn).
pub const CLAIM_FAILED: &str = "queue.claim_failed";
/// A claimed job was released unstarted: at shutdown, or because too little lease was left (info).
pub const CLAIM_RELEASED: &str = "queue.claim_released";
/// A handler panicked; treated as a retryable handler error (error).
pub const HANDLER_PANICKED: &str = "queue.handler_panicked";
/// A handler ran past the job timeout; treated as a retryable handler error (warn).
pub const HANDLER_TIMED_OUT: &str = "queue.handler_timed_out";
/// A heartbeat (`extend_lease`) failed; it is tried again at the next tick (warn).
pub const HEARTBEAT_FAILED: &str = "queue.heartbeat_failed";
/// A `LISTEN` connection (PostgreSQL) is up and listening (info).
pub const LISTENER_CONNECTED: &str = "queue.listener_connected";
/// A `LISTEN` connection was lost; workers poll until it is back (warn).
pub const LISTENER_LOST: &str = "queue.listener_lost";
/// Graceful shutdown finished (info).
pub const WORKER_STOPPED: &str = "queue.worker_stopped";

pub(crate) fn stale_finalize_fenced(queue: &QueueName, claim: Claim, action: &Finalize) {
    tracing::warn!(
        name: "queue.stale_finalize_fenced",
        queue = %queue,
        job_id = claim.id.0,
        generation = claim.generation.0,
        action = action.kind(),
        "queue.stale_finalize_fenced: the job is no longer held under this generation; nothing written"
    );
}

pub(crate) fn job_dead(queue: &QueueName, id: JobId) {
    tracing::error!(
        name: "queue.job_dead",
        queue = %queue,
        job_id = id.0,
        "queue.job_dead: lease expired past the reclaim cap; the job was buried as dead"
    );
}

#[cfg(test)]
pub(crate) mod capture {
    //! A subscriber that records event names, for tests that assert an event fired.

    use std::sync::{Arc, Mutex};

    use tracing::Subscriber;
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::{Context, SubscriberExt};

    #[derive(Clone, Default)]
    pub struct Captured(Arc<Mutex<Vec<String>>>);

    impl Captured {
        pub fn names(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }

        pub fn count(&self, name: &str) -> usize {
            self.names().iter().filter(|n| *n == name).count()
        }

        pub fn subscriber(&self) -> impl Subscriber + Send + Sync + 'static {
            tracing_subscriber::registry().with(self.clone())
        }
    }

    impl<S: Subscriber> Layer<S> for Captured {
        fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
            self.0
                .lock()
                .unwrap()
                .push(event.metadata().name().to_owned());
        }
    }
}
