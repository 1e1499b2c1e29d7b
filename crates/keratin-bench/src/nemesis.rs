//! `keratin-bench nemesis`: 3 or 5 real `keratin serve` processes on 127.0.0.1, a workload of
//! producers and consumers through different nodes, the seeded fault schedule of
//! `nemesis_schedule` played on the processes, then healing, draining and the checks of
//! `nemesis_check`; a table per fault kind, and a non-zero exit with the replay command on any
//! violation (docs/reliability.md).
//!
//! - `Nodes`: the processes, each with its data directory under one run directory, fixed
//!   addresses over restarts; killed (by the PIDs it started) and the directory removed (unless
//!   `--keep`) when dropped, on every way out, a panic included.
//! - The workload: queue [`QUEUE`] of 3 partitions × 3 replicas with dead-letter queue [`DLQ`]
//!   and `max_deliveries` [`MAX_DELIVERIES`]; an idempotent producer starting on node 1, a
//!   non-idempotent one on node 2, an acking consumer on node 3, and one that requeues some
//!   messages on the last node; every one of them moves to the next node when its own fails.
//!   Poison messages (`nemesis_check::poison`) are rejected with requeue by every consumer
//!   until they are dead-lettered.
//! - Between faults the runner waits until every partition of both queues has one leader and
//!   every partition of the queue confirmed a publish sent after the fault ([`RECOVERY_MAX`]
//!   each); longer is a stall.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};

use crate::contender::BenchResult;
use crate::nemesis_check::{
    check, decode_body, encode_body, poison, Findings, MsgKey, Producer, Published, QueueKind,
    Seen, Settle,
};
use crate::nemesis_schedule::{schedule, Damage, FaultKind, Rng, Step};

const QUEUE: &str = "nemesis";
const DLQ: &str = "nemesis-dlq";
const PARTITIONS: u32 = 3;
const REPLICAS: u32 = 3;
/// A message delivered this many times and rejected again goes to [`DLQ`].
const MAX_DELIVERIES: u32 = 3;
/// The idempotent producer's id, and the after-healing probe's.
const PRODUCER_ID: u64 = 0x6e65_6d65_7369_7331;
const PROBE_ID: u64 = 0x6e65_6d65_7369_7332;
/// Messages per publish batch, and the pause between batches: about 2 × 200 messages/s, modest
/// on a shared 2-core machine.
const BATCH: u64 = 10;
const BATCH_PAUSE: Duration = Duration::from_millis(50);
/// Unsettled deliveries per consumer and node.
const PREFETCH: u32 = 16;
/// A node prints its addresses within this of its start, or the start failed.
const START_MAX: Duration = Duration::from_secs(30);
/// After a fault is healed: the leaders, then every partition's confirm of a publish sent
/// after the fault, within this each; longer is a stall.
const RECOVERY_MAX: Duration = Duration::from_secs(30);
/// Setting up (declares, first leaders) within this.
const SETUP_MAX: Duration = Duration::from_secs(60);
/// Draining: a pass over a queue ends after this long without a delivery; the whole drain of
/// both queues within [`DRAIN_MAX`].
const DRAIN_IDLE: Duration = Duration::from_secs(3);
const DRAIN_MAX: Duration = Duration::from_secs(180);
/// Steps the schedule is generated for; a run ends at its time first (a step takes seconds).
const STEPS_MAX: usize = 10_000;
/// Ports nodes listen on: below Linux's ephemeral range, so that no client's outgoing
/// connection holds a node's port when the node restarts and binds it again.
const NODE_PORTS: std::ops::Range<u16> = 20_000..32_000;
/// Client timeouts: a connect, a request and a publish give up after these.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// Disk thresholds for nodes on the host's disk (tiny fractions): a run is about faults, not
/// about how full the machine's disk happens to be.
const HOST_DISK_LIMITS: &[(&str, &str)] = &[
    ("KERATIN_LIMITS__DISK__SOFT_FRACTION", "0.002"),
    ("KERATIN_LIMITS__DISK__HARD_FRACTION", "0.001"),
    ("KERATIN_LIMITS__DISK__RESERVE_FRACTION", "0.0005"),
    ("KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES", "268435456"),
    ("KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES", "134217728"),
    ("KERATIN_LIMITS__DISK__RESERVE_FLOOR_BYTES", "67108864"),
];

/// What `keratin-bench nemesis` was asked to do.
#[derive(Debug, Clone)]
pub struct NemesisConfig {
    pub nodes: usize,
    pub seed: u64,
    pub seconds: u64,
    pub faults: Vec<FaultKind>,
    /// The `keratin` binary.
    pub keratin: PathBuf,
    /// Keep the run directory here (data directories and node logs) instead of a temporary
    /// one removed at the end.
    pub keep: Option<PathBuf>,
}

