//! The `Writer`, the only code that writes a log's files, and the round a commit worker runs
//! with it (`run_round`; the workers themselves are `workers.rs`'s).
//!
//! Appenders only queue requests (`log.rs`); a round takes everything queued at once, encodes
//! the records into one buffer, writes it with one `write_all_at` per segment and covers it with
//! one `sync_data`, then publishes the new durable end and resolves the tickets. While it syncs,
//! new appends queue up for the next round: that is the group commit.
//!
//! Ordering rules the recovery relies on (docs/storage-format.md, "Ordering"):
//! - a segment's records are synced before the header of the segment after it is written;
//! - a record claims durable only what a completed sync covered (`durable_distance`);
//! - truncation removes later segments before it zeroes the cut segment's tail;
//! - a segment file grows by preallocation steps before the write that needs the room, and its
//!   new length is made durable by the batch's sync;
//! - a hand-back makes its anchor durable before it removes any segment;
//! - a restart hands the log back first and only then makes its own anchor durable.
//!
//! Any failed write or sync stops the log: nothing is retried in place.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{LogError, LogResult};
use crate::format::{
    encode_anchor, encode_record, HeaderKind, RecordFields, SegmentHeader, FLAG_SEAL,
    RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE,
};
use crate::io::{IoError, IoFile, OpenMode};
use crate::log::{Item, Pending, PrefixRemoval, RecordMeta, Shared};
use crate::reader::locate;
use crate::recovery::{zero_range, Recovered};
use crate::segment::{
    preallocation_target, scratch_file_name, segment_file_name, IndexBuilder, IndexEntry, Segment,
    ANCHOR_FILE_NAME, ANCHOR_SCRATCH_FILE_NAME,
};
use crate::ticket::Reply;
use crate::workers::WorkerSet;

/// The segment appends go to.
#[derive(Debug)]
struct Active {
    base: u64,
    generation: u16,
    file: Arc<dyn IoFile>,
    size_bytes: u64,
    /// The file's length: writes below it need no new blocks.
    allocated: u64,
    /// One past the last byte written.
    position: u64,
    next_offset: u64,
    index: IndexBuilder,
    new_entries: Vec<IndexEntry>,
}

impl Active {
    fn from_segment(segment: &Segment, position: u64, next_offset: u64) -> Active {
        let last = segment
            .index
            .iter()
            .rev()
            .find(|e| segment.base + u64::from(e.offset_delta) < next_offset)
            .map(|e| u64::from(e.position));
        Active {
            base: segment.base,
            generation: segment.generation,
            file: segment.file.clone(),
            size_bytes: segment.size_bytes,
            allocated: segment.allocated_bytes,
            position,
            next_offset,
            index: IndexBuilder::new(segment.base, last),
            new_entries: Vec::new(),
        }
    }
}

/// A change to a segment that readers see once it is durable.
#[derive(Debug)]
struct Update {
    base: u64,
    allocated_bytes: u64,
    end_position: u64,
    next_offset: u64,
    entries: Vec<IndexEntry>,
}

pub(crate) enum Flow {
    Continue,
    Exit,
}

/// The write side of a log, used by one commit worker at a time.
#[derive(Debug)]
pub(crate) struct Writer {
    /// The segment appends go to; `None` while the log holds no segment (a new log before its
    /// first append, or after a hand-back): the next append creates one at `durable_next`.
    active: Option<Active>,
    /// Whether the log directory exists (it is created with the first segment).
    dir_exists: bool,
    durable_next: u64,
    /// Encoded records not yet written; they start at `buf_position` of the active segment.
    buf: Vec<u8>,
    buf_position: u64,
    updates: Vec<Update>,
    created: Vec<Segment>,
    dirty: Vec<Arc<dyn IoFile>>,
    dir_dirty: bool,
    /// Room an append encoded since the last flush asked to leave past the records
    /// (`Log::append_async_leaving`): the next flush allocates it in the active segment.
    leave: u64,
    /// The answer to `close`, sent once every earlier answer has been delivered.
    close_reply: Option<(Reply<()>, LogResult<()>)>,
}

/// Answers of one group commit: every ticket of it resolves with its offsets.
type AnswerBatch = Vec<(Reply<Range<u64>>, Range<u64>)>;

/// A log's writer and the buffer its rounds swap the pending requests into, kept between rounds
/// in the log's state (`State::engine`).
#[derive(Debug)]
pub(crate) struct Engine {
    writer: Writer,
    work: Pending,
    /// The file system's commit workers, which count the buffers idle logs keep.
    workers: Arc<WorkerSet>,
    /// The buffer capacity counted for this log while it is idle; 0 while a round runs.
    retained: usize,
}

impl Engine {
    pub(crate) fn new(writer: Writer, workers: Arc<WorkerSet>) -> Box<Engine> {
        Box::new(Engine {
            writer,
            work: Pending::default(),
            workers,
            retained: 0,
        })
    }

    /// A round starts: its buffers are in use, no longer counted as kept.
    fn start_round(&mut self) {
        self.workers.unretain(std::mem::take(&mut self.retained));
    }

