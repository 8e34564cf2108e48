//! The legacy upgrade, in phases that a live service can run: a legacy queue table (the
//! pre-lease claim pattern: `status` + `attempts` + `next_attempt_at`, no claim stamp) brought
//! to the lease schema in place, while the legacy release goes on reading and writing it.
//!
//! | phase | what | locks |
//! |---|---|---|
//! | [`UpgradePhase::Columns`] | one catalog-only `ALTER TABLE … ADD COLUMN IF NOT EXISTS` | `ACCESS EXCLUSIVE`, for milliseconds once granted; waits at most `lock_timeout` per try (readers and writers queue behind a waiting ALTER), tried again with backoff |
//! | [`UpgradePhase::Backfill`] | `finished_at` of terminal rows, in batches of the primary key | row locks on one batch, one short transaction per batch |
//! | [`UpgradePhase::Indexes`] | each lease index `CREATE INDEX CONCURRENTLY` (an invalid leftover dropped first) | `SHARE UPDATE EXCLUSIVE`: readers and writers go on |
//! | [`UpgradePhase::RetireIndexes`] | the legacy indexes named by the caller, `DROP INDEX CONCURRENTLY` | the same |
//! | [`UpgradePhase::TableMigrations`] | each framework table migration later than the columns phase, as it is | its own (catalog changes of the queue's companion tables: `ACCESS EXCLUSIVE` on them for milliseconds), under `lock_timeout`, tried again with backoff |
//!
//! The columns phase is frozen: a service that committed it as a migration of its own keeps
//! its text. Table migrations of later releases come as steps of their own, at the end, so
//! that the files committed before keep their places too.
//!
//! Every phase can be run again: columns and indexes are skipped when present and valid, the
//! backfill stamps only what is left, the later table migrations run again (they create or
//! replace their objects). [`PostgresQueue::upgrade_legacy_table`] runs the phases
//! on either driver and reports progress; [`LegacyUpgrade::migration_files`] gives the same
//! statements as migration files for a service whose migrator applies them (sqlx's
//! `-- no-transaction` files for the statements that cannot run in a transaction).

use std::time::{Duration, Instant};

use queue_core::QueueName;
use tracing::Instrument;

use crate::driver::Driver;
use crate::error::PgError;
use crate::ident::{TableName, validate_index_name};
use crate::queue::PostgresQueue;
use crate::sql::{self, Template};
use crate::statement;

/// The phases of the legacy upgrade, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UpgradePhase {
    /// The lease schema's columns (catalog only, under a short `lock_timeout`).
    Columns,
    /// `finished_at` stamped on terminal rows, in bounded batches.
    Backfill,
    /// The lease schema's indexes, built concurrently.
    Indexes,
    /// Legacy indexes the lease schema supersedes, dropped concurrently.
    RetireIndexes,
    /// The framework's table migrations later than the columns phase's, one step each.
    TableMigrations,
}

impl UpgradePhase {
    /// The phase's name, as `queuectl` and the progress events print it.
    pub fn as_str(self) -> &'static str {
        match self {
            UpgradePhase::Columns => "columns",
            UpgradePhase::Backfill => "backfill",
            UpgradePhase::Indexes => "indexes",
            UpgradePhase::RetireIndexes => "retire-indexes",
            UpgradePhase::TableMigrations => "table-migrations",
        }
    }
}

/// One statement of the upgrade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeStep {
    /// The phase it belongs to.
    pub phase: UpgradePhase,
    /// What it makes: a column set, an index name, the backfill.
    pub name: String,
    /// The statement. The backfill's binds `$1` (the last id done), `$2` (the batch size) and
    /// `$3` (the highest id when it began).
    pub sql: String,
}

/// A migration file of the upgrade (see [`LegacyUpgrade::migration_files`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationFile {
    /// A description for the file name (`<version>_<description>.sql`).
    pub description: String,
    /// The file's text; a file that must run outside a transaction starts with
    /// `-- no-transaction`.
    pub sql: String,
}

/// What the upgrade is doing, for a progress display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeProgress {
    /// The phase.
    pub phase: UpgradePhase,
    /// The step's name (an index, the column set, the backfill).
    pub step: String,
    /// How far the step is: rows of the primary key passed (backfill), or steps done.
    pub done: u64,
    /// How far it has to go, when known.
    pub total: Option<u64>,
}

