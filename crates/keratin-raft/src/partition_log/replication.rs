//! The replication figures of a [`ReplicatedLog`] (`PartitionLog::replication`), from
//! openraft's metrics, in the broker's terms ([`ReplicationStatus`]): the group's voters, the
//! leader, the committed offset, and on the leader each voter's progress — its matched log
//! index (openraft's leader-side `replication` metrics), its lag behind the leader's last log
//! index, and when it last acknowledged the leader (openraft's `heartbeat` metrics: the send
//! time of the last request the voter answered, heartbeats and appends alike). A voter is in
//! sync within `IN_SYNC_LAG_ENTRIES_MAX` entries and `IN_SYNC_ACK_AGE_MAX` of its last
//! acknowledgement; the leader always is.
//!
//! openraft gives no time for "no leader known": [`LeaderlessClock`], fed by a task that
//! watches the metrics, keeps when this replica last stopped knowing one.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_broker::partition::replication::{ReplicaProgress, ReplicationStatus};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::Instant as _;
use tokio::sync::watch;

use super::forward::stopped;
use super::*;

/// Since when this replica has known no leader (`None` while it knows one). Starts "since
/// now": a replica that just opened knows no leader until it hears from one.
#[derive(Debug)]
pub(super) struct LeaderlessClock(Mutex<Option<Instant>>);

impl LeaderlessClock {
    pub(super) fn new() -> Arc<LeaderlessClock> {
        Arc::new(LeaderlessClock(Mutex::new(Some(Instant::now()))))
    }

    /// A leader is known (`true`) or not: start the clock if it was not running, stop it.
    fn observe(&self, leader_known: bool) {
        let mut since = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if leader_known {
            *since = None;
        } else if since.is_none() {
            *since = Some(Instant::now());
        }
    }

    fn leaderless_ms(&self) -> Option<u64> {
        let since = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        since.map(|since| u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX))
    }
}

/// Feeds `clock` from the replica's metrics until stopped or the group is gone.
pub(super) async fn watch_leader(
    raft: ReplicaRaft,
    clock: Arc<LeaderlessClock>,
    mut stop: watch::Receiver<bool>,
) {
    let mut metrics = raft.metrics();
    loop {
        let known = metrics.borrow_watched().current_leader.is_some();
        clock.observe(known);
        tokio::select! {
            biased;
            () = stopped(&mut stop) => return,
            changed = metrics.changed() => if changed.is_err() { return },
        }
    }
}

/// The figures of `replica` as node `id` sees them (see the module docs).
pub(super) fn status_of(id: u64, replica: &Replica, clock: &LeaderlessClock) -> ReplicationStatus {
    let committed_offset = *replica.committed().borrow();
    let watched = replica.raft().metrics();
    // Read under the watch's borrow (no copy of the metrics): nothing here waits.
    let metrics = watched.borrow_watched();
    let replicas: Vec<u64> = metrics.membership_config.voter_ids().collect();
    let leading = metrics.state.is_leader() && metrics.current_leader == Some(id);
    let progress = match (leading, &metrics.replication, &metrics.heartbeat) {
        (true, Some(replication), heartbeat) => {
            let matched: BTreeMap<u64, Option<u64>> = replication
                .iter()
                .map(|(node, log_id)| (*node, log_id.as_ref().map(|l| l.index)))
                .collect();
            let acked: BTreeMap<u64, Option<Duration>> = heartbeat
                .iter()
                .flatten()
                .map(|(node, at)| (*node, at.as_ref().map(|at| at.elapsed())))
                .collect();
            leader_progress(id, &replicas, metrics.last_log_index, &matched, &acked)
        }
        _ => Vec::new(),
    };
    // A leader cut off from a majority (`quorum_lost`) serves nothing: as far as the broker
    // and its attention items go, no leader is known here since it last heard a majority.
    // (When it was elected is the forwarder's to know: a leader never acknowledged counts as
    // leading here.)
    let cut_off_for = match quorum_ack_age(&metrics, None) {
        Some(QuorumAck::Age(age)) if age > QUORUM_LOST_AFTER => Some(age),
        _ => None,
    };
    ReplicationStatus {
        leader: metrics.current_leader.filter(|_| cut_off_for.is_none()),
        leaderless_ms: match (cut_off_for, metrics.current_leader) {
            (Some(age), _) => Some(u64::try_from(age.as_millis()).unwrap_or(u64::MAX)),
            (None, Some(_)) => None,
            (None, None) => clock.leaderless_ms().or(Some(0)),
        },
        replicas,
        leading: leading && cut_off_for.is_none(),
        committed_offset,
        progress,
    }
}

