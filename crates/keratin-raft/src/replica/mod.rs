//! [`Replica`]: one node's member of one partition group, in the broker's terms: propose
//! records and learn their committed offsets, watch the committed offset move (records another
//! leader proposed included), read committed records in offset order. openraft stays inside:
//! the broker's partition log (`keratin-broker` `partition/log.rs`) is built on this.
//!
//! - `notifier`: [`CommitNotifier`], the Raft state machine that only tells how far the log is
//!   committed.
//! - `reader`: [`CommittedReader`], the partition's records below the committed offset, read
//!   from the group's log view (entry log and the tail not yet durable here) with the
//!   adapter's own entries (blank, membership) skipped.
//! - `membership`: forming the group and changing the voters of a live group
//!   ([`Replica::change_voters`], [`MembershipError`]).
//! - `copies`: which copy of the group's storage each member is: forming only where the group
//!   exists nowhere yet ([`Replica::form`]), recording the members' copies (a task of every
//!   replica, acting while it leads), removing a member whose copy is not the recorded one
//!   ([`Replica::replace_copies`]).
//!
//! A proposal refused because this node is not the leader is [`ProposeError::NotLeader`] with
//! the leader openraft knows of, so the broker can answer "not the leader" with its address.

pub(crate) mod copies;
pub(crate) mod membership;
mod notifier;
mod reader;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use keratin_net::{GroupId, Transport};
use openraft::errors::{
    ClientWriteError, Fatal, LinearizableReadError, RaftError as OpenRaftError,
};
use openraft::{Config, SnapshotPolicy};
use tokio::sync::watch;

pub use copies::{Formation, Replaced, COPY_ACK_AGE_MAX, FORMATION_RETRY};
pub use membership::{
    GroupMembers, MembershipError, CATCH_UP_WAIT, TRANSFER_ACK_AGE_MAX, TRANSFER_LAG_MAX,
};
pub use notifier::{AppliedImage, CommitNotifier, NotifierSnapshotBuilder};
pub use reader::CommittedReader;

use crate::error::RaftError;
use crate::fence::Fence;
use crate::network::{Addressing, Groups, NetworkFactory, RaftEndpoint};
use crate::store::{GroupLogs, LogStoreReader};
use crate::types::{NodeAddr, PartitionRecord, StorageId, TypeConfig};

/// The openraft instance of a replica.
pub type ReplicaRaft = openraft::Raft<TypeConfig, CommitNotifier>;

/// Heartbeats every 100 ms and elections after 500–1,000 ms without one: a lost leader is
/// replaced within about a second (the failover goal is 2 s), while a leader on a loaded node
/// (a full `fdatasync` queue, a busy core) is not voted out for a pause under half a second.
pub const HEARTBEAT_INTERVAL_MS: u64 = 100;
/// See [`HEARTBEAT_INTERVAL_MS`].
pub const ELECTION_TIMEOUT_MIN_MS: u64 = 500;
/// See [`HEARTBEAT_INTERVAL_MS`].
pub const ELECTION_TIMEOUT_MAX_MS: u64 = 1_000;

/// The openraft configuration of partition replicas: the timers above, and snapshots only when
/// the partition owner frees disk (`ReplicatedLog::remove_prefix` triggers one below its floor,
/// see `notifier`); the entries a snapshot covers are purged at once (a lagging follower gets
/// the snapshot and the entries after it).
pub fn replica_config(cluster_name: &str) -> Result<Arc<Config>, RaftError> {
    let config = Config {
        cluster_name: cluster_name.to_string(),
        heartbeat_interval: HEARTBEAT_INTERVAL_MS,
        election_timeout_min: ELECTION_TIMEOUT_MIN_MS,
        election_timeout_max: ELECTION_TIMEOUT_MAX_MS,
        snapshot_policy: SnapshotPolicy::Never,
        max_in_snapshot_log_to_keep: 0,
        // A replica whose data directory was wiped is another copy of the storage
        // (`StorageId`), which answers nothing addressed to the copy the leader replicated to,
        // until the leader replaces it (`membership.rs`): removed, added back as a learner
        // from an empty log, promoted. A follower whose own copy lost its tail (bytes that rot,
        // a disk that lost what it reported flushed: recovery keeps the records before the
        // damage) answers with a shorter log than the leader knew it to hold. Without this,
        // openraft's core panics on the leader ("follower log reversion is not allowed"): the
        // group dies on the healthy node while it still reports leading. With it, the leader
        // resets that follower's progress and sends it what it lost, as to a new follower.
        allow_log_reversion: Some(true),
        // A replica that led before a restart starts as a follower: restored at once, it took
        // proposals (a consumer's acks) that the election after it answered as "not the
        // leader", so acked messages came back (`tests/partition_snapshots.rs`).
        enable_leader_restore: Some(false),
        ..Config::default()
    };
    config
        .validate()
        .map(Arc::new)
        .map_err(|e| RaftError::Invalid(format!("raft configuration: {e}")))
}

