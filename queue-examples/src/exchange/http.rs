//! The HTTP partner adapter: `POST <endpoint>` over HTTP/1.1 or HTTPS (reqwest on rustls with
//! the ring provider), the system's roots plus an optional CA file per partner.
//!
//! Endpoints are validated when the adapter is built (scheme `http` or `https`, a host), so a
//! URL that can never work is refused at start-up, not found out one send at a time. Wherever an
//! endpoint is printed (errors, events, `Debug`) its credentials are left out: see
//! [`PartnerEndpoint`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{CONTENT_TYPE, USER_AGENT};
use url::Url;

use super::{DEFAULT_SEND_TIMEOUT, Partner, SendError, Transmission, events};

/// The header carrying the transmission's idempotency key (its correlation id).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// A diagnostic header: the claim generation of the attempt (changes on every claim).
pub const CLAIM_GENERATION: &str = "x-claim-generation";
/// A diagnostic header: the send job.
pub const SEND_JOB_ID: &str = "x-send-job-id";

/// How long an idle connection to a partner is kept for the next send.
const POOL_IDLE: Duration = Duration::from_secs(30);

/// A partner endpoint that can work: it parses, its scheme is `http` or `https`, it has a host.
///
/// Its `Display` and `Debug` leave out the URL's credentials (`http://user:secret@host/x`
/// prints as `http://host/x`): a partner URL is printed in errors, events and logs, and a
/// secret must never reach them.
#[derive(Clone, PartialEq, Eq)]
pub struct PartnerEndpoint {
    url: Url,
}

impl PartnerEndpoint {
    /// Parses and checks `endpoint`. The error never repeats the input (it may hold a secret).
    pub fn parse(endpoint: &str) -> Result<Self, EndpointError> {
        let url = Url::parse(endpoint).map_err(|e| EndpointError::Unparsable(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(EndpointError::Scheme(url.scheme().to_owned()));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(EndpointError::NoHost);
        }
        Ok(PartnerEndpoint { url })
    }

    /// The URL without its username and password: what may be printed.
    pub fn redacted(&self) -> Url {
        let mut url = self.url.clone();
        // Both only fail for URLs that cannot have credentials, which `parse` refused.
        let _ = url.set_username("");
        let _ = url.set_password(None);
        url
    }

    /// Whether the URL carries a username or a password.
    pub fn has_credentials(&self) -> bool {
        !self.url.username().is_empty() || self.url.password().is_some()
    }

    /// Whether the scheme is `https`.
    pub fn is_https(&self) -> bool {
        self.url.scheme() == "https"
    }
}

impl fmt::Display for PartnerEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.redacted(), f)
    }
}

impl fmt::Debug for PartnerEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PartnerEndpoint({})", self.redacted())
    }
}

/// Why a partner endpoint or its client was refused. No variant repeats the URL as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// The text is not an absolute URL.
    #[error("the URL does not parse ({0})")]
    Unparsable(String),
    /// The scheme is neither `http` nor `https` (`127.0.0.1:9` without a scheme parses as the
    /// scheme `127.0.0.1`, `partner:9` as `partner`).
    #[error("the URL's scheme must be http or https, not {0:?}")]
    Scheme(String),
    /// No host to connect to.
    #[error("the URL has no host")]
    NoHost,
    /// The extra CA file could not be read or holds no PEM certificate.
    #[error("CA file {path}: {reason}")]
    CaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("the HTTP client: {0}")]
    Client(String),
}

/// A partner refused at start-up: its name and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("partner {name:?} refused: {reason}")]
pub struct PartnerConfigError {
    /// The partner's name.
    pub name: String,
    /// Why.
    #[source]
    pub reason: EndpointError,
}

/// A partner reached by `POST <endpoint>` with a JSON body.
#[derive(Clone)]
pub struct HttpPartner {
    endpoint: PartnerEndpoint,
    timeout: Duration,
    user_agent: Option<String>,
    extra_roots: Vec<reqwest::Certificate>,
    ca_file: Option<PathBuf>,
    client: reqwest::Client,
}

impl fmt::Debug for HttpPartner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpPartner")
            .field("endpoint", &self.endpoint)
            .field("timeout", &self.timeout)
            .field("user_agent", &self.user_agent)
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

impl HttpPartner {
    /// A partner at `endpoint` (`http://` or `https://`, checked here) with the default 30 s
    /// send timeout; HTTPS trusts the system's roots (see [`HttpPartner::with_ca_file`]).
    pub fn new(endpoint: &str) -> Result<Self, EndpointError> {
        let endpoint = PartnerEndpoint::parse(endpoint)?;
        let client = build_client(&[])?;
        Ok(HttpPartner {
            endpoint,
            timeout: DEFAULT_SEND_TIMEOUT,
            user_agent: None,
            extra_roots: Vec::new(),
            ca_file: None,
            client,
        })
    }

    /// Builds the partner called `name` at start-up: the endpoint checked, and the CA file,
    /// if any, added to the system's roots. Refusals name the partner.
    pub fn configured(
        name: &str,
        endpoint: &str,
        ca_file: Option<&Path>,
    ) -> Result<Self, PartnerConfigError> {
        let refused = |reason| PartnerConfigError {
            name: name.to_owned(),
            reason,
        };
        let mut partner = HttpPartner::new(endpoint).map_err(refused)?;
        if let Some(path) = ca_file {
            partner = partner.with_ca_file(path).map_err(refused)?;
        }
        Ok(partner)
    }

    /// Also trusts the PEM certificates in `path` (a private CA), on top of the system's roots.
    pub fn with_ca_file(self, path: &Path) -> Result<Self, EndpointError> {
        let ca_error = |reason: String| EndpointError::CaFile {
            path: path.to_owned(),
            reason,
        };
        let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
        let mut partner = self.with_ca_pem(&pem).map_err(|e| match e {
            EndpointError::Client(reason) => ca_error(reason),
            other => other,
        })?;
        partner.ca_file = Some(path.to_owned());
        Ok(partner)
    }

