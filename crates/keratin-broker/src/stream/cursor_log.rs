//! A stream's cursor log on one node: the [`CursorTable`] and the log (small size class) its
//! records are kept in, written through and compacted (`docs/streams.md`, "Cursor log
//! records"). The sole writer of that log.
//!
//! - Open: apply every record from the log's start (a compacted log starts with a snapshot).
//! - Commit and delete: checked against the table, appended, applied once durable; the answer
//!   comes after the sync, so a committed position survives a crash.
//! - Compaction ([`CursorLog::compact_if_due`], after writes): a snapshot of the table is
//!   appended, then every segment before it goes to the pool. A crash between the two leaves
//!   records before the snapshot, which replaces what they built: the same table.
//!
//! Blocking (appends wait for their sync): the stream's owner runs it on the blocking pool.
//! A failed write stops the log (`keratin_log` semantics): every later call fails until the
//! owner heals it with [`CursorLog::heal`], which re-reads the table from what is durable.
//! Single node only: in a cluster the cursor log is a replicated group (not built yet).

use std::path::Path;
use std::sync::Arc;

use keratin_log::{Io, Log, LogOptions, Record, SegmentPool, SizeClass};

use crate::error::{BrokerError, BrokerResult};
use crate::stream::cursors::{should_compact, CursorRecord, CursorTable};

/// A stream's cursor log and the table it holds.
#[derive(Debug)]
pub struct CursorLog {
    log: Log,
    table: CursorTable,
}

impl CursorLog {
    /// Opens (or creates, at the first write) the cursor log in `dir`, with the node's
    /// `full_segment_size_bytes` (the log uses the small class, an eighth of it).
    pub fn open(
        io: Arc<dyn Io>,
        dir: &Path,
        full_segment_size_bytes: u64,
        pool: Option<SegmentPool>,
    ) -> BrokerResult<CursorLog> {
        let options = LogOptions {
            full_segment_size_bytes,
            size_class: SizeClass::Small,
            ..LogOptions::default()
        };
        let log = Log::open(io, dir, options, pool)?;
        let table = read_table(&log)?;
        Ok(CursorLog { log, table })
    }

    /// The cursors.
    pub fn table(&self) -> &CursorTable {
        &self.table
    }

    /// Sets cursor `name`'s `positions` (partition, next offset), durably, at `now_ms`.
    pub fn commit(
        &mut self,
        name: &str,
        positions: &[(u32, u64)],
        now_ms: u64,
    ) -> BrokerResult<()> {
        self.table.check_commit(name, positions)?;
        let record = CursorRecord::Commit {
            name: name.to_owned(),
            positions: positions.to_vec(),
        };
        self.write(&record, now_ms)
    }

    /// Removes cursor `name`, durably; `false` (and nothing written) when it does not exist.
    pub fn delete(&mut self, name: &str, now_ms: u64) -> BrokerResult<bool> {
        if self.table.get(name).is_none() {
            return Ok(false);
        }
        self.write(
            &CursorRecord::Delete {
                name: name.to_owned(),
            },
            now_ms,
        )?;
        Ok(true)
    }

    /// Deletes the cursors idle for `expiry_ms`; returns their names.
    pub fn expire(&mut self, now_ms: u64, expiry_ms: u64) -> BrokerResult<Vec<String>> {
        let expired = self.table.expired(now_ms, expiry_ms);
        for name in &expired {
            self.delete(name, now_ms)?;
        }
        Ok(expired)
    }

    /// Compacts the log when [`should_compact`] says so; returns whether it did.
    pub fn compact_if_due(&mut self, now_ms: u64) -> BrokerResult<bool> {
        let stats = self.log.stats();
        // What the records take, not what is preallocated ahead of them.
        let used: u64 = stats.segments.iter().map(|s| s.used_bytes).sum();
        let snapshot = self.table.snapshot();
        let snapshot_bytes = snapshot.encode().len() as u64;
        let segment = self.log_segment_bytes();
        if !should_compact(used, stats.segments.len(), snapshot_bytes, segment) {
            return Ok(false);
        }
        // The snapshot starts a segment of its own, so that removing what lies before it
        // frees every older segment.
        self.log.roll()?.wait()?;
        let at = self.log.next_offset();
        self.write(&snapshot, now_ms)?;
        self.log.remove_prefix(at)?.wait()?;
        Ok(true)
    }

    /// Heals a log stopped by a failed write and reads the table again from what is durable
    /// (a write that failed after its sync is in the log, so it is in the table too).
    pub fn heal(&mut self) -> BrokerResult<()> {
        self.log.heal()?;
        self.table = read_table(&self.log)?;
        Ok(())
    }

    /// Bytes of the log's segments on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.log.disk_bytes()
    }

    /// Closes the log.
    pub fn close(self) -> BrokerResult<()> {
        Ok(self.log.close()?)
    }

    /// Deletes the log (the stream is deleted).
    pub fn delete_log(self) -> BrokerResult<()> {
        Ok(self.log.delete()?)
    }

    fn log_segment_bytes(&self) -> u64 {
        self.log.pool().options().full_segment_size_bytes / 8
    }

    fn write(&mut self, record: &CursorRecord, now_ms: u64) -> BrokerResult<()> {
        let payload = record.encode();
        self.log.append_sync(&[Record {
            record_type: record.record_type(),
            flags: 0,
            timestamp_ms: now_ms,
            payload: &payload,
        }])?;
        self.table.apply(record, now_ms);
        Ok(())
    }
}

/// The table the durable records of `log` build.
fn read_table(log: &Log) -> BrokerResult<CursorTable> {
    let mut table = CursorTable::new();
    let end = log.durable_offset();
    for record in log.reader(log.start_offset()) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        let decoded = CursorRecord::decode(record.record_type, &record.payload, record.offset)?;
        table.apply(&decoded, record.timestamp_ms);
    }
    if log.next_offset() != end {
        return Err(BrokerError::Corrupt {
            what: "cursor log",
            offset: end,
            reason: "records past the durable end at open".into(),
        });
    }
    Ok(table)
}
