//! The commit workers: a bounded set of threads per file system serves every log of a pool.
//! Thread counts stay bounded however many logs there are, every log still commits in groups,
//! a stalled disk call of one log does not hold up the others while workers remain, the workers
//! leave with the pool, and `append_async` waits for room without blocking its thread and can be
//! cancelled.
//!
//! The tests of this file count the process's threads, so they run one at a time.

mod common;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use common::{payload, record, small_options};
use keratin_log::io::IoResult;
use keratin_log::{
    FsStats, Io, IoFile, Log, LogError, LogOptions, OpenMode, PoolOptions, SegmentPool, SimIo,
    RETAINED_BUFFERS_BYTES_MAX,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The process's threads that the log started (`keratin-commit`, `keratin-pool`), from
/// `/proc/self/task`: the test harness starts and ends threads of its own meanwhile.
fn threads_now() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| {
            let comm = task.ok()?.path().join("comm");
            std::fs::read_to_string(comm).ok()
        })
        .filter(|name| name.starts_with("keratin-"))
        .count()
}

/// Wait (bounded) until the process has at most `limit` threads; the last count seen.
fn settle_threads(limit: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = threads_now();
        if now <= limit || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A gate that `sync_data` of files under one directory waits at while it is closed.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    /// Syncs waiting at the gate now.
    waiting: AtomicUsize,
}

#[derive(Debug, Default)]
struct GateState {
    closed: Option<PathBuf>,
    /// Syncs let through with EIO (the ones waiting when `fail` opened the gate).
    failures: usize,
    /// Syncs of files under this directory are counted in `watched_syncs`.
    watched: Option<PathBuf>,
    watched_syncs: u64,
}

impl Gate {
    fn close(&self, under: &Path) {
        self.state.lock().expect("gate").closed = Some(under.to_path_buf());
    }

    fn open(&self) {
        self.state.lock().expect("gate").closed = None;
        self.changed.notify_all();
    }

    /// Open the gate, failing the syncs waiting at it with EIO.
    fn fail(&self) {
        let mut state = self.state.lock().expect("gate");
        state.closed = None;
        state.failures = self.waiting.load(Ordering::SeqCst);
        drop(state);
        self.changed.notify_all();
    }

    fn watch(&self, under: &Path) {
        self.state.lock().expect("gate").watched = Some(under.to_path_buf());
    }

    fn watched_syncs(&self) -> u64 {
        self.state.lock().expect("gate").watched_syncs
    }

    fn pass(&self, path: &Path) -> IoResult<()> {
        let mut state = self.state.lock().expect("gate");
        if state
            .watched
            .as_ref()
            .is_some_and(|dir| path.starts_with(dir))
        {
            state.watched_syncs += 1;
        }
        let mut counted = false;
        while state
            .closed
            .as_ref()
            .is_some_and(|dir| path.starts_with(dir))
        {
            if !counted {
                self.waiting.fetch_add(1, Ordering::SeqCst);
                counted = true;
            }
            state = self.changed.wait(state).expect("gate");
        }
        if counted {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            if state.failures > 0 {
                state.failures -= 1;
                return Err(std::io::Error::from_raw_os_error(5).into());
            }
        }
        Ok(())
    }

