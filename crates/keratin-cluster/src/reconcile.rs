//! The reconciler: on every node, every [`ROUND`], each Raft group this node leads is brought
//! to the members the metadata says it has.
//! - A partition group whose committed voters differ from its replicas in the catalog changes
//!   them (`ReplicatedLogs::change_voters`: new nodes join as learners and catch up first,
//!   then joint consensus). One change per group at a time, on a task of its own.
//! - Learners that are no longer replicas (voters that left) are forgotten once they had
//!   [`LEARNER_GRACE`] to learn that the change committed (they retire on seeing it).
//! - The metadata group's voters are up to [`crate::META_VOTERS_MAX`] of the cluster's nodes
//!   (those it was formed with and the added ones, but the removed ones; `meta::meta_voters`
//!   says which), with the same steps; the other nodes are made learners.
//!
//! - A partition group led here whose voters are settled hands its leadership back to its
//!   preferred leader, the first of its replicas in the catalog (`balance.rs`), a bounded
//!   number of groups per round, while `cluster.leader_balance` is on.
//!
//! It only acts on a group whose membership is settled (not joint, the latest committed), so
//! it never races a change in flight, including one of a leader before this one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_net::GroupId;
use keratin_raft::partition_log::{partition_group, ReplicatedLogs};
use keratin_raft::replica::CATCH_UP_WAIT;
use tokio::sync::watch;

use crate::applier::AppliedState;
use crate::balance::Balancer;
use crate::meta::{meta_voters, MetaGroup};

/// How often the groups are looked at.
pub(crate) const ROUND: Duration = Duration::from_secs(1);

/// A former voter stays a learner this long before the leader forgets it: the time it needs
/// to hear that the change committed (a few heartbeats), with room for a slow node.
pub(crate) const LEARNER_GRACE: Duration = Duration::from_secs(5);

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
        for entry in catalog.queues().values() {
            for (index, replicas) in entry.replicas.iter().enumerate() {
                // A leader that is moving off still leads the change.
                let Ok(group) = partition_group(entry.id, index as u32) else {
                    continue;
                };
                if !self.logs.leads(group) {
                    continue;
                }
                seen.insert(group.0);
                let settled = self
                    .partition(group, replicas.iter().copied().collect())
                    .await;
                if let (true, Some(&preferred)) = (settled, replicas.first()) {
                    settled_led.push((group, preferred));
                }
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
        if effective.joint || effective != committed {
            return false;
        }
        if committed.voters != target {
            let Some(guard) = self.claim(group.0) else {
                return false;
            };
            let logs = self.logs.clone();
            tokio::spawn(async move {
                let _guard = guard;
                match logs.change_voters(group, &target, CATCH_UP_WAIT).await {
                    Ok(members) => {
                        tracing::info!(group = group.0, voters = ?members.voters, "partition group voters changed")
                    }
                    Err(error) => {
                        tracing::warn!(group = group.0, %error, "changing a partition group's voters; retrying")
                    }
                }
            });
            return false;
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
        if effective.joint || effective != committed {
            return;
        }
        let voters = meta_voters(&nodes, &committed.voters);
        let target: BTreeSet<u64> = voters.keys().copied().collect();
        if committed.voters != target {
            let Some(guard) = self.claim(group) else {
                return;
            };
            let meta = self.meta.clone();
            tokio::spawn(async move {
                let _guard = guard;
                match meta.change_voters(&voters, CATCH_UP_WAIT).await {
                    Ok(members) => {
                        tracing::info!(voters = ?members.voters, learners = ?members.learners, "metadata group voters changed")
                    }
                    Err(error) => {
                        tracing::warn!(%error, "changing the metadata group's voters; retrying")
                    }
                }
            });
            return;
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
