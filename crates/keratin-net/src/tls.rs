//! [`ClusterTls`]: mutual TLS on cluster connections (`docs/cluster-protocol.md`, "Transport
//! security"). It reads a node's certificate chain, its key and the cluster's CA from PEM files
//! ([`ClusterTlsFiles`]), and makes the acceptor and the connector every new connection uses:
//! the acceptor requires a client certificate signed by the CA, the connector verifies the
//! peer's certificate against the CA and presents this node's.
//!
//! Naming rule: a node's certificate carries the DNS name [`node_name`] (`node-<id>.keratin`)
//! among its subject alternative names. The dialer asks for `node-<peer id>.keratin` as the TLS
//! server name, so rustls checks it reached the node it meant to, whatever the IP. The listener
//! checks the client certificate against the id the hello claims (`listener.rs`), with
//! [`certificate_names`].
//!
//! [`ClusterTls::reload`] reads the three files again and swaps in a new acceptor and connector:
//! connections made after it use them, open ones keep their session. A reload that fails changes
//! nothing. Handshakes (hello, frames) and what happens on a refusal belong to `listener.rs` and
//! `dialer.rs`; the byte stream over TCP or TLS to `stream.rs`.
//!
//! The ring provider is passed to every builder rather than installed as the process default,
//! so the embedder's choice (keratin-server installs ring too) is neither needed nor changed.
//! TLS 1.3 only: every node of a cluster runs the same build.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use rustls::client::verify_server_name;
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::ClusterTlsFiles;
use crate::{NetError, NodeId};

/// The DNS name a node's certificate must carry: `node-<id>.keratin`.
pub fn node_name(id: NodeId) -> String {
    format!("node-{id}.keratin")
}

/// Whether `certificate` (DER, an end-entity certificate) carries [`node_name`]`(id)` among its
/// subject alternative names. Only the name: the chain was verified by the TLS handshake.
pub fn certificate_names(certificate: &CertificateDer<'_>, id: NodeId) -> bool {
    let Ok(parsed) = ParsedCertificate::try_from(certificate) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(node_name(id)) else {
        return false;
    };
    verify_server_name(&parsed, &name).is_ok()
}

/// Mutual TLS for a [`crate::Transport`] (see the module docs). Cheap to clone: clones share
/// the certificate, and a reload through any of them reaches every connection made after it.
#[derive(Clone)]
pub struct ClusterTls {
    files: Arc<ClusterTlsFiles>,
    current: Arc<RwLock<Endpoints>>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// What new connections use; replaced whole by a reload.
#[derive(Clone)]
struct Endpoints {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    /// This node's certificate (the chain's first), for [`ClusterTls::names`].
    certificate: CertificateDer<'static>,
}

impl ClusterTls {
    /// Reads the three files and makes the acceptor and connector. Fails with
    /// [`NetError::Tls`] naming the file and what is wrong with it.
    pub fn load(files: ClusterTlsFiles) -> Result<ClusterTls, NetError> {
        let endpoints = Endpoints::load(&files)?;
        Ok(ClusterTls {
            files: Arc::new(files),
            current: Arc::new(RwLock::new(endpoints)),
        })
    }

    /// Reads the files again: connections made from now on use what they hold, open ones keep
    /// their session. On an error nothing changes.
    pub fn reload(&self) -> Result<(), NetError> {
        let endpoints = Endpoints::load(&self.files)?;
        // A panic while writing left a whole value in place: overwrite it.
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = endpoints;
        Ok(())
    }

    /// Whether the certificate now in use names node `id` ([`node_name`]). A node whose
    /// certificate does not name its own id is refused by every peer it dials and by every
    /// dialer; the embedder should refuse to start, `Transport::start` logs it at `warn`.
    pub fn names(&self, id: NodeId) -> bool {
        certificate_names(&self.endpoints().certificate, id)
    }

    /// The files this was loaded from.
    pub fn files(&self) -> &ClusterTlsFiles {
        &self.files
    }

    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        self.endpoints().acceptor
    }

    pub(crate) fn connector(&self) -> TlsConnector {
        self.endpoints().connector
    }

    fn endpoints(&self) -> Endpoints {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Endpoints {
    fn load(files: &ClusterTlsFiles) -> Result<Endpoints, NetError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = Arc::new(load_roots(&files.ca_file)?);
        let chain = load_chain(&files.cert_file)?;
        let certificate = chain[0].clone();
        let key = load_key(&files.key_file)?;
        let key_error = |error: rustls::Error| {
            tls_error(
                "key file",
                &files.key_file,
                format!(
                    "{error} (the key must be the certificate's, in PKCS#8, PKCS#1 or SEC1 PEM)"
                ),
            )
        };
        let versions = [&rustls::version::TLS13];
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                .build()
                .map_err(|error| tls_error("CA file", &files.ca_file, error.to_string()))?;
        let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&versions)
            .expect("the ring provider has TLS 1.3 cipher suites and key exchange groups")
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(key_error)?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&versions)
            .expect("the ring provider has TLS 1.3 cipher suites and key exchange groups")
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(key_error)?;
        Ok(Endpoints {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
            certificate,
        })
    }
}

fn load_roots(ca_file: &Path) -> Result<RootCertStore, NetError> {
    let error = |reason: String| tls_error("CA file", ca_file, reason);
    let certificates: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca_file)
        .map_err(|e| error(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| error(e.to_string()))?;
    if certificates.is_empty() {
        return Err(error(
            "no CERTIFICATE block (expected the cluster's CA, PEM)".into(),
        ));
    }
    let mut roots = RootCertStore::empty();
    for certificate in certificates {
        roots
            .add(certificate)
            .map_err(|e| error(format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

fn load_chain(cert_file: &Path) -> Result<Vec<CertificateDer<'static>>, NetError> {
    let error = |reason: String| tls_error("certificate file", cert_file, reason);
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| error(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| error(e.to_string()))?;
    if chain.is_empty() {
        return Err(error(
            "no CERTIFICATE block (expected the PEM chain, this node's certificate first)".into(),
        ));
    }
    Ok(chain)
}

fn load_key(key_file: &Path) -> Result<PrivateKeyDer<'static>, NetError> {
    PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| tls_error("key file", key_file, e.to_string()))
}

fn tls_error(what: &'static str, path: &Path, reason: String) -> NetError {
    NetError::Tls {
        what,
        path: PathBuf::from(path),
        reason,
    }
}
