//! The values every backend can store, and how the framework keeps what it writes within them.
//!
//! What a caller gives (a job to enqueue) is refused with [`InvalidInput`] when it falls outside
//! these limits; what the framework writes on a handler's behalf (an outcome's error text, a
//! retry's delay) is made to fit: NUL characters are taken out, text is cut at
//! [`MAX_ERROR_BYTES`], delays are capped at [`MAX_DELAY`] and instants kept between
//! [`EARLIEST`] and [`LATEST`]. So one bad value never costs a batch of outcomes its write.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::error::InvalidInput;
use crate::types::{Claim, Finalize, NewJob, RunAt};

/// The longest error text (or cancel reason) kept in `last_error`, in bytes: 8 KiB. Longer
/// text is cut at a character boundary and ends with [`TRUNCATED`].
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// What ends error text that was cut at [`MAX_ERROR_BYTES`].
pub const TRUNCATED: &str = "…[truncated]";

/// The longest delay the queue schedules: 366 days. A longer retry delay is capped; an enqueue
/// with a longer delay is refused.
pub const MAX_DELAY: Duration = Duration::from_secs(366 * 24 * 3600);

/// The earliest instant kept: 1970-01-01T00:00:00Z. An earlier retry instant means "due now".
pub const EARLIEST: DateTime<Utc> = DateTime::UNIX_EPOCH;

/// The latest instant kept: 9999-12-31T23:59:59Z (PostgreSQL and every client agree on it).
pub const LATEST: DateTime<Utc> = match DateTime::from_timestamp(253_402_300_799, 0) {
    Some(latest) => latest,
    None => panic!("9999-12-31T23:59:59Z is a valid instant"),
};

/// How many errors a job's history keeps ([`crate::JobRecord::errors`]): the last ten.
pub const ERROR_HISTORY_LEN: usize = 10;

/// The longest error text an entry of the history keeps, in characters (the full text, up to
/// [`MAX_ERROR_BYTES`], is the latest entry's `last_error`).
pub const HISTORY_ERROR_CHARS: usize = 1024;

/// The longest holder name ([`crate::ClaimRequest::holder`]) stored, in bytes.
pub const MAX_HOLDER_BYTES: usize = 200;

/// A holder name as it is stored: control characters (NUL among them) taken out, cut at
/// [`MAX_HOLDER_BYTES`] on a character boundary.
pub fn storable_holder(name: &str) -> String {
    let mut out = String::with_capacity(name.len().min(MAX_HOLDER_BYTES));
    for c in name.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > MAX_HOLDER_BYTES {
            break;
        }
        out.push(c);
    }
    out
}

/// An error text as the history keeps it: at most [`HISTORY_ERROR_CHARS`] characters.
pub fn history_text(text: &str) -> String {
    text.chars().take(HISTORY_ERROR_CHARS).collect()
}

/// `text` as it can be stored: without NUL characters, at most [`MAX_ERROR_BYTES`].
pub fn storable_text(text: &str) -> Cow<'_, str> {
    let text = if text.contains('\0') {
        Cow::Owned(text.replace('\0', ""))
    } else {
        Cow::Borrowed(text)
    };
    if text.len() <= MAX_ERROR_BYTES {
        return text;
    }
    let mut cut = MAX_ERROR_BYTES - TRUNCATED.len();
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    Cow::Owned(format!("{}{TRUNCATED}", &text[..cut]))
}

/// `run_at` as it can be stored: a delay capped at [`MAX_DELAY`], an instant kept between
/// [`EARLIEST`] and [`LATEST`].
pub fn storable_run_at(run_at: RunAt) -> RunAt {
    match run_at {
        RunAt::Now => RunAt::Now,
        RunAt::After(delay) => RunAt::After(delay.min(MAX_DELAY)),
        RunAt::At(at) => RunAt::At(at.clamp(EARLIEST, LATEST)),
    }
}

impl Finalize {
    /// This write as it can be stored (see the [module](self)): what every backend writes.
    pub fn storable(&self) -> Finalize {
        let text = |s: &String| storable_text(s).into_owned();
        match self {
            Finalize::Complete => Finalize::Complete,
            Finalize::Release => Finalize::Release,
            Finalize::Snooze { at } => Finalize::Snooze {
                at: storable_run_at(*at),
            },
            Finalize::Fail { error } => Finalize::Fail { error: text(error) },
            Finalize::Retry { at, error } => Finalize::Retry {
                at: storable_run_at(*at),
                error: text(error),
            },
            Finalize::Cancel { reason } => Finalize::Cancel {
                reason: text(reason),
            },
            Finalize::Dead { reason } => Finalize::Dead {
                reason: text(reason),
            },
        }
    }
}

