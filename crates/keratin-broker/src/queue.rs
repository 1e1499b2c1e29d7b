//! `Queue`: a declared queue, its settings and the handles of its partitions' owner tasks.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::consumer::ConsumerLink;
use crate::error::{BrokerError, BrokerResult};
use crate::partition::log::PartitionLog;
use crate::partition::owner::Command;
use crate::partition::producers::RANGES_MAX;
use crate::partition::replication::ReplicationStatus;
use crate::partition::state::PartitionState;
use crate::record::Message;

/// What a queue does when a publish would pass its `max_messages` or `max_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// Refuse the publish with `ERR_LIMITED`, reason `queue_full`; nothing of it is applied.
    #[default]
    Reject,
    /// Remove the oldest ready messages to make room (to the dead-letter queue when one is set).
    DropOldest,
}

impl Overflow {
    /// `reject` or `drop_oldest`.
    pub fn as_str(self) -> &'static str {
        match self {
            Overflow::Reject => "reject",
            Overflow::DropOldest => "drop_oldest",
        }
    }
}

/// A queue's settings. `partitions` is fixed at declaration; the others can change on a live
/// queue ([`crate::Broker::set_queue_settings`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSettings {
    /// Number of partitions (at least 1).
    pub partitions: u32,
    /// Queue that rejected and expired messages go to.
    pub dead_letter: Option<String>,
    /// A message delivered this many times and returned again is dead-lettered (or dropped).
    pub max_deliveries: Option<u32>,
    /// Most messages (ready and inflight) the queue holds; each partition enforces its share
    /// (the limit divided by the partitions, rounded up).
    #[serde(default)]
    pub max_messages: Option<u64>,
    /// Most message bytes (ready and inflight) the queue holds, shared like `max_messages`.
    #[serde(default)]
    pub max_bytes: Option<u64>,
    /// What happens at a limit; `None` means [`Overflow::Reject`].
    #[serde(default)]
    pub overflow: Option<Overflow>,
    /// Replicas of each partition in a cluster (`None`: the cluster's default,
    /// `min(3, nodes)`). A single node holds one copy and refuses more than 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings {
            partitions: 1,
            dead_letter: None,
            max_deliveries: None,
            max_messages: None,
            max_bytes: None,
            overflow: None,
            replicas: None,
        }
    }
}

impl std::fmt::Display for QueueSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "partitions={}", self.partitions)?;
        if let Some(dl) = &self.dead_letter {
            write!(f, ", dead_letter={dl}")?;
        }
        if let Some(max) = self.max_deliveries {
            write!(f, ", max_deliveries={max}")?;
        }
        if let Some(max) = self.max_messages {
            write!(f, ", max_messages={max}")?;
        }
        if let Some(max) = self.max_bytes {
            write!(f, ", max_bytes={max}")?;
        }
        if let Some(overflow) = self.overflow {
            write!(f, ", overflow={}", overflow.as_str())?;
        }
        if let Some(replicas) = self.replicas {
            write!(f, ", replicas={replicas}")?;
        }
        Ok(())
    }
}

/// Maximum partitions of one queue: each has its own log and commit thread.
pub const MAX_PARTITIONS: u32 = 64;

/// Maximum replicas of a partition: a Raft group of up to 7 voters tolerates 3 lost nodes.
pub const MAX_REPLICAS: u32 = 7;

