//! [`ReplicatedLog`]: the broker's partition log (`keratin_broker::partition::log::PartitionLog`)
//! over a [`Replica`], and [`ReplicatedLogs`], the provider a cluster node's broker opens them
//! with (`BrokerConfig::partition_logs`). `docs/cluster.md`, "Replicated partition logs".
//!
//! What reaches the partition owner, and from where:
//! - [`LogEvent::Role`]: sent at once from `start` (synchronously), then by one forwarder task
//!   on every change of leadership seen in openraft's metrics (the leading flag or the leader's
//!   id), with the leader's *client* address from the node's resolver;
//! - [`LogEvent::Committed`]: the same task forwards every move of the replica's committed
//!   offset (records another node proposed, and the adapter's own entries, included); it also
//!   tells the replica's log view whether to hold applied entries for the owner's reads (a
//!   follower's owner reads every committed entry; `crate::store`, module docs);
//! - [`LogEvent::Proposed`]: a proposal refused at once when this node does not lead (nothing
//!   written); otherwise it waits for room in a bounded queue (the owner's back-pressure) that
//!   one submitter task drains in proposal order, handing each proposal to openraft as one
//!   batch (`client_write_many`, whose first await returns once the core has the batch, so
//!   proposals are pipelined and get increasing, consecutive offsets in proposal order). Its
//!   outcome is awaited on a task of its own: the offsets once committed and applied; "not the
//!   leader" when openraft refused it before appending anything; "leadership lost" (504,
//!   outcome unknown) when openraft discarded an entry of it as this node took another
//!   leader's log (that leader, or a later one, may still commit it: openraft says "commit
//!   status unknown"), or when the proposal was committed in part; a storage error (outcome
//!   unknown) when the replica's storage fenced or the group stopped.
//!
//! A deposed leader's entries in flight are not failed when it steps down: openraft answers
//! them when their fate is known — committed by the successor (then they are reported
//! committed and the owner applies them at their offsets) or discarded (then "leadership
//! lost": only an idempotent producer's retry is safe, so nobody is told to send again).
//! The owner reads records committed by others meanwhile up to its oldest pending proposal
//! (`owner/follow.rs`), so nothing waits on a proposal that cannot end while a leader exists.
//!
//! Storage failures: when the replica's fence trips (a write of either log failed), the
//! forwarder reports `LogEvent::Stopped` and "not leading" and shuts the `Raft` down, so the
//! proposals in flight end with the storage error (outcome unknown) instead of waiting for a
//! flush that never comes; the owner (a follower's too, which has nothing pending) stops the
//! partition and calls `heal`, which rebuilds the replica on its healed logs (the group's
//! documented rebuild path: `GroupLogs::heal`, then a new store) and reports healed once the
//! new replica has committed again what the failed one had (`tests/follower_heal.rs`).
//!
//! Prefix removal: the owner's floor becomes a snapshot (`replica/notifier.rs`) and openraft
//! purges the entries below it. Not built: hand-back of an idle replica's tail segment, reset
//! (a replicated purge is a record).
//
//! Files: this one owns [`ReplicatedLog`] (its replica, roles, close/delete/heal); `forward`,
//! the task that reports commits and roles; `submit`, the ordered submitter and the outcome of
//! each proposal; `reader`, the committed reader with the adapter's entries as `NOOP`;
//! `provider`, [`ReplicatedLogs`]; `replication`, the replication figures (replicas, lag, the
//! in-sync set) from openraft's metrics.

mod forward;
mod provider;
mod reader;
mod replication;
mod submit;

use forward::forward;
pub use provider::{set_aside_damaged, ReplicatedLogs, ReplicatedLogsSetup, DAMAGED_DIR_NAME};
use reader::ReplicatedReader;
use replication::LeaderlessClock;
use submit::{submit, Answers, Submission};

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use keratin_broker::error::{BrokerError, BrokerResult};
use keratin_broker::partition::log::{
    BoxReader, DeliveryLease, LogEvent, LogEvents, LogSpace, PartitionLog, PartitionLogs,
    PartitionPlace, PartitionReader, Proposal, Proposing, Removing, Role,
};
use keratin_broker::partition::replication::ReplicationStatus;
use keratin_broker::record::NOOP;
use keratin_log::{Io, LogError, LogOptions, LogResult, PrefixRemoval, ReadRecord};
use keratin_net::{GroupId, ResolvedCluster, Transport};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::errors::{ClientWriteError, Fatal};
use openraft::raft::WriteResult;
use openraft::{Config, Instant as _, RaftMetrics};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::entry_format::RECORD_TYPE_RESERVED_MIN;
use crate::error::RaftError;
use crate::fence::Fence;
use crate::network::Groups;
use crate::replica::{CommittedReader, Replica, ReplicaRaft, ELECTION_TIMEOUT_MAX_MS};
use crate::store::GroupLogs;
use crate::types::{NodeAddr, PartitionRecord, TypeConfig};

/// Maps a node id to its client (protocol) address, as the cluster layer knows them; `None`
/// when unknown.
pub type ClientAddrs = Arc<dyn Fn(u64) -> Option<String> + Send + Sync>;

