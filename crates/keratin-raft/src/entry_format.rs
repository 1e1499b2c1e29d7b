//! The replicated-log record format: how one Raft entry is one record of the partition's
//! segment log, byte by byte as `docs/storage-format.md` ("Replicated log records") specifies.
//! The segment log's own record header (offset, generation, CRC) is keratin-log's; this module
//! owns the record type, the flags and the payload.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use keratin_log::{ReadRecord, Record};

use crate::error::RaftError;
use crate::types::{
    Entry, LeaderId, LogId, Membership, NodeAddr, PartitionRecord, Payload, StorageId,
};

/// Version of the entry prefix; a reader refuses other versions.
pub const ENTRY_FORMAT_VERSION: u8 = 1;

/// Record types from here on are the adapter's; the broker's record types stay below.
pub const RECORD_TYPE_RESERVED_MIN: u8 = 0xf0;
/// A blank entry (a new leader's first entry).
pub const RECORD_TYPE_BLANK: u8 = 0xf0;
/// A membership entry without storage identities (replicated-log format 1 and 2): read, never
/// written.
pub const RECORD_TYPE_MEMBERSHIP: u8 = 0xf1;
/// A gap filler: takes an offset that has no Raft entry (below a purge point that lies past
/// the log's end), so that Raft index and log offset stay equal. Never read as an entry.
pub const RECORD_TYPE_GAP: u8 = 0xf2;
/// A membership entry whose nodes carry their storage identities (replicated-log format 3):
/// what is written.
pub const RECORD_TYPE_MEMBERSHIP_STORAGE: u8 = 0xf3;

/// The two encodings of a membership body (`docs/storage-format.md`, "Membership body").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MembershipBody {
    /// Nodes with their address only (record type `0xf1`, state records up to version 2).
    Addresses,
    /// Nodes with their storage identity and address (record type `0xf3`, state records of
    /// version 3, Raft bodies of version 2): what is written.
    WithStorage,
}

/// Every record of a replicated log carries this caller flag: a reader can tell a replicated
/// log from a single-node partition log record by record.
pub const FLAG_REPLICATED: u8 = 0x40;

// The entry prefix, at the start of the record payload (docs/storage-format.md).
const VERSION_OFFSET: usize = 0;
const RESERVED_OFFSET: usize = VERSION_OFFSET + 1;
const TERM_OFFSET: usize = RESERVED_OFFSET + 3;
const LEADER_NODE_OFFSET: usize = TERM_OFFSET + 8;
/// Size of the entry prefix; the body follows it.
pub const ENTRY_PREFIX_SIZE: usize = LEADER_NODE_OFFSET + 8;
const _: () = assert!(ENTRY_PREFIX_SIZE == 20);

/// Bounds of a membership body. Joint consensus holds two configurations at once; more than
/// eight is malformed. A partition group has a handful of replicas; 1,024 voters or nodes is far
/// past any cluster we plan and keeps a decoded body under ~1.1 MiB.
const MEMBERSHIP_CONFIGS_MAX: u32 = 8;
const MEMBERSHIP_VOTERS_MAX: u32 = 1024;
const MEMBERSHIP_NODES_MAX: u32 = 1024;
/// A `host:port` is far shorter; longer is malformed.
const NODE_ADDR_BYTES_MAX: u32 = 1024;

/// One entry encoded as the fields of a segment-log record.
#[derive(Debug, Clone)]
pub(crate) struct EncodedEntry {
    pub(crate) record_type: u8,
    pub(crate) timestamp_ms: u64,
    pub(crate) payload: Vec<u8>,
}

impl EncodedEntry {
    pub(crate) fn record(&self) -> Record<'_> {
        Record {
            record_type: self.record_type,
            flags: FLAG_REPLICATED,
            timestamp_ms: self.timestamp_ms,
            payload: &self.payload,
        }
    }
}

/// The entry prefix of an entry proposed by `leader`.
pub(crate) fn entry_prefix(leader: &LeaderId) -> [u8; ENTRY_PREFIX_SIZE] {
    let mut head = [0u8; ENTRY_PREFIX_SIZE];
    head[VERSION_OFFSET] = ENTRY_FORMAT_VERSION;
    head[TERM_OFFSET..LEADER_NODE_OFFSET].copy_from_slice(&leader.term.to_le_bytes());
    head[LEADER_NODE_OFFSET..].copy_from_slice(&leader.node_id.to_le_bytes());
    head
}

fn prefix(leader: &LeaderId, body_len: usize) -> Vec<u8> {
    let mut payload = Vec::with_capacity(ENTRY_PREFIX_SIZE + body_len);
    payload.extend_from_slice(&entry_prefix(leader));
    payload
}