impl QueueSettings {
    pub(crate) fn validate(&self, name: &str) -> BrokerResult<()> {
        if self.partitions == 0 || self.partitions > MAX_PARTITIONS {
            return Err(BrokerError::Invalid(format!(
                "partitions = {}: expected 1 to {MAX_PARTITIONS}",
                self.partitions
            )));
        }
        if self.dead_letter.as_deref() == Some(name) {
            return Err(BrokerError::Invalid(
                "a queue cannot be its own dead-letter queue".into(),
            ));
        }
        if let Some(replicas) = self.replicas {
            if replicas == 0 || replicas > MAX_REPLICAS {
                return Err(BrokerError::Invalid(format!(
                    "replicas = {replicas}: expected 1 to {MAX_REPLICAS}"
                )));
            }
        }
        if self.max_deliveries == Some(0) {
            return Err(BrokerError::Invalid(
                "max_deliveries must be at least 1".into(),
            ));
        }
        if self.max_messages == Some(0) || self.max_bytes == Some(0) {
            return Err(BrokerError::Invalid(
                "max_messages and max_bytes must be at least 1 (leave them unset for no limit)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// This partition's share of the queue limits.
    pub(crate) fn partition_limits(&self) -> PartitionLimits {
        let n = u64::from(self.partitions.max(1));
        PartitionLimits {
            max_messages: self.max_messages.map(|m| m.div_ceil(n)),
            max_bytes: self.max_bytes.map(|b| b.div_ceil(n)),
            overflow: self.overflow.unwrap_or_default(),
        }
    }
}

/// The limits one partition enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartitionLimits {
    pub(crate) max_messages: Option<u64>,
    pub(crate) max_bytes: Option<u64>,
    pub(crate) overflow: Overflow,
}

impl PartitionLimits {
    pub(crate) fn is_set(&self) -> bool {
        self.max_messages.is_some() || self.max_bytes.is_some()
    }
}

/// Check a queue name: 1 to 255 bytes of letters, digits, `.`, `_`, `-`.
pub fn validate_queue_name(name: &str) -> BrokerResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(BrokerError::Invalid(format!(
            "queue name {name:?}: expected 1 to 255 letters, digits, '.', '_' or '-'"
        )))
    }
}

/// Figures a partition's owner publishes for readers (queue info, metrics).
#[derive(Debug, Default)]
pub(crate) struct PartitionFigures {
    pub(crate) ready: AtomicU64,
    pub(crate) inflight: AtomicU64,
    pub(crate) live_bytes: AtomicU64,
    pub(crate) disk_bytes: AtomicU64,
    pub(crate) stopped: AtomicU64,
    /// Publishes refused with `queue_full`.
    pub(crate) rejected_full: AtomicU64,
    /// Messages removed by `drop_oldest` (dropped or dead-lettered).
    pub(crate) overflowed: AtomicU64,
    /// 1 while the partition is at its limit.
    pub(crate) full: AtomicU64,
    /// Times its log stopped.
    pub(crate) stops: AtomicU64,
    /// Times its stopped log was healed.
    pub(crate) heals: AtomicU64,
    /// Dead-letter copies that failed, by [`DeadLetterFailure`] index (see
    /// [`PartitionFigures::count_dead_letter_failures`]).
    pub(crate) dead_letter_failures: [AtomicU64; DeadLetterFailure::ALL.len()],
    /// Messages held until their dead-letter copies are confirmed (as the owner last
    /// published).
    pub(crate) dead_letters_held: AtomicU64,
    /// Who leads the partition, as its owner last heard from its log.
    pub(crate) role: std::sync::RwLock<crate::partition::log::Role>,
    /// Times the leader its log reported changed to another known node (see
    /// [`PartitionFigures::set_role`]).
    pub(crate) leader_changes: AtomicU64,
    /// The last leader its log named (kept while none is known).
    last_leader: std::sync::Mutex<Option<u64>>,
    /// The partition's log, for its replication figures (set once the owner is spawned; weak,
    /// so that closing the log is not held up by readers of figures).
    pub(crate) log: LogLink,
}

/// A weak link to a partition's log; set again when the partition's owner is replaced (its
/// copy moved onto or off this node).
#[derive(Default)]
pub(crate) struct LogLink(std::sync::RwLock<Option<std::sync::Weak<dyn PartitionLog>>>);

impl std::fmt::Debug for LogLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogLink")
    }
}

impl LogLink {
    /// Link `log`, in place of the one linked before.
    pub(crate) fn set(&self, log: &Arc<dyn PartitionLog>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::downgrade(log));
    }

    /// The log's replication figures, if it is replicated and still open.
    pub(crate) fn replication(&self) -> Option<ReplicationStatus> {
        let log = self
            .0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()?
            .upgrade()?;
        log.replication()
    }
}

