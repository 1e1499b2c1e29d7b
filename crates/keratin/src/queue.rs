//! `keratin queue declare|list|info|purge|delete`: the admin verbs, each one request to the
//! broker, printed as a table or as one JSON object.
//! `keratin queue set NAME ...` changes the settings of a live queue (limits, overflow,
//! dead-letter queue, max deliveries). `keratin queue move NAME --partition P --from N --to M`
//! moves one replica in a cluster (`cluster.rs`, through the HTTP admin port).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use keratin_client::{
    Client, Overflow, QueueInfoReply, QueueSettings, QueueSettingsUpdate, QueueSummary, Update,
};
use serde_json::{json, Value};

use crate::connect::{connect, CommonArgs};
use crate::output::{format_bytes, print_json, Failure, Table};

/// `keratin queue ...`.
#[derive(Debug, Args)]
pub struct QueueArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(subcommand)]
    verb: QueueVerb,
}

#[derive(Debug, Subcommand)]
enum QueueVerb {
    /// Create a queue, or succeed if it exists with the same settings (409 otherwise).
    Declare(DeclareArgs),
    /// Every queue with its message counts.
    List,
    /// A queue's settings and per-partition counts.
    Info { name: String },
    /// Remove every ready message of a queue (inflight ones stay until settled).
    Purge { name: String },
    /// Delete a queue and all its messages.
    Delete { name: String },
    /// Change a live queue's settings; `none` unsets a limit or the dead-letter queue.
    Set(SetArgs),
    /// Move one partition's replica to another node, live (a cluster): the new node catches
    /// up as a learner, then takes the old one's place; the old copy is then removed.
    Move(MoveArgs),
}

#[derive(Debug, Args)]
struct MoveArgs {
    name: String,
    /// The partition whose replica moves.
    #[arg(long, value_name = "P")]
    partition: u32,
    /// The node the replica leaves.
    #[arg(long, value_name = "NODE")]
    from: u64,
    /// The node that takes it (below the soft level, without a replica of the partition).
    #[arg(long, value_name = "NODE")]
    to: u64,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
    /// Wait up to this many seconds until the move is done; exits 1 if it is not then.
    #[arg(long, value_name = "SECS")]
    wait: Option<u64>,
}

/// `reject` or `drop_oldest`, as the CLI spells them.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum OverflowArg {
    /// Refuse publishes past the limit with ERR_LIMITED, reason queue_full.
    Reject,
    /// Remove the oldest ready messages to make room.
    #[value(name = "drop_oldest", alias = "drop-oldest")]
    DropOldest,
}

impl From<OverflowArg> for Overflow {
    fn from(o: OverflowArg) -> Overflow {
        match o {
            OverflowArg::Reject => Overflow::Reject,
            OverflowArg::DropOldest => Overflow::DropOldest,
        }
    }
}

#[derive(Debug, Args)]
struct SetArgs {
    name: String,
    /// Most messages the queue holds (a number, or `none`).
    #[arg(long = "max-messages", value_name = "N|none")]
    max_messages: Option<String>,
    /// Most message bytes the queue holds (a number, or `none`).
    #[arg(long = "max-bytes", value_name = "B|none")]
    max_bytes: Option<String>,
    /// What happens at a limit.
    #[arg(long, value_enum)]
    overflow: Option<OverflowArg>,
    /// Dead-letter queue (a name, or `none`).
    #[arg(long = "dead-letter", value_name = "Q|none")]
    dead_letter: Option<String>,
    /// Deliveries before dead-lettering (a number, or `none`).
    #[arg(long = "max-deliveries", value_name = "N|none")]
    max_deliveries: Option<String>,
}

fn parse_update<T: std::str::FromStr>(
    flag: &str,
    value: Option<String>,
) -> Result<Update<T>, Failure> {
    match value.as_deref() {
        None => Ok(Update::Keep),
        Some("none") => Ok(Update::Clear),
        Some(text) => text
            .parse()
            .map(Update::Set)
            .map_err(|_| Failure::new(format!("{flag} {text:?}: expected a number or none"))),
    }
}

async fn run_set(client: &Client, args: SetArgs, json: bool) -> Result<(), Failure> {
    let update = QueueSettingsUpdate {
        dead_letter: match args.dead_letter.as_deref() {
            None => Update::Keep,
            Some("none") => Update::Clear,
            Some(name) => Update::Set(name.to_string()),
        },
        max_deliveries: parse_update("--max-deliveries", args.max_deliveries)?,
        max_messages: parse_update("--max-messages", args.max_messages)?,
        max_bytes: parse_update("--max-bytes", args.max_bytes)?,
        overflow: args
            .overflow
            .map_or(Update::Keep, |o| Update::Set(o.into())),
    };
    client
        .set_queue_settings(&args.name, update)
        .await
        .map_err(|error| Failure::client(format!("set {}", args.name), &error))?;
    let info = client
        .info(&args.name)
        .await
        .map_err(|error| Failure::client(format!("info {}", args.name), &error))?;
    done(
        json,
        json!({"queue": args.name, "settings": settings_json(&info.settings)}),
        format!(
            "queue {} now has {}",
            args.name,
            settings_text(&info.settings)
        ),
    );
    Ok(())
}

