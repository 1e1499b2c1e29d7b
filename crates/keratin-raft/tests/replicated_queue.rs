//! A replicated queue on three in-process brokers (`Broker` with `ReplicatedLogs`), each on its
//! own directory and its own `keratin-net` transport over 127.0.0.1: every node declares the
//! queue with replicas 1, 2 and 3; one leads; its broker confirms publishes; a follower's
//! broker refuses a publish as "not the leader", naming the leader's id and client address;
//! every node's queue info shows the same ready count once the followers applied the records,
//! and the right leader. A consumer at the leader acks some messages and keeps others unacked;
//! then the leader's broker and transport are shut down: the other two elect a leader whose
//! broker takes publishes, and a consumer there receives every message not acked before (those
//! delivered before flagged `redelivered`) and none of the acked ones. It fails if a confirmed
//! message is lost or an acked one comes back, if the refusal names the wrong leader, or if no
//! leader emerges within the bounds.
//!
//! A leader that keeps running but loses an election (a follower is made to start one) steps
//! down: its consumer ends with "not the leader", and the leader after it delivers the
//! unacked messages again, flagged `redelivered`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::brokers::{client_addr, publish_all, wait_info, BrokerNode};
use keratin_broker::{BrokerError, Consumer, Delivery, Message, QueueSettings};
use keratin_raft::partition_log::partition_group;

const QUEUE: &str = "orders";
const QUEUE_ID: u64 = 3;
const WAIT: Duration = Duration::from_secs(10);
/// Messages published before the failover.
const FIRST: usize = 20;
/// Of those, acked at the first leader.
const ACKED: usize = 6;
/// Messages published at the new leader.
const SECOND: usize = 10;

fn settings() -> QueueSettings {
    QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    }
}

async fn leader(nodes: &BTreeMap<u64, BrokerNode>) -> u64 {
    common::brokers::agreed_leader(nodes, QUEUE, WAIT).await
}

async fn receive(consumer: &mut Consumer, count: usize) -> Vec<Delivery> {
    let mut deliveries = Vec::new();
    while deliveries.len() < count {
        let delivery = tokio::time::timeout(WAIT, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of {count} deliveries in {WAIT:?}", deliveries.len()))
            .expect("the consumer is open");
        deliveries.push(delivery);
    }
    deliveries
}

fn bodies(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| format!("{prefix} {n}")).collect()
}

