//! A sqlx pool that follows the primary of a high-availability cluster.
//!
//! sqlx connects to one host; libpq (and tokio-postgres) take several and pick the one that
//! accepts writes (`target_session_attrs=read-write`). [`PrimaryPool`] gives sqlx the same:
//! it finds the primary among the hosts of a multi-host URL, opens the pool on it, refuses any
//! new connection that lands on a standby, and, from a task of its own, checks the primary once
//! a second and points the pool's new connections at the new primary after a failover.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use queue_core::events::{PRIMARY_CHANGED, PRIMARY_MISSING};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::task::JoinHandle;

use crate::error::PgError;
use crate::redact::redact_url;

/// How often the follower checks that its host is still the primary.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long one host may take to answer a check (a URL's `connect_timeout`, else this).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Asks a server whether it takes writes: a primary that is not read-only by default.
const ACCEPTS_WRITES: &str =
    "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'";

/// One host of a multi-host URL, and the options that reach it.
#[derive(Clone)]
struct Host {
    /// `host:port`, for events and [`PrimaryPool::primary`].
    name: String,
    options: PgConnectOptions,
}

/// A [`PgPool`] on the primary of several hosts, kept on it across failovers.
///
/// The URL names the hosts as libpq does: `postgres://user@h1:5432,h2:5432/app`, optionally
/// with `target_session_attrs=read-write` (or `primary`; nothing else is accepted, since a
/// queue writes) and `connect_timeout=<seconds>` (each check of a host, 2 s by default). Every
/// new connection of the pool is checked after it connects and refused when its server does
/// not take writes (a standby, or a primary being demoted), so a queue never writes through a
/// standby; the refusal is a transient error the worker backs off from. A task checks the
/// current host once a second on a connection of its own; when it stops being the primary,
/// the task looks for the host that is, and points the pool's new connections there
/// ([`PgPool::set_connect_options`]). Connections already open to the old primary stay in the
/// pool until they fail, which a failover's restart of the old primary makes them do.
///
/// The pool's `after_connect` is the check above: one set on `options` is replaced. The task
/// stops when the `PrimaryPool` is dropped (the pool itself lives on while clones of it do).
///
/// ```no_run
/// use queue_postgres::{PgQueue, PgQueueConfig, PrimaryPool};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://app@10.0.0.1:5432,10.0.0.2:5432/app?target_session_attrs=read-write";
/// let primary = PrimaryPool::connect(url, sqlx::postgres::PgPoolOptions::new()).await?;
/// let queue = PgQueue::connect(primary.pool().clone(), PgQueueConfig::default()).await?;
/// # drop(queue); Ok(()) }
/// ```
pub struct PrimaryPool {
    pool: PgPool,
    shared: Arc<Shared>,
    follower: JoinHandle<()>,
}

struct Shared {
    hosts: Vec<Host>,
    /// The index of the host new connections go to.
    current: AtomicU64,
    /// How many times the pool moved to another host.
    switches: AtomicU64,
    /// When it last did: connections older than that are not handed out again.
    switched_at: Mutex<Option<Instant>>,
    connect_timeout: Duration,
}

impl std::fmt::Debug for PrimaryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrimaryPool")
            .field("primary", &self.primary())
            .field("hosts", &self.hosts())
            .field("switches", &self.switches())
            .finish()
    }
}

impl PrimaryPool {
    /// Finds the primary among the URL's hosts (in their order), opens a pool with `options`
    /// on it and starts following it. Fails when no host takes writes within `options`'
    /// acquire timeout (and at least one round over the hosts); with one host, as soon as it
    /// cannot connect, as a plain pool does.
    pub async fn connect(url: &str, options: PgPoolOptions) -> Result<PrimaryPool, PgError> {
        let (hosts, connect_timeout) = parse(url)?;
        let give_up = tokio::time::Instant::now() + options.get_acquire_timeout();
        // One host: connect as a plain pool would, and fail as fast.
        let first = if hosts.len() == 1 {
            0
        } else {
            loop {
                match find_primary(&hosts, connect_timeout).await {
                    Found::Primary(index) => break index,
                    // A wrong password or a missing database is no outage: waiting heals
                    // nothing.
                    Found::Refused(err) => return Err(PgError::Database(err)),
                    Found::Nothing if tokio::time::Instant::now() >= give_up => {
                        return Err(PgError::NoPrimary {
                            url: redact_url(url).into_owned(),
                        });
                    }
                    Found::Nothing => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        };
        let shared = Arc::new(Shared {
            hosts,
            current: AtomicU64::new(first as u64),
            switches: AtomicU64::new(0),
            switched_at: Mutex::new(None),
            connect_timeout,
        });
        let since_switch = shared.clone();
        let options = options
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    if accepts_writes(conn).await? {
                        Ok(())
                    } else {
                        Err(sqlx::Error::Io(std::io::Error::other(
                            "the server does not take writes (a standby): waiting for the primary",
                        )))
                    }
                })
            })
            // A connection opened before the pool moved to another host is closed instead of
            // handed out: its server was the old primary (read-only now, or about to be).
            .before_acquire(move |_conn, meta| {
                let stale = since_switch
                    .switched_at
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some_and(|at| meta.age > at.elapsed());
                Box::pin(async move { Ok(!stale) })
            });
        let pool = options
            .connect_with(shared.hosts[first].options.clone())
            .await?;
        let follower = tokio::spawn(follow(pool.clone(), shared.clone()));
        Ok(PrimaryPool {
            pool,
            shared,
            follower,
        })
    }

    /// The pool, on the primary.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The host (`host:port`) new connections go to.
    pub fn primary(&self) -> &str {
        &self.shared.hosts[self.shared.current.load(Ordering::SeqCst) as usize].name
    }

    /// Every host of the URL, in its order.
    pub fn hosts(&self) -> Vec<&str> {
        self.shared.hosts.iter().map(|h| h.name.as_str()).collect()
    }

    /// How many times the pool moved to another host (failovers it followed).
    pub fn switches(&self) -> u64 {
        self.shared.switches.load(Ordering::SeqCst)
    }
}

