//! `Broker`: one node's queues over its storage directories. It owns the node's segment pool
//! and metadata log, places partitions, routes publishes and hands out consumers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use keratin_log::{Io, Log, LogOptions, PoolOptions, RealIo, SegmentPool};
use tokio::sync::{mpsc, Mutex};

use crate::byte_budget::ByteBudget;
use crate::consumer::{Consumer, ConsumerLink, Credit, SubscribeOptions};
use crate::error::{BrokerError, BrokerResult};
use crate::gate::{OpenGate, PublishGate};
use crate::meta::{Meta, MetaFigures, MetaRecord, QueueDecl};
use crate::partition::owner::{self, rebuild, Command, OwnerContext};
use crate::partition::state::PartitionState;
use crate::queue::{validate_queue_name, DeadLetterFailure, Queue, QueueSettings};
use crate::record::Message;

/// Milliseconds since the Unix epoch; injected so that tests control time.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system clock.
pub fn system_clock() -> Clock {
    Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    })
}

/// Largest prefetch a consumer may ask for: deliveries in flight to one consumer are buffered
/// in its channel, so this bounds that buffer. Equal to the protocol's `PREFETCH_MAX`
/// (`keratin-server` asserts it at compile time; this crate does not know the protocol).
pub const MAX_PREFETCH: u32 = 65_535;

/// Default node-wide bound on delivery bytes held in memory (read from disk for consumers and
/// not yet handed to their sockets): 64 MiB is a quarter second of sending at 250 MB/s, enough
/// to keep every consumer busy; a server lowers it to fit its memory limit.
pub const DELIVERY_BYTES_DEFAULT: u64 = 64 << 20;

/// Default bound on the partitions of all queues of a node. Each partition has an owner task, a
/// log with its own commit thread and segment files, and while busy up to about 4 MiB of
/// buffers (three commit buffers kept at 1 MiB, a 1 MiB read chunk while delivering): 4,096
/// partitions are 4,096 threads, well inside a process's usual thread limit, and a client that
/// declares queues in a loop meets a clear refusal instead of the thread limit.
pub const PARTITIONS_MAX_DEFAULT: u32 = 4096;

/// Default publish timeout: the Keratin client's default `publish_timeout` (30 s).
pub const PUBLISH_TIMEOUT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(30);

/// Default idle time after which an empty partition hands its log's segments back to the pool.
pub const IDLE_RELEASE_AFTER_DEFAULT: std::time::Duration = std::time::Duration::from_secs(30);

/// How a broker node is set up.
#[derive(Clone)]
pub struct BrokerConfig {
    /// Storage directories; the first also holds the metadata log.
    pub dirs: Vec<PathBuf>,
    /// Full segment size of every log (metadata logs use one eighth).
    pub segment_size_bytes: u64,
    /// The file system seam (the real one, or a simulated disk in tests).
    pub io: Arc<dyn Io>,
    /// Spare bytes per file system (`None`: 2% of it, at most 1 GiB).
    pub spare_budget_bytes: Option<u64>,
    /// Prepare spares on a background thread (off for deterministic tests).
    pub pool_background: bool,
    /// Time source.
    pub clock: Clock,
    /// The resource limits publishes pass through.
    pub gate: Arc<dyn PublishGate>,
    /// Node-wide bound on delivery bytes held in memory ([`DELIVERY_BYTES_DEFAULT`]).
    pub delivery_bytes_max: u64,
    /// Most partitions over all queues ([`PARTITIONS_MAX_DEFAULT`]); a declare past it is
    /// refused.
    pub partitions_max: u32,
    /// A publish not confirmed within this is answered [`BrokerError::TimedOut`] (outcome
    /// unknown) instead of waiting for a stalled disk ([`PUBLISH_TIMEOUT_DEFAULT`]).
    pub publish_timeout: std::time::Duration,
    /// A partition that holds nothing and saw no append for this long hands its log's segments
    /// back to the node's pool ([`IDLE_RELEASE_AFTER_DEFAULT`]).
    pub idle_release_after: std::time::Duration,
}

impl std::fmt::Debug for BrokerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerConfig")
            .field("dirs", &self.dirs)
            .field("segment_size_bytes", &self.segment_size_bytes)
            .finish_non_exhaustive()
    }
}

