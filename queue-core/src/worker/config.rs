//! How a worker runs: every setting with its named default, and the checks that refuse
//! combinations that would break the lease's guarantee.

use std::time::Duration;

use crate::error::ConfigError;
use crate::retry::RetryPolicy;
use crate::types::{DEFAULT_MAX_RECLAIMS, Lease};

/// How a [`Worker`](crate::Worker) runs. Every field has a named default;
/// [`WorkerConfig::validate`] refuses combinations that would break the lease's guarantee.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Handlers running at once (default 8).
    pub concurrency: usize,
    /// Jobs claimed but not yet started that the worker may hold (default 0). Prefetch saves
    /// claim round trips for short jobs; a prefetched job's lease is already running, so a job
    /// whose remaining lease is shorter than `job_timeout` is released instead of started.
    pub prefetch: usize,
    /// The most jobs one claim asks for (default 100; the claim asks for fewer when fewer slots
    /// are free).
    pub max_batch: u32,
    /// How long an idle worker waits before polling again if no wake-up arrives (default 1 s).
    /// After a full batch it polls again at once.
    pub poll_interval: Duration,
    /// The claim lease (default [`Lease::DEFAULT`], 90 s): how long a job this worker claims or
    /// renews stays its own. It is stored with the claim, so workers of one queue may use
    /// different leases: each job expires by its holder's.
    pub lease: Lease,
    /// A run longer than this is stopped and counts as a retryable handler error (default 30 s).
    /// Must be at most half the lease, unless the handler [`runs_long`](crate::Handler::runs_long).
    pub job_timeout: Duration,
    /// A job whose lease expired after this many takeovers goes to `dead` (default
    /// [`DEFAULT_MAX_RECLAIMS`]).
    pub max_reclaims: u32,
    /// Retries of handler errors.
    pub retry: RetryPolicy,
    /// At shutdown, how long running jobs may take to finish before their cancellation tokens
    /// fire (default 20 s). The whole shutdown ends within `shutdown_timeout + shutdown_grace`
    /// (25 s by default, under a 30 s termination grace period such as Kubernetes' default),
    /// whatever the database does.
    pub shutdown_timeout: Duration,
    /// After the tokens fire, how long the shutdown has left (default 5 s): handlers get it
    /// less the time kept for the last writes (half of it, at most 2 s), then are aborted and
    /// their jobs released.
    pub shutdown_grace: Duration,
    /// Write outcomes of jobs without hooks in batches (default true): many fenced writes per
    /// statement instead of one statement per job.
    pub batch_finalize: bool,
    /// Send the batched outcomes with the next claim, in one statement and one commit, where
    /// the backend can ([`crate::Backend::fuses_claims`]; default false): one round trip per
    /// batch instead of two, but the claim then waits for the outcomes' write, where it
    /// otherwise runs beside it on another connection. On a database next to the worker that
    /// costs more than it saves (`docs/performance.md`: 0.7× the throughput); it is for a
    /// database whose round trips dominate. An outcome waits at most a few milliseconds for a
    /// claim to carry it; outcomes with hooks never do. A claim also waits while the batching
    /// task tries a failing write again (until the database answers, at most the lease).
    pub fuse_claims: bool,
    /// The worker's name, stored with each claim (`claimed_by`) and with each error it reports
    /// in a job's history, so an operator can tell which process holds or failed a job
    /// (default `<host>:<pid>`; cut to [`crate::limits::MAX_HOLDER_BYTES`]).
    pub name: String,
}

/// The default [`WorkerConfig::name`]: the host's name and the process id.
pub fn default_worker_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_owned());
    format!("{host}:{}", std::process::id())
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 8,
            prefetch: 0,
            max_batch: 100,
            poll_interval: Duration::from_secs(1),
            lease: Lease::DEFAULT,
            job_timeout: Duration::from_secs(30),
            max_reclaims: DEFAULT_MAX_RECLAIMS,
            retry: RetryPolicy::default(),
            shutdown_timeout: Duration::from_secs(20),
            shutdown_grace: Duration::from_secs(5),
            batch_finalize: true,
            fuse_claims: false,
            name: default_worker_name(),
        }
    }
}

impl WorkerConfig {
    /// Checks the configuration for a handler that does (`runs_long`) or does not heartbeat.
    pub fn validate(&self, runs_long: bool) -> Result<(), ConfigError> {
        if self.concurrency == 0 {
            return Err(ConfigError::Zero("worker concurrency"));
        }
        if self.max_batch == 0 {
            return Err(ConfigError::Zero("worker max_batch"));
        }
        if self.poll_interval.is_zero() {
            return Err(ConfigError::Zero("worker poll_interval"));
        }
        if self.job_timeout.is_zero() {
            return Err(ConfigError::Zero("worker job_timeout"));
        }
        if !runs_long && self.lease.duration() < self.job_timeout * 2 {
            return Err(ConfigError::LeaseTooShortForTimeout {
                lease: self.lease.duration(),
                timeout: self.job_timeout,
            });
        }
        self.retry.validate()
    }

    /// Claimed jobs the worker holds at most: running plus prefetched.
    pub(super) fn slots(&self) -> usize {
        self.concurrency + self.prefetch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_refuses_a_lease_under_twice_the_timeout() {
        let config = WorkerConfig {
            lease: Lease::from_secs(50).unwrap(),
            job_timeout: Duration::from_secs(30),
            ..WorkerConfig::default()
        };
        let err = config.validate(false).unwrap_err();
        assert!(matches!(err, ConfigError::LeaseTooShortForTimeout { .. }));
        assert!(err.to_string().contains("at least twice"), "{err}");
        // A heartbeating handler may run past the lease.
        assert!(config.validate(true).is_ok());
        assert!(WorkerConfig::default().validate(false).is_ok());
        let zero = WorkerConfig {
            concurrency: 0,
            ..WorkerConfig::default()
        };
        assert_eq!(
            zero.validate(false),
            Err(ConfigError::Zero("worker concurrency"))
        );
    }
}
