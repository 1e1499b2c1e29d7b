//! The bodies of the Raft RPCs between nodes, byte by byte as `docs/cluster-protocol.md` ("Raft
//! bodies") specifies: append-entries, vote (and pre-vote), full snapshots, leadership
//! transfers and the storage probe, their replies, and the kinds that name them in a
//! `keratin-net` request. Every request names the copy it is for ([`addressed_to`]): the
//! storage identity the sender's membership records for the receiver.
//!
//! Entries travel in the replicated-log record format ([`crate::entry_format`]): what a follower
//! receives is what it stores, checked by the same decoder. Input from the network never
//! panics: a malformed body is a [`RaftError::Invalid`] the server answers with
//! [`BAD_BODY`](super::codes::BAD_BODY).

use bytes::Bytes;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, TransferLeaderError, TransferLeaderRequest,
    VoteRequest, VoteResponse,
};

use crate::entry_format::{
    decode_membership, decode_shared, encode_entry, encode_membership, entry_prefix,
    MembershipBody, ENTRY_PREFIX_SIZE, FLAG_REPLICATED, RECORD_TYPE_RESERVED_MIN,
};
use crate::error::RaftError;
use crate::state_machine::{RecordsImage, SnapshotMeta, StoredMembership};
use crate::types::{Entry, LeaderId, LogId, PartitionRecord, Payload, StorageId, TypeConfig, Vote};

/// Request kind: append-entries with entries (heartbeats travel coalesced, see `client`).
pub const KIND_APPEND: u8 = 1;
/// Request kind: vote.
pub const KIND_VOTE: u8 = 2;
/// Request kind: pre-vote (a vote that changes nothing, openraft's Pre-Vote).
pub const KIND_PRE_VOTE: u8 = 3;
/// Request kind: a whole snapshot in one body.
pub const KIND_SNAPSHOT: u8 = 4;
/// Request kind: the leader hands its leadership to a voter (openraft's `TransferLeader`).
pub const KIND_TRANSFER_LEADER: u8 = 5;
/// Request kind: which copy of the group's storage the receiver holds, whether its log holds a
/// membership and its last entry ([`CopyStatus`]); answered whatever copy it is addressed to.
pub const KIND_STORAGE: u8 = 6;

/// Version byte that opens every Raft body; a receiver refuses other versions. Version 2 adds
/// the addressed storage identity to every request and the nodes' identities to a snapshot's
/// membership.
pub const RPC_VERSION: u8 = 2;

/// Bytes before a request's own fields: the version and the addressed storage identity.
const REQUEST_HEAD_BYTES: usize = 1 + 16;

/// Most entries one append-entries body may carry (openraft sends at most
/// `Config::max_payload_entries`, 300 by default).
pub const ENTRIES_MAX: u32 = 65_536;

const ENTRY_SIZE_MIN: usize = 8 + 1 + 8 + 4;

/// How a snapshot's data goes over the wire (a state machine's `SnapshotData`).
pub trait SnapshotWire: Sized + Send + 'static {
    /// Appends the snapshot data to `dst`.
    fn encode(&self, dst: &mut Vec<u8>) -> Result<(), RaftError>;
    /// Reads it back from exactly `bytes`.
    fn decode(bytes: &[u8]) -> Result<Self, RaftError>;
}

// ---------------------------------------------------------------------------------------------
// Writer and reader

struct Writer(Vec<u8>);

impl Writer {
    /// A reply body.
    fn new() -> Writer {
        Writer(vec![RPC_VERSION])
    }

    /// A request body for the copy `to` (`None`: its identity is not recorded).
    fn request(to: Option<StorageId>, capacity: usize) -> Writer {
        let mut w = Writer(Vec::with_capacity(REQUEST_HEAD_BYTES + capacity));
        w.u8(RPC_VERSION);
        w.0.extend_from_slice(&StorageId::to_wire(to).to_le_bytes());
        w
    }

    fn u8(&mut self, value: u8) {
        self.0.push(value);
    }

    fn u32(&mut self, value: u32) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn u64(&mut self, value: u64) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn bytes(&mut self, bytes: &[u8]) -> Result<(), RaftError> {
        let len = u32::try_from(bytes.len())
            .map_err(|_| RaftError::Invalid("a body field over 4 GiB".into()))?;
        self.u32(len);
        self.0.extend_from_slice(bytes);
        Ok(())
    }

