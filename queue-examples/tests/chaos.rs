//! The chaos suite's quick mode: every single-fault scenario against `exchange-worker`
//! processes, a PostgreSQL cluster of the suite's own and the local partner, each audited.
//! The full mode is `cargo run --release -p queue-examples --bin exchange-chaos`
//! (docs/reliability.md).

use std::path::PathBuf;

use queue_examples::chaos::{self, ChaosConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_quick_mode_keeps_every_promise() {
    let config = ChaosConfig::quick(PathBuf::from(env!("CARGO_BIN_EXE_exchange-worker")));
    let report = chaos::run(&config).await.expect("the chaos run completes");
    println!("{report}");
    let violations = report.violations();
    let logs: Vec<_> = report.scenarios.iter().map(|s| s.logs.display()).collect();
    assert!(
        violations.is_empty(),
        "{report}\n{violations:#?}\nworker logs: {logs:?}"
    );
    assert_eq!(report.scenarios.len(), config.scenarios.len());
    for scenario in &report.scenarios {
        let audit = &scenario.audit;
        assert!(audit.posts > 0, "{:?} sent nothing", scenario.scenario);
        assert_eq!(
            audit.success + audit.failed,
            audit.transactions,
            "{:?}",
            scenario.scenario
        );
        if scenario.scenario != chaos::Scenario::Poison {
            assert!(
                !audit.faults.is_empty(),
                "{:?}: no fault",
                scenario.scenario
            );
        }
    }
}
