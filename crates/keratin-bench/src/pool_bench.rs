//! The `pool` benchmark (issue 3): does a segment file reused through the node's segment pool
//! take appends faster than a fresh one, and does the node pool make log churn cheaper?
//!
//! - **Append latency**: one appender, `records` single-record `append_sync` calls of 1 KiB each,
//!   into (a) a segment the log took from a node pool filled beforehand (its blocks all written
//!   by an earlier log), (b) a fresh preallocated segment (a node pool with a zero budget, so
//!   it never holds a spare). Beside them, the raw reference does one `pwrite` + `fdatasync` per
//!   record into (c) a fresh file grown by the appends (no preallocation), (d) a fresh
//!   `fallocate`d file (unwritten extents, like a fresh segment) and (e) a file written in full
//!   beforehand (like a reused segment). The design's claim, "reused files are faster because
//!   appends do not wait for the journal to record new blocks", is tested by (a)/(b) and (e)/(d).
//! - **Churn**: create a log, fill two 1 MiB segments, delete it, `logs` times; with one node pool
//!   for all the logs vs each log with its own private pool (the default without a node pool).
//!
//! The disk is noisy, so the cases run in every round, in forward order in even rounds and
//! reversed in odd ones, and the report gives medians of figures and of per-round ratios.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_log::format::{RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE};
use keratin_log::{Io, Log, LogOptions, PoolOptions, RealIo, Record, SegmentPool};
use rustix::fs::{Mode, OFlags};
use serde_json::json;

use crate::contender::BenchResult;
use crate::raw::{preallocated_file, pwrite_all};
use crate::report::{latency_us, median, text_table};

/// What `keratin-bench pool` runs.
#[derive(Debug, Clone)]
pub struct PoolBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: PathBuf,
    /// Rounds; every case runs once per round.
    pub rounds: usize,
    /// Synced single-record appends per latency run.
    pub records: usize,
    /// Payload bytes of one record.
    pub record_bytes: usize,
    /// Segment size of the latency runs' logs (and the raw files' size).
    pub segment_bytes: u64,
    /// Logs created, filled and deleted per churn run.
    pub churn_logs: usize,
    /// Segment size of the churn logs.
    pub churn_segment_bytes: u64,
}

/// The latency cases, in their forward order.
const CASES: [&str; 5] = [
    "keratin, reused segment (node pool)",
    "keratin, fresh preallocated segment",
    "raw, reused file (written before)",
    "raw, fresh preallocated file",
    "raw, fresh file grown by appends",
];
const K_REUSED: usize = 0;
const K_FRESH: usize = 1;
const R_REUSED: usize = 2;
const R_PREALLOC: usize = 3;
const R_GROWN: usize = 4;

/// One latency run.
#[derive(Debug, Clone, Default)]
struct LatencyRun {
    latencies_ns: Vec<u64>,
    elapsed: Duration,
}

