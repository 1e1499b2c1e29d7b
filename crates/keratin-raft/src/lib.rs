//! Keratin's replication adapter: each queue partition is one Raft group on `openraft`
//! (`=0.10.0-alpha.37`), and the group's Raft log *is* the partition's segment log. Every
//! openraft type stays inside this crate, so an alpha API change touches one place.
//!
//! # Layout
//! - `types`: the openraft type configuration ([`TypeConfig`]): node ids `u64`, [`NodeAddr`]
//!   (with the [`StorageId`] of the member's copy), the application data [`PartitionRecord`]
//!   and the response [`CommittedOffsets`].
//! - [`entry_format`]: one Raft entry as one segment-log record (record type, flags, the entry
//!   prefix with the leader id), `docs/storage-format.md`, "Replicated log records".
//! - `raft_state`: the copy's storage identity, the vote, committed id and purge point, in a
//!   small state log ([`RaftState`]).
//! - `store`: [`GroupLogs`] (a group's two logs, kept across rebuilds), [`LogStore`]
//!   (openraft's `RaftLogStorage`) and [`LogStoreReader`] (`RaftLogReader`), with the
//!   in-memory tail of entries not yet durable and applied.
//! - `fence`: [`Fence`], how a failed log is surfaced instead of a `StorageError`.
//! - `state_machine`: [`RecordStateMachine`], an in-memory state machine of records by offset,
//!   with snapshots.
//! - [`network`]: the groups' network over `keratin-net` (one connection per node pair,
//!   coalesced heartbeats): openraft's sending side and the node's request handler; every
//!   request names the copy of the receiver's storage it is for, and a copy answers only its
//!   own (`docs/cluster.md`, "Storage identities"); the storage probe.
//! - [`replica`]: [`replica::Replica`], one node's member of a partition group in the broker's
//!   terms (propose, committed offset, committed reader), over the network below; forming a
//!   group, recording and replacing its members' copies, changing its voters.
//! - [`partition_log`]: [`partition_log::ReplicatedLog`], the broker's partition log over a
//!   replica, and [`partition_log::ReplicatedLogs`], the provider a cluster node's broker opens
//!   them with; the group id of a partition ([`partition_log::partition_group`]).
//! - `error`: [`RaftError`].
//!
//! # Index and offset
//! Raft index == record offset in the entry log: the message id (the offset of its `ENQUEUE`
//! record) keeps its meaning. openraft numbers entries from 0, as the log does. When an entry
//! must land past the log's end (after a purge past the end, which follows a snapshot install),
//! gap records take the offsets in between (at most [`GAP_FILL_MAX`]).
//!
//! # Durability
//! An append is reported flushed to openraft (`IOFlushed`) only when the entry log's ticket
//! resolves, after the group commit's `fdatasync`: then the entries survive a process crash and
//! a power loss. A vote and a purge point are durable when `save_vote`/`purge` return; the
//! committed id is written without waiting, on its own only every
//! [`COMMITTED_WRITE_EVERY_ENTRIES`] entries (openraft treats it as a lower bound; opening
//! clamps it to the durable entries). Truncations are durable when `truncate_after` returns.
//!
//! # Failures
//! openraft's maintainers treat a storage error as fatal for the node (openraft#1795, #185), so
//! no log failure — a full disk, EIO, a stopped log, a failed read — ever reaches openraft as an
//! `io::Error`/`StorageError`. Instead the store trips its group's [`Fence`] and then:
//! - answers every storage call `Ok` but takes no further effect on disk: appends stay in the
//!   in-memory view and are never reported flushed (openraft waits), votes, committed ids,
//!   truncations and purges change only the view;
//! - a failed read returns the entries before the failure: replication takes a short read as a
//!   heartbeat and retries; the stream the state machine applies from stays open without an
//!   error while the instance runs (it ends with an error only once the store is dropped, so
//!   that openraft's state machine task lets go of the logs);
//! - the group's network must refuse to carry anything for a fenced group — requests it sends
//!   and replies to requests it received — with a transient `Unreachable` error, because
//!   openraft may have acted on a vote or entry that is not on disk. Peers see the node as
//!   unreachable (a lagging follower, a silent candidate) and retry;
//! - the owner waits on [`Fence::tripped`], shuts the `Raft` down, heals the logs
//!   ([`GroupLogs::heal`], once space is back) and builds a new `Raft` on
//!   [`GroupLogs::store`]. The new instance starts from what is durable.
//!
//! A follower at the disk reserve (the broker's limits, before any write fails) refuses appends
//! the same way, at the network level.
//!
//! A read of entries that a purge (a snapshot's, or the partition's space reclaim) removed
//! while the read ran is no failure: the fence stays as it is, and the reader gets the segment
//! log's `OutOfRange`, as a local log reports a removed prefix, and reads on from the new start.
//!
//! # What is left
//! Snapshot *transfer* of a partition (segment files plus queue state), restarting a log at a
//! higher offset after a large snapshot install (needs a keratin-log operation), leadership
//! transfer over the network, and snapshots larger than one `keratin-net` frame. (Connections
//! are shared per node pair and heartbeats coalesced by `keratin-net`, see [`network`], so
//! `openraft-multi` is not needed.)
#![deny(missing_docs)]

pub mod entry_format;
mod error;
mod fence;
pub mod network;
pub mod partition_log;
mod raft_state;
pub mod replica;
mod state_machine;
mod store;
mod types;

pub use error::RaftError;
pub use fence::Fence;
pub use raft_state::{RaftState, COMMITTED_WRITE_EVERY_ENTRIES};
pub use state_machine::{
    RecordSnapshot, RecordSnapshotBuilder, RecordStateMachine, RecordsImage, SnapshotMeta,
    StoredMembership,
};
pub use store::{
    GroupLogs, LogStore, LogStoreReader, SnapshotKeeper, ENTRIES_DIR_NAME, GAP_FILL_MAX,
    HOLD_BYTES_MAX, STATE_DIR_NAME,
};
pub use types::{
    CommittedOffsets, Entry, LeaderId, LogId, Membership, NodeAddr, PartitionRecord, Payload,
    StorageId, TypeConfig, Vote,
};