impl NemesisConfig {
    /// The command that plays this run again.
    pub fn replay_command(&self) -> String {
        format!(
            "keratin-bench nemesis --nodes {} --seed {} --seconds {} --faults {} --keratin {}",
            self.nodes,
            self.seed,
            self.seconds,
            fault_names(&self.faults),
            self.keratin.display()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The processes.

/// One node: fixed addresses and data directory, its process while it runs.
struct Node {
    id: u64,
    protocol: SocketAddr,
    http: SocketAddr,
    cluster: SocketAddr,
    dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// Every node of the run; kills what still runs and removes the run directory when dropped.
struct Nodes {
    root: PathBuf,
    keep: bool,
    keratin: PathBuf,
    nodes: Vec<Node>,
}

/// A free port on 127.0.0.1 in [`NODE_PORTS`], starting at a place picked by `rng`.
fn free_addr(rng: &mut Rng, taken: &[SocketAddr]) -> BenchResult<SocketAddr> {
    let span = u64::from(NODE_PORTS.end - NODE_PORTS.start);
    for _ in 0..span {
        let port = NODE_PORTS.start + u16::try_from(rng.below(span)).unwrap_or(0);
        if taken.iter().any(|a| a.port() == port) {
            continue;
        }
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return Ok(listener.local_addr()?);
        }
    }
    Err(format!("no free port on 127.0.0.1 in {NODE_PORTS:?}").into())
}

impl Nodes {
    fn new(config: &NemesisConfig) -> BenchResult<Nodes> {
        let (root, keep) = match &config.keep {
            Some(dir) => (dir.clone(), true),
            None => (
                std::env::temp_dir().join(format!(
                    "keratin-nemesis-{}-{}",
                    std::process::id(),
                    config.seed
                )),
                false,
            ),
        };
        std::fs::create_dir_all(&root)
            .map_err(|e| format!("create the run directory {}: {e}", root.display()))?;
        // Ports from the process id, not the seed: two runs of one seed side by side differ.
        let mut rng = Rng::new(u64::from(std::process::id()));
        let mut taken = Vec::new();
        let mut nodes = Vec::new();
        for id in 1..=config.nodes as u64 {
            let mut addr = || -> BenchResult<SocketAddr> {
                let a = free_addr(&mut rng, &taken)?;
                taken.push(a);
                Ok(a)
            };
            let (protocol, http, cluster) = (addr()?, addr()?, addr()?);
            nodes.push(Node {
                id,
                protocol,
                http,
                cluster,
                dir: root.join(format!("node-{id}")),
                log: root.join(format!("node-{id}.log")),
                child: None,
            });
        }
        Ok(Nodes {
            root,
            keep,
            keratin: config.keratin.clone(),
            nodes,
        })
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(|n| n.protocol).collect()
    }

    /// Starts node `index` (0-based) and waits for its address line.
    fn start(&mut self, index: usize) -> BenchResult<()> {
        let peers: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}={}", n.id, n.cluster))
            .collect();
        let node = &mut self.nodes[index];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .map_err(|e| format!("open {}: {e}", node.log.display()))?;
        let mut command = Command::new(&self.keratin);
        command
            .arg("serve")
            .arg("--data-dir")
            .arg(&node.dir)
            .args(["--listen", &node.protocol.to_string()])
            .args(["--http", &node.http.to_string()])
            .args(["--node-id", &node.id.to_string()]);
        for peer in &peers {
            command.args(["--peer", peer]);
        }
        command
            .env("KERATIN_SERVER__AUTH", "none")
            .env("KERATIN_CLUSTER__LEADER_BALANCE", "true")
            .env(
                "KERATIN_LOG",
                std::env::var("KERATIN_NEMESIS_NODE_LOG")
                    .unwrap_or_else(|_| "info,openraft=error".into()),
            )
            .envs(HOST_DISK_LIMITS.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = command
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.keratin.display()))?;
        let stdout = child.stdout.take();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let Some(stdout) = stdout else { return };
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining so the node never blocks on a full pipe.
            for _ in lines {}
        });
        let id = node.id;
        node.child = Some(child);
        match rx.recv_timeout(START_MAX) {
            Ok(line) if line.contains("protocol=") => Ok(()),
            outcome => {
                // A node that exits closes its output before it can be reaped: give it a
                // moment so that its exit status is known.
                let mut status = None;
                for _ in 0..20 {
                    status = node
                        .child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten());
                    if status.is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                self.kill(index);
                Err(format!(
                    "node {id} did not start (printed {:?}, exit status {status:?}); its log: {}",
                    outcome.ok(),
                    self.nodes[index].log.display()
                )
                .into())
            }
        }
    }

    /// `kill -9` node `index` (by the PID it was started with) and reap it.
    fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.nodes[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (`-STOP`, `-CONT`) to node `index`'s process.
    fn signal(&self, index: usize, signal: &str) -> BenchResult<()> {
        let pid = self.nodes[index]
            .child
            .as_ref()
            .ok_or_else(|| format!("node {} is not running", index + 1))?
            .id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()?;
        if !status.success() {
            return Err(format!("kill {signal} {pid}: {status}").into());
        }
        Ok(())
    }

    /// Lines with "panicked at" in the nodes' logs (a panic on a node's thread need not end
    /// it), at most 10.
    fn panics(&self) -> Vec<String> {
        let mut found = Vec::new();
        for node in &self.nodes {
            let Ok(file) = std::fs::File::open(&node.log) else {
                continue;
            };
            for line in BufReader::new(file).lines().map_while(Result::ok) {
                if line.contains("panicked at") && found.len() < 10 {
                    found.push(format!("node {}: {line}", node.id));
                }
            }
        }
        found
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for index in 0..self.nodes.len() {
            // SIGKILL ends a stopped process as well.
            self.kill(index);
        }
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Damage to a segment file.

/// Every `*.seg` file under `dir`, sorted.
fn segment_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            segment_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "seg") {
            out.push(path);
        }
    }
    out.sort();
}

/// Damages one segment file of `dir` as `damage` says, at a place `pick` chooses within its
/// written part (up to its last non-zero byte); what it did.
fn corrupt_segment(dir: &Path, damage: Damage, pick: u64) -> BenchResult<String> {
    let mut files = Vec::new();
    segment_files(dir, &mut files);
    // Only files with something written past their 64-byte header.
    let mut written = Vec::new();
    for file in files {
        let mut bytes = Vec::new();
        std::fs::File::open(&file)?.read_to_end(&mut bytes)?;
        let end = bytes.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
        if end > 64 {
            written.push((file, end));
        }
    }
    if written.is_empty() {
        return Ok(format!("no written segment file under {}", dir.display()));
    }
    let (file, end) = &written[(pick % written.len() as u64) as usize];
    let end = *end as u64;
    let at = 64 + (pick >> 8) % (end - 64);
    let mut handle = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)?;
    let what = match damage {
        Damage::BitFlip => {
            let mut byte = [0u8; 1];
            handle.seek(SeekFrom::Start(at))?;
            handle.read_exact(&mut byte)?;
            byte[0] ^= 1 << (pick % 8);
            handle.seek(SeekFrom::Start(at))?;
            handle.write_all(&byte)?;
            format!("flipped bit {} of byte {at}", pick % 8)
        }
        Damage::Truncate => {
            handle.set_len(at)?;
            format!("truncated to {at} bytes (written part {end})")
        }
        Damage::ZeroTail => {
            let from = end.saturating_sub(4096).max(64);
            handle.seek(SeekFrom::Start(from))?;
            handle.write_all(&vec![0u8; (end - from) as usize])?;
            format!("zeroed bytes {from}..{end}")
        }
    };
    handle.sync_all()?;
    Ok(format!("{}: {what}", file.display()))
}

