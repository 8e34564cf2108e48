//! Every statement the backend runs, once: one file per statement under `sql/` (each with a
//! header saying its parameters and what it guarantees), rendered for a table by [`render`].
//! Drivers and tests run these texts; nothing else writes queue SQL.

use std::sync::Arc;

use queue_core::JobStatus;

use crate::error::PgError;
use crate::ident::TableName;

/// A statement template: `{{name}}` tokens, rendered by [`render`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Template {
    /// The file it comes from, for errors.
    pub(crate) name: &'static str,
    pub(crate) text: &'static str,
}

macro_rules! template {
    ($file:literal) => {
        Template {
            name: $file,
            text: include_str!(concat!("../sql/", $file)),
        }
    };
}

pub(crate) const ENQUEUE: Template = template!("enqueue.sql");
pub(crate) const ENQUEUE_PLAIN: Template = template!("enqueue_plain.sql");
pub(crate) const ENQUEUE_IDS: Template = template!("enqueue_ids.sql");
pub(crate) const ENQUEUE_COPY: Template = template!("enqueue_copy.sql");
pub(crate) const NOTIFY: Template = template!("notify.sql");
pub(crate) const CLAIM: Template = template!("claim.sql");
pub(crate) const CLAIM_DUE: Template = template!("claim_due.sql");
pub(crate) const CLAIM_PICKS: Template = template!("claim_picks.sql");
pub(crate) const CLAIM_LIMITED: Template = template!("claim_limited.sql");
pub(crate) const CLAIM_TURNS: Template = template!("claim_turns.sql");
pub(crate) const CLAIM_AHEAD: Template = template!("claim_ahead.sql");
pub(crate) const CLAIM_CANDIDATES: Template = template!("claim_candidates.sql");
pub(crate) const CLAIM_KEY_STARTED: Template = template!("claim_key_started.sql");
pub(crate) const CLAIM_WALK_ROOM: Template = template!("claim_walk_room.sql");
pub(crate) const CLAIM_QUOTA: Template = template!("claim_quota.sql");
pub(crate) const CLAIM_LOGGED: Template = template!("claim_logged.sql");
pub(crate) const CLAIM_LOGGED_PARTITIONS: Template = template!("claim_logged_partitions.sql");
pub(crate) const CLAIM_BINDING: Template = template!("claim_binding.sql");
pub(crate) const CLAIM_RATED: Template = template!("claim_rated.sql");
pub(crate) const CLAIM_RATED_BEFORE_PICK: Template = template!("claim_rated_before_pick.sql");
pub(crate) const CLAIM_SLOT: Template = template!("claim_slot.sql");
pub(crate) const CLAIM_SLOTS_WHOLE: Template = template!("claim_slots_whole.sql");
pub(crate) const CLAIM_COUNT_SLOTS: Template = template!("claim_count_slots.sql");
pub(crate) const CLAIM_TALLY: Template = template!("claim_tally.sql");
pub(crate) const CLAIM_COUNT_TALLY: Template = template!("claim_count_tally.sql");
pub(crate) const CLAIM_TALLY_CLAIMS: Template = template!("claim_tally_claims.sql");
pub(crate) const LOCK_QUEUE: Template = template!("lock_queue.sql");
pub(crate) const CLAIM_CHECK: Template = template!("claim_check.sql");
pub(crate) const GRANT: Template = template!("grant.sql");
pub(crate) const CLAIM_GRANTED: Template = template!("claim_granted.sql");
pub(crate) const RETURN_GRANT: Template = template!("return_grant.sql");
const GRANT_LOG: Template = template!("grant_log.sql");
const GRANT_TALLY_BACK: Template = template!("grant_tally_back.sql");
const CLAIM_TO_FOLD: Template = template!("claim_to_fold.sql");
pub(crate) const SET_ROOM_GRANTS: Template = template!("set_room_grants.sql");
pub(crate) const FOLD_STARTS: Template = template!("fold_starts.sql");
pub(crate) const EXTEND_LEASES: Template = template!("extend_leases.sql");
pub(crate) const SET_LIMITS: Template = template!("set_limits.sql");
pub(crate) const FINALIZE_CLAIM: Template = template!("finalize_claim.sql");
pub(crate) const FINALIZE: Template = template!("finalize.sql");
pub(crate) const SAVEPOINT: Template = template!("savepoint.sql");
pub(crate) const ROLLBACK_TO_SAVEPOINT: Template = template!("rollback_to_savepoint.sql");
pub(crate) const EXTEND_LEASE: Template = template!("extend_lease.sql");
pub(crate) const CANCEL: Template = template!("cancel.sql");
pub(crate) const GET: Template = template!("get.sql");
pub(crate) const COUNTS: Template = template!("counts.sql");
pub(crate) const STATS: Template = template!("stats.sql");
pub(crate) const SWEEP_FINISHED: Template = template!("sweep_finished.sql");
pub(crate) const TABLE_COLUMNS: Template = template!("table_columns.sql");
pub(crate) const TABLE_INDEXES: Template = template!("table_indexes.sql");
pub(crate) const TABLE_ID_SEQUENCE: Template = template!("table_id_sequence.sql");
pub(crate) const LIST_JOBS: Template = template!("list_jobs.sql");
pub(crate) const FIND_UNIQUE: Template = template!("find_unique.sql");
pub(crate) const RETRY: Template = template!("retry.sql");
pub(crate) const PURGE: Template = template!("purge.sql");
pub(crate) const PAUSE: Template = template!("pause.sql");
pub(crate) const QUEUE_CONTROL: Template = template!("queue_control.sql");
pub(crate) const QUEUES: Template = template!("queues.sql");
pub(crate) const RECORD_STALE: Template = template!("record_stale.sql");
pub(crate) const NOTE_SERVED: Template = template!("note_served.sql");
pub(crate) const THROUGHPUT: Template = template!("throughput.sql");
pub(crate) const RECORD_SCHEDULES: Template = template!("record_schedules.sql");
pub(crate) const SCHEDULES: Template = template!("schedules.sql");
pub(crate) const FORGET_SCHEDULE: Template = template!("forget_schedule.sql");
pub(crate) const CLAIMS_RUNNING: Template = template!("claims_running.sql");
pub(crate) const TABLE_EXISTS: Template = template!("table_exists.sql");
pub(crate) const TABLE_TRIGGERS: Template = template!("table_triggers.sql");
pub(crate) const UPGRADE_LOCK: Template = template!("upgrade_lock.sql");
pub(crate) const INDEX_STATE: Template = template!("index_state.sql");
pub(crate) const UPGRADE_LEGACY_COLUMNS: Template = template!("upgrade_legacy_columns.sql");
pub(crate) const UPGRADE_LEGACY_BACKFILL: Template = template!("upgrade_legacy_backfill.sql");
pub(crate) const UPGRADE_LEGACY_INDEXES: Template = template!("upgrade_legacy_indexes.sql");
pub(crate) const UPGRADE_LEGACY_EXTENT: Template = template!("upgrade_legacy_extent.sql");

