//! The audit after a chaos scenario: what the database, the outbox, the status log and the
//! partner's records say, checked against the promise (no job lost or stranded, one outcome
//! and one event each, no status flip, every duplicate send tied to an injected fault).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use sqlx::{PgPool, Row};

use super::faults::{Fault, FaultKind};
use super::fleet;
use crate::exchange::partner_server::PostRecord;

/// Installs the status log: every status change of a transaction or a send job, with its old
/// and new value, so that the audit can count flips out of a terminal status.
pub(crate) const STATUS_LOG: &str = r#"
CREATE TABLE chaos_status_log (
    tbl    text        NOT NULL,
    id     bigint      NOT NULL,
    old    text        NOT NULL,
    new    text        NOT NULL,
    at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_log_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status IS DISTINCT FROM NEW.status THEN
        INSERT INTO chaos_status_log (tbl, id, old, new)
        VALUES (TG_TABLE_NAME, NEW.id, OLD.status, NEW.status);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_status_log AFTER UPDATE ON exchange_transactions
    FOR EACH ROW EXECUTE FUNCTION chaos_log_status();
CREATE TRIGGER chaos_status_log AFTER UPDATE ON exchange_send_jobs
    FOR EACH ROW EXECUTE FUNCTION chaos_log_status();
"#;

/// The figures of one scenario's audit. Every count but `posts`, `accepted`, the explained
/// ones and `faults` must be zero.
#[derive(Debug, Clone, Default)]
pub struct Audit {
    /// Transactions in the database at the end (poison ones included).
    pub transactions: usize,
    /// Of which planted with a poison payload.
    pub poison: usize,
    /// POSTs the partner received.
    pub posts: usize,
    /// POSTs it answered 2xx.
    pub accepted: usize,
    /// Transactions that ended `success` / `failed`.
    pub success: usize,
    /// Transactions that ended `failed`.
    pub failed: usize,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, usize>,
    /// Send jobs taken over from an expired lease at least once (the faults that bit).
    pub taken_over: usize,
    /// Accepted POSTs beyond the first of their key, each tied to a fault or a timeout.
    pub duplicates_explained: usize,
    /// Two POSTs of one key at the partner at once, each tied to a fault or a timeout.
    pub overlaps_explained: usize,
    /// Created transactions missing from the database, or without a send job.
    pub lost: usize,
    /// Transactions still `pending`, send jobs still `pending` or `in_flight`, after the drain.
    pub stranded: usize,
    /// Terminal transactions without their event.
    pub missing_events: usize,
    /// Events beyond one per transaction.
    pub double_events: usize,
    /// Events that contradict their transaction's status (`exchange.sent` on a failed one, or
    /// the other way round).
    pub conflicting_events: usize,
    /// Status changes out of a terminal status (transactions or send jobs).
    pub flips: usize,
    /// `success` transactions whose key the partner never accepted.
    pub unsent_successes: usize,
    /// `exchange.sent` events staged by an attempt (job, generation) whose POST the partner
    /// did not accept.
    pub unbacked_successes: usize,
    /// POSTs of a key by a send job of another transaction, or of a poison transaction's key.
    pub foreign_posts: usize,
    /// Poison transactions that did not end `failed`.
    pub poison_not_failed: usize,
    /// Duplicate sends tied to no fault and no timeout.
    pub unexplained_duplicates: usize,
    /// Overlapping POSTs of one key tied to no fault and no timeout.
    pub unexplained_overlaps: usize,
    /// Workers that did not exit cleanly on SIGTERM at the end.
    pub unclean_exits: usize,
    /// Times the exchange's terminal guard refused a stamp (`exchange.transaction_guard_refused`
    /// in the workers' logs): a second outcome reached the hooks, stopped only by the guard.
    pub guard_refusals: usize,
}

impl Audit {
    /// Each broken promise, named with its count.
    pub fn violations(&self) -> Vec<String> {
        [
            ("jobs lost", self.lost),
            ("rows stranded", self.stranded),
            (
                "terminal transactions without their event",
                self.missing_events,
            ),
            ("double events", self.double_events),
            ("conflicting events", self.conflicting_events),
            ("status flips", self.flips),
            (
                "successes never accepted by the partner",
                self.unsent_successes,
            ),
            (
                "successes staged by an attempt the partner did not accept",
                self.unbacked_successes,
            ),
            ("POSTs of another transaction's key", self.foreign_posts),
            ("poison transactions not failed", self.poison_not_failed),
            (
                "duplicate sends tied to no fault",
                self.unexplained_duplicates,
            ),
            (
                "overlapping sends tied to no fault",
                self.unexplained_overlaps,
            ),
            ("workers that did not drain on SIGTERM", self.unclean_exits),
            (
                "second outcomes stopped only by the terminal guard",
                self.guard_refusals,
            ),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(what, n)| format!("{what}: {n}"))
        .collect()
    }
}

impl fmt::Display for Audit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "transactions={} poison={} success={} failed={} taken_over={} posts={} accepted={} \
             duplicates={} overlaps={} faults={:?}",
            self.transactions,
            self.poison,
            self.success,
            self.failed,
            self.taken_over,
            self.posts,
            self.accepted,
            self.duplicates_explained,
            self.overlaps_explained,
            self.faults
        )?;
        for violation in self.violations() {
            write!(f, "\n  VIOLATION {violation}")?;
        }
        Ok(())
    }
}

