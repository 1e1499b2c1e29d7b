//! Leader balancing: each partition's *preferred leader* is the first node of its replica list
//! in the catalog, and placement rotates the first node over the cluster, so leaders spread
//! (a stream's groups rotate its one replica set: `groups.rs`; they are balanced as queue
//! partitions are).
//! A new group is handed to its preferred leader right after its first election, by the
//! replica that won it (`keratin-raft`, `replica/copies.rs`, whatever the setting below); later
//! elections do not keep the preferred order: after a failover the new leader stays where the
//! election put it, and a node
//! back from a restart leads nothing. As Kafka's preferred leader election does
//! (`auto.leader.rebalance.enable`), the leader of a group hands it back to the preferred
//! leader once that one is caught up (`ReplicatedLogs::transfer_leader`: a voter at most a few
//! hundred entries behind that acknowledged lately; else nothing happens and the next round
//! looks again).
//!
//! - Automatic ([`Balancer::round`], from the reconciler every round) while the runtime
//!   setting `cluster.leader_balance` is on.
//! - On request ([`Balancer::rebalance_here`], `keratin cluster rebalance` through every
//!   node): every group led here that is not led by its preferred leader is handed over now
//!   if its preferred leader is caught up, whatever the setting and the timers below (at
//!   most [`REBALANCE_TRANSFERS_MAX`] per node per request); the answer says which moved and
//!   why the others did not.
//!
//! Bounded churn (automatic): a node hands over at most [`TRANSFERS_PER_ROUND_MAX`] groups per
//! reconciler round, only groups it has led for [`LEADER_SETTLE`] (not in the middle of a
//! failover or a membership change), and tries a group again only after [`TRANSFER_RETRY`]
//! while it keeps leading it.
//! A transfer costs its publishers the time to elect the named node (openraft stops proposing
//! on the old leader; the client follows the 421 to the new one).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_net::GroupId;
use keratin_raft::partition_log::ReplicatedLogs;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::applier::AppliedState;

/// A node hands a group over only once it has led it this long.
pub(crate) const LEADER_SETTLE: Duration = Duration::from_secs(5);

/// After handing a group over (or trying to), the same group waits this long.
pub(crate) const TRANSFER_RETRY: Duration = Duration::from_secs(30);

/// Automatic hand-overs per node per reconciler round (1 s). Each costs one partition one
/// election (tens of milliseconds on a LAN); 8 a second per node hands a returning node's
/// share of 1,000 partitions over three nodes (about 333) back in about 21 s from the two
/// others.
pub(crate) const TRANSFERS_PER_ROUND_MAX: usize = 8;

/// On request, how long to wait for the groups asked to have their new leader: an election of
/// the named node takes a round trip or two; 5 s leaves room for a loaded node.
pub(crate) const REBALANCE_WAIT: Duration = Duration::from_secs(5);

/// On request, hand-overs per node: each is one election at once, and 256 at once is still
/// a small burst of vote requests (3 per group on three replicas); more partitions wait for
/// the next request (the answer says so).
pub(crate) const REBALANCE_TRANSFERS_MAX: usize = 256;

/// How often the groups asked are looked at while waiting ([`REBALANCE_WAIT`]).
const REBALANCE_POLL: Duration = Duration::from_millis(50);

/// One leadership handed over on request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderMove {
    /// The queue or stream.
    pub queue: String,
    /// The partition's index (`u32::MAX`, 4294967295, for a stream's cursor log).
    pub partition: u32,
    /// The node that led it.
    pub from: u64,
    /// Its preferred leader, which leads it now.
    pub to: u64,
}

/// A partition that is not led by its preferred leader and was not handed over, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderKept {
    /// The queue or stream.
    pub queue: String,
    /// The partition's index (`u32::MAX`, 4294967295, for a stream's cursor log).
    pub partition: u32,
    /// The node that leads it.
    pub leader: u64,
    /// Its preferred leader.
    pub preferred: u64,
    /// Why it stays.
    pub reason: String,
}

