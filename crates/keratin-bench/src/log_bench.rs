//! The `log` benchmark: durable appends from 1, 8, 64 appenders, a sequential read and a recovery,
//! each against the raw reference. The disk's speed swings between runs, so the two contenders
//! alternate round by round (A B, B A, A B, ...) and the report gives medians and the median of
//! the per-round ratios.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use crate::contender::{AppendRun, AppendWork, BenchResult, Contender, ReadRun, StoredLog};
use crate::keratin::{build_stored_log, Keratin};
use crate::page_cache::PageCache;
use crate::raw::Raw;
use crate::report::{median, percentile, Report, Row};

/// Granularity and floor of the reference's preallocated file: one Keratin segment.
const PREALLOC_STEP_BYTES: u64 = 64 << 20;
/// The reference preallocates this many times the bytes Keratin wrote in its latest run.
const PREALLOC_MARGIN: u64 = 4;
/// Ceiling of the reference's preallocated file; past it the reference wraps to its start.
const PREALLOC_MAX_BYTES: u64 = 16 << 30;

/// What `keratin-bench log` runs.
#[derive(Debug, Clone)]
pub struct LogBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: PathBuf,
    /// Length of each append run.
    pub duration: Duration,
    /// Rounds of each case; each round runs both contenders.
    pub rounds: usize,
    /// Payload bytes of one record.
    pub record_bytes: usize,
    /// Appender counts, one case each.
    pub appenders: Vec<usize>,
    /// Payload bytes of the log read back and recovered.
    pub read_bytes: u64,
    /// Run only the append cases.
    pub append_only: bool,
    /// Run only the read and recovery cases.
    pub read_only: bool,
}

/// Run every case and gather the report.
pub fn run(config: &LogBenchConfig, cache: &PageCache) -> BenchResult<Report> {
    let keratin = Keratin { cache };
    let raw = Raw { cache };
    let mut report = Report::default();
    let appender_cases = if config.read_only {
        &[][..]
    } else {
        &config.appenders[..]
    };
    for &appenders in appender_cases {
        eprintln!(
            "append: {appenders} appender(s), {} round(s)",
            config.rounds
        );
        let rounds = append_rounds(config, appenders, &keratin, &raw)?;
        append_summary(&mut report, config, appenders, &rounds);
    }
    if config.append_only {
        return Ok(report);
    }
    eprintln!("read: writing a log of {} bytes", config.read_bytes);
    let stored = build_stored_log(
        &config.dir.join("read-log"),
        config.read_bytes,
        config.record_bytes,
    )?;
    let rounds = read_rounds(config, &stored, &keratin, &raw)?;
    read_summary(&mut report, config, &stored, &rounds);
    remove_and_settle(&stored.dir)?;
    Ok(report)
}

/// One round of an append case: Keratin's run and the reference's.
struct AppendRound {
    keratin: AppendRun,
    raw: AppendRun,
}

fn append_rounds(
    config: &LogBenchConfig,
    appenders: usize,
    keratin: &Keratin<'_>,
    raw: &Raw<'_>,
) -> BenchResult<Vec<AppendRound>> {
    let mut rounds: Vec<AppendRound> = Vec::new();
    for round in 0..config.rounds {
        // The reference replays the batches of the latest Keratin run: in odd rounds it goes
        // first, with the previous round's batches.
        let keratin_first = round % 2 == 0;
        let (k, r) = if keratin_first {
            let k = append_once(config, appenders, round, keratin, &[], 0)?;
            let r = append_once(config, appenders, round, raw, &k.batches, k.disk_bytes)?;
            (k, r)
        } else {
            let last = &rounds[round - 1].keratin;
            let r = append_once(
                config,
                appenders,
                round,
                raw,
                &last.batches,
                last.disk_bytes,
            )?;
            let k = append_once(config, appenders, round, keratin, &[], 0)?;
            (k, r)
        };
        eprintln!(
            "  round {round}: keratin {:.0} rec/s ({} syncs), raw {:.0} rec/s ({} syncs), ratio {:.2}",
            k.records_per_s(),
            k.syncs,
            r.records_per_s(),
            r.syncs,
            k.records_per_s() / r.records_per_s().max(1e-9),
        );
        rounds.push(AppendRound { keratin: k, raw: r });
    }
    Ok(rounds)
}

