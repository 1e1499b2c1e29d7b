//! `RecordStateMachine`: a state machine that keeps every applied partition record by offset,
//! in memory. It is what the tests replicate and the shape the broker's partition owner will
//! take (applied records keyed by offset, a snapshot = the state below an index).
//!
//! What a snapshot is for a partition (`docs/storage-format.md`, "Snapshots of a replicated
//! partition"): the partition state as of the snapshot's last log id — for this state machine
//! the records themselves ([`RecordsImage`]); for the broker, the segment files below the index
//! (immutable once sealed) plus the queue state that the records below them leave. The
//! snapshot lets openraft purge the log below its index.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::{Stream, StreamExt};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine, Snapshot};

use crate::types::{
    CommittedOffsets, LeaderId, LogId, NodeAddr, PartitionRecord, Payload, TypeConfig,
};

/// The membership a state machine applied last, with the id of its entry.
pub type StoredMembership = openraft::StoredMembership<LeaderId, u64, NodeAddr>;
/// A snapshot's metadata.
pub type SnapshotMeta = openraft::storage::SnapshotMeta<LeaderId, u64, NodeAddr>;
/// A snapshot of a [`RecordStateMachine`].
pub type RecordSnapshot = Snapshot<LeaderId, u64, NodeAddr, RecordsImage>;

/// The data of a [`RecordStateMachine`] snapshot: every record applied up to its last log id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordsImage {
    /// Applied records by offset.
    pub records: BTreeMap<u64, PartitionRecord>,
}

#[derive(Debug, Default)]
struct State {
    last_applied: Option<LogId>,
    membership: StoredMembership,
    records: BTreeMap<u64, PartitionRecord>,
    snapshot: Option<RecordSnapshot>,
}

/// An in-memory state machine over partition records (cheap to clone; clones share it).
#[derive(Debug, Clone, Default)]
pub struct RecordStateMachine {
    state: Arc<Mutex<State>>,
}

impl RecordStateMachine {
    /// An empty state machine.
    pub fn new() -> RecordStateMachine {
        RecordStateMachine::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The records applied so far, by offset.
    pub fn records(&self) -> BTreeMap<u64, PartitionRecord> {
        self.lock().records.clone()
    }

    /// The last applied log id.
    pub fn last_applied(&self) -> Option<LogId> {
        self.lock().last_applied
    }
}

/// Builds a snapshot of a [`RecordStateMachine`] from a copy taken under its lock.
#[derive(Debug)]
pub struct RecordSnapshotBuilder {
    machine: RecordStateMachine,
}

impl RaftSnapshotBuilder<TypeConfig> for RecordSnapshotBuilder {
    type SnapshotData = RecordsImage;

    async fn build_snapshot(&mut self) -> Result<RecordSnapshot, io::Error> {
        let mut state = self.machine.lock();
        let snapshot = Snapshot {
            meta: SnapshotMeta {
                last_log_id: state.last_applied,
                last_membership: state.membership.clone(),
            },
            snapshot: RecordsImage {
                records: state.records.clone(),
            },
        };
        state.snapshot = Some(snapshot.clone());
        Ok(snapshot)
    }
}

impl RaftStateMachine<TypeConfig> for RecordStateMachine {
    type SnapshotData = RecordsImage;
    type SnapshotBuilder = RecordSnapshotBuilder;

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
                match entry.payload {
                    Payload::Blank => {}
                    Payload::Normal(record) => {
                        state.records.insert(index, record);
                    }
                    Payload::Membership(membership) => {
                        state.membership = StoredMembership::new(Some(entry.log_id), membership);
                    }
                }
                state.last_applied = Some(entry.log_id);
            }
            if let Some(responder) = responder {
                responder.send(CommittedOffsets {
                    offsets: index..index + 1,
                });
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        RecordSnapshotBuilder {
            machine: self.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: RecordsImage,
    ) -> Result<(), io::Error> {
        let mut state = self.lock();
        state.records = snapshot.records.clone();
        state.last_applied = meta.last_log_id;
        state.membership = meta.last_membership.clone();
        state.snapshot = Some(Snapshot {
            meta: meta.clone(),
            snapshot,
        });
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<RecordSnapshot>, io::Error> {
        Ok(self.lock().snapshot.clone())
    }
}
