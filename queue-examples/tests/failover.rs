//! PostgreSQL failovers under load, on both drivers: `exchange-worker` processes on the
//! multi-host URL of a pg_auto_failover formation of the test's own (monitor, primary,
//! synchronous standby), switchovers and lost primaries while the local partner records every
//! POST, audited as the chaos suite audits (nothing lost or stranded, no conflicting or double
//! terminal events, every duplicate POST tied to a failover within its lease). Needs
//! `pg_autoctl` (Debian: postgresql-15-auto-failover), which `.ci/run` installs.

use std::path::PathBuf;
use std::time::Duration;

use queue_examples::chaos::{self, ChaosConfig, ChaosError};
use queue_examples::cli::PgDriver;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlx_workers_ride_through_failovers() {
    ride_through(PgDriver::Sqlx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokio_postgres_workers_ride_through_failovers() {
    ride_through(PgDriver::TokioPostgres).await;
}

/// One formation at a time: two of them (six PostgreSQL servers, their keepers and the workers)
/// starting together on a 2-core machine made the formations' own start-up time out.
static ONE_FORMATION_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn ride_through(driver: PgDriver) {
    let _turn = ONE_FORMATION_AT_A_TIME.lock().await;
    let config =
        ChaosConfig::failover(PathBuf::from(env!("CARGO_BIN_EXE_exchange-worker")), driver);
    // A formation that does not settle (its monitor names no primary within 90 s, seen once in
    // CI, never reproduced here) fails the formation, not the workers: the run goes once more on
    // a new formation. The first failure, which says what the monitor saw, goes to the process's
    // stderr itself (not through the test harness's capture), so CI's log keeps it when the
    // second run passes.
    let report = match chaos::run_failover(&config).await {
        Err(ChaosError::Cluster(first)) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "{driver:?}: the formation itself failed; once more on a new one: {first}"
            );
            chaos::run_failover(&config).await
        }
        other => other,
    }
    .expect("the failover run completes");
    let scenario = &report.scenarios[0];
    println!("{report}");
    println!(
        "{driver:?}: longest pause between POSTs {:.2} s; LISTEN connections made {}",
        scenario.longest_post_gap.as_secs_f64(),
        scenario.listener_connects
    );
    let violations = report.violations();
    assert!(
        violations.is_empty(),
        "{report}\n{violations:#?}\nworker logs: {}",
        scenario.logs.display()
    );
    let audit = &scenario.audit;
    let failovers: usize = audit.faults.values().sum();
    assert_eq!(
        failovers, config.rounds,
        "every failover happened under load"
    );
    assert_eq!(audit.success + audit.failed, audit.transactions);
    assert_eq!(audit.lost, 0);
    assert_eq!(audit.stranded, 0);
    // Each worker listened once at start and again on the new primary after failovers.
    assert!(
        scenario.listener_connects > config.workers,
        "no listener re-listened: {} connects for {} workers",
        scenario.listener_connects,
        config.workers
    );
    assert!(scenario.longest_post_gap < Duration::from_secs(30));
}
