//! The frames of protocol versions 1 to 7: the [`Frame`] enum, its type numbers and the structs
//! each frame carries (the stream frames of version 7 carry the structs of [`crate::stream`]).
//!
//! Owns what a frame *means*. How it is laid out in bytes belongs to [`crate::codec`] and
//! `docs/protocol.md` ("Frames"); what a server does with it belongs to `keratin-server`. The codec
//! checks structure only (lengths, tags, UTF-8, ranges); queue names, partition counts and which
//! direction a frame may travel are checked by the receiver, which answers a non-fatal 400.

use bytes::Bytes;

use crate::error_body::ErrorBody;
use crate::handshake::PROTOCOL_VERSION_STREAMS;
use crate::stream::{
    CursorCommit, StreamCredit, StreamDeclare, StreamDeliver, StreamInfoReply, StreamList,
    StreamListReply, StreamPartitionEnd, StreamRequest, StreamSet, StreamSubscribe,
};

/// The protocol version that added [`FrameType::ConsumerEnd`].
const CONSUMER_END_SINCE: u16 = 4;

/// A frame's type byte. The numbers are part of the protocol and never change meaning.
///
/// Requests (client to server) use `0x01..=0x3f`, replies and pushes (server to client)
/// `0x40..=0x7f`, and frames either side may send `0xf0..=0xff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// [`Frame::Declare`]
    Declare = 0x01,
    /// [`Frame::Delete`]
    Delete = 0x02,
    /// [`Frame::Purge`]
    Purge = 0x03,
    /// [`Frame::QueueInfo`]
    QueueInfo = 0x04,
    /// [`Frame::QueueList`]
    QueueList = 0x05,
    /// [`Frame::SetQueueSettings`]
    SetQueueSettings = 0x06,
    /// [`Frame::StreamDeclare`] (protocol version 7 and later)
    StreamDeclare = 0x07,
    /// [`Frame::StreamSet`] (protocol version 7 and later)
    StreamSet = 0x08,
    /// [`Frame::StreamInfo`] (protocol version 7 and later)
    StreamInfo = 0x09,
    /// [`Frame::StreamList`] (protocol version 7 and later)
    StreamList = 0x0a,
    /// [`Frame::StreamDelete`] (protocol version 7 and later)
    StreamDelete = 0x0b,
    /// [`Frame::Publish`]
    Publish = 0x10,
    /// [`Frame::Subscribe`]
    Subscribe = 0x20,
    /// [`Frame::Cancel`]
    Cancel = 0x21,
    /// [`Frame::Ack`]
    Ack = 0x22,
    /// [`Frame::Reject`]
    Reject = 0x23,
    /// [`Frame::StreamSubscribe`] (protocol version 7 and later)
    StreamSubscribe = 0x24,
    /// [`Frame::StreamCredit`] (protocol version 7 and later)
    StreamCredit = 0x25,
    /// [`Frame::CursorCommit`] (protocol version 7 and later)
    CursorCommit = 0x26,
    /// [`Frame::Ok`]
    Ok = 0x40,
    /// [`Frame::QueueInfoReply`]
    QueueInfoReply = 0x41,
    /// [`Frame::QueueListReply`]
    QueueListReply = 0x42,
    /// [`Frame::SubscribeOk`]
    SubscribeOk = 0x43,
    /// [`Frame::StreamInfoReply`] (protocol version 7 and later)
    StreamInfoReply = 0x44,
    /// [`Frame::StreamListReply`] (protocol version 7 and later)
    StreamListReply = 0x45,
    /// [`Frame::Confirm`]
    Confirm = 0x50,
    /// [`Frame::PublishError`]
    PublishError = 0x51,
    /// [`Frame::Deliver`]
    Deliver = 0x60,
    /// [`Frame::ConsumerEnd`] (protocol version 4 and later)
    ConsumerEnd = 0x61,
    /// [`Frame::StreamDeliver`] (protocol version 7 and later)
    StreamDeliver = 0x62,
    /// [`Frame::StreamPartitionEnd`] (protocol version 7 and later)
    StreamPartitionEnd = 0x63,
    /// [`Frame::Heartbeat`]
    Heartbeat = 0xf0,
    /// [`Frame::Error`]
    Error = 0xf1,
    /// [`Frame::Close`]
    Close = 0xf2,
}