/// What the audit reads besides the database.
pub(crate) struct Evidence<'a> {
    pub(crate) created: &'a [i64],
    pub(crate) poison: &'a [i64],
    pub(crate) posts: &'a [PostRecord],
    pub(crate) faults: &'a [Fault],
    pub(crate) lease: Duration,
    pub(crate) send_timeout: Duration,
    pub(crate) unclean_exits: usize,
    pub(crate) guard_refusals: usize,
}

struct Transaction {
    key: String,
    status: String,
}

/// Audits the scenario's database against the evidence.
pub(crate) async fn audit(pool: &PgPool, evidence: &Evidence<'_>) -> Result<Audit, sqlx::Error> {
    let mut audit = Audit {
        poison: evidence.poison.len(),
        posts: evidence.posts.len(),
        accepted: evidence.posts.iter().filter(|p| p.accepted()).count(),
        unclean_exits: evidence.unclean_exits,
        guard_refusals: evidence.guard_refusals,
        ..Audit::default()
    };
    for fault in evidence.faults {
        *audit.faults.entry(fault.kind).or_default() += 1;
    }

    let transactions: HashMap<i64, Transaction> =
        sqlx::query("SELECT id, correlation_id, status FROM exchange_transactions")
            .fetch_all(pool)
            .await?
            .into_iter()
            .map(|row| {
                let tx = Transaction {
                    key: row.get("correlation_id"),
                    status: row.get("status"),
                };
                (row.get("id"), tx)
            })
            .collect();
    let jobs: Vec<(i64, Option<i64>, String)> =
        sqlx::query("SELECT id, transaction_id, status FROM exchange_send_jobs")
            .fetch_all(pool)
            .await?
            .into_iter()
            .map(|row| (row.get("id"), row.get("transaction_id"), row.get("status")))
            .collect();
    let events: Vec<(String, i64, i64, i64)> = sqlx::query(
        "SELECT event_type, transaction_id, send_job_id, claim_generation FROM exchange_outbox",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|row| {
        (
            row.get("event_type"),
            row.get("transaction_id"),
            row.get("send_job_id"),
            row.get("claim_generation"),
        )
    })
    .collect();
    audit.taken_over =
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM exchange_send_jobs WHERE reclaims > 0")
            .fetch_one(pool)
            .await? as usize;
    audit.flips = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM chaos_status_log WHERE old IN \
         ('success', 'failed', 'completed', 'dead', 'cancelled')",
    )
    .fetch_one(pool)
    .await? as usize;

    // Every transaction in the database: those whose creation committed behind a lost reply
    // (a crash restart) included.
    audit.transactions = transactions.len();

    // Lost and stranded.
    let with_job: HashSet<i64> = jobs.iter().filter_map(|(_, t, _)| *t).collect();
    audit.lost = evidence
        .created
        .iter()
        .chain(evidence.poison)
        .filter(|id| !transactions.contains_key(id) || !with_job.contains(id))
        .count();
    audit.stranded = transactions
        .values()
        .filter(|t| t.status == "pending")
        .count()
        + jobs
            .iter()
            .filter(|(_, _, status)| status == "pending" || status == "in_flight")
            .count();
    audit.success = transactions
        .values()
        .filter(|t| t.status == "success")
        .count();
    audit.failed = transactions
        .values()
        .filter(|t| t.status == "failed")
        .count();

    // One event per terminal transaction, agreeing with its status.
    let mut per_transaction: HashMap<i64, Vec<&str>> = HashMap::new();
    for (event_type, transaction, _, _) in &events {
        per_transaction
            .entry(*transaction)
            .or_default()
            .push(event_type);
    }
    for (id, tx) in &transactions {
        let staged = per_transaction.get(id).map_or(&[][..], Vec::as_slice);
        let wanted = match tx.status.as_str() {
            "success" => "exchange.sent",
            "failed" => "exchange.failed",
            _ => continue,
        };
        if staged.is_empty() {
            audit.missing_events += 1;
        }
        audit.double_events += staged.len().saturating_sub(1);
        audit.conflicting_events += staged.iter().filter(|e| **e != wanted).count();
    }

    // What the partner accepted, against what the outbox says was sent.
    let accepted_keys: HashSet<&str> = evidence
        .posts
        .iter()
        .filter(|p| p.accepted())
        .filter_map(|p| p.key.as_deref())
        .collect();
    audit.unsent_successes = transactions
        .values()
        .filter(|t| t.status == "success" && !accepted_keys.contains(t.key.as_str()))
        .count();
    let accepted_attempts: HashSet<(i64, i64)> = evidence
        .posts
        .iter()
        .filter(|p| p.accepted())
        .filter_map(|p| Some((p.job_id?, p.generation?)))
        .collect();
    audit.unbacked_successes = events
        .iter()
        .filter(|(event_type, _, job, generation)| {
            event_type == "exchange.sent" && !accepted_attempts.contains(&(*job, *generation))
        })
        .count();
    let job_owner: HashMap<i64, i64> = jobs
        .iter()
        .filter_map(|(job, owner, _)| Some((*job, (*owner)?)))
        .collect();
    let poison: HashSet<i64> = evidence.poison.iter().copied().collect();
    audit.foreign_posts = evidence
        .posts
        .iter()
        .filter(|post| {
            let owner = post.job_id.and_then(|job| job_owner.get(&job));
            match (owner, &post.key) {
                (Some(owner), Some(key)) => {
                    poison.contains(owner) || transactions.get(owner).is_none_or(|t| &t.key != key)
                }
                _ => true,
            }
        })
        .count();
    audit.poison_not_failed = evidence
        .poison
        .iter()
        .filter(|id| transactions.get(id).is_none_or(|t| t.status != "failed"))
        .count();

    // Duplicates and overlaps, each tied to a fault or a timeout.
    let mut by_key: HashMap<&str, Vec<&PostRecord>> = HashMap::new();
    for post in evidence.posts {
        if let Some(key) = post.key.as_deref() {
            by_key.entry(key).or_default().push(post);
        }
    }
    let explains = |a: &PostRecord, b: &PostRecord| explained(a, b, evidence);
    for posts in by_key.values_mut() {
        posts.sort_by_key(|p| p.arrived);
        let accepted: Vec<&&PostRecord> = posts.iter().filter(|p| p.accepted()).collect();
        for later in accepted.iter().skip(1) {
            if explains(accepted[0], later) {
                audit.duplicates_explained += 1;
            } else {
                audit.unexplained_duplicates += 1;
            }
        }
        for (i, earlier) in posts.iter().enumerate() {
            for later in &posts[i + 1..] {
                let overlapping = earlier
                    .answered
                    .is_none_or(|(answered, _)| later.arrived < answered);
                if !overlapping {
                    continue;
                }
                if explains(earlier, later) {
                    audit.overlaps_explained += 1;
                } else {
                    audit.unexplained_overlaps += 1;
                }
            }
        }
    }
    Ok(audit)
}

