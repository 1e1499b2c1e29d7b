//! Streams (protocol version 7) against a scripted fake broker: the admin requests carry every
//! field and return the broker's answers; an `Error` becomes the `ClientError` with its code;
//! a stream consumer yields every message of every `StreamDeliver` in order with its fields
//! (`moved_from` on the first message of the frame that carried it), gives credit back once
//! half of it was taken, commits the positions it handed out, and cancels; a node of version 6
//! gets no stream frame at all, and the error says streams need version 7. A client that lost
//! or reordered messages, never topped up its credit, committed the wrong offsets or sent a
//! stream frame to an old node fails these tests, and so does one that drops messages a broker
//! sent over the credit instead of ending the consumer.

mod fake;

use std::sync::atomic::Ordering;

use futures_util::StreamExt;
use keratin_client::{
    ClientError, CursorEntry, StreamDelivery, StreamRetentionUpdate, StreamSettings, StreamStart,
    StreamSubscribeOptions, Update,
};
use keratin_proto::codes::{ERR_CONFLICT, ERR_NOT_FOUND};
use keratin_proto::{
    ErrorBody, ErrorFrame, Frame, Header, StreamDeliver, StreamInfoReply, StreamListReply,
    StreamMessage, StreamPartitionEnd, StreamPartitionInfo, StreamSummary, SubscribeOk,
};

fn settings() -> StreamSettings {
    StreamSettings {
        partitions: 2,
        replicas: None,
        max_bytes: Some(1 << 30),
        max_age_ms: Some(86_400_000),
        max_messages: None,
    }
}

fn partition_info(next_offset: u64) -> StreamPartitionInfo {
    StreamPartitionInfo {
        start_offset: 0,
        next_offset,
        messages: next_offset,
        bytes: next_offset * 10,
        disk_bytes: 4096,
        oldest_timestamp_ms: Some(1_700_000_000_000),
        leading: true,
        leader: None,
        leader_addr: None,
    }
}

#[tokio::test]
async fn admin_requests_round_trip() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamDeclare(declare)) = conn.recv().await else {
            panic!("expected StreamDeclare");
        };
        assert_eq!(declare.stream, "events");
        assert_eq!(declare.settings, settings());
        assert_eq!(declare.nodes, vec![1, 2]);
        conn.ok(declare.request_id).await;

        let Some(Frame::StreamSet(set)) = conn.recv().await else {
            panic!("expected StreamSet");
        };
        assert_eq!(set.stream, "events");
        assert_eq!(set.update.max_bytes, Update::Clear);
        assert_eq!(set.update.max_age_ms, Update::Keep);
        assert_eq!(set.update.max_messages, Update::Set(500));
        conn.ok(set.request_id).await;

        let Some(Frame::StreamInfo(info)) = conn.recv().await else {
            panic!("expected StreamInfo");
        };
        assert_eq!(info.stream, "events");
        conn.send(Frame::StreamInfoReply(StreamInfoReply {
            request_id: info.request_id,
            stream: "events".into(),
            settings: settings(),
            partitions: vec![partition_info(7), partition_info(3)],
        }))
        .await;

        let Some(Frame::StreamList(list)) = conn.recv().await else {
            panic!("expected StreamList");
        };
        conn.send(Frame::StreamListReply(StreamListReply {
            request_id: list.request_id,
            streams: vec![StreamSummary {
                stream: "events".into(),
                partitions: 2,
                messages: 10,
                bytes: 100,
            }],
        }))
        .await;

        let Some(Frame::CursorCommit(commit)) = conn.recv().await else {
            panic!("expected CursorCommit");
        };
        assert_eq!(
            (commit.stream.as_str(), commit.cursor.as_str()),
            ("events", "billing")
        );
        assert_eq!(
            commit.entries,
            vec![
                CursorEntry {
                    partition: 0,
                    offset: 7
                },
                CursorEntry {
                    partition: 1,
                    offset: 3
                },
            ]
        );
        conn.ok(commit.request_id).await;

        let Some(Frame::StreamDelete(delete)) = conn.recv().await else {
            panic!("expected StreamDelete");
        };
        assert_eq!(delete.stream, "events");
        conn.ok(delete.request_id).await;
        conn.until_close().await;
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    assert_eq!(
        client.protocol_version(),
        keratin_proto::PROTOCOL_VERSION_STREAMS
    );
    client
        .declare_stream_on("events", settings(), &[1, 2])
        .await
        .unwrap();
    let update = StreamRetentionUpdate {
        max_bytes: Update::Clear,
        max_age_ms: Update::Keep,
        max_messages: Update::Set(500),
    };
    client.set_stream("events", update).await.unwrap();
    let info = client.stream_info("events").await.unwrap();
    assert_eq!(info.settings, settings());
    assert_eq!(
        info.partitions
            .iter()
            .map(|p| p.next_offset)
            .collect::<Vec<_>>(),
        vec![7, 3]
    );
    let list = client.list_streams().await.unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].stream.as_str(), list[0].messages), ("events", 10));
    let entries = [
        CursorEntry {
            partition: 0,
            offset: 7,
        },
        CursorEntry {
            partition: 1,
            offset: 3,
        },
    ];
    client
        .commit_cursor("events", "billing", &entries)
        .await
        .unwrap();
    // Refused before sending: the fake would fail on an unexpected frame.
    let reversed = [entries[1], entries[0]];
    let error = client
        .commit_cursor("events", "billing", &reversed)
        .await
        .unwrap_err();
    assert!(matches!(error, ClientError::InvalidArgument(_)), "{error}");
    assert!(client
        .commit_cursor("events", "billing", &[])
        .await
        .is_err());
    client.delete_stream("events").await.unwrap();
    client.close().await;
    server.await.unwrap();
}

