//! The delivery byte budgets (issue 12, "Memory"): the node-wide budget of delivery bytes held
//! in memory, a connection's outbound budget and a consumer's byte prefetch. Deliveries wait for
//! room and resume when bytes come back (a dropped permit, an ack); a consumer whose connection
//! holds its budget does not stop the others; a message larger than a budget still goes out,
//! alone; nothing is lost or duplicated. A failure shows as a delivery that never comes (a lost
//! wake-up), more bytes held than a budget allows, or a message missing at the end.
//! Also the node's bound on declared partitions (what a client declaring queues in a loop
//! meets): a failure shows as a declare accepted past the bound.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use keratin_broker::{Broker, ByteBudget, Consumer, Delivery, QueueSettings, SubscribeOptions};

const KB: usize = 1000;

async fn open_with_budget(dir: &tempfile::TempDir, delivery_bytes_max: u64) -> Broker {
    let mut config = config(dir.path().join("data"));
    config.delivery_bytes_max = delivery_bytes_max;
    Broker::open(config).await.expect("open broker")
}

async fn declare(broker: &Broker, partitions: u32) {
    broker
        .declare(
            "q",
            QueueSettings {
                partitions,
                ..QueueSettings::default()
            },
        )
        .await
        .expect("declare");
}

async fn try_recv_within(consumer: &mut Consumer, wait: Duration) -> Option<Delivery> {
    tokio::time::timeout(wait, consumer.recv())
        .await
        .ok()
        .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_holds_only_its_budget_and_others_keep_receiving() {
    let dir = tempfile::tempdir().expect("tmp");
    let broker = open_with_budget(&dir, 1_000 * KB as u64).await;
    declare(&broker, 2).await;
    publish_seq(&broker, "q", 0..60, 100 * KB).await;
    let stalled_budget = ByteBudget::new(250 * KB as u64);
    let mut stalled = broker
        .subscribe_with(
            "q",
            SubscribeOptions {
                prefetch: 200,
                prefetch_bytes: None,
                outbound: Some(stalled_budget.clone()),
            },
        )
        .expect("subscribe");
    // The stalled consumer takes its deliveries but never "sends" them: permits stay held.
    let mut held = Vec::new();
    while let Some(d) = try_recv_within(&mut stalled, Duration::from_millis(300)).await {
        held.push(d);
    }
    assert!(
        !held.is_empty() && stalled_budget.used_bytes() <= 250 * KB as u64,
        "the stalled connection holds at most its budget: {} deliveries, {} bytes",
        held.len(),
        stalled_budget.used_bytes()
    );
    assert_eq!(held.len(), 2, "two 100 KB messages fit 250 KB");
    let live = broker
        .subscribe_with(
            "q",
            SubscribeOptions {
                prefetch: 200,
                prefetch_bytes: None,
                outbound: Some(ByteBudget::new(250 * KB as u64)),
            },
        )
        .expect("subscribe");
    let mut live = live;
    let mut seen = BTreeSet::new();
    for d in &held {
        assert!(seen.insert(seq_of(&d.message.body)));
    }
    while seen.len() < 60 {
        let mut d = recv(&mut live).await;
        drop(std::mem::take(&mut d.permit));
        assert!(seen.insert(seq_of(&d.message.body)), "no duplicate");
        live.ack(&[d.tag]);
    }
    assert!(
        broker.delivery_budget().used_bytes() <= 1_000 * KB as u64,
        "the node budget holds"
    );
    // The stalled consumer resumes: it settles what it held and gets new messages.
    drop(live);
    for d in held.drain(..) {
        stalled.ack(&[d.tag]);
    }
    publish_seq(&broker, "q", 60..70, 100 * KB).await;
    while seen.len() < 70 {
        let mut d = recv(&mut stalled).await;
        drop(std::mem::take(&mut d.permit));
        assert!(seen.insert(seq_of(&d.message.body)), "no duplicate");
        stalled.ack(&[d.tag]);
    }
    assert_eq!(seen, (0..70).collect::<BTreeSet<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_larger_than_every_budget_goes_out_alone() {
    let dir = tempfile::tempdir().expect("tmp");
    let broker = open_with_budget(&dir, 50 * KB as u64).await;
    declare(&broker, 1).await;
    publish_seq(&broker, "q", 0..3, 120 * KB).await;
    let mut consumer = broker
        .subscribe_with(
            "q",
            SubscribeOptions {
                prefetch: 10,
                prefetch_bytes: Some(30 * KB as u64),
                outbound: Some(ByteBudget::new(40 * KB as u64)),
            },
        )
        .expect("subscribe");
    for seq in 0..3 {
        let d = recv(&mut consumer).await;
        assert_eq!(seq_of(&d.message.body), seq);
        assert!(
            try_recv_within(&mut consumer, Duration::from_millis(200))
                .await
                .is_none(),
            "one at a time while the first is held and unacked"
        );
        consumer.ack(&[d.tag]);
        drop(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_bytes_bounds_unacked_bytes() {
    let dir = tempfile::tempdir().expect("tmp");
    let broker = open_with_budget(&dir, 10_000 * KB as u64).await;
    declare(&broker, 2).await;
    publish_seq(&broker, "q", 0..10, 100 * KB).await;
    let mut consumer = broker
        .subscribe_with(
            "q",
            SubscribeOptions {
                prefetch: 100,
                prefetch_bytes: Some(250 * KB as u64),
                outbound: None,
            },
        )
        .expect("subscribe");
    let mut unacked = Vec::new();
    while let Some(mut d) = try_recv_within(&mut consumer, Duration::from_millis(300)).await {
        // Sent: the permit goes back, the message stays unacknowledged.
        drop(std::mem::take(&mut d.permit));
        unacked.push(d);
    }
    assert_eq!(unacked.len(), 2, "250 KB of byte prefetch holds two 100 KB");
    let mut received = unacked.len();
    while received < 10 {
        let d = unacked.remove(0);
        consumer.ack(&[d.tag]);
        let mut next = recv(&mut consumer).await;
        drop(std::mem::take(&mut next.permit));
        unacked.push(next);
        received += 1;
    }
    assert!(broker
        .subscribe_with(
            "q",
            SubscribeOptions {
                prefetch: 1,
                prefetch_bytes: Some(0),
                outbound: None,
            }
        )
        .is_err());
}

/// Many consumers whose "sockets" drain at random paces, on a small node budget: every message
/// arrives exactly once and no wake-up is lost (a lost one shows as a stall past the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_paces_lose_no_wake_up() {
    let dir = tempfile::tempdir().expect("tmp");
    let broker = open_with_budget(&dir, 300 * KB as u64).await;
    declare(&broker, 3).await;
    const TOTAL: u64 = 300;
    publish_seq(&broker, "q", 0..TOTAL, 40 * KB).await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let mut tasks = Vec::new();
    for c in 0..4u64 {
        let mut consumer = broker
            .subscribe_with(
                "q",
                SubscribeOptions {
                    prefetch: 50,
                    prefetch_bytes: None,
                    outbound: Some(ByteBudget::new(100 * KB as u64)),
                },
            )
            .expect("subscribe");
        let seen = seen.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                let Some(mut d) = try_recv_within(&mut consumer, Duration::from_secs(3)).await
                else {
                    break;
                };
                n += 1;
                if (n + c).is_multiple_of(3) {
                    tokio::time::sleep(Duration::from_millis(n % 7)).await;
                }
                drop(std::mem::take(&mut d.permit));
                let seq = seq_of(&d.message.body);
                assert!(seen.lock().expect("lock").insert(seq), "duplicate {seq}");
                consumer.ack(&[d.tag]);
                if seen.lock().expect("lock").len() as u64 == TOTAL {
                    break;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("consumer");
    }
    let seen = seen.lock().expect("lock");
    assert_eq!(
        seen.len() as u64,
        TOTAL,
        "every message arrived; a stall means a lost wake-up"
    );
}

/// Declaring queues in a loop meets a clear refusal at the node's partition bound, not the
/// thread limit; deleting a queue makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_partitions_are_bounded_per_node() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = config(dir.path().join("data"));
    config.partitions_max = 5;
    let broker = Broker::open(config).await.expect("open");
    let settings = |partitions| QueueSettings {
        partitions,
        ..QueueSettings::default()
    };
    broker.declare("a", settings(2)).await.expect("2 of 5");
    broker.declare("b", settings(3)).await.expect("5 of 5");
    broker
        .declare("b", settings(3))
        .await
        .expect("redeclaring takes nothing");
    let refused = broker.declare("c", settings(1)).await;
    assert!(
        matches!(&refused, Err(keratin_broker::BrokerError::NodeFull(m)) if m.contains("5 of its 5 partitions")),
        "{refused:?}"
    );
    broker.delete("a").await.expect("delete");
    broker.declare("c", settings(2)).await.expect("room again");
}
