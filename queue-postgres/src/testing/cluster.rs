//! A PostgreSQL cluster of a test's own, for tests that stop, crash or restart the server: they
//! must never touch the shared server the other tests use.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// Why a [`TempCluster`] could not be made or driven.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// No PostgreSQL server binaries were found.
    #[error(
        "no PostgreSQL server binaries (initdb, pg_ctl) found: install the server package \
         (postgresql-15) or set QUEUE_TEST_PG_BIN to their directory"
    )]
    NoBinaries,
    /// A command could not be started.
    #[error("{command}: {source}")]
    Spawn {
        /// The command.
        command: String,
        /// Why.
        source: std::io::Error,
    },
    /// A command failed.
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        /// The command.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
    /// `pg_autoctl` is not installed.
    #[error("no pg_autoctl found: install pg_auto_failover (Debian: postgresql-15-auto-failover)")]
    NoAutoFailover,
    /// A high-availability cluster has no primary (by its monitor), or not the one awaited.
    #[error(
        "no primary {waiting_for}; the monitor's nodes (name port reported goal): {nodes}; \
         its last events: {events}"
    )]
    NoPrimary {
        /// What was awaited.
        waiting_for: String,
        /// The monitor's nodes as it last answered, one per `;`.
        nodes: String,
        /// The monitor's last events, newest first, one per `;`.
        events: String,
    },
    /// A high-availability cluster did not reach a state in time.
    #[error(
        "timed out waiting for {waiting_for}; the monitor's nodes (name port reported goal): \
         {nodes}; its last events: {events}"
    )]
    Timeout {
        /// The condition, as SQL on the monitor.
        waiting_for: String,
        /// The monitor's nodes as it last answered, one per `;`.
        nodes: String,
        /// The monitor's last events, newest first, one per `;`.
        events: String,
    },
    /// No free port, or the temporary directory could not be made.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// How [`TempCluster::stop`] stops the server (`pg_ctl stop -m …`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Ends sessions, checkpoints, exits: a planned restart.
    Fast,
    /// Exits at once without a checkpoint, as a crash would; the next start replays the WAL.
    Immediate,
}

