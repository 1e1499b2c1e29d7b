//! Queue semantics through the in-process API on the real file system: declare, publish,
//! consume, ack, reject with and without requeue, dead-lettering, max deliveries, consumer loss,
//! purge, delete, partitions, restart. Each test fails if a message is lost, duplicated where it
//! must not be, or delivered out of order.

mod common;

use common::*;
use std::time::Duration;

use keratin_broker::{BrokerError, Message, QueueSettings};

fn settings(partitions: u32) -> QueueSettings {
    QueueSettings {
        partitions,
        ..QueueSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_is_idempotent_and_conflicts_on_other_settings() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(2)).await.expect("declare");
    broker
        .declare("q", settings(2))
        .await
        .expect("same settings");
    let err = broker
        .declare("q", settings(3))
        .await
        .expect_err("conflict");
    assert!(matches!(err, BrokerError::Conflict { .. }), "{err}");
    assert!(broker.declare("bad name!", settings(1)).await.is_err());
    assert!(broker.declare("z", settings(0)).await.is_err());
    let list = broker.list();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].partitions.len(), 2);
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_consume_ack_in_order() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(1)).await.expect("declare");
    publish_seq(&broker, "q", 0..500, 300).await;
    assert_eq!(broker.info("q").expect("info").ready(), 500);
    let mut consumer = broker.subscribe("q", 50).expect("subscribe");
    for expected in 0..500 {
        let d = recv(&mut consumer).await;
        assert_eq!(seq_of(&d.message.body), expected);
        assert!(!d.redelivered);
        assert_eq!(d.delivery_count, 1);
        consumer.ack(&[d.tag]);
    }
    assert_idle(&mut consumer).await;
    let info = broker.info("q").expect("info");
    assert_eq!((info.ready(), info.inflight(), info.bytes()), (0, 0, 0));
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(
            live, rebuilt,
            "state rebuilt from the log equals the live one"
        );
    }
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_bounds_inflight() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(2)).await.expect("declare");
    publish_seq(&broker, "q", 0..100, 50).await;
    let mut consumer = broker.subscribe("q", 7).expect("subscribe");
    let mut held = Vec::new();
    for _ in 0..7 {
        held.push(recv(&mut consumer).await);
    }
    assert_idle(&mut consumer).await;
    assert_eq!(broker.info("q").expect("info").inflight(), 7);
    consumer.ack(&[held[0].tag]);
    recv(&mut consumer).await;
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_requeue_goes_back_ahead_of_newer_messages() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(1)).await.expect("declare");
    publish_seq(&broker, "q", 0..10, 20).await;
    let mut consumer = broker.subscribe("q", 3).expect("subscribe");
    let first = recv(&mut consumer).await;
    let second = recv(&mut consumer).await;
    let third = recv(&mut consumer).await;
    consumer.reject(&[second.tag], true);
    consumer.ack(&[first.tag, third.tag]);
    let again = recv(&mut consumer).await;
    assert_eq!(
        seq_of(&again.message.body),
        1,
        "returned message comes before newer ones"
    );
    assert!(again.redelivered);
    assert_eq!(again.delivery_count, 2);
    consumer.ack(&[again.tag]);
    for expected in 3..10 {
        let d = recv(&mut consumer).await;
        assert_eq!(seq_of(&d.message.body), expected);
        consumer.ack(&[d.tag]);
    }
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_without_requeue_dead_letters_with_headers_or_drops() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("dlq", settings(1)).await.expect("declare");
    let with_dl = QueueSettings {
        dead_letter: Some("dlq".into()),
        ..settings(1)
    };
    broker.declare("q", with_dl).await.expect("declare");
    broker.declare("plain", settings(1)).await.expect("declare");
    publish_seq(&broker, "q", 0..2, 20).await;
    publish_seq(&broker, "plain", 0..1, 20).await;
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    let a = recv(&mut consumer).await;
    let b = recv(&mut consumer).await;
    consumer.reject(&[a.tag], false);
    consumer.ack(&[b.tag]);
    let mut dead = broker.subscribe("dlq", 10).expect("subscribe dlq");
    let d = recv(&mut dead).await;
    assert_eq!(seq_of(&d.message.body), 0);
    let header = |k: &str| {
        d.message
            .headers
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("x-death-reason").as_deref(), Some("rejected"));
    assert_eq!(header("x-death-queue").as_deref(), Some("q"));
    dead.ack(&[d.tag]);
    // Without a dead-letter queue the message is dropped.
    let mut plain = broker.subscribe("plain", 10).expect("subscribe");
    let p = recv(&mut plain).await;
    plain.reject(&[p.tag], false);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let info = broker.info("plain").expect("info");
    assert_eq!((info.ready(), info.inflight()), (0, 0));
    assert_idle(&mut plain).await;
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_deliveries_dead_letters() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("dlq", settings(1)).await.expect("declare");
    let s = QueueSettings {
        dead_letter: Some("dlq".into()),
        max_deliveries: Some(3),
        ..settings(1)
    };
    broker.declare("q", s).await.expect("declare");
    publish_seq(&broker, "q", 0..1, 20).await;
    let mut consumer = broker.subscribe("q", 1).expect("subscribe");
    for attempt in 1..=3 {
        let d = recv(&mut consumer).await;
        assert_eq!(d.delivery_count, attempt);
        consumer.reject(&[d.tag], true);
    }
    assert_idle(&mut consumer).await;
    let mut dead = broker.subscribe("dlq", 1).expect("subscribe");
    let d = recv(&mut dead).await;
    assert!(d
        .message
        .headers
        .contains(&("x-death-reason".into(), "max_deliveries".into())));
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_consumer_returns_inflight_ahead_of_newer() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(1)).await.expect("declare");
    publish_seq(&broker, "q", 0..20, 20).await;
    let mut first = broker.subscribe("q", 5).expect("subscribe");
    for _ in 0..5 {
        recv(&mut first).await;
    }
    drop(first);
    let mut second = broker.subscribe("q", 100).expect("subscribe");
    for expected in 0..20 {
        let d = recv(&mut second).await;
        assert_eq!(seq_of(&d.message.body), expected);
        assert_eq!(d.redelivered, expected < 5, "seq {expected}");
        second.ack(&[d.tag]);
    }
    broker.shutdown().await.expect("shutdown");
}