impl BrokerConfig {
    /// Defaults on the real file system.
    pub fn new(dirs: Vec<PathBuf>) -> BrokerConfig {
        BrokerConfig {
            dirs,
            segment_size_bytes: keratin_log::DEFAULT_SEGMENT_SIZE_BYTES,
            io: Arc::new(RealIo::new()),
            spare_budget_bytes: None,
            pool_background: true,
            clock: system_clock(),
            gate: Arc::new(OpenGate),
            delivery_bytes_max: DELIVERY_BYTES_DEFAULT,
            partitions_max: PARTITIONS_MAX_DEFAULT,
            publish_timeout: PUBLISH_TIMEOUT_DEFAULT,
            idle_release_after: IDLE_RELEASE_AFTER_DEFAULT,
        }
    }
}

/// Where a published message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receipt {
    /// Partition index.
    pub partition: u32,
    /// Message id (offset) in the partition.
    pub message: u64,
}

/// One partition's share of a publish: its index, the positions of its messages in the batch,
/// and the owner's answer.
type PartitionWait = (
    u32,
    Vec<usize>,
    tokio::sync::oneshot::Receiver<BrokerResult<std::ops::Range<u64>>>,
);

/// Publishes handed to their partitions, waiting for their outcomes.
#[derive(Debug)]
pub struct PendingPublish {
    queue: String,
    results: Vec<Option<BrokerResult<Receipt>>>,
    waiting: Vec<PartitionWait>,
}

impl PendingPublish {
    /// Each message's outcome, in the order given: a receipt once durable, or the error.
    pub async fn wait(mut self) -> Vec<BrokerResult<Receipt>> {
        for (partition, indexes, reply) in std::mem::take(&mut self.waiting) {
            let outcome = reply
                .await
                .unwrap_or_else(|_| Err(BrokerError::Closed(format!("queue {:?}", self.queue))));
            match outcome {
                Ok(range) => {
                    for (i, offset) in indexes.into_iter().zip(range) {
                        self.results[i] = Some(Ok(Receipt {
                            partition,
                            message: offset,
                        }));
                    }
                }
                Err(e) => {
                    for i in indexes {
                        self.results[i] = Some(Err(e.clone()));
                    }
                }
            }
        }
        let queue = self.queue;
        self.results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(BrokerError::Closed(queue.clone()))))
            .collect()
    }
}

/// Figures of one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionInfo {
    /// Index.
    pub index: u32,
    /// Storage directory.
    pub dir: PathBuf,
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and not yet settled.
    pub inflight: u64,
    /// Payload bytes of live messages.
    pub bytes: u64,
    /// Bytes of the partition's log on disk.
    pub disk_bytes: u64,
    /// True if its log stopped after a write error.
    pub stopped: bool,
    /// Times its log stopped since start (a stop healed between two looks still counts).
    pub stops: u64,
    /// Times its stopped log was healed since start.
    pub heals: u64,
    /// True while the partition is at its share of the queue limits.
    pub full: bool,
    /// Publishes refused with `queue_full` since start.
    pub rejected_full: u64,
    /// Messages removed by `drop_oldest` since start.
    pub overflowed: u64,
    /// Messages dropped since start because dead-lettering them failed, by reason (non-zero
    /// counts only).
    pub dead_letter_failures: BTreeMap<DeadLetterFailure, u64>,
}

/// Figures of a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    /// Name.
    pub name: String,
    /// Settings.
    pub settings: QueueSettings,
    /// Per partition.
    pub partitions: Vec<PartitionInfo>,
}

impl QueueInfo {
    /// Ready messages over all partitions.
    pub fn ready(&self) -> u64 {
        self.partitions.iter().map(|p| p.ready).sum()
    }
    /// Inflight messages over all partitions.
    pub fn inflight(&self) -> u64 {
        self.partitions.iter().map(|p| p.inflight).sum()
    }
    /// Live payload bytes over all partitions.
    pub fn bytes(&self) -> u64 {
        self.partitions.iter().map(|p| p.bytes).sum()
    }
    /// Disk bytes over all partitions.
    pub fn disk_bytes(&self) -> u64 {
        self.partitions.iter().map(|p| p.disk_bytes).sum()
    }
    /// Messages dropped because dead-lettering them failed, by reason, over all partitions.
    pub fn dead_letter_failures(&self) -> BTreeMap<DeadLetterFailure, u64> {
        let mut total = BTreeMap::new();
        for (reason, count) in self.partitions.iter().flat_map(|p| &p.dead_letter_failures) {
            *total.entry(*reason).or_insert(0) += count;
        }
        total
    }
}

