//! `keratin cluster status`: the cluster as the node at `--server` sees it — its nodes
//! (addresses, reachable or not, which leads the metadata group) and every queue's partition
//! leaders — read from the HTTP admin port's `GET /api/v1/cluster`. `--json` prints the
//! document unchanged.

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
            let document = admin::request(&http, "GET", CLUSTER_PATH, None)?;
            if args.common.json {
                print_json(&document);
            } else {
                print!("{}", cluster_text(&document));
            }
            Ok(ExitCode::SUCCESS)
        }
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
    let mut partitions = Table::new(&["QUEUE", "PARTITION", "LEADER", "LEADER ADDRESS", "HERE"]);
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
                 "ready": 0, "inflight": 0}
            ]}]
        });
        let text = cluster_text(&document);
        assert!(text.contains("metadata leader 1"), "{text}");
        assert!(text.contains("127.0.0.1:5681"), "{text}");
        assert!(text.contains("orders"), "{text}");
        assert!(text.contains("follows"), "{text}");
    }
}