    /// The log goes idle with `pending` empty: keep the buffers if the file system's bound on
    /// kept buffers has room for them ([`crate::workers::RETAINED_BUFFERS_BYTES_MAX`]), else
    /// free them.
    fn go_idle(&mut self, pending: &mut Pending) {
        let bytes =
            self.work.capacity_bytes() + pending.capacity_bytes() + self.writer.buf.capacity();
        if bytes == 0 || self.workers.retain(bytes) {
            self.retained = bytes;
            return;
        }
        self.work = Pending::default();
        *pending = Pending::default();
        self.writer.buf = Vec::new();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.workers.unretain(self.retained);
    }
}

/// Capacity a log keeps in its buffers between groups. A burst of large records can
/// grow them to the pending bound (64 MiB by default, three buffers per log); keeping that after
/// the burst would hold memory the node's memory level counts, long after the load is gone. A
/// group larger than this pays one reallocation, small next to writing it.
const RETAINED_BUFFER_BYTES: usize = 1 << 20;

fn shrink_retained(buf: &mut Vec<u8>) {
    if buf.capacity() > RETAINED_BUFFER_BYTES {
        buf.clear();
        buf.shrink_to(RETAINED_BUFFER_BYTES);
    }
}

type StepResult<T> = Result<T, LogError>;

fn stop<'a>(shared: &'a Shared, op: &'static str) -> impl Fn(IoError) -> LogError + 'a {
    move |source| LogError::Stopped {
        dir: shared.dir.clone(),
        op,
        source,
    }
}

impl Writer {
    /// Take over the recovered segments and publish them. A log without segments starts with
    /// none, at the anchor's offset (or 0), and writes nothing: its first append creates the
    /// first segment. `Recovered::unproven_from` says where the last segment's bytes stop being
    /// proven durable.
    pub(crate) fn start(shared: &Shared, recovered: Recovered) -> LogResult<Writer> {
        let Recovered {
            segments,
            unproven_from,
            empty_next_offset,
            dir_exists,
            ..
        } = recovered;
        let Some(last) = segments.values().next_back() else {
            // Nothing to make durable and nothing to create: the first append creates the first
            // segment (and the directory), on the commit path, as a roll does.
            {
                let mut state = shared.lock();
                state.segments = segments;
                state.next_offset = empty_next_offset;
                state.durable_next = empty_next_offset;
            }
            return Ok(Writer::new(None, empty_next_offset, dir_exists));
        };
        // What no record proves durable may be in the page cache only, with a failed sync
        // behind it (in an earlier process, or before a heal): Linux reported that failure once
        // and marked the pages clean, so the sync below would succeed without writing them.
        // Writing them again makes them dirty, and the sync then makes them durable before the
        // log reports them (issue 12, items 5 and 8: a restart after a stop adopted a failed
        // batch, or a spare's header, that a power loss then took away from under records
        // acknowledged later).
        if let Some(from) = unproven_from {
            rewrite(last, from, last.end_position)?;
        }
        // Recovery read what the page cache holds, which can be more than the disk does: the
        // names and data left by a process that died, or by an open or heal that failed,
        // before its syncs. Make them durable before the log reports them durable and builds on
        // them; otherwise an append acknowledged after this open can vanish with the segment's
        // unsynced directory entry at a power loss (found by crash_every_step: EIO at the
        // first open's sync, reopen, append, crash). A fresh segment needs the same two syncs.
        timed_sync(shared, || last.file.sync_data())
            .map_err(|e| LogError::io("sync segment", last.path.clone(), e))?;
        timed_sync(shared, || shared.io.sync_dir(&shared.dir))
            .map_err(|e| LogError::io("sync log directory", &shared.dir, e))?;
        let active = Active::from_segment(last, last.end_position, last.next_offset);
        let next_offset = active.next_offset;
        {
            let mut state = shared.lock();
            state.segments = segments;
            state.next_offset = next_offset;
            state.durable_next = next_offset;
        }
        Ok(Writer::new(Some(active), next_offset, true))
    }

    fn new(active: Option<Active>, durable_next: u64, dir_exists: bool) -> Writer {
        Writer {
            buf_position: active.as_ref().map_or(0, |a| a.position),
            active,
            dir_exists,
            durable_next,
            buf: Vec::new(),
            updates: Vec::new(),
            created: Vec::new(),
            dirty: Vec::new(),
            dir_dirty: false,
            leave: 0,
            close_reply: None,
        }
    }

    pub(crate) fn next_offset(&self) -> u64 {
        self.active
            .as_ref()
            .map_or(self.durable_next, |a| a.next_offset)
    }

    /// Whether the log holds a segment (appends go to it).
    pub(crate) fn holds_segment(&self) -> bool {
        self.active.is_some()
    }

