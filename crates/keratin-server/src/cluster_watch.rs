//! [`ClusterWatch`]: the cluster's attention items on a cluster node. Once a second it looks
//! at this node's replicated partitions (`PartitionInfo::replicas`, `in_sync`,
//! `leaderless_ms`) and at the peers' transport connections (`ClusterNode::status`), and
//! raises or clears:
//! - `partition_below_majority` (subject `queue/partition`): this node leads the partition and
//!   fewer of its replicas than a majority are in sync, or this replica has known no leader
//!   for [`LEADERLESS_AFTER`] (a leader that has heard no majority for the election timeout
//!   counts as knowing none: `keratin-raft`, "A cut-off leader" in `docs/cluster.md`);
//! - `node_unreachable` (subject `node-ID`): a peer's connection has been down for
//!   [`UNREACHABLE_AFTER`] (a node removed from the cluster is not watched: it is expected to
//!   go away);
//! - `node_limited` (subject `node-ID:PATH` or `node-ID:memory`, with the level): a peer's
//!   label reports a file system or its memory at soft or worse; raised again when the level
//!   changes, cleared when it is back to normal (this node's own levels are the sampler's
//!   `disk_level` and `memory_level` items).
//!
//! An item is raised when its cause appears and cleared when it goes (or its partition or
//! node does), not raised again every round. The state it keeps is the set of causes seen,
//! bounded by the node's partitions and peers. The sampler (`limits.rs`) owns the other kinds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_broker::partition::replication::{IN_SYNC_ACK_AGE_MAX, IN_SYNC_LAG_ENTRIES_MAX};
use keratin_broker::{Broker, PartitionInfo, QueueInfo};
use keratin_cluster::{ClusterNode, NodeStatus};
use keratin_limits::Level;
use tokio::sync::watch;

use crate::attention::{Attention, AttentionKind, Raise, Severity};

/// How often the watch looks: a second is well within what an operator notices, and a round
/// costs one queue list and one cluster status.
pub const CLUSTER_WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// A replica that has known no leader for this long is reported: three of the longest
/// election timeouts (1 s, `keratin_raft::replica::ELECTION_TIMEOUT_MAX_MS`), so an ordinary
/// election (well under 2 s) raises nothing.
pub const LEADERLESS_AFTER: Duration = Duration::from_secs(3);

/// A peer whose connection has been down this long is reported: the transport reconnects
/// within a second of a peer coming back, so a restart or a short blip raises nothing.
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(3);

/// See the module docs.
#[derive(Debug, Default)]
pub struct ClusterWatch {
    /// Partitions with an active item.
    partitions: BTreeSet<String>,
    /// Peers seen down, and since when.
    down_since: BTreeMap<u64, Instant>,
    /// Peers with an active item.
    nodes: BTreeSet<u64>,
    /// Peers' resources at soft or worse with an active item, and the level it names.
    limited: BTreeMap<String, Level>,
}

impl ClusterWatch {
    /// A watch that has seen nothing yet.
    pub fn new() -> ClusterWatch {
        ClusterWatch::default()
    }

    /// One round: `queues` as this node's broker lists them, `nodes` as the cluster status
    /// shows them (this node, `own_id`, included), at `now`.
    pub fn check(
        &mut self,
        attention: &Attention,
        queues: &[QueueInfo],
        nodes: &[NodeStatus],
        own_id: u64,
        now: Instant,
    ) {
        self.check_partitions(attention, queues);
        self.check_nodes(attention, nodes, own_id, now);
        self.check_levels(attention, nodes, own_id);
    }

