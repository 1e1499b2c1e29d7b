//! TLS to the broker ([`ClientTls`]): the broker's certificate is verified against the CA
//! certificates of a PEM file (not the system's roots: a broker's certificate usually comes
//! from the operator's own CA), for the name the client was given, or else for the IP address
//! it connected to (the certificate then needs that IP among its subject alternative names).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;

use crate::ClientError;

/// How a client verifies the broker's certificate.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
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
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        ClientTls {
            config: Arc::new(config),
            server_name: None,
        }
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

    pub(crate) fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(self.config.clone())
    }
}