/// Encode one entry. Fails only for a membership past the bounds (or a normal entry with a
/// reserved record type, which [`PartitionRecord::new`] does not build).
pub(crate) fn encode_entry(entry: &Entry) -> Result<EncodedEntry, RaftError> {
    let leader = &entry.log_id.leader_id;
    match &entry.payload {
        Payload::Blank => Ok(EncodedEntry {
            record_type: RECORD_TYPE_BLANK,
            timestamp_ms: 0,
            payload: prefix(leader, 0),
        }),
        Payload::Normal(record) => {
            if record.record_type >= RECORD_TYPE_RESERVED_MIN {
                return Err(RaftError::Invalid(format!(
                    "entry {}: record type {:#04x} is reserved",
                    entry.log_id.index, record.record_type
                )));
            }
            let mut payload = prefix(leader, record.payload.len());
            payload.extend_from_slice(&record.payload);
            Ok(EncodedEntry {
                record_type: record.record_type,
                timestamp_ms: record.timestamp_ms,
                payload,
            })
        }
        Payload::Membership(membership) => {
            let body = encode_membership(membership, MembershipBody::WithStorage)?;
            let mut payload = prefix(leader, body.len());
            payload.extend_from_slice(&body);
            Ok(EncodedEntry {
                record_type: RECORD_TYPE_MEMBERSHIP_STORAGE,
                timestamp_ms: 0,
                payload,
            })
        }
    }
}

/// The record that fills an offset without an entry.
pub(crate) fn encode_gap() -> EncodedEntry {
    EncodedEntry {
        record_type: RECORD_TYPE_GAP,
        timestamp_ms: 0,
        payload: prefix(
            &LeaderId {
                term: 0,
                node_id: 0,
            },
            0,
        ),
    }
}

/// Decode a record of an entry log (as `keratin_log::Log::read` returns it) into the entry at
/// index `record.offset`; `None` for a gap record.
pub fn decode_entry(record: &ReadRecord) -> Result<Option<Entry>, RaftError> {
    decode_shared(
        record.offset,
        record.record_type,
        record.flags,
        record.timestamp_ms,
        Bytes::copy_from_slice(&record.payload),
    )
}

/// [`decode_entry`] of a record the caller owns: the entry's body keeps the record's buffer
/// instead of a copy.
pub(crate) fn decode_entry_owned(record: ReadRecord) -> Result<Option<Entry>, RaftError> {
    decode_shared(
        record.offset,
        record.record_type,
        record.flags,
        record.timestamp_ms,
        Bytes::from(record.payload),
    )
}

