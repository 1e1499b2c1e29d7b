//! TLS end to end through the binaries: `keratin serve` with its certificate and key from the
//! environment (`KERATIN_SERVER__TLS_CERT_FILE`, `..._KEY_FILE`), CLI verbs with `--ca`, and
//! SIGHUP: the node reads the files again and new connections get the new certificate, while
//! the node keeps running (SIGHUP's default action would end it).
//! The HTTP admin port serves HTTPS with the same certificate: `keratin status --ca` (which
//! reads the admin port) works, and without `--ca` it fails saying to pass it.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use support::Server;

const BIN: &str = env!("CARGO_BIN_EXE_keratin");

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca(CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA"))
    }

    /// This CA's certificate, and a certificate for 127.0.0.1 with its key, written to `dir`
    /// under `name`.
    fn files(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
        let params = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.0).expect("signed");
        let paths = (
            dir.join(format!("{name}-ca.pem")),
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&paths.0, self.0.pem()).expect("write");
        std::fs::write(&paths.1, cert.pem()).expect("write");
        std::fs::write(&paths.2, key.serialize_pem()).expect("write");
        paths
    }
}

fn cli(server: &Server, ca: Option<&Path>, args: &[&str]) -> (bool, String) {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .args(["--server", &server.protocol.to_string()])
        .env_remove("KERATIN_CA");
    if let Some(ca) = ca {
        command.arg("--ca").arg(ca);
    }
    let output = command.output().expect("run keratin");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn the_cli_speaks_tls_and_sighup_reloads_the_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old_ca, cert, key) = Ca::new("old CA").files(dir.path(), "old");
    let (new_ca, new_cert, new_key) = Ca::new("new CA").files(dir.path(), "new");
    let data = dir.path().join("data");
    let mut command = Command::new(BIN);
    command
        .env("KERATIN_SERVER__TLS_CERT_FILE", &cert)
        .env("KERATIN_SERVER__TLS_KEY_FILE", &key);
    let mut server = Server::start_with(
        command,
        &[
            "serve",
            "--data-dir",
            data.to_str().expect("utf8"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    );

    let (ok, out) = cli(&server, Some(&old_ca), &["queue", "declare", "q"]);
    assert!(ok, "{out}");
    let (ok, out) = cli(
        &server,
        Some(&old_ca),
        &["publish", "q", "--count", "20", "--size", "64"],
    );
    assert!(ok, "{out}");
    let (ok, out) = cli(&server, None, &["queue", "list"]);
    assert!(!ok && out.contains("handshake"), "plaintext to TLS: {out}");
    let (ok, out) = cli(&server, Some(&new_ca), &["queue", "list"]);
    assert!(!ok && out.contains("UnknownIssuer"), "another CA: {out}");

    std::fs::copy(&new_cert, &cert).expect("copy");
    std::fs::copy(&new_key, &key).expect("copy");
    let status = Command::new("kill")
        .args(["-HUP", &server.pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (ok, out) = cli(&server, Some(&new_ca), &["queue", "list"]);
        if ok {
            assert!(out.contains('q'), "{out}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new certificate never served: {out}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (ok, out) = cli(&server, Some(&old_ca), &["queue", "list"]);
    assert!(
        !ok && out.contains("UnknownIssuer"),
        "the old CA after the reload: {out}"
    );
    let (ok, out) = cli(&server, Some(&new_ca), &["consume", "q", "--count", "20"]);
    assert!(ok, "the messages published before the reload: {out}");
    assert!(server.alive(), "SIGHUP did not end the node");
    assert!(server.terminate(Duration::from_secs(10)), "a clean stop");
}

#[test]
fn status_reads_the_admin_port_over_https_with_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = Ca::new("keratin CA").files(dir.path(), "node");
    let data = dir.path().join("data");
    let mut command = Command::new(BIN);
    command
        .env("KERATIN_SERVER__TLS_CERT_FILE", &cert)
        .env("KERATIN_SERVER__TLS_KEY_FILE", &key);
    let mut server = Server::start_with(
        command,
        &[
            "serve",
            "--data-dir",
            data.to_str().expect("utf8"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    );

    let (ok, out) = cli(&server, Some(&ca), &["status", "--json"]);
    assert!(ok, "status over HTTPS: {out}");
    assert!(out.contains("levels") || out.contains("node"), "{out}");
    // Plain HTTP to the HTTPS admin port (the admin address given, so the protocol port's
    // own TLS refusal does not come first): a failure that says to pass --ca.
    let http = server.http.to_string();
    let (ok, out) = cli(&server, None, &["status", "--http", &http]);
    assert!(!ok && out.contains("--ca"), "plain HTTP to HTTPS: {out}");
    let (ok, out) = cli(&server, None, &["status"]);
    assert!(!ok, "status without --ca: {out}");
    assert!(server.terminate(Duration::from_secs(10)), "a clean stop");
}