/// The metadata log's state, for metrics and attention items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataLogInfo {
    /// Its directory.
    pub dir: PathBuf,
    /// True if it stopped after a write error and has not healed yet.
    pub stopped: bool,
    /// Times it stopped since start.
    pub stops: u64,
    /// Times it was healed since start.
    pub heals: u64,
}

/// A stopped metadata log is offered a heal this often, as a partition's log is (when the gate
/// says its file system is back above reserve); a metadata write also heals it first.
const METADATA_HEAL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

pub(crate) struct BrokerInner {
    config: BrokerConfig,
    pool: SegmentPool,
    meta: Mutex<Option<Meta>>,
    meta_figures: Arc<MetaFigures>,
    queues: RwLock<BTreeMap<String, Arc<Queue>>>,
    placements: RwLock<BTreeMap<String, Vec<PathBuf>>>,
    next_consumer: AtomicU64,
    delivery_budget: Arc<ByteBudget>,
}

/// One broker node.
#[derive(Clone)]
pub struct Broker {
    inner: Arc<BrokerInner>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("dirs", &self.inner.config.dirs)
            .finish_non_exhaustive()
    }
}

fn queue_dir(storage: &Path, id: u64) -> PathBuf {
    storage.join("queues").join(id.to_string())
}

fn partition_dir(storage: &Path, id: u64, index: u32) -> PathBuf {
    queue_dir(storage, id).join(index.to_string())
}

impl Broker {
    /// Open a node: its pool, its metadata log, and every declared queue's partitions, whose
    /// state is rebuilt from their logs. Must run inside a tokio runtime.
    pub async fn open(config: BrokerConfig) -> BrokerResult<Broker> {
        if config.dirs.is_empty() {
            return Err(BrokerError::Invalid(
                "at least one storage directory".into(),
            ));
        }
        let io = config.io.clone();
        let pool = SegmentPool::new(
            io.clone(),
            PoolOptions {
                full_segment_size_bytes: config.segment_size_bytes,
                budget_bytes: config.spare_budget_bytes,
                background: config.pool_background,
                ..PoolOptions::default()
            },
        );
        for dir in &config.dirs {
            io.create_dir_all(dir)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
            pool.add_storage_dir(dir)?;
        }
        let meta = Meta::open(
            io.clone(),
            &config.dirs[0].join("meta"),
            config.segment_size_bytes,
            pool.clone(),
            config.gate.clone(),
        )?;
        let delivery_budget = ByteBudget::new(config.delivery_bytes_max);
        let inner = Arc::new(BrokerInner {
            config,
            pool,
            meta: Mutex::new(None),
            meta_figures: meta.figures.clone(),
            queues: RwLock::new(BTreeMap::new()),
            placements: RwLock::new(BTreeMap::new()),
            next_consumer: AtomicU64::new(1),
            delivery_budget,
        });
        let decls: Vec<QueueDecl> = meta.queues.values().cloned().collect();
        inner.remove_orphans(&meta)?;
        for decl in decls {
            inner.start_queue(&decl)?;
        }
        *inner.meta.lock().await = Some(meta);
        spawn_metadata_healer(Arc::downgrade(&inner));
        Ok(Broker { inner })
    }

    /// The metadata log's state: stopped or not, and its stops and heals since start.
    pub fn metadata_log(&self) -> MetadataLogInfo {
        let f = &self.inner.meta_figures;
        MetadataLogInfo {
            dir: f.dir.clone(),
            stopped: f.stopped.load(Ordering::Relaxed) != 0,
            stops: f.stops.load(Ordering::Relaxed),
            heals: f.heals.load(Ordering::Relaxed),
        }
    }

    /// The node's segment pool.
    pub fn pool(&self) -> &SegmentPool {
        &self.inner.pool
    }

    /// The node's configuration.
    pub fn config(&self) -> &BrokerConfig {
        &self.inner.config
    }

