//! The sending side: openraft's `RaftNetworkFactory` / `RaftNetworkV2` for one group over the
//! node's `keratin-net` [`Transport`] (one connection per node pair, shared by every group).
//!
//! Heartbeats (openraft's heartbeat clients) go through [`Transport::heartbeat`], coalesced with
//! every other group's heartbeats to the same node into one frame per tick; appends with
//! entries, votes, snapshots and leadership transfers are [`Transport::call`]s. Every transport failure — no
//! connection, a timeout, a refusal (a follower fenced or without room) — reaches openraft as
//! `Unreachable`, never as a storage error, and openraft backs off and retries. A fenced group
//! sends nothing and drops replies that arrive after it tripped (`crate::Fence`).
//!
//! Addressing (`docs/cluster.md`, "Storage identities"). Every request names the copy of the
//! group's storage the sender's membership records for the target: the latest membership this
//! replica holds ([`Addressing`], read from openraft's metrics at each send, so that a copy
//! recorded or replaced since a stream started is addressed as it is now), else the node
//! openraft named when it made the client. A replica whose own latest membership records
//! another copy for itself sends no vote request: it is not the copy the group counts on, and
//! must not campaign until it has been replaced.
//!
//! Non-contiguous appends. An append whose first entry does not follow its previous log id by
//! one is refused here, as unreachable (the stream's session ends and openraft starts again
//! from the follower's position), and by the receiver's decoder: a log is never filled around
//! a hole. A stale stream's reads start at the purge point (`crate::store`), so its entries can
//! begin past the entry after its previous log id.
//!
//! Stale streams. openraft 0.10.0-alpha.37 can leave a replication stream working on a payload
//! the leader's core has given up: a heartbeat finds a follower's log reverted (its data
//! directory was wiped), the core resets that follower's progress, which lets the purge it had
//! postponed go ahead, and sends the snapshot; the stream meanwhile still sends "entries since
//! X" with X below the new purge point. The follower, which installed the snapshot, accepts
//! X as matched; the stream's reads of the purged entries come back empty (openraft then sends
//! the append without entries, "as a heartbeat"), and since there is always a later entry to
//! send, the stream never looks for the core's new command: the follower receives nothing
//! more, for good (issue 14's cluster test, round 5). So a client that knows its group's log
//! (`NetworkFactory::with_log_view`) refuses an append without entries whose next entry lies
//! below this node's log start, as unreachable: the stream's session ends, the core resets the
//! follower's progress on the error and sends from the follower's real position.

use std::collections::BTreeMap;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use bytes::Bytes;
use keratin_net::{GroupId, NetError, Transport};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::errors::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use openraft::storage::Snapshot;
use openraft::type_config::alias::WatchReceiverOf;
use openraft::{OptionalSend, RaftMetrics};

use super::parts;
use super::rpc::{self, SnapshotWire};
use crate::error::RaftError;
use crate::fence::Fence;
use crate::store::LogStoreReader;
use crate::types::{LeaderId, NodeAddr, StorageId, TypeConfig, Vote};

/// Which copy of each member's storage this replica addresses, and which copy it is itself
/// (module docs, "Addressing"). Made before the group's `Raft`, given its metrics once it runs.
pub struct Addressing {
    own: StorageId,
    metrics: OnceLock<WatchReceiverOf<TypeConfig, RaftMetrics<TypeConfig>>>,
    /// The copies this replica's storage probes found on members its membership does not
    /// record yet, each holding at least what this replica knew it acknowledged (one entry per
    /// member of the group: bounded by the membership).
    probed: Mutex<BTreeMap<u64, StorageId>>,
}

impl std::fmt::Debug for Addressing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Addressing")
            .field("own", &self.own)
            .field("following", &self.metrics.get().is_some())
            .field("probed", &*lock(&self.probed))
            .finish()
    }
}

impl Addressing {
    /// The addressing of a replica whose copy is `own`.
    pub fn new(own: StorageId) -> Addressing {
        Addressing {
            own,
            metrics: OnceLock::new(),
            probed: Mutex::new(BTreeMap::new()),
        }
    }

    /// Address member `target`'s copy `storage` while the membership records none for it: the
    /// leader's storage probe found it holding at least what the leader knew it acknowledged
    /// (`replica::copies`, "Recording"). A replica that holds no membership yet (it joined the
    /// group after it formed) answers only requests addressed to its copy, and the leader may
    /// need its acknowledgements to commit the entry that records it: with another voter
    /// down, its lease and every commit do.
    pub(crate) fn probed(&self, target: u64, storage: StorageId) {
        lock(&self.probed).insert(target, storage);
    }

    /// Read the memberships from `metrics` (the group's `Raft::metrics`) from now on.
    pub fn follow(&self, metrics: WatchReceiverOf<TypeConfig, RaftMetrics<TypeConfig>>) {
        let _ = self.metrics.set(metrics);
    }

