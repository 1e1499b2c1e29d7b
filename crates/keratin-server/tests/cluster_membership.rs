//! Changing a running cluster's nodes, on four in-process cluster nodes (`Node` with
//! `[cluster]`, real transports on 127.0.0.1).
//!
//! `keratin cluster remove-node` on four in-process cluster nodes (`Node` with `[cluster]`,
//! real transports on 127.0.0.1): a queue of one partition with three replicas, so one node
//! holds none. Messages are published and some acked; then the partition's *leader* is
//! removed, asked at the node that holds no replica (the request travels to the metadata
//! leader). While publishes go on:
//! - the answer plans the move onto the node without a replica, in the removed node's place;
//! - the group's voters become the new set and all three are in sync (the new node caught
//!   up from the log and snapshot), the removed node's copy retires and its files go, the
//!   metadata group's voters drop it, and `cluster status` marks it removed;
//! - with the removed node stopped, the new leader delivers every confirmed message that was
//!   not acked, none acked comes back, and publishes keep being confirmed.
//!
//! Fails without the move (the voters never change), if the removed node keeps its files, or
//! if a confirmed message is lost or an acked one comes back.

mod common;

use common::{agreed_leader, http, http_json, node, publish, take, until};

use std::collections::BTreeSet;

use keratin_broker::QueueSettings;
use keratin_server::config::Config;
use keratin_server::Node;
use serde_json::Value;

const QUEUE: &str = "moving";
const NODES: u64 = 4;

/// [`common::cluster_configs`] of [`NODES`] nodes, nodes `1..=formed` forming the cluster, with
/// small segments: the acked prefix is freed and a new replica starts from a snapshot.
fn configs(dirs: &[tempfile::TempDir], formed: u64) -> Vec<Config> {
    let mut configs = common::cluster_configs(dirs, formed, "membership");
    for config in &mut configs {
        config.storage.segment_bytes = 256 << 10;
    }
    configs
}

/// `Some` once a running node leads `queue`'s partition with exactly `wanted` as its voters,
/// all in sync.
fn led_by_all_in_sync(nodes: &[Option<Node>], queue: &str, wanted: &BTreeSet<u64>) -> Option<()> {
    nodes.iter().flatten().find_map(|n| {
        let p = n.broker().info(queue).ok()?.partitions[0].clone();
        let voters: BTreeSet<u64> = p.replicas.iter().copied().collect();
        let in_sync: BTreeSet<u64> = p.in_sync.iter().copied().collect();
        (p.leading && voters == *wanted && in_sync == *wanted).then_some(())
    })
}