/// Proposals waiting for the submitter. The owner hands its proposals over one at a time and
/// polls the next only once one is taken (`owner/append.rs`), so this queue is a short buffer:
/// the submitter takes a proposal within one core round trip; 64 proposals of the owner's
/// largest batch (4 MiB of payloads) bound it at 256 MiB in the worst case, and a publish
/// batch is usually a few KiB.
pub const SUBMIT_QUEUE_MAX: usize = 64;

/// Proposals handed to openraft and not yet answered. openraft keeps a responder per entry
/// (its responder queue starts at 8,192 entries); 1,024 proposals keep the leader's pipeline
/// full at a few ms of commit latency while the queue above holds the owner back.
pub const PROPOSALS_IN_FLIGHT_MAX: usize = 1_024;

/// How long a prefix removal waits for openraft to purge before it reports what went.
const PURGE_WAIT: Duration = Duration::from_secs(1);

/// How long closing waits for the tasks of a shut-down `Raft` (and readers) to let go of the
/// group's logs before it reports the log as still in use.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Group 0 is the cluster's metadata group; partition groups follow [`partition_group`].
pub const METADATA_GROUP: GroupId = GroupId(0);

/// Bits of a group id that hold the partition index (see [`partition_group`]).
const PARTITION_INDEX_BITS: u32 = 8;
const _: () = assert!(keratin_broker::MAX_PARTITIONS <= 1 << PARTITION_INDEX_BITS);

/// The Raft group of partition `index` of queue `queue_id`: `((queue_id + 1) << 8) | index`.
/// A pure function of the queue's id (assigned by the metadata group, the same on every node)
/// and the index (below 256; queues have at most `MAX_PARTITIONS` = 64), so every node names
/// the same group without asking; group 0 ([`METADATA_GROUP`]) is never a partition's.
pub fn partition_group(queue_id: u64, index: u32) -> Result<GroupId, RaftError> {
    let shifted = queue_id
        .checked_add(1)
        .and_then(|id| id.checked_mul(1 << PARTITION_INDEX_BITS))
        .ok_or_else(|| {
            RaftError::Invalid(format!("queue id {queue_id} is too large for a group id"))
        })?;
    if u64::from(index) >= 1 << PARTITION_INDEX_BITS {
        return Err(RaftError::Invalid(format!(
            "partition index {index}: a group id holds indexes below {}",
            1u64 << PARTITION_INDEX_BITS
        )));
    }
    Ok(GroupId(shifted | u64::from(index)))
}

/// The storage failure behind a tripped fence, as the broker's log error (a failed write
/// keeps its `LogError::Stopped`, so the owner stops the partition as for a local log).
fn fenced_error(reason: RaftError) -> LogError {
    match reason {
        RaftError::Log { source, .. } => source,
        other => LogError::Invalid(format!("the partition's replica failed: {other}")),
    }
}

/// A failure of the replica while doing `what`, as the broker's log error (a log's own error
/// as it is).
fn log_error(what: &str, error: RaftError) -> LogError {
    match error {
        RaftError::Log { source, .. } => source,
        other => LogError::Invalid(format!("{what}: {other}")),
    }
}

/// A leader that has heard from no majority of its voters for this long takes itself for cut
/// off and stops leading as far as the broker is concerned (openraft has no check-quorum: a
/// leader cut from the others stays leader, and the proposals it takes wait until the cut
/// heals). By then the majority on the other side has had an election timeout to elect a
/// leader of its own, so the publishers it leaves go there (`docs/cluster.md`, "A cut-off
/// leader").
pub const QUORUM_LOST_AFTER: Duration = Duration::from_millis(ELECTION_TIMEOUT_MAX_MS);

/// What a leader's delivery lease leaves for the way from the decision to deliver to the
/// consumer's socket (the owner's round, a full connection buffer, a busy core) and for clock
/// rates: a message handed out just before the lease ends is on its way well before any
/// successor can lead (`docs/cluster.md`, "A cut-off leader").
pub const DELIVERY_MARGIN: Duration = Duration::from_millis(250);

/// A leader of several voters delivers only while a majority acknowledged a request it sent
/// within this: [`QUORUM_LOST_AFTER`], the followers' lease on it (openraft's leader lease,
/// the longest election timeout: a follower that acknowledged a request sent at `t` votes for
/// no one else before `t` + 1 s), less [`DELIVERY_MARGIN`].
pub const DELIVERY_LEASE: Duration =
    Duration::from_millis(ELECTION_TIMEOUT_MAX_MS - DELIVERY_MARGIN.as_millis() as u64);
const _: () = assert!(DELIVERY_MARGIN.as_millis() < ELECTION_TIMEOUT_MAX_MS as u128 / 2);

