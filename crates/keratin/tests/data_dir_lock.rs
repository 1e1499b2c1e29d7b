//! One node per data directory, with the real binary: a second `keratin serve` on a directory a
//! running node holds (the same `--data-dir` with other ports; one shared directory among
//! several; a cluster node's start on it) exits at once with status 1, naming the directory and
//! the pid of the node that holds it, and has changed nothing there: the first node still
//! serves every message. After `kill -9` of the holder its lock file stays behind, naming a
//! dead pid, and the next start succeeds on it (the kernel released the `flock`).
//!
//! Fails without the lock: the second `keratin serve` starts (prints its listening line and
//! keeps running) on the directory the first node writes.
//!
//! No root needed. Bounded: each start and each CLI run has a deadline; processes are killed
//! by PID.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::Server;

const BIN: &str = env!("CARGO_BIN_EXE_keratin");

/// Bound on a refused start: it refuses before opening anything, in milliseconds.
const REFUSAL_WITHIN: Duration = Duration::from_secs(10);

/// `keratin serve ARGS` that must refuse to start: its stderr, once it exited non-zero within
/// [`REFUSAL_WITHIN`]. A start that runs instead is killed and fails the test.
fn refused_start(args: &[&str]) -> String {
    let mut child = Command::new(BIN)
        .arg("serve")
        .args(args)
        .env("KERATIN_SERVER__AUTH", "none")
        .envs(support::HOST_DISK_LIMITS.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keratin serve");
    let deadline = Instant::now() + REFUSAL_WITHIN;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let output = child.wait_with_output().expect("output");
            let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            assert_eq!(
                status.code(),
                Some(1),
                "the refused start exits 1: {stderr}{stdout}"
            );
            assert!(
                !stdout.contains("keratin listening"),
                "it never served: {stdout}"
            );
            return stderr;
        }
        if Instant::now() >= deadline {
            let pid = child.id();
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "a second `keratin serve {}` (pid {pid}) ran on a data directory a running node \
                 holds, for {REFUSAL_WITHIN:?} without exiting; its output: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every path under `dir` (relative), to see that a refused start created nothing.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let mut paths = BTreeSet::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path.clone());
            }
            paths.insert(path.strip_prefix(dir).expect("under dir").to_path_buf());
        }
    }
    paths
}

/// `keratin ARGS --server SERVER --json`, which must succeed: its JSON summary.
fn cli(server: &Server, args: &[&str]) -> serde_json::Value {
    let output = Command::new(BIN)
        .args(args)
        .args(["--server", &server.protocol.to_string(), "--json"])
        .output()
        .expect("run keratin");
    assert!(
        output.status.success(),
        "keratin {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON summary")
}

#[test]
fn a_second_node_on_a_held_data_directory_refuses_to_start_and_a_dead_holder_does_not_block() {
    let root = tempfile::tempdir().expect("tmp");
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    let (a_text, b_text) = (a.display().to_string(), b.display().to_string());
    let local = ["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"];
    let first_args = [
        &["--data-dir", &a_text, "--data-dir", &b_text][..],
        &local[..],
    ]
    .concat();
    let mut first = Server::start(&[&["serve"][..], &first_args].concat());
    let declared = cli(&first, &["queue", "declare", "kept", "--partitions", "2"]);
    assert_eq!(declared["queue"], "kept", "{declared}");
    let published = cli(
        &first,
        &["publish", "kept", "--count", "200", "--size", "64"],
    );
    assert_eq!(published["confirmed"], 200, "{published}");
    let before = (tree(&a), tree(&b));
    let holder = format!("pid {}", first.pid);

    // The same directories, other ports.
    let stderr = refused_start(&first_args);
    assert!(stderr.contains(&a_text), "names the directory: {stderr}");
    assert!(stderr.contains(&holder), "names the holder's pid: {stderr}");
    // Only the second directory shared: refused on it, naming it (not the free one).
    let c_text = root.path().join("c").display().to_string();
    let stderr = refused_start(
        &[
            &["--data-dir", &c_text, "--data-dir", &b_text][..],
            &local[..],
        ]
        .concat(),
    );
    assert!(
        stderr.contains(&b_text),
        "names the shared directory: {stderr}"
    );
    assert!(stderr.contains(&holder), "{stderr}");
    // A cluster node's start (it would open cluster-meta/ there) is refused the same way.
    let peer = format!("1={}", support::cluster::free_addr());
    let stderr = refused_start(
        &[
            &["--data-dir", &a_text, "--node-id", "1", "--peer", &peer][..],
            &local[..],
        ]
        .concat(),
    );
    assert!(
        stderr.contains(&a_text) && stderr.contains(&holder),
        "{stderr}"
    );
    assert_eq!(
        (tree(&a), tree(&b)),
        before,
        "the refused starts changed nothing"
    );
    let consumed = cli(&first, &["consume", "kept", "--count", "100"]);
    assert_eq!(
        consumed["received"], 100,
        "the first node serves on: {consumed}"
    );

    // kill -9: the lock file stays, naming the dead pid; the next start takes it.
    let dead = first.pid;
    first.kill9();
    let lock = a.join("keratin.lock");
    assert_eq!(
        std::fs::read_to_string(&lock).expect("lock file").trim(),
        dead.to_string()
    );
    let second = Server::start(&[&["serve"][..], &first_args].concat());
    assert_eq!(
        std::fs::read_to_string(&lock).expect("lock file").trim(),
        second.pid.to_string(),
        "the new holder wrote its pid"
    );
    let consumed = cli(&second, &["consume", "kept", "--count", "100"]);
    assert_eq!(consumed["received"], 100, "{consumed}");
}
