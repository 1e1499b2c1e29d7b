//! Admin reads and other queues stay fast while one storage directory's disk stalls.
//!
//! An in-process node (`keratin_server::Node`, two worker threads) runs on two storage
//! directories through a test `Io` that passes everything to the real disk, except that
//! `sync_data` of files under the second directory blocks while the test holds it stalled (and
//! that directory reports its own device, as a second disk would; it lives on a tmpfs of its own,
//! so that its writeback shares no journal with the first directory's disk). Queues `slow-a` and `slow-b`
//! live there, `fast` on the first directory. While the stall lasts:
//! - `/health`, `/api/v1/status`, `/metrics`, `/api/v1/queues` and `keratin status` (the CLI
//!   binary against the node's HTTP port) answer, and confirmed publishes to `fast` complete, each
//!   in under 100 ms (the CLI: under 100 ms beyond its own start-up, measured before the stall);
//! - 1,200 publishes of 128 KiB to two queues on the stalled disk (`slow-a`, `slow-b`, as many
//!   as the runtime's workers; 75 MiB each, past a log's 64 MiB pending bound) get a timeout
//!   error (`publish_timeout` 4 s: outcome unknown), not a hang.
//!
//! Anything that parks an async worker on the stalled disk (a blocking append, a lock held
//! across a sync, a handler reading log files) makes a read or a `fast` publish wait for the
//! stall and fails the test. After the release, everything completes and the node shuts down.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use keratin_client::{Client, ClientError, ClientOptions, OutgoingMessage, QueueSettings};
use keratin_log::{FsStats, Io, IoError, IoFile, OpenMode, RealIo};
use keratin_server::config::Config;
use keratin_server::Node;

mod support;

type IoResult<T> = Result<T, IoError>;

/// Room the stalled directory's file system must have: the stalled publishes' 150 MiB, under
/// the levels' floors (soft at 256 MiB free) with room to spare.
const SLOW_FS_MIB: u64 = 1024;

/// Where the stalled directory lives: a tmpfs of its own (root), else /dev/shm when it has
/// the room (a container's is often 64 MiB: the stalled writes filled it and the directory
/// was at the hard level before the test began), else the first directory's file system,
/// said loudly.
enum SlowFs {
    Mounted(support::Tmpfs),
    Shm(tempfile::TempDir),
    Shared(PathBuf),
}

impl SlowFs {
    fn new(tmp: &Path) -> SlowFs {
        if support::is_root() {
            return SlowFs::Mounted(support::Tmpfs::mount(&tmp.join("slow-fs"), SLOW_FS_MIB));
        }
        if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
            if support::free_and_total(shm.path()).0 >= SLOW_FS_MIB << 20 {
                return SlowFs::Shm(shm);
            }
        }
        eprintln!(
            "!!! not root and no /dev/shm with {SLOW_FS_MIB} MiB free: the stalled directory \
             shares the fast one's file system (a fast publish may wait behind its writeback)"
        );
        SlowFs::Shared(tmp.to_path_buf())
    }

    fn dir(&self) -> &Path {
        match self {
            SlowFs::Mounted(tmpfs) => &tmpfs.path,
            SlowFs::Shm(dir) => dir.path(),
            SlowFs::Shared(dir) => dir,
        }
    }
}

/// What every operation measured during the stall must stay under.
const FAST: Duration = Duration::from_millis(100);

/// Two queues on the stalled disk, as many as the node's async workers: a partition owner that
/// blocks a worker while its log cannot sync would take them all.
const SLOW_QUEUES: [&str; 2] = ["slow-a", "slow-b"];
/// Publishes to each stalled queue: 3 connections x 200 x 128 KiB = 75 MiB, past a log's
/// default pending bound (64 MiB), where an append that blocks its thread would block.
const SLOW_CONNECTIONS_PER_QUEUE: usize = 3;
const SLOW_PUBLISHES_PER_CONNECTION: usize = 200;
const SLOW_BODY_BYTES: usize = 128 << 10;
/// The stalled publishers' `publish_timeout`.
const SLOW_PUBLISH_TIMEOUT: Duration = Duration::from_secs(4);

