//! The `compare` benchmark (issue 9): one workload description run through three drivers
//! (`peers`: Keratin, RabbitMQ over AMQP 0-9-1, NATS JetStream) and the raw disk reference, on
//! the same machine in the same run, as one table of figures and ratios (Keratin / peer).
//!
//! Keratin runs as a child process of this benchmark (`compare-node`: a node in its default
//! durable configuration, on a counting `Io`), so that its resident memory is its own and the
//! bytes each fdatasync covered give the raw reference its batch sizes. The peers are started
//! by `bench/compare.sh` and reached by address; their process ids give their memory.
//!
//! Cases (1 KiB bodies): `publish` (1 producer, `in_flight` single confirmed publishes in
//! flight), `producers` (4 producers, each its own connection and queue), `consume` (consume +
//! ack a backlog), `latency` (publish-to-confirm at a fixed rate), `rss` (broker memory holding
//! `rss_messages` queued), `fill` (push until the broker pushes back on a small file system,
//! drain, time to the next accepted publish). Rounds interleave the systems (A B C D, then
//! D C B A); figures are medians over rounds.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use keratin_log::RealIo;
use keratin_server::config::{load, CliOverrides};
use keratin_server::Node;
use serde_json::json;

use crate::broker_bench::{raw_replay, remove_and_settle, runtime};
use crate::contender::BenchResult;
use crate::counting_io::CountingIo;
use crate::net_bench::latency_line;
use crate::peers::{Endpoints, Peer, System};
use crate::report::{median, percentile};

/// Confirmed publish: Keratin / RabbitMQ quorum at least this (issue 9).
const GOAL_PUBLISH_VS_QUORUM: f64 = 5.0;
/// Confirmed publish and consume: Keratin / NATS at least this.
const GOAL_VS_NATS: f64 = 1.0;
/// Confirmed publish: Keratin / raw at least this.
const GOAL_PUBLISH_VS_RAW: f64 = 0.5;
/// Consume + ack: Keratin / RabbitMQ at least this.
const GOAL_CONSUME_VS_RABBIT: f64 = 3.0;
/// Fill: the next publish accepted within this after the drain.
const GOAL_RESUME: Duration = Duration::from_secs(2);
/// Fill: the broker has pushed back once no publish was confirmed for this long. Longer than
/// the Keratin client's publish timeout (30 s), which retries `ERR_LIMITED` by itself until
/// then, so that what its publisher finally sees is quoted.
const FILL_STALL: Duration = Duration::from_secs(35);

/// A case of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Case {
    /// 1 producer, `in_flight` confirmed publishes in flight.
    Publish,
    /// `producers` producers on as many queues.
    Producers,
    /// Consume + ack from a backlog.
    Consume,
    /// Publish-to-confirm latency at a fixed rate.
    Latency,
    /// Resident memory holding `rss_messages` queued.
    Rss,
    /// The fill scenario (the brokers must be on small file systems).
    Fill,
}

impl Case {
    /// Parses a case name.
    pub fn parse(text: &str) -> Result<Case, String> {
        Ok(match text.trim() {
            "publish" => Case::Publish,
            "producers" => Case::Producers,
            "consume" => Case::Consume,
            "latency" => Case::Latency,
            "rss" => Case::Rss,
            "fill" => Case::Fill,
            other => {
                return Err(format!(
                    "unknown case {other:?}; use publish, producers, consume, latency, rss, fill"
                ))
            }
        })
    }
}

/// What `keratin-bench compare` runs.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// Directory for Keratin's data (unless `keratin_dir`) and the raw reference's files.
    pub dir: PathBuf,
    /// Keratin's data directory; default a fresh one under `dir`.
    pub keratin_dir: Option<PathBuf>,
    /// A Keratin configuration file (the fill case's limits); default the built-in defaults.
    pub keratin_config: Option<PathBuf>,
    /// Peer addresses (Keratin's is filled in when its child starts).
    pub endpoints: Endpoints,
    /// Process ids of the peers, for their memory.
    pub rabbitmq_pid: Option<u32>,
    /// See `rabbitmq_pid`.
    pub nats_pid: Option<u32>,
    /// The peers' data directories, for free space in the fill case.
    pub rabbitmq_dir: Option<PathBuf>,
    /// See `rabbitmq_dir`.
    pub nats_dir: Option<PathBuf>,
    /// The systems, in column order.
    pub systems: Vec<System>,
    /// The cases.
    pub cases: Vec<Case>,
    /// Length of each publish and latency run.
    pub duration: Duration,
    /// Rounds of the throughput and latency cases.
    pub rounds: usize,
    /// Body bytes.
    pub body_bytes: usize,
    /// Most confirmed publishes in flight per producer.
    pub in_flight: usize,
    /// Producers of the `producers` case.
    pub producers: usize,
    /// Messages queued before a consume run.
    pub backlog: u64,
    /// Unacked deliveries at most.
    pub prefetch: u32,
    /// Messages per second of the latency run.
    pub latency_rate: u32,
    /// Messages queued for the memory figure.
    pub rss_messages: u64,
    /// Where to write the markdown section, besides stdout.
    pub out: Option<PathBuf>,
}