    /// Declare a queue. Declaring an existing queue with identical settings is a no-op; with
    /// other settings it is a conflict.
    pub async fn declare(&self, name: &str, settings: QueueSettings) -> BrokerResult<QueueInfo> {
        validate_queue_name(name)?;
        settings.validate(name)?;
        let mut guard = self.inner.meta.lock().await;
        let meta = guard
            .as_mut()
            .ok_or_else(|| BrokerError::Closed("broker".into()))?;
        if let Some(existing) = meta.by_name(name) {
            if existing.settings != settings {
                return Err(BrokerError::Conflict {
                    name: name.into(),
                    existing: existing.settings.to_string(),
                });
            }
            drop(guard);
            return self.info(name);
        }
        let partitions: u64 = meta
            .queues
            .values()
            .map(|q| u64::from(q.settings.partitions))
            .sum();
        let partitions_max = self.inner.config.partitions_max;
        if partitions + u64::from(settings.partitions) > u64::from(partitions_max) {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?} with {} partitions: the node has {partitions} of its \
                 {partitions_max} partitions; delete a queue or declare fewer partitions",
                settings.partitions
            )));
        }
        let decl = QueueDecl {
            id: meta.next_id,
            name: name.into(),
            placement: self.inner.place(settings.partitions)?,
            settings,
        };
        meta.write(
            MetaRecord::QueueDeclared(decl.clone()),
            (self.inner.config.clock)(),
        )
        .await?;
        self.inner.start_queue(&decl)?;
        drop(guard);
        self.info(name)
    }

    /// Change the settings of a live queue (limits, overflow, dead-letter queue, max
    /// deliveries; not the partitions). The change is durable in the node's metadata before any
    /// partition applies it, and each partition records it in its own log. Lowering a
    /// `drop_oldest` limit trims ready messages; inflight ones are never dropped.
    pub async fn set_queue_settings(
        &self,
        name: &str,
        settings: QueueSettings,
    ) -> BrokerResult<QueueInfo> {
        self.update_queue_settings(name, |_| Ok(settings)).await
    }

    /// Change some settings of a live queue: `update` gets the settings in force and returns
    /// the new ones (or an error, which changes nothing). The read, the write and the
    /// partitions' update happen under the metadata lock, so two concurrent updates of
    /// different settings both take effect, and every partition ends with the settings the
    /// metadata holds (a change that reads first and writes later would lose the other's).
    pub async fn update_queue_settings(
        &self,
        name: &str,
        update: impl FnOnce(&QueueSettings) -> BrokerResult<QueueSettings>,
    ) -> BrokerResult<QueueInfo> {
        let mut guard = self.inner.meta.lock().await;
        let meta = guard
            .as_mut()
            .ok_or_else(|| BrokerError::Closed("broker".into()))?;
        let decl = meta
            .by_name(name)
            .cloned()
            .ok_or_else(|| BrokerError::NotFound(name.into()))?;
        let settings = update(&decl.settings)?;
        settings.validate(name)?;
        if decl.settings.partitions != settings.partitions {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?} has {} partitions; partitions cannot change on a live queue",
                decl.settings.partitions
            )));
        }
        let queue = self.inner.queue(name)?;
        meta.write(
            MetaRecord::QueueSettingsChanged {
                id: decl.id,
                settings: settings.clone(),
            },
            (self.inner.config.clock)(),
        )
        .await?;
        *queue.settings.write().unwrap_or_else(|e| e.into_inner()) = settings.clone();
        // Still under the lock: a later change reaches each partition after this one.
        for partition in &queue.partitions {
            let settings = settings.clone();
            partition
                .request(|reply| Command::SetSettings { settings, reply })
                .await?;
        }
        drop(guard);
        self.info(name)
    }

    /// The node's runtime setting overrides as the metadata log last stored them (dotted key to
    /// value; empty when none were ever set).
    pub async fn node_settings(&self) -> BrokerResult<BTreeMap<String, serde_json::Value>> {
        let guard = self.inner.meta.lock().await;
        let meta = guard
            .as_ref()
            .ok_or_else(|| BrokerError::Closed("broker".into()))?;
        Ok(meta.node_settings.clone())
    }

    /// Replace the node's runtime setting overrides, durably: when this returns `Ok` they are
    /// synced in the metadata log and a restart reads them back. The broker does not interpret
    /// them; the caller validates before storing.
    pub async fn set_node_settings(
        &self,
        overrides: BTreeMap<String, serde_json::Value>,
    ) -> BrokerResult<()> {
        let mut guard = self.inner.meta.lock().await;
        let meta = guard
            .as_mut()
            .ok_or_else(|| BrokerError::Closed("broker".into()))?;
        meta.write(
            MetaRecord::NodeSettingsChanged { overrides },
            (self.inner.config.clock)(),
        )
        .await
    }

    /// Delete a queue with its messages; its consumers see the end of their stream.
    pub async fn delete(&self, name: &str) -> BrokerResult<()> {
        let mut guard = self.inner.meta.lock().await;
        let meta = guard
            .as_mut()
            .ok_or_else(|| BrokerError::Closed("broker".into()))?;
        let id = meta
            .by_name(name)
            .map(|d| d.id)
            .ok_or_else(|| BrokerError::NotFound(name.into()))?;
        let queue = self.inner.queue(name)?;
        meta.write(MetaRecord::QueueDeleted { id }, (self.inner.config.clock)())
            .await?;
        self.inner.queues_write().remove(name);
        self.inner
            .placements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        drop(guard);
        // The deletion is durable: whatever a partition's log fails at (a stopped log can hold
        // the scratch file of a segment it could not allocate), its files go below.
        for partition in &queue.partitions {
            if let Err(error) = partition.request(|reply| Command::Delete { reply }).await {
                tracing::warn!(queue = name, partition = partition.index, %error, "deleting a partition's log failed; removing its files");
            }
        }
        self.inner.remove_queue_dirs(id)
    }

    /// Remove every ready message; inflight ones stay until settled. Returns how many went.
    pub async fn purge(&self, name: &str) -> BrokerResult<u64> {
        let queue = self.inner.queue(name)?;
        let mut total = 0;
        for partition in &queue.partitions {
            total += partition.purge().await?;
        }
        Ok(total)
    }

    /// Figures of one queue.
    pub fn info(&self, name: &str) -> BrokerResult<QueueInfo> {
        let queue = self.inner.queue(name)?;
        Ok(self.inner.info_of(&queue))
    }

    /// Figures of every queue, by name.
    pub fn list(&self) -> Vec<QueueInfo> {
        let queues: Vec<Arc<Queue>> = self.inner.queues_read().values().cloned().collect();
        queues.iter().map(|q| self.inner.info_of(q)).collect()
    }

    /// Publish messages to a queue. Each result comes once the message is durable (confirmed),
    /// or with the reason it was not applied.
    pub async fn publish(&self, name: &str, messages: Vec<Message>) -> Vec<BrokerResult<Receipt>> {
        self.inner.publish(name, messages).await
    }

    /// Whether separate publishes to `name` may be handed over as one batch without changing
    /// their outcomes: true when the queue exists and has no message or byte limit (a batch is
    /// admitted under the limits all or nothing; the resource gate decides the same for every
    /// publish of an instant either way).
    pub fn publishes_may_join(&self, name: &str) -> bool {
        self.inner.queue(name).is_ok_and(|queue| {
            let settings = queue.settings.read().unwrap_or_else(|e| e.into_inner());
            settings.max_messages.is_none() && settings.max_bytes.is_none()
        })
    }

    /// Route and hand over messages now, and return a value that waits for their outcomes: a
    /// connection uses it so that its publishes reach each partition in the order they arrived,
    /// while their confirms are awaited elsewhere.
    pub fn publish_dispatch(&self, name: &str, messages: Vec<Message>) -> PendingPublish {
        self.inner.dispatch(name, messages, false)
    }

    /// [`Broker::publish_dispatch`] for separate publishes joined into one batch (a joinable
    /// frame): a message whose record can never fit a segment fails alone with
    /// [`BrokerError::TooLarge`] instead of failing the append of every message routed with it.
    pub fn publish_dispatch_joined(&self, name: &str, messages: Vec<Message>) -> PendingPublish {
        self.inner.dispatch_with(name, messages, false, true)
    }

    /// Subscribe to a queue with a prefetch (most unsettled deliveries at once).
    pub fn subscribe(&self, name: &str, prefetch: u32) -> BrokerResult<Consumer> {
        self.subscribe_with(name, SubscribeOptions::prefetch(prefetch))
    }

    /// The node-wide budget of delivery bytes held in memory.
    pub fn delivery_budget(&self) -> Arc<ByteBudget> {
        self.inner.delivery_budget()
    }

    /// Subscribe to a queue with a count prefetch, an optional byte prefetch and an optional
    /// connection budget (see [`SubscribeOptions`]).
    pub fn subscribe_with(&self, name: &str, options: SubscribeOptions) -> BrokerResult<Consumer> {
        let prefetch = options.prefetch;
        if prefetch == 0 || prefetch > MAX_PREFETCH {
            return Err(BrokerError::Invalid(format!(
                "prefetch {prefetch}: expected 1 to {MAX_PREFETCH}"
            )));
        }
        let queue = self.inner.queue(name)?;
        let id = self.inner.next_consumer.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = mpsc::channel(prefetch as usize);
        if options.prefetch_bytes == Some(0) {
            return Err(BrokerError::Invalid(
                "prefetch_bytes 0: expected at least 1 (or none for no byte bound)".into(),
            ));
        }
        let credit = Arc::new(Credit::new(prefetch, options.prefetch_bytes));
        let link = Arc::new(ConsumerLink {
            id,
            sender,
            credit: credit.clone(),
            outbound: options.outbound,
            queue: Arc::downgrade(&queue),
        });
        for partition in &queue.partitions {
            partition.subscribe(link.clone());
        }
        Ok(Consumer::new(id, queue, receiver))
    }

    /// For tests: each partition's live state beside the state rebuilt from its log.
    pub async fn check_states(
        &self,
        name: &str,
    ) -> BrokerResult<Vec<(PartitionState, PartitionState)>> {
        let queue = self.inner.queue(name)?;
        let mut out = Vec::new();
        for partition in &queue.partitions {
            out.push(partition.state().await?);
        }
        Ok(out)
    }

    /// Close every log cleanly: pending appends finish, seals are synced.
    pub async fn shutdown(&self) -> BrokerResult<()> {
        let queues: Vec<Arc<Queue>> = {
            let mut map = self.inner.queues_write();
            std::mem::take(&mut *map).into_values().collect()
        };
        for queue in queues {
            for partition in &queue.partitions {
                partition.request(|reply| Command::Close { reply }).await?;
            }
        }
        if let Some(meta) = self.inner.meta.lock().await.take() {
            meta.close()?;
        }
        Ok(())
    }
}

