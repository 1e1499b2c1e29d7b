//! [`CommitNotifier`]: the Raft state machine of a partition replica. It holds no partition
//! state: the partition owner applies committed records by reading them from the entry log
//! (the Raft log *is* the partition log), so this state machine only tells how far the log is
//! committed and applied ([`CommitNotifier::committed`]), answers each proposal with its
//! offset, and keeps the membership openraft asks for.
//!
//! Snapshots: a partition snapshot (segment files below its index plus the queue state) is not
//! built yet, so replicas run with `SnapshotPolicy::Never` and openraft never purges entries a
//! follower may still need; this state machine's snapshot is its applied position only. A
//! snapshot install would leave records unreadable on this replica, so it trips the group's
//! fence instead of taking effect (never a storage error; the group is rebuilt from its log).

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::{Stream, StreamExt};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine, Snapshot};
use tokio::sync::watch;

use crate::error::RaftError;
use crate::fence::Fence;
use crate::network::SnapshotWire;
use crate::state_machine::{SnapshotMeta, StoredMembership};
use crate::types::{CommittedOffsets, LeaderId, LogId, NodeAddr, Payload, TypeConfig};

/// The data of a replica's snapshot: nothing beyond its meta (see the module docs).
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
}

/// See the module docs. Cheap to clone; clones share the state.
#[derive(Debug, Clone)]
pub struct CommitNotifier {
    state: Arc<Mutex<State>>,
    /// One past the last applied index (0: nothing applied).
    applied: Arc<watch::Sender<u64>>,
    fence: Fence,
}

impl CommitNotifier {
    /// A notifier that has applied nothing; a snapshot install trips `fence`.
    pub fn new(fence: Fence) -> CommitNotifier {
        CommitNotifier {
            state: Arc::new(Mutex::new(State {
                last_applied: None,
                membership: StoredMembership::default(),
            })),
            applied: Arc::new(watch::Sender::new(0)),
            fence,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One past the last committed and applied index, as it moves. Every record below it is
    /// committed on a majority and durable on this node.
    pub fn committed(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// The membership last applied.
    pub fn membership(&self) -> StoredMembership {
        self.lock().membership.clone()
    }

    fn snapshot(&self) -> ReplicaSnapshot {
        let state = self.lock();
        Snapshot {
            meta: SnapshotMeta {
                last_log_id: state.last_applied,
                last_membership: state.membership.clone(),
            },
            snapshot: AppliedImage,
        }
    }
}

/// Builds a replica's snapshot: its applied position.
#[derive(Debug)]
pub struct NotifierSnapshotBuilder {
    notifier: CommitNotifier,
}

impl RaftSnapshotBuilder<TypeConfig> for NotifierSnapshotBuilder {
    type SnapshotData = AppliedImage;

    async fn build_snapshot(&mut self) -> Result<ReplicaSnapshot, io::Error> {
        Ok(self.notifier.snapshot())
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
        while let Some(item) = entries.next().await {
            let (entry, responder) = item?;
            let index = entry.log_id.index;
            {
                let mut state = self.lock();
                if let Payload::Membership(membership) = entry.payload {
                    state.membership = StoredMembership::new(Some(entry.log_id), membership);
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
        Ok(())
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
        self.fence.trip(RaftError::Unsupported(format!(
            "a snapshot up to {:?} was sent to this replica, but partition snapshots are not \
             built yet: the entries must come from the leader's log",
            meta.last_log_id
        )));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<ReplicaSnapshot>, io::Error> {
        Ok(None)
    }
}