/// The framework's migrations of a queue table, `(version, description, template)`, in order.
/// Rendered for `queue_jobs` they are the standard table's migrations (byte for byte what
/// earlier releases applied, so their checksums hold); rendered for another name, a custom
/// table's DDL.
pub(crate) const TABLE_MIGRATIONS: [(i64, &str, Template); 13] = [
    (
        20261130000001,
        "queue jobs",
        Template {
            name: "20261130000001_queue_jobs.sql",
            text: include_str!("../migrations/20261130000001_queue_jobs.sql"),
        },
    ),
    (
        20261201000001,
        "lease and cancel request",
        Template {
            name: "20261201000001_lease_and_cancel_request.sql",
            text: include_str!("../migrations/20261201000001_lease_and_cancel_request.sql"),
        },
    ),
    (
        20261202000001,
        "holder errors and queue controls",
        Template {
            name: "20261202000001_holder_errors_and_queue_controls.sql",
            text: include_str!("../migrations/20261202000001_holder_errors_and_queue_controls.sql"),
        },
    ),
    (
        20261204000001,
        "claim token",
        Template {
            name: "20261204000001_claim_token.sql",
            text: include_str!("../migrations/20261204000001_claim_token.sql"),
        },
    ),
    (
        20261205000001,
        "queue limits",
        Template {
            name: "20261205000001_queue_limits.sql",
            text: include_str!("../migrations/20261205000001_queue_limits.sql"),
        },
    ),
    (
        20261206000001,
        "partitions and schedules",
        Template {
            name: "20261206000001_partitions_and_schedules.sql",
            text: include_str!("../migrations/20261206000001_partitions_and_schedules.sql"),
        },
    ),
    (
        20261207000001,
        "partition rates",
        Template {
            name: "20261207000001_partition_rates.sql",
            text: include_str!("../migrations/20261207000001_partition_rates.sql"),
        },
    ),
    (
        20261208000001,
        "partition rate tally",
        Template {
            name: "20261208000001_partition_rate_tally.sql",
            text: include_str!("../migrations/20261208000001_partition_rate_tally.sql"),
        },
    ),
    (
        20261209000001,
        "partition rate slots",
        Template {
            name: "20261209000001_partition_rate_slots.sql",
            text: include_str!("../migrations/20261209000001_partition_rate_slots.sql"),
        },
    ),
    (
        20261210000001,
        "claim counts",
        Template {
            name: "20261210000001_claim_counts.sql",
            text: include_str!("../migrations/20261210000001_claim_counts.sql"),
        },
    ),
    (
        20261211000001,
        "claim slots",
        Template {
            name: "20261211000001_claim_slots.sql",
            text: include_str!("../migrations/20261211000001_claim_slots.sql"),
        },
    ),
    (
        20261212000001,
        "room grants",
        Template {
            name: "20261212000001_room_grants.sql",
            text: include_str!("../migrations/20261212000001_room_grants.sql"),
        },
    ),
    (
        20261213000001,
        "grant fence",
        Template {
            name: "20261213000001_grant_fence.sql",
            text: include_str!("../migrations/20261213000001_grant_fence.sql"),
        },
    ),
];

/// The first table migration the legacy upgrade's columns phase renders as it is, after
/// `upgrade_legacy_columns.sql` (which states the earlier ones' columns itself).
pub(crate) const UPGRADE_COLUMNS_RENDER_FROM: i64 = 20261212000001;

/// The last table migration the legacy upgrade's columns phase renders. The phase is frozen
/// there: a service commits it as a migration of its own, so its text never changes; each later
/// table migration is a step of its own ([`crate::UpgradePhase::TableMigrations`]).
pub(crate) const UPGRADE_COLUMNS_RENDER_THROUGH: i64 = 20261212000001;

/// The names of a queue table's columns.
pub(crate) mod col {
    pub(crate) const ID: &str = "id";
    pub(crate) const QUEUE: &str = "queue";
    pub(crate) const STATUS: &str = "status";
    pub(crate) const PAYLOAD: &str = "payload";
    pub(crate) const PRIORITY: &str = "priority";
    pub(crate) const ATTEMPTS: &str = "attempts";
    pub(crate) const RECLAIMS: &str = "reclaims";
    pub(crate) const NEXT_ATTEMPT_AT: &str = "next_attempt_at";
    pub(crate) const CLAIMED_AT: &str = "claimed_at";
    pub(crate) const LEASE_EXPIRES_AT: &str = "lease_expires_at";
    pub(crate) const LEASE_GENERATION: &str = "lease_generation";
    pub(crate) const CANCEL_REQUESTED_AT: &str = "cancel_requested_at";
    pub(crate) const CLAIM_GENERATION: &str = "claim_generation";
    pub(crate) const CLAIM_TOKEN: &str = "claim_token";
    pub(crate) const LAST_ERROR: &str = "last_error";
    pub(crate) const UNIQUE_KEY: &str = "unique_key";
    pub(crate) const PARTITION_KEY: &str = "partition_key";
    pub(crate) const CREATED_AT: &str = "created_at";
    pub(crate) const UPDATED_AT: &str = "updated_at";
    pub(crate) const FINISHED_AT: &str = "finished_at";
    pub(crate) const CLAIMED_BY: &str = "claimed_by";
    pub(crate) const ERRORS: &str = "errors";
}

/// The columns of a queue table with the type `format_type` reports: what `get.sql` selects,
/// what the schema check requires, and what a job's row is read from. Adding a column is an
/// entry here (and its field in the record), and a migration.
pub(crate) const COLUMNS: [(&str, &str); 22] = [
    (col::ID, "bigint"),
    (col::QUEUE, "text"),
    (col::STATUS, "text"),
    (col::PAYLOAD, "jsonb"),
    (col::PRIORITY, "smallint"),
    (col::ATTEMPTS, "integer"),
    (col::RECLAIMS, "integer"),
    (col::NEXT_ATTEMPT_AT, "timestamp with time zone"),
    (col::CLAIMED_AT, "timestamp with time zone"),
    (col::LEASE_EXPIRES_AT, "timestamp with time zone"),
    (col::LEASE_GENERATION, "bigint"),
    (col::CANCEL_REQUESTED_AT, "timestamp with time zone"),
    (col::CLAIM_GENERATION, "bigint"),
    (col::CLAIM_TOKEN, "bigint"),
    (col::LAST_ERROR, "text"),
    (col::UNIQUE_KEY, "text"),
    (col::CREATED_AT, "timestamp with time zone"),
    (col::UPDATED_AT, "timestamp with time zone"),
    (col::FINISHED_AT, "timestamp with time zone"),
    (col::CLAIMED_BY, "text"),
    (col::ERRORS, "jsonb"),
    (col::PARTITION_KEY, "text"),
];

/// Replaces every `{{name}}` of `template` by its value; a token left over (a name without a
/// value, or a typo) is an error, never SQL sent to the server.
pub(crate) fn render(template: Template, values: &[(&str, &str)]) -> Result<String, PgError> {
    let mut text = template.text.to_owned();
    for (name, value) in values {
        text = text.replace(&format!("{{{{{name}}}}}"), value);
    }
    match text.find("{{") {
        None => Ok(text),
        Some(at) => {
            let token = text[at..].split("}}").next().unwrap_or_default();
            Err(PgError::Template {
                template: template.name,
                token: format!("{token}}}}}"),
            })
        }
    }
}

