//! `GroupLogs` (the two logs of a group, kept across rebuilds of its `Raft`) and `LogStore`, the
//! openraft log storage over them, with its reader `LogStoreReader`.
//!
//! The view: openraft sees the durable entries of the entry log plus an in-memory tail of the
//! entries appended since and not yet durable (openraft reads what it just appended, before the
//! flush; keratin-log readers only see durable records). Only once a batch's append ticket
//! resolves, after the sync, is openraft told it is flushed. An entry leaves the tail once it
//! is both durable and applied by the state machine: until then the replication streams, the
//! state machine and the partition owner read it from memory instead of reading the file back
//! (a leader's replication streams read an entry right after its flush, the state machine
//! right after its commit). Unapplied entries are the ones openraft has in flight, so the tail
//! stays as bounded as openraft's pipeline.
//!
//! On a follower the partition owner reads every committed entry too, just after the state
//! machine applied it (`LogEvent::Committed` comes from the apply). So while the replica
//! follows (`LogStoreReader::set_hold`), an applied entry stays until a committed reader took it
//! (`LogStoreReader::consumed`) or the tail holds more than [`HOLD_BYTES_MAX`]: the owner reads
//! from memory instead of reading back the record it has just written. A leader's owner
//! proposed the records itself and does not read them: nothing is held there.
//!
//! Raft index == log offset. A purge point past the log's end (after a snapshot install)
//! restarts the entry log there (`Log::restart_at`), so the next entry lands at its index; an
//! entry appended past the end without one (openraft does not) is preceded by gap records.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::{stream, Stream, StreamExt};
use keratin_log::{Io, Log, LogOptions, SegmentPool, SizeClass};
use openraft::storage::{IOFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::OptionalSend;

use crate::entry_format::{
    decode_entry, decode_entry_owned, encode_entry, encode_gap, EncodedEntry,
};
use crate::error::RaftError;
use crate::fence::Fence;
use crate::raft_state::{RaftState, StateLog};
use crate::types::{Entry, LogId, StorageId, TypeConfig, Vote};

/// The entry log's directory inside a group's directory.
pub const ENTRIES_DIR_NAME: &str = "entries";
/// The state log's directory inside a group's directory.
pub const STATE_DIR_NAME: &str = "raft-state";

/// At most this many gap records fill offsets up to an entry whose index lies past the log's
/// end (after a purge past the end, which follows a snapshot install). 65,536 records of 52
/// bytes are 3.3 MiB; a larger jump needs a segment-log operation that restarts a log at a
/// higher offset (crate docs, "What is left").
pub const GAP_FILL_MAX: u64 = 65_536;

/// Most bytes of entries the view's tail holds for a follower's owner (module docs); past it,
/// applied entries leave as they would on a leader, and the owner reads them from the file.
/// 1 MiB: an owner reads within a few milliseconds of the apply (about 100 KB at 100,000
/// messages of 1 KiB a second), and an owner that lags (stopped, starved) costs at most this
/// much memory per partition replica.
pub const HOLD_BYTES_MAX: usize = 1 << 20;

/// What an entry counts for in the tail's bytes: its payload and a little for the rest.
fn entry_bytes(entry: &Entry) -> usize {
    const OVERHEAD: usize = 64;
    match &entry.payload {
        openraft::EntryPayload::Normal(record) => OVERHEAD + record.payload.len(),
        _ => OVERHEAD,
    }
}

fn entries_bytes<'a>(tail: impl IntoIterator<Item = &'a TailEntry>) -> usize {
    tail.into_iter().map(|t| entry_bytes(&t.entry)).sum()
}

/// The two logs of one partition group: the entry log (the partition's segment log: record
/// offset == Raft index) and the small state log (vote, committed, purge point). They outlive
/// the group's `Raft` instances: after a failure the owner heals them and builds a new
/// [`LogStore`] with [`GroupLogs::store`].
#[derive(Debug, Clone)]
pub struct GroupLogs {
    entries: Arc<Log>,
    state: Arc<Log>,
}

impl GroupLogs {
    /// Open (recover) the logs in `dir/entries` and `dir/raft-state`. `options` are the entry
    /// log's; the state log uses the same full segment size in the small class.
    pub fn open(
        io: Arc<dyn Io>,
        dir: &Path,
        options: LogOptions,
        pool: Option<SegmentPool>,
    ) -> Result<GroupLogs, RaftError> {
        let state_options = LogOptions {
            size_class: SizeClass::Small,
            ..options.clone()
        };
        let entries = Log::open(
            io.clone(),
            &dir.join(ENTRIES_DIR_NAME),
            options,
            pool.clone(),
        )
        .map_err(|e| RaftError::log("open the entry log", e))?;
        let state = Log::open(io, &dir.join(STATE_DIR_NAME), state_options, pool)
            .map_err(|e| RaftError::log("open the raft state log", e))?;
        Ok(GroupLogs {
            entries: Arc::new(entries),
            state: Arc::new(state),
        })
    }

