//! Behaviour specific to PostgreSQL: real connections racing, a connection killed mid-finalize,
//! the schema check, the claim's plans, NOTIFY wake-ups, retention. Tests that
//! go through a driver run once per driver (`per_driver!`).

mod support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use queue_core::{
    Backend, BackendTx, Claim, ClaimGeneration, ClaimRequest, Finalize, FinalizeOutcome, Handler,
    Heartbeat, InvalidInput, JobContext, JobError, JobId, JobStatus, Lease, NewJob, QueueName,
    QueueStats, Worker, WorkerConfig,
};
use queue_postgres::{PgError, PgQueueConfig, PostgresQueue, TableName};
use serde_json::{Value, json};
use sqlx::Row;
use sqlx::postgres::PgPoolOptions;
use support::{TestDb, TestDriver};

per_driver!(
    two_connections_racing_claims_take_each_job_once,
    eight_connections_racing_claims_take_each_job_once,
    a_connection_killed_during_finalize_loses_nothing,
    schema_check_names_a_missing_table,
    schema_check_names_what_a_table_without_an_id_lacks,
    a_table_from_before_the_claim_token_is_told_which_migration_to_commit,
    notify_wakes_an_idle_worker_and_a_lost_listener_re_listens,
    notify_is_sent_on_commit_only,
    concurrent_enqueues_of_one_unique_key_insert_once,
    a_custom_table_works_and_keeps_its_queues_apart,
    retention_sweeps_old_terminal_rows_in_batches_and_nothing_else,
    a_stale_finalize_in_the_callers_transaction_writes_nothing,
    connecting_to_a_stopped_server_is_a_transient_error,
    a_worker_without_listen_finds_work_by_polling,
    a_refused_outcome_costs_only_its_own_job,
    a_refused_outcome_carried_with_a_claim_costs_only_its_own_job,
    workers_carrying_outcomes_with_claims_run_each_job_once,
    a_claim_from_before_stored_leases_keeps_its_claimers_lease,
    a_takeover_by_a_binary_from_before_stored_leases_is_not_taken_over_at_once,
    an_enqueue_that_fails_inserts_nothing,
    a_bulk_enqueue_by_copy_is_all_or_nothing_and_wakes_idle_workers,
    a_database_error_names_the_servers_message_but_no_row_values,
    the_payload_limit_is_the_queues_own,
    a_retry_that_lost_a_race_reports_the_state_the_job_is_in_now,
    a_hand_edited_error_history_does_not_stop_the_job,
    drain_waits_for_a_claim_that_started_before_the_pause,
    a_row_another_transaction_holds_holds_up_no_other_renewal,
    a_transaction_dropped_during_its_begin_leaves_none_open_in_the_pool,
    a_finalize_whose_commit_reply_was_lost_is_reported_applied,
    a_bulk_enqueue_dropped_at_its_end_leaves_the_connection_in_step,
    limits_per_partition_set_since_a_handle_looked_hold_for_its_next_claim,
    a_table_without_the_lease_index_serves_every_statement,
    a_handles_claim_ahead_over_the_limit_claims_again_under_the_lock,
);

/// Heartbeats of many claims in one statement: a job whose row another transaction holds (a
/// finalize with hooks, an operator's cancel) is left unanswered at once instead of waited for,
/// and the others are renewed; asked alone, it waits for the lock and is answered.
async fn a_row_another_transaction_holds_holds_up_no_other_renewal<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    for n in 0..3 {
        queue
            .enqueue(NewJob::from_value(json!({ "n": n })))
            .await
            .unwrap();
    }
    let jobs = queue.claim(req(3)).await.unwrap().jobs;
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM queue_jobs WHERE id = $1 FOR UPDATE")
        .bind(jobs[1].id.0)
        .execute(&mut *holder)
        .await
        .unwrap();
    let claims: Vec<Claim> = jobs.iter().map(|j| j.claim()).collect();
    let stamps = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT claimed_at FROM queue_jobs ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let before = stamps().await;
    // Bounded, so that a statement that waited for the lock fails the test instead of hanging.
    let answers = tokio::time::timeout(
        Duration::from_secs(30),
        queue.extend_leases(&claims, Lease::DEFAULT),
    )
    .await
    .expect("the renewals do not wait for the locked row")
    .unwrap();
    assert_eq!(
        answers,
        [Some(Heartbeat::Held), None, Some(Heartbeat::Held)]
    );
    let renewed: Vec<bool> = before
        .iter()
        .zip(stamps().await)
        .map(|(was, now)| now > *was)
        .collect();
    assert_eq!(
        renewed,
        [true, false, true],
        "the two free rows were renewed"
    );
    let alone = tokio::spawn({
        let queue = queue.clone();
        let claim = jobs[1].claim();
        async move { queue.extend_lease(claim, Lease::DEFAULT).await }
    });
    support::wait_for_a_lock_wait(&db, "the renewal asked alone waits for the lock").await;
    holder.commit().await.unwrap();
    assert_eq!(alone.await.unwrap().unwrap(), Heartbeat::Held);
    db.drop_db().await;
}

/// A caller that drops a transaction while its `BEGIN` is on the wire (a renewal nobody waits
/// for any more, a timeout) leaves no transaction open on the pooled connection: the next
/// borrower's statements would otherwise run inside it and never commit.
async fn a_transaction_dropped_during_its_begin_leaves_none_open_in_the_pool<D: TestDriver>() {
    let db = TestDb::new().await;
    // Through a proxy that holds the BEGIN's reply: the server runs the BEGIN while its caller
    // still waits, every time (racing the reply from here lost on a loaded machine).
    let proxy = support::proxy::Proxy::start().await;
    let url = proxy.url(&db);
    let queue = D::connect(&url, D::pool(&url, 1), PgQueueConfig::default())
        .await
        .unwrap();
    // The pool's one connection, open before the hold.
    queue.begin().await.unwrap().rollback().await.unwrap();
    proxy.hold_replies_after(b"BEGIN");
    tokio::select! {
        _ = queue.begin() => panic!("the BEGIN was answered while its reply was held"),
        () = support::wait_for_activity(
            &db,
            "state = 'idle in transaction'",
            "the BEGIN never ran on the server",
        ) => {}
    }
    // The begin is dropped with its BEGIN run and the reply on the wire; the reply goes now.
    proxy.release();
    sqlx::raw_sql("CREATE TABLE marker AS SELECT clock_timestamp() AS at")
        .execute(&db.pool)
        .await
        .unwrap();
    // The pool's one connection again: its transaction must be new, not the dropped one.
    let mut tx = queue.begin().await.unwrap();
    let rows = tx
        .query("SELECT now() > (SELECT at FROM marker) AS fresh", ())
        .await
        .unwrap();
    let fresh: bool = rows[0].get("fresh").unwrap();
    tx.rollback().await.unwrap();
    assert!(
        fresh,
        "the next borrower ran inside the dropped transaction"
    );
    db.drop_db().await;
}

/// Stages a row of `effects` for each job whose outcome applied, in the finalize's transaction.
struct Effect;

impl<D: queue_postgres::Driver> queue_core::FinalizeHook<queue_postgres::PostgresTx<D>, Value>
    for Effect
{
    async fn after_applied(
        &self,
        tx: &mut queue_postgres::PostgresTx<D>,
        event: &queue_core::FinalizeEvent<'_, Value>,
    ) -> Result<(), queue_core::BoxError> {
        tx.execute(
            "INSERT INTO effects (job_id) VALUES ($1)",
            (event.job.id.0,),
        )
        .await?;
        Ok(())
    }
}

/// A finalize whose `COMMIT` reached the server and committed, but whose reply the network
/// lost (every connection cut while the reply was held on the wire): the worker's write fails
/// with a transient error, and tried again it finds the job finalized under its own claim, so
/// it reports the outcome applied, never stale or unknown, and the side effect its hook staged
/// in the same transaction is there once.
async fn a_finalize_whose_commit_reply_was_lost_is_reported_applied<D: TestDriver>() {
    let db = TestDb::new().await;
    sqlx::raw_sql("CREATE TABLE effects (job_id bigint NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let proxy = support::proxy::Proxy::start().await;
    let url = proxy.url(&db);
    let config = PgQueueConfig {
        listen: false,
        ..PgQueueConfig::default()
    };
    let queue = D::connect(&url, D::pool(&url, 2), config).await.unwrap();
    let id = queue
        .enqueue(NewJob::from_value(json!({ "n": 1 })))
        .await
        .unwrap()
        .id;
    // Claims and heartbeats are statements of their own: the first COMMIT is the finalize's.
    proxy.hold_replies_after(b"COMMIT");
    let worker = Worker::new(queue.clone(), Done, WorkerConfig::default())
        .unwrap()
        .hooks(queue_core::Hooks::new().with(Effect))
        .start();
    let completed = format!("status = 'completed' AND id = {}", id.0);
    wait_for_row(&db, &completed, "the finalize committed on the server").await;
    assert_eq!(
        worker.stats().finished(),
        0,
        "the worker has not heard back: its reply is held"
    );
    proxy.cut();
    let stats = worker
        .wait_for_timeout(Duration::from_secs(60), |s| s.finished() == 1)
        .await
        .expect("the outcome is reported once the write is tried again");
    worker.shutdown().await.unwrap();
    assert_eq!((stats.completed, stats.stale, stats.unknown), (1, 0, 0));
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(effects, 1, "the hook's effect committed once");
    db.drop_db().await;
}

/// Returns once a row of the default table meets `condition`; fails after 30 s, saying `what`.
async fn wait_for_row(db: &TestDb, condition: &str, what: &str) {
    let sql = format!("SELECT count(*) FROM queue_jobs WHERE {condition}");
    support::wait_for_count(db, &sql, Duration::from_secs(30), what).await;
}

/// A bulk enqueue by `COPY` dropped by its caller after the data went out (a timeout around a
/// large `enqueue_many`) ends on its own, and the pool's connection answers the next
/// statements with their own rows.
async fn a_bulk_enqueue_dropped_at_its_end_leaves_the_connection_in_step<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_single::<D>(&db, PgQueueConfig::default()).await;
    // The statements the connection will run after the drop, prepared on it before.
    queue
        .enqueue(NewJob::from_value(json!({"warm": true})))
        .await
        .unwrap();
    let warm = queue.claim(req(1)).await.unwrap().jobs;
    assert_eq!(warm.len(), 1);
    // The COPY's end waits for a lock the test holds: a statement trigger fires after the
    // last row, so the client is then waiting for the COPY's answer.
    sqlx::raw_sql(
        "CREATE FUNCTION hold() RETURNS trigger LANGUAGE plpgsql AS
             $$BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END$$;
         CREATE TRIGGER hold AFTER INSERT ON queue_jobs
             FOR EACH STATEMENT EXECUTE FUNCTION hold();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let jobs: Vec<NewJob> = (0..10_000)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    {
        let mut enqueue = std::pin::pin!(queue.enqueue_many(jobs));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let polled =
                std::future::poll_fn(|cx| std::task::Poll::Ready(enqueue.as_mut().poll(cx))).await;
            assert!(polled.is_pending(), "the COPY ended past the held lock");
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND query LIKE '%FROM STDIN%'
                   AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            if waiting > 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the COPY never reached its end"
            );
            tokio::task::yield_now().await;
        }
    }
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *holder)
        .await
        .unwrap();
    // The next statements on the pool's one connection get their own answers.
    let id = queue
        .enqueue(NewJob::from_value(json!({"after": true})))
        .await
        .unwrap()
        .id;
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_jobs WHERE id = $1")
        .bind(id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, 1, "the enqueue's id is its row's");
    let claimed = queue.claim(req(1)).await.unwrap().jobs;
    assert_eq!(claimed.len(), 1, "a claim with due jobs takes one");
    let status: String = sqlx::query_scalar("SELECT status::text FROM queue_jobs WHERE id = $1")
        .bind(claimed[0].id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "in_flight");
    let copied: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_jobs WHERE payload ? 'n'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(copied, 10_000, "the dropped enqueue ran to its end");
    db.drop_db().await;
}

/// A handle that last saw its queue with a queue limit only claims with the lean form of the
/// limited claim (no partition tables); limits per partition that another handle set since
/// still hold for its very next claim: the lean form refuses the queue, and the full form
/// claims by them. Both kinds of limit per partition: a partition limit and a rate.
async fn limits_per_partition_set_since_a_handle_looked_hold_for_its_next_claim<D: TestDriver>() {
    use queue_core::{Admin, QueueLimits, RateLimit};
    let queue_limit = QueueLimits {
        max_in_flight: Some(100),
        ..QueueLimits::NONE
    };
    let per_partition = QueueLimits {
        max_per_partition: Some(2),
        ..queue_limit
    };
    let rate = QueueLimits {
        rate_per_partition: Some(RateLimit::new(2, Duration::from_secs(600)).unwrap()),
        ..queue_limit
    };
    // The first claim took one job before the limit per partition was set; the second may
    // take one more under the partition limit (two in flight), two under the rate (it counts
    // the starts from when it was set).
    for (limits, in_flight_after) in [(per_partition, 2), (rate, 3)] {
        let mut tested = false;
        for _ in 0..5 {
            let db = TestDb::new().await;
            // Grants off: a's claims are the lean and full forms under the lock.
            let a = support::connect_claiming_ahead::<D>(&db).await;
            let b = support::connect_claiming_ahead::<D>(&db).await;
            let partner = (0..4)
                .map(|n| NewJob::from_value(json!({ "n": n })).partition_key("partner"))
                .collect();
            a.enqueue_many(partner).await.unwrap();
            a.set_limits(queue_limit).await.unwrap();
            // a trusts the limits it read for a second (LIMITS_RECHECK): its claims within it
            // start with the lean form.
            let looked = std::time::Instant::now();
            assert_eq!(a.claim(req(1)).await.unwrap().jobs.len(), 1);
            b.set_limits(limits).await.unwrap();
            let claimed = a.claim(req(4)).await.unwrap().jobs;
            let in_flight: i64 =
                sqlx::query_scalar("SELECT count(*) FROM queue_jobs WHERE status = 'in_flight'")
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            assert_eq!(
                in_flight,
                in_flight_after,
                "{limits:?}: {} claimed",
                claimed.len()
            );
            db.drop_db().await;
            if looked.elapsed() < Duration::from_millis(900) {
                tested = true;
                break;
            }
            // Too slow a machine: a read the limits again before claiming; try once more.
        }
        assert!(
            tested,
            "never claimed within a second of reading the limits"
        );
    }
}

/// Ends the next claimable job with `action`.
async fn end_next<D: TestDriver>(queue: &PostgresQueue<D>, action: Finalize) -> JobId {
    let job = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    assert_eq!(
        queue.finalize(job.claim(), &action).await.unwrap(),
        FinalizeOutcome::Applied
    );
    job.id
}

/// Two operators retry one dead job at once: one reopens it, the other is told it is pending
/// now (the statement's own snapshot would still say dead).
async fn a_retry_that_lost_a_race_reports_the_state_the_job_is_in_now<D: TestDriver>() {
    use queue_core::{Admin, RetryTarget};
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    queue.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    let id = end_next(
        &queue,
        Finalize::Dead {
            reason: "poison".into(),
        },
    )
    .await;
    let mut first = queue.begin().await.unwrap();
    let won = queue
        .retry_in(&mut first, id, JobStatus::Dead)
        .await
        .unwrap();
    assert!(matches!(won, RetryTarget::Retried(_)));
    let second = {
        let queue = queue.clone();
        tokio::spawn(async move {
            let mut tx = queue.begin().await.unwrap();
            let target = queue.retry_in(&mut tx, id, JobStatus::Dead).await.unwrap();
            tx.commit().await.unwrap();
            target
        })
    };
    // The second retry waits for the first one's row lock.
    support::wait_for_a_lock_wait(&db, "the second retry never waited").await;
    first.commit().await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        RetryTarget::WrongState(JobStatus::Pending)
    );
    db.drop_db().await;
}

/// An error history edited by hand into something that is not a list, or into more than ten
/// entries: the job still fails, retries and reads, and its history is bounded again.
async fn a_hand_edited_error_history_does_not_stop_the_job<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let ids = queue
        .enqueue_many((0..2).map(|n| NewJob::new(&n).unwrap()).collect())
        .await
        .unwrap();
    let (odd, long) = (ids[0].id, ids[1].id);
    sqlx::query("UPDATE queue_jobs SET errors = '{\"a\": 1}' WHERE id = $1")
        .bind(odd.0)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE queue_jobs SET errors = (SELECT jsonb_agg(jsonb_build_object('error', g))
                                         FROM generate_series(1, 15) g) WHERE id = $1",
    )
    .bind(long.0)
    .execute(&db.pool)
    .await
    .unwrap();
    assert!(queue.get(odd).await.unwrap().unwrap().errors.is_empty());
    let jobs = queue.claim(req(2)).await.unwrap().jobs;
    let retry = |error: &str| Finalize::Retry {
        at: queue_core::RunAt::Now,
        error: error.into(),
    };
    let items: Vec<(Claim, Finalize)> = jobs.iter().map(|j| (j.claim(), retry("again"))).collect();
    let outcomes = queue.finalize_many(&items).await.unwrap();
    assert_eq!(
        outcomes,
        [FinalizeOutcome::Applied, FinalizeOutcome::Applied]
    );
    let odd_errors = queue.get(odd).await.unwrap().unwrap().errors;
    assert_eq!(
        odd_errors.len(),
        1,
        "a history that was not a list starts again"
    );
    assert_eq!(odd_errors[0].error, "again");
    let stored: Value = sqlx::query_scalar("SELECT errors FROM queue_jobs WHERE id = $1")
        .bind(long.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        stored.as_array().unwrap().len(),
        10,
        "bounded again: {stored}"
    );
    db.drop_db().await;
}

/// A claim that started before a pause committed may still take jobs: a drain waits for it, and
/// reports the job it took as running instead of calling the queue drained.
async fn drain_waits_for_a_claim_that_started_before_the_pause<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    queue.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    // Claims of this database take half a second: long enough to pause in the middle of one.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$;
         CREATE TRIGGER slow_claim AFTER UPDATE ON queue_jobs
             FOR EACH STATEMENT EXECUTE FUNCTION slow_claim();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let claiming = {
        let queue = queue.clone();
        tokio::spawn(async move { queue.claim(req(1)).await.unwrap() })
    };
    // Wait until the claim sleeps in its trigger, after its update: a statement shows as active
    // from its parse on, before it takes its snapshot, and a claim whose snapshot sees the pause
    // rightly takes nothing.
    support::wait_for_activity(
        &db,
        "state = 'active' AND query LIKE '-- The claim%' AND wait_event = 'PgSleep'",
        "the claim never ran",
    )
    .await;
    let report = queue_core::drain(&queue, Duration::ZERO, Duration::from_millis(10))
        .await
        .unwrap();
    assert_eq!(
        claiming.await.unwrap().jobs.len(),
        1,
        "the claim took its job"
    );
    assert_eq!(
        (report.running, report.drained),
        (1, false),
        "the drain saw the claim's job"
    );
    db.drop_db().await;
}

/// The server process of a transaction's connection.
async fn backend_pid<D: TestDriver>(tx: &mut queue_postgres::PostgresTx<D>) -> i32 {
    let rows = tx
        .query("SELECT pg_backend_pid() AS pid", ())
        .await
        .unwrap();
    rows[0].get("pid").unwrap()
}

/// In the queue's transaction: the fenced writes, then a domain write
/// (`INSERT INTO outbox VALUES (job_id)`), then commit.
async fn finalize_with_domain_write<D: TestDriver>(
    queue: &PostgresQueue<D>,
    items: &[(Claim, Finalize)],
    job_id: i64,
) -> Vec<FinalizeOutcome> {
    let mut tx = queue.begin().await.unwrap();
    let outcomes = queue.finalize_with(tx.conn(), items).await.unwrap();
    tx.execute("INSERT INTO outbox VALUES ($1)", (job_id,))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    outcomes
}

fn req(batch: u32) -> ClaimRequest {
    ClaimRequest::new(batch, Lease::DEFAULT)
}

/// `tasks` claimers, each on its own single-connection pool, drain `jobs` jobs.
async fn race_on_separate_connections<D: TestDriver>(tasks: usize, jobs: usize, batch: u32) {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let ids: HashSet<JobId> = queue
        .enqueue_many(
            (0..jobs)
                .map(|n| NewJob::from_value(json!({ "n": n })))
                .collect(),
        )
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let config = PgQueueConfig {
            listen: false,
            ..PgQueueConfig::default()
        };
        let worker = support::connect_single::<D>(&db, config).await;
        set.spawn(async move {
            let mut taken = Vec::new();
            loop {
                let batch_jobs = worker.claim(req(batch)).await.unwrap().jobs;
                assert!(
                    batch_jobs.len() <= batch as usize,
                    "claim exceeded its batch"
                );
                if batch_jobs.is_empty() {
                    break;
                }
                let done: Vec<(Claim, Finalize)> = batch_jobs
                    .iter()
                    .map(|j| (j.claim(), Finalize::Complete))
                    .collect();
                let outcomes = worker.finalize_many(&done).await.unwrap();
                assert!(outcomes.iter().all(|o| o.is_applied()));
                taken.extend(batch_jobs.iter().map(|j| (j.id, j.generation)));
            }
            taken
        });
    }
    let mut seen: HashMap<JobId, u32> = HashMap::new();
    while let Some(taken) = set.join_next().await {
        for (id, generation) in taken.unwrap() {
            assert_eq!(generation, ClaimGeneration(1));
            *seen.entry(id).or_default() += 1;
        }
    }
    assert!(seen.values().all(|n| *n == 1), "a job was claimed twice");
    assert_eq!(
        seen.keys().copied().collect::<HashSet<_>>(),
        ids,
        "a job was lost"
    );
    assert_eq!(queue.counts().await.unwrap().completed, jobs as u64);
    db.drop_db().await;
}

