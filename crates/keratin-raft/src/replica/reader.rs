//! [`CommittedReader`]: a partition's committed records in offset order. They come from the
//! group's log view (`crate::store`): the entry log (the Raft log is the partition log) plus
//! the in-memory tail of entries appended but not yet durable here, because an entry is
//! committed once a majority has it, which need not include this node. The adapter's own
//! entries (blank, membership) take offsets but are not partition records: they are skipped,
//! so a reader sees gaps in the offsets, never a record that is not the broker's — unless it
//! was made with [`CommittedReader::with_adapter_entries`], which returns them as records of
//! their reserved type ([`RECORD_TYPE_BLANK`], [`RECORD_TYPE_MEMBERSHIP`]) with an empty
//! payload, so that offsets stay consecutive (the broker maps them to `NOOP`). It stops at
//! the committed offset of the moment (records past it may still be cut by a new leader);
//! reading again later continues where it stopped.

use std::collections::VecDeque;

use keratin_log::{LogError, ReadRecord};
use tokio::sync::watch;

use crate::entry_format::{RECORD_TYPE_BLANK, RECORD_TYPE_MEMBERSHIP};
use crate::error::RaftError;
use crate::store::LogStoreReader;
use crate::types::{Entry, Payload};

/// Entries read from the view at a time.
const READ_BATCH: u64 = 256;

/// See the module docs. Iterating blocks on file reads: run it on the blocking pool.
#[derive(Debug)]
pub struct CommittedReader {
    view: LogStoreReader,
    /// The offset of the next entry to read from the view.
    next: u64,
    /// Entries read and not yet returned.
    buffered: VecDeque<Entry>,
    committed: watch::Receiver<u64>,
    /// Return the adapter's own entries too (see the module docs).
    adapter_entries: bool,
}

impl CommittedReader {
    pub(crate) fn new(view: LogStoreReader, offset: u64, committed: watch::Receiver<u64>) -> Self {
        CommittedReader {
            view,
            next: offset,
            buffered: VecDeque::new(),
            committed,
            adapter_entries: false,
        }
    }

    /// This reader, returning the adapter's own entries (blank, membership) as records of their
    /// reserved type with an empty payload and timestamp 0, so that every committed offset is
    /// returned.
    pub fn with_adapter_entries(mut self) -> Self {
        self.adapter_entries = true;
        self
    }

    /// The offset of the next entry it returns or skips.
    pub fn next_offset(&self) -> u64 {
        self.buffered
            .front()
            .map_or(self.next, |entry| entry.log_id.index)
    }

    fn fill(&mut self) -> Result<(), RaftError> {
        let committed = *self.committed.borrow();
        if self.next >= committed {
            return Ok(());
        }
        let hi = committed.min(self.next + READ_BATCH);
        let (entries, failure) = self.view.read_entries(self.next, hi);
        if let Some(error) = failure {
            return Err(error);
        }
        if entries.first().map(|first| first.log_id.index) != Some(self.next) {
            // A purge removed them (the read is planned from the purge point on): as a
            // segment log reports a removed prefix, so the reader's owner reads on from the
            // new start.
            let floor = self.view.floor();
            if self.next < floor {
                return Err(RaftError::Log {
                    what: "read committed entries",
                    source: LogError::OutOfRange {
                        offset: self.next,
                        start: floor,
                        end: committed,
                    },
                });
            }
            return Err(RaftError::Unsupported(format!(
                "committed entries {}..{hi} are missing from this replica's log (it starts at \
                 {floor})",
                self.next
            )));
        }
        self.next += entries.len() as u64;
        self.buffered.extend(entries);
        // A follower's view held them for this read (`store`, module docs).
        self.view.consumed(self.next);
        Ok(())
    }
}

impl Iterator for CommittedReader {
    /// A partition record as written by the broker: its type, timestamp and payload, at its
    /// offset; `flags` is 0. With adapter entries, those too (see the module docs).
    type Item = Result<ReadRecord, RaftError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.buffered.is_empty() {
                if let Err(error) = self.fill() {
                    return Some(Err(error));
                }
            }
            let entry = self.buffered.pop_front()?;
            let offset = entry.log_id.index;
            let (record_type, timestamp_ms, payload) = match entry.payload {
                Payload::Normal(record) => (
                    record.record_type,
                    record.timestamp_ms,
                    Vec::from(record.payload),
                ),
                _ if !self.adapter_entries => continue,
                Payload::Blank => (RECORD_TYPE_BLANK, 0, Vec::new()),
                Payload::Membership(_) => (RECORD_TYPE_MEMBERSHIP, 0, Vec::new()),
            };
            return Some(Ok(ReadRecord {
                offset,
                record_type,
                flags: 0,
                timestamp_ms,
                payload,
            }));
        }
    }
}
