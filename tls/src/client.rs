//! The client side: one HTTP agent builder, one rustls client
//! configuration for rfaas's own TLS streams, both from the same trust
//! roots, and one URL check.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use ureq::tls::{Certificate, RootCerts, TlsConfig};

use crate::TlsError;

/// The environment variable that names a site CA file in a job (the
/// SPANK plugin sets it from its configuration).
pub const CA_FILE_ENV: &str = "RFAAS_CA_FILE";

/// How an agent is built.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Trust only the CAs in this PEM file instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Each phase of a request (connect, send, receive) is bounded by it.
    pub timeout: Duration,
    /// Connecting is bounded by this instead, when set (to try the next
    /// replica sooner).
    pub connect_timeout: Option<Duration>,
}

impl AgentOptions {
    /// The system's roots, each phase bounded by `timeout`.
    pub fn new(timeout: Duration) -> AgentOptions {
        AgentOptions {
            ca_file: None,
            timeout,
            connect_timeout: None,
        }
    }

    /// Trusts the CAs in `ca_file` (when given) instead of the system's.
    pub fn ca_file(mut self, ca_file: Option<PathBuf>) -> AgentOptions {
        self.ca_file = ca_file;
        self
    }

    /// `ca_file` if given, else the file `RFAAS_CA_FILE` names, if set.
    pub fn ca_file_or_env(self, ca_file: Option<PathBuf>) -> AgentOptions {
        self.ca_file(ca_file.or_else(env_ca_file))
    }
}

/// The file `RFAAS_CA_FILE` names, when it is set and not empty.
pub fn env_ca_file() -> Option<PathBuf> {
    std::env::var_os(CA_FILE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// What a client trusts: the CAs in `ca_file`, or the system's roots. The
/// one place a CA option becomes trust roots, for HTTP ([`agent`]) and
/// for raw TLS streams ([`client_config`]).
fn trust_roots(ca_file: Option<&Path>) -> Result<Arc<Vec<CertificateDer<'static>>>, TlsError> {
    match ca_file {
        Some(path) => read_cas(path),
        None => Ok(system_roots()),
    }
}

/// A rustls client configuration for a TLS stream of rfaas's own (the
/// executor's control port): it trusts the CAs in `ca_file`, or the
/// system's roots, and checks the server's name as the caller gives it to
/// [`rustls::ClientConnection::new`].
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    let roots = trust_roots(ca_file)?;
    let (_added, _unusable) = store.add_parsable_certificates(roots.iter().cloned());
    if store.is_empty() {
        let what = ca_file.map_or_else(
            || "the system's root certificates".to_owned(),
            |p| format!("the CA file {p:?}"),
        );
        return Err(TlsError::Setup(format!(
            "{what} hold no usable CA certificate, so no server can be verified; \
             name the site CA's certificate with {CA_FILE_ENV} or the CA file option"
        )));
    }
    let config = rustls::ClientConfig::builder_with_provider(crate::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(format!("the TLS client cannot be set up: {e}")))?
        .with_root_certificates(store)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// A blocking HTTP agent that speaks `https://` (and plain `http://`
/// where [`manager_url`] let it through): statuses are values, not errors;
/// each phase is bounded (not the whole call: with a global timeout ureq
/// resolves the address on a new thread before every request).
pub fn agent(options: &AgentOptions) -> Result<ureq::Agent, TlsError> {
    let roots = trust_roots(options.ca_file.as_deref())?;
    Ok(build(&roots, options.timeout, options.connect_timeout))
}

/// As [`agent`] with the system's roots, which cannot fail.
pub fn system_agent(timeout: Duration) -> ureq::Agent {
    build(&system_roots(), timeout, None)
}

fn build(
    roots: &[CertificateDer<'static>],
    timeout: Duration,
    connect: Option<Duration>,
) -> ureq::Agent {
    let roots: Vec<Certificate<'static>> = roots
        .iter()
        .map(|c| Certificate::from_der(c.as_ref()).to_owned())
        .collect();
    let roots = Arc::new(roots);
    let tls = TlsConfig::builder()
        .unversioned_rustls_crypto_provider(crate::provider())
        .root_certs(RootCerts::Specific(roots))
        .build();
    let phase = Some(timeout);
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .tls_config(tls)
        .timeout_connect(connect.or(phase))
        .timeout_send_request(phase)
        .timeout_send_body(phase)
        .timeout_recv_response(phase)
        .timeout_recv_body(phase)
        .build()
        .new_agent()
}

/// The CA certificates in the PEM file `path`.
fn read_cas(path: &Path) -> Result<Arc<Vec<CertificateDer<'static>>>, TlsError> {
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        what: "the CA file",
        path: path.to_owned(),
        source,
    })?;
    let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect();
    if cas.is_empty() {
        return Err(TlsError::Content {
            what: "the CA file",
            path: path.to_owned(),
            why: "holds no PEM certificate (-----BEGIN CERTIFICATE-----); name the site CA's certificate file".into(),
        });
    }
    Ok(Arc::new(cas))
}