impl FrameType {
    /// Every frame type of every protocol version this crate speaks (up to
    /// [`PROTOCOL_VERSION_STREAMS`]); [`FrameType::since`] says which version added each.
    pub const ALL: [FrameType; 34] = [
        FrameType::Declare,
        FrameType::Delete,
        FrameType::Purge,
        FrameType::QueueInfo,
        FrameType::QueueList,
        FrameType::SetQueueSettings,
        FrameType::StreamDeclare,
        FrameType::StreamSet,
        FrameType::StreamInfo,
        FrameType::StreamList,
        FrameType::StreamDelete,
        FrameType::Publish,
        FrameType::Subscribe,
        FrameType::Cancel,
        FrameType::Ack,
        FrameType::Reject,
        FrameType::StreamSubscribe,
        FrameType::StreamCredit,
        FrameType::CursorCommit,
        FrameType::Ok,
        FrameType::QueueInfoReply,
        FrameType::QueueListReply,
        FrameType::SubscribeOk,
        FrameType::StreamInfoReply,
        FrameType::StreamListReply,
        FrameType::Confirm,
        FrameType::PublishError,
        FrameType::Deliver,
        FrameType::ConsumerEnd,
        FrameType::StreamDeliver,
        FrameType::StreamPartitionEnd,
        FrameType::Heartbeat,
        FrameType::Error,
        FrameType::Close,
    ];

    /// The type for a type byte in any version this crate speaks, or `None` if none defines
    /// it. A connection asks [`FrameType::from_u8_in`] with its own version.
    pub fn from_u8(byte: u8) -> Option<FrameType> {
        FrameType::ALL
            .iter()
            .copied()
            .find(|frame_type| *frame_type as u8 == byte)
    }

    /// The type for a type byte in protocol `version`, or `None` if that version does not
    /// define it (a type a later version added is as unknown as any other).
    pub fn from_u8_in(byte: u8, version: u16) -> Option<FrameType> {
        FrameType::from_u8(byte).filter(|frame_type| frame_type.since() <= version)
    }

    /// The protocol version that added this type.
    pub fn since(self) -> u16 {
        match self {
            FrameType::ConsumerEnd => CONSUMER_END_SINCE,
            stream if stream.is_stream() => PROTOCOL_VERSION_STREAMS,
            _ => 1,
        }
    }

    /// Whether this is one of version 7's stream frames (`docs/streams.md`).
    pub fn is_stream(self) -> bool {
        matches!(
            self,
            FrameType::StreamDeclare
                | FrameType::StreamSet
                | FrameType::StreamInfo
                | FrameType::StreamList
                | FrameType::StreamDelete
                | FrameType::StreamSubscribe
                | FrameType::StreamCredit
                | FrameType::CursorCommit
                | FrameType::StreamInfoReply
                | FrameType::StreamListReply
                | FrameType::StreamDeliver
                | FrameType::StreamPartitionEnd
        )
    }

