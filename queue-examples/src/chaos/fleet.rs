//! The `exchange-worker` processes of a chaos run, and the signals sent to them.

use std::fs::File;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// Live worker processes, kept at a set number by [`Fleet::top_up`].
pub(crate) struct Fleet {
    bin: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log_dir: PathBuf,
    children: Vec<Child>,
    spawned: usize,
    /// How many processes ended before the shutdown (killed, or crashed on their own).
    pub(crate) exited: Vec<(u32, ExitStatus)>,
}

impl Fleet {
    pub(crate) fn new(bin: PathBuf, args: Vec<String>, log_dir: PathBuf) -> Fleet {
        Fleet {
            bin,
            args,
            envs: Vec::new(),
            log_dir,
            children: Vec::new(),
            spawned: 0,
            exited: Vec::new(),
        }
    }

    /// Sets `key` in every worker's environment (for what should not show in a process
    /// listing, such as a database URL).
    pub(crate) fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Fleet {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// The process ids of the live workers.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.children.iter().filter_map(Child::id).collect()
    }

    /// A live worker at random.
    pub(crate) fn any(&self) -> Option<u32> {
        let pids = self.pids();
        (!pids.is_empty()).then(|| pids[fastrand::usize(..pids.len())])
    }

    /// Forgets the workers that ended and starts new ones until `n` run.
    pub(crate) fn top_up(&mut self, n: usize) -> std::io::Result<()> {
        let mut live = Vec::with_capacity(self.children.len());
        for mut child in self.children.drain(..) {
            let pid = child.id().unwrap_or_default();
            match child.try_wait()? {
                Some(status) => self.exited.push((pid, status)),
                None => live.push(child),
            }
        }
        self.children = live;
        while self.children.len() < n {
            self.spawn()?;
        }
        Ok(())
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        self.spawned += 1;
        let log = File::create(self.log_dir.join(format!("worker-{}.log", self.spawned)))?;
        let child = Command::new(&self.bin)
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            // Warnings, and the listener's connects (the failover audit counts re-listens).
            .env("RUST_LOG", "warn,queue_postgres::wake=info")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        self.children.push(child);
        Ok(())
    }

    /// Takes the live workers out, for the shutdown.
    pub(crate) fn take(&mut self) -> Vec<Child> {
        std::mem::take(&mut self.children)
    }
}

/// SIGTERMs every worker and waits for each; those still running after `timeout` are killed.
/// Returns each worker's exit status (`None`: killed after the timeout).
pub(crate) async fn drain(children: Vec<Child>, timeout: Duration) -> Vec<Option<ExitStatus>> {
    for child in &children {
        if let Some(pid) = child.id() {
            // A paused worker would not act on SIGTERM until continued.
            send(pid, Signal::SIGCONT);
            send(pid, Signal::SIGTERM);
        }
    }
    let mut statuses = Vec::with_capacity(children.len());
    for mut child in children {
        match tokio::time::timeout(timeout, child.wait()).await {
            Ok(Ok(status)) => statuses.push(Some(status)),
            _ => {
                let _ = child.kill().await;
                statuses.push(None);
            }
        }
    }
    statuses
}

/// Sends `signal` to `pid`; a process that is already gone is not an error.
pub(crate) fn send(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// The process id a worker names in its `User-Agent` (`exchange-worker (pid N)`).
pub(crate) fn sender_pid(agent: Option<&str>) -> Option<u32> {
    let rest = agent?.split("(pid ").nth(1)?;
    rest.trim_end_matches(')').parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sender_is_read_from_the_user_agent() {
        assert_eq!(
            super::sender_pid(Some("exchange-worker (pid 4242)")),
            Some(4242)
        );
        assert_eq!(super::sender_pid(Some("curl/8")), None);
        assert_eq!(super::sender_pid(None), None);
    }
}