    /// Wait (bounded) until a sync waits at the gate.
    fn wait_for_stalled_sync(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.waiting.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "no sync reached the gate");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// `SimIo` whose `sync_data` counts, optionally takes some time like a disk, and waits at the
/// gate for the gated directory.
#[derive(Debug)]
struct TestIo {
    inner: SimIo,
    gate: Arc<Gate>,
    syncs: Arc<AtomicU64>,
    sync_time: Duration,
}

#[derive(Debug)]
struct TestFile {
    inner: Arc<dyn IoFile>,
    path: PathBuf,
    gate: Arc<Gate>,
    syncs: Arc<AtomicU64>,
    sync_time: Duration,
}

impl IoFile for TestFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.inner.read_exact_at(buf, position)
    }
    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.inner.write_all_at(buf, position)
    }
    fn sync_data(&self) -> IoResult<()> {
        self.gate.pass(&self.path)?;
        self.syncs.fetch_add(1, Ordering::SeqCst);
        if !self.sync_time.is_zero() {
            std::thread::sleep(self.sync_time);
        }
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

impl Io for TestIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let inner = self.inner.open(path, mode)?;
        Ok(Arc::new(TestFile {
            inner,
            path: path.to_path_buf(),
            gate: self.gate.clone(),
            syncs: self.syncs.clone(),
            sync_time: self.sync_time,
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

struct Node {
    sim: SimIo,
    io: Arc<dyn Io>,
    gate: Arc<Gate>,
    syncs: Arc<AtomicU64>,
    pool: SegmentPool,
}

const ROOT: &str = "/sim/node";

fn node(workers: usize, sync_time: Duration) -> Node {
    let sim = SimIo::new(common::seed(13));
    let gate = Arc::new(Gate::default());
    let syncs = Arc::new(AtomicU64::new(0));
    let io: Arc<dyn Io> = Arc::new(TestIo {
        inner: sim.clone(),
        gate: gate.clone(),
        syncs: syncs.clone(),
        sync_time,
    });
    io.create_dir_all(Path::new(ROOT)).expect("storage dir");
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: small_options().full_segment_size_bytes,
            commit_workers_per_filesystem: workers,
            ..PoolOptions::default()
        },
    );
    pool.add_storage_dir(Path::new(ROOT)).expect("pool dir");
    Node {
        sim,
        io,
        gate,
        syncs,
        pool,
    }
}

impl Node {
    fn open(&self, name: &str, options: LogOptions) -> Log {
        Log::open(
            self.io.clone(),
            &Path::new(ROOT).join(name),
            options,
            Some(self.pool.clone()),
        )
        .expect("open")
    }
}

#[test]
fn a_thousand_logs_share_the_workers_of_their_file_system() {
    let _serial = serial();
    let before = threads_now();
    let node = node(4, Duration::ZERO);
    // A second file system: its logs get a set of workers of their own.
    node.sim.set_device(Path::new("/sim/other"), 2);
    node.io
        .create_dir_all(Path::new("/sim/other"))
        .expect("second storage dir");
    let mut logs: Vec<Log> = (0..1000)
        .map(|i| node.open(&format!("log-{i}"), small_options()))
        .collect();
    // Every log busy at once: each gets a batch in before any is waited for.
    let tickets: Vec<_> = logs
        .iter()
        .enumerate()
        .map(|(i, log)| log.append(&[record(&payload(0, i as u32, 100))]))
        .collect::<Result<_, _>>()
        .expect("append");
    for ticket in tickets {
        assert_eq!(ticket.wait().expect("durable"), 0..1);
    }
    let commit_threads = node.pool.commit_threads();
    assert!(
        (1..=4).contains(&commit_threads),
        "{commit_threads} commit threads for 1,000 logs on one file system"
    );
    let extra = threads_now().saturating_sub(before);
    assert!(
        extra <= 4 + 1,
        "1,000 logs use {extra} extra threads; expected at most 4 commit workers + 1 pool worker"
    );
    for i in 0..10 {
        let other = Log::open(
            node.io.clone(),
            &Path::new("/sim/other").join(format!("log-{i}")),
            small_options(),
            Some(node.pool.clone()),
        )
        .expect("open on the second file system");
        other
            .append_sync(&[record(&payload(0, 0, 100))])
            .expect("append on the second file system");
        logs.push(other);
    }
    let commit_threads = node.pool.commit_threads();
    assert!(
        (2..=8).contains(&commit_threads),
        "{commit_threads} commit threads for two file systems"
    );
    assert!(threads_now().saturating_sub(before) <= 2 * 4 + 1);
    // Closing every log and dropping the pool ends the workers.
    for log in logs {
        log.close().expect("close");
    }
    drop(node);
    let after = settle_threads(before);
    assert!(
        after <= before,
        "{after} threads after the pool was dropped, {before} before"
    );
}

#[test]
fn idle_logs_keep_at_most_the_bound_of_buffers_together() {
    let _serial = serial();
    let io: Arc<dyn Io> = Arc::new(SimIo::new(common::seed(17)));
    io.create_dir_all(Path::new(ROOT)).expect("storage dir");
    let options = LogOptions {
        full_segment_size_bytes: 4 << 20,
        ..LogOptions::default()
    };
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: options.full_segment_size_bytes,
            commit_workers_per_filesystem: 2,
            ..PoolOptions::default()
        },
    );
    pool.add_storage_dir(Path::new(ROOT)).expect("pool dir");
    // 100 logs each see one burst of 1 MiB: kept, their buffers would hold about 200 MiB.
    let logs: Vec<Log> = (0..100)
        .map(|i| {
            let dir = Path::new(ROOT).join(format!("log-{i}"));
            Log::open(io.clone(), &dir, options.clone(), Some(pool.clone())).expect("open")
        })
        .collect();
    let burst: Vec<Vec<u8>> = (0..2).map(|i| payload(i, 0, 512 << 10)).collect();
    let records: Vec<_> = burst.iter().map(|p| record(p)).collect();
    let tickets: Vec<_> = logs
        .iter()
        .map(|log| log.append(&records))
        .collect::<Result<_, _>>()
        .expect("append");
    for ticket in tickets {
        assert_eq!(ticket.wait().expect("durable"), 0..2);
    }
    let kept = pool.retained_buffer_bytes();
    assert!(
        kept <= RETAINED_BUFFERS_BYTES_MAX,
        "idle logs keep {kept} bytes of buffers, past the bound of {RETAINED_BUFFERS_BYTES_MAX}"
    );
    assert!(kept > 0, "logs within the bound keep their buffers");
    // Logs that freed their buffers append as before.
    for log in &logs {
        assert_eq!(log.append_sync(&records).expect("append again"), 2..4);
    }
    assert!(pool.retained_buffer_bytes() <= RETAINED_BUFFERS_BYTES_MAX);
    for log in logs {
        log.close().expect("close");
    }
    assert_eq!(
        pool.retained_buffer_bytes(),
        0,
        "closed logs keep nothing counted"
    );
}