/// Renders `template` for `table`.
///
/// `{{queue_default}}` is the `queue` column's default: `'default'` (the default queue) in the
/// standard table, as earlier releases created it; none in a table of another name, which
/// serves queues of its own, so that a row inserted by hand without its queue is refused instead
/// of landing in a queue nobody serves.
pub(crate) fn for_table(template: Template, table: &TableName) -> Result<String, PgError> {
    for_table_with(template, table, &[])
}

/// [`for_table`] with more tokens of the caller's.
pub(crate) fn for_table_with(
    template: Template,
    table: &TableName,
    extra: &[(&str, &str)],
) -> Result<String, PgError> {
    let columns = COLUMNS.map(|(name, _)| name).join(", ");
    let queue_default = if *table == TableName::default() {
        " DEFAULT 'default'"
    } else {
        ""
    };
    let history_len = queue_core::limits::ERROR_HISTORY_LEN.to_string();
    let history_chars = queue_core::limits::HISTORY_ERROR_CHARS.to_string();
    let history_last = (queue_core::limits::ERROR_HISTORY_LEN - 1).to_string();
    let slot_count = PARTITION_SLOTS.to_string();
    let slot_mask = (PARTITION_SLOTS - 1).to_string();
    let flight_slot_count = FLIGHT_SLOTS.to_string();
    let mut values = vec![
        ("table", table.as_str()),
        ("columns", columns.as_str()),
        ("queue_default", queue_default),
        ("history_len", history_len.as_str()),
        ("history_chars", history_chars.as_str()),
        ("history_last", history_last.as_str()),
        ("slot_count", slot_count.as_str()),
        ("slot_mask", slot_mask.as_str()),
        ("flight_slot_count", flight_slot_count.as_str()),
    ];
    values.extend_from_slice(extra);
    render(template, &values)
}

/// The slots of partition keys in the tally of a rate per partition (`claim_slot.sql`, the
/// column `partition_slots`): a power of two. More slots bound each partition more closely
/// (fewer keys share one) and cost a larger row, read and written whole by every claim.
const PARTITION_SLOTS: u32 = 512;

/// What keeps `claim.sql` (and `finalize_claim.sql`) from a queue besides a pause: limits,
/// which only `claim_limited.sql` applies.
/// (A rate is a number of starts and a window: both, or it is not one.)
const LIMITED_GUARD: &str = "OR c.max_in_flight IS NOT NULL \
     OR (c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL) \
     OR c.max_per_partition IS NOT NULL \
     OR (c.partition_rate_starts IS NOT NULL AND c.partition_rate_per_ms IS NOT NULL)";

/// The most of a partition-limited queue's earliest due jobs `claim_limited.sql` reads to find
/// jobs without a partition key among them when its partitions take turns.
pub(crate) const LOOSE_READ_AHEAD: usize = queue_core::partition::MAX_LOOSE_READ_AHEAD;

/// The claims' picks: `claim_due.sql` picking `due_batch` pending jobs, and `claim_picks.sql`
/// taking `batch` of all it picked, both kept from a queue by `guard` as well as by a pause.
struct Picks<'a> {
    due_batch: &'a str,
    batch: &'a str,
    guard: &'a str,
    /// What else keeps the takeovers of expired leases from the claim.
    expired_guard: &'a str,
    /// The claim's instant: `claimed_at`, and the lease counts from it.
    claim_now: &'a str,
}

/// The picks of `claim.sql` and `finalize_claim.sql`: `$2` of each, and no limited queue.
const PLAIN_PICKS: Picks<'static> = Picks {
    due_batch: "$2",
    batch: "$2",
    guard: LIMITED_GUARD,
    expired_guard: LIMITED_GUARD,
    claim_now: "now()",
};

/// The candidates of `claim.sql`'s picks: every due job and takeover.
const ALL_CANDIDATES: &str = "(SELECT * FROM due UNION ALL SELECT * FROM expired) AS candidates";

/// `claim_key_started.sql` for `table`, for the partition key `key` (an SQL expression).
fn key_started(table: &TableName, key: &str) -> Result<String, PgError> {
    for_table_with(CLAIM_KEY_STARTED, table, &[("key", key)])
}

/// The candidates of the limited claims' picks (`claim_candidates.sql`): within each
/// partition's starts.
fn limited_candidates(table: &TableName) -> Result<String, PgError> {
    let started = key_started(table, "k.key")?;
    for_table_with(CLAIM_CANDIDATES, table, &[("key_started", &started)])
}

/// The takeovers a limited claim leaves out before it counts them: those of a partition whose
/// rate per partition has no start left, so that they do not fill a batch only to be dropped
/// (`claim_candidates.sql` keeps the rest within each partition's starts).
fn expired_starts(table: &TableName) -> Result<String, PgError> {
    let started = key_started(table, "x.partition_key")?;
    Ok(format!(
        "AND (x.partition_key IS NULL OR (SELECT key_rate_starts FROM rated) IS NULL \
         OR (SELECT key_rate_starts FROM rated) - {started} > 0)"
    ))
}

/// `claim_due.sql` and `claim_picks.sql` for `table`, rendered for `picks`, choosing among
/// `candidates` (`None`: all, no partition's rate applies).
fn claim_parts(
    table: &TableName,
    picks: &Picks<'_>,
    candidates: Option<&str>,
) -> Result<(String, String), PgError> {
    let (candidates, expired) = match candidates {
        Some(candidates) => (candidates.to_owned(), expired_starts(table)?),
        None => (ALL_CANDIDATES.to_owned(), String::new()),
    };
    claim_parts_among(table, picks, &candidates, &expired)
}

/// [`claim_parts`] choosing among `candidates`, with `expired` keeping lapsed leases from
/// being taken over besides a pause and the picks' guard (SQL).
fn claim_parts_among(
    table: &TableName,
    picks: &Picks<'_>,
    candidates: &str,
    expired: &str,
) -> Result<(String, String), PgError> {
    let due = for_table_with(
        CLAIM_DUE,
        table,
        &[
            ("due_batch", picks.due_batch),
            ("limited_guard", picks.guard),
        ],
    )?;
    let rest = for_table_with(
        CLAIM_PICKS,
        table,
        &[
            ("batch", picks.batch),
            ("limited_guard", picks.expired_guard),
            ("candidates", candidates),
            ("expired_starts", expired),
            ("claim_now", picks.claim_now),
        ],
    )?;
    Ok((due, rest))
}

/// `claim.sql` for `table`, with `claim_due.sql` and `claim_picks.sql` rendered in.
pub(crate) fn claim(table: &TableName) -> Result<String, PgError> {
    claim_with(table, &PLAIN_PICKS, "")
}

