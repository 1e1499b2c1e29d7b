//! [`Context`]: what every task of one transport shares: this node's identity, the options, the
//! handler, the counters, the peers and the shutdown signal. Tasks hold it, never the public
//! [`crate::Transport`], so dropping the last `Transport` can shut them all down.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

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
    pub(crate) peers: BTreeMap<NodeId, Arc<Peer>>,
    pub(crate) shutdown: watch::Receiver<bool>,
    generations: AtomicU64,
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
            peers,
            shutdown,
            generations: AtomicU64::new(1),
        }
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

/// Resolves when the transport shuts down (or its last handle is gone).
pub(crate) async fn wait_shutdown(signal: &mut watch::Receiver<bool>) {
    let _ = signal.wait_for(|down| *down).await;
}
