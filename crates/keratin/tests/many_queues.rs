//! Many queues on one node, against the real binary:
//! - `threads_do_not_grow_with_queues`: with `server.worker_threads = 2` and
//!   `server.blocking_threads_max = 16`, the process's threads (`/proc/PID/task`) stay under the
//!   formula of docs/ARCHITECTURE.md ("Threads") with 10 queues and with 1,000, and do not grow
//!   between the two. A thread (or two) per log fails it.
//! - `many_queues_declared_used_deleted_and_restarted`: declare `KERATIN_MANY_QUEUES` queues
//!   (default 10,000; 64 declares in flight), publish one confirmed message to each, consume and
//!   ack it, restart the node (SIGTERM, start again: every queue is back; the time is printed and
//!   bounded generously, debug builds being slow), delete them all. Idle empty queues hold no
//!   file descriptor (`/proc/PID/fd` does not grow with them), and the node raised its open
//!   files soft limit to the hard limit. Prints the declare rate, resident memory and
//!   descriptors.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::Server;

/// Declares (and other requests) in flight at once.
const IN_FLIGHT: usize = 64;

/// Threads of the tests' runtime configuration.
const WORKER_THREADS: u64 = 2;
const BLOCKING_THREADS_MAX: u64 = 16;
/// `keratin_log`'s default commit workers per file system (docs/ARCHITECTURE.md, "Threads").
const COMMIT_WORKERS_PER_FILESYSTEM: u64 = 16;

/// The thread formula for one file system: the main thread, the runtime's workers, its
/// blocking pool at most, the commit workers of the file system and the segment pool's worker.
fn threads_max() -> u64 {
    1 + WORKER_THREADS + BLOCKING_THREADS_MAX + COMMIT_WORKERS_PER_FILESYSTEM + 1
}

fn start(data: &Path, extra_env: &[(&str, &str)]) -> Server {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_keratin"));
    command.envs(extra_env.iter().copied());
    command
        .env("KERATIN_SERVER__WORKER_THREADS", WORKER_THREADS.to_string())
        .env(
            "KERATIN_SERVER__BLOCKING_THREADS_MAX",
            BLOCKING_THREADS_MAX.to_string(),
        )
        .env("KERATIN_SERVER__QUEUES_MAX", "20000")
        .env("KERATIN_SERVER__PARTITIONS_MAX", "20000");
    Server::start_with(
        command,
        &[
            "serve",
            "--data-dir",
            data.to_str().expect("utf-8 path"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    )
}

async fn connect(addr: SocketAddr) -> Arc<Client> {
    let client = Client::connect(
        addr,
        ClientOptions {
            name: "many-queues".into(),
            request_timeout: Duration::from_secs(60),
            publish_timeout: Duration::from_secs(60),
            ..ClientOptions::default()
        },
    )
    .await
    .expect("connect");
    Arc::new(client)
}

fn count_entries(path: String) -> u64 {
    std::fs::read_dir(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .count() as u64
}

fn threads(pid: u32) -> u64 {
    count_entries(format!("/proc/{pid}/task"))
}

fn open_fds(pid: u32) -> u64 {
    count_entries(format!("/proc/{pid}/fd"))
}

/// Run `op` on every index in `range`, `IN_FLIGHT` at a time.
async fn each<F, Fut>(range: std::ops::Range<u64>, op: F)
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut running = tokio::task::JoinSet::new();
    for i in range {
        if running.len() >= IN_FLIGHT {
            running.join_next().await.expect("a task").expect("task");
        }
        running.spawn(op(i));
    }
    while let Some(done) = running.join_next().await {
        done.expect("task");
    }
}

async fn declare_all(client: &Arc<Client>, range: std::ops::Range<u64>) {
    each(range, |i| {
        let client = client.clone();
        async move {
            client
                .declare(&format!("q{i}"), QueueSettings::default())
                .await
                .unwrap_or_else(|e| panic!("declare q{i}: {e}"));
        }
    })
    .await;
}

/// Threads settle: blocking threads that finished their work stay up to 10 s (tokio's keep
/// alive), which the formula counts, so a single look is enough; this waits only for the
/// declares' last answers to be sent.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_do_not_grow_with_queues() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Small segments: this test is about threads, whatever a log preallocates.
    let server = start(
        &tmp.path().join("data"),
        &[("KERATIN_STORAGE__SEGMENT_BYTES", "262144")],
    );
    let client = connect(server.protocol).await;
    declare_all(&client, 0..10).await;
    settle().await;
    let at_10 = threads(server.pid);
    declare_all(&client, 10..1_000).await;
    settle().await;
    let at_1000 = threads(server.pid);
    eprintln!(
        "threads: {at_10} with 10 queues, {at_1000} with 1,000; formula bound {}",
        threads_max()
    );
    assert!(
        at_1000 <= threads_max(),
        "{at_1000} threads with 1,000 queues, over the formula's {}",
        threads_max()
    );
    assert!(
        at_1000 <= at_10 + BLOCKING_THREADS_MAX,
        "threads grew with queues: {at_10} -> {at_1000}"
    );
}

fn queue_count() -> u64 {
    std::env::var("KERATIN_MANY_QUEUES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files")
        .to_string();
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_string(), fields[4].to_string())
}