/// Refuses a finalize batch that holds two outcomes for one claim: which one should apply is
/// not the backend's to guess.
pub fn check_batch(items: &[(Claim, Finalize)]) -> Result<(), InvalidInput> {
    let mut seen = HashSet::with_capacity(items.len());
    for (claim, _) in items {
        if !seen.insert(*claim) {
            return Err(InvalidInput::DuplicateClaim {
                id: claim.id,
                generation: claim.generation,
            });
        }
    }
    Ok(())
}

/// Refuses an enqueue call in which two jobs share a unique key and one of them has a unique
/// scope ([`InvalidInput::RepeatedScopedKey`]); every backend runs it with [`NewJob::check`].
/// Repeated keys without scopes are fine: the first job of the key is inserted, and the later
/// ones report it.
pub fn check_enqueue_batch(jobs: &[NewJob]) -> Result<(), InvalidInput> {
    if jobs.iter().all(|job| job.unique.is_default()) {
        return Ok(());
    }
    let mut seen: HashMap<&str, (usize, bool)> = HashMap::new();
    for (i, job) in jobs.iter().enumerate() {
        let Some(key) = job.unique_key.as_deref() else {
            continue;
        };
        let scoped = !job.unique.is_default();
        if let Some(&(first, first_scoped)) = seen.get(key) {
            if scoped || first_scoped {
                return Err(InvalidInput::RepeatedScopedKey { first, second: i });
            }
        } else {
            seen.insert(key, (i, scoped));
        }
    }
    Ok(())
}

impl NewJob {
    /// Refuses a job no backend could store as given: NUL characters in the payload or the
    /// unique key, a payload over [`DEFAULT_MAX_PAYLOAD_BYTES`], a unique key over
    /// [`MAX_UNIQUE_KEY_BYTES`], a delay over [`MAX_DELAY`], an instant outside
    /// [`EARLIEST`]..=[`LATEST`]. Backends run [`NewJob::check_within`] with their own payload
    /// limit before anything is written.
    pub fn check(&self) -> Result<(), InvalidInput> {
        self.check_within(DEFAULT_MAX_PAYLOAD_BYTES)
    }

    /// [`NewJob::check`] with a payload limit of `max_payload_bytes` (JSON text).
    pub fn check_within(&self, max_payload_bytes: usize) -> Result<(), InvalidInput> {
        let size = json_size(&self.payload);
        if size > max_payload_bytes {
            return Err(InvalidInput::PayloadTooLarge {
                size,
                limit: max_payload_bytes,
            });
        }
        if let Some(path) = nul_in(&self.payload, &mut String::new()) {
            return Err(InvalidInput::PayloadNul { path });
        }
        if let Some(key) = self.unique_key.as_deref() {
            if key.contains('\0') {
                return Err(InvalidInput::UniqueKeyNul);
            }
            if key.len() > MAX_UNIQUE_KEY_BYTES {
                return Err(InvalidInput::UniqueKeyTooLong { len: key.len() });
            }
        }
        if let Some(key) = self.partition_key.as_deref() {
            if key.contains('\0') {
                return Err(InvalidInput::PartitionKeyNul);
            }
            if key.is_empty() || key.len() > MAX_PARTITION_KEY_BYTES {
                return Err(InvalidInput::PartitionKeyLength { len: key.len() });
            }
        }
        if !self.unique.is_default() {
            if self.unique_key.is_none() {
                return Err(InvalidInput::UniqueScopeWithoutKey);
            }
            if self.unique.held_while.as_ref().is_some_and(Vec::is_empty) {
                return Err(InvalidInput::UniqueScopeEmpty);
            }
            if let Some(period) = self.unique.held_for.filter(|p| *p > MAX_DELAY) {
                return Err(InvalidInput::UniquePeriodTooLong(period));
            }
        }
        match self.run_at {
            RunAt::After(delay) if delay > MAX_DELAY => Err(InvalidInput::DelayTooLong(delay)),
            RunAt::At(at) if at < EARLIEST || at > LATEST => {
                Err(InvalidInput::InstantOutOfRange(at))
            }
            _ => Ok(()),
        }
    }
}

/// The largest payload [`NewJob::check`] accepts by default, as JSON text: 1 MiB. Backends take
/// another limit in their configuration (`MemoryBackend::with_max_payload_bytes`,
/// `PgQueueConfig::max_payload_bytes`); a job is a row read by every claim, not a blob store.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// The longest unique key, in bytes: 512. PostgreSQL's unique index refuses entries over about
/// 2.7 kB with an error no caller can act on; a key is an identifier, not data.
pub const MAX_UNIQUE_KEY_BYTES: usize = 512;

/// The longest partition key ([`NewJob::partition_key`](NewJob#structfield.partition_key)),
/// in bytes: 200. A key names a partner or a tenant; it is part of an index entry.
pub const MAX_PARTITION_KEY_BYTES: usize = 200;

