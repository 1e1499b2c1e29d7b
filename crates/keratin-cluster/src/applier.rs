//! The applier: reads the metadata group's committed records in order and applies each to the
//! node's [`ClusterCatalog`] and to its broker (declare, delete, settings of replicated
//! queues). It starts from the group's first record at every start: applying a record the
//! broker already reflects changes nothing (a declare of the same queue id, the delete of a
//! queue already gone). A broker change that fails is retried, and the records after it wait:
//! the node's queues follow the metadata in order or not at all.
//!
//! A partition that moves off this node is the exception: its replica may go only once the
//! group's voters (latest and committed) no longer name this node (its vote may be needed
//! until then), so a task waits for that and then moves the broker's partition
//! (`retire_then_move`), while the records after it apply. The broker ignores a move older than the partition's current
//! one (each move carries its record's offset as its version).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use keratin_auth::UserTable;
use keratin_broker::{Broker, BrokerError};
use keratin_raft::partition_log::{partition_group, ReplicatedLogs};
use keratin_raft::replica::MembershipError;
use tokio::sync::watch;

use crate::catalog::{Change, ClusterCatalog};
use crate::meta::MetaGroup;
use crate::records::ClusterRecord;

/// A failed broker change is tried again after this.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// A replica that moves off this node is checked for retirement this often.
const RETIRE_POLL: Duration = Duration::from_secs(2);

/// A moving replica whose group is not open here (its log is being rebuilt) is given this
/// long to open before the broker's partition moves regardless.
const NOT_OPEN_PATIENCE: Duration = Duration::from_secs(30);

/// What the applier acts with besides the broker.
#[derive(Clone)]
pub(crate) struct ApplyContext {
    /// This node's id.
    pub(crate) node_id: u64,
    /// This node's replicas (retirement of a replica that moves off, members added).
    pub(crate) logs: Arc<ReplicatedLogs>,
    /// The cluster transport (peers added).
    pub(crate) transport: keratin_net::Transport,
    /// The node directory (an added node is asked who it is).
    pub(crate) directory: crate::directory::Directory,
}

/// What the applier has applied: the catalog and how far (shared with the metadata hook).
#[derive(Debug)]
pub(crate) struct AppliedState {
    catalog: RwLock<ClusterCatalog>,
    applied: watch::Sender<u64>,
    /// The cluster-wide runtime settings as applied (the catalog's, published on change).
    runtime_settings: watch::Sender<BTreeMap<String, serde_json::Value>>,
    /// The cluster's users as applied (the catalog's, published on change).
    users: watch::Sender<Arc<UserTable>>,
}

impl AppliedState {
    pub(crate) fn new() -> AppliedState {
        AppliedState {
            catalog: RwLock::new(ClusterCatalog::default()),
            applied: watch::channel(0).0,
            runtime_settings: watch::channel(BTreeMap::new()).0,
            users: watch::channel(Arc::new(UserTable::new())).0,
        }
    }

    /// The cluster-wide runtime settings as applied here, as they change.
    pub(crate) fn runtime_settings(&self) -> watch::Receiver<BTreeMap<String, serde_json::Value>> {
        self.runtime_settings.subscribe()
    }

