//! A group's membership: forming it (its first voters) and changing the voters of a live group.
//!
//! Forming: openraft accepts `initialize` on every member at once when all name the same
//! voters (its docs: "Calling `initialize()` on multiple nodes with identical configuration is
//! also acceptable"), so a group whose members are decided elsewhere (the cluster's metadata,
//! the `[cluster]` settings) is formed by each member initializing it with that same set: no
//! member has to be up first. Each does so only once it learned that the group exists nowhere
//! yet ([`Replica::form`], `copies.rs`): a member whose copy was wiped joins. A node that joins
//! a live group later never initializes: it starts empty and waits for the leader to add it
//! (`partition_log/provider.rs`).
//!
//! Changing ([`Replica::change_voters`], on the leader): every new node is added as a learner,
//! with the copy of the group's storage it holds (asked with the storage probe: `copies.rs`;
//! a learner already whose recorded copy is not the one it holds is removed and added back
//! with it), and followed until it holds everything up to the entry that added it (a snapshot and the
//! entries after it, as any lagging follower), within a bound; then the voters change by joint
//! consensus (openraft's `change_membership`: a joint entry, then the uniform one), and the
//! call returns once the uniform membership is committed. Voters that leave stay *learners*
//! (`retain`): the leader keeps replicating to them, so each learns that the membership which
//! dropped it committed, and stops campaigning (openraft elects only a voter of its effective
//! or committed membership); a removed node that was cut off at once (openraft's `retain =
//! false`) would be left with the joint membership in which it still votes, and would campaign
//! with ever higher terms (refused while the leader's lease holds, but noise). A removed
//! node's replica then retires ([`Replica::wait_retired`]: only once its committed membership
//! no longer names it a voter) and the leader forgets it ([`Replica::remove_learners`]).
//!
//! A leader that removes itself leads until the uniform membership commits; openraft keeps a
//! leader that is a *learner* leading, so it then removes itself from the nodes too (a
//! second, single-step membership entry). Once that commits, openraft's step-down watcher
//! (`Config::removed_leader_step_down`, 150 ms by default) asks the most up-to-date voter to
//! take over (the `transfer_leader` RPC) and, a heartbeat later, reverts the node to a follower
//! that is no voter; the voter asked campaigns at once (the others, told of the transfer,
//! grant it), else the voters elect one of them after their election timeout.
//!
//! Handing leadership over ([`Replica::transfer_leader`], on the leader): to a voter that holds
//! nearly all of the leader's log and answered it lately, else nothing is done. openraft stops
//! proposing on the leader and asks every voter to accept the new one; the one named campaigns
//! once it holds the leader's last entry. The former leader knows that a
//! committed membership no longer names it, so it retires at once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use openraft::async_runtime::watch::WatchReceiver;
use openraft::errors::{ClientWriteError, RaftError as OpenRaftError};
use openraft::{ChangeMembers, RaftMetrics};

use keratin_net::{GroupId, Transport};

use super::copies::{self, Formation, Replaced};
use super::{Replica, ReplicaRaft};
use crate::error::RaftError;
use crate::network::probe::probe_storage;
use crate::types::{NodeAddr, TypeConfig};

/// How long [`Replica::change_voters`] waits by default for a new node to catch up: a
/// replica's log past its floor is bounded by about twice the live bytes plus two segments
/// (`docs/cluster.md`, "Snapshots and rebuild"); 60 s moves a few GiB over a LAN, and a
/// larger backlog is retried (the learner keeps catching up meanwhile).
pub const CATCH_UP_WAIT: Duration = Duration::from_secs(60);

/// [`Replica::transfer_leader`] hands over only to a voter at most this many entries behind
/// the leader...
pub const TRANSFER_LAG_MAX: u64 = 256;

/// ...that acknowledged the leader this recently (ten heartbeat intervals).
pub const TRANSFER_ACK_AGE_MAX: Duration = Duration::from_secs(1);

/// How often the waits below look at openraft's metrics when nothing changed (they also wake
/// on every change).
const METRICS_POLL: Duration = Duration::from_millis(50);