async fn two_connections_racing_claims_take_each_job_once<D: TestDriver>() {
    race_on_separate_connections::<D>(2, 600, 10).await;
}

async fn eight_connections_racing_claims_take_each_job_once<D: TestDriver>() {
    race_on_separate_connections::<D>(8, 1200, 7).await;
}

async fn a_connection_killed_during_finalize_loses_nothing<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let id = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    let job = queue.claim(req(1)).await.unwrap().jobs.remove(0);

    let mut tx = queue.begin().await.unwrap();
    let pid = backend_pid(&mut tx).await;
    let outcome = queue
        .finalize_in(&mut tx, job.claim(), &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(
        outcome,
        FinalizeOutcome::Applied,
        "applied inside the open transaction"
    );
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(killed);
    let err = tx
        .commit()
        .await
        .expect_err("the commit cannot succeed on a killed connection");
    assert!(
        err.is_transient(),
        "a lost connection must be transient: {err}"
    );

    let row = queue.get(id).await.unwrap().unwrap();
    assert_eq!(
        row.status,
        JobStatus::InFlight,
        "the uncommitted complete must be gone"
    );
    assert_eq!(row.claim_generation, job.generation);
    // Nothing is lost: after the lease the job is claimed again, one generation on.
    support::shift_time(
        &db.pool,
        "queue_jobs",
        Lease::DEFAULT.duration() + Duration::from_secs(1),
    )
    .await;
    let again = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    assert_eq!(again.id, id);
    assert_eq!(again.generation.0, job.generation.0 + 1);
    assert_eq!(again.attempts, job.attempts + 1);
    db.drop_db().await;
}

#[tokio::test]
async fn an_invalid_table_name_is_rejected_before_any_sql_runs() {
    // A pool that would fail on first use: nothing may reach it.
    let unreachable = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(200))
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap();
    for bad in ["jobs; DROP TABLE users", "Jobs", "", "a\"b"] {
        let err = TableName::new(bad).unwrap_err();
        assert!(
            matches!(err, PgError::InvalidIdentifier { .. }),
            "{bad:?}: {err}"
        );
    }
    let upgrade = queue_postgres::LegacyUpgrade::new(TableName::default(), QueueName::default());
    assert!(upgrade.retire_index("x; drop").is_err());
    // The type makes a bad name unrepresentable: the only way to a PgQueue is a valid name.
    assert_eq!(unreachable.size(), 0, "no connection was attempted");
}

async fn schema_check_names_a_missing_table<D: TestDriver>() {
    let db = TestDb::new().await;
    let config = PgQueueConfig::new(TableName::new("nowhere").unwrap(), QueueName::default());
    let err = support::connect::<D>(&db, config).await.unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");
    db.drop_db().await;
}

/// A table keyed by another column: the check names what is missing instead of failing on the
/// sequence look-up.
async fn schema_check_names_what_a_table_without_an_id_lacks<D: TestDriver>() {
    let db = TestDb::new().await;
    sqlx::raw_sql("CREATE TABLE keyed_jobs (job_id bigserial PRIMARY KEY, status text)")
        .execute(&db.pool)
        .await
        .unwrap();
    let config = PgQueueConfig::new(TableName::new("keyed_jobs").unwrap(), QueueName::default());
    let err = support::connect::<D>(&db, config).await.unwrap_err();
    assert!(matches!(err, PgError::Schema { .. }), "{err}");
    let text = err.to_string();
    for named in [
        "column id (bigint)",
        "column claimed_at",
        "a sequence or identity default on id",
    ] {
        assert!(
            text.contains(named),
            "the refusal must name {named:?}: {text}"
        );
    }
    db.drop_db().await;
}

/// A custom table of the previous release (no claim token) is refused, naming the one table
/// migration to commit; once it is applied, the queue opens and fences on the token.
async fn a_table_from_before_the_claim_token_is_told_which_migration_to_commit<D: TestDriver>() {
    let db = TestDb::new().await;
    let table = TableName::new("older_jobs").unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(queue_postgres::create_table_sql(
        &table,
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::raw_sql("ALTER TABLE older_jobs DROP COLUMN claim_token")
        .execute(&db.pool)
        .await
        .unwrap();
    let config = PgQueueConfig::new(table.clone(), QueueName::default());
    let err = support::connect::<D>(&db, config.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, PgError::Schema { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("column claim_token") && text.contains("20261204000001"),
        "{text}"
    );
    let migration = queue_postgres::table_migration_sql(&table, 20261204000001).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(migration))
        .execute(&db.pool)
        .await
        .unwrap();
    let queue = support::connect::<D>(&db, config).await.unwrap();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    let job = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    assert_ne!(job.token, queue_core::ClaimToken(0));
    db.drop_db().await;
}

/// Collects every plan node under `node` (depth first).
fn nodes<'a>(node: &'a Value, out: &mut Vec<&'a Value>) {
    out.push(node);
    if let Some(children) = node.get("Plans").and_then(Value::as_array) {
        for child in children {
            nodes(child, out);
        }
    }
}

async fn explain_claim(db: &TestDb) -> Value {
    explain_claim_of(db, 1).await
}

/// The plan of a claim of `batch` jobs.
async fn explain_claim_of(db: &TestDb, batch: i64) -> Value {
    let claim = queue_postgres::testing::claim_sql(&TableName::default());
    let sql = format!("EXPLAIN (FORMAT JSON) {claim}");
    let plan: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind("default")
        .bind(batch)
        .bind(90.0_f64)
        .bind(5_i32)
        .bind("explain")
        .bind(42_i64)
        .bind(Vec::<i64>::new())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    plan[0]["Plan"].clone()
}

/// The plan of the claim that carries outcomes, with 500 outcomes for rows in flight.
async fn explain_fused_claim(db: &TestDb) -> Value {
    let fused = queue_postgres::testing::finalize_claim_sql(&TableName::default());
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM queue_jobs WHERE status = 'in_flight' ORDER BY id LIMIT 500",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let n = ids.len();
    let plan: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (FORMAT JSON) {fused}"
    )))
    .bind(&ids)
    .bind(vec![1_i64; n])
    .bind(vec!["completed"; n])
    .bind(vec![false; n])
    .bind(vec![None::<chrono::DateTime<chrono::Utc>>; n])
    .bind(vec![None::<f64>; n])
    .bind(vec![None::<String>; n])
    .bind(vec![true; n])
    .bind(vec!["complete"; n])
    .bind(vec![0_i64; n])
    .bind("default")
    .bind(500_i64)
    .bind(90.0_f64)
    .bind(5_i32)
    .bind("explain")
    .bind(42_i64)
    .bind(&ids)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    plan[0]["Plan"].clone()
}

/// Asserts that each pick (`CTE due`, `CTE expired`) is an index scan on its partial index with
/// no sequential scan and no sort under it.
fn assert_picks_are_index_backed(plan: &Value) {
    let mut all = Vec::new();
    nodes(plan, &mut all);
    for (cte, index) in [
        ("due", "queue_jobs_due_idx"),
        ("expired", "queue_jobs_expiry_idx"),
    ] {
        let root = all
            .iter()
            .find(|n| n["Subplan Name"] == format!("CTE {cte}"))
            .unwrap_or_else(|| panic!("no CTE {cte} in {plan:#}"));
        let mut under = Vec::new();
        nodes(root, &mut under);
        let types: Vec<&str> = under
            .iter()
            .filter_map(|n| n["Node Type"].as_str())
            .collect();
        assert!(
            !types.contains(&"Seq Scan"),
            "CTE {cte} scans the table: {types:?}"
        );
        assert!(!types.contains(&"Sort"), "CTE {cte} sorts: {types:?}");
        assert!(
            under.iter().any(|n| n["Index Name"] == index),
            "CTE {cte} does not use {index}: {root:#}"
        );
    }
}

/// The nodes of `sql`'s plan (`EXPLAIN (FORMAT JSON)` with the bound values).
async fn plan_nodes(
    db: &TestDb,
    sql: String,
    binds: impl FnOnce(
        sqlx::query::QueryScalar<'_, sqlx::Postgres, Value, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryScalar<
        '_,
        sqlx::Postgres,
        Value,
        sqlx::postgres::PgArguments,
    >,
) -> Vec<Value> {
    let text = format!("EXPLAIN (FORMAT JSON) {sql}");
    let query = sqlx::query_scalar(sqlx::AssertSqlSafe(text));
    let plan: Value = binds(query).fetch_one(&db.pool).await.unwrap();
    let mut all = Vec::new();
    nodes(&plan[0]["Plan"], &mut all);
    all.into_iter().cloned().collect()
}

/// The operator's views stay index-backed on a big table: dead jobs are listed through the
/// failed index (never a scan of the completed history), and the queues of a table are found
/// by skip scans of the partial indexes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listings_stay_index_backed_on_a_large_table() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "INSERT INTO queue_jobs (status, payload, finished_at)
             SELECT 'completed', '{}', now() - interval '1 day' FROM generate_series(1, 200000);
         INSERT INTO queue_jobs (status, payload, finished_at)
             SELECT 'dead', '{}', now() FROM generate_series(1, 20);
         INSERT INTO queue_jobs (queue, payload) SELECT 'q' || (g % 3), '{}'
             FROM generate_series(1, 30000) g;
         ANALYZE queue_jobs;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let table = TableName::default();
    let listing = queue_postgres::testing::list_jobs_sql(&table, &[JobStatus::Dead]);
    let nodes = plan_nodes(&db, listing, |q| {
        q.bind("default").bind(None::<i64>).bind(51_i64)
    })
    .await;
    let types: Vec<&str> = nodes
        .iter()
        .filter_map(|n| n["Node Type"].as_str())
        .collect();
    assert!(
        !types.contains(&"Seq Scan"),
        "the dead listing scans the table: {types:?}"
    );
    assert!(
        nodes
            .iter()
            .any(|n| n["Index Name"] == "queue_jobs_failed_idx"),
        "the dead listing does not use the failed index: {types:?}"
    );
    let queues_plan = || async {
        let nodes = plan_nodes(&db, queue_postgres::testing::queues_sql(&table), |q| q).await;
        let scans: Vec<Value> = nodes
            .iter()
            .filter(|n| n["Node Type"] == "Seq Scan" && n["Relation Name"] == "queue_jobs")
            .cloned()
            .collect();
        (nodes, scans)
    };
    let (_, scanned) = queues_plan().await;
    assert!(
        scanned.is_empty(),
        "the queues statement scans the job table: {scanned:?}"
    );
    // No statement needs the lease index: without it, the in-flight skip scan reads the expiry
    // index (the same queue-leading partial index) and nothing scans the table.
    sqlx::raw_sql(
        "UPDATE queue_jobs SET status = 'in_flight', claimed_at = now(),
                lease_expires_at = now() + interval '90 seconds'
         WHERE id IN (SELECT id FROM queue_jobs WHERE status = 'pending' LIMIT 300);
         ANALYZE queue_jobs;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    drop_lease_index(&db).await;
    let (nodes, scanned) = queues_plan().await;
    assert!(
        scanned.is_empty(),
        "without the lease index the queues statement scans the job table: {scanned:?}"
    );
    assert!(
        nodes
            .iter()
            .any(|n| n["Index Name"] == "queue_jobs_expiry_idx"),
        "the in-flight skip scan does not read the expiry index: {nodes:#?}"
    );
    db.drop_db().await;
}

/// Statistics taken while nothing was in flight (autovacuum analyzing a table just loaded, or a
/// quiet night) make the in-flight partial indexes look empty. A heartbeat and a cancel, which
/// name their row by id, still read it by primary key however many jobs are in flight by then
/// (planned on the literal status, each read every in-flight row through
/// `queue_jobs_expiry_idx`; at a thousand jobs in flight on heartbeats that starved the
/// database), and they still apply. So does the claim's write of its picks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_and_cancels_read_their_row_by_primary_key_on_statistics_taken_with_nothing_in_flight()
 {
    let db = TestDb::new().await;
    let queue = db.queue().await;
    sqlx::raw_sql(
        "INSERT INTO queue_jobs (payload)
             SELECT jsonb_build_object('n', g) FROM generate_series(1, 20000) g;
         ANALYZE queue_jobs;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.extend(queue.claim(req(500)).await.unwrap().jobs);
    }
    assert_eq!(held.len(), 1500);

    let only_by_primary_key = |what: &str, all: &[Value]| {
        let read: Vec<(&str, &str)> = all
            .iter()
            .filter(|n| {
                n["Relation Name"] == "queue_jobs"
                    && n["Node Type"].as_str().is_some_and(|t| t.contains("Scan"))
            })
            .map(|n| {
                (
                    n["Node Type"].as_str().unwrap_or(""),
                    n["Index Name"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert!(
            !read.is_empty()
                && read
                    .iter()
                    .all(|(node, index)| *node != "Seq Scan" && *index == "queue_jobs_pkey"),
            "{what} reads queue_jobs otherwise than by primary key: {read:?}"
        );
    };
    let [_, heartbeat, cancel, heartbeats] =
        queue_postgres::testing::lease_holder_writes_sql(&TableName::default());
    let job = &held[700];
    let all = plan_nodes(&db, heartbeat, |q| {
        q.bind(job.id.0)
            .bind(job.generation.0)
            .bind(90.0_f64)
            .bind(job.token.0)
    })
    .await;
    only_by_primary_key("the heartbeat", &all);
    let many = &held[600..900];
    let ids: Vec<i64> = many.iter().map(|j| j.id.0).collect();
    let generations: Vec<i64> = many.iter().map(|j| j.generation.0).collect();
    let tokens: Vec<i64> = many.iter().map(|j| j.token.0).collect();
    let all = plan_nodes(&db, heartbeats, |q| {
        q.bind(ids.clone())
            .bind(generations.clone())
            .bind(90.0_f64)
            .bind(tokens.clone())
    })
    .await;
    only_by_primary_key("the batched heartbeat", &all);
    let all = plan_nodes(&db, cancel, |q| {
        q.bind(job.id.0).bind("default").bind("operator")
    })
    .await;
    only_by_primary_key("the cancel", &all);

    // The claim's write names its rows by id too: read by primary key, never by a scan of the
    // table (joined with its picks, it was planned as a hash join over a sequential scan here).
    let claim = explain_claim_of(&db, 500).await;
    let mut all = Vec::new();
    nodes(&claim, &mut all);
    let written = all
        .iter()
        .find(|n| n["Subplan Name"] == "CTE written")
        .unwrap_or_else(|| panic!("no CTE written in {claim:#}"));
    let mut under = Vec::new();
    nodes(written, &mut under);
    let under: Vec<Value> = under.into_iter().cloned().collect();
    only_by_primary_key("the claim's write", &under);
    assert_picks_are_index_backed(&claim);

    // And they do what they did: the heartbeat holds the job, the cancel is requested, and
    // the next heartbeat says so.
    assert_eq!(
        queue
            .extend_lease(job.claim(), Lease::DEFAULT)
            .await
            .unwrap(),
        Heartbeat::Held
    );
    let claims: Vec<Claim> = many.iter().map(|j| j.claim()).collect();
    let answers = queue.extend_leases(&claims, Lease::DEFAULT).await.unwrap();
    assert!(answers.iter().all(|a| *a == Some(Heartbeat::Held)));
    queue.cancel(job.id).await.unwrap();
    assert_eq!(
        queue
            .extend_lease(job.claim(), Lease::DEFAULT)
            .await
            .unwrap(),
        Heartbeat::CancelRequested
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_plan_stays_index_backed_with_a_large_backlog_and_many_finished_rows() {
    claim_plan_stays_index_backed(true).await;
}

/// The same on a table whose operator dropped `queue_jobs_lease_idx`: the expiry index serves
/// every in-flight read the lease index served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_plan_stays_index_backed_without_the_lease_index() {
    claim_plan_stays_index_backed(false).await;
}

async fn claim_plan_stays_index_backed(lease_index: bool) {
    let db = TestDb::new().await;
    if !lease_index {
        drop_lease_index(&db).await;
    }
    let queue = db.queue().await;
    // 100k finished rows, 200k due rows, 500 in flight.
    sqlx::raw_sql(
        "INSERT INTO queue_jobs (status, payload, finished_at, next_attempt_at)
             SELECT 'completed', '{}', now() - interval '1 day', now() - interval '2 days'
             FROM generate_series(1, 100000);
         INSERT INTO queue_jobs (payload, next_attempt_at)
             SELECT jsonb_build_object('n', g), now() - make_interval(secs => g)
             FROM generate_series(1, 200000) g;
         INSERT INTO queue_jobs (status, payload, claimed_at, claim_generation)
             SELECT 'in_flight', '{}', now(), 1 FROM generate_series(1, 500);
         ANALYZE queue_jobs;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_picks_are_index_backed(&explain_claim(&db).await);
    // The claim that carries outcomes picks the same way, and finds the outcomes' rows
    // through an index, never by scanning the table.
    let fused = explain_fused_claim(&db).await;
    assert_picks_are_index_backed(&fused);
    let mut all = Vec::new();
    nodes(&fused, &mut all);
    let finalized = all
        .iter()
        .find(|n| n["Subplan Name"] == "CTE finalized")
        .unwrap_or_else(|| panic!("no CTE finalized in {fused:#}"));
    let mut under = Vec::new();
    nodes(finalized, &mut under);
    // By primary key, or (with many outcomes) by reading the in-flight rows' partial index.
    assert!(
        under.iter().all(|n| n["Node Type"] != "Seq Scan")
            && under.iter().any(|n| {
                n["Index Name"] == "queue_jobs_pkey" || n["Index Name"] == "queue_jobs_expiry_idx"
            }),
        "the outcomes' rows are not found through an index: {finalized:#}"
    );
    // The statistics read indexes only, never the table's history.
    let stats = queue_postgres::testing::stats_sql(&TableName::default());
    let plan: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (FORMAT JSON) {stats}"
    )))
    .bind("default")
    .bind(60.0_f64)
    .bind(90.0_f64)
    .bind(100_000_i64)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let mut all = Vec::new();
    nodes(&plan[0]["Plan"], &mut all);
    // A scan of the table is allowed only under a limit (the capped counts, where the planner
    // finds most rows match and a scan stops early): never a scan of the history.
    let unbounded = all.iter().any(|node| {
        let children = node["Plans"].as_array().cloned().unwrap_or_default();
        children
            .iter()
            .any(|child| child["Node Type"] == "Seq Scan")
            && node["Node Type"] != "Limit"
    });
    assert!(
        !unbounded && plan[0]["Plan"]["Node Type"] != "Seq Scan",
        "stats scan the table: {plan:#}"
    );
    for index in [
        "queue_jobs_due_idx",
        "queue_jobs_expiry_idx",
        "queue_jobs_finished_idx",
    ] {
        assert!(
            all.iter().any(|n| n["Index Name"] == index),
            "stats do not read {index}: {plan:#}"
        );
    }
    let stats = queue.stats(Duration::from_secs(60)).await.unwrap();
    assert_eq!(
        (stats.due, stats.in_flight, stats.lease_expired),
        (QueueStats::COUNT_CAP, 500, 0)
    );
    // And the claim really takes the oldest due job.
    let job = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    assert_eq!(job.payload, json!({ "n": 200000 }));
    db.drop_db().await;
}

/// A partitioned queue with a large backlog: 1 000 partitions of 200 due jobs, 100k finished
/// rows, 500 partitions at their limit. The walk reads the partition index one probe per key
/// and each partition's offer through it; the jobs without a partition are looked for among
/// a bounded number of the earliest due rows; nothing scans the table. Run for real (inside a
/// transaction rolled back), a claim of 10 reads a few hundred pages, not the backlog's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_claim_walks_the_partition_index_with_a_large_backlog() {
    partitioned_claim_walks_the_partition_index(true).await;
}

/// The same on a table whose operator dropped `queue_jobs_lease_idx` (the limited claim's
/// in-flight counts read the expiry index instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_claim_walks_the_partition_index_without_the_lease_index() {
    partitioned_claim_walks_the_partition_index(false).await;
}

async fn partitioned_claim_walks_the_partition_index(lease_index: bool) {
    use queue_core::{Admin, QueueLimits};
    let db = TestDb::new().await;
    if !lease_index {
        drop_lease_index(&db).await;
    }
    let queue = db.queue().await;
    sqlx::raw_sql(
        "INSERT INTO queue_jobs (status, payload, finished_at, next_attempt_at, partition_key)
             SELECT 'completed', '{}', now() - interval '1 day', now() - interval '2 days',
                    'p' || (g % 1000)
             FROM generate_series(1, 100000) g;
         INSERT INTO queue_jobs (payload, next_attempt_at, partition_key)
             SELECT jsonb_build_object('n', g), now() - make_interval(secs => g),
                    'p' || lpad((g % 1000)::text, 3, '0')
             FROM generate_series(1, 200000) g;
         INSERT INTO queue_jobs (status, payload, claimed_at, claim_generation, lease_generation,
                                 lease_expires_at, partition_key)
             SELECT 'in_flight', '{}', now(), 1, 1, now() + interval '1 hour',
                    'p' || lpad((g * 2)::text, 3, '0')
             FROM generate_series(0, 499) g;
         ANALYZE queue_jobs;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let limits = QueueLimits {
        max_per_partition: Some(1),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    let explain = |sql: String, analyze: bool| {
        let options = if analyze {
            "ANALYZE, BUFFERS, FORMAT JSON"
        } else {
            "FORMAT JSON"
        };
        sqlx::query_scalar::<_, Value>(sqlx::AssertSqlSafe(format!("EXPLAIN ({options}) {sql}")))
            .bind("default")
            .bind(10_i64)
            .bind(90.0_f64)
            .bind(5_i32)
            .bind("explain")
            .bind(42_i64)
            .bind(Vec::<i64>::new())
    };
    let table = TableName::default();
    let pick = queue_postgres::testing::claim_limited_sql(&table);
    let turns = queue_postgres::testing::claim_turns_sql(&table);
    for (sql, indexes) in [
        (&pick, vec![("plain", "queue_jobs_due_idx")]),
        (
            &turns,
            vec![
                ("after_cursor", "queue_jobs_partition_idx"),
                ("offers", "queue_jobs_partition_idx"),
            ],
        ),
    ] {
        let plan = explain(sql.clone(), false)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let mut all = Vec::new();
        nodes(&plan[0]["Plan"], &mut all);
        assert!(
            all.iter().all(|n| n["Node Type"] != "Seq Scan"),
            "a partitioned claim scans a table: {plan:#}"
        );
        for (cte, index) in indexes {
            let root = all
                .iter()
                .find(|n| n["Subplan Name"] == format!("CTE {cte}"))
                .unwrap_or_else(|| panic!("no CTE {cte} in {plan:#}"));
            let mut under = Vec::new();
            nodes(root, &mut under);
            assert!(
                under.iter().any(|n| n["Index Name"] == index),
                "CTE {cte} does not use {index}: {root:#}"
            );
        }
        let mut tx = db.pool.begin().await.unwrap();
        let run = explain(sql.clone(), true)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let top = &run[0]["Plan"];
        let pages = top["Shared Hit Blocks"].as_i64().unwrap()
            + top["Shared Read Blocks"].as_i64().unwrap();
        assert!(pages < 3_000, "a claim of 10 read {pages} pages: {run:#}");
    }

    // And for real: ten partitions not at their limit, one job each, the cursor after them.
    let jobs = queue.claim(req(10)).await.unwrap().jobs;
    assert_eq!(jobs.len(), 10);
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT partition_key FROM queue_jobs WHERE id = ANY($1) ORDER BY partition_key",
    )
    .bind(jobs.iter().map(|j| j.id.0).collect::<Vec<_>>())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let expected: Vec<String> = (0..10).map(|n| format!("p{:03}", n * 2 + 1)).collect();
    assert_eq!(
        keys, expected,
        "the odd partitions: the even ones are at their limit"
    );
    let cursor: Option<String> = sqlx::query_scalar(
        "SELECT partition_cursor FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(cursor.as_deref(), Some("p019"));
    db.drop_db().await;
}

struct Done;

impl Handler for Done {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        Ok(())
    }
}

fn idle_worker_config() -> WorkerConfig {
    WorkerConfig {
        // Far longer than the test waits: only a NOTIFY can wake the worker in time.
        poll_interval: Duration::from_secs(3600),
        ..WorkerConfig::default()
    }
}

async fn listener_pids(db: &TestDb) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = $2 AND query ILIKE 'LISTEN%'",
    )
    .bind(&db.name)
    .bind(queue_postgres::LISTENER_APPLICATION_NAME)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn wait_for_listener(db: &TestDb, not: Option<i32>) -> i32 {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Some(pid) = listener_pids(db)
                .await
                .into_iter()
                .find(|p| Some(*p) != not)
            {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the listener did not (re)connect")
}

/// A bulk enqueue goes by `COPY` in a transaction of its own: a row the database refuses
/// (here a trigger raises for one job of 10 500) leaves nothing inserted, and a bulk enqueue
/// that commits wakes an idle worker through its NOTIFY.
async fn a_bulk_enqueue_by_copy_is_all_or_nothing_and_wakes_idle_workers<D: TestDriver>() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        r#"
        CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'poisoned row %', NEW.id; END $$;
        CREATE TRIGGER refuse_poison BEFORE INSERT ON queue_jobs FOR EACH ROW
            WHEN (NEW.payload ? 'poison') EXECUTE FUNCTION refuse_poison();
        "#,
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let queue = support::connect_default::<D>(&db).await;
    let jobs = (0..10_500)
        .map(|n| match n {
            9_200 => NewJob::from_value(json!({ "poison": true, "card": "s3cr3t" })),
            n => NewJob::from_value(json!({ "n": n })),
        })
        .collect();
    let err = queue.enqueue_many(jobs).await.unwrap_err().to_string();
    // The server's message, never the row COPY was reading (its context names the line).
    assert!(err.contains("poisoned row"), "{err}");
    assert!(
        !err.contains("s3cr3t") && !err.contains("poison\""),
        "{err}"
    );
    assert_eq!(queue.counts().await.unwrap().total(), 0);

    wait_for_listener(&db, None).await;
    let worker = Worker::new(queue.clone(), Done, idle_worker_config())
        .unwrap()
        .start();
    worker
        .wait_for_timeout(Duration::from_secs(10), |s| s.claim_passes >= 1)
        .await
        .expect("the worker's first claim");
    let jobs = (0..1000)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    queue.enqueue_many(jobs).await.unwrap();
    worker
        .wait_for_timeout(Duration::from_secs(30), |s| s.completed == 1000)
        .await
        .expect("NOTIFY woke the idle worker for the bulk enqueue");
    worker.shutdown().await.unwrap();
    db.drop_db().await;
}

async fn notify_wakes_an_idle_worker_and_a_lost_listener_re_listens<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let first = wait_for_listener(&db, None).await;
    let worker = Worker::new(queue.clone(), Done, idle_worker_config())
        .unwrap()
        .start();
    // Let the worker make its first empty claim and go idle.
    worker
        .wait_for_timeout(Duration::from_secs(10), |s| s.claim_passes >= 1)
        .await
        .expect("the worker's first claim");
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        worker.wait_for(|s| s.completed == 1),
    )
    .await
    .expect("NOTIFY did not wake the idle worker");

    // Kill the listener's connection: it must come back and listen again.
    let passes = worker.stats().claim_passes;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(first)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(killed);
    wait_for_listener(&db, Some(first)).await;
    // The lost connection and the new one each wake the worker for a poll: let it be idle again.
    worker
        .wait_for_timeout(Duration::from_secs(10), |s| s.claim_passes > passes)
        .await
        .expect("a poll after the listener came back");
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        worker.wait_for(|s| s.completed == 2),
    )
    .await
    .expect("after re-listening, NOTIFY did not wake the worker");
    worker.shutdown().await.unwrap();
    db.drop_db().await;
}