impl LatencyRun {
    fn per_s(&self) -> f64 {
        self.latencies_ns.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// One churn run.
#[derive(Debug, Clone, Default)]
struct ChurnRun {
    logs: usize,
    elapsed: Duration,
    takes_from_pool: u64,
    takes_fresh: u64,
}

impl ChurnRun {
    fn per_s(&self) -> f64 {
        self.logs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn real_io() -> Arc<dyn Io> {
    Arc::new(RealIo::new())
}

/// Settle a removal before the next timed run: with `discard` mounts, freed blocks cost
/// discards at the next journal commit (see `log_bench::remove_and_settle`).
fn remove_and_settle(path: &Path) -> BenchResult<()> {
    if path.is_dir() {
        std::fs::remove_dir_all(path)?;
    } else if path.exists() {
        std::fs::remove_file(path)?;
    }
    rustix::fs::sync();
    Ok(())
}

/// `count` synced single-record appends into `log`, each timed.
fn keratin_appends(log: &Log, count: usize, payload: &[u8]) -> BenchResult<LatencyRun> {
    let record = Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 0,
        payload,
    };
    let mut run = LatencyRun {
        latencies_ns: Vec::with_capacity(count),
        elapsed: Duration::ZERO,
    };
    let began = Instant::now();
    for _ in 0..count {
        let t = Instant::now();
        log.append_sync(&[record])?;
        run.latencies_ns.push(nanos(t.elapsed()));
    }
    run.elapsed = began.elapsed();
    Ok(run)
}

/// `count` timed `pwrite` + `fdatasync` of one record each, at the end of what was written.
fn raw_appends(fd: &std::os::fd::OwnedFd, count: usize, payload: &[u8]) -> BenchResult<LatencyRun> {
    let mut run = LatencyRun {
        latencies_ns: Vec::with_capacity(count),
        elapsed: Duration::ZERO,
    };
    let mut position = 0u64;
    let began = Instant::now();
    for _ in 0..count {
        let t = Instant::now();
        pwrite_all(fd, payload, position)?;
        rustix::fs::fdatasync(fd)?;
        run.latencies_ns.push(nanos(t.elapsed()));
        position += payload.len() as u64;
    }
    run.elapsed = began.elapsed();
    Ok(run)
}

fn sync_dir(dir: &Path) -> BenchResult<()> {
    let fd = rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
    rustix::fs::fsync(&fd)?;
    Ok(())
}

/// A file of `len` bytes all written (zeros) and synced: the raw stand-in for a reused segment.
fn written_file(path: &Path, len: u64) -> BenchResult<()> {
    let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
    let fd = rustix::fs::open(path, flags, Mode::from_raw_mode(0o644))?;
    let chunk = vec![0u8; 1 << 20];
    let mut position = 0u64;
    while position < len {
        let n = (len - position).min(chunk.len() as u64) as usize;
        pwrite_all(&fd, &chunk[..n], position)?;
        position += n as u64;
    }
    rustix::fs::fdatasync(&fd)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))?;
    Ok(())
}

/// The fixtures of the latency runs: the node pool with its spares, and the raw reused file.
struct Fixtures {
    node_pool: SegmentPool,
    /// A log that filled the pool's spares; kept (closed) until the end.
    prewarm_dir: PathBuf,
    raw_reused: PathBuf,
}

fn log_options(segment_bytes: u64) -> LogOptions {
    LogOptions {
        full_segment_size_bytes: segment_bytes,
        ..LogOptions::default()
    }
}

/// Fill `spares` segments of a log in the node pool, then reclaim them (`remove_prefix`): they
/// become the pool's spares, every block of them written.
fn prewarm(config: &PoolBenchConfig, spares: usize) -> BenchResult<Fixtures> {
    let node_dir = config.dir.join("node");
    std::fs::create_dir_all(&node_dir)?;
    let node_pool = SegmentPool::new(
        real_io(),
        PoolOptions {
            full_segment_size_bytes: config.segment_bytes,
            budget_bytes: Some(config.segment_bytes * (spares as u64 + 2)),
            background: true,
            ..PoolOptions::default()
        },
    );
    node_pool.add_storage_dir(&node_dir)?;
    let prewarm_dir = node_dir.join("prewarm");
    let log = Log::open(
        real_io(),
        &prewarm_dir,
        log_options(config.segment_bytes),
        Some(node_pool.clone()),
    )?;
    let payload = vec![0xa5_u8; config.record_bytes];
    let record = Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 0,
        payload: &payload,
    };
    let batch = vec![record; 1024];
    while log.stats().segments.len() <= spares {
        log.append_sync(&batch)?;
    }
    let removed = log.remove_prefix(log.next_offset())?.wait()?;
    log.close()?;
    node_pool.flush();
    let ready: u64 = node_pool.filesystems().iter().map(|f| f.full_count).sum();
    if removed.segments < spares || ready < spares as u64 {
        return Err(format!(
            "prewarm: {} segment(s) reclaimed, {ready} spare(s) ready; wanted {spares}",
            removed.segments
        )
        .into());
    }
    let raw_reused = config.dir.join("raw-reused.dat");
    written_file(&raw_reused, config.segment_bytes)?;
    rustix::fs::sync();
    Ok(Fixtures {
        node_pool,
        prewarm_dir,
        raw_reused,
    })
}

