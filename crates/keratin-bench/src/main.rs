//! `keratin-bench`: scenario benchmarks of Keratin against a raw reference measured in the same
//! run, on the same file system, reported as a table of ratios (docs/benchmarks.md).
//!
//! # Layout
//! - `contender`: the `Contender` trait every storage under test implements, and its workloads.
//! - `keratin`: Keratin's log as a contender; `raw`: the `pwrite`+`fdatasync` / `pread` reference.
//! - `counting_io`: an `Io` wrapper that counts syncs and the batch each one covered.
//! - `page_cache`: dropping the page cache before reads, when root.
//! - `log_bench`: the `log` benchmark: interleaved rounds of appends, reads and recovery.
//! - `pool_bench`: the `pool` benchmark: appends into reused vs fresh segments, and log churn
//!   with and without the node's segment pool.
//! - `broker_bench`: the `broker` benchmark: publish+confirm, consume+ack and resident memory
//!   of the broker core in process.
//! - `net_bench`: the `net` benchmark: a node in process over TCP with the Rust client:
//!   publish+confirm and consume+ack vs raw, and publish-to-confirm latency at a fixed rate.
//! - `limits_bench`: the `limits` benchmark: the cost of admission (limits on vs off) and, as
//!   root on a tmpfs, the time from crossing hard to the first rejection and back.
//! - `compare`, `peers`: the `compare` benchmark: Keratin, RabbitMQ (AMQP 0-9-1 via `lapin`),
//!   NATS JetStream (`async-nats`) and the raw disk on one workload (issue 9; bench/compare.sh).
//! - `idle_bench`: the `idle` benchmark (issue 13): many idle queues (declare rate, disk,
//!   memory, threads, restart) against RabbitMQ and NATS, and confirmed publish spread over many
//!   queues; driven by `bench/compare.sh` with `MODE=idle`.
//! - `cluster_bench`, `cluster_ctl`, `cluster_failover`, `keratin_cluster_peer`: the
//!   `compare-cluster` benchmark (issue 14): three-node Keratin (replicas 3), RabbitMQ (quorum
//!   queue) and NATS (R3 stream) clusters started by `bench/cluster.sh` (`MODE=cluster`), and a
//!   single Keratin node in the same run: confirmed publish, consume + ack, paced confirm
//!   latency and leader failover (kill -9 by pid, restart through the script's `ctl` verbs).
//! - `tls_bench`: the `tls` benchmark (issue 16): confirmed publish over TLS vs plain TCP.
//! - `auth_bench`: the `auth` benchmark (issue 16): connections per second with a password or
//!   token login vs none, and the cost of permission checks per confirmed publish.
//! - `stream_bench`: the `stream` benchmark (issue 18): a Keratin stream against a NATS
//!   JetStream stream (limits retention) and the raw disk: confirmed publish, fan-out read by 1
//!   and 3 readers, sequential read vs raw (cold and warm), memory with 10 readers; driven by
//!   `bench/compare.sh` with `MODE=stream`.
//! - `nemesis`, `nemesis_schedule`, `nemesis_check`: the `nemesis` command (issue 38): 3 or 5
//!   real `keratin serve` processes, a workload through different nodes, a seeded schedule of
//!   kills, pauses, wipes and segment corruption, then healing, draining and the checks of
//!   Keratin's delivery promises (docs/reliability.md).
//! - `report`: the table, its JSON form, medians and percentiles.

mod auth_bench;
mod broker_bench;
mod cluster_bench;
mod cluster_ctl;
mod cluster_failover;
mod compare;
mod contender;
mod counting_io;
mod idle_bench;
mod keratin;
mod keratin_cluster_peer;
mod limits_bench;
mod limits_cluster;
mod log_bench;
mod nemesis;
mod nemesis_check;
mod nemesis_schedule;
mod net_bench;
mod overflow_bench;
mod page_cache;
mod peers;
mod pool_bench;
mod raw;
mod report;
mod stream_bench;
mod tls_bench;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::contender::BenchResult;
use crate::log_bench::{filesystem_name, human_bytes, LogBenchConfig};
use crate::page_cache::PageCache;

