//! How a claim of a queue with a limit per partition
//! ([`QueueLimits::max_per_partition`](crate::QueueLimits) or
//! [`QueueLimits::rate_per_partition`](crate::QueueLimits)) chooses its jobs: the one rule every
//! backend applies (PostgreSQL in SQL, `claim_limited.sql`; the others through [`fits`],
//! [`PartitionWalk`] and [`keep_within_starts`]).
//!
//! A partition's *room* is how many more of its jobs a claim may start
//! ([`QueueLimits::partition_room`](crate::QueueLimits::partition_room)): what its limit in
//! flight leaves (counting its jobs in flight, leases expired or not) and what its rate leaves
//! (counting its claims within the window, takeovers included).
//!
//! A claim first looks at what it would take without partitions: the queue's earliest due
//! jobs. When that puts no partition over its room, it takes them: while no partition is at its
//! limit, jobs run in the usual order (due time, priority, id), at the cost of an unlimited
//! claim.
//!
//! Otherwise the partitions take turns. The queue keeps a cursor: the partition key where the
//! last such claim stopped. The claim visits the keys of the queue's pending jobs in key order,
//! starting after the cursor and wrapping around to the first key, each key once. A key
//! *yields* when it has a due job and room; it offers its earliest due jobs, up to its room.
//! The walk stops once as many keys yielded as the claim may take new jobs, or after
//! [`MAX_PARTITION_VISITS`] keys (so a claim's cost is bounded however many partitions exist).
//! The claim then takes, from these offers and the due jobs without a partition among the
//! queue's earliest (eight times the claim's size, at most 1 000), the earliest in the usual
//! order.
//!
//! Takeovers of expired leases join the claim's picks in claim order either way. They add no
//! job in flight, but each is a start: with a rate per partition, a partition's picks beyond
//! the starts its rate leaves are dropped, the latest first ([`keep_within_starts`]).
//!
//! The cursor moves to the last key visited, except when a key yielded and none of its jobs was
//! taken (the batch filled with earlier jobs first): it then stops just before that key, which
//! comes first in the next claim. So a partition at its limit is passed over, a partition's
//! backlog never holds back another's once it reaches its limit, and every partition with due
//! work is visited within `partitions / batch` claims.
//!
//! ```
//! use queue_core::partition::{PartitionWalk, Probe};
//!
//! // Three partners with due work, room for one job each; the last claim stopped at "b".
//! let mut walk = PartitionWalk::new(Some("b".into()), 10);
//! let keys = ["a", "b", "c"];
//! while let Some(probe) = walk.probe() {
//!     let next = keys.iter().find(|k| probe.admits(k)).map(|k| k.to_string());
//!     // Each found key has a due job and room for one.
//!     walk.found(next.map(|key| (key, true, 1)));
//! }
//! let order: Vec<&str> = walk.visits().iter().map(|v| v.key.as_str()).collect();
//! assert_eq!(order, ["c", "a", "b"]);
//! // Every yielding key had a job taken: the cursor goes to the last visited.
//! assert_eq!(walk.cursor_after(|_| true), Some("b".to_owned()));
//! // "a" yielded but its job was not taken: the next claim starts with it.
//! assert_eq!(walk.cursor_after(|key| key != "a"), Some("c".to_owned()));
//! ```

/// Whether a claim may take the jobs it would take without partitions (the partition key of
/// each, `None` for a job without one) as they are: no partition then has more of them than
/// `room(key)` ([`QueueLimits::partition_room`](crate::QueueLimits::partition_room)). When it
/// may not, the partitions take turns ([`PartitionWalk`]).
///
/// ```
/// use queue_core::partition::fits;
///
/// // Two in flight per partition; "a" has one already.
/// let room = |key: &str| if key == "a" { 1 } else { 2 };
/// assert!(fits([Some("a"), Some("b"), None, Some("b")], room));
/// assert!(!fits([Some("a"), Some("a")], room), "a would have three");
/// ```
pub fn fits<'a>(
    picked: impl IntoIterator<Item = Option<&'a str>>,
    room: impl Fn(&str) -> u64,
) -> bool {
    let mut counts: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for key in picked.into_iter().flatten() {
        *counts.entry(key).or_default() += 1;
    }
    counts.into_iter().all(|(key, n)| n <= room(key))
}

