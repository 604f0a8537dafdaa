//! The server side: a certificate chain and key from PEM files, served
//! through a resolver whose certificate [`ServerCert::reload`] swaps, so a
//! renewed certificate is taken without closing the listener.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::TlsError;

/// A server certificate that can be reloaded from its files.
#[derive(Debug, Clone)]
pub struct ServerCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: Arc<Current>,
    config: Arc<rustls::ServerConfig>,
}

#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

impl ServerCert {
    /// Reads the chain in `cert_file` (the server's certificate first)
    /// and the key in `key_file` (PKCS#8, PKCS#1 or SEC1 PEM), which must
    /// be private to its owner, root or this process's user
    /// ([`crate::files::check_private_file`]), at start and every reload.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<ServerCert, TlsError> {
        let current = Arc::new(Current(RwLock::new(read(cert_file, key_file)?)));
        let mut config = rustls::ServerConfig::builder_with_provider(crate::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Content {
                what: "the certificate",
                path: cert_file.to_owned(),
                why: e.to_string(),
            })?
            .with_no_client_auth()
            .with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ServerCert {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current,
            config: Arc::new(config),
        })
    }

    /// The configuration new connections are accepted with (it follows
    /// reloads).
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        self.config.clone()
    }

    /// Reads the files again and serves the new certificate to every
    /// connection from now on. On an error the old one stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = read(&self.cert_file, &self.key_file)?;
        *self.current.0.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    /// The certificate and key files.
    pub fn files(&self) -> (&Path, &Path) {
        (&self.cert_file, &self.key_file)
    }
}

fn read(cert_file: &Path, key_file: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let content = |what, path: &Path, why: String| TlsError::Content {
        what,
        path: path.to_owned(),
        why,
    };
    let read = |what, path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            what,
            path: path.to_owned(),
            source,
        })
    };
    crate::files::check_private_file(key_file, "the TLS key file").map_err(TlsError::Unsafe)?;
    let pem = read("the certificate file", cert_file)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            content(
                "the certificate file",
                cert_file,
                format!("is not PEM: {e}"),
            )
        })?;
    if chain.is_empty() {
        return Err(content(
            "the certificate file",
            cert_file,
            "holds no certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    let pem = read("the key file", key_file)?;
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        content(
            "the key file",
            key_file,
            format!("holds no private key in PEM ({e})"),
        )
    })?;
    let key = crate::provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| content("the key file", key_file, format!("is unusable: {e}")))?;
    let certified = CertifiedKey::new(chain, key);
    certified.keys_match().map_err(|e| {
        content(
            "the key file",
            key_file,
            format!("does not belong to the certificate in {cert_file:?}: {e}"),
        )
    })?;
    Ok(Arc::new(certified))
}
