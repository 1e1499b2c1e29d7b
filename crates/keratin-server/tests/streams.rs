//! Streams over the wire (protocol version 7, issue 18), spoken with raw frames: declare, info,
//! list, set, delete; publish with keys; readers from each start with credit, moved readers,
//! cursors committed explicitly and automatically, resumed after a reconnect; a reader told
//! when its stream is deleted; a version 6 client refused stream frames by the codec.

mod common;
mod stream_wire;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::SinkExt;
use keratin_proto::codes::{ERR_BAD_REQUEST, ERR_CONFLICT, ERR_NOT_FOUND};
use keratin_proto::frame::*;
use keratin_proto::stream::*;
use tokio::io::AsyncWriteExt;

use stream_wire::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_info_list_set_delete_over_the_wire() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start(&tmp).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    let settings = StreamSettings {
        partitions: 3,
        max_messages: Some(1_000_000),
        ..StreamSettings::default()
    };
    declare(&mut conn, "events", settings.clone()).await;
    declare(&mut conn, "events", settings.clone()).await;
    let conflict = request(
        &mut conn,
        Frame::StreamDeclare(StreamDeclare {
            request_id: 2,
            stream: "events".into(),
            settings: StreamSettings::default(),
            nodes: Vec::new(),
        }),
    )
    .await;
    assert_eq!(error_code(&conflict), ERR_CONFLICT.0);
    let taken = request(
        &mut conn,
        Frame::Declare(Declare {
            request_id: 3,
            queue: "events".into(),
            settings: QueueSettings::default(),
            nodes: Vec::new(),
        }),
    )
    .await;
    assert_eq!(error_code(&taken), ERR_CONFLICT.0, "one name space");
    publish(&mut conn, "events", 0, 30, 5).await;
    let info = request(
        &mut conn,
        Frame::StreamInfo(StreamRequest {
            request_id: 4,
            stream: "events".into(),
        }),
    )
    .await;
    let Frame::StreamInfoReply(info) = info else {
        panic!("{info:?}")
    };
    assert_eq!(info.settings, settings);
    assert_eq!(info.partitions.len(), 3);
    assert_eq!(info.partitions.iter().map(|p| p.messages).sum::<u64>(), 30);
    assert!(info.partitions.iter().all(|p| p.leading));
    assert!(info
        .partitions
        .iter()
        .filter(|p| p.messages > 0)
        .all(|p| p.oldest_timestamp_ms.is_some() && p.disk_bytes > 0));
    let set = request(
        &mut conn,
        Frame::StreamSet(StreamSet {
            request_id: 5,
            stream: "events".into(),
            update: StreamRetentionUpdate {
                max_messages: Update::Clear,
                max_age_ms: Update::Set(3_600_000),
                max_bytes: Update::Keep,
            },
        }),
    )
    .await;
    assert_eq!(set, Frame::Ok(OkReply { request_id: 5 }));
    let list = request(&mut conn, Frame::StreamList(StreamList { request_id: 6 })).await;
    let Frame::StreamListReply(list) = list else {
        panic!("{list:?}")
    };
    assert_eq!(list.streams.len(), 1);
    assert_eq!(list.streams[0].messages, 30);
    let info = request(
        &mut conn,
        Frame::StreamInfo(StreamRequest {
            request_id: 7,
            stream: "events".into(),
        }),
    )
    .await;
    let Frame::StreamInfoReply(info) = info else {
        panic!("{info:?}")
    };
    assert_eq!(info.settings.max_messages, None);
    assert_eq!(info.settings.max_age_ms, Some(3_600_000));
    let deleted = request(
        &mut conn,
        Frame::StreamDelete(StreamRequest {
            request_id: 8,
            stream: "events".into(),
        }),
    )
    .await;
    assert_eq!(deleted, Frame::Ok(OkReply { request_id: 8 }));
    let gone = request(
        &mut conn,
        Frame::StreamInfo(StreamRequest {
            request_id: 9,
            stream: "events".into(),
        }),
    )
    .await;
    assert_eq!(error_code(&gone), ERR_NOT_FOUND.0);
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_get_every_message_by_key_in_order_within_their_credit() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start(&tmp).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    let settings = StreamSettings {
        partitions: 4,
        ..StreamSettings::default()
    };
    declare(&mut conn, "s", settings).await;
    publish(&mut conn, "s", 0, 1000, 7).await;
    let mut reader = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut reader,
        subscribe("r", "s", None, StreamStart::First, 300, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)), "{ok:?}");
    let first = receive(&mut reader, "r", 300).await;
    assert_eq!(first.len(), 300, "no more than the credit");
    assert_eq!(
        quiet_for(&mut reader, Duration::from_millis(300)).await,
        None,
        "nothing past the credit"
    );
    reader
        .send(Frame::StreamCredit(StreamCredit {
            consumer_tag: "r".into(),
            credit: 10_000,
        }))
        .await
        .expect("credit");
    let mut got = first;
    got.extend(receive(&mut reader, "r", 700).await);
    // Every message once; per key in publish order, each key on one partition.
    let mut by_key: BTreeMap<String, Vec<(u32, u64)>> = BTreeMap::new();
    for (partition, _, body, key) in &got {
        by_key
            .entry(key.clone().expect("a key"))
            .or_default()
            .push((*partition, body.parse().expect("n")));
    }
    assert_eq!(by_key.len(), 7);
    for (key, seen) in &by_key {
        assert!(
            seen.windows(2).all(|w| w[0].0 == w[1].0),
            "{key}: one partition"
        );
        let bodies: Vec<u64> = seen.iter().map(|(_, n)| *n).collect();
        let k: u64 = key.trim_start_matches("key-").parse().expect("k");
        let expected: Vec<u64> = (0..1000).filter(|i| i % 7 == k).collect();
        assert_eq!(bodies, expected, "{key}: every message in order");
    }
    // A reader at the end gets what is published next.
    publish(&mut conn, "s", 1000, 5, 7).await;
    let later = receive(&mut reader, "r", 5).await;
    let mut bodies: Vec<u64> = later.iter().map(|m| m.2.parse().expect("n")).collect();
    bodies.sort_unstable();
    assert_eq!(bodies, vec![1000, 1001, 1002, 1003, 1004]);
    // `next` starts after what is there; `last` at the newest message of each partition.
    let mut fresh = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut fresh,
        subscribe("n", "s", None, StreamStart::Next, 100, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    assert_eq!(
        quiet_for(&mut fresh, Duration::from_millis(300)).await,
        None
    );
    let ok = request(
        &mut fresh,
        subscribe("l", "s", None, StreamStart::Last, 100, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    let used: std::collections::BTreeSet<u32> = by_key.values().map(|seen| seen[0].0).collect();
    let last = receive(&mut fresh, "l", used.len()).await;
    let newest: std::collections::BTreeSet<u32> = last.iter().map(|m| m.0).collect();
    assert_eq!(
        newest, used,
        "the newest message of each partition holding any"
    );
    assert_eq!(
        quiet_for(&mut fresh, Duration::from_millis(300)).await,
        None,
        "only the newest"
    );
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_resume_where_commits_left_them() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start(&tmp).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    declare(&mut conn, "s", StreamSettings::default()).await;
    publish(&mut conn, "s", 0, 100, 1).await;
    // Explicit: read 40, commit past the 40th, reconnect: the 41st comes first.
    let mut reader = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut reader,
        subscribe("r", "s", Some("c1"), StreamStart::First, 40, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    let got = receive(&mut reader, "r", 40).await;
    let commit = request(
        &mut reader,
        Frame::CursorCommit(CursorCommit {
            request_id: 11,
            stream: "s".into(),
            cursor: "c1".into(),
            entries: vec![CursorEntry {
                partition: 0,
                offset: got[39].1 + 1,
            }],
        }),
    )
    .await;
    assert_eq!(commit, Frame::Ok(OkReply { request_id: 11 }));
    drop(reader);
    let mut reader = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut reader,
        subscribe("r", "s", Some("c1"), StreamStart::First, 1000, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    let rest = receive(&mut reader, "r", 60).await;
    assert_eq!(rest[0].2, "40", "resumed after the commit");
    assert_eq!(rest[59].2, "99");
    // Automatic: the reader's position is committed when it is cancelled.
    let mut auto = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut auto,
        subscribe("a", "s", Some("c2"), StreamStart::First, 25, true),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    receive(&mut auto, "a", 25).await;
    let cancelled = request(
        &mut auto,
        Frame::Cancel(Cancel {
            request_id: 12,
            consumer_tag: "a".into(),
        }),
    )
    .await;
    assert_eq!(cancelled, Frame::Ok(OkReply { request_id: 12 }));
    let ok = request(
        &mut auto,
        subscribe("b", "s", Some("c2"), StreamStart::First, 1, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    let resumed = receive(&mut auto, "b", 1).await;
    assert_eq!(resumed[0].2, "25", "auto commit kept the position");
    // auto_commit without a cursor, and groups, are refused with their reasons.
    let refused = request(
        &mut auto,
        subscribe("x", "s", None, StreamStart::First, 1, true),
    )
    .await;
    assert_eq!(error_code(&refused), ERR_BAD_REQUEST.0);
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_is_told_when_its_stream_is_deleted_and_v6_has_no_stream_frames() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start(&tmp).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    declare(&mut conn, "s", StreamSettings::default()).await;
    let mut reader = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut reader,
        subscribe("r", "s", None, StreamStart::Next, 10, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    let deleted = request(
        &mut conn,
        Frame::StreamDelete(StreamRequest {
            request_id: 3,
            stream: "s".into(),
        }),
    )
    .await;
    assert_eq!(deleted, Frame::Ok(OkReply { request_id: 3 }));
    match next(&mut reader).await {
        Frame::StreamPartitionEnd(end) => {
            assert_eq!((end.consumer_tag.as_str(), end.partition), ("r", 0));
            assert_eq!(end.error.code(), ERR_NOT_FOUND);
        }
        other => panic!("expected StreamPartitionEnd, got {other:?}"),
    }
    // A version 6 connection has no stream frames: one sent anyway is refused as an unknown
    // frame type (and encoding one in version 6 is refused here first).
    let mut old = connect(node.protocol_addr(), 6).await;
    let frame = Frame::StreamList(StreamList { request_id: 1 });
    let mut buf = BytesMut::new();
    assert!(frame.encode_version(&mut buf, 1 << 20, 6).is_err());
    frame
        .encode_version(&mut buf, 1 << 20, 7)
        .expect("encodes in 7");
    old.get_mut().write_all(&buf).await.expect("raw frame");
    let refused = next(&mut old).await;
    assert_eq!(error_code(&refused), ERR_BAD_REQUEST.0, "{refused:?}");
    node.shutdown().await.expect("shutdown");
}

/// Visibility (`docs/streams.md`): `/metrics` has the stream's figures, retention's removals by
/// bound and a cursor's lag; a cursor that retention passed raises `cursor_behind_retention`,
/// which clears once the cursor is committed at the start again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_cursor_behind_retention_item() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start(&tmp).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    declare(
        &mut conn,
        "s",
        StreamSettings {
            max_messages: Some(1000),
            ..StreamSettings::default()
        },
    )
    .await;
    let commit = |request_id, offset| {
        Frame::CursorCommit(CursorCommit {
            request_id,
            stream: "s".into(),
            cursor: "slow".into(),
            entries: vec![CursorEntry {
                partition: 0,
                offset,
            }],
        })
    };
    assert_eq!(
        request(&mut conn, commit(2, 0)).await,
        Frame::Ok(OkReply { request_id: 2 })
    );
    // About 4 MiB of 1 KiB messages in 1 MiB segments: retention by count removes some.
    let body = Bytes::from(vec![b'x'; 1000]);
    for batch in 0..40u64 {
        let messages = (0..100u64)
            .map(|i| Message {
                publish_id: batch * 100 + i + 1,
                routing_key: None,
                headers: vec![],
                body: body.clone(),
                sequence: None,
            })
            .collect();
        conn.send(Frame::Publish(Publish {
            queue: "s".into(),
            mode: PublishMode::Confirmed,
            messages,
            joinable: false,
            producer_id: None,
        }))
        .await
        .expect("publish");
        assert!(matches!(next(&mut conn).await, Frame::Confirm(_)));
    }
    let http = node.http_addr();
    let start = common::until("retention removes old segments", || {
        let (_, text) = common::http_text(http, "GET", "/metrics", "");
        text.contains(
            "keratin_stream_retention_removed_segments_total{stream=\"s\",bound=\"count\"}",
        )
        .then_some(text)
    })
    .await;
    for series in [
        "keratin_stream_messages{stream=\"s\"}",
        "keratin_stream_disk_bytes{stream=\"s\"}",
        "keratin_stream_cursor_lag_messages{stream=\"s\",cursor=\"slow\"}",
    ] {
        assert!(start.contains(series), "{series} in {start}");
    }
    let active = |kind: &str| common::active_item(http, kind, "s/slow");
    let item = common::until("cursor_behind_retention is raised", || {
        active("cursor_behind_retention")
    })
    .await;
    assert_eq!(item["severity"], "warning", "{item}");
    // Committed at the partition's start: within retention again.
    let info = request(
        &mut conn,
        Frame::StreamInfo(StreamRequest {
            request_id: 3,
            stream: "s".into(),
        }),
    )
    .await;
    let Frame::StreamInfoReply(info) = info else {
        panic!("{info:?}")
    };
    let first = info.partitions[0].start_offset;
    assert!(first > 0, "retention moved the start");
    assert_eq!(
        request(&mut conn, commit(4, first)).await,
        Frame::Ok(OkReply { request_id: 4 })
    );
    common::until("cursor_behind_retention clears", || {
        active("cursor_behind_retention").is_none().then_some(())
    })
    .await;
    node.shutdown().await.expect("shutdown");
}
