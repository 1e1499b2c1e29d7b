//! `SegmentPool`: spare segment files shared by the logs of one node.
//!
//! Format and ordering rules in `docs/storage-format.md`, "Spares". In short:
//! - one pool per node, passed to every log it opens (no process-wide state: two nodes in one
//!   process never exchange files); a log opened without one gets a private pool that keeps up to
//!   [`PRIVATE_POOL_SPARES`] spares in `<log dir>/spares`;
//! - spares are grouped by file system (a rename works only within one) and by size class, in a
//!   `spares/` directory on that file system;
//! - **enter**: a segment a log no longer needs is renamed into `spares/` as `*.incoming`; a
//!   worker then rewrites its header as a spare header with the next generation and no base,
//!   syncs it and renames it to `*.spare`. A file whose generation would wrap is deleted instead;
//! - **take**: a log that rolls takes a `*.spare` of its class on its file system, renames it into
//!   its directory and writes the real header (same generation, its base), synced with its batch;
//! - a spare keeps the length it had in its log (segment files grow by preallocation steps), and
//!   the pool counts real file lengths; a log that takes one grows it from there;
//! - a spare is adopted (at start, from `*.spare` or `*.incoming`) only if its length is at most
//!   its class's size (and holds a header) and its header is valid, and always with the next generation (a take interrupted by
//!   a power loss can leave records of the spare's own generation in it); anything else in
//!   `spares/` is deleted;
//! - a per-file-system byte budget; `release` deletes spares down to a target (the limits call
//!   it under disk pressure), and the pool reports its spare bytes, which count as free space.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use crate::error::{LogError, LogResult};
use crate::format::{HeaderKind, SegmentHeader, SizeClass, SEGMENT_HEADER_SIZE, SPARE_BASE};
use crate::io::{Io, IoError, OpenMode};
use crate::log::DEFAULT_SEGMENT_SIZE_BYTES;
use crate::sync_stats::{SyncHistogram, SyncHistogramSnapshot};
use crate::workers::{CommitWorkers, WorkerSet};

/// Spares kept by the private pool of a log opened without a node pool.
pub const PRIVATE_POOL_SPARES: u64 = 4;

/// The default budget is the smaller of this fraction of the file system...
pub const DEFAULT_BUDGET_FRACTION: f64 = 0.02;
/// ...and this many bytes.
pub const DEFAULT_BUDGET_MAX_BYTES: u64 = 1 << 30;

/// The name of the directory that holds a file system's spares.
pub const SPARES_DIR_NAME: &str = "spares";

/// How a pool is set up.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// The full segment size of the node's logs (the small class is one eighth).
    pub full_segment_size_bytes: u64,
    /// Spare bytes kept per file system; `None`: the smaller of 2% of the file system and 1 GiB.
    pub budget_bytes: Option<u64>,
    /// Rewrite the headers of entering files on a background thread (the default), or inline
    /// in the caller (deterministic, for tests).
    pub background: bool,
    /// Commit workers per file system: the threads that write and sync the logs of the pool
    /// (see `docs/ARCHITECTURE.md`, "Threads"). Syncs of different logs on one file system
    /// overlap up to this many; each log still commits in groups. At least 1; a private pool
    /// always has 1.
    pub commit_workers_per_filesystem: usize,
}

/// The default of [`PoolOptions::commit_workers_per_filesystem`].
/// Measured on a 2-core VM's virtio disk with 1,000 busy queues (4 producers, 1,000 confirmed
/// publishes in flight each; docs/benchmarks.md, issue 13): 4 workers 20-23 k msg/s, 8 about
/// 29 k, 16 about 31-39 k, 32 about 21-26 k, 64 about 19 k; 4 busy queues alike with all of them.
pub const DEFAULT_COMMIT_WORKERS_PER_FILESYSTEM: usize = 16;

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            full_segment_size_bytes: DEFAULT_SEGMENT_SIZE_BYTES,
            budget_bytes: None,
            background: true,
            commit_workers_per_filesystem: DEFAULT_COMMIT_WORKERS_PER_FILESYSTEM,
        }
    }
}

