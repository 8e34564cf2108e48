//! The backend conformance suite: the executable form of the [`Backend`] guarantees.
//!
//! Every backend runs the same cases from its own tests with one macro call, which expands to one
//! named `#[test]` per case so a failure names the broken guarantee:
//!
//! ```ignore
//! // tests/conformance.rs of a backend crate
//! queue_core::conformance_suite!(my_backend_tests::Harness);
//! ```
//!
//! A [`Harness`] gives each case a fresh, empty queue and a way to move the backend's clock
//! (leases expire by moving time, never by sleeping). Changing the queue's semantics means
//! extending this suite, not adding a backend-only test.
//!
//! The cases live by topic ([`lease`], [`fence`], [`enqueue`], [`hooks`], [`worker`],
//! [`admin`], [`scheduling`], [`unique`], [`limits`], [`partitions`]); each is
//! declared once, inside its topic's `cases!` block, which both defines it and registers it
//! with [`conformance_suite!`](crate::conformance_suite).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::backend::Backend;
use crate::types::{ClaimBatch, ClaimRequest, ClaimedJob, JobId, JobRecord, Lease, NewJob};

/// Defines a topic's cases (`pub async fn name<H: Harness>(h: Arc<H>) { … }`) and a hidden
/// exported macro, named by the first argument, that expands to one `#[test]` per case for a
/// harness. The leading `$` is passed in so that the generated macro can name its own
/// metavariable.
macro_rules! cases {
    ($d:tt $list:ident; $(
        $(#[$meta:meta])*
        pub async fn $name:ident<H: Harness>($h:ident: Arc<H>) $body:block
    )+) => {
        $(
            $(#[$meta])*
            pub async fn $name<H: Harness>($h: Arc<H>) $body
        )+

        #[doc(hidden)]
        #[macro_export]
        macro_rules! $list {
            ($d harness:ty) => {
                $(
                    #[test]
                    fn $name() {
                        $crate::conformance::run_case::<$d harness, _, _>(|h| {
                            $crate::conformance::$name(h)
                        });
                    }
                )+
            };
        }
    };
}

pub mod admin;
pub mod enqueue;
pub mod fence;
pub mod hooks;
pub mod lease;
pub mod limits;
pub mod partitions;
pub mod scheduling;
pub mod unique;
pub mod worker;

pub use admin::*;
pub use enqueue::*;
pub use fence::*;
pub use hooks::*;
pub use lease::*;
pub use limits::*;
pub use partitions::*;
pub use scheduling::*;
pub use unique::*;
pub use worker::*;

/// Expands to one `#[test]` per conformance case for the given [`Harness`] type.
#[macro_export]
macro_rules! conformance_suite {
    ($harness:ty) => {
        $crate::__conformance_lease!($harness);
        $crate::__conformance_fence!($harness);
        $crate::__conformance_enqueue!($harness);
        $crate::__conformance_hooks!($harness);
        $crate::__conformance_worker!($harness);
        $crate::__conformance_admin!($harness);
        $crate::__conformance_scheduling!($harness);
        $crate::__conformance_unique!($harness);
        $crate::__conformance_limits!($harness);
        $crate::__conformance_partitions!($harness);
    };
}

/// What a backend's test crate provides to run the suite.
pub trait Harness: Send + Sync + Sized + 'static {
    /// The backend under test, with its admin API.
    type Backend: crate::admin::Admin;

    /// A fresh, empty queue (a scratch database, a new store): cases never share state.
    fn setup() -> impl Future<Output = Self> + Send;

    /// The queue under test. Clones must share the store (several clones stand for several
    /// workers or connections).
    fn backend(&self) -> &Self::Backend;

    /// Moves the backend's clock forward by `by`: a lease claimed `by` earlier must now count as
    /// that much older, and a job due `by` from now must be due. (A SQL backend may move stored
    /// timestamps back instead.)
    fn advance_clock(&self, by: Duration) -> impl Future<Output = ()> + Send;

    /// Inserts a legacy row: `in_flight` with no `claimed_at`, generation 0, `attempts` 1, due
    /// an hour ago: what a pre-lease release leaves behind.
    fn insert_legacy_in_flight(&self, payload: Value) -> impl Future<Output = JobId> + Send;

    /// A handle on another queue of the same store (a memory store's `with_queue`, a table's
    /// other queue).
    fn other_queue(&self, queue: crate::types::QueueName) -> Self::Backend;

    /// Releases what `setup` created. Runs even when the case failed.
    fn teardown(&self) -> impl Future<Output = ()> + Send;
}

/// Runs one case on a fresh harness inside its own multi-threaded runtime, tears down, and then
/// re-raises the case's panic if it had one.
pub fn run_case<H, F, Fut>(case: F)
where
    H: Harness,
    F: FnOnce(Arc<H>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance case");
    runtime.block_on(async move {
        let harness = Arc::new(H::setup().await);
        let outcome = tokio::spawn(case(harness.clone())).await;
        harness.teardown().await;
        if let Err(err) = outcome {
            if err.is_panic() {
                std::panic::resume_unwind(err.into_panic());
            }
            panic!("conformance case did not finish: {err}");
        }
    });
}

fn lease() -> Lease {
    Lease::DEFAULT
}

fn req(batch: u32) -> ClaimRequest {
    ClaimRequest::new(batch, lease())
}

async fn claim<B: Backend>(backend: &B, batch: u32) -> ClaimBatch {
    backend.claim(req(batch)).await.expect("claim")
}

async fn enqueue<B: Backend>(backend: &B, n: i64) -> JobId {
    backend
        .enqueue(NewJob::from_value(json!({ "n": n })))
        .await
        .expect("enqueue")
        .id
}

async fn record<B: Backend>(backend: &B, id: JobId) -> JobRecord {
    backend
        .get(id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("job {id} is missing"))
}

/// Claims `id` once (fresh), expires the lease, claims it again: returns both claims' jobs.
async fn claim_then_take_over<H: Harness>(h: &H, id: JobId) -> (ClaimedJob, ClaimedJob) {
    let first = claim(h.backend(), 1).await.jobs.remove(0);
    assert_eq!(first.id, id);
    h.advance_clock(lease().duration() + Duration::from_secs(1))
        .await;
    let second = claim(h.backend(), 1).await.jobs.remove(0);
    assert_eq!(second.id, id, "the expired job must be the one re-claimed");
    (first, second)
}