/// `claim.sql` for `table` with `picks`, its rows with `keys` after the job's columns (`""`, or
/// `", partition_key"` for a claim that checks its partitions after).
fn claim_with(table: &TableName, picks: &Picks<'_>, keys: &str) -> Result<String, PgError> {
    let (due, picks) = claim_parts(table, picks, None)?;
    for_table_with(
        CLAIM,
        table,
        &[
            ("claim_due", &due),
            ("claim_picks", &picks),
            ("claim_keys", keys),
        ],
    )
}

/// The picks of a claim checked under the lock after it ([`claim_checked`]): `claim.sql`'s,
/// kept from a queue by a pause alone.
const CHECKED_PICKS: Picks<'static> = Picks {
    guard: "",
    expired_guard: "",
    ..PLAIN_PICKS
};

/// `claim.sql` for `table` with no limit applied, for a queue whose limits are in flight only:
/// in a transaction that then takes the queue's lock (`lock_queue.sql`) and checks the claim
/// (`claim_check.sql`), rolled back when the check finds it over. Its first line is
/// `claim.sql`'s, so that a drain finds it running; its rows carry each job's partition key,
/// which the check counts by.
pub(crate) fn claim_checked(table: &TableName) -> Result<String, PgError> {
    claim_with(table, &CHECKED_PICKS, ", partition_key")
}

/// The picks of `claim_turns.sql`: within the quota, on limited queues too.
const QUOTA_PICKS: Picks<'static> = Picks {
    due_batch: "(SELECT new_jobs FROM quota)",
    batch: "(SELECT all_jobs FROM quota)",
    guard: "",
    expired_guard: "",
    claim_now: "(SELECT now_at FROM quota)",
};

/// The picks of `claim_limited.sql`: [`QUOTA_PICKS`], but no takeover either when the
/// partitions take turns (`claim_turns.sql` merges the takeovers with the partitions' offers
/// in claim order, as every store does).
const LIMITED_PICKS: Picks<'static> = Picks {
    expired_guard: "OR (SELECT binds FROM binding) OR (SELECT must_fold FROM rated)",
    ..QUOTA_PICKS
};

/// Which statement claims from a queue with limits: `claim_limited.sql` in its lean form (a
/// queue without limits per partition), in its full form, or `claim_turns.sql` for a queue
/// whose partitions take turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitedForm {
    Lean,
    Pick,
    Turns,
}

/// `claim_quota.sql`, the CTE `rated` and `claim_logged.sql` as `form` renders them: the lean
/// form refuses limits per partition and logs nothing per partition; the full form applies the
/// rate per partition once its pick is known (`claim_rated.sql`) and says when its pick would
/// put a partition over its limit (the row marked `turns`); the turns apply it as the quota
/// decided (`claim_rated_before_pick.sql`).
struct LimitedEnds {
    quota: String,
    rated: String,
    logged: String,
}

impl LimitedEnds {
    fn new(table: &TableName, form: LimitedForm) -> Result<Self, PgError> {
        let flag = |on: bool| if on { "true" } else { "false" };
        let lean = form == LimitedForm::Lean;
        let after_pick = form == LimitedForm::Pick;
        let to_fold = for_table(CLAIM_TO_FOLD, table)?;
        let quota = for_table_with(
            CLAIM_QUOTA,
            table,
            &[
                ("lean", flag(lean)),
                ("after_pick", flag(after_pick)),
                ("tally", &tally(table, "c", "t.now_ms", "$2::bigint")?),
                ("to_fold", &to_fold),
            ],
        )?;
        let rated = if after_pick {
            let slot = for_table_with(CLAIM_SLOT, table, &[("key", "p.partition_key")])?;
            for_table_with(
                CLAIM_RATED,
                table,
                &[("slot", &slot), ("to_fold", &to_fold)],
            )?
        } else {
            for_table(CLAIM_RATED_BEFORE_PICK, table)?
        };
        let partition_logs = if lean {
            String::new()
        } else {
            for_table(CLAIM_LOGGED_PARTITIONS, table)?
        };
        let turns = if after_pick {
            "(SELECT binds FROM binding)"
        } else {
            "false"
        };
        let flight_slot = slot_of("c.partition_key", FLIGHT_SLOTS)?;
        let counted = count_slots(
            table,
            "(SELECT jobs FROM flight_claims)",
            "EXISTS (SELECT 1 FROM claimed)",
        )?;
        let logged = for_table_with(
            CLAIM_LOGGED,
            table,
            &[
                ("turns", turns),
                ("partition_logs", &partition_logs),
                ("flight_slot", &flight_slot),
                ("count_slots", &counted),
                ("count_tally", &count_tally(table, "quota", "true")?),
                ("tally_claims", &tally_claims(table)?),
            ],
        )?;
        Ok(Self {
            quota,
            rated,
            logged,
        })
    }

    /// `claim_limited.sql` around these ends: the pick (`due`, `picks`) and the binding check.
    fn claim_limited(
        &self,
        table: &TableName,
        due: &str,
        binding: &str,
        picks: &str,
    ) -> Result<String, PgError> {
        for_table_with(
            CLAIM_LIMITED,
            table,
            &[
                ("claim_quota", &self.quota),
                ("claim_due", due),
                ("rated", &self.rated),
                ("binding", binding),
                ("claim_picks", picks),
                ("claim_logged", &self.logged),
            ],
        )
    }
}

/// `claim_limited.sql` for `table`: `claim_due.sql`'s pick within the quota, unless it would
/// put a partition over its limit (then a row marked `turns`: `claim_turns.sql` claims).
pub(crate) fn claim_limited(table: &TableName) -> Result<String, PgError> {
    let (due, picks) = claim_parts(table, &LIMITED_PICKS, Some(&limited_candidates(table)?))?;
    let started = key_started(table, "k.key")?;
    let binding = for_table_with(CLAIM_BINDING, table, &[("key_started", &started)])?;
    LimitedEnds::new(table, LimitedForm::Pick)?.claim_limited(table, &due, &binding, &picks)
}

/// The lean form of `claim_limited.sql` for `table`, for a queue without limits per partition:
/// every due job and takeover a candidate, no binding check, nothing logged per partition
/// (the executor opens none of the partition tables). Meeting limits per partition (set since
/// the handle last looked), it claims nothing and returns a row marked `partitioned`.
pub(crate) fn claim_limited_lean(table: &TableName) -> Result<String, PgError> {
    let (due, picks) = claim_parts(table, &QUOTA_PICKS, None)?;
    LimitedEnds::new(table, LimitedForm::Lean)?.claim_limited(
        table,
        &due,
        "SELECT false AS binds",
        &picks,
    )
}

/// The least margin of `claim_ahead.sql` (`$8`): how many claims of the batch asked for the
/// room of a queue-wide limit must leave space for before a claim goes ahead of the queue's
/// row lock. Claims that commit while one runs use up its margin; past it, the claim fails and
/// runs again under the lock (its pick and write wasted), so the margin keeps those rare far
/// from the limit, while near it every claim takes the lock, as `claim_limited.sql` does. A
/// queue handle widens it while its claims ahead fail (more workers claiming).
pub(crate) const AHEAD_MARGIN_LEAST: u32 = 4;

