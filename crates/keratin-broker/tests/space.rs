//! Acknowledged data frees disk, whatever the ack pattern, without changing delivery order.
//!
//! The adversarial case: 200,000 messages, every one acknowledged except every 1,000th, which a
//! live consumer holds forever. Those 200 messages are spread over every segment, so prefix
//! removal alone frees nothing; the partition must relocate them to the head until its disk use
//! is at most 2 × live bytes + 2 segments. When the consumer goes away the 200 messages must come
//! back in their original order with their bodies intact, and the live state must equal the
//! state rebuilt from the log. The test fails if reclaim stalls above the bound, if relocation
//! loses, duplicates, reorders or corrupts a message, or if relocation records rebuild to a
//! different state.
//!
//! Purge and delete free space the same way: after a purge the log shrinks to the bound, and
//! after a delete the queue's files are gone (handed to the pool, whose spares stay within its
//! budget).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use keratin_broker::{
    Broker, BrokerConfig, Message, PartitionInfo, QueueSettings, RELOCATION_BYTES_MAX,
};

const MESSAGES: u64 = 200_000;
const BODY_BYTES: usize = 100;
/// One message in this many is never acknowledged.
const KEEP_EVERY: u64 = 1_000;
const BATCH: u64 = 1_000;

/// The bound of the issue for one partition.
fn within_bound(p: &PartitionInfo) -> bool {
    p.disk_bytes <= 2 * p.bytes + 2 * SEGMENT
}

async fn publish_many(broker: &Broker, queue: &str, count: u64) {
    let mut seq = 0;
    while seq < count {
        let end = (seq + BATCH).min(count);
        let messages: Vec<Message> = (seq..end)
            .map(|s| Message::new(body(s, BODY_BYTES)))
            .collect();
        for result in broker.publish(queue, messages).await {
            result.expect("publish");
        }
        seq = end;
    }
}

async fn wait_for_bound(broker: &Broker, queue: &str, what: &str) -> PartitionInfo {
    let started = Instant::now();
    let settled = wait_until(Duration::from_secs(60), || {
        let info = broker.info(queue).expect("info");
        within_bound(&info.partitions[0])
    })
    .await;
    let p = broker.info(queue).expect("info").partitions[0].clone();
    assert!(
        settled,
        "{what}: disk use {} bytes stays above 2 × {} live bytes + 2 segments of {SEGMENT}",
        p.disk_bytes, p.bytes
    );
    eprintln!(
        "{what}: {} disk bytes for {} live bytes, settled in {:.1?}",
        p.disk_bytes,
        p.bytes,
        started.elapsed()
    );
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_unacked_messages_do_not_pin_the_log_nor_change_order() {
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    let started = Instant::now();
    publish_many(&broker, "q", MESSAGES).await;
    let peak = broker.info("q").expect("info").disk_bytes();
    eprintln!(
        "published {MESSAGES} in {:.1?}: {peak} disk bytes",
        started.elapsed()
    );

    let mut consumer = broker.subscribe("q", 1_000).expect("subscribe");
    let mut held = Vec::new();
    for expected in 0..MESSAGES {
        let d = recv(&mut consumer).await;
        assert_eq!(
            seq_of(&d.message.body),
            expected,
            "first deliveries in order"
        );
        if expected % KEEP_EVERY == 0 {
            held.push(d.tag);
        } else {
            consumer.ack(&[d.tag]);
        }
    }
    eprintln!("consumed in {:.1?}", started.elapsed());
    // Every ack is applied first (a round of acks is written as records of at most 4,096
    // entries; the owner may still be working through them), then the bound must hold.
    let held_count = MESSAGES / KEEP_EVERY;
    let acked = wait_until(Duration::from_secs(60), || {
        broker.info("q").expect("info").partitions[0].inflight == held_count
    })
    .await;
    assert!(acked, "acks were not applied");
    let p = wait_for_bound(&broker, "q", "200 held messages").await;
    assert_eq!(p.inflight, MESSAGES / KEEP_EVERY);
    assert!(p.disk_bytes < peak / 10, "most of the log was freed");
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt, "relocations rebuild to the live state");
    }

    // The held messages come back in their original order, with their bodies.
    drop(consumer);
    let mut again = broker.subscribe("q", 1_000).expect("subscribe");
    for (i, tag) in held.iter().enumerate() {
        let d = recv(&mut again).await;
        assert_eq!(d.tag, *tag, "same message id, same place in the order");
        assert_eq!(seq_of(&d.message.body), i as u64 * KEEP_EVERY);
        assert_eq!(d.message.body, body(i as u64 * KEEP_EVERY, BODY_BYTES));
        assert!(d.redelivered);
        again.ack(&[d.tag]);
    }
    assert_idle(&mut again).await;
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt);
    }
    assert!(
        wait_until(Duration::from_secs(10), || {
            let info = broker.info("q").expect("info");
            info.bytes() == 0 && within_bound(&info.partitions[0])
        })
        .await
    );
    broker.shutdown().await.expect("shutdown");

    // And the same after a restart: nothing comes back.
    let broker = open(&tmp).await;
    assert_eq!(broker.info("q").expect("info").ready(), 0);
    broker.shutdown().await.expect("shutdown");
}