#[tokio::test]
async fn an_error_answer_is_a_client_error_with_its_code() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamDeclare(declare)) = conn.recv().await else {
            panic!("expected StreamDeclare");
        };
        conn.send(Frame::Error(ErrorFrame {
            request_id: Some(declare.request_id),
            fatal: false,
            error: ErrorBody::new(ERR_CONFLICT, "a queue is named events"),
        }))
        .await;
        let Some(Frame::StreamInfo(info)) = conn.recv().await else {
            panic!("expected StreamInfo");
        };
        conn.send(Frame::Error(ErrorFrame {
            request_id: Some(info.request_id),
            fatal: false,
            error: ErrorBody::new(ERR_NOT_FOUND, "no stream named missing"),
        }))
        .await;
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected StreamSubscribe");
        };
        conn.send(Frame::Error(ErrorFrame {
            request_id: Some(subscribe.request_id),
            fatal: false,
            error: ErrorBody::new(ERR_NOT_FOUND, "no stream named missing"),
        }))
        .await;
        conn.until_close().await;
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let error = client
        .declare_stream("events", StreamSettings::default())
        .await
        .unwrap_err();
    assert!(matches!(error, ClientError::Server(_)), "{error:?}");
    assert_eq!(error.code(), Some(409));
    assert!(
        error.to_string().contains("a queue is named events"),
        "{error}"
    );
    let error = client.stream_info("missing").await.unwrap_err();
    assert_eq!(error.code(), Some(404));
    let error = client
        .stream_subscribe(StreamSubscribeOptions::new("missing"))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some(404));
    // Refused before sending: a group needs a cursor.
    let mut options = StreamSubscribeOptions::new("events");
    options.group = true;
    let error = client.stream_subscribe(options).await.unwrap_err();
    assert!(matches!(error, ClientError::InvalidArgument(_)), "{error}");
    assert!(client
        .stream_subscribe(StreamSubscribeOptions::new("events").credit(0))
        .await
        .is_err());
    client.close().await;
    server.await.unwrap();
}

fn message(offset: u64, key: Option<&str>) -> StreamMessage {
    StreamMessage {
        offset,
        timestamp_ms: 1_700_000_000_000 + offset,
        routing_key: key.map(str::to_owned),
        headers: vec![Header {
            name: "n".into(),
            value: offset.to_string(),
        }],
        body: format!("body-{offset}").into_bytes().into(),
    }
}

