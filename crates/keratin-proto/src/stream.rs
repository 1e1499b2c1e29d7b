//! The structs of the stream frames of protocol version 7 ([`crate::PROTOCOL_VERSION_STREAMS`],
//! issue 18) and the bounds the codec holds them to.
//!
//! Owns what a stream frame *means*; its bytes belong to `stream_body.rs` and `docs/protocol.md`
//! ("Stream frames"), what a server does with it to `keratin-server` and `docs/streams.md`. As
//! for queues, the codec checks structure only (lengths, tags, UTF-8, the bounds below); names,
//! partition numbers and their order are checked by the receiver, which answers a non-fatal 400.

use bytes::Bytes;

use crate::error_body::ErrorBody;
use crate::frame::{Header, Update};

/// Most partitions a stream has (`docs/streams.md`, "Model": 1 to 64, as a queue), and so the
/// most entries of every per-partition list of a stream frame (`StreamSubscribe.partitions`,
/// `CursorCommit.entries`, `StreamInfoReply.partitions`). A longer list is malformed.
pub const STREAM_PARTITIONS_MAX: usize = 64;

/// Most nodes a `StreamDeclare` pins its replicas to: as many as a server info lists
/// ([`crate::SERVER_INFO_NODES_MAX`]), more than any cluster Keratin runs.
pub const STREAM_NODES_MAX: usize = crate::handshake::SERVER_INFO_NODES_MAX;

/// Most messages in one `StreamDeliver`: the server's batch (`docs/streams.md`, "Reading": up to
/// 256 messages or 1 MiB). The bound keeps a decoded frame small in memory as well as on the
/// wire: without it a 16 MiB frame of 23-byte empty messages decodes to about 730,000 structs
/// (some 70 MiB); with it a frame holds at most 256 structs besides its bodies.
pub const STREAM_DELIVER_MESSAGES_MAX: usize = 256;

const _: () = assert!(STREAM_PARTITIONS_MAX <= u16::MAX as usize);
const _: () = assert!(STREAM_NODES_MAX <= u16::MAX as usize);

/// A stream's settings, as declared and as `StreamInfoReply` reports them. `None` means "not
/// set": no bound of that kind, or (for `replicas`) the cluster's choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSettings {
    /// Number of partitions, 1 to 64; fixed at declaration.
    pub partitions: u32,
    /// Nodes holding a copy of each partition; `None` lets the cluster choose. Fixed at
    /// declaration.
    pub replicas: Option<u32>,
    /// Retention by size: the stream's bytes on disk over all partitions.
    pub max_bytes: Option<u64>,
    /// Retention by age: a segment is removed once its newest message is older than this.
    pub max_age_ms: Option<u64>,
    /// Retention by count: the messages held over all partitions.
    pub max_messages: Option<u64>,
}

impl Default for StreamSettings {
    fn default() -> StreamSettings {
        StreamSettings {
            partitions: 1,
            replicas: None,
            max_bytes: None,
            max_age_ms: None,
            max_messages: None,
        }
    }
}

/// The retention of a live stream, changed by `StreamSet`: each bound kept, cleared or set.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamRetentionUpdate {
    /// See [`StreamSettings::max_bytes`].
    pub max_bytes: Update<u64>,
    /// See [`StreamSettings::max_age_ms`].
    pub max_age_ms: Update<u64>,
    /// See [`StreamSettings::max_messages`].
    pub max_messages: Update<u64>,
}

/// Body of [`crate::Frame::StreamDeclare`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDeclare {
    /// Echoed by the reply (`Ok` or `Error`).
    pub request_id: u64,
    /// The stream's name; a queue of that name is a 409.
    pub stream: String,
    /// Its settings; a stream that exists with other settings is a 409.
    pub settings: StreamSettings,
    /// The nodes that hold each partition's replicas, as `Declare.nodes`; empty lets the
    /// cluster place them. At most [`STREAM_NODES_MAX`].
    pub nodes: Vec<u64>,
}

/// Body of [`crate::Frame::StreamSet`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSet {
    /// Echoed by the reply (`Ok` or `Error`).
    pub request_id: u64,
    /// The stream's name.
    pub stream: String,
    /// The retention bounds to change.
    pub update: StreamRetentionUpdate,
}

/// Body of [`crate::Frame::StreamInfo`] and [`crate::Frame::StreamDelete`]: a request naming a
/// stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRequest {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The stream's name.
    pub stream: String,
}

/// Body of [`crate::Frame::StreamList`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamList {
    /// Echoed by the reply.
    pub request_id: u64,
}

/// Where a reader starts in a partition that its cursor has no position for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamStart {
    /// The oldest message the partition holds.
    First,
    /// The newest message (it is delivered, then what follows).
    Last,
    /// Only messages appended after the subscription.
    Next,
    /// The message at this offset, or the first after it; the partition's start if below it.
    Offset(u64),
    /// The first message appended at or after this time, in ms since the Unix epoch.
    Timestamp(u64),
}

impl StreamStart {
    /// The wire's kind byte.
    pub fn kind(self) -> u8 {
        match self {
            StreamStart::First => 0,
            StreamStart::Last => 1,
            StreamStart::Next => 2,
            StreamStart::Offset(_) => 3,
            StreamStart::Timestamp(_) => 4,
        }
    }

    /// The wire's value: the offset or the time, 0 for the kinds without one.
    pub fn value(self) -> u64 {
        match self {
            StreamStart::First | StreamStart::Last | StreamStart::Next => 0,
            StreamStart::Offset(value) | StreamStart::Timestamp(value) => value,
        }
    }

