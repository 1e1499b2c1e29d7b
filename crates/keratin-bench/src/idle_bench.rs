//! The `idle` benchmark (issue 13): many idle queues on one node, Keratin against RabbitMQ
//! (durable classic queues, quorum queues) and NATS JetStream (file streams), driven by
//! `bench/compare.sh` (`MODE=idle`), which starts and restarts each broker from its binary.
//!
//! Three phases, each a separate invocation, so that the script can stop and start a broker
//! between them:
//! - `declare`: with the broker fresh, its resident memory and OS threads; then `queues` queues
//!   declared by `concurrency` workers (declare rate); after a settle pause, the disk used by its
//!   data directory (`du`: allocated blocks), its resident memory and threads again.
//! - `restart`: the script stopped the broker and started it again at `--since-ns`; the time
//!   until every queue answers a passive check (Keratin `info`, AMQP passive `queue.declare`,
//!   JetStream stream info). For Keratin, then the confirmed publish of 4 producers spread over
//!   `spread` queues against the same 4 producers on 4 queues (rounds alternate; ratio).
//! - `report`: the table of every figure, with ratios Keratin / peer.
//!
//! Each phase writes (or extends) one JSON file per system.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use serde_json::{json, Value};

use crate::broker_bench::runtime;
use crate::contender::BenchResult;
use crate::peers::{Endpoints, System};
use crate::report::median;

/// Disk per idle empty queue at most this (issue 13).
const GOAL_DISK_PER_QUEUE: u64 = 64 * 1024;
/// Restart with 10,000 queues at most this (issue 13).
const GOAL_RESTART: Duration = Duration::from_secs(5);
/// Spread over many queues: at least this share of the 4-queue rate (issue 13).
const GOAL_SPREAD: f64 = 0.8;
/// One connect, declare or check taking longer than this counts as failed (RabbitMQ accepts
/// TCP connections long before it answers them while it recovers quorum queues).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between retries of a passive check that failed (the broker still recovering).
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// What one phase does.
#[derive(Debug, Clone)]
pub struct IdleConfig {
    /// `declare`, `restart` or `report`.
    pub phase: String,
    /// The system of `declare` and `restart`.
    pub system: Option<System>,
    /// Broker addresses.
    pub endpoints: Endpoints,
    /// The broker's process id (its tree: memory and threads).
    pub pid: Option<u32>,
    /// The broker's data directory (disk used).
    pub data_dir: Option<PathBuf>,
    /// Queues declared.
    pub queues: usize,
    /// Declares (and checks) in flight.
    pub concurrency: usize,
    /// Pause after the declares before disk, memory and threads are read.
    pub settle: Duration,
    /// When the restart began (ns since the Unix epoch).
    pub since_ns: Option<u128>,
    /// A queue not usable this long after the restart began fails the restart phase (and the
    /// declares of the declare phase).
    pub restart_timeout: Duration,
    /// Queues of the spread publish case (Keratin; 0 skips it).
    pub spread: usize,
    /// Producers of the spread case.
    pub producers: usize,
    /// Confirmed publishes in flight per producer.
    pub in_flight: usize,
    /// Seconds per publish run of the spread case.
    pub duration: Duration,
    /// Rounds of the spread case.
    pub rounds: usize,
    /// Body bytes of the spread case.
    pub body_bytes: usize,
    /// The per-system JSON file (`declare`, `restart`), or the files to report (`report`).
    pub files: Vec<PathBuf>,
    /// Where `report` writes its markdown, besides stdout.
    pub out: Option<PathBuf>,
    /// A line about the run printed under the table (e.g. a capped Keratin count).
    pub note: Vec<String>,
}

/// Runs one phase.
pub fn run(config: &IdleConfig) -> BenchResult<()> {
    match config.phase.as_str() {
        "declare" => declare_phase(config),
        "restart" => restart_phase(config),
        "report" => report(config),
        other => Err(format!("unknown phase {other:?}; use declare, restart or report").into()),
    }
}