    /// The entry log (for readers of the partition: record offset == Raft index; the format of
    /// its records is in `docs/storage-format.md`, "Replicated log records").
    pub fn entries(&self) -> &Log {
        &self.entries
    }

    /// Close both logs once nothing else holds them: the store of a shut-down `Raft`, its
    /// readers and its flush waiters let go as their tasks end. While something still does, the
    /// logs come back as `Err` (try again later; never open the directory twice).
    pub fn try_close(self) -> Result<Result<(), RaftError>, GroupLogs> {
        let (entries, state) = self.try_unshare()?;
        let closed = entries
            .close()
            .map_err(|e| RaftError::log("close the entry log", e));
        let state_closed = state
            .close()
            .map_err(|e| RaftError::log("close the raft state log", e));
        Ok(closed.and(state_closed))
    }

    /// Delete both logs (this node's copy of the group: see `keratin_log::Log::delete`) once
    /// nothing else holds them, as [`GroupLogs::try_close`].
    pub fn try_delete(self) -> Result<Result<(), RaftError>, GroupLogs> {
        let (entries, state) = self.try_unshare()?;
        // The entry log first: a crash between the two leaves a state log naming entries that
        // are gone, in a directory the caller removes (or deletes again) next.
        let deleted = entries
            .delete()
            .map_err(|e| RaftError::log("delete the entry log", e));
        let state_deleted = state
            .delete()
            .map_err(|e| RaftError::log("delete the raft state log", e));
        Ok(deleted.and(state_deleted))
    }

    /// Both logs, if nothing else holds them.
    fn try_unshare(self) -> Result<(Log, Log), GroupLogs> {
        let GroupLogs { entries, state } = self;
        let entries = match Arc::try_unwrap(entries) {
            Ok(entries) => entries,
            Err(entries) => return Err(GroupLogs { entries, state }),
        };
        match Arc::try_unwrap(state) {
            Ok(state) => Ok((entries, state)),
            Err(state) => Err(GroupLogs {
                entries: Arc::new(entries),
                state,
            }),
        }
    }

    /// Heal both logs after a stop (see `keratin_log::Log::heal`). Call it after the group's
    /// `Raft` is shut down, then build a new store.
    pub fn heal(&self) -> Result<(), RaftError> {
        self.entries
            .heal()
            .map_err(|e| RaftError::log("heal the entry log", e))?;
        self.state
            .heal()
            .map_err(|e| RaftError::log("heal the raft state log", e))
    }

    /// A log storage for a new `Raft` instance, with a new fence, its view read from what is
    /// durable. Cuts gap records left at the end by a torn batch. Blocks while it reads.
    pub fn store(&self) -> Result<LogStore, RaftError> {
        for log in [&self.entries, &self.state] {
            if let Some(stop) = log.stopped() {
                return Err(RaftError::log("build a store", stop));
            }
        }
        let mut state = StateLog::read(&self.state)?;
        let storage = match state.storage {
            Some(storage) => storage,
            None => {
                // A new copy (or one written before identities existed): its identity is
                // durable before the replica answers anyone, so that every answer it gives is
                // this copy's.
                let storage = StorageId::random()?;
                state.storage = Some(storage);
                StateLog::write_now(&self.state, &state)
                    .map_err(|e| RaftError::log("save the storage identity", e))?;
                storage
            }
        };
        let entries = &self.entries;
        let purged_next = state.purged.as_ref().map_or(0, |p| p.index + 1);
        if entries.next_offset() < purged_next {
            // A restart past the log's end (after a snapshot install) that a crash cut short:
            // the purge point was durable first, so the log goes on from there.
            entries
                .restart_at(purged_next)
                .and_then(|ticket| ticket.wait())
                .map_err(|e| RaftError::log("restart the entry log at the purge point", e))?;
        }
        let floor = entries.start_offset().max(purged_next);
        let mut end = entries.durable_offset();
        let mut last = None;
        while end > floor {
            let record = entries
                .read(end - 1)
                .map_err(|e| RaftError::log("read the last entry", e))?;
            match decode_entry(&record)? {
                Some(entry) => {
                    last = Some(entry.log_id);
                    break;
                }
                None => end -= 1,
            }
        }
        if end < entries.next_offset() {
            entries
                .truncate_suffix(end)
                .and_then(|ticket| ticket.wait())
                .map_err(|e| RaftError::log("cut trailing gap records", e))?;
        }
        let last_log_id = last.or(state.purged);
        // The committed id is written without waiting for the sync and the entries it names may
        // not be durable here yet: the entries present are a prefix of the log as it was, so
        // the last one present is committed if a later one was.
        if state.committed.as_ref().map(|c| c.index) > last_log_id.as_ref().map(|l| l.index) {
            state.committed = last_log_id;
        }
        let state_log = Arc::new(tokio::sync::Mutex::new(StateLog::new(
            self.state.clone(),
            &state,
        )));
        let view = View {
            tail: BTreeMap::new(),
            applied_next: 0,
            hold: false,
            consumed_next: 0,
            tail_bytes: 0,
            next_index: end,
            disk_limit: u64::MAX,
            last_log_id,
            state,
            next_batch: 0,
        };
        Ok(LogStore {
            shared: Arc::new(Shared {
                storage,
                entries: self.entries.clone(),
                fence: Fence::new(),
                view: Mutex::new(view),
                store_dropped: tokio::sync::watch::Sender::new(false),
            }),
            state_log,
            purged_watch: None,
        })
    }
}

