//! The applier: reads the metadata group's committed records in order and applies each to the
//! node's [`ClusterCatalog`] and to its broker (declare, delete, settings of replicated
//! queues). It starts from the group's first record at every start: applying a record the
//! broker already reflects changes nothing (a declare of the same queue id, the delete of a
//! queue already gone). A broker change that fails is retried, and the records after it wait:
//! the node's queues follow the metadata in order or not at all.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use keratin_broker::{Broker, BrokerError};
use tokio::sync::watch;

use crate::catalog::{Change, ClusterCatalog};
use crate::meta::MetaGroup;
use crate::records::ClusterRecord;

/// A failed broker change is tried again after this.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// What the applier has applied: the catalog and how far (shared with the metadata hook).
#[derive(Debug)]
pub(crate) struct AppliedState {
    catalog: RwLock<ClusterCatalog>,
    applied: watch::Sender<u64>,
}

impl AppliedState {
    pub(crate) fn new() -> AppliedState {
        AppliedState {
            catalog: RwLock::new(ClusterCatalog::default()),
            applied: watch::channel(0).0,
        }
    }

    /// A copy of the catalog as applied.
    pub(crate) fn catalog(&self) -> ClusterCatalog {
        self.catalog
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until every record below `offset` is applied here, at most `timeout`.
    pub(crate) async fn wait_applied(&self, offset: u64, timeout: Duration) -> bool {
        let mut applied = self.applied.subscribe();
        tokio::time::timeout(timeout, applied.wait_for(|a| *a >= offset))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// One past the last applied record.
    pub(crate) fn applied(&self) -> u64 {
        *self.applied.borrow()
    }
}

/// Apply the group's records until `stop` turns true.
pub(crate) async fn run(
    meta: Arc<MetaGroup>,
    broker: Broker,
    state: Arc<AppliedState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut committed = meta.committed();
    let mut next = 0u64;
    loop {
        let until = *committed.borrow_and_update();
        if next >= until {
            tokio::select! {
                changed = committed.changed() => if changed.is_err() { return },
                _ = stop.changed() => return,
            }
            continue;
        }
        let reader_meta = meta.clone();
        let read = tokio::task::spawn_blocking(move || {
            let mut records = Vec::new();
            for record in reader_meta.reader(next) {
                match record {
                    Ok(record) if record.offset < until => records.push(record),
                    Ok(_) => break,
                    Err(error) => return Err(error.to_string()),
                }
            }
            Ok(records)
        })
        .await;
        let failure = match read {
            Ok(Ok(records)) => Ok(records),
            Ok(Err(error)) => Err(error),
            Err(error) => Err(error.to_string()),
        };
        let records = match failure {
            Ok(records) => records,
            Err(error) => {
                tracing::error!(%error, offset = next, "reading the metadata group's records failed; retrying");
                if pause_or_stop(&mut stop).await {
                    return;
                }
                continue;
            }
        };
        for record in records {
            let decoded = ClusterRecord::decode(record.record_type, &record.payload);
            let change = match decoded {
                Ok(decoded) => {
                    let mut catalog = state.catalog.write().unwrap_or_else(|e| e.into_inner());
                    catalog.apply(decoded)
                }
                Err(error) => {
                    tracing::error!(offset = record.offset, %error, "skipping a metadata record this node cannot read (a newer node wrote it?)");
                    Change::Ignored(error)
                }
            };
            loop {
                match act(&broker, &change).await {
                    Ok(()) => break,
                    Err(error) => {
                        tracing::warn!(offset = record.offset, ?change, %error, "applying a metadata change to this node's broker failed; retrying");
                        if pause_or_stop(&mut stop).await {
                            return;
                        }
                    }
                }
            }
            state.applied.send_replace(record.offset + 1);
        }
        // The adapter's own entries (membership, blank) in between are skipped by the reader.
        next = until;
        state.applied.send_replace(until);
    }
}

/// Sleep the retry pause; true if told to stop meanwhile.
async fn pause_or_stop(stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(RETRY_PAUSE) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

/// Make the broker reflect one change.
async fn act(broker: &Broker, change: &Change) -> Result<(), BrokerError> {
    match change {
        Change::Declared { name, entry } => {
            match broker
                .declare_replicated(
                    entry.id,
                    name,
                    entry.settings.clone(),
                    entry.replicas.clone(),
                )
                .await
            {
                Ok(_) => Ok(()),
                // A queue of that name this node declared alone, before it joined: it stays
                // as it is, and the cluster's queue is not served here. Retrying cannot help.
                Err(error @ BrokerError::Conflict { .. }) => {
                    tracing::error!(queue = %name, %error, "a queue of this name exists on this node outside the cluster; delete it here to serve the cluster's");
                    Ok(())
                }
                Err(error) => Err(error),
            }
        }
        Change::Deleted { name } => match broker.delete_replicated(name).await {
            Ok(()) | Err(BrokerError::NotFound(_)) => Ok(()),
            Err(error) => Err(error),
        },
        Change::SettingsChanged { name, settings } => {
            match broker.set_settings_replicated(name, settings.clone()).await {
                Ok(_) | Err(BrokerError::NotFound(_)) => Ok(()),
                Err(error) => Err(error),
            }
        }
        Change::Ignored(_) => Ok(()),
    }
}
