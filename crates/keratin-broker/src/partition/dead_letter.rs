//! Dead-lettering's parts that are not the owner's task: [`DeadLetterSink`], where a partition
//! sends the messages it dead-letters (rejected, past `max_deliveries`, dropped by
//! `drop_oldest`); the messages a partition holds until the dead-letter queue confirmed their
//! copies ([`HeldDeadLetters`], with its bounds); and the mark that makes the copies an
//! idempotent producer's ([`dead_letter_mark`]).
//!
//! Dead-lettering is at least once (`docs/cluster.md`, "Dead-lettering"): the owner reads the
//! payloads, adds the `x-death-*` headers, hands them to the sink, and settles an original as
//! dead-lettered only once the sink confirmed its copy. A copy the sink could not store (the
//! dead-letter queue's leader elsewhere, moving or unreachable, the queue full or not
//! declared) leaves its original held, live in the source queue and counted toward its
//! limits, and it is tried again after a backoff. The retry of a copy whose first attempt had
//! an unknown outcome carries the same mark, so the dead-letter partition stores it once.
//!
//! `LocalDeadLetters` (in `broker.rs`, since it is the broker's own publish) is the single-node
//! sink: an internal publish into the dead-letter queue through this node's broker (never held
//! back by the publish gate, bound by the queue limits). A cluster node's sink
//! (`keratin-cluster`) publishes each partition's share on that partition's leader, wherever it
//! is.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::BrokerResult;
use crate::partition::delivery_state::Inflight;
use crate::partition::producers;
use crate::record::{Message, ProducerSeq};

/// The outcomes of a dead-lettering publish, one per message, in order.
pub type DeadLettering = Pin<Box<dyn Future<Output = Vec<BrokerResult<()>>> + Send>>;

/// Where dead-lettered messages go.
pub trait DeadLetterSink: Send + Sync + 'static {
    /// False while the sink cannot publish (the node is starting or going away): the owner
    /// holds its dead letters and tries again later.
    fn is_open(&self) -> bool;

    /// Publish `messages` into dead-letter queue `queue`, once (the owner retries), with the
    /// internal publish's rules: not held back by the node's resource gate, refused when the
    /// queue is full (`reject`). `Ok` for a message means its copy is stored (committed on the
    /// dead-letter partition's replicas); an error means it is not, or that the outcome is
    /// unknown. Never blocks; the future may wait for the commit.
    fn publish(&self, queue: &str, messages: Vec<Message>) -> DeadLettering;
}

/// Why a message goes to the dead-letter queue; sent as the `x-death-reason` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeathReason {
    /// Dropped by `drop_oldest` to make room.
    Overflow,
    Rejected,
    MaxDeliveries,
}

impl DeathReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::MaxDeliveries => "max_deliveries",
            DeathReason::Overflow => "overflow",
        }
    }
}

/// A message waiting to be dead-lettered (it is in the partition's `limbo`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dying {
    pub(crate) message: u64,
    pub(crate) entry: Inflight,
    pub(crate) reason: DeathReason,
}

/// One attempt carries at most this many messages. Equal to the number of runs an idempotent
/// producer's window keeps (`producers::RANGES_MAX`): the marks of one attempt are offsets of
/// the source partition, often not consecutive (each a run of its own), and a retry of the
/// attempt after an unknown outcome must still find every one of them in the window of the
/// dead-letter partition to be stored once.
pub const ATTEMPT_MESSAGES_MAX: usize = producers::RANGES_MAX;
const _: () = assert!(ATTEMPT_MESSAGES_MAX == producers::RANGES_MAX);

/// One attempt carries at most this many payload bytes (a larger message goes alone). The
/// payloads are charged to the node's delivery budget while the attempt is out: 1 MiB is a
/// sixty-fourth of its 64 MiB default, so a few partitions dead-lettering at once do not hold
/// up deliveries.
pub(crate) const ATTEMPT_BYTES_MAX: u64 = 1 << 20;

/// The first retry after a failed attempt waits this long; each failure in a row doubles it...
pub(crate) const RETRY_AFTER_MIN: Duration = Duration::from_millis(100);

/// ...up to this: a dead-letter queue that comes back (a new leader elected in a second or
/// two, room made by a consumer) is tried again within 5 s, and a partition whose
/// dead-letter queue stays away costs one attempt per 5 s.
pub(crate) const RETRY_AFTER_MAX: Duration = Duration::from_secs(5);

