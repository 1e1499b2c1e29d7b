//! `keratin stream` against the real broker (issue 18): declare a stream of two partitions,
//! publish ten keyed messages with `keratin publish --routing-key`, read them back with
//! `keratin stream read --from first --count 10`, resume a named cursor after a committed
//! read, check `stream info --json` and `stream list --json`, delete the stream and see it
//! gone. It fails if a message is lost, duplicated or read out of order within its key, if a
//! key's messages land in two partitions, if a committed cursor does not resume after what it
//! read, or if a verb's JSON loses a documented field.
//!
//!
//! And what a terminal meets: bodies and keys with escape sequences are printed escaped
//! (`--raw` prints the bytes), and a read whose pipe closes early ends quietly.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;
use support::Server;

fn start(data: &std::path::Path) -> Server {
    Server::start(&[
        "serve",
        "--data-dir",
        data.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ])
}

/// Runs `keratin ARGS --server <protocol> --json`: success, and every stdout line as JSON.
fn cli(server: &Server, args: &[&str]) -> (bool, Vec<Value>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_keratin"))
        .args(args)
        .args(["--server", &server.protocol.to_string(), "--json"])
        .env_remove("KERATIN_SERVER")
        .output()
        .expect("run the CLI");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line:?}")))
        .collect();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.success(), lines, stderr)
}

/// A verb that must succeed; its last stdout line.
fn ok(server: &Server, args: &[&str]) -> Value {
    let (success, lines, stderr) = cli(server, args);
    assert!(success, "keratin {args:?} failed: {stderr}");
    lines.last().cloned().expect("a JSON line")
}

/// `stream read ... --json`: the messages, then the summary (the last line).
fn read(server: &Server, args: &[&str]) -> (Vec<Value>, Value) {
    let (success, mut lines, stderr) = cli(server, &[&["stream", "read"], args].concat());
    assert!(success, "keratin stream read {args:?} failed: {stderr}");
    let summary = lines.pop().expect("a summary line");
    (lines, summary)
}

