//! Room granted to a queue handle for several claims (`grant.sql`, `claim_granted.sql`,
//! docs/adr/0004-room-grants.md): the grants' room is counted by every other claim, spent
//! only once, and given back when the grant's row goes (returned, expired, or the limits or
//! the switch changed), whatever writes the queue's row; under a queue rate a grant counts
//! whole in the rate's log until a grant statement or its handle deletes it (then as its
//! claims' jobs) or a window after its expiry.

mod support;

use std::time::Duration;

use queue_core::{Admin, Backend, ClaimRequest, Lease, NewJob, QueueLimits};
use queue_postgres::{PostgresQueue, Sqlx, TableName};
use serde_json::json;
use sqlx::Row;
use support::{TestDb, TestDriver};

fn req(batch: u32) -> ClaimRequest {
    ClaimRequest::new(batch, Lease::DEFAULT)
}

/// A handle on a fresh database's default queue holding `jobs`, under `limits`, its room grants
/// switched on.
async fn granting<D: TestDriver>(
    db: &TestDb,
    limits: QueueLimits,
    jobs: Vec<NewJob>,
) -> PostgresQueue<D> {
    let queue = support::connect_default::<D>(db).await;
    queue.enqueue_many(jobs).await.unwrap();
    queue.set_limits(limits).await.unwrap();
    assert!(queue.set_room_grants(true).await.unwrap());
    queue
}

/// At most forty jobs in flight: a grant of eight claims of five takes ten (a quarter).
const FORTY_IN_FLIGHT: QueueLimits = QueueLimits {
    max_in_flight: Some(40),
    ..QueueLimits::NONE
};

fn plain_jobs(n: usize) -> Vec<NewJob> {
    (0..n)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect()
}

fn partitioned_jobs(n: usize, key: &str) -> Vec<NewJob> {
    (0..n)
        .map(|n| NewJob::from_value(json!({ "n": n })).partition_key(key))
        .collect()
}

/// A grant as `grant.sql` returns it: `(grant_id, jobs_left, claims_left, per_claim)`.
type GrantRow = (i64, i64, i32, i32);

/// Asks for a grant of eight claims of `batch` for the default queue, as a handle does (the
/// queue's row locked first, in one transaction), returning `previous`.
async fn ask_grant(db: &TestDb, batch: i64, previous: Option<i64>) -> Option<GrantRow> {
    ask_grant_living(db, batch, previous, Duration::from_secs(2)).await
}

/// [`ask_grant`] for a grant living `life` (no longer than the queue's rate's window).
async fn ask_grant_living(
    db: &TestDb,
    batch: i64,
    previous: Option<i64>,
    life: Duration,
) -> Option<GrantRow> {
    let mut tx = db.pool.begin().await.unwrap();
    lock_queue(&mut tx).await;
    let grant = grant_under_lock(&mut tx, batch, previous, life).await;
    tx.commit().await.unwrap();
    grant
}

/// The queue's row locked on `conn` (`lock_queue.sql`), as a handle does before its grant
/// statement.
async fn lock_queue(conn: &mut sqlx::PgConnection) {
    let [lock, _] = queue_postgres::testing::grant_sql(&TableName::default());
    sqlx::query(sqlx::AssertSqlSafe(lock))
        .bind("default")
        .execute(conn)
        .await
        .unwrap();
}

/// The grant statement (`grant.sql`) on `conn`, whose transaction holds the queue's row lock:
/// eight claims of `batch`, living `life`, returning `previous`.
async fn grant_under_lock(
    conn: &mut sqlx::PgConnection,
    batch: i64,
    previous: Option<i64>,
    life: Duration,
) -> Option<GrantRow> {
    let [_, grant] = queue_postgres::testing::grant_sql(&TableName::default());
    let row = sqlx::query(sqlx::AssertSqlSafe(grant))
        .bind("default")
        .bind("test")
        .bind(batch)
        .bind(8_i64)
        .bind(i64::try_from(life.as_millis()).unwrap())
        .bind(previous.into_iter().collect::<Vec<i64>>())
        .fetch_optional(conn)
        .await
        .unwrap();
    row.map(|r| {
        (
            r.get("grant_id"),
            r.get("jobs_left"),
            r.get("claims_left"),
            r.get("per_claim"),
        )
    })
}

/// A claim of `batch` on the grant `grant` (`claim_granted.sql`) on `conn`: the jobs it took.
async fn claim_on(
    conn: &mut sqlx::PgConnection,
    grant: i64,
    batch: i64,
) -> Result<usize, sqlx::Error> {
    let sql = queue_postgres::testing::claim_granted_sql(&TableName::default());
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind("default")
        .bind(batch)
        .bind(90.0_f64)
        .bind(5_i32)
        .bind("granted")
        .bind(42_i64)
        .bind(Vec::<i64>::new())
        .bind(grant)
        .fetch_all(conn)
        .await?;
    Ok(rows
        .iter()
        .filter(|row| row.get::<Option<i64>, _>("id").is_some())
        .count())
}

/// The rows of the claim `sql` (`claim_limited.sql` or `claim_turns.sql`) of `batch` on `conn`.
async fn claim_rows(
    conn: &mut sqlx::PgConnection,
    sql: String,
    batch: i64,
) -> Vec<sqlx::postgres::PgRow> {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind("default")
        .bind(batch)
        .bind(90.0_f64)
        .bind(5_i32)
        .bind("locked")
        .bind(7_i64)
        .bind(Vec::<i64>::new())
        .fetch_all(conn)
        .await
        .unwrap()
}

/// A claim of `batch` under the queue's lock (`claim_limited.sql`) on `conn`: the jobs it took.
async fn claim_under_lock(conn: &mut sqlx::PgConnection, batch: i64) -> usize {
    let locked = queue_postgres::testing::claim_limited_sql(&TableName::default());
    claim_rows(conn, locked, batch)
        .await
        .iter()
        .filter(|row| row.get::<Option<String>, _>("marker").is_none())
        .count()
}

/// A claim of `batch` under the queue's lock as a handle makes it on `conn`: `claim_limited.sql`,
/// and `claim_turns.sql` when that says the partitions must take turns (a pick that would put
/// one over its room): the jobs taken.
async fn claim_in_turns(conn: &mut sqlx::PgConnection, batch: i64) -> usize {
    let table = TableName::default();
    let mut taken = 0;
    for sql in [
        queue_postgres::testing::claim_limited_sql(&table),
        queue_postgres::testing::claim_turns_sql(&table),
    ] {
        let rows = claim_rows(conn, sql, batch).await;
        let markers: Vec<Option<String>> = rows.iter().map(|row| row.get("marker")).collect();
        taken += markers.iter().filter(|marker| marker.is_none()).count();
        assert!(
            markers.iter().flatten().all(|marker| marker == "turns"),
            "{markers:?}"
        );
        if !markers.iter().flatten().any(|marker| marker == "turns") {
            break;
        }
    }
    taken
}