/// A planned move of an add/remove answer: its queue and the replicas it goes to.
fn planned_move(planned: &Value) -> (String, BTreeSet<u64>) {
    let queue = planned["queue"].as_str().expect("queue").to_string();
    let to = planned["to"]
        .as_array()
        .expect("to")
        .iter()
        .map(|n| n.as_u64().expect("id"))
        .collect();
    (queue, to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removed_leaders_partition_moves_to_another_node_and_keeps_every_confirmed_message() {
    let dirs = common::cluster_test_dirs(NODES);
    let configs = configs(&dirs, NODES);
    let mut nodes = common::start_all(&configs).await;
    let settings = QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    };
    common::declare(node(&nodes, 1), QUEUE, &settings).await;
    let leader = agreed_leader(&nodes, QUEUE).await;
    let before: Vec<u64> = node(&nodes, leader)
        .broker()
        .info(QUEUE)
        .expect("info")
        .partitions[0]
        .replicas
        .clone();
    assert_eq!(before.len(), 3, "{before:?}");
    let spare = (1..=NODES)
        .find(|id| !before.contains(id))
        .expect("a node without a replica");

    let mut confirmed = BTreeSet::new();
    let mut unknown = BTreeSet::new();
    for n in 0..300 {
        match publish(&nodes, QUEUE, n).await {
            Ok(()) => confirmed.insert(n),
            Err(_) => unknown.insert(n),
        };
    }
    let acked: BTreeSet<usize> = take(node(&nodes, leader).broker(), QUEUE, 150, true)
        .await
        .into_iter()
        .collect();
    assert_eq!(acked.len(), 150, "the first acks");

    // Remove the leader, asked at the node holding no replica.
    let (status, answer) = http(
        node(&nodes, spare).http_addr(),
        "POST",
        &format!("/api/v1/cluster/nodes/{leader}/remove"),
    );
    assert_eq!(status, 200, "{answer}");
    let planned = &answer["moves"];
    assert_eq!(planned.as_array().map(Vec::len), Some(1), "{answer}");
    assert_eq!(planned[0]["queue"], QUEUE);
    assert_eq!(planned[0]["partition"], 0);
    let ids = |v: &Value| -> Vec<u64> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|id| id.as_u64().expect("id"))
            .collect()
    };
    let from = ids(&planned[0]["from"]);
    assert_eq!(
        from.iter().copied().collect::<BTreeSet<u64>>(),
        before.iter().copied().collect::<BTreeSet<u64>>()
    );
    let expected: Vec<u64> = from
        .iter()
        .map(|id| if *id == leader { spare } else { *id })
        .collect();
    assert_eq!(
        ids(&planned[0]["to"]),
        expected,
        "the spare node in the removed one's place"
    );
    let (again, _) = http(
        node(&nodes, spare).http_addr(),
        "POST",
        &format!("/api/v1/cluster/nodes/{}/remove", NODES + 7),
    );
    assert_eq!(again, 404, "an unknown node");

    // Publishes go on during the move.
    for n in 300..400 {
        match publish(&nodes, QUEUE, n).await {
            Ok(()) => confirmed.insert(n),
            Err(_) => unknown.insert(n),
        };
    }
    let target: BTreeSet<u64> = expected.iter().copied().collect();
    let mut polls = 0;
    until("the group's voters are the new set, all in sync", || {
        polls += 1;
        if polls % 50 == 0 {
            for n in nodes.iter().flatten() {
                if let Ok(info) = n.broker().info(QUEUE) {
                    let p = &info.partitions[0];
                    eprintln!(
                        "leading {} leader {:?} replicas {:?} in sync {:?}",
                        p.leading, p.leader, p.replicas, p.in_sync
                    );
                }
            }
        }
        led_by_all_in_sync(&nodes, QUEUE, &target)
    })
    .await;
    let removed_dir = dirs[(leader - 1) as usize]
        .path()
        .join("data")
        .join("queues");
    until("the removed node's copy retired and its files went", || {
        let left: Vec<_> = std::fs::read_dir(&removed_dir)
            .map(|entries| {
                entries
                    .flatten()
                    .flat_map(|queue| std::fs::read_dir(queue.path()).into_iter().flatten())
                    .flatten()
                    .map(|p| p.path())
                    .collect()
            })
            .unwrap_or_default();
        left.is_empty().then_some(())
    })
    .await;
    until("the metadata group dropped the removed node", || {
        let (_, document) = http(node(&nodes, spare).http_addr(), "GET", "/api/v1/cluster");
        let voters = document["meta_voters"].as_array()?.clone();
        let removed = document["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["id"] == leader)?["removed"]
            .as_bool()?;
        (removed && voters.len() == 3 && !voters.contains(&Value::from(leader))).then_some(())
    })
    .await;

    // The removed node goes away; the new group serves everything.
    nodes[(leader - 1) as usize]
        .take()
        .expect("removed node")
        .shutdown()
        .await
        .expect("shutdown");
    for n in 400..420 {
        match publish(&nodes, QUEUE, n).await {
            Ok(()) => confirmed.insert(n),
            Err(_) => unknown.insert(n),
        };
    }
    let new_leader = agreed_leader(&nodes, QUEUE).await;
    assert!(target.contains(&new_leader), "{new_leader} leads");
    let wanted: BTreeSet<usize> = confirmed.difference(&acked).copied().collect();
    let got = take(
        node(&nodes, new_leader).broker(),
        QUEUE,
        wanted.len() + unknown.len(),
        true,
    )
    .await;
    let got_set: BTreeSet<usize> = got.iter().copied().collect();
    let lost: Vec<_> = wanted.difference(&got_set).collect();
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
    let back: Vec<_> = acked.intersection(&got_set).collect();
    assert!(back.is_empty(), "acked messages came back: {back:?}");
    eprintln!(
        "removed leader {leader}; {} confirmed, {} acked before, {} delivered after, {} unknown",
        confirmed.len(),
        acked.len(),
        got.len(),
        unknown.len()
    );
    for n in nodes.into_iter().flatten() {
        n.shutdown().await.expect("shutdown");
    }
}

