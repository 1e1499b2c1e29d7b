//! Keratin's cluster layer: what makes a node a member of a cluster, above the replication
//! adapter (`keratin-raft`, which alone names openraft's types) and beside the broker
//! (`keratin-broker`, which it drives through two hooks: `PartitionLogs` opens replicated
//! partition logs, `ClusterMetadata` sends declare, delete and settings changes through the
//! metadata group, and purges to partitions' leaders). Design: `docs/cluster.md`.
//!
//! - `records`: the metadata group's records (JSON), byte by byte in `docs/cluster.md`.
//! - `catalog`: the queues as the applied records say, with ids assigned in log order.
//! - `placement`: which nodes hold each partition's replicas.
//! - `meta`: this node's member of the metadata group; proposals go to its leader.
//! - `applier`: applies the group's records to the catalog and the broker, in order.
//! - `hook`: the broker's `ClusterMetadata`.
//! - `service`: node-to-node requests that are not Raft's (who are you, propose this, store
//!   these dead letters).
//! - `dead_letters`: the broker's dead-letter sink on a cluster node: each dead-letter copy
//!   goes to its partition's leader, wherever it is.
//! - `directory`: the nodes' client and admin addresses.
//! - `levels`: every node's resource report, carried by node labels.
//! - `elsewhere`: the log of a partition with no replica on this node.
//! - `groups`: every queue's and stream's replicated groups, the preferred leader first.
//! - `reconcile`: brings the groups this node leads to the members the metadata names.
//! - `balance`: hands partitions back to their preferred leaders (automatically, and on
//!   request: [`ClusterNode::rebalance`]).
//! - `remove`: where a removed node's replicas go.
//! - `join`: which replicas move onto an added node.
//! - `moves`: moving one replica to another node (`keratin queue move`).
//! - `purge`: purging a partition on its leader from any node.
//! - `node`: [`ClusterNode`], starting and stopping all of it.

#![deny(missing_docs)]

mod applier;
mod balance;
pub mod catalog;
pub mod dead_letters;
pub mod directory;
pub mod elsewhere;
mod groups;
mod hook;
pub mod join;
pub mod levels;
mod meta;
pub mod moves;
mod node;
pub mod placement;
mod purge;
mod reconcile;
pub mod records;
pub mod remove;
mod service;

pub use balance::{LeaderKept, LeaderMove, RebalanceReport};
pub use dead_letters::ClusterDeadLetters;
pub use directory::{Directory, NodeInfo};
pub use hook::{DEFAULT_REPLICAS, METADATA_TIMEOUT};
pub use join::AddNodeError;
pub use levels::{ClusterLevels, HeardReport, NodeLabel};
pub use meta::{META_GROUP, META_VOTERS_MAX};
pub use moves::MoveReplicaError;
pub use node::{
    ClusterNode, ClusterStatus, MakePartitionLogs, NodeStatus, PreparedCluster, CLUSTER_NODES_MAX,
};
pub use remove::{PlannedMove, RemoveNodeError};
pub use service::SERVICE_GROUP;
