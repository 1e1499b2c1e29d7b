//! Helpers shared by the log's integration tests: running one scenario on both `Io`
//! implementations, and payloads that say which offset and which write they belong to.

#![allow(dead_code)]

pub mod gate;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keratin_log::{Io, Log, LogOptions, RealIo, Record, SimIo};

/// Small segments so that scenarios roll often: 256 KiB full.
pub fn small_options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: 256 << 10,
        ..LogOptions::default()
    }
}

/// The seed for randomized tests: `KERATIN_SEED` if set, else `default`. Printed so that a
/// failure can be replayed.
pub fn seed(default: u64) -> u64 {
    let seed = std::env::var("KERATIN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    eprintln!("seed {seed} (replay with KERATIN_SEED={seed})");
    seed
}

/// A payload that names its offset and a version, padded to `len` bytes.
pub fn payload(offset: u64, version: u32, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(len.max(12));
    p.extend_from_slice(&offset.to_le_bytes());
    p.extend_from_slice(&version.to_le_bytes());
    while p.len() < len {
        p.push((offset as u8).wrapping_mul(31).wrapping_add(p.len() as u8));
    }
    p
}

pub fn record(payload: &[u8]) -> Record<'_> {
    Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 1_700_000_000_000,
        payload,
    }
}

/// The environments every non-crash scenario runs in.
pub enum Env {
    Sim(SimIo),
    Real(tempfile::TempDir),
}

impl Env {
    pub fn io(&self) -> Arc<dyn Io> {
        match self {
            Env::Sim(sim) => Arc::new(sim.clone()),
            Env::Real(_) => Arc::new(RealIo::new()),
        }
    }

    pub fn dir(&self) -> PathBuf {
        match self {
            Env::Sim(_) => PathBuf::from("/sim/log"),
            Env::Real(tmp) => tmp.path().join("log"),
        }
    }

    pub fn open(&self, options: &LogOptions) -> Log {
        Log::open(self.io(), &self.dir(), options.clone(), None).expect("open log")
    }

    pub fn name(&self) -> &'static str {
        match self {
            Env::Sim(_) => "sim",
            Env::Real(_) => "real",
        }
    }
}

/// Run `scenario` on a simulated disk and on the real file system.
pub fn on_both(scenario: impl Fn(&Env)) {
    let sim = Env::Sim(SimIo::new(7));
    scenario(&sim);
    let real = Env::Real(tempfile::tempdir().expect("tempdir"));
    scenario(&real);
}

pub fn segment_path(dir: &Path, base: u64) -> PathBuf {
    dir.join(format!("{base:020}.seg"))
}

/// The offset and version a [`payload`] names, if `bytes` is one of ours at all.
pub fn payload_origin(bytes: &[u8]) -> Option<(u64, u32)> {
    let offset = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let version = u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?);
    (payload(offset, version, bytes.len()) == bytes).then_some((offset, version))
}

/// Every durable record from the log's start, checked to run without a gap from
/// `start_offset` to `durable_offset`. Panics (with `context`) on a read error or a gap.
pub fn read_all(log: &Log, context: &str) -> Vec<keratin_log::ReadRecord> {
    let start = log.start_offset();
    let durable = log.durable_offset();
    let mut records = Vec::new();
    for (i, result) in log.reader(start).enumerate() {
        let record = result.unwrap_or_else(|e| panic!("{context}: reading from {start}: {e}"));
        assert_eq!(
            record.offset,
            start + i as u64,
            "{context}: offsets are not contiguous"
        );
        records.push(record);
    }
    assert_eq!(
        start + records.len() as u64,
        durable,
        "{context}: iteration from {start} stopped before the durable end"
    );
    records
}

/// The whole content of a file, through the `Io` seam (works on both implementations).
pub fn read_file(io: &dyn Io, path: &Path) -> Vec<u8> {
    let file = io
        .open(path, keratin_log::OpenMode::Existing)
        .expect("open file");
    let len = file.len().expect("stat file");
    let mut bytes = vec![0u8; usize::try_from(len).expect("file fits in memory")];
    file.read_exact_at(&mut bytes, 0).expect("read file");
    bytes
}

/// Create `path` with `bytes`, durable (data and directory entry), through the `Io` seam.
pub fn write_new_file(io: &dyn Io, path: &Path, bytes: &[u8]) {
    let file = io
        .open(path, keratin_log::OpenMode::CreateNew)
        .expect("create file");
    file.write_all_at(bytes, 0).expect("write file");
    file.sync_data().expect("sync file");
    io.sync_dir(path.parent().expect("file has a parent"))
        .expect("sync dir");
}

/// Flip `mask` in the byte at `position` of `path`, durably, through the `Io` seam: bit rot on
/// the real file system as well as on the simulated one.
pub fn flip_byte(io: &dyn Io, path: &Path, position: u64, mask: u8) {
    let file = io
        .open(path, keratin_log::OpenMode::Existing)
        .expect("open file");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, position).expect("read byte");
    byte[0] ^= mask;
    file.write_all_at(&byte, position).expect("write byte");
    file.sync_data().expect("sync file");
}

/// Byte positions of the records of one segment, given their payload lengths in order.
pub fn record_positions(lengths: &[usize]) -> Vec<u64> {
    let mut position = keratin_log::format::SEGMENT_HEADER_SIZE as u64;
    lengths
        .iter()
        .map(|len| {
            let at = position;
            position += (keratin_log::format::RECORD_HEADER_SIZE + len) as u64;
            at
        })
        .collect()
}