/// A message delivered and not acknowledged before a restart (a crash, or a shutdown with a
/// consumer holding it) comes again flagged `redelivered`, as RabbitMQ flags it: deliveries are
/// not recorded in the log, so every message in it when the node starts may have been
/// delivered. Before, it came again as new (`redelivered` false, delivery count 1), and a
/// consumer could not tell it from a message it had never seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_delivered_before_a_restart_comes_again_flagged_redelivered() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(1)).await.expect("declare");
    publish_seq(&broker, "q", 0..2, 20).await;
    let mut consumer = broker.subscribe("q", 1).expect("subscribe");
    let d = recv(&mut consumer).await;
    assert_eq!(seq_of(&d.message.body), 0);
    assert!(!d.redelivered, "a first delivery");
    // The node stops with the delivery out.
    broker.shutdown().await.expect("shutdown");
    drop(consumer);
    let broker = open(&tmp).await;
    publish_seq(&broker, "q", 2..3, 20).await;
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    for expected in 0..3 {
        let d = recv(&mut consumer).await;
        assert_eq!(seq_of(&d.message.body), expected);
        // 0 was delivered; 1 was in the log when the node started (it may have been: no record
        // says otherwise); 2 came after the start.
        assert_eq!(d.redelivered, expected < 2, "seq {expected}");
        consumer.ack(&[d.tag]);
    }
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_keeps_inflight_and_delete_ends_consumers() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(2)).await.expect("declare");
    publish_seq(&broker, "q", 0..100, 100).await;
    let mut consumer = broker.subscribe("q", 4).expect("subscribe");
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(recv(&mut consumer).await);
    }
    let purged = broker.purge("q").await.expect("purge");
    assert_eq!(purged, 96);
    let info = broker.info("q").expect("info");
    assert_eq!((info.ready(), info.inflight()), (0, 4));
    consumer.ack(&[held[0].tag]);
    consumer.reject(&[held[1].tag], true);
    let again = recv(&mut consumer).await;
    assert_eq!(again.message, held[1].message);
    publish_seq(&broker, "q", 1000..1001, 10).await;
    broker.delete("q").await.expect("delete");
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while consumer.recv().await.is_some() {}
    })
    .await;
    assert!(end.is_ok(), "a deleted queue ends its consumers' streams");
    assert!(matches!(broker.info("q"), Err(BrokerError::NotFound(_))));
    let queues_dir = tmp.path().join("data").join("queues");
    assert_eq!(
        std::fs::read_dir(&queues_dir).expect("ls").count(),
        0,
        "files removed"
    );
    let results = broker.publish("q", vec![Message::new(b"x".to_vec())]).await;
    assert!(matches!(results[0], Err(BrokerError::NotFound(_))));
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_keys_pick_stable_partitions() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(4)).await.expect("declare");
    let keyed: Vec<Message> = (0..40)
        .map(|i| Message {
            routing_key: format!("k{}", i % 3),
            headers: vec![],
            body: body(i, 20),
            producer: None,
        })
        .collect();
    let receipts: Vec<_> = broker
        .publish("q", keyed)
        .await
        .into_iter()
        .map(|r| r.expect("publish"))
        .collect();
    for (i, r) in receipts.iter().enumerate() {
        assert_eq!(
            r.partition,
            receipts[i % 3].partition,
            "same key, same partition"
        );
    }
    publish_seq(&broker, "q", 100..140, 20).await;
    let info = broker.info("q").expect("info");
    assert!(
        info.partitions.iter().all(|p| p.ready >= 10),
        "round robin spreads: {info:?}"
    );
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_redelivers_unacked_and_never_acked() {
    let tmp = tempfile::tempdir().expect("tmp");
    {
        let broker = open(&tmp).await;
        broker.declare("q", settings(2)).await.expect("declare");
        publish_seq(&broker, "q", 0..200, 500).await;
        let mut consumer = broker.subscribe("q", 200).expect("subscribe");
        let mut all = Vec::new();
        for _ in 0..200 {
            all.push(recv(&mut consumer).await);
        }
        // Ack the 100 even messages and the 20 lowest odd ones; 80 stay unacknowledged.
        all.sort_by_key(|d| seq_of(&d.message.body));
        for d in &all {
            let seq = seq_of(&d.message.body);
            if seq.is_multiple_of(2) || seq < 40 {
                consumer.ack(&[d.tag]);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        drop(consumer);
        broker.shutdown().await.expect("shutdown");
    }
    let broker = open(&tmp).await;
    let info = broker.info("q").expect("info after restart");
    assert_eq!(info.ready(), 80);
    let mut consumer = broker.subscribe("q", 100).expect("subscribe");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..80 {
        let d = recv(&mut consumer).await;
        assert!(seen.insert(seq_of(&d.message.body)), "no duplicate");
        consumer.ack(&[d.tag]);
    }
    assert_idle(&mut consumer).await;
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt);
    }
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_settings_are_stored_whole_and_survive_a_restart() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    assert!(broker.node_settings().await.expect("read").is_empty());
    broker.declare("q", settings(1)).await.expect("declare");
    let first: std::collections::BTreeMap<String, serde_json::Value> = [
        (
            "limits.disk.soft_fraction".to_string(),
            serde_json::json!(0.3),
        ),
        ("storage.max_bytes".to_string(), serde_json::json!(1 << 30)),
    ]
    .into_iter()
    .collect();
    broker
        .set_node_settings(first.clone())
        .await
        .expect("store");
    // A later record replaces the whole map: a removed key is gone after a restart.
    let mut second = first.clone();
    second.remove("storage.max_bytes");
    broker
        .set_node_settings(second.clone())
        .await
        .expect("store");
    assert_eq!(broker.node_settings().await.expect("read"), second);
    broker.shutdown().await.expect("shutdown");

    let broker = open(&tmp).await;
    assert_eq!(broker.node_settings().await.expect("read"), second);
    assert_eq!(broker.list().len(), 1, "queues are still there");
    broker.shutdown().await.expect("shutdown");
}

