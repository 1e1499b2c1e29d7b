//! Moving one replica (`keratin queue move NAME --partition P --from NODE --to NODE`): the
//! checks and the planned move ([`plan_move`], pure). `ClusterNode::move_replica` proposes it
//! as a [`crate::records::ClusterRecord::PartitionReplicasChanged`]; the partition group's
//! leader then carries it out like a removal's moves (`reconcile.rs`: the new node joins as a
//! learner and catches up, then the voters change; the old copy retires once that committed).

use std::collections::BTreeMap;

use crate::catalog::ClusterCatalog;
use crate::remove::PlannedMove;

/// Why a replica cannot move.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MoveReplicaError {
    /// No such queue.
    #[error("queue {0:?} does not exist")]
    UnknownQueue(String),
    /// No such partition.
    #[error("queue {queue:?} has {partitions} partitions (0 to {}); there is no partition {partition}", partitions.saturating_sub(1))]
    UnknownPartition {
        /// The queue.
        queue: String,
        /// The partition asked for.
        partition: u32,
        /// How many it has.
        partitions: u32,
    },
    /// A node that is not one of the cluster's.
    #[error("node {id} is not in this cluster (its nodes are {nodes:?})")]
    UnknownNode {
        /// The node asked for.
        id: u64,
        /// The cluster's nodes.
        nodes: Vec<u64>,
    },
    /// `from` holds no replica of the partition.
    #[error("partition {partition} of queue {queue:?} has no replica on node {from} (its replicas are on {replicas:?})")]
    NotHeld {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// The node named as the source.
        from: u64,
        /// Where its replicas are.
        replicas: Vec<u64>,
    },
    /// `to` holds one already (or is `from`).
    #[error("partition {partition} of queue {queue:?} has a replica on node {to} already (its replicas are on {replicas:?}); name a node without one")]
    AlreadyHeld {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// The node named as the target.
        to: u64,
        /// Where its replicas are.
        replicas: Vec<u64>,
    },
    /// The target is at the soft level or worse: it would be limited at once.
    #[error("node {to} is at the {level} level: a replica moved there would limit the partition at once; free space there or pick another node")]
    TargetLimited {
        /// The target.
        to: u64,
        /// Its level.
        level: String,
    },
    /// The metadata group did not take the record.
    #[error("the cluster's metadata group did not take the move: {0}; run the command again")]
    Metadata(String),
}

/// The move of partition `partition` of `queue`'s replica from node `from` to node `to`:
/// `to` takes `from`'s place in the replica list (so a preferred leader moving off is
/// replaced by the new node, which leads once caught up). `nodes` are the cluster's nodes;
/// `level` says what a node last reported (`None`: not heard yet, taken as normal).
pub fn plan_move(
    catalog: &ClusterCatalog,
    nodes: &BTreeMap<u64, String>,
    queue: &str,
    partition: u32,
    from: u64,
    to: u64,
    level: impl Fn(u64) -> Option<String>,
) -> Result<PlannedMove, MoveReplicaError> {
    let entry = catalog
        .get(queue)
        .ok_or_else(|| MoveReplicaError::UnknownQueue(queue.to_string()))?;
    let replicas = entry.replicas.get(partition as usize).ok_or_else(|| {
        MoveReplicaError::UnknownPartition {
            queue: queue.to_string(),
            partition,
            partitions: entry.replicas.len() as u32,
        }
    })?;
    if !nodes.contains_key(&to) {
        return Err(MoveReplicaError::UnknownNode {
            id: to,
            nodes: nodes.keys().copied().collect(),
        });
    }
    if !replicas.contains(&from) {
        return Err(MoveReplicaError::NotHeld {
            queue: queue.to_string(),
            partition,
            from,
            replicas: replicas.clone(),
        });
    }
    if replicas.contains(&to) {
        return Err(MoveReplicaError::AlreadyHeld {
            queue: queue.to_string(),
            partition,
            to,
            replicas: replicas.clone(),
        });
    }
    if let Some(level) = level(to).filter(|l| l != "normal") {
        return Err(MoveReplicaError::TargetLimited { to, level });
    }
    Ok(PlannedMove {
        queue: queue.to_string(),
        partition,
        from: replicas.clone(),
        to: replicas
            .iter()
            .map(|n| if *n == from { to } else { *n })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::ClusterRecord;
    use keratin_broker::QueueSettings;

    fn setup() -> (ClusterCatalog, BTreeMap<u64, String>) {
        let mut catalog = ClusterCatalog::default();
        catalog.apply(ClusterRecord::QueueDeclared {
            name: "a".into(),
            settings: QueueSettings {
                partitions: 2,
                replicas: Some(2),
                ..QueueSettings::default()
            },
            replicas: vec![vec![3, 1], vec![1, 3]],
        });
        let nodes = (1..=4).map(|id| (id, format!("127.0.0.1:{id}"))).collect();
        (catalog, nodes)
    }

    #[test]
    fn the_new_node_takes_the_old_ones_place() {
        let (catalog, nodes) = setup();
        let planned = plan_move(&catalog, &nodes, "a", 0, 3, 2, |_| None).expect("plan");
        assert_eq!(planned.from, vec![3, 1]);
        assert_eq!(
            planned.to,
            vec![2, 1],
            "2 is the preferred leader in 3's place"
        );
        let planned =
            plan_move(&catalog, &nodes, "a", 1, 3, 4, |_| Some("normal".into())).expect("plan");
        assert_eq!(planned.to, vec![1, 4]);
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let (catalog, nodes) = setup();
        let refused = |queue: &str, p: u32, from: u64, to: u64| {
            plan_move(&catalog, &nodes, queue, p, from, to, |id| {
                (id == 4).then(|| "hard".to_string())
            })
            .expect_err("refused")
        };
        assert!(matches!(
            refused("b", 0, 3, 2),
            MoveReplicaError::UnknownQueue(_)
        ));
        assert!(matches!(
            refused("a", 2, 3, 2),
            MoveReplicaError::UnknownPartition { partitions: 2, .. }
        ));
        assert!(matches!(
            refused("a", 0, 3, 9),
            MoveReplicaError::UnknownNode { id: 9, .. }
        ));
        assert!(matches!(
            refused("a", 0, 2, 4),
            MoveReplicaError::NotHeld { from: 2, .. }
        ));
        assert!(matches!(
            refused("a", 0, 3, 1),
            MoveReplicaError::AlreadyHeld { to: 1, .. }
        ));
        assert!(matches!(
            refused("a", 0, 3, 3),
            MoveReplicaError::AlreadyHeld { to: 3, .. }
        ));
        let limited = refused("a", 0, 3, 4);
        assert!(matches!(
            limited,
            MoveReplicaError::TargetLimited { to: 4, .. }
        ));
        assert!(limited.to_string().contains("hard level"), "{limited}");
    }
}
