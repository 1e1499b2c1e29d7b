//! [`MetadataHook`]: the broker's [`ClusterMetadata`] on a cluster node. A declare, delete or
//! settings change becomes a record of the metadata group (proposed on its leader, wherever it
//! is), and answers once this node has applied it, so the caller's next request on this node
//! sees the queue as the cluster decided. What the catalog already says is answered at once
//! (declaring an existing queue with the same settings, deleting a missing one).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use keratin_broker::partition::log::{ClusterMetadata, MetadataFuture, PurgeFuture};
use keratin_broker::stream::StreamSettings;
use keratin_broker::{BrokerError, QueueSettings};

use crate::applier::AppliedState;
use crate::directory::Directory;
use crate::meta::MetaGroup;
use crate::placement::{eligible, name_hash, place_by_space, place_pinned};
use crate::purge::ClusterPurge;
use crate::records::ClusterRecord;

/// A metadata change answers within this (the group may be electing a leader).
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request for a queue not known on this node waits for this node's metadata to
/// catch up with the cluster's before it is answered (`catch_up`): about one election
/// (500–1,000 ms timeouts, then a vote) plus the applier opening a queue's logs; past it the
/// answer is 503 with [`CATCH_UP_RETRY_AFTER_MS`].
pub const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(2);

/// The retry hint of a request whose queue could not be checked against the cluster's
/// metadata: an election is usually over by then.
pub const CATCH_UP_RETRY_AFTER_MS: u32 = 1_000;

/// A declare refused because too few nodes are below the soft level may succeed once their
/// levels are heard again (every 10 s).
pub const PLACEMENT_RETRY_AFTER_MS: u32 = 10_000;

/// Replicas of a partition when the declare names none: `min(DEFAULT_REPLICAS, nodes)`.
pub const DEFAULT_REPLICAS: u32 = 3;

/// See the module docs.
pub(crate) struct MetadataHook {
    /// The nodes the cluster was formed with (the `[cluster]` peers), by id; the catalog adds
    /// and removes nodes.
    pub(crate) formed: std::collections::BTreeMap<u64, String>,
    /// What the nodes last said of their level and free space (placement).
    pub(crate) directory: Directory,
    pub(crate) meta: Arc<OnceLock<Arc<MetaGroup>>>,
    pub(crate) applied: Arc<AppliedState>,
    /// Purges of partitions led elsewhere go through it.
    pub(crate) purge: Arc<ClusterPurge>,
}

fn starting(queue: &str) -> BrokerError {
    BrokerError::NotLeader {
        queue: queue.to_string(),
        partition: 0,
        leader: None,
        addr: None,
    }
}

impl MetadataHook {
    /// Propose `record`, then wait until this node applied it.
    async fn change(
        meta: Option<Arc<MetaGroup>>,
        applied: Arc<AppliedState>,
        record: ClusterRecord,
    ) -> Result<(), BrokerError> {
        let Some(meta) = meta else {
            return Err(starting(record.queue()));
        };
        let offset = meta.propose(&record, METADATA_TIMEOUT).await?;
        if !applied.wait_applied(offset + 1, METADATA_TIMEOUT).await {
            return Err(BrokerError::TimedOut {
                queue: record.queue().to_string(),
                partition: 0,
                timeout_ms: METADATA_TIMEOUT.as_millis() as u64,
            });
        }
        Ok(())
    }
}