    fn check_levels(&mut self, attention: &Attention, nodes: &[NodeStatus], own_id: u64) {
        let mut now_limited = BTreeMap::new();
        for node in nodes.iter().filter(|n| n.id != own_id && !n.removed) {
            let Some(report) = &node.levels else {
                continue;
            };
            let resources = report
                .filesystems
                .iter()
                .map(|fs| {
                    let free = fs.free_bytes.saturating_add(fs.spare_bytes);
                    (
                        fs.path.clone(),
                        fs.input.level,
                        format!("{} MiB free of {} MiB", free >> 20, fs.total_bytes >> 20),
                    )
                })
                .chain(report.memory.iter().map(|m| {
                    (
                        "memory".to_string(),
                        m.input.level,
                        format!(
                            "{} MiB resident of a {} MiB limit",
                            m.resident_bytes >> 20,
                            m.limit_bytes >> 20
                        ),
                    )
                }));
            for (what, level, figures) in resources {
                if level < Level::Soft {
                    continue;
                }
                let subject = format!("node-{}:{what}", node.id);
                if self.limited.get(&subject) != Some(&level) {
                    let effect = match level {
                        Level::Soft => "publishes to the partitions with an in-sync copy there are slowed",
                        Level::Hard => "publishes to the partitions with an in-sync copy there are refused (429)",
                        _ => "it takes no new entries for the partitions it follows: they go on without it, out of its in-sync sets",
                    };
                    let message = format!(
                        "node {} reports {what} at {level} level ({figures}): {effect}; free \
                         space or memory there (consume or purge its largest queues; `keratin \
                         cluster status` shows every node)",
                        node.id
                    );
                    tracing::warn!("{message}");
                    attention.raise(Raise {
                        kind: AttentionKind::NodeLimited,
                        subject: subject.clone(),
                        severity: if level >= Level::Hard {
                            Severity::Critical
                        } else {
                            Severity::Warning
                        },
                        level: Some(level.as_str().to_string()),
                        message,
                    });
                }
                now_limited.insert(subject, level);
            }
        }
        for subject in self.limited.keys() {
            if !now_limited.contains_key(subject) {
                tracing::info!(%subject, "node resource back to normal");
                attention.clear(AttentionKind::NodeLimited, subject);
            }
        }
        self.limited = now_limited;
    }

    fn check_partitions(&mut self, attention: &Attention, queues: &[QueueInfo]) {
        let mut now_below = BTreeSet::new();
        for queue in queues {
            for partition in &queue.partitions {
                let Some(message) = partition_trouble(&queue.name, partition) else {
                    continue;
                };
                let subject = format!("{}/{}", queue.name, partition.index);
                if !self.partitions.contains(&subject) {
                    tracing::warn!("{message}");
                    attention.raise(Raise {
                        kind: AttentionKind::PartitionBelowMajority,
                        subject: subject.clone(),
                        severity: Severity::Critical,
                        level: None,
                        message,
                    });
                }
                now_below.insert(subject);
            }
        }
        for subject in self.partitions.difference(&now_below) {
            tracing::info!(partition = %subject, "partition back to a majority in sync");
            attention.clear(AttentionKind::PartitionBelowMajority, subject);
        }
        self.partitions = now_below;
    }

    fn check_nodes(
        &mut self,
        attention: &Attention,
        nodes: &[NodeStatus],
        own_id: u64,
        now: Instant,
    ) {
        let peers: BTreeMap<u64, &NodeStatus> = nodes
            .iter()
            // A removed node is expected to go away.
            .filter(|n| n.id != own_id && !n.removed)
            .map(|n| (n.id, n))
            .collect();
        self.down_since
            .retain(|id, _| peers.get(id).is_some_and(|n| !n.reachable));
        let mut now_down = BTreeSet::new();
        for (id, node) in &peers {
            if node.reachable {
                continue;
            }
            let since = *self.down_since.entry(*id).or_insert(now);
            let down_for = now.saturating_duration_since(since);
            if down_for < UNREACHABLE_AFTER {
                continue;
            }
            if !self.nodes.contains(id) {
                let message = format!(
                    "node {id} (cluster address {}) has been unreachable from this node for {} s: \
                     its cluster connection is down; the partitions it holds go on while a \
                     majority of their replicas remains, and fall out of sync meanwhile; check \
                     that its process runs and that this node reaches {} (firewall, network)",
                    node.cluster_addr,
                    down_for.as_secs(),
                    node.cluster_addr
                );
                tracing::warn!("{message}");
                attention.raise(Raise {
                    kind: AttentionKind::NodeUnreachable,
                    subject: node_subject(*id),
                    severity: Severity::Warning,
                    level: None,
                    message,
                });
            }
            now_down.insert(*id);
        }
        for id in self.nodes.difference(&now_down) {
            tracing::info!(node = id, "node reachable again");
            attention.clear(AttentionKind::NodeUnreachable, &node_subject(*id));
        }
        self.nodes = now_down;
    }
}