/// The widest margin a queue handle lets its claims ahead ask for.
pub(crate) const AHEAD_MARGIN_MOST: u32 = 256;

/// The text of the error `claim_ahead.sql` fails with when its jobs would put the queue over
/// a limit (SQLSTATE 22P02, the text cast to a number): the whole claim is undone.
pub(crate) const AHEAD_OVER: &str = "claim_ahead: over the limits of the queue";

/// Whether room may be granted to queue handles from the queue's row `c` (`grant.sql`): its
/// switch is on, and it has a limit in flight or a rate (per queue or per partition).
const GRANTING: &str = "(c.room_grants \
     AND (c.max_in_flight IS NOT NULL OR c.max_per_partition IS NOT NULL \
          OR (c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL) \
          OR (c.partition_rate_starts IS NOT NULL AND c.partition_rate_per_ms IS NOT NULL)))";

/// What a statement that deletes grants returns of each (`grant_log.sql` and `grant.sql`'s
/// sizing read it): its id, its jobs and claims left as the delete read the row (after any
/// claim on it that held it committed: final), its per-claim share, and the instant after, in
/// epoch milliseconds (past every start of its claims).
const SWEPT_RETURNING: &str = "g.grant_id, g.jobs_left, g.claims_left, g.per_claim, \
     extract(epoch FROM clock_timestamp())::float8 * 1000 AS at_ms, \
     extract(epoch FROM g.expires_at)::float8 * 1000 AS expires_ms";

/// `grant_log.sql` for the log `log` of the row `row` (its alias) at the instant `now_ms`
/// (SQL expressions).
fn grant_log(row: &str, now_ms: &str) -> Result<String, PgError> {
    render(
        GRANT_LOG,
        &[
            ("log", &format!("{row}.rate_log")),
            ("per_ms", &format!("{row}.rate_per_ms")),
            ("now_ms", now_ms),
        ],
    )
}

/// `grant_tally_back.sql` for the tally `tally` under the window `per_ms` (SQL expressions).
fn grant_tally_back(tally: &str, per_ms: &str) -> Result<String, PgError> {
    render(GRANT_TALLY_BACK, &[("tally", tally), ("per_ms", per_ms)])
}

/// The share of the room a queue's limits leave that one grant may take (`grant.sql`): the
/// others' grants take shares of the rest, and the claims under the lock what is left.
pub(crate) const GRANT_SHARE: u32 = 4;

/// The text of the error `claim_granted.sql` fails with when its grant is gone or has not the
/// room for its jobs (SQLSTATE 22P02, the text cast to a number): the whole claim is undone.
pub(crate) const GRANT_OVER: &str = "claim_granted: no room left of the grant";

/// The picks of `claim_granted.sql`: the batch asked for, at most the grant's jobs left of
/// them, takeovers included.
const GRANTED_PICKS: Picks<'static> = Picks {
    due_batch: "LEAST($2::bigint, COALESCE((SELECT jobs_left FROM room), 0))",
    batch: "LEAST($2::bigint, COALESCE((SELECT jobs_left FROM room), 0))",
    guard: "",
    expired_guard: "",
    claim_now: "now()",
};

/// `claim_granted.sql` for `table`: the claim on room granted to the queue handle.
pub(crate) fn claim_granted(table: &TableName) -> Result<String, PgError> {
    // Under a rate per partition, per_claim caps a slot of partition keys: the due picks and
    // the takeovers of each slot together, in the claim's order (the spend's guard is then only
    // a backstop). Otherwise every due pick (capped per partition) and takeover, as claim.sql
    // chooses: the ranked branch does not run (its condition is read once).
    let slot = slot_of("c.partition_key", PARTITION_SLOTS)?;
    let candidates = format!(
        "(SELECT * FROM due WHERE NOT (SELECT per_slot FROM room) \
          UNION ALL SELECT * FROM expired WHERE NOT (SELECT per_slot FROM room) \
          UNION ALL \
          SELECT c.id, c.next_attempt_at, c.priority, c.reclaims, c.expired, c.partition_key \
          FROM (SELECT c.*, row_number() OVER (PARTITION BY ({slot}) \
                                               ORDER BY c.next_attempt_at, c.priority, c.id) \
                           AS slot_nth \
                FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c \
                WHERE (SELECT per_slot FROM room)) AS c \
          WHERE c.partition_key IS NULL OR c.slot_nth <= (SELECT per_claim FROM room)) \
         AS candidates"
    );
    let (due, picks) = claim_parts_among(table, &GRANTED_PICKS, &candidates, "")?;
    for_table_with(
        CLAIM_GRANTED,
        table,
        &[
            ("claim_due", &due),
            ("claim_picks", &picks),
            ("over", GRANT_OVER),
            (
                "claimed_slot",
                &slot_of("cl.partition_key", PARTITION_SLOTS)?,
            ),
        ],
    )
}

/// The picks of `claim_ahead.sql`: the batch asked for, or none when the room is not ample.
const AHEAD_PICKS: Picks<'static> = Picks {
    due_batch: "(SELECT jobs FROM take)",
    batch: "(SELECT jobs FROM take)",
    guard: "",
    expired_guard: "OR NOT COALESCE((SELECT ok FROM fit), false)",
    claim_now: "now()",
};

/// The slots of partition keys in which a queue with `max_per_partition` counts the jobs its
/// limited claims put in flight (`claim_slot.sql`, the column `counted_slots`): a power of
/// two. A claim ahead bounds a partition's jobs put in flight meanwhile by its slot's count,
/// so fewer keys to a slot bound it more closely, and each slot costs 8 bytes of the queue's
/// row, which every limited claim of such a queue reads and writes whole.
const FLIGHT_SLOTS: u32 = 128;

/// `claim_slot.sql` for the partition key `key` (an SQL expression), among `slots` slots.
fn slot_of(key: &str, slots: u32) -> Result<String, PgError> {
    let mask = (slots - 1).to_string();
    render(CLAIM_SLOT, &[("key", key), ("slot_mask", &mask)])
}

/// `claim_tally.sql` for the queues row `row` (its alias), at the instant `now_ms`, for a claim
/// of `jobs` jobs (SQL expressions).
fn tally(table: &TableName, row: &str, now_ms: &str, jobs: &str) -> Result<String, PgError> {
    for_table_with(
        CLAIM_TALLY,
        table,
        &[("row", row), ("now_ms", now_ms), ("jobs", jobs)],
    )
}

/// `claim_count_tally.sql` reading its quota from `quota` (a relation or a subquery of one
/// row) and counting the claim when `fits` holds (an SQL expression); the claim's jobs per slot
/// are the CTE `tally_claims` (`claim_tally_claims.sql`).
fn count_tally(table: &TableName, quota: &str, fits: &str) -> Result<String, PgError> {
    for_table_with(
        CLAIM_COUNT_TALLY,
        table,
        &[
            ("quota", quota),
            ("fits", fits),
            ("over", AHEAD_OVER),
            ("added", TALLY_CLAIMS),
        ],
    )
}

/// The claim's jobs per slot of the tally, as `claim_count_tally.sql` and the claim ahead's
/// check read them.
const TALLY_CLAIMS: &str = "(SELECT jobs FROM tally_claims)";

