//! The replicated groups the catalog names, each with its replicas in preferred order: the one
//! walk the reconciler and the leader balancer make over queues and streams alike.
//!
//! - A queue's partition `p` is group `partition_group(id, p)`, on the replicas placement
//!   gave it (placement rotates the first node, the preferred leader, over the cluster).
//! - A stream keeps one replica set for all its groups. Its payload partition `p` lists that
//!   set rotated left by `p`, and its cursor log (group index
//!   [`CURSOR_LOG_GROUP_INDEX`]) by the partition count: so a stream of three partitions on
//!   three nodes has its partitions' preferred leaders on three different nodes, as a queue's
//!   have, and its cursor log's on the node after the last partition's.
//!
//! Pure: reads the catalog, owns nothing.

use keratin_broker::stream::cursor_log::{CURSOR_LOG_GROUP_INDEX, CURSOR_LOG_PARTITION};
use keratin_net::GroupId;
use keratin_raft::partition_log::partition_group;

use crate::catalog::{ClusterCatalog, StreamEntry};

/// One replicated group of a queue or stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CatalogGroup {
    /// Its Raft group.
    pub(crate) group: GroupId,
    /// The queue or stream it belongs to.
    pub(crate) name: String,
    /// Its partition's index; [`CURSOR_LOG_PARTITION`] for a stream's cursor log (the number
    /// the broker's refusals carry for it).
    pub(crate) partition: u32,
    /// The nodes holding a copy, the preferred leader first.
    pub(crate) replicas: Vec<u64>,
}

/// `replicas` rotated left by `by` (the first node after the rotation prefers to lead).
fn rotated(replicas: &[u64], by: u32) -> Vec<u64> {
    let mut out = replicas.to_vec();
    if !out.is_empty() {
        let by = by as usize % out.len();
        out.rotate_left(by);
    }
    out
}

/// Each payload partition's replicas of `entry`, by index, the preferred leader first (see
/// the module docs).
pub(crate) fn stream_partition_replicas(entry: &StreamEntry) -> Vec<Vec<u64>> {
    (0..entry.settings.partitions)
        .map(|p| rotated(&entry.replicas, p))
        .collect()
}

/// Every group of every queue and stream in `catalog`; a group whose id cannot be formed (an
/// id past the group id's range) is left out, as the applier never opened it.
pub(crate) fn catalog_groups(catalog: &ClusterCatalog) -> Vec<CatalogGroup> {
    let mut out = Vec::new();
    for (name, entry) in catalog.queues() {
        for (index, replicas) in entry.replicas.iter().enumerate() {
            let Ok(partition) = u32::try_from(index) else {
                continue;
            };
            if let Ok(group) = partition_group(entry.id, partition) {
                out.push(CatalogGroup {
                    group,
                    name: name.clone(),
                    partition,
                    replicas: replicas.clone(),
                });
            }
        }
    }
    for (name, entry) in catalog.streams() {
        for (partition, replicas) in (0u32..).zip(stream_partition_replicas(entry)) {
            if let Ok(group) = partition_group(entry.id, partition) {
                out.push(CatalogGroup {
                    group,
                    name: name.clone(),
                    partition,
                    replicas,
                });
            }
        }
        if let Ok(group) = partition_group(entry.id, CURSOR_LOG_GROUP_INDEX) {
            out.push(CatalogGroup {
                group,
                name: name.clone(),
                partition: CURSOR_LOG_PARTITION,
                replicas: rotated(&entry.replicas, entry.settings.partitions),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::ClusterRecord;
    use keratin_broker::stream::StreamSettings;
    use keratin_broker::QueueSettings;

    #[test]
    fn a_streams_partitions_prefer_different_nodes_and_queues_keep_their_placement() {
        let mut catalog = ClusterCatalog::default();
        catalog.apply(ClusterRecord::QueueDeclared {
            name: "q".into(),
            settings: QueueSettings {
                partitions: 2,
                ..QueueSettings::default()
            },
            replicas: vec![vec![2, 3, 1], vec![3, 1, 2]],
        });
        catalog.apply(ClusterRecord::StreamDeclared {
            name: "s".into(),
            settings: StreamSettings {
                partitions: 3,
                ..StreamSettings::default()
            },
            replicas: vec![2, 3, 1],
        });
        let groups = catalog_groups(&catalog);
        let preferred: Vec<(&str, u32, u64)> = groups
            .iter()
            .map(|g| (g.name.as_str(), g.partition, g.replicas[0]))
            .collect();
        assert_eq!(
            preferred,
            vec![
                ("q", 0, 2),
                ("q", 1, 3),
                ("s", 0, 2),
                ("s", 1, 3),
                ("s", 2, 1),
                ("s", CURSOR_LOG_PARTITION, 2),
            ]
        );
        // Every group keeps the stream's whole replica set; the ids are the broker's.
        let stream_id = catalog.stream("s").map(|s| s.id).unwrap_or_default();
        for g in groups.iter().filter(|g| g.name == "s") {
            let mut set = g.replicas.clone();
            set.sort_unstable();
            assert_eq!(set, vec![1, 2, 3]);
        }
        assert_eq!(
            groups.last().map(|g| g.group),
            partition_group(stream_id, CURSOR_LOG_GROUP_INDEX).ok()
        );
    }
}
