//! [`ReplicatedLogs`]: opens this node's replicas of replicated partitions for the broker,
//! forming a new group or joining one formed without this node (`docs/cluster.md`,
//! "Membership changes of partition groups"), and the node-local handle of membership
//! changes: changing a group's voters on its leader, retiring a replica that left.

use std::collections::BTreeSet;

use super::*;
use crate::replica::{copies, membership, GroupMembers, MembershipError, Replaced};

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
    /// Cluster address of every node, this one included (nodes added at run time too).
    pub(super) members: std::sync::RwLock<BTreeMap<u64, NodeAddr>>,
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
            .map(|(id, addr)| (*id, NodeAddr::new(addr.to_string())))
            .collect();
        // Listed peers name this node as the others reach it; `listen` only stands in.
        members
            .entry(setup.cluster.node_id)
            .or_insert_with(|| NodeAddr::new(setup.cluster.listen.to_string()));
        ReplicatedLogs {
            node_id: setup.node_id,
            transport: setup.transport,
            groups: setup.groups,
            raft_config: setup.raft_config,
            members: std::sync::RwLock::new(members),
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

    /// Node `id`'s cluster address, from the peer list.
    fn addr_of(&self, id: u64) -> Option<NodeAddr> {
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Node `id` joined the cluster at `addr` (`keratin cluster add-node`): groups may take it
    /// as a member from now on. A known node's address is replaced.
    pub fn add_member(&self, id: u64, addr: String) {
        self.members
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, NodeAddr::new(addr));
    }

    /// How this node's replica of `place` starts when its log holds no membership yet: it
    /// forms the group with the voters of its formation if it is one of them, else it joins
    /// (see [`Opening`]).
    fn opening(&self, place: &PartitionPlace) -> BrokerResult<Opening> {
        if !place.replicas.contains(&self.node_id) {
            return Err(BrokerError::Invalid(format!(
                "partition {} of {:?}: node {} holds no replica (replicas {:?})",
                place.index, place.queue, self.node_id, place.replicas
            )));
        }
        let formation = place.formation.as_ref().unwrap_or(&place.replicas);
        if !formation.contains(&self.node_id) {
            return Ok(Opening::Join);
        }
        let voters = formation
            .iter()
            .map(|id| {
                let node = self.addr_of(*id).ok_or_else(|| {
                    BrokerError::Invalid(format!(
                        "partition {} of {:?}: replica node {id} is not in the cluster's peer \
                         list",
                        place.index, place.queue
                    ))
                })?;
                Ok((*id, node.addr))
            })
            .collect::<BrokerResult<_>>()?;
        Ok(Opening::Form {
            voters,
            preferred: place.replicas.first().copied(),
        })
    }

    /// Start the replica of `group` on `logs`; a [`Opening::Form`] one forms its group in the
    /// background where it exists nowhere yet, else joins it ([`Replica::form`]).
    ///
    /// Every forming replica initializes a group whose log holds no membership yet, with the
    /// same voters (the group's formation, with the addresses of the cluster configuration
    /// every node shares): openraft documents this as safe (`Raft::initialize`: "calling
    /// `initialize()` on multiple nodes with identical configuration is also acceptable": each
    /// writes the same membership at index 0 and the vote elects one leader). So a group forms
    /// while any majority of its replicas is up, whichever node is down; choosing one
    /// initializer would stall the group while that node is down. A forming replica first asks
    /// the other voters: one that holds the group past its formation means the group exists
    /// (this node's copy was wiped, or it was down while the others formed it), and the
    /// replica joins instead.
    ///
    /// A joining replica never initializes: a membership of its own at index 0 would name
    /// voters the group no longer has (or never had), and it could campaign on it. It starts
    /// with an empty log and waits for the leader to add it (with its copy of the storage:
    /// [`ReplicatedLogs::change_voters`]), or to record it (a joining member of the formation).
    async fn start_group(
        &self,
        group: GroupId,
        logs: GroupLogs,
        opening: Opening,
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
        if let Opening::Form { voters, preferred } = opening {
            replica.form_in_background(&voters, preferred);
        }
        Ok(replica)
    }

    /// The open log of `group`.
    fn opened(&self, group: GroupId) -> Result<Arc<ReplicatedLog>, MembershipError> {
        self.opened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&group.0)
            .and_then(Weak::upgrade)
            .ok_or(MembershipError::NotOpen { group: group.0 })
    }

    /// The `Raft` of `group`'s running replica.
    fn running_raft(&self, group: GroupId) -> Result<ReplicaRaft, MembershipError> {
        self.opened(group)?
            .with_replica(|replica| replica.raft().clone())
            .ok_or(MembershipError::NotOpen { group: group.0 })
    }

    /// Make `voters` the voters of `group`, whose leader runs on this node (see
    /// [`Replica::change_voters`]): every node must be in the cluster's peer list; new ones
    /// must have opened their replica (as joining) to catch up within `catch_up_wait`. Voters
    /// that leave stay learners until they retire ([`ReplicatedLogs::retire`]) and
    /// [`ReplicatedLogs::remove_learners`] forgets them.
    pub async fn change_voters(
        &self,
        group: GroupId,
        voters: &BTreeSet<u64>,
        catch_up_wait: Duration,
    ) -> Result<GroupMembers, MembershipError> {
        let raft = self.running_raft(group)?;
        let mut target = BTreeMap::new();
        for id in voters {
            let addr = self.addr_of(*id).ok_or_else(|| MembershipError::Refused {
                group: group.0,
                reason: format!("node {id} is not in the cluster's peer list"),
            })?;
            target.insert(*id, addr.addr);
        }
        membership::change_voters(&raft, &self.transport, group, &target, catch_up_wait).await
    }

    /// On the leader of `group`: the members that have not acknowledged it lately (see
    /// [`ReplicatedLogs::replace_copies`]); empty if this node does not lead it.
    pub fn silent_members(&self, group: GroupId) -> BTreeSet<u64> {
        self.running_raft(group)
            .map(|raft| copies::silent_members(&raft.metrics().borrow_watched()))
            .unwrap_or_default()
    }

    /// On the leader of `group`: remove the members that hold another copy of the group's
    /// storage than the recorded one (a wiped directory); [`ReplicatedLogs::change_voters`]
    /// adds them back as learners with their new copy and promotes them once caught up.
    pub async fn replace_copies(&self, group: GroupId) -> Result<Replaced, MembershipError> {
        let raft = self.running_raft(group)?;
        copies::replace_copies(&raft, &self.transport, group).await
    }

    /// Forget `learners` of `group` (retired replicas), on its leader: see
    /// [`Replica::remove_learners`].
    pub async fn remove_learners(
        &self,
        group: GroupId,
        learners: &BTreeSet<u64>,
    ) -> Result<GroupMembers, MembershipError> {
        let raft = self.running_raft(group)?;
        membership::remove_learners(&raft, group.0, learners).await
    }

    /// The members of `group` as this node's replica sees them: the latest membership it
    /// holds, and the latest it knows committed.
    pub async fn members(
        &self,
        group: GroupId,
    ) -> Result<(GroupMembers, GroupMembers), MembershipError> {
        let raft = self.running_raft(group)?;
        membership::members(&raft, group.0).await
    }

    /// Waits up to `wait` until this node's replica of `group` may go: its committed
    /// membership no longer names it a voter (see [`ReplicatedLogs::retire`]), without
    /// touching the replica (the broker replaces the partition's log itself). A replica whose
    /// log holds no membership (it never joined) may go at once.
    pub async fn wait_retired(
        &self,
        group: GroupId,
        wait: Duration,
    ) -> Result<(), MembershipError> {
        let raft = self.running_raft(group)?;
        membership::wait_retired(&raft, group.0, wait).await
    }

    /// Remove what a replica of `place` left on this node, which holds none of it now (it
    /// stopped between the partition's move and the removal of its files): its logs' segments
    /// go back to the pool and its directory goes. Nothing there: nothing done. Blocking.
    pub fn remove_leftover(&self, place: &PartitionPlace) -> BrokerResult<()> {
        let stat = |e: keratin_log::IoError| {
            BrokerError::Log(LogError::Invalid(format!("{}: {e}", place.dir.display())))
        };
        if !place.io.exists(&place.dir).map_err(stat)? {
            return Ok(());
        }
        tracing::info!(queue = %place.queue, partition = place.index, dir = %place.dir.display(), "removing the files of a replica this node no longer holds");
        let invalid = |e: RaftError| BrokerError::Log(log_error("removing a former replica", e));
        let logs = open_group_logs(place).map_err(invalid)?;
        match logs.try_delete() {
            Ok(result) => result.map_err(invalid)?,
            Err(_) => {
                return Err(BrokerError::Closed(format!(
                    "{}: a former replica's logs are in use",
                    place.dir.display()
                )))
            }
        }
        if place.io.exists(&place.dir).map_err(stat)? {
            place.io.remove_dir(&place.dir).map_err(stat)?;
        }
        Ok(())
    }

    /// Hand the leadership of `group`, which this node leads, to voter `to` if it is nearly
    /// caught up (see [`Replica::transfer_leader`]): `Ok(true)` once asked.
    pub async fn transfer_leader(&self, group: GroupId, to: u64) -> Result<bool, MembershipError> {
        let raft = self.running_raft(group)?;
        membership::transfer_leader(&raft, group.0, to).await
    }

    /// Whether this node's replica of `group` leads it (openraft's view: a leader cut off from
    /// the others still says so until it learns otherwise).
    pub fn leads(&self, group: GroupId) -> bool {
        self.running_raft(group).is_ok_and(|raft| {
            let metrics = raft.metrics().borrow_watched().clone();
            metrics.state.is_leader() && metrics.current_leader == Some(self.node_id)
        })
    }

    /// The leader of `group` as this node's replica knows it (itself included), if any.
    pub fn leader_of(&self, group: GroupId) -> Option<u64> {
        let raft = self.running_raft(group).ok()?;
        let leader = raft.metrics().borrow_watched().current_leader;
        leader
    }

    /// Retire this node's replica of `group` once the voters changed without it: waits up to
    /// `wait` until the membership it knows committed no longer names it a voter (its vote
    /// can no longer be needed; refused with [`MembershipError::StillVoter`] otherwise), then
    /// shuts the replica down and deletes its logs and directory (blocking work on the
    /// blocking pool). The broker's partition, if any, sees its log closed; the leader should
    /// then forget the node ([`ReplicatedLogs::remove_learners`]).
    pub async fn retire(&self, group: GroupId, wait: Duration) -> Result<(), MembershipError> {
        let log = self.opened(group)?;
        let raft = log
            .with_replica(|replica| replica.raft().clone())
            .ok_or(MembershipError::NotOpen { group: group.0 })?;
        membership::wait_retired(&raft, group.0, wait).await?;
        drop(raft);
        self.opened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&group.0);
        let deleted = tokio::task::spawn_blocking(move || log.delete()).await;
        let stopped = |reason: String| MembershipError::Stopped {
            group: group.0,
            reason,
        };
        match deleted {
            Ok(Ok(())) => {
                tracing::info!(group = group.0, "retired replica removed");
                Ok(())
            }
            Ok(Err(error)) => Err(stopped(format!("removing the retired replica: {error}"))),
            Err(error) => Err(stopped(format!("removing the retired replica: {error}"))),
        }
    }
}

