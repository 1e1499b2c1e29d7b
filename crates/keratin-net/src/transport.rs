//! [`Transport`]: the public face of the crate. Starting one binds (or takes) the cluster
//! listener and spawns the listener, one dialer per peer with a higher id, and the heartbeat
//! ticker; its methods make calls, leave heartbeats and read liveness. Every task stops when the
//! last `Transport` handle is dropped or [`Transport::shutdown`] is called.
//!
//! # Peers that change at run time
//!
//! The peers given at start are only the first set: [`Transport::add_peer`] and
//! [`Transport::remove_peer`] change it while the transport runs (the cluster layer calls them
//! when a node is added to or removed from a live cluster). The rules are those of start:
//!
//! - The lower id of a pair dials. Adding a peer with a higher id starts its dialer; adding one
//!   with a lower id only lets its hello in. A node that dials before it is added here is
//!   refused (`UNKNOWN_NODE`) and retries with its backoff, so the pair connects within
//!   `reconnect_backoff_max` of both sides having added each other, in either order.
//! - Adding a known peer at its address changes nothing. At another address, the old peer is
//!   retired (its connection dropped, its dialer stopped, calls on it fail with `Closed`) and a
//!   fresh one takes its place, dialed at the new address when ours to dial; its liveness
//!   counters start again.
//! - Removing a peer retires it: its dialer stops, its connection closes, calls and heartbeats
//!   waiting on it fail at once with [`NetError::Unreachable`] (a call may still have run
//!   there), later ones fail fast with [`NetError::UnknownPeer`], the heartbeat ticker no longer
//!   visits it, `peers_status` no longer lists it, and its hello is refused like any unknown
//!   node's. Nothing is kept per removed peer: its tasks end and drop it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use crate::config::ResolvedCluster;
use crate::context::Context;
use crate::dialer::run_dialer;
use crate::frame::{Frame, LABEL_BYTES_MAX};
use crate::handler::Handler;
use crate::heartbeat::{enqueue, run_heartbeats, ENTRY_FIXED_SIZE};
use crate::listener::run_listener;
use crate::liveness::{Liveness, PeerStatus};
use crate::options::TransportOptions;
use crate::peer::{Peer, Standing};
use crate::stats::TransportStats;
use crate::{GroupId, NetError, NodeId};

/// The node-to-node transport of one node. Cheap to clone; all clones share one set of
/// connections.
#[derive(Clone)]
pub struct Transport {
    context: Arc<Context>,
    local_addr: SocketAddr,
    _guard: Arc<ShutdownGuard>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("node_id", &self.context.node_id)
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

/// Signals shutdown when the last `Transport` handle is dropped.
struct ShutdownGuard(watch::Sender<bool>);

impl Drop for ShutdownGuard {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

impl Transport {
    /// Binds `cluster.listen` and starts the transport.
    ///
    /// # Panics
    /// Outside a tokio runtime, or when `options` break their own relations (for example a
    /// write queue smaller than one frame): both are the embedder's bugs, not runtime input.
    pub async fn start(
        cluster: ResolvedCluster,
        options: TransportOptions,
        handler: Arc<dyn Handler>,
    ) -> Result<Transport, NetError> {
        let listener = TcpListener::bind(cluster.listen)
            .await
            .map_err(|error| NetError::bind(cluster.listen, &error))?;
        Transport::start_on(listener, cluster, options, handler)
    }

