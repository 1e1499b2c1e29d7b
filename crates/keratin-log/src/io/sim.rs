//! [`SimIo`]: an in-memory disk, deterministic from a seed, that keeps written and durable state
//! apart so that tests can fail any call and crash after any call.
//!
//! This file owns the simulated disk and its durability model. What the log does with it (and
//! which crash outcomes it must survive) belongs to the log's tests.
//!
//! # Durability model
//!
//! - **Inodes and names.** A file is an inode; the namespace maps paths to inodes and directories.
//!   An open handle refers to the inode, so a removed or renamed file stays readable and writable
//!   through it (unix semantics). `rename` moves an entry and replaces an existing target.
//! - **File data.** Each inode has a live image (what reads see), a durable image (what survives a
//!   crash for sure) and the list of writes made since its last [`IoFile::sync_data`]. `sync_data`
//!   makes those writes and the current length durable. Reading past the live length fails with
//!   [`IoError::ShortRead`]; writing past it zero-fills the gap; new space reads as zeros.
//! - **Torn writes.** At a crash, every 512-byte sector (aligned to file positions) touched by
//!   unsynced writes independently ends up at one of its versions: the durable one, or the content
//!   right after one of the unsynced writes to it. A sector is atomic, sectors are written back in
//!   any order. An unsynced length change (growth or truncation) is kept or lost as a whole; when
//!   lost, the durable length stays and sector contents beyond it are gone.
//! - **Directory entries.** Create, remove, rename, mkdir and rmdir go into one global ordered
//!   metadata journal (like ext4 or xfs). [`Io::sync_dir`] of any directory commits the whole
//!   journal. A crash keeps a prefix of the uncommitted operations (possibly none, possibly all),
//!   in order. A file whose creation was lost is gone with its data; a file whose removal was lost
//!   is back with its durable data.
//! - **Failed sync ("fsyncgate").** A failed `sync_data` drops the file's unsynced writes from the
//!   durable path forever: reads still see them (page cache), a later `sync_data` succeeds without
//!   making them durable, and a crash loses them. Writes made after the failed sync behave normally.
//! - **Failed write.** A failed `write_all_at` may have applied a prefix of the buffer, in whole
//!   sectors, as an unsynced write. A write refused by the space limit applies nothing.
//! - **Determinism.** Every random choice comes from one PRNG seeded by [`SimIo::new`], drawn in
//!   a fixed order: the same seed and the same calls give the same state, byte for byte.
//!
//! What survives a process crash on a real machine (everything written) is not modelled: a
//! [`SimIo`] crash is always a power loss.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::io::Errno;

use super::{Io, IoError, IoFile, IoResult, OpenMode};

/// The unit of atomic write-back: a disk never tears a 512-byte sector (a smaller unit would invent
/// failures no disk has; a larger one would hide torn pages of 4 KiB writes).
const SECTOR_SIZE_BYTES: u64 = 512;

/// The largest simulated file. The disk lives in memory, twice (live and durable image): a file
/// past 1 GiB is a bug in a test, and `EFBIG` reports it better than the out-of-memory killer.
const FILE_SIZE_BYTES_MAX: u64 = 1 << 30;

// Every position inside a simulated file fits in `usize`, so the `as usize` casts of positions
// that were checked against a file's length are lossless.
const _: () = assert!(FILE_SIZE_BYTES_MAX <= usize::MAX as u64);

/// The device id of every path not under a prefix given to [`SimIo::set_device`].
const DEVICE_DEFAULT: u64 = 1;

/// A failure that [`SimIo::fail_at`] injects into one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimFault {
    /// The call fails with `EIO` (a media or transport error).
    Eio,
    /// The call fails with `ENOSPC` (the device is full).
    NoSpace,
}

impl SimFault {
    fn errno(self) -> Errno {
        match self {
            SimFault::Eio => Errno::IO,
            SimFault::NoSpace => Errno::NOSPC,
        }
    }
}

/// splitmix64 (Steele, Lea, Flood 2014): tiny, full-period, and good enough to pick crash outcomes.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..count` (0 when `count` is 0). The modulo bias is irrelevant at these sizes.
    fn below(&mut self, count: u64) -> u64 {
        if count == 0 {
            0
        } else {
            self.next_u64() % count
        }
    }

    fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
}

type Ino = u64;

/// One entry of the namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    File(Ino),
    Dir,
}

/// Paths to entries; the root (a path without parent) exists implicitly and is not stored.
type Namespace = BTreeMap<PathBuf, Entry>;

/// One operation of the metadata journal, replayable on any namespace where it was valid.
#[derive(Debug, Clone)]
enum DirOp {
    Create { path: PathBuf, ino: Ino },
    Mkdir { path: PathBuf },
    Remove { path: PathBuf },
    Rename { from: PathBuf, to: PathBuf },
}

impl DirOp {
    fn apply(&self, namespace: &mut Namespace) {
        match self {
            DirOp::Create { path, ino } => {
                namespace.insert(path.clone(), Entry::File(*ino));
            }
            DirOp::Mkdir { path } => {
                namespace.insert(path.clone(), Entry::Dir);
            }
            DirOp::Remove { path } => {
                namespace.remove(path);
            }
            DirOp::Rename { from, to } => rename_in(namespace, from, to),
        }
    }
}

/// Move `from` (and, for a directory, everything below it) to `to`, replacing `to`.
fn rename_in(namespace: &mut Namespace, from: &Path, to: &Path) {
    namespace.remove(to);
    let moved: Vec<PathBuf> = namespace
        .keys()
        .filter(|path| path.starts_with(from))
        .cloned()
        .collect();
    for old in moved {
        if let Some(entry) = namespace.remove(&old) {
            let rest = old.strip_prefix(from).unwrap_or(Path::new(""));
            let new = if rest.as_os_str().is_empty() {
                to.to_path_buf()
            } else {
                to.join(rest)
            };
            namespace.insert(new, entry);
        }
    }
}

