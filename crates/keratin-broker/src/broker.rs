//! `Broker`: one node's queues over its storage directories. It owns the node's segment pool
//! and metadata log, places partitions, routes publishes and hands out consumers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use keratin_log::{Io, Log, LogOptions, PoolOptions, RealIo, SegmentPool};
use tokio::sync::{mpsc, Mutex};

use crate::byte_budget::ByteBudget;
use crate::claims::{Claim, Claims};
use crate::consumer::{Consumer, ConsumerLink, ConsumerSlot, Credit, SubscribeOptions};
use crate::error::{BrokerError, BrokerResult};
use crate::gate::{OpenGate, PublishGate};
use crate::meta::{Catalog, MetaFigures, MetaLog, MetaRecord, QueueDecl, StreamDecl};
use crate::partition::dead_letter::{
    dead_letter_producer, DeadLetterSink, DeadLettering, HeldCount,
};
use crate::partition::local_log::{remove_if_no_segments, LocalLog};
use crate::partition::log::{ClusterMetadata, PartitionLog, PartitionLogs, PartitionPlace};
use crate::partition::owner::{self, rebuild, Command, OwnerContext};
use crate::partition::state::PartitionState;
use crate::queue::{validate_queue_name, DeadLetterFailure, Queue, QueueSettings};
use crate::record::Message;
use crate::stream::{Appended, Stream};
use keratin_auth::{UserChange, UserTable};

mod streams;
pub use streams::{ReadFrom, CURSOR_EXPIRY, RETENTION_INTERVAL};

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

/// Node-wide bound on payload bytes read for relocation (space reclaim copying old live messages
/// to the head) and not yet written back: four of a partition's 4 MiB rounds. Without it, every
/// partition reclaiming at once would hold a round each, 4,096 partitions 16 GiB. A partition
/// that finds it taken waits for another's round to finish (reclaim only frees space; it can
/// wait). Separate from the delivery budget, which stalled consumers can hold.
pub const RELOCATION_BYTES_MAX: u64 = 16 << 20;

/// Default bound on the partitions of all queues of a node (`server.partitions_max`): 10,000
/// single-partition queues fit with room for some partitioned ones. An idle partition costs an
/// owner task, its log's in-memory index and, once it holds messages, an open segment file
/// (`docs/configuration.md` has the measured memory per queue); a client that declares queues
/// in a loop meets a clear refusal (409) instead of the memory or descriptor limit.
pub const PARTITIONS_MAX_DEFAULT: u32 = 16_384;

/// Default bound on the queues of a node (`server.queues_max`): RabbitMQ and NATS users run
/// thousands to tens of thousands per node; past 10,000 the declare is refused with 409.
pub const QUEUES_MAX_DEFAULT: u32 = 10_000;

/// Default bound on the consumers of a node over all connections (`server.consumers_max`):
/// each holds a delivery channel, a link in every partition of its queue and, on a connection,
/// a forwarding task; past it a subscribe is refused with 429 `consumers`.
pub const CONSUMERS_MAX_DEFAULT: u32 = 16_384;

/// How long a client refused by `consumers_max` is told to wait: consumers come and go with
/// connections, so a second is a fair first retry.
const CONSUMERS_RETRY_AFTER_MS: u32 = 1_000;

/// Queue logs opened at once when a node starts: opening is disk-bound (reads of each log's
/// tail), so a few in parallel keep the disk busy without taking the whole blocking pool.
const OPEN_PARALLEL: usize = 8;

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
    /// Commit workers per file system, shared by every log on it
    /// ([`keratin_log::PoolOptions::commit_workers_per_filesystem`]).
    pub commit_workers_per_filesystem: usize,
    /// Time source.
    pub clock: Clock,
    /// The resource limits publishes pass through.
    pub gate: Arc<dyn PublishGate>,
    /// Node-wide bound on delivery bytes held in memory ([`DELIVERY_BYTES_DEFAULT`]).
    pub delivery_bytes_max: u64,
    /// Most partitions over all queues ([`PARTITIONS_MAX_DEFAULT`]); a declare past it is
    /// refused ([`BrokerError::NodeFull`]).
    pub partitions_max: u32,
    /// A publish not confirmed within this is answered [`BrokerError::TimedOut`] (outcome
    /// unknown) instead of waiting for a stalled disk ([`PUBLISH_TIMEOUT_DEFAULT`]).
    pub publish_timeout: std::time::Duration,
    /// A partition that holds nothing and saw no append for this long hands its log's segments
    /// back to the node's pool ([`IDLE_RELEASE_AFTER_DEFAULT`]).
    pub idle_release_after: std::time::Duration,
    /// Most queues ([`QUEUES_MAX_DEFAULT`]); a declare past it is refused
    /// ([`BrokerError::NodeFull`]).
    pub queues_max: u32,
    /// Most consumers over all queues ([`CONSUMERS_MAX_DEFAULT`]); a subscribe past it is
    /// refused ([`BrokerError::Limited`], reason `consumers`).
    pub consumers_max: u32,
    /// Opens the logs of replicated queues (a cluster node); `None` on a single node.
    pub partition_logs: Option<Arc<dyn PartitionLogs>>,
    /// The cluster's metadata group (a cluster node): declare, delete and settings changes go
    /// through it. `None` on a single node.
    pub cluster_metadata: Option<Arc<dyn ClusterMetadata>>,
    /// Where dead-lettered messages go (a cluster node: to each dead-letter partition's
    /// leader, wherever it is). `None`: this node's own queues ([`Broker::publish_internal_to`]).
    pub dead_letters: Option<Arc<dyn DeadLetterSink>>,
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
            commit_workers_per_filesystem: keratin_log::PoolOptions::default()
                .commit_workers_per_filesystem,
            clock: system_clock(),
            gate: Arc::new(OpenGate),
            delivery_bytes_max: DELIVERY_BYTES_DEFAULT,
            partitions_max: PARTITIONS_MAX_DEFAULT,
            publish_timeout: PUBLISH_TIMEOUT_DEFAULT,
            idle_release_after: IDLE_RELEASE_AFTER_DEFAULT,
            queues_max: QUEUES_MAX_DEFAULT,
            consumers_max: CONSUMERS_MAX_DEFAULT,
            partition_logs: None,
            cluster_metadata: None,
            dead_letters: None,
        }
    }
}

/// Where a published message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receipt {
    /// Partition index.
    pub partition: u32,
    /// Message id (offset) in the partition; [`Receipt::DUPLICATE`] for an idempotent
    /// producer's retry a stream had stored already.
    pub message: u64,
}

impl Receipt {
    /// The `message` of a stream message stored before (its first offset is not looked up).
    pub const DUPLICATE: u64 = u64::MAX;
}

/// One partition's share of a publish: its index, the positions of its messages in the batch,
/// and the owner's answer.
type PartitionWait = (
    u32,
    Vec<usize>,
    tokio::sync::oneshot::Receiver<BrokerResult<std::ops::Range<u64>>>,
);

/// One stream partition's share of a publish: its index, the positions of its messages in the
/// batch, and the owner's answer.
type StreamWait = (
    u32,
    Vec<usize>,
    tokio::sync::oneshot::Receiver<BrokerResult<Vec<Appended>>>,
);

