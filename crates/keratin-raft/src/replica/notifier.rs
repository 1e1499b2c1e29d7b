//! [`CommitNotifier`]: the Raft state machine of a partition replica. It holds no partition
//! state: the partition owner applies committed records by reading them from the entry log
//! (the Raft log *is* the partition log), so this state machine only tells how far the log is
//! committed and applied ([`CommitNotifier::committed`]), answers each proposal with its
//! offset, and keeps the membership openraft asks for.
//!
//! Snapshots (`docs/cluster.md`, "Partition snapshots"): the partition owner frees disk below
//! its lowest live payload (`PartitionState::pinned_offset`): every record below it is dead,
//! and the owner's state rebuilt from the records at and above it equals its state now (the
//! owner's own prefix removal on a single node rests on the same fact). It tells this state
//! machine so with [`CommitNotifier::set_floor`]; a snapshot is then the position just below
//! the floor, and carries no data: a follower that installs it holds an empty log that
//! continues at the floor, receives the records from there, and its owner rebuilds its state
//! from them. The snapshot's meta (last log id and membership) is kept durable in the group's
//! state log ([`SnapshotKeeper`]) *before* openraft learns of it, so openraft never purges
//! entries a restart could not account for. The idempotent producers' windows need no data
//! either: while a producer has one, the owner's floor is a `PRODUCERS` record holding them
//! (`keratin-broker` `partition/owner/checkpoint.rs`), the first entry after the snapshot.
//!
//! The committed watch: moved by every applied entry, and, after a snapshot install, by the
//! purge that follows it ([`crate::LogStore::watch_purges`]), so that the owner never looks
//! for entries below the new start this node never had.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::{Stream, StreamExt};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine, Snapshot};
use tokio::sync::watch;

use crate::error::RaftError;
use crate::fence::Fence;
use crate::network::SnapshotWire;
use crate::state_machine::{SnapshotMeta, StoredMembership};
use crate::store::{LogStoreReader, SnapshotKeeper};
use crate::types::{CommittedOffsets, LeaderId, LogId, NodeAddr, Payload, TypeConfig};

/// The data of a replica's snapshot: nothing beyond its meta (see the module docs): the state
/// below a snapshot holds nothing live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppliedImage;

impl SnapshotWire for AppliedImage {
    fn encode(&self, _dst: &mut Vec<u8>) -> Result<(), RaftError> {
        Ok(())
    }

    fn decode(bytes: &[u8]) -> Result<AppliedImage, RaftError> {
        if bytes.is_empty() {
            Ok(AppliedImage)
        } else {
            Err(RaftError::Invalid(format!(
                "a replica snapshot carries no data, got {} bytes",
                bytes.len()
            )))
        }
    }
}

type ReplicaSnapshot = Snapshot<LeaderId, u64, NodeAddr, AppliedImage>;

#[derive(Debug)]
struct State {
    last_applied: Option<LogId>,
    membership: StoredMembership,
    /// Memberships applied since the snapshot, and the last one at or below it, oldest first
    /// (a snapshot names the membership in force at its own index).
    memberships: Vec<StoredMembership>,
    /// The first index of each leader's run of applied entries, from the snapshot on (a
    /// snapshot's last log id names the leader of the entry at its index).
    leaders: BTreeMap<u64, LeaderId>,
    /// The partition owner's word: no record below this index is needed.
    floor: u64,
    /// The last snapshot built or installed (its meta is durable).
    snapshot: Option<SnapshotMeta>,
}

