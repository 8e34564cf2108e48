//! The crate's error type. Losing a lease is not an error: see [`crate::FinalizeOutcome`].

use std::time::Duration;

/// A boxed error from a backend driver or a hook.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the queue core and its backends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value was refused before anything ran.
    #[error("invalid queue configuration: {0}")]
    Config(#[from] ConfigError),

    /// The backend (database, driver, connection) failed. `transient` says whether trying again
    /// later can help (a dropped connection, a pool timeout, a serialization failure).
    #[error("queue backend error: {source}")]
    Backend {
        /// The driver's error.
        #[source]
        source: BoxError,
        /// Whether a retry can succeed.
        transient: bool,
    },

    /// A finalize hook failed; the whole finalize (the fenced write included) was rolled back.
    #[error("finalize hook `{hook}` failed: {source}")]
    Hook {
        /// The failing hook's name.
        hook: String,
        /// What it reported.
        #[source]
        source: BoxError,
    },

    /// A value was refused before it reached the store: the call changed nothing.
    #[error("refused: {0}")]
    Invalid(#[from] InvalidInput),

    /// A payload could not be (de)serialised.
    #[error("job payload is not valid JSON for this job type: {0}")]
    Payload(#[source] serde_json::Error),

    /// The worker runtime was shut down while the call waited.
    #[error("the worker has shut down")]
    Shutdown,
}

impl Error {
    /// Wraps a driver error; `transient` as the driver's mapping decides.
    pub fn backend(source: impl Into<BoxError>, transient: bool) -> Self {
        Error::Backend {
            source: source.into(),
            transient,
        }
    }

    /// True when trying again later can succeed (connection loss, pool exhaustion, …).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Backend {
                transient: true,
                ..
            }
        )
    }
}

/// A value of a call that no backend could store, or a request that cannot be carried out as
/// given. Refused before anything is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidInput {
    /// One finalize batch held two outcomes for the same claim.
    #[error("the batch holds two outcomes for job {id} under generation {generation}")]
    DuplicateClaim {
        /// The job.
        id: crate::JobId,
        /// The claim's generation.
        generation: crate::ClaimGeneration,
    },
    /// A payload string or object key holds a NUL character, which PostgreSQL's `jsonb` cannot
    /// store. `path` says where (a JSON pointer), never what.
    #[error("the payload holds a NUL character at {path}")]
    PayloadNul {
        /// Where, as a JSON pointer.
        path: String,
    },
    /// A unique key holds a NUL character.
    #[error("the unique key holds a NUL character")]
    UniqueKeyNul,
    /// A payload larger, as JSON text, than the backend's limit
    /// ([`crate::limits::DEFAULT_MAX_PAYLOAD_BYTES`] unless configured).
    #[error("the payload is {size} bytes of JSON, over the limit of {limit}")]
    PayloadTooLarge {
        /// The payload's size as JSON text.
        size: usize,
        /// The backend's limit.
        limit: usize,
    },
    /// A unique key longer than [`crate::limits::MAX_UNIQUE_KEY_BYTES`].
    #[error("the unique key is {len} bytes, over the limit of {max}", max = crate::limits::MAX_UNIQUE_KEY_BYTES)]
    UniqueKeyTooLong {
        /// The key's length in bytes.
        len: usize,
    },
    /// A partition key holds a NUL character.
    #[error("the partition key holds a NUL character")]
    PartitionKeyNul,
    /// A partition key longer than [`crate::limits::MAX_PARTITION_KEY_BYTES`] (or empty).
    #[error("the partition key is {len} bytes, outside 1 to {max}", max = crate::limits::MAX_PARTITION_KEY_BYTES)]
    PartitionKeyLength {
        /// The key's length in bytes.
        len: usize,
    },
    /// A delay longer than [`crate::limits::MAX_DELAY`].
    #[error("a delay of {0:?} is longer than the longest the queue schedules ({max:?})", max = crate::limits::MAX_DELAY)]
    DelayTooLong(Duration),
    /// An operator's retry named a status other than `dead`, `failed` or `cancelled`.
    #[error("only dead, failed or cancelled jobs can be retried, not {}", status.as_str())]
    NotRetryable {
        /// The status named.
        status: crate::JobStatus,
    },
    /// A purge named no status, or a live one (`pending`, `in_flight`).
    #[error("{}", match status {
        None => "a purge needs at least one terminal status".to_owned(),
        Some(s) => format!("only terminal jobs can be purged, not {}", s.as_str()),
    })]
    NotPurgeable {
        /// The live status named, if one was.
        status: Option<crate::JobStatus>,
    },
    /// An instant outside [`crate::limits::EARLIEST`] ..= [`crate::limits::LATEST`].
    #[error("the instant {0} is outside the range the queue stores (1970 to 9999)")]
    InstantOutOfRange(chrono::DateTime<chrono::Utc>),
    /// A job with a [`crate::UniqueScope`] other than the default but no unique key.
    #[error("a unique scope needs a unique key")]
    UniqueScopeWithoutKey,
    /// A [`crate::UniqueScope`] that lists no status a holder keeps its key in.
    #[error("a unique scope needs at least one status a holder keeps its key in")]
    UniqueScopeEmpty,
    /// A unique period longer than [`crate::limits::MAX_DELAY`].
    #[error("a unique period of {0:?} is longer than the longest the queue stores ({max:?})", max = crate::limits::MAX_DELAY)]
    UniquePeriodTooLong(Duration),
    /// One enqueue call holds two jobs with one unique key, one of them with a unique scope:
    /// which should meet the other's scope is not the backend's to guess. `first` and `second`
    /// are their positions in the call (the key itself is not repeated here).
    #[error(
        "jobs {first} and {second} of the call share a unique key, and one has a unique scope: enqueue them in separate calls"
    )]
    RepeatedScopedKey {
        /// The first job's position.
        first: usize,
        /// The second job's position.
        second: usize,
    },
}

/// A configuration value that was refused, with what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A zero lease would make every claim immediately stealable.
    #[error("the lease must be longer than zero")]
    ZeroLease,
    /// A lease over a day is almost certainly a unit mistake.
    #[error("a lease of {0:?} is longer than one day; is the unit right?")]
    LeaseTooLong(Duration),
    /// A queue name outside the allowed characters or lengths.
    #[error("invalid queue name {0:?}: use 1 to 128 ASCII letters, digits, '_', '-', '.' or ':'")]
    InvalidQueueName(String),
    /// The per-job timeout leaves no margin inside the lease.
    #[error(
        "the lease ({lease:?}) must be at least twice the job timeout ({timeout:?}): otherwise a \
         job still running can be claimed by a second worker"
    )]
    LeaseTooShortForTimeout {
        /// The configured lease.
        lease: Duration,
        /// The configured per-job timeout.
        timeout: Duration,
    },
    /// A value that must be positive was zero.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    /// A schedule name outside the allowed characters or lengths.
    #[error("invalid schedule name {0:?}: use 1 to 128 ASCII letters, digits, '_', '-' or '.'")]
    InvalidScheduleName(String),
    /// A cron expression that does not parse, or never fires.
    #[error("invalid cron expression {expression:?}: {reason}")]
    InvalidCron {
        /// The expression.
        expression: String,
        /// Why it was refused.
        reason: String,
    },
    /// A time zone name the IANA database does not know.
    #[error("unknown time zone {0:?}: use an IANA name such as \"Europe/Berlin\"")]
    UnknownTimeZone(String),
    /// A value out of its allowed range.
    #[error("{name} is out of range: {detail}")]
    OutOfRange {
        /// Which setting.
        name: &'static str,
        /// Why.
        detail: String,
    },
}