    fn vote(&mut self, vote: &Vote) {
        self.u64(vote.leader_id.term);
        self.u64(vote.leader_id.node_id);
        self.u8(u8::from(vote.committed));
    }

    fn log_id(&mut self, log_id: Option<&LogId>) {
        match log_id {
            None => self.u8(0),
            Some(id) => {
                self.u8(1);
                self.u64(id.leader_id.term);
                self.u64(id.leader_id.node_id);
                self.u64(id.index);
            }
        }
    }
}

/// A reader over a received body; every read checks the bytes left.
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn open(body: &'a [u8], what: &'static str) -> Result<Reader<'a>, RaftError> {
        let mut reader = Reader { rest: body, what };
        let version = reader.u8()?;
        if version != RPC_VERSION {
            return Err(reader.bad(format!(
                "body version {version}, this node speaks {RPC_VERSION}"
            )));
        }
        Ok(reader)
    }

    /// A request body: the version, then the addressed identity, which the server checked
    /// already ([`addressed_to`]) and this skips.
    fn open_request(body: &'a [u8], what: &'static str) -> Result<Reader<'a>, RaftError> {
        let mut reader = Reader::open(body, what)?;
        reader.take(16)?;
        Ok(reader)
    }

    fn bad(&self, reason: String) -> RaftError {
        RaftError::Invalid(format!("{}: {reason}", self.what))
    }

    fn take(&mut self, count: usize) -> Result<&'a [u8], RaftError> {
        if self.rest.len() < count {
            return Err(self.bad(format!(
                "ends early ({count} bytes wanted, {} left)",
                self.rest.len()
            )));
        }
        let (head, rest) = self.rest.split_at(count);
        self.rest = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, RaftError> {
        Ok(self.take(1)?[0])
    }

    fn bool(&mut self) -> Result<bool, RaftError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.bad(format!("boolean byte {other}"))),
        }
    }

    fn u32(&mut self) -> Result<u32, RaftError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, RaftError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn u128(&mut self) -> Result<u128, RaftError> {
        let mut b = [0u8; 16];
        b.copy_from_slice(self.take(16)?);
        Ok(u128::from_le_bytes(b))
    }

    fn bytes(&mut self) -> Result<&'a [u8], RaftError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    fn vote(&mut self) -> Result<Vote, RaftError> {
        let term = self.u64()?;
        let node_id = self.u64()?;
        let committed = self.bool()?;
        Ok(Vote {
            leader_id: LeaderId { term, node_id },
            committed,
        })
    }

    fn log_id(&mut self) -> Result<Option<LogId>, RaftError> {
        if !self.bool()? {
            return Ok(None);
        }
        let term = self.u64()?;
        let node_id = self.u64()?;
        let index = self.u64()?;
        Ok(Some(LogId::new(LeaderId { term, node_id }, index)))
    }

    fn finish(self) -> Result<(), RaftError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(self.bad(format!("{} bytes after the last field", self.rest.len())))
        }
    }
}

/// The storage identity a request body is addressed to (`None`: the sender's membership does
/// not record the receiver's), read before anything else of it.
pub fn addressed_to(body: &[u8]) -> Result<Option<StorageId>, RaftError> {
    let mut r = Reader::open(body, "request")?;
    Ok(StorageId::from_u128(r.u128()?))
}

// ---------------------------------------------------------------------------------------------
// Append-entries

/// Fixed bytes of an append-entries body before its entries, after the request head: vote,
/// two log ids and the count.
const APPEND_HEAD_BYTES: usize = 17 + 2 * 25 + 4;

/// The bytes `entry` takes in an append-entries body: a normal entry's exact size (index, type,
/// timestamp, length, prefix, body); the others are small and may take a little more.
pub fn append_entry_bytes(entry: &Entry) -> usize {
    match &entry.payload {
        Payload::Normal(record) => ENTRY_SIZE_MIN + ENTRY_PREFIX_SIZE + record.payload.len(),
        _ => ENTRY_SIZE_MIN + ENTRY_PREFIX_SIZE,
    }
}

