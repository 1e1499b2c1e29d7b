//! `PartitionLog`: the partition owner's view of its log, the seam where replication slots in.
//! The owner proposes records and applies them once the log reports them **committed**, in
//! offset order; it reads committed records back by offset; it never sees a record that is not
//! committed. [`LocalLog`](super::local_log::LocalLog) is the single-node implementation over
//! `keratin_log::Log` (committed = durable after the group commit's sync). A replicated
//! implementation (the `keratin-raft` adapter crate) commits on a majority.
//!
//! The methods fall in two groups, both on this one trait because every node keeps its own
//! copy of the log in its own storage, replicated or not:
//! - **replication**: [`PartitionLog::propose`], the [`LogEvents`] of commits (including records
//!   this owner did not propose), [`PartitionLog::reader`] of committed records,
//!   [`PartitionLog::committed_offset`], [`PartitionLog::start_offset`],
//!   [`PartitionLog::truncate_suffix`], and [`PartitionLog::delivery_lease`] (whether the
//!   leader may deliver now);
//! - **storage upkeep** of this node's copy: heal after a write error, prefix removal below the
//!   lowest live payload (space reclaim; on a replicated log, this node's compaction, never
//!   above what it applied), hand-back of an idle log's segments, space figures, close,
//!   delete, and the reset of a stopped log.
//!
//! Threads: the owner runs on an async worker and must never block it. `propose`,
//! `remove_prefix` and `hand_back` return futures that never block; methods documented as
//! blocking (`reader`'s iteration, `heal`, `truncate_suffix`, `close`, `delete`, `reset`) run on
//! the blocking pool; the figures (`committed_offset`, `start_offset`, `disk_bytes`, `space`,
//! `tail_room_bytes`, `replication`, `delivery_lease`) take a short lock.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;

use keratin_log::{LogError, LogReader, LogResult, PrefixRemoval, ReadRecord};

use crate::error::{BrokerError, BrokerResult};

/// Records the owner proposes, with its own sequence number: what the log reports back names
/// it.
pub struct Proposal {
    /// The owner's sequence number of this proposal (increasing by one per proposal).
    pub sequence: u64,
    /// Each record's type byte (`record::ENQUEUE`...), one per payload.
    pub types: Vec<u8>,
    /// Each record's payload, as written.
    pub payloads: Vec<Vec<u8>>,
    /// The records' timestamp.
    pub timestamp_ms: u64,
}

/// What a partition log tells its owner. Sent from any thread, possibly out of order between
/// proposals (the owner orders `Proposed` answers by sequence).
#[derive(Debug)]
pub enum LogEvent {
    /// Proposal `sequence` ended: committed at these offsets, or failed. A storage failure
    /// (`BrokerError::Log`, see [`is_storage_failure`]) after the proposal was queued means
    /// the outcome is unknown (the records may be committed; the log is then stopped, and a
    /// heal tells). Any other error means leadership moved while it was in flight, is
    /// answered as is, and the log keeps running: `BrokerError::NotLeader` when nothing was
    /// written, `BrokerError::LeadershipLost` when its records (some or all) were written and
    /// their fate is unknown (another leader may commit them: they then come as commits, like
    /// any record this owner did not propose).
    Proposed {
        /// The proposal's sequence number.
        sequence: u64,
        /// Its offsets, or why it failed.
        result: BrokerResult<Range<u64>>,
    },
    /// This node's role in the partition changed (a replicated log; a local log always
    /// leads and never sends it). Sent first from `start`, then on every change, in order with
    /// the other events.
    Role(Role),
    /// Every record below `up_to` is committed, including records this owner did not propose
    /// (a follower's log, or a leader catching up on its predecessor's records): the owner
    /// reads and applies those, in order, while none of its own proposals is pending. So a
    /// log must fail the pending proposals of an owner that stops leading, and must not take
    /// an owner's proposals as leader before that owner applied every record committed before
    /// (its own proposals are applied at their offsets, after those). A local log never sends
    /// it (every record of a local log is its owner's proposal, reported by `Proposed`).
    Committed {
        /// One past the last committed offset.
        up_to: u64,
    },
    /// This node's copy of the log failed (a replicated log's storage fenced after a write or
    /// sync error): the owner stops the partition and heals it (`heal`), even with nothing of
    /// its own pending, as a follower's owner has not. A leader's pending proposals also end
    /// with the storage error. A local log never sends it (its failures come as `Proposed`).
    Stopped {
        /// What failed.
        error: LogError,
    },
}

