//! Per-queue limits through the real binary and the CLI: a `max_messages=1000` queue with
//! `reject` overflow accepts exactly 1,000 messages and rejects the rest with reason
//! `queue_full`; after 10 are consumed, exactly 10 more are accepted; `queue set` changes the
//! limit live and `queue info` shows it. A failure means the queue held more or fewer than its
//! limit, or the CLI miscounted the rejections.

mod support;

use std::process::Command;

use serde_json::Value;
use support::Server;

fn cli(server: &Server, args: &[&str]) -> (bool, Value) {
    let output = Command::new(env!("CARGO_BIN_EXE_keratin"))
        .args(args)
        .args(["--server", &server.protocol.to_string(), "--json"])
        .output()
        .expect("run the CLI");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    (output.status.success(), json)
}

#[test]
fn max_messages_reject_admits_exactly_the_limit() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let server = Server::start(&[
        "serve",
        "--data-dir",
        data.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);
    let (ok, _) = cli(
        &server,
        &[
            "queue",
            "declare",
            "capped",
            "--max-messages",
            "1000",
            "--overflow",
            "reject",
        ],
    );
    assert!(ok, "declare");
    let (ok, summary) = cli(
        &server,
        &[
            "publish",
            "capped",
            "--count",
            "1100",
            "--size",
            "100",
            "--keep-going",
            "--timeout-ms",
            "300",
        ],
    );
    assert!(!ok, "some publishes failed, so the verb exits non-zero");
    assert_eq!(summary["confirmed"], 1000, "{summary}");
    assert_eq!(summary["failed"], 100, "{summary}");
    assert_eq!(summary["errors"]["429:queue_full"], 100, "{summary}");
    let (ok, consumed) = cli(
        &server,
        &[
            "consume",
            "capped",
            "--count",
            "10",
            "--prefetch",
            "10",
            "--idle-exit-ms",
            "2000",
        ],
    );
    assert!(ok, "{consumed}");
    assert_eq!(consumed["acked"], 10, "{consumed}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (_, again) = cli(
        &server,
        &[
            "publish",
            "capped",
            "--count",
            "20",
            "--size",
            "100",
            "--keep-going",
            "--timeout-ms",
            "300",
            "--start-seq",
            "5000",
        ],
    );
    assert_eq!(again["confirmed"], 10, "{again}");
    assert_eq!(again["errors"]["429:queue_full"], 10, "{again}");
    // Raised live: room for more.
    let (ok, set) = cli(
        &server,
        &["queue", "set", "capped", "--max-messages", "1005"],
    );
    assert!(ok, "{set}");
    let (_, info) = cli(&server, &["queue", "info", "capped"]);
    assert_eq!(info["settings"]["max_messages"], 1005, "{info}");
    let (_, more) = cli(
        &server,
        &[
            "publish",
            "capped",
            "--count",
            "5",
            "--size",
            "100",
            "--timeout-ms",
            "300",
            "--start-seq",
            "6000",
        ],
    );
    assert_eq!(more["confirmed"], 5, "{more}");
}