fn append_once(
    config: &LogBenchConfig,
    appenders: usize,
    round: usize,
    contender: &dyn Contender,
    batches: &[u32],
    keratin_disk_bytes: u64,
) -> BenchResult<AppendRun> {
    let dir = config.dir.join(format!(
        "append-{appenders}-round-{round}-{}",
        contender.name()
    ));
    std::fs::create_dir_all(&dir)?;
    // Four times what Keratin wrote in its run of the same length: the reference should never
    // wrap, since rewriting blocks already written is cheaper than writing into unwritten
    // extents and would flatter it (the report counts wraps).
    let prealloc_bytes = keratin_disk_bytes
        .saturating_mul(PREALLOC_MARGIN)
        .div_ceil(PREALLOC_STEP_BYTES)
        .max(1)
        .saturating_mul(PREALLOC_STEP_BYTES)
        .min(PREALLOC_MAX_BYTES);
    let work = AppendWork {
        dir: &dir,
        duration: config.duration,
        record_bytes: config.record_bytes,
        appenders,
        batches,
        prealloc_bytes,
    };
    let run = contender.append(&work)?;
    remove_and_settle(&dir)?;
    Ok(run)
}

fn append_goal(appenders: usize) -> Option<f64> {
    match appenders {
        1 => Some(0.6),
        64 => Some(0.85),
        _ => None,
    }
}

fn append_summary(
    report: &mut Report,
    config: &LogBenchConfig,
    appenders: usize,
    rounds: &[AppendRound],
) {
    let k_rps: Vec<f64> = rounds.iter().map(|r| r.keratin.records_per_s()).collect();
    let r_rps: Vec<f64> = rounds.iter().map(|r| r.raw.records_per_s()).collect();
    let k_mbs: Vec<f64> = rounds.iter().map(|r| r.keratin.mb_per_s()).collect();
    let r_mbs: Vec<f64> = rounds.iter().map(|r| r.raw.mb_per_s()).collect();
    let ratios: Vec<f64> = k_rps
        .iter()
        .zip(&r_rps)
        .map(|(k, r)| k / r.max(1e-9))
        .collect();
    let batches: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.keratin.batches.iter().map(|b| u64::from(*b)))
        .collect();
    let mean_batch = batches.iter().sum::<u64>() as f64 / batches.len().max(1) as f64;
    let batch_note = format!(
        "batch rec/sync: mean {mean_batch:.1}, p50 {}, p90 {}, max {}",
        percentile(&batches, 0.5),
        percentile(&batches, 0.9),
        percentile(&batches, 1.0),
    );
    let case = format!(
        "append {} B, {appenders} appender{}",
        config.record_bytes,
        if appenders == 1 { "" } else { "s" }
    );
    report.rows.push(Row {
        case: case.clone(),
        keratin: format!("{:.0} rec/s {:.2} MB/s", median(&k_rps), median(&k_mbs)),
        reference: format!("{:.0} rec/s {:.2} MB/s", median(&r_rps), median(&r_mbs)),
        ratio: median(&ratios),
        round_ratios: ratios.clone(),
        goal: append_goal(appenders),
        note: batch_note.clone(),
    });
    report
        .diagnostics
        .push(append_diagnostics(&case, rounds, &batches));
    report.json_cases.push(json!({
        "case": case,
        "appenders": appenders,
        "keratin_records_per_s": k_rps,
        "raw_records_per_s": r_rps,
        "keratin_mb_per_s": k_mbs,
        "raw_mb_per_s": r_mbs,
        "ratios": ratios,
        "median_ratio": median(&ratios),
        "goal": append_goal(appenders),
        "batch_records_mean": mean_batch,
        "batch_records_p50": percentile(&batches, 0.5),
        "batch_records_p90": percentile(&batches, 0.9),
        "batch_records_max": percentile(&batches, 1.0),
        "rounds": rounds.iter().map(|r| json!({
            "keratin": append_run_json(&r.keratin),
            "raw": append_run_json(&r.raw),
        })).collect::<Vec<_>>(),
    }));
}

