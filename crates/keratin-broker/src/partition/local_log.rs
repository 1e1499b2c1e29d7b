//! `LocalLog`: the single-node [`PartitionLog`], a `keratin_log::Log` on this node's disk.
//! Committed means durable: a proposal is one `append_async` (group commit: many proposals
//! share one write and one `fdatasync`), reported committed once the commit worker's sync
//! covers it. Readers see only durable records. Every record is its owner's proposal, so it
//! never sends [`LogEvent::Committed`].

use std::path::Path;
use std::sync::{Arc, OnceLock};

use keratin_log::{Io, Log, LogError, LogOptions, LogResult, Record};

use super::log::{
    BoxReader, LogEvent, LogEvents, LogSpace, PartitionLog, Proposal, Proposing, Removing,
};
use crate::error::{BrokerError, BrokerResult};
use crate::partition::prepare::CONTROL_RECORD_BYTES_MAX;
use crate::record::{ENQUEUE, RELOCATE};

/// A partition log on this node's disk only.
pub struct LocalLog {
    log: Log,
    /// To open a fresh log in the same directory (`reset`).
    io: Arc<dyn Io>,
    segment_size_bytes: u64,
    events: OnceLock<LogEvents>,
}

impl LocalLog {
    /// Wrap an open log whose segments are `segment_size_bytes` long.
    pub fn new(log: Log, io: Arc<dyn Io>, segment_size_bytes: u64) -> LocalLog {
        LocalLog {
            log,
            io,
            segment_size_bytes,
            events: OnceLock::new(),
        }
    }

    fn events(&self) -> &LogEvents {
        // The owner starts the log before it proposes anything: a proposal without a listener
        // would be committed and never applied.
        self.events
            .get()
            .expect("a partition log proposed to before it was started")
    }
}

impl PartitionLog for LocalLog {
    fn start(&self, events: LogEvents) {
        let _ = self.events.set(events);
    }

    fn propose(self: Arc<Self>, proposal: Proposal) -> Proposing {
        Box::pin(async move {
            let records: Vec<Record<'_>> = proposal
                .types
                .iter()
                .zip(&proposal.payloads)
                .map(|(record_type, payload)| Record {
                    record_type: *record_type,
                    flags: 0,
                    timestamp_ms: proposal.timestamp_ms,
                    payload,
                })
                .collect();
            // Messages (and relocated copies) leave room for the largest control record
            // behind them: the acks, returns and purges that free the disk are written even
            // when the file system filled after the messages (`docs/reliability.md`).
            let leave = if proposal
                .types
                .iter()
                .any(|t| *t == ENQUEUE || *t == RELOCATE)
            {
                CONTROL_RECORD_BYTES_MAX
            } else {
                0
            };
            let ticket = self.log.append_async_leaving(&records, leave).await?;
            let events = self.events().clone();
            let sequence = proposal.sequence;
            tokio::spawn(async move {
                let result = ticket.await.map_err(BrokerError::Log);
                events.send(LogEvent::Proposed { sequence, result });
            });
            Ok(())
        })
    }

    fn reader(&self, offset: u64) -> BoxReader {
        Box::new(self.log.reader(offset))
    }

    fn committed_offset(&self) -> u64 {
        self.log.durable_offset()
    }

    fn start_offset(&self) -> u64 {
        self.log.start_offset()
    }

    fn truncate_suffix(&self, from: u64) -> LogResult<()> {
        let committed = self.log.durable_offset();
        if from >= committed {
            return Ok(());
        }
        Err(LogError::Invalid(format!(
            "a local log never drops committed records (asked to truncate from {from}, \
             committed up to {committed})"
        )))
    }

    fn heal(&self) -> LogResult<()> {
        self.log.heal()
    }

    fn remove_prefix(&self, before: u64) -> LogResult<Removing> {
        Ok(Box::pin(self.log.remove_prefix(before)?))
    }

    fn hand_back(&self) -> LogResult<Removing> {
        Ok(Box::pin(self.log.hand_back()?))
    }

