//! `CountingIo`: an [`Io`] that forwards every call to another one (the real file system) and
//! counts what the log asked of the disk: writes, data syncs with the bytes each one covered,
//! directory syncs, reads, and the time spent in each. It is how the benchmark learns the batch
//! sizes Keratin's group commit achieved, without any hook inside the log.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use keratin_log::io::IoResult;
use keratin_log::{FsStats, Io, IoFile, OpenMode};

/// Totals since the counters were created or last [`Counters::reset`].
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// `write_all_at` calls and the bytes they wrote.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Nanoseconds spent in `write_all_at`.
    pub write_ns: u64,
    /// `sync_data` calls.
    pub syncs: u64,
    /// Nanoseconds spent in `sync_data`.
    pub sync_ns: u64,
    /// `sync_dir` calls.
    pub dir_syncs: u64,
    /// Nanoseconds spent in `sync_dir`.
    pub dir_sync_ns: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes each data sync covered (written to that file since its previous sync), in order.
    pub sync_batches_bytes: Vec<u64>,
    /// Latency of each data sync, in nanoseconds, in order.
    pub sync_latencies_ns: Vec<u64>,
}

/// Counters shared by a [`CountingIo`] and every file it opened.
#[derive(Debug, Default)]
pub struct Counters {
    writes: AtomicU64,
    write_bytes: AtomicU64,
    write_ns: AtomicU64,
    syncs: AtomicU64,
    sync_ns: AtomicU64,
    dir_syncs: AtomicU64,
    dir_sync_ns: AtomicU64,
    read_bytes: AtomicU64,
    /// Per sync: (bytes covered, latency ns). Only the commit thread syncs, so the lock is
    /// uncontended; it is taken after the sync returns, never around it.
    sync_log: Mutex<Vec<(u64, u64)>>,
}

impl Counters {
    fn sync_log(&self) -> MutexGuard<'_, Vec<(u64, u64)>> {
        self.sync_log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forget everything counted so far (call it when the measured window starts).
    pub fn reset(&self) {
        for counter in [
            &self.writes,
            &self.write_bytes,
            &self.write_ns,
            &self.syncs,
            &self.sync_ns,
            &self.dir_syncs,
            &self.dir_sync_ns,
            &self.read_bytes,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        self.sync_log().clear();
    }

    /// What was counted since the last reset.
    pub fn snapshot(&self) -> Snapshot {
        let log = self.sync_log().clone();
        Snapshot {
            writes: self.writes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            write_ns: self.write_ns.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            sync_ns: self.sync_ns.load(Ordering::Relaxed),
            dir_syncs: self.dir_syncs.load(Ordering::Relaxed),
            dir_sync_ns: self.dir_sync_ns.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            sync_batches_bytes: log.iter().map(|(bytes, _)| *bytes).collect(),
            sync_latencies_ns: log.iter().map(|(_, ns)| *ns).collect(),
        }
    }
}

fn nanos_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// An [`Io`] that counts and forwards.
#[derive(Debug)]
pub struct CountingIo {
    inner: Arc<dyn Io>,
    counters: Arc<Counters>,
}

impl CountingIo {
    /// Count the calls made to `inner`.
    pub fn new(inner: Arc<dyn Io>) -> CountingIo {
        CountingIo {
            inner,
            counters: Arc::new(Counters::default()),
        }
    }

    /// The counters, shared with every file opened through this `Io`.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }
}

/// A file opened through [`CountingIo`].
#[derive(Debug)]
struct CountingFile {
    inner: Arc<dyn IoFile>,
    counters: Arc<Counters>,
    /// Bytes written to this file since its last sync.
    unsynced_bytes: AtomicU64,
}

impl IoFile for CountingFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.inner.read_exact_at(buf, position)?;
        self.counters
            .read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        let start = Instant::now();
        self.inner.write_all_at(buf, position)?;
        let c = &self.counters;
        c.write_ns.fetch_add(nanos_since(start), Ordering::Relaxed);
        c.writes.fetch_add(1, Ordering::Relaxed);
        c.write_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.unsynced_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn sync_data(&self) -> IoResult<()> {
        let covered = self.unsynced_bytes.swap(0, Ordering::Relaxed);
        let start = Instant::now();
        self.inner.sync_data()?;
        let latency_ns = nanos_since(start);
        let c = &self.counters;
        c.sync_ns.fetch_add(latency_ns, Ordering::Relaxed);
        c.syncs.fetch_add(1, Ordering::Relaxed);
        c.sync_log().push((covered, latency_ns));
        Ok(())
    }

    fn allocate(&self, len: u64) -> IoResult<()> {
        self.inner.allocate(len)
    }

    fn set_len(&self, len: u64) -> IoResult<()> {
        self.inner.set_len(len)
    }

    fn len(&self) -> IoResult<u64> {
        self.inner.len()
    }
}

impl Io for CountingIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let inner = self.inner.open(path, mode)?;
        Ok(Arc::new(CountingFile {
            inner,
            counters: self.counters.clone(),
            unsynced_bytes: AtomicU64::new(0),
        }))
    }

    fn create_dir_all(&self, path: &Path) -> IoResult<()> {
        self.inner.create_dir_all(path)
    }

    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>> {
        self.inner.read_dir(path)
    }

    fn remove_file(&self, path: &Path) -> IoResult<()> {
        self.inner.remove_file(path)
    }

    fn remove_dir(&self, path: &Path) -> IoResult<()> {
        self.inner.remove_dir(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> IoResult<()> {
        self.inner.rename(from, to)
    }

    fn sync_dir(&self, path: &Path) -> IoResult<()> {
        let start = Instant::now();
        self.inner.sync_dir(path)?;
        let c = &self.counters;
        c.dir_sync_ns
            .fetch_add(nanos_since(start), Ordering::Relaxed);
        c.dir_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn device_id(&self, path: &Path) -> IoResult<u64> {
        self.inner.device_id(path)
    }

    fn exists(&self, path: &Path) -> IoResult<bool> {
        self.inner.exists(path)
    }

    fn fs_stats(&self, path: &Path) -> IoResult<FsStats> {
        self.inner.fs_stats(path)
    }
}
