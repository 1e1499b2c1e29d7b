//! `MemLog`, a replicated log's stand-in for the owner's tests: committed records in memory,
//! every proposal committed at once, records "committed by another node" on demand, and a log
//! restart past its end (a follower installing the leader's snapshot) that can strike in the
//! middle of a read.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use keratin_log::{LogError, LogResult, ReadRecord};

use crate::error::{BrokerError, BrokerResult};
use crate::partition::log::{
    BoxReader, LogEvent, LogEvents, LogSpace, PartitionLog, PartitionReader, Proposal, Proposing,
    Removing,
};
use crate::record::PartitionRecord;

/// See the module docs.
#[derive(Default)]
pub(super) struct MemLog {
    /// Every record from offset 0; those below `start` are gone.
    records: Mutex<Vec<(u8, Vec<u8>)>>,
    start: AtomicU64,
    committed: AtomicU64,
    events: OnceLock<LogEvents>,
    /// `(at, new_start)`: the next read from below `at` returns the records up to `at`, then
    /// fails because the log restarted at `new_start` meanwhile (once).
    restart_mid_read: Mutex<Option<(u64, u64)>>,
}

impl MemLog {
    /// Append committed records; returns their offsets.
    pub(super) fn push(&self, records: &[(u8, Vec<u8>)]) -> Range<u64> {
        let mut held = self.records.lock().expect("lock");
        let start = held.len() as u64;
        held.extend_from_slice(records);
        let end = held.len() as u64;
        self.committed.store(end, Ordering::SeqCst);
        start..end
    }

    /// Records another node proposed, now committed.
    pub(super) fn commit_foreign(&self, records: &[PartitionRecord]) {
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
    pub(super) fn restart_during_next_read(&self, at: u64, new_start: u64) {
        *self.restart_mid_read.lock().expect("lock") = Some((at, new_start));
    }

    /// The log restarts at `new_start` now (a snapshot installed before the owner opened).
    pub(super) fn restart(&self, new_start: u64) {
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
            let records: Vec<(u8, Vec<u8>)> =
                proposal.types.into_iter().zip(proposal.payloads).collect();
            let range = self.push(&records);
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
        let start = self.start.load(Ordering::SeqCst);
        let until = restart.map_or(held.len() as u64, |(at, _)| at);
        let records: Vec<ReadRecord> = (offset..until)
            .zip(held.iter().skip(offset as usize))
            .map(|(offset, (record_type, payload))| ReadRecord {
                offset,
                record_type: *record_type,
                flags: 0,
                timestamp_ms: 0,
                payload: payload.clone(),
            })
            .collect();
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

    fn remove_prefix(&self, _before: u64) -> LogResult<Removing> {
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
