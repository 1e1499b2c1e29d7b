//! The `net` benchmark (issue 5): a whole node started in process (`Node::start_with_io`, real
//! TCP on 127.0.0.1, real storage directory) and the Rust client, 1 KiB messages.
//!
//! - **publish+confirm**: one client connection, one producer keeping up to `in_flight`
//!   single-message confirmed publishes (`Client::publish`) in flight, for `duration`. The node
//!   runs on a counting `Io`, which gives the bytes each `fdatasync` covered, hence Keratin's
//!   messages per sync. The reference is the raw contender (`pwrite` of one batch of 1 KiB
//!   payloads + `fdatasync`, one thread) replaying those batches for `duration`.
//! - **consume+ack**: a backlog of `backlog` messages published in process beforehand (not
//!   timed), then one client consumer with prefetch `prefetch` that acks every delivery on its
//!   own until the queue is empty; the reference replays the messages settled per sync.
//! - **latency**: publish-to-confirm latency of single confirmed publishes issued at a fixed
//!   rate (open loop: `rate` per second, in groups every millisecond) for `duration`.
//!
//! Keratin and the reference alternate (K R in even rounds, R K in odd ones, replaying the
//! previous round's batches); medians and the median of per-round ratios.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use hdrhistogram::Histogram;
use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use keratin_log::RealIo;
use keratin_server::config::Config;
use keratin_server::Node;
use serde_json::json;

use crate::broker_bench::{
    batches_by_bytes, message_batch, publish_loop, raw_replay, remove_and_settle, runtime,
    BrokerRun,
};
use crate::contender::{AppendRun, BenchResult};
use crate::counting_io::{Counters, CountingIo};
use crate::report::{median, percentile, Report, Row};

/// The queue every case uses.
pub(crate) const QUEUE: &str = "bench";
/// Confirmed publish must reach this fraction of raw append+fsync (issue 5).
const PUBLISH_GOAL: f64 = 0.5;

/// What `keratin-bench net` runs.
#[derive(Debug, Clone)]
pub struct NetBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: PathBuf,
    /// Length of each publish, raw and latency run.
    pub duration: Duration,
    /// Rounds of each case.
    pub rounds: usize,
    /// Body bytes of one message.
    pub body_bytes: usize,
    /// Most confirmed publishes in flight at once.
    pub in_flight: usize,
    /// Messages queued before a consume run.
    pub backlog: usize,
    /// Prefetch of the consumer.
    pub prefetch: u32,
    /// Messages per second of the latency run (0: skip it).
    pub latency_rate: u32,
}

/// A loopback address with a port chosen by the kernel.
pub(crate) fn loopback_any() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// A node configuration on `dir`, listening on loopback ports chosen by the kernel.
pub(crate) fn node_config(dir: &Path) -> Config {
    let mut config = Config::default();
    config.storage.dirs = vec![dir.to_path_buf()];
    config.server.listen = loopback_any();
    config.server.http = loopback_any();
    // The benchmarks measure the data path; logins have their own (`auth`, which sets this
    // back per node). The peers they compare with run without logins too (NATS) or with a
    // fixed guest login (RabbitMQ).
    config.server.auth = keratin_server::access::AuthMode::None;
    config
}

/// A node on a counting `Io`, a connected client and the queue declared.
async fn start(dir: &Path) -> BenchResult<(Node, Arc<Counters>, Client)> {
    std::fs::create_dir_all(dir)?;
    let io = Arc::new(CountingIo::new(Arc::new(RealIo::new())));
    let counters = io.counters();
    let node = Node::start_with_io(&node_config(dir), io).await?;
    let client = Client::connect(node.protocol_addr(), ClientOptions::default()).await?;
    client.declare(QUEUE, QueueSettings::default()).await?;
    Ok((node, counters, client))
}

/// The disk level of the node's first file system, as text.
fn disk_level(node: &Node) -> String {
    node.limits()
        .snapshot()
        .filesystems
        .first()
        .map_or_else(|| "unknown".into(), |f| f.level.as_str().to_string())
}