/// What a rebalance did on one node or, merged, on the cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceReport {
    /// The partitions handed to their preferred leader.
    pub moved: Vec<LeaderMove>,
    /// The partitions left where they are, with why.
    pub kept: Vec<LeaderKept>,
    /// The nodes that could not be asked (down or unreachable), with the error; the
    /// partitions they lead (if any) were not looked at.
    pub unreachable: BTreeMap<u64, String>,
}

impl RebalanceReport {
    /// Add `other`'s lines to this one's, sorted by queue and partition.
    pub(crate) fn merge(&mut self, other: RebalanceReport) {
        self.moved.extend(other.moved);
        self.kept.extend(other.kept);
        self.unreachable.extend(other.unreachable);
        self.moved
            .sort_by(|a, b| (&a.queue, a.partition).cmp(&(&b.queue, b.partition)));
        self.kept
            .sort_by(|a, b| (&a.queue, a.partition).cmp(&(&b.queue, b.partition)));
    }
}

/// What this node remembers to decide automatic hand-overs (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LeaderBalance {
    /// Since when this node leads each group, as the rounds saw it.
    led_since: BTreeMap<u64, Instant>,
    /// When a transfer of each group was last asked for.
    tried: BTreeMap<u64, Instant>,
}

impl LeaderBalance {
    /// This round's groups led here whose voters are settled at the catalog's replicas, each
    /// with its preferred leader: the groups to hand over now, at most `max`, and to whom.
    pub(crate) fn pick(
        &mut self,
        me: u64,
        now: Instant,
        led: &[(GroupId, u64)],
        max: usize,
    ) -> Vec<(GroupId, u64)> {
        let leads = |group: &u64| led.iter().any(|(g, _)| g.0 == *group);
        self.led_since.retain(|group, _| leads(group));
        // A group no longer led here forgets its hand-over: led here again later (a failover
        // back), it is a new leadership that settles anew, not a retry. (Kept, a group handed
        // over and failed back within the retry period stayed here for the rest of it.)
        self.tried.retain(|group, at| {
            leads(group) && now.saturating_duration_since(*at) < TRANSFER_RETRY
        });
        let mut picked = Vec::new();
        for (group, preferred) in led {
            let since = *self.led_since.entry(group.0).or_insert(now);
            if picked.len() < max
                && *preferred != me
                && now.saturating_duration_since(since) >= LEADER_SETTLE
                && !self.tried.contains_key(&group.0)
            {
                picked.push((*group, *preferred));
            }
        }
        picked
    }

    /// A transfer of `group` was asked for (or failed): leave it alone for a while.
    pub(crate) fn tried(&mut self, group: GroupId, now: Instant) {
        self.tried.insert(group.0, now);
    }
}

/// A partition group led here with its place in the catalog.
struct Led {
    group: GroupId,
    queue: String,
    partition: u32,
    replicas: Vec<u64>,
}

/// Hands partitions led here back to their preferred leaders, automatically and on request
/// (see the module docs). Shared by the reconciler and the cluster service.
pub(crate) struct Balancer {
    node_id: u64,
    logs: Arc<ReplicatedLogs>,
    applied: Arc<AppliedState>,
    /// `cluster.leader_balance` as in force on this node: automatic hand-overs while true.
    on: watch::Receiver<bool>,
    /// The automatic hand-overs' memory.
    state: Mutex<LeaderBalance>,
    /// One rebalance on request at a time on this node (a second waits for the first).
    requests: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Balancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balancer")
            .field("node_id", &self.node_id)
            .field("on", &*self.on.borrow())
            .finish_non_exhaustive()
    }
}

impl Balancer {
    pub(crate) fn new(
        node_id: u64,
        logs: Arc<ReplicatedLogs>,
        applied: Arc<AppliedState>,
        on: watch::Receiver<bool>,
    ) -> Balancer {
        Balancer {
            node_id,
            logs,
            applied,
            on,
            state: Mutex::new(LeaderBalance::default()),
            requests: tokio::sync::Mutex::new(()),
        }
    }

