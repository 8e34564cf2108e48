//! The crate's error type and the one place where driver errors are mapped.

/// Everything that can go wrong in the PostgreSQL backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgError {
    /// An identifier from configuration (a table name) was refused before any SQL ran.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidIdentifier {
        /// Which identifier.
        what: &'static str,
        /// The refused value.
        value: String,
        /// Why.
        reason: &'static str,
    },

    /// The queue table lacks what the lease protocol needs. Running against it could double-run
    /// jobs (a pre-lease table has no claim stamp to fence on), so the queue refuses to start.
    #[error(
        "queue table {table:?} is not on the lease schema; missing: {}. Apply \
         the legacy upgrade (queue_postgres::LegacyUpgrade, `queuectl upgrade-legacy`) or \
         install_table for a new table first",
        missing.join(", ")
    )]
    Schema {
        /// The table checked.
        table: String,
        /// Each missing or mistyped column and each missing index, described.
        missing: Vec<String>,
    },

    /// A row holds a status outside the framework's vocabulary.
    #[error("job {id} has status {status:?}, which the queue does not know")]
    UnknownStatus {
        /// The job.
        id: i64,
        /// Its status text.
        status: String,
    },

    /// A statement template kept a `{{token}}` that nothing filled in: a defect of the
    /// framework's own SQL, refused before anything reached the server.
    #[error("statement template {template} has an unfilled token {token}")]
    Template {
        /// The template's file name.
        template: &'static str,
        /// The token left over.
        token: String,
    },

    /// A value was refused before any SQL ran (see [`queue_core::InvalidInput`]).
    #[error(transparent)]
    Invalid(#[from] queue_core::InvalidInput),

    /// A statement that always returns a row returned none: a defect of the framework's own
    /// SQL.
    #[error("statement {statement} returned no row")]
    NoRow {
        /// The statement's file name.
        statement: &'static str,
    },

    /// A statement that answers one row per input answered another number: a defect of the
    /// framework's own SQL, or a connection out of step with its server.
    #[error("statement {statement} answered {rows} rows for {expected}")]
    RowsAnswered {
        /// The statement's file name.
        statement: &'static str,
        /// How many rows it answered.
        rows: usize,
        /// How many it owed.
        expected: usize,
    },

    /// A bulk enqueue's ids (`enqueue_ids.sql`) were not one per job: a defect of the
    /// framework's own SQL; nothing was copied.
    #[error("enqueue_ids drew {drawn} ids for {jobs} jobs")]
    IdsDrawn {
        /// How many ids the statement returned.
        drawn: usize,
        /// How many jobs asked for one.
        jobs: usize,
    },

    /// No framework table migration has this version.
    #[error("the framework has no table migration {version}")]
    UnknownMigration {
        /// The version asked for.
        version: i64,
    },

    /// A configuration value was refused.
    #[error(transparent)]
    Config(#[from] queue_core::ConfigError),

    /// A database URL that cannot serve a queue (printed without its credentials).
    #[error("the database URL {url} cannot be used: {reason}")]
    InvalidUrl {
        /// The URL, redacted.
        url: String,
        /// Why.
        reason: &'static str,
    },

    /// None of a URL's hosts took writes within the pool's acquire timeout: no primary is up.
    #[error("no host of {url} takes writes (no primary is up)")]
    NoPrimary {
        /// The URL, redacted.
        url: String,
    },

    /// A setting of the legacy upgrade is outside its range.
    #[error("{what} must be {range}")]
    Setting {
        /// The setting.
        what: &'static str,
        /// Its range.
        range: &'static str,
    },

    /// Another legacy upgrade of the same table is running (it holds the upgrade's advisory
    /// lock): nothing was done.
    #[error("another upgrade of {table:?} is running; nothing was done")]
    UpgradeInProgress {
        /// The table.
        table: String,
    },

    /// The legacy upgrade's `ALTER TABLE` did not get its lock within `lock_timeout` in any of
    /// its tries (a long transaction holds the table): nothing was changed. Run it again when
    /// the table is quieter, or with a longer timeout or more tries.
    #[error(
        "the upgrade of {table:?} did not get its lock in {attempts} tries of {timeout:?}; \
         nothing changed"
    )]
    LockNotAvailable {
        /// The table.
        table: String,
        /// Tries made.
        attempts: u32,
        /// `lock_timeout` per try.
        timeout: std::time::Duration,
    },

    /// Work the queue runs on a task of its own (a bulk enqueue by `COPY`, the legacy
    /// upgrade) ended without an answer: it panicked, or the runtime shut down.
    #[error("the {task} task ended without an answer: {message}")]
    Task {
        /// What the task ran.
        task: &'static str,
        /// Why it ended.
        message: String,
    },

    /// The database or the driver failed.
    #[cfg(feature = "sqlx")]
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),

    /// tokio-postgres failed.
    #[cfg(feature = "tokio-postgres")]
    #[error("postgres: {}", tokio_postgres_message(.0))]
    TokioPostgres(#[from] tokio_postgres::Error),

    /// The deadpool-postgres pool failed to hand out a connection.
    #[cfg(feature = "tokio-postgres")]
    #[error("connection pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),

    /// Applying the framework's migrations failed.
    #[cfg(feature = "sqlx")]
    #[error("migrating the queue schema: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl PgError {
    /// The server's SQLSTATE, when the server refused a statement.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            #[cfg(feature = "sqlx")]
            PgError::Database(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
            #[cfg(feature = "sqlx")]
            PgError::Migrate(sqlx::migrate::MigrateError::ExecuteMigration(
                sqlx::Error::Database(db),
                _,
            )) => db.code().map(|c| c.into_owned()),
            #[cfg(feature = "tokio-postgres")]
            PgError::TokioPostgres(err) => err.code().map(|c| c.code().to_owned()),
            #[cfg(feature = "tokio-postgres")]
            PgError::Pool(deadpool_postgres::PoolError::Backend(err)) => {
                err.code().map(|c| c.code().to_owned())
            }
            _ => None,
        }
    }

    /// The server's message, when the server refused a statement (never its detail, which
    /// can quote row values).
    pub(crate) fn server_message(&self) -> Option<String> {
        match self {
            #[cfg(feature = "sqlx")]
            PgError::Database(sqlx::Error::Database(db)) => Some(db.message().to_owned()),
            #[cfg(feature = "tokio-postgres")]
            PgError::TokioPostgres(err) => err.as_db_error().map(|db| db.message().to_owned()),
            _ => None,
        }
    }

    /// True when trying again later can succeed: the connection dropped, the pool timed out,
    /// the server is shutting down or restarting, is a standby now (a write refused as read-only:
    /// a failover demoted it), a serialization failure or deadlock.
    pub fn is_transient(&self) -> bool {
        match self {
            #[cfg(feature = "sqlx")]
            PgError::Database(err) => sqlx_is_transient(err),
            PgError::NoPrimary { .. } => true,
            #[cfg(feature = "tokio-postgres")]
            PgError::TokioPostgres(err) => tokio_postgres_is_transient(err),
            #[cfg(feature = "tokio-postgres")]
            PgError::Pool(err) => match err {
                deadpool_postgres::PoolError::Backend(err) => tokio_postgres_is_transient(err),
                deadpool_postgres::PoolError::Timeout(_) => true,
                _ => false,
            },
            _ => false,
        }
    }
}