    /// The name used in the spec and in error messages.
    pub fn name(self) -> &'static str {
        match self {
            FrameType::Declare => "Declare",
            FrameType::Delete => "Delete",
            FrameType::Purge => "Purge",
            FrameType::QueueInfo => "QueueInfo",
            FrameType::QueueList => "QueueList",
            FrameType::SetQueueSettings => "SetQueueSettings",
            FrameType::StreamDeclare => "StreamDeclare",
            FrameType::StreamSet => "StreamSet",
            FrameType::StreamInfo => "StreamInfo",
            FrameType::StreamList => "StreamList",
            FrameType::StreamDelete => "StreamDelete",
            FrameType::Publish => "Publish",
            FrameType::Subscribe => "Subscribe",
            FrameType::Cancel => "Cancel",
            FrameType::Ack => "Ack",
            FrameType::Reject => "Reject",
            FrameType::StreamSubscribe => "StreamSubscribe",
            FrameType::StreamCredit => "StreamCredit",
            FrameType::CursorCommit => "CursorCommit",
            FrameType::Ok => "Ok",
            FrameType::QueueInfoReply => "QueueInfoReply",
            FrameType::QueueListReply => "QueueListReply",
            FrameType::SubscribeOk => "SubscribeOk",
            FrameType::StreamInfoReply => "StreamInfoReply",
            FrameType::StreamListReply => "StreamListReply",
            FrameType::Confirm => "Confirm",
            FrameType::PublishError => "PublishError",
            FrameType::Deliver => "Deliver",
            FrameType::ConsumerEnd => "ConsumerEnd",
            FrameType::StreamDeliver => "StreamDeliver",
            FrameType::StreamPartitionEnd => "StreamPartitionEnd",
            FrameType::Heartbeat => "Heartbeat",
            FrameType::Error => "Error",
            FrameType::Close => "Close",
        }
    }
}

/// One protocol frame. Requests that expect a reply carry a `request_id` chosen by the client;
/// the reply (or an [`ErrorFrame`]) echoes it. Publishes are answered per message by publish id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Create a queue, or confirm it exists with the same settings. Reply: `Ok`.
    Declare(Declare),
    /// Delete a queue and its messages. Reply: `Ok`.
    Delete(QueueRequest),
    /// Remove every ready message of a queue. Reply: `Ok`.
    Purge(QueueRequest),
    /// Ask for a queue's settings and per-partition counts. Reply: `QueueInfoReply`.
    QueueInfo(QueueRequest),
    /// Ask for every queue. Reply: `QueueListReply`.
    QueueList(QueueList),
    /// Change settings of a live queue, for example its limits. Reply: `Ok`.
    SetQueueSettings(SetQueueSettings),
    /// Create a stream, or confirm it exists with the same settings. Reply: `Ok`. Version 7.
    StreamDeclare(StreamDeclare),
    /// Change a live stream's retention. Reply: `Ok`. Version 7.
    StreamSet(StreamSet),
    /// Ask for a stream's settings and per-partition figures. Reply: `StreamInfoReply`.
    /// Version 7.
    StreamInfo(StreamRequest),
    /// Ask for every stream. Reply: `StreamListReply`. Version 7.
    StreamList(StreamList),
    /// Delete a stream, its messages and cursors. Reply: `Ok`. Version 7.
    StreamDelete(StreamRequest),
    /// A batch of messages for one queue. Answered by `Confirm` and `PublishError` by publish id.
    Publish(Publish),
    /// Start a consumer. Reply: `SubscribeOk`, then `Deliver` frames.
    Subscribe(Subscribe),
    /// Stop a consumer; its unacknowledged deliveries return to ready. Reply: `Ok`.
    Cancel(Cancel),
    /// Acknowledge deliveries. No reply; unknown delivery ids get a non-fatal `Error`.
    Ack(Ack),
    /// Reject deliveries, requeueing or dead-lettering them. No reply, like `Ack`.
    Reject(Reject),
    /// Start reading a stream. Reply: `SubscribeOk`, then `StreamDeliver` frames. Version 7.
    StreamSubscribe(StreamSubscribe),
    /// Give a stream consumer more credit. No reply; an unknown tag gets a non-fatal `Error`.
    /// Version 7.
    StreamCredit(StreamCredit),
    /// Set a cursor's positions. Reply: `Ok`, once durable. Version 7.
    CursorCommit(CursorCommit),
    /// A request succeeded.
    Ok(OkReply),
    /// Answer to `QueueInfo`.
    QueueInfoReply(QueueInfoReply),
    /// Answer to `QueueList`.
    QueueListReply(QueueListReply),
    /// Answer to `Subscribe` and `StreamSubscribe`: the consumer is registered.
    SubscribeOk(SubscribeOk),
    /// Answer to `StreamInfo`. Version 7.
    StreamInfoReply(StreamInfoReply),
    /// Answer to `StreamList`. Version 7.
    StreamListReply(StreamListReply),
    /// Publishes that are durable (synced to disk).
    Confirm(Confirm),
    /// Publishes that failed, with why.
    PublishError(PublishError),
    /// A message for a consumer.
    Deliver(Deliver),
    /// The server ended a consumer on its own (its partitions' leadership moved): no more
    /// `Deliver` for the tag. Protocol version 4 and later.
    ConsumerEnd(ConsumerEnd),
    /// Messages of one partition for a stream consumer. Version 7.
    StreamDeliver(StreamDeliver),
    /// A stream consumer stops reading one partition (no more `StreamDeliver` of it), with
    /// why. Version 7.
    StreamPartitionEnd(StreamPartitionEnd),
    /// Keeps an idle connection alive; either side may send it at any time. No reply.
    Heartbeat,
    /// An error not tied to a publish id: a failed request, or a connection-level problem.
    Error(ErrorFrame),
    /// The sender will send nothing more and closes after its outstanding replies.
    Close(Close),
}

