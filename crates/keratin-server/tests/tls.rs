//! TLS on the protocol port (`server.tls_cert_file`, `server.tls_key_file`), a node in process
//! and the Rust client, with certificates made here (rcgen):
//! - a client that trusts the node's CA publishes and consumes; one that trusts another CA,
//!   and one that speaks plaintext to the TLS port, are refused promptly with a clear error;
//! - an expired certificate is refused by the client;
//! - a reload (what SIGHUP does) gives new connections the new certificate while an open
//!   connection goes on publishing without an error; a reload with a key that does not match
//!   changes nothing.
//!
//! The HTTP admin port serves HTTPS with the same certificate: `/health` answers a client that
//! trusts the CA, plain HTTP gets no HTTP answer, and the same reload reaches it (new
//! connections get the new certificate, a keep-alive connection opened before serves on).

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::{
    Client, ClientError, ClientOptions, ClientTls, OutgoingMessage, QueueSettings,
};
use keratin_server::config::Config;
use keratin_server::Node;
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
};

/// A CA: its certificate (PEM) and what signs with it.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("CA"),
        }
    }

    /// A certificate for 127.0.0.1 and its key, as PEM files in `dir` named `name`.
    fn server_files(&self, dir: &Path, name: &str, expired: bool) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        if expired {
            params.not_before = date_time_ymd(2020, 1, 1);
            params.not_after = date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let (cert_file, key_file) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert_file, cert.pem()).expect("write cert");
        std::fs::write(&key_file, key.serialize_pem()).expect("write key");
        (cert_file, key_file)
    }

    fn ca_file(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&path, self.issuer.pem()).expect("write CA");
        path
    }
}

async fn start(dir: &Path, cert: &Path, key: &Path) -> Node {
    let mut config = Config::default();
    config.storage.dirs = vec![dir.join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    // Anyone may connect: these tests are not about logins (`access.rs` is).
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    config.server.tls_cert_file = Some(cert.to_path_buf());
    config.server.tls_key_file = Some(key.to_path_buf());
    common::host_disk_limits(&mut config);
    Node::start(&config).await.expect("start node")
}

async fn connect(node: &Node, ca_file: Option<&Path>) -> Result<Client, ClientError> {
    let options = ClientOptions {
        tls: ca_file.map(|ca| ClientTls::from_ca_file(ca).expect("CA file")),
        connect_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    };
    Client::connect(node.protocol_addr(), options).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusting_the_ca_is_served_and_others_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, other) = (Ca::new("keratin test CA"), Ca::new("another CA"));
    let (cert, key) = ca.server_files(dir.path(), "node", false);
    let node = start(dir.path(), &cert, &key).await;

    let client = connect(&node, Some(&ca.ca_file(dir.path(), "ca")))
        .await
        .expect("TLS client");
    client
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    client
        .publish("q", OutgoingMessage::new(b"over tls".to_vec()))
        .await
        .expect("publish");
    let mut consumer = client.subscribe("q", 10).await.expect("subscribe");
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.recv())
        .await
        .expect("a delivery in time")
        .expect("a delivery");
    assert_eq!(&delivery.body[..], b"over tls");
    delivery.ack().expect("ack");

    let started = Instant::now();
    let error = connect(&node, Some(&other.ca_file(dir.path(), "other")))
        .await
        .expect_err("another CA");
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");
    let error = connect(&node, None)
        .await
        .expect_err("plaintext to the TLS port");
    assert!(
        error.to_string().contains("handshake"),
        "a plaintext client hears of a failed handshake: {error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused promptly"
    );
    // The node goes on serving the trusted client.
    client
        .publish("q", OutgoingMessage::new(b"still".to_vec()))
        .await
        .expect("publish after the refusals");
    client.close().await;
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("keratin test CA");
    let (cert, key) = ca.server_files(dir.path(), "old", true);
    let node = start(dir.path(), &cert, &key).await;
    let error = connect(&node, Some(&ca.ca_file(dir.path(), "ca")))
        .await
        .expect_err("expired");
    assert!(error.to_string().contains("certificate expired"), "{error}");
    node.shutdown().await.expect("shutdown");
}