async fn use_all(client: &Arc<Client>, count: u64) {
    each(0..count, |i| {
        let client = client.clone();
        async move {
            let queue = format!("q{i}");
            client
                .publish(&queue, OutgoingMessage::new(format!("m{i}").into_bytes()))
                .await
                .unwrap_or_else(|e| panic!("publish {queue}: {e}"));
            let mut consumer = client.subscribe(&queue, 1).await.expect("subscribe");
            let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                .await
                .unwrap_or_else(|_| panic!("{queue}: no delivery within 30 s"))
                .expect("delivery");
            assert_eq!(&delivery.body[..], format!("m{i}").as_bytes());
            delivery.ack().expect("ack");
            consumer.cancel().await.expect("cancel");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_queues_declared_used_deleted_and_restarted() {
    let count = queue_count();
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let mut server = start(&data, &[]);
    let (soft, hard) = open_files_limits(server.pid);
    assert_eq!(soft, hard, "keratin serve raises its open files soft limit");
    let client = connect(server.protocol).await;
    declare_all(&client, 0..10).await;
    let fds_at_10 = open_fds(server.pid);
    let started = Instant::now();
    declare_all(&client, 10..count).await;
    let declare_s = started.elapsed().as_secs_f64();
    let fds = open_fds(server.pid);
    eprintln!(
        "{count} queues declared in {declare_s:.1} s ({:.0}/s); {} threads, {} MiB resident, \
         {fds} open fds ({fds_at_10} with 10 queues)",
        count as f64 / declare_s,
        threads(server.pid),
        server.rss_bytes() >> 20
    );
    assert!(
        fds <= fds_at_10 + count / 100 + 16,
        "idle empty queues hold file descriptors: {fds_at_10} with 10 queues, {fds} with {count}"
    );
    let listed = client.list().await.expect("list").len() as u64;
    assert_eq!(listed, count);
    let started = Instant::now();
    use_all(&client, count).await;
    eprintln!(
        "one message published, consumed and acked on each of {count} queues in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    client.close().await;

    assert!(server.terminate(Duration::from_secs(120)), "clean shutdown");
    let started = Instant::now();
    let server = start(&data, &[]);
    let client = connect(server.protocol).await;
    let listed = client.list().await.expect("list").len() as u64;
    let restart_s = started.elapsed().as_secs_f64();
    eprintln!("restart with {count} queues: {restart_s:.2} s (debug build)");
    assert_eq!(listed, count, "every queue is back after the restart");
    assert!(
        restart_s < 120.0,
        "restart with {count} queues took {restart_s:.1} s"
    );

    let started = Instant::now();
    each(0..count, |i| {
        let client = client.clone();
        async move {
            client
                .delete(&format!("q{i}"))
                .await
                .unwrap_or_else(|e| panic!("delete q{i}: {e}"));
        }
    })
    .await;
    eprintln!(
        "{count} queues deleted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(client.list().await.expect("list").len(), 0);
    let left = std::fs::read_dir(data.join("queues"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(left, 0, "every queue's files are gone");
}

fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

/// Resident memory after the node settled (the sampler returns freed heap every second).
async fn settled_resident_kib(pid: u32) -> u64 {
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    resident_kib(pid)
}

/// The memory figures of docs/configuration.md ("What clients create, and what it costs"):
/// resident memory per idle queue, per idle connection and per idle consumer. Run on demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: KERATIN_MEASURE=1 ... -- --ignored measure_costs --nocapture"]
async fn measure_costs() {
    const QUEUES: u64 = 1_000;
    const CONNECTIONS: u64 = 200;
    const CONSUMERS: u64 = 1_000;
    let tmp = tempfile::tempdir().expect("tmp");
    // Small segments: the figure is memory, which the segment size does not change, and a
    // log that did preallocate at open would not fill the disk.
    let server = start(
        &tmp.path().join("data"),
        &[("KERATIN_STORAGE__SEGMENT_BYTES", "262144")],
    );
    let client = connect(server.protocol).await;
    declare_all(&client, 0..10).await;
    let before = settled_resident_kib(server.pid).await;
    declare_all(&client, 10..10 + QUEUES).await;
    let after_queues = settled_resident_kib(server.pid).await;
    let mut connections = Vec::new();
    for _ in 0..CONNECTIONS {
        connections.push(connect(server.protocol).await);
    }
    let after_connections = settled_resident_kib(server.pid).await;
    let mut consumers = Vec::new();
    for i in 0..CONSUMERS {
        let on = &connections[(i % 4) as usize];
        consumers.push(
            on.subscribe(&format!("q{}", 10 + i), 1)
                .await
                .expect("subscribe"),
        );
    }
    let after_consumers = settled_resident_kib(server.pid).await;
    let per = |delta: u64, n: u64| delta as f64 / n as f64;
    eprintln!(
        "resident: {before} KiB with 10 queues; per idle queue {:.1} KiB; per idle connection \
         {:.1} KiB; per idle consumer {:.1} KiB; {} threads",
        per(after_queues.saturating_sub(before), QUEUES),
        per(after_connections.saturating_sub(after_queues), CONNECTIONS),
        per(after_consumers.saturating_sub(after_connections), CONSUMERS),
        threads(server.pid),
    );
}