/// A throw-away PostgreSQL cluster: `initdb` in a temporary directory, started by `pg_ctl` on a
/// free port of 127.0.0.1 with trust authentication for the user `postgres`. Stopped and
/// removed when dropped. When the test runs as root, the server runs as the `postgres` user
/// (PostgreSQL refuses root).
///
/// ```no_run
/// # fn t() -> Result<(), queue_postgres::testing::ClusterError> {
/// use queue_postgres::testing::{StopMode, TempCluster};
/// let cluster = TempCluster::start()?;
/// let url = cluster.url("postgres"); // postgres://postgres@127.0.0.1:<port>/postgres
/// cluster.stop(StopMode::Immediate)?; // a crash
/// cluster.restart()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TempCluster {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl TempCluster {
    /// Creates and starts a cluster (a few seconds).
    pub fn start() -> Result<TempCluster, ClusterError> {
        let cluster = TempCluster::empty()?;
        let data = cluster.data_dir();
        run(cluster.tool("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]))?;
        cluster.restart()?;
        Ok(cluster)
    }

    /// A streaming standby of this cluster (`pg_basebackup -R`: asynchronous replication),
    /// started on a port of its own; it follows this cluster until it is promoted
    /// ([`TempCluster::promote`]) or detached ([`TempCluster::detach`]).
    pub fn standby(&self) -> Result<TempCluster, ClusterError> {
        let standby = TempCluster::empty()?;
        run(standby
            .tool("pg_basebackup")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .arg("-D")
            .arg(standby.data_dir())
            .args(["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]))?;
        standby.restart()?;
        Ok(standby)
    }

    /// Stops this standby's replication (its WAL receiver ends and it receives nothing more
    /// from its primary), as a network partition would, without stopping either server.
    pub fn detach(&self) -> Result<(), ClusterError> {
        self.psql("ALTER SYSTEM SET primary_conninfo = ''")?;
        self.psql("SELECT pg_reload_conf()")?;
        Ok(())
    }

    /// Promotes this standby to a primary (`pg_ctl promote`, waiting until it takes writes).
    pub fn promote(&self) -> Result<(), ClusterError> {
        run(self
            .tool("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["promote", "-w", "-t", "60"]))
        .map(drop)
    }

    /// Runs one statement with `psql` on the `postgres` database, returning what it printed.
    pub fn psql(&self, sql: &str) -> Result<String, ClusterError> {
        let out = run(self
            .tool("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args([
                "-d",
                "postgres",
                "-XAtq",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ]))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `database`, as the user `postgres`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Stops the server; connections to it break.
    pub fn stop(&self, mode: StopMode) -> Result<(), ClusterError> {
        let mode = match mode {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        };
        run(self
            .tool("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["stop", "-w", "-m", mode]))
        .map(drop)
    }

    /// Starts the server (again), waiting until it accepts connections; stops it first if it
    /// runs.
    pub fn restart(&self) -> Result<(), ClusterError> {
        // Durability across a crash of the server needs no fsync (the kernel keeps the WAL);
        // it is the machine that would have to crash to lose it.
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c full_page_writes=off \
             -c max_connections=300",
            self.port,
            self.dir.display()
        );
        run(self
            .tool("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_file())
            .args(["-o", &options, "-w", "-t", "60", "restart"]))
        .map(drop)
    }

    /// Makes the server accept TCP connections only over TLS, with the certificate `cert_pem`
    /// and its key `key_pem`, and restarts it. Connections over its Unix socket stay open.
    pub fn require_tls(&self, cert_pem: &str, key_pem: &str) -> Result<(), ClusterError> {
        let data = self.data_dir();
        std::fs::write(data.join("server.crt"), cert_pem)?;
        std::fs::write(data.join("server.key"), key_pem)?;
        {
            use std::os::unix::fs::PermissionsExt;
            // The server refuses a key that others can read.
            std::fs::set_permissions(
                data.join("server.key"),
                std::fs::Permissions::from_mode(0o600),
            )?;
        }
        if self.as_postgres {
            run(Command::new("chown")
                .arg("postgres:postgres")
                .arg(data.join("server.crt"))
                .arg(data.join("server.key")))?;
        }
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))?;
        std::io::Write::write_all(&mut conf, b"\nssl = on\n")?;
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostnossl all all 0.0.0.0/0 reject\n",
        )?;
        self.restart()
    }

    /// The server's log file.
    pub fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// A directory and a port of its own, nothing in them yet.
    fn empty() -> Result<TempCluster, ClusterError> {
        let bin = server_binaries().ok_or(ClusterError::NoBinaries)?;
        let as_postgres = running_as_root();
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "queue-cluster-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        // A directory left by a crashed run of a process with the same id is not ours to keep.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let port = free_port()?;
        let cluster = TempCluster {
            bin,
            dir,
            port,
            as_postgres,
        };
        if as_postgres {
            run(Command::new("chown")
                .arg("postgres:postgres")
                .arg(&cluster.dir))?;
        }
        Ok(cluster)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn tool(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        let _ = self.stop(StopMode::Immediate);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory of `initdb` and `pg_ctl`: `QUEUE_TEST_PG_BIN`, `pg_config --bindir`, or the
/// newest `/usr/lib/postgresql/<version>/bin`.
pub(super) fn server_binaries() -> Option<PathBuf> {
    let has_tools = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(dir) = std::env::var_os("QUEUE_TEST_PG_BIN").map(PathBuf::from) {
        return has_tools(&dir).then_some(dir);
    }
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    if let Some(dir) = from_pg_config.filter(|dir| has_tools(dir)) {
        return Some(dir);
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|dir| has_tools(dir))
        .collect();
    versions.sort();
    versions.pop()
}

pub(super) fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// A port nobody listens on now (the server binds it a moment later).
pub(super) fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

pub(super) fn run(command: &mut Command) -> Result<Output, ClusterError> {
    let name = format!("{command:?}");
    let output = command.output().map_err(|source| ClusterError::Spawn {
        command: name.clone(),
        source,
    })?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(ClusterError::Failed {
            command: name,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cluster comes up, survives a crash with its committed data, and is gone when dropped.
    #[tokio::test]
    async fn a_cluster_of_its_own_survives_a_crash_and_goes_away() {
        use sqlx::Connection;
        let cluster = TempCluster::start().expect("a cluster of the test's own");
        assert_ne!(cluster.port(), 5432);
        let url = cluster.url("postgres");
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
            .execute(&mut conn)
            .await
            .unwrap();
        cluster.stop(StopMode::Immediate).unwrap();
        let broken = sqlx::query("SELECT 1").execute(&mut conn).await;
        assert!(broken.is_err(), "the server was stopped");
        cluster.restart().unwrap();
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        let kept: i32 = sqlx::query_scalar("SELECT n FROM kept")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(kept, 7);
        drop(conn);
        let dir = cluster.dir.clone();
        drop(cluster);
        assert!(!dir.exists());
    }
}
