//! `PartitionState`: the durable state of one partition, a deterministic function of the records
//! of its log. Applying the same records always gives the same state; the owner applies a record
//! only once the log reports it durable, so the state never runs ahead of the disk.
//!
//! Memory does not grow per queued message: a message is live unless its offset is in `dead`
//! (a `RangeSet`, compact for in-order settles), and per-message entries exist only for the
//! exceptions: messages returned with a delivery count, and messages relocated to the log's head.
//! What is inflight is not durable state: after a restart every live message is ready.

use std::collections::{BTreeMap, VecDeque};

use crate::error::{BrokerError, BrokerResult};
use crate::partition::producers::ProducerWindows;
use crate::range_set::RangeSet;
use crate::record::{PartitionRecord, Producers, Purge, Relocate};

/// The durable state of a partition.
///
/// The producers' windows survive the removal of the log's prefix: while a producer has a
/// window, space reclaim cuts the log only at a `PRODUCERS` record ([`Self::window_cut`]),
/// which replaces the windows with those it holds when applied; the leader writes one after
/// every segment roll. So a state rebuilt from the log (at a restart, or a replica rebuilt from
/// its leader's snapshot, whose log starts at the cut) has the windows of the live one, and
/// equality (a live state against the state rebuilt from its log: the debug check, the crash
/// tests) covers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionState {
    /// First offset of the log (offsets below it were removed as free space).
    start: u64,
    /// One past the last applied record.
    head: u64,
    /// Offsets at or above `start` that hold no live message: control records, settled messages,
    /// and the copies made by relocation.
    dead: RangeSet,
    /// Live messages whose payload was moved: message id -> offset of its RELOCATE record.
    relocated: BTreeMap<u64, u64>,
    /// Delivery counts of live messages that were delivered and returned.
    counts: BTreeMap<u64, u32>,
    live_count: u64,
    live_bytes: u64,
    /// A PURGE named messages this state never knew (their records lie below `start`): its
    /// byte total covers them, so `live_bytes` is only exact once recounted from the log's
    /// records ([`PartitionState::recount`]).
    recount_due: bool,
    /// The idempotent producers' windows, from the ENQUEUE records applied: a second ENQUEUE
    /// of a producer's sequence is a duplicate, dead from the start (never delivered).
    producers: ProducerWindows,
    /// Offsets of the `PRODUCERS` records at or above `start`, oldest first (about one per
    /// segment: at most [`WINDOW_CHECKPOINTS_MAX`]).
    checkpoints: VecDeque<u64>,
    /// Offsets of the duplicate `ENQUEUE` records applied since the last `PRODUCERS` record
    /// (at or above `start`); the next one lists them. Bounded by the duplicates written in
    /// one segment, and the leader writes a `PRODUCERS` record early once they pass
    /// [`DUPLICATE_RANGES_CHECKPOINT`] ranges (`owner/checkpoint.rs`).
    duplicates: RangeSet,
}

/// Ranges of duplicate offsets after which the leader writes a `PRODUCERS` record without
/// waiting for a segment roll, so that one record lists at most about this many (16 bytes
/// each).
pub const DUPLICATE_RANGES_CHECKPOINT: usize = 1_024;

/// Most `PRODUCERS` offsets a state keeps. The leader writes one per segment roll, so this
/// covers 4,096 segments between the log's start and its head (256 GiB of 64 MiB segments);
/// a longer log forgets the oldest, and space reclaim then falls back on cutting at the
/// lowest live payload (see `owner/reclaim.rs`).
pub const WINDOW_CHECKPOINTS_MAX: usize = 4_096;

/// What applying a record changed, for the owner's volatile bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// A new message.
    Enqueued {
        /// Its id.
        message: u64,
    },
    /// Messages that left the queue.
    Settled(Vec<u64>),
    /// Messages back to ready.
    Returned(Vec<u64>),
    /// Every live message in these ranges left the queue.
    Purged(Vec<(u64, u64)>),
    /// An idempotent producer's message that the partition stored before: the record is dead
    /// from the start.
    Duplicate {
        /// Its offset.
        offset: u64,
    },
    /// The queue's settings were recorded.
    Settings,
    /// The producers' windows were replaced by a `PRODUCERS` record's: the log may be cut here.
    Checkpointed,
    /// An offset with no partition record (a replicated log's own entry).
    Nothing,
    /// A message's payload now lives at `to`.
    Relocated {
        /// The message.
        message: u64,
        /// The RELOCATE record's offset.
        to: u64,
    },
}