#[derive(Debug, Parser)]
#[command(
    name = "keratin-bench",
    about = "Keratin against a raw reference, as ratios"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The storage engine: durable appends with group commit vs pwrite+fdatasync with the same
    /// batch sizes; sequential read and recovery vs a raw read of the same files.
    Log(LogArgs),
    /// The segment pool: synced appends into a reused segment, a fresh preallocated one and raw
    /// files (grown, preallocated, reused); log churn with the node pool vs private pools.
    Pool(PoolArgs),
    /// The broker core in process: publish+confirm and consume+ack of 1 KiB messages on 1 and 4
    /// partitions vs raw pwrite+fdatasync with the same batches; resident memory when queued.
    Broker(BrokerArgs),
    /// The broker on the network: a node in process, the Rust client over TCP: confirmed publish
    /// and consume+ack of 1 KiB messages vs raw pwrite+fdatasync with the same batches, and
    /// publish-to-confirm latency at a fixed rate.
    Net(NetArgs),
    /// Resource limits: confirmed publish with limits on (all levels clear) vs off, and (as root,
    /// on a tmpfs) the time from crossing hard to the first rejection and back.
    Limits(LimitsArgs),
    /// Per-queue limits: publishing into a full drop_oldest queue (each publish drops one)
    /// vs into an unlimited queue.
    Overflow(OverflowArgs),
    /// TLS on the protocol port: confirmed publish over TLS vs plain TCP, alternating.
    Tls(TlsArgs),
    /// Logins and permission checks: connections per second with a password or token login
    /// vs none, and confirmed publish as a user with ten rules vs a node without logins.
    Auth(AuthArgs),
    /// Keratin against RabbitMQ (classic and quorum queues) and NATS JetStream, started by
    /// bench/compare.sh, and the raw disk: one table of figures and ratios (Keratin / peer).
    Compare(Box<CompareArgs>),
    /// Many idle queues (issue 13), one phase per call, driven by bench/compare.sh (MODE=idle):
    /// declare rate, disk, memory, threads and restart time against RabbitMQ and NATS, and
    /// confirmed publish spread over many queues vs 4.
    Idle(Box<IdleArgs>),
    /// Three-node clusters (issue 14), started by bench/cluster.sh (MODE=cluster bash
    /// bench/compare.sh): RabbitMQ quorum queue and NATS R3 stream (keratin-cluster reserved):
    /// confirmed publish, consume + ack, paced confirm latency and leader failover, as one table
    /// with ratios between systems.
    CompareCluster(Box<CompareClusterArgs>),
    /// Streams (issue 18): confirmed publish into a stream and fan-out read by 1 and 3 readers
    /// against NATS JetStream (limits retention), sequential read against the raw disk, and
    /// Keratin's memory with 10 readers on a large stream; driven by bench/compare.sh
    /// (MODE=stream), which starts nats-server.
    Stream(Box<StreamArgs>),
    /// Fault injection on real processes: 3 or 5 `keratin serve` nodes, producers and consumers
    /// through different nodes, a seeded schedule of faults, then healing, draining and checks
    /// (nothing confirmed lost, no duplicates, no unflagged redelivery, order, dead letters,
    /// no stall). Exits non-zero with the replay command on any violation.
    Nemesis(NemesisArgs),
    /// The Keratin node of `compare`, as a child process.
    #[command(hide = true)]
    CompareNode {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The child process of `broker`'s memory figure.
    #[command(hide = true)]
    BrokerRss {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        messages: usize,
        #[arg(long, default_value_t = 32)]
        body_bytes: usize,
    },
    /// A seconds-long run of every case with tiny sizes, in a temporary directory (CI).
    Smoke {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
struct NemesisArgs {
    /// Nodes: 3 or 5.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// The schedule's seed: the same seed plays the same faults on the same victims.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds from the start of the nodes after which no new fault begins (the step under
    /// way, healing, draining and checking come after).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Fault kinds, comma-separated: kill, kill-majority, kill-all, pause, wipe, corrupt.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kill,kill-majority,kill-all,pause,wipe,corrupt"
    )]
    faults: Vec<String>,
    /// The `keratin` binary (default: `keratin` next to this program).
    #[arg(long)]
    keratin: Option<PathBuf>,
    /// Keep the data directories and node logs in this directory (default: a temporary one,
    /// removed at the end).
    #[arg(long)]
    keep: Option<PathBuf>,
}

fn nemesis_config(args: &NemesisArgs) -> BenchResult<nemesis::NemesisConfig> {
    let faults = args
        .faults
        .iter()
        .map(|f| nemesis_schedule::FaultKind::parse(f))
        .collect::<Result<Vec<_>, _>>()?;
    let keratin = match &args.keratin {
        Some(path) => path.clone(),
        None => std::env::current_exe()?
            .parent()
            .map(|dir| dir.join("keratin"))
            .ok_or("cannot tell this program's directory; give --keratin")?,
    };
    if !keratin.is_file() {
        return Err(format!(
            "no keratin binary at {} (build it with `cargo build -p keratin`, or give --keratin)",
            keratin.display()
        )
        .into());
    }
    Ok(nemesis::NemesisConfig {
        nodes: args.nodes,
        seed: args.seed,
        seconds: args.seconds,
        faults,
        keratin,
        keep: args.keep.clone(),
    })
}

