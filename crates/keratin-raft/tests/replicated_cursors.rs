//! A stream's cursor log (`keratin_broker::stream::cursor_log::CursorLog`) on a replicated
//! log: three replicas in-process, each on its own directory and `keratin-net` transport over
//! 127.0.0.1. One leads; a follower refuses a commit as "not the leader", naming the leader's
//! id and client address; the leader commits four cursors' positions 300 times (long names,
//! so the owner compacts the log several times, each copy giving back what lies below a
//! snapshot), and every replica applies the same table. Then the leader is shut down: the
//! other two elect a leader whose table holds every acknowledged commit, which takes new
//! commits, and the remaining follower applies them. It fails if a commit is lost or differs
//! on a replica, or if no leader emerges within the bounds.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::brokers::{client_addr, client_addrs, place_in, replicated_logs, transport};
use keratin_broker::partition::log::{PartitionLog, PartitionLogs};
use keratin_broker::stream::cursor_log::{CursorLog, CURSOR_LOG_PARTITION};
use keratin_broker::stream::{CursorRecord, CursorState, CursorTable};
use keratin_broker::BrokerError;
use keratin_log::{RealIo, SizeClass};
use keratin_net::Transport;
use keratin_raft::partition_log::ReplicatedLogs;

const WAIT: Duration = Duration::from_secs(10);
/// Commits at the first leader, and at the second.
const FIRST: u64 = 300;
const SECOND: u64 = 20;
/// The segment size the owner's compaction rule reads: small, so it compacts every few
/// kilobytes of commits.
const COMPACTION_SEGMENT: u64 = 8 << 10;

struct Node {
    transport: Transport,
    _logs: Arc<ReplicatedLogs>,
    cursors: CursorLog,
}

async fn start(net: &mut common::tcp::Loopback, id: u64) -> Node {
    let listener = net.listeners.remove(&id).expect("a listener");
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
        255,
        "cursors",
        SizeClass::Small,
    );
    let opening = logs.clone();
    let log: Arc<dyn PartitionLog> = tokio::task::spawn_blocking(move || opening.open(&place))
        .await
        .expect("open task")
        .expect("the cursor log's partition log opens");
    let cursors = CursorLog::start("events", log, COMPACTION_SEGMENT)
        .await
        .expect("the cursor log starts");
    Node {
        transport,
        _logs: logs,
        cursors,
    }
}

async fn stop(node: Node) {
    tokio::time::timeout(Duration::from_secs(20), node.cursors.close())
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
            .filter(|(_, node)| node.cursors.figures().role.leading)
            .map(|(id, _)| *id)
            .collect();
        let agreed = match leading[..] {
            [id] => nodes
                .iter()
                .all(|(other, node)| *other == id || node.cursors.figures().role.leader == Some(id))
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

fn name(i: u64) -> String {
    format!("{}-{}", "group".repeat(40), i % 4)
}

/// Commit `i`: cursor `name(i)` at partition `i % 3`, offset `i`.
fn commit(i: u64) -> (String, Vec<(u32, u64)>) {
    (name(i), vec![((i % 3) as u32, i)])
}

/// Commits `from..from + count` at `cursors`, each answered before the next; the model
/// updated with each.
async fn commit_all(cursors: &CursorLog, from: u64, count: u64, model: &mut CursorTable) {
    for i in from..from + count {
        let (name, positions) = commit(i);
        tokio::time::timeout(WAIT, cursors.commit(&name, &positions, 1_000 + i))
            .await
            .expect("answered in time")
            .unwrap_or_else(|e| panic!("commit {i}: {e}"));
        let record = CursorRecord::Commit {
            name: name.clone(),
            positions,
        };
        model.apply(&record, 1_000 + i);
    }
}

fn entries(table: &CursorTable) -> Vec<(String, CursorState)> {
    table
        .iter()
        .map(|(name, state)| (name.to_string(), state.clone()))
        .collect()
}

/// Waits until `node`'s table is `model`.
async fn applied(id: u64, node: &Node, model: &CursorTable) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while entries(&node.cursors.table()) != entries(model) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {id}: its table is not the leader's within {WAIT:?}: {:?}",
            entries(&node.cursors.table())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replicated_cursor_log_keeps_every_commit_across_compactions_and_a_failover() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start(&mut net, id).await);
    }
    let first_leader = leader(&nodes).await;
    let follower = *nodes
        .keys()
        .find(|id| **id != first_leader)
        .expect("a follower");
    match nodes[&follower].cursors.commit("x", &[(0, 1)], 1_000).await {
        Err(BrokerError::NotLeader {
            partition,
            leader,
            addr,
            ..
        }) => {
            assert_eq!(partition, CURSOR_LOG_PARTITION);
            assert_eq!(leader, Some(first_leader));
            assert_eq!(addr.as_deref(), Some(client_addr(first_leader).as_str()));
        }
        other => panic!("a follower's commit: {other:?}"),
    }

    let mut model = CursorTable::new();
    commit_all(&nodes[&first_leader].cursors, 0, FIRST, &mut model).await;
    let compactions = nodes[&first_leader].cursors.figures().compactions;
    assert!(compactions >= 3, "{compactions} compactions");
    for (id, node) in &nodes {
        applied(*id, node, &model).await;
    }

    let old = nodes.remove(&first_leader).expect("the leader");
    stop(old).await;
    let second_leader = leader(&nodes).await;
    assert_eq!(
        entries(&nodes[&second_leader].cursors.table()),
        entries(&model),
        "the new leader holds every acknowledged commit"
    );
    commit_all(&nodes[&second_leader].cursors, FIRST, SECOND, &mut model).await;
    for (id, node) in &nodes {
        applied(*id, node, &model).await;
    }
    for node in nodes.into_values() {
        stop(node).await;
    }
}
