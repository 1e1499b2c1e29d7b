//! Helpers shared by the log's integration tests: running one scenario on both `Io`
//! implementations, and payloads that say which offset and which write they belong to.

#![allow(dead_code)]

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
