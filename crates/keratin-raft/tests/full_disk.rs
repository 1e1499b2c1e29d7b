//! A full disk under a live group never reaches openraft as a storage error. Three nodes, each
//! on its own simulated disk (`SimIo`), joined by the fence-honouring in-memory network:
//!
//! - a follower's disk refuses its next calls with `ENOSPC`: the follower's store fences, its
//!   `Raft` keeps running without a fatal error, the leader keeps committing with the other
//!   follower, and once space is back the owner shuts the follower's `Raft` down, heals its
//!   logs and starts a new `Raft` that catches up to every acknowledged write;
//! - the leader's disk does the same while writes are in flight: the leader fences and goes
//!   silent, the others elect a new leader that commits more writes, and the old leader,
//!   rebuilt after the heal, converges on the same records.
//!
//! It fails if openraft reports a fatal error on a fenced node, if the group stops committing
//! while a majority has room, if an acknowledged write is lost, or if a rebuilt node diverges.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{
    check_has, initialize_three, leader_among, run_with, start, stop, write, Node, Router,
};
use keratin_log::{SimFault, SimIo};
use keratin_raft::PartitionRecord;
use openraft::async_runtime::watch::WatchReceiver;

const DIR: &str = "/node/partition";

async fn cluster(router: &Router) -> (BTreeMap<u64, SimIo>, BTreeMap<u64, Node>) {
    let disks: BTreeMap<u64, SimIo> = (1..=3).map(|id| (id, SimIo::new(id))).collect();
    let mut nodes = BTreeMap::new();
    for (id, disk) in &disks {
        let node = start(*id, Arc::new(disk.clone()), Path::new(DIR), router).await;
        nodes.insert(*id, node);
    }
    initialize_three(&nodes).await;
    (disks, nodes)
}

/// The disk refuses its next few calls with `ENOSPC` (whatever they are: a write, a sync, an
/// allocation), as a disk that just filled would.
fn fill(disk: &SimIo) {
    let next = disk.steps();
    for step in next..next + 4 {
        disk.fail_at(step, SimFault::NoSpace);
    }
}

async fn wait_fenced(id: u64, node: &Node) {
    tokio::time::timeout(Duration::from_secs(10), node.fence.tripped())
        .await
        .unwrap_or_else(|_| panic!("node {id}'s store did not fence within 10 s"));
    let metrics = node.raft.metrics().borrow_watched().clone();
    assert!(
        metrics.running_state.is_ok(),
        "node {id}: openraft saw a fatal error: {:?}",
        metrics.running_state
    );
}

/// Shut the fenced node's `Raft` down, heal its logs and start a new one.
async fn rebuild(id: u64, nodes: &mut BTreeMap<u64, Node>, router: &Router) {
    let node = nodes.remove(&id).expect("node");
    let reason = node.fence.reason().expect("fenced");
    eprintln!("node {id} fenced: {reason}");
    let logs = stop(id, node, router).await;
    // The owner retries the heal until the disk takes calls again (each failed attempt here
    // uses up one of the refused calls).
    let mut attempts = 0;
    let store = loop {
        match logs.heal().and_then(|()| logs.store()) {
            Ok(store) => break store,
            Err(e) => {
                attempts += 1;
                assert!(attempts < 20, "node {id}: heal after {reason}: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    nodes.insert(id, run_with(id, logs, store, router).await);
}

/// Every node applies up to the same last log id and holds the same records.
async fn converge(nodes: &BTreeMap<u64, Node>, leader: u64) {
    let last = nodes[&leader].raft.metrics().borrow_watched().last_applied;
    for (id, node) in nodes {
        node.raft
            .wait(Some(Duration::from_secs(10)))
            .applied_index_at_least(last.map(|l| l.index), "converge")
            .await
            .unwrap_or_else(|e| panic!("node {id}: {e}"));
    }
    let reference = nodes[&leader].machine.records();
    for (id, node) in nodes {
        assert_eq!(node.machine.records(), reference, "node {id} differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_follower_is_fenced_then_rebuilt() {
    let router = Router::default();
    let (disks, mut nodes) = cluster(&router).await;
    let leader = leader_among(&nodes).await;
    let mut acked = write(&nodes[&leader].raft, 0, 200).await;

    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    fill(&disks[&follower]);
    // The leader and the other follower are a majority with room: writes keep committing.
    acked.extend(write(&nodes[&leader].raft, 200, 200).await);
    wait_fenced(follower, &nodes[&follower]).await;
    assert_eq!(leader_among(&nodes).await, leader, "leadership moved");

    rebuild(follower, &mut nodes, &router).await;
    for (id, node) in &nodes {
        check_has(*id, node, &acked).await;
    }
    converge(&nodes, leader).await;
    for (id, node) in nodes {
        common::kill(id, node, &router).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_leader_is_fenced_and_replaced_then_rebuilt() {
    let router = Router::default();
    let (disks, mut nodes) = cluster(&router).await;
    let old = leader_among(&nodes).await;
    let mut acked = write(&nodes[&old].raft, 0, 200).await;

    fill(&disks[&old]);
    // Writes in flight while the leader's disk fills: each is acknowledged or not; none may
    // be lost once acknowledged.
    let mut in_flight = Vec::new();
    for n in 200..250u64 {
        let raft = nodes[&old].raft.clone();
        in_flight.push(tokio::spawn(async move {
            let payload = format!("message {n}").into_bytes();
            let record = PartitionRecord::new(1, n, payload.clone()).expect("record");
            let write = tokio::time::timeout(Duration::from_secs(5), raft.client_write(record));
            match write.await {
                Ok(Ok(response)) => Some((response.log_id.index, payload)),
                _ => None,
            }
        }));
    }
    wait_fenced(old, &nodes[&old]).await;

    let others: BTreeMap<u64, Node> = {
        let mut rest = std::mem::take(&mut nodes);
        let old_node = rest.remove(&old).expect("old leader");
        nodes.insert(old, old_node);
        rest
    };
    let new = leader_among(&others).await;
    assert_ne!(new, old);
    acked.extend(write(&others[&new].raft, 1_000, 100).await);
    nodes.extend(others);

    rebuild(old, &mut nodes, &router).await;
    for write in in_flight {
        if let Some((offset, payload)) = write.await.expect("write task") {
            assert!(
                acked.insert(offset, payload).is_none(),
                "offset {offset} twice"
            );
        }
    }
    for (id, node) in &nodes {
        check_has(*id, node, &acked).await;
    }
    converge(&nodes, new).await;
    for (id, node) in nodes {
        common::kill(id, node, &router).await;
    }
}