impl PartitionState {
    /// The state of an empty log whose next offset is `start`.
    pub fn new(start: u64) -> PartitionState {
        PartitionState {
            start,
            head: start,
            dead: RangeSet::new(),
            relocated: BTreeMap::new(),
            counts: BTreeMap::new(),
            live_count: 0,
            live_bytes: 0,
            recount_due: false,
            producers: ProducerWindows::new(),
            checkpoints: VecDeque::new(),
            duplicates: RangeSet::new(),
        }
    }

    /// First offset of the log.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// One past the last applied record.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Live (unsettled) messages, ready or inflight.
    pub fn live_count(&self) -> u64 {
        self.live_count
    }

    /// Payload bytes of live messages.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// True if message `id` is live.
    pub fn is_live(&self, id: u64) -> bool {
        if id >= self.head {
            return false;
        }
        if id < self.start {
            return self.relocated.contains_key(&id);
        }
        !self.dead.contains(id)
    }

    /// Where the payload of live message `id` is: its own offset, or its relocated copy.
    pub fn payload_offset(&self, id: u64) -> u64 {
        self.relocated.get(&id).copied().unwrap_or(id)
    }

    /// Deliveries of message `id` recorded so far.
    pub fn delivery_count(&self, id: u64) -> u32 {
        self.counts.get(&id).copied().unwrap_or(0)
    }

    /// The first live message id at or after `from` (below `head`), in delivery order.
    pub fn next_live(&self, from: u64) -> Option<u64> {
        // Relocated messages below `start` come first: their ids are the oldest.
        if from < self.start {
            if let Some((&id, _)) = self.relocated.range(from..self.start).next() {
                return Some(id);
            }
        }
        let id = self.dead.next_absent(from.max(self.start));
        (id < self.head).then_some(id)
    }

    /// Live message ids in `[from, to)` in order (relocated ones below `start` included).
    pub fn live_ranges(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = self
            .relocated
            .range(from..self.start.min(to).max(from))
            .map(|(&id, _)| (id, id + 1))
            .collect();
        let lower = from.max(self.start);
        let upper = to.min(self.head);
        if lower < upper {
            out.extend(self.dead.gaps(lower, upper));
        }
        out
    }

    /// The lowest offset the log must keep: every live message's payload is at or above it.
    pub fn pinned_offset(&self) -> u64 {
        let mut id = self.dead.next_absent(self.start);
        // Skip live messages whose payload moved: they pin their copy, not their id.
        while id < self.head && self.relocated.contains_key(&id) {
            id = self.dead.next_absent(id + 1);
        }
        let lowest_copy = self.relocated.values().copied().min().unwrap_or(u64::MAX);
        id.min(self.head).min(lowest_copy)
    }

