//! `Consumer`: a subscription to a queue, with a prefetch shared across the queue's partitions,
//! receiving deliveries as a stream and settling them with ack and reject.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::byte_budget::{ByteBudget, BytePermit};
use crate::error::BrokerError;
use crate::queue::Queue;
use crate::record::Message;

/// Identifies one delivery: the partition and the message id (the offset of its record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryTag {
    /// Partition index.
    pub partition: u32,
    /// Message id within the partition.
    pub message: u64,
}

/// A message delivered to a consumer. It stays inflight until acked or rejected, or until the
/// consumer goes away (then it is returned to ready, ahead of newer messages).
///
/// Its payload bytes count against the node's delivery budget (and the consumer's outbound
/// budget, if it has one) for as long as `permit` lives: a server moves the permit beside the
/// frame it writes and drops it once the bytes are handed to the socket.
#[derive(Debug)]
pub struct Delivery {
    /// What to ack or reject.
    pub tag: DeliveryTag,
    /// True if the message was delivered before (returned by a reject, a lost consumer or a
    /// restart).
    pub redelivered: bool,
    /// How many times it has been delivered, this time included.
    pub delivery_count: u32,
    /// The message.
    pub message: Message,
    /// The bytes this delivery holds in the delivery budgets; given back when dropped.
    pub permit: DeliveryPermit,
}

/// The budget bytes one delivery holds: node-wide and, for a consumer with an outbound budget,
/// its connection's. Dropping it gives them back and wakes partitions waiting for room.
#[derive(Debug, Default)]
pub struct DeliveryPermit {
    pub(crate) node: Option<BytePermit>,
    pub(crate) outbound: Option<BytePermit>,
}

impl DeliveryPermit {
    /// Bytes held in the node-wide delivery budget.
    pub fn node_bytes(&self) -> u64 {
        self.node.as_ref().map_or(0, BytePermit::bytes)
    }

    /// Bytes held in the connection's outbound budget.
    pub fn outbound_bytes(&self) -> u64 {
        self.outbound.as_ref().map_or(0, BytePermit::bytes)
    }

    /// Takes `bytes` from the connection's budget and then the node's, waiting for room in
    /// each (a reader whose connection is stalled waits holding none of the node's bytes).
    pub async fn take(
        outbound: &Arc<ByteBudget>,
        node: &Arc<ByteBudget>,
        bytes: u64,
    ) -> DeliveryPermit {
        let outbound = outbound.take(bytes).await;
        let node = node.take(bytes).await;
        DeliveryPermit {
            node: Some(node),
            outbound: Some(outbound),
        }
    }
}

/// How to subscribe: the count and byte prefetch, and the budget of the connection the
/// deliveries go out on.
#[derive(Debug, Clone)]
pub struct SubscribeOptions {
    /// Most unsettled deliveries at once (1 to [`crate::MAX_PREFETCH`]).
    pub prefetch: u32,
    /// Most unsettled payload bytes at once (like AMQP's prefetch-size); `None`: no byte bound.
    /// A message larger than this still goes out, alone.
    pub prefetch_bytes: Option<u64>,
    /// Bytes of deliveries taken and not yet handed to the consumer's socket, shared by the
    /// consumers of one connection; `None`: only the node-wide delivery budget applies.
    pub outbound: Option<Arc<ByteBudget>>,
}

impl SubscribeOptions {
    /// A count prefetch only.
    pub fn prefetch(prefetch: u32) -> SubscribeOptions {
        SubscribeOptions {
            prefetch,
            prefetch_bytes: None,
            outbound: None,
        }
    }
}

/// How many deliveries and payload bytes a consumer may hold unsettled, shared by the
/// partitions that deliver to it.
#[derive(Debug)]
pub(crate) struct Credit {
    prefetch: u32,
    used: AtomicU32,
    /// `u64::MAX` when the consumer set no byte prefetch.
    prefetch_bytes: u64,
    used_bytes: AtomicU64,
    /// A delivery waited for byte credit: the next settle wakes the queue's partitions.
    bytes_blocked: AtomicBool,
}