    /// The cluster's users as applied here, as they change.
    pub(crate) fn users(&self) -> watch::Receiver<Arc<UserTable>> {
        self.users.subscribe()
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
    ctx: ApplyContext,
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
            if let Change::ReplicasChanged {
                name,
                id,
                index,
                before,
                replicas,
            } = &change
            {
                if before.contains(&ctx.node_id) && !replicas.contains(&ctx.node_id) {
                    tokio::spawn(retire_then_move(
                        Move {
                            name: name.clone(),
                            queue_id: *id,
                            index: *index,
                            replicas: replicas.clone(),
                            version: record.offset,
                        },
                        broker.clone(),
                        ctx.clone(),
                        state.clone(),
                        stop.clone(),
                    ));
                    state.applied.send_replace(record.offset + 1);
                    continue;
                }
            }
            if let Change::NodeAdded { id, cluster_addr } = &change {
                admit(&ctx, *id, cluster_addr, &stop);
            }
            if let Change::RuntimeSettings { overrides } = &change {
                state.runtime_settings.send_replace(overrides.clone());
            }
            if let Change::Users { table } = &change {
                state.users.send_replace(table.clone());
            }
            loop {
                match act(&broker, &ctx, &change, record.offset).await {
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

/// Node `id` joined the cluster at `cluster_addr`: the transport, the partition groups and
/// the directory learn it (on the node itself, nothing to learn).
fn admit(ctx: &ApplyContext, id: u64, cluster_addr: &str, stop: &watch::Receiver<bool>) {
    if id == ctx.node_id {
        return;
    }
    let Ok(addr) = cluster_addr.parse::<std::net::SocketAddr>() else {
        tracing::error!(
            node = id,
            cluster_addr,
            "an added node's cluster address is not IP:PORT; it stays unreachable from here"
        );
        return;
    };
    if let Err(error) = ctx.transport.add_peer(id, addr) {
        tracing::error!(node = id, %error, "adding a node to this node's peers failed");
        return;
    }
    ctx.logs.add_member(id, cluster_addr.to_string());
    tokio::spawn(crate::directory::learn_peer(
        ctx.transport.clone(),
        ctx.directory.clone(),
        id,
        addr,
        stop.clone(),
    ));
    tracing::info!(node = id, %addr, "node added to the cluster");
}

/// A partition's move, as applied.
struct Move {
    name: String,
    queue_id: u64,
    index: u32,
    replicas: Vec<u64>,
    /// The record's offset.
    version: u64,
}

/// Wait until this node's replica of a partition that moved off it may go, then move the
/// broker's partition (its replica goes); see the module docs. Ends early if a later record
/// put the partition back on this node or deleted the queue.
async fn retire_then_move(
    moved: Move,
    broker: Broker,
    ctx: ApplyContext,
    state: Arc<AppliedState>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(group) = partition_group(moved.queue_id, moved.index) else {
        return;
    };
    let mut not_open_since: Option<tokio::time::Instant> = None;
    loop {
        if *stop.borrow() {
            return;
        }
        let current = state.catalog().get(&moved.name).and_then(|entry| {
            (entry.id == moved.queue_id)
                .then(|| entry.replicas.get(moved.index as usize).cloned())
                .flatten()
        });
        match current {
            Some(replicas) if !replicas.contains(&ctx.node_id) => {}
            // Deleted, or back on this node: nothing to retire.
            _ => return,
        }
        let retired = match ctx.logs.wait_retired(group, RETIRE_POLL).await {
            Ok(()) => true,
            Err(MembershipError::NotOpen { .. }) => {
                let since = *not_open_since.get_or_insert_with(tokio::time::Instant::now);
                since.elapsed() >= NOT_OPEN_PATIENCE
            }
            Err(MembershipError::StillVoter { .. }) => false,
            Err(error) => {
                tracing::warn!(queue = %moved.name, partition = moved.index, %error, "waiting for a replica that moved off this node to retire");
                false
            }
        };
        if retired {
            match broker
                .set_partition_replicas(
                    &moved.name,
                    moved.index,
                    moved.replicas.clone(),
                    moved.version,
                    ctx.node_id,
                )
                .await
            {
                Ok(()) | Err(BrokerError::NotFound(_)) => {
                    tracing::info!(queue = %moved.name, partition = moved.index, "the replica that moved off this node retired");
                    return;
                }
                Err(error) => {
                    tracing::warn!(queue = %moved.name, partition = moved.index, %error, "removing a retired replica failed; retrying");
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY_PAUSE.min(RETIRE_POLL)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Make the broker reflect one change, the record at `offset`'s.
async fn act(
    broker: &Broker,
    ctx: &ApplyContext,
    change: &Change,
    offset: u64,
) -> Result<(), BrokerError> {
    match change {
        Change::ReplicasChanged {
            name,
            index,
            replicas,
            ..
        } => match broker
            .set_partition_replicas(name, *index, replicas.clone(), offset, ctx.node_id)
            .await
        {
            Ok(()) | Err(BrokerError::NotFound(_)) => Ok(()),
            Err(error) => Err(error),
        },
        Change::NodeRemoved { .. }
        | Change::NodeAdded { .. }
        | Change::RuntimeSettings { .. }
        | Change::Users { .. } => Ok(()),
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
        Change::StreamDeclared { name, entry } => {
            let replicas = crate::groups::stream_partition_replicas(entry);
            match broker
                .declare_stream_replicated(entry.id, name, entry.settings, replicas)
                .await
            {
                Ok(_) => Ok(()),
                Err(error @ (BrokerError::Conflict { .. } | BrokerError::NameTaken { .. })) => {
                    tracing::error!(stream = %name, %error, "a queue or stream of this name exists on this node outside the cluster; delete it here to serve the cluster's stream");
                    Ok(())
                }
                Err(error) => Err(error),
            }
        }
        Change::StreamDeleted { name } => match broker.delete_stream_replicated(name).await {
            Ok(()) | Err(BrokerError::StreamNotFound(_)) => Ok(()),
            Err(error) => Err(error),
        },
        Change::StreamSettingsChanged { name, settings } => {
            match broker.set_stream_settings_replicated(name, *settings).await {
                Ok(_) | Err(BrokerError::StreamNotFound(_)) => Ok(()),
                Err(error) => Err(error),
            }
        }
        Change::Ignored(_) => Ok(()),
    }
}
