//! [`ClusterCatalog`]: what the metadata group's records say, applied in log order on every
//! node (plain data; the applier acts on each [`Change`]). Deterministic: the same records give
//! the same catalog, queue ids included, on every node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use keratin_auth::UserTable;
use keratin_broker::stream::StreamSettings;
use keratin_broker::QueueSettings;

use crate::records::ClusterRecord;

/// A queue as the cluster knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEntry {
    /// Its id, the same on every node (it names the partition groups).
    pub id: u64,
    /// Its settings.
    pub settings: QueueSettings,
    /// Per partition, the nodes holding a replica.
    pub replicas: Vec<Vec<u64>>,
}

/// A stream as the cluster knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntry {
    /// Its id, the same on every node (it names its groups).
    pub id: u64,
    /// Its settings.
    pub settings: StreamSettings,
    /// The nodes holding a replica of every partition and of the cursor log.
    pub replicas: Vec<u64>,
}

/// What applying one record changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A new queue.
    Declared {
        /// Its name.
        name: String,
        /// As declared.
        entry: QueueEntry,
    },
    /// A queue went.
    Deleted {
        /// Its name.
        name: String,
    },
    /// A queue's settings changed.
    SettingsChanged {
        /// Its name.
        name: String,
        /// The new settings.
        settings: QueueSettings,
    },
    /// A partition moved onto other nodes.
    ReplicasChanged {
        /// The queue's name.
        name: String,
        /// The queue's id.
        id: u64,
        /// The partition.
        index: u32,
        /// The nodes that held its replicas.
        before: Vec<u64>,
        /// The nodes holding them from here on.
        replicas: Vec<u64>,
    },
    /// A new stream.
    StreamDeclared {
        /// Its name.
        name: String,
        /// As declared.
        entry: StreamEntry,
    },
    /// A stream went.
    StreamDeleted {
        /// Its name.
        name: String,
    },
    /// A stream's retention changed.
    StreamSettingsChanged {
        /// Its name.
        name: String,
        /// The new settings.
        settings: StreamSettings,
    },
    /// A node joined the cluster.
    NodeAdded {
        /// The node.
        id: u64,
        /// Its cluster address.
        cluster_addr: String,
    },
    /// A node left the cluster.
    NodeRemoved {
        /// The node.
        id: u64,
    },
    /// The cluster-wide runtime settings changed.
    RuntimeSettings {
        /// Every cluster-wide value in force from here on, by dotted key.
        overrides: BTreeMap<String, serde_json::Value>,
    },
    /// The users changed.
    Users {
        /// The table from here on.
        table: Arc<UserTable>,
    },
    /// Nothing changed, and why (a declare of a name taken, a delete of a name not there: a
    /// proposer raced another; its caller sees the catalog as it is).
    Ignored(String),
}

/// See the module docs.
#[derive(Debug, Default, Clone)]
pub struct ClusterCatalog {
    queues: BTreeMap<String, QueueEntry>,
    streams: BTreeMap<String, StreamEntry>,
    next_id: u64,
    removed: BTreeSet<u64>,
    added: BTreeMap<u64, String>,
    settings: BTreeMap<String, serde_json::Value>,
    users: Arc<UserTable>,
}