    /// The copy to address on `target`: as the latest membership records it, else as `node`
    /// (openraft's when the client was made) does, else the copy a storage probe found.
    fn target_storage(&self, target: u64, node: &NodeAddr) -> Option<StorageId> {
        let recorded = match self.metrics.get() {
            None => node.storage,
            Some(metrics) => {
                let metrics = metrics.borrow_watched();
                match metrics.membership_config.membership().get_node(&target) {
                    Some(recorded) => recorded.storage,
                    None => node.storage,
                }
            }
        };
        recorded.or_else(|| lock(&self.probed).get(&target).copied())
    }

    /// Why this replica must not campaign, if its latest membership records another copy for
    /// it.
    fn campaign_refused(&self) -> Option<String> {
        let metrics = self.metrics.get()?;
        let metrics = metrics.borrow_watched();
        let recorded = metrics
            .membership_config
            .membership()
            .get_node(&metrics.id)?
            .storage?;
        (recorded != self.own).then(|| {
            format!(
                "this node's copy {} of the group is not the copy {recorded} its membership \
                 counts on: it does not campaign until the leader replaces that copy with it",
                self.own
            )
        })
    }
}

/// Builds the group's connections to its peers (one [`GroupNetwork`] per target; openraft
/// asks for separate heartbeat and snapshot clients).
#[derive(Debug)]
pub struct NetworkFactory<D> {
    transport: Transport,
    group: GroupId,
    fence: Fence,
    view: Option<LogStoreReader>,
    addressing: Option<Arc<Addressing>>,
    _data: PhantomData<fn() -> D>,
}

impl<D> NetworkFactory<D> {
    /// The network of `group` over `transport`; `fence` is the group's storage fence.
    pub fn new(transport: Transport, group: GroupId, fence: Fence) -> NetworkFactory<D> {
        NetworkFactory {
            transport,
            group,
            fence,
            view: None,
            addressing: None,
            _data: PhantomData,
        }
    }

    /// Address each target's copy as the replica's latest membership records it, and send no
    /// vote request while that membership records another copy for this node (module docs,
    /// "Addressing"). Without it, targets are addressed as openraft named them.
    pub fn with_addressing(mut self, addressing: Arc<Addressing>) -> NetworkFactory<D> {
        self.addressing = Some(addressing);
        self
    }

    /// Refuse the appends of stale replication streams, which start below the start of the
    /// group's log `view` (module docs, "Stale streams").
    pub fn with_log_view(mut self, view: LogStoreReader) -> NetworkFactory<D> {
        self.view = Some(view);
        self
    }

    fn client(&self, target: u64, node: &NodeAddr, heartbeats: bool) -> GroupNetwork<D> {
        GroupNetwork {
            transport: self.transport.clone(),
            group: self.group,
            target,
            node: node.clone(),
            fence: self.fence.clone(),
            view: self.view.clone(),
            addressing: self.addressing.clone(),
            heartbeats,
            _data: PhantomData,
        }
    }
}

impl<D: SnapshotWire + Sync> RaftNetworkFactory<TypeConfig> for NetworkFactory<D> {
    type Network = GroupNetwork<D>;

    async fn new_client(&mut self, target: u64, node: &NodeAddr) -> GroupNetwork<D> {
        self.client(target, node, false)
    }

    async fn new_heartbeat_client(&mut self, target: u64, node: &NodeAddr) -> GroupNetwork<D> {
        self.client(target, node, true)
    }
}

/// One group's connection to one peer.
#[derive(Debug)]
pub struct GroupNetwork<D> {
    transport: Transport,
    group: GroupId,
    target: u64,
    /// The target as openraft named it when it made this client.
    node: NodeAddr,
    fence: Fence,
    /// The group's log, for refusing stale streams (module docs).
    view: Option<LogStoreReader>,
    addressing: Option<Arc<Addressing>>,
    /// Empty appends go coalesced (openraft's heartbeat client).
    heartbeats: bool,
    _data: PhantomData<fn() -> D>,
}