    /// Carry out one round of queued requests, in order. On error every request of the round
    /// not yet answered gets the error, and the caller stops the log. The answers of the
    /// round's last group (durable already) are left in `answers`: the caller sends them after
    /// it has let go of the log, so that another worker can run the next round meanwhile.
    pub(crate) fn process(
        &mut self,
        shared: &Shared,
        work: &mut Pending,
        answers: &mut AnswerBatch,
    ) -> StepResult<Flow> {
        let mut group: Vec<(Reply<Range<u64>>, Range<u64>)> = Vec::new();
        let mut meta_at = 0usize;
        let mut payload_at = 0usize;
        let mut items = std::mem::take(&mut work.items).into_iter();
        while let Some(item) = items.next() {
            let step = match item {
                Item::Append {
                    first_offset,
                    count,
                    leave,
                    reply,
                } => {
                    let metas = &work.metas[meta_at..meta_at + count];
                    meta_at += count;
                    group.push((reply, first_offset..first_offset + count as u64));
                    self.encode(
                        shared,
                        first_offset,
                        metas,
                        &work.payloads,
                        &mut payload_at,
                        leave,
                    )
                    .map(|()| Flow::Continue)
                }
                op => match self.commit_group(shared, &mut group, true) {
                    Ok(()) => self.run_op(shared, op),
                    Err(error) => {
                        // The request never ran: answer it with the stop, not a dropped reply
                        // (`Closed`), like the requests after it (found by crash_every_step:
                        // EIO at the sync of the appends queued just before a hand-back).
                        let error = fail(shared, error);
                        fail_items([op], &error);
                        Err(error)
                    }
                },
            };
            match step {
                Ok(Flow::Continue) => {}
                Ok(Flow::Exit) => return Ok(Flow::Exit),
                Err(error) => {
                    let error = fail(shared, error);
                    for (reply, _) in group.drain(..) {
                        reply.send(Err(error.clone()));
                    }
                    fail_items(items, &error);
                    return Err(error);
                }
            }
        }
        if let Err(error) = self.commit_group(shared, &mut group, false) {
            let error = fail(shared, error);
            for (reply, _) in group.drain(..) {
                reply.send(Err(error.clone()));
            }
            return Err(error);
        }
        answers.append(&mut group);
        Ok(Flow::Continue)
    }

    /// Encode one append's records into the buffer, rolling to a new segment when full. With
    /// `leave`, the batch starts a new segment unless it and the room fit in the current one
    /// (or that one holds no record yet), and the next flush allocates the room behind it.
    fn encode(
        &mut self,
        shared: &Shared,
        first_offset: u64,
        metas: &[RecordMeta],
        payloads: &[u8],
        payload_at: &mut usize,
        leave: u64,
    ) -> StepResult<()> {
        assert_eq!(
            first_offset,
            self.next_offset(),
            "appends reach the writer in offset order"
        );
        if leave > 0 {
            let batch: u64 = metas
                .iter()
                .map(|m| RECORD_HEADER_SIZE as u64 + u64::from(m.length))
                .sum();
            let roll_first = self.active.as_ref().is_some_and(|a| {
                a.position > SEGMENT_HEADER_SIZE as u64 && a.position + batch + leave > a.size_bytes
            });
            if roll_first {
                self.roll(shared, self.next_offset())?;
            }
        }
        for meta in metas {
            let size = RECORD_HEADER_SIZE as u64 + u64::from(meta.length);
            let fits = self
                .active
                .as_ref()
                .is_some_and(|a| a.position + size <= a.size_bytes);
            if !fits {
                self.roll(shared, self.next_offset())?;
            }
            let active = self
                .active
                .as_mut()
                .expect("a roll leaves an active segment");
            let payload = &payloads[*payload_at..*payload_at + meta.length as usize];
            *payload_at += meta.length as usize;
            let offset = active.next_offset;
            let fields = RecordFields {
                offset,
                generation: active.generation,
                record_type: meta.record_type,
                flags: meta.flags,
                timestamp_ms: meta.timestamp_ms,
                durable_distance: u32::try_from(offset - self.durable_next)
                    .unwrap_or(crate::format::NO_DURABILITY_CLAIM),
            };
            encode_record(&mut self.buf, &fields, payload);
            if let Some(entry) = active.index.record(offset, active.position) {
                active.new_entries.push(entry);
            }
            active.position += size;
            active.next_offset += 1;
        }
        self.leave = self.leave.max(leave);
        Ok(())
    }

    /// Write the buffer to the active segment (not synced yet) and note the segment's new end.
    fn flush(&mut self, shared: &Shared) -> StepResult<()> {
        let Some(active) = self.active.as_mut() else {
            debug_assert!(self.buf.is_empty());
            return Ok(());
        };
        let leave = std::mem::take(&mut self.leave);
        if !self.buf.is_empty() {
            // Room for the idle seal too, so that it never needs an allocation of its own, and
            // the room an append asked to leave behind it.
            let needed = active.position + (RECORD_HEADER_SIZE as u64).max(leave);
            allocate_for(shared, active, needed)?;
            active
                .file
                .write_all_at(&self.buf, self.buf_position)
                .map_err(stop(shared, "write"))?;
            self.buf.clear();
            shrink_retained(&mut self.buf);
            self.mark_dirty();
        }
        let Some(active) = self.active.as_mut() else {
            return Ok(());
        };
        self.buf_position = active.position;
        self.updates.push(Update {
            base: active.base,
            allocated_bytes: active.allocated,
            end_position: active.position,
            next_offset: active.next_offset,
            entries: std::mem::take(&mut active.new_entries),
        });
        Ok(())
    }

    fn mark_dirty(&mut self) {
        let Some(active) = &self.active else {
            return;
        };
        if !self.dirty.iter().any(|f| Arc::ptr_eq(f, &active.file)) {
            self.dirty.push(active.file.clone());
        }
    }

    fn sync_dirty(&mut self, shared: &Shared) -> StepResult<()> {
        for file in self.dirty.drain(..) {
            timed_sync(shared, || file.sync_data()).map_err(stop(shared, "sync"))?;
        }
        if self.dir_dirty {
            timed_sync(shared, || shared.io.sync_dir(&shared.dir))
                .map_err(stop(shared, "sync directory"))?;
            self.dir_dirty = false;
        }
        Ok(())
    }

