//! Pinned placement and replica moves through the CLI against three real `keratin serve`
//! processes on 127.0.0.1 (issue 15): `keratin queue declare --nodes` puts the replicas on the
//! named nodes with the preferred leaders rotating, and refuses what cannot be (a node that is
//! not the cluster's, a node named twice, `--replicas` that disagrees); `keratin queue move`
//! refuses a source without a replica and a target with one, and a move it takes is done
//! (`--wait`). The move under load, off a full node, is `cluster_limits.rs`'s.
//!
//! No root needed. Bounded: each wait has a deadline; the processes are stopped by PID.

mod support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::cluster::Cluster;

const WAIT_MAX: Duration = Duration::from_secs(60);

/// `keratin ARGS` against node `id` until it succeeds, within [`WAIT_MAX`].
fn cli_until_ok(cluster: &Cluster, id: u64, args: &[&str]) -> String {
    cluster.cli_until_ok(id, args, WAIT_MAX)
}

/// The preferred leader and replica lists of `queue`'s partitions as node `id`'s cluster
/// document has them, as `[preferred, others in id order...]`.
fn replicas(cluster: &Cluster, id: u64, queue: &str) -> Vec<Vec<u64>> {
    let Some(document) = cluster.cluster_document(id) else {
        return Vec::new();
    };
    let ids = |list: &Value| -> Vec<u64> {
        list.as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .collect()
    };
    document["queues"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|q| q["name"] == queue)
        .flat_map(|q| q["partitions"].as_array().cloned().unwrap_or_default())
        .map(|p| {
            let preferred = p["preferred_leader"].as_u64();
            let mut list: Vec<u64> = preferred.into_iter().collect();
            list.extend(
                ids(&p["replicas"])
                    .into_iter()
                    .filter(|n| Some(*n) != preferred),
            );
            list
        })
        .collect()
}

#[test]
fn declare_pins_replicas_to_the_named_nodes_and_move_changes_one() {
    let cluster = Cluster::start();
    let declare = [
        "queue",
        "declare",
        "pinned",
        "--partitions",
        "3",
        "--nodes",
        "3,1",
    ];
    let out = cli_until_ok(&cluster, 1, &declare);
    assert!(out.contains("declared queue pinned"), "{out}");
    // Every partition on 3 and 1, the preferred leaders rotating from 3.
    wait_replicas(&cluster, "pinned", &[vec![3, 1], vec![1, 3], vec![3, 1]]);
    // Declared again with the same nodes: the same queue (replicas = 2 either way).
    cli_until_ok(&cluster, 2, &declare);

    for (args, expected) in [
        (
            vec!["--nodes", "1,9"],
            "node 9 is not one of the cluster's nodes",
        ),
        (vec!["--nodes", "2,2"], "node 2 is named twice"),
        (
            vec!["--nodes", "1,2", "--replicas", "3"],
            "replicas = 3, and 2 nodes are named",
        ),
    ] {
        let mut full = vec!["queue", "declare", "other"];
        full.extend(args.iter().copied());
        let (ok, out) = cluster.cli(1, &full);
        assert!(!ok, "{full:?} is refused: {out}");
        assert!(out.contains(expected), "{full:?}: {out}");
    }
    let (ok, out) = cluster.cli(1, &["queue", "info", "other"]);
    assert!(!ok, "nothing was declared: {out}");

    // Moves: refusals first, then one that is done.
    let move_args = |partition: &'static str, from: &'static str, to: &'static str| {
        [
            "queue",
            "move",
            "pinned",
            "--partition",
            partition,
            "--from",
            from,
            "--to",
            to,
        ]
    };
    for ((partition, from, to), expected) in [
        (("1", "2", "3"), "no replica on node 2"),
        (("1", "1", "3"), "has a replica on node 3 already"),
        (("7", "1", "2"), "there is no partition 7"),
    ] {
        let (ok, out) = cluster.cli(2, &move_args(partition, from, to));
        assert!(!ok && out.contains(expected), "{out}");
    }
    let out = cli_until_ok(
        &cluster,
        2,
        &[
            "queue",
            "move",
            "pinned",
            "--partition",
            "1",
            "--from",
            "1",
            "--to",
            "2",
            "--wait",
            "60",
        ],
    );
    assert!(
        out.contains("node 2 holds the replica, node 1 no longer does"),
        "{out}"
    );
    wait_replicas(&cluster, "pinned", &[vec![3, 1], vec![2, 3], vec![3, 1]]);
}

/// Waits until node 3, which holds every partition here, sees `queue`'s partitions with
/// `expected` (preferred leader first), as each group's membership settles. A node without a
/// replica of a partition lists none for it.
fn wait_replicas(cluster: &Cluster, queue: &str, expected: &[Vec<u64>]) {
    let deadline = Instant::now() + WAIT_MAX;
    while replicas(cluster, 3, queue) != expected {
        assert!(
            Instant::now() < deadline,
            "node 3 sees {:?}, expected {expected:?}",
            replicas(cluster, 3, queue)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
