//! The `queuectl` binary against a scratch database: every subcommand, its output, its exit
//! code, and what it changed (or did not) in the table.

use std::time::Duration;

use assert_cmd::Command;
use chrono::{DateTime, Utc};
use queue_core::{
    Admin, Backend, ClaimRequest, Finalize, FinalizeOutcome, JobId, JobStatus, Lease, NewJob,
    QueueName, ScheduleReport,
};
use queue_postgres::testing::ScratchDb;
use queue_postgres::{PgQueue, TableName};
use serde_json::{Value, json};

fn url(db: &ScratchDb) -> String {
    format!("{}/{}", queue_postgres::testing::server_url(), db.name)
}

fn ctl(db: &ScratchDb) -> Command {
    let mut command = Command::cargo_bin("queuectl").expect("the queuectl binary");
    command.env("DATABASE_URL", url(db)).env_remove("RUST_LOG");
    command
}

/// Runs `args`, expects `code`, returns stdout parsed as JSON (the commands run with --json).
fn json_of(db: &ScratchDb, args: &[&str], code: i32) -> Value {
    let output = ctl(db)
        .arg("--json")
        .args(args)
        .output()
        .expect("run queuectl");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(code),
        "queuectl {args:?}: stdout {stdout} stderr {stderr}"
    );
    serde_json::from_str(&stdout).unwrap_or(Value::Null)
}

/// Ends the next claimable job (`id`) with `action`, claimed under `holder`.
async fn end(queue: &PgQueue, id: JobId, holder: &str, action: Finalize) {
    let job = queue
        .claim(ClaimRequest::new(1, Lease::DEFAULT).holder(holder))
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!(job.id, id);
    assert_eq!(
        queue.finalize(job.claim(), &action).await.unwrap(),
        FinalizeOutcome::Applied
    );
}