    /// Write, sync and publish what the group encoded, then answer its appenders (or, without
    /// `answer_now`, leave the answers in `group` for the caller).
    fn commit_group(
        &mut self,
        shared: &Shared,
        group: &mut Vec<(Reply<Range<u64>>, Range<u64>)>,
        answer_now: bool,
    ) -> StepResult<()> {
        if group.is_empty() && self.buf.is_empty() && self.created.is_empty() {
            return Ok(());
        }
        self.flush(shared)?;
        self.sync_dirty(shared)?;
        self.durable_next = self.next_offset();
        self.publish(shared);
        // Sealing before answering keeps the sequence of disk calls a function of the requests
        // alone (the crash tests replay it call by call); the seal is one small unsynced write.
        let idle = shared.options.seal_when_idle && shared.lock().pending.items.is_empty();
        if idle {
            if let Err(error) = self.write_seal(shared, false) {
                // The group is durable and readers already see it: answering it `Stopped` would
                // tell its appenders a lie they act on (the partition owner would never apply
                // records that the log holds and replays). The log stops for the seal's failure
                // (marked before anyone hears of it, see `fail`), the group gets the truth.
                let error = fail(shared, error);
                answer(std::mem::take(group));
                return Err(error);
            }
        }
        if answer_now {
            answer(std::mem::take(group));
        }
        Ok(())
    }

    /// Show readers what is now durable.
    fn publish(&mut self, shared: &Shared) {
        let mut state = shared.lock();
        for segment in self.created.drain(..) {
            state.segments.insert(segment.base, segment);
        }
        for update in self.updates.drain(..) {
            if let Some(segment) = state.segments.get_mut(&update.base) {
                segment.allocated_bytes = update.allocated_bytes;
                segment.end_position = update.end_position;
                segment.next_offset = update.next_offset;
                segment.index.extend(update.entries);
            }
        }
        state.durable_next = self.durable_next;
    }

    /// Seal the active segment and continue in a new one whose first offset is `base`; with no
    /// active segment (a new log, or one that handed its segments back), create the first one
    /// (and the log directory, the first time).
    fn roll(&mut self, shared: &Shared, base: u64) -> StepResult<()> {
        self.flush(shared)?;
        // The records before `base` are durable before the next header exists: recovery reads a
        // valid next segment as proof that this one is whole.
        self.sync_dirty(shared)?;
        if !self.dir_exists {
            create_log_dir(shared).map_err(|e| as_stop(shared, e))?;
            self.dir_exists = true;
        }
        let segment = new_segment(shared, base).map_err(|e| as_stop(shared, e))?;
        // The new name (a rename from the scratch name or from the pool) is synced with the
        // batch, before any of its records is reported durable.
        self.dir_dirty = true;
        let new = Active::from_segment(&segment, SEGMENT_HEADER_SIZE as u64, base);
        self.buf_position = new.position;
        self.active = Some(new);
        self.mark_dirty();
        self.created.push(segment);
        Ok(())
    }

    fn run_op(&mut self, shared: &Shared, op: Item) -> StepResult<Flow> {
        match op {
            Item::Append { .. } => unreachable!("appends are grouped by process"),
            Item::Truncate { offset, reply } => {
                let result = self.truncate(shared, offset).map_err(|e| fail(shared, e));
                reply.send(result.clone());
                result.map(|()| Flow::Continue)
            }
            Item::RemovePrefix { before, reply } => {
                let result = self
                    .remove_prefix(shared, before)
                    .map_err(|e| fail(shared, e));
                reply.send(result.clone());
                result.map(|_| Flow::Continue)
            }
            Item::Roll { reply } => {
                let result = self.explicit_roll(shared).map_err(|e| fail(shared, e));
                reply.send(result.clone());
                result.map(|()| Flow::Continue)
            }
            Item::HandBack { reply } => {
                let result = self.hand_back(shared).map_err(|e| fail(shared, e));
                reply.send(result.clone());
                result.map(|_| Flow::Continue)
            }
            Item::RestartAt { offset, reply } => {
                let result = self.restart_at(shared, offset).map_err(|e| fail(shared, e));
                reply.send(result.clone());
                result.map(|_| Flow::Continue)
            }
            Item::Close { reply } => {
                let result = self.write_seal(shared, true).map_err(|e| fail(shared, e));
                // Answered after every earlier answer is out (see `run_round`).
                self.close_reply = Some((reply, result.clone()));
                result.map(|()| Flow::Exit)
            }
        }
    }

    fn explicit_roll(&mut self, shared: &Shared) -> StepResult<()> {
        if self.active.as_ref().is_none_or(|a| a.next_offset == a.base) {
            return Ok(());
        }
        self.roll(shared, self.next_offset())?;
        self.flush(shared)?;
        self.sync_dirty(shared)?;
        self.publish(shared);
        Ok(())
    }