/// Most messages a node holds for dead-lettering over all its partitions (those in an attempt
/// included). Each costs about 64 bytes (a [`Dying`] of 32 bytes in a `VecDeque`, and its
/// `limbo` entry, 12 bytes in a hash map at most 7/8 full with its control byte): 65,536 of
/// them are 4 MiB. At the bound, a partition holding dead letters delivers nothing more
/// (a delivery would only add to them; its consumers get other partitions' messages), and a
/// message `drop_oldest` removes is dropped instead of held. The bound can be passed by the
/// messages consumers hold at that moment (their rejects still come in), which the consumers'
/// prefetch bounds.
pub(crate) const HELD_MAX: u64 = 65_536;

/// The messages a partition holds until their dead-letter copies are confirmed, oldest first,
/// and the attempt out for some of them. Leader-only and volatile, like the rest of
/// `DeliveryState`: a new leader delivers the held messages again (they are live), and their
/// copies, dead-lettered again with the same mark, are stored once.
///
/// Each held message counts in the node's [`HeldCount`] from [`HeldDeadLetters::hold`] until it
/// leaves, or until the whole value is dropped (the delivery state reset when this node stops
/// leading).
#[derive(Debug, Default)]
pub(crate) struct HeldDeadLetters {
    waiting: VecDeque<Dying>,
    /// The attempt out, if any: its id and its messages.
    attempt: Option<(u64, Vec<Dying>)>,
    /// No attempt starts before this (after a failed one).
    retry_at: Option<tokio::time::Instant>,
    /// The pause after the next failure.
    retry_after: Option<Duration>,
    /// Most messages the next attempt carries: [`ATTEMPT_MESSAGES_MAX`], or fewer after the
    /// dead-letter queue's limits refused a batch (a queue with room for a few, or a limit
    /// smaller than a batch, takes them one by one); doubles again per attempt that stored
    /// every copy. `None`: the most.
    size: Option<usize>,
    node: Option<HeldCount>,
}

/// The messages a node holds for dead-lettering, over all its partitions.
#[derive(Debug, Clone, Default)]
pub struct HeldCount(Arc<AtomicU64>);

impl HeldCount {
    /// How many now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// At [`HELD_MAX`] or beyond.
    pub(crate) fn full(&self) -> bool {
        self.get() >= HELD_MAX
    }

    fn add(&self, count: usize) {
        self.0.fetch_add(count as u64, Ordering::Relaxed);
    }

    fn sub(&self, count: usize) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                Some(held.saturating_sub(count as u64))
            });
    }
}

impl HeldDeadLetters {
    /// Hold `dying`, counted in `node`.
    pub(crate) fn hold(&mut self, node: &HeldCount, dying: impl IntoIterator<Item = Dying>) {
        let before = self.waiting.len();
        self.waiting.extend(dying);
        node.add(self.waiting.len() - before);
        self.node.get_or_insert_with(|| node.clone());
    }

