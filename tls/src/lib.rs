//! `rfaas-tls`: TLS for the connections that carry credentials, and the
//! files that hold rfaas's keys. TLS protects the manager's REST API
//! (leases, node and job credentials, the admin token) and the executor's
//! control port (lease tokens, allocation requests), never the fabric,
//! whose invocations stay as they are.
//!
//! Layout:
//! - [`client`]: the one HTTP agent every client of the manager uses
//!   (client library, C API, executord, rfaasctl, testkit, bench): rustls
//!   with the ring provider, the system's roots or a site CA file
//!   (`RFAAS_CA_FILE`, `ca_file`, `--ca-file`); and the one check of a
//!   manager URL, which allows plain `http://` only to a loopback address
//!   or when explicitly allowed; and the rustls client configuration, from
//!   the same trust roots, for the executor's control port.
//! - [`server`]: a certificate and key read from PEM files into a rustls
//!   server configuration whose certificate can be reloaded while serving
//!   (the manager's HTTPS port, executord's control port); the key file
//!   must be private to root or the service's user.
//! - [`files`]: the one check of a secret file's (or a trust file's) mode
//!   and owner, for TLS keys, lease keys, credentials and passwords.
//! - [`keys`]: the lease key files, read and written with those checks:
//!   the public keys executord and the accounting service verify lease
//!   tokens and accounting tickets with, and the secret key the manager and
//!   `rfaas-token` sign with.

pub mod client;
pub mod files;
pub mod keys;
pub mod server;

pub use client::{
    agent, client_config, env_ca_file, is_loopback, manager_url, system_agent, AgentOptions,
    PlainHttp, CA_FILE_ENV,
};
pub use server::ServerCert;

use std::path::PathBuf;

/// What went wrong reading certificates, keys or URLs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A certificate, CA or key file could not be read.
    #[error(
        "cannot read {what} {path:?}: {source}; check the path and that this user may read it"
    )]
    Read {
        /// Which file it was meant to be.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file was read but holds nothing usable.
    #[error("{what} {path:?} {why}")]
    Content {
        /// Which file it was meant to be.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A key file whose mode or owner lets others read it (the sentence
    /// says how to fix it).
    #[error("{0}")]
    Unsafe(String),
    /// A TLS client or server cannot be set up as configured.
    #[error("{0}")]
    Setup(String),
    /// A manager URL that is not `https://host[:port]` (or a plain
    /// `http://` one where that is allowed).
    #[error("{0}")]
    Url(String),
}

/// The crypto provider of every TLS connection: ring.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