/// The system's trusted roots, read once per process.
fn system_roots() -> Arc<Vec<CertificateDer<'static>>> {
    static ROOTS: OnceLock<Arc<Vec<CertificateDer<'static>>>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!(error = %e, "a system root certificate could not be read");
            }
            Arc::new(found.certs)
        })
        .clone()
}

/// Whether plain `http://` may go beyond the loopback addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlainHttp {
    /// Only to `127.0.0.0/8`, `::1` and `localhost`.
    #[default]
    LoopbackOnly,
    /// Anywhere: the site said so in its configuration.
    Allowed,
}

/// Checks a manager's base URL and returns it without a trailing slash:
/// `https://host[:port]`, or `http://host[:port]` to a loopback host (or
/// anywhere, when `plain` allows it). A path, a missing host or another
/// scheme is refused with a sentence that says what to write.
pub fn manager_url(url: &str, plain: PlainHttp) -> Result<String, TlsError> {
    let url = url.trim();
    // A trailing slash is dropped, not the ones of an empty `https://`.
    let trimmed = url.trim_end_matches('/');
    let url = if trimmed.contains("://") {
        trimmed
    } else {
        url
    };
    let bad = |why: &str| TlsError::Url(format!("manager URL {url:?} {why}"));
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("has no scheme; write https://host:port"))?;
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) || rest.contains(char::is_whitespace)
    {
        return Err(bad("must be https://host:port, a host and no path"));
    }
    match scheme {
        "https" => Ok(url.to_owned()),
        "http" if plain == PlainHttp::Allowed || is_loopback(rest) => Ok(url.to_owned()),
        "http" => Err(bad(
            "is plain http to a host that is not loopback, which would send credentials in clear; \
             use https:// (with the site CA file if its certificate is not in the system roots), \
             or allow plain http explicitly in the configuration",
        )),
        _ => Err(bad("is neither https:// nor http://")),
    }
}

/// `host` of `host[:port]` (brackets of an IPv6 address removed).
pub fn host_of(authority: &str) -> &str {
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

/// Whether `host[:port]` names a loopback address (`127.0.0.0/8`, `::1`,
/// `localhost`): where plain HTTP may go.
pub fn is_loopback(authority: &str) -> bool {
    let host = host_of(authority);
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_only_to_loopback_unless_allowed() {
        let ok = |u: &str, p| manager_url(u, p).unwrap();
        assert_eq!(
            ok("https://m1:7300/", PlainHttp::LoopbackOnly),
            "https://m1:7300"
        );
        assert_eq!(
            ok("http://127.0.0.5:1", PlainHttp::LoopbackOnly),
            "http://127.0.0.5:1"
        );
        ok("http://localhost:1", PlainHttp::LoopbackOnly);
        ok("http://[::1]:1", PlainHttp::LoopbackOnly);
        ok("http://m1:7300", PlainHttp::Allowed);
        let err = manager_url("http://m1:7300", PlainHttp::LoopbackOnly)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("in clear") && err.contains("https://"),
            "{err}"
        );
        for bad in [
            "m1:7300",
            "ftp://m1",
            "https://",
            "https://m1:7300/v1",
            "http://",
        ] {
            assert!(manager_url(bad, PlainHttp::Allowed).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("rfaas-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let opts = AgentOptions::new(Duration::from_secs(1)).ca_file(Some(path.clone()));
        let err = agent(&opts).unwrap_err().to_string();
        assert!(
            err.contains("empty.pem") && err.contains("no PEM certificate"),
            "{err}"
        );
        let err = agent(&opts.ca_file(Some(dir.join("missing.pem"))))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.pem"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