    fn disk_bytes(&self) -> u64 {
        self.log.disk_bytes()
    }

    fn tail_room_bytes(&self) -> u64 {
        self.log.tail_room_bytes()
    }

    fn space(&self) -> LogSpace {
        let stats = self.log.stats();
        LogSpace {
            disk_bytes: stats.disk_bytes,
            segment_bases: stats.segments.iter().map(|s| s.base_offset).collect(),
        }
    }

    fn close(self: Arc<Self>) -> BrokerResult<()> {
        Ok(unshared(self)?.log.close()?)
    }

    fn delete(self: Arc<Self>) -> BrokerResult<()> {
        Ok(unshared(self)?.log.delete()?)
    }

    fn reset(self: Arc<Self>) -> (Option<Arc<dyn PartitionLog>>, BrokerResult<()>) {
        let local = match Arc::try_unwrap(self) {
            Ok(local) => local,
            Err(shared) => {
                let error = BrokerError::Closed("the log is still in use".into());
                return (Some(shared), Err(error));
            }
        };
        let events = local.events.get().cloned();
        let (io, segment_size_bytes) = (local.io.clone(), local.segment_size_bytes);
        let (log, result) = reset_log(io.clone(), local.log, segment_size_bytes);
        let log = log.map(|log| {
            let fresh = LocalLog::new(log, io, segment_size_bytes);
            // The fresh log reports to the same owner.
            if let Some(events) = events {
                fresh.start(events);
            }
            Arc::new(fresh) as Arc<dyn PartitionLog>
        });
        (log, result)
    }
}

/// The log alone, to close or delete it; a log still shared elsewhere (a bug) is closed by its
/// last holder's drop.
fn unshared(log: Arc<LocalLog>) -> BrokerResult<LocalLog> {
    Arc::try_unwrap(log)
        .map_err(|_| BrokerError::Closed("the partition log is still in use".into()))
}

/// Delete `log` and open a fresh one in its directory (blocking). Returns the fresh log, or
/// none when that failed (until a restart, which opens the directory again).
fn reset_log(
    io: Arc<dyn Io>,
    log: Log,
    segment_size_bytes: u64,
) -> (Option<Log>, BrokerResult<()>) {
    let dir = log.dir().to_path_buf();
    let pool = log.pool().clone();
    if let Err(error) = log.delete() {
        // A log stopped at a roll can hold the scratch file of the segment it could not
        // allocate, which `Log::delete` does not know: the directory stays, without
        // segments. Anything else is a real failure.
        match remove_if_no_segments(io.as_ref(), &dir) {
            Ok(true) => {}
            Ok(false) => return (None, Err(error.into())),
            Err(error) => return (None, Err(error)),
        }
    }
    // Spares being prepared from the deleted segments become ready first.
    pool.flush();
    let options = LogOptions {
        full_segment_size_bytes: segment_size_bytes,
        ..LogOptions::default()
    };
    match Log::open(io, &dir, options, Some(pool)) {
        Ok(log) => (Some(log), Ok(())),
        Err(error) => (None, Err(error.into())),
    }
}

