//! `keratin cluster status`: the cluster as the node at `--server` sees it — its nodes
//! (addresses, reachable or not, which leads the metadata group) and every queue's partitions
//! (leader, replicas, in-sync set, largest replica lag) — read from the HTTP admin port's
//! `GET /api/v1/cluster`. Only a partition's leader knows its in-sync set and lags: for the
//! partitions another node leads, the leader's own document is read too (once per leader, at
//! the admin address the first node lists for it) and its view of those partitions is taken,
//! marked `"lag_from": <leader id>`; a leader that cannot be reached leaves them `null`.
//! `--json` prints the document with those views filled in.

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
                print!("{}", cluster_text(&document));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
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

/// The in-sync set and lags of each partition led by another node, from that node's document
/// (`fetch` of its admin address; once per leader).
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
            let Some(leader) = p["leader"].as_u64() else {
                continue;
            };
            let seen = fetched
                .entry(leader)
                .or_insert_with(|| admins.get(&leader).and_then(|admin| fetch(admin)));
            let Some(view) = seen
                .as_ref()
                .and_then(|doc| leader_view(doc, &name, &p["index"]))
            else {
                continue;
            };
            for key in ["in_sync", "replica_lag", "max_lag"] {
                p[key] = view[key].clone();
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
            if node["meta_leader"].as_bool() == Some(true) {
                "metadata leader"
            } else {
                "-"
            }
            .to_owned(),
        ]);
    }
    out.push_str(&nodes.render());
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
                    {"index": 0, "leading": true, "in_sync": [1, 2],
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
        assert!(text.contains("127.0.0.1:5681"), "{text}");
        assert!(text.contains("orders"), "{text}");
        assert!(text.contains("follows"), "{text}");
    }
}
