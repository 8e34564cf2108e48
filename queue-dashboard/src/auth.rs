//! Optional authentication: a bearer token (scripts) or basic authentication (browsers ask for
//! it themselves), compared in constant time.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;

/// Event: a request came with credentials that did not match (warn).
pub const AUTH_REFUSED: &str = "queue_dashboard.auth_refused";

/// What a request must carry.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// `Authorization: Bearer <token>`.
    Bearer(String),
    /// `Authorization: Basic …` with this user and password.
    Basic {
        /// The user name.
        user: String,
        /// The password.
        password: String,
    },
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print a secret, not even in a debug dump.
        match self {
            Auth::Bearer(_) => f.write_str("Auth::Bearer(***)"),
            Auth::Basic { user, .. } => {
                write!(f, "Auth::Basic {{ user: {user:?}, password: *** }}")
            }
        }
    }
}

impl Auth {
    /// Basic authentication from `user:password`; `None` without a `:` or with an empty user
    /// or password.
    pub fn basic(credentials: &str) -> Option<Auth> {
        let (user, password) = credentials.split_once(':')?;
        (!user.is_empty() && !password.is_empty()).then(|| Auth::Basic {
            user: user.to_owned(),
            password: password.to_owned(),
        })
    }

    fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(given) = authorization.and_then(|v| v.to_str().ok()) else {
            return false;
        };
        match self {
            Auth::Bearer(token) => {
                scheme(given, "bearer").is_some_and(|t| same(t.trim().as_bytes(), token.as_bytes()))
            }
            Auth::Basic { user, password } => {
                let expected = format!("{user}:{password}");
                scheme(given, "basic")
                    .and_then(|b| {
                        base64::engine::general_purpose::STANDARD
                            .decode(b.trim())
                            .ok()
                    })
                    .is_some_and(|decoded| same(&decoded, expected.as_bytes()))
            }
        }
    }
}

/// The credentials after an authentication scheme, whose name is case-insensitive.
fn scheme<'a>(given: &'a str, name: &str) -> Option<&'a str> {
    let (first, rest) = given.trim_start().split_once(' ')?;
    first.eq_ignore_ascii_case(name).then_some(rest)
}

/// Equal, in time that depends on the lengths only.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The middleware: 401 unless the request carries what `auth` asks for.
pub(crate) async fn require(
    State(auth): State<Arc<Auth>>,
    request: Request,
    next: Next,
) -> Response {
    if auth.admits(request.headers().get(header::AUTHORIZATION)) {
        return next.run(request).await;
    }
    if request.headers().contains_key(header::AUTHORIZATION) {
        tracing::warn!(
            name: AUTH_REFUSED,
            path = %request.uri().path(),
            "{AUTH_REFUSED}: wrong credentials"
        );
    }
    let mut response = (StatusCode::UNAUTHORIZED, "authentication required\n").into_response();
    if matches!(*auth, Auth::Basic { .. }) {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"queue dashboard\", charset=\"UTF-8\""),
        );
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_checked_and_never_printed() {
        let bearer = Auth::Bearer("s3cret".into());
        assert!(bearer.admits(Some(&HeaderValue::from_static("Bearer s3cret"))));
        assert!(bearer.admits(Some(&HeaderValue::from_static("bearer s3cret"))));
        assert!(!bearer.admits(Some(&HeaderValue::from_static("Bearer s3cre"))));
        assert!(!bearer.admits(None));
        let basic = Auth::basic("ops:pa:ss").unwrap();
        let header = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("ops:pa:ss")
        );
        assert!(basic.admits(Some(&HeaderValue::from_str(&header).unwrap())));
        assert!(!basic.admits(Some(&HeaderValue::from_static("Basic b3BzOm5v"))));
        assert!(Auth::basic("nopassword").is_none());
        assert!(Auth::basic(":x").is_none());
        for auth in [bearer, basic] {
            let printed = format!("{auth:?}");
            assert!(
                !printed.contains("s3cret") && !printed.contains("pa:ss"),
                "{printed}"
            );
        }
    }
}