fn append_run_json(run: &AppendRun) -> serde_json::Value {
    json!({
        "records": run.records,
        "elapsed_s": run.elapsed.as_secs_f64(),
        "syncs": run.syncs,
        "record_syncs": run.batches.len(),
        "dir_syncs": run.dir_syncs,
        "writes": run.writes,
        "sync_busy": run.sync_time.as_secs_f64() / run.elapsed.as_secs_f64().max(1e-9),
        "write_busy": run.write_time.as_secs_f64() / run.elapsed.as_secs_f64().max(1e-9),
        "sync_p50_us": percentile(&run.sync_latencies_ns, 0.5) / 1000,
        "sync_p99_us": percentile(&run.sync_latencies_ns, 0.99) / 1000,
        "disk_bytes": run.disk_bytes,
        "append_p50_us": percentile(&run.append_latencies_us, 0.5),
        "append_p99_us": percentile(&run.append_latencies_us, 0.99),
        "wraps": run.wraps,
    })
}

/// Where the time went, for the rows that miss their goal: how many syncs each side made, how
/// long they took, and how much of the wall time the commit thread spent inside the disk.
fn append_diagnostics(case: &str, rounds: &[AppendRound], batches: &[u64]) -> String {
    let med = |f: &dyn Fn(&AppendRound) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
    let per_s = |run: &AppendRun, n: u64| n as f64 / run.elapsed.as_secs_f64().max(1e-9);
    let busy = |run: &AppendRun, t: Duration| t.as_secs_f64() / run.elapsed.as_secs_f64().max(1e-9);
    let k_lat: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.keratin.sync_latencies_ns.clone())
        .collect();
    let r_lat: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.raw.sync_latencies_ns.clone())
        .collect();
    let app: Vec<u64> = rounds
        .iter()
        .flat_map(|r| r.keratin.append_latencies_us.clone())
        .collect();
    let extra_syncs: u64 = rounds
        .iter()
        .map(|r| r.keratin.syncs - r.keratin.batches.len() as u64)
        .sum();
    let dir_syncs: u64 = rounds.iter().map(|r| r.keratin.dir_syncs).sum();
    let wraps: u64 = rounds.iter().map(|r| r.raw.wraps).sum();
    let writes_per_sync = med(&|r| r.keratin.writes as f64 / r.keratin.syncs.max(1) as f64);
    let disk_per_record = med(&|r| r.keratin.disk_bytes as f64 / r.keratin.records.max(1) as f64);
    format!(
        "{case}: syncs/s keratin {:.0} raw {:.0}; sync p50/p99 keratin {}/{} us raw {}/{} us; \
         keratin commit thread in sync {:.0}% in write {:.0}% (raw {:.0}%/{:.0}%); \
         append latency p50/p99 {}/{} us; {} record syncs, {extra_syncs} other data syncs, \
         {dir_syncs} dir syncs, {writes_per_sync:.2} writes/sync; {disk_per_record:.0} disk bytes/record; raw wraps {wraps}",
        med(&|r| per_s(&r.keratin, r.keratin.syncs)),
        med(&|r| per_s(&r.raw, r.raw.syncs)),
        percentile(&k_lat, 0.5) / 1000,
        percentile(&k_lat, 0.99) / 1000,
        percentile(&r_lat, 0.5) / 1000,
        percentile(&r_lat, 0.99) / 1000,
        100.0 * med(&|r| busy(&r.keratin, r.keratin.sync_time)),
        100.0 * med(&|r| busy(&r.keratin, r.keratin.write_time)),
        100.0 * med(&|r| busy(&r.raw, r.raw.sync_time)),
        100.0 * med(&|r| busy(&r.raw, r.raw.write_time)),
        percentile(&app, 0.5),
        percentile(&app, 0.99),
        batches.len(),
    )
}

/// Keratin's run and the reference's of one kind, from a read round.
type PickRuns = fn(&ReadRound) -> (&ReadRun, &ReadRun);

/// One round of the read case.
struct ReadRound {
    keratin_read: ReadRun,
    keratin_recover: ReadRun,
    raw_read: ReadRun,
    raw_recover: ReadRun,
}

