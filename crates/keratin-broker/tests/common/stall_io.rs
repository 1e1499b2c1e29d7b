//! `StallIo`: the real file system, except that data syncs, directory syncs and reads of files
//! under one directory block while that directory is stalled (a disk that stopped answering).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use keratin_log::io::IoResult;
use keratin_log::{FsStats, Io, IoFile, OpenMode, RealIo};

#[derive(Debug, Default)]
struct Gate {
    stalled: Mutex<bool>,
    /// Bumped by [`StallIo::let_waiting_through`]: a call waiting since an older round passes.
    round: std::sync::atomic::AtomicU64,
    /// Reads pass even while stalled (only syncs stall).
    reads_free: std::sync::atomic::AtomicBool,
    released: Condvar,
    /// Calls that blocked so far.
    blocked: Mutex<u64>,
}

impl Gate {
    /// Block while stalled; at most a minute, so a broken test cannot hang for good.
    fn pass(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let mut stalled = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        let round = self.round.load(SeqCst);
        if *stalled {
            *self.blocked.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while *stalled && self.round.load(SeqCst) == round && std::time::Instant::now() < deadline {
            stalled = self
                .released
                .wait_timeout(stalled, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct StallIo {
    real: Arc<RealIo>,
    dir: PathBuf,
    gate: Arc<Gate>,
    /// Placement goes by free space: the stalled directory shows 1 GiB more (when set) or less
    /// than the file system has, so that a test chooses where a queue lands.
    favour: Arc<std::sync::atomic::AtomicBool>,
}

impl StallIo {
    /// Stalls (once [`StallIo::stall`] is called) what lies under `dir`.
    pub fn new(dir: PathBuf) -> StallIo {
        StallIo {
            real: Arc::new(RealIo::new()),
            dir,
            gate: Arc::default(),
            favour: Arc::default(),
        }
    }

    /// Make placement prefer the stalled directory (or the others).
    pub fn favour_stalled(&self, favour: bool) {
        self.favour
            .store(favour, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn stall(&self) {
        *self.gate.stalled.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    pub fn release(&self) {
        *self.gate.stalled.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.gate
            .reads_free
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.gate.released.notify_all();
    }

    /// Stall syncs only; reads go on.
    pub fn stall_syncs(&self) {
        self.gate
            .reads_free
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.stall();
    }

    /// Let the calls waiting now through; later ones still stall.
    pub fn let_waiting_through(&self) {
        let _stalled = self.gate.stalled.lock().unwrap_or_else(|e| e.into_inner());
        self.gate
            .round
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.gate.released.notify_all();
    }

    /// Calls that found the disk stalled.
    pub fn blocked_calls(&self) -> u64 {
        *self.gate.blocked.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stalls(&self, path: &Path) -> bool {
        path.starts_with(&self.dir)
    }
}

#[derive(Debug)]
struct StallFile {
    inner: Arc<dyn IoFile>,
    gate: Option<Arc<Gate>>,
}

impl StallFile {
    fn pass(&self) {
        if let Some(gate) = &self.gate {
            gate.pass();
        }
    }
}

impl IoFile for StallFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        if !self
            .gate
            .as_ref()
            .is_some_and(|g| g.reads_free.load(std::sync::atomic::Ordering::SeqCst))
        {
            self.pass();
        }
        self.inner.read_exact_at(buf, position)
    }

    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.inner.write_all_at(buf, position)
    }

    fn sync_data(&self) -> IoResult<()> {
        self.pass();
        self.inner.sync_data()
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

impl Io for StallIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let inner = self.real.open(path, mode)?;
        let gate = self.stalls(path).then(|| self.gate.clone());
        Ok(Arc::new(StallFile { inner, gate }))
    }

    fn create_dir_all(&self, path: &Path) -> IoResult<()> {
        self.real.create_dir_all(path)
    }

    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>> {
        self.real.read_dir(path)
    }

    fn remove_file(&self, path: &Path) -> IoResult<()> {
        self.real.remove_file(path)
    }

    fn remove_dir(&self, path: &Path) -> IoResult<()> {
        self.real.remove_dir(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> IoResult<()> {
        self.real.rename(from, to)
    }

    fn sync_dir(&self, path: &Path) -> IoResult<()> {
        if self.stalls(path) {
            self.gate.pass();
        }
        self.real.sync_dir(path)
    }

    fn device_id(&self, path: &Path) -> IoResult<u64> {
        self.real.device_id(path)
    }

    fn exists(&self, path: &Path) -> IoResult<bool> {
        self.real.exists(path)
    }

    fn fs_stats(&self, path: &Path) -> IoResult<FsStats> {
        let mut stats = self.real.fs_stats(path)?;
        if self.stalls(path) {
            stats.free_bytes = if self.favour.load(std::sync::atomic::Ordering::Relaxed) {
                stats.free_bytes + (1 << 30)
            } else {
                stats.free_bytes.saturating_sub(1 << 30)
            };
        }
        Ok(stats)
    }
}