    /// The start for a kind byte and value, or `None` for a kind the protocol does not define
    /// or a non-zero value with a kind that has none (one encoding per start).
    pub fn from_parts(kind: u8, value: u64) -> Option<StreamStart> {
        match (kind, value) {
            (0, 0) => Some(StreamStart::First),
            (1, 0) => Some(StreamStart::Last),
            (2, 0) => Some(StreamStart::Next),
            (3, offset) => Some(StreamStart::Offset(offset)),
            (4, time_ms) => Some(StreamStart::Timestamp(time_ms)),
            _ => None,
        }
    }
}

/// Body of [`crate::Frame::StreamSubscribe`]. Answered by `SubscribeOk`, then `StreamDeliver`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSubscribe {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The stream's name.
    pub stream: String,
    /// Chosen by the client, unique on the connection among consumers of queues and streams.
    pub consumer_tag: String,
    /// The named cursor to resume from and commit to; `None` reads without a cursor.
    pub cursor: Option<String>,
    /// Share the stream's partitions with the other readers of the same cursor (a group).
    pub group: bool,
    /// Where to start in a partition the cursor has no position for.
    pub start: StreamStart,
    /// Messages the server may send before the client gives more with `StreamCredit`.
    pub credit: u32,
    /// The server commits the delivered positions to the cursor every second and at the end.
    pub auto_commit: bool,
    /// The partitions to read; empty reads all (or, in a group, those the group assigns).
    /// At most [`STREAM_PARTITIONS_MAX`].
    pub partitions: Vec<u32>,
}

/// Body of [`crate::Frame::StreamCredit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCredit {
    /// The stream consumer that gets more credit.
    pub consumer_tag: String,
    /// More messages the server may send it, added to what is left.
    pub credit: u32,
}

/// One partition's position in a [`CursorCommit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CursorEntry {
    /// The partition.
    pub partition: u32,
    /// The offset of the next message the cursor reads in it.
    pub offset: u64,
}

/// Body of [`crate::Frame::CursorCommit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorCommit {
    /// Echoed by the reply, sent once the commit is durable.
    pub request_id: u64,
    /// The stream's name.
    pub stream: String,
    /// The cursor's name.
    pub cursor: String,
    /// The positions to set; other partitions keep theirs. 1 to [`STREAM_PARTITIONS_MAX`]
    /// entries, partitions ascending (the receiver checks the order and the count's floor).
    pub entries: Vec<CursorEntry>,
}

/// One partition of a [`StreamInfoReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPartitionInfo {
    /// The offset of the oldest record held (retention moves it up).
    pub start_offset: u64,
    /// The offset the next record gets.
    pub next_offset: u64,
    /// Messages held.
    pub messages: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Bytes the partition's log occupies on disk.
    pub disk_bytes: u64,
    /// The `timestamp_ms` of the oldest message held; `None` when it holds none.
    pub oldest_timestamp_ms: Option<u64>,
    /// Whether the answering node leads this partition.
    pub leading: bool,
    /// The leading node's id, when one is known.
    pub leader: Option<u64>,
    /// The leading node's protocol address, when known and another node leads.
    pub leader_addr: Option<String>,
}

/// Body of [`crate::Frame::StreamInfoReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfoReply {
    /// The request answered.
    pub request_id: u64,
    /// The stream's name.
    pub stream: String,
    /// Its current settings.
    pub settings: StreamSettings,
    /// One entry per partition, in partition order; at most [`STREAM_PARTITIONS_MAX`].
    pub partitions: Vec<StreamPartitionInfo>,
}

/// One stream in a [`StreamListReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSummary {
    /// The stream's name.
    pub stream: String,
    /// Number of partitions.
    pub partitions: u32,
    /// Messages held over all partitions.
    pub messages: u64,
    /// Their payload bytes.
    pub bytes: u64,
}

/// Body of [`crate::Frame::StreamListReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamListReply {
    /// The request answered.
    pub request_id: u64,
    /// Every stream, sorted by name.
    pub streams: Vec<StreamSummary>,
}

/// One message of a [`StreamDeliver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// Its offset in the partition's log.
    pub offset: u64,
    /// When the leader appended it, in ms since the Unix epoch.
    pub timestamp_ms: u64,
    /// The routing key it was published with.
    pub routing_key: Option<String>,
    /// Application headers, as published.
    pub headers: Vec<Header>,
    /// The payload.
    pub body: Bytes,
}

/// Body of [`crate::Frame::StreamDeliver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDeliver {
    /// The stream consumer these messages are for.
    pub consumer_tag: String,
    /// The partition they come from.
    pub partition: u32,
    /// Set when the reader's position (this offset) was below the partition's start, which
    /// retention had moved, and the reader was moved to the start.
    pub moved_from: Option<u64>,
    /// The messages, offsets ascending; at most [`STREAM_DELIVER_MESSAGES_MAX`].
    pub messages: Vec<StreamMessage>,
}

/// Body of [`crate::Frame::StreamPartitionEnd`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPartitionEnd {
    /// The stream consumer that stops reading the partition.
    pub consumer_tag: String,
    /// The partition.
    pub partition: u32,
    /// Why: reassigned in a group, the stream deleted, or a leader change (421 with
    /// `leader_addr`).
    pub error: ErrorBody,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_parts_roundtrip_and_refuse_other_encodings() {
        for start in [
            StreamStart::First,
            StreamStart::Last,
            StreamStart::Next,
            StreamStart::Offset(7),
            StreamStart::Timestamp(u64::MAX),
        ] {
            assert_eq!(
                StreamStart::from_parts(start.kind(), start.value()),
                Some(start)
            );
        }
        assert_eq!(StreamStart::from_parts(5, 0), None);
        assert_eq!(StreamStart::from_parts(0, 1), None);
        assert_eq!(StreamStart::from_parts(2, u64::MAX), None);
    }
}
