//! Membership changes of a live partition group: in-process brokers with `ReplicatedLogs` over
//! the real network on 127.0.0.1 (segments of 256 KiB), the group formed on nodes 1 to 3, a
//! fourth node in every peer list.
//!
//! - A replica moves: after messages were acked and the logs freed (a snapshot exists), a
//!   follower of {1,2,3} is replaced by node 4 (opened as joining) while publishes go on;
//!   node 4 catches up and counts every live message, the removed node retires (its data
//!   removed) without disturbing the group, and once the leader is stopped the group elects
//!   among the rest with node 4's vote and delivers every confirmed, unacked message and no
//!   acked one. Fails if node 4 misses a message, if a publish is not confirmed, if the
//!   removed node's elections change the leader's term, or if anything is lost or comes back.
//! - The leader removes itself: a new leader is elected among the others, nothing confirmed is
//!   lost, and the former leader is left a learner that can retire.
//! - A joining replica never initializes: node 4 opened alone holds no membership (a replica
//!   that formed the group would hold one at offset 0, as node 1 does in the same test once a
//!   majority of the formation is known to hold nothing of the group; before, it waits).
//! - Node 4 stopped in the middle of catching up and started again resumes, and the change
//!   completes.
//! - A voter of a group that has committed nothing yet (no leader ever elected) is still a
//!   voter: it may not retire, though the membership it knows committed is empty (it retired
//!   at once before, and its data went while the group needed its vote).

mod common;

use common::brokers::{body, three_replicas as settings};

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::brokers::{wait_info, BrokerNode};
use keratin_broker::{Broker, BrokerError, Consumer, Message};
use keratin_log::MIN_SEGMENT_SIZE_BYTES;
use keratin_net::GroupId;
use keratin_raft::partition_log::partition_group;
use keratin_raft::replica::MembershipError;
use openraft::async_runtime::watch::WatchReceiver;

const QUEUE: &str = "moves";
const QUEUE_ID: u64 = 9;
const WAIT: Duration = Duration::from_secs(30);

fn group() -> GroupId {
    partition_group(QUEUE_ID, 0).expect("group id")
}

fn bodies(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| body(prefix, n)).collect()
}

/// Start node `id` with the queue placed on `replicas`, its group formed with `formation`.
async fn start_node(
    net: &mut common::tcp::Loopback,
    id: u64,
    replicas: &[u64],
    formation: &[u64],
) -> BrokerNode {
    let listener = match net.listeners.remove(&id) {
        Some(listener) => listener,
        None => net.rebind(id).await,
    };
    let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
    let formation = if formation == replicas {
        Vec::new()
    } else {
        vec![formation.to_vec()]
    };
    node.broker
        .declare_replicated_formed(
            QUEUE_ID,
            QUEUE,
            settings(),
            vec![replicas.to_vec()],
            formation,
        )
        .await
        .expect("declare");
    node
}

/// The node among `ids` that leads, with every one of them agreeing.
async fn leader_among(nodes: &BTreeMap<u64, BrokerNode>, ids: &BTreeSet<u64>) -> u64 {
    common::brokers::agreed_leader_among(nodes, ids, QUEUE, WAIT).await
}

