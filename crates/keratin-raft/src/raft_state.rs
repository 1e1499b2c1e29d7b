//! `StateLog`: the storage identity of this copy of the group, its vote, committed log id,
//! purge point and the meta of its last snapshot, kept in a small-class keratin log beside the
//! entries (`docs/storage-format.md`, "Raft state records"). Every record holds the whole state, so the last durable record is the
//! state and older segments can go.
//!
//! One `StateLog` per group, shared by the log storage (vote, committed, purge point) and the
//! partition state machine (snapshot meta) behind an async mutex: each write holds the whole
//! state, so the two writers must not interleave stale copies.
//!
//! Durability: a vote and a purge point are durable (process crash and power loss) when
//! [`StateLog::write`] returns `Ok`; the committed log id is written without waiting, and on its
//! own only every [`COMMITTED_WRITE_EVERY_ENTRIES`] entries (it is a lower bound: openraft only
//! re-applies up to it at start, and [`crate::GroupLogs::store`] clamps it to the durable
//! entries).

use std::sync::Arc;

use keratin_log::{Log, LogError, LogResult, ReadRecord, Record};

use crate::entry_format::{decode_membership, encode_membership, MembershipBody};
use crate::error::RaftError;
use crate::state_machine::{SnapshotMeta, StoredMembership};
use crate::types::{LeaderId, LogId, StorageId, Vote};

/// The record type of a state record (in the adapter's reserved range).
pub const RECORD_TYPE_RAFT_STATE: u8 = 0xf8;
/// Version of the state record without a snapshot: exactly [`STATE_RECORD_SIZE`] bytes.
pub const STATE_FORMAT_VERSION: u8 = 1;
/// Version of the state record with a snapshot meta after the version 1 fields.
pub const STATE_FORMAT_VERSION_SNAPSHOT: u8 = 2;
/// Version of the state record with the copy's storage identity (and a snapshot meta, if
/// any): what is written once the copy has an identity.
pub const STATE_FORMAT_VERSION_STORAGE: u8 = 3;

const VERSION_OFFSET: usize = 0;
const PRESENT_OFFSET: usize = VERSION_OFFSET + 1;
const RESERVED_OFFSET: usize = PRESENT_OFFSET + 1;
const VOTE_TERM_OFFSET: usize = RESERVED_OFFSET + 6;
const VOTE_NODE_OFFSET: usize = VOTE_TERM_OFFSET + 8;
const COMMITTED_OFFSET: usize = VOTE_NODE_OFFSET + 8;
const PURGED_OFFSET: usize = COMMITTED_OFFSET + LOG_ID_SIZE;
/// Size of a state record's payload.
pub const STATE_RECORD_SIZE: usize = PURGED_OFFSET + LOG_ID_SIZE;
/// A log id: term, node, index.
const LOG_ID_SIZE: usize = 24;
const _: () = assert!(STATE_RECORD_SIZE == 72);

const PRESENT_VOTE: u8 = 0x01;
const PRESENT_VOTE_COMMITTED: u8 = 0x02;
const PRESENT_COMMITTED: u8 = 0x04;
const PRESENT_PURGED: u8 = 0x08;
const PRESENT_ALL: u8 = PRESENT_VOTE | PRESENT_VOTE_COMMITTED | PRESENT_COMMITTED | PRESENT_PURGED;

/// Snapshot part (version 2): flags, the snapshot's last log id, its membership's log id, and the
/// membership body's length, then the body (`entry_format`'s membership encoding).
const SNAPSHOT_FLAGS_OFFSET: usize = STATE_RECORD_SIZE;
const SNAPSHOT_LAST_OFFSET: usize = SNAPSHOT_FLAGS_OFFSET + 8;
const SNAPSHOT_MEMBERSHIP_ID_OFFSET: usize = SNAPSHOT_LAST_OFFSET + LOG_ID_SIZE;
const SNAPSHOT_MEMBERSHIP_LEN_OFFSET: usize = SNAPSHOT_MEMBERSHIP_ID_OFFSET + LOG_ID_SIZE;
const SNAPSHOT_MEMBERSHIP_OFFSET: usize = SNAPSHOT_MEMBERSHIP_LEN_OFFSET + 4;
const SNAPSHOT_HAS_MEMBERSHIP_ID: u8 = 0x01;