/// A write not yet made durable by `sync_data`.
#[derive(Debug, Clone)]
struct PendingWrite {
    position: u64,
    bytes: Vec<u8>,
}

impl PendingWrite {
    fn end(&self) -> u64 {
        self.position + self.bytes.len() as u64
    }

    /// Copy the part of this write inside `[from, to)` onto `image`, as far as `image` reaches.
    fn apply_range(&self, image: &mut [u8], from: u64, to: u64) {
        let image_len = image.len() as u64;
        let start = from.max(self.position);
        let end = to.min(self.end()).min(image_len);
        if start >= end {
            return;
        }
        let source = (start - self.position) as usize..(end - self.position) as usize;
        image[start as usize..end as usize].copy_from_slice(&self.bytes[source]);
    }
}

/// A file's contents: live, durable, and what lies between.
#[derive(Debug, Default)]
struct Inode {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Unsynced writes, oldest first, each within the live length.
    pending: Vec<PendingWrite>,
    /// The smallest length since the last sync (at most the durable length): a sync or a kept
    /// length change zeroes what a truncation freed.
    len_min: u64,
    /// The live namespace names this inode.
    linked: bool,
    /// Open handles on it.
    open_count: u32,
}

impl Inode {
    fn len(&self) -> u64 {
        self.live.len() as u64
    }

    fn read(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        let available = self.len().saturating_sub(position);
        let read = usize::try_from(available)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        if read > 0 {
            let start = position as usize;
            buf[..read].copy_from_slice(&self.live[start..start + read]);
        }
        if read < buf.len() {
            return Err(IoError::ShortRead { read });
        }
        Ok(())
    }

    fn write(&mut self, bytes: &[u8], position: u64) {
        if bytes.is_empty() {
            return;
        }
        let end = position + bytes.len() as u64;
        if end > self.len() {
            self.live.resize(end as usize, 0);
        }
        self.live[position as usize..end as usize].copy_from_slice(bytes);
        self.pending.push(PendingWrite {
            position,
            bytes: bytes.to_vec(),
        });
    }

    fn set_len(&mut self, len: u64) {
        if len < self.len() {
            // Truncated bytes are gone from the page cache: they must not come back at a crash.
            for write in &mut self.pending {
                let keep = len
                    .saturating_sub(write.position)
                    .min(write.bytes.len() as u64);
                write.bytes.truncate(keep as usize);
            }
            self.pending.retain(|write| !write.bytes.is_empty());
            self.len_min = self.len_min.min(len);
        }
        self.live.resize(len as usize, 0);
    }

    /// The durable image with the length change applied: truncated to `len_min`, then grown with
    /// zeros to the live length.
    fn durable_resized(&self) -> Vec<u8> {
        let mut image = self.durable.clone();
        image.truncate(self.len_min as usize);
        image.resize(self.live.len(), 0);
        image
    }

    fn sync(&mut self) {
        let mut image = self.durable_resized();
        for write in &self.pending {
            write.apply_range(&mut image, 0, u64::MAX);
        }
        self.durable = image;
        self.pending.clear();
        self.len_min = self.len();
    }

    /// A failed sync: the unsynced writes never reach the disk, whatever happens next.
    fn poison(&mut self) {
        self.pending.clear();
    }

    fn len_changed(&self) -> bool {
        self.len() != self.durable.len() as u64 || self.len_min < self.durable.len() as u64
    }

    /// What a power loss leaves of this file (see the module documentation).
    fn crash_image(&self, rng: &mut Rng) -> Vec<u8> {
        let mut image = if self.len_changed() && rng.coin() {
            self.durable_resized()
        } else {
            self.durable.clone()
        };
        // Sector index -> the pending writes touching it, oldest first.
        let mut sectors: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (index, write) in self.pending.iter().enumerate() {
            let first = write.position / SECTOR_SIZE_BYTES;
            let last = (write.end() - 1) / SECTOR_SIZE_BYTES;
            for sector in first..=last {
                sectors.entry(sector).or_default().push(index);
            }
        }
        for (sector, writers) in sectors {
            let version = rng.below(writers.len() as u64 + 1) as usize;
            let from = sector * SECTOR_SIZE_BYTES;
            for &index in &writers[..version] {
                self.pending[index].apply_range(&mut image, from, from + SECTOR_SIZE_BYTES);
            }
        }
        image
    }

    /// A file restored from `image` after a restart: everything durable, nothing pending.
    fn restored(image: Vec<u8>) -> Inode {
        Inode {
            live: image.clone(),
            len_min: image.len() as u64,
            durable: image,
            pending: Vec::new(),
            linked: true,
            open_count: 0,
        }
    }
}

/// Everything behind one [`SimIo`] handle and its clones.
struct State {
    rng: Rng,
    steps: u64,
    faults: BTreeMap<u64, SimFault>,
    crash_after: Option<u64>,
    crashed: bool,
    space_limit_bytes: Option<u64>,
    /// Directory prefix -> device id.
    devices: BTreeMap<PathBuf, u64>,
    inodes: BTreeMap<Ino, Inode>,
    ino_next: Ino,
    live: Namespace,
    /// The namespace as of the last journal commit.
    durable: Namespace,
    /// Directory operations since the last commit, oldest first.
    journal: Vec<DirOp>,
}

fn os(errno: Errno) -> IoError {
    IoError::Os(errno)
}

fn fail_if(fault: Option<SimFault>) -> IoResult<()> {
    match fault {
        Some(fault) => Err(os(fault.errno())),
        None => Ok(()),
    }
}

fn is_root(path: &Path) -> bool {
    path.parent().is_none()
}

