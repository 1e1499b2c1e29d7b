//! A stream partition's owner (`keratin_broker::stream::StreamPartition`) on a replicated log:
//! three replicas in-process, each on its own directory and `keratin-net` transport over
//! 127.0.0.1. One leads; it stores an idempotent producer's messages (4 KiB each, so the log
//! holds a dozen checkpoints, which every follower checks against its own state as it applies
//! them); a follower refuses an append as "not the leader", naming the leader's id and client
//! address; every follower applies and reads back the same messages at the same offsets. Then
//! the leader is shut down: the other two elect a leader, which finds the producer's retry of
//! its last message stored already (it applied its predecessor's records before taking any
//! append) and stores new ones after it, and the remaining follower reads them all. It fails
//! if a stored message is lost, moved or stored twice, if a checkpoint does not match on a
//! follower (it stops), or if no leader emerges within the bounds.
//!
//! A follower started again reports the partition's start and message count as the leader
//! does before it applies anything new, on a whole stream and on one whose retention removed
//! its first segments.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::brokers::{client_addr, client_addrs, place_in, replicated_logs, transport};
use keratin_broker::partition::log::{PartitionLog, PartitionLogs};
use keratin_broker::record::{Message, ProducerSeq};
use keratin_broker::stream::{Appended, StreamPartition, StreamPartitionConfig, StreamSettings};
use keratin_broker::{BrokerError, OpenGate};
use keratin_log::{RealIo, SizeClass, MIN_SEGMENT_SIZE_BYTES};
use keratin_net::Transport;
use keratin_raft::partition_log::ReplicatedLogs;

const WAIT: Duration = Duration::from_secs(10);
const PRODUCER: u64 = 7;
/// Messages stored at the first leader, and their body size.
const FIRST: u64 = 200;
const BODY: usize = 4 << 10;
/// Messages stored at the second leader.
const SECOND: u64 = 10;

struct Node {
    transport: Transport,
    _logs: Arc<ReplicatedLogs>,
    partition: StreamPartition,
}

fn config(settings: StreamSettings) -> StreamPartitionConfig {
    StreamPartitionConfig {
        stream: "events".into(),
        index: 0,
        dir: "stream-0".into(),
        device: 1,
        segment_bytes: MIN_SEGMENT_SIZE_BYTES,
        settings,
        retention_as_written: false,
    }
}

async fn start(net: &mut common::tcp::Loopback, id: u64) -> Node {
    start_with(net, id, StreamSettings::default()).await
}

async fn start_with(net: &mut common::tcp::Loopback, id: u64, settings: StreamSettings) -> Node {
    let listener = match net.listeners.remove(&id) {
        Some(listener) => listener,
        None => net.rebind(id).await,
    };
    let cluster = net.cluster(id);
    let (transport, groups) = transport(listener, cluster.clone());
    let logs = Arc::new(replicated_logs(
        cluster,
        transport.clone(),
        groups,
        client_addrs(),
    ));
    let place = place_in(
        net.dirs[&id].path(),
        Arc::new(RealIo),
        0,
        "stream-0",
        SizeClass::Full,
    );
    let opening = logs.clone();
    let log: Arc<dyn PartitionLog> = tokio::task::spawn_blocking(move || opening.open(&place))
        .await
        .expect("open task")
        .expect("the partition log opens");
    let partition = StreamPartition::open(log, Arc::new(OpenGate), config(settings))
        .await
        .expect("the stream partition opens");
    Node {
        transport,
        _logs: logs,
        partition,
    }
}

async fn stop(node: Node) {
    tokio::time::timeout(Duration::from_secs(20), node.partition.close())
        .await
        .expect("closed within 20 s")
        .expect("closes");
    node.transport.shutdown();
}

