//! A cluster of more than five nodes: six in-process cluster nodes (`Node` with `[cluster]`,
//! real transports on 127.0.0.1), formed together.
//! - The metadata group has five voters (nodes 1-5, the lowest ids) and node 6 follows it as a
//!   learner: `cluster status` says so on every node.
//! - Node 6 takes part like any other: a queue declared through it is decided by the voters
//!   and appears in every node's copy, node 6's included, and a queue declared elsewhere
//!   appears in node 6's.
//! - A voter removed (`remove-node 2`) is replaced by the learner: the voters become 1, 3, 4,
//!   5, 6, and node 2 leaves the group.
//!
//! Fails if six nodes are refused (as before learners existed), if all six vote, if node 6
//! does not apply the metadata, or if the removed voter is not replaced.

mod common;

use common::{http, node, until};
use keratin_broker::QueueSettings;
use keratin_server::Node;
use serde_json::Value;

const NODES: u64 = 6;

/// `Some` once every running node's status names these voters and learners.
fn members_everywhere(nodes: &[Option<Node>], voters: &Value, learners: &Value) -> Option<()> {
    nodes
        .iter()
        .flatten()
        .all(|n| {
            let (_, document) = http(n.http_addr(), "GET", "/api/v1/cluster");
            document["meta_voters"] == *voters && document["meta_learners"] == *learners
        })
        .then_some(())
}

async fn declare(node: &Node, queue: &str) {
    let settings = QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    };
    common::declare(node, queue, &settings).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixth_node_follows_the_metadata_group_as_a_learner_and_replaces_a_removed_voter() {
    let dirs = common::cluster_test_dirs(NODES);
    let mut configs = common::cluster_configs(&dirs, NODES, "learners");
    for config in &mut configs {
        config.cluster.as_mut().expect("cluster").leader_balance = true;
    }
    let nodes = common::start_all(&configs).await;

    until("five voters and node 6 a learner, on every node", || {
        members_everywhere(
            &nodes,
            &serde_json::json!([1, 2, 3, 4, 5]),
            &serde_json::json!([6]),
        )
    })
    .await;

    // Declared through the learner: decided by the voters, applied everywhere.
    declare(node(&nodes, 6), "via-learner").await;
    declare(node(&nodes, 1), "via-voter").await;
    for queue in ["via-learner", "via-voter"] {
        until(&format!("every node knows {queue}"), || {
            nodes
                .iter()
                .flatten()
                .all(|n| n.broker().info(queue).is_ok())
                .then_some(())
        })
        .await;
    }

    // Voter 2 removed: the learner takes its place, and node 2 leaves the group.
    let (status, answer) = http(
        node(&nodes, 6).http_addr(),
        "POST",
        "/api/v1/cluster/nodes/2/remove",
    );
    assert_eq!(status, 200, "{answer}");
    until("voters 1, 3, 4, 5, 6 and no learner", || {
        let (_, document) = http(node(&nodes, 1).http_addr(), "GET", "/api/v1/cluster");
        (document["meta_voters"] == serde_json::json!([1, 3, 4, 5, 6])
            && document["meta_learners"] == serde_json::json!([]))
        .then_some(())
    })
    .await;
    // The promoted node votes: a declare still commits, and node 6 applies it.
    declare(node(&nodes, 3), "after-the-change").await;
    until("node 6 knows the queue declared after the change", || {
        node(&nodes, 6)
            .broker()
            .info("after-the-change")
            .ok()
            .map(drop)
    })
    .await;

    for n in nodes.into_iter().flatten() {
        let _ = n.shutdown().await;
    }
}