/// What SIGHUP does, called directly: new connections get the new certificate (signed by a
/// new CA: a client trusting only the old one is now refused), the connection opened before
/// publishes on without an error throughout, and a reload with a mismatched key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_serves_the_new_certificate_and_drops_no_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old_ca, new_ca) = (Ca::new("old CA"), Ca::new("new CA"));
    let (cert, key) = old_ca.server_files(dir.path(), "node", false);
    let node = start(dir.path(), &cert, &key).await;
    let (old_ca_file, new_ca_file) = (
        old_ca.ca_file(dir.path(), "old"),
        new_ca.ca_file(dir.path(), "new"),
    );
    let client = Arc::new(connect(&node, Some(&old_ca_file)).await.expect("connect"));
    client
        .declare("load", QueueSettings::default())
        .await
        .expect("declare");

    // A publisher that never stops until told, counting confirms and failures.
    let (stop, confirmed, failed) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let publisher = {
        let (client, stop, confirmed, failed) = (
            client.clone(),
            stop.clone(),
            confirmed.clone(),
            failed.clone(),
        );
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                match client
                    .publish("load", OutgoingMessage::new(vec![1u8; 512]))
                    .await
                {
                    Ok(_) => confirmed.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    let wait_for_more = |from: u64| {
        let confirmed = confirmed.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while confirmed.load(Ordering::Relaxed) < from + 50 {
                assert!(Instant::now() < deadline, "publishing stalled");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    wait_for_more(0).await;

    // Swap the files for a certificate from the new CA, and reload.
    let (new_cert, new_key) = new_ca.server_files(dir.path(), "next", false);
    std::fs::copy(&new_cert, &cert).expect("copy cert");
    std::fs::copy(&new_key, &key).expect("copy key");
    assert!(node.reload_tls().expect("reloaded"), "the node serves TLS");
    connect(&node, Some(&new_ca_file))
        .await
        .expect("a new connection gets the new certificate")
        .close()
        .await;
    let error = connect(&node, Some(&old_ca_file))
        .await
        .expect_err("the old CA no longer verifies");
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");
    wait_for_more(confirmed.load(Ordering::Relaxed)).await;

    // A key that is not the certificate's: refused, the served certificate unchanged.
    let (_, stray_key) = new_ca.server_files(dir.path(), "stray", false);
    std::fs::copy(&stray_key, &key).expect("copy key");
    let error = node.reload_tls().expect_err("mismatched key");
    assert!(error.to_string().contains("key"), "{error}");
    connect(&node, Some(&new_ca_file))
        .await
        .expect("still the new certificate")
        .close()
        .await;

    stop.store(true, Ordering::Relaxed);
    publisher.await.expect("publisher");
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "the open connection lost no publish across the reloads"
    );
    assert!(client.is_connected());
    client.close().await;
    node.shutdown().await.expect("shutdown");
}

/// An HTTPS connection to the admin port that trusts only `ca_file`.
async fn https_connect(
    node: &Node,
    ca_file: &Path,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(ca_file).expect("CA file") {
        roots.add(cert.expect("CA cert")).expect("root");
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let stream = tokio::net::TcpStream::connect(node.http_addr()).await?;
    let name = rustls_pki_types::ServerName::IpAddress(node.http_addr().ip().into());
    tokio::time::timeout(Duration::from_secs(5), connector.connect(name, stream))
        .await
        .expect("handshake in time")
}

/// `GET path` on a keep-alive connection: the status line and the body.
async fn http_get<S>(stream: &mut S, path: &str) -> (String, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        assert!(Instant::now() < deadline, "no response head in time");
        let mut chunk = [0u8; 4096];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk))
            .await
            .expect("read in time")
            .expect("read");
        assert!(read > 0, "closed before the response head");
        buf.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().expect("length"))
        })
        .expect("content-length");
    while buf.len() < head_end + length {
        let mut chunk = [0u8; 4096];
        let read = stream.read(&mut chunk).await.expect("read body");
        assert!(read > 0, "closed in the body");
        buf.extend_from_slice(&chunk[..read]);
    }
    let status = head.lines().next().unwrap_or_default().to_string();
    let body = String::from_utf8_lossy(&buf[head_end..head_end + length]).to_string();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_serves_https_and_refuses_plain_http() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("keratin test CA");
    let (cert, key) = ca.server_files(dir.path(), "node", false);
    let node = start(dir.path(), &cert, &key).await;

    let mut https = https_connect(&node, &ca.ca_file(dir.path(), "ca"))
        .await
        .expect("HTTPS handshake");
    let (status, body) = http_get(&mut https, "/health").await;
    assert!(status.contains(" 200 "), "{status}");
    assert!(body.contains("ok"), "{body}");

    // Plain HTTP: the server reads a non-TLS record and closes; no HTTP answer comes back.
    let mut plain = tokio::net::TcpStream::connect(node.http_addr())
        .await
        .expect("connect");
    plain
        .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection promptly");
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plain HTTP got an HTTP answer: {}",
        String::from_utf8_lossy(&answer)
    );

    // The HTTPS port still serves after the failed handshake.
    let (status, _) = http_get(&mut https, "/health").await;
    assert!(status.contains(" 200 "), "{status}");
    drop(https);
    node.shutdown().await.expect("shutdown");
}

/// The protocol port's reload reaches the admin port: a certificate from a new CA is what new
/// HTTPS connections get, and a keep-alive connection made before answers a second request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reaches_the_admin_port_and_keeps_open_connections() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old_ca, new_ca) = (Ca::new("old CA"), Ca::new("new CA"));
    let (cert, key) = old_ca.server_files(dir.path(), "node", false);
    let node = start(dir.path(), &cert, &key).await;
    let (old_ca_file, new_ca_file) = (
        old_ca.ca_file(dir.path(), "old"),
        new_ca.ca_file(dir.path(), "new"),
    );
    let mut before = https_connect(&node, &old_ca_file).await.expect("HTTPS");
    let (status, _) = http_get(&mut before, "/health").await;
    assert!(status.contains(" 200 "), "{status}");

    let (new_cert, new_key) = new_ca.server_files(dir.path(), "next", false);
    std::fs::copy(&new_cert, &cert).expect("copy cert");
    std::fs::copy(&new_key, &key).expect("copy key");
    assert!(node.reload_tls().expect("reloaded"), "the node serves TLS");

    let mut after = https_connect(&node, &new_ca_file)
        .await
        .expect("a new connection gets the new certificate");
    let (status, _) = http_get(&mut after, "/health").await;
    assert!(status.contains(" 200 "), "{status}");
    let error = https_connect(&node, &old_ca_file)
        .await
        .expect_err("the old CA no longer verifies");
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");

    let (status, body) = http_get(&mut before, "/health").await;
    assert!(
        status.contains(" 200 "),
        "the open connection serves on: {status}"
    );
    assert!(body.contains("ok"), "{body}");
    drop((before, after));
    node.shutdown().await.expect("shutdown");
}
