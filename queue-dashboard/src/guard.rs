//! What every answer gets: the host check (against DNS rebinding) and the security headers
//! (no framing, no script, no sniffing, no referrer to other sites).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The authority (`host:port`) of an origin (`scheme://host:port`).
pub(crate) fn authority(origin: &str) -> &str {
    origin.split_once("://").map_or(origin, |(_, rest)| rest)
}

/// Refuses a request whose `Host` is not one of the allowed origins' (when any is set).
pub(crate) async fn hosts(
    State(origins): State<Arc<Vec<String>>>,
    request: Request,
    next: Next,
) -> Response {
    if !origins.is_empty() {
        // Exactly one Host, and one of the dashboard's own.
        let mut hosts = request.headers().get_all(header::HOST).iter();
        let host = match (hosts.next(), hosts.next()) {
            (Some(host), None) => host.to_str().ok().map(str::to_ascii_lowercase),
            _ => None,
        };
        let known = host
            .as_deref()
            .is_some_and(|host| origins.iter().any(|o| authority(o) == host));
        if !known {
            return (
                StatusCode::MISDIRECTED_REQUEST,
                "unknown host: reach the dashboard at the address it was started for\n",
            )
                .into_response();
        }
    }
    next.run(request).await
}

/// The security headers, on every answer.
pub(crate) async fn headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; \
             frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // Not `no-referrer`: with it browsers send `Origin: null` on the dashboard's own forms.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}