/// Credit 4: the client gives back 2 after each 2 messages the application takes, commits
/// the offset after the last message of each partition, and cancels.
#[tokio::test]
async fn a_consumer_reads_tops_up_its_credit_and_commits() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected StreamSubscribe");
        };
        assert_eq!(subscribe.stream, "events");
        assert_eq!(subscribe.cursor.as_deref(), Some("billing"));
        assert_eq!(subscribe.start, StreamStart::Offset(5));
        assert_eq!(subscribe.credit, 4);
        assert_eq!(subscribe.partitions, vec![0, 1]);
        assert!(!subscribe.group && !subscribe.auto_commit);
        let tag = subscribe.consumer_tag.clone();
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: tag.clone(),
        }))
        .await;
        // Retention removed offsets 5 to 9 of partition 0: the reader was moved to 10.
        conn.send(Frame::StreamDeliver(StreamDeliver {
            consumer_tag: tag.clone(),
            partition: 0,
            moved_from: Some(5),
            messages: vec![
                message(10, Some("k1")),
                message(12, None),
                message(13, Some("k1")),
            ],
        }))
        .await;
        conn.send(Frame::StreamDeliver(StreamDeliver {
            consumer_tag: tag.clone(),
            partition: 1,
            moved_from: None,
            messages: vec![message(5, Some("k2"))],
        }))
        .await;
        // The credit is spent: nothing more until the client gives some back.
        let mut given = 0;
        while given < 4 {
            match conn.recv().await {
                Some(Frame::StreamCredit(credit)) => {
                    assert_eq!(credit.consumer_tag, tag);
                    assert_eq!(credit.credit, 2, "half the credit at a time");
                    given += credit.credit;
                }
                other => panic!("expected StreamCredit, got {other:?}"),
            }
        }
        conn.send(Frame::StreamDeliver(StreamDeliver {
            consumer_tag: tag.clone(),
            partition: 1,
            moved_from: None,
            messages: vec![message(6, None)],
        }))
        .await;
        let Some(Frame::CursorCommit(commit)) = conn.recv().await else {
            panic!("expected CursorCommit");
        };
        assert_eq!(
            (commit.stream.as_str(), commit.cursor.as_str()),
            ("events", "billing")
        );
        assert_eq!(
            commit.entries,
            vec![
                CursorEntry {
                    partition: 0,
                    offset: 14
                },
                CursorEntry {
                    partition: 1,
                    offset: 7
                },
            ]
        );
        conn.ok(commit.request_id).await;
        let Some(Frame::Cancel(cancel)) = conn.recv().await else {
            panic!("expected Cancel");
        };
        assert_eq!(cancel.consumer_tag, tag);
        conn.ok(cancel.request_id).await;

        // A second consumer: dropping it cancels it.
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected the second StreamSubscribe");
        };
        assert_eq!(subscribe.start, StreamStart::First);
        assert_eq!(subscribe.credit, keratin_client::STREAM_CREDIT_DEFAULT);
        assert!(subscribe.cursor.is_none() && subscribe.partitions.is_empty());
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: subscribe.consumer_tag.clone(),
        }))
        .await;
        let Some(Frame::Cancel(cancel)) = conn.recv().await else {
            panic!("expected a Cancel from Drop");
        };
        assert_eq!(cancel.consumer_tag, subscribe.consumer_tag);
        conn.ok(cancel.request_id).await;
        conn.until_close().await;
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let options = StreamSubscribeOptions::new("events")
        .cursor("billing")
        .start(StreamStart::Offset(5))
        .credit(4)
        .partitions(vec![0, 1]);
    let mut consumer = client.stream_subscribe(options).await.unwrap();
    let mut read: Vec<StreamDelivery> = Vec::new();
    for _ in 0..5 {
        let delivery = tokio::time::timeout(fake::TEST_WAIT, consumer.next())
            .await
            .expect("a message in time")
            .expect("a message");
        read.push(delivery);
    }
    let places: Vec<(u32, u64)> = read.iter().map(|d| (d.partition, d.offset)).collect();
    assert_eq!(places, vec![(0, 10), (0, 12), (0, 13), (1, 5), (1, 6)]);
    let moved: Vec<Option<u64>> = read.iter().map(|d| d.moved_from).collect();
    assert_eq!(moved, vec![Some(5), None, None, None, None]);
    assert_eq!(read[0].routing_key.as_deref(), Some("k1"));
    assert_eq!(read[1].routing_key, None);
    assert_eq!(read[0].timestamp_ms, 1_700_000_000_010);
    assert_eq!(read[2].headers[0].value, "13");
    assert_eq!(read[4].body.as_ref(), b"body-6");
    assert_eq!(
        consumer.positions(),
        vec![
            CursorEntry {
                partition: 0,
                offset: 14
            },
            CursorEntry {
                partition: 1,
                offset: 7
            },
        ]
    );
    consumer.commit().await.unwrap();
    consumer.cancel().await.unwrap();

    let mut consumer = client
        .stream_subscribe(StreamSubscribeOptions::new("events"))
        .await
        .unwrap();
    // Without a cursor there is nothing to commit to: refused, nothing sent.
    let error = consumer.commit().await.unwrap_err();
    assert!(matches!(error, ClientError::InvalidArgument(_)), "{error}");
    assert!(error.to_string().contains("without a cursor"), "{error}");
    drop(consumer);
    client.close().await;
    server.await.unwrap();
}

