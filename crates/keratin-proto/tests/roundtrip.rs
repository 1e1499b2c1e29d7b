//! Proves that the codec is a faithful, panic-free inverse of itself and of `docs/protocol.md`:
//!
//! - every frame and hello roundtrips encode → decode unchanged, whole or split at any points,
//!   in version 7 (the stream frames included) and in version 6 (without them);
//! - arbitrary bytes, random bodies behind valid headers and mutated valid frames never panic
//!   the decoder, and every failure maps to a 400 or 413 answer;
//! - an oversize length prefix is refused with 413 from its four bytes, before any buffer grows;
//! - the example byte blocks in `docs/protocol.md` are exactly what the encoder writes;
//! - the stream frames and `Deliver.routing_key` exist only from version 7 (an older version
//!   reads their types as unknown and cannot write them), and malformed stream frames (every
//!   truncation, a bad start kind, lists over their bounds) are errors, never panics;
//! - the login of a version 6 hello (every mechanism) roundtrips, respects its bounds both ways
//!   (an out-of-bound field fails to encode, leaving the buffer as it was, and fails to decode),
//!   is never on the wire below version 6, and never shows a secret in `Debug`.
//!
//! A failure prints the frame or bytes that broke and `KERATIN_SEED=<n>`; rerun with that
//! variable set to replay the same cases. A drifted spec fails `spec_examples_match_the_encoder`
//! with the bytes the encoder produced.

use bytes::{Bytes, BytesMut};
use keratin_proto::codec::{HEADER_SIZE, LENGTH_SIZE};
use keratin_proto::codes::{self, Code, ERR_BAD_REQUEST, ERR_TOO_LARGE};
use keratin_proto::*;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::Union;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use tokio_util::codec::{Decoder, Encoder};

// ---------------------------------------------------------------------------------------------
// Seeded runner

/// Runs `test` over `strategy` with a seed from `KERATIN_SEED` (or a fresh one), and names the
/// seed in the panic so the failure can be replayed.
fn check<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let seed = std::env::var("KERATIN_SEED")
        .ok()
        .and_then(|seed| seed.parse::<u64>().ok())
        .unwrap_or_else(fresh_seed);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
    let config = Config {
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(config, rng);
    if let Err(failure) = runner.run(&strategy, test) {
        panic!("{name} failed; replay with KERATIN_SEED={seed}\n{failure}");
    }
}

fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

// ---------------------------------------------------------------------------------------------
// Strategies

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,8}"
}

fn body() -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..48).prop_map(Bytes::from)
}

/// The newest version the codec speaks: the properties run in it, so they cover every frame.
const NEWEST: u16 = PROTOCOL_VERSION_STREAMS;

fn headers() -> impl Strategy<Value = Vec<Header>> {
    vec(
        (text(), text()).prop_map(|(name, value)| Header { name, value }),
        0..3,
    )
}

fn overflow() -> impl Strategy<Value = Overflow> {
    prop_oneof![Just(Overflow::Reject), Just(Overflow::DropOldest)]
}

