//! Per-queue limits (`max_messages`, `max_bytes`) with `reject` and `drop_oldest` overflow:
//! exact admission, all-or-nothing batches, inflight messages never dropped, dead-lettering of
//! dropped messages, limits across partitions, across a restart and changed on a live queue, and
//! a full dead-letter queue. A failure means a queue held more than its limit, dropped a message
//! it must keep, or lost its limits.

mod common;

use common::*;
use keratin_broker::{BrokerError, Message, Overflow, QueueSettings};

fn limited(max_messages: Option<u64>, max_bytes: Option<u64>, overflow: Overflow) -> QueueSettings {
    QueueSettings {
        max_messages,
        max_bytes,
        overflow: Some(overflow),
        ..QueueSettings::default()
    }
}

async fn publish_one(
    broker: &keratin_broker::Broker,
    queue: &str,
    seq: u64,
) -> Result<(), BrokerError> {
    broker
        .publish(queue, vec![Message::new(body(seq, 100))])
        .await
        .remove(0)
        .map(|_| ())
}

fn is_queue_full(e: &BrokerError) -> bool {
    matches!(e, BrokerError::Limited { reason, retry_after_ms, .. } if reason == "queue_full" && *retry_after_ms > 0)
}

async fn drain_seqs(broker: &keratin_broker::Broker, queue: &str, n: usize) -> Vec<u64> {
    let mut consumer = broker.subscribe(queue, 1000).expect("subscribe");
    let mut out = Vec::new();
    for _ in 0..n {
        let d = recv(&mut consumer).await;
        out.push(seq_of(&d.message.body));
        consumer.ack(&[d.tag]);
    }
    assert_idle(&mut consumer).await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_admits_exactly_the_limit_and_room_reopens() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("q", limited(Some(10), None, Overflow::Reject))
        .await
        .expect("declare");
    for seq in 0..10 {
        publish_one(&broker, "q", seq)
            .await
            .expect("within the limit");
    }
    let err = publish_one(&broker, "q", 10).await.expect_err("full");
    assert!(is_queue_full(&err), "{err}");
    assert!(err.to_string().contains("full"), "{err}");
    let info = broker.info("q").expect("info");
    assert_eq!(info.ready(), 10);
    assert!(info.partitions[0].full);
    assert_eq!(info.partitions[0].rejected_full, 1);
    // A batch that does not fit whole is refused whole.
    let mut consumer = broker.subscribe("q", 3).expect("subscribe");
    let mut tags = Vec::new();
    for _ in 0..3 {
        tags.push(recv(&mut consumer).await.tag);
    }
    consumer.ack(&tags);
    drop(consumer);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !broker.info("q").expect("info").partitions[0].full,
        "a partition with room again is no longer full"
    );
    let batch: Vec<Message> = (100..104).map(|s| Message::new(body(s, 100))).collect();
    let results = broker.publish("q", batch).await;
    assert!(
        results.iter().all(|r| r.as_ref().is_err_and(is_queue_full)),
        "{results:?}"
    );
    for seq in 10..13 {
        publish_one(&broker, "q", seq)
            .await
            .expect("room after consuming");
    }
    assert!(publish_one(&broker, "q", 13).await.is_err());
    assert_eq!(
        drain_seqs(&broker, "q", 10).await,
        (3..13).collect::<Vec<_>>()
    );
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_bytes_counts_payload_bytes() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    // Each payload is the 100-byte body plus a 5-byte message header.
    broker
        .declare("q", limited(None, Some(5 * 105), Overflow::Reject))
        .await
        .expect("declare");
    for seq in 0..5 {
        publish_one(&broker, "q", seq).await.expect("fits");
    }
    assert!(is_queue_full(
        &publish_one(&broker, "q", 5).await.expect_err("full")
    ));
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_oldest_keeps_the_newest_and_dead_letters_the_dropped() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("plain", limited(Some(10), None, Overflow::DropOldest))
        .await
        .expect("declare");
    for seq in 0..15 {
        publish_one(&broker, "plain", seq)
            .await
            .expect("drop_oldest admits");
    }
    let info = broker.info("plain").expect("info");
    assert_eq!(info.ready(), 10);
    assert_eq!(info.partitions[0].overflowed, 5);
    assert_eq!(
        drain_seqs(&broker, "plain", 10).await,
        (5..15).collect::<Vec<_>>()
    );

    broker
        .declare("dlq", QueueSettings::default())
        .await
        .expect("dlq");
    let with_dl = QueueSettings {
        dead_letter: Some("dlq".into()),
        ..limited(Some(3), None, Overflow::DropOldest)
    };
    broker.declare("q", with_dl).await.expect("declare");
    for seq in 0..5 {
        publish_one(&broker, "q", seq).await.expect("admit");
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut dead = broker.subscribe("dlq", 10).expect("subscribe");
    for expected in 0..2 {
        let d = recv(&mut dead).await;
        assert_eq!(seq_of(&d.message.body), expected);
        assert!(d
            .message
            .headers
            .contains(&("x-death-reason".into(), "overflow".into())));
        dead.ack(&[d.tag]);
    }
    assert_eq!(drain_seqs(&broker, "q", 3).await, vec![2, 3, 4]);
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_messages_are_never_dropped() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    // Only inflight messages: drop_oldest refuses like reject.
    broker
        .declare("all-inflight", limited(Some(2), None, Overflow::DropOldest))
        .await
        .expect("declare");
    publish_one(&broker, "all-inflight", 0)
        .await
        .expect("admit");
    publish_one(&broker, "all-inflight", 1)
        .await
        .expect("admit");
    let mut holder = broker.subscribe("all-inflight", 2).expect("subscribe");
    recv(&mut holder).await;
    recv(&mut holder).await;
    let err = publish_one(&broker, "all-inflight", 2)
        .await
        .expect_err("only inflight remain");
    assert!(is_queue_full(&err), "{err}");

    // Three inflight, two ready: each publish drops the oldest ready message, never an
    // inflight one.
    broker
        .declare("q", limited(Some(5), None, Overflow::DropOldest))
        .await
        .expect("declare");
    for seq in 0..5 {
        publish_one(&broker, "q", seq).await.expect("admit");
    }
    let mut consumer = broker.subscribe("q", 3).expect("subscribe");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(recv(&mut consumer).await);
    }
    for seq in 5..8 {
        publish_one(&broker, "q", seq)
            .await
            .expect("drops a ready one");
    }
    assert_eq!(broker.info("q").expect("info").partitions[0].overflowed, 3);
    let held_seqs: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
    assert_eq!(held_seqs, vec![0, 1, 2]);
    consumer.ack(&held.iter().map(|d| d.tag).collect::<Vec<_>>());
    let mut rest = Vec::new();
    for _ in 0..2 {
        let d = recv(&mut consumer).await;
        rest.push(seq_of(&d.message.body));
        consumer.ack(&[d.tag]);
    }
    assert_eq!(rest, vec![6, 7], "the oldest ready ones (3, 4, 5) went");
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_shared_by_partitions_and_survive_a_restart() {
    let tmp = tempfile::tempdir().expect("tmp");
    {
        let broker = open(&tmp).await;
        let s = QueueSettings {
            partitions: 2,
            ..limited(Some(10), None, Overflow::Reject)
        };
        broker.declare("q", s).await.expect("declare");
        let mut accepted = 0;
        for seq in 0..30 {
            if publish_one(&broker, "q", seq).await.is_ok() {
                accepted += 1;
            }
        }
        assert_eq!(accepted, 10, "5 per partition");
        broker.shutdown().await.expect("shutdown");
    }
    let broker = open(&tmp).await;
    assert_eq!(
        broker.info("q").expect("info").settings.max_messages,
        Some(10)
    );
    assert!(is_queue_full(
        &publish_one(&broker, "q", 99).await.expect_err("still full")
    ));
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_change_on_a_live_queue() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("q", limited(Some(10), None, Overflow::Reject))
        .await
        .expect("declare");
    for seq in 0..10 {
        publish_one(&broker, "q", seq).await.expect("admit");
    }
    // Lowering a reject limit drops nothing.
    broker
        .set_queue_settings("q", limited(Some(4), None, Overflow::Reject))
        .await
        .expect("set");
    assert_eq!(broker.info("q").expect("info").ready(), 10);
    assert!(publish_one(&broker, "q", 10).await.is_err());
    // Switching to drop_oldest trims the ready ones down to the limit.
    broker
        .set_queue_settings("q", limited(Some(4), None, Overflow::DropOldest))
        .await
        .expect("set");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(broker.info("q").expect("info").ready(), 4);
    // Raising it makes room; removing it lifts the limit.
    broker
        .set_queue_settings("q", QueueSettings::default())
        .await
        .expect("set");
    for seq in 10..30 {
        publish_one(&broker, "q", seq).await.expect("unlimited");
    }
    let partitions_change = QueueSettings {
        partitions: 3,
        ..QueueSettings::default()
    };
    assert!(broker
        .set_queue_settings("q", partitions_change)
        .await
        .is_err());
    let mut expected: Vec<u64> = (6..10).collect();
    expected.extend(10..30);
    assert_eq!(drain_seqs(&broker, "q", 24).await, expected);
    broker.shutdown().await.expect("shutdown");
}