/// Claims of `batch` in turns ([`claim_in_turns`]) until one takes nothing: the jobs taken.
async fn claim_in_turns_until_none(conn: &mut sqlx::PgConnection, batch: i64) -> usize {
    let mut taken = 0;
    loop {
        let claimed = claim_in_turns(conn, batch).await;
        if claimed == 0 {
            return taken;
        }
        taken += claimed;
    }
}

/// The default queue's rate log, oldest first: each entry's instant less the clock's (ahead of
/// it when positive), in milliseconds, its jobs and its grant's id (none but for a grant's).
async fn rate_log(db: &TestDb) -> Vec<(f64, i64, Option<i64>)> {
    sqlx::query_as(
        "SELECT (e ->> 0)::float8 - extract(epoch FROM clock_timestamp())::float8 * 1000,
                (e ->> 1)::bigint, (e ->> 2)::bigint
         FROM queue_jobs_queues AS c CROSS JOIN LATERAL jsonb_array_elements(c.rate_log) AS e
         WHERE c.queue = 'default'
         ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Asserts that `claim` is `claim_granted.sql`'s refusal, which undid everything it wrote.
fn assert_refused(claim: Result<usize, sqlx::Error>) {
    let err = claim.expect_err("the claim on the grant is refused");
    let server = err.as_database_error().expect("the server refused it");
    assert_eq!(server.code().as_deref(), Some("22P02"), "{err}");
    assert!(
        server
            .message()
            .contains("claim_granted: no room left of the grant"),
        "{err}"
    );
}

async fn count(db: &TestDb, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&db.pool).await.unwrap()
}

async fn in_flight(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT count(*) FROM queue_jobs WHERE status = 'in_flight'",
    )
    .await
}

async fn grants(db: &TestDb) -> i64 {
    count(db, "SELECT count(*) FROM queue_jobs_grants").await
}

/// The claims counter of the default queue's row.
async fn claims_counter(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT claims FROM queue_jobs_queues WHERE queue = 'default'",
    )
    .await
}

/// A grant of `max_in_flight = 40` takes a quarter of the room (ten jobs for eight claims of
/// five); the claim under the lock counts those ten as if in flight and takes thirty, not
/// forty; the claims on the grant then take the ten, and the queue never passes forty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_counts_the_jobs_granted() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let before = claims_counter(&db).await;
    let (grant, jobs_left, claims_left, _) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!((jobs_left, claims_left), (10, 8));
    assert_eq!(
        claims_counter(&db).await,
        before + 1,
        "a grant moves the claims counter"
    );

    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(
        claim_under_lock(&mut conn, 40).await,
        30,
        "the lock leaves the granted ten"
    );

    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 5);
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 5);
    assert_eq!(in_flight(&db).await, 40);
    assert_refused(claim_on(&mut conn, grant, 5).await);
    assert_eq!(in_flight(&db).await, 40, "the refused claim left nothing");
    drop(conn);
    db.drop_db().await;
}

/// Under `max_per_partition = 64` a grant of eight claims may put two jobs of one partition in
/// flight a claim (a 1/4 share of 64 over eight claims): the claim under the lock counts those
/// sixteen against every partition and takes 48 of one; a claim on the grant takes at most two
/// of it, and the partition never passes 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_counts_the_room_granted_per_partition() {
    let db = TestDb::new().await;
    let limits = QueueLimits {
        max_per_partition: Some(64),
        ..QueueLimits::NONE
    };
    granting::<Sqlx>(&db, limits, partitioned_jobs(100, "a")).await;
    let (grant, _, claims_left, per_claim) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!((claims_left, per_claim), (8, 2));
    let queue = support::connect_default::<Sqlx>(&db).await;
    // This handle has not seen the switch yet: no claim ahead passes it, and the lock counts
    // the grant.
    let mut under_lock = 0;
    loop {
        let taken = queue.claim(req(100)).await.unwrap().jobs.len();
        if taken == 0 {
            break;
        }
        under_lock += taken;
    }
    assert_eq!(under_lock, 48);
    let mut conn = db.pool.acquire().await.unwrap();
    for _ in 0..8 {
        assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 2, "per_claim");
    }
    assert_eq!(in_flight(&db).await, 64);
    assert_refused(claim_on(&mut conn, grant, 5).await);
    drop(conn);
    db.drop_db().await;
}

/// Two connections spend one grant's last room at once: the first holds the grant's row until
/// it commits, the second reads the row again once it may (its guard is in the update's WHERE)
/// and is refused, undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_claims_spend_a_grants_last_room_once() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let (grant, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    sqlx::query("UPDATE queue_jobs_grants SET jobs_left = 5 WHERE grant_id = $1")
        .bind(grant)
        .execute(&db.pool)
        .await
        .unwrap();
    let mut first = db.pool.begin().await.unwrap();
    assert_eq!(claim_on(&mut first, grant, 5).await.unwrap(), 5);
    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        claim_on(&mut conn, grant, 5).await
    });
    support::wait_for_a_lock_wait(&db, "the second claim never waited").await;
    first.commit().await.unwrap();
    assert_refused(second.await.unwrap());
    assert_eq!(in_flight(&db).await, 5, "the second claim left nothing");
    db.drop_db().await;
}

/// A grant counts until its row is deleted: an expired one is refused to its claims, still
/// counted by the lock, and deleted by the next grant statement, which grants from the room it
/// gave back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_grant_is_refused_and_its_room_comes_back() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let (grant, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    // The grant's expiry passes (the database's clock, moved for its row).
    sqlx::query("UPDATE queue_jobs_grants SET expires_at = now() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_refused(claim_on(&mut conn, grant, 5).await);
    assert_eq!(in_flight(&db).await, 0);
    // Still counted by the lock: 40 less its ten.
    assert_eq!(claim_under_lock(&mut conn, 35).await, 30);
    // The next grant statement deletes it, and its ten are room again at once: (40 - 30) / 4.
    let (_, jobs_left, ..) = ask_grant(&db, 2, None).await.expect("a second grant");
    assert_eq!(
        jobs_left, 2,
        "(40 - 30) / 4: the expired grant's room came back"
    );
    assert_eq!(grants(&db).await, 1, "the expired grant was deleted");
    drop(conn);
    db.drop_db().await;
}