fn read_rounds(
    config: &LogBenchConfig,
    stored: &StoredLog,
    keratin: &Keratin<'_>,
    raw: &Raw<'_>,
) -> BenchResult<Vec<ReadRound>> {
    let mut rounds = Vec::new();
    for round in 0..config.rounds {
        let round = if round % 2 == 0 {
            let raw_read = raw.read(stored)?;
            let keratin_read = keratin.read(stored)?;
            let raw_recover = raw.recover(stored)?;
            let keratin_recover = keratin.recover(stored)?;
            ReadRound {
                keratin_read,
                keratin_recover,
                raw_read,
                raw_recover,
            }
        } else {
            let keratin_read = keratin.read(stored)?;
            let raw_read = raw.read(stored)?;
            let keratin_recover = keratin.recover(stored)?;
            let raw_recover = raw.recover(stored)?;
            ReadRound {
                keratin_read,
                keratin_recover,
                raw_read,
                raw_recover,
            }
        };
        eprintln!(
            "  round {}: read keratin {:.0} MB/s raw {:.0} MB/s; recovery keratin {:.0} MB/s ({:.2} s) raw {:.0} MB/s",
            rounds.len(),
            round.keratin_read.mb_per_s(),
            round.raw_read.mb_per_s(),
            round.keratin_recover.mb_per_s(),
            round.keratin_recover.elapsed.as_secs_f64(),
            round.raw_recover.mb_per_s(),
        );
        rounds.push(round);
    }
    Ok(rounds)
}

fn read_summary(
    report: &mut Report,
    config: &LogBenchConfig,
    stored: &StoredLog,
    rounds: &[ReadRound],
) {
    let size = human_bytes(config.read_bytes);
    let segments = stored.segments.len();
    let pairs: [(&str, PickRuns); 2] = [
        ("sequential read", |r| (&r.keratin_read, &r.raw_read)),
        ("recovery (open)", |r| (&r.keratin_recover, &r.raw_recover)),
    ];
    for (name, pick) in pairs {
        let k_mbs: Vec<f64> = rounds.iter().map(|r| pick(r).0.mb_per_s()).collect();
        let r_mbs: Vec<f64> = rounds.iter().map(|r| pick(r).1.mb_per_s()).collect();
        let k_s: Vec<f64> = rounds
            .iter()
            .map(|r| pick(r).0.elapsed.as_secs_f64())
            .collect();
        let r_s: Vec<f64> = rounds
            .iter()
            .map(|r| pick(r).1.elapsed.as_secs_f64())
            .collect();
        let ratios: Vec<f64> = k_mbs
            .iter()
            .zip(&r_mbs)
            .map(|(k, r)| k / r.max(1e-9))
            .collect();
        let case = format!("{name} {size}");
        report.rows.push(Row {
            case: case.clone(),
            keratin: format!("{:.0} MB/s {:.2} s", median(&k_mbs), median(&k_s)),
            reference: format!("{:.0} MB/s {:.2} s", median(&r_mbs), median(&r_s)),
            ratio: median(&ratios),
            round_ratios: ratios.clone(),
            goal: None,
            note: format!(
                "{segments} segment(s) of 64 MiB, {:.1} MB used; keratin read {:.1} MB from disk; \
                 reference: pread 1 MiB chunks of the used bytes",
                stored.used_bytes() as f64 / 1e6,
                median(
                    &rounds
                        .iter()
                        .map(|r| pick(r).0.read_bytes as f64)
                        .collect::<Vec<_>>()
                ) / 1e6,
            ),
        });
        report.json_cases.push(json!({
            "case": case,
            "keratin_mb_per_s": k_mbs,
            "raw_mb_per_s": r_mbs,
            "keratin_s": k_s,
            "raw_s": r_s,
            "ratios": ratios,
            "median_ratio": median(&ratios),
            "log_bytes": stored.used_bytes(),
            "segments": segments,
            "keratin_read_bytes": rounds.iter().map(|r| pick(r).0.read_bytes).collect::<Vec<_>>(),
            "keratin_records": rounds.iter().map(|r| pick(r).0.records).collect::<Vec<_>>(),
        }));
    }
}

/// Remove a run's files and wait until the removal is on disk. The file system here may be
/// mounted with `discard`: freeing a file's blocks then costs discards at the next journal
/// commit, which would land inside the next run's first syncs. `sync` pays for them now.
fn remove_and_settle(dir: &Path) -> BenchResult<()> {
    std::fs::remove_dir_all(dir)?;
    rustix::fs::sync();
    Ok(())
}

/// `1 GiB`, `16 MiB`, or bytes.
pub fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} B")
    }
}

/// The file system type of `path`, by its `statfs` magic number.
pub fn filesystem_name(path: &Path) -> String {
    let Ok(stat) = rustix::fs::statfs(path) else {
        return "unknown".into();
    };
    let magic = stat.f_type as u64;
    match magic {
        0xEF53 => "ext4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x0102_1994 => "tmpfs".into(),
        0x794C_7630 => "overlayfs".into(),
        0x2FC1_2FC1 => "zfs".into(),
        other => format!("0x{other:x}"),
    }
}
