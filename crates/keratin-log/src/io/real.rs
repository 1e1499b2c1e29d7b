//! [`RealIo`]: the [`Io`] seam on the Linux file system, through `rustix`.
//!
//! This file owns the system calls and their quirks (partial transfers, `EINTR`, errno mapping).
//! What the calls guarantee is the kernel's business: data is durable after `fdatasync`, a
//! directory entry after `fsync` of its directory. Both survive a power loss on a disk that honours
//! cache flushes; everything written before them survives only a process crash.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::io::Errno;

use super::{Io, IoError, IoFile, IoResult, OpenMode};

/// Permissions of every file the engine creates: the owner writes, everyone reads (before umask).
const FILE_MODE: u32 = 0o644;

// A transferred byte count (`usize`) always fits in a file position (`u64`).
const _: () = assert!(usize::BITS <= u64::BITS);

/// The real file system. A zero-sized handle: every call goes straight to the kernel.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealIo;

impl RealIo {
    /// A handle on the real file system.
    pub fn new() -> RealIo {
        RealIo
    }
}

/// An open file: positioned reads and writes on one descriptor, closed on drop.
#[derive(Debug)]
struct RealFile {
    fd: OwnedFd,
}

/// `position + done` for a transfer loop; a sum past `u64::MAX` is an invalid argument.
fn position_plus(position: u64, done: usize) -> IoResult<u64> {
    position
        .checked_add(done as u64)
        .ok_or(IoError::Os(Errno::INVAL))
}

impl IoFile for RealFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        let mut done = 0;
        // Each turn either moves at least one byte or was interrupted by a signal.
        while done < buf.len() {
            let at = position_plus(position, done)?;
            match rustix::io::pread(&self.fd, &mut buf[done..], at) {
                Ok(0) => return Err(IoError::ShortRead { read: done }),
                Ok(read) => done += read,
                // Interrupted by a signal before any byte moved: try again.
                Err(Errno::INTR) => {}
                Err(e) => return Err(IoError::Os(e)),
            }
        }
        Ok(())
    }

    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        let mut done = 0;
        // Each turn either moves at least one byte or was interrupted by a signal.
        while done < buf.len() {
            let at = position_plus(position, done)?;
            match rustix::io::pwrite(&self.fd, &buf[done..], at) {
                // pwrite never returns 0 for a non-empty buffer on a regular file; looping on it
                // would spin forever, so report it as an I/O error.
                Ok(0) => return Err(IoError::Os(Errno::IO)),
                Ok(written) => done += written,
                // Interrupted by a signal before any byte moved: try again.
                Err(Errno::INTR) => {}
                Err(e) => return Err(IoError::Os(e)),
            }
        }
        Ok(())
    }

    fn sync_data(&self) -> IoResult<()> {
        Ok(rustix::fs::fdatasync(&self.fd)?)
    }

    fn allocate(&self, len: u64) -> IoResult<()> {
        Ok(rustix::fs::fallocate(
            &self.fd,
            FallocateFlags::empty(),
            0,
            len,
        )?)
    }

    fn set_len(&self, len: u64) -> IoResult<()> {
        Ok(rustix::fs::ftruncate(&self.fd, len)?)
    }

    fn len(&self) -> IoResult<u64> {
        let stat = rustix::fs::fstat(&self.fd)?;
        u64::try_from(stat.st_size).map_err(|_| IoError::Os(Errno::OVERFLOW))
    }
}