/// A change of the limits deletes the queue's grants, whatever writes the row: the framework's
/// `set_limits`, an older release's (which knows nothing of grants), or a hand. Their claims
/// are refused; the handle's next claim goes on under the new limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_the_limits_deletes_the_grants() {
    let db = TestDb::new().await;
    let queue = granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let mut conn = db.pool.acquire().await.unwrap();

    let (grant, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    let lowered = QueueLimits {
        max_in_flight: Some(3),
        ..QueueLimits::NONE
    };
    queue.set_limits(lowered).await.unwrap();
    assert_eq!(grants(&db).await, 0);
    assert_refused(claim_on(&mut conn, grant, 5).await);
    assert_eq!(queue.claim(req(5)).await.unwrap().jobs.len(), 3);

    // An older release's write of the limits, by hand here: the trigger deletes the grants.
    queue.set_limits(FORTY_IN_FLIGHT).await.unwrap();
    let (grant, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    sqlx::query("UPDATE queue_jobs_queues SET max_in_flight = 4 WHERE queue = 'default'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(grants(&db).await, 0);
    assert_refused(claim_on(&mut conn, grant, 5).await);

    // The limits written as they were delete nothing; the switch turned off deletes them too.
    queue.set_limits(FORTY_IN_FLIGHT).await.unwrap();
    ask_grant(&db, 5, None).await.expect("a grant");
    queue.set_limits(FORTY_IN_FLIGHT).await.unwrap();
    assert_eq!(grants(&db).await, 1, "limits set as they were");
    assert!(!queue.set_room_grants(false).await.unwrap());
    assert_eq!(grants(&db).await, 0);
    assert_eq!(ask_grant(&db, 5, None).await, None, "no grant while off");
    drop(conn);
    db.drop_db().await;
}

/// No grant is given near a limit (the share of the room left is short of a batch), under a
/// rate per partition (left to the claims under the lock), or while the queue is paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_grant_near_a_limit_or_a_partition_rate_or_paused() {
    let db = TestDb::new().await;
    let limits = QueueLimits {
        max_in_flight: Some(19),
        ..QueueLimits::NONE
    };
    let queue = granting::<Sqlx>(&db, limits, plain_jobs(60)).await;
    assert_eq!(ask_grant(&db, 5, None).await, None, "19 / 4 is short of 5");
    assert!(
        ask_grant(&db, 4, None).await.is_some(),
        "a batch of four fits"
    );
    let rated = QueueLimits {
        max_in_flight: Some(40),
        rate_per_partition: Some(queue_core::RateLimit::new(3, Duration::from_secs(60)).unwrap()),
        ..QueueLimits::NONE
    };
    queue.set_limits(rated).await.unwrap();
    assert_eq!(
        ask_grant(&db, 5, None).await,
        None,
        "a quarter of a rate per partition of 3 is short of a job a slot"
    );
    queue
        .set_limits(QueueLimits {
            rate_per_partition: None,
            ..rated
        })
        .await
        .unwrap();
    queue.pause().await.unwrap();
    assert_eq!(ask_grant(&db, 5, None).await, None, "paused");
    queue.resume().await.unwrap();
    assert!(ask_grant(&db, 5, None).await.is_some());
    db.drop_db().await;
}

/// At most forty starts a minute.
fn forty_a_minute() -> QueueLimits {
    QueueLimits {
        rate: Some(queue_core::RateLimit::new(40, Duration::from_secs(60)).unwrap()),
        ..QueueLimits::NONE
    }
}

/// Under a queue rate of forty a minute a grant takes a quarter of what the rate leaves (ten
/// starts), logged in the rate's log as ten starts at the grant's expiry (twenty seconds on):
/// the lock's claims count all ten whether the grant's claims start them or not (five here,
/// then the grant returned), until a whole window after the grant's expiry (the database's
/// clock moved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_counts_a_grant_whole_until_a_window_after_it_expires() {
    let db = TestDb::new().await;
    let queue = granting::<Sqlx>(&db, forty_a_minute(), plain_jobs(100)).await;
    let (grant, jobs_left, claims_left, _) =
        ask_grant_living(&db, 5, None, Duration::from_secs(20))
            .await
            .expect("a grant");
    assert_eq!((jobs_left, claims_left), (10, 8));
    let logged: (f64, i64) = sqlx::query_as(
        "SELECT (c.rate_log -> 0 ->> 0)::float8
                    - extract(epoch FROM g.expires_at)::float8 * 1000,
                (c.rate_log -> 0 ->> 1)::bigint
         FROM queue_jobs_queues AS c JOIN queue_jobs_grants AS g ON g.queue = c.queue",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(logged.0.abs() < 1.0, "stamped at the expiry: {logged:?}");
    assert_eq!(logged.1, 10, "logged as ten starts");

    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(
        claim_under_lock(&mut conn, 40).await,
        30,
        "the lock leaves ten"
    );
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 5);
    sqlx::query("DELETE FROM queue_jobs_grants")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        claim_under_lock(&mut conn, 40).await,
        0,
        "returned, the grant still counts its ten"
    );

    let table = TableName::default();
    queue_postgres::testing::age_rows(&db.pool, &table, Duration::from_secs(60)).await;
    assert_eq!(
        claim_under_lock(&mut conn, 40).await,
        30,
        "a window on, only the grant's entry (twenty seconds later) counts"
    );
    queue_postgres::testing::age_rows(&db.pool, &table, Duration::from_secs(21)).await;
    assert_eq!(
        claim_under_lock(&mut conn, 40).await,
        10,
        "a window after the grant's expiry, only the last claim's thirty count"
    );
    assert_eq!(in_flight(&db).await, 75);
    drop(conn);
    drop(queue);
    db.drop_db().await;
}

/// A grant the grant statement deletes (its holder's, returned through it) is logged from then
/// on as the jobs its claims took, at the delete: of a grant of ten a claim took five, so the
/// next grant is a quarter of the 35 the rate then leaves (eight), and the lock leaves those
/// eight and the five.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_deleted_by_the_grant_statement_is_logged_as_its_claims_took() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, forty_a_minute(), plain_jobs(100)).await;
    let life = Duration::from_secs(20);
    let (first, ..) = ask_grant_living(&db, 5, None, life).await.expect("a grant");
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, first, 5).await.unwrap(), 5);
    let (second, jobs_left, ..) = ask_grant_living(&db, 5, Some(first), life)
        .await
        .expect("a second grant");
    assert_eq!(jobs_left, 8, "(40 - 5) / 4");
    let log = rate_log(&db).await;
    assert_eq!(log.len(), 2, "{log:?}");
    assert!(
        log[0].0 <= 0.0,
        "the first grant at its delete, past: {log:?}"
    );
    assert_eq!((log[0].1, log[0].2), (5, None), "the jobs its claims took");
    assert!(
        log[1].0 > 10_000.0,
        "the second at its expiry, ahead: {log:?}"
    );
    assert_eq!((log[1].1, log[1].2), (8, Some(second)));
    assert_eq!(claim_under_lock(&mut conn, 40).await, 27, "40 - 5 - 8");
    drop(conn);
    db.drop_db().await;
}

