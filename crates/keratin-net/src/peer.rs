//! [`Peer`]: everything this node keeps about one other node: its address, the slot holding the
//! current connection (at most one; a newer one replaces and closes the older), its liveness, the
//! group heartbeats waiting for the next tick, and whether it is still a peer ([`Standing`]).
//! Dialing belongs to `dialer.rs`, accepting to `listener.rs`; both install connections here.
//!
//! A `Peer` never changes address: `Transport::add_peer` with a new address retires the old
//! `Peer` ([`Standing::Moved`]) and puts a fresh one in the map, and `Transport::remove_peer`
//! retires it ([`Standing::Removed`]). A retired peer's dialer and session watch its standing
//! and end, so nothing of it outlives the calls that still hold it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use crate::connection::{lock, CloseMode, Connection, Waiter};
use crate::liveness::Liveness;
use crate::{GroupId, NetError, NodeId};

/// One group's heartbeat waiting for the next tick: the newest payload and its caller.
pub(crate) type PendingHeartbeats = HashMap<GroupId, (Bytes, Waiter)>;

/// Whether a [`Peer`] is still one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// In the transport's map: dialed (if ours to dial) and accepted.
    Active,
    /// Replaced by a `Peer` with another address for the same node.
    Moved,
    /// Removed from the transport's peers.
    Removed,
}

pub(crate) struct Peer {
    pub(crate) id: NodeId,
    pub(crate) addr: SocketAddr,
    pub(crate) liveness: Arc<Liveness>,
    pub(crate) heartbeats: Mutex<PendingHeartbeats>,
    slot: watch::Sender<Option<Arc<Connection>>>,
    standing: watch::Sender<Standing>,
}

impl Peer {
    pub(crate) fn new(id: NodeId, addr: SocketAddr, liveness: Liveness) -> Peer {
        Peer {
            id,
            addr,
            liveness: Arc::new(liveness),
            heartbeats: Mutex::new(HashMap::new()),
            slot: watch::Sender::new(None),
            standing: watch::Sender::new(Standing::Active),
        }
    }

    pub(crate) fn standing(&self) -> Standing {
        *self.standing.borrow()
    }

    /// A receiver for [`wait_retired`].
    pub(crate) fn standing_signal(&self) -> watch::Receiver<Standing> {
        self.standing.subscribe()
    }

    /// Ends the peer's life: its dialer and session stop (they watch the standing), its
    /// connection closes now (waiting calls fail at once), and its heartbeats waiting for the
    /// tick fail. `standing` is `Moved` or `Removed`. Called once, by the transport, after it
    /// took the peer out of its map.
    pub(crate) fn retire(&self, standing: Standing) {
        debug_assert!(standing != Standing::Active);
        self.standing.send_replace(standing);
        // Cloned out first, so the slot's read lock is not held while closing.
        let connection = self.slot.borrow().clone();
        if let Some(connection) = connection {
            connection.close(CloseMode::Now);
        }
        // `enqueue` checks the standing under this lock, so nothing is left behind after this.
        let pending = std::mem::take(&mut *lock(&self.heartbeats));
        for (_, (_, waiter)) in pending {
            let _ = waiter.send(Err(self.unreachable()));
        }
    }

    /// The current connection, if one is up.
    pub(crate) fn current(&self) -> Option<Arc<Connection>> {
        self.slot
            .borrow()
            .clone()
            .filter(|connection| !connection.is_closed())
    }

    /// Makes `connection` the peer's connection, closing the one it replaces.
    pub(crate) fn install(&self, connection: Arc<Connection>) {
        let old = self.slot.send_replace(Some(connection));
        self.liveness.connected();
        if let Some(old) = old {
            old.close(CloseMode::Now);
        }
    }

    /// Empties the slot if it still holds the connection of `generation`.
    pub(crate) fn uninstall(&self, generation: u64) {
        let removed = self.slot.send_if_modified(|current| {
            let ours = current
                .as_ref()
                .is_some_and(|connection| connection.generation == generation);
            if ours {
                *current = None;
            }
            ours
        });
        if removed {
            self.liveness.disconnected();
        }
    }

    /// Waits up to `timeout` for a connection; fails at once when the peer is retired.
    pub(crate) async fn wait_connected(&self, timeout: Duration) -> Result<(), NetError> {
        let mut slot = self.slot.subscribe();
        let mut standing = self.standing_signal();
        let connected = async move {
            tokio::select! {
                connected = slot.wait_for(|current| current.is_some()) => connected.is_ok(),
                _ = wait_retired(&mut standing) => false,
            }
        };
        match tokio::time::timeout(timeout, connected).await {
            Ok(true) if self.standing() == Standing::Active => Ok(()),
            _ => Err(self.unreachable()),
        }
    }

    pub(crate) fn unreachable(&self) -> NetError {
        let reason = match self.standing() {
            Standing::Removed => "removed from this node's peers".to_string(),
            Standing::Moved => format!("its address changed from {}; retry", self.addr),
            Standing::Active => self
                .liveness
                .error()
                .unwrap_or_else(|| "not connected (yet)".to_string()),
        };
        NetError::Unreachable {
            to: self.id,
            reason,
        }
    }

    /// A call's or heartbeat's result, with `Closed` turned into `Unreachable` once the peer is
    /// removed: its connection was closed on purpose and will not come back.
    pub(crate) fn unless_removed(
        &self,
        result: Result<Bytes, NetError>,
    ) -> Result<Bytes, NetError> {
        match result {
            Err(NetError::Closed { .. }) if self.standing() == Standing::Removed => {
                Err(self.unreachable())
            }
            other => other,
        }
    }
}

/// Resolves once the peer is retired (moved or removed).
pub(crate) async fn wait_retired(signal: &mut watch::Receiver<Standing>) {
    let _ = signal
        .wait_for(|standing| *standing != Standing::Active)
        .await;
}
