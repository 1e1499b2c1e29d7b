//! The receiving side: [`Groups`], the node's `keratin-net` [`Handler`], routes each request
//! and each coalesced heartbeat to the `Raft` instance of its group.
//!
//! A group that is not here (not created yet on this node, or being rebuilt after its log
//! failed) and a group whose fence tripped answer with a refusal the sender sees as
//! `Unreachable`, so openraft retries; a reply computed while the fence tripped is dropped,
//! because openraft may have acted on a vote or entry that is not on disk (`crate::Fence`).
//!
//! Storage identities (`docs/cluster.md`, "Storage identities"). Every request names the copy
//! of the group's storage its sender's membership records for this node. A copy answers only
//! what is addressed to it: a request for another copy (the one this node held before its
//! directory was wiped) is refused with [`codes::OTHER_STORAGE`], so the sender sees the node
//! as unreachable: the empty copy neither votes nor acknowledges entries as the one that
//! voted and stored them. A request that names no copy (the membership has not recorded this
//! node's yet) is answered only by a replica whose log holds a membership ([`codes::NOT_MEMBER`]
//! otherwise): a replica that formed the group answers its first leader, an empty one waits
//! until a leader records it. The storage probe ([`rpc::KIND_STORAGE`]) is answered by any
//! copy.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use futures_util::future::join_all;
use keratin_net::handler::BoxFuture;
use keratin_net::{GroupId, Handler, NodeId, RemoteError};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::storage::{RaftStateMachine, Snapshot};

use super::codes;
use super::rpc::{self, SnapshotWire};
use crate::error::RaftError;
use crate::fence::Fence;
use crate::types::{StorageId, TypeConfig};

/// One group as the server reaches it: serve a request of `kind`.
pub trait GroupEndpoint: Send + Sync + 'static {
    /// Serves one request; the reply body or a refusal.
    fn serve(&self, kind: u8, body: Bytes) -> BoxFuture<Result<Bytes, RemoteError>>;
}

/// A group's `Raft`, its fence and its copy's storage identity, served over the network.
pub struct RaftEndpoint<SM: RaftStateMachine<TypeConfig>> {
    raft: openraft::Raft<TypeConfig, SM>,
    fence: Fence,
    storage: StorageId,
}

impl<SM: RaftStateMachine<TypeConfig>> RaftEndpoint<SM> {
    /// Serve `raft`, whose storage (the copy `storage`) trips `fence`.
    pub fn new(
        raft: openraft::Raft<TypeConfig, SM>,
        fence: Fence,
        storage: StorageId,
    ) -> RaftEndpoint<SM> {
        RaftEndpoint {
            raft,
            fence,
            storage,
        }
    }
}

/// What this replica's log holds now, for a storage probe.
fn copy_status<SM: RaftStateMachine<TypeConfig>>(
    raft: &openraft::Raft<TypeConfig, SM>,
    storage: StorageId,
) -> rpc::CopyStatus {
    let watched = raft.metrics();
    let metrics = watched.borrow_watched();
    rpc::CopyStatus {
        storage,
        member: metrics.membership_config.log_id().is_some(),
        last_index: metrics.last_log_index,
    }
}

/// Refuses a request addressed to another copy than `storage`, or to no copy while this
/// replica's log holds no membership (module docs).
fn check_addressed<SM: RaftStateMachine<TypeConfig>>(
    raft: &openraft::Raft<TypeConfig, SM>,
    storage: StorageId,
    body: &Bytes,
) -> Result<(), RemoteError> {
    match rpc::addressed_to(body).map_err(bad_body)? {
        Some(to) if to == storage => Ok(()),
        Some(to) => Err(RemoteError::new(
            codes::OTHER_STORAGE,
            format!(
                "this node's copy of the group is {storage}, not the copy {to} the request is \
                 for (its storage was replaced): it answers once the group's leader has \
                 replaced the old copy with it"
            ),
        )),
        None if copy_status(raft, storage).member => Ok(()),
        None => Err(RemoteError::new(
            codes::NOT_MEMBER,
            format!(
                "this node's copy {storage} of the group holds no membership yet: it answers \
                 requests addressed to it once the group's leader has recorded it"
            ),
        )),
    }
}

