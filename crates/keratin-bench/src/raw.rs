//! The raw reference: what the file system does for the same workload with no engine at all.
//!
//! - Appends: one `pwrite` of a whole batch and one `fdatasync`, in a loop, into a file
//!   preallocated with `fallocate` like a Keratin segment (so both write into unwritten extents
//!   and both pay for converting them at each sync). The batch sizes are Keratin's: the records
//!   its group commit covered with each sync, replayed in order and cyclically. The payload
//!   alone is written (no record headers): the reference is the least work the disk can be asked.
//! - Reads: `pread` of 1 MiB chunks over the used bytes of the same segment files Keratin reads.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::io::Errno;

use crate::contender::{AppendRun, AppendWork, BenchResult, Contender, ReadRun, StoredLog};
use crate::page_cache::PageCache;

/// Bytes per `pread` of the raw sequential read; Keratin's readers read 1 MiB chunks too.
const READ_CHUNK_BYTES: usize = 1 << 20;

/// The raw `pwrite`+`fdatasync` / `pread` reference.
#[derive(Debug)]
pub struct Raw<'a> {
    /// Dropped before every read, if it can be.
    pub cache: &'a PageCache,
}

pub(crate) fn pwrite_all(fd: &OwnedFd, mut buf: &[u8], mut position: u64) -> BenchResult<()> {
    while !buf.is_empty() {
        match rustix::io::pwrite(fd, buf, position) {
            Ok(0) => return Err("pwrite wrote nothing".into()),
            Ok(written) => {
                buf = &buf[written..];
                position += written as u64;
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Read `[0, len)` of `path` in chunks; returns the bytes read.
pub(crate) fn pread_file(path: &Path, len: u64, buf: &mut [u8]) -> BenchResult<u64> {
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    let mut position = 0u64;
    while position < len {
        let want = (len - position).min(buf.len() as u64) as usize;
        match rustix::io::pread(&fd, &mut buf[..want], position) {
            Ok(0) => return Err(format!("{} ends before {len} bytes", path.display()).into()),
            Ok(read) => position += read as u64,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(position)
}

/// A fresh file of `len` preallocated bytes, synced with its directory entry, as Keratin prepares
/// a segment before it is used.
pub(crate) fn preallocated_file(path: &Path, len: u64) -> BenchResult<OwnedFd> {
    let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
    let fd = rustix::fs::open(path, flags, Mode::from_raw_mode(0o644))?;
    rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len)?;
    rustix::fs::fdatasync(&fd)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let dir_fd = rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
    rustix::fs::fsync(&dir_fd)?;
    Ok(fd)
}

impl Contender for Raw<'_> {
    fn name(&self) -> &'static str {
        "raw"
    }

    fn append(&self, work: &AppendWork<'_>) -> BenchResult<AppendRun> {
        let batches: &[u32] = if work.batches.is_empty() {
            &[1]
        } else {
            work.batches
        };
        let max_batch = batches.iter().copied().max().unwrap_or(1) as usize;
        let buf = vec![0x5a_u8; max_batch * work.record_bytes];
        let len = work.prealloc_bytes.max(buf.len() as u64);
        let fd = preallocated_file(&work.dir.join("raw.dat"), len)?;
        let mut run = AppendRun::default();
        let mut position = 0u64;
        let mut write_time = Duration::ZERO;
        let mut sync_time = Duration::ZERO;
        let began = Instant::now();
        for &batch in batches.iter().cycle() {
            let bytes = &buf[..batch as usize * work.record_bytes];
            if position + bytes.len() as u64 > len {
                position = 0;
                run.wraps += 1;
            }
            let write_began = Instant::now();
            pwrite_all(&fd, bytes, position)?;
            let sync_began = Instant::now();
            rustix::fs::fdatasync(&fd)?;
            let synced = Instant::now();
            write_time += sync_began - write_began;
            sync_time += synced - sync_began;
            let sync_ns = u64::try_from((synced - sync_began).as_nanos()).unwrap_or(u64::MAX);
            run.sync_latencies_ns.push(sync_ns);
            run.batches.push(batch);
            run.records += u64::from(batch);
            run.disk_bytes += bytes.len() as u64;
            position += bytes.len() as u64;
            if began.elapsed() >= work.duration {
                break;
            }
        }
        run.elapsed = began.elapsed();
        run.payload_bytes = run.records * work.record_bytes as u64;
        run.syncs = run.batches.len() as u64;
        run.writes = run.syncs;
        run.write_time = write_time;
        run.sync_time = sync_time;
        Ok(run)
    }

    fn read(&self, stored: &StoredLog) -> BenchResult<ReadRun> {
        self.cache.drop_caches()?;
        let mut buf = vec![0u8; READ_CHUNK_BYTES];
        let began = Instant::now();
        let mut read_bytes = 0u64;
        for (path, used) in &stored.segments {
            read_bytes += pread_file(path, *used, &mut buf)?;
        }
        Ok(ReadRun {
            log_bytes: stored.used_bytes(),
            read_bytes,
            records: 0,
            elapsed: began.elapsed(),
        })
    }

    fn recover(&self, stored: &StoredLog) -> BenchResult<ReadRun> {
        self.read(stored)
    }
}