// ---------------------------------------------------------------------------------------------
// Keratin as a child process.

/// The hidden `compare-node` subcommand: a node on `dir` (and `config`, if given) on a counting
/// `Io`, listening on loopback ports chosen by the kernel. It prints
/// `keratin listening protocol=ADDR http=ADDR`, then answers lines on stdin: `reset` (zero the
/// counters, answers `ok`), `snapshot` (answers the counters as one JSON line), `stop` or end
/// of input (shuts down).
pub fn node_main(dir: &Path, config: Option<&Path>) -> BenchResult<()> {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let cli = CliOverrides {
        config: config.map(Path::to_path_buf),
        data_dirs: vec![dir.to_path_buf()],
        listen: Some(loopback),
        http: Some(loopback),
        ..CliOverrides::default()
    };
    let mut config = load(&cli, std::iter::empty::<(String, String)>())?.into_config();
    // The data path is measured, not logins (as net_bench::node_config).
    config.server.auth = keratin_server::access::AuthMode::None;
    std::fs::create_dir_all(dir)?;
    let rt = runtime()?;
    let io = Arc::new(CountingIo::new(Arc::new(RealIo::new())));
    let counters = io.counters();
    let node = rt.block_on(Node::start_with_io(&config, io))?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "keratin listening protocol={} http={}",
        node.protocol_addr(),
        node.http_addr()
    )?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "reset" => {
                counters.reset();
                writeln!(out, "ok")?;
            }
            "snapshot" => {
                let s = counters.snapshot();
                let level = node
                    .limits()
                    .snapshot()
                    .filesystems
                    .first()
                    .map_or_else(|| "unknown".into(), |f| f.level.as_str().to_string());
                let line = json!({
                    "level": level,
                    "syncs": s.syncs,
                    "write_bytes": s.write_bytes,
                    "sync_batches_bytes": s.sync_batches_bytes,
                });
                writeln!(out, "{line}")?;
            }
            "stop" => break,
            other => writeln!(out, "unknown command {other:?}")?,
        }
        out.flush()?;
    }
    rt.block_on(node.shutdown())?;
    Ok(())
}

/// What the child's counters said.
struct NodeCounters {
    /// The disk level of the node's first file system.
    level: String,
    write_bytes: u64,
    sync_batches_bytes: Vec<u64>,
}

/// The Keratin child process and the pipes to it (also `compare-cluster`'s single node).
pub(crate) struct KeratinChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    addr: SocketAddr,
}

impl KeratinChild {
    /// Starts `keratin-bench compare-node` on `dir` and waits for its addresses.
    pub(crate) fn start(dir: &Path, config: Option<&Path>) -> BenchResult<KeratinChild> {
        let exe = std::env::current_exe()?;
        let mut command = Command::new(exe);
        command.arg("compare-node").arg("--dir").arg(dir);
        if let Some(config) = config {
            command.arg("--config").arg(config);
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start the Keratin node: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the Keratin node's pipes were not set up".into());
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("protocol="))
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("the Keratin node did not start (it said {line:?})"))?;
        Ok(KeratinChild {
            child,
            stdin,
            stdout,
            addr,
        })
    }

    fn ask(&mut self, command: &str) -> BenchResult<String> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        if line.is_empty() {
            return Err("the Keratin node exited".into());
        }
        Ok(line)
    }

    fn reset(&mut self) -> BenchResult<()> {
        self.ask("reset").map(|_| ())
    }

    fn snapshot(&mut self) -> BenchResult<NodeCounters> {
        let line = self.ask("snapshot")?;
        let value: serde_json::Value = serde_json::from_str(&line)?;
        Ok(NodeCounters {
            level: value["level"].as_str().unwrap_or("unknown").to_string(),
            write_bytes: value["write_bytes"].as_u64().unwrap_or(0),
            sync_batches_bytes: value["sync_batches_bytes"]
                .as_array()
                .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
                .unwrap_or_default(),
        })
    }

    /// The node's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The node's protocol address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shuts the node down and waits for it.
    pub(crate) fn stop(mut self) -> BenchResult<()> {
        writeln!(self.stdin, "stop")?;
        self.stdin.flush()?;
        let status = self.child.wait()?;
        if !status.success() {
            return Err(format!("the Keratin node exited with {status}").into());
        }
        Ok(())
    }
}

