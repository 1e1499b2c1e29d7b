//! The reconciler: on every node, every [`ROUND`], each Raft group this node leads (a queue's
//! partition, a stream's partition or cursor log: `groups.rs`) is brought to the members the
//! metadata says it has.
//! - A partition group whose committed voters differ from its replicas in the catalog changes
//!   them (`ReplicatedLogs::change_voters`: new nodes join as learners and catch up first,
//!   then joint consensus). One change per group at a time, on a task of its own. A group left
//!   joint (its leader lost between the joint and the final entry) is finished toward the
//!   catalog's replicas the same way.
//! - A member that has not acknowledged the leader lately is asked which copy of the group's
//!   storage it holds; one that holds another copy than the recorded one (its directory was
//!   wiped) is removed (`ReplicatedLogs::replace_copies`), and the change of voters above adds
//!   it back as a learner, catches it up and promotes it (`docs/cluster.md`, "Storage
//!   identities").
//! - Learners that are no longer replicas (voters that left) are forgotten once they had
//!   [`LEARNER_GRACE`] to learn that the change committed (they retire on seeing it).
//! - The metadata group's voters are up to [`crate::META_VOTERS_MAX`] of the cluster's nodes
//!   (those it was formed with and the added ones, but the removed ones; `meta::meta_voters`
//!   says which), with the same steps; the other nodes are made learners.
//!
//! - A partition group led here whose voters are settled hands its leadership back to its
//!   preferred leader, the first of its replicas as `groups.rs` lists them (`balance.rs`), a bounded
//!   number of groups per round, while `cluster.leader_balance` is on.
//!
//! It only acts on a group whose latest membership is committed, so it never races a change in
//! flight, including one of a leader before this one; a committed joint membership is no
//! change in flight (its leader is gone) and is finished.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_net::GroupId;
use keratin_raft::partition_log::ReplicatedLogs;
use keratin_raft::replica::{GroupMembers, CATCH_UP_WAIT};
use tokio::sync::watch;

use crate::applier::AppliedState;
use crate::balance::Balancer;
use crate::meta::{meta_voters, MetaGroup};

/// How often the groups are looked at.
pub(crate) const ROUND: Duration = Duration::from_secs(1);

/// A former voter stays a learner this long before the leader forgets it: the time it needs
/// to hear that the change committed (a few heartbeats), with room for a slow node.
pub(crate) const LEARNER_GRACE: Duration = Duration::from_secs(5);

/// A group's change (replacing copies, then changing voters) gives up after this and is tried
/// again: the catch-up wait of each new node, with a minute for the joint consensus and the
/// probes. A change whose entries cannot commit (most voters down) would otherwise hold the
/// group's turn for good.
pub(crate) const CHANGE_WAIT_MAX: Duration = Duration::from_secs(CATCH_UP_WAIT.as_secs() + 60);

/// What the reconciler works with.
pub(crate) struct Reconciler {
    pub(crate) logs: Arc<ReplicatedLogs>,
    pub(crate) meta: Arc<MetaGroup>,
    pub(crate) applied: Arc<AppliedState>,
    /// The nodes the cluster was formed with, with their cluster addresses (the catalog
    /// adds and removes nodes).
    pub(crate) formed: BTreeMap<u64, String>,
    /// Groups with a change under way.
    busy: Arc<Mutex<BTreeSet<u64>>>,
    /// When each stale learner was first seen, by group.
    stale_since: BTreeMap<(u64, u64), Instant>,
    /// Handing groups back to their preferred leaders (`balance.rs`); `None`: never.
    balancer: Option<Arc<Balancer>>,
}

impl Reconciler {
    pub(crate) fn new(
        logs: Arc<ReplicatedLogs>,
        meta: Arc<MetaGroup>,
        applied: Arc<AppliedState>,
        formed: BTreeMap<u64, String>,
    ) -> Reconciler {
        Reconciler {
            logs,
            meta,
            applied,
            formed,
            busy: Arc::default(),
            stale_since: BTreeMap::new(),
            balancer: None,
        }
    }

    /// Hand groups back to their preferred leaders through `balancer` (while its setting is
    /// on).
    pub(crate) fn balancing(mut self, balancer: Arc<Balancer>) -> Reconciler {
        self.balancer = Some(balancer);
        self
    }