/// An append-entries request (with or without entries) for the copy `to`.
pub fn encode_append(
    rpc: &AppendEntriesRequest<TypeConfig>,
    to: Option<StorageId>,
) -> Result<Vec<u8>, RaftError> {
    let count = u32::try_from(rpc.entries.len())
        .ok()
        .filter(|count| *count <= ENTRIES_MAX)
        .ok_or_else(|| {
            RaftError::Invalid(format!("{} entries in one append", rpc.entries.len()))
        })?;
    // One allocation for the whole body.
    let entries_bytes: usize = rpc.entries.iter().map(append_entry_bytes).sum();
    let mut w = Writer::request(to, APPEND_HEAD_BYTES + entries_bytes);
    w.vote(&rpc.vote);
    w.log_id(rpc.prev_log_id.as_ref());
    w.log_id(rpc.leader_commit.as_ref());
    w.u32(count);
    for entry in &rpc.entries {
        w.u64(entry.log_id.index);
        match &entry.payload {
            // The record format written field by field, without an encoded copy in between
            // (the same bytes as `encode_entry`).
            Payload::Normal(record) if record.record_type < RECORD_TYPE_RESERVED_MIN => {
                let len = u32::try_from(ENTRY_PREFIX_SIZE + record.payload.len())
                    .map_err(|_| RaftError::Invalid("a body field over 4 GiB".into()))?;
                w.u8(record.record_type);
                w.u64(record.timestamp_ms);
                w.u32(len);
                w.0.extend_from_slice(&entry_prefix(&entry.log_id.leader_id));
                w.0.extend_from_slice(&record.payload);
            }
            _ => {
                let encoded = encode_entry(entry)?;
                w.u8(encoded.record_type);
                w.u64(encoded.timestamp_ms);
                w.bytes(&encoded.payload)?;
            }
        }
    }
    Ok(w.0)
}

/// Reads an append-entries request.
pub fn decode_append(body: &[u8]) -> Result<AppendEntriesRequest<TypeConfig>, RaftError> {
    decode_append_shared(&Bytes::copy_from_slice(body))
}

/// Reads an append-entries request received as `body`: the entries' payloads are slices of it,
/// not copies.
pub fn decode_append_shared(body: &Bytes) -> Result<AppendEntriesRequest<TypeConfig>, RaftError> {
    let mut r = Reader::open_request(body, "append-entries")?;
    let vote = r.vote()?;
    let prev_log_id = r.log_id()?;
    let leader_commit = r.log_id()?;
    let count = r.u32()?;
    if count > ENTRIES_MAX || (count as usize).saturating_mul(ENTRY_SIZE_MIN) > r.rest.len() {
        return Err(r.bad(format!("{count} entries do not fit")));
    }
    let mut entries: Vec<Entry> = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let offset = r.u64()?;
        let record_type = r.u8()?;
        let timestamp_ms = r.u64()?;
        let payload = body.slice_ref(r.bytes()?);
        let entry = decode_shared(offset, record_type, FLAG_REPLICATED, timestamp_ms, payload)
            .map_err(|e| RaftError::Invalid(format!("append-entries: {e}")))?
            .ok_or_else(|| r.bad(format!("a gap record at {offset} is not an entry")))?;
        // Each entry follows the one before it, the first one the previous log id: a follower
        // never fills a hole (`client.rs`, "Non-contiguous appends").
        let follows = entries
            .last()
            .map(|previous: &Entry| previous.log_id.index + 1)
            .unwrap_or_else(|| prev_log_id.as_ref().map_or(0, |prev| prev.index + 1));
        if entry.log_id.index != follows {
            return Err(r.bad(format!(
                "entry {} where entry {follows} must come",
                entry.log_id.index
            )));
        }
        entries.push(entry);
    }
    r.finish()?;
    Ok(AppendEntriesRequest {
        vote,
        prev_log_id,
        entries,
        leader_commit,
    })
}

/// An append-entries reply.
pub fn encode_append_reply(reply: &AppendEntriesResponse<TypeConfig>) -> Vec<u8> {
    let mut w = Writer::new();
    match reply {
        AppendEntriesResponse::Success => w.u8(0),
        AppendEntriesResponse::PartialSuccess(matching) => {
            w.u8(1);
            w.log_id(matching.as_ref());
        }
        AppendEntriesResponse::Conflict => w.u8(2),
        AppendEntriesResponse::HigherVote(vote) => {
            w.u8(3);
            w.vote(vote);
        }
    }
    w.0
}

/// Reads an append-entries reply.
pub fn decode_append_reply(body: &[u8]) -> Result<AppendEntriesResponse<TypeConfig>, RaftError> {
    let mut r = Reader::open(body, "append-entries reply")?;
    let reply = match r.u8()? {
        0 => AppendEntriesResponse::Success,
        1 => AppendEntriesResponse::PartialSuccess(r.log_id()?),
        2 => AppendEntriesResponse::Conflict,
        3 => AppendEntriesResponse::HigherVote(r.vote()?),
        other => return Err(r.bad(format!("reply tag {other}"))),
    };
    r.finish()?;
    Ok(reply)
}