/// What [`PostgresQueue::upgrade_legacy_table`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpgradeReport {
    /// Whether the columns were added (false: they were all there, and the columns phase
    /// took no lock). The later table migrations run every time.
    pub columns_added: bool,
    /// Tries (of the `ALTER` or of a backfill batch) that ran into `lock_timeout`, a shorter
    /// `statement_timeout` or a deadlock, and were made again.
    pub lock_retries: u32,
    /// Terminal rows given a `finished_at`.
    pub rows_stamped: u64,
    /// Indexes built (an invalid leftover dropped and built again counts here).
    pub indexes_built: Vec<String>,
    /// Invalid leftovers of an earlier, failed build that were dropped.
    pub invalid_indexes_dropped: Vec<String>,
    /// Legacy indexes dropped.
    pub indexes_retired: Vec<String>,
    /// How long each phase took, in the order they ran.
    pub phase_times: Vec<(UpgradePhase, Duration)>,
}

/// The legacy upgrade of one table: what it adds, and how careful it is with locks.
///
/// ```
/// use queue_postgres::{LegacyUpgrade, TableName};
/// use queue_core::QueueName;
///
/// let upgrade = LegacyUpgrade::new(TableName::new("invoice_jobs")?, QueueName::new("invoices")?)
///     .retire_index("idx_invoice_jobs_stuck")?;
/// // Commit these as migrations of your own, or run them with PgQueue::upgrade_legacy_table.
/// let files = upgrade.migration_files()?;
/// assert!(files[0].sql.contains("ALTER TABLE \"invoice_jobs\""));
/// assert!(files.iter().any(|f| f.sql.contains("CREATE INDEX CONCURRENTLY")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegacyUpgrade {
    table: TableName,
    queue: QueueName,
    retire: Vec<String>,
    lock_timeout: Duration,
    lock_attempts: u32,
    batch_size: u32,
}

impl LegacyUpgrade {
    /// How long the `ALTER` waits for its lock per try, by default. Readers and writers that
    /// arrive while it waits queue behind it, so this is the longest they are held up.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_millis(500);
    /// How many times the `ALTER` is tried, by default.
    pub const DEFAULT_LOCK_ATTEMPTS: u32 = 30;
    /// Rows of the primary key per backfill batch, by default.
    pub const DEFAULT_BATCH_SIZE: u32 = 10_000;

    /// The upgrade of `table`; rows the legacy release inserts without a queue belong to
    /// `queue`.
    pub fn new(table: TableName, queue: QueueName) -> Self {
        LegacyUpgrade {
            table,
            queue,
            retire: Vec::new(),
            lock_timeout: Self::DEFAULT_LOCK_TIMEOUT,
            lock_attempts: Self::DEFAULT_LOCK_ATTEMPTS,
            batch_size: Self::DEFAULT_BATCH_SIZE,
        }
    }

    /// Drops the legacy index `name` at the end (its old stuck-job or pending index, which the
    /// lease schema supersedes). Refused unless 1 to 63 lowercase ASCII letters, digits and
    /// `_`.
    pub fn retire_index(mut self, name: &str) -> Result<Self, PgError> {
        validate_index_name(name)?;
        self.retire.push(name.to_owned());
        Ok(self)
    }

    /// How long the `ALTER` waits for its lock per try (1 ms to 60 s).
    pub fn lock_timeout(mut self, timeout: Duration) -> Result<Self, PgError> {
        if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(60) {
            return Err(PgError::Setting {
                what: "lock_timeout",
                range: "1 ms to 60 s",
            });
        }
        self.lock_timeout = timeout;
        Ok(self)
    }

    /// How many times the `ALTER` is tried before the upgrade gives up (at least 1).
    pub fn lock_attempts(mut self, attempts: u32) -> Self {
        self.lock_attempts = attempts.max(1);
        self
    }

    /// Rows of the primary key per backfill batch (1 to 1 000 000).
    pub fn batch_size(mut self, rows: u32) -> Result<Self, PgError> {
        if !(1..=1_000_000).contains(&rows) {
            return Err(PgError::Setting {
                what: "batch_size",
                range: "1 to 1000000 rows",
            });
        }
        self.batch_size = rows;
        Ok(self)
    }

