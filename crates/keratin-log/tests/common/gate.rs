//! `GatedIo`: an `Io` that passes every call to another one, except that while its gate is
//! closed every sync (`sync_data`, `sync_dir`) waits for it to open. A test closes the gate,
//! submits a request, waits until the commit path is held in its first sync, queues more
//! requests, and opens the gate: the later requests then reach the commit path together, in one
//! round, whatever the thread timing (the crash sweeps need the same `Io` calls in every run).

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use keratin_log::io::IoResult;
use keratin_log::{FsStats, Io, IoFile, OpenMode};

#[derive(Debug, Default)]
struct GateState {
    closed: bool,
    waiting: usize,
}

/// The gate shared by a `GatedIo` and its files.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    pub fn close(&self) {
        self.state.lock().expect("gate lock").closed = true;
    }

    pub fn open(&self) {
        self.state.lock().expect("gate lock").closed = false;
        self.changed.notify_all();
    }

    /// Wait until a sync is held at the closed gate, or `give_up()` holds (checked every
    /// millisecond), for at most `limit`. True if a sync is held.
    pub fn wait_for_held_sync(&self, limit: Duration, give_up: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        let mut state = self.state.lock().expect("gate lock");
        loop {
            if state.waiting > 0 {
                return true;
            }
            if give_up() || Instant::now() >= deadline {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(1))
                .expect("gate lock")
                .0;
        }
    }

    fn pass(&self) {
        let mut state = self.state.lock().expect("gate lock");
        if !state.closed {
            return;
        }
        state.waiting += 1;
        self.changed.notify_all();
        while state.closed {
            state = self.changed.wait(state).expect("gate lock");
        }
        state.waiting -= 1;
    }
}

#[derive(Debug)]
pub struct GatedIo<I> {
    pub inner: I,
    pub gate: Arc<Gate>,
}

#[derive(Debug)]
struct GatedFile {
    inner: Arc<dyn IoFile>,
    gate: Arc<Gate>,
}

impl IoFile for GatedFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.inner.read_exact_at(buf, position)
    }
    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.inner.write_all_at(buf, position)
    }
    fn sync_data(&self) -> IoResult<()> {
        self.gate.pass();
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

impl<I: Io> Io for GatedIo<I> {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let inner = self.inner.open(path, mode)?;
        Ok(Arc::new(GatedFile {
            inner,
            gate: self.gate.clone(),
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
        self.gate.pass();
        self.inner.sync_dir(path)
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