/// Drops from a claim's picks (in claim order) those past the starts a partition has left
/// (`left(key)`: [`QueueLimits::partition_starts_left`](crate::QueueLimits::partition_starts_left)),
/// keeping each partition's earliest: what bounds the takeovers of a partition's expired leases
/// by its rate. Picks without a partition (`key` gives `None`) are kept.
///
/// ```
/// use queue_core::partition::keep_within_starts;
///
/// let mut picks = vec![("a", 1), ("b", 2), ("a", 3), ("a", 4)];
/// keep_within_starts(&mut picks, |p| Some(p.0), |key| if key == "a" { 2 } else { 0 });
/// assert_eq!(picks, [("a", 1), ("a", 3)]);
/// ```
pub fn keep_within_starts<T>(
    picks: &mut Vec<T>,
    key: impl Fn(&T) -> Option<&str>,
    left: impl Fn(&str) -> u64,
) {
    let mut taken: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    picks.retain(|pick| match key(pick) {
        None => true,
        Some(key) => {
            let n = taken.entry(key.to_owned()).or_default();
            *n += 1;
            *n <= left(key)
        }
    });
}

/// How many of the queue's earliest due jobs a claim whose partitions take turns reads to find
/// the jobs without a partition among them: eight times the jobs it may take, at most
/// [`MAX_LOOSE_READ_AHEAD`].
pub fn loose_read_ahead(wanted: u32) -> usize {
    (wanted as usize)
        .saturating_mul(8)
        .min(MAX_LOOSE_READ_AHEAD)
}

/// The most due jobs [`loose_read_ahead`] reads.
pub const MAX_LOOSE_READ_AHEAD: usize = 1_000;

/// The most partition keys one claim visits.
pub const MAX_PARTITION_VISITS: usize = 1_000;

/// A walk over a queue's partition keys for one claim (see the [module](self)).
#[derive(Debug, Clone)]
pub struct PartitionWalk {
    cursor: Option<String>,
    wanted: usize,
    max_visits: usize,
    /// The last key visited, and whether the walk went past the end and began again.
    after: Option<String>,
    wrapped: bool,
    done: bool,
    yielded: usize,
    visits: Vec<Visit>,
}

/// A key the walk visited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visit {
    /// The partition key.
    pub key: String,
    /// How many of its due jobs the claim may take (0: none due, or at its limit).
    pub room: u32,
}

/// Which key the walk needs next: the first key of the queue's pending jobs that
/// [`Probe::admits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe<'a> {
    /// Keys strictly after this one (`None`: from the first key).
    pub after: Option<&'a str>,
    /// Keys up to this one, itself included (`None`: to the last key).
    pub up_to: Option<&'a str>,
}

impl Probe<'_> {
    /// Whether `key` is in the range this probe asks for.
    pub fn admits(&self, key: &str) -> bool {
        self.after.is_none_or(|after| key > after) && self.up_to.is_none_or(|up_to| key <= up_to)
    }
}

impl PartitionWalk {
    /// A walk from `cursor` (the queue's stored cursor; `None`: from the first key), for a claim
    /// that may take `wanted` new jobs.
    pub fn new(cursor: Option<String>, wanted: u32) -> Self {
        Self::with_max_visits(cursor, wanted, MAX_PARTITION_VISITS)
    }

    /// [`PartitionWalk::new`] that visits at most `max_visits` keys.
    pub fn with_max_visits(cursor: Option<String>, wanted: u32, max_visits: usize) -> Self {
        PartitionWalk {
            after: cursor.clone(),
            // Without a cursor the walk starts at the first key: there is nothing to wrap to.
            wrapped: cursor.is_none(),
            cursor,
            wanted: wanted as usize,
            max_visits,
            done: wanted == 0 || max_visits == 0,
            yielded: 0,
            visits: Vec::new(),
        }
    }