#[derive(Debug, clap::Args)]
struct CompareArgs {
    /// Directory on the file system under test: Keratin's data and the raw reference's files.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Keratin's data directory (default: a fresh one under --dir, removed afterwards).
    #[arg(long)]
    keratin_dir: Option<PathBuf>,
    /// A Keratin configuration file (the fill case's limits).
    #[arg(long)]
    keratin_config: Option<PathBuf>,
    /// RabbitMQ's AMQP URI.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp: String,
    /// The NATS server's URL.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// RabbitMQ's process id (its memory is that of the process and its children).
    #[arg(long)]
    rabbitmq_pid: Option<u32>,
    /// The NATS server's process id.
    #[arg(long)]
    nats_pid: Option<u32>,
    /// RabbitMQ's data directory (free space in the fill case).
    #[arg(long)]
    rabbitmq_dir: Option<PathBuf>,
    /// The NATS server's data directory (free space in the fill case).
    #[arg(long)]
    nats_dir: Option<PathBuf>,
    /// Systems, comma-separated: keratin, rabbitmq-classic, rabbitmq-quorum, nats.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "keratin,rabbitmq-classic,rabbitmq-quorum,nats"
    )]
    systems: Vec<String>,
    /// Cases, comma-separated: publish, producers, consume, latency, rss, fill.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "publish,producers,consume,latency,rss"
    )]
    cases: Vec<String>,
    /// Seconds of each publish and latency run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Rounds; the systems alternate within them (A B C D, then D C B A).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Body bytes.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Most confirmed publishes in flight per producer.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Producers (each its own connection and queue) of the `producers` case.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Messages queued before each consume run.
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Unacked deliveries at most.
    #[arg(long, default_value_t = 1000)]
    prefetch: u32,
    /// Messages per second of the latency case.
    #[arg(long, default_value_t = 5000)]
    latency_rate: u32,
    /// Messages queued for the memory figure.
    #[arg(long, default_value_t = 1_000_000)]
    rss_messages: u64,
    /// Also write the markdown section to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct StreamArgs {
    /// Directory on the file system under test: Keratin's data and the raw file (a fresh
    /// directory under it, removed afterwards).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// A Keratin configuration file (bench/compare.sh's lowered disk levels).
    #[arg(long)]
    keratin_config: Option<PathBuf>,
    /// The NATS server's URL; without it only Keratin and the raw disk run.
    #[arg(long)]
    nats: Option<String>,
    /// GiB of payload in the stream of the publish and read cases.
    #[arg(long, default_value_t = 1.0)]
    stream_gib: f64,
    /// Body bytes.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Confirmed publishes in flight (both systems).
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Rounds; each runs keratin, nats and raw in turn.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Concurrent readers of the fan-out case.
    #[arg(long, default_value_t = 3)]
    fan_out: usize,
    /// A Keratin reader's credit, in messages (the client's default; 10,000 was no faster).
    #[arg(long, default_value_t = keratin_client::STREAM_CREDIT_DEFAULT)]
    credit: u32,
    /// How NATS reads: ordered-push or ordered-pull (push was the faster here).
    #[arg(long, default_value = "ordered-push")]
    nats_consumer: String,
    /// Read from a warm cache only (by default, as root, each read runs cold, then warm).
    #[arg(long)]
    no_drop_caches: bool,
    /// GiB of payload in the memory case's stream; 0 skips the case.
    #[arg(long, default_value_t = 10.0)]
    rss_gib: f64,
    /// Readers of the memory case.
    #[arg(long, default_value_t = 10)]
    rss_readers: usize,
    /// Seconds the memory case's readers read at most.
    #[arg(long, default_value_t = 60.0)]
    rss_seconds: f64,
    /// Also write the markdown section to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct CompareClusterArgs {
    /// Systems, comma-separated: keratin-cluster, keratin-single (one node started by the
    /// harness on --dir), rabbitmq-quorum, nats-r3.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "keratin-cluster,keratin-single,rabbitmq-quorum,nats-r3"
    )]
    systems: Vec<String>,
    /// Cases, comma-separated: publish, publish-3 (3 producers), publish-3p and publish-3p-3
    /// (1 and 3 producers on a Keratin queue of 3 partitions led by 3 nodes), consume,
    /// latency, failover.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "publish,publish-3,publish-3p,publish-3p-3,consume,latency,failover"
    )]
    cases: Vec<String>,
    /// AMQP URIs of the 3 RabbitMQ nodes, node 1 first (bench/cluster.sh's ports by default).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "amqp://guest:guest@127.0.0.1:25701/%2f,amqp://guest:guest@127.0.0.1:25702/%2f,amqp://guest:guest@127.0.0.1:25703/%2f"
    )]
    amqp_nodes: Vec<String>,
    /// URLs of the 3 NATS servers, n1 first.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nats://127.0.0.1:24231,nats://127.0.0.1:24232,nats://127.0.0.1:24233"
    )]
    nats_nodes: Vec<String>,
    /// Client addresses of the 3 Keratin nodes, node 1 first (bench/cluster.sh's ports).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "127.0.0.1:25721,127.0.0.1:25722,127.0.0.1:25723"
    )]
    keratin_nodes: Vec<String>,
    /// Where keratin-single keeps its data (a fresh directory under it, removed at the end).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// The node control command, words separated by spaces, e.g. "bash bench/cluster.sh ctl"
    /// (verbs pid, restart, leader); needed by the failover case and to find a RabbitMQ
    /// queue's leader.
    #[arg(long)]
    ctl: Option<String>,
    /// Seconds of each publish and latency run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds; the systems alternate within them (A B, then B A).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Body bytes.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Most confirmed publishes in flight.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Messages queued before each consume run.
    #[arg(long, default_value_t = 50_000)]
    backlog: u64,
    /// Unacked deliveries at most.
    #[arg(long, default_value_t = 1000)]
    prefetch: u32,
    /// Messages per second of the latency case.
    #[arg(long, default_value_t = 5000)]
    latency_rate: u32,
    /// Messages per second of the failover producer.
    #[arg(long, default_value_t = 1000)]
    failover_rate: u32,
    /// Also write the markdown section to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct IdleArgs {
    /// declare (fresh broker: declare the queues, then disk, memory, threads), restart (the
    /// broker was restarted at --since-ns: time until every queue answers; Keratin: the spread
    /// case), report (the table from the --file of each system).
    #[arg(long)]
    phase: String,
    /// keratin, rabbitmq-classic, rabbitmq-quorum or nats (declare, restart).
    #[arg(long)]
    system: Option<String>,
    /// Keratin's protocol address.
    #[arg(long, default_value = "127.0.0.1:5680")]
    keratin: std::net::SocketAddr,
    /// RabbitMQ's AMQP URI.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp: String,
    /// The NATS server's URL.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// The broker's process id: memory and threads of it and its children.
    #[arg(long)]
    pid: Option<u32>,
    /// The broker's data directory (disk used).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Queues to declare.
    #[arg(long, default_value_t = 10_000)]
    queues: usize,
    /// Declares (and checks after the restart) in flight.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seconds to wait after the declares before disk, memory and threads are read.
    #[arg(long, default_value_t = 3.0)]
    settle: f64,
    /// When the restart began, in ns since the Unix epoch (`date +%s%N`).
    #[arg(long)]
    since_ns: Option<u128>,
    /// Seconds after the restart began until every queue must answer (else the phase fails
    /// and says so in the figures).
    #[arg(long, default_value_t = 1200.0)]
    restart_timeout: f64,
    /// Queues the spread case publishes over (Keratin, restart phase; 0 skips it).
    #[arg(long, default_value_t = 1000)]
    spread: usize,
    /// Producers (connections) of the spread case.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Confirmed publishes in flight per producer.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Seconds of each publish run of the spread case.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Rounds of the spread case (the two loads alternate which goes first).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Body bytes of the spread case.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// The system's JSON file (declare, restart); every system's (report), repeatable.
    #[arg(long = "file")]
    files: Vec<PathBuf>,
    /// report: also write the markdown here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// report: a line printed under the table; repeatable.
    #[arg(long)]
    note: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct TlsArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Seconds of each publish run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds; TLS and plain alternate within them.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Most confirmed publishes in flight from the one producer.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct AuthArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Rounds of each part; the cases alternate within them.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Connections per round with no login, a cached password and a token.
    #[arg(long, default_value_t = 500)]
    connections: usize,
    /// Connections per round with a password the node has not verified yet (argon2id each).
    #[arg(long, default_value_t = 20)]
    cold_connections: usize,
    /// Seconds of each publish run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Most confirmed publishes in flight from the one producer.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// `Grant::check` calls timed per round.
    #[arg(long, default_value_t = 1_000_000)]
    check_calls: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct OverflowArgs {
    /// Directory on the file system under test.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Seconds of publishing per run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds; the two cases alternate.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The full queue's max_messages.
    #[arg(long, default_value_t = 10_000)]
    max_messages: u64,
}