impl Frame {
    /// The frame's type byte.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Declare(_) => FrameType::Declare,
            Frame::Delete(_) => FrameType::Delete,
            Frame::Purge(_) => FrameType::Purge,
            Frame::QueueInfo(_) => FrameType::QueueInfo,
            Frame::QueueList(_) => FrameType::QueueList,
            Frame::SetQueueSettings(_) => FrameType::SetQueueSettings,
            Frame::StreamDeclare(_) => FrameType::StreamDeclare,
            Frame::StreamSet(_) => FrameType::StreamSet,
            Frame::StreamInfo(_) => FrameType::StreamInfo,
            Frame::StreamList(_) => FrameType::StreamList,
            Frame::StreamDelete(_) => FrameType::StreamDelete,
            Frame::Publish(_) => FrameType::Publish,
            Frame::Subscribe(_) => FrameType::Subscribe,
            Frame::Cancel(_) => FrameType::Cancel,
            Frame::Ack(_) => FrameType::Ack,
            Frame::Reject(_) => FrameType::Reject,
            Frame::StreamSubscribe(_) => FrameType::StreamSubscribe,
            Frame::StreamCredit(_) => FrameType::StreamCredit,
            Frame::CursorCommit(_) => FrameType::CursorCommit,
            Frame::Ok(_) => FrameType::Ok,
            Frame::QueueInfoReply(_) => FrameType::QueueInfoReply,
            Frame::QueueListReply(_) => FrameType::QueueListReply,
            Frame::SubscribeOk(_) => FrameType::SubscribeOk,
            Frame::StreamInfoReply(_) => FrameType::StreamInfoReply,
            Frame::StreamListReply(_) => FrameType::StreamListReply,
            Frame::Confirm(_) => FrameType::Confirm,
            Frame::PublishError(_) => FrameType::PublishError,
            Frame::Deliver(_) => FrameType::Deliver,
            Frame::ConsumerEnd(_) => FrameType::ConsumerEnd,
            Frame::StreamDeliver(_) => FrameType::StreamDeliver,
            Frame::StreamPartitionEnd(_) => FrameType::StreamPartitionEnd,
            Frame::Heartbeat => FrameType::Heartbeat,
            Frame::Error(_) => FrameType::Error,
            Frame::Close(_) => FrameType::Close,
        }
    }
}

