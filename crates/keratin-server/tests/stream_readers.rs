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
