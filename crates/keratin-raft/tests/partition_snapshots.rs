//! Disk of replicated partitions is freed, and a lagging follower catches up from a snapshot.
//! Three in-process brokers with `ReplicatedLogs` over the real network on 127.0.0.1, segments
//! of 256 KiB:
//!
//! - Acked messages free the disk on every replica: after 2,000 messages of 1 KiB are
//!   published and acked, each node's partition holds at most a few segments (it held eight),
//!   and the queue keeps working.
//! - A follower that was down while the others acked and freed their logs comes back: the
//!   leader no longer has the entries it missed, so it sends a snapshot; the follower's log
//!   restarts at the snapshot, its broker rebuilds the partition from there and shows the
//!   live messages; once the leader is stopped, the follower (or the third node) leads and
//!   delivers every live message and none of the acked ones. The same with the follower's
//!   data directory wiped before it returns (a replaced disk): it is another copy of the
//!   group's storage, so the leader removes it and adds it back as a learner (what the
//!   cluster's reconciler does), and it rebuilds from the snapshot.
//!
//! Each fails if disk is not freed within its bound, if a partition stops, or if a message is
//! lost or an acked one delivered again.

mod common;

use common::brokers::{body, three_replicas as settings};

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::brokers::{wait_info, BrokerNode};
use keratin_broker::{Broker, BrokerError, BrokerResult, Consumer, Message, ProducerSeq, Receipt};
use keratin_log::MIN_SEGMENT_SIZE_BYTES;
use keratin_raft::partition_log::partition_group;

const QUEUE: &str = "events";
const QUEUE_ID: u64 = 5;
const WAIT: Duration = Duration::from_secs(20);
/// Messages published and acked.
const ACKED: usize = 2_000;
/// Messages left live at the end.
const LIVE: usize = 50;

async fn leader(nodes: &BTreeMap<u64, BrokerNode>) -> u64 {
    common::brokers::agreed_leader(nodes, QUEUE, WAIT).await
}

/// Publish `bodies` at `broker` in batches of 100, retrying a batch refused as "not the
/// leader" with none known (a new leader's first moments).
async fn publish(broker: &Broker, bodies: &[String]) {
    let deadline = tokio::time::Instant::now() + WAIT;
    for batch in bodies.chunks(100) {
        loop {
            let messages: Vec<Message> = batch.iter().map(|b| Message::new(b.clone())).collect();
            let results = broker.publish(QUEUE, messages).await;
            if results
                .iter()
                .all(|r| matches!(r, Err(BrokerError::NotLeader { leader: None, .. })))
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no leader to publish to"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            for result in results {
                result.expect("publish confirmed");
            }
            break;
        }
    }
}

/// Receive `count` deliveries and ack them all; returns their bodies.
async fn consume_and_ack(consumer: &mut Consumer, count: usize) -> Vec<String> {
    let mut bodies = Vec::new();
    while bodies.len() < count {
        let delivery = tokio::time::timeout(WAIT, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of {count} deliveries in {WAIT:?}", bodies.len()))
            .expect("the consumer is open");
        bodies.push(String::from_utf8(delivery.message.body.clone()).expect("utf-8"));
        consumer.ack(&[delivery.tag]);
    }
    bodies
}

/// Nothing more is delivered (an acked message coming back, or a live one twice).
fn no_more(consumer: &mut Consumer) {
    if let Some(delivery) = consumer.try_recv() {
        panic!(
            "delivered after every live message was acked: message {} {:?} (redelivered {})",
            delivery.tag.message,
            String::from_utf8_lossy(&delivery.message.body[..20]),
            delivery.redelivered
        );
    }
}

async fn start_all(net: &mut common::tcp::Loopback) -> BTreeMap<u64, BrokerNode> {
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
        node.broker
            .declare_replicated(QUEUE_ID, QUEUE, settings(), vec![vec![1, 2, 3]])
            .await
            .expect("declare");
        nodes.insert(id, node);
    }
    nodes
}