async fn notify_is_sent_on_commit_only<D: TestDriver>() {
    let db = TestDb::new().await;
    let config = PgQueueConfig {
        listen: false,
        ..PgQueueConfig::default()
    };
    let queue = support::connect::<D>(&db, config).await.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener
        .listen(&TableName::default().channel())
        .await
        .unwrap();
    let mut tx = queue.begin().await.unwrap();
    queue
        .enqueue_in(&mut tx, NewJob::from_value(json!({})))
        .await
        .unwrap();
    // Nothing before the commit, and nothing claimable from another connection either.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), listener.recv())
            .await
            .is_err(),
        "a NOTIFY arrived before the commit"
    );
    assert!(queue.claim(req(10)).await.unwrap().jobs.is_empty());
    tx.commit().await.unwrap();
    let note = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("no NOTIFY after the commit")
        .unwrap();
    assert_eq!(note.payload(), "default");
    assert_eq!(queue.claim(req(10)).await.unwrap().jobs.len(), 1);
    drop(listener);
    db.drop_db().await;
}

async fn concurrent_enqueues_of_one_unique_key_insert_once<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let q = queue.clone();
        set.spawn(async move {
            q.enqueue(NewJob::from_value(json!({})).unique_key("transmission-42"))
                .await
                .unwrap()
        });
    }
    let mut results = Vec::new();
    while let Some(r) = set.join_next().await {
        results.push(r.unwrap());
    }
    assert_eq!(results.iter().filter(|e| !e.duplicate).count(), 1);
    let ids: HashSet<JobId> = results.iter().map(|e| e.id).collect();
    assert_eq!(ids.len(), 1, "every caller must learn the one job's id");
    assert_eq!(queue.counts().await.unwrap().total(), 1);
    db.drop_db().await;
}

async fn a_custom_table_works_and_keeps_its_queues_apart<D: TestDriver>() {
    let db = TestDb::new().await;
    let table = TableName::new("mail_jobs").unwrap();
    PostgresQueue::<D>::install_table(&support::pool::<D>(&db, 1), &table)
        .await
        .unwrap();
    PostgresQueue::<D>::install_table(&support::pool::<D>(&db, 1), &table)
        .await
        .expect("idempotent");
    let mail = support::connect::<D>(
        &db,
        PgQueueConfig::new(table.clone(), QueueName::new("mail").unwrap()),
    )
    .await
    .unwrap();
    let sms = support::connect::<D>(
        &db,
        PgQueueConfig::new(table, QueueName::new("sms").unwrap()),
    )
    .await
    .unwrap();
    let id = mail
        .enqueue(NewJob::from_value(json!({ "to": "a@b" })))
        .await
        .unwrap()
        .id;
    assert!(
        sms.claim(req(10)).await.unwrap().jobs.is_empty(),
        "a queue claimed another's job"
    );
    assert!(sms.get(id).await.unwrap().is_none());
    let job = mail.claim(req(10)).await.unwrap().jobs.remove(0);
    assert_eq!(job.id, id);
    assert!(
        mail.finalize(job.claim(), &Finalize::Complete)
            .await
            .unwrap()
            .is_applied()
    );
    let standard: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(standard, 0, "the custom table's jobs went elsewhere");
    // A row written by hand without its queue is refused, not parked in a queue nobody serves.
    let err = sqlx::query("INSERT INTO mail_jobs (payload) VALUES ('{}')")
        .execute(&db.pool)
        .await
        .unwrap_err();
    let code = err
        .as_database_error()
        .and_then(|e| e.code().map(|c| c.into_owned()));
    assert_eq!(code.as_deref(), Some("23502"), "{err}");
    db.drop_db().await;
}

async fn retention_sweeps_old_terminal_rows_in_batches_and_nothing_else<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    queue
        .enqueue_many(
            (0..25)
                .map(|n| NewJob::from_value(json!({ "n": n })))
                .collect(),
        )
        .await
        .unwrap();
    let jobs = queue.claim(req(20)).await.unwrap().jobs;
    let done: Vec<_> = jobs
        .iter()
        .map(|j| (j.claim(), Finalize::Complete))
        .collect();
    queue.finalize_many(&done).await.unwrap();
    // 20 finished, 5 pending; age everything by two days, then finish one more (fresh).
    support::shift_time(&db.pool, "queue_jobs", Duration::from_secs(2 * 86400)).await;
    let fresh = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    assert!(
        queue
            .finalize(fresh.claim(), &Finalize::Complete)
            .await
            .unwrap()
            .is_applied()
    );
    let deleted = queue
        .sweep_finished(Duration::from_secs(86400), 7)
        .await
        .unwrap();
    assert_eq!(deleted, 20);
    let counts = queue.counts().await.unwrap();
    assert_eq!((counts.completed, counts.pending), (1, 4));
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framework_migrations_coexist_with_a_services_own_migrator() {
    use sqlx::migrate::{Migration, MigrationType, Migrator};
    let db = TestDb::new().await;
    let service = Migrator::with_migrations(vec![Migration::new(
        1,
        "orders".into(),
        MigrationType::Simple,
        sqlx::SqlSafeStr::into_sql_str("CREATE TABLE orders (id bigserial PRIMARY KEY)"),
        false,
    )]);
    service
        .run(&db.pool)
        .await
        .expect("the service's migrator ignores the framework's table");
    queue_postgres::migrate(&db.pool)
        .await
        .expect("and the framework's ignores the service's");
    service.run(&db.pool).await.unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE tablename IN ('_sqlx_migrations', $1) ORDER BY 1",
    )
    .bind(queue_postgres::MIGRATIONS_TABLE)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(tables.len(), 2, "{tables:?}");
    db.drop_db().await;
}

async fn a_stale_finalize_in_the_callers_transaction_writes_nothing<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let id = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    let old = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    support::shift_time(&db.pool, "queue_jobs", Lease::DEFAULT.duration() * 2).await;
    let new = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    // The caller's own transaction (any lifetime), with a domain write beside the job's outcome.
    sqlx::raw_sql("CREATE TABLE outbox (job_id bigint)")
        .execute(&db.pool)
        .await
        .unwrap();
    let items = [
        (old.claim(), Finalize::Complete),
        (new.claim(), Finalize::Complete),
    ];
    let outcomes = finalize_with_domain_write(&queue, &items, id.0).await;
    assert_eq!(
        outcomes,
        vec![FinalizeOutcome::Stale, FinalizeOutcome::Applied]
    );
    let row = queue.get(id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.claim_generation),
        (JobStatus::Completed, new.generation)
    );
    let staged: i64 = sqlx::query("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(staged, 1);
    db.drop_db().await;
}

async fn connecting_to_a_stopped_server_is_a_transient_error<D: TestDriver>() {
    let unreachable = D::pool("postgres://postgres@127.0.0.1:1/none", 1);
    let err = PostgresQueue::<D>::check_schema(&unreachable, &TableName::default())
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
}

/// The fallback: with no `LISTEN` connection at all, the poll finds the work.
async fn a_worker_without_listen_finds_work_by_polling<D: TestDriver>() {
    let db = TestDb::new().await;
    let config = PgQueueConfig {
        listen: false,
        ..PgQueueConfig::default()
    };
    let queue = support::connect::<D>(&db, config).await.unwrap();
    assert!(queue.wake_signal().is_none());
    let worker_config = WorkerConfig {
        poll_interval: Duration::from_millis(50),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(queue.clone(), Done, worker_config)
        .unwrap()
        .start();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        worker.wait_for(|s| s.completed == 1),
    )
    .await
    .expect("polling alone should find the job");
    worker.shutdown().await.unwrap();
    assert_eq!(listener_pids(&db).await, Vec::<i32>::new());
    db.drop_db().await;
}

/// One outcome the database refuses (here a trigger raises for one job) costs only that job its
/// write: the batch is split until the refused item stands alone, and the other outcomes apply.
async fn a_refused_outcome_costs_only_its_own_job<D: TestDriver>() {
    refused_outcome::<D>(false).await;
}

/// The same when the outcomes ride with the claims: the refused statement loses neither the
/// claim (sent again alone) nor the other outcomes.
async fn a_refused_outcome_carried_with_a_claim_costs_only_its_own_job<D: TestDriver>() {
    refused_outcome::<D>(true).await;
}

async fn refused_outcome<D: TestDriver>(fuse_claims: bool) {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        r#"
        CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'poisoned row %', NEW.id; END $$;
        CREATE TRIGGER refuse_poison BEFORE UPDATE ON queue_jobs FOR EACH ROW
            WHEN (NEW.status = 'completed' AND NEW.payload ? 'poison')
            EXECUTE FUNCTION refuse_poison();
        "#,
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let queue = support::connect_default::<D>(&db).await;
    let mut jobs: Vec<NewJob> = (0..7)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    jobs.push(NewJob::from_value(json!({ "poison": true })));
    queue.enqueue_many(jobs).await.unwrap();
    let config = WorkerConfig {
        concurrency: 8,
        max_batch: 8,
        poll_interval: Duration::from_millis(50),
        fuse_claims,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(queue.clone(), Done, config).unwrap().start();
    worker
        .wait_for_timeout(Duration::from_secs(30), |s| {
            s.completed == 7 && s.finalize_errors == 1
        })
        .await
        .expect("seven outcomes apply, one is refused");
    // Later jobs are still claimed and run.
    queue
        .enqueue_many(
            (0..5)
                .map(|n| NewJob::from_value(json!({ "later": n })))
                .collect(),
        )
        .await
        .unwrap();
    worker
        .wait_for_timeout(Duration::from_secs(30), |s| s.completed == 12)
        .await
        .expect("the jobs enqueued after the refusal run");
    worker.shutdown().await.unwrap();
    let counts = queue.counts().await.unwrap();
    assert_eq!((counts.completed, counts.in_flight), (12, 1));
}

/// Counts each job's runs; every seventh job fails for good.
#[derive(Clone, Default)]
struct CountRuns {
    runs: std::sync::Arc<std::sync::Mutex<HashMap<JobId, u32>>>,
    total: std::sync::Arc<tokio::sync::Notify>,
}

impl Handler for CountRuns {
    type Payload = Value;
    async fn handle(&self, ctx: JobContext, payload: Value) -> Result<(), JobError> {
        let ran = {
            let mut runs = self.runs.lock().unwrap();
            *runs.entry(ctx.id()).or_default() += 1;
            runs.len()
        };
        if ran >= 3000 {
            self.total.notify_one();
        }
        match payload["n"].as_i64() {
            Some(n) if n % 7 == 0 => Err(JobError::fail("seventh")),
            _ => Ok(()),
        }
    }
}

/// Three workers on three pools drain one queue, two of them carrying their outcomes with
/// their claims (one statement per batch) and one writing them apart: every job runs once, and
/// every outcome lands.
async fn workers_carrying_outcomes_with_claims_run_each_job_once<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    for chunk in (0..3000).collect::<Vec<i64>>().chunks(1000) {
        let jobs = chunk
            .iter()
            .map(|n| NewJob::from_value(json!({ "n": n })))
            .collect();
        queue.enqueue_many(jobs).await.unwrap();
    }
    let handler = CountRuns::default();
    let ran_all = handler.total.notified();
    let mut workers = Vec::new();
    for fuse_claims in [true, true, false] {
        let queue = support::connect_default::<D>(&db).await;
        let config = WorkerConfig {
            concurrency: 8,
            prefetch: 40,
            max_batch: 40,
            poll_interval: Duration::from_millis(50),
            fuse_claims,
            ..WorkerConfig::default()
        };
        workers.push(Worker::new(queue, handler.clone(), config).unwrap().start());
    }
    tokio::time::timeout(Duration::from_secs(60), ran_all)
        .await
        .expect("every job runs");
    let mut stale = 0;
    for worker in workers {
        stale += worker.shutdown().await.unwrap().stats.stale;
    }
    assert_eq!(stale, 0);
    let runs = handler.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 3000);
    assert!(runs.values().all(|&n| n == 1), "a job ran twice");
    let counts = queue.counts().await.unwrap();
    let failed = (0..3000).filter(|n| n % 7 == 0).count() as u64;
    assert_eq!(
        (
            counts.completed,
            counts.failed,
            counts.in_flight,
            counts.pending
        ),
        (3000 - failed, failed, 0, 0)
    );
    db.drop_db().await;
}

/// No statement needs `<table>_lease_idx` (the claim's expired pick reads the expiry index, and
/// every plan that may read it has the same shape on the expiry index), so the schema check no
/// longer requires it. A table whose operator dropped it (operations.md says when) connects,
/// is not given it back by `install_table`, claims with and without limits, renews, reports its
/// statistics, takes over expired leases, fences their first holder, cancels, finalizes and
/// lists its queues.
async fn a_table_without_the_lease_index_serves_every_statement<D: TestDriver>() {
    use queue_core::{Admin, CancelOutcome, QueueLimits};
    let db = TestDb::new().await;
    drop_lease_index(&db).await;
    let table = TableName::default();
    PostgresQueue::<D>::install_table(&support::pool::<D>(&db, 1), &table)
        .await
        .unwrap();
    assert!(
        !has_lease_index(&db).await,
        "install_table built the dropped index again"
    );
    let queue = support::connect::<D>(&db, PgQueueConfig::default())
        .await
        .expect("a table without the lease index passes the schema check");
    let mut ids = Vec::new();
    for n in 0..4 {
        let job = NewJob::from_value(json!({ "n": n })).partition_key(format!("p{}", n % 2));
        ids.push(queue.enqueue(job).await.unwrap().id);
    }
    let lease = Lease::from_secs(30).unwrap();
    let first = queue.claim(ClaimRequest::new(2, lease)).await.unwrap().jobs;
    assert_eq!(first.len(), 2);
    let claims: Vec<Claim> = first.iter().map(|j| j.claim()).collect();
    assert_eq!(
        queue.extend_leases(&claims, lease).await.unwrap(),
        [Some(Heartbeat::Held), Some(Heartbeat::Held)]
    );
    let stats = queue.stats(Duration::from_secs(60)).await.unwrap();
    assert_eq!((stats.in_flight, stats.due), (2, 2));
    assert_eq!(
        queue.cancel(ids[3]).await.unwrap(),
        CancelOutcome::Cancelled
    );
    // The limited claim counts the jobs in flight, queue-wide and per partition.
    queue
        .set_limits(QueueLimits {
            max_in_flight: Some(10),
            max_per_partition: Some(2),
            ..QueueLimits::NONE
        })
        .await
        .unwrap();
    support::shift_time(&db.pool, "queue_jobs", Duration::from_secs(31)).await;
    assert_eq!(
        queue
            .stats(Duration::from_secs(60))
            .await
            .unwrap()
            .lease_expired,
        2
    );
    let second = queue.claim(req(3)).await.unwrap().jobs;
    assert_eq!(second.len(), 3, "both expired leases and the pending job");
    assert_eq!(second.iter().filter(|j| j.taken_over).count(), 2);
    assert_eq!(
        queue.queues().await.unwrap(),
        [QueueName::default()],
        "a queue whose jobs are all in flight is listed"
    );
    assert_eq!(
        queue
            .finalize(first[0].claim(), &Finalize::Complete)
            .await
            .unwrap(),
        FinalizeOutcome::Stale,
        "the first holder is fenced"
    );
    let items: Vec<(Claim, Finalize)> = second
        .iter()
        .map(|j| (j.claim(), Finalize::Complete))
        .collect();
    let outcomes = queue.finalize_many(&items).await.unwrap();
    assert!(outcomes.iter().all(|o| o.is_applied()), "{outcomes:?}");
    let counts = queue.counts().await.unwrap();
    assert_eq!((counts.completed, counts.cancelled), (3, 1));
    assert!(!has_lease_index(&db).await);
    db.drop_db().await;
}