/// The one node that leads, once the others agree and the group's first leader handed it to
/// the preferred leader, node 1 (the first of the replica list), when node 1 is asked
/// (`common::brokers::settled`).
async fn leader(nodes: &BTreeMap<u64, Node>) -> u64 {
    let deadline = tokio::time::Instant::now() + WAIT;
    let preferred = nodes.contains_key(&1).then_some(1);
    let mut since = None;
    loop {
        let leading: Vec<u64> = nodes
            .iter()
            .filter(|(_, node)| node.partition.figures().leading)
            .map(|(id, _)| *id)
            .collect();
        let agreed = match leading[..] {
            [id] => nodes
                .iter()
                .all(|(other, node)| *other == id || node.partition.figures().leader == Some(id))
                .then_some(id),
            _ => None,
        };
        if let Some(id) = common::brokers::settled(agreed, preferred, &mut since) {
            return id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no agreed leader in {WAIT:?}: {leading:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn message(sequence: u64) -> Message {
    let mut message = Message::new(vec![(sequence % 251) as u8; BODY]);
    message.headers = vec![("n".into(), sequence.to_string())];
    message.producer = Some(ProducerSeq {
        producer: PRODUCER,
        sequence,
    });
    message
}

/// Appends sequences `from..from + count`, ten per append; their offsets.
async fn append(partition: &StreamPartition, from: u64, count: u64) -> Vec<u64> {
    let mut offsets = Vec::new();
    let sequences: Vec<u64> = (from..from + count).collect();
    for batch in sequences.chunks(10) {
        let messages = batch.iter().map(|s| message(*s)).collect();
        let appended = tokio::time::timeout(WAIT, partition.append(messages, 1_000))
            .await
            .expect("appended in time")
            .expect("appended");
        for outcome in appended {
            match outcome {
                Appended::Stored(offset) => offsets.push(offset),
                Appended::Duplicate => panic!("a new sequence stored as a duplicate"),
            }
        }
    }
    offsets
}

/// Every message a node holds, as (offset, sequence), once its end reaches `end`.
async fn read_all(node: &Node, end: u64) -> Vec<(u64, u64)> {
    let mut watch = node.partition.watch_end();
    tokio::time::timeout(WAIT, watch.wait_for(|at| *at >= end))
        .await
        .unwrap_or_else(|_| panic!("applied up to {end} in {WAIT:?}"))
        .expect("the partition runs");
    let mut held = Vec::new();
    let mut from = 0;
    while from < end {
        let read = node
            .partition
            .read(from, 4096, usize::MAX)
            .await
            .expect("reads");
        assert!(read.next > from, "a read moves on");
        for message in read.messages {
            let producer = message.message.producer.expect("a producer mark");
            assert_eq!(
                message.message.body,
                vec![(producer.sequence % 251) as u8; BODY]
            );
            held.push((message.offset, producer.sequence));
        }
        from = read.next;
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replicated_stream_partition_serves_from_its_leader_and_survives_its_loss() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start(&mut net, id).await);
    }
    let first_leader = leader(&nodes).await;
    let offsets = append(&nodes[&first_leader].partition, 1, FIRST).await;
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");
    let end = offsets.last().expect("offsets") + 1;
    let expected: Vec<(u64, u64)> = offsets.iter().copied().zip(1..=FIRST).collect();

    let follower = *nodes
        .keys()
        .find(|id| **id != first_leader)
        .expect("a follower");
    match nodes[&follower]
        .partition
        .append(vec![message(FIRST + 1)], 1_000)
        .await
    {
        Err(BrokerError::NotLeader { leader, addr, .. }) => {
            assert_eq!(leader, Some(first_leader));
            assert_eq!(addr.as_deref(), Some(client_addr(first_leader).as_str()));
        }
        other => panic!("a follower's append: {other:?}"),
    }
    for (id, node) in &nodes {
        assert_eq!(read_all(node, end).await, expected, "node {id}");
        let figures = node.partition.figures();
        assert_eq!(figures.messages, FIRST, "node {id}");
        assert!(!figures.stopped, "node {id}: every checkpoint matched");
    }

    let old = nodes.remove(&first_leader).expect("the leader");
    stop(old).await;
    let second_leader = leader(&nodes).await;
    let leading = &nodes[&second_leader].partition;
    let retry = tokio::time::timeout(WAIT, leading.append(vec![message(FIRST)], 2_000))
        .await
        .expect("answered in time")
        .expect("appended");
    assert_eq!(
        retry,
        vec![Appended::Duplicate],
        "stored by the first leader"
    );
    let more = append(leading, FIRST + 1, SECOND).await;
    assert!(more[0] >= end, "after the first leader's records: {more:?}");
    let mut expected = expected;
    expected.extend(more.iter().copied().zip(FIRST + 1..=FIRST + SECOND));
    let end = more.last().expect("offsets") + 1;
    for (id, node) in &nodes {
        assert_eq!(read_all(node, end).await, expected, "node {id}");
        assert_eq!(
            node.partition.figures().messages,
            FIRST + SECOND,
            "node {id}"
        );
        assert!(!node.partition.figures().stopped, "node {id}");
    }
    for node in nodes.into_values() {
        stop(node).await;
    }
}

/// Stop a follower of `leader` (taken out of `nodes`), start it again with `settings`, and
/// wait until it applied up to `end`; its id and the node.
async fn restart_a_follower(
    net: &mut common::tcp::Loopback,
    nodes: &mut BTreeMap<u64, Node>,
    leader: u64,
    settings: StreamSettings,
    end: u64,
) -> (u64, Node) {
    let follower = *nodes.keys().find(|id| **id != leader).expect("a follower");
    stop(nodes.remove(&follower).expect("the follower")).await;
    let again = start_with(net, follower, settings).await;
    let mut watch = again.partition.watch_end();
    tokio::time::timeout(WAIT, watch.wait_for(|at| *at >= end))
        .await
        .unwrap_or_else(|_| panic!("the restarted follower is at {end} in {WAIT:?}"))
        .expect("the partition runs");
    (follower, again)
}

/// A follower started again reports the partition's start (the offset of its first message)
/// and its message count as the leader does, before it applies anything new: the log holds
/// entries of its own (a membership, the leader's first entry) below the first message, so
/// neither 0 nor the log's start is the answer. Fails if a node's figures differ from the
/// leader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_follower_reports_the_start_and_count_the_leader_does() {
    const COUNT: u64 = 20;
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start(&mut net, id).await);
    }
    let leader_id = leader(&nodes).await;
    let offsets = append(&nodes[&leader_id].partition, 1, COUNT).await;
    let first = offsets[0];
    let end = offsets.last().expect("offsets") + 1;
    assert!(first > 0, "the log holds entries below the first message");
    for (id, node) in &nodes {
        read_all(node, end).await;
        let figures = node.partition.figures();
        assert_eq!(
            (figures.start, figures.messages),
            (first, COUNT),
            "node {id}"
        );
    }

    let (follower, again) = restart_a_follower(
        &mut net,
        &mut nodes,
        leader_id,
        StreamSettings::default(),
        end,
    )
    .await;
    let figures = again.partition.figures();
    assert_eq!(
        (figures.start, figures.messages, figures.end),
        (first, COUNT, end),
        "the restarted follower"
    );
    nodes.insert(follower, again);
    for node in nodes.into_values() {
        stop(node).await;
    }
}