impl ClusterMetadata for MetadataHook {
    fn declare(&self, name: String, settings: QueueSettings, pinned: Vec<u64>) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        let formed = self.formed.clone();
        let directory = self.directory.clone();
        Box::pin(async move {
            let mut settings = settings;
            if !pinned.is_empty() {
                let count = pinned.len() as u32;
                match settings.replicas {
                    None => settings.replicas = Some(count),
                    Some(replicas) if replicas == count => {}
                    Some(replicas) => {
                        return Err(BrokerError::Invalid(format!(
                            "queue {name:?}: replicas = {replicas}, and {count} nodes are named \
                             ({pinned:?}); name one node per replica, or leave --replicas out"
                        )))
                    }
                }
            }
            let catalog = applied.catalog();
            if let Some(entry) = catalog.get(&name) {
                return same_or_conflict(&name, &entry.settings, &settings);
            }
            // Removed nodes take no replicas; added ones do.
            let nodes: Vec<u64> = catalog.nodes(&formed).into_keys().collect();
            if !pinned.is_empty() {
                let replicas =
                    pinned_replicas(&name, &pinned, &nodes, &directory, settings.partitions)?;
                let record = ClusterRecord::QueueDeclared {
                    name: name.clone(),
                    settings: settings.clone(),
                    replicas,
                };
                MetadataHook::change(meta, applied.clone(), record).await?;
                return match applied.catalog().get(&name) {
                    Some(entry) => same_or_conflict(&name, &entry.settings, &settings),
                    None => Err(BrokerError::Invalid(format!(
                        "queue {name:?}: the cluster did not take the declaration (deleted meanwhile?)"
                    ))),
                };
            }
            let replicas = place_replicas(
                "queue",
                &name,
                settings.partitions,
                settings.replicas,
                &nodes,
                &directory,
            )?;
            let record = ClusterRecord::QueueDeclared {
                name: name.clone(),
                settings: settings.clone(),
                replicas,
            };
            MetadataHook::change(meta, applied.clone(), record).await?;
            match applied.catalog().get(&name) {
                Some(entry) => same_or_conflict(&name, &entry.settings, &settings),
                None => Err(BrokerError::Invalid(format!(
                    "queue {name:?}: the cluster did not take the declaration (deleted meanwhile?)"
                ))),
            }
        })
    }

    fn catch_up(&self, name: String) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        Box::pin(async move {
            let unavailable = |why: String| BrokerError::MetadataUnavailable {
                queue: name.clone(),
                why,
                retry_after_ms: CATCH_UP_RETRY_AFTER_MS,
            };
            let Some(meta) = meta else {
                return Err(unavailable(
                    "the node is starting and does not serve the metadata group yet".into(),
                ));
            };
            let started = tokio::time::Instant::now();
            let committed = meta.read_index(CATCH_UP_TIMEOUT).await.map_err(|last| {
                unavailable(format!(
                    "no metadata leader confirmed the commit index within {} ms ({last})",
                    CATCH_UP_TIMEOUT.as_millis()
                ))
            })?;
            let left = CATCH_UP_TIMEOUT.saturating_sub(started.elapsed());
            if !applied.wait_applied(committed, left).await {
                return Err(unavailable(format!(
                    "this node has applied the metadata up to record {} of {committed} \
                     committed and did not catch up within {} ms",
                    applied.applied(),
                    CATCH_UP_TIMEOUT.as_millis()
                )));
            }
            Ok(())
        })
    }

    fn delete(&self, name: String) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        Box::pin(async move {
            if applied.catalog().get(&name).is_none() {
                return Err(BrokerError::NotFound(name));
            }
            let record = ClusterRecord::QueueDeleted { name };
            MetadataHook::change(meta, applied, record).await
        })
    }

    fn declare_stream(
        &self,
        name: String,
        settings: StreamSettings,
        replicas: Option<u32>,
        pinned: Vec<u64>,
    ) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        let formed = self.formed.clone();
        let directory = self.directory.clone();
        Box::pin(async move {
            let catalog = applied.catalog();
            if let Some(entry) = catalog.stream(&name) {
                return same_stream_or_conflict(&name, &entry.settings, &settings);
            }
            if catalog.get(&name).is_some() {
                return Err(BrokerError::NameTaken {
                    name,
                    kind: "queue",
                });
            }
            let nodes: Vec<u64> = catalog.nodes(&formed).into_keys().collect();
            // One replica set for the whole stream: the node leading its cursor log holds a
            // copy of every partition and serves its readers.
            let replicas = if pinned.is_empty() {
                place_replicas("stream", &name, 1, replicas, &nodes, &directory)?
            } else {
                if replicas.is_some_and(|r| r as usize != pinned.len()) {
                    return Err(BrokerError::Invalid(format!(
                        "stream {name:?}: replicas = {}, and {} nodes are named ({pinned:?}); \
                         name one node per replica, or leave --replicas out",
                        replicas.unwrap_or_default(),
                        pinned.len()
                    )));
                }
                pinned_replicas(&name, &pinned, &nodes, &directory, 1)?
            };
            let record = ClusterRecord::StreamDeclared {
                name: name.clone(),
                settings,
                replicas: replicas.into_iter().next().unwrap_or_default(),
            };
            MetadataHook::change(meta, applied.clone(), record).await?;
            match applied.catalog().stream(&name) {
                Some(entry) => same_stream_or_conflict(&name, &entry.settings, &settings),
                None => Err(BrokerError::Invalid(format!(
                    "stream {name:?}: the cluster did not take the declaration (a queue of \
                     that name, or deleted meanwhile?)"
                ))),
            }
        })
    }

    fn delete_stream(&self, name: String) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        Box::pin(async move {
            if applied.catalog().stream(&name).is_none() {
                return Err(BrokerError::StreamNotFound(name));
            }
            MetadataHook::change(meta, applied, ClusterRecord::StreamDeleted { name }).await
        })
    }

    fn purge_at(&self, name: String, index: u32, leader: u64) -> PurgeFuture {
        let purge = self.purge.clone();
        Box::pin(async move { purge.purge_at(name, index, leader).await })
    }

    fn set_stream_settings(&self, name: String, settings: StreamSettings) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        Box::pin(async move {
            if applied.catalog().stream(&name).is_none() {
                return Err(BrokerError::StreamNotFound(name));
            }
            let record = ClusterRecord::StreamSettingsChanged {
                name: name.clone(),
                settings,
            };
            MetadataHook::change(meta, applied.clone(), record).await?;
            match applied.catalog().stream(&name) {
                Some(entry) => same_stream_or_conflict(&name, &entry.settings, &settings),
                None => Err(BrokerError::StreamNotFound(name)),
            }
        })
    }

    fn set_settings(&self, name: String, settings: QueueSettings) -> MetadataFuture {
        let meta = self.meta.get().cloned();
        let applied = self.applied.clone();
        Box::pin(async move {
            if applied.catalog().get(&name).is_none() {
                return Err(BrokerError::NotFound(name));
            }
            let record = ClusterRecord::QueueSettingsChanged {
                name: name.clone(),
                settings: settings.clone(),
            };
            MetadataHook::change(meta, applied.clone(), record).await?;
            match applied.catalog().get(&name) {
                Some(entry) if entry.settings == settings => Ok(()),
                Some(entry) => Err(BrokerError::Conflict {
                    name,
                    existing: entry.settings.to_string(),
                }),
                None => Err(BrokerError::NotFound(name)),
            }
        })
    }
}

