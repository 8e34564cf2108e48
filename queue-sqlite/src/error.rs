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

    /// An option of [`crate::OpenOptions`] or [`crate::SqliteQueueConfig`] was refused.
    #[error("invalid {name}: {reason}")]
    InvalidOption {
        /// The option.
        name: &'static str,
        /// Why.
        reason: String,
    },

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
    pub(super) const CONSTRAINT: i64 = 19;
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
        let primary = primary_code(&err);
        let open = |reason| SqliteError::Open {
            path: path.to_owned(),
            reason,
        };
        match primary {
            Some(code::BUSY | code::LOCKED) => SqliteError::Busy,
            Some(code::READONLY) => open(OpenFailure::ReadOnly),
            Some(code::CORRUPT | code::NOTADB) => open(OpenFailure::Corrupt),
            Some(code::CANTOPEN) => {
                let dir = std::path::Path::new(path)
                    .parent()
                    .filter(|dir| !dir.as_os_str().is_empty())
                    .unwrap_or(std::path::Path::new("."));
                open(if !dir.exists() {
                    OpenFailure::MissingDirectory
                } else if !writable(dir) {
                    OpenFailure::ReadOnly
                } else {
                    OpenFailure::CannotOpen
                })
            }
            _ => SqliteError::Database(err),
        }
    }

    /// True when trying again can succeed: the database was busy (a migration included), the
    /// pool timed out, the driver's connection thread or the file's I/O failed.
    pub fn is_transient(&self) -> bool {
        match self {
            SqliteError::Busy => true,
            SqliteError::Database(err) => sqlx_is_transient(err),
            SqliteError::Migrate(sqlx::migrate::MigrateError::Execute(err)) => {
                sqlx_is_transient(err) || is_busy(err)
            }
            _ => false,
        }
    }
}

fn sqlx_is_transient(err: &sqlx::Error) -> bool {
    matches!(
        err,
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed
    )
}

/// Whether `err` is SQLite's busy or locked.
pub(crate) fn is_busy(err: &sqlx::Error) -> bool {
    primary_code(err).is_some_and(|c| c == code::BUSY || c == code::LOCKED)
}

/// Whether `err` is a constraint SQLite enforced (a unique key taken, a CHECK).
pub(crate) fn is_constraint(err: &sqlx::Error) -> bool {
    primary_code(err) == Some(code::CONSTRAINT)
}

/// Whether `err` is SQLite refusing to add a column that exists (its generic error code; the
/// message tells it apart): another process's migration added it first.
pub(crate) fn is_duplicate_column(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => {
            primary_code(err) == Some(1) && db.message().starts_with("duplicate column name")
        }
        _ => false,
    }
}

fn primary_code(err: &sqlx::Error) -> Option<i64> {
    match err {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i64>().ok())
            .map(|c| c & 0xff),
        _ => None,
    }
}

/// Whether a file can be created in `dir` (tried, and removed): permissions alone do not say
/// so for root, an immutable directory or a read-only mount.
fn writable(dir: &std::path::Path) -> bool {
    let probe = dir.join(format!(".queue-sqlite-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            true
        }
        Err(e) => e.kind() == std::io::ErrorKind::AlreadyExists,
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