/// A group's members as one replica sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMembers {
    /// The voters (every voter of both halves while joint).
    pub voters: BTreeSet<u64>,
    /// Nodes that receive the log without voting.
    pub learners: BTreeSet<u64>,
    /// Whether the membership is joint (a change under way, or left half-done by a leader
    /// that was lost between its two entries).
    pub joint: bool,
    /// The offset of the entry that holds the membership (`None`: the group is not formed).
    pub offset: Option<u64>,
}

impl GroupMembers {
    fn of(stored: &openraft::StoredMembership<crate::types::LeaderId, u64, NodeAddr>) -> Self {
        let membership = stored.membership();
        GroupMembers {
            voters: membership.voter_ids().collect(),
            learners: membership.learner_ids().collect(),
            joint: membership.get_joint_config().len() > 1,
            offset: stored.log_id().as_ref().map(|id| id.index),
        }
    }
}

/// Why a change of a group's members (or a replica's retirement) did not complete.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipError {
    /// Membership changes are made on the group's leader; this node does not lead.
    #[error("node {node} does not lead group {group}{}; change its members on the leader", match .leader {
        Some(id) => format!(" (node {id} does)"),
        None => " (no leader is known yet; retry once one is elected)".to_string(),
    })]
    NotLeader {
        /// The group.
        group: u64,
        /// This node.
        node: u64,
        /// The leader this node knows of.
        leader: Option<u64>,
    },
    /// A group needs at least one voter.
    #[error("group {group}: a group needs at least one voter (the target is empty)")]
    EmptyTarget {
        /// The group.
        group: u64,
    },
    /// A new node did not catch up within the wait; it stays a learner and keeps catching up,
    /// the voters are unchanged.
    #[error(
        "group {group}: node {node} was added as a learner but holds entries up to {} of the \
         {needed} it needs after {waited_ms} ms (is it running, reachable, with room?); it \
         keeps catching up as a learner and the voters are unchanged: call again to finish",
        .matched.map_or_else(|| "none".to_string(), |m| m.to_string())
    )]
    CatchUpTimeout {
        /// The group.
        group: u64,
        /// The learner.
        node: u64,
        /// The last offset the leader knows it holds.
        matched: Option<u64>,
        /// The offset it must hold (the entry that added it).
        needed: u64,
        /// How long it was waited for.
        waited_ms: u64,
    },
    /// openraft refused the change (another change under way, a learner missing, ...);
    /// nothing or only the joint half was written.
    #[error("group {group}: the membership change was refused: {reason}; retry once the current change has committed")]
    Refused {
        /// The group.
        group: u64,
        /// openraft's reason.
        reason: String,
    },
    /// The change was proposed but its fate is not known here: this node lost leadership or
    /// its entry was cut. Read the members on the new leader and call again there.
    #[error("group {group}: leadership changed during the membership change ({reason}); its outcome is unknown: read the members on the new leader and call again there")]
    Interrupted {
        /// The group.
        group: u64,
        /// What happened.
        reason: String,
    },
    /// The change was proposed and did not commit within the wait: a majority of the voters
    /// has not acknowledged it. It stays proposed and commits once they do.
    #[error("group {group}: the membership change was proposed and not committed within {waited_ms} ms (is a majority of the voters down?); it commits once a majority acknowledges it")]
    Uncommitted {
        /// The group.
        group: u64,
        /// How long it was waited for.
        waited_ms: u64,
    },
    /// The replica still votes in the membership it knows to be committed, so it must not be
    /// removed (its vote may be needed for a majority).
    #[error("group {group}: node {node} is still a voter in the committed membership (voters {voters:?}); change the voters on the leader first")]
    StillVoter {
        /// The group.
        group: u64,
        /// This node.
        node: u64,
        /// The committed voters.
        voters: BTreeSet<u64>,
    },
    /// A node to add did not say which copy of the group's storage it holds (it is down, or
    /// has not opened its replica yet); nothing was changed.
    #[error("group {group}: node {node} did not say which copy of the group it holds ({reason}); is it running with the group open? retry")]
    NoCopy {
        /// The group.
        group: u64,
        /// The node.
        node: u64,
        /// What the probe got.
        reason: String,
    },
    /// The replica is not open on this node.
    #[error("group {group} is not open on this node (or its replica failed and is not rebuilt)")]
    NotOpen {
        /// The group.
        group: u64,
    },
    /// The group stopped on this node (shut down, or its storage failed).
    #[error("group {group} stopped on this node: {reason}")]
    Stopped {
        /// The group.
        group: u64,
        /// Why.
        reason: String,
    },
}

