//! [`MetaGroup`]: this node's member of the cluster's metadata group (group 0), a Raft group
//! over a small segment log in the first storage directory (`cluster-meta/`). Its records are
//! [`ClusterRecord`]s; every node applies them (`applier.rs`). A record is proposed on the
//! group's leader: a node that does not lead forwards it there through the cluster service.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keratin_broker::BrokerError;
use keratin_log::{Io, LogOptions, SegmentPool};
use keratin_net::{GroupId, NetError, RemoteError, Transport};
use keratin_raft::network::Groups;
use keratin_raft::replica::{
    CommittedReader, GroupMembers, MembershipError, ProposeError, Replaced, Replica,
};
use keratin_raft::{GroupLogs, PartitionRecord};
use tokio::sync::watch;

use crate::records::{ClusterRecord, RECORD_JSON_V1};
use crate::service::{
    KIND_PROPOSE, KIND_READ_INDEX, NOT_META_LEADER, PROPOSAL_FAILED, SERVICE_GROUP, STARTING,
};

/// The metadata group's id.
pub const META_GROUP: GroupId = GroupId(0);

/// At most this many voters; the cluster's further nodes are learners of the metadata group:
/// they receive and apply every record, and answer reads from their copy, without voting (a
/// larger quorum would only slow every metadata change). See [`meta_voters`].
pub const META_VOTERS_MAX: usize = 5;

/// The metadata group's voters among `nodes` (id to cluster address), given its `current`
/// voters: the current ones that are still nodes, then the nodes of lowest id, up to
/// [`META_VOTERS_MAX`]. Keeping the current voters first means a node joining or leaving
/// changes at most the voters it must.
pub(crate) fn meta_voters(
    nodes: &BTreeMap<u64, String>,
    current: &BTreeSet<u64>,
) -> BTreeMap<u64, String> {
    let kept = nodes.iter().filter(|(id, _)| current.contains(id));
    let others = nodes.iter().filter(|(id, _)| !current.contains(id));
    kept.chain(others)
        .take(META_VOTERS_MAX)
        .map(|(id, addr)| (*id, addr.clone()))
        .collect()
}

/// Between two attempts to reach the metadata group's leader.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// See the module docs.
pub(crate) struct MetaGroup {
    node_id: u64,
    replica: Replica,
    transport: Transport,
    clock: keratin_broker::Clock,
}

impl std::fmt::Debug for MetaGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaGroup")
            .field("node_id", &self.node_id)
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

/// The metadata group's logs in `dir` (blocking). A copy whose logs report damage as they
/// open (data reported durable does not read back) is moved to
/// `<storage>/damaged/cluster-meta-<unix ms>` when the group has `copies_elsewhere`, and an
/// empty copy takes its place: a new storage identity, which the group's leader replaces and
/// rebuilds from the others as it does a wiped node's (`keratin_raft::replica`, "copies.rs").
/// Without other copies the damage stops the start, naming the directory.
fn open_meta_logs(
    io: Arc<dyn Io>,
    dir: &Path,
    options: LogOptions,
    pool: SegmentPool,
    copies_elsewhere: bool,
) -> Result<GroupLogs, String> {
    let opened = GroupLogs::open(io.clone(), dir, options.clone(), Some(pool.clone()));
    let error = match opened {
        Ok(logs) => return Ok(logs),
        Err(error) if error.is_damage() && copies_elsewhere => error,
        Err(error) => return Err(format!("opening the metadata group's logs: {error}")),
    };
    let storage = dir.parent().ok_or("the metadata directory has no parent")?;
    let aside =
        keratin_raft::partition_log::set_aside_damaged(io.as_ref(), dir, storage, "cluster-meta")
            .map_err(|e| {
            format!(
            "opening the metadata group's logs: {error}; moving the damaged copy aside failed: {e}"
        )
        })?;
    tracing::error!(
        %error,
        moved_to = %aside.display(),
        "this node's copy of the cluster metadata is damaged: it was moved aside, and an empty \
         copy takes its place, rebuilt from the other nodes (remove the moved copy once the \
         node is back in the cluster)"
    );
    io.create_dir_all(dir)
        .map_err(|e| format!("create {}: {e}", dir.display()))?;
    GroupLogs::open(io, dir, options, Some(pool))
        .map_err(|e| format!("opening the metadata group's new copy: {e}"))
}