    /// Starts the transport on a listener the caller bound (tests bind `127.0.0.1:0` first so
    /// that every node's address is known before any starts). `cluster.listen` is not used.
    ///
    /// # Panics
    /// As [`Transport::start`].
    pub fn start_on(
        listener: TcpListener,
        cluster: ResolvedCluster,
        options: TransportOptions,
        handler: Arc<dyn Handler>,
    ) -> Result<Transport, NetError> {
        options.assert_valid();
        let local_addr = listener
            .local_addr()
            .map_err(|error| NetError::bind(cluster.listen, &error))?;
        let epoch = Instant::now();
        let peers: BTreeMap<NodeId, Arc<Peer>> = cluster
            .peers
            .iter()
            .filter(|(id, _)| **id != cluster.node_id)
            .map(|(&id, &addr)| (id, Arc::new(Peer::new(id, addr, Liveness::new(epoch)))))
            .collect();
        if let Some(tls) = &options.tls {
            if !tls.names(cluster.node_id) {
                warn!(
                    node = cluster.node_id,
                    cert_file = %tls.files().cert_file.display(),
                    "this node's cluster certificate does not name {}; every peer will refuse it",
                    crate::tls::node_name(cluster.node_id)
                );
            }
        }
        let (shutdown, shutdown_signal) = watch::channel(false);
        let context = Arc::new(Context::new(
            cluster.node_id,
            cluster.name,
            options,
            handler,
            peers,
            shutdown_signal,
        ));
        tokio::spawn(run_listener(Arc::clone(&context), listener));
        tokio::spawn(run_heartbeats(Arc::clone(&context)));
        for peer in context.peers() {
            spawn_dialer(&context, peer);
        }
        Ok(Transport {
            context,
            local_addr,
            _guard: Arc::new(ShutdownGuard(shutdown)),
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.context.node_id
    }

    /// The address the cluster listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Calls `to`'s handler for `group` with `kind` and `body` and waits for its reply, for at
    /// most `timeout` (including the wait for a call slot and for room in the write queue).
    ///
    /// Fails fast with [`NetError::Unreachable`] when no connection is up; the transport keeps
    /// reconnecting in the background. A [`NetError::TimedOut`] or [`NetError::Closed`] call may
    /// still have run on the peer.
    pub async fn call(
        &self,
        to: NodeId,
        group: GroupId,
        kind: u8,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, NetError> {
        let peer = self.peer(to)?;
        let size_bytes = Frame::Request {
            request_id: 0,
            group,
            kind,
            body: Bytes::new(),
        }
        .size_bytes()
            + body.len();
        self.check_size(size_bytes)?;
        let connection = peer.current().ok_or_else(|| peer.unreachable())?;
        match tokio::time::timeout(timeout, connection.call(group, kind, body)).await {
            Ok(result) => peer.unless_removed(result),
            Err(_) => Err(timed_out(to, timeout)),
        }
    }

    /// Sends a heartbeat for `group` to `to`, coalesced with every other group's heartbeat to
    /// `to` into one frame at the next tick, and waits for the group's reply (from the peer's
    /// [`Handler::heartbeats`]) for at most `timeout`. A newer heartbeat for the same group
    /// before the tick replaces this one ([`NetError::Superseded`]).
    pub async fn heartbeat(
        &self,
        to: NodeId,
        group: GroupId,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, NetError> {
        let peer = self.peer(to)?;
        self.check_size(crate::frame::HEADER_SIZE + 8 + 4 + ENTRY_FIXED_SIZE + payload.len())?;
        if peer.current().is_none() {
            return Err(peer.unreachable());
        }
        let (waiter, reply) = oneshot::channel();
        enqueue(&peer, group, payload, waiter)?;
        match tokio::time::timeout(timeout, reply).await {
            Ok(Ok(result)) => peer.unless_removed(result),
            Ok(Err(_)) => peer.unless_removed(Err(NetError::Closed { to })),
            Err(_) => Err(timed_out(to, timeout)),
        }
    }

    /// Makes `id` at `addr` a peer of this node from now on (see the module docs, "Peers that
    /// change at run time"). Adding a known peer at its known address does nothing; at another
    /// address its connection is dropped and it is dialed at the new one (when this node has
    /// the lower id; otherwise the peer dials). A new peer with a higher id than this node's is
    /// dialed at once.
    ///
    /// Fails with [`NetError::SelfPeer`] for this node's own id.
    ///
    /// # Panics
    /// Outside a tokio runtime (it may spawn the peer's dialer).
    pub fn add_peer(&self, id: NodeId, addr: SocketAddr) -> Result<(), NetError> {
        let context = &self.context;
        if id == context.node_id {
            return Err(NetError::SelfPeer { id });
        }
        let peer = Arc::new(Peer::new(id, addr, Liveness::new(Instant::now())));
        let replaced = {
            let mut peers = context.write_peers();
            if peers.get(&id).is_some_and(|known| known.addr == addr) {
                return Ok(());
            }
            peers.insert(id, Arc::clone(&peer))
        };
        if let Some(old) = replaced {
            info!(peer = id, from = %old.addr, to = %addr, "cluster peer changed address");
            old.retire(Standing::Moved);
        } else {
            info!(peer = id, %addr, "cluster peer added");
        }
        spawn_dialer(context, peer);
        Ok(())
    }

    /// Stops treating `id` as a peer (see the module docs, "Peers that change at run time"):
    /// its connection closes, calls and heartbeats waiting on it fail at once with
    /// [`NetError::Unreachable`], later ones with [`NetError::UnknownPeer`], and its hello is
    /// refused from now on. Returns whether `id` was a peer; removing an unknown id does
    /// nothing.
    pub fn remove_peer(&self, id: NodeId) -> bool {
        let removed = self.context.write_peers().remove(&id);
        match removed {
            Some(peer) => {
                info!(peer = id, addr = %peer.addr, "cluster peer removed");
                peer.retire(Standing::Removed);
                true
            }
            None => false,
        }
    }

    /// The address `id` is known at; `None` for an id that is not a peer.
    pub fn peer_addr(&self, id: NodeId) -> Option<SocketAddr> {
        self.context.peer(id).map(|peer| peer.addr)
    }

    /// Waits up to `timeout` until a connection to `to` is up.
    pub async fn wait_connected(&self, to: NodeId, timeout: Duration) -> Result<(), NetError> {
        self.peer(to)?.wait_connected(timeout).await
    }

    /// The liveness of one peer; `None` for an id that is not a peer.
    pub fn peer_status(&self, to: NodeId) -> Option<PeerStatus> {
        let peer = self.context.peer(to)?;
        Some(peer.liveness.status(peer.id, peer.addr))
    }

    /// The liveness of every peer, by id.
    pub fn peers_status(&self) -> Vec<PeerStatus> {
        self.context
            .peers()
            .iter()
            .map(|peer| peer.liveness.status(peer.id, peer.addr))
            .collect()
    }

    /// The transport's counters since start.
    pub fn stats(&self) -> TransportStats {
        self.context.stats.snapshot()
    }

    /// Set this node's label, which every peer's [`crate::Handler::label`] receives: at once
    /// when it changed, after each handshake, and with every ping. Refuses a label over
    /// [`LABEL_BYTES_MAX`] (the receiver would drop the connection).
    pub fn set_label(&self, label: Bytes) -> Result<(), NetError> {
        if label.len() > LABEL_BYTES_MAX {
            return Err(NetError::LabelTooLarge {
                size_bytes: label.len(),
                limit_bytes: LABEL_BYTES_MAX,
            });
        }
        if !self.context.replace_label(label.clone()) {
            return Ok(());
        }
        let frame = Frame::Label { label };
        for peer in self.context.peers() {
            if let Some(connection) = peer.current() {
                // A full write queue drops it: the next ping carries it again.
                let _ = connection.try_send(&frame);
            }
        }
        Ok(())
    }

    /// Reads the mutual-TLS files again ([`crate::ClusterTls::reload`]): connections made from
    /// now on use the new certificate, key and CA; open ones keep their session. `Ok(false)`
    /// without TLS (nothing to read). On an error nothing changes.
    pub fn reload_tls(&self) -> Result<bool, NetError> {
        match &self.context.options.tls {
            Some(tls) => tls.reload().map(|()| true),
            None => Ok(false),
        }
    }

    /// Stops every task and closes every connection (outstanding calls get
    /// [`NetError::Closed`]). Dropping the last handle does the same.
    pub fn shutdown(&self) {
        self._guard.0.send_replace(true);
    }

    fn peer(&self, to: NodeId) -> Result<Arc<Peer>, NetError> {
        self.context.peer(to).ok_or(NetError::UnknownPeer { to })
    }

    fn check_size(&self, size_bytes: usize) -> Result<(), NetError> {
        let limit_bytes = self.context.options.frame_size_bytes_max;
        let length = size_bytes.saturating_sub(crate::frame::LENGTH_SIZE);
        if length > limit_bytes as usize {
            return Err(NetError::TooLarge {
                size_bytes: length as u64,
                limit_bytes,
            });
        }
        Ok(())
    }
}

/// Starts `peer`'s dialer if this node is the one to dial (the lower id of the pair).
fn spawn_dialer(context: &Arc<Context>, peer: Arc<Peer>) {
    if context.node_id < peer.id {
        tokio::spawn(run_dialer(Arc::clone(context), peer));
    }
}

fn timed_out(to: NodeId, timeout: Duration) -> NetError {
    NetError::TimedOut {
        to,
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    }
}