impl Replica {
    /// Whether the group's log holds a membership already (formed here before, or joined).
    pub async fn is_initialized(&self) -> Result<bool, RaftError> {
        self.raft
            .is_initialized()
            .await
            .map_err(|e| RaftError::Invalid(format!("group {}: {e}", self.group.0)))
    }

    /// Form the group with `voters` (node id to cluster address; this node among them) where
    /// it exists nowhere yet, else join it (`copies.rs`, "Forming"): returns once decided,
    /// which takes until a majority of `voters` answered. Every voter may call it at the same
    /// time with the same `voters`. Run it in the background ([`Replica::form_in_background`]).
    pub async fn form(&self, voters: &BTreeMap<u64, String>) -> Result<Formation, RaftError> {
        copies::form(
            self.raft.clone(),
            self.transport.clone(),
            self.group,
            formation_members(voters),
            None,
        )
        .await
    }

    /// [`Replica::form`] on a task of its own (it ends when decided or when the replica
    /// stops); a failure is logged. With `first_leader`, the replica that wins the group's
    /// first election hands it to that node as soon as it acknowledged (`copies.rs`,
    /// "Forming"): a new partition starts on its preferred leader without waiting for leader
    /// balancing, which may be off.
    pub fn form_in_background(&self, voters: &BTreeMap<u64, String>, first_leader: Option<u64>) {
        let forming = copies::form(
            self.raft.clone(),
            self.transport.clone(),
            self.group,
            formation_members(voters),
            first_leader,
        );
        let group = self.group.0;
        tokio::spawn(async move {
            match forming.await {
                Ok(Formation::Formed) => tracing::info!(group, "group formed"),
                Ok(_) => {}
                Err(error) => tracing::warn!(group, %error, "forming the group"),
            }
        });
    }

    /// On the leader: the members that have not acknowledged it lately (down, cut off, or
    /// holding another copy): [`Replica::replace_copies`] asks them. Empty elsewhere.
    pub fn silent_members(&self) -> BTreeSet<u64> {
        copies::silent_members(&self.raft.metrics().borrow_watched())
    }

    /// On the leader: remove the members that hold another copy of the group's storage than
    /// the recorded one (`copies.rs`, "Replacing"); [`Replica::change_voters`] adds them back.
    pub async fn replace_copies(&self) -> Result<Replaced, MembershipError> {
        copies::replace_copies(&self.raft, &self.transport, self.group).await
    }

    /// The members in the latest membership this replica holds (committed or not), and in
    /// the latest one it knows committed.
    pub async fn members(&self) -> Result<(GroupMembers, GroupMembers), MembershipError> {
        members(&self.raft, self.group.0).await
    }

    /// Make `target` (node id to cluster address) the group's voters: see the module docs.
    /// Run on the leader; waits up to `catch_up_wait` for each new node to catch up, and
    /// returns the members once the new membership is committed. `target` equal to the
    /// voters already is answered at once.
    pub async fn change_voters(
        &self,
        target: &BTreeMap<u64, String>,
        catch_up_wait: Duration,
    ) -> Result<GroupMembers, MembershipError> {
        change_voters(
            &self.raft,
            &self.transport,
            self.group,
            target,
            catch_up_wait,
        )
        .await
    }

    /// Add `learners` (node id to cluster address) that are not members yet: they receive
    /// the log without voting. Does not wait for them to catch up.
    pub async fn add_learners(
        &self,
        learners: &BTreeMap<u64, String>,
    ) -> Result<GroupMembers, MembershipError> {
        add_learners(&self.raft, &self.transport, self.group, learners).await
    }