/// Decode the fields of a record at `offset` whose payload is `payload`: a normal entry's body
/// is a slice of it (no copy).
pub(crate) fn decode_shared(
    offset: u64,
    record_type: u8,
    flags: u8,
    timestamp_ms: u64,
    payload: Bytes,
) -> Result<Option<Entry>, RaftError> {
    let bad = |reason: String| RaftError::Format { offset, reason };
    if flags != FLAG_REPLICATED {
        return Err(bad(format!(
            "flags {flags:#04x}, expected {FLAG_REPLICATED:#04x}"
        )));
    }
    let Some(head) = payload.get(..ENTRY_PREFIX_SIZE) else {
        return Err(bad(format!("payload of {} bytes", payload.len())));
    };
    if head[VERSION_OFFSET] != ENTRY_FORMAT_VERSION {
        return Err(bad(format!(
            "entry format version {}",
            head[VERSION_OFFSET]
        )));
    }
    if head[RESERVED_OFFSET..TERM_OFFSET].iter().any(|b| *b != 0) {
        return Err(bad("reserved bytes are not zero".into()));
    }
    let leader_id = LeaderId {
        term: read_u64(head, TERM_OFFSET),
        node_id: read_u64(head, LEADER_NODE_OFFSET),
    };
    let body = &payload[ENTRY_PREFIX_SIZE..];
    let log_id = LogId::new(leader_id, offset);
    let payload = match record_type {
        RECORD_TYPE_GAP => {
            if !body.is_empty() {
                return Err(bad("gap record with a body".into()));
            }
            return Ok(None);
        }
        RECORD_TYPE_BLANK => {
            if !body.is_empty() {
                return Err(bad("blank entry with a body".into()));
            }
            Payload::Blank
        }
        RECORD_TYPE_MEMBERSHIP => {
            Payload::Membership(decode_membership(body, MembershipBody::Addresses).map_err(bad)?)
        }
        RECORD_TYPE_MEMBERSHIP_STORAGE => {
            Payload::Membership(decode_membership(body, MembershipBody::WithStorage).map_err(bad)?)
        }
        t if t < RECORD_TYPE_RESERVED_MIN => Payload::Normal(PartitionRecord {
            record_type: t,
            timestamp_ms,
            payload: payload.slice(ENTRY_PREFIX_SIZE..),
        }),
        t => return Err(bad(format!("reserved record type {t:#04x}"))),
    };
    Ok(Some(Entry { log_id, payload }))
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// A membership's body in `encoding` ([`MembershipBody::WithStorage`] is what is written; the
/// other only for tests of the older layouts).
pub(crate) fn encode_membership(
    membership: &Membership,
    encoding: MembershipBody,
) -> Result<Vec<u8>, RaftError> {
    let too_big = |what: &str| RaftError::Invalid(format!("membership: too many {what}"));
    let configs = membership.get_joint_config();
    let mut body = Vec::new();
    let count = u32::try_from(configs.len()).map_err(|_| too_big("configurations"))?;
    if count > MEMBERSHIP_CONFIGS_MAX {
        return Err(too_big("configurations"));
    }
    body.extend_from_slice(&count.to_le_bytes());
    for config in configs {
        let voters = u32::try_from(config.len()).map_err(|_| too_big("voters"))?;
        if voters > MEMBERSHIP_VOTERS_MAX {
            return Err(too_big("voters"));
        }
        body.extend_from_slice(&voters.to_le_bytes());
        for id in config {
            body.extend_from_slice(&id.to_le_bytes());
        }
    }
    let nodes: Vec<(&u64, &NodeAddr)> = membership.nodes().collect();
    let count = u32::try_from(nodes.len()).map_err(|_| too_big("nodes"))?;
    if count > MEMBERSHIP_NODES_MAX {
        return Err(too_big("nodes"));
    }
    body.extend_from_slice(&count.to_le_bytes());
    for (id, node) in nodes {
        let len = u32::try_from(node.addr.len())
            .ok()
            .filter(|len| *len <= NODE_ADDR_BYTES_MAX)
            .ok_or_else(|| RaftError::Invalid(format!("node {id}: address too long")))?;
        body.extend_from_slice(&id.to_le_bytes());
        if encoding == MembershipBody::WithStorage {
            body.extend_from_slice(&StorageId::to_wire(node.storage).to_le_bytes());
        }
        body.extend_from_slice(&len.to_le_bytes());
        body.extend_from_slice(node.addr.as_bytes());
    }
    Ok(body)
}

/// A cursor over a body that never reads past its end.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl Cursor<'_> {
    fn take(&mut self, count: usize) -> Result<&[u8], String> {
        if self.rest.len() < count {
            return Err(format!(
                "membership body ends early ({count} bytes wanted, {} left)",
                self.rest.len()
            ));
        }
        let (head, rest) = self.rest.split_at(count);
        self.rest = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(read_u64(self.take(8)?, 0))
    }

    fn u128(&mut self) -> Result<u128, String> {
        let mut b = [0u8; 16];
        b.copy_from_slice(self.take(16)?);
        Ok(u128::from_le_bytes(b))
    }

    fn count(&mut self, max: u32, what: &str) -> Result<u32, String> {
        let count = self.u32()?;
        if count > max {
            return Err(format!("{count} {what}, at most {max}"));
        }
        Ok(count)
    }
}

