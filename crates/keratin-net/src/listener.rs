//! The cluster listener: accepts connections, runs the acceptor's side of the handshake (reads a
//! [`Hello`], checks magic, version, cluster, node ids and direction, answers a
//! [`HelloReply`]), then hands an accepted connection to `session.rs`. Only the node with the
//! lower id of a pair dials, so an accepted hello must come from a lower id: that rule is what
//! keeps one connection per pair. A known peer that dials again (it restarted, or its old
//! connection is half-open) replaces its old connection.
//!
//! A node that is not a peer (yet, or any more) is refused with `UNKNOWN_NODE`. That is expected
//! while a node joins (it may dial before `Transport::add_peer` runs here) and after one is
//! removed (it may not know yet), and its dialer retries every `reconnect_backoff_max` at most,
//! so the refusal is logged at `info` at most once per [`UNKNOWN_NODE_LOG_INTERVAL`] and at
//! `debug` otherwise; the count is in `TransportStats::handshakes_refused`.
//!
//! With mutual TLS (`crate::tls`) the TLS handshake comes first and requires a client
//! certificate signed by the cluster's CA. After the hello, the certificate must also name the
//! node the hello claims (`node-<from>.keratin`): a node holding node 2's certificate cannot
//! claim to be node 3. A mismatch is refused with `WRONG_IDENTITY` and logged at `warn` with
//! both ids. A failed TLS handshake (a plaintext dialer, a certificate from another CA) and a
//! TLS hello on a plaintext port are logged at `warn` at most once per
//! [`TLS_FAILURE_LOG_INTERVAL`] and at `debug` otherwise, like unknown nodes: a misconfigured
//! peer repeats them every backoff, and a port scan would too.

use std::sync::Arc;

use std::net::SocketAddr;

use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::codes;
use crate::context::{wait_shutdown, Context};
use crate::error::{FrameError, RemoteError};
use crate::handshake::{HandshakeReadError, Hello, HelloReply, PROTOCOL_VERSION};
use crate::peer::Peer;
use crate::session::run_session;
use crate::stats::add;
use crate::stream::{looks_like_tls, Established};
use crate::tls::{certificate_names, node_name};
use crate::NodeId;

/// Handshakes in progress at once. Each holds a socket and at most a 279-byte hello for at most
/// `handshake_timeout`; 64 is far more than a cluster's nodes, and bounds what a port scan or a
/// misdirected client fleet can hold.
const HANDSHAKES_MAX: usize = 64;
/// At most one `info` line per this interval for refused unknown nodes: a joining node is
/// refused every 2 s (the default `reconnect_backoff_max`) until it is added, and a removed one
/// until it learns, so one line per 30 s says it is happening without repeating it 15 times.
pub(crate) const UNKNOWN_NODE_LOG_INTERVAL: std::time::Duration =
    std::time::Duration::from_secs(30);
/// At most one `warn` line per this interval for failed TLS handshakes (and TLS hellos on a
/// plaintext port): a misconfigured peer repeats them every `reconnect_backoff_max`, a port scan
/// as fast as it likes; the same 30 s as for unknown nodes, for the same reason.
const TLS_FAILURE_LOG_INTERVAL: std::time::Duration = UNKNOWN_NODE_LOG_INTERVAL;

/// Accepts connections until shutdown.
pub(crate) async fn run_listener(context: Arc<Context>, listener: TcpListener) {
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_MAX));
    let mut shutdown = context.shutdown_signal();
    loop {
        let accepted = tokio::select! {
            _ = wait_shutdown(&mut shutdown) => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and friends: wait a moment rather than spin.
                warn!(%error, "cluster listener accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        add(&context.stats.connections_accepted, 1);
        let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
            debug!(%remote, "too many cluster handshakes in progress; dropping the connection");
            continue;
        };
        let context = Arc::clone(&context);
        tokio::spawn(async move {
            if let Some((peer, stream)) = accept(&context, stream, remote).await {
                drop(permit);
                run_session(context, peer, stream).await;
            }
        });
    }
}