impl Drop for PrimaryPool {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// The follower: a connection of its own to the current host, asked once a second whether it
/// still takes writes; when it does not (or is gone), every host is asked in turn until one
/// does, and the pool's new connections go there.
async fn follow(pool: PgPool, shared: Arc<Shared>) {
    let mut probe: Option<PgConnection> = None;
    let mut missing = false;
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        if pool.is_closed() {
            return;
        }
        let current = shared.current.load(Ordering::SeqCst) as usize;
        let host = &shared.hosts[current];
        if probe.is_none() {
            probe = connect(host, shared.connect_timeout).await;
        }
        if let Some(conn) = probe.as_mut() {
            let answer = tokio::time::timeout(shared.connect_timeout, accepts_writes(conn)).await;
            if matches!(answer, Ok(Ok(true))) {
                continue;
            }
        }
        probe = None;
        match find_primary(&shared.hosts, shared.connect_timeout).await {
            Found::Primary(found) if found == current => missing = false,
            Found::Primary(found) => {
                shared.current.store(found as u64, Ordering::SeqCst);
                shared.switches.fetch_add(1, Ordering::SeqCst);
                *shared.switched_at.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(Instant::now());
                pool.set_connect_options(shared.hosts[found].options.clone());
                tracing::info!(
                    name: PRIMARY_CHANGED,
                    from = %host.name,
                    to = %shared.hosts[found].name,
                    "{PRIMARY_CHANGED}"
                );
                missing = false;
            }
            Found::Refused(_) | Found::Nothing => {
                if !missing {
                    tracing::warn!(
                        name: PRIMARY_MISSING,
                        last = %host.name,
                        "{PRIMARY_MISSING}: no host takes writes; looking again every second"
                    );
                }
                missing = true;
            }
        }
    }
}

/// What a look over the hosts found.
enum Found {
    /// The first host, in the URL's order, that takes writes.
    Primary(usize),
    /// No host takes writes, and one refused us for good (a password, a database name): the
    /// last such error.
    Refused(sqlx::Error),
    /// No host takes writes now.
    Nothing,
}

/// The first host, in the URL's order, that takes writes.
async fn find_primary(hosts: &[Host], timeout: Duration) -> Found {
    let mut refused = None;
    for (index, host) in hosts.iter().enumerate() {
        match tokio::time::timeout(timeout, host.options.connect()).await {
            Ok(Ok(mut conn)) => {
                let answer = tokio::time::timeout(timeout, accepts_writes(&mut conn)).await;
                let _ = tokio::time::timeout(timeout, conn.close()).await;
                if matches!(answer, Ok(Ok(true))) {
                    return Found::Primary(index);
                }
            }
            Ok(Err(err)) if refused_for_good(&err) => {
                refused = Some(err);
            }
            _ => {}
        }
    }
    match refused {
        Some(err) => Found::Refused(err),
        None => Found::Nothing,
    }
}

/// A connect error that waiting cannot heal: refused credentials (SQLSTATE class `28`), a
/// database that does not exist (`3D000`), a TLS or configuration failure.
fn refused_for_good(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("28") || code == "3D000"),
        sqlx::Error::Tls(_) | sqlx::Error::Configuration(_) => true,
        _ => false,
    }
}

async fn connect(host: &Host, timeout: Duration) -> Option<PgConnection> {
    match tokio::time::timeout(timeout, host.options.connect()).await {
        Ok(Ok(conn)) => Some(conn),
        _ => None,
    }
}

async fn accepts_writes(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(ACCEPTS_WRITES).fetch_one(conn).await
}