fn unreachable(error: &(impl std::error::Error + 'static)) -> Unreachable<TypeConfig> {
    Unreachable::new(error)
}

impl<D> GroupNetwork<D> {
    /// The copy of the target's storage to address (module docs, "Addressing").
    fn to(&self) -> Option<StorageId> {
        match &self.addressing {
            Some(addressing) => addressing.target_storage(self.target, &self.node),
            None => self.node.storage,
        }
    }

    /// Refuses a vote request of a replica that is not the copy its membership counts on.
    fn check_campaign(&self) -> Result<(), Unreachable<TypeConfig>> {
        match self.addressing.as_ref().and_then(|a| a.campaign_refused()) {
            Some(reason) => Err(unreachable(&RaftError::Invalid(reason))),
            None => Ok(()),
        }
    }

    /// An append whose first entry does not follow its previous log id (module docs,
    /// "Non-contiguous appends").
    fn check_contiguous(
        rpc: &AppendEntriesRequest<TypeConfig>,
    ) -> Result<(), Unreachable<TypeConfig>> {
        let Some(first) = rpc.entries.first() else {
            return Ok(());
        };
        let next = rpc.prev_log_id.as_ref().map_or(0, |prev| prev.index + 1);
        if first.log_id.index != next {
            return Err(unreachable(&RaftError::NotContiguous {
                first: first.log_id.index,
                next,
            }));
        }
        Ok(())
    }

    /// An append without entries from a replication stream whose next entry this node purged
    /// (module docs, "Stale streams").
    fn check_stale(
        &self,
        rpc: &AppendEntriesRequest<TypeConfig>,
    ) -> Result<(), Unreachable<TypeConfig>> {
        let Some(view) = self.view.as_ref() else {
            return Ok(());
        };
        if self.heartbeats || !rpc.entries.is_empty() {
            return Ok(());
        }
        let next = rpc.prev_log_id.as_ref().map_or(0, |prev| prev.index + 1);
        let floor = view.floor();
        if next < floor {
            return Err(unreachable(&RaftError::Purged { next, floor }));
        }
        Ok(())
    }

    fn check_fence(&self) -> Result<(), Unreachable<TypeConfig>> {
        match self.fence.reason() {
            Some(reason) => Err(unreachable(&reason)),
            None => Ok(()),
        }
    }

    /// Sends `body` as `kind` (or as a coalesced heartbeat) and returns the reply, unless the
    /// group's fence tripped before the reply arrived.
    async fn send(
        &self,
        kind: u8,
        body: Vec<u8>,
        option: &RPCOption,
        coalesce: bool,
    ) -> Result<Bytes, Unreachable<TypeConfig>> {
        self.check_fence()?;
        let ttl = option.hard_ttl();
        let body = Bytes::from(body);
        let reply = if coalesce {
            self.transport
                .heartbeat(self.target, self.group, body, ttl)
                .await
        } else {
            self.transport
                .call(self.target, self.group, kind, body, ttl)
                .await
        };
        let reply = reply.map_err(|error: NetError| unreachable(&error))?;
        self.check_fence()?;
        Ok(reply)
    }
}

impl<D> GroupNetwork<D> {
    async fn send_append(
        &self,
        rpc: &AppendEntriesRequest<TypeConfig>,
        option: &RPCOption,
        coalesce: bool,
    ) -> Result<AppendEntriesResponse<TypeConfig>, Unreachable<TypeConfig>> {
        let body = decoded(rpc::encode_append(rpc, self.to()))?;
        let reply = self.send(rpc::KIND_APPEND, body, option, coalesce).await?;
        decoded(rpc::decode_append_reply(&reply))
    }
}

fn decoded<T>(result: Result<T, RaftError>) -> Result<T, Unreachable<TypeConfig>> {
    // A reply that does not decode comes from a node of another version or a broken one: treat
    // it as unreachable (openraft retries later), never as a storage error.
    result.map_err(|error| unreachable(&error))
}

impl<D: SnapshotWire + Sync> RaftNetworkV2<TypeConfig> for GroupNetwork<D> {
    type SnapshotData = D;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.check_stale(&rpc)?;
        Self::check_contiguous(&rpc)?;
        let coalesce = self.heartbeats && rpc.entries.is_empty();
        let mut parts = parts::split(rpc, parts::APPEND_PART_BYTES);
        if parts.len() == 1 {
            let rpc = parts.pop().expect("one part");
            return Ok(self.send_append(&rpc, &option, coalesce).await?);
        }
        // Too large for one body ("Large appends" in `parts`): one part after the other.
        let mut combined = parts::Combined::default();
        for part in parts {
            let last = part.entries.last().map(|entry| entry.log_id);
            let reply = self.send_append(&part, &option, false).await?;
            if let Some(answer) = combined.reply(reply, last) {
                return Ok(answer);
            }
        }
        Ok(combined.done())
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.check_campaign()?;
        let body = rpc::encode_vote(&rpc, self.to());
        let reply = self.send(rpc::KIND_VOTE, body, &option, false).await?;
        Ok(decoded(rpc::decode_vote_reply(&reply))?)
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.check_campaign()?;
        let body = rpc::encode_vote(&rpc, self.to());
        let reply = self.send(rpc::KIND_PRE_VOTE, body, &option, false).await?;
        Ok(decoded(rpc::decode_vote_reply(&reply))?)
    }

    async fn transfer_leader(
        &mut self,
        rpc: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        let body = rpc::encode_transfer_leader(&rpc, self.to());
        let reply = self
            .send(rpc::KIND_TRANSFER_LEADER, body, &option, false)
            .await?;
        Ok(decoded(rpc::decode_transfer_leader_reply(&reply))?)
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot<LeaderId, u64, NodeAddr, D>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let body = decoded(rpc::encode_snapshot(
            &vote,
            &snapshot.meta,
            &snapshot.snapshot,
            self.to(),
        ))?;
        let send = self.send(rpc::KIND_SNAPSHOT, body, &option, false);
        let reply = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            reply = send => reply?,
        };
        let vote = decoded(rpc::decode_snapshot_reply(&reply))?;
        Ok(SnapshotResponse::new(vote))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