/// Whether a failed proposal's error is its log's storage failure (the owner stops the
/// partition and heals it) rather than a change of leadership (the log runs on). One rule for
/// every owner of a partition log (queue partitions, stream partitions, cursor logs).
pub fn is_storage_failure(error: &BrokerError) -> bool {
    matches!(error, BrokerError::Log(_))
}

/// Who leads a partition, as its log on this node knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    /// This node leads: it takes proposals and delivers.
    pub leading: bool,
    /// The leader's node id, if known (this node's when `leading`).
    pub leader: Option<u64>,
    /// The leader's client address, if known.
    pub addr: Option<String>,
    /// When `leading`: the first offset of this leadership. Messages below it may have been
    /// delivered by an earlier leader and are delivered with `redelivered` set.
    pub from: u64,
}

impl Default for Role {
    fn default() -> Role {
        Role::alone()
    }
}

impl Role {
    /// The role of a single-node log: it leads from offset 0.
    pub fn alone() -> Role {
        Role {
            leading: true,
            leader: None,
            addr: None,
            from: 0,
        }
    }

    /// What this node knows of the leadership, for an answer whose outcome the step-down left
    /// unknown ("node 2 at ... leads it now").
    pub fn leadership_now(&self) -> String {
        match (self.leading, self.leader, &self.addr) {
            (true, _, _) => "this node leads it again".to_string(),
            (false, Some(id), Some(addr)) => format!("node {id} at {addr} leads it now"),
            (false, Some(id), None) => format!("node {id} leads it now"),
            (false, None, _) => {
                "no leader is known here: this node may be cut off from the others".to_string()
            }
        }
    }

    /// The answer to a proposal whose fate the step-down left unknown (it may be committed
    /// yet: an idempotent producer's retry is stored once).
    pub fn leadership_lost(&self, queue: &str, partition: u32) -> BrokerError {
        BrokerError::LeadershipLost {
            queue: queue.to_string(),
            partition,
            why: self.leadership_now(),
        }
    }

    /// The refusal of a request this node cannot serve because another node leads.
    pub fn not_leader(&self, queue: &str, partition: u32) -> BrokerError {
        BrokerError::NotLeader {
            queue: queue.to_string(),
            partition,
            leader: self.leader,
            addr: self.addr.clone(),
        }
    }
}

/// Until when this node may hand messages to consumers as the partition's leader
/// ([`PartitionLog::delivery_lease`]). Deliveries are not entries: nothing in the log stops a
/// deposed leader from delivering what its successor delivers too. A leader that a majority
/// acknowledged at time `t` knows no other node can lead before `t` plus the followers' lease
/// on it; it delivers only until shortly before that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryLease {
    /// For as long as it leads: no other node can lead meanwhile (a single node's log, or a
    /// group whose only voter is this node).
    Held,
    /// Until then: a majority acknowledged this leader recently enough.
    Until(tokio::time::Instant),
    /// Not now: this node does not lead, or no majority acknowledged it recently (cut off from
    /// the others, or just elected and not acknowledged yet).
    Lapsed,
}

impl DeliveryLease {
    /// Whether it allows a delivery at `now`.
    pub fn holds_at(self, now: tokio::time::Instant) -> bool {
        match self {
            DeliveryLease::Held => true,
            DeliveryLease::Until(until) => now < until,
            DeliveryLease::Lapsed => false,
        }
    }
}