    /// Hand the leadership over to voter `to` if it is nearly caught up (see the module
    /// docs): `Ok(true)` once openraft was asked to, `Ok(false)` if `to` is not ready (or
    /// already leads).
    pub async fn transfer_leader(&self, to: u64) -> Result<bool, MembershipError> {
        transfer_leader(&self.raft, self.group.0, to).await
    }

    /// Forget `learners` (nodes that left the voters and retired): the leader stops
    /// replicating to them. Refuses a voter.
    pub async fn remove_learners(
        &self,
        learners: &BTreeSet<u64>,
    ) -> Result<GroupMembers, MembershipError> {
        remove_learners(&self.raft, self.group.0, learners).await
    }

    /// Waits up to `wait` until neither this replica's latest membership nor its committed one
    /// names it a voter, the condition for removing its data: its vote can no longer be
    /// needed. (A group that committed nothing yet has no committed membership, and its
    /// voters are voters all the same.)
    pub async fn wait_retired(&self, wait: Duration) -> Result<(), MembershipError> {
        wait_retired(&self.raft, self.group.0, wait).await
    }
}

/// The latest membership `raft` holds, and the latest it knows committed (read from the core's
/// state: the metrics follow it a moment later).
pub(crate) async fn members(
    raft: &ReplicaRaft,
    group: u64,
) -> Result<(GroupMembers, GroupMembers), MembershipError> {
    raft.with_raft_state(|state| {
        (
            GroupMembers::of(state.membership_state.effective()),
            GroupMembers::of(state.membership_state.committed()),
        )
    })
    .await
    .map_err(|e| MembershipError::Stopped {
        group,
        reason: e.to_string(),
    })
}

/// The members of a formation, their copies not recorded yet (every forming replica must
/// write the same membership).
fn formation_members(voters: &BTreeMap<u64, String>) -> BTreeMap<u64, NodeAddr> {
    voters
        .iter()
        .map(|(id, addr)| (*id, NodeAddr::new(addr.clone())))
        .collect()
}

/// Node `id` at `addr` as a new member: with the copy of the group's storage it holds now.
async fn new_member(
    transport: &Transport,
    group: GroupId,
    id: u64,
    addr: &str,
) -> Result<NodeAddr, MembershipError> {
    match probe_storage(transport, id, group).await {
        Ok(status) => Ok(NodeAddr::with_storage(addr, status.storage)),
        Err(error) => Err(MembershipError::NoCopy {
            group: group.0,
            node: id,
            reason: error.to_string(),
        }),
    }
}

/// `Ok` on the leader, else who leads.
pub(crate) fn ensure_leader(
    metrics: &RaftMetrics<TypeConfig>,
    group: u64,
) -> Result<(), MembershipError> {
    if metrics.state.is_leader() && metrics.current_leader == Some(metrics.id) {
        return Ok(());
    }
    Err(MembershipError::NotLeader {
        group,
        node: metrics.id,
        leader: metrics
            .current_leader
            .filter(|leader| *leader != metrics.id),
    })
}

/// openraft's refusal of a membership write, in our terms.
pub(crate) fn write_error(
    group: u64,
    node: u64,
    error: OpenRaftError<TypeConfig, ClientWriteError<TypeConfig>>,
) -> MembershipError {
    match error {
        OpenRaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => {
            MembershipError::NotLeader {
                group,
                node,
                leader: forward.leader_id,
            }
        }
        OpenRaftError::APIError(ClientWriteError::LogEntryDiscarded(forward)) => {
            MembershipError::Interrupted {
                group,
                reason: format!("the entry was cut by a new leader ({forward})"),
            }
        }
        OpenRaftError::APIError(other) => MembershipError::Refused {
            group,
            reason: other.to_string(),
        },
        OpenRaftError::Fatal(fatal) => MembershipError::Stopped {
            group,
            reason: fatal.to_string(),
        },
    }
}

