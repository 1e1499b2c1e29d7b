//! `keratin cluster status`: the cluster as the node at `--server` sees it — its nodes
//! (addresses, reachable or not, which leads the metadata group) and every queue's partitions
//! (leader, replicas, in-sync set, largest replica lag) — read from the HTTP admin port's
//! `GET /api/v1/cluster`. Only a partition's leader knows its in-sync set and lags: for the
//! partitions another node leads, the leader's own document is read too (each node at most
//! once, at the admin address the first node lists for it; when the named leader does not
//! lead, as a node holding no replica names the preferred one, the other nodes are asked) and
//! its view of those partitions is taken, marked `"lag_from": <leader id>`; a leader that
//! cannot be reached leaves them `null`.
//! `--json` prints the document with those views filled in.
//!
//! `keratin cluster add-node ID=ADDR [--no-rebalance] [--wait SECS]`: admit a node started
//! with `--join` (`POST /api/v1/cluster/nodes`); prints the replicas that move onto it, and
//! with `--wait` polls until every partition's leader counts the planned replicas.
//!
//! `keratin cluster rebalance`: hand every partition to its preferred leader now, where that
//! one is caught up (`POST /api/v1/cluster/rebalance`, Kafka's preferred-leader election);
//! prints what moved, what stays and why, and the nodes that could not be asked (exit 1 if
//! any could not).
//!
//! `keratin cluster remove-node ID [--wait SECS]`: remove a node (`POST
//! /api/v1/cluster/nodes/{id}/remove`); prints where each of its partitions goes, and with
//! `--wait` polls the cluster document until no partition's leader counts the node among its
//! replicas.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::Value;

use crate::admin;
use crate::connect::CommonArgs;
use crate::output::{print_json, Failure, Table};

const CLUSTER_PATH: &str = "/api/v1/cluster";

/// `keratin cluster ...`.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    verb: ClusterVerb,
}

#[derive(Debug, Subcommand)]
enum ClusterVerb {
    /// Nodes, reachability, the metadata leader, and each partition's leader.
    Status(StatusArgs),
    /// Admit a node started with `--join` (its cluster address as ID=ADDR); replicas move
    /// onto it unless --no-rebalance.
    AddNode(AddArgs),
    /// Remove a node (running or dead): its partitions move onto the other nodes, then it
    /// leaves the metadata group. Stop it once the moves are done (`--wait`).
    RemoveNode(RemoveArgs),
    /// Hand every partition to its preferred leader now, where that one is caught up (after
    /// a restart, or with `cluster.leader_balance` off); prints what moved.
    Rebalance(StatusArgs),
}

/// Flags of `keratin cluster add-node`.
#[derive(Debug, Args)]
struct AddArgs {
    /// The new node as ID=ADDR (its id and cluster address).
    node: keratin_net::PeerSpec,
    #[command(flatten)]
    common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
    /// Move no replicas onto the new node (new queues still use it).
    #[arg(long)]
    no_rebalance: bool,
    /// Wait up to this many seconds until every planned move is done; exits 1 if some are
    /// not then.
    #[arg(long, value_name = "SECS")]
    wait: Option<u64>,
}

/// Flags of `keratin cluster remove-node`.
#[derive(Debug, Args)]
struct RemoveArgs {
    /// The node's id.
    id: u64,
    #[command(flatten)]
    common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
    /// Wait up to this many seconds until no partition keeps a replica on the node; exits 1
    /// if some still do then.
    #[arg(long, value_name = "SECS")]
    wait: Option<u64>,
}

/// Flags of `keratin cluster status`.
#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
}

impl ClusterArgs {
    /// Whether failures are also reported as JSON.
    pub fn json(&self) -> bool {
        match &self.verb {
            ClusterVerb::Status(args) => args.common.json,
            ClusterVerb::RemoveNode(args) => args.common.json,
            ClusterVerb::AddNode(args) => args.common.json,
            ClusterVerb::Rebalance(args) => args.common.json,
        }
    }
}