/// An entry of the view's tail.
#[derive(Debug)]
struct TailEntry {
    /// The append it came with.
    batch: u64,
    /// Its batch is durable (it stays until applied too).
    flushed: bool,
    entry: Entry,
}

/// What openraft sees of the log.
#[derive(Debug)]
struct View {
    /// Entries appended and not yet both durable and applied, by index (module docs).
    tail: BTreeMap<u64, TailEntry>,
    /// One past the last entry the state machine applied: below it, durable entries leave the
    /// tail (unless held, see `hold`).
    applied_next: u64,
    /// The replica follows: applied entries stay until a committed reader took them, within
    /// [`HOLD_BYTES_MAX`] (module docs).
    hold: bool,
    /// One past the last entry a committed reader took.
    consumed_next: u64,
    /// [`entry_bytes`] of the tail's entries.
    tail_bytes: usize,
    /// One past the last entry. Unless fenced, also the entry log's next offset.
    next_index: u64,
    /// Disk records from here on are stale: a truncation made while fenced never reached the
    /// disk.
    disk_limit: u64,
    last_log_id: Option<LogId>,
    /// As openraft saved it (while fenced: possibly not on disk).
    state: RaftState,
    next_batch: u64,
}

impl View {
    /// Put `entries` (consecutive, from `first`) at the end of the view; returns their batch.
    fn put(&mut self, first: u64, entries: Vec<Entry>) -> u64 {
        let batch = self.next_batch;
        self.next_batch += 1;
        self.cut_from(first);
        self.tail_bytes += entries.iter().map(entry_bytes).sum::<usize>();
        if let Some(last) = entries.last() {
            self.next_index = last.log_id.index + 1;
            self.last_log_id = Some(last.log_id);
        }
        for entry in entries {
            self.tail.insert(
                entry.log_id.index,
                TailEntry {
                    batch,
                    flushed: false,
                    entry,
                },
            );
        }
        batch
    }

    /// Drop the tail's entries from `index` on.
    fn cut_from(&mut self, index: u64) {
        let cut = self.tail.split_off(&index);
        self.tail_bytes -= entries_bytes(cut.values());
    }

    /// Drop the tail's entries up to and including `index`.
    fn cut_through(&mut self, index: u64) {
        let kept = self.tail.split_off(&(index + 1));
        let cut = std::mem::replace(&mut self.tail, kept);
        self.tail_bytes -= entries_bytes(cut.values());
    }

    /// Drop the durable and applied entries at the front of the tail, but those held for a
    /// follower's owner (module docs). Batches become durable in index order, so once the front
    /// is not, nothing behind it is either.
    fn sweep(&mut self) {
        while let Some(first) = self.tail.first_entry() {
            let index = *first.key();
            if index >= self.applied_next || !first.get().flushed {
                break;
            }
            if self.hold && index >= self.consumed_next && self.tail_bytes <= HOLD_BYTES_MAX {
                break;
            }
            let gone = first.remove();
            self.tail_bytes -= entry_bytes(&gone.entry);
        }
    }

    fn purged_next(&self) -> u64 {
        self.state.purged.as_ref().map_or(0, |p| p.index + 1)
    }
}

#[derive(Debug)]
struct Shared {
    /// This copy's identity (also in `view.state`, which the state log writes).
    storage: StorageId,
    entries: Arc<Log>,
    fence: Fence,
    view: Mutex<View>,
    /// Set when the `LogStore` is dropped (its `Raft` is shut down).
    store_dropped: tokio::sync::watch::Sender<bool>,
}