fn settings() -> impl Strategy<Value = QueueSettings> {
    (
        any::<u32>(),
        proptest::option::of(text()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(overflow()),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(
            |(
                partitions,
                dead_letter,
                max_deliveries,
                max_messages,
                max_bytes,
                overflow,
                replicas,
            )| {
                QueueSettings {
                    partitions,
                    dead_letter,
                    max_deliveries,
                    max_messages,
                    max_bytes,
                    overflow,
                    replicas,
                }
            },
        )
}

fn update<T: std::fmt::Debug + Clone>(
    value: impl Strategy<Value = T>,
) -> impl Strategy<Value = Update<T>> {
    prop_oneof![
        Just(Update::Keep),
        Just(Update::Clear),
        value.prop_map(Update::Set)
    ]
}

fn settings_update() -> impl Strategy<Value = QueueSettingsUpdate> {
    (
        update(text()),
        update(any::<u32>()),
        update(any::<u64>()),
        update(any::<u64>()),
        update(overflow()),
    )
        .prop_map(
            |(dead_letter, max_deliveries, max_messages, max_bytes, overflow)| {
                QueueSettingsUpdate {
                    dead_letter,
                    max_deliveries,
                    max_messages,
                    max_bytes,
                    overflow,
                }
            },
        )
}

fn limit_reason() -> impl Strategy<Value = LimitReason> {
    // from_name keeps the invariant that Unknown never holds a known name.
    "[a-z_]{0,12}".prop_map(|name| LimitReason::from_name(&name))
}

fn error_body() -> impl Strategy<Value = ErrorBody> {
    let limited =
        (limit_reason(), any::<u32>(), text()).prop_map(|(reason, retry_after_ms, message)| {
            ErrorBody::limited(reason, retry_after_ms, message)
        });
    let code = prop_oneof![
        proptest::sample::select(codes::KNOWN.to_vec()),
        any::<u16>().prop_map(Code)
    ]
    .prop_filter("429 is built by ErrorBody::limited", |code| {
        *code != codes::ERR_LIMITED
    });
    let other = (
        code,
        proptest::option::of(limit_reason()),
        proptest::option::of(any::<u32>()),
        text(),
    )
        .prop_map(|(code, reason, retry_after_ms, message)| {
            ErrorBody::from_parts(code, reason, retry_after_ms, message).expect("not a 429")
        });
    prop_oneof![limited, other]
}

/// An error body as frames of version 4 carry it: any body, with or without a leader address.
fn frame_error_body() -> impl Strategy<Value = ErrorBody> {
    (error_body(), proptest::option::of(text()))
        .prop_map(|(body, leader_addr)| body.with_leader_addr(leader_addr))
}

/// Every mechanism, with fields inside their bounds.
fn auth() -> impl Strategy<Value = Auth> {
    prop_oneof![
        Just(Auth::None),
        ("\\PC{1,8}", "\\PC{1,16}").prop_map(|(user, password)| Auth::Plain { user, password }),
        Just(Auth::External),
        "kt_[0-9a-f]{64}".prop_map(Auth::Token),
    ]
}

fn ranges() -> impl Strategy<Value = Vec<PublishIdRange>> {
    vec(
        (any::<u64>(), any::<u64>()).prop_map(|(a, b)| PublishIdRange {
            first: a.min(b),
            last: a.max(b),
        }),
        0..4,
    )
}

fn message() -> impl Strategy<Value = Message> {
    (
        any::<u64>(),
        proptest::option::of(text()),
        headers(),
        body(),
        proptest::option::of(any::<u64>()),
    )
        .prop_map(
            |(publish_id, routing_key, headers, body, sequence)| Message {
                publish_id,
                routing_key,
                headers,
                body,
                sequence,
            },
        )
}

fn queue_request() -> impl Strategy<Value = QueueRequest> {
    (any::<u64>(), text()).prop_map(|(request_id, queue)| QueueRequest { request_id, queue })
}

fn request_frame() -> Vec<BoxedStrategy<Frame>> {
    vec![
        (any::<u64>(), text(), settings(), vec(any::<u64>(), 0..5))
            .prop_map(|(request_id, queue, settings, nodes)| {
                Frame::Declare(Declare {
                    request_id,
                    queue,
                    settings,
                    nodes,
                })
            })
            .boxed(),
        queue_request().prop_map(Frame::Delete).boxed(),
        queue_request().prop_map(Frame::Purge).boxed(),
        queue_request().prop_map(Frame::QueueInfo).boxed(),
        any::<u64>()
            .prop_map(|request_id| Frame::QueueList(QueueList { request_id }))
            .boxed(),
        (any::<u64>(), text(), settings_update())
            .prop_map(|(request_id, queue, update)| {
                Frame::SetQueueSettings(SetQueueSettings {
                    request_id,
                    queue,
                    update,
                })
            })
            .boxed(),
        (
            text(),
            any::<bool>(),
            vec(message(), 0..4),
            any::<bool>(),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(|(queue, buffered, messages, joinable, producer_id)| {
                let mode = if buffered {
                    PublishMode::Buffered
                } else {
                    PublishMode::Confirmed
                };
                Frame::Publish(Publish {
                    queue,
                    mode,
                    messages,
                    joinable,
                    producer_id,
                })
            })
            .boxed(),
        (any::<u64>(), text(), any::<u32>(), text(), any::<u64>())
            .prop_map(
                |(request_id, queue, prefetch, consumer_tag, prefetch_bytes)| {
                    Frame::Subscribe(Subscribe {
                        request_id,
                        queue,
                        prefetch,
                        consumer_tag,
                        prefetch_bytes,
                    })
                },
            )
            .boxed(),
        (any::<u64>(), text())
            .prop_map(|(request_id, consumer_tag)| {
                Frame::Cancel(Cancel {
                    request_id,
                    consumer_tag,
                })
            })
            .boxed(),
        vec(any::<u64>(), 0..6)
            .prop_map(|delivery_ids| Frame::Ack(Ack { delivery_ids }))
            .boxed(),
        (vec(any::<u64>(), 0..6), any::<bool>())
            .prop_map(|(delivery_ids, requeue)| {
                Frame::Reject(Reject {
                    delivery_ids,
                    requeue,
                })
            })
            .boxed(),
    ]
}

fn partition_info() -> impl Strategy<Value = PartitionInfo> {
    (
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        any::<bool>(),
        proptest::option::of(any::<u64>()),
        proptest::option::of(text()),
    )
        .prop_map(
            |((ready, inflight, bytes, disk_bytes), leading, leader, leader_addr)| PartitionInfo {
                ready,
                inflight,
                bytes,
                disk_bytes,
                leading,
                leader,
                leader_addr,
            },
        )
}

fn queue_summary() -> impl Strategy<Value = QueueSummary> {
    (
        text(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(queue, partitions, ready, inflight, bytes)| QueueSummary {
            queue,
            partitions,
            ready,
            inflight,
            bytes,
        })
}

fn reply_frame() -> Vec<BoxedStrategy<Frame>> {
    let partition = partition_info();
    let summary = queue_summary();
    vec![
        any::<u64>()
            .prop_map(|request_id| Frame::Ok(OkReply { request_id }))
            .boxed(),
        (any::<u64>(), text(), settings(), vec(partition, 0..4))
            .prop_map(|(request_id, queue, settings, partitions)| {
                Frame::QueueInfoReply(QueueInfoReply {
                    request_id,
                    queue,
                    settings,
                    partitions,
                })
            })
            .boxed(),
        (any::<u64>(), vec(summary, 0..4))
            .prop_map(|(request_id, queues)| {
                Frame::QueueListReply(QueueListReply { request_id, queues })
            })
            .boxed(),
        (any::<u64>(), text())
            .prop_map(|(request_id, consumer_tag)| {
                Frame::SubscribeOk(SubscribeOk {
                    request_id,
                    consumer_tag,
                })
            })
            .boxed(),
        ranges()
            .prop_map(|ranges| Frame::Confirm(Confirm { ranges }))
            .boxed(),
        (ranges(), frame_error_body())
            .prop_map(|(ranges, error)| Frame::PublishError(PublishError { ranges, error }))
            .boxed(),
        deliver().boxed(),
        (text(), frame_error_body())
            .prop_map(|(consumer_tag, error)| {
                Frame::ConsumerEnd(ConsumerEnd {
                    consumer_tag,
                    error,
                })
            })
            .boxed(),
        Just(Frame::Heartbeat).boxed(),
        (
            proptest::option::of(any::<u64>()),
            any::<bool>(),
            frame_error_body(),
        )
            .prop_map(|(request_id, fatal, error)| {
                Frame::Error(ErrorFrame {
                    request_id,
                    fatal,
                    error,
                })
            })
            .boxed(),
        text()
            .prop_map(|message| Frame::Close(Close { message }))
            .boxed(),
    ]
}

fn deliver() -> impl Strategy<Value = Frame> {
    (
        text(),
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<bool>(),
        any::<u32>(),
        proptest::option::of(text()),
        headers(),
        body(),
    )
        .prop_map(
            |(
                consumer_tag,
                delivery_id,
                partition,
                offset,
                redelivered,
                delivery_count,
                routing_key,
                headers,
                body,
            )| {
                Frame::Deliver(Deliver {
                    consumer_tag,
                    delivery_id,
                    partition,
                    offset,
                    redelivered,
                    delivery_count,
                    routing_key,
                    headers,
                    body,
                })
            },
        )
}

fn stream_settings() -> impl Strategy<Value = StreamSettings> {
    (
        any::<u32>(),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
    )
        .prop_map(
            |(partitions, replicas, max_bytes, max_age_ms, max_messages)| StreamSettings {
                partitions,
                replicas,
                max_bytes,
                max_age_ms,
                max_messages,
            },
        )
}

fn stream_start() -> impl Strategy<Value = StreamStart> {
    prop_oneof![
        Just(StreamStart::First),
        Just(StreamStart::Last),
        Just(StreamStart::Next),
        any::<u64>().prop_map(StreamStart::Offset),
        any::<u64>().prop_map(StreamStart::Timestamp),
    ]
}

fn stream_request() -> impl Strategy<Value = StreamRequest> {
    (any::<u64>(), text()).prop_map(|(request_id, stream)| StreamRequest { request_id, stream })
}

fn stream_partition_info() -> impl Strategy<Value = StreamPartitionInfo> {
    (
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        ),
        proptest::option::of(any::<u64>()),
        any::<bool>(),
        proptest::option::of(any::<u64>()),
        proptest::option::of(text()),
    )
        .prop_map(
            |(
                (start_offset, next_offset, messages, bytes, disk_bytes),
                oldest_timestamp_ms,
                leading,
                leader,
                leader_addr,
            )| StreamPartitionInfo {
                start_offset,
                next_offset,
                messages,
                bytes,
                disk_bytes,
                oldest_timestamp_ms,
                leading,
                leader,
                leader_addr,
            },
        )
}

fn stream_message() -> impl Strategy<Value = StreamMessage> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::option::of(text()),
        headers(),
        body(),
    )
        .prop_map(
            |(offset, timestamp_ms, routing_key, headers, body)| StreamMessage {
                offset,
                timestamp_ms,
                routing_key,
                headers,
                body,
            },
        )
}

/// The frames of version 7, one strategy per stream frame type.
fn stream_frame() -> Vec<BoxedStrategy<Frame>> {
    vec![
        (
            any::<u64>(),
            text(),
            stream_settings(),
            vec(any::<u64>(), 0..5),
        )
            .prop_map(|(request_id, stream, settings, nodes)| {
                Frame::StreamDeclare(StreamDeclare {
                    request_id,
                    stream,
                    settings,
                    nodes,
                })
            })
            .boxed(),
        (
            any::<u64>(),
            text(),
            update(any::<u64>()),
            update(any::<u64>()),
            update(any::<u64>()),
        )
            .prop_map(
                |(request_id, stream, max_bytes, max_age_ms, max_messages)| {
                    Frame::StreamSet(StreamSet {
                        request_id,
                        stream,
                        update: StreamRetentionUpdate {
                            max_bytes,
                            max_age_ms,
                            max_messages,
                        },
                    })
                },
            )
            .boxed(),
        stream_request().prop_map(Frame::StreamInfo).boxed(),
        any::<u64>()
            .prop_map(|request_id| Frame::StreamList(StreamList { request_id }))
            .boxed(),
        stream_request().prop_map(Frame::StreamDelete).boxed(),
        (
            (any::<u64>(), text(), text(), proptest::option::of(text())),
            any::<bool>(),
            stream_start(),
            any::<u32>(),
            any::<bool>(),
            vec(any::<u32>(), 0..5),
        )
            .prop_map(
                |(
                    (request_id, stream, consumer_tag, cursor),
                    group,
                    start,
                    credit,
                    auto_commit,
                    partitions,
                )| {
                    Frame::StreamSubscribe(StreamSubscribe {
                        request_id,
                        stream,
                        consumer_tag,
                        cursor,
                        group,
                        start,
                        credit,
                        auto_commit,
                        partitions,
                    })
                },
            )
            .boxed(),
        (text(), any::<u32>())
            .prop_map(|(consumer_tag, credit)| {
                Frame::StreamCredit(StreamCredit {
                    consumer_tag,
                    credit,
                })
            })
            .boxed(),
        (
            any::<u64>(),
            text(),
            text(),
            vec(
                (any::<u32>(), any::<u64>())
                    .prop_map(|(partition, offset)| CursorEntry { partition, offset }),
                0..5,
            ),
        )
            .prop_map(|(request_id, stream, cursor, entries)| {
                Frame::CursorCommit(CursorCommit {
                    request_id,
                    stream,
                    cursor,
                    entries,
                })
            })
            .boxed(),
        (
            any::<u64>(),
            text(),
            stream_settings(),
            vec(stream_partition_info(), 0..4),
        )
            .prop_map(|(request_id, stream, settings, partitions)| {
                Frame::StreamInfoReply(StreamInfoReply {
                    request_id,
                    stream,
                    settings,
                    partitions,
                })
            })
            .boxed(),
        (
            any::<u64>(),
            vec(
                (text(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
                    |(stream, partitions, messages, bytes)| StreamSummary {
                        stream,
                        partitions,
                        messages,
                        bytes,
                    },
                ),
                0..4,
            ),
        )
            .prop_map(|(request_id, streams)| {
                Frame::StreamListReply(StreamListReply {
                    request_id,
                    streams,
                })
            })
            .boxed(),
        (
            text(),
            any::<u32>(),
            proptest::option::of(any::<u64>()),
            vec(stream_message(), 0..4),
        )
            .prop_map(|(consumer_tag, partition, moved_from, messages)| {
                Frame::StreamDeliver(StreamDeliver {
                    consumer_tag,
                    partition,
                    moved_from,
                    messages,
                })
            })
            .boxed(),
        (text(), any::<u32>(), frame_error_body())
            .prop_map(|(consumer_tag, partition, error)| {
                Frame::StreamPartitionEnd(StreamPartitionEnd {
                    consumer_tag,
                    partition,
                    error,
                })
            })
            .boxed(),
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    let mut arms = request_frame();
    arms.extend(reply_frame());
    arms.extend(stream_frame());
    assert_eq!(
        arms.len(),
        FrameType::ALL.len(),
        "one strategy per frame type"
    );
    Union::new(arms)
}

/// The frame encoded in the newest version (every example of the spec has the same bytes in it).
fn encode(frame: &Frame) -> BytesMut {
    encode_version(frame, NEWEST)
}

fn encode_version(frame: &Frame, version: u16) -> BytesMut {
    let mut dst = BytesMut::new();
    FrameCodec::new()
        .with_version(version)
        .encode(frame, &mut dst)
        .expect("small frames encode");
    dst
}

/// Feeds `chunks` one at a time and decodes after each, as a connection's read loop does.
fn decode_stream(chunks: &[&[u8]]) -> Result<Vec<Frame>, ProtoError> {
    decode_stream_version(chunks, NEWEST)
}

fn decode_stream_version(chunks: &[&[u8]], version: u16) -> Result<Vec<Frame>, ProtoError> {
    let mut codec = FrameCodec::new().with_version(version);
    let mut src = BytesMut::new();
    let mut frames = Vec::new();
    for chunk in chunks {
        src.extend_from_slice(chunk);
        while let Some(frame) = codec.decode(&mut src)? {
            frames.push(frame);
        }
    }
    if let Some(frame) = codec.decode_eof(&mut src)? {
        frames.push(frame);
    }
    Ok(frames)
}

fn assert_answerable(error: &ProtoError) -> Result<(), TestCaseError> {
    let code = error.code();
    prop_assert!(
        code == ERR_BAD_REQUEST || code == ERR_TOO_LARGE,
        "{error} maps to {code}"
    );
    prop_assert!(!error.to_error_body().message().is_empty());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Properties

#[test]
fn every_frame_roundtrips() {
    check("every_frame_roundtrips", frame(), |frame| {
        let bytes = encode(&frame);
        let status = Frame::check_version(&bytes, FRAME_SIZE_BYTES_MAX, NEWEST)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            status,
            FrameStatus::Complete {
                size_bytes: bytes.len()
            }
        );
        let decoded = decode_stream(&[&bytes]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decoded, vec![frame]);
        Ok(())
    });
}

/// In version 6 every frame of version 6 roundtrips, except that `Deliver` loses its routing
/// key (version 7's field); the stream frames cannot be written.
#[test]
fn every_frame_of_version_6_roundtrips_in_version_6() {
    check("every_frame_v6", frame(), |frame| {
        let mut dst = BytesMut::new();
        let encoded = frame.encode_version(&mut dst, FRAME_SIZE_BYTES_MAX, 6);
        if frame.frame_type().since() > 6 {
            prop_assert!(encoded.is_err());
            prop_assert!(dst.is_empty(), "a refused frame leaves nothing behind");
            return Ok(());
        }
        encoded.map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut expected = frame;
        if let Frame::Deliver(deliver) = &mut expected {
            deliver.routing_key = None;
        }
        let decoded =
            decode_stream_version(&[&dst], 6).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decoded, vec![expected]);
        Ok(())
    });
}

#[test]
fn a_stream_split_anywhere_decodes_the_same_frames() {
    let strategy = (vec(frame(), 1..6), vec(any::<prop::sample::Index>(), 0..8));
    check("split_stream", strategy, |(frames, cuts)| {
        let mut stream = BytesMut::new();
        for frame in &frames {
            stream.extend_from_slice(&encode(frame));
        }
        let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(stream.len() + 1)).collect();
        cuts.push(0);
        cuts.push(stream.len());
        cuts.sort_unstable();
        let chunks: Vec<&[u8]> = cuts
            .windows(2)
            .map(|pair| &stream[pair[0]..pair[1]])
            .collect();
        let decoded = decode_stream(&chunks).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decoded, frames);
        Ok(())
    });
}

