//! Stream readers under pressure, over the wire (issue 18): a reader whose client stops reading
//! holds no more than the connection's outbound byte budget, and its last automatic commit
//! covers only what was handed to the connection; consumer groups share a stream's
//! partitions, hand them over as members join and leave, and fence commits of partitions
//! another member reads.

mod common;
mod stream_wire;

use std::time::Duration;

use bytes::Bytes;
use futures_util::SinkExt;
use keratin_proto::frame::*;
use keratin_proto::stream::*;

use stream_wire::*;

const BIG: usize = 64 << 10;

/// Publishes `count` messages of [`BIG`] bytes to `stream`, 32 a frame, all confirmed.
async fn publish_big(conn: &mut Conn, stream: &str, count: u64) {
    let mut id = 0;
    while id < count {
        let batch = (count - id).min(32);
        let messages = (id..id + batch)
            .map(|i| Message {
                publish_id: i + 1,
                routing_key: None,
                headers: Vec::new(),
                body: Bytes::from(vec![(i % 251) as u8; BIG]),
                sequence: None,
            })
            .collect();
        conn.send(Frame::Publish(Publish {
            queue: stream.into(),
            mode: PublishMode::Confirmed,
            messages,
            joinable: false,
            producer_id: None,
        }))
        .await
        .expect("publish");
        let mut confirmed = 0;
        while confirmed < batch {
            match next(conn).await {
                Frame::Confirm(c) => {
                    confirmed += c.ranges.iter().map(|r| r.last - r.first + 1).sum::<u64>()
                }
                other => panic!("expected confirms, got {other:?}"),
            }
        }
        id += batch;
    }
}

/// A client that stops reading its socket: the node reads ahead of it no more than the
/// connection's outbound byte budget (and what the sockets buffer), not the whole stream into
/// memory; cancelled, the reader commits only the messages it handed to the connection, so
/// the next reader of the cursor misses none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_holds_its_budget_and_commits_only_what_it_sent() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start_with(&tmp, |config| {
        config.server.outbound_bytes_max = 4 << 20;
        config.storage.segment_bytes = 16 << 20;
    })
    .await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    declare(&mut conn, "s", StreamSettings::default()).await;
    // 96 MiB: far more than the budget plus what loopback sockets buffer.
    let total = 1536;
    publish_big(&mut conn, "s", total).await;
    let mut reader = connect(node.protocol_addr(), 7).await;
    let ok = request(
        &mut reader,
        subscribe("r", "s", Some("c"), StreamStart::First, 1 << 20, true),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)));
    // The client reads nothing for a while; the reader's automatic commits tell how far it
    // read the stream.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let read_ahead = node
        .broker()
        .cursor("s", "c")
        .expect("stream")
        .map_or(0, |c| c.positions.get(&0).copied().unwrap_or(0));
    assert!(
        read_ahead * (BIG as u64) < 48 << 20,
        "a reader whose client reads nothing read {read_ahead} messages of 64 KiB ahead of it"
    );
    // Cancel without reading, then read everything that was sent.
    reader
        .send(Frame::Cancel(Cancel {
            request_id: 5,
            consumer_tag: "r".into(),
        }))
        .await
        .expect("cancel");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (mut delivered_to, mut received) = (0, 0u64);
    loop {
        match next(&mut reader).await {
            Frame::StreamDeliver(d) => {
                for m in d.messages {
                    // Offsets skip the partition's checkpoint records; bodies count messages.
                    assert!(m.offset >= delivered_to, "in order");
                    assert_eq!(m.body[0], (received % 251) as u8, "none skipped");
                    delivered_to = m.offset + 1;
                    received += 1;
                }
            }
            Frame::Ok(OkReply { request_id: 5 }) => break,
            other => panic!("expected deliveries then the cancel's Ok, got {other:?}"),
        }
    }
    let committed = node
        .broker()
        .cursor("s", "c")
        .expect("stream")
        .and_then(|c| c.positions.get(&0).copied())
        .expect("committed");
    assert_eq!(
        committed, delivered_to,
        "the last commit is exactly what was delivered (more loses messages for the next reader)"
    );
    assert!(
        received < total,
        "the client read nothing while the reader was stalled"
    );
    node.shutdown().await.expect("shutdown");
}

