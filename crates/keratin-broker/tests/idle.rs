//! The idle hand-back: a partition that holds nothing and saw no append for
//! `idle_release_after` hands its log's segments back to the node's pool. Afterwards its state
//! equals the state rebuilt from the (empty) log, consumers attached to it stay attached and get
//! later messages, offsets continue where they were — across a restart too — and nothing
//! confirmed is lost. A hand-back racing an append (the append queued behind it in the log)
//! loses nothing either.

mod common;

use std::time::Duration;

use common::*;
use keratin_broker::{Broker, BrokerConfig, Message, QueueSettings, Receipt};

fn idle_config(dir: std::path::PathBuf, idle: Duration) -> BrokerConfig {
    let mut config = config(dir);
    config.idle_release_after = idle;
    config
}

async fn publish_receipts(broker: &Broker, seqs: std::ops::Range<u64>) -> Vec<Receipt> {
    let messages: Vec<Message> = seqs.map(|s| Message::new(body(s, 1000))).collect();
    broker
        .publish("q", messages)
        .await
        .into_iter()
        .map(|r| r.expect("publish"))
        .collect()
}

async fn assert_states_match(broker: &Broker) {
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(
            live, rebuilt,
            "the state differs from the state rebuilt from the log"
        );
    }
}

/// Wait until the partition handed its segments back (the log holds no byte on disk).
async fn wait_handed_back(broker: &Broker) {
    let handed = wait_until(Duration::from_secs(10), || {
        broker.info("q").is_ok_and(|i| i.disk_bytes() == 0)
    })
    .await;
    assert!(
        handed,
        "the idle partition kept {} bytes on disk",
        broker.info("q").expect("info").disk_bytes()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_partition_hands_its_segments_back_and_its_offsets_continue() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let idle = Duration::from_millis(200);
    let broker = Broker::open(idle_config(data.clone(), idle))
        .await
        .expect("open");
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    // A consumer that stays attached through the hand-backs.
    let mut consumer = broker.subscribe("q", 100).expect("subscribe");
    let mut last = 0;
    for round in 0..3u64 {
        let receipts = publish_receipts(&broker, round * 50..round * 50 + 50).await;
        assert!(
            receipts.iter().all(|r| r.message >= last),
            "offsets went back after a hand-back: {receipts:?} after {last}"
        );
        last = receipts.iter().map(|r| r.message).max().expect("receipts");
        for seq in round * 50..round * 50 + 50 {
            let delivery = recv(&mut consumer).await;
            assert_eq!(seq_of(&delivery.message.body), seq);
            consumer.ack(&[delivery.tag]);
        }
        assert!(broker.info("q").expect("info").disk_bytes() > 0);
        wait_handed_back(&broker).await;
        assert_states_match(&broker).await;
        let info = broker.info("q").expect("info");
        assert_eq!((info.ready(), info.inflight(), info.bytes()), (0, 0, 0));
    }
    // Published now, confirmed, not consumed: must survive the restart.
    let kept = publish_receipts(&broker, 150..160).await;
    assert!(kept.iter().all(|r| r.message > last));
    last = kept.iter().map(|r| r.message).max().expect("receipts");
    drop(consumer);
    broker.shutdown().await.expect("shutdown");

    let broker = Broker::open(idle_config(data, idle)).await.expect("reopen");
    assert_states_match(&broker).await;
    let mut consumer = broker.subscribe("q", 100).expect("subscribe");
    for seq in 150..160 {
        let delivery = recv(&mut consumer).await;
        assert_eq!(seq_of(&delivery.message.body), seq);
        consumer.ack(&[delivery.tag]);
    }
    assert_idle(&mut consumer).await;
    wait_handed_back(&broker).await;
    drop(consumer);
    broker.shutdown().await.expect("shutdown");

    // Restarted on a handed-back log: the offsets still continue.
    let broker = Broker::open(idle_config(tmp.path().join("data"), idle))
        .await
        .expect("reopen");
    assert_states_match(&broker).await;
    let receipts = publish_receipts(&broker, 160..161).await;
    assert!(
        receipts[0].message > last,
        "offset {} after a restart on a handed-back log, last before {last}",
        receipts[0].message
    );
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    let delivery = recv(&mut consumer).await;
    assert_eq!(seq_of(&delivery.message.body), 160);
    consumer.ack(&[delivery.tag]);
    assert_idle(&mut consumer).await;
    drop(consumer);
    broker.shutdown().await.expect("shutdown");
}

/// With an idle time of a millisecond, nearly every publish races a hand-back queued just
/// before it (or just after the previous ack): each must be confirmed, delivered once, in
/// order, with offsets rising, and the state must follow the log throughout and after a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_backs_racing_appends_lose_nothing() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let idle = Duration::from_millis(1);
    let broker = Broker::open(idle_config(data.clone(), idle))
        .await
        .expect("open");
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    let mut last = None;
    for seq in 0..200u64 {
        let receipt = publish_receipts(&broker, seq..seq + 1).await[0];
        assert!(
            last.is_none_or(|l| receipt.message > l),
            "offset {} after {last:?}",
            receipt.message
        );
        last = Some(receipt.message);
        let delivery = recv(&mut consumer).await;
        assert_eq!(seq_of(&delivery.message.body), seq);
        consumer.ack(&[delivery.tag]);
        // Vary the gap around the idle time, so that hand-backs meet appends at every stage.
        if seq % 3 == 0 {
            tokio::time::sleep(Duration::from_millis(seq % 5)).await;
        }
        if seq % 50 == 49 {
            assert_states_match(&broker).await;
        }
    }
    assert_idle(&mut consumer).await;
    wait_handed_back(&broker).await;
    assert_states_match(&broker).await;
    drop(consumer);
    broker.shutdown().await.expect("shutdown");

    let broker = Broker::open(idle_config(data, idle)).await.expect("reopen");
    assert_states_match(&broker).await;
    let info = broker.info("q").expect("info");
    assert_eq!(
        (info.ready(), info.inflight()),
        (0, 0),
        "acked messages came back"
    );
    let receipt = publish_receipts(&broker, 200..201).await[0];
    assert!(last.is_some_and(|l| receipt.message > l));
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    let delivery = recv(&mut consumer).await;
    assert_eq!(seq_of(&delivery.message.body), 200);
    drop(consumer);
    broker.shutdown().await.expect("shutdown");
}