impl BrokerInner {
    pub(crate) fn delivery_budget(&self) -> Arc<ByteBudget> {
        self.delivery_budget.clone()
    }

    fn queues_read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Queue>>> {
        self.queues.read().unwrap_or_else(|e| e.into_inner())
    }

    fn queues_write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<Queue>>> {
        self.queues.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The node's file system seam.
    pub(crate) fn io(&self) -> Arc<dyn Io> {
        self.config.io.clone()
    }

    fn queue(&self, name: &str) -> BrokerResult<Arc<Queue>> {
        self.queues_read()
            .get(name)
            .cloned()
            .ok_or_else(|| BrokerError::NotFound(name.into()))
    }

    /// Choose a storage directory per partition: most free space first, spreading ties.
    fn place(&self, partitions: u32) -> BrokerResult<Vec<PathBuf>> {
        let io = self.config.io.as_ref();
        let mut free: Vec<(u64, PathBuf)> = Vec::new();
        for dir in &self.config.dirs {
            let stats = io
                .fs_stats(dir)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
            free.push((stats.free_bytes, dir.clone()));
        }
        let segment = self.config.segment_size_bytes;
        let mut placement = Vec::with_capacity(partitions as usize);
        for _ in 0..partitions {
            let best = free
                .iter_mut()
                .max_by_key(|(bytes, _)| *bytes)
                .ok_or_else(|| BrokerError::Invalid("no storage directory".into()))?;
            placement.push(best.1.clone());
            // Count the segment the partition will take, so that ties spread.
            best.0 = best.0.saturating_sub(segment);
        }
        Ok(placement)
    }

    fn start_queue(self: &Arc<Self>, decl: &QueueDecl) -> BrokerResult<()> {
        let io = self.config.io.clone();
        let mut partitions = Vec::with_capacity(decl.placement.len());
        for (index, storage) in decl.placement.iter().enumerate() {
            let dir = partition_dir(storage, decl.id, index as u32);
            let options = LogOptions {
                full_segment_size_bytes: self.config.segment_size_bytes,
                ..LogOptions::default()
            };
            let log = Log::open(io.clone(), &dir, options, Some(self.pool.clone()))?;
            let state = rebuild(&log, None)?;
            // The storage directory's: a log creates its own directory at its first append.
            let device = io
                .device_id(storage)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
            let ctx = OwnerContext {
                device,
                gate: self.config.gate.clone(),
                queue: decl.name.clone(),
                index: index as u32,
                settings: decl.settings.clone(),
                broker: Arc::downgrade(self),
                clock: self.config.clock.clone(),
                segment_size_bytes: self.config.segment_size_bytes,
                publish_timeout: self.config.publish_timeout,
                idle_release_after: self.config.idle_release_after,
            };
            partitions.push(owner::spawn(ctx, log, state));
        }
        let queue = Arc::new(Queue::new(
            decl.id,
            decl.name.clone(),
            decl.settings.clone(),
            partitions,
        ));
        self.queues_write().insert(decl.name.clone(), queue);
        self.placements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(decl.name.clone(), decl.placement.clone());
        Ok(())
    }

    fn info_of(&self, queue: &Queue) -> QueueInfo {
        let placement = self
            .placements
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&queue.name)
            .cloned()
            .unwrap_or_default();
        let partitions = queue
            .partitions
            .iter()
            .map(|p| {
                let f = &p.figures;
                PartitionInfo {
                    index: p.index,
                    dir: placement.get(p.index as usize).cloned().unwrap_or_default(),
                    ready: f.ready.load(Ordering::Relaxed),
                    inflight: f.inflight.load(Ordering::Relaxed),
                    bytes: f.live_bytes.load(Ordering::Relaxed),
                    disk_bytes: f.disk_bytes.load(Ordering::Relaxed),
                    stopped: f.stopped.load(Ordering::Relaxed) != 0,
                    stops: f.stops.load(Ordering::Relaxed),
                    heals: f.heals.load(Ordering::Relaxed),
                    full: f.full.load(Ordering::Relaxed) != 0,
                    rejected_full: f.rejected_full.load(Ordering::Relaxed),
                    overflowed: f.overflowed.load(Ordering::Relaxed),
                    dead_letter_failures: f.dead_letter_failures(),
                }
            })
            .collect();
        QueueInfo {
            name: queue.name.clone(),
            settings: queue.settings(),
            partitions,
        }
    }