/// Drops `queue_jobs_lease_idx`, as operations.md lets an operator once every process runs a
/// release that does not require it.
async fn drop_lease_index(db: &TestDb) {
    queue_postgres::testing::drop_lease_index(&db.pool, &TableName::default()).await;
}

async fn has_lease_index(db: &TestDb) -> bool {
    sqlx::query_scalar("SELECT to_regclass('queue_jobs_lease_idx') IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A row claimed by a binary from before leases were stored (an in-flight row with
/// `claimed_at` and no `lease_expires_at`, as during a rolling upgrade) keeps the claimer's
/// lease, counted from `claimed_at`: it is not taken over early.
async fn a_claim_from_before_stored_leases_keeps_its_claimers_lease<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO queue_jobs (status, payload, attempts, claimed_at, claim_generation)
         VALUES ('in_flight', '{}', 1, now(), 1) RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        queue.claim(req(1)).await.unwrap().jobs.is_empty(),
        "taken over early"
    );
    support::shift_time(
        &db.pool,
        "queue_jobs",
        Lease::DEFAULT.duration() + Duration::from_secs(1),
    )
    .await;
    let taken = queue.claim(req(1)).await.unwrap().jobs.remove(0);
    assert_eq!(
        (taken.id, taken.generation),
        (JobId(id), ClaimGeneration(2))
    );
    let row = queue.get(taken.id).await.unwrap().unwrap();
    assert!(
        row.lease_expires_at.is_some(),
        "the new claim stores its lease"
    );
    db.drop_db().await;
}

/// During a rolling deploy, a binary from before stored leases may take over a job this one
/// claimed, and renew it: it stamps `claimed_at` and leaves this binary's `lease_expires_at`
/// behind, expired or not. That expiry belongs to an earlier claim (`lease_generation`), so it
/// must not decide: the claimer's lease counts from the old binary's last `claimed_at`.
async fn a_takeover_by_a_binary_from_before_stored_leases_is_not_taken_over_at_once<
    D: TestDriver,
>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let short = ClaimRequest::new(1, Lease::from_secs(30).unwrap());
    let id = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    // A new worker claims under 90 s and dies.
    queue.claim(req(1)).await.unwrap().jobs.remove(0);
    let shift = |secs: u64| support::shift_time(&db.pool, "queue_jobs", Duration::from_secs(secs));
    shift(31).await;
    // An old binary with a 30 s lease takes it over (its claim statement), while this binary's
    // expiry is still 59 s ahead…
    let old_binary = |statement: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(statement)
                .bind(id.0)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    old_binary(
        "UPDATE queue_jobs SET claimed_at = now(), claim_generation = claim_generation + 1,
                attempts = attempts + 1, reclaims = reclaims + 1, updated_at = now()
         WHERE id = $1",
    )
    .await;
    // …and renews it (its heartbeat), the last time 9 s before that expiry.
    for secs in [20, 20, 10] {
        shift(secs).await;
        old_binary("UPDATE queue_jobs SET claimed_at = now(), updated_at = now() WHERE id = $1")
            .await;
    }
    // Past the stale expiry, 10 s after the old binary's last renewal.
    shift(10).await;
    assert!(
        queue.claim(short.clone()).await.unwrap().jobs.is_empty(),
        "a live claim of the older binary was taken over"
    );
    shift(21).await;
    let taken = queue.claim(short.clone()).await.unwrap().jobs.remove(0);
    assert_eq!((taken.id, taken.generation), (id, ClaimGeneration(3)));
    db.drop_db().await;
}

/// A queue's configured payload limit refuses a larger payload in every enqueue path, before
/// anything is written, and names the sizes, not the payload.
async fn the_payload_limit_is_the_queues_own<D: TestDriver>() {
    let db = TestDb::new().await;
    let config = PgQueueConfig {
        max_payload_bytes: 64,
        ..PgQueueConfig::default()
    };
    let queue = support::connect::<D>(&db, config).await.unwrap();
    let fits = NewJob::from_value(json!({ "note": "x".repeat(40) }));
    let over = NewJob::from_value(json!({ "card": "4111 1111 1111 1111", "note": "x".repeat(40) }));
    queue.enqueue(fits.clone()).await.unwrap();
    for result in [
        queue.enqueue(over.clone()).await,
        queue
            .enqueue_many(vec![fits, over.clone()])
            .await
            .map(|_| unreachable!()),
    ] {
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                queue_core::Error::Invalid(InvalidInput::PayloadTooLarge { limit: 64, .. })
            ),
            "{err:?}"
        );
        assert!(!err.to_string().contains("4111"), "{err}");
    }
    assert_eq!(queue.counts().await.unwrap().total(), 1);
    db.drop_db().await;
}

/// An enqueue is all or none: the database turning hostile in the middle of the call (here, the
/// table locked right after the insert, past the role's `lock_timeout`) must not leave some of
/// its jobs inserted behind an error, or a caller that retries duplicates them. One statement
/// either commits every row, with an exact result, or none.
async fn an_enqueue_that_fails_inserts_nothing<D: TestDriver>() {
    let db = TestDb::new().await;
    let admin = support::connect_default::<D>(&db).await;
    let held = admin
        .enqueue(NewJob::from_value(json!({})).unique_key("held"))
        .await
        .unwrap()
        .id;
    // The insert waits at a statement trigger on an advisory lock the test holds, so that the
    // test can queue a table lock behind it, to be granted the moment the insert commits.
    let role = format!("{}_enqueuer", db.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"CREATE ROLE "{role}" LOGIN;
           ALTER ROLE "{role}" SET lock_timeout = '1s';
           GRANT SELECT, INSERT, UPDATE ON queue_jobs TO "{role}";
           GRANT USAGE ON SEQUENCE queue_jobs_id_seq TO "{role}";
           CREATE FUNCTION hold_inserts() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$;
           CREATE TRIGGER hold_inserts BEFORE INSERT ON queue_jobs
               FOR EACH STATEMENT EXECUTE FUNCTION hold_inserts();"#
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let mut gate = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    let url = format!("postgres://{role}@127.0.0.1:{}/{}", server_port(), db.name);
    let config = PgQueueConfig {
        listen: false,
        ..PgQueueConfig::default()
    };
    let queue = D::connect(&url, D::pool(&url, 2), config)
        .await
        .expect("the role connects");
    let enqueue = tokio::spawn(async move {
        let jobs = vec![
            NewJob::from_value(json!({ "n": 1 })),
            NewJob::from_value(json!({ "n": 2 })).unique_key("held"),
        ];
        queue.enqueue_many(jobs).await
    });
    let waiting = |kind: &'static str| {
        let pool = db.pool.clone();
        async move {
            let query = "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = $1";
            while sqlx::query_scalar::<_, i64>(query)
                .bind(kind)
                .fetch_one(&pool)
                .await
                .unwrap()
                == 0
            {
                tokio::task::yield_now().await;
            }
        }
    };
    waiting("advisory").await;
    let mut locker = db.pool.begin().await.unwrap();
    let lock = tokio::spawn(async move {
        sqlx::query("LOCK TABLE queue_jobs IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *locker)
            .await
            .unwrap();
        locker
    });
    waiting("relation").await;
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    let result = enqueue.await.unwrap();
    lock.await.unwrap().rollback().await.unwrap();
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    match result {
        Err(err) => assert_eq!(
            total, 1,
            "a failed enqueue inserted some of its jobs: {err}"
        ),
        Ok(enqueued) => {
            assert_eq!(total, 2, "{enqueued:?}");
            assert!(!enqueued[0].duplicate);
            assert_eq!((enqueued[1].id, enqueued[1].duplicate), (held, true));
        }
    }
    drop(gate);
    db.drop_db().await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"DROP ROLE IF EXISTS "{role}""#
    )))
    .execute(&admin_pool().await)
    .await;
}

/// A server error says what the server said (both drivers), with its SQLSTATE, and not the
/// detail that quotes row values (here the duplicate key's value).
async fn a_database_error_names_the_servers_message_but_no_row_values<D: TestDriver>() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<D>(&db).await;
    let err = queue
        .query("SELECT 1 / 0", ())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("division by zero"), "{err}");
    sqlx::raw_sql(
        "CREATE TABLE secrets (value text PRIMARY KEY); INSERT INTO secrets VALUES ('s3cr3t')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let err = queue
        .query("INSERT INTO secrets VALUES ($1)", ("s3cr3t",))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("duplicate key"), "{err}");
    assert!(!err.contains("s3cr3t"), "{err}");
    db.drop_db().await;
}

/// The port of the test server (from `QUEUE_TEST_PG_URL`).
fn server_port() -> u16 {
    let url = queue_postgres::testing::server_url();
    url.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432)
}

/// A connection pool on the server's `postgres` database, for cluster-wide cleanup.
async fn admin_pool() -> sqlx::PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!(
            "{}/postgres",
            queue_postgres::testing::server_url()
        ))
        .await
        .unwrap()
}

/// What a scheduler child process prints to report (libtest's own lines are told apart).
const CHILD_LINE: &str = "scheduler-child:";

/// One scheduler child of `three_scheduler_processes_enqueue_each_period_once`: a process of
/// its own, on its own connections, its clock moved by its parent.
struct SchedulerChild {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl SchedulerChild {
    /// The child and its first report, after a pass at `start`.
    fn spawn(db: &TestDb, start: &str) -> (SchedulerChild, (u64, u64)) {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "scheduler_process", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("QUEUE_SCHEDULER_DB", support::url(db))
            .env("QUEUE_SCHEDULER_START", start)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the test binary runs a child of itself");
        let stdin = child.stdin.take().unwrap();
        let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut child = SchedulerChild {
            child,
            stdin,
            lines,
        };
        let first = child.report();
        (child, first)
    }

    /// The child's next report: `(enqueued, duplicates)` so far, after a pass at its clock's
    /// time.
    fn report(&mut self) -> (u64, u64) {
        for line in self.lines.by_ref() {
            let line = line.expect("the child's stdout");
            // libtest may have begun the line with the test's name.
            if let Some((_, report)) = line.split_once(CHILD_LINE) {
                let mut numbers = report.split_whitespace().map(|n| n.parse::<u64>().unwrap());
                return (numbers.next().unwrap(), numbers.next().unwrap());
            }
        }
        panic!("the scheduler child exited without reporting");
    }

    fn advance(&mut self, secs: u64) -> (u64, u64) {
        use std::io::Write;
        writeln!(self.stdin, "advance {secs}").unwrap();
        self.stdin.flush().unwrap();
        self.report()
    }
}

/// Three scheduler processes on one database run one schedule through six periods, their
/// clocks moved by the test: one job per period, none missed; a process killed and started
/// again in the middle of a period enqueues nothing new.
#[test]
fn three_scheduler_processes_enqueue_each_period_once() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let mut children: Vec<SchedulerChild> = [
        "2026-01-01T00:00:30Z",
        "2026-01-01T00:00:32Z",
        "2026-01-01T00:00:27Z",
    ]
    .iter()
    .map(|start| SchedulerChild::spawn(&db, start).0)
    .collect();
    let mut reports = Vec::new();
    for _ in 1..=5 {
        reports = children.iter_mut().map(|c| c.advance(60)).collect();
    }
    let enqueued: u64 = reports.iter().map(|r| r.0).sum();
    let duplicates: u64 = reports.iter().map(|r| r.1).sum();
    assert_eq!((enqueued, duplicates), (6, 12), "{reports:?}");

    // Killed, then started again in the middle of the period of 00:05.
    let mut killed = children.remove(0);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    let (restarted, first) = SchedulerChild::spawn(&db, "2026-01-01T00:05:45Z");
    assert_eq!(first, (0, 1), "the period's job was there already");

    runtime.block_on(async {
        let queue = support::connect_default::<queue_postgres::Sqlx>(&db).await;
        assert_eq!(queue.counts().await.unwrap().pending, 6);
        let schedule = scheduler_schedule();
        for minute in 0..=5 {
            let period: chrono::DateTime<chrono::Utc> =
                format!("2026-01-01T00:0{minute}:00Z").parse().unwrap();
            let job = queue_core::Admin::find_by_unique_key(&queue, &schedule.unique_key(period))
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("no job for the period {period}"));
            assert_eq!(job.next_attempt_at, period);
        }
        db.drop_db().await;
    });
    for mut child in children.into_iter().chain([restarted]) {
        child.child.kill().unwrap();
        child.child.wait().unwrap();
    }
}

fn scheduler_schedule() -> queue_core::schedule::Schedule {
    queue_core::schedule::Schedule::every("rates", Duration::from_secs(60)).unwrap()
}

/// The child process of `three_scheduler_processes_enqueue_each_period_once` (run by it, with
/// its database and start time in the environment): a scheduler on a clock that stands still
/// until a line `advance <seconds>` on stdin moves it; after each pass it prints what it has
/// enqueued and found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of three_scheduler_processes_enqueue_each_period_once"]
async fn scheduler_process() {
    use queue_core::schedule::{Clock, ManualClock, Scheduler};
    let url = std::env::var("QUEUE_SCHEDULER_DB")
        .expect("run by three_scheduler_processes_enqueue_each_period_once");
    let start: chrono::DateTime<chrono::Utc> = std::env::var("QUEUE_SCHEDULER_START")
        .unwrap()
        .parse()
        .unwrap();
    let pool = <queue_postgres::Sqlx as TestDriver>::pool(&url, 2);
    let queue = queue_postgres::PgQueue::connect(pool, PgQueueConfig::default())
        .await
        .unwrap();
    let clock = ManualClock::new(start);
    let scheduler = Scheduler::new(queue)
        .schedule(scheduler_schedule())
        .unwrap()
        .clock(clock.clone())
        .start()
        .unwrap();
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            if lines_tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    loop {
        // Bounded, so that a scheduler that stops passing ends the child and fails the parent.
        let stats = scheduler
            .wait_for_timeout(Duration::from_secs(30), |s| s.seen >= Some(clock.now()))
            .await
            .expect("a pass at the clock's time");
        let rates = &stats.schedules["rates"];
        println!("{CHILD_LINE} {} {}", rates.enqueued, rates.duplicates);
        let Some(line) = lines.recv().await else {
            break;
        };
        let secs: u64 = line.strip_prefix("advance ").unwrap().parse().unwrap();
        clock.advance(Duration::from_secs(secs));
    }
    scheduler.shutdown().await;
}

/// The queue's jobs in flight, sampled by the worker-process tests of limits.
const IN_FLIGHT: &str = "SELECT count(*) FROM queue_jobs WHERE status = 'in_flight'";

/// The most jobs in flight of any one partition, sampled by the worker-process tests of limits.
const MOST_IN_FLIGHT_OF_A_PARTITION: &str = "SELECT COALESCE(max(n), 0) FROM (
     SELECT count(*) AS n FROM queue_jobs
     WHERE status = 'in_flight' AND partition_key IS NOT NULL
     GROUP BY partition_key) AS per_partition";

/// Three worker processes of eight slots each on a queue limited to three jobs in flight:
/// sampled from the database while they run, never more than three are in flight, the limit
/// is reached (it binds), and every job completes.
#[test]
fn worker_processes_never_exceed_the_queue_limit() {
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(3),
        ..queue_core::QueueLimits::NONE
    };
    let jobs = (0..90).map(|n| NewJob::from_value(json!({ "n": n })));
    let most = run_limited_workers(limits, jobs.collect(), IN_FLIGHT, 3, Hold::UntilTheLimit);
    assert_eq!(most, 3, "the limit bound: three ran at once at some point");
}

/// Six worker processes of twenty-four slots each, claiming at most five jobs at a time (each
/// job 50 ms of work), on a
/// queue limited to forty jobs in flight: while twenty or fewer are in flight their claims do
/// not wait for the queue's row (`claim_ahead.sql`: the room leaves space for four such
/// claims) and check the limit only as they end, racing one another (six claims of five could
/// pass it); past that they claim under the lock. Sampled from the database while they run, never more than forty are in
/// flight, the limit binds, and every job completes.
#[test]
fn worker_processes_claiming_ahead_never_exceed_the_queue_limit() {
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(40),
        ..queue_core::QueueLimits::NONE
    };
    let jobs = (0..1500).map(|n| NewJob::from_value(json!({ "n": n })));
    let most = run_limited_workers_of(
        limits,
        jobs.collect(),
        IN_FLIGHT,
        40,
        (6, 24, 5, 50),
        Hold::UntilTheLimit,
    );
    assert_eq!(most, 40, "the limit bound: forty ran at once at some point");
}

/// Six worker processes of twenty-four slots each, claiming at most five jobs at a time (each
/// job 300 ms of work), on a queue of two partitions (300 jobs each, due in turns) limited to
/// thirty jobs in flight per partition: the queue's jobs in flight, all partitions together,
/// are soon past thirty, and while a partition's jobs in flight and a claim's picks of it leave
/// room for four more such claims its claims do not wait for the queue's row
/// (`claim_ahead.sql`) and check the limit only as they end, by the jobs each claim put in
/// flight per slot of partition keys meanwhile, racing one another; past that they claim under
/// the lock. Sampled from the database while they run, no partition ever has more than thirty
/// in flight, the limit binds, and every job completes.
#[test]
fn worker_processes_claiming_ahead_never_exceed_the_partition_limit() {
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(30),
        ..queue_core::QueueLimits::NONE
    };
    let jobs = (0..600)
        .map(|n| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{}", n % 2)));
    let most = run_limited_workers_of(
        limits,
        jobs.collect(),
        MOST_IN_FLIGHT_OF_A_PARTITION,
        30,
        (6, 24, 5, 300),
        Hold::UntilTheLimit,
    );
    assert_eq!(
        most, 30,
        "the limit bound: thirty of one partition ran at once"
    );
}

/// The queue's room grants switched on (as `set_room_grants` does, flipping `grants_counted`:
/// this release's write), for `run_limited_workers_after`'s setup.
const ROOM_GRANTS_ON: &str = "UPDATE queue_jobs_queues
     SET room_grants = true, claims = claims + 1, grants_counted = NOT grants_counted
     WHERE queue = 'default'";

/// How many grants were made (the grants' identity), for `run_limited_workers_after`'s last read.
const GRANTS_MADE: &str = "SELECT COALESCE(pg_sequence_last_value(
     pg_get_serial_sequence('queue_jobs_grants', 'grant_id')), 0)";

/// Six worker processes of twenty-four slots each, claiming at most five jobs at a time (each
/// job 50 ms of work), on a queue limited to forty jobs in flight whose room grants are on:
/// far from the limit the handles claim on grants (a quarter of the room left each, for 32
/// claims) without the queue's row, near it under the lock, which counts the room granted.
/// Sampled from the database while they run, never more than forty are in flight, the limit
/// binds, grants were made, and every job completes.
#[test]
fn worker_processes_on_grants_never_exceed_the_queue_limit() {
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(40),
        ..queue_core::QueueLimits::NONE
    };
    let jobs = (0..1500).map(|n| NewJob::from_value(json!({ "n": n })));
    let (most, grants) = run_limited_workers_after(
        Some((ROOM_GRANTS_ON, GRANTS_MADE)),
        limits,
        jobs.collect(),
        (IN_FLIGHT, 40),
        (6, 24, 5, 50),
        Hold::UntilTheLimit,
    );
    assert_eq!(most, 40, "the limit bound: forty ran at once at some point");
    assert!(grants > 0, "no grant was made");
}

/// The same under `max_per_partition = 64` on two partitions of 300 jobs (each 300 ms of
/// work): a grant lets each of its claims put at most its share of one partition in flight,
/// and the claims under the lock count that share against every partition. No partition ever
/// has more than 64 in flight, the limit binds, grants were made, and every job completes.
#[test]
fn worker_processes_on_grants_never_exceed_the_partition_limit() {
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(64),
        ..queue_core::QueueLimits::NONE
    };
    let jobs = (0..600)
        .map(|n| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{}", n % 2)));
    let (most, grants) = run_limited_workers_after(
        Some((ROOM_GRANTS_ON, GRANTS_MADE)),
        limits,
        jobs.collect(),
        (MOST_IN_FLIGHT_OF_A_PARTITION, 64),
        (6, 24, 5, 300),
        Hold::UntilTheLimit,
    );
    assert_eq!(most, 64, "the limit bound: 64 of one partition ran at once");
    assert!(grants > 0, "no grant was made");
}

/// The most jobs claimed within any second (less a millisecond: the rate's log keeps
/// milliseconds as floating point), read from `claimed_at`, each job claimed once.
const MOST_CLAIMS_IN_A_SECOND: &str = "SELECT COALESCE(max(n), 0) FROM (
     SELECT count(*) OVER (ORDER BY claimed_at
                           RANGE BETWEEN interval '999 milliseconds' PRECEDING
                           AND CURRENT ROW) AS n
     FROM queue_jobs
     WHERE claimed_at IS NOT NULL) AS per_window";