/// A spare taken from the pool: the file to rename into the log and its generation.
#[derive(Debug, Clone)]
pub(crate) struct Spare {
    pub(crate) path: PathBuf,
    pub(crate) generation: u16,
    /// The file's length.
    pub(crate) size_bytes: u64,
}

/// Figures of one file system's spares, for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilesystemSpares {
    /// The file system's device id.
    pub device: u64,
    /// Where its spares live.
    pub spares_dir: PathBuf,
    /// Spare files of the full class.
    pub full_count: u64,
    /// Spare files of the small class.
    pub small_count: u64,
    /// Bytes in spare files (ready and being prepared; real file lengths).
    pub spare_bytes: u64,
    /// The budget in force.
    pub budget_bytes: u64,
}

/// Counters of a pool since it was created, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCounters {
    /// Segments served from a spare.
    pub takes_from_pool: u64,
    /// Segments created fresh because no spare was there.
    pub takes_fresh: u64,
    /// Files that entered the pool as spares.
    pub entered: u64,
    /// Files deleted on entry because the budget was full.
    pub deleted_over_budget: u64,
    /// Files retired because their generation would wrap.
    pub retired_generation: u64,
    /// Spares deleted by [`SegmentPool::release`].
    pub released: u64,
    /// Bytes deleted by [`SegmentPool::release`].
    pub released_bytes: u64,
    /// Logs of this pool that stopped after a failed write or sync.
    pub log_stops: u64,
    /// Stopped logs of this pool that [`crate::Log::heal`] reopened.
    pub log_heals: u64,
}

#[derive(Debug, Default)]
struct Counters {
    takes_from_pool: AtomicU64,
    takes_fresh: AtomicU64,
    entered: AtomicU64,
    deleted_over_budget: AtomicU64,
    retired_generation: AtomicU64,
    released: AtomicU64,
    released_bytes: AtomicU64,
    log_stops: AtomicU64,
    log_heals: AtomicU64,
}

#[derive(Debug, Clone)]
struct ReadySpare {
    path: PathBuf,
    generation: u16,
    /// The file's length (a spare keeps the length it had in its log).
    size_bytes: u64,
}

/// The spares of one file system.
#[derive(Debug)]
struct Group {
    device: u64,
    dir: PathBuf,
    budget_bytes: u64,
    full: Vec<ReadySpare>,
    small: Vec<ReadySpare>,
    /// Bytes of files renamed in but not yet ready.
    incoming_bytes: u64,
    next_name: u64,
}

impl Group {
    fn ready(&mut self, class: SizeClass) -> &mut Vec<ReadySpare> {
        match class {
            SizeClass::Full => &mut self.full,
            SizeClass::Small => &mut self.small,
        }
    }

    fn spare_bytes(&self) -> u64 {
        self.full
            .iter()
            .chain(&self.small)
            .map(|spare| spare.size_bytes)
            .sum::<u64>()
            + self.incoming_bytes
    }

    fn fresh_name(&mut self, class: SizeClass, suffix: &str) -> PathBuf {
        self.next_name += 1;
        self.dir.join(format!(
            "{}-{:016}.{suffix}",
            class.as_str(),
            self.next_name
        ))
    }
}

#[derive(Debug)]
struct Job {
    device: u64,
    path: PathBuf,
    class: SizeClass,
    generation: u16,
    /// The length counted in `incoming_bytes` for it.
    size_bytes: u64,
}