/// Publishes handed to their partitions, waiting for their outcomes.
#[derive(Debug)]
pub struct PendingPublish {
    queue: String,
    results: Vec<Option<BrokerResult<Receipt>>>,
    waiting: Vec<PartitionWait>,
    /// A stream's partitions' shares (a publish goes to a queue or a stream, never both).
    appends: Vec<StreamWait>,
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
        for (partition, indexes, reply) in std::mem::take(&mut self.appends) {
            let outcome = reply
                .await
                .unwrap_or_else(|_| Err(BrokerError::Closed(format!("stream {:?}", self.queue))));
            match outcome {
                Ok(appended) => {
                    assert_eq!(
                        appended.len(),
                        indexes.len(),
                        "a stream partition answers each message it was given"
                    );
                    for (i, appended) in indexes.into_iter().zip(appended) {
                        let message = match appended {
                            Appended::Stored(offset) => offset,
                            Appended::Duplicate => Receipt::DUPLICATE,
                        };
                        self.results[i] = Some(Ok(Receipt { partition, message }));
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
    /// Dead-letter copies that failed since start, by reason (non-zero counts only): each
    /// failed attempt of a message (its original is held and tried again), and each message
    /// `drop_oldest` removed and dropped because the node held its most dead letters.
    pub dead_letter_failures: BTreeMap<DeadLetterFailure, u64>,
    /// Messages held until their dead-letter copies are confirmed (leader only; they are not
    /// ready, and not inflight).
    pub dead_letters_held: u64,
    /// True if this node leads the partition (always on a single node).
    pub leading: bool,
    /// The leader's node id, if known (`None` on a single node).
    pub leader: Option<u64>,
    /// The leader's client address, if known (`None` on a single node, or when this node
    /// leads).
    pub leader_addr: Option<String>,
    /// The nodes holding a replica (the group's voters), ascending; empty on a single node.
    pub replicas: Vec<u64>,
    /// The node meant to lead the partition: the first of its replicas as the cluster placed
    /// them (placement rotates it over the nodes, and the leader hands the partition back to
    /// it once it is caught up); `None` on a single node.
    pub preferred_leader: Option<u64>,
    /// The replicas in sync with the leader (`partition::replication`), ascending: known on
    /// the leader only, empty elsewhere.
    pub in_sync: Vec<u64>,
    /// Each replica's lag behind the leader's log, in entries, by node id: known on the
    /// leader only (the leader's own is 0), empty elsewhere.
    pub replica_lag: BTreeMap<u64, u64>,
    /// Times the partition's leader changed to another node, as this node saw it, since the
    /// partition opened here.
    pub leader_changes: u64,
    /// On a replica that knows no leader: for how long (ms) it has known none.
    pub leaderless_ms: Option<u64>,
    /// On a replica: one past the last offset committed and applied on this node (`None` on
    /// a single node).
    pub committed_offset: Option<u64>,
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
    /// Dead-letter copies that failed, by reason, over all partitions (see
    /// [`PartitionInfo::dead_letter_failures`]).
    pub fn dead_letter_failures(&self) -> BTreeMap<DeadLetterFailure, u64> {
        let mut total = BTreeMap::new();
        for (reason, count) in self.partitions.iter().flat_map(|p| &p.dead_letter_failures) {
            *total.entry(*reason).or_insert(0) += count;
        }
        total
    }
}

/// What a node holds against its bounds, each as (count, bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeBounds {
    /// Declared queues and `queues_max`.
    pub queues: (u64, u64),
    /// Partitions over all queues and `partitions_max`.
    pub partitions: (u64, u64),
    /// Consumers and `consumers_max`.
    pub consumers: (u64, u64),
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

/// How long a purge looks for a partition's leader (following the leaders named, waiting out
/// elections) before it answers "not the leader": about two elections (500-1,000 ms timeouts
/// and a vote each), well within a client's request timeout (10 s by default), which then
/// has time to ask again elsewhere.
pub const PURGE_LEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(4);
/// The pause before a purge asks again when no leader is named: a quarter of the shortest
/// election timeout, as the clients' backoff after a 421 without a leader.
const PURGE_LEADER_PAUSE: std::time::Duration = std::time::Duration::from_millis(250);

pub(crate) struct BrokerInner {
    config: BrokerConfig,
    pool: SegmentPool,
    /// The metadata log; `None` once shut down. Cloned out for each write, never held locked
    /// across one.
    meta_log: std::sync::RwLock<Option<Arc<MetaLog>>>,
    meta_figures: Arc<MetaFigures>,
    /// What the metadata says, the names being changed and the reservations of declares in
    /// flight (see `claims.rs`). A `std` mutex: held for a few map operations, never across an
    /// `await` or a disk call.
    meta_state: std::sync::Mutex<MetaState>,
    /// Orders writes of the node setting overrides (each record holds all of them).
    node_settings_write: Mutex<()>,
    /// Orders user changes: each is checked against the table the ones before it made.
    users_write: Mutex<()>,
    queues: RwLock<BTreeMap<String, Arc<Queue>>>,
    placements: RwLock<BTreeMap<String, Vec<PathBuf>>>,
    /// The declared streams, by name (`broker/streams.rs`).
    streams: RwLock<BTreeMap<String, Arc<Stream>>>,
    next_consumer: AtomicU64,
    /// Consumers alive over all queues, against `consumers_max`.
    consumers: Arc<AtomicU64>,
    delivery_budget: Arc<ByteBudget>,
    /// Payload bytes read for relocation and not yet written back ([`RELOCATION_BYTES_MAX`]).
    relocation_budget: Arc<ByteBudget>,
    /// Messages held for dead-lettering over all partitions (`partition/dead_letter.rs`,
    /// `HELD_MAX`).
    dead_letters_held: HeldCount,
}

#[derive(Debug, Default)]
struct MetaState {
    catalog: Catalog,
    claims: Claims,
    /// Set by `shutdown`: no new metadata operation starts.
    closed: bool,
}

/// A claimed queue name (see `claims.rs`); given back when dropped.
struct NameClaim<'a> {
    inner: &'a BrokerInner,
    name: String,
}

impl Drop for NameClaim<'_> {
    fn drop(&mut self) {
        self.inner.meta_state().claims.release(&self.name);
    }
}

/// A declare's reservation against the node's bounds; dropped when the declare fails, or
/// turned into a catalog entry by [`Reservation::applied`] under the same lock.
struct Reservation<'a> {
    inner: &'a BrokerInner,
    partitions: u32,
    done: bool,
}

impl Reservation<'_> {
    fn applied(mut self, state: &mut MetaState, record: MetaRecord) {
        state.catalog.apply(record);
        state.claims.unreserve(self.partitions);
        self.done = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.inner.meta_state().claims.unreserve(self.partitions);
        }
    }
}

/// One node's partition logs as opened (blocking) before their owners start.
type OpenedPartitions = Vec<(Arc<dyn PartitionLog>, PartitionState, u64)>;

/// One broker node.
#[derive(Clone)]
pub struct Broker {
    inner: Arc<BrokerInner>,
}

/// A [`Broker`] handle that does not keep it open ([`Broker::downgrade`]).
#[derive(Clone, Debug, Default)]
pub struct WeakBroker(std::sync::Weak<BrokerInner>);

impl WeakBroker {
    /// The broker, unless it was dropped.
    pub fn upgrade(&self) -> Option<Broker> {
        self.0.upgrade().map(|inner| Broker { inner })
    }
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("dirs", &self.inner.config.dirs)
            .finish_non_exhaustive()
    }
}

/// A replicated queue as the metadata group placed it (see
/// [`Broker::declare_replicated_formed`]).
struct Placed {
    id: u64,
    replicas: Vec<Vec<u64>>,
    formation: Vec<Vec<u64>>,
}