/// Runs TLS when configured, then the acceptor's handshake; `None` when refused or failed
/// (already answered and logged).
async fn accept(
    context: &Context,
    stream: TcpStream,
    remote: SocketAddr,
) -> Option<(Arc<Peer>, Established)> {
    let _ = stream.set_nodelay(true);
    let Some(tls) = &context.options.tls else {
        let mut stream = stream;
        let peer = accept_hello(context, &mut stream, remote, Identity::Plain).await?;
        return Some((peer, Established::Plain(stream)));
    };
    let timeout = context.options.handshake_timeout;
    let mut stream = match tokio::time::timeout(timeout, tls.acceptor().accept(stream)).await {
        Ok(Ok(stream)) => tokio_rustls::TlsStream::Server(stream),
        Ok(Err(error)) => {
            add(&context.stats.tls_handshakes_failed, 1);
            let message = "cluster TLS handshake failed (a peer without TLS, or a certificate \
                           not signed by cluster.tls_ca_file?)";
            if context.tls_failure_log_due(TLS_FAILURE_LOG_INTERVAL) {
                warn!(%remote, %error, "{message}");
            } else {
                debug!(%remote, %error, "{message}");
            }
            return None;
        }
        Err(_) => {
            debug!(%remote, "cluster TLS handshake timed out");
            return None;
        }
    };
    let certificate = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|certificate| certificate.clone().into_owned());
    let identity = Identity::Certificate(certificate);
    let peer = accept_hello(context, &mut stream, remote, identity).await?;
    Some((peer, Established::Tls(Box::new(stream))))
}

