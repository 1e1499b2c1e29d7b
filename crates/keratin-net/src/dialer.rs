//! The dialer of one peer with a higher id than ours: connects, runs the dialer's side of the
//! handshake, hands the connection to `session.rs`, and when it ends (or fails) dials again after
//! a backoff that doubles from `reconnect_backoff_min` to `reconnect_backoff_max`, with jitter so
//! the nodes of a restarted cluster do not dial in lockstep. It ends at shutdown or when its
//! peer is retired (removed, or replaced by a `Peer` with a new address and a new dialer).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::debug;

use crate::context::{wait_shutdown, Context};
use crate::handshake::{Hello, HelloReply, PROTOCOL_VERSION};
use crate::peer::{wait_retired, Peer};
use crate::session::run_session;
use crate::stats::add;

/// Dials `peer` until the transport shuts down or the peer is retired.
pub(crate) async fn run_dialer(context: Arc<Context>, peer: Arc<Peer>) {
    let options = &context.options;
    let mut shutdown = context.shutdown_signal();
    let mut retired = peer.standing_signal();
    let mut backoff = options.reconnect_backoff_min;
    loop {
        let dialed = tokio::select! {
            biased;
            _ = wait_shutdown(&mut shutdown) => return,
            _ = wait_retired(&mut retired) => return,
            dialed = dial(&context, &peer) => dialed,
        };
        match dialed {
            Ok(stream) => {
                add(&context.stats.connections_dialed, 1);
                backoff = options.reconnect_backoff_min;
                run_session(Arc::clone(&context), Arc::clone(&peer), stream).await;
            }
            Err(reason) => {
                debug!(peer = peer.id, %reason, "cluster dial failed");
                peer.liveness.set_error(reason);
            }
        }
        let delay = jittered(backoff, peer.liveness.now_us());
        tokio::select! {
            _ = wait_shutdown(&mut shutdown) => return,
            _ = wait_retired(&mut retired) => return,
            _ = tokio::time::sleep(delay) => {}
        }
        backoff = (backoff * 2).min(options.reconnect_backoff_max);
    }
}

/// Connects and handshakes; the error says why, for the peer's liveness view.
async fn dial(context: &Context, peer: &Peer) -> Result<TcpStream, String> {
    let options = &context.options;
    let connect = TcpStream::connect(peer.addr);
    let mut stream = match tokio::time::timeout(options.connect_timeout, connect).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => return Err(format!("connect to {} failed: {error}", peer.addr)),
        Err(_) => return Err(format!("connect to {} timed out", peer.addr)),
    };
    stream
        .set_nodelay(true)
        .map_err(|error| format!("TCP_NODELAY: {error}"))?;
    let hello = Hello {
        version: PROTOCOL_VERSION,
        from: context.node_id,
        to: peer.id,
        cluster: context.cluster_name.clone(),
    };
    let handshake = async {
        stream.write_all(&hello.encode()).await?;
        HelloReply::read(&mut stream).await.map_err(|error| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, error.to_string())
        })
    };
    let reply = match tokio::time::timeout(options.handshake_timeout, handshake).await {
        Ok(Ok(reply)) => reply,
        Ok(Err(error)) => return Err(format!("handshake with {} failed: {error}", peer.addr)),
        Err(_) => return Err(format!("handshake with {} timed out", peer.addr)),
    };
    if let Err(error) = reply.outcome {
        return Err(format!(
            "node {} refused the handshake ({error})",
            reply.node_id
        ));
    }
    if reply.version != PROTOCOL_VERSION || reply.node_id != peer.id {
        return Err(format!(
            "{} answered as node {} with version {}, expected node {} with version {PROTOCOL_VERSION}",
            peer.addr, reply.node_id, reply.version, peer.id
        ));
    }
    Ok(stream)
}

/// `backoff` scaled by a factor in [0.5, 1.0) taken from the clock's low bits.
fn jittered(backoff: Duration, now_us: u64) -> Duration {
    let fraction = 0.5 + (now_us % 1000) as f64 / 2000.0;
    backoff.mul_f64(fraction)
}