/// Read a membership body encoded as `encoding` says.
pub(crate) fn decode_membership(
    body: &[u8],
    encoding: MembershipBody,
) -> Result<Membership, String> {
    let mut cursor = Cursor { rest: body };
    let config_count = cursor.count(MEMBERSHIP_CONFIGS_MAX, "configurations")?;
    let mut configs = Vec::new();
    for _ in 0..config_count {
        let voters = cursor.count(MEMBERSHIP_VOTERS_MAX, "voters")?;
        let mut config = BTreeSet::new();
        for _ in 0..voters {
            config.insert(cursor.u64()?);
        }
        configs.push(config);
    }
    let node_count = cursor.count(MEMBERSHIP_NODES_MAX, "nodes")?;
    let mut nodes = BTreeMap::new();
    for _ in 0..node_count {
        let id = cursor.u64()?;
        let storage = match encoding {
            MembershipBody::Addresses => None,
            MembershipBody::WithStorage => StorageId::from_u128(cursor.u128()?),
        };
        let len = cursor.count(NODE_ADDR_BYTES_MAX, "address bytes")?;
        let addr = std::str::from_utf8(cursor.take(len as usize)?)
            .map_err(|e| format!("node {id}: address is not UTF-8: {e}"))?
            .to_string();
        nodes.insert(id, NodeAddr { addr, storage });
    }
    if !cursor.rest.is_empty() {
        return Err(format!("{} bytes after the membership", cursor.rest.len()));
    }
    Membership::new(configs, nodes).map_err(|e| format!("membership: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(encoded: &EncodedEntry, offset: u64) -> ReadRecord {
        ReadRecord {
            offset,
            record_type: encoded.record_type,
            flags: FLAG_REPLICATED,
            timestamp_ms: encoded.timestamp_ms,
            payload: encoded.payload.clone(),
        }
    }

    fn leader(term: u64, node_id: u64) -> LeaderId {
        LeaderId { term, node_id }
    }

    #[test]
    fn every_kind_roundtrips() {
        let mut nodes = BTreeMap::new();
        for id in 1..=3u64 {
            let storage = StorageId::from_u128(u128::from(id) << 100 | 7);
            let addr = format!("10.0.0.{id}:7000");
            // Node 3's identity is not recorded yet.
            let node = match storage.filter(|_| id != 3) {
                Some(storage) => NodeAddr::with_storage(addr, storage),
                None => NodeAddr::new(addr),
            };
            nodes.insert(id, node);
        }
        let configs = vec![BTreeSet::from([1, 2]), BTreeSet::from([1, 2, 3])];
        let membership = Membership::new(configs, nodes).expect("membership");
        let entries = [
            Entry {
                log_id: LogId::new(leader(3, 2), 7),
                payload: Payload::Blank,
            },
            Entry {
                log_id: LogId::new(leader(u64::MAX, 9), 8),
                payload: Payload::Normal(PartitionRecord {
                    record_type: 1,
                    timestamp_ms: 1_700_000_000_000,
                    payload: Bytes::from_static(b"hello"),
                }),
            },
            Entry {
                log_id: LogId::new(leader(4, 1), 9),
                payload: Payload::Membership(membership),
            },
        ];
        for entry in &entries {
            let encoded = encode_entry(entry).expect("encode");
            let decoded = decode_entry(&read_back(&encoded, entry.log_id.index))
                .expect("decode")
                .expect("an entry");
            assert_eq!(&decoded, entry);
        }
        let gap = encode_gap();
        assert_eq!(decode_entry(&read_back(&gap, 4)).expect("decode"), None);
    }

    #[test]
    fn reserved_record_types_are_refused() {
        let entry = Entry {
            log_id: LogId::new(leader(1, 1), 0),
            payload: Payload::Normal(PartitionRecord {
                record_type: RECORD_TYPE_GAP,
                timestamp_ms: 0,
                payload: Bytes::new(),
            }),
        };
        assert!(encode_entry(&entry).is_err());
        assert!(PartitionRecord::new(RECORD_TYPE_RESERVED_MIN, 0, Vec::new()).is_err());
    }

    #[test]
    fn a_membership_without_storage_identities_still_reads() {
        // Written by replicated-log format 1 and 2: one configuration {1}, node 1 at "a:1".
        let mut body = Vec::new();
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&1u64.to_le_bytes());
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&1u64.to_le_bytes());
        body.extend_from_slice(&3u32.to_le_bytes());
        body.extend_from_slice(b"a:1");
        let mut payload = entry_prefix(&leader(2, 1)).to_vec();
        payload.extend_from_slice(&body);
        let record = ReadRecord {
            offset: 4,
            record_type: RECORD_TYPE_MEMBERSHIP,
            flags: FLAG_REPLICATED,
            timestamp_ms: 0,
            payload,
        };
        let entry = decode_entry(&record).expect("decode").expect("an entry");
        let Payload::Membership(membership) = entry.payload else {
            panic!("not a membership: {entry:?}");
        };
        let nodes: Vec<_> = membership.nodes().collect();
        assert_eq!(nodes, [(&1, &NodeAddr::new("a:1"))]);
        // Read as the other encoding, the same bytes are refused, never misread.
        assert!(decode_membership(&body, MembershipBody::WithStorage).is_err());
    }

    #[test]
    fn arbitrary_payloads_never_panic() {
        // Every prefix and a few corruptions of a membership record decode to an error or an
        // entry, never a panic.
        let nodes = BTreeMap::from([(1u64, NodeAddr::new("a:1"))]);
        let membership = Membership::new(vec![BTreeSet::from([1])], nodes).expect("membership");
        let entry = Entry {
            log_id: LogId::new(leader(1, 1), 0),
            payload: Payload::Membership(membership),
        };
        let encoded = encode_entry(&entry).expect("encode");
        for len in 0..encoded.payload.len() {
            let mut record = read_back(&encoded, 0);
            record.payload.truncate(len);
            assert!(decode_entry(&record).is_err(), "prefix of {len} bytes");
        }
        for position in 0..encoded.payload.len() {
            let mut record = read_back(&encoded, 0);
            record.payload[position] ^= 0xff;
            let _ = decode_entry(&record);
        }
    }
}
