//! [`ClusterNode`]: a node's cluster membership from start to stop. Two steps, because the
//! broker sits in between: [`ClusterNode::prepare`] starts the transport and gives the hooks
//! the broker is opened with ([`PreparedCluster`]); [`ClusterNode::start`], given the opened
//! broker, starts this node's member of the metadata group, the applier and the directory.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, OnceLock};

use keratin_auth::{UserChange, UserTable};
use keratin_broker::partition::log::{
    ClusterMetadata, PartitionLog, PartitionLogs, PartitionPlace,
};
use keratin_broker::{Broker, BrokerResult};
use keratin_limits::NodeReport;
use keratin_net::{ResolvedCluster, Transport, TransportOptions};
use keratin_raft::network::Groups;
use keratin_raft::partition_log::ReplicatedLogs;
use tokio::sync::watch;

use crate::applier::{self, AppliedState, ApplyContext};
use crate::balance::{Balancer, RebalanceReport, REBALANCE_WAIT};
use crate::dead_letters::ClusterDeadLetters;
use crate::directory::{Directory, NodeInfo};
use crate::elsewhere::ElsewhereLog;
use crate::hook::MetadataHook;
use crate::hook::METADATA_TIMEOUT;
use crate::join::{plan_rebalance, AddNodeError};
use crate::levels::{ClusterLevels, NodeLabel};
use crate::meta::{meta_voters, MetaGroup};
use crate::moves::{plan_move, MoveReplicaError};
use crate::placement::eligible;
use crate::purge::ClusterPurge;
use crate::reconcile::Reconciler;
use crate::records::ClusterRecord;
use crate::remove::{plan_removal, PlannedMove, RemoveNodeError};
use crate::service::{ClusterService, KIND_REBALANCE, SERVICE_GROUP};

/// The metadata group's logs, under the first storage directory.
pub const META_DIR_NAME: &str = "cluster-meta";

/// How long a node asked to rebalance has to answer: its own wait for the new leaders, and a
/// margin for the hand-overs asked before it.
const REBALANCE_CALL_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(REBALANCE_WAIT.as_secs() + 5);

/// At most this many nodes in a cluster: [`crate::META_VOTERS_MAX`] of them vote in the
/// metadata group, the others follow it as learners; every node keeps one connection to every
/// other (`keratin-net`), so the bound keeps a node's connections and heartbeats bounded.
pub const CLUSTER_NODES_MAX: usize = 32;

/// Opens this node's replicated partition logs (the replication adapter's provider), given the
/// transport, the node's groups handler and the directory.
pub type MakePartitionLogs =
    Box<dyn FnOnce(&Transport, &Arc<Groups>, &Directory) -> Arc<ReplicatedLogs> + Send>;

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
    replicated: Arc<ReplicatedLogs>,
    levels: ClusterLevels,
    join: bool,
    leader_balance: watch::Receiver<bool>,
    balancer: Arc<OnceLock<Arc<Balancer>>>,
    /// Serves and sends purges; the broker is attached at start.
    purge: Arc<ClusterPurge>,
    /// For `BrokerConfig::partition_logs`.
    pub partition_logs: Arc<dyn PartitionLogs>,
    /// For `BrokerConfig::cluster_metadata`.
    pub metadata: Arc<dyn ClusterMetadata>,
    /// For `BrokerConfig::dead_letters`: dead-letter copies go to their partition's leader.
    pub dead_letters: Arc<ClusterDeadLetters>,
}

impl PreparedCluster {
    /// Every node's resource report as this node hears it (for the publish gate, which exists
    /// before the cluster starts).
    pub fn levels(&self) -> &ClusterLevels {
        &self.levels
    }

    /// This node joins a running cluster (`[cluster] join`): it never forms the metadata
    /// group, it waits for `keratin cluster add-node` to admit it.
    pub fn joining(mut self, join: bool) -> PreparedCluster {
        self.join = join;
        self
    }