#[test]
fn arbitrary_bytes_never_panic() {
    check("arbitrary_bytes", vec(any::<u8>(), 0..256), |bytes| {
        if let Err(error) = decode_stream(&[&bytes]) {
            if !matches!(error, ProtoError::UnexpectedEof { .. }) {
                assert_answerable(&error)?;
            }
        }
        Ok(())
    });
}

#[test]
fn random_bodies_behind_valid_headers_never_panic() {
    let strategy = (
        proptest::sample::select(FrameType::ALL.to_vec()),
        vec(any::<u8>(), 0..128),
    );
    check("random_bodies", strategy, |(frame_type, body)| {
        let length = u32::try_from(body.len() + 1).expect("small");
        let mut bytes = length.to_le_bytes().to_vec();
        bytes.push(frame_type as u8);
        bytes.extend_from_slice(&body);
        for version in [PROTOCOL_VERSION, NEWEST] {
            match Frame::decode_version(Bytes::from(bytes.clone()), version) {
                // Whatever decodes must encode back to the very same bytes: one encoding per
                // value.
                Ok(frame) => prop_assert_eq!(&encode_version(&frame, version)[..], &bytes[..]),
                Err(error) => assert_answerable(&error)?,
            }
        }
        Ok(())
    });
}

#[test]
fn mutated_frames_never_panic() {
    let strategy = (
        frame(),
        any::<prop::sample::Index>(),
        any::<u8>(),
        any::<prop::sample::Index>(),
    );
    check("mutated_frames", strategy, |(frame, at, value, cut)| {
        let mut bytes = encode(&frame).to_vec();
        let at = at.index(bytes.len());
        bytes[at] = value;
        bytes.truncate(cut.index(bytes.len()) + 1);
        if let Err(error) = decode_stream(&[&bytes]) {
            if !matches!(error, ProtoError::UnexpectedEof { .. }) {
                assert_answerable(&error)?;
            }
        }
        Ok(())
    });
}

