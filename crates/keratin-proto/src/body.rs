//! Frame bodies: the fields after the type byte, for every frame type.
//!
//! Owns the field order of each frame, exactly as the tables in `docs/protocol.md` ("Frames")
//! list it. Framing (length prefix, type byte, size limit) belongs to [`crate::codec`]; the
//! primitive encodings to [`crate::wire`].

use bytes::{BufMut, BytesMut};

use crate::codes::{Code, LimitReason};
use crate::error::{Problem, ProtoError};
use crate::error_body::ErrorBody;
use crate::frame::{
    Ack, Cancel, Close, Confirm, ConsumerEnd, Declare, Deliver, ErrorFrame, Frame, FrameType,
    Header, Message, OkReply, Overflow, PartitionInfo, Publish, PublishError, PublishIdRange,
    PublishMode, QueueInfoReply, QueueList, QueueListReply, QueueRequest, QueueSettings,
    QueueSettingsUpdate, QueueSummary, Reject, SetQueueSettings, Subscribe, SubscribeOk, Update,
};
use crate::handshake::PROTOCOL_VERSION_STREAMS;
use crate::stream_body::{decode_stream_body, encode_stream_body};
use crate::wire::{put_bytes, put_count_u16, put_count_u32, put_option, put_string, Reader};

/// Smallest encoded header: two empty strings, each a u16 length.
const HEADER_SIZE_MIN: usize = 2 + 2;
/// Smallest encoded message: publish_id u64, absent routing key tag, header count u16, body length u32.
const MESSAGE_SIZE_MIN: usize = 8 + 1 + 2 + 4;
/// An encoded delivery id: u64.
const DELIVERY_ID_SIZE: usize = 8;
/// An encoded publish id range: first u64, last u64.
const RANGE_SIZE: usize = 8 + 8;
/// An encoded partition info: ready, inflight, bytes, disk_bytes, each u64.
const PARTITION_INFO_SIZE: usize = 4 * 8;
/// Smallest encoded queue summary: empty name u16, partitions u32, ready, inflight, bytes u64.
const QUEUE_SUMMARY_SIZE_MIN: usize = 2 + 4 + 3 * 8;

/// The protocol version that added `Deliver.routing_key`: the stream frames' version.
const DELIVER_ROUTING_KEY_SINCE: u16 = PROTOCOL_VERSION_STREAMS;
/// Tag of [`Update::Keep`]; `Clear` is 1 and `Set` is 2, followed by the value.
const UPDATE_KEEP: u8 = 0;
const UPDATE_CLEAR: u8 = 1;
const UPDATE_SET: u8 = 2;
/// The protocol version that added `Subscribe.prefetch_bytes`.
const PREFETCH_BYTES_SINCE: u16 = 2;
/// The protocol version that added `QueueSettings.replicas`, the partition leader fields of
/// `QueueInfoReply` and the error body's `leader_addr`.
pub(crate) const CLUSTER_FIELDS_SINCE: u16 = 4;
/// The protocol version that added `Declare.nodes` (a queue's replicas pinned to nodes).
pub(crate) const PINNED_NODES_SINCE: u16 = 5;
/// The version 4 fields of a partition info at their smallest: `leading` bool, absent `leader`
/// and `leader_addr` tags.
const PARTITION_LEADER_SIZE_MIN: usize = 1 + 1 + 1;
const UPDATE_TAG_COUNT: u8 = 3;