/// The end of a transfer of `len` bytes at `position`, if the simulated file may reach it.
fn checked_end(position: u64, len: usize) -> IoResult<u64> {
    position
        .checked_add(len as u64)
        .filter(|end| *end <= FILE_SIZE_BYTES_MAX)
        .ok_or(os(Errno::FBIG))
}

impl State {
    fn new(seed: u64) -> State {
        State {
            rng: Rng(seed),
            steps: 0,
            faults: BTreeMap::new(),
            crash_after: None,
            crashed: false,
            space_limit_bytes: None,
            devices: BTreeMap::new(),
            inodes: BTreeMap::new(),
            ino_next: 1,
            live: Namespace::new(),
            durable: Namespace::new(),
            journal: Vec::new(),
        }
    }

    /// Crash this state for good and return what a power loss leaves of it (see the module docs).
    fn restarted(&mut self) -> State {
        self.crashed = true;
        let kept = self.rng.below(self.journal.len() as u64 + 1) as usize;
        let mut namespace = self.durable.clone();
        for op in &self.journal[..kept] {
            op.apply(&mut namespace);
        }
        let mut new = State::new(0);
        for entry in namespace.values() {
            if let Entry::File(ino) = *entry {
                let image = match self.inodes.get(&ino) {
                    Some(inode) => inode.crash_image(&mut self.rng),
                    None => Vec::new(),
                };
                new.inodes.insert(ino, Inode::restored(image));
            }
        }
        new.rng = Rng(self.rng.next_u64());
        new.ino_next = self.ino_next;
        new.space_limit_bytes = self.space_limit_bytes;
        new.devices = self.devices.clone();
        new.durable = namespace.clone();
        new.live = namespace;
        new
    }

    /// Count one call; fail it if the disk crashed; return the fault injected into it, if any.
    fn begin(&mut self) -> IoResult<Option<SimFault>> {
        let index = self.steps;
        self.steps += 1;
        if self.crashed {
            return Err(IoError::Crashed);
        }
        if let Some(crash_after) = self.crash_after {
            if index >= crash_after {
                // The call at `crash_after` itself completes; the crash happens right after it.
                self.crashed = true;
                if index > crash_after {
                    return Err(IoError::Crashed);
                }
            }
        }
        Ok(self.faults.remove(&index))
    }

    fn entry(&self, path: &Path) -> Option<Entry> {
        if is_root(path) {
            Some(Entry::Dir)
        } else {
            self.live.get(path).copied()
        }
    }

    /// `ENOENT` unless the parent of `path` is an existing directory.
    fn check_parent(&self, path: &Path) -> IoResult<()> {
        match path.parent().map(|parent| self.entry(parent)) {
            Some(Some(Entry::Dir)) => Ok(()),
            Some(Some(Entry::File(_))) => Err(os(Errno::NOTDIR)),
            _ => Err(os(Errno::NOENT)),
        }
    }

    fn inode(&mut self, ino: Ino) -> &mut Inode {
        self.inodes
            .get_mut(&ino)
            .expect("an inode lives while a handle or a name refers to it")
    }

    fn used_bytes(&self) -> u64 {
        self.inodes
            .values()
            .filter(|inode| inode.linked || inode.open_count > 0)
            .map(Inode::len)
            .sum()
    }

    /// `ENOSPC` if growing `ino` to `len` would pass the space limit.
    fn check_space(&self, ino: Ino, len: u64) -> IoResult<()> {
        let (Some(limit), Some(inode)) = (self.space_limit_bytes, self.inodes.get(&ino)) else {
            return Ok(());
        };
        let current = inode.len();
        if len > current && self.used_bytes() - current + len > limit {
            return Err(os(Errno::NOSPC));
        }
        Ok(())
    }

    fn device(&self, path: &Path) -> u64 {
        self.devices
            .iter()
            .filter(|(prefix, _)| path.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.components().count())
            .map_or(DEVICE_DEFAULT, |(_, device)| *device)
    }

    /// Apply a directory operation to the live namespace and journal it.
    fn journal_push(&mut self, op: DirOp) {
        op.apply(&mut self.live);
        self.journal.push(op);
    }

    /// Drop inodes that no name, handle or crash outcome can reach any more.
    fn collect_garbage(&mut self) {
        let mut reachable: BTreeSet<Ino> = BTreeSet::new();
        for entry in self.durable.values() {
            if let Entry::File(ino) = entry {
                reachable.insert(*ino);
            }
        }
        for op in &self.journal {
            if let DirOp::Create { ino, .. } = op {
                reachable.insert(*ino);
            }
        }
        self.inodes
            .retain(|ino, inode| inode.linked || inode.open_count > 0 || reachable.contains(ino));
    }
}

/// An in-memory disk that models durability, deterministic from a seed (see the module docs).
///
/// A cheap handle: clones share the disk, and files opened through any clone belong to it.
#[derive(Clone)]
pub struct SimIo {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for SimIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimIo")
            .field("steps", &self.steps())
            .finish_non_exhaustive()
    }
}

