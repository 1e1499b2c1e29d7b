//! The bodies of the stream frames of protocol version 7: their field order, exactly as the
//! tables of `docs/protocol.md` ("Stream frames") list it, and their list bounds.
//!
//! The codec calls in here only for a connection of version 7 or later: it refuses a stream
//! frame type in an older version at the type byte, so nothing below depends on the version.
//! Primitives belong to [`crate::wire`]; the queue frames and the shared structures (headers,
//! updates, error body) to `body.rs`.

use bytes::{BufMut, BytesMut};

use crate::body::{
    put_error_body, put_headers, put_u32_value, put_u64_value, put_update, read_error_body,
    read_headers, read_update,
};
use crate::error::{Problem, ProtoError};
use crate::frame::{Frame, FrameType};
use crate::stream::{
    CursorCommit, CursorEntry, StreamCredit, StreamDeclare, StreamDeliver, StreamInfoReply,
    StreamList, StreamListReply, StreamMessage, StreamPartitionEnd, StreamPartitionInfo,
    StreamRequest, StreamRetentionUpdate, StreamSet, StreamSettings, StreamStart, StreamSubscribe,
    StreamSummary, STREAM_DELIVER_MESSAGES_MAX, STREAM_NODES_MAX, STREAM_PARTITIONS_MAX,
};
use crate::wire::{put_bytes, put_count_u16, put_count_u32, put_option, put_string, Reader};

/// An encoded node id or offset: u64.
const U64_SIZE: usize = 8;
/// An encoded partition number: u32.
const PARTITION_SIZE: usize = 4;
/// An encoded cursor entry: partition u32, offset u64.
const CURSOR_ENTRY_SIZE: usize = 4 + 8;
/// Smallest encoded stream partition info: start, next, messages, bytes, disk_bytes (u64 each),
/// the oldest timestamp's tag, `leading`, the leader's and the leader address's tags.
const STREAM_PARTITION_INFO_SIZE_MIN: usize = 5 * 8 + 1 + 1 + 1 + 1;
/// Smallest encoded stream summary: empty name u16, partitions u32, messages u64, bytes u64.
const STREAM_SUMMARY_SIZE_MIN: usize = 2 + 4 + 8 + 8;
/// Smallest encoded stream message: offset u64, timestamp u64, absent key tag, header count
/// u16, body length u32.
const STREAM_MESSAGE_SIZE_MIN: usize = 8 + 8 + 1 + 2 + 4;

/// Writes the body of a stream frame (everything after the type byte).
pub(crate) fn encode_stream_body(frame: &Frame, dst: &mut BytesMut) -> Result<(), ProtoError> {
    match frame {
        Frame::StreamDeclare(declare) => {
            dst.put_u64_le(declare.request_id);
            put_string(dst, "stream", &declare.stream)?;
            put_stream_settings(dst, &declare.settings)?;
            put_bounded_count(dst, "nodes", declare.nodes.len(), STREAM_NODES_MAX)?;
            for node in &declare.nodes {
                dst.put_u64_le(*node);
            }
            Ok(())
        }
        Frame::StreamSet(set) => {
            dst.put_u64_le(set.request_id);
            put_string(dst, "stream", &set.stream)?;
            put_update(dst, &set.update.max_bytes, put_u64_value)?;
            put_update(dst, &set.update.max_age_ms, put_u64_value)?;
            put_update(dst, &set.update.max_messages, put_u64_value)
        }
        Frame::StreamInfo(request) | Frame::StreamDelete(request) => {
            dst.put_u64_le(request.request_id);
            put_string(dst, "stream", &request.stream)
        }
        Frame::StreamList(list) => {
            dst.put_u64_le(list.request_id);
            Ok(())
        }
        Frame::StreamSubscribe(subscribe) => put_stream_subscribe(dst, subscribe),
        Frame::StreamCredit(credit) => {
            put_string(dst, "consumer_tag", &credit.consumer_tag)?;
            dst.put_u32_le(credit.credit);
            Ok(())
        }
        Frame::CursorCommit(commit) => {
            dst.put_u64_le(commit.request_id);
            put_string(dst, "stream", &commit.stream)?;
            put_string(dst, "cursor", &commit.cursor)?;
            put_bounded_count(dst, "entries", commit.entries.len(), STREAM_PARTITIONS_MAX)?;
            for entry in &commit.entries {
                dst.put_u32_le(entry.partition);
                dst.put_u64_le(entry.offset);
            }
            Ok(())
        }
        Frame::StreamInfoReply(info) => put_stream_info_reply(dst, info),
        Frame::StreamListReply(list) => {
            dst.put_u64_le(list.request_id);
            put_count_u32(dst, "streams", list.streams.len())?;
            for summary in &list.streams {
                put_string(dst, "stream.name", &summary.stream)?;
                dst.put_u32_le(summary.partitions);
                dst.put_u64_le(summary.messages);
                dst.put_u64_le(summary.bytes);
            }
            Ok(())
        }
        Frame::StreamDeliver(deliver) => put_stream_deliver(dst, deliver),
        Frame::StreamPartitionEnd(end) => {
            put_string(dst, "consumer_tag", &end.consumer_tag)?;
            dst.put_u32_le(end.partition);
            put_error_body(dst, &end.error, true)
        }
        _ => unreachable!("body.rs hands only stream frames to encode_stream_body"),
    }
}