    pub(crate) async fn publish(
        &self,
        name: &str,
        messages: Vec<Message>,
    ) -> Vec<BrokerResult<Receipt>> {
        self.dispatch(name, messages, false).wait().await
    }

    /// Dead-lettering: a move of existing messages, never held back by the resource limits.
    pub(crate) async fn publish_internal(
        &self,
        name: &str,
        messages: Vec<Message>,
    ) -> Vec<BrokerResult<Receipt>> {
        self.dispatch(name, messages, true).wait().await
    }

    /// Route messages to their partitions and hand them over now; the returned value waits for
    /// the outcomes. Two dispatches from one caller reach each partition in call order.
    pub(crate) fn dispatch(
        &self,
        name: &str,
        messages: Vec<Message>,
        internal: bool,
    ) -> PendingPublish {
        self.dispatch_with(name, messages, internal, false)
    }

    /// `dispatch`; with `joined`, messages too large for a segment fail one by one here, before
    /// the rest of their partition's batch is appended.
    pub(crate) fn dispatch_with(
        &self,
        name: &str,
        messages: Vec<Message>,
        internal: bool,
        joined: bool,
    ) -> PendingPublish {
        let mut pending = PendingPublish {
            queue: name.to_string(),
            results: vec![None; messages.len()],
            waiting: Vec::new(),
        };
        let queue = match self.queue(name) {
            Ok(queue) => queue,
            Err(e) => {
                pending.results = messages.iter().map(|_| Some(Err(e.clone()))).collect();
                return pending;
            }
        };
        let n = queue.partitions.len();
        let mut batches: Vec<(Vec<usize>, Vec<Vec<u8>>)> = vec![(Vec::new(), Vec::new()); n];
        for (i, message) in messages.iter().enumerate() {
            let mut payload = Vec::with_capacity(message.body.len() + 16);
            if let Err(e) = message.encode(&mut payload) {
                pending.results[i] = Some(Err(e));
                continue;
            }
            if joined {
                if let Err(e) = self.check_record_size(&payload) {
                    pending.results[i] = Some(Err(e));
                    continue;
                }
            }
            let p = queue.route(&message.routing_key);
            batches[p].0.push(i);
            batches[p].1.push(payload);
        }
        let timestamp_ms = (self.config.clock)();
        for (p, (indexes, payloads)) in batches.into_iter().enumerate() {
            if indexes.is_empty() {
                continue;
            }
            let reply = queue.partitions[p].dispatch(payloads, timestamp_ms, internal);
            pending.waiting.push((p as u32, indexes, reply));
        }
        pending
    }