    /// One reconciler round: `led` are this round's groups led here whose voters are settled,
    /// with their preferred leaders; `busy` says whether a group has a change under way. Hands
    /// over the groups due (at most [`TRANSFERS_PER_ROUND_MAX`]) while automatic balancing is
    /// on.
    pub(crate) async fn round(&self, led: &[(GroupId, u64)], busy: impl Fn(GroupId) -> bool) {
        if !*self.on.borrow() {
            // Off: start over when it is turned on again (groups led meanwhile settle anew).
            *self.state.lock().unwrap_or_else(|e| e.into_inner()) = LeaderBalance::default();
            return;
        }
        let now = Instant::now();
        let picked = self.state.lock().unwrap_or_else(|e| e.into_inner()).pick(
            self.node_id,
            now,
            led,
            TRANSFERS_PER_ROUND_MAX,
        );
        for (group, preferred) in picked {
            if busy(group) {
                continue;
            }
            let outcome = self.logs.transfer_leader(group, preferred).await;
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match outcome {
                Ok(true) => state.tried(group, now),
                // Not caught up yet: the next round looks again.
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(group = group.0, to = preferred, %error, "handing a partition to its preferred leader");
                    state.tried(group, now);
                }
            }
        }
    }

    /// Hand every group led here whose preferred leader is another node over to it now, if
    /// that node is caught up (see the module docs), and wait up to [`REBALANCE_WAIT`] for
    /// the new leaders: what moved and what stays, with why.
    pub(crate) async fn rebalance_here(&self) -> RebalanceReport {
        let _one = self.requests.lock().await;
        let mut report = RebalanceReport::default();
        let mut asked = Vec::new();
        for led in self.led_elsewhere_preferred() {
            let preferred = led.replicas[0];
            let kept = |reason: String| LeaderKept {
                queue: led.queue.clone(),
                partition: led.partition,
                leader: self.node_id,
                preferred,
                reason,
            };
            if asked.len() >= REBALANCE_TRANSFERS_MAX {
                report.kept.push(kept(format!(
                    "node {} hands over at most {REBALANCE_TRANSFERS_MAX} partitions per \
                     request; ask again for the rest",
                    self.node_id
                )));
                continue;
            }
            if let Some(reason) = self.unsettled(&led).await {
                report.kept.push(kept(reason));
                continue;
            }
            match self.logs.transfer_leader(led.group, preferred).await {
                Ok(true) => {
                    self.state
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .tried(led.group, Instant::now());
                    asked.push(led);
                }
                Ok(false) => report.kept.push(kept(format!(
                    "node {preferred} is not caught up (more than {} entries behind, or not \
                     heard from within {} ms); ask again once it is",
                    keratin_raft::replica::TRANSFER_LAG_MAX,
                    keratin_raft::replica::TRANSFER_ACK_AGE_MAX.as_millis()
                ))),
                Err(error) => report.kept.push(kept(error.to_string())),
            }
        }
        let deadline = tokio::time::Instant::now() + REBALANCE_WAIT;
        while asked
            .iter()
            .any(|led| self.logs.leader_of(led.group) != Some(led.replicas[0]))
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(REBALANCE_POLL).await;
        }
        for led in asked {
            let preferred = led.replicas[0];
            match self.logs.leader_of(led.group) {
                Some(leader) if leader == preferred => report.moved.push(LeaderMove {
                    queue: led.queue,
                    partition: led.partition,
                    from: self.node_id,
                    to: preferred,
                }),
                leader => report.kept.push(LeaderKept {
                    queue: led.queue,
                    partition: led.partition,
                    leader: leader.unwrap_or(self.node_id),
                    preferred,
                    reason: format!(
                        "asked node {preferred} to take over, but {} after {} ms",
                        match leader {
                            Some(id) => format!("node {id} leads"),
                            None => "no leader is known".to_string(),
                        },
                        REBALANCE_WAIT.as_millis()
                    ),
                }),
            }
        }
        report
    }

    /// The groups (queue and stream partitions, stream cursor logs) this node leads whose
    /// preferred leader is another node.
    fn led_elsewhere_preferred(&self) -> Vec<Led> {
        let catalog = self.applied.catalog();
        crate::groups::catalog_groups(&catalog)
            .into_iter()
            .filter(|g| {
                g.replicas.first().is_some_and(|p| *p != self.node_id) && self.logs.leads(g.group)
            })
            .map(|g| Led {
                group: g.group,
                queue: g.name,
                partition: g.partition,
                replicas: g.replicas,
            })
            .collect()
    }

    /// Why `led`'s group may not change leader now (a membership change under way or its
    /// voters not yet the catalog's replicas), or `None`.
    async fn unsettled(&self, led: &Led) -> Option<String> {
        let target: BTreeSet<u64> = led.replicas.iter().copied().collect();
        match self.logs.members(led.group).await {
            Ok((effective, committed))
                if !effective.joint && effective == committed && committed.voters == target =>
            {
                None
            }
            Ok(_) => Some(
                "its replicas are changing (a move or a node added or removed); ask again once \
                 that is done"
                    .to_string(),
            ),
            Err(error) => Some(error.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settled_groups_go_back_to_their_preferred_leaders_a_bounded_number_per_round() {
        let mut balance = LeaderBalance::default();
        let start = Instant::now();
        let led = [(GroupId(256), 2), (GroupId(512), 1), (GroupId(768), 3)];
        // Node 1 just started leading: nothing yet.
        assert_eq!(balance.pick(1, start, &led, 8), vec![]);
        let later = start + LEADER_SETTLE;
        // Group 512 prefers node 1 itself; the others go, at most `max` per round.
        assert_eq!(balance.pick(1, later, &led, 1), vec![(GroupId(256), 2)]);
        balance.tried(GroupId(256), later);
        assert_eq!(balance.pick(1, later, &led, 8), vec![(GroupId(768), 3)]);
        balance.tried(GroupId(768), later);
        assert_eq!(balance.pick(1, later, &led, 8), vec![]);
        // Still leading both a retry period later (the transfers did not happen): again.
        let retry = later + TRANSFER_RETRY;
        assert_eq!(
            balance.pick(1, retry, &led, 8),
            vec![(GroupId(256), 2), (GroupId(768), 3)]
        );
        // A group led anew starts its settle time over.
        assert_eq!(balance.pick(1, retry, &[(GroupId(512), 1)], 8), vec![]);
        assert_eq!(balance.pick(1, retry, &led[..1], 8), vec![]);
    }

    #[test]
    fn a_group_handed_over_and_failed_back_is_handed_over_again_once_settled() {
        let mut balance = LeaderBalance::default();
        let start = Instant::now();
        let led = [(GroupId(256), 2)];
        balance.pick(1, start, &led, 8);
        let settled = start + LEADER_SETTLE;
        assert_eq!(balance.pick(1, settled, &led, 8), vec![(GroupId(256), 2)]);
        balance.tried(GroupId(256), settled);
        // Node 2 took it over (not led here next round), then failed: node 1 leads it again.
        let away = settled + Duration::from_secs(1);
        assert_eq!(balance.pick(1, away, &[], 8), vec![]);
        let back = away + Duration::from_secs(1);
        assert_eq!(balance.pick(1, back, &led, 8), vec![]);
        // Settled again, well within the retry period of the first hand-over: due.
        let due = back + LEADER_SETTLE;
        assert!(due < settled + TRANSFER_RETRY);
        assert_eq!(balance.pick(1, due, &led, 8), vec![(GroupId(256), 2)]);
    }

    #[test]
    fn reports_merge_sorted_by_queue_and_partition() {
        let line = |queue: &str, partition| LeaderMove {
            queue: queue.to_string(),
            partition,
            from: 1,
            to: 2,
        };
        let mut report = RebalanceReport {
            moved: vec![line("b", 0)],
            ..RebalanceReport::default()
        };
        report.merge(RebalanceReport {
            moved: vec![line("a", 2), line("a", 1)],
            unreachable: [(3, "down".to_string())].into_iter().collect(),
            ..RebalanceReport::default()
        });
        assert_eq!(report.moved, vec![line("a", 1), line("a", 2), line("b", 0)]);
        assert_eq!(report.unreachable.len(), 1);
    }
}