fn run_case(
    config: &PoolBenchConfig,
    fixtures: &Fixtures,
    case: usize,
    round: usize,
) -> BenchResult<LatencyRun> {
    let payload = vec![0x5a_u8; config.record_bytes];
    let dir = config.dir.join(format!("case-{case}-round-{round}"));
    std::fs::create_dir_all(&dir)?;
    let run = match case {
        K_REUSED => {
            let pool = &fixtures.node_pool;
            let before = pool.counters();
            let log = Log::open(
                real_io(),
                &dir.join("log"),
                log_options(config.segment_bytes),
                Some(pool.clone()),
            )?;
            // Logs are created lazily (storage format 1.2): the first append takes the spare,
            // inside the timed run, as a queue's first publish does.
            let run = keratin_appends(&log, config.records, &payload)?;
            let after = pool.counters();
            if after.takes_from_pool != before.takes_from_pool + 1 {
                return Err(format!(
                    "the reused case's log did not take a spare (takes from pool {} -> {}, fresh {} -> {})",
                    before.takes_from_pool, after.takes_from_pool, before.takes_fresh, after.takes_fresh
                )
                .into());
            }
            if log.stats().segments.len() != 1 {
                return Err("the reused case's log rolled: lower --records".into());
            }
            // Back to the pool for the next round, still written in full.
            log.delete()?;
            pool.flush();
            run
        }
        K_FRESH => {
            let pool_dir = dir.join("node");
            std::fs::create_dir_all(&pool_dir)?;
            // A zero budget: the pool never keeps a spare, every segment is a fresh file.
            let pool = SegmentPool::new(
                real_io(),
                PoolOptions {
                    full_segment_size_bytes: config.segment_bytes,
                    budget_bytes: Some(0),
                    background: true,
                    ..PoolOptions::default()
                },
            );
            pool.add_storage_dir(&pool_dir)?;
            let log = Log::open(
                real_io(),
                &pool_dir.join("log"),
                log_options(config.segment_bytes),
                Some(pool.clone()),
            )?;
            // The first append creates the segment (logs are created lazily).
            let run = keratin_appends(&log, config.records, &payload)?;
            if pool.counters().takes_fresh != 1 || pool.counters().takes_from_pool != 0 {
                return Err("the fresh case's log did not create a fresh segment".into());
            }
            if log.stats().segments.len() != 1 {
                return Err("the fresh case's log rolled: lower --records".into());
            }
            log.delete()?;
            pool.flush();
            run
        }
        R_REUSED => {
            let fd = rustix::fs::open(
                &fixtures.raw_reused,
                OFlags::RDWR | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            raw_appends(&fd, config.records, &payload)?
        }
        R_PREALLOC => {
            let fd = preallocated_file(&dir.join("raw.dat"), config.segment_bytes)?;
            raw_appends(&fd, config.records, &payload)?
        }
        _ => {
            let path = dir.join("raw.dat");
            let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
            let fd = rustix::fs::open(&path, flags, Mode::from_raw_mode(0o644))?;
            rustix::fs::fdatasync(&fd)?;
            sync_dir(&dir)?;
            raw_appends(&fd, config.records, &payload)?
        }
    };
    remove_and_settle(&dir)?;
    Ok(run)
}

/// Create, fill two segments of, and delete `config.churn_logs` logs, each in its own
/// directory; with `node_pool` all of them use it, else each gets a private pool.
fn churn(config: &PoolBenchConfig, dir: &Path, node_pool: bool) -> BenchResult<ChurnRun> {
    std::fs::create_dir_all(dir)?;
    let pool = if node_pool {
        let pool = SegmentPool::new(
            real_io(),
            PoolOptions {
                full_segment_size_bytes: config.churn_segment_bytes,
                budget_bytes: None,
                background: true,
                ..PoolOptions::default()
            },
        );
        pool.add_storage_dir(dir)?;
        Some(pool)
    } else {
        None
    };
    let on_disk = (RECORD_HEADER_SIZE + config.record_bytes) as u64;
    let per_segment = (config.churn_segment_bytes - SEGMENT_HEADER_SIZE as u64) / on_disk;
    // Two segments' worth, less a few records for the seal: the log rolls once.
    let records = (2 * per_segment).saturating_sub(4).max(1) as usize;
    let payload = vec![0x3c_u8; config.record_bytes];
    let record = Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 0,
        payload: &payload,
    };
    let batch = vec![record; 128];
    let began = Instant::now();
    let mut private_takes = (0u64, 0u64);
    for i in 0..config.churn_logs {
        let log = Log::open(
            real_io(),
            &dir.join(format!("log-{i}")),
            log_options(config.churn_segment_bytes),
            pool.clone(),
        )?;
        let mut tickets = Vec::new();
        let mut written = 0;
        while written < records {
            let n = (records - written).min(batch.len());
            tickets.push(log.append(&batch[..n])?);
            written += n;
        }
        for ticket in tickets {
            ticket.wait()?;
        }
        if pool.is_none() {
            let c = log.pool().counters();
            private_takes.0 += c.takes_from_pool;
            private_takes.1 += c.takes_fresh;
        }
        log.delete()?;
    }
    if let Some(pool) = &pool {
        pool.flush();
    }
    let elapsed = began.elapsed();
    let (takes_from_pool, takes_fresh) = match &pool {
        Some(pool) => (pool.counters().takes_from_pool, pool.counters().takes_fresh),
        None => private_takes,
    };
    drop(pool);
    remove_and_settle(dir)?;
    Ok(ChurnRun {
        logs: config.churn_logs,
        elapsed,
        takes_from_pool,
        takes_fresh,
    })
}