/// Why a proposal was not committed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ProposeError {
    /// This replica does not lead the group; `leader` is the one it knows of, if any.
    #[error("this node does not lead the partition{}", match (.leader, .addr) {
        (Some(id), Some(addr)) => format!(" (node {id} at {addr} does)"),
        (Some(id), None) => format!(" (node {id} does)"),
        _ => " (no leader is known yet)".to_string(),
    })]
    NotLeader {
        /// The leader's node id.
        leader: Option<u64>,
        /// The leader's cluster address.
        addr: Option<String>,
    },
    /// The group's storage failed on this node; it is being rebuilt. The records may or may not
    /// be committed.
    #[error("the partition's storage failed on this node: {0}")]
    Fenced(RaftError),
    /// The group is shutting down. The records may or may not be committed.
    #[error("the partition group stopped: {0}")]
    Stopped(String),
}

/// See the module docs.
pub struct Replica {
    raft: ReplicaRaft,
    logs: GroupLogs,
    view: LogStoreReader,
    notifier: CommitNotifier,
    fence: Fence,
    group: GroupId,
    /// The node's cluster transport (storage probes of the members).
    transport: Transport,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl Replica {
    /// Starts node `id`'s replica of `group` over `logs`, reachable through `transport` and
    /// served by `groups` (the node's handler). Blocks while it reads the logs.
    pub async fn start(
        id: u64,
        group: GroupId,
        logs: GroupLogs,
        config: Arc<Config>,
        transport: Transport,
        groups: &Groups,
    ) -> Result<Replica, RaftError> {
        let mut store = logs.store()?;
        let fence = store.fence();
        let view = store.reader();
        let storage = store.storage();
        let notifier =
            CommitNotifier::new(fence.clone(), store.snapshot_keeper(), view.clone()).await;
        store.watch_purges(notifier.committed_sender());
        let addressing = Arc::new(Addressing::new(storage));
        let network = NetworkFactory::<AppliedImage>::new(transport.clone(), group, fence.clone())
            .with_log_view(view.clone())
            .with_addressing(addressing.clone());
        let raft = ReplicaRaft::new(id, config, network, store, notifier.clone())
            .await
            .map_err(|e| RaftError::Invalid(format!("start group {}: {e}", group.0)))?;
        addressing.follow(raft.metrics());
        tokio::spawn(copies::record_while_running(
            raft.clone(),
            transport.clone(),
            group,
            storage,
            addressing,
        ));
        groups.insert(
            group,
            Arc::new(RaftEndpoint::new(raft.clone(), fence.clone(), storage)),
        );
        Ok(Replica {
            raft,
            logs,
            view,
            notifier,
            fence,
            group,
            transport,
        })
    }

    /// The openraft instance, for membership changes and metrics (`keratin-raft` only: the
    /// broker uses the methods below).
    pub fn raft(&self) -> &ReplicaRaft {
        &self.raft
    }

    /// The group's logs (figures, reads of the entry log).
    pub fn logs(&self) -> &GroupLogs {
        &self.logs
    }

    /// The replica's state machine (commits, snapshots below the owner's floor).
    pub fn notifier(&self) -> &CommitNotifier {
        &self.notifier
    }

    /// The first offset this node holds or will hold (past the purge point).
    pub fn log_floor(&self) -> u64 {
        self.view.floor()
    }

    /// The group this replica belongs to.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// This node's copy of the group's storage (`docs/cluster.md`, "Storage identities").
    pub fn storage(&self) -> StorageId {
        self.view.storage()
    }

    /// The group's storage fence: it trips when this node's copy fails.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// Propose `records` (one entry each, consecutive offsets); their offsets once committed on
    /// a majority and applied here.
    pub async fn propose(&self, records: Vec<PartitionRecord>) -> Result<Range<u64>, ProposeError> {
        if let Some(reason) = self.fence.reason() {
            return Err(ProposeError::Fenced(reason));
        }
        let count = records.len() as u64;
        let mut results = self
            .raft
            .client_write_many(records)
            .await
            .map_err(|e| self.stopped(e))?;
        let mut offsets = Offsets::default();
        while let Some(result) = results.next().await {
            let written = result.map_err(|e| self.stopped(e))?.map_err(not_leader)?;
            offsets.push(written.log_id.index);
        }
        Ok(offsets.finish(count))
    }

    fn stopped(&self, error: Fatal<TypeConfig>) -> ProposeError {
        match self.fence.reason() {
            Some(reason) => ProposeError::Fenced(reason),
            None => ProposeError::Stopped(error.to_string()),
        }
    }

    /// One past the last record committed in the group as of this call, on its leader: openraft's
    /// ReadIndex (the leader confirms with a quorum that it still leads, so nothing committed
    /// before this call lies beyond the answer). A replica that has applied up to it has seen
    /// every record committed before the call. Refused with [`ProposeError::NotLeader`] on any
    /// other replica (naming the leader it knows), and with [`ProposeError::Stopped`] when the
    /// leader cannot reach a quorum or the group stopped. Unbounded while the leader waits for
    /// its quorum: the caller bounds it.
    pub async fn read_index(&self) -> Result<u64, ProposeError> {
        match self
            .raft
            .get_read_log_id(openraft::ReadPolicy::ReadIndex)
            .await
        {
            Ok((read, _applied)) => Ok(read.log_id().index + 1),
            Err(OpenRaftError::APIError(LinearizableReadError::ForwardToLeader(forward))) => {
                Err(ProposeError::NotLeader {
                    leader: forward.leader_id,
                    addr: forward.leader_node.map(|node: NodeAddr| node.addr),
                })
            }
            Err(other) => Err(ProposeError::Stopped(other.to_string())),
        }
    }

    /// One past the last committed record, as it moves.
    pub fn committed(&self) -> watch::Receiver<u64> {
        self.notifier.committed()
    }

    /// Hold applied entries in memory for the owner's committed reader while this replica
    /// follows (`crate::store`, module docs); not while it leads.
    pub fn hold_for_reader(&self, hold: bool) {
        self.view.set_hold(hold);
    }

    /// Bytes of entries this replica keeps in memory (the log view's tail).
    pub fn tail_bytes(&self) -> usize {
        self.view.tail_bytes()
    }

    /// The replica's log view (for the forwarder, which sets its hold).
    pub(crate) fn view(&self) -> LogStoreReader {
        self.view.clone()
    }

    /// The partition's committed records from `offset` on (blocking iteration: run it on the
    /// blocking pool).
    pub fn reader(&self, offset: u64) -> CommittedReader {
        CommittedReader::new(self.view.clone(), offset, self.committed())
    }

    /// The partition's committed entries from `offset` on, the adapter's own entries included
    /// (see [`CommittedReader::with_adapter_entries`]); blocking iteration, as [`Replica::reader`].
    pub fn reader_with_adapter_entries(&self, offset: u64) -> CommittedReader {
        self.reader(offset).with_adapter_entries()
    }

    /// The leader this replica knows of.
    pub async fn leader(&self) -> Option<u64> {
        self.raft.current_leader().await
    }

    /// Waits up to `timeout` until this replica is the leader (or knows another one is).
    pub async fn wait_leader(&self, timeout: Duration) -> Option<u64> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(leader) = self.leader().await {
                return Some(leader);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops serving the group and shuts its `Raft` down; the logs are returned, to close (or
    /// heal and start again).
    pub async fn shutdown(self, groups: &Groups) -> GroupLogs {
        groups.remove(self.group);
        if let Err(error) = self.raft.shutdown().await {
            tracing::warn!(group = self.group.0, %error, "raft shutdown");
        }
        self.logs
    }
}

fn not_leader(error: ClientWriteError<TypeConfig>) -> ProposeError {
    match error {
        ClientWriteError::ForwardToLeader(forward) => ProposeError::NotLeader {
            leader: forward.leader_id,
            addr: forward.leader_node.map(|node: NodeAddr| node.addr),
        },
        other => ProposeError::Stopped(other.to_string()),
    }
}

/// The offsets of one proposal's entries, gathered as openraft answers each: one batch is
/// appended at once, so they are consecutive, one per record.
#[derive(Debug, Default)]
pub(crate) struct Offsets(Option<Range<u64>>);

impl Offsets {
    /// The next entry's index.
    pub(crate) fn push(&mut self, index: u64) {
        self.0 = Some(match self.0.take() {
            None => index..index + 1,
            Some(range) => {
                assert_eq!(range.end, index, "a proposal's entries are consecutive");
                range.start..index + 1
            }
        });
    }

    /// The offsets of a proposal of `count` records, every one answered.
    pub(crate) fn finish(self, count: u64) -> Range<u64> {
        let offsets = self.0.unwrap_or(0..0);
        assert_eq!(offsets.end - offsets.start, count, "one offset per record");
        offsets
    }
}