/// Whether a second POST `b` of the key `a` carried is tied to an injected fault (see
/// [`explained_by`]).
fn explained(a: &PostRecord, b: &PostRecord, evidence: &Evidence<'_>) -> bool {
    explained_by(a, b, evidence.faults, evidence.lease, evidence.send_timeout)
}

/// Whether a second POST `b` of the key `a` carried is tied to one of `faults`: `a` was
/// answered only after the send timeout (the worker gave up on it, and the partner kept it), a
/// fault hit `a`'s sender during `a`'s attempt (a lease either side of its arrival: killed or
/// paused before its outcome committed), or `b`'s sender within the lease before `b` (resumed
/// from a pause, it sent late), or the database crashed after `a` while its outcome had to be
/// written. A partner hang explains only through the timeout, and killed connections never.
pub(crate) fn explained_by(
    a: &PostRecord,
    b: &PostRecord,
    faults: &[Fault],
    lease: Duration,
    send_timeout: Duration,
) -> bool {
    let timed_out = a
        .answered
        .is_none_or(|(answered, _)| answered - a.arrived >= send_timeout);
    if timed_out {
        return true;
    }
    let before = |at: std::time::Instant| at.checked_sub(lease).unwrap_or(at);
    let a_attempt = (before(a.arrived), a.arrived + lease);
    let b_attempt = (before(b.arrived), b.arrived);
    let overlaps = |fault: &Fault, (from, to): (std::time::Instant, std::time::Instant)| {
        fault.start <= to && fault.end >= from
    };
    let (a_sender, b_sender) = (
        fleet::sender_pid(a.agent.as_deref()),
        fleet::sender_pid(b.agent.as_deref()),
    );
    faults.iter().any(|fault| match fault.pid {
        Some(pid) => {
            (Some(pid) == a_sender && overlaps(fault, a_attempt))
                || (Some(pid) == b_sender && overlaps(fault, b_attempt))
        }
        // Killed connections alone never explain one: outcomes are tried again on new
        // connections until the lease deadline. A crashed database does, when it was down
        // after the first POST, while its outcome had to be written.
        None => {
            matches!(
                fault.kind,
                FaultKind::RestartDatabase
                    | FaultKind::Switchover
                    | FaultKind::PrimaryLost
                    | FaultKind::PrimaryCrash
            ) && overlaps(fault, (a.arrived, a.arrived + lease))
        }
    })
}

