//! Helpers for tests that run the real `keratin` binary: starting and killing it by PID,
//! size-limited tmpfs mounts, the root-only skip rule, free space, the status document, bodies
//! that carry a sequence number and a checksum.

#![allow(dead_code)]

pub mod cluster;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// True if this process runs as root (its real user id is 0).
pub fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("0")
}

/// True if privileged tests may run. Without root they skip loudly, unless
/// `KERATIN_REQUIRE_PRIVILEGED_TESTS=1`, where skipping is a failure.
pub fn privileged(test: &str) -> bool {
    if is_root() {
        return true;
    }
    if std::env::var("KERATIN_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{test} needs root (mount, cgroups, iptables) and KERATIN_REQUIRE_PRIVILEGED_TESTS=1 forbids skipping");
    }
    eprintln!(
        "!!! SKIPPING {test}: it needs root (tmpfs mounts, cgroups, iptables); run as root to include it"
    );
    false
}

/// Disk thresholds for a server on the host's disk (no `--config`): tiny fractions and floors,
/// so that a test of something else does not slow down or fail because the machine's disk
/// happens to be 90% full (the defaults put soft at 10% free). Tests of the limits themselves
/// use a tmpfs or a budget and a config file, where these do not apply.
pub const HOST_DISK_LIMITS: &[(&str, &str)] = &[
    ("KERATIN_LIMITS__DISK__SOFT_FRACTION", "0.002"),
    ("KERATIN_LIMITS__DISK__HARD_FRACTION", "0.001"),
    ("KERATIN_LIMITS__DISK__RESERVE_FRACTION", "0.0005"),
    ("KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES", "268435456"),
    ("KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES", "134217728"),
    ("KERATIN_LIMITS__DISK__RESERVE_FLOOR_BYTES", "67108864"),
];

/// The servers' log filter: `KERATIN_TEST_NODE_LOG` when set (to chase a failure, for example
/// `info,openraft=debug`), otherwise info with openraft's errors only.
pub fn node_log_filter() -> String {
    std::env::var("KERATIN_TEST_NODE_LOG").unwrap_or_else(|_| "info,openraft=error".to_owned())
}

/// A running `keratin serve`, killed by PID when dropped.
pub struct Server {
    pub child: Option<Child>,
    pub protocol: SocketAddr,
    pub http: SocketAddr,
    pub pid: u32,
    /// Forwards the node's stderr to the test's and keeps the first line of each panic it
    /// printed: a panic on one of the node's threads (a debug assertion in a partition owner)
    /// does not end the node, and the test would pass over it. Dropping the server fails the
    /// test when there was one.
    /// (Unwind safe: only `Drop` touches it.)
    stderr: Option<std::panic::AssertUnwindSafe<std::thread::JoinHandle<Vec<String>>>>,
}

impl Server {
    /// Start `keratin serve` with `args` (ports 0 unless given) and wait for its address line.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with(Command::new(env!("CARGO_BIN_EXE_keratin")), args)
    }

    /// Start through a prepared command (for example a shell that joins a cgroup first).
    pub fn start_with(mut command: Command, args: &[&str]) -> Server {
        if !args.contains(&"--config") {
            // The caller's own settings of these win.
            let set: Vec<std::ffi::OsString> =
                command.get_envs().map(|(key, _)| key.to_owned()).collect();
            for (key, value) in HOST_DISK_LIMITS {
                if !set.iter().any(|s| s == key) {
                    command.env(key, value);
                }
            }
        }
        // Anyone may connect unless the test asks for logins (`KERATIN_SERVER__AUTH=users`):
        // most tests are not about them (`auth.rs` is).
        if !command
            .get_envs()
            .any(|(key, _)| key == "KERATIN_SERVER__AUTH")
        {
            command.env("KERATIN_SERVER__AUTH", "none");
        }
        command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("KERATIN_LOG", node_log_filter());
        let mut child = command.spawn().expect("spawn keratin");
        let pid = child.id();
        let stderr = child.stderr.take().expect("stderr");
        let stderr = std::thread::spawn(move || {
            use std::io::Write;
            let mut panics = Vec::new();
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("panicked at") && panics.len() < 8 {
                    panics.push(line.clone());
                }
                let _ = writeln!(std::io::stderr(), "{line}");
            }
            panics
        });
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("keratin did not print its addresses within 30 s");
            }
        };
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
        };
        Server {
            protocol: field("protocol="),
            http: field("http="),
            pid,
            child: Some(child),
            stderr: Some(std::panic::AssertUnwindSafe(stderr)),
        }
    }

    /// SIGKILL, and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM (graceful shutdown) and wait up to `timeout`; SIGKILL after that.
    pub fn terminate(&mut self, timeout: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Resident memory of the server process.
    pub fn rss_bytes(&self) -> u64 {
        let statm =
            std::fs::read_to_string(format!("/proc/{}/statm", self.pid)).unwrap_or_default();
        statm
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
            * 4096
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
        // The pipe closes with the process: every line it printed is in.
        let panics = self
            .stderr
            .take()
            .and_then(|forward| forward.0.join().ok())
            .unwrap_or_default();
        if !panics.is_empty() && !std::thread::panicking() {
            panic!(
                "keratin node (pid {}) panicked while the test ran (its log above): {}",
                self.pid,
                panics.join(" | ")
            );
        }
    }
}

