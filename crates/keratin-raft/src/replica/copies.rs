//! Which copy of the group's storage each member is (`docs/cluster.md`, "Storage
//! identities"): forming a group only where it exists nowhere yet, recording the members'
//! copies in the membership, and removing a member whose copy is not the recorded one, so
//! that it can be added back from an empty log.
//!
//! - **Forming** ([`form`], in the background of a replica of the group's formation whose log
//!   holds no membership): the replica asks the other voters of the formation what they hold
//!   (the storage probe). One whose log goes past the formation's entry (a leader was elected
//!   and wrote) means the group exists: this replica joins, never initializes (a copy of the
//!   formation that was wiped would otherwise write the formation's membership again and vote
//!   as the old copy). Once a majority of the formation, this replica included, is known to
//!   hold nothing past the formation's entry (an empty log, the formation's membership alone,
//!   or the group not opened yet), it initializes: every forming replica writes the same
//!   membership at index 0 (openraft allows it) and campaigns; the replica that wins hands
//!   the group to its preferred leader (the first of its replica list) as soon as that one
//!   acknowledged it. Otherwise it asks again after [`FORMATION_RETRY`]: while most of the
//!   formation is down, the group waits.
//! - **Recording** ([`record_while_running`], a task of every replica, acting while it leads):
//!   a member whose copy the membership does not record yet (a group formed a moment ago, a
//!   member that joined the formation from an empty log, a group written before identities
//!   existed) is probed, and its copy recorded (openraft's `SetNodes`, one entry) when its log
//!   reaches at least as far as the leader knows it to: a copy that went back (wiped before it
//!   was recorded) is left to the replacement below. The leader addresses such a copy from the
//!   probe on, before the change commits: a replica that joined after the group formed answers
//!   only requests addressed to its copy, and with another voter down the leader's lease and
//!   the change itself need its acknowledgements.
//! - **Replacing** ([`replace_copies`], called by the cluster's reconciler on the leader): a
//!   member that has not acknowledged the leader for [`COPY_ACK_AGE_MAX`] is probed; if it
//!   holds another copy than the recorded one, it is removed (a voter by joint consensus,
//!   `retain = false`, so that its replication progress goes too; a learner from the nodes).
//!   The reconciler's next change of voters adds it back as a learner with its new copy,
//!   follows it until it caught up, and promotes it. A voter is removed only while the voters
//!   whose copies are not in question are a majority: otherwise the joint entry could not
//!   commit, and the group waits for its old copies.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use keratin_net::{GroupId, Transport};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::errors::{InitializeError, RaftError as OpenRaftError};
use openraft::{ChangeMembers, RaftMetrics};

use super::membership::{ensure_leader, members, write_error, GroupMembers, MembershipError};
use super::ReplicaRaft;
use crate::error::RaftError;
use crate::network::probe::{probe_storage, ProbeError};
use crate::network::Addressing;
use crate::network::CopyStatus;
use crate::types::{NodeAddr, StorageId, TypeConfig};

/// A forming replica that could not decide asks the formation again after this.
pub const FORMATION_RETRY: Duration = Duration::from_millis(500);

/// A forming replica watches for the first leader's hand-over to the preferred leader this long
/// at most (the group's first election, the preferred leader's first acknowledgement)...
const FIRST_LEADER_FOR: Duration = Duration::from_secs(3);

/// ...looking again after this.
const FIRST_LEADER_POLL: Duration = Duration::from_millis(50);

/// A replica looks for unrecorded copies at least this often (a down member is asked again)...
const RECORD_EVERY: Duration = Duration::from_secs(1);

/// ...and at most this often, when its metrics change (a new leader records within a fifth of
/// a second; a busy leader's metrics change at every commit, so they are not followed closer).
const RECORD_PAUSE: Duration = Duration::from_millis(200);

/// How long the leader waits for the change recording members' copies to commit: two
/// election timeouts; longer means a majority is not there, and the change stays proposed.
const RECORD_WAIT: Duration = Duration::from_secs(2);

/// A member that acknowledged the leader within this is the recorded copy (a replaced copy
/// refuses everything addressed to the old one); one silent for longer is probed. Ten
/// heartbeat intervals.
pub const COPY_ACK_AGE_MAX: Duration = Duration::from_secs(1);

/// How a forming replica started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Formation {
    /// Its log held a membership already (it formed or joined before).
    Held,
    /// It initialized the group.
    Formed,
    /// Node `seen_on` holds the group past its formation: this replica joins.
    Joined {
        /// The node that told.
        seen_on: u64,
    },
}