/// Recover the guard of a poisoned mutex: a test that panicked mid-call leaves a state that is
/// still memory-safe, and the next assertion of the test reports the real failure.
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SimIo {
    /// An empty disk (only the root directory exists) whose random choices all derive from `seed`.
    pub fn new(seed: u64) -> SimIo {
        SimIo::from_state(State::new(seed))
    }

    fn from_state(state: State) -> SimIo {
        SimIo {
            state: Arc::new(Mutex::new(state)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Run one `Io` call: count it, refuse it after a crash, and hand it its injected fault.
    fn call<T>(
        &self,
        body: impl FnOnce(&mut State, Option<SimFault>) -> IoResult<T>,
    ) -> IoResult<T> {
        let mut state = self.lock();
        let fault = state.begin()?;
        body(&mut state, fault)
    }

    /// How many `Io` and `IoFile` calls were made so far, through this handle, its clones and its
    /// files. It is also the index of the next call, as [`SimIo::fail_at`] and
    /// [`SimIo::crash_after`] count them.
    pub fn steps(&self) -> u64 {
        self.lock().steps
    }

    /// Make the call with index `step` fail with `fault` (see the module docs for side effects).
    pub fn fail_at(&self, step: u64, fault: SimFault) {
        self.lock().faults.insert(step, fault);
    }

    /// Let the call with index `step` complete, then crash: every later call returns
    /// [`IoError::Crashed`]. A `step` already past crashes at the next call.
    pub fn crash_after(&self, step: u64) {
        self.lock().crash_after = Some(step);
    }

    /// Crash now: every later call returns [`IoError::Crashed`].
    pub fn crash_now(&self) {
        self.lock().crashed = true;
    }

    /// The machine comes back after a power loss: crash this handle (if it has not crashed yet) for
    /// good, and return a new, independent handle on what the crash left on the disk. The new
    /// handle has a fresh step counter and no faults; it keeps the space limit and the devices.
    pub fn restart(&self) -> SimIo {
        SimIo::from_state(self.lock().restarted())
    }

    /// Limit the total live length of all files (`None`: no limit). A write, `allocate` or
    /// `set_len` that would grow past it fails with `ENOSPC` and changes nothing.
    pub fn set_space_limit(&self, bytes: Option<u64>) {
        self.lock().space_limit_bytes = bytes;
    }

    /// The total live length of all files, including removed files that are still open.
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes()
    }

    /// Paths under `dir_prefix` report `device` from [`Io::device_id`] (the longest matching prefix
    /// wins; other paths are on device 1). A rename between devices fails with `EXDEV`.
    pub fn set_device(&self, dir_prefix: &Path, device: u64) {
        self.lock().devices.insert(dir_prefix.to_path_buf(), device);
    }

    /// The live contents of the file at `path` (what a read would see), for tests. Not a step.
    pub fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        let state = self.lock();
        match state.entry(path) {
            Some(Entry::File(ino)) => state.inodes.get(&ino).map(|inode| inode.live.clone()),
            _ => None,
        }
    }

    /// The live length of the file at `path`, for tests. Not a step.
    pub fn file_len(&self, path: &Path) -> Option<u64> {
        let state = self.lock();
        match state.entry(path) {
            Some(Entry::File(ino)) => state.inodes.get(&ino).map(Inode::len),
            _ => None,
        }
    }

    /// Flip the bits of `xor_mask` in the byte at `position` of the file at `path`, in both the
    /// live and the durable copy (bit rot on the medium), for tests. Not a step.
    ///
    /// # Panics
    /// If `path` is not a file or `position` is past its live length: a bug in the test.
    pub fn corrupt(&self, path: &Path, position: u64, xor_mask: u8) {
        let mut state = self.lock();
        let Some(Entry::File(ino)) = state.entry(path) else {
            panic!("corrupt: {} is not a file", path.display());
        };
        let inode = state.inode(ino);
        assert!(
            position < inode.len(),
            "corrupt: position {position} past the end"
        );
        let at = position as usize;
        inode.live[at] ^= xor_mask;
        if let Some(byte) = inode.durable.get_mut(at) {
            *byte ^= xor_mask;
        }
    }
}

impl Io for SimIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let ino = self.call(|state, fault| {
            fail_if(fault)?;
            let ino = match (state.entry(path), mode) {
                (Some(Entry::File(ino)), OpenMode::Existing) => ino,
                (Some(Entry::Dir), OpenMode::Existing) => return Err(os(Errno::ISDIR)),
                (Some(_), OpenMode::CreateNew) => return Err(os(Errno::EXIST)),
                (None, OpenMode::Existing) => return Err(os(Errno::NOENT)),
                (None, OpenMode::CreateNew) => {
                    state.check_parent(path)?;
                    let ino = state.ino_next;
                    state.ino_next += 1;
                    state.inodes.insert(ino, Inode::default());
                    let path = path.to_path_buf();
                    state.journal_push(DirOp::Create { path, ino });
                    state.inode(ino).linked = true;
                    ino
                }
            };
            state.inode(ino).open_count += 1;
            Ok(ino)
        })?;
        let state = Arc::clone(&self.state);
        Ok(Arc::new(SimFile { state, ino }))
    }

    fn create_dir_all(&self, path: &Path) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            let mut missing = Vec::new();
            for ancestor in path.ancestors() {
                match state.entry(ancestor) {
                    Some(Entry::Dir) => break,
                    Some(Entry::File(_)) if ancestor == path => return Err(os(Errno::EXIST)),
                    Some(Entry::File(_)) => return Err(os(Errno::NOTDIR)),
                    None => missing.push(ancestor.to_path_buf()),
                }
            }
            for path in missing.into_iter().rev() {
                state.journal_push(DirOp::Mkdir { path });
            }
            Ok(())
        })
    }

    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>> {
        self.call(|state, fault| {
            fail_if(fault)?;
            match state.entry(path) {
                Some(Entry::Dir) => {}
                Some(Entry::File(_)) => return Err(os(Errno::NOTDIR)),
                None => return Err(os(Errno::NOENT)),
            }
            let mut names: Vec<String> = state
                .live
                .keys()
                .filter(|child| child.parent() == Some(path))
                .filter_map(|child| child.file_name())
                .map(|name| name.to_string_lossy().into_owned())
                .collect();
            names.sort();
            Ok(names)
        })
    }

    fn remove_file(&self, path: &Path) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            match state.entry(path) {
                Some(Entry::File(ino)) => {
                    state.inode(ino).linked = false;
                    let path = path.to_path_buf();
                    state.journal_push(DirOp::Remove { path });
                    Ok(())
                }
                Some(Entry::Dir) => Err(os(Errno::ISDIR)),
                None => Err(os(Errno::NOENT)),
            }
        })
    }

    fn remove_dir(&self, path: &Path) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            if is_root(path) {
                return Err(os(Errno::BUSY));
            }
            match state.entry(path) {
                Some(Entry::Dir) => {}
                Some(Entry::File(_)) => return Err(os(Errno::NOTDIR)),
                None => return Err(os(Errno::NOENT)),
            }
            if state.live.keys().any(|child| child.parent() == Some(path)) {
                return Err(os(Errno::NOTEMPTY));
            }
            let path = path.to_path_buf();
            state.journal_push(DirOp::Remove { path });
            Ok(())
        })
    }

    fn rename(&self, from: &Path, to: &Path) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            rename_check(state, from, to)?;
            if from == to {
                return Ok(());
            }
            if let Some(Entry::File(replaced)) = state.entry(to) {
                state.inode(replaced).linked = false;
            }
            let (from, to) = (from.to_path_buf(), to.to_path_buf());
            state.journal_push(DirOp::Rename { from, to });
            Ok(())
        })
    }

    fn sync_dir(&self, path: &Path) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            match state.entry(path) {
                Some(Entry::Dir) => {}
                Some(Entry::File(_)) => return Err(os(Errno::NOTDIR)),
                None => return Err(os(Errno::NOENT)),
            }
            // One journal for the whole file system: committing it commits every directory.
            state.durable = state.live.clone();
            state.journal.clear();
            state.collect_garbage();
            Ok(())
        })
    }

    fn device_id(&self, path: &Path) -> IoResult<u64> {
        self.call(|state, fault| {
            fail_if(fault)?;
            match state.entry(path) {
                Some(_) => Ok(state.device(path)),
                None => Err(os(Errno::NOENT)),
            }
        })
    }

    /// The simulated file system is as large as its space limit, or 1 TiB without one; what is
    /// not used is free.
    fn fs_stats(&self, path: &Path) -> IoResult<super::FsStats> {
        self.call(|state, fault| {
            fail_if(fault)?;
            if state.entry(path).is_none() {
                return Err(os(Errno::NOENT));
            }
            let total_bytes = state.space_limit_bytes.unwrap_or(1 << 40);
            Ok(super::FsStats {
                total_bytes,
                free_bytes: total_bytes.saturating_sub(state.used_bytes()),
            })
        })
    }

    fn exists(&self, path: &Path) -> IoResult<bool> {
        self.call(|state, fault| {
            fail_if(fault)?;
            Ok(state.entry(path).is_some())
        })
    }
}

