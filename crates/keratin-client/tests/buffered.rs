//! Buffered publishes against a scripted fake broker: they go out in `PublishMode::Buffered`, are
//! never retried, and a `PublishError` (429 included) lands on the dropped path with its code
//! and reason; `send` waits while the bounded buffer is full, and `flush` returns once the
//! barrier (`QueueList`) came back. A client that retried buffered messages, lost a failure,
//! or let the buffer grow past its capacity fails these tests.

mod fake;

use std::time::{Duration, Instant};

use keratin_client::{BufferedOptions, ClientError, OutgoingMessage};
use keratin_proto::{ErrorBody, Frame, LimitReason, PublishMode, QueueListReply};

#[tokio::test]
async fn rejected_buffered_messages_land_on_the_dropped_path_with_their_reason() {
    let (addr, server) = fake::start(|mut conn| async move {
        let mut publishes = 0;
        while let Some(frame) = conn.recv().await {
            match frame {
                Frame::Publish(publish) => {
                    assert_eq!(publish.mode, PublishMode::Buffered);
                    // Separate buffered sends may share a frame, marked joinable so the
                    // broker still admits each on its own.
                    assert!(publish.joinable, "buffered sends are joinable");
                    publishes += publish.messages.len();
                    for message in publish.messages {
                        if message.body.as_ref() == b"refused" {
                            let error = ErrorBody::limited(
                                LimitReason::QueueFull,
                                250,
                                "queue orders is full (max_messages 10)",
                            );
                            conn.publish_error(message.publish_id, error).await;
                        }
                    }
                }
                Frame::QueueList(list) => {
                    let reply = QueueListReply {
                        request_id: list.request_id,
                        queues: Vec::new(),
                    };
                    conn.send(Frame::QueueListReply(reply)).await;
                }
                Frame::Close(_) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            publishes, 3,
            "buffered messages are sent once and not retried"
        );
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let (publisher, mut dropped) = client.buffered_publisher("orders", BufferedOptions::default());
    for body in ["one", "refused", "three"] {
        publisher.send(OutgoingMessage::new(body)).await.unwrap();
    }
    publisher.flush().await.unwrap();
    assert_eq!(publisher.unsettled_count(), 0);
    assert_eq!(publisher.dropped_count(), 1);
    let report = dropped
        .try_recv()
        .expect("the refusal was reported before flush returned");
    assert_eq!(report.message.body.as_ref(), b"refused");
    assert_eq!(report.error.code_key().as_deref(), Some("429:queue_full"));
    assert!(matches!(
        report.error,
        ClientError::Limited {
            timed_out: false,
            ..
        }
    ));
    assert!(report.error.to_string().contains("queue orders is full"));
    assert!(dropped.try_recv().is_none());
    drop(publisher);
    client.close().await;
    server.await.unwrap();
}

#[tokio::test]
async fn send_waits_while_the_buffer_is_full() {
    let (addr, server) = fake::start(|mut conn| async move {
        while let Some(frame) = conn.recv().await {
            match frame {
                Frame::Publish(_) => {}
                Frame::QueueList(list) => {
                    // Hold the barrier: the buffer stays full meanwhile.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let reply = QueueListReply {
                        request_id: list.request_id,
                        queues: Vec::new(),
                    };
                    conn.send(Frame::QueueListReply(reply)).await;
                }
                _ => break,
            }
        }
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let (publisher, _dropped) =
        client.buffered_publisher("orders", BufferedOptions { capacity: 2 });
    let started = Instant::now();
    publisher.send(OutgoingMessage::new("a")).await.unwrap();
    publisher.send(OutgoingMessage::new("b")).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(150));
    assert!(publisher.unsettled_count() <= 2);
    publisher.send(OutgoingMessage::new("c")).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "the third send did not wait for room"
    );
    publisher.flush().await.unwrap();
    drop(publisher);
    client.close().await;
    server.await.unwrap();
}

/// A connection that ends under a blocked write, with buffered messages outstanding in every
/// state (written and unanswered, in the frame being written, queued for the task), reports
/// each of them on the dropped path exactly once. The fake broker reads nothing, so the
/// client's writes fill the socket buffers and block; then it closes with the client's bytes
/// unread, which resets the connection under that write. A client that let the messages of
/// the frame it was writing (or of a command it had taken) vanish reports fewer than it sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_buffered_message_is_reported_once_when_the_connection_ends() {
    let (addr, server) = fake::start(|conn| async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(conn);
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    // Room for everything the socket buffers and the command queue can hold, so that `send`
    // never waits for a slot and the dropped path never overflows.
    let capacity = 100_000;
    let (publisher, mut dropped) =
        client.buffered_publisher("orders", BufferedOptions { capacity });
    let body = bytes::Bytes::from(vec![7u8; 300 * 1024]);
    let deadline = tokio::time::Instant::now() + fake::TEST_WAIT;
    let mut sent = 0u64;
    loop {
        let send = publisher.send(OutgoingMessage::new(body.clone()));
        match tokio::time::timeout_at(deadline, send).await {
            Ok(Ok(())) => sent += 1,
            Ok(Err(failed)) => {
                assert!(matches!(failed.error, ClientError::ConnectionLost { .. }));
                break;
            }
            Err(_) => panic!("the connection did not end ({sent} sent)"),
        }
    }
    server.await.unwrap();
    // Every slot comes back once each message is settled: here, reported as dropped.
    let flushed = tokio::time::timeout(fake::TEST_WAIT, publisher.flush())
        .await
        .expect("flush returns once every message is settled");
    assert!(flushed.is_err(), "the connection is gone");
    let mut reported = 0u64;
    while let Some(report) = dropped.try_recv() {
        assert!(
            matches!(
                report.error,
                ClientError::OutcomeUnknown { .. } | ClientError::ConnectionLost { .. }
            ),
            "{:?}",
            report.error
        );
        assert!(
            !report.error.to_string().contains("lost track"),
            "reported by the safety net, not by the path that let it go: {}",
            report.error
        );
        reported += 1;
    }
    assert_eq!(dropped.unreported_count(), 0);
    assert_eq!(
        (reported, publisher.dropped_count()),
        (sent, sent),
        "every message sent must be reported dropped exactly once"
    );
}