/// `claim_tally_claims.sql` for `table`, the body of the CTE `tally_claims`.
fn tally_claims(table: &TableName) -> Result<String, PgError> {
    let slot = slot_of("cl.partition_key", PARTITION_SLOTS)?;
    for_table_with(CLAIM_TALLY_CLAIMS, table, &[("slot", &slot)])
}

/// `claim_slots_whole.sql` for `slots` (an SQL expression of a `counted_slots` value).
fn slots_whole(table: &TableName, slots: &str) -> Result<String, PgError> {
    for_table_with(CLAIM_SLOTS_WHOLE, table, &[("slots", slots)])
}

/// `claim_count_slots.sql` for a claim whose jobs per slot are `added` and which counts when
/// `counts` holds (SQL expressions).
fn count_slots(table: &TableName, added: &str, counts: &str) -> Result<String, PgError> {
    let row_whole = slots_whole(table, "c.counted_slots")?;
    for_table_with(
        CLAIM_COUNT_SLOTS,
        table,
        &[
            ("added", added),
            ("counts", counts),
            ("row_slots_whole", &row_whole),
        ],
    )
}

/// `claim_ahead.sql` for `table`: the claim of a queue with limits while they leave ample room,
/// which checks them only at its end (under the queue's row lock).
pub(crate) fn claim_ahead(table: &TableName) -> Result<String, PgError> {
    let (due, picks) = claim_parts(table, &AHEAD_PICKS, None)?;
    let flight_slot_held = slot_of("u.key", FLIGHT_SLOTS)?;
    let seen_whole = slots_whole(table, "(SELECT counted_slots FROM seen)")?;
    let snapshot_whole = slots_whole(table, "s.counted_slots")?;
    let row_whole = slots_whole(table, "c.counted_slots")?;
    let counted = count_slots(table, "(SELECT picks FROM slot_picks)", "true")?;
    let snapshot_tally = tally(table, "s", AHEAD_NOW_MS, "$8::bigint * $2::bigint")?;
    // The rate per partition at the end: the newest row's tally at one instant, for the jobs
    // taken, read once by the SET that counts them (claim_count_tally.sql), which fails the
    // claim when they do not fit.
    let row_tally = tally(
        table,
        "c",
        "x.now_ms",
        "(SELECT count(*) FROM claimed WHERE partition_key IS NOT NULL)",
    )?;
    let quota = format!(
        "(SELECT g.per_ms AS tally_per_ms, x.now_ms, g.kept AS slots_kept, g.unbound, g.usable, \
         g.slot_base, g.slot_counts \
         FROM (SELECT {AHEAD_NOW_MS} AS now_ms) AS x CROSS JOIN LATERAL ({row_tally}) AS g)"
    );
    // No partitioned job, or each slot with jobs of the claim within the rate by the tally's
    // count of it, read in one pass of both arrays (a count missing binds).
    let fits = format!(
        "(n.jobs = 0 OR q.unbound OR (q.usable AND NOT EXISTS (SELECT 1 \
         FROM unnest(q.slot_counts, {TALLY_CLAIMS}) AS t(counted, added) \
         WHERE t.added > 0 \
         AND (q.slot_base + t.counted + t.added > c.partition_rate_starts) IS NOT FALSE)))"
    );
    let counted_tally = count_tally(table, &quota, &fits)?;
    for_table_with(
        CLAIM_AHEAD,
        table,
        &[
            ("claim_due", &due),
            ("claim_picks", &picks),
            ("over", AHEAD_OVER),
            ("flight_slot_held", &flight_slot_held),
            ("seen_slots_whole", &seen_whole),
            ("snapshot_slots_whole", &snapshot_whole),
            ("row_slots_whole", &row_whole),
            ("count_slots", &counted),
            ("snapshot_tally", &snapshot_tally),
            ("count_tally", &counted_tally),
            (
                "rate_slot_pick",
                &slot_of("p.partition_key", PARTITION_SLOTS)?,
            ),
            ("tally_claims", &tally_claims(table)?),
            ("granting", GRANTING),
        ],
    )
}

/// The instant a claim ahead counts its rate per partition by, in epoch milliseconds: the
/// clock when it is read (a claim ahead reads it for its snapshot's tally, and again for the
/// newest row's once it holds the queue's row lock).
const AHEAD_NOW_MS: &str = "extract(epoch FROM clock_timestamp())::float8 * 1000";

/// `claim_turns.sql` for `table`: the claim of a queue whose partitions take turns.
pub(crate) fn claim_turns(table: &TableName) -> Result<String, PgError> {
    let (_, picks) = claim_parts(table, &QUOTA_PICKS, Some(&limited_candidates(table)?))?;
    let ends = LimitedEnds::new(table, LimitedForm::Turns)?;
    let started = key_started(table, "f.partition_key")?;
    let walk_room = for_table_with(CLAIM_WALK_ROOM, table, &[("key_started", &started)])?;
    let read_ahead = LOOSE_READ_AHEAD.to_string();
    let max_visits = queue_core::partition::MAX_PARTITION_VISITS.to_string();
    for_table_with(
        CLAIM_TURNS,
        table,
        &[
            ("claim_quota", &ends.quota),
            ("rated", &ends.rated),
            ("claim_picks", &picks),
            ("claim_logged", &ends.logged),
            ("loose_read_ahead", &read_ahead),
            ("max_visits", &max_visits),
            ("walk_room", &walk_room),
        ],
    )
}

/// The parameters of `finalize.sql` that `finalize_claim.sql` puts before the claim's.
pub(crate) const FINALIZE_PARAMS: usize = 10;

/// `finalize_claim.sql` for `table`: `finalize.sql`, then `claim_due.sql` and
/// `claim_picks.sql` with their parameters numbered after finalize's.
pub(crate) fn finalize_claim(table: &TableName) -> Result<String, PgError> {
    let finalize = for_table(FINALIZE, table)?;
    let (due, picks) = claim_parts(table, &PLAIN_PICKS, None)?;
    let due = shift_params(&due, FINALIZE_PARAMS);
    let picks = shift_params(&picks, FINALIZE_PARAMS);
    for_table_with(
        FINALIZE_CLAIM,
        table,
        &[
            ("finalize", &finalize),
            ("claim_due", &due),
            ("claim_picks", &picks),
        ],
    )
}

/// Renumbers every parameter (`$n`) of `sql` to `$(n + by)`, leaving comments and string
/// literals alone: how one statement's text serves inside another whose parameters come
/// first.
fn shift_params(sql: &str, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut chars = sql.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '-' if sql[at..].starts_with("--") => {
                let end = sql[at..].find('\n').map_or(sql.len(), |n| at + n);
                out.push_str(&sql[at..end]);
                while chars.peek().is_some_and(|&(i, _)| i < end) {
                    chars.next();
                }
            }
            '\'' => {
                out.push(c);
                for (_, inner) in chars.by_ref() {
                    out.push(inner);
                    if inner == '\'' {
                        break;
                    }
                }
            }
            '$' if chars.peek().is_some_and(|(_, d)| d.is_ascii_digit()) => {
                let mut number = 0;
                while let Some(&(_, d)) = chars.peek().filter(|(_, d)| d.is_ascii_digit()) {
                    number = number * 10 + (d as usize - '0' as usize);
                    chars.next();
                }
                out.push_str(&format!("${}", number + by));
            }
            _ => out.push(c),
        }
    }
    out
}

