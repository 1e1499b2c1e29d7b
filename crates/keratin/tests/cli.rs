//! The `keratin` CLI against a real broker: each test starts the real binary with
//! `keratin serve` on loopback (ports chosen by the kernel, learned from the first stdout line)
//! and runs CLI verbs as subprocesses, checking their `--json` summaries and exit codes.
//!
//! It fails if a verb's JSON loses a documented field, if a published message is not delivered
//! exactly as published (sequence numbers and CRC32C are checked by `consume --verify` and the
//! recorded sequence files), or if an error does not exit non-zero with the broker's message.
//! Every wait is bounded; the server is stopped by PID (SIGTERM, then SIGKILL) by a guard, so a
//! failing test never leaks it.
//!
//! The broker runs with logins (the default, `server.auth = users`), and the CLI gets no
//! `--user`: like an operator on the broker's machine, it logs in as `admin` with the password
//! the node wrote to its data directory (`KERATIN_DATA_DIR`). `keratin user` verbs and a user
//! held to its permissions are checked too.

mod support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_keratin");
/// Bound on the broker printing its listening line (recovery of an empty data dir is instant;
/// a loaded CI machine with a cold page cache still starts in well under this).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on one CLI run: the largest one here moves a few thousand small messages.
const CLI_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on a graceful stop after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A running `keratin serve`; dropping it stops the process by PID.
struct Server {
    child: Child,
    protocol: String,
    http: String,
    dir: tempfile::TempDir,
    /// The README's way: the node and the CLI run in `dir`, the node on its default data
    /// directory (`./keratin-data`), the CLI finding it there with no flag or variable.
    readme: bool,
}

impl Server {
    fn start() -> Server {
        Server::start_as(false)
    }

    /// Like the README's first command (`keratin serve` with no flags), but on ports the
    /// kernel chooses: the node runs in a new directory on `./keratin-data`.
    fn start_readme() -> Server {
        Server::start_as(true)
    }