/// The errors `rename(2)` gives for `from` and `to` in `state`.
fn rename_check(state: &State, from: &Path, to: &Path) -> IoResult<()> {
    let Some(source) = state.entry(from) else {
        return Err(os(Errno::NOENT));
    };
    state.check_parent(to)?;
    if state.device(from) != state.device(to) {
        return Err(os(Errno::XDEV));
    }
    if is_root(from) || (from != to && to.starts_with(from)) {
        return Err(os(Errno::INVAL));
    }
    match (source, state.entry(to)) {
        (Entry::File(_), Some(Entry::Dir)) => Err(os(Errno::ISDIR)),
        (Entry::Dir, Some(Entry::File(_))) => Err(os(Errno::NOTDIR)),
        (Entry::Dir, Some(Entry::Dir))
            if from != to && state.live.keys().any(|child| child.parent() == Some(to)) =>
        {
            Err(os(Errno::NOTEMPTY))
        }
        _ => Ok(()),
    }
}

/// A file open on a [`SimIo`]: refers to its inode, not to its name.
struct SimFile {
    state: Arc<Mutex<State>>,
    ino: Ino,
}

impl fmt::Debug for SimFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimFile")
            .field("ino", &self.ino)
            .finish_non_exhaustive()
    }
}

impl SimFile {
    fn call<T>(
        &self,
        body: impl FnOnce(&mut State, Option<SimFault>) -> IoResult<T>,
    ) -> IoResult<T> {
        let mut state = lock(&self.state);
        let fault = state.begin()?;
        body(&mut state, fault)
    }

    /// A failed write: a PRNG-chosen prefix of `buf`, ending on a sector boundary, lands first.
    fn write_failed(&self, state: &mut State, buf: &[u8], position: u64) {
        let end = position + buf.len() as u64;
        let first_boundary = (position / SECTOR_SIZE_BYTES + 1) * SECTOR_SIZE_BYTES;
        let boundaries = if first_boundary < end {
            (end - 1 - first_boundary) / SECTOR_SIZE_BYTES + 1
        } else {
            0
        };
        let chosen = state.rng.below(boundaries + 1);
        if chosen == 0 {
            return;
        }
        let prefix_end = first_boundary + (chosen - 1) * SECTOR_SIZE_BYTES;
        if state.check_space(self.ino, prefix_end).is_ok() {
            let prefix = &buf[..(prefix_end - position) as usize];
            state.inode(self.ino).write(prefix, position);
        }
    }
}

impl IoFile for SimFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            state.inode(self.ino).read(buf, position)
        })
    }

    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.call(|state, fault| {
            let end = checked_end(position, buf.len())?;
            state.check_space(self.ino, end)?;
            if let Some(fault) = fault {
                self.write_failed(state, buf, position);
                return Err(os(fault.errno()));
            }
            state.inode(self.ino).write(buf, position);
            Ok(())
        })
    }

    fn sync_data(&self) -> IoResult<()> {
        self.call(|state, fault| {
            let inode = state.inode(self.ino);
            if let Some(fault) = fault {
                inode.poison();
                return Err(os(fault.errno()));
            }
            inode.sync();
            Ok(())
        })
    }

    fn allocate(&self, len: u64) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            checked_end(len, 0)?;
            state.check_space(self.ino, len)?;
            let inode = state.inode(self.ino);
            if len > inode.len() {
                inode.set_len(len);
            }
            Ok(())
        })
    }

    fn set_len(&self, len: u64) -> IoResult<()> {
        self.call(|state, fault| {
            fail_if(fault)?;
            checked_end(len, 0)?;
            state.check_space(self.ino, len)?;
            state.inode(self.ino).set_len(len);
            Ok(())
        })
    }

    fn len(&self) -> IoResult<u64> {
        self.call(|state, fault| {
            fail_if(fault)?;
            Ok(state.inode(self.ino).len())
        })
    }
}