impl Shared {
    fn view(&self) -> MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A batch is durable: mark it in the tail (unless truncated and replaced meanwhile), and
    /// drop what is applied too.
    fn flushed(&self, batch: u64, range: std::ops::Range<u64>) {
        let mut view = self.view();
        for (_, tail_entry) in view.tail.range_mut(range) {
            if tail_entry.batch == batch {
                tail_entry.flushed = true;
            }
        }
        view.sweep();
    }

    /// The entries in `lo..hi` that exist, in order; with a failure, those before it.
    /// Disk reads (of entries that left the tail) run on the blocking pool.
    async fn read_range(self: &Arc<Self>, lo: u64, hi: u64) -> (Vec<Entry>, Option<ReadFailure>) {
        let plan = self.read_plan(lo, hi);
        if plan.disk.is_none() {
            return self.read_disk(plan);
        }
        let shared = self.clone();
        match tokio::task::spawn_blocking(move || shared.read_disk(plan)).await {
            Ok(read) => read,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: nobody waits for the answer.
            Err(_) => (Vec::new(), None),
        }
    }

    /// What the view holds of `lo..hi`, and the range left to read from the disk.
    fn read_plan(&self, lo: u64, hi: u64) -> ReadPlan {
        let (lo, hi, disk_limit, found) = {
            let view = self.view();
            let lo = lo.max(view.purged_next());
            let hi = hi.min(view.next_index);
            if lo >= hi {
                return ReadPlan {
                    found: BTreeMap::new(),
                    disk: None,
                };
            }
            let found: BTreeMap<u64, Entry> = view
                .tail
                .range(lo..hi)
                .map(|(index, tail_entry)| (*index, tail_entry.entry.clone()))
                .collect();
            (lo, hi, view.disk_limit, found)
        };
        let disk_lo = lo.max(self.entries.start_offset());
        let disk_hi = hi.min(disk_limit).min(self.entries.durable_offset());
        let disk =
            (disk_lo < disk_hi && (found.len() as u64) < hi - lo).then_some((disk_lo, disk_hi));
        ReadPlan { found, disk }
    }

    /// Carry out a plan: read its disk range (blocking), merge, keep the entries consecutive.
    fn read_disk(&self, plan: ReadPlan) -> (Vec<Entry>, Option<ReadFailure>) {
        let ReadPlan { mut found, disk } = plan;
        let mut failure = None;
        if let Some((disk_lo, disk_hi)) = disk {
            // Bounded: a read of a few hundred entries just behind the durable end (a
            // follower applying, a replication stream) reads those, not the file up to the end.
            for result in self.entries.reader(disk_lo).until(disk_hi) {
                let record = match result {
                    Ok(record) => record,
                    Err(e) => {
                        failure = Some(self.read_failure(e));
                        break;
                    }
                };
                if record.offset >= disk_hi {
                    break;
                }
                if found.contains_key(&record.offset) {
                    continue;
                }
                let offset = record.offset;
                match decode_entry_owned(record) {
                    Ok(Some(entry)) => {
                        found.insert(offset, entry);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        failure = Some(ReadFailure::Storage(e));
                        break;
                    }
                }
            }
        }
        // Entries must come consecutive: after a failure, keep the run from the first one.
        let mut entries: Vec<Entry> = Vec::with_capacity(found.len());
        for (index, entry) in found {
            if failure.is_some() && entries.last().is_some_and(|e| e.log_id.index + 1 != index) {
                break;
            }
            entries.push(entry);
        }
        (entries, failure)
    }

    /// What a failed read of the entry log means. A purge raises the view's purge point before
    /// it removes segments, so an offset below the point (or below the log's start) when the
    /// read fails was removed after the read was planned: the entries are gone on purpose.
    fn read_failure(&self, error: keratin_log::LogError) -> ReadFailure {
        let purged = match &error {
            keratin_log::LogError::OutOfRange { offset, .. } => {
                let floor = self.view().purged_next().max(self.entries.start_offset());
                *offset < floor
            }
            _ => false,
        };
        let error = RaftError::log("read entries", error);
        if purged {
            ReadFailure::Purged(error)
        } else {
            ReadFailure::Storage(error)
        }
    }
}

/// Why a read returned fewer entries than it planned.
#[derive(Debug)]
enum ReadFailure {
    /// A purge (a snapshot's, or the partition's space reclaim) removed entries after the read
    /// was planned: no storage failed. The error is the segment log's `OutOfRange`; a reader
    /// asks again from the new start.
    Purged(RaftError),
    /// The entry log failed, or holds what is not an entry: the fence trips.
    Storage(RaftError),
}

impl ReadFailure {
    /// The error, after tripping `fence` if storage failed.
    fn settle(self, fence: &Fence) -> RaftError {
        match self {
            ReadFailure::Purged(error) => error,
            ReadFailure::Storage(error) => {
                fence.trip(error.clone());
                error
            }
        }
    }
}