/// What a reader got: (partition, body) of each message, and the partitions ended with why.
#[derive(Default)]
struct Got {
    messages: Vec<(u32, String)>,
    ends: Vec<(u32, u16)>,
}

/// Reads `tag`'s frames until `messages` messages and `ends` partition ends came.
async fn collect(conn: &mut Conn, tag: &str, messages: usize, ends: usize) -> Got {
    let mut got = Got::default();
    while got.messages.len() < messages || got.ends.len() < ends {
        match next(conn).await {
            Frame::StreamDeliver(d) => {
                assert_eq!(d.consumer_tag, tag);
                for m in d.messages {
                    let body = String::from_utf8(m.body.to_vec()).expect("utf-8");
                    got.messages.push((d.partition, body));
                }
            }
            Frame::StreamPartitionEnd(end) => {
                assert_eq!(end.consumer_tag, tag);
                got.ends.push((end.partition, end.error.code().0));
            }
            other => panic!("expected stream frames of {tag}, got {other:?}"),
        }
    }
    got
}

fn group_subscribe(tag: &str, cursor: &str) -> Frame {
    match subscribe(tag, "s", Some(cursor), StreamStart::First, 1 << 20, true) {
        Frame::StreamSubscribe(mut s) => {
            s.group = true;
            Frame::StreamSubscribe(s)
        }
        _ => unreachable!("subscribe builds a StreamSubscribe"),
    }
}

fn bodies(got: &Got) -> Vec<u64> {
    let mut bodies: Vec<u64> = got
        .messages
        .iter()
        .map(|(_, b)| b.parse().expect("a number"))
        .collect();
    bodies.sort_unstable();
    bodies
}

/// Consumer groups (`docs/streams.md`, "Reading"): the first member reads every partition; a
/// second takes half of them once the first has committed and ended them (409); each message
/// published after goes to exactly one member, by partition; a commit of a partition the other
/// member reads is refused (409); when the second leaves, the first takes its partitions back
/// from where the second's automatic commit left them, and nothing is read twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_shares_partitions_and_hands_them_over_without_loss_or_repeats() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start(&tmp).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    let settings = StreamSettings {
        partitions: 4,
        ..StreamSettings::default()
    };
    declare(&mut conn, "s", settings).await;
    publish(&mut conn, "s", 0, 200, 40).await;

    let mut a = connect(node.protocol_addr(), 7).await;
    let ok = request(&mut a, group_subscribe("a", "g")).await;
    assert!(matches!(ok, Frame::SubscribeOk(_)), "{ok:?}");
    let first = collect(&mut a, "a", 200, 0).await;
    assert_eq!(bodies(&first), (0..200).collect::<Vec<_>>());

    let mut b = connect(node.protocol_addr(), 7).await;
    let ok = request(&mut b, group_subscribe("b", "g")).await;
    assert!(matches!(ok, Frame::SubscribeOk(_)), "{ok:?}");
    let handed = collect(&mut a, "a", 0, 2).await;
    let mut ended: Vec<(u32, u16)> = handed.ends.clone();
    ended.sort_unstable();
    assert_eq!(ended, vec![(2, 409), (3, 409)], "the later half goes to b");
    assert!(handed.messages.is_empty());

    publish(&mut conn, "s", 200, 200, 40).await;
    let info = node.broker().stream_info("s").expect("info");
    let per_partition: Vec<u64> = info.partitions.iter().map(|p| p.messages).collect();
    let a_count = (per_partition[0] + per_partition[1] - bodies_in(&first, &[0, 1])) as usize;
    let b_count = 200 - a_count;
    let got_a = collect(&mut a, "a", a_count, 0).await;
    let got_b = collect(&mut b, "b", b_count, 0).await;
    assert!(
        got_a.messages.iter().all(|(p, _)| *p < 2),
        "a reads 0 and 1"
    );
    assert!(
        got_b.messages.iter().all(|(p, _)| *p >= 2),
        "b reads 2 and 3"
    );
    let mut second: Vec<u64> = bodies(&got_a);
    second.extend(bodies(&got_b));
    second.sort_unstable();
    assert_eq!(
        second,
        (200..400).collect::<Vec<_>>(),
        "each once, none lost"
    );
    assert_eq!(quiet_for(&mut b, Duration::from_millis(300)).await, None);

    // a may not commit what b reads.
    let refused = request(
        &mut a,
        Frame::CursorCommit(CursorCommit {
            request_id: 21,
            stream: "s".into(),
            cursor: "g".into(),
            entries: vec![CursorEntry {
                partition: 2,
                offset: 0,
            }],
        }),
    )
    .await;
    assert_eq!(error_code(&refused), 409, "{refused:?}");

    // b leaves: its last automatic commit, then a takes 2 and 3 back from there.
    let cancelled = request(
        &mut b,
        Frame::Cancel(Cancel {
            request_id: 22,
            consumer_tag: "b".into(),
        }),
    )
    .await;
    assert_eq!(cancelled, Frame::Ok(OkReply { request_id: 22 }));
    publish(&mut conn, "s", 400, 100, 40).await;
    let third = collect(&mut a, "a", 100, 0).await;
    assert_eq!(bodies(&third), (400..500).collect::<Vec<_>>(), "none again");
    assert_eq!(quiet_for(&mut a, Duration::from_millis(300)).await, None);
    let groups = node.broker().stream_info("s").expect("info").groups;
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].members.len(), 1);
    assert_eq!(groups[0].members[0].1, vec![0, 1, 2, 3]);

    // A group needs a cursor, and takes the partitions it is given.
    let mut no_cursor = group_subscribe("x", "g");
    if let Frame::StreamSubscribe(s) = &mut no_cursor {
        s.cursor = None;
        s.auto_commit = false;
    }
    assert_eq!(error_code(&request(&mut conn, no_cursor).await), 400);
    let mut named = group_subscribe("y", "g");
    if let Frame::StreamSubscribe(s) = &mut named {
        s.partitions = vec![1];
    }
    assert_eq!(error_code(&request(&mut conn, named).await), 400);
    node.shutdown().await.expect("shutdown");
}

