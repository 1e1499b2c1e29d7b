//! TLS to the broker ([`ClientTls`]): the broker's certificate is verified against the CA
//! certificates of a PEM file (not the system's roots: a broker's certificate usually comes
//! from the operator's own CA), for the name the client was given, or else for the IP address
//! it connected to (the certificate then needs that IP among its subject alternative names).
//! A client that logs in by certificate ([`crate::Credentials::Certificate`]) also presents
//! one of its own ([`ClientTls::with_client_cert`]).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;

use crate::ClientError;

/// How a client verifies the broker's certificate, and the certificate it presents, if any.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    /// Kept to build the configuration again with a client certificate.
    roots: Arc<RootCertStore>,
    server_name: Option<ServerName<'static>>,
    has_client_cert: bool,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .field("has_client_cert", &self.has_client_cert)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Trust the CA certificates in the PEM file `ca_file`.
    pub fn from_ca_file(ca_file: &Path) -> Result<ClientTls, ClientError> {
        let bad = |reason: String| ClientError::Tls {
            detail: format!("CA file {}: {reason}", ca_file.display()),
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca_file)
            .map_err(|e| bad(e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| bad(e.to_string()))?;
        if certs.is_empty() {
            return Err(bad("no CERTIFICATE block".into()));
        }
        let mut roots = RootCertStore::empty();
        for cert in certs {
            roots.add(cert).map_err(|e| bad(e.to_string()))?;
        }
        Ok(ClientTls::from_roots(roots))
    }

    /// Trust these roots.
    pub fn from_roots(roots: RootCertStore) -> ClientTls {
        let roots = Arc::new(roots);
        let config = config_builder(&roots).with_no_client_auth();
        ClientTls {
            config: Arc::new(config),
            roots,
            server_name: None,
            has_client_cert: false,
        }
    }

    /// Present the certificate chain of the PEM file `cert_pem_file` (the client's certificate
    /// first) with the private key of `key_pem_file` when the broker asks for one, as it does to
    /// log in by certificate ([`crate::Credentials::Certificate`]).
    pub fn with_client_cert(
        self,
        cert_pem_file: &Path,
        key_pem_file: &Path,
    ) -> Result<ClientTls, ClientError> {
        let bad = |file: &Path, reason: String| ClientError::Tls {
            detail: format!("client certificate {}: {reason}", file.display()),
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_pem_file)
            .map_err(|e| bad(cert_pem_file, e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| bad(cert_pem_file, e.to_string()))?;
        if chain.is_empty() {
            return Err(bad(cert_pem_file, "no CERTIFICATE block".into()));
        }
        let key = PrivateKeyDer::from_pem_file(key_pem_file)
            .map_err(|e| bad(key_pem_file, format!("no usable PRIVATE KEY block: {e}")))?;
        let config = config_builder(&self.roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| {
                bad(
                    key_pem_file,
                    format!("the key does not fit {}: {e}", cert_pem_file.display()),
                )
            })?;
        Ok(ClientTls {
            config: Arc::new(config),
            has_client_cert: true,
            ..self
        })
    }

    /// Whether a client certificate is configured ([`ClientTls::with_client_cert`]).
    pub fn has_client_cert(&self) -> bool {
        self.has_client_cert
    }

    /// Verify the certificate for `name` (a DNS name or an IP address) instead of the IP
    /// address connected to. In a cluster, the client follows leaders to other nodes with the
    /// same name: give one only when every node's certificate carries it.
    pub fn with_server_name(mut self, name: &str) -> Result<ClientTls, ClientError> {
        let name = ServerName::try_from(name.to_owned()).map_err(|e| ClientError::Tls {
            detail: format!("server name {name:?}: {e}"),
        })?;
        self.server_name = Some(name);
        Ok(self)
    }

    /// The name to verify when connecting to `addr`.
    pub(crate) fn name_for(&self, addr: std::net::SocketAddr) -> ServerName<'static> {
        self.server_name
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(addr.ip().into()))
    }

    /// The rustls configuration, for a connection the client does not make itself (the CLI's
    /// blocking requests to the HTTP admin port verify its certificate with the same CA).
    pub fn rustls_config(&self) -> Arc<ClientConfig> {
        self.config.clone()
    }

    pub(crate) fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(self.config.clone())
    }
}

/// A configuration builder that trusts `roots`, before the client-certificate choice.
fn config_builder(
    roots: &Arc<RootCertStore>,
) -> rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(Arc::clone(roots))
}
