//! [`Directory`]: each node's client and admin addresses, by node id. A node learns its peers'
//! by asking them (the service's `HELLO`, `service.rs`) until each answered, and again every
//! [`REFRESH`] (a restarted peer may listen elsewhere). The broker names a leader's client
//! address in its "not the leader" answers from here.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use keratin_net::Transport;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::service::{KIND_HELLO, SERVICE_GROUP};

/// The directory asks a peer that has not answered yet this often.
const HELLO_RETRY: Duration = Duration::from_millis(250);

/// What a node tells its peers about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's id.
    pub id: u64,
    /// Its protocol listener, `host:port`.
    pub client: String,
    /// Its HTTP admin listener, `host:port`.
    pub admin: String,
    /// The name it gives clients in its handshake (`ServerHello.node_id`); absent from nodes
    /// that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its worst resource level (`normal`, `soft`, `hard`, `reserve`) when it last answered;
    /// placement gives no new replicas to a node at `soft` or worse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<String>,
    /// Free bytes of its fullest data file system when it last answered; placement prefers
    /// the nodes with the most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
}

impl NodeInfo {
    /// What a peer told about itself, with every address it bound on an unspecified IP
    /// (`0.0.0.0`, `::`) told as the IP this node reaches it at (`cluster`, its cluster
    /// address): the others hand these addresses to clients, who cannot dial a wildcard.
    pub fn reachable_via(mut self, cluster: SocketAddr) -> NodeInfo {
        let fix = |addr: &mut String| {
            if let Ok(bound) = addr.parse::<SocketAddr>() {
                if bound.ip().is_unspecified() {
                    *addr = SocketAddr::new(cluster.ip(), bound.port()).to_string();
                }
            }
        };
        fix(&mut self.client);
        fix(&mut self.admin);
        self
    }
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

    /// Update node `id`'s resource level and free bytes (this node's own, sampled locally, or a
    /// peer's from its label).
    pub fn set_health(&self, id: u64, level: &str, free_bytes: u64) {
        let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
        if let Some(info) = nodes.get_mut(&id) {
            info.level = Some(level.to_string());
            info.free_bytes = Some(free_bytes);
        }
    }

    /// Every known node but `id`, by id.
    pub fn others(&self, id: u64) -> Vec<NodeInfo> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|info| info.id != id)
            .cloned()
            .collect()
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

/// Ask `peer` who it is until it answers, then again every [`REFRESH`].
pub(crate) async fn learn_peer(
    transport: Transport,
    directory: Directory,
    peer: u64,
    peer_addr: std::net::SocketAddr,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let answer = transport
            .call(
                peer,
                SERVICE_GROUP,
                KIND_HELLO,
                Bytes::new(),
                HELLO_RETRY * 4,
            )
            .await;
        let pause = match answer.map(|body| serde_json::from_slice::<NodeInfo>(&body)) {
            Ok(Ok(info)) if info.id == peer => {
                directory.insert(info.reachable_via(peer_addr));
                REFRESH
            }
            Ok(Ok(info)) => {
                tracing::warn!(
                    peer,
                    answered = info.id,
                    "a peer answered with another node id"
                );
                REFRESH
            }
            _ => HELLO_RETRY,
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(client: &str, admin: &str) -> NodeInfo {
        NodeInfo {
            id: 2,
            client: client.into(),
            admin: admin.into(),
            name: Some("b".into()),
            level: None,
            free_bytes: None,
        }
    }

    #[test]
    fn wildcard_addresses_are_told_as_the_cluster_address_ip() {
        let cluster: SocketAddr = "10.0.0.2:5690".parse().unwrap();
        let fixed = info("0.0.0.0:5680", "[::]:5681").reachable_via(cluster);
        assert_eq!(fixed.client, "10.0.0.2:5680");
        assert_eq!(fixed.admin, "10.0.0.2:5681");
        let kept = info("10.9.9.9:5680", "name-not-an-ip:5681").reachable_via(cluster);
        assert_eq!(kept, info("10.9.9.9:5680", "name-not-an-ip:5681"));
    }

    #[test]
    fn a_hello_without_a_name_still_decodes() {
        let old: NodeInfo =
            serde_json::from_str(r#"{"id": 2, "client": "a:1", "admin": "a:2"}"#).unwrap();
        assert_eq!(old.name, None);
    }
}