/// Six worker processes of twenty-four slots each, claiming at most five jobs at a time (each
/// job 5 ms of work), on a queue allowed a hundred starts a second whose room grants are on:
/// far from the rate the handles claim on grants (each a quarter of the starts the rate's log
/// leaves, logged in it as all started at the grant's expiry, a second on), near it under the
/// lock, which counts those entries. A claim on a grant stamps `claimed_at` between the grant
/// and its expiry, a claim under the lock at the instant its rate counts. Read from the table
/// all along, the claims never number more than a hundred within a second, grants were made,
/// and the rate binds (four hundred starts take more than three seconds).
#[test]
fn worker_processes_on_grants_never_exceed_the_queue_rate() {
    let limits = queue_core::QueueLimits {
        rate: Some(queue_core::RateLimit::new(100, Duration::from_secs(1)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    let jobs = (0..400).map(|n| NewJob::from_value(json!({ "n": n })));
    let started = std::time::Instant::now();
    let (most, grants) = run_limited_workers_after(
        Some((ROOM_GRANTS_ON, GRANTS_MADE)),
        limits,
        jobs.collect(),
        (MOST_CLAIMS_IN_A_SECOND, 100),
        (6, 24, 5, 5),
        Hold::No,
    );
    assert!(most >= 1, "the sampler saw claims");
    assert!(grants > 0, "no grant was made");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "the rate bound: four hundred starts at a hundred a second take more than three windows"
    );
}

/// Six worker processes of eight slots each, claiming at most eight jobs at a time (each job
/// 5 ms of work), on 48 partitions of ten jobs (due in turns), each partition allowed eight
/// starts in any two seconds, room grants on: far from the rate the handles claim on grants
/// (charged whole to the queue's tally, one job of a slot of partition keys a claim), near it
/// under the lock, which counts the grants' charges, and per partition the claims on grants
/// and what the live grants may still start. Read from the table all along (`claimed_at`: a
/// claim on a grant starts its jobs within the window its grant is charged to), no partition
/// ever has more than eight claims within two seconds, grants were made, and the rate binds
/// (ten starts of a partition take more than a window).
#[test]
fn worker_processes_on_grants_never_exceed_the_partition_rate() {
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(8, Duration::from_secs(2)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    let jobs: Vec<NewJob> = (0..10)
        .flat_map(|n| {
            (0..48)
                .map(move |p| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{p}")))
        })
        .collect();
    let started = std::time::Instant::now();
    let (most, grants) = run_limited_workers_after(
        Some((ROOM_GRANTS_ON, GRANTS_MADE)),
        limits,
        jobs,
        (MOST_CLAIMS_OF_A_PARTITION_IN_TWO_SECONDS, 8),
        (6, 8, 8, 5),
        Hold::No,
    );
    assert!(
        (1..=8).contains(&most),
        "at most eight of a partition in two seconds: {most}"
    );
    assert!(grants > 0, "no grant was made");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "ten starts of a partition at eight per two seconds take more than a window"
    );
}

/// A worker process that holds room granted to it is killed (SIGKILL: nothing returns its
/// grant). Its grant still counts against the limit, expired or not, until a grant statement
/// of another handle deletes it once it expired (its expiry passed here by the database's
/// clock moved for its row, not by waiting); then only the new grant counts.
#[test]
fn a_killed_workers_grant_comes_back() {
    use queue_core::Admin;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(60),
        ..queue_core::QueueLimits::NONE
    };
    let queue = runtime.block_on(async {
        let queue = support::connect_default::<queue_postgres::Sqlx>(&db).await;
        queue
            .enqueue_many(
                (0..100)
                    .map(|n| NewJob::from_value(json!({ "n": n })))
                    .collect(),
            )
            .await
            .unwrap();
        queue.set_limits(limits).await.unwrap();
        assert!(queue.set_room_grants(true).await.unwrap());
        queue
    });
    // Four slots, claims of five, each job held until the end of the test.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "limited_worker_process", "--ignored"])
        .args(["--nocapture", "--test-threads", "1"])
        .env("QUEUE_LIMITED_DB", support::url(&db))
        .env("QUEUE_LIMITED_WORKER", "4 5 0 1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("the test binary runs a child of itself");
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let childs: Vec<i64> = runtime.block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while in_flight(&db).await < 4 {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never claimed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sqlx::query_scalar("SELECT grant_id FROM queue_jobs_grants")
            .fetch_all(&db.pool)
            .await
            .unwrap()
    });
    assert_eq!(childs.len(), 1, "the child claimed on a grant");
    child.kill().unwrap();
    child.wait().unwrap();
    runtime.block_on(async {
        // A quarter of 60 for claims of five: 15, four of them spent.
        let left = count("SELECT sum(jobs_left)::bigint FROM queue_jobs_grants").await;
        assert_eq!(left, 11);
        sqlx::query("UPDATE queue_jobs_grants SET expires_at = now() - interval '1 second'")
            .execute(&db.pool)
            .await
            .unwrap();
        // This handle's claim asks for a grant: the statement deletes the expired one, whose
        // eleven come back at once ((60 - 4) / 4 = 14).
        assert_eq!(queue.claim(req(5)).await.unwrap().jobs.len(), 5);
        let grants: Vec<(i64, i64)> =
            sqlx::query_as("SELECT grant_id, jobs_left FROM queue_jobs_grants")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(grants.len(), 1, "{grants:?}");
        assert!(
            !childs.contains(&grants[0].0),
            "the killed worker's grant is gone"
        );
        assert_eq!(grants[0].1, 14 - 5);
        db.drop_db().await;
    });
}

/// Three worker processes of eight slots each on a queue of six partitions (twenty jobs each)
/// and ten jobs without one, limited to two jobs in flight per partition: sampled from the
/// database while they run, no partition ever has more than two in flight, the limit binds,
/// and every job completes.
#[test]
fn worker_processes_never_exceed_the_partition_limit() {
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(2),
        ..queue_core::QueueLimits::NONE
    };
    let mut jobs: Vec<NewJob> = (0..6)
        .flat_map(|p| {
            (0..20)
                .map(move |n| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{p}")))
        })
        .collect();
    jobs.extend((0..10).map(|n| NewJob::from_value(json!({ "loose": n }))));
    let most = run_limited_workers(
        limits,
        jobs,
        MOST_IN_FLIGHT_OF_A_PARTITION,
        2,
        Hold::UntilTheLimit,
    );
    assert_eq!(
        most, 2,
        "the limit bound: two of one partition ran at once at some point"
    );
}

/// The most claims of one partition within any two seconds (less a millisecond: the rate's log
/// keeps milliseconds as floating point), read from the table by `claimed_at` (each job
/// claimed once).
const MOST_CLAIMS_OF_A_PARTITION_IN_TWO_SECONDS: &str = "SELECT COALESCE(max(n), 0) FROM (
     SELECT count(*) OVER (PARTITION BY partition_key ORDER BY claimed_at
                           RANGE BETWEEN interval '1999 milliseconds' PRECEDING
                           AND CURRENT ROW) AS n
     FROM queue_jobs
     WHERE partition_key IS NOT NULL AND claimed_at IS NOT NULL) AS per_window";

/// Three worker processes of eight slots each on a queue of four partitions (six jobs each) and
/// six jobs without one, each partition allowed two claims in any two seconds: every
/// partition's claims, read from the table all along (`claimed_at`, each job claimed once),
/// never number more than two within any two seconds (less a millisecond: the rate's log keeps
/// milliseconds as floating point), and the rate binds (six jobs of a partition take at least
/// two windows to start). A limited claim under the queue's lock stamps `claimed_at` with the
/// instant its limits count by (after the lock), so the table shows each claim where the rate
/// placed it; at two starts a window, below the claims ahead's margin of four claims, no claim
/// goes ahead of the lock (a claim ahead's `claimed_at` precedes the instant it is counted by).
#[test]
fn worker_processes_never_exceed_the_partition_rate() {
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(2, Duration::from_secs(2)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    let mut jobs: Vec<NewJob> = (0..6)
        .map(|n| NewJob::from_value(json!({ "loose": n })))
        .collect();
    jobs.extend((0..4).flat_map(|p| {
        (0..6).map(move |n| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{p}")))
    }));
    let started = std::time::Instant::now();
    let most = run_limited_workers(
        limits,
        jobs,
        MOST_CLAIMS_OF_A_PARTITION_IN_TWO_SECONDS,
        2,
        Hold::No,
    );
    assert!(most >= 1, "the sampler saw claims");
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "the rate bound: six starts of a partition at two per two seconds take two windows"
    );
}

/// The same with a rate the first claims cannot reach (sixteen claims of a partition in any
/// two seconds, two partitions of forty jobs, each worker asking for at most eight): the queue's
/// first claims count no partition (its tally leaves room for them), the later ones fold those
/// into the partitions' logs and count per partition, all across three processes; no
/// partition ever has more than sixteen claims within two seconds, and the rate binds.
#[test]
fn worker_processes_never_exceed_the_partition_rate_from_far_under_it() {
    let jobs: Vec<NewJob> = (0..2)
        .flat_map(|p| {
            (0..40)
                .map(move |n| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{p}")))
        })
        .collect();
    the_partition_rate_binds_across_processes(16, jobs);
}

/// The same across many partitions (forty-eight of ten jobs, four claims of a partition in any
/// two seconds): after the first claims the queue's sum is over the rate, and its tally per
/// slot of partition keys lets claims skip the count per partition until a partition's slot
/// nears the rate; no partition ever has more than four claims within two seconds, and the rate
/// binds (ten starts of a partition take three windows).
#[test]
fn worker_processes_never_exceed_the_partition_rate_across_many_partitions() {
    // Due in turns (every partition's first job, then every partition's second): the picks
    // spread over the partitions, as the slots are for (a partition at its rate holding the
    // earliest jobs would make every claim count per partition).
    let jobs: Vec<NewJob> = (0..10)
        .flat_map(|n| {
            (0..48)
                .map(move |p| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{p}")))
        })
        .collect();
    the_partition_rate_binds_across_processes(4, jobs);
}

/// Records, for a test, the instant the rates count each claim of partitioned jobs at: each job
/// claimed (or taken over), with the claim's transaction and statement, and each write of the
/// queue's row, with the tally's `at` it leaves (a claim's jobs and its count of them are one
/// statement). A claim that fails is undone, its records too.
const AUDIT_COUNTED_STARTS: &str = "
    CREATE TABLE audit_jobs (tx bigint, stmt timestamptz, partition_key text, claimed_at timestamptz);
    CREATE TABLE audit_counts (tx bigint, stmt timestamptz, at float8);
    CREATE FUNCTION audit_job() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
        INSERT INTO audit_jobs VALUES (txid_current(), statement_timestamp(), NEW.partition_key,
                                       NEW.claimed_at);
        RETURN NULL; END $$;
    CREATE TRIGGER audit_job AFTER UPDATE ON queue_jobs FOR EACH ROW
        WHEN (NEW.status = 'in_flight' AND NEW.claim_generation <> OLD.claim_generation
              AND NEW.partition_key IS NOT NULL)
        EXECUTE FUNCTION audit_job();
    CREATE FUNCTION audit_count() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
        INSERT INTO audit_counts VALUES (txid_current(), statement_timestamp(),
                                         (NEW.partition_tally ->> 'at')::float8);
        RETURN NULL; END $$;
    CREATE TRIGGER audit_count AFTER UPDATE ON queue_jobs_queues FOR EACH ROW
        EXECUTE FUNCTION audit_count();";

/// The most starts of one partition within any two seconds (less a millisecond) by the
/// instants the rates counted them at (`AUDIT_COUNTED_STARTS`).
const MOST_COUNTED_STARTS_OF_A_PARTITION_IN_TWO_SECONDS: &str = "SELECT COALESCE(max(n), 0) FROM (
     SELECT count(*) OVER (PARTITION BY j.partition_key ORDER BY c.at
                           RANGE BETWEEN 1999 PRECEDING AND CURRENT ROW) AS n
     FROM audit_jobs AS j JOIN audit_counts AS c USING (tx, stmt)) AS per_window";

/// The claims of partitioned jobs that went ahead of the queue's lock: counted by the rates
/// after their jobs' `claimed_at` (a claim under the lock stamps the instant it counts by).
const CLAIMS_COUNTED_AFTER_THEIR_CLAIMED_AT: &str = "SELECT count(DISTINCT (tx, stmt))
     FROM audit_jobs AS j JOIN audit_counts AS c USING (tx, stmt)
     WHERE c.at > extract(epoch FROM j.claimed_at)::float8 * 1000 + 0.5";

/// Three worker processes of four slots each, claiming at most four jobs at a time, on sixteen
/// partitions of twenty jobs each (due in turns), each partition allowed eight starts in any two
/// seconds: while a partition's slot of the tally leaves room for four claims like one, claims
/// of it go ahead of the queue's row lock, nearer the rate they take the lock. Read by the
/// instants the rates count each claim at (a claim ahead's `claimed_at` is earlier), no
/// partition ever has more than eight starts within two seconds, the rate binds, and claims
/// went ahead.
#[test]
fn worker_processes_claiming_ahead_never_exceed_the_partition_rate() {
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(8, Duration::from_secs(2)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    let jobs: Vec<NewJob> = (0..20)
        .flat_map(|n| {
            (0..16)
                .map(move |p| NewJob::from_value(json!({ "n": n })).partition_key(format!("p{p}")))
        })
        .collect();
    let started = std::time::Instant::now();
    let (most, ahead) = run_limited_workers_after(
        Some((AUDIT_COUNTED_STARTS, CLAIMS_COUNTED_AFTER_THEIR_CLAIMED_AT)),
        limits,
        jobs,
        (MOST_COUNTED_STARTS_OF_A_PARTITION_IN_TWO_SECONDS, 8),
        (3, 4, 4, 5),
        Hold::No,
    );
    assert_eq!(most, 8, "a partition made all its starts of a window");
    assert!(ahead > 0, "no claim went ahead of the queue's lock");
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "twenty starts of a partition at eight per two seconds take more than two windows"
    );
}

/// Runs `jobs` (more than twice `starts` of each partition) through three worker processes
/// under a rate of `starts` claims of a partition in any two seconds: no partition ever has
/// more, one has that many (the sampler saw a whole window's starts), and the drain takes at
/// least two windows.
fn the_partition_rate_binds_across_processes(starts: u32, jobs: Vec<NewJob>) {
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(
            queue_core::RateLimit::new(starts, Duration::from_secs(2)).unwrap(),
        ),
        ..queue_core::QueueLimits::NONE
    };
    let started = std::time::Instant::now();
    let most = run_limited_workers(
        limits,
        jobs,
        MOST_CLAIMS_OF_A_PARTITION_IN_TWO_SECONDS,
        i64::from(starts),
        Hold::No,
    );
    assert_eq!(
        most,
        i64::from(starts),
        "a partition made all its starts of a window"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "the rate bound: a partition's jobs at {starts} per two seconds take more than two windows"
    );
}

/// Sets `limits` on a fresh database's default queue, enqueues `jobs`, and runs three worker
/// processes of eight slots each (`limited_worker_process`) until every job completed, sampling
/// `sample` (one number, which must stay within `limit`: the caller asserts on the largest)
/// every 2 ms meanwhile, holding the jobs until it reaches `limit` first if `hold` says so.
/// Returns the largest sample.
fn run_limited_workers(
    limits: queue_core::QueueLimits,
    jobs: Vec<NewJob>,
    sample: &'static str,
    limit: i64,
    hold: Hold,
) -> i64 {
    run_limited_workers_of(limits, jobs, sample, limit, (3, 8, 100, 5), hold)
}

/// [`run_limited_workers`] with `processes` workers of `(concurrency, max_batch)`, whose jobs
/// each take `work_ms`.
fn run_limited_workers_of(
    limits: queue_core::QueueLimits,
    jobs: Vec<NewJob>,
    sample: &'static str,
    limit: i64,
    shape: (usize, usize, u32, u64),
    hold: Hold,
) -> i64 {
    run_limited_workers_after(None, limits, jobs, (sample, limit), shape, hold).0
}

/// Whether the worker processes of [`run_limited_workers_after`] hold every job, its work done,
/// until the sampler has seen the limit reached. A limit in flight binds only while the
/// workers refill faster than their jobs end, which a loaded machine need not do; held jobs
/// do not end, so the claims must fill the limit (or the run fails), and the race goes on
/// once they are let go.
#[derive(Clone, Copy, PartialEq)]
enum Hold {
    UntilTheLimit,
    No,
}

/// [`run_limited_workers_of`] with `setup` (SQL) run on the database before the workers start,
/// and `last` (one number) read once every job completed: returns the largest sample and it.
fn run_limited_workers_after(
    setup: Option<(&'static str, &'static str)>,
    limits: queue_core::QueueLimits,
    jobs: Vec<NewJob>,
    (sample, limit): (&'static str, i64),
    (processes, concurrency, max_batch, work_ms): (usize, usize, u32, u64),
    hold: Hold,
) -> (i64, i64) {
    use queue_core::Admin;
    let total = jobs.len() as i64;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    runtime.block_on(async {
        let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
        queue.set_limits(limits).await.unwrap();
        queue.enqueue_many(jobs).await.unwrap();
        if let Some((sql, _)) = setup {
            sqlx::raw_sql(sql).execute(&db.pool).await.unwrap();
        }
    });
    /// The worker processes, killed when the test ends, by a failed assertion too.
    struct Children(Vec<std::process::Child>);
    impl Drop for Children {
        fn drop(&mut self) {
            for child in &mut self.0 {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
    let mut children = Children(
        (0..processes)
            .map(|_| {
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "limited_worker_process", "--ignored"])
                    .args(["--nocapture", "--test-threads", "1"])
                    .env("QUEUE_LIMITED_DB", support::url(&db))
                    .env(
                        "QUEUE_LIMITED_WORKER",
                        format!(
                            "{concurrency} {max_batch} {work_ms} {}",
                            u8::from(hold == Hold::UntilTheLimit)
                        ),
                    )
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("the test binary runs a child of itself")
            })
            .collect(),
    );
    let most = runtime.block_on(async {
        let read = || async {
            let seen: i64 = sqlx::query_scalar(sample)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            assert!(seen <= limit, "{seen} in flight, over the limit of {limit}");
            seen
        };
        if hold == Hold::UntilTheLimit {
            let reached = async {
                let mut tick = tokio::time::interval(Duration::from_millis(2));
                while read().await < limit {
                    tick.tick().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(60), reached)
                .await
                .expect("the limit binds: with every job held, the claims fill it");
            for child in &mut children.0 {
                use std::io::Write;
                let stdin = child.stdin.as_mut().unwrap();
                stdin.write_all(b"open\n").unwrap();
            }
        }
        let sample = async {
            let mut most = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            loop {
                tick.tick().await;
                most = most.max(read().await);
                let completed: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM queue_jobs WHERE status = 'completed'",
                )
                .fetch_one(&db.pool)
                .await
                .unwrap();
                if completed == total {
                    return most;
                }
            }
        };
        let most = tokio::time::timeout(Duration::from_secs(120), sample)
            .await
            .expect("the workers finish the jobs");
        if hold == Hold::UntilTheLimit {
            limit
        } else {
            most
        }
    });
    drop(children);
    let last = match setup {
        Some((_, last)) => runtime.block_on(async {
            sqlx::query_scalar::<_, i64>(last)
                .fetch_one(&db.pool)
                .await
                .unwrap()
        }),
        None => 0,
    };
    runtime.block_on(db.drop_db());
    (most, last)
}

/// A child process of `run_limited_workers`: a worker of the slots and claims its parent asks
/// for, whose jobs each take the milliseconds it says (the work) and, when it says so, are
/// then held until a line `open` on stdin, until its parent kills it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of run_limited_workers"]
async fn limited_worker_process() {
    struct Work(Duration, tokio::sync::watch::Receiver<bool>);
    impl Handler for Work {
        type Payload = Value;
        async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
            tokio::time::sleep(self.0).await;
            self.1.clone().wait_for(|open| *open).await.unwrap();
            Ok(())
        }
    }
    let url = std::env::var("QUEUE_LIMITED_DB").expect("run by run_limited_workers");
    let pool = <queue_postgres::Sqlx as TestDriver>::pool(&url, 4);
    let queue = queue_postgres::PgQueue::connect(pool, PgQueueConfig::default())
        .await
        .unwrap();
    let shape = std::env::var("QUEUE_LIMITED_WORKER").expect("run by run_limited_workers");
    let shape: Vec<u64> = shape.split(' ').map(|n| n.parse().unwrap()).collect();
    let config = WorkerConfig {
        concurrency: shape[0] as usize,
        max_batch: shape[1] as u32,
        poll_interval: Duration::from_millis(10),
        ..WorkerConfig::default()
    };
    let (open, gate) = tokio::sync::watch::channel(shape[3] == 0);
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            if line.unwrap() == "open" {
                open.send_replace(true);
            }
        }
        // Stdin closed: keep the sender, so that a gate never opened holds its jobs still.
        loop {
            std::thread::park();
        }
    });
    let work = Work(Duration::from_millis(shape[2]), gate);
    let worker = Worker::new(queue, work, config).unwrap().start();
    worker.wait_for(|_| false).await;
}

/// Enqueues a job of partition `key` named `name` (one statement each: due times in order).
async fn partitioned(queue: &queue_postgres::PgQueue, name: &str, key: &str, unique: bool) {
    let mut job = NewJob::from_value(json!({ "name": name })).partition_key(key);
    if unique {
        job = job.unique_key(format!("k{key}"));
    }
    queue.enqueue(job).await.unwrap();
}

async fn claimed_names(queue: &queue_postgres::PgQueue, batch: u32) -> Vec<String> {
    let jobs = queue.claim(req(batch)).await.unwrap().jobs;
    jobs.iter()
        .map(|j| j.payload["name"].as_str().unwrap().to_owned())
        .collect()
}