/// Version 3: the storage identity after the version 1 fields, then flags, then the snapshot
/// part of version 2 at its own offsets when flag [`V3_HAS_SNAPSHOT`] is set.
const V3_STORAGE_OFFSET: usize = STATE_RECORD_SIZE;
const V3_FLAGS_OFFSET: usize = V3_STORAGE_OFFSET + 16;
const V3_SNAPSHOT_LAST_OFFSET: usize = V3_FLAGS_OFFSET + 8;
const V3_SNAPSHOT_MEMBERSHIP_ID_OFFSET: usize = V3_SNAPSHOT_LAST_OFFSET + LOG_ID_SIZE;
const V3_SNAPSHOT_MEMBERSHIP_LEN_OFFSET: usize = V3_SNAPSHOT_MEMBERSHIP_ID_OFFSET + LOG_ID_SIZE;
const V3_SNAPSHOT_MEMBERSHIP_OFFSET: usize = V3_SNAPSHOT_MEMBERSHIP_LEN_OFFSET + 4;
/// Size of a version 3 record without a snapshot.
const V3_RECORD_SIZE: usize = V3_SNAPSHOT_LAST_OFFSET;
const _: () = assert!(V3_RECORD_SIZE == 96 && V3_SNAPSHOT_MEMBERSHIP_OFFSET == 148);
/// Version 3 flag: the snapshot's membership has a log id (as [`SNAPSHOT_HAS_MEMBERSHIP_ID`]).
const V3_HAS_MEMBERSHIP_ID: u8 = 0x01;
/// Version 3 flag: a snapshot part follows.
const V3_HAS_SNAPSHOT: u8 = 0x02;

/// After this many writes the state log hands back the segments below its last durable record.
/// A state record takes 104 bytes with the log's header, so a small segment (8 MiB by default,
/// 32 KiB at least) holds over 300 of them: 4,096 writes reclaim at most a few segments per pass.
const COMPACT_EVERY_WRITES: u64 = 4096;

/// The committed id alone is written once it has moved this many entries past the last one
/// written (votes and purges write it too, as every record holds the whole state). Writing it on
/// every commit would cost the state log one record and one `fdatasync` per commit, as many
/// syncs as the entry log itself; this way it costs one per 256 entries, and a restart re-applies
/// at most 256 entries fewer before it hears the cluster's commit (openraft needs only a lower
/// bound).
pub const COMMITTED_WRITE_EVERY_ENTRIES: u64 = 256;

/// What openraft persists besides the entries, and the identity of this copy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RaftState {
    /// This copy's storage identity (`None` in records written before identities existed; the
    /// store gives the copy one when it opens).
    pub storage: Option<StorageId>,
    /// The last vote.
    pub vote: Option<Vote>,
    /// The last committed log id saved (a lower bound of the cluster's).
    pub committed: Option<LogId>,
    /// Entries up to and including this one are purged.
    pub purged: Option<LogId>,
    /// The meta of the last snapshot built or installed (a partition's snapshot holds no
    /// data beyond it: see `replica/notifier.rs`).
    pub snapshot: Option<SnapshotMeta>,
}

impl RaftState {
    fn encode(&self) -> Result<Vec<u8>, RaftError> {
        let mut bytes = vec![0u8; STATE_RECORD_SIZE];
        bytes[VERSION_OFFSET] = STATE_FORMAT_VERSION;
        let mut present = 0;
        if let Some(vote) = &self.vote {
            present |= PRESENT_VOTE;
            if vote.committed {
                present |= PRESENT_VOTE_COMMITTED;
            }
            put_u64(&mut bytes, VOTE_TERM_OFFSET, vote.leader_id.term);
            put_u64(&mut bytes, VOTE_NODE_OFFSET, vote.leader_id.node_id);
        }
        if let Some(committed) = &self.committed {
            present |= PRESENT_COMMITTED;
            put_log_id(&mut bytes, COMMITTED_OFFSET, committed);
        }
        if let Some(purged) = &self.purged {
            present |= PRESENT_PURGED;
            put_log_id(&mut bytes, PURGED_OFFSET, purged);
        }
        bytes[PRESENT_OFFSET] = present;
        match self.storage {
            Some(storage) => self.encode_v3(bytes, storage),
            None => self.encode_v2(bytes),
        }
    }