/// A grant whose holder died (nothing returns it) expires; another holder's grant statement
/// deletes it and logs it from then on as the jobs its claims took, at its expiry: of a grant
/// of ten a claim took five before the holder went, so the next grant is (40 - 5) / 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_grant_is_logged_as_its_claims_took_at_its_expiry() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, forty_a_minute(), plain_jobs(100)).await;
    let (first, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, first, 5).await.unwrap(), 5);
    // Three seconds on (the database's clock, moved for the rows): the grant expired a second ago.
    queue_postgres::testing::age_rows(&db.pool, &TableName::default(), Duration::from_secs(3))
        .await;
    let (second, jobs_left, ..) = ask_grant(&db, 5, None).await.expect("a second grant");
    assert_eq!(jobs_left, 8, "(40 - 5) / 4");
    let log = rate_log(&db).await;
    assert_eq!(log.len(), 2, "{log:?}");
    assert!(
        log[0].0 < -900.0,
        "the first grant at its expiry, a second or more ago, not at the delete: {log:?}"
    );
    assert_eq!((log[0].1, log[0].2), (5, None), "the jobs its claims took");
    assert_eq!((log[1].1, log[1].2), (8, Some(second)));
    drop(conn);
    db.drop_db().await;
}

/// A grant its handle returns because its claim found nothing due (`return_grant.sql`) is
/// logged from then on as the jobs its claims took, at the return: of a grant of ten the
/// handle's claims took three, and the lock then leaves 37 of the rate's forty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_returned_idle_is_logged_as_its_claims_took() {
    let db = TestDb::new().await;
    let queue = granting::<Sqlx>(&db, forty_a_minute(), plain_jobs(3)).await;
    assert_eq!(queue.claim(req(5)).await.unwrap().jobs.len(), 3);
    assert_eq!(
        count(&db, "SELECT jobs_left FROM queue_jobs_grants").await,
        7,
        "a grant of ten, three taken"
    );
    assert!(queue.claim(req(5)).await.unwrap().jobs.is_empty());
    assert_eq!(grants(&db).await, 0, "returned");
    let log = rate_log(&db).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].0 <= 0.0, "at the return, past: {log:?}");
    assert_eq!((log[0].1, log[0].2), (3, None), "the jobs its claims took");
    queue.enqueue_many(plain_jobs(50)).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_under_lock(&mut conn, 50).await, 37, "40 - 3");
    drop(conn);
    db.drop_db().await;
}

/// A grant bounds every job its claims start, takeovers included (the queue's rate counts a
/// takeover as a start): five jobs whose leases lapsed are taken over by a claim on a grant of
/// seven (a quarter of the thirty starts the rate leaves), which leaves it two; the next
/// claim takes two, and the grant is spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_bounds_its_claims_takeovers_included() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, forty_a_minute(), plain_jobs(20)).await;
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_under_lock(&mut conn, 10).await, 10);
    sqlx::query("UPDATE queue_jobs SET lease_expires_at = now() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    let (grant, jobs_left, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!(jobs_left, 7, "(40 - 10) / 4");
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 5);
    assert_eq!(
        count(&db, "SELECT count(*) FROM queue_jobs WHERE reclaims > 0").await,
        5,
        "the claim took over five lapsed leases"
    );
    assert_eq!(
        count(&db, "SELECT jobs_left FROM queue_jobs_grants").await,
        2,
        "the takeovers spent the grant"
    );
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 2);
    assert_refused(claim_on(&mut conn, grant, 5).await);
    drop(conn);
    db.drop_db().await;
}

/// A claim of five with `claim_ahead.sql` (margin four) on `conn`.
async fn run_ahead(
    ahead: String,
    conn: &mut sqlx::PgConnection,
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(ahead))
        .bind("default")
        .bind(5_i64)
        .bind(90.0_f64)
        .bind(5_i32)
        .bind("ahead")
        .bind(42_i64)
        .bind(Vec::<i64>::new())
        .bind(4_i64)
        .fetch_all(conn)
        .await
}

/// A claim ahead does not count granted room, so none passes a queue granting it: its snapshot
/// shows it 'binding', and one whose queue switched grants on while it ran fails at its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_claim_ahead_beside_grants() {
    let db = TestDb::new().await;
    let limits = QueueLimits {
        max_in_flight: Some(400),
        ..QueueLimits::NONE
    };
    let queue = granting::<Sqlx>(&db, limits, plain_jobs(60)).await;
    let ahead = queue_postgres::testing::claim_ahead_sql(&TableName::default());
    let mut conn = db.pool.acquire().await.unwrap();
    let rows = run_ahead(ahead.clone(), &mut conn).await.unwrap();
    let markers: Vec<String> = rows
        .iter()
        .filter_map(|row| row.get::<Option<String>, _>("marker"))
        .collect();
    assert_eq!(markers, ["binding"]);
    assert_eq!(in_flight(&db).await, 0);

    // Off, a claim ahead goes ahead, and one that meets the switch turned on at its end fails.
    queue.set_room_grants(false).await.unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE queue_jobs_queues
         SET room_grants = true, claims = claims + 1, grants_counted = NOT grants_counted",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let pool = db.pool.clone();
    let waiting = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        run_ahead(ahead, &mut conn).await.map(|rows| rows.len())
    });
    support::wait_for_a_lock_wait(&db, "the second claim never waited").await;
    holder.commit().await.unwrap();
    let err = waiting.await.unwrap().expect_err("the claim ahead fails");
    assert!(
        err.to_string().contains("claim_ahead: over the limits"),
        "{err}"
    );
    assert_eq!(in_flight(&db).await, 0);
    drop(conn);
    db.drop_db().await;
}

