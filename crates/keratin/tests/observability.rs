//! What an operator sees, against the real binary: `/metrics` parsed strictly as Prometheus
//! text (every sample line `name{labels} value`, every family with HELP and TYPE) and its
//! figures checked against `/api/v1/status`, `/api/v1/queues` and what was published; and the
//! attention items of a size-limited tmpfs filled past soft (root only): raised while the level
//! holds, carried over a restart, cleared by draining, kept in history across another restart,
//! seen through HTTP and `keratin attention`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, Overflow, QueueSettings};
use serde_json::Value;
use support::*;

/// The tests of this file run one at a time: the fill drives a broker at full speed.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Bound on waiting for the sampler to notice a change (100 ms interval in the fill config,
/// 1 s by default; a loaded CI machine may be slow to schedule it).
const SAMPLE_WAIT: Duration = Duration::from_secs(30);

/// One sample line of the exposition.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A strictly parsed exposition: samples and the declared families.
#[derive(Debug)]
struct Exposition {
    samples: Vec<Sample>,
    /// Family name -> TYPE.
    types: BTreeMap<String, String>,
}

impl Exposition {
    /// Samples named `name` whose labels include every pair of `labels`.
    fn values(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .collect()
    }

    /// The one sample named `name` with `labels`; panics if there is none or several.
    fn one(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let values = self.values(name, labels);
        assert_eq!(values.len(), 1, "{name} {labels:?}: {values:?}");
        values[0]
    }
}

