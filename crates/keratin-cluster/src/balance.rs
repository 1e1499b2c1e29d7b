//! Leader balancing: each partition's *preferred leader* is the first node of its replica list
//! in the catalog, and placement rotates the first node over the cluster, so leaders spread.
//! Elections do not keep that order: after a failover the new leader stays where the election
//! put it, and a node back from a restart leads nothing. As Kafka's preferred leader election
//! does (`auto.leader.rebalance.enable`), the leader of a group hands it back to the preferred
//! leader once that one is caught up (`ReplicatedLogs::transfer_leader`: a voter at most a few
//! hundred entries behind that acknowledged lately; else nothing happens and the next round
//! looks again).
//!
//! Bounded churn: a node hands over one group per reconciler round, only a group it has led
//! for [`LEADER_SETTLE`] (not in the middle of a failover or a membership change), and tries a
//! group again only after [`TRANSFER_RETRY`]. A transfer costs its publishers the time to elect
//! the named node (openraft stops proposing on the old leader; the client follows the 421 to
//! the new one).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use keratin_net::GroupId;

/// A node hands a group over only once it has led it this long.
pub(crate) const LEADER_SETTLE: Duration = Duration::from_secs(5);

/// After handing a group over (or trying to), the same group waits this long.
pub(crate) const TRANSFER_RETRY: Duration = Duration::from_secs(30);

/// What this node remembers to decide (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LeaderBalance {
    /// Since when this node leads each group, as the rounds saw it.
    led_since: BTreeMap<u64, Instant>,
    /// When a transfer of each group was last asked for.
    tried: BTreeMap<u64, Instant>,
}

impl LeaderBalance {
    /// This round's groups led here whose voters are settled at the catalog's replicas, each
    /// with its preferred leader: the group to hand over now, and to whom, if any.
    pub(crate) fn pick(
        &mut self,
        me: u64,
        now: Instant,
        led: &[(GroupId, u64)],
    ) -> Option<(GroupId, u64)> {
        self.led_since
            .retain(|group, _| led.iter().any(|(g, _)| g.0 == *group));
        self.tried
            .retain(|_, at| now.saturating_duration_since(*at) < TRANSFER_RETRY);
        let mut pick = None;
        for (group, preferred) in led {
            let since = *self.led_since.entry(group.0).or_insert(now);
            if pick.is_none()
                && *preferred != me
                && now.saturating_duration_since(since) >= LEADER_SETTLE
                && !self.tried.contains_key(&group.0)
            {
                pick = Some((*group, *preferred));
            }
        }
        pick
    }

    /// A transfer of `group` was asked for (or failed): leave it alone for a while.
    pub(crate) fn tried(&mut self, group: GroupId, now: Instant) {
        self.tried.insert(group.0, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_group_goes_back_to_its_preferred_leader_one_at_a_time() {
        let mut balance = LeaderBalance::default();
        let start = Instant::now();
        let led = [(GroupId(256), 2), (GroupId(512), 1), (GroupId(768), 3)];
        // Node 1 just started leading: nothing yet.
        assert_eq!(balance.pick(1, start, &led), None);
        let later = start + LEADER_SETTLE;
        // Group 512 prefers node 1 itself; the first other one goes, one per round.
        assert_eq!(balance.pick(1, later, &led), Some((GroupId(256), 2)));
        balance.tried(GroupId(256), later);
        assert_eq!(balance.pick(1, later, &led), Some((GroupId(768), 3)));
        balance.tried(GroupId(768), later);
        assert_eq!(balance.pick(1, later, &led), None);
        // Still leading both a retry period later (the transfers did not happen): again.
        let retry = later + TRANSFER_RETRY;
        assert_eq!(balance.pick(1, retry, &led), Some((GroupId(256), 2)));
        // A group led anew starts its settle time over.
        assert_eq!(balance.pick(1, retry, &[(GroupId(512), 1)]), None);
        assert_eq!(balance.pick(1, retry, &led[..1]), None);
    }
}
