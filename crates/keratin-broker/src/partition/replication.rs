//! [`ReplicationStatus`]: how a replicated partition's copies keep up, in the broker's terms
//! (no Raft type): the group's replicas, who leads, and — on the leader only — each replica's
//! progress and the in-sync set. A replicated log fills it
//! ([`PartitionLog::replication`](super::log::PartitionLog::replication)); a local log has
//! none. Queue info, metrics, the cluster status and the attention items read it.

use std::time::Duration;

/// A follower is in sync while it lags the leader's log by at most this many entries: about
/// one second of a busy partition's publishes in batches (a few thousand messages per second
/// in tens of batches, one entry each), so a follower that keeps up stays in, and one that
/// was down for more than moments is out until it has caught up.
pub const IN_SYNC_LAG_ENTRIES_MAX: u64 = 1_000;

/// ... and acknowledged the leader within this long: fifty heartbeat intervals (100 ms each),
/// five election timeouts; a follower paused longer than that (a stopped process, a cut
/// network) is out even if it lost nothing yet.
pub const IN_SYNC_ACK_AGE_MAX: Duration = Duration::from_secs(5);

/// One replica's progress, as the partition's leader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaProgress {
    /// The replica's node id.
    pub node: u64,
    /// One past the last offset of the replica's log known to match the leader's (0: none
    /// known yet).
    pub matched: u64,
    /// Entries of the leader's log the replica does not hold yet (0 for the leader).
    pub lag_entries: u64,
    /// How long ago it last acknowledged the leader (`None`: never, in this leadership; 0 for
    /// the leader itself).
    pub acked_ms_ago: Option<u64>,
    /// Lag at most [`IN_SYNC_LAG_ENTRIES_MAX`] and acknowledged within
    /// [`IN_SYNC_ACK_AGE_MAX`]; always for the leader.
    pub in_sync: bool,
}

impl ReplicaProgress {
    /// Whether a follower with this lag and last acknowledgement is in sync (see the bounds).
    pub fn is_in_sync(lag_entries: u64, acked_ago: Option<Duration>) -> bool {
        lag_entries <= IN_SYNC_LAG_ENTRIES_MAX
            && acked_ago.is_some_and(|ago| ago <= IN_SYNC_ACK_AGE_MAX)
    }
}

/// How a replicated partition's copies keep up, as this node knows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReplicationStatus {
    /// The group's voters (this node included), ascending.
    pub replicas: Vec<u64>,
    /// This node leads the partition.
    pub leading: bool,
    /// The leader this node knows of.
    pub leader: Option<u64>,
    /// One past the last offset committed and applied on this node.
    pub committed_offset: u64,
    /// On the leader: each replica's progress, by node id (the leader included). Empty
    /// elsewhere: only the leader knows.
    pub progress: Vec<ReplicaProgress>,
    /// When no leader is known: for how long (ms) this node has known none.
    pub leaderless_ms: Option<u64>,
}

impl ReplicationStatus {
    /// The in-sync replicas (leader only; empty elsewhere), ascending.
    pub fn in_sync(&self) -> Vec<u64> {
        self.progress
            .iter()
            .filter(|p| p.in_sync)
            .map(|p| p.node)
            .collect()
    }

    /// The replicas a majority needs (`replicas / 2 + 1`).
    pub fn majority(&self) -> usize {
        self.replicas.len() / 2 + 1
    }

    /// On the leader: fewer replicas in sync than a majority (a publish cannot be confirmed
    /// until enough of them catch up); `None` elsewhere.
    pub fn below_majority(&self) -> Option<bool> {
        self.leading
            .then(|| self.progress.iter().filter(|p| p.in_sync).count() < self.majority())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(node: u64, in_sync: bool) -> ReplicaProgress {
        ReplicaProgress {
            node,
            matched: 10,
            lag_entries: 0,
            acked_ms_ago: Some(0),
            in_sync,
        }
    }

    #[test]
    fn in_sync_needs_a_small_lag_and_a_recent_ack() {
        let recent = Some(Duration::from_millis(100));
        assert!(ReplicaProgress::is_in_sync(0, recent));
        assert!(ReplicaProgress::is_in_sync(IN_SYNC_LAG_ENTRIES_MAX, recent));
        assert!(!ReplicaProgress::is_in_sync(
            IN_SYNC_LAG_ENTRIES_MAX + 1,
            recent
        ));
        assert!(!ReplicaProgress::is_in_sync(0, None));
        assert!(!ReplicaProgress::is_in_sync(
            0,
            Some(IN_SYNC_ACK_AGE_MAX + Duration::from_millis(1))
        ));
    }

    #[test]
    fn below_majority_is_the_leaders_word() {
        let mut status = ReplicationStatus {
            replicas: vec![1, 2, 3],
            leading: true,
            leader: Some(1),
            committed_offset: 10,
            progress: vec![progress(1, true), progress(2, true), progress(3, false)],
            leaderless_ms: None,
        };
        assert_eq!(status.in_sync(), vec![1, 2]);
        assert_eq!(status.below_majority(), Some(false));
        status.progress[1].in_sync = false;
        assert_eq!(status.below_majority(), Some(true));
        status.leading = false;
        assert_eq!(status.below_majority(), None);
    }
}