    /// Hand partitions back to their preferred leaders while `on` says so (the runtime
    /// setting `cluster.leader_balance` as in force on this node, on by default;
    /// `docs/cluster.md`, "Leader balancing").
    pub fn leader_balance(mut self, on: watch::Receiver<bool>) -> PreparedCluster {
        self.leader_balance = on;
        self
    }
}

/// The nodes a cluster was formed with, by id, with their cluster addresses: the `[cluster]`
/// peers and this node.
fn formed(cluster: &ResolvedCluster) -> BTreeMap<u64, String> {
    let mut nodes: BTreeMap<u64, String> = cluster
        .peers
        .iter()
        .map(|(id, addr)| (*id, addr.to_string()))
        .collect();
    nodes.insert(cluster.node_id, cluster.listen.to_string());
    nodes
}

/// A report's worst level, and the free bytes (spares included) of its fullest file system.
fn health_of(report: &NodeReport) -> (keratin_limits::Level, u64) {
    let free_bytes = report
        .filesystems
        .iter()
        .map(|fs| fs.free_bytes.saturating_add(fs.spare_bytes))
        .min()
        .unwrap_or(0);
    (report.level(), free_bytes)
}

/// Where peers' labels go: the cluster's levels, and the directory's level and free bytes
/// (placement reads those; labels refresh them sooner than `HELLO`).
fn label_sink(levels: ClusterLevels, directory: Directory) -> keratin_raft::network::LabelSink {
    Arc::new(move |from, label| {
        levels.heard(from, &label);
        if let Some(heard) = levels.get(from) {
            let (level, free_bytes) = health_of(&heard.report);
            directory.set_health(from, level.as_str(), free_bytes);
        }
    })
}

/// A cluster node, running. See the module docs.
#[derive(Debug)]
pub struct ClusterNode {
    cluster: ResolvedCluster,
    transport: Transport,
    groups: Arc<Groups>,
    directory: Directory,
    levels: ClusterLevels,
    meta: Arc<MetaGroup>,
    applied: Arc<AppliedState>,
    /// The nodes the cluster was formed with (the catalog adds and removes nodes).
    formed: BTreeMap<u64, String>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Hands partitions back to their preferred leaders.
    balancer: Arc<Balancer>,
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
    /// It was removed from the cluster (`keratin cluster remove-node`).
    pub removed: bool,
    /// Its resources as it last reported them (its label), `None` until heard.
    pub levels: Option<NodeReport>,
    /// How long ago that report arrived, in ms (0 for this node).
    pub levels_age_ms: Option<u64>,
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
    /// The metadata group's voters in the membership this node knows committed.
    pub meta_voters: Vec<u64>,
    /// Its learners in that membership: the nodes beyond [`crate::META_VOTERS_MAX`] voters
    /// (and, for a moment, a node being added or a removed one).
    pub meta_learners: Vec<u64>,
}

/// Opens a partition's log: replicated where this node holds a replica, an empty follower
/// pointing at the replicas elsewhere.
struct ClusterLogs {
    node_id: u64,
    directory: Directory,
    replicated: Arc<ReplicatedLogs>,
}

