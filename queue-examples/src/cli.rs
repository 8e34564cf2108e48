//! Command lines of the example binaries: `exchange-worker`'s flags ([`WorkerArgs`], clap, every
//! duration bounded), and `exchange-demo`'s ([`DemoArgs`]).

use std::collections::HashMap;
use std::path::PathBuf;

use crate::exchange::{HttpPartner, PartnerConfigError, PartnerEndpoint};

/// `exchange-worker`'s flags. Every duration is bounded at both ends: a zero would spin or time
/// out every send at once, and an absurd one hides a typo (`--send-timeout-secs 30000`) until
/// a send hangs for hours. `DATABASE_URL` and `EXCHANGE_PARTNERS` (`name=url,name=url`) are read
/// by the binary when the flags are absent.
#[derive(Clone, clap::Parser)]
#[command(
    name = "exchange-worker",
    about = "The exchange's long-running send worker."
)]
pub struct WorkerArgs {
    /// The database (default: `DATABASE_URL`). Several hosts, `postgres://u@h1:5432,h2:5432/db`,
    /// reach a high-availability cluster: the worker writes to whichever takes writes, and
    /// follows it across a failover.
    #[arg(long)]
    pub database_url: Option<String>,
    /// The PostgreSQL driver.
    #[arg(long, value_enum, default_value_t = PgDriver::Sqlx)]
    pub driver: PgDriver,
    /// A partner, `NAME=URL` with an `http://` or `https://` URL (repeatable).
    #[arg(long = "partner", value_name = "NAME=URL")]
    pub partners: Vec<String>,
    /// An extra CA (PEM) that a partner's certificate may chain to, on top of the system's
    /// roots: `NAME=PATH` (repeatable).
    #[arg(long = "partner-ca", value_name = "NAME=PATH")]
    pub partner_cas: Vec<String>,
    /// A partner known by name whose endpoint cannot be resolved: its sends fail at once
    /// (repeatable).
    #[arg(long = "unresolvable", value_name = "NAME")]
    pub unresolvable: Vec<String>,
    /// The claim lease, in seconds (1 s to a day).
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub lease_secs: u64,
    /// Sends at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub concurrency: u64,
    /// Every send's timeout, in seconds (1 s to an hour).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub send_timeout_secs: u64,
    /// Sends per transmission before it fails.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Applies the exchange's migrations first.
    #[arg(long)]
    pub migrate: bool,
    /// What the lease must leave beyond two send timeouts, in seconds (1 s to an hour).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub lease_margin_secs: u64,
    /// The backoff after a first failed send, in milliseconds (1 ms to 10 minutes; the backoff
    /// grows to 64 times that).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub retry_base_ms: u64,
    /// The poll interval when idle, in milliseconds (10 ms to a minute).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub poll_ms: u64,
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address (for example
    /// 127.0.0.1:9464); none by default.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// The PostgreSQL driver of `exchange-worker`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PgDriver {
    /// sqlx, on a [`queue_postgres::PrimaryPool`].
    Sqlx,
    /// tokio-postgres with a deadpool pool (without TLS).
    TokioPostgres,
}

impl std::fmt::Debug for WorkerArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Partner and database URLs may carry credentials: partners print without them, the
        // database URL not at all.
        let partners: Vec<String> = self
            .partners
            .iter()
            .map(|spec| match spec.split_once('=') {
                Some((name, url)) => match PartnerEndpoint::parse(url) {
                    Ok(endpoint) => format!("{name}={endpoint}"),
                    Err(_) => format!("{name}=<not a partner URL>"),
                },
                None => "<not NAME=URL>".to_owned(),
            })
            .collect();
        f.debug_struct("WorkerArgs")
            .field("database_url", &self.database_url.as_ref().map(|_| "<set>"))
            .field("driver", &self.driver)
            .field("partners", &partners)
            .field("partner_cas", &self.partner_cas)
            .field("unresolvable", &self.unresolvable)
            .field("lease_secs", &self.lease_secs)
            .field("concurrency", &self.concurrency)
            .field("send_timeout_secs", &self.send_timeout_secs)
            .field("max_attempts", &self.max_attempts)
            .field("migrate", &self.migrate)
            .field("lease_margin_secs", &self.lease_margin_secs)
            .field("retry_base_ms", &self.retry_base_ms)
            .field("poll_ms", &self.poll_ms)
            .finish()
    }
}