    /// Write a seal record at the end of the active segment: it claims everything before it
    /// durable, which holds because it is written only after a sync. `sync` at close.
    pub(crate) fn write_seal(&mut self, shared: &Shared, sync: bool) -> StepResult<()> {
        debug_assert!(self.buf.is_empty());
        let Some(active) = &self.active else {
            return Ok(());
        };
        // A seal never allocates: batches leave room for it where the segment has room
        // (`flush`); a file a spare or an older layout left shorter simply gets none.
        if active.position + RECORD_HEADER_SIZE as u64 > active.size_bytes.min(active.allocated) {
            return Ok(());
        }
        let mut seal = Vec::with_capacity(RECORD_HEADER_SIZE);
        let fields = RecordFields {
            offset: active.next_offset,
            generation: active.generation,
            record_type: 0,
            flags: FLAG_SEAL,
            timestamp_ms: 0,
            durable_distance: 0,
        };
        encode_record(&mut seal, &fields, &[]);
        active
            .file
            .write_all_at(&seal, active.position)
            .map_err(stop(shared, "write seal"))?;
        if sync {
            timed_sync(shared, || active.file.sync_data()).map_err(stop(shared, "sync"))?;
        }
        Ok(())
    }

    /// Cut the log at `offset` (see [`crate::Log::truncate_suffix`]). Everything before it is
    /// durable: the writer wrote and synced it before taking this request.
    pub(crate) fn truncate(&mut self, shared: &Shared, offset: u64) -> StepResult<()> {
        if offset == self.next_offset() {
            return Ok(());
        }
        let (victims, target) = {
            let state = shared.lock();
            let first = state.start_offset();
            let victims: Vec<Segment> = state
                .segments
                .range(offset.max(first + 1)..)
                .rev()
                .map(|(_, s)| s.clone())
                .collect();
            let target = state
                .segments
                .range(..=offset)
                .rfind(|(base, _)| **base == first || **base < offset)
                .map(|(_, s)| s.clone());
            (victims, target)
        };
        let target =
            target.ok_or_else(|| LogError::Invalid(format!("no segment holds {offset}")))?;
        self.retire(shared, &victims)?;
        let position = if offset >= target.next_offset {
            target.end_position
        } else {
            locate(&target, offset)?
        };
        let (old_end, allocated) = match &self.active {
            Some(active) if active.base == target.base => (active.position, active.allocated),
            _ => (target.end_position, target.allocated_bytes),
        };
        // The seal record, if one was written, lies just past the old end; nothing lies past
        // the end of the file (writing there would allocate).
        let zero_end = (old_end + RECORD_HEADER_SIZE as u64)
            .min(target.size_bytes)
            .min(allocated);
        // The records from the cut on were durable, and each claims the ones before it: a crash
        // or a failed write part way through the zeroing leaves holes followed by intact
        // claiming records, which recovery would rightly call corruption (found by
        // crash_every_step with EIO on the zeroing write: heal then failed). A mark in the
        // header (inside one sector, so it lands whole) tells recovery that claims past the cut
        // no longer count; it is durable before the zeroing starts and cleared after it.
        let destroys_records = position < old_end;
        if destroys_records {
            write_cut_mark(shared, &target, Some(offset))?;
        }
        zero_range(&target, position, zero_end).map_err(|e| as_stop(shared, e))?;
        if destroys_records {
            write_cut_mark(shared, &target, None)?;
        }
        let mut active = Active::from_segment(&target, position, offset);
        active.allocated = active.allocated.max(allocated);
        self.active = Some(active);
        self.buf_position = position;
        self.durable_next = offset;
        let mut state = shared.lock();
        if let Some(segment) = state.segments.get_mut(&target.base) {
            segment.end_position = position;
            segment.next_offset = offset;
            segment.truncate_index(offset);
        }
        state.durable_next = offset;
        Ok(())
    }

    /// Hand whole segments below `before` to the pool; never the active one.
    fn remove_prefix(&mut self, shared: &Shared, before: u64) -> StepResult<PrefixRemoval> {
        let active_base = self.active.as_ref().map(|a| a.base);
        let victims: Vec<Segment> = {
            let state = shared.lock();
            let bases: Vec<u64> = state.segments.keys().copied().collect();
            bases
                .windows(2)
                .filter(|pair| pair[1] <= before && Some(pair[0]) != active_base)
                .filter_map(|pair| state.segments.get(&pair[0]).cloned())
                .collect()
        };
        self.retire(shared, &victims)?;
        Ok(PrefixRemoval {
            segments: victims.len(),
            bytes: victims.iter().map(|s| s.allocated_bytes).sum(),
        })
    }

    /// Hand every segment, the active one too, to the pool, after making the next offset durable
    /// in the anchor (see [`crate::Log::hand_back`]). Everything queued before is durable: the
    /// group before this request was committed first.
    fn hand_back(&mut self, shared: &Shared) -> StepResult<PrefixRemoval> {
        let Some(active) = self.active.take() else {
            // No segment: the anchor (or offset 0 of a log never written) holds the offset.
            return Ok(PrefixRemoval::default());
        };
        // Put it back until the hand-back is through: a failure stops the log with its state
        // as it is on disk (the segments win over the anchor at recovery).
        let next_offset = active.next_offset;
        let allocated = active.allocated;
        self.active = Some(active);
        debug_assert_eq!(next_offset, self.durable_next);
        write_anchor(shared, next_offset)?;
        let mut victims: Vec<Segment> = shared.lock().segments.values().cloned().collect();
        if let Some(last) = victims.last_mut() {
            // The writer knows the tail's length better than readers do (an allocation after
            // the last publish).
            last.allocated_bytes = last.allocated_bytes.max(allocated);
        }
        // Lowest first (as `retire` is called with them in order): a crash part way leaves a
        // suffix of the log, which still ends at the anchor's offset.
        self.retire(shared, &victims)?;
        self.active = None;
        self.buf_position = 0;
        Ok(PrefixRemoval {
            segments: victims.len(),
            bytes: victims.iter().map(|s| s.allocated_bytes).sum(),
        })
    }