    /// The log's own check (`LogError::RecordTooLarge`), made before the append: a partition
    /// log's segments are `segment_size_bytes` long and hold one segment header.
    fn check_record_size(&self, payload: &[u8]) -> BrokerResult<()> {
        use keratin_log::format::{RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE};
        let segment_size_bytes = self.config.segment_size_bytes;
        let size_bytes = (RECORD_HEADER_SIZE as u64).saturating_add(payload.len() as u64);
        if size_bytes > segment_size_bytes.saturating_sub(SEGMENT_HEADER_SIZE as u64) {
            let error = keratin_log::LogError::RecordTooLarge {
                size_bytes,
                segment_size_bytes,
            };
            return Err(BrokerError::TooLarge(error.to_string()));
        }
        Ok(())
    }

    /// Queue directories whose queue the metadata no longer names (a delete that did not
    /// finish) go back to the pool.
    fn remove_orphans(&self, meta: &Meta) -> BrokerResult<()> {
        let io = self.config.io.as_ref();
        for storage in &self.config.dirs {
            let queues = storage.join("queues");
            if !io.exists(&queues).unwrap_or(false) {
                continue;
            }
            let names = io.read_dir(&queues).map_err(|e| {
                keratin_log::LogError::Invalid(format!("{}: {e}", queues.display()))
            })?;
            for name in names {
                let Ok(id) = name.parse::<u64>() else {
                    continue;
                };
                if meta.queues.contains_key(&id) {
                    continue;
                }
                tracing::info!(queue_id = id, "removing the files of a deleted queue");
                self.remove_queue_dirs(id)?;
            }
        }
        Ok(())
    }