/// The `AND status IN (…)` of `list_jobs.sql` for `statuses` (empty: no filter). The literals
/// come from [`JobStatus::as_str`] only, so the planner sees them and can pick the partial
/// index they match.
fn status_filter(statuses: &[JobStatus]) -> String {
    if statuses.is_empty() {
        return String::new();
    }
    let list: Vec<String> = statuses
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    format!("AND status IN ({})", list.join(", "))
}

/// The first line of `claim.sql`, which every running claim statement's text starts with
/// (`claims_running.sql` finds them by it; `finalize_claim.sql` starts with it too).
pub(crate) fn claim_first_line() -> &'static str {
    CLAIM.text.lines().next().unwrap_or_default()
}

/// The statements of one table, rendered once per queue handle.
#[derive(Debug, Clone)]
pub(crate) struct Sql {
    pub(crate) enqueue: Arc<str>,
    pub(crate) enqueue_plain: Arc<str>,
    pub(crate) enqueue_ids: Arc<str>,
    pub(crate) enqueue_copy: Arc<str>,
    pub(crate) notify: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) claim_limited: Arc<str>,
    pub(crate) claim_checked: Arc<str>,
    pub(crate) claim_check: Arc<str>,
    pub(crate) claim_limited_lean: Arc<str>,
    pub(crate) claim_turns: Arc<str>,
    pub(crate) claim_ahead: Arc<str>,
    pub(crate) lock_queue: Arc<str>,
    pub(crate) grant: Arc<str>,
    pub(crate) claim_granted: Arc<str>,
    pub(crate) return_grant: Arc<str>,
    pub(crate) set_room_grants: Arc<str>,
    pub(crate) fold_starts: Arc<str>,
    pub(crate) set_limits: Arc<str>,
    pub(crate) finalize: Arc<str>,
    pub(crate) finalize_claim: Arc<str>,
    pub(crate) extend_lease: Arc<str>,
    pub(crate) extend_leases: Arc<str>,
    pub(crate) cancel: Arc<str>,
    pub(crate) get: Arc<str>,
    pub(crate) counts: Arc<str>,
    pub(crate) stats: Arc<str>,
    pub(crate) sweep_finished: Arc<str>,
    pub(crate) find_unique: Arc<str>,
    pub(crate) retry: Arc<str>,
    pub(crate) purge: Arc<str>,
    pub(crate) pause: Arc<str>,
    pub(crate) queue_control: Arc<str>,
    pub(crate) queues: Arc<str>,
    pub(crate) record_stale: Arc<str>,
    pub(crate) note_served: Arc<str>,
    pub(crate) throughput: Arc<str>,
    pub(crate) record_schedules: Arc<str>,
    pub(crate) schedules: Arc<str>,
    pub(crate) forget_schedule: Arc<str>,
    table: TableName,
}

impl Sql {
    pub(crate) fn new(table: &TableName) -> Result<Self, PgError> {
        let r = |template| for_table(template, table).map(Arc::from);
        Ok(Sql {
            enqueue: r(ENQUEUE)?,
            enqueue_plain: r(ENQUEUE_PLAIN)?,
            enqueue_ids: r(ENQUEUE_IDS)?,
            enqueue_copy: r(ENQUEUE_COPY)?,
            notify: r(NOTIFY)?,
            claim: claim(table)?.into(),
            claim_limited: claim_limited(table)?.into(),
            claim_checked: claim_checked(table)?.into(),
            claim_check: for_table(CLAIM_CHECK, table)?.into(),
            claim_limited_lean: claim_limited_lean(table)?.into(),
            claim_turns: claim_turns(table)?.into(),
            claim_ahead: claim_ahead(table)?.into(),
            lock_queue: r(LOCK_QUEUE)?,
            grant: for_table_with(
                GRANT,
                table,
                &[
                    ("granting", GRANTING),
                    ("grant_share", &GRANT_SHARE.to_string()),
                    ("swept_returning", SWEPT_RETURNING),
                    (
                        "rewritten_log",
                        &grant_log("c", "extract(epoch FROM c.now_at)::float8 * 1000")?,
                    ),
                    ("tally_back", &grant_tally_back("c.tally", "c.key_per_ms")?),
                    ("due_slot", &slot_of("j.partition_key", PARTITION_SLOTS)?),
                ],
            )?
            .into(),
            claim_granted: claim_granted(table)?.into(),
            return_grant: for_table_with(
                RETURN_GRANT,
                table,
                &[
                    ("swept_returning", SWEPT_RETURNING),
                    (
                        "rewritten_log",
                        &grant_log("c", "extract(epoch FROM clock_timestamp())::float8 * 1000")?,
                    ),
                    (
                        "tally_back",
                        &grant_tally_back(
                            "c.partition_tally",
                            "(CASE WHEN c.partition_rate_starts IS NOT NULL \
                             THEN c.partition_rate_per_ms END)",
                        )?,
                    ),
                ],
            )?
            .into(),
            set_room_grants: r(SET_ROOM_GRANTS)?,
            fold_starts: r(FOLD_STARTS)?,
            set_limits: for_table_with(
                SET_LIMITS,
                table,
                &[("row_slots_whole", &slots_whole(table, "c.counted_slots")?)],
            )?
            .into(),
            finalize: r(FINALIZE)?,
            finalize_claim: finalize_claim(table)?.into(),
            extend_lease: r(EXTEND_LEASE)?,
            extend_leases: r(EXTEND_LEASES)?,
            cancel: r(CANCEL)?,
            get: r(GET)?,
            counts: r(COUNTS)?,
            stats: r(STATS)?,
            sweep_finished: r(SWEEP_FINISHED)?,
            find_unique: r(FIND_UNIQUE)?,
            retry: r(RETRY)?,
            purge: r(PURGE)?,
            pause: r(PAUSE)?,
            queue_control: r(QUEUE_CONTROL)?,
            queues: r(QUEUES)?,
            record_stale: r(RECORD_STALE)?,
            note_served: r(NOTE_SERVED)?,
            throughput: r(THROUGHPUT)?,
            record_schedules: r(RECORD_SCHEDULES)?,
            schedules: r(SCHEDULES)?,
            forget_schedule: r(FORGET_SCHEDULE)?,
            table: table.clone(),
        })
    }