#[test]
fn oversize_prefix_gets_413_before_any_allocation() {
    let strategy = (
        1u32..=FRAME_SIZE_BYTES_MAX,
        any::<u32>(),
        vec(any::<u8>(), 0..16),
    );
    check("oversize", strategy, |(limit, length, rest)| {
        prop_assume!(length > limit);
        let mut src = BytesMut::with_capacity(LENGTH_SIZE + rest.len());
        src.extend_from_slice(&length.to_le_bytes());
        src.extend_from_slice(&rest);
        let capacity = src.capacity();
        let mut codec = FrameCodec::with_frame_size_bytes_max(limit);
        let error = codec.decode(&mut src).expect_err("over the limit");
        prop_assert_eq!(error.code(), ERR_TOO_LARGE);
        let named_sizes = matches!(error, ProtoError::FrameTooLarge { size_bytes, limit_bytes }
            if size_bytes == u64::from(length) && limit_bytes == limit);
        prop_assert!(named_sizes, "error names both sizes: {}", error);
        prop_assert_eq!(src.capacity(), capacity, "the buffer did not grow");
        Ok(())
    });
}

#[test]
fn hellos_roundtrip_split_anywhere() {
    let strategy = (
        text(),
        any::<u16>(),
        text(),
        any::<prop::sample::Index>(),
        auth(),
        proptest::option::of(text()),
    );
    check(
        "hellos",
        strategy,
        |(client_name, version, node_id, cut, auth, user)| {
            let hello = ClientHello {
                version,
                client_name,
                auth: if version >= AUTH_VERSION {
                    auth
                } else {
                    Auth::None
                },
            };
            let mut bytes = BytesMut::new();
            hello
                .encode(&mut bytes)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let cut = cut.index(bytes.len());
            let mut src = BytesMut::from(&bytes[..cut]);
            prop_assert_eq!(ClientHello::decode(&mut src).ok(), Some(None));
            src.extend_from_slice(&bytes[cut..]);
            prop_assert_eq!(
                ClientHello::decode(&mut src).ok(),
                Some(Some(hello.clone()))
            );
            let info = ServerInfo {
                admin: Some("127.0.0.1:5681".into()),
                nodes: vec![NodeAddress {
                    node_id: node_id.chars().take(64).collect(),
                    server: "127.0.0.1:5680".into(),
                    admin: None,
                }],
            };
            let mut answer = ServerHello::answer(&hello, node_id, info);
            if let ServerHello::Accepted { user: named, .. } = &mut answer {
                *named = user;
            }
            let mut bytes = BytesMut::new();
            answer
                .encode(&mut bytes)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            // Below version 6 the user is not sent: it comes back as `None`.
            if let ServerHello::Accepted { version, user, .. } = &mut answer {
                if *version < AUTH_VERSION {
                    *user = None;
                }
            }
            prop_assert_eq!(ServerHello::decode(&mut bytes).ok(), Some(Some(answer)));
            Ok(())
        },
    );
}