impl State {
    /// The snapshot just below the floor, if it is past the current one and its leader and
    /// membership are known.
    fn next_snapshot(&self) -> Option<SnapshotMeta> {
        let applied_next = self.last_applied.as_ref().map_or(0, |l| l.index + 1);
        let last = self.floor.min(applied_next).checked_sub(1)?;
        let current = self
            .snapshot
            .as_ref()
            .and_then(|s| s.last_log_id.as_ref())
            .map(|l| l.index);
        if current.is_some_and(|c| c >= last) {
            return None;
        }
        let (_, leader) = self.leaders.range(..=last).next_back()?;
        let membership = self
            .memberships
            .iter()
            .rev()
            .find(|m| m.log_id().as_ref().is_some_and(|id| id.index <= last))?;
        Some(SnapshotMeta {
            last_log_id: Some(LogId::new(*leader, last)),
            last_membership: membership.clone(),
        })
    }

    /// `meta` is the snapshot now: forget what lies below it but the entries that name its
    /// leader and membership.
    fn taken(&mut self, meta: SnapshotMeta) {
        if let Some(last) = meta.last_log_id.as_ref() {
            let kept = self.leaders.split_off(&(last.index + 1));
            self.leaders = kept;
            self.leaders.insert(last.index, last.leader_id);
            self.memberships
                .retain(|m| m.log_id().as_ref().is_none_or(|id| id.index > last.index));
            self.memberships.insert(0, meta.last_membership.clone());
        }
        self.snapshot = Some(meta);
    }
}

/// See the module docs. Cheap to clone; clones share the state.
#[derive(Debug, Clone)]
pub struct CommitNotifier {
    state: Arc<Mutex<State>>,
    /// One past the last applied index (0: nothing applied).
    applied: Arc<watch::Sender<u64>>,
    fence: Fence,
    keeper: SnapshotKeeper,
    view: LogStoreReader,
}