/// A `drop_oldest` queue whose dead-letter queue is full (`reject`) holds what it removed
/// until the dead-letter queue has room: dead-lettering is at least once, and the queue's
/// limit still holds (the held message no longer counts toward it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_dead_letter_queue_holds_what_it_cannot_take_until_it_has_room() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("dlq", limited(Some(1), None, Overflow::Reject))
        .await
        .expect("dlq");
    let s = QueueSettings {
        dead_letter: Some("dlq".into()),
        ..limited(Some(1), None, Overflow::DropOldest)
    };
    broker.declare("q", s).await.expect("declare");
    for seq in 0..3 {
        publish_one(&broker, "q", seq).await.expect("admit");
    }
    // The dead-letter queue took the first overflow (0); the second (1) found it full and is
    // held; the queue holds the newest (2), ready.
    let held = |broker: &keratin_broker::Broker| -> u64 {
        let info = broker.info("q").expect("info");
        info.partitions.iter().map(|p| p.dead_letters_held).sum()
    };
    assert!(
        wait_until(std::time::Duration::from_secs(5), || held(&broker) == 1).await,
        "one held: {:?}",
        broker.info("q")
    );
    assert_eq!(broker.info("q").expect("info").ready(), 1);
    assert_eq!(drain_seqs(&broker, "q", 1).await, vec![2]);
    // Room in the dead-letter queue: the held one follows (retried within 5 s).
    let mut dead = broker.subscribe("dlq", 1).expect("subscribe");
    let mut got = Vec::new();
    for _ in 0..2 {
        let d = tokio::time::timeout(std::time::Duration::from_secs(10), dead.recv())
            .await
            .expect("a dead letter within 10 s")
            .expect("open");
        got.push(seq_of(&d.message.body));
        dead.ack(&[d.tag]);
    }
    assert_eq!(got, vec![0, 1]);
    assert!(wait_until(std::time::Duration::from_secs(5), || held(&broker) == 0).await);
    drop(dead);
    broker.shutdown().await.expect("shutdown");
}