/// Form the group with `voters` (this node among them) where it exists nowhere yet, or join
/// it (module docs, "Forming"); when this node is `first_leader` and initialized the group,
/// it campaigns at once. Returns once decided; `Err` once the replica stopped.
pub(crate) async fn form(
    raft: ReplicaRaft,
    transport: Transport,
    group: GroupId,
    voters: BTreeMap<u64, NodeAddr>,
    first_leader: Option<u64>,
) -> Result<Formation, RaftError> {
    let node = raft.metrics().borrow_watched().id;
    let stopped = |e: &dyn std::fmt::Display| RaftError::Invalid(format!("group {}: {e}", group.0));
    let mut told = false;
    loop {
        if raft.is_initialized().await.map_err(|e| stopped(&e))? {
            return Ok(Formation::Held);
        }
        let others: Vec<u64> = voters.keys().copied().filter(|id| *id != node).collect();
        let answers = join_all(
            others
                .iter()
                .map(|id| probe_storage(&transport, *id, group)),
        )
        .await;
        // This replica holds nothing yet.
        let mut nothing_past_formation = 1;
        for (id, answer) in others.iter().zip(answers) {
            match answer {
                Ok(status) if past_formation(&status) => {
                    tracing::info!(
                        group = group.0,
                        seen_on = id,
                        "the group exists: this replica joins it"
                    );
                    return Ok(Formation::Joined { seen_on: *id });
                }
                Ok(_) | Err(ProbeError::NoGroup { .. }) => nothing_past_formation += 1,
                Err(ProbeError::NoAnswer { .. }) => {}
            }
        }
        if nothing_past_formation * 2 > voters.len() {
            return match raft.initialize(voters.clone()).await {
                Ok(()) => {
                    if let Some(preferred) = first_leader {
                        hand_to_first_leader(&raft, group, preferred).await;
                    }
                    Ok(Formation::Formed)
                }
                // Another member's entries reached it meanwhile: formed.
                Err(OpenRaftError::APIError(InitializeError::NotAllowed(_))) => Ok(Formation::Held),
                Err(error) => Err(RaftError::Invalid(format!(
                    "form group {} with voters {:?}: {error}",
                    group.0,
                    voters.keys().collect::<Vec<_>>()
                ))),
            };
        }
        if !told {
            told = true;
            tracing::info!(group = group.0, voters = ?voters.keys().collect::<Vec<_>>(), "forming the group waits until a majority of its voters answers");
        }
        tokio::time::sleep(FORMATION_RETRY).await;
    }
}

/// Every forming replica campaigns as it initializes (openraft's `initialize` elects at once),
/// so the first election goes to whichever asks first. The replica that wins hands the group to
/// its preferred leader `preferred` as soon as that one has acknowledged it (a leadership
/// transfer: one more election, a millisecond or two on a LAN), so a new group starts on its
/// preferred leader whether leader balancing is on or not. Each forming replica watches for
/// [`FIRST_LEADER_FOR`] at most, looking again every [`FIRST_LEADER_POLL`]; a hand-over that
/// does not happen (the preferred leader down or slow) is left to leader balancing.
async fn hand_to_first_leader(raft: &ReplicaRaft, group: GroupId, preferred: u64) {
    let deadline = tokio::time::Instant::now() + FIRST_LEADER_FOR;
    loop {
        let (leader, leads) = {
            let metrics = raft.metrics().borrow_watched().clone();
            (
                metrics.current_leader,
                metrics.state.is_leader() && metrics.current_leader == Some(metrics.id),
            )
        };
        if leader == Some(preferred) {
            return;
        }
        if leads {
            match super::membership::transfer_leader(raft, group.0, preferred).await {
                Ok(true) => return,
                Ok(false) => {}
                Err(error) => {
                    tracing::debug!(group = group.0, preferred, %error, "handing a new group to its preferred leader");
                    return;
                }
            }
        }
        if tokio::time::Instant::now() + FIRST_LEADER_POLL > deadline {
            return;
        }
        tokio::time::sleep(FIRST_LEADER_POLL).await;
    }
}

/// A copy holding entries past the formation's membership at index 0: a leader was elected.
fn past_formation(status: &CopyStatus) -> bool {
    status.last_index.is_some_and(|index| index > 0)
}