/// Whether the metrics show a leader of several voters cut off from a majority: its last
/// request a majority acknowledged was sent over [`QUORUM_LOST_AFTER`] ago, or, with none
/// acknowledged yet, it was elected (`elected_at`, when known) over [`QUORUM_LOST_AFTER`] ago.
/// openraft refuses a new leader's writes until its lease is confirmed; this keeps it from
/// holding consumers it cannot serve.
fn quorum_lost(
    metrics: &RaftMetrics<TypeConfig>,
    elected_at: Option<tokio::time::Instant>,
) -> bool {
    match quorum_ack_age(metrics, elected_at) {
        Some(QuorumAck::Age(age)) => age > QUORUM_LOST_AFTER,
        Some(QuorumAck::Never { elected_for }) => elected_for > QUORUM_LOST_AFTER,
        None => false,
    }
}

/// When this node, as the leader of several voters, last heard from a majority.
enum QuorumAck {
    /// A majority acknowledged a request sent this long ago.
    Age(Duration),
    /// None yet, since it was elected this long ago.
    Never { elected_for: Duration },
}

/// Whether this node leads several voters (not alone): the leaders a lease matters for.
fn leads_others(metrics: &RaftMetrics<TypeConfig>) -> bool {
    metrics.state.is_leader()
        && metrics.current_leader == Some(metrics.id)
        && metrics
            .membership_config
            .membership()
            .voter_ids()
            .nth(1)
            .is_some()
}

/// How long ago a majority acknowledged the last request of this node as the leader of
/// several voters (or, with none yet, how long ago it was elected when `elected_at` is known);
/// `None` when it does not lead, leads alone, or nothing is known.
fn quorum_ack_age(
    metrics: &RaftMetrics<TypeConfig>,
    elected_at: Option<tokio::time::Instant>,
) -> Option<QuorumAck> {
    if !leads_others(metrics) {
        return None;
    }
    match metrics.last_quorum_acked {
        Some(acked) => Some(QuorumAck::Age(acked.into_inner().elapsed())),
        None => elected_at.map(|at| QuorumAck::Never {
            elected_for: at.elapsed(),
        }),
    }
}

/// When the forwarder should check the quorum again: once the last acknowledgement (or the
/// election, with none yet) would be [`QUORUM_LOST_AFTER`] old, while this node leads others;
/// `None` otherwise (a change of metrics wakes it then).
fn quorum_check_in(
    metrics: &RaftMetrics<TypeConfig>,
    elected_at: Option<tokio::time::Instant>,
) -> Option<Duration> {
    let age = match quorum_ack_age(metrics, elected_at)? {
        QuorumAck::Age(age) => age,
        QuorumAck::Never { elected_for } => elected_for,
    };
    QUORUM_LOST_AFTER
        .checked_sub(age)
        .map(|left| left + Duration::from_millis(1))
}

/// The delivery lease the metrics show for this node (see [`DELIVERY_LEASE`]): held by a
/// leader alone in its group; until [`DELIVERY_LEASE`] after the last request a majority
/// acknowledged for the leader of several voters; lapsed otherwise (no leader, or none
/// acknowledged: a leader just elected delivers from its first acknowledged heartbeat).
fn delivery_lease(metrics: &RaftMetrics<TypeConfig>) -> DeliveryLease {
    if !metrics.state.is_leader() || metrics.current_leader != Some(metrics.id) {
        return DeliveryLease::Lapsed;
    }
    if !leads_others(metrics) {
        return DeliveryLease::Held;
    }
    let Some(acked) = metrics.last_quorum_acked else {
        return DeliveryLease::Lapsed;
    };
    match DELIVERY_LEASE.checked_sub(acked.into_inner().elapsed()) {
        Some(left) if !left.is_zero() => DeliveryLease::Until(tokio::time::Instant::now() + left),
        _ => DeliveryLease::Lapsed,
    }
}

/// The leader node `id`, which does not lead, may send its clients to: the one its metrics
/// know, unless that is `id` itself (a leader that handed the group over or removed itself
/// keeps its own committed vote until it hears the next leader: clients sent back to it loop)
/// or no voter of the group as this node knows it (a leader moved off the partition stays
/// known here until the voters elect, while its own node sends clients to the partition's
/// replicas: two nodes naming each other). `None`: the refusal names no leader and carries a
/// retry hint (`docs/cluster.md`, "Redirects never loop").
fn redirect_target(id: u64, metrics: &RaftMetrics<TypeConfig>) -> Option<u64> {
    let leader = metrics.current_leader.filter(|leader| *leader != id)?;
    metrics
        .membership_config
        .membership()
        .voter_ids()
        .any(|voter| voter == leader)
        .then_some(leader)
}

/// The role openraft's metrics show for node `id`, elected at `elected_at` if that is known:
/// a leader cut off from a majority ([`quorum_lost`]) is not leading and knows no leader; a
/// node that does not lead names only a [`redirect_target`].
fn role_of(
    id: u64,
    metrics: &RaftMetrics<TypeConfig>,
    elected_at: Option<tokio::time::Instant>,
    client_addrs: &ClientAddrs,
) -> Role {
    let elected = metrics.state.is_leader() && metrics.current_leader == Some(id);
    let cut_off = elected && quorum_lost(metrics, elected_at);
    let leading = elected && !cut_off;
    let leader = if cut_off {
        None
    } else if leading {
        metrics.current_leader
    } else {
        redirect_target(id, metrics)
    };
    Role {
        leading,
        leader,
        // `PartitionInfo::leader_addr`: none while this node leads.
        addr: if leading {
            None
        } else {
            leader.and_then(|leader| client_addrs(leader))
        },
        // Every entry up to the last one seen may have been proposed, and its messages
        // delivered, by an earlier leader.
        from: if leading {
            metrics.last_log_index.map_or(0, |index| index + 1)
        } else {
            0
        },
    }
}