/// SQLSTATE classes and codes that a retry can get past.
pub(crate) fn sqlstate_is_transient(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("57P") // admin/crash shutdown, cannot connect now
        || matches!(code, "25006" | "40001" | "40P01" | "53300" | "55P03")
}

#[cfg(feature = "sqlx")]
fn sqlx_is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| sqlstate_is_transient(&c)),
        _ => false,
    }
}

/// tokio-postgres says only "db error" for a server error: name the server's message and
/// SQLSTATE, as sqlx does, but not its detail, which can quote row values.
#[cfg(feature = "tokio-postgres")]
fn tokio_postgres_message(err: &tokio_postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => err.to_string(),
    }
}

#[cfg(feature = "tokio-postgres")]
fn tokio_postgres_is_transient(err: &tokio_postgres::Error) -> bool {
    use std::error::Error as _;
    if err.is_closed() {
        return true;
    }
    if let Some(code) = err.code() {
        return sqlstate_is_transient(code.code());
    }
    // No SQLSTATE: a connection or I/O failure underneath.
    err.source()
        .is_some_and(|source| source.is::<std::io::Error>())
}

impl From<PgError> for queue_core::Error {
    fn from(err: PgError) -> Self {
        match err {
            PgError::Config(config) => queue_core::Error::Config(config),
            PgError::Invalid(invalid) => queue_core::Error::Invalid(invalid),
            other => {
                let transient = other.is_transient();
                queue_core::Error::backend(other, transient)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_codes() {
        for code in ["08006", "57P01", "40001", "40P01", "53300"] {
            assert!(sqlstate_is_transient(code), "{code}");
        }
        for code in ["23505", "42P01", "22P02"] {
            assert!(!sqlstate_is_transient(code), "{code}");
        }
    }

    #[test]
    fn core_error_keeps_transience() {
        #[cfg(feature = "sqlx")]
        {
            let core: queue_core::Error = PgError::Database(sqlx::Error::PoolTimedOut).into();
            assert!(core.is_transient());
        }
        let core: queue_core::Error = PgError::Schema {
            table: "t".into(),
            missing: vec!["column claimed_at".into()],
        }
        .into();
        assert!(!core.is_transient());
    }
}