    /// Version 3: `base` (the version 1 fields) with the identity and the snapshot, if any.
    fn encode_v3(&self, mut bytes: Vec<u8>, storage: StorageId) -> Result<Vec<u8>, RaftError> {
        bytes[VERSION_OFFSET] = STATE_FORMAT_VERSION_STORAGE;
        bytes.resize(V3_RECORD_SIZE, 0);
        bytes[V3_STORAGE_OFFSET..V3_FLAGS_OFFSET].copy_from_slice(&storage.get().to_le_bytes());
        let Some(snapshot) = &self.snapshot else {
            return Ok(bytes);
        };
        let last = snapshot_last(snapshot)?;
        let mut flags = V3_HAS_SNAPSHOT;
        bytes.resize(V3_SNAPSHOT_MEMBERSHIP_OFFSET, 0);
        put_log_id(&mut bytes, V3_SNAPSHOT_LAST_OFFSET, last);
        let membership = &snapshot.last_membership;
        if let Some(id) = membership.log_id() {
            flags |= V3_HAS_MEMBERSHIP_ID;
            put_log_id(&mut bytes, V3_SNAPSHOT_MEMBERSHIP_ID_OFFSET, id);
        }
        bytes[V3_FLAGS_OFFSET] = flags;
        let body = encode_membership(membership.membership(), MembershipBody::WithStorage)?;
        put_len(&mut bytes, V3_SNAPSHOT_MEMBERSHIP_LEN_OFFSET, body.len())?;
        bytes.extend_from_slice(&body);
        Ok(bytes)
    }

    /// Versions 1 and 2, for a state without an identity (tests of the older layouts).
    fn encode_v2(&self, mut bytes: Vec<u8>) -> Result<Vec<u8>, RaftError> {
        let Some(snapshot) = &self.snapshot else {
            return Ok(bytes);
        };
        let last = snapshot_last(snapshot)?;
        bytes[VERSION_OFFSET] = STATE_FORMAT_VERSION_SNAPSHOT;
        bytes.resize(SNAPSHOT_MEMBERSHIP_OFFSET, 0);
        put_log_id(&mut bytes, SNAPSHOT_LAST_OFFSET, last);
        let membership = &snapshot.last_membership;
        if let Some(id) = membership.log_id() {
            bytes[SNAPSHOT_FLAGS_OFFSET] = SNAPSHOT_HAS_MEMBERSHIP_ID;
            put_log_id(&mut bytes, SNAPSHOT_MEMBERSHIP_ID_OFFSET, id);
        }
        // Version 2 holds the membership without identities.
        let body = encode_membership(membership.membership(), MembershipBody::Addresses)?;
        put_len(&mut bytes, SNAPSHOT_MEMBERSHIP_LEN_OFFSET, body.len())?;
        bytes.extend_from_slice(&body);
        Ok(bytes)
    }