    /// Messages held, in an attempt or waiting.
    pub(crate) fn len(&self) -> usize {
        self.waiting.len() + self.attempt.as_ref().map_or(0, |(_, a)| a.len())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// No attempt is out and one is due at `now`.
    pub(crate) fn due(&self, now: tokio::time::Instant) -> bool {
        self.attempt.is_none()
            && !self.waiting.is_empty()
            && self.retry_at.is_none_or(|at| at <= now)
    }

    /// Most messages the next attempt carries.
    fn size(&self) -> usize {
        self.size.unwrap_or(ATTEMPT_MESSAGES_MAX)
    }

    /// The payload bytes the next attempt takes (see [`HeldDeadLetters::start`]).
    pub(crate) fn next_bytes(&self) -> u64 {
        let mut bytes = 0u64;
        for (i, next) in self.waiting.iter().enumerate() {
            let size = u64::from(next.entry.size_bytes);
            if i == self.size() || (i > 0 && bytes + size > ATTEMPT_BYTES_MAX) {
                break;
            }
            bytes += size;
        }
        bytes
    }

    /// When the owner must wake to start the next attempt: the end of the pause after a
    /// failed one, if it is still ahead and no attempt is out. (A due attempt that could not
    /// start waits for what held it back: the delivery budget kicks the owner, a heal ends a
    /// round.)
    pub(crate) fn wake_at(&self, now: tokio::time::Instant) -> Option<tokio::time::Instant> {
        if self.attempt.is_some() || self.waiting.is_empty() {
            return None;
        }
        self.retry_at.filter(|at| *at > now)
    }

    /// Start attempt `id` with the oldest waiting messages: at most the attempt size
    /// ([`ATTEMPT_MESSAGES_MAX`] unless shrunk) and [`ATTEMPT_BYTES_MAX`] bytes (at least one
    /// message).
    pub(crate) fn start(&mut self, id: u64) -> Vec<Dying> {
        debug_assert!(self.attempt.is_none(), "one attempt at a time");
        let mut taken = Vec::new();
        let mut bytes = 0u64;
        while let Some(next) = self.waiting.front() {
            let size = u64::from(next.entry.size_bytes);
            if taken.len() == self.size() || (!taken.is_empty() && bytes + size > ATTEMPT_BYTES_MAX)
            {
                break;
            }
            bytes += size;
            taken.extend(self.waiting.pop_front());
        }
        self.attempt = Some((id, taken.clone()));
        self.retry_at = None;
        taken
    }

    /// Attempt `id` ended: whether it is this partition's (else it started before the delivery
    /// state was reset, and its messages are no longer held here). Its messages leave; the
    /// caller holds again, through [`HeldDeadLetters::retry`], those whose copies were not
    /// stored.
    pub(crate) fn finish(&mut self, id: u64) -> bool {
        match &self.attempt {
            Some((current, _)) if *current == id => {}
            _ => return false,
        }
        if let Some((_, messages)) = self.attempt.take() {
            self.release(messages.len());
        }
        true
    }

    /// Hold `failed` again, ahead of the others (oldest first), and pause before the next
    /// attempt: [`RETRY_AFTER_MIN`], doubling per failure in a row up to [`RETRY_AFTER_MAX`].
    /// Returns the pause.
    pub(crate) fn retry(&mut self, failed: Vec<Dying>, now: tokio::time::Instant) -> Duration {
        if let Some(node) = &self.node {
            node.add(failed.len());
        }
        for dying in failed.into_iter().rev() {
            self.waiting.push_front(dying);
        }
        let pause = self.retry_after.unwrap_or(RETRY_AFTER_MIN);
        self.retry_after = Some((pause * 2).min(RETRY_AFTER_MAX));
        self.retry_at = Some(now + pause);
        pause
    }

    /// An attempt stored every copy: the next one starts at once, with up to twice as many
    /// messages.
    pub(crate) fn succeeded(&mut self) {
        self.retry_after = None;
        self.retry_at = None;
        self.size = self
            .size
            .map(|size| size * 2)
            .filter(|size| *size < ATTEMPT_MESSAGES_MAX);
    }

    /// The dead-letter queue's limits refused a batch: the next attempts carry one message
    /// each (until one stores its copy).
    pub(crate) fn shrink(&mut self) {
        self.size = Some(1);
    }

    /// Try again at once (the dead-letter queue was changed).
    pub(crate) fn retry_now(&mut self) {
        self.retry_at = None;
    }

    /// Every held message, waiting or in the attempt out.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Dying> {
        let attempt = self.attempt.iter().flat_map(|(_, a)| a.iter());
        self.waiting.iter().chain(attempt)
    }

    /// Every waiting message (not those of an attempt out), leaving.
    pub(crate) fn take_waiting(&mut self) -> Vec<Dying> {
        let taken: Vec<Dying> = self.waiting.drain(..).collect();
        self.release(taken.len());
        taken
    }

    fn release(&self, count: usize) {
        if let Some(node) = &self.node {
            node.sub(count);
        }
    }
}

impl Drop for HeldDeadLetters {
    fn drop(&mut self) {
        self.release(self.len());
    }
}