/// Wait until every node's partition uses at most `bound` bytes of disk, with no stop.
async fn wait_disk_at_most(nodes: &BTreeMap<u64, BrokerNode>, bound: u64, what: &str) {
    for (id, node) in nodes {
        let info = wait_info(
            &node.broker,
            QUEUE,
            WAIT,
            &format!("{what}: node {id} at most {bound} bytes of disk"),
            |info| info.partitions[0].disk_bytes <= bound,
        )
        .await;
        assert_eq!(info.partitions[0].stops, 0, "node {id}: {info:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acked_messages_free_the_disk_on_every_replica() {
    let mut net = common::tcp::three_nodes().await;
    let nodes = start_all(&mut net).await;
    let first = leader(&nodes).await;
    let bodies: Vec<String> = (0..ACKED).map(|n| body("acked", n)).collect();
    publish(&nodes[&first].broker, &bodies).await;
    let used: Vec<u64> = nodes
        .values()
        .map(|n| n.broker.info(QUEUE).expect("info").partitions[0].disk_bytes)
        .collect();
    assert!(
        used.iter().all(|u| *u >= 6 * MIN_SEGMENT_SIZE_BYTES),
        "2 MB of messages take at least six segments everywhere: {used:?}"
    );

    let mut consumer = nodes[&first]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe");
    let got = consume_and_ack(&mut consumer, ACKED).await;
    assert_eq!(got, bodies, "delivered in order");
    wait_disk_at_most(&nodes, 3 * MIN_SEGMENT_SIZE_BYTES, "after the acks").await;

    // The queue goes on: new messages are delivered, and every node counts them.
    let more: Vec<String> = (0..LIVE).map(|n| body("live", n)).collect();
    publish(&nodes[&first].broker, &more).await;
    let got = consume_and_ack(&mut consumer, LIVE).await;
    assert_eq!(got, more);
    for (id, node) in &nodes {
        wait_info(
            &node.broker,
            QUEUE,
            WAIT,
            &format!("node {id} empty"),
            |info| info.partitions[0].ready + info.partitions[0].inflight == 0,
        )
        .await;
    }
    drop(consumer);
    for (_, node) in nodes {
        node.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_behind_the_freed_log_catches_up_from_a_snapshot() {
    follower_returns(Returns::Whole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wiped_follower_rebuilds_from_a_snapshot() {
    follower_returns(Returns::Wiped).await;
}

/// A follower's copy is damaged while it is down (one flipped bit in a record with records
/// after it, which its log had reported durable): the node starts all the same, moves the
/// damaged copy aside, and the empty copy in its place is replaced and rebuilt like a wiped
/// one. Before, the node's start failed ("corrupt log data ... restore this log from a replica
/// or backup"), and every other partition on the node stayed down with it (the nemesis,
/// `docs/reliability.md` finding 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_whose_copy_is_damaged_starts_and_rebuilds_from_a_snapshot() {
    follower_returns(Returns::Damaged).await;
}

/// How the follower of [`follower_returns`] comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Returns {
    /// As it stopped.
    Whole,
    /// Its data directory emptied (a replaced disk).
    Wiped,
    /// One bit of a durable record of its partition flipped.
    Damaged,
}

/// Flip one bit of the first occurrence of `marker` in a file under `dir`; whether it was
/// found.
fn flip_a_bit(dir: &std::path::Path, marker: &[u8]) -> bool {
    for file in common::files_under(dir) {
        let mut bytes = std::fs::read(&file).expect("read");
        if let Some(at) = bytes.windows(marker.len()).position(|w| w == marker) {
            bytes[at + marker.len() / 2] ^= 0x04;
            std::fs::write(&file, bytes).expect("write");
            return true;
        }
    }
    false
}

/// A follower stops; the others ack and free their logs; it returns (as `returns` says) and
/// catches up from the leader's snapshot.
async fn follower_returns(returns: Returns) {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = start_all(&mut net).await;
    let first = leader(&nodes).await;
    let lagging = *nodes.keys().find(|id| **id != first).expect("a follower");
    // Something the lagging follower has, acked later while it is down.
    let early: Vec<String> = (0..10).map(|n| body("early", n)).collect();
    publish(&nodes[&first].broker, &early).await;
    wait_info(
        &nodes[&lagging].broker,
        QUEUE,
        WAIT,
        "the follower has the early messages",
        |info| info.partitions[0].ready == early.len() as u64,
    )
    .await;
    nodes.remove(&lagging).expect("follower").stop().await;

    let bodies: Vec<String> = (0..ACKED).map(|n| body("acked", n)).collect();
    publish(&nodes[&first].broker, &bodies).await;
    let mut consumer = nodes[&first]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe");
    let got = consume_and_ack(&mut consumer, early.len() + ACKED).await;
    let all_acked: Vec<String> = early.iter().chain(&bodies).cloned().collect();
    assert_eq!(got, all_acked, "delivered in order");
    let live: Vec<String> = (0..LIVE).map(|n| body("live", n)).collect();
    publish(&nodes[&first].broker, &live).await;
    // Keep the live ones undelivered: the consumer goes.
    drop(consumer);
    wait_disk_at_most(
        &nodes,
        3 * MIN_SEGMENT_SIZE_BYTES,
        "before the follower returns",
    )
    .await;

    if returns == Returns::Damaged {
        let dir = net.dirs[&lagging].path();
        assert!(
            flip_a_bit(dir, body("early", 5).as_bytes()),
            "the follower holds the early messages"
        );
    }
    if returns == Returns::Wiped {
        let dir = net.dirs[&lagging].path();
        for entry in std::fs::read_dir(dir).expect("list the follower's directory") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path).expect("wipe");
            } else {
                std::fs::remove_file(&path).expect("wipe");
            }
        }
    }
    // The follower returns; the leader sends it a snapshot and the entries after it.
    let node = common::brokers::start(
        net.dirs[&lagging].path(),
        net.rebind(lagging).await,
        net.cluster(lagging),
    )
    .await;
    node.broker
        .declare_replicated(QUEUE_ID, QUEUE, settings(), vec![vec![1, 2, 3]])
        .await
        .expect("declare again");
    nodes.insert(lagging, node);
    if returns == Returns::Damaged {
        let damaged = net.dirs[&lagging].path().join("damaged");
        let moved = std::fs::read_dir(&damaged)
            .map(|entries| entries.count())
            .unwrap_or(0);
        assert_eq!(moved, 1, "the damaged copy moved to {}", damaged.display());
    }
    if returns != Returns::Whole {
        replace_wiped(&nodes[&first], lagging).await;
    }
    let info = wait_info(
        &nodes[&lagging].broker,
        QUEUE,
        WAIT,
        "the returned follower counts the live messages only",
        |info| info.partitions[0].ready == LIVE as u64,
    )
    .await;
    assert_eq!(info.partitions[0].leader, Some(first));
    assert!(
        info.partitions[0].disk_bytes <= 3 * MIN_SEGMENT_SIZE_BYTES,
        "the follower holds what follows the snapshot only: {info:?}"
    );

    // Without the old leader, the live messages are delivered once each, nothing acked.
    nodes.remove(&first).expect("leader").stop().await;
    let second = leader(&nodes).await;
    let mut consumer = nodes[&second]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe at the new leader");
    let got = consume_and_ack(&mut consumer, LIVE).await;
    let got: BTreeSet<String> = got.into_iter().collect();
    let wanted: BTreeSet<String> = live.iter().cloned().collect();
    assert_eq!(got, wanted, "every live message, once");
    tokio::time::sleep(Duration::from_millis(200)).await;
    no_more(&mut consumer);
    drop(consumer);
    for (_, node) in nodes {
        node.stop().await;
    }
}

/// On `leader`, what the cluster's reconciler does for a member whose directory was wiped:
/// once it is silent (it refuses everything addressed to its old copy), remove it, then add it
/// back as a learner with its new copy and promote it once caught up. Within `WAIT`.
async fn replace_wiped(leader: &BrokerNode, wiped: u64) {
    let group = partition_group(QUEUE_ID, 0).expect("group id");
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut removed = false;
    while !removed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the wiped copy of node {wiped} was never found replaced"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let replaced = leader.logs.replace_copies(group).await.expect("replace");
        removed = replaced.removed.contains(&wiped);
    }
    let members = leader
        .logs
        .change_voters(group, &[1, 2, 3].into(), WAIT)
        .await
        .expect("the wiped node is added back and promoted");
    assert_eq!(members.voters, [1, 2, 3].into());
}