impl Drop for SimFile {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        if let Some(inode) = state.inodes.get_mut(&self.ino) {
            inode.open_count -= 1;
            if !inode.linked && inode.open_count == 0 {
                state.collect_garbage();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEEDS_COUNT: u64 = 64;

    fn path(text: &str) -> PathBuf {
        PathBuf::from(text)
    }

    fn create(io: &SimIo, file: &str) -> Arc<dyn IoFile> {
        io.open(&path(file), OpenMode::CreateNew).unwrap()
    }

    /// `/d` with a file `name` holding `bytes`, all durable.
    fn durable_file(io: &SimIo, name: &str, bytes: &[u8]) -> Arc<dyn IoFile> {
        io.create_dir_all(&path("/d")).unwrap();
        io.sync_dir(&path("/")).unwrap();
        let file = create(io, &format!("/d/{name}"));
        file.write_all_at(bytes, 0).unwrap();
        file.sync_data().unwrap();
        io.sync_dir(&path("/d")).unwrap();
        file
    }

    /// Every path below `/` with the contents of the files (`None` for a directory).
    fn snapshot(io: &SimIo) -> Vec<(PathBuf, Option<Vec<u8>>)> {
        let mut out = Vec::new();
        let mut dirs = vec![path("/")];
        while let Some(dir) = dirs.pop() {
            for name in io.read_dir(&dir).unwrap() {
                let child = dir.join(name);
                let contents = io.read_file(&child);
                if contents.is_none() {
                    dirs.push(child.clone());
                }
                out.push((child, contents));
            }
        }
        out.sort();
        out
    }

    #[test]
    fn synced_data_survives_restart() {
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            let file = durable_file(&io, "a", &[7u8; 3000]);
            file.write_all_at(&[9u8; 100], 5000).unwrap();
            file.sync_data().unwrap();
            let before = io.read_file(&path("/d/a")).unwrap();
            assert_eq!(before.len(), 5100);
            let io = io.restart();
            assert_eq!(io.read_file(&path("/d/a")), Some(before), "seed {seed}");
        }
    }

    #[test]
    fn unsynced_writes_are_lost_or_torn_by_whole_sectors() {
        let old = vec![0xaau8; 4096];
        let mut new = old.clone();
        new[100..4000].fill(0xbb);
        let (mut torn, mut sectors_seen_new, mut sectors_seen_old) = (None, [0; 8], [0; 8]);
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            let file = durable_file(&io, "a", &old);
            file.write_all_at(&new[100..4000], 100).unwrap();
            let after = io.restart().read_file(&path("/d/a")).unwrap();
            assert_eq!(after.len(), 4096, "seed {seed}");
            let mut sectors_new = 0;
            for (index, sector) in after.chunks(512).enumerate() {
                let range = index * 512..(index + 1) * 512;
                if sector == &new[range.clone()] {
                    sectors_new += 1;
                    sectors_seen_new[index] += 1;
                } else {
                    assert_eq!(sector, &old[range], "seed {seed}: sector {index} is torn");
                    sectors_seen_old[index] += 1;
                }
            }
            if sectors_new > 0 && sectors_new < 8 {
                torn = torn.or(Some(seed));
            }
        }
        let torn = torn.expect("some seed tears the write");
        println!(
            "first torn seed {torn}; per sector new {sectors_seen_new:?} old {sectors_seen_old:?}"
        );
        // Sectors are independent: each one is sometimes written back and sometimes not.
        assert!(sectors_seen_new.iter().all(|count| *count > 0));
        assert!(sectors_seen_old.iter().all(|count| *count > 0));
    }