    fn start_as(readme: bool) -> Server {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let data = dir.path().join("data");
        let log =
            std::fs::File::create(dir.path().join("server.log")).expect("the server log file");
        let mut command = Command::new(BIN);
        command.arg("serve").current_dir(dir.path());
        if !readme {
            command.arg("--data-dir").arg(&data);
        }
        let mut child = command
            .args(["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
            .env_remove("KERATIN_SERVER__AUTH")
            // Tiny disk thresholds: these tests must not depend on how full the host's disk is.
            .envs(support::HOST_DISK_LIMITS.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("keratin serve starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (lines, first_line) = mpsc::channel();
        // The thread reads stdout to its end, so the broker never writes into a closed pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = lines.send(line);
            }
        });
        // From here on the guard owns the child: a panic below still stops it.
        let mut server = Server {
            child,
            protocol: String::new(),
            http: String::new(),
            dir,
            readme,
        };
        let line = first_line
            .recv_timeout(START_TIMEOUT)
            .unwrap_or_else(|_| panic!("no listening line; log:\n{}", server.log()));
        let field = |name: &str| -> String {
            line.split_whitespace()
                .find_map(|word| word.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .to_owned()
        };
        assert!(line.starts_with("keratin listening "), "{line}");
        server.protocol = field("protocol=");
        server.http = field("http=");
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    /// Runs `keratin ARGS --server <protocol>` (and `KERATIN_HTTP` for `status`), bounded.
    fn run(&self, args: &[&str]) -> Output {
        self.run_with(args, Some(&self.http))
    }

    /// Runs `keratin ARGS --server <protocol>` with `KERATIN_HTTP` set to `http`, or unset.
    fn run_with(&self, args: &[&str], http: Option<&str>) -> Output {
        let mut command = Command::new(BIN);
        match http {
            Some(http) => command.env("KERATIN_HTTP", http),
            None => command.env_remove("KERATIN_HTTP"),
        };
        if self.readme {
            command
                .current_dir(self.dir.path())
                .env_remove("KERATIN_DATA_DIR");
        } else {
            command.env("KERATIN_DATA_DIR", self.dir.path().join("data"));
        }
        let child = command
            .args(args)
            .args(["--server", &self.protocol])
            .env_remove("KERATIN_SERVER")
            .env_remove("KERATIN_USER")
            .env_remove("KERATIN_PASSWORD")
            .env_remove("KERATIN_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the keratin CLI starts");
        let pid = child.id();
        let (done, output) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(child.wait_with_output());
        });
        match output.recv_timeout(CLI_TIMEOUT) {
            Ok(output) => output.expect("the CLI's output"),
            Err(_) => {
                kill(pid, libc::SIGKILL);
                panic!("keratin {args:?} did not finish within {CLI_TIMEOUT:?}");
            }
        }
    }

    /// Runs a verb that must succeed and returns its stdout parsed as one JSON object.
    fn json(&self, args: &[&str]) -> Value {
        let output = self.run(&[args, &["--json"]].concat());
        assert!(
            output.status.success(),
            "keratin {args:?}: {}",
            describe(&output)
        );
        parse(&output)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        kill(self.child.id(), libc::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn kill(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("a pid fits pid_t");
    // SAFETY: kill(2) on a process this test started; no memory is shared.
    unsafe {
        libc::kill(pid, signal);
    }
}

fn describe(output: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn parse(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "expected one JSON line: {}",
        describe(output)
    );
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {}", describe(output)))
}

fn read_seqs(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .expect("the recorded sequence numbers")
        .lines()
        .map(|line| line.parse().expect("one number per line"))
        .collect()
}

/// The README's commands on a fresh machine: `keratin serve` with no flags (ports aside) makes
/// its data directory and first admin, and the CLI run in the same directory with no flag
/// finds the password and works, over the protocol and the admin port.
#[test]
fn the_readme_commands_work_with_logins_and_no_setup() {
    let server = Server::start_readme();
    let password = server
        .dir
        .path()
        .join("keratin-data")
        .join("admin-password");
    assert!(
        password.exists(),
        "the first start wrote {}",
        password.display()
    );
    let declared = server.json(&["queue", "declare", "readme"]);
    assert_eq!(declared["queue"], "readme");
    let published = server.json(&["publish", "readme", "--count", "10", "--size", "64"]);
    assert_eq!(published["confirmed"], 10, "{published}");
    let consumed = server.json(&["consume", "readme", "--count", "10"]);
    assert_eq!(consumed["received"], 10, "{consumed}");
    let me = server.json(&["user", "whoami"]);
    assert_eq!(me, serde_json::json!({ "user": "admin", "admin": true }));
    let status = server.run(&["status"]);
    assert!(status.status.success(), "{}", describe(&status));
    // Without the file (another directory), the broker says what is missing.
    let elsewhere = tempfile::tempdir().expect("tmp");
    let output = Command::new(BIN)
        .args(["queue", "list", "--server", &server.protocol])
        .current_dir(elsewhere.path())
        .env_remove("KERATIN_DATA_DIR")
        .env_remove("KERATIN_USER")
        .env_remove("KERATIN_PASSWORD")
        .env_remove("KERATIN_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("the CLI runs");
    assert!(!output.status.success(), "{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("401") && stderr.contains("--user"),
        "{}",
        describe(&output)
    );
}

/// `keratin user` verbs: add, grant, passwd, tokens, delete; a user held to its permissions
/// by every verb it runs (`--user`/`--password`, `--token`).
#[test]
fn user_verbs_and_a_user_held_to_its_permissions() {
    let server = Server::start();
    let listed = server.json(&["user", "list"]);
    assert_eq!(listed["users"][0]["name"], "admin", "{listed}");
    server.json(&["queue", "declare", "orders.eu"]);
    server.json(&["queue", "declare", "billing"]);
    let added = server.json(&["user", "add", "app", "--new-password", "app-password-1"]);
    assert_eq!(added["name"], "app", "{added}");
    let granted = server.json(&["user", "grant", "app", "orders.*", "publish,consume"]);
    assert_eq!(granted["grants"][0]["pattern"], "orders.*", "{granted}");
    let as_app = ["--user", "app", "--password", "app-password-1"];

    let allowed = server.json(
        &[
            &["publish", "orders.eu", "--count", "3", "--size", "64"],
            &as_app[..],
        ]
        .concat(),
    );
    assert_eq!(allowed["confirmed"], 3, "{allowed}");
    let refused = server.run(
        &[
            &["publish", "billing", "--count", "1", "--size", "64"],
            &as_app[..],
        ]
        .concat(),
    );
    assert!(!refused.status.success(), "{}", describe(&refused));
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(
        text.contains("403") || text.contains("may not publish"),
        "{}",
        describe(&refused)
    );
    for verb in [
        &["queue", "delete", "billing"][..],
        &["queue", "purge", "orders.eu"],
        &["user", "list"],
        &["settings", "set", "limits.sample_interval_ms=500"],
    ] {
        let output = server.run(&[verb, &as_app[..]].concat());
        assert!(
            !output.status.success(),
            "{verb:?} as app: {}",
            describe(&output)
        );
    }
    let seen = server.json(&[&["queue", "list"], &as_app[..]].concat());
    let names: Vec<&str> = seen["queues"]
        .as_array()
        .expect("queues")
        .iter()
        .filter_map(|q| q["queue"].as_str().or(q["name"].as_str()))
        .collect();
    assert_eq!(names, ["orders.eu"], "{seen}");

    // A new password, generated and printed once.
    let changed = server.json(&["user", "passwd", "app"]);
    let new_password = changed["password"]
        .as_str()
        .expect("a generated password")
        .to_string();
    let old = server.run(&[&["queue", "list"], &as_app[..]].concat());
    assert!(
        !old.status.success(),
        "the old password: {}",
        describe(&old)
    );
    let fresh = server.json(&[
        "queue",
        "list",
        "--user",
        "app",
        "--password",
        &new_password,
    ]);
    assert!(fresh["queues"].is_array(), "{fresh}");

    // A token for app logs in on both ports, until deleted.
    let token = server.json(&["user", "token", "add", "app", "ci"]);
    let token = token["token"].as_str().expect("the token").to_string();
    let me = server.json(&["user", "whoami", "--token", &token]);
    assert_eq!(me["user"], "app", "{me}");
    let listed = server.json(&["queue", "list", "--token", &token]);
    assert!(listed["queues"].is_array(), "{listed}");
    server.json(&["user", "token", "delete", "app", "ci"]);
    let gone = server.run(&["user", "whoami", "--token", &token]);
    assert!(!gone.status.success(), "{}", describe(&gone));

    server.json(&["user", "delete", "app"]);
    let deleted = server.run(&[
        "queue",
        "list",
        "--user",
        "app",
        "--password",
        &new_password,
    ]);
    assert!(!deleted.status.success(), "{}", describe(&deleted));
    let last_admin = server.run(&["user", "delete", "admin"]);
    assert!(!last_admin.status.success(), "{}", describe(&last_admin));
    assert!(
        String::from_utf8_lossy(&last_admin.stderr).contains("no admin"),
        "{}",
        describe(&last_admin)
    );
}

#[test]
fn queue_verbs_publish_and_consume_round_trip() {
    let server = Server::start();
    let declared = server.json(&["queue", "declare", "orders", "--partitions", "2"]);
    assert_eq!(declared["queue"], "orders");
    assert_eq!(declared["settings"]["partitions"], 2);

    let listed = server.run(&["queue", "list"]);
    assert!(listed.status.success(), "{}", describe(&listed));
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(text.contains("QUEUE") && text.contains("orders"), "{text}");

    let confirmed_file = server.path("confirmed.txt");
    let published = server.json(&[
        "publish",
        "orders",
        "--count",
        "2000",
        "--size",
        "100",
        "--in-flight",
        "64",
        "--record-seqs",
        confirmed_file.to_str().unwrap(),
    ]);
    for field in [
        "sent",
        "confirmed",
        "first_seq",
        "rate_per_s",
        "confirmed_seqs",
    ] {
        assert!(published.get(field).is_some(), "no {field}: {published}");
    }
    assert_eq!(published["sent"], 2000);
    assert_eq!(published["confirmed"], 2000);
    assert_eq!(published["failed"], 0);
    assert_eq!(published["errors"], serde_json::json!({}));
    assert_eq!(published["last_seq"], 1999);
    assert!(published["elapsed_ms"].is_u64());
    assert_eq!(read_seqs(&confirmed_file), (0..2000).collect::<Vec<_>>());

    let buffered = server.json(&[
        "publish",
        "orders",
        "--count",
        "500",
        "--size",
        "64",
        "--buffered",
        "--start-seq",
        "2000",
    ]);
    assert_eq!(buffered["mode"], "buffered");
    assert_eq!(buffered["sent"], 500);
    assert_eq!(buffered["failed"], 0);
    assert!(buffered.get("confirmed_seqs").is_none(), "{buffered}");

    let info = server.json(&["queue", "info", "orders"]);
    assert_eq!(info["ready"], 2500);
    assert_eq!(info["partitions"].as_array().unwrap().len(), 2);

    let received_file = server.path("received.txt");
    let consumed = server.json(&[
        "consume",
        "orders",
        "--count",
        "2500",
        "--verify",
        "--idle-exit-ms",
        "10000",
        "--record-seqs",
        received_file.to_str().unwrap(),
    ]);
    assert_eq!(consumed["received"], 2500);
    assert_eq!(consumed["acked"], 2500);
    assert_eq!(consumed["rejected"], 0);
    assert_eq!(consumed["corrupt"], 0);
    assert_eq!(consumed["redelivered"], 0);
    assert!(consumed["elapsed_ms"].is_u64());
    let received: BTreeSet<u64> = read_seqs(&received_file).into_iter().collect();
    assert_eq!(received, (0..2500).collect::<BTreeSet<_>>());

    // Idle exit: nothing left, so it stops after the idle time and still succeeds.
    let drained = server.json(&["consume", "orders", "--idle-exit-ms", "300"]);
    assert_eq!(drained["received"], 0);

    server.json(&["publish", "orders", "--count", "50", "--size", "16"]);
    let purged = server.json(&["queue", "purge", "orders"]);
    assert_eq!(purged["purged"], true);
    assert_eq!(server.json(&["queue", "info", "orders"])["ready"], 0);

    assert_eq!(server.json(&["queue", "delete", "orders"])["deleted"], true);
    let listed = server.json(&["queue", "list"]);
    assert_eq!(listed["queues"], serde_json::json!([]));
}

#[test]
fn reject_dead_letters_and_requeue_redelivers() {
    let server = Server::start();
    server.json(&["queue", "declare", "dead"]);
    server.json(&["queue", "declare", "work", "--dead-letter", "dead"]);
    server.json(&["queue", "declare", "capped", "--max-deliveries", "5"]);
    assert_eq!(
        server.json(&["queue", "info", "work"])["settings"]["dead_letter"],
        "dead"
    );
    assert_eq!(
        server.json(&["queue", "info", "capped"])["settings"]["max_deliveries"],
        5
    );

    server.json(&["publish", "work", "--count", "10", "--size", "32"]);
    // With prefetch 1 a requeued message comes straight back: four rejects of the head.
    let requeued = server.json(&[
        "consume",
        "work",
        "--count",
        "4",
        "--prefetch",
        "1",
        "--requeue",
        "--idle-exit-ms",
        "10000",
    ]);
    assert_eq!(requeued["rejected"], 4);
    assert_eq!(requeued["requeued"], 4);
    assert_eq!(requeued["acked"], 0);
    let again_file = server.path("again.txt");
    let again = server.json(&[
        "consume",
        "work",
        "--count",
        "10",
        "--verify",
        "--idle-exit-ms",
        "10000",
        "--record-seqs",
        again_file.to_str().unwrap(),
    ]);
    assert_eq!(again["received"], 10);
    assert!(again["redelivered"].as_u64().unwrap() >= 1, "{again}");
    assert_eq!(again["corrupt"], 0);
    assert_eq!(again["duplicates"], 0);
    let seqs: BTreeSet<u64> = read_seqs(&again_file).into_iter().collect();
    assert_eq!(seqs, (0..10).collect::<BTreeSet<_>>());

    server.json(&[
        "publish",
        "work",
        "--count",
        "3",
        "--size",
        "32",
        "--start-seq",
        "100",
    ]);
    let rejected = server.json(&[
        "consume",
        "work",
        "--count",
        "3",
        "--reject",
        "--idle-exit-ms",
        "10000",
    ]);
    assert_eq!(rejected["rejected"], 3);
    assert_eq!(rejected["requeued"], 0);
    let dead_file = server.path("dead.txt");
    let dead = server.json(&[
        "consume",
        "dead",
        "--count",
        "3",
        "--verify",
        "--idle-exit-ms",
        "10000",
        "--record-seqs",
        dead_file.to_str().unwrap(),
    ]);
    assert_eq!(dead["received"], 3);
    assert_eq!(dead["corrupt"], 0);
    let mut seqs = read_seqs(&dead_file);
    seqs.sort_unstable();
    assert_eq!(seqs, vec![100, 101, 102]);
    assert_eq!(server.json(&["queue", "info", "work"])["ready"], 0);
}

#[test]
fn status_shows_filesystems_and_memory() {
    let server = Server::start();
    let status = server.json(&["status"]);
    assert!(status["node"].is_string(), "{status}");
    let level = status["filesystems"][0]["level"].as_str().unwrap();
    assert!(
        ["normal", "soft", "hard", "reserve"].contains(&level),
        "{status}"
    );
    for field in ["path", "device", "total_bytes", "free_bytes", "spare_bytes"] {
        assert!(
            status["filesystems"][0].get(field).is_some(),
            "no {field}: {status}"
        );
    }
    assert!(status["memory"]["limit_source"].is_string(), "{status}");
    assert!(status["memory"]["resident_bytes"].is_u64(), "{status}");

    let human = server.run(&["status"]);
    assert!(human.status.success(), "{}", describe(&human));
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(text.contains("LEVEL") && text.contains("memory"), "{text}");
}

/// Bound on waiting for the sampler (1 s interval by default) to raise or clear an item.
const ATTENTION_TIMEOUT: Duration = Duration::from_secs(20);

/// Polls `keratin attention ARGS --json` until `wanted` holds for the queue_full item of
/// `queue`, bounded by [`ATTENTION_TIMEOUT`]; returns that item.
fn wait_queue_full_item(server: &Server, args: &[&str], queue: &str, active: bool) -> Value {
    let deadline = Instant::now() + ATTENTION_TIMEOUT;
    loop {
        let document = server.json(&[&["attention"], args].concat());
        let found = document["items"].as_array().and_then(|items| {
            items
                .iter()
                .find(|i| {
                    i["kind"] == "queue_full" && i["subject"] == queue && i["active"] == active
                })
                .cloned()
        });
        if let Some(item) = found {
            return item;
        }
        assert!(
            Instant::now() < deadline,
            "no queue_full item for {queue} with active={active} within {ATTENTION_TIMEOUT:?}: \
             {document}\nlog:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn attention_shows_a_full_queue_and_keeps_it_in_history_once_cleared() {
    let server = Server::start();
    // The machine's own disk may be past soft (a disk_level item): look at queue items only.
    let queue_items = |args: &[&str]| -> Vec<Value> {
        let document = server.json(&[&["attention"], args].concat());
        document["items"]
            .as_array()
            .unwrap_or_else(|| panic!("no items list: {document}"))
            .iter()
            .filter(|i| i["kind"] == "queue_full")
            .cloned()
            .collect()
    };
    assert_eq!(queue_items(&["--all"]), Vec::<Value>::new());
    server.json(&[
        "queue",
        "declare",
        "capped",
        "--max-messages",
        "3",
        "--overflow",
        "reject",
    ]);
    // One more than the queue holds: the last one is refused and the queue is full.
    let published = server.run(&[
        "publish",
        "capped",
        "--count",
        "4",
        "--size",
        "16",
        "--keep-going",
        "--timeout-ms",
        "300",
        "--json",
    ]);
    assert_eq!(
        parse(&published)["confirmed"],
        3,
        "{}",
        describe(&published)
    );
    let item = wait_queue_full_item(&server, &["--active"], "capped", true);
    assert_eq!(item["severity"], "warning", "{item}");
    assert!(item["cleared_at_ms"].is_null(), "{item}");
    assert!(item["id"].as_u64().is_some_and(|id| id >= 1), "{item}");
    assert!(
        item["raised_at_ms"].as_u64().is_some_and(|at| at > 0),
        "{item}"
    );
    let message = item["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("capped") && message.contains("max_messages"),
        "the message says what to do: {message}"
    );
    let human = server.run(&["attention"]);
    assert!(human.status.success(), "{}", describe(&human));
    let text = String::from_utf8_lossy(&human.stdout);
    let row = text.lines().find(|l| l.contains("queue_full"));
    assert!(
        row.is_some_and(|l| l.contains("active") && l.contains("capped")),
        "{text}"
    );

    server.json(&["queue", "purge", "capped"]);
    let cleared = wait_queue_full_item(&server, &[], "capped", false);
    assert_eq!(
        cleared["id"], item["id"],
        "the same item, cleared: {cleared}"
    );
    assert!(
        cleared["cleared_at_ms"].as_u64() >= item["raised_at_ms"].as_u64(),
        "{cleared}"
    );
    assert_eq!(queue_items(&["--active"]), Vec::<Value>::new());
    assert_eq!(queue_items(&["--all"]), vec![cleared]);
    let human = server.run(&["attention"]);
    let text = String::from_utf8_lossy(&human.stdout);
    let row = text.lines().find(|l| l.contains("queue_full"));
    assert!(row.is_some_and(|l| l.contains("cleared")), "{text}");
    let conflicting = server.run(&["attention", "--all", "--active"]);
    assert!(!conflicting.status.success(), "{}", describe(&conflicting));
}

#[test]
fn failures_exit_non_zero_with_the_brokers_message() {
    let server = Server::start();
    let missing = server.run(&["queue", "info", "missing"]);
    assert!(!missing.status.success(), "{}", describe(&missing));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("404") && stderr.contains("missing"),
        "{stderr}"
    );

    let missing = server.run(&["queue", "info", "missing", "--json"]);
    assert!(!missing.status.success());
    assert_eq!(parse(&missing)["code"], 404);

    let published = server.run(&[
        "publish", "missing", "--count", "5", "--size", "16", "--json",
    ]);
    assert!(!published.status.success(), "{}", describe(&published));
    let summary = parse(&published);
    assert_eq!(summary["confirmed"], 0);
    assert!(summary["failed"].as_u64().unwrap() >= 1, "{summary}");
    assert_eq!(summary["errors"]["404"], summary["failed"], "{summary}");

    let buffered = server.run(&[
        "publish",
        "missing",
        "--count",
        "5",
        "--size",
        "16",
        "--buffered",
        "--keep-going",
        "--json",
    ]);
    assert!(!buffered.status.success(), "{}", describe(&buffered));
    assert_eq!(parse(&buffered)["errors"]["404"], 5);

    let too_small = server.run(&["publish", "missing", "--count", "1", "--size", "4"]);
    assert!(!too_small.status.success());

    // A queue declared again with other settings is a conflict.
    server.json(&["queue", "declare", "q"]);
    let conflict = server.run(&["queue", "declare", "q", "--partitions", "3"]);
    assert!(!conflict.status.success(), "{}", describe(&conflict));
    assert!(
        String::from_utf8_lossy(&conflict.stderr).contains("409"),
        "{}",
        describe(&conflict)
    );

    // Nobody listens on the HTTP port once it is closed; a bad --http fails cleanly.
    let status = server.run(&["status", "--http", "127.0.0.1:1"]);
    assert!(!status.status.success(), "{}", describe(&status));
}

/// Issue 14: one address of a node is enough for every verb. `status`, `settings` and
/// `attention` read the HTTP admin port, whose address the node names in its handshake; before
/// protocol version 3 they needed `--http` and, without it, went to the default admin address.
#[test]
fn every_verb_works_given_only_the_protocol_address() {
    let server = Server::start();
    let run = |args: &[&str]| {
        let output = server.run_with(&[args, &["--json"]].concat(), None);
        assert!(
            output.status.success(),
            "keratin {args:?} with --server only: {}",
            describe(&output)
        );
        parse(&output)
    };
    let status = run(&["status"]);
    assert!(status["filesystems"].is_array(), "{status}");
    let settings = run(&["settings", "get", "limits.disk.soft_fraction"]);
    assert!(
        settings.to_string().contains("limits.disk.soft_fraction"),
        "{settings}"
    );
    run(&["settings", "set", "limits.sample_interval_ms=750"]);
    let changed = run(&["settings", "get", "limits.sample_interval_ms"]);
    assert!(changed.to_string().contains("750"), "{changed}");
    let attention = run(&["attention"]);
    assert!(attention["items"].is_array(), "{attention}");
    run(&["queue", "declare", "one-address"]);
    run(&["queue", "info", "one-address"]);

    // --http still wins over what the node says: a wrong one fails, naming it.
    let wrong = server.run_with(&["status", "--http", "127.0.0.1:1"], None);
    assert!(!wrong.status.success(), "{}", describe(&wrong));
    assert!(
        String::from_utf8_lossy(&wrong.stderr).contains("127.0.0.1:1"),
        "{}",
        describe(&wrong)
    );
}

/// A `--server` where no node listens, without `--http`: a clear failure that says how to name
/// the admin port, not a guess at another address.
#[test]
fn status_without_a_reachable_node_says_to_pass_http() {
    let output = Command::new(BIN)
        .args(["status", "--server", "127.0.0.1:1"])
        .env_remove("KERATIN_HTTP")
        .env_remove("KERATIN_SERVER")
        .stdin(Stdio::null())
        .output()
        .expect("the keratin CLI runs");
    assert!(!output.status.success(), "{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("127.0.0.1:1") && stderr.contains("--http"),
        "{}",
        describe(&output)
    );
}

/// `keratin serve` off loopback without `--insecure` refuses to start (before binding
/// anything), naming the key, the address and the flag; with `--insecure` the same
/// configuration is accepted (`--print-config`, so the test binds nothing off loopback).
#[test]
fn serve_off_loopback_needs_insecure() {
    let data = tempfile::tempdir().expect("tempdir");
    let data_dir = data.path().to_str().expect("utf8");
    let serve = |extra: &[&str]| {
        Command::new(BIN)
            .args(["serve", "--data-dir", data_dir, "--listen", "0.0.0.0:5680"])
            .args(extra)
            .env_remove("KERATIN_SERVER__INSECURE")
            .stdin(Stdio::null())
            .output()
            .expect("the keratin binary runs")
    };
    let refused = serve(&[]);
    assert!(!refused.status.success(), "{}", describe(&refused));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    for part in ["server.listen", "0.0.0.0:5680", "--insecure", "with TLS"] {
        assert!(
            stderr.contains(part),
            "{part:?} missing: {}",
            describe(&refused)
        );
    }
    let accepted = serve(&["--insecure", "--print-config"]);
    assert!(accepted.status.success(), "{}", describe(&accepted));
    let stdout = String::from_utf8_lossy(&accepted.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("insecure = true") && l.ends_with("# flag --insecure")),
        "{stdout}"
    );
}

/// `consume --count N` on a queue holding fewer: without an idle timeout it says, after a few
/// seconds without a message, what it waits for and how to stop; with `--idle-timeout` it
/// stops after that quiet spell, exits 1 (fewer than asked) and says it ended idle. Before, it
/// waited without a word, and the idle exit was spelt only in milliseconds (`--idle-exit-ms`),
/// unlike `stream read --idle-timeout 2s`.
#[test]
fn consume_short_of_its_count_says_what_it_waits_for_and_stops_when_idle() {
    let server = Server::start();
    server.json(&["queue", "declare", "few"]);
    let published = server.json(&["publish", "few", "--count", "2"]);
    assert_eq!(published["confirmed"], 2);

    let started = Instant::now();
    let output = server.run(&[
        "consume",
        "few",
        "--count",
        "5",
        "--idle-timeout",
        "1s",
        "--json",
    ]);
    let took = started.elapsed();
    assert!(
        !output.status.success(),
        "2 of 5 is no success: {}",
        describe(&output)
    );
    let summary = parse(&output);
    assert_eq!(summary["received"], 2, "{summary}");
    assert_eq!(summary["ended"], "idle", "{summary}");
    assert!(
        took < Duration::from_secs(5),
        "an idle timeout of 1 s took {took:?}"
    );

    let mut child = Command::new(BIN)
        .args([
            "consume",
            "few",
            "--count",
            "5",
            "--server",
            &server.protocol,
        ])
        .env("KERATIN_DATA_DIR", server.dir.path().join("data"))
        .env_remove("KERATIN_SERVER")
        .env_remove("KERATIN_USER")
        .env_remove("KERATIN_PASSWORD")
        .env_remove("KERATIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the keratin CLI starts");
    let stderr = child.stderr.take().expect("stderr");
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = Vec::new();
    let hint = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains("waiting for messages") => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    kill(child.id(), libc::SIGKILL);
    let _ = child.wait();
    let hint = hint.unwrap_or_else(|| panic!("no word while waiting; stderr: {seen:?}"));
    assert!(
        hint.contains("few") && hint.contains("0 received of 5") && hint.contains("--idle-timeout"),
        "{hint}"
    );
}