fn settings_text(s: &QueueSettings) -> String {
    let opt = |v: Option<u64>| v.map_or("none".to_string(), |n| n.to_string());
    format!(
        "max_messages={} max_bytes={} overflow={}",
        opt(s.max_messages),
        opt(s.max_bytes),
        match s.overflow {
            Some(Overflow::DropOldest) => "drop_oldest",
            _ => "reject",
        }
    )
}

#[derive(Debug, Args)]
struct DeclareArgs {
    name: String,
    /// Number of partitions; fixed at declaration.
    #[arg(long, default_value_t = 1, value_name = "N")]
    partitions: u32,
    /// Queue that receives rejected and dead messages.
    #[arg(long = "dead-letter", value_name = "Q")]
    dead_letter: Option<String>,
    /// Deliveries after which a message is dead-lettered instead of redelivered.
    #[arg(long = "max-deliveries", value_name = "N")]
    max_deliveries: Option<u32>,
    /// Most messages the queue holds (ready and inflight).
    #[arg(long = "max-messages", value_name = "N")]
    max_messages: Option<u64>,
    /// Most message bytes the queue holds (ready and inflight).
    #[arg(long = "max-bytes", value_name = "B")]
    max_bytes: Option<u64>,
    /// What happens at a limit (default reject).
    #[arg(long, value_enum)]
    overflow: Option<OverflowArg>,
    /// Nodes holding a copy of each partition (a cluster; default min(3, nodes)); fixed at
    /// declaration. A node that runs alone refuses more than 1.
    #[arg(long, value_name = "R", value_parser = clap::value_parser!(u32).range(1..))]
    replicas: Option<u32>,
    /// Pin the replicas to these cluster nodes (comma-separated ids; the first leads
    /// partition 0, the next partitions' leaders rotate); one node per replica.
    #[arg(long, value_name = "ID,ID,...", value_delimiter = ',')]
    nodes: Vec<u64>,
}

/// Runs one queue verb.
pub async fn run(args: QueueArgs) -> Result<ExitCode, Failure> {
    let client = connect(&args.common, None).await?;
    let json = args.common.json;
    let result = match args.verb {
        QueueVerb::Declare(declare) => run_declare(&client, declare, json).await,
        QueueVerb::List => run_list(&client, json).await,
        QueueVerb::Info { name } => run_info(&client, &name, json).await,
        QueueVerb::Set(set) => run_set(&client, set, json).await,
        QueueVerb::Move(m) => {
            // Through the HTTP admin port, like `keratin cluster`.
            client.close().await;
            return crate::cluster::move_replica(
                &args.common,
                m.http.as_deref(),
                &m.name,
                m.partition,
                (m.from, m.to),
                m.wait,
            )
            .await;
        }
        QueueVerb::Purge { name } => {
            let outcome = client.purge(&name).await;
            outcome.map_err(|error| Failure::client(format!("purge {name}"), &error))?;
            done(
                json,
                json!({"queue": name, "purged": true}),
                format!("purged queue {name}"),
            );
            Ok(())
        }
        QueueVerb::Delete { name } => {
            let outcome = client.delete(&name).await;
            outcome.map_err(|error| Failure::client(format!("delete {name}"), &error))?;
            done(
                json,
                json!({"queue": name, "deleted": true}),
                format!("deleted queue {name}"),
            );
            Ok(())
        }
    };
    client.close().await;
    result.map(|()| ExitCode::SUCCESS)
}

fn done(json: bool, object: Value, text: String) {
    if json {
        print_json(&object);
    } else {
        outln!("{text}");
    }
}

async fn run_declare(client: &Client, args: DeclareArgs, json: bool) -> Result<(), Failure> {
    let settings = QueueSettings {
        partitions: args.partitions,
        dead_letter: args.dead_letter,
        max_deliveries: args.max_deliveries,
        max_messages: args.max_messages,
        max_bytes: args.max_bytes,
        overflow: args.overflow.map(Overflow::from),
        replicas: args.replicas,
    };
    client
        .declare_on(&args.name, settings.clone(), &args.nodes)
        .await
        .map_err(|error| Failure::client(format!("declare {}", args.name), &error))?;
    let text = format!(
        "declared queue {} ({} partition{})",
        args.name,
        settings.partitions,
        if settings.partitions == 1 { "" } else { "s" }
    );
    let mut object = json!({
        "queue": args.name,
        "declared": true,
        "settings": settings_json(&settings),
    });
    if !args.nodes.is_empty() {
        object["nodes"] = json!(args.nodes);
    }
    done(json, object, text);
    Ok(())
}

