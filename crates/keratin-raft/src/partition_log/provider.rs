//! [`ReplicatedLogs`]: opens this node's replicas of replicated partitions for the broker.

use super::*;

/// How a node opens its replicated partition logs: see [`ReplicatedLogs::new`].
pub struct ReplicatedLogsSetup {
    /// This node's id.
    pub node_id: u64,
    /// The node's cluster transport.
    pub transport: Transport,
    /// The node's Raft handler (the transport's handler): each group registers there.
    pub groups: Arc<Groups>,
    /// openraft's configuration of partition replicas ([`crate::replica::replica_config`]).
    pub raft_config: Arc<Config>,
    /// The cluster's nodes: their cluster addresses name the members of a new group.
    pub cluster: ResolvedCluster,
    /// Client (protocol) addresses by node id, for "not the leader" answers and roles.
    pub client_addrs: ClientAddrs,
}

/// Opens this node's replicas of replicated partitions for the broker (see the module docs).
pub struct ReplicatedLogs {
    pub(super) node_id: u64,
    pub(super) transport: Transport,
    pub(super) groups: Arc<Groups>,
    pub(super) raft_config: Arc<Config>,
    /// Cluster address of every node, this one included.
    pub(super) members: BTreeMap<u64, NodeAddr>,
    pub(super) client_addrs: ClientAddrs,
    /// The logs opened, by group (entries of closed logs are dropped at the next open).
    pub(super) opened: Mutex<BTreeMap<u64, Weak<ReplicatedLog>>>,
}

impl std::fmt::Debug for ReplicatedLogs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicatedLogs")
            .field("node_id", &self.node_id)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

impl ReplicatedLogs {
    /// A provider for node `setup.node_id`.
    pub fn new(setup: ReplicatedLogsSetup) -> ReplicatedLogs {
        let mut members: BTreeMap<u64, NodeAddr> = setup
            .cluster
            .peers
            .iter()
            .map(|(id, addr)| {
                let addr = addr.to_string();
                (*id, NodeAddr { addr })
            })
            .collect();
        // Listed peers name this node as the others reach it; `listen` only stands in.
        members
            .entry(setup.cluster.node_id)
            .or_insert_with(|| NodeAddr {
                addr: setup.cluster.listen.to_string(),
            });
        ReplicatedLogs {
            node_id: setup.node_id,
            transport: setup.transport,
            groups: setup.groups,
            raft_config: setup.raft_config,
            members,
            client_addrs: setup.client_addrs,
            opened: Mutex::new(BTreeMap::new()),
        }
    }

    /// The openraft instance of an open partition group on this node, for what the cluster
    /// layer does beside the broker (membership changes, metrics, triggering an election);
    /// `None` if the group is not open or its replica is being rebuilt.
    pub fn raft(&self, group: GroupId) -> Option<ReplicaRaft> {
        let log = self
            .opened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&group.0)?
            .upgrade()?;
        log.with_replica(|replica| replica.raft().clone())
    }

    /// The voters of a new group: every replica with its cluster address.
    fn voters(&self, place: &PartitionPlace) -> BrokerResult<BTreeMap<u64, NodeAddr>> {
        if !place.replicas.contains(&self.node_id) {
            return Err(BrokerError::Invalid(format!(
                "partition {} of {:?}: node {} holds no replica (replicas {:?})",
                place.index, place.queue, self.node_id, place.replicas
            )));
        }
        place
            .replicas
            .iter()
            .map(|id| {
                let addr = self.members.get(id).cloned().ok_or_else(|| {
                    BrokerError::Invalid(format!(
                        "partition {} of {:?}: replica node {id} is not in the cluster's peer \
                         list",
                        place.index, place.queue
                    ))
                })?;
                Ok((*id, addr))
            })
            .collect()
    }

    /// Start the replica of `group` on `logs` and make sure its group is initialized.
    ///
    /// Every replica initializes a group whose log holds no membership yet, with the same
    /// voters (the partition's replicas, with the addresses of the cluster configuration every
    /// node shares), at the same time: openraft documents this as safe (`Raft::initialize`:
    /// "calling `initialize()` on multiple nodes with identical configuration is also
    /// acceptable": each writes the same membership at index 0 and the vote elects one
    /// leader), and a member that already holds a log (another's membership reached it, or it
    /// restarted) answers `NotAllowed`, which is the goal reached. So a group forms while any
    /// majority of its replicas is up, whichever node is down; choosing one initializer would
    /// stall the group while that node is down.
    async fn start_group(
        &self,
        group: GroupId,
        logs: GroupLogs,
        voters: BTreeMap<u64, NodeAddr>,
    ) -> Result<Replica, RaftError> {
        let replica = Replica::start(
            self.node_id,
            group,
            logs,
            self.raft_config.clone(),
            self.transport.clone(),
            &self.groups,
        )
        .await?;
        let initialized = async {
            let raft = replica.raft();
            let done = raft
                .is_initialized()
                .await
                .map_err(|e| RaftError::Invalid(format!("group {}: {e}", group.0)))?;
            if done {
                return Ok(());
            }
            match raft.initialize(voters).await {
                Ok(()) => Ok(()),
                Err(openraft::errors::RaftError::APIError(InitializeError::NotAllowed(_))) => {
                    Ok(())
                }
                Err(e) => Err(RaftError::Invalid(format!(
                    "initialize group {}: {e}",
                    group.0
                ))),
            }
        }
        .await;
        match initialized {
            Ok(()) => Ok(replica),
            Err(error) => {
                let logs = replica.shutdown(&self.groups).await;
                drop(logs);
                Err(error)
            }
        }
    }
}

impl PartitionLogs for ReplicatedLogs {
    fn open(&self, place: &PartitionPlace) -> BrokerResult<Arc<dyn PartitionLog>> {
        let invalid = |e: RaftError| BrokerError::Log(log_error("opening a replica", e));
        let group = partition_group(place.queue_id, place.index)
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
        let voters = self.voters(place)?;
        let handle = tokio::runtime::Handle::try_current().map_err(|e| {
            BrokerError::Invalid(format!("replicated logs open inside a tokio runtime: {e}"))
        })?;
        place.io.create_dir_all(&place.dir).map_err(|e| {
            BrokerError::Log(LogError::Invalid(format!(
                "create {}: {e}",
                place.dir.display()
            )))
        })?;
        let options = LogOptions {
            full_segment_size_bytes: place.segment_size_bytes,
            ..LogOptions::default()
        };
        // The node's pool: replicas allocate their segments like every other log of the node.
        let logs = GroupLogs::open(
            place.io.clone(),
            &place.dir,
            options,
            Some(place.pool.clone()),
        )
        .map_err(invalid)?;
        let replica = handle
            .block_on(self.start_group(group, logs, voters))
            .map_err(invalid)?;
        let log = Arc::new(ReplicatedLog::new(replica, place, self));
        let mut opened = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        opened.retain(|_, log| log.strong_count() > 0);
        opened.insert(group.0, Arc::downgrade(&log));
        Ok(log)
    }
}
