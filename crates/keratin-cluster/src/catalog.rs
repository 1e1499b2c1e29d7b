//! [`ClusterCatalog`]: what the metadata group's records say, applied in log order on every
//! node (plain data; the applier acts on each [`Change`]). Deterministic: the same records give
//! the same catalog, queue ids included, on every node.

use std::collections::BTreeMap;

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
    /// Nothing changed, and why (a declare of a name taken, a delete of a name not there: a
    /// proposer raced another; its caller sees the catalog as it is).
    Ignored(String),
}

/// See the module docs.
#[derive(Debug, Default, Clone)]
pub struct ClusterCatalog {
    queues: BTreeMap<String, QueueEntry>,
    next_id: u64,
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
        }
    }

    /// A queue by name.
    pub fn get(&self, name: &str) -> Option<&QueueEntry> {
        self.queues.get(name)
    }

    /// Every queue, by name.
    pub fn queues(&self) -> &BTreeMap<String, QueueEntry> {
        &self.queues
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
}