    /// The table upgraded.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// `template` rendered, without its comments: what `pg_stat_activity` shows of a running
    /// step starts with the statement (it keeps only the first kilobyte of a query).
    fn render(&self, template: Template, extra: &[(&str, &str)]) -> Result<String, PgError> {
        let mut values = vec![
            ("table", self.table.as_str()),
            ("queue", self.queue.as_str()),
        ];
        values.extend_from_slice(extra);
        let text = sql::render(template, &values)?;
        Ok(text
            .lines()
            .filter(|line| !line.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
            .trim()
            .to_owned())
    }

    /// The columns phase: `upgrade_legacy_columns.sql`, then the table migrations whose
    /// objects it does not state itself, through the one it is frozen at (room grants,
    /// `20261212000001`, rendered as they are). The later ones are steps of their own.
    fn columns(&self) -> Result<String, PgError> {
        let mut text = self.render(sql::UPGRADE_LEGACY_COLUMNS, &[])?;
        for (version, _, template) in sql::TABLE_MIGRATIONS {
            if (sql::UPGRADE_COLUMNS_RENDER_FROM..=sql::UPGRADE_COLUMNS_RENDER_THROUGH)
                .contains(&version)
            {
                let migration = self.render(template, &[])?;
                text.push_str(";\n\n");
                text.push_str(migration.trim_end_matches(';'));
            }
        }
        Ok(text)
    }

    /// The statements of the upgrade, phase by phase, in order.
    pub fn steps(&self) -> Result<Vec<UpgradeStep>, PgError> {
        let mut steps = vec![
            UpgradeStep {
                phase: UpgradePhase::Columns,
                name: "lease columns".to_owned(),
                sql: self.columns()?,
            },
            UpgradeStep {
                phase: UpgradePhase::Backfill,
                name: "finished_at of terminal rows".to_owned(),
                sql: self.render(
                    sql::UPGRADE_LEGACY_BACKFILL,
                    &[("after", "$1"), ("limit", "$2"), ("until", "$3")],
                )?,
            },
        ];
        for statement in statements(&self.render(sql::UPGRADE_LEGACY_INDEXES, &[])?) {
            steps.push(UpgradeStep {
                phase: UpgradePhase::Indexes,
                name: index_of(&statement)?,
                sql: statement,
            });
        }
        for index in &self.retire {
            steps.push(UpgradeStep {
                phase: UpgradePhase::RetireIndexes,
                name: index.clone(),
                sql: format!("DROP INDEX CONCURRENTLY IF EXISTS \"{index}\""),
            });
        }
        for (version, description, template) in sql::TABLE_MIGRATIONS {
            if version > sql::UPGRADE_COLUMNS_RENDER_THROUGH {
                steps.push(UpgradeStep {
                    phase: UpgradePhase::TableMigrations,
                    name: format!("{version} {description}"),
                    sql: self.render(template, &[])?,
                });
            }
        }
        Ok(steps)
    }

    /// The upgrade as migration files, in order, for a service that applies it with its own
    /// migrator: the columns in a transaction under `SET LOCAL lock_timeout` (a try that times
    /// out fails the migration; run it again), then one `-- no-transaction` file per statement
    /// that cannot run in one (sqlx runs such a file as it is, and PostgreSQL refuses
    /// `CREATE INDEX CONCURRENTLY` in a multi-statement string). The backfill is a `DO` block
    /// that commits after every batch. An index build that failed leaves an invalid index,
    /// which `IF NOT EXISTS` would keep: the start-up schema check refuses it, and
    /// [`PostgresQueue::upgrade_legacy_table`] repairs it.
    pub fn migration_files(&self) -> Result<Vec<MigrationFile>, PgError> {
        let timeout_ms = self.lock_timeout.as_millis();
        let mut files = Vec::new();
        for step in self.steps()? {
            let (description, sql) = match step.phase {
                UpgradePhase::Columns => (
                    format!("{}_lease_columns", self.table),
                    format!(
                        "SET LOCAL lock_timeout = '{timeout_ms}ms';\n{};\n",
                        step.sql
                    ),
                ),
                UpgradePhase::Backfill => (
                    format!("{}_backfill_finished_at", self.table),
                    self.backfill_block()?,
                ),
                UpgradePhase::Indexes => (
                    format!("{}_index", step.name.trim_end_matches("_idx")),
                    format!("-- no-transaction\n{};\n", step.sql),
                ),
                UpgradePhase::RetireIndexes => (
                    format!("drop_{}", step.name),
                    format!("-- no-transaction\n{};\n", step.sql),
                ),
                UpgradePhase::TableMigrations => {
                    // "20261213000001 grant fence" -> "<table>_grant_fence".
                    let description = step.name.split_once(' ').map_or("", |(_, d)| d);
                    (
                        format!("{}_{}", self.table, description.replace(' ', "_")),
                        format!(
                            "SET LOCAL lock_timeout = '{timeout_ms}ms';\n{};\n",
                            step.sql.trim_end_matches(';')
                        ),
                    )
                }
            };
            files.push(MigrationFile { description, sql });
        }
        Ok(files)
    }

    /// The backfill as one `DO` block, committing after every batch (allowed in a `DO` run on
    /// its own, outside a transaction).
    fn backfill_block(&self) -> Result<String, PgError> {
        let batch = self.batch_size.to_string();
        let statement = self.render(
            sql::UPGRADE_LEGACY_BACKFILL,
            &[
                ("after", "upgrade_after"),
                ("limit", &batch),
                ("until", "upgrade_until"),
            ],
        )?;
        let body: Vec<&str> = statement.lines().collect();
        Ok(format!(
            "-- no-transaction\nDO $upgrade$\nDECLARE\n    upgrade_after bigint := (SELECT min(id) - 1 \
             FROM \"{table}\");\n    upgrade_stamped bigint;\n    upgrade_until bigint := \
             (SELECT max(id) FROM \"{table}\");\nBEGIN\n    LOOP\n        {}\n        INTO upgrade_after, \
             upgrade_stamped;\n        EXIT WHEN upgrade_after IS NULL;\n        COMMIT;\n    \
             END LOOP;\nEND\n$upgrade$;\n",
            body.join("\n        "),
            table = self.table,
        ))
    }
}

/// The statements of a template of several: comments left out, then split at each `;`.
fn statements(text: &str) -> Vec<String> {
    let code: Vec<&str> = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect();
    code.join("\n")
        .split(';')
        .map(|statement| statement.trim().to_owned())
        .filter(|statement| !statement.is_empty())
        .collect()
}

/// The index an index statement names first (`… IF NOT EXISTS "name" ON …`).
fn index_of(statement: &str) -> Result<String, PgError> {
    statement
        .split('"')
        .nth(1)
        .map(str::to_owned)
        .ok_or(PgError::Template {
            template: sql::UPGRADE_LEGACY_INDEXES.name,
            token: "an index statement without a quoted name".to_owned(),
        })
}

/// Backoff between tries of the `ALTER`: doubling from 50 ms to 2 s, with jitter so that two
/// upgraders (or an upgrader and a busy writer) do not keep meeting.
fn lock_backoff(try_number: u32) -> Duration {
    let base = 50u64.saturating_mul(1 << try_number.min(6)).min(2_000);
    Duration::from_millis(base / 2 + fastrand::u64(0..=base / 2))
}

impl<D: Driver> PostgresQueue<D> {
    /// Runs the legacy upgrade's phases on `pool` while the table stays in use (see
    /// [`LegacyUpgrade`] and the module table for what each locks), calling `progress` as it
    /// goes. Every phase can be run again; an interrupted upgrade is resumed by running it
    /// again. Refused with [`PgError::LockNotAvailable`] when the `ALTER` did not get its lock
    /// in `lock_attempts` tries (nothing changed then).
    ///
    /// Once started, the upgrade runs to its end on a task of its own: a caller that stops
    /// waiting (a timeout, an aborted task) stops getting progress, not the upgrade, whose
    /// lock is held until its last step ended (a concurrent index build goes on after its
    /// client left, and a second upgrade must not find it half-built).
    pub async fn upgrade_legacy_table(
        pool: &D::Pool,
        upgrade: &LegacyUpgrade,
        mut progress: impl FnMut(&UpgradeProgress) + Send,
    ) -> Result<UpgradeReport, PgError> {
        let steps = upgrade.steps()?;
        let (pool, upgrade) = (pool.clone(), upgrade.clone());
        let (sent, mut received) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(
            async move {
                let lock = UpgradeLock::<D>::take(&pool, &upgrade.table).await?;
                let mut send = |step: &UpgradeProgress| {
                    // A caller that stopped waiting reads no progress; the upgrade goes on.
                    let _ = sent.send(step.clone());
                };
                let result = run_steps::<D>(&pool, &upgrade, &steps, &mut send).await;
                lock.release().await;
                result
            }
            .instrument(tracing::Span::current()),
        );
        while let Some(step) = received.recv().await {
            progress(&step);
        }
        task.await.map_err(|e| PgError::Task {
            task: "legacy upgrade",
            message: e.to_string(),
        })?
    }
}

/// The upgrade's advisory lock, on a connection of its own that stays idle while it is held.
/// Dropped without [`release`](Self::release) (the caller stopped waiting for the upgrade),
/// its connection is closed rather than pooled, which releases the lock: a pooled one would
/// hold it for the connection's lifetime and refuse every later upgrade of the table.
struct UpgradeLock<D: Driver> {
    conn: Option<D::Pooled>,
    table: String,
}

impl<D: Driver> Drop for UpgradeLock<D> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            D::discard(conn);
        }
    }
}