impl ClusterCatalog {
    /// Apply one record.
    pub fn apply(&mut self, record: ClusterRecord) -> Change {
        match record {
            ClusterRecord::QueueDeclared {
                name,
                settings,
                replicas,
            } => {
                if self.queues.contains_key(&name) {
                    return Change::Ignored(format!("queue {name:?} exists"));
                }
                if self.streams.contains_key(&name) {
                    return Change::Ignored(format!("a stream is named {name:?}"));
                }
                if replicas.len() != settings.partitions as usize
                    || replicas.iter().any(Vec::is_empty)
                {
                    return Change::Ignored(format!(
                        "queue {name:?}: {} replica sets for {} partitions",
                        replicas.len(),
                        settings.partitions
                    ));
                }
                let entry = QueueEntry {
                    id: self.next_id,
                    settings,
                    replicas,
                };
                self.next_id += 1;
                self.queues.insert(name.clone(), entry.clone());
                Change::Declared { name, entry }
            }
            ClusterRecord::QueueDeleted { name } => match self.queues.remove(&name) {
                Some(_) => Change::Deleted { name },
                None => Change::Ignored(format!("queue {name:?} does not exist")),
            },
            ClusterRecord::QueueSettingsChanged { name, settings } => {
                match self.queues.get_mut(&name) {
                    Some(entry)
                        if entry.settings.partitions == settings.partitions
                            && entry.settings.replicas == settings.replicas =>
                    {
                        entry.settings = settings.clone();
                        Change::SettingsChanged { name, settings }
                    }
                    Some(_) => Change::Ignored(format!(
                        "queue {name:?}: partitions and replicas cannot change"
                    )),
                    None => Change::Ignored(format!("queue {name:?} does not exist")),
                }
            }
            ClusterRecord::PartitionReplicasChanged {
                name,
                index,
                replicas,
            } => {
                let Some(entry) = self.queues.get_mut(&name) else {
                    return Change::Ignored(format!("queue {name:?} does not exist"));
                };
                let Some(current) = entry.replicas.get_mut(index as usize) else {
                    return Change::Ignored(format!("queue {name:?} has no partition {index}"));
                };
                let distinct: BTreeSet<u64> = replicas.iter().copied().collect();
                if replicas.is_empty() || distinct.len() != replicas.len() {
                    return Change::Ignored(format!(
                        "queue {name:?} partition {index}: replicas {replicas:?} are not distinct \
                         nodes"
                    ));
                }
                if let Some(gone) = replicas.iter().find(|id| self.removed.contains(id)) {
                    return Change::Ignored(format!(
                        "queue {name:?} partition {index}: node {gone} was removed"
                    ));
                }
                if *current == replicas {
                    return Change::Ignored(format!(
                        "queue {name:?} partition {index} is on {replicas:?} already"
                    ));
                }
                let before = std::mem::replace(current, replicas.clone());
                Change::ReplicasChanged {
                    name,
                    id: entry.id,
                    index,
                    before,
                    replicas,
                }
            }
            ClusterRecord::StreamDeclared {
                name,
                settings,
                replicas,
            } => {
                if self.streams.contains_key(&name) {
                    return Change::Ignored(format!("stream {name:?} exists"));
                }
                if self.queues.contains_key(&name) {
                    return Change::Ignored(format!("a queue is named {name:?}"));
                }
                let distinct: BTreeSet<u64> = replicas.iter().copied().collect();
                if replicas.is_empty() || distinct.len() != replicas.len() {
                    return Change::Ignored(format!(
                        "stream {name:?}: replicas {replicas:?} are not distinct nodes"
                    ));
                }
                let entry = StreamEntry {
                    id: self.next_id,
                    settings,
                    replicas,
                };
                self.next_id += 1;
                self.streams.insert(name.clone(), entry.clone());
                Change::StreamDeclared { name, entry }
            }
            ClusterRecord::StreamDeleted { name } => match self.streams.remove(&name) {
                Some(_) => Change::StreamDeleted { name },
                None => Change::Ignored(format!("stream {name:?} does not exist")),
            },
            ClusterRecord::StreamSettingsChanged { name, settings } => {
                match self.streams.get_mut(&name) {
                    Some(entry) if entry.settings.partitions == settings.partitions => {
                        entry.settings = settings;
                        Change::StreamSettingsChanged { name, settings }
                    }
                    Some(_) => {
                        Change::Ignored(format!("stream {name:?}: its partitions cannot change"))
                    }
                    None => Change::Ignored(format!("stream {name:?} does not exist")),
                }
            }
            ClusterRecord::NodeAdded { id, cluster_addr } => {
                if self.removed.contains(&id) {
                    return Change::Ignored(format!(
                        "node {id} was removed; a removed node's id is not used again"
                    ));
                }
                if self.added.get(&id) == Some(&cluster_addr) {
                    return Change::Ignored(format!("node {id} was added already"));
                }
                self.added.insert(id, cluster_addr.clone());
                Change::NodeAdded { id, cluster_addr }
            }
            ClusterRecord::NodeRemoved { id } => {
                if self.removed.insert(id) {
                    Change::NodeRemoved { id }
                } else {
                    Change::Ignored(format!("node {id} was removed already"))
                }
            }
            ClusterRecord::UserChanged { change } => match self.users.changed(&change) {
                Ok(table) => {
                    self.users = Arc::new(table);
                    Change::Users {
                        table: self.users.clone(),
                    }
                }
                Err(error) => Change::Ignored(error.to_string()),
            },
            ClusterRecord::RuntimeSettingsChanged { changes } => {
                let before = self.settings.clone();
                for (key, value) in changes {
                    if value.is_null() {
                        self.settings.remove(&key);
                    } else {
                        self.settings.insert(key, value);
                    }
                }
                if self.settings == before {
                    return Change::Ignored("the cluster-wide settings are so already".into());
                }
                Change::RuntimeSettings {
                    overrides: self.settings.clone(),
                }
            }
        }
    }