/// Writes the body of `frame` (everything after the type byte).
pub(crate) fn encode_body(
    frame: &Frame,
    dst: &mut BytesMut,
    version: u16,
) -> Result<(), ProtoError> {
    match frame {
        Frame::Declare(declare) => {
            dst.put_u64_le(declare.request_id);
            put_string(dst, "queue", &declare.queue)?;
            if version < CLUSTER_FIELDS_SINCE && declare.settings.replicas.is_some() {
                return Err(ProtoError::InvalidValue {
                    field: "settings.replicas",
                    reason: "protocol versions before 4 cannot carry replicas",
                });
            }
            put_settings(dst, &declare.settings, version)?;
            if version >= PINNED_NODES_SINCE {
                put_count_u16(dst, "nodes", declare.nodes.len())?;
                for node in &declare.nodes {
                    dst.put_u64_le(*node);
                }
            } else if !declare.nodes.is_empty() {
                return Err(ProtoError::InvalidValue {
                    field: "nodes",
                    reason: "protocol versions before 5 cannot carry a queue's nodes",
                });
            }
            Ok(())
        }
        Frame::Delete(request) | Frame::Purge(request) | Frame::QueueInfo(request) => {
            dst.put_u64_le(request.request_id);
            put_string(dst, "queue", &request.queue)
        }
        Frame::QueueList(list) => {
            dst.put_u64_le(list.request_id);
            Ok(())
        }
        Frame::SetQueueSettings(set) => {
            dst.put_u64_le(set.request_id);
            put_string(dst, "queue", &set.queue)?;
            put_settings_update(dst, &set.update)
        }
        Frame::Publish(publish) => put_publish(dst, publish, version),
        Frame::Subscribe(subscribe) => {
            dst.put_u64_le(subscribe.request_id);
            put_string(dst, "queue", &subscribe.queue)?;
            dst.put_u32_le(subscribe.prefetch);
            put_string(dst, "consumer_tag", &subscribe.consumer_tag)?;
            if version >= PREFETCH_BYTES_SINCE {
                dst.put_u64_le(subscribe.prefetch_bytes);
            } else if subscribe.prefetch_bytes != 0 {
                return Err(ProtoError::InvalidValue {
                    field: "prefetch_bytes",
                    reason: "protocol version 1 cannot carry a byte prefetch",
                });
            }
            Ok(())
        }
        Frame::Cancel(cancel) => {
            dst.put_u64_le(cancel.request_id);
            put_string(dst, "consumer_tag", &cancel.consumer_tag)
        }
        Frame::Ack(ack) => put_delivery_ids(dst, &ack.delivery_ids),
        Frame::Reject(reject) => {
            put_delivery_ids(dst, &reject.delivery_ids)?;
            dst.put_u8(u8::from(reject.requeue));
            Ok(())
        }
        Frame::StreamDeclare(_)
        | Frame::StreamSet(_)
        | Frame::StreamInfo(_)
        | Frame::StreamList(_)
        | Frame::StreamDelete(_)
        | Frame::StreamSubscribe(_)
        | Frame::StreamCredit(_)
        | Frame::CursorCommit(_)
        | Frame::StreamInfoReply(_)
        | Frame::StreamListReply(_)
        | Frame::StreamDeliver(_)
        | Frame::StreamPartitionEnd(_) => encode_stream_body(frame, dst),
        _ => encode_reply_body(frame, dst, version),
    }
}

/// The server-to-client and either-direction half of [`encode_body`].
fn encode_reply_body(frame: &Frame, dst: &mut BytesMut, version: u16) -> Result<(), ProtoError> {
    match frame {
        Frame::Ok(ok) => {
            dst.put_u64_le(ok.request_id);
            Ok(())
        }
        Frame::QueueInfoReply(info) => put_queue_info_reply(dst, info, version),
        Frame::QueueListReply(list) => put_queue_list_reply(dst, list),
        Frame::SubscribeOk(subscribe_ok) => {
            dst.put_u64_le(subscribe_ok.request_id);
            put_string(dst, "consumer_tag", &subscribe_ok.consumer_tag)
        }
        Frame::Confirm(confirm) => put_ranges(dst, &confirm.ranges),
        Frame::PublishError(publish_error) => {
            put_ranges(dst, &publish_error.ranges)?;
            put_error_body(dst, &publish_error.error, version >= CLUSTER_FIELDS_SINCE)
        }
        Frame::Deliver(deliver) => put_deliver(dst, deliver, version),
        // The codec refused a type `version` does not define before the body.
        Frame::ConsumerEnd(end) => {
            put_string(dst, "consumer_tag", &end.consumer_tag)?;
            put_error_body(dst, &end.error, true)
        }
        Frame::Heartbeat => Ok(()),
        Frame::Error(error) => {
            put_option(dst, error.request_id.as_ref(), |dst, id| {
                dst.put_u64_le(*id);
                Ok(())
            })?;
            dst.put_u8(u8::from(error.fatal));
            put_error_body(dst, &error.error, version >= CLUSTER_FIELDS_SINCE)
        }
        Frame::Close(close) => put_string(dst, "message", &close.message),
        _ => unreachable!("encode_body handles every request frame"),
    }
}

