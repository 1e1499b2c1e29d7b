//! Replica health as an operator sees it, on three in-process cluster nodes (`Node` with
//! `[cluster]`, real transports on 127.0.0.1): after publishes, the partition's leader answers
//! `GET /api/v1/cluster` with all three replicas in sync and `/metrics` with the replication
//! series. One follower stops: the leader raises `node_unreachable` for it and its in-sync
//! set shrinks to two (a majority: no `partition_below_majority`). The second follower stops:
//! the leader raises `partition_below_majority`. Both come back (same directories and cluster
//! addresses): every item clears and all three are in sync again. It fails if an item is not
//! raised or not cleared within its bound, or if the documents do not show the replicas.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use keratin_broker::{BrokerError, Message, QueueSettings};
use keratin_server::attention::AttentionKind;
use keratin_server::config::Config;
use keratin_server::Node;
use serde_json::Value;

const QUEUE: &str = "watched";
const WAIT: Duration = Duration::from_secs(20);

fn get(addr: SocketAddr, path: &str) -> String {
    common::http_text(addr, "GET", path, "").1
}

/// Partition 0 of the queue in `node`'s cluster document.
fn cluster_partition(node: &Node) -> Value {
    let document: Value =
        serde_json::from_str(&get(node.http_addr(), "/api/v1/cluster")).expect("cluster json");
    let queue = document["queues"]
        .as_array()
        .and_then(|queues| queues.iter().find(|q| q["name"] == QUEUE))
        .cloned()
        .unwrap_or(Value::Null);
    queue["partitions"][0].clone()
}

fn active(node: &Node, kind: AttentionKind) -> Vec<String> {
    node.limits()
        .attention()
        .active()
        .into_iter()
        .filter(|item| item.kind == kind)
        .map(|item| item.subject)
        .collect()
}

async fn until<T>(what: &str, check: impl FnMut() -> Option<T>) -> T {
    common::until_within(what, WAIT, check).await
}

/// Node `id` of `nodes`, if running.
fn node(nodes: &[Option<Node>], id: u64) -> Option<&Node> {
    nodes[(id - 1) as usize].as_ref()
}

async fn start(config: Config) -> Node {
    Node::start(&config).await.expect("node starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_health_shows_in_the_cluster_document_metrics_and_attention() {
    let dirs: Vec<tempfile::TempDir> = (0..3)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let configs = common::cluster_configs(&dirs, 3, "health");
    let starting: Vec<_> = configs
        .iter()
        .cloned()
        .map(|config| tokio::spawn(start(config)))
        .collect();
    let mut nodes: Vec<Option<Node>> = Vec::new();
    for handle in starting {
        nodes.push(Some(handle.await.expect("start task")));
    }
    let settings = QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while let Err(error) = node(&nodes, 1)
        .expect("node 1")
        .broker()
        .declare(QUEUE, settings.clone())
        .await
    {
        assert!(tokio::time::Instant::now() < deadline, "declare: {error}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let leader = until("a leader every node agrees on", || {
        let leaders: Vec<Option<u64>> = (1..=3)
            .map(|id| {
                let info = node(&nodes, id)?.broker().info(QUEUE).ok()?;
                info.partitions[0].leader
            })
            .collect();
        leaders[0].filter(|l| leaders.iter().all(|x| *x == Some(*l)))
    })
    .await;
    let leading = node(&nodes, leader).expect("leader").broker().clone();
    for n in 0..10 {
        loop {
            let mut results = leading
                .publish(QUEUE, vec![Message::new(format!("m{n}"))])
                .await;
            match results.remove(0) {
                Ok(_) => break,
                Err(BrokerError::NotLeader { leader: None, .. }) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(other) => panic!("publish: {other}"),
            }
        }
    }
    let at_leader =
        |nodes: &[Option<Node>]| cluster_partition(node(nodes, leader).expect("leader"));
    let p = until("all three in sync", || {
        let p = at_leader(&nodes);
        (p["in_sync"] == serde_json::json!([1, 2, 3]) && p["max_lag"].as_u64() <= Some(1))
            .then_some(p)
    })
    .await;
    assert_eq!(p["replicas"], serde_json::json!([1, 2, 3]), "{p}");
    let metrics = get(
        node(&nodes, leader).expect("leader").http_addr(),
        "/metrics",
    );
    for line in [
        format!(r#"keratin_partition_replicas{{queue="{QUEUE}",partition="0"}} 3"#),
        format!(r#"keratin_partition_in_sync_replicas{{queue="{QUEUE}",partition="0"}} 3"#),
        format!(
            r#"keratin_partition_replica_lag_entries{{queue="{QUEUE}",partition="0",replica="{leader}"}} 0"#
        ),
    ] {
        assert!(metrics.contains(&line), "{line} missing from /metrics");
    }
    assert!(metrics.contains("keratin_partition_leader_changes_total"));
    let follower = (1..=3).find(|id| *id != leader).expect("follower");
    let p = cluster_partition(node(&nodes, follower).expect("follower"));
    assert_eq!(p["in_sync"], Value::Null, "only the leader knows: {p}");

    // One follower down: unreachable, out of sync, still a majority.
    let first_down = follower;
    nodes[(first_down - 1) as usize]
        .take()
        .expect("follower")
        .shutdown()
        .await
        .expect("shutdown");
    until("node_unreachable raised on the leader", || {
        let down = active(
            node(&nodes, leader).expect("leader"),
            AttentionKind::NodeUnreachable,
        );
        (down == vec![format!("node-{first_down}")]).then_some(())
    })
    .await;
    until("two in sync", || {
        (at_leader(&nodes)["in_sync"].as_array().map(Vec::len) == Some(2)).then_some(())
    })
    .await;
    let below = active(
        node(&nodes, leader).expect("leader"),
        AttentionKind::PartitionBelowMajority,
    );
    assert!(below.is_empty(), "two of three are a majority: {below:?}");

    // The second follower down: below a majority.
    let second_down = (1..=3)
        .find(|id| *id != leader && *id != first_down)
        .expect("second follower");
    nodes[(second_down - 1) as usize]
        .take()
        .expect("follower")
        .shutdown()
        .await
        .expect("shutdown");
    until("partition_below_majority raised on the leader", || {
        let below = active(
            node(&nodes, leader).expect("leader"),
            AttentionKind::PartitionBelowMajority,
        );
        (below == vec![format!("{QUEUE}/0")]).then_some(())
    })
    .await;

    // Both back: every item clears.
    for id in [first_down, second_down] {
        nodes[(id - 1) as usize] = Some(start(configs[(id - 1) as usize].clone()).await);
    }
    for id in 1..=3 {
        until("every item cleared", || {
            let n = node(&nodes, id).expect("node");
            (active(n, AttentionKind::NodeUnreachable).is_empty()
                && active(n, AttentionKind::PartitionBelowMajority).is_empty())
            .then_some(())
        })
        .await;
    }
    let leader = until("a leader again", || {
        (1..=3).find(|id| {
            node(&nodes, *id)
                .and_then(|n| n.broker().info(QUEUE).ok())
                .is_some_and(|info| info.partitions[0].leading)
        })
    })
    .await;
    until("all three in sync again", || {
        let p = cluster_partition(node(&nodes, leader).expect("leader"));
        (p["in_sync"] == serde_json::json!([1, 2, 3])).then_some(())
    })
    .await;

    for slot in nodes.iter_mut() {
        if let Some(node) = slot.take() {
            node.shutdown().await.expect("shutdown");
        }
    }
}