#[derive(Debug, clap::Args)]
struct LogArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Seconds of each append run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds of each case; Keratin and the reference alternate within them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Payload bytes of one record.
    #[arg(long, default_value_t = 1024)]
    record_bytes: usize,
    /// Appender counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    appenders: Vec<usize>,
    /// Payload bytes of the log that is read and recovered (suffixes K, M, G, KiB, MiB, GiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    read_bytes: u64,
    /// Run only the append cases.
    #[arg(long, conflicts_with = "read_only")]
    append_only: bool,
    /// Run only the read and recovery cases.
    #[arg(long)]
    read_only: bool,
    /// Never drop the page cache, even as root (reads then come from memory).
    #[arg(long)]
    no_drop_caches: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct PoolArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Rounds; every case runs once per round, in alternating order.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Synced single-record appends per latency run.
    #[arg(long, default_value_t = 3000)]
    records: usize,
    /// Payload bytes of one record.
    #[arg(long, default_value_t = 1024)]
    record_bytes: usize,
    /// Segment size of the latency runs (suffixes K, M, G).
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    segment_bytes: u64,
    /// Logs created, filled and deleted per churn run.
    #[arg(long, default_value_t = 200)]
    churn_logs: usize,
    /// Segment size of the churn logs.
    #[arg(long, default_value = "1MiB", value_parser = parse_bytes)]
    churn_segment_bytes: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct BrokerArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Seconds of each publish run and of each reference run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds of each case; Keratin and the reference alternate within them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Partition counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    partitions: Vec<u32>,
    /// Concurrent publishers.
    #[arg(long, default_value_t = 8)]
    publishers: usize,
    /// Messages per publish.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Messages queued before each consume run.
    #[arg(long, default_value_t = 200_000)]
    backlog: usize,
    /// Prefetch of the consumer.
    #[arg(long, default_value_t = 1000)]
    prefetch: u32,
    /// Queued 32-byte messages for the memory figure (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    rss_messages: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct NetArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Seconds of each publish, reference and latency run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds of each case; Keratin and the reference alternate within them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Most confirmed publishes in flight from the one producer.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Messages queued before each consume run.
    #[arg(long, default_value_t = 200_000)]
    backlog: usize,
    /// Prefetch of the consumer.
    #[arg(long, default_value_t = 1000)]
    prefetch: u32,
    /// Messages per second of the latency run (0 skips it).
    #[arg(long, default_value_t = 5000)]
    latency_rate: u32,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct LimitsArgs {
    /// Directory on the file system under test; a `keratin-bench-<pid>` directory is made in it
    /// and removed afterwards (the tmpfs is mounted inside it).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Seconds of each publish run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds of the on/off comparison; on and off alternate within them.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Most confirmed publishes in flight from the one producer.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Trials of the reaction-time case per sample interval (root only; 0 skips it).
    #[arg(long, default_value_t = 5)]
    trials: usize,
    /// Sample intervals of the reaction-time case, ms, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,100")]
    intervals_ms: Vec<u64>,
    /// Size of the tmpfs, MiB.
    #[arg(long, default_value_t = 512)]
    tmpfs_mib: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|e| format!("{text:?}: {e}"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        other => return Err(format!("{text:?}: unknown unit {other:?}; use K, M or G")),
    };
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Log(args) => run_log(&args),
        Command::Pool(args) => run_pool(&args),
        Command::Broker(args) => run_broker(&args),
        Command::Net(args) => run_net(&args),
        Command::Limits(args) => run_limits(&args),
        Command::Tls(args) => run_tls(&args),
        Command::Auth(args) => run_auth(&args),
        Command::Overflow(args) => overflow_bench::run(&overflow_config(&args)),
        Command::BrokerRss {
            dir,
            messages,
            body_bytes,
        } => broker_bench::rss(&dir, messages, body_bytes),
        Command::Compare(args) => compare_config(&args).and_then(|c| compare::run(&c)),
        Command::Idle(args) => idle_config(&args).and_then(|c| idle_bench::run(&c)),
        Command::CompareCluster(args) => cluster_config(&args).and_then(|c| cluster_bench::run(&c)),
        Command::Stream(args) => stream_config(&args).and_then(|c| stream_bench::run(&c)),
        Command::CompareNode { dir, config } => compare::node_main(&dir, config.as_deref()),
        Command::Smoke { json } => run_smoke(json),
        Command::Nemesis(args) => nemesis_config(&args).and_then(|c| nemesis::run(&c)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("keratin-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run_log(args: &LogArgs) -> BenchResult<()> {
    if args.rounds == 0 || args.appenders.contains(&0) || args.record_bytes == 0 {
        return Err("--rounds, --appenders and --record-bytes must be at least 1".into());
    }
    let config = LogBenchConfig {
        dir: args.dir.clone(),
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        record_bytes: args.record_bytes,
        appenders: args.appenders.clone(),
        read_bytes: args.read_bytes,
        append_only: args.append_only,
        read_only: args.read_only,
    };
    run_in_work_dir(config, !args.no_drop_caches, args.json)
}

fn compare_config(args: &CompareArgs) -> BenchResult<compare::CompareConfig> {
    if args.rounds == 0 || args.body_bytes == 0 || args.in_flight == 0 || args.producers == 0 {
        return Err(
            "--rounds, --body-bytes, --in-flight and --producers must be at least 1".into(),
        );
    }
    let systems = args
        .systems
        .iter()
        .map(|s| peers::System::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let cases = args
        .cases
        .iter()
        .map(|c| compare::Case::parse(c))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(compare::CompareConfig {
        dir: args.dir.clone(),
        keratin_dir: args.keratin_dir.clone(),
        keratin_config: args.keratin_config.clone(),
        endpoints: peers::Endpoints {
            keratin: None,
            amqp: Some(args.amqp.clone()),
            nats: Some(args.nats.clone()),
        },
        rabbitmq_pid: args.rabbitmq_pid,
        nats_pid: args.nats_pid,
        rabbitmq_dir: args.rabbitmq_dir.clone(),
        nats_dir: args.nats_dir.clone(),
        systems,
        cases,
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        body_bytes: args.body_bytes,
        in_flight: args.in_flight,
        producers: args.producers,
        backlog: args.backlog,
        prefetch: args.prefetch.max(1),
        latency_rate: args.latency_rate.max(1),
        rss_messages: args.rss_messages,
        out: args.out.clone(),
    })
}

fn cluster_config(args: &CompareClusterArgs) -> BenchResult<cluster_bench::ClusterConfig> {
    if args.rounds == 0 || args.body_bytes < 8 || args.in_flight == 0 {
        return Err("--rounds and --in-flight must be at least 1, --body-bytes at least 8".into());
    }
    let systems = args
        .systems
        .iter()
        .map(|s| cluster_bench::ClusterSystem::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let cases = args
        .cases
        .iter()
        .map(|c| cluster_bench::ClusterCase::parse(c))
        .collect::<Result<Vec<_>, _>>()?;
    let ctl = args
        .ctl
        .as_deref()
        .map(cluster_ctl::NodeCtl::parse)
        .transpose()?;
    Ok(cluster_bench::ClusterConfig {
        systems,
        cases,
        amqp_nodes: args.amqp_nodes.clone(),
        nats_nodes: args.nats_nodes.clone(),
        keratin_nodes: args.keratin_nodes.clone(),
        dir: args.dir.clone(),
        keratin_single: None,
        ctl,
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        body_bytes: args.body_bytes,
        in_flight: args.in_flight,
        backlog: args.backlog,
        prefetch: args.prefetch.max(1),
        latency_rate: args.latency_rate.max(1),
        failover_rate: args.failover_rate.max(1),
        out: args.out.clone(),
    })
}

fn idle_config(args: &IdleArgs) -> BenchResult<idle_bench::IdleConfig> {
    let system = args
        .system
        .as_deref()
        .map(peers::System::parse)
        .transpose()?;
    Ok(idle_bench::IdleConfig {
        phase: args.phase.clone(),
        system,
        endpoints: peers::Endpoints {
            keratin: Some(args.keratin),
            amqp: Some(args.amqp.clone()),
            nats: Some(args.nats.clone()),
        },
        pid: args.pid,
        data_dir: args.data_dir.clone(),
        queues: args.queues,
        concurrency: args.concurrency.max(1),
        settle: Duration::from_secs_f64(args.settle.max(0.0)),
        since_ns: args.since_ns,
        restart_timeout: Duration::from_secs_f64(args.restart_timeout.max(1.0)),
        spread: args.spread,
        producers: args.producers.max(1),
        in_flight: args.in_flight.max(1),
        duration: Duration::from_secs_f64(args.seconds.max(0.1)),
        rounds: args.rounds.max(1),
        body_bytes: args.body_bytes.max(1),
        files: args.files.clone(),
        out: args.out.clone(),
        note: args.note.clone(),
    })
}

fn stream_config(args: &StreamArgs) -> BenchResult<stream_bench::StreamBenchConfig> {
    let gib = |value: f64, flag: &str| -> BenchResult<u64> {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("--{flag} {value}: expected GiB, 0 or more").into());
        }
        Ok((value * f64::from(1u32 << 30)) as u64)
    };
    if args.body_bytes == 0 || args.in_flight == 0 || args.rounds == 0 || args.fan_out == 0 {
        return Err("--body-bytes, --in-flight, --rounds and --fan-out must be at least 1".into());
    }
    let dir = make_work_dir(&args.dir)?;
    Ok(stream_bench::StreamBenchConfig {
        dir,
        keratin_config: args.keratin_config.clone(),
        nats: args.nats.clone(),
        stream_bytes: gib(args.stream_gib, "stream-gib")?.max(args.body_bytes as u64),
        body_bytes: args.body_bytes,
        in_flight: args.in_flight,
        rounds: args.rounds,
        fan_out: args.fan_out,
        credit: args.credit,
        nats_consumer: stream_bench::NatsConsumer::parse(&args.nats_consumer)?,
        drop_caches: !args.no_drop_caches,
        rss_bytes: gib(args.rss_gib, "rss-gib")?,
        rss_readers: args.rss_readers,
        rss_duration: Duration::from_secs_f64(args.rss_seconds.max(0.0)),
        out: args.out.clone(),
    })
}

fn overflow_config(args: &OverflowArgs) -> overflow_bench::OverflowBenchConfig {
    overflow_bench::OverflowBenchConfig {
        dir: args.dir.clone(),
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds.max(1),
        publishers: 8,
        batch: 16,
        body_bytes: 1024,
        max_messages: args.max_messages.max(1),
    }
}

fn run_smoke(json: bool) -> BenchResult<()> {
    let base = std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let config = LogBenchConfig {
        dir: base.clone(),
        duration: Duration::from_secs(1),
        rounds: 1,
        record_bytes: 1024,
        appenders: vec![1, 8, 64],
        read_bytes: 16 << 20,
        append_only: false,
        read_only: false,
    };
    run_in_work_dir(config, true, json)?;
    let pool = PoolArgs {
        dir: base.clone(),
        rounds: 1,
        records: 100,
        record_bytes: 1024,
        segment_bytes: 4 << 20,
        churn_logs: 10,
        churn_segment_bytes: 1 << 20,
        json,
    };
    run_pool(&pool)?;
    let broker = BrokerArgs {
        dir: base.clone(),
        seconds: 0.5,
        rounds: 1,
        partitions: vec![1, 4],
        publishers: 8,
        batch: 64,
        backlog: 5_000,
        prefetch: 1000,
        rss_messages: 20_000,
        json,
    };
    run_broker(&broker)?;
    let net = NetArgs {
        dir: base.clone(),
        seconds: 0.5,
        rounds: 1,
        in_flight: 1000,
        backlog: 5_000,
        prefetch: 1000,
        latency_rate: 5000,
        json,
    };
    run_net(&net)?;
    let limits = LimitsArgs {
        dir: base,
        seconds: 0.5,
        rounds: 1,
        in_flight: 1000,
        trials: 1,
        intervals_ms: vec![100],
        tmpfs_mib: 256,
        json,
    };
    run_limits(&limits)?;
    run_tls(&TlsArgs {
        dir: std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from),
        seconds: 0.5,
        rounds: 1,
        in_flight: 1000,
        json,
    })?;
    run_auth(&AuthArgs {
        dir: std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from),
        rounds: 1,
        connections: 20,
        cold_connections: 2,
        seconds: 0.3,
        in_flight: 64,
        check_calls: 10_000,
        json,
    })?;
    overflow_bench::run(&overflow_config(&OverflowArgs {
        dir: std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from),
        seconds: 0.5,
        rounds: 1,
        max_messages: 2_000,
    }))?;
    // The comparison's harness against Keratin alone: every case but fill, tiny figures.
    let compare = CompareArgs {
        dir: std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from),
        keratin_dir: None,
        keratin_config: None,
        amqp: String::new(),
        nats: String::new(),
        rabbitmq_pid: None,
        nats_pid: None,
        rabbitmq_dir: None,
        nats_dir: None,
        systems: vec!["keratin".into()],
        cases: ["publish", "producers", "consume", "latency", "rss"]
            .map(String::from)
            .to_vec(),
        seconds: 0.5,
        rounds: 1,
        body_bytes: 1024,
        in_flight: 1000,
        producers: 4,
        backlog: 5_000,
        prefetch: 1000,
        latency_rate: 5000,
        rss_messages: 20_000,
        out: None,
    };
    compare::run(&compare_config(&compare)?)?;
    // The cluster comparison's harness against its single Keratin node: the cases without a
    // cluster (the three-node contenders need `bench/cluster.sh`), tiny figures.
    let cluster = Cli::try_parse_from([
        "keratin-bench",
        "compare-cluster",
        "--systems",
        "keratin-single",
        "--cases",
        "publish,consume,latency",
        "--seconds",
        "0.5",
        "--rounds",
        "1",
        "--backlog",
        "5000",
    ])
    .map_err(|e| format!("smoke compare-cluster arguments: {e}"))?;
    if let Command::CompareCluster(mut args) = cluster.command {
        args.dir =
            std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
        cluster_bench::run(&cluster_config(&args)?)?;
    }
    // The streams benchmark against Keratin and the raw file alone (NATS needs
    // `MODE=stream bench/compare.sh`): 16 MiB streams, the memory case for a second.
    let stream = Cli::try_parse_from([
        "keratin-bench",
        "stream",
        "--stream-gib",
        "0.015625",
        "--rounds",
        "1",
        "--rss-gib",
        "0.03125",
        "--rss-seconds",
        "1",
        "--no-drop-caches",
    ])
    .map_err(|e| format!("smoke stream arguments: {e}"))?;
    if let Command::Stream(mut args) = stream.command {
        args.dir =
            std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
        stream_bench::run(&stream_config(&args)?)?;
    }
    eprintln!("smoke: every case ran (figures of a seconds-long run are not benchmark results)");
    Ok(())
}