    /// Reconcile every [`ROUND`] until `stop`.
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(ROUND) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            self.round().await;
        }
    }

    async fn round(&mut self) {
        let catalog = self.applied.catalog();
        let mut seen = BTreeSet::new();
        let mut settled_led = Vec::new();
        for entry in crate::groups::catalog_groups(&catalog) {
            // A leader that is moving off still leads the change.
            if !self.logs.leads(entry.group) {
                continue;
            }
            seen.insert(entry.group.0);
            let settled = self
                .partition(entry.group, entry.replicas.iter().copied().collect())
                .await;
            if let (true, Some(&preferred)) = (settled, entry.replicas.first()) {
                settled_led.push((entry.group, preferred));
            }
        }
        self.balance(&settled_led).await;
        if self.meta.leads().await {
            seen.insert(crate::meta::META_GROUP.0);
            self.metadata(catalog.nodes(&self.formed)).await;
        }
        self.stale_since
            .retain(|(group, _), _| seen.contains(group));
    }

    /// Hand the groups led here that are due back to their preferred leaders (`balance.rs`).
    async fn balance(&mut self, led: &[(GroupId, u64)]) {
        let Some(balancer) = self.balancer.clone() else {
            return;
        };
        let busy = self.busy.clone();
        balancer
            .round(led, |group| {
                busy.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(&group.0)
            })
            .await;
    }

    /// Whether `group` may be changed now: no change of ours under way.
    fn claim(&self, group: u64) -> Option<BusyGuard> {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        busy.insert(group).then(|| BusyGuard {
            busy: self.busy.clone(),
            group,
        })
    }

    /// The learners of `group` that had their grace, of `learners` (not in the target).
    fn expired(&mut self, group: u64, learners: &BTreeSet<u64>) -> BTreeSet<u64> {
        let now = Instant::now();
        learners
            .iter()
            .copied()
            .filter(|id| {
                let since = *self.stale_since.entry((group, *id)).or_insert(now);
                now.duration_since(since) >= LEARNER_GRACE
            })
            .collect()
    }

    /// Returns whether the group's voters are settled at `target` (no change under way).
    async fn partition(&mut self, group: GroupId, target: BTreeSet<u64>) -> bool {
        let Ok((effective, committed)) = self.logs.members(group).await else {
            return false;
        };
        let silent = self.logs.silent_members(group);
        let change = match turn(&effective, &committed, &target, !silent.is_empty()) {
            Turn::Wait => return false,
            Turn::Settled => false,
            Turn::Work { change } => change,
        };
        if change || !silent.is_empty() {
            let Some(guard) = self.claim(group.0) else {
                return false;
            };
            let logs = self.logs.clone();
            let voters = target.clone();
            tokio::spawn(async move {
                let _guard = guard;
                let work = async {
                    if !silent.is_empty() && !replace_partition_copies(&logs, group).await {
                        return;
                    }
                    if change {
                        change_partition_voters(&logs, group, &voters).await;
                    }
                };
                if tokio::time::timeout(CHANGE_WAIT_MAX, work).await.is_err() {
                    tracing::warn!(
                        group = group.0,
                        "a partition group's change took over {CHANGE_WAIT_MAX:?}; trying again"
                    );
                }
            });
            if change {
                return false;
            }
        }
        let stale: BTreeSet<u64> = committed.learners.difference(&target).copied().collect();
        let expired = self.expired(group.0, &stale);
        if expired.is_empty() {
            return true;
        }
        let Some(_guard) = self.claim(group.0) else {
            return true;
        };
        match self.logs.remove_learners(group, &expired).await {
            Ok(_) => {
                tracing::info!(group = group.0, learners = ?expired, "former replicas forgotten")
            }
            Err(error) => tracing::warn!(group = group.0, %error, "forgetting former replicas"),
        }
        true
    }

    async fn metadata(&mut self, nodes: BTreeMap<u64, String>) {
        let group = crate::meta::META_GROUP.0;
        let Ok((effective, committed)) = self.meta.members().await else {
            return;
        };
        let voters = meta_voters(&nodes, &committed.voters);
        let target: BTreeSet<u64> = voters.keys().copied().collect();
        let silent = self.meta.silent_members();
        let change = match turn(&effective, &committed, &target, !silent.is_empty()) {
            Turn::Wait => return,
            Turn::Settled => false,
            Turn::Work { change } => change,
        };
        if change || !silent.is_empty() {
            let Some(guard) = self.claim(group) else {
                return;
            };
            let meta = self.meta.clone();
            tokio::spawn(async move {
                let _guard = guard;
                let work = async {
                    if !silent.is_empty() {
                        match meta.replace_copies().await {
                            Ok(replaced) if !replaced.removed.is_empty() => {
                                tracing::info!(nodes = ?replaced.removed, "metadata group members with a replaced copy removed; they are added back");
                                return;
                            }
                            Ok(_) => {}
                            Err(error) => {
                                tracing::warn!(%error, "looking for replaced copies of the metadata group; retrying");
                                return;
                            }
                        }
                    }
                    if !change {
                        return;
                    }
                    match meta.change_voters(&voters, CATCH_UP_WAIT).await {
                        Ok(members) => {
                            tracing::info!(voters = ?members.voters, learners = ?members.learners, "metadata group voters changed")
                        }
                        Err(error) => {
                            tracing::warn!(%error, "changing the metadata group's voters; retrying")
                        }
                    }
                };
                if tokio::time::timeout(CHANGE_WAIT_MAX, work).await.is_err() {
                    tracing::warn!(
                        "a metadata group change took over {CHANGE_WAIT_MAX:?}; trying again"
                    );
                }
            });
            if change {
                return;
            }
        }
        // The nodes beyond the voters follow as learners.
        let missing: BTreeMap<u64, String> = nodes
            .iter()
            .filter(|(id, _)| !committed.voters.contains(id) && !committed.learners.contains(id))
            .map(|(id, addr)| (*id, addr.clone()))
            .collect();
        if !missing.is_empty() {
            let Some(_guard) = self.claim(group) else {
                return;
            };
            match self.meta.add_learners(&missing).await {
                Ok(members) => {
                    tracing::info!(learners = ?members.learners, "nodes follow the metadata group as learners")
                }
                Err(error) => tracing::warn!(%error, "adding learners to the metadata group"),
            }
            return;
        }
        let stale: BTreeSet<u64> = committed
            .learners
            .iter()
            .filter(|id| !nodes.contains_key(id))
            .copied()
            .collect();
        let expired = self.expired(group, &stale);
        if expired.is_empty() {
            return;
        }
        let Some(_guard) = self.claim(group) else {
            return;
        };
        match self.meta.remove_learners(&expired).await {
            Ok(_) => tracing::info!(learners = ?expired, "removed nodes left the metadata group"),
            Err(error) => tracing::warn!(%error, "removing nodes from the metadata group"),
        }
    }
}

