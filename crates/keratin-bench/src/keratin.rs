//! The Keratin contender: `keratin_log::Log` on the real file system, behind a [`CountingIo`] so
//! that the run reports how many syncs its group commit needed and how many records each covered.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use keratin_log::format::RECORD_HEADER_SIZE;
use keratin_log::{Log, LogOptions, RealIo, Record};

use crate::contender::{AppendRun, AppendWork, BenchResult, Contender, ReadRun, StoredLog};
use crate::counting_io::{CountingIo, Snapshot};
use crate::page_cache::PageCache;

/// Keratin's segment log with default options (64 MiB segments, group commit, seal when idle).
#[derive(Debug)]
pub struct Keratin<'a> {
    /// Dropped before every read and recovery, if it can be.
    pub cache: &'a PageCache,
}

/// What one appender thread saw.
#[derive(Debug, Default)]
struct AppenderRun {
    records: u64,
    latencies_us: Vec<u64>,
}

/// Append one record at a time and wait for it to be durable, until `stop`.
fn appender_loop(log: &Log, payload: &[u8], start: &Barrier, stop: &AtomicBool) -> AppenderRun {
    let record = Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 0,
        payload,
    };
    let mut run = AppenderRun::default();
    start.wait();
    while !stop.load(Ordering::Relaxed) {
        let began = Instant::now();
        let confirmed = log.append(&[record]).and_then(|ticket| ticket.wait());
        if let Err(error) = confirmed {
            eprintln!("keratin appender: {error}");
            break;
        }
        run.records += 1;
        let micros = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
        run.latencies_us.push(micros);
    }
    run
}

/// Records per data sync, from the bytes each sync covered; syncs that covered less than one
/// record (a new segment's header, a seal) are not batches. A seal written after a batch and
/// overwritten by the next is shorter than a record, so flooring drops it.
fn batches_from(snapshot: &Snapshot, record_bytes: usize) -> Vec<u32> {
    let on_disk = (RECORD_HEADER_SIZE + record_bytes) as u64;
    snapshot
        .sync_batches_bytes
        .iter()
        .map(|bytes| u32::try_from(bytes / on_disk).unwrap_or(u32::MAX))
        .filter(|records| *records > 0)
        .collect()
}

impl Keratin<'_> {
    fn open(&self, dir: &std::path::Path) -> BenchResult<(Log, Arc<crate::counting_io::Counters>)> {
        let io = Arc::new(CountingIo::new(Arc::new(RealIo::new())));
        let counters = io.counters();
        let log = Log::open(io, dir, LogOptions::default(), None)?;
        Ok((log, counters))
    }
}

impl Contender for Keratin<'_> {
    fn name(&self) -> &'static str {
        "keratin"
    }

    fn append(&self, work: &AppendWork<'_>) -> BenchResult<AppendRun> {
        let (log, counters) = self.open(&work.dir.join("log"))?;
        let payload = vec![0x5a_u8; work.record_bytes];
        let start = Barrier::new(work.appenders + 1);
        let stop = AtomicBool::new(false);
        let (threads, elapsed, snapshot) = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..work.appenders)
                .map(|_| scope.spawn(|| appender_loop(&log, &payload, &start, &stop)))
                .collect();
            start.wait();
            counters.reset();
            let began = Instant::now();
            std::thread::sleep(work.duration);
            stop.store(true, Ordering::Relaxed);
            let threads: Vec<AppenderRun> = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect();
            (threads, began.elapsed(), counters.snapshot())
        });
        log.close()?;
        let records: u64 = threads.iter().map(|t| t.records).sum();
        Ok(AppendRun {
            records,
            payload_bytes: records * work.record_bytes as u64,
            elapsed,
            batches: batches_from(&snapshot, work.record_bytes),
            syncs: snapshot.syncs,
            dir_syncs: snapshot.dir_syncs,
            writes: snapshot.writes,
            sync_time: Duration::from_nanos(snapshot.sync_ns + snapshot.dir_sync_ns),
            write_time: Duration::from_nanos(snapshot.write_ns),
            disk_bytes: snapshot.write_bytes,
            append_latencies_us: threads.into_iter().flat_map(|t| t.latencies_us).collect(),
            sync_latencies_ns: snapshot.sync_latencies_ns,
            wraps: 0,
        })
    }

    fn read(&self, stored: &StoredLog) -> BenchResult<ReadRun> {
        let (log, counters) = self.open(&stored.dir)?;
        self.cache.drop_caches()?;
        counters.reset();
        let began = Instant::now();
        let mut records = 0u64;
        let mut payload_bytes = 0u64;
        for record in log.reader(0) {
            payload_bytes += record?.payload.len() as u64;
            records += 1;
        }
        let elapsed = began.elapsed();
        let read_bytes = counters.snapshot().read_bytes;
        log.close()?;
        if records != stored.records || payload_bytes != stored.payload_bytes {
            return Err(format!(
                "keratin read {records} records ({payload_bytes} payload bytes); the log holds {} ({})",
                stored.records, stored.payload_bytes
            )
            .into());
        }
        Ok(ReadRun {
            log_bytes: stored.used_bytes(),
            read_bytes,
            records,
            elapsed,
        })
    }

    fn recover(&self, stored: &StoredLog) -> BenchResult<ReadRun> {
        self.cache.drop_caches()?;
        let began = Instant::now();
        let (log, counters) = self.open(&stored.dir)?;
        let elapsed = began.elapsed();
        let read_bytes = counters.snapshot().read_bytes;
        let next_offset = log.next_offset();
        log.close()?;
        if next_offset != stored.records {
            return Err(format!(
                "recovery found {next_offset} records; the log holds {}",
                stored.records
            )
            .into());
        }
        Ok(ReadRun {
            log_bytes: stored.used_bytes(),
            read_bytes,
            records: 0,
            elapsed,
        })
    }
}

/// Records per append while the read benchmark's log is written: 1 MiB of 1 KiB records.
const BUILD_BATCH_RECORDS: usize = 1024;

/// Appends in flight while the log is written: enough to keep the commit thread busy, far below
/// the log's 64 MiB bound on pending bytes (16 × 1 MiB).
const BUILD_TICKETS_MAX: usize = 16;

/// Write a log of `payload_bytes` of `record_bytes` records in `dir` and close it.
pub fn build_stored_log(
    dir: &std::path::Path,
    payload_bytes: u64,
    record_bytes: usize,
) -> BenchResult<StoredLog> {
    let log = Log::open(Arc::new(RealIo::new()), dir, LogOptions::default(), None)?;
    let payload = vec![0xa5_u8; record_bytes];
    let record = Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 0,
        payload: &payload,
    };
    let records_total = (payload_bytes / record_bytes as u64).max(1);
    let mut tickets = std::collections::VecDeque::new();
    let mut written = 0u64;
    while written < records_total {
        let count = (records_total - written).min(BUILD_BATCH_RECORDS as u64) as usize;
        tickets.push_back(log.append(&vec![record; count])?);
        written += count as u64;
        if tickets.len() >= BUILD_TICKETS_MAX {
            if let Some(ticket) = tickets.pop_front() {
                ticket.wait()?;
            }
        }
    }
    for ticket in tickets {
        ticket.wait()?;
    }
    let stats = log.stats();
    log.close()?;
    Ok(StoredLog {
        dir: dir.to_path_buf(),
        segments: stats
            .segments
            .iter()
            .map(|s| (s.path.clone(), s.used_bytes))
            .collect(),
        records: records_total,
        payload_bytes: records_total * record_bytes as u64,
    })
}
