//! The faults a chaos run injects, and the log that ties every duplicate send to one of them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use queue_core::CancellationToken;
use queue_postgres::testing::StopMode;
use sqlx::PgPool;

use super::fleet::{self, Fleet};
use super::{ChaosConfig, ChaosError, Scenario};
use crate::exchange::partner_server::{Behavior, PartnerServer, PostObserver, PostRecord};

/// What was done to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// `kill -9` of a worker at a random moment (claiming, before, during or after a send,
    /// finalizing).
    Kill,
    /// `kill -9` of the worker whose POST the partner holds, before it answers.
    KillDuringSend,
    /// `kill -9` of the worker a moment after the partner answered its POST.
    KillAfterSend,
    /// `SIGSTOP` of a worker past its lease, then `SIGCONT`.
    Stop,
    /// `SIGSTOP` of the worker whose POST the partner holds, past its lease, then `SIGCONT`.
    StopDuringSend,
    /// `pg_terminate_backend` of every worker connection.
    TerminateConnections,
    /// The PostgreSQL server crashed (`pg_ctl stop -m immediate`) and started again.
    RestartDatabase,
    /// The partner answered every POST after three send timeouts.
    PartnerHang,
    /// A planned switchover of a high-availability formation (`pg_autoctl perform failover`).
    Switchover,
    /// The primary's machine lost (keeper and postmaster killed), its standby promoted.
    PrimaryLost,
    /// The primary's postmaster killed with SIGKILL; its keeper starts it again.
    PrimaryCrash,
}

impl FaultKind {
    /// A short name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill -9",
            FaultKind::KillDuringSend => "kill -9 during send",
            FaultKind::KillAfterSend => "kill -9 after send",
            FaultKind::Stop => "SIGSTOP past lease",
            FaultKind::StopDuringSend => "SIGSTOP past lease during send",
            FaultKind::TerminateConnections => "pg_terminate_backend",
            FaultKind::RestartDatabase => "PostgreSQL crash restart",
            FaultKind::Switchover => "PostgreSQL switchover",
            FaultKind::PrimaryLost => "PostgreSQL primary lost",
            FaultKind::PrimaryCrash => "PostgreSQL primary postmaster kill -9",
            FaultKind::PartnerHang => "partner hang",
        }
    }
}

/// One injected fault: on one worker process, or on everything (`pid` `None`), over a span.
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// What.
    pub kind: FaultKind,
    /// The worker it hit; `None` for the database or the partner.
    pub pid: Option<u32>,
    /// When it began.
    pub start: Instant,
    /// When it ended (a kill: the same instant).
    pub end: Instant,
}

/// The faults injected so far.
#[derive(Clone, Default)]
pub(crate) struct FaultLog(Arc<Mutex<Vec<Fault>>>);

impl FaultLog {
    pub(crate) fn push(&self, kind: FaultKind, pid: Option<u32>, start: Instant) {
        self.0.lock().unwrap().push(Fault {
            kind,
            pid,
            start,
            end: Instant::now(),
        });
    }

    pub(crate) fn all(&self) -> Vec<Fault> {
        self.0.lock().unwrap().clone()
    }
}

/// Strikes the sender of a POST while the partner holds it (and, for kills, just after it
/// answered): the moments a random timer would rarely hit, and the one the incident this
/// framework was built for came from (a worker paused mid-send, its job sent again).
pub(crate) struct AtPartner {
    log: FaultLog,
    budget: AtomicUsize,
    /// The chance that a POST costs its sender.
    chance: f64,
    /// Kill the sender; otherwise pause it past the lease.
    kill: bool,
    /// How long a pause lasts (the lease and a margin).
    pause: Duration,
    /// Strikes still under way (a pause not yet ended, a kill not yet sent).
    pending: Arc<AtomicUsize>,
    /// The senders killed so far: a POST a dead sender left at the partner costs no strike.
    killed: std::sync::Mutex<std::collections::HashSet<u32>>,
}

impl AtPartner {
    /// Kills senders, before or after the answer.
    pub(crate) fn kill(log: FaultLog, budget: usize, chance: f64) -> AtPartner {
        AtPartner {
            log,
            budget: AtomicUsize::new(budget),
            chance,
            kill: true,
            pause: Duration::ZERO,
            pending: Arc::default(),
            killed: Default::default(),
        }
    }

    /// Pauses senders for `lease` and a bit more, their POST held until they stop.
    pub(crate) fn stop(log: FaultLog, budget: usize, chance: f64, lease: Duration) -> AtPartner {
        AtPartner {
            log,
            budget: AtomicUsize::new(budget),
            chance,
            kill: false,
            pause: lease,
            pending: Arc::default(),
            killed: Default::default(),
        }
    }