/// The hosts of a libpq-style URL, each with the URL's user, database and parameters, and the
/// URL's `connect_timeout`. A URL with one host is a list of one.
fn parse(url: &str) -> Result<(Vec<Host>, Duration), PgError> {
    let invalid = |reason: &'static str| PgError::InvalidUrl {
        url: redact_url(url).into_owned(),
        reason,
    };
    // One host (or a socket, or hosts from parameters or the environment): sqlx reads the URL
    // as it would for a plain pool.
    let authority_has_list = url
        .split_once("://")
        .map(|(_, rest)| rest[..rest.find(['/', '?']).unwrap_or(rest.len())].contains(','))
        .unwrap_or(false);
    if !matches!(url.split_once("://"), Some(("postgres" | "postgresql", _))) {
        return Err(invalid("not a postgres:// URL"));
    }
    if !authority_has_list {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|_| invalid("not a PostgreSQL URL sqlx can read"))?;
        let name = format!("{}:{}", options.get_host(), options.get_port());
        return Ok((vec![Host { name, options }], DEFAULT_CONNECT_TIMEOUT));
    }
    let (scheme, rest) = url
        .split_once("://")
        .filter(|(scheme, _)| matches!(*scheme, "postgres" | "postgresql"))
        .ok_or_else(|| invalid("not a postgres:// URL"))?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, host_list) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (Some(user), hosts),
        None => (None, authority),
    };
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (tail, None),
    };
    let mut connect_timeout = DEFAULT_CONNECT_TIMEOUT;
    let mut kept = Vec::new();
    for pair in query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|p| !p.is_empty())
    {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "target_session_attrs" => {
                if !matches!(value, "read-write" | "primary") {
                    return Err(invalid(
                        "target_session_attrs must be read-write or primary: a queue writes",
                    ));
                }
            }
            "connect_timeout" => {
                let secs: u64 = value
                    .parse()
                    .map_err(|_| invalid("connect_timeout is not a whole number of seconds"))?;
                if !(1..=300).contains(&secs) {
                    return Err(invalid("connect_timeout must be 1 to 300 seconds"));
                }
                connect_timeout = Duration::from_secs(secs);
            }
            "host" | "hostaddr" | "port" => {
                return Err(invalid(
                    "name the hosts in the URL's authority, not as parameters",
                ));
            }
            _ => kept.push(pair),
        }
    }
    let query = if kept.is_empty() {
        String::new()
    } else {
        format!("?{}", kept.join("&"))
    };
    let mut hosts = Vec::new();
    for host in host_list.split(',') {
        if host.is_empty() {
            return Err(invalid("an empty host in the host list"));
        }
        let user = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let single = format!("{scheme}://{user}{host}{path}{query}");
        let mut options: PgConnectOptions = single
            .parse()
            .map_err(|_| invalid("a host of the list does not make a valid URL"))?;
        // An IPv6 address keeps the URL's brackets in sqlx's host, which its resolver refuses.
        if let Some(address) = options
            .get_host()
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
        {
            let address = address.to_owned();
            options = options.host(&address);
        }
        let name = format!("{}:{}", options.get_host(), options.get_port());
        hosts.push(Host { name, options });
    }
    Ok((hosts, connect_timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(url: &str) -> Vec<String> {
        parse(url).unwrap().0.into_iter().map(|h| h.name).collect()
    }

    #[test]
    fn every_host_of_the_list_keeps_the_user_database_and_parameters() {
        let (hosts, timeout) = parse(
            "postgres://app:s3cret@10.0.0.1:5433,10.0.0.2,db3:6000/orders\
             ?target_session_attrs=read-write&connect_timeout=3&application_name=sender",
        )
        .unwrap();
        assert_eq!(timeout, Duration::from_secs(3));
        let got: Vec<_> = hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(got, ["10.0.0.1:5433", "10.0.0.2:5432", "db3:6000"]);
        for host in &hosts {
            assert_eq!(host.options.get_username(), "app");
            assert_eq!(host.options.get_database(), Some("orders"));
            assert_eq!(host.options.get_application_name(), Some("sender"));
        }
        assert_eq!(names("postgresql://localhost/app"), ["localhost:5432"]);
        // One host or a socket: read by sqlx as a plain pool would.
        assert_eq!(
            names("postgres:///app?host=/var/run/postgresql"),
            ["/var/run/postgresql:5432"]
        );
        assert_eq!(
            names("postgres://[::1]:5433,[::1]:5434/app"),
            ["::1:5433", "::1:5434"]
        );
    }

    #[test]
    fn urls_that_cannot_reach_a_primary_are_refused_without_their_password() {
        for url in [
            "mysql://u:pw@h/db",
            "postgres://u:pw@h1,,h2/db",
            "postgres://u:pw@h1,h2/db?target_session_attrs=any",
            "postgres://u:pw@h1,h2/db?target_session_attrs=read-only",
            "postgres://u:pw@h1,h2/db?connect_timeout=0",
            "postgres://u:pw@h1,h2/db?connect_timeout=soon",
            "postgres://u:pw@h1,h3/db?host=h2",
        ] {
            let err = parse(url).err().unwrap_or_else(|| panic!("{url} accepted"));
            assert!(matches!(err, PgError::InvalidUrl { .. }), "{url}: {err}");
            assert!(!err.to_string().contains("pw"), "{err}");
        }
    }
}