// ---------------------------------------------------------------------------------------------
// Vote

/// A vote or pre-vote request for the copy `to`.
pub fn encode_vote(rpc: &VoteRequest<TypeConfig>, to: Option<StorageId>) -> Vec<u8> {
    let mut w = Writer::request(to, 17 + 25 + 1);
    w.vote(&rpc.vote);
    w.log_id(rpc.last_log_id.as_ref());
    w.u8(u8::from(rpc.leadership_transfer));
    w.0
}

/// Reads a vote or pre-vote request.
pub fn decode_vote(body: &[u8]) -> Result<VoteRequest<TypeConfig>, RaftError> {
    let mut r = Reader::open_request(body, "vote")?;
    let vote = r.vote()?;
    let last_log_id = r.log_id()?;
    let leadership_transfer = r.bool()?;
    r.finish()?;
    let mut request = VoteRequest::new(vote, last_log_id);
    request.leadership_transfer = leadership_transfer;
    Ok(request)
}

/// A vote reply.
pub fn encode_vote_reply(reply: &VoteResponse<TypeConfig>) -> Vec<u8> {
    let mut w = Writer::new();
    w.vote(&reply.vote);
    w.u8(u8::from(reply.vote_granted));
    w.log_id(reply.last_log_id.as_ref());
    w.0
}

/// Reads a vote reply.
pub fn decode_vote_reply(body: &[u8]) -> Result<VoteResponse<TypeConfig>, RaftError> {
    let mut r = Reader::open(body, "vote reply")?;
    let vote = r.vote()?;
    let granted = r.bool()?;
    let last_log_id = r.log_id()?;
    r.finish()?;
    Ok(VoteResponse::new(vote, last_log_id, granted))
}

// ---------------------------------------------------------------------------------------------
// Snapshots

/// A whole snapshot for the copy `to`: the leader's vote, the snapshot's meta and its data.
pub fn encode_snapshot<D: SnapshotWire>(
    vote: &Vote,
    meta: &SnapshotMeta,
    data: &D,
    to: Option<StorageId>,
) -> Result<Vec<u8>, RaftError> {
    let mut w = Writer::request(to, 0);
    w.vote(vote);
    w.log_id(meta.last_log_id.as_ref());
    w.log_id(meta.last_membership.log_id().as_ref());
    let membership = meta.last_membership.membership();
    w.bytes(&encode_membership(membership, MembershipBody::WithStorage)?)?;
    let mut bytes = Vec::new();
    data.encode(&mut bytes)?;
    w.bytes(&bytes)?;
    Ok(w.0)
}

/// Reads a whole snapshot.
pub fn decode_snapshot<D: SnapshotWire>(body: &[u8]) -> Result<(Vote, SnapshotMeta, D), RaftError> {
    let mut r = Reader::open_request(body, "snapshot")?;
    let vote = r.vote()?;
    let last_log_id = r.log_id()?;
    let membership_log_id = r.log_id()?;
    let membership = decode_membership(r.bytes()?, MembershipBody::WithStorage)
        .map_err(|reason| r.bad(reason))?;
    let data = D::decode(r.bytes()?)?;
    r.finish()?;
    let meta = SnapshotMeta {
        last_log_id,
        last_membership: StoredMembership::new(membership_log_id, membership),
    };
    Ok((vote, meta, data))
}

/// A snapshot reply: the receiver's vote.
pub fn encode_snapshot_reply(vote: &Vote) -> Vec<u8> {
    let mut w = Writer::new();
    w.vote(vote);
    w.0
}

/// Reads a snapshot reply.
pub fn decode_snapshot_reply(body: &[u8]) -> Result<Vote, RaftError> {
    let mut r = Reader::open(body, "snapshot reply")?;
    let vote = r.vote()?;
    r.finish()?;
    Ok(vote)
}

// ---------------------------------------------------------------------------------------------
// Leadership transfer

