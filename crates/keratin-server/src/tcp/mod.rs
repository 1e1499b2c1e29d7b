//! The TCP protocol server: accepts connections and runs one [`connection`] task each.

mod connection;
pub mod errors;
mod incoming;
mod stream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use keratin_broker::Broker;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Default node-wide bound on unanswered publish bytes: 256 MiB keeps a fast disk busy (a
/// second of appends at 250 MB/s) and fits comfortably in a small container; `Node` lowers it
/// to an eighth of the memory limit when that is smaller.
pub const PUBLISH_BYTES_INFLIGHT_DEFAULT: usize = 256 << 20;

/// Default bound on one connection's delivery bytes not yet handed to its socket: 16 MiB is
/// 64 ms of sending at 250 MB/s, enough to keep a fast consumer busy; `Node` lowers it to a
/// sixteenth of the node's delivery budget when that is smaller, so that sixteen stalled
/// connections are needed to take the whole budget from the others.
pub const OUTBOUND_BYTES_DEFAULT: usize = 16 << 20;

/// Default bound on open protocol connections. Past it, new connections are closed at once
/// (and logged): each open connection holds a task, its read and write buffers (a frame's worth
/// at most, 16 MiB, while a large frame passes), its consumers' bookkeeping (at most
/// `PREFETCH_PER_CONNECTION_MAX` unacknowledged deliveries, about 25 MiB) and a file descriptor;
/// 1,024 is the usual descriptor limit of a process.
pub const CONNECTIONS_MAX_DEFAULT: usize = 1024;

/// Memory a connection claims for as long as it is open: its task, its read and write buffers
/// between frames (64 KiB each at most, `BUFFER_RETAINED_BYTES`), its outbound channel and
/// maps. A connection that could take memory past the limit is refused with 429 `memory`.
pub const CONNECTION_CLAIM_BYTES: u64 = 256 << 10;

/// Refusals of connections past `connections_max` being answered at once: each waits for the
/// client's hello (at most `handshake_timeout`) to answer it 429 `connections`. Past this,
/// new connections are closed without an answer, so a flood costs at most 64 small tasks.
const REFUSALS_MAX: usize = 64;

/// The retry hint of a connection refused at `connections_max`: connections come and go.
const CONNECTIONS_RETRY_AFTER_MS: u32 = 1_000;

/// The publish byte budget is counted in KiB permits (a semaphore counts in `u32`).
pub(crate) const PUBLISH_PERMIT_BYTES: usize = 1024;

/// The other nodes of the cluster, as the cluster layer knows them now (asked at each
/// handshake). Cheap to clone.
#[derive(Clone)]
pub struct ClusterPeers(pub Arc<dyn Fn() -> Vec<keratin_proto::NodeAddress> + Send + Sync>);

impl std::fmt::Debug for ClusterPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterPeers")
    }
}

/// Limits and timers of protocol connections.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Sent to clients in the handshake.
    pub node_id: String,
    /// The protocol listener's bound address, told to clients in the handshake (`None`: the
    /// handshake names the address the client connected to).
    pub server_addr: Option<SocketAddr>,
    /// The HTTP admin listener's bound address, told to clients in the handshake so that the
    /// CLI needs only the protocol address (`None`: no admin port is advertised).
    pub admin_addr: Option<SocketAddr>,
    /// The cluster's other nodes, listed in the handshake after this one so that a client
    /// given one address can reach the others (a partition's leader, or any node while this
    /// one is cut off). `None` on a single node.
    pub peers: Option<ClusterPeers>,
    /// Largest frame accepted or sent.
    pub frame_size_bytes_max: u32,
    /// Publish frames of one connection whose outcome is awaited at once; past it the server
    /// stops reading the connection, so TCP flow control holds the client back. 256 frames of up
    /// to 1,000 messages keep a fast disk busy while bounding what a connection can queue.
    pub publish_frames_inflight_max: usize,
    /// Message bytes of publishes read from all connections and not yet answered, node-wide.
    /// Past it, connections stop reading publishes until earlier ones are confirmed: the memory
    /// that unconfirmed publishes can take is bounded whatever the number of connections.
    pub publish_bytes_inflight_max: usize,
    /// Frames queued for sending on one connection; a client that does not read is held back
    /// when it is full (deliveries and confirms wait, then TCP flow control).
    pub outbound_frames_max: usize,
    /// Delivery bytes taken for one connection's consumers and not yet flushed to its socket;
    /// past it the broker delivers to the connection's consumers only as bytes are sent (a
    /// larger message goes out alone). A client that does not read holds at most this much.
    pub outbound_bytes_max: usize,
    /// Open protocol connections at once; past it new connections are closed.
    pub connections_max: usize,
    /// The server sends a heartbeat when it has sent nothing for this long.
    pub heartbeat_interval: Duration,
    /// A connection that sent nothing (not even a heartbeat) for this long is closed.
    pub idle_timeout: Duration,
    /// Time a client has to complete the handshake.
    pub handshake_timeout: Duration,
    /// On shutdown, how long connections get to deliver outstanding confirms.
    pub drain_timeout: Duration,
    /// TLS for every connection (`None`: plain TCP). The TLS handshake counts against
    /// `handshake_timeout` with the protocol's.
    pub tls: Option<Arc<crate::tls::ServerTls>>,
    /// Logins and permissions; `None`: anyone may do anything.
    pub access: Option<Arc<crate::access::Access>>,
    /// Password and token logins over plain TCP off loopback are refused unless this is set
    /// (`server.insecure`): they would send the secret in the clear.
    pub insecure: bool,
    /// The audit trail the connections record manage verbs and refused logins in; `None`:
    /// not recorded.
    pub audit: Option<crate::audit::AuditLog>,
    /// The node's memory claims: each connection claims [`CONNECTION_CLAIM_BYTES`], each frame
    /// over 64 KiB its size while it is read, each consumer its prefetch's bookkeeping. The
    /// default grants everything (no memory sample feeds it).
    pub memory_claims: Arc<keratin_limits::MemoryClaims>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            node_id: "keratin".into(),
            server_addr: None,
            admin_addr: None,
            peers: None,
            frame_size_bytes_max: keratin_proto::FRAME_SIZE_BYTES_MAX,
            publish_frames_inflight_max: 256,
            publish_bytes_inflight_max: PUBLISH_BYTES_INFLIGHT_DEFAULT,
            outbound_frames_max: 1024,
            outbound_bytes_max: OUTBOUND_BYTES_DEFAULT,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            heartbeat_interval: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(5),
            tls: None,
            access: None,
            insecure: false,
            audit: None,
            memory_claims: keratin_limits::MemoryClaims::new(),
        }
    }
}