/// Reads the body of a frame of type `frame_type`; the reader stands after the type byte.
pub(crate) fn decode_body(
    frame_type: FrameType,
    r: &mut Reader,
    version: u16,
) -> Result<Frame, ProtoError> {
    let frame = match frame_type {
        FrameType::Declare => Frame::Declare(Declare {
            request_id: r.u64("request_id")?,
            queue: r.string("queue")?,
            settings: read_settings(r, version)?,
            nodes: if version >= PINNED_NODES_SINCE {
                r.list_u16("nodes", 8, |r| r.u64("nodes"))?
            } else {
                Vec::new()
            },
        }),
        FrameType::Delete => Frame::Delete(read_queue_request(r)?),
        FrameType::Purge => Frame::Purge(read_queue_request(r)?),
        FrameType::QueueInfo => Frame::QueueInfo(read_queue_request(r)?),
        FrameType::QueueList => Frame::QueueList(QueueList {
            request_id: r.u64("request_id")?,
        }),
        FrameType::SetQueueSettings => Frame::SetQueueSettings(SetQueueSettings {
            request_id: r.u64("request_id")?,
            queue: r.string("queue")?,
            update: read_settings_update(r)?,
        }),
        FrameType::Publish => Frame::Publish(read_publish(r, version)?),
        FrameType::Subscribe => Frame::Subscribe(Subscribe {
            request_id: r.u64("request_id")?,
            queue: r.string("queue")?,
            prefetch: r.u32("prefetch")?,
            consumer_tag: r.string("consumer_tag")?,
            prefetch_bytes: if version >= PREFETCH_BYTES_SINCE {
                r.u64("prefetch_bytes")?
            } else {
                0
            },
        }),
        FrameType::Cancel => Frame::Cancel(Cancel {
            request_id: r.u64("request_id")?,
            consumer_tag: r.string("consumer_tag")?,
        }),
        FrameType::Ack => Frame::Ack(Ack {
            delivery_ids: read_delivery_ids(r)?,
        }),
        FrameType::Reject => Frame::Reject(Reject {
            delivery_ids: read_delivery_ids(r)?,
            requeue: r.bool("requeue")?,
        }),
        stream if stream.is_stream() => decode_stream_body(stream, r)?,
        _ => decode_reply_body(frame_type, r, version)?,
    };
    Ok(frame)
}

/// The server-to-client and either-direction half of [`decode_body`].
fn decode_reply_body(
    frame_type: FrameType,
    r: &mut Reader,
    version: u16,
) -> Result<Frame, ProtoError> {
    let with_leader = version >= CLUSTER_FIELDS_SINCE;
    let frame = match frame_type {
        FrameType::Ok => Frame::Ok(OkReply {
            request_id: r.u64("request_id")?,
        }),
        FrameType::QueueInfoReply => Frame::QueueInfoReply(read_queue_info_reply(r, version)?),
        FrameType::QueueListReply => Frame::QueueListReply(QueueListReply {
            request_id: r.u64("request_id")?,
            queues: r.list_u32("queues", QUEUE_SUMMARY_SIZE_MIN, read_queue_summary)?,
        }),
        FrameType::SubscribeOk => Frame::SubscribeOk(SubscribeOk {
            request_id: r.u64("request_id")?,
            consumer_tag: r.string("consumer_tag")?,
        }),
        FrameType::Confirm => Frame::Confirm(Confirm {
            ranges: read_ranges(r)?,
        }),
        FrameType::PublishError => Frame::PublishError(PublishError {
            ranges: read_ranges(r)?,
            error: read_error_body(r, with_leader)?,
        }),
        FrameType::Deliver => Frame::Deliver(read_deliver(r, version)?),
        // The codec refused a type `version` does not define (ConsumerEnd before version 4)
        // at the type byte.
        FrameType::ConsumerEnd => Frame::ConsumerEnd(ConsumerEnd {
            consumer_tag: r.string("consumer_tag")?,
            error: read_error_body(r, true)?,
        }),
        FrameType::Heartbeat => Frame::Heartbeat,
        FrameType::Error => Frame::Error(ErrorFrame {
            request_id: r.option("request_id", |r| r.u64("request_id"))?,
            fatal: r.bool("fatal")?,
            error: read_error_body(r, with_leader)?,
        }),
        FrameType::Close => Frame::Close(Close {
            message: r.string("message")?,
        }),
        _ => unreachable!("decode_body handles every request frame"),
    };
    Ok(frame)
}