/// The name of queue `i`: sortable, the same in every system (NATS stream names allow it).
fn queue_name(i: usize) -> String {
    format!("idle-{i:05}")
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

// ---------------------------------------------------------------------------------------------
// What the operating system says about a broker.

/// Resident bytes and OS threads of `pid` and its descendants, shells and `su` excepted (the
/// wrappers that start a broker are not the broker).
pub fn tree_rss_threads(pid: u32) -> BenchResult<(u64, u64)> {
    let (mut rss, mut threads) = (0u64, 0u64);
    let mut stack = vec![pid];
    let mut seen = 0usize;
    while let Some(pid) = stack.pop() {
        seen += 1;
        if seen > 10_000 {
            break;
        }
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().trim_end_matches("kB").trim().to_string())
        };
        let name = field("Name:").unwrap_or_default();
        if !matches!(name.as_str(), "sh" | "bash" | "dash" | "su" | "runuser") {
            rss += field("VmRSS:")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
            threads += field("Threads:")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for task in tasks.flatten() {
                if let Ok(children) = std::fs::read_to_string(task.path().join("children")) {
                    stack.extend(
                        children
                            .split_whitespace()
                            .filter_map(|c| c.parse::<u32>().ok()),
                    );
                }
            }
        }
    }
    if rss == 0 && !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(format!("no process {pid}").into());
    }
    Ok((rss, threads))
}

/// Allocated bytes under `dir`, as `du` counts them (blocks, each inode once).
pub fn du_bytes(dir: &Path) -> BenchResult<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue; // removed while we walked
        };
        if seen.insert((meta.dev(), meta.ino())) {
            total += meta.blocks() * 512;
        }
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                stack.extend(entries.flatten().map(|e| e.path()));
            }
        }
    }
    Ok(total)
}

// ---------------------------------------------------------------------------------------------
// One connection per system, able to declare and check many queues.

enum Admin {
    Keratin(Client),
    Amqp(lapin::Connection),
    Nats(async_nats::jetstream::Context),
}

impl Admin {
    async fn connect(system: System, endpoints: &Endpoints) -> BenchResult<Admin> {
        Ok(match system {
            System::Keratin => {
                let addr = endpoints
                    .keratin
                    .ok_or("no address for keratin: pass --keratin")?;
                Admin::Keratin(Client::connect(addr, ClientOptions::default()).await?)
            }
            System::RabbitClassic | System::RabbitQuorum => {
                let uri = endpoints.amqp.as_deref().ok_or("pass --amqp")?;
                let connection =
                    lapin::Connection::connect(uri, lapin::ConnectionProperties::default())
                        .await
                        .map_err(|e| format!("connect to RabbitMQ at {uri}: {e}"))?;
                Admin::Amqp(connection)
            }
            System::Nats => {
                let url = endpoints.nats.as_deref().ok_or("pass --nats")?;
                let client = async_nats::connect(url)
                    .await
                    .map_err(|e| format!("connect to NATS at {url}: {e}"))?;
                Admin::Nats(async_nats::jetstream::new(client))
            }
        })
    }

    async fn close(self) {
        match self {
            Admin::Keratin(client) => client.close().await,
            Admin::Amqp(connection) => {
                let _ = connection.close(200, "bye").await;
            }
            Admin::Nats(_) => {}
        }
    }

    /// A worker's handle: an AMQP channel of its own (a channel runs one method at a time, and
    /// a failed passive declare closes it).
    async fn worker(&self) -> BenchResult<Worker<'_>> {
        Ok(match self {
            Admin::Keratin(client) => Worker::Keratin(client),
            Admin::Amqp(connection) => Worker::Amqp(connection, connection.create_channel().await?),
            Admin::Nats(context) => Worker::Nats(context),
        })
    }
}