fn bad_body(error: RaftError) -> RemoteError {
    RemoteError::new(codes::BAD_BODY, error.to_string())
}

fn raft_refused(error: impl std::fmt::Display) -> RemoteError {
    RemoteError::new(codes::RAFT, error.to_string())
}

impl<SM> GroupEndpoint for RaftEndpoint<SM>
where
    SM: RaftStateMachine<TypeConfig>,
    SM::SnapshotData: SnapshotWire,
{
    fn serve(&self, kind: u8, body: Bytes) -> BoxFuture<Result<Bytes, RemoteError>> {
        let raft = self.raft.clone();
        let fence = self.fence.clone();
        let storage = self.storage;
        Box::pin(async move {
            if let Some(reason) = fence.reason() {
                return Err(RemoteError::new(codes::FENCED, reason.to_string()));
            }
            if kind == rpc::KIND_STORAGE {
                let status = copy_status(&raft, storage);
                return Ok(Bytes::from(rpc::encode_storage_reply(&status)));
            }
            check_addressed(&raft, storage, &body)?;
            let reply = serve_kind(&raft, kind, &body).await?;
            // Acted on while the storage failed: the reply may rest on a vote or entry that is
            // not durable. Drop it.
            if let Some(reason) = fence.reason() {
                return Err(RemoteError::new(codes::FENCED, reason.to_string()));
            }
            Ok(Bytes::from(reply))
        })
    }
}

async fn serve_kind<SM>(
    raft: &openraft::Raft<TypeConfig, SM>,
    kind: u8,
    body: &Bytes,
) -> Result<Vec<u8>, RemoteError>
where
    SM: RaftStateMachine<TypeConfig>,
    SM::SnapshotData: SnapshotWire,
{
    match kind {
        rpc::KIND_APPEND => {
            // The entries keep slices of the received body instead of copies.
            let request = rpc::decode_append_shared(body).map_err(bad_body)?;
            let reply = raft.append_entries(request).await.map_err(raft_refused)?;
            Ok(rpc::encode_append_reply(&reply))
        }
        rpc::KIND_VOTE => {
            let request = rpc::decode_vote(body).map_err(bad_body)?;
            let reply = raft.vote(request).await.map_err(raft_refused)?;
            Ok(rpc::encode_vote_reply(&reply))
        }
        rpc::KIND_PRE_VOTE => {
            let request = rpc::decode_vote(body).map_err(bad_body)?;
            let reply = raft.pre_vote(request).await.map_err(raft_refused)?;
            Ok(rpc::encode_vote_reply(&reply))
        }
        rpc::KIND_SNAPSHOT => {
            let (vote, meta, data) =
                rpc::decode_snapshot::<SM::SnapshotData>(body).map_err(bad_body)?;
            let snapshot = Snapshot {
                meta,
                snapshot: data,
            };
            let reply = raft
                .install_full_snapshot(vote, snapshot)
                .await
                .map_err(raft_refused)?;
            Ok(rpc::encode_snapshot_reply(&reply.vote))
        }
        rpc::KIND_TRANSFER_LEADER => {
            let request = rpc::decode_transfer_leader(body).map_err(bad_body)?;
            let reply = raft
                .handle_transfer_leader(request)
                .await
                .map_err(raft_refused)?;
            Ok(rpc::encode_transfer_leader_reply(&reply))
        }
        other => Err(RemoteError::new(
            codes::UNKNOWN_KIND,
            format!("request kind {other} is not a Raft request this node knows"),
        )),
    }
}

/// What receives the node labels peers send (`Groups::on_label`).
pub type LabelSink = Arc<dyn Fn(NodeId, Bytes) + Send + Sync>;

