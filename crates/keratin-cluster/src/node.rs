//! [`ClusterNode`]: a node's cluster membership from start to stop. Two steps, because the
//! broker sits in between: [`ClusterNode::prepare`] starts the transport and gives the hooks
//! the broker is opened with ([`PreparedCluster`]); [`ClusterNode::start`], given the opened
//! broker, starts this node's member of the metadata group, the applier and the directory.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use keratin_broker::partition::log::{
    ClusterMetadata, PartitionLog, PartitionLogs, PartitionPlace,
};
use keratin_broker::{Broker, BrokerResult};
use keratin_net::{ResolvedCluster, Transport, TransportOptions};
use keratin_raft::network::Groups;
use tokio::sync::watch;

use crate::applier::{self, AppliedState};
use crate::directory::{Directory, NodeInfo, REFRESH};
use crate::elsewhere::ElsewhereLog;
use crate::hook::MetadataHook;
use crate::meta::{MetaGroup, META_VOTERS_MAX};
use crate::service::{ClusterService, KIND_HELLO, SERVICE_GROUP};

/// The directory asks a peer that has not answered yet this often.
const HELLO_RETRY: Duration = Duration::from_millis(250);

/// The metadata group's logs, under the first storage directory.
pub const META_DIR_NAME: &str = "cluster-meta";

/// Opens this node's replicated partition logs (the replication adapter's provider), given the
/// transport, the node's groups handler and the directory.
pub type MakePartitionLogs =
    Box<dyn FnOnce(&Transport, &Arc<Groups>, &Directory) -> Arc<dyn PartitionLogs> + Send>;

/// The transport is up; the broker is opened with [`PreparedCluster::partition_logs`] and
/// [`PreparedCluster::metadata`], then given to [`ClusterNode::start`].
pub struct PreparedCluster {
    cluster: ResolvedCluster,
    transport: Transport,
    groups: Arc<Groups>,
    directory: Directory,
    own: Arc<OnceLock<NodeInfo>>,
    meta: Arc<OnceLock<Arc<MetaGroup>>>,
    applied: Arc<AppliedState>,
    /// For `BrokerConfig::partition_logs`.
    pub partition_logs: Arc<dyn PartitionLogs>,
    /// For `BrokerConfig::cluster_metadata`.
    pub metadata: Arc<dyn ClusterMetadata>,
}

/// A cluster node, running. See the module docs.
#[derive(Debug)]
pub struct ClusterNode {
    cluster: ResolvedCluster,
    transport: Transport,
    groups: Arc<Groups>,
    directory: Directory,
    meta: Arc<MetaGroup>,
    applied: Arc<AppliedState>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// One node as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeStatus {
    /// Its id.
    pub id: u64,
    /// Its cluster address.
    pub cluster_addr: String,
    /// Its client and admin addresses, once it told them.
    pub info: Option<NodeInfo>,
    /// This node, or a peer with a connection up.
    pub reachable: bool,
    /// It leads the metadata group.
    pub meta_leader: bool,
}

/// The cluster as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ClusterStatus {
    /// This node's id.
    pub node_id: u64,
    /// The cluster's name.
    pub name: String,
    /// Every node, by id.
    pub nodes: Vec<NodeStatus>,
    /// The metadata group's leader, if known.
    pub meta_leader: Option<u64>,
    /// Metadata records applied here (one past the last).
    pub meta_applied: u64,
}

/// Opens a partition's log: replicated where this node holds a replica, an empty follower
/// pointing at the replicas elsewhere.
struct ClusterLogs {
    node_id: u64,
    directory: Directory,
    replicated: Arc<dyn PartitionLogs>,
}

impl PartitionLogs for ClusterLogs {
    fn open(&self, place: &PartitionPlace) -> BrokerResult<Arc<dyn PartitionLog>> {
        if place.replicas.contains(&self.node_id) {
            return self.replicated.open(place);
        }
        let first = place.replicas.first().copied().unwrap_or_default();
        Ok(Arc::new(ElsewhereLog::new(
            place.queue.clone(),
            place.index,
            first,
            self.directory.clone(),
        )))
    }
}

