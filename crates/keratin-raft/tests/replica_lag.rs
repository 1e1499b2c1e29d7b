//! Replica lag and the in-sync set (`PartitionInfo::replicas`, `in_sync`, `replica_lag`) on
//! three in-process brokers over 127.0.0.1: after publishes, the leader shows all three
//! replicas in sync with no lag, and a follower shows the replicas but no lag figures (only
//! the leader knows). One follower's broker and transport are stopped: within the ack-age
//! bound (5 s) plus a margin, the leader shows the other two in sync and the stopped one out
//! of sync and lagging by at least the publishes made meanwhile, which still confirm (two of
//! three are a majority). The follower restarts on its directory and is in sync again, with
//! no lag. It fails if a stopped replica stays in the in-sync set, if a live one leaves it, if
//! the lag does not count the entries it missed, or if the restarted one does not come back.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::brokers::{publish_all, wait_info, BrokerNode};
use keratin_broker::partition::replication::IN_SYNC_ACK_AGE_MAX;

const QUEUE: &str = "lagging";
const QUEUE_ID: u64 = 5;
const WAIT: Duration = Duration::from_secs(10);
/// Published while every replica runs.
const BEFORE: usize = 20;
/// Published while one follower is down.
const DURING: usize = 30;

fn bodies(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| format!("{prefix} {n}")).collect()
}

async fn leader(nodes: &BTreeMap<u64, BrokerNode>) -> u64 {
    common::brokers::agreed_leader(nodes, QUEUE, WAIT).await
}

/// Waits until the leader's info shows exactly `in_sync` in sync, each of them lagging by at
/// most one entry.
async fn wait_in_sync(node: &BrokerNode, in_sync: &[u64], wait: Duration, what: &str) {
    wait_info(&node.broker, QUEUE, wait, what, |info| {
        let p = &info.partitions[0];
        p.in_sync == in_sync
            && in_sync
                .iter()
                .all(|id| p.replica_lag.get(id).is_some_and(|lag| *lag <= 1))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_tracks_lag_and_the_in_sync_set_as_a_follower_leaves_and_returns() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await;
        nodes.insert(id, node);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    let first = leader(&nodes).await;
    publish_all(
        &nodes[&first].broker,
        QUEUE,
        &bodies("before", BEFORE),
        WAIT,
    )
    .await;
    wait_in_sync(&nodes[&first], &[1, 2, 3], WAIT, "all three in sync").await;
    let info = nodes[&first].broker.info(QUEUE).expect("info");
    let p = &info.partitions[0];
    assert_eq!(p.replicas, vec![1, 2, 3]);
    assert_eq!(p.replica_lag.len(), 3, "{p:?}");
    assert!(p.leader_changes >= 1, "{p:?}");
    let follower = *nodes.keys().find(|id| **id != first).expect("a follower");
    let seen = wait_info(
        &nodes[&follower].broker,
        QUEUE,
        WAIT,
        "a follower's view",
        |info| info.partitions[0].leader == Some(first),
    )
    .await;
    let p = &seen.partitions[0];
    assert_eq!(p.replicas, vec![1, 2, 3], "a follower knows the replicas");
    assert!(
        p.in_sync.is_empty() && p.replica_lag.is_empty(),
        "only the leader knows lag: {p:?}"
    );
    assert_eq!(p.leaderless_ms, None);
    assert!(
        p.committed_offset.is_some_and(|c| c >= BEFORE as u64),
        "a follower knows its committed offset: {p:?}"
    );

    // Stop a follower: the leader sees it leave the in-sync set, and keeps confirming.
    nodes.remove(&follower).expect("follower").stop().await;
    let stopped_at = tokio::time::Instant::now();
    publish_all(
        &nodes[&first].broker,
        QUEUE,
        &bodies("during", DURING),
        WAIT,
    )
    .await;
    let remaining: Vec<u64> = nodes.keys().copied().collect();
    wait_in_sync(
        &nodes[&first],
        &remaining,
        IN_SYNC_ACK_AGE_MAX + Duration::from_secs(3),
        "the stopped follower out of sync",
    )
    .await;
    // Its lag is far below the entry bound: only the ack age takes it out.
    assert!(
        stopped_at.elapsed() >= IN_SYNC_ACK_AGE_MAX - Duration::from_millis(500),
        "left the in-sync set {:?} after it stopped, before its ack age ran out",
        stopped_at.elapsed()
    );
    let info = nodes[&first].broker.info(QUEUE).expect("info");
    let lag = info.partitions[0].replica_lag[&follower];
    assert!(
        lag >= DURING as u64,
        "the stopped follower lags by the {DURING} publishes it missed: {lag}"
    );

    // It comes back: in sync again, lag gone.
    let node = common::brokers::start(
        net.dirs[&follower].path(),
        net.rebind(follower).await,
        net.cluster(follower),
    )
    .await;
    nodes.insert(follower, node);
    wait_in_sync(
        &nodes[&first],
        &[1, 2, 3],
        WAIT,
        "the follower back in sync",
    )
    .await;
    let leader_now = leader(&nodes).await;
    assert_eq!(leader_now, first, "the leader kept its place");

    for node in std::mem::take(&mut nodes).into_values() {
        node.stop().await;
    }
}