impl<D: Driver> UpgradeLock<D> {
    async fn take(pool: &D::Pool, table: &TableName) -> Result<Self, PgError> {
        let text = sql::render(sql::UPGRADE_LOCK, &[])?;
        // The guard exists before the lock is asked for: whatever happens between the ask and
        // its answer, the connection is closed rather than pooled holding the lock. A refusal
        // closes it too (it holds nothing then; one connection more to open).
        let mut lock = UpgradeLock {
            conn: Some(D::acquire(pool).await?),
            table: table.as_str().to_owned(),
        };
        let conn = lock.conn.as_mut().expect("the guard's connection");
        let rows = D::query(D::pooled(conn), &text, &(table.as_str(), true)).await?;
        let held = match rows.first() {
            Some(row) => D::get::<bool>(row, "held")?,
            None => false,
        };
        if !held {
            return Err(PgError::UpgradeInProgress {
                table: table.to_string(),
            });
        }
        Ok(lock)
    }

    /// Releases the lock, and the connection to the pool. A connection that failed meanwhile
    /// has released it already; one whose unlock failed or was dropped half-way is closed (the
    /// guard's drop).
    async fn release(mut self) {
        let (Some(conn), Ok(text)) = (self.conn.as_mut(), sql::render(sql::UPGRADE_LOCK, &[]))
        else {
            return;
        };
        let unlocked = D::query(D::pooled(conn), &text, &(self.table.as_str(), false)).await;
        if unlocked.is_ok() {
            // Back to the pool: the session holds nothing any more.
            drop(self.conn.take());
        }
    }
}