#[test]
fn dropping_pools_and_logs_leaves_no_thread_behind() {
    let _serial = serial();
    let before = threads_now();
    for round in 0..20u32 {
        let node = node(4, Duration::ZERO);
        let logs: Vec<Log> = (0..3)
            .map(|i| node.open(&format!("log-{i}"), small_options()))
            .collect();
        for log in &logs {
            log.append_sync(&[record(&payload(0, round, 64))])
                .expect("append");
        }
        // Some closed, some dropped, one outliving the pool's handle.
        let mut logs = logs.into_iter();
        logs.next().expect("log").close().expect("close");
        drop(logs.next());
        let last = logs.next().expect("log");
        drop(node);
        last.append_sync(&[record(&payload(1, round, 64))])
            .expect("the log keeps its pool alive");
        drop(last);
        // A log opened without a pool has a private one with one worker.
        let sim = SimIo::new(u64::from(round));
        let private = Log::open(
            Arc::new(sim),
            Path::new("/sim/private"),
            small_options(),
            None,
        )
        .expect("open");
        private
            .append_sync(&[record(&payload(0, round, 64))])
            .expect("append");
        assert_eq!(private.pool().commit_threads(), 1);
        drop(private);
    }
    let after = settle_threads(before);
    assert!(
        after <= before,
        "{after} threads after 20 pools came and went, {before} before"
    );
}