/// What the reconciler does with a group it leads, this round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// A membership change is in flight (the latest membership is not committed): leave it.
    Wait,
    /// The voters are the target, every member answers: nothing to do.
    Settled,
    /// A task for the group: look for replaced copies (among silent members), and change the
    /// voters (`change`) when they are not the target or the membership is joint.
    Work {
        /// The voters must change.
        change: bool,
    },
}

/// The turn of a group whose latest membership is `effective`, whose committed one is
/// `committed`, whose voters should be `target`, with members that have not acknowledged its
/// leader lately (`silent`). A committed joint membership is no change in flight: its leader
/// was lost between the joint and the final entry, and nobody else will finish it.
fn turn(
    effective: &GroupMembers,
    committed: &GroupMembers,
    target: &BTreeSet<u64>,
    silent: bool,
) -> Turn {
    if effective != committed {
        return Turn::Wait;
    }
    let change = committed.joint || committed.voters != *target;
    if change || silent {
        Turn::Work { change }
    } else {
        Turn::Settled
    }
}

/// Remove the members of `group` (led here) that hold another copy than the recorded one;
/// whether the change of voters may follow in the same turn (nothing was removed and nothing
/// failed: a removed member is added back by the next round's change).
async fn replace_partition_copies(logs: &ReplicatedLogs, group: GroupId) -> bool {
    match logs.replace_copies(group).await {
        Ok(replaced) if !replaced.removed.is_empty() => {
            tracing::info!(group = group.0, nodes = ?replaced.removed, "partition group members with a replaced copy removed; they are added back");
            false
        }
        Ok(_) => true,
        Err(error) => {
            tracing::warn!(group = group.0, %error, "looking for replaced copies of a partition group; retrying");
            false
        }
    }
}

/// Make `target` the voters of `group` (led here), finishing a joint membership first.
async fn change_partition_voters(logs: &ReplicatedLogs, group: GroupId, target: &BTreeSet<u64>) {
    match logs.change_voters(group, target, CATCH_UP_WAIT).await {
        Ok(members) => {
            tracing::info!(group = group.0, voters = ?members.voters, "partition group voters changed")
        }
        Err(error) => {
            tracing::warn!(group = group.0, %error, "changing a partition group's voters; retrying")
        }
    }
}

/// Marks a group busy while held.
struct BusyGuard {
    busy: Arc<Mutex<BTreeSet<u64>>>,
    group: u64,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(voters: &[u64], joint: bool, offset: u64) -> GroupMembers {
        GroupMembers {
            voters: voters.iter().copied().collect(),
            learners: BTreeSet::new(),
            joint,
            offset: Some(offset),
        }
    }

    #[test]
    fn a_committed_joint_membership_is_finished_toward_the_target() {
        // The leader that wrote the joint entry (voters 1, 2, 3 and 1, 2, 4) was lost before
        // the uniform one: the joint one is committed, nothing is in flight.
        let joint = members(&[1, 2, 3, 4], true, 40);
        assert_eq!(
            turn(&joint, &joint, &[1, 2, 4].into(), false),
            Turn::Work { change: true }
        );
    }

    #[test]
    fn a_change_in_flight_is_left_alone_and_a_settled_group_is_settled() {
        let old = members(&[1, 2, 3], false, 10);
        let joint = members(&[1, 2, 3, 4], true, 12);
        assert_eq!(turn(&joint, &old, &[1, 2, 4].into(), true), Turn::Wait);
        assert_eq!(turn(&old, &old, &[1, 2, 3].into(), false), Turn::Settled);
        assert_eq!(
            turn(&old, &old, &[1, 2, 3].into(), true),
            Turn::Work { change: false }
        );
        assert_eq!(
            turn(&old, &old, &[1, 2, 4].into(), false),
            Turn::Work { change: true }
        );
    }
}