/// While the queue's tally leaves room for a whole claim, a claim reads no partition's log and
/// writes one row of `queue_jobs_claim_starts`; the first claim that could bring a partition to
/// its rate folds those rows into the partitions' logs and counts per partition; removing the
/// rate forgets the tally and the rows. (Room grants off: the claims without grants.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_far_under_the_partition_rate_log_one_row_each_until_folded() {
    use queue_core::{Admin, QueueLimits, RateLimit};
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    for n in 0..6 {
        partitioned(&queue, &format!("a{n}"), "a", false).await;
    }
    partitioned(&queue, "b0", "b", false).await;
    let limits = QueueLimits {
        rate_per_partition: Some(RateLimit::new(4, Duration::from_secs(60)).unwrap()),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    let rows = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let unfolded = "SELECT count(*) FROM queue_jobs_claim_starts";
    let logged = "SELECT count(*) FROM queue_jobs_starts";
    // 0 + 2 and then 2 + 2 of the queue's starts within 4: no partition can reach 4.
    assert_eq!(claimed_names(&queue, 2).await, ["a0", "a1"]);
    assert_eq!((rows(unfolded).await, rows(logged).await), (1, 0));
    let (keys, jobs): (Vec<String>, Vec<i64>) =
        sqlx::query_as("SELECT keys, jobs FROM queue_jobs_claim_starts")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((keys, jobs), (vec!["a".to_owned()], vec![2]));
    assert_eq!(claimed_names(&queue, 2).await, ["a2", "a3"]);
    assert_eq!((rows(unfolded).await, rows(logged).await), (2, 0));
    // 4 + 1 could reach the rate: the claim folds, counts a's four starts, and passes a over.
    assert_eq!(claimed_names(&queue, 1).await, ["b0"]);
    assert_eq!((rows(unfolded).await, rows(logged).await), (0, 2));
    let a_starts: i64 = sqlx::query_scalar(
        "SELECT sum((e ->> 1)::bigint)::bigint FROM queue_jobs_starts,
                jsonb_array_elements(rate_log) AS e WHERE partition_key = 'a'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(a_starts, 4);
    assert!(
        claimed_names(&queue, 1).await.is_empty(),
        "a has no start left"
    );
    queue.set_limits(QueueLimits::NONE).await.unwrap();
    let tally: Option<Value> = sqlx::query_scalar("SELECT partition_tally FROM queue_jobs_queues")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(tally, None);
    assert_eq!((rows(unfolded).await, rows(logged).await), (0, 0));
}

/// A rate per partition set, and the statements' count of a tally's state, for the slot tests.
async fn rate_per_partition(queue: &queue_postgres::PgQueue, starts: u32) {
    use queue_core::{Admin, QueueLimits, RateLimit};
    let day = Duration::from_secs(86_400);
    let limits = QueueLimits {
        rate_per_partition: Some(RateLimit::new(starts, day).unwrap()),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
}

async fn count(pool: &sqlx::PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Takes the lease of the in-flight job named `name` back into the past, as if it had run out.
async fn expire_lease(pool: &sqlx::PgPool, name: &str) {
    let expired = sqlx::query(
        "UPDATE queue_jobs SET lease_expires_at = now() - interval '1 second'
         WHERE payload ->> 'name' = $1 AND status = 'in_flight'",
    )
    .bind(name)
    .execute(pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(expired, 1, "{name} in flight");
}

/// Many partitions far under their rate, although the queue's sum of starts is over it: the
/// tally per slot of partition keys bounds each partition by its slot, so every claim skips the
/// count per partition (one row of `queue_jobs_claim_starts` each, no partition's log read or
/// written, nothing folded). Claims of six jobs against five starts a partition: the queue's
/// sum never leaves room for one, so a tally of the sum alone counts per partition from the
/// first claim on. (Room grants off: the claims without grants.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_many_partitions_far_under_their_rate_count_by_slot() {
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    for n in 0..42 {
        partitioned(&queue, &format!("p{n}"), &format!("key-{n}"), false).await;
    }
    rate_per_partition(&queue, 5).await;
    for claim in 0..7 {
        let names: Vec<String> = (0..6).map(|n| format!("p{}", claim * 6 + n)).collect();
        assert_eq!(claimed_names(&queue, 6).await, names);
    }
    let unfolded = count(&db.pool, "SELECT count(*) FROM queue_jobs_claim_starts").await;
    let logged = count(&db.pool, "SELECT count(*) FROM queue_jobs_starts").await;
    assert_eq!((unfolded, logged), (7, 0), "no claim counted per partition");
    let (tally, slots): (Value, Vec<i32>) =
        sqlx::query_as("SELECT partition_tally, partition_slots FROM queue_jobs_queues")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let in_slots: i32 = slots.iter().sum();
    assert_eq!(
        (
            tally["jobs"].as_i64(),
            tally["slots_jobs"].as_i64(),
            slots.len(),
            in_slots
        ),
        (Some(42), Some(42), 512, 42),
        "{tally}"
    );
}

/// A takeover is a start its slot's count cannot foresee (the expired leases are not picked
/// when the claim decides): every slot is charged the queue's expired partitioned leases. `a`
/// may start twice; each case ends with `a0`'s lease run out, and a claim that may take one
/// start of `a` at most, whether its pick shows `a`'s slot or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_counts_against_its_partitions_slot() {
    // a0 started once and a1 is due: the pick shows a1 and b0, and a's slot holds one start,
    // so a1 alone would fit; the takeover of a0 makes it two.
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    for (name, key) in [("a0", "a"), ("a1", "a"), ("b0", "b")] {
        partitioned(&queue, name, key, false).await;
    }
    rate_per_partition(&queue, 2).await;
    assert_eq!(claimed_names(&queue, 1).await, ["a0"]);
    expire_lease(&db.pool, "a0").await;
    assert_eq!(claimed_names(&queue, 2).await, ["a0", "b0"]);
    db.drop_db().await;
    // a0 started twice (a takeover), counted in a's slot (claims of three: the queue's sum
    // leaves no room for them); then c0 is due. The pick shows only c's slot, with room; the
    // takeover could still fall in a's, the fullest.
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    partitioned(&queue, "a0", "a", false).await;
    rate_per_partition(&queue, 2).await;
    assert_eq!(claimed_names(&queue, 3).await, ["a0"]);
    expire_lease(&db.pool, "a0").await;
    assert_eq!(
        claimed_names(&queue, 3).await,
        ["a0"],
        "taken over: a's second start"
    );
    partitioned(&queue, "c0", "c", false).await;
    expire_lease(&db.pool, "a0").await;
    assert_eq!(claimed_names(&queue, 3).await, ["c0"]);
    db.drop_db().await;
}

/// Claims the slots did not count are charged to every slot: those the queue's sum left room
/// for (they skip the slots) and those of a release without slots, which count a claim in the
/// tally's jobs but not in its slots (its fast claims log a row of `queue_jobs_claim_starts`
/// too): set here as such a claim of two of `a`'s jobs leaves them. By its slot `a` has one
/// start and room for `a1`; it has three, and the claim counts per partition and passes it
/// over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_the_slots_did_not_count_are_charged_to_every_slot() {
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    for (name, key) in [("a0", "a"), ("a1", "a"), ("b0", "b")] {
        partitioned(&queue, name, key, false).await;
    }
    rate_per_partition(&queue, 3).await;
    // The sum leaves room for a claim of one (0 + 1 <= 3): a0 is not counted in the slots.
    assert_eq!(claimed_names(&queue, 1).await, ["a0"]);
    sqlx::query(
        "WITH logged AS (
             INSERT INTO queue_jobs_claim_starts (queue, claim, at_ms, keys, jobs)
             SELECT 'default', claims + 1,
                    extract(epoch FROM clock_timestamp())::float8 * 1000, '{a}', '{2}'
             FROM queue_jobs_queues)
         UPDATE queue_jobs_queues SET claims = claims + 1,
             partition_tally = partition_tally || jsonb_build_object(
                 'jobs', (partition_tally ->> 'jobs')::bigint + 2)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(claimed_names(&queue, 2).await, ["b0"]);
    let (tally, slots): (Value, Vec<i32>) =
        sqlx::query_as("SELECT partition_tally, partition_slots FROM queue_jobs_queues")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    // The last claim, not left room by the sum, counted in the slots.
    let in_slots: i32 = slots.iter().sum();
    assert_eq!(
        (
            tally["jobs"].as_i64(),
            tally["slots_jobs"].as_i64(),
            in_slots
        ),
        (Some(4), Some(1), 1),
        "{tally}"
    );
}

/// Slot counts the claim cannot trust (the column NULL or cut short, the tally's stamp of
/// their window gone, or more jobs counted in them than the tally has: a hand edit or a
/// damaged row) are not read: the claim counts per partition. `a` made its two starts in one
/// claim, counted in its slot; each damage also zeroes the counts, so a claim that trusted
/// them would start `a` a third time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_counts_it_cannot_trust_leave_the_claim_counting_per_partition() {
    for damage in [
        "UPDATE queue_jobs_queues SET partition_slots = NULL",
        "UPDATE queue_jobs_queues SET partition_slots = array_fill(0, ARRAY[511])",
        "UPDATE queue_jobs_queues SET partition_slots = array_fill(0, ARRAY[512]),
             partition_tally = partition_tally - 'slots_at'",
        "UPDATE queue_jobs_queues SET partition_slots = array_fill(0, ARRAY[512]),
             partition_tally = partition_tally || '{\"slots_jobs\": 99}'",
    ] {
        let db = TestDb::new().await;
        let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
        for name in ["a0", "a1"] {
            partitioned(&queue, name, "a", false).await;
        }
        rate_per_partition(&queue, 2).await;
        // A claim of three: the queue's sum leaves no room, so a's jobs count in its slot.
        assert_eq!(claimed_names(&queue, 3).await, ["a0", "a1"], "{damage}");
        partitioned(&queue, "a2", "a", false).await;
        partitioned(&queue, "b0", "b", false).await;
        sqlx::query(damage).execute(&db.pool).await.unwrap();
        assert_eq!(claimed_names(&queue, 3).await, ["b0"], "{damage}");
        db.drop_db().await;
    }
}

/// A claim under `max_per_partition` counts by key only once its picks and the queue's jobs in
/// flight, all keys together, could pass the limit: up to it exactly they cannot, one past it
/// they are counted. `a` gets to four in flight in claims of two, never five; with `b` at its
/// limit, `a`'s three picks are cut to its two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partition_limit_is_counted_by_key_once_the_queue_could_pass_it() {
    use queue_core::{Admin, QueueLimits};
    let per_partition = |n| QueueLimits {
        max_per_partition: Some(n),
        ..QueueLimits::NONE
    };
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    for n in 0..6 {
        partitioned(&queue, &format!("a{n}"), "a", false).await;
    }
    queue.set_limits(per_partition(4)).await.unwrap();
    assert_eq!(claimed_names(&queue, 2).await, ["a0", "a1"]);
    assert_eq!(
        claimed_names(&queue, 2).await,
        ["a2", "a3"],
        "four in all: at the limit"
    );
    assert!(
        claimed_names(&queue, 2).await.is_empty(),
        "a fifth would pass it"
    );
    db.drop_db().await;

    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    for name in ["b0", "b1"] {
        partitioned(&queue, name, "b", false).await;
    }
    queue.set_limits(per_partition(2)).await.unwrap();
    assert_eq!(claimed_names(&queue, 2).await, ["b0", "b1"]);
    for name in ["a0", "a1", "a2"] {
        partitioned(&queue, name, "a", false).await;
    }
    assert_eq!(claimed_names(&queue, 3).await, ["a0", "a1"]);
    assert!(claimed_names(&queue, 3).await.is_empty());
    db.drop_db().await;
}

/// The tally counts the window before the current one while it still overlaps the sliding
/// window: a partition's starts of the previous fixed window, within the rate's length, keep the
/// next claim counting per partition (set here as a store would have left them: `a`'s five
/// starts of a second ago, tallied in the previous window, or split between it and the current
/// one; windows of a day, so that none ends during the test). A tally that forgot either window
/// would let the claim skip the count and start `a` a sixth time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_windows_claims_keep_a_partition_counted() {
    use queue_core::{Admin, QueueLimits, RateLimit};
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    let day = Duration::from_secs(86_400);
    let limits = QueueLimits {
        rate_per_partition: Some(RateLimit::new(5, day).unwrap()),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    // (the tally's window relative to now, its jobs, those of the window before)
    for (back, jobs, before) in [(1_i64, 5_i64, 0_i64), (0, 1, 4)] {
        sqlx::query("DELETE FROM queue_jobs")
            .execute(&db.pool)
            .await
            .unwrap();
        for n in 0..3 {
            partitioned(&queue, &format!("a{n}"), "a", false).await;
        }
        partitioned(&queue, "b0", "b", false).await;
        sqlx::query(
            "WITH t AS (SELECT extract(epoch FROM clock_timestamp())::float8 * 1000 AS ms)
             , s AS (
                 INSERT INTO queue_jobs_starts (queue, partition_key, rate_log, last_at)
                 SELECT 'default', 'a', jsonb_build_array(jsonb_build_array(t.ms - 1000, 5)), now()
                 FROM t
                 ON CONFLICT (queue, partition_key) DO UPDATE SET rate_log = EXCLUDED.rate_log)
             UPDATE queue_jobs_queues SET partition_tally = jsonb_build_object(
                 'per_ms', 86400000, 'since', 0,
                 'bucket', (SELECT floor(t.ms / 86400000)::bigint FROM t) - $1,
                 'jobs', $2, 'before', $3)",
        )
        .bind(back)
        .bind(jobs)
        .bind(before)
        .execute(&db.pool)
        .await
        .unwrap();
        // a made its five starts of the day: passed over, however the tally was split.
        assert_eq!(claimed_names(&queue, 1).await, ["b0"], "window {back} back");
        assert!(
            claimed_names(&queue, 1).await.is_empty(),
            "window {back} back"
        );
    }
}

/// A database clock that steps back (a failover to a server whose clock lags, an NTP step)
/// forgets no claim: while it is behind, the claims count per partition and are tallied in the
/// tally's own window, so once it is put right the claims from before the step still count.
/// Set here as a store would have left things before a step back of two days (`a`'s five
/// starts of the day, and the tally, two days ahead); then the stored instants move back two
/// days instead of the clock forward (the clock put right).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_that_stepped_back_forgets_no_claim() {
    use queue_core::{Admin, QueueLimits, RateLimit};
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    let limits = QueueLimits {
        rate_per_partition: Some(RateLimit::new(5, Duration::from_secs(86_400)).unwrap()),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    for name in ["a0", "a1"] {
        partitioned(&queue, name, "a", false).await;
    }
    for name in ["b0", "b1"] {
        partitioned(&queue, name, "b", false).await;
    }
    sqlx::query(
        "WITH t AS (SELECT extract(epoch FROM clock_timestamp())::float8 * 1000
                           + 2 * 86400000 AS ms)
         , s AS (
             INSERT INTO queue_jobs_starts (queue, partition_key, rate_log, last_at)
             SELECT 'default', 'a', jsonb_build_array(jsonb_build_array(t.ms - 1000, 5)),
                    now() + interval '2 days'
             FROM t)
         UPDATE queue_jobs_queues SET partition_tally = jsonb_build_object(
             'per_ms', 86400000, 'since', 0,
             'bucket', (SELECT floor(t.ms / 86400000)::bigint FROM t),
             'jobs', 5, 'before', 0)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let first = queue.claim(req(1)).await.unwrap().jobs;
    assert_eq!(first[0].payload["name"], "b0", "a's starts count");
    assert_eq!(
        queue
            .finalize(first[0].claim(), &Finalize::Complete)
            .await
            .unwrap(),
        FinalizeOutcome::Applied
    );
    let tally: Value = sqlx::query_scalar("SELECT partition_tally FROM queue_jobs_queues")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        (tally["since"].as_f64(), tally["jobs"].as_i64()),
        (Some(0.0), Some(6)),
        "tallied in its own window, not started again: {tally}"
    );
    support::shift_time(&db.pool, "queue_jobs", Duration::from_secs(2 * 86_400)).await;
    assert_eq!(
        claimed_names(&queue, 1).await,
        ["b1"],
        "a's starts still count"
    );
    assert!(claimed_names(&queue, 1).await.is_empty());
}

/// A partition's offer locked by an adopter's open transaction (a replacing enqueue) does not
/// keep the partition's turn: the claim that met it takes nothing, the next ones take the other
/// partitions' jobs, and the locked job is taken once the transaction commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_offer_does_not_stall_the_partitions_turns() {
    use queue_core::{Admin, QueueLimits};
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    partitioned(&queue, "a0", "a", false).await;
    assert_eq!(claimed_names(&queue, 1).await, ["a0"]);
    partitioned(&queue, "a1", "a", false).await;
    partitioned(&queue, "b0", "b", true).await;
    partitioned(&queue, "c0", "c", false).await;
    partitioned(&queue, "d0", "d", false).await;
    let limits = QueueLimits {
        max_per_partition: Some(1),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    let mut tx = queue.begin().await.unwrap();
    let replacing = NewJob::from_value(json!({ "name": "b0'" }))
        .partition_key("b")
        .unique_key("kb")
        .replace_pending();
    assert!(queue.enqueue_in(&mut tx, replacing).await.unwrap().replaced);
    let mut rounds = Vec::new();
    for _ in 0..4 {
        rounds.push(claimed_names(&queue, 1).await);
    }
    // The claim that met the lock takes nothing (b's turn, its only offer locked); the turn
    // does not stay with b, so the next claims take c's and d's.
    let expected: [Vec<&str>; 4] = [vec![], vec!["c0"], vec!["d0"], vec![]];
    assert_eq!(rounds, expected, "b's locked job is passed over");
    tx.commit().await.unwrap();
    assert_eq!(claimed_names(&queue, 1).await, ["b0'"]);
    db.drop_db().await;
}

/// A pending job moved an hour ahead (a replacing enqueue) while a claim whose partitions take
/// turns waited for the queue's row is not claimed: the lock reads the due time again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_moved_ahead_during_a_turns_claim_is_not_claimed() {
    use queue_core::{Admin, QueueLimits};
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    partitioned(&queue, "a0", "a", false).await;
    assert_eq!(claimed_names(&queue, 1).await, ["a0"]);
    partitioned(&queue, "a1", "a", false).await;
    partitioned(&queue, "b0", "b", true).await;
    let limits = QueueLimits {
        max_per_partition: Some(1),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    // Another transaction holds the queue's row, as a concurrent claim of the queue does.
    let holder = holding_the_queues_row(&db).await;
    let sql = queue_postgres::testing::claim_turns_sql(&TableName::default());
    let pool = db.pool.clone();
    let turns = tokio::spawn(async move {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind("default")
            .bind(1_i64)
            .bind(90.0_f64)
            .bind(5_i32)
            .bind("test")
            .bind(42_i64)
            .bind(Vec::<i64>::new())
            .fetch_all(&pool)
            .await
            .unwrap()
            .len()
    });
    support::wait_for_a_lock_wait(&db, "the claim never waited").await;
    let later = NewJob::from_value(json!({ "name": "b0 later" }))
        .partition_key("b")
        .unique_key("kb")
        .run_at(queue_core::RunAt::After(Duration::from_secs(3600)))
        .replace_pending();
    assert!(queue.enqueue(later).await.unwrap().replaced);
    holder.commit().await.unwrap();
    assert_eq!(turns.await.unwrap(), 0, "nothing claimed");
    let status: String =
        sqlx::query_scalar("SELECT status FROM queue_jobs WHERE unique_key = 'kb'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "pending");
    db.drop_db().await;
}

/// Runs `sql` (a claim statement rendered for the default table) for `batch` jobs of the
/// default queue in `conn`, with `margin` as `$8` when given (`claim_ahead.sql`'s): how many
/// jobs it returned, and its markers (`binding`, `partitioned`, …).
async fn raw_claim(
    conn: &mut sqlx::PgConnection,
    sql: String,
    batch: i64,
    holder: &str,
    margin: Option<i64>,
) -> Result<(usize, Vec<String>), sqlx::Error> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind("default")
        .bind(batch)
        .bind(90.0_f64)
        .bind(5_i32)
        .bind(holder)
        .bind(42_i64)
        .bind(Vec::<i64>::new());
    if let Some(margin) = margin {
        query = query.bind(margin);
    }
    let rows = query.fetch_all(conn).await?;
    let markers: Vec<String> = rows
        .iter()
        .filter_map(|row| row.get::<Option<String>, _>("marker"))
        .collect();
    Ok((rows.len() - markers.len(), markers))
}

/// Asserts that `claim` is `claim_ahead.sql`'s refusal of a claim over the queue's limits.
fn assert_over(claim: Result<(usize, Vec<String>), sqlx::Error>) {
    let err = claim.expect_err("the claim ahead is refused");
    let db = err.as_database_error().expect("the server refused it");
    assert_eq!(db.code().as_deref(), Some("22P02"), "{err}");
    assert!(
        db.message()
            .contains("claim_ahead: over the limits of the queue with 3 jobs"),
        "{err}"
    );
}

/// The default queue's jobs in flight.
async fn in_flight(db: &TestDb) -> i64 {
    sqlx::query_scalar(IN_FLIGHT)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A handle on a fresh database's default queue with twenty jobs, under `limits`.
async fn twenty_jobs_under<D: TestDriver>(
    db: &TestDb,
    limits: queue_core::QueueLimits,
) -> PostgresQueue<D> {
    use queue_core::Admin;
    let queue = support::connect_claiming_ahead::<D>(db).await;
    queue
        .enqueue_many((0..20).map(|n| NewJob::new(&n).unwrap()).collect())
        .await
        .unwrap();
    queue.set_limits(limits).await.unwrap();
    queue
}

/// A claim of `batch` with `claim_ahead.sql` (margin four, claimed by `holder`) on a
/// connection of its own, running.
fn spawn_claim_ahead(
    db: &TestDb,
    holder: &'static str,
    batch: i64,
) -> tokio::task::JoinHandle<Result<(usize, Vec<String>), sqlx::Error>> {
    let pool = db.pool.clone();
    tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        let sql = queue_postgres::testing::claim_ahead_sql(&TableName::default());
        raw_claim(&mut conn, sql, batch, holder, Some(4)).await
    })
}