fn read_queue_request(r: &mut Reader) -> Result<QueueRequest, ProtoError> {
    Ok(QueueRequest {
        request_id: r.u64("request_id")?,
        queue: r.string("queue")?,
    })
}

fn put_overflow(dst: &mut BytesMut, overflow: &Overflow) -> Result<(), ProtoError> {
    dst.put_u8(*overflow as u8);
    Ok(())
}

fn read_overflow(r: &mut Reader) -> Result<Overflow, ProtoError> {
    match r.tag("overflow", 2)? {
        0 => Ok(Overflow::Reject),
        _ => Ok(Overflow::DropOldest),
    }
}

pub(crate) fn put_u32_value(dst: &mut BytesMut, value: &u32) -> Result<(), ProtoError> {
    dst.put_u32_le(*value);
    Ok(())
}

pub(crate) fn put_u64_value(dst: &mut BytesMut, value: &u64) -> Result<(), ProtoError> {
    dst.put_u64_le(*value);
    Ok(())
}

/// Writes queue settings; `replicas` only in version 4 and later (a reply to an older client
/// leaves it out; a `Declare` that needs it was refused before).
fn put_settings(
    dst: &mut BytesMut,
    settings: &QueueSettings,
    version: u16,
) -> Result<(), ProtoError> {
    dst.put_u32_le(settings.partitions);
    put_option(dst, settings.dead_letter.as_ref(), |dst, name| {
        put_string(dst, "settings.dead_letter", name)
    })?;
    put_option(dst, settings.max_deliveries.as_ref(), put_u32_value)?;
    put_option(dst, settings.max_messages.as_ref(), put_u64_value)?;
    put_option(dst, settings.max_bytes.as_ref(), put_u64_value)?;
    put_option(dst, settings.overflow.as_ref(), put_overflow)?;
    if version >= CLUSTER_FIELDS_SINCE {
        put_option(dst, settings.replicas.as_ref(), put_u32_value)?;
    }
    Ok(())
}

fn read_settings(r: &mut Reader, version: u16) -> Result<QueueSettings, ProtoError> {
    Ok(QueueSettings {
        partitions: r.u32("settings.partitions")?,
        dead_letter: r.option("settings.dead_letter", |r| r.string("settings.dead_letter"))?,
        max_deliveries: r.option("settings.max_deliveries", |r| {
            r.u32("settings.max_deliveries")
        })?,
        max_messages: r.option("settings.max_messages", |r| r.u64("settings.max_messages"))?,
        max_bytes: r.option("settings.max_bytes", |r| r.u64("settings.max_bytes"))?,
        overflow: r.option("settings.overflow", read_overflow)?,
        replicas: if version >= CLUSTER_FIELDS_SINCE {
            r.option("settings.replicas", |r| r.u32("settings.replicas"))?
        } else {
            None
        },
    })
}

pub(crate) fn put_update<T>(
    dst: &mut BytesMut,
    update: &Update<T>,
    write: impl FnOnce(&mut BytesMut, &T) -> Result<(), ProtoError>,
) -> Result<(), ProtoError> {
    match update {
        Update::Keep => dst.put_u8(UPDATE_KEEP),
        Update::Clear => dst.put_u8(UPDATE_CLEAR),
        Update::Set(value) => {
            dst.put_u8(UPDATE_SET);
            write(dst, value)?;
        }
    }
    Ok(())
}

pub(crate) fn read_update<T>(
    r: &mut Reader,
    field: &'static str,
    read: impl FnOnce(&mut Reader) -> Result<T, ProtoError>,
) -> Result<Update<T>, ProtoError> {
    match r.tag(field, UPDATE_TAG_COUNT)? {
        UPDATE_KEEP => Ok(Update::Keep),
        UPDATE_CLEAR => Ok(Update::Clear),
        _ => read(r).map(Update::Set),
    }
}