/// Why the worker's partners were refused at start-up. No variant repeats a partner URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PartnersError {
    /// No partner at all.
    #[error("no partner configured: --partner NAME=URL or EXCHANGE_PARTNERS")]
    NoPartner,
    /// A partner without `=` (its text is not repeated: it may be a URL with credentials).
    #[error("a partner must look like NAME=URL (one has no '=')")]
    Spec,
    /// A partner named twice.
    #[error("partner {0:?} is configured twice")]
    Duplicate(String),
    /// A `--partner-ca` that is not `NAME=PATH`.
    #[error("--partner-ca must look like NAME=PATH, not {0:?}")]
    CaSpec(String),
    /// A `--partner-ca` for a partner that is not configured.
    #[error("--partner-ca names {0:?}, which is not a configured partner")]
    CaUnknownPartner(String),
    /// A partner's endpoint or CA file was refused.
    #[error(transparent)]
    Refused(#[from] PartnerConfigError),
}

impl WorkerArgs {
    /// The HTTP partners of `--partner` and of `env` (`EXCHANGE_PARTNERS`: `name=url,…`), each
    /// endpoint checked and given its `--partner-ca`, in the order given.
    pub fn http_partners(
        &self,
        env: Option<&str>,
    ) -> Result<Vec<(String, HttpPartner)>, PartnersError> {
        let from_env = env
            .into_iter()
            .flat_map(|env| env.split(','))
            .filter(|s| !s.is_empty());
        let mut specs: Vec<(&str, &str)> = Vec::new();
        for spec in self.partners.iter().map(String::as_str).chain(from_env) {
            let (name, url) = spec.split_once('=').ok_or(PartnersError::Spec)?;
            if specs.iter().any(|(seen, _)| *seen == name) {
                return Err(PartnersError::Duplicate(name.to_owned()));
            }
            specs.push((name, url));
        }
        if specs.is_empty() {
            return Err(PartnersError::NoPartner);
        }
        let mut cas: HashMap<&str, PathBuf> = HashMap::new();
        for spec in &self.partner_cas {
            let (name, path) = spec
                .split_once('=')
                .ok_or_else(|| PartnersError::CaSpec(spec.clone()))?;
            if !specs.iter().any(|(known, _)| *known == name) {
                return Err(PartnersError::CaUnknownPartner(name.to_owned()));
            }
            cas.insert(name, PathBuf::from(path));
        }
        specs
            .into_iter()
            .map(|(name, url)| {
                let partner =
                    HttpPartner::configured(name, url, cas.get(name).map(PathBuf::as_path))?;
                Ok((name.to_owned(), partner))
            })
            .collect()
    }
}

/// Where `exchange-demo` keeps the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoBackend {
    /// A SQLite file (in a temporary directory unless `--db-path`): durable, nothing to install.
    Sqlite,
    /// A scratch database in the PostgreSQL of `--database-url` / `DATABASE_URL`.
    Postgres,
    /// The in-memory backend: the logic without durability (no `--kill`).
    Memory,
}

/// The flags of `exchange-demo`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "exchange-demo",
    about = "The exchange send queue under a rolling restart (or, with --kill, worker processes \
             killed mid-send), against a local partner that counts duplicate POSTs. On a SQLite \
             file by default; on PostgreSQL when --database-url or DATABASE_URL is set (in a \
             scratch database it creates and drops); in memory with --backend memory."
)]
pub struct DemoArgs {
    /// Transmissions to send.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub jobs: u64,
    /// Workers: tasks restarted one after the other halfway through, or with --kill the
    /// worker processes kept running.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub workers: u64,
    /// Sends at once per worker.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub concurrency: u64,
    /// The share of POSTs the partner answers 503 (retried), in [0, 1).
    #[arg(long, default_value_t = 0.05, value_parser = fail_rate)]
    pub fail_rate: f64,
    /// The store (default: postgres when a database URL is given, otherwise sqlite).
    #[arg(long, value_enum)]
    pub backend: Option<DemoBackend>,
    /// The PostgreSQL server; a scratch database is created in it and dropped after.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// The SQLite file (default: one in a new temporary directory, removed after the run).
    #[arg(long, value_name = "FILE")]
    pub db_path: Option<PathBuf>,
    /// Keep the scratch database or the SQLite file.
    #[arg(long)]
    pub keep_db: bool,
    /// Run the workers as processes and kill some with SIGKILL mid-send (instead of the
    /// rolling restart); every duplicate POST must be explained by a kill (or by a send its own worker
    /// timed out on and retried under its key).
    #[arg(long)]
    pub kill: bool,
    /// With --kill: the most worker processes killed.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    pub kills: u64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Write each send's outcome in a transaction of its own (the default writes them many
    /// to a transaction, a savepoint per send).
    #[arg(long)]
    pub one_transaction_per_send: bool,
    /// Run as one of --kill's worker processes (started by the demo itself).
    #[arg(long, hide = true)]
    pub worker: bool,
}