/// A read of `lo..hi`: the entries the view's tail holds, and the range to read from disk.
#[derive(Debug)]
struct ReadPlan {
    found: BTreeMap<u64, Entry>,
    disk: Option<(u64, u64)>,
}

/// The openraft log storage of one group instance (see [`GroupLogs::store`]).
#[derive(Debug)]
pub struct LogStore {
    shared: Arc<Shared>,
    /// Shared with the state machine's [`SnapshotKeeper`].
    state_log: Arc<tokio::sync::Mutex<StateLog>>,
    /// Told one past each purge point (see [`LogStore::watch_purges`]).
    purged_watch: Option<Arc<tokio::sync::watch::Sender<u64>>>,
}

/// The state machine's handle on the group's state log: where a snapshot's meta is kept
/// (`docs/storage-format.md`, "Raft state records"), beside the vote and purge point.
#[derive(Debug, Clone)]
pub struct SnapshotKeeper {
    state_log: Arc<tokio::sync::Mutex<StateLog>>,
    /// The store's fence: once tripped, nothing is kept (see [`SnapshotKeeper::save`]).
    fence: Fence,
}

impl SnapshotKeeper {
    /// The snapshot meta kept (read at open, or last saved).
    pub async fn current(&self) -> Option<crate::state_machine::SnapshotMeta> {
        self.state_log.lock().await.snapshot().cloned()
    }

    /// Keep `meta` as the snapshot's: returns once it is durable. Refused once the store is
    /// fenced: truncations and purges then reach only the in-memory view, and a snapshot kept
    /// over the uncut entries on disk would disagree with them when the replica starts again
    /// (openraft refuses such a log). The rebuilt replica gets the snapshot again.
    pub async fn save(
        &self,
        meta: crate::state_machine::SnapshotMeta,
    ) -> keratin_log::LogResult<()> {
        let mut state_log = self.state_log.lock().await;
        // Checked under the state log's lock: the store trips the fence before it skips a
        // write, so a truncation skipped while fenced is never followed by a kept snapshot.
        if let Some(reason) = self.fence.reason() {
            return Err(keratin_log::LogError::Invalid(format!(
                "the group's storage is fenced ({reason}): no snapshot is kept until it is \
                 rebuilt"
            )));
        }
        state_log.write_snapshot(meta).await
    }
}

impl Drop for LogStore {
    fn drop(&mut self) {
        self.shared.store_dropped.send_replace(true);
    }
}

/// A reader of a [`LogStore`]'s view (cheap to clone).
#[derive(Debug, Clone)]
pub struct LogStoreReader {
    shared: Arc<Shared>,
}

impl LogStore {
    /// This copy's storage identity (made when the copy was created, see [`StorageId`]).
    pub fn storage(&self) -> StorageId {
        self.reader().storage()
    }

    /// This instance's fence: tripped at the first failure of either log.
    pub fn fence(&self) -> Fence {
        self.shared.fence.clone()
    }

    /// The handle a state machine keeps its snapshot meta with.
    pub fn snapshot_keeper(&self) -> SnapshotKeeper {
        SnapshotKeeper {
            state_log: self.state_log.clone(),
            fence: self.shared.fence.clone(),
        }
    }

    /// Raise `watch` to one past each purge point once the purge is in the view. A replica's
    /// committed offset: after a snapshot install openraft purges the entries it covers, and
    /// only then may the partition owner look past them (it finds the log restarted and
    /// rebuilds its state from there, instead of reading entries this node never had).
    pub fn watch_purges(&mut self, watch: Arc<tokio::sync::watch::Sender<u64>>) {
        self.purged_watch = Some(watch);
    }

    /// A reader of the view.
    pub fn reader(&self) -> LogStoreReader {
        LogStoreReader {
            shared: self.shared.clone(),
        }
    }

    fn trip(&self, error: RaftError) {
        self.shared.fence.trip(error);
    }

