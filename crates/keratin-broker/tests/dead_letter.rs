//! A message whose dead-lettering fails is dropped (the partition cannot keep a rejected
//! message forever), but never silently: each one is counted by reason, for metrics and
//! attention items. A failure means a dead-letter failure left no trace in the queue's figures.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use keratin_broker::{Broker, DeadLetterFailure, QueueSettings};

/// Reject (without requeue) `count` messages of `queue`.
async fn reject_all(broker: &Broker, queue: &str, count: u64) {
    publish_seq(broker, queue, 0..count, 100).await;
    let mut consumer = broker.subscribe(queue, 100).expect("subscribe");
    for _ in 0..count {
        let d = recv(&mut consumer).await;
        consumer.reject(&[d.tag], false);
    }
    assert!(
        wait_until(Duration::from_secs(5), || {
            let info = broker.info(queue).expect("info");
            info.ready() + info.inflight() == 0
        })
        .await,
        "the rejected messages left {queue}"
    );
}

async fn failures_of(broker: &Broker, queue: &str) -> BTreeMap<DeadLetterFailure, u64> {
    // The count is taken when the dead-letter publish answers, after the messages left.
    let mut failures = BTreeMap::new();
    wait_until(Duration::from_secs(5), || {
        failures = broker.info(queue).expect("info").dead_letter_failures();
        !failures.is_empty()
    })
    .await;
    failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_failures_are_counted_by_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = open(&dir).await;
    // A dead-letter queue that was never declared.
    let missing = QueueSettings {
        dead_letter: Some("missing".into()),
        ..QueueSettings::default()
    };
    broker.declare("orphan", missing).await.expect("declare");
    reject_all(&broker, "orphan", 3).await;
    assert_eq!(
        failures_of(&broker, "orphan").await,
        BTreeMap::from([(DeadLetterFailure::NotFound, 3)])
    );
    // A full dead-letter queue (one message, overflow reject): one lands, two are refused.
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
    publish_seq(&broker, "source", 0..3, 100).await;
    let mut consumer = broker.subscribe("source", 10).expect("subscribe");
    for _ in 0..3 {
        // One at a time, so that each dead-letter publish is its own batch.
        let d = recv(&mut consumer).await;
        consumer.reject(&[d.tag], false);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(consumer);
    assert!(
        wait_until(Duration::from_secs(5), || {
            broker
                .info("source")
                .expect("info")
                .dead_letter_failures()
                .get(&DeadLetterFailure::QueueFull)
                == Some(&2)
        })
        .await,
        "two queue_full failures: {:?}",
        broker.info("source").expect("info").dead_letter_failures()
    );
    assert_eq!(broker.info("dlq").expect("info").ready(), 1);
    broker.shutdown().await.expect("shutdown");
}
