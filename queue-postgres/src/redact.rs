//! Database URLs without their secrets, for everything that prints one.

use std::borrow::Cow;

/// What stands in for a redacted secret.
pub const REDACTED: &str = "***";

/// `url` as it may be printed: the user information of a URL
/// (`postgres://user:secret@host/db` → `postgres://***@host/db`) and every `password` or
/// `sslpassword` value, as a URL query parameter or a `key=value` connection string
/// (`host=db password=secret` → `host=db password=***`), replaced by [`REDACTED`].
///
/// ```
/// use queue_postgres::redact_url;
///
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/app"), "postgres://***@db:5432/app");
/// assert_eq!(redact_url("host=db password='s3 cret' user=app"), "host=db password=*** user=app");
/// ```
pub fn redact_url(url: &str) -> Cow<'_, str> {
    let mut out = match url.split_once("://") {
        Some((scheme, rest)) => {
            // The user information ends at the last '@': a password may hold '@', '/', '?'
            // or '#' (which a URL parser would take for the end of the authority). An '@' in
            // the path or the query hides the host too: better too much than a password.
            match rest.rfind('@') {
                Some(at) => Cow::Owned(format!("{scheme}://{REDACTED}{}", &rest[at..])),
                None => Cow::Borrowed(url),
            }
        }
        None => Cow::Borrowed(url),
    };
    for key in ["password", "sslpassword"] {
        if let Some(redacted) = redact_values(&out, key) {
            out = Cow::Owned(redacted);
        }
    }
    out
}

/// Replaces the value of every `key=value` (key at a word start: after the start, a space, `?`
/// or `&`); a value ends at `&` or a space, or is a single-quoted string with `\'` escapes.
fn redact_values(text: &str, key: &str) -> Option<String> {
    let pattern = format!("{key}=");
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut changed = false;
    while let Some(found) = rest.find(&pattern) {
        let at_word_start = found == 0 || rest[..found].ends_with([' ', '?', '&']);
        let value_start = found + pattern.len();
        out.push_str(&rest[..value_start]);
        rest = &rest[value_start..];
        if !at_word_start {
            continue;
        }
        let value_len = if let Some(quoted) = rest.strip_prefix('\'') {
            let mut escaped = false;
            let close = quoted
                .char_indices()
                .find(|&(_, c)| {
                    let closes = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                })
                .map_or(quoted.len(), |(i, _)| i + 1);
            1 + close
        } else {
            rest.find(['&', ' ']).unwrap_or(rest.len())
        };
        out.push_str(REDACTED);
        rest = &rest[value_len..];
        changed = true;
    }
    out.push_str(rest);
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_secret_of_a_database_url_survives() {
        for (url, expected) in [
            ("postgres://app:s3cret@db/app", "postgres://***@db/app"),
            ("postgres://app@db/app", "postgres://***@db/app"),
            ("postgresql://a:p@ss@db:5432", "postgresql://***@db:5432"),
            (
                "postgres://db/app?password=s3cret&sslmode=require",
                "postgres://db/app?password=***&sslmode=require",
            ),
            (
                "postgres://db/app?sslmode=require&sslpassword=s3cret",
                "postgres://db/app?sslmode=require&sslpassword=***",
            ),
            (
                "host=db user=app password=s3cret dbname=app",
                "host=db user=app password=*** dbname=app",
            ),
            ("password='s3 \\' cret' host=db", "password=*** host=db"),
            ("postgres://db/app", "postgres://db/app"),
            ("postgres://ops:12#34@db/q", "postgres://***@db/q"),
            ("postgres://ops:p?w@db/q", "postgres://***@db/q"),
            ("postgres://ops:p/w@db/q", "postgres://***@db/q"),
            (
                "postgres://ops:a@b#c@db:5432/q?sslmode=require",
                "postgres://***@db:5432/q?sslmode=require",
            ),
            ("host=db mypassword=x", "host=db mypassword=x"),
        ] {
            assert_eq!(redact_url(url), expected, "{url}");
        }
    }
}
