//! Removing a node from the cluster (`keratin cluster remove-node`): the plan of where each of
//! its replicas goes ([`plan_removal`], pure), and the errors. The records that carry it out
//! are proposed by `ClusterNode::remove_node`; the groups follow them (`reconcile.rs`).

use std::collections::{BTreeMap, BTreeSet};

use crate::catalog::ClusterCatalog;

/// One partition's move, planned.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlannedMove {
    /// The queue.
    pub queue: String,
    /// The partition.
    pub partition: u32,
    /// The nodes holding its replicas now.
    pub from: Vec<u64>,
    /// The nodes that will (one fewer when no node could take the removed node's copy).
    pub to: Vec<u64>,
}

/// Why a node cannot be removed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RemoveNodeError {
    /// The node is not one of the cluster's.
    #[error("node {id} is not in this cluster (its nodes are {nodes:?})")]
    Unknown {
        /// The node asked for.
        id: u64,
        /// The cluster's nodes.
        nodes: Vec<u64>,
    },
    /// It is the last node left.
    #[error("node {id} is the cluster's last node; a cluster keeps at least one")]
    Last {
        /// The node.
        id: u64,
    },
    /// A partition whose only copy is on the node, and no node can take it.
    #[error(
        "partition {partition} of queue {queue:?} has its only copy on node {id} and no other \
         node below the soft level can take it; free space on another node, add a node, or \
         delete the queue first"
    )]
    NoRoom {
        /// The node.
        id: u64,
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
    },
    /// The node holds a replica of a stream: streams' replicas do not move yet.
    #[error(
        "node {id} holds a replica of stream {stream:?}, and a stream's replicas cannot move \
         yet; delete the stream (or keep the node) before removing it"
    )]
    HoldsStream {
        /// The node.
        id: u64,
        /// The first such stream.
        stream: String,
    },
    /// The metadata group did not take a record.
    #[error("the cluster's metadata group did not take the removal: {0}; run the command again (it continues where it stopped)")]
    Metadata(String),
}

/// Where each partition with a replica on `id` goes: the copy there is replaced by one on the
/// eligible node (`candidates`, most free first: see `placement::eligible`) that holds the
/// fewest replicas so far and none of this partition, in the removed node's place in the list
/// (the first stays the preferred leader unless it was the removed node). With no candidate
/// the partition keeps its other copies; one with no other copy makes the plan fail, and so
/// does a node holding a stream's replica (streams' replicas do not move yet).
pub fn plan_removal(
    catalog: &ClusterCatalog,
    id: u64,
    candidates: &[u64],
) -> Result<Vec<PlannedMove>, RemoveNodeError> {
    // A stream's groups are not moved by these plans: its copy on the node would be lost.
    if let Some((stream, _)) = catalog
        .streams()
        .iter()
        .find(|(_, entry)| entry.replicas.contains(&id))
    {
        return Err(RemoveNodeError::HoldsStream {
            id,
            stream: stream.clone(),
        });
    }
    let mut load: BTreeMap<u64, usize> = candidates.iter().map(|c| (*c, 0)).collect();
    for entry in catalog.queues().values() {
        for node in entry.replicas.iter().flatten() {
            if let Some(count) = load.get_mut(node) {
                *count += 1;
            }
        }
    }
    let mut moves = Vec::new();
    for (name, entry) in catalog.queues() {
        for (index, from) in entry.replicas.iter().enumerate() {
            if !from.contains(&id) {
                continue;
            }
            let held: BTreeSet<u64> = from.iter().copied().collect();
            // Fewest replicas first; among equals, the candidates' order (most free first).
            let choice = candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| **c != id && !held.contains(c))
                .min_by_key(|(rank, c)| (load.get(c).copied().unwrap_or(0), *rank))
                .map(|(_, c)| *c);
            let to: Vec<u64> = match choice {
                Some(other) => {
                    *load.entry(other).or_default() += 1;
                    from.iter()
                        .map(|n| if *n == id { other } else { *n })
                        .collect()
                }
                None if from.len() > 1 => from.iter().copied().filter(|n| *n != id).collect(),
                None => {
                    return Err(RemoveNodeError::NoRoom {
                        id,
                        queue: name.clone(),
                        partition: index as u32,
                    })
                }
            };
            moves.push(PlannedMove {
                queue: name.clone(),
                partition: index as u32,
                from: from.clone(),
                to,
            });
        }
    }
    Ok(moves)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::ClusterRecord;
    use keratin_broker::QueueSettings;

    fn catalog(queues: &[(&str, Vec<Vec<u64>>)]) -> ClusterCatalog {
        let mut catalog = ClusterCatalog::default();
        for (name, replicas) in queues {
            catalog.apply(ClusterRecord::QueueDeclared {
                name: name.to_string(),
                settings: QueueSettings {
                    partitions: replicas.len() as u32,
                    ..QueueSettings::default()
                },
                replicas: replicas.clone(),
            });
        }
        catalog
    }

    #[test]
    fn copies_go_to_the_least_loaded_eligible_node_in_the_removed_nodes_place() {
        let catalog = catalog(&[
            ("a", vec![vec![3, 1, 2], vec![1, 2, 4]]),
            ("b", vec![vec![2, 3], vec![5, 1]]),
        ]);
        let moves = plan_removal(&catalog, 3, &[1, 2, 4, 5]).expect("plan");
        assert_eq!(
            moves,
            vec![
                PlannedMove {
                    queue: "a".into(),
                    partition: 0,
                    from: vec![3, 1, 2],
                    to: vec![4, 1, 2],
                },
                PlannedMove {
                    queue: "b".into(),
                    partition: 0,
                    from: vec![2, 3],
                    to: vec![2, 5],
                },
            ],
            "4 and 5 held one replica each: 4 (more free) takes the first, then 5 (fewer now)"
        );
    }

    #[test]
    fn without_a_candidate_a_partition_keeps_its_other_copies_or_the_plan_fails() {
        let shrink = catalog(&[("a", vec![vec![1, 3]])]);
        let moves = plan_removal(&shrink, 3, &[1]).expect("plan");
        assert_eq!(moves[0].to, vec![1]);
        let alone = catalog(&[("a", vec![vec![3]])]);
        assert!(matches!(
            plan_removal(&alone, 3, &[]),
            Err(RemoveNodeError::NoRoom { partition: 0, .. })
        ));
        assert_eq!(
            plan_removal(&alone, 2, &[]).expect("nothing to move"),
            vec![]
        );
    }

    #[test]
    fn a_node_holding_a_stream_replica_is_not_removed() {
        let mut with_stream = catalog(&[("a", vec![vec![1, 3]])]);
        with_stream.apply(ClusterRecord::StreamDeclared {
            name: "events".into(),
            settings: keratin_broker::stream::StreamSettings::default(),
            replicas: vec![2, 3],
        });
        match plan_removal(&with_stream, 3, &[1, 2]) {
            Err(RemoveNodeError::HoldsStream { id: 3, stream }) => assert_eq!(stream, "events"),
            other => panic!("removing a stream's replica: {other:?}"),
        }
        assert!(
            plan_removal(&with_stream, 1, &[2, 3]).is_ok(),
            "node 1 holds no stream"
        );
    }
}