async fn run_list(client: &Client, json: bool) -> Result<(), Failure> {
    let queues = client
        .list()
        .await
        .map_err(|error| Failure::client("list queues", &error))?;
    if json {
        let queues: Vec<Value> = queues.iter().map(summary_json).collect();
        print_json(&json!({ "queues": queues }));
        return Ok(());
    }
    if queues.is_empty() {
        outln!("no queues");
        return Ok(());
    }
    let mut table = Table::new(&["QUEUE", "PARTITIONS", "READY", "INFLIGHT", "BYTES"]);
    for queue in &queues {
        table.row(vec![
            queue.queue.clone(),
            queue.partitions.to_string(),
            queue.ready.to_string(),
            queue.inflight.to_string(),
            format_bytes(queue.bytes),
        ]);
    }
    out!("{}", table.render());
    Ok(())
}

async fn run_info(client: &Client, name: &str, json: bool) -> Result<(), Failure> {
    let info = client
        .info(name)
        .await
        .map_err(|error| Failure::client(format!("info {name}"), &error))?;
    // In a cluster, the replicas and in-sync sets come from the admin API (the protocol's
    // reply has leaders only): best effort, `-` when the admin port cannot be asked.
    let replication = match client.server_info().admin.clone() {
        Some(http) if info.partitions.iter().any(|p| p.leader.is_some()) => {
            let name = name.to_owned();
            tokio::task::spawn_blocking(move || crate::cluster::queue_partitions(&http, &name))
                .await
                .ok()
                .flatten()
        }
        _ => None,
    };
    if json {
        print_json(&info_json(&info, replication.as_deref()));
    } else {
        out!("{}", info_text(&info, replication.as_deref()));
    }
    Ok(())
}

fn summary_json(queue: &QueueSummary) -> Value {
    json!({
        "queue": queue.queue,
        "partitions": queue.partitions,
        "ready": queue.ready,
        "inflight": queue.inflight,
        "bytes": queue.bytes,
    })
}

fn overflow_name(overflow: Option<Overflow>) -> Option<&'static str> {
    overflow.map(|overflow| match overflow {
        Overflow::Reject => "reject",
        Overflow::DropOldest => "drop_oldest",
    })
}

fn settings_json(settings: &QueueSettings) -> Value {
    json!({
        "partitions": settings.partitions,
        "dead_letter": settings.dead_letter,
        "max_deliveries": settings.max_deliveries,
        "max_messages": settings.max_messages,
        "max_bytes": settings.max_bytes,
        "overflow": overflow_name(settings.overflow),
        "replicas": settings.replicas,
    })
}

/// `{"queue", "settings", "ready", "inflight", "bytes", "disk_bytes", "partitions": [...]}`,
/// the totals summed over partitions; each partition's `replicas`, `in_sync` and `max_lag`
/// from `replication` (the cluster document's partitions), `null` without it.
fn info_json(info: &QueueInfoReply, replication: Option<&[Value]>) -> Value {
    let partitions: Vec<Value> = info
        .partitions
        .iter()
        .enumerate()
        .map(|(index, p)| {
            json!({
                "partition": index,
                "ready": p.ready,
                "inflight": p.inflight,
                "bytes": p.bytes,
                "disk_bytes": p.disk_bytes,
                "leading": p.leading,
                "leader": p.leader,
                "leader_addr": p.leader_addr,
                "replicas": replication_field(replication, index, "replicas"),
                "in_sync": replication_field(replication, index, "in_sync"),
                "max_lag": replication_field(replication, index, "max_lag"),
            })
        })
        .collect();
    let sum = |field: fn(&keratin_client::PartitionInfo) -> u64| -> u64 {
        info.partitions
            .iter()
            .map(field)
            .fold(0, u64::saturating_add)
    };
    json!({
        "queue": info.queue,
        "settings": settings_json(&info.settings),
        "ready": sum(|p| p.ready),
        "inflight": sum(|p| p.inflight),
        "bytes": sum(|p| p.bytes),
        "disk_bytes": sum(|p| p.disk_bytes),
        "partitions": partitions,
    })
}