/// An idempotent producer's messages, stored (and acked) while a follower is down.
const IDEMPOTENT: u64 = 10;
/// Their producer.
const PRODUCER: u64 = 0xfeed;

fn idempotent(sequence: u64) -> Message {
    let mut message = Message::new(format!("idempotent {sequence}"));
    message.producer = Some(ProducerSeq {
        producer: PRODUCER,
        sequence,
    });
    message
}

/// A follower that was down while the others freed their logs rebuilds from the leader's
/// snapshot; leadership then moves to it, and the producer sends its messages again (a retry
/// after an unknown outcome, with the same sequences). The rebuilt follower must know them as
/// stored, like its peers: before the producers' windows travelled with the snapshot it kept
/// none of the sequences stored below it, and stored all ten again as new messages (its peers
/// applied the same records as duplicates: the replicas disagreed about the queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_rebuilt_from_a_snapshot_deduplicates_like_its_peers() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = start_all(&mut net).await;
    let first = leader(&nodes).await;
    let lagging = *nodes.keys().find(|id| **id != first).expect("a follower");
    nodes.remove(&lagging).expect("follower").stop().await;

    // Stored and acked while the follower is down, then freed with the rest.
    let stored: Vec<BrokerResult<Receipt>> = nodes[&first]
        .broker
        .publish(QUEUE, (1..=IDEMPOTENT).map(idempotent).collect())
        .await;
    for result in &stored {
        assert!(result.is_ok(), "{result:?}");
    }
    let bodies: Vec<String> = (0..ACKED).map(|n| body("acked", n)).collect();
    publish(&nodes[&first].broker, &bodies).await;
    let mut consumer = nodes[&first]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe");
    consume_and_ack(&mut consumer, IDEMPOTENT as usize + ACKED).await;
    drop(consumer);
    let live: Vec<String> = (0..LIVE).map(|n| body("live", n)).collect();
    publish(&nodes[&first].broker, &live).await;
    wait_disk_at_most(
        &nodes,
        3 * MIN_SEGMENT_SIZE_BYTES,
        "before the follower returns",
    )
    .await;

    // The follower returns and rebuilds from the leader's snapshot.
    let node = common::brokers::start(
        net.dirs[&lagging].path(),
        net.rebind(lagging).await,
        net.cluster(lagging),
    )
    .await;
    node.broker
        .declare_replicated(QUEUE_ID, QUEUE, settings(), vec![vec![1, 2, 3]])
        .await
        .expect("declare again");
    nodes.insert(lagging, node);
    wait_info(
        &nodes[&lagging].broker,
        QUEUE,
        WAIT,
        "the returned follower counts the live messages only",
        |info| info.partitions[0].ready == LIVE as u64,
    )
    .await;

    // Leadership moves to it.
    let group = keratin_raft::partition_log::partition_group(QUEUE_ID, 0).expect("group");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = leader(&nodes).await;
        if now == lagging {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leadership never moved to the rebuilt follower"
        );
        let _ = nodes[&now].logs.transfer_leader(group, lagging).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The producer's retries are confirmed and stored nowhere.
    let deadline = tokio::time::Instant::now() + WAIT;
    let retried = loop {
        let results = nodes[&lagging]
            .broker
            .publish(QUEUE, (1..=IDEMPOTENT).map(idempotent).collect())
            .await;
        let refused = results
            .iter()
            .all(|r| matches!(r, Err(BrokerError::NotLeader { leader: None, .. })));
        if !refused || tokio::time::Instant::now() > deadline {
            break results;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for result in &retried {
        assert!(result.is_ok(), "a retry: {result:?}");
    }
    for (id, node) in &nodes {
        let info = wait_info(
            &node.broker,
            QUEUE,
            WAIT,
            &format!("node {id} applied the retries"),
            |info| info.partitions[0].leader == Some(lagging),
        )
        .await;
        // Give a follower the moment to apply what the leader committed.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let info = node.broker.info(QUEUE).unwrap_or(info);
        assert_eq!(
            info.partitions[0].ready, LIVE as u64,
            "node {id}: a retry of a sequence stored before the snapshot was stored again \
             (the rebuilt follower is {lagging})"
        );
    }
    for (_, node) in nodes {
        node.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_restarted_after_freeing_its_logs_keeps_its_live_messages() {
    restart_cluster(Duration::from_millis(1500)).await;
}

/// Right after a whole-cluster restart, a consumer at the first agreed leader acks every live
/// message and none comes back. This found a defect: the node that led before the restart took
/// leadership back at once without an election (openraft's leader restore), and an election
/// that followed answered its first proposals (the acks) as "not the leader": the acked
/// messages came back flagged `redelivered`. Replicas now start as followers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ack_right_after_a_cluster_restart_is_kept() {
    restart_cluster(Duration::ZERO).await;
}

/// Publish and ack, leave `LIVE` messages, free the logs, restart every node, wait `settle`
/// after the first leader, then consume.
async fn restart_cluster(settle: Duration) {
    let mut net = common::tcp::three_nodes().await;
    let nodes = start_all(&mut net).await;
    let first = leader(&nodes).await;
    let bodies: Vec<String> = (0..ACKED).map(|n| body("acked", n)).collect();
    publish(&nodes[&first].broker, &bodies).await;
    let mut consumer = nodes[&first]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe");
    consume_and_ack(&mut consumer, ACKED).await;
    drop(consumer);
    let live: Vec<String> = (0..LIVE).map(|n| body("live", n)).collect();
    publish(&nodes[&first].broker, &live).await;
    wait_disk_at_most(&nodes, 3 * MIN_SEGMENT_SIZE_BYTES, "before the restart").await;
    for (_, node) in nodes {
        node.stop().await;
    }

    // Every node starts from its snapshot (kept in its state log) and the entries after it.
    let mut nodes = BTreeMap::new();
    for id in 1..=3u64 {
        let node =
            common::brokers::start(net.dirs[&id].path(), net.rebind(id).await, net.cluster(id))
                .await;
        node.broker
            .declare_replicated(QUEUE_ID, QUEUE, settings(), vec![vec![1, 2, 3]])
            .await
            .expect("declare again");
        nodes.insert(id, node);
    }
    let second = leader(&nodes).await;
    for (id, node) in &nodes {
        wait_info(
            &node.broker,
            QUEUE,
            WAIT,
            &format!("node {id} counts the live messages after the restart"),
            |info| info.partitions[0].ready == LIVE as u64,
        )
        .await;
    }
    tokio::time::sleep(settle).await;
    let mut consumer = nodes[&second]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe after the restart");
    let got: BTreeSet<String> = consume_and_ack(&mut consumer, LIVE)
        .await
        .into_iter()
        .collect();
    assert_eq!(got, live.iter().cloned().collect::<BTreeSet<_>>());
    tokio::time::sleep(Duration::from_millis(200)).await;
    no_more(&mut consumer);
    drop(consumer);
    for (_, node) in nodes {
        node.stop().await;
    }
}