/// The stream is deleted while a reader reads: its partitions end with 404, the consumer
/// yields what it received before and then ends, saying why.
#[tokio::test]
async fn a_deleted_stream_ends_its_consumer() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected StreamSubscribe");
        };
        let tag = subscribe.consumer_tag.clone();
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: tag.clone(),
        }))
        .await;
        conn.send(Frame::StreamDeliver(StreamDeliver {
            consumer_tag: tag.clone(),
            partition: 0,
            moved_from: None,
            messages: vec![message(0, None)],
        }))
        .await;
        conn.send(Frame::StreamPartitionEnd(StreamPartitionEnd {
            consumer_tag: tag.clone(),
            partition: 0,
            error: ErrorBody::new(ERR_NOT_FOUND, "stream events was deleted"),
        }))
        .await;
        // The consumer's handle is dropped once it ended: it cancels.
        let Some(Frame::Cancel(cancel)) = conn.recv().await else {
            panic!("expected Cancel");
        };
        conn.ok(cancel.request_id).await;
        conn.until_close().await;
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let mut consumer = client
        .stream_subscribe(StreamSubscribeOptions::new("events"))
        .await
        .unwrap();
    let first = consumer
        .recv()
        .await
        .expect("the message sent before the end");
    assert_eq!(first.offset, 0);
    let end = tokio::time::timeout(fake::TEST_WAIT, consumer.recv())
        .await
        .expect("the consumer ends in time");
    assert!(end.is_none());
    let error = consumer.end_error().expect("an end error");
    assert_eq!(error.code(), Some(404), "{error}");
    let ends = consumer.take_partition_ends();
    assert_eq!(ends.len(), 1);
    assert_eq!(ends[0].0, 0);
    drop(consumer);
    client.close().await;
    server.await.unwrap();
}

/// In a group, a partition handed to another member ends with 409: its messages received
/// before are still handed out, but its position leaves `positions()` (the other member
/// commits it now); once the partition comes back, its new messages are positions again.
#[tokio::test]
async fn a_partition_handed_to_another_group_member_leaves_the_positions() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected StreamSubscribe");
        };
        assert!(subscribe.group);
        let tag = subscribe.consumer_tag.clone();
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: tag.clone(),
        }))
        .await;
        for (partition, offsets) in [(0, vec![0, 1]), (1, vec![5])] {
            conn.send(Frame::StreamDeliver(StreamDeliver {
                consumer_tag: tag.clone(),
                partition,
                moved_from: None,
                messages: offsets.into_iter().map(|o| message(o, None)).collect(),
            }))
            .await;
        }
        conn.send(Frame::StreamPartitionEnd(StreamPartitionEnd {
            consumer_tag: tag.clone(),
            partition: 1,
            error: ErrorBody::new(ERR_CONFLICT, "partition 1 is now read by another member"),
        }))
        .await;
        conn.send(Frame::StreamDeliver(StreamDeliver {
            consumer_tag: tag.clone(),
            partition: 1,
            moved_from: None,
            messages: vec![message(9, None)],
        }))
        .await;
        let Some(Frame::CursorCommit(commit)) = conn.recv().await else {
            panic!("expected CursorCommit");
        };
        assert_eq!(
            commit.entries,
            vec![CursorEntry {
                partition: 0,
                offset: 2
            }],
            "partition 1 is the other member's to commit"
        );
        conn.ok(commit.request_id).await;
        conn.until_close().await;
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let mut options = StreamSubscribeOptions::new("events").cursor("g");
    options.group = true;
    let mut consumer = client.stream_subscribe(options).await.unwrap();
    let mut offsets = Vec::new();
    for _ in 0..3 {
        let delivery = consumer.recv().await.expect("a message");
        offsets.push((delivery.partition, delivery.offset));
    }
    assert_eq!(offsets, vec![(0, 0), (0, 1), (1, 5)], "all handed out");
    // The end may not be taken in yet: the commit takes it in first.
    consumer.commit().await.expect("commit");
    let ends = consumer.take_partition_ends();
    assert_eq!(ends.len(), 1);
    assert_eq!((ends[0].0, ends[0].1.code()), (1, ERR_CONFLICT));
    let back = consumer.recv().await.expect("partition 1 again");
    assert_eq!((back.partition, back.offset), (1, 9));
    assert_eq!(
        consumer.positions(),
        vec![
            CursorEntry {
                partition: 0,
                offset: 2
            },
            CursorEntry {
                partition: 1,
                offset: 10
            }
        ]
    );
    drop(consumer);
    client.close().await;
    server.await.unwrap();
}