/// A fresh `keratin-bench-<pid>` directory under `dir`.
fn make_work_dir(dir: &Path) -> BenchResult<PathBuf> {
    let work_dir = dir.join(format!("keratin-bench-{}", std::process::id()));
    std::fs::create_dir_all(dir)?;
    std::fs::create_dir(&work_dir).map_err(|e| format!("create {}: {e}", work_dir.display()))?;
    Ok(work_dir)
}

/// Where, on what, and how loaded: the lines above a report.
fn run_context(work_dir: &Path, load_before: &str) -> Vec<(String, String)> {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let args: Vec<String> = std::env::args().collect();
    vec![
        ("command".into(), args.join(" ")),
        (
            "directory".into(),
            format!("{} ({})", work_dir.display(), filesystem_name(work_dir)),
        ),
        (
            "machine".into(),
            format!("{cores} cores, Linux {}", kernel.trim()),
        ),
        (
            "load average before/after".into(),
            format!("{load_before} / {}", load_average()),
        ),
    ]
}

fn run_pool(args: &PoolArgs) -> BenchResult<()> {
    if args.rounds == 0 || args.records == 0 || args.churn_logs == 0 || args.record_bytes == 0 {
        return Err(
            "--rounds, --records, --churn-logs and --record-bytes must be at least 1".into(),
        );
    }
    let work_dir = make_work_dir(&args.dir)?;
    let load_before = load_average();
    let config = pool_bench::PoolBenchConfig {
        dir: work_dir.clone(),
        rounds: args.rounds,
        records: args.records,
        record_bytes: args.record_bytes,
        segment_bytes: args.segment_bytes,
        churn_logs: args.churn_logs,
        churn_segment_bytes: args.churn_segment_bytes,
    };
    let result = pool_bench::run(&config);
    let context = run_context(&work_dir, &load_before);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    if args.json {
        let context: serde_json::Map<String, serde_json::Value> = context
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::String(v)))
            .collect();
        let out = serde_json::json!({"context": context, "pool": report.json});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        for (key, value) in context {
            println!("{key}: {value}");
        }
        println!();
        print!("{}", report.text);
    }
    Ok(())
}

