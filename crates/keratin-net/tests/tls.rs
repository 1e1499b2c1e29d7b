//! Mutual TLS between nodes (`cluster.tls_*`, `docs/cluster-protocol.md`, "Transport security"),
//! with certificates made here (rcgen) and nodes on 127.0.0.1:
//! - three nodes whose certificates come from one CA connect and calls round-trip every way;
//! - a certificate from another CA is refused by the dialer (the acceptor's) and by the acceptor
//!   (the dialer's);
//! - a node holding node 2's certificate cannot claim to be node 3, as dialer or as acceptor;
//! - a plaintext node and a TLS node never connect, either way round, and the dialer keeps
//!   retrying;
//! - a reload gives new connections the new certificate while the open connection keeps
//!   serving calls, and a failed reload changes nothing.
//!
//! A failure shows as a pair that connects when it should not (a hole in verification), or one
//! that does not connect or stops answering when it should (a broken handshake or reload).

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use common::{bind, cluster, fast_options, within, Echo, SECOND};
use keratin_net::{
    ClusterTls, ClusterTlsFiles, GroupId, NetError, NodeId, Transport, TransportOptions,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use tokio::net::TcpListener;

/// A CA: its certificate and what signs with it.
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

    /// Writes a node certificate naming `dns_names` (for both TLS roles), its key and this CA
    /// into `dir`, with file names starting `stem`; returns the three paths.
    fn node_files(&self, dir: &Path, stem: &str, dns_names: &[&str]) -> ClusterTlsFiles {
        let names: Vec<String> = dns_names.iter().map(|name| name.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("params");
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let files = ClusterTlsFiles {
            cert_file: dir.join(format!("{stem}.pem")),
            key_file: dir.join(format!("{stem}.key")),
            ca_file: dir.join(format!("{stem}-ca.pem")),
        };
        std::fs::write(&files.cert_file, cert.pem()).expect("write cert");
        std::fs::write(&files.key_file, key.serialize_pem()).expect("write key");
        std::fs::write(&files.ca_file, self.issuer.pem()).expect("write CA");
        files
    }

    /// [`Ca::node_files`] for node `id` with its proper name, loaded.
    fn node(&self, dir: &Path, id: NodeId) -> ClusterTls {
        let name = format!("node-{id}.keratin");
        let files = self.node_files(dir, &format!("node-{id}"), &[&name]);
        ClusterTls::load(files).expect("load TLS")
    }
}

fn options(tls: Option<ClusterTls>) -> TransportOptions {
    TransportOptions {
        tls,
        ..fast_options()
    }
}

/// Listeners for `ids`, bound first so every address is known.
async fn bind_nodes(ids: &[NodeId]) -> (Vec<TcpListener>, Vec<(NodeId, SocketAddr)>) {
    let mut listeners = Vec::new();
    let mut nodes = Vec::new();
    for &id in ids {
        let listener = bind().await;
        nodes.push((id, listener.local_addr().expect("addr")));
        listeners.push(listener);
    }
    (listeners, nodes)
}

fn start(
    listener: TcpListener,
    id: NodeId,
    nodes: &[(NodeId, SocketAddr)],
    tls: Option<ClusterTls>,
) -> Transport {
    Transport::start_on(
        listener,
        cluster(id, nodes, "tls"),
        options(tls),
        Echo::new(id),
    )
    .expect("start")
}

async fn call(from: &Transport, to: NodeId, body: &'static str) -> Result<Bytes, NetError> {
    from.call(to, GroupId(7), 1, Bytes::from(body), 2 * SECOND)
        .await
}

/// Asserts `from` never gets a connection to `to` for `window`, and returns `to`'s last error
/// as `from` sees it.
async fn never_connects(from: &Transport, to: NodeId, window: Duration) -> String {
    let result = from.wait_connected(to, window).await;
    assert!(
        result.is_err(),
        "node {} connected to node {to}",
        from.node_id()
    );
    assert!(matches!(
        call(from, to, "x").await,
        Err(NetError::Unreachable { .. })
    ));
    from.peer_status(to)
        .and_then(|status| status.last_error)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_with_one_ca_call_each_other() {
    within(20 * SECOND, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::new("cluster CA");
        let (mut listeners, nodes) = bind_nodes(&[1, 2, 3]).await;
        let transports: Vec<Transport> = [1, 2, 3]
            .into_iter()
            .zip(listeners.drain(..))
            .map(|(id, listener)| start(listener, id, &nodes, Some(ca.node(dir.path(), id))))
            .collect();
        for from in &transports {
            for to in [1, 2, 3] {
                if to == from.node_id() {
                    continue;
                }
                from.wait_connected(to, 5 * SECOND)
                    .await
                    .expect("connected");
                let reply = call(from, to, "hi").await.expect("call");
                assert_eq!(reply, format!("{to}<-{}:7:1:hi", from.node_id()));
            }
        }
        assert_eq!(transports[2].stats().tls_handshakes_failed, 0);
        assert_eq!(transports[2].stats().handshakes_refused, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused_both_ways() {
    within(20 * SECOND, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let (ours, theirs) = (Ca::new("cluster CA"), Ca::new("another CA"));
        let trust_ours = |files: ClusterTlsFiles| ClusterTlsFiles {
            ca_file: dir.path().join("node-1-ca.pem"),
            ..files
        };

        // The acceptor's certificate is from another CA: the dialer refuses it.
        let (mut listeners, nodes) = bind_nodes(&[1, 2]).await;
        let one = ours.node(dir.path(), 1);
        let two_files = trust_ours(theirs.node_files(dir.path(), "two", &["node-2.keratin"]));
        let two = ClusterTls::load(two_files).expect("load");
        let t1 = start(listeners.remove(0), 1, &nodes, Some(one.clone()));
        let t2 = start(listeners.remove(0), 2, &nodes, Some(two));
        let error = never_connects(&t1, 2, SECOND).await;
        assert!(error.contains("TLS handshake with node 2"), "{error}");
        assert!(error.contains("UnknownIssuer"), "{error}");
        assert!(t2.stats().tls_handshakes_failed >= 1);
        drop((t1, t2));

        // The dialer's certificate is from another CA: the acceptor refuses it.
        let (mut listeners, nodes) = bind_nodes(&[1, 2]).await;
        let one_files = trust_ours(theirs.node_files(dir.path(), "one", &["node-1.keratin"]));
        let one_foreign = ClusterTls::load(one_files).expect("load");
        let two = ours.node(dir.path(), 2);
        let t1 = start(listeners.remove(0), 1, &nodes, Some(one_foreign));
        let t2 = start(listeners.remove(0), 2, &nodes, Some(two));
        let error = never_connects(&t1, 2, SECOND).await;
        assert!(error.contains("handshake with node 2"), "{error}");
        assert!(t2.stats().tls_handshakes_failed >= 1);
        assert_eq!(
            t2.stats().handshakes_refused,
            0,
            "refused by TLS, before any hello"
        );
        let _ = one;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_node_2s_certificate_cannot_be_node_3() {
    within(20 * SECOND, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::new("cluster CA");
        let impostor = || {
            let files = ca.node_files(dir.path(), "impostor", &["node-2.keratin"]);
            let tls = ClusterTls::load(files).expect("load");
            assert!(tls.names(2) && !tls.names(3));
            tls
        };

        // As the dialer: node 4's listener reads node 3's hello, then finds the certificate
        // names node 2. Node 2 is listed (never started), so the refusal can name it.
        let (mut listeners, nodes) = bind_nodes(&[2, 3, 4]).await;
        drop(listeners.remove(0));
        let t3 = start(listeners.remove(0), 3, &nodes, Some(impostor()));
        let t4 = start(listeners.remove(0), 4, &nodes, Some(ca.node(dir.path(), 4)));
        let error = never_connects(&t3, 4, SECOND).await;
        assert!(error.contains("node 4 refused the handshake"), "{error}");
        assert!(error.contains("code 16"), "{error}");
        assert!(error.contains("claims to be node 3"), "{error}");
        assert!(error.contains("node 2 (node-2.keratin)"), "{error}");
        assert!(t4.stats().handshakes_refused >= 1);
        assert!(t4.peer_status(3).is_some_and(|status| !status.connected));
        drop((t3, t4));

        // As the acceptor: node 1 dials node 3 and asks for node-3.keratin.
        let (mut listeners, nodes) = bind_nodes(&[1, 3]).await;
        let t1 = start(listeners.remove(0), 1, &nodes, Some(ca.node(dir.path(), 1)));
        let _t3 = start(listeners.remove(0), 3, &nodes, Some(impostor()));
        let error = never_connects(&t1, 3, SECOND).await;
        assert!(error.contains("TLS handshake with node 3"), "{error}");
        assert!(error.contains("node-3.keratin"), "{error}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_and_tls_nodes_never_connect() {
    within(20 * SECOND, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::new("cluster CA");

        // A plaintext dialer at a TLS port.
        let (mut listeners, nodes) = bind_nodes(&[1, 2]).await;
        let t1 = start(listeners.remove(0), 1, &nodes, None);
        let t2 = start(listeners.remove(0), 2, &nodes, Some(ca.node(dir.path(), 2)));
        let error = never_connects(&t1, 2, SECOND).await;
        // The acceptor's TLS alert is what the dialer reads instead of a hello reply.
        assert!(error.contains("answered with TLS"), "{error}");
        let failed = t2.stats().tls_handshakes_failed;
        assert!(failed >= 2, "the dialer retries: {failed} attempts");
        drop((t1, t2));

        // A TLS dialer at a plaintext port.
        let (mut listeners, nodes) = bind_nodes(&[1, 2]).await;
        let t1 = start(listeners.remove(0), 1, &nodes, Some(ca.node(dir.path(), 1)));
        let t2 = start(listeners.remove(0), 2, &nodes, None);
        let error = never_connects(&t1, 2, SECOND).await;
        assert!(error.contains("TLS handshake with node 2"), "{error}");
        let refused = t2.stats().handshakes_refused;
        assert!(refused >= 2, "the dialer retries: {refused} attempts");
    })
    .await;
}

/// Writes a new certificate and key for node `id` from `ca` over `files`, and `ca` as its CA.
fn rewrite(files: &ClusterTlsFiles, ca: &Ca, dir: &Path, id: NodeId) {
    let name = format!("node-{id}.keratin");
    let fresh = ca.node_files(dir, &format!("fresh-{id}"), &[&name]);
    for (from, to) in [
        (&fresh.cert_file, &files.cert_file),
        (&fresh.key_file, &files.key_file),
        (&fresh.ca_file, &files.ca_file),
    ] {
        std::fs::copy(from, to).expect("copy");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_serves_new_connections_and_keeps_open_ones() {
    within(30 * SECOND, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let (old_ca, new_ca) = (Ca::new("old CA"), Ca::new("new CA"));
        let (mut listeners, nodes) = bind_nodes(&[1, 2]).await;
        let two_tls = old_ca.node(dir.path(), 2);
        assert!(two_tls.names(2) && !two_tls.names(1));
        let t1 = start(
            listeners.remove(0),
            1,
            &nodes,
            Some(old_ca.node(dir.path(), 1)),
        );
        let t2 = start(listeners.remove(0), 2, &nodes, Some(two_tls.clone()));
        t1.wait_connected(2, 5 * SECOND).await.expect("connected");
        call(&t1, 2, "before").await.expect("call before");

        // Node 2 moves to a certificate (and CA) of the new CA.
        let two_files = two_tls.files().clone();
        rewrite(&two_files, &new_ca, dir.path(), 2);
        assert_eq!(t2.reload_tls(), Ok(true));
        // A reload that fails (a key that is not PEM) keeps what the last one loaded.
        std::fs::write(dir.path().join("broken.key"), "not a key").expect("write");
        let broken = ClusterTls::load(two_files.clone()).expect("load");
        std::fs::copy(dir.path().join("broken.key"), &two_files.key_file).expect("copy");
        let error = broken.reload().expect_err("broken key");
        assert!(
            matches!(
                error,
                NetError::Tls {
                    what: "key file",
                    ..
                }
            ),
            "{error}"
        );
        let error = t2.reload_tls().expect_err("broken key");
        assert!(error.to_string().contains("key file"), "{error}");

        // The open connection goes on, both ways, without reconnecting.
        for round in 0..20 {
            let reply = call(&t1, 2, "after")
                .await
                .expect("call on the open connection");
            assert_eq!(reply, "2<-1:7:1:after", "round {round}");
            call(&t2, 1, "back").await.expect("call back");
        }
        assert_eq!(t1.stats().connections_dialed, 1);
        assert_eq!(t2.peer_status(1).expect("peer").connections_count, 1);
        drop(t1);

        // A new connection gets the new certificate: a node 1 trusting only the old CA is
        // refused, one of the new CA connects and calls.
        let stale = old_ca.node(dir.path(), 1);
        let (mut fresh_listeners, _) = bind_nodes(&[1]).await;
        let stale_node = start(fresh_listeners.remove(0), 1, &nodes, Some(stale));
        let error = never_connects(&stale_node, 2, SECOND).await;
        assert!(error.contains("UnknownIssuer"), "{error}");
        drop(stale_node);
        let renewed = new_ca.node(dir.path(), 1);
        let (mut fresh_listeners, _) = bind_nodes(&[1]).await;
        let renewed_node = start(fresh_listeners.remove(0), 1, &nodes, Some(renewed));
        renewed_node
            .wait_connected(2, 5 * SECOND)
            .await
            .expect("a node of the new CA connects");
        let reply = call(&renewed_node, 2, "new").await.expect("call");
        assert_eq!(reply, "2<-1:7:1:new");
    })
    .await;
}

#[tokio::test]
async fn reload_without_tls_reads_nothing() {
    let (t1, _t2, _, _) = common::pair(fast_options()).await;
    assert_eq!(t1.reload_tls(), Ok(false));
}

#[test]
fn load_names_the_file_that_cannot_be_used() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("cluster CA");
    let files = ca.node_files(dir.path(), "node-1", &["node-1.keratin"]);
    let missing = ClusterTlsFiles {
        ca_file: PathBuf::from("/nonexistent/ca.pem"),
        ..files.clone()
    };
    let error = ClusterTls::load(missing).expect_err("missing CA");
    assert!(
        error.to_string().contains("CA file /nonexistent/ca.pem"),
        "{error}"
    );
    let other_key = ca
        .node_files(dir.path(), "node-2", &["node-2.keratin"])
        .key_file;
    let mismatched = ClusterTlsFiles {
        key_file: other_key,
        ..files
    };
    let error = ClusterTls::load(mismatched).expect_err("another key");
    assert!(error.to_string().contains("key file"), "{error}");
}
