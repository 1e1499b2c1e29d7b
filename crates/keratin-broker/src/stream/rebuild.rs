//! Rebuilding a stream partition's state from its log at open (and after a heal), from the last
//! checkpoint instead of the log's start (`docs/streams.md`, "`STREAM_CHECKPOINT`").
//!
//! The segments are tried from the tail backwards: each is read from its base to the log's
//! committed end, restarting the state at every checkpoint met; the first segment that holds
//! one gives the state. Checkpoints come every quarter of a segment, so a rebuild reads about
//! the tail segment, or the tail and the one before, however long the stream. Every record read
//! after the checkpoint is decoded and applied (a later checkpoint must match the state it
//! follows), so damage there stops the open instead of giving wrong counts.
//!
//! A log without any checkpoint is rebuilt from its start, which is right only if nothing was
//! ever removed from it (start 0): retention keeps a checkpoint in the oldest segment it leaves
//! (`stream/retention.rs`), so a log with a removed prefix and no checkpoint is refused as
//! corrupt.
//!
//! Blocking: reads the log (run it on the blocking pool).

use crate::error::{BrokerError, BrokerResult};
use crate::partition::log::PartitionLog;
use crate::stream::records::StreamRecord;
use crate::stream::state::StreamPartitionState;

/// A rebuilt state and how much was read for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebuilt {
    /// The state as of the log's committed end.
    pub state: StreamPartitionState,
    /// Records read (the cost of the rebuild).
    pub records_read: u64,
}

/// The state of the stream partition in `log`, as of its committed end.
pub fn rebuild(log: &dyn PartitionLog) -> BrokerResult<Rebuilt> {
    let start = log.start_offset();
    let end = log.committed_offset();
    let bases = log.space().segment_bases;
    let mut records_read = 0;
    for &base in bases.iter().rev() {
        let from = base.max(start);
        if from >= end {
            continue;
        }
        if let Some(state) = scan(log, from, end, None, &mut records_read)? {
            return Ok(Rebuilt {
                state,
                records_read,
            });
        }
    }
    if start != 0 {
        return Err(BrokerError::Corrupt {
            what: "stream partition",
            offset: start,
            reason: format!(
                "the log starts at {start} (a prefix was removed) and holds no checkpoint to \
                 rebuild from"
            ),
        });
    }
    let state = scan(
        log,
        start,
        end,
        Some(StreamPartitionState::new(start)),
        &mut records_read,
    )?
    .expect("a scan given a state returns one");
    Ok(Rebuilt {
        state,
        records_read,
    })
}

/// Reads `from..end`, starting the state over at each checkpoint (or from `state` when given)
/// and applying every record after it; `None` when neither a state was given nor a checkpoint
/// found.
fn scan(
    log: &dyn PartitionLog,
    from: u64,
    end: u64,
    mut state: Option<StreamPartitionState>,
    records_read: &mut u64,
) -> BrokerResult<Option<StreamPartitionState>> {
    let mut expected = from;
    for record in log.reader(from) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        if record.offset != expected {
            return Err(BrokerError::Corrupt {
                what: "stream partition",
                offset: record.offset,
                reason: format!("the log skipped from {expected} to {}", record.offset),
            });
        }
        expected += 1;
        *records_read += 1;
        let decoded = StreamRecord::decode(record.record_type, &record.payload, record.offset)?;
        match (&decoded, state.as_mut()) {
            (StreamRecord::Checkpoint(checkpoint), None) => {
                state = Some(StreamPartitionState::from_checkpoint(
                    record.offset,
                    record.timestamp_ms,
                    checkpoint,
                )?);
            }
            // A later checkpoint is checked against the state it follows by `apply`.
            (_, Some(current)) => {
                current.apply(
                    record.offset,
                    record.timestamp_ms,
                    record.payload.len() as u64,
                    &decoded,
                )?;
            }
            (_, None) => {}
        }
    }
    if expected < end && state.is_some() {
        return Err(BrokerError::Corrupt {
            what: "stream partition",
            offset: expected,
            reason: format!("the log's records end at {expected}, before its committed end {end}"),
        });
    }
    Ok(state)
}