/// Replica sets for `partitions` partitions of `kind` (queue, stream) `name`, `replicas` each (`None`: the
/// default, at most the cluster's node count), on nodes below the soft level, by free space.
fn place_replicas(
    kind: &str,
    name: &str,
    partitions: u32,
    replicas: Option<u32>,
    nodes: &[u64],
    directory: &Directory,
) -> Result<Vec<Vec<u64>>, BrokerError> {
    let count = nodes.len() as u32;
    let replicas = replicas.unwrap_or(DEFAULT_REPLICAS.min(count));
    if replicas > count {
        return Err(BrokerError::Invalid(format!(
            "{kind} {name:?}: replicas = {replicas}, and the cluster has {count} nodes; declare at \
             most {count} replicas or add nodes"
        )));
    }
    let (candidates, left_out) = eligible(nodes, |id| {
        directory
            .get(id)
            .map_or((None, None), |info| (info.level, info.free_bytes))
    });
    if (candidates.len() as u32) < replicas {
        let full: Vec<String> = left_out
            .iter()
            .map(|(id, level)| format!("node {id} at {level}"))
            .collect();
        return Err(BrokerError::Limited {
            reason: "disk".into(),
            retry_after_ms: PLACEMENT_RETRY_AFTER_MS,
            message: format!(
                "{kind} {name:?}: {replicas} replicas need {replicas} nodes below the soft level, and \
                 {} of {count} are ({}); free disk or memory on those nodes, add nodes, or \
                 declare fewer replicas",
                candidates.len(),
                full.join(", ")
            ),
        });
    }
    Ok(place_by_space(
        &candidates,
        partitions,
        replicas,
        name_hash(name),
    ))
}

/// The replica sets of a queue pinned to `pinned`: each must be one of the cluster's `nodes`,
/// named once, and below the soft level (as the directory last heard).
fn pinned_replicas(
    name: &str,
    pinned: &[u64],
    nodes: &[u64],
    directory: &Directory,
    partitions: u32,
) -> Result<Vec<Vec<u64>>, BrokerError> {
    let mut seen = std::collections::BTreeSet::new();
    for id in pinned {
        if !nodes.contains(id) {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: node {id} is not one of the cluster's nodes ({nodes:?})"
            )));
        }
        if !seen.insert(*id) {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: node {id} is named twice; a partition has one replica per node"
            )));
        }
    }
    let (_, left_out) = eligible(pinned, |id| {
        directory
            .get(id)
            .map_or((None, None), |info| (info.level, info.free_bytes))
    });
    if let Some((id, level)) = left_out.first() {
        return Err(BrokerError::Limited {
            reason: "disk".into(),
            retry_after_ms: PLACEMENT_RETRY_AFTER_MS,
            message: format!(
                "queue {name:?}: node {id} is at the {level} level and takes no new replicas; \
                 free space there, name other nodes, or leave --nodes out"
            ),
        });
    }
    Ok(place_pinned(pinned, partitions))
}

fn same_or_conflict(
    name: &str,
    existing: &QueueSettings,
    wanted: &QueueSettings,
) -> Result<(), BrokerError> {
    same_or_conflict_by(name, existing, wanted, ToString::to_string)
}

fn same_stream_or_conflict(
    name: &str,
    existing: &StreamSettings,
    wanted: &StreamSettings,
) -> Result<(), BrokerError> {
    same_or_conflict_by(name, existing, wanted, |s| format!("{s:?}"))
}

/// `Ok` when the settings a name has are the ones wanted, else a conflict showing them.
fn same_or_conflict_by<S: PartialEq>(
    name: &str,
    existing: &S,
    wanted: &S,
    text: impl FnOnce(&S) -> String,
) -> Result<(), BrokerError> {
    if existing == wanted {
        Ok(())
    } else {
        Err(BrokerError::Conflict {
            name: name.to_string(),
            existing: text(existing),
        })
    }
}