    fn decode(record: &ReadRecord) -> Result<RaftState, RaftError> {
        let bad = |reason: String| RaftError::Format {
            offset: record.offset,
            reason: format!("raft state record: {reason}"),
        };
        if record.record_type != RECORD_TYPE_RAFT_STATE {
            return Err(bad(format!("record type {:#04x}", record.record_type)));
        }
        let bytes = record.payload.as_slice();
        let version = bytes.get(VERSION_OFFSET).copied();
        match version {
            Some(STATE_FORMAT_VERSION) if bytes.len() == STATE_RECORD_SIZE => {}
            Some(STATE_FORMAT_VERSION_SNAPSHOT) if bytes.len() >= SNAPSHOT_MEMBERSHIP_OFFSET => {}
            Some(STATE_FORMAT_VERSION_STORAGE) if bytes.len() >= V3_RECORD_SIZE => {}
            Some(
                STATE_FORMAT_VERSION | STATE_FORMAT_VERSION_SNAPSHOT | STATE_FORMAT_VERSION_STORAGE,
            ) => return Err(bad(format!("{} bytes", bytes.len()))),
            Some(other) => return Err(bad(format!("version {other}"))),
            None => return Err(bad("empty".into())),
        }
        let present = bytes[PRESENT_OFFSET];
        if present & !PRESENT_ALL != 0
            || (present & PRESENT_VOTE_COMMITTED != 0 && present & PRESENT_VOTE == 0)
        {
            return Err(bad(format!("presence bits {present:#04x}")));
        }
        if bytes[RESERVED_OFFSET..VOTE_TERM_OFFSET]
            .iter()
            .any(|b| *b != 0)
        {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let vote = (present & PRESENT_VOTE != 0).then(|| Vote {
            leader_id: LeaderId {
                term: get_u64(bytes, VOTE_TERM_OFFSET),
                node_id: get_u64(bytes, VOTE_NODE_OFFSET),
            },
            committed: present & PRESENT_VOTE_COMMITTED != 0,
        });
        let (storage, snapshot) = match version {
            Some(STATE_FORMAT_VERSION_SNAPSHOT) => {
                (None, Some(decode_snapshot(bytes).map_err(bad)?))
            }
            Some(STATE_FORMAT_VERSION_STORAGE) => decode_v3(bytes).map_err(bad)?,
            _ => (None, None),
        };
        Ok(RaftState {
            storage,
            vote,
            committed: (present & PRESENT_COMMITTED != 0)
                .then(|| get_log_id(bytes, COMMITTED_OFFSET)),
            purged: (present & PRESENT_PURGED != 0).then(|| get_log_id(bytes, PURGED_OFFSET)),
            snapshot,
        })
    }
}

/// The snapshot part of a version 2 record (`bytes` is the whole payload).
fn decode_snapshot(bytes: &[u8]) -> Result<SnapshotMeta, String> {
    let flags = bytes[SNAPSHOT_FLAGS_OFFSET];
    if flags & !SNAPSHOT_HAS_MEMBERSHIP_ID != 0
        || bytes[SNAPSHOT_FLAGS_OFFSET + 1..SNAPSHOT_LAST_OFFSET]
            .iter()
            .any(|b| *b != 0)
    {
        return Err(format!("snapshot flags {flags:#04x} or reserved bytes"));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&bytes[SNAPSHOT_MEMBERSHIP_LEN_OFFSET..SNAPSHOT_MEMBERSHIP_OFFSET]);
    let len = u32::from_le_bytes(len) as usize;
    let body = &bytes[SNAPSHOT_MEMBERSHIP_OFFSET..];
    if body.len() != len {
        return Err(format!(
            "snapshot membership of {len} bytes, {} present",
            body.len()
        ));
    }
    let membership = decode_membership(body, MembershipBody::Addresses)?;
    let membership_id = (flags & SNAPSHOT_HAS_MEMBERSHIP_ID != 0)
        .then(|| get_log_id(bytes, SNAPSHOT_MEMBERSHIP_ID_OFFSET));
    Ok(SnapshotMeta {
        last_log_id: Some(get_log_id(bytes, SNAPSHOT_LAST_OFFSET)),
        last_membership: StoredMembership::new(membership_id, membership),
    })
}

/// The identity and the snapshot of a version 3 record (`bytes` is the whole payload, at least
/// [`V3_RECORD_SIZE`] bytes).
fn decode_v3(bytes: &[u8]) -> Result<(Option<StorageId>, Option<SnapshotMeta>), String> {
    let mut storage = [0u8; 16];
    storage.copy_from_slice(&bytes[V3_STORAGE_OFFSET..V3_FLAGS_OFFSET]);
    let storage = StorageId::from_u128(u128::from_le_bytes(storage))
        .ok_or_else(|| "a storage identity of zero".to_string())?;
    let flags = bytes[V3_FLAGS_OFFSET];
    if flags & !(V3_HAS_SNAPSHOT | V3_HAS_MEMBERSHIP_ID) != 0
        || (flags & V3_HAS_MEMBERSHIP_ID != 0 && flags & V3_HAS_SNAPSHOT == 0)
        || bytes[V3_FLAGS_OFFSET + 1..V3_SNAPSHOT_LAST_OFFSET]
            .iter()
            .any(|b| *b != 0)
    {
        return Err(format!("flags {flags:#04x} or reserved bytes"));
    }
    if flags & V3_HAS_SNAPSHOT == 0 {
        if bytes.len() != V3_RECORD_SIZE {
            return Err(format!("{} bytes without a snapshot", bytes.len()));
        }
        return Ok((Some(storage), None));
    }
    if bytes.len() < V3_SNAPSHOT_MEMBERSHIP_OFFSET {
        return Err(format!("{} bytes with a snapshot", bytes.len()));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&bytes[V3_SNAPSHOT_MEMBERSHIP_LEN_OFFSET..V3_SNAPSHOT_MEMBERSHIP_OFFSET]);
    let len = u32::from_le_bytes(len) as usize;
    let body = &bytes[V3_SNAPSHOT_MEMBERSHIP_OFFSET..];
    if body.len() != len {
        return Err(format!(
            "snapshot membership of {len} bytes, {} present",
            body.len()
        ));
    }
    let membership = decode_membership(body, MembershipBody::WithStorage)?;
    let membership_id = (flags & V3_HAS_MEMBERSHIP_ID != 0)
        .then(|| get_log_id(bytes, V3_SNAPSHOT_MEMBERSHIP_ID_OFFSET));
    let snapshot = SnapshotMeta {
        last_log_id: Some(get_log_id(bytes, V3_SNAPSHOT_LAST_OFFSET)),
        last_membership: StoredMembership::new(membership_id, membership),
    };
    Ok((Some(storage), Some(snapshot)))
}

/// A kept snapshot's last log id (a snapshot without one is not kept).
fn snapshot_last(snapshot: &SnapshotMeta) -> Result<&LogId, RaftError> {
    snapshot
        .last_log_id
        .as_ref()
        .ok_or_else(|| RaftError::Invalid("a snapshot without a last log id is not kept".into()))
}

fn put_len(bytes: &mut [u8], at: usize, len: usize) -> Result<(), RaftError> {
    let len = u32::try_from(len)
        .map_err(|_| RaftError::Invalid("snapshot membership too large".into()))?;
    bytes[at..at + 4].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

fn put_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

fn get_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

fn put_log_id(bytes: &mut [u8], at: usize, log_id: &LogId) {
    put_u64(bytes, at, log_id.leader_id.term);
    put_u64(bytes, at + 8, log_id.leader_id.node_id);
    put_u64(bytes, at + 16, log_id.index);
}

fn get_log_id(bytes: &[u8], at: usize) -> LogId {
    LogId::new(
        LeaderId {
            term: get_u64(bytes, at),
            node_id: get_u64(bytes, at + 8),
        },
        get_u64(bytes, at + 16),
    )
}

/// The writer of a group's state log (one per `LogStore`; openraft calls it sequentially).
#[derive(Debug)]
pub(crate) struct StateLog {
    log: Arc<Log>,
    /// The last state written (or read at open): a write of one part keeps the others.
    last: RaftState,
    writes: u64,
    /// The index of the committed id in the last record written.
    committed_written: Option<u64>,
}

impl StateLog {
    pub(crate) fn new(log: Arc<Log>, state: &RaftState) -> StateLog {
        StateLog {
            log,
            last: state.clone(),
            writes: 0,
            committed_written: state.committed.map(|c| c.index),
        }
    }

    /// Whether `committed` has moved far enough to be written on its own.
    pub(crate) fn committed_is_due(&self, committed: Option<&LogId>) -> bool {
        match (committed, self.committed_written) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(c), Some(written)) => {
                c.index >= written.saturating_add(COMMITTED_WRITE_EVERY_ENTRIES)
            }
        }
    }