#[derive(Debug)]
struct Inner {
    io: Arc<dyn Io>,
    options: PoolOptions,
    /// Private pools keep spares beside the log and at most [`PRIVATE_POOL_SPARES`] of them.
    private: bool,
    groups: Mutex<HashMap<u64, Group>>,
    jobs: Mutex<Vec<Job>>,
    jobs_ready: Condvar,
    jobs_done: Condvar,
    worker_started: Mutex<bool>,
    counters: Counters,
    syncs: SyncHistogram,
    /// Last field: dropped after everything else of the pool, it stops the commit workers.
    commit: CommitWorkers,
}

/// Spare segment files of one node. Cheap to clone: clones share the pool.
#[derive(Debug, Clone)]
pub struct SegmentPool {
    inner: Arc<Inner>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl SegmentPool {
    /// A node's pool. Call [`SegmentPool::add_storage_dir`] for each storage directory so that
    /// spares left by an earlier run are adopted at start.
    pub fn new(io: Arc<dyn Io>, options: PoolOptions) -> SegmentPool {
        SegmentPool::build(io, options, false)
    }

    /// A pool private to one log: spares in `<log dir>/spares`, at most four.
    pub fn private(io: Arc<dyn Io>) -> SegmentPool {
        SegmentPool::private_with(io, PoolOptions::default())
    }

    pub(crate) fn private_with(io: Arc<dyn Io>, options: PoolOptions) -> SegmentPool {
        SegmentPool::build(io, options, true)
    }

    fn build(io: Arc<dyn Io>, options: PoolOptions, private: bool) -> SegmentPool {
        let workers = if private {
            1
        } else {
            options.commit_workers_per_filesystem
        };
        SegmentPool {
            inner: Arc::new(Inner {
                io,
                options,
                private,
                groups: Mutex::new(HashMap::new()),
                jobs: Mutex::new(Vec::new()),
                jobs_ready: Condvar::new(),
                jobs_done: Condvar::new(),
                worker_started: Mutex::new(false),
                counters: Counters::default(),
                syncs: SyncHistogram::default(),
                commit: CommitWorkers::new(workers),
            }),
        }
    }

    /// Keep this file system's spares in `<dir>/spares` and adopt the valid spares found there.
    /// The first directory registered on a file system wins.
    pub fn add_storage_dir(&self, dir: &Path) -> LogResult<()> {
        let io = self.inner.io.as_ref();
        let device = io
            .device_id(dir)
            .map_err(|e| LogError::io("stat storage directory", dir, e))?;
        if lock(&self.inner.groups).contains_key(&device) {
            return Ok(());
        }
        self.open_group(device, &dir.join(SPARES_DIR_NAME))
    }

    /// True for a pool private to one log (spares beside the log).
    pub(crate) fn is_private(&self) -> bool {
        self.inner.private
    }

    /// The options the pool was made with.
    pub fn options(&self) -> &PoolOptions {
        &self.inner.options
    }

    /// The group of the file system holding `log_dir`, opened on first use.
    fn device_of(&self, log_dir: &Path) -> LogResult<u64> {
        let io = self.inner.io.as_ref();
        let device = io
            .device_id(log_dir)
            .map_err(|e| LogError::io("stat log directory", log_dir, e))?;
        if !lock(&self.inner.groups).contains_key(&device) {
            self.open_group(device, &log_dir.join(SPARES_DIR_NAME))?;
        }
        Ok(device)
    }

    fn open_group(&self, device: u64, dir: &Path) -> LogResult<()> {
        let io = self.inner.io.as_ref();
        if !io.exists(dir).map_err(|e| LogError::io("stat", dir, e))? {
            io.create_dir_all(dir)
                .map_err(|e| LogError::io("create spares directory", dir, e))?;
            if let Some(parent) = dir.parent() {
                io.sync_dir(parent)
                    .map_err(|e| LogError::io("sync directory", parent, e))?;
            }
        }
        let budget_bytes = self.budget_for(dir)?;
        let mut group = Group {
            device,
            dir: dir.to_path_buf(),
            budget_bytes,
            full: Vec::new(),
            small: Vec::new(),
            incoming_bytes: 0,
            next_name: 0,
        };
        let incoming = self.adopt(&mut group)?;
        let mut groups = lock(&self.inner.groups);
        if groups.contains_key(&device) {
            return Ok(());
        }
        groups.insert(device, group);
        drop(groups);
        for (path, class, generation, size) in incoming {
            if let Some(group) = lock(&self.inner.groups).get_mut(&device) {
                group.incoming_bytes += size;
            }
            self.prepare_spare(device, &path, class, generation, size)?;
        }
        Ok(())
    }

    fn budget_for(&self, dir: &Path) -> LogResult<u64> {
        let full = self.inner.options.full_segment_size_bytes;
        if self.inner.private {
            return Ok(PRIVATE_POOL_SPARES * full);
        }
        if let Some(budget) = self.inner.options.budget_bytes {
            return Ok(budget);
        }
        let stats = self
            .inner
            .io
            .fs_stats(dir)
            .map_err(|e| LogError::io("statvfs", dir, e))?;
        let fraction = (stats.total_bytes as f64 * DEFAULT_BUDGET_FRACTION) as u64;
        Ok(fraction.min(DEFAULT_BUDGET_MAX_BYTES))
    }

    /// Scan a spares directory: queue valid `*.spare` and `*.incoming` files for their header
    /// rewrite with the next generation, delete everything else (a half-made file is never
    /// adopted).
    fn adopt(&self, group: &mut Group) -> LogResult<Vec<(PathBuf, SizeClass, u16, u64)>> {
        let io = self.inner.io.as_ref();
        let names = io
            .read_dir(&group.dir)
            .map_err(|e| LogError::io("list spares directory", &group.dir, e))?;
        let mut incoming = Vec::new();
        let mut deleted = false;
        for name in names {
            let path = group.dir.join(&name);
            let header = if name.ends_with(".spare") || name.ends_with(".incoming") {
                self.read_header(&path)?
            } else {
                None
            };
            let counter = name
                .split(['-', '.'])
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            group.next_name = group.next_name.max(counter);
            match header {
                // A ready spare is adopted with the next generation, like an incoming file: a
                // log may have taken it (rename, header, records) and lost the rename at a power
                // loss while some of the records' sectors reached the disk and the header's did
                // not. Those records carry the spare's generation; the next log to take it would
                // write the same one and could adopt them, or see their claims as damage
                // (issue 12, item 6; found by tests/power_loss.rs, taking spares).
                Some((h, len)) if name.ends_with(".spare") && h.kind == HeaderKind::Spare => {
                    incoming.push((path, h.size_class, h.generation, len));
                }
                Some((h, len)) if name.ends_with(".incoming") => {
                    // Bump past every generation the file may hold records of: a segment
                    // header's own generation, or a spare header that may have been taken and
                    // written to before the crash.
                    incoming.push((path, h.size_class, h.generation, len));
                }
                _ => {
                    tracing::warn!(path = %path.display(), "deleting an unusable file in the spares directory");
                    io.remove_file(&path)
                        .map_err(|e| LogError::io("remove bad spare", &path, e))?;
                    deleted = true;
                }
            }
        }
        if deleted {
            io.sync_dir(&group.dir)
                .map_err(|e| LogError::io("sync spares directory", &group.dir, e))?;
        }
        Ok(incoming)
    }

    /// The header and length of a would-be spare, if the file has a valid header, the header
    /// states its class's size and the file is no longer than that (files grow by preallocation
    /// steps, so a shorter one is a segment that was handed back early in its life).
    fn read_header(&self, path: &Path) -> LogResult<Option<(SegmentHeader, u64)>> {
        let io = self.inner.io.as_ref();
        let file = match io.open(path, OpenMode::Existing) {
            Ok(file) => file,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(LogError::io("open spare", path, e)),
        };
        let mut bytes = [0u8; SEGMENT_HEADER_SIZE];
        match file.read_exact_at(&mut bytes, 0) {
            Ok(()) => {}
            Err(IoError::ShortRead { .. }) => return Ok(None),
            Err(e) => return Err(LogError::io("read spare header", path, e)),
        }
        let Ok(header) = SegmentHeader::decode(&bytes) else {
            return Ok(None);
        };
        let class_size = header
            .size_class
            .segment_size_bytes(self.inner.options.full_segment_size_bytes);
        let len = file
            .len()
            .map_err(|e| LogError::io("stat spare", path, e))?;
        if header.segment_size_bytes != class_size || len > class_size {
            return Ok(None);
        }
        Ok(Some((header, len)))
    }

    /// A spare of `class` on the file system of `log_dir`, if the pool has one. The caller renames
    /// it into the log and writes the real header with the same generation.
    pub(crate) fn take(&self, log_dir: &Path, class: SizeClass) -> LogResult<Option<Spare>> {
        let device = self.device_of(log_dir)?;
        let mut groups = lock(&self.inner.groups);
        // The longest spare first: a log that takes a spare is about to write, and a longer file
        // spares it preallocation steps (and keeps busy logs on whole-size files).
        let spare = groups.get_mut(&device).and_then(|group| {
            let ready = group.ready(class);
            let longest = (0..ready.len()).max_by_key(|&i| ready[i].size_bytes)?;
            Some(ready.swap_remove(longest))
        });
        drop(groups);
        let counter = match spare {
            Some(_) => &self.inner.counters.takes_from_pool,
            None => &self.inner.counters.takes_fresh,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(spare.map(|s| Spare {
            path: s.path,
            generation: s.generation,
            size_bytes: s.size_bytes,
        }))
    }

    /// A segment file at `path` that its log no longer needs, whose records carry `generation`
    /// and whose length is `size` as far as the log knows (the spare is counted with its real
    /// length once prepared). It leaves the log's directory now (the caller syncs that directory
    /// afterwards); its header is rewritten later, off the write path.
    pub(crate) fn enter(
        &self,
        path: &Path,
        class: SizeClass,
        generation: u16,
        size: u64,
    ) -> LogResult<()> {
        let log_dir = path.parent().unwrap_or(Path::new("."));
        let device = self.device_of(log_dir)?;
        let io = self.inner.io.as_ref();
        let destination = {
            let mut groups = lock(&self.inner.groups);
            let group = groups
                .get_mut(&device)
                .ok_or_else(|| LogError::Invalid("pool group vanished".into()))?;
            if generation == u16::MAX {
                self.inner
                    .counters
                    .retired_generation
                    .fetch_add(1, Ordering::Relaxed);
                None
            } else if group.spare_bytes() + size > group.budget_bytes {
                self.inner
                    .counters
                    .deleted_over_budget
                    .fetch_add(1, Ordering::Relaxed);
                None
            } else {
                group.incoming_bytes += size;
                Some(group.fresh_name(class, "incoming"))
            }
        };
        let Some(destination) = destination else {
            return io
                .remove_file(path)
                .map_err(|e| LogError::io("remove segment", path, e));
        };
        if let Err(e) = io.rename(path, &destination) {
            self.forget_incoming(device, size);
            return Err(LogError::io("move segment to spares", path, e));
        }
        self.submit(Job {
            device,
            path: destination,
            class,
            generation,
            size_bytes: size,
        })
    }

    /// A trailing segment recovery found with a header that is not the log's own (a spare being
    /// taken when the node stopped). Its records may carry the header's generation, so it enters
    /// like any retired segment: with the next generation.
    pub(crate) fn enter_foreign(&self, path: &Path, class: SizeClass) -> LogResult<()> {
        let header = self.read_header(path)?;
        let log_dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        match header {
            Some((h, len)) if h.size_class == class => {
                self.enter(path, class, h.generation, len)?
            }
            _ => self
                .inner
                .io
                .remove_file(path)
                .map_err(|e| LogError::io("remove foreign segment", path, e))?,
        }
        self.inner
            .io
            .sync_dir(&log_dir)
            .map_err(|e| LogError::io("sync log directory", &log_dir, e))
    }

    fn forget_incoming(&self, device: u64, size: u64) {
        if let Some(group) = lock(&self.inner.groups).get_mut(&device) {
            group.incoming_bytes = group.incoming_bytes.saturating_sub(size);
        }
    }

    fn submit(&self, job: Job) -> LogResult<()> {
        if !self.inner.options.background {
            return self.prepare_spare(
                job.device,
                &job.path,
                job.class,
                job.generation,
                job.size_bytes,
            );
        }
        lock(&self.inner.jobs).push(job);
        self.inner.jobs_ready.notify_one();
        self.ensure_worker()
    }

    fn ensure_worker(&self) -> LogResult<()> {
        let mut started = lock(&self.inner.worker_started);
        if *started {
            return Ok(());
        }
        let weak = Arc::downgrade(&self.inner);
        std::thread::Builder::new()
            .name("keratin-pool".into())
            .spawn(move || worker(weak))
            .map_err(|e| LogError::io("spawn pool worker", ".", e.into()))?;
        *started = true;
        Ok(())
    }

    /// Rewrite an incoming file's header as a spare with the next generation, sync it, and make
    /// it ready. Any failure deletes the file: a spare is never adopted half-made.
    fn prepare_spare(
        &self,
        device: u64,
        path: &Path,
        class: SizeClass,
        generation: u16,
        incoming_size: u64,
    ) -> LogResult<()> {
        let size = class.segment_size_bytes(self.inner.options.full_segment_size_bytes);
        let result = self.rewrite_header(device, path, class, generation, size);
        self.forget_incoming(device, incoming_size);
        match result {
            Ok(ready) => {
                let mut groups = lock(&self.inner.groups);
                if let Some(group) = groups.get_mut(&device) {
                    group.ready(class).push(ready);
                }
                self.inner.counters.entered.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "dropping a spare that could not be prepared");
                let _ = self.inner.io.remove_file(path);
                if generation == u16::MAX {
                    return Ok(());
                }
                Err(e)
            }
        }
    }

    fn rewrite_header(
        &self,
        device: u64,
        path: &Path,
        class: SizeClass,
        generation: u16,
        size: u64,
    ) -> LogResult<ReadySpare> {
        let io = self.inner.io.as_ref();
        let next_generation = generation
            .checked_add(1)
            .ok_or_else(|| LogError::Invalid("generation would wrap".into()))?;
        // The rename out of the log must be durable before the header changes: a spare header
        // on a file the log still names after a crash would be a hole in the log.
        let dir = path.parent().unwrap_or(Path::new("."));
        io.sync_dir(dir)
            .map_err(|e| LogError::io("sync spares directory", dir, e))?;
        let file = io
            .open(path, OpenMode::Existing)
            .map_err(|e| LogError::io("open spare", path, e))?;
        let header = SegmentHeader {
            size_class: class,
            kind: HeaderKind::Spare,
            generation: next_generation,
            base_offset: SPARE_BASE,
            segment_size_bytes: size,
        };
        file.write_all_at(&header.encode(), 0)
            .map_err(|e| LogError::io("write spare header", path, e))?;
        file.sync_data()
            .map_err(|e| LogError::io("sync spare", path, e))?;
        // The real length, whatever the log thought: budgets and `release` count it.
        let size_bytes = file
            .len()
            .map_err(|e| LogError::io("stat spare", path, e))?;
        let ready_path = {
            let mut groups = lock(&self.inner.groups);
            let group = groups
                .get_mut(&device)
                .ok_or_else(|| LogError::Invalid("pool group vanished".into()))?;
            group.fresh_name(class, "spare")
        };
        io.rename(path, &ready_path)
            .map_err(|e| LogError::io("rename spare", path, e))?;
        let dir = ready_path.parent().unwrap_or(Path::new("."));
        io.sync_dir(dir)
            .map_err(|e| LogError::io("sync spares directory", dir, e))?;
        Ok(ReadySpare {
            path: ready_path,
            generation: next_generation,
            size_bytes,
        })
    }

    /// Wait until every file that entered has been prepared (tests and orderly shutdown).
    pub fn flush(&self) {
        let mut jobs = lock(&self.inner.jobs);
        while !jobs.is_empty() || self.busy() {
            jobs = self
                .inner
                .jobs_done
                .wait(jobs)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn busy(&self) -> bool {
        lock(&self.inner.groups)
            .values()
            .any(|group| group.incoming_bytes > 0)
    }

    /// Delete spares on the file system `device` until at most `target_bytes` remain; returns the
    /// bytes deleted. Spares being prepared are not counted and not touched.
    pub fn release(&self, device: u64, target_bytes: u64) -> LogResult<u64> {
        let mut victims = Vec::new();
        let dir = {
            let mut groups = lock(&self.inner.groups);
            let Some(group) = groups.get_mut(&device) else {
                return Ok(0);
            };
            while group.spare_bytes() > target_bytes {
                // Full spares first: they free the most per file.
                if let Some(spare) = group.full.pop() {
                    victims.push((spare.path, spare.size_bytes));
                } else if let Some(spare) = group.small.pop() {
                    victims.push((spare.path, spare.size_bytes));
                } else {
                    break;
                }
            }
            group.dir.clone()
        };
        let io = self.inner.io.as_ref();
        let mut released = 0;
        for (path, size) in &victims {
            io.remove_file(path)
                .map_err(|e| LogError::io("release spare", path, e))?;
            released += size;
        }
        if !victims.is_empty() {
            io.sync_dir(&dir)
                .map_err(|e| LogError::io("sync spares directory", &dir, e))?;
        }
        let counters = &self.inner.counters;
        counters
            .released
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
        counters
            .released_bytes
            .fetch_add(released, Ordering::Relaxed);
        Ok(released)
    }

    /// Spare bytes on the file system `device` (they count as free space: they can be deleted at
    /// once).
    pub fn spare_bytes(&self, device: u64) -> u64 {
        lock(&self.inner.groups)
            .get(&device)
            .map_or(0, Group::spare_bytes)
    }

    /// Change the budget of every file system (`None`: the default rule). Spares above a lowered
    /// budget are released.
    pub fn set_budget(&self, budget_bytes: Option<u64>) -> LogResult<()> {
        let devices: Vec<(u64, PathBuf)> = lock(&self.inner.groups)
            .values()
            .map(|g| (g.device, g.dir.clone()))
            .collect();
        for (device, dir) in devices {
            let budget = match budget_bytes {
                Some(b) if !self.inner.private => b,
                _ => self.budget_for(&dir)?,
            };
            if let Some(group) = lock(&self.inner.groups).get_mut(&device) {
                group.budget_bytes = budget;
            }
            self.release(device, budget)?;
        }
        Ok(())
    }

    /// Per-file-system figures.
    pub fn filesystems(&self) -> Vec<FilesystemSpares> {
        let mut out: Vec<FilesystemSpares> = lock(&self.inner.groups)
            .values()
            .map(|group| FilesystemSpares {
                device: group.device,
                spares_dir: group.dir.clone(),
                full_count: group.full.len() as u64,
                small_count: group.small.len() as u64,
                spare_bytes: group.spare_bytes(),
                budget_bytes: group.budget_bytes,
            })
            .collect();
        out.sort_by_key(|fs| fs.device);
        out
    }

    /// Counters since the pool was created.
    pub fn counters(&self) -> PoolCounters {
        let c = &self.inner.counters;
        PoolCounters {
            takes_from_pool: c.takes_from_pool.load(Ordering::Relaxed),
            takes_fresh: c.takes_fresh.load(Ordering::Relaxed),
            entered: c.entered.load(Ordering::Relaxed),
            deleted_over_budget: c.deleted_over_budget.load(Ordering::Relaxed),
            retired_generation: c.retired_generation.load(Ordering::Relaxed),
            released: c.released.load(Ordering::Relaxed),
            released_bytes: c.released_bytes.load(Ordering::Relaxed),
            log_stops: c.log_stops.load(Ordering::Relaxed),
            log_heals: c.log_heals.load(Ordering::Relaxed),
        }
    }

    /// Commit worker threads running for this pool's logs: at most
    /// `commit_workers_per_filesystem` per file system the logs are on, however many logs there
    /// are (started when needed, kept until the pool's last handle goes).
    pub fn commit_threads(&self) -> usize {
        self.inner.commit.threads()
    }

    /// Buffer capacity this pool's idle logs keep between their rounds: at most 64 MiB per file
    /// system whatever the number of logs (a log past that frees its buffers when it goes
    /// idle).
    pub fn retained_buffer_bytes(&self) -> usize {
        self.inner.commit.retained_bytes()
    }

    /// The commit workers of the file system holding `log_dir` (or, while it does not exist
    /// yet, its nearest existing ancestor), with one worker started at least.
    pub(crate) fn commit_set(&self, log_dir: &Path) -> LogResult<Arc<WorkerSet>> {
        let io = self.inner.io.as_ref();
        let mut dir = log_dir;
        let device = loop {
            match io.device_id(dir) {
                Ok(device) => break device,
                Err(e) if e.is_not_found() => match dir.parent() {
                    Some(parent) if !parent.as_os_str().is_empty() => dir = parent,
                    _ => return Err(LogError::io("stat log directory", log_dir, e)),
                },
                Err(e) => return Err(LogError::io("stat log directory", log_dir, e)),
            }
        };
        self.inner.commit.set_for(device)
    }

    /// How long the commit workers of this pool's logs took for each sync since the pool was
    /// created.
    pub fn sync_histogram(&self) -> SyncHistogramSnapshot {
        self.inner.syncs.snapshot()
    }

    /// Count one sync of a commit worker.
    pub(crate) fn record_sync(&self, elapsed: std::time::Duration) {
        self.inner.syncs.record(elapsed);
    }

    /// Count a log that stopped.
    pub(crate) fn note_log_stopped(&self) {
        self.inner
            .counters
            .log_stops
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Count a stopped log that healed.
    pub(crate) fn note_log_healed(&self) {
        self.inner
            .counters
            .log_heals
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// The background worker: prepares entered files until the pool is dropped.
fn worker(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let job = {
            let mut jobs = lock(&strong.jobs);
            loop {
                if let Some(job) = jobs.pop() {
                    break Some(job);
                }
                let (guard, timeout) = strong
                    .jobs_ready
                    .wait_timeout(jobs, std::time::Duration::from_millis(200))
                    .unwrap_or_else(|e| e.into_inner());
                jobs = guard;
                if timeout.timed_out() && jobs.is_empty() {
                    break None;
                }
            }
        };
        if let Some(job) = job {
            let pool = SegmentPool {
                inner: strong.clone(),
            };
            let _ = pool.prepare_spare(
                job.device,
                &job.path,
                job.class,
                job.generation,
                job.size_bytes,
            );
            // Through the jobs lock: `flush` checks under it and then waits, so a notice sent
            // between its check and its wait would be lost and it would wait for ever.
            drop(lock(&strong.jobs));
            strong.jobs_done.notify_all();
        } else if Arc::strong_count(&strong) == 1 {
            // Only this worker holds the pool: every node and log has let go of it.
            return;
        }
    }
}