/// Twenty jobs in the default queue under `limits`; a transaction claims `held` of them with
/// `claim_limited.sql` and holds the queue's row (as a claim under the lock does until it
/// commits), then runs `meanwhile` in it (the claim of an earlier release, say); a claim of
/// three with `claim_ahead.sql` (a transaction of its own) picks and writes its jobs and waits
/// for the row at its end. Once the first commits, the second ends: its jobs and markers, or
/// its error.
async fn claim_ahead_after_a_locked_claim(
    db: &TestDb,
    limits: queue_core::QueueLimits,
    held: i64,
    meanwhile: Option<&'static str>,
) -> Result<(usize, Vec<String>), sqlx::Error> {
    twenty_jobs_under::<queue_postgres::Sqlx>(db, limits).await;
    claim_ahead_behind_a_locked_claim(db, held, meanwhile, 3).await
}

/// A transaction that claimed `held` jobs of the default queue with `claim_limited.sql` and
/// holds the queue's row, as a claim under the lock does until it commits.
async fn holding_the_row_after_claiming(
    db: &TestDb,
    held: i64,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = db.pool.begin().await.unwrap();
    let locked = queue_postgres::testing::claim_limited_sql(&TableName::default());
    let first = raw_claim(&mut holder, locked, held, "first", None)
        .await
        .unwrap();
    assert_eq!(first, (held as usize, vec![]));
    holder
}

/// A transaction claims `held` jobs of the default queue with `claim_limited.sql`, holds the
/// queue's row and runs `meanwhile`; a claim ahead of `batch` waits for the row at its end. Once
/// the first commits, the second ends: its jobs and markers, or its error.
async fn claim_ahead_behind_a_locked_claim(
    db: &TestDb,
    held: i64,
    meanwhile: Option<&'static str>,
    batch: i64,
) -> Result<(usize, Vec<String>), sqlx::Error> {
    let mut holder = holding_the_row_after_claiming(db, held).await;
    if let Some(sql) = meanwhile {
        sqlx::query(sql).execute(&mut *holder).await.unwrap();
    }
    let ahead = spawn_claim_ahead(db, "ahead", batch);
    support::wait_for_a_lock_wait(db, "the claim ahead never waited for the queue's row").await;
    holder.commit().await.unwrap();
    ahead.await.unwrap()
}

/// A claim that does not wait for the queue's row while max_in_flight leaves ample room
/// (thirteen, nothing in flight in its snapshot) counts at its end the jobs that a claim which
/// committed meanwhile put in flight (eleven, counted on the row): its three would make
/// fourteen, so it fails, and nothing it wrote stays. The handle's next claim takes the two
/// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_counts_the_jobs_a_claim_put_in_flight_while_it_ran() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(13),
        ..queue_core::QueueLimits::NONE
    };
    assert_over(claim_ahead_after_a_locked_claim(&db, limits, 11, None).await);
    assert_eq!(in_flight(&db).await, 11, "the claim ahead was undone");
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    assert_eq!(queue.claim(req(3)).await.unwrap().jobs.len(), 2);
    assert_eq!(in_flight(&db).await, 13);
    db.drop_db().await;
}

/// A transaction claims `held` jobs of the default queue with `claim_limited.sql` and holds the
/// queue's row; the handle's claim of three, spawned, waits for that row. Returns both: commit
/// the first to let the second end.
async fn a_claim_of_three_behind_a_locked_claim<D: TestDriver>(
    db: &TestDb,
    queue: &PostgresQueue<D>,
    held: i64,
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    tokio::task::JoinHandle<usize>,
) {
    let holder = holding_the_row_after_claiming(db, held).await;
    let claiming = {
        let queue = queue.clone();
        tokio::spawn(async move { queue.claim(req(3)).await.unwrap().jobs.len() })
    };
    support::wait_for_a_lock_wait(db, "the handle's claim never waited for the queue's row").await;
    (holder, claiming)
}

/// A claim of three through `queue` behind a claim of two that holds the queue's row, which
/// then commits: the handle's claim takes its three.
async fn three_claimed_behind_a_locked_claim_of_two<D: TestDriver>(
    db: &TestDb,
    queue: &PostgresQueue<D>,
) {
    let (holder, claiming) = a_claim_of_three_behind_a_locked_claim(db, queue, 2).await;
    holder.commit().await.unwrap();
    assert_eq!(claiming.await.unwrap(), 3);
}

/// The values `queue_limited_claims_rerun_total` took for the default queue in `snapshotter`'s
/// recorder.
fn reruns_of_the_default_queue(
    snapshotter: &metrics_util::debugging::Snapshotter,
) -> Vec<metrics_util::debugging::DebugValue> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.key().name() == queue_core::metrics::LIMITED_CLAIMS_RERUN
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == queue_core::metrics::QUEUE_LABEL && l.value() == "default")
        })
        .map(|(.., value)| value)
        .collect()
}

/// Through a queue handle, on either driver: its claim goes ahead (thirteen allowed, nothing in
/// flight in its snapshot), meets at its end the eleven jobs a claim put in flight while it
/// ran, fails, undone, and claims again under the lock in the same call: the two left.
async fn a_handles_claim_ahead_over_the_limit_claims_again_under_the_lock<D: TestDriver>() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(13),
        ..queue_core::QueueLimits::NONE
    };
    let queue = twenty_jobs_under::<D>(&db, limits).await;
    let (holder, claiming) = a_claim_of_three_behind_a_locked_claim(&db, &queue, 11).await;
    assert_the_waiting_claim_has_written(&db).await;
    holder.commit().await.unwrap();
    assert_eq!(claiming.await.unwrap(), 2);
    assert_eq!(in_flight(&db).await, 13);
    db.drop_db().await;
}

/// A transaction holding the default queue's row locked (not written), as a claim under the
/// queue's lock holds it from its start.
async fn holding_the_queues_row(db: &TestDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM queue_jobs_queues WHERE queue = 'default' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// The claim waiting for the queue's row has written its jobs before it waits, as only a claim
/// ahead's does (a locked claim waits before its pick): it holds its transaction id.
async fn assert_the_waiting_claim_has_written(db: &TestDb) {
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
         WHERE a.datname = current_database() AND a.wait_event_type = 'Lock'
           AND l.locktype = 'transactionid' AND l.granted",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        held, 1,
        "the waiting claim has written (it holds its transaction id)"
    );
}

/// The claim ahead that failed in the test above counts once as a claim run again under the
/// lock (`queue_limited_claims_rerun_total`, labelled with its queue), recorded by this
/// thread's recorder: the test runs on one thread, its spawned claim too.
#[tokio::test(flavor = "current_thread")]
async fn a_claim_ahead_over_the_limits_is_counted_as_run_again() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    a_handles_claim_ahead_over_the_limit_claims_again_under_the_lock::<queue_postgres::Sqlx>()
        .await;
    assert_eq!(
        reruns_of_the_default_queue(&snapshotter),
        [DebugValue::Counter(1)]
    );
}

/// A claim under the lock whose snapshot went stale while it waited for the queue's row (a
/// queue whose limit of eleven in flight, and rate of eleven an hour, leave no room for four
/// claims of three, so the claim does not go ahead; with a rate it is not checked after the
/// lock either): a claim that held the row committed meanwhile, so the handle's statement
/// claims nothing and the handle claims again after the lock, in the same call. That counts
/// once as a claim run again (`queue_limited_claims_rerun_total`), recorded by this thread's
/// recorder, and the call still takes its three jobs. The handle's next claim behind a locked
/// claim takes the lock first and is not run again.
#[tokio::test(flavor = "current_thread")]
async fn a_limited_claim_gone_stale_at_the_lock_is_counted_as_run_again() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(11),
        rate: Some(queue_core::RateLimit::new(11, Duration::from_secs(3600)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    let queue = twenty_jobs_under::<queue_postgres::Sqlx>(&db, limits).await;
    // The first claim goes stale and runs again. The handle's next claims take the lock first:
    // behind a locked claim again, the second waits for the row before it reads the queue, so
    // it is not stale and runs once. (A snapshot of the debugging recorder reads its counters'
    // increments since the last one.)
    for (in_flight_after, reruns) in [(5, 1), (10, 0)] {
        three_claimed_behind_a_locked_claim_of_two(&db, &queue).await;
        assert_eq!(in_flight(&db).await, in_flight_after);
        assert_eq!(
            reruns_of_the_default_queue(&snapshotter),
            [DebugValue::Counter(reruns)],
            "claims run again, up to {in_flight_after} in flight"
        );
    }
    db.drop_db().await;
}

/// A claim of a queue whose limits are in flight only (eleven), behind a claim that holds the
/// queue's row: the handle writes its jobs first and waits for the row only to check them
/// (`claim_check.sql`), so the claim that committed meanwhile leaves it nothing to run again:
/// its three jobs, five in flight, no claim run again.
#[tokio::test(flavor = "current_thread")]
async fn a_checked_claim_behind_a_locked_claim_is_not_run_again() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(11),
        ..queue_core::QueueLimits::NONE
    };
    let queue = twenty_jobs_under::<queue_postgres::Sqlx>(&db, limits).await;
    three_claimed_behind_a_locked_claim_of_two(&db, &queue).await;
    assert_eq!(in_flight(&db).await, 5);
    let reruns = reruns_of_the_default_queue(&snapshotter);
    assert!(
        reruns.is_empty() || reruns == [DebugValue::Counter(0)],
        "no claim run again: {reruns:?}"
    );
    db.drop_db().await;
}

/// The check finds a partition full: under a `max_per_partition` of two, a claim holding the
/// queue's row put two jobs of partition `p` in flight while the handle's claim, ahead of the
/// row, wrote the third job of `p` and two more. Once the first commits, the check counts three
/// of `p` in flight: the handle's claim is rolled back (counted as run again) and claims again
/// under the lock, where `p` is full: three jobs of other partitions, `p` still at two. (Without
/// the check's count of `p`, mutated to pass, `p` ends at three.)
#[tokio::test(flavor = "current_thread")]
async fn a_checked_claim_over_a_partition_is_rolled_back_and_claims_under_the_lock() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use queue_core::Admin;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    // Jobs 0 to 2 in p, the rest one partition each; due in that order.
    let key = |n: usize| {
        if n < 3 {
            "p".to_owned()
        } else {
            format!("q{n}")
        }
    };
    let jobs = (0..20).map(|n| NewJob::new(&n).unwrap().partition_key(key(n)));
    queue.enqueue_many(jobs.collect()).await.unwrap();
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(2),
        ..queue_core::QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    three_claimed_behind_a_locked_claim_of_two(&db, &queue).await;
    let per_partition: Vec<(String, i64)> = sqlx::query_as(
        "SELECT partition_key, count(*) FROM queue_jobs WHERE status = 'in_flight' \
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    // Under the lock the partitions take turns (from the queue's partition cursor), so which
    // three others is theirs to say; p stays at two, the others at one each.
    assert_eq!(per_partition.len(), 4, "{per_partition:?}");
    assert_eq!(per_partition[0], ("p".to_owned(), 2), "{per_partition:?}");
    assert!(
        per_partition[1..]
            .iter()
            .all(|(key, n)| key != "p" && *n == 1),
        "{per_partition:?}"
    );
    assert_eq!(
        reruns_of_the_default_queue(&snapshotter),
        [DebugValue::Counter(1)]
    );
    db.drop_db().await;
}

/// A claim ahead whose connection is killed while it waits for the queue's row, its jobs
/// written: the handle's claim fails (a transient error), nothing it wrote stays (no job in
/// flight, none counted on the row), and a claim after it takes its jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_killed_while_it_waits_leaves_nothing() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(20),
        ..queue_core::QueueLimits::NONE
    };
    let queue = twenty_jobs_under::<queue_postgres::Sqlx>(&db, limits).await;
    a_claim_ahead_killed_while_it_waits(&db, &queue).await;
    db.drop_db().await;
}

/// The same under max_per_partition, twenty partitions of one job each: nothing is counted
/// per slot of partition keys either (the counts stay zeros, the claims that counted in them
/// none), and the claim after it counts its own three there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_in_partitions_killed_while_it_waits_leaves_nothing() {
    use queue_core::Admin;
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    let jobs = (0..20).map(|n| NewJob::new(&n).unwrap().partition_key(format!("p{n}")));
    queue.enqueue_many(jobs.collect()).await.unwrap();
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(10),
        ..queue_core::QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    a_claim_ahead_killed_while_it_waits(&db, &queue).await;
    let (slots, slotted): (Vec<i64>, i64) = sqlx::query_as(
        "SELECT counted_slots, slotted_claims FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // The claim after it counted its three, per slot, and itself.
    assert_eq!(slots.len(), 128);
    assert_eq!(slots.iter().sum::<i64>(), 3);
    assert_eq!(slotted, 1);
    db.drop_db().await;
}

/// A claim checked after the lock (`max_per_partition` 2 on twenty partitions of one job each:
/// the room leaves no claim ahead) whose connection is killed while it waits for the queue's
/// row, its three jobs written: the handle's claim fails (a transient error), nothing it wrote
/// stays, and a claim after it takes three jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_claim_killed_while_it_waits_leaves_nothing() {
    use queue_core::Admin;
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    let jobs = (0..20).map(|n| NewJob::new(&n).unwrap().partition_key(format!("p{n}")));
    queue.enqueue_many(jobs.collect()).await.unwrap();
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(2),
        ..queue_core::QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    a_claim_ahead_killed_while_it_waits(&db, &queue).await;
    db.drop_db().await;
}

/// A claim ahead whose queue's row is deleted while it waits for it (an operator's hand) finds
/// no row to count its jobs on: it fails with the over-error like a claim over the limits, and
/// nothing it wrote stays (uncounted, its jobs would escape the counts of claims whose
/// snapshot predates its commit, should the limits be set again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_whose_queues_row_goes_while_it_waits_commits_nothing() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(20),
        ..queue_core::QueueLimits::NONE
    };
    twenty_jobs_under::<queue_postgres::Sqlx>(&db, limits).await;
    let mut holder = holding_the_queues_row(&db).await;
    let ahead = spawn_claim_ahead(&db, "ahead", 3);
    support::wait_for_a_lock_wait(&db, "the claim ahead never waited for the queue's row").await;
    sqlx::query("DELETE FROM queue_jobs_queues WHERE queue = 'default'")
        .execute(&mut *holder)
        .await
        .unwrap();
    holder.commit().await.unwrap();
    assert_over(ahead.await.unwrap());
    assert_eq!(in_flight(&db).await, 0, "nothing the claim wrote stayed");
    db.drop_db().await;
}

/// The handle's claim ahead of three, behind a transaction holding the queue's row, has its
/// connection killed while it waits: it fails transiently, no job stays in flight and none is
/// counted, and a claim after it (another handle's) takes three.
async fn a_claim_ahead_killed_while_it_waits(
    db: &TestDb,
    queue: &PostgresQueue<queue_postgres::Sqlx>,
) {
    let holder = holding_the_queues_row(db).await;
    let claiming = {
        let queue = queue.clone();
        tokio::spawn(async move { queue.claim(req(3)).await })
    };
    support::wait_for_a_lock_wait(db, "the claim ahead never waited for the queue's row").await;
    assert_the_waiting_claim_has_written(db).await;
    let killed: bool = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(killed);
    let err = claiming
        .await
        .unwrap()
        .expect_err("the claim's connection was killed");
    assert!(err.is_transient(), "{err}");
    holder.commit().await.unwrap();
    assert_eq!(in_flight(db).await, 0, "nothing the claim wrote stayed");
    let (counted, slots, slotted): (i64, i64, i64) = sqlx::query_as(
        "SELECT counted_jobs, COALESCE((SELECT sum(n) FROM unnest(counted_slots) AS n), 0)::bigint,
                slotted_claims
         FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((counted, slots, slotted), (0, 0, 0));
    let after = support::connect_claiming_ahead::<queue_postgres::Sqlx>(db).await;
    assert_eq!(after.claim(req(3)).await.unwrap().jobs.len(), 3);
}

/// A transaction holds the default queue's row locked, running `meanwhile` (or nothing), while
/// a claim ahead of three waits for it; it commits once the claim has waited a tenth of a
/// second by the database's clock. Returns the claim ahead's jobs and markers, or its error,
/// and the clock (epoch milliseconds) the holder read just before its commit.
async fn claim_ahead_behind_a_long_lock(
    db: &TestDb,
    meanwhile: Option<&'static str>,
) -> (Result<(usize, Vec<String>), sqlx::Error>, f64) {
    let mut holder = holding_the_queues_row(db).await;
    if let Some(sql) = meanwhile {
        sqlx::query(sql).execute(&mut *holder).await.unwrap();
    }
    let ahead = spawn_claim_ahead(db, "ahead", 3);
    support::wait_for_activity(
        db,
        "wait_event_type = 'Lock' AND clock_timestamp() - query_start > interval '100 milliseconds'",
        "the claim ahead never waited a tenth of a second for the queue's row",
    )
    .await;
    let released: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8 * 1000")
            .fetch_one(&mut *holder)
            .await
            .unwrap();
    holder.commit().await.unwrap();
    (ahead.await.unwrap(), released)
}

/// The instant the rates counted the default queue's last claim at, in epoch milliseconds:
/// the rate log's last entry, or the tally's `at` with a rate per partition.
async fn last_counted_at(db: &TestDb, per_partition: bool) -> f64 {
    let sql = if per_partition {
        "SELECT (partition_tally ->> 'at')::float8 FROM queue_jobs_queues WHERE queue = 'default'"
    } else {
        "SELECT (rate_log -> -1 ->> 0)::float8 FROM queue_jobs_queues WHERE queue = 'default'"
    };
    sqlx::query_scalar(sql).fetch_one(&db.pool).await.unwrap()
}

/// A queue with twenty jobs under a rate of a hundred a minute: a rate of the queue, or a rate
/// per partition (then eight jobs of partition `a`).
async fn rated_ahead_of_a_long_lock(db: &TestDb, per_partition: bool) {
    let rate = Some(queue_core::RateLimit::new(100, Duration::from_secs(60)).unwrap());
    if per_partition {
        eight_jobs_of_a_limited(
            db,
            queue_core::QueueLimits {
                rate_per_partition: rate,
                ..queue_core::QueueLimits::NONE
            },
        )
        .await;
    } else {
        let limits = queue_core::QueueLimits {
            rate,
            ..queue_core::QueueLimits::NONE
        };
        twenty_jobs_under::<queue_postgres::Sqlx>(db, limits).await;
    }
}

/// A claim ahead that waited for the queue's row while a transaction held it, locked only or
/// written: the rates count it by the clock after the wait, not at the instant the wait began
/// (PostgreSQL computes an update's values again after a wait only for a row written
/// meanwhile; the claim takes the row's lock before computing them), so later claims never
/// let it leave their windows before its jobs start. Under a rate of the queue and under a
/// rate per partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_behind_a_long_lock_is_counted_after_the_wait() {
    let written = "UPDATE queue_jobs_queues SET updated_at = now() WHERE queue = 'default'";
    for per_partition in [false, true] {
        for meanwhile in [None, Some(written)] {
            let db = TestDb::new().await;
            rated_ahead_of_a_long_lock(&db, per_partition).await;
            let (claim, released) = claim_ahead_behind_a_long_lock(&db, meanwhile).await;
            let case = format!(
                "per partition: {per_partition}, written: {}",
                meanwhile.is_some()
            );
            assert_eq!(claim.unwrap(), (3, vec![]), "{case}");
            assert_eq!(in_flight(&db).await, 3, "{case}");
            let counted = last_counted_at(&db, per_partition).await;
            assert!(
                counted >= released,
                "{case}: counted at {counted}, the row released after {released}"
            );
            db.drop_db().await;
        }
    }
}

/// Jobs without a partition key are not limited per partition: a claim ahead of them goes
/// ahead and commits whatever the tally of the rate per partition says, here one that has not
/// yet counted a whole window (as after its window changed), which bounds no partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_of_jobs_without_a_partition_key_needs_no_partition_tally() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(1, Duration::from_secs(60)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    twenty_jobs_under::<queue_postgres::Sqlx>(&db, limits).await;
    sqlx::query(
        "UPDATE queue_jobs_queues
         SET partition_tally = partition_tally
             || jsonb_build_object('since', extract(epoch FROM clock_timestamp()) * 1000)
         WHERE queue = 'default'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let sql = queue_postgres::testing::claim_ahead_sql(&TableName::default());
    let mut conn = db.pool.acquire().await.unwrap();
    let ahead = raw_claim(&mut conn, sql, 3, "ahead", Some(4)).await;
    assert_eq!(ahead.unwrap(), (3, vec![]));
    assert_eq!(in_flight(&db).await, 3);
    db.drop_db().await;
}

/// A claim ahead whose statement spans changes of the queue's limits: it took its snapshot
/// under a limit of twelve, and while it wrote its jobs the limits were removed, another handle
/// claimed ten without them (`claim.sql`, which counts nothing on the row), and the limit was
/// set again. The changes moved the row's claims counter, so the claim fails its check instead
/// of counting on a snapshot that missed those ten (its three would make thirteen). Limits
/// set again as they were move nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_spanning_a_change_of_limits_fails() {
    use queue_core::{Admin, QueueLimits};
    let db = TestDb::new().await;
    let twelve = QueueLimits {
        max_in_flight: Some(12),
        ..QueueLimits::NONE
    };
    let queue = twenty_jobs_under::<queue_postgres::Sqlx>(&db, twelve).await;
    // Limits set as they were move nothing (a process that sets its limits as it starts fails
    // no claim ahead).
    let claims = || async {
        sqlx::query_scalar::<_, i64>("SELECT claims FROM queue_jobs_queues WHERE queue = 'default'")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let before = claims().await;
    queue.set_limits(twelve).await.unwrap();
    assert_eq!(claims().await, before);
    // The claim ahead (claimed_by 'slow') writes each of its rows slowly.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_row() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(0.2); RETURN NEW; END $$;
         CREATE TRIGGER slow_row BEFORE UPDATE ON queue_jobs
             FOR EACH ROW WHEN (NEW.claimed_by = 'slow') EXECUTE FUNCTION slow_row();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let ahead = spawn_claim_ahead(&db, "slow", 3);
    support::wait_for_activity(&db, "wait_event = 'PgSleep'", "the claim ahead never wrote").await;
    queue.set_limits(QueueLimits::NONE).await.unwrap();
    let other = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    assert_eq!(other.claim(req(10)).await.unwrap().jobs.len(), 10);
    queue.set_limits(twelve).await.unwrap();
    assert_over(ahead.await.unwrap());
    assert_eq!(in_flight(&db).await, 10);
    db.drop_db().await;
}