/// Runs `keratin cluster ...`.
pub async fn run(args: ClusterArgs) -> Result<ExitCode, Failure> {
    match args.verb {
        ClusterVerb::Status(args) => {
            let http = admin::address(&args.common, args.http.as_deref()).await?;
            let mut document = admin::request(&http, "GET", CLUSTER_PATH, None)?;
            fill_from_leaders(&mut document, |admin| {
                admin::request(admin, "GET", CLUSTER_PATH, None).ok()
            });
            if args.common.json {
                print_json(&document);
            } else {
                out!("{}", cluster_text(&document));
            }
            Ok(ExitCode::SUCCESS)
        }
        ClusterVerb::RemoveNode(args) => remove_node(args).await,
        ClusterVerb::AddNode(args) => add_node(args).await,
        ClusterVerb::Rebalance(args) => rebalance(args).await,
    }
}

/// `keratin cluster rebalance` (see the module docs).
async fn rebalance(args: StatusArgs) -> Result<ExitCode, Failure> {
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let answer = admin::request(&http, "POST", &format!("{CLUSTER_PATH}/rebalance"), None)?;
    let unreachable = answer["unreachable"]
        .as_object()
        .map_or(0, serde_json::Map::len);
    if args.common.json {
        print_json(&answer);
    } else {
        out!("{}", rebalance_text(&answer));
    }
    Ok(if unreachable == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The text of a rebalance answer: the moves, what stays and why, who was not asked.
fn rebalance_text(answer: &Value) -> String {
    let rows = |key: &str| {
        answer[key]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .to_vec()
    };
    let (moved, kept) = (rows("moved"), rows("kept"));
    let mut text = String::new();
    if moved.is_empty() {
        text.push_str("no partition changed leader\n");
    } else {
        text.push_str(&format!(
            "{} partition(s) handed to their preferred leader\n",
            moved.len()
        ));
        let mut table = Table::new(&["QUEUE", "PARTITION", "FROM", "TO"]);
        for line in &moved {
            table.row(vec![
                field(line, "queue"),
                field(line, "partition"),
                field(line, "from"),
                field(line, "to"),
            ]);
        }
        text.push_str(&table.render());
    }
    if !kept.is_empty() {
        text.push_str(&format!(
            "{} partition(s) stay off their preferred leader\n",
            kept.len()
        ));
        let mut table = Table::new(&["QUEUE", "PARTITION", "LEADER", "PREFERRED", "WHY"]);
        for line in &kept {
            table.row(vec![
                field(line, "queue"),
                field(line, "partition"),
                field(line, "leader"),
                field(line, "preferred"),
                field(line, "reason"),
            ]);
        }
        text.push_str(&table.render());
    }
    for (id, error) in answer["unreachable"].as_object().into_iter().flatten() {
        text.push_str(&format!(
            "node {id} could not be asked ({}); the partitions it leads were not looked at\n",
            error.as_str().unwrap_or_default()
        ));
    }
    text
}

/// `keratin cluster add-node` (see the module docs).
async fn add_node(args: AddArgs) -> Result<ExitCode, Failure> {
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let body = serde_json::json!({
        "id": args.node.id,
        "cluster_addr": args.node.addr.to_string(),
        "rebalance": !args.no_rebalance,
    });
    let path = format!("{CLUSTER_PATH}/nodes");
    let answer = admin::request(&http, "POST", &path, Some(&body))?;
    let pending = |document: &Value| not_moved(document, &answer["moves"]);
    let remaining = wait_for(&http, args.wait, pending).await;
    report(
        &answer,
        &args.common,
        &format!("node {} added to the cluster", args.node),
        remaining,
        args.wait,
        "every planned replica is on the new node",
    )
}

/// `keratin cluster remove-node` (see the module docs).
async fn remove_node(args: RemoveArgs) -> Result<ExitCode, Failure> {
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let path = format!("{CLUSTER_PATH}/nodes/{}/remove", args.id);
    let answer = admin::request(&http, "POST", &path, None)?;
    let id = args.id;
    let remaining = wait_for(&http, args.wait, |document| held_by(document, id)).await;
    report(
        &answer,
        &args.common,
        &format!("node {id} removed from the cluster"),
        remaining,
        args.wait,
        &format!("every partition moved off node {id}: it can be stopped"),
    )
}

/// `keratin queue move NAME --partition P --from NODE --to NODE [--wait SECS]`: move one
/// replica live (`POST /api/v1/queues/{name}/partitions/{p}/move`); prints the move, and with
/// `--wait` polls until the partition's leader counts the new replicas.
pub(crate) async fn move_replica(
    common: &CommonArgs,
    http: Option<&str>,
    queue: &str,
    partition: u32,
    (from, to): (u64, u64),
    wait: Option<u64>,
) -> Result<ExitCode, Failure> {
    // A queue name is letters, digits, '.', '_' and '-': safe in a path as it is.
    keratin_broker::validate_queue_name(queue).map_err(|e| Failure::new(e.to_string()))?;
    let http = admin::address(common, http).await?;
    let path = format!("/api/v1/queues/{queue}/partitions/{partition}/move");
    let body = serde_json::json!({ "from": from, "to": to });
    let answer = admin::request(&http, "POST", &path, Some(&body))?;
    let answer = serde_json::json!({ "moves": [answer["move"].clone()] });
    let pending = |document: &Value| not_moved(document, &answer["moves"]);
    let remaining = wait_for(&http, wait, pending).await;
    report(
        &answer,
        common,
        &format!("replica of {queue}/{partition} moving from node {from} to node {to}"),
        remaining,
        wait,
        &format!("node {to} holds the replica, node {from} no longer does"),
    )
}

/// With `wait`, poll the cluster document (with the leaders' views) until `pending` finds
/// nothing, at most `wait` seconds; what is still pending then. `None` without `wait`.
async fn wait_for(
    http: &str,
    wait: Option<u64>,
    pending: impl Fn(&Value) -> Vec<String>,
) -> Option<Vec<String>> {
    let secs = wait?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let left = admin::request(http, "GET", CLUSTER_PATH, None)
            .map(|mut document| {
                fill_from_leaders(&mut document, |admin| {
                    admin::request(admin, "GET", CLUSTER_PATH, None).ok()
                });
                pending(&document)
            })
            .unwrap_or_else(|_| vec!["(the cluster document could not be read)".into()]);
        if left.is_empty() || std::time::Instant::now() >= deadline {
            return Some(left);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Print the moves of an add or remove answer and how the wait ended; exit 1 if some are
/// still pending after the wait.
fn report(
    answer: &Value,
    common: &CommonArgs,
    headline: &str,
    remaining: Option<Vec<String>>,
    wait: Option<u64>,
    done: &str,
) -> Result<ExitCode, Failure> {
    if common.json {
        let mut document = answer.clone();
        if let Some(left) = &remaining {
            document["pending"] = Value::from(left.clone());
        }
        print_json(&document);
    } else {
        let mut table = Table::new(&["QUEUE", "PARTITION", "FROM", "TO"]);
        for planned in answer["moves"].as_array().map_or(&[][..], Vec::as_slice) {
            table.row(vec![
                field(planned, "queue"),
                field(planned, "partition"),
                list(&planned["from"]),
                list(&planned["to"]),
            ]);
        }
        outln!("{headline}");
        out!("{}", table.render());
        match &remaining {
            Some(left) if left.is_empty() => outln!("{done}"),
            Some(left) => outln!(
                "still moving after {} s: {} (the moves continue)",
                wait.unwrap_or(0),
                left.join(", ")
            ),
            None => {
                outln!("the moves run in the background: `keratin cluster status` shows them")
            }
        }
    }
    Ok(match remaining {
        Some(left) if !left.is_empty() => ExitCode::FAILURE,
        _ => ExitCode::SUCCESS,
    })
}

/// The planned `moves` (`queue/index`) whose partition's leader does not count exactly the
/// planned replicas yet, or that have no leader to ask.
fn not_moved(document: &Value, moves: &Value) -> Vec<String> {
    let mut pending = Vec::new();
    for planned in moves.as_array().map_or(&[][..], Vec::as_slice) {
        let name = format!(
            "{}/{}",
            field(planned, "queue"),
            field(planned, "partition")
        );
        let mut wanted: Vec<u64> = planned["to"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        wanted.sort_unstable();
        let partition = document["queues"]
            .as_array()
            .and_then(|queues| queues.iter().find(|q| q["name"] == planned["queue"]))
            .and_then(|q| q["partitions"].as_array())
            .and_then(|ps| ps.iter().find(|p| p["index"] == planned["partition"]));
        let done = partition.is_some_and(|p| {
            let from_leader = p["leading"].as_bool() == Some(true) || !p["lag_from"].is_null();
            let mut voters: Vec<u64> = p["replicas"]
                .as_array()
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .filter_map(Value::as_u64)
                .collect();
            voters.sort_unstable();
            from_leader && voters == wanted
        });
        if !done {
            pending.push(name);
        }
    }
    pending
}

/// The partitions (`queue/index`) whose leader still counts node `id` among its replicas,
/// or that have no leader to ask.
fn held_by(document: &Value, id: u64) -> Vec<String> {
    let mut held = Vec::new();
    for queue in document["queues"].as_array().map_or(&[][..], Vec::as_slice) {
        for p in queue["partitions"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
        {
            let name = format!("{}/{}", field(queue, "name"), field(p, "index"));
            let from_leader = p["leading"].as_bool() == Some(true) || !p["lag_from"].is_null();
            let on_it = p["replicas"]
                .as_array()
                .is_some_and(|r| r.iter().any(|n| n.as_u64() == Some(id)));
            if !from_leader || on_it {
                held.push(name);
            }
        }
    }
    held
}

/// The partitions of queue `name` in the cluster document of the node whose admin port is at
/// `http`, each with its leader's view filled in (see the module docs); `None` when the node
/// cannot be asked or runs alone. For `keratin queue info`, whose protocol reply has no
/// in-sync set.
pub(crate) fn queue_partitions(http: &str, name: &str) -> Option<Vec<Value>> {
    let mut document = admin::request(http, "GET", CLUSTER_PATH, None).ok()?;
    fill_from_leaders(&mut document, |admin| {
        admin::request(admin, "GET", CLUSTER_PATH, None).ok()
    });
    let queue = document["queues"]
        .as_array()?
        .iter()
        .find(|q| q["name"] == name)?;
    queue["partitions"].as_array().cloned()
}

/// The in-sync set, lags and voters of each partition led by another node, from that node's
/// document (`fetch` of its admin address; each node at most once): the leader this node
/// names, else the node among the others that says it leads (a node holding no replica
/// names the preferred leader, which need not lead).
fn fill_from_leaders(document: &mut Value, fetch: impl Fn(&str) -> Option<Value>) {
    let admins: std::collections::BTreeMap<u64, String> = document["nodes"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter_map(|node| {
            Some((
                node["id"].as_u64()?,
                node["info"]["admin"].as_str()?.to_owned(),
            ))
        })
        .collect();
    let own = document["node_id"].as_u64().unwrap_or(0);
    let mut fetched: std::collections::BTreeMap<u64, Option<Value>> = Default::default();
    let Some(queues) = document["queues"].as_array_mut() else {
        return;
    };
    for queue in queues {
        let name = queue["name"].clone();
        let Some(partitions) = queue["partitions"].as_array_mut() else {
            continue;
        };
        for p in partitions {
            if p["leading"].as_bool() == Some(true) {
                continue;
            }
            // The leader this node names first, then every other node: a node holding no
            // replica names the preferred leader, which need not lead.
            let named = p["leader"].as_u64();
            let candidates: Vec<u64> = named
                .into_iter()
                .chain(
                    admins
                        .keys()
                        .copied()
                        .filter(|id| Some(*id) != named && *id != own),
                )
                .collect();
            let mut found = None;
            for candidate in candidates {
                let seen = fetched
                    .entry(candidate)
                    .or_insert_with(|| admins.get(&candidate).and_then(|admin| fetch(admin)));
                if let Some(view) = seen
                    .as_ref()
                    .and_then(|doc| leader_view(doc, &name, &p["index"]))
                {
                    found = Some((candidate, view.clone()));
                    break;
                }
            }
            let Some((leader, view)) = found else {
                continue;
            };
            p["leader"] = Value::from(leader);
            for key in ["in_sync", "replica_lag", "max_lag"] {
                p[key] = view[key].clone();
            }
            // The leader's voters are the group's current ones (a move may be under way).
            if view["replicas"].is_array() {
                p["replicas"] = view["replicas"].clone();
            }
            p["lag_from"] = Value::from(leader);
        }
    }
}

/// Partition `index` of queue `name` in a leader's document, if that node leads it.
fn leader_view<'a>(document: &'a Value, name: &Value, index: &Value) -> Option<&'a Value> {
    document["queues"]
        .as_array()?
        .iter()
        .find(|q| &q["name"] == name)?["partitions"]
        .as_array()?
        .iter()
        .find(|p| &p["index"] == index && p["leading"].as_bool() == Some(true))
}

/// A list of node ids as `1,2,3`; `-` when unknown.
pub(crate) fn list(value: &Value) -> String {
    match value.as_array() {
        Some(items) => {
            let items: Vec<String> = items.iter().map(Value::to_string).collect();
            items.join(",")
        }
        None => "-".to_owned(),
    }
}

fn field(value: &Value, name: &str) -> String {
    match &value[name] {
        Value::Null => "-".to_owned(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// Every node's file systems and memory as it last reported them (its label), from a
/// document whose `nodes` carry `id`, `levels` and `levels_age_ms` (the cluster document, or
/// the status document's `cluster`).
pub(crate) fn resources_text(document: &Value) -> String {
    let mut table = Table::new(&["NODE", "RESOURCE", "LEVEL", "FREE", "TOTAL", "HEARD"]);
    let mib = |value: &Value| {
        value
            .as_u64()
            .map_or_else(|| "-".to_owned(), |bytes| format!("{} MiB", bytes >> 20))
    };
    for node in document["nodes"].as_array().map_or(&[][..], Vec::as_slice) {
        let levels = &node["levels"];
        let heard = node["levels_age_ms"].as_u64().map_or_else(
            || "never".to_owned(),
            |ms| format!("{:.1} s ago", ms as f64 / 1000.0),
        );
        if levels.is_null() {
            table.row(vec![
                field(node, "id"),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                heard,
            ]);
            continue;
        }
        for fs in levels["filesystems"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
        {
            let free =
                fs["free_bytes"].as_u64().unwrap_or(0) + fs["spare_bytes"].as_u64().unwrap_or(0);
            table.row(vec![
                field(node, "id"),
                field(fs, "path"),
                field(fs, "level"),
                mib(&Value::from(free)),
                mib(&fs["total_bytes"]),
                heard.clone(),
            ]);
        }
        let memory = &levels["memory"];
        if !memory.is_null() {
            let free = memory["limit_bytes"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(memory["resident_bytes"].as_u64().unwrap_or(0));
            table.row(vec![
                field(node, "id"),
                "memory".to_owned(),
                field(memory, "level"),
                mib(&Value::from(free)),
                mib(&memory["limit_bytes"]),
                heard.clone(),
            ]);
        }
    }
    table.render()
}

/// The human rendering: the cluster line, a table of nodes, a table of partitions.
fn cluster_text(document: &Value) -> String {
    let mut out = format!(
        "cluster {}  seen from node {}  metadata leader {}  metadata applied {}\n\n",
        field(document, "name"),
        field(document, "node_id"),
        field(document, "meta_leader"),
        field(document, "meta_applied"),
    );
    let mut nodes = Table::new(&["NODE", "CLUSTER", "CLIENT", "ADMIN", "REACHABLE", "ROLE"]);
    let listed = |name: &str, id: &Value| {
        document[name]
            .as_array()
            .is_some_and(|ids| ids.contains(id))
    };
    for node in document["nodes"].as_array().map_or(&[][..], Vec::as_slice) {
        let info = &node["info"];
        nodes.row(vec![
            field(node, "id"),
            field(node, "cluster_addr"),
            field(info, "client"),
            field(info, "admin"),
            if node["reachable"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
            .to_owned(),
            if node["removed"].as_bool() == Some(true) {
                "removed"
            } else if node["meta_leader"].as_bool() == Some(true) {
                "metadata leader"
            } else if listed("meta_voters", &node["id"]) {
                "metadata voter"
            } else if listed("meta_learners", &node["id"]) {
                "metadata learner"
            } else {
                "-"
            }
            .to_owned(),
        ]);
    }
    out.push_str(&nodes.render());
    out.push('\n');
    out.push_str(&resources_text(document));
    let mut partitions = Table::new(&[
        "QUEUE",
        "PARTITION",
        "LEADER",
        "LEADER ADDRESS",
        "HERE",
        "REPLICAS",
        "IN SYNC",
        "MAX LAG",
    ]);
    for queue in document["queues"].as_array().map_or(&[][..], Vec::as_slice) {
        for p in queue["partitions"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
        {
            let leading = p["leading"].as_bool() == Some(true);
            partitions.row(vec![
                field(queue, "name"),
                field(p, "index"),
                field(p, "leader"),
                field(p, "leader_addr"),
                if leading { "leads" } else { "follows" }.to_owned(),
                list(&p["replicas"]),
                list(&p["in_sync"]),
                field(p, "max_lag"),
            ]);
        }
    }
    out.push('\n');
    out.push_str(&partitions.render());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_nodes_and_partition_leaders() {
        let document = serde_json::json!({
            "node_id": 2, "name": "keratin", "meta_leader": 1, "meta_applied": 7,
            "meta_voters": [1], "meta_learners": [2],
            "nodes": [
                {"id": 1, "cluster_addr": "127.0.0.1:5690", "reachable": true, "meta_leader": true,
                 "info": {"id": 1, "client": "127.0.0.1:5680", "admin": "127.0.0.1:5681"}},
                {"id": 2, "cluster_addr": "127.0.0.1:5691", "reachable": true, "meta_leader": false,
                 "info": null}
            ],
            "queues": [{"name": "orders", "replicas": 3, "partitions": [
                {"index": 0, "leading": false, "leader": 1, "leader_addr": "127.0.0.1:5680",
                 "ready": 0, "inflight": 0, "replicas": [1, 2, 3], "in_sync": null,
                 "replica_lag": null, "max_lag": null},
                {"index": 1, "leading": false, "leader": 3, "leader_addr": null,
                 "ready": 0, "inflight": 0, "replicas": [1, 2, 3], "in_sync": null,
                 "replica_lag": null, "max_lag": null}
            ]}]
        });
        let mut document = document;
        // Node 1 leads partition 0 and answers with its view; node 3's admin is unknown.
        let asked = std::cell::RefCell::new(Vec::new());
        fill_from_leaders(&mut document, |admin| {
            asked.borrow_mut().push(admin.to_owned());
            Some(
                serde_json::json!({"queues": [{"name": "orders", "partitions": [
                    {"index": 0, "leading": true, "in_sync": [1, 2], "replicas": [1, 2, 3],
                     "replica_lag": {"1": 0, "2": 3, "3": 1500}, "max_lag": 1500}
                ]}]}),
            )
        });
        assert_eq!(asked.into_inner(), vec!["127.0.0.1:5681".to_owned()]);
        let p = &document["queues"][0]["partitions"];
        assert_eq!(p[0]["in_sync"], serde_json::json!([1, 2]));
        assert_eq!(p[0]["lag_from"], 1);
        assert_eq!(
            p[1]["in_sync"],
            Value::Null,
            "no admin address known for node 3"
        );
        let text = cluster_text(&document);
        assert!(
            text.contains("1,2,3") && text.contains("1,2 ") && text.contains("1500"),
            "{text}"
        );
        assert!(text.contains("metadata leader 1"), "{text}");
        assert!(text.contains("metadata learner"), "{text}");
        assert!(text.contains("127.0.0.1:5681"), "{text}");
        assert!(text.contains("orders"), "{text}");
        assert!(text.contains("follows"), "{text}");
        // Node 3 is still a replica of both; partition 1's leader could not be asked.
        assert_eq!(held_by(&document, 3), vec!["orders/0", "orders/1"]);
        assert_eq!(held_by(&document, 4), vec!["orders/1"]);
        let planned = serde_json::json!([
            {"queue": "orders", "partition": 0, "from": [1, 2, 4], "to": [3, 2, 1]},
            {"queue": "orders", "partition": 1, "from": [1, 2, 4], "to": [1, 2, 3]}
        ]);
        assert_eq!(
            not_moved(&document, &planned),
            vec!["orders/1"],
            "partition 0's leader counts 1,2,3; partition 1 has no leader view"
        );
    }

    #[test]
    fn the_text_lists_every_node_s_file_systems_and_memory() {
        let document = serde_json::json!({
            "node_id": 1, "name": "keratin", "meta_leader": 1, "meta_applied": 7,
            "nodes": [
                {"id": 1, "cluster_addr": "127.0.0.1:5690", "reachable": true, "meta_leader": true,
                 "levels_age_ms": 0, "levels": {
                    "filesystems": [{"path": "/data", "level": "normal", "free_bytes": 4294967296_u64,
                                     "spare_bytes": 1048576, "total_bytes": 8589934592_u64}],
                    "memory": {"level": "normal", "resident_bytes": 104857600,
                               "limit_bytes": 1073741824}}},
                {"id": 3, "cluster_addr": "127.0.0.1:5692", "reachable": true, "meta_leader": false,
                 "levels_age_ms": 1500, "levels": {
                    "filesystems": [{"path": "/small", "level": "hard", "free_bytes": 73400320,
                                     "spare_bytes": 0, "total_bytes": 268435456}],
                    "memory": null}},
                {"id": 4, "cluster_addr": "127.0.0.1:5693", "reachable": false, "meta_leader": false,
                 "levels": null, "levels_age_ms": null}
            ],
            "queues": []
        });
        let text = resources_text(&document);
        let row = |node: &str, what: &str| {
            text.lines()
                .find(|l| l.starts_with(node) && l.contains(what))
                .unwrap_or_else(|| panic!("no row {node} {what}: {text}"))
                .to_owned()
        };
        let small = row("3", "/small");
        assert!(
            small.contains("hard") && small.contains("70 MiB") && small.contains("256 MiB"),
            "{small}"
        );
        assert!(small.contains("1.5 s ago"), "{small}");
        let data = row("1", "/data");
        assert!(
            data.contains("4097 MiB") && data.contains("normal"),
            "{data}"
        );
        let memory = row("1", "memory");
        assert!(
            memory.contains("924 MiB") && memory.contains("1024 MiB"),
            "{memory}"
        );
        assert!(row("4", "never").contains('-'));
        assert!(cluster_text(&document).contains("/small"));
    }

    #[test]
    fn a_partition_is_filled_from_the_node_that_leads_it_when_the_named_one_does_not() {
        // Node 1 holds no replica of the partition: it names the preferred leader (3), and
        // node 2 leads it.
        let mut document = serde_json::json!({
            "nodes": [
                {"id": 1, "info": {"admin": "a1"}},
                {"id": 2, "info": {"admin": "a2"}},
                {"id": 3, "info": {"admin": "a3"}}
            ],
            "queues": [{"name": "q", "partitions": [
                {"index": 0, "leading": false, "leader": 3, "replicas": [], "in_sync": null}
            ]}]
        });
        let view = |leading: bool| {
            serde_json::json!({"queues": [{"name": "q", "partitions": [
                {"index": 0, "leading": leading, "leader": 2, "replicas": [2, 3, 4],
                 "in_sync": if leading { serde_json::json!([2, 3, 4]) } else { Value::Null },
                 "replica_lag": null, "max_lag": 0}
            ]}]})
        };
        let asked = std::cell::RefCell::new(Vec::new());
        fill_from_leaders(&mut document, |admin| {
            asked.borrow_mut().push(admin.to_owned());
            match admin {
                "a2" => Some(view(true)),
                "a3" => Some(view(false)),
                _ => None,
            }
        });
        let p = &document["queues"][0]["partitions"][0];
        assert_eq!(p["lag_from"], 2, "{p}");
        assert_eq!(p["leader"], 2, "{p}");
        assert_eq!(p["replicas"], serde_json::json!([2, 3, 4]), "{p}");
        assert_eq!(p["in_sync"], serde_json::json!([2, 3, 4]), "{p}");
        let asked = asked.into_inner();
        assert_eq!(
            asked.iter().filter(|a| *a == "a3").count(),
            1,
            "each node asked once: {asked:?}"
        );
    }
}