/// Relocation reads take from the node's relocation budget: while something else holds all of
/// it, a partition pinned by a few held messages frees nothing; once it is given back,
/// relocation runs and the partition reaches the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relocation_waits_while_the_nodes_relocation_budget_is_taken() {
    const COUNT: u64 = 20_000;
    let tmp = tempfile::tempdir().expect("tmp");
    let broker = open(&tmp).await;
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    let taken = broker
        .relocation_budget()
        .try_take(RELOCATION_BYTES_MAX)
        .expect("the whole relocation budget");
    publish_many(&broker, "q", COUNT).await;
    let mut consumer = broker.subscribe("q", 1_000).expect("subscribe");
    for expected in 0..COUNT {
        let d = recv(&mut consumer).await;
        assert_eq!(seq_of(&d.message.body), expected);
        if expected % KEEP_EVERY != 0 {
            consumer.ack(&[d.tag]);
        }
    }
    let held = COUNT / KEEP_EVERY;
    assert!(
        wait_until(Duration::from_secs(60), || {
            broker.info("q").expect("info").partitions[0].inflight == held
        })
        .await,
        "acks were not applied"
    );
    // Reclaim gets every chance for two seconds, and relocation cannot run.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pinned = broker.info("q").expect("info").partitions[0].clone();
    assert!(
        !within_bound(&pinned),
        "with the relocation budget taken the log stays pinned: {} disk bytes for {} live",
        pinned.disk_bytes,
        pinned.bytes
    );
    drop(taken);
    wait_for_bound(&broker, "q", "relocation budget given back").await;
    assert!(
        wait_until(Duration::from_secs(10), || broker
            .relocation_budget()
            .used_bytes()
            == 0)
        .await,
        "every relocation round gave its bytes back"
    );
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt, "relocations rebuild to the live state");
    }
    drop(consumer);
    broker.shutdown().await.expect("shutdown");
}

/// Total size of the files under `dir`.
fn du(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).expect("ls").flatten() {
        let meta = entry.metadata().expect("stat");
        total += if meta.is_dir() {
            du(&entry.path())
        } else {
            meta.len()
        };
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_delete_free_space() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    // A small spare budget, so that freed segments beyond it go back to the file system.
    let budget = 4 * SEGMENT;
    let config = BrokerConfig {
        spare_budget_bytes: Some(budget),
        ..config(data.clone())
    };
    let broker = Broker::open(config).await.expect("open");
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    publish_many(&broker, "q", 40_000).await;
    let full = broker.info("q").expect("info").disk_bytes();
    assert!(full > 10 * SEGMENT, "the workload spans many segments");
    assert_eq!(broker.purge("q").await.expect("purge"), 40_000);
    wait_for_bound(&broker, "q", "purge").await;
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt);
    }

    publish_many(&broker, "q", 40_000).await;
    let before = du(&data);
    broker.delete("q").await.expect("delete");
    let after = du(&data);
    eprintln!("delete: {before} bytes under the data directory before, {after} after");
    assert!(
        std::fs::read_dir(data.join("queues")).expect("ls").count() == 0,
        "the queue's directory is gone"
    );
    let spares: u64 = broker
        .pool()
        .filesystems()
        .iter()
        .map(|fs| fs.spare_bytes)
        .sum();
    assert!(
        spares <= budget,
        "pool spares {spares} within budget {budget}"
    );
    assert!(
        after + 8 * SEGMENT < before,
        "a delete frees the queue's segments: {before} -> {after} bytes"
    );
    broker.shutdown().await.expect("shutdown");
}
