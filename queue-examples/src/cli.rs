//! A small `--name value` / `--flag` parser for the example binaries (no dependency needed for
//! a handful of flags).

use std::collections::HashMap;
use std::str::FromStr;

/// A refused command line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgsError {
    /// A flag the binary does not know.
    #[error("unknown flag --{0} (try --help)")]
    Unknown(String),
    /// A value that does not parse.
    #[error("--{flag}: {value:?} is not a valid value ({reason})")]
    Invalid {
        /// The flag.
        flag: String,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// A bare argument where a flag was expected.
    #[error("unexpected argument {0:?} (flags look like --name value)")]
    Positional(String),
}

/// Parsed flags: `--name value`, `--name=value`, or `--flag` alone (value `"true"`). A flag may
/// repeat; [`Args::all`] returns every value.
#[derive(Debug, Default)]
pub struct Args {
    values: HashMap<String, Vec<String>>,
}

impl Args {
    /// Parses `args` (without the program name), accepting only the flags in `known`.
    pub fn parse(
        args: impl IntoIterator<Item = String>,
        known: &[&str],
    ) -> Result<Args, ArgsError> {
        let mut values: HashMap<String, Vec<String>> = HashMap::new();
        let mut args = args.into_iter().peekable();
        while let Some(arg) = args.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(ArgsError::Positional(arg));
            };
            let (name, value) = match flag.split_once('=') {
                Some((name, value)) => (name.to_owned(), value.to_owned()),
                None => {
                    let value = match args.peek() {
                        Some(next) if !next.starts_with("--") => args.next().unwrap_or_default(),
                        _ => "true".to_owned(),
                    };
                    (flag.to_owned(), value)
                }
            };
            if !known.contains(&name.as_str()) {
                return Err(ArgsError::Unknown(name));
            }
            values.entry(name).or_default().push(value);
        }
        Ok(Args { values })
    }

    /// The last value of `flag`, parsed; `default` when absent.
    pub fn get<T>(&self, flag: &str, default: T) -> Result<T, ArgsError>
    where
        T: FromStr,
        T::Err: std::fmt::Display,
    {
        match self.values.get(flag).and_then(|v| v.last()) {
            None => Ok(default),
            Some(value) => value.parse().map_err(|e: T::Err| ArgsError::Invalid {
                flag: flag.to_owned(),
                value: value.clone(),
                reason: e.to_string(),
            }),
        }
    }

    /// The last value of `flag`, if given.
    pub fn opt(&self, flag: &str) -> Option<&str> {
        self.values
            .get(flag)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    /// Every value of a repeated flag.
    pub fn all(&self, flag: &str) -> &[String] {
        self.values.get(flag).map(Vec::as_slice).unwrap_or_default()
    }

    /// Whether a flag was given.
    pub fn has(&self, flag: &str) -> bool {
        self.values.contains_key(flag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Args, ArgsError> {
        Args::parse(
            line.split_whitespace().map(str::to_owned),
            &["jobs", "keep", "partner"],
        )
    }

    #[test]
    fn flags_values_and_errors() {
        let args = parse("--jobs 10 --keep --partner a=x --partner=b=y").unwrap();
        assert_eq!(args.get("jobs", 0usize).unwrap(), 10);
        assert!(args.has("keep"));
        assert_eq!(args.all("partner"), ["a=x", "b=y"]);
        assert_eq!(args.get("missing", 7u32).unwrap(), 7);
        assert!(matches!(parse("--nope 1"), Err(ArgsError::Unknown(_))));
        assert!(matches!(parse("stray"), Err(ArgsError::Positional(_))));
        let bad = parse("--jobs many")
            .unwrap()
            .get("jobs", 0usize)
            .unwrap_err();
        assert!(bad.to_string().contains("--jobs"));
    }
}