/// Where a log sends its [`LogEvent`]s: the owner's command channel. Cheap to clone.
#[derive(Clone)]
pub struct LogEvents(Arc<dyn Fn(LogEvent) + Send + Sync>);

impl LogEvents {
    /// Events go to `send`, which must not block.
    pub fn new(send: impl Fn(LogEvent) + Send + Sync + 'static) -> LogEvents {
        LogEvents(Arc::new(send))
    }

    /// Report `event`.
    pub fn send(&self, event: LogEvent) {
        (self.0)(event)
    }
}

/// A proposal on its way into the log's queue: resolves `Ok` once the log has taken it (its
/// outcome then comes as [`LogEvent::Proposed`]), or with the refusal (nothing was written:
/// `BrokerError::Log` from the storage, `BrokerError::NotLeader` from a replicated log that
/// does not lead). It may wait for room in the log's queue; dropping it before it resolves
/// withdraws the proposal.
pub type Proposing = Pin<Box<dyn Future<Output = BrokerResult<()>> + Send>>;

/// A prefix removal or hand-back in the log's queue.
pub type Removing = Pin<Box<dyn Future<Output = LogResult<PrefixRemoval>> + Send>>;

/// Reads committed records in offset order (blocking: run it on the blocking pool).
pub trait PartitionReader: Iterator<Item = LogResult<ReadRecord>> + Send {
    /// The offset of the next record it reads. (Not `position`: `Iterator` has one.)
    fn next_offset(&self) -> u64;
}

impl PartitionReader for LogReader {
    fn next_offset(&self) -> u64 {
        LogReader::position(self)
    }
}

/// A reader of a partition log.
pub type BoxReader = Box<dyn PartitionReader>;

/// Reads the committed records of `from..until` in offset order, at most `max_count` records
/// or about `max_bytes` of payloads (at least one record); blocking. A gap, or no record where
/// the log says one is committed, is [`BrokerError::Corrupt`] about `what` (a copy that cannot
/// read back what it committed is damaged); a read below the log's start fails with the log's
/// error (the caller checks whether the log restarted past it).
pub(crate) fn read_committed(
    log: &dyn PartitionLog,
    what: &'static str,
    range: Range<u64>,
    max_count: usize,
    max_bytes: usize,
) -> BrokerResult<Vec<ReadRecord>> {
    let mut records = Vec::new();
    let mut bytes = 0usize;
    for (expected, record) in range.clone().zip(log.reader(range.start)) {
        let record = record?;
        if record.offset != expected {
            return Err(BrokerError::Corrupt {
                what,
                offset: record.offset,
                reason: format!("the log skipped from {expected} to {}", record.offset),
            });
        }
        bytes += record.payload.len();
        records.push(record);
        if records.len() >= max_count || bytes >= max_bytes {
            break;
        }
    }
    if records.is_empty() && !range.is_empty() {
        return Err(BrokerError::Corrupt {
            what,
            offset: range.start,
            reason: format!(
                "the log's records end at {}, before its committed end {}",
                range.start, range.end
            ),
        });
    }
    Ok(records)
}

/// This node's storage figures of a log, for space reclaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSpace {
    /// Allocated bytes of its segment files.
    pub disk_bytes: u64,
    /// The first offset of each segment, oldest first.
    pub segment_bases: Vec<u64>,
}