/// The replica and, once started, the tasks that serve the owner.
struct Running {
    replica: Replica,
    /// Ends the forwarder and the submitter.
    stop: watch::Sender<bool>,
    /// The submitter's queue; set by `start`.
    submitter: Option<mpsc::Sender<Submission>>,
    /// A rebuilt replica is healed once its committed offset is back here (see `heal`).
    catch_up_to: u64,
}

impl Running {
    fn new(replica: Replica, catch_up_to: u64) -> Running {
        Running {
            replica,
            stop: watch::Sender::new(false),
            submitter: None,
            catch_up_to,
        }
    }

    /// Stop its tasks and shut the `Raft` down; the logs, to close, delete or heal.
    async fn shut_down(self, groups: &Groups) -> GroupLogs {
        self.stop.send_replace(true);
        drop(self.submitter);
        self.replica.shutdown(groups).await
    }
}

/// The replica of a [`ReplicatedLog`].
enum Replicating {
    Running(Running),
    /// Shut down after its storage failed, and not rebuilt yet (a heal failed): the logs, and
    /// the committed offset the rebuilt replica must reach again.
    Fenced(GroupLogs, u64),
    Closed,
}

/// How long a heal waits for a rebuilt replica to commit again what its predecessor had
/// committed (a leader re-elects itself, a follower hears from its leader: within about an
/// election timeout, [`crate::replica::ELECTION_TIMEOUT_MAX_MS`]); the owner asks again
/// later otherwise.
const HEAL_CATCH_UP_WAIT: Duration = Duration::from_secs(5);

/// See the module docs.
pub struct ReplicatedLog {
    id: u64,
    queue: String,
    partition: u32,
    group: GroupId,
    dir: PathBuf,
    io: Arc<dyn Io>,
    groups: Arc<Groups>,
    transport: Transport,
    raft_config: Arc<Config>,
    client_addrs: ClientAddrs,
    /// One past the last committed offset, as of the last replica (kept after close).
    last_committed: std::sync::atomic::AtomicU64,
    replicating: Mutex<Replicating>,
    events: OnceLock<LogEvents>,
    /// Since when no leader is known (kept across rebuilds).
    leaderless: Arc<LeaderlessClock>,
}

impl ReplicatedLog {
    fn new(replica: Replica, place: &PartitionPlace, setup: &ReplicatedLogs) -> ReplicatedLog {
        ReplicatedLog {
            id: setup.node_id,
            queue: place.queue.clone(),
            partition: place.index,
            group: replica.group(),
            dir: place.dir.clone(),
            io: place.io.clone(),
            groups: setup.groups.clone(),
            transport: setup.transport.clone(),
            raft_config: setup.raft_config.clone(),
            client_addrs: setup.client_addrs.clone(),
            last_committed: std::sync::atomic::AtomicU64::new(0),
            replicating: Mutex::new(Replicating::Running(Running::new(replica, 0))),
            events: OnceLock::new(),
            leaderless: LeaderlessClock::new(),
        }
    }

    fn replicating(&self) -> MutexGuard<'_, Replicating> {
        self.replicating.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `f` of the running replica, if there is one.
    fn with_replica<T>(&self, f: impl FnOnce(&Replica) -> T) -> Option<T> {
        match &*self.replicating() {
            Replicating::Running(running) => Some(f(&running.replica)),
            Replicating::Fenced(..) | Replicating::Closed => None,
        }
    }

    fn closed(&self) -> BrokerError {
        BrokerError::Closed(format!(
            "partition {} of queue {:?} (its replica was shut down)",
            self.partition, self.queue
        ))
    }

    fn answers(&self, replica: &Replica, events: LogEvents) -> Answers {
        Answers {
            id: self.id,
            queue: self.queue.clone(),
            partition: self.partition,
            client_addrs: self.client_addrs.clone(),
            fence: replica.fence().clone(),
            events,
        }
    }

    /// Send the current role, then start the forwarder and the submitter of `running`.
    fn serve(&self, running: &mut Running, events: &LogEvents) {
        let raft = running.replica.raft().clone();
        let role = role_of(
            self.id,
            &raft.metrics().borrow_watched(),
            None,
            &self.client_addrs,
        );
        let seen = (role.leading, role.leader, role.addr.clone());
        running.replica.hold_for_reader(!role.leading);
        events.send(LogEvent::Role(role));
        let answers = self.answers(&running.replica, events.clone());
        let (submitter, queue) = mpsc::channel(SUBMIT_QUEUE_MAX);
        running.submitter = Some(submitter);
        tokio::spawn(forward(
            answers.clone(),
            raft.clone(),
            running.replica.view(),
            running.replica.committed(),
            running.stop.subscribe(),
            seen,
        ));
        tokio::spawn(replication::watch_leader(
            raft.clone(),
            self.leaderless.clone(),
            running.stop.subscribe(),
        ));
        tokio::spawn(submit(answers, raft, queue, running.stop.subscribe()));
    }