async fn run_steps<D: Driver>(
    pool: &D::Pool,
    upgrade: &LegacyUpgrade,
    steps: &[UpgradeStep],
    progress: &mut (impl FnMut(&UpgradeProgress) + Send),
) -> Result<UpgradeReport, PgError> {
    let mut report = UpgradeReport::default();
    let mut phase_started: Option<(UpgradePhase, Instant)> = None;
    for step in steps {
        if phase_started.map(|(phase, _)| phase) != Some(step.phase) {
            if let Some((phase, at)) = phase_started {
                report.phase_times.push((phase, at.elapsed()));
            }
            phase_started = Some((step.phase, Instant::now()));
        }
        match step.phase {
            UpgradePhase::Columns => add_columns::<D>(pool, upgrade, step, &mut report).await?,
            UpgradePhase::Backfill => {
                backfill::<D>(pool, upgrade, step, &mut report, progress).await?
            }
            UpgradePhase::Indexes => {
                build_index::<D>(pool, &upgrade.table, step, &mut report).await?
            }
            UpgradePhase::RetireIndexes => {
                let mut conn = D::acquire(pool).await?;
                D::batch_execute(D::pooled(&mut conn), &step.sql).await?;
                report.indexes_retired.push(step.name.clone());
            }
            // Run every time: they change the queue's companion tables only (`ACCESS
            // EXCLUSIVE` on them for milliseconds), and a trigger of theirs dropped or disabled
            // by hand (the schema check names it) comes back enabled.
            UpgradePhase::TableMigrations => {
                with_lock_retries::<D>(pool, upgrade, &mut report, &step.sql, None).await?;
            }
        }
        if step.phase != UpgradePhase::Backfill {
            progress(&UpgradeProgress {
                phase: step.phase,
                step: step.name.clone(),
                done: 1,
                total: Some(1),
            });
        }
    }
    if let Some((phase, at)) = phase_started {
        report.phase_times.push((phase, at.elapsed()));
    }
    Ok(report)
}