fn queue_dir(storage: &Path, id: u64) -> PathBuf {
    storage.join("queues").join(id.to_string())
}

fn partition_dir(storage: &Path, id: u64, index: u32) -> PathBuf {
    queue_dir(storage, id).join(index.to_string())
}

/// Run blocking disk work on the blocking pool and wait for it without holding a worker.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> BrokerResult<T> + Send + 'static,
) -> BrokerResult<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| BrokerError::Closed(format!("blocking task: {e}")))?
}

impl Broker {
    /// Open a node: its pool, its metadata log, and every declared queue's partitions, whose
    /// state is rebuilt from their logs. Must run inside a tokio runtime; the disk work runs on
    /// its blocking pool, queue logs [`OPEN_PARALLEL`] at a time.
    pub async fn open(config: BrokerConfig) -> BrokerResult<Broker> {
        if config.dirs.is_empty() {
            return Err(BrokerError::Invalid(
                "at least one storage directory".into(),
            ));
        }
        let setup = config.clone();
        let (pool, meta, catalog) = blocking(move || {
            let io = setup.io.clone();
            let pool = SegmentPool::new(
                io.clone(),
                PoolOptions {
                    full_segment_size_bytes: setup.segment_size_bytes,
                    budget_bytes: setup.spare_budget_bytes,
                    background: setup.pool_background,
                    commit_workers_per_filesystem: setup.commit_workers_per_filesystem,
                },
            );
            for dir in &setup.dirs {
                io.create_dir_all(dir).map_err(|e| {
                    keratin_log::LogError::Invalid(format!("{}: {e}", dir.display()))
                })?;
                pool.add_storage_dir(dir)?;
            }
            let (meta, catalog) = MetaLog::open(
                io,
                &setup.dirs[0].join("meta"),
                setup.segment_size_bytes,
                pool.clone(),
                setup.gate.clone(),
            )?;
            Ok((pool, meta, catalog))
        })
        .await?;
        let delivery_budget = ByteBudget::new(config.delivery_bytes_max);
        let decls: Vec<QueueDecl> = catalog.queues.values().cloned().collect();
        let declared_ever = catalog.declared_ever.clone();
        let stream_decls: Vec<StreamDecl> = catalog.streams.values().cloned().collect();
        let inner = Arc::new(BrokerInner {
            config,
            pool,
            meta_figures: meta.figures.clone(),
            meta_log: std::sync::RwLock::new(Some(Arc::new(meta))),
            meta_state: std::sync::Mutex::new(MetaState {
                catalog,
                ..MetaState::default()
            }),
            node_settings_write: Mutex::new(()),
            users_write: Mutex::new(()),
            queues: RwLock::new(BTreeMap::new()),
            placements: RwLock::new(BTreeMap::new()),
            streams: RwLock::new(BTreeMap::new()),
            next_consumer: AtomicU64::new(1),
            consumers: Arc::new(AtomicU64::new(0)),
            delivery_budget,
            relocation_budget: ByteBudget::new(RELOCATION_BYTES_MAX),
            dead_letters_held: HeldCount::default(),
        });
        let ids: std::collections::BTreeSet<u64> = decls.iter().map(|d| d.id).collect();
        let stream_ids: std::collections::BTreeSet<u64> =
            stream_decls.iter().map(|d| d.id).collect();
        let orphans = inner.clone();
        blocking(move || {
            orphans.remove_orphans(&ids, &declared_ever)?;
            orphans.remove_stream_orphans(&stream_ids, &declared_ever)
        })
        .await?;
        inner.open_queues(decls).await?;
        inner.open_streams(stream_decls).await?;
        spawn_metadata_healer(Arc::downgrade(&inner));
        streams::spawn_stream_timer(Arc::downgrade(&inner));
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
    /// other settings it is a conflict; past the node's `queues_max` or `partitions_max` it is
    /// refused ([`BrokerError::NodeFull`]).
    ///
    /// No lock is held across the disk: the name and the room are reserved under a short lock,
    /// the metadata record is written (group-committed with other declares) and the logs are
    /// opened on the blocking pool, then the queue is published. The record is durable before
    /// any log exists, so a crash leaves either no queue or a declared one whose logs the next
    /// start opens.
    pub async fn declare(&self, name: &str, settings: QueueSettings) -> BrokerResult<QueueInfo> {
        self.declare_on(name, settings, Vec::new()).await
    }

    /// [`Broker::declare`] with the queue's replicas pinned to `nodes` (cluster node ids, the
    /// first being partition 0's preferred leader); empty lets the cluster place them. A node
    /// that runs alone refuses a non-empty `nodes`. Ignored when the queue exists.
    pub async fn declare_on(
        &self,
        name: &str,
        settings: QueueSettings,
        nodes: Vec<u64>,
    ) -> BrokerResult<QueueInfo> {
        if let Some(cluster) = &self.inner.config.cluster_metadata {
            validate_queue_name(name)?;
            settings.validate(name)?;
            cluster.declare(name.to_string(), settings, nodes).await?;
            return self.info(name);
        }
        if !nodes.is_empty() {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: nodes {nodes:?} named, and this node runs alone; start a \
                 cluster (keratin serve --node-id N --peer ID=ADDR ...) to place replicas"
            )));
        }
        // On a task of its own: a caller that goes away (a closed connection) does not cut the
        // declare between its durable record and the start of its queue.
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move { broker.declare_here(&name, settings).await })
            .await
            .map_err(|e| BrokerError::Closed(format!("declare: {e}")))?
    }

    /// Declare a replicated queue as the cluster's metadata group decided it: its id (the same
    /// on every node) and the nodes holding each partition's replicas. Declaring it again with
    /// the same id is a no-op (the metadata group's records are applied again at every start).
    pub async fn declare_replicated(
        &self,
        id: u64,
        name: &str,
        settings: QueueSettings,
        replicas: Vec<Vec<u64>>,
    ) -> BrokerResult<QueueInfo> {
        self.declare_replicated_formed(id, name, settings, replicas, Vec::new())
            .await
    }

    /// [`Broker::declare_replicated`] on a node whose replicas join groups formed before with
    /// other voters: `formation` holds, per partition, the voters its group was formed with
    /// (`PartitionPlace::formation`; a partition whose formation does not name this node opens
    /// its replica as joining, never forming the group). Empty: formed with `replicas`.
    pub async fn declare_replicated_formed(
        &self,
        id: u64,
        name: &str,
        settings: QueueSettings,
        replicas: Vec<Vec<u64>>,
        formation: Vec<Vec<u64>>,
    ) -> BrokerResult<QueueInfo> {
        if replicas.len() != settings.partitions as usize || replicas.iter().any(Vec::is_empty) {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: {} partitions need one non-empty replica set each, got {}",
                settings.partitions,
                replicas.len()
            )));
        }
        if !formation.is_empty()
            && (formation.len() != replicas.len() || formation.iter().any(Vec::is_empty))
        {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: {} partitions need one non-empty formation each (or none), got \
                 {}",
                settings.partitions,
                formation.len()
            )));
        }
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            broker
                .declare_placed(
                    &name,
                    settings,
                    Some(Placed {
                        id,
                        replicas,
                        formation,
                    }),
                )
                .await
        })
        .await
        .map_err(|e| BrokerError::Closed(format!("declare: {e}")))?
    }

    async fn declare_here(&self, name: &str, settings: QueueSettings) -> BrokerResult<QueueInfo> {
        if settings.replicas.is_some_and(|r| r > 1) && self.inner.config.partition_logs.is_none() {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: replicas = {}, and this node runs alone (one copy); start a \
                 cluster (keratin serve --node-id N --peer ID=ADDR ...) for replicated queues",
                settings.replicas.unwrap_or(1)
            )));
        }
        self.declare_placed(name, settings, None).await
    }

    async fn declare_placed(
        &self,
        name: &str,
        settings: QueueSettings,
        cluster: Option<Placed>,
    ) -> BrokerResult<QueueInfo> {
        validate_queue_name(name)?;
        settings.validate(name)?;
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let (id, reservation) = {
            let mut state = inner.meta_state();
            if state.catalog.stream_by_name(name).is_some() {
                return Err(BrokerError::NameTaken {
                    name: name.into(),
                    kind: "stream",
                });
            }
            if let Some(existing) = state.catalog.by_name(name) {
                let other_id = cluster.as_ref().is_some_and(|c| c.id != existing.id);
                if existing.settings != settings || other_id {
                    return Err(BrokerError::Conflict {
                        name: name.into(),
                        existing: existing.settings.to_string(),
                    });
                }
                drop(state);
                drop(claim);
                return self.info(name);
            }
            inner.check_room(&state, "queue", name, settings.partitions)?;
            let id = match &cluster {
                Some(placed) => placed.id,
                None => state.catalog.next_id,
            };
            state.catalog.next_id = state.catalog.next_id.max(id) + 1;
            state.claims.reserve(settings.partitions);
            let reservation = Reservation {
                inner,
                partitions: settings.partitions,
                done: false,
            };
            (id, reservation)
        };
        let placer = inner.clone();
        let partitions = settings.partitions;
        let placement = blocking(move || placer.place(partitions)).await?;
        let (replicas, formation) = cluster
            .map(|placed| (placed.replicas, placed.formation))
            .unwrap_or_default();
        let decl = QueueDecl {
            id,
            name: name.into(),
            placement,
            settings,
            replicas,
            formation,
            replicas_version: Vec::new(),
        };
        let record = MetaRecord::QueueDeclared(decl.clone());
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        reservation.applied(&mut inner.meta_state(), record);
        if let Err(error) = inner.start_queue(&decl).await {
            tracing::warn!(queue = name, %error, "opening a declared queue's logs failed; undoing the declaration");
            inner.undo_declare(&decl).await;
            return Err(error);
        }
        drop(claim);
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
        if let Some(cluster) = &self.inner.config.cluster_metadata {
            let current = self.inner.queue(name)?.settings();
            let settings = update(&current)?;
            settings.validate(name)?;
            if current.partitions != settings.partitions || current.replicas != settings.replicas {
                return Err(BrokerError::Invalid(format!(
                    "queue {name:?}: partitions and replicas cannot change on a live queue"
                )));
            }
            cluster.set_settings(name.to_string(), settings).await?;
            return self.info(name);
        }
        self.set_settings_here(name, update).await
    }

    /// Apply new settings of a replicated queue, as the cluster's metadata group decided them.
    pub async fn set_settings_replicated(
        &self,
        name: &str,
        settings: QueueSettings,
    ) -> BrokerResult<QueueInfo> {
        self.set_settings_here(name, |_| Ok(settings)).await
    }

    async fn set_settings_here(
        &self,
        name: &str,
        update: impl FnOnce(&QueueSettings) -> BrokerResult<QueueSettings>,
    ) -> BrokerResult<QueueInfo> {
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let decl = inner.declared(name)?;
        let settings = update(&decl.settings)?;
        settings.validate(name)?;
        if decl.settings.replicas != settings.replicas {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?}: replicas cannot change on a live queue"
            )));
        }
        if decl.settings.partitions != settings.partitions {
            return Err(BrokerError::Invalid(format!(
                "queue {name:?} has {} partitions; partitions cannot change on a live queue",
                decl.settings.partitions
            )));
        }
        let queue = inner.queue(name)?;
        let record = MetaRecord::QueueSettingsChanged {
            id: decl.id,
            settings: settings.clone(),
        };
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        inner.meta_state().catalog.apply(record);
        *queue.settings.write().unwrap_or_else(|e| e.into_inner()) = settings.clone();
        // Still claimed: a later change reaches each partition after this one.
        for partition in &queue.partitions {
            let settings = settings.clone();
            partition
                .request(|reply| Command::SetSettings { settings, reply })
                .await?;
        }
        drop(claim);
        self.info(name)
    }

    /// The node's runtime setting overrides as the metadata log last stored them (dotted key to
    /// value; empty when none were ever set).
    pub async fn node_settings(&self) -> BrokerResult<BTreeMap<String, serde_json::Value>> {
        let state = self.inner.meta_state();
        if state.closed {
            return Err(BrokerError::Closed("broker".into()));
        }
        Ok(state.catalog.node_settings.clone())
    }

    /// Replace the node's runtime setting overrides, durably: when this returns `Ok` they are
    /// synced in the metadata log and a restart reads them back. The broker does not interpret
    /// them; the caller validates before storing.
    pub async fn set_node_settings(
        &self,
        overrides: BTreeMap<String, serde_json::Value>,
    ) -> BrokerResult<()> {
        let inner = &self.inner;
        // Each record holds every override: two writers must apply in the order they wrote.
        let _ordered = inner.node_settings_write.lock().await;
        let record = MetaRecord::NodeSettingsChanged { overrides };
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        inner.meta_state().catalog.apply(record);
        Ok(())
    }

    /// The node's users as its metadata log holds them (a single node's: a cluster keeps its
    /// users in its metadata group). A snapshot: changes after this call make a new table.
    pub fn users(&self) -> Arc<UserTable> {
        self.inner.meta_state().catalog.users.clone()
    }

    /// Store a change to the node's users durably, then apply it; returns the new table. A
    /// change that does not apply (an unknown user, a duplicate name) or that would leave the
    /// node without an admin once it has one is refused ([`BrokerError::Invalid`]) and not
    /// stored.
    pub async fn change_users(&self, change: UserChange) -> BrokerResult<Arc<UserTable>> {
        let inner = &self.inner;
        let _ordered = inner.users_write.lock().await;
        self.users()
            .changed(&change)
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
        let record = MetaRecord::UserChanged { change };
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        let mut state = inner.meta_state();
        state.catalog.apply(record);
        Ok(state.catalog.users.clone())
    }

    /// Delete a queue with its messages; its consumers see the end of their stream. The
    /// deletion record is durable before any file goes (a crash part way leaves files that the
    /// next start removes); no lock is held across the disk.
    pub async fn delete(&self, name: &str) -> BrokerResult<()> {
        if let Some(cluster) = &self.inner.config.cluster_metadata {
            return cluster.delete(name.to_string()).await;
        }
        // On a task of its own, like `declare`: the deletion, once durable, always finishes.
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move { broker.delete_here(&name).await })
            .await
            .map_err(|e| BrokerError::Closed(format!("delete: {e}")))?
    }

    /// Delete a replicated queue, as the cluster's metadata group decided it: this node's
    /// copies go.
    pub async fn delete_replicated(&self, name: &str) -> BrokerResult<()> {
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move { broker.delete_here(&name).await })
            .await
            .map_err(|e| BrokerError::Closed(format!("delete: {e}")))?
    }

    /// Move partition `index` of replicated queue `name` onto `replicas`, as the cluster's
    /// metadata group decided at `version` (its record's offset); this node is `node`. A
    /// change not newer than the partition's current version changes nothing (the group's
    /// records are applied again at every start). This node's copy:
    /// - stays a replica: only the recorded set changes;
    /// - becomes one: its replica opens as joining (it never forms the group; the replicas it
    ///   knew, without this node, are recorded as its formation) and the group's leader adds
    ///   it;
    /// - is no longer one: its log and its files go. Call this only once the replica retired
    ///   (the group's committed voters no longer name this node), else a majority could miss
    ///   its vote;
    /// - was none and is none: its "elsewhere" log names the new replicas.
    ///
    /// The partition's owner is replaced; consumers of the queue here keep their
    /// subscription, except those of a partition this node led, which are ended with "not the
    /// leader" (they subscribe again at the leader, as after a step-down).
    pub async fn set_partition_replicas(
        &self,
        name: &str,
        index: u32,
        replicas: Vec<u64>,
        version: u64,
        node: u64,
    ) -> BrokerResult<()> {
        let broker = self.clone();
        let name = name.to_string();
        // On a task of its own, like `declare`: a caller that goes away does not cut the
        // change between its durable record and the owner's replacement.
        tokio::spawn(async move {
            broker
                .set_replicas_here(&name, index, replicas, version, node)
                .await
        })
        .await
        .map_err(|e| BrokerError::Closed(format!("moving a partition: {e}")))?
    }

    async fn set_replicas_here(
        &self,
        name: &str,
        index: u32,
        replicas: Vec<u64>,
        version: u64,
        node: u64,
    ) -> BrokerResult<()> {
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let decl = inner.declared(name)?;
        let i = index as usize;
        let before = match decl.replicas.get(i) {
            Some(before) if !replicas.is_empty() => before.clone(),
            _ => {
                return Err(BrokerError::Invalid(format!(
                    "queue {name:?}: partition {index} of {} cannot move onto {replicas:?} \
                     (only a replicated queue's partitions move, onto at least one node)",
                    decl.replicas.len()
                )))
            }
        };
        if decl.replicas_version(i) >= version {
            return Ok(());
        }
        let (was, now) = (before.contains(&node), replicas.contains(&node));
        let formation = if now && !was { before } else { Vec::new() };
        let record = MetaRecord::PartitionReplicasChanged {
            id: decl.id,
            index,
            replicas: replicas.clone(),
            formation: formation.clone(),
            version,
        };
        if was && now {
            inner
                .meta_log()?
                .write(&record, (inner.config.clock)())
                .await?;
            inner.meta_state().catalog.apply(record);
            drop(claim);
            return Ok(());
        }
        let queue = inner.queue(name)?;
        let handle = queue.partitions.get(i).ok_or_else(|| {
            BrokerError::Invalid(format!("queue {name:?} has no partition {index} here"))
        })?;
        // The new log first: if it cannot open, nothing changed and the change is retried. A
        // node that stops after the record below and before the old files went finds them at
        // its next start, where a partition it holds no copy of opens nothing of them.
        let mut moved = decl.clone();
        moved.set_partition_replicas(i, replicas, formation, version);
        let opener = inner.clone();
        let placed = moved.clone();
        let (log, state, device) = blocking(move || opener.open_partition(&placed, i)).await?;
        let written = match inner.meta_log() {
            Ok(meta) => meta.write(&record, (inner.config.clock)()).await,
            Err(error) => Err(error),
        };
        if let Err(error) = written {
            let _ = blocking(move || log.delete()).await;
            return Err(error);
        }
        inner.meta_state().catalog.apply(record);
        let ctx = inner.owner_context(&moved, index, device, inner.dead_letter_sink());
        let link = log.clone();
        let next = owner::spawn(ctx, log, state, Some(handle.figures.clone()));
        handle.figures.log.set(&link);
        let replaced = handle.replace_owner(next);
        let (reply, answer) = tokio::sync::oneshot::channel();
        let _ = replaced.send(Command::Replace { reply });
        // The claim is held until the old copy is gone: a later move of the same partition
        // must not open the directory its files are being removed from.
        let answer = answer.await;
        drop(claim);
        match answer {
            Ok(Ok(consumers)) => {
                for consumer in consumers {
                    handle.subscribe(consumer);
                }
                Ok(())
            }
            Ok(Err(error)) => {
                // The new owner serves; only the old copy's files may be left (removed at the
                // next start).
                tracing::warn!(queue = name, partition = index, %error, "removing the copy this node no longer holds failed");
                Ok(())
            }
            Err(_) => Ok(()),
        }
    }

    async fn delete_here(&self, name: &str) -> BrokerResult<()> {
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let id = inner
            .meta_state()
            .catalog
            .by_name(name)
            .map(|d| d.id)
            .ok_or_else(|| BrokerError::NotFound(name.into()))?;
        let queue = inner.queue(name)?;
        let record = MetaRecord::QueueDeleted { id };
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        inner.meta_state().catalog.apply(record);
        inner.unpublish(name);
        drop(claim);
        // The deletion is durable: whatever a partition's log fails at (a stopped log can hold
        // the scratch file of a segment it could not allocate), its files go below.
        for partition in &queue.partitions {
            if let Err(error) = partition.request(|reply| Command::Delete { reply }).await {
                tracing::warn!(queue = name, partition = partition.index, %error, "deleting a partition's log failed; removing its files");
            }
        }
        let remover = inner.clone();
        blocking(move || remover.remove_queue_dirs(id)).await
    }

    /// Make sure an answer "queue `name` does not exist" would be true of the cluster, before a
    /// request on `name` is served. `Ok` at once when the queue exists here or the node is not
    /// in a cluster (a map lookup: the cost of a request on a known queue). In a cluster, when
    /// the queue is not known here, it waits until this node applied every metadata record
    /// committed before the call ([`ClusterMetadata::catch_up`]): a queue declared through
    /// another node a moment ago is then found, and one still missing does not exist.
    /// [`BrokerError::MetadataUnavailable`] (503) when that cannot finish in time.
    pub async fn catch_up_for(&self, name: &str) -> BrokerResult<()> {
        let Some(cluster) = &self.inner.config.cluster_metadata else {
            return Ok(());
        };
        if self.inner.queues_read().contains_key(name) || self.is_stream(name) {
            return Ok(());
        }
        cluster.catch_up(name.to_string()).await
    }

    /// Remove every ready message; inflight ones stay until settled. Returns how many went.
    ///
    /// In a cluster each partition is purged on its leader: here for those this node leads,
    /// through the cluster service ([`ClusterMetadata::purge_at`]) for the others, all at
    /// once; a partition whose leader moves meanwhile, or has none yet (an election), is
    /// asked again at the leader named, within [`PURGE_LEADER_WAIT`]. When a partition cannot
    /// be purged the error is its own (421 when no leader was found in time), and the
    /// partitions purged meanwhile stay purged: purging again removes what is ready then.
    pub async fn purge(&self, name: &str) -> BrokerResult<u64> {
        let queue = self.inner.queue(name)?;
        let purges: Vec<_> = (0..queue.partitions.len())
            .map(|index| {
                let broker = self.clone();
                let queue = queue.clone();
                tokio::spawn(async move { broker.purge_partition_anywhere(&queue, index).await })
            })
            .collect();
        let mut total: u64 = 0;
        let mut first_error = None;
        for purge in purges {
            let outcome = purge
                .await
                .unwrap_or_else(|e| Err(BrokerError::Closed(format!("purge: {e}"))));
            match outcome {
                Ok(count) => total = total.saturating_add(count),
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(total),
        }
    }

    /// A handle that does not keep the broker open (for hooks the broker itself holds, and
    /// the cluster service).
    pub fn downgrade(&self) -> WeakBroker {
        WeakBroker(Arc::downgrade(&self.inner))
    }

    /// Purge partition `index` of queue `name` here; [`BrokerError::NotLeader`] when this node
    /// does not lead it (what another node's [`Broker::purge`] asks of the leader).
    pub async fn purge_partition(&self, name: &str, index: u32) -> BrokerResult<u64> {
        let queue = self.inner.queue(name)?;
        let partition = queue.partitions.get(index as usize).ok_or_else(|| {
            BrokerError::Invalid(format!(
                "queue {name:?} has partitions 0 to {}, not {index}",
                queue.partitions.len().saturating_sub(1)
            ))
        })?;
        partition.purge().await
    }

    /// Purge partition `index` of `queue` on its leader, wherever it is (see [`Broker::purge`]).
    async fn purge_partition_anywhere(&self, queue: &Queue, index: usize) -> BrokerResult<u64> {
        let deadline = tokio::time::Instant::now() + PURGE_LEADER_WAIT;
        let name = queue.name().to_string();
        // The node to ask next: `None` this one.
        let mut at: Option<u64> = None;
        loop {
            let outcome = match (at, &self.inner.config.cluster_metadata) {
                (Some(leader), Some(cluster)) => {
                    cluster.purge_at(name.clone(), index as u32, leader).await
                }
                _ => queue.partitions[index].purge().await,
            };
            let leader = match &outcome {
                Err(BrokerError::NotLeader { leader, .. })
                    if self.inner.config.cluster_metadata.is_some() =>
                {
                    *leader
                }
                _ => return outcome,
            };
            // A leader named is asked at once; none named (an election, or a node naming
            // itself while it takes over) is asked again here after a pause.
            let next = leader.filter(|leader| at != Some(*leader));
            if next.is_none() {
                if tokio::time::Instant::now() + PURGE_LEADER_PAUSE >= deadline {
                    return outcome;
                }
                tokio::time::sleep(PURGE_LEADER_PAUSE).await;
            } else if tokio::time::Instant::now() >= deadline {
                return outcome;
            }
            at = next;
        }
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
        if self.inner.stream(name).is_ok() {
            return true; // a stream has no per-stream limit
        }
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

    /// The partition of queue `name` that `message` goes to (by its routing key; without one
    /// by its producer mark; else round robin), as a publish here would route it.
    pub fn route(&self, name: &str, message: &Message) -> BrokerResult<u32> {
        match self.inner.queue(name) {
            Ok(queue) => Ok(queue.route(message) as u32),
            Err(_) if self.inner.stream(name).is_ok() => Err(BrokerError::NameTaken {
                name: name.to_string(),
                kind: "stream",
            }),
            Err(error) => Err(error),
        }
    }

    /// Dead-lettering's publish into partition `partition` of queue `name`, which this node
    /// must lead (else [`BrokerError::NotLeader`] naming the leader): `payloads` are encoded
    /// messages ([`Message::encode`]); never held back by the resource gate, refused when the
    /// queue is full (`reject`). Their offsets once committed.
    pub async fn publish_internal_to(
        &self,
        name: &str,
        partition: u32,
        payloads: Vec<Vec<u8>>,
    ) -> BrokerResult<std::ops::Range<u64>> {
        let queue = self.inner.queue(name)?;
        let handle = queue.partitions.get(partition as usize).ok_or_else(|| {
            BrokerError::Invalid(format!(
                "queue {name:?} has {} partitions, not {}",
                queue.partitions.len(),
                partition + 1
            ))
        })?;
        let timestamp_ms = (self.inner.config.clock)();
        handle
            .dispatch(payloads, timestamp_ms, true)
            .await
            .unwrap_or_else(|_| Err(BrokerError::Closed(format!("queue {name:?}"))))
    }

    /// Messages this node holds until their dead-letter copies are confirmed, over all
    /// partitions.
    pub fn dead_letters_held(&self) -> u64 {
        self.inner.dead_letters_held.get()
    }

    /// Subscribe to a queue with a prefetch (most unsettled deliveries at once).
    pub fn subscribe(&self, name: &str, prefetch: u32) -> BrokerResult<Consumer> {
        self.subscribe_with(name, SubscribeOptions::prefetch(prefetch))
    }

    /// The node-wide budget of delivery bytes held in memory.
    pub fn delivery_budget(&self) -> Arc<ByteBudget> {
        self.inner.delivery_budget()
    }

    /// The node-wide budget of payload bytes read for relocation and not yet written back
    /// ([`RELOCATION_BYTES_MAX`]).
    pub fn relocation_budget(&self) -> Arc<ByteBudget> {
        self.inner.relocation_budget()
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
        if options.prefetch_bytes == Some(0) {
            return Err(BrokerError::Invalid(
                "prefetch_bytes 0: expected at least 1 (or none for no byte bound)".into(),
            ));
        }
        let queue = self.inner.queue(name)?;
        // A replicated queue's consumer attaches where its partitions are led: a node leading
        // none of them sends it to the leader of the first.
        if let Some(first) = queue.partitions.first() {
            if !queue.partitions.iter().any(|p| p.figures.role().leading) {
                return Err(first.figures.role().not_leader(name, first.index));
            }
        }
        let slot = self.inner.consumer_slot()?;
        let id = self.inner.next_consumer.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = mpsc::channel(prefetch as usize);
        let credit = Arc::new(Credit::new(prefetch, options.prefetch_bytes));
        let ended = Arc::new(std::sync::OnceLock::new());
        let link = Arc::new(ConsumerLink {
            id,
            sender,
            credit: credit.clone(),
            outbound: options.outbound,
            queue: Arc::downgrade(&queue),
            ended: ended.clone(),
        });
        for partition in &queue.partitions {
            partition.subscribe(link.clone());
        }
        Ok(Consumer::new(id, queue, receiver, ended, slot))
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

    /// The node's bounds with what they count now: (queues, queues_max), (partitions,
    /// partitions_max), (consumers, consumers_max). Declares in flight are not counted yet.
    pub fn bounds(&self) -> NodeBounds {
        let (queues, partitions) = {
            let state = self.inner.meta_state();
            (
                state.catalog.queues.len() as u64,
                state.catalog.partitions(),
            )
        };
        let config = &self.inner.config;
        NodeBounds {
            queues: (queues, u64::from(config.queues_max)),
            partitions: (partitions, u64::from(config.partitions_max)),
            consumers: (self.consumer_count(), u64::from(config.consumers_max)),
        }
    }

    /// Consumers alive over all queues (against `consumers_max`).
    pub fn consumer_count(&self) -> u64 {
        self.inner.consumers.load(Ordering::Relaxed)
    }

    /// Close every log cleanly: pending appends finish, seals are synced. Metadata operations
    /// in flight finish first; later ones are refused as closed.
    pub async fn shutdown(&self) -> BrokerResult<()> {
        self.inner.meta_state().closed = true;
        // Bounded: a metadata write waits for its sync, which a stalled disk can hold up.
        let deadline = tokio::time::Instant::now() + SHUTDOWN_WAIT;
        while self.inner.meta_state().claims.busy_count() > 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let queues: Vec<Arc<Queue>> = {
            let mut map = self.inner.queues_write();
            std::mem::take(&mut *map).into_values().collect()
        };
        for queue in queues {
            for partition in &queue.partitions {
                partition.request(|reply| Command::Close { reply }).await?;
            }
        }
        self.inner.close_streams().await?;
        let meta = self
            .inner
            .meta_log
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut meta) = meta {
            // A writer still holding it (past the deadline) closes it when it lets go.
            while Arc::strong_count(&meta) > 1 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            loop {
                match Arc::try_unwrap(meta) {
                    Ok(meta) => return blocking(move || meta.close()).await,
                    Err(shared) if tokio::time::Instant::now() < deadline => {
                        meta = shared;
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                    Err(_) => break,
                }
            }
        }
        Ok(())
    }
}

/// How long `shutdown` waits for metadata operations in flight.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl BrokerInner {
    pub(crate) fn delivery_budget(&self) -> Arc<ByteBudget> {
        self.delivery_budget.clone()
    }

    pub(crate) fn relocation_budget(&self) -> Arc<ByteBudget> {
        self.relocation_budget.clone()
    }

    fn queues_read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Queue>>> {
        self.queues.read().unwrap_or_else(|e| e.into_inner())
    }

    fn queues_write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<Queue>>> {
        self.queues.write().unwrap_or_else(|e| e.into_inner())
    }

    fn queue(&self, name: &str) -> BrokerResult<Arc<Queue>> {
        self.queues_read()
            .get(name)
            .cloned()
            .ok_or_else(|| BrokerError::NotFound(name.into()))
    }

    /// Queue `name`'s declaration as the node's metadata holds it.
    fn declared(&self, name: &str) -> BrokerResult<QueueDecl> {
        self.meta_state()
            .catalog
            .by_name(name)
            .cloned()
            .ok_or_else(|| BrokerError::NotFound(name.into()))
    }

    fn meta_state(&self) -> std::sync::MutexGuard<'_, MetaState> {
        self.meta_state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The metadata log, for one write.
    fn meta_log(&self) -> BrokerResult<Arc<MetaLog>> {
        self.meta_log
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| BrokerError::Closed("broker".into()))
    }

    /// Claim `name` for one metadata operation, waiting while another holds it.
    async fn claim(&self, name: &str) -> BrokerResult<NameClaim<'_>> {
        loop {
            let claim = {
                let mut state = self.meta_state();
                if state.closed {
                    return Err(BrokerError::Closed("broker".into()));
                }
                state.claims.claim(name)
            };
            match claim {
                Claim::Taken => {
                    return Ok(NameClaim {
                        inner: self,
                        name: name.to_string(),
                    })
                }
                // Errs once the holder gives the claim back: then try again.
                Claim::Wait(mut released) => while released.changed().await.is_ok() {},
            }
        }
    }

    /// Whether one more queue or stream (`kind`) of `new_partitions` fits the node's bounds,
    /// counting declares in flight. Streams count as queues against `queues_max`, and their
    /// partitions against `partitions_max` (each is a log with an owner task).
    fn check_room(
        &self,
        state: &MetaState,
        kind: &str,
        name: &str,
        new_partitions: u32,
    ) -> BrokerResult<()> {
        let queues = (state.catalog.queues.len() + state.catalog.streams.len()) as u64
            + state.claims.reserved_queues;
        let queues_max = self.config.queues_max;
        if queues + 1 > u64::from(queues_max) {
            return Err(BrokerError::NodeFull(format!(
                "{kind} {name:?}: the node has {queues} queues and streams, its most \
                 (server.queues_max = {queues_max}); delete a queue or stream, or raise \
                 server.queues_max"
            )));
        }
        let partitions = state.catalog.partitions() + state.claims.reserved_partitions;
        let partitions_max = self.config.partitions_max;
        if partitions + u64::from(new_partitions) > u64::from(partitions_max) {
            return Err(BrokerError::NodeFull(format!(
                "{kind} {name:?} with {new_partitions} partitions: the node has {partitions} \
                 of its {partitions_max} partitions (server.partitions_max); delete a queue or \
                 stream, declare fewer partitions or raise server.partitions_max"
            )));
        }
        Ok(())
    }

    /// A consumer's place under `consumers_max`, given back when the consumer goes.
    pub(crate) fn consumer_slot(&self) -> BrokerResult<ConsumerSlot> {
        let max = u64::from(self.config.consumers_max);
        let taken = self
            .consumers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if !taken {
            return Err(BrokerError::Limited {
                reason: "consumers".into(),
                retry_after_ms: CONSUMERS_RETRY_AFTER_MS,
                message: format!(
                    "the node has {max} consumers, its most (server.consumers_max); cancel \
                     consumers or raise server.consumers_max; retry after \
                     {CONSUMERS_RETRY_AFTER_MS} ms"
                ),
            });
        }
        Ok(ConsumerSlot::new(self.consumers.clone()))
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

    /// Open a queue's partition logs and rebuild their states (blocking).
    fn open_partitions(&self, decl: &QueueDecl) -> BrokerResult<OpenedPartitions> {
        (0..decl.placement.len())
            .map(|index| self.open_partition(decl, index))
            .collect()
    }

    /// Open partition `index`'s log as `decl` places it and rebuild its state (blocking).
    fn open_partition(
        &self,
        decl: &QueueDecl,
        index: usize,
    ) -> BrokerResult<(Arc<dyn PartitionLog>, PartitionState, u64)> {
        let io = self.config.io.clone();
        let storage = decl.placement.get(index).ok_or_else(|| {
            BrokerError::Invalid(format!("queue {:?} has no partition {index}", decl.name))
        })?;
        let dir = partition_dir(storage, decl.id, index as u32);
        let options = LogOptions {
            full_segment_size_bytes: self.config.segment_size_bytes,
            ..LogOptions::default()
        };
        let replicas = decl.replicas.get(index).filter(|r| !r.is_empty());
        let log: Arc<dyn PartitionLog> = match (replicas, &self.config.partition_logs) {
            (Some(replicas), Some(logs)) => logs.open(&PartitionPlace {
                io: io.clone(),
                pool: self.pool.clone(),
                segment_size_bytes: self.config.segment_size_bytes,
                size_class: keratin_log::SizeClass::Full,
                queue_id: decl.id,
                queue: decl.name.clone(),
                index: index as u32,
                dir: dir.clone(),
                replicas: replicas.clone(),
                formation: decl.formation.get(index).filter(|f| !f.is_empty()).cloned(),
            })?,
            (Some(_), None) => {
                return Err(BrokerError::Invalid(format!(
                    "queue {:?} is replicated, and this node runs without a cluster; \
                     start it with its [cluster] settings",
                    decl.name
                )))
            }
            (None, _) => {
                let log = Log::open(io.clone(), &dir, options, Some(self.pool.clone()))?;
                Arc::new(LocalLog::new(
                    log,
                    io.clone(),
                    self.config.segment_size_bytes,
                ))
            }
        };
        let state = rebuild(log.as_ref(), None)?;
        // The storage directory's: a log creates its own directory at its first append.
        let device = io
            .device_id(storage)
            .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
        Ok((log, state, device))
    }

    /// Start a declared queue: open its logs on the blocking pool, then spawn its owners and
    /// publish it.
    async fn start_queue(self: &Arc<Self>, decl: &QueueDecl) -> BrokerResult<()> {
        let opener = self.clone();
        let owned = decl.clone();
        let opened = blocking(move || opener.open_partitions(&owned)).await?;
        self.spawn_queue(decl, opened);
        Ok(())
    }

    /// Spawn the owners of a queue's opened partitions and publish the queue.
    fn spawn_queue(self: &Arc<Self>, decl: &QueueDecl, opened: OpenedPartitions) {
        let mut partitions = Vec::with_capacity(opened.len());
        let dead_letters = self.dead_letter_sink();
        for (index, (log, state, device)) in opened.into_iter().enumerate() {
            let ctx = self.owner_context(decl, index as u32, device, dead_letters.clone());
            let link = log.clone();
            let handle = owner::spawn(ctx, log, state, None);
            handle.figures.log.set(&link);
            partitions.push(handle);
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
    }

    /// Where this node's partitions send their dead letters: the configured sink, or this
    /// node's own queues.
    fn dead_letter_sink(self: &Arc<Self>) -> Arc<dyn DeadLetterSink> {
        match &self.config.dead_letters {
            Some(sink) => sink.clone(),
            None => Arc::new(LocalDeadLetters::new(Arc::downgrade(self))),
        }
    }

    /// What the owner of partition `index` of `decl` runs with.
    fn owner_context(
        self: &Arc<Self>,
        decl: &QueueDecl,
        index: u32,
        device: u64,
        dead_letters: Arc<dyn DeadLetterSink>,
    ) -> OwnerContext {
        OwnerContext {
            device,
            gate: self.config.gate.clone(),
            queue: decl.name.clone(),
            index,
            settings: decl.settings.clone(),
            broker: Arc::downgrade(self),
            dead_letters,
            dead_letter_producer: dead_letter_producer(decl.id, index),
            dead_letters_held: self.dead_letters_held.clone(),
            clock: self.config.clock.clone(),
            segment_size_bytes: self.config.segment_size_bytes,
            publish_timeout: self.config.publish_timeout,
            idle_release_after: self.config.idle_release_after,
        }
    }

    /// Open every declared queue at start, [`OPEN_PARALLEL`] at a time.
    async fn open_queues(self: &Arc<Self>, decls: Vec<QueueDecl>) -> BrokerResult<()> {
        let mut opening = tokio::task::JoinSet::new();
        let mut decls = decls.into_iter();
        loop {
            while opening.len() < OPEN_PARALLEL {
                let Some(decl) = decls.next() else { break };
                let opener = self.clone();
                opening.spawn_blocking(move || {
                    let opened = opener.open_partitions(&decl);
                    (decl, opened)
                });
            }
            let Some(joined) = opening.join_next().await else {
                return Ok(());
            };
            let (decl, opened) =
                joined.map_err(|e| BrokerError::Closed(format!("opening queues: {e}")))?;
            self.spawn_queue(&decl, opened?);
        }
    }

    /// A declared queue whose logs could not be opened: write its deletion and remove what was
    /// created, so that the metadata and the queues agree again (best effort: if this fails
    /// too, the next start opens or removes it).
    async fn undo_declare(self: &Arc<Self>, decl: &QueueDecl) {
        let record = MetaRecord::QueueDeleted { id: decl.id };
        let written = match self.meta_log() {
            Ok(meta) => meta.write(&record, (self.config.clock)()).await,
            Err(e) => Err(e),
        };
        if let Err(error) = written {
            tracing::warn!(queue = decl.name, %error, "undoing a failed declare failed; the next start retries");
            return;
        }
        self.meta_state().catalog.apply(record);
        let remover = self.clone();
        let id = decl.id;
        if let Err(error) = blocking(move || remover.remove_queue_dirs(id)).await {
            tracing::warn!(queue = decl.name, %error, "removing a failed declare's files failed; the next start retries");
        }
    }

    /// Take a queue out of the maps readers and publishers use.
    fn unpublish(&self, name: &str) {
        self.queues_write().remove(name);
        self.placements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
    }

    fn info_of(&self, queue: &Queue) -> QueueInfo {
        let preferred: Vec<Option<u64>> = self
            .meta_state()
            .catalog
            .by_name(&queue.name)
            .map(|decl| decl.replicas.iter().map(|r| r.first().copied()).collect())
            .unwrap_or_default();
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
                let role = f.role();
                let replication = f.log.replication();
                let committed_offset = replication.as_ref().map(|r| r.committed_offset);
                let replication = replication.unwrap_or_default();
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
                    dead_letters_held: f.dead_letters_held.load(Ordering::Relaxed),
                    leading: role.leading,
                    leader: role.leader,
                    leader_addr: role.addr,
                    in_sync: replication.in_sync(),
                    replica_lag: replication
                        .progress
                        .iter()
                        .map(|r| (r.node, r.lag_entries))
                        .collect(),
                    replicas: replication.replicas,
                    preferred_leader: preferred.get(p.index as usize).copied().flatten(),
                    leader_changes: f.leader_changes.load(Ordering::Relaxed),
                    leaderless_ms: replication.leaderless_ms,
                    committed_offset,
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
            appends: Vec::new(),
        };
        let queue = match self.queue(name) {
            Ok(queue) => queue,
            Err(_) if self.stream(name).is_ok() => {
                return self.dispatch_stream(pending, messages, joined);
            }
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
            let p = queue.route(message);
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
    /// finish) go back to the pool. A directory whose id no declaration record names (the
    /// metadata log lost records: a declaration is durable before its directory is made) is
    /// refused with [`BrokerError::MetadataLost`], never removed.
    fn remove_orphans(
        &self,
        declared: &std::collections::BTreeSet<u64>,
        declared_ever: &std::collections::BTreeSet<u64>,
    ) -> BrokerResult<()> {
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
                if declared.contains(&id) {
                    continue;
                }
                if !declared_ever.contains(&id) {
                    return Err(self.metadata_lost("queue", id, &queues.join(&name)));
                }
                tracing::info!(queue_id = id, "removing the files of a deleted queue");
                self.remove_queue_dirs(id)?;
            }
        }
        Ok(())
    }

    /// The refusal of a data directory no declaration names (see [`Self::remove_orphans`]).
    pub(super) fn metadata_lost(&self, kind: &'static str, id: u64, dir: &Path) -> BrokerError {
        BrokerError::MetadataLost {
            kind,
            id,
            dir: dir.display().to_string(),
            meta: self.meta_figures.dir.display().to_string(),
        }
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

/// Dead-lettering into a queue of this node.
pub(crate) struct LocalDeadLetters {
    broker: std::sync::Weak<BrokerInner>,
}

impl LocalDeadLetters {
    pub(crate) fn new(broker: std::sync::Weak<BrokerInner>) -> LocalDeadLetters {
        LocalDeadLetters { broker }
    }
}

impl DeadLetterSink for LocalDeadLetters {
    fn is_open(&self) -> bool {
        self.broker.strong_count() > 0
    }

    fn publish(&self, queue: &str, messages: Vec<Message>) -> DeadLettering {
        let broker = self.broker.upgrade();
        let queue = queue.to_string();
        Box::pin(async move {
            match broker {
                Some(broker) => {
                    let results = broker.publish_internal(&queue, messages).await;
                    results.into_iter().map(|r| r.map(|_| ())).collect()
                }
                None => {
                    let error = BrokerError::Closed("the broker".into());
                    messages.iter().map(|_| Err(error.clone())).collect()
                }
            }
        })
    }
}

/// Offer a stopped metadata log a heal every `METADATA_HEAL_INTERVAL` until the broker is
/// dropped or shut down. The heal (recovery reads) runs on the blocking pool.
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
            let Ok(meta) = inner.meta_log() else {
                return;
            };
            drop(inner);
            let _ = tokio::task::spawn_blocking(move || meta.maybe_heal()).await;
        }
    });
}