impl Credit {
    pub(crate) fn new(prefetch: u32, prefetch_bytes: Option<u64>) -> Credit {
        Credit {
            prefetch,
            used: AtomicU32::new(0),
            prefetch_bytes: prefetch_bytes.unwrap_or(u64::MAX).max(1),
            used_bytes: AtomicU64::new(0),
            bytes_blocked: AtomicBool::new(false),
        }
    }

    /// The byte credit a payload of `size_bytes` takes: clamped to the byte prefetch, so that a
    /// larger message still goes out, alone.
    pub(crate) fn charge(&self, size_bytes: u32) -> u64 {
        u64::from(size_bytes).min(self.prefetch_bytes)
    }

    /// True if a payload of `size_bytes` fits the byte credit left; else the consumer is marked
    /// blocked, so that its next settle wakes the partitions.
    pub(crate) fn bytes_room(&self, size_bytes: u32) -> bool {
        let used = self.used_bytes.load(Ordering::Acquire);
        let fits = used.saturating_add(self.charge(size_bytes)) <= self.prefetch_bytes;
        if !fits {
            self.bytes_blocked.store(true, Ordering::Release);
        }
        fits
    }

    /// Take the byte credit of a payload of `size_bytes` if it fits.
    pub(crate) fn try_acquire_bytes(&self, size_bytes: u32) -> bool {
        let charge = self.charge(size_bytes);
        let taken = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used.saturating_add(charge) <= self.prefetch_bytes).then_some(used + charge)
            })
            .is_ok();
        if !taken {
            self.bytes_blocked.store(true, Ordering::Release);
        }
        taken
    }

    /// Give back byte credit (the sum of [`Credit::charge`] of settled payloads); true if a
    /// delivery was waiting for it.
    pub(crate) fn release_bytes(&self, bytes: u64) -> bool {
        let _ = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(bytes))
            });
        bytes > 0 && self.bytes_blocked.swap(false, Ordering::AcqRel)
    }

    /// Whether a unit of credit is left (without taking it).
    pub(crate) fn has_credit(&self) -> bool {
        self.used.load(Ordering::Acquire) < self.prefetch
    }

    /// Take one unit of credit if any is left.
    pub(crate) fn try_acquire(&self) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used < self.prefetch).then_some(used + 1)
            })
            .is_ok()
    }

    /// Give back `n` units; returns true if the consumer had no credit before.
    pub(crate) fn release(&self, n: u32) -> bool {
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(n))
            })
            .unwrap_or(0);
        before >= self.prefetch
    }
}

/// What a partition needs to deliver to a consumer.
#[derive(Debug)]
pub(crate) struct ConsumerLink {
    pub(crate) id: u64,
    pub(crate) sender: mpsc::Sender<Delivery>,
    /// Taken by a partition when it delivers, given back by the partition that took in the
    /// settle of the delivery.
    pub(crate) credit: Arc<Credit>,
    /// The consumer's connection budget, if it has one (see [`SubscribeOptions::outbound`]).
    pub(crate) outbound: Option<Arc<ByteBudget>>,
    /// The consumer's queue, to wake its other partitions when credit comes back.
    pub(crate) queue: std::sync::Weak<Queue>,
    /// Why the consumer was ended by the broker (its partition's leadership moved), shared
    /// with the [`Consumer`].
    pub(crate) ended: Arc<std::sync::OnceLock<BrokerError>>,
}

impl ConsumerLink {
    /// End this consumer because of `reason`: every partition of its queue lets it go, so its
    /// stream ends and [`Consumer::end_reason`] tells why.
    pub(crate) fn end(&self, reason: BrokerError) {
        let _ = self.ended.set(reason);
        if let Some(queue) = self.queue.upgrade() {
            for partition in &queue.partitions {
                partition.unsubscribe(self.id);
            }
        }
    }
}

/// Settles deliveries of one consumer; cheap to clone, usable while the consumer is being read.
#[derive(Debug, Clone)]
pub struct Settler {
    id: u64,
    queue: Arc<Queue>,
}

impl Settler {
    /// See [`Consumer::ack`].
    pub fn ack(&self, tags: &[DeliveryTag]) {
        settle(self.id, &self.queue, tags, None);
    }