/// Who leads a partition, as `queue info` shows it: `this node`, `node 2 (10.0.0.2:5680)`, or
/// `none known` (an election is under way).
fn leader_text(p: &keratin_client::PartitionInfo) -> String {
    if p.leading {
        return "this node".to_owned();
    }
    match (p.leader, &p.leader_addr) {
        (Some(id), Some(addr)) => format!("node {id} ({addr})"),
        (Some(id), None) => format!("node {id}"),
        (None, Some(addr)) => addr.clone(),
        (None, None) => "none known".to_owned(),
    }
}

/// Field `key` of partition `index` in the cluster document's partitions; `null` if unknown.
fn replication_field(replication: Option<&[Value]>, index: usize, key: &str) -> Value {
    replication
        .and_then(|partitions| partitions.iter().find(|p| p["index"] == index))
        .map_or(Value::Null, |p| p[key].clone())
}

fn info_text(info: &QueueInfoReply, replication: Option<&[Value]>) -> String {
    let settings = &info.settings;
    let unset = || "-".to_owned();
    let mut out = format!("queue           {}\n", info.queue);
    out.push_str(&format!("partitions      {}\n", settings.partitions));
    let dead_letter = settings.dead_letter.clone().unwrap_or_else(unset);
    out.push_str(&format!("dead-letter     {dead_letter}\n"));
    let lines = [
        ("max-deliveries", settings.max_deliveries.map(u64::from)),
        ("max-messages", settings.max_messages),
        ("max-bytes", settings.max_bytes),
    ];
    for (label, value) in lines {
        let value = value.map_or_else(unset, |v| v.to_string());
        out.push_str(&format!("{label:<16}{value}\n"));
    }
    let overflow = overflow_name(settings.overflow).unwrap_or("reject");
    out.push_str(&format!("overflow        {overflow}\n"));
    let replicas = settings
        .replicas
        .map_or_else(|| "default".to_owned(), |r| r.to_string());
    out.push_str(&format!("replicas        {replicas}\n\n"));
    let mut headers = vec!["PARTITION", "READY", "INFLIGHT", "BYTES", "DISK", "LEADER"];
    if replication.is_some() {
        headers.extend(["REPLICAS", "IN SYNC"]);
    }
    let mut table = Table::new(&headers);
    for (index, p) in info.partitions.iter().enumerate() {
        let mut row = vec![
            index.to_string(),
            p.ready.to_string(),
            p.inflight.to_string(),
            format_bytes(p.bytes),
            format_bytes(p.disk_bytes),
            leader_text(p),
        ];
        if replication.is_some() {
            row.push(crate::cluster::list(&replication_field(
                replication,
                index,
                "replicas",
            )));
            row.push(crate::cluster::list(&replication_field(
                replication,
                index,
                "in_sync",
            )));
        }
        table.row(row);
    }
    out.push_str(&table.render());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(
        leading: bool,
        leader: Option<u64>,
        addr: Option<&str>,
    ) -> keratin_client::PartitionInfo {
        keratin_client::PartitionInfo {
            ready: 0,
            inflight: 0,
            bytes: 0,
            disk_bytes: 0,
            leading,
            leader,
            leader_addr: addr.map(str::to_owned),
        }
    }

    #[test]
    fn info_names_each_partitions_leader() {
        assert_eq!(
            leader_text(&partition(true, Some(1), Some("a:1"))),
            "this node"
        );
        assert_eq!(
            leader_text(&partition(false, Some(2), Some("10.0.0.2:5680"))),
            "node 2 (10.0.0.2:5680)"
        );
        assert_eq!(leader_text(&partition(false, None, None)), "none known");
        let info = QueueInfoReply {
            request_id: 1,
            queue: "q".into(),
            settings: QueueSettings {
                replicas: Some(3),
                ..QueueSettings::default()
            },
            partitions: vec![partition(false, Some(2), Some("h:1"))],
        };
        let text = info_text(&info, None);
        assert!(text.contains("replicas        3"), "{text}");
        assert!(text.contains("node 2 (h:1)"), "{text}");
        assert!(!text.contains("IN SYNC"), "{text}");
        assert_eq!(
            info_json(&info, None)["partitions"][0]["leader_addr"],
            "h:1"
        );
        assert_eq!(
            info_json(&info, None)["partitions"][0]["in_sync"],
            Value::Null
        );
        // With the cluster document's view (the leader's in-sync set).
        let replication = vec![json!({"index": 0, "replicas": [1, 2, 3], "in_sync": [2, 3],
                                      "max_lag": 7})];
        let text = info_text(&info, Some(&replication));
        assert!(
            text.contains("IN SYNC") && text.contains("1,2,3") && text.contains("2,3"),
            "{text}"
        );
        let object = info_json(&info, Some(&replication));
        assert_eq!(object["partitions"][0]["in_sync"], json!([2, 3]));
        assert_eq!(object["partitions"][0]["max_lag"], 7);
    }
}