/// A size-limited tmpfs mounted on a directory, unmounted when dropped.
pub struct Tmpfs {
    pub path: PathBuf,
}

impl Tmpfs {
    pub fn mount(path: &Path, size_mib: u64) -> Tmpfs {
        std::fs::create_dir_all(path).expect("mkdir");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_mib}m"), "tmpfs"])
            .arg(path)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount tmpfs on {}", path.display());
        Tmpfs {
            path: path.to_path_buf(),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

/// Free and total bytes of the file system holding `path`.
pub fn free_and_total(path: &Path) -> (u64, u64) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `s` a writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    assert_eq!(rc, 0, "statvfs {}", path.display());
    let frsize = s.f_frsize as u64;
    (s.f_bavail as u64 * frsize, s.f_blocks as u64 * frsize)
}

/// A plain HTTP GET on loopback; returns the body.
pub fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect http");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default()
}

/// `GET /api/v1/status` as JSON.
pub fn status(http: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&http_get(http, "/api/v1/status")).expect("status JSON")
}

/// The value of a metric line `name{labels} value` whose labels contain `label`.
pub fn metric(http: SocketAddr, name: &str, label: &str) -> f64 {
    http_get(http, "/metrics")
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A body: 8-byte sequence number, filler, and a CRC32C of the rest.
pub fn body(seq: u64, len: usize) -> Vec<u8> {
    let mut b = seq.to_le_bytes().to_vec();
    b.resize(len.max(12) - 4, (seq % 251) as u8);
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// The sequence number of a body made by [`body`], if its checksum holds.
pub fn seq_of(body: &[u8]) -> Option<u64> {
    if body.len() < 12 {
        return None;
    }
    let (data, crc) = body.split_at(body.len() - 4);
    (crc32c::crc32c(data).to_le_bytes() == crc)
        .then(|| u64::from_le_bytes(data[..8].try_into().unwrap_or([0; 8])))
}

/// Write a TOML config for a small file system: thresholds as fractions with zero floors.
pub fn small_fs_config(dir: &Path, dirs: &[&Path], soft: f64, hard: f64, reserve: f64) -> PathBuf {
    let list: Vec<String> = dirs
        .iter()
        .map(|d| format!("{:?}", d.display().to_string()))
        .collect();
    let text = format!(
        r#"[storage]
dirs = [{dirs}]
segment_bytes = 4194304

[limits]
sample_interval_ms = 100
max_delay_ms = 50

[limits.disk]
soft_fraction = {soft}
soft_floor_bytes = 0
hard_fraction = {hard}
hard_floor_bytes = 0
reserve_fraction = {reserve}
reserve_floor_bytes = 0
clear_margin_fraction = 0.02
"#,
        dirs = list.join(", ")
    );
    let path = dir.join("keratin.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// Tells apart the cgroups of one test process.
static CGROUP_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A cgroup v1 memory group with a limit, removed when dropped (after its processes are gone).
pub struct MemoryCgroup {
    pub path: PathBuf,
}

impl MemoryCgroup {
    pub fn create(limit_bytes: u64) -> MemoryCgroup {
        let path = PathBuf::from(format!(
            "/sys/fs/cgroup/memory/keratin-test-{}-{}",
            std::process::id(),
            CGROUP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create the cgroup");
        std::fs::write(path.join("memory.limit_in_bytes"), limit_bytes.to_string())
            .expect("set the limit");
        MemoryCgroup { path }
    }

    pub fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.path.join("memory.oom_control"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// True if cgroup v1 memory groups can be made here (root and the controller mounted). Without,
/// the test skips loudly, unless `KERATIN_REQUIRE_PRIVILEGED_TESTS=1`, where skipping fails.
pub fn memory_cgroups(test: &str) -> bool {
    if !privileged(test) {
        return false;
    }
    if Path::new("/sys/fs/cgroup/memory").is_dir() {
        return true;
    }
    if std::env::var("KERATIN_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{test}: no cgroup v1 memory controller at /sys/fs/cgroup/memory");
    }
    eprintln!("!!! SKIPPING {test}: no cgroup v1 memory controller");
    false
}

impl Server {
    /// Start `keratin serve --config config` inside `cgroup` (a shell joins it, then execs).
    pub fn start_in_cgroup(cgroup: &MemoryCgroup, config: &Path) -> Server {
        let mut shell = Command::new("sh");
        shell.arg("-c").arg(format!(
            "echo $$ > {}/cgroup.procs && exec {} \"$@\"",
            cgroup.path.display(),
            env!("CARGO_BIN_EXE_keratin")
        ));
        shell.arg("keratin");
        Server::start_with(
            shell,
            &[
                "serve",
                "--config",
                config.to_str().expect("utf8"),
                "--listen",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
            ],
        )
    }
}

/// True if iptables rules can be inserted here (root and a working `iptables`). Without, the
/// test skips loudly, unless `KERATIN_REQUIRE_PRIVILEGED_TESTS=1`, where skipping fails.
pub fn iptables(test: &str) -> bool {
    if !privileged(test) {
        return false;
    }
    let works = Command::new("iptables")
        .args(["-w", "-n", "-L", "INPUT"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if works {
        return true;
    }
    if std::env::var("KERATIN_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{test}: `iptables -L INPUT` fails (apt-get install iptables)");
    }
    eprintln!("!!! SKIPPING {test}: no working iptables (apt-get install iptables)");
    false
}

/// Rules this test process inserted into the `INPUT` chain. Each carries the comment
/// `keratin-test-<pid>` (so a leftover of a killed test can be told apart) and is deleted by
/// its exact spec (`iptables -D INPUT ...`; the table is never flushed): by [`Self::remove`],
/// or when dropped, a panicking test included.
#[derive(Default)]
pub struct IptablesRules {
    rules: Vec<Vec<String>>,
}

impl IptablesRules {
    /// The comment every rule of this process carries.
    pub fn comment() -> String {
        format!("keratin-test-{}", std::process::id())
    }

    /// Inserts `matches ... -m comment --comment keratin-test-<pid> -j target` at `position`
    /// of `INPUT` (1 is first); panics if iptables refuses.
    pub fn insert(&mut self, position: usize, matches: &[String], target: &str) {
        let mut spec: Vec<String> = matches.to_vec();
        spec.extend(["-m", "comment", "--comment"].map(String::from));
        spec.push(Self::comment());
        spec.extend(["-j".to_string(), target.to_string()]);
        let output = Command::new("iptables")
            .args(["-w", "-I", "INPUT", &position.to_string()])
            .args(&spec)
            .output()
            .expect("run iptables");
        assert!(
            output.status.success(),
            "iptables -I INPUT {position} {}: {}",
            spec.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        self.rules.push(spec);
    }

    /// Packets the `DROP` rules of this process dropped so far.
    pub fn dropped_packets(&self) -> u64 {
        let output = Command::new("iptables")
            .args(["-w", "-n", "-v", "-x", "-L", "INPUT"])
            .output()
            .expect("run iptables");
        let tag = format!("/* {} */", Self::comment());
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|l| l.contains(&tag) && l.split_whitespace().nth(2) == Some("DROP"))
            .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    /// Deletes every rule, the last inserted first; the specs iptables refused to delete.
    pub fn remove(&mut self) -> Vec<String> {
        let mut failed = Vec::new();
        while let Some(spec) = self.rules.pop() {
            let output = Command::new("iptables")
                .args(["-w", "-D", "INPUT"])
                .args(&spec)
                .output();
            match output {
                Ok(o) if o.status.success() => {}
                Ok(o) => failed.push(format!(
                    "iptables -D INPUT {}: {}",
                    spec.join(" "),
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => failed.push(format!("iptables -D INPUT {}: {e}", spec.join(" "))),
            }
        }
        failed
    }
}

impl Drop for IptablesRules {
    fn drop(&mut self) {
        for failure in self.remove() {
            eprintln!("!!! could not remove a test's iptables rule: {failure}");
        }
    }
}

/// Runs `decode` over a fresh buffer holding `bytes`; returns its answer and the bytes left.
/// (The codec's buffer type is inferred from `decode`: the tests do not depend on `bytes`.)
pub fn with_buffer<B: Default + Extend<u8> + AsRef<[u8]>, T>(
    bytes: &[u8],
    decode: impl FnOnce(&mut B) -> T,
) -> (T, Vec<u8>) {
    let mut buffer = B::default();
    buffer.extend(bytes.iter().copied());
    let answer = decode(&mut buffer);
    (answer, buffer.as_ref().to_vec())
}
