//! The throughput chart, drawn on the server as SVG: one bar per minute, completed jobs in
//! green with failed, dead and cancelled ones stacked on top in red. No script, no network.

use maud::{Markup, html};
use queue_core::MinuteCounts;

const WIDTH: u32 = 300;
const HEIGHT: u32 = 60;

/// The chart of `minutes` (oldest first).
pub(crate) fn throughput(minutes: &[MinuteCounts]) -> Markup {
    let total = |m: &MinuteCounts| {
        let f = m.finished;
        f.completed + f.failed + f.dead + f.cancelled
    };
    let peak = minutes.iter().map(total).max().unwrap_or(0).max(1);
    let slot = WIDTH as f64 / minutes.len().max(1) as f64;
    let bar = (slot - 1.0).max(1.0);
    let height = |n: u64| n as f64 / peak as f64 * f64::from(HEIGHT);
    let all: u64 = minutes.iter().map(total).sum();
    html! {
        svg class="chart" viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) width=(WIDTH) height=(HEIGHT)
            role="img" aria-label=(format!("{all} jobs ended in the last {} minutes", minutes.len())) {
            @for (i, minute) in minutes.iter().enumerate() {
                @let f = minute.finished;
                @let bad = f.failed + f.dead + f.cancelled;
                @let x = i as f64 * slot;
                @let ok_h = height(f.completed);
                @let bad_h = height(bad);
                g {
                    title {
                        (minute.minute.format("%H:%M")) ": " (f.completed) " completed, "
                        (f.failed) " failed, " (f.dead) " dead, " (f.cancelled) " cancelled"
                    }
                    rect class="ok" x=(format!("{x:.1}")) y=(format!("{:.1}", f64::from(HEIGHT) - ok_h))
                        width=(format!("{bar:.1}")) height=(format!("{ok_h:.1}")) {}
                    rect class="bad" x=(format!("{x:.1}")) y=(format!("{:.1}", f64::from(HEIGHT) - ok_h - bad_h))
                        width=(format!("{bar:.1}")) height=(format!("{bad_h:.1}")) {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use queue_core::FinishedCounts;

    #[test]
    fn bars_scale_to_the_busiest_minute() {
        let now = chrono::Utc::now();
        let minutes = [
            MinuteCounts {
                minute: now,
                finished: FinishedCounts {
                    completed: 10,
                    ..FinishedCounts::default()
                },
            },
            MinuteCounts {
                minute: now,
                finished: FinishedCounts {
                    completed: 3,
                    dead: 2,
                    ..FinishedCounts::default()
                },
            },
        ];
        let svg = throughput(&minutes).into_string();
        assert!(svg.contains("15 jobs ended in the last 2 minutes"), "{svg}");
        assert!(
            svg.contains(r#"height="60.0""#),
            "the busiest minute fills the chart: {svg}"
        );
        assert!(svg.contains("2 dead"));
    }
}