/// What to do when a queue limit (`max_messages` or `max_bytes`) would be exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Refuse the publish with `ERR_LIMITED`, reason `queue_full`. The default when a limit is set.
    Reject = 0,
    /// Remove the oldest ready messages to make room (dead-lettering them when configured).
    DropOldest = 1,
}

/// A queue's settings, as declared. `None` means "not set" (no limit, no dead-letter queue).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSettings {
    /// Number of partitions; fixed at declaration.
    pub partitions: u32,
    /// Queue that receives rejected, expired and dropped messages.
    pub dead_letter: Option<String>,
    /// Deliveries after which a message is dead-lettered instead of redelivered.
    pub max_deliveries: Option<u32>,
    /// Most messages (ready and inflight) the queue holds.
    pub max_messages: Option<u64>,
    /// Most message bytes (ready and inflight) the queue holds.
    pub max_bytes: Option<u64>,
    /// What happens at a limit; `None` means [`Overflow::Reject`].
    pub overflow: Option<Overflow>,
    /// Nodes holding a copy of each partition; `None` lets the cluster choose (`min(3, nodes)`).
    /// Fixed at declaration. Protocol version 4 and later; `None` in earlier versions.
    pub replicas: Option<u32>,
}

impl Default for QueueSettings {
    fn default() -> QueueSettings {
        QueueSettings {
            partitions: 1,
            dead_letter: None,
            max_deliveries: None,
            max_messages: None,
            max_bytes: None,
            overflow: None,
            replicas: None,
        }
    }
}

/// One field of a [`SetQueueSettings`]: leave it, unset it, or set it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Update<T> {
    /// Leave the current value.
    #[default]
    Keep,
    /// Unset the value (no limit, no dead-letter queue).
    Clear,
    /// Set a new value.
    Set(T),
}

/// The settings a live queue can change. Partitions cannot change.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueueSettingsUpdate {
    /// See [`QueueSettings::dead_letter`].
    pub dead_letter: Update<String>,
    /// See [`QueueSettings::max_deliveries`].
    pub max_deliveries: Update<u32>,
    /// See [`QueueSettings::max_messages`].
    pub max_messages: Update<u64>,
    /// See [`QueueSettings::max_bytes`].
    pub max_bytes: Update<u64>,
    /// See [`QueueSettings::overflow`].
    pub overflow: Update<Overflow>,
}

/// Body of [`Frame::Declare`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declare {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The queue's name.
    pub queue: String,
    /// Its settings; a queue that exists with other settings is a 409.
    pub settings: QueueSettings,
    /// Version 5 and later: the nodes that hold each partition's replicas (a cluster's node
    /// ids, the first being the preferred leader of partition 0, rotating over the others);
    /// empty lets the cluster place them. Ignored when the queue exists.
    pub nodes: Vec<u64>,
}

/// Body of [`Frame::Delete`], [`Frame::Purge`] and [`Frame::QueueInfo`]: a request naming a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRequest {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The queue's name.
    pub queue: String,
}

/// Body of [`Frame::QueueList`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueList {
    /// Echoed by the reply.
    pub request_id: u64,
}

/// Body of [`Frame::SetQueueSettings`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetQueueSettings {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The queue's name.
    pub queue: String,
    /// The fields to change.
    pub update: QueueSettingsUpdate,
}

/// Whether the server confirms each message of a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishMode {
    /// The server sends `Confirm` once a message is durable, or `PublishError`.
    Confirmed = 0,
    /// The server sends no `Confirm`; failures still come back as `PublishError`.
    Buffered = 1,
}

/// A message header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Header name.
    pub name: String,
    /// Header value.
    pub value: String,
}

/// One message in a [`Publish`] batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Chosen by the client, unique on the connection; `Confirm` and `PublishError` name it.
    pub publish_id: u64,
    /// Chooses the partition; messages without one are spread over partitions.
    pub routing_key: Option<String>,
    /// Application headers.
    pub headers: Vec<Header>,
    /// The payload.
    pub body: Bytes,
    /// Its number in its producer's sequence (`Publish::producer_id`), for an idempotent
    /// producer: a message whose producer and sequence a partition stored already is confirmed
    /// again and not stored twice. Version 4 on.
    pub sequence: Option<u64>,
}