#[test]
fn arbitrary_hello_bytes_never_panic() {
    check("hello_bytes", vec(any::<u8>(), 0..64), |bytes| {
        let mut with_magic = BytesMut::from(&b"KRTN"[..]);
        with_magic.extend_from_slice(&bytes);
        for mut src in [BytesMut::from(&bytes[..]), with_magic] {
            let _ = ClientHello::decode(&mut src.clone());
            let _ = ServerHello::decode(&mut src);
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// Fixed vectors from the spec

const SPEC: &str = include_str!("../../../docs/protocol.md");

/// The bytes of the example named `name` in `docs/protocol.md`: the fenced block after
/// `<!-- example: name -->`, hex pairs, with `#` comments ignored.
fn spec_example(name: &str) -> Vec<u8> {
    let marker = format!("<!-- example: {name} -->");
    let after = SPEC
        .split_once(&marker)
        .unwrap_or_else(|| panic!("no example {name}"))
        .1;
    let block = after
        .split("```")
        .nth(1)
        .unwrap_or_else(|| panic!("no block for {name}"));
    block
        .lines()
        .skip(1) // The info string (`text`).
        .flat_map(|line| line.split('#').next().unwrap_or("").split_whitespace())
        .map(|pair| {
            u8::from_str_radix(pair, 16).unwrap_or_else(|_| panic!("{name}: bad hex {pair}"))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn assert_example(name: &str, encoded: &[u8]) {
    let expected = spec_example(name);
    assert_eq!(
        hex(encoded),
        hex(&expected),
        "docs/protocol.md example {name} differs from the encoder (left: encoder)"
    );
}

#[test]
fn spec_examples_match_the_encoder() {
    let examples = SPEC.matches("<!-- example: ").count();
    assert_eq!(examples, 14, "every example in the spec is checked here");

    assert_example("heartbeat", &encode(&Frame::Heartbeat));
    assert_example(
        "ack",
        &encode(&Frame::Ack(Ack {
            delivery_ids: vec![1, 2],
        })),
    );
    let publish = Frame::Publish(Publish {
        queue: "q".into(),
        mode: PublishMode::Confirmed,
        messages: vec![Message {
            publish_id: 7,
            routing_key: None,
            headers: vec![Header {
                name: "k".into(),
                value: "v".into(),
            }],
            body: Bytes::from_static(b"hi"),
            sequence: Some(1),
        }],
        joinable: false,
        producer_id: Some(9),
    });
    assert_example("publish", &encode(&publish));
    let publish_error = Frame::PublishError(PublishError {
        ranges: vec![PublishIdRange::single(7)],
        error: ErrorBody::limited(LimitReason::QueueFull, 250, "full"),
    });
    assert_example("publish_error", &encode(&publish_error));
    let error = Frame::Error(ErrorFrame {
        request_id: None,
        fatal: true,
        error: ErrorBody::new(ERR_TOO_LARGE, "too big"),
    });
    assert_example("error", &encode(&error));
    // The first two hello examples are of version 5, the last before logins.
    let v5_hello = ClientHello {
        version: 5,
        ..ClientHello::new("cli")
    };
    let mut hello = BytesMut::new();
    v5_hello.encode(&mut hello).expect("short name");
    assert_example("client_hello", &hello);
    let info = ServerInfo {
        admin: Some("h:2".into()),
        nodes: vec![NodeAddress {
            node_id: "n".into(),
            server: "h:1".into(),
            admin: Some("h:2".into()),
        }],
    };
    let mut hello = BytesMut::new();
    ServerHello::answer(&v5_hello, "n", info)
        .encode(&mut hello)
        .expect("short fields");
    assert_example("server_hello", &hello);
    // The spec's example is a version 6 hello (the login's layout is that version's).
    let plain = ClientHello {
        version: 6,
        ..ClientHello::new("cli")
    }
    .with_auth(Auth::Plain {
        user: "bob".into(),
        password: "pw".into(),
    });
    let mut hello = BytesMut::new();
    plain.encode(&mut hello).expect("short fields");
    assert_example("client_hello_plain", &hello);
    let mut spec_bytes = BytesMut::from(&spec_example("client_hello_plain")[..]);
    assert_eq!(
        ClientHello::decode(&mut spec_bytes).expect("spec bytes decode"),
        Some(plain)
    );

    let not_leader = Frame::Error(ErrorFrame {
        request_id: Some(9),
        fatal: false,
        error: ErrorBody::not_leader(Some("h:1".into()), "led by 2"),
    });
    assert_example("not_leader", &encode(&not_leader));
    let pinned = Frame::Declare(Declare {
        request_id: 3,
        queue: "q".into(),
        settings: QueueSettings::default(),
        nodes: vec![1, 3],
    });
    assert_example("declare_pinned", &encode(&pinned));
    let queue_info = Frame::QueueInfoReply(QueueInfoReply {
        request_id: 5,
        queue: "q".into(),
        settings: QueueSettings {
            replicas: Some(3),
            ..QueueSettings::default()
        },
        partitions: vec![PartitionInfo {
            ready: 1,
            inflight: 0,
            bytes: 2,
            disk_bytes: 4096,
            leading: false,
            leader: Some(2),
            leader_addr: Some("h:1".into()),
        }],
    });
    assert_example("queue_info_reply", &encode(&queue_info));

    // And the spec's bytes decode back to the same values.
    let decoded = decode_stream(&[
        &spec_example("publish_error"),
        &spec_example("not_leader"),
        &spec_example("queue_info_reply"),
    ])
    .expect("spec bytes decode");
    assert_eq!(decoded, vec![publish_error, not_leader, queue_info]);

    // The examples of version 7.
    let (subscribe, deliver, keyed) = version_7_examples();
    assert_example("stream_subscribe", &encode_version(&subscribe, 7));
    assert_example("stream_deliver", &encode_version(&deliver, 7));
    assert_example("deliver_routing_key", &encode_version(&keyed, 7));
    let decoded = decode_stream_version(
        &[
            &spec_example("stream_subscribe"),
            &spec_example("stream_deliver"),
            &spec_example("deliver_routing_key"),
        ],
        7,
    )
    .expect("spec bytes decode in version 7");
    assert_eq!(decoded, vec![subscribe, deliver, keyed]);
}

/// The values of the spec's examples of version 7: `stream_subscribe`, `stream_deliver` and
/// `deliver_routing_key`.
fn version_7_examples() -> (Frame, Frame, Frame) {
    let subscribe = Frame::StreamSubscribe(StreamSubscribe {
        request_id: 4,
        stream: "s".into(),
        consumer_tag: "c".into(),
        cursor: Some("r".into()),
        group: false,
        start: StreamStart::Offset(100),
        credit: 500,
        auto_commit: true,
        partitions: vec![0, 2],
    });
    let deliver = Frame::StreamDeliver(StreamDeliver {
        consumer_tag: "c".into(),
        partition: 1,
        moved_from: Some(10),
        messages: vec![
            StreamMessage {
                offset: 12,
                timestamp_ms: 1_700_000_000_000,
                routing_key: Some("k".into()),
                headers: Vec::new(),
                body: Bytes::from_static(b"hi"),
            },
            StreamMessage {
                offset: 14,
                timestamp_ms: 1_700_000_000_001,
                routing_key: None,
                headers: Vec::new(),
                body: Bytes::from_static(b"yo"),
            },
        ],
    });
    let keyed = Frame::Deliver(Deliver {
        consumer_tag: "c".into(),
        delivery_id: 5,
        partition: 0,
        offset: 3,
        redelivered: false,
        delivery_count: 1,
        routing_key: Some("k".into()),
        headers: Vec::new(),
        body: Bytes::from_static(b"hi"),
    });
    (subscribe, deliver, keyed)
}

#[test]
fn spec_header_size_matches() {
    // The frame header table: a u32 length and a u8 type.
    assert_eq!(HEADER_SIZE, 4 + 1);
    assert_eq!(FRAME_SIZE_BYTES_MAX, 16_777_216);
}

/// Version 1 `Subscribe` has no `prefetch_bytes`: it encodes and decodes without it (0), a
/// byte prefetch cannot be sent in version 1, and the layouts of the two versions differ
/// exactly by the 8-byte field.
#[test]
fn subscribe_prefetch_bytes_exists_from_version_2() {
    let subscribe = |prefetch_bytes| {
        Frame::Subscribe(Subscribe {
            request_id: 7,
            queue: "q".into(),
            prefetch: 10,
            consumer_tag: "c".into(),
            prefetch_bytes,
        })
    };
    let mut v1 = BytesMut::new();
    subscribe(0)
        .encode_version(&mut v1, FRAME_SIZE_BYTES_MAX, 1)
        .expect("v1");
    let mut v2 = BytesMut::new();
    subscribe(4096)
        .encode_version(&mut v2, FRAME_SIZE_BYTES_MAX, 2)
        .expect("v2");
    assert_eq!(v2.len(), v1.len() + 8);
    assert_eq!(
        Frame::decode_version(v1.clone().freeze(), 1).expect("v1 decodes"),
        subscribe(0)
    );
    assert_eq!(
        Frame::decode_version(v2.clone().freeze(), 2).expect("v2 decodes"),
        subscribe(4096)
    );
    assert!(
        Frame::decode_version(v1.freeze(), 2).is_err(),
        "v1 bytes are short in v2"
    );
    assert!(subscribe(1)
        .encode_version(&mut BytesMut::new(), FRAME_SIZE_BYTES_MAX, 1)
        .is_err());
    let hello = ClientHello {
        version: 1,
        client_name: "old".into(),
        auth: Auth::None,
    };
    assert!(matches!(
        ServerHello::answer(&hello, "n", ServerInfo::default()),
        ServerHello::Accepted { version: 1, .. }
    ));
}

/// Version 4 adds `replicas` to the queue settings, the leader fields to each partition of a
/// `QueueInfoReply` and `leader_addr` to the error body of frames. In version 3 a reply leaves
/// them out (an old client reads exactly the old layout, and each partition decodes as led by
/// the answering node), a `Declare` asking for replicas cannot be sent, and the error body of a
/// refused hello never carries the leader field in any version.
#[test]
fn cluster_fields_exist_from_version_4() {
    let info = |leading, leader: Option<u64>, replicas| {
        Frame::QueueInfoReply(QueueInfoReply {
            request_id: 1,
            queue: "q".into(),
            settings: QueueSettings {
                replicas,
                ..QueueSettings::default()
            },
            partitions: vec![PartitionInfo {
                ready: 1,
                inflight: 2,
                bytes: 3,
                disk_bytes: 4,
                leading,
                leader,
                leader_addr: leader.map(|id| format!("n{id}:1")),
            }],
        })
    };
    let encode_in = |frame: &Frame, version| {
        let mut dst = BytesMut::new();
        frame
            .encode_version(&mut dst, FRAME_SIZE_BYTES_MAX, version)
            .map(|()| dst)
    };
    let v4 = encode_in(&info(false, Some(2), Some(3)), 4).expect("v4");
    let v3 = encode_in(&info(false, Some(2), Some(3)), 3).expect("v3 drops the fields");
    // replicas: tag + u32; partition: leading + leader tag + u64 + leader_addr tag + "n2:1".
    assert_eq!(v4.len(), v3.len() + 5 + 1 + 9 + 1 + 2 + 4);
    assert_eq!(
        Frame::decode_version(v4.freeze(), 4).expect("v4 decodes"),
        info(false, Some(2), Some(3))
    );
    assert_eq!(
        Frame::decode_version(v3.freeze(), 3).expect("v3 decodes"),
        info(true, None, None)
    );

    let declare = |replicas| {
        Frame::Declare(Declare {
            request_id: 1,
            queue: "q".into(),
            settings: QueueSettings {
                replicas,
                ..QueueSettings::default()
            },
            nodes: Vec::new(),
        })
    };
    assert!(encode_in(&declare(Some(3)), 3).is_err());
    let v3 = encode_in(&declare(None), 3).expect("v3 declare");
    let v4 = encode_in(&declare(None), 4).expect("v4 declare");
    assert_eq!(v4.len(), v3.len() + 1, "an absent replicas is one tag byte");

    let error = |leader_addr: Option<&str>| {
        Frame::Error(ErrorFrame {
            request_id: Some(1),
            fatal: false,
            error: ErrorBody::not_leader(leader_addr.map(str::to_owned), "elsewhere"),
        })
    };
    let v3 = encode_in(&error(Some("h:1")), 3).expect("v3 error");
    assert_eq!(
        Frame::decode_version(v3.freeze(), 3).expect("v3 decodes"),
        error(None),
        "version 3 has no leader_addr; the code still travels"
    );
    let v4 = encode_in(&error(Some("h:1")), 4).expect("v4 error");
    assert_eq!(
        Frame::decode_version(v4.freeze(), 4).expect("v4 decodes"),
        error(Some("h:1"))
    );

    let end = Frame::ConsumerEnd(ConsumerEnd {
        consumer_tag: "c".into(),
        error: ErrorBody::not_leader(Some("h:1".into()), "moved"),
    });
    assert!(
        encode_in(&end, 3).is_err(),
        "ConsumerEnd is a version 4 frame"
    );
    let v4 = encode_in(&end, 4).expect("v4 ConsumerEnd");
    assert!(Frame::decode_version(v4.clone().freeze(), 3).is_err());
    assert_eq!(Frame::decode_version(v4.freeze(), 4).expect("v4"), end);

    let hello = ClientHello {
        version: 3,
        client_name: "old".into(),
        auth: Auth::None,
    };
    assert!(matches!(
        ServerHello::answer(&hello, "n", ServerInfo::default()),
        ServerHello::Accepted { version: 3, .. }
    ));
    let refused = ServerHello::Refused {
        version: 4,
        error: ErrorBody::new(ERR_BAD_REQUEST, "no"),
    };
    let mut bytes = BytesMut::new();
    refused.encode(&mut bytes).expect("refusal");
    // magic, version, status, code, reason tag, retry tag, message "no": no leader tag.
    assert_eq!(bytes.len(), 4 + 2 + 1 + 2 + 1 + 1 + 2 + 2);
    assert_eq!(ServerHello::decode(&mut bytes).ok(), Some(Some(refused)));
}

/// Version 5 adds `nodes` to `Declare` (a queue's replicas pinned to named nodes): a `list16`
/// of node ids after the settings. A version 4 `Declare` has no such field and cannot carry
/// pinned nodes; an empty list is two bytes.
#[test]
fn declare_nodes_exist_from_version_5() {
    let encode_in = |frame: &Frame, version| {
        let mut dst = BytesMut::new();
        frame
            .encode_version(&mut dst, FRAME_SIZE_BYTES_MAX, version)
            .map(|()| dst)
    };
    let declare = |nodes: Vec<u64>| {
        Frame::Declare(Declare {
            request_id: 7,
            queue: "pinned".into(),
            settings: QueueSettings {
                replicas: Some(2),
                ..QueueSettings::default()
            },
            nodes,
        })
    };
    let v5 = encode_in(&declare(vec![1, 3]), 5).expect("v5 declare");
    let v5_empty = encode_in(&declare(Vec::new()), 5).expect("v5 declare");
    let v4 = encode_in(&declare(Vec::new()), 4).expect("v4 declare");
    assert_eq!(
        v5_empty.len(),
        v4.len() + 2,
        "an empty list is its u16 count"
    );
    assert_eq!(v5.len(), v5_empty.len() + 16, "two u64 node ids");
    assert_eq!(
        &v5[v5.len() - 18..v5.len() - 16],
        &[2, 0],
        "count 2, little-endian"
    );
    assert_eq!(
        Frame::decode_version(v5.freeze(), 5).expect("v5 decodes"),
        declare(vec![1, 3])
    );
    assert_eq!(
        Frame::decode_version(v4.freeze(), 4).expect("v4 decodes"),
        declare(Vec::new())
    );
    assert!(
        encode_in(&declare(vec![1]), 4).is_err(),
        "version 4 cannot carry pinned nodes"
    );
}

/// Version 6 adds the login: a `ClientHello` ends with the mechanism byte and its fields, an
/// accepted `ServerHello` with `user` (`option<string>`). A version 5 hello has neither: it
/// decodes as `Auth::None`, cannot carry a login (the encoder refuses, leaving the buffer as it
/// was), and an answer to it leaves the user out.
#[test]
fn auth_exists_from_version_6() {
    let v5 = ClientHello {
        version: 5,
        ..ClientHello::new("c")
    };
    let mut v5_bytes = BytesMut::new();
    v5.encode(&mut v5_bytes).expect("v5 hello");
    assert_eq!(&v5_bytes[..], b"KRTN\x05\x00\x01\x00c");
    let mut v6_bytes = BytesMut::new();
    ClientHello {
        version: 6,
        ..ClientHello::new("c")
    }
    .encode(&mut v6_bytes)
    .expect("v6 hello");
    assert_eq!(
        &v6_bytes[..],
        b"KRTN\x06\x00\x01\x00c\x00",
        "mechanism 0 after the name"
    );
    assert_eq!(
        ClientHello::decode(&mut v5_bytes.clone()).expect("v5 decodes"),
        Some(v5.clone())
    );

    for auth in [
        Auth::Plain {
            user: "bob".into(),
            password: "pw".into(),
        },
        Auth::External,
        Auth::Token(format!("kt_{}", "0f".repeat(32))),
    ] {
        let mut dst = BytesMut::from(&b"before"[..]);
        let error = v5
            .clone()
            .with_auth(auth.clone())
            .encode(&mut dst)
            .expect_err("version 5 cannot carry a login");
        assert!(error.to_string().contains("before 6"), "{error}");
        assert_eq!(&dst[..], b"before", "a failed encode leaves dst as it was");

        let hello = ClientHello::new("c").with_auth(auth.clone());
        let mut bytes = BytesMut::new();
        hello.encode(&mut bytes).expect("v6 login");
        assert_eq!(bytes[v6_bytes.len() - 1], auth.mechanism());
        assert_eq!(
            ClientHello::decode(&mut bytes).expect("v6 decodes"),
            Some(hello)
        );
        assert!(bytes.is_empty());
    }

    let accepted = |version| ServerHello::Accepted {
        version,
        node_id: "n".into(),
        info: ServerInfo::default(),
        user: Some("bob".into()),
    };
    let mut v6 = BytesMut::new();
    accepted(6).encode(&mut v6).expect("v6 answer");
    assert!(
        v6.ends_with(b"\x00\x00\x00\x01\x03\x00bob"),
        "info, then user"
    );
    assert_eq!(ServerHello::decode(&mut v6).ok(), Some(Some(accepted(6))));
    let mut v5 = BytesMut::new();
    accepted(5).encode(&mut v5).expect("v5 answer");
    assert!(v5.ends_with(b"\x00\x00\x00"), "no user below version 6");
    let Some(Some(ServerHello::Accepted { user, .. })) = ServerHello::decode(&mut v5).ok() else {
        panic!("v5 answer decodes");
    };
    assert_eq!(user, None);
    let answer = ServerHello::answer(&ClientHello::new("c"), "n", ServerInfo::default());
    assert!(matches!(
        answer,
        ServerHello::Accepted {
            version: PROTOCOL_VERSION,
            user: None,
            ..
        }
    ));
}

/// A version 7 `ClientHello` with a `Plain` login whose user is `user_size` bytes and password
/// `password_size` bytes (`u` and `p` repeated), written by hand (the encoder refuses
/// out-of-bound sizes).
fn plain_hello_bytes(user_size: usize, password_size: usize) -> BytesMut {
    let mut bytes = BytesMut::from(&b"KRTN\x07\x00\x01\x00c\x01"[..]);
    for (letter, size) in [("u", user_size), ("p", password_size)] {
        bytes.extend_from_slice(&u16::try_from(size).expect("test size").to_le_bytes());
        bytes.extend_from_slice(&letter.repeat(size).into_bytes());
    }
    bytes
}

/// Each login field is bounded both ways: user 1 to 255 bytes, password 1 to 1,024, token 1
/// to 255. The encoder refuses any other size and leaves the buffer as it was; the decoder
/// refuses it at the field's length, naming the field. Unknown mechanisms are refused.
#[test]
fn auth_bounds_hold_both_ways() {
    let strategy = (0..=300usize, 0..=1100usize, 0..=300usize);
    check(
        "auth_bounds",
        strategy,
        |(user_size, password_size, token_size)| {
            let user_ok = (1..=255).contains(&user_size);
            let password_ok = (1..=1024).contains(&password_size);
            let plain = ClientHello::new("c").with_auth(Auth::Plain {
                user: "u".repeat(user_size),
                password: "p".repeat(password_size),
            });
            let mut dst = BytesMut::from(&b"kept"[..]);
            let encoded = plain.encode(&mut dst);
            prop_assert_eq!(encoded.is_ok(), user_ok && password_ok);
            if encoded.is_err() {
                prop_assert_eq!(&dst[..], b"kept");
            }
            let decoded = ClientHello::decode(&mut plain_hello_bytes(user_size, password_size));
            match decoded {
                Ok(Some(hello)) => {
                    prop_assert!(user_ok && password_ok);
                    prop_assert_eq!(hello, plain);
                }
                Err(ProtoError::Malformed {
                    field,
                    problem: Problem::SizeOutOfBounds { size, .. },
                    ..
                }) => {
                    let expected = if user_ok {
                        ("auth.password", password_size)
                    } else {
                        ("auth.user", user_size)
                    };
                    prop_assert_eq!((field, size), expected);
                }
                other => prop_assert!(false, "unexpected {:?}", other),
            }

            let token_ok = (1..=255).contains(&token_size);
            let token = ClientHello::new("c").with_auth(Auth::Token("t".repeat(token_size)));
            let mut dst = BytesMut::new();
            prop_assert_eq!(token.encode(&mut dst).is_ok(), token_ok);
            let mut bytes = BytesMut::from(&b"KRTN\x07\x00\x01\x00c\x03"[..]);
            bytes.extend_from_slice(&u16::try_from(token_size).expect("size").to_le_bytes());
            bytes.extend_from_slice(&"t".repeat(token_size).into_bytes());
            match ClientHello::decode(&mut bytes) {
                Ok(Some(hello)) => prop_assert!(token_ok && hello == token),
                Err(error) => prop_assert!(!token_ok && error.to_string().contains("auth.token")),
                Ok(None) => prop_assert!(false, "a whole hello is not incomplete"),
            }
            Ok(())
        },
    );
    for mechanism in 4..=u8::MAX {
        let mut bytes = BytesMut::from(&b"KRTN\x06\x00\x01\x00c"[..]);
        bytes.extend_from_slice(&[mechanism]);
        let error = ClientHello::decode(&mut bytes).expect_err("unknown mechanism");
        assert_eq!(error.code(), ERR_BAD_REQUEST);
        assert!(matches!(
            error,
            ProtoError::Malformed {
                field: "auth.mechanism",
                problem: Problem::InvalidTag(_),
                ..
            }
        ));
    }
    // An accepted ServerHello's user is bounded at 255 bytes too.
    let long_user = ServerHello::Accepted {
        version: 6,
        node_id: "n".into(),
        info: ServerInfo::default(),
        user: Some("u".repeat(256)),
    };
    let mut dst = BytesMut::new();
    assert!(long_user.encode(&mut dst).is_err());
    assert!(dst.is_empty());
    let mut bytes = BytesMut::from(&b"KRTN\x06\x00\x00\x01\x00n\x00\x00\x00\x01"[..]);
    bytes.extend_from_slice(&256u16.to_le_bytes());
    bytes.extend_from_slice(&[b'u'; 256]);
    assert!(ServerHello::decode(&mut bytes).is_err());
}

/// `Debug` of a login, and of a hello that carries one, names the user but never shows the
/// password or the token.
#[test]
fn debug_never_shows_a_secret() {
    let plain = Auth::Plain {
        user: "bob".into(),
        password: "hunter2".into(),
    };
    assert_eq!(
        format!("{plain:?}"),
        "Plain { user: \"bob\", password: <redacted> }"
    );
    let token = format!("kt_{}", "ab".repeat(32));
    for auth in [plain, Auth::Token(token.clone())] {
        let hello = ClientHello::new("cli").with_auth(auth);
        for shown in [format!("{hello:?}"), format!("{hello:#?}")] {
            assert!(
                !shown.contains("hunter2") && !shown.contains(&token),
                "{shown}"
            );
            assert!(shown.contains("<redacted>"), "{shown}");
        }
    }
    assert_eq!(format!("{:?}", Auth::External), "External");
    assert_eq!(format!("{:?}", Auth::None), "None");
}

// ---------------------------------------------------------------------------------------------
// Version 7: streams

fn encode_in(frame: &Frame, version: u16) -> Result<BytesMut, ProtoError> {
    let mut dst = BytesMut::new();
    frame
        .encode_version(&mut dst, FRAME_SIZE_BYTES_MAX, version)
        .map(|()| dst)
}

/// The stream frames exist from version 7 on: in version 6 they cannot be written, and their
/// bytes are an unknown type (400) from the type byte on, in `check`, `decode_version` and the
/// codec alike. `Deliver` carries its routing key from version 7 on: version 6 leaves it out
/// (the bytes differ by exactly the option) and reads it as absent.
#[test]
fn stream_frames_and_the_deliver_key_exist_from_version_7() {
    let (subscribe, deliver, keyed) = version_7_examples();
    for frame in [&subscribe, &deliver] {
        let bytes = encode_in(frame, 7).expect("version 7");
        assert!(encode_in(frame, 6).is_err(), "{frame:?} in version 6");
        let unknown = |result: Result<(), ProtoError>| {
            matches!(result, Err(ProtoError::UnknownFrameType { frame_type })
                if frame_type == frame.frame_type() as u8)
        };
        assert!(unknown(
            Frame::check_version(&bytes[..5], FRAME_SIZE_BYTES_MAX, 6).map(drop)
        ));
        assert!(unknown(
            Frame::decode_version(bytes.clone().freeze(), 6).map(drop)
        ));
        assert!(unknown(
            FrameCodec::new()
                .with_version(6)
                .decode(&mut BytesMut::from(&bytes[..]))
                .map(drop)
        ));
        assert_eq!(
            Frame::decode_version(bytes.clone().freeze(), 6)
                .expect_err("no stream frames in version 6")
                .code(),
            ERR_BAD_REQUEST
        );
        assert_eq!(
            Frame::decode(bytes.clone().freeze()).expect("PROTOCOL_VERSION is 7"),
            *frame
        );
        assert_eq!(
            Frame::decode_version(bytes.freeze(), 7).expect("version 7"),
            *frame
        );
    }
    assert_eq!(PROTOCOL_VERSION, 7, "version 7 is negotiated");
    let v7 = encode_in(&keyed, 7).expect("v7");
    let v6 = encode_in(&keyed, 6).expect("v6 leaves the key out");
    assert_eq!(v7.len(), v6.len() + 1 + 2 + 1, "tag, length and \"k\"");
    let Frame::Deliver(mut without_key) = keyed.clone() else {
        unreachable!()
    };
    without_key.routing_key = None;
    assert_eq!(
        Frame::decode_version(v6.freeze(), 6).expect("v6"),
        Frame::Deliver(without_key.clone())
    );
    assert_eq!(
        encode_in(&Frame::Deliver(without_key), 7)
            .expect("v7")
            .len(),
        v7.len() - 3,
        "an absent key is one tag byte"
    );
}

/// Every proper prefix of every stream frame (with the length prefix set to match) is a
/// decode error naming a field, never a panic or a frame.
#[test]
fn truncated_stream_frames_are_errors() {
    check(
        "truncated_stream_frames",
        Union::new(stream_frame()),
        |frame| {
            let bytes = encode_in(&frame, 7).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for size in HEADER_SIZE..bytes.len() {
                let mut cut = bytes[..size].to_vec();
                let length = u32::try_from(size - LENGTH_SIZE).expect("small");
                cut[..LENGTH_SIZE].copy_from_slice(&length.to_le_bytes());
                let error = Frame::decode_version(Bytes::from(cut), 7)
                    .expect_err("a truncated frame does not decode");
                prop_assert!(
                    matches!(error, ProtoError::Malformed { .. }),
                    "{error} at {size}"
                );
                assert_answerable(&error)?;
            }
            Ok(())
        },
    );
}

/// The bytes of `frame` in version 7 with the byte at `at` replaced by `value`.
fn patched(frame: &Frame, at: usize, value: u8) -> Bytes {
    let mut bytes = encode_in(frame, 7).expect("version 7").to_vec();
    bytes[at] = value;
    Bytes::from(bytes)
}

fn problem_at(result: Result<Frame, ProtoError>) -> (String, Problem, usize) {
    match result {
        Err(ProtoError::Malformed {
            field,
            problem,
            offset,
            ..
        }) => (field.to_owned(), problem, offset),
        other => panic!("expected a malformed frame, got {other:?}"),
    }
}

/// A start kind above 4, and a value with a kind that has none, are malformed at the kind.
#[test]
fn stream_subscribe_start_is_checked() {
    let (subscribe, _, _) = version_7_examples();
    // Header 5, request_id 8, "s" 3, "c" 3, cursor "r" 4, group 1: the kind is at 24.
    let kind_at = 5 + 8 + 3 + 3 + 4 + 1;
    assert_eq!(encode_in(&subscribe, 7).expect("v7")[kind_at], 3);
    for kind in [5u8, 0xff] {
        let (field, problem, offset) =
            problem_at(Frame::decode_version(patched(&subscribe, kind_at, kind), 7));
        assert_eq!(
            (field.as_str(), problem, offset),
            ("start.kind", Problem::InvalidTag(kind), kind_at)
        );
    }
    // Kinds 0 to 2 with the example's value 100: one encoding per start, so malformed.
    for kind in [0u8, 1, 2] {
        let (field, problem, _) =
            problem_at(Frame::decode_version(patched(&subscribe, kind_at, kind), 7));
        assert_eq!(field, "start.kind");
        assert!(matches!(problem, Problem::InvalidValue(_)), "{problem:?}");
    }
    // Kind 4 reads the same value as a time.
    let Frame::StreamSubscribe(timed) =
        Frame::decode_version(patched(&subscribe, kind_at, 4), 7).expect("kind 4")
    else {
        unreachable!()
    };
    assert_eq!(timed.start, StreamStart::Timestamp(100));
    // A bad bool after the start.
    let auto_commit_at = kind_at + 1 + 8 + 4;
    let (field, problem, _) = problem_at(Frame::decode_version(
        patched(&subscribe, auto_commit_at, 2),
        7,
    ));
    assert_eq!(
        (field.as_str(), problem),
        ("auto_commit", Problem::InvalidTag(2))
    );
}

/// Lists over their bounds: an encoder refuses to write them (leaving the buffer as it was),
/// and a decoder refuses them at the count, before reading or allocating any item, even when
/// the frame holds enough bytes for every item.
#[test]
fn stream_lists_over_their_bounds_are_refused() {
    let (subscribe, deliver, _) = version_7_examples();
    let Frame::StreamSubscribe(subscribe) = subscribe else {
        unreachable!()
    };
    let Frame::StreamDeliver(deliver) = deliver else {
        unreachable!()
    };
    let message = deliver.messages[0].clone();
    let over = |count_max: usize| -> Vec<Frame> {
        let count = count_max + 1;
        vec![
            Frame::StreamSubscribe(StreamSubscribe {
                partitions: (0..u32::try_from(count).expect("small")).collect(),
                ..subscribe.clone()
            }),
            Frame::StreamDeclare(StreamDeclare {
                request_id: 1,
                stream: "s".into(),
                settings: StreamSettings::default(),
                nodes: vec![1; count],
            }),
            Frame::CursorCommit(CursorCommit {
                request_id: 1,
                stream: "s".into(),
                cursor: "r".into(),
                entries: vec![
                    CursorEntry {
                        partition: 0,
                        offset: 0
                    };
                    count
                ],
            }),
            Frame::StreamInfoReply(StreamInfoReply {
                request_id: 1,
                stream: "s".into(),
                settings: StreamSettings::default(),
                partitions: vec![
                    StreamPartitionInfo {
                        start_offset: 0,
                        next_offset: 0,
                        messages: 0,
                        bytes: 0,
                        disk_bytes: 0,
                        oldest_timestamp_ms: None,
                        leading: true,
                        leader: None,
                        leader_addr: None,
                    };
                    count
                ],
            }),
        ]
    };
    let mut frames = over(STREAM_PARTITIONS_MAX);
    assert_eq!(STREAM_PARTITIONS_MAX, STREAM_NODES_MAX);
    frames.push(Frame::StreamDeliver(StreamDeliver {
        messages: vec![message; STREAM_DELIVER_MESSAGES_MAX + 1],
        ..deliver.clone()
    }));
    for frame in &frames {
        let mut dst = BytesMut::from(&b"xy"[..]);
        let error = frame
            .encode_version(&mut dst, FRAME_SIZE_BYTES_MAX, 7)
            .expect_err("over the bound");
        assert!(matches!(error, ProtoError::FieldTooLong { .. }), "{error}");
        assert_eq!(&dst[..], b"xy", "{frame:?}");
    }
    // At the bound they encode; with the count raised by one (the frame's bytes then hold one
    // item too few) the decoder names the bound, not a truncation.
    let mut at_bound = over(STREAM_PARTITIONS_MAX - 1);
    at_bound.push(Frame::StreamDeliver(StreamDeliver {
        messages: vec![deliver.messages[1].clone(); STREAM_DELIVER_MESSAGES_MAX],
        ..deliver
    }));
    // Where each frame's count lies: after the fields before the list.
    let count_at = [
        5 + 8 + 3 + 3 + 4 + 1 + 1 + 8 + 4 + 1, // StreamSubscribe.partitions (u16)
        5 + 8 + 3 + 4 + 4,                     // StreamDeclare.nodes (u16)
        5 + 8 + 3 + 3,                         // CursorCommit.entries (u16)
        5 + 8 + 3 + 4 + 4,                     // StreamInfoReply.partitions (u16)
        5 + 3 + 4 + 9,                         // StreamDeliver.messages (u32)
    ];
    for (frame, at) in at_bound.iter().zip(count_at) {
        let bytes = encode_in(frame, 7).expect("at the bound");
        assert_eq!(
            Frame::decode_version(bytes.clone().freeze(), 7).expect("at the bound"),
            *frame
        );
        let mut raised = bytes.to_vec();
        raised[at] += 1;
        let (field, problem, offset) =
            problem_at(Frame::decode_version(Bytes::from(raised.clone()), 7));
        assert!(
            matches!(problem, Problem::InvalidValue(reason) if reason.starts_with("more than")),
            "{field}: {problem:?}"
        );
        assert_eq!(offset, at, "{field}");
        // A huge count is refused the same way, before any allocation.
        raised[at] = 0xff;
        raised[at + 1] = 0xff;
        let (_, problem, _) = problem_at(Frame::decode_version(Bytes::from(raised), 7));
        assert!(matches!(problem, Problem::InvalidValue(_)), "{problem:?}");
    }
}