    /// Queue the records of `entries` (from `first`) on the entry log, gap records first if
    /// `first` lies past its end.
    async fn append_to_log(
        &self,
        first: u64,
        entries: &[Entry],
    ) -> Result<keratin_log::Ticket<std::ops::Range<u64>>, RaftError> {
        let log = &self.shared.entries;
        let next = self.shared.view().next_index;
        debug_assert_eq!(next, log.next_offset(), "an unfenced view matches the log");
        let mut encoded: Vec<EncodedEntry> = Vec::with_capacity(entries.len());
        if first > next {
            let gap = first - next;
            if gap > GAP_FILL_MAX {
                return Err(RaftError::Unsupported(format!(
                    "entry {first} lies {gap} offsets past the log's end {next} (at most \
                     {GAP_FILL_MAX} gap records)"
                )));
            }
            encoded.extend(std::iter::repeat_n(encode_gap(), gap as usize));
        } else if first < next {
            // openraft truncates before it overwrites; should it not, the log's order of
            // requests keeps this cut before the append.
            drop(
                log.truncate_suffix(first)
                    .map_err(|e| RaftError::log("truncate before an overwrite", e))?,
            );
        }
        for (entry, index) in entries.iter().zip(first..) {
            assert_eq!(
                entry.log_id.index, index,
                "openraft appends consecutive entries"
            );
            encoded.push(encode_entry(entry)?);
        }
        let records: Vec<keratin_log::Record<'_>> =
            encoded.iter().map(EncodedEntry::record).collect();
        log.append_async(&records)
            .await
            .map_err(|e| RaftError::log("append entries", e))
    }
}

