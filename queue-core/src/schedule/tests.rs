use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{Schedule, periods, walk};

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

#[test]
fn periods_are_bounded_and_say_when_more_are_left() {
    let s = Schedule::every("s", Duration::from_secs(1)).unwrap();
    let (first, more) = periods(
        &s,
        at("2026-01-01T00:00:00Z"),
        at("2026-01-01T01:00:00Z"),
        10,
    );
    assert!(more);
    assert_eq!(first.len(), 10);
    assert_eq!(first[0], at("2026-01-01T00:00:01Z"));
    let (all, more) = periods(
        &s,
        at("2026-01-01T00:00:00Z"),
        at("2026-01-01T00:00:05Z"),
        10,
    );
    assert!(!more);
    assert_eq!(
        all.last(),
        Some(&at("2026-01-01T00:00:05Z")),
        "the end is included"
    );
}

#[test]
fn a_walk_past_its_limit_still_finds_the_latest_period() {
    let s = Schedule::every("s", Duration::from_secs(1)).unwrap();
    let (latest, counted) = walk(
        &s,
        at("2026-01-01T00:00:00Z"),
        at("2026-01-02T00:00:00.5Z"),
        100,
    );
    assert_eq!(latest, Some(at("2026-01-02T00:00:00Z")));
    assert!(counted > 100, "counted {counted}");
    let (none, zero) = walk(
        &s,
        at("2026-01-01T00:00:00Z"),
        at("2026-01-01T00:00:00.5Z"),
        100,
    );
    assert_eq!((none, zero), (None, 0));
}