    /// Drop every segment and continue at `offset` (see [`crate::Log::restart_at`]): a
    /// hand-back, then an anchor at `offset`. In this order every crash leaves a state recovery
    /// accepts and that never ends below the current next offset: the hand-back's own outcomes
    /// (the segments, a suffix of them ending at its anchor, or none at its anchor), then the
    /// old anchor or the new one, replaced by a rename. The other order (the new anchor first)
    /// would leave segments that end below their anchor, which recovery rightly calls lost
    /// records.
    fn restart_at(&mut self, shared: &Shared, offset: u64) -> StepResult<PrefixRemoval> {
        let end = self.next_offset();
        // `Log::restart_at` refuses a lower offset when it queues the request, and every request
        // queued before it ends at or below it. Going on would hand out offsets again.
        assert!(
            offset >= end,
            "restart at {offset} below the next offset {end} reached the writer"
        );
        let removed = self.hand_back(shared)?;
        assert!(
            self.active.is_none() && self.durable_next == end,
            "a hand-back leaves no segment and keeps the offsets"
        );
        if offset == end {
            return Ok(removed);
        }
        if !self.dir_exists {
            // Never written: the anchor needs the directory (created as the first segment
            // creates it, its entry synced in the parent).
            create_log_dir(shared).map_err(|e| as_stop(shared, e))?;
            self.dir_exists = true;
        }
        write_anchor(shared, offset)?;
        self.durable_next = offset;
        self.buf_position = 0;
        let mut state = shared.lock();
        debug_assert!(state.segments.is_empty());
        debug_assert!(state.next_offset >= offset);
        state.durable_next = offset;
        Ok(removed)
    }

    /// Remove segments from the log, in the given order, and make the removal durable.
    fn retire(&mut self, shared: &Shared, victims: &[Segment]) -> StepResult<()> {
        if victims.is_empty() {
            return Ok(());
        }
        // Out of the readers' map first: once the pool has a file, another log may write over
        // it at once, and a reader still inside it must find it removed (`LogReader::explain`
        // reads a corruption below the start as `OutOfRange`), not corrupt. A failure below
        // stops the log; the heal finds the files as the disk holds them.
        {
            let mut state = shared.lock();
            for victim in victims {
                state.segments.remove(&victim.base);
            }
        }
        for victim in victims {
            shared
                .pool
                .enter(
                    &victim.path,
                    shared.options.size_class,
                    victim.generation,
                    victim.allocated_bytes,
                )
                .map_err(|e| as_stop(shared, e))?;
        }
        timed_sync(shared, || shared.io.sync_dir(&shared.dir))
            .map_err(stop(shared, "sync directory"))?;
        Ok(())
    }
}

/// Write and sync `segment`'s header with a truncation mark at `cut` (or without one).
fn write_cut_mark(shared: &Shared, segment: &Segment, cut: Option<u64>) -> StepResult<()> {
    let header = SegmentHeader {
        size_class: shared.options.size_class,
        kind: HeaderKind::Segment,
        generation: segment.generation,
        base_offset: segment.base,
        segment_size_bytes: segment.size_bytes,
    };
    let bytes = match cut {
        Some(cut) => header.encode_cutting(cut),
        None => header.encode(),
    };
    segment
        .file
        .write_all_at(&bytes, 0)
        .map_err(stop(shared, "write truncation mark"))?;
    timed_sync(shared, || segment.file.sync_data()).map_err(stop(shared, "sync truncation mark"))
}

/// Write `[from, to)` of `segment` again with what reads show (see `Writer::start`); the caller
/// syncs.
fn rewrite(segment: &Segment, from: u64, to: u64) -> LogResult<()> {
    let mut chunk = vec![0u8; crate::segment::READ_CHUNK_BYTES.min((to - from.min(to)) as usize)];
    let mut position = from;
    while position < to {
        let len = ((to - position) as usize).min(chunk.len());
        let bytes = &mut chunk[..len];
        segment
            .file
            .read_exact_at(bytes, position)
            .map_err(|e| LogError::io("read segment tail", segment.path.clone(), e))?;
        segment
            .file
            .write_all_at(bytes, position)
            .map_err(|e| LogError::io("rewrite segment tail", segment.path.clone(), e))?;
        position += len as u64;
    }
    Ok(())
}

/// Run one sync of a commit worker (`sync_data` or `sync_dir`) and count its time in the
/// pool's histogram, failed or not.
fn timed_sync(shared: &Shared, sync: impl FnOnce() -> Result<(), IoError>) -> Result<(), IoError> {
    let start = Instant::now();
    let result = sync();
    shared.pool.record_sync(start.elapsed());
    result
}

/// Turn an error of a write-path helper into a stop of the log.
fn as_stop(shared: &Shared, error: LogError) -> LogError {
    match error {
        LogError::Io { op, source, .. } => LogError::Stopped {
            dir: shared.dir.clone(),
            op,
            source,
        },
        other => other,
    }
}