/// Reads the body of a stream frame of type `frame_type`; the reader stands after the type byte.
pub(crate) fn decode_stream_body(
    frame_type: FrameType,
    r: &mut Reader,
) -> Result<Frame, ProtoError> {
    let frame = match frame_type {
        FrameType::StreamDeclare => Frame::StreamDeclare(StreamDeclare {
            request_id: r.u64("request_id")?,
            stream: r.string("stream")?,
            settings: read_stream_settings(r)?,
            nodes: read_bounded_list(r, "nodes", NODES_BOUND, U64_SIZE, |r| r.u64("nodes"))?,
        }),
        FrameType::StreamSet => Frame::StreamSet(StreamSet {
            request_id: r.u64("request_id")?,
            stream: r.string("stream")?,
            update: StreamRetentionUpdate {
                max_bytes: read_update(r, "update.max_bytes", |r| r.u64("update.max_bytes"))?,
                max_age_ms: read_update(r, "update.max_age_ms", |r| r.u64("update.max_age_ms"))?,
                max_messages: read_update(r, "update.max_messages", |r| {
                    r.u64("update.max_messages")
                })?,
            },
        }),
        FrameType::StreamInfo => Frame::StreamInfo(read_stream_request(r)?),
        FrameType::StreamList => Frame::StreamList(StreamList {
            request_id: r.u64("request_id")?,
        }),
        FrameType::StreamDelete => Frame::StreamDelete(read_stream_request(r)?),
        FrameType::StreamSubscribe => Frame::StreamSubscribe(read_stream_subscribe(r)?),
        FrameType::StreamCredit => Frame::StreamCredit(StreamCredit {
            consumer_tag: r.string("consumer_tag")?,
            credit: r.u32("credit")?,
        }),
        FrameType::CursorCommit => Frame::CursorCommit(CursorCommit {
            request_id: r.u64("request_id")?,
            stream: r.string("stream")?,
            cursor: r.string("cursor")?,
            entries: read_bounded_list(r, "entries", PARTITIONS_BOUND, CURSOR_ENTRY_SIZE, |r| {
                Ok(CursorEntry {
                    partition: r.u32("entry.partition")?,
                    offset: r.u64("entry.offset")?,
                })
            })?,
        }),
        FrameType::StreamInfoReply => Frame::StreamInfoReply(read_stream_info_reply(r)?),
        FrameType::StreamListReply => Frame::StreamListReply(StreamListReply {
            request_id: r.u64("request_id")?,
            streams: r.list_u32("streams", STREAM_SUMMARY_SIZE_MIN, |r| {
                Ok(StreamSummary {
                    stream: r.string("stream.name")?,
                    partitions: r.u32("stream.partitions")?,
                    messages: r.u64("stream.messages")?,
                    bytes: r.u64("stream.bytes")?,
                })
            })?,
        }),
        FrameType::StreamDeliver => Frame::StreamDeliver(read_stream_deliver(r)?),
        FrameType::StreamPartitionEnd => Frame::StreamPartitionEnd(StreamPartitionEnd {
            consumer_tag: r.string("consumer_tag")?,
            partition: r.u32("partition")?,
            error: read_error_body(r, true)?,
        }),
        _ => unreachable!("body.rs hands only stream frame types to decode_stream_body"),
    };
    Ok(frame)
}

/// Writes a u16 count of at most `count_max` items; a longer list is an error, as it would be
/// malformed for the receiver.
fn put_bounded_count(
    dst: &mut BytesMut,
    field: &'static str,
    count: usize,
    count_max: usize,
) -> Result<(), ProtoError> {
    if count > count_max {
        return Err(ProtoError::FieldTooLong {
            field,
            size: count,
            limit: count_max,
        });
    }
    put_count_u16(dst, field, count)
}

/// A list's bound: its most items, and what the error says when a count exceeds it.
struct ListBound {
    count_max: usize,
    reason: &'static str,
}