    /// The state as the last durable record holds it.
    pub(crate) fn read(log: &Log) -> Result<RaftState, RaftError> {
        let end = log.durable_offset();
        if end <= log.start_offset() {
            return Ok(RaftState::default());
        }
        let record = log
            .read(end - 1)
            .map_err(|e| RaftError::log("read the raft state", e))?;
        RaftState::decode(&record)
    }

    /// Write `state` as the only change to `log` and wait until it is durable (blocking: at
    /// open, before any `StateLog` exists).
    pub(crate) fn write_now(log: &Log, state: &RaftState) -> LogResult<()> {
        let bytes = state
            .encode()
            .map_err(|e| LogError::Invalid(format!("encode the raft state: {e}")))?;
        let record = Record {
            record_type: RECORD_TYPE_RAFT_STATE,
            flags: 0,
            timestamp_ms: 0,
            payload: &bytes,
        };
        log.append_sync(&[record]).map(drop)
    }

    /// The snapshot meta last written (or read at open).
    pub(crate) fn snapshot(&self) -> Option<&SnapshotMeta> {
        self.last.snapshot.as_ref()
    }

    /// Append `state` (its snapshot meta is the one this log keeps: see
    /// [`StateLog::write_snapshot`]); with `wait`, return once it is durable.
    pub(crate) async fn write(&mut self, state: &RaftState, wait: bool) -> LogResult<()> {
        let mut state = state.clone();
        state.snapshot = self.last.snapshot.clone();
        self.append(state, wait).await
    }

    /// Append the last state with `snapshot` as its snapshot meta; returns once it is durable.
    pub(crate) async fn write_snapshot(&mut self, snapshot: SnapshotMeta) -> LogResult<()> {
        let mut state = self.last.clone();
        state.snapshot = Some(snapshot);
        self.append(state, true).await
    }

