//! The `broker` benchmark (issue 4): the broker core in process, 1 KiB messages.
//!
//! - **publish+confirm**: `publishers` tasks each publish a batch of `batch` messages and await
//!   its confirms (every one durable), in a loop, for `duration`, into a queue of 1 and of 4
//!   partitions. The broker runs on a counting `Io`, which gives the bytes each `fdatasync`
//!   covered; spread over the messages in proportion, that is Keratin's batch (messages per
//!   sync). The reference is the raw contender of the storage benchmark (`pwrite` of one batch
//!   of 1 KiB payloads + `fdatasync`), replaying those batches, one thread per partition.
//! - **consume+ack**: a backlog of `backlog` messages (published beforehand, not timed), one
//!   consumer with prefetch `prefetch` that acks every delivery on its own, until the queue is
//!   empty. The reference replays the messages settled per sync the same way (1 KiB each).
//! - **memory**: resident memory (`VmRSS`) of a fresh process with 0 and with `rss_messages`
//!   queued `rss_body_bytes`-byte messages (published in confirmed batches of 1000 after a
//!   warm-up), measured in a child process (`keratin-bench broker-rss`) so that the heap left by
//!   the other cases does not hide growth.
//!
//! Keratin and the reference alternate (K R in even rounds, R K in odd ones, replaying the
//! previous round's batches), and the report gives medians and the median of per-round ratios.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_broker::{Broker, BrokerConfig, Message, QueueSettings};
use keratin_log::{Io, RealIo};
use serde_json::json;

use crate::contender::{AppendRun, AppendWork, BenchResult, Contender};
use crate::counting_io::{Counters, CountingIo, Snapshot};
use crate::page_cache::PageCache;
use crate::raw::Raw;
use crate::report::{median, percentile, Report, Row};

/// Granularity of the reference's preallocated files.
const PREALLOC_STEP_BYTES: u64 = 64 << 20;
/// Ceiling of one reference file.
const PREALLOC_MAX_BYTES: u64 = 8 << 30;
/// The queue every case uses.
pub(crate) const QUEUE: &str = "bench";

/// What `keratin-bench broker` runs.
#[derive(Debug, Clone)]
pub struct BrokerBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: PathBuf,
    /// Length of each publish run and of each reference run.
    pub duration: Duration,
    /// Rounds of each case.
    pub rounds: usize,
    /// Body bytes of one message.
    pub body_bytes: usize,
    /// Partition counts, one case each.
    pub partitions: Vec<u32>,
    /// Concurrent publishers.
    pub publishers: usize,
    /// Messages per publish.
    pub batch: usize,
    /// Messages queued before a consume run.
    pub backlog: usize,
    /// Prefetch of the consumer.
    pub prefetch: u32,
    /// Messages queued for the memory figure (0: skip it).
    pub rss_messages: usize,
    /// Body bytes of those messages.
    pub rss_body_bytes: usize,
}

/// One Keratin run: messages made durable (or consumed), time, and the batches it achieved.
#[derive(Debug, Clone, Default)]
pub(crate) struct BrokerRun {
    pub(crate) messages: u64,
    pub(crate) elapsed: Duration,
    /// Messages per data sync, in order.
    pub(crate) batches: Vec<u32>,
    pub(crate) syncs: u64,
    pub(crate) disk_bytes: u64,
    pub(crate) latencies_us: Vec<u64>,
}