/// Record the members' copies while this replica leads, until it stops (module docs,
/// "Recording"). `own` is this replica's copy.
pub(crate) async fn record_while_running(
    raft: ReplicaRaft,
    transport: Transport,
    group: GroupId,
    own: StorageId,
    addressing: Arc<Addressing>,
) {
    let mut watched = raft.metrics();
    loop {
        // Woken by a change of the metrics or after a while; the metrics close when the
        // replica stops.
        if let Ok(Err(_)) = tokio::time::timeout(RECORD_EVERY, watched.changed()).await {
            return;
        }
        let wanted = {
            let metrics = watched.borrow_watched();
            unrecorded(&metrics)
        };
        if let Some(wanted) = wanted {
            match record(&raft, &transport, &addressing, group, own, wanted).await {
                Ok(recorded) if !recorded.is_empty() => {
                    tracing::info!(group = group.0, nodes = ?recorded, "members' storage copies recorded")
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(group = group.0, %error, "recording members' storage copies; again later")
                }
            }
        }
        tokio::time::sleep(RECORD_PAUSE).await;
    }
}

/// On a leader whose membership is uniform: the members whose copy it does not record.
fn unrecorded(metrics: &RaftMetrics<TypeConfig>) -> Option<BTreeSet<u64>> {
    if !metrics.state.is_leader() || metrics.current_leader != Some(metrics.id) {
        return None;
    }
    let membership = metrics.membership_config.membership();
    if membership.get_joint_config().len() > 1 {
        return None;
    }
    let wanted: BTreeSet<u64> = membership
        .nodes()
        .filter(|(_, node)| node.storage.is_none())
        .map(|(id, _)| *id)
        .collect();
    (!wanted.is_empty()).then_some(wanted)
}

/// Probe `wanted` and record the copies that hold what the leader knows them to hold; the
/// nodes recorded. Each such copy is addressed from the probe on, before the change commits
/// (or while another change is under way): the change may need its acknowledgement (a
/// replica that joined after the group formed answers nothing else, and with another voter
/// down it is the leader's majority). The change is waited for [`RECORD_WAIT`] at most: one
/// that a majority cannot commit yet stays proposed, and the next round probes again.
async fn record(
    raft: &ReplicaRaft,
    transport: &Transport,
    addressing: &Addressing,
    group: GroupId,
    own: StorageId,
    wanted: BTreeSet<u64>,
) -> Result<Vec<u64>, MembershipError> {
    let (node, membership, matched) = {
        let metrics = raft.metrics().borrow_watched().clone();
        ensure_leader(&metrics, group.0)?;
        (
            metrics.id,
            metrics.membership_config.clone(),
            matched_of(&metrics),
        )
    };
    let mut set = BTreeMap::new();
    for id in wanted {
        let Some(recorded) = membership.membership().get_node(&id) else {
            continue;
        };
        let storage = if id == node {
            own
        } else {
            match probe_storage(transport, id, group).await {
                Ok(status) if !went_back(&status, matched.get(&id).copied().flatten()) => {
                    addressing.probed(id, status.storage);
                    status.storage
                }
                Ok(status) => {
                    tracing::warn!(group = group.0, node = id, copy = %status.storage, last = ?status.last_index, "a member's unrecorded copy holds less than it acknowledged: it is replaced, not recorded");
                    continue;
                }
                Err(_) => continue,
            }
        };
        set.insert(id, NodeAddr::with_storage(recorded.addr.clone(), storage));
    }
    if set.is_empty() {
        return Ok(Vec::new());
    }
    let (latest, committed) = members(raft, group.0).await?;
    if latest != committed || latest.joint {
        return Ok(Vec::new());
    }
    let nodes: Vec<u64> = set.keys().copied().collect();
    let change = raft.change_membership(ChangeMembers::SetNodes(set), true);
    match tokio::time::timeout(RECORD_WAIT, change).await {
        Ok(changed) => changed.map_err(|e| write_error(group.0, node, e))?,
        Err(_) => {
            return Err(MembershipError::Uncommitted {
                group: group.0,
                waited_ms: u64::try_from(RECORD_WAIT.as_millis()).unwrap_or(u64::MAX),
            })
        }
    };
    Ok(nodes)
}

/// Each member's last entry the leader knows it holds.
fn matched_of(metrics: &RaftMetrics<TypeConfig>) -> BTreeMap<u64, Option<u64>> {
    metrics
        .replication
        .iter()
        .flatten()
        .map(|(id, log_id)| (*id, log_id.as_ref().map(|l| l.index)))
        .collect()
}