/// Publish `bodies` in batches of 50 at whichever of `nodes` leads, retrying a batch refused
/// as "not the leader" (nothing written); every message must be confirmed.
async fn publish(nodes: &BTreeMap<u64, &Broker>, bodies: &[String]) {
    let deadline = tokio::time::Instant::now() + WAIT;
    for batch in bodies.chunks(50) {
        'batch: loop {
            for broker in nodes.values() {
                let messages: Vec<Message> =
                    batch.iter().map(|b| Message::new(b.clone())).collect();
                let results = broker.publish(QUEUE, messages).await;
                if results
                    .iter()
                    .all(|r| matches!(r, Err(BrokerError::NotLeader { .. })))
                {
                    continue;
                }
                for result in results {
                    result.expect("publish confirmed");
                }
                break 'batch;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no leader took a publish in {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Receive `count` deliveries and ack them all; returns their bodies.
async fn consume_and_ack(consumer: &mut Consumer, count: usize) -> Vec<String> {
    let mut got = Vec::new();
    while got.len() < count {
        let delivery = tokio::time::timeout(WAIT, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of {count} deliveries in {WAIT:?}", got.len()))
            .expect("the consumer is open");
        got.push(String::from_utf8(delivery.message.body.clone()).expect("utf-8"));
        consumer.ack(&[delivery.tag]);
    }
    got
}

/// Publish and ack `acked` messages at `leader`, leave `live` ones, and wait until every node
/// of `ids` freed its log below them (so the leader holds a snapshot).
async fn acked_then_live(
    nodes: &BTreeMap<u64, BrokerNode>,
    leader: u64,
    acked: &[String],
    live: &[String],
) {
    let brokers: BTreeMap<u64, &Broker> = [(leader, &nodes[&leader].broker)].into();
    publish(&brokers, acked).await;
    let mut consumer = nodes[&leader]
        .broker
        .subscribe(QUEUE, 200)
        .expect("subscribe");
    assert_eq!(consume_and_ack(&mut consumer, acked.len()).await, acked);
    drop(consumer);
    publish(&brokers, live).await;
    for (id, node) in nodes {
        wait_info(
            &node.broker,
            QUEUE,
            WAIT,
            &format!("node {id} freed its log below the live messages"),
            |info| info.partitions[0].disk_bytes <= 3 * MIN_SEGMENT_SIZE_BYTES,
        )
        .await;
    }
    let raft = nodes[&leader]
        .logs
        .raft(group())
        .expect("the leader's group");
    let metrics = raft.metrics().borrow_watched().clone();
    assert!(
        metrics.snapshot.is_some() && metrics.purged.is_some(),
        "the leader holds a snapshot and purged below it: {metrics:?}"
    );
}

/// The current term as node `id` sees it.
fn term(node: &BrokerNode) -> u64 {
    let raft = node.logs.raft(group()).expect("group open");
    let metrics = raft.metrics().borrow_watched().clone();
    metrics.current_term
}

/// Every live message is delivered once at the leader among `ids`, and nothing else.
async fn delivers_exactly(nodes: &BTreeMap<u64, BrokerNode>, ids: &BTreeSet<u64>, live: &[String]) {
    let leader = leader_among(nodes, ids).await;
    let mut consumer = nodes[&leader]
        .broker
        .subscribe(QUEUE, 500)
        .expect("subscribe at the leader");
    let got: BTreeSet<String> = consume_and_ack(&mut consumer, live.len())
        .await
        .into_iter()
        .collect();
    let wanted: BTreeSet<String> = live.iter().cloned().collect();
    assert_eq!(got.len(), live.len(), "a message delivered twice");
    assert_eq!(got, wanted, "every confirmed live message");
    // Nothing acked comes back (the consumer holds every delivery the leader had ready).
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Some(delivery) = consumer.try_recv() {
        panic!(
            "delivered after every live message: {:?}",
            String::from_utf8_lossy(&delivery.message.body[..20])
        );
    }
}

/// Four nodes' network, nodes 1 to 3 started with the group formed on them.
async fn start_three() -> (common::tcp::Loopback, BTreeMap<u64, BrokerNode>) {
    let mut net = common::tcp::nodes(4).await;
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start_node(&mut net, id, &[1, 2, 3], &[1, 2, 3]).await);
    }
    (net, nodes)
}

async fn stop_all(nodes: BTreeMap<u64, BrokerNode>) {
    for (_, node) in nodes {
        node.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_moves_to_a_new_node_while_publishes_go_on() {
    let (mut net, mut nodes) = start_three().await;
    let first = leader_among(&nodes, &[1, 2, 3].into()).await;
    let acked = bodies("acked", 1_000);
    let mut live = bodies("live", 100);
    acked_then_live(&nodes, first, &acked, &live).await;

    // Node 4 opens its replica as joining: it knows nothing of the group yet.
    nodes.insert(4, start_node(&mut net, 4, &[1, 2, 4], &[1, 2, 3]).await);
    let (latest, _) = nodes[&4].logs.members(group()).await.expect("members");
    assert_eq!(
        latest.offset, None,
        "node 4 holds no membership: {latest:?}"
    );

    // A follower leaves; node 4 takes its place, while publishes go on.
    let removed = *[1, 2, 3]
        .iter()
        .find(|id| **id != first)
        .expect("a follower");
    let target: BTreeSet<u64> = [1, 2, 3, 4]
        .into_iter()
        .filter(|id| *id != removed)
        .collect();
    let during = bodies("during", 200);
    let brokers: BTreeMap<u64, &Broker> = [(first, &nodes[&first].broker)].into();
    let (changed, ()) = tokio::join!(
        nodes[&first]
            .logs
            .change_voters(group(), &target, Duration::from_secs(20)),
        publish(&brokers, &during),
    );
    let members = changed.expect("voters changed");
    assert_eq!(members.voters, target);
    assert!(!members.joint);
    assert!(
        members.learners.contains(&removed),
        "the removed voter stays a learner until it retires: {members:?}"
    );
    // Idempotent: the same target again is answered at once, with nothing written.
    let again = nodes[&first]
        .logs
        .change_voters(group(), &target, Duration::from_secs(1))
        .await
        .expect("same voters");
    assert_eq!(again.offset, members.offset);
    let after = bodies("after", 100);
    publish(&brokers, &after).await;
    live.extend(during);
    live.extend(after);

    // Node 4 holds every live message.
    wait_info(
        &nodes[&4].broker,
        QUEUE,
        WAIT,
        "node 4 counts every live message",
        |info| info.partitions[0].ready == live.len() as u64,
    )
    .await;

    // The removed node stops taking part: it learns that the membership without it committed,
    // so it never campaigns. Several election timeouts with it still running: a removed voter
    // that still thought it votes (openraft's `retain = false` leaves it in the joint
    // membership) would raise its term at each, and could not retire.
    let terms_before = (term(&nodes[&first]), term(&nodes[&removed]));
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        (term(&nodes[&first]), term(&nodes[&removed])),
        terms_before,
        "no election since the change (leader's term, removed node's term)"
    );
    // It retires: its replica's data goes. The broker's partition directory is
    // `queues/<queue id>/<index>` under its storage directory.
    let storage = nodes[&removed].broker.info(QUEUE).expect("info").partitions[0]
        .dir
        .clone();
    let dir = storage.join("queues").join(QUEUE_ID.to_string()).join("0");
    assert!(dir.join("entries").exists(), "the replica's logs: {dir:?}");
    nodes[&removed]
        .logs
        .retire(group(), WAIT)
        .await
        .expect("the removed node retires");
    assert!(
        !dir.exists(),
        "the retired replica's data is removed: {dir:?} holds {:?}",
        std::fs::read_dir(&dir).map(|d| d.map(|e| e.map(|e| e.path())).collect::<Vec<_>>())
    );
    let forgotten = nodes[&first]
        .logs
        .remove_learners(group(), &[removed].into())
        .await
        .expect("the leader forgets it");
    assert!(!forgotten.learners.contains(&removed), "{forgotten:?}");
    nodes.remove(&removed).expect("removed node").stop().await;

    // The old leader goes: the rest elect with node 4's vote, and every confirmed, unacked
    // message is delivered, none of the acked ones.
    nodes.remove(&first).expect("first leader").stop().await;
    let rest: BTreeSet<u64> = target.iter().copied().filter(|id| *id != first).collect();
    let second = leader_among(&nodes, &rest).await;
    let brokers: BTreeMap<u64, &Broker> = [(second, &nodes[&second].broker)].into();
    let last = bodies("last", 20);
    publish(&brokers, &last).await;
    live.extend(last);
    delivers_exactly(&nodes, &rest, &live).await;
    stop_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_removes_itself_and_another_takes_over() {
    let mut net = common::tcp::nodes(3).await;
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start_node(&mut net, id, &[1, 2, 3], &[1, 2, 3]).await);
    }
    let first = leader_among(&nodes, &[1, 2, 3].into()).await;
    let live = bodies("live", 300);
    let brokers: BTreeMap<u64, &Broker> = [(first, &nodes[&first].broker)].into();
    publish(&brokers, &live).await;

    let rest: BTreeSet<u64> = [1, 2, 3].into_iter().filter(|id| *id != first).collect();
    let members = nodes[&first]
        .logs
        .change_voters(group(), &rest, Duration::from_secs(20))
        .await
        .expect("the leader removes itself");
    assert_eq!(members.voters, rest);
    let second = leader_among(&nodes, &rest).await;
    assert_ne!(second, first);
    // The former leader stepped down, knows it is out of the group, and retires.
    wait_info(
        &nodes[&first].broker,
        QUEUE,
        WAIT,
        "the former leader stepped down",
        |info| !info.partitions[0].leading,
    )
    .await;
    let (latest, committed) = nodes[&first].logs.members(group()).await.expect("members");
    assert_eq!(committed.voters, rest, "{committed:?}");
    assert!(
        !latest.voters.contains(&first) && !latest.learners.contains(&first),
        "the former leader removed itself from the nodes: {latest:?}"
    );
    nodes[&first]
        .logs
        .retire(group(), WAIT)
        .await
        .expect("the former leader retires");
    nodes.remove(&first).expect("former leader").stop().await;
    let more = bodies("more", 50);
    let brokers: BTreeMap<u64, &Broker> = [(second, &nodes[&second].broker)].into();
    publish(&brokers, &more).await;
    let all: Vec<String> = live.into_iter().chain(more).collect();
    delivers_exactly(&nodes, &rest, &all).await;
    stop_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_replica_never_initializes() {
    let mut net = common::tcp::nodes(4).await;
    // Node 4 alone, joining a group formed on 1 to 3 (none of them running).
    let joining = start_node(&mut net, 4, &[1, 2, 4], &[1, 2, 3]).await;
    let (latest, committed) = joining.logs.members(group()).await.expect("members");
    assert_eq!(latest.offset, None, "no membership in its log: {latest:?}");
    assert!(latest.voters.is_empty(), "{latest:?}");
    assert!(committed.voters.is_empty(), "{committed:?}");
    // Nor later: with a membership of its own it would campaign, and lead a group of its own
    // formation after a few election timeouts.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let (latest, _) = joining.logs.members(group()).await.expect("members");
    assert_eq!(latest.offset, None, "no membership in its log: {latest:?}");
    let info = joining.broker.info(QUEUE).expect("info");
    assert_eq!(info.partitions[0].leader, None, "{info:?}");
    // A joining replica is not the leader and refuses membership changes with that reason.
    let refused = joining
        .logs
        .change_voters(group(), &[4].into(), Duration::from_secs(1))
        .await
        .expect_err("not the leader");
    assert!(
        matches!(refused, MembershipError::NotLeader { leader: None, .. }),
        "{refused}"
    );
    // A forming replica (node 1, in the formation) waits while it cannot tell whether the
    // group exists (nodes 2 and 3 down)...
    let forming = start_node(&mut net, 1, &[1, 2, 3], &[1, 2, 3]).await;
    tokio::time::sleep(3 * keratin_raft::replica::FORMATION_RETRY).await;
    let (latest, _) = forming.logs.members(group()).await.expect("members");
    assert_eq!(
        latest.offset, None,
        "formed with most of the formation down: {latest:?}"
    );
    // ...and forms it, the formation at offset 0, once a majority is known to hold nothing of
    // it: node 3 runs without the queue (it answers that it serves no such group).
    let listener = net.listeners.remove(&3).expect("node 3's listener");
    let bare = common::brokers::start(net.dirs[&3].path(), listener, net.cluster(3)).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let (latest, committed) = loop {
        let (latest, committed) = forming.logs.members(group()).await.expect("members");
        if latest.offset.is_some() {
            break (latest, committed);
        }
        assert!(tokio::time::Instant::now() < deadline, "never formed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(latest.offset, Some(0), "{latest:?}");
    assert_eq!(latest.voters, [1, 2, 3].into());
    // Nothing committed yet (nodes 2 and 3 are down: no leader), yet node 1 votes: it may
    // not retire. The joining node 4, in no membership, may.
    assert!(committed.voters.is_empty(), "{committed:?}");
    let still = forming
        .logs
        .wait_retired(group(), Duration::from_millis(300))
        .await
        .expect_err("a voter of a young group does not retire");
    assert!(
        matches!(still, MembershipError::StillVoter { node: 1, .. }),
        "{still}"
    );
    joining
        .logs
        .wait_retired(group(), Duration::from_millis(300))
        .await
        .expect("a replica in no membership holds no vote");
    // An empty target is refused before anything else.
    let empty = forming
        .logs
        .change_voters(group(), &BTreeSet::new(), Duration::from_secs(1))
        .await
        .expect_err("empty");
    assert!(
        matches!(empty, MembershipError::EmptyTarget { .. }),
        "{empty}"
    );
    joining.stop().await;
    forming.stop().await;
    bare.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_node_restarted_mid_catch_up_completes() {
    let (mut net, mut nodes) = start_three().await;
    let first = leader_among(&nodes, &[1, 2, 3].into()).await;
    // Enough live messages (6 MB) that catching up takes a while.
    let live = bodies("live", 6_000);
    let brokers: BTreeMap<u64, &Broker> = [(first, &nodes[&first].broker)].into();
    publish(&brokers, &live).await;

    nodes.insert(4, start_node(&mut net, 4, &[1, 2, 4], &[1, 2, 3]).await);
    let removed = *[1, 2, 3]
        .iter()
        .find(|id| **id != first)
        .expect("a follower");
    let target: BTreeSet<u64> = [1, 2, 3, 4]
        .into_iter()
        .filter(|id| *id != removed)
        .collect();
    let logs = nodes[&first].logs.clone();
    let change_target = target.clone();
    let change = tokio::spawn(async move {
        logs.change_voters(group(), &change_target, Duration::from_secs(60))
            .await
    });
    // Stop node 4 once it has part of the log, not all of it.
    let info = wait_info(
        &nodes[&4].broker,
        QUEUE,
        WAIT,
        "node 4 started catching up",
        |info| info.partitions[0].ready > 0,
    )
    .await;
    nodes.remove(&4).expect("node 4").stop().await;
    assert!(
        info.partitions[0].ready < live.len() as u64,
        "node 4 was stopped mid-catch-up: {info:?}"
    );
    assert!(!change.is_finished(), "the change waits for node 4");

    // Back from its directory (its metadata log still says it joins): it resumes.
    nodes.insert(4, start_node(&mut net, 4, &[1, 2, 4], &[1, 2, 3]).await);
    let members = tokio::time::timeout(WAIT * 2, change)
        .await
        .expect("the change completes")
        .expect("change task")
        .expect("voters changed");
    assert_eq!(members.voters, target);
    wait_info(
        &nodes[&4].broker,
        QUEUE,
        WAIT,
        "node 4 counts every live message",
        |info| info.partitions[0].ready == live.len() as u64,
    )
    .await;
    stop_all(nodes).await;
}

/// A change to a new node that is not running ends with a typed error that says so (the node
/// cannot say which copy of the group it holds), and the members stay as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_node_that_does_not_catch_up_leaves_the_voters_unchanged() {
    let (_net, nodes) = start_three().await;
    let first = leader_among(&nodes, &[1, 2, 3].into()).await;
    let brokers: BTreeMap<u64, &Broker> = [(first, &nodes[&first].broker)].into();
    publish(&brokers, &bodies("live", 10)).await;
    let error = nodes[&first]
        .logs
        .change_voters(group(), &[1, 2, 3, 4].into(), Duration::from_millis(1_500))
        .await
        .expect_err("node 4 is down");
    // Node 4 cannot say which copy of the group it holds: it is not even added.
    assert!(
        matches!(error, MembershipError::NoCopy { node: 4, .. }),
        "{error}"
    );
    let (latest, committed) = nodes[&first].logs.members(group()).await.expect("members");
    assert_eq!(committed.voters, [1, 2, 3].into());
    assert_eq!(latest.voters, [1, 2, 3].into());
    assert!(latest.learners.is_empty(), "{latest:?}");
    // A voter's replica does not retire: its vote may be needed.
    let still = nodes[&first]
        .logs
        .retire(group(), Duration::from_millis(300))
        .await
        .expect_err("a voter");
    assert!(
        matches!(still, MembershipError::StillVoter { .. }),
        "{still}"
    );
    assert!(nodes[&first].logs.raft(group()).is_some(), "still open");
    // On a follower: refused, naming the leader.
    let follower = *[1, 2, 3].iter().find(|id| **id != first).expect("follower");
    let refused = nodes[&follower]
        .logs
        .change_voters(group(), &[1, 2, 3].into(), Duration::from_secs(1))
        .await
        .expect_err("not the leader");
    assert!(
        matches!(refused, MembershipError::NotLeader { leader: Some(l), .. } if l == first),
        "{refused}"
    );
    stop_all(nodes).await;
}

/// A membership change cut between its two entries (its leader lost once the joint entry
/// committed, before the uniform one) leaves the group joint: a committed joint membership,
/// written here as the cut leaves it (openraft's `append_membership`, one entry). Node 3, a
/// voter of its old half, cannot retire while it lasts; `change_voters` on the leader, as the
/// cluster's reconciler calls it for every group it leads, finishes it toward the target, and
/// node 3 then retires. Fails if the joint membership stays, or if node 3 retires while it is
/// a voter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_cut_between_its_entries_is_finished() {
    let (_net, nodes) = start_three().await;
    let leader = leader_among(&nodes, &[1, 2, 3].into()).await;
    let brokers: BTreeMap<u64, &Broker> = [(leader, &nodes[&leader].broker)].into();
    publish(&brokers, &bodies("before", 20)).await;
    let raft = nodes[&leader]
        .logs
        .raft(group())
        .expect("the leader's group");
    let current = raft.metrics().borrow_watched().membership_config.clone();
    let leaving = *[1, 2, 3]
        .iter()
        .find(|id| **id != leader)
        .expect("a follower");
    let rest: BTreeSet<u64> = [1, 2, 3].into_iter().filter(|id| *id != leaving).collect();
    let joint = keratin_raft::Membership::new(
        vec![[1, 2, 3].into(), rest.clone()],
        current
            .membership()
            .nodes()
            .map(|(id, node)| (*id, node.clone()))
            .collect::<BTreeMap<_, _>>(),
    )
    .expect("joint membership");
    raft.append_membership(joint, keratin_raft::Payload::Blank, [])
        .await
        .expect("the joint entry commits");
    let (latest, committed) = nodes[&leader].logs.members(group()).await.expect("members");
    assert!(
        latest.joint && latest == committed,
        "{latest:?} / {committed:?}"
    );
    let still = nodes[&leaving]
        .logs
        .wait_retired(group(), Duration::from_millis(500))
        .await
        .expect_err("a voter of the joint membership");
    assert!(
        matches!(still, MembershipError::StillVoter { .. }),
        "{still}"
    );

    let finished = nodes[&leader]
        .logs
        .change_voters(group(), &rest, WAIT)
        .await
        .expect("the change is finished");
    assert!(!finished.joint, "{finished:?}");
    assert_eq!(finished.voters, rest);
    nodes[&leaving]
        .logs
        .wait_retired(group(), WAIT)
        .await
        .expect("node 3 may retire once the uniform membership committed");
    publish(&brokers, &bodies("after", 20)).await;
    stop_all(nodes).await;
}
