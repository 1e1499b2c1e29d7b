//! `NodeLimits`: the node's resource limits at run time. It samples every storage file system
//! (spare files counted as free) and the process's memory on a timer and after segment rolls,
//! feeds the levels (`keratin-limits`), releases spares at the soft disk level, and answers the
//! partitions' [`PublishGate`] questions from the last sample — never sampling inside a request.
//! Each sample round also raises and clears the node's [`Attention`] items: level changes, full
//! queues, stopped and healed logs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use keratin_broker::{Broker, GateDecision, PublishGate};
use keratin_cluster::ClusterLevels;
use keratin_limits::{
    discover_limit, read_resident_bytes, sample_filesystem, Decision, DeviceId, DiskSample, Level,
    LevelChange, LimitSource, LimitsSettings, MemoryClaims, MemoryLimit, MemorySample, Monitor,
    Reason, SystemRoots,
};
use keratin_log::SegmentPool;

use crate::history::FreeSpaceHistory;
use crate::time_to_full::Projection;
use serde_json::{json, Value};
use tokio::sync::{watch, Notify};

use crate::attention::{Attention, AttentionKind, Raise, Severity};

mod cursors;
mod damaged;
mod filling;
mod replicas;

/// A storage file system: its device and the storage directories on it.
#[derive(Debug, Clone)]
pub struct Filesystem {
    /// Device id.
    pub device: u64,
    /// The first storage directory on it (what statvfs is asked about).
    pub path: PathBuf,
}

/// Publishes delayed and rejected, by reason, since start.
#[derive(Debug, Default)]
pub struct PublishCounters {
    /// Delayed for disk.
    pub delayed_disk: AtomicU64,
    /// Delayed for memory.
    pub delayed_memory: AtomicU64,
    /// Rejected for disk.
    pub rejected_disk: AtomicU64,
    /// Rejected for memory.
    pub rejected_memory: AtomicU64,
    /// Of the delayed ones, those delayed for another node's level (an in-sync replica's).
    pub delayed_for_replica: AtomicU64,
    /// Of the rejected ones, those rejected for another node's level.
    pub rejected_for_replica: AtomicU64,
}