/// Through a queue handle, on either driver: with the switch on (the default of a queue whose
/// row the handle writes first, here by setting the limits) its claims take a grant and
/// spend it (the claims counter moves once for the grant, not once a claim), each claim
/// within the grant's share per partition (under `max_per_partition = 1000`, 1000 / (4 * 32):
/// seven of one partition a claim); a claim that finds nothing due returns the grant.
async fn a_handle_claims_on_grants<D: TestDriver>() {
    let db = TestDb::new().await;
    let limits = QueueLimits {
        max_per_partition: Some(1000),
        ..QueueLimits::NONE
    };
    let queue = support::connect_default::<D>(&db).await;
    // Two partitions due in turns, then one of thirty.
    let mut jobs: Vec<NewJob> = (0..20)
        .map(|n| NewJob::from_value(json!({ "n": n })).partition_key(["a", "b"][n % 2]))
        .collect();
    jobs.extend(partitioned_jobs(30, "c"));
    for job in jobs {
        queue.enqueue(job).await.unwrap();
    }
    // No switch: a queue whose row the handle writes first has grants on by default.
    queue.set_limits(limits).await.unwrap();
    let before = claims_counter(&db).await;
    for _ in 0..2 {
        assert_eq!(queue.claim(req(10)).await.unwrap().jobs.len(), 10);
    }
    let grant: (i64, i32, i32) = sqlx::query_as(
        "SELECT jobs_left, claims_left, per_claim FROM queue_jobs_grants WHERE queue = 'default'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(grant, (320 - 20, 30, 7), "a grant of 32 claims of ten");
    for _ in 0..4 {
        let batch = queue.claim(req(10)).await.unwrap().jobs;
        assert_eq!(batch.len(), 7, "the grant's share of partition c");
    }
    assert_eq!(
        claims_counter(&db).await,
        before + 1,
        "one grant, six claims"
    );
    let mut taken = 48;
    while taken < 50 {
        let n = queue.claim(req(10)).await.unwrap().jobs.len();
        assert!(n > 0);
        taken += n;
    }
    assert!(queue.claim(req(10)).await.unwrap().jobs.is_empty());
    assert_eq!(grants(&db).await, 0, "the idle handle returned its grant");
    assert_eq!(in_flight(&db).await, 50);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_claims_on_grants_sqlx() {
    a_handle_claims_on_grants::<Sqlx>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_claims_on_grants_tokio_postgres() {
    a_handle_claims_on_grants::<queue_postgres::TokioPostgres>().await;
}

/// An older release's claim under the lock, made of this release's: it counts no granted room
/// against the limits, and does not flip `grants_counted` (which says a write counts grants:
/// the fence, table migration 20261213000001).
fn older_claim_sql() -> String {
    let this_release = queue_postgres::testing::claim_limited_sql(&TableName::default());
    assert_eq!(
        this_release.matches("WHEN c.room_grants AND").count(),
        2,
        "the claim counts grants against max_in_flight and max_per_partition"
    );
    let older = this_release
        .replace("WHEN c.room_grants AND", "WHEN false AND")
        .replace("grants_counted = NOT c.grants_counted,", "");
    assert!(!older.contains("grants_counted"), "the claim flips it once");
    older
}

/// Runs [`older_claim_sql`] for a batch of `batch` on `conn`: the rows it returned.
async fn claim_as_older(
    conn: &mut sqlx::PgConnection,
    batch: i64,
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(older_claim_sql()))
        .bind("default")
        .bind(batch)
        .bind(90.0_f64)
        .bind(5_i32)
        .bind("older")
        .bind(7_i64)
        .bind(Vec::<i64>::new())
        .fetch_all(conn)
        .await
}

/// Asserts that `result` is the fence's refusal (SQLSTATE QG001), naming the queue.
fn assert_fenced<T: std::fmt::Debug>(result: Result<T, sqlx::Error>) {
    let err = result.expect_err("fenced");
    let server = err.as_database_error().expect("the server refused it");
    assert_eq!(server.code().as_deref(), Some("QG001"), "{err}");
    assert!(
        server
            .message()
            .contains("queue default has room grants on"),
        "{err}"
    );
}

/// The fence of room grants: while the switch is on, a claim of a release that does not count
/// grants fails, undone, whether a grant is held or not; so does an older tool's write of the
/// claims counter. This release's claim beside it goes through, and once the switch is off
/// (an older tool may turn it off) the older claim does too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_does_not_count_grants_is_fenced_while_the_switch_is_on() {
    let db = TestDb::new().await;
    let _queue = granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let (grant, granted, _, _) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!(granted, 10);
    let mut conn = db.pool.acquire().await.unwrap();
    let claims_before = claims_counter(&db).await;
    assert_fenced(claim_as_older(&mut conn, 5).await);
    assert_eq!(in_flight(&db).await, 0, "the fenced claim left nothing");
    assert_eq!(claims_counter(&db).await, claims_before);
    assert_fenced(
        sqlx::raw_sql("UPDATE queue_jobs_queues SET claims = claims + 1")
            .execute(&db.pool)
            .await,
    );

    // This release's claim under the lock counts the grant: 40 less its 10.
    assert_eq!(claim_under_lock(&mut conn, 40).await, 30);
    // No grant held, the switch on: still fenced.
    sqlx::query("DELETE FROM queue_jobs_grants WHERE grant_id = $1")
        .bind(grant)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_fenced(claim_as_older(&mut conn, 5).await);

    // An older tool turns the switch off (its write moves claims); the older claim goes on.
    sqlx::raw_sql("UPDATE queue_jobs_queues SET room_grants = false, claims = claims + 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let taken = claim_as_older(&mut conn, 5).await.unwrap();
    assert_eq!(taken.len(), 5);
    assert_eq!(in_flight(&db).await, 35);
    drop(conn);
    db.drop_db().await;
}

/// The fence holds on the switch, not on the grants' rows: an older claim counts the jobs in
/// flight from its snapshot, and a grant whose claim committed after that snapshot may be gone
/// by the time the older claim writes the queue's row. Here a grant statement holds the lock
/// while the older claim (snapshot taken, nothing in flight) waits for it; a claim on the grant
/// puts two jobs in flight; the grant statement deletes the spent grant and grants nothing (a
/// batch of five does not fit a quarter of the eight left), so the claims counter does not move
/// and the older claim is not stale by its own check. It must fail: it would take ten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_claim_whose_snapshot_predates_a_grant_spent_and_deleted_is_fenced() {
    let db = TestDb::new().await;
    let limits = QueueLimits {
        max_in_flight: Some(10),
        ..QueueLimits::NONE
    };
    let _queue = granting::<Sqlx>(&db, limits, plain_jobs(30)).await;
    let (grant, granted, _, _) = ask_grant(&db, 2, None).await.expect("a grant");
    assert_eq!(granted, 2, "10 / 4");

    let mut holder = db.pool.begin().await.unwrap();
    lock_queue(&mut holder).await;
    let pool = db.pool.clone();
    let older = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        claim_as_older(&mut conn, 10).await.map(|rows| rows.len())
    });
    support::wait_for_a_lock_wait(&db, "the older claim never waited").await;
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 2).await.unwrap(), 2);
    let granted = grant_under_lock(&mut holder, 5, Some(grant), Duration::from_secs(2)).await;
    assert!(
        granted.is_none(),
        "(10 - 2) / 4 is short of a batch of five"
    );
    holder.commit().await.unwrap();
    assert_eq!(grants(&db).await, 0, "the spent grant was deleted");
    assert_fenced(older.await.unwrap());
    assert_eq!(in_flight(&db).await, 2, "never more than the limit");
    drop(conn);
    db.drop_db().await;
}

/// What a grant the grant statement deletes had left comes back in that statement: of a grant
/// of ten a claim took five, and when its holder returns it through the next grant statement,
/// that grant is a quarter of the 35 left by the five in flight (eight), not of the 30 left if
/// the deleted grant's five still counted (seven).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_deleted_by_the_grant_statement_gives_its_room_back_at_once() {
    let db = TestDb::new().await;
    let _queue = granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let (first, jobs, _, _) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!(jobs, 10);
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, first, 5).await.unwrap(), 5);
    let (_, jobs, _, _) = ask_grant(&db, 5, Some(first)).await.expect("a grant");
    assert_eq!(jobs, 8, "(40 - 5 in flight) / 4");
    db.drop_db().await;
}