/// Everything one invocation measured, as text (and JSON).
pub struct PoolReport {
    /// The tables and verdict lines.
    pub text: String,
    /// Every per-round figure.
    pub json: serde_json::Value,
}

/// Run every round and gather the report.
pub fn run(config: &PoolBenchConfig) -> BenchResult<PoolReport> {
    let spares = 2;
    eprintln!("pool: prewarming {spares} spare segment(s) in a node pool");
    let fixtures = prewarm(config, spares)?;
    let mut runs: Vec<Vec<LatencyRun>> = vec![Vec::new(); CASES.len()];
    let mut churns: Vec<(ChurnRun, ChurnRun)> = Vec::new();
    for round in 0..config.rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..CASES.len()).collect()
        } else {
            (0..CASES.len()).rev().collect()
        };
        for case in order {
            let run = run_case(config, &fixtures, case, round)?;
            eprintln!(
                "  round {round}: {:<38} {:>6.0} appends/s p50 {} us",
                CASES[case],
                run.per_s(),
                latency_us(&run.latencies_ns).0
            );
            runs[case].push(run);
        }
        let node_dir = config.dir.join(format!("churn-node-{round}"));
        let private_dir = config.dir.join(format!("churn-private-{round}"));
        let (node, private) = if round % 2 == 0 {
            let n = churn(config, &node_dir, true)?;
            (n, churn(config, &private_dir, false)?)
        } else {
            let p = churn(config, &private_dir, false)?;
            (churn(config, &node_dir, true)?, p)
        };
        eprintln!(
            "  round {round}: churn node pool {:.0} logs/s ({} from pool, {} fresh), private pools {:.0} logs/s",
            node.per_s(),
            node.takes_from_pool,
            node.takes_fresh,
            private.per_s()
        );
        churns.push((node, private));
    }
    let counters = fixtures.node_pool.counters();
    drop(fixtures.node_pool);
    remove_and_settle(&fixtures.prewarm_dir)?;
    remove_and_settle(&fixtures.raw_reused)?;
    Ok(report(config, &runs, &churns, counters))
}

