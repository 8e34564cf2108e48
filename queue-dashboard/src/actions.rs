//! The operator's actions: POST forms, refused unless actions are allowed, the form carries the
//! process's CSRF token and the request comes from the dashboard's own origin. Each goes
//! through the admin API with the hooks, then redirects back (Post/Redirect/Get) with a notice.

use axum::Form;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use queue_core::{
    Admin, CancelOutcome, JobFilter, JobId, JobStatus, QueueName, RetryTarget, cancel_with_hooks,
    retry_with_hooks,
};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::Shared;
use crate::auth::same;
use crate::pages::{PageError, queue_named};

/// A fresh CSRF token: 32 random bytes, hex.
pub(crate) fn new_token() -> String {
    random_hex::<32>()
}

/// `N` random bytes from the operating system, hex.
pub(crate) fn random_hex<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    // Without the operating system's randomness, no token could be trusted: fail loudly.
    getrandom::fill(&mut bytes).expect("the operating system's random numbers");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What every action's form carries.
#[derive(Debug, Deserialize)]
pub(crate) struct ActionForm {
    csrf: String,
    back: Option<String>,
    queue: Option<String>,
    seen: Option<String>,
    /// A schedule's name (forget a schedule).
    name: Option<String>,
}

/// Refuses an action that is not allowed, has no valid token, or comes from another origin.
fn check<B: Admin, P>(
    d: &Shared<B, P>,
    headers: &HeaderMap,
    form: &ActionForm,
) -> Result<(), (StatusCode, &'static str)> {
    if !d.config.allow_actions {
        return Err((StatusCode::FORBIDDEN, "this dashboard is read-only\n"));
    }
    if !same(form.csrf.as_bytes(), d.csrf.as_bytes()) {
        return Err((
            StatusCode::FORBIDDEN,
            "the form's token does not match: reload the page\n",
        ));
    }
    // A browser names the page's origin on a POST: it must be the dashboard's own, one of
    // the allowed origins exactly, or (when none is set) the request's own host.
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or_default().to_ascii_lowercase();
        let allowed = &d.config.allowed_origins;
        let same = if allowed.is_empty() {
            headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .is_some_and(|host| crate::guard::authority(&origin) == host.to_ascii_lowercase())
        } else {
            allowed.contains(&origin)
        };
        if !same {
            return Err((StatusCode::FORBIDDEN, "cross-origin request refused\n"));
        }
    }
    Ok(())
}

/// Where to go back to (a path inside the dashboard, or its overview), with the action's
/// result as a flash: kept on the server under a random key, so that no text an attacker could
/// put in a link is ever shown as the dashboard's own.
fn back_to<B: Admin, P>(d: &Shared<B, P>, back: Option<&str>, notice: &str) -> Response {
    let base = d.href("/");
    let back = back.filter(|b| d.is_inside(b)).unwrap_or(&base);
    let (path, query) = back.split_once('?').unwrap_or((back, ""));
    let mut parts: Vec<String> = query
        .split('&')
        .filter(|part| !part.is_empty() && !part.starts_with("flash="))
        .map(str::to_owned)
        .collect();
    parts.push(format!("flash={}", d.flashes.put(notice)));
    Redirect::to(&format!("{path}?{}", parts.join("&"))).into_response()
}