/// Each voter's progress on leader `me`, whose last log index is `last_log_index`, from the
/// matched index and the age of the last acknowledgement of each node.
pub(super) fn leader_progress(
    me: u64,
    voters: &[u64],
    last_log_index: Option<u64>,
    matched: &BTreeMap<u64, Option<u64>>,
    acked: &BTreeMap<u64, Option<Duration>>,
) -> Vec<ReplicaProgress> {
    let end = last_log_index.map_or(0, |index| index.saturating_add(1));
    voters
        .iter()
        .map(|&node| {
            if node == me {
                return ReplicaProgress {
                    node,
                    matched: end,
                    lag_entries: 0,
                    acked_ms_ago: Some(0),
                    in_sync: true,
                };
            }
            let matched_end = matched
                .get(&node)
                .copied()
                .flatten()
                .map_or(0, |index| index.saturating_add(1));
            let lag_entries = end.saturating_sub(matched_end);
            let acked_ago = acked.get(&node).copied().flatten();
            ReplicaProgress {
                node,
                matched: matched_end,
                lag_entries,
                acked_ms_ago: acked_ago
                    .map(|ago| u64::try_from(ago.as_millis()).unwrap_or(u64::MAX)),
                in_sync: ReplicaProgress::is_in_sync(lag_entries, acked_ago),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_broker::partition::replication::{IN_SYNC_ACK_AGE_MAX, IN_SYNC_LAG_ENTRIES_MAX};

    #[test]
    fn lag_counts_entries_past_the_matched_index_and_the_leader_is_in_sync() {
        const LAST: u64 = 4_999;
        let recent = Some(Duration::from_millis(50));
        let matched = BTreeMap::from([
            (1, Some(LAST)),
            (2, Some(LAST)),
            (3, Some(LAST - IN_SYNC_LAG_ENTRIES_MAX)),
        ]);
        let acked = BTreeMap::from([(2, recent), (3, recent)]);
        let progress = leader_progress(1, &[1, 2, 3], Some(LAST), &matched, &acked);
        let summary: Vec<(u64, u64, u64, bool)> = progress
            .iter()
            .map(|p| (p.node, p.matched, p.lag_entries, p.in_sync))
            .collect();
        assert_eq!(
            summary,
            vec![
                (1, LAST + 1, 0, true),
                (2, LAST + 1, 0, true),
                (
                    3,
                    LAST + 1 - IN_SYNC_LAG_ENTRIES_MAX,
                    IN_SYNC_LAG_ENTRIES_MAX,
                    true
                ),
            ]
        );
        // One entry more behind, or silent for too long, or never heard from: out of sync.
        let matched = BTreeMap::from([
            (2, Some(LAST - 1 - IN_SYNC_LAG_ENTRIES_MAX)),
            (3, Some(LAST)),
        ]);
        let stale = Some(IN_SYNC_ACK_AGE_MAX + Duration::from_millis(1));
        let acked = BTreeMap::from([(2, recent), (3, stale)]);
        let progress = leader_progress(1, &[1, 2, 3, 4], Some(LAST), &matched, &acked);
        let in_sync: Vec<bool> = progress.iter().map(|p| p.in_sync).collect();
        assert_eq!(in_sync, vec![true, false, false, false]);
        assert_eq!(progress[3].lag_entries, LAST + 1, "node 4 matched nothing");
        assert_eq!(progress[3].acked_ms_ago, None);
    }

    #[test]
    fn the_leaderless_clock_runs_only_without_a_leader() {
        let clock = LeaderlessClock::new();
        assert!(clock.leaderless_ms().is_some());
        clock.observe(true);
        assert_eq!(clock.leaderless_ms(), None);
        clock.observe(false);
        std::thread::sleep(Duration::from_millis(20));
        clock.observe(false);
        assert!(clock.leaderless_ms().is_some_and(|ms| ms >= 20));
    }
}