/// The groups this node serves, by id: the node's [`Handler`] for `keratin-net`. Node labels
/// go to the sink the cluster layer set, not to any group.
#[derive(Default)]
pub struct Groups {
    groups: RwLock<HashMap<u64, Arc<dyn GroupEndpoint>>>,
    label_sink: RwLock<Option<LabelSink>>,
    /// Set while the node's storage is at reserve: why partition groups' appends with entries
    /// are refused (`Groups::refuse_appends`).
    append_refusal: RwLock<Option<String>>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("count", &self.read().len())
            .finish()
    }
}

impl Groups {
    /// No group yet.
    pub fn new() -> Groups {
        Groups::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u64, Arc<dyn GroupEndpoint>>> {
        self.groups.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Serve `group` with `endpoint` from now on (replacing a previous one: a rebuilt group).
    pub fn insert(&self, group: GroupId, endpoint: Arc<dyn GroupEndpoint>) {
        self.groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(group.0, endpoint);
    }

    /// Hand every node label a peer sends to `sink` from now on (it must not block).
    pub fn on_label(&self, sink: LabelSink) {
        *self.label_sink.write().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    /// While `reason` is set (the node's storage is at its reserve level), refuse every append
    /// that carries entries to a partition group with [`codes::NO_ROOM`]: replication catch-up
    /// stops at reserve, and the follower leaves the in-sync sets as after a fault. Heartbeats,
    /// votes, snapshot installs (a partition's snapshot carries no data) and the metadata group (group 0) are still served, so no
    /// election starts and the cluster's metadata keeps working. `None` lifts it.
    pub fn refuse_appends(&self, reason: Option<String>) {
        *self
            .append_refusal
            .write()
            .unwrap_or_else(|e| e.into_inner()) = reason;
    }

    /// Why an append of `body` to `group` is refused now, if it is.
    fn append_refused(&self, group: GroupId, kind: u8, body: &Bytes) -> Option<RemoteError> {
        if kind != rpc::KIND_APPEND || group.0 == 0 {
            return None;
        }
        let reason = self
            .append_refusal
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        // Only at reserve does the body get looked at: a heartbeat (no entries) passes.
        let carries_entries = rpc::decode_append_shared(body).is_ok_and(|r| !r.entries.is_empty());
        carries_entries.then(|| RemoteError::new(codes::NO_ROOM, reason))
    }

    /// Stop serving `group` (it is being rebuilt, or was deleted).
    pub fn remove(&self, group: GroupId) {
        self.groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&group.0);
    }

    fn get(&self, group: GroupId) -> Result<Arc<dyn GroupEndpoint>, RemoteError> {
        self.read().get(&group.0).cloned().ok_or_else(|| {
            RemoteError::new(
                codes::NO_GROUP,
                format!("group {} is not served on this node (yet)", group.0),
            )
        })
    }
}

impl Handler for Groups {
    fn call(
        &self,
        _from: NodeId,
        group: GroupId,
        kind: u8,
        body: Bytes,
    ) -> BoxFuture<Result<Bytes, RemoteError>> {
        if let Some(refusal) = self.append_refused(group, kind, &body) {
            return Box::pin(std::future::ready(Err(refusal)));
        }
        match self.get(group) {
            Ok(endpoint) => endpoint.serve(kind, body),
            Err(error) => Box::pin(std::future::ready(Err(error))),
        }
    }

    fn heartbeats(
        &self,
        _from: NodeId,
        batch: Vec<(GroupId, Bytes)>,
    ) -> BoxFuture<Vec<(GroupId, Result<Bytes, RemoteError>)>> {
        let served: Vec<_> = batch
            .into_iter()
            .map(|(group, body)| {
                let endpoint = match self.append_refused(group, rpc::KIND_APPEND, &body) {
                    Some(refusal) => Err(refusal),
                    None => self.get(group),
                };
                async move {
                    let reply = match endpoint {
                        Ok(endpoint) => endpoint.serve(rpc::KIND_APPEND, body).await,
                        Err(error) => Err(error),
                    };
                    (group, reply)
                }
            })
            .collect();
        Box::pin(join_all(served))
    }

    fn label(&self, from: NodeId, label: Bytes) {
        let sink = self
            .label_sink
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(sink) = sink {
            sink(from, label);
        }
    }
}
