//! The committed reader of a [`ReplicatedLog`]: the adapter's own entries read as `NOOP`.

use super::*;

/// A reader of the committed log for the owner: the adapter's entries read as `NOOP`.
pub(super) struct ReplicatedReader {
    /// `None` once the replica was shut down.
    pub(super) reader: Option<CommittedReader>,
    pub(super) offset: u64,
    pub(super) dir: PathBuf,
}

impl Iterator for ReplicatedReader {
    type Item = LogResult<ReadRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let Some(reader) = self.reader.as_mut() else {
            self.reader = None;
            return Some(Err(LogError::Closed {
                dir: self.dir.clone(),
            }));
        };
        let record = match reader.next()? {
            Ok(record) => record,
            Err(error) => {
                return Some(Err(log_error(
                    "reading the replicated partition log",
                    error,
                )))
            }
        };
        self.offset = record.offset + 1;
        if record.record_type >= RECORD_TYPE_RESERVED_MIN {
            // A blank or membership entry: it takes an offset, the owner applies it as NOOP
            // (`docs/partition-records.md`).
            return Some(Ok(ReadRecord {
                record_type: NOOP,
                payload: Vec::new(),
                ..record
            }));
        }
        Some(Ok(record))
    }
}

impl PartitionReader for ReplicatedReader {
    fn next_offset(&self) -> u64 {
        self.reader
            .as_ref()
            .map_or(self.offset, CommittedReader::next_offset)
    }
}