    /// `list_jobs.sql` for `statuses`, rendered per call (seven shapes at most; each is a
    /// distinct prepared statement).
    pub(crate) fn list_jobs(&self, statuses: &[JobStatus]) -> Result<String, PgError> {
        for_table_with(
            LIST_JOBS,
            &self.table,
            &[("statuses", &status_filter(statuses))],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn squash(sql: &str) -> String {
        sql.lines()
            .filter(|line| !line.trim_start().starts_with("--"))
            .flat_map(str::split_whitespace)
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn queue_jobs(template: Template) -> String {
        for_table(template, &TableName::default()).unwrap()
    }

    /// Pins the properties the lease protocol rests on; a change here is a change of the
    /// protocol and needs the conformance suite extended, not this test edited away.
    #[test]
    fn claim_statement_keeps_the_lease_protocol() {
        let claim = squash(&claim(&TableName::default()).unwrap());
        for needle in [
            "status = 'pending' AND next_attempt_at <= now()",
            "(lease_expires_at < now() OR lease_expires_at IS NULL) AND (lease_generation = claim_generation OR claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $3))",
            "lease_generation = j.claim_generation + 1",
            "lease_expires_at = now() + make_interval(secs => $3)",
            "ORDER BY lease_expires_at NULLS FIRST",
            "FOR UPDATE SKIP LOCKED",
            "claim_generation = j.claim_generation + 1",
            "claim_token = $6,",
            "attempts = j.attempts + 1",
            "claimed_at = now()",
            "due AS MATERIALIZED",
            "expired AS MATERIALIZED",
            "ORDER BY next_attempt_at, priority, id LIMIT $2",
        ] {
            assert!(claim.contains(needle), "claim lost {needle:?}");
        }
        assert_eq!(claim.matches("FOR UPDATE SKIP LOCKED").count(), 2);
        assert!(
            !claim.contains(" OR status"),
            "the two picks must stay separate"
        );
    }

    #[test]
    fn every_lease_holder_write_is_fenced_on_status_generation_and_token() {
        assert!(squash(&queue_jobs(FINALIZE)).contains(
            "WHERE j.id = u.id AND j.status = 'in_flight' AND j.claim_generation = u.claim_generation AND j.claim_token = u.claim_token"
        ));
        assert!(squash(&queue_jobs(EXTEND_LEASE)).contains(
            "WHERE id = $1 AND status = (SELECT 'in_flight') AND claim_generation = $2 AND claim_token = $4"
        ));
        assert!(
            squash(&queue_jobs(EXTEND_LEASE))
                .contains("lease_expires_at = now() + make_interval(secs => $3)")
        );
    }

    /// The claim ahead's refusal is the text its caller looks for, cast whole (no quote in it
    /// to end the literal early).
    #[test]
    fn the_claim_ahead_fails_with_the_text_its_caller_looks_for() {
        assert!(!AHEAD_OVER.contains('\''));
        let text = claim_ahead(&TableName::default()).unwrap();
        assert!(text.contains(&format!(
            "('{AHEAD_OVER} with ' || (SELECT count(*) FROM claimed)"
        )));
    }

    #[test]
    fn every_statement_renders_for_any_table_and_touches_only_the_table() {
        let table = TableName::new("exchange_send_jobs").unwrap();
        let sql = Sql::new(&table).unwrap();
        assert!(sql.claim.contains("FROM \"exchange_send_jobs\""));
        for text in [
            &sql.enqueue,
            &sql.claim,
            &sql.finalize,
            &sql.get,
            &sql.cancel,
        ] {
            assert!(!text.contains("queue_jobs"), "{text}");
            assert!(!text.contains("{{"), "{text}");
        }
        assert!(sql.get.contains("SELECT id, queue, status, payload"));
    }

    /// The fused statement is the claim and the finalize, word for word, with the claim's
    /// parameters after the finalize's; and it is found as a claim by a drain.
    #[test]
    fn the_fused_statement_is_the_claim_and_the_finalize() {
        let table = TableName::default();
        let fused = squash(&finalize_claim(&table).unwrap());
        assert!(fused.contains(&squash(&queue_jobs(FINALIZE))));
        let (due, picks) = claim_parts(&table, &PLAIN_PICKS, None).unwrap();
        assert!(fused.contains(&squash(&shift_params(&due, FINALIZE_PARAMS))));
        assert!(fused.contains(&squash(&shift_params(&picks, FINALIZE_PARAMS))));
        assert!(fused.contains("queue = $11 AND status = 'pending'"));
        assert!(fused.contains("AND id <> ALL($17::bigint[])"));
        assert!(fused.contains("claim_token = $16,"));
        for n in 1..=17 {
            assert!(fused.contains(&format!("${n}")), "${n} unused");
        }
        assert!(!fused.contains("$18") && !fused.contains("$0"));
        let first = finalize_claim(&table).unwrap();
        assert!(first.starts_with(claim_first_line()));
        assert!(claim(&table).unwrap().starts_with(claim_first_line()));
        assert!(
            claim_limited(&table)
                .unwrap()
                .starts_with(claim_first_line())
        );
        assert!(claim_turns(&table).unwrap().starts_with(claim_first_line()));
        assert!(claim_ahead(&table).unwrap().starts_with(claim_first_line()));
        let lean = claim_limited_lean(&table).unwrap();
        assert!(lean.starts_with(claim_first_line()));
        // The lean form writes none of the partition tables, and reads only the queue's
        // pending claims: claim_to_fold.sql's two reads, behind a constant false (the planner
        // drops them), and claim_key_started.sql's of the claims on grants, behind the rate
        // per partition the lean form refuses.
        let code = |text: &str| -> String {
            text.lines()
                .filter(|line| !line.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let lean = code(&lean);
        assert!(!lean.contains("\"queue_jobs_starts\""), "{lean}");
        assert_eq!(
            lean.matches("\"queue_jobs_claim_starts\"").count(),
            3,
            "{lean}"
        );
        assert!(
            lean.contains("NOT true AND NOT false AND g.per_ms"),
            "{lean}"
        );
        let full = code(&claim_limited(&table).unwrap());
        assert!(full.contains("INTO \"queue_jobs_claim_starts\""));
        assert!(full.contains("INTO \"queue_jobs_starts\""));
        // The full form decides the rate per partition after its pick (by the slots' tally);
        // the turns decide it before theirs.
        assert!(
            full.contains("NOT false AND NOT true AND g.per_ms"),
            "{full}"
        );
        assert!(full.contains("FROM plain AS p"), "{full}");
        let turns = code(&claim_turns(&table).unwrap());
        assert!(
            turns.contains("NOT false AND NOT false AND g.per_ms"),
            "{turns}"
        );
    }

    #[test]
    fn parameters_shift_outside_comments_and_literals() {
        assert_eq!(
            shift_params("a = $1 -- $2\nAND b = '$3' AND c = $12", 10),
            "a = $11 -- $2\nAND b = '$3' AND c = $22"
        );
    }

    #[test]
    fn a_leftover_token_is_refused() {
        let template = Template {
            name: "typo.sql",
            text: "SELECT 1 FROM \"{{table}}\" WHERE queue = '{{queu}}'",
        };
        let err = render(template, &[("table", "jobs")]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("typo.sql") && text.contains("{{queu}}"),
            "{text}"
        );
        // The upgrade needs its queue: rendered for a table alone it is refused.
        assert!(for_table(UPGRADE_LEGACY_COLUMNS, &TableName::default()).is_err());
    }
}