    /// See [`Consumer::reject`].
    pub fn reject(&self, tags: &[DeliveryTag], requeue: bool) {
        settle(self.id, &self.queue, tags, Some(requeue));
    }
}

/// A consumer's place under the node's `consumers_max`: taken at subscribe, given back when
/// the consumer is dropped.
#[derive(Debug)]
pub(crate) struct ConsumerSlot {
    alive: Arc<AtomicU64>,
}

impl ConsumerSlot {
    /// A slot already counted in `alive`.
    pub(crate) fn new(alive: Arc<AtomicU64>) -> ConsumerSlot {
        ConsumerSlot { alive }
    }
}

impl Drop for ConsumerSlot {
    fn drop(&mut self) {
        let before = self.alive.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "a consumer slot given back twice");
    }
}

/// A stream reader's place under the node's `consumers_max` (stream readers and queue
/// consumers count together); given back when dropped.
#[derive(Debug)]
pub struct ReaderSlot {
    _slot: ConsumerSlot,
}

impl ReaderSlot {
    pub(crate) fn new(slot: ConsumerSlot) -> ReaderSlot {
        ReaderSlot { _slot: slot }
    }
}

/// A subscription to a queue.
#[derive(Debug)]
pub struct Consumer {
    id: u64,
    queue: Arc<Queue>,
    receiver: mpsc::Receiver<Delivery>,
    ended: Arc<std::sync::OnceLock<BrokerError>>,
    _slot: ConsumerSlot,
}

impl Consumer {
    pub(crate) fn new(
        id: u64,
        queue: Arc<Queue>,
        receiver: mpsc::Receiver<Delivery>,
        ended: Arc<std::sync::OnceLock<BrokerError>>,
        slot: ConsumerSlot,
    ) -> Consumer {
        Consumer {
            id,
            queue,
            receiver,
            ended,
            _slot: slot,
        }
    }

    /// Why the broker ended this consumer, once [`Consumer::recv`] gave `None`: `None` when
    /// its queue was deleted or the broker shut down; [`BrokerError::NotLeader`] when a
    /// partition of its queue moved to another node (subscribe again there).
    pub fn end_reason(&self) -> Option<BrokerError> {
        self.ended.get().cloned()
    }

    /// The consumer's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next delivery; `None` once the queue is deleted or the broker shuts down.
    pub async fn recv(&mut self) -> Option<Delivery> {
        self.receiver.recv().await
    }

    /// A delivery if one is waiting, without waiting.
    pub fn try_recv(&mut self) -> Option<Delivery> {
        self.receiver.try_recv().ok()
    }

    /// Acknowledge deliveries: their messages leave the queue for good.
    pub fn ack(&self, tags: &[DeliveryTag]) {
        self.settle(tags, None);
    }

    /// Reject deliveries: with `requeue` they go back to ready (ahead of newer messages), unless
    /// they reached the queue's `max_deliveries`; without, they go to the dead-letter queue if
    /// the queue has one, else they are dropped.
    pub fn reject(&self, tags: &[DeliveryTag], requeue: bool) {
        self.settle(tags, Some(requeue));
    }

    fn settle(&self, tags: &[DeliveryTag], reject: Option<bool>) {
        settle(self.id, &self.queue, tags, reject);
    }

    /// A handle that settles this consumer's deliveries from elsewhere.
    pub fn settler(&self) -> Settler {
        Settler {
            id: self.id,
            queue: self.queue.clone(),
        }
    }
}

fn settle(consumer: u64, queue: &Queue, tags: &[DeliveryTag], reject: Option<bool>) {
    let mut by_partition: Vec<Vec<u64>> = vec![Vec::new(); queue.partitions.len()];
    for tag in tags {
        if let Some(list) = by_partition.get_mut(tag.partition as usize) {
            list.push(tag.message);
        }
    }
    // Credit comes back when the owning partition has taken the settle in (see
    // `ConsumerLink::credit`): released here, a partition could deliver a newer message before
    // a requeued one is ready again.
    for (index, messages) in by_partition.into_iter().enumerate() {
        if messages.is_empty() {
            continue;
        }
        queue.partitions[index].settle(consumer, messages, reject);
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        for partition in &self.queue.partitions {
            partition.unsubscribe(self.id);
        }
    }
}