/// Messages of `got` in `partitions`.
fn bodies_in(got: &Got, partitions: &[u32]) -> u64 {
    got.messages
        .iter()
        .filter(|(p, _)| partitions.contains(p))
        .count() as u64
}

/// Stream readers count against the node's `server.consumers_max` as queue consumers do: past
/// it a subscription is refused with 429 (`consumers`, a retry hint), and cancelling one gives
/// its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_readers_count_against_the_nodes_consumers_max() {
    let tmp = tempfile::tempdir().expect("tmp");
    let node = start_with(&tmp, |config| config.server.consumers_max = 1).await;
    let mut conn = connect(node.protocol_addr(), 7).await;
    declare(&mut conn, "s", StreamSettings::default()).await;
    let ok = request(
        &mut conn,
        subscribe("r1", "s", None, StreamStart::Next, 10, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)), "{ok:?}");
    let mut other = connect(node.protocol_addr(), 7).await;
    let refused = request(
        &mut other,
        subscribe("r2", "s", None, StreamStart::Next, 10, false),
    )
    .await;
    match &refused {
        Frame::Error(e) => {
            assert_eq!(e.error.code().0, 429, "{refused:?}");
            let reason = e.error.reason().map(ToString::to_string);
            assert_eq!(reason.as_deref(), Some("consumers"), "{refused:?}");
            assert!(e.error.retry_after_ms().is_some(), "{refused:?}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    let cancelled = request(
        &mut conn,
        Frame::Cancel(Cancel {
            request_id: 3,
            consumer_tag: "r1".into(),
        }),
    )
    .await;
    assert_eq!(cancelled, Frame::Ok(OkReply { request_id: 3 }));
    let ok = request(
        &mut other,
        subscribe("r2", "s", None, StreamStart::Next, 10, false),
    )
    .await;
    assert!(matches!(ok, Frame::SubscribeOk(_)), "{ok:?}");
    node.shutdown().await.expect("shutdown");
}