const NODES_BOUND: ListBound = ListBound {
    count_max: STREAM_NODES_MAX,
    reason: "more than 64 nodes",
};
const PARTITIONS_BOUND: ListBound = ListBound {
    count_max: STREAM_PARTITIONS_MAX,
    reason: "more than 64 partitions",
};
const MESSAGES_BOUND: ListBound = ListBound {
    count_max: STREAM_DELIVER_MESSAGES_MAX,
    reason: "more than 256 messages in one StreamDeliver",
};
// The reasons name the numbers.
const _: () = assert!(STREAM_NODES_MAX == 64 && STREAM_PARTITIONS_MAX == 64);
const _: () = assert!(STREAM_DELIVER_MESSAGES_MAX == 256);

/// Reads a u16 count, refused above its bound at the count (before any item is read), then
/// that many items.
fn read_bounded_list<T>(
    r: &mut Reader,
    field: &'static str,
    bound: ListBound,
    item_size_min: usize,
    read: impl FnMut(&mut Reader) -> Result<T, ProtoError>,
) -> Result<Vec<T>, ProtoError> {
    let start = r.position();
    let count = usize::from(r.u16(field)?);
    if count > bound.count_max {
        return Err(r.error_at(start, field, Problem::InvalidValue(bound.reason)));
    }
    r.list(field, count, item_size_min, read)
}

/// [`read_bounded_list`] with a u32 count.
fn read_bounded_list_u32<T>(
    r: &mut Reader,
    field: &'static str,
    bound: ListBound,
    item_size_min: usize,
    read: impl FnMut(&mut Reader) -> Result<T, ProtoError>,
) -> Result<Vec<T>, ProtoError> {
    let start = r.position();
    let count = usize::try_from(r.u32(field)?).unwrap_or(usize::MAX);
    if count > bound.count_max {
        return Err(r.error_at(start, field, Problem::InvalidValue(bound.reason)));
    }
    r.list(field, count, item_size_min, read)
}

fn put_stream_settings(dst: &mut BytesMut, settings: &StreamSettings) -> Result<(), ProtoError> {
    dst.put_u32_le(settings.partitions);
    put_option(dst, settings.replicas.as_ref(), put_u32_value)?;
    put_option(dst, settings.max_bytes.as_ref(), put_u64_value)?;
    put_option(dst, settings.max_age_ms.as_ref(), put_u64_value)?;
    put_option(dst, settings.max_messages.as_ref(), put_u64_value)
}

fn read_stream_settings(r: &mut Reader) -> Result<StreamSettings, ProtoError> {
    Ok(StreamSettings {
        partitions: r.u32("settings.partitions")?,
        replicas: r.option("settings.replicas", |r| r.u32("settings.replicas"))?,
        max_bytes: r.option("settings.max_bytes", |r| r.u64("settings.max_bytes"))?,
        max_age_ms: r.option("settings.max_age_ms", |r| r.u64("settings.max_age_ms"))?,
        max_messages: r.option("settings.max_messages", |r| r.u64("settings.max_messages"))?,
    })
}

fn read_stream_request(r: &mut Reader) -> Result<StreamRequest, ProtoError> {
    Ok(StreamRequest {
        request_id: r.u64("request_id")?,
        stream: r.string("stream")?,
    })
}

fn put_stream_subscribe(dst: &mut BytesMut, subscribe: &StreamSubscribe) -> Result<(), ProtoError> {
    dst.put_u64_le(subscribe.request_id);
    put_string(dst, "stream", &subscribe.stream)?;
    put_string(dst, "consumer_tag", &subscribe.consumer_tag)?;
    put_option(dst, subscribe.cursor.as_ref(), |dst, cursor| {
        put_string(dst, "cursor", cursor)
    })?;
    dst.put_u8(u8::from(subscribe.group));
    dst.put_u8(subscribe.start.kind());
    dst.put_u64_le(subscribe.start.value());
    dst.put_u32_le(subscribe.credit);
    dst.put_u8(u8::from(subscribe.auto_commit));
    put_bounded_count(
        dst,
        "partitions",
        subscribe.partitions.len(),
        STREAM_PARTITIONS_MAX,
    )?;
    for partition in &subscribe.partitions {
        dst.put_u32_le(*partition);
    }
    Ok(())
}

fn read_stream_subscribe(r: &mut Reader) -> Result<StreamSubscribe, ProtoError> {
    let request_id = r.u64("request_id")?;
    let stream = r.string("stream")?;
    let consumer_tag = r.string("consumer_tag")?;
    let cursor = r.option("cursor", |r| r.string("cursor"))?;
    let group = r.bool("group")?;
    let start_at = r.position();
    let kind = r.u8("start.kind")?;
    let value = r.u64("start.value")?;
    let Some(start) = StreamStart::from_parts(kind, value) else {
        let problem = if kind > StreamStart::Timestamp(0).kind() {
            Problem::InvalidTag(kind)
        } else {
            Problem::InvalidValue("start.value must be 0 for start kinds first, last and next")
        };
        return Err(r.error_at(start_at, "start.kind", problem));
    };
    Ok(StreamSubscribe {
        request_id,
        stream,
        consumer_tag,
        cursor,
        group,
        start,
        credit: r.u32("credit")?,
        auto_commit: r.bool("auto_commit")?,
        partitions: read_bounded_list(r, "partitions", PARTITIONS_BOUND, PARTITION_SIZE, |r| {
            r.u32("partition")
        })?,
    })
}

