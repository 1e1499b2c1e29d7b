//! Cluster-wide runtime settings (issue 15) against three real `keratin serve` processes on
//! 127.0.0.1: `keratin settings set` on one node changes the value on every node (stored in
//! the cluster's metadata group, origin `cluster`), and the node applies it (its disk
//! thresholds move); `--node` on one node overrides it there only; a full restart of all three
//! keeps both; `reset` goes back to the configured value everywhere.
//!
//! No root needed: the thresholds are fractions of whatever file system holds the temporary
//! directory. Bounded: each wait has a deadline; the processes are stopped by PID.

mod support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::cluster::Cluster;

const WAIT_MAX: Duration = Duration::from_secs(60);

/// The entry of `key` in node `id`'s settings document, if the node answers.
fn setting(cluster: &Cluster, id: u64, key: &str) -> Option<Value> {
    let http = cluster.nodes[&id].http;
    let text = std::panic::catch_unwind(|| support::http_get(http, "/api/v1/settings")).ok()?;
    let document: Value = serde_json::from_str(&text[text.find('{')?..]).ok()?;
    document["settings"]
        .as_array()?
        .iter()
        .find(|entry| entry["key"] == key)
        .cloned()
}

/// Waits until node `id` shows `key` = `value` with `origin`.
fn wait_setting(cluster: &Cluster, id: u64, key: &str, value: &Value, origin: &str) -> Value {
    let deadline = Instant::now() + WAIT_MAX;
    loop {
        let entry = setting(cluster, id, key);
        if let Some(entry) = &entry {
            if entry["value"] == *value && entry["origin"] == origin {
                return entry.clone();
            }
        }
        assert!(
            Instant::now() < deadline,
            "node {id}: {key} is {entry:?}, expected {value} from {origin}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The soft threshold node `id` applies to its first file system, as a fraction of its size.
fn soft_fraction_in_force(cluster: &Cluster, id: u64) -> f64 {
    let status = support::status(cluster.nodes[&id].http);
    let fs = &status["filesystems"][0];
    let soft = fs["thresholds"]["soft_bytes"].as_f64().expect("soft_bytes");
    let total = fs["total_bytes"].as_f64().expect("total_bytes");
    soft / total
}

/// Waits until every node applies a soft threshold of 30 % of its file system (the floors
/// are far below that on a disk that can hold the tests); `why` names the step.
fn wait_soft_applied(cluster: &Cluster, why: &str) {
    let deadline = Instant::now() + WAIT_MAX;
    for id in 1..=3 {
        while soft_fraction_in_force(cluster, id) < 0.29 {
            assert!(
                Instant::now() < deadline,
                "{why}: node {id} applies soft at {:.3} of its disk",
                soft_fraction_in_force(cluster, id)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `keratin ARGS` against node `id` until it succeeds, within [`WAIT_MAX`].
fn cli_until_ok(cluster: &Cluster, id: u64, args: &[&str]) -> String {
    cluster.cli_until_ok(id, args, WAIT_MAX)
}

#[test]
fn a_cluster_wide_setting_reaches_every_node_and_survives_a_full_restart() {
    let mut cluster = Cluster::start();
    let soft = "limits.disk.soft_fraction";
    let interval = "limits.sample_interval_ms";
    // What each node is configured with (the test harness sets some keys by environment).
    let deadline = Instant::now() + WAIT_MAX;
    let configured = loop {
        let entries = (setting(&cluster, 1, soft), setting(&cluster, 1, interval));
        if let (Some(soft), Some(interval)) = entries {
            break (soft, interval);
        }
        assert!(Instant::now() < deadline, "node 1 never answered");
        std::thread::sleep(Duration::from_millis(100));
    };
    let origin = |entry: &Value| entry["origin"].as_str().expect("origin").to_owned();
    cli_until_ok(
        &cluster,
        1,
        &[
            "settings",
            "set",
            &format!("{soft}=0.3"),
            &format!("{interval}=300"),
        ],
    );
    for id in 1..=3 {
        wait_setting(&cluster, id, soft, &Value::from(0.3), "cluster");
        wait_setting(&cluster, id, interval, &Value::from(300), "cluster");
    }
    // Applied, not only shown.
    wait_soft_applied(&cluster, "set on node 1");

    // Node 2's own value wins there only.
    let out = cli_until_ok(
        &cluster,
        2,
        &["settings", "set", "--node", &format!("{interval}=400")],
    );
    assert!(
        out.contains("over cluster 300"),
        "the table shows what it hides: {out}"
    );
    let entry = wait_setting(&cluster, 2, interval, &Value::from(400), "runtime");
    assert_eq!(entry["cluster_value"], Value::from(300));
    for id in [1, 3] {
        wait_setting(&cluster, id, interval, &Value::from(300), "cluster");
    }

    // A full restart: every node stops, then every node starts again.
    for node in cluster.nodes.values_mut() {
        if let Some(mut server) = node.server.take() {
            assert!(
                server.terminate(Duration::from_secs(30)),
                "node {} stops cleanly",
                node.id
            );
        }
    }
    for id in 1..=3 {
        cluster.start_node(id);
    }
    for id in 1..=3 {
        wait_setting(&cluster, id, soft, &Value::from(0.3), "cluster");
    }
    wait_setting(&cluster, 2, interval, &Value::from(400), "runtime");
    for id in [1, 3] {
        wait_setting(&cluster, id, interval, &Value::from(300), "cluster");
    }
    wait_soft_applied(&cluster, "after the restart");

    // A refused change changes nothing anywhere; reset goes back to the configured values.
    let (ok, out) = cluster.cli(
        3,
        &[
            "settings",
            "set",
            &format!("{soft}=0.3"),
            "limits.disk.hard_fraction=0.9",
        ],
    );
    assert!(!ok, "hard above soft is refused: {out}");
    assert!(out.contains("limits.disk.hard_fraction"), "{out}");
    cli_until_ok(&cluster, 3, &["settings", "reset", soft, interval]);
    let (soft_configured, interval_configured) = configured;
    for id in 1..=3 {
        let entry = wait_setting(
            &cluster,
            id,
            soft,
            &soft_configured["value"],
            &origin(&soft_configured),
        );
        assert!(entry.get("configured_value").is_none(), "{entry}");
    }
    wait_setting(&cluster, 2, interval, &Value::from(400), "runtime");
    wait_setting(
        &cluster,
        1,
        interval,
        &interval_configured["value"],
        &origin(&interval_configured),
    );
}