/// The log of one partition, as its owner uses it. See the module docs.
pub trait PartitionLog: Send + Sync + 'static {
    /// Where this log reports proposals' outcomes and commits. Called once, by the owner, before
    /// its first proposal.
    fn start(&self, events: LogEvents);

    /// Propose records. They get consecutive offsets in proposal order; once committed they are
    /// reported as [`LogEvent::Proposed`] (never before they are committed: for a local log,
    /// after the sync that covers them).
    fn propose(self: Arc<Self>, proposal: Proposal) -> Proposing;

    /// A reader of committed records from `offset` (at or above `start_offset`).
    fn reader(&self, offset: u64) -> BoxReader;

    /// One past the last committed record.
    fn committed_offset(&self) -> u64;

    /// The first offset held (records below it were removed).
    fn start_offset(&self) -> u64;

    /// Drop the records from `from` on, which must not be committed (a replicated log's follower
    /// or new leader cutting a divergent suffix). Blocking. A local log holds nothing past its
    /// committed offset: it accepts `from` at or past it and refuses anything lower.
    fn truncate_suffix(&self, from: u64) -> LogResult<()>;

    /// Reopen this node's copy after a write error stopped it (blocking); does nothing on a
    /// running log. Records committed stay; the unsynced tail is cut.
    fn heal(&self) -> LogResult<()>;

    /// Give back whole segments below `before` (no live payload lies below it).
    fn remove_prefix(&self, before: u64) -> LogResult<Removing>;

    /// Give an idle log's segments back to the node's pool, keeping its next offset.
    fn hand_back(&self) -> LogResult<Removing>;

    /// Allocated bytes of this node's copy.
    fn disk_bytes(&self) -> u64;

    /// Bytes an append can still write into the tail segment without allocating.
    fn tail_room_bytes(&self) -> u64;

    /// Segments and disk use, for space reclaim.
    fn space(&self) -> LogSpace;

    /// Close: what is queued is written and synced (blocking). Fails if the log is still
    /// shared (a bug: the last holder's drop closes it).
    fn close(self: Arc<Self>) -> BrokerResult<()>;

    /// Delete this node's copy (blocking).
    fn delete(self: Arc<Self>) -> BrokerResult<()>;

    /// Replace a stopped log that holds nothing delivered by a fresh, empty one in the same
    /// place, offsets starting at 0 (the purge of a stopped log; blocking). Returns the fresh
    /// log, or the old one if it could not be taken, or none. A replicated log refuses: its
    /// purge writes a PURGE record like any other.
    fn reset(self: Arc<Self>) -> (Option<Arc<dyn PartitionLog>>, BrokerResult<()>);

    /// How the partition's copies keep up (replicas, leader, and on the leader each replica's
    /// lag and the in-sync set); `None` for a log that is not replicated. Takes a short lock.
    fn replication(&self) -> Option<super::replication::ReplicationStatus> {
        None
    }

    /// Until when this node may deliver as the partition's leader (see [`DeliveryLease`]);
    /// asked before every round of deliveries. A local log always leads. Takes a short lock.
    fn delivery_lease(&self) -> DeliveryLease {
        DeliveryLease::Held
    }
}

/// Where a partition of a replicated queue lives, for [`PartitionLogs::open`].
#[derive(Clone)]
pub struct PartitionPlace {
    /// The node's file system seam.
    pub io: Arc<dyn keratin_log::Io>,
    /// The node's segment pool (every log of the node allocates from it).
    pub pool: keratin_log::SegmentPool,
    /// The full segment size of partition logs.
    pub segment_size_bytes: u64,
    /// The log's size class: `Full` for partitions' payloads, `Small` (an eighth) for a
    /// stream's cursor log.
    pub size_class: keratin_log::SizeClass,
    /// The queue's id (the same on every node: the metadata group assigns it).
    pub queue_id: u64,
    /// The queue's name.
    pub queue: String,
    /// The partition's index.
    pub index: u32,
    /// This node's directory for its copy of the log.
    pub dir: std::path::PathBuf,
    /// The nodes holding a replica, this one included.
    pub replicas: Vec<u64>,
    /// The voters the partition's group was formed with, when this node's replica joined the
    /// group later (the group grew or moved after it was formed): such a replica must not form
    /// the group, it waits for its leader to add it. `None`: the group was formed with
    /// `replicas` (a queue declared with its groups, every queue before membership changes).
    pub formation: Option<Vec<u64>>,
}