fn put_stream_info_reply(dst: &mut BytesMut, info: &StreamInfoReply) -> Result<(), ProtoError> {
    dst.put_u64_le(info.request_id);
    put_string(dst, "stream", &info.stream)?;
    put_stream_settings(dst, &info.settings)?;
    put_bounded_count(
        dst,
        "partitions",
        info.partitions.len(),
        STREAM_PARTITIONS_MAX,
    )?;
    for partition in &info.partitions {
        dst.put_u64_le(partition.start_offset);
        dst.put_u64_le(partition.next_offset);
        dst.put_u64_le(partition.messages);
        dst.put_u64_le(partition.bytes);
        dst.put_u64_le(partition.disk_bytes);
        put_option(dst, partition.oldest_timestamp_ms.as_ref(), put_u64_value)?;
        dst.put_u8(u8::from(partition.leading));
        put_option(dst, partition.leader.as_ref(), put_u64_value)?;
        put_option(dst, partition.leader_addr.as_ref(), |dst, addr| {
            put_string(dst, "partition.leader_addr", addr)
        })?;
    }
    Ok(())
}

fn read_stream_info_reply(r: &mut Reader) -> Result<StreamInfoReply, ProtoError> {
    Ok(StreamInfoReply {
        request_id: r.u64("request_id")?,
        stream: r.string("stream")?,
        settings: read_stream_settings(r)?,
        partitions: read_bounded_list(
            r,
            "partitions",
            PARTITIONS_BOUND,
            STREAM_PARTITION_INFO_SIZE_MIN,
            |r| {
                Ok(StreamPartitionInfo {
                    start_offset: r.u64("partition.start_offset")?,
                    next_offset: r.u64("partition.next_offset")?,
                    messages: r.u64("partition.messages")?,
                    bytes: r.u64("partition.bytes")?,
                    disk_bytes: r.u64("partition.disk_bytes")?,
                    oldest_timestamp_ms: r.option("partition.oldest_timestamp_ms", |r| {
                        r.u64("partition.oldest_timestamp_ms")
                    })?,
                    leading: r.bool("partition.leading")?,
                    leader: r.option("partition.leader", |r| r.u64("partition.leader"))?,
                    leader_addr: r.option("partition.leader_addr", |r| {
                        r.string("partition.leader_addr")
                    })?,
                })
            },
        )?,
    })
}

fn put_stream_deliver(dst: &mut BytesMut, deliver: &StreamDeliver) -> Result<(), ProtoError> {
    put_string(dst, "consumer_tag", &deliver.consumer_tag)?;
    dst.put_u32_le(deliver.partition);
    put_option(dst, deliver.moved_from.as_ref(), put_u64_value)?;
    if deliver.messages.len() > STREAM_DELIVER_MESSAGES_MAX {
        return Err(ProtoError::FieldTooLong {
            field: "messages",
            size: deliver.messages.len(),
            limit: STREAM_DELIVER_MESSAGES_MAX,
        });
    }
    put_count_u32(dst, "messages", deliver.messages.len())?;
    for message in &deliver.messages {
        dst.put_u64_le(message.offset);
        dst.put_u64_le(message.timestamp_ms);
        put_option(dst, message.routing_key.as_ref(), |dst, key| {
            put_string(dst, "message.routing_key", key)
        })?;
        put_headers(dst, &message.headers)?;
        put_bytes(dst, "message.body", &message.body)?;
    }
    Ok(())
}

fn read_stream_deliver(r: &mut Reader) -> Result<StreamDeliver, ProtoError> {
    Ok(StreamDeliver {
        consumer_tag: r.string("consumer_tag")?,
        partition: r.u32("partition")?,
        moved_from: r.option("moved_from", |r| r.u64("moved_from"))?,
        messages: read_bounded_list_u32(
            r,
            "messages",
            MESSAGES_BOUND,
            STREAM_MESSAGE_SIZE_MIN,
            |r| {
                Ok(StreamMessage {
                    offset: r.u64("message.offset")?,
                    timestamp_ms: r.u64("message.timestamp_ms")?,
                    routing_key: r
                        .option("message.routing_key", |r| r.string("message.routing_key"))?,
                    headers: read_headers(r)?,
                    body: r.bytes("message.body")?,
                })
            },
        )?,
    })
}
