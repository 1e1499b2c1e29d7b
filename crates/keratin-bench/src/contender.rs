//! `Contender`: the one trait every storage under test implements (redb's `BenchDatabase`), and
//! the workloads and figures it speaks in. Keratin's log (`keratin.rs`) and the raw reference
//! (`raw.rs`) are the two implementations; `log_bench.rs` runs the same workload against both.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors of a benchmark run: it stops and says why.
pub type BenchError = Box<dyn std::error::Error + Send + Sync>;
/// Result of a benchmark step.
pub type BenchResult<T> = Result<T, BenchError>;

/// A durable-append workload.
#[derive(Debug, Clone)]
pub struct AppendWork<'a> {
    /// A fresh directory for this run's files; removed by the caller afterwards.
    pub dir: &'a Path,
    /// How long to append for.
    pub duration: Duration,
    /// Payload bytes of one record.
    pub record_bytes: usize,
    /// Concurrent appenders, each appending one record and waiting for it to be durable.
    pub appenders: usize,
    /// Records per sync to replay, in order and cyclically: Keratin's achieved group-commit
    /// batches. Keratin itself ignores it (its batches come from its appenders).
    pub batches: &'a [u32],
    /// Bytes the reference preallocates before its timed loop (see `raw.rs`).
    pub prealloc_bytes: u64,
}

/// What one append run achieved.
#[derive(Debug, Clone, Default)]
pub struct AppendRun {
    /// Records made durable (every one confirmed by a completed sync).
    pub records: u64,
    /// Their payload bytes.
    pub payload_bytes: u64,
    /// Wall time from the first append to the last confirmation.
    pub elapsed: Duration,
    /// Data syncs that covered at least one record, as records per sync, in order.
    pub batches: Vec<u32>,
    /// Every data sync, including those that covered no record (a new segment's own sync).
    pub syncs: u64,
    /// Directory syncs (a new segment's name).
    pub dir_syncs: u64,
    /// Write calls (records of one batch go out in one write; a seal is one more).
    pub writes: u64,
    /// Latency of each data sync, in nanoseconds.
    pub sync_latencies_ns: Vec<u64>,
    /// Time spent inside data and directory syncs.
    pub sync_time: Duration,
    /// Time spent inside writes.
    pub write_time: Duration,
    /// Bytes written to the disk (payloads, record headers, segment headers, seals).
    pub disk_bytes: u64,
    /// Per-record latency from `append` to confirmation, in microseconds (Keratin only).
    pub append_latencies_us: Vec<u64>,
    /// Times the reference ran past its preallocated file and wrapped to its start.
    pub wraps: u64,
}

impl AppendRun {
    /// Durable records per second.
    pub fn records_per_s(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Durable payload megabytes (10^6 bytes) per second.
    pub fn mb_per_s(&self) -> f64 {
        self.payload_bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A log written once and read back by every read and recovery run.
#[derive(Debug, Clone)]
pub struct StoredLog {
    /// The log's directory.
    pub dir: PathBuf,
    /// Its segment files, oldest first, with the bytes of each that hold the header and records.
    pub segments: Vec<(PathBuf, u64)>,
    /// Records in the log.
    pub records: u64,
    /// Their payload bytes.
    pub payload_bytes: u64,
}

impl StoredLog {
    /// Bytes of the segment files that hold headers and records (what a reader must read).
    pub fn used_bytes(&self) -> u64 {
        self.segments.iter().map(|(_, used)| used).sum()
    }
}

/// What one read or recovery run achieved.
#[derive(Debug, Clone, Default)]
pub struct ReadRun {
    /// Bytes of the log covered: the used bytes of its segments.
    pub log_bytes: u64,
    /// Bytes actually read from the files.
    pub read_bytes: u64,
    /// Records returned (0 for the raw read and for recovery).
    pub records: u64,
    /// Wall time.
    pub elapsed: Duration,
}

impl ReadRun {
    /// Megabytes (10^6 bytes) of the log covered per second.
    pub fn mb_per_s(&self) -> f64 {
        self.log_bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A storage under test. Both implementations run every workload in the same invocation, on the
/// same file system, so that their ratio cancels the disk's mood of the moment.
pub trait Contender {
    /// Short name for tables.
    fn name(&self) -> &'static str;

    /// Durable appends for `work.duration`.
    fn append(&self, work: &AppendWork<'_>) -> BenchResult<AppendRun>;

    /// Read the whole log sequentially, from a cold page cache if the caller could drop it.
    fn read(&self, log: &StoredLog) -> BenchResult<ReadRun>;

    /// Bring the log back after a restart: Keratin opens it (recovery verifies every record of
    /// every segment); the reference reads every byte once, the least any verifying recovery does.
    fn recover(&self, log: &StoredLog) -> BenchResult<ReadRun>;
}