/// An idempotent producer's message without a routing key, published again (a retry after an
/// unknown outcome) on a queue of several partitions, is stored once: the partition it goes to
/// is chosen by its producer and sequence, not by the node's round robin, so the retry meets
/// the first copy's window. Fails if the two copies land on different partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_retry_of_an_idempotent_producer_is_stored_once() {
    use keratin_broker::record::ProducerSeq;
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(4)).await.expect("declare");
    let message = |sequence: u64| Message {
        producer: Some(ProducerSeq {
            producer: 42,
            sequence,
        }),
        ..Message::new(format!("m{sequence}"))
    };
    for sequence in 1..=8 {
        for attempt in 0..3 {
            let results = broker.publish("q", vec![message(sequence)]).await;
            assert!(
                results.iter().all(Result::is_ok),
                "sequence {sequence} attempt {attempt}: {results:?}"
            );
        }
    }
    let info = broker.info("q").expect("info");
    assert_eq!(info.ready(), 8, "each sequence once: {info:?}");
    // Sequences 1 to 8 are in the producer's first block of 64: one partition,
    // (producer + sequence / 64) mod partitions = 42 mod 4 = 2.
    assert_eq!(
        info.partitions.iter().map(|p| p.ready).collect::<Vec<_>>(),
        vec![0, 0, 8, 0],
        "one block, one partition"
    );
    broker.shutdown().await.expect("shutdown");
}