    /// Records of a proposal, refused if a type is in the adapter's range.
    fn records(proposal: Proposal) -> BrokerResult<Vec<PartitionRecord>> {
        if proposal.types.is_empty() || proposal.types.len() != proposal.payloads.len() {
            return Err(BrokerError::Log(LogError::Invalid(format!(
                "a proposal needs one type per payload and at least one record ({} types, {} \
                 payloads)",
                proposal.types.len(),
                proposal.payloads.len()
            ))));
        }
        let timestamp_ms = proposal.timestamp_ms;
        proposal
            .types
            .into_iter()
            .zip(proposal.payloads)
            .map(|(record_type, payload)| {
                PartitionRecord::new(record_type, timestamp_ms, payload)
                    .map_err(|e| BrokerError::Log(LogError::Invalid(e.to_string())))
            })
            .collect()
    }

    /// The submitter's queue, if this node leads; else why not.
    fn submitter(&self) -> BrokerResult<mpsc::Sender<Submission>> {
        let replicating = self.replicating();
        let running = match &*replicating {
            Replicating::Running(running) => running,
            Replicating::Fenced(..) => {
                return Err(BrokerError::Log(LogError::Invalid(format!(
                    "partition {} of {:?}: this node's replica failed and is not rebuilt yet",
                    self.partition, self.queue
                ))))
            }
            Replicating::Closed => return Err(self.closed()),
        };
        if let Some(reason) = running.replica.fence().reason() {
            return Err(BrokerError::Log(fenced_error(reason)));
        }
        // Not knowing when it was elected, a leader never acknowledged counts as leading here:
        // openraft refuses its writes until its lease is confirmed.
        let role = role_of(
            self.id,
            &running.replica.raft().metrics().borrow_watched(),
            None,
            &self.client_addrs,
        );
        if !role.leading {
            return Err(BrokerError::NotLeader {
                queue: self.queue.clone(),
                partition: self.partition,
                leader: role.leader,
                addr: role.addr,
            });
        }
        running.submitter.clone().ok_or_else(|| {
            BrokerError::Log(LogError::Invalid(
                "a partition log proposed to before it was started".into(),
            ))
        })
    }

    fn runtime(&self) -> LogResult<tokio::runtime::Handle> {
        tokio::runtime::Handle::try_current().map_err(|e| {
            LogError::Invalid(format!("a replicated log runs inside a tokio runtime: {e}"))
        })
    }

    /// Stop the replica (blocking); its logs, to close or delete.
    fn shut_down(&self) -> BrokerResult<Option<GroupLogs>> {
        let taken = std::mem::replace(&mut *self.replicating(), Replicating::Closed);
        match taken {
            Replicating::Closed => Ok(None),
            Replicating::Fenced(logs, _) => Ok(Some(logs)),
            Replicating::Running(running) => {
                self.note_committed(&running.replica);
                let handle = self.runtime()?;
                Ok(Some(handle.block_on(running.shut_down(&self.groups))))
            }
        }
    }

    fn note_committed(&self, replica: &Replica) {
        let committed = *replica.committed().borrow();
        self.last_committed
            .fetch_max(committed, std::sync::atomic::Ordering::Relaxed);
    }

