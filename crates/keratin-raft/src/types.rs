//! The openraft type configuration of a partition group ([`TypeConfig`]) and the types it names:
//! [`NodeAddr`] (with the [`StorageId`] of the node's copy), the application data
//! [`PartitionRecord`] and the response [`CommittedOffsets`].

use std::fmt;
use std::ops::Range;

use bytes::Bytes;

use crate::entry_format::RECORD_TYPE_RESERVED_MIN;
use crate::error::RaftError;

openraft::declare_raft_types!(
    /// The type configuration of every partition group: node ids are `u64`, leader ids are
    /// (term, node) (`leader_id_adv`, several candidates per term), entries are openraft's
    /// `Entry` carrying a [`PartitionRecord`].
    pub TypeConfig:
        D = PartitionRecord,
        R = CommittedOffsets,
        NodeId = u64,
        Node = NodeAddr,
        Term = u64,
        AsyncRuntime = openraft::impls::TokioRuntime,
);

/// A member of a group: where its peers reach it, and which copy of the group's storage it is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeAddr {
    /// `host:port` of the node's cluster listener.
    pub addr: String,
    /// The storage identity of the copy the membership counts on (`None`: not recorded yet, a
    /// group formed a moment ago or before identities existed). A replica whose own identity
    /// differs is another copy (a wiped directory): it answers nothing addressed to this one
    /// (`docs/cluster.md`, "Storage identities").
    pub storage: Option<StorageId>,
}

impl NodeAddr {
    /// A member at `addr` whose storage identity is not recorded.
    pub fn new(addr: impl Into<String>) -> NodeAddr {
        NodeAddr {
            addr: addr.into(),
            storage: None,
        }
    }

    /// A member at `addr` whose copy is `storage`.
    pub fn with_storage(addr: impl Into<String>, storage: StorageId) -> NodeAddr {
        NodeAddr {
            addr: addr.into(),
            storage: Some(storage),
        }
    }
}

/// The identity of one copy of a group's storage: 128 random bits, created with the group's
/// directory on a node and kept in its state log (`docs/storage-format.md`, "State records").
/// A directory wiped and created again gets a new one, so the group can tell the copy that
/// voted and acknowledged entries from an empty one that took its place (Kafka KRaft's
/// directory id, KIP-853). Never zero: zero on disk and on the wire means "none".
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StorageId(std::num::NonZeroU128);

impl StorageId {
    /// A new random identity (the operating system's random source).
    pub fn random() -> Result<StorageId, RaftError> {
        for _ in 0..4 {
            let mut bytes = [0u8; 16];
            getrandom::fill(&mut bytes).map_err(|e| {
                RaftError::Invalid(format!("no random bytes for a storage identity: {e}"))
            })?;
            if let Some(id) = StorageId::from_u128(u128::from_le_bytes(bytes)) {
                return Ok(id);
            }
        }
        Err(RaftError::Invalid(
            "the random source gave zero four times".into(),
        ))
    }

    /// The identity `value`, `None` for zero (no identity).
    pub fn from_u128(value: u128) -> Option<StorageId> {
        std::num::NonZeroU128::new(value).map(StorageId)
    }

    /// The identity as a number (never zero).
    pub fn get(self) -> u128 {
        self.0.get()
    }

    /// `id` as stored and sent: zero for none.
    pub fn to_wire(id: Option<StorageId>) -> u128 {
        id.map_or(0, StorageId::get)
    }
}

impl fmt::Display for StorageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.get())
    }
}

impl fmt::Debug for StorageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageId({self})")
    }
}

/// The application data of one Raft entry: one record of the partition log, opaque to the
/// adapter (the broker may encode a batch in it). Its offset in the partition log is the
/// entry's Raft index. The payload is shared (`Bytes`): openraft clones an entry for each
/// replication stream and for the state machine, and a clone must not copy the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionRecord {
    /// Below [`RECORD_TYPE_RESERVED_MIN`] (checked by [`PartitionRecord::new`]).
    pub(crate) record_type: u8,
    pub(crate) timestamp_ms: u64,
    pub(crate) payload: Bytes,
}

impl PartitionRecord {
    /// A record, refused if its type is in the adapter's reserved range.
    pub fn new(record_type: u8, timestamp_ms: u64, payload: Vec<u8>) -> Result<Self, RaftError> {
        if record_type >= RECORD_TYPE_RESERVED_MIN {
            return Err(RaftError::Invalid(format!(
                "record type {record_type:#04x}: types from {RECORD_TYPE_RESERVED_MIN:#04x} on \
                 are reserved for the replicated log"
            )));
        }
        Ok(PartitionRecord {
            record_type,
            timestamp_ms,
            payload: Bytes::from(payload),
        })
    }

    /// The broker's record type (`ENQUEUE`, `SETTLE`, ...); below [`RECORD_TYPE_RESERVED_MIN`],
    /// whose range is the adapter's.
    pub fn record_type(&self) -> u8 {
        self.record_type
    }

    /// Milliseconds since the Unix epoch, chosen by the leader when it proposes the record, so
    /// that every replica stores and applies the same time.
    pub fn timestamp_ms(&self) -> u64 {
        self.timestamp_ms
    }

    /// The record's payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

impl fmt::Display for PartitionRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "record(type {}, {} bytes)",
            self.record_type,
            self.payload.len()
        )
    }
}

/// The answer to a write once it is committed and applied: the partition-log offsets its
/// records got (one record per entry today: `index..index + 1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedOffsets {
    /// The offsets.
    pub offsets: Range<u64>,
}

/// The leader id inside a vote and a log id: (term, node).
pub type LeaderId = openraft::impls::leader_id_adv::LeaderId<u64, u64>;
/// A vote as openraft persists it.
pub type Vote = openraft::impls::Vote<LeaderId>;
/// A log id: the leader that proposed the entry and its index.
pub type LogId = openraft::LogId<LeaderId>;
/// One entry of the Raft log.
pub type Entry = openraft::Entry<LeaderId, Payload>;
/// The payload of an entry.
pub type Payload = openraft::EntryPayload<PartitionRecord, u64, NodeAddr>;
/// A membership configuration.
pub type Membership = openraft::Membership<u64, NodeAddr>;