fn is_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `{a="x",b="y\"z"}` -> pairs; the text after the closing brace.
fn parse_labels(text: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = text.strip_prefix('{').ok_or("no {")?;
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (key, after) = rest.split_once("=\"").ok_or("a label without =\"")?;
        if !is_name(key) {
            return Err(format!("bad label name {key:?}"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => return Err("an unterminated label value".into()),
            }
        };
        if labels.insert(key.to_string(), value).is_some() {
            return Err(format!("label {key} twice"));
        }
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

fn parse_value(text: &str) -> Result<f64, String> {
    match text {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => text.parse().map_err(|e| format!("bad value {text:?}: {e}")),
    }
}

/// Parse the exposition; panics naming the line on anything not in the format.
fn parse_exposition(text: &str) -> Exposition {
    let mut samples = Vec::new();
    let mut types = BTreeMap::new();
    let mut helps = BTreeSet::new();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.last(),
        Some(&"# EOF"),
        "the exposition ends with # EOF"
    );
    for line in &lines[..lines.len() - 1] {
        if let Some(comment) = line.strip_prefix("# ") {
            let mut words = comment.splitn(3, ' ');
            let (kind, name, rest) = (words.next(), words.next(), words.next());
            let name = name.unwrap_or_else(|| panic!("a comment without a name: {line:?}"));
            assert!(is_name(name), "bad family name in {line:?}");
            match kind {
                Some("HELP") => {
                    assert!(rest.is_some_and(|h| !h.is_empty()), "empty HELP: {line:?}");
                    assert!(helps.insert(name.to_string()), "HELP twice: {line:?}");
                }
                Some("TYPE") => {
                    let kind = rest.unwrap_or_default();
                    assert!(
                        ["counter", "gauge", "histogram", "info", "unknown"].contains(&kind),
                        "bad TYPE: {line:?}"
                    );
                    assert!(
                        types.insert(name.to_string(), kind.to_string()).is_none(),
                        "TYPE twice: {line:?}"
                    );
                }
                Some("UNIT") => {}
                _ => panic!("an unknown comment: {line:?}"),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        assert!(is_name(name), "bad metric name in {line:?}");
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).unwrap_or_else(|e| panic!("{e}: {line:?}"))
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let value_text = rest
            .strip_prefix(' ')
            .unwrap_or_else(|| panic!("no space before the value: {line:?}"));
        assert!(!value_text.contains(' '), "more than a value: {line:?}");
        let value = parse_value(value_text).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    // Every sample belongs to a family declared with HELP and TYPE.
    for sample in &samples {
        let family = [
            "_total", "_bucket", "_count", "_sum", "_created", "_info", "",
        ]
        .iter()
        .filter_map(|suffix| sample.name.strip_suffix(suffix))
        .find(|family| types.contains_key(*family))
        .unwrap_or_else(|| panic!("{} has no TYPE line", sample.name));
        assert!(helps.contains(family), "{family} has no HELP line");
    }
    assert!(!samples.is_empty(), "no samples at all");
    Exposition { samples, types }
}

fn scrape(http: SocketAddr) -> Exposition {
    parse_exposition(&http_get(http, "/metrics"))
}

fn queues(http: SocketAddr) -> Value {
    serde_json::from_str(&http_get(http, "/api/v1/queues")).expect("queues JSON")
}

fn queue<'a>(queues: &'a Value, name: &str) -> &'a Value {
    queues["queues"]
        .as_array()
        .and_then(|list| list.iter().find(|q| q["name"] == name))
        .unwrap_or_else(|| panic!("no queue {name} in {queues}"))
}

fn level_index(level: &str) -> f64 {
    match level {
        "normal" => 0.0,
        "soft" => 1.0,
        "hard" => 2.0,
        "reserve" => 3.0,
        other => panic!("unknown level {other}"),
    }
}

/// A scrape taken between two identical status documents, so that both describe the same
/// sample of the sampler (which runs on its own timer). Bounded retries.
fn scrape_with_status(http: SocketAddr) -> (Exposition, Value) {
    for _ in 0..50 {
        let before = status(http);
        let exposition = scrape(http);
        if status(http) == before {
            return (exposition, before);
        }
    }
    panic!("the status never held still across a scrape");
}

/// Every file system and the memory figures of `/metrics` are those of the status document.
fn assert_levels_match(exposition: &Exposition, status: &Value) {
    let filesystems = status["filesystems"].as_array().expect("filesystems");
    for fs in filesystems {
        let path = fs["path"].as_str().expect("path");
        let device = fs["device"].to_string();
        let labels = [("path", path), ("device", device.as_str())];
        for (metric, field) in [
            ("keratin_disk_free_bytes", "free_bytes"),
            ("keratin_disk_total_bytes", "total_bytes"),
            ("keratin_disk_spare_bytes", "spare_bytes"),
        ] {
            assert_eq!(
                exposition.one(metric, &labels),
                fs[field].as_u64().expect(field) as f64,
                "{metric} vs {field}: {status}"
            );
        }
        assert_eq!(
            exposition.one("keratin_disk_level", &labels),
            level_index(fs["level"].as_str().expect("level"))
        );
    }
    let memory = &status["memory"];
    assert_eq!(
        exposition.one("keratin_memory_limit_bytes", &[]),
        memory["limit_bytes"].as_u64().expect("limit") as f64
    );
    assert_eq!(
        exposition.one("keratin_memory_resident_bytes", &[]),
        memory["resident_bytes"].as_u64().expect("resident") as f64
    );
    assert_eq!(
        exposition.one("keratin_memory_level", &[]),
        level_index(memory["level"].as_str().expect("level"))
    );
    // The delivery budget is sized from the memory limit: an eighth, at most 64 MiB, at least
    // 8 MiB (server.delivery_bytes_max = 0).
    let limit = memory["limit_bytes"].as_u64().expect("limit");
    assert_eq!(
        exposition.one("keratin_delivery_budget_bytes", &[]),
        (limit / 8).clamp(8 << 20, 64 << 20) as f64
    );
    assert!(exposition.one("keratin_delivery_budget_used_bytes", &[]) >= 0.0);
}

/// The histogram is whole: cumulative buckets, `+Inf` equal to the count.
fn assert_fsync_histogram(exposition: &Exposition) -> f64 {
    assert_eq!(
        exposition
            .types
            .get("keratin_log_fsync_seconds")
            .map(String::as_str),
        Some("histogram")
    );
    let buckets: Vec<&Sample> = exposition
        .samples
        .iter()
        .filter(|s| s.name == "keratin_log_fsync_seconds_bucket")
        .collect();
    assert!(buckets.len() > 10, "{buckets:?}");
    let bounds: Vec<f64> = buckets
        .iter()
        .map(|s| parse_value(&s.labels["le"]).expect("le"))
        .collect();
    assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{bounds:?}");
    assert!(buckets.windows(2).all(|w| w[0].value <= w[1].value));
    let count = exposition.one("keratin_log_fsync_seconds_count", &[]);
    assert_eq!(bounds.last(), Some(&f64::INFINITY));
    assert_eq!(buckets.last().map(|s| s.value), Some(count));
    // A fresh node may not have synced yet: logs create their first segment at their first
    // append (issue 13).
    let sum = exposition.one("keratin_log_fsync_seconds_sum", &[]);
    assert!(
        if count > 0.0 { sum > 0.0 } else { sum == 0.0 },
        "{count} syncs took {sum} s"
    );
    count
}

async fn connect(addr: SocketAddr) -> Client {
    connect_with_timeout(addr, Duration::from_secs(10)).await
}

async fn connect_with_timeout(addr: SocketAddr, publish_timeout: Duration) -> Client {
    Client::connect(
        addr,
        ClientOptions {
            name: "observability-test".into(),
            publish_timeout,
            ..ClientOptions::default()
        },
    )
    .await
    .expect("connect")
}

fn serve_args<'a>(config_or_data: &'a [&'a str]) -> Vec<&'a str> {
    let mut args = vec!["serve"];
    args.extend_from_slice(config_or_data);
    args.extend_from_slice(&["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]);
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_match_status_queues_and_what_was_published() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let server = Server::start(&serve_args(&["--data-dir", data.to_str().expect("utf8")]));
    let client = connect(server.protocol).await;
    let before = scrape(server.http);
    let syncs_before = assert_fsync_histogram(&before);

    const COUNT: u64 = 40;
    const SIZE: usize = 1000;
    client
        .declare(
            "work",
            QueueSettings {
                partitions: 2,
                ..QueueSettings::default()
            },
        )
        .await
        .expect("declare");
    // One at a time: every confirm is its own sync.
    for seq in 0..COUNT {
        let message = OutgoingMessage::new(body(seq, SIZE)).with_routing_key(seq.to_string());
        client.publish("work", message).await.expect("publish");
    }
    client
        .declare(
            "capped",
            QueueSettings {
                max_messages: Some(2),
                overflow: Some(Overflow::Reject),
                ..QueueSettings::default()
            },
        )
        .await
        .expect("declare capped");
    // A short timeout: the refused publish is retried until then.
    let impatient = connect_with_timeout(server.protocol, Duration::from_secs(1)).await;
    let mut refused = 0;
    for seq in 0..3 {
        if impatient
            .publish("capped", OutgoingMessage::new(body(seq, SIZE)))
            .await
            .is_err()
        {
            refused += 1;
        }
    }
    assert_eq!(refused, 1, "the third publish exceeds max_messages 2");

    let (exposition, status) = scrape_with_status(server.http);
    assert_levels_match(&exposition, &status);
    let queues = queues(server.http);
    let work = queue(&queues, "work");
    let capped = queue(&queues, "capped");
    let labels = [("queue", "work")];
    assert_eq!(
        exposition.one("keratin_queue_ready_messages", &labels),
        COUNT as f64
    );
    assert_eq!(work["ready"], COUNT, "{work}");
    assert_eq!(
        exposition.one("keratin_queue_inflight_messages", &labels),
        0.0
    );
    // Live bytes are the stored messages: each body plus its routing key and a few bytes of
    // message framing.
    let bytes = exposition.one("keratin_queue_bytes", &labels);
    assert_eq!(
        bytes,
        work["bytes"].as_u64().expect("bytes") as f64,
        "{work}"
    );
    let bodies = (COUNT * SIZE as u64) as f64;
    assert!(
        bodies <= bytes && bytes <= bodies + (COUNT * 32) as f64,
        "{bytes} bytes for {COUNT} bodies of {SIZE}"
    );
    let disk = exposition.one("keratin_queue_disk_bytes", &labels);
    assert_eq!(
        disk,
        work["disk_bytes"].as_u64().expect("disk_bytes") as f64
    );
    assert!(
        disk >= (COUNT * SIZE as u64) as f64,
        "the logs hold every body"
    );
    // The client retries a queue_full refusal until its publish timeout: each try is counted.
    let rejected_full = capped["partitions"][0]["rejected_queue_full"]
        .as_u64()
        .expect("rejected_queue_full");
    assert!(rejected_full >= 1, "{capped}");
    assert_eq!(
        exposition.one(
            "keratin_queue_publishes_rejected_total",
            &[("queue", "capped"), ("reason", "queue_full")]
        ),
        rejected_full as f64
    );
    assert_eq!(
        exposition.one(
            "keratin_queue_publishes_rejected_total",
            &[("queue", "work"), ("reason", "queue_full")]
        ),
        0.0
    );
    assert_eq!(
        exposition.one(
            "keratin_publishes_rejected_total",
            &[("reason", "queue_full")]
        ),
        rejected_full as f64,
        "the node-wide figure sums the queues'"
    );
    for reason in ["disk", "memory"] {
        assert_eq!(
            exposition
                .values("keratin_publishes_rejected_total", &[("reason", reason)])
                .len(),
            1,
            "rejections by {reason} are exposed"
        );
        assert_eq!(
            exposition
                .values("keratin_publishes_delayed_total", &[("reason", reason)])
                .len(),
            1,
            "delays by {reason} are exposed"
        );
    }
    assert_eq!(exposition.one("keratin_log_stops_total", &[]), 0.0);
    assert_eq!(exposition.one("keratin_log_heals_total", &[]), 0.0);
    assert_eq!(exposition.one("keratin_partitions_stopped", &[]), 0.0);
    let syncs = assert_fsync_histogram(&exposition) - syncs_before;
    assert!(
        syncs >= (COUNT + 2) as f64,
        "each of {COUNT} + 2 confirmed publishes, sent one at a time, was synced: {syncs}"
    );
    client.close().await;
}

/// Publish 16 KiB bodies to `queue` until the file system of `status`'s first entry is at
/// `soft` with at least `margin_bytes` below the soft threshold (so that a restart finds it at
/// soft again, not at the edge), bounded by 90 s.
async fn fill_past_soft(client: &Client, http: SocketAddr, queue: &str, margin_bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut seq = 0;
    loop {
        let doc = status(http);
        let fs = &doc["filesystems"][0];
        let effective_free =
            fs["free_bytes"].as_u64().unwrap_or(0) + fs["spare_bytes"].as_u64().unwrap_or(0);
        let soft_bytes = fs["thresholds"]["soft_bytes"].as_u64().unwrap_or(0);
        if fs["level"] == "soft" && effective_free + margin_bytes <= soft_bytes {
            return;
        }
        assert_ne!(fs["level"], "hard", "overshot to hard: {doc}");
        assert!(Instant::now() < deadline, "never reached soft: {doc}");
        for _ in 0..16 {
            client
                .publish(queue, OutgoingMessage::new(body(seq, 16 * 1024)))
                .await
                .expect("publishes below hard are confirmed");
            seq += 1;
        }
    }
}

/// Poll `GET /api/v1/attention` until an item of `kind` about `subject` with `active` shows.
fn wait_item(http: SocketAddr, kind: &str, subject: &str, active: bool) -> Value {
    let deadline = Instant::now() + SAMPLE_WAIT;
    loop {
        let doc: Value =
            serde_json::from_str(&http_get(http, "/api/v1/attention")).expect("attention JSON");
        let found = doc["items"].as_array().and_then(|items| {
            items
                .iter()
                .rev()
                .find(|i| i["kind"] == kind && i["subject"] == subject && i["active"] == active)
                .cloned()
        });
        if let Some(item) = found {
            return item;
        }
        assert!(
            Instant::now() < deadline,
            "no {kind} item for {subject} with active={active} within {SAMPLE_WAIT:?}: {doc}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `keratin attention ARGS --json --http ADDR`, parsed.
fn cli_attention(http: SocketAddr, args: &[&str]) -> Value {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_keratin"))
        .arg("attention")
        .args(args)
        .args(["--json", "--http", &http.to_string()])
        .output()
        .expect("run keratin attention");
    assert!(output.status.success(), "{output:?}");
    serde_json::from_slice(&output.stdout).expect("one JSON document")
}

fn active_disk_items(http: SocketAddr) -> Vec<Value> {
    let doc: Value = serde_json::from_str(&http_get(http, "/api/v1/attention?active=true"))
        .expect("attention JSON");
    doc["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter(|i| i["kind"] == "disk_level")
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_past_soft_shows_in_metrics_and_attention_and_survives_restarts() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged("a_fill_past_soft_shows_in_metrics_and_attention_and_survives_restarts") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let fs = Tmpfs::mount(&data, 64);
    // Soft at 50% free, hard at 20%: 64 MiB leaves ~13 MiB between them.
    let config = small_fs_config(tmp.path(), &[&data], 0.50, 0.20, 0.05);
    let config = config.to_str().expect("utf8").to_string();
    let config_args = ["--config", config.as_str()];
    let args = serve_args(&config_args);
    let mut server = Server::start(&args);
    let client = connect(server.protocol).await;
    client
        .declare("fill", QueueSettings::default())
        .await
        .expect("declare");
    fill_past_soft(&client, server.http, "fill", 4 << 20).await;

    let (exposition, status_doc) = scrape_with_status(server.http);
    assert_levels_match(&exposition, &status_doc);
    let path = status_doc["filesystems"][0]["path"]
        .as_str()
        .expect("path")
        .to_string();
    assert_eq!(
        exposition.one("keratin_disk_level", &[("path", &path)]),
        1.0
    );
    let queues_doc = queues(server.http);
    assert_eq!(
        exposition.one("keratin_queue_disk_bytes", &[("queue", "fill")]),
        queue(&queues_doc, "fill")["disk_bytes"]
            .as_u64()
            .expect("disk") as f64
    );
    assert_fsync_histogram(&exposition);

    let raised = wait_item(server.http, "disk_level", &path, true);
    assert_eq!(raised["level"], "soft", "{raised}");
    assert_eq!(raised["severity"], "warning", "{raised}");
    let message = raised["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("fill") && message.contains("MiB free"),
        "the item names the free space and the largest queue: {message}"
    );
    let listed = cli_attention(server.http, &["--active"]);
    assert!(
        listed["items"]
            .as_array()
            .is_some_and(|items| items.contains(&raised)),
        "keratin attention shows the item: {listed}"
    );
    assert!(
        fs.path.join("attention.json").exists(),
        "the list is persisted"
    );

    // A restart while the cause holds keeps the same item active.
    client.close().await;
    assert!(server.terminate(Duration::from_secs(30)), "graceful stop");
    let mut server = Server::start(&args);
    let carried = wait_item(server.http, "disk_level", &path, true);
    assert_eq!(
        carried["id"], raised["id"],
        "carried over the restart: {carried}"
    );
    assert_eq!(active_disk_items(server.http).len(), 1);

    // Draining clears it; the cleared item stays in history.
    let client = connect(server.protocol).await;
    client.purge("fill").await.expect("purge");
    let cleared = wait_item(server.http, "disk_level", &path, false);
    assert_eq!(cleared["id"], raised["id"], "{cleared}");
    assert!(cleared["cleared_at_ms"].as_u64() >= raised["raised_at_ms"].as_u64());
    assert_eq!(active_disk_items(server.http), Vec::<Value>::new());
    let (exposition, status_doc) = scrape_with_status(server.http);
    assert_levels_match(&exposition, &status_doc);
    assert_eq!(
        exposition.one("keratin_disk_level", &[("path", &path)]),
        0.0
    );

    client.close().await;
    assert!(server.terminate(Duration::from_secs(30)), "graceful stop");
    let server = Server::start(&args);
    let history = cli_attention(server.http, &["--all"]);
    let kept = history["items"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["id"] == raised["id"]).cloned());
    assert_eq!(
        kept.as_ref(),
        Some(&cleared),
        "history survives a restart: {history}"
    );
    assert_eq!(active_disk_items(server.http), Vec::<Value>::new());
    drop(server);
    assert!(Path::new(&fs.path).exists());
}