    #[test]
    fn unsynced_growth_keeps_or_loses_the_length() {
        let mut lengths = BTreeSet::new();
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            let file = durable_file(&io, "a", &[1u8; 512]);
            file.write_all_at(&[2u8; 1024], 512).unwrap();
            let after = io.restart().read_file(&path("/d/a")).unwrap();
            assert!(after.len() == 512 || after.len() == 1536, "seed {seed}");
            assert!(after[..512].iter().all(|b| *b == 1), "seed {seed}");
            assert!(
                after[512..].iter().all(|b| *b == 2 || *b == 0),
                "seed {seed}"
            );
            lengths.insert(after.len());
        }
        assert_eq!(lengths.len(), 2, "both outcomes happen: {lengths:?}");
    }

    #[test]
    fn entry_without_sync_dir_may_vanish_and_synced_one_stays() {
        let (mut vanished, mut stayed) = (0, 0);
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            durable_file(&io, "synced", b"kept");
            let file = create(&io, "/d/unsynced");
            file.write_all_at(b"data", 0).unwrap();
            file.sync_data().unwrap();
            let io = io.restart();
            assert_eq!(
                io.read_file(&path("/d/synced")).unwrap(),
                b"kept",
                "seed {seed}"
            );
            match io.read_file(&path("/d/unsynced")) {
                None => vanished += 1,
                Some(data) => {
                    assert_eq!(data, b"data", "seed {seed}");
                    stayed += 1;
                }
            }
        }
        assert!(
            vanished > 0 && stayed > 0,
            "vanished {vanished}, stayed {stayed}"
        );
    }

    #[test]
    fn crash_keeps_a_prefix_of_the_metadata_journal() {
        // The names in /d after each prefix of: create a, create b, rename a->c, remove b, create e.
        let prefixes: [&[&str]; 6] = [&[], &["a"], &["a", "b"], &["b", "c"], &["c"], &["c", "e"]];
        let mut seen = BTreeSet::new();
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            io.create_dir_all(&path("/d")).unwrap();
            io.sync_dir(&path("/")).unwrap();
            create(&io, "/d/a");
            create(&io, "/d/b");
            io.rename(&path("/d/a"), &path("/d/c")).unwrap();
            io.remove_file(&path("/d/b")).unwrap();
            create(&io, "/d/e");
            let names = io.restart().read_dir(&path("/d")).unwrap();
            let prefix = prefixes.iter().position(|p| names == *p);
            let prefix = prefix.unwrap_or_else(|| panic!("seed {seed}: {names:?} is no prefix"));
            seen.insert(prefix);
        }
        assert!(seen.contains(&0) && seen.contains(&5), "{seen:?}");
        assert!(seen.len() >= 4, "{seen:?}");
    }

    #[test]
    fn removal_without_sync_dir_may_bring_back_durable_data() {
        let mut outcomes = BTreeSet::new();
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            let file = durable_file(&io, "a", b"durable");
            file.write_all_at(b"DUR", 0).unwrap();
            io.remove_file(&path("/d/a")).unwrap();
            // Unix semantics: the open handle still reaches the inode.
            let mut buf = [0u8; 7];
            file.read_exact_at(&mut buf, 0).unwrap();
            assert_eq!(&buf, b"DURable");
            let back = io.restart().read_file(&path("/d/a"));
            if let Some(data) = &back {
                assert!(
                    data == b"durable" || data == b"DURable",
                    "seed {seed}: {data:?}"
                );
            }
            outcomes.insert(back.is_some());
        }
        assert_eq!(outcomes.len(), 2);
    }

    #[test]
    fn fail_at_injects_eio_and_enospc_at_one_step() {
        let io = SimIo::new(1);
        let file = durable_file(&io, "a", &[0u8; 16]);
        io.fail_at(io.steps(), SimFault::Eio);
        let error = file.write_all_at(b"x", 0).unwrap_err();
        assert_eq!(error, IoError::Os(Errno::IO));
        file.write_all_at(b"y", 0).unwrap();

        io.fail_at(io.steps() + 1, SimFault::NoSpace);
        assert!(!io.exists(&path("/d/b")).unwrap());
        let error = io.open(&path("/d/b"), OpenMode::CreateNew).unwrap_err();
        assert!(error.is_no_space(), "{error:?}");
        assert!(!io.exists(&path("/d/b")).unwrap());
        assert_eq!(io.steps(), 11);
    }

    #[test]
    fn failed_write_applies_a_sector_prefix_at_most() {
        let buf: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8 + 1).collect();
        let mut prefixes = BTreeSet::new();
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            let file = durable_file(&io, "a", &[]);
            io.fail_at(io.steps(), SimFault::Eio);
            file.write_all_at(&buf, 100).unwrap_err();
            let live = io.read_file(&path("/d/a")).unwrap();
            if !live.is_empty() {
                assert_eq!(live.len() % 512, 0, "seed {seed}: prefix ends on a sector");
                assert_eq!(&live[100..], &buf[..live.len() - 100], "seed {seed}");
            }
            assert!(live.len() < 3100, "seed {seed}: the whole write landed");
            prefixes.insert(live.len());
        }
        assert!(prefixes.len() > 2, "{prefixes:?}");
    }

    #[test]
    fn failed_sync_loses_its_writes_even_after_a_good_sync() {
        for seed in 0..SEEDS_COUNT {
            let io = SimIo::new(seed);
            let file = durable_file(&io, "a", &[0u8; 1024]);
            file.write_all_at(&[5u8; 1024], 0).unwrap();
            io.fail_at(io.steps(), SimFault::Eio);
            assert_eq!(file.sync_data().unwrap_err(), IoError::Os(Errno::IO));
            let mut buf = [0u8; 1024];
            file.read_exact_at(&mut buf, 0).unwrap();
            assert_eq!(buf, [5u8; 1024], "the page cache still shows the write");
            // A write after the failed sync is an ordinary write.
            file.write_all_at(&[6u8; 512], 1024).unwrap();
            file.sync_data().unwrap();
            let after = io.restart().read_file(&path("/d/a")).unwrap();
            assert_eq!(&after[..1024], &[0u8; 1024][..], "seed {seed}: fsyncgate");
            assert_eq!(&after[1024..], &[6u8; 512][..], "seed {seed}");
        }
    }

    #[test]
    fn crash_after_fails_later_calls_and_restart_recovers() {
        let io = SimIo::new(3);
        let file = durable_file(&io, "a", b"abc");
        let clone = io.clone();
        io.crash_after(io.steps() + 1);
        assert!(io.exists(&path("/d/a")).unwrap());
        file.write_all_at(b"z", 0).unwrap();
        assert_eq!(file.len().unwrap_err(), IoError::Crashed);
        assert_eq!(clone.exists(&path("/d")).unwrap_err(), IoError::Crashed);
        assert_eq!(io.sync_dir(&path("/")).unwrap_err(), IoError::Crashed);

        let new = io.restart();
        assert_eq!(new.steps(), 0);
        assert_eq!(io.exists(&path("/d")).unwrap_err(), IoError::Crashed);
        assert_eq!(file.sync_data().unwrap_err(), IoError::Crashed);
        let reopened = new.open(&path("/d/a"), OpenMode::Existing).unwrap();
        let mut buf = [0u8; 3];
        reopened.read_exact_at(&mut buf, 0).unwrap();
        assert!(&buf == b"abc" || &buf == b"zbc", "{buf:?}");
        reopened.write_all_at(b"new", 3).unwrap();
        assert_eq!(reopened.len().unwrap(), 6);
        assert_eq!(new.steps(), 4);
    }

    #[test]
    fn crash_now_then_restart_of_an_uncrashed_handle() {
        let io = SimIo::new(4);
        durable_file(&io, "a", b"abc");
        io.crash_now();
        assert_eq!(io.exists(&path("/d")).unwrap_err(), IoError::Crashed);
        let io = SimIo::new(4);
        durable_file(&io, "a", b"abc");
        let new = io.restart();
        assert_eq!(io.exists(&path("/d")).unwrap_err(), IoError::Crashed);
        assert_eq!(new.read_file(&path("/d/a")).unwrap(), b"abc");
    }

    /// A workload with unsynced writes, renames and a crash at `crash_step`; the state after it.
    fn workload(seed: u64, crash_step: u64) -> Vec<(PathBuf, Option<Vec<u8>>)> {
        let io = SimIo::new(seed);
        io.crash_after(crash_step);
        let mut files = Vec::new();
        for round in 0..6u8 {
            let name = format!("/w/f{round}");
            let _ = io.create_dir_all(&path("/w"));
            let Ok(file) = io.open(&path(&name), OpenMode::CreateNew) else {
                break;
            };
            let _ = file.write_all_at(&[round; 1500], u64::from(round) * 700);
            if round % 2 == 0 {
                let _ = file.sync_data();
                let _ = io.rename(&path(&name), &path(&format!("{name}.done")));
            }
            if round % 3 == 0 {
                let _ = io.sync_dir(&path("/w"));
            }
            files.push(file);
        }
        snapshot(&io.restart())
    }

    #[test]
    fn same_seed_same_state_byte_for_byte() {
        let mut distinct = BTreeSet::new();
        for seed in 0..16 {
            let first = workload(seed, 20);
            assert_eq!(first, workload(seed, 20), "seed {seed}");
            assert!(!first.is_empty(), "seed {seed}");
            distinct.insert(first);
        }
        assert!(distinct.len() > 1, "the seed changes the outcome");
    }

    #[test]
    fn space_limit_refuses_growth_with_enospc() {
        let io = SimIo::new(5);
        io.set_space_limit(Some(4096));
        io.create_dir_all(&path("/d")).unwrap();
        let file = create(&io, "/d/a");
        file.write_all_at(&[1u8; 4096], 0).unwrap();
        assert_eq!(io.used_bytes(), 4096);
        assert!(file
            .write_all_at(&[2u8; 2], 4095)
            .unwrap_err()
            .is_no_space());
        assert_eq!(io.read_file(&path("/d/a")).unwrap(), vec![1u8; 4096]);
        assert!(file.allocate(8192).unwrap_err().is_no_space());
        assert!(file.set_len(4097).unwrap_err().is_no_space());
        file.set_len(1024).unwrap();
        assert_eq!(io.used_bytes(), 1024);
        let other = create(&io, "/d/b");
        other.allocate(3072).unwrap();
        assert!(other.write_all_at(b"x", 3072).unwrap_err().is_no_space());
        io.remove_file(&path("/d/b")).unwrap();
        assert_eq!(
            io.used_bytes(),
            4096,
            "an open removed file holds its space"
        );
        drop(other);
        assert_eq!(io.used_bytes(), 1024);
        io.set_space_limit(None);
        file.allocate(1 << 20).unwrap();
        assert_eq!(io.file_len(&path("/d/a")), Some(1 << 20));
    }

    #[test]
    fn rename_across_devices_fails_with_exdev() {
        let io = SimIo::new(6);
        io.set_device(&path("/mnt/other"), 7);
        io.create_dir_all(&path("/mnt/other/x")).unwrap();
        io.create_dir_all(&path("/data")).unwrap();
        create(&io, "/data/a");
        assert_eq!(io.device_id(&path("/data/a")).unwrap(), DEVICE_DEFAULT);
        assert_eq!(io.device_id(&path("/mnt/other/x")).unwrap(), 7);
        let error = io
            .rename(&path("/data/a"), &path("/mnt/other/x/a"))
            .unwrap_err();
        assert_eq!(error, IoError::Os(Errno::XDEV));
        io.rename(&path("/data/a"), &path("/data/b")).unwrap();
        assert_eq!(io.read_dir(&path("/data")).unwrap(), vec!["b"]);
    }

    #[test]
    fn corrupt_flips_the_live_and_the_durable_byte() {
        let io = SimIo::new(8);
        durable_file(&io, "a", &[0u8; 10]);
        io.corrupt(&path("/d/a"), 3, 0x81);
        assert_eq!(io.read_file(&path("/d/a")).unwrap()[3], 0x81);
        assert_eq!(io.restart().read_file(&path("/d/a")).unwrap()[3], 0x81);
    }

    #[test]
    fn reads_past_the_end_are_short_and_directories_behave() {
        let io = SimIo::new(9);
        let file = durable_file(&io, "a", b"12345");
        let mut buf = [0u8; 8];
        assert_eq!(
            file.read_exact_at(&mut buf, 2),
            Err(IoError::ShortRead { read: 3 })
        );
        assert_eq!(&buf[..3], b"345");
        assert_eq!(
            file.read_exact_at(&mut buf, 99),
            Err(IoError::ShortRead { read: 0 })
        );
        let error = io.remove_dir(&path("/d")).unwrap_err();
        assert_eq!(error, IoError::Os(Errno::NOTEMPTY));
        assert!(io
            .open(&path("/nope/a"), OpenMode::CreateNew)
            .unwrap_err()
            .is_not_found());
        io.remove_file(&path("/d/a")).unwrap();
        io.remove_dir(&path("/d")).unwrap();
        assert!(!io.exists(&path("/d")).unwrap());
        assert!(io.read_dir(&path("/")).unwrap().is_empty());
    }
}