fn node_subject(id: u64) -> String {
    format!("node-{id}")
}

fn nodes_text(ids: &[u64]) -> String {
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    ids.join(", ")
}

/// What is wrong with a replicated partition on this node, if anything (see the module docs).
fn partition_trouble(queue: &str, p: &PartitionInfo) -> Option<String> {
    if p.replicas.is_empty() {
        return None;
    }
    let majority = p.replicas.len() / 2 + 1;
    if p.leading && p.in_sync.len() < majority {
        let behind: Vec<String> = p
            .replicas
            .iter()
            .filter(|id| !p.in_sync.contains(id))
            .map(|id| match p.replica_lag.get(id) {
                Some(lag) => format!("node {id} lags {lag} entries"),
                None => format!("node {id}"),
            })
            .collect();
        return Some(format!(
            "partition {} of queue {queue}: this node leads it and only {} of its {} replicas \
             are in sync (nodes {}; in sync = at most {IN_SYNC_LAG_ENTRIES_MAX} entries behind \
             and heard from within {} s; out of sync: {}): a publish is confirmed only once a \
             majority ({majority}) holds it, so publishes wait or fail and one more lost node \
             loses the partition; bring the out-of-sync replicas back (`keratin cluster \
             status` shows them; check their processes, disks and the network)",
            p.index,
            p.in_sync.len(),
            p.replicas.len(),
            nodes_text(&p.in_sync),
            IN_SYNC_ACK_AGE_MAX.as_secs(),
            behind.join(", ")
        ));
    }
    let leaderless_ms = p.leaderless_ms?;
    if p.leading || leaderless_ms < LEADERLESS_AFTER.as_millis() as u64 {
        return None;
    }
    Some(format!(
        "partition {} of queue {queue}: this replica has known no leader for {} s: the \
         partition takes no publishes and delivers nothing until a majority of its replicas \
         ({majority} of nodes {}) are up and reach each other to elect one; check `keratin cluster status` \
         for unreachable nodes, and their processes and the network",
        p.index,
        leaderless_ms / 1000,
        nodes_text(&p.replicas)
    ))
}