impl PartitionFigures {
    /// Who leads the partition.
    pub(crate) fn role(&self) -> crate::partition::log::Role {
        self.role.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether this node leads the partition (without cloning the role).
    pub(crate) fn is_leading(&self) -> bool {
        self.role.read().unwrap_or_else(|e| e.into_inner()).leading
    }

    /// The owner heard `role` from its log: publish it, and count a change of leader (a
    /// leader named that differs from the last one named; "no leader known" between two
    /// terms of the same leader is no change).
    pub(crate) fn set_role(&self, role: crate::partition::log::Role) {
        if let Some(leader) = role.leader {
            let mut last = self.last_leader.lock().unwrap_or_else(|e| e.into_inner());
            if *last != Some(leader) {
                *last = Some(leader);
                self.leader_changes.fetch_add(1, Ordering::Relaxed);
            }
        }
        *self.role.write().unwrap_or_else(|e| e.into_inner()) = role;
    }

    /// Count the messages of a dead-lettering attempt whose copies the dead-letter queue did
    /// not store: they are held and tried again, and this is how an operator hears of it.
    pub(crate) fn count_dead_letter_failures<T>(&self, results: &[BrokerResult<T>]) {
        for error in results.iter().filter_map(|r| r.as_ref().err()) {
            let failure = DeadLetterFailure::of(error);
            self.dead_letter_failures[failure as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Count `count` messages dropped instead of dead-lettered, for `reason`.
    pub(crate) fn count_dead_letter_drops(&self, count: u64, reason: DeadLetterFailure) {
        self.dead_letter_failures[reason as usize].fetch_add(count, Ordering::Relaxed);
    }

    /// The dead-letter failure counts, non-zero ones only.
    pub(crate) fn dead_letter_failures(&self) -> BTreeMap<DeadLetterFailure, u64> {
        DeadLetterFailure::ALL
            .into_iter()
            .map(|f| {
                (
                    f,
                    self.dead_letter_failures[f as usize].load(Ordering::Relaxed),
                )
            })
            .filter(|(_, count)| *count > 0)
            .collect()
    }
}

/// Why a dead-letter copy was not stored (its original is held and tried again, or, past the
/// node's bound of held dead letters, a message `drop_oldest` removed was dropped); the
/// `reason` label of `keratin_dead_letter_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeadLetterFailure {
    /// The dead-letter queue does not exist (never declared, or deleted).
    NotFound = 0,
    /// The dead-letter queue is full (its `max_messages` / `max_bytes` with `reject`).
    QueueFull = 1,
    /// The dead-letter queue's partition could not write it, or its outcome is unknown: its
    /// log stopped, its leader is elsewhere, moving or unreachable, or the node held its most
    /// dead letters (a `drop_oldest` removal dropped).
    Unavailable = 2,
    /// Anything else: the message is invalid there, or the node is shutting down.
    Other = 3,
}

impl DeadLetterFailure {
    /// Every reason, in index order.
    pub const ALL: [DeadLetterFailure; 4] = [
        DeadLetterFailure::NotFound,
        DeadLetterFailure::QueueFull,
        DeadLetterFailure::Unavailable,
        DeadLetterFailure::Other,
    ];

    /// The stable metrics and attention name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterFailure::NotFound => "not_found",
            DeadLetterFailure::QueueFull => "queue_full",
            DeadLetterFailure::Unavailable => "unavailable",
            DeadLetterFailure::Other => "other",
        }
    }

    fn of(error: &BrokerError) -> DeadLetterFailure {
        match error {
            BrokerError::NotFound(_) => DeadLetterFailure::NotFound,
            BrokerError::Limited { .. } => DeadLetterFailure::QueueFull,
            BrokerError::Unavailable { .. }
            | BrokerError::OutcomeUnknown { .. }
            | BrokerError::LeadershipLost { .. }
            | BrokerError::TimedOut { .. }
            | BrokerError::NotLeader { .. }
            | BrokerError::Unreachable { .. }
            | BrokerError::MetadataUnavailable { .. } => DeadLetterFailure::Unavailable,
            _ => DeadLetterFailure::Other,
        }
    }
}

/// The handle of one partition's owner task. The owner can be replaced while the queue
/// lives (this node's copy of the partition moved: `Broker::set_partition_replicas`); every
/// holder of the handle then reaches the new one.
#[derive(Debug)]
pub(crate) struct PartitionHandle {
    pub(crate) index: u32,
    commands: std::sync::RwLock<mpsc::UnboundedSender<Command>>,
    pub(crate) figures: Arc<PartitionFigures>,
}

impl PartitionHandle {
    pub(crate) fn new(
        index: u32,
        commands: mpsc::UnboundedSender<Command>,
        figures: Arc<PartitionFigures>,
    ) -> PartitionHandle {
        PartitionHandle {
            index,
            commands: std::sync::RwLock::new(commands),
            figures,
        }
    }

    fn send(&self, command: Command) {
        // A closed channel means the owner is gone (queue deleted or broker shut down): the
        // request has nothing left to act on.
        let _ = self
            .commands
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .send(command);
    }