fn report(
    config: &PoolBenchConfig,
    runs: &[Vec<LatencyRun>],
    churns: &[(ChurnRun, ChurnRun)],
    counters: keratin_log::PoolCounters,
) -> PoolReport {
    let mut rows = vec![vec![
        "case".to_string(),
        "appends/s (median)".into(),
        "p50 us".into(),
        "p99 us".into(),
        "p99.9 us".into(),
        "appends/s per round".into(),
    ]];
    for (case, name) in CASES.iter().enumerate() {
        let all: Vec<u64> = runs[case]
            .iter()
            .flat_map(|r| r.latencies_ns.iter().copied())
            .collect();
        let (p50, p99, p999) = latency_us(&all);
        let rates: Vec<f64> = runs[case].iter().map(LatencyRun::per_s).collect();
        rows.push(vec![
            name.to_string(),
            format!("{:.0}", median(&rates)),
            p50.to_string(),
            p99.to_string(),
            p999.to_string(),
            rates
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(" "),
        ]);
    }
    let ratio_of = |a: usize, b: usize| -> Vec<f64> {
        runs[a]
            .iter()
            .zip(&runs[b])
            .map(|(x, y)| x.per_s() / y.per_s().max(1e-9))
            .collect()
    };
    let ratios: [(&str, usize, usize); 6] = [
        ("keratin reused / keratin fresh", K_REUSED, K_FRESH),
        ("raw reused / raw preallocated", R_REUSED, R_PREALLOC),
        ("raw preallocated / raw grown", R_PREALLOC, R_GROWN),
        ("raw reused / raw grown", R_REUSED, R_GROWN),
        ("keratin reused / raw reused", K_REUSED, R_REUSED),
        ("keratin fresh / raw preallocated", K_FRESH, R_PREALLOC),
    ];
    let mut ratio_rows = vec![vec![
        "throughput ratio".to_string(),
        "median".into(),
        "per round".into(),
    ]];
    let mut json_ratios = Vec::new();
    for (name, a, b) in ratios {
        let r = ratio_of(a, b);
        ratio_rows.push(vec![
            name.to_string(),
            format!("{:.2}", median(&r)),
            r.iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
        ]);
        json_ratios.push(json!({"ratio": name, "median": median(&r), "rounds": r}));
    }
    let node: Vec<f64> = churns.iter().map(|c| c.0.per_s()).collect();
    let private: Vec<f64> = churns.iter().map(|c| c.1.per_s()).collect();
    let churn_ratios: Vec<f64> = node
        .iter()
        .zip(&private)
        .map(|(n, p)| n / p.max(1e-9))
        .collect();
    let takes = |f: &dyn Fn(&ChurnRun) -> u64, node: bool| -> u64 {
        churns
            .iter()
            .map(|c| if node { f(&c.0) } else { f(&c.1) })
            .sum()
    };
    let churn_rows = vec![
        vec![
            "churn".to_string(),
            "logs/s (median)".into(),
            "segments from a spare / fresh".into(),
            "logs/s per round".into(),
        ],
        vec![
            "node pool".into(),
            format!("{:.1}", median(&node)),
            format!(
                "{} / {}",
                takes(&|c| c.takes_from_pool, true),
                takes(&|c| c.takes_fresh, true)
            ),
            node.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join(" "),
        ],
        vec![
            "private pools".into(),
            format!("{:.1}", median(&private)),
            format!(
                "{} / {}",
                takes(&|c| c.takes_from_pool, false),
                takes(&|c| c.takes_fresh, false)
            ),
            private
                .iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join(" "),
        ],
        vec![
            "node / private".into(),
            format!("{:.2}", median(&churn_ratios)),
            String::new(),
            churn_ratios
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
        ],
    ];
    let mut text = String::new();
    text.push_str(&format!(
        "append latency: {} single-record append_sync / pwrite+fdatasync of {} B per run, {} MiB \
         segments and files, {} round(s), order forward in even rounds and reversed in odd ones\n\n",
        config.records,
        config.record_bytes,
        config.segment_bytes >> 20,
        config.rounds
    ));
    text.push_str(&text_table(&rows));
    text.push('\n');
    text.push_str(&text_table(&ratio_rows));
    text.push('\n');
    text.push_str(&format!(
        "churn: {} logs per run, each created, filled with two {} KiB segments of {} B records \
         and deleted; node pool and private pools alternate\n\n",
        config.churn_logs,
        config.churn_segment_bytes >> 10,
        config.record_bytes
    ));
    text.push_str(&text_table(&churn_rows));
    text.push_str(&format!(
        "\nnode pool of the latency runs: {} segment(s) taken from the pool, {} fresh, {} entered, \
         {} deleted over budget\n",
        counters.takes_from_pool,
        counters.takes_fresh,
        counters.entered,
        counters.deleted_over_budget
    ));
    let json = json!({
        "cases": CASES.iter().enumerate().map(|(case, name)| json!({
            "case": name,
            "appends_per_s": runs[case].iter().map(LatencyRun::per_s).collect::<Vec<_>>(),
            "p50_us": runs[case].iter().map(|r| latency_us(&r.latencies_ns).0).collect::<Vec<_>>(),
            "p99_us": runs[case].iter().map(|r| latency_us(&r.latencies_ns).1).collect::<Vec<_>>(),
            "p999_us": runs[case].iter().map(|r| latency_us(&r.latencies_ns).2).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "ratios": json_ratios,
        "churn_node_logs_per_s": node,
        "churn_private_logs_per_s": private,
        "churn_ratios": churn_ratios,
    });
    PoolReport { text, json }
}