impl PartitionLogs for ClusterLogs {
    fn open(&self, place: &PartitionPlace) -> BrokerResult<Arc<dyn PartitionLog>> {
        if place.replicas.contains(&self.node_id) {
            return self.replicated.open(place);
        }
        // What a replica this node no longer holds left behind (it stopped between the
        // partition's move and the removal of its files) goes.
        self.replicated.remove_leftover(place)?;
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
    /// of more than [`CLUSTER_NODES_MAX`] nodes.
    pub async fn prepare(
        cluster: ResolvedCluster,
        options: TransportOptions,
        make_partition_logs: MakePartitionLogs,
    ) -> Result<PreparedCluster, String> {
        let nodes = cluster.peers.len() + 1;
        if nodes > CLUSTER_NODES_MAX {
            return Err(format!(
                "the cluster lists {nodes} nodes; this version runs clusters of at most \
                 {CLUSTER_NODES_MAX}"
            ));
        }
        let groups = Arc::new(Groups::new());
        let directory = Directory::default();
        let own = Arc::new(OnceLock::new());
        let meta = Arc::new(OnceLock::new());
        let balancer = Arc::new(OnceLock::new());
        let dead_letters = Arc::new(ClusterDeadLetters::new(cluster.node_id));
        let purge_cell = Arc::new(OnceLock::new());
        groups.insert(
            SERVICE_GROUP,
            Arc::new(ClusterService {
                own: own.clone(),
                directory: directory.clone(),
                meta: meta.clone(),
                balancer: balancer.clone(),
                dead_letters: dead_letters.clone(),
                purge: purge_cell.clone(),
            }),
        );
        let levels = ClusterLevels::new(cluster.node_id);
        groups.on_label(label_sink(levels.clone(), directory.clone()));
        let transport = Transport::start(cluster.clone(), options, groups.clone())
            .await
            .map_err(|e| format!("cluster transport: {e}"))?;
        let purge = Arc::new(ClusterPurge::new(
            cluster.node_id,
            transport.clone(),
            directory.clone(),
        ));
        let _ = purge_cell.set(purge.clone());
        let replicated = make_partition_logs(&transport, &groups, &directory);
        let applied = Arc::new(AppliedState::new());
        let metadata = Arc::new(MetadataHook {
            formed: formed(&cluster),
            directory: directory.clone(),
            meta: meta.clone(),
            applied: applied.clone(),
            purge: purge.clone(),
        });
        Ok(PreparedCluster {
            partition_logs: Arc::new(ClusterLogs {
                node_id: cluster.node_id,
                directory: directory.clone(),
                replicated: replicated.clone(),
            }),
            replicated,
            dead_letters,
            levels,
            join: false,
            leader_balance: watch::channel(true).1,
            balancer,
            purge,
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
            replicated,
            dead_letters,
            levels,
            join,
            leader_balance,
            balancer: balancer_cell,
            purge,
            ..
        } = prepared;
        dead_letters.attach(&broker, transport.clone());
        purge.attach(broker.downgrade());
        directory.insert(own.clone());
        let _ = own_cell.set(own);
        let voters = formed(&cluster);
        // The first voters form the metadata group; a node beyond them starts like a joining
        // one and the group's leader makes it a learner (`reconcile`).
        let forming = meta_voters(&voters, &BTreeSet::new());
        let forms = !join && forming.contains_key(&cluster.node_id);
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
                forms.then(|| forming.clone()),
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
            ApplyContext {
                node_id: cluster.node_id,
                logs: replicated.clone(),
                transport: transport.clone(),
                directory: directory.clone(),
            },
            applied.clone(),
            stopped.clone(),
        )));
        let balancer = Arc::new(Balancer::new(
            cluster.node_id,
            replicated.clone(),
            applied.clone(),
            leader_balance,
        ));
        let _ = balancer_cell.set(balancer.clone());
        let reconciler = Reconciler::new(replicated, meta.clone(), applied.clone(), voters.clone())
            .balancing(balancer.clone());
        tasks.push(tokio::spawn(reconciler.run(stopped.clone())));
        for (&peer, &addr) in &cluster.peers {
            if peer == cluster.node_id {
                continue;
            }
            tasks.push(tokio::spawn(crate::directory::learn_peer(
                transport.clone(),
                directory.clone(),
                peer,
                addr,
                stopped.clone(),
            )));
        }
        Ok(ClusterNode {
            balancer,
            formed: voters,
            cluster,
            transport,
            groups,
            directory,
            levels,
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

    /// This node's resources at its last sample: its label tells every peer at once (their
    /// publish gates judge the partitions with a copy here by it), and its `HELLO` tells its
    /// worst level and the free bytes of its fullest data file system (placement).
    pub fn set_levels(&self, report: NodeReport) {
        let (level, free_bytes) = health_of(&report);
        self.directory
            .set_health(self.cluster.node_id, level.as_str(), free_bytes);
        // Replication catch-up stops at reserve: followed partitions leave the in-sync sets
        // rather than fill the last of the disk (`Groups::refuse_appends`).
        let refusal = report.at_reserve().map(|fs| {
            format!(
                "node {}'s file system {} is at its reserve level ({} MiB free): it takes no \
                 new entries for the partitions it follows until space is freed there",
                self.cluster.node_id,
                fs.path,
                fs.free_bytes.saturating_add(fs.spare_bytes) >> 20
            )
        });
        self.groups.refuse_appends(refusal);
        self.levels.insert(self.cluster.node_id, report.clone());
        let label = NodeLabel { levels: report }.encode();
        if let Err(error) = self.transport.set_label(label) {
            tracing::warn!(%error, "this node's label was not sent");
        }
    }

    /// Every node's resource report as this node last heard it.
    pub fn levels(&self) -> &ClusterLevels {
        &self.levels
    }

    /// The directory of node addresses (shared, it fills as peers answer).
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// This node's id.
    pub fn node_id(&self) -> u64 {
        self.cluster.node_id
    }

    /// Remove node `id` from the cluster: it gets no new replicas, each partition with a
    /// replica there moves onto another node below the soft level (see
    /// [`plan_removal`]), and it leaves the metadata group's voters. Returns the moves; the
    /// groups carry them out in the background (new copies catch up, then the voters change
    /// and the node's copies retire), which `keratin queue info` and `cluster status` show.
    /// Works for a node that is down. Run again, it continues where it stopped.
    pub async fn remove_node(&self, id: u64) -> Result<Vec<PlannedMove>, RemoveNodeError> {
        let catalog = self.applied.catalog();
        let known: std::collections::BTreeSet<u64> = self
            .formed
            .keys()
            .chain(catalog.added().keys())
            .copied()
            .collect();
        if !known.contains(&id) {
            return Err(RemoveNodeError::Unknown {
                id,
                nodes: known.into_iter().collect(),
            });
        }
        let staying: Vec<u64> = catalog
            .nodes(&self.formed)
            .into_keys()
            .filter(|n| *n != id)
            .collect();
        if staying.is_empty() {
            return Err(RemoveNodeError::Last { id });
        }
        let (candidates, _) = eligible(&staying, |node| {
            self.directory
                .get(node)
                .map_or((None, None), |info| (info.level, info.free_bytes))
        });
        let candidates: Vec<u64> = candidates.into_iter().map(|(node, _)| node).collect();
        let moves = plan_removal(&catalog, id, &candidates)?;
        if !catalog.removed().contains(&id) {
            self.decide(ClusterRecord::NodeRemoved { id })
                .await
                .map_err(RemoveNodeError::Metadata)?;
        }
        self.propose_moves(&moves)
            .await
            .map_err(RemoveNodeError::Metadata)?;
        tracing::info!(
            node = id,
            moves = moves.len(),
            "node removed from the cluster"
        );
        Ok(moves)
    }

    /// Add node `id`, listening for peers at `cluster_addr`, to the cluster: every node adds it
    /// to its peers, and the metadata group takes it as a voter once it caught up (the node
    /// runs with `[cluster] join` and lists the cluster's nodes). With `rebalance`, replicas
    /// move onto it until it holds about its share ([`plan_rebalance`]); the moves are
    /// returned and run in the background as for `remove_node`. Run again, it continues.
    pub async fn add_node(
        &self,
        id: u64,
        cluster_addr: &str,
        rebalance: bool,
    ) -> Result<Vec<PlannedMove>, AddNodeError> {
        if id == 0 {
            return Err(AddNodeError::Invalid(
                "node ids start at 1 (0 is reserved)".into(),
            ));
        }
        let addr: std::net::SocketAddr = cluster_addr.parse().map_err(|_| {
            AddNodeError::Invalid(format!(
                "{cluster_addr:?} is not IP:PORT (the new node's cluster address; host names are \
                 not resolved)"
            ))
        })?;
        let catalog = self.applied.catalog();
        if catalog.removed().contains(&id) {
            return Err(AddNodeError::Removed { id });
        }
        let nodes = catalog.nodes(&self.formed);
        let addr = addr.to_string();
        if let Some((other, _)) = nodes.iter().find(|(n, a)| **a == addr && **n != id) {
            return Err(AddNodeError::AddressTaken {
                addr,
                other: *other,
            });
        }
        match nodes.get(&id) {
            Some(existing) if *existing != addr => {
                return Err(AddNodeError::Taken {
                    id,
                    existing: existing.clone(),
                })
            }
            Some(_) => {}
            None if nodes.len() >= CLUSTER_NODES_MAX => {
                return Err(AddNodeError::Full { nodes: nodes.len() })
            }
            None => {
                self.decide(ClusterRecord::NodeAdded {
                    id,
                    cluster_addr: addr.clone(),
                })
                .await
                .map_err(AddNodeError::Metadata)?;
            }
        }
        if !rebalance {
            return Ok(Vec::new());
        }
        let catalog = self.applied.catalog();
        let nodes: Vec<u64> = catalog.nodes(&self.formed).into_keys().collect();
        let moves = plan_rebalance(&catalog, id, &nodes);
        self.propose_moves(&moves)
            .await
            .map_err(AddNodeError::Metadata)?;
        tracing::info!(node = id, moves = moves.len(), "node added to the cluster");
        Ok(moves)
    }

    /// Move partition `partition` of `queue`'s replica from node `from` to node `to`, live:
    /// `to` joins the partition's group as a learner, catches up, then takes `from`'s place
    /// among the voters, and `from`'s copy retires (run by the group's leader, as for
    /// [`ClusterNode::remove_node`]). Returns the planned move; `keratin queue info` and
    /// `cluster status` show its progress. A target at the soft level or worse is refused.
    pub async fn move_replica(
        &self,
        queue: &str,
        partition: u32,
        from: u64,
        to: u64,
    ) -> Result<PlannedMove, MoveReplicaError> {
        let catalog = self.applied.catalog();
        let nodes = catalog.nodes(&self.formed);
        let planned = plan_move(&catalog, &nodes, queue, partition, from, to, |id| {
            self.directory.get(id).and_then(|info| info.level)
        })?;
        self.propose_moves(std::slice::from_ref(&planned))
            .await
            .map_err(MoveReplicaError::Metadata)?;
        tracing::info!(queue, partition, from, to, "replica move proposed");
        Ok(planned)
    }

    /// Hand every partition to its preferred leader now, where that one is caught up
    /// (`keratin cluster rebalance`), whatever `cluster.leader_balance` says: this node and
    /// every other node of the cluster hand over the partitions they lead, at once, and wait
    /// up to 5 s for the new leaders. Returns what moved, what stays and why, and the nodes
    /// that could not be asked.
    pub async fn rebalance(&self) -> RebalanceReport {
        let catalog = self.applied.catalog();
        let me = self.cluster.node_id;
        let asks: Vec<_> = catalog
            .nodes(&self.formed)
            .into_keys()
            .filter(|id| *id != me)
            .map(|id| {
                let transport = self.transport.clone();
                tokio::spawn(async move {
                    let answer = transport
                        .call(
                            id,
                            SERVICE_GROUP,
                            KIND_REBALANCE,
                            bytes::Bytes::new(),
                            REBALANCE_CALL_TIMEOUT,
                        )
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|body| {
                            serde_json::from_slice::<RebalanceReport>(&body)
                                .map_err(|e| format!("its answer did not decode: {e}"))
                        });
                    (id, answer)
                })
            })
            .collect();
        let mut report = self.balancer.rebalance_here().await;
        for ask in asks {
            match ask.await {
                Ok((_, Ok(theirs))) => report.merge(theirs),
                Ok((id, Err(error))) => {
                    report.unreachable.insert(id, error);
                }
                Err(error) => tracing::warn!(%error, "a rebalance request task failed"),
            }
        }
        report.merge(RebalanceReport::default());
        tracing::info!(
            moved = report.moved.len(),
            kept = report.kept.len(),
            "partitions handed to their preferred leaders on request"
        );
        report
    }

    /// The cluster-wide runtime settings as applied here (the metadata group's), as they
    /// change; every node applies them under its own overrides.
    pub fn runtime_settings(&self) -> watch::Receiver<BTreeMap<String, serde_json::Value>> {
        self.applied.runtime_settings()
    }

    /// Change cluster-wide runtime settings (`null` drops a key's cluster-wide value); returns
    /// once this node applied the change. The caller checked the values.
    pub async fn change_runtime_settings(
        &self,
        changes: BTreeMap<String, serde_json::Value>,
    ) -> Result<BTreeMap<String, serde_json::Value>, String> {
        self.decide(ClusterRecord::RuntimeSettingsChanged { changes })
            .await?;
        Ok(self.applied.catalog().runtime_settings().clone())
    }

    /// The cluster's users as applied here, as they change.
    pub fn users(&self) -> watch::Receiver<Arc<UserTable>> {
        self.applied.users()
    }

    /// Change the cluster's users; returns the table once this node applied the change.
    /// Checked first against this node's copy (a change that does not apply, or would leave
    /// no admin, is refused here and not proposed). Two proposers that race are ordered by
    /// the log: the later change, if it no longer applies, changes nothing anywhere, and the
    /// table returned shows it.
    pub async fn change_users(&self, change: UserChange) -> Result<Arc<UserTable>, String> {
        self.applied
            .catalog()
            .users()
            .changed(&change)
            .map_err(|e| e.to_string())?;
        self.decide(ClusterRecord::UserChanged { change }).await?;
        Ok(self.applied.catalog().users().clone())
    }

    /// Propose each move's record in turn, each applied here before the next.
    async fn propose_moves(&self, moves: &[PlannedMove]) -> Result<(), String> {
        for planned in moves {
            self.decide(ClusterRecord::PartitionReplicasChanged {
                name: planned.queue.clone(),
                index: planned.partition,
                replicas: planned.to.clone(),
            })
            .await?;
        }
        Ok(())
    }

    /// Propose `record` and wait until this node applied it; why not, if not.
    async fn decide(&self, record: ClusterRecord) -> Result<(), String> {
        let offset = self
            .meta
            .propose(&record, METADATA_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        if self
            .applied
            .wait_applied(offset + 1, METADATA_TIMEOUT)
            .await
        {
            Ok(())
        } else {
            Err(format!(
                "the record at {offset} was not applied on this node within {} s",
                METADATA_TIMEOUT.as_secs()
            ))
        }
    }

    /// The cluster as this node sees it.
    pub async fn status(&self) -> ClusterStatus {
        let removed = self.applied.catalog().removed().clone();
        let meta_leader = self.meta.leader().await;
        let (meta_voters, meta_learners) = self
            .meta
            .members()
            .await
            .map(|(_, committed)| (committed.voters, committed.learners))
            .unwrap_or_default();
        let mut nodes = vec![NodeStatus {
            id: self.cluster.node_id,
            cluster_addr: self.cluster.listen.to_string(),
            info: self.directory.get(self.cluster.node_id),
            reachable: true,
            meta_leader: meta_leader == Some(self.cluster.node_id),
            removed: removed.contains(&self.cluster.node_id),
            levels: None,
            levels_age_ms: None,
        }];
        for peer in self.transport.peers_status() {
            nodes.push(NodeStatus {
                id: peer.id,
                cluster_addr: peer.addr.to_string(),
                info: self.directory.get(peer.id),
                reachable: peer.connected,
                meta_leader: meta_leader == Some(peer.id),
                removed: removed.contains(&peer.id),
                levels: None,
                levels_age_ms: None,
            });
        }
        nodes.sort_by_key(|n| n.id);
        for node in &mut nodes {
            if let Some(heard) = self.levels.get(node.id) {
                node.levels = Some(heard.report);
                node.levels_age_ms = Some(u64::try_from(heard.age.as_millis()).unwrap_or(u64::MAX));
            }
        }
        ClusterStatus {
            node_id: self.cluster.node_id,
            name: self.cluster.name.clone(),
            nodes,
            meta_leader,
            meta_applied: self.applied.applied(),
            meta_voters: meta_voters.into_iter().collect(),
            meta_learners: meta_learners.into_iter().collect(),
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