/// Every node's info shows `ready` ready messages, `leader` leading, and the leader's client
/// address on the others.
async fn check_infos(nodes: &BTreeMap<u64, BrokerNode>, leader: u64, ready: u64) {
    for (id, node) in nodes {
        let what = format!("node {id}: {ready} ready, node {leader} leading");
        let info = wait_info(&node.broker, QUEUE, WAIT, &what, |info| {
            let partition = &info.partitions[0];
            partition.ready + partition.inflight == ready && partition.leader == Some(leader)
        })
        .await;
        let partition = &info.partitions[0];
        assert_eq!(partition.leading, *id == leader, "node {id}");
        let addr = (*id != leader).then(|| client_addr(leader));
        assert_eq!(partition.leader_addr, addr, "node {id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replicated_queue_serves_from_its_leader_and_survives_its_loss() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
    }
    for node in nodes.values() {
        let info = node
            .broker
            .declare_replicated(QUEUE_ID, QUEUE, settings(), vec![vec![1, 2, 3]])
            .await
            .expect("declare");
        assert_eq!(info.partitions.len(), 1);
    }

    let first_leader = leader(&nodes).await;
    let first = bodies("first", FIRST);
    let ids = publish_all(&nodes[&first_leader].broker, QUEUE, &first, WAIT).await;
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase: {ids:?}");
    let follower = *nodes
        .keys()
        .find(|id| **id != first_leader)
        .expect("a follower");
    let refused = nodes[&follower]
        .broker
        .publish(QUEUE, vec![Message::new("to a follower")])
        .await;
    match &refused[..] {
        [Err(BrokerError::NotLeader { leader, addr, .. })] => {
            assert_eq!(*leader, Some(first_leader));
            assert_eq!(addr.as_deref(), Some(client_addr(first_leader).as_str()));
        }
        other => panic!("a follower's publish: {other:?}"),
    }
    check_infos(&nodes, first_leader, FIRST as u64).await;

    // Consume at the leader: ack some, keep the rest unacked.
    let mut consumer = nodes[&first_leader]
        .broker
        .subscribe(QUEUE, 100)
        .expect("subscribe");
    let delivered = receive(&mut consumer, FIRST).await;
    let received: Vec<String> = delivered
        .iter()
        .map(|d| String::from_utf8(d.message.body.clone()).expect("utf-8"))
        .collect();
    assert_eq!(received, first, "delivered in order");
    let acked: BTreeSet<String> = received[..ACKED].iter().cloned().collect();
    let tags: Vec<_> = delivered[..ACKED].iter().map(|d| d.tag).collect();
    consumer.ack(&tags);
    // The acks are committed once every node counts them out.
    check_infos(&nodes, first_leader, (FIRST - ACKED) as u64).await;

    let old = nodes.remove(&first_leader).expect("the leader");
    old.stop().await;
    // The old leader's consumer ends without a reason: the broker's shutdown ends the
    // partition's owner (and its consumers) before it closes the log, and the log stops its
    // role events before it shuts the Raft down, so this is no step-down ("not the leader"
    // comes from a node that keeps running while another leads).
    let end = tokio::time::timeout(WAIT, async { while consumer.recv().await.is_some() {} }).await;
    assert!(end.is_ok(), "the old leader's consumer did not end");
    assert!(
        consumer.end_reason().is_none(),
        "the old leader's consumer ended with {:?}",
        consumer.end_reason()
    );
    drop(delivered);

    let second_leader = leader(&nodes).await;
    assert_ne!(second_leader, first_leader);
    let second = bodies("second", SECOND);
    let more = publish_all(&nodes[&second_leader].broker, QUEUE, &second, WAIT).await;
    assert!(
        more[0] > *ids.last().expect("ids"),
        "new ids follow the old ones"
    );
    let expected_live = FIRST - ACKED + SECOND;
    check_infos(&nodes, second_leader, expected_live as u64).await;

    let mut consumer = nodes[&second_leader]
        .broker
        .subscribe(QUEUE, 100)
        .expect("subscribe at the new leader");
    let deliveries = receive(&mut consumer, expected_live).await;
    let mut seen = BTreeSet::new();
    for delivery in &deliveries {
        let body = String::from_utf8(delivery.message.body.clone()).expect("utf-8");
        assert!(
            !acked.contains(&body),
            "acked message {body:?} delivered again"
        );
        let before = body.starts_with("first");
        assert_eq!(delivery.redelivered, before, "{body:?}: redelivered flag");
        assert!(seen.insert(body.clone()), "{body:?} delivered twice");
    }
    let wanted: BTreeSet<String> = first[ACKED..].iter().chain(&second).cloned().collect();
    assert_eq!(seen, wanted);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(consumer.try_recv().is_none(), "nothing more to deliver");
    drop(deliveries);
    drop(consumer);
    for (_, node) in nodes {
        node.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_that_loses_an_election_ends_its_consumers_with_not_leader() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
    }
    for node in nodes.values() {
        node.broker
            .declare_replicated(QUEUE_ID, QUEUE, settings(), vec![vec![1, 2, 3]])
            .await
            .expect("declare");
    }
    let first_leader = leader(&nodes).await;
    let sent = bodies("message", 5);
    publish_all(&nodes[&first_leader].broker, QUEUE, &sent, WAIT).await;
    check_infos(&nodes, first_leader, sent.len() as u64).await;
    let mut consumer = nodes[&first_leader]
        .broker
        .subscribe(QUEUE, 100)
        .expect("subscribe");
    let delivered = receive(&mut consumer, sent.len()).await;

    // A follower starts an election with a higher term: whoever wins, the leader hears the
    // higher term and steps down while running.
    let follower = *nodes
        .keys()
        .find(|id| **id != first_leader)
        .expect("a follower");
    let group = partition_group(QUEUE_ID, 0).expect("group");
    nodes[&follower]
        .logs
        .raft(group)
        .expect("the follower's replica")
        .trigger()
        .elect(false)
        .await
        .expect("election triggered");
    let end = tokio::time::timeout(WAIT, async { while consumer.recv().await.is_some() {} }).await;
    assert!(end.is_ok(), "the deposed leader's consumer did not end");
    match consumer.end_reason() {
        Some(BrokerError::NotLeader { leader, addr, .. }) => {
            assert_ne!(leader, Some(first_leader), "named itself as leader");
            if let Some(leader) = leader {
                assert_eq!(addr, Some(client_addr(leader)));
            }
        }
        other => panic!("the deposed leader's consumer ended with {other:?}"),
    }
    drop(delivered);

    // The leader after it (possibly the same node, in a later term) delivers them again.
    let new_leader = leader(&nodes).await;
    let mut consumer = nodes[&new_leader]
        .broker
        .subscribe(QUEUE, 100)
        .expect("subscribe at the new leader");
    let deliveries = receive(&mut consumer, sent.len()).await;
    let received: Vec<String> = deliveries
        .iter()
        .map(|d| String::from_utf8(d.message.body.clone()).expect("utf-8"))
        .collect();
    assert_eq!(received, sent);
    assert!(
        deliveries.iter().all(|d| d.redelivered),
        "flagged redelivered"
    );
    drop(deliveries);
    drop(consumer);
    for (_, node) in nodes {
        node.stop().await;
    }
}
