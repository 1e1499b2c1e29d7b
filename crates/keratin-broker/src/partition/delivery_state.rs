//! `DeliveryState`: what only the partition's leader has, and loses at a restart or when it stops
//! leading: the consumers attached, which messages are inflight to which consumer, which are
//! being settled (`limbo`), which were returned (`redeliver`), the delivery cursor, and the
//! payloads read ahead for delivery with the reader they came from. None of it is durable: after
//! a restart (or on a new leader) every live message is ready, in id order.
//!
//! Owns the bookkeeping and its invariant; leaves to the owner the consumers' budgets and
//! channels (handing out a delivery), the records (`prepare`) and the log.
//!
//! Invariant: every live message below `cursor` is in exactly one of `inflight`, `limbo` (its
//! settle, return or dead-lettering is being written; a message held for dead-lettering is
//! also in `dead_letters`) and `redeliver` (ready again).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use tokio::time::Instant;

use crate::consumer::ConsumerLink;
use crate::partition::dead_letter::HeldDeadLetters;
use crate::partition::log::BoxReader;
use crate::partition::state::PartitionState;
use crate::record::Message;

/// A message handed to a consumer and not settled yet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Inflight {
    /// The consumer holding it.
    pub(crate) consumer: u64,
    /// Its deliveries, this one included.
    pub(crate) delivery_count: u32,
    /// Its payload size.
    pub(crate) size_bytes: u32,
}

/// A message read ahead for delivery.
pub(crate) struct Prefetched {
    /// Its id.
    pub(crate) id: u64,
    /// The message.
    pub(crate) message: Message,
    /// Its payload size.
    pub(crate) size_bytes: u32,
}

/// The leader-only delivery state of a partition.
#[derive(Default)]
pub(crate) struct DeliveryState {
    /// Consumers attached, served round robin from `round_robin`.
    pub(crate) consumers: Vec<Arc<ConsumerLink>>,
    pub(crate) round_robin: usize,
    /// Every message below it was handed out once (or is in `redeliver`).
    pub(crate) cursor: u64,
    pub(crate) inflight: HashMap<u64, Inflight>,
    /// Messages whose settle, return or dead-lettering is being written, with their sizes.
    pub(crate) limbo: HashMap<u64, u32>,
    /// Messages ready again (returned, or a failed write put them back), delivered first.
    pub(crate) redeliver: BTreeSet<u64>,
    /// Delivery counts not durable yet: of returned messages whose RETURN record is not
    /// applied yet, and of messages whose settle was refused (dropped when they are settled).
    pub(crate) counts_pending: HashMap<u64, u32>,
    /// The reader the last delivery read stopped at, to read on from there.
    pub(crate) reader: Option<BoxReader>,
    /// Bumped when the log's files may change under a reader (heal, reset, hand-back): a reader
    /// coming back from a job of an older epoch is dropped.
    pub(crate) reader_epoch: u64,
    /// A delivery read job is out (it holds `reader`).
    pub(crate) reading: bool,
    /// Payloads read ahead for delivery, in delivery order.
    pub(crate) prefetched: VecDeque<Prefetched>,
    /// After a failed read, no delivery read starts before this.
    pub(crate) read_retry_at: Option<Instant>,
    /// The first offset of this owner's delivery: a message below it may have been delivered
    /// by an earlier leader, or by this node before a restart (the log's head when the owner
    /// started), and is delivered with `redelivered` set.
    pub(crate) taken_over_at: u64,
    /// Messages waiting for their dead-letter copies to be confirmed (each also in `limbo`).
    pub(crate) dead_letters: HeldDeadLetters,
}

impl DeliveryState {
    /// The next ready message in delivery order, without taking it.
    pub(crate) fn peek_ready(&mut self, state: &PartitionState) -> Option<u64> {
        while let Some(&m) = self.redeliver.first() {
            if state.is_live(m) {
                return Some(m);
            }
            // Returned after its settle became durable but was answered as failed: the state
            // rebuilt at the heal knows it is gone.
            self.redeliver.remove(&m);
            self.counts_pending.remove(&m);
        }
        state.next_live(self.cursor)
    }

    /// Take ready message `m` (the one `peek_ready` gave).
    pub(crate) fn take_ready(&mut self, m: u64) {
        if !self.redeliver.remove(&m) {
            self.cursor = m + 1;
        }
    }

    /// The next `limit` ready messages in delivery order, without taking them.
    pub(crate) fn ready_ids(&self, state: &PartitionState, limit: usize) -> Vec<u64> {
        let mut ids = Vec::with_capacity(limit.min(64));
        ids.extend(
            self.redeliver
                .iter()
                .copied()
                .filter(|m| state.is_live(*m))
                .take(limit),
        );
        let mut from = self.cursor;
        while ids.len() < limit {
            let Some(m) = state.next_live(from) else {
                break;
            };
            ids.push(m);
            from = m + 1;
        }
        ids
    }

    /// The deliveries of `m` so far: the durable count, or a later return's still being
    /// written.
    pub(crate) fn delivery_count(&self, state: &PartitionState, m: u64) -> u32 {
        state
            .delivery_count(m)
            .max(self.counts_pending.get(&m).copied().unwrap_or(0))
    }