    /// Also trusts the PEM certificates in `pem`, on top of the system's roots.
    pub fn with_ca_pem(mut self, pem: &[u8]) -> Result<Self, EndpointError> {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| EndpointError::Client(error_chain(&e.without_url())))?;
        if certs.is_empty() {
            return Err(EndpointError::Client("no PEM certificate found".into()));
        }
        self.extra_roots.extend(certs);
        self.client = build_client(&self.extra_roots)?;
        Ok(self)
    }

    /// Sets the send timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends this `User-Agent` (the worker names its process, so the partner's records say
    /// which process sent what).
    pub fn with_user_agent(mut self, user_agent: impl Into<String>) -> Self {
        self.user_agent = Some(user_agent.into());
        self
    }

    /// The endpoint (printing it leaves out its credentials).
    pub fn endpoint(&self) -> &PartnerEndpoint {
        &self.endpoint
    }

    async fn post(&self, transmission: Transmission<'_>) -> Result<(), SendError> {
        let body = serde_json::to_vec(transmission.payload)
            .map_err(|e| SendError::Invalid(e.to_string()))?;
        let mut request = self
            .client
            .post(self.endpoint.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(IDEMPOTENCY_KEY, &transmission.payload.correlation_id)
            .header(CLAIM_GENERATION, transmission.generation.to_string())
            .header(SEND_JOB_ID, transmission.job_id.to_string())
            .body(body);
        if let Some(agent) = &self.user_agent {
            request = request.header(USER_AGENT, agent);
        }
        let response = request.send().await.map_err(|e| self.classify(e))?;
        let status = response.status();
        // Read the body so the connection goes back to the pool.
        let _ = response.bytes().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(SendError::Status(status.as_u16()))
        }
    }

    /// Maps a client error to what it says about the send, its text free of the URL.
    fn classify(&self, err: reqwest::Error) -> SendError {
        let refused_tls = is_tls_refusal(&err);
        let (builder, connect) = (err.is_builder(), err.is_connect());
        let detail = format!("{}: {}", self.endpoint, error_chain(&err.without_url()));
        if builder {
            SendError::Invalid(detail)
        } else if refused_tls {
            SendError::Tls(detail)
        } else if connect {
            SendError::Connect(detail)
        } else {
            SendError::Transport(detail)
        }
    }
}

/// Logs a partner as configured, its endpoint without credentials.
pub fn log_configured(name: &str, partner: &HttpPartner) {
    events::partner_configured(
        name,
        partner.endpoint(),
        partner.timeout,
        partner.ca_file.as_deref(),
    );
}

fn build_client(extra_roots: &[reqwest::Certificate]) -> Result<reqwest::Client, EndpointError> {
    install_crypto_provider();
    reqwest::Client::builder()
        .pool_idle_timeout(POOL_IDLE)
        // A redirected POST could reach another party than the one configured.
        .redirect(reqwest::redirect::Policy::none())
        .tls_certs_merge(extra_roots.iter().cloned())
        .build()
        .map_err(|e| EndpointError::Client(error_chain(&e.without_url())))
}

/// rustls needs one crypto provider per process: ring, unless the application installed one.
fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Already installed by the application: theirs is kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The error and its sources, joined with `: `.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Whether the handshake failed because rustls refused the partner (its certificate, its
/// protocol): no retry can change that.
fn is_tls_refusal(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(e) = current {
        if e.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        // `io::Error::source` skips the error it wraps: look at that one too.
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && is_tls_refusal(inner)
        {
            return true;
        }
        current = e.source();
    }
    false
}

#[async_trait]
impl Partner for HttpPartner {
    fn send_timeout(&self) -> Duration {
        self.timeout
    }

    async fn send(&self, transmission: Transmission<'_>) -> Result<(), SendError> {
        tokio::time::timeout(self.timeout, self.post(transmission))
            .await
            .map_err(|_| SendError::Timeout(self.timeout))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_that_can_never_work_are_refused_with_the_reason() {
        assert!(matches!(
            PartnerEndpoint::parse("/transmissions"),
            Err(EndpointError::Unparsable(_))
        ));
        assert!(matches!(
            PartnerEndpoint::parse("127.0.0.1:9"),
            Err(EndpointError::Unparsable(_))
        ));
        assert_eq!(
            PartnerEndpoint::parse("partner:9/x"),
            Err(EndpointError::Scheme("partner".into()))
        );
        assert_eq!(
            PartnerEndpoint::parse("ftp://partner/x"),
            Err(EndpointError::Scheme("ftp".into()))
        );
        assert!(PartnerEndpoint::parse("http://127.0.0.1:9/x").is_ok());
        assert!(PartnerEndpoint::parse("https://partner.example/x").is_ok());
    }

    #[test]
    fn printing_an_endpoint_leaves_out_its_credentials() {
        let endpoint = PartnerEndpoint::parse("https://user:secret@partner.example/x").unwrap();
        assert!(endpoint.has_credentials());
        assert_eq!(endpoint.to_string(), "https://partner.example/x");
        assert!(!format!("{endpoint:?}").contains("secret"));
        assert!(!format!("{endpoint:?}").contains("user"));
        let partner = HttpPartner::new("http://user:secret@127.0.0.1:9/x").unwrap();
        assert!(!format!("{partner:?}").contains("secret"));
        // A refusal does not repeat the input.
        let refused = PartnerEndpoint::parse("nope://user:secret@partner/x").unwrap_err();
        assert!(!refused.to_string().contains("secret"));
    }
}