async fn status_of(queue: &PgQueue, id: JobId) -> JobStatus {
    queue.get(id).await.unwrap().unwrap().status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_the_standard_and_a_named_table() {
    let db = ScratchDb::empty().await;
    let done = json_of(&db, &["migrate"], 0);
    assert_eq!(done, json!({ "table": "queue_jobs", "ready": true }));
    json_of(&db, &["migrate"], 0);
    json_of(&db, &["--table", "mail_jobs", "migrate"], 0);
    PgQueue::check_schema(&db.pool, &TableName::new("mail_jobs").unwrap())
        .await
        .expect("the named table is on the lease schema");
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_jobs_and_lease_show_what_the_queue_holds() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    let dead = queue
        .enqueue(
            NewJob::new(&json!({ "card": "4111 1111 1111 1111" }))
                .unwrap()
                .unique_key("order-9"),
        )
        .await
        .unwrap()
        .id;
    end(
        &queue,
        dead,
        "host-a:1",
        Finalize::Dead {
            reason: "poison".into(),
        },
    )
    .await;
    let partitioned = queue
        .enqueue(NewJob::from_value(json!({ "n": 0 })).partition_key("partner-7"))
        .await
        .unwrap()
        .id;
    for n in 1..3 {
        queue
            .enqueue(NewJob::new(&json!({ "n": n })).unwrap())
            .await
            .unwrap();
    }
    let running = queue
        .claim(ClaimRequest::new(1, Lease::DEFAULT).holder("host-b:2"))
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!(running.id, partitioned, "the earliest job runs");

    let status = json_of(&db, &["status"], 0);
    let default = &status["queues"][0];
    assert_eq!(default["queue"], "default");
    assert_eq!(
        (default["due"].as_u64(), default["in_flight"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(default["finished_last_hour"]["dead"], 1);
    assert_eq!(default["paused"], false);

    let listed = json_of(&db, &["jobs", "list", "--state", "dead"], 0);
    assert_eq!(listed["jobs"].as_array().unwrap().len(), 1);
    assert_eq!(listed["jobs"][0]["id"], dead.0);
    assert_eq!(listed["next"], Value::Null);
    let page = json_of(&db, &["jobs", "list", "--limit", "2"], 0);
    assert_eq!(page["jobs"].as_array().unwrap().len(), 2);
    let cursor = page["next"].as_i64().expect("a next page");
    let rest = json_of(&db, &["jobs", "list", "--before", &cursor.to_string()], 0);
    assert_eq!(rest["jobs"].as_array().unwrap().len(), 2);

    let shown = json_of(&db, &["jobs", "show", &dead.0.to_string()], 0);
    assert_eq!(shown["status"], "dead");
    assert!(
        shown.get("payload").is_none(),
        "payload shown unasked: {shown}"
    );
    assert_eq!(shown["errors"][0]["worker"], "host-a:1");
    assert_eq!(shown["errors"][0]["outcome"], "dead");
    assert_eq!(shown["unique_key"], "order-9");
    assert_eq!(shown["partition_key"], Value::Null);
    let text = ctl(&db)
        .args(["jobs", "show", &dead.0.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        !text.contains("4111"),
        "the payload leaked into the table: {text}"
    );
    assert!(text.contains("hidden (--show-payload)"));
    assert!(
        text.contains("  unique key    order-9\n  partition     -\n"),
        "no partition: -, below the unique key: {text}"
    );
    // A job's partition key, in the text and the JSON, and in the listings' JSON.
    let shown = json_of(&db, &["jobs", "show", &partitioned.0.to_string()], 0);
    assert_eq!(shown["partition_key"], "partner-7");
    assert_eq!(shown["unique_key"], Value::Null);
    let text = ctl(&db)
        .args(["jobs", "show", &partitioned.0.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("  unique key    -\n  partition     partner-7\n"),
        "the partition key, below the unique key: {text}"
    );
    let running_list = json_of(&db, &["jobs", "list", "--state", "in-flight"], 0);
    assert_eq!(running_list["jobs"][0]["partition_key"], "partner-7");
    let with_payload = json_of(
        &db,
        &["jobs", "show", &dead.0.to_string(), "--show-payload"],
        0,
    );
    assert_eq!(with_payload["payload"]["card"], "4111 1111 1111 1111");
    let found = json_of(&db, &["jobs", "find", "order-9"], 0);
    assert_eq!(found["id"], dead.0);
    json_of(&db, &["jobs", "find", "order-10"], 3);

    let leases = json_of(&db, &["lease"], 0);
    let lease = &leases["jobs"][0];
    assert_eq!(lease["id"], running.id.0);
    assert_eq!(lease["holder"], "host-b:2");
    assert_eq!(lease["partition_key"], "partner-7");
    assert_eq!(lease["generation"], 1);
    let text = ctl(&db).arg("lease").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("partition") && text.contains("partner-7"),
        "the lease table names the partition: {text}"
    );
    let left = lease["lease_left_ms"].as_i64().unwrap();
    assert!(left > 0 && left <= 90_000, "{left}");
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_and_cancel_change_only_what_they_are_asked_to() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    let dead = queue.enqueue(NewJob::new(&1).unwrap()).await.unwrap().id;
    end(
        &queue,
        dead,
        "w",
        Finalize::Dead {
            reason: "poison".into(),
        },
    )
    .await;
    let pending = queue.enqueue(NewJob::new(&2).unwrap()).await.unwrap().id;

    let retried = json_of(&db, &["jobs", "retry", &dead.0.to_string()], 0);
    assert_eq!(retried["jobs"][0]["result"], "retried");
    assert_eq!(status_of(&queue, dead).await, JobStatus::Pending);
    let again = json_of(&db, &["jobs", "retry", &dead.0.to_string()], 4);
    assert_eq!(again["jobs"][0]["result"], "refused");
    json_of(&db, &["jobs", "retry", "999999"], 3);

    // Not confirmed (no terminal, no --yes): nothing changes.
    let refused = ctl(&db)
        .args(["jobs", "cancel", &pending.0.to_string()])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(5));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--yes"));
    assert_eq!(status_of(&queue, pending).await, JobStatus::Pending);
    let cancelled = json_of(&db, &["jobs", "cancel", "--yes", &pending.0.to_string()], 0);
    assert_eq!(cancelled["jobs"][0]["result"], "cancelled");
    assert_eq!(status_of(&queue, pending).await, JobStatus::Cancelled);
    json_of(&db, &["jobs", "cancel", "--yes", &pending.0.to_string()], 4);

    // Every cancelled job at once.
    let all = json_of(
        &db,
        &["jobs", "retry", "--all", "--state", "cancelled", "--yes"],
        0,
    );
    assert_eq!(all["jobs"].as_array().unwrap().len(), 1);
    assert_eq!(status_of(&queue, pending).await, JobStatus::Pending);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_pause_resume_and_drain() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    for n in 0..3 {
        let id = queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap().id;
        end(&queue, id, "w", Finalize::Complete).await;
    }
    queue_postgres::testing::age_rows(&db.pool, &TableName::default(), Duration::from_secs(7_200))
        .await;
    let fresh = queue.enqueue(NewJob::new(&9).unwrap()).await.unwrap().id;
    end(&queue, fresh, "w", Finalize::Complete).await;
    json_of(
        &db,
        &["purge", "--older-than", "1h", "--state", "completed"],
        5,
    );
    let purged = json_of(
        &db,
        &[
            "purge",
            "--older-than",
            "1h",
            "--state",
            "completed",
            "--batch-size",
            "2",
            "--yes",
        ],
        0,
    );
    assert_eq!(purged["deleted"], 3);
    assert!(
        queue.get(fresh).await.unwrap().is_some(),
        "a recent job was purged"
    );

    let paused = json_of(&db, &["queue", "pause"], 0);
    assert_eq!(paused["paused"], true);
    let status = json_of(&db, &["status"], 0);
    assert_eq!(status["queues"][0]["paused"], true);
    let id = queue.enqueue(NewJob::new(&10).unwrap()).await.unwrap().id;
    assert!(
        queue
            .claim(ClaimRequest::new(1, Lease::DEFAULT))
            .await
            .unwrap()
            .jobs
            .is_empty()
    );
    json_of(&db, &["queue", "resume"], 0);
    let running = queue
        .claim(ClaimRequest::new(1, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!(running.id, id);

    let timed_out = json_of(&db, &["queue", "drain", "--timeout", "200ms"], 6);
    assert_eq!(
        (
            timed_out["running"].as_u64(),
            timed_out["drained"].as_bool()
        ),
        (Some(1), Some(false))
    );
    let done = queue
        .finalize(running.claim(), &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(done, FinalizeOutcome::Applied);
    let drained = json_of(&db, &["queue", "drain", "--timeout", "10s"], 0);
    assert_eq!(drained["drained"], true);
    json_of(&db, &["queue", "resume"], 0);
    db.drop_db().await;
}

/// Limits set by queuectl hold for a worker's handle in another process at once, show in
/// `status` (text and JSON), and go when set without values; bad values change nothing.
/// `queue grants on|off` switches the queue's room grants, as another process's handle sees
/// them: on, a handle of the queue claims on a grant (a row of `queue_jobs_grants`); off, the
/// grant is deleted and the handle claims under the queue's lock. A queue whose row the command
/// writes first starts as `--room-grants-for-new-queues` says (on by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_grants_switches_room_grants() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    for n in 0..20 {
        queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
    }
    let first = ["queue", "limit", "--max-in-flight", "400"];
    json_of(
        &db,
        &[&first[..], &["--room-grants-for-new-queues", "off"]].concat(),
        0,
    );
    assert!(!queue.room_grants().await.unwrap(), "the row starts off");
    json_of(
        &db,
        &[
            "queue",
            "limit",
            "--max-in-flight",
            "400",
            "--queue",
            "other",
        ],
        0,
    );
    let other = queue_core::Admin::for_queue(&queue, queue_core::QueueName::new("other").unwrap());
    assert!(
        other.room_grants().await.unwrap(),
        "a new queue's row starts on by default"
    );
    let on = json_of(&db, &["queue", "grants", "on"], 0);
    assert_eq!(on, json!({ "queue": "default", "room_grants": true }));
    assert!(queue.room_grants().await.unwrap());
    let status = json_of(&db, &["status"], 0);
    assert_eq!(status["queues"][0]["room_grants"], true);
    let text = ctl(&db).arg("status").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("at most 400 in flight (room grants on)"),
        "{text}"
    );
    let grants = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM queue_jobs_grants")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let claimed = queue
        .claim(ClaimRequest::new(2, Lease::DEFAULT))
        .await
        .unwrap();
    assert_eq!(claimed.jobs.len(), 2);
    assert_eq!(grants().await, 1, "the handle claimed on a grant");
    let said = ctl(&db).args(["queue", "grants", "off"]).output().unwrap();
    assert_eq!(said.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(said.stdout).unwrap(),
        "queue default: room grants off\n"
    );
    assert_eq!(grants().await, 0, "switched off, the grants are deleted");
    assert!(!queue.room_grants().await.unwrap());
    let bad = ctl(&db)
        .args(["queue", "grants", "maybe"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "a usage error");
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_limit_sets_shows_and_clears_the_limits() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    // Four jobs of one partner first, then two without a partition.
    let mut partner = Vec::new();
    for n in 0..4 {
        let job = NewJob::from_value(json!({ "n": n })).partition_key("partner-1");
        partner.push(queue.enqueue(job).await.unwrap().id);
    }
    for n in 4..6 {
        queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
    }
    let set = json_of(
        &db,
        &[
            "queue",
            "limit",
            "--max-in-flight",
            "3",
            "--rate",
            "5/1m",
            "--max-per-partition",
            "2",
            "--rate-per-partition",
            "10/1s",
        ],
        0,
    );
    assert_eq!(set["limits"]["max_in_flight"], 3);
    assert_eq!(set["limits"]["rate"]["starts"], 5);
    assert_eq!(set["limits"]["rate"]["per_ms"], 60_000);
    assert_eq!(set["limits"]["max_per_partition"], 2);
    assert_eq!(
        set["limits"]["rate_per_partition"],
        json!({ "starts": 10, "per_ms": 1_000 })
    );
    let status = json_of(&db, &["status"], 0);
    assert_eq!(status["queues"][0]["limits"], set["limits"]);
    let all_four = "at most 3 in flight, 5 starts per 60s, at most 2 in flight per partition, \
                    10 starts per 1s per partition";
    let text = ctl(&db).arg("status").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains(all_four), "{text}");
    let said = ctl(&db)
        .args(["queue", "limit", "--max-in-flight", "3", "--rate", "5/1m"])
        .args(["--max-per-partition", "2", "--rate-per-partition", "10/1s"])
        .output()
        .unwrap();
    assert_eq!(said.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(said.stdout).unwrap(),
        format!("queue default: {all_four}\n"),
        "the command's own line names every limit"
    );

    // The partner's two earliest jobs; then the partner is at its limit, and the queue has
    // room for one more: a job without a partition.
    let first = queue
        .claim(ClaimRequest::new(2, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    let mut ids: Vec<i64> = first.iter().map(|job| job.id.0).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        [partner[0].0, partner[1].0],
        "the earliest jobs: the partner's"
    );
    let second = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert_eq!(second.len(), 1, "at most 3 in flight");
    assert!(
        !partner.contains(&second[0].id),
        "at most 2 of one partition in flight: {:?}",
        second[0].id
    );

    json_of(&db, &["queue", "limit", "--max-in-flight", "0"], 2);
    json_of(&db, &["queue", "limit", "--rate", "0/1m"], 2);
    json_of(&db, &["queue", "limit", "--rate", "5"], 2);
    json_of(&db, &["queue", "limit", "--max-per-partition", "0"], 2);
    let refused = ctl(&db)
        .args(["queue", "limit", "--max-per-partition", "0"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("--max-per-partition") && stderr.contains("'0'"),
        "{stderr}"
    );
    // A bad rate per partition: exit 2, the option, the value and what is wrong with it.
    for (bad, why) in [
        ("0/1s", "0 is outside 1 to 100000"),
        ("5/0s", "outside 1 ms to a day"),
        ("garbage", "expected STARTS/WINDOW"),
        ("5/soon", "try 500ms"),
    ] {
        json_of(&db, &["queue", "limit", "--rate-per-partition", bad], 2);
        let refused = ctl(&db)
            .args(["queue", "limit", "--max-in-flight", "1"])
            .args(["--rate-per-partition", bad])
            .output()
            .unwrap();
        assert_eq!(refused.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(
            stderr.contains("--rate-per-partition")
                && stderr.contains(&format!("'{bad}'"))
                && stderr.contains(why),
            "{bad}: {stderr}"
        );
    }
    let status = json_of(&db, &["status"], 0);
    assert_eq!(
        status["queues"][0]["limits"], set["limits"],
        "refusals changed nothing"
    );

    let cleared = json_of(&db, &["queue", "limit"], 0);
    assert_eq!(cleared["limits"]["max_in_flight"], Value::Null);
    assert_eq!(cleared["limits"]["rate"], Value::Null);
    assert_eq!(cleared["limits"]["max_per_partition"], Value::Null);
    assert_eq!(cleared["limits"]["rate_per_partition"], Value::Null);
    let status = json_of(&db, &["status"], 0);
    assert_eq!(status["queues"][0]["limits"], cleared["limits"]);
    let text = ctl(&db).arg("status").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        !text.contains("in flight") && !text.contains("per partition"),
        "limits still shown: {text}"
    );
    let rest = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert_eq!(rest.len(), 3, "no limits: the rest, the partner's too");
    db.drop_db().await;
}

/// `queue limit --rate-per-partition` alone replaces the other limits, as every `queue limit`
/// does; a partition that used its starts waits for its window while jobs without a partition go
/// on; `queue limit` without options lifts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_limit_sets_a_rate_per_partition_alone() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    json_of(
        &db,
        &[
            "queue",
            "limit",
            "--max-in-flight",
            "7",
            "--max-per-partition",
            "3",
        ],
        0,
    );
    let mut partner = Vec::new();
    for n in 0..4 {
        let job = NewJob::from_value(json!({ "n": n })).partition_key("partner-1");
        partner.push(queue.enqueue(job).await.unwrap().id);
    }
    for n in 4..6 {
        queue.enqueue(NewJob::new(&n).unwrap()).await.unwrap();
    }

    let set = json_of(&db, &["queue", "limit", "--rate-per-partition", "2/1h"], 0);
    assert_eq!(
        set["limits"],
        json!({
            "max_in_flight": null,
            "rate": null,
            "max_per_partition": null,
            "rate_per_partition": { "starts": 2, "per_ms": 3_600_000 },
        }),
        "what is not given is removed"
    );
    let status = json_of(&db, &["status"], 0);
    assert_eq!(status["queues"][0]["limits"], set["limits"]);
    let text = ctl(&db).arg("status").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("2 starts per 3600s per partition"), "{text}");
    assert!(
        !text.contains("in flight"),
        "only the rate per partition: {text}"
    );

    // Two of the partner's jobs in the hour, and every job without a partition.
    let first = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    let partners: Vec<_> = first.iter().filter(|j| partner.contains(&j.id)).collect();
    assert_eq!(
        partners.len(),
        2,
        "2 starts of the partner per hour: {first:?}"
    );
    assert_eq!(first.len(), 4, "jobs without a partition are not limited");
    for job in &first {
        let done = queue.finalize(job.claim(), &Finalize::Complete).await;
        assert_eq!(done.unwrap(), FinalizeOutcome::Applied);
    }
    let none = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert!(
        none.is_empty(),
        "the partner's starts are used, none in flight: {none:?}"
    );

    let cleared = json_of(&db, &["queue", "limit"], 0);
    assert_eq!(cleared["limits"]["rate_per_partition"], Value::Null);
    let rest = queue
        .claim(ClaimRequest::new(10, Lease::DEFAULT))
        .await
        .unwrap()
        .jobs;
    assert_eq!(rest.len(), 2, "no limit: the partner's other two");
    db.drop_db().await;
}

fn at(text: &str) -> DateTime<Utc> {
    text.parse().unwrap()
}

/// Sets a schedule's last report back by `interval` (a PostgreSQL interval), as if no scheduler
/// had reported it since.
async fn seen_ago(db: &ScratchDb, name: &str, interval: &str) {
    let done = sqlx::query(
        "UPDATE queue_jobs_schedules SET seen_at = now() - $2::interval WHERE name = $1",
    )
    .bind(name)
    .bind(interval)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(done.rows_affected(), 1, "{name}");
}

/// `schedules` lists what schedulers recorded, for every queue `status` lists, in text and
/// JSON, marks the records no scheduler reported lately `stale?` (twice the period, at least
/// 10 minutes), and `status` counts them; `schedules forget` drops a record, and exits 3 for one
/// that is not recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_lists_marks_stale_and_forgets_recorded_schedules() {
    let db = ScratchDb::new().await;
    let queue = db.queue().await;
    let listed = json_of(&db, &["schedules"], 0);
    assert_eq!(listed, json!({ "schedules": [] }));
    let text = ctl(&db).arg("schedules").output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("no schedule recorded"));

    let nightly = ScheduleReport {
        name: "nightly".into(),
        spec: "cron 0 2 * * * Europe/Berlin".into(),
        missed: "skip after 60s".into(),
        through: Some(at("2026-01-01T01:00:00Z")),
        next: Some(at("2026-01-02T01:00:00Z")),
    };
    let rates = ScheduleReport {
        name: "rates".into(),
        spec: "every 60s from 1970-01-01T00:00:00Z".into(),
        missed: "catch up within 21600s".into(),
        through: Some(at("2026-01-01T00:01:00Z")),
        next: Some(at("2026-01-01T00:02:00Z")),
    };
    queue
        .record_schedules("host-a:1", &[nightly.clone(), rates.clone()])
        .await
        .unwrap();
    // Another queue's schedule, before its first period and before the queue holds any job:
    // a queue whose only trace is a recorded schedule is still listed.
    let mail = queue.for_queue(QueueName::new("mail").unwrap());
    let digest = ScheduleReport {
        name: "digest".into(),
        spec: "cron 0 7 * * 1 UTC".into(),
        missed: "skip after 60s".into(),
        through: None,
        next: Some(at("2030-01-07T07:00:00Z")),
    };
    mail.record_schedules("host-b:2", &[digest]).await.unwrap();

    let listed = json_of(&db, &["schedules"], 0);
    let rows = listed["schedules"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["nightly", "rates", "digest"],
        "every queue's schedules, by queue and name; mail has no job yet"
    );
    let row = &rows[1];
    assert_eq!(row["queue"], "default");
    assert_eq!(row["spec"], rates.spec);
    assert_eq!(row["missed"], "catch up within 21600s");
    assert_eq!(row["seen_by"], "host-a:1");
    assert_eq!(row["stale"], false, "just reported");
    for field in ["through", "next", "seen_at"] {
        let text = row[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field}: {row}"));
        DateTime::parse_from_rfc3339(text).unwrap_or_else(|e| panic!("{field} {text}: {e}"));
    }
    assert_eq!(at(row["through"].as_str().unwrap()), rates.through.unwrap());
    assert_eq!(at(row["next"].as_str().unwrap()), rates.next.unwrap());
    let seen = at(row["seen_at"].as_str().unwrap());
    assert!(
        (Utc::now() - seen).num_seconds().abs() < 60,
        "seen by the database's clock: {seen}"
    );

    // --queue adds the queue asked for to those listed; it filters nothing out, and a job in
    // mail changes nothing of what is listed.
    let by_name = json_of(&db, &["--queue", "mail", "schedules"], 0);
    assert_eq!(by_name, listed);
    mail.enqueue(NewJob::new(&1).unwrap()).await.unwrap();
    let listed = json_of(&db, &["schedules"], 0);
    let rows = listed["schedules"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(
        (&rows[0]["queue"], &rows[0]["name"]),
        (&json!("default"), &json!("nightly"))
    );
    let digest_row = &rows[2];
    assert_eq!(
        (&digest_row["queue"], &digest_row["name"]),
        (&json!("mail"), &json!("digest"))
    );
    assert_eq!(digest_row["through"], Value::Null);
    assert_eq!(digest_row["seen_by"], "host-b:2");

    // No report for a day: stale for a minutely schedule (10 minutes), not for a daily one
    // (two days); three days, both.
    seen_ago(&db, "rates", "1 day").await;
    seen_ago(&db, "nightly", "1 day").await;
    let listed = json_of(&db, &["schedules"], 0);
    let stale: Vec<(&str, bool)> = listed["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), r["stale"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        stale,
        [("nightly", false), ("rates", true), ("digest", false)]
    );
    let text = ctl(&db).arg("schedules").output().unwrap();
    assert_eq!(text.status.code(), Some(0));
    let text = String::from_utf8(text.stdout).unwrap();
    let line = |name: &str| {
        text.lines()
            .find(|l| l.contains(&format!(" {name} ")))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .to_owned()
    };
    let rates_line = line("rates");
    for shown in [
        "default",
        "every 60s from 1970-01-01T00:00:00Z",
        "catch up within 21600s",
        "2026-01-01 00:01:00.000 UTC",
        "2026-01-01 00:02:00.000 UTC",
        "host-a:1",
        "stale?",
    ] {
        assert!(rates_line.contains(shown), "{shown} in {rates_line}");
    }
    assert!(!line("nightly").contains("stale?"), "{text}");
    assert!(line("nightly").contains("cron 0 2 * * * Europe/Berlin"));
    assert!(line("digest").contains("host-b:2"));
    seen_ago(&db, "nightly", "3 days").await;
    let listed = json_of(&db, &["schedules"], 0);
    assert_eq!(listed["schedules"][0]["stale"], true, "{listed}");

    // `status` counts each queue's schedules and the stale ones.
    let status = json_of(&db, &["status"], 0);
    assert_eq!(
        (
            &status["queues"][0]["queue"],
            &status["queues"][0]["schedules"],
            &status["queues"][0]["schedules_stale"]
        ),
        (&json!("default"), &json!(2), &json!(2))
    );
    assert_eq!(status["queues"][1]["schedules"], 1);
    let text = ctl(&db).arg("status").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("\nschedules of default: 2 (2 stale?)\nschedules of mail: 1"),
        "{text}"
    );

    // Forget: the record goes, the other queue's stays; again: not found (3), said clearly.
    let forgotten = json_of(&db, &["schedules", "forget", "rates"], 0);
    assert_eq!(
        forgotten,
        json!({ "queue": "default", "name": "rates", "forgotten": true })
    );
    let names: Vec<String> = queue
        .schedules()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.report.name)
        .collect();
    assert_eq!(names, ["nightly"]);
    let again = json_of(&db, &["schedules", "forget", "rates"], 3);
    assert_eq!(again["exit"], 3);
    let again = ctl(&db)
        .args(["schedules", "forget", "rates"])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains("no schedule \"rates\" is recorded for queue default"),
        "{stderr}"
    );
    // A schedule of another queue is forgotten with --queue, not without.
    json_of(&db, &["schedules", "forget", "digest"], 3);
    json_of(
        &db,
        &["--queue", "mail", "schedules", "forget", "digest"],
        0,
    );
    assert!(mail.schedules().await.unwrap().is_empty());
    let text = ctl(&db).arg("status").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(!text.contains("schedules of mail"), "{text}");
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_legacy_upgrades_a_legacy_table_once_confirmed() {
    let db = ScratchDb::empty().await;
    sqlx::raw_sql(
        "CREATE TABLE invoice_jobs (id bigserial PRIMARY KEY, status text NOT NULL DEFAULT 'pending',
                                    attempts integer NOT NULL DEFAULT 0,
                                    next_attempt_at timestamptz NOT NULL DEFAULT now());
         CREATE INDEX invoice_jobs_stuck ON invoice_jobs (next_attempt_at) WHERE status = 'in_flight';
         INSERT INTO invoice_jobs (status) VALUES ('pending'), ('completed'), ('in_flight');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let args = [
        "--table",
        "invoice_jobs",
        "--queue",
        "invoices",
        "upgrade-legacy",
        "--retire-index",
        "invoice_jobs_stuck",
    ];
    json_of(&db, &args, 5);
    let table = TableName::new("invoice_jobs").unwrap();
    assert!(
        PgQueue::check_schema(&db.pool, &table).await.is_err(),
        "changed unconfirmed"
    );
    let mut confirmed = args.to_vec();
    confirmed.push("--yes");
    let report = json_of(&db, &confirmed, 0);
    assert_eq!(report["columns_added"], true);
    assert_eq!(report["rows_stamped"], 1);
    assert_eq!(report["indexes_retired"], json!(["invoice_jobs_stuck"]));
    PgQueue::check_schema(&db.pool, &table)
        .await
        .expect("upgraded");
    let status = json_of(
        &db,
        &["--table", "invoice_jobs", "--queue", "invoices", "status"],
        0,
    );
    assert_eq!(
        status["queues"][0]["lease_expired"], 1,
        "the stranded row counts as expired"
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_message_and_changes_nothing() {
    let db = ScratchDb::new().await;
    let run = |command: &mut Command| {
        let output = command.output().unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stderr) = run(ctl(&db).args(["--table", "Bad Name", "status"]));
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("--table") && stderr.contains("lowercase"),
        "{stderr}"
    );
    let (code, stderr) = run(ctl(&db).args(["--queue", "has space", "status"]));
    assert_eq!(code, Some(2), "{stderr}");
    let (code, stderr) = run(ctl(&db).args(["--table", "nowhere", "status"]));
    assert_eq!(code, Some(1));
    assert!(stderr.contains("not found"), "{stderr}");
    let (code, stderr) = run(Command::cargo_bin("queuectl")
        .unwrap()
        .env_remove("DATABASE_URL")
        .arg("status"));
    assert_eq!(code, Some(2));
    assert!(stderr.contains("DATABASE_URL"), "{stderr}");
    let (code, stderr) = run(ctl(&db).args([
        "--database-url",
        "postgres://ops:s3cret-pw@127.0.0.1:1/queues",
        "status",
    ]));
    assert_eq!(code, Some(1));
    assert!(stderr.contains("cannot reach the database"), "{stderr}");
    assert!(
        !stderr.contains("s3cret-pw"),
        "the password leaked: {stderr}"
    );
    let (code, _) = run(ctl(&db).args(["jobs", "show", "424242"]));
    assert_eq!(code, Some(3));
    // With --json, stdout holds one document whatever the outcome.
    let missing = json_of(&db, &["jobs", "show", "424242"], 3);
    assert_eq!(missing["exit"], 3);
    let down = json_of(
        &db,
        &[
            "--database-url",
            "postgres://ops:pw@127.0.0.1:1/queues",
            "status",
        ],
        1,
    );
    assert!(
        down["error"].as_str().unwrap().contains("cannot reach"),
        "{down}"
    );
    // Passwords holding '#', '?' or '/' are not printed either, whether the URL parses or not.
    for url in [
        "postgres://ops:12#34@127.0.0.1:1/queues",
        "postgres://ops:p?w3rd@127.0.0.1:1/queues",
        "postgres://ops:p/w3rd@127.0.0.1:1/queues",
        "postgres://ops:s3cret@127.0.0.1:notaport/queues",
    ] {
        let (code, stderr) = run(ctl(&db).args(["--database-url", url, "status"]));
        assert!(
            matches!(code, Some(1) | Some(2)),
            "{url}: {code:?} {stderr}"
        );
        for secret in ["12#34", "p?w3rd", "p/w3rd", "s3cret"] {
            assert!(
                !stderr.contains(secret),
                "{url}: the password leaked: {stderr}"
            );
        }
    }
    let (code, stderr) = run(ctl(&db).args([
        "--database-url",
        "postgres://ops:s3cret@127.0.0.1:notaport/queues",
        "status",
    ]));
    assert_eq!(
        code,
        Some(2),
        "a URL that does not parse is a bad value: {stderr}"
    );
    let (code, stderr) = run(ctl(&db).args(["purge", "--older-than", "soon", "--state", "dead"]));
    assert_eq!(code, Some(2));
    assert!(stderr.contains("--older-than"), "{stderr}");
    // The dashboard on a public address without credentials: refused.
    let (code, stderr) = run(ctl(&db).args(["serve", "--addr", "0.0.0.0:0"]));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--token"), "{stderr}");
    let (code, stderr) = run(ctl(&db).args(["serve", "--basic-auth", "nopassword"]));
    assert_eq!(code, Some(2), "{stderr}");
    for help in [
        vec!["--help"],
        vec!["status", "--help"],
        vec!["jobs", "retry", "--help"],
        vec!["purge", "--help"],
        vec!["upgrade-legacy", "--help"],
        vec!["queue", "drain", "--help"],
        vec!["lease", "--help"],
        vec!["serve", "--help"],
        vec!["schedules", "--help"],
        vec!["schedules", "forget", "--help"],
    ] {
        let (code, _) = run(ctl(&db).args(&help));
        assert_eq!(code, Some(0), "{help:?}");
    }
    db.drop_db().await;
}
