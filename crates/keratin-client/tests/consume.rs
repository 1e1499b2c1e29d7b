//! Consumers against a scripted fake broker: `Deliver` frames come out of the `Stream` with
//! every field, acks and rejects go back as `Ack`/`Reject` frames naming the delivery ids,
//! `cancel` sends `Cancel` and dropping a consumer cancels it. A client that lost deliveries,
//! sent the wrong ids or forgot to cancel fails these tests.

mod fake;

use futures_util::StreamExt;
use keratin_proto::{Deliver, Frame, Header, SubscribeOk};

fn deliver(tag: &str, delivery_id: u64) -> Frame {
    Frame::Deliver(Deliver {
        consumer_tag: tag.to_owned(),
        delivery_id,
        partition: 0,
        offset: delivery_id * 10,
        redelivered: delivery_id == 3,
        delivery_count: if delivery_id == 3 { 2 } else { 1 },
        routing_key: (delivery_id == 2).then(|| "k2".to_owned()),
        headers: vec![Header {
            name: "seq".into(),
            value: delivery_id.to_string(),
        }],
        body: format!("body-{delivery_id}").into_bytes().into(),
    })
}

#[tokio::test]
async fn deliveries_stream_in_and_acks_and_rejects_go_out() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::Subscribe(subscribe)) = conn.recv().await else {
            panic!("expected Subscribe");
        };
        assert_eq!(
            (subscribe.queue.as_str(), subscribe.prefetch),
            ("orders", 10)
        );
        let tag = subscribe.consumer_tag.clone();
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: tag.clone(),
        }))
        .await;
        for delivery_id in 1..=3 {
            conn.send(deliver(&tag, delivery_id)).await;
        }
        let mut acked = Vec::new();
        let mut rejected = Vec::new();
        while acked.len() < 2 || rejected.is_empty() {
            match conn.recv().await {
                Some(Frame::Ack(ack)) => acked.extend(ack.delivery_ids),
                Some(Frame::Reject(reject)) => {
                    assert!(reject.requeue);
                    rejected.extend(reject.delivery_ids);
                }
                other => panic!("expected Ack or Reject, got {other:?}"),
            }
        }
        acked.sort_unstable();
        assert_eq!((acked, rejected), (vec![1, 2], vec![3]));
        let Some(Frame::Cancel(cancel)) = conn.recv().await else {
            panic!("expected Cancel");
        };
        assert_eq!(cancel.consumer_tag, tag);
        conn.ok(cancel.request_id).await;
        // Dropping a consumer cancels it too.
        let Some(Frame::Subscribe(subscribe)) = conn.recv().await else {
            panic!("expected the second Subscribe");
        };
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
        assert!(matches!(conn.recv().await, Some(Frame::Close(_))));
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let mut consumer = client.subscribe("orders", 10).await.unwrap();
    let mut deliveries = Vec::new();
    for _ in 0..3 {
        deliveries.push(consumer.next().await.expect("a delivery"));
    }
    let third = &deliveries[2];
    assert_eq!(third.queue, "orders");
    assert_eq!(third.consumer_tag, consumer.tag());
    assert_eq!(
        (third.delivery_id, third.offset, third.partition),
        (3, 30, 0)
    );
    assert!(third.redelivered);
    assert_eq!(third.delivery_count, 2);
    assert_eq!(third.headers[0].value, "3");
    assert_eq!(third.body.as_ref(), b"body-3");
    assert_eq!(third.routing_key, None);
    assert_eq!(deliveries[1].routing_key.as_deref(), Some("k2"));
    deliveries[0].ack().unwrap();
    deliveries[1].ack().unwrap();
    deliveries[1].ack().unwrap(); // a second ack is a no-op
    deliveries[2].reject(true).unwrap();
    consumer.cancel().await.unwrap();
    let consumer = client.subscribe("orders", 1).await.unwrap();
    drop(consumer);
    assert!(
        client.subscribe("orders", 0).await.is_err(),
        "prefetch 0 refused"
    );
    client.close().await;
    server.await.unwrap();
}

/// Acks queued before `cancel` reach the broker before the `Cancel`: a broker that cancels a
/// consumer returns its unacknowledged deliveries to ready, so an ack sent after the Cancel
/// comes too late, and the acked message is delivered again. Twenty rounds of 200 acks
/// followed at once by a cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_queued_before_a_cancel_go_out_before_it() {
    const ROUNDS: usize = 20;
    const DELIVERIES: u64 = 200;
    let (addr, server) = fake::start(|mut conn| async move {
        for round in 0..ROUNDS {
            let Some(Frame::Subscribe(subscribe)) = conn.recv().await else {
                panic!("expected Subscribe");
            };
            let tag = subscribe.consumer_tag.clone();
            conn.send(Frame::SubscribeOk(SubscribeOk {
                request_id: subscribe.request_id,
                consumer_tag: tag.clone(),
            }))
            .await;
            let first = round as u64 * DELIVERIES + 1;
            for delivery_id in first..first + DELIVERIES {
                conn.send(deliver(&tag, delivery_id)).await;
            }
            let mut acked = 0;
            let cancel = loop {
                match conn.recv().await {
                    Some(Frame::Ack(ack)) => acked += ack.delivery_ids.len() as u64,
                    Some(Frame::Cancel(cancel)) => break cancel,
                    other => panic!("expected Ack or Cancel, got {other:?}"),
                }
            };
            assert_eq!(
                acked, DELIVERIES,
                "round {round}: the Cancel came after {acked} of {DELIVERIES} acks"
            );
            conn.ok(cancel.request_id).await;
        }
        assert!(matches!(conn.recv().await, Some(Frame::Close(_))));
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    for _ in 0..ROUNDS {
        let mut consumer = client.subscribe("orders", 1000).await.unwrap();
        let mut deliveries = Vec::new();
        for _ in 0..DELIVERIES {
            deliveries.push(consumer.next().await.expect("a delivery"));
        }
        for delivery in &deliveries {
            delivery.ack().unwrap();
        }
        consumer.cancel().await.unwrap();
    }
    client.close().await;
    server.await.unwrap();
}