/// A node of version 6 refuses 7 and is spoken to in 6; every stream call then fails saying
/// streams need 7, and no frame reaches the node.
#[tokio::test]
async fn a_version_6_node_gets_no_stream_frame() {
    let (addr, accepted, frames) = fake::start_old_counting(6).await;
    let client = fake::connect(addr, fake::options()).await;
    assert_eq!(client.protocol_version(), 6);
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "7 refused, then 6");
    let errors = [
        client
            .declare_stream("events", StreamSettings::default())
            .await
            .unwrap_err(),
        client.stream_info("events").await.unwrap_err(),
        client.list_streams().await.unwrap_err(),
        client.delete_stream("events").await.unwrap_err(),
        client
            .set_stream("events", StreamRetentionUpdate::default())
            .await
            .unwrap_err(),
        client
            .commit_cursor(
                "events",
                "c",
                &[CursorEntry {
                    partition: 0,
                    offset: 1,
                }],
            )
            .await
            .unwrap_err(),
        client
            .stream_subscribe(StreamSubscribeOptions::new("events"))
            .await
            .unwrap_err(),
    ];
    for error in errors {
        assert!(
            matches!(
                error,
                ClientError::StreamsUnsupported {
                    server_version: 6,
                    needed: 7
                }
            ),
            "{error:?}"
        );
        let shown = error.to_string();
        assert!(
            shown.contains("protocol version 6") && shown.contains("version 7"),
            "{shown}"
        );
        assert!(shown.contains("upgrade"), "{shown}");
    }
    // A queue request still goes out: the node sees exactly that one frame.
    let _ = tokio::time::timeout(std::time::Duration::from_millis(300), client.list()).await;
    client.close().await;
    assert_eq!(frames.load(Ordering::SeqCst), 1);
}

/// A broker that sends more than the credit (here 1 message, then 65 more frames while the
/// application reads nothing): the client counts the credit, keeps what it allowed, cancels
/// the consumer instead of dropping messages silently, and the consumer ends saying why after
/// yielding what it holds.
#[tokio::test]
async fn a_broker_over_the_credit_ends_the_consumer() {
    let (cancelled_tx, cancelled) = tokio::sync::oneshot::channel();
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected StreamSubscribe");
        };
        assert_eq!(subscribe.credit, 1);
        let tag = subscribe.consumer_tag.clone();
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: tag.clone(),
        }))
        .await;
        for offset in 0..66 {
            conn.send(Frame::StreamDeliver(StreamDeliver {
                consumer_tag: tag.clone(),
                partition: 0,
                moved_from: None,
                messages: vec![message(offset, None)],
            }))
            .await;
        }
        let Some(Frame::Cancel(cancel)) = conn.recv().await else {
            panic!("expected Cancel");
        };
        assert_eq!(cancel.consumer_tag, tag);
        conn.ok(cancel.request_id).await;
        let _ = cancelled_tx.send(());
        // No credit is given for a consumer that was cancelled: the next frame is the Close.
        match conn.recv().await {
            Some(Frame::Close(close)) => conn.send(Frame::Close(close)).await,
            other => panic!("expected only Close, got {other:?}"),
        }
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let mut consumer = client
        .stream_subscribe(StreamSubscribeOptions::new("events").credit(1))
        .await
        .unwrap();
    tokio::time::timeout(fake::TEST_WAIT, cancelled)
        .await
        .expect("the client cancels in time")
        .expect("the fake signals");
    let mut offsets = Vec::new();
    while let Some(delivery) = consumer.recv().await {
        offsets.push(delivery.offset);
    }
    assert_eq!(offsets, vec![0], "what the credit allowed");
    let error = consumer.end_error().expect("an end error");
    assert!(error.to_string().contains("credit"), "{error}");
    drop(consumer);
    client.close().await;
    server.await.unwrap();
}