pub(crate) async fn retry<B, P>(
    State(d): State<Shared<B, P>>,
    Path(id): Path<i64>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response
where
    B: Admin,
    P: DeserializeOwned + Send + Sync + 'static,
{
    if let Err(refused) = check(&d, &headers, &form) {
        return refused.into_response();
    }
    let queue = match queue_named(&d, form.queue.as_deref()) {
        Ok(queue) => queue,
        Err(err) => return err.into_response(),
    };
    let Some(seen) = form.seen.as_deref().and_then(JobStatus::parse) else {
        return PageError::bad_request("the form names no state the job was seen in")
            .into_response();
    };
    let notice = match retry_with_hooks(&queue, &d.hooks, JobId(id), seen).await {
        Ok(RetryTarget::Retried(_)) => format!("job {id} retried: pending again"),
        Ok(RetryTarget::NotFound) => format!("job {id} not found"),
        Ok(RetryTarget::WrongState(now)) => {
            format!("job {id} not retried: it is {} now", now.as_str())
        }
        Err(queue_core::Error::Hook { hook, source }) => {
            format!("job {id} not retried: {hook} refused: {source}")
        }
        Err(err) => return PageError::from(err).into_response(),
    };
    back_to(&d, form.back.as_deref(), &notice)
}

pub(crate) async fn cancel<B, P>(
    State(d): State<Shared<B, P>>,
    Path(id): Path<i64>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response
where
    B: Admin,
    P: DeserializeOwned + Send + Sync + 'static,
{
    if let Err(refused) = check(&d, &headers, &form) {
        return refused.into_response();
    }
    let queue = match queue_named(&d, form.queue.as_deref()) {
        Ok(queue) => queue,
        Err(err) => return err.into_response(),
    };
    let notice = match cancel_with_hooks(&queue, &d.hooks, JobId(id)).await {
        Ok(CancelOutcome::Cancelled) => format!("job {id} cancelled"),
        Ok(CancelOutcome::Requested) => {
            format!("job {id} is running: its worker was asked to cancel it")
        }
        Ok(CancelOutcome::AlreadyTerminal(status)) => {
            format!("job {id} not cancelled: it is {} already", status.as_str())
        }
        Ok(CancelOutcome::NotFound) => format!("job {id} not found"),
        Err(queue_core::Error::Hook { hook, source }) => {
            format!("job {id} not cancelled: {hook} refused: {source}")
        }
        Err(err) => return PageError::from(err).into_response(),
    };
    back_to(&d, form.back.as_deref(), &notice)
}

pub(crate) async fn retry_dead<B, P>(
    State(d): State<Shared<B, P>>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response
where
    B: Admin,
    P: DeserializeOwned + Send + Sync + 'static,
{
    if let Err(refused) = check(&d, &headers, &form) {
        return refused.into_response();
    }
    let queue = match QueueName::new(queue) {
        Ok(name) => d.queue.for_queue(name),
        Err(err) => return PageError::bad_request(err.to_string()).into_response(),
    };
    let (mut retried, mut moved_on, mut refused) = (0u64, 0u64, 0u64);
    let page = match queue
        .list_jobs(
            &JobFilter::new()
                .status(JobStatus::Dead)
                .limit(crate::pages::BULK_RETRY_MOST),
        )
        .await
    {
        Ok(page) => page,
        Err(err) => return PageError::from(err).into_response(),
    };
    for job in &page.jobs {
        match retry_with_hooks(&queue, &d.hooks, job.id, JobStatus::Dead).await {
            Ok(RetryTarget::Retried(_)) => retried += 1,
            // Retried by someone else meanwhile, or gone.
            Ok(_) => moved_on += 1,
            Err(queue_core::Error::Hook { .. }) => refused += 1,
            Err(err) => return PageError::from(err).into_response(),
        }
    }
    let more = if page.next.is_some() {
        "; more remain: press again"
    } else {
        ""
    };
    let notice = format!(
        "{retried} dead jobs of {} retried, {moved_on} had moved on, {refused} refused by a hook{more}",
        queue.queue().as_str()
    );
    back_to(&d, form.back.as_deref(), &notice)
}

/// Forgets a schedule's record ([`Admin::forget_schedule`]); a scheduler that still runs it
/// records it again at its next pass.
pub(crate) async fn forget_schedule<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(refused) = check(&d, &headers, &form) {
        return refused.into_response();
    }
    let queue = match QueueName::new(queue) {
        Ok(name) => d.queue.for_queue(name),
        Err(err) => return PageError::bad_request(err.to_string()).into_response(),
    };
    let Some(name) = form.name.as_deref().filter(|n| !n.is_empty()) else {
        return PageError::bad_request("the form names no schedule").into_response();
    };
    let notice = match queue.forget_schedule(name).await {
        Ok(true) => format!(
            "schedule {name} of {} forgotten (a scheduler that still runs it records it again)",
            queue.queue().as_str()
        ),
        Ok(false) => format!(
            "schedule {name} of {} was not recorded (forgotten already?)",
            queue.queue().as_str()
        ),
        Err(err) => return PageError::from(err).into_response(),
    };
    back_to(&d, form.back.as_deref(), &notice)
}

pub(crate) async fn pause<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    set_paused(d, queue, headers, form, true).await
}

pub(crate) async fn resume<B: Admin, P>(
    State(d): State<Shared<B, P>>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    set_paused(d, queue, headers, form, false).await
}

async fn set_paused<B: Admin, P>(
    d: Shared<B, P>,
    queue: String,
    headers: HeaderMap,
    form: ActionForm,
    paused: bool,
) -> Response {
    if let Err(refused) = check(&d, &headers, &form) {
        return refused.into_response();
    }
    let queue = match QueueName::new(queue) {
        Ok(name) => d.queue.for_queue(name),
        Err(err) => return PageError::bad_request(err.to_string()).into_response(),
    };
    // Only a queue the dashboard shows: a typed URL must not pause a queue nobody serves.
    let known = match d.queue.queues().await {
        Ok(names) => names.contains(queue.queue()) || queue.queue() == d.queue.queue(),
        Err(err) => return PageError::from(err).into_response(),
    };
    if !known {
        return PageError::not_found(format!("no queue {}", queue.queue().as_str()))
            .into_response();
    }
    let result = if paused {
        queue.pause().await
    } else {
        queue.resume().await
    };
    match result {
        Ok(_) => {
            let verb = if paused { "paused" } else { "resumed" };
            back_to(
                &d,
                form.back.as_deref(),
                &format!("queue {} {verb}", queue.queue().as_str()),
            )
        }
        Err(err) => PageError::from(err).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_long() {
        let (a, b) = (new_token(), new_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
