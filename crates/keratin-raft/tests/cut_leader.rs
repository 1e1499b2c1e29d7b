//! Leadership changes as publishers and consumers meet them, on three in-process brokers over
//! 127.0.0.1 (network faults with exact timing from `common::faults`, or a leader's transport
//! shut down while its broker runs on): a cut-off leader answers its publishers within seconds
//! and stops delivering within its lease; a publish whose records a deposed leader's log
//! discarded is answered as unknown, never as "not the leader"; a new leader delivers nothing
//! its predecessor settled. Each test says how it fails.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::brokers::{agreed_leader, agreed_leader_among, publish_all, wait_info, BrokerNode};
use common::faults::{carries, Faults, Rule};
use keratin_broker::record::{ENQUEUE, SETTLE};
use keratin_broker::{Broker, BrokerError, Message};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(15);

/// How soon the cut leader must answer: the quorum check (1 s without a majority's ack) plus
/// the step-down grace (0.5 s), with room for a loaded machine.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// A leader cut off from the other replicas (its transport shut down, its broker running: the
/// network cut of the cluster test, in process) must not leave its publishers waiting for the
/// publish timeout (30 s here). Within a few seconds of the cut:
/// - a publish that was in flight there is answered as `LeadershipLost` (outcome unknown: the
///   cut leader cannot know whether it will be committed), not left waiting;
/// - a new publish there is refused as "not the leader" with no leader named, so a client
///   tries the other nodes;
/// - the other two elect a leader that takes publishes.
///
/// Fails if the cut leader keeps claiming the partition (publishes hang until the timeout) or
/// answers an in-flight publish as failed for sure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_off_leader_answers_its_publishers_within_seconds() {
    const QUEUE: &str = "cut";
    const QUEUE_ID: u64 = 5;
    let mut net = common::tcp::three_nodes().await;
    let mut nodes: BTreeMap<u64, BrokerNode> = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    let leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    let before: Vec<String> = (0..5).map(|n| format!("before {n}")).collect();
    publish_all(&nodes[&leader].broker, QUEUE, &before, WAIT).await;

    // The cut: the leader's transport goes, its broker keeps running.
    nodes[&leader].transport.shutdown();
    let cut_at = Instant::now();
    let in_flight = {
        let broker = nodes[&leader].broker.clone();
        tokio::spawn(async move { broker.publish(QUEUE, vec![Message::new("in flight")]).await })
    };
    let answered = tokio::time::timeout(ANSWER_WITHIN, in_flight)
        .await
        .unwrap_or_else(|_| panic!("the cut leader left a publish waiting over {ANSWER_WITHIN:?}"))
        .expect("the publish task");
    match &answered[..] {
        // Sent at once after the cut, well before the quorum check can notice it: it reached
        // the log, so its outcome is unknown there.
        [Err(BrokerError::LeadershipLost { .. })] => {}
        other => panic!("the in-flight publish at the cut leader: {other:?}"),
    }
    eprintln!(
        "in-flight publish answered {:?} after the cut",
        cut_at.elapsed()
    );

    // A new publish there is refused as "not the leader", naming no leader.
    let refused = nodes[&leader]
        .broker
        .publish(QUEUE, vec![Message::new("after the cut")])
        .await;
    assert!(
        matches!(
            &refused[..],
            [Err(BrokerError::NotLeader { leader: None, .. })]
        ),
        "a publish at the cut leader: {refused:?}"
    );
    let info = nodes[&leader].broker.info(QUEUE).expect("info");
    assert!(
        !info.partitions[0].leading,
        "the cut leader still says it leads: {info:?}"
    );

    // The others elect a leader of their own, which takes publishes.
    let cut = nodes.remove(&leader).expect("the cut node");
    let new_leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    assert_ne!(new_leader, leader);
    publish_all(
        &nodes[&new_leader].broker,
        QUEUE,
        &["after".to_string()],
        WAIT,
    )
    .await;

    cut.stop().await;
    for (_, node) in nodes {
        node.stop().await;
    }
}