/// The stall: `sync_data` under `dir` waits while `stalled` holds.
#[derive(Debug)]
struct Stall {
    dir: PathBuf,
    stalled: Mutex<bool>,
    released: Condvar,
    /// Which directory reports more free space, so that the next declare places there.
    prefer_stalled: AtomicBool,
}

impl Stall {
    fn set(&self, stalled: bool) {
        *self.stalled.lock().expect("lock") = stalled;
        self.released.notify_all();
    }

    fn wait(&self) {
        let mut stalled = self.stalled.lock().expect("lock");
        while *stalled {
            stalled = self.released.wait(stalled).expect("lock");
        }
    }
}

/// Releases the stall when dropped, so that a failing test does not leave the node's threads
/// blocked (dropping its runtime waits for them).
struct Unstall(Arc<Stall>);

impl Drop for Unstall {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

#[derive(Debug)]
struct StallIo {
    real: RealIo,
    stall: Arc<Stall>,
}

#[derive(Debug)]
struct StallFile {
    file: Arc<dyn IoFile>,
    stall: Option<Arc<Stall>>,
}

impl IoFile for StallFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.file.read_exact_at(buf, position)
    }
    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.file.write_all_at(buf, position)
    }
    fn sync_data(&self) -> IoResult<()> {
        if let Some(stall) = &self.stall {
            stall.wait();
        }
        self.file.sync_data()
    }
    fn allocate(&self, len: u64) -> IoResult<()> {
        self.file.allocate(len)
    }
    fn set_len(&self, len: u64) -> IoResult<()> {
        self.file.set_len(len)
    }
    fn len(&self) -> IoResult<u64> {
        self.file.len()
    }
}

impl StallIo {
    fn stalls(&self, path: &Path) -> bool {
        path.starts_with(&self.stall.dir)
    }
}

impl Io for StallIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let file = self.real.open(path, mode)?;
        let stall = self.stalls(path).then(|| self.stall.clone());
        Ok(Arc::new(StallFile { file, stall }))
    }
    fn create_dir_all(&self, path: &Path) -> IoResult<()> {
        self.real.create_dir_all(path)
    }
    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>> {
        self.real.read_dir(path)
    }
    fn remove_file(&self, path: &Path) -> IoResult<()> {
        self.real.remove_file(path)
    }
    fn remove_dir(&self, path: &Path) -> IoResult<()> {
        self.real.remove_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> IoResult<()> {
        self.real.rename(from, to)
    }
    fn sync_dir(&self, path: &Path) -> IoResult<()> {
        self.real.sync_dir(path)
    }
    fn device_id(&self, path: &Path) -> IoResult<u64> {
        // The stalled directory is a disk of its own: its segments never move to the other.
        let real = self.real.device_id(path)?;
        Ok(if self.stalls(path) {
            real ^ (1 << 40)
        } else {
            real
        })
    }
    fn exists(&self, path: &Path) -> IoResult<bool> {
        self.real.exists(path)
    }
    fn fs_stats(&self, path: &Path) -> IoResult<FsStats> {
        let mut stats = self.real.fs_stats(path)?;
        // Placement takes the directory with the most free bytes: the preferred one looks
        // a TiB larger (and emptier), whatever the two real file systems hold.
        let preferred = self.stalls(path) == self.stall.prefer_stalled.load(Ordering::Relaxed);
        if preferred {
            stats.free_bytes += 1 << 40;
            stats.total_bytes += 1 << 40;
        }
        Ok(stats)
    }
}

fn config(fast_dir: &Path, slow_dir: &Path) -> Config {
    let mut config = Config::default();
    config.storage.dirs = vec![fast_dir.to_path_buf(), slow_dir.to_path_buf()];
    config.storage.segment_bytes = 256 << 10;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    // The client connects without a login (logins have their own tests).
    config.server.auth = keratin_server::access::AuthMode::None;
    // The host's disk may be fuller than the default levels allow (see support::HOST_DISK_LIMITS).
    config.limits.disk.soft_fraction = 0.002;
    config.limits.disk.hard_fraction = 0.001;
    config.limits.disk.reserve_fraction = 0.0005;
    config.limits.disk.soft_floor_bytes = 256 << 20;
    config.limits.disk.hard_floor_bytes = 128 << 20;
    config.limits.disk.reserve_floor_bytes = 64 << 20;
    config
}

