//! `PRODUCERS` records: the idempotent producers' windows written into the log, so that the
//! log's prefix can go without them (`docs/partition-records.md`, "`PRODUCERS`"). Space
//! reclaim cuts a log whose producers have windows only at such a record
//! (`PartitionState::window_cut`); a state rebuilt from there (a restart, a replica rebuilt
//! from its leader's snapshot, whose log starts at the cut) takes the windows from it and
//! deduplicates like its peers.
//!
//! The leader writes one after every segment roll while a producer has a window (none while
//! the log has a single segment). Its windows must be those of every copy at its offset: it
//! is handed to the log only once nothing of this owner's before it is pending and the state
//! applied everything committed before it (its predecessors' records included), and its
//! windows are taken then. Appends made meanwhile wait behind it in the backlog, for about one
//! commit round trip per segment.

use super::*;

/// What becomes of a `PRODUCERS` record about to be handed to the log.
pub(super) enum Checkpoint {
    /// Its windows are filled in: hand it on.
    Ready,
    /// The state has not caught up with where it will land: it waits.
    Wait,
    /// Not to be written (a stopped log, a node that stopped leading): its windows would be
    /// empty, and applying them would empty every replica's.
    Drop,
}

impl Owner {
    /// As leader, append a `PRODUCERS` record when a producer has a window and none lies in
    /// the log's tail segment, once the log has rolled (a log of one segment is never cut), or
    /// when the duplicates it would list pass `DUPLICATE_RANGES_CHECKPOINT` ranges.
    /// Its windows are filled in when it is handed to the log ([`Owner::fill_checkpoint`]).
    pub(super) fn maybe_checkpoint(&mut self) {
        if !self.driver.role().leading
            || self.driver.stopped().is_some()
            || self.checkpoint_sequence.is_some()
            || !self.state.has_producers()
        {
            return;
        }
        // Many duplicates since the last record: one now, so that no record lists more than
        // about `DUPLICATE_RANGES_CHECKPOINT` ranges of them.
        let many_duplicates =
            self.state.duplicate_ranges() >= crate::partition::state::DUPLICATE_RANGES_CHECKPOINT;
        // A roll grows the log's disk use: look at the segments only then (and at the first
        // round with a producer).
        if self.disk_bytes == self.checkpoint_disk_bytes && !many_duplicates {
            return;
        }
        self.checkpoint_disk_bytes = self.disk_bytes;
        if !many_duplicates && !self.tail_segment_lacks_a_record() {
            return;
        }
        let sequence = self.driver.next_sequence();
        self.checkpoint_sequence = Some(sequence);
        let record = PartitionRecord::Producers(crate::record::Producers::default());
        self.append(vec![record], vec![Vec::new()], Done::Internal);
        if self.driver.next_sequence() == sequence {
            // Refused at once (nothing was queued).
            self.checkpoint_sequence = None;
        }
    }

    /// Whether the log has rolled and its tail segment holds no `PRODUCERS` record yet (a log
    /// of one segment has nothing for reclaim to cut below a record).
    fn tail_segment_lacks_a_record(&self) -> bool {
        let Some(log) = &self.log else {
            return false;
        };
        let bases = log.space().segment_bases;
        let Some(&tail_base) = bases.last().filter(|_| bases.len() >= 2) else {
            return false;
        };
        self.state.last_checkpoint().is_none_or(|at| at < tail_base)
    }

    /// Fill in the `PRODUCERS` record `batch` with the windows now, if the state is where the
    /// record will land: nothing of this owner's before it is pending, and every record
    /// committed before it (its predecessors' too, below the leadership's first offset) is
    /// applied. A stopped log or a node that no longer leads drops it (never written).
    pub(super) fn fill_checkpoint(&mut self, batch: &mut Proposal) -> Checkpoint {
        if self.driver.stopped().is_some() || !self.driver.role().leading {
            return Checkpoint::Drop;
        }
        let first_pending = self.driver.oldest().map(|p| p.sequence);
        let head = self.state.head();
        if first_pending != Some(batch.sequence)
            || self.following
            || head < self.driver.committed_up_to()
            || head < self.driver.role().from
        {
            return Checkpoint::Wait;
        }
        let record = PartitionRecord::Producers(self.state.producers_record());
        batch.payloads = vec![record.encode()];
        if let Some(pending) = self.driver.get_mut(batch.sequence) {
            pending.item.records = vec![record];
        }
        Checkpoint::Ready
    }
}
