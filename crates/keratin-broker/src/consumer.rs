//! `Consumer`: a subscription to a queue, with a prefetch shared across the queue's partitions,
//! receiving deliveries as a stream and settling them with ack and reject.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

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
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// How many deliveries a consumer may hold unsettled, shared by the partitions that deliver to it.
#[derive(Debug)]
pub(crate) struct Credit {
    prefetch: u32,
    used: AtomicU32,
}

impl Credit {
    pub(crate) fn new(prefetch: u32) -> Credit {
        Credit {
            prefetch,
            used: AtomicU32::new(0),
        }
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
    /// The consumer's queue, to wake its other partitions when credit comes back.
    pub(crate) queue: std::sync::Weak<Queue>,
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

/// A subscription to a queue.
#[derive(Debug)]
pub struct Consumer {
    id: u64,
    queue: Arc<Queue>,
    receiver: mpsc::Receiver<Delivery>,
}

impl Consumer {
    pub(crate) fn new(id: u64, queue: Arc<Queue>, receiver: mpsc::Receiver<Delivery>) -> Consumer {
        Consumer {
            id,
            queue,
            receiver,
        }
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