/// Runs a [`ClusterWatch`] on `attention` every [`CLUSTER_WATCH_INTERVAL`] until `stop`.
pub async fn run(
    cluster: Arc<ClusterNode>,
    broker: Broker,
    limits: Arc<crate::limits::NodeLimits>,
    mut stop: watch::Receiver<bool>,
) {
    let mut watch = ClusterWatch::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(CLUSTER_WATCH_INTERVAL) => {}
            _ = stop.changed() => return,
        }
        let status = cluster.status().await;
        let queues = broker.list();
        watch.check(
            limits.attention(),
            &queues,
            &status.nodes,
            status.node_id,
            Instant::now(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_broker::QueueSettings;

    fn partition(leading: bool, in_sync: &[u64], leaderless_ms: Option<u64>) -> PartitionInfo {
        PartitionInfo {
            index: 0,
            dir: "/data/q/0".into(),
            ready: 0,
            inflight: 0,
            bytes: 0,
            disk_bytes: 0,
            stopped: false,
            stops: 0,
            heals: 0,
            full: false,
            rejected_full: 0,
            overflowed: 0,
            dead_letter_failures: BTreeMap::new(),
            dead_letters_held: 0,
            leading,
            leader: leading.then_some(1),
            leader_addr: None,
            replicas: vec![1, 2, 3],
            preferred_leader: None,
            in_sync: in_sync.to_vec(),
            replica_lag: if leading {
                BTreeMap::from([(1, 0), (2, 0), (3, 4_321)])
            } else {
                BTreeMap::new()
            },
            leader_changes: 1,
            leaderless_ms,
            committed_offset: Some(10),
        }
    }

    fn queue(partition: PartitionInfo) -> Vec<QueueInfo> {
        vec![QueueInfo {
            name: "orders".into(),
            settings: QueueSettings::default(),
            partitions: vec![partition],
        }]
    }

    fn node(id: u64, reachable: bool) -> NodeStatus {
        NodeStatus {
            id,
            cluster_addr: format!("127.0.0.1:569{id}"),
            info: None,
            reachable,
            meta_leader: false,
            removed: false,
            levels: None,
            levels_age_ms: None,
        }
    }

    fn active(attention: &Attention) -> Vec<(String, String)> {
        attention
            .active()
            .into_iter()
            .map(|i| (i.kind.as_str().to_string(), i.subject))
            .collect()
    }

    #[test]
    fn a_partition_below_a_majority_is_raised_once_and_cleared() {
        let dir = tempfile::tempdir().expect("tempdir");
        let attention = Attention::open(dir.path());
        let mut watch = ClusterWatch::new();
        let nodes = [node(1, true)];
        let now = Instant::now();
        watch.check(
            &attention,
            &queue(partition(true, &[1, 2, 3], None)),
            &nodes,
            1,
            now,
        );
        watch.check(
            &attention,
            &queue(partition(true, &[1, 2], None)),
            &nodes,
            1,
            now,
        );
        assert!(active(&attention).is_empty(), "two of three are a majority");
        for _ in 0..3 {
            watch.check(
                &attention,
                &queue(partition(true, &[1], None)),
                &nodes,
                1,
                now,
            );
        }
        assert_eq!(
            active(&attention),
            vec![("partition_below_majority".into(), "orders/0".into())]
        );
        assert_eq!(attention.items().len(), 1, "raised once, not every round");
        let message = &attention.items()[0].message;
        assert!(
            message.contains("only 1 of its 3 replicas") && message.contains("node 3 lags 4321"),
            "{message}"
        );
        watch.check(
            &attention,
            &queue(partition(true, &[1, 3], None)),
            &nodes,
            1,
            now,
        );
        assert!(active(&attention).is_empty());
        // A follower without a leader: only after LEADERLESS_AFTER.
        let short = LEADERLESS_AFTER.as_millis() as u64 - 1;
        watch.check(
            &attention,
            &queue(partition(false, &[], Some(short))),
            &nodes,
            1,
            now,
        );
        assert!(active(&attention).is_empty(), "an election is no trouble");
        let long = LEADERLESS_AFTER.as_millis() as u64;
        watch.check(
            &attention,
            &queue(partition(false, &[], Some(long))),
            &nodes,
            1,
            now,
        );
        assert_eq!(active(&attention).len(), 1);
        assert!(attention.active()[0].message.contains("known no leader"));
        // The queue is deleted: its item goes with it.
        watch.check(&attention, &[], &nodes, 1, now);
        assert!(active(&attention).is_empty());
    }

    #[test]
    fn an_unreachable_node_is_raised_after_a_grace_and_cleared_when_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let attention = Attention::open(dir.path());
        let mut watch = ClusterWatch::new();
        let start = Instant::now();
        let down = [node(1, true), node(2, false), node(3, true)];
        watch.check(&attention, &[], &down, 1, start);
        watch.check(&attention, &[], &down, 1, start + UNREACHABLE_AFTER / 2);
        assert!(active(&attention).is_empty(), "within the grace");
        watch.check(&attention, &[], &down, 1, start + UNREACHABLE_AFTER);
        watch.check(&attention, &[], &down, 1, start + 2 * UNREACHABLE_AFTER);
        assert_eq!(
            active(&attention),
            vec![("node_unreachable".into(), "node-2".into())]
        );
        assert_eq!(attention.items().len(), 1);
        assert!(attention.items()[0].message.contains("127.0.0.1:5692"));
        let up = [node(1, true), node(2, true), node(3, true)];
        watch.check(&attention, &[], &up, 1, start + 3 * UNREACHABLE_AFTER);
        assert!(active(&attention).is_empty());
        // Down again: the grace starts over.
        watch.check(&attention, &[], &down, 1, start + 4 * UNREACHABLE_AFTER);
        assert!(active(&attention).is_empty());
        // This node itself never counts, whatever it is told.
        watch.check(
            &attention,
            &[],
            &[node(1, false)],
            1,
            start + 9 * UNREACHABLE_AFTER,
        );
        assert!(active(&attention).is_empty());
    }

    #[test]
    fn a_removed_node_is_not_reported_unreachable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let attention = Attention::open(dir.path());
        let mut watch = ClusterWatch::new();
        let start = Instant::now();
        let down = [node(1, true), node(2, false)];
        watch.check(&attention, &[], &down, 1, start);
        watch.check(&attention, &[], &down, 1, start + UNREACHABLE_AFTER);
        assert_eq!(active(&attention).len(), 1);
        // Removed from the cluster (and stopped): its item clears and never comes back.
        let removed = [
            node(1, true),
            NodeStatus {
                removed: true,
                ..node(2, false)
            },
        ];
        for round in 2..5 {
            watch.check(
                &attention,
                &[],
                &removed,
                1,
                start + round * UNREACHABLE_AFTER,
            );
        }
        assert!(active(&attention).is_empty(), "{:?}", active(&attention));
    }

    fn limited(id: u64, level: Level) -> NodeStatus {
        use keratin_limits::{FilesystemReport, LevelInput, NodeReport, Thresholds};
        NodeStatus {
            levels: Some(NodeReport {
                filesystems: vec![FilesystemReport {
                    path: "/small".into(),
                    free_bytes: 70 << 20,
                    total_bytes: 256 << 20,
                    spare_bytes: 0,
                    input: LevelInput {
                        level,
                        headroom_bytes: 70 << 20,
                        thresholds: Thresholds {
                            soft_bytes: 128 << 20,
                            hard_bytes: 76 << 20,
                            reserve_bytes: Some(25 << 20),
                            clear_margin_bytes: 5 << 20,
                        },
                    },
                    largest_queues: Vec::new(),
                }],
                memory: None,
                sampled_at_ms: 1,
            }),
            ..node(id, true)
        }
    }

    #[test]
    fn a_limited_node_is_raised_with_its_level_and_cleared_at_normal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let attention = Attention::open(dir.path());
        let mut watch = ClusterWatch::new();
        let now = Instant::now();
        watch.check(
            &attention,
            &[],
            &[node(1, true), limited(3, Level::Soft)],
            1,
            now,
        );
        assert_eq!(
            active(&attention),
            vec![("node_limited".into(), "node-3:/small".into())]
        );
        // Same level: not raised again.
        watch.check(
            &attention,
            &[],
            &[node(1, true), limited(3, Level::Soft)],
            1,
            now,
        );
        assert_eq!(attention.items().len(), 1);
        // Deeper: the item is replaced, critical, naming the node and the effect.
        watch.check(
            &attention,
            &[],
            &[node(1, true), limited(3, Level::Hard)],
            1,
            now,
        );
        let items = attention.active();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].severity, Severity::Critical);
        assert_eq!(items[0].level.as_deref(), Some("hard"));
        assert!(
            items[0].message.contains("node 3") && items[0].message.contains("refused"),
            "{}",
            items[0].message
        );
        // This node's own levels are the sampler's items, not these.
        watch.check(
            &attention,
            &[],
            &[limited(1, Level::Hard), limited(3, Level::Normal)],
            1,
            now,
        );
        assert!(active(&attention).is_empty(), "{:?}", active(&attention));
    }
}