/// The POSTs a partner accepted, grouped by idempotency key, each group in arrival order.
fn accepted_by_key(posts: &[PostRecord]) -> Vec<Vec<&PostRecord>> {
    let mut by_key: HashMap<&str, Vec<&PostRecord>> = HashMap::new();
    for post in posts.iter().filter(|p| p.accepted()) {
        if let Some(key) = post.key.as_deref() {
            by_key.entry(key).or_default().push(post);
        }
    }
    by_key
        .into_values()
        .map(|mut accepted| {
            accepted.sort_by_key(|p| p.arrived);
            accepted
        })
        .collect()
}

/// The accepted POSTs beyond the first of their key that [`explained_by`] ties to no fault, each
/// as `(first, previous, later)`: the first POST of its key, the accepted one just before it,
/// and itself.
pub(crate) fn unexplained_duplicates<'a>(
    posts: &'a [PostRecord],
    faults: &[Fault],
    lease: Duration,
    send_timeout: Duration,
) -> Vec<(&'a PostRecord, &'a PostRecord, &'a PostRecord)> {
    let mut found = Vec::new();
    for accepted in accepted_by_key(posts) {
        let first = accepted[0];
        for pair in accepted.windows(2) {
            let (previous, later) = (pair[0], pair[1]);
            if !explained_by(first, later, faults, lease, send_timeout) {
                found.push((first, previous, later));
            }
        }
    }
    found
}