/// A publish whose records a deposed leader's log discarded is answered as *unknown* (504
/// `LeadershipLost`), never as "not the leader" (421, which tells any client, idempotent or
/// not, that nothing was stored and a resend is safe). openraft reports an entry it discarded
/// when the node adopted another leader's log as `LogEntryDiscarded`: "commit status unknown",
/// and a proposal of several entries can end partly committed.
///
/// Three in-process brokers over 127.0.0.1, with network faults on the receiving side
/// (`common::faults`), in this exact order:
/// 1. the leader proposes one publish of two messages, "first" and "second" (one proposal, two
///    entries); both followers take the append only up to "first" (a follower that took part
///    of an append), so "first" is committed and "second" is not;
/// 2. one follower stops hearing the leader; the other answers the leader's heartbeats
///    without its `Raft` hearing them (the old leader keeps its quorum lease and does not step
///    down on its own), so the followers elect a successor, which keeps "first";
/// 3. the successor's log replaces the old leader's "second": openraft discards it.
///
/// Before the fix the publish was answered `NotLeader` naming the successor (the first failure
/// of the batch decided): a non-idempotent producer resends both, and "first" is stored twice.
/// It fails if the publish is answered anything but `LeadershipLost`, or if the successor does
/// not hold "first" exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partly_committed_publish_is_answered_as_unknown_not_as_not_the_leader() {
    const QUEUE: &str = "partly";
    const QUEUE_ID: u64 = 6;
    // The successor is elected once the followers' lease on the old leader ran out (1 s) and
    // an election timeout passed (0.5-1 s): the publish is answered within seconds.
    const ANSWERED_WITHIN: Duration = Duration::from_secs(10);
    let mut net = common::tcp::three_nodes().await;
    let mut nodes: BTreeMap<u64, BrokerNode> = BTreeMap::new();
    let mut faults: BTreeMap<u64, Faults> = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let (node, node_faults) =
            common::brokers::start_faulty(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
        faults.insert(id, node_faults);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    let leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    // A publish confirmed first: the leader's lease is established.
    publish_all(&nodes[&leader].broker, QUEUE, &["before".to_string()], WAIT).await;
    let followers: Vec<u64> = nodes.keys().copied().filter(|id| *id != leader).collect();

    // 1. The followers take the batch up to "second".
    for follower in &followers {
        faults[follower].set(
            leader,
            Rule::TakeBefore(Box::new(|entry| carries(entry, ENQUEUE, b"second"))),
        );
    }
    let publish = {
        let broker = nodes[&leader].broker.clone();
        tokio::spawn(async move {
            broker
                .publish(QUEUE, vec![Message::new("first"), Message::new("second")])
                .await
        })
    };
    for follower in &followers {
        wait_info(
            &nodes[follower].broker,
            QUEUE,
            WAIT,
            "\"first\" committed and applied on the follower",
            |info| info.partitions[0].ready == 2,
        )
        .await;
    }

    // 2. The followers elect a successor without the old leader.
    faults[&followers[0]].set(leader, Rule::Deaf);
    faults[&followers[1]].set(leader, Rule::FakeHeartbeats);
    let answered = tokio::time::timeout(ANSWERED_WITHIN, publish)
        .await
        .unwrap_or_else(|_| panic!("the publish was not answered within {ANSWERED_WITHIN:?}"))
        .expect("the publish task");
    for (n, result) in answered.iter().enumerate() {
        assert!(
            matches!(result, Err(BrokerError::LeadershipLost { .. })),
            "message {n} of a publish whose first record the successor committed: {result:?} \
             (a 421 tells a client that did not number its messages to send it again)"
        );
    }

    // 3. The successor holds "first" once, and not "second".
    let ids: BTreeSet<u64> = followers.iter().copied().collect();
    let successor = agreed_leader_among(&nodes, &ids, QUEUE, WAIT).await;
    let info = nodes[&successor].broker.info(QUEUE).expect("info");
    assert_eq!(
        info.partitions[0].ready, 2,
        "the successor holds \"before\" and \"first\": {info:?}"
    );
    let mut consumer = nodes[&successor]
        .broker
        .subscribe(QUEUE, 10)
        .expect("subscribe at the successor");
    let mut bodies = Vec::new();
    for _ in 0..2 {
        let delivery = tokio::time::timeout(WAIT, consumer.recv())
            .await
            .expect("a delivery")
            .expect("the consumer is open");
        bodies.push(String::from_utf8(delivery.message.body.clone()).expect("utf-8"));
        consumer.ack(&[delivery.tag]);
    }
    assert_eq!(bodies, ["before", "first"]);
    drop(consumer);

    for node_faults in faults.values() {
        node_faults.clear();
    }
    for (_, node) in nodes {
        node.stop().await;
    }
}

