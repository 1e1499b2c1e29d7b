//! Idempotent producers end to end on one node: a retry of a producer's sequence, over another
//! connection of the same producer, is confirmed and not stored again (and so never delivered
//! twice), also after a restart (the windows are rebuilt from the log); a client that is not
//! idempotent stores what it sends.

mod common;

use std::time::Duration;

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use keratin_server::config::Config;
use keratin_server::Node;

const WAIT: Duration = Duration::from_secs(20);

fn config(dir: &tempfile::TempDir) -> Config {
    common::node_config(dir.path())
}

fn producer(id: u64) -> ClientOptions {
    ClientOptions {
        producer_id: Some(id),
        ..ClientOptions::default()
    }
}

async fn publish_range(client: &Client, sequences: std::ops::RangeInclusive<u64>) {
    let messages: Vec<OutgoingMessage> = sequences
        .map(|s| OutgoingMessage::new(format!("m{s}")).with_sequence(s))
        .collect();
    for result in client.publish_batch("q", messages).await {
        result.expect("confirmed");
    }
}

async fn ready(client: &Client) -> u64 {
    let info = client.info("q").await.expect("info");
    info.partitions.iter().map(|p| p.ready).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_retries_are_confirmed_and_stored_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node::start(&config(&dir)).await.expect("start");
    let addr = node.protocol_addr();
    let work = async {
        let first = Client::connect(addr, producer(5)).await.expect("connect");
        first
            .declare("q", QueueSettings::default())
            .await
            .expect("declare");
        publish_range(&first, 1..=10).await;
        // The same producer on a new connection retries 5..=10 and goes on to 15.
        let second = Client::connect(addr, producer(5)).await.expect("connect");
        publish_range(&second, 5..=15).await;
        assert_eq!(
            ready(&second).await,
            15,
            "sequences 5 to 10 were stored once"
        );
        // Another producer's sequences are its own.
        let other = Client::connect(addr, producer(6)).await.expect("connect");
        publish_range(&other, 1..=3).await;
        assert_eq!(ready(&other).await, 18);
        // A client that is not idempotent stores what it sends.
        let plain = Client::connect(
            addr,
            ClientOptions {
                idempotent: false,
                ..ClientOptions::default()
            },
        )
        .await
        .expect("connect");
        publish_range(&plain, 1..=2).await;
        publish_range(&plain, 1..=2).await;
        assert_eq!(ready(&plain).await, 22);
        // Each stored message is delivered once.
        let mut consumer = first.subscribe("q", 64).await.expect("subscribe");
        let mut bodies = Vec::new();
        while bodies.len() < 22 {
            let delivery = consumer.recv().await.expect("a delivery");
            bodies.push(String::from_utf8_lossy(&delivery.body).into_owned());
            delivery.ack().expect("ack");
        }
        let count = |body: &str| bodies.iter().filter(|b| *b == body).count();
        assert_eq!(count("m5"), 1, "m5 once, from producer 5: {bodies:?}");
        assert_eq!(
            count("m1"),
            4,
            "producers 5 and 6 once each, the plain client twice"
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(300), consumer.recv())
                .await
                .is_err(),
            "nothing more"
        );
    };
    tokio::time::timeout(WAIT, work).await.expect("in time");
    node.shutdown().await.expect("shutdown");

    // After a restart the windows come back from the log: a late retry is still dropped.
    let node = Node::start(&config(&dir)).await.expect("restart");
    let work = async {
        let again = Client::connect(node.protocol_addr(), producer(5))
            .await
            .expect("connect");
        publish_range(&again, 14..=16).await;
        assert_eq!(ready(&again).await, 1, "only sequence 16 is new");
    };
    tokio::time::timeout(WAIT, work).await.expect("in time");
    node.shutdown().await.expect("shutdown");
}

/// A client given a producer id of its own publishes messages without sequences of their own,
/// then the application restarts with the same id and does it again: every publish the
/// broker confirms must be stored. (The client numbered such messages from 1 in each run, so
/// the second run's were confirmed as retries of the first's and dropped: confirmed, lost.)
/// Such a publish is refused before it is sent, saying what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_producer_id_without_sequences_never_has_a_confirmed_message_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node::start(&config(&dir)).await.expect("start");
    let addr = node.protocol_addr();
    let work = async {
        let setup = Client::connect(addr, ClientOptions::default())
            .await
            .expect("connect");
        setup
            .declare("q", QueueSettings::default())
            .await
            .expect("declare");
        let mut confirmed = 0;
        let mut refusals = Vec::new();
        for run in ["first run", "after a restart"] {
            let client = Client::connect(addr, producer(9)).await.expect("connect");
            let single = client.publish("q", OutgoingMessage::new(run)).await;
            let batch = client
                .publish_batch("q", vec![OutgoingMessage::new(format!("{run}, batched"))])
                .await;
            for result in std::iter::once(single).chain(batch) {
                match result {
                    Ok(_) => confirmed += 1,
                    Err(failed) => refusals.push(failed.error.to_string()),
                }
            }
            client.close().await;
        }
        assert_eq!(
            ready(&setup).await,
            confirmed,
            "every confirmed message is stored"
        );
        assert_eq!(refusals.len(), 4, "{refusals:?}");
        for refusal in &refusals {
            assert!(
                refusal.contains("with_sequence"),
                "says what to do: {refusal}"
            );
        }
        // With sequences of its own it publishes.
        let client = Client::connect(addr, producer(9)).await.expect("connect");
        publish_range(&client, 1..=2).await;
        assert_eq!(ready(&setup).await, 2);
    };
    tokio::time::timeout(WAIT, work).await.expect("in time");
    node.shutdown().await.expect("shutdown");
}
