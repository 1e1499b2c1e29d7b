//! TLS on the protocol port: the certificate chain and private key come from PEM files
//! (`server.tls_cert_file`, `server.tls_key_file`), and are read again on SIGHUP
//! ([`ServerTls::reload`]): connections made after a reload get the new certificate, open ones
//! keep the session they have. A reload that fails (a missing file, a key that does not match
//! the certificate) changes nothing and says why. rustls with the ring provider; TLS 1.2 and
//! 1.3.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// A certificate or key that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[error("TLS {what} {}: {reason}", path.display())]
pub struct TlsError {
    /// `certificate file` or `key file`.
    pub what: &'static str,
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub reason: String,
}

/// Install ring as the process's rustls provider (once; later calls find it installed).
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The protocol port's TLS: see the module docs.
pub struct ServerTls {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: Arc<CurrentCert>,
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

/// The certificate handed to new connections.
#[derive(Debug)]
struct CurrentCert(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for CurrentCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // A panic while writing left a whole Arc in place: use it.
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

impl ServerTls {
    /// Read the files and make the acceptor.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<ServerTls, TlsError> {
        ServerTls::load_with_client_ca(cert_file, key_file, None)
    }

    /// Like [`ServerTls::load`], and with `client_ca_file` the node asks clients for a
    /// certificate signed by one of its CAs (optional: a client without one still connects,
    /// and logs in some other way); [`peer_common_name`] names a verified one.
    pub fn load_with_client_ca(
        cert_file: &Path,
        key_file: &Path,
        client_ca_file: Option<&Path>,
    ) -> Result<ServerTls, TlsError> {
        install_provider();
        let key = load_certified_key(cert_file, key_file)?;
        let current = Arc::new(CurrentCert(RwLock::new(Arc::new(key))));
        let builder = rustls::ServerConfig::builder();
        let config = match client_ca_file {
            None => builder.with_no_client_auth(),
            Some(ca_file) => builder.with_client_cert_verifier(client_verifier(ca_file)?),
        }
        .with_cert_resolver(current.clone());
        Ok(ServerTls {
            cert_file: cert_file.to_path_buf(),
            key_file: key_file.to_path_buf(),
            current,
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// Read the files again; new connections get what they hold. On an error nothing changes.
    pub fn reload(&self) -> Result<(), TlsError> {
        let key = load_certified_key(&self.cert_file, &self.key_file)?;
        *self.current.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(key);
        Ok(())
    }

    /// What accepts a connection's TLS handshake.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

/// Verifies client certificates against the CAs in `ca_file`; clients without one pass
/// (they log in with a password or token).
fn client_verifier(
    ca_file: &Path,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let error = |reason: String| TlsError {
        what: "client CA file",
        path: ca_file.to_path_buf(),
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca_file).map_err(|e| error(e.to_string()))? {
        roots
            .add(cert.map_err(|e| error(e.to_string()))?)
            .map_err(|e| error(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(error("no CERTIFICATE block".into()));
    }
    rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
        .allow_unauthenticated()
        .build()
        .map_err(|e| error(e.to_string()))
}

/// The subject common name of a verified client certificate (its end-entity, DER), the user
/// a certificate login logs in as.
pub fn peer_common_name(certificate: &[u8]) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate).ok()?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(name)
}

fn load_certified_key(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, TlsError> {
    let cert_error = |reason: String| TlsError {
        what: "certificate file",
        path: cert_file.to_path_buf(),
        reason,
    };
    let key_error = |reason: String| TlsError {
        what: "key file",
        path: key_file.to_path_buf(),
        reason,
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| cert_error(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| cert_error(e.to_string()))?;
    if chain.is_empty() {
        return Err(cert_error(
            "no CERTIFICATE block (expected the PEM chain, server certificate first)".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| key_error(e.to_string()))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map_err(|e| {
        key_error(format!(
            "{e} (the key must be the certificate's, in PKCS#8, PKCS#1 or SEC1 PEM)"
        ))
    })
}