/// Body of [`Frame::Publish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// The queue's name.
    pub queue: String,
    /// Confirmed or buffered.
    pub mode: PublishMode,
    /// The batch; all-or-nothing per partition, unless `joinable`.
    pub messages: Vec<Message>,
    /// The messages are separate publishes the client joined into one frame: the server admits
    /// each on its own, as if each had come in a frame of its own (wire: bit 7 of `mode`).
    pub joinable: bool,
    /// The idempotent producer the messages' sequences belong to. Version 4 on.
    pub producer_id: Option<u64>,
}

/// An inclusive range of publish ids; a single id is a range with `first == last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishIdRange {
    /// First id in the range.
    pub first: u64,
    /// Last id in the range, `>= first` (the decoder rejects anything else).
    pub last: u64,
}

impl PublishIdRange {
    /// A range holding one id.
    pub fn single(publish_id: u64) -> PublishIdRange {
        PublishIdRange {
            first: publish_id,
            last: publish_id,
        }
    }
}

/// Body of [`Frame::Confirm`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirm {
    /// Publish ids now durable.
    pub ranges: Vec<PublishIdRange>,
}

/// Body of [`Frame::PublishError`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishError {
    /// Publish ids that failed; none of them gets a `Confirm`.
    pub ranges: Vec<PublishIdRange>,
    /// Why: code, reason (always for `ERR_LIMITED`), retry hint and message.
    pub error: ErrorBody,
}

/// Largest `prefetch` of a [`Subscribe`]; a receiver refuses 0 and anything above with 400.
/// Deliveries in flight to one consumer are held in bounded channels on both sides (the
/// server's consumer channel, the client's delivery channel), each as deep as the prefetch:
/// 65,535 deliveries of 1 KiB are 64 MiB per consumer. `docs/protocol.md` ("Subscribe") states
/// the same bound; the client checks it before sending and the server on receipt.
pub const PREFETCH_MAX: u32 = 65_535;

/// Body of [`Frame::Subscribe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The queue's name.
    pub queue: String,
    /// Most unacknowledged deliveries the server sends this consumer.
    pub prefetch: u32,
    /// Chosen by the client, unique on the connection; `Deliver` and `Cancel` name it.
    pub consumer_tag: String,
    /// Most unacknowledged payload bytes the server sends this consumer (a larger message
    /// still goes out, alone); 0 = no byte bound. Protocol version 2 and later; 0 in version 1.
    pub prefetch_bytes: u64,
}

/// Body of [`Frame::ConsumerEnd`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerEnd {
    /// The consumer the server ended; the tag is free again on the connection.
    pub consumer_tag: String,
    /// Why: 421 `ERR_NOT_LEADER` with the new leader's `leader_addr` when a partition of the
    /// queue moved to another node.
    pub error: ErrorBody,
}

/// Body of [`Frame::Cancel`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    /// Echoed by the reply.
    pub request_id: u64,
    /// The consumer to stop.
    pub consumer_tag: String,
}

/// Body of [`Frame::Ack`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// Deliveries to acknowledge.
    pub delivery_ids: Vec<u64>,
}

/// Body of [`Frame::Reject`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Deliveries to reject.
    pub delivery_ids: Vec<u64>,
    /// Return them to ready (`true`) or dead-letter/drop them (`false`).
    pub requeue: bool,
}

/// Body of [`Frame::Ok`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OkReply {
    /// The request that succeeded.
    pub request_id: u64,
}