impl BrokerRun {
    pub(crate) fn per_s(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Spread `messages` over the syncs in proportion to the bytes each covered: messages per sync.
/// Syncs that covered (next to) nothing, such as a spare's header, are not batches.
pub(crate) fn batches_by_bytes(snapshot: &Snapshot, messages: u64) -> Vec<u32> {
    let total: u64 = snapshot.sync_batches_bytes.iter().sum();
    if total == 0 || messages == 0 {
        return Vec::new();
    }
    let per_byte = messages as f64 / total as f64;
    snapshot
        .sync_batches_bytes
        .iter()
        .map(|bytes| (*bytes as f64 * per_byte).round() as u32)
        .filter(|n| *n > 0)
        .collect()
}

fn config_for(dir: &Path, io: Arc<dyn Io>) -> BrokerConfig {
    let mut config = BrokerConfig::new(vec![dir.to_path_buf()]);
    config.io = io;
    config
}

pub(crate) fn runtime() -> BenchResult<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

async fn open_broker(dir: &Path, partitions: u32) -> BenchResult<(Broker, Arc<Counters>)> {
    let io = Arc::new(CountingIo::new(Arc::new(RealIo::new())));
    let counters = io.counters();
    let broker = Broker::open(config_for(dir, io)).await?;
    broker
        .declare(
            QUEUE,
            QueueSettings {
                partitions,
                ..QueueSettings::default()
            },
        )
        .await?;
    Ok((broker, counters))
}

/// Publish `batch`-message batches from `publishers` tasks until `stop` (or until `limit`
/// messages are confirmed); returns confirmed messages and per-batch latencies.
pub(crate) async fn publish_loop(
    broker: &Broker,
    publishers: usize,
    batch: Vec<Message>,
    stop: Arc<AtomicBool>,
    limit: Option<u64>,
) -> BenchResult<(u64, Vec<u64>)> {
    let claimed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..publishers {
        let broker = broker.clone();
        let batch = batch.clone();
        let stop = stop.clone();
        let claimed = claimed.clone();
        tasks.push(tokio::spawn(async move {
            let mut confirmed = 0u64;
            let mut latencies = Vec::new();
            loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Some(limit) = limit {
                    let before = claimed.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    if before >= limit {
                        break;
                    }
                }
                let began = Instant::now();
                let results = broker.publish(QUEUE, batch.clone()).await;
                latencies.push(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX));
                for result in results {
                    result.map_err(|e| format!("publish: {e}"))?;
                    confirmed += 1;
                }
            }
            Ok::<_, String>((confirmed, latencies))
        }));
    }
    let mut confirmed = 0;
    let mut latencies = Vec::new();
    for task in tasks {
        let (n, l) = task.await??;
        confirmed += n;
        latencies.extend(l);
    }
    Ok((confirmed, latencies))
}

pub(crate) fn message_batch(count: usize, body_bytes: usize) -> Vec<Message> {
    (0..count)
        .map(|_| Message::new(vec![0x5a_u8; body_bytes]))
        .collect()
}

