//! Dead-lettering is at least once: a message whose copy the dead-letter queue cannot take
//! (not declared, or full with `reject`) stays in the source queue, held (neither ready nor
//! inflight), and is tried again until the dead-letter queue takes it; each failed attempt is
//! counted by reason, for metrics and attention items. A failure means a held message was lost
//! or dropped (it never reached the dead-letter queue once it could), delivered again while
//! held, or that a failure left no trace in the queue's figures.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use keratin_broker::{Broker, DeadLetterFailure, QueueSettings};

/// Reject (without requeue) `count` messages of `queue`; the consumer is returned, so that a
/// message delivered again would show.
async fn reject_all(broker: &Broker, queue: &str, count: u64) -> keratin_broker::Consumer {
    publish_seq(broker, queue, 0..count, 100).await;
    let mut consumer = broker.subscribe(queue, 100).expect("subscribe");
    for _ in 0..count {
        let d = recv(&mut consumer).await;
        consumer.reject(&[d.tag], false);
    }
    consumer
}

fn held(broker: &Broker, queue: &str) -> u64 {
    let info = broker.info(queue).expect("info");
    info.partitions.iter().map(|p| p.dead_letters_held).sum()
}

fn failures_of(broker: &Broker, queue: &str) -> BTreeMap<DeadLetterFailure, u64> {
    broker.info(queue).expect("info").dead_letter_failures()
}

/// Waits until `queue` holds `count` messages for dead-lettering, none ready or inflight.
async fn wait_held(broker: &Broker, queue: &str, count: u64) {
    assert!(
        wait_until(Duration::from_secs(5), || {
            let info = broker.info(queue).expect("info");
            held(broker, queue) == count && info.ready() + info.inflight() == 0
        })
        .await,
        "{queue} holds {count} dead letters: {:?}",
        broker.info(queue)
    );
}

/// Drains `queue`: the sequence numbers of its messages, sorted.
async fn drain(broker: &Broker, queue: &str, count: usize) -> Vec<u64> {
    let mut consumer = broker.subscribe(queue, 100).expect("subscribe");
    let mut seqs = Vec::new();
    for _ in 0..count {
        let d = recv(&mut consumer).await;
        seqs.push(seq_of(&d.message.body));
        consumer.ack(&[d.tag]);
    }
    assert_idle(&mut consumer).await;
    seqs.sort_unstable();
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeliverable_dead_letters_are_held_counted_and_delivered_once_possible() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    // A dead-letter queue that is not declared yet.
    let missing = QueueSettings {
        dead_letter: Some("later".into()),
        ..QueueSettings::default()
    };
    broker.declare("orphan", missing).await.expect("declare");
    let mut consumer = reject_all(&broker, "orphan", 3).await;
    wait_held(&broker, "orphan", 3).await;
    assert!(
        wait_until(Duration::from_secs(5), || {
            failures_of(&broker, "orphan")
                .get(&DeadLetterFailure::NotFound)
                .is_some_and(|n| *n >= 3)
        })
        .await,
        "not_found counted: {:?}",
        failures_of(&broker, "orphan")
    );
    // Held messages are not delivered again.
    assert_idle(&mut consumer).await;
    // Declared now: the next retry (at most 5 s away) moves them there.
    broker
        .declare("later", QueueSettings::default())
        .await
        .expect("declare");
    assert!(
        wait_until(Duration::from_secs(10), || {
            broker.info("later").expect("info").ready() == 3
        })
        .await,
        "the held messages reach the dead-letter queue once it exists"
    );
    wait_held(&broker, "orphan", 0).await;
    assert_eq!(drain(&broker, "later", 3).await, vec![0, 1, 2]);
    drop(consumer);

    // A full dead-letter queue (one message, overflow reject): one lands, two wait.
    let tiny = QueueSettings {
        max_messages: Some(1),
        ..QueueSettings::default()
    };
    broker.declare("dlq", tiny).await.expect("declare");
    let to_dlq = QueueSettings {
        dead_letter: Some("dlq".into()),
        ..QueueSettings::default()
    };
    broker.declare("source", to_dlq).await.expect("declare");
    let consumer = reject_all(&broker, "source", 3).await;
    wait_held(&broker, "source", 2).await;
    assert!(
        wait_until(Duration::from_secs(5), || {
            failures_of(&broker, "source")
                .get(&DeadLetterFailure::QueueFull)
                .is_some_and(|n| *n >= 2)
        })
        .await,
        "queue_full counted: {:?}",
        failures_of(&broker, "source")
    );
    assert_eq!(broker.info("dlq").expect("info").ready(), 1);
    // Each message consumed from the dead-letter queue makes room for the next held one.
    let mut got = Vec::new();
    let mut dead = broker.subscribe("dlq", 1).expect("subscribe");
    for _ in 0..3 {
        let d = tokio::time::timeout(Duration::from_secs(10), dead.recv())
            .await
            .expect("a dead letter within 10 s")
            .expect("open");
        got.push(seq_of(&d.message.body));
        dead.ack(&[d.tag]);
    }
    got.sort_unstable();
    assert_eq!(got, vec![0, 1, 2], "every rejected message, once");
    wait_held(&broker, "source", 0).await;
    drop((consumer, dead));
    broker.shutdown().await.expect("shutdown");
}

/// Unsetting the dead-letter queue drops what was held for it, as a reject without one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_dead_letters_drop_when_the_dead_letter_queue_is_unset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    let missing = QueueSettings {
        dead_letter: Some("nowhere".into()),
        ..QueueSettings::default()
    };
    broker.declare("q", missing).await.expect("declare");
    let consumer = reject_all(&broker, "q", 4).await;
    wait_held(&broker, "q", 4).await;
    broker
        .set_queue_settings("q", QueueSettings::default())
        .await
        .expect("unset the dead-letter queue");
    assert!(
        wait_until(Duration::from_secs(5), || {
            let info = broker.info("q").expect("info");
            held(&broker, "q") == 0 && info.ready() + info.inflight() == 0 && info.bytes() == 0
        })
        .await,
        "dropped: {:?}",
        broker.info("q")
    );
    drop(consumer);
    broker.shutdown().await.expect("shutdown");
}