    /// Stops striking, and waits until every strike under way is over (each paused worker
    /// continued), so that the drain and the final SIGTERM find no worker still paused.
    pub(crate) async fn settle(&self) {
        self.budget.store(0, Ordering::SeqCst);
        while self.pending.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether to strike `pid` this time: by chance, while the budget lasts, and never a sender
    /// already killed.
    fn draw(&self, pid: u32) -> bool {
        let mut killed = self.killed.lock().unwrap_or_else(|e| e.into_inner());
        let strike = !(self.kill && killed.contains(&pid))
            && fastrand::f64() < self.chance
            && self
                .budget
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                    left.checked_sub(1)
                })
                .is_ok();
        if strike && self.kill {
            killed.insert(pid);
        }
        strike
    }
}

impl PostObserver for AtPartner {
    fn arrived(&self, post: &PostRecord) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let Some(pid) = fleet::sender_pid(post.agent.as_deref()) else {
            return Box::pin(std::future::ready(()));
        };
        if self.kill {
            if fastrand::bool() && self.draw(pid) {
                let start = Instant::now();
                fleet::send(pid, Signal::SIGKILL);
                self.log.push(FaultKind::KillDuringSend, Some(pid), start);
            }
        } else if self.draw(pid) {
            let start = Instant::now();
            fleet::send(pid, Signal::SIGSTOP);
            let (log, pause, pending) = (self.log.clone(), self.pause, self.pending.clone());
            pending.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                tokio::time::sleep(pause + Duration::from_millis(fastrand::u64(500..1500))).await;
                fleet::send(pid, Signal::SIGCONT);
                log.push(FaultKind::StopDuringSend, Some(pid), start);
                pending.fetch_sub(1, Ordering::SeqCst);
            });
        }
        Box::pin(std::future::ready(()))
    }

    fn answered(&self, post: &PostRecord) {
        if !self.kill {
            return;
        }
        if let Some(pid) = fleet::sender_pid(post.agent.as_deref())
            && self.draw(pid)
        {
            let (log, pending) = (self.log.clone(), self.pending.clone());
            pending.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                // Within a few milliseconds: while the worker reads the answer or writes the
                // outcome.
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..20))).await;
                let start = Instant::now();
                fleet::send(pid, Signal::SIGKILL);
                log.push(FaultKind::KillAfterSend, Some(pid), start);
                pending.fetch_sub(1, Ordering::SeqCst);
            });
        }
    }
}

/// What the fault loops act on.
pub(crate) struct Targets<'a> {
    pub(crate) config: &'a ChaosConfig,
    pub(crate) fleet: &'a Mutex<Fleet>,
    pub(crate) cluster: &'a super::Cluster,
    pub(crate) admin: &'a PgPool,
    pub(crate) database: &'a str,
    pub(crate) partner: &'a PartnerServer,
    pub(crate) log: &'a FaultLog,
}

/// A pause of between `low` and `high` between two faults: pacing, not synchronisation.
async fn pause(low: Duration, high: Duration) {
    let span = high.saturating_sub(low).as_millis() as u64;
    tokio::time::sleep(low + Duration::from_millis(fastrand::u64(0..=span))).await;
}

/// Injects the faults of `scenario`, `config.rounds` of each kind, until done or `stop`.
pub(crate) async fn inject(
    scenario: Scenario,
    targets: &Targets<'_>,
    stop: &CancellationToken,
) -> Result<(), ChaosError> {
    let rounds = targets.config.rounds;
    let kinds: &[Scenario] = match scenario {
        Scenario::All => &[
            Scenario::Kill,
            Scenario::Stop,
            Scenario::Terminate,
            Scenario::Restart,
            Scenario::Hang,
        ],
        Scenario::Poison => &[],
        Scenario::Failover => return failovers(targets, stop).await,
        _ => std::slice::from_ref(&scenario),
    };
    let loops = kinds.iter().map(|kind| async move {
        for _ in 0..rounds {
            if stop.is_cancelled() {
                break;
            }
            one(*kind, targets).await?;
        }
        Ok::<(), ChaosError>(())
    });
    futures_util::future::try_join_all(loops).await?;
    Ok(())
}

