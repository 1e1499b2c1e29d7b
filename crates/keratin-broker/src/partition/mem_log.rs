//! `MemLog`, a replicated log's stand-in for the partition owners' tests (queue and stream):
//! committed records in memory, every proposal committed at once (or held until the test
//! settles it), records "committed by another node" on demand, roles (a follower refuses
//! proposals, "not the leader"), a storage failure, and a log restart past its end (a follower
//! installing the leader's snapshot) that can strike in the middle of a read.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use keratin_log::{LogError, LogResult, ReadRecord};

use crate::error::{BrokerError, BrokerResult};
use crate::partition::log::{
    BoxReader, LogEvent, LogEvents, LogSpace, PartitionLog, PartitionReader, Proposal, Proposing,
    Removing, Role,
};
use crate::record::PartitionRecord;

/// See the module docs.
#[derive(Default)]
pub(crate) struct MemLog {
    /// Every record from offset 0; those below `start` are gone.
    records: Mutex<Vec<(u8, Vec<u8>)>>,
    start: AtomicU64,
    committed: AtomicU64,
    events: OnceLock<LogEvents>,
    /// `(at, new_start)`: the next read from below `at` returns the records up to `at`, then
    /// fails because the log restarted at `new_start` meanwhile (once).
    restart_mid_read: Mutex<Option<(u64, u64)>>,
    /// Each record's timestamp, beside `records`.
    timestamps: Mutex<Vec<u64>>,
    /// The role last set (`None`: it leads, as a local log).
    role: Mutex<Option<Role>>,
    /// Proposals are taken but not committed until [`MemLog::settle_held`].
    hold: std::sync::atomic::AtomicBool,
    held: Mutex<Vec<Proposal>>,
    /// Every `remove_prefix` asked for, in order.
    removals: Mutex<Vec<u64>>,
}

impl MemLog {
    /// Append committed records; returns their offsets.
    pub(crate) fn push(&self, records: &[(u8, Vec<u8>)]) -> Range<u64> {
        self.push_at(records, 0)
    }

    fn push_at(&self, records: &[(u8, Vec<u8>)], timestamp_ms: u64) -> Range<u64> {
        let mut held = self.records.lock().expect("lock");
        let start = held.len() as u64;
        held.extend_from_slice(records);
        let end = held.len() as u64;
        let mut timestamps = self.timestamps.lock().expect("lock");
        timestamps.resize(end as usize, timestamp_ms);
        self.committed.store(end, Ordering::SeqCst);
        start..end
    }

    /// Every record held from offset 0 (those below the start included), encoded.
    pub(crate) fn records(&self) -> Vec<(u8, Vec<u8>)> {
        self.records.lock().expect("lock").clone()
    }

    /// The offsets `remove_prefix` was asked to remove below, in order.
    pub(crate) fn removals(&self) -> Vec<u64> {
        self.removals.lock().expect("lock").clone()
    }

    /// Encoded records another node proposed (`(type, payload)`), now committed.
    pub(crate) fn commit_foreign_encoded(&self, records: &[(u8, Vec<u8>)], timestamp_ms: u64) {
        let range = self.push_at(records, timestamp_ms);
        let events = self.events.get().expect("started");
        events.send(LogEvent::Committed { up_to: range.end });
    }

    /// This node's role changes to `role` (reported to the owner).
    pub(crate) fn set_role(&self, role: Role) {
        *self.role.lock().expect("lock") = Some(role.clone());
        self.events
            .get()
            .expect("started")
            .send(LogEvent::Role(role));
    }

    /// From now on proposals wait in the log until [`MemLog::settle_held`].
    pub(crate) fn hold_proposals(&self) {
        self.hold.store(true, Ordering::SeqCst);
    }

    /// How many proposals wait.
    pub(crate) fn held_count(&self) -> usize {
        self.held.lock().expect("lock").len()
    }

    /// Ends the held proposals: committed (after whatever was committed meanwhile) or failed
    /// with `error`; later proposals commit at once again.
    pub(crate) fn settle_held(&self, error: Option<BrokerError>) {
        self.hold.store(false, Ordering::SeqCst);
        let held = std::mem::take(&mut *self.held.lock().expect("lock"));
        let events = self.events.get().expect("started");
        for proposal in held {
            let result = match &error {
                Some(error) => Err(error.clone()),
                None => Ok(self.commit_proposal(&proposal)),
            };
            events.send(LogEvent::Proposed {
                sequence: proposal.sequence,
                result,
            });
        }
    }

    /// This node's copy fails (a replicated log's fenced storage).
    pub(crate) fn fail_storage(&self) {
        let events = self.events.get().expect("started");
        events.send(LogEvent::Stopped {
            error: LogError::Invalid("the test failed the storage".into()),
        });
    }

    fn commit_proposal(&self, proposal: &Proposal) -> Range<u64> {
        let records: Vec<(u8, Vec<u8>)> = proposal
            .types
            .iter()
            .copied()
            .zip(proposal.payloads.iter().cloned())
            .collect();
        self.push_at(&records, proposal.timestamp_ms)
    }