    /// The nodes added to the cluster after it was formed, with their cluster addresses.
    pub fn added(&self) -> &BTreeMap<u64, String> {
        &self.added
    }

    /// The cluster's nodes: `formed` (the nodes it was formed with: the `[cluster]` peers),
    /// the added ones, less the removed ones; with their cluster addresses.
    pub fn nodes(&self, formed: &BTreeMap<u64, String>) -> BTreeMap<u64, String> {
        formed
            .iter()
            .chain(self.added.iter())
            .filter(|(id, _)| !self.removed.contains(id))
            .map(|(id, addr)| (*id, addr.clone()))
            .collect()
    }

    /// The nodes removed from the cluster.
    pub fn removed(&self) -> &BTreeSet<u64> {
        &self.removed
    }

    /// The cluster's users.
    pub fn users(&self) -> &Arc<UserTable> {
        &self.users
    }

    /// The cluster-wide runtime settings in force, by dotted key.
    pub fn runtime_settings(&self) -> &BTreeMap<String, serde_json::Value> {
        &self.settings
    }

    /// A queue by name.
    pub fn get(&self, name: &str) -> Option<&QueueEntry> {
        self.queues.get(name)
    }

    /// Every queue, by name.
    pub fn queues(&self) -> &BTreeMap<String, QueueEntry> {
        &self.queues
    }

    /// A stream by name.
    pub fn stream(&self, name: &str) -> Option<&StreamEntry> {
        self.streams.get(name)
    }