/// See [`Replica::change_voters`].
pub(crate) async fn change_voters(
    raft: &ReplicaRaft,
    transport: &Transport,
    group_id: GroupId,
    target: &BTreeMap<u64, String>,
    catch_up_wait: Duration,
) -> Result<GroupMembers, MembershipError> {
    let group = group_id.0;
    if target.is_empty() {
        return Err(MembershipError::EmptyTarget { group });
    }
    let (node, current, known) = {
        let metrics = raft.metrics().borrow_watched().clone();
        ensure_leader(&metrics, group)?;
        let known: BTreeMap<u64, NodeAddr> = metrics
            .membership_config
            .membership()
            .nodes()
            .map(|(id, node)| (*id, node.clone()))
            .collect();
        (
            metrics.id,
            GroupMembers::of(&metrics.membership_config),
            known,
        )
    };
    let wanted: BTreeSet<u64> = target.keys().copied().collect();
    if !current.joint && current.voters == wanted {
        return Ok(current);
    }
    for (id, addr) in target {
        if current.voters.contains(id) {
            continue;
        }
        // Every node that joins says which copy of the group it holds now. A learner already
        // (a change before this one added it) keeps its recorded copy while it holds it; one
        // that holds another copy (it left the group and removed its files, then was placed
        // here again; or its directory was wiped) is forgotten and added back with the copy
        // it holds: the catch-up would otherwise wait on a copy that refuses every append.
        let now = new_member(transport, group_id, *id, addr).await?;
        let node_addr = match known.get(id) {
            Some(known) if known.storage.is_none() || known.storage == now.storage => known.clone(),
            Some(_) => {
                tracing::info!(group, node = id, "a learner holds another copy than the recorded one: it is added back with the copy it holds");
                raft.change_membership(ChangeMembers::RemoveNodes([*id].into()), false)
                    .await
                    .map_err(|e| write_error(group, node, e))?;
                now
            }
            None => now,
        };
        let added = raft
            .add_learner(*id, node_addr, false)
            .await
            .map_err(|e| write_error(group, node, e))?;
        wait_caught_up(raft, group, *id, added.log_id.index, catch_up_wait).await?;
    }
    raft.change_membership(wanted, true)
        .await
        .map_err(|e| write_error(group, node, e))?;
    if !target.contains_key(&node) {
        // openraft keeps a leader leading while it is a learner: it steps down (its
        // step-down watcher) only once a committed membership no longer names it at all. So
        // a leader that left the voters forgets itself too; the membership that says so is
        // committed, so it knows it holds no vote and can retire.
        raft.change_membership(ChangeMembers::RemoveNodes([node].into()), false)
            .await
            .map_err(|e| write_error(group, node, e))?;
    }
    let (_, committed) = members(raft, group).await?;
    tracing::info!(group, voters = ?committed.voters, learners = ?committed.learners, "group voters changed");
    Ok(committed)
}

/// Waits until the leader knows learner `id` holds the entries up to `needed`.
async fn wait_caught_up(
    raft: &ReplicaRaft,
    group: u64,
    id: u64,
    needed: u64,
    wait: Duration,
) -> Result<(), MembershipError> {
    let started = tokio::time::Instant::now();
    let deadline = started + wait;
    let mut watched = raft.metrics();
    loop {
        let matched = {
            let metrics = watched.borrow_watched();
            if !metrics.state.is_leader() {
                return Err(MembershipError::Interrupted {
                    group,
                    reason: format!("this node stopped leading while node {id} caught up"),
                });
            }
            metrics
                .replication
                .as_ref()
                .and_then(|replication| replication.get(&id).cloned().flatten())
                .map(|log_id| log_id.index)
        };
        if matched.is_some_and(|m| m >= needed) {
            return Ok(());
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(MembershipError::CatchUpTimeout {
                group,
                node: id,
                matched,
                needed,
                waited_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            });
        }
        let nap = METRICS_POLL.min(deadline - now);
        // Woken by a change of the metrics or after a short nap, whichever first.
        let _ = tokio::time::timeout(nap, watched.changed()).await;
    }
}