    /// Send from now on to `next`'s owner (it must be the same partition's, sharing these
    /// figures); returns the sender of the owner replaced, which still gets what was sent
    /// before.
    pub(crate) fn replace_owner(&self, next: PartitionHandle) -> mpsc::UnboundedSender<Command> {
        debug_assert!(Arc::ptr_eq(&self.figures, &next.figures));
        let sender = next
            .commands
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        std::mem::replace(
            &mut *self.commands.write().unwrap_or_else(|e| e.into_inner()),
            sender,
        )
    }

    /// Hand messages to the owner now; the receiver gets the outcome.
    pub(crate) fn dispatch(
        &self,
        payloads: Vec<Vec<u8>>,
        timestamp_ms: u64,
        internal: bool,
    ) -> oneshot::Receiver<BrokerResult<Range<u64>>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Publish {
            payloads,
            timestamp_ms,
            internal,
            reply,
        });
        rx
    }

    pub(crate) fn subscribe(&self, link: Arc<ConsumerLink>) {
        self.send(Command::Subscribe { link });
    }

    pub(crate) fn unsubscribe(&self, consumer: u64) {
        self.send(Command::Unsubscribe { consumer });
    }

    pub(crate) fn settle(&self, consumer: u64, messages: Vec<u64>, reject: Option<bool>) {
        self.send(Command::Settle {
            consumer,
            messages,
            reject,
        });
    }

    pub(crate) fn kick(&self) {
        self.send(Command::Kick);
    }

    pub(crate) async fn request<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<BrokerResult<T>>) -> Command,
    ) -> BrokerResult<T> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply));
        rx.await
            .unwrap_or_else(|_| Err(BrokerError::Closed("partition".into())))
    }

    pub(crate) async fn purge(&self) -> BrokerResult<u64> {
        self.request(|reply| Command::Purge { reply }).await
    }

    pub(crate) async fn state(&self) -> BrokerResult<(PartitionState, PartitionState)> {
        self.request(|reply| Command::CheckState { reply }).await
    }
}

/// Consecutive sequences of an idempotent producer that go to one partition when its messages
/// have no routing key (Kafka's sticky partitioner): partition `(producer id + sequence /
/// PRODUCER_SEQUENCE_BLOCK) mod partitions`. A partition's window of a producer keeps
/// [`RANGES_MAX`] runs of stored sequences (`partition/producers.rs`); a block stored whole is
/// one run, so the window covers the producer's last 64 blocks there, 64 × 64 = 4,096 of its
/// sequences, four times the 1,000 publishes the CLI keeps in flight (what a lost leader
/// leaves with an unknown outcome, to be sent again). With one sequence per partition in
/// turn (a block of 1) each message was a run of its own and the window covered 64. A
/// producer still moves on to the next partition every 64 messages, so its 1,000 publishes in
/// flight spread over ~16 blocks and every partition. Part of the routing contract the
/// clients compute too (`docs/protocol.md`, "Publish"; `keratin-client` `partitioning.rs`).
pub const PRODUCER_SEQUENCE_BLOCK: u64 = 64;
const _: () = assert!(PRODUCER_SEQUENCE_BLOCK * RANGES_MAX as u64 >= 4 * 1_000);

/// The partition of `partitions` that `message` goes to (a queue's or a stream's; see
/// [`Queue::route`]), `round_robin` counting the messages without key or producer. Those go
/// round robin over the partitions `leads` says this node leads when it leads any, else over
/// all (and are refused "not the leader" by the partition's owner, naming its leader).
pub(crate) fn route(
    message: &Message,
    partitions: usize,
    round_robin: &AtomicU64,
    leads: impl Fn(usize) -> bool,
) -> usize {
    let n = partitions.max(1);
    let choice = match (&message.producer, message.routing_key.is_empty()) {
        (_, false) => u64::from(crc32c::crc32c(message.routing_key.as_bytes())),
        (Some(mark), true) => mark
            .producer
            .wrapping_add(mark.sequence / PRODUCER_SEQUENCE_BLOCK),
        (None, true) => {
            let turn = round_robin.fetch_add(1, Ordering::Relaxed);
            let led = (0..n).filter(|&p| leads(p)).count();
            if led == 0 {
                return (turn % n as u64) as usize;
            }
            let k = (turn % led as u64) as usize;
            return (0..n).filter(|&p| leads(p)).nth(k).unwrap_or(0);
        }
    };
    (choice % n as u64) as usize
}

/// A declared queue.
#[derive(Debug)]
pub struct Queue {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) settings: std::sync::RwLock<QueueSettings>,
    pub(crate) partitions: Vec<PartitionHandle>,
    round_robin: AtomicU64,
}