async fn add_columns<D: Driver>(
    pool: &D::Pool,
    upgrade: &LegacyUpgrade,
    step: &UpgradeStep,
    report: &mut UpgradeReport,
) -> Result<(), PgError> {
    let facts = {
        let mut conn = D::acquire(pool).await?;
        statement::table_facts::<D>(D::pooled(&mut conn), &upgrade.table).await?
    };
    preflight(&upgrade.table, &facts)?;
    // Skipped when every column and companion table is there: even a no-op ALTER takes
    // ACCESS EXCLUSIVE. A table upgraded by an earlier release gets the later migrations'.
    let missing = sql::COLUMNS
        .iter()
        .any(|(name, _)| !facts.columns.iter().any(|(have, _)| have == name));
    if !missing
        && crate::schema::companions_complete(&facts, Some(sql::UPGRADE_COLUMNS_RENDER_THROUGH))
    {
        return Ok(());
    }
    with_lock_retries::<D>(pool, upgrade, report, &step.sql, None).await?;
    report.columns_added = true;
    Ok(())
}

/// Refuses, before anything changes, a table the upgrade cannot bring to the lease schema: no
/// such table, an `id` that is not a `bigint` drawn from a sequence, or a column of the lease
/// schema already there with another type. Each needs the adopter's own migration first.
fn preflight(table: &TableName, facts: &crate::schema::TableFacts) -> Result<(), PgError> {
    if facts.columns.is_empty() {
        return Err(PgError::Schema {
            table: table.to_string(),
            missing: vec!["the table itself (not found on the search_path)".to_owned()],
        });
    }
    let mut wrong = Vec::new();
    for (name, ty) in sql::COLUMNS {
        match facts.columns.iter().find(|(have, _)| have == name) {
            Some((_, actual)) if actual != ty => {
                wrong.push(format!("column {name} must be {ty}, found {actual}"))
            }
            None if name == sql::col::ID => wrong.push("a bigint id column".to_owned()),
            _ => {}
        }
    }
    if !facts.id_has_sequence {
        wrong.push("a sequence or identity default on id".to_owned());
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(PgError::Schema {
            table: table.to_string(),
            missing: wrong,
        })
    }
}

/// Runs `statement` (with the backfill's `params`, or none: DDL) in a transaction of its own
/// under `SET LOCAL lock_timeout`, trying again with backoff when it could not get its locks in
/// time (or was cancelled by a shorter `statement_timeout`, or chosen as a deadlock's victim):
/// every try that fails rolls back. Returns the statement's rows.
async fn with_lock_retries<D: Driver>(
    pool: &D::Pool,
    upgrade: &LegacyUpgrade,
    report: &mut UpgradeReport,
    statement: &str,
    params: Option<(i64, i64, i64)>,
) -> Result<Vec<D::Row>, PgError> {
    let set_timeout = format!(
        "SET LOCAL lock_timeout = '{}ms'",
        upgrade.lock_timeout.as_millis()
    );
    for try_number in 0..upgrade.lock_attempts {
        let mut tx = D::begin(pool).await?;
        D::batch_execute(D::in_tx(&mut tx), &set_timeout).await?;
        let result = match &params {
            Some(params) => D::query(D::in_tx(&mut tx), statement, params).await,
            None => D::batch_execute(D::in_tx(&mut tx), statement)
                .await
                .map(|()| Vec::new()),
        };
        match result {
            Ok(rows) => {
                D::commit(tx).await?;
                return Ok(rows);
            }
            Err(err)
                if err
                    .sqlstate()
                    .is_some_and(|code| RETRY_CODES.contains(&code.as_str())) =>
            {
                D::rollback(tx).await?;
                report.lock_retries += 1;
                if try_number + 1 < upgrade.lock_attempts {
                    tokio::time::sleep(lock_backoff(try_number)).await;
                }
            }
            Err(err) => return Err(err),
        }
    }
    Err(PgError::LockNotAvailable {
        table: upgrade.table.to_string(),
        attempts: upgrade.lock_attempts,
        timeout: upgrade.lock_timeout,
    })
}

