//! The `Io` seam: every file operation of the storage engine goes through [`Io`] and [`IoFile`].
//!
//! Two implementations exist: [`RealIo`] (the Linux file system, through `rustix`) and [`SimIo`] (an
//! in-memory disk that is deterministic from a seed, keeps written and durable bytes apart, can fail
//! any call with `EIO` or `ENOSPC`, and can crash after any call). The log never touches `std::fs`
//! directly, so every test that runs on `SimIo` exercises the exact code that runs in production.

mod real;
mod sim;

pub use real::RealIo;
pub use sim::{SimFault, SimIo};

use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// The error of one `Io` call: the operating system's error number, or a crash of the simulated disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoError {
    /// The call failed with this `errno` (`EIO`, `ENOSPC`, `ENOENT`, ...).
    Os(rustix::io::Errno),
    /// The simulated machine crashed: this call and every later one on this `SimIo` fail. Only
    /// [`SimIo`] returns it.
    Crashed,
    /// A read ended before the buffer was filled (the file is shorter than asked).
    ShortRead {
        /// Bytes that were read before the end of the file.
        read: usize,
    },
}

impl IoError {
    /// True when the error means "no space left on the device".
    pub fn is_no_space(&self) -> bool {
        matches!(self, IoError::Os(e) if *e == rustix::io::Errno::NOSPC)
    }

    /// True when the error means the file or directory does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, IoError::Os(e) if *e == rustix::io::Errno::NOENT)
    }
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IoError::Os(e) => write!(f, "{e}"),
            IoError::Crashed => write!(f, "the simulated disk crashed"),
            IoError::ShortRead { read } => write!(f, "short read: file ended after {read} bytes"),
        }
    }
}

impl std::error::Error for IoError {}

impl From<rustix::io::Errno> for IoError {
    fn from(e: rustix::io::Errno) -> Self {
        IoError::Os(e)
    }
}

impl From<std::io::Error> for IoError {
    fn from(e: std::io::Error) -> Self {
        match e.raw_os_error() {
            Some(code) => IoError::Os(rustix::io::Errno::from_raw_os_error(code)),
            None => IoError::Os(rustix::io::Errno::IO),
        }
    }
}

/// Result of one `Io` call.
pub type IoResult<T> = Result<T, IoError>;

/// How [`Io::open`] opens a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Open an existing file for reading and writing; `ENOENT` if it does not exist.
    Existing,
    /// Create a new file for reading and writing; `EEXIST` if it exists already.
    CreateNew,
}

/// An open file. Positions are absolute: there is no cursor, so one file may be shared by a writer
/// and many readers at once.
#[expect(
    clippy::len_without_is_empty,
    reason = "a segment file is never empty; len() is a stat, not a collection size"
)]
pub trait IoFile: Send + Sync + fmt::Debug {
    /// Read exactly `buf.len()` bytes at `position`, or fail with [`IoError::ShortRead`].
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()>;
    /// Write all of `buf` at `position` (`pwrite`). The bytes are visible to reads at once and
    /// durable only after a later successful [`IoFile::sync_data`].
    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()>;
    /// Make every write to this file before the call durable (`fdatasync`), including a size
    /// change. Does not make the file's directory entry durable: see [`Io::sync_dir`].
    fn sync_data(&self) -> IoResult<()>;
    /// Reserve blocks for `[0, len)` so that writes below `len` never need new blocks
    /// (`fallocate`); grows the file to `len` if shorter.
    fn allocate(&self, len: u64) -> IoResult<()>;
    /// Set the file's length (`ftruncate`).
    fn set_len(&self, len: u64) -> IoResult<()>;
    /// The file's current length.
    fn len(&self) -> IoResult<u64>;
}

/// The file-system operations of the storage engine. Paths are absolute or relative to the process;
/// `SimIo` treats them as plain keys.
pub trait Io: Send + Sync + fmt::Debug + 'static {
    /// Open a file (see [`OpenMode`]).
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>>;
    /// Create a directory and its missing parents (`mkdir -p`); each new entry is durable only
    /// after [`Io::sync_dir`] of its parent.
    fn create_dir_all(&self, path: &Path) -> IoResult<()>;
    /// The names (not paths) of the entries of a directory, sorted.
    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>>;
    /// Remove a file. Durable after [`Io::sync_dir`] of its directory.
    fn remove_file(&self, path: &Path) -> IoResult<()>;
    /// Remove an empty directory.
    fn remove_dir(&self, path: &Path) -> IoResult<()>;
    /// Rename a file atomically, replacing `to` if it exists; both must be on one file system.
    /// Durable after [`Io::sync_dir`] of the directories involved.
    fn rename(&self, from: &Path, to: &Path) -> IoResult<()>;
    /// Make the entries of a directory durable (`fsync` on the directory).
    fn sync_dir(&self, path: &Path) -> IoResult<()>;
    /// The id of the file system (device) that holds `path`; a rename works only within one.
    fn device_id(&self, path: &Path) -> IoResult<u64>;
    /// True if `path` exists.
    fn exists(&self, path: &Path) -> IoResult<bool>;
    /// Size and free space of the file system that holds `path` (`statvfs`).
    fn fs_stats(&self, path: &Path) -> IoResult<FsStats>;
}

/// Size and free space of a file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    /// Total size in bytes.
    pub total_bytes: u64,
    /// Bytes available to an unprivileged writer.
    pub free_bytes: u64,
}
