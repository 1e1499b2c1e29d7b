//! Confirmed publishes against a scripted fake broker: a publish resolves only on its
//! `Confirm`; `ERR_LIMITED` is retried under a new publish id after the hint and then succeeds,
//! or fails at `publish_timeout` with an error naming the limit and reason; 503 and 504 are not
//! retried. A client that resolved early, retried too soon, reused a publish id or retried a
//! 503 fails these tests.

mod fake;

use std::time::{Duration, Instant};

use bytes::Bytes;
use keratin_client::{ClientError, ClientOptions, OutgoingMessage, QueueSettings};
use keratin_proto::codes::{ERR_GATEWAY_TIMEOUT, ERR_NOT_FOUND, ERR_UNAVAILABLE};
use keratin_proto::{ErrorBody, Frame, LimitReason, PublishMode};
use tokio::sync::mpsc;

fn disk_limited(retry_after_ms: u32) -> ErrorBody {
    ErrorBody::limited(
        LimitReason::Disk,
        retry_after_ms,
        "disk at hard level on /data; retry after the hint",
    )
}

#[tokio::test]
async fn confirmed_publish_resolves_only_on_its_confirm() {
    let (addr, server) = fake::start(|mut conn| async move {
        let declare = match conn.recv().await {
            Some(Frame::Declare(declare)) => declare,
            other => panic!("expected Declare, got {other:?}"),
        };
        assert_eq!(declare.queue, "orders");
        conn.ok(declare.request_id).await;
        let publish = conn.expect_publish().await;
        assert_eq!(publish.mode, PublishMode::Confirmed);
        assert_eq!(publish.messages.len(), 1);
        let publish_id = publish.messages[0].publish_id;
        // Answers for other ids must not resolve this publish.
        conn.confirm(publish_id + 100).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        conn.confirm(publish_id).await;
        assert!(conn
            .recv()
            .await
            .is_some_and(|f| matches!(f, Frame::Close(_))));
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    assert_eq!(client.node_id(), "fake-node");
    client
        .declare("orders", QueueSettings::default())
        .await
        .unwrap();
    let started = Instant::now();
    let message = OutgoingMessage::new(Bytes::from_static(b"hello")).with_header("k", "v");
    let confirmed = client.publish("orders", message).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "resolved before its Confirm"
    );
    assert_eq!(confirmed.attempts, 1);
    client.close().await;
    server.await.unwrap();
}

#[tokio::test]
async fn limited_is_retried_after_the_hint_with_a_new_publish_id() {
    let (gaps_tx, mut gaps) = mpsc::unbounded_channel();
    let (addr, server) = fake::start(move |mut conn| async move {
        let mut ids = Vec::new();
        let mut last = None::<Instant>;
        for attempt in 0..3 {
            let publish = conn.expect_publish().await;
            let message = &publish.messages[0];
            assert_eq!(
                message.body,
                Bytes::from_static(b"payload"),
                "same body each time"
            );
            if let Some(last) = last {
                gaps_tx.send(last.elapsed()).unwrap();
            }
            ids.push(message.publish_id);
            if attempt < 2 {
                conn.publish_error(message.publish_id, disk_limited(50))
                    .await;
                last = Some(Instant::now());
            } else {
                conn.confirm(message.publish_id).await;
            }
        }
        ids.dedup();
        assert_eq!(ids.len(), 3, "each retry uses a new publish id");
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let started = Instant::now();
    let confirmed = client
        .publish("orders", OutgoingMessage::new(&b"payload"[..]))
        .await
        .unwrap();
    assert_eq!(confirmed.attempts, 3);
    assert!(started.elapsed() >= Duration::from_millis(100));
    server.await.unwrap();
    for _ in 0..2 {
        let gap = gaps.recv().await.unwrap();
        // The hint is 50 ms; jitter adds at most 20%, scheduling some slack.
        assert!(
            gap >= Duration::from_millis(50),
            "retried after {gap:?}, before the hint"
        );
        assert!(gap < Duration::from_millis(500), "retried after {gap:?}");
    }
}

#[tokio::test]
async fn limited_until_the_timeout_fails_naming_limit_and_reason() {
    let (addr, server) = fake::start(|mut conn| async move {
        // Until the client closes: every attempt is refused.
        while let Some(Frame::Publish(publish)) = conn.recv().await {
            conn.publish_error(publish.messages[0].publish_id, disk_limited(50))
                .await;
        }
    })
    .await;
    let options = ClientOptions {
        publish_timeout: Duration::from_millis(300),
        ..fake::options()
    };
    let client = fake::connect(addr, options).await;
    let started = Instant::now();
    let failed = client
        .publish("orders", OutgoingMessage::new(&b"x"[..]))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(300),
        "gave up after {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(2),
        "gave up after {elapsed:?}"
    );
    assert!(matches!(
        failed.error,
        ClientError::Limited {
            timed_out: true,
            reason: LimitReason::Disk,
            retry_after_ms: 50,
            ..
        }
    ));
    let shown = failed.to_string();
    assert!(
        shown.starts_with("publish timed out after 300 ms while the broker kept rejecting it: disk limit (disk at hard level on /data"),
        "{shown}"
    );
    assert_eq!(failed.code(), Some(429));
    assert_eq!(failed.reason(), Some("disk"));
    assert_eq!(failed.error.code_key().as_deref(), Some("429:disk"));
    assert_eq!(
        failed.message.body,
        Bytes::from_static(b"x"),
        "message handed back"
    );
    drop(client);
    server.await.unwrap();
}

#[tokio::test]
async fn unavailable_and_gateway_timeout_are_not_retried() {
    let (addr, server) = fake::start(|mut conn| async move {
        let publish = conn.expect_publish().await;
        let error = ErrorBody::new(ERR_UNAVAILABLE, "log of orders/0 stopped: EIO; healing");
        conn.publish_error(publish.messages[0].publish_id, error)
            .await;
        let publish = conn.expect_publish().await;
        assert_eq!(
            publish.messages[0].body,
            Bytes::from_static(b"second"),
            "503 not retried"
        );
        let error = ErrorBody::new(ERR_GATEWAY_TIMEOUT, "fsync failed after write");
        conn.publish_error(publish.messages[0].publish_id, error)
            .await;
        assert!(
            matches!(conn.recv().await, Some(Frame::Close(_))),
            "504 not retried"
        );
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let failed = client
        .publish("orders", OutgoingMessage::new(&b"first"[..]))
        .await
        .unwrap_err();
    assert!(matches!(failed.error, ClientError::Server(_)));
    assert_eq!(failed.code(), Some(503));
    assert!(failed.to_string().contains("log of orders/0 stopped"));
    let failed = client
        .publish("orders", OutgoingMessage::new(&b"second"[..]))
        .await
        .unwrap_err();
    assert!(matches!(failed.error, ClientError::OutcomeUnknown { .. }));
    assert_eq!(failed.code(), Some(504));
    assert!(failed.to_string().contains("may or may not be durable"));
    assert!(failed.to_string().contains("fsync failed after write"));
    client.close().await;
    server.await.unwrap();
}

#[tokio::test]
async fn batch_goes_in_one_frame_and_is_answered_in_order() {
    let (addr, server) = fake::start(|mut conn| async move {
        let publish = conn.expect_publish().await;
        assert_eq!(publish.messages.len(), 3, "one frame for the batch");
        let ids: Vec<u64> = publish.messages.iter().map(|m| m.publish_id).collect();
        conn.publish_error(ids[1], ErrorBody::new(ERR_NOT_FOUND, "no queue"))
            .await;
        conn.send(Frame::Confirm(keratin_proto::Confirm {
            ranges: vec![keratin_proto::PublishIdRange {
                first: ids[0],
                last: ids[0],
            }],
        }))
        .await;
        conn.confirm(ids[2]).await;
        let _ = conn.recv().await;
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let messages = ["a", "b", "c"]
        .into_iter()
        .map(|body| OutgoingMessage::new(body.as_bytes().to_vec()))
        .collect();
    let results = client.publish_batch("orders", messages).await;
    assert!(results[0].is_ok());
    let failed = results[1].as_ref().unwrap_err();
    assert_eq!(failed.code(), Some(404));
    assert_eq!(failed.message.body, Bytes::from_static(b"b"));
    assert!(results[2].is_ok());
    client.close().await;
    server.await.unwrap();
}
