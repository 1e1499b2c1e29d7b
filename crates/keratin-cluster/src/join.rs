//! Adding a node to a running cluster (`keratin cluster add-node`): the checks, the errors,
//! and the plan of which replicas move onto it ([`plan_rebalance`], pure). The records that
//! carry it out are proposed by `ClusterNode::add_node`; every node adds the new one to its
//! peers (`applier.rs`), and the groups follow the moves (`reconcile.rs`).

use std::collections::{BTreeMap, BTreeSet};

use crate::catalog::ClusterCatalog;
use crate::remove::PlannedMove;

/// Why a node cannot be added.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AddNodeError {
    /// The id is taken by a node at another address.
    #[error("node {id} is already in the cluster at {existing}; give the new node another id")]
    Taken {
        /// The id.
        id: u64,
        /// Where the node of that id is.
        existing: String,
    },
    /// The address is another node's.
    #[error("{addr} is node {other}'s cluster address; give the new node its own")]
    AddressTaken {
        /// The address.
        addr: String,
        /// The node using it.
        other: u64,
    },
    /// The id belonged to a removed node.
    #[error("node {id} was removed from the cluster, and a removed node's id is not used again; give the new node another id")]
    Removed {
        /// The id.
        id: u64,
    },
    /// The cluster is at its size bound.
    #[error("the cluster has {nodes} nodes, the most this version runs; remove one first")]
    Full {
        /// Its nodes.
        nodes: usize,
    },
    /// Not an id or address this can take.
    #[error("{0}")]
    Invalid(String),
    /// The metadata group did not take a record.
    #[error("the cluster's metadata group did not take the change: {0}; run the command again (it continues where it stopped)")]
    Metadata(String),
}

/// Replicas that move onto `new` so that it holds about its share: the nodes holding the most
/// replicas give one each in turn (in place in the partition's list, so the preferred leader
/// moves only if it was the one giving), each partition at most once and never onto a
/// partition `new` holds already, until `new` holds `total / nodes` (rounded down) or no
/// partition can give. `nodes` are the cluster's nodes, `new` among them.
pub fn plan_rebalance(catalog: &ClusterCatalog, new: u64, nodes: &[u64]) -> Vec<PlannedMove> {
    let mut load: BTreeMap<u64, usize> = nodes.iter().map(|n| (*n, 0)).collect();
    let mut replicas: Vec<(String, u32, Vec<u64>)> = Vec::new();
    for (name, entry) in catalog.queues() {
        for (index, set) in entry.replicas.iter().enumerate() {
            for node in set {
                *load.entry(*node).or_default() += 1;
            }
            replicas.push((name.clone(), index as u32, set.clone()));
        }
    }
    if nodes.is_empty() {
        return Vec::new();
    }
    let total: usize = load.values().sum();
    let share = total / nodes.len();
    let mut moves = Vec::new();
    let mut moved = BTreeSet::new();
    while load.get(&new).copied().unwrap_or(0) < share {
        // The most loaded node that can give (ties: the lower id), and its first partition
        // not on `new` and not moved yet.
        let mut givers: Vec<(usize, u64)> = load
            .iter()
            .filter(|(node, _)| **node != new)
            .map(|(node, count)| (*count, *node))
            .collect();
        givers.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let pick = givers.iter().find_map(|(count, giver)| {
            if *count <= share {
                return None;
            }
            replicas
                .iter()
                .enumerate()
                .find(|(at, (_, _, set))| {
                    !moved.contains(at) && set.contains(giver) && !set.contains(&new)
                })
                .map(|(at, _)| (at, *giver))
        });
        let Some((at, giver)) = pick else { break };
        moved.insert(at);
        let (queue, partition, from) = replicas[at].clone();
        let to: Vec<u64> = from
            .iter()
            .map(|n| if *n == giver { new } else { *n })
            .collect();
        *load.entry(giver).or_default() -= 1;
        *load.entry(new).or_default() += 1;
        replicas[at].2 = to.clone();
        moves.push(PlannedMove {
            queue,
            partition,
            from,
            to,
        });
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::ClusterRecord;
    use keratin_broker::QueueSettings;

    fn catalog(replicas: Vec<Vec<u64>>) -> ClusterCatalog {
        let mut catalog = ClusterCatalog::default();
        catalog.apply(ClusterRecord::QueueDeclared {
            name: "q".into(),
            settings: QueueSettings {
                partitions: replicas.len() as u32,
                ..QueueSettings::default()
            },
            replicas,
        });
        catalog
    }

    #[test]
    fn the_new_node_takes_its_share_from_the_most_loaded() {
        // 4 partitions x 3 replicas on 3 nodes: 4 each; with node 4, 12 / 4 = 3 each.
        let catalog = catalog(vec![
            vec![1, 2, 3],
            vec![2, 3, 1],
            vec![3, 1, 2],
            vec![1, 2, 3],
        ]);
        let moves = plan_rebalance(&catalog, 4, &[1, 2, 3, 4]);
        assert_eq!(moves.len(), 3, "{moves:?}");
        let mut load: BTreeMap<u64, usize> = BTreeMap::new();
        let mut after: Vec<Vec<u64>> = catalog.get("q").unwrap().replicas.clone();
        for planned in &moves {
            after[planned.partition as usize] = planned.to.clone();
        }
        for set in &after {
            let distinct: BTreeSet<u64> = set.iter().copied().collect();
            assert_eq!(distinct.len(), 3, "{set:?}");
            for n in set {
                *load.entry(*n).or_default() += 1;
            }
        }
        assert_eq!(load.values().copied().collect::<Vec<_>>(), vec![3, 3, 3, 3]);
        // Each partition moves at most once, the new node in the giver's place.
        let partitions: BTreeSet<u32> = moves.iter().map(|m| m.partition).collect();
        assert_eq!(partitions.len(), 3);
        assert_eq!(moves[0].from, vec![1, 2, 3]);
        assert_eq!(moves[0].to, vec![4, 2, 3]);
    }

    #[test]
    fn nothing_moves_when_the_share_is_below_one_or_nothing_can_give() {
        assert!(plan_rebalance(&catalog(vec![vec![1, 2, 3]]), 4, &[1, 2, 3, 4]).is_empty());
        assert!(plan_rebalance(&ClusterCatalog::default(), 4, &[1, 4]).is_empty());
        // Every partition already holds the new node.
        assert!(plan_rebalance(&catalog(vec![vec![4, 1], vec![1, 4]]), 4, &[1, 4]).is_empty());
    }
}
