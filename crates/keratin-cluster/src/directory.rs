//! [`Directory`]: each node's client and admin addresses, by node id. A node learns its peers'
//! by asking them (the service's `HELLO`, `service.rs`) until each answered, and again every
//! [`REFRESH`] (a restarted peer may listen elsewhere). The broker names a leader's client
//! address in its "not the leader" answers from here.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a node tells its peers about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's id.
    pub id: u64,
    /// Its protocol listener, `host:port`.
    pub client: String,
    /// Its HTTP admin listener, `host:port`.
    pub admin: String,
}

/// A known node is asked again this often.
pub const REFRESH: Duration = Duration::from_secs(10);

/// See the module docs. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    nodes: Arc<RwLock<BTreeMap<u64, NodeInfo>>>,
}

impl Directory {
    /// Record what node `info.id` said.
    pub fn insert(&self, info: NodeInfo) {
        self.nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(info.id, info);
    }

    /// Node `id`, if known.
    pub fn get(&self, id: u64) -> Option<NodeInfo> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Node `id`'s client address, if known.
    pub fn client_addr(&self, id: u64) -> Option<String> {
        self.get(id).map(|info| info.client)
    }

    /// Every known node, by id.
    pub fn all(&self) -> Vec<NodeInfo> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}