    async fn append(&mut self, state: RaftState, wait: bool) -> LogResult<()> {
        let bytes = state
            .encode()
            .map_err(|e| LogError::Invalid(format!("encode the raft state: {e}")))?;
        let record = Record {
            record_type: RECORD_TYPE_RAFT_STATE,
            flags: 0,
            timestamp_ms: 0,
            payload: &bytes,
        };
        let ticket = self.log.append_async(&[record]).await?;
        self.writes += 1;
        self.committed_written = state.committed.map(|c| c.index);
        self.last = state;
        if self.writes.is_multiple_of(COMPACT_EVERY_WRITES) {
            self.compact()?;
        }
        if wait {
            ticket.await?;
        }
        Ok(())
    }

    /// Hand back the segments below the last durable record (it holds the whole state, and every
    /// later record is newer). Not waited for: a failure stops the log and the next write says so.
    fn compact(&self) -> Result<(), LogError> {
        let durable = self.log.durable_offset();
        if durable > self.log.start_offset() + 1 {
            drop(self.log.remove_prefix(durable - 1)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_roundtrips() {
        let states = [
            RaftState::default(),
            RaftState {
                storage: None,
                vote: Some(Vote::new(3, 2)),
                committed: None,
                purged: Some(LogId::new(
                    LeaderId {
                        term: 1,
                        node_id: 1,
                    },
                    9,
                )),
                snapshot: None,
            },
            RaftState {
                storage: StorageId::from_u128(u128::MAX),
                vote: Some(Vote::new_committed(u64::MAX, 7)),
                committed: Some(LogId::new(
                    LeaderId {
                        term: 5,
                        node_id: 7,
                    },
                    1 << 40,
                )),
                purged: None,
                snapshot: None,
            },
            RaftState {
                storage: None,
                vote: Some(Vote::new(4, 1)),
                committed: None,
                purged: Some(LogId::new(
                    LeaderId {
                        term: 4,
                        node_id: 1,
                    },
                    99,
                )),
                snapshot: Some(SnapshotMeta {
                    last_log_id: Some(LogId::new(
                        LeaderId {
                            term: 4,
                            node_id: 1,
                        },
                        120,
                    )),
                    last_membership: StoredMembership::new(
                        Some(LogId::new(
                            LeaderId {
                                term: 1,
                                node_id: 1,
                            },
                            0,
                        )),
                        crate::types::Membership::new(
                            vec![std::collections::BTreeSet::from([1, 2, 3])],
                            (1..=3)
                                .map(|id| {
                                    (
                                        id,
                                        crate::types::NodeAddr::new(format!(
                                            "127.0.0.1:{}",
                                            5690 + id
                                        )),
                                    )
                                })
                                .collect::<std::collections::BTreeMap<_, _>>(),
                        )
                        .expect("membership"),
                    ),
                }),
            },
        ];
        // The same with an identity (version 3), node 2's recorded in the snapshot's
        // membership.
        let mut with_storage = states[3].clone();
        with_storage.storage = StorageId::from_u128(0x1234_5678_9abc_def0 << 64 | 42);
        if let Some(snapshot) = with_storage.snapshot.as_mut() {
            let membership = snapshot.last_membership.membership();
            let mut nodes: std::collections::BTreeMap<u64, crate::types::NodeAddr> = membership
                .nodes()
                .map(|(id, node)| (*id, node.clone()))
                .collect();
            if let (Some(node), Some(id)) = (nodes.get_mut(&2), StorageId::from_u128(77)) {
                node.storage = Some(id);
            }
            let changed =
                crate::types::Membership::new(membership.get_joint_config().clone(), nodes)
                    .expect("membership");
            snapshot.last_membership =
                StoredMembership::new(*snapshot.last_membership.log_id(), changed);
        }
        let mut no_snapshot = with_storage.clone();
        no_snapshot.snapshot = None;
        let states = states.into_iter().chain([with_storage, no_snapshot]);
        for state in states {
            let record = ReadRecord {
                offset: 0,
                record_type: RECORD_TYPE_RAFT_STATE,
                flags: 0,
                timestamp_ms: 0,
                payload: state.encode().expect("encode"),
            };
            assert_eq!(RaftState::decode(&record).expect("decode"), state);
            // Every cut of the payload is refused, never misread.
            for len in 0..record.payload.len() {
                let cut = ReadRecord {
                    payload: record.payload[..len].to_vec(),
                    ..record.clone()
                };
                assert!(RaftState::decode(&cut).is_err(), "a cut at {len} decoded");
            }
        }
    }
}