    /// Message `m` comes back to ready after a delivery that no RETURN record counts (its
    /// settle was refused): its next delivery counts this one, and is flagged redelivered.
    pub(crate) fn count_delivery(&mut self, state: &PartitionState, m: u64) {
        let count = self.delivery_count(state, m) + 1;
        self.counts_pending.insert(m, count);
    }

    /// Messages inflight or leaving (whether or not still live).
    pub(crate) fn busy_count(&self) -> u64 {
        (self.inflight.len() + self.limbo.len()) as u64
    }

    /// Messages inflight or leaving, and their bytes (whether or not still live).
    pub(crate) fn busy(&self) -> (u64, u64) {
        let bytes: u64 = self
            .inflight
            .values()
            .map(|e| u64::from(e.size_bytes))
            .chain(self.limbo.values().map(|s| u64::from(*s)))
            .sum();
        ((self.inflight.len() + self.limbo.len()) as u64, bytes)
    }

    /// Whether a consumer could take a delivery now (a count credit is free). Only looks: a
    /// credit taken and given back here could make another partition of the queue find the
    /// consumer full and wait for a kick that never comes.
    pub(crate) fn some_consumer_has_credit(&self) -> bool {
        self.consumers
            .iter()
            .any(|link| !link.sender.is_closed() && link.credit.has_credit())
    }

    /// The log's files may change under the cached reader (heal, reset, hand-back): drop it,
    /// its read-ahead, and any read still out.
    pub(crate) fn forget_reader(&mut self) {
        self.reader = None;
        self.reader_epoch += 1;
        self.prefetched.clear();
    }

    /// A consumer went away: detach it and take its inflight messages, in id order.
    pub(crate) fn unsubscribe(&mut self, consumer: u64) -> Vec<(u64, Inflight)> {
        self.consumers.retain(|c| c.id != consumer);
        let mut theirs: Vec<(u64, Inflight)> = self
            .inflight
            .iter()
            .filter(|(_, e)| e.consumer == consumer)
            .map(|(&m, &e)| (m, e))
            .collect();
        theirs.sort_by_key(|(m, _)| *m);
        for (m, _) in &theirs {
            self.inflight.remove(m);
        }
        theirs
    }

    /// A purge applied: the ready messages of `ranges` are gone.
    pub(crate) fn purged(&mut self, ranges: &[(u64, u64)]) {
        for &(start, end) in ranges {
            let gone: Vec<u64> = self.redeliver.range(start..end).copied().collect();
            for m in gone {
                self.redeliver.remove(&m);
                self.counts_pending.remove(&m);
            }
        }
    }

    /// The state was rebuilt from the log: messages it no longer holds live are not ready.
    /// Inflight ones stay until their consumer settles them (a settle of a message that is gone
    /// changes nothing).
    pub(crate) fn rebuilt(&mut self, state: &PartitionState) {
        self.redeliver.retain(|m| state.is_live(*m));
        self.counts_pending.retain(|m, _| state.is_live(*m));
    }

    /// The log was replaced by an empty one (a stopped partition purged by reset, which needs
    /// nothing inflight or leaving): delivery starts again at offset 0.
    pub(crate) fn reset(&mut self) {
        debug_assert!(
            self.inflight.is_empty() && self.limbo.is_empty(),
            "log reset with deliveries outstanding"
        );
        self.cursor = 0;
        self.taken_over_at = 0;
        self.redeliver.clear();
        self.counts_pending.clear();
    }

    /// Nothing is inflight, leaving, returned or being read.
    pub(crate) fn is_quiet(&self) -> bool {
        self.inflight.is_empty()
            && self.limbo.is_empty()
            && self.redeliver.is_empty()
            && self.counts_pending.is_empty()
            && !self.reading
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::PartitionRecord;

    fn state_with(messages: u64) -> PartitionState {
        let mut state = PartitionState::new(0);
        for offset in 0..messages {
            let record = PartitionRecord::Enqueue {
                size_bytes: 1,
                producer: None,
            };
            state.apply(offset, &record).expect("enqueue applies");
        }
        state
    }

    #[test]
    fn returned_messages_go_out_before_newer_ones() {
        let state = state_with(4);
        let mut delivery = DeliveryState::default();
        for expected in [0, 1] {
            assert_eq!(delivery.peek_ready(&state), Some(expected));
            delivery.take_ready(expected);
        }
        delivery.redeliver.insert(0);
        assert_eq!(delivery.ready_ids(&state, 3), vec![0, 2, 3]);
        delivery.take_ready(0);
        // Taking a returned message leaves the cursor where it was.
        assert_eq!(delivery.peek_ready(&state), Some(2));
    }

    #[test]
    fn a_purge_takes_returned_messages_and_their_pending_counts() {
        let mut delivery = DeliveryState::default();
        delivery.redeliver.extend([1, 5]);
        delivery.counts_pending.extend([(1, 2), (5, 1)]);
        delivery.purged(&[(0, 3)]);
        assert_eq!(delivery.redeliver.iter().copied().collect::<Vec<_>>(), [5]);
        assert!(!delivery.counts_pending.contains_key(&1));
    }
}
