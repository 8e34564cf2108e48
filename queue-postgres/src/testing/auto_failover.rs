//! A high-availability PostgreSQL cluster of a test's own: pg_auto_failover's monitor, a
//! primary and a standby on ports of their own, under a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::cluster::{ClusterError, free_port, run, running_as_root, server_binaries};

/// The monitor's failure detection, shortened from its defaults (about 50 s from a lost
/// primary to a promoted standby) to about 2 s: a test's cluster lives on one host, where a
/// network partition cannot happen. Production clusters keep the defaults.
const FAST_DETECTION: [&str; 7] = [
    "pgautofailover.health_check_period = 1000",
    "pgautofailover.health_check_timeout = 1000",
    "pgautofailover.health_check_max_retries = 1",
    "pgautofailover.health_check_retry_delay = 200",
    "pgautofailover.node_considered_unhealthy_timeout = 1000",
    "pgautofailover.primary_demote_timeout = 1000",
    "pgautofailover.startup_grace_period = 1",
];

/// A pg_auto_failover formation: a monitor and two nodes (`node1` starts as the primary,
/// `node2` as its standby, replicated synchronously as pg_auto_failover does by default), on
/// 127.0.0.1, trust authentication for the user `postgres`, a database `queue_test`. Every
/// process runs as the `postgres` user when the test runs as root. Stopped (kill -9) and
/// removed when dropped.
///
/// Needs `pg_autoctl` (Debian's `postgresql-15-auto-failover`). Failovers are forced with
/// [`AutoFailoverCluster::perform_failover`] (a planned switchover) or
/// [`AutoFailoverCluster::lose_primary`] (the primary's machine gone: its keeper and its
/// postmaster killed).
#[derive(Debug)]
pub struct AutoFailoverCluster {
    root: PathBuf,
    as_postgres: bool,
    monitor_port: u16,
    ports: [u16; 2],
    keepers: Mutex<Vec<(String, Child)>>,
}

