//! Rebuilding a partition's state from its log: at open, after a heal, and on a follower
//! whose log restarted past its head (a snapshot from the leader).

use super::*;
use crate::record::{ENQUEUE, RELOCATE};

/// Rebuild a partition's state by applying its log's records from the start, up to `until`
/// (exclusive) or the committed end (blocking: reads the log). A replicated log may restart
/// past the read while it runs (this follower installs the leader's snapshot: the records
/// below the new start hold nothing live): the rebuild then starts over from the new start.
/// Each new try starts further on, and the log starts past its end at most by the leader's
/// committed end, so the tries are bounded by the leader's snapshots during one rebuild.
pub(crate) fn rebuild(log: &dyn PartitionLog, until: Option<u64>) -> BrokerResult<PartitionState> {
    loop {
        let start = log.start_offset();
        match rebuild_from(log, start, until) {
            Err(error) if log.start_offset() > start => {
                tracing::info!(
                    from = start,
                    now = log.start_offset(),
                    %error,
                    "the log restarted past the rebuild (a snapshot from the leader); rebuilding from its new start"
                );
            }
            rebuilt => return rebuilt,
        }
    }
}

/// One try of [`rebuild`], from `start`.
fn rebuild_from(
    log: &dyn PartitionLog,
    start: u64,
    until: Option<u64>,
) -> BrokerResult<PartitionState> {
    let end = until.unwrap_or_else(|| log.committed_offset());
    let mut state = PartitionState::new(start);
    for record in log.reader(start) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        let decoded = PartitionRecord::decode(record.record_type, &record.payload, record.offset)?;
        state.apply(record.offset, &decoded)?;
    }
    if state.recount_due() {
        recount(log, &mut state, end)?;
    }
    Ok(state)
}

/// Count the live messages and their bytes from the records that hold their payloads: each
/// live message's `ENQUEUE`, or its latest `RELOCATE` (the one `payload_offset` names). A second
/// read of the log, needed only after a purge named messages below the log's start.
fn recount(log: &dyn PartitionLog, state: &mut PartitionState, end: u64) -> BrokerResult<()> {
    let mut count = 0u64;
    let mut bytes = 0u64;
    for record in log.reader(state.start()) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        let (message, size_bytes) = match record.record_type {
            ENQUEUE => (record.offset, record.payload.len() as u64),
            RELOCATE => match PartitionRecord::decode(RELOCATE, &record.payload, record.offset)? {
                PartitionRecord::Relocate(relocate) => {
                    (relocate.message, relocate.payload.len() as u64)
                }
                _ => continue,
            },
            _ => continue,
        };
        if state.is_live(message) && state.payload_offset(message) == record.offset {
            count += 1;
            bytes += size_bytes;
        }
    }
    state.recount(count, bytes);
    Ok(())
}

#[cfg(test)]
mod tests {
    //! A follower's log can restart past a rebuild that is reading it: at open, a node that
    //! was down long enough receives the leader's snapshot while its partitions are rebuilt
    //! (issue 14's cluster test, round 5: the restarted node failed to start with "committed
    //! entries 713495..713751 are no longer in this replica's log").

    use super::*;
    use crate::partition::mem_log::MemLog;

    fn enqueue(body: &str) -> (u8, Vec<u8>) {
        let mut payload = Vec::new();
        Message::new(body).encode(&mut payload).expect("encodes");
        (ENQUEUE, payload)
    }

    #[test]
    fn a_rebuild_starts_over_when_the_log_restarts_under_it() {
        let log = MemLog::default();
        let bodies: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
        let records: Vec<(u8, Vec<u8>)> = bodies.iter().map(|b| enqueue(b)).collect();
        log.push(&records);
        // The read gets to offset 4; the log restarts at 8 meanwhile.
        log.restart_during_next_read(4, 8);
        let state = rebuild(&log, None).expect("rebuilt from the new start");
        assert_eq!(state.start(), 8);
        assert_eq!(state.head(), 10);
        assert_eq!(
            state.live_count(),
            2,
            "the messages at and above the new start"
        );
    }

    #[test]
    fn a_read_failure_with_the_start_in_place_is_an_error() {
        let log = MemLog::default();
        let records: Vec<(u8, Vec<u8>)> = (0..10).map(|i| enqueue(&format!("m{i}"))).collect();
        log.push(&records);
        // The read stops at 4 with an error, and the log did not move: nothing to start over.
        log.restart_during_next_read(4, 0);
        assert!(rebuild(&log, None).is_err());
    }
}
