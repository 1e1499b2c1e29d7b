//! The records of the cluster's metadata group, byte by byte as `docs/cluster.md` ("Metadata
//! records") specifies: one JSON object per Raft entry, record type [`RECORD_JSON_V1`]. JSON
//! because these records are rare, small and read by people debugging a cluster; the hot path
//! never touches them (the node metadata log made the same choice).

use std::collections::BTreeMap;

use keratin_auth::UserChange;
use keratin_broker::stream::StreamSettings;
use keratin_broker::QueueSettings;
use serde::{Deserialize, Serialize};

/// Record type of a JSON metadata record, format 1.
pub const RECORD_JSON_V1: u8 = 1;

/// One decision of the metadata group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ClusterRecord {
    /// A queue, with the nodes holding each partition's replicas (the first is the preferred
    /// leader). Its id is assigned when the record is applied: the next free one.
    QueueDeclared {
        /// The queue.
        name: String,
        /// Its settings.
        settings: QueueSettings,
        /// Per partition, the nodes holding a replica.
        replicas: Vec<Vec<u64>>,
    },
    /// A queue deleted with its messages.
    QueueDeleted {
        /// The queue.
        name: String,
    },
    /// New settings of a live queue (not its partitions or replicas).
    QueueSettingsChanged {
        /// The queue.
        name: String,
        /// Its settings from here on.
        settings: QueueSettings,
    },
    /// Partition `index` of a queue moves onto other nodes (a node is removed): the nodes
    /// holding its replicas from here on, the first being the preferred leader. The group's
    /// leader changes its voters to match; a node left out retires its replica once the
    /// change committed.
    PartitionReplicasChanged {
        /// The queue.
        name: String,
        /// The partition.
        index: u32,
        /// The nodes holding a replica from here on.
        replicas: Vec<u64>,
    },
    /// Node `id` joins the cluster at `cluster_addr` (`keratin cluster add-node`): every node
    /// adds it to its peers, and it joins the metadata group's voters.
    NodeAdded {
        /// The node.
        id: u64,
        /// Its cluster address (`IP:PORT`).
        cluster_addr: String,
    },
    /// Node `id` leaves the cluster: it gets no new replicas and leaves the metadata group's
    /// voters (its partitions move by [`ClusterRecord::PartitionReplicasChanged`] records).
    NodeRemoved {
        /// The node.
        id: u64,
    },
    /// Cluster-wide runtime settings change (`keratin settings set`): each key (dotted, as
    /// `limits.disk.soft_fraction`) takes its value on every node, under the node's own
    /// overrides; a `null` value drops the key's cluster-wide value. Checked by the proposer;
    /// every node applies what its configuration accepts.
    RuntimeSettingsChanged {
        /// The keys that change, with their values (`null`: back to each node's configuration).
        changes: BTreeMap<String, serde_json::Value>,
    },
    /// A stream, its partitions and its cursor log replicated on `replicas` (partition `p`
    /// prefers the node at `p` modulo their number as leader, the cursor log the node after the
    /// last partition's: `groups.rs`). Its id is assigned when applied, from the queues'
    /// counter (one name space and one id space with queues).
    StreamDeclared {
        /// The stream.
        name: String,
        /// Its settings.
        settings: StreamSettings,
        /// The nodes holding a replica of every partition and of the cursor log.
        replicas: Vec<u64>,
    },
    /// A stream deleted with its messages and cursors.
    StreamDeleted {
        /// The stream.
        name: String,
    },
    /// New retention of a live stream (not its partitions).
    StreamSettingsChanged {
        /// The stream.
        name: String,
        /// Its settings from here on.
        settings: StreamSettings,
    },
    /// A change to the cluster's users (issue 16): checked by the proposer against its copy
    /// of the table; every node applies it in log order, and one that no longer applies (two
    /// proposers raced) or would leave no admin changes nothing on any node.
    UserChanged {
        /// The change.
        change: UserChange,
    },
}

impl ClusterRecord {
    /// The record's payload.
    pub fn encode(&self) -> Vec<u8> {
        // A derived Serialize of plain data cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record from its type and payload, or why it does not decode.
    pub fn decode(record_type: u8, payload: &[u8]) -> Result<ClusterRecord, String> {
        if record_type != RECORD_JSON_V1 {
            return Err(format!(
                "metadata record type {record_type}: this node knows only {RECORD_JSON_V1}"
            ));
        }
        serde_json::from_slice(payload).map_err(|e| format!("metadata record: {e}"))
    }

    /// The queue the record is about (empty for a record about a node).
    pub fn queue(&self) -> &str {
        match self {
            ClusterRecord::QueueDeclared { name, .. }
            | ClusterRecord::QueueDeleted { name }
            | ClusterRecord::QueueSettingsChanged { name, .. }
            | ClusterRecord::PartitionReplicasChanged { name, .. }
            | ClusterRecord::StreamDeclared { name, .. }
            | ClusterRecord::StreamDeleted { name }
            | ClusterRecord::StreamSettingsChanged { name, .. } => name,
            ClusterRecord::NodeRemoved { .. }
            | ClusterRecord::NodeAdded { .. }
            | ClusterRecord::RuntimeSettingsChanged { .. }
            | ClusterRecord::UserChanged { .. } => "",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_foreign_types_are_refused() {
        let record = ClusterRecord::QueueDeclared {
            name: "orders".into(),
            settings: QueueSettings::default(),
            replicas: vec![vec![2, 3, 1]],
        };
        let payload = record.encode();
        assert_eq!(
            ClusterRecord::decode(RECORD_JSON_V1, &payload).expect("decodes"),
            record
        );
        assert!(ClusterRecord::decode(2, &payload).is_err());
        for record in [
            ClusterRecord::PartitionReplicasChanged {
                name: "orders".into(),
                index: 1,
                replicas: vec![4, 2],
            },
            ClusterRecord::NodeRemoved { id: 3 },
            ClusterRecord::NodeAdded {
                id: 4,
                cluster_addr: "10.0.0.4:5690".into(),
            },
            ClusterRecord::RuntimeSettingsChanged {
                changes: [
                    (
                        "limits.disk.soft_fraction".to_string(),
                        serde_json::json!(0.3),
                    ),
                    ("storage.max_bytes".to_string(), serde_json::Value::Null),
                ]
                .into(),
            },
            ClusterRecord::UserChanged {
                change: UserChange::Delete { name: "app".into() },
            },
            ClusterRecord::StreamDeclared {
                name: "events".into(),
                settings: StreamSettings::default(),
                replicas: vec![2, 3, 1],
            },
            ClusterRecord::StreamSettingsChanged {
                name: "events".into(),
                settings: StreamSettings::default(),
            },
            ClusterRecord::StreamDeleted {
                name: "events".into(),
            },
        ] {
            let payload = record.encode();
            assert_eq!(
                ClusterRecord::decode(RECORD_JSON_V1, &payload).expect("decodes"),
                record
            );
        }
        assert_eq!(
            ClusterRecord::NodeRemoved { id: 3 }.encode(),
            br#"{"kind":"node_removed","id":3}"#
        );
        assert!(ClusterRecord::decode(RECORD_JSON_V1, b"{\"kind\":\"nope\"}").is_err());
    }
}