impl AutoFailoverCluster {
    /// Builds the formation and waits until it has a primary and a secondary (seconds).
    pub fn start() -> Result<AutoFailoverCluster, ClusterError> {
        let bin = server_binaries().ok_or(ClusterError::NoBinaries)?;
        if Command::new("pg_autoctl")
            .arg("--version")
            .output()
            .is_err()
        {
            return Err(ClusterError::NoAutoFailover);
        }
        let root = std::env::temp_dir().join(format!(
            "queue-ha-{}-{}",
            std::process::id(),
            fastrand::u32(..)
        ));
        for sub in ["home", "cfg", "data", "run", "bin", "sock"] {
            std::fs::create_dir_all(root.join(sub))?;
        }
        // pg_autoctl runs pg_basebackup from the directory of --pgctl: a copy of the server's
        // binaries whose pg_basebackup neither waits for a spread checkpoint nor syncs.
        for entry in std::fs::read_dir(&bin)? {
            let entry = entry?;
            if entry.file_name() != "pg_basebackup" {
                std::os::unix::fs::symlink(entry.path(), root.join("bin").join(entry.file_name()))?;
            }
        }
        let wrapper = root.join("bin/pg_basebackup");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nexec {}/pg_basebackup --no-sync --checkpoint=fast \"$@\"\n",
                bin.display()
            ),
        )?;
        set_mode(&wrapper, 0o755)?;
        let as_postgres = running_as_root();
        if as_postgres {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&root))?;
        }
        set_mode(&root.join("run"), 0o700)?;
        let monitor_port = free_port()?;
        let mut ports = [free_port()?, free_port()?];
        while ports[1] == ports[0] || ports.contains(&monitor_port) {
            ports = [free_port()?, free_port()?];
        }
        let cluster = AutoFailoverCluster {
            root,
            as_postgres,
            monitor_port,
            ports,
            keepers: Mutex::new(Vec::new()),
        };
        cluster.build(&bin)?;
        Ok(cluster)
    }

    fn build(&self, bin: &Path) -> Result<(), ClusterError> {
        let monitor = self.root.join("monitor");
        self.initdb(bin, &monitor, &FAST_DETECTION)?;
        run(self
            .autoctl()
            .args(["create", "monitor", "--pgdata"])
            .arg(&monitor)
            .args([
                "--pgctl",
                &self.pg_ctl(),
                "--pgport",
                &self.monitor_port.to_string(),
                "--hostname",
                "127.0.0.1",
                "--auth",
                "trust",
                "--no-ssl",
            ]))?;
        run(self
            .autoctl()
            .args(["config", "set", "--pgdata"])
            .arg(&monitor)
            .args(["postgresql.listen_addresses", "127.0.0.1"]))?;
        self.keep(
            "monitor",
            self.autoctl().arg("run").arg("--pgdata").arg(&monitor),
        )?;
        self.wait_for(&self.monitor_url("pg_auto_failover"), "SELECT true", ANY)?;
        self.initdb(bin, &self.root.join("node1"), &[])?;
        for (index, port) in self.ports.iter().enumerate() {
            let name = format!("node{}", index + 1);
            let monitor = format!(
                "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable",
                self.monitor_port
            );
            let mut create = self.autoctl();
            create
                .args(["create", "postgres", "--pgdata"])
                .arg(self.root.join(&name))
                .args(["--pgctl", &self.pg_ctl(), "--pgport", &port.to_string()])
                .args([
                    "--listen",
                    "127.0.0.1",
                    "--hostname",
                    "127.0.0.1",
                    "--name",
                    &name,
                ])
                .args(["--monitor", &monitor, "--auth", "trust", "--no-ssl"])
                .args(["--ssl-mode", "disable", "--run"]);
            self.keep(&name, &mut create)?;
            if index == 0 {
                self.wait_for(
                    &self.monitor_url("pg_auto_failover"),
                    "SELECT count(*) = 1 FROM pgautofailover.node \
                     WHERE nodename = 'node1' AND reportedstate = 'single'",
                    ANY,
                )?;
            }
        }
        self.wait_healthy(Duration::from_secs(90))?;
        let primary = self.primary_port()?;
        run(&mut self.psql(primary, "postgres", "CREATE DATABASE queue_test"))?;
        Ok(())
    }

    /// The URL of `database` through both nodes, as a service connects to the cluster:
    /// `postgres://postgres@127.0.0.1:<node1>,127.0.0.1:<node2>/<database>
    /// ?target_session_attrs=read-write&connect_timeout=2`.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}\
             ?target_session_attrs=read-write&connect_timeout=2",
            self.ports[0], self.ports[1]
        )
    }

    /// The port of the node that is primary now, by the monitor.
    pub fn primary_port(&self) -> Result<u16, ClusterError> {
        self.monitors_primary()?
            .ok_or_else(|| self.no_primary("named by the monitor now"))
    }

    /// The monitor's primary, if it names one settled in a primary's state.
    fn monitors_primary(&self) -> Result<Option<u16>, ClusterError> {
        let out = run(&mut self.psql(
            self.monitor_port,
            "pg_auto_failover",
            "SELECT nodeport FROM pgautofailover.node \
             WHERE reportedstate IN ('primary', 'wait_primary', 'single') \
               AND goalstate = reportedstate",
        ))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse().ok())
    }

    /// A [`ClusterError::NoPrimary`] that says what the monitor saw: a formation that does not
    /// settle is diagnosed from the error alone (its folder goes with it).
    fn no_primary(&self, waiting_for: &str) -> ClusterError {
        let (nodes, events) = self.monitor_state();
        ClusterError::NoPrimary {
            waiting_for: waiting_for.to_owned(),
            nodes,
            events,
        }
    }

    /// The monitor's nodes and its last events, as text for an error.
    fn monitor_state(&self) -> (String, String) {
        let ask = |sql: &str| {
            run(&mut self.psql(self.monitor_port, "pg_auto_failover", sql))
                .map(|out| {
                    String::from_utf8_lossy(&out.stdout)
                        .trim()
                        .replace('\n', "; ")
                })
                .unwrap_or_else(|err| format!("(the monitor did not answer: {err})"))
        };
        (
            ask(
                "SELECT format('%s %s %s %s', nodename, nodeport, reportedstate, goalstate) \
                 FROM pgautofailover.node ORDER BY nodeid",
            ),
            ask(
                "SELECT format('%s %s', to_char(eventtime, 'HH24:MI:SS.MS'), description) \
                 FROM pgautofailover.event ORDER BY eventid DESC LIMIT 12",
            ),
        )
    }

    /// The primary's port, waiting up to `within` for the monitor to name one: between two
    /// faults the formation may still be settling (a node applying settings after a rejoin),
    /// and a fault aimed at the primary must not fail for asking at that instant.
    fn settled_primary_port(&self, within: Duration) -> Result<u16, ClusterError> {
        let deadline = Instant::now() + within;
        loop {
            match self.monitors_primary() {
                Ok(Some(port)) => return Ok(port),
                Err(err) if Instant::now() > deadline => return Err(err),
                _ if Instant::now() > deadline => {
                    return Err(self.no_primary("settled between two faults"));
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// The primary's port and its node's index in `ports`, waiting as
    /// `settled_primary_port` does.
    fn settled_primary(&self, within: Duration) -> Result<(u16, usize), ClusterError> {
        let port = self.settled_primary_port(within)?;
        let index = self
            .ports
            .iter()
            .position(|p| *p == port)
            .ok_or_else(|| self.no_primary("on one of the formation's nodes"))?;
        Ok((port, index))
    }

    /// A planned switchover (`pg_autoctl perform failover`): returns once the standby is the
    /// primary and the old primary follows it.
    pub fn perform_failover(&self) -> Result<(), ClusterError> {
        run(self
            .autoctl()
            .args(["perform", "failover", "--pgdata"])
            .arg(self.root.join("monitor")))?;
        self.wait_healthy(Duration::from_secs(90))
    }

    /// The primary's machine lost: its keeper and its postmaster killed with SIGKILL. Returns
    /// once the standby took over (the monitor promoted it); the lost node stays down until
    /// [`AutoFailoverCluster::rejoin`].
    pub fn lose_primary(&self) -> Result<String, ClusterError> {
        let (_, index) = self.settled_primary(Duration::from_secs(90))?;
        let name = format!("node{}", index + 1);
        {
            let mut keepers = self.keepers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(at) = keepers.iter().position(|(n, _)| *n == name) {
                let (_, mut child) = keepers.remove(at);
                kill_group(&child);
                let _ = child.wait();
            }
        }
        let _ = kill_postmaster(&self.root.join(&name));
        let deadline = Instant::now() + Duration::from_secs(90);
        while self.monitors_primary().ok().flatten() != Some(self.ports[1 - index]) {
            if Instant::now() > deadline {
                return Err(self.no_primary("promoted from the standby after its primary was lost"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(name)
    }

    /// The primary's postmaster killed with SIGKILL (its keeper lives on): the keeper starts
    /// PostgreSQL again, usually before the monitor would fail over. Returns once a primary
    /// takes writes again (the same node, restarted, or the other one); the formation may still
    /// be settling ([`AutoFailoverCluster::wait_healthy`]).
    pub fn kill_primary_postmaster(&self) -> Result<(), ClusterError> {
        let found_by = Instant::now() + Duration::from_secs(90);
        // The monitor's primary, and its postmaster's pid file, may be between states for a
        // moment (a restart the keeper just made): ask again until the deadline.
        let (port, index, pgdata, killed) = loop {
            let (port, index) = self.settled_primary(Duration::from_secs(90))?;
            let pgdata = self.root.join(format!("node{}", index + 1));
            if let Some(killed) = kill_postmaster(&pgdata) {
                break (port, index, pgdata, killed);
            }
            if Instant::now() > found_by {
                return Err(self.no_primary("with a running postmaster to kill"));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let restarted = postmaster_pid(&pgdata).is_some_and(|pid| pid != killed);
            let other = self.ports[1 - index];
            let takes_writes = |port: u16| {
                Command::new("psql")
                    .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
                    .args(["-d", "postgres", "-XAtqc", "SELECT NOT pg_is_in_recovery()"])
                    .stderr(Stdio::null())
                    .output()
                    .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "t")
            };
            if (restarted && takes_writes(port)) || takes_writes(other) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.no_primary("taking writes after its postmaster was killed"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a lost node's keeper again; it rejoins as the standby (pg_rewind), and this
    /// returns once the formation is healthy.
    pub fn rejoin(&self, node: &str) -> Result<(), ClusterError> {
        let pgdata = self.root.join(node);
        self.keep(node, self.autoctl().arg("run").arg("--pgdata").arg(pgdata))?;
        self.wait_healthy(Duration::from_secs(90))
    }

    /// Waits until one node is primary and the other secondary, both settled.
    pub fn wait_healthy(&self, within: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + within;
        self.wait_until(
            &self.monitor_url("pg_auto_failover"),
            "SELECT count(*) FILTER (WHERE reportedstate = 'primary' AND goalstate = 'primary') = 1 \
                AND count(*) FILTER (WHERE reportedstate = 'secondary' AND goalstate = 'secondary') = 1 \
             FROM pgautofailover.node",
            deadline,
        )
    }

    fn monitor_url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.monitor_port
        )
    }

    fn wait_for(&self, url: &str, sql: &str, within: Duration) -> Result<(), ClusterError> {
        self.wait_until(url, sql, Instant::now() + within)
    }

    fn wait_until(&self, url: &str, sql: &str, deadline: Instant) -> Result<(), ClusterError> {
        loop {
            let answer = Command::new("psql")
                .args([url, "-XAtqc", sql])
                .stderr(Stdio::null())
                .output();
            if answer.is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "t") {
                return Ok(());
            }
            if Instant::now() > deadline {
                let (nodes, events) = self.monitor_state();
                return Err(ClusterError::Timeout {
                    waiting_for: sql.split_whitespace().collect::<Vec<_>>().join(" "),
                    nodes,
                    events,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn initdb(&self, bin: &Path, pgdata: &Path, settings: &[&str]) -> Result<(), ClusterError> {
        run(self
            .as_user(bin.join("initdb"))
            .arg("-D")
            .arg(pgdata)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]))?;
        // full_page_writes stays on: pg_rewind needs it when a lost primary rejoins.
        let mut conf = format!(
            "fsync = off\nunix_socket_directories = '{}'\n",
            self.root.join("sock").display()
        );
        for line in settings {
            conf.push_str(line);
            conf.push('\n');
        }
        let path = pgdata.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&path)?;
        text.push_str(&conf);
        std::fs::write(&path, text)?;
        Ok(())
    }

    fn pg_ctl(&self) -> String {
        self.root.join("bin/pg_ctl").display().to_string()
    }

    fn psql(&self, port: u16, database: &str, sql: &str) -> Command {
        let mut command = Command::new("psql");
        command
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .args(["-d", database, "-XAtq", "-v", "ON_ERROR_STOP=1", "-c", sql]);
        command
    }

    /// `pg_autoctl`, as the `postgres` user when root, with its state under the root.
    fn autoctl(&self) -> Command {
        let mut command = self.as_user(PathBuf::from("env"));
        let r = &self.root;
        command
            .arg(format!("HOME={}", r.join("home").display()))
            .arg(format!("XDG_CONFIG_HOME={}", r.join("cfg").display()))
            .arg(format!("XDG_DATA_HOME={}", r.join("data").display()))
            .arg(format!("XDG_RUNTIME_DIR={}", r.join("run").display()))
            .arg(format!("PATH={}:/usr/bin:/bin", r.join("bin").display()))
            .arg("PGUSER=postgres")
            .arg(format!("PGHOST={}", r.join("sock").display()))
            .arg("pg_autoctl")
            .current_dir(r);
        command
    }

    fn as_user(&self, program: PathBuf) -> Command {
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command.current_dir(&self.root);
            command
        } else {
            let mut command = Command::new(program);
            command.current_dir(&self.root);
            command
        }
    }

    /// Starts a long-running `pg_autoctl` (a keeper or the monitor) in a process group of its
    /// own, its output in `<name>.log`.
    fn keep(&self, name: &str, command: &mut Command) -> Result<(), ClusterError> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join(format!("{name}.log")))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .map_err(|source| ClusterError::Spawn {
                command: format!("pg_autoctl ({name})"),
                source,
            })?;
        self.keepers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((name.to_owned(), child));
        Ok(())
    }
}

/// How long the monitor may take to answer at start-up.
const ANY: Duration = Duration::from_secs(60);

impl Drop for AutoFailoverCluster {
    fn drop(&mut self) {
        let keepers = std::mem::take(&mut *self.keepers.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, child) in &keepers {
            kill_group(child);
        }
        for name in ["node1", "node2", "monitor"] {
            let _ = kill_postmaster(&self.root.join(name));
        }
        for (_, mut child) in keepers {
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn kill_group(child: &Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stderr(Stdio::null())
        .status();
}

/// Kills the postmaster of `pgdata` (its children end with it).
/// Kills the postmaster of `pgdata` (its children end with it), returning its pid. A pid file a
/// killed server left behind may name a pid the system has given to another process since: only
/// a process whose command line names `pgdata` is killed.
fn kill_postmaster(pgdata: &Path) -> Option<u32> {
    let pid = postmaster_pid(pgdata)?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let ours = String::from_utf8_lossy(&cmdline).contains(&*pgdata.to_string_lossy());
    if !ours {
        return None;
    }
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .stderr(Stdio::null())
        .status();
    Some(pid)
}

fn postmaster_pid(pgdata: &Path) -> Option<u32> {
    std::fs::read_to_string(pgdata.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formation comes up, switches over, survives the loss of its primary, takes the lost
    /// node back as its standby, and leaves nothing behind.
    #[test]
    fn a_formation_fails_over_both_ways_and_goes_away() {
        let cluster = AutoFailoverCluster::start().expect("a pg_auto_failover formation");
        let first = cluster.primary_port().unwrap();
        assert_eq!(first, cluster.ports[0]);
        cluster.perform_failover().unwrap();
        let second = cluster.primary_port().unwrap();
        assert_eq!(second, cluster.ports[1]);
        let lost = cluster.lose_primary().unwrap();
        assert_eq!(lost, "node2");
        assert_eq!(cluster.primary_port().unwrap(), first);
        cluster.rejoin(&lost).unwrap();
        cluster.kill_primary_postmaster().unwrap();
        cluster.wait_healthy(Duration::from_secs(90)).unwrap();
        cluster.primary_port().unwrap();
        // A formation that does not settle is diagnosed from its error: the monitor's nodes
        // and events are in it.
        let said = cluster.no_primary("in this test").to_string();
        assert!(
            said.contains("node1") && said.contains("node2") && said.contains("secondary"),
            "{said}"
        );
        let root = cluster.root.clone();
        drop(cluster);
        assert!(!root.exists());
    }
}