/// Whether a copy holds less than the leader knows its node acknowledged: its log went back.
fn went_back(status: &CopyStatus, matched: Option<u64>) -> bool {
    match matched {
        None => false,
        Some(matched) => status.last_index.is_none_or(|last| last < matched),
    }
}

/// What [`replace_copies`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replaced {
    /// Members removed because their copy is not the recorded one (to be added back).
    pub removed: BTreeSet<u64>,
    /// Voters whose copy is not the recorded one but that stay, because the others are no
    /// majority: the group waits for its old copies.
    pub kept: BTreeSet<u64>,
}

/// On the leader: remove the members whose copy is not the recorded one (module docs,
/// "Replacing"). Nothing while a membership change is under way.
pub(crate) async fn replace_copies(
    raft: &ReplicaRaft,
    transport: &Transport,
    group: GroupId,
) -> Result<Replaced, MembershipError> {
    let (node, membership, matched, silent) = {
        let metrics = raft.metrics().borrow_watched().clone();
        ensure_leader(&metrics, group.0)?;
        let silent = silent_members(&metrics);
        (
            metrics.id,
            metrics.membership_config.clone(),
            matched_of(&metrics),
            silent,
        )
    };
    let (latest, committed) = members(raft, group.0).await?;
    if latest != committed || latest.joint {
        return Ok(Replaced::default());
    }
    let mut stale = BTreeSet::new();
    for id in silent {
        let Some(recorded) = membership.membership().get_node(&id) else {
            continue;
        };
        let Ok(status) = probe_storage(transport, id, group).await else {
            continue;
        };
        let other_copy = match recorded.storage {
            Some(storage) => storage != status.storage,
            None => went_back(&status, matched.get(&id).copied().flatten()),
        };
        if other_copy {
            tracing::warn!(group = group.0, node = id, recorded = ?recorded.storage, holds = %status.storage, "a member holds another copy of the group's storage than the recorded one: it is removed, then added back from an empty log");
            stale.insert(id);
        }
    }
    remove_stale(raft, group.0, node, &committed, stale).await
}

/// The members other than the leader that have not acknowledged it within
/// [`COPY_ACK_AGE_MAX`] (none on a replica that does not lead).
pub(crate) fn silent_members(metrics: &RaftMetrics<TypeConfig>) -> BTreeSet<u64> {
    if !metrics.state.is_leader() || metrics.current_leader != Some(metrics.id) {
        return BTreeSet::new();
    }
    let acked = metrics.heartbeat.as_ref();
    metrics
        .membership_config
        .membership()
        .nodes()
        .map(|(id, _)| *id)
        .filter(|id| *id != metrics.id)
        .filter(|id| {
            let at = acked.and_then(|acked| acked.get(id).cloned().flatten());
            at.is_none_or(|at| openraft::Instant::elapsed(&*at) > COPY_ACK_AGE_MAX)
        })
        .collect()
}

/// Remove the `stale` members of `current` (see [`replace_copies`]).
async fn remove_stale(
    raft: &ReplicaRaft,
    group: u64,
    node: u64,
    current: &GroupMembers,
    stale: BTreeSet<u64>,
) -> Result<Replaced, MembershipError> {
    let mut replaced = Replaced::default();
    let stale_voters: BTreeSet<u64> = stale.intersection(&current.voters).copied().collect();
    let stale_learners: BTreeSet<u64> = stale.difference(&stale_voters).copied().collect();
    if !stale_voters.is_empty() {
        let rest: BTreeSet<u64> = current.voters.difference(&stale_voters).copied().collect();
        if rest.len() * 2 > current.voters.len() {
            raft.change_membership(ChangeMembers::ReplaceAllVoters(rest), false)
                .await
                .map_err(|e| write_error(group, node, e))?;
            replaced.removed.extend(stale_voters);
        } else {
            tracing::warn!(group, voters = ?current.voters, replaced = ?stale_voters, "most voters hold other copies than the recorded ones: the group waits for its recorded copies");
            replaced.kept = stale_voters;
        }
    }
    if !stale_learners.is_empty() {
        raft.change_membership(ChangeMembers::RemoveNodes(stale_learners.clone()), false)
            .await
            .map_err(|e| write_error(group, node, e))?;
        replaced.removed.extend(stale_learners);
    }
    Ok(replaced)
}