/// Serve the protocol on `listener` until `shutdown` completes; then stop accepting, tell every
/// connection to close, and wait (up to `drain_timeout`) for their outstanding replies.
pub async fn serve(
    listener: TcpListener,
    broker: Broker,
    options: TcpOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let publish_bytes = Arc::new(tokio::sync::Semaphore::new(
        (options.publish_bytes_inflight_max / PUBLISH_PERMIT_BYTES).max(1),
    ));
    let options = Arc::new(options);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut refusals = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(error) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let admitted = if connections.len() >= options.connections_max {
                    tracing::warn!(%peer, connections_max = options.connections_max, "too many connections; refusing the new one");
                    Err(connections_refusal(options.connections_max))
                } else {
                    options.memory_claims.claim(CONNECTION_CLAIM_BYTES).map_err(|refused| {
                        tracing::warn!(%peer, %refused, "no memory for a new connection; refusing it");
                        memory_refusal(&refused)
                    })
                };
                let memory = match admitted {
                    Ok(claim) => claim,
                    Err(error) => {
                    if refusals.len() < REFUSALS_MAX {
                        let options = options.clone();
                        refusals.spawn(async move {
                            match options.tls.clone() {
                                None => connection::refuse(stream, options, error).await,
                                Some(tls) => {
                                    if let Some(stream) = tls_accept(&tls, stream, peer, &options).await {
                                        connection::refuse(stream, options, error).await;
                                    }
                                }
                            }
                        });
                    }
                    continue;
                    }
                };
                let broker = broker.clone();
                let options = options.clone();
                let stop = stop_rx.clone();
                let publish_bytes = publish_bytes.clone();
                connections.spawn(async move {
                    let _memory = memory;
                    match options.tls.clone() {
                        None => connection::run(stream, peer, broker, options, publish_bytes, stop).await,
                        Some(tls) => {
                            if let Some(stream) = tls_accept(&tls, stream, peer, &options).await {
                                connection::run(stream, peer, broker, options, publish_bytes, stop).await;
                            }
                        }
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            Some(_) = refusals.join_next(), if !refusals.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    refusals.abort_all();
    let _ = stop_tx.send(true);
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(options.drain_timeout + Duration::from_secs(1), drain)
        .await
        .is_err()
    {
        tracing::warn!("connections did not close in time; closing them");
        connections.abort_all();
    }
    Ok(())
}

/// The TLS handshake of a new connection, within the handshake timeout. A client that does
/// not speak TLS (a plaintext hello), presents nothing in time or rejects the certificate is
/// closed here, logged at debug level: these are the client's errors, and the client sees its
/// own (a closed connection, or its verifier's reason).
async fn tls_accept(
    tls: &crate::tls::ServerTls,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    options: &TcpOptions,
) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    match tokio::time::timeout(options.handshake_timeout, tls.acceptor().accept(stream)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "TLS handshake failed; closing");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "no TLS handshake in time; closing");
            None
        }
    }
}

/// The answer to a connection that could take memory past the limit: 429 `memory`, not applied,
/// retry.
fn memory_refusal(refused: &keratin_limits::ClaimRefused) -> keratin_proto::ErrorBody {
    let retry_after_ms = u32::try_from(refused.retry_after_ms).unwrap_or(u32::MAX);
    keratin_proto::ErrorBody::limited(
        keratin_proto::LimitReason::Memory,
        retry_after_ms,
        format!(
            "the node has no memory for another connection: {refused}; close idle \
             connections or consumers with large prefetch; retry after {retry_after_ms} ms"
        ),
    )
}

/// The answer to a connection past `connections_max`: 429 `connections`, not applied, retry.
fn connections_refusal(connections_max: usize) -> keratin_proto::ErrorBody {
    keratin_proto::ErrorBody::limited(
        keratin_proto::LimitReason::Connections,
        CONNECTIONS_RETRY_AFTER_MS,
        format!(
            "the node has {connections_max} connections, its most (server.connections_max); \
             close idle connections or raise server.connections_max; retry after \
             {CONNECTIONS_RETRY_AFTER_MS} ms"
        ),
    )
}