async fn connect(addr: SocketAddr, publish_timeout: Duration) -> Arc<Client> {
    let client = Client::connect(
        addr,
        ClientOptions {
            name: "stalled-disk".into(),
            publish_timeout,
            ..ClientOptions::default()
        },
    )
    .await
    .expect("connect");
    Arc::new(client)
}

/// A request that takes longer than this counts as this long: the node is stuck.
const STUCK: Duration = Duration::from_secs(5);

/// How long an HTTP GET of `path` takes until the whole 200 response is read; [`STUCK`] if it
/// does not answer by then.
async fn timed_get(http: SocketAddr, path: &'static str) -> Duration {
    let started = Instant::now();
    let get = async {
        let mut stream = tokio::net::TcpStream::connect(http).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        response.starts_with(b"HTTP/1.1 200").then_some(())
    };
    match tokio::time::timeout(STUCK, get).await {
        Ok(Some(())) => started.elapsed(),
        Ok(None) => panic!("GET {path} failed"),
        Err(_) => STUCK,
    }
}

/// How long `keratin status --http ADDR --json` takes; [`STUCK`] if it fails or takes longer.
async fn timed_cli_status(http: SocketAddr) -> Duration {
    let started = Instant::now();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_keratin"))
        .args(["status", "--http", &http.to_string(), "--json"])
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(STUCK, output).await {
        Ok(output) => {
            let output = output.expect("run keratin status");
            if !output.status.success() {
                eprintln!(
                    "keratin status: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
                return STUCK;
            }
            started.elapsed()
        }
        Err(_) => STUCK,
    }
}

/// The node runs on a runtime of its own (two workers, as on a two-core machine), the test's
/// clients and clocks on another: a node whose workers are all parked fails the measurements
/// instead of freezing the test.
#[test]
fn admin_reads_and_other_queues_stay_fast_while_a_disk_stalls() {
    // Declared first, dropped last: when the test fails, the node's runtime (dropped before
    // it) stops the node before its directories go. Removed under a live node, they made its
    // logs fail and heal onto nothing, and the owner's "the healed log lost applied records"
    // assertion fired on top of the test's own failure (seen once after a 126 ms publish).
    let tmp = tempfile::tempdir().expect("tmp");
    // The stalled directory on another file system: on the same disk as `fast`, the kernel's
    // writeback of the stalled files' 150 MiB (their syncs block, their pages do not) made one
    // `fast` fdatasync wait about a second behind it in ext4's journal (seen once in CI:
    // 999 ms). A second disk, as the test means, shares no journal.
    let slow_fs = SlowFs::new(tmp.path());
    let node_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .thread_name("node-worker")
        .enable_all()
        .build()
        .expect("node runtime");
    let test_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("test runtime");
    let (fast_dir, slow_dir) = (tmp.path().join("fast"), slow_fs.dir().join("slow"));
    let stall = Arc::new(Stall {
        dir: slow_dir.clone(),
        stalled: Mutex::new(false),
        released: Condvar::new(),
        prefer_stalled: AtomicBool::new(true),
    });
    let io = Arc::new(StallIo {
        real: RealIo::new(),
        stall: stall.clone(),
    });
    let _unstall = Unstall(stall.clone());
    let node = node_runtime
        .block_on(Node::start_with_io(&config(&fast_dir, &slow_dir), io))
        .expect("start");
    test_runtime.block_on(measure(&node, &stall, &fast_dir, &slow_dir));
    node_runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), node.shutdown()).await })
        .expect("shutdown in time")
        .expect("shutdown");
}