impl Queue {
    pub(crate) fn new(
        id: u64,
        name: String,
        settings: QueueSettings,
        partitions: Vec<PartitionHandle>,
    ) -> Queue {
        Queue {
            id,
            name,
            settings: std::sync::RwLock::new(settings),
            partitions,
            round_robin: AtomicU64::new(0),
        }
    }

    /// The partition `message` goes to: by the CRC32C of its routing key; without one, by its
    /// idempotent producer's id plus its sequence's block ([`PRODUCER_SEQUENCE_BLOCK`]: a
    /// retry of the message, on any node, goes where the first copy went, so the partition's
    /// window drops it as a duplicate); else round robin over the partitions this node leads
    /// (all when it leads none): a message with neither key nor producer may go to any
    /// partition, and one led elsewhere would only be refused ("not the leader").
    pub(crate) fn route(&self, message: &Message) -> usize {
        route(message, self.partitions.len(), &self.round_robin, |p| {
            self.partitions[p].figures.is_leading()
        })
    }

    /// The queue's id (names its directories).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The queue's current settings.
    pub fn settings(&self) -> QueueSettings {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn kick_all(&self) {
        for partition in &self.partitions {
            partition.kick();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::log::Role;

    fn role(leader: Option<u64>) -> Role {
        Role {
            leading: false,
            leader,
            addr: None,
            from: 0,
        }
    }

    fn produced(producer: u64, sequence: u64) -> Message {
        Message {
            producer: Some(crate::record::ProducerSeq { producer, sequence }),
            ..Message::new("x")
        }
    }

    #[test]
    fn a_producers_keyless_sequences_go_in_blocks_keys_by_crc32c() {
        let rr = AtomicU64::new(0);
        let all = |_: usize| true;
        // CRC32C("123456789") is the standard check value 0xE3069283 (the clients test the same).
        let keyed = Message {
            routing_key: "123456789".into(),
            ..produced(1, 5)
        };
        assert_eq!(route(&keyed, 7, &rr, all), (0xE306_9283_u32 % 7) as usize);
        // Blocks of 64: sequences 0..=63 on partition (9 + 0) % 3, 64..=127 on (9 + 1) % 3.
        let block = PRODUCER_SEQUENCE_BLOCK;
        for sequence in 0..block {
            assert_eq!(route(&produced(9, sequence), 3, &rr, all), 0);
        }
        assert_eq!(route(&produced(9, block), 3, &rr, all), 1);
        assert_eq!(route(&produced(9, 2 * block - 1), 3, &rr, all), 1);
        assert_eq!(route(&produced(9, 2 * block), 3, &rr, all), 2);
        assert_eq!(
            route(&produced(9, 130), 3, &rr, all),
            ((9 + 130 / 64) % 3) as usize
        );
        assert_eq!(
            route(&produced(u64::MAX, 64), 3, &rr, all),
            (u64::MAX.wrapping_add(1) % 3) as usize
        );
        assert_eq!(
            rr.load(Ordering::Relaxed),
            0,
            "no turn taken by keyed or numbered messages"
        );
    }

    #[test]
    fn messages_without_key_or_producer_go_round_robin_over_the_partitions_led_here() {
        let rr = AtomicU64::new(0);
        let plain = Message::new("x");
        let picks: Vec<usize> = (0..6).map(|_| route(&plain, 3, &rr, |p| p == 1)).collect();
        assert_eq!(
            picks,
            vec![1; 6],
            "one partition led here: all of them there"
        );
        let picks: Vec<usize> = (0..4).map(|_| route(&plain, 3, &rr, |p| p != 1)).collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
        let mut picks: Vec<usize> = (0..3).map(|_| route(&plain, 3, &rr, |_| false)).collect();
        picks.sort_unstable();
        assert_eq!(picks, vec![0, 1, 2], "none led here: over all, as before");
    }

    #[test]
    fn a_leader_change_counts_once_per_new_leader() {
        let figures = PartitionFigures::default();
        let leaders = [
            None,
            Some(1),
            Some(1),
            None,
            Some(1),
            Some(2),
            None,
            Some(3),
        ];
        for leader in leaders {
            figures.set_role(role(leader));
        }
        // 1, then 2, then 3: no leader known in between is no change, the same one again
        // neither.
        assert_eq!(figures.leader_changes.load(Ordering::Relaxed), 3);
        assert_eq!(figures.role().leader, Some(3));
    }
}
