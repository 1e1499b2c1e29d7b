//! A login by certificate: `ClientTls::with_client_cert` loads a PEM certificate chain and key
//! and presents them to a broker that asks for a client certificate, and the hello then says
//! `External`. Files that hold no certificate or no key fail with a `Tls` error naming the
//! file. A client that did not present its certificate fails the broker's TLS handshake here.

mod fake;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::BytesMut;
use keratin_client::{ClientError, ClientOptions, ClientTls, Credentials};
use keratin_proto::{Auth, ClientHello, ServerHello, ServerInfo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

struct Files {
    dir: PathBuf,
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

/// A CA, a certificate for 127.0.0.1 and a client certificate for `bob`, written to a fresh
/// directory under the system's temporary directory.
fn files(test: &str) -> Files {
    let dir = std::env::temp_dir().join(format!("keratin-client-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "test CA");
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA");
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    };
    let signed = |names: Vec<String>, common_name: &str| {
        let mut params = CertificateParams::new(names).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &ca).expect("signed");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = signed(vec!["127.0.0.1".into()], "node");
    let (client_cert, client_key) = signed(Vec::new(), "bob");
    Files {
        dir: dir.clone(),
        ca: write("ca.pem", ca.pem()),
        server_cert: write("node.pem", server_cert),
        server_key: write("node.key", server_key),
        client_cert: write("bob.pem", client_cert),
        client_key: write("bob.key", client_key),
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tls_error(result: Result<ClientTls, ClientError>) -> String {
    match result {
        Err(error @ ClientError::Tls { .. }) => error.to_string(),
        other => panic!("expected a TLS error, got {other:?}"),
    }
}

#[test]
fn client_certificate_files_are_checked() {
    let files = files("files");
    let tls = ClientTls::from_ca_file(&files.ca).expect("CA");
    assert!(!tls.has_client_cert());
    let with_cert = tls
        .clone()
        .with_client_cert(&files.client_cert, &files.client_key)
        .expect("client certificate");
    assert!(with_cert.has_client_cert());

    let error = tls_error(
        tls.clone()
            .with_client_cert(&files.client_key, &files.client_key),
    );
    assert!(
        error.contains("bob.key") && error.contains("no CERTIFICATE"),
        "{error}"
    );
    let error = tls_error(
        tls.clone()
            .with_client_cert(&files.client_cert, &files.client_cert),
    );
    assert!(
        error.contains("bob.pem") && error.contains("PRIVATE KEY"),
        "{error}"
    );
    let missing = Path::new("/nonexistent/bob.key");
    let error = tls_error(tls.with_client_cert(&files.client_cert, missing));
    assert!(error.contains("/nonexistent/bob.key"), "{error}");
}

/// A broker that requires a client certificate from the CA: it sees the client's certificate
/// in the TLS handshake and `External` in the hello.
#[tokio::test]
async fn a_certificate_login_presents_the_client_certificate() {
    let files = files("login");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&files.ca).expect("CA") {
        roots.add(cert.expect("CA")).expect("CA");
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .expect("verifier");
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.server_cert)
        .expect("cert")
        .collect::<Result<_, _>>()
        .expect("cert");
    let key = PrivateKeyDer::from_pem_file(&files.server_key).expect("key");
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let mut stream = acceptor
            .accept(tcp)
            .await
            .expect("the client presents its certificate");
        let presented = stream.get_ref().1.peer_certificates().map_or(0, <[_]>::len);
        let mut buf = BytesMut::new();
        let hello = loop {
            if let Some(hello) = ClientHello::decode(&mut buf).expect("hello") {
                break hello;
            }
            assert_ne!(
                stream.read_buf(&mut buf).await.expect("read"),
                0,
                "eof in hello"
            );
        };
        let mut answer = BytesMut::new();
        ServerHello::Accepted {
            version: hello.version,
            node_id: "tls-node".into(),
            info: ServerInfo::default(),
            user: Some("bob".into()),
        }
        .encode(&mut answer)
        .expect("answer");
        stream.write_all(&answer).await.expect("write");
        // Hold the connection until the client goes.
        let _ = stream.read_buf(&mut buf).await;
        (presented, hello.auth)
    });

    let tls = ClientTls::from_ca_file(&files.ca)
        .expect("CA")
        .with_client_cert(&files.client_cert, &files.client_key)
        .expect("client certificate");
    let options = ClientOptions {
        tls: Some(tls),
        credentials: Some(Credentials::Certificate),
        ..fake::options()
    };
    let client = fake::connect(addr, options).await;
    assert_eq!(client.user(), Some("bob"));
    drop(client);
    let (presented, auth) = tokio::time::timeout(fake::TEST_WAIT, server)
        .await
        .expect("the fake broker ends")
        .expect("fake broker");
    assert_eq!(presented, 1, "the client certificate, without its CA");
    assert_eq!(auth, Auth::External);
}