// ---------------------------------------------------------------------------------------------
// The workload.

/// What the producers and consumers saw, shared.
/// Bounded by the run: at about 400 messages/s ([`BATCH`] every [`BATCH_PAUSE`] per producer)
/// and a few deliveries each, a 10-minute run holds about 240,000 publishes and 600,000
/// deliveries, some tens of MiB.
#[derive(Default)]
struct Ledger {
    published: BTreeMap<MsgKey, PubState>,
    /// Each confirm: when its attempt was sent, when it came back, and the partition for the
    /// idempotent producer's (known from its id and sequence, [`idempotent_partition`]).
    confirms: Vec<(Instant, Instant, Option<u32>)>,
    seen: Vec<Seen>,
    /// Each producer's last failed publish (when, which, through which node, why): for the
    /// report of a stall.
    last_errors: BTreeMap<Producer, String>,
}

struct PubState {
    first_sent: Instant,
    confirmed: bool,
    attempts: u32,
}

struct Shared {
    addrs: Vec<SocketAddr>,
    ledger: Mutex<Ledger>,
    stop_producers: AtomicBool,
    stop_consumers: AtomicBool,
    sessions: AtomicU64,
    /// When the run began (times in the report count from here).
    began: Instant,
}

impl Shared {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        // A panicking task leaves the ledger as it was: keep using it.
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn options(name: &str, producer_id: Option<u64>, idempotent: bool) -> ClientOptions {
    ClientOptions {
        name: name.into(),
        connect_timeout: CONNECT_TIMEOUT,
        request_timeout: PUBLISH_TIMEOUT,
        publish_timeout: PUBLISH_TIMEOUT,
        idempotent,
        producer_id,
        ..ClientOptions::default()
    }
}

/// A client of the first node from `start` on (round the list) that answers.
async fn connect_from(
    addrs: &[SocketAddr],
    start: usize,
    options: &ClientOptions,
) -> Option<Client> {
    for k in 0..addrs.len() {
        let addr = addrs[(start + k) % addrs.len()];
        if let Ok(client) = Client::connect(addr, options.clone()).await {
            return Some(client);
        }
    }
    None
}

/// Publishes batches until stopped, starting on node `first`; on a failure it moves to the
/// next node and sends the failed messages again (same sequences: the idempotent producer's
/// retries are stored once; the plain producer's may be stored twice).
async fn producer(shared: Arc<Shared>, producer: Producer, first: usize) {
    let idempotent = producer.idempotent();
    let options = options(
        &format!("nemesis {producer:?}"),
        idempotent.then_some(PRODUCER_ID),
        idempotent,
    );
    let mut turn = first;
    let mut client: Option<Client> = None;
    let mut next = 1u64;
    let mut pending: Vec<u64> = Vec::new();
    while !shared.stop_producers.load(Ordering::Relaxed) {
        let Some(c) = client.clone() else {
            client = connect_from(&shared.addrs, turn, &options).await;
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        if pending.is_empty() {
            pending = (next..next + BATCH).collect();
            next += BATCH;
        }
        let sent = Instant::now();
        {
            let mut ledger = shared.ledger();
            for seq in &pending {
                let state = ledger
                    .published
                    .entry((producer, *seq))
                    .or_insert(PubState {
                        first_sent: sent,
                        confirmed: false,
                        attempts: 0,
                    });
                state.attempts += 1;
            }
        }
        let messages: Vec<OutgoingMessage> = pending
            .iter()
            .map(|seq| {
                let message = OutgoingMessage::new(encode_body((producer, *seq)));
                if idempotent {
                    message.with_sequence(*seq)
                } else {
                    message
                }
            })
            .collect();
        let results = c.publish_batch(QUEUE, messages).await;
        let mut failed = Vec::new();
        {
            let mut ledger = shared.ledger();
            for (seq, result) in pending.iter().zip(results) {
                match result {
                    Ok(_) => {
                        if let Some(state) = ledger.published.get_mut(&(producer, *seq)) {
                            state.confirmed = true;
                        }
                        let partition = idempotent.then(|| idempotent_partition(*seq));
                        ledger.confirms.push((sent, Instant::now(), partition));
                    }
                    Err(error) => {
                        if failed.is_empty() {
                            ledger.last_errors.insert(
                                producer,
                                format!(
                                    "at {} ms, sequence {seq}, via node {}: {}",
                                    shared.began.elapsed().as_millis(),
                                    c.node_id(),
                                    error.error
                                ),
                            );
                        }
                        failed.push(*seq);
                    }
                }
            }
        }
        pending = failed;
        if !pending.is_empty() {
            client = None;
            turn += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        } else {
            tokio::time::sleep(BATCH_PAUSE).await;
        }
    }
}

/// How a consumer settles a delivery that is not poison (poison is always requeued).
#[derive(Clone, Copy)]
enum Policy {
    AckAll,
    /// Requeue one in 7 first deliveries, ack the rest.
    RequeueSome,
}

/// Consumes `queue` until `stop`, starting on node `first`, resubscribing through the next
/// node when the subscription ends; when `idle_end` is given, also ends after that long
/// without a delivery. How many deliveries it saw.
async fn consume(
    shared: &Shared,
    queue: QueueKind,
    first: usize,
    policy: Policy,
    stop: &AtomicBool,
    idle_end: Option<Duration>,
) -> u64 {
    let name = match queue {
        QueueKind::Main => QUEUE,
        QueueKind::DeadLetter => DLQ,
    };
    let options = options("nemesis consumer", None, true);
    let mut turn = first;
    let mut count = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Some(client) = connect_from(&shared.addrs, turn, &options).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(mut consumer) = client.subscribe(name, PREFETCH).await else {
            turn += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let session = shared.sessions.fetch_add(1, Ordering::Relaxed);
        let mut last = Instant::now();
        loop {
            let delivery =
                match tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await {
                    Ok(Some(delivery)) => delivery,
                    Ok(None) => break,
                    Err(_) => {
                        let idle = idle_end.is_some_and(|idle| last.elapsed() >= idle);
                        if stop.load(Ordering::Relaxed) || idle {
                            let _ = tokio::time::timeout(PUBLISH_TIMEOUT, consumer.cancel()).await;
                            client.close().await;
                            return count;
                        }
                        continue;
                    }
                };
            last = Instant::now();
            count += 1;
            let key = decode_body(&delivery.body);
            let requeue = key.is_some_and(|(_, seq)| {
                queue == QueueKind::Main
                    && (poison(seq)
                        || matches!(policy, Policy::RequeueSome)
                            && !delivery.redelivered
                            && seq % 7 == 3)
            });
            let settle = match if requeue {
                delivery.reject(true).map(|()| Settle::Requeue)
            } else {
                delivery.ack().map(|()| Settle::Ack)
            } {
                Ok(settle) => settle,
                Err(_) => Settle::None,
            };
            shared.ledger().seen.push(Seen {
                queue,
                session,
                key,
                partition: delivery.partition,
                offset: delivery.offset,
                redelivered: delivery.redelivered,
                settle,
                at_ms: shared.began.elapsed().as_millis() as u64,
                delivery_count: delivery.delivery_count,
            });
        }
        turn += 1;
    }
    count
}

// ---------------------------------------------------------------------------------------------
// Leaders and recovery.

/// The leader of each partition of `queue` when every running node answers and agrees: each
/// partition has exactly one running node saying it leads it, and no running node names
/// another leader; otherwise what disagreed (for the report of a stall).
async fn leaders(addrs: &[SocketAddr], running: &[bool], queue: &str) -> Result<Vec<u64>, String> {
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..ClientOptions::default()
    };
    let mut views = Vec::new();
    for (index, addr) in addrs.iter().enumerate() {
        if !running[index] {
            continue;
        }
        let id = index as u64 + 1;
        let client = Client::connect(*addr, options.clone())
            .await
            .map_err(|e| format!("{queue}: node {id} does not answer: {e}"))?;
        let info = client.info(queue).await;
        client.close().await;
        let info = info.map_err(|e| format!("{queue}: node {id} answers no info: {e}"))?;
        views.push((id, info.partitions));
    }
    let count = views.first().map_or(0, |(_, ps)| ps.len());
    if count == 0 || views.iter().any(|(_, ps)| ps.len() != count) {
        return Err(format!(
            "{queue}: the nodes list different partition counts"
        ));
    }
    (0..count)
        .map(|p| {
            let leading: Vec<u64> = views
                .iter()
                .filter(|(_, ps)| ps[p].leading)
                .map(|(id, _)| *id)
                .collect();
            let named: Vec<(u64, Option<u64>)> =
                views.iter().map(|(id, ps)| (*id, ps[p].leader)).collect();
            let disagree = || {
                format!(
                    "{queue} partition {p}: nodes saying they lead it {leading:?}; leader \
                     each node names (node, leader) {named:?}"
                )
            };
            let [leader] = leading[..] else {
                return Err(disagree());
            };
            if named.iter().all(|(_, l)| l.is_none_or(|l| l == leader)) {
                Ok(leader)
            } else {
                Err(disagree())
            }
        })
        .collect()
}

/// Waits up to `within` for agreed leaders of both queues; how long it took, or the last
/// disagreement seen.
async fn wait_leaders(
    addrs: &[SocketAddr],
    running: &[bool],
    within: Duration,
) -> Result<Duration, String> {
    let began = Instant::now();
    loop {
        let agreed = match leaders(addrs, running, QUEUE).await {
            Ok(_) => leaders(addrs, running, DLQ).await.map(|_| ()),
            Err(e) => Err(e),
        };
        match agreed {
            Ok(()) => return Ok(began.elapsed()),
            Err(last) if began.elapsed() >= within => return Err(last),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The partition of the idempotent producer's message `seq`: it has no routing key, so the
/// client and the broker route it by `(producer id + sequence / block) mod partitions`.
fn idempotent_partition(seq: u64) -> u32 {
    let block = PRODUCER_ID.wrapping_add(seq / keratin_client::PRODUCER_SEQUENCE_BLOCK);
    (block % u64::from(PARTITIONS)) as u32
}

/// Waits up to `within` from now until every partition of the queue confirmed a publish of the
/// idempotent producer sent after `since` (it writes 64 messages to one partition, then 64 to
/// the next, so a partition that takes no publish stops it); the time from `since` to the
/// last partition's first such confirm, or `None`.
async fn wait_confirm_after(shared: &Shared, since: Instant, within: Duration) -> Option<Duration> {
    let deadline = Instant::now() + within;
    loop {
        let firsts: Option<Vec<Instant>> = {
            let ledger = shared.ledger();
            (0..PARTITIONS)
                .map(|p| {
                    ledger
                        .confirms
                        .iter()
                        .filter(|(sent, _, partition)| *sent >= since && *partition == Some(p))
                        .map(|(_, at, _)| *at)
                        .min()
                })
                .collect()
        };
        if let Some(last) = firsts.and_then(|f| f.into_iter().max()) {
            return Some(last.saturating_duration_since(since));
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The run.

/// One fault as played: when it began, its kind, how the cluster came back.
struct Played {
    began: Instant,
    kind: FaultKind,
    /// Fault start until every partition confirmed a publish sent after it.
    recovered: Option<Duration>,
    stalled: bool,
}

/// Runs `blocking` on the runtime's thread without stalling the other tasks.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Plays one step on `nodes`; notes of what happened (restart failures are stalls).
async fn play(nodes: &Mutex<Nodes>, step: &Step, notes: &mut Vec<String>) -> BenchResult<bool> {
    let lock = || nodes.lock().unwrap_or_else(|e| e.into_inner());
    let mut stalled = false;
    match step.kind {
        FaultKind::Pause => {
            let victim = step.victims[0];
            blocking(|| lock().signal(victim, "-STOP"))?;
            tokio::time::sleep(step.down).await;
            blocking(|| lock().signal(victim, "-CONT"))?;
        }
        kind => {
            blocking(|| {
                let mut nodes = lock();
                for v in &step.victims {
                    nodes.kill(*v);
                }
            });
            if kind == FaultKind::Wipe {
                let dir = lock().nodes[step.victims[0]].dir.clone();
                let _ = std::fs::remove_dir_all(&dir);
            }
            if kind == FaultKind::Corrupt {
                for v in &step.victims {
                    let dir = lock().nodes[*v].dir.clone();
                    let what = corrupt_segment(&dir, step.damage, step.pick)?;
                    notes.push(format!("node {}: {what}", v + 1));
                }
            }
            tokio::time::sleep(step.down).await;
            for v in &step.victims {
                if let Err(error) = blocking(|| lock().start(*v)) {
                    // A node that refuses to start after a fault is a finding; an operator
                    // would replace its disk: wipe it and start it empty to go on.
                    stalled = true;
                    notes.push(format!(
                        "node {} did not restart after {}: {error}; wiped and restarted",
                        v + 1,
                        kind.name()
                    ));
                    let dir = lock().nodes[*v].dir.clone();
                    let _ = std::fs::remove_dir_all(&dir);
                    blocking(|| lock().start(*v))?;
                }
            }
        }
    }
    Ok(stalled)
}

/// The table: one row per fault kind (and "none" for messages published before the first
/// fault, "heal" for the after-healing checks).
#[derive(Default, Clone)]
struct Row {
    runs: u64,
    confirmed: u64,
    lost: u64,
    duplicates: u64,
    unknown_outcome_duplicates: u64,
    unflagged: u64,
    order: u64,
    dead_letter_missing: u64,
    phantoms: u64,
    stalls: u64,
    recover_ms: Vec<u64>,
}

fn render(rows: &BTreeMap<String, Row>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>4} {:>9} {:>5} {:>5} {:>7} {:>9} {:>6} {:>8} {:>8} {:>6} {:>10} {:>10}",
        "fault",
        "runs",
        "confirmed",
        "lost",
        "dups",
        "unk-dup",
        "unflagged",
        "order",
        "dlq-miss",
        "phantoms",
        "stalls",
        "recov-med",
        "recov-max"
    );
    for (name, row) in rows {
        let mut times = row.recover_ms.clone();
        times.sort_unstable();
        let median = times
            .get(times.len() / 2)
            .map_or("-".into(), |t| format!("{t} ms"));
        let max = times.last().map_or("-".into(), |t| format!("{t} ms"));
        let _ = writeln!(
            out,
            "{:<14} {:>4} {:>9} {:>5} {:>5} {:>7} {:>9} {:>6} {:>8} {:>8} {:>6} {:>10} {:>10}",
            name,
            row.runs,
            row.confirmed,
            row.lost,
            row.duplicates,
            row.unknown_outcome_duplicates,
            row.unflagged,
            row.order,
            row.dead_letter_missing,
            row.phantoms,
            row.stalls,
            median,
            max
        );
    }
    out
}

/// The fault kind whose window holds `at` (the last fault begun at or before it), or "none".
fn window_of(played: &[Played], at: Instant) -> String {
    played
        .iter()
        .rev()
        .find(|p| p.began <= at)
        .map_or("none".into(), |p| p.kind.name().into())
}

pub fn run(config: &NemesisConfig) -> BenchResult<()> {
    if !(config.nodes == 3 || config.nodes == 5) {
        return Err("--nodes must be 3 or 5".into());
    }
    if config.faults.is_empty() {
        return Err("--faults names no fault".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // SIGINT or SIGTERM end the run as an error would: the nodes are killed and the run
    // directory removed (unless --keep) by `Nodes`' drop, not left running.
    let result = runtime.block_on(async {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            result = run_async(config) => result,
            _ = tokio::signal::ctrl_c() => Err("interrupted (SIGINT); nodes killed".into()),
            _ = terminate.recv() => Err("terminated (SIGTERM); nodes killed".into()),
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    result
}

async fn run_async(config: &NemesisConfig) -> BenchResult<()> {
    let nodes = Mutex::new(Nodes::new(config)?);
    let lock = || nodes.lock().unwrap_or_else(|e| e.into_inner());
    let root = lock().root.clone();
    println!(
        "nemesis: {} nodes, seed {}, {} s, faults {}; run directory {}",
        config.nodes,
        config.seed,
        config.seconds,
        fault_names(&config.faults),
        root.display()
    );
    let began = Instant::now();
    for index in 0..config.nodes {
        blocking(|| lock().start(index))?;
    }
    let addrs = lock().addrs();
    declare_queues(&addrs).await?;
    let shared = Arc::new(Shared {
        addrs,
        ledger: Mutex::new(Ledger::default()),
        stop_producers: AtomicBool::new(false),
        stop_consumers: AtomicBool::new(false),
        sessions: AtomicU64::new(0),
        began,
    });
    let tasks = start_workload(&shared, config.nodes);
    if wait_confirm_after(&shared, Instant::now(), SETUP_MAX)
        .await
        .is_none()
    {
        return Err("no publish was confirmed after setting up".into());
    }
    // Some load before the first fault.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut notes: Vec<String> = Vec::new();
    let deadline = began + Duration::from_secs(config.seconds);
    let played = play_schedule(config, &nodes, &shared, deadline, &mut notes).await?;
    let heal = heal_and_drain(config.nodes, &shared, tasks, &mut notes).await;
    let panics = lock().panics();
    report(config, &root, &shared, &played, heal, &panics, &notes)
}

fn fault_names(faults: &[FaultKind]) -> String {
    faults
        .iter()
        .map(|f| f.name())
        .collect::<Vec<_>>()
        .join(",")
}

/// Declares the dead-letter queue, then the queue, through any node (the cluster may still be
/// electing its metadata leader), and waits for their leaders; within [`SETUP_MAX`].
async fn declare_queues(addrs: &[SocketAddr]) -> BenchResult<()> {
    let began = Instant::now();
    loop {
        let declared = async {
            let client = connect_from(addrs, 0, &options("nemesis setup", None, true))
                .await
                .ok_or("no node accepted a connection")?;
            let dlq = QueueSettings {
                partitions: 1,
                replicas: Some(REPLICAS),
                ..QueueSettings::default()
            };
            let queue = QueueSettings {
                partitions: PARTITIONS,
                replicas: Some(REPLICAS),
                dead_letter: Some(DLQ.into()),
                max_deliveries: Some(MAX_DELIVERIES),
                ..QueueSettings::default()
            };
            let result = match client.declare(DLQ, dlq).await {
                Ok(()) => client.declare(QUEUE, queue).await,
                Err(e) => Err(e),
            };
            client.close().await;
            result.map_err(|e| e.to_string())
        }
        .await;
        match declared {
            Ok(()) => break,
            Err(error) if began.elapsed() > SETUP_MAX => {
                return Err(format!("declaring the queues: {error}").into())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
    let all_running = vec![true; addrs.len()];
    if let Err(last) = wait_leaders(addrs, &all_running, SETUP_MAX).await {
        return Err(format!("the queues have no agreed leaders after setting up: {last}").into());
    }
    Ok(())
}

/// The producers (idempotent from node 1, plain from node 2) and the consumers (acking from
/// node 3, requeueing some from the last node).
fn start_workload(shared: &Arc<Shared>, nodes: usize) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = vec![
        tokio::spawn(producer(shared.clone(), Producer::Idempotent, 0)),
        tokio::spawn(producer(shared.clone(), Producer::Plain, 1)),
    ];
    for (first, policy) in [(2, Policy::AckAll), (nodes - 1, Policy::RequeueSome)] {
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            consume(
                &shared,
                QueueKind::Main,
                first,
                policy,
                &shared.stop_consumers,
                None,
            )
            .await;
        }));
    }
    tasks
}

/// Plays the seed's schedule until `deadline`, each step from a recovered cluster; a line per
/// step, notes of what went wrong.
async fn play_schedule(
    config: &NemesisConfig,
    nodes: &Mutex<Nodes>,
    shared: &Shared,
    deadline: Instant,
    notes: &mut Vec<String>,
) -> BenchResult<Vec<Played>> {
    let all_running = vec![true; config.nodes];
    let steps = schedule(config.seed, config.nodes, &config.faults, STEPS_MAX);
    let mut played: Vec<Played> = Vec::new();
    for (number, step) in steps.iter().enumerate() {
        if Instant::now() >= deadline {
            break;
        }
        let fault_began = Instant::now();
        let victims: Vec<usize> = step.victims.iter().map(|v| v + 1).collect();
        let mut step_notes = Vec::new();
        let mut stalled = play(nodes, step, &mut step_notes).await?;
        let leaders_in = wait_leaders(&shared.addrs, &all_running, RECOVERY_MAX).await;
        if let Err(last) = &leaders_in {
            step_notes.push(format!("no agreed leaders within {RECOVERY_MAX:?}: {last}"));
        }
        let leaders_in = leaders_in.ok();
        let recovered = wait_confirm_after(shared, fault_began, RECOVERY_MAX).await;
        if recovered.is_none() {
            let ledger = shared.ledger();
            let firsts: Vec<String> = (0..PARTITIONS)
                .map(|p| {
                    let first = ledger
                        .confirms
                        .iter()
                        .filter(|(sent, _, partition)| {
                            *sent >= fault_began && *partition == Some(p)
                        })
                        .map(|(_, at, _)| at.saturating_duration_since(fault_began).as_millis())
                        .min();
                    format!("partition {p}: {first:?} ms")
                })
                .collect();
            step_notes.push(format!(
                "not every partition confirmed within {RECOVERY_MAX:?} (first confirms after \
                 the fault: {}); the producers' last errors: {:?}",
                firsts.join(", "),
                ledger.last_errors
            ));
        }
        stalled |= leaders_in.is_none() || recovered.is_none();
        println!(
            "step {number}: {} nodes {victims:?} for {} ms: leaders {}, every partition \
             confirming {} after the fault{}",
            step.kind.name(),
            step.down.as_millis(),
            leaders_in.map_or("NOT back".into(), |d| format!(
                "back in {} ms",
                d.as_millis()
            )),
            recovered.map_or("NONE".into(), |d| format!("{} ms", d.as_millis())),
            if stalled { " STALL" } else { "" }
        );
        for note in &step_notes {
            println!("  {note}");
        }
        notes.extend(
            step_notes
                .into_iter()
                .map(|n| format!("step {number} ({}): {n}", step.kind.name())),
        );
        played.push(Played {
            began: fault_began,
            kind: step.kind,
            recovered,
            stalled,
        });
        tokio::time::sleep(step.gap).await;
    }
    Ok(played)
}

/// Heals and drains: every node runs (they do after each step); every partition of both
/// queues has one leader and accepts a publish within the bound (the "heal" row); then the
/// workload stops and passes over every node drain the queue (poison goes on to the
/// dead-letter queue) and then the dead-letter queue, until a whole round sees nothing.
async fn heal_and_drain(
    node_count: usize,
    shared: &Shared,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    notes: &mut Vec<String>,
) -> Row {
    let mut heal = Row {
        runs: 1,
        ..Row::default()
    };
    shared.stop_producers.store(true, Ordering::Relaxed);
    let all_running = vec![true; node_count];
    if let Err(last) = wait_leaders(&shared.addrs, &all_running, RECOVERY_MAX).await {
        heal.stalls += 1;
        notes.push(format!("after healing: no agreed leaders: {last}"));
    }
    let probe_began = Instant::now();
    heal.stalls += probe(shared, notes).await;
    heal.recover_ms
        .push(probe_began.elapsed().as_millis() as u64);

    // The workload's consumers take what is ready a little longer, then stop.
    tokio::time::sleep(Duration::from_secs(2)).await;
    shared.stop_consumers.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    }
    let drain_deadline = Instant::now() + DRAIN_MAX;
    let never = AtomicBool::new(false);
    for queue in [QueueKind::Main, QueueKind::DeadLetter] {
        loop {
            let mut round = 0;
            for first in 0..node_count {
                round += consume(
                    shared,
                    queue,
                    first,
                    Policy::AckAll,
                    &never,
                    Some(DRAIN_IDLE),
                )
                .await;
            }
            if round == 0 || Instant::now() >= drain_deadline {
                break;
            }
        }
    }
    heal
}

/// Checks the ledger, prints the table, and fails with the replay command on any violation.
fn report(
    config: &NemesisConfig,
    root: &Path,
    shared: &Shared,
    played: &[Played],
    heal: Row,
    panics: &[String],
    notes: &[String],
) -> BenchResult<()> {
    let (published, seen, by_window) = {
        let ledger = shared.ledger();
        let published: Vec<Published> = ledger
            .published
            .iter()
            .map(|(key, state)| Published {
                key: *key,
                confirmed: state.confirmed,
                attempts: state.attempts,
            })
            .collect();
        let by_window: HashMap<MsgKey, String> = ledger
            .published
            .iter()
            .map(|(key, state)| {
                let window = if key.0 == Producer::Probe {
                    "heal".into()
                } else {
                    window_of(played, state.first_sent)
                };
                (*key, window)
            })
            .collect();
        (published, ledger.seen.clone(), by_window)
    };
    let findings = check(&published, &seen);
    let rows = table(played, &published, &findings, &by_window, heal);
    println!();
    print!("{}", render(&rows));
    println!(
        "published {}, deliveries seen {}, unknown-outcome duplicates (allowed) {}",
        published.len(),
        seen.len(),
        findings.unknown_outcome_duplicates.len()
    );
    for panic in panics {
        println!("PANIC in a node's log: {panic}");
    }
    let stalls: u64 = rows.values().map(|r| r.stalls).sum();
    let violations = findings.violations() as u64 + stalls + panics.len() as u64;
    if violations == 0 {
        println!("no violations (seed {})", config.seed);
        return Ok(());
    }
    print_findings(&findings);
    print_history(&findings, &seen, played, shared.began);
    for note in notes {
        println!("note: {note}");
    }
    let kept = if config.keep.is_some() {
        format!(
            "; data directories and node logs kept in {}",
            root.display()
        )
    } else {
        "; add --keep DIR to keep the data directories and node logs".into()
    };
    Err(format!(
        "{violations} violations (seed {}); replay: {}{kept}",
        config.seed,
        config.replay_command()
    )
    .into())
}

/// After healing, one publish to each partition of the queue (the probe producer's sequences
/// 1, 65 and 129 fall in three consecutive blocks, so on three partitions) and one to the
/// dead-letter queue, each confirmed within [`RECOVERY_MAX`]; how many were not.
async fn probe(shared: &Shared, notes: &mut Vec<String>) -> u64 {
    let options = options("nemesis probe", Some(PROBE_ID), true);
    let mut failed = 0;
    for (queue, seq) in [(QUEUE, 1), (QUEUE, 65), (QUEUE, 129), (DLQ, 1_000)] {
        let began = Instant::now();
        let sent = Instant::now();
        shared.ledger().published.insert(
            (Producer::Probe, seq),
            PubState {
                first_sent: sent,
                confirmed: false,
                attempts: 0,
            },
        );
        let mut confirmed = false;
        let mut turn = 0;
        while !confirmed && began.elapsed() < RECOVERY_MAX {
            if let Some(state) = shared.ledger().published.get_mut(&(Producer::Probe, seq)) {
                state.attempts += 1;
            }
            if let Some(client) = connect_from(&shared.addrs, turn, &options).await {
                let message =
                    OutgoingMessage::new(encode_body((Producer::Probe, seq))).with_sequence(seq);
                confirmed = client.publish(queue, message).await.is_ok();
                client.close().await;
            }
            turn += 1;
        }
        if let Some(state) = shared.ledger().published.get_mut(&(Producer::Probe, seq)) {
            state.confirmed = confirmed;
        }
        if !confirmed {
            failed += 1;
            notes.push(format!(
                "after healing: probe publish {seq} to {queue} not confirmed within {RECOVERY_MAX:?}"
            ));
        }
    }
    failed
}

fn table(
    played: &[Played],
    published: &[Published],
    findings: &Findings,
    by_window: &HashMap<MsgKey, String>,
    heal: Row,
) -> BTreeMap<String, Row> {
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    for p in played {
        let row = rows.entry(p.kind.name().into()).or_default();
        row.runs += 1;
        row.stalls += u64::from(p.stalled);
        if let Some(d) = p.recovered {
            row.recover_ms.push(d.as_millis() as u64);
        }
    }
    let window = |key: &MsgKey| by_window.get(key).cloned().unwrap_or_else(|| "none".into());
    for p in published.iter().filter(|p| p.confirmed) {
        rows.entry(window(&p.key)).or_default().confirmed += 1;
    }
    let mut add = |keys: &mut dyn Iterator<Item = MsgKey>, field: fn(&mut Row) -> &mut u64| {
        for key in keys {
            *field(rows.entry(window(&key)).or_default()) += 1;
        }
    };
    add(&mut findings.lost.iter().copied(), |r| &mut r.lost);
    add(&mut findings.duplicates.iter().copied(), |r| {
        &mut r.duplicates
    });
    add(
        &mut findings.unknown_outcome_duplicates.iter().copied(),
        |r| &mut r.unknown_outcome_duplicates,
    );
    add(&mut findings.unflagged_redeliveries.iter().copied(), |r| {
        &mut r.unflagged
    });
    add(
        &mut findings.order_violations.iter().map(|(k, _)| *k),
        |r| &mut r.order,
    );
    add(&mut findings.dead_letter_missing.iter().copied(), |r| {
        &mut r.dead_letter_missing
    });
    add(&mut findings.phantoms.iter().flatten().copied(), |r| {
        &mut r.phantoms
    });
    // The after-healing row: its probe's messages (counted above) and its own checks; bodies
    // that failed their checks belong to no window and are counted here.
    let row = rows.entry("heal".into()).or_default();
    row.runs += heal.runs;
    row.stalls += heal.stalls;
    row.recover_ms.extend(heal.recover_ms);
    row.phantoms += findings.phantoms.iter().filter(|k| k.is_none()).count() as u64;
    rows
}

fn print_findings(findings: &Findings) {
    let show = |name: &str, keys: &[MsgKey]| {
        if !keys.is_empty() {
            println!(
                "VIOLATION {name}: {} (first: {:?})",
                keys.len(),
                &keys[..keys.len().min(10)]
            );
        }
    };
    show("lost", &findings.lost);
    show("duplicates", &findings.duplicates);
    show("unflagged redeliveries", &findings.unflagged_redeliveries);
    show("dead letter missing", &findings.dead_letter_missing);
    if !findings.phantoms.is_empty() {
        println!(
            "VIOLATION phantoms: {} (first: {:?})",
            findings.phantoms.len(),
            &findings.phantoms[..findings.phantoms.len().min(10)]
        );
    }
    if !findings.order_violations.is_empty() {
        println!(
            "VIOLATION order: {} (first: {:?})",
            findings.order_violations.len(),
            &findings.order_violations[..findings.order_violations.len().min(10)]
        );
    }
}

/// Every delivery of the first few messages each rule flagged, with the faults' start times:
/// what a replay needs to find the window.
fn print_history(findings: &Findings, seen: &[Seen], played: &[Played], began: Instant) {
    let mut keys: Vec<MsgKey> = Vec::new();
    for list in [
        &findings.duplicates,
        &findings.unflagged_redeliveries,
        &findings.dead_letter_missing,
    ] {
        keys.extend(list.iter().take(3));
    }
    keys.extend(findings.order_violations.iter().take(3).map(|(k, _)| *k));
    for key in keys {
        println!("deliveries of {key:?} (queue, session, partition, offset, redelivered, delivery count, settled, at ms):");
        for s in seen.iter().filter(|s| s.key == Some(key)) {
            println!(
                "  {:?} session {} partition {} offset {} redelivered {} count {} {:?} at {} ms",
                s.queue,
                s.session,
                s.partition,
                s.offset,
                s.redelivered,
                s.delivery_count,
                s.settle,
                s.at_ms
            );
        }
    }
    if !played.is_empty() {
        let starts: Vec<String> = played
            .iter()
            .map(|p| {
                format!(
                    "{} at {} ms",
                    p.kind.name(),
                    p.began.saturating_duration_since(began).as_millis()
                )
            })
            .collect();
        println!("faults: {}", starts.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory with one segment file: a 64-byte header, 1,000 written bytes, then
    /// preallocated zeros; and a file that is not a segment.
    fn scratch(name: &str) -> (PathBuf, PathBuf, Vec<u8>) {
        let dir = std::env::temp_dir().join(format!(
            "keratin-nemesis-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("queues/0/0/entries")).unwrap();
        let mut bytes = vec![0xa5_u8; 64 + 1_000];
        bytes.extend(vec![0u8; 4_096]);
        let file = dir.join("queues/0/0/entries/00000000000000000000.seg");
        std::fs::write(&file, &bytes).unwrap();
        std::fs::write(dir.join("anchor"), [1u8; 100]).unwrap();
        (dir, file, bytes)
    }

    #[test]
    fn a_bit_flip_changes_one_bit_of_the_written_part() {
        let (dir, file, before) = scratch("flip");
        let what = corrupt_segment(&dir, Damage::BitFlip, 0x1234_5678).unwrap();
        let after = std::fs::read(&file).unwrap();
        let changed: Vec<usize> = (0..before.len())
            .filter(|i| before[*i] != after[*i])
            .collect();
        assert_eq!(changed.len(), 1, "{what}");
        assert!((64..1_064).contains(&changed[0]), "{what}");
        assert_eq!((before[changed[0]] ^ after[changed[0]]).count_ones(), 1);
        assert_eq!(std::fs::read(dir.join("anchor")).unwrap(), vec![1u8; 100]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncation_and_zeroing_hit_the_written_part() {
        let (dir, file, _) = scratch("cut");
        corrupt_segment(&dir, Damage::Truncate, 0x9999).unwrap();
        let len = std::fs::metadata(&file).unwrap().len();
        assert!((64..1_064).contains(&len), "truncated to {len}");
        std::fs::remove_dir_all(&dir).unwrap();

        let (dir, file, _) = scratch("zero");
        corrupt_segment(&dir, Damage::ZeroTail, 7).unwrap();
        let after = std::fs::read(&file).unwrap();
        // The whole written part is under 4 KiB: zeroed from the header on.
        assert!(after[..64].iter().all(|b| *b == 0xa5));
        assert!(after[64..].iter().all(|b| *b == 0));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_without_written_segments_is_left_alone() {
        let dir =
            std::env::temp_dir().join(format!("keratin-nemesis-test-{}-empty", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let what = corrupt_segment(&dir, Damage::BitFlip, 1).unwrap();
        assert!(what.starts_with("no written segment file"), "{what}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_replay_command_names_every_choice() {
        let config = NemesisConfig {
            nodes: 5,
            seed: 42,
            seconds: 90,
            faults: vec![FaultKind::Kill, FaultKind::Corrupt],
            keratin: PathBuf::from("/bin/keratin"),
            keep: None,
        };
        assert_eq!(
            config.replay_command(),
            "keratin-bench nemesis --nodes 5 --seed 42 --seconds 90 --faults kill,corrupt \
             --keratin /bin/keratin"
        );
    }
}
