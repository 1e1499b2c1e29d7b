//! Three nodes in one process, each a `Raft` over `LogStore` on its own temporary directory
//! (real files), joined by an in-memory network that honours the fences: elect a leader, commit
//! 1,000 writes, kill the leader (shut down and dropped, its logs closed), see a new leader
//! elected that commits more writes, check that every acknowledged write is on both survivors
//! (state machines and entry logs: index == offset, the record type and payload at the
//! offset), then restart the old leader from its directory and see it catch up to the same
//! records. It fails if a committed write is lost or moved, if no leader emerges, or if the
//! restarted node does not converge.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{check_has, initialize_three, kill, leader_among, start, write, Router};
use keratin_log::RealIo;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_survive_the_loss_of_the_leader() {
    let dirs: BTreeMap<u64, tempfile::TempDir> = (1..=3)
        .map(|id| (id, tempfile::tempdir().expect("temporary directory")))
        .collect();
    let router = Router::default();
    let mut nodes = BTreeMap::new();
    for (id, dir) in &dirs {
        nodes.insert(
            *id,
            start(*id, Arc::new(RealIo::new()), dir.path(), &router).await,
        );
    }
    initialize_three(&nodes).await;

    let leader = leader_among(&nodes).await;
    let mut acked = write(&nodes[&leader].raft, 0, 1_000).await;
    assert_eq!(acked.len(), 1_000);

    let old = nodes.remove(&leader).expect("leader");
    kill(leader, old, &router).await;
    let new_leader = leader_among(&nodes).await;
    assert_ne!(new_leader, leader);
    acked.extend(write(&nodes[&new_leader].raft, 1_000, 100).await);
    assert_eq!(acked.len(), 1_100);
    for (id, node) in &nodes {
        check_has(*id, node, &acked).await;
    }

    let restarted = start(
        leader,
        Arc::new(RealIo::new()),
        dirs[&leader].path(),
        &router,
    )
    .await;
    check_has(leader, &restarted, &acked).await;
    nodes.insert(leader, restarted);
    let reference = nodes[&new_leader].machine.records();
    for (id, node) in &nodes {
        assert_eq!(node.machine.records(), reference, "node {id} differs");
    }
    for (id, node) in nodes {
        kill(id, node, &router).await;
    }
}
