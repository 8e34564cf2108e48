//! The values every backend can store, and how the framework keeps what it writes within them.
//!
//! What a caller gives (a job to enqueue) is refused with [`InvalidInput`] when it falls outside
//! these limits; what the framework writes on a handler's behalf (an outcome's error text, a
//! retry's delay) is made to fit: NUL characters are taken out, text is cut at
//! [`MAX_ERROR_BYTES`], delays are capped at [`MAX_DELAY`] and instants kept between
//! [`EARLIEST`] and [`LATEST`]. So one bad value never costs a batch of outcomes its write.

use std::borrow::Cow;
use std::collections::HashSet;
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

impl NewJob {
    /// Refuses a job no backend could store as given: NUL characters in the payload or the
    /// unique key, a delay over [`MAX_DELAY`], an instant outside [`EARLIEST`]..=[`LATEST`].
    /// Every backend runs it before anything is written.
    pub fn check(&self) -> Result<(), InvalidInput> {
        if let Some(path) = nul_in(&self.payload, &mut String::new()) {
            return Err(InvalidInput::PayloadNul { path });
        }
        if self.unique_key.as_deref().is_some_and(|k| k.contains('\0')) {
            return Err(InvalidInput::UniqueKeyNul);
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

/// Why a payload does not parse, without the payload's values: serde quotes the value it
/// found (`invalid type: string "…"`, ``unknown variant `…` ``), and payloads may carry secrets,
/// so every quoted or backticked part is replaced by `…`, except the name of a missing field
/// (the handler's type's own). This is the text of `last_error` and of the event.
pub fn payload_error_text(error: &serde_json::Error) -> String {
    let message = error.to_string();
    if message.starts_with("missing field `") {
        return message;
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
    fn a_payload_error_names_no_value_of_the_payload() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        enum Kind {
            Card,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Args {
            amount: i64,
            kind: Kind,
        }
        let text = |value: serde_json::Value| {
            payload_error_text(&serde_json::from_value::<Args>(value).unwrap_err())
        };
        let secret = "4111-1111-1111-1111";
        for hostile in [
            json!({ "amount": secret, "kind": "Card" }),
            json!({ "amount": 1, "kind": secret }),
            json!({ "amount": 1, "kind": { secret: 1 } }),
            json!(secret),
            json!([secret, 1]),
        ] {
            let text = text(hostile);
            assert!(!text.contains("4111"), "{text}");
            assert!(!text.is_empty());
        }
        assert_eq!(text(json!({ "kind": "Card" })), "missing field `amount`");
        assert_eq!(
            text(json!({ "amount": "x", "kind": "Card" })),
            "invalid type: string \"…\", expected i64"
        );
        // Numbers are values too.
        assert!(!text(json!({ "amount": 1.5, "kind": "Card" })).contains("1.5"));
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