/// One fault of `kind`.
async fn one(kind: Scenario, t: &Targets<'_>) -> Result<(), ChaosError> {
    let lease = t.config.lease;
    match kind {
        Scenario::Kill => {
            pause(Duration::from_millis(200), Duration::from_millis(1200)).await;
            let victim = t.fleet.lock().unwrap().any();
            if let Some(pid) = victim {
                let start = Instant::now();
                fleet::send(pid, Signal::SIGKILL);
                t.log.push(FaultKind::Kill, Some(pid), start);
            }
        }
        Scenario::Stop => {
            pause(Duration::from_millis(200), Duration::from_millis(1000)).await;
            let victim = t.fleet.lock().unwrap().any();
            if let Some(pid) = victim {
                let start = Instant::now();
                fleet::send(pid, Signal::SIGSTOP);
                tokio::time::sleep(lease + Duration::from_millis(fastrand::u64(500..1500))).await;
                fleet::send(pid, Signal::SIGCONT);
                t.log.push(FaultKind::Stop, Some(pid), start);
            }
        }
        Scenario::Terminate => {
            pause(Duration::from_millis(300), Duration::from_millis(900)).await;
            let start = Instant::now();
            let terminated = sqlx::query(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = $1 AND application_name <> $2 AND pid <> pg_backend_pid()",
            )
            .bind(t.database)
            .bind(super::HARNESS)
            .execute(t.admin)
            .await;
            // The database may be down (a crash restart in the combined scenario): then there
            // is nothing to kill this round.
            if terminated.is_ok() {
                t.log.push(FaultKind::TerminateConnections, None, start);
            }
        }
        Scenario::Restart => {
            pause(Duration::from_millis(1000), Duration::from_millis(2500)).await;
            let start = Instant::now();
            let super::Cluster::Single(cluster) = t.cluster else {
                return Ok(());
            };
            let cluster = cluster.clone();
            let down_for = Duration::from_millis(fastrand::u64(300..1500));
            // Crash, stay down a moment, come back: on one blocking task, which runs to its
            // end even if this future is dropped, so the server is never left down.
            tokio::task::spawn_blocking(move || {
                cluster.stop(StopMode::Immediate)?;
                std::thread::sleep(down_for);
                cluster.restart()
            })
            .await??;
            t.log.push(FaultKind::RestartDatabase, None, start);
        }
        Scenario::Hang => {
            pause(Duration::from_millis(300), Duration::from_millis(1000)).await;
            let start = Instant::now();
            let hang = t.config.send_timeout * 3;
            t.partner.set_behavior(super::PARTNER, Behavior::Slow(hang));
            tokio::time::sleep(Duration::from_millis(fastrand::u64(1000..2500))).await;
            t.partner
                .set_behavior(super::PARTNER, t.config.partner_behavior());
            // The POSTs it held answer up to one hang later.
            tokio::time::sleep(hang).await;
            t.log.push(FaultKind::PartnerHang, None, start);
        }
        Scenario::Poison | Scenario::All | Scenario::Failover => {}
    }
    Ok(())
}

/// `config.rounds` failovers of the formation: a switchover, a kill -9 of the primary's
/// postmaster and a lost primary in turn, each after the formation is healthy again (a lost
/// node rejoined as the standby).
async fn failovers(t: &Targets<'_>, stop: &CancellationToken) -> Result<(), ChaosError> {
    let super::Cluster::Ha(cluster) = t.cluster else {
        return Ok(());
    };
    for round in 0..t.config.rounds {
        if stop.is_cancelled() {
            break;
        }
        pause(Duration::from_millis(1500), Duration::from_millis(3000)).await;
        let start = Instant::now();
        let formation = cluster.clone();
        // On one blocking task each, which runs to its end even if this future is dropped,
        // so the formation is never left without a standby.
        // Each fault's window ends when a primary takes writes again: the audit ties a
        // duplicate to it only while outcomes could not be written. Settling (a lost node
        // rejoining as the standby) comes after, outside the window.
        match round % 3 {
            0 => {
                tokio::task::spawn_blocking(move || formation.perform_failover()).await??;
                t.log.push(FaultKind::Switchover, None, start);
            }
            1 => {
                let back = formation.clone();
                tokio::task::spawn_blocking(move || back.kill_primary_postmaster()).await??;
                t.log.push(FaultKind::PrimaryCrash, None, start);
                tokio::task::spawn_blocking(move || {
                    formation.wait_healthy(Duration::from_secs(90))
                })
                .await??;
            }
            _ => {
                let back = formation.clone();
                let lost = tokio::task::spawn_blocking(move || back.lose_primary()).await??;
                t.log.push(FaultKind::PrimaryLost, None, start);
                tokio::task::spawn_blocking(move || formation.rejoin(&lost)).await??;
            }
        }
    }
    Ok(())
}