/// Remove a log directory that holds no segment file (a deleted log whose directory stayed,
/// with at most the scratch file of a segment it failed to create): opening it as a log would
/// create a segment, which needs space a full disk does not have. True if it was removed.
pub(crate) fn remove_if_no_segments(io: &dyn Io, dir: &Path) -> BrokerResult<bool> {
    let io_error = |e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display()));
    let names = io.read_dir(dir).map_err(io_error)?;
    if names.iter().any(|name| name.ends_with(".seg")) {
        return Ok(false);
    }
    for name in names {
        io.remove_file(&dir.join(name)).map_err(io_error)?;
    }
    io.remove_dir(dir).map_err(io_error)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use keratin_log::{PoolOptions, RealIo, SegmentPool};
    use tokio::sync::mpsc;

    use super::*;
    use crate::record::ENQUEUE;

    const SEGMENT_SIZE_BYTES: u64 = 1 << 20;

    /// A log in `storage`, with a node pool there, as the broker opens one.
    fn open(storage: &std::path::Path) -> (Arc<LocalLog>, mpsc::UnboundedReceiver<LogEvent>) {
        let io: Arc<dyn Io> = Arc::new(RealIo::new());
        let pool = SegmentPool::new(
            io.clone(),
            PoolOptions {
                full_segment_size_bytes: SEGMENT_SIZE_BYTES,
                ..PoolOptions::default()
            },
        );
        pool.add_storage_dir(storage).expect("storage directory");
        let options = LogOptions {
            full_segment_size_bytes: SEGMENT_SIZE_BYTES,
            ..LogOptions::default()
        };
        let dir = storage.join("partition");
        let log = Log::open(io.clone(), &dir, options, Some(pool)).expect("log opens");
        let local = Arc::new(LocalLog::new(log, io, SEGMENT_SIZE_BYTES));
        let (sender, receiver) = mpsc::unbounded_channel();
        local.start(LogEvents::new(move |event| {
            let _ = sender.send(event);
        }));
        (local, receiver)
    }

    fn proposal(sequence: u64, payloads: &[&[u8]]) -> Proposal {
        Proposal {
            sequence,
            types: vec![ENQUEUE; payloads.len()],
            payloads: payloads.iter().map(|p| p.to_vec()).collect(),
            timestamp_ms: 7,
        }
    }

    async fn next_event(events: &mut mpsc::UnboundedReceiver<LogEvent>) -> LogEvent {
        tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("an event within 10 s")
            .expect("the log keeps its sender")
    }

    /// A proposal is reported committed at consecutive offsets, only once durable: a reader
    /// then sees it, and the committed offset covers it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_proposal_is_reported_committed_then_readable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, mut events) = open(dir.path());
        log.clone()
            .propose(proposal(0, &[b"a", b"bc"]))
            .await
            .expect("taken");
        log.clone()
            .propose(proposal(1, &[b"d"]))
            .await
            .expect("taken");
        let mut ranges = Vec::new();
        for _ in 0..2 {
            match next_event(&mut events).await {
                LogEvent::Proposed { sequence, result } => {
                    ranges.push((sequence, result.expect("committed")))
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        ranges.sort_by_key(|(sequence, _)| *sequence);
        assert_eq!(ranges, vec![(0, 0..2), (1, 2..3)]);
        assert_eq!(log.committed_offset(), 3);
        let payloads: Vec<Vec<u8>> = log.reader(1).map(|r| r.expect("reads").payload).collect();
        assert_eq!(payloads, vec![b"bc".to_vec(), b"d".to_vec()]);
    }

    /// A local log has no uncommitted suffix to cut: it refuses to drop committed records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn truncating_committed_records_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, mut events) = open(dir.path());
        log.clone()
            .propose(proposal(0, &[b"a"]))
            .await
            .expect("taken");
        next_event(&mut events).await;
        assert!(log.truncate_suffix(1).is_ok());
        assert!(matches!(log.truncate_suffix(0), Err(LogError::Invalid(_))));
    }

    /// A reset gives an empty log whose proposals reach the same listener.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reset_log_starts_at_zero_and_reports_to_the_same_owner() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, mut events) = open(dir.path());
        log.clone()
            .propose(proposal(0, &[b"a", b"b"]))
            .await
            .expect("taken");
        next_event(&mut events).await;
        let (fresh, result) = tokio::task::spawn_blocking(move || log.reset())
            .await
            .expect("the job ends");
        result.expect("reset");
        let fresh = fresh.expect("a fresh log");
        assert_eq!((fresh.start_offset(), fresh.committed_offset()), (0, 0));
        fresh
            .clone()
            .propose(proposal(1, &[b"c"]))
            .await
            .expect("taken");
        match next_event(&mut events).await {
            LogEvent::Proposed { sequence, result } => {
                assert_eq!((sequence, result.expect("committed")), (1, 0..1))
            }
            other => panic!("unexpected {other:?}"),
        }
        tokio::task::spawn_blocking(move || fresh.close())
            .await
            .expect("the job ends")
            .expect("closes");
    }
}