/// What vouches for the dialer besides its hello.
enum Identity {
    /// Plain TCP: nothing.
    Plain,
    /// Mutual TLS: the dialer's end-entity certificate, already verified against the CA.
    Certificate(Option<CertificateDer<'static>>),
}

/// The acceptor's side of the cluster handshake, over TCP or TLS.
async fn accept_hello<S: AsyncRead + AsyncWrite + Unpin>(
    context: &Context,
    stream: &mut S,
    remote: SocketAddr,
    identity: Identity,
) -> Option<Arc<Peer>> {
    let timeout = context.options.handshake_timeout;
    let hello = match tokio::time::timeout(timeout, Hello::read(stream)).await {
        Ok(Ok(hello)) => hello,
        Ok(Err(HandshakeReadError::Bad(error))) => {
            let code = match error {
                FrameError::BadMagic(magic) => {
                    if looks_like_tls(magic)
                        && context.tls_failure_log_due(TLS_FAILURE_LOG_INTERVAL)
                    {
                        warn!(%remote, "a peer speaks TLS to this plaintext cluster port; set cluster.tls_cert_file, tls_key_file and tls_ca_file on every node or on none");
                    }
                    codes::BAD_MAGIC
                }
                _ => codes::PROTOCOL,
            };
            refuse(context, stream, RemoteError::new(code, error.to_string())).await;
            return None;
        }
        Ok(Err(HandshakeReadError::Io(error))) => {
            debug!(%remote, %error, "cluster handshake failed");
            return None;
        }
        Err(_) => {
            debug!(%remote, "cluster handshake timed out");
            return None;
        }
    };
    let checked = check_hello(context, &hello)
        .and_then(|peer| check_identity(context, &hello, &identity).map(|()| peer));
    match checked {
        Ok(peer) => {
            let reply = HelloReply {
                version: PROTOCOL_VERSION,
                node_id: context.node_id,
                outcome: Ok(()),
            };
            stream.write_all(&reply.encode()).await.ok()?;
            stream.flush().await.ok()?;
            Some(peer)
        }
        Err(error) if error.code == codes::UNKNOWN_NODE => {
            if context.unknown_node_log_due(UNKNOWN_NODE_LOG_INTERVAL) {
                info!(from = hello.from, %error, "refused a cluster handshake from an unknown node (expected while a node joins or after one is removed)");
            } else {
                debug!(from = hello.from, %error, "refused a cluster handshake from an unknown node");
            }
            refuse(context, stream, error).await;
            None
        }
        Err(error) => {
            warn!(from = hello.from, %remote, %error, "refused a cluster handshake");
            refuse(context, stream, error).await;
            None
        }
    }
}

/// With mutual TLS, the dialer's certificate must name the node its hello claims.
fn check_identity(
    context: &Context,
    hello: &Hello,
    identity: &Identity,
) -> Result<(), RemoteError> {
    let certificate = match identity {
        Identity::Plain => return Ok(()),
        Identity::Certificate(certificate) => certificate.as_ref(),
    };
    let claimed = hello.from;
    if certificate.is_some_and(|certificate| certificate_names(certificate, claimed)) {
        return Ok(());
    }
    let named = certificate.map_or_else(Vec::new, |certificate| named_nodes(context, certificate));
    let names = match named.as_slice() {
        [] => "none of this cluster's nodes".to_string(),
        ids => ids
            .iter()
            .map(|id| format!("node {id} ({})", node_name(*id)))
            .collect::<Vec<_>>()
            .join(", "),
    };
    Err(RemoteError::new(
        codes::WRONG_IDENTITY,
        format!(
            "the dialer claims to be node {claimed}, but its certificate names {names}, not {}; \
             a node's certificate must name its own id",
            node_name(claimed)
        ),
    ))
}

/// The nodes this node knows (its peers and itself) that `certificate` names, for the refusal
/// message: one name check per known node, a few dozen at most, and only on a refusal.
fn named_nodes(context: &Context, certificate: &CertificateDer<'_>) -> Vec<NodeId> {
    let mut ids: Vec<NodeId> = context.peers().iter().map(|peer| peer.id).collect();
    ids.push(context.node_id);
    ids.sort_unstable();
    ids.retain(|id| certificate_names(certificate, *id));
    ids
}

fn check_hello(context: &Context, hello: &Hello) -> Result<Arc<Peer>, RemoteError> {
    let me = context.node_id;
    if hello.version != PROTOCOL_VERSION {
        return Err(RemoteError::new(
            codes::VERSION,
            format!(
                "node {me} speaks cluster protocol version {PROTOCOL_VERSION}, node {} speaks {}; \
                 run the same Keratin version on every node",
                hello.from, hello.version
            ),
        ));
    }
    if hello.cluster != context.cluster_name {
        return Err(RemoteError::new(
            codes::CLUSTER,
            format!(
                "node {me} belongs to cluster '{}', not '{}'; check cluster.name and the peer addresses",
                context.cluster_name, hello.cluster
            ),
        ));
    }
    if hello.to != me {
        return Err(RemoteError::new(
            codes::WRONG_NODE,
            format!(
                "this is node {me}, not node {}; the peer list of node {} has a wrong address",
                hello.to, hello.from
            ),
        ));
    }
    let Some(peer) = context.peer(hello.from) else {
        return Err(RemoteError::new(
            codes::UNKNOWN_NODE,
            format!(
                "node {} is not among the peers of node {me}; add it to cluster.peers \
                 (or `keratin cluster add-node`)",
                hello.from
            ),
        ));
    };
    if hello.from > me {
        return Err(RemoteError::new(
            codes::WRONG_DIRECTION,
            format!(
                "node {} dialed node {me}, but only the lower id of a pair dials",
                hello.from
            ),
        ));
    }
    Ok(peer)
}

async fn refuse<S: AsyncWrite + Unpin>(context: &Context, stream: &mut S, error: RemoteError) {
    add(&context.stats.handshakes_refused, 1);
    let reply = HelloReply {
        version: PROTOCOL_VERSION,
        node_id: context.node_id,
        outcome: Err(error),
    };
    let _ = stream.write_all(&reply.encode()).await;
    let _ = stream.shutdown().await;
}