/// Messages ready at the cut leader: more than its consumer takes in the seconds it runs.
const READY: usize = 2_000;
/// The consumer takes one message every this long (with prefetch 1), so deliveries go on
/// steadily across the cut.
const TAKE_EVERY: Duration = Duration::from_millis(4);
/// Deliveries before the cut.
const BEFORE_CUT: usize = 30;
/// A delivery decided just before the lease ran out reaches the in-process consumer within
/// this (a scheduling delay on a loaded 2-core machine).
const SLACK: Duration = Duration::from_millis(100);

/// Publish `bodies` at `broker` in batches of 100 (retrying a batch refused while the new
/// leader's lease is not yet confirmed).
async fn publish(broker: &Broker, queue: &str, bodies: &[String]) {
    let deadline = Instant::now() + WAIT;
    for batch in bodies.chunks(100) {
        loop {
            let messages: Vec<Message> = batch.iter().map(|b| Message::new(b.clone())).collect();
            let results = broker.publish(queue, messages).await;
            if results
                .iter()
                .all(|r| matches!(r, Err(BrokerError::NotLeader { leader: None, .. })))
            {
                assert!(Instant::now() < deadline, "no leader to publish to");
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

/// One delivery as the consumer saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    message: u64,
    at: Instant,
}

/// A consumer at the leader takes and acks messages one by one; the leader's transport is shut
/// down (its broker runs on). The followers may elect a successor once their lease on the old
/// leader runs out, one lease (openraft's, the longest election timeout: 1 s) after the last
/// request of the old leader that a majority acknowledged; from then on two leaders would
/// deliver the same messages. The cut leader must stop delivering before that, with a margin:
/// no delivery reaches its consumer later than the delivery lease after the cut (plus
/// scheduling slack). Before the fix it went on until its quorum check (the full lease) turned
/// its role: the last delivery came 995 ms after the cut (bound 850 ms). Every message it
/// delivered comes again from the successor flagged `redelivered`, and only after its last.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_off_leader_stops_delivering_within_its_lease() {
    const QUEUE: &str = "lease";
    const QUEUE_ID: u64 = 7;
    let mut net = common::tcp::three_nodes().await;
    let mut nodes: BTreeMap<u64, BrokerNode> = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    let leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    let bodies: Vec<String> = (0..READY).map(|n| format!("message {n}")).collect();
    publish(&nodes[&leader].broker, QUEUE, &bodies).await;

    let mut consumer = nodes[&leader]
        .broker
        .subscribe(QUEUE, 1)
        .expect("subscribe at the leader");
    let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<()>();
    let taking = tokio::spawn(async move {
        let mut seen = Vec::new();
        let mut cut_tx = Some(cut_tx);
        // Until the leader ends the consumer (it stepped down), 10 s at most.
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Ok(Some(delivery)) = tokio::time::timeout_at(deadline, consumer.recv()).await {
            seen.push(Seen {
                message: delivery.tag.message,
                at: Instant::now(),
            });
            if seen.len() == BEFORE_CUT {
                if let Some(tx) = cut_tx.take() {
                    let _ = tx.send(());
                }
            }
            tokio::time::sleep(TAKE_EVERY).await;
            consumer.ack(&[delivery.tag]);
        }
        (seen, consumer.end_reason())
    });
    cut_rx.await.expect("deliveries before the cut");
    nodes[&leader].transport.shutdown();
    let cut_at = Instant::now();
    let (seen, ended) = taking.await.expect("the consumer task");
    let after_cut: Vec<&Seen> = seen.iter().filter(|s| s.at > cut_at).collect();
    let last = seen.last().expect("deliveries").at;
    eprintln!(
        "{} deliveries, {} after the cut, the last {:?} after it; consumer ended: {ended:?}",
        seen.len(),
        after_cut.len(),
        last.saturating_duration_since(cut_at)
    );
    assert!(ended.is_some(), "the cut leader never ended its consumer");
    let bound = keratin_raft::partition_log::DELIVERY_LEASE + SLACK;
    assert!(
        last <= cut_at + bound,
        "the cut leader delivered {:?} after the cut (a successor may lead {:?} after the \
         last acknowledged request, so deliveries must stop within {bound:?})",
        last.saturating_duration_since(cut_at),
        keratin_raft::partition_log::QUORUM_LOST_AFTER
    );

    // The successor delivers everything not acked for sure; what the cut leader handed out
    // comes flagged.
    let cut = nodes.remove(&leader).expect("the cut node");
    let successor = agreed_leader(&nodes, QUEUE, WAIT).await;
    let delivered_before: BTreeSet<u64> = seen.iter().map(|s| s.message).collect();
    let mut consumer = nodes[&successor]
        .broker
        .subscribe(QUEUE, 500)
        .expect("subscribe at the successor");
    let mut again = BTreeSet::new();
    let first = tokio::time::timeout(WAIT, consumer.recv())
        .await
        .expect("a delivery from the successor")
        .expect("open");
    let first_successor_delivery_at = Instant::now();
    // Drain until the successor holds nothing. Its `ready` right after the election may still
    // count messages whose SETTLE the cut leader wrote and the successor commits only with its
    // first entry, so the end is "nothing ready, nothing in flight", not a count taken once.
    let drain_deadline = Instant::now() + WAIT;
    let mut next = Some(first);
    loop {
        if let Some(d) = next.take() {
            if delivered_before.contains(&d.tag.message) {
                assert!(
                    d.redelivered,
                    "message {} was delivered by the cut leader and again by the successor \
                     without the redelivered flag",
                    d.tag.message
                );
                again.insert(d.tag.message);
            }
            consumer.ack(&[d.tag]);
        }
        match tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await {
            Ok(delivery) => next = Some(delivery.expect("the successor's consumer is open")),
            Err(_) => {
                let info = nodes[&successor].broker.info(QUEUE).expect("info");
                let partition = &info.partitions[0];
                if partition.ready == 0 && partition.inflight == 0 {
                    break;
                }
                assert!(
                    Instant::now() < drain_deadline,
                    "the successor stopped delivering with {} ready and {} in flight",
                    partition.ready,
                    partition.inflight
                );
            }
        }
    }
    assert!(
        first_successor_delivery_at > last,
        "the successor delivered while the cut leader still did"
    );
    let after_cut_ids: BTreeSet<u64> = after_cut.iter().map(|s| s.message).collect();
    assert!(
        after_cut_ids.is_subset(&again),
        "what the cut leader handed out after the cut (never settled) comes back"
    );
    drop(consumer);
    cut.stop().await;
    for (_, node) in nodes {
        node.stop().await;
    }
}

/// The followers append the old leader's SETTLE of every message and then stop hearing it, so
/// they never learn it was committed; one of them is elected and cannot commit anything for a
/// while (its peer takes heartbeats only). Its state does not have the SETTLE applied yet, and
/// before the fix it delivered the ten acked messages again (flagged `redelivered`); a new
/// leader now delivers only once it applied everything up to the start of its leadership.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_leader_delivers_nothing_its_predecessor_settled() {
    const QUEUE: &str = "settled";
    const QUEUE_ID: u64 = 8;
    const COUNT: usize = 10;
    let mut net = common::tcp::three_nodes().await;
    let mut nodes: BTreeMap<u64, BrokerNode> = BTreeMap::new();
    let mut faults: BTreeMap<u64, Faults> = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let (node, node_faults) =
            common::brokers::start_faulty(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
        faults.insert(id, node_faults);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    let leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    let bodies: Vec<String> = (0..COUNT).map(|n| format!("acked {n}")).collect();
    publish_all(&nodes[&leader].broker, QUEUE, &bodies, WAIT).await;
    let followers: Vec<u64> = nodes.keys().copied().filter(|id| *id != leader).collect();
    for follower in &followers {
        wait_info(
            &nodes[follower].broker,
            QUEUE,
            WAIT,
            "the follower holds the messages",
            |info| info.partitions[0].ready == COUNT as u64,
        )
        .await;
    }

    // The followers append the SETTLE, then hear the leader no more.
    for follower in &followers {
        faults[follower].set(
            leader,
            Rule::DeafAfter(Box::new(|entry| carries(entry, SETTLE, b""))),
        );
    }
    let mut consumer = nodes[&leader]
        .broker
        .subscribe(QUEUE, COUNT as u32)
        .expect("subscribe at the leader");
    let mut tags = Vec::new();
    for _ in 0..COUNT {
        let delivery = tokio::time::timeout(WAIT, consumer.recv())
            .await
            .expect("a delivery")
            .expect("open");
        tags.push(delivery.tag);
    }
    consumer.ack(&tags);
    // Committed at the leader (a follower acknowledged the append).
    wait_info(
        &nodes[&leader].broker,
        QUEUE,
        WAIT,
        "the acks applied at the leader",
        |info| info.partitions[0].bytes == 0,
    )
    .await;
    drop(consumer);
    // The old leader is cut both ways; the followers elect one of them, which commits nothing
    // until its peer takes appends again.
    for follower in &followers {
        faults[&leader].set(*follower, Rule::Deaf);
    }
    faults[&followers[0]].set(followers[1], Rule::HeartbeatsOnly);
    faults[&followers[1]].set(followers[0], Rule::HeartbeatsOnly);
    let ids: BTreeSet<u64> = followers.iter().copied().collect();
    let successor = agreed_leader_among(&nodes, &ids, QUEUE, WAIT).await;
    let mut consumer = nodes[&successor]
        .broker
        .subscribe(QUEUE, COUNT as u32)
        .expect("subscribe at the successor");
    let hold = Duration::from_millis(1_000);
    if let Ok(Some(delivery)) = tokio::time::timeout(hold, consumer.recv()).await {
        panic!(
            "the new leader delivered message {} (redelivered {}) whose SETTLE its predecessor \
             committed, before applying it",
            delivery.tag.message, delivery.redelivered
        );
    }
    // Its peer takes appends again: the SETTLE is committed and applied, nothing is live.
    faults[&followers[0]].clear();
    faults[&followers[1]].clear();
    wait_info(
        &nodes[&successor].broker,
        QUEUE,
        WAIT,
        "the successor applied the predecessor's SETTLE",
        |info| info.partitions[0].bytes == 0,
    )
    .await;
    if let Ok(Some(delivery)) =
        tokio::time::timeout(Duration::from_millis(300), consumer.recv()).await
    {
        panic!(
            "an acked message was delivered again: {} (redelivered {})",
            delivery.tag.message, delivery.redelivered
        );
    }
    drop(consumer);
    for node_faults in faults.values() {
        node_faults.clear();
    }
    for (_, node) in nodes {
        node.stop().await;
    }
}