impl CommitNotifier {
    /// A notifier that has applied nothing, whose snapshot is the one `keeper` holds (read at
    /// open: openraft installs it at start); `view` is the group's log view.
    pub async fn new(fence: Fence, keeper: SnapshotKeeper, view: LogStoreReader) -> CommitNotifier {
        let snapshot = keeper.current().await;
        CommitNotifier {
            state: Arc::new(Mutex::new(State {
                last_applied: None,
                membership: StoredMembership::default(),
                memberships: Vec::new(),
                leaders: BTreeMap::new(),
                floor: 0,
                snapshot,
            })),
            applied: Arc::new(watch::Sender::new(0)),
            fence,
            keeper,
            view,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One past the last committed and applied index, as it moves. Every record below it is
    /// committed on a majority and durable on this node (or below this node's log start).
    pub fn committed(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// The sender behind [`CommitNotifier::committed`], for the log store's purges.
    pub(crate) fn committed_sender(&self) -> Arc<watch::Sender<u64>> {
        self.applied.clone()
    }

    /// The membership last applied.
    pub fn membership(&self) -> StoredMembership {
        self.lock().membership.clone()
    }

    /// The partition owner needs no record below `floor` (see the module docs). Never moves
    /// back.
    pub fn set_floor(&self, floor: u64) {
        let mut state = self.lock();
        state.floor = state.floor.max(floor);
    }

    /// The last snapshot's index, if any.
    pub fn snapshot_index(&self) -> Option<u64> {
        self.lock()
            .snapshot
            .as_ref()
            .and_then(|s| s.last_log_id.as_ref())
            .map(|l| l.index)
    }

    fn current_snapshot(&self) -> Option<ReplicaSnapshot> {
        self.lock().snapshot.clone().map(|meta| Snapshot {
            meta,
            snapshot: AppliedImage,
        })
    }

    /// Build the snapshot below the floor: its meta made durable first. Without one (nothing
    /// new, or keeping it failed: the fence trips) the current one, or an empty meta that
    /// openraft ignores; never a storage error (openraft treats those as fatal).
    async fn build(&self) -> ReplicaSnapshot {
        let next = self.lock().next_snapshot();
        if let Some(meta) = next {
            match self.keeper.save(meta.clone()).await {
                Ok(()) => {
                    self.lock().taken(meta);
                }
                Err(error) => self.fence.trip(RaftError::log("keep the snapshot", error)),
            }
        }
        self.current_snapshot().unwrap_or_else(|| Snapshot {
            meta: SnapshotMeta::default(),
            snapshot: AppliedImage,
        })
    }
}

/// Builds a replica's snapshot: the position below the owner's floor (see the module docs).
#[derive(Debug)]
pub struct NotifierSnapshotBuilder {
    notifier: CommitNotifier,
}

impl RaftSnapshotBuilder<TypeConfig> for NotifierSnapshotBuilder {
    type SnapshotData = AppliedImage;

    async fn build_snapshot(&mut self) -> Result<ReplicaSnapshot, io::Error> {
        Ok(self.notifier.build().await)
    }
}

impl RaftStateMachine<TypeConfig> for CommitNotifier {
    type SnapshotData = AppliedImage;
    type SnapshotBuilder = NotifierSnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let state = self.lock();
        Ok((state.last_applied, state.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + Send,
    {
        let mut applied_next = None;
        while let Some(item) = entries.next().await {
            let (entry, responder) = item?;
            let index = entry.log_id.index;
            applied_next = Some(index + 1);
            {
                let mut state = self.lock();
                if let Payload::Membership(membership) = entry.payload {
                    state.membership = StoredMembership::new(Some(entry.log_id), membership);
                    let applied = state.membership.clone();
                    state.memberships.push(applied);
                }
                if state.leaders.last_key_value().map(|(_, l)| l) != Some(&entry.log_id.leader_id) {
                    state.leaders.insert(index, entry.log_id.leader_id);
                }
                assert!(
                    state.last_applied.is_none_or(|last| last.index < index),
                    "entries apply in index order: {index} after {:?}",
                    state.last_applied
                );
                state.last_applied = Some(entry.log_id);
            }
            self.applied.send_replace(index + 1);
            if let Some(responder) = responder {
                responder.send(CommittedOffsets {
                    offsets: index..index + 1,
                });
            }
        }
        if let Some(next) = applied_next {
            self.view.release_applied(next);
        }
        Ok(())
    }

    async fn try_create_snapshot_builder(
        &mut self,
        force: bool,
    ) -> Option<NotifierSnapshotBuilder> {
        // Nothing to build unless the floor moved past the last snapshot (or openraft insists:
        // it is then given the current one).
        if !force && self.lock().next_snapshot().is_none() {
            return None;
        }
        Some(NotifierSnapshotBuilder {
            notifier: self.clone(),
        })
    }

    async fn get_snapshot_builder(&mut self) -> NotifierSnapshotBuilder {
        NotifierSnapshotBuilder {
            notifier: self.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        _snapshot: AppliedImage,
    ) -> Result<(), io::Error> {
        let Some(last) = meta.last_log_id else {
            return Ok(());
        };
        // At start openraft installs the kept snapshot again: nothing to keep then.
        let kept = self.lock().snapshot.as_ref() == Some(meta);
        if !kept {
            if let Err(error) = self.keeper.save(meta.clone()).await {
                self.fence
                    .trip(RaftError::log("keep the snapshot from the leader", error));
                return Ok(());
            }
        }
        {
            let mut state = self.lock();
            state.last_applied = Some(last);
            state.membership = meta.last_membership.clone();
            state.memberships.clear();
            state.leaders.clear();
            state.floor = state.floor.max(last.index + 1);
            state.taken(meta.clone());
        }
        // The owner may look past the snapshot once the log has its start there (at start,
        // it has; after an install from the leader, the purge that follows raises the watch).
        if self.view.floor() > last.index {
            self.applied.send_if_modified(|applied| {
                let raise = *applied <= last.index;
                if raise {
                    *applied = last.index + 1;
                }
                raise
            });
        }
        tracing::info!(snapshot = last.index, "snapshot installed");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<ReplicaSnapshot>, io::Error> {
        Ok(self.current_snapshot())
    }
}