    /// Live messages whose relocated payload lies in `[start, end)`.
    pub fn relocated_payloads_in(&self, start: u64, end: u64) -> Vec<u64> {
        self.relocated
            .iter()
            .filter(|(_, &at)| at >= start && at < end)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The log's prefix below `start` was removed.
    pub fn forget_below(&mut self, start: u64) {
        if start <= self.start {
            return;
        }
        debug_assert!(start <= self.pinned_offset(), "removed a live payload");
        self.dead.forget_below(start);
        self.duplicates.forget_below(start);
        self.start = start;
        self.head = self.head.max(start);
        while self.checkpoints.front().is_some_and(|c| *c < start) {
            self.checkpoints.pop_front();
        }
    }

    /// After an idle hand-back left the log starting at `start`: forgets the windows of
    /// producers whose last message lies below it, unless a `PRODUCERS` record is still at or
    /// above it. A state rebuilt from the log has exactly these windows: a `PRODUCERS` record
    /// replaces the windows with all of them (its own writer's, which applied the whole log),
    /// so with one left a rebuild ends with every window this state has (a replicated log's
    /// start is the cut reclaim placed on such a record, and its hand-back removes nothing
    /// more); with none left (a local log's hand-back removes every record) a rebuild knows
    /// only the producers of the records from `start` on. (A resend comes within the client's
    /// publish timeout, 30 s at most by default; the hand-back follows `idle_release_after`,
    /// 30 s, without an append.)
    pub fn forget_producers_below(&mut self, start: u64) {
        if self.checkpoints.iter().any(|c| *c >= start) {
            return;
        }
        self.producers.forget_below(start);
    }

    /// Where space reclaim may cut the log (remove what lies below) with `pin` the lowest live
    /// payload, keeping the producers' windows: `pin` itself while no producer has a window
    /// (windows never empty once filled, so none had one below it either); else the last
    /// `PRODUCERS` record at or below `pin`, whose windows a state rebuilt from there starts
    /// with. `None`: no such record yet.
    pub fn window_cut(&self, pin: u64) -> Option<u64> {
        if self.producers.is_empty() {
            return Some(pin);
        }
        self.checkpoints.iter().rev().find(|c| **c <= pin).copied()
    }

    /// Whether some idempotent producer has a window here.
    pub fn has_producers(&self) -> bool {
        !self.producers.is_empty()
    }

    /// The offset of the last `PRODUCERS` record applied, if one is at or above the start.
    pub fn last_checkpoint(&self) -> Option<u64> {
        self.checkpoints.back().copied()
    }

    /// The `PRODUCERS` record to write at the head: the windows, and the duplicates applied
    /// since the last one.
    pub fn producers_record(&self) -> Producers {
        Producers {
            windows: self.producers.snapshot(),
            duplicates: self.duplicates.iter().collect(),
        }
    }

    /// Ranges of duplicate offsets the next `PRODUCERS` record will list.
    pub fn duplicate_ranges(&self) -> usize {
        self.duplicates.range_count()
    }

    /// True when `live_bytes` must be recounted from the log's records (see
    /// [`PartitionState::recount`]): a rebuild applied a PURGE that named messages below the
    /// log's start.
    pub(crate) fn recount_due(&self) -> bool {
        self.recount_due
    }

    /// Set the live totals counted from the records that hold the live payloads (each live
    /// message's `ENQUEUE`, or its latest `RELOCATE`).
    pub(crate) fn recount(&mut self, live_count: u64, live_bytes: u64) {
        assert_eq!(
            live_count, self.live_count,
            "recount found another live count"
        );
        self.live_bytes = live_bytes;
        self.recount_due = false;
    }

    /// Memory-relevant sizes: ranges in `dead`, relocated and counted entries.
    pub fn exception_entries(&self) -> usize {
        self.dead.range_count() + self.relocated.len() + self.counts.len()
    }

    /// Apply the record at `offset`. Records must come in offset order, without gaps.
    pub fn apply(&mut self, offset: u64, record: &PartitionRecord) -> BrokerResult<Applied> {
        if offset != self.head {
            return Err(BrokerError::Corrupt {
                what: "partition",
                offset,
                reason: format!("applied out of order: expected offset {}", self.head),
            });
        }
        // Checked before anything changes (a record decoded from the log was checked already).
        let windows = match record {
            PartitionRecord::Producers(producers) => Some(
                ProducerWindows::from_snapshot(&producers.windows).map_err(|reason| {
                    BrokerError::Corrupt {
                        what: "producers record",
                        offset,
                        reason,
                    }
                })?,
            ),
            _ => None,
        };
        self.head = offset + 1;
        let applied = match record {
            PartitionRecord::Enqueue {
                size_bytes,
                producer,
            } => {
                let new = producer
                    .is_none_or(|mark| self.producers.record(mark.producer, mark.sequence, offset));
                if new {
                    self.live_count += 1;
                    self.live_bytes += u64::from(*size_bytes);
                    Applied::Enqueued { message: offset }
                } else {
                    self.dead.insert(offset);
                    self.duplicates.insert(offset);
                    Applied::Duplicate { offset }
                }
            }
            PartitionRecord::Settle(entries) => {
                self.dead.insert(offset);
                let mut settled = Vec::with_capacity(entries.len());
                for entry in entries {
                    if self.remove_live(entry.message, u64::from(entry.size_bytes)) {
                        settled.push(entry.message);
                    }
                }
                Applied::Settled(settled)
            }
            PartitionRecord::Return(entries) => {
                self.dead.insert(offset);
                let mut returned = Vec::with_capacity(entries.len());
                for entry in entries {
                    if self.is_live(entry.message) {
                        self.counts.insert(entry.message, entry.delivery_count);
                        returned.push(entry.message);
                    }
                }
                Applied::Returned(returned)
            }
            PartitionRecord::Purge(purge) => {
                self.dead.insert(offset);
                self.apply_purge(purge);
                Applied::Purged(purge.ranges.clone())
            }
            PartitionRecord::Relocate(relocate) => {
                self.dead.insert(offset);
                self.apply_relocate(offset, relocate)
            }
            PartitionRecord::Settings(_) => {
                // The node metadata log is authoritative for settings; this record keeps the
                // partition's own history (and will travel with it when it replicates).
                self.dead.insert(offset);
                Applied::Settings
            }
            PartitionRecord::Noop => {
                self.dead.insert(offset);
                Applied::Nothing
            }
            PartitionRecord::Producers(producers) => {
                // Replaced whatever this state had, on every replica alike: the leader wrote
                // them with nothing of its own before them unapplied, so they are the windows
                // every copy that applied the whole log has here; a copy rebuilt from here on
                // gets them only from this record.
                self.dead.insert(offset);
                self.producers = windows.unwrap_or_default();
                if self.checkpoints.len() >= WINDOW_CHECKPOINTS_MAX {
                    self.checkpoints.pop_front();
                }
                self.checkpoints.push_back(offset);
                let dropped = self.drop_listed_duplicates(&producers.duplicates);
                self.duplicates = RangeSet::new();
                if dropped.is_empty() {
                    Applied::Checkpointed
                } else {
                    Applied::Purged(dropped)
                }
            }
        };
        Ok(applied)
    }

    /// The duplicates a `PRODUCERS` record lists that this state holds live: a state rebuilt
    /// from a log starting after their first copies met them before any window. They were
    /// never live on the copy that wrote the record: they go, and the live bytes are recounted
    /// from the log (the records' sizes are not kept). A copy that applied the whole log holds
    /// none of them live: nothing changes. Returns the ranges that went.
    fn drop_listed_duplicates(&mut self, listed: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut dropped = Vec::new();
        for &(start, end) in listed {
            let lower = start.max(self.start);
            let upper = end.min(self.head);
            if lower >= upper {
                continue;
            }
            for (gap_start, gap_end) in self.dead.gaps(lower, upper) {
                // A duplicate was never delivered, so never relocated or counted; clear both
                // all the same so that no entry outlives its message.
                for id in gap_start..gap_end {
                    self.relocated.remove(&id);
                    self.counts.remove(&id);
                }
                let count = self.dead.insert_range(gap_start, gap_end);
                self.live_count = self.live_count.saturating_sub(count);
                self.recount_due = true;
                dropped.push((gap_start, gap_end));
            }
        }
        dropped
    }

    fn remove_live(&mut self, id: u64, size_bytes: u64) -> bool {
        if !self.is_live(id) {
            return false;
        }
        if id >= self.start {
            self.dead.insert(id);
        }
        self.relocated.remove(&id);
        self.counts.remove(&id);
        self.live_count = self.live_count.saturating_sub(1);
        self.live_bytes = self.live_bytes.saturating_sub(size_bytes);
        true
    }

    /// Remove every live message in the purge's ranges. The count removed is what this state
    /// knows of them: a state rebuilt from a log whose prefix was removed never saw the messages
    /// below its start (unless relocated), and subtracting the record's whole count would
    /// undercount. The record's byte total is exact when the state knew every message it names;
    /// else the rebuild recounts the bytes from the records.
    fn apply_purge(&mut self, purge: &Purge) {
        let mut named = 0u64;
        let mut removed = 0u64;
        for &(start, end) in &purge.ranges {
            named += end.saturating_sub(start);
            let moved: Vec<u64> = self
                .relocated
                .range(start..end)
                .map(|(&id, _)| id)
                .collect();
            for id in moved {
                // Below `start` a relocated message is live only through this entry.
                if id < self.start {
                    removed += 1;
                }
                self.relocated.remove(&id);
            }
            let counted: Vec<u64> = self.counts.range(start..end).map(|(&id, _)| id).collect();
            for id in counted {
                self.counts.remove(&id);
            }
            let lower = start.max(self.start);
            if lower < end {
                removed += self.dead.insert_range(lower, end.min(self.head));
            }
        }
        self.live_count = self.live_count.saturating_sub(removed);
        self.live_bytes = self.live_bytes.saturating_sub(purge.bytes);
        if removed < named {
            self.recount_due = true;
        }
    }

    fn apply_relocate(&mut self, offset: u64, relocate: &Relocate) -> Applied {
        let id = relocate.message;
        // A copy of a message this state knows is gone (settled or purged before the copy was
        // applied) is void: it must not bring the message back. The owner never writes one,
        // since it never relocates a message whose settle or purge is pending.
        if id >= self.start && id < self.head && !self.is_live(id) {
            return Applied::Relocated {
                message: id,
                to: offset,
            };
        }
        // A message already known to be live just moves; one whose ENQUEUE record lies below
        // the log's start (a state rebuilt after prefix removal) becomes known here.
        let known = self.relocated.contains_key(&id) || (id >= self.start && self.is_live(id));
        if !known {
            self.live_count += 1;
            self.live_bytes += relocate.payload.len() as u64;
        }
        self.relocated.insert(id, offset);
        if relocate.delivery_count > 0 {
            self.counts.insert(id, relocate.delivery_count);
        }
        Applied::Relocated {
            message: id,
            to: offset,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Outcome, Returned, Settled};

    fn settle(id: u64, size: u32) -> PartitionRecord {
        PartitionRecord::Settle(vec![Settled {
            message: id,
            size_bytes: size,
            outcome: Outcome::Acked,
        }])
    }

    #[test]
    fn enqueue_settle_and_pin() {
        let mut s = PartitionState::new(0);
        for i in 0..5 {
            s.apply(
                i,
                &PartitionRecord::Enqueue {
                    size_bytes: 10,
                    producer: None,
                },
            )
            .expect("apply");
        }
        assert_eq!((s.live_count(), s.live_bytes()), (5, 50));
        s.apply(5, &settle(0, 10)).expect("apply");
        s.apply(6, &settle(2, 10)).expect("apply");
        assert_eq!(s.live_count(), 3);
        assert_eq!(s.pinned_offset(), 1);
        assert_eq!(s.next_live(2), Some(3));
        assert_eq!(s.live_ranges(0, 7), vec![(1, 2), (3, 5)]);
        assert!(s.apply(9, &settle(1, 10)).is_err(), "out of order");
    }

    #[test]
    fn relocation_keeps_the_message_id_and_moves_the_pin() {
        let mut s = PartitionState::new(0);
        s.apply(
            0,
            &PartitionRecord::Enqueue {
                size_bytes: 3,
                producer: None,
            },
        )
        .expect("apply");
        s.apply(
            1,
            &PartitionRecord::Enqueue {
                size_bytes: 3,
                producer: None,
            },
        )
        .expect("apply");
        s.apply(2, &settle(1, 3)).expect("apply");
        let relocate = PartitionRecord::Relocate(Relocate {
            message: 0,
            delivery_count: 2,
            payload: b"abc".to_vec(),
        });
        s.apply(3, &relocate).expect("apply");
        assert_eq!(s.live_count(), 1);
        assert_eq!(s.payload_offset(0), 3);
        assert_eq!(s.pinned_offset(), 3);
        assert_eq!(s.delivery_count(0), 2);
        s.forget_below(3);
        assert!(s.is_live(0));
        assert_eq!(s.next_live(0), Some(0));
        // A state rebuilt from the log that starts at 3 is the same.
        let mut rebuilt = PartitionState::new(3);
        rebuilt.apply(3, &relocate).expect("apply");
        assert_eq!(rebuilt, s);
    }

    #[test]
    fn returns_record_counts_and_purge_clears_them() {
        let mut s = PartitionState::new(0);
        for i in 0..4 {
            s.apply(
                i,
                &PartitionRecord::Enqueue {
                    size_bytes: 1,
                    producer: None,
                },
            )
            .expect("apply");
        }
        let ret = PartitionRecord::Return(vec![Returned {
            message: 1,
            delivery_count: 1,
        }]);
        s.apply(4, &ret).expect("apply");
        assert_eq!(s.delivery_count(1), 1);
        let purge = PartitionRecord::Purge(Purge {
            ranges: vec![(0, 2), (3, 4)],
            count: 3,
            bytes: 3,
        });
        s.apply(5, &purge).expect("apply");
        assert_eq!(s.live_count(), 1);
        assert!(s.is_live(2));
        assert_eq!(s.delivery_count(1), 0);
        assert!(!s.recount_due());
    }

    #[test]
    fn a_purge_of_messages_below_the_start_counts_only_known_ones() {
        // Rebuilt from offset 2: messages 0 and 1 lie below the start.
        let mut s = PartitionState::new(2);
        for i in 2..5 {
            s.apply(
                i,
                &PartitionRecord::Enqueue {
                    size_bytes: 10,
                    producer: None,
                },
            )
            .expect("apply");
        }
        let purge = PartitionRecord::Purge(Purge {
            ranges: vec![(0, 3), (4, 5)],
            count: 4,
            bytes: 40,
        });
        s.apply(5, &purge).expect("apply");
        assert_eq!(s.live_count(), 1, "message 3 is live");
        assert!(s.recount_due(), "the byte total covered unknown messages");
        s.recount(1, 10);
        assert_eq!((s.live_count(), s.live_bytes()), (1, 10));
    }

    /// The log may be cut at the pin while no producer has a window, and only at a
    /// `PRODUCERS` record at or below the pin once one has; a state rebuilt from that record
    /// on equals the live one, windows included, and still knows a sequence stored below it.
    #[test]
    fn a_producers_record_carries_the_windows_past_a_cut() {
        use crate::record::ProducerSeq;
        let mut s = PartitionState::new(0);
        let plain = PartitionRecord::Enqueue {
            size_bytes: 4,
            producer: None,
        };
        s.apply(0, &plain).expect("apply");
        s.apply(1, &settle(0, 4)).expect("apply");
        assert_eq!(s.window_cut(2), Some(2), "no producer: cut at the pin");
        let marked = PartitionRecord::Enqueue {
            size_bytes: 4,
            producer: Some(ProducerSeq {
                producer: 9,
                sequence: 1,
            }),
        };
        s.apply(2, &marked).expect("apply");
        s.apply(3, &settle(2, 4)).expect("apply");
        assert_eq!(s.window_cut(4), None, "a window and no record to cut at");
        let checkpoint = PartitionRecord::Producers(s.producers_record());
        assert_eq!(
            s.apply(4, &checkpoint).expect("apply"),
            Applied::Checkpointed
        );
        s.apply(5, &plain).expect("apply");
        assert_eq!(s.pinned_offset(), 5);
        assert_eq!(s.window_cut(s.pinned_offset()), Some(4));
        s.forget_below(4);
        let mut rebuilt = PartitionState::new(4);
        rebuilt.apply(4, &checkpoint).expect("apply");
        rebuilt.apply(5, &plain).expect("apply");
        assert_eq!(rebuilt, s);
        assert_eq!(
            rebuilt.apply(6, &marked).expect("apply"),
            Applied::Duplicate { offset: 6 },
            "the sequence stored below the cut is still known"
        );
    }

    /// A single node's log cut at a `PRODUCERS` record starts at the base of the segment that
    /// holds it: a retry between that base and the record, whose first copy went with the
    /// removed segments, meets no window in a state rebuilt from there. The record lists it,
    /// and the rebuilt state drops it: equal to the live one, where it was never live.
    #[test]
    fn duplicates_before_a_producers_record_stay_dead_in_a_state_rebuilt_below_it() {
        use crate::record::ProducerSeq;
        let marked = |sequence| PartitionRecord::Enqueue {
            size_bytes: 4,
            producer: Some(ProducerSeq {
                producer: 9,
                sequence,
            }),
        };
        let mut s = PartitionState::new(0);
        s.apply(0, &marked(1)).expect("apply");
        s.apply(1, &marked(2)).expect("apply");
        s.apply(2, &settle(0, 4)).expect("apply");
        s.apply(3, &settle(1, 4)).expect("apply");
        // A segment starts at 4: the retries of both, then the record.
        let base = 4;
        for (offset, sequence) in [(4, 1), (5, 2)] {
            assert_eq!(
                s.apply(offset, &marked(sequence)).expect("apply"),
                Applied::Duplicate { offset }
            );
        }
        let checkpoint = PartitionRecord::Producers(s.producers_record());
        assert_eq!(
            s.producers_record().duplicates,
            vec![(4, 6)],
            "the record lists the retries"
        );
        assert_eq!(
            s.apply(6, &checkpoint).expect("apply"),
            Applied::Checkpointed
        );
        assert_eq!(s.duplicate_ranges(), 0, "the next record starts a new list");
        s.apply(7, &marked(3)).expect("apply");
        assert_eq!(s.window_cut(s.pinned_offset()), Some(6));
        // The log removes whole segments: it starts at the base, below the cut.
        s.forget_below(base);
        let mut rebuilt = PartitionState::new(base);
        for (offset, record) in [
            (4, marked(1)),
            (5, marked(2)),
            (6, checkpoint.clone()),
            (7, marked(3)),
        ] {
            rebuilt.apply(offset, &record).expect("apply");
        }
        assert!(
            rebuilt.recount_due(),
            "the dropped retries' bytes are unknown"
        );
        rebuilt.recount(1, 4);
        assert_eq!(rebuilt, s);
        assert_eq!((rebuilt.live_count(), rebuilt.live_bytes()), (1, 4));
    }

    /// An idle hand-back whose log keeps a `PRODUCERS` record at its start (a replicated log's
    /// start is the cut reclaim placed on such a record) keeps the windows that record holds,
    /// as a state rebuilt from the start has them.
    #[test]
    fn a_hand_back_that_keeps_a_producers_record_keeps_its_windows() {
        use crate::record::ProducerSeq;
        let mut s = PartitionState::new(0);
        let marked = PartitionRecord::Enqueue {
            size_bytes: 4,
            producer: Some(ProducerSeq {
                producer: 9,
                sequence: 1,
            }),
        };
        s.apply(0, &marked).expect("apply");
        s.apply(1, &settle(0, 4)).expect("apply");
        let checkpoint = PartitionRecord::Producers(s.producers_record());
        s.apply(2, &checkpoint).expect("apply");
        // Nothing live: the log starts at the record (the cut), and the hand-back removes
        // nothing more.
        s.forget_below(2);
        s.forget_producers_below(2);
        let mut rebuilt = PartitionState::new(2);
        rebuilt.apply(2, &checkpoint).expect("apply");
        assert_eq!(
            s, rebuilt,
            "the live state differs from the state rebuilt from its log"
        );
        assert_eq!(
            s.apply(3, &marked).expect("apply"),
            Applied::Duplicate { offset: 3 },
            "a resend after the hand-back is still a duplicate"
        );
    }

    /// A producer's sequence is stored once: its second ENQUEUE is dead from the start, and the
    /// state rebuilt from the same records agrees.
    #[test]
    fn a_producers_second_enqueue_of_a_sequence_is_a_duplicate() {
        use crate::record::ProducerSeq;
        let mark = |sequence| {
            Some(ProducerSeq {
                producer: 9,
                sequence,
            })
        };
        let records = [
            PartitionRecord::Enqueue {
                size_bytes: 4,
                producer: mark(1),
            },
            PartitionRecord::Enqueue {
                size_bytes: 4,
                producer: mark(2),
            },
            PartitionRecord::Enqueue {
                size_bytes: 4,
                producer: mark(1),
            },
            PartitionRecord::Enqueue {
                size_bytes: 4,
                producer: None,
            },
        ];
        let mut s = PartitionState::new(0);
        let applied: Vec<Applied> = records
            .iter()
            .enumerate()
            .map(|(i, r)| s.apply(i as u64, r).expect("applies"))
            .collect();
        assert_eq!(applied[2], Applied::Duplicate { offset: 2 });
        assert_eq!(s.live_count(), 3);
        assert!(!s.is_live(2));
        assert_eq!(s.next_live(2), Some(3));
        let mut again = PartitionState::new(0);
        for (i, r) in records.iter().enumerate() {
            again.apply(i as u64, r).expect("applies");
        }
        assert_eq!(again, s);
        assert_eq!(again.producers, s.producers, "the windows replay alike");
    }
}
