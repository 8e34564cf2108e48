//! Validated SQL identifiers: the only values ever spliced into statement text.

use std::fmt;

use crate::error::PgError;

/// The longest suffix the framework appends to a table name (`_partition_idx`), so that every
/// derived name stays within PostgreSQL's 63-byte identifier limit (a longer one is cut, and
/// the schema check would not find it under its whole name).
const LONGEST_SUFFIX: usize = "_partition_idx".len();
const MAX_IDENT: usize = 63;

/// The name of a queue table: lowercase ASCII letters, digits and `_`, starting with a letter or
/// `_`, at most 49 bytes (so derived index names fit in 63).
///
/// It is resolved on the connection's `search_path`, like the rest of a service's SQL; to keep
/// queue tables in another schema, set `search_path` in the pool's connect options. Always
/// written quoted, so reserved words (`order`, `user`) are fine.
///
/// ```
/// use queue_postgres::TableName;
/// assert!(TableName::new("exchange_send_jobs").is_ok());
/// assert!(TableName::new("jobs; DROP TABLE users").is_err());
/// assert_eq!(TableName::new("order").unwrap().quoted(), "\"order\"");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

impl TableName {
    /// The framework's standard table, created by `queue_postgres::migrate`.
    pub const DEFAULT: &'static str = "queue_jobs";

    /// Validates `name`; refused names get [`PgError::InvalidIdentifier`] before any SQL runs.
    pub fn new(name: impl Into<String>) -> Result<Self, PgError> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > MAX_IDENT - LONGEST_SUFFIX {
            Some("it is longer than 49 bytes (index names derived from it must fit in 63)")
        } else if !name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_') {
            Some("it must start with a lowercase ASCII letter or '_'")
        } else if !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            Some("only lowercase ASCII letters, digits and '_' are allowed")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(PgError::InvalidIdentifier {
                what: "table name",
                value: name,
                reason,
            }),
            None => Ok(TableName(name)),
        }
    }

    /// The bare name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted for SQL text.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// A derived index name (`<table>_<suffix>`), quoted.
    pub fn index(&self, suffix: &str) -> String {
        format!("\"{}_{}\"", self.0, suffix)
    }

    /// The table of this table's queue controls (pauses), `<table>_queues`, quoted.
    pub fn controls_quoted(&self) -> String {
        format!("\"{}_queues\"", self.0)
    }

    /// The `LISTEN`/`NOTIFY` channel of this table's wake-ups.
    pub fn channel(&self) -> String {
        format!("queue_{}", self.0)
    }
}

/// Validates the name of an index the caller names (a legacy index to drop): 1 to 63 lowercase
/// ASCII letters, digits and `_`, so it can be written quoted into DDL.
pub(crate) fn validate_index_name(index: &str) -> Result<(), PgError> {
    let valid = !index.is_empty()
        && index.len() <= MAX_IDENT
        && index
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(PgError::InvalidIdentifier {
            what: "index name",
            value: index.to_owned(),
            reason: "use 1 to 63 lowercase ASCII letters, digits and '_'",
        })
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName(Self::DEFAULT.to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_names_are_refused_with_the_reason() {
        for (bad, why) in [
            ("", "empty"),
            ("Jobs", "lowercase"),
            ("1jobs", "start"),
            ("jobs\"; drop table x; --", "only lowercase"),
            ("job-queue", "only lowercase"),
            (&"j".repeat(50), "49 bytes"),
        ] {
            let err = TableName::new(bad).unwrap_err();
            assert!(err.to_string().contains(why), "{bad:?}: {err}");
        }
        assert!(TableName::new("j".repeat(49)).is_ok());
    }
}
