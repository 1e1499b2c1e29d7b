//! `keratin status`: the node's filesystems and memory with their limit levels, and on a cluster
//! node every node's as their labels last reported, read from the HTTP admin port's
//! `GET /api/v1/status` (see [`crate::admin`] for the request).
//!
//! Owns the human rendering. The document itself is the server's (`keratin-server`
//! `limits.rs`, `status()`); `--json` prints it unchanged.

use std::process::ExitCode;

use clap::Args;
use serde_json::Value;

use crate::admin;
use crate::connect::CommonArgs;
use crate::output::{format_bytes, print_json, Failure, Table};

const STATUS_PATH: &str = "/api/v1/status";

/// Flags of `keratin status`: the status comes from the HTTP admin port, found through
/// `--server` unless `--http` names it.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
}

/// Runs `keratin status`.
pub async fn run(args: StatusArgs) -> Result<ExitCode, Failure> {
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let document = admin::request(&http, "GET", STATUS_PATH, None)?;
    if args.common.json {
        print_json(&document);
    } else {
        out!("{}", status_text(&document));
    }
    Ok(ExitCode::SUCCESS)
}

fn bytes_field(value: &Value, field: &str) -> String {
    value[field]
        .as_u64()
        .map_or_else(|| "?".to_owned(), format_bytes)
}

fn text_field<'a>(value: &'a Value, field: &str) -> &'a str {
    value[field].as_str().unwrap_or("?")
}

/// The human rendering: the node, a table of filesystems, a line for memory.
fn status_text(document: &Value) -> String {
    let mut out = format!("node    {}\n\n", text_field(document, "node"));
    let mut table = Table::new(&["PATH", "LEVEL", "FREE", "TOTAL", "SPARE"]);
    let filesystems = document["filesystems"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    for fs in filesystems {
        table.row(vec![
            text_field(fs, "path").to_owned(),
            text_field(fs, "level").to_owned(),
            bytes_field(fs, "free_bytes"),
            bytes_field(fs, "total_bytes"),
            bytes_field(fs, "spare_bytes"),
        ]);
    }
    out.push_str(&table.render());
    let memory = &document["memory"];
    out.push_str(&format!(
        "\nmemory  {} resident of {} limit ({}), level {}\n",
        bytes_field(memory, "resident_bytes"),
        bytes_field(memory, "limit_bytes"),
        text_field(memory, "limit_source"),
        text_field(memory, "level"),
    ));
    let bounds = &document["bounds"];
    if bounds.is_object() {
        let pair = |name: &str| {
            let bound = &bounds[name];
            match (bound["count"].as_u64(), bound["max"].as_u64()) {
                (Some(count), Some(max)) => format!("{count} of {max}"),
                _ => "?".to_owned(),
            }
        };
        out.push_str(&format!(
            "bounds  queues {}, partitions {}, consumers {}\n",
            pair("queues"),
            pair("partitions"),
            pair("consumers"),
        ));
    }
    let cluster = &document["cluster"];
    if cluster.is_object() {
        out.push_str("\ncluster nodes, as their labels last reported\n");
        out.push_str(&crate::cluster::resources_text(cluster));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_status_names_every_field() {
        let document = serde_json::json!({
            "node": "n1",
            "filesystems": [{"path": "/data", "level": "soft", "free_bytes": 2048,
                             "total_bytes": 1048576, "spare_bytes": 0}],
            "memory": {"resident_bytes": 1024, "limit_bytes": 4096,
                       "limit_source": "cgroup v2", "level": "normal"},
            "bounds": {"queues": {"count": 3, "max": 10000},
                       "partitions": {"count": 4, "max": 16384},
                       "consumers": {"count": 0, "max": 16384}},
        });
        let text = status_text(&document);
        assert!(text.contains("/data   soft"), "{text}");
        assert!(text.contains("2.0 KiB"), "{text}");
        assert!(
            text.contains("1.0 KiB resident of 4.0 KiB limit (cgroup v2), level normal"),
            "{text}"
        );
        assert!(
            text.contains("bounds  queues 3 of 10000, partitions 4 of 16384, consumers 0 of 16384"),
            "{text}"
        );
        assert!(
            !text.contains("cluster nodes"),
            "a node alone lists no cluster: {text}"
        );
    }

    #[test]
    fn a_cluster_node_s_status_lists_every_node_s_file_systems() {
        let document = serde_json::json!({
            "node": "n1",
            "filesystems": [],
            "memory": {},
            "cluster": {"nodes": [
                {"id": 2, "levels_age_ms": 300, "levels": {
                    "filesystems": [{"path": "/small", "level": "hard", "free_bytes": 73400320,
                                     "spare_bytes": 0, "total_bytes": 268435456}],
                    "memory": null}}
            ]},
        });
        let text = status_text(&document);
        assert!(text.contains("cluster nodes"), "{text}");
        let row = text
            .lines()
            .find(|l| l.starts_with('2') && l.contains("/small"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(row.contains("hard") && row.contains("70 MiB"), "{row}");
    }
}