    /// The next key range to look up, or `None` when the walk is over.
    pub fn probe(&self) -> Option<Probe<'_>> {
        if self.done {
            return None;
        }
        Some(Probe {
            after: self.after.as_deref(),
            up_to: if self.wrapped {
                self.cursor.as_deref()
            } else {
                None
            },
        })
    }

    /// What the last [`probe`](Self::probe) found: the first key in its range, whether it has a
    /// due job, and its room
    /// ([`QueueLimits::partition_room`](crate::QueueLimits::partition_room)); `None` when no
    /// key is in the range.
    pub fn found(&mut self, found: Option<(String, bool, u64)>) {
        match found {
            None if self.wrapped => self.done = true,
            None => {
                self.wrapped = true;
                self.after = None;
            }
            Some((key, due, room)) => {
                let room = if due {
                    room.min(u64::from(u32::MAX)) as u32
                } else {
                    0
                };
                if room > 0 {
                    self.yielded += 1;
                }
                self.after = Some(key.clone());
                self.visits.push(Visit { key, room });
                if self.yielded >= self.wanted || self.visits.len() >= self.max_visits {
                    self.done = true;
                }
            }
        }
    }

    /// The keys visited, in order.
    pub fn visits(&self) -> &[Visit] {
        &self.visits
    }

    /// The queue's cursor after the claim, given which keys had a job taken (see the
    /// [module](self)).
    pub fn cursor_after(&self, taken: impl Fn(&str) -> bool) -> Option<String> {
        match self
            .visits
            .iter()
            .position(|visit| visit.room > 0 && !taken(&visit.key))
        {
            Some(0) => self.cursor.clone(),
            Some(at) => Some(self.visits[at - 1].key.clone()),
            None => self
                .visits
                .last()
                .map(|visit| visit.key.clone())
                .or_else(|| self.cursor.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks `keys` (each `(key, due, in_flight)`, sorted) from `cursor`, `limit` in flight
    /// per partition.
    fn walk(
        cursor: Option<&str>,
        keys: &[(&str, bool, u64)],
        limit: u32,
        wanted: u32,
        max: usize,
    ) -> PartitionWalk {
        let mut walk = PartitionWalk::with_max_visits(cursor.map(str::to_owned), wanted, max);
        let mut probes = 0;
        while let Some(probe) = walk.probe() {
            probes += 1;
            assert!(probes <= keys.len() + 2, "the walk does not end");
            let next = keys
                .iter()
                .find(|(key, _, _)| probe.admits(key))
                .map(|(key, due, n)| (key.to_string(), *due, u64::from(limit).saturating_sub(*n)));
            walk.found(next);
        }
        walk
    }

    fn order(walk: &PartitionWalk) -> Vec<(&str, u32)> {
        walk.visits()
            .iter()
            .map(|v| (v.key.as_str(), v.room))
            .collect()
    }

    #[test]
    fn the_walk_starts_after_the_cursor_wraps_and_visits_each_key_once() {
        let keys = [
            ("a", true, 0),
            ("b", true, 0),
            ("c", true, 0),
            ("d", true, 0),
        ];
        let w = walk(Some("b"), &keys, 1, 10, 100);
        assert_eq!(order(&w), [("c", 1), ("d", 1), ("a", 1), ("b", 1)]);
        let w = walk(None, &keys, 1, 10, 100);
        assert_eq!(order(&w), [("a", 1), ("b", 1), ("c", 1), ("d", 1)]);
        // A cursor past every key (its partition finished meanwhile) wraps at once.
        let w = walk(Some("z"), &keys, 1, 10, 100);
        assert_eq!(order(&w).len(), 4);
        assert!(walk(Some("b"), &[], 1, 10, 100).visits().is_empty());
    }

    #[test]
    fn keys_at_their_limit_or_without_due_jobs_yield_nothing_and_do_not_stop_the_walk() {
        let keys = [
            ("a", true, 2),
            ("b", false, 0),
            ("c", true, 1),
            ("d", true, 0),
        ];
        let w = walk(None, &keys, 2, 2, 100);
        assert_eq!(order(&w), [("a", 0), ("b", 0), ("c", 1), ("d", 2)]);
        // The claim wants one key's jobs: the walk stops at the first that yields.
        let w = walk(None, &keys, 2, 1, 100);
        assert_eq!(order(&w), [("a", 0), ("b", 0), ("c", 1)]);
    }

    #[test]
    fn the_walk_stops_after_its_most_visits_and_the_cursor_moves_past_them() {
        let keys: Vec<(String, bool, u64)> = (0..10).map(|n| (format!("k{n}"), true, 1)).collect();
        let keys: Vec<(&str, bool, u64)> =
            keys.iter().map(|(k, d, n)| (k.as_str(), *d, *n)).collect();
        let w = walk(None, &keys, 1, 5, 4);
        assert_eq!(w.visits().len(), 4, "every key full: four visits, no more");
        assert_eq!(w.cursor_after(|_| false), Some("k3".to_owned()));
        let w = walk(Some("k3"), &keys, 1, 5, 4);
        assert_eq!(w.visits()[0].key, "k4", "the next claim goes on");
    }

    #[test]
    fn the_cursor_stops_before_the_first_key_whose_offer_was_not_taken() {
        let keys = [("a", true, 0), ("b", true, 0), ("c", true, 0)];
        let w = walk(Some("a"), &keys, 1, 10, 100);
        assert_eq!(w.cursor_after(|_| true), Some("a".to_owned()));
        assert_eq!(w.cursor_after(|k| k == "b"), Some("b".to_owned()));
        assert_eq!(w.cursor_after(|_| false), Some("a".to_owned()), "unchanged");
        let w = walk(None, &keys, 1, 10, 100);
        assert_eq!(w.cursor_after(|_| false), None, "unchanged: none");
        // A claim that may take nothing walks nowhere and keeps the cursor.
        let w = walk(Some("b"), &keys, 1, 0, 100);
        assert!(w.visits().is_empty());
        assert_eq!(w.cursor_after(|_| true), Some("b".to_owned()));
    }
}