/// Four queues of one partition and three replicas on three nodes (four replicas each); a
/// fourth node started with `join` is admitted by `POST /api/v1/cluster/nodes` at node 2 and
/// takes its share: three replicas move onto it. It joins the metadata group's voters, each
/// moved group counts it in sync, its copy holds every live message, and with the node that
/// gave a replica stopped, every confirmed message not acked is delivered and none acked.
/// Then the whole cluster restarts, nodes 1-3 with their old peer lists: the moved groups
/// serve with node 4 again and it is still a metadata voter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_added_node_joins_the_metadata_group_and_takes_its_share_of_replicas() {
    let dirs = common::cluster_test_dirs(NODES);
    let configs = configs(&dirs, 3);
    let mut nodes = common::start_all(&configs[..3]).await;
    nodes.push(None);
    let queues: Vec<String> = (0..4).map(|q| format!("grow-{q}")).collect();
    let settings = QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    };
    for queue in &queues {
        common::declare(node(&nodes, 1), queue, &settings).await;
    }
    let mut confirmed: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); queues.len()];
    for (q, queue) in queues.iter().enumerate() {
        for n in 0..60 {
            if publish(&nodes, queue, n).await.is_ok() {
                confirmed[q].insert(n);
            }
        }
    }
    // Acks on the first queue: the rest of its log is what the new node must hold.
    let leader = agreed_leader(&nodes, &queues[0]).await;
    let acked: BTreeSet<usize> = take(node(&nodes, leader).broker(), &queues[0], 20, true)
        .await
        .into_iter()
        .collect();
    assert_eq!(acked.len(), 20);

    // The fourth node starts alone: it forms nothing, and waits to be admitted.
    nodes[3] = Some(common::start_node(&configs[3]).await);
    let addr4 = configs[3]
        .cluster
        .as_ref()
        .and_then(|c| c.listen)
        .expect("node 4's cluster address");
    let body = serde_json::json!({"id": 4, "cluster_addr": addr4.to_string()});
    let (status, answer) = http_json(node(&nodes, 2).http_addr(), "/api/v1/cluster/nodes", &body);
    assert_eq!(status, 200, "{answer}");
    let moves = answer["moves"].as_array().expect("moves").clone();
    assert_eq!(
        moves.len(),
        3,
        "12 replicas over 4 nodes: 3 move to node 4: {answer}"
    );
    let (again, repeat) = http_json(node(&nodes, 2).http_addr(), "/api/v1/cluster/nodes", &body);
    assert_eq!(again, 200, "adding it again continues: {repeat}");
    let (taken, refusal) = http_json(
        node(&nodes, 2).http_addr(),
        "/api/v1/cluster/nodes",
        &serde_json::json!({"id": 2, "cluster_addr": "127.0.0.1:1"}),
    );
    assert_eq!((taken, &refusal["reason"]), (409, &Value::from("id_taken")));

    until("the metadata group's voters are the four nodes", || {
        let (_, document) = http(node(&nodes, 1).http_addr(), "GET", "/api/v1/cluster");
        (document["meta_voters"] == serde_json::json!([1, 2, 3, 4])).then_some(())
    })
    .await;
    for planned in &moves {
        let (queue, wanted) = planned_move(planned);
        assert!(wanted.contains(&4), "{planned}");
        until(&format!("{queue}: the planned voters, all in sync"), || {
            led_by_all_in_sync(&nodes, &queue, &wanted)
        })
        .await;
        let q = queues
            .iter()
            .position(|name| *name == queue)
            .expect("queue");
        let live = confirmed[q].len() - if q == 0 { acked.len() } else { 0 };
        until(
            &format!("{queue}: node 4's copy holds every live message"),
            || {
                let p = node(&nodes, 4).broker().info(&queue).ok()?.partitions[0].clone();
                (p.ready + p.inflight == live as u64).then_some(())
            },
        )
        .await;
    }

    // The node that gave the first moved replica stops: the group goes on with node 4.
    let first = &moves[0];
    let queue = first["queue"].as_str().expect("queue").to_string();
    let giver = first["from"]
        .as_array()
        .expect("from")
        .iter()
        .map(|n| n.as_u64().expect("id"))
        .find(|id| {
            !first["to"]
                .as_array()
                .expect("to")
                .contains(&Value::from(*id))
        })
        .expect("the giver");
    nodes[(giver - 1) as usize]
        .take()
        .expect("giver")
        .shutdown()
        .await
        .expect("shutdown");
    let q = queues
        .iter()
        .position(|name| *name == queue)
        .expect("queue");
    for n in 60..80 {
        if publish(&nodes, &queue, n).await.is_ok() {
            confirmed[q].insert(n);
        }
    }
    let leader = agreed_leader(&nodes, &queue).await;
    let gone = if q == 0 {
        acked.clone()
    } else {
        BTreeSet::new()
    };
    let wanted: BTreeSet<usize> = confirmed[q].difference(&gone).copied().collect();
    let got: BTreeSet<usize> = take(node(&nodes, leader).broker(), &queue, wanted.len(), true)
        .await
        .into_iter()
        .collect();
    let lost: Vec<_> = wanted.difference(&got).collect();
    assert!(
        lost.is_empty(),
        "{queue}: confirmed messages lost: {lost:?}"
    );
    let back: Vec<_> = gone.intersection(&got).collect();
    assert!(
        back.is_empty(),
        "{queue}: acked messages came back: {back:?}"
    );
    eprintln!(
        "node 4 added: {} moves; {queue} without node {giver}: {} delivered",
        moves.len(),
        got.len()
    );

    // The whole cluster restarts, nodes 1-3 with their old peer lists (without node 4): they
    // learn node 4 again from the metadata they replay, and every moved group serves.
    for n in std::mem::take(&mut nodes).into_iter().flatten() {
        n.shutdown().await.expect("shutdown");
    }
    nodes = common::start_all(&configs).await;
    for planned in &moves {
        let (queue, wanted) = planned_move(planned);
        until(
            &format!("{queue} after the restart: the planned voters, in sync"),
            || led_by_all_in_sync(&nodes, &queue, &wanted),
        )
        .await;
        publish(&nodes, &queue, 1_000)
            .await
            .expect("a publish after the restart is confirmed");
    }
    until("the metadata voters after the restart", || {
        let (_, document) = http(node(&nodes, 1).http_addr(), "GET", "/api/v1/cluster");
        (document["meta_voters"] == serde_json::json!([1, 2, 3, 4])).then_some(())
    })
    .await;
    for n in nodes.into_iter().flatten() {
        n.shutdown().await.expect("shutdown");
    }
}