/// The error a failed request is answered with: typed as a stop, and already visible in the
/// log's state. Marking the log stopped before anyone hears of the error matters: a caller that
/// gets `Stopped` and calls `heal()` at once must find the log stopped (heal does nothing to a
/// running log, and the log would stop right after), and `Log::stopped()` must agree with the
/// error just returned (found by crash_every_step with EIO on a seal write). `stop_log` then
/// answers whatever is still queued.
fn fail(shared: &Shared, error: LogError) -> LogError {
    let error = as_stop(shared, error);
    let mut state = shared.lock();
    if state.stopped.is_none() {
        state.stopped = Some(error.clone());
        shared.pool.note_log_stopped();
    }
    error
}

/// Answer every request not yet answered with the error that stopped the log.
pub(crate) fn fail_items(items: impl IntoIterator<Item = Item>, error: &LogError) {
    for item in items {
        match item {
            Item::Append { reply, .. } => reply.send(Err(error.clone())),
            Item::Truncate { reply, .. } | Item::Roll { reply } | Item::Close { reply } => {
                reply.send(Err(error.clone()))
            }
            Item::RemovePrefix { reply, .. }
            | Item::HandBack { reply }
            | Item::RestartAt { reply, .. } => reply.send(Err(error.clone())),
        }
    }
}

/// A new segment at `base`: a spare from the pool, renamed in and given its real header (synced
/// with the next batch), or a fresh file prepared under a scratch name, preallocated and synced
/// before it is renamed into place.
fn new_segment(shared: &Shared, base: u64) -> LogResult<Segment> {
    let io = shared.io.as_ref();
    let class = shared.options.size_class;
    let size = shared.options.segment_size_bytes();
    let path = shared.dir.join(segment_file_name(base));
    let header = |generation| SegmentHeader {
        size_class: class,
        kind: HeaderKind::Segment,
        generation,
        base_offset: base,
        segment_size_bytes: size,
    };
    if let Some(spare) = shared.pool.take(&shared.dir, class)? {
        io.rename(&spare.path, &path)
            .map_err(|e| LogError::io("rename spare into log", &path, e))?;
        let file = io
            .open(&path, OpenMode::Existing)
            .map_err(|e| LogError::io("open segment", &path, e))?;
        file.write_all_at(&header(spare.generation).encode(), 0)
            .map_err(|e| LogError::io("write segment header", &path, e))?;
        // A spare keeps the length it had in its log (it grows like any segment from there).
        return Ok(Segment::new(
            path,
            file,
            base,
            spare.generation,
            size,
            spare.size_bytes,
        ));
    }
    let scratch = shared.dir.join(scratch_file_name(base));
    if io
        .exists(&scratch)
        .map_err(|e| LogError::io("stat", &scratch, e))?
    {
        io.remove_file(&scratch)
            .map_err(|e| LogError::io("remove scratch segment", &scratch, e))?;
    }
    let file = io
        .open(&scratch, OpenMode::CreateNew)
        .map_err(|e| LogError::io("create segment", &scratch, e))?;
    let generation = 1;
    // The first preallocation step only: the file grows ahead of the writer (`allocate_for`).
    let allocated = preallocation_target(0, SEGMENT_HEADER_SIZE as u64, size);
    file.allocate(allocated)
        .map_err(|e| LogError::io("preallocate segment", &scratch, e))?;
    file.write_all_at(&header(generation).encode(), 0)
        .map_err(|e| LogError::io("write segment header", &scratch, e))?;
    timed_sync(shared, || file.sync_data())
        .map_err(|e| LogError::io("sync segment", &scratch, e))?;
    io.rename(&scratch, &path)
        .map_err(|e| LogError::io("rename segment into place", &path, e))?;
    Ok(Segment::new(path, file, base, generation, size, allocated))
}

/// Grow the active segment's file by preallocation steps until `needed` bytes fit (never past
/// the segment size). Runs before the write that needs the room; the batch's sync makes the new
/// length durable with the data. A failure (`ENOSPC`) stops the log like a failed write.
fn allocate_for(shared: &Shared, active: &mut Active, needed: u64) -> StepResult<()> {
    let target = preallocation_target(active.allocated, needed, active.size_bytes);
    if target <= active.allocated {
        return Ok(());
    }
    active
        .file
        .allocate(target)
        .map_err(stop(shared, "preallocate"))?;
    active.allocated = target;
    Ok(())
}

/// Create the log directory (the first segment's creation does it: logs are created lazily) and
/// make its entry durable before anything in it is.
fn create_log_dir(shared: &Shared) -> LogResult<()> {
    let io = shared.io.as_ref();
    let dir = &shared.dir;
    if io
        .exists(dir)
        .map_err(|e| LogError::io("stat log directory", dir, e))?
    {
        return Ok(());
    }
    io.create_dir_all(dir)
        .map_err(|e| LogError::io("create log directory", dir, e))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        timed_sync(shared, || io.sync_dir(parent))
            .map_err(|e| LogError::io("sync parent directory", parent, e))?;
    }
    Ok(())
}

