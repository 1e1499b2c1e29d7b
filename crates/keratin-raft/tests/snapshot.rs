//! A node that missed entries the leader has purged catches up through a snapshot. Three
//! nodes on real temporary directories: 300 writes reach everyone, one follower is killed, 700
//! more writes go to the other two, the leader builds a snapshot and purges its log up to it
//! (whole 256 KiB segments leave its entry log), then the follower restarts from its directory
//! with an empty state machine: it re-applies its own log, installs the leader's snapshot,
//! purges past its log's end (its entry log restarts at the snapshot's next index) and takes the
//! next entries at their own indexes (index == offset holds). It fails if the follower does not converge on the same
//! records, if an acknowledged write is missing anywhere, or if the offsets on the follower's
//! entry log do not match the indexes.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{check_has, initialize_three, kill, leader_among, start, write, Router};
use keratin_log::RealIo;
use keratin_raft::entry_format::decode_entry;
use openraft::async_runtime::watch::WatchReceiver;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lagging_follower_catches_up_through_a_snapshot() {
    let dirs: BTreeMap<u64, tempfile::TempDir> = (1..=3)
        .map(|id| (id, tempfile::tempdir().expect("temporary directory")))
        .collect();
    let router = Router::default();
    let mut nodes = BTreeMap::new();
    for (id, dir) in &dirs {
        let node = start(*id, Arc::new(RealIo::new()), dir.path(), &router).await;
        nodes.insert(*id, node);
    }
    initialize_three(&nodes).await;
    let leader = leader_among(&nodes).await;
    let mut acked = write(&nodes[&leader].raft, 0, 300).await;
    let lagging = (1..=3).find(|id| *id != leader).expect("a follower");
    for (id, node) in &nodes {
        check_has(*id, node, &acked).await;
    }
    let node = nodes.remove(&lagging).expect("follower");
    kill(lagging, node, &router).await;

    acked.extend(write(&nodes[&leader].raft, 300, 700).await);
    let raft = &nodes[&leader].raft;
    let last = *acked.keys().next_back().expect("writes");
    let wait = || raft.wait(Some(Duration::from_secs(10)));
    wait()
        .applied_index_at_least(Some(last), "applied")
        .await
        .expect("applied");
    raft.trigger().snapshot().await.expect("snapshot");
    let metrics = wait()
        .metrics(
            |m| m.snapshot.is_some_and(|s| s.index >= last),
            "snapshot built",
        )
        .await
        .expect("snapshot");
    let applied = metrics.snapshot.expect("snapshot");
    raft.trigger()
        .purge_log(applied.index)
        .await
        .expect("purge");
    wait()
        .metrics(
            |m| m.purged.is_some_and(|p| p.index >= applied.index),
            "log purged",
        )
        .await
        .expect("purged");
    let leader_log = nodes[&leader].logs.entries();
    assert!(
        leader_log.start_offset() > 0,
        "the purge removed no segment of the leader's log"
    );

    let restarted = start(
        lagging,
        Arc::new(RealIo::new()),
        dirs[&lagging].path(),
        &router,
    )
    .await;
    nodes.insert(lagging, restarted);
    acked.extend(write(&nodes[&leader].raft, 1_000, 100).await);
    for (id, node) in &nodes {
        check_has(*id, node, &acked).await;
    }
    let follower = &nodes[&lagging];
    let purged = follower
        .raft
        .metrics()
        .borrow_watched()
        .purged
        .expect("the follower purged up to the snapshot");
    assert!(purged.index >= applied.index, "follower purged {purged:?}");
    // Its entry log restarted just past the snapshot: nothing of its old log (about 300
    // entries) is left, and the entries after the snapshot sit at their indexes (check_has
    // read them at their offsets).
    let entries = follower.logs.entries();
    assert_eq!(
        entries.start_offset(),
        purged.index + 1,
        "the follower's log starts past the snapshot"
    );
    let first = entries
        .read(purged.index + 1)
        .expect("read past the snapshot index");
    assert!(
        decode_entry(&first).expect("decode").is_some(),
        "an entry, not a gap record"
    );
    let reference = nodes[&leader].machine.records();
    for (id, node) in &nodes {
        assert_eq!(node.machine.records(), reference, "node {id} differs");
    }
    for (id, node) in nodes {
        kill(id, node, &router).await;
    }
}