/// Counts for one partition in a [`QueueInfoReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionInfo {
    /// Messages waiting for delivery.
    pub ready: u64,
    /// Messages delivered and not yet acknowledged.
    pub inflight: u64,
    /// Message bytes held (ready and inflight).
    pub bytes: u64,
    /// Bytes the partition's log occupies on disk.
    pub disk_bytes: u64,
    /// Whether the answering node leads this partition (publishes and subscribes to it are
    /// served there). Protocol version 4 and later; decoded as `true` in earlier versions,
    /// whose nodes run alone and lead every partition.
    pub leading: bool,
    /// The leading node's id, when one is known. Version 4 and later; `None` before.
    pub leader: Option<u64>,
    /// The leading node's protocol address (`host:port`), when known. Version 4 and later.
    pub leader_addr: Option<String>,
}

/// Body of [`Frame::QueueInfoReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfoReply {
    /// The request answered.
    pub request_id: u64,
    /// The queue's name.
    pub queue: String,
    /// Its current settings.
    pub settings: QueueSettings,
    /// One entry per partition, in partition order.
    pub partitions: Vec<PartitionInfo>,
}

/// One queue in a [`QueueListReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSummary {
    /// The queue's name.
    pub queue: String,
    /// Number of partitions.
    pub partitions: u32,
    /// Ready messages over all partitions.
    pub ready: u64,
    /// Inflight messages over all partitions.
    pub inflight: u64,
    /// Message bytes over all partitions.
    pub bytes: u64,
}

/// Body of [`Frame::QueueListReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueListReply {
    /// The request answered.
    pub request_id: u64,
    /// Every queue, sorted by name.
    pub queues: Vec<QueueSummary>,
}

/// Body of [`Frame::SubscribeOk`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeOk {
    /// The request answered.
    pub request_id: u64,
    /// The consumer registered.
    pub consumer_tag: String,
}

/// Body of [`Frame::Deliver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deliver {
    /// The consumer this delivery is for.
    pub consumer_tag: String,
    /// Unique on the connection; `Ack` and `Reject` name it.
    pub delivery_id: u64,
    /// Partition the message lives in.
    pub partition: u32,
    /// Its offset in that partition's log.
    pub offset: u64,
    /// Whether the message was delivered before (to any consumer).
    pub redelivered: bool,
    /// Deliveries so far, this one included.
    pub delivery_count: u32,
    /// The routing key the message was published with. Protocol version 7 and later: an
    /// older version does not carry it (encoded without it, decoded as `None`).
    pub routing_key: Option<String>,
    /// Application headers, plus any the broker added (for example when dead-lettering).
    pub headers: Vec<Header>,
    /// The payload.
    pub body: Bytes,
}

/// Body of [`Frame::Error`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    /// The request that failed, or `None` for a connection-level error.
    pub request_id: Option<u64>,
    /// Whether the sender closes the connection after this frame.
    pub fatal: bool,
    /// Code, reason, retry hint and message.
    pub error: ErrorBody,
}

/// Body of [`Frame::Close`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Close {
    /// Why, for humans (for example `server shutting down`); may be empty.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_bytes_are_unique_and_map_back() {
        for frame_type in FrameType::ALL {
            assert_eq!(FrameType::from_u8(frame_type as u8), Some(frame_type));
        }
        let mut bytes: Vec<u8> = FrameType::ALL.iter().map(|t| *t as u8).collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), FrameType::ALL.len());
        assert_eq!(FrameType::from_u8(0x00), None);
        assert_eq!(FrameType::from_u8(0xff), None);
    }

    #[test]
    fn a_type_exists_from_its_version_on() {
        for frame_type in FrameType::ALL {
            let byte = frame_type as u8;
            assert_eq!(
                FrameType::from_u8_in(byte, frame_type.since()),
                Some(frame_type)
            );
            assert_eq!(FrameType::from_u8_in(byte, frame_type.since() - 1), None);
        }
        assert_eq!(FrameType::StreamDeliver.since(), PROTOCOL_VERSION_STREAMS);
        assert_eq!(FrameType::from_u8_in(0x62, 6), None);
    }
}