/// The same for max_per_partition: under 72, a grant of eight claims gets two jobs of a
/// partition a claim (72 / 32), and one claim takes two of partition a. Returned through the
/// next grant statement, its least of per_claim * claims_left and jobs_left (2 * 7) no longer
/// counts: the next grant's share is (72 - 2) / 32 = 2 again, not (72 - 2 - 14) / 32 = 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_grant_gives_its_share_of_a_partition_back_at_once() {
    let db = TestDb::new().await;
    let limits = QueueLimits {
        max_per_partition: Some(72),
        ..QueueLimits::NONE
    };
    let _queue = granting::<Sqlx>(&db, limits, partitioned_jobs(60, "a")).await;
    let (first, _, claims, per_claim) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!((claims, per_claim), (8, 2));
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, first, 5).await.unwrap(), 2);
    let (_, _, claims, per_claim) = ask_grant(&db, 5, Some(first)).await.expect("a grant");
    assert_eq!((claims, per_claim), (8, 2));
    db.drop_db().await;
}

/// A switch turned off by hand (a write that moves no counter) still makes every claim whose
/// snapshot predates it stale (the trigger `<table>_grants_switch` moves the claims counter):
/// here a claim under the lock takes its snapshot while the hand's transaction holds the row,
/// a claim on a grant of ten puts them in flight meanwhile, and the hand turns the switch off,
/// which deletes the grant. Read with the switch off, the claim would count no grant and, from
/// its snapshot, nothing in flight: forty more under a limit of forty. It claims nothing, and
/// the next claim takes the thirty left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_turned_off_by_hand_makes_older_snapshots_stale() {
    let db = TestDb::new().await;
    let _queue = granting::<Sqlx>(&db, FORTY_IN_FLIGHT, plain_jobs(60)).await;
    let (grant, granted, _, _) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!(granted, 10);

    let mut hand = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM queue_jobs_queues WHERE queue = 'default' FOR UPDATE")
        .execute(&mut *hand)
        .await
        .unwrap();
    let pool = db.pool.clone();
    let locked = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        claim_under_lock(&mut conn, 40).await
    });
    support::wait_for_a_lock_wait(&db, "the claim never waited").await;
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 5);
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 5);
    sqlx::query("UPDATE queue_jobs_queues SET room_grants = false")
        .execute(&mut *hand)
        .await
        .unwrap();
    hand.commit().await.unwrap();
    assert_eq!(
        grants(&db).await,
        0,
        "turning the switch off deleted the grant"
    );
    assert_eq!(locked.await.unwrap(), 0, "stale: it claimed nothing");
    assert_eq!(in_flight(&db).await, 10);
    assert_eq!(claim_under_lock(&mut conn, 40).await, 30);
    assert_eq!(in_flight(&db).await, 40, "never more than the limit");
    db.drop_db().await;
}

/// The schema check refuses a table whose fence is gone: a trigger of room grants disabled by
/// hand is named, with the migration that brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_check_refuses_a_disabled_fence() {
    let db = TestDb::new().await;
    let _queue = support::connect_default::<Sqlx>(&db).await;
    let pool = support::pool::<Sqlx>(&db, 1);
    PostgresQueue::<Sqlx>::check_schema(&pool, &TableName::default())
        .await
        .unwrap();
    sqlx::raw_sql("ALTER TABLE queue_jobs_queues DISABLE TRIGGER queue_jobs_grants_fence")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = PostgresQueue::<Sqlx>::check_schema(&pool, &TableName::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("trigger queue_jobs_grants_fence on queue_jobs_queues")
            && err.contains("20261213000001"),
        "{err}"
    );
    drop(pool);
    db.drop_db().await;
}

/// A handle that switches grants on and then sets the limits claims on a grant at once: the
/// write of the limits reads the switch with them. It used to keep the switch as last seen
/// (off) and mark the limits fresh, so the handle claimed under the lock until it read them
/// again, a second later, or never while its claims took the lock at least once a second (so
/// did the lock's read of the limits): one bench drain in four ran at the claims ahead's speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_that_sets_the_limits_after_the_switch_claims_on_grants() {
    let db = TestDb::new().await;
    let queue = support::connect_default::<Sqlx>(&db).await;
    queue.enqueue_many(plain_jobs(20)).await.unwrap();
    assert!(queue.set_room_grants(true).await.unwrap());
    queue.set_limits(FORTY_IN_FLIGHT).await.unwrap();
    assert_eq!(queue.claim(req(5)).await.unwrap().jobs.len(), 5);
    assert_eq!(grants(&db).await, 1, "the claim took a grant");
    db.drop_db().await;
}

/// The switch of a queue's row as stored (`None`: no row).
async fn stored_switch(db: &TestDb, queue: &str) -> Option<bool> {
    sqlx::query_scalar("SELECT room_grants FROM queue_jobs_queues WHERE queue = $1")
        .bind(queue)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// A queue's row starts with room grants as the handle that writes it first is configured
/// (`PgQueueConfig::room_grants_for_new_queues`, on by default), whichever of its writes comes
/// first (its limits, a pause, the served mark, a fenced outcome counted); a row written before
/// keeps its switch whatever handle writes it after, and an older release's row (its insert
/// names no switch) starts off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_row_starts_with_room_grants_as_its_first_writer_is_configured() {
    let db = TestDb::new().await;
    let on = support::connect_default::<Sqlx>(&db).await;
    let off = support::connect_claiming_ahead::<Sqlx>(&db).await;
    assert!(on.config().room_grants_for_new_queues);
    let for_queue = |handle: &PostgresQueue<Sqlx>, name: &str| {
        handle.for_queue(queue_core::QueueName::new(name).unwrap())
    };
    async fn write(handle: &PostgresQueue<Sqlx>, how: &str) {
        match how {
            "limits" => drop(handle.set_limits(FORTY_IN_FLIGHT).await.unwrap()),
            "pause" => drop(handle.pause().await.unwrap()),
            "served" => handle.note_served().await.unwrap(),
            "stale" => handle.record_stale(1).await.unwrap(),
            _ => unreachable!(),
        }
    }
    let writes = ["limits", "pause", "served", "stale"];
    for how in writes {
        for (handle, switch) in [(&on, true), (&off, false)] {
            let name = format!("{how}-{switch}");
            write(&for_queue(handle, &name), how).await;
            assert_eq!(stored_switch(&db, &name).await, Some(switch), "{name}");
            // Every write of the other handle after: the row keeps its switch.
            let other = if switch { &off } else { &on };
            for later in writes {
                write(&for_queue(other, &name), later).await;
            }
            assert_eq!(
                stored_switch(&db, &name).await,
                Some(switch),
                "{name}, kept"
            );
        }
    }
    sqlx::query("INSERT INTO queue_jobs_queues (queue, served_at) VALUES ('older', now())")
        .execute(&db.pool)
        .await
        .unwrap();
    write(&for_queue(&on, "older"), "limits").await;
    assert_eq!(stored_switch(&db, "older").await, Some(false));
    db.drop_db().await;
}