impl PublishCounters {
    /// A publish batch delayed, for memory or for disk.
    fn delayed(&self, memory: bool) {
        let counter = if memory {
            &self.delayed_memory
        } else {
            &self.delayed_disk
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A publish batch rejected for `reason`.
    fn rejected(&self, reason: Reason) {
        let counter = match reason {
            Reason::Disk => &self.rejected_disk,
            _ => &self.rejected_memory,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The node's resource limits.
#[derive(Debug)]
pub struct NodeLimits {
    monitor: Mutex<Monitor>,
    filesystems: Vec<Filesystem>,
    /// Set once the broker is open (the pool lives in it).
    pool: OnceLock<SegmentPool>,
    broker: OnceLock<Broker>,
    /// `storage.max_bytes` in force (0 = no node budget); a runtime setting.
    max_bytes: AtomicU64,
    memory_limit: MemoryLimit,
    roots: SystemRoots,
    nudge: Notify,
    /// Counters for metrics.
    pub counters: PublishCounters,
    attention: Attention,
    /// Queues at their limit at the last sample.
    full_queues: Mutex<BTreeSet<String>>,
    /// Stream cursors (`stream/cursor`) behind their partitions' start, as last raised.
    cursors_behind: Mutex<BTreeSet<String>>,
    /// The storage directories, as configured (each may hold a `damaged/` directory).
    storage_dirs: Vec<PathBuf>,
    /// Each `damaged/` directory's entries at the last sample, those with any (`damaged.rs`).
    damaged: Mutex<BTreeMap<PathBuf, Vec<String>>>,
    /// Recent free space per file system, for the dashboard's plot.
    history: FreeSpaceHistory,
    /// Each partition log's stop figures at the last sample, by directory.
    stopped_logs: Mutex<BTreeMap<String, LogFigures>>,
    /// Each queue's dead-letter failures at the last sample, and when they last grew.
    dead_letter_failures: Mutex<BTreeMap<String, DeadLetterFigures>>,
    /// In a cluster: every node's reported levels (`replicas.rs`).
    cluster_levels: OnceLock<ClusterLevels>,
    /// Counts sample rounds, so that a cluster node reports each one at once.
    sampled: watch::Sender<u64>,
    /// File systems with an active `disk_filling` item (`filling.rs`).
    filling: filling::Filling,
    /// Each file system's largest queues for the node's report, and when they were counted
    /// (`replicas.rs`: counted at most every few seconds, as listing every queue costs).
    largest_queues: Mutex<Option<(std::time::Instant, Vec<Vec<keratin_limits::QueueUsage>>)>>,
    /// Memory claimed by connections, large frames and consumers before they take it, decided
    /// against each memory sample.
    claims: Arc<MemoryClaims>,
}

/// A queue's dead-letter failures as the sampler last saw them.
#[derive(Debug, Default, Clone, Copy)]
struct DeadLetterFigures {
    total: u64,
    grew_at_ms: u64,
}

/// A `dead_letter_failed` item clears after this long without a new failure: the failures are
/// events, not a state the sampler can see end, and ten minutes is long enough for an operator
/// who looks at the active items every few minutes to see it (the history keeps it after).
const DEAD_LETTER_QUIET_MS: u64 = 10 * 60 * 1000;

/// A partition log's stop figures at one sample.
#[derive(Debug, Default, Clone, Copy)]
struct LogFigures {
    stops: u64,
    heals: u64,
    stopped: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

impl NodeLimits {
    /// Limits over the storage directories `dirs`, with `settings`, an optional node storage
    /// budget (`max_bytes`, 0 = none) and the memory limit discovered now.
    pub fn new(
        dirs: &[PathBuf],
        settings: LimitsSettings,
        max_bytes: u64,
    ) -> Result<NodeLimits, String> {
        let roots = SystemRoots::host();
        let memory_limit = discover_limit(&roots, settings.memory.limit_bytes)
            .map_err(|e| format!("memory limit: {e}"))?;
        let mut filesystems: Vec<Filesystem> = Vec::new();
        for dir in dirs {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("storage directory {}: {e}", dir.display()))?;
            let sample = sample_filesystem(dir).map_err(|e| e.to_string())?;
            if !filesystems.iter().any(|f| f.device == sample.device.0) {
                filesystems.push(Filesystem {
                    device: sample.device.0,
                    path: std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone()),
                });
            }
        }
        let monitor = Monitor::new(settings).map_err(|e| e.to_string())?;
        let first = filesystems
            .first()
            .ok_or("no storage directory is configured (storage.dirs)")?;
        let attention = Attention::open(&first.path);
        Ok(NodeLimits {
            monitor: Mutex::new(monitor),
            filesystems,
            pool: OnceLock::new(),
            broker: OnceLock::new(),
            max_bytes: AtomicU64::new(max_bytes),
            memory_limit,
            roots,
            nudge: Notify::new(),
            counters: PublishCounters::default(),
            attention,
            full_queues: Mutex::new(BTreeSet::new()),
            cursors_behind: Mutex::new(BTreeSet::new()),
            storage_dirs: dirs.to_vec(),
            damaged: Mutex::new(BTreeMap::new()),
            history: FreeSpaceHistory::new(),
            stopped_logs: Mutex::new(BTreeMap::new()),
            dead_letter_failures: Mutex::new(BTreeMap::new()),
            cluster_levels: OnceLock::new(),
            sampled: watch::Sender::new(0),
            filling: Mutex::new(BTreeSet::new()),
            largest_queues: Mutex::new(None),
            claims: MemoryClaims::new(),
        })
    }

    /// Connect the broker (for spare and used bytes) once it is open.
    pub fn attach(&self, broker: &Broker) {
        let _ = self.pool.set(broker.pool().clone());
        let _ = self.broker.set(broker.clone());
    }

    /// The node's memory claims (connections, large frames and consumers take memory through
    /// them).
    pub fn memory_claims(&self) -> &Arc<MemoryClaims> {
        &self.claims
    }

    /// The memory limit the levels are computed from.
    pub fn memory_limit_bytes(&self) -> u64 {
        self.memory_limit.limit_bytes
    }

    /// The storage file systems.
    pub fn filesystems(&self) -> &[Filesystem] {
        &self.filesystems
    }

    /// The settings in force.
    pub fn settings(&self) -> LimitsSettings {
        lock(&self.monitor).settings().clone()
    }

    /// Replace the settings (validated first); they apply from the next sample.
    pub fn set_settings(&self, settings: LimitsSettings) -> Result<(), String> {
        lock(&self.monitor)
            .set_settings(settings)
            .map_err(|e| e.to_string())?;
        self.nudge.notify_one();
        Ok(())
    }

    /// Change the node storage budget (`storage.max_bytes`, 0 = none); applies from the next
    /// sample, which this starts.
    pub fn set_max_bytes(&self, max_bytes: u64) {
        self.max_bytes.store(max_bytes, Ordering::Relaxed);
        self.nudge.notify_one();
    }

    /// The node's attention items.
    pub fn attention(&self) -> &Attention {
        &self.attention
    }

    /// After the first sample round with the broker attached: clear the attention items
    /// carried over a restart whose cause that round did not find again.
    pub fn settle_attention(&self) {
        self.attention.settle();
    }

    /// Bytes Keratin itself uses on disk: partitions' logs and spare files (for the budget).
    fn used_bytes(&self) -> u64 {
        let logs: u64 = self
            .broker
            .get()
            .map_or(0, |b| b.list().iter().map(|q| q.disk_bytes()).sum());
        let spares: u64 = self.pool.get().map_or(0, |pool| {
            pool.filesystems().iter().map(|f| f.spare_bytes).sum()
        });
        logs + spares
    }

    /// Take one sample of every file system and of memory, and act on level changes.
    pub fn sample(&self) {
        self.attention.retry_save();
        self.check_full_queues();
        self.check_cursors_behind();
        self.check_damaged_copies();
        self.check_stopped_logs();
        self.check_dead_letter_failures(now_ms());
        let max_bytes = self.max_bytes.load(Ordering::Relaxed);
        let used = if max_bytes > 0 { self.used_bytes() } else { 0 };
        for fs in &self.filesystems {
            let filesystem = match sample_filesystem(&fs.path) {
                Ok(sample) => sample,
                Err(error) => {
                    tracing::warn!(path = %fs.path.display(), %error, "cannot sample the file system");
                    continue;
                }
            };
            let spare = self.pool.get().map_or(0, |p| p.spare_bytes(fs.device));
            let sample = DiskSample::new(&filesystem, spare).within_budget(max_bytes, used);
            let at_ms = now_ms();
            self.history
                .record(fs.device, at_ms, sample.effective_free_bytes());
            let change = lock(&self.monitor).observe_disk(DeviceId(fs.device), sample, at_ms);
            let level = lock(&self.monitor).disk_level(DeviceId(fs.device));
            if level.is_some_and(|l| l >= Level::Soft) && spare > 0 {
                self.release_spares(fs);
            }
            if let Some(change) = change {
                self.report(&change, Some(fs));
            }
            self.check_filling(fs);
        }
        match read_resident_bytes(
            &self.roots.proc_dir,
            keratin_limits::memory::page_size_bytes(),
        ) {
            Ok(resident_bytes) => {
                let sample = MemorySample {
                    resident_bytes,
                    limit_bytes: self.memory_limit.limit_bytes,
                };
                let change = lock(&self.monitor).observe_memory(
                    sample,
                    self.memory_limit.source.clone(),
                    now_ms(),
                );
                if let Some(change) = change {
                    self.report(&change, None);
                }
                self.observe_claims(resident_bytes);
                // Every sample, not only under pressure: after a burst the allocator would keep
                // the freed buffers resident until the next one (issue 9's memory case: 19.1 MB
                // before, 17.4 MB after, holding a million queued messages after a 200 k msg/s
                // burst). A trim walks the free lists once a sampling interval.
                return_free_memory();
            }
            Err(error) => tracing::warn!(%error, "cannot read resident memory"),
        }
    }

    /// Give the memory claims the sample just taken: resident bytes, the limit, and the retry
    /// hint of memory at hard.
    fn observe_claims(&self, resident_bytes: u64) {
        let retry_after_ms = lock(&self.monitor)
            .admission()
            .retry_after_ms(Reason::Memory, Level::Hard);
        self.claims.observe(
            resident_bytes,
            self.memory_limit.limit_bytes,
            retry_after_ms,
        );
    }

    /// Raise an attention item when a queue reaches its limit (and note when it has room again).
    fn check_full_queues(&self) {
        let Some(broker) = self.broker.get() else {
            return;
        };
        let now: std::collections::BTreeSet<String> = broker
            .list()
            .into_iter()
            .filter(|q| q.partitions.iter().any(|p| p.full))
            .map(|q| q.name)
            .collect();
        let mut before = lock(&self.full_queues);
        for name in now.difference(&before) {
            let message = format!(
                "queue {name} is full: publishes are refused with queue_full (or drop its oldest \
                 messages); consume, or raise its max_messages / max_bytes"
            );
            tracing::warn!("{message}");
            self.attention.raise(Raise {
                kind: AttentionKind::QueueFull,
                subject: name.clone(),
                severity: Severity::Warning,
                level: None,
                message,
            });
        }
        for name in before.difference(&now) {
            tracing::info!("queue {name} has room again");
            self.attention.clear(AttentionKind::QueueFull, name);
        }
        *before = now;
    }

    /// Raise an attention item for each partition log that stopped, clear it and note the
    /// heal once it runs again. The partitions count their stops and heals, so a log that
    /// stopped and healed between two samples (the owner heals at once when the disk works)
    /// still leaves both in the history.
    fn check_stopped_logs(&self) {
        let Some(broker) = self.broker.get() else {
            return;
        };
        // Every log of the node: each queue's and stream's partition's, and the metadata log.
        let mut logs: Vec<(String, LogFigures, String, &str)> = Vec::new();
        for queue in broker.list() {
            for partition in &queue.partitions {
                let figures = LogFigures {
                    stops: partition.stops,
                    heals: partition.heals,
                    stopped: partition.stopped,
                };
                let what = format!("queue {} partition {}", queue.name, partition.index);
                let effect = "its publishes are refused";
                logs.push((partition.dir.display().to_string(), figures, what, effect));
            }
        }
        for stream in broker.list_streams() {
            for (index, (partition, dir)) in stream
                .partitions
                .iter()
                .zip(&stream.partition_dirs)
                .enumerate()
            {
                let figures = LogFigures {
                    stops: partition.stops,
                    heals: partition.heals,
                    stopped: partition.stopped,
                };
                let what = format!("stream {} partition {index}", stream.name);
                let effect = "its publishes are refused; reading it goes on";
                logs.push((dir.display().to_string(), figures, what, effect));
            }
        }
        let meta = broker.metadata_log();
        let figures = LogFigures {
            stops: meta.stops,
            heals: meta.heals,
            stopped: meta.stopped,
        };
        logs.push((
            meta.dir.display().to_string(),
            figures,
            "the node's metadata".into(),
            "declaring queues and changing settings wait; deleting queues works",
        ));
        let mut seen = lock(&self.stopped_logs);
        let mut now = BTreeMap::new();
        for (dir, figures, what, effect) in logs {
            let before = seen.get(&dir).copied().unwrap_or_default();
            if figures.stops > before.stops || (figures.stopped && !before.stopped) {
                let message = format!(
                    "the log of {what} ({dir}) stopped after a failed write or sync: {effect}; \
                     the broker heals it once its file system has room again; check the disk \
                     and the broker's log for the error"
                );
                tracing::error!("{message}");
                self.attention.raise(Raise {
                    kind: AttentionKind::LogStopped,
                    subject: dir.clone(),
                    severity: Severity::Critical,
                    level: None,
                    message,
                });
            }
            let healed = figures.heals > before.heals || (before.stopped && !figures.stopped);
            if healed && !figures.stopped {
                self.attention.clear(AttentionKind::LogStopped, &dir);
                self.attention.note(Raise {
                    kind: AttentionKind::LogHealed,
                    subject: dir.clone(),
                    severity: Severity::Info,
                    level: None,
                    message: format!("the log of {what} ({dir}) was healed and works again"),
                });
            }
            now.insert(dir, figures);
        }
        // A deleted queue's logs are gone, and with them the cause of their items.
        for dir in seen.keys().filter(|dir| !now.contains_key(*dir)) {
            self.attention.clear(AttentionKind::LogStopped, dir);
        }
        *seen = now;
    }

    /// Raise an attention item when a queue's dead-letter copies failed (each failed attempt
    /// of a message is counted by the partitions; the message waits and is tried again); clear
    /// it after a quiet spell, or when the queue is gone.
    fn check_dead_letter_failures(&self, now_ms: u64) {
        let Some(broker) = self.broker.get() else {
            return;
        };
        let mut seen = lock(&self.dead_letter_failures);
        let mut now = BTreeMap::new();
        for queue in broker.list() {
            let failures = queue.dead_letter_failures();
            let total: u64 = failures.values().sum();
            let mut figures = seen.get(&queue.name).copied().unwrap_or_default();
            if total > figures.total {
                let reasons: Vec<String> = failures
                    .iter()
                    .map(|(reason, count)| format!("{count} {}", reason.as_str()))
                    .collect();
                let target = queue.settings.dead_letter.clone().unwrap_or_default();
                let held: u64 = queue.partitions.iter().map(|p| p.dead_letters_held).sum();
                let message = format!(
                    "queue {}: {total} dead-letter copies to {target:?} failed since start ({}); \
                     {held} messages wait in the queue on this node and are tried again (every \
                     5 s at most) until it takes them; declare the dead-letter queue, give it \
                     room, or change the queue's dead_letter",
                    queue.name,
                    reasons.join(", ")
                );
                tracing::warn!("{message}");
                self.attention.raise(Raise {
                    kind: AttentionKind::DeadLetterFailed,
                    subject: queue.name.clone(),
                    severity: Severity::Warning,
                    level: None,
                    message,
                });
                figures = DeadLetterFigures {
                    total,
                    grew_at_ms: now_ms,
                };
            } else if figures.grew_at_ms > 0
                && now_ms.saturating_sub(figures.grew_at_ms) >= DEAD_LETTER_QUIET_MS
            {
                self.attention
                    .clear(AttentionKind::DeadLetterFailed, &queue.name);
                figures.grew_at_ms = 0;
            }
            now.insert(queue.name.clone(), figures);
        }
        for name in seen.keys().filter(|name| !now.contains_key(*name)) {
            self.attention.clear(AttentionKind::DeadLetterFailed, name);
        }
        *seen = now;
    }

    /// At soft and deeper, spare segment files go first: they are free space held back.
    fn release_spares(&self, fs: &Filesystem) {
        if let Some(pool) = self.pool.get() {
            match pool.release(fs.device, 0) {
                Ok(bytes) if bytes > 0 => {
                    tracing::info!(path = %fs.path.display(), released_mib = mib(bytes), "released spare segments under disk pressure");
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "releasing spares failed"),
            }
        }
    }

    fn report(&self, change: &LevelChange, fs: Option<&Filesystem>) {
        let what = match (change, fs) {
            (
                LevelChange::Disk {
                    from,
                    to,
                    free_bytes,
                    total_bytes,
                    ..
                },
                Some(fs),
            ) => format!(
                "disk level {from} -> {to} on {} ({} MiB free of {} MiB){}",
                fs.path.display(),
                mib(*free_bytes),
                mib(*total_bytes),
                self.top_queues_text(fs.device),
            ),
            _ => change.to_string(),
        };
        if change.to() > change.from() {
            tracing::warn!("{what}");
        } else {
            tracing::info!("{what}");
        }
        let (kind, subject) = match (change, fs) {
            (LevelChange::Disk { .. }, Some(fs)) => {
                (AttentionKind::DiskLevel, fs.path.display().to_string())
            }
            _ => (AttentionKind::MemoryLevel, "memory".to_string()),
        };
        let to = change.to();
        if to == Level::Normal {
            self.attention.clear(kind, &subject);
            return;
        }
        let advice = match (kind, to) {
            (AttentionKind::DiskLevel, Level::Soft) => {
                "publishers are slowed and spare segments released; consume or purge the largest \
                 queues, or free or add space"
            }
            (AttentionKind::DiskLevel, _) => {
                "publishes are refused with ERR_LIMITED; consume or purge the largest queues, or \
                 free or add space now"
            }
            (_, Level::Soft) => {
                "publishers are slowed; consume faster, publish less, or raise the memory limit"
            }
            _ => {
                "publishes are refused with ERR_LIMITED; consume faster, publish less, or raise \
                 the memory limit"
            }
        };
        self.attention.raise(Raise {
            kind,
            subject,
            severity: if to == Level::Soft {
                Severity::Warning
            } else {
                Severity::Critical
            },
            level: Some(to.as_str().to_string()),
            message: format!("{what}: {advice}"),
        });
    }

    /// The queues and streams using the most space on a file system, for messages and the
    /// dashboard: (name, is a stream, bytes on disk), largest first.
    pub fn top_queues(&self, device: u64, count: usize) -> Vec<(String, bool, u64)> {
        let Some(broker) = self.broker.get() else {
            return Vec::new();
        };
        let here = |dir: &std::path::Path| {
            self.filesystems
                .iter()
                .any(|f| f.device == device && dir.starts_with(&f.path))
                || self.filesystems.len() == 1
        };
        let queues = broker.list().into_iter().map(|q| {
            let bytes = q
                .partitions
                .iter()
                .filter(|p| here(&p.dir))
                .map(|p| p.disk_bytes)
                .sum();
            (q.name, false, bytes)
        });
        let streams = broker.list_streams().into_iter().map(|s| {
            let bytes = s
                .partitions
                .iter()
                .zip(&s.partition_dirs)
                .filter(|(_, dir)| here(dir))
                .map(|(p, _)| p.disk_bytes)
                .sum();
            (s.name, true, bytes)
        });
        let mut usage: Vec<(String, bool, u64)> = queues
            .chain(streams)
            .filter(|(_, _, bytes)| *bytes > 0)
            .collect();
        usage.sort_by_key(|(_, _, bytes)| std::cmp::Reverse(*bytes));
        usage.truncate(count);
        usage
    }

    fn top_queues_text(&self, device: u64) -> String {
        let top = self.top_queues(device, 3);
        if top.is_empty() {
            return String::new();
        }
        let list: Vec<String> = top
            .iter()
            .map(|(name, stream, bytes)| {
                let kind = if *stream { " (stream)" } else { "" };
                format!("{name}{kind} {} MiB", mib(*bytes))
            })
            .collect();
        format!("; largest: {}", list.join(", "))
    }

    /// Sample on a timer and after segment rolls until `stop` turns true.
    pub async fn run_sampler(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let interval = Duration::from_millis(self.settings().sample_interval_ms.max(10));
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.nudge.notified() => {}
                _ = stop.changed() => return,
            }
            let limits = self.clone();
            // statvfs and /proc reads are quick but blocking: keep them off the async workers.
            let _ = tokio::task::spawn_blocking(move || limits.sample()).await;
            self.sampled.send_modify(|rounds| *rounds += 1);
        }
    }

    fn path_of(&self, device: u64) -> String {
        self.filesystems
            .iter()
            .find(|f| f.device == device)
            .map_or_else(
                || format!("device {device}"),
                |f| f.path.display().to_string(),
            )
    }

    fn reject_message(
        &self,
        device: u64,
        reason: Reason,
        level: Level,
        retry_after_ms: u64,
    ) -> String {
        // A cluster node names itself, as it names a replica's node that limits a publish.
        let node = self
            .cluster_levels
            .get()
            .map(|levels| format!(" on node {}", levels.own_id()))
            .unwrap_or_default();
        let monitor = lock(&self.monitor);
        match reason {
            Reason::Disk => {
                let status = monitor.disks().find(|d| d.device == DeviceId(device));
                let (free, hard) = status.map_or((0, 0), |s| {
                    (s.sample.effective_free_bytes(), s.thresholds.hard_bytes)
                });
                let on = if node.is_empty() { " on" } else { "," };
                format!(
                    "disk at {level} level{node}{on} {} ({} MiB free, hard level at {} MiB); \
                     publishing resumes once consumers free space; retry after {retry_after_ms} ms",
                    self.path_of(device),
                    mib(free),
                    mib(hard)
                )
            }
            _ => {
                let memory = monitor.memory();
                let (resident, limit) =
                    memory.map_or((0, 0), |m| (m.sample.resident_bytes, m.sample.limit_bytes));
                format!(
                    "memory at {level} level{node} ({} MiB resident of a {} MiB limit); \
                     publishing resumes once memory falls; retry after {retry_after_ms} ms",
                    mib(resident),
                    mib(limit)
                )
            }
        }
    }

    /// The status document of `GET /api/v1/status` and `keratin status --json`.
    pub fn status(&self, node: &str) -> Value {
        // Gathered before taking the monitor's lock, which every publish takes: listing the
        // queues asks every partition for its size (and a projection takes the lock itself).
        let extras: Vec<(Value, Value, Option<Projection>)> = self
            .filesystems
            .iter()
            .map(|fs| {
                (
                    self.history_json(fs.device),
                    self.top_queues_json(fs.device),
                    self.projection(fs.device),
                )
            })
            .collect();
        let monitor = lock(&self.monitor);
        let filesystems: Vec<Value> = self
            .filesystems
            .iter()
            .zip(extras)
            .map(|(fs, (history, top_queues, projection))| {
                let status = monitor.disks().find(|d| d.device == DeviceId(fs.device));
                let spare = self.pool.get().map_or(0, |p| p.spare_bytes(fs.device));
                json!({
                    "path": fs.path,
                    "device": fs.device,
                    "total_bytes": status.as_ref().map_or(0, |s| s.sample.total_bytes),
                    "free_bytes": status.as_ref().map_or(0, |s| s.sample.free_bytes),
                    "spare_bytes": spare,
                    "level": status.as_ref().map_or(Level::Normal, |s| s.level).as_str(),
                    "thresholds": status.as_ref().map(|s| json!({
                        "soft_bytes": s.thresholds.soft_bytes,
                        "hard_bytes": s.thresholds.hard_bytes,
                        "reserve_bytes": s.thresholds.reserve_bytes,
                    })),
                    "history": history,
                    "top_queues": top_queues,
                    "time_to_full": projection.map(|p| json!({
                        "fill_bytes_per_s": p.fill_bytes_per_s.round() as u64,
                        "to_hard_ms": p.to_hard_ms,
                        "to_reserve_ms": p.to_reserve_ms,
                    })),
                })
            })
            .collect();
        let memory = monitor.memory();
        json!({
            "node": node,
            "filesystems": filesystems,
            "memory": {
                "resident_bytes": memory.as_ref().map_or(0, |m| m.sample.resident_bytes),
                "limit_bytes": self.memory_limit.limit_bytes,
                "limit_source": limit_source_text(&self.memory_limit.source),
                "level": memory.as_ref().map_or(Level::Normal, |m| m.level).as_str(),
            },
        })
    }

    /// `[[at_ms, free_bytes], ...]` of a file system, oldest first: the last 10 minutes.
    fn history_json(&self, device: u64) -> Value {
        let points: Vec<Value> = self
            .history
            .points(device)
            .iter()
            .map(|p| json!([p.at_ms, p.free_bytes]))
            .collect();
        Value::Array(points)
    }

    /// `[{name, kind, disk_bytes}, ...]`: the three queues or streams (`kind` `queue` or
    /// `stream`) using the most space on a file system.
    fn top_queues_json(&self, device: u64) -> Value {
        let top: Vec<Value> = self
            .top_queues(device, 3)
            .into_iter()
            .map(|(name, stream, disk_bytes)| {
                let kind = if stream { "stream" } else { "queue" };
                json!({ "name": name, "kind": kind, "disk_bytes": disk_bytes })
            })
            .collect();
        Value::Array(top)
    }

    /// The levels for metrics: per file system (device, path, level, total, free, spare) and
    /// memory (resident, limit, level).
    pub fn snapshot(&self) -> LimitsSnapshot {
        let monitor = lock(&self.monitor);
        let filesystems = self
            .filesystems
            .iter()
            .map(|fs| {
                let status = monitor.disks().find(|d| d.device == DeviceId(fs.device));
                FilesystemSnapshot {
                    device: fs.device,
                    path: fs.path.display().to_string(),
                    level: status.as_ref().map_or(Level::Normal, |s| s.level),
                    total_bytes: status.as_ref().map_or(0, |s| s.sample.total_bytes),
                    free_bytes: status.as_ref().map_or(0, |s| s.sample.free_bytes),
                    spare_bytes: self.pool.get().map_or(0, |p| p.spare_bytes(fs.device)),
                }
            })
            .collect();
        let memory = monitor.memory();
        LimitsSnapshot {
            filesystems,
            memory_resident_bytes: memory.as_ref().map_or(0, |m| m.sample.resident_bytes),
            memory_limit_bytes: self.memory_limit.limit_bytes,
            memory_level: memory.as_ref().map_or(Level::Normal, |m| m.level),
        }
    }
}

/// Hand freed heap memory back to the system. The allocator keeps freed memory for reuse, so
/// resident memory — what the limit is measured on — would stay high long after the publishes
/// that used it were answered, and under pressure publishing would stay limited.
fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// One file system's figures for metrics.
#[derive(Debug, Clone)]
pub struct FilesystemSnapshot {
    /// Device id.
    pub device: u64,
    /// Storage path.
    pub path: String,
    /// Level.
    pub level: Level,
    /// Total bytes (or the budget).
    pub total_bytes: u64,
    /// Free bytes (statvfs).
    pub free_bytes: u64,
    /// Spare bytes.
    pub spare_bytes: u64,
}

/// The limits' figures for metrics.
#[derive(Debug, Clone)]
pub struct LimitsSnapshot {
    /// Per file system.
    pub filesystems: Vec<FilesystemSnapshot>,
    /// Resident memory.
    pub memory_resident_bytes: u64,
    /// Memory limit.
    pub memory_limit_bytes: u64,
    /// Memory level.
    pub memory_level: Level,
}

fn limit_source_text(source: &LimitSource) -> String {
    match source {
        LimitSource::CgroupV2 { path } | LimitSource::CgroupV1 { path } => {
            format!("{} {}", source.as_str(), path.display())
        }
        other => other.as_str().to_string(),
    }
}

impl PublishGate for NodeLimits {
    fn publish(&self, device: u64, batch_bytes: u64) -> GateDecision {
        let decision = lock(&self.monitor).decide(&[DeviceId(device)], batch_bytes);
        self.answer(device, decision)
    }

    fn replicas_limited(&self) -> bool {
        self.cluster_levels
            .get()
            .is_some_and(|levels| levels.peer_limited())
    }

    fn publish_replicated(&self, device: u64, batch_bytes: u64, replicas: &[u64]) -> GateDecision {
        self.decide_replicated(device, batch_bytes, replicas)
    }

    fn may_heal(&self, device: u64) -> bool {
        lock(&self.monitor)
            .disk_level(DeviceId(device))
            .is_none_or(|level| level < Level::Reserve)
    }

    fn free_bytes(&self, device: u64) -> Option<u64> {
        lock(&self.monitor)
            .disks()
            .find(|d| d.device == DeviceId(device))
            .map(|d| d.sample.effective_free_bytes())
    }

    fn segment_rolled(&self, _device: u64) {
        self.nudge.notify_one();
    }
}

impl NodeLimits {
    /// The gate's answer for this node's own `decision` on a partition on `device`: counted,
    /// and a rejection explained.
    fn answer(&self, device: u64, decision: Decision) -> GateDecision {
        match decision {
            Decision::Admit => GateDecision::Admit,
            Decision::Slow { delay_ms } => {
                let memory_soft = lock(&self.monitor)
                    .memory_level()
                    .is_some_and(|l| l >= Level::Soft);
                self.counters.delayed(memory_soft);
                GateDecision::Slow { delay_ms }
            }
            Decision::Reject {
                reason,
                level,
                retry_after_ms,
            } => {
                self.counters.rejected(reason);
                GateDecision::Reject {
                    reason: reason.as_str().to_string(),
                    retry_after_ms: u32::try_from(retry_after_ms).unwrap_or(u32::MAX),
                    message: self.reject_message(device, reason, level, retry_after_ms),
                }
            }
        }
    }
}