impl Drop for KeratinChild {
    fn drop(&mut self) {
        // After `stop` the child has been waited for and this does nothing; after an error it
        // ends the child we started (by its pid, through its handle).
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Messages per sync from the bytes each sync covered, scaled so they add up to `messages`.
fn batches_of(counters: &NodeCounters, messages: u64) -> Vec<u32> {
    let total: u64 = counters.sync_batches_bytes.iter().sum();
    if total == 0 || messages == 0 {
        return Vec::new();
    }
    let per_byte = messages as f64 / total as f64;
    counters
        .sync_batches_bytes
        .iter()
        .map(|bytes| (*bytes as f64 * per_byte).round() as u32)
        .filter(|n| *n > 0)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Workloads, written once for every driver.

/// One producer keeps up to `in_flight` confirmed publishes in flight until `duration` has
/// passed or `limit` are confirmed: (confirmed, elapsed).
pub(crate) async fn publish_window(
    peer: &Peer,
    body: &Bytes,
    in_flight: usize,
    duration: Duration,
    limit: Option<u64>,
) -> BenchResult<(u64, Duration)> {
    let began = Instant::now();
    let deadline = began + duration;
    let mut pending = FuturesUnordered::new();
    let (mut started, mut confirmed) = (0u64, 0u64);
    loop {
        if Instant::now() < deadline {
            while pending.len() < in_flight && limit.is_none_or(|l| started < l) {
                pending.push(peer.publish(body.clone()));
                started += 1;
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
    Ok((confirmed, began.elapsed()))
}

/// Publish-to-confirm latencies (µs) of single publishes started at a fixed `rate`.
pub(crate) async fn fixed_rate(
    peer: &Peer,
    body: &Bytes,
    rate: u32,
    duration: Duration,
) -> BenchResult<Vec<u64>> {
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let began = Instant::now();
    let total = (f64::from(rate) * duration.as_secs_f64()).round() as u64;
    let mut started = 0u64;
    let mut pending = FuturesUnordered::new();
    let mut latencies = Vec::with_capacity(total as usize);
    let timed = |body: Bytes| async move {
        let sent = Instant::now();
        let result = peer.publish(body).await;
        result.map(|()| u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX))
    };
    while started < total || !pending.is_empty() {
        tokio::select! {
            _ = ticker.tick(), if started < total => {
                let due = ((began.elapsed().as_secs_f64() * f64::from(rate)) as u64 + 1).min(total);
                while started < due {
                    pending.push(timed(body.clone()));
                    started += 1;
                }
            }
            Some(result) = pending.next(), if !pending.is_empty() => {
                latencies.push(result.map_err(|e| format!("publish: {e}"))?);
            }
        }
    }
    Ok(latencies)
}

/// Connects and declares a fresh queue.
async fn fresh(
    system: System,
    endpoints: &Endpoints,
    queue: &str,
    max_bytes: Option<i64>,
) -> BenchResult<Peer> {
    let peer = Peer::connect(system, endpoints, queue).await?;
    // A queue left by an earlier, interrupted run would hold its messages.
    let _ = peer.delete().await;
    peer.declare(system, max_bytes).await?;
    Ok(peer)
}

/// Resident set of `pid` and its descendants, shells and `su` excepted (the wrappers that
/// start a broker are not the broker), in bytes.
fn tree_rss_bytes(pid: u32) -> BenchResult<u64> {
    let mut total = 0u64;
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
        let name = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap_or("")
            .trim()
            .to_string();
        if !matches!(name.as_str(), "sh" | "bash" | "dash" | "su" | "runuser") {
            total += status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
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
    if seen == 1 && !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(format!("no process {pid}").into());
    }
    Ok(total)
}

/// Free bytes of the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let stat = rustix::fs::statvfs(dir).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

// ---------------------------------------------------------------------------------------------
// The matrix.

/// Everything measured, by case and system.
#[derive(Default)]
struct Results {
    /// msg/s per round, by (case, column); column "raw" is the reference.
    rates: BTreeMap<(Case, String), Vec<f64>>,
    /// Latencies (µs) of every round, by system.
    latencies: BTreeMap<String, Vec<u64>>,
    /// (idle, holding) resident bytes, by system.
    rss: BTreeMap<String, (u64, u64)>,
    /// Fill outcome, by system.
    fill: BTreeMap<String, FillOutcome>,
    /// Keratin's disk level at the end of each publish run.
    levels: Vec<String>,
    /// Lines printed under the table.
    notes: Vec<String>,
}

/// What the fill case saw for one system.
#[derive(Debug, Clone, Default)]
struct FillOutcome {
    accepted_bytes: u64,
    publisher_saw: String,
    min_free_bytes: Option<u64>,
    survived: bool,
    consumed: u64,
    resume: Option<Duration>,
}

struct Harness<'a> {
    config: &'a CompareConfig,
    endpoints: Endpoints,
    keratin: Option<KeratinChild>,
    body: Bytes,
    results: Results,
    last_batches: Vec<u32>,
    last_disk_bytes: u64,
}

impl Harness<'_> {
    fn pid_of(&self, system: System) -> Option<u32> {
        match system {
            System::Keratin => self.keratin.as_ref().map(KeratinChild::pid),
            System::RabbitClassic | System::RabbitQuorum => self.config.rabbitmq_pid,
            System::Nats => self.config.nats_pid,
        }
    }

    fn reset(&mut self, system: System) -> BenchResult<()> {
        match (&mut self.keratin, system) {
            (Some(child), System::Keratin) => child.reset(),
            _ => Ok(()),
        }
    }

    fn record(&mut self, case: Case, column: &str, rate: f64) {
        eprintln!("  {case:?} {column}: {rate:.0} msg/s");
        self.results
            .rates
            .entry((case, column.to_string()))
            .or_default()
            .push(rate);
    }

    fn raw(&mut self, case: Case, producers: u32) -> BenchResult<()> {
        let dir = self.config.dir.join("raw");
        let run = raw_replay(
            self.config.duration,
            self.config.body_bytes,
            producers,
            &self.last_batches,
            self.last_disk_bytes.max(64 << 20),
            &dir,
        )?;
        remove_and_settle(&dir)?;
        self.record(case, "raw", run.records_per_s());
        Ok(())
    }

    /// One run of a throughput case on one system.
    fn throughput(
        &mut self,
        rt: &tokio::runtime::Runtime,
        case: Case,
        system: System,
        round: usize,
    ) -> BenchResult<()> {
        let config = self.config;
        let endpoints = self.endpoints.clone();
        let body = self.body.clone();
        let producers = if case == Case::Producers {
            config.producers
        } else {
            1
        };
        let queues: Vec<String> = (0..producers)
            .map(|p| format!("kbench-{case:?}-{round}-{p}").to_lowercase())
            .collect();
        let peers = rt.block_on(async {
            let mut peers = Vec::new();
            for queue in &queues {
                peers.push(fresh(system, &endpoints, queue, None).await?);
            }
            Ok::<_, crate::contender::BenchError>(peers)
        })?;
        let rate = match case {
            Case::Publish | Case::Producers => {
                rt.block_on(async {
                    let mut warm = Vec::new();
                    for peer in &peers {
                        warm.push(publish_window(
                            peer,
                            &body,
                            config.in_flight,
                            Duration::from_millis(200),
                            None,
                        ));
                    }
                    for r in futures_util::future::join_all(warm).await {
                        r?;
                    }
                    Ok::<_, crate::contender::BenchError>(())
                })?;
                self.reset(system)?;
                let runs = rt.block_on(async {
                    let handles: Vec<_> = peers
                        .iter()
                        .map(|peer| {
                            publish_window(peer, &body, config.in_flight, config.duration, None)
                        })
                        .collect();
                    futures_util::future::join_all(handles).await
                });
                let mut confirmed = 0u64;
                let mut elapsed = Duration::ZERO;
                for run in runs {
                    let (c, e) = run?;
                    confirmed += c;
                    elapsed = elapsed.max(e);
                }
                if system == System::Keratin {
                    if let Some(child) = &mut self.keratin {
                        let counters = child.snapshot()?;
                        self.results.levels.push(counters.level.clone());
                        let mut batches: Vec<u64> = batches_of(&counters, confirmed)
                            .into_iter()
                            .map(u64::from)
                            .collect();
                        batches.sort_unstable();
                        let syncs = batches.len() as f64;
                        self.results.notes.push(format!(
                            "keratin {case:?} round {}: {confirmed} confirmed over {:.1} s in {} \
                             syncs ({:.0}/s), msg/sync mean {:.1}, p50 {}, p90 {}, max {}",
                            round + 1,
                            elapsed.as_secs_f64(),
                            batches.len(),
                            syncs / elapsed.as_secs_f64().max(1e-9),
                            confirmed as f64 / syncs.max(1.0),
                            percentile(&batches, 0.5),
                            percentile(&batches, 0.9),
                            percentile(&batches, 1.0),
                        ));
                        // Every sync covered one queue's log: each raw thread replays them all.
                        self.last_batches = batches_of(&counters, confirmed);
                        self.last_disk_bytes = counters.write_bytes / producers as u64;
                    }
                }
                confirmed as f64 / elapsed.as_secs_f64().max(1e-9)
            }
            Case::Consume => {
                let peer = &peers[0];
                let (queued, _) = rt.block_on(publish_window(
                    peer,
                    &body,
                    config.in_flight,
                    Duration::from_secs(3600),
                    Some(config.backlog),
                ))?;
                let began = Instant::now();
                let consumed =
                    rt.block_on(peer.consume(queued, config.prefetch, Duration::from_secs(10)))?;
                let elapsed = began.elapsed();
                if consumed < queued {
                    return Err(format!(
                        "{}: consumed {consumed} of {queued} before 10 s without a delivery",
                        system.name()
                    )
                    .into());
                }
                consumed as f64 / elapsed.as_secs_f64().max(1e-9)
            }
            _ => return Err(format!("{case:?} is not a throughput case").into()),
        };
        rt.block_on(async {
            for peer in peers {
                peer.delete().await?;
                peer.close().await;
            }
            Ok::<_, crate::contender::BenchError>(())
        })?;
        self.record(case, system.name(), rate);
        Ok(())
    }

    fn latency(
        &mut self,
        rt: &tokio::runtime::Runtime,
        system: System,
        round: usize,
    ) -> BenchResult<()> {
        let config = self.config;
        let queue = format!("kbench-latency-{round}");
        let latencies = rt.block_on(async {
            let peer = fresh(system, &self.endpoints, &queue, None).await?;
            fixed_rate(
                &peer,
                &self.body,
                config.latency_rate,
                Duration::from_millis(300),
            )
            .await?;
            let latencies =
                fixed_rate(&peer, &self.body, config.latency_rate, config.duration).await?;
            peer.delete().await?;
            peer.close().await;
            Ok::<_, crate::contender::BenchError>(latencies)
        })?;
        eprintln!("  latency {}: {}", system.name(), latency_line(&latencies));
        self.results
            .latencies
            .entry(system.name().into())
            .or_default()
            .extend(latencies);
        Ok(())
    }

    fn rss(&mut self, rt: &tokio::runtime::Runtime, system: System) -> BenchResult<()> {
        let Some(pid) = self.pid_of(system) else {
            self.results
                .notes
                .push(format!("memory of {}: no process id given", system.name()));
            return Ok(());
        };
        let config = self.config;
        let idle = tree_rss_bytes(pid)?;
        let holding = rt.block_on(async {
            let peer = fresh(system, &self.endpoints, "kbench-rss", None).await?;
            let (queued, elapsed) = publish_window(
                &peer,
                &self.body,
                config.in_flight,
                Duration::from_secs(3600),
                Some(config.rss_messages),
            )
            .await?;
            eprintln!(
                "  rss {}: {queued} queued in {:.1} s",
                system.name(),
                elapsed.as_secs_f64()
            );
            tokio::time::sleep(Duration::from_secs(2)).await;
            let holding = tree_rss_bytes(pid)?;
            peer.delete().await?;
            peer.close().await;
            Ok::<_, crate::contender::BenchError>(holding)
        })?;
        eprintln!(
            "  rss {}: idle {} MB, holding {} MB",
            system.name(),
            idle / 1_000_000,
            holding / 1_000_000
        );
        self.results
            .rss
            .insert(system.name().into(), (idle, holding));
        Ok(())
    }

    fn fill(&mut self, rt: &tokio::runtime::Runtime, system: System) -> BenchResult<()> {
        let config = self.config;
        let dir = match system {
            System::Keratin => config.keratin_dir.clone(),
            System::RabbitClassic | System::RabbitQuorum => config.rabbitmq_dir.clone(),
            System::Nats => config.nats_dir.clone(),
        };
        let pid = self.pid_of(system);
        let endpoints = self.endpoints.clone();
        let body = self.body.clone();
        let outcome = rt.block_on(async {
            let queue = "kbench-fill";
            let peer = fresh(system, &endpoints, queue, None).await?;
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let sampler = {
                let stop = stop.clone();
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || {
                    let mut min: Option<u64> = None;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        if let Some(free) = dir.as_deref().and_then(free_bytes) {
                            min = Some(min.map_or(free, |m| m.min(free)));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    min
                })
            };
            let mut outcome = FillOutcome::default();
            // Push until the broker refuses (an error) or stops confirming (5 s without one).
            let mut pending = FuturesUnordered::new();
            let began = Instant::now();
            let stall = FILL_STALL;
            let mut last_confirm = Instant::now();
            let mut confirmed = 0u64;
            loop {
                while pending.len() < config.in_flight {
                    pending.push(peer.publish(body.clone()));
                }
                match tokio::time::timeout(Duration::from_millis(200), pending.next()).await {
                    Ok(Some(Ok(()))) => {
                        confirmed += 1;
                        last_confirm = Instant::now();
                    }
                    Ok(Some(Err(error))) => {
                        outcome.publisher_saw = format!(
                            "error {:.1} s after the last confirm: {error}",
                            last_confirm.elapsed().as_secs_f64()
                        );
                        break;
                    }
                    Ok(None) => {}
                    Err(_) => {}
                }
                if last_confirm.elapsed() >= stall {
                    outcome.publisher_saw = format!(
                        "no confirm for {} s, no error{}",
                        stall.as_secs(),
                        if peer.blocked() {
                            "; connection.blocked received"
                        } else {
                            ""
                        }
                    );
                    break;
                }
                if began.elapsed() > Duration::from_secs(300) {
                    outcome.publisher_saw = "no push-back within 300 s".into();
                    break;
                }
            }
            drop(pending);
            outcome.accepted_bytes = confirmed * body.len() as u64;
            eprintln!(
                "  fill {}: {} MB accepted; {}",
                system.name(),
                outcome.accepted_bytes / 1_000_000,
                outcome.publisher_saw
            );
            // Still there, and a new connection works?
            tokio::time::sleep(Duration::from_secs(1)).await;
            let alive = pid.is_none_or(|p| Path::new(&format!("/proc/{p}")).exists());
            let consumer = match Peer::connect(system, &endpoints, queue).await {
                Ok(consumer) => Some(consumer),
                Err(error) => {
                    outcome.publisher_saw += &format!("; new connection failed: {error}");
                    None
                }
            };
            outcome.survived = alive && consumer.is_some();
            // Drain: consume and ack everything accepted.
            if let Some(consumer) = consumer {
                outcome.consumed = consumer
                    .consume(confirmed, config.prefetch, Duration::from_secs(10))
                    .await
                    .unwrap_or_else(|error| {
                        eprintln!("  fill {}: consume: {error}", system.name());
                        0
                    });
                consumer.close().await;
            }
            // The next accepted publish, on the publisher's own connection.
            let drained = Instant::now();
            while drained.elapsed() < Duration::from_secs(60) {
                match tokio::time::timeout(Duration::from_secs(5), peer.publish(body.clone())).await
                {
                    Ok(Ok(())) => {
                        outcome.resume = Some(drained.elapsed());
                        break;
                    }
                    Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(10)).await,
                    Err(_) => {}
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            outcome.min_free_bytes = sampler.await.ok().flatten();
            // A RabbitMQ connection still blocked reads nothing more: bound the clean-up; the
            // queue then goes with the broker's temporary data directory.
            let cleanup = async {
                if peer.delete().await.is_ok() {
                    peer.close().await;
                }
            };
            if tokio::time::timeout(Duration::from_secs(10), cleanup)
                .await
                .is_err()
            {
                eprintln!(
                    "  fill {}: the queue could not be deleted within 10 s",
                    system.name()
                );
            }
            Ok::<_, crate::contender::BenchError>(outcome)
        })?;
        eprintln!("  fill {}: {outcome:?}", system.name());
        self.results.fill.insert(system.name().into(), outcome);
        Ok(())
    }
}

/// Runs the matrix and prints (and writes) the markdown section.
pub fn run(config: &CompareConfig) -> BenchResult<()> {
    std::fs::create_dir_all(&config.dir)?;
    let keratin_dir = config
        .keratin_dir
        .clone()
        .unwrap_or_else(|| config.dir.join(format!("keratin-{}", std::process::id())));
    let mut endpoints = config.endpoints.clone();
    let keratin = if config.systems.contains(&System::Keratin) {
        let child = KeratinChild::start(&keratin_dir, config.keratin_config.as_deref())?;
        endpoints.keratin = Some(child.addr);
        Some(child)
    } else {
        None
    };
    let config = &CompareConfig {
        keratin_dir: Some(keratin_dir.clone()),
        ..config.clone()
    };
    let mut harness = Harness {
        config,
        endpoints,
        keratin,
        body: Bytes::from(vec![0x5a_u8; config.body_bytes]),
        results: Results::default(),
        last_batches: Vec::new(),
        last_disk_bytes: 0,
    };
    let rt = runtime()?;
    for &case in &config.cases {
        eprintln!("{case:?}:");
        match case {
            Case::Publish | Case::Producers | Case::Consume | Case::Latency => {
                for round in 0..config.rounds {
                    let mut order = config.systems.clone();
                    if round % 2 == 1 {
                        order.reverse();
                    }
                    for system in order {
                        if case == Case::Latency {
                            harness.latency(&rt, system, round)?;
                        } else {
                            harness.throughput(&rt, case, system, round)?;
                        }
                        if system == System::Keratin
                            && case != Case::Consume
                            && case != Case::Latency
                        {
                            let producers = if case == Case::Producers {
                                config.producers as u32
                            } else {
                                1
                            };
                            harness.raw(case, producers)?;
                        }
                    }
                }
            }
            Case::Rss => {
                for &system in &config.systems {
                    harness.rss(&rt, system)?;
                }
            }
            Case::Fill => {
                for &system in &config.systems {
                    harness.fill(&rt, system)?;
                }
            }
        }
    }
    drop(rt);
    if let Some(child) = harness.keratin.take() {
        child.stop()?;
    }
    if config.keratin_dir.as_deref() == Some(keratin_dir.as_path())
        && keratin_dir.starts_with(&config.dir)
    {
        remove_and_settle(&keratin_dir)?;
    }
    let text = markdown(config, &harness.results);
    print!("{text}");
    if let Some(out) = &config.out {
        std::fs::write(out, &text).map_err(|e| format!("write {}: {e}", out.display()))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The table.

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1000.0)
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

fn markdown(config: &CompareConfig, results: &Results) -> String {
    let systems: Vec<&str> = config.systems.iter().map(|s| s.name()).collect();
    let peers: Vec<&str> = systems
        .iter()
        .copied()
        .filter(|s| *s != "keratin")
        .collect();
    let mut out = String::new();
    let mut header = vec!["case".to_string(), "keratin".into(), "raw disk".into()];
    header.extend(peers.iter().map(|p| (*p).to_string()));
    header.push("keratin / raw".into());
    header.extend(peers.iter().map(|p| format!("keratin / {p}")));
    let rule: Vec<String> = header.iter().map(|_| "---".to_string()).collect();
    let matrix = [
        Case::Publish,
        Case::Producers,
        Case::Consume,
        Case::Latency,
        Case::Rss,
    ];
    if config.cases.iter().any(|c| matrix.contains(c)) {
        out += &format!("| {} |\n| {} |\n", header.join(" | "), rule.join(" | "));
    }
    let rate = |case: Case, column: &str| {
        results
            .rates
            .get(&(case, column.to_string()))
            .map(|v| median(v))
    };
    let mut goals: Vec<String> = Vec::new();
    let names = [
        (
            Case::Publish,
            format!(
                "1. confirmed publish, 1 producer, {} in flight (msg/s)",
                config.in_flight
            ),
        ),
        (
            Case::Producers,
            format!(
                "2. confirmed publish, {} producers on {0} queues (msg/s)",
                config.producers
            ),
        ),
        (
            Case::Consume,
            format!(
                "3. consume + ack, backlog {}, prefetch {} (msg/s)",
                config.backlog, config.prefetch
            ),
        ),
    ];
    for (case, name) in names {
        if !config.cases.contains(&case) {
            continue;
        }
        let k = rate(case, "keratin");
        let raw = rate(case, "raw");
        let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "-".into(),
        };
        let mut cells = vec![name, fmt(k), fmt(raw)];
        cells.extend(peers.iter().map(|p| fmt(rate(case, p))));
        cells.push(ratio(k, raw));
        cells.extend(peers.iter().map(|p| ratio(k, rate(case, p))));
        out += &format!("| {} |\n", cells.join(" | "));
        let mut goal = |what: String, have: Option<f64>, want: f64| {
            if let Some(have) = have {
                goals.push(format!(
                    "{what}: {have:.2} (goal >= {want}) {}",
                    verdict(have >= want)
                ));
            }
        };
        let over = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b.max(1e-9));
        match case {
            Case::Publish => {
                goal(
                    "publish keratin / raw".into(),
                    over(k, raw),
                    GOAL_PUBLISH_VS_RAW,
                );
                goal(
                    "publish keratin / rabbitmq-quorum".into(),
                    over(k, rate(case, "rabbitmq-quorum")),
                    GOAL_PUBLISH_VS_QUORUM,
                );
                goal(
                    "publish keratin / nats".into(),
                    over(k, rate(case, "nats")),
                    GOAL_VS_NATS,
                );
            }
            Case::Consume => {
                goal(
                    "consume keratin / rabbitmq-classic".into(),
                    over(k, rate(case, "rabbitmq-classic")),
                    GOAL_CONSUME_VS_RABBIT,
                );
                goal(
                    "consume keratin / rabbitmq-quorum".into(),
                    over(k, rate(case, "rabbitmq-quorum")),
                    GOAL_CONSUME_VS_RABBIT,
                );
                goal(
                    "consume keratin / nats".into(),
                    over(k, rate(case, "nats")),
                    GOAL_VS_NATS,
                );
            }
            _ => {}
        }
    }
    if config.cases.contains(&Case::Latency) {
        let line = |name: &str| {
            results.latencies.get(name).map_or("-".to_string(), |l| {
                format!(
                    "{} / {} / {}",
                    ms(percentile(l, 0.5)),
                    ms(percentile(l, 0.99)),
                    ms(percentile(l, 0.999))
                )
            })
        };
        let p99 = |name: &str| results.latencies.get(name).map(|l| percentile(l, 0.99));
        let mut cells = vec![
            format!(
                "4. publish-to-confirm p50 / p99 / p99.9 at {} msg/s (ms)",
                config.latency_rate
            ),
            line("keratin"),
            "-".into(),
        ];
        cells.extend(peers.iter().map(|p| line(p)));
        cells.push("-".into());
        cells.extend(peers.iter().map(|p| match (p99("keratin"), p99(p)) {
            (Some(k), Some(v)) => format!("{:.2} (p99)", k as f64 / (v as f64).max(1.0)),
            _ => "-".into(),
        }));
        out += &format!("| {} |\n", cells.join(" | "));
        for peer in ["rabbitmq-classic", "rabbitmq-quorum"] {
            if let (Some(k), Some(v)) = (p99("keratin"), p99(peer)) {
                goals.push(format!(
                    "latency p99 keratin {} ms below {peer} {} ms: {}",
                    ms(k),
                    ms(v),
                    verdict(k < v)
                ));
            }
        }
    }
    if config.cases.contains(&Case::Rss) {
        let holding = |name: &str| results.rss.get(name).map(|r| r.1);
        let cell = |name: &str| {
            results.rss.get(name).map_or("-".into(), |(idle, holding)| {
                format!("{} (idle {})", mb(*holding), mb(*idle))
            })
        };
        let mut cells = vec![
            format!("5. resident memory holding {} queued", config.rss_messages),
            cell("keratin"),
            "-".into(),
        ];
        cells.extend(peers.iter().map(|p| cell(p)));
        cells.push("-".into());
        cells.extend(
            peers
                .iter()
                .map(|p| match (holding("keratin"), holding(p)) {
                    (Some(k), Some(v)) => format!("{:.2}", k as f64 / (v as f64).max(1.0)),
                    _ => "-".into(),
                }),
        );
        out += &format!("| {} |\n", cells.join(" | "));
        if let (Some(k), Some(n)) = (holding("keratin"), holding("nats")) {
            goals.push(format!(
                "memory keratin {} at most nats {}: {}",
                mb(k),
                mb(n),
                verdict(k <= n)
            ));
        }
    }
    if config.cases.contains(&Case::Fill) {
        out += "\n| 6. fill, 256 MiB tmpfs | accepted before push-back | what the publisher saw | least free space | broker survived | consumers drained | next publish accepted after drain |\n| --- | --- | --- | --- | --- | --- | --- |\n";
        for name in &systems {
            if let Some(f) = results.fill.get(*name) {
                out += &format!(
                    "| {name} | {} | {} | {} | {} | {} of {} | {} |\n",
                    mb(f.accepted_bytes),
                    f.publisher_saw.replace('|', "/"),
                    f.min_free_bytes.map_or("-".into(), mb),
                    if f.survived { "yes" } else { "NO" },
                    f.consumed,
                    f.accepted_bytes / config.body_bytes.max(1) as u64,
                    f.resume.map_or("not within 60 s".into(), |d| format!(
                        "{:.1} ms",
                        d.as_secs_f64() * 1e3
                    )),
                );
            }
        }
        if let Some(f) = results.fill.get("keratin") {
            goals.push(format!(
                "fill: keratin resumed {} (goal within {} s) {}",
                f.resume.map_or("never".into(), |d| format!(
                    "after {:.1} ms",
                    d.as_secs_f64() * 1e3
                )),
                GOAL_RESUME.as_secs(),
                verdict(f.resume.is_some_and(|d| d <= GOAL_RESUME) && f.survived)
            ));
        }
    }
    out += "\nWhat a confirm means:\n";
    for system in &config.systems {
        out += &format!("- {}: {}\n", system.name(), system.confirm_meaning());
    }
    if !goals.is_empty() {
        out += "\nGoals (ratios in this run):\n";
        for goal in goals {
            out += &format!("- {goal}\n");
        }
    }
    if config.rounds > 1 && !results.rates.is_empty() {
        out += "\nPer-round msg/s:\n";
        for ((case, column), v) in &results.rates {
            let v: Vec<String> = v.iter().map(|r| format!("{r:.0}")).collect();
            out += &format!("- {case:?} {column}: {}\n", v.join(" "));
        }
    }
    if !results.levels.is_empty() {
        out += &format!(
            "\nKeratin's disk level at the end of each publish run: {}\n",
            results.levels.join(" ")
        );
    }
    for note in &results.notes {
        out += &format!("- {note}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(batches: &[u64]) -> NodeCounters {
        NodeCounters {
            level: "normal".into(),
            write_bytes: batches.iter().sum(),
            sync_batches_bytes: batches.to_vec(),
        }
    }

    #[test]
    fn batches_share_the_messages_by_the_bytes_each_sync_covered() {
        // 3 syncs of 1, 2 and 1 units for 400 messages: 100, 200, 100.
        let c = counters(&[1040, 2080, 1040]);
        assert_eq!(batches_of(&c, 400), vec![100, 200, 100]);
        // A sync that covered less than one message (a seal) is not a batch.
        let c = counters(&[100_000, 10]);
        assert_eq!(batches_of(&c, 96), vec![96]);
        assert!(batches_of(&counters(&[]), 10).is_empty());
        assert!(batches_of(&counters(&[1024]), 0).is_empty());
    }

    #[test]
    fn cases_and_systems_parse_and_refuse_unknown_names() {
        assert_eq!(Case::parse(" fill "), Ok(Case::Fill));
        assert_eq!(Case::parse("rss"), Ok(Case::Rss));
        let error = Case::parse("flood").unwrap_err();
        assert!(
            error.contains("flood") && error.contains("publish"),
            "{error}"
        );
        for system in System::ALL {
            assert_eq!(System::parse(system.name()), Ok(system));
        }
        assert!(System::parse("kafka")
            .unwrap_err()
            .contains("rabbitmq-quorum"));
    }

    #[test]
    fn the_table_gives_keratin_over_peer_and_the_goals_verdicts() {
        let config = CompareConfig {
            dir: PathBuf::from("/nonexistent"),
            keratin_dir: None,
            keratin_config: None,
            endpoints: Endpoints::default(),
            rabbitmq_pid: None,
            nats_pid: None,
            rabbitmq_dir: None,
            nats_dir: None,
            systems: vec![System::Keratin, System::RabbitQuorum, System::Nats],
            cases: vec![Case::Publish],
            duration: Duration::from_secs(1),
            rounds: 1,
            body_bytes: 1024,
            in_flight: 1000,
            producers: 4,
            backlog: 10,
            prefetch: 10,
            latency_rate: 10,
            rss_messages: 10,
            out: None,
        };
        let mut results = Results::default();
        for (column, rate) in [
            ("keratin", 100_000.0),
            ("raw", 150_000.0),
            ("rabbitmq-quorum", 25_000.0),
            ("nats", 80_000.0),
        ] {
            results
                .rates
                .insert((Case::Publish, column.to_string()), vec![rate]);
        }
        let text = markdown(&config, &results);
        assert!(
            text.contains("| 100000 | 150000 | 25000 | 80000 | 0.67 | 4.00 | 1.25 |"),
            "{text}"
        );
        assert!(
            text.contains("keratin / rabbitmq-quorum: 4.00 (goal >= 5) MISSED"),
            "{text}"
        );
        assert!(
            text.contains("keratin / nats: 1.25 (goal >= 1) met"),
            "{text}"
        );
        assert!(text.contains("nats: NOT fsynced"), "{text}");
    }
}