enum Worker<'a> {
    Keratin(&'a Client),
    Amqp(&'a lapin::Connection, lapin::Channel),
    Nats(&'a async_nats::jetstream::Context),
}

impl Worker<'_> {
    /// Declares `queue` durable (or checks it exists, `passive`).
    async fn declare(&mut self, system: System, queue: &str, passive: bool) -> BenchResult<()> {
        match self {
            Worker::Keratin(client) => {
                if passive {
                    client.info(queue).await?;
                } else {
                    client.declare(queue, QueueSettings::default()).await?;
                }
            }
            Worker::Amqp(connection, channel) => {
                if !channel.status().connected() {
                    *channel = connection.create_channel().await?;
                }
                let kind = if system == System::RabbitQuorum {
                    "quorum"
                } else {
                    "classic"
                };
                let mut arguments = lapin::types::FieldTable::default();
                arguments.insert(
                    "x-queue-type".into(),
                    lapin::types::AMQPValue::LongString(kind.into()),
                );
                let options = lapin::options::QueueDeclareOptions {
                    durable: true,
                    passive,
                    ..Default::default()
                };
                channel.queue_declare(queue, options, arguments).await?;
            }
            Worker::Nats(context) => {
                use async_nats::jetstream::stream;
                if passive {
                    context
                        .get_stream(queue)
                        .await
                        .map_err(|e| format!("stream {queue}: {e}"))?;
                } else {
                    let config = stream::Config {
                        name: queue.to_string(),
                        subjects: vec![queue.to_string()],
                        storage: stream::StorageType::File,
                        discard: stream::DiscardPolicy::New,
                        retention: stream::RetentionPolicy::WorkQueue,
                        ..Default::default()
                    };
                    context
                        .create_stream(config)
                        .await
                        .map_err(|e| format!("create stream {queue}: {e}"))?;
                }
            }
        }
        Ok(())
    }
}

/// Declares (or, `passive`, checks until each answers) queues 0..`queues` with `concurrency`
/// workers, each on a connection of its own (Keratin answers one request of a connection at a
/// time; RabbitMQ and NATS clients declare from many connections in practice too); retries a
/// failed connect or check until `deadline`. Returns the checks retried.
async fn declare_all(
    system: System,
    endpoints: &Endpoints,
    queues: usize,
    concurrency: usize,
    passive: bool,
    deadline: Instant,
) -> BenchResult<u64> {
    let next = AtomicUsize::new(0);
    let retries = AtomicUsize::new(0);
    let mut workers = FuturesUnordered::new();
    for _ in 0..concurrency.max(1) {
        let (next, retries) = (&next, &retries);
        workers.push(async move {
            let admin = loop {
                let connect =
                    tokio::time::timeout(OPERATION_TIMEOUT, Admin::connect(system, endpoints));
                match connect
                    .await
                    .unwrap_or_else(|_| Err("connect timed out".into()))
                {
                    Ok(admin) => break admin,
                    // A connect refused under load (16 at once) is retried in both phases.
                    Err(error) if Instant::now() < deadline => {
                        if retries.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("  {}: connect: {error}; retrying", system.name());
                        }
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    Err(error) => return Err(error),
                }
            };
            let mut worker = admin.worker().await?;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= queues {
                    break;
                }
                let name = queue_name(i);
                loop {
                    let declare = tokio::time::timeout(
                        OPERATION_TIMEOUT,
                        worker.declare(system, &name, passive),
                    );
                    match declare
                        .await
                        .unwrap_or_else(|_| Err("no answer within 30 s".into()))
                    {
                        Ok(()) => break,
                        Err(error) if passive && Instant::now() < deadline => {
                            if retries.fetch_add(1, Ordering::Relaxed) == 0 {
                                eprintln!(
                                    "  {}: {name} not usable yet ({error}); retrying",
                                    system.name()
                                );
                            }
                            tokio::time::sleep(RETRY_PAUSE).await;
                            if let Worker::Amqp(connection, channel) = &mut worker {
                                if !channel.status().connected() {
                                    *channel = connection.create_channel().await?;
                                }
                            }
                        }
                        Err(error) => return Err(format!("{name}: {error}").into()),
                    }
                }
            }
            drop(worker);
            admin.close().await;
            BenchResult::Ok(())
        });
    }
    while let Some(result) = workers.next().await {
        result?;
    }
    Ok(retries.load(Ordering::Relaxed) as u64)
}

fn read_json(path: &Path) -> Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| json!({}))
}