/// The idempotent producer id of the dead-letter copies of partition `partition` of the queue
/// of id `queue_id`: the same on every node and after restarts, and another for a queue
/// declared again under the same name (its offsets start again at 0). A 64-bit mix
/// (SplitMix64's finalizer) of the two, so that it collides with a client's random producer id
/// only by a 2^-64 chance.
pub(crate) fn dead_letter_producer(queue_id: u64, partition: u32) -> u64 {
    let mut z = queue_id
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(partition))
        .wrapping_add(0x6465_6164_6c65_7474); // "deadlett"
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The mark of the dead-letter copy of message `message` (its offset in the source partition)
/// sent by the producer [`dead_letter_producer`] gave: every attempt of one message carries
/// the same mark.
pub(crate) fn dead_letter_mark(producer: u64, message: u64) -> ProducerSeq {
    ProducerSeq {
        producer,
        sequence: message,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use super::*;
    use crate::broker::LocalDeadLetters;
    use crate::error::BrokerError;

    /// Without a broker nothing is tried (the owner holds its dead letters), and a publish
    /// already on its way fails message by message.
    #[tokio::test]
    async fn a_sink_without_its_broker_is_closed_and_fails_each_message() {
        let sink = LocalDeadLetters::new(Weak::new());
        assert!(!sink.is_open());
        let results = sink
            .publish("dlq", vec![Message::new("a"), Message::new("b")])
            .await;
        assert_eq!(results.len(), 2);
        assert!(results
            .iter()
            .all(|r| matches!(r, Err(BrokerError::Closed(_)))));
    }

    fn dying(message: u64, size_bytes: u32) -> Dying {
        Dying {
            message,
            entry: Inflight {
                consumer: 1,
                delivery_count: 1,
                size_bytes,
            },
            reason: DeathReason::Rejected,
        }
    }

    /// Attempts take the oldest first within their bounds, failures go back to the front with
    /// a doubling pause, and the node's count follows every message in and out, including
    /// when the whole hold is dropped (a step-down).
    #[test]
    fn attempts_are_bounded_retried_first_and_counted() {
        let node = HeldCount::default();
        let mut held = HeldDeadLetters::default();
        held.hold(&node, (0..100).map(|m| dying(m, 10)));
        assert_eq!(node.get(), 100);
        let now = tokio::time::Instant::now();
        assert!(held.due(now));
        assert_eq!(held.next_bytes(), ATTEMPT_MESSAGES_MAX as u64 * 10);
        let first = held.start(1);
        assert_eq!(first.len(), ATTEMPT_MESSAGES_MAX);
        assert_eq!(first[0].message, 0);
        assert!(!held.due(now), "one attempt at a time");
        assert_eq!((held.len(), node.get()), (100, 100));
        assert!(!held.finish(7), "another attempt's answer");
        assert!(held.finish(1));
        assert_eq!(node.get(), 100 - ATTEMPT_MESSAGES_MAX as u64);
        // Half failed: they go first again, after the pause.
        let failed = first[32..].to_vec();
        assert_eq!(held.retry(failed, now), RETRY_AFTER_MIN);
        assert_eq!(node.get(), 100 - 32);
        assert!(!held.due(now));
        assert_eq!(held.wake_at(now), Some(now + RETRY_AFTER_MIN));
        assert_eq!(held.wake_at(now + RETRY_AFTER_MIN), None, "due: no timer");
        assert!(held.due(now + RETRY_AFTER_MIN));
        assert_eq!(held.start(2)[0].message, 32);
        assert_eq!(held.wake_at(now), None, "an attempt is out");
        held.finish(2);
        assert_eq!(held.retry(Vec::new(), now), RETRY_AFTER_MIN * 2);
        for _ in 0..10 {
            held.retry(Vec::new(), now);
        }
        assert_eq!(held.retry(Vec::new(), now), RETRY_AFTER_MAX);
        held.succeeded();
        assert!(held.due(now));
        // Shrunk to one message after the queue's limits refused a batch; doubling back.
        held.hold(&node, (100..200).map(|m| dying(m, 10)));
        held.shrink();
        assert_eq!(held.next_bytes(), 10);
        for size in [2, 4, 8, 16, 32, 64, 64] {
            held.succeeded();
            assert_eq!(held.next_bytes(), size * 10);
        }
        // A large message goes alone; the bytes bound the rest.
        let mut big = HeldDeadLetters::default();
        big.hold(&node, [dying(500, 4 << 20), dying(501, 10)]);
        assert_eq!(big.next_bytes(), 4 << 20);
        assert_eq!(big.start(3).len(), 1);
        drop(big);
        drop(held);
        assert_eq!(node.get(), 0, "dropping a hold releases its count");
    }

    #[test]
    fn dead_letter_producers_differ_by_queue_and_partition() {
        let ids: std::collections::BTreeSet<u64> = (0..50)
            .flat_map(|q| (0..64).map(move |p| dead_letter_producer(q, p)))
            .collect();
        assert_eq!(ids.len(), 50 * 64);
        assert_eq!(dead_letter_producer(3, 1), dead_letter_producer(3, 1));
    }
}