/// A claim ahead under a rate counts and logs its starts by the clock once it holds the
/// queue's row, not when it began to wait for it: while it waits, a claim under the lock takes
/// two jobs and logs them; the claim ahead's entry in the rate's log comes after that one (a
/// claim that counted by the instant it began to wait would count a window that the claims
/// meanwhile may have pruned, and log itself out of order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_counts_the_rate_by_the_clock_under_the_lock() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        rate: Some(queue_core::RateLimit::new(100, Duration::from_secs(60)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    twenty_jobs_under::<queue_postgres::Sqlx>(&db, limits).await;
    let mut holder = holding_the_queues_row(&db).await;
    let ahead = spawn_claim_ahead(&db, "ahead", 3);
    support::wait_for_a_lock_wait(&db, "the claim ahead never waited for the queue's row").await;
    let locked = queue_postgres::testing::claim_limited_sql(&TableName::default());
    let held = raw_claim(&mut holder, locked, 2, "first", None)
        .await
        .unwrap();
    assert_eq!(held, (2, vec![]));
    holder.commit().await.unwrap();
    assert_eq!(ahead.await.unwrap().unwrap(), (3, vec![]));
    let log: Value =
        sqlx::query_scalar("SELECT rate_log FROM queue_jobs_queues WHERE queue = 'default'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let entries: Vec<(f64, i64)> = log
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_f64().unwrap(), e[1].as_i64().unwrap()))
        .collect();
    assert_eq!(entries.len(), 2, "{log}");
    assert_eq!((entries[0].1, entries[1].1), (2, 3), "{log}");
    assert!(
        entries[1].0 >= entries[0].0,
        "the claim ahead was logged before the claim it waited for: {log}"
    );
    db.drop_db().await;
}

/// Under max_per_partition (six), with ten jobs of ten other partitions in flight (a claim
/// committed them, counting them per slot of partition keys), so that the queue's jobs in
/// flight leave no room under the limit all partitions together: a transaction claims `held`
/// jobs of partition `a` under the lock and holds the queue's row; a claim ahead of one more
/// job of `a` (the partition's snapshot shows none in flight: ample room) writes it and waits
/// for the row at its end. Once the first commits, the second ends: its jobs and markers, or
/// its error. `a`'s jobs in flight after it. `meanwhile` runs in the first's transaction after
/// its claim (an edit of the queue's row, say).
async fn claim_ahead_in_a_partition_after_a_locked_claim(
    db: &TestDb,
    held: i64,
    meanwhile: Option<&'static str>,
) -> (Result<(usize, Vec<String>), sqlx::Error>, i64) {
    use queue_core::Admin;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(db).await;
    let mut jobs: Vec<NewJob> = (0..10)
        .map(|n| NewJob::new(&n).unwrap().partition_key(format!("x{n}")))
        .collect();
    jobs.extend((0..8).map(|n| NewJob::new(&n).unwrap().partition_key("a")));
    queue.enqueue_many(jobs).await.unwrap();
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(6),
        ..queue_core::QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    let table = TableName::default();
    let locked = queue_postgres::testing::claim_limited_sql(&table);
    let mut conn = db.pool.acquire().await.unwrap();
    let others = raw_claim(&mut conn, locked, 10, "others", None)
        .await
        .unwrap();
    assert_eq!(others, (10, vec![]), "one job of each other partition");
    let claim = claim_ahead_behind_a_locked_claim(db, held, meanwhile, 1).await;
    let a: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM queue_jobs WHERE status = 'in_flight' AND partition_key = 'a'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (claim, a)
}

/// The claim ahead counts at its end the jobs of its slot of partition keys that the claim
/// which committed meanwhile put in flight (six of `a`, counted on the queue's row): its one
/// would make seven of `a`, so it fails, and nothing it wrote stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_counts_the_jobs_a_claim_put_in_flight_in_its_partition() {
    let db = TestDb::new().await;
    let (claim, a) = claim_ahead_in_a_partition_after_a_locked_claim(&db, 6, None).await;
    assert_over_with_one(claim);
    assert_eq!(a, 6, "the claim ahead was undone");
    assert_eq!(in_flight(&db).await, 16);
    db.drop_db().await;
}

/// Asserts that `claim` is `claim_ahead.sql`'s refusal of its one job over the queue's limits.
fn assert_over_with_one(claim: Result<(usize, Vec<String>), sqlx::Error>) {
    let err = claim.expect_err("the claim ahead is refused");
    let server = err.as_database_error().expect("the server refused it");
    assert_eq!(server.code().as_deref(), Some("22P02"), "{err}");
    assert!(
        server
            .message()
            .contains("claim_ahead: over the limits of the queue with 1 jobs"),
        "{err}"
    );
}

/// Three of `a` claimed meanwhile (the claim ahead's one would fit), but the queue's count of
/// `a`'s slot was lost meanwhile (NULL: an edit by hand, a restore): the claim ahead cannot
/// bound the partition, so it fails, undone, rather than pass on a count it does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_over_counts_per_slot_not_whole_fails() {
    let db = TestDb::new().await;
    let lost = "UPDATE queue_jobs_queues
                SET counted_slots[(hashtextextended('a', 0) & 127)::integer + 1] = NULL
                WHERE queue = 'default'";
    over_after_three_of_a_and(&db, lost).await;
    db.drop_db().await;
}

/// Three of `a` claimed by a locked claim that runs `meanwhile` before it commits: the claim
/// ahead of one more fails, and nothing it wrote stays.
async fn over_after_three_of_a_and(db: &TestDb, meanwhile: &'static str) {
    let (claim, a) = claim_ahead_in_a_partition_after_a_locked_claim(db, 3, Some(meanwhile)).await;
    assert_over_with_one(claim);
    assert_eq!(a, 3, "the claim ahead was undone");
}

/// The count of `a`'s slot was lost (NULL) and a claim under the lock started the counts again
/// from its own six of `a` while a claim ahead of one more ran, whose snapshot held the old
/// counts (six of `a` claimed and completed before): the new count minus the old would say no
/// job of the slot went in flight since. The claim that started the counts again did not count
/// as one that counted in them (`slotted_claims`), so the claim ahead fails, undone, and `a`
/// stays at its limit of six.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_across_counts_started_again_is_over() {
    use queue_core::Admin;
    let db = TestDb::new().await;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(&db).await;
    let jobs = (0..14).map(|n| NewJob::new(&n).unwrap().partition_key("a"));
    queue.enqueue_many(jobs.collect()).await.unwrap();
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(6),
        ..queue_core::QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    let locked = || queue_postgres::testing::claim_limited_sql(&TableName::default());
    let mut conn = db.pool.acquire().await.unwrap();
    let earlier = raw_claim(&mut conn, locked(), 6, "earlier", None).await;
    assert_eq!(earlier.unwrap(), (6, vec![]));
    sqlx::query("UPDATE queue_jobs SET status = 'completed' WHERE status = 'in_flight'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE queue_jobs_queues
         SET counted_slots[(hashtextextended('a', 0) & 127)::integer + 1] = NULL
         WHERE queue = 'default'",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let ahead = spawn_claim_ahead(&db, "ahead", 1);
    support::wait_for_a_lock_wait(&db, "the claim ahead never waited for the queue's row").await;
    let first = raw_claim(&mut holder, locked(), 6, "first", None).await;
    assert_eq!(first.unwrap(), (6, vec![]));
    holder.commit().await.unwrap();
    assert_over_with_one(ahead.await.unwrap());
    assert_eq!(in_flight(&db).await, 6, "the claim ahead was undone");
    db.drop_db().await;
}

/// Three of `a` claimed meanwhile by a claim that counted its jobs on the queue's row but not
/// per slot (a build between the two counts; a claim while the queue had no max_per_partition
/// does the same): the claim ahead cannot bound the partition and fails, undone, although the
/// room would have held its job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_after_a_claim_not_counted_per_slot_is_over() {
    let db = TestDb::new().await;
    let uncounted = "UPDATE queue_jobs_queues
                     SET slotted_claims = slotted_claims - 1,
                         counted_slots[(hashtextextended('a', 0) & 127)::integer + 1]
                             = counted_slots[(hashtextextended('a', 0) & 127)::integer + 1] - 3
                     WHERE queue = 'default'";
    over_after_three_of_a_and(&db, uncounted).await;
    db.drop_db().await;
}

/// The same with three of `a` claimed meanwhile: the claim ahead's one makes four, within the
/// limit, and it commits, although the queue's jobs in flight, all partitions together, are
/// past the limit (the bound per slot serves it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_within_its_partitions_limit_commits_beside_a_locked_claim() {
    let db = TestDb::new().await;
    let (claim, a) = claim_ahead_in_a_partition_after_a_locked_claim(&db, 3, None).await;
    assert_eq!(claim.unwrap(), (1, vec![]));
    assert_eq!(a, 4);
    assert_eq!(in_flight(&db).await, 14);
    db.drop_db().await;
}

/// A handle on a fresh database's default queue with eight jobs of partition `a`, under
/// `max_per_partition`.
async fn eight_jobs_of_a_under(
    db: &TestDb,
    max_per_partition: u32,
) -> PostgresQueue<queue_postgres::Sqlx> {
    let limits = queue_core::QueueLimits {
        max_per_partition: Some(max_per_partition),
        ..queue_core::QueueLimits::NONE
    };
    eight_jobs_of_a_limited(db, limits).await
}

/// A handle on a fresh database's default queue with eight jobs of partition `a`, under
/// `limits`.
async fn eight_jobs_of_a_limited(
    db: &TestDb,
    limits: queue_core::QueueLimits,
) -> PostgresQueue<queue_postgres::Sqlx> {
    use queue_core::Admin;
    let queue = support::connect_claiming_ahead::<queue_postgres::Sqlx>(db).await;
    let jobs = (0..8).map(|n| NewJob::new(&n).unwrap().partition_key("a"));
    queue.enqueue_many(jobs.collect()).await.unwrap();
    queue.set_limits(limits).await.unwrap();
    queue
}

/// Under a rate per partition of six starts a `window`, a locked claim takes `held` jobs of
/// partition `a` and holds the queue's row while a claim ahead of one more of `a` waits for it.
/// The claim ahead went ahead on the snapshot's tally: set_limits starts it complete and empty,
/// so its sum left room for four claims of one, unless `tally` (SQL run before the claims)
/// makes it otherwise. Returns the claim ahead's jobs and markers, or its error, and the starts
/// of `a` the queue's claim logs hold.
async fn a_rated_claim_ahead_after_a_locked_claim(
    db: &TestDb,
    held: i64,
    window: Duration,
    tally: Option<&'static str>,
) -> (Result<(usize, Vec<String>), sqlx::Error>, i64) {
    let limits = queue_core::QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(6, window).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    eight_jobs_of_a_limited(db, limits).await;
    if let Some(sql) = tally {
        sqlx::raw_sql(sql).execute(&db.pool).await.unwrap();
    }
    let claim = claim_ahead_behind_a_locked_claim(db, held, None, 1).await;
    let logged: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(j), 0)::bigint
         FROM queue_jobs_claim_starts AS s, unnest(s.keys, s.jobs) AS k(key, j)
         WHERE s.queue = 'default' AND k.key = 'a'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (claim, logged)
}

/// A rate per partition goes ahead too, and the claim ahead counts, at its end, the starts a
/// claim made while it ran: six of `a` were claimed meanwhile, its one would make seven within
/// the minute, so it fails, undone, and `a` keeps its six.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_counts_the_starts_per_partition_a_claim_made_while_it_ran() {
    let db = TestDb::new().await;
    let minute = Duration::from_secs(60);
    let (claim, logged) = a_rated_claim_ahead_after_a_locked_claim(&db, 6, minute, None).await;
    assert_over_with_one(claim);
    assert_eq!(in_flight(&db).await, 6);
    assert_eq!(logged, 6, "the locked claim's starts alone");
    db.drop_db().await;
}

/// The same with five of `a` claimed meanwhile: the claim ahead's one makes six, within the
/// rate, and it commits, logging its start in the queue's claim logs (`<table>_claim_starts`)
/// as a claim under the lock would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_within_the_partition_rate_commits_beside_a_locked_claim() {
    let db = TestDb::new().await;
    let minute = Duration::from_secs(60);
    let (claim, logged) = a_rated_claim_ahead_after_a_locked_claim(&db, 5, minute, None).await;
    assert_eq!(claim.unwrap(), (1, vec![]));
    assert_eq!(in_flight(&db).await, 6);
    assert_eq!(logged, 6, "five and one");
    db.drop_db().await;
}

/// The queue's tally of the hour counted forty starts of other partitions, all in the slot
/// after `a`'s, each claim counted per slot: the tally's sum leaves no room (forty against six
/// a partition), but `a`'s slot does, so claims of `a` go ahead on the slots
/// (`claim_rated.sql`'s bound).
const FORTY_STARTS_BESIDE_A: &str = "
    UPDATE queue_jobs_queues AS c
    SET partition_tally = jsonb_build_object(
            'per_ms', 3600000, 'since', w.now_ms - 7200000, 'bucket', w.bucket, 'jobs', 40,
            'before', 0, 'slots_at', w.bucket, 'slots_jobs', 40, 'slot_before', 0),
        partition_slots = (SELECT array_agg(CASE WHEN i = ((hashtextextended('a', 0) & 511) + 1) % 512 + 1
                                                 THEN 40 ELSE 0 END ORDER BY i)
                           FROM generate_series(1, 512) AS i)
    FROM (SELECT extract(epoch FROM clock_timestamp())::float8 * 1000 AS now_ms,
                 floor(extract(epoch FROM clock_timestamp())::float8 * 1000 / 3600000)::bigint
                     AS bucket) AS w
    WHERE c.queue = 'default'";

/// A claim ahead that went ahead on the slots of the tally counts, at its end, the starts a
/// claim made in its partition's slot while it ran: six of `a` meanwhile, its one would make
/// seven within the hour, so it fails, undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_counts_the_starts_a_claim_made_in_its_partitions_slot() {
    let db = TestDb::new().await;
    let hour = Duration::from_secs(3600);
    let (claim, logged) =
        a_rated_claim_ahead_after_a_locked_claim(&db, 6, hour, Some(FORTY_STARTS_BESIDE_A)).await;
    assert_over_with_one(claim);
    assert_eq!(in_flight(&db).await, 6);
    assert_eq!(logged, 6, "the locked claim's starts alone");
    let a_slot: i32 = sqlx::query_scalar(
        "SELECT partition_slots[(hashtextextended('a', 0) & 511) + 1]
         FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(a_slot, 6, "the slot of `a` counts the locked claim's six");
    db.drop_db().await;
}

/// The same with five of `a` meanwhile: six within the hour, and the claim ahead commits,
/// counting its start in the slot of `a`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_within_its_partitions_slot_commits_beside_a_locked_claim() {
    let db = TestDb::new().await;
    let hour = Duration::from_secs(3600);
    let (claim, logged) =
        a_rated_claim_ahead_after_a_locked_claim(&db, 5, hour, Some(FORTY_STARTS_BESIDE_A)).await;
    assert_eq!(claim.unwrap(), (1, vec![]));
    assert_eq!(in_flight(&db).await, 6);
    assert_eq!(logged, 6, "five and one");
    let (a_slot, jobs): (i32, i64) = sqlx::query_as(
        "SELECT partition_slots[(hashtextextended('a', 0) & 511) + 1],
                (partition_tally ->> 'slots_jobs')::bigint
         FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((a_slot, jobs), (6, 46), "both claims counted per slot");
    db.drop_db().await;
}

/// Under max_per_partition (five), a claim ahead of jobs of one partition goes ahead only
/// while the partition's jobs in flight and its picks leave room for four more claims like it
/// in the partition's slot: with none in flight, a claim of two, and with three in flight, a
/// claim of one, it claims nothing and says `binding`; the handle claims under the lock,
/// within the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_leaves_a_partition_near_its_limit_to_the_lock() {
    let db = TestDb::new().await;
    let queue = eight_jobs_of_a_under(&db, 5).await;
    let sql = || queue_postgres::testing::claim_ahead_sql(&TableName::default());
    let mut conn = db.pool.acquire().await.unwrap();
    let binding = (0, vec!["binding".to_owned()]);
    for (batch, claimed) in [(2, 3), (1, 2)] {
        let ahead = raw_claim(&mut conn, sql(), batch, "ahead", Some(4)).await;
        assert_eq!(ahead.unwrap(), binding);
        assert_eq!(queue.claim(req(3)).await.unwrap().jobs.len(), claimed);
    }
    assert_eq!(in_flight(&db).await, 5);
    db.drop_db().await;
}

/// Setting max_per_partition starts the queue's counts per slot (`set_limits.sql`), so the
/// first claim under it goes ahead of the queue's row lock while the limit leaves room: here
/// two jobs of a partition allowed a hundred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_claim_under_a_new_partition_limit_goes_ahead() {
    let db = TestDb::new().await;
    eight_jobs_of_a_under(&db, 100).await;
    let sql = queue_postgres::testing::claim_ahead_sql(&TableName::default());
    let mut conn = db.pool.acquire().await.unwrap();
    let ahead = raw_claim(&mut conn, sql, 2, "ahead", Some(4)).await;
    assert_eq!(ahead.unwrap(), (2, vec![]));
    let counted: Vec<i64> = sqlx::query_scalar(
        "SELECT unnest(counted_slots) FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(counted.len(), 128, "a count per slot");
    assert_eq!(counted.iter().sum::<i64>(), 2, "the claim counted its two");
    db.drop_db().await;
}

/// The same within the limit (two held, twenty allowed): the claim ahead fits and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_within_the_limit_commits_beside_a_locked_claim() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(20),
        ..queue_core::QueueLimits::NONE
    };
    let claim = claim_ahead_after_a_locked_claim(&db, limits, 2, None).await;
    assert_eq!(claim.unwrap(), (3, vec![]));
    assert_eq!(in_flight(&db).await, 5);
    db.drop_db().await;
}

/// The claim that committed meanwhile is one of a release that does not count its jobs on the
/// queue's row (it moves the claims counter alone): the claim ahead cannot bound the jobs in
/// flight and fails, undone, although the room would have held them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_after_an_uncounted_claim_is_over() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        max_in_flight: Some(20),
        ..queue_core::QueueLimits::NONE
    };
    let earlier_release = "UPDATE queue_jobs_queues
                           SET counted_claims = counted_claims - 1, counted_jobs = counted_jobs - 2
                           WHERE queue = 'default'";
    assert_over(claim_ahead_after_a_locked_claim(&db, limits, 2, Some(earlier_release)).await);
    assert_eq!(in_flight(&db).await, 2);
    db.drop_db().await;
}

/// Under a rate alone (fourteen starts a minute), a claim ahead counts the starts a claim
/// logged while it ran (twelve): its three would make fifteen, so it fails, undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_counts_the_starts_a_claim_logged_while_it_ran() {
    let db = TestDb::new().await;
    let limits = queue_core::QueueLimits {
        rate: Some(queue_core::RateLimit::new(14, Duration::from_secs(60)).unwrap()),
        ..queue_core::QueueLimits::NONE
    };
    assert_over(claim_ahead_after_a_locked_claim(&db, limits, 12, None).await);
    assert_eq!(in_flight(&db).await, 12);
    db.drop_db().await;
}

/// A claim ahead claims nothing when the room is not ample for four batches like its own (it
/// says `binding`); the queue handle then claims under the lock, within the limits. A rate per
/// partition set where there was none starts its tally complete and empty, so the first claim
/// goes ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_ahead_leaves_a_queue_near_its_limit_to_the_lock() {
    use queue_core::{Admin, QueueLimits};
    let db = TestDb::new().await;
    let queue = twenty_jobs_under::<queue_postgres::Sqlx>(&db, QueueLimits::NONE).await;
    let sql = || queue_postgres::testing::claim_ahead_sql(&TableName::default());
    let mut conn = db.pool.acquire().await.unwrap();
    let rate = Some(queue_core::RateLimit::new(100, Duration::from_secs(1)).unwrap());
    for (max_in_flight, max_per_partition, rate_per_partition, batch, expected) in [
        (Some(11), None, None, 3, (0, vec!["binding".to_owned()])),
        (Some(12), None, None, 3, (3, vec![])),
        // Jobs without a partition key: no limit per partition applies to them.
        (None, Some(1), None, 3, (3, vec![])),
        (None, None, rate, 1, (1, vec![])),
    ] {
        let limits = QueueLimits {
            max_in_flight,
            max_per_partition,
            rate_per_partition,
            ..QueueLimits::NONE
        };
        queue.set_limits(limits).await.unwrap();
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        assert_eq!(
            raw_claim(&mut tx, sql(), batch, "ahead", Some(4))
                .await
                .unwrap(),
            expected
        );
        tx.rollback().await.unwrap();
    }
    let limits = QueueLimits {
        max_in_flight: Some(4),
        ..QueueLimits::NONE
    };
    queue.set_limits(limits).await.unwrap();
    assert_eq!(queue.claim(req(3)).await.unwrap().jobs.len(), 3);
    assert_eq!(queue.claim(req(3)).await.unwrap().jobs.len(), 1);
    assert_eq!(in_flight(&db).await, 4);
    db.drop_db().await;
}