async fn assert_states_match(broker: &keratin_broker::Broker, queue: &str) {
    for (live, rebuilt) in broker.check_states(queue).await.expect("states") {
        assert_eq!(
            live, rebuilt,
            "live state differs from the state rebuilt from the log"
        );
    }
}

/// A burst of single publishes, more than the limit, all handed over before the first is
/// durable: `drop_oldest` is a ring buffer, so every one is confirmed and the queue ends with
/// the newest `max_messages`, the older ones dropped (dead-lettered when the queue has a
/// dead-letter queue). Before the fix the publishes admitted and not yet applied counted
/// toward the limit but could not be dropped, so most of the burst was refused as
/// `queue_full`. A batch that fits the limit on its own is accepted behind such a burst too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_into_drop_oldest_keeps_the_newest() {
    const LIMIT: u64 = 5;
    const BURST: u64 = 40;
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("dlq", QueueSettings::default())
        .await
        .expect("dlq");
    let with_dl = QueueSettings {
        dead_letter: Some("dlq".into()),
        ..limited(Some(LIMIT), None, Overflow::DropOldest)
    };
    broker
        .declare("plain", limited(Some(LIMIT), None, Overflow::DropOldest))
        .await
        .expect("declare");
    broker.declare("with-dl", with_dl).await.expect("declare");
    for queue in ["plain", "with-dl"] {
        // Every publish is handed to the partition before any is awaited.
        let mut pending: Vec<_> = (0..BURST)
            .map(|seq| broker.publish_dispatch(queue, vec![Message::new(body(seq, 100))]))
            .collect();
        // Behind the burst, a batch of the limit's size: it fits on its own.
        let batch = (BURST..BURST + LIMIT)
            .map(|seq| Message::new(body(seq, 100)))
            .collect();
        pending.push(broker.publish_dispatch(queue, batch));
        let mut refused = Vec::new();
        for (i, p) in pending.into_iter().enumerate() {
            for result in p.wait().await {
                if let Err(e) = result {
                    refused.push((i, e.to_string()));
                }
            }
        }
        assert!(
            refused.is_empty(),
            "{queue}: {} of {} messages refused, first {:?}",
            refused.len(),
            BURST + LIMIT,
            refused.first()
        );
        // The drops a publish owed are made before it is confirmed.
        let total = BURST + LIMIT;
        let info = broker.info(queue).expect("info");
        assert_eq!(
            (info.ready(), info.partitions[0].overflowed),
            (LIMIT, total - LIMIT),
            "{queue}: {info:?}"
        );
        assert_states_match(&broker, queue).await;
        assert_eq!(
            drain_seqs(&broker, queue, LIMIT as usize).await,
            (total - LIMIT..total).collect::<Vec<_>>()
        );
    }
    // Every message dropped from the queue with a dead-letter queue went there (drops of
    // separate rounds are dead-lettered by separate tasks, so their order is not checked).
    let mut dead = broker.subscribe("dlq", 1000).expect("subscribe");
    let mut dead_seqs = Vec::new();
    for _ in 0..BURST {
        let d = recv(&mut dead).await;
        dead_seqs.push(seq_of(&d.message.body));
        assert!(d
            .message
            .headers
            .contains(&("x-death-reason".into(), "overflow".into())));
        dead.ack(&[d.tag]);
    }
    assert_idle(&mut dead).await;
    dead_seqs.sort_unstable();
    assert_eq!(dead_seqs, (0..BURST).collect::<Vec<_>>());
    assert_states_match(&broker, "with-dl").await;
    broker.shutdown().await.expect("shutdown");
}