impl std::fmt::Debug for PartitionPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionPlace")
            .field("queue_id", &self.queue_id)
            .field("queue", &self.queue)
            .field("index", &self.index)
            .field("size_class", &self.size_class)
            .field("dir", &self.dir)
            .field("replicas", &self.replicas)
            .field("formation", &self.formation)
            .finish_non_exhaustive()
    }
}

/// Opens the logs of replicated partitions (the cluster's replication adapter). A broker
/// without one keeps every log local.
pub trait PartitionLogs: Send + Sync + 'static {
    /// Open this node's copy of a partition's log, creating it (and its group) if new.
    /// Blocking: runs on the blocking pool.
    fn open(&self, place: &PartitionPlace) -> BrokerResult<Arc<dyn PartitionLog>>;
}

/// A boxed future of the cluster's metadata operations.
pub type MetadataFuture = Pin<Box<dyn Future<Output = BrokerResult<()>> + Send>>;

/// A boxed future of a purge on another node: the count of messages it removed.
pub type PurgeFuture = Pin<Box<dyn Future<Output = BrokerResult<u64>> + Send>>;

/// The cluster's metadata group, as the broker of a cluster node uses it: declaring, deleting
/// and changing the settings of a queue go through the group (on whichever node leads it), and
/// each future resolves once this node has applied the outcome (its broker then holds the
/// queue as the cluster decided, through [`crate::Broker::declare_replicated`],
/// [`crate::Broker::delete_replicated`] and [`crate::Broker::set_settings_replicated`]).
pub trait ClusterMetadata: Send + Sync + 'static {
    /// Declare queue `name` with `settings` in the cluster, its replicas on `nodes` (empty:
    /// placed by the cluster).
    fn declare(
        &self,
        name: String,
        settings: crate::QueueSettings,
        nodes: Vec<u64>,
    ) -> MetadataFuture;
    /// Delete queue `name` in the cluster.
    fn delete(&self, name: String) -> MetadataFuture;
    /// Replace the settings of live queue `name` in the cluster.
    fn set_settings(&self, name: String, settings: crate::QueueSettings) -> MetadataFuture;
    /// Wait until this node has applied every metadata record the cluster committed before
    /// the call (a read index through the metadata group's leader), bounded by a short time;
    /// `name` is the queue the caller did not find, for the error. Only called on the path to
    /// "not found" ([`crate::Broker::catch_up_for`]). Fails with
    /// [`BrokerError::MetadataUnavailable`] when it cannot finish in time.
    fn catch_up(&self, name: String) -> MetadataFuture;
    /// Declare stream `name` with `settings` in the cluster: its partitions and cursor log on
    /// `replicas` nodes (`None`: the cluster's default), on `nodes` when named (empty: placed
    /// by the cluster). Resolves once applied here ([`crate::Broker::declare_stream_replicated`]).
    fn declare_stream(
        &self,
        name: String,
        settings: crate::stream::StreamSettings,
        replicas: Option<u32>,
        nodes: Vec<u64>,
    ) -> MetadataFuture;
    /// Delete stream `name` in the cluster.
    fn delete_stream(&self, name: String) -> MetadataFuture;
    /// Purge partition `index` of queue `name` on node `leader`, which leads it as this node
    /// last heard ([`crate::Broker::purge`] reaches a partition led elsewhere through this):
    /// the count that node removed, or its refusal ([`BrokerError::NotLeader`] with the leader
    /// it knows when the leadership moved, or none known yet; the caller asks again).
    fn purge_at(&self, name: String, index: u32, leader: u64) -> PurgeFuture;
    /// Replace the retention of live stream `name` in the cluster.
    fn set_stream_settings(
        &self,
        name: String,
        settings: crate::stream::StreamSettings,
    ) -> MetadataFuture;
}
