//! A reader bounded with `LogReader::until` returns the records before its end and reads no
//! more of the segment file than they need (within one index interval). Replicated partitions
//! read their log a few hundred records at a time, just behind the durable end (a follower
//! applying what was committed, a leader's replication streams): an unbounded reader read a
//! 1 MiB chunk (or up to the durable end) for each such read, several times the records
//! wanted, in a fresh 1 MiB buffer every time (issue 14's replicated publish profile: a follower
//! read 3.4 KB of its log per 1 KiB message). It fails if the bounded reader returns a record
//! at or past its end, or reads over one index interval and one record beyond what it returns.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{payload, record};
use keratin_log::{FsStats, Io, IoError, IoFile, Log, LogOptions, OpenMode, RealIo};

/// Index interval of the segment format (`docs/storage-format.md`): a bounded read may go this
/// far past its last record.
const INDEX_INTERVAL_BYTES: u64 = 16 << 10;

#[derive(Debug)]
struct CountingIo {
    inner: RealIo,
    read_bytes: Arc<AtomicU64>,
}

#[derive(Debug)]
struct CountingFile {
    inner: Arc<dyn IoFile>,
    read_bytes: Arc<AtomicU64>,
}

impl IoFile for CountingFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> Result<(), IoError> {
        self.read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.inner.read_exact_at(buf, position)
    }
    fn write_all_at(&self, buf: &[u8], position: u64) -> Result<(), IoError> {
        self.inner.write_all_at(buf, position)
    }
    fn sync_data(&self) -> Result<(), IoError> {
        self.inner.sync_data()
    }
    fn allocate(&self, len: u64) -> Result<(), IoError> {
        self.inner.allocate(len)
    }
    fn set_len(&self, len: u64) -> Result<(), IoError> {
        self.inner.set_len(len)
    }
    fn len(&self) -> Result<u64, IoError> {
        self.inner.len()
    }
}

impl Io for CountingIo {
    fn open(&self, path: &Path, mode: OpenMode) -> Result<Arc<dyn IoFile>, IoError> {
        Ok(Arc::new(CountingFile {
            inner: self.inner.open(path, mode)?,
            read_bytes: self.read_bytes.clone(),
        }))
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
fn a_bounded_reader_reads_only_what_its_records_need() {
    let dir = tempfile::tempdir().expect("temp dir");
    let read_bytes = Arc::new(AtomicU64::new(0));
    let io = Arc::new(CountingIo {
        inner: RealIo::new(),
        read_bytes: read_bytes.clone(),
    });
    let options = LogOptions {
        full_segment_size_bytes: 64 << 20,
        ..LogOptions::default()
    };
    let log = Log::open(io, dir.path(), options, None).expect("open");
    // 4,000 records of 1,000 bytes (4 MB) in one segment.
    let bodies: Vec<Vec<u8>> = (0..4_000u64).map(|i| payload(i, 0, 1_000)).collect();
    for chunk in bodies.chunks(500) {
        let records: Vec<_> = chunk.iter().map(|b| record(b)).collect();
        log.append_sync(&records).expect("append");
    }

    for (start, end) in [
        (100u64, 356u64),
        (1_000, 1_001),
        (3_700, 3_956),
        (3_990, 4_000),
    ] {
        read_bytes.store(0, Ordering::Relaxed);
        let read: Vec<_> = log
            .reader(start)
            .until(end)
            .map(|r| r.expect("read"))
            .collect();
        let offsets: Vec<u64> = read.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, (start..end).collect::<Vec<_>>(), "{start}..{end}");
        for r in &read {
            assert_eq!(r.payload, bodies[r.offset as usize]);
        }
        let needed: u64 = read.iter().map(|r| r.payload.len() as u64 + 64).sum();
        let read = read_bytes.load(Ordering::Relaxed);
        assert!(
            read <= needed + 2 * INDEX_INTERVAL_BYTES + 2_000,
            "{start}..{end}: read {read} bytes of the file for records of about {needed}"
        );
    }

    // Unbounded, it still reads to the durable end.
    let all = log.reader(3_000).count();
    assert_eq!(all, 1_000);
    // An end at or before the start returns nothing.
    assert_eq!(log.reader(50).until(50).count(), 0);
    log.close().expect("close");
}