/// Write the anchor: under a scratch name, synced, renamed into place, directory synced. Once
/// this returns, a recovery that finds no segment starts at `next_offset`.
fn write_anchor(shared: &Shared, next_offset: u64) -> StepResult<()> {
    let io = shared.io.as_ref();
    let scratch = shared.dir.join(ANCHOR_SCRATCH_FILE_NAME);
    let path = shared.dir.join(ANCHOR_FILE_NAME);
    let step = |op: &'static str| stop(shared, op);
    if io.exists(&scratch).map_err(step("stat anchor"))? {
        io.remove_file(&scratch)
            .map_err(step("remove scratch anchor"))?;
    }
    let file = io
        .open(&scratch, OpenMode::CreateNew)
        .map_err(step("create anchor"))?;
    file.write_all_at(&encode_anchor(next_offset), 0)
        .map_err(step("write anchor"))?;
    timed_sync(shared, || file.sync_data()).map_err(step("sync anchor"))?;
    io.rename(&scratch, &path).map_err(step("rename anchor"))?;
    timed_sync(shared, || io.sync_dir(&shared.dir)).map_err(step("sync directory"))
}

fn answer(batch: AnswerBatch) {
    for (reply, offsets) in batch {
        reply.send(Ok(offsets));
    }
}

/// One turn of a commit worker with a scheduled log: take everything queued, run it as one round
/// (`Writer::process`), and let go of the log. If requests arrived during the round, the log
/// stays scheduled and goes back to the end of its ready queue (every log with work gets one
/// round per turn) *before* this worker answers the round's appenders: another worker can run
/// the next round while this one wakes them (waking dozens of blocked threads one by one took
/// 45% of a commit thread's time at 64 appenders; see `docs/benchmarks.md`). A log that stopped
/// or closed loses its writer here, before it is let go: `close`, `heal` and `delete` wait for
/// that (`Shared::wait_writer_free`).
pub(crate) fn run_round(shared: &Arc<Shared>) {
    let (mut engine, wakers) = {
        let mut state = shared.lock();
        debug_assert!(state.scheduled, "a worker runs only scheduled logs");
        let Some(mut engine) = state.engine.take() else {
            // Stopped or closed since it was queued: `stop_log` answered what was queued.
            release(shared, state);
            return;
        };
        if state.pending.items.is_empty() {
            state.engine = Some(engine);
            release(shared, state);
            return;
        }
        std::mem::swap(&mut state.pending, &mut engine.work);
        engine.start_round();
        (engine, state.room_wakers.take())
    };
    shared.wake_room_waiters(wakers);
    // The answers of the round's last group, sent once the worker has let go of the log.
    let mut answers = AnswerBatch::new();
    let flow = engine
        .writer
        .process(shared, &mut engine.work, &mut answers);
    engine.work.clear();
    shrink_retained(&mut engine.work.payloads);
    match flow {
        Ok(Flow::Continue) => {
            let mut state = shared.lock();
            let more = !state.pending.items.is_empty();
            let deferred = !answers.is_empty();
            if deferred {
                state.answering += 1;
            }
            if !more {
                engine.go_idle(&mut state.pending);
            }
            state.engine = Some(engine);
            if more {
                drop(state);
                shared.workers.push(shared.clone(), deferred);
            } else {
                release(shared, state);
            }
            if deferred {
                answer(answers);
                let mut state = shared.lock();
                state.answering -= 1;
                if state.answering == 0 {
                    drop(state);
                    shared.writer_free.notify_all();
                }
            }
        }
        Ok(Flow::Exit) | Err(_) => {
            if let Err(error) = flow {
                stop_log(shared, error);
            }
            // Every other answer goes out first (the round's, earlier rounds' still being sent
            // by other workers, and `stop_log`'s to what was still queued): the close is
            // answered last.
            if let Some((reply, result)) = engine.writer.close_reply.take() {
                let mut state = shared.lock();
                while state.answering > 0 {
                    state = shared
                        .writer_free
                        .wait(state)
                        .unwrap_or_else(|e| e.into_inner());
                }
                drop(state);
                reply.send(result);
            }
            drop(engine);
            release(shared, shared.lock());
        }
    }
}

/// A round panicked (a bug of ours): stop the log, so that everything queued is answered and a
/// heal can build a new writer, and let go of it. The worker serves the other logs on.
pub(crate) fn abandon_round(shared: &Shared) {
    tracing::error!(dir = %shared.dir.display(), "a commit round panicked");
    // The round's writer was dropped by the unwinding (or never taken): the log has none.
    shared.lock().engine = None;
    stop_log(
        shared,
        LogError::Stopped {
            dir: shared.dir.clone(),
            op: "commit round (panicked)",
            source: IoError::Os(rustix::io::Errno::IO),
        },
    );
    release(shared, shared.lock());
}

/// The worker lets go of the log: it is neither queued nor run any more.
fn release(shared: &Shared, mut state: std::sync::MutexGuard<'_, crate::log::State>) {
    state.scheduled = false;
    drop(state);
    shared.writer_free.notify_all();
}

/// Mark the log stopped and answer everything still queued with the error.
fn stop_log(shared: &Shared, error: LogError) {
    tracing::error!(dir = %shared.dir.display(), %error, "log stopped");
    let items = {
        let mut state = shared.lock();
        // `fail` may have marked the stop already: count each stop once.
        if state.stopped.replace(error.clone()).is_none() {
            shared.pool.note_log_stopped();
        }
        state.pending.bytes = 0;
        state.pending.metas.clear();
        state.pending.payloads.clear();
        (
            std::mem::take(&mut state.pending.items),
            state.room_wakers.take(),
        )
    };
    let (items, wakers) = items;
    fail_items(items, &error);
    shared.wake_room_waiters(wakers);
}