/// A duplicate as a person reading a failed run needs it: both POSTs and every fault, timed
/// from the first POST.
pub(crate) fn describe_duplicate(
    first: &PostRecord,
    later: &PostRecord,
    faults: &[Fault],
) -> String {
    let answered_ms = first
        .answered
        .map(|(at, _)| (at - first.arrived).as_millis())
        .unwrap_or_default();
    let near: Vec<String> = faults
        .iter()
        .map(|f| {
            let at = if f.start >= first.arrived {
                format!("+{} ms", (f.start - first.arrived).as_millis())
            } else {
                format!("-{} ms", (first.arrived - f.start).as_millis())
            };
            format!("{} pid {:?} at {at}", f.kind.as_str(), f.pid)
        })
        .collect();
    format!(
        "job {:?}: first POST (generation {:?}, {:?}) answered in {answered_ms} ms; again {} ms \
         later (generation {:?}, {:?}); faults relative to the first: {}",
        first.job_id,
        first.generation,
        first.agent,
        (later.arrived - first.arrived).as_millis(),
        later.generation,
        later.agent,
        near.join(", ")
    )
}

/// The POSTs a partner accepted beyond the first of their key, and how many of those
/// [`explained_by`] ties to one of `faults`: `(duplicates, explained)`.
pub(crate) fn duplicate_sends(
    posts: &[PostRecord],
    faults: &[Fault],
    lease: Duration,
    send_timeout: Duration,
) -> (u64, u64) {
    let (mut duplicates, mut explained) = (0, 0);
    for accepted in accepted_by_key(posts) {
        for later in accepted.iter().skip(1) {
            duplicates += 1;
            if explained_by(accepted[0], later, faults, lease, send_timeout) {
                explained += 1;
            }
        }
    }
    (duplicates, explained)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn post(seq: usize, pid: u32, at: Instant, status: u16) -> PostRecord {
        PostRecord {
            seq,
            partner: "acme".into(),
            key: Some("k".into()),
            job_id: Some(1),
            generation: Some(seq as i64 + 1),
            agent: Some(format!("exchange-demo worker (pid {pid})")),
            arrived: at,
            answered: Some((at + Duration::from_millis(10), status)),
        }
    }

    fn kill(pid: u32, at: Instant) -> Fault {
        Fault {
            kind: FaultKind::KillAfterSend,
            pid: Some(pid),
            start: at,
            end: at,
        }
    }

    #[test]
    fn the_unexplained_duplicates_are_listed_with_their_first_post() {
        let lease = Duration::from_secs(4);
        let timeout = Duration::from_secs(1);
        let t0 = Instant::now();
        let posts = [
            post(0, 10, t0, 201),
            post(1, 11, t0 + Duration::from_secs(6), 201),
        ];
        let pairs = unexplained_duplicates(&posts, &[], lease, timeout);
        assert_eq!(pairs.len(), 1);
        assert_eq!((pairs[0].0.seq, pairs[0].1.seq, pairs[0].2.seq), (0, 0, 1));
        let killed = [kill(10, t0 + Duration::from_millis(5))];
        assert!(unexplained_duplicates(&posts, &killed, lease, timeout).is_empty());
        let text = describe_duplicate(pairs[0].0, pairs[0].2, &killed);
        assert!(text.contains("again 6000 ms later"), "{text}");
        assert!(text.contains("at +5 ms"), "{text}");
    }

    #[test]
    fn a_duplicate_is_explained_only_by_a_kill_of_its_first_sender_within_the_lease() {
        let lease = Duration::from_secs(4);
        let timeout = Duration::from_secs(1);
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(5);
        let posts = [post(0, 10, t0, 201), post(1, 11, later, 201)];
        assert_eq!(duplicate_sends(&posts, &[], lease, timeout), (1, 0));
        let own = [kill(10, t0 + Duration::from_millis(15))];
        assert_eq!(duplicate_sends(&posts, &own, lease, timeout), (1, 1));
        let someone_else = [kill(12, t0 + Duration::from_millis(15))];
        assert_eq!(
            duplicate_sends(&posts, &someone_else, lease, timeout),
            (1, 0)
        );
        let long_after = [kill(10, t0 + Duration::from_secs(30))];
        assert_eq!(duplicate_sends(&posts, &long_after, lease, timeout), (1, 0));
        // A refused POST is no send: one accepted POST of a key is no duplicate.
        let refused = [post(0, 10, t0, 503), post(1, 11, later, 201)];
        assert_eq!(duplicate_sends(&refused, &[], lease, timeout), (0, 0));
    }
}
