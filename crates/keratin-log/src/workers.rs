//! Commit workers: the threads that run the logs' group commits, a bounded set per file system,
//! shared by every log of a pool.
//!
//! A log with work is *scheduled*: it sits once in its file system's ready queue, or is being
//! processed by one worker (`State::scheduled`, under the log's lock, makes sure of both). A
//! worker takes the log at the front, runs one round of group commit for it
//! (`commit::run_round`: everything queued at that moment, one write and one sync) and puts it
//! at the back if more arrived meanwhile, then answers the round's appenders while another
//! worker may already run the log's next round. So a log still gets group commit (what arrives during
//! its sync is the next group), logs on one file system sync in parallel up to the worker
//! count, and a busy log gets one round per turn and never starves the others. The queue holds
//! each log at most once: it is bounded by the number of logs.
//!
//! Threads start lazily, up to `PoolOptions::commit_workers_per_filesystem` per file system, and
//! stay until the pool's last handle goes; then they exit.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::commit::{abandon_round, run_round};
use crate::error::{LogError, LogResult};
use crate::log::Shared;

/// The commit workers of one pool: a set per file system.
#[derive(Debug)]
pub(crate) struct CommitWorkers {
    per_filesystem: usize,
    sets: Mutex<HashMap<u64, Arc<WorkerSet>>>,
    /// Worker threads running, over every set.
    threads: Arc<AtomicUsize>,
}

/// The workers of one file system and its ready queue.
#[derive(Debug)]
pub(crate) struct WorkerSet {
    device: u64,
    max_threads: usize,
    queue: Mutex<Queue>,
    ready: Condvar,
    running: Arc<AtomicUsize>,
    /// Buffer capacity the idle logs of this file system keep between rounds; at most
    /// [`RETAINED_BUFFERS_BYTES_MAX`].
    retained_bytes: AtomicUsize,
}

/// Buffer capacity all the idle logs of one file system keep between their rounds, together.
/// A log keeps its buffers (up to 1 MiB each, three per log) to spare the next round its
/// allocations; past this bound a log that goes idle frees them instead. So 4,096 partitions
/// that each saw a burst hold 64 MiB between rounds, not 12 GiB: the buffers of rounds in
/// progress hold the appends waiting for them, which the node's publish budget bounds.
pub const RETAINED_BUFFERS_BYTES_MAX: usize = 64 << 20;

#[derive(Debug, Default)]
struct Queue {
    logs: VecDeque<Arc<Shared>>,
    threads: usize,
    idle: usize,
    shutdown: bool,
    handles: Vec<JoinHandle<()>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl CommitWorkers {
    pub(crate) fn new(per_filesystem: usize) -> CommitWorkers {
        CommitWorkers {
            per_filesystem: per_filesystem.max(1),
            sets: Mutex::new(HashMap::new()),
            threads: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The worker set of file system `device`, with at least one worker running (so that a log
    /// that opened can always be served; later workers start when work waits).
    pub(crate) fn set_for(&self, device: u64) -> LogResult<Arc<WorkerSet>> {
        let set = lock(&self.sets)
            .entry(device)
            .or_insert_with(|| {
                Arc::new(WorkerSet {
                    device,
                    max_threads: self.per_filesystem,
                    queue: Mutex::new(Queue::default()),
                    ready: Condvar::new(),
                    running: self.threads.clone(),
                    retained_bytes: AtomicUsize::new(0),
                })
            })
            .clone();
        let mut queue = lock(&set.queue);
        if queue.threads == 0 {
            set.spawn(&mut queue)?;
        }
        drop(queue);
        Ok(set)
    }

    /// Worker threads running, over every file system.
    pub(crate) fn threads(&self) -> usize {
        self.threads.load(Ordering::SeqCst)
    }

    /// Buffer capacity the idle logs keep between rounds, over every file system.
    pub(crate) fn retained_bytes(&self) -> usize {
        lock(&self.sets)
            .values()
            .map(|set| set.retained_bytes())
            .sum()
    }
}

impl Drop for CommitWorkers {
    /// The pool's last handle is gone, so no log uses these workers (each log holds the pool):
    /// tell them to exit and wait for them, except for the worker whose drop of a log's last
    /// reference brought us here (it exits when it returns to its loop).
    fn drop(&mut self) {
        let sets: Vec<Arc<WorkerSet>> = lock(&self.sets).drain().map(|(_, s)| s).collect();
        let me = std::thread::current().id();
        for set in sets {
            let handles = {
                let mut queue = lock(&set.queue);
                queue.shutdown = true;
                std::mem::take(&mut queue.handles)
            };
            set.ready.notify_all();
            for handle in handles {
                if handle.thread().id() == me {
                    continue;
                }
                if handle.join().is_err() {
                    tracing::error!(device = set.device, "log commit worker panicked");
                }
            }
        }
    }
}

impl WorkerSet {
    /// Count `bytes` of an idle log's buffers against [`RETAINED_BUFFERS_BYTES_MAX`]; false,
    /// counting nothing, when they do not fit (the log frees them).
    pub(crate) fn retain(&self, bytes: usize) -> bool {
        self.retained_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes)
                    .filter(|&total| total <= RETAINED_BUFFERS_BYTES_MAX)
            })
            .is_ok()
    }

    /// Stop counting `bytes` that [`WorkerSet::retain`] counted (the log works again, or is
    /// gone).
    pub(crate) fn unretain(&self, bytes: usize) {
        self.retained_bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Buffer capacity the idle logs of this file system keep.
    pub(crate) fn retained_bytes(&self) -> usize {
        self.retained_bytes.load(Ordering::Acquire)
    }

    /// Put a log that has work on the ready queue (the caller marked it scheduled) and wake a
    /// worker, starting one more if none is idle, `may_start` and the set is not full. A worker
    /// that puts back a log it just served and goes straight back to the queue passes false: it
    /// takes the next log itself.
    pub(crate) fn push(self: &Arc<Self>, log: Arc<Shared>, may_start: bool) {
        let mut queue = lock(&self.queue);
        queue.logs.push_back(log);
        // `idle` counts sleepers until they wake and take the lock: a sleeper already woken
        // for an earlier push is still counted. So start a worker whenever the queued logs
        // outnumber the sleepers, else a log can wait behind another's stalled sync.
        let short = queue.logs.len() > queue.idle;
        if short && may_start && queue.threads < self.max_threads && !queue.shutdown {
            // Failing to start a further worker only costs parallelism: the set has one.
            if let Err(error) = self.spawn(&mut queue) {
                tracing::warn!(device = self.device, %error, "starting a commit worker failed");
            }
        }
        if queue.idle > 0 {
            drop(queue);
            self.ready.notify_one();
        }
    }

    fn spawn(self: &Arc<Self>, queue: &mut Queue) -> LogResult<()> {
        let set = self.clone();
        let handle = std::thread::Builder::new()
            .name("keratin-commit".into())
            .spawn(move || set.work())
            .map_err(|e| LogError::io("spawn commit worker", ".", e.into()))?;
        queue.threads += 1;
        queue.handles.push(handle);
        self.running.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn work(self: Arc<Self>) {
        loop {
            let log = {
                let mut queue = lock(&self.queue);
                loop {
                    if let Some(log) = queue.logs.pop_front() {
                        break log;
                    }
                    if queue.shutdown {
                        queue.threads -= 1;
                        self.running.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                    queue.idle += 1;
                    queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner());
                    queue.idle -= 1;
                }
            };
            if std::panic::catch_unwind(AssertUnwindSafe(|| run_round(&log))).is_err() {
                abandon_round(&log);
            }
        }
    }
}