    /// Wait (blocking) until nothing else holds `logs`, then close or delete them.
    fn release(&self, mut logs: GroupLogs, delete: bool) -> BrokerResult<()> {
        let deadline = std::time::Instant::now() + CLOSE_WAIT;
        loop {
            let attempt = if delete {
                logs.try_delete()
            } else {
                logs.try_close()
            };
            match attempt {
                Ok(result) => {
                    return result
                        .map_err(|e| BrokerError::Log(log_error("closing a replica's logs", e)))
                }
                Err(again) => logs = again,
            }
            if std::time::Instant::now() >= deadline {
                return Err(BrokerError::Closed(format!(
                    "partition {} of {:?}: its logs are still in use {CLOSE_WAIT:?} after the \
                     replica shut down",
                    self.partition, self.queue
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Rebuild a failed replica (blocking): shut its `Raft` down, heal the logs, start a new
    /// replica on what is durable. The new one must commit again what the old one had
    /// committed before the owner rebuilds its state from it (`caught_up`).
    fn rebuild(&self, handle: &tokio::runtime::Handle, taken: Replicating) -> LogResult<()> {
        let (logs, catch_up_to) = match taken {
            Replicating::Running(running) => {
                let committed = *running.replica.committed().borrow();
                let catch_up_to = committed.max(running.catch_up_to);
                (
                    handle.block_on(running.shut_down(&self.groups)),
                    catch_up_to,
                )
            }
            Replicating::Fenced(logs, catch_up_to) => (logs, catch_up_to),
            Replicating::Closed => return Ok(()),
        };
        if let Err(error) = logs.heal() {
            *self.replicating() = Replicating::Fenced(logs, catch_up_to);
            return Err(log_error("healing a failed replica's logs", error));
        }
        let started = handle.block_on(Replica::start(
            self.id,
            self.group,
            logs.clone(),
            self.raft_config.clone(),
            self.transport.clone(),
            &self.groups,
        ));
        let replica = match started {
            Ok(replica) => replica,
            Err(error) => {
                *self.replicating() = Replicating::Fenced(logs, catch_up_to);
                return Err(log_error("starting a rebuilt replica", error));
            }
        };
        drop(logs);
        tracing::info!(queue = %self.queue, partition = self.partition, catch_up_to, "replica rebuilt after a storage failure");
        let mut running = Running::new(replica, catch_up_to);
        if let Some(events) = self.events.get() {
            self.serve(&mut running, events);
        }
        *self.replicating() = Replicating::Running(running);
        Ok(())
    }

    /// Whether the running replica committed again what its failed predecessor had: waits up
    /// to [`HEAL_CATCH_UP_WAIT`] (blocking).
    fn caught_up(&self, handle: &tokio::runtime::Handle) -> LogResult<()> {
        let Some((mut committed, catch_up_to)) = (match &*self.replicating() {
            Replicating::Running(running) => {
                Some((running.replica.committed(), running.catch_up_to))
            }
            Replicating::Fenced(..) | Replicating::Closed => None,
        }) else {
            return Ok(());
        };
        let reached = handle.block_on(async {
            tokio::time::timeout(
                HEAL_CATCH_UP_WAIT,
                committed.wait_for(|up_to| *up_to >= catch_up_to),
            )
            .await
            .is_ok_and(|waited| waited.is_ok())
        });
        if reached {
            return Ok(());
        }
        Err(LogError::Invalid(format!(
            "partition {} of {:?}: this node's replica was rebuilt after a storage failure and \
             has committed up to {} of the {catch_up_to} it held before (it needs a leader)",
            self.partition,
            self.queue,
            *committed.borrow()
        )))
    }
}

impl Drop for ReplicatedLog {
    /// A log dropped without `close` (a broker dropped without a shutdown) still stops serving
    /// its group: its tasks end, the group leaves the node's handler, and the `Raft` is shut
    /// down on the runtime if there is one. Its logs close when the last holder lets go.
    fn drop(&mut self) {
        let taken = std::mem::replace(&mut *self.replicating(), Replicating::Closed);
        let Replicating::Running(running) = taken else {
            return;
        };
        running.stop.send_replace(true);
        self.groups.remove(self.group);
        let raft = running.replica.raft().clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = raft.shutdown().await;
            });
        }
    }
}

impl PartitionLog for ReplicatedLog {
    fn start(&self, events: LogEvents) {
        if self.events.set(events.clone()).is_err() {
            return;
        }
        if let Replicating::Running(running) = &mut *self.replicating() {
            self.serve(running, &events);
        }
    }

    fn propose(self: Arc<Self>, proposal: Proposal) -> Proposing {
        Box::pin(async move {
            let sequence = proposal.sequence;
            let records = ReplicatedLog::records(proposal)?;
            let submitter = self.submitter()?;
            submitter
                .send(Submission { sequence, records })
                .await
                .map_err(|_| self.closed())
        })
    }

    fn reader(&self, offset: u64) -> BoxReader {
        let reader = self.with_replica(|replica| replica.reader_with_adapter_entries(offset));
        Box::new(ReplicatedReader {
            reader,
            offset,
            dir: self.dir.clone(),
        })
    }

    fn committed_offset(&self) -> u64 {
        self.with_replica(|replica| *replica.committed().borrow())
            .unwrap_or_else(|| {
                self.last_committed
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
    }

    fn start_offset(&self) -> u64 {
        // Past the purge point too: after a snapshot install the entry log may still hold
        // records below it until they are removed (or gap records, see `store.rs`).
        self.with_replica(|replica| replica.log_floor())
            .unwrap_or(0)
    }

    fn truncate_suffix(&self, from: u64) -> LogResult<()> {
        // openraft cuts an uncommitted suffix itself (a follower's divergent entries); the
        // owner never sees those records, so only the committed ones are its concern.
        let committed = self.committed_offset();
        if from >= committed {
            return Ok(());
        }
        Err(LogError::Invalid(format!(
            "a replicated log never drops committed records (asked to truncate from {from}, \
             committed up to {committed})"
        )))
    }

    /// A replica whose storage failed (its fence tripped) is rebuilt: its `Raft` shut down,
    /// its logs healed, a new replica started on what is durable (the entries it lost come
    /// back from the leader). The heal succeeds once the new replica has committed again
    /// everything the failed one had, so that the owner's rebuild from the log loses nothing
    /// it applied; until then it fails and the owner asks again later.
    fn heal(&self) -> LogResult<()> {
        let handle = self.runtime()?;
        let failed = {
            let mut replicating = self.replicating();
            let failed = match &*replicating {
                Replicating::Running(running) => running.replica.fence().is_tripped(),
                Replicating::Fenced(..) => true,
                Replicating::Closed => return Ok(()),
            };
            failed.then(|| std::mem::replace(&mut *replicating, Replicating::Closed))
        };
        if let Some(taken) = failed {
            self.rebuild(&handle, taken)?;
        }
        self.caught_up(&handle)
    }

    fn remove_prefix(&self, before: u64) -> LogResult<Removing> {
        // The owner needs nothing below `before`: a snapshot just below it lets openraft purge
        // the entries it covers (once no replication stream still reads them) and send it to
        // a follower that lags behind them. See `replica/notifier.rs`.
        let Some((raft, notifier, logs)) = self.with_replica(|replica| {
            (
                replica.raft().clone(),
                replica.notifier().clone(),
                replica.logs().clone(),
            )
        }) else {
            return Ok(Box::pin(std::future::ready(Ok(PrefixRemoval::default()))));
        };
        notifier.set_floor(before);
        Ok(Box::pin(async move {
            let entries = logs.entries();
            let segments_before = entries.stats().segments.len();
            let bytes_before = entries.disk_bytes();
            let start = entries.start_offset();
            if raft.trigger().snapshot().await.is_err() {
                // Shut down meanwhile: nothing was removed.
                return Ok(PrefixRemoval::default());
            }
            // openraft builds the snapshot and purges on its own schedule (a leader keeps
            // entries a replication stream is sending): report what went within a short wait;
            // later removals show in the log's figures.
            let deadline = tokio::time::Instant::now() + PURGE_WAIT;
            while entries.start_offset() == start && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(PrefixRemoval {
                segments: segments_before.saturating_sub(entries.stats().segments.len()),
                bytes: bytes_before.saturating_sub(entries.disk_bytes()),
            })
        }))
    }

    fn hand_back(&self) -> LogResult<Removing> {
        // An idle replica keeps its tail segment (the group's log goes on from there); its
        // older segments go with prefix removal.
        Ok(Box::pin(std::future::ready(Ok(PrefixRemoval {
            segments: 0,
            bytes: 0,
        }))))
    }

    fn disk_bytes(&self) -> u64 {
        self.with_replica(|replica| replica.logs().entries().disk_bytes())
            .unwrap_or(0)
    }

    fn tail_room_bytes(&self) -> u64 {
        self.with_replica(|replica| replica.logs().entries().tail_room_bytes())
            .unwrap_or(0)
    }

    fn space(&self) -> LogSpace {
        let Some(stats) = self.with_replica(|replica| replica.logs().entries().stats()) else {
            return LogSpace {
                disk_bytes: 0,
                segment_bases: Vec::new(),
            };
        };
        LogSpace {
            disk_bytes: stats.disk_bytes,
            segment_bases: stats.segments.iter().map(|s| s.base_offset).collect(),
        }
    }

    fn close(self: Arc<Self>) -> BrokerResult<()> {
        match self.shut_down()? {
            Some(logs) => self.release(logs, false),
            None => Ok(()),
        }
    }

    fn delete(self: Arc<Self>) -> BrokerResult<()> {
        if let Some(logs) = self.shut_down()? {
            self.release(logs, true)?;
        }
        match self.io.exists(&self.dir) {
            Ok(false) => Ok(()),
            Ok(true) => self.io.remove_dir(&self.dir).map_err(|e| {
                BrokerError::Log(LogError::Invalid(format!(
                    "remove {}: {e}",
                    self.dir.display()
                )))
            }),
            Err(e) => Err(BrokerError::Log(LogError::Invalid(format!(
                "stat {}: {e}",
                self.dir.display()
            )))),
        }
    }

    fn replication(&self) -> Option<ReplicationStatus> {
        self.with_replica(|replica| replication::status_of(self.id, replica, &self.leaderless))
    }

    fn delivery_lease(&self) -> DeliveryLease {
        self.with_replica(|replica| {
            if replica.fence().is_tripped() {
                return DeliveryLease::Lapsed;
            }
            delivery_lease(&replica.raft().metrics().borrow_watched())
        })
        .unwrap_or(DeliveryLease::Lapsed)
    }

    fn reset(self: Arc<Self>) -> (Option<Arc<dyn PartitionLog>>, BrokerResult<()>) {
        let error = BrokerError::Invalid(format!(
            "partition {} of {:?} is replicated: its log is not reset in place; a purge \
             writes a PURGE record through the leader like any other",
            self.partition, self.queue
        ));
        (Some(self), Err(error))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use openraft::{ServerState, StoredMembership};

    use super::*;
    use crate::types::Membership;

    /// Node `id`'s metrics in `state`, knowing `leader`, in a group of `voters`.
    fn metrics(
        id: u64,
        state: ServerState,
        leader: Option<u64>,
        voters: &[u64],
    ) -> RaftMetrics<TypeConfig> {
        let nodes: BTreeMap<u64, NodeAddr> = voters
            .iter()
            .map(|v| (*v, NodeAddr::new(format!("node-{v}:7000"))))
            .collect();
        let membership =
            Membership::new(vec![voters.iter().copied().collect::<BTreeSet<_>>()], nodes)
                .expect("membership");
        let mut metrics = RaftMetrics::<TypeConfig>::new_initial(id);
        metrics.state = state;
        metrics.current_leader = leader;
        metrics.membership_config = Arc::new(StoredMembership::new(None, membership));
        metrics
    }

    fn client_addrs() -> ClientAddrs {
        Arc::new(|id| Some(format!("node-{id}:5680")))
    }

    #[test]
    fn a_follower_names_the_leader_it_knows() {
        let role = role_of(
            2,
            &metrics(2, ServerState::Follower, Some(3), &[1, 2, 3]),
            None,
            &client_addrs(),
        );
        assert!(!role.leading);
        assert_eq!(role.leader, Some(3));
        assert_eq!(role.addr.as_deref(), Some("node-3:5680"));
    }

    #[test]
    fn a_leader_leads_and_names_no_address() {
        let role = role_of(
            2,
            &metrics(2, ServerState::Leader, Some(2), &[1, 2, 3]),
            None,
            &client_addrs(),
        );
        assert!(role.leading);
        assert_eq!(role.addr, None);
    }

    /// A leader that handed the group over or removed itself is a follower whose last committed
    /// vote is still its own until it hears the next leader: it must not send clients to itself.
    #[test]
    fn a_node_that_does_not_lead_never_names_itself() {
        for state in [
            ServerState::Follower,
            ServerState::Candidate,
            ServerState::Learner,
        ] {
            let role = role_of(
                2,
                &metrics(2, state, Some(2), &[1, 2, 3]),
                None,
                &client_addrs(),
            );
            assert!(!role.leading, "{state:?}");
            assert_eq!(role.leader, None, "{state:?}: named itself");
            assert_eq!(role.addr, None, "{state:?}: its own address");
        }
    }

    /// A leader that no majority acknowledged since its election does not count as cut off at
    /// first (openraft holds its writes until its lease is confirmed), but does once the
    /// lease has passed since it was elected: its consumers must go where a leader can serve
    /// them. It never holds the delivery lease meanwhile.
    #[test]
    fn a_leader_never_acknowledged_is_cut_off_a_lease_after_its_election() {
        let leader = metrics(2, ServerState::Leader, Some(2), &[1, 2, 3]);
        let now = tokio::time::Instant::now();
        let just = role_of(2, &leader, Some(now), &client_addrs());
        assert!(just.leading, "just elected: {just:?}");
        let long_ago = now
            .checked_sub(QUORUM_LOST_AFTER + Duration::from_millis(100))
            .expect("the clock runs longer than a lease");
        let late = role_of(2, &leader, Some(long_ago), &client_addrs());
        assert!(!late.leading, "never acknowledged for a lease: {late:?}");
        assert_eq!(late.leader, None);
        assert_eq!(delivery_lease(&leader), DeliveryLease::Lapsed);
    }

    /// The delivery lease: none for a follower, held by a leader alone, and for the leader of
    /// several voters until `DELIVERY_LEASE` after the last acknowledged request.
    #[test]
    fn the_delivery_lease_follows_the_last_quorum_acknowledgement() {
        let follower = metrics(2, ServerState::Follower, Some(3), &[1, 2, 3]);
        assert_eq!(delivery_lease(&follower), DeliveryLease::Lapsed);
        let alone = metrics(2, ServerState::Leader, Some(2), &[2]);
        assert_eq!(delivery_lease(&alone), DeliveryLease::Held);
        let mut leader = metrics(2, ServerState::Leader, Some(2), &[1, 2, 3]);
        let now = <openraft::type_config::alias::InstantOf<TypeConfig> as openraft::Instant>::now();
        leader.last_quorum_acked = Some(now.into());
        let before = tokio::time::Instant::now();
        match delivery_lease(&leader) {
            DeliveryLease::Until(until) => {
                // (Two clock readings apart: a millisecond of slack.)
                let latest = before + DELIVERY_LEASE + Duration::from_millis(1);
                assert!(until > before && until <= latest, "{until:?}");
            }
            other => panic!("a leader just acknowledged: {other:?}"),
        }
        let stale = now - (DELIVERY_LEASE + Duration::from_millis(1));
        leader.last_quorum_acked = Some(stale.into());
        assert_eq!(delivery_lease(&leader), DeliveryLease::Lapsed);
    }

    /// A former leader moved off the group (no voter any more) stays the leader a follower
    /// knows until the voters elect; the former leader's node then points at the partition's
    /// replicas, one of which points back at it: a loop. Name no one instead.
    #[test]
    fn a_follower_never_names_a_leader_that_is_no_voter() {
        let role = role_of(
            2,
            &metrics(2, ServerState::Follower, Some(4), &[1, 2, 3]),
            None,
            &client_addrs(),
        );
        assert!(!role.leading);
        assert_eq!(role.leader, None, "named node 4, which is no voter");
        assert_eq!(role.addr, None);
    }
}