impl MetaGroup {
    /// Open (or create) the group's logs under `dir`, start this node's replica and form the
    /// group with `voters` (node id to cluster address) in the background if it exists nowhere
    /// yet (`keratin_raft::replica::Replica::form`: a node whose data was wiped joins the
    /// group it formed once); `None`: this node joins a running group (it waits to be added,
    /// never forming it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start(
        node_id: u64,
        dir: &Path,
        io: Arc<dyn Io>,
        pool: SegmentPool,
        segment_size_bytes: u64,
        transport: Transport,
        groups: &Groups,
        cluster_name: &str,
        voters: Option<BTreeMap<u64, String>>,
        clock: keratin_broker::Clock,
    ) -> Result<MetaGroup, String> {
        let options = LogOptions {
            // Metadata records are small and rare: the small class, like the node's metadata.
            full_segment_size_bytes: segment_size_bytes,
            size_class: keratin_log::SizeClass::Small,
            ..LogOptions::default()
        };
        let dir = dir.to_path_buf();
        // Other copies exist when this node forms the group with others, or joins it.
        let copies_elsewhere = voters
            .as_ref()
            .is_none_or(|voters| voters.keys().any(|id| *id != node_id));
        let logs = tokio::task::spawn_blocking(move || {
            open_meta_logs(io, &dir, options, pool, copies_elsewhere)
        })
        .await
        .map_err(|e| format!("opening the metadata group's logs: {e}"))??;
        let config =
            keratin_raft::replica::replica_config(cluster_name).map_err(|e| e.to_string())?;
        let replica = Replica::start(node_id, META_GROUP, logs, config, transport.clone(), groups)
            .await
            .map_err(|e| format!("starting the metadata group: {e}"))?;
        if let Some(voters) = voters {
            replica.form_in_background(&voters, None);
        }
        Ok(MetaGroup {
            node_id,
            replica,
            transport,
            clock,
        })
    }

    /// The group's leader as this node knows it.
    pub(crate) async fn leader(&self) -> Option<u64> {
        self.replica.leader().await
    }

    /// Whether this node leads the group.
    pub(crate) async fn leads(&self) -> bool {
        self.leader().await == Some(self.node_id)
    }

    /// The group's members as this node sees them (the latest, and the latest committed).
    pub(crate) async fn members(&self) -> Result<(GroupMembers, GroupMembers), MembershipError> {
        self.replica.members().await
    }

    /// Make `voters` (node id to cluster address) the group's voters, on its leader.
    pub(crate) async fn change_voters(
        &self,
        voters: &BTreeMap<u64, String>,
        catch_up_wait: Duration,
    ) -> Result<GroupMembers, MembershipError> {
        self.replica.change_voters(voters, catch_up_wait).await
    }

    /// On the group's leader: the members that have not acknowledged it lately.
    pub(crate) fn silent_members(&self) -> BTreeSet<u64> {
        self.replica.silent_members()
    }

    /// Remove the members that hold another copy of the group's storage than the recorded one,
    /// on the group's leader (`change_voters` adds them back).
    pub(crate) async fn replace_copies(&self) -> Result<Replaced, MembershipError> {
        self.replica.replace_copies().await
    }

    /// Make `learners` (node id to cluster address) learners unless they are members, on the
    /// group's leader.
    pub(crate) async fn add_learners(
        &self,
        learners: &BTreeMap<u64, String>,
    ) -> Result<GroupMembers, MembershipError> {
        self.replica.add_learners(learners).await
    }

    /// Forget `learners` (removed nodes), on the group's leader.
    pub(crate) async fn remove_learners(
        &self,
        learners: &BTreeSet<u64>,
    ) -> Result<GroupMembers, MembershipError> {
        self.replica.remove_learners(learners).await
    }

    /// One past the last committed record, as it moves.
    pub(crate) fn committed(&self) -> watch::Receiver<u64> {
        self.replica.committed()
    }

    /// The committed records from `offset` (blocking iteration).
    pub(crate) fn reader(&self, offset: u64) -> CommittedReader {
        self.replica.reader(offset)
    }

    /// Propose `record` on this node, which must lead the group; its offset once committed.
    pub(crate) async fn propose_here(&self, record: &ClusterRecord) -> Result<u64, RemoteError> {
        let entry = PartitionRecord::new(RECORD_JSON_V1, (self.clock)(), record.encode())
            .map_err(|e| RemoteError::new(PROPOSAL_FAILED, e.to_string()))?;
        match self.replica.propose(vec![entry]).await {
            Ok(range) => Ok(range.start),
            Err(error @ ProposeError::NotLeader { .. }) => {
                Err(RemoteError::new(NOT_META_LEADER, error.to_string()))
            }
            Err(error) => Err(RemoteError::new(PROPOSAL_FAILED, error.to_string())),
        }
    }

    /// Propose `record` on the group's leader, wherever it is, retrying until `timeout` while
    /// there is none or it moves; its offset once committed. A retry after a lost answer may
    /// propose it twice: applying a record twice changes nothing the second time
    /// (`catalog.rs`).
    pub(crate) async fn propose(
        &self,
        record: &ClusterRecord,
        timeout: Duration,
    ) -> Result<u64, BrokerError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let body = Bytes::from(record.encode());
        let mut last = String::from("no leader was elected yet");
        loop {
            match self.leader().await {
                Some(leader) if leader == self.node_id => match self.propose_here(record).await {
                    Ok(offset) => return Ok(offset),
                    Err(error) if error.code == NOT_META_LEADER => last = error.message,
                    Err(error) => return Err(failed(record, error.message)),
                },
                Some(leader) => {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    let call = self
                        .transport
                        .call(leader, SERVICE_GROUP, KIND_PROPOSE, body.clone(), left)
                        .await;
                    match call {
                        Ok(reply) => {
                            return offset_of(&reply).ok_or_else(|| {
                                failed(
                                    record,
                                    format!("node {leader} answered {} bytes", reply.len()),
                                )
                            })
                        }
                        Err(NetError::Refused { error, .. })
                            if error.code != NOT_META_LEADER && error.code != STARTING =>
                        {
                            return Err(failed(record, error.message));
                        }
                        Err(error) => last = error.to_string(),
                    }
                }
                None => {}
            }
            if tokio::time::Instant::now() + RETRY_PAUSE >= deadline {
                return Err(BrokerError::NotLeader {
                    queue: record.queue().to_string(),
                    partition: 0,
                    leader: None,
                    addr: None,
                })
                .inspect_err(|_| {
                    tracing::warn!(queue = record.queue(), %last, "the cluster's metadata group did not take a change in time");
                });
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// One past the group's last committed record as of now, on this node, which must lead
    /// the group (openraft's ReadIndex: it confirms with a quorum that it still leads).
    pub(crate) async fn read_index_here(&self) -> Result<u64, RemoteError> {
        match self.replica.read_index().await {
            Ok(committed) => Ok(committed),
            Err(error @ ProposeError::NotLeader { .. }) => {
                Err(RemoteError::new(NOT_META_LEADER, error.to_string()))
            }
            Err(error) => Err(RemoteError::new(PROPOSAL_FAILED, error.to_string())),
        }
    }

    /// One past the group's last committed record as of now, from its leader wherever it is,
    /// retrying until `timeout` while there is none or it moves. `Err`: what went wrong last.
    pub(crate) async fn read_index(&self, timeout: Duration) -> Result<u64, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = String::from("no leader is known");
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.leader().await {
                Some(leader) if leader == self.node_id => {
                    // The leader waits for its quorum's answer without a bound of its own.
                    match tokio::time::timeout(left, self.read_index_here()).await {
                        Ok(Ok(committed)) => return Ok(committed),
                        Ok(Err(error)) => last = error.message,
                        Err(_) => last = "this node leads and no quorum confirmed it".into(),
                    }
                }
                Some(leader) => {
                    let call = self
                        .transport
                        .call(leader, SERVICE_GROUP, KIND_READ_INDEX, Bytes::new(), left)
                        .await;
                    match call {
                        Ok(reply) => {
                            return offset_of(&reply).ok_or_else(|| {
                                format!("node {leader} answered {} bytes", reply.len())
                            })
                        }
                        Err(error) => last = format!("node {leader}: {error}"),
                    }
                }
                None => {}
            }
            if tokio::time::Instant::now() + RETRY_PAUSE >= deadline {
                return Err(last);
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// Stop this node's replica; its logs close once openraft lets go of them.
    pub(crate) async fn shutdown(self, groups: &Groups) {
        let logs = self.replica.shutdown(groups).await;
        let mut logs = logs;
        for _ in 0..500 {
            match logs.try_close() {
                Ok(Ok(())) => return,
                Ok(Err(error)) => {
                    tracing::warn!(%error, "closing the metadata group's logs");
                    return;
                }
                Err(again) => logs = again,
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::warn!("the metadata group's logs were still held 5 s after shutdown");
    }
}

fn offset_of(reply: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(reply.try_into().ok()?))
}

fn failed(record: &ClusterRecord, reason: String) -> BrokerError {
    BrokerError::Invalid(format!(
        "queue {:?}: the cluster's metadata group refused the change: {reason}",
        record.queue()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(ids: impl IntoIterator<Item = u64>) -> BTreeMap<u64, String> {
        ids.into_iter()
            .map(|id| (id, format!("127.0.0.1:{}", 7000 + id)))
            .collect()
    }

    fn ids(voters: &BTreeMap<u64, String>) -> Vec<u64> {
        voters.keys().copied().collect()
    }

    #[test]
    fn at_most_five_voters_and_the_current_ones_stay() {
        // Formed with seven: the five of lowest id vote.
        assert_eq!(
            ids(&meta_voters(&nodes(1..=7), &BTreeSet::new())),
            [1, 2, 3, 4, 5]
        );
        // Up to five nodes: every one votes.
        assert_eq!(ids(&meta_voters(&nodes(1..=3), &[1, 2].into())), [1, 2, 3]);
        // Node 2 removed: one learner takes its place, the other voters stay.
        let current: BTreeSet<u64> = [1, 2, 3, 4, 5].into();
        let left = nodes([1, 3, 4, 5, 6, 7]);
        assert_eq!(ids(&meta_voters(&left, &current)), [1, 3, 4, 5, 6]);
        // A node of lower id added later does not push a current voter out.
        let current: BTreeSet<u64> = [3, 4, 5, 6, 7].into();
        assert_eq!(ids(&meta_voters(&nodes(1..=7), &current)), [3, 4, 5, 6, 7]);
    }
}