#[test]
fn concurrent_appenders_to_one_log_commit_in_groups() {
    let _serial = serial();
    // A sync that takes a while, like a disk's: appends arriving meanwhile form the next group.
    let node = node(4, Duration::from_millis(2));
    let log = Arc::new(node.open("busy", small_options()));
    let syncs_before = node.syncs.load(Ordering::SeqCst);
    let (appenders, per_appender) = (16u32, 40u32);
    let threads: Vec<_> = (0..appenders)
        .map(|a| {
            let log = log.clone();
            std::thread::spawn(move || {
                for i in 0..per_appender {
                    log.append_sync(&[record(&payload(0, a * 1000 + i, 200))])
                        .expect("append");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("appender");
    }
    let appends = u64::from(appenders * per_appender);
    let syncs = node.syncs.load(Ordering::SeqCst) - syncs_before;
    assert_eq!(log.durable_offset(), appends);
    eprintln!("{appends} appends from {appenders} threads, {syncs} syncs");
    assert!(
        syncs * 4 <= appends,
        "{syncs} syncs for {appends} appends from {appenders} threads: no group commit"
    );
}

#[test]
fn a_stalled_sync_of_one_log_does_not_hold_up_another() {
    let _serial = serial();
    let node = node(2, Duration::ZERO);
    let stalled = node.open("stalled", small_options());
    let other = node.open("other", small_options());
    node.gate.close(&Path::new(ROOT).join("stalled"));
    let stuck = stalled
        .append(&[record(&payload(0, 0, 100))])
        .expect("append");
    node.gate.wait_for_stalled_sync();
    // The stalled log's next appends queue behind its sync.
    let queued = stalled
        .append(&[record(&payload(1, 0, 100))])
        .expect("append");
    // One worker is stuck in the stalled log's sync; the other serves the other log. (Bounded:
    // with every worker stuck, the appends would wait for ever.)
    let other = Arc::new(other);
    let (done, finished) = std::sync::mpsc::channel();
    let appender = {
        let other = other.clone();
        std::thread::spawn(move || {
            for i in 0..50 {
                let offsets = other.append_sync(&[record(&payload(i, 0, 100))]);
                assert_eq!(offsets.expect("append to the other log"), i..i + 1);
            }
            let _ = done.send(());
        })
    };
    let served = finished.recv_timeout(Duration::from_secs(20));
    if served.is_err() {
        node.gate.open();
    }
    appender.join().expect("appender");
    assert!(
        served.is_ok(),
        "the other log's appends waited for the stalled sync"
    );
    let other = Arc::into_inner(other).expect("one handle");
    assert_eq!(
        stalled.durable_offset(),
        0,
        "the stalled sync has not returned"
    );
    node.gate.open();
    assert_eq!(stuck.wait().expect("durable after the stall"), 0..1);
    assert_eq!(queued.wait().expect("durable after the stall"), 1..2);
    stalled.close().expect("close");
    other.close().expect("close");
}

/// Counts its wake-ups.
#[derive(Debug, Default)]
struct CountingWaker(AtomicUsize);

impl CountingWaker {
    /// Wait (up to 10 s) until woken at least once; else fail with `what`.
    fn wait_woken(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.0.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn tight_options() -> LogOptions {
    LogOptions {
        max_pending_bytes: 4 << 10,
        ..small_options()
    }
}

/// A stalled log whose pending bytes are at the bound: the first batch is in the stalled sync,
/// the second waits behind it.
fn stalled_and_full(node: &Node, log: &Log) -> Vec<keratin_log::Ticket<std::ops::Range<u64>>> {
    node.gate.close(&Path::new(ROOT).join("tight"));
    let big = payload(0, 0, 3 << 10);
    let first = log.append(&[record(&big)]).expect("append");
    node.gate.wait_for_stalled_sync();
    let second = log.append(&[record(&big)]).expect("append");
    vec![first, second]
}

#[test]
fn a_cancelled_append_async_assigns_nothing_and_leaves_no_waker() {
    let _serial = serial();
    let node = node(4, Duration::ZERO);
    let log = node.open("tight", tight_options());
    let tickets = stalled_and_full(&node, &log);
    let big = payload(2, 0, 3 << 10);
    let batch = [record(&big)];
    let counter = Arc::new(CountingWaker::default());
    let waker = Waker::from(counter.clone());
    {
        let mut future = pin!(log.append_async(&batch));
        let mut cx = Context::from_waker(&waker);
        assert!(
            future.as_mut().poll(&mut cx).is_pending(),
            "no room: the append waits"
        );
        assert!(future.as_mut().poll(&mut cx).is_pending());
        // Dropped here, while waiting.
    }
    assert_eq!(
        log.next_offset(),
        2,
        "a cancelled append assigned no offset"
    );
    node.gate.open();
    for (i, ticket) in tickets.into_iter().enumerate() {
        let i = i as u64;
        assert_eq!(ticket.wait().expect("durable"), i..i + 1);
    }
    // The rounds that freed the room did not wake the cancelled append's waker.
    assert_eq!(counter.0.load(Ordering::SeqCst), 0);
    // The next append gets the next offset: no gap, no record of the cancelled one.
    assert_eq!(log.append_sync(&batch).expect("append"), 2..3);
    let read: Vec<u64> = log
        .reader(0)
        .map(|r| r.expect("read").offset)
        .collect::<Vec<_>>();
    assert_eq!(read, vec![0, 1, 2]);
    log.close().expect("close");
}

#[test]
fn a_waiting_append_async_is_woken_by_room_and_by_a_stop() {
    let _serial = serial();
    let node = node(4, Duration::ZERO);
    let log = node.open("tight", tight_options());
    let tickets = stalled_and_full(&node, &log);
    let big = payload(2, 0, 3 << 10);
    let batch = [record(&big)];
    let counter = Arc::new(CountingWaker::default());
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    let mut future = Box::pin(log.append_async(&batch));
    assert!(future.as_mut().poll(&mut cx).is_pending());
    node.gate.open();
    // The round that takes the second batch makes room and wakes the waiting append.
    counter.wait_woken("the waiting append was not woken");
    let ticket = match future.as_mut().poll(&mut cx) {
        Poll::Ready(result) => result.expect("queued"),
        Poll::Pending => panic!("woken, and room now, but still waiting"),
    };
    drop(future);
    for ticket in tickets {
        ticket.wait().expect("durable");
    }
    assert_eq!(ticket.wait().expect("durable"), 2..3);

    // Stalled and full again: a waiting append is woken by the stop when the sync fails, and
    // answered with it, having queued nothing.
    let tickets = stalled_and_full(&node, &log);
    let counter = Arc::new(CountingWaker::default());
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    let mut future = Box::pin(log.append_async(&batch));
    assert!(future.as_mut().poll(&mut cx).is_pending());
    node.gate.fail();
    counter.wait_woken("the stop did not wake the waiting append");
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(Err(error)) => assert!(error.is_stopped(), "{error}"),
        other => panic!("expected the stop, got {other:?}"),
    }
    drop(future);
    for ticket in tickets {
        assert!(ticket.wait().expect_err("the sync failed").is_stopped());
    }
    assert_eq!(log.next_offset(), 5, "the failed append assigned no offset");
    log.heal().expect("heal");
    assert_eq!(log.durable_offset(), 3);
    assert_eq!(log.append_sync(&batch).expect("append after heal"), 3..4);
    log.close().expect("close");
}

#[test]
fn append_async_waits_for_room_without_blocking_a_current_thread_runtime() {
    let _serial = serial();
    let node = node(4, Duration::ZERO);
    let log = Arc::new(node.open("tight", tight_options()));
    let gate = node.gate.clone();
    gate.close(&Path::new(ROOT).join("tight"));
    let (done, finished) = std::sync::mpsc::channel();
    let runtime_log = log.clone();
    // The runtime runs on a thread of its own so that a blocked runtime fails the test by
    // timing out instead of hanging it.
    let runtime = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let result = runtime.block_on(async move {
            let log = runtime_log;
            let appends = tokio::task::LocalSet::new();
            let result = appends
                .run_until(async {
                    let mut tasks = Vec::new();
                    for i in 0..8u32 {
                        let log = log.clone();
                        tasks.push(tokio::task::spawn_local(async move {
                            let big = payload(0, i, 3 << 10);
                            let ticket = log.append_async(&[record(&big)]).await?;
                            ticket.await
                        }));
                    }
                    // Only this task, on the same thread, opens the gate: if an append blocked
                    // the thread waiting for room, it would never run.
                    tokio::task::spawn_local(async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        gate.open();
                    });
                    let mut offsets = Vec::new();
                    for task in tasks {
                        offsets.push(task.await.expect("task")?);
                    }
                    Ok::<_, LogError>(offsets)
                })
                .await;
            result
        });
        let _ = done.send(result);
    });
    let mut offsets = finished
        .recv_timeout(Duration::from_secs(30))
        .expect("the appends finished: the runtime's thread was not blocked")
        .expect("appends");
    runtime.join().expect("runtime thread");
    offsets.sort_by_key(|r| r.start);
    let expected: Vec<_> = (0..8u64).map(|i| i..i + 1).collect();
    assert_eq!(offsets, expected);
    assert_eq!(log.durable_offset(), 8);
}

#[test]
fn a_busy_log_does_not_starve_another_on_one_worker() {
    let _serial = serial();
    // One worker, syncs of 2 ms, and a log kept busy by eight appenders: the worker must still
    // give the quiet log its turn after each round of the busy one.
    let node = node(1, Duration::from_millis(2));
    let busy = Arc::new(node.open("busy", small_options()));
    node.gate.watch(&Path::new(ROOT).join("busy"));
    let quiet = node.open("quiet", small_options());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(20);
    let appenders: Vec<_> = (0..8u32)
        .map(|a| {
            let (busy, stop) = (busy.clone(), stop.clone());
            std::thread::spawn(move || {
                // Four appends in flight each: the busy log always has work queued when a
                // round ends.
                let mut in_flight = std::collections::VecDeque::new();
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                    let ticket = busy.append(&[record(&payload(0, a * 100_000 + i, 200))]);
                    in_flight.push_back(ticket.expect("busy append"));
                    if in_flight.len() >= 4 {
                        let oldest = in_flight.pop_front().expect("a ticket");
                        oldest.wait().expect("busy append durable");
                    }
                    i += 1;
                }
                for ticket in in_flight {
                    ticket.wait().expect("busy append durable");
                }
            })
        })
        .collect();
    // Let the busy log's queue fill first.
    while busy.durable_offset() < 50 {
        assert!(Instant::now() < deadline, "the busy log made no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    let busy_syncs_before = node.gate.watched_syncs();
    let (done, finished) = std::sync::mpsc::channel();
    let quiet_appender = std::thread::spawn(move || {
        for i in 0..20 {
            let offsets = quiet.append_sync(&[record(&payload(i, 0, 100))]);
            assert_eq!(offsets.expect("quiet append"), i..i + 1);
        }
        let _ = done.send(());
        quiet
    });
    let served = finished.recv_timeout(Duration::from_secs(10));
    let waited = started.elapsed();
    let busy_syncs = node.gate.watched_syncs() - busy_syncs_before;
    stop.store(true, Ordering::SeqCst);
    for appender in appenders {
        appender.join().expect("busy appender");
    }
    let quiet = quiet_appender.join().expect("quiet appender");
    assert!(
        served.is_ok(),
        "the quiet log's 20 appends did not finish in 10 s beside a busy log"
    );
    eprintln!("20 quiet appends in {waited:?}, while the busy log synced {busy_syncs} times");
    // Each quiet append waits for at most the busy log's round in progress: a round syncs its
    // segment, and a roll adds a few syncs (the new segment, the directory).
    assert!(
        busy_syncs <= 20 * 4,
        "the busy log synced {busy_syncs} times while the quiet log made 20 appends"
    );
    quiet.close().expect("close");
}

#[test]
fn close_returns_after_every_earlier_append_is_answered() {
    let _serial = serial();
    // Several workers: a round's answers go out after its worker let go of the log, possibly
    // while another worker already runs the round with the close.
    let node = node(4, Duration::from_millis(1));
    let log = node.open("closing", small_options());
    let tickets: Vec<_> = std::thread::scope(|scope| {
        let appenders: Vec<_> = (0..16u32)
            .map(|a| {
                let log = &log;
                scope.spawn(move || {
                    (0..50u32)
                        .map(|i| {
                            log.append(&[record(&payload(0, a * 1000 + i, 100))])
                                .expect("append")
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        appenders
            .into_iter()
            .flat_map(|h| h.join().expect("appender"))
            .collect()
    });
    log.close().expect("close");
    let waker = Waker::from(Arc::new(CountingWaker::default()));
    let mut cx = Context::from_waker(&waker);
    for mut ticket in tickets {
        match Pin::new(&mut ticket).poll(&mut cx) {
            Poll::Ready(result) => {
                result.expect("durable before the close");
            }
            Poll::Pending => panic!("close returned before an earlier append was answered"),
        }
    }
}

/// Partition owners run `append_async` inside tasks a multi-threaded runtime may move between
/// threads: the future must be `Send`.
#[test]
fn the_append_async_future_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    let _serial = serial();
    let node = node(1, Duration::ZERO);
    let log = node.open("send", small_options());
    let bytes = payload(0, 0, 10);
    let batch = [record(&bytes)];
    let future = log.append_async(&batch);
    assert_send(&future);
    drop(future);
    assert_eq!(log.next_offset(), 0, "a future never polled queues nothing");
    log.close().expect("close");
}

/// Logs queued for the sleeping workers, one more than there are: the woken workers take the
/// first ones, whose syncs stall, and a further worker must start for the last. The set used
/// to start a worker only when none was idle at the push, so pushes made before the sleepers
/// woke saw them as idle and the last log waited behind the stalled syncs (found by the
/// broker's stalled-disk test under CPU load). Pushing from one thread, back to back, hits that
/// window in most rounds.
#[test]
fn logs_queued_beyond_the_idle_workers_start_another() {
    let _serial = serial();
    let mut rounds_in_the_window = 0;
    for round in 0..20 {
        let node = node(4, Duration::ZERO);
        let stalled: Vec<Log> = (0..3)
            .map(|i| node.open(&format!("stalled/{i}"), small_options()))
            .collect();
        let other = node.open("other", small_options());
        // Every log holds a segment already, and the workers sleep.
        for log in stalled.iter().chain([&other]) {
            log.append_sync(&[record(&payload(0, 0, 100))])
                .expect("first append");
        }
        std::thread::sleep(Duration::from_millis(20));
        // A worker that finished a sync may not have been counted idle yet when the next
        // append came, so under CPU load the first appends can start all four workers. Such a
        // round still checks that the other log is served; it just misses the window.
        let sleeping = node.pool.commit_threads();
        if sleeping < 4 {
            rounds_in_the_window += 1;
        }
        node.gate.close(&Path::new(ROOT).join("stalled"));
        let stuck: Vec<_> = stalled[..sleeping.min(3)]
            .iter()
            .map(|log| log.append(&[record(&payload(1, 0, 100))]).expect("append"))
            .collect();
        let served = other
            .append(&[record(&payload(1, 0, 100))])
            .expect("append");
        let (done, finished) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let _ = done.send(served.wait());
        });
        let result = finished.recv_timeout(Duration::from_secs(5));
        node.gate.open();
        waiter.join().expect("waiter");
        assert!(
            matches!(result, Ok(Ok(_))),
            "round {round}: with {sleeping} workers asleep, the other log waited behind the \
             stalled syncs: {result:?}"
        );
        for ticket in stuck {
            assert_eq!(ticket.wait().expect("durable after the stall"), 1..2);
        }
        for log in stalled {
            log.close().expect("close");
        }
        other.close().expect("close");
    }
    assert!(
        rounds_in_the_window > 0,
        "no round of 20 had fewer than 4 workers asleep: the window was never tested"
    );
}