    /// Every stream, by name.
    pub fn streams(&self) -> &BTreeMap<String, StreamEntry> {
        &self.streams
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared(name: &str) -> ClusterRecord {
        ClusterRecord::QueueDeclared {
            name: name.into(),
            settings: QueueSettings::default(),
            replicas: vec![vec![1, 2, 3]],
        }
    }

    #[test]
    fn ids_are_assigned_in_log_order_and_never_reused() {
        let mut catalog = ClusterCatalog::default();
        assert!(
            matches!(catalog.apply(declared("a")), Change::Declared { entry, .. } if entry.id == 0)
        );
        assert!(matches!(catalog.apply(declared("a")), Change::Ignored(_)));
        assert!(
            matches!(catalog.apply(declared("b")), Change::Declared { entry, .. } if entry.id == 1)
        );
        let deleted = ClusterRecord::QueueDeleted { name: "a".into() };
        assert_eq!(
            catalog.apply(deleted.clone()),
            Change::Deleted { name: "a".into() }
        );
        assert!(matches!(catalog.apply(deleted), Change::Ignored(_)));
        assert!(
            matches!(catalog.apply(declared("a")), Change::Declared { entry, .. } if entry.id == 2)
        );
    }

    #[test]
    fn streams_share_the_queues_name_space_and_ids() {
        let mut catalog = ClusterCatalog::default();
        let stream = |name: &str| ClusterRecord::StreamDeclared {
            name: name.into(),
            settings: StreamSettings::default(),
            replicas: vec![2, 1, 3],
        };
        assert!(matches!(
            catalog.apply(declared("a")),
            Change::Declared { .. }
        ));
        assert!(matches!(catalog.apply(stream("a")), Change::Ignored(_)));
        assert!(
            matches!(catalog.apply(stream("s")), Change::StreamDeclared { entry, .. } if entry.id == 1)
        );
        assert!(matches!(catalog.apply(declared("s")), Change::Ignored(_)));
        assert!(matches!(catalog.apply(stream("s")), Change::Ignored(_)));
        let twice = ClusterRecord::StreamDeclared {
            name: "t".into(),
            settings: StreamSettings::default(),
            replicas: vec![1, 1],
        };
        assert!(matches!(catalog.apply(twice), Change::Ignored(_)));
        let more = StreamSettings {
            partitions: 2,
            ..StreamSettings::default()
        };
        let change = |settings| ClusterRecord::StreamSettingsChanged {
            name: "s".into(),
            settings,
        };
        assert!(matches!(catalog.apply(change(more)), Change::Ignored(_)));
        let bounded = StreamSettings {
            max_messages: Some(10),
            ..StreamSettings::default()
        };
        assert!(matches!(
            catalog.apply(change(bounded)),
            Change::StreamSettingsChanged { .. }
        ));
        assert_eq!(catalog.stream("s").map(|e| e.settings), Some(bounded));
        assert_eq!(
            catalog.apply(ClusterRecord::StreamDeleted { name: "s".into() }),
            Change::StreamDeleted { name: "s".into() }
        );
        assert!(
            matches!(catalog.apply(declared("s")), Change::Declared { entry, .. } if entry.id == 2)
        );
    }

    #[test]
    fn runtime_settings_merge_key_by_key_and_null_drops_a_key() {
        let mut catalog = ClusterCatalog::default();
        let change = |pairs: &[(&str, serde_json::Value)]| ClusterRecord::RuntimeSettingsChanged {
            changes: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        };
        let soft = ("limits.disk.soft_fraction", serde_json::json!(0.3));
        let max = ("storage.max_bytes", serde_json::json!(1_000_000));
        catalog.apply(change(std::slice::from_ref(&soft)));
        assert_eq!(
            catalog.apply(change(std::slice::from_ref(&max))),
            Change::RuntimeSettings {
                overrides: [soft.clone(), max.clone()]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect()
            },
            "a change keeps the keys it does not name"
        );
        assert!(matches!(
            catalog.apply(change(std::slice::from_ref(&max))),
            Change::Ignored(_)
        ));
        catalog.apply(change(&[(soft.0, serde_json::Value::Null)]));
        assert_eq!(
            catalog.runtime_settings().keys().collect::<Vec<_>>(),
            vec!["storage.max_bytes"]
        );
    }

    #[test]
    fn partitions_move_onto_distinct_nodes_that_were_not_removed() {
        let mut catalog = ClusterCatalog::default();
        catalog.apply(declared("a"));
        let moved = |replicas: Vec<u64>| ClusterRecord::PartitionReplicasChanged {
            name: "a".into(),
            index: 0,
            replicas,
        };
        assert!(matches!(
            catalog.apply(moved(vec![1, 2, 2])),
            Change::Ignored(_)
        ));
        assert!(matches!(catalog.apply(moved(vec![])), Change::Ignored(_)));
        assert!(matches!(
            catalog.apply(moved(vec![1, 2, 3])),
            Change::Ignored(_)
        ));
        assert_eq!(
            catalog.apply(moved(vec![1, 2, 4])),
            Change::ReplicasChanged {
                name: "a".into(),
                id: 0,
                index: 0,
                before: vec![1, 2, 3],
                replicas: vec![1, 2, 4],
            }
        );
        assert_eq!(
            catalog.get("a").map(|e| e.replicas.clone()),
            Some(vec![vec![1, 2, 4]])
        );
        let other = ClusterRecord::PartitionReplicasChanged {
            name: "a".into(),
            index: 1,
            replicas: vec![1],
        };
        assert!(matches!(catalog.apply(other), Change::Ignored(_)));
        assert_eq!(
            catalog.apply(ClusterRecord::NodeRemoved { id: 3 }),
            Change::NodeRemoved { id: 3 }
        );
        assert!(matches!(
            catalog.apply(ClusterRecord::NodeRemoved { id: 3 }),
            Change::Ignored(_)
        ));
        assert!(matches!(
            catalog.apply(moved(vec![3, 1])),
            Change::Ignored(_)
        ));
        assert!(catalog.removed().contains(&3));
        let added = |id: u64, addr: &str| ClusterRecord::NodeAdded {
            id,
            cluster_addr: addr.into(),
        };
        assert!(
            matches!(catalog.apply(added(3, "a:1")), Change::Ignored(_)),
            "removed ids stay removed"
        );
        assert!(matches!(
            catalog.apply(added(5, "e:1")),
            Change::NodeAdded { id: 5, .. }
        ));
        assert!(matches!(catalog.apply(added(5, "e:1")), Change::Ignored(_)));
        assert!(matches!(
            catalog.apply(added(5, "e:2")),
            Change::NodeAdded { id: 5, .. }
        ));
        let formed: BTreeMap<u64, String> = [(1, "a"), (2, "b"), (3, "c")]
            .map(|(i, a)| (i, a.to_string()))
            .into();
        let nodes: Vec<(u64, String)> = catalog.nodes(&formed).into_iter().collect();
        assert_eq!(
            nodes,
            vec![(1, "a".into()), (2, "b".into()), (5, "e:2".into())]
        );
    }

    #[test]
    fn settings_change_only_what_may_change() {
        let mut catalog = ClusterCatalog::default();
        catalog.apply(declared("a"));
        let limits = QueueSettings {
            max_messages: Some(10),
            ..QueueSettings::default()
        };
        let changed = ClusterRecord::QueueSettingsChanged {
            name: "a".into(),
            settings: limits.clone(),
        };
        assert!(matches!(
            catalog.apply(changed),
            Change::SettingsChanged { .. }
        ));
        assert_eq!(catalog.get("a").map(|e| &e.settings), Some(&limits));
        let more = ClusterRecord::QueueSettingsChanged {
            name: "a".into(),
            settings: QueueSettings {
                partitions: 2,
                ..limits
            },
        };
        assert!(matches!(catalog.apply(more), Change::Ignored(_)));
    }

    #[test]
    fn user_changes_apply_in_log_order_and_a_raced_one_changes_nothing() {
        let digest = keratin_auth::PasswordDigest::hash("password1").expect("hashed");
        let add = |name: &str, admin: bool| ClusterRecord::UserChanged {
            change: keratin_auth::UserChange::Add {
                name: name.into(),
                password: digest.clone(),
                admin,
            },
        };
        let mut catalog = ClusterCatalog::default();
        assert!(matches!(
            catalog.apply(add("admin", true)),
            Change::Users { .. }
        ));
        // A second node proposed the same bootstrap admin before it saw the first: ignored.
        assert!(matches!(
            catalog.apply(add("admin", true)),
            Change::Ignored(_)
        ));
        let demote = ClusterRecord::UserChanged {
            change: keratin_auth::UserChange::Admin {
                name: "admin".into(),
                admin: false,
            },
        };
        let Change::Ignored(reason) = catalog.apply(demote) else {
            panic!("the last admin went");
        };
        assert!(reason.contains("no admin"), "{reason}");
        assert!(catalog.users().is_admin("admin"));
        assert_eq!(catalog.users().len(), 1);
    }
}