/// At most `starts` starts of each partition a day: a window no test crosses but once in a
/// great while, which a test that moves the clock moves whole.
fn per_partition_a_day(starts: u32) -> QueueLimits {
    per_partition_per(starts, Duration::from_secs(86_400))
}

fn per_partition_per(starts: u32, window: Duration) -> QueueLimits {
    QueueLimits {
        rate_per_partition: Some(queue_core::RateLimit::new(starts, window).unwrap()),
        ..QueueLimits::NONE
    }
}

/// The slot of partition keys `key` falls in (`claim_slot.sql`: 512 of them).
async fn slot_of(db: &TestDb, key: &str) -> i32 {
    sqlx::query_scalar("SELECT (hashtextextended($1, 0) & 511)::integer")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// `n` partition keys, each in a slot of its own.
async fn keys_in_distinct_slots(db: &TestDb, n: usize) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    let mut slots = Vec::new();
    for i in 0.. {
        let key = format!("k{i}");
        let slot = slot_of(db, &key).await;
        if !slots.contains(&slot) {
            keys.push(key);
            slots.push(slot);
        }
        if keys.len() == n {
            break;
        }
    }
    keys
}

/// Another partition key in the slot of `key`.
async fn slot_mate(db: &TestDb, key: &str) -> String {
    sqlx::query_scalar(
        "SELECT 'k' || i FROM generate_series(1, 1000000) AS i
         WHERE (hashtextextended('k' || i, 0) & 511) = (hashtextextended($1, 0) & 511)
           AND 'k' || i <> $1
         LIMIT 1",
    )
    .bind(key)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// The default queue's tally of its rate per partition: `(jobs, untracked, before,
/// slot_before, bucket, at)`, the untracked jobs being those every slot is charged.
async fn tally(db: &TestDb) -> (i64, i64, i64, i64, i64, Option<f64>) {
    sqlx::query_as(
        "SELECT (t ->> 'jobs')::bigint, (t ->> 'jobs')::bigint - (t ->> 'slots_jobs')::bigint,
                (t ->> 'before')::bigint, (t ->> 'slot_before')::bigint,
                (t ->> 'bucket')::bigint, (t ->> 'at')::float8
         FROM (SELECT partition_tally AS t FROM queue_jobs_queues WHERE queue = 'default') AS c",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Under a rate per partition of 400 a day a grant of eight claims of five, at most one job of
/// a slot of partition keys a claim (a batch of five picks far less than a job a slot), is
/// charged to the queue's tally at once, whole: its 40 jobs to the sum, and a job of every slot
/// for each of its eight claims to the jobs every slot is charged. Its claim takes one job of
/// each of three partitions in three slots, logged in a row of its own; the grant statement
/// that deletes the grant gives back the 37 jobs and the seven claims it left, so the tally
/// holds the three jobs, one a slot, and the next grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_under_a_partition_rate_is_charged_whole_and_gives_back_what_it_left() {
    let db = TestDb::new().await;
    let jobs = keys_in_distinct_slots(&db, 3)
        .await
        .iter()
        .flat_map(|key| partitioned_jobs(1, key))
        .collect();
    granting::<Sqlx>(&db, per_partition_a_day(400), jobs).await;
    let (grant, jobs_left, claims_left, per_claim) =
        ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!((jobs_left, claims_left, per_claim), (40, 8, 1));
    let (jobs, untracked, ..) = tally(&db).await;
    assert_eq!((jobs, untracked), (40, 8), "charged whole at the grant");

    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 3);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM queue_jobs_claim_starts WHERE claim < 0 AND cardinality(keys) = 3"
        )
        .await,
        1,
        "the claim's jobs per partition, in a row of its own"
    );
    let (_, jobs_left, claims_left, _) =
        ask_grant(&db, 5, Some(grant)).await.expect("another grant");
    assert_eq!((jobs_left, claims_left), (40, 8));
    let (jobs, untracked, ..) = tally(&db).await;
    assert_eq!(
        (jobs, untracked),
        (3 + 40, 1 + 8),
        "the first grant gave back what it left"
    );
    drop(conn);
    db.drop_db().await;
}

/// Under a rate per partition a claim on a grant takes at most its `per_claim` of one slot of
/// partition keys, two partitions of one slot together, takeovers of lapsed leases included:
/// with a lease of the slot lapsed and a job of it due, the next claim takes the earlier of
/// the two, not both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_grant_under_a_partition_rate_keeps_to_its_cap_a_slot_takeovers_included() {
    let db = TestDb::new().await;
    let mate = slot_mate(&db, "k0").await;
    let mut jobs = partitioned_jobs(1, "k0");
    jobs.extend(partitioned_jobs(1, &mate));
    granting::<Sqlx>(&db, per_partition_a_day(400), jobs).await;
    let (grant, _, _, per_claim) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!(per_claim, 1);
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(
        claim_on(&mut conn, grant, 5).await.unwrap(),
        1,
        "one job of the slot a claim"
    );
    sqlx::query("UPDATE queue_jobs SET lease_expires_at = now() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        claim_on(&mut conn, grant, 5).await.unwrap(),
        1,
        "the lapsed lease (the earlier job) or the due job, not both"
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM queue_jobs WHERE reclaims > 0").await,
        1,
        "the earlier job was taken over"
    );
    assert_eq!(in_flight(&db).await, 1, "the other waits");
    drop(conn);
    db.drop_db().await;
}

/// A backlog of few partitions gets a larger cap a slot: half the most of one slot among the
/// next batch due. Twenty jobs of one partition, claims of ten: a cap of five, not one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_under_a_partition_rate_sizes_its_cap_a_slot_by_the_backlog() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, per_partition_a_day(4000), partitioned_jobs(20, "p")).await;
    let (grant, _, claims_left, per_claim) = ask_grant(&db, 10, None).await.expect("a grant");
    assert_eq!((claims_left, per_claim), (8, 5));
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 10).await.unwrap(), 5);
    drop(conn);
    db.drop_db().await;
}

/// A grant under a rate per partition that its handle returns because its claim found nothing
/// due (`return_grant.sql`) gives back what it left, as a grant statement's delete does: the
/// tally holds the three jobs its one claim took, one a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_under_a_partition_rate_returned_idle_gives_back_what_it_left() {
    let db = TestDb::new().await;
    let jobs = keys_in_distinct_slots(&db, 3)
        .await
        .iter()
        .flat_map(|key| partitioned_jobs(1, key))
        .collect();
    let queue = granting::<Sqlx>(&db, per_partition_a_day(400), jobs).await;
    assert_eq!(queue.claim(req(5)).await.unwrap().jobs.len(), 3);
    assert_eq!(grants(&db).await, 1, "claimed on a grant");
    assert!(queue.claim(req(5)).await.unwrap().jobs.is_empty());
    assert_eq!(grants(&db).await, 0, "returned");
    let (jobs, untracked, ..) = tally(&db).await;
    assert_eq!((jobs, untracked), (3, 1));
    db.drop_db().await;
}