/// Where damaged copies go, under the storage directory (`<storage>/damaged`).
pub const DAMAGED_DIR_NAME: &str = "damaged";

/// Move the damaged copy in `place.dir` (`<storage>/queues|streams/<id>/<index>`) to
/// `<storage>/damaged/<queues|streams>-<id>-<index>-<unix ms>` ([`set_aside_damaged`]); where
/// it went (blocking).
fn set_aside(place: &PartitionPlace) -> Result<std::path::PathBuf, String> {
    let index_dir = &place.dir;
    let id_dir = index_dir.parent().ok_or("no queue directory")?;
    let kind_dir = id_dir.parent().ok_or("no queues directory")?;
    let kind = kind_dir
        .file_name()
        .and_then(|name| name.to_str())
        .filter(|name| *name == "queues" || *name == "streams")
        .ok_or_else(|| {
            format!(
                "{} is not a queue's or stream's directory",
                index_dir.display()
            )
        })?;
    let storage = kind_dir.parent().ok_or("no storage directory")?;
    let name = |path: &std::path::Path| {
        path.file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    set_aside_damaged(
        place.io.as_ref(),
        index_dir,
        storage,
        &format!("{kind}-{}-{}", name(id_dir), name(index_dir)),
    )
}

/// Move the damaged copy in `dir` to `<storage>/damaged/<label>-<unix ms>`, out of the way of
/// the node's data, and sync both parents; where it went. Nothing is deleted: an operator may
/// still read it, and removes it (the node shows it until then). The caller opens an empty copy
/// in `dir`, which the group replaces and rebuilds from its other replicas like a wiped one
/// (blocking).
pub fn set_aside_damaged(
    io: &dyn keratin_log::Io,
    dir: &std::path::Path,
    storage: &std::path::Path,
    label: &str,
) -> Result<std::path::PathBuf, String> {
    let parent = dir
        .parent()
        .ok_or("the damaged copy has no parent directory")?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    let damaged = storage.join(DAMAGED_DIR_NAME);
    let aside = damaged.join(format!("{label}-{now_ms}"));
    io.create_dir_all(&damaged).map_err(|e| e.to_string())?;
    io.rename(dir, &aside).map_err(|e| e.to_string())?;
    io.sync_dir(parent).map_err(|e| e.to_string())?;
    io.sync_dir(&damaged).map_err(|e| e.to_string())?;
    Ok(aside)
}

/// A replica's logs in `place.dir`, on the node's pool (blocking).
fn open_group_logs(place: &PartitionPlace) -> Result<GroupLogs, RaftError> {
    let options = LogOptions {
        full_segment_size_bytes: place.segment_size_bytes,
        size_class: place.size_class,
        ..LogOptions::default()
    };
    GroupLogs::open(
        place.io.clone(),
        &place.dir,
        options,
        Some(place.pool.clone()),
    )
}

/// How a replica whose log holds no membership yet starts.
#[derive(Debug)]
enum Opening {
    /// This node is one of the voters the group is formed with (by node id, their cluster
    /// addresses): it initializes the group with them unless the group exists already.
    Form {
        /// The voters.
        voters: BTreeMap<u64, String>,
        /// The group's preferred leader (the first of its replica list): the first election's
        /// winner hands the new group to it.
        preferred: Option<u64>,
    },
    /// This node joins a group formed without it: it waits for the leader to add it.
    Join,
}

impl PartitionLogs for ReplicatedLogs {
    fn open(&self, place: &PartitionPlace) -> BrokerResult<Arc<dyn PartitionLog>> {
        let invalid = |e: RaftError| BrokerError::Log(log_error("opening a replica", e));
        let group = partition_group(place.queue_id, place.index)
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
        let opening = self.opening(place)?;
        // Every replica of the formation forms the group at once (`copies.rs`, "Forming");
        // the first to campaign leads and hands the group to its preferred leader.
        let handle = tokio::runtime::Handle::try_current().map_err(|e| {
            BrokerError::Invalid(format!("replicated logs open inside a tokio runtime: {e}"))
        })?;
        place.io.create_dir_all(&place.dir).map_err(|e| {
            BrokerError::Log(LogError::Invalid(format!(
                "create {}: {e}",
                place.dir.display()
            )))
        })?;
        // The node's pool: replicas allocate their segments like every other log of the node.
        let logs = match open_group_logs(place) {
            Ok(logs) => logs,
            Err(error) if error.is_damage() && place.replicas.len() > 1 => {
                let aside = set_aside(place).map_err(|e| {
                    BrokerError::Log(LogError::Invalid(format!(
                        "{error}; moving the damaged copy aside failed: {e}"
                    )))
                })?;
                tracing::error!(
                    queue = %place.queue,
                    partition = place.index,
                    %error,
                    moved_to = %aside.display(),
                    "this node's copy of the partition is damaged: it was moved aside, and an \
                     empty copy takes its place, rebuilt from the other replicas (remove the \
                     moved copy once the partition is whole again)"
                );
                place.io.create_dir_all(&place.dir).map_err(|e| {
                    BrokerError::Log(LogError::Invalid(format!(
                        "create {}: {e}",
                        place.dir.display()
                    )))
                })?;
                open_group_logs(place).map_err(invalid)?
            }
            Err(error) => return Err(invalid(error)),
        };
        let replica = handle
            .block_on(self.start_group(group, logs, opening))
            .map_err(invalid)?;
        let log = Arc::new(ReplicatedLog::new(replica, place, self));
        let mut opened = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        opened.retain(|_, log| log.strong_count() > 0);
        opened.insert(group.0, Arc::downgrade(&log));
        Ok(log)
    }
}