/// See [`Replica::transfer_leader`].
pub(crate) async fn transfer_leader(
    raft: &ReplicaRaft,
    group: u64,
    to: u64,
) -> Result<bool, MembershipError> {
    let ready = {
        let metrics = raft.metrics().borrow_watched().clone();
        ensure_leader(&metrics, group)?;
        if to == metrics.id || !metrics.membership_config.voter_ids().any(|id| id == to) {
            return Ok(false);
        }
        let end = metrics.last_log_index.map_or(0, |index| index + 1);
        let matched_end = metrics
            .replication
            .as_ref()
            .and_then(|replication| replication.get(&to).cloned().flatten())
            .map_or(0, |log_id| log_id.index + 1);
        let acked_ago = metrics
            .heartbeat
            .as_ref()
            .and_then(|heartbeat| heartbeat.get(&to).cloned().flatten())
            .map(|at| openraft::Instant::elapsed(&*at));
        end.saturating_sub(matched_end) <= TRANSFER_LAG_MAX
            && acked_ago.is_some_and(|ago| ago <= TRANSFER_ACK_AGE_MAX)
    };
    if !ready {
        return Ok(false);
    }
    raft.trigger()
        .transfer_leader(to)
        .await
        .map_err(|fatal| MembershipError::Stopped {
            group,
            reason: fatal.to_string(),
        })?;
    tracing::info!(group, to, "leadership handed over");
    Ok(true)
}

/// See [`Replica::add_learners`].
pub(crate) async fn add_learners(
    raft: &ReplicaRaft,
    transport: &Transport,
    group_id: GroupId,
    learners: &BTreeMap<u64, String>,
) -> Result<GroupMembers, MembershipError> {
    let group = group_id.0;
    let (node, current) = {
        let metrics = raft.metrics().borrow_watched().clone();
        ensure_leader(&metrics, group)?;
        (metrics.id, GroupMembers::of(&metrics.membership_config))
    };
    for (id, addr) in learners {
        if current.voters.contains(id) || current.learners.contains(id) {
            continue;
        }
        let node_addr = new_member(transport, group_id, *id, addr).await?;
        raft.add_learner(*id, node_addr, false)
            .await
            .map_err(|e| write_error(group, node, e))?;
    }
    Ok(members(raft, group).await?.1)
}

/// See [`Replica::remove_learners`].
pub(crate) async fn remove_learners(
    raft: &ReplicaRaft,
    group: u64,
    learners: &BTreeSet<u64>,
) -> Result<GroupMembers, MembershipError> {
    let (node, current) = {
        let metrics = raft.metrics().borrow_watched().clone();
        ensure_leader(&metrics, group)?;
        (metrics.id, GroupMembers::of(&metrics.membership_config))
    };
    if let Some(voter) = learners.iter().find(|id| current.voters.contains(id)) {
        return Err(MembershipError::Refused {
            group,
            reason: format!(
                "node {voter} is a voter (voters {:?}); change the voters first",
                current.voters
            ),
        });
    }
    let gone: BTreeSet<u64> = learners.intersection(&current.learners).copied().collect();
    if gone.is_empty() {
        return Ok(current);
    }
    raft.change_membership(ChangeMembers::RemoveNodes(gone), false)
        .await
        .map_err(|e| write_error(group, node, e))?;
    Ok(members(raft, group).await?.1)
}

/// See [`Replica::wait_retired`].
pub(crate) async fn wait_retired(
    raft: &ReplicaRaft,
    group: u64,
    wait: Duration,
) -> Result<(), MembershipError> {
    let node = raft.metrics().borrow_watched().id;
    let deadline = tokio::time::Instant::now() + wait;
    let mut watched = raft.metrics();
    loop {
        let (latest, committed) = members(raft, group).await?;
        // Retired once neither the latest membership nor the committed one names it (a
        // joining replica never added is in neither). The committed one alone is not enough:
        // a young group that committed nothing yet knows no committed membership, though this
        // node is one of its voters.
        if !latest.voters.contains(&node) && !committed.voters.contains(&node) {
            return Ok(());
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(MembershipError::StillVoter {
                group,
                node,
                voters: if committed.voters.contains(&node) {
                    committed.voters
                } else {
                    latest.voters
                },
            });
        }
        let _ = tokio::time::timeout(METRICS_POLL.min(deadline - now), watched.changed()).await;
    }
}
