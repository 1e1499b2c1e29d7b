//! [`Peer`]: everything this node keeps about one other node: its address, the slot holding the
//! current connection (at most one; a newer one replaces and closes the older), its liveness, and
//! the group heartbeats waiting for the next tick. Dialing belongs to `dialer.rs`, accepting to
//! `listener.rs`; both install connections here.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use crate::connection::{CloseMode, Connection, Waiter};
use crate::liveness::Liveness;
use crate::{GroupId, NetError, NodeId};

/// One group's heartbeat waiting for the next tick: the newest payload and its caller.
pub(crate) type PendingHeartbeats = HashMap<GroupId, (Bytes, Waiter)>;

pub(crate) struct Peer {
    pub(crate) id: NodeId,
    pub(crate) addr: SocketAddr,
    pub(crate) liveness: Arc<Liveness>,
    pub(crate) heartbeats: Mutex<PendingHeartbeats>,
    slot: watch::Sender<Option<Arc<Connection>>>,
}

impl Peer {
    pub(crate) fn new(id: NodeId, addr: SocketAddr, liveness: Liveness) -> Peer {
        Peer {
            id,
            addr,
            liveness: Arc::new(liveness),
            heartbeats: Mutex::new(HashMap::new()),
            slot: watch::Sender::new(None),
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

    /// Waits up to `timeout` for a connection.
    pub(crate) async fn wait_connected(&self, timeout: Duration) -> Result<(), NetError> {
        let mut slot = self.slot.subscribe();
        let connected = async move { slot.wait_for(|current| current.is_some()).await.is_ok() };
        match tokio::time::timeout(timeout, connected).await {
            Ok(true) => Ok(()),
            _ => Err(self.unreachable()),
        }
    }

    pub(crate) fn unreachable(&self) -> NetError {
        let reason = self
            .liveness
            .error()
            .unwrap_or_else(|| "not connected (yet)".to_string());
        NetError::Unreachable {
            to: self.id,
            reason,
        }
    }
}