/// A burst into a `drop_oldest` queue whose consumer holds messages: the held (inflight)
/// messages are never dropped, every single publish is confirmed (it fits beside them), and a
/// batch that does not fit beside them is refused and drops nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_never_drops_inflight_messages() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("q", limited(Some(5), None, Overflow::DropOldest))
        .await
        .expect("declare");
    for seq in 0..5 {
        publish_one(&broker, "q", seq).await.expect("admit");
    }
    let mut consumer = broker.subscribe("q", 3).expect("subscribe");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(recv(&mut consumer).await);
    }
    let singles: Vec<_> = (5..15)
        .map(|seq| broker.publish_dispatch("q", vec![Message::new(body(seq, 100))]))
        .collect();
    // Three held plus three is over the limit, whatever is dropped.
    let batch = (15..18).map(|seq| Message::new(body(seq, 100))).collect();
    let batch = broker.publish_dispatch("q", batch);
    for single in singles {
        for result in single.wait().await {
            result.expect("a single publish fits beside the held messages");
        }
    }
    for result in batch.wait().await {
        let err = result.expect_err("the batch does not fit beside the held messages");
        assert!(is_queue_full(&err), "{err}");
    }
    let info = broker.info("q").expect("info");
    assert_eq!(
        (info.ready(), info.partitions[0].overflowed),
        (2, 10),
        "{info:?}"
    );
    assert_states_match(&broker, "q").await;
    let held_seqs: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
    assert_eq!(held_seqs, vec![0, 1, 2]);
    consumer.ack(&held.iter().map(|d| d.tag).collect::<Vec<_>>());
    let mut rest = Vec::new();
    for _ in 0..2 {
        let d = recv(&mut consumer).await;
        rest.push(seq_of(&d.message.body));
        consumer.ack(&[d.tag]);
    }
    assert_eq!(rest, vec![13, 14], "the newest singles stay");
    assert_idle(&mut consumer).await;
    broker.shutdown().await.expect("shutdown");
}