/// As above on a stream whose retention removed its first segments (most 256 KiB): a
/// follower started again counts the messages held, not every message ever applied, and starts
/// where the leader does. Fails if its start or count differs from the leader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_follower_of_a_trimmed_stream_reports_the_start_and_count_the_leader_does() {
    const COUNT: u64 = 300;
    let settings = StreamSettings {
        max_bytes: Some(MIN_SEGMENT_SIZE_BYTES),
        ..StreamSettings::default()
    };
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start_with(&mut net, id, settings).await);
    }
    let leader_id = leader(&nodes).await;
    let offsets = append(&nodes[&leader_id].partition, 1, COUNT).await;
    let end = offsets.last().expect("offsets") + 1;
    // Every replica trims its own copy (the broker's timer asks each): once all applied
    // everything, each runs a pass; then they agree.
    for node in nodes.values() {
        read_all(node, end).await;
        node.partition
            .retention(2_000)
            .await
            .expect("a retention pass")
            .expect("it removes segments");
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    let held = loop {
        let figures: Vec<(u64, u64)> = nodes
            .values()
            .map(|node| {
                let f = node.partition.figures();
                (f.start, f.messages)
            })
            .collect();
        let leaders = nodes[&leader_id].partition.figures();
        if leaders.end >= end
            && leaders.start > offsets[0]
            && figures
                .iter()
                .all(|f| *f == (leaders.start, leaders.messages))
        {
            break (leaders.start, leaders.messages);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replicas never trimmed alike: {figures:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(held.1 < COUNT, "retention removed messages: {held:?}");
    assert_eq!(
        offsets.iter().filter(|o| **o >= held.0).count() as u64,
        held.1,
        "the count is what lies from the start"
    );

    let (follower, again) =
        restart_a_follower(&mut net, &mut nodes, leader_id, settings, end).await;
    let figures = again.partition.figures();
    assert_eq!(
        (figures.start, figures.messages),
        held,
        "the restarted follower"
    );
    nodes.insert(follower, again);
    for node in nodes.into_values() {
        stop(node).await;
    }
}