/// A leadership transfer for the copy `to`: the leader's vote, the node to take over, and the
/// last log id it must hold first.
pub fn encode_transfer_leader(
    rpc: &TransferLeaderRequest<TypeConfig>,
    to: Option<StorageId>,
) -> Vec<u8> {
    let mut w = Writer::request(to, 17 + 8 + 25);
    w.vote(rpc.from_leader());
    w.u64(*rpc.to_node_id());
    w.log_id(rpc.last_log_id());
    w.0
}

/// Reads a leadership transfer.
pub fn decode_transfer_leader(body: &[u8]) -> Result<TransferLeaderRequest<TypeConfig>, RaftError> {
    let mut r = Reader::open_request(body, "transfer leader")?;
    let from = r.vote()?;
    let to = r.u64()?;
    let last_log_id = r.log_id()?;
    r.finish()?;
    Ok(TransferLeaderRequest::new(from, to, last_log_id))
}

/// Transfer reply outcomes (the byte after the version).
const TRANSFER_ACCEPTED: u8 = 0;
const TRANSFER_VOTE_CHANGED: u8 = 1;
const TRANSFER_LOG_NOT_FLUSHED: u8 = 2;

/// A leadership transfer's reply: accepted, or why not (the votes, or the log ids, expected
/// and seen).
pub fn encode_transfer_leader_reply(
    reply: &Result<(), TransferLeaderError<TypeConfig>>,
) -> Vec<u8> {
    let mut w = Writer::new();
    match reply {
        Ok(()) => w.u8(TRANSFER_ACCEPTED),
        Err(TransferLeaderError::VoteChanged { expected, actual }) => {
            w.u8(TRANSFER_VOTE_CHANGED);
            w.vote(expected);
            w.vote(actual);
        }
        Err(TransferLeaderError::LogNotFlushed { expected, actual }) => {
            w.u8(TRANSFER_LOG_NOT_FLUSHED);
            w.log_id(expected.as_ref());
            w.log_id(actual.as_ref());
        }
    }
    w.0
}

/// Reads a leadership transfer's reply.
pub fn decode_transfer_leader_reply(
    body: &[u8],
) -> Result<Result<(), TransferLeaderError<TypeConfig>>, RaftError> {
    let mut r = Reader::open(body, "transfer leader reply")?;
    let reply = match r.u8()? {
        TRANSFER_ACCEPTED => Ok(()),
        TRANSFER_VOTE_CHANGED => Err(TransferLeaderError::VoteChanged {
            expected: r.vote()?,
            actual: r.vote()?,
        }),
        TRANSFER_LOG_NOT_FLUSHED => Err(TransferLeaderError::LogNotFlushed {
            expected: r.log_id()?,
            actual: r.log_id()?,
        }),
        other => return Err(r.bad(format!("unknown transfer outcome {other}"))),
    };
    r.finish()?;
    Ok(reply)
}

// ---------------------------------------------------------------------------------------------
// Storage probe

/// What a node holds of a group, as it answers [`KIND_STORAGE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStatus {
    /// Its copy's storage identity.
    pub storage: StorageId,
    /// Its log holds a membership (it formed the group, or a leader reached it).
    pub member: bool,
    /// The index of its last entry (`None`: an empty log).
    pub last_index: Option<u64>,
}

/// A storage probe (the request names no copy: any copy answers).
pub fn encode_storage_probe() -> Vec<u8> {
    Writer::request(None, 0).0
}

/// A storage probe's reply.
pub fn encode_storage_reply(status: &CopyStatus) -> Vec<u8> {
    let mut w = Writer::new();
    w.0.extend_from_slice(&status.storage.get().to_le_bytes());
    w.u8(u8::from(status.member));
    match status.last_index {
        None => w.u8(0),
        Some(index) => {
            w.u8(1);
            w.u64(index);
        }
    }
    w.0
}

/// Reads a storage probe's reply.
pub fn decode_storage_reply(body: &[u8]) -> Result<CopyStatus, RaftError> {
    let mut r = Reader::open(body, "storage reply")?;
    let storage = StorageId::from_u128(r.u128()?)
        .ok_or_else(|| r.bad("a storage identity of zero".into()))?;
    let member = r.bool()?;
    let last_index = match r.bool()? {
        false => None,
        true => Some(r.u64()?),
    };
    r.finish()?;
    Ok(CopyStatus {
        storage,
        member,
        last_index,
    })
}

