//! [`Context`]: what every task of one transport shares: this node's identity, the options, the
//! handler, the counters, the peers and the shutdown signal. Tasks hold it, never the public
//! [`crate::Transport`], so dropping the last `Transport` can shut them all down.
//!
//! The peers sit in a `std::sync::RwLock<BTreeMap>`: every call reads it once (a shared lock
//! and an `Arc` clone), while `Transport::add_peer`/`remove_peer` write it rarely. No guard is
//! ever held across an `.await`: readers clone the `Arc<Peer>` they need and let go.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::watch;

use crate::frame::Frame;
use crate::handler::Handler;
use crate::options::TransportOptions;
use crate::peer::Peer;
use crate::stats::Stats;
use crate::NodeId;

pub(crate) struct Context {
    pub(crate) node_id: NodeId,
    pub(crate) cluster_name: String,
    pub(crate) options: TransportOptions,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) stats: Arc<Stats>,
    peers: RwLock<BTreeMap<NodeId, Arc<Peer>>>,
    pub(crate) shutdown: watch::Receiver<bool>,
    generations: AtomicU64,
    /// When an unknown node's refusal was last logged at `info` (see `listener.rs`).
    unknown_node_logged: Mutex<Option<Instant>>,
    /// When a failed TLS handshake (or TLS on a plaintext port) was last logged at `warn`.
    tls_failure_logged: Mutex<Option<Instant>>,
    /// This node's label (`Transport::set_label`); empty: none yet, nothing is sent.
    label: Mutex<Bytes>,
}

impl Context {
    pub(crate) fn new(
        node_id: NodeId,
        cluster_name: String,
        options: TransportOptions,
        handler: Arc<dyn Handler>,
        peers: BTreeMap<NodeId, Arc<Peer>>,
        shutdown: watch::Receiver<bool>,
    ) -> Context {
        Context {
            node_id,
            cluster_name,
            options,
            handler,
            stats: Arc::new(Stats::default()),
            peers: RwLock::new(peers),
            shutdown,
            generations: AtomicU64::new(1),
            unknown_node_logged: Mutex::new(None),
            tls_failure_logged: Mutex::new(None),
            label: Mutex::new(Bytes::new()),
        }
    }

    /// This node's label as a frame to send, unless it has none.
    pub(crate) fn label_frame(&self) -> Option<Frame> {
        let label = self
            .label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        (!label.is_empty()).then_some(Frame::Label { label })
    }

    /// Replace this node's label; whether it changed.
    pub(crate) fn replace_label(&self, label: Bytes) -> bool {
        let mut current = self.label.lock().unwrap_or_else(PoisonError::into_inner);
        let changed = *current != label;
        *current = label;
        changed
    }

    /// The peer `id`, if it is one now.
    pub(crate) fn peer(&self, id: NodeId) -> Option<Arc<Peer>> {
        self.read_peers().get(&id).cloned()
    }

    /// Every peer now, by id.
    pub(crate) fn peers(&self) -> Vec<Arc<Peer>> {
        self.read_peers().values().cloned().collect()
    }

    // A panic while holding the map's lock (none of its critical sections can panic but an
    // allocation failure) leaves the map whole: each writer makes one insert or remove.
    fn read_peers(&self) -> RwLockReadGuard<'_, BTreeMap<NodeId, Arc<Peer>>> {
        self.peers.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn write_peers(&self) -> RwLockWriteGuard<'_, BTreeMap<NodeId, Arc<Peer>>> {
        self.peers.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `interval` has passed since an unknown node's refusal was last logged at `info`;
    /// if so, the caller logs it now.
    pub(crate) fn unknown_node_log_due(&self, interval: Duration) -> bool {
        log_due(&self.unknown_node_logged, interval)
    }

    /// The same for failed TLS handshakes, logged at `warn` when due.
    pub(crate) fn tls_failure_log_due(&self, interval: Duration) -> bool {
        log_due(&self.tls_failure_logged, interval)
    }

    /// A number for a new connection, unique within this transport.
    pub(crate) fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::Relaxed)
    }

    /// A receiver that resolves when the transport shuts down.
    pub(crate) fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.clone()
    }
}

/// Whether `interval` has passed since `last`; if so, `last` becomes now.
fn log_due(last: &Mutex<Option<Instant>>, interval: Duration) -> bool {
    let mut last = last.lock().unwrap_or_else(PoisonError::into_inner);
    let now = Instant::now();
    let due = last.is_none_or(|at| now.duration_since(at) >= interval);
    if due {
        *last = Some(now);
    }
    due
}

/// Resolves when the transport shuts down (or its last handle is gone).
pub(crate) async fn wait_shutdown(signal: &mut watch::Receiver<bool>) {
    let _ = signal.wait_for(|down| *down).await;
}