impl DemoArgs {
    /// The store asked for: `--backend`, else postgres when a database URL is set, else sqlite.
    pub fn backend(&self) -> DemoBackend {
        match (self.backend, &self.database_url) {
            (Some(backend), _) => backend,
            (None, Some(url)) if !url.is_empty() => DemoBackend::Postgres,
            (None, _) => DemoBackend::Sqlite,
        }
    }
}

fn fail_rate(value: &str) -> Result<f64, String> {
    let rate: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if (0.0..1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err("must be at least 0 and below 1".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn worker(line: &str) -> Result<WorkerArgs, clap::Error> {
        WorkerArgs::try_parse_from(
            std::iter::once("exchange-worker").chain(line.split_whitespace()),
        )
    }

    #[test]
    fn every_duration_flag_refuses_zero_and_absurd_values_by_name() {
        for (flag, absurd) in [
            ("--lease-secs", "86401"),
            ("--send-timeout-secs", "3601"),
            ("--lease-margin-secs", "3601"),
            ("--retry-base-ms", "600001"),
            ("--poll-ms", "60001"),
        ] {
            for value in ["0", absurd] {
                let err = worker(&format!("{flag} {value}")).unwrap_err();
                assert!(err.to_string().contains(flag), "{flag} {value}: {err}");
            }
        }
        let fine = worker("--send-timeout-secs 1 --poll-ms 200 --retry-base-ms 100").unwrap();
        assert_eq!((fine.send_timeout_secs, fine.lease_secs), (1, 90));
    }

    #[test]
    fn partners_are_checked_by_name_without_repeating_their_urls() {
        let args = worker("--partner good=http://127.0.0.1:9/x --partner bad=127.0.0.1:9").unwrap();
        let err = args.http_partners(None).unwrap_err();
        assert!(
            matches!(&err, PartnersError::Refused(e) if e.name == "bad"),
            "{err}"
        );
        let args = worker("--partner acme=ftp://user:secret@partner/x").unwrap();
        let err = args.http_partners(None).unwrap_err().to_string();
        assert!(err.contains("\"acme\"") && err.contains("scheme"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let args = worker("").unwrap();
        let err = args
            .http_partners(Some("http://user:secret@partner/x"))
            .unwrap_err();
        assert_eq!(err, PartnersError::Spec);
        let partners = args
            .http_partners(Some("a=http://127.0.0.1:9/a,b=https://partner.example/b"))
            .unwrap();
        assert_eq!(partners.len(), 2);
        let args = worker(
            "--database-url postgres://u:secret@db/x --partner a=https://user:secret@partner/a \
             --partner b=nope://user:secret@partner/b --partner user:secret@partner",
        )
        .unwrap();
        let printed = format!("{args:?}");
        assert!(printed.contains("a=https://partner/a"), "{printed}");
        assert!(!printed.contains("secret"), "{printed}");
        let args = worker("--partner a=http://127.0.0.1:9/a --partner-ca b=/tmp/ca.pem").unwrap();
        assert_eq!(
            args.http_partners(None).unwrap_err(),
            PartnersError::CaUnknownPartner("b".into())
        );
    }

    #[test]
    fn demo_flags_refuse_bad_values_by_name() {
        use clap::Parser;
        let demo = |line: &str| {
            DemoArgs::try_parse_from(
                std::iter::once("exchange-demo").chain(line.split_whitespace()),
            )
        };
        let args = demo("--jobs 10 --keep-db").unwrap();
        assert_eq!((args.jobs, args.workers, args.keep_db), (10, 4, true));
        // DATABASE_URL, when the environment has one, stands for --database-url.
        let from_env = std::env::var("DATABASE_URL").is_ok_and(|url| !url.is_empty());
        let default = if from_env {
            DemoBackend::Postgres
        } else {
            DemoBackend::Sqlite
        };
        assert_eq!(args.backend(), default);
        let args = demo("--database-url postgres://h/db").unwrap();
        assert_eq!(args.backend(), DemoBackend::Postgres);
        let args = demo("--backend memory --database-url postgres://h/db").unwrap();
        assert_eq!(args.backend(), DemoBackend::Memory);
        for bad in [
            "--backend mysql",
            "--kills 0",
            "--jobs 0",
            "--fail-rate 1",
            "--fail-rate many",
            "--workers 0",
            "--nope",
        ] {
            let err = demo(bad).unwrap_err().to_string();
            let flag = bad.split_whitespace().next().unwrap();
            assert!(err.contains(flag), "{bad}: {err}");
        }
    }
}