async fn measure(node: &Node, stall: &Stall, fast_dir: &Path, slow_dir: &Path) {
    let (protocol, http) = (node.protocol_addr(), node.http_addr());
    let client = connect(protocol, Duration::from_secs(10)).await;
    for queue in SLOW_QUEUES {
        client
            .declare(queue, QueueSettings::default())
            .await
            .expect("slow queue");
    }
    stall.prefer_stalled.store(false, Ordering::Relaxed);
    client
        .declare("fast", QueueSettings::default())
        .await
        .expect("fast");
    let dir_of = |name: &str| {
        node.broker().info(name).expect("info").partitions[0]
            .dir
            .clone()
    };
    for queue in SLOW_QUEUES {
        assert_eq!(
            dir_of(queue),
            slow_dir,
            "{queue} is on the stalled directory"
        );
    }
    assert_eq!(dir_of("fast"), fast_dir, "fast is not");
    for queue in SLOW_QUEUES.into_iter().chain(["fast"]) {
        client
            .publish(queue, OutgoingMessage::new(b"before".to_vec()))
            .await
            .expect("publish before the stall");
    }
    let mut cli_baseline = Duration::ZERO;
    for _ in 0..3 {
        cli_baseline = cli_baseline.max(timed_cli_status(http).await);
    }

    stall.set(true);
    let mut slow_publishers = tokio::task::JoinSet::new();
    for queue in SLOW_QUEUES {
        for _ in 0..SLOW_CONNECTIONS_PER_QUEUE {
            let slow_client = connect(protocol, SLOW_PUBLISH_TIMEOUT).await;
            for _ in 0..SLOW_PUBLISHES_PER_CONNECTION {
                let slow_client = slow_client.clone();
                slow_publishers.spawn(async move {
                    let started = Instant::now();
                    let body = vec![7u8; SLOW_BODY_BYTES];
                    let outcome = slow_client.publish(queue, OutgoingMessage::new(body)).await;
                    (outcome, started.elapsed())
                });
            }
        }
    }
    // Let the stalled publishes reach their logs, pile up past the logs' pending bound, and
    // their commit work block in the sync.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let mut worst: Vec<(&str, Duration)> = Vec::new();
    let mut note =
        |what: &'static str, took: Duration| match worst.iter_mut().find(|(w, _)| *w == what) {
            Some((_, max)) => *max = (*max).max(took),
            None => worst.push((what, took)),
        };
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut rounds = 0;
    while Instant::now() < deadline {
        for path in ["/health", "/api/v1/status", "/metrics", "/api/v1/queues"] {
            note(path, timed_get(http, path).await);
        }
        let started = Instant::now();
        let published = tokio::time::timeout(
            STUCK,
            client.publish("fast", OutgoingMessage::new(b"during".to_vec())),
        )
        .await;
        match published {
            Ok(result) => {
                result.expect("publish to fast during the stall");
                note("publish fast", started.elapsed());
            }
            Err(_) => note("publish fast", STUCK),
        }
        let cli = timed_cli_status(http).await;
        note(
            "keratin status beyond its start-up",
            cli.saturating_sub(cli_baseline),
        );
        rounds += 1;
    }
    eprintln!("during the stall ({rounds} rounds; CLI start-up {cli_baseline:?}): {worst:?}");
    for (what, took) in &worst {
        assert!(*took < FAST, "{what} took {took:?} while a disk stalled");
    }

    let mut timed_out = 0;
    let mut answered = 0;
    while let Some(joined) =
        tokio::time::timeout(Duration::from_secs(20), slow_publishers.join_next())
            .await
            .expect("every stalled publisher gets an answer, not a hang")
    {
        let (outcome, took) = joined.expect("publisher");
        answered += 1;
        match outcome.map_err(|failed| failed.error) {
            Err(ClientError::OutcomeUnknown { detail, .. }) => {
                assert!(detail.contains("publish_timeout"), "{detail}");
                timed_out += 1;
            }
            // Refused for memory (the stalled bytes are held until their sync): also an answer.
            Err(ClientError::Limited { .. }) => {}
            other => panic!("a publish to a stalled queue: expected a timeout, got {other:?}"),
        }
        assert!(
            took < SLOW_PUBLISH_TIMEOUT + Duration::from_secs(5),
            "a stalled publish was answered after {took:?}"
        );
    }
    eprintln!("{answered} stalled publishes answered, {timed_out} of them timed out");
    assert!(timed_out > 0, "the stalled publishers time out");
    stall.set(false);
    for queue in SLOW_QUEUES {
        client
            .publish(queue, OutgoingMessage::new(b"after".to_vec()))
            .await
            .expect("the stalled queue works once the disk is back");
    }
    client.close().await;
}