fn put_settings_update(dst: &mut BytesMut, update: &QueueSettingsUpdate) -> Result<(), ProtoError> {
    put_update(dst, &update.dead_letter, |dst, name| {
        put_string(dst, "update.dead_letter", name)
    })?;
    put_update(dst, &update.max_deliveries, put_u32_value)?;
    put_update(dst, &update.max_messages, put_u64_value)?;
    put_update(dst, &update.max_bytes, put_u64_value)?;
    put_update(dst, &update.overflow, put_overflow)
}

fn read_settings_update(r: &mut Reader) -> Result<QueueSettingsUpdate, ProtoError> {
    Ok(QueueSettingsUpdate {
        dead_letter: read_update(r, "update.dead_letter", |r| r.string("update.dead_letter"))?,
        max_deliveries: read_update(r, "update.max_deliveries", |r| {
            r.u32("update.max_deliveries")
        })?,
        max_messages: read_update(r, "update.max_messages", |r| r.u64("update.max_messages"))?,
        max_bytes: read_update(r, "update.max_bytes", |r| r.u64("update.max_bytes"))?,
        overflow: read_update(r, "update.overflow", read_overflow)?,
    })
}

pub(crate) fn put_headers(dst: &mut BytesMut, headers: &[Header]) -> Result<(), ProtoError> {
    put_count_u16(dst, "headers", headers.len())?;
    for header in headers {
        put_string(dst, "header.name", &header.name)?;
        put_string(dst, "header.value", &header.value)?;
    }
    Ok(())
}

pub(crate) fn read_headers(r: &mut Reader) -> Result<Vec<Header>, ProtoError> {
    r.list_u16("headers", HEADER_SIZE_MIN, |r| {
        Ok(Header {
            name: r.string("header.name")?,
            value: r.string("header.value")?,
        })
    })
}

/// Bit 7 of a `Publish` frame's `mode` byte: the messages are joinable separate publishes.
const JOINABLE_BIT: u8 = 0x80;

fn put_publish(dst: &mut BytesMut, publish: &Publish, version: u16) -> Result<(), ProtoError> {
    let producer = version >= CLUSTER_FIELDS_SINCE;
    put_string(dst, "queue", &publish.queue)?;
    dst.put_u8(publish.mode as u8 | if publish.joinable { JOINABLE_BIT } else { 0 });
    put_count_u32(dst, "messages", publish.messages.len())?;
    for message in &publish.messages {
        dst.put_u64_le(message.publish_id);
        put_option(dst, message.routing_key.as_ref(), |dst, key| {
            put_string(dst, "message.routing_key", key)
        })?;
        put_headers(dst, &message.headers)?;
        put_bytes(dst, "message.body", &message.body)?;
        if producer {
            put_option(dst, message.sequence.as_ref(), |dst, sequence| {
                dst.put_u64_le(*sequence);
                Ok(())
            })?;
        }
    }
    if producer {
        put_option(dst, publish.producer_id.as_ref(), |dst, id| {
            dst.put_u64_le(*id);
            Ok(())
        })?;
    }
    Ok(())
}

fn read_publish(r: &mut Reader, version: u16) -> Result<Publish, ProtoError> {
    let producer = version >= CLUSTER_FIELDS_SINCE;
    let queue = r.string("queue")?;
    let mode_byte = r.u8("mode")?;
    let joinable = mode_byte & JOINABLE_BIT != 0;
    let mode = match mode_byte & !JOINABLE_BIT {
        0 => PublishMode::Confirmed,
        1 => PublishMode::Buffered,
        _ => return Err(r.invalid_tag("mode", mode_byte)),
    };
    let messages = r.list_u32("messages", MESSAGE_SIZE_MIN, |r| {
        Ok(Message {
            publish_id: r.u64("message.publish_id")?,
            routing_key: r.option("message.routing_key", |r| r.string("message.routing_key"))?,
            headers: read_headers(r)?,
            body: r.bytes("message.body")?,
            sequence: if producer {
                r.option("message.sequence", |r| r.u64("message.sequence"))?
            } else {
                None
            },
        })
    })?;
    let producer_id = if producer {
        r.option("producer_id", |r| r.u64("producer_id"))?
    } else {
        None
    };
    Ok(Publish {
        queue,
        mode,
        messages,
        joinable,
        producer_id,
    })
}

