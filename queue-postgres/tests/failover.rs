//! A failover that loses committed writes, produced on purpose on clusters of the test's own: a
//! primary and its asynchronous standby, the standby cut off, a claim committed on the primary
//! alone, the primary crashed and the standby promoted. The new primary never saw the claim and
//! hands the job's generation out again; the old holder, reconnected through the multi-host
//! URL, must be fenced by the claim token where the generation alone would have let it write.

mod support;

use std::time::{Duration, Instant};

use queue_core::{Backend, ClaimRequest, Finalize, FinalizeOutcome, JobStatus, Lease, NewJob};
use queue_postgres::PgQueueConfig;
use queue_postgres::testing::{StopMode, TempCluster};
use serde_json::json;
use support::TestDriver;

per_driver!(a_claim_lost_in_a_failover_is_fenced_by_its_token);

const DATABASE: &str = "queue_failover";

fn req() -> ClaimRequest {
    ClaimRequest::new(1, Lease::from_secs(60).unwrap())
}

/// Retries `op` while it fails transiently (the pool is on its way to the new primary), for
/// at most 30 s.
async fn through_failover<T, F, Fut>(what: &str, mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, queue_core::Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match op().await {
            Ok(value) => return value,
            Err(err) if err.is_transient() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("{what}: {err}"),
        }
    }
}

async fn a_claim_lost_in_a_failover_is_fenced_by_its_token<D: TestDriver>() {
    let primary = TempCluster::start().expect("a primary of the test's own");
    primary
        .psql(&format!("CREATE DATABASE {DATABASE}"))
        .expect("the database");
    let admin = sqlx::PgPool::connect(&primary.url(DATABASE)).await.unwrap();
    queue_postgres::migrate(&admin).await.unwrap();
    admin.close().await;
    let standby = primary.standby().expect("an asynchronous standby");

    // Worker A connects as a service would: both hosts, the one that takes writes.
    let hosts = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{DATABASE}\
         ?target_session_attrs=read-write&connect_timeout=2",
        primary.port(),
        standby.port()
    );
    let config = PgQueueConfig {
        listen: false,
        ..PgQueueConfig::default()
    };
    let (pool_a, _guard_a) = D::primary_pool(&hosts, 2).await;
    let a = D::connect(&hosts, pool_a, config.clone()).await.unwrap();
    let id = a
        .enqueue(NewJob::from_value(json!({ "send": 1 })))
        .await
        .unwrap()
        .id;

    // The standby has the job, then hears nothing more from the primary.
    let replayed = primary.psql("SELECT pg_current_wal_lsn()").unwrap();
    wait_for(
        &standby,
        &format!("SELECT pg_last_wal_replay_lsn() >= '{replayed}'"),
    )
    .await;
    standby.detach().unwrap();
    wait_for(&standby, "SELECT count(*) = 0 FROM pg_stat_wal_receiver").await;

    // A's claim commits on the old primary only.
    let held = a.claim(req()).await.unwrap().jobs.remove(0);
    assert_eq!(held.id, id);
    primary.stop(StopMode::Immediate).unwrap();
    standby.promote().unwrap();

    // The new primary never saw A's claim: B gets the same generation.
    let b = D::connect(
        &standby.url(DATABASE),
        D::pool(&standby.url(DATABASE), 2),
        config,
    )
    .await
    .unwrap();
    let taken = b.claim(req()).await.unwrap().jobs.remove(0);
    assert_eq!(taken.id, id);
    assert_eq!(
        taken.generation, held.generation,
        "the lost write made the new primary reissue the generation"
    );
    assert_ne!(taken.token, held.token);

    // The generation alone would let A's outcome apply over B's claim.
    let verifier = sqlx::PgPool::connect(&standby.url(DATABASE)).await.unwrap();
    let matches_by_generation: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM queue_jobs WHERE id = $1 AND status = 'in_flight' \
         AND claim_generation = $2",
    )
    .bind(id.0)
    .bind(held.generation.0)
    .fetch_one(&verifier)
    .await
    .unwrap();
    assert_eq!(matches_by_generation, 1);

    // A, back on the new primary through its multi-host pool, is fenced by the token.
    let fail = Finalize::Fail {
        error: "A's partner said no".into(),
    };
    let outcome = through_failover("A's outcome", || a.finalize(held.claim(), &fail)).await;
    assert_eq!(outcome, FinalizeOutcome::Stale);
    let beat = through_failover("A's heartbeat", || {
        a.extend_lease(held.claim(), Lease::from_secs(60).unwrap())
    })
    .await;
    assert_eq!(beat, queue_core::Heartbeat::Lost);

    // B, the true holder, ends the job once.
    assert_eq!(
        b.finalize(taken.claim(), &Finalize::Complete)
            .await
            .unwrap(),
        FinalizeOutcome::Applied
    );
    let record = b.get(id).await.unwrap().unwrap();
    assert_eq!(record.status, JobStatus::Completed);
    assert_eq!(record.last_error, None, "A's failure never landed");
    assert_eq!(record.claim_token, taken.token);
    verifier.close().await;
}

/// Waits (bounded) until `sql` answers `t` on `cluster`.
async fn wait_for(cluster: &TempCluster, sql: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if cluster.psql(sql).unwrap() == "t" {
            return;
        }
        assert!(Instant::now() < deadline, "{sql} never held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
