//! Certificate logins (issue 16, the protocol's EXTERNAL mechanism): a node with
//! `server.tls_client_ca_file` asks TLS clients for a certificate; a client presenting one
//! signed by that CA logs in as the user its common name names, held to that user's
//! permissions; a certificate naming no user is refused with 401; one from another CA fails
//! the TLS handshake; a client without a certificate still logs in with a password.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use keratin_auth::{PasswordDigest, Pattern, Permissions, UserChange};
use keratin_client::{Client, ClientOptions, ClientTls, Credentials, OutgoingMessage};
use keratin_server::Node;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

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

    /// A certificate with `sans` and common name `name`, with its key, as PEM files in `dir`.
    fn files(&self, dir: &Path, name: &str, sans: Vec<String>) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(sans).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
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

fn options(tls: ClientTls, credentials: Credentials) -> ClientOptions {
    ClientOptions {
        name: "certificate-login".into(),
        tls: Some(tls),
        credentials: Some(credentials),
        connect_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_as_the_user_it_names() {
    let dir = tempfile::tempdir().expect("tmp");
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    let ca = Ca::new("keratin test CA");
    let ca_file = ca.ca_file(&certs, "keratin");
    let (server_cert, server_key) = ca.files(&certs, "server", vec!["127.0.0.1".into()]);
    let (app_cert, app_key) = ca.files(&certs, "app", Vec::new());
    let (ghost_cert, ghost_key) = ca.files(&certs, "ghost", Vec::new());
    let other = Ca::new("another CA");
    let (forged_cert, forged_key) = other.files(&certs, "forged-app", Vec::new());

    let mut config = common::node_config(dir.path());
    config.server.auth = keratin_server::access::AuthMode::Users;
    config.server.tls_cert_file = Some(server_cert);
    config.server.tls_key_file = Some(server_key);
    config.server.tls_client_ca_file = Some(ca_file.clone());
    let node = Node::start(&config).await.expect("start");
    let access = node.access();
    access
        .change(UserChange::Add {
            name: "app".into(),
            password: PasswordDigest::hash("app-password-1").expect("hash"),
            admin: false,
        })
        .await
        .expect("user");
    access
        .change(UserChange::Grant {
            name: "app".into(),
            pattern: Pattern::new("orders").expect("pattern"),
            permissions: Permissions::parse("publish").expect("permissions"),
        })
        .await
        .expect("grant");
    node.broker()
        .declare("orders", keratin_broker::QueueSettings::default())
        .await
        .expect("declare");
    let addr = node.protocol_addr();
    let trusting = || ClientTls::from_ca_file(&ca_file).expect("client TLS");

    // The certificate names app: logged in as app, held to app's permissions.
    let tls = trusting()
        .with_client_cert(&app_cert, &app_key)
        .expect("client cert");
    let app = Client::connect(addr, options(tls, Credentials::Certificate))
        .await
        .expect("a certificate login");
    assert_eq!(app.user(), Some("app"));
    app.publish("orders", OutgoingMessage::new(&b"by certificate"[..]))
        .await
        .expect("publish where app may");
    let refused = app
        .declare("other", keratin_client::QueueSettings::default())
        .await;
    assert_eq!(refused.err().and_then(|e| e.code()), Some(403));
    app.close().await;

    // A certificate that names no user: 401.
    let tls = trusting()
        .with_client_cert(&ghost_cert, &ghost_key)
        .expect("client cert");
    let ghost = Client::connect(addr, options(tls, Credentials::Certificate)).await;
    let error = ghost.expect_err("no user ghost");
    assert_eq!(error.code(), Some(401), "{error}");

    // A certificate from another CA fails the TLS handshake: no login happens.
    let tls = trusting()
        .with_client_cert(&forged_cert, &forged_key)
        .expect("client cert");
    let forged = Client::connect(addr, options(tls, Credentials::Certificate)).await;
    let error = forged.expect_err("a certificate from another CA");
    assert_eq!(
        error.code(),
        None,
        "refused by TLS, not by a login: {error}"
    );

    // No certificate: a password login still works; a certificate login without one is 401.
    let by_password = Client::connect(
        addr,
        options(
            trusting(),
            Credentials::Password {
                user: "app".into(),
                password: "app-password-1".into(),
            },
        ),
    )
    .await
    .expect("a password login over TLS without a client certificate");
    assert_eq!(by_password.user(), Some("app"));
    by_password.close().await;
    node.shutdown().await.expect("shutdown");
}
