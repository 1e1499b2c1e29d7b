//! The dialer of one peer with a higher id than ours: connects, runs the dialer's side of the
//! handshake, hands the connection to `session.rs`, and when it ends (or fails) dials again after
//! a backoff that doubles from `reconnect_backoff_min` to `reconnect_backoff_max`, with jitter so
//! the nodes of a restarted cluster do not dial in lockstep. It ends at shutdown or when its
//! peer is retired (removed, or replaced by a `Peer` with a new address and a new dialer).
//!
//! With mutual TLS (`crate::tls`) the TLS handshake comes first, asking for the server name
//! `node-<peer id>.keratin`, so a certificate that does not name the peer ends the dial before a
//! hello is sent. Failures that are configuration mistakes (a certificate refused either way,
//! TLS on one side only, a refused identity) are logged at `warn` once per distinct reason and
//! at `debug` while they repeat, since the dialer retries them every `reconnect_backoff_max`.

use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::codes;
use crate::context::{wait_shutdown, Context};
use crate::error::FrameError;
use crate::handshake::{HandshakeReadError, Hello, HelloReply, PROTOCOL_VERSION};
use crate::peer::{wait_retired, Peer};
use crate::session::run_session;
use crate::stats::add;
use crate::stream::{looks_like_tls, Established};
use crate::tls::node_name;

/// Why a dial failed, for the peer's liveness view and the log.
struct DialFailure {
    reason: String,
    /// A configuration mistake an operator must see (see the module docs), not a peer that is
    /// down or not added yet.
    misconfigured: bool,
}

impl DialFailure {
    fn transient(reason: String) -> DialFailure {
        DialFailure {
            reason,
            misconfigured: false,
        }
    }

    fn misconfigured(reason: String) -> DialFailure {
        DialFailure {
            reason,
            misconfigured: true,
        }
    }
}

/// Dials `peer` until the transport shuts down or the peer is retired.
pub(crate) async fn run_dialer(context: Arc<Context>, peer: Arc<Peer>) {
    let options = &context.options;
    let mut shutdown = context.shutdown_signal();
    let mut retired = peer.standing_signal();
    let mut backoff = options.reconnect_backoff_min;
    let mut last_warned: Option<String> = None;
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
                last_warned = None;
                run_session(Arc::clone(&context), Arc::clone(&peer), stream).await;
            }
            Err(failure) => {
                let reason = failure.reason;
                if failure.misconfigured && last_warned.as_ref() != Some(&reason) {
                    warn!(peer = peer.id, addr = %peer.addr, %reason, "cluster dial failed; retrying");
                    last_warned = Some(reason.clone());
                } else {
                    debug!(peer = peer.id, %reason, "cluster dial failed");
                }
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

/// Connects, runs TLS when configured, and handshakes, all within the options' bounds.
async fn dial(context: &Context, peer: &Peer) -> Result<Established, DialFailure> {
    let options = &context.options;
    let connect = TcpStream::connect(peer.addr);
    let stream = match tokio::time::timeout(options.connect_timeout, connect).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            return Err(DialFailure::transient(format!(
                "connect to {} failed: {error}",
                peer.addr
            )))
        }
        Err(_) => {
            return Err(DialFailure::transient(format!(
                "connect to {} timed out",
                peer.addr
            )))
        }
    };
    stream
        .set_nodelay(true)
        .map_err(|error| DialFailure::transient(format!("TCP_NODELAY: {error}")))?;
    let established = async {
        match &options.tls {
            None => {
                let mut stream = stream;
                hello(context, peer, &mut stream, false).await?;
                Ok(Established::Plain(stream))
            }
            Some(tls) => {
                let name = ServerName::try_from(node_name(peer.id))
                    .map_err(|error| DialFailure::misconfigured(error.to_string()))?;
                let stream = tls
                    .connector()
                    .connect(name, stream)
                    .await
                    .map_err(|error| {
                        DialFailure::misconfigured(format!(
                        "TLS handshake with node {} at {} failed: {error} (its certificate must \
                         be signed by cluster.tls_ca_file and name {}; does it run with TLS?)",
                        peer.id,
                        peer.addr,
                        node_name(peer.id)
                    ))
                    })?;
                let mut stream = tokio_rustls::TlsStream::Client(stream);
                hello(context, peer, &mut stream, true).await?;
                Ok(Established::Tls(Box::new(stream)))
            }
        }
    };
    match tokio::time::timeout(options.handshake_timeout, established).await {
        Ok(result) => result,
        Err(_) => Err(DialFailure::transient(format!(
            "handshake with {} timed out",
            peer.addr
        ))),
    }
}

/// The dialer's side of the cluster handshake: sends the hello, reads and checks the reply.
async fn hello<S: AsyncRead + AsyncWrite + Unpin>(
    context: &Context,
    peer: &Peer,
    stream: &mut S,
    tls: bool,
) -> Result<(), DialFailure> {
    let hello = Hello {
        version: PROTOCOL_VERSION,
        from: context.node_id,
        to: peer.id,
        cluster: context.cluster_name.clone(),
    };
    let exchange = async {
        stream.write_all(&hello.encode()).await?;
        // TLS holds written bytes in its session until flushed; TCP's flush does nothing.
        stream.flush().await?;
        HelloReply::read(stream).await
    };
    let reply = match exchange.await {
        Ok(reply) => reply,
        Err(HandshakeReadError::Bad(FrameError::BadMagic(magic))) if looks_like_tls(magic) => {
            return Err(DialFailure::misconfigured(format!(
                "node {} at {} answered with TLS; set cluster.tls_cert_file, tls_key_file and \
                 tls_ca_file on this node too (every node of a cluster, or none)",
                peer.id, peer.addr
            )))
        }
        // Over TLS, a refused certificate shows here: TLS 1.3 lets the dialer finish its side
        // before the acceptor has checked the dialer's certificate.
        Err(HandshakeReadError::Io(error)) if tls => {
            return Err(DialFailure::misconfigured(format!(
                "handshake with node {} at {} failed: {error} (was this node's certificate \
                 refused? it must be signed by the cluster's CA and name {})",
                peer.id,
                peer.addr,
                node_name(context.node_id)
            )))
        }
        Err(error) => {
            return Err(DialFailure::transient(format!(
                "handshake with {} failed: {error}",
                peer.addr
            )))
        }
    };
    if let Err(error) = reply.outcome {
        let failure = format!("node {} refused the handshake ({error})", reply.node_id);
        return Err(if error.code == codes::WRONG_IDENTITY {
            DialFailure::misconfigured(failure)
        } else {
            DialFailure::transient(failure)
        });
    }
    if reply.version != PROTOCOL_VERSION || reply.node_id != peer.id {
        return Err(DialFailure::transient(format!(
            "{} answered as node {} with version {}, expected node {} with version {PROTOCOL_VERSION}",
            peer.addr, reply.node_id, reply.version, peer.id
        )));
    }
    Ok(())
}

/// `backoff` scaled by a factor in [0.5, 1.0) taken from the clock's low bits.
fn jittered(backoff: Duration, now_us: u64) -> Duration {
    let fraction = 0.5 + (now_us % 1000) as f64 / 2000.0;
    backoff.mul_f64(fraction)
}