/// A group hands a partition away and back any number of times while the application reads
/// nothing (here 200 ends of partition 1 after the credit of 2 was spent): the consumer keeps
/// running (the ends do not take the slots its credit bounds; a client that queued each end
/// there ended the consumer "over credit" at the 65th), reports the partition's latest end
/// once, leaves its position out of the commit, and reads on when it gives credit back.
#[tokio::test]
async fn a_partition_ended_many_times_while_unread_does_not_end_the_consumer() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::StreamSubscribe(subscribe)) = conn.recv().await else {
            panic!("expected StreamSubscribe");
        };
        assert_eq!(subscribe.credit, 2);
        let tag = subscribe.consumer_tag.clone();
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: tag.clone(),
        }))
        .await;
        for partition in [0, 1] {
            conn.send(Frame::StreamDeliver(StreamDeliver {
                consumer_tag: tag.clone(),
                partition,
                moved_from: None,
                messages: vec![message(0, None)],
            }))
            .await;
        }
        for round in 0..200 {
            conn.send(Frame::StreamPartitionEnd(StreamPartitionEnd {
                consumer_tag: tag.clone(),
                partition: 1,
                error: ErrorBody::new(ERR_CONFLICT, format!("handed over, round {round}")),
            }))
            .await;
        }
        let mut credit = 0;
        let mut committed = false;
        loop {
            match conn.recv().await {
                // The test's own commit, after the ends: the task has taken them all.
                Some(Frame::CursorCommit(commit)) if commit.cursor == "sync" => {
                    conn.ok(commit.request_id).await;
                }
                Some(Frame::StreamCredit(given)) => {
                    assert_eq!(given.consumer_tag, tag);
                    credit += given.credit;
                    if credit == 1 {
                        conn.send(Frame::StreamDeliver(StreamDeliver {
                            consumer_tag: tag.clone(),
                            partition: 0,
                            moved_from: None,
                            messages: vec![message(1, None)],
                        }))
                        .await;
                    }
                }
                Some(Frame::CursorCommit(commit)) => {
                    assert_eq!(commit.cursor, "g");
                    assert_eq!(
                        commit.entries,
                        vec![CursorEntry {
                            partition: 0,
                            offset: 2
                        }],
                        "partition 1 is another member's to commit"
                    );
                    committed = true;
                    conn.ok(commit.request_id).await;
                }
                // Only when the test drops the consumer, after its commit.
                Some(Frame::Cancel(cancel)) => {
                    assert!(committed, "the client cancelled early: {cancel:?}");
                    conn.ok(cancel.request_id).await;
                }
                Some(Frame::Close(close)) => {
                    conn.send(Frame::Close(close)).await;
                    return;
                }
                Some(other) => panic!("unexpected {other:?}"),
                None => panic!("the connection ended without a Close"),
            }
        }
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let mut options = StreamSubscribeOptions::new("events").cursor("g").credit(2);
    options.group = true;
    let mut consumer = client.stream_subscribe(options).await.unwrap();
    // Answered after the 200 ends on the same connection: the task has handled them all.
    let entry = CursorEntry {
        partition: 0,
        offset: 0,
    };
    client
        .commit_cursor("events", "sync", &[entry])
        .await
        .expect("the sync commit");
    let mut offsets = Vec::new();
    for _ in 0..3 {
        let delivery = tokio::time::timeout(fake::TEST_WAIT, consumer.recv())
            .await
            .expect("in time")
            .unwrap_or_else(|| panic!("the consumer ended: {:?}", consumer.end_error()));
        offsets.push((delivery.partition, delivery.offset));
    }
    assert_eq!(offsets, vec![(0, 0), (1, 0), (0, 1)]);
    assert!(consumer.end_error().is_none(), "{:?}", consumer.end_error());
    consumer.commit().await.expect("commit");
    let ends = consumer.take_partition_ends();
    assert_eq!(
        ends.len(),
        1,
        "the latest end of partition 1, once: {ends:?}"
    );
    assert_eq!((ends[0].0, ends[0].1.code()), (1, ERR_CONFLICT));
    assert!(ends[0].1.message().contains("round 199"), "{:?}", ends[0].1);
    drop(consumer);
    client.close().await;
    server.await.unwrap();
}
