//! The node-wide log figures a pool keeps for metrics: every sync of a commit thread lands in
//! the sync histogram (counted against the syncs the disk saw), a failed fsync counts one stop
//! and a heal counts one heal, across the logs sharing the pool.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{payload, record, small_options};
use keratin_log::io::IoResult;
use keratin_log::{FsStats, Io, IoFile, Log, OpenMode, PoolOptions, SegmentPool, SimFault, SimIo};

/// `SimIo` that counts the syncs (`sync_data` and `sync_dir`) asked of it.
#[derive(Debug)]
struct SyncCounting {
    inner: SimIo,
    syncs: Arc<AtomicU64>,
}

#[derive(Debug)]
struct SyncCountingFile {
    inner: Arc<dyn IoFile>,
    syncs: Arc<AtomicU64>,
}

impl IoFile for SyncCountingFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.inner.read_exact_at(buf, position)
    }
    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.inner.write_all_at(buf, position)
    }
    fn sync_data(&self) -> IoResult<()> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
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

impl Io for SyncCounting {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let inner = self.inner.open(path, mode)?;
        Ok(Arc::new(SyncCountingFile {
            inner,
            syncs: self.syncs.clone(),
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
        self.syncs.fetch_add(1, Ordering::SeqCst);
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

/// Two logs sharing one pool over a sync-counting simulated disk.
struct Node {
    sim: SimIo,
    syncs: Arc<AtomicU64>,
    pool: SegmentPool,
    logs: [Log; 2],
}

fn node(seed: u64) -> Node {
    let sim = SimIo::new(seed);
    let syncs = Arc::new(AtomicU64::new(0));
    let io: Arc<dyn Io> = Arc::new(SyncCounting {
        inner: sim.clone(),
        syncs: syncs.clone(),
    });
    let root = PathBuf::from("/sim/node");
    io.create_dir_all(&root).expect("storage dir");
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: small_options().full_segment_size_bytes,
            background: false,
            ..PoolOptions::default()
        },
    );
    pool.add_storage_dir(&root).expect("pool dir");
    let open = |name: &str| {
        Log::open(
            io.clone(),
            &root.join(name),
            small_options(),
            Some(pool.clone()),
        )
        .expect("open")
    };
    let logs = [open("a"), open("b")];
    Node {
        sim,
        syncs,
        pool,
        logs,
    }
}

#[test]
fn every_commit_sync_lands_in_the_histogram_of_the_shared_pool() {
    let node = node(common::seed(5));
    let syncs_before = node.syncs.load(Ordering::SeqCst);
    let histogram_before = node.pool.sync_histogram();
    // 2 000-byte records in 256 KiB segments: 400 appends roll each log a few times, so the
    // syncs of new segments and of the directory are in the count too.
    for offset in 0..200 {
        for log in &node.logs {
            let body = payload(offset, 0, 2000);
            log.append_sync(&[record(&body)]).expect("append");
        }
    }
    assert!(node.logs[0].stats().segments.len() > 1, "the logs rolled");
    let syncs = node.syncs.load(Ordering::SeqCst) - syncs_before;
    let histogram = node.pool.sync_histogram();
    let counted = histogram.count() - histogram_before.count();
    assert!(
        syncs >= 400,
        "one sync per acknowledged append at least, saw {syncs}"
    );
    assert_eq!(
        counted, syncs,
        "every sync the disk saw is in the histogram"
    );
    assert!(histogram.sum_nanos > histogram_before.sum_nanos);
    let cumulative = histogram.cumulative_seconds();
    assert!(cumulative
        .windows(2)
        .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    assert!(cumulative
        .last()
        .is_some_and(|(_, c)| *c <= histogram.count()));
    assert_eq!(node.pool.counters().log_stops, 0);
    assert_eq!(node.pool.counters().log_heals, 0);
}

#[test]
fn a_failed_fsync_counts_one_stop_and_a_heal_one_heal() {
    let node = node(common::seed(6));
    let [a, b] = &node.logs;
    for offset in 0..5 {
        a.append_sync(&[record(&payload(offset, 0, 900))])
            .expect("append a");
        b.append_sync(&[record(&payload(offset, 0, 900))])
            .expect("append b");
    }
    let syncs_before = node.syncs.load(Ordering::SeqCst);
    let histogram_before = node.pool.sync_histogram().count();
    // The log is idle: its next batch is one write, then the sync that fails.
    node.sim.fail_at(node.sim.steps() + 1, SimFault::Eio);
    let error = a
        .append_sync(&[record(b"lost")])
        .expect_err("the sync failed");
    assert!(
        matches!(&error, keratin_log::LogError::Stopped { op, .. } if *op == "sync"),
        "the fsync failed, not the write: {error:?}"
    );
    // A refused append on the stopped log is no second stop.
    assert!(a.append_sync(&[record(b"refused")]).is_err());
    let counters = node.pool.counters();
    assert_eq!((counters.log_stops, counters.log_heals), (1, 0));
    let failed_syncs = node.syncs.load(Ordering::SeqCst) - syncs_before;
    assert_eq!(failed_syncs, 1, "the batch's one sync, and it failed");
    assert_eq!(
        node.pool.sync_histogram().count() - histogram_before,
        failed_syncs,
        "the failed sync is timed too"
    );
    a.heal().expect("heal");
    // Healing a running log does nothing and counts nothing.
    a.heal().expect("heal a running log");
    b.heal().expect("heal a running log");
    let counters = node.pool.counters();
    assert_eq!((counters.log_stops, counters.log_heals), (1, 1));
    a.append_sync(&[record(b"after")])
        .expect("append after heal");
}