#[test]
fn declare_publish_read_info_delete() {
    let tmp = tempfile::tempdir().expect("tmp");
    let server = start(&tmp.path().join("data"));

    let declared = ok(
        &server,
        &[
            "stream",
            "declare",
            "events",
            "--partitions",
            "2",
            "--max-age",
            "7d",
        ],
    );
    assert_eq!(declared["declared"], true);
    assert_eq!(declared["settings"]["partitions"], 2);
    assert_eq!(declared["settings"]["max_age_ms"], 7 * 86_400_000_u64);

    // Ten messages, sequence numbers 0 to 9: 0-4 with key a, 5-9 with key b.
    for (key, start_seq) in [("a", "0"), ("b", "5")] {
        let published = ok(
            &server,
            &[
                "publish",
                "events",
                "--count",
                "5",
                "--size",
                "32",
                "--routing-key",
                key,
                "--start-seq",
                start_seq,
            ],
        );
        assert_eq!(published["confirmed"], 5, "{published}");
        assert_eq!(published["key"], key);
    }

    let (messages, summary) = read(&server, &["events", "--from", "first", "--count", "10"]);
    assert_eq!(summary["read"], 10, "{summary}");
    assert_eq!(summary["ended"], "count reached");
    assert_eq!(messages.len(), 10);
    let mut seqs_by_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut partitions_by_key: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for message in &messages {
        let key = message["key"].as_str().expect("a key").to_owned();
        let seq = message["seq"].as_u64().expect("a keratin publish body");
        assert_eq!(message["size"], 32);
        assert!(message["timestamp_ms"].as_u64().expect("a time") > 0);
        assert!(message["timestamp"]
            .as_str()
            .expect("a time")
            .ends_with('Z'));
        seqs_by_key.entry(key.clone()).or_default().push(seq);
        partitions_by_key
            .entry(key)
            .or_default()
            .insert(message["partition"].as_u64().expect("a partition"));
    }
    assert_eq!(
        seqs_by_key["a"],
        vec![0, 1, 2, 3, 4],
        "key a in order, once each"
    );
    assert_eq!(
        seqs_by_key["b"],
        vec![5, 6, 7, 8, 9],
        "key b in order, once each"
    );
    for (key, partitions) in &partitions_by_key {
        assert_eq!(
            partitions.len(),
            1,
            "key {key} in one partition: {partitions:?}"
        );
    }

    // A named cursor: read 4 and commit, then the next read resumes after them.
    let (first, summary) = read(
        &server,
        &[
            "events", "--from", "first", "--count", "4", "--cursor", "audit", "--commit",
        ],
    );
    let mut expected: BTreeMap<u64, u64> = BTreeMap::new();
    for message in &first {
        let partition = message["partition"].as_u64().expect("a partition");
        let offset = message["offset"].as_u64().expect("an offset");
        expected.insert(partition, offset + 1);
    }
    let committed: BTreeMap<u64, u64> = summary["committed"]
        .as_array()
        .expect("committed positions")
        .iter()
        .map(|e| {
            (
                e["partition"].as_u64().unwrap_or(u64::MAX),
                e["offset"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        committed, expected,
        "the offset after the last message read, per partition"
    );
    let (rest, summary) = read(
        &server,
        &[
            "events",
            "--from",
            "first",
            "--cursor",
            "audit",
            "--idle-timeout",
            "2s",
        ],
    );
    assert_eq!(summary["ended"], "idle");
    let seqs = |messages: &[Value]| -> Vec<u64> {
        messages
            .iter()
            .map(|m| m["seq"].as_u64().expect("seq"))
            .collect()
    };
    let mut all: Vec<u64> = seqs(&first);
    all.extend(seqs(&rest));
    all.sort_unstable();
    assert_eq!(
        all,
        (0..10).collect::<Vec<u64>>(),
        "each message once over both reads"
    );

    // The same through a consumer group of one member (--group): it is given every
    // partition, and its commit lets the next member resume after what it read.
    let (grouped, _) = read(
        &server,
        &[
            "events", "--from", "first", "--count", "6", "--cursor", "team", "--group", "--commit",
        ],
    );
    let (rest, _) = read(
        &server,
        &[
            "events",
            "--from",
            "first",
            "--cursor",
            "team",
            "--group",
            "--idle-timeout",
            "2s",
        ],
    );
    let mut all: Vec<u64> = seqs(&grouped);
    all.extend(seqs(&rest));
    all.sort_unstable();
    assert_eq!(all, (0..10).collect::<Vec<u64>>(), "each once in the group");

    let info = ok(&server, &["stream", "info", "events"]);
    assert_eq!(info["stream"], "events");
    assert_eq!(info["messages"], 10, "{info}");
    assert_eq!(info["settings"]["max_age_ms"], 7 * 86_400_000_u64);
    let partitions = info["partitions"].as_array().expect("partitions");
    assert_eq!(partitions.len(), 2);
    let held: u64 = partitions
        .iter()
        .map(|p| p["messages"].as_u64().expect("messages"))
        .sum();
    assert_eq!(held, 10);
    for p in partitions {
        assert!(
            p["next_offset"].as_u64() >= p["start_offset"].as_u64(),
            "{p}"
        );
    }
    let list = ok(&server, &["stream", "list"]);
    let names: Vec<&str> = list["streams"]
        .as_array()
        .expect("streams")
        .iter()
        .filter_map(|s| s["stream"].as_str())
        .collect();
    assert_eq!(names, vec!["events"]);

    let set = ok(
        &server,
        &[
            "stream",
            "set",
            "events",
            "--max-age",
            "none",
            "--max-bytes",
            "1GiB",
        ],
    );
    assert_eq!(set["settings"]["max_age_ms"], Value::Null);
    assert_eq!(set["settings"]["max_bytes"], 1_u64 << 30);

    let deleted = ok(&server, &["stream", "delete", "events"]);
    assert_eq!(deleted["deleted"], true);
    let (success, lines, stderr) = cli(&server, &["stream", "info", "events"]);
    assert!(!success, "info of a deleted stream fails");
    assert_eq!(
        lines.last().map(|l| l["code"].clone()),
        Some(Value::from(404)),
        "{stderr}"
    );
}

/// What a terminal meets. A message whose body and key carry escape sequences (colour, a
/// bell, a newline) is printed with them escaped, one message to one line, and `--raw` prints
/// the body's bytes as they are and nothing else. A read piped into a reader that stops early
/// (`keratin stream read ... | head -3`) ends quietly with 141, as Unix tools do. Before: the
/// escape bytes reached the terminal, and the closed pipe ended the CLI with a panic and a
/// backtrace ("failed printing to stdout: Broken pipe").
#[test]
fn a_read_escapes_what_would_drive_a_terminal_and_ends_quietly_on_a_closed_pipe() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let tmp = tempfile::tempdir().expect("tmp");
    let server = start(&tmp.path().join("data"));
    ok(&server, &["stream", "declare", "term"]);
    let body = "\u{1b}[31mred\u{1b}[0m\nsecond\tline\u{7}";
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = keratin_client::Client::connect(
            server.protocol,
            keratin_client::ClientOptions::default(),
        )
        .await
        .expect("connect");
        client
            .publish(
                "term",
                keratin_client::OutgoingMessage::new(body.as_bytes().to_vec())
                    .with_routing_key("k\u{1b}]0;title\u{7}"),
            )
            .await
            .expect("publish");
        client.close().await;
    });

    let read = |extra: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_keratin"))
            .args(["stream", "read", "term", "--from", "first", "--count", "1"])
            .args(extra)
            .args(["--server", &server.protocol.to_string()])
            .env_remove("KERATIN_SERVER")
            .output()
            .expect("run the CLI");
        assert!(output.status.success(), "{output:?}");
        output.stdout
    };
    let text = String::from_utf8(read(&[])).expect("utf-8");
    assert!(
        !text.bytes().any(|b| b < 0x20 && b != b'\n') && text.lines().count() == 1,
        "control characters reached the terminal: {text:?}"
    );
    assert!(
        text.contains(r"key=k\x1b]0;title\x07")
            && text.contains(r"body=\x1b[31mred\x1b[0m\nsecond\tline\x07"),
        "the message, escaped: {text:?}"
    );
    assert_eq!(read(&["--raw"]), format!("{body}\n").into_bytes(), "--raw");

    // Far more output than a pipe holds (64 KiB): the CLI is still writing when the pipe closes.
    ok(
        &server,
        &["publish", "term", "--count", "2000", "--size", "512"],
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_keratin"))
        .args([
            "stream", "read", "term", "--from", "first", "--count", "2001", "--json",
        ])
        .args(["--server", &server.protocol.to_string()])
        .env_remove("KERATIN_SERVER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the CLI");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    for _ in 0..3 {
        lines.next().expect("a line").expect("read a line");
    }
    drop(lines);
    let output = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "the closed pipe: {stderr}"
    );
    assert_eq!(output.status.code(), Some(141), "{stderr}");
}
