//! Keratin's broker core: durable queues whose partitions are deterministic state machines over
//! segment logs, in process (the network is `keratin-server`'s).
//!
//! # Layout
//! - `broker`: [`Broker`], one node: storage directories, the segment pool, the metadata log,
//!   placement, publish routing, consumers.
//! - `meta`: the node metadata log (queue declarations and deletions) and the catalog it
//!   replays to.
//! - `claims`: queue names with a metadata operation in flight, and the room declares in
//!   flight reserve (no lock across disk I/O).
//! - `queue`: [`Queue`] and [`QueueSettings`]; handles of the partitions' owner tasks.
//! - `partition::state`: [`PartitionState`], the durable state applied from log records.
//! - `partition::prepare`: pure functions from commands to records (publish, settle and
//!   return batching, purge, settings) and the queue limits' verdict; no I/O.
//! - `partition::log`: [`PartitionLog`](partition::log::PartitionLog), the owner's view of its
//!   log (propose, commit events, read committed records, storage upkeep): the seam where
//!   replication slots in. `partition::local_log`: the single-node implementation over
//!   `keratin_log::Log` (committed = durable).
//! - `partition::dead_letter`: `DeadLetterSink`, where dead-lettered messages go (the
//!   dead-letter queue's leader may be another node: a cluster node's sink is
//!   `keratin-cluster`'s), the messages held until their copies are confirmed, and the copies'
//!   idempotent producer mark; the broker's `LocalDeadLetters` publishes through this node.
//! - `partition::driver`: `LogDriver`, what every owner of a partition log keeps about driving
//!   it, once: proposals in sequence order (outcomes released in order), the role and the
//!   step-down grace, the follow limit, and the stop/heal phase with its retry (pure).
//! - `partition::delivery_state`: what only a leader has: consumers, inflight, returned
//!   messages, the delivery cursor and read-ahead (volatile).
//! - `partition::owner`: the task that owns a partition: commands to records, records to state;
//!   its children own admission (queue limits, the gate, slowing), settling (acks, returns,
//!   dead-lettering, purge), delivery (within the log's delivery lease), reclaim (prefix
//!   removal, relocation, healing) and the `PRODUCERS` records reclaim cuts at (`checkpoint`).
//! - `record`: the partition log's records, byte by byte (`docs/partition-records.md`).
//! - `consumer`: [`Consumer`] and [`Delivery`].
//! - `byte_budget`: [`ByteBudget`], bytes of deliveries held in memory (node-wide and per
//!   connection), taken by partitions without waiting and given back when sent.
//! - `gate`: [`PublishGate`], the resource limits as partitions see them.
//! - `range_set`: [`RangeSet`], compact sets of offsets.
//! - `stream`: streams (`docs/streams.md`): payload and cursor log records, retention and the
//!   cursor table (pure), the stream partition owner and the cursor log's owner (both drive
//!   their logs through `partition::driver`).
#![deny(missing_docs)]

mod broker;
mod byte_budget;
mod claims;
mod consumer;
pub mod error;
pub mod gate;
mod meta;
pub mod partition;
mod queue;
pub mod range_set;
pub mod record;
pub mod stream;

pub use broker::{
    system_clock, Broker, BrokerConfig, Clock, MetadataLogInfo, NodeBounds, PartitionInfo,
    PendingPublish, QueueInfo, ReadFrom, Receipt, WeakBroker, CONSUMERS_MAX_DEFAULT, CURSOR_EXPIRY,
    DELIVERY_BYTES_DEFAULT, IDLE_RELEASE_AFTER_DEFAULT, MAX_PREFETCH, PARTITIONS_MAX_DEFAULT,
    PUBLISH_TIMEOUT_DEFAULT, PURGE_LEADER_WAIT, QUEUES_MAX_DEFAULT, RELOCATION_BYTES_MAX,
    RETENTION_INTERVAL,
};
pub use byte_budget::{ByteBudget, BytePermit};
pub use consumer::{
    Consumer, Delivery, DeliveryPermit, DeliveryTag, ReaderSlot, Settler, SubscribeOptions,
};
pub use error::{BrokerError, BrokerResult};
pub use gate::{GateDecision, OpenGate, PublishGate};
pub use partition::state::PartitionState;
pub use queue::{
    validate_queue_name, DeadLetterFailure, Overflow, Queue, QueueSettings, MAX_PARTITIONS,
    PRODUCER_SEQUENCE_BLOCK,
};
pub use range_set::RangeSet;
pub use record::{Message, ProducerSeq};