/// The counts per partition, which a claim under the lock reads while the tally cannot bound
/// it (here the rate's window changed, which starts the tally again), count the jobs claims on
/// grants started: of a rate of four a day, a grant's claim started one of the partition, so
/// the claims under the lock start three more, not four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counts_per_partition_count_the_claims_on_grants() {
    let db = TestDb::new().await;
    let queue = granting::<Sqlx>(&db, per_partition_a_day(4), partitioned_jobs(10, "p")).await;
    let (grant, _, claims_left, per_claim) = ask_grant(&db, 5, None).await.expect("a grant");
    assert_eq!(
        (claims_left, per_claim),
        (1, 1),
        "a quarter of four: one job, one claim"
    );
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 1);
    queue
        .set_limits(per_partition_per(4, Duration::from_secs(43_200)))
        .await
        .unwrap();
    assert_eq!(grants(&db).await, 0, "the change deleted the grant");
    let taken = claim_in_turns_until_none(&mut conn, 10).await;
    assert_eq!(taken, 3, "four a window, one started on the grant");
    assert_eq!(in_flight(&db).await, 4);
    drop(conn);
    db.drop_db().await;
}

/// The counts per partition also count what a grant still alive may start: of a rate of eight
/// a day, a grant of two claims of one job (a slot's cap of one) whose first claim started one
/// job of the partition may start one more, so the claims under the lock start six, and the partition
/// ends at eight once the grant's second claim takes its one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counts_per_partition_count_what_a_live_grant_may_start() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, per_partition_a_day(8), partitioned_jobs(20, "p")).await;
    let (grant, _, claims_left, per_claim) = ask_grant(&db, 1, None).await.expect("a grant");
    assert_eq!((claims_left, per_claim), (2, 1));
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 1).await.unwrap(), 1);
    let taken = claim_in_turns_until_none(&mut conn, 10).await;
    assert_eq!(
        taken, 6,
        "eight a window, one started on the grant and one it may start"
    );
    assert_eq!(claim_on(&mut conn, grant, 1).await.unwrap(), 1);
    assert_eq!(in_flight(&db).await, 8);
    drop(conn);
    db.drop_db().await;
}

/// The grant statement moves the tally to the window of its instant itself, first giving back
/// what an expired grant of the window before left (the clock moved a whole window on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grant_statement_moves_the_tally_on_giving_back_what_the_window_before_left() {
    let db = TestDb::new().await;
    let jobs = partitioned_jobs(1, "k0");
    granting::<Sqlx>(&db, per_partition_a_day(400), jobs).await;
    let (grant, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(claim_on(&mut conn, grant, 5).await.unwrap(), 1);
    drop(conn);
    let (.., bucket, _) = tally(&db).await;
    queue_postgres::testing::age_rows(&db.pool, &TableName::default(), Duration::from_secs(86_400))
        .await;
    assert!(ask_grant(&db, 5, None).await.is_some());
    let (jobs, untracked, before, slot_before, moved, _) = tally(&db).await;
    assert_eq!(moved, bucket, "a window on (the rows moved a window back)");
    assert_eq!(
        (jobs, untracked, before, slot_before),
        (40, 8, 1, 1),
        "the window before: the expired grant's one job, one a slot"
    );
    db.drop_db().await;
}

/// A grant under a rate per partition expires no later than the end of the window it is
/// charged to: a window of about an hour chosen to end two to three seconds after the grant,
/// whose life of ten seconds it cuts (or, on a machine slow enough to pass the end first, the
/// next window, which does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_under_a_partition_rate_ends_with_its_window() {
    let db = TestDb::new().await;
    let now_ms: f64 = count_f64(
        &db,
        "SELECT extract(epoch FROM clock_timestamp())::float8 * 1000",
    )
    .await;
    let window_ms = (3_600_000_u64..)
        .find(|ms| (2_000..3_000).contains(&(ms - (now_ms as u64) % ms)))
        .unwrap();
    let limits = per_partition_per(400, Duration::from_millis(window_ms));
    granting::<Sqlx>(&db, limits, partitioned_jobs(1, "k0")).await;
    let (_, jobs_left, ..) = ask_grant_living(&db, 5, None, Duration::from_secs(10))
        .await
        .expect("a grant");
    assert_eq!(jobs_left, 40);
    let (.., at) = tally(&db).await;
    let at = at.expect("the grant's instant");
    let window_end = ((at as u64) / window_ms + 1) * window_ms;
    let expires_ms = count_f64(
        &db,
        "SELECT extract(epoch FROM expires_at)::float8 * 1000 FROM queue_jobs_grants",
    )
    .await;
    let expected = (window_end as f64).min(at + 10_000.0);
    assert!(
        (expires_ms - expected).abs() < 1.0,
        "expires at {expires_ms}, not {expected} (granted at {at}, window ends {window_end})"
    );
    db.drop_db().await;
}

async fn count_f64(db: &TestDb, sql: &'static str) -> f64 {
    sqlx::query_scalar(sql).fetch_one(&db.pool).await.unwrap()
}

/// A handle's return of its grant (`return_grant.sql`) under a rate takes the queue's row
/// before the grant's, as the grant statement and the trigger do: a return waiting behind a
/// grant statement that holds the row and then deletes the same grant (expired: the grants of
/// a window all expire at its end) goes on once that commits, and neither deadlocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_takes_the_queues_row_before_the_grants() {
    let db = TestDb::new().await;
    granting::<Sqlx>(&db, per_partition_a_day(400), partitioned_jobs(3, "k0")).await;
    let (grant, ..) = ask_grant(&db, 5, None).await.expect("a grant");
    sqlx::query("UPDATE queue_jobs_grants SET expires_at = now() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    lock_queue(&mut tx).await;
    let returned = tokio::spawn({
        let pool = db.pool.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(
                queue_postgres::testing::return_grant_sql(&TableName::default()),
            ))
            .bind("default")
            .bind(grant)
            .execute(&pool)
            .await
        }
    });
    support::wait_for_a_lock_wait(&db, "the return waits for the queue's row").await;
    let fresh = grant_under_lock(&mut tx, 5, None, Duration::from_secs(2)).await;
    assert!(fresh.is_some(), "the expired grant swept, another given");
    tx.commit().await.unwrap();
    let returned = returned.await.unwrap().expect("no deadlock");
    assert_eq!(
        returned.rows_affected(),
        0,
        "the grant was gone: nothing to give back"
    );
    assert_eq!(grants(&db).await, 1, "the new grant");
    db.drop_db().await;
}
