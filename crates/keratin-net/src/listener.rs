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

use std::sync::Arc;

use tokio::io::AsyncWriteExt;
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

/// Handshakes in progress at once. Each holds a socket and at most a 279-byte hello for at most
/// `handshake_timeout`; 64 is far more than a cluster's nodes, and bounds what a port scan or a
/// misdirected client fleet can hold.
const HANDSHAKES_MAX: usize = 64;
/// At most one `info` line per this interval for refused unknown nodes: a joining node is
/// refused every 2 s (the default `reconnect_backoff_max`) until it is added, and a removed one
/// until it learns, so one line per 30 s says it is happening without repeating it 15 times.
pub(crate) const UNKNOWN_NODE_LOG_INTERVAL: std::time::Duration =
    std::time::Duration::from_secs(30);

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
            if let Some((peer, stream)) = accept(&context, stream).await {
                drop(permit);
                run_session(context, peer, stream).await;
            }
        });
    }
}

/// The acceptor's handshake; `None` when refused or failed (already answered and logged).
async fn accept(context: &Context, mut stream: TcpStream) -> Option<(Arc<Peer>, TcpStream)> {
    let _ = stream.set_nodelay(true);
    let timeout = context.options.handshake_timeout;
    let hello = match tokio::time::timeout(timeout, Hello::read(&mut stream)).await {
        Ok(Ok(hello)) => hello,
        Ok(Err(HandshakeReadError::Bad(error))) => {
            let code = if matches!(error, FrameError::BadMagic(_)) {
                codes::BAD_MAGIC
            } else {
                codes::PROTOCOL
            };
            refuse(
                context,
                &mut stream,
                RemoteError::new(code, error.to_string()),
            )
            .await;
            return None;
        }
        Ok(Err(HandshakeReadError::Io(error))) => {
            debug!(%error, "cluster handshake failed");
            return None;
        }
        Err(_) => {
            debug!("cluster handshake timed out");
            return None;
        }
    };
    match check_hello(context, &hello) {
        Ok(peer) => {
            let reply = HelloReply {
                version: PROTOCOL_VERSION,
                node_id: context.node_id,
                outcome: Ok(()),
            };
            stream.write_all(&reply.encode()).await.ok()?;
            Some((peer, stream))
        }
        Err(error) if error.code == codes::UNKNOWN_NODE => {
            if context.unknown_node_log_due(UNKNOWN_NODE_LOG_INTERVAL) {
                info!(from = hello.from, %error, "refused a cluster handshake from an unknown node (expected while a node joins or after one is removed)");
            } else {
                debug!(from = hello.from, %error, "refused a cluster handshake from an unknown node");
            }
            refuse(context, &mut stream, error).await;
            None
        }
        Err(error) => {
            warn!(from = hello.from, %error, "refused a cluster handshake");
            refuse(context, &mut stream, error).await;
            None
        }
    }
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

async fn refuse(context: &Context, stream: &mut TcpStream, error: RemoteError) {
    add(&context.stats.handshakes_refused, 1);
    let reply = HelloReply {
        version: PROTOCOL_VERSION,
        node_id: context.node_id,
        outcome: Err(error),
    };
    let _ = stream.write_all(&reply.encode()).await;
    let _ = stream.shutdown().await;
}