impl Io for RealIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let flags = match mode {
            OpenMode::Existing => OFlags::RDWR | OFlags::CLOEXEC,
            OpenMode::CreateNew => OFlags::RDWR | OFlags::CLOEXEC | OFlags::CREATE | OFlags::EXCL,
        };
        let fd = rustix::fs::open(path, flags, Mode::from_raw_mode(FILE_MODE))?;
        Ok(Arc::new(RealFile { fd }))
    }

    fn create_dir_all(&self, path: &Path) -> IoResult<()> {
        Ok(std::fs::create_dir_all(path)?)
    }

    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(path)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    fn remove_file(&self, path: &Path) -> IoResult<()> {
        Ok(rustix::fs::unlink(path)?)
    }

    fn remove_dir(&self, path: &Path) -> IoResult<()> {
        Ok(rustix::fs::rmdir(path)?)
    }

    fn rename(&self, from: &Path, to: &Path) -> IoResult<()> {
        Ok(rustix::fs::rename(from, to)?)
    }

    fn sync_dir(&self, path: &Path) -> IoResult<()> {
        // IMPORTANT: a new, removed or renamed entry is durable only once its directory is fsynced.
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, Mode::empty())?;
        Ok(rustix::fs::fsync(&fd)?)
    }

    fn device_id(&self, path: &Path) -> IoResult<u64> {
        let stat = rustix::fs::stat(path)?;
        // `st_dev` is `u64` on x86_64 but a narrower integer on some targets, so the conversion is
        // useless only here: `#[expect]` would fail the build elsewhere.
        #[allow(clippy::useless_conversion)]
        let device = u64::from(stat.st_dev);
        Ok(device)
    }

    fn fs_stats(&self, path: &Path) -> IoResult<super::FsStats> {
        let stats = rustix::fs::statvfs(path)?;
        Ok(super::FsStats {
            total_bytes: stats.f_blocks.saturating_mul(stats.f_frsize),
            free_bytes: stats.f_bavail.saturating_mul(stats.f_frsize),
        })
    }

    fn exists(&self, path: &Path) -> IoResult<bool> {
        match rustix::fs::stat(path) {
            Ok(_) => Ok(true),
            // ENOTDIR: a component of the path is a file, so the path cannot exist either.
            Err(Errno::NOENT | Errno::NOTDIR) => Ok(false),
            Err(e) => Err(IoError::Os(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_io_covers_every_call_in_a_temp_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let io = RealIo::new();
        let dir = tmp.path().join("a/b");
        io.create_dir_all(&dir).unwrap();
        assert!(io.exists(&dir).unwrap());

        let path = dir.join("one");
        let missing = io.open(&path, OpenMode::Existing).unwrap_err();
        assert!(missing.is_not_found(), "{missing:?}");
        let file = io.open(&path, OpenMode::CreateNew).unwrap();
        let again = io.open(&path, OpenMode::CreateNew).unwrap_err();
        assert_eq!(again, IoError::Os(Errno::EXIST));

        file.write_all_at(b"hello world", 3).unwrap();
        assert_eq!(file.len().unwrap(), 14);
        let mut buf = [0xffu8; 14];
        file.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"\0\0\0hello world");
        let mut past = [0u8; 10];
        let short = file.read_exact_at(&mut past, 8).unwrap_err();
        assert_eq!(short, IoError::ShortRead { read: 6 });

        file.allocate(8192).unwrap();
        assert_eq!(file.len().unwrap(), 8192);
        file.set_len(100).unwrap();
        assert_eq!(file.len().unwrap(), 100);
        file.sync_data().unwrap();

        let renamed = dir.join("two");
        io.rename(&path, &renamed).unwrap();
        assert!(!io.exists(&path).unwrap());
        assert!(!io.exists(&renamed.join("below_a_file")).unwrap());
        io.sync_dir(&dir).unwrap();
        // The open descriptor follows the inode across the rename.
        file.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"\0\0\0hello world");

        let other = io.open(&dir.join("three"), OpenMode::CreateNew).unwrap();
        drop(other);
        assert_eq!(io.read_dir(&dir).unwrap(), vec!["three", "two"]);
        assert_eq!(io.device_id(&dir).unwrap(), io.device_id(&renamed).unwrap());
        assert!(io.device_id(&dir.join("nope")).unwrap_err().is_not_found());

        io.remove_file(&renamed).unwrap();
        io.remove_file(&dir.join("three")).unwrap();
        assert!(io.remove_file(&renamed).unwrap_err().is_not_found());
        assert!(io.read_dir(&dir).unwrap().is_empty());
        io.remove_dir(&dir).unwrap();
        assert!(!io.exists(&dir).unwrap());
        io.sync_dir(&tmp.path().join("a")).unwrap();
    }
}