/// Why a stored payload does not parse into a handler's type, without any of the payload's
/// values: payloads may carry secrets (a card number in a mistyped field), and this text goes to
/// `last_error` and to the `queue.payload_malformed` event.
///
/// `path` is where (`amount`, `items[2].sku`); `reason` is serde's complaint with every value it
/// quoted replaced by `…` (`invalid type: string "…", expected i64`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at {path}: {reason}")]
pub struct PayloadError {
    /// Where in the payload, as field names and indexes (`.` for the payload itself); a map key
    /// that does not look like a field name is shown as `…`.
    pub path: String,
    /// What did not fit, without values.
    pub reason: String,
}

/// Parses a stored payload into `T`, or says where and why it does not fit without quoting it
/// ([`PayloadError`]). The worker parses every payload through it.
///
/// ```
/// use queue_core::limits::parse_payload;
///
/// #[derive(serde::Deserialize, Debug)]
/// struct Charge { card: u64 }
///
/// let err = parse_payload::<Charge>(&serde_json::json!({ "card": "4111 1111 1111 1111" }))
///     .unwrap_err();
/// assert_eq!(err.to_string(), "at card: invalid type: string \"…\", expected u64");
/// ```
pub fn parse_payload<T: serde::de::DeserializeOwned>(payload: &Value) -> Result<T, PayloadError> {
    serde_path_to_error::deserialize(payload).map_err(|err| PayloadError {
        path: path_text(err.path()),
        reason: reason_text(err.inner()),
    })
}

/// The path with map keys that could be data (not field-name shaped) replaced by `…`.
fn path_text(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(if looks_like_a_field_name(key) {
                    key
                } else {
                    "…"
                });
            }
            Segment::Unknown => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push('?');
            }
        }
    }
    if out.is_empty() { ".".to_owned() } else { out }
}

/// A field name: an ASCII identifier of at most 40 characters. Longer or other keys (a card
/// number, an e-mail address, a token with `-`) may be a map's data and are not shown.
fn looks_like_a_field_name(key: &str) -> bool {
    let mut chars = key.chars();
    key.len() <= 40
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// serde's complaint with its quoted values (`"…"`, `` `…` ``) and JSON positions taken out,
/// except the name of a missing field (the handler's type's own).
fn reason_text(error: &serde_json::Error) -> String {
    let message = error.to_string();
    // serde_json adds " at line L column C", which says nothing about a payload read from a row.
    let message = match message.rfind(" at line ") {
        Some(at) => &message[..at],
        None => &message,
    };
    if message.starts_with("missing field `") {
        return message.to_owned();
    }
    let mut out = String::with_capacity(message.len());
    let mut open: Option<char> = None;
    for c in message.chars() {
        match open {
            Some(close) if c == close => {
                out.push(c);
                open = None;
            }
            Some(_) => {}
            None if c == '"' || c == '`' => {
                out.push(c);
                out.push('…');
                open = Some(c);
            }
            None => out.push(c),
        }
    }
    out
}

/// The size of `value` as JSON text, without building the text.
pub fn json_size(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).expect("a JSON value always serialises");
    count.0
}