fn index_range(range: &impl RangeBounds<u64>) -> (u64, u64) {
    let lo = match range.start_bound() {
        Bound::Included(x) => *x,
        Bound::Excluded(x) => x.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let hi = match range.end_bound() {
        Bound::Included(x) => x.saturating_add(1),
        Bound::Excluded(x) => *x,
        Bound::Unbounded => u64::MAX,
    };
    (lo, hi)
}

impl LogStoreReader {
    /// This copy's storage identity.
    pub fn storage(&self) -> StorageId {
        self.shared.storage
    }

    /// The state machine applied every entry below `next`: those that are durable leave the
    /// view's tail (later reads of them go to the entry log).
    pub(crate) fn release_applied(&self, next: u64) {
        let mut view = self.shared.view();
        if next > view.applied_next {
            view.applied_next = next;
            view.sweep();
        }
    }

    /// Hold applied entries for a committed reader (the replica follows), or not (it leads):
    /// module docs.
    pub(crate) fn set_hold(&self, hold: bool) {
        let mut view = self.shared.view();
        if view.hold != hold {
            view.hold = hold;
            view.sweep();
        }
    }

    /// A committed reader took every entry below `next`: held ones leave the tail.
    pub(crate) fn consumed(&self, next: u64) {
        let mut view = self.shared.view();
        if next > view.consumed_next {
            view.consumed_next = next;
            view.sweep();
        }
    }

    /// Bytes of the entries in the view's tail (see [`HOLD_BYTES_MAX`]).
    pub fn tail_bytes(&self) -> usize {
        self.shared.view().tail_bytes
    }

    /// The first index this node holds or will hold: past the purge point and the entry log's
    /// start.
    pub fn floor(&self) -> u64 {
        let purged_next = self.shared.view().purged_next();
        purged_next.max(self.shared.entries.start_offset())
    }

    /// The entries in `lo..hi` that exist, in order, the in-memory tail of entries not yet
    /// durable included; with an error, those before the failure. The fence trips if storage
    /// failed; entries a purge removed while the read ran end it with the segment log's
    /// `OutOfRange` and leave the fence alone (the caller reads on from the new start). For
    /// the partition's committed reader (`crate::replica`): a committed entry need not be
    /// durable on this node yet (a majority elsewhere committed it).
    /// Blocking (it reads files): call it on the blocking pool.
    pub(crate) fn read_entries(&self, lo: u64, hi: u64) -> (Vec<Entry>, Option<RaftError>) {
        self.read_planned(self.shared.read_plan(lo, hi))
    }

    /// Carry out a read planned before (see [`LogStoreReader::read_entries`]).
    fn read_planned(&self, plan: ReadPlan) -> (Vec<Entry>, Option<RaftError>) {
        let (entries, failure) = self.shared.read_disk(plan);
        (
            entries,
            failure.map(|failure| failure.settle(&self.shared.fence)),
        )
    }
}

impl RaftLogReader<TypeConfig> for LogStoreReader {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let (lo, hi) = index_range(&range);
        let (entries, failure) = self.shared.read_range(lo, hi).await;
        if let Some(failure) = failure {
            // Fewer entries than asked: replication treats a short read as a heartbeat and
            // retries (after a purge, from the snapshot); after a storage failure the fence
            // tripped and the owner rebuilds the group.
            failure.settle(&self.shared.fence);
        }
        Ok(entries)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.shared.view().state.vote)
    }

    async fn entries_stream<RB>(
        &mut self,
        range: RB,
    ) -> impl Stream<Item = Result<Entry, io::Error>> + OptionalSend
    where
        RB: RangeBounds<u64> + Clone + Debug + OptionalSend,
    {
        let (lo, hi) = index_range(&range);
        let (entries, failure) = self.shared.read_range(lo, hi).await;
        let items = stream::iter(entries.into_iter().map(Ok));
        match failure {
            None => items.boxed(),
            Some(failure) => {
                // Never a purge in practice (entries the state machine has yet to apply are
                // not purged), and either way an entry it needs is gone: the fence trips.
                let error = match failure {
                    ReadFailure::Purged(error) | ReadFailure::Storage(error) => error,
                };
                // The state machine applies what this stream yields and counts on all of it
                // (openraft asserts it in debug builds): after a read failure the stream stays
                // open, without an error, while this instance runs. Once its store is dropped
                // (the owner shut the `Raft` down) it ends with the error, which no running
                // instance sees, so that the state machine task ends and lets go of the logs.
                self.shared.fence.trip(error.clone());
                let mut dropped = self.shared.store_dropped.subscribe();
                let end = stream::once(async move {
                    // The sender lives in `Shared`, which this stream does not hold: a closed
                    // channel also means the store is gone.
                    let _ = dropped.wait_for(|dropped| *dropped).await;
                    Err(io::Error::other(format!(
                        "entries read after the store was shut down: {error}"
                    )))
                });
                items.chain(end).boxed()
            }
        }
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStoreReader;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let view = self.shared.view();
        Ok(LogState {
            last_purged_log_id: view.state.purged,
            last_log_id: view.last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.reader()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        let state = {
            let mut view = self.shared.view();
            view.state.vote = Some(*vote);
            view.state.clone()
        };
        if !self.shared.fence.is_tripped() {
            if let Err(e) = self.state_log.lock().await.write(&state, true).await {
                self.trip(RaftError::log("save the vote", e));
            }
        }
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        let state = {
            let mut view = self.shared.view();
            view.state.committed = committed;
            view.state.clone()
        };
        let mut state_log = self.state_log.lock().await;
        if !self.shared.fence.is_tripped() && state_log.committed_is_due(state.committed.as_ref()) {
            if let Err(e) = state_log.write(&state, false).await {
                self.trip(RaftError::log("save the committed log id", e));
            }
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.shared.view().state.committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let Some(first) = entries.first().map(|e| e.log_id.index) else {
            callback.io_completed(Ok(()));
            return Ok(());
        };
        let ticket = if self.shared.fence.is_tripped() {
            None
        } else {
            match self.append_to_log(first, &entries).await {
                Ok(ticket) => Some(ticket),
                Err(error) => {
                    self.trip(error);
                    None
                }
            }
        };
        let batch = {
            let mut view = self.shared.view();
            if ticket.is_none() {
                view.disk_limit = view.disk_limit.min(first);
            }
            view.put(first, entries)
        };
        let Some(ticket) = ticket else {
            // Never flushed: openraft waits for this callback, which is dropped.
            return Ok(());
        };
        let shared = self.shared.clone();
        tokio::spawn(async move {
            match ticket.await {
                Ok(range) => {
                    shared.flushed(batch, range);
                    callback.io_completed(Ok(()));
                }
                Err(e) => shared.fence.trip(RaftError::log("append entries", e)),
            }
        });
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let cut = last_log_id.as_ref().map_or(0, |l| l.index + 1);
        let fenced = self.shared.fence.is_tripped();
        {
            let mut view = self.shared.view();
            if cut >= view.next_index {
                return Ok(());
            }
            view.cut_from(cut);
            view.next_index = cut;
            view.last_log_id = last_log_id.or_else(|| view.state.purged);
            if fenced {
                view.disk_limit = view.disk_limit.min(cut);
                return Ok(());
            }
        }
        let result = match self.shared.entries.truncate_suffix(cut) {
            Ok(ticket) => ticket.await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            self.shared.view().disk_limit = cut;
            self.trip(RaftError::log("truncate entries", e));
        }
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let next = log_id.index + 1;
        let (state, past_end) = {
            let mut view = self.shared.view();
            if view.state.purged.as_ref() >= Some(&log_id) {
                return Ok(());
            }
            // Past the end only after a snapshot install: no entry of the log is kept, and
            // the log restarts at the purge point (below, once that point is durable).
            let past_end = view.next_index < next;
            if past_end {
                view.next_index = next;
            }
            if view.last_log_id.as_ref() < Some(&log_id) {
                view.last_log_id = Some(log_id);
            }
            view.state.purged = Some(log_id);
            view.cut_through(log_id.index);
            (view.state.clone(), past_end)
        };
        if self.shared.fence.is_tripped() {
            return Ok(());
        }
        // The purge point first: once it is durable, a crash during the prefix removal leaves
        // segments below it, which no one reads.
        if let Err(e) = self.state_log.lock().await.write(&state, true).await {
            self.trip(RaftError::log("save the purge point", e));
            return Ok(());
        }
        let removal = if past_end {
            self.shared.entries.restart_at(next)
        } else {
            self.shared.entries.remove_prefix(next)
        };
        let result = match removal {
            Ok(ticket) => ticket.await.map(drop),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            self.trip(RaftError::log("remove purged segments", e));
            return Ok(());
        }
        if let Some(watch) = &self.purged_watch {
            watch.send_if_modified(|applied| {
                let raise = *applied < next;
                if raise {
                    *applied = next;
                }
                raise
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use keratin_log::{LogError, SimIo, MIN_SEGMENT_SIZE_BYTES};
    use openraft::type_config::TypeConfigExt;

    use super::*;
    use crate::types::{LeaderId, PartitionRecord, Payload};

    /// Entries of 32 KiB: about seven to a segment of the smallest size.
    const ENTRIES: u64 = 40;

    fn log_id(index: u64) -> LogId {
        LogId::new(
            LeaderId {
                term: 1,
                node_id: 1,
            },
            index,
        )
    }

    /// A store on the simulated disk holding entries `0..ENTRIES`, flushed and applied (so
    /// reads of them go to the entry log, not the view's tail).
    async fn store_on_disk() -> (GroupLogs, LogStore) {
        let options = LogOptions {
            full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
            ..LogOptions::default()
        };
        let logs =
            GroupLogs::open(Arc::new(SimIo::new(3)), Path::new("/p"), options, None).expect("open");
        let mut store = logs.store().expect("store");
        store
            .save_vote(&Vote::new_committed(1, 1))
            .await
            .expect("vote");
        let entries = (0..ENTRIES).map(|index| Entry {
            log_id: log_id(index),
            payload: Payload::Normal(
                PartitionRecord::new(1, index, vec![7; 32 << 10]).expect("record"),
            ),
        });
        let (tx, rx) = TypeConfig::oneshot();
        store
            .append(entries, IOFlushed::signal(tx))
            .await
            .expect("append");
        assert!(matches!(rx.await, Ok(Ok(()))), "the entries are flushed");
        store.reader().release_applied(ENTRIES);
        assert!(
            store.shared.view().tail.is_empty(),
            "every entry left the view"
        );
        (logs, store)
    }

    /// A read planned from the log's start, and a purge (a snapshot's, or the partition's
    /// space reclaim) that removes segments before the read reaches them: the read ends early,
    /// as a removed prefix does in a segment log (`OutOfRange`), and the fence stays untripped:
    /// no storage failed, and a committed reader (the owner's rebuild, a delivery) asks again
    /// from the new start. Before, the fence tripped ("read entries: offset 0 is not in the log
    /// (it holds offsets 21..40)") and the partition's `Raft` was shut down and rebuilt.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_purge_during_a_read_is_no_storage_failure() {
        let (_logs, mut store) = store_on_disk().await;
        let reader = store.reader();
        let plan = store.shared.read_plan(0, ENTRIES);
        assert_eq!(plan.disk, Some((0, ENTRIES)));
        store.purge(log_id(20)).await.expect("purge");
        let start = store.shared.entries.start_offset();
        assert!(
            start > 0,
            "the purge removed segments (the log starts at {start})"
        );

        let (entries, failure) = reader.read_planned(plan);
        assert!(
            !store.fence().is_tripped(),
            "a read of entries purged meanwhile tripped the fence: {:?}",
            store.fence().reason()
        );
        assert!(entries.is_empty(), "read {} purged entries", entries.len());
        match failure {
            Some(RaftError::Log {
                source: LogError::OutOfRange { offset: 0, .. },
                ..
            }) => {}
            other => panic!("the read ends as out of range at offset 0, not {other:?}"),
        }
        let (entries, failure) = reader.read_entries(start, ENTRIES);
        assert!(
            failure.is_none(),
            "a read from the new start fails: {failure:?}"
        );
        assert_eq!(entries.len() as u64, ENTRIES - start);

        // A committed reader that starts (or stands) below the purge point is told so in the
        // same terms, not that the replica is broken (before: `Unsupported`, "committed entry
        // 0 is no longer in this replica's log").
        let (_committed_tx, committed) = tokio::sync::watch::channel(ENTRIES);
        let mut committed_reader =
            crate::replica::CommittedReader::new(reader.clone(), 0, committed);
        match committed_reader.next() {
            Some(Err(RaftError::Log {
                source:
                    LogError::OutOfRange {
                        offset: 0,
                        start: floor,
                        ..
                    },
                ..
            })) if floor == start => {}
            other => panic!("a committed read below the purge point: {other:?}"),
        }
        assert!(!store.fence().is_tripped());
    }
}