/// One publish+confirm run into a fresh broker.
fn keratin_publish(
    config: &BrokerBenchConfig,
    partitions: u32,
    dir: &Path,
) -> BenchResult<BrokerRun> {
    let rt = runtime()?;
    let run = rt.block_on(async {
        let (broker, counters) = open_broker(dir, partitions).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let batch = message_batch(config.batch, config.body_bytes);
        counters.reset();
        let began = Instant::now();
        let timer = {
            let stop = stop.clone();
            let duration = config.duration;
            tokio::spawn(async move {
                tokio::time::sleep(duration).await;
                stop.store(true, Ordering::Relaxed);
            })
        };
        let (confirmed, latencies) =
            publish_loop(&broker, config.publishers, batch, stop, None).await?;
        let elapsed = began.elapsed();
        timer.await?;
        let snapshot = counters.snapshot();
        broker.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(BrokerRun {
            messages: confirmed,
            elapsed,
            batches: batches_by_bytes(&snapshot, confirmed),
            syncs: snapshot.syncs,
            disk_bytes: snapshot.write_bytes,
            latencies_us: latencies,
        })
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(run)
}

/// One consume+ack run: a backlog published first (not timed), then drained by one consumer.
fn keratin_consume(
    config: &BrokerBenchConfig,
    partitions: u32,
    dir: &Path,
) -> BenchResult<BrokerRun> {
    let rt = runtime()?;
    let run = rt.block_on(async {
        let (broker, counters) = open_broker(dir, partitions).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let batch = message_batch(1000, config.body_bytes);
        let backlog = config.backlog as u64;
        let (queued, _) = publish_loop(&broker, 8, batch, stop, Some(backlog)).await?;
        counters.reset();
        let mut consumer = broker.subscribe(QUEUE, config.prefetch)?;
        let began = Instant::now();
        let mut consumed = 0u64;
        while consumed < queued {
            let Some(delivery) = consumer.recv().await else {
                return Err(format!("the consumer ended after {consumed} of {queued}").into());
            };
            consumer.ack(&[delivery.tag]);
            consumed += 1;
        }
        let elapsed = began.elapsed();
        drop(consumer);
        let snapshot = counters.snapshot();
        broker.shutdown().await?;
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

/// The raw reference: one thread per partition, each replaying `batches` of 1 KiB payloads
/// with one `pwrite` + `fdatasync` per batch, for `duration`, in its own preallocated file.
fn raw_reference(
    config: &BrokerBenchConfig,
    partitions: u32,
    batches: &[u32],
    keratin_disk_bytes: u64,
    dir: &Path,
) -> BenchResult<AppendRun> {
    raw_replay(
        config.duration,
        config.body_bytes,
        partitions,
        batches,
        keratin_disk_bytes,
        dir,
    )
}

/// The raw reference: one thread per partition, each replaying `batches` of `body_bytes`
/// payloads with one `pwrite` + `fdatasync` per batch, for `duration`, in its own preallocated
/// file under `dir` (removed afterwards).
pub(crate) fn raw_replay(
    duration: Duration,
    body_bytes: usize,
    partitions: u32,
    batches: &[u32],
    keratin_disk_bytes: u64,
    dir: &Path,
) -> BenchResult<AppendRun> {
    let cache = PageCache::detect(false);
    let raw = Raw { cache: &cache };
    let prealloc_bytes = (keratin_disk_bytes.saturating_mul(4) / u64::from(partitions))
        .div_ceil(PREALLOC_STEP_BYTES)
        .max(1)
        .saturating_mul(PREALLOC_STEP_BYTES)
        .min(PREALLOC_MAX_BYTES);
    let runs: Vec<BenchResult<AppendRun>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..partitions)
            .map(|p| {
                let raw = &raw;
                let dir = dir.join(format!("raw-{p}"));
                scope.spawn(move || {
                    std::fs::create_dir_all(&dir)?;
                    raw.append(&AppendWork {
                        dir: &dir,
                        duration,
                        record_bytes: body_bytes,
                        appenders: 1,
                        batches,
                        prealloc_bytes,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("raw thread panicked".into()))
            })
            .collect()
    });
    let mut total = AppendRun::default();
    for run in runs {
        let run = run?;
        total.records += run.records;
        total.payload_bytes += run.payload_bytes;
        total.elapsed = total.elapsed.max(run.elapsed);
        total.syncs += run.syncs;
        total.wraps += run.wraps;
    }
    remove_and_settle(dir)?;
    Ok(total)
}

pub(crate) fn remove_and_settle(dir: &Path) -> BenchResult<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    rustix::fs::sync();
    Ok(())
}

/// One round of a case.
struct Round {
    keratin: BrokerRun,
    raw: AppendRun,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Publish,
    Consume,
}

fn rounds_of(config: &BrokerBenchConfig, kind: Kind, partitions: u32) -> BenchResult<Vec<Round>> {
    let mut rounds: Vec<Round> = Vec::new();
    for round in 0..config.rounds {
        let name = if kind == Kind::Publish {
            "publish"
        } else {
            "consume"
        };
        let kdir = config
            .dir
            .join(format!("{name}-{partitions}-{round}-keratin"));
        let rdir = config.dir.join(format!("{name}-{partitions}-{round}-raw"));
        let keratin_run = |dir: &Path| match kind {
            Kind::Publish => keratin_publish(config, partitions, dir),
            Kind::Consume => keratin_consume(config, partitions, dir),
        };
        let (k, r) = if round % 2 == 0 {
            let k = keratin_run(&kdir)?;
            let r = raw_reference(config, partitions, &k.batches, k.disk_bytes, &rdir)?;
            (k, r)
        } else {
            let last = &rounds[round - 1].keratin;
            let r = raw_reference(config, partitions, &last.batches, last.disk_bytes, &rdir)?;
            (keratin_run(&kdir)?, r)
        };
        eprintln!(
            "  round {round}: keratin {:.0} msg/s ({} syncs, {:.1} msg/sync), raw {:.0} rec/s, ratio {:.2}",
            k.per_s(),
            k.syncs,
            mean(&k.batches),
            r.records_per_s(),
            k.per_s() / r.records_per_s().max(1e-9)
        );
        rounds.push(Round { keratin: k, raw: r });
    }
    Ok(rounds)
}

fn mean(batches: &[u32]) -> f64 {
    batches.iter().map(|b| f64::from(*b)).sum::<f64>() / batches.len().max(1) as f64
}

fn summarize(
    report: &mut Report,
    config: &BrokerBenchConfig,
    kind: Kind,
    partitions: u32,
    rounds: &[Round],
) {
    let k: Vec<f64> = rounds.iter().map(|r| r.keratin.per_s()).collect();
    let r: Vec<f64> = rounds.iter().map(|r| r.raw.records_per_s()).collect();
    let ratios: Vec<f64> = k.iter().zip(&r).map(|(k, r)| k / r.max(1e-9)).collect();
    let mb = |rate: f64| rate * config.body_bytes as f64 / 1e6;
    let batches: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.keratin.batches.iter().map(|b| u64::from(*b)))
        .collect();
    let case = match kind {
        Kind::Publish => format!(
            "publish+confirm {} B, {partitions} partition{}",
            config.body_bytes,
            if partitions == 1 { "" } else { "s" }
        ),
        Kind::Consume => format!(
            "consume+ack {} B, {partitions} partition{}",
            config.body_bytes,
            if partitions == 1 { "" } else { "s" }
        ),
    };
    let lat: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.keratin.latencies_us.iter().copied())
        .collect();
    let setup = match kind {
        Kind::Publish => format!(
            "{} publishers x batches of {}; confirm latency per batch p50/p99 {}/{} us",
            config.publishers,
            config.batch,
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        ),
        Kind::Consume => format!(
            "backlog {}, prefetch {}, one ack per delivery",
            config.backlog, config.prefetch
        ),
    };
    report.rows.push(Row {
        case: case.clone(),
        keratin: format!("{:.0} msg/s {:.2} MB/s", median(&k), mb(median(&k))),
        reference: format!("{:.0} rec/s {:.2} MB/s", median(&r), mb(median(&r))),
        ratio: median(&ratios),
        round_ratios: ratios.clone(),
        goal: None,
        note: format!(
            "{setup}; msg/sync: mean {:.1}, p50 {}, p90 {}, max {}; syncs/s keratin {:.0} raw {:.0}; raw threads {partitions}",
            batches.iter().sum::<u64>() as f64 / batches.len().max(1) as f64,
            percentile(&batches, 0.5),
            percentile(&batches, 0.9),
            percentile(&batches, 1.0),
            median(&rounds.iter().map(|r| r.keratin.syncs as f64 / r.keratin.elapsed.as_secs_f64().max(1e-9)).collect::<Vec<_>>()),
            median(&rounds.iter().map(|r| r.raw.syncs as f64 / r.raw.elapsed.as_secs_f64().max(1e-9)).collect::<Vec<_>>()),
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

/// Run every case and gather the report (memory comes from `rss` in a child process).
pub fn run(config: &BrokerBenchConfig) -> BenchResult<Report> {
    let mut report = Report::default();
    for kind in [Kind::Publish, Kind::Consume] {
        for &partitions in &config.partitions {
            eprintln!(
                "broker: {} with {partitions} partition(s), {} round(s)",
                if kind == Kind::Publish {
                    "publish+confirm"
                } else {
                    "consume+ack"
                },
                config.rounds
            );
            let rounds = rounds_of(config, kind, partitions)?;
            summarize(&mut report, config, kind, partitions, &rounds);
        }
    }
    if config.rss_messages > 0 {
        eprintln!(
            "broker: resident memory with 0 and {} queued messages (child process)",
            config.rss_messages
        );
        let exe = std::env::current_exe()?;
        let dir = config.dir.join("rss");
        let output = std::process::Command::new(exe)
            .arg("broker-rss")
            .arg("--dir")
            .arg(&dir)
            .arg("--messages")
            .arg(config.rss_messages.to_string())
            .arg("--body-bytes")
            .arg(config.rss_body_bytes.to_string())
            .stderr(std::process::Stdio::inherit())
            .output()?;
        if !output.status.success() {
            return Err(format!("broker-rss failed: {}", output.status).into());
        }
        let figures: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        let kib = |key: &str| figures[key].as_u64().unwrap_or(0);
        let delta = kib("rss_full_kib").saturating_sub(kib("rss_empty_kib"));
        report.diagnostics.push(format!(
            "resident memory: {} KiB with 0 queued, {} KiB with {} queued {}-byte messages: \
             +{:.1} MB ({:.1} bytes per message); peak {} KiB; queue ready {}",
            kib("rss_empty_kib"),
            kib("rss_full_kib"),
            config.rss_messages,
            config.rss_body_bytes,
            delta as f64 * 1024.0 / 1e6,
            delta as f64 * 1024.0 / config.rss_messages as f64,
            kib("hwm_kib"),
            kib("ready"),
        ));
        report
            .json_cases
            .push(json!({"case": "resident memory", "figures": figures}));
        remove_and_settle(&dir)?;
    }
    Ok(report)
}

/// `VmRSS` and `VmHWM` of this process, in KiB.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The child process of the memory figure: warm up, then `VmRSS` with 0 and with `messages`
/// queued; prints one JSON object on stdout.
pub fn rss(dir: &Path, messages: usize, body_bytes: usize) -> BenchResult<()> {
    std::fs::create_dir_all(dir)?;
    let rt = runtime()?;
    let figures = rt.block_on(async {
        let broker = Broker::open(config_for(dir, Arc::new(RealIo::new()))).await?;
        broker.declare(QUEUE, QueueSettings::default()).await?;
        let batch = message_batch(1000, body_bytes);
        // Warm-up: the runtime's threads, the log's buffers, a consumer's round trip.
        for _ in 0..20 {
            check(broker.publish(QUEUE, batch.clone()).await)?;
        }
        let mut consumer = broker.subscribe(QUEUE, 1000)?;
        for _ in 0..20_000 {
            let Some(delivery) = consumer.recv().await else {
                return Err("warm-up consumer ended".into());
            };
            consumer.ack(&[delivery.tag]);
        }
        drop(consumer);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ready_before = broker.info(QUEUE)?.ready();
        let (rss_empty, _) = rss_kib();
        let began = Instant::now();
        let mut published = 0;
        while published < messages {
            let n = (messages - published).min(batch.len());
            check(broker.publish(QUEUE, batch[..n].to_vec()).await)?;
            published += n;
        }
        let publish_s = began.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss_full, hwm) = rss_kib();
        let info = broker.info(QUEUE)?;
        broker.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(json!({
            "rss_empty_kib": rss_empty,
            "rss_full_kib": rss_full,
            "hwm_kib": hwm,
            "ready_before": ready_before,
            "ready": info.ready(),
            "disk_bytes": info.disk_bytes(),
            "messages": messages,
            "body_bytes": body_bytes,
            "publish_s": publish_s,
        }))
    })?;
    drop(rt);
    std::fs::remove_dir_all(dir)?;
    println!("{figures}");
    Ok(())
}

fn check(results: Vec<keratin_broker::BrokerResult<keratin_broker::Receipt>>) -> BenchResult<()> {
    for result in results {
        result?;
    }
    Ok(())
}