/// One producer keeps up to `in_flight` single-message confirmed publishes in flight until
/// `duration` has passed, then waits for the last ones: (confirmed, elapsed).
pub(crate) async fn publish_window(
    client: &Client,
    body: &Bytes,
    in_flight: usize,
    duration: Duration,
) -> BenchResult<(u64, Duration)> {
    let began = Instant::now();
    let deadline = began + duration;
    let mut pending = FuturesUnordered::new();
    let mut confirmed = 0u64;
    loop {
        if Instant::now() < deadline {
            while pending.len() < in_flight {
                pending.push(client.publish(QUEUE, OutgoingMessage::new(body.clone())));
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

fn keratin_publish(config: &NetBenchConfig, dir: &Path) -> BenchResult<(BrokerRun, String)> {
    let rt = runtime()?;
    let run = rt.block_on(async {
        let (node, counters, client) = start(dir).await?;
        let level = disk_level(&node);
        let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
        // A short warm-up: the connection's buffers, the first segment.
        publish_window(&client, &body, config.in_flight, Duration::from_millis(100)).await?;
        counters.reset();
        let (confirmed, elapsed) =
            publish_window(&client, &body, config.in_flight, config.duration).await?;
        let snapshot = counters.snapshot();
        client.close().await;
        node.shutdown().await?;
        Ok::<_, crate::contender::BenchError>((
            BrokerRun {
                messages: confirmed,
                elapsed,
                batches: batches_by_bytes(&snapshot, confirmed),
                syncs: snapshot.syncs,
                disk_bytes: snapshot.write_bytes,
                latencies_us: Vec::new(),
            },
            level,
        ))
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(run)
}

fn keratin_consume(config: &NetBenchConfig, dir: &Path) -> BenchResult<BrokerRun> {
    let rt = runtime()?;
    let run = rt.block_on(async {
        let (node, counters, client) = start(dir).await?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let batch = message_batch(1000, config.body_bytes);
        let (queued, _) =
            publish_loop(node.broker(), 8, batch, stop, Some(config.backlog as u64)).await?;
        counters.reset();
        let mut consumer = client.subscribe(QUEUE, config.prefetch).await?;
        let began = Instant::now();
        let mut consumed = 0u64;
        while consumed < queued {
            let Some(delivery) = consumer.recv().await else {
                return Err(format!("the consumer ended after {consumed} of {queued}").into());
            };
            delivery.ack()?;
            consumed += 1;
        }
        let elapsed = began.elapsed();
        // Let the last acks reach the broker before the counters are read.
        consumer.cancel().await?;
        let snapshot = counters.snapshot();
        client.close().await;
        node.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(BrokerRun {
            messages: consumed,
            elapsed,
            batches: batches_by_bytes(&snapshot, consumed),
            syncs: snapshot.syncs,
            disk_bytes: snapshot.write_bytes,
            latencies_us: Vec::new(),
        })
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(run)
}

/// Publish-to-confirm latency at a fixed rate: every millisecond, `rate / 1000` single
/// confirmed publishes are started (the remainder spread over the ticks); each is timed from
/// its first poll (when it is sent) to its confirm. Returns latencies in microseconds and the
/// achieved rate.
pub(crate) async fn fixed_rate_latencies(
    client: &Client,
    body: &Bytes,
    rate: u32,
    duration: Duration,
) -> BenchResult<(Vec<u64>, f64)> {
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let began = Instant::now();
    let total = (f64::from(rate) * duration.as_secs_f64()).round() as u64;
    let mut started = 0u64;
    let mut pending = FuturesUnordered::new();
    let mut latencies = Vec::with_capacity(total as usize);
    let timed = |message: OutgoingMessage| async move {
        let sent = Instant::now();
        let result = client.publish(QUEUE, message).await;
        result.map(|_| u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX))
    };
    while started < total || !pending.is_empty() {
        tokio::select! {
            _ = ticker.tick(), if started < total => {
                // Messages due by now, so the rate holds whatever the ticks' jitter.
                let due = ((began.elapsed().as_secs_f64() * f64::from(rate)) as u64 + 1).min(total);
                while started < due {
                    pending.push(timed(OutgoingMessage::new(body.clone())));
                    started += 1;
                }
            }
            Some(result) = pending.next(), if !pending.is_empty() => {
                latencies.push(result.map_err(|e| format!("publish: {e}"))?);
            }
        }
    }
    let achieved = started as f64 / began.elapsed().as_secs_f64().max(1e-9);
    Ok((latencies, achieved))
}

fn keratin_latency(config: &NetBenchConfig, dir: &Path) -> BenchResult<(Vec<u64>, f64)> {
    let rt = runtime()?;
    let out = rt.block_on(async {
        let (node, _counters, client) = start(dir).await?;
        let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
        fixed_rate_latencies(
            &client,
            &body,
            config.latency_rate,
            Duration::from_millis(200),
        )
        .await?;
        let out =
            fixed_rate_latencies(&client, &body, config.latency_rate, config.duration).await?;
        client.close().await;
        node.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(out)
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(out)
}

struct Round {
    keratin: BrokerRun,
    raw: AppendRun,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Publish,
    Consume,
}

fn rounds_of(
    config: &NetBenchConfig,
    kind: Kind,
    levels: &mut Vec<String>,
) -> BenchResult<Vec<Round>> {
    let name = match kind {
        Kind::Publish => "publish",
        Kind::Consume => "consume",
    };
    let mut rounds: Vec<Round> = Vec::new();
    for round in 0..config.rounds {
        let kdir = config.dir.join(format!("net-{name}-{round}-keratin"));
        let rdir = config.dir.join(format!("net-{name}-{round}-raw"));
        let mut keratin_run = |dir: &Path| match kind {
            Kind::Publish => keratin_publish(config, dir).map(|(run, level)| {
                levels.push(level);
                run
            }),
            Kind::Consume => keratin_consume(config, dir),
        };
        let raw_run = |batches: &[u32], disk_bytes: u64| {
            raw_replay(
                config.duration,
                config.body_bytes,
                1,
                batches,
                disk_bytes,
                &rdir,
            )
        };
        let (k, r) = if round % 2 == 0 {
            let k = keratin_run(&kdir)?;
            let r = raw_run(&k.batches, k.disk_bytes)?;
            (k, r)
        } else {
            let last = &rounds[round - 1].keratin;
            let r = raw_run(&last.batches, last.disk_bytes)?;
            let k = keratin_run(&kdir)?;
            (k, r)
        };
        eprintln!(
            "  round {}: keratin {:.0} msg/s, raw {:.0} rec/s, ratio {:.2}",
            round + 1,
            k.per_s(),
            r.records_per_s(),
            k.per_s() / r.records_per_s().max(1e-9)
        );
        rounds.push(Round { keratin: k, raw: r });
    }
    Ok(rounds)
}

fn summarize(report: &mut Report, config: &NetBenchConfig, kind: Kind, rounds: &[Round]) {
    let k: Vec<f64> = rounds.iter().map(|r| r.keratin.per_s()).collect();
    let r: Vec<f64> = rounds.iter().map(|r| r.raw.records_per_s()).collect();
    let ratios: Vec<f64> = k.iter().zip(&r).map(|(k, r)| k / r.max(1e-9)).collect();
    let mb = |rate: f64| rate * config.body_bytes as f64 / 1e6;
    let batches: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.keratin.batches.iter().map(|b| u64::from(*b)))
        .collect();
    let (case, setup, goal) = match kind {
        Kind::Publish => (
            format!("net publish+confirm {} B", config.body_bytes),
            format!(
                "1 client, 1 producer, up to {} single-message publishes in flight",
                config.in_flight
            ),
            Some(PUBLISH_GOAL),
        ),
        Kind::Consume => (
            format!("net consume+ack {} B", config.body_bytes),
            format!(
                "backlog {}, 1 client consumer, prefetch {}, one ack per delivery",
                config.backlog, config.prefetch
            ),
            None,
        ),
    };
    let per_s = |syncs: u64, elapsed: Duration| syncs as f64 / elapsed.as_secs_f64().max(1e-9);
    report.rows.push(Row {
        case: case.clone(),
        keratin: format!("{:.0} msg/s {:.2} MB/s", median(&k), mb(median(&k))),
        reference: format!("{:.0} rec/s {:.2} MB/s", median(&r), mb(median(&r))),
        ratio: median(&ratios),
        round_ratios: ratios.clone(),
        goal,
        note: format!(
            "{setup}; msg/sync: mean {:.1}, p50 {}, p90 {}, max {}; syncs/s keratin {:.0} raw {:.0}",
            batches.iter().sum::<u64>() as f64 / batches.len().max(1) as f64,
            percentile(&batches, 0.5),
            percentile(&batches, 0.9),
            percentile(&batches, 1.0),
            median(
                &rounds
                    .iter()
                    .map(|r| per_s(r.keratin.syncs, r.keratin.elapsed))
                    .collect::<Vec<_>>()
            ),
            median(
                &rounds
                    .iter()
                    .map(|r| per_s(r.raw.syncs, r.raw.elapsed))
                    .collect::<Vec<_>>()
            ),
        ),
    });
    report.json_cases.push(json!({
        "case": case,
        "keratin_per_s": k,
        "raw_per_s": r,
        "ratios": ratios,
        "keratin_syncs": rounds.iter().map(|r| r.keratin.syncs).collect::<Vec<_>>(),
        "keratin_elapsed_s": rounds.iter().map(|r| r.keratin.elapsed.as_secs_f64()).collect::<Vec<_>>(),
        "raw_wraps": rounds.iter().map(|r| r.raw.wraps).sum::<u64>(),
    }));
}

/// p50 / p99 / p99.9 / max of microsecond samples, from one histogram.
pub(crate) fn latency_line(latencies_us: &[u64]) -> String {
    let Ok(mut histogram) = Histogram::<u64>::new(3) else {
        return "no histogram".into();
    };
    for value in latencies_us {
        let _ = histogram.record(*value);
    }
    if histogram.is_empty() {
        return "no samples".into();
    }
    format!(
        "p50 {} us, p99 {} us, p99.9 {} us, max {} us ({} samples)",
        histogram.value_at_quantile(0.5),
        histogram.value_at_quantile(0.99),
        histogram.value_at_quantile(0.999),
        histogram.max(),
        histogram.len()
    )
}

/// Run every case and gather the report.
pub fn run(config: &NetBenchConfig) -> BenchResult<Report> {
    let mut report = Report::default();
    let mut levels = Vec::new();
    eprintln!("net: publish+confirm over TCP, {} round(s)", config.rounds);
    let rounds = rounds_of(config, Kind::Publish, &mut levels)?;
    summarize(&mut report, config, Kind::Publish, &rounds);
    eprintln!("net: consume+ack over TCP, {} round(s)", config.rounds);
    let rounds = rounds_of(config, Kind::Consume, &mut levels)?;
    summarize(&mut report, config, Kind::Consume, &rounds);
    report.diagnostics.push(format!(
        "node disk level at the end of each publish run: {} (limits on, default settings)",
        levels.join(" ")
    ));
    if config.latency_rate > 0 {
        eprintln!(
            "net: publish-to-confirm latency at {} msg/s, {} round(s)",
            config.latency_rate, config.rounds
        );
        let mut all = Vec::new();
        let mut per_round = Vec::new();
        let mut achieved = Vec::new();
        for round in 0..config.rounds {
            let dir = config.dir.join(format!("net-latency-{round}"));
            let (latencies, rate) = keratin_latency(config, &dir)?;
            per_round.push(format!(
                "{}/{}",
                percentile(&latencies, 0.5),
                percentile(&latencies, 0.99)
            ));
            eprintln!("  round {}: {}", round + 1, latency_line(&latencies));
            achieved.push(rate);
            all.extend(latencies);
        }
        report.diagnostics.push(format!(
            "publish-to-confirm latency at a fixed {} msg/s ({:.0} achieved), 1 client, single \
             confirmed publishes: {}; p50/p99 per round (us): {}",
            config.latency_rate,
            median(&achieved),
            latency_line(&all),
            per_round.join(" ")
        ));
        report.json_cases.push(json!({
            "case": "latency",
            "rate": config.latency_rate,
            "achieved_per_s": achieved,
            "p50_us": percentile(&all, 0.5),
            "p99_us": percentile(&all, 0.99),
            "p999_us": percentile(&all, 0.999),
            "max_us": percentile(&all, 1.0),
        }));
    }
    Ok(report)
}