fn put_delivery_ids(dst: &mut BytesMut, delivery_ids: &[u64]) -> Result<(), ProtoError> {
    put_count_u32(dst, "delivery_ids", delivery_ids.len())?;
    for delivery_id in delivery_ids {
        dst.put_u64_le(*delivery_id);
    }
    Ok(())
}

fn read_delivery_ids(r: &mut Reader) -> Result<Vec<u64>, ProtoError> {
    r.list_u32("delivery_ids", DELIVERY_ID_SIZE, |r| r.u64("delivery_id"))
}

fn put_ranges(dst: &mut BytesMut, ranges: &[PublishIdRange]) -> Result<(), ProtoError> {
    put_count_u32(dst, "ranges", ranges.len())?;
    for range in ranges {
        dst.put_u64_le(range.first);
        dst.put_u64_le(range.last);
    }
    Ok(())
}

fn read_ranges(r: &mut Reader) -> Result<Vec<PublishIdRange>, ProtoError> {
    r.list_u32("ranges", RANGE_SIZE, |r| {
        let first = r.u64("range.first")?;
        let last = r.u64("range.last")?;
        if first > last {
            return Err(r.error(
                "range.last",
                Problem::InvalidValue("range ends before it starts"),
            ));
        }
        Ok(PublishIdRange { first, last })
    })
}

/// Writes an error body: code u16, reason option string, retry_after_ms option u32, message,
/// and with `with_leader` (frames of version 4 and later) leader_addr option string.
pub(crate) fn put_error_body(
    dst: &mut BytesMut,
    error: &ErrorBody,
    with_leader: bool,
) -> Result<(), ProtoError> {
    dst.put_u16_le(error.code().0);
    put_option(dst, error.reason(), |dst, reason| {
        put_string(dst, "error.reason", reason.name())
    })?;
    put_option(dst, error.retry_after_ms().as_ref(), put_u32_value)?;
    put_string(dst, "error.message", error.message())?;
    if with_leader {
        put_option(
            dst,
            error.leader_addr().map(str::to_owned).as_ref(),
            |dst, addr| put_string(dst, "error.leader_addr", addr),
        )?;
    }
    Ok(())
}

/// Reads an error body, enforcing that `ERR_LIMITED` carries a reason and a hint; with
/// `with_leader` (frames of version 4 and later) its trailing leader_addr too.
pub(crate) fn read_error_body(r: &mut Reader, with_leader: bool) -> Result<ErrorBody, ProtoError> {
    let code = Code(r.u16("error.code")?);
    let reason = r.option("error.reason", |r| r.string("error.reason"))?;
    let reason = reason.map(|name| LimitReason::from_name(&name));
    let retry_after_ms = r.option("error.retry_after_ms", |r| r.u32("error.retry_after_ms"))?;
    let message = r.string("error.message")?;
    let body =
        ErrorBody::from_parts(code, reason, retry_after_ms, message).map_err(
            |error| match error {
                ProtoError::InvalidValue { field, reason } => {
                    r.error(field, Problem::InvalidValue(reason))
                }
                other => other,
            },
        )?;
    let leader_addr = if with_leader {
        r.option("error.leader_addr", |r| r.string("error.leader_addr"))?
    } else {
        None
    };
    Ok(body.with_leader_addr(leader_addr))
}

/// Writes a delivery; `routing_key` only in version 7 and later (a server writing to an older
/// client leaves it out, as it leaves out the cluster fields of a reply).
fn put_deliver(dst: &mut BytesMut, deliver: &Deliver, version: u16) -> Result<(), ProtoError> {
    put_string(dst, "consumer_tag", &deliver.consumer_tag)?;
    dst.put_u64_le(deliver.delivery_id);
    dst.put_u32_le(deliver.partition);
    dst.put_u64_le(deliver.offset);
    dst.put_u8(u8::from(deliver.redelivered));
    dst.put_u32_le(deliver.delivery_count);
    if version >= DELIVER_ROUTING_KEY_SINCE {
        put_option(dst, deliver.routing_key.as_ref(), |dst, key| {
            put_string(dst, "routing_key", key)
        })?;
    }
    put_headers(dst, &deliver.headers)?;
    put_bytes(dst, "body", &deliver.body)
}