fn write_json(path: &Path, value: &Value) -> BenchResult<()> {
    std::fs::write(path, serde_json::to_string_pretty(value)?)?;
    Ok(())
}

fn single_file(config: &IdleConfig) -> BenchResult<&Path> {
    match config.files.as_slice() {
        [one] => Ok(one),
        _ => Err("pass exactly one --file for this phase".into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Phases.

fn declare_phase(config: &IdleConfig) -> BenchResult<()> {
    let system = config.system.ok_or("pass --system")?;
    let pid = config.pid.ok_or("pass --pid")?;
    let data_dir = config.data_dir.as_deref().ok_or("pass --data-dir")?;
    let file = single_file(config)?;
    let rt = runtime()?;
    let (rss_fresh, threads_fresh) = tree_rss_threads(pid)?;
    let disk_fresh = du_bytes(data_dir)?;
    eprintln!(
        "  {}: fresh: {} threads, {:.1} MB resident, {:.1} MB on disk; declaring {} queues",
        system.name(),
        threads_fresh,
        rss_fresh as f64 / 1e6,
        disk_fresh as f64 / 1e6,
        config.queues
    );
    let began = Instant::now();
    rt.block_on(declare_all(
        system,
        &config.endpoints,
        config.queues,
        config.concurrency,
        false,
        began + config.restart_timeout,
    ))?;
    let declare = began.elapsed();
    std::thread::sleep(config.settle);
    let (rss, threads) = tree_rss_threads(pid)?;
    let disk = du_bytes(data_dir)?;
    let rate = config.queues as f64 / declare.as_secs_f64();
    eprintln!(
        "  {}: {} queues in {:.2} s ({rate:.0}/s); {threads} threads, {:.1} MB resident, {:.1} MB on disk",
        system.name(),
        config.queues,
        declare.as_secs_f64(),
        rss as f64 / 1e6,
        disk as f64 / 1e6
    );
    let value = json!({
        "system": system.name(),
        "queues": config.queues,
        "concurrency": config.concurrency,
        "declare_s": declare.as_secs_f64(),
        "declare_rate": rate,
        "rss_fresh": rss_fresh,
        "threads_fresh": threads_fresh,
        "disk_fresh": disk_fresh,
        "rss": rss,
        "threads": threads,
        "disk": disk,
        "settle_s": config.settle.as_secs_f64(),
    });
    write_json(file, &value)
}

fn restart_phase(config: &IdleConfig) -> BenchResult<()> {
    let system = config.system.ok_or("pass --system")?;
    let pid = config.pid.ok_or("pass --pid")?;
    let since = config.since_ns.ok_or("pass --since-ns")?;
    let file = single_file(config)?;
    let mut value = read_json(file);
    let queues = value["queues"]
        .as_u64()
        .map_or(config.queues, |q| q as usize);
    let rt = runtime()?;
    let deadline = Instant::now() + config.restart_timeout;
    let checked = rt.block_on(declare_all(
        system,
        &config.endpoints,
        queues,
        config.concurrency,
        true,
        deadline,
    ));
    let usable = now_ns().saturating_sub(since);
    let restart = Duration::from_nanos(u64::try_from(usable).unwrap_or(u64::MAX));
    let (rss, threads) = tree_rss_threads(pid)?;
    match checked {
        Ok(retries) => {
            eprintln!(
                "  {}: restarted, all {queues} queues usable after {:.2} s ({retries} retried \
                 checks); {threads} threads, {:.1} MB resident",
                system.name(),
                restart.as_secs_f64(),
                rss as f64 / 1e6
            );
            value["restart_s"] = json!(restart.as_secs_f64());
            value["restart_retries"] = json!(retries);
        }
        Err(error) => {
            // Recorded, not fatal: the other systems' figures still count.
            eprintln!(
                "  {}: not every queue usable {:.0} s after the restart began: {error}",
                system.name(),
                restart.as_secs_f64()
            );
            value["restart_failed_after_s"] = json!(restart.as_secs_f64());
            value["restart_error"] = json!(error.to_string());
        }
    }
    value["rss_restarted"] = json!(rss);
    value["threads_restarted"] = json!(threads);
    if system == System::Keratin && config.spread > 0 {
        let spread = config.spread.min(queues);
        let (four, many, ratios) = rt.block_on(spread_case(config, spread))?;
        value["spread_queues"] = json!(spread);
        value["spread_four"] = json!(four);
        value["spread_many"] = json!(many);
        value["spread_ratios"] = json!(ratios);
        // The disk's own ceiling for it, in the same run: one write and one sync per file.
        let dir = config
            .data_dir
            .as_deref()
            .and_then(Path::parent)
            .unwrap_or(Path::new("/var/tmp"))
            .join("raw-syncs");
        let mut raw = Vec::new();
        for threads in RAW_SYNC_THREADS {
            let rate = raw_syncs(&dir, spread, threads, config.duration, config.body_bytes)?;
            eprintln!(
                "  raw disk: {rate:.0} write+fdatasync/s of {} bytes over {spread} files, \
                 {threads} threads",
                config.body_bytes
            );
            raw.push(json!({"threads": threads, "syncs_per_s": rate}));
        }
        value["spread_raw_syncs"] = json!(raw);
    }
    write_json(file, &value)
}

/// Thread counts of the raw many-file sync reference.
const RAW_SYNC_THREADS: [usize; 2] = [4, 16];

/// The raw reference of the spread case: `files` files preallocated like a fresh segment's first
/// step (64 KiB), and `threads` threads each writing `bytes` at the next offset of one of its
/// files in turn and `fdatasync`ing it, for `duration`: syncs per second. Each log of the
/// spread case syncs on its own, so this bounds its rounds per second.
fn raw_syncs(
    dir: &Path,
    files: usize,
    threads: usize,
    duration: Duration,
    bytes: usize,
) -> BenchResult<f64> {
    use std::os::unix::fs::FileExt;
    const ALLOCATED: u64 = 64 << 10;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let mut opened = Vec::with_capacity(files);
    for i in 0..files {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.join(format!("raw-{i:05}")))?;
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, ALLOCATED)?;
        file.sync_all()?;
        opened.push(file);
    }
    let done = AtomicUsize::new(0);
    let deadline = Instant::now() + duration;
    let began = Instant::now();
    let failed = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..threads.max(1))
            .map(|t| {
                let (opened, done) = (&opened, &done);
                scope.spawn(move || -> std::io::Result<()> {
                    let buf = vec![0x6b_u8; bytes.max(1)];
                    let mine: Vec<&std::fs::File> =
                        opened.iter().skip(t).step_by(threads.max(1)).collect();
                    let mut offsets = vec![0u64; mine.len()];
                    let mut next = 0;
                    while !mine.is_empty() && Instant::now() < deadline {
                        let i = next % mine.len();
                        next += 1;
                        if offsets[i] + buf.len() as u64 > ALLOCATED {
                            offsets[i] = 0;
                        }
                        mine[i].write_all_at(&buf, offsets[i])?;
                        mine[i].sync_data()?;
                        offsets[i] += buf.len() as u64;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        runs.into_iter()
            .filter_map(|r| r.join().ok().and_then(Result::err))
            .next()
    });
    let elapsed = began.elapsed().as_secs_f64();
    drop(opened);
    let _ = std::fs::remove_dir_all(dir);
    if let Some(error) = failed {
        return Err(format!("raw syncs in {}: {error}", dir.display()).into());
    }
    Ok(done.load(Ordering::Relaxed) as f64 / elapsed)
}

/// One producer: up to `in_flight` confirmed publishes, round robin over `queues`, for
/// `duration`: messages confirmed per second.
async fn produce(
    client: &Client,
    queues: &[String],
    body: &Bytes,
    in_flight: usize,
    duration: Duration,
) -> BenchResult<f64> {
    let began = Instant::now();
    let deadline = began + duration;
    let mut pending = FuturesUnordered::new();
    let (mut next, mut confirmed) = (0usize, 0u64);
    loop {
        if Instant::now() < deadline {
            while pending.len() < in_flight {
                let queue = &queues[next % queues.len()];
                next += 1;
                pending.push(client.publish(queue, OutgoingMessage::new(body.clone())));
            }
        }
        match pending.next().await {
            None => break,
            Some(result) => {
                result.map_err(|e| format!("publish: {e}"))?;
                confirmed += 1;
            }
        }
    }
    Ok(confirmed as f64 / began.elapsed().as_secs_f64())
}

/// Every client produces to its set of queues at once: the sum of their rates.
async fn run_load(
    clients: &[Client],
    sets: &[Vec<String>],
    body: &Bytes,
    config: &IdleConfig,
) -> BenchResult<f64> {
    let runs = clients
        .iter()
        .zip(sets)
        .map(|(client, queues)| produce(client, queues, body, config.in_flight, config.duration));
    let mut total = 0.0;
    for rate in futures_util::future::join_all(runs).await {
        total += rate?;
    }
    Ok(total)
}

/// `producers` producers (a connection each) on `producers` queues, against the same producers
/// spread round robin over `spread` queues; rounds alternate which goes first. Returns the
/// rates of both per round and the per-round ratios (spread / four).
async fn spread_case(
    config: &IdleConfig,
    spread: usize,
) -> BenchResult<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let addr = config.endpoints.keratin.ok_or("pass --keratin")?;
    let producers = config.producers.max(1);
    let mut clients = Vec::with_capacity(producers);
    for _ in 0..producers {
        clients.push(Client::connect(addr, ClientOptions::default()).await?);
    }
    let body = Bytes::from(vec![0x6b_u8; config.body_bytes]);
    let few: Vec<Vec<String>> = (0..producers).map(|p| vec![queue_name(p)]).collect();
    let many: Vec<Vec<String>> = (0..producers)
        .map(|p| (p..spread).step_by(producers).map(queue_name).collect())
        .collect();
    if many.iter().any(Vec::is_empty) {
        return Err(format!("spread over {spread} queues needs at least {producers}").into());
    }
    let (mut fours, mut spreads, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..config.rounds.max(1) {
        let (four, wide) = if round % 2 == 0 {
            let four = run_load(&clients, &few, &body, config).await?;
            (four, run_load(&clients, &many, &body, config).await?)
        } else {
            let wide = run_load(&clients, &many, &body, config).await?;
            (run_load(&clients, &few, &body, config).await?, wide)
        };
        eprintln!(
            "  keratin confirmed publish, {producers} producers: {four:.0} msg/s on {producers} \
             queues, {wide:.0} msg/s over {spread} queues ({:.2})",
            wide / four
        );
        fours.push(four);
        spreads.push(wide);
        ratios.push(wide / four);
    }
    for client in clients {
        client.close().await;
    }
    Ok((fours, spreads, ratios))
}

// ---------------------------------------------------------------------------------------------
// The report.

/// A figure of one system, if measured.
fn figure(value: &Value, key: &str) -> Option<f64> {
    value[key].as_f64()
}

fn per_queue(value: &Value, key: &str, fresh: &str) -> Option<f64> {
    let queues = value["queues"].as_f64()?;
    let grown = (figure(value, key)? - figure(value, fresh).unwrap_or(0.0)).max(0.0);
    (queues > 0.0).then(|| grown / queues)
}

fn report(config: &IdleConfig) -> BenchResult<()> {
    let mut systems: Vec<(String, Value)> = config
        .files
        .iter()
        .map(|f| read_json(f))
        .filter_map(|v| v["system"].as_str().map(|s| (s.to_string(), v.clone())))
        .collect();
    systems.sort_by_key(|(name, _)| {
        System::parse(name).map_or(usize::MAX, |s| {
            System::ALL
                .iter()
                .position(|x| *x == s)
                .unwrap_or(usize::MAX)
        })
    });
    let keratin = systems
        .iter()
        .find(|(n, _)| n == "keratin")
        .map(|(_, v)| v.clone());
    let peers: Vec<&(String, Value)> = systems.iter().filter(|(n, _)| n != "keratin").collect();
    type Row = (&'static str, fn(&Value) -> Option<f64>, fn(f64) -> String);
    let rows: [Row; 10] = [
        (
            "queues declared",
            |v| figure(v, "queues"),
            |x| format!("{x:.0}"),
        ),
        (
            "declare rate (queues/s)",
            |v| figure(v, "declare_rate"),
            |x| format!("{x:.0}"),
        ),
        (
            "disk used after (MB, du of the data dir)",
            |v| figure(v, "disk").map(|b| b / 1e6),
            |x| format!("{x:.1}"),
        ),
        (
            "disk per queue (KiB)",
            |v| per_queue(v, "disk", "disk_fresh").map(|b| b / 1024.0),
            |x| format!("{x:.1}"),
        ),
        (
            "resident memory after (MB)",
            |v| figure(v, "rss").map(|b| b / 1e6),
            |x| format!("{x:.1}"),
        ),
        (
            "resident memory per queue (KiB, growth from fresh)",
            |v| per_queue(v, "rss", "rss_fresh").map(|b| b / 1024.0),
            |x| format!("{x:.2}"),
        ),
        (
            "OS threads fresh",
            |v| figure(v, "threads_fresh"),
            |x| format!("{x:.0}"),
        ),
        (
            "OS threads with the queues",
            |v| figure(v, "threads"),
            |x| format!("{x:.0}"),
        ),
        (
            "restart until all usable (s)",
            |v| figure(v, "restart_s"),
            |x| format!("{x:.2}"),
        ),
        (
            "resident memory after restart (MB)",
            |v| figure(v, "rss_restarted").map(|b| b / 1e6),
            |x| format!("{x:.1}"),
        ),
    ];
    let mut md = String::new();
    let names: Vec<&str> = systems.iter().map(|(n, _)| n.as_str()).collect();
    md.push_str(&format!("| figure | {} |", names.join(" | ")));
    for (peer, _) in &peers {
        md.push_str(&format!(" keratin / {peer} |"));
    }
    md.push('\n');
    md.push_str(&format!(
        "|{}\n",
        " --- |".repeat(1 + names.len() + peers.len())
    ));
    for (label, get, show) in rows {
        md.push_str(&format!("| {label} |"));
        for (_, value) in &systems {
            md.push_str(&format!(" {} |", get(value).map_or("-".into(), show)));
        }
        for (_, peer) in &peers {
            let ratio = keratin
                .as_ref()
                .and_then(get)
                .zip(get(peer))
                .filter(|(_, p)| *p > 0.0)
                .map_or("-".into(), |(k, p)| format!("{:.3}", k / p));
            md.push_str(&format!(" {ratio} |"));
        }
        md.push('\n');
    }
    md.push_str(
        "\nRatios are Keratin / peer: above 1 is better for the declare rate, below 1 is better \
         for every other row. Per-queue figures are the growth from the fresh broker divided by \
         the queues declared, so they compare across different counts.\n",
    );
    for (name, value) in &systems {
        md.push_str(&format!(
            "- {name}: {} queues declared by {} concurrent workers in {:.2} s; disk fresh {:.1} MB, \
             resident fresh {:.1} MB; {} checks retried after the restart; {} threads after the restart\n",
            value["queues"].as_u64().unwrap_or(0),
            value["concurrency"].as_u64().unwrap_or(0),
            figure(value, "declare_s").unwrap_or(f64::NAN),
            figure(value, "disk_fresh").unwrap_or(0.0) / 1e6,
            figure(value, "rss_fresh").unwrap_or(0.0) / 1e6,
            value["restart_retries"].as_u64().unwrap_or(0),
            figure(value, "threads_restarted").map_or("-".into(), |t| format!("{t:.0}")),
        ));
    }
    for (name, value) in &systems {
        if let (Some(after), Some(error)) = (
            figure(value, "restart_failed_after_s"),
            value["restart_error"].as_str(),
        ) {
            md.push_str(&format!(
                "- {name}: NOT every queue was usable {after:.0} s after the restart began \
                 (the check gave up): {error}\n"
            ));
        }
    }
    for note in &config.note {
        md.push_str(&format!("- {note}\n"));
    }
    if let Some(k) = &keratin {
        md.push_str("\nGoals (issue 13, ratios in this run):\n");
        let goal = |met: bool| if met { "met" } else { "MISSED" };
        if let Some(per) = per_queue(k, "disk", "disk_fresh") {
            md.push_str(&format!(
                "- disk per idle queue {:.1} KiB (goal <= {} KiB): {}\n",
                per / 1024.0,
                GOAL_DISK_PER_QUEUE / 1024,
                goal(per <= GOAL_DISK_PER_QUEUE as f64)
            ));
        }
        if let (Some(per), Some((_, nats))) = (
            per_queue(k, "rss", "rss_fresh"),
            peers.iter().find(|(n, _)| n == "nats"),
        ) {
            if let Some(theirs) = per_queue(nats, "rss", "rss_fresh") {
                md.push_str(&format!(
                    "- resident memory per idle queue {:.2} KiB, NATS {:.2} KiB per stream: {}\n",
                    per / 1024.0,
                    theirs / 1024.0,
                    goal(per <= theirs)
                ));
            }
        }
        if let (Some(fresh), Some(after)) = (figure(k, "threads_fresh"), figure(k, "threads")) {
            md.push_str(&format!(
                "- threads {fresh:.0} fresh, {after:.0} with {} queues (goal: independent of the count): {}\n",
                k["queues"].as_u64().unwrap_or(0),
                goal(after <= fresh + 8.0)
            ));
        }
        if let Some(rate) = figure(k, "declare_rate") {
            let best = peers
                .iter()
                .filter_map(|(n, v)| figure(v, "declare_rate").map(|r| (n.as_str(), r)))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((name, theirs)) = best {
                md.push_str(&format!(
                    "- declare rate {rate:.0}/s vs the fastest peer ({name}) {theirs:.0}/s: {:.2} (goal >= 1): {}\n",
                    rate / theirs,
                    goal(rate >= theirs)
                ));
            }
        }
        if let Some(restart) = figure(k, "restart_s") {
            md.push_str(&format!(
                "- restart with {} queues {restart:.2} s (goal <= {} s with 10,000): {}\n",
                k["queues"].as_u64().unwrap_or(0),
                GOAL_RESTART.as_secs(),
                goal(restart <= GOAL_RESTART.as_secs_f64())
            ));
        }
        if let Some(ratios) = k["spread_ratios"].as_array() {
            let ratios: Vec<f64> = ratios.iter().filter_map(Value::as_f64).collect();
            let rates = |key: &str| -> Vec<f64> {
                k[key]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default()
            };
            let (four, many) = (rates("spread_four"), rates("spread_many"));
            let spread = k["spread_queues"].as_u64().unwrap_or(0);
            let show = |v: &[f64]| {
                v.iter()
                    .map(|x| format!("{x:.0}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let ratio = median(&ratios);
            md.push_str(&format!(
                "- confirmed publish spread over {spread} queues / the same load on 4 queues: \
                 {ratio:.2} (goal >= {GOAL_SPREAD}): {}; msg/s per round, 4 queues: {}; {spread} \
                 queues: {}\n",
                goal(ratio >= GOAL_SPREAD),
                show(&four),
                show(&many)
            ));
            for raw in k["spread_raw_syncs"].as_array().into_iter().flatten() {
                if let (Some(threads), Some(rate)) =
                    (raw["threads"].as_u64(), raw["syncs_per_s"].as_f64())
                {
                    md.push_str(&format!(
                        "  - raw disk, same run: {rate:.0} write+fdatasync/s over {spread} files \
                         with {threads} threads; the spread's {:.0} msg/s are {:.1} messages \
                         per such sync, the 4-queue rate would need {:.1}\n",
                        median(&many),
                        median(&many) / rate,
                        median(&four) * GOAL_SPREAD / rate
                    ));
                }
            }
        }
    }
    print!("{md}");
    if let Some(out) = &config.out {
        std::fs::write(out, &md)?;
    }
    Ok(())
}
