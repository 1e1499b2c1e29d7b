//! A segment a log removes (its prefix) goes to the pool, where another log may take it and
//! write over it at once. A reader of the first log still inside that segment then reads the
//! other log's records: that must read as "removed" (`OutOfRange`), never as corruption of
//! data reported durable. The removal leaves the readers' map before the file reaches the pool:
//! before, it left after the directory sync that follows the hand-over, and in between a reader
//! saw the reused file as a corrupt segment of its own log.
//!
//! Two logs share one pool on a real directory; the removing log's directory sync is held (a
//! gated `Io`) while the other log takes the spare and writes it full.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{payload, record};
use keratin_log::{
    FsStats, Io, IoError, IoFile, Log, LogError, LogOptions, OpenMode, PoolOptions, RealIo,
    SegmentPool,
};

/// Holds `sync_dir` of one directory while armed, and says when a sync is held.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    armed: Option<PathBuf>,
    held: bool,
}

impl Gate {
    fn pass(&self, path: &Path) {
        let mut state = self.state.lock().expect("gate");
        if state.armed.as_deref() != Some(path) {
            return;
        }
        state.held = true;
        self.changed.notify_all();
        // Bounded: a test that never releases fails by its own timeouts, not a hang here.
        let (_state, _) = self
            .changed
            .wait_timeout_while(state, Duration::from_secs(20), |s| s.armed.is_some())
            .expect("gate");
    }

    fn wait_held(&self) {
        let state = self.state.lock().expect("gate");
        let (state, _) = self
            .changed
            .wait_timeout_while(state, Duration::from_secs(20), |s| !s.held)
            .expect("gate");
        assert!(state.held, "the removal never reached its directory sync");
    }

    fn release(&self) {
        self.state.lock().expect("gate").armed = None;
        self.changed.notify_all();
    }
}

#[derive(Debug)]
struct GatedIo {
    inner: RealIo,
    gate: Arc<Gate>,
}

impl Io for GatedIo {
    fn open(&self, path: &Path, mode: OpenMode) -> Result<Arc<dyn IoFile>, IoError> {
        self.inner.open(path, mode)
    }
    fn create_dir_all(&self, path: &Path) -> Result<(), IoError> {
        self.inner.create_dir_all(path)
    }
    fn read_dir(&self, path: &Path) -> Result<Vec<String>, IoError> {
        self.inner.read_dir(path)
    }
    fn remove_file(&self, path: &Path) -> Result<(), IoError> {
        self.inner.remove_file(path)
    }
    fn remove_dir(&self, path: &Path) -> Result<(), IoError> {
        self.inner.remove_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), IoError> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, path: &Path) -> Result<(), IoError> {
        self.gate.pass(path);
        self.inner.sync_dir(path)
    }
    fn device_id(&self, path: &Path) -> Result<u64, IoError> {
        self.inner.device_id(path)
    }
    fn exists(&self, path: &Path) -> Result<bool, IoError> {
        self.inner.exists(path)
    }
    fn fs_stats(&self, path: &Path) -> Result<FsStats, IoError> {
        self.inner.fs_stats(path)
    }
}

#[test]
fn a_reader_in_a_segment_reused_by_another_log_reads_it_as_removed() {
    let root = tempfile::tempdir().expect("temp dir");
    let gate = Arc::new(Gate::default());
    let io: Arc<dyn Io> = Arc::new(GatedIo {
        inner: RealIo::new(),
        gate: gate.clone(),
    });
    // Segments of 4 MiB: a reader reads a segment in chunks of 1 MiB, so most of the first
    // segment is read after the reuse.
    let options = LogOptions {
        full_segment_size_bytes: 4 << 20,
        ..LogOptions::default()
    };
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: options.full_segment_size_bytes,
            budget_bytes: Some(16 * options.full_segment_size_bytes),
            background: false,
            ..PoolOptions::default()
        },
    );
    let a_dir = root.path().join("a");
    let a = Arc::new(
        Log::open(io.clone(), &a_dir, options.clone(), Some(pool.clone())).expect("open a"),
    );
    let b = Log::open(
        io.clone(),
        &root.path().join("b"),
        options.clone(),
        Some(pool),
    )
    .expect("open b");

    // Log a: three segments or more of records a byte pattern tells apart from b's.
    let body_bytes = 4096;
    let per_segment = options.segment_size_bytes() / (body_bytes as u64 + 64);
    let total = per_segment * 3 + 1;
    for offset in 0..total {
        a.append_sync(&[record(&payload(offset, 1, body_bytes))])
            .expect("append to a");
    }
    let second = a.stats().segments[1].base_offset;
    let mut reader = a.reader(0);
    reader.next().expect("a record").expect("the first record");

    // The removal of a's first segment holds at its directory sync, after the hand-over.
    gate.state.lock().expect("gate").armed = Some(a_dir.clone());
    let removal = {
        let a = a.clone();
        std::thread::spawn(move || a.remove_prefix(second).and_then(|ticket| ticket.wait()))
    };
    gate.wait_held();
    // Log b takes the spare (a roll takes one from the pool) and writes it full.
    b.roll().and_then(|ticket| ticket.wait()).expect("roll b");
    for offset in 0..per_segment {
        b.append_sync(&[record(&payload(offset, 2, body_bytes))])
            .expect("append to b");
    }

    let mut read = Vec::new();
    let outcome = loop {
        match reader.next() {
            Some(Ok(record)) if record.offset < second => read.push(record.offset),
            Some(Ok(record)) => break Ok(record.offset),
            Some(Err(error)) => break Err(error),
            None => break Ok(u64::MAX),
        }
    };
    gate.release();
    removal
        .join()
        .expect("removal thread")
        .expect("the removal");
    match outcome {
        Err(LogError::OutOfRange { .. }) => {}
        other => panic!(
            "a reader in a's removed segment, reused by b, after {} records: {other:?}",
            read.len()
        ),
    }
}