/// The SQLSTATEs after which a try is made again: `lock_not_available` (`lock_timeout` ran out),
/// `query_canceled` (a `statement_timeout` shorter than it), `deadlock_detected`.
const RETRY_CODES: [&str; 3] = ["55P03", "57014", "40P01"];

async fn backfill<D: Driver>(
    pool: &D::Pool,
    upgrade: &LegacyUpgrade,
    step: &UpgradeStep,
    report: &mut UpgradeReport,
    progress: &mut (impl FnMut(&UpgradeProgress) + Send),
) -> Result<(), PgError> {
    let (min_id, max_id) = {
        let mut conn = D::acquire(pool).await?;
        let extent = sql::for_table(sql::UPGRADE_LEGACY_EXTENT, &upgrade.table)?;
        let rows = D::query(D::pooled(&mut conn), &extent, &()).await?;
        match rows.first() {
            Some(row) => (
                D::get::<Option<i64>>(row, "min_id")?,
                D::get::<Option<i64>>(row, "max_id")?,
            ),
            None => (None, None),
        }
    };
    let (Some(min_id), Some(until)) = (min_id, max_id) else {
        return Ok(()); // an empty table
    };
    let span = until.abs_diff(min_id).saturating_add(1);
    let limit = i64::from(upgrade.batch_size);
    // Below the lowest id, so that ids of zero and below are reached too.
    let mut after = min_id.saturating_sub(1);
    while after < until {
        let params = Some((after, limit, until));
        let rows = with_lock_retries::<D>(pool, upgrade, report, &step.sql, params).await?;
        let row = rows.first().ok_or(PgError::NoRow {
            statement: sql::UPGRADE_LEGACY_BACKFILL.name,
        })?;
        let stamped: i64 = D::get(row, "stamped")?;
        report.rows_stamped += stamped.max(0) as u64;
        let Some(last) = D::get::<Option<i64>>(row, "last_id")? else {
            break;
        };
        after = last;
        progress(&UpgradeProgress {
            phase: UpgradePhase::Backfill,
            step: step.name.clone(),
            done: after.abs_diff(min_id).saturating_add(1).min(span),
            total: Some(span),
        });
    }
    progress(&UpgradeProgress {
        phase: UpgradePhase::Backfill,
        step: step.name.clone(),
        done: span,
        total: Some(span),
    });
    Ok(())
}