/// The test state machine's image: its records by offset.
impl SnapshotWire for RecordsImage {
    fn encode(&self, dst: &mut Vec<u8>) -> Result<(), RaftError> {
        let count = u32::try_from(self.records.len())
            .map_err(|_| RaftError::Invalid("more than 4 G records in a snapshot".into()))?;
        let mut w = Writer(Vec::new());
        w.u32(count);
        for (offset, record) in &self.records {
            w.u64(*offset);
            w.u8(record.record_type);
            w.u64(record.timestamp_ms);
            w.bytes(&record.payload)?;
        }
        dst.extend_from_slice(&w.0);
        Ok(())
    }

    fn decode(bytes: &[u8]) -> Result<RecordsImage, RaftError> {
        let mut r = Reader {
            rest: bytes,
            what: "records image",
        };
        let count = r.u32()?;
        let mut records = std::collections::BTreeMap::new();
        for _ in 0..count {
            let offset = r.u64()?;
            let record_type = r.u8()?;
            let timestamp_ms = r.u64()?;
            let payload = r.bytes()?.to_vec();
            let record = PartitionRecord::new(record_type, timestamp_ms, payload)?;
            records.insert(offset, record);
        }
        r.finish()?;
        Ok(RecordsImage { records })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::types::{Membership, NodeAddr, Payload};

    fn leader(term: u64, node_id: u64) -> LeaderId {
        LeaderId { term, node_id }
    }

    fn membership() -> Membership {
        let nodes = (1..=3u64)
            .map(|id| {
                let addr = format!("127.0.0.{id}:7000");
                let node = match StorageId::from_u128(u128::from(id) * 1_000_003) {
                    Some(storage) if id != 2 => NodeAddr::with_storage(addr, storage),
                    _ => NodeAddr::new(addr),
                };
                (id, node)
            })
            .collect::<BTreeMap<_, _>>();
        Membership::new(vec![BTreeSet::from([1, 2, 3])], nodes).expect("membership")
    }

    fn append() -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote {
                leader_id: leader(4, 2),
                committed: true,
            },
            prev_log_id: Some(LogId::new(leader(3, 1), 9)),
            leader_commit: Some(LogId::new(leader(3, 1), 8)),
            entries: vec![
                Entry {
                    log_id: LogId::new(leader(4, 2), 10),
                    payload: Payload::Blank,
                },
                Entry {
                    log_id: LogId::new(leader(4, 2), 11),
                    payload: Payload::Normal(
                        PartitionRecord::new(1, 1_700_000_000_000, b"hello".to_vec())
                            .expect("record"),
                    ),
                },
                Entry {
                    log_id: LogId::new(leader(4, 2), 12),
                    payload: Payload::Membership(membership()),
                },
            ],
        }
    }

    #[test]
    fn every_body_roundtrips() {
        let rpc = append();
        // AppendEntriesRequest has no PartialEq; its Debug form shows every field.
        let same = |a: &AppendEntriesRequest<TypeConfig>, b: &AppendEntriesRequest<TypeConfig>| {
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
        };
        let to = StorageId::from_u128(0xfeed << 64 | 9);
        let body = encode_append(&rpc, to).unwrap();
        assert_eq!(addressed_to(&body).unwrap(), to);
        same(&decode_append(&body).unwrap(), &rpc);
        let heartbeat = AppendEntriesRequest {
            entries: Vec::new(),
            ..append()
        };
        let body = encode_append(&heartbeat, None).unwrap();
        assert_eq!(addressed_to(&body).unwrap(), None);
        same(&decode_append(&body).unwrap(), &heartbeat);
        for reply in [
            AppendEntriesResponse::Success,
            AppendEntriesResponse::PartialSuccess(None),
            AppendEntriesResponse::PartialSuccess(Some(LogId::new(leader(2, 3), 5))),
            AppendEntriesResponse::Conflict,
            AppendEntriesResponse::HigherVote(Vote {
                leader_id: leader(9, 1),
                committed: false,
            }),
        ] {
            let body = encode_append_reply(&reply);
            assert_eq!(decode_append_reply(&body).unwrap(), reply);
        }
        let mut vote = VoteRequest::new(
            Vote {
                leader_id: leader(5, 3),
                committed: false,
            },
            Some(LogId::new(leader(4, 2), 12)),
        );
        vote.leadership_transfer = true;
        let body = encode_vote(&vote, to);
        assert_eq!(addressed_to(&body).unwrap(), to);
        assert_eq!(decode_vote(&body).unwrap(), vote);
        let reply = VoteResponse::new(vote.vote, None, true);
        assert_eq!(
            decode_vote_reply(&encode_vote_reply(&reply)).unwrap(),
            reply
        );
        assert_eq!(
            decode_snapshot_reply(&encode_snapshot_reply(&vote.vote)).unwrap(),
            vote.vote
        );
        let meta = SnapshotMeta {
            last_log_id: Some(LogId::new(leader(4, 2), 12)),
            last_membership: StoredMembership::new(
                Some(LogId::new(leader(4, 2), 12)),
                membership(),
            ),
        };
        let image = RecordsImage {
            records: [(
                11,
                PartitionRecord::new(1, 5, b"hello".to_vec()).expect("record"),
            )]
            .into(),
        };
        let body = encode_snapshot(&vote.vote, &meta, &image, to).unwrap();
        assert_eq!(addressed_to(&body).unwrap(), to);
        let (got_vote, got_meta, got_image) = decode_snapshot::<RecordsImage>(&body).unwrap();
        assert_eq!((got_vote, got_meta, got_image), (vote.vote, meta, image));
        let transfer = TransferLeaderRequest::new(vote.vote, 2, Some(LogId::new(leader(5, 3), 40)));
        let got = decode_transfer_leader(&encode_transfer_leader(&transfer, to)).unwrap();
        assert_eq!(format!("{got}"), format!("{transfer}"));
        for reply in [
            Ok(()),
            Err(TransferLeaderError::VoteChanged {
                expected: vote.vote,
                actual: Vote {
                    leader_id: leader(6, 2),
                    committed: true,
                },
            }),
            Err(TransferLeaderError::LogNotFlushed {
                expected: Some(LogId::new(leader(5, 3), 40)),
                actual: None,
            }),
        ] {
            let body = encode_transfer_leader_reply(&reply);
            assert_eq!(decode_transfer_leader_reply(&body).unwrap(), reply);
        }
    }

    #[test]
    fn a_storage_reply_roundtrips() {
        for status in [
            CopyStatus {
                storage: StorageId::from_u128(u128::MAX).unwrap(),
                member: true,
                last_index: Some(41),
            },
            CopyStatus {
                storage: StorageId::from_u128(1).unwrap(),
                member: false,
                last_index: None,
            },
        ] {
            assert_eq!(
                decode_storage_reply(&encode_storage_reply(&status)).unwrap(),
                status
            );
        }
        let probe = encode_storage_probe();
        assert_eq!(addressed_to(&probe).unwrap(), None);
        // A reply naming identity zero is refused.
        let mut zero = encode_storage_reply(&CopyStatus {
            storage: StorageId::from_u128(5).unwrap(),
            member: true,
            last_index: None,
        });
        zero[1] = 0;
        assert!(decode_storage_reply(&zero).is_err());
    }

    #[test]
    fn malformed_bodies_are_errors_never_panics() {
        let body = encode_append(&append(), None).unwrap();
        for cut in 0..body.len() {
            assert!(decode_append(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = body.clone();
        trailing.push(0);
        assert!(decode_append(&trailing).is_err());
        let mut version = body.clone();
        version[0] = 1;
        assert!(decode_append(&version).is_err());
        // A count that cannot fit is refused before anything is allocated for it.
        let mut w = Writer::request(None, 0);
        w.vote(&append().vote);
        w.log_id(None);
        w.log_id(None);
        w.u32(ENTRIES_MAX);
        assert!(decode_append(&w.0).is_err());
        // Entries out of order.
        let mut rpc = append();
        rpc.entries.swap(0, 1);
        assert!(decode_append(&encode_append(&rpc, None).unwrap()).is_err());
        // A first entry that does not follow the previous log id (9): entries 11 and 12.
        let mut rpc = append();
        rpc.entries.remove(0);
        assert!(decode_append(&encode_append(&rpc, None).unwrap()).is_err());
        // Without a previous log id the first entry is 0.
        let mut rpc = append();
        rpc.prev_log_id = None;
        assert!(decode_append(&encode_append(&rpc, None).unwrap()).is_err());
        // Arbitrary bytes.
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for len in 0..512 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = decode_append(&bytes);
            let _ = decode_append_reply(&bytes);
            let _ = decode_vote(&bytes);
            let _ = decode_vote_reply(&bytes);
            let _ = decode_transfer_leader(&bytes);
            let _ = decode_transfer_leader_reply(&bytes);
            let _ = decode_storage_reply(&bytes);
            let _ = addressed_to(&bytes);
        }
    }
}