fn read_deliver(r: &mut Reader, version: u16) -> Result<Deliver, ProtoError> {
    Ok(Deliver {
        consumer_tag: r.string("consumer_tag")?,
        delivery_id: r.u64("delivery_id")?,
        partition: r.u32("partition")?,
        offset: r.u64("offset")?,
        redelivered: r.bool("redelivered")?,
        delivery_count: r.u32("delivery_count")?,
        routing_key: if version >= DELIVER_ROUTING_KEY_SINCE {
            r.option("routing_key", |r| r.string("routing_key"))?
        } else {
            None
        },
        headers: read_headers(r)?,
        body: r.bytes("body")?,
    })
}

/// Writes a queue info reply; before version 4 without `replicas` and the partitions' leader
/// fields (an older client cannot read them and talks to a node that runs alone).
fn put_queue_info_reply(
    dst: &mut BytesMut,
    info: &QueueInfoReply,
    version: u16,
) -> Result<(), ProtoError> {
    dst.put_u64_le(info.request_id);
    put_string(dst, "queue", &info.queue)?;
    put_settings(dst, &info.settings, version)?;
    put_count_u32(dst, "partitions", info.partitions.len())?;
    for partition in &info.partitions {
        dst.put_u64_le(partition.ready);
        dst.put_u64_le(partition.inflight);
        dst.put_u64_le(partition.bytes);
        dst.put_u64_le(partition.disk_bytes);
        if version >= CLUSTER_FIELDS_SINCE {
            dst.put_u8(u8::from(partition.leading));
            put_option(dst, partition.leader.as_ref(), put_u64_value)?;
            put_option(dst, partition.leader_addr.as_ref(), |dst, addr| {
                put_string(dst, "partition.leader_addr", addr)
            })?;
        }
    }
    Ok(())
}

fn read_queue_info_reply(r: &mut Reader, version: u16) -> Result<QueueInfoReply, ProtoError> {
    let cluster_fields = version >= CLUSTER_FIELDS_SINCE;
    let partition_size_min = if cluster_fields {
        PARTITION_INFO_SIZE + PARTITION_LEADER_SIZE_MIN
    } else {
        PARTITION_INFO_SIZE
    };
    Ok(QueueInfoReply {
        request_id: r.u64("request_id")?,
        queue: r.string("queue")?,
        settings: read_settings(r, version)?,
        partitions: r.list_u32("partitions", partition_size_min, |r| {
            let mut partition = PartitionInfo {
                ready: r.u64("partition.ready")?,
                inflight: r.u64("partition.inflight")?,
                bytes: r.u64("partition.bytes")?,
                disk_bytes: r.u64("partition.disk_bytes")?,
                leading: true,
                leader: None,
                leader_addr: None,
            };
            if cluster_fields {
                partition.leading = r.bool("partition.leading")?;
                partition.leader = r.option("partition.leader", |r| r.u64("partition.leader"))?;
                partition.leader_addr = r.option("partition.leader_addr", |r| {
                    r.string("partition.leader_addr")
                })?;
            }
            Ok(partition)
        })?,
    })
}

fn put_queue_list_reply(dst: &mut BytesMut, list: &QueueListReply) -> Result<(), ProtoError> {
    dst.put_u64_le(list.request_id);
    put_count_u32(dst, "queues", list.queues.len())?;
    for summary in &list.queues {
        put_string(dst, "queue.name", &summary.queue)?;
        dst.put_u32_le(summary.partitions);
        dst.put_u64_le(summary.ready);
        dst.put_u64_le(summary.inflight);
        dst.put_u64_le(summary.bytes);
    }
    Ok(())
}

fn read_queue_summary(r: &mut Reader) -> Result<QueueSummary, ProtoError> {
    Ok(QueueSummary {
        queue: r.string("queue.name")?,
        partitions: r.u32("queue.partitions")?,
        ready: r.u64("queue.ready")?,
        inflight: r.u64("queue.inflight")?,
        bytes: r.u64("queue.bytes")?,
    })
}
