//! The crate's error type, and how SQLite's failures are told apart.

/// Everything that can go wrong in the SQLite backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// A table name was refused before any SQL ran.
    #[error("invalid table name {value:?}: {reason}")]
    InvalidTable {
        /// The refused name.
        value: String,
        /// Why.
        reason: &'static str,
    },

    /// The queue table lacks what the lease protocol needs.
    #[error(
        "queue table {table:?} is not on the lease schema; missing: {}. Apply \
         queue_sqlite::migrate (or install_table for a table of its own) first",
        missing.join(", ")
    )]
    Schema {
        /// The table checked.
        table: String,
        /// What is missing or mistyped.
        missing: Vec<String>,
    },

    /// The database file could not be opened or written (the reason is SQLite's, typed).
    #[error("the SQLite database {path} {reason}")]
    Open {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: OpenFailure,
    },

    /// The database stayed locked by another connection or process for longer than the busy
    /// timeout. Transient: try again.
    #[error("the SQLite database is locked by another writer past the busy timeout")]
    Busy,

    /// A row holds a value the queue does not know (a status, an instant).
    #[error("job {id} holds {what}, which the queue does not know")]
    Corrupt {
        /// The job.
        id: i64,
        /// What.
        what: String,
    },

    /// A value was refused before any SQL ran.
    #[error(transparent)]
    Invalid(#[from] queue_core::InvalidInput),

    /// A configuration value was refused.
    #[error(transparent)]
    Config(#[from] queue_core::ConfigError),

    /// Any other failure of SQLite or of the driver.
    #[error("sqlite: {0}")]
    Database(sqlx::Error),

    /// Applying the framework's migrations failed.
    #[error("migrating the queue schema: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// Why a database file could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpenFailure {
    /// Its directory does not exist.
    #[error("is in a directory that does not exist")]
    MissingDirectory,
    /// It (or its directory, for the WAL files) cannot be written.
    #[error("is read-only")]
    ReadOnly,
    /// It is not a SQLite database, or it is damaged.
    #[error("is not a SQLite database, or is corrupt")]
    Corrupt,
    /// It cannot be opened for another reason (permissions, a directory in its place).
    #[error("cannot be opened")]
    CannotOpen,
}

/// SQLite's primary result codes the backend tells apart (the low byte of an extended code).
mod code {
    pub(super) const BUSY: i64 = 5;
    pub(super) const LOCKED: i64 = 6;
    pub(super) const READONLY: i64 = 8;
    pub(super) const CORRUPT: i64 = 11;
    pub(super) const CANTOPEN: i64 = 14;
    pub(super) const NOTADB: i64 = 26;
}

impl SqliteError {
    /// The error for `err`, met on the database file at `path` (named in open failures): for
    /// code that runs its own statements on the queue's database, such as a hook's domain
    /// writes, so that a locked or read-only file is told apart as the queue's own errors are.
    pub fn from_sqlx(err: sqlx::Error, path: &str) -> Self {
        let primary = match &err {
            sqlx::Error::Database(db) => db
                .code()
                .and_then(|c| c.parse::<i64>().ok())
                .map(|c| c & 0xff),
            _ => None,
        };
        let open = |reason| SqliteError::Open {
            path: path.to_owned(),
            reason,
        };
        match primary {
            Some(code::BUSY | code::LOCKED) => SqliteError::Busy,
            Some(code::READONLY) => open(OpenFailure::ReadOnly),
            Some(code::CORRUPT | code::NOTADB) => open(OpenFailure::Corrupt),
            Some(code::CANTOPEN) => {
                let missing = std::path::Path::new(path)
                    .parent()
                    .is_some_and(|dir| !dir.as_os_str().is_empty() && !dir.exists());
                open(if missing {
                    OpenFailure::MissingDirectory
                } else {
                    OpenFailure::CannotOpen
                })
            }
            _ => SqliteError::Database(err),
        }
    }

    /// True when trying again can succeed: the database was busy, the pool timed out.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            SqliteError::Busy
                | SqliteError::Database(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))
        )
    }
}

impl From<SqliteError> for queue_core::Error {
    fn from(err: SqliteError) -> Self {
        match err {
            SqliteError::Config(config) => queue_core::Error::Config(config),
            SqliteError::Invalid(invalid) => queue_core::Error::Invalid(invalid),
            other => {
                let transient = other.is_transient();
                queue_core::Error::backend(other, transient)
            }
        }
    }
}