async fn build_index<D: Driver>(
    pool: &D::Pool,
    table: &TableName,
    step: &UpgradeStep,
    report: &mut UpgradeReport,
) -> Result<(), PgError> {
    let mut conn = D::acquire(pool).await?;
    let quoted = format!("\"{}\"", step.name);
    let state = sql::render(sql::INDEX_STATE, &[])?;
    let table_quoted = table.quoted();
    let rows = D::query(
        D::pooled(&mut conn),
        &state,
        &(quoted.as_str(), table_quoted.as_str()),
    )
    .await?;
    let valid: Option<bool> = match rows.first() {
        Some(row) if !D::get::<bool>(row, "on_table")? => {
            return Err(PgError::Schema {
                table: table.to_string(),
                missing: vec![format!(
                    "index {} belongs to another table: rename or drop it first",
                    step.name
                )],
            });
        }
        Some(row) => Some(D::get(row, "valid")?),
        None => None,
    };
    match valid {
        Some(true) => return Ok(()),
        Some(false) => {
            // A failed concurrent build left it: it serves nothing, and IF NOT EXISTS would
            // keep it. Drop it and build it again.
            let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {quoted}");
            D::batch_execute(D::pooled(&mut conn), &drop).await?;
            report.invalid_indexes_dropped.push(step.name.clone());
        }
        None => {}
    }
    D::batch_execute(D::pooled(&mut conn), &step.sql).await?;
    report.indexes_built.push(step.name.clone());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upgrade() -> LegacyUpgrade {
        LegacyUpgrade::new(
            TableName::new("invoice_jobs").unwrap(),
            QueueName::new("invoices").unwrap(),
        )
    }

    #[test]
    fn every_required_index_is_built_concurrently_and_named() {
        let steps = upgrade().steps().unwrap();
        let built: Vec<&str> = steps
            .iter()
            .filter(|s| s.phase == UpgradePhase::Indexes)
            .map(|s| s.name.as_str())
            .collect();
        for suffix in crate::schema::required_index_suffixes() {
            assert!(
                built.contains(&format!("invoice_jobs_{suffix}").as_str()),
                "{suffix} missing from {built:?}"
            );
        }
        for step in steps.iter().filter(|s| s.phase == UpgradePhase::Indexes) {
            assert!(step.sql.contains("CONCURRENTLY"), "{}", step.sql);
            assert!(!step.sql.contains(';'), "one statement: {}", step.sql);
        }
    }

    #[test]
    fn the_columns_are_every_column_of_the_lease_schema_with_the_queue_as_default() {
        let steps = upgrade().steps().unwrap();
        let columns = &steps[0].sql;
        for (name, _) in sql::COLUMNS {
            if name != sql::col::ID
                && name != sql::col::STATUS
                && name != sql::col::ATTEMPTS
                && name != sql::col::NEXT_ATTEMPT_AT
            {
                assert!(
                    columns.contains(&format!("IF NOT EXISTS {name} ")),
                    "{name} missing"
                );
            }
        }
        assert!(columns.contains("DEFAULT 'invoices'"));
        assert!(!columns.contains("{{"));
    }

    #[test]
    fn migration_files_run_what_cannot_be_in_a_transaction_on_its_own() {
        let files = upgrade()
            .retire_index("idx_invoice_jobs_stuck")
            .unwrap()
            .migration_files()
            .unwrap();
        assert!(
            files[0]
                .sql
                .starts_with("SET LOCAL lock_timeout = '500ms';")
        );
        // The later table migrations come last, each in a transaction of its own.
        let later = sql::TABLE_MIGRATIONS
            .iter()
            .filter(|(version, _, _)| *version > sql::UPGRADE_COLUMNS_RENDER_THROUGH)
            .count();
        let (files, later_files) = files.split_at(files.len() - later);
        assert_eq!(later_files[0].description, "invoice_jobs_grant_fence");
        for file in later_files {
            assert!(
                file.sql.starts_with("SET LOCAL lock_timeout = '500ms';"),
                "{}",
                file.sql
            );
            assert!(!file.sql.contains("{{"), "{}", file.sql);
        }
        assert!(
            !files[0].sql.contains("grants_counted"),
            "the columns are frozen"
        );
        for file in &files[1..] {
            assert!(file.sql.starts_with("-- no-transaction\n"), "{}", file.sql);
            let statements = statements(&file.sql.replace("$upgrade$", ""));
            if !file.sql.contains("DO $upgrade$") {
                assert_eq!(statements.len(), 1, "{}", file.sql);
            }
        }
        let backfill = &files[1].sql;
        assert!(
            backfill.contains(
                "WHERE id > upgrade_after::bigint AND id <= upgrade_until::bigint ORDER BY id LIMIT 10000"
            )
        );
        assert!(backfill.contains("COMMIT;"));
        assert_eq!(
            files.last().unwrap().sql,
            "-- no-transaction\nDROP INDEX CONCURRENTLY IF EXISTS \"idx_invoice_jobs_stuck\";\n"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(upgrade().retire_index("bad\"; drop").is_err());
        assert!(upgrade().lock_timeout(Duration::ZERO).is_err());
        assert!(upgrade().batch_size(0).is_err());
    }

    #[test]
    fn lock_backoff_is_bounded() {
        for n in 0..40 {
            let wait = lock_backoff(n);
            assert!(wait <= Duration::from_secs(2) && wait >= Duration::from_millis(25));
        }
    }
}
