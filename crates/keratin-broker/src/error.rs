//! `BrokerError`, the error type of the broker core. Each variant maps to one wire code
//! (`keratin-proto::codes`) in the server; the text says what happened and what to do.

use keratin_log::LogError;

/// An error of the broker core.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// No queue of that name.
    #[error("queue {0:?} does not exist; declare it first")]
    NotFound(String),
    /// In a cluster: queue `queue` is not known on this node, and the node could not make sure
    /// its copy of the cluster's metadata is current (no metadata leader reachable within the
    /// bound), so it cannot say whether the queue exists. Nothing was applied; retry after
    /// `retry_after_ms`.
    #[error("queue {queue:?} is not known on this node, and the node could not check the cluster's metadata: {why}; retry after {retry_after_ms} ms")]
    MetadataUnavailable {
        /// The queue asked for.
        queue: String,
        /// Why the check failed.
        why: String,
        /// When a retry may succeed (a metadata leader is usually elected by then).
        retry_after_ms: u32,
    },
    /// No stream of that name.
    #[error("stream {0:?} does not exist; declare it first (keratin stream declare)")]
    StreamNotFound(String),
    /// The name is taken by the other kind: queues and streams share one name space.
    #[error("{name:?} is a {kind}, and queues and streams share one name space; delete the {kind} or choose another name")]
    NameTaken {
        /// The name.
        name: String,
        /// `queue` or `stream`: what holds the name.
        kind: &'static str,
    },
    /// The queue (or stream) exists with other settings.
    #[error("{name:?} exists with other settings ({existing}); delete it or declare it with the same settings")]
    Conflict {
        /// The queue or stream.
        name: String,
        /// Its current settings, as text.
        existing: String,
    },
    /// A stream partition another member of a consumer group reads: that member commits its
    /// position.
    #[error("{0}")]
    HeldByGroupMember(String),
    /// The node holds as many queues or partitions as it may (`queues_max`,
    /// `partitions_max`); a declare succeeds once queues are deleted or the bound is raised.
    #[error("node full: {0}")]
    NodeFull(String),
    /// A request that can never succeed as sent.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A message too large to store: its record would not fit in a segment. Never succeeds as
    /// sent.
    #[error("message too large: {0}")]
    TooLarge(String),
    /// The partition's log stopped after a write error; it takes no writes until healed.
    #[error("queue {queue:?} partition {partition} is unavailable: {source}")]
    Unavailable {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// Why.
        source: LogError,
    },
    /// The partition's log stopped while this write was in flight: it may or may not be durable
    /// (a retry can duplicate it).
    #[error("queue {queue:?} partition {partition}: the outcome is unknown, the log failed while writing: {source}")]
    OutcomeUnknown {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// Why.
        source: LogError,
    },
    /// This node stopped leading the partition (deposed, or cut off from a majority of its
    /// replicas) while the publish was in flight, and its fate was not known within the
    /// step-down grace: the new leader may commit it or cut it. Mapped like
    /// [`BrokerError::OutcomeUnknown`].
    #[error("queue {queue:?} partition {partition}: this node stopped leading the partition while the publish was in flight ({why}); the outcome is unknown: an idempotent producer (the Keratin client's default) may publish it again with the same sequence, any other retry may store it twice")]
    LeadershipLost {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// What this node knows of the leadership now.
        why: String,
    },
    /// The publish was not confirmed within the broker's publish timeout (the disk is slow or
    /// stalled): it may or may not be stored, so a retry can duplicate it. Mapped like
    /// [`BrokerError::OutcomeUnknown`].
    #[error("queue {queue:?} partition {partition}: the publish was not confirmed within {timeout_ms} ms (the disk is slow or stalled); the outcome is unknown, a retry may store it twice")]
    TimedOut {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// The publish timeout that passed.
        timeout_ms: u64,
    },
    /// A resource limit refused the request (a publish: disk, memory, a full queue; a
    /// subscribe: the node's consumers); nothing was applied, so retrying is safe.
    #[error("{message}")]
    Limited {
        /// `disk`, `memory`, `queue_full` or `consumers`.
        reason: String,
        /// When a retry may succeed.
        retry_after_ms: u32,
        /// What happened and what to do.
        message: String,
    },
    /// The storage engine failed outside a partition's write path (opening, metadata).
    #[error("storage: {0}")]
    Log(#[from] LogError),
    /// A directory of queue or stream data belongs to no declaration the node's metadata log
    /// holds: the log lost records. Nothing is deleted, and the node does not start.
    #[error("{dir} holds the data of {kind} id {id}, which no record of the node's metadata log ({meta}) declares: the metadata log has lost records (damaged, or replaced by an older copy). Nothing was deleted. Restore the metadata log from a backup; on a cluster node you can instead move the node's data directory away and start the node empty, to rebuild its copies from the other nodes; to give up that {kind}'s data, remove its directory")]
    MetadataLost {
        /// `"queue"` or `"stream"`.
        kind: &'static str,
        /// The id the directory is named by.
        id: u64,
        /// The directory.
        dir: String,
        /// The metadata log's directory.
        meta: String,
    },
    /// A record in a log does not decode: the log was written by something else or is damaged.
    #[error("undecodable {what} record at offset {offset}: {reason}")]
    Corrupt {
        /// Which kind of record.
        what: &'static str,
        /// Its offset.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// This node does not lead the partition (a replicated queue): send the request to the
    /// leader. A publish in flight when leadership moved may or may not be stored (a retry
    /// with the same producer id and sequence is dropped as a duplicate).
    #[error("queue {queue:?} partition {partition} is led by {}; send it there", match (.leader, .addr) {
        (Some(id), Some(addr)) => format!("node {id} at {addr}"),
        (Some(id), None) => format!("node {id} (its address is not known here yet; retry shortly)"),
        _ => "no node yet (an election is under way; retry shortly)".to_string(),
    })]
    NotLeader {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// The leader's node id, if one is known.
        leader: Option<u64>,
        /// The leader's client address (`host:port` of its protocol listener), if known.
        addr: Option<String>,
    },
    /// In a cluster: the node that leads the partition could not be reached or did not answer
    /// in time, so a request sent to it may or may not have been applied there. Mapped like
    /// [`BrokerError::OutcomeUnknown`].
    #[error("queue {queue:?} partition {partition}: {why}; the outcome is unknown")]
    Unreachable {
        /// The queue.
        queue: String,
        /// The partition.
        partition: u32,
        /// Which node, and what went wrong.
        why: String,
    },
    /// The broker or the queue is shutting down or was deleted.
    #[error("{0} is closed")]
    Closed(String),
}

/// Result type of the broker.
pub type BrokerResult<T> = Result<T, BrokerError>;
