//! [`StorageLock`]: one node per storage directory. A node takes an exclusive `flock` on
//! `<dir>/keratin.lock` in every storage directory before it opens anything there (the
//! partitions, the node metadata, the cluster's `cluster-meta/`, the spares, the admin password)
//! and holds it for its life. A second node started on any of the same directories fails at
//! once, naming the directory and the pid written in the lock file, and has changed nothing.
//!
//! Two nodes on one directory would take spare segments from under each other and append to
//! the same logs: each heals its logs over and over and both answer with different messages.
//!
//! The lock is the kernel's, not the file's: `flock` is released when its descriptor closes,
//! including when the holder dies (`kill -9`, a crash, a power loss), so a lock file left by a
//! dead node never blocks the next start. The pid in the file only says who held it last; it
//! is rewritten by each holder and never trusted for the decision. The descriptor is opened
//! close-on-exec (Rust's default), so a child process never inherits the lock.
//! The format of the file is in `docs/storage-format.md`, "Storage directory lock".

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock file's name in each storage directory.
pub const LOCK_FILE_NAME: &str = "keratin.lock";

/// The most bytes read from a lock file to find the pid of its holder: a pid is at most
/// 7 digits on Linux (`pid_max` is at most 4,194,304) plus a newline; anything longer is not
/// a lock file this version wrote.
const LOCK_FILE_READ_BYTES_MAX: u64 = 64;

/// Why a storage directory could not be locked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageLockError {
    /// Another process holds the directory's lock.
    #[error(
        "storage directory {} is in use by {holder} (lock file {}); two nodes on one \
         directory would overwrite each other's logs, so this one did not start: stop the \
         other node first, or give this one another --data-dir (storage.dirs)",
        .dir.display(), .lock.display()
    )]
    InUse {
        /// The storage directory as configured.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
        /// Who holds it, as its lock file says.
        holder: Holder,
    },
    /// The directory or its lock file could not be created, opened or locked.
    #[error(
        "cannot lock storage directory {} (lock file {}): {source}; check that the directory \
         exists or can be created and that this user may write in it",
        .dir.display(), .lock.display()
    )]
    Io {
        /// The storage directory as configured.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The holder of a lock, as its lock file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Another process: its pid.
    Process(u32),
    /// This process: the directory is listed twice under different names (a symlink, a bind
    /// mount), which the configuration's check of distinct paths cannot see.
    ThisProcess,
    /// The file names no pid (its holder has not written it yet, or it is not ours).
    Unknown,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Process(pid) => write!(f, "another keratin process (pid {pid})"),
            Holder::ThisProcess => write!(
                f,
                "this node already (it is listed twice in storage.dirs under different names)"
            ),
            Holder::Unknown => write!(f, "another process (its pid is not in the lock file)"),
        }
    }
}

/// The locks of a node's storage directories, held until dropped.
#[derive(Debug)]
pub struct StorageLock {
    /// Each directory with its open, locked lock file.
    held: Vec<(PathBuf, File)>,
}

impl StorageLock {
    /// Lock every directory of `dirs`, in order, creating a missing directory (the storage
    /// would create it next) and its lock file. On a refusal the locks taken so far are
    /// released and nothing in a directory held by another process was changed.
    pub fn acquire(dirs: &[PathBuf]) -> Result<StorageLock, StorageLockError> {
        let mut held = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let file = lock_dir(dir)?;
            held.push((dir.clone(), file));
        }
        Ok(StorageLock { held })
    }

    /// The directories held.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.held.iter().map(|(dir, _)| dir.as_path())
    }
}

/// Lock one directory: open (or create) its lock file without changing it, try the lock, and
/// only once it is ours write this process's pid.
fn lock_dir(dir: &Path) -> Result<File, StorageLockError> {
    let lock = dir.join(LOCK_FILE_NAME);
    let io_error = |source: std::io::Error| StorageLockError::Io {
        dir: dir.to_path_buf(),
        lock: lock.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io_error)?;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock)
        .map_err(io_error)?;
    // SAFETY: flock only acts on the descriptor, which `file` keeps open for the call.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if locked != 0 {
        let error = std::io::Error::last_os_error();
        if error.kind() == std::io::ErrorKind::WouldBlock {
            return Err(StorageLockError::InUse {
                dir: dir.to_path_buf(),
                lock: lock.clone(),
                holder: holder_of(&mut file),
            });
        }
        return Err(io_error(error));
    }
    // Ours: say who holds it. Not synced: the pid is information for the operator, and the
    // kernel's lock, not the file, decides.
    let pid = format!("{}\n", std::process::id());
    file.set_len(0).map_err(io_error)?;
    file.seek(SeekFrom::Start(0)).map_err(io_error)?;
    file.write_all(pid.as_bytes()).map_err(io_error)?;
    Ok(file)
}

/// The holder a lock file names.
fn holder_of(file: &mut File) -> Holder {
    let mut text = String::new();
    let read = file.seek(SeekFrom::Start(0)).and_then(|_| {
        file.take(LOCK_FILE_READ_BYTES_MAX)
            .read_to_string(&mut text)
    });
    if read.is_err() {
        return Holder::Unknown;
    }
    match text.trim().parse::<u32>() {
        Ok(pid) if pid == std::process::id() => Holder::ThisProcess,
        Ok(pid) => Holder::Process(pid),
        Err(_) => Holder::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_locked_once_and_free_again_when_dropped() {
        let root = tempfile::tempdir().expect("tmp");
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        let lock = StorageLock::acquire(&[a.clone(), b.clone()]).expect("first");
        let written = std::fs::read_to_string(a.join(LOCK_FILE_NAME)).expect("lock file");
        assert_eq!(written, format!("{}\n", std::process::id()));
        // flock conflicts between two open file descriptions, even in one process: a
        // second node of this process on `b` is refused, and `c` (free) is not kept locked.
        let c = root.path().join("c");
        let error = StorageLock::acquire(&[c.clone(), b.clone()]).expect_err("b is held");
        match &error {
            StorageLockError::InUse { dir, holder, .. } => {
                assert_eq!(dir, &b);
                assert_eq!(*holder, Holder::ThisProcess);
            }
            other => panic!("{other}"),
        }
        assert!(
            error.to_string().contains(&b.display().to_string()),
            "{error}"
        );
        drop(StorageLock::acquire(std::slice::from_ref(&c)).expect("c was released"));
        drop(lock);
        // The file stays, naming the last holder; the lock went with the descriptor.
        assert!(a.join(LOCK_FILE_NAME).exists());
        let again = StorageLock::acquire(&[a, b]).expect("free after drop");
        assert_eq!(again.dirs().count(), 2);
    }

    #[test]
    fn a_lock_file_without_a_pid_names_no_holder() {
        let root = tempfile::tempdir().expect("tmp");
        let path = root.path().join(LOCK_FILE_NAME);
        std::fs::write(&path, "not a pid").expect("write");
        let mut file = File::open(&path).expect("open");
        assert_eq!(holder_of(&mut file), Holder::Unknown);
        std::fs::write(&path, "4242\n").expect("write");
        let mut file = File::open(&path).expect("open");
        assert_eq!(holder_of(&mut file), Holder::Process(4242));
    }
}