    /// Records another node proposed, now committed.
    pub(crate) fn commit_foreign(&self, records: &[PartitionRecord]) {
        let encoded: Vec<(u8, Vec<u8>)> = records
            .iter()
            .map(|r| (r.record_type(), r.encode()))
            .collect();
        let range = self.push(&encoded);
        let events = self.events.get().expect("started");
        events.send(LogEvent::Committed { up_to: range.end });
    }

    /// The next read from below `at` stops there: the log restarts at `new_start` (see the
    /// field).
    pub(crate) fn restart_during_next_read(&self, at: u64, new_start: u64) {
        *self.restart_mid_read.lock().expect("lock") = Some((at, new_start));
    }

    /// The log restarts at `new_start` now (a snapshot installed before the owner opened).
    pub(crate) fn restart(&self, new_start: u64) {
        self.restart_at(new_start);
    }

    fn restart_at(&self, new_start: u64) {
        let mut held = self.records.lock().expect("lock");
        // Offsets up to the new start are taken by records nobody reads again.
        while (held.len() as u64) < new_start {
            held.push((crate::record::NOOP, Vec::new()));
        }
        self.start.store(new_start, Ordering::SeqCst);
        self.committed.fetch_max(new_start, Ordering::SeqCst);
    }
}

impl PartitionLog for MemLog {
    fn start(&self, events: LogEvents) {
        let _ = self.events.set(events);
    }

    fn propose(self: Arc<Self>, proposal: Proposal) -> Proposing {
        Box::pin(async move {
            if let Some(role) = self.role.lock().expect("lock").as_ref() {
                if !role.leading {
                    return Err(role.not_leader("mem", 0));
                }
            }
            if self.hold.load(Ordering::SeqCst) {
                self.held.lock().expect("lock").push(proposal);
                return Ok(());
            }
            let range = self.commit_proposal(&proposal);
            let events = self.events.get().expect("started");
            events.send(LogEvent::Proposed {
                sequence: proposal.sequence,
                result: Ok(range),
            });
            Ok(())
        })
    }

    fn reader(&self, offset: u64) -> BoxReader {
        let restart = self
            .restart_mid_read
            .lock()
            .expect("lock")
            .take_if(|(at, _)| offset < *at);
        let held = self.records.lock().expect("lock");
        let timestamps = self.timestamps.lock().expect("lock");
        let start = self.start.load(Ordering::SeqCst);
        let until = restart.map_or(held.len() as u64, |(at, _)| at);
        let records: Vec<ReadRecord> = (offset..until)
            .zip(held.iter().skip(offset as usize))
            .map(|(offset, (record_type, payload))| ReadRecord {
                offset,
                record_type: *record_type,
                flags: 0,
                timestamp_ms: timestamps.get(offset as usize).copied().unwrap_or(0),
                payload: payload.clone(),
            })
            .collect();
        drop(timestamps);
        drop(held);
        let failure = if offset < start {
            Some(format!(
                "offset {offset} lies below the log's start {start}"
            ))
        } else {
            restart.map(|(at, new_start)| {
                self.restart_at(new_start);
                format!("entry {at} is no longer in this replica's log (it starts at {new_start})")
            })
        };
        Box::new(MemReader {
            next: offset,
            records: if offset < start {
                Vec::new().into_iter()
            } else {
                records.into_iter()
            },
            failure,
        })
    }

    fn committed_offset(&self) -> u64 {
        self.committed.load(Ordering::SeqCst)
    }

    fn start_offset(&self) -> u64 {
        self.start.load(Ordering::SeqCst)
    }

    fn truncate_suffix(&self, _from: u64) -> LogResult<()> {
        Ok(())
    }

    fn heal(&self) -> LogResult<()> {
        Ok(())
    }

    fn remove_prefix(&self, before: u64) -> LogResult<Removing> {
        self.removals.lock().expect("lock").push(before);
        Err(LogError::Invalid("not kept on disk".into()))
    }

    fn hand_back(&self) -> LogResult<Removing> {
        Err(LogError::Invalid("not kept on disk".into()))
    }

    fn disk_bytes(&self) -> u64 {
        0
    }

    fn tail_room_bytes(&self) -> u64 {
        0
    }

    fn space(&self) -> LogSpace {
        LogSpace {
            disk_bytes: 0,
            segment_bases: vec![self.start_offset()],
        }
    }

    fn close(self: Arc<Self>) -> BrokerResult<()> {
        Ok(())
    }

    fn delete(self: Arc<Self>) -> BrokerResult<()> {
        Ok(())
    }

    fn reset(self: Arc<Self>) -> (Option<Arc<dyn PartitionLog>>, BrokerResult<()>) {
        (Some(self), Err(BrokerError::Invalid("no reset".into())))
    }
}

struct MemReader {
    next: u64,
    records: std::vec::IntoIter<ReadRecord>,
    /// Returned once the records run out.
    failure: Option<String>,
}

impl Iterator for MemReader {
    type Item = LogResult<ReadRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.records.next() {
            Some(record) => {
                self.next = record.offset + 1;
                Some(Ok(record))
            }
            None => self.failure.take().map(|f| Err(LogError::Invalid(f))),
        }
    }
}

impl PartitionReader for MemReader {
    fn next_offset(&self) -> u64 {
        self.next
    }
}