fn run_broker(args: &BrokerArgs) -> BenchResult<()> {
    if args.rounds == 0
        || args.partitions.contains(&0)
        || args.publishers == 0
        || args.batch == 0
        || args.backlog == 0
        || args.prefetch == 0
    {
        return Err("--rounds, --partitions, --publishers, --batch, --backlog and --prefetch must be at least 1".into());
    }
    let work_dir = make_work_dir(&args.dir)?;
    let load_before = load_average();
    let config = broker_bench::BrokerBenchConfig {
        dir: work_dir.clone(),
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        body_bytes: 1024,
        partitions: args.partitions.clone(),
        publishers: args.publishers,
        batch: args.batch,
        backlog: args.backlog,
        prefetch: args.prefetch,
        rss_messages: args.rss_messages,
        rss_body_bytes: 32,
    };
    let result = broker_bench::run(&config);
    let mut context = run_context(&work_dir, &load_before);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let mut report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    context.push((
        "method".into(),
        format!(
            "{} round(s) per case, keratin and raw alternating (K R, R K, ...); {} s per publish \
             and raw run; medians; ratio = keratin / raw, median of per-round ratios; raw = one \
             thread per partition doing pwrite of one batch of {} B payloads + fdatasync, \
             replaying keratin's messages per sync",
            args.rounds, args.seconds, config.body_bytes
        ),
    ));
    report.context = context;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn run_net(args: &NetArgs) -> BenchResult<()> {
    if args.rounds == 0 || args.in_flight == 0 || args.backlog == 0 || args.prefetch == 0 {
        return Err("--rounds, --in-flight, --backlog and --prefetch must be at least 1".into());
    }
    let work_dir = make_work_dir(&args.dir)?;
    let load_before = load_average();
    let config = net_bench::NetBenchConfig {
        dir: work_dir.clone(),
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        body_bytes: 1024,
        in_flight: args.in_flight,
        backlog: args.backlog,
        prefetch: args.prefetch,
        latency_rate: args.latency_rate,
    };
    let result = net_bench::run(&config);
    let mut context = run_context(&work_dir, &load_before);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let mut report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    context.push((
        "method".into(),
        format!(
            "{} round(s) per case, keratin and raw alternating (K R, R K, ...); {} s per publish, \
             raw and latency run; node in process (Node::start_with_io on a counting Io, default \
             limits), client over TCP on 127.0.0.1; medians; ratio = keratin / raw, median of \
             per-round ratios; raw = one thread doing pwrite of one batch of {} B payloads + \
             fdatasync, replaying keratin's messages per sync",
            args.rounds, args.seconds, config.body_bytes
        ),
    ));
    report.context = context;
    print_report(&report, args.json)
}

fn run_limits(args: &LimitsArgs) -> BenchResult<()> {
    if args.rounds == 0 || args.in_flight == 0 || args.intervals_ms.contains(&0) {
        return Err("--rounds, --in-flight and --intervals-ms must be at least 1".into());
    }
    let work_dir = make_work_dir(&args.dir)?;
    let load_before = load_average();
    let config = limits_bench::LimitsBenchConfig {
        dir: work_dir.clone(),
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        body_bytes: 1024,
        in_flight: args.in_flight,
        trials: args.trials,
        intervals_ms: args.intervals_ms.clone(),
        tmpfs_mib: args.tmpfs_mib,
    };
    let result = limits_bench::run(&config);
    let mut context = run_context(&work_dir, &load_before);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let mut report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    context.push((
        "method".into(),
        format!(
            "{} round(s), limits on and off alternating (on off, off on, ...); {} s per run; \
             a server assembled as Node does (broker + tcp::serve), client over TCP on \
             127.0.0.1; medians; ratio = on / off, median of per-round ratios",
            args.rounds, args.seconds
        ),
    ));
    report.context = context;
    print_report(&report, args.json)
}

fn run_tls(args: &TlsArgs) -> BenchResult<()> {
    if args.rounds == 0 || args.in_flight == 0 {
        return Err("--rounds and --in-flight must be at least 1".into());
    }
    let work_dir = make_work_dir(&args.dir)?;
    let load_before = load_average();
    let config = tls_bench::TlsBenchConfig {
        dir: work_dir.clone(),
        duration: Duration::from_secs_f64(args.seconds),
        rounds: args.rounds,
        body_bytes: 1024,
        in_flight: args.in_flight,
    };
    let result = tls_bench::run(&config);
    let mut context = run_context(&work_dir, &load_before);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let mut report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    context.push((
        "method".into(),
        format!(
            "{} round(s), TLS and plain alternating (T P, P T, ...); {} s per run; a node in \
             process per run, the Rust client over 127.0.0.1; ratio = TLS / plain, median of \
             per-round ratios",
            args.rounds, args.seconds
        ),
    ));
    report.context = context;
    print_report(&report, args.json)
}

fn run_auth(args: &AuthArgs) -> BenchResult<()> {
    if args.rounds == 0 || args.in_flight == 0 || args.connections == 0 {
        return Err("--rounds, --in-flight and --connections must be at least 1".into());
    }
    let work_dir = make_work_dir(&args.dir)?;
    let load_before = load_average();
    let config = auth_bench::AuthBenchConfig {
        dir: work_dir.clone(),
        rounds: args.rounds,
        connections: args.connections,
        cold_connections: args.cold_connections,
        duration: Duration::from_secs_f64(args.seconds),
        body_bytes: 1024,
        in_flight: args.in_flight,
        check_calls: args.check_calls,
    };
    let result = auth_bench::run(&config);
    let mut context = run_context(&work_dir, &load_before);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let mut report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    context.push((
        "method".into(),
        format!(
            "{} round(s); connections: one connector, sequential connect + close, the four \
             cases rotating (N C W T, T W C N, ...) on two nodes kept for the run; publish: a \
             fresh node per run, user and none alternating (U N, N U, ...), {} s per run; the \
             Rust client over 127.0.0.1; ratios are medians of per-round ratios",
            args.rounds, args.seconds
        ),
    ));
    report.context = context;
    print_report(&report, args.json)
}

fn print_report(report: &report::Report, json: bool) -> BenchResult<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

/// Run the `log` benchmark in a fresh directory under `config.dir`, removed afterwards.
fn run_in_work_dir(mut config: LogBenchConfig, drop_caches: bool, json: bool) -> BenchResult<()> {
    let work_dir = config
        .dir
        .join(format!("keratin-bench-{}", std::process::id()));
    std::fs::create_dir_all(&config.dir)?;
    std::fs::create_dir(&work_dir).map_err(|e| format!("create {}: {e}", work_dir.display()))?;
    let filesystem = filesystem_name(&work_dir);
    config.dir = work_dir.clone();
    let cache = PageCache::detect(drop_caches);
    let load_before = load_average();
    let result = log_bench::run(&config, &cache);
    let cleanup = std::fs::remove_dir_all(&work_dir);
    let mut report = result?;
    cleanup.map_err(|e| format!("remove {}: {e}", work_dir.display()))?;
    report.context = context(&config, &work_dir, &filesystem, &cache, &load_before);
    if json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn context(
    config: &LogBenchConfig,
    work_dir: &Path,
    filesystem: &str,
    cache: &PageCache,
    load_before: &str,
) -> Vec<(String, String)> {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let args: Vec<String> = std::env::args().collect();
    [
        ("command", args.join(" ")),
        ("directory", format!("{} ({filesystem})", work_dir.display())),
        ("machine", format!("{cores} cores, Linux {}", kernel.trim())),
        ("load average before/after", format!("{load_before} / {}", load_average())),
        (
            "method",
            format!(
                "{} round(s) per case, keratin and raw alternating (K R, R K, ...); \
                 {} s per append run; medians; ratio = keratin / raw, median of per-round ratios",
                config.rounds,
                config.duration.as_secs_f64()
            ),
        ),
        (
            "append",
            format!(
                "each appender appends one {} B record and waits for its ticket; raw replays \
                 keratin's records-per-sync with one pwrite + fdatasync each; MB = 10^6 B of payload",
                config.record_bytes
            ),
        ),
        (
            "read",
            format!(
                "log of {} payload in 64 MiB segments; page cache {}",
                human_bytes(config.read_bytes),
                cache.describe()
            ),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("16M"), Ok(16 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("1T").is_err());
        assert!(parse_bytes("x").is_err());
    }

    #[test]
    fn compare_cluster_defaults_to_bench_cluster_sh_ports_and_every_case() {
        let cli = Cli::try_parse_from(["keratin-bench", "compare-cluster"]).unwrap();
        let Command::CompareCluster(args) = cli.command else {
            panic!("not compare-cluster");
        };
        let config = cluster_config(&args).unwrap();
        assert_eq!(config.systems.len(), 4);
        assert_eq!(config.keratin_nodes[1], "127.0.0.1:25722");
        assert_eq!(config.cases.len(), 7);
        assert_eq!(
            config.amqp_nodes[2],
            "amqp://guest:guest@127.0.0.1:25703/%2f"
        );
        assert_eq!(config.nats_nodes[0], "nats://127.0.0.1:24231");
        assert!(config.ctl.is_none());
        let cli = Cli::try_parse_from([
            "keratin-bench",
            "compare-cluster",
            "--systems",
            "nats-r3,kafka",
        ])
        .unwrap();
        let Command::CompareCluster(args) = cli.command else {
            panic!("not compare-cluster");
        };
        assert!(cluster_config(&args).is_err());
    }
}