    fn remove_queue_dirs(&self, id: u64) -> BrokerResult<()> {
        let io = self.config.io.clone();
        for storage in &self.config.dirs {
            let dir = queue_dir(storage, id);
            if !io.exists(&dir).unwrap_or(false) {
                continue;
            }
            let names = io
                .read_dir(&dir)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
            for name in names {
                let log_dir = dir.join(&name);
                if remove_if_no_segments(io.as_ref(), &log_dir)? {
                    continue;
                }
                let options = LogOptions {
                    full_segment_size_bytes: self.config.segment_size_bytes,
                    ..LogOptions::default()
                };
                let log = Log::open(
                    io.clone(),
                    &dir.join(name),
                    options,
                    Some(self.pool.clone()),
                )?;
                log.delete()?;
            }
            io.remove_dir(&dir)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
        }
        Ok(())
    }
}

/// Remove a log directory that holds no segment file (a deleted log whose directory stayed,
/// with at most the scratch file of a segment it failed to create): opening it as a log would
/// create a segment, which needs space a full disk does not have. True if it was removed.
pub(crate) fn remove_if_no_segments(io: &dyn Io, dir: &Path) -> BrokerResult<bool> {
    let io_error = |e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display()));
    let names = io.read_dir(dir).map_err(io_error)?;
    if names.iter().any(|name| name.ends_with(".seg")) {
        return Ok(false);
    }
    for name in names {
        io.remove_file(&dir.join(name)).map_err(io_error)?;
    }
    io.remove_dir(dir).map_err(io_error)?;
    Ok(true)
}

/// Offer a stopped metadata log a heal every `METADATA_HEAL_INTERVAL` until the broker is
/// dropped or shut down.
fn spawn_metadata_healer(inner: std::sync::Weak<BrokerInner>) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(METADATA_HEAL_INTERVAL).await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            if inner.meta_figures.stopped.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut guard = inner.meta.lock().await;
            let Some(meta) = guard.as_mut() else {
                return;
            };
            meta.maybe_heal();
        }
    });
}