/// The JSON pointer of the first NUL character in a string or key of `value`.
fn nul_in(value: &Value, path: &mut String) -> Option<String> {
    let at = path.len();
    let found = match value {
        Value::String(s) if s.contains('\0') => Some(path.clone()),
        Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            path.truncate(at);
            path.push_str(&format!("/{i}"));
            nul_in(item, path)
        }),
        Value::Object(map) => map.iter().find_map(|(key, item)| {
            path.truncate(at);
            let escaped = key
                .replace('~', "~0")
                .replace('/', "~1")
                .replace('\0', "\\u0000");
            path.push('/');
            path.push_str(&escaped);
            if key.contains('\0') {
                Some(path.clone())
            } else {
                nul_in(item, path)
            }
        }),
        _ => None,
    };
    path.truncate(at);
    found.map(|p| if p.is_empty() { "/".to_owned() } else { p })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_payload_error_names_where_and_no_value_of_the_payload() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        enum Kind {
            Card,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Item {
            sku: u32,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Args {
            amount: i64,
            kind: Kind,
            #[serde(default)]
            items: Vec<Item>,
            #[serde(default)]
            tags: std::collections::HashMap<String, u8>,
        }
        let text =
            |value: serde_json::Value| parse_payload::<Args>(&value).unwrap_err().to_string();
        let secret = "4111-1111-1111-1111";
        for hostile in [
            json!({ "amount": secret, "kind": "Card" }),
            json!({ "amount": 1, "kind": secret }),
            json!({ "amount": 1, "kind": { secret: 1 } }),
            json!({ "amount": 1, "kind": "Card", "items": [{ "sku": secret }] }),
            json!({ "amount": 1, "kind": "Card", "tags": { secret: "x" } }),
            json!({ "amount": 1, "kind": "Card", "tags": { "4111111111111111": 1000 } }),
            json!(secret),
            json!([secret, 1]),
        ] {
            let text = text(hostile);
            assert!(!text.contains("4111"), "{text}");
            assert!(!text.is_empty());
        }
        assert_eq!(
            text(json!({ "kind": "Card" })),
            "at .: missing field `amount`"
        );
        assert_eq!(
            text(json!({ "amount": "x", "kind": "Card" })),
            "at amount: invalid type: string \"…\", expected i64"
        );
        assert_eq!(
            text(json!({ "amount": 1, "kind": "Card", "items": [{ "sku": 1 }, { "sku": "x" }] })),
            "at items[1].sku: invalid type: string \"…\", expected u32"
        );
        assert_eq!(
            text(json!({ "amount": 1, "kind": "Card", "tags": { "card 4111": 1000 } })),
            "at tags.…: invalid value: integer `…`, expected u8"
        );
        // Numbers are values too.
        assert!(!text(json!({ "amount": 1.5, "kind": "Card" })).contains("1.5"));
    }

    #[test]
    fn a_job_over_a_size_limit_is_refused_with_its_size() {
        let big = NewJob::from_value(json!("x".repeat(100)));
        assert_eq!(json_size(&big.payload), 102);
        assert!(big.check_within(102).is_ok());
        assert_eq!(
            big.check_within(101),
            Err(InvalidInput::PayloadTooLarge {
                size: 102,
                limit: 101
            })
        );
        let keyed = |len: usize| NewJob::from_value(json!({})).unique_key("k".repeat(len));
        assert!(keyed(MAX_UNIQUE_KEY_BYTES).check().is_ok());
        assert_eq!(
            keyed(MAX_UNIQUE_KEY_BYTES + 1).check(),
            Err(InvalidInput::UniqueKeyTooLong {
                len: MAX_UNIQUE_KEY_BYTES + 1
            })
        );
        let partitioned = |key: &str| NewJob::from_value(json!({})).partition_key(key);
        assert!(
            partitioned(&"p".repeat(MAX_PARTITION_KEY_BYTES))
                .check()
                .is_ok()
        );
        assert_eq!(
            partitioned(&"p".repeat(MAX_PARTITION_KEY_BYTES + 1)).check(),
            Err(InvalidInput::PartitionKeyLength {
                len: MAX_PARTITION_KEY_BYTES + 1
            })
        );
        assert_eq!(
            partitioned("").check(),
            Err(InvalidInput::PartitionKeyLength { len: 0 })
        );
        assert_eq!(
            partitioned("a\0b").check(),
            Err(InvalidInput::PartitionKeyNul)
        );
        let huge = NewJob::from_value(json!("x".repeat(DEFAULT_MAX_PAYLOAD_BYTES)));
        assert!(matches!(
            huge.check(),
            Err(InvalidInput::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn text_loses_nul_and_is_cut_at_a_character_boundary() {
        assert_eq!(storable_text("a\0b"), "ab");
        assert!(matches!(storable_text("fine"), Cow::Borrowed("fine")));
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = storable_text(&long);
        assert!(
            cut.len() <= MAX_ERROR_BYTES && cut.ends_with(TRUNCATED),
            "{}",
            cut.len()
        );
    }

    #[test]
    fn run_at_is_kept_in_range() {
        assert_eq!(
            storable_run_at(RunAt::After(Duration::MAX)),
            RunAt::After(MAX_DELAY)
        );
        assert_eq!(
            storable_run_at(RunAt::At(DateTime::<Utc>::MAX_UTC)),
            RunAt::At(LATEST)
        );
        assert_eq!(
            storable_run_at(RunAt::At(DateTime::<Utc>::MIN_UTC)),
            RunAt::At(EARLIEST)
        );
        assert_eq!(LATEST.to_rfc3339(), "9999-12-31T23:59:59+00:00");
    }

    #[test]
    fn a_job_with_a_nul_names_where_not_what() {
        let job = NewJob::from_value(json!({"card": {"holder": "x\u{0}y"}, "list": ["a"]}));
        let err = job.check().unwrap_err();
        assert_eq!(
            err,
            InvalidInput::PayloadNul {
                path: "/card/holder".into()
            }
        );
        assert!(!err.to_string().contains('x'), "{err}");
        let key = NewJob::from_value(json!({})).unique_key("k\0");
        assert_eq!(key.check(), Err(InvalidInput::UniqueKeyNul));
        let late = NewJob::from_value(json!({})).run_at(RunAt::After(Duration::MAX));
        assert!(matches!(late.check(), Err(InvalidInput::DelayTooLong(_))));
        assert!(
            NewJob::from_value(json!({"ok": [1, "two"]}))
                .check()
                .is_ok()
        );
    }
}