/// An idempotent producer's messages, acknowledged and their segments removed by space
/// reclaim, are still known after a restart: the producer's retries (the same sequences, as
/// after an unknown outcome across the restart) are confirmed without being stored. The log is
/// cut only at a `PRODUCERS` record, which the rebuilt state takes the windows from. Before,
/// the windows of the removed segments were forgotten at the restart and all ten retries were
/// stored again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_reclaim_and_a_restart_is_stored_once() {
    use keratin_broker::record::ProducerSeq;
    const RETRIED: u64 = 10;
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(1)).await.expect("declare");
    let message = |sequence: u64| Message {
        producer: Some(ProducerSeq {
            producer: 42,
            sequence,
        }),
        ..Message::new(format!("m{sequence}"))
    };
    let results = broker
        .publish("q", (1..=RETRIED).map(message).collect())
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // Enough after them to fill several segments, all acknowledged.
    let filler: Vec<Message> = (0..2_000u64)
        .map(|n| Message::new(body(n, 1_000)))
        .collect();
    for batch in filler.chunks(100) {
        for result in broker.publish("q", batch.to_vec()).await {
            result.expect("publish");
        }
    }
    let mut consumer = broker.subscribe("q", 500).expect("subscribe");
    for _ in 0..RETRIED + 2_000 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.recv())
            .await
            .expect("a delivery")
            .expect("open");
        consumer.ack(&[delivery.tag]);
    }
    drop(consumer);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = broker.info("q").expect("info");
        if info.partitions[0].ready == 0 && info.partitions[0].disk_bytes <= 3 * SEGMENT {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the acknowledged segments were not reclaimed: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    broker.shutdown().await.expect("shutdown");

    let broker = open(&tmp).await;
    let results = broker
        .publish("q", (1..=RETRIED).map(message).collect())
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let info = broker.info("q").expect("info");
    assert_eq!(
        info.ready(),
        0,
        "retries of sequences stored before the reclaim were stored again: {info:?}"
    );
    broker.shutdown().await.expect("shutdown");
}

/// Retries written at the start of a segment, before that segment's `PRODUCERS` record, stay
/// duplicates when space reclaim removes the segments before them: the log can only remove
/// whole segments, so a cut at the record leaves it starting at the segment's base, and a
/// state rebuilt from there met the retries before any window and counted them as new
/// messages (delivered once more after a restart, while the live state held none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_before_a_producers_record_in_the_tail_segment_stay_duplicates_after_reclaim() {
    use keratin_broker::record::ProducerSeq;
    const RETRIED: u64 = 50;
    // Fifty messages of 4.5 KiB: about 0.9 of a segment, so that the retried batch never fits
    // behind the first one and starts a segment of its own.
    let message = |sequence: u64| Message {
        producer: Some(ProducerSeq {
            producer: 42,
            sequence,
        }),
        ..Message::new(body(sequence, 4_608))
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker.declare("q", settings(1)).await.expect("declare");
    let first = broker
        .publish("q", (1..=RETRIED).map(message).collect())
        .await;
    assert!(first.iter().all(Result::is_ok), "{first:?}");
    let mut consumer = broker.subscribe("q", 500).expect("subscribe");
    for _ in 0..RETRIED {
        let delivery = recv(&mut consumer).await;
        consumer.ack(&[delivery.tag]);
    }
    drop(consumer);
    wait_for(&broker, "the acks", |info| {
        info.ready() + info.inflight() == 0
    })
    .await;
    // The retry of every sequence (an unknown outcome, say): confirmed, stored as duplicates.
    let retried = broker
        .publish("q", (1..=RETRIED).map(message).collect())
        .await;
    assert!(retried.iter().all(Result::is_ok), "{retried:?}");
    assert_eq!(broker.info("q").expect("info").ready(), 0, "duplicates");
    // The first segment goes once the producers' windows are written behind the retries.
    wait_for(&broker, "reclaim of the first segment", |info| {
        info.partitions[0].disk_bytes <= SEGMENT
    })
    .await;
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt, "the state rebuilt from the log differs");
    }
    broker.shutdown().await.expect("shutdown");

    let broker = open(&tmp).await;
    let info = broker.info("q").expect("info");
    assert_eq!(
        info.ready(),
        0,
        "retries confirmed as duplicates are messages after the restart: {info:?}"
    );
    broker.shutdown().await.expect("shutdown");
}

/// Waits up to 10 s for `done` to hold of queue `name`'s info.
async fn wait_for(
    broker: &keratin_broker::Broker,
    what: &str,
    done: impl Fn(&keratin_broker::QueueInfo) -> bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = broker.info("q").expect("info");
        if done(&info) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 10 s: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