impl ClusterNode {
    /// Start the transport on `cluster.listen` and build the broker's hooks. Refuses a cluster
    /// of more than [`META_VOTERS_MAX`] nodes (learners of the metadata group are not built).
    pub async fn prepare(
        cluster: ResolvedCluster,
        options: TransportOptions,
        make_partition_logs: MakePartitionLogs,
    ) -> Result<PreparedCluster, String> {
        let nodes = cluster.peers.len() + 1;
        if nodes > META_VOTERS_MAX {
            return Err(format!(
                "the cluster lists {nodes} nodes; this version runs clusters of at most \
                 {META_VOTERS_MAX} (every node votes in the metadata group)"
            ));
        }
        let groups = Arc::new(Groups::new());
        let directory = Directory::default();
        let own = Arc::new(OnceLock::new());
        let meta = Arc::new(OnceLock::new());
        groups.insert(
            SERVICE_GROUP,
            Arc::new(ClusterService {
                own: own.clone(),
                directory: directory.clone(),
                meta: meta.clone(),
            }),
        );
        let transport = Transport::start(cluster.clone(), options, groups.clone())
            .await
            .map_err(|e| format!("cluster transport: {e}"))?;
        let replicated = make_partition_logs(&transport, &groups, &directory);
        let applied = Arc::new(AppliedState::new());
        let mut ids: Vec<u64> = cluster.peers.keys().copied().collect();
        ids.push(cluster.node_id);
        ids.sort_unstable();
        let metadata = Arc::new(MetadataHook {
            nodes: ids,
            directory: directory.clone(),
            meta: meta.clone(),
            applied: applied.clone(),
        });
        Ok(PreparedCluster {
            partition_logs: Arc::new(ClusterLogs {
                node_id: cluster.node_id,
                directory: directory.clone(),
                replicated,
            }),
            metadata,
            cluster,
            transport,
            groups,
            directory,
            own,
            meta,
            applied,
        })
    }

    /// Join the metadata group and start applying it to `broker` (opened with the prepared
    /// hooks); `own` is this node's client and admin address.
    pub async fn start(
        prepared: PreparedCluster,
        broker: Broker,
        own: NodeInfo,
    ) -> Result<ClusterNode, String> {
        let PreparedCluster {
            cluster,
            transport,
            groups,
            directory,
            own: own_cell,
            meta: meta_cell,
            applied,
            ..
        } = prepared;
        directory.insert(own.clone());
        let _ = own_cell.set(own);
        let mut voters: BTreeMap<u64, String> = cluster
            .peers
            .iter()
            .map(|(id, addr)| (*id, addr.to_string()))
            .collect();
        voters.insert(cluster.node_id, cluster.listen.to_string());
        let config = broker.config();
        let dir = config
            .dirs
            .first()
            .ok_or("no storage directory")?
            .join(META_DIR_NAME);
        let meta = Arc::new(
            MetaGroup::start(
                cluster.node_id,
                &dir,
                config.io.clone(),
                broker.pool().clone(),
                config.segment_size_bytes,
                transport.clone(),
                &groups,
                &cluster.name,
                voters,
                config.clock.clone(),
            )
            .await?,
        );
        let _ = meta_cell.set(meta.clone());
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(applier::run(
            meta.clone(),
            broker,
            applied.clone(),
            stopped.clone(),
        )));
        for (&peer, &addr) in &cluster.peers {
            if peer == cluster.node_id {
                continue;
            }
            tasks.push(tokio::spawn(learn_peer(
                transport.clone(),
                directory.clone(),
                peer,
                addr,
                stopped.clone(),
            )));
        }
        Ok(ClusterNode {
            cluster,
            transport,
            groups,
            directory,
            meta,
            applied,
            stop,
            tasks,
        })
    }

    /// The nodes whose addresses are known (this one included), by id.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.directory.all()
    }

    /// This node's resource level (`normal`, `soft`, `hard`, `reserve`) and the free bytes of
    /// its fullest data file system, as its `HELLO` tells the others (placement).
    pub fn set_health(&self, level: &str, free_bytes: u64) {
        self.directory
            .set_health(self.cluster.node_id, level, free_bytes);
    }

    /// The directory of node addresses (shared, it fills as peers answer).
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// This node's id.
    pub fn node_id(&self) -> u64 {
        self.cluster.node_id
    }

    /// The cluster as this node sees it.
    pub async fn status(&self) -> ClusterStatus {
        let meta_leader = self.meta.leader().await;
        let mut nodes = vec![NodeStatus {
            id: self.cluster.node_id,
            cluster_addr: self.cluster.listen.to_string(),
            info: self.directory.get(self.cluster.node_id),
            reachable: true,
            meta_leader: meta_leader == Some(self.cluster.node_id),
        }];
        for peer in self.transport.peers_status() {
            nodes.push(NodeStatus {
                id: peer.id,
                cluster_addr: peer.addr.to_string(),
                info: self.directory.get(peer.id),
                reachable: peer.connected,
                meta_leader: meta_leader == Some(peer.id),
            });
        }
        nodes.sort_by_key(|n| n.id);
        ClusterStatus {
            node_id: self.cluster.node_id,
            name: self.cluster.name.clone(),
            nodes,
            meta_leader,
            meta_applied: self.applied.applied(),
        }
    }

    /// Stop the applier, the directory and this node's member of the metadata group. The
    /// broker (and with it the partition groups) is shut down by its owner before this; the
    /// transport goes last.
    pub async fn shutdown(self) {
        self.stop.send_replace(true);
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
        match Arc::try_unwrap(self.meta) {
            Ok(meta) => meta.shutdown(&self.groups).await,
            Err(_) => tracing::warn!("the metadata group is still in use at shutdown"),
        }
        self.groups.remove(SERVICE_GROUP);
        self.transport.shutdown();
    }
}

/// Ask `peer` who it is until it answers, then again every [`REFRESH`].
async fn learn_peer(
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
