//! `Log`: the public face of one log. It owns the shared state that appenders, readers and the
//! commit workers meet in; the writing itself is the `Writer`'s (`commit.rs`), run by the pool's
//! commit workers (`workers.rs`), the reading is `reader.rs`'s and the opening is
//! `recovery.rs`'s.

use std::collections::BTreeMap;
use std::future::Future;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use crate::commit::{Engine, Writer};
use crate::error::{LogError, LogResult};
use crate::format::{SizeClass, FLAGS_USER_MASK, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE};
use crate::io::Io;
use crate::pool::{PoolOptions, SegmentPool};
use crate::reader::LogReader;
use crate::recovery::{recover, Trust};
use crate::segment::Segment;
use crate::ticket::{Reply, Ticket};
use crate::workers::WorkerSet;

/// The default size of a full segment: 64 MiB. Large enough that rolling (one file creation
/// and two syncs) is rare at any throughput, small enough that recovery's scan of the last
/// segment stays well under a second and that reclaiming space works in steps of 64 MiB. The
/// small class is one eighth of it, 8 MiB.
pub const DEFAULT_SEGMENT_SIZE_BYTES: u64 = 64 << 20;

/// Smallest configurable full segment size; the small class is then 32 KiB.
pub const MIN_SEGMENT_SIZE_BYTES: u64 = 256 << 10;

/// Largest configurable full segment size: byte positions in the sparse index are `u32`.
pub const MAX_SEGMENT_SIZE_BYTES: u64 = 1 << 32;

/// Appends wait once this many bytes wait for a commit worker: at 64 MiB and a disk that
/// writes 100 MB/s, an appender waits at most about a second for room.
pub const DEFAULT_MAX_PENDING_BYTES: usize = 64 << 20;

/// How a log is opened.
#[derive(Debug, Clone)]
pub struct LogOptions {
    /// Size of a full segment; the log uses it, or one eighth of it for [`SizeClass::Small`].
    pub full_segment_size_bytes: u64,
    /// Which size class this log's segments have.
    pub size_class: SizeClass,
    /// Appends block while more than this many bytes wait to be written.
    pub max_pending_bytes: usize,
    /// Write an unsynced seal record when the log goes idle after a batch, so that recovery can
    /// tell damage to the last synced batch from a torn write more often. Costs one small write
    /// per idle moment, no sync.
    pub seal_when_idle: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            full_segment_size_bytes: DEFAULT_SEGMENT_SIZE_BYTES,
            size_class: SizeClass::Full,
            max_pending_bytes: DEFAULT_MAX_PENDING_BYTES,
            seal_when_idle: true,
        }
    }
}

impl LogOptions {
    /// The size of this log's segment files.
    pub fn segment_size_bytes(&self) -> u64 {
        self.size_class
            .segment_size_bytes(self.full_segment_size_bytes)
    }

    fn validate(&self) -> LogResult<()> {
        let size = self.full_segment_size_bytes;
        if !(MIN_SEGMENT_SIZE_BYTES..=MAX_SEGMENT_SIZE_BYTES).contains(&size)
            || !size.is_multiple_of(32768)
        {
            return Err(LogError::Invalid(format!(
                "segment size {size} bytes: expected a multiple of 32 KiB between \
                 {MIN_SEGMENT_SIZE_BYTES} and {MAX_SEGMENT_SIZE_BYTES}"
            )));
        }
        Ok(())
    }
}

/// One record to append.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    /// Caller-defined type (the broker's record kinds).
    pub record_type: u8,
    /// Caller flags: only the bits of [`FLAGS_USER_MASK`].
    pub flags: u8,
    /// Milliseconds since the Unix epoch, supplied by the caller (state machines take time as an
    /// argument).
    pub timestamp_ms: u64,
    /// The payload.
    pub payload: &'a [u8],
}

/// A record read back from the log, verified (checksum, generation and offset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRecord {
    /// Its offset.
    pub offset: u64,
    /// Its type.
    pub record_type: u8,
    /// Its caller flags.
    pub flags: u8,
    /// Its timestamp.
    pub timestamp_ms: u64,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// Figures of one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentStats {
    /// First offset.
    pub base_offset: u64,
    /// One past its last durable record's offset.
    pub next_offset: u64,
    /// Generation of the file (how many times it has been used).
    pub generation: u16,
    /// Size of the file on disk: what is preallocated so far (a segment file grows in steps
    /// ahead of its records, up to the segment size).
    pub size_bytes: u64,
    /// Bytes holding the header and durable records.
    pub used_bytes: u64,
    /// The file.
    pub path: PathBuf,
}

/// Figures of a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogStats {
    /// First offset held.
    pub start_offset: u64,
    /// One past the last durable offset.
    pub durable_offset: u64,
    /// The offset the next append gets.
    pub next_offset: u64,
    /// The segments, oldest first.
    pub segments: Vec<SegmentStats>,
    /// Sum of the segment files' sizes (allocated bytes; 0 for a log without segments).
    pub disk_bytes: u64,
    /// Whether the log is stopped (see [`Log::heal`]).
    pub stopped: bool,
}

/// What [`Log::remove_prefix`], [`Log::hand_back`] or [`Log::restart_at`] removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixRemoval {
    /// Segments handed to the pool.
    pub segments: usize,
    /// Their size on disk (allocated bytes).
    pub bytes: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordMeta {
    pub(crate) record_type: u8,
    pub(crate) flags: u8,
    pub(crate) timestamp_ms: u64,
    pub(crate) length: u32,
}

#[derive(Debug)]
pub(crate) enum Item {
    Append {
        first_offset: u64,
        count: usize,
        /// Bytes to keep allocated and unwritten in the segment after the batch
        /// ([`Log::append_async_leaving`]); 0 for a plain append.
        leave: u64,
        reply: Reply<Range<u64>>,
    },
    Truncate {
        offset: u64,
        reply: Reply<()>,
    },
    RemovePrefix {
        before: u64,
        reply: Reply<PrefixRemoval>,
    },
    Roll {
        reply: Reply<()>,
    },
    HandBack {
        reply: Reply<PrefixRemoval>,
    },
    RestartAt {
        offset: u64,
        reply: Reply<PrefixRemoval>,
    },
    Close {
        reply: Reply<()>,
    },
}

/// Requests waiting for a commit worker, in arrival order. Record payloads are copied into
/// one buffer so that an append costs one copy and no allocation per record.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub(crate) items: Vec<Item>,
    pub(crate) metas: Vec<RecordMeta>,
    pub(crate) payloads: Vec<u8>,
    pub(crate) bytes: usize,
}

impl Pending {
    /// The capacity its buffers hold.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.items.capacity() * std::mem::size_of::<Item>()
            + self.metas.capacity() * std::mem::size_of::<RecordMeta>()
            + self.payloads.capacity()
    }

    pub(crate) fn clear(&mut self) {
        self.items.clear();
        self.metas.clear();
        self.payloads.clear();
        self.bytes = 0;
    }
}

#[derive(Debug)]
pub(crate) struct State {
    /// What readers see: durable records only.
    pub(crate) segments: BTreeMap<u64, Segment>,
    /// The offset the next append gets.
    pub(crate) next_offset: u64,
    /// Every offset below this one is durable.
    pub(crate) durable_next: u64,
    pub(crate) pending: Pending,
    pub(crate) stopped: Option<LogError>,
    pub(crate) closing: bool,
    /// The write side. Taken out by the worker running a round; `None` for good once the log
    /// stopped (until a heal) or closed.
    pub(crate) engine: Option<Box<Engine>>,
    /// On its file system's ready queue or being run by a worker: one worker at a time holds
    /// the log, and the queue holds it at most once (`workers.rs`).
    pub(crate) scheduled: bool,
    /// `append_async` calls waiting for room under `max_pending_bytes`.
    pub(crate) room_wakers: RoomWakers,
    /// Workers answering an earlier round of this log after letting go of it; the answer to
    /// `close` waits until none is.
    pub(crate) answering: usize,
}

/// Wakers of `append_async` calls waiting for room, each under the id its future holds (so a
/// dropped future removes its own). All are woken when a round takes the pending bytes, and on
/// stop and close; each woken call looks again and registers again if still too large.
#[derive(Debug, Default)]
pub(crate) struct RoomWakers {
    next_id: u64,
    waiting: Vec<(u64, Waker)>,
}

impl RoomWakers {
    fn register(&mut self, id: &mut Option<u64>, waker: &Waker) {
        if let Some(id) = *id {
            if let Some((_, known)) = self.waiting.iter_mut().find(|(i, _)| *i == id) {
                if !known.will_wake(waker) {
                    known.clone_from(waker);
                }
                return;
            }
        }
        self.next_id += 1;
        *id = Some(self.next_id);
        self.waiting.push((self.next_id, waker.clone()));
    }

    fn remove(&mut self, id: u64) {
        self.waiting.retain(|(i, _)| *i != id);
    }

    /// Every waiting waker, to wake once the log's lock is released.
    pub(crate) fn take(&mut self) -> Vec<Waker> {
        std::mem::take(&mut self.waiting)
            .into_iter()
            .map(|(_, waker)| waker)
            .collect()
    }
}

/// Wake what [`RoomWakers::take`] returned.
pub(crate) fn wake_all(wakers: Vec<Waker>) {
    for waker in wakers {
        waker.wake();
    }
}

impl State {
    pub(crate) fn start_offset(&self) -> u64 {
        // Without segments nothing is held: the start is the durable end (appends queued after
        // a hand-back have offsets already, but no segment yet).
        self.segments
            .first_key_value()
            .map_or(self.durable_next, |(base, _)| *base)
    }
}

/// What the commit workers, appenders and readers share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    pub(crate) io: Arc<dyn Io>,
    pub(crate) options: LogOptions,
    pub(crate) pool: SegmentPool,
    pub(crate) state: Mutex<State>,
    /// The commit workers of the log's file system.
    pub(crate) workers: Arc<WorkerSet>,
    /// Signalled when a worker lets go of the log (`scheduled` turns false): close, heal and
    /// delete wait on it.
    pub(crate) writer_free: Condvar,
    /// Signalled when pending bytes drop (blocking appenders over the bound wait on it;
    /// `append_async` waits with `State::room_wakers`).
    pub(crate) space_ready: Condvar,
    /// One heal at a time.
    heal_lock: Mutex<()>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug of ours; the state is still consistent at
        // every unlock point, so keep serving rather than poisoning every later call.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Put the log on its ready queue if `claimed` (see [`State::claim`]); call without the
    /// log's lock.
    fn schedule(self: &Arc<Self>, claimed: bool) {
        if claimed {
            self.workers.push(self.clone(), true);
        }
    }

    /// Wait until no worker holds the log (nothing queued for it either).
    fn wait_writer_free(&self) {
        let mut state = self.lock();
        while state.scheduled {
            state = self
                .writer_free
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wake every appender waiting for room (blocking or async).
    pub(crate) fn wake_room_waiters(&self, wakers: Vec<Waker>) {
        self.space_ready.notify_all();
        wake_all(wakers);
    }
}

impl State {
    /// After queueing a request: mark the log scheduled if it is not; true if the caller must
    /// then put it on the ready queue ([`Shared::schedule`]).
    fn claim(&mut self) -> bool {
        !std::mem::replace(&mut self.scheduled, true)
    }

    fn has_room(&self, batch_bytes: usize, max_pending_bytes: usize) -> bool {
        let pending = self.pending.bytes;
        pending == 0 || pending + batch_bytes <= max_pending_bytes
    }

    /// Assign offsets to an append and queue it; true if the log must be put on its queue.
    fn enqueue_append(
        &mut self,
        records: &[Record<'_>],
        batch_bytes: usize,
        leave: u64,
        reply: Reply<Range<u64>>,
    ) -> bool {
        let first_offset = self.next_offset;
        self.next_offset += records.len() as u64;
        let pending = &mut self.pending;
        for record in records {
            pending.metas.push(RecordMeta {
                record_type: record.record_type,
                flags: record.flags,
                timestamp_ms: record.timestamp_ms,
                length: record.payload.len() as u32,
            });
            pending.payloads.extend_from_slice(record.payload);
        }
        pending.bytes += batch_bytes;
        pending.items.push(Item::Append {
            first_offset,
            count: records.len(),
            leave,
            reply,
        });
        self.claim()
    }
}

/// A segment log: an append-only sequence of records in segment files, with group commit,
/// crash recovery and typed stops on write errors.
///
/// Durability: a record is durable — it survives a process crash and a power loss — once its
/// append [`Ticket`] resolves. Readers see only durable records.
#[derive(Debug)]
pub struct Log {
    shared: Arc<Shared>,
}

impl Log {
    /// Open the log in `dir`, recovering what is there. `pool` is the node's segment pool, or
    /// `None` for a private one.
    ///
    /// Opening a missing or empty directory writes nothing: the directory and the first segment
    /// are created by the first append, on the commit path (`docs/storage-format.md`, "Files of
    /// a log"). Such a log holds no segment and [`Log::disk_bytes`] is 0 until then.
    pub fn open(
        io: Arc<dyn Io>,
        dir: &Path,
        options: LogOptions,
        pool: Option<SegmentPool>,
    ) -> LogResult<Log> {
        options.validate()?;
        let pool = match pool {
            Some(pool) => {
                let pool_size = pool.options().full_segment_size_bytes;
                if pool_size != options.full_segment_size_bytes {
                    return Err(LogError::Invalid(format!(
                        "the segment pool serves {pool_size}-byte segments, the log uses {}",
                        options.full_segment_size_bytes
                    )));
                }
                pool
            }
            None => SegmentPool::private_with(
                io.clone(),
                PoolOptions {
                    full_segment_size_bytes: options.full_segment_size_bytes,
                    ..PoolOptions::default()
                },
            ),
        };
        let workers = pool.commit_set(dir)?;
        let recovered = recover(io.as_ref(), dir, &options, &pool, Trust::Reads)?;
        if recovered.zeroed_bytes > 0 {
            tracing::info!(dir = %dir.display(), bytes = recovered.zeroed_bytes, "recovery zeroed a torn tail");
        }
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            io,
            options,
            pool,
            state: Mutex::new(State {
                segments: BTreeMap::new(),
                next_offset: 0,
                durable_next: 0,
                pending: Pending::default(),
                stopped: None,
                closing: false,
                engine: None,
                scheduled: false,
                room_wakers: RoomWakers::default(),
                answering: 0,
            }),
            workers,
            writer_free: Condvar::new(),
            space_ready: Condvar::new(),
            heal_lock: Mutex::new(()),
        });
        let writer = Writer::start(&shared, recovered)?;
        shared.lock().engine = Some(Engine::new(writer, shared.workers.clone()));
        Ok(Log { shared })
    }

    /// The log's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Append a batch of records. Offsets are assigned at once (see [`Ticket`]); the ticket
    /// resolves with them once a sync covers every record of the batch, or with the error that
    /// stopped the log. Blocks the calling thread while more than `max_pending_bytes` wait for
    /// the disk (in async code use [`Log::append_async`]).
    pub fn append(&self, records: &[Record<'_>]) -> LogResult<Ticket<Range<u64>>> {
        let batch_bytes = self.check_batch(records)?;
        let (reply, ticket) = Ticket::new(self.shared.dir.clone());
        let mut state = self.shared.lock();
        loop {
            Self::check_open(&self.shared, &state)?;
            if state.has_room(batch_bytes, self.shared.options.max_pending_bytes) {
                break;
            }
            state = self
                .shared
                .space_ready
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
        let claimed = state.enqueue_append(records, batch_bytes, 0, reply);
        drop(state);
        self.shared.schedule(claimed);
        Ok(ticket)
    }

    /// [`Log::append`] for async code: waits for room under `max_pending_bytes` without
    /// blocking a thread, then queues the batch and returns its ticket (await that for
    /// durability). Cancellation-safe: a future dropped before it completes has assigned no
    /// offset and queued nothing; once it completes, the batch is queued.
    pub async fn append_async(&self, records: &[Record<'_>]) -> LogResult<Ticket<Range<u64>>> {
        self.append_async_leaving(records, 0).await
    }

    /// [`Log::append_async`] that leaves room behind the batch: once it is durable, at least
    /// `leave` bytes (at most half a segment) past its last record are allocated in the same
    /// segment and still unwritten, so that appends after it that need no more than that room
    /// are written without allocating (on a file system that filled up meanwhile). The batch
    /// starts a new segment when the room does not fit behind it in the current one, unless the
    /// current one is still empty. A failure to allocate the room stops the log like any failed
    /// preallocation: the batch is not durable.
    pub async fn append_async_leaving(
        &self,
        records: &[Record<'_>],
        leave: u64,
    ) -> LogResult<Ticket<Range<u64>>> {
        let batch_bytes = self.check_batch(records)?;
        let leave = leave.min(self.shared.options.segment_size_bytes() / 2);
        AppendWhenRoom {
            shared: &self.shared,
            records,
            batch_bytes,
            leave,
            waker_id: None,
        }
        .await
    }

    /// Append and wait until durable (blocking; see [`Ticket::wait`]).
    pub fn append_sync(&self, records: &[Record<'_>]) -> LogResult<Range<u64>> {
        self.append(records)?.wait()
    }

    fn check_batch(&self, records: &[Record<'_>]) -> LogResult<usize> {
        if records.is_empty() {
            return Err(LogError::Invalid(
                "an append needs at least one record".into(),
            ));
        }
        let room = self.shared.options.segment_size_bytes() - SEGMENT_HEADER_SIZE as u64;
        let mut total = 0usize;
        for record in records {
            if record.flags & !FLAGS_USER_MASK != 0 {
                return Err(LogError::Invalid(format!(
                    "record flags {:#04x}: only the bits {FLAGS_USER_MASK:#04x} are the caller's",
                    record.flags
                )));
            }
            let size = RECORD_HEADER_SIZE as u64 + record.payload.len() as u64;
            if size > room {
                return Err(LogError::RecordTooLarge {
                    size_bytes: size,
                    segment_size_bytes: self.shared.options.segment_size_bytes(),
                });
            }
            total = total.saturating_add(size as usize);
        }
        Ok(total)
    }

    fn check_open(shared: &Shared, state: &State) -> LogResult<()> {
        if let Some(stop) = &state.stopped {
            return Err(stop.clone());
        }
        if state.closing {
            return Err(LogError::Closed {
                dir: shared.dir.clone(),
            });
        }
        Ok(())
    }

    fn submit<T>(
        &self,
        make: impl FnOnce(&mut State, Reply<T>) -> LogResult<Item>,
    ) -> LogResult<Ticket<T>> {
        let (reply, ticket) = Ticket::new(self.shared.dir.clone());
        let mut state = self.shared.lock();
        Self::check_open(&self.shared, &state)?;
        let item = make(&mut state, reply)?;
        state.pending.items.push(item);
        let claimed = state.claim();
        drop(state);
        self.shared.schedule(claimed);
        Ok(ticket)
    }

    /// Remove every record at `offset` and after; appends continue from `offset`. Durable when
    /// the ticket resolves. `offset` must lie between the log's start and its next offset.
    pub fn truncate_suffix(&self, offset: u64) -> LogResult<Ticket<()>> {
        self.submit(|state, reply| {
            let start = state.start_offset();
            if offset < start || offset > state.next_offset {
                return Err(LogError::OutOfRange {
                    offset,
                    start,
                    end: state.next_offset,
                });
            }
            state.next_offset = offset;
            Ok(Item::Truncate { offset, reply })
        })
    }

    /// Hand every whole segment whose records all lie below `before` to the pool (space
    /// reclaim). The last segment is never removed.
    pub fn remove_prefix(&self, before: u64) -> LogResult<Ticket<PrefixRemoval>> {
        self.submit(|_, reply| Ok(Item::RemovePrefix { before, reply }))
    }

    /// Start a new segment at the next offset (after pending appends are durable), unless the
    /// current one is empty.
    pub fn roll(&self) -> LogResult<Ticket<()>> {
        self.submit(|_, reply| Ok(Item::Roll { reply }))
    }

    /// Hand every segment, the tail too, to the pool (an idle log gives its disk space back).
    /// Runs after every append queued before it is durable: it writes and syncs an anchor
    /// holding the next offset, hands the segments over (spare budget and release rules apply)
    /// and syncs the directory. Afterwards the log holds no segment, `start_offset()`,
    /// `durable_offset()` and `next_offset()` are what they were, and the next append creates a
    /// segment at that offset. A crash at any step recovers the state before (or a suffix of
    /// its segments) or after, never a lower next offset. The records are gone for readers:
    /// call it only when nothing needs them. A failure stops the log (heal as usual).
    pub fn hand_back(&self) -> LogResult<Ticket<PrefixRemoval>> {
        self.submit(|_, reply| Ok(Item::HandBack { reply }))
    }

    /// Drop every record and continue at `offset`, which must be at or past `next_offset()`
    /// (a Raft follower that installed a snapshot past its log's end: the log continues there
    /// without one gap record per missing offset).
    ///
    /// Runs after every append queued before it is durable; appends queued after it get offsets
    /// from `offset` on. Afterwards the log holds no segment, `start_offset()`,
    /// `durable_offset()` and `next_offset()` are `offset`, reads below it are `OutOfRange` (as
    /// for a removed prefix), and the next append creates a segment at `offset`. The segments go
    /// to the pool as at a hand-back (spare budget and release rules apply).
    ///
    /// Steps: a hand-back first (see [`Log::hand_back`]: an anchor holding the current next
    /// offset, call it `end`, written and synced; every segment to the pool, lowest first; the
    /// directory synced), then the anchor is replaced by one holding `offset` (scratch file,
    /// synced, renamed, directory synced; the log's directory is created first if the log was
    /// never written). At `offset == next_offset()` it is exactly a hand-back. Nothing new on
    /// disk: the same anchor file.
    ///
    /// A crash or power loss at any step recovers one of:
    /// - the log as it was before;
    /// - a suffix of its segments, still ending at `end` (records the restart was dropping are
    ///   readable again);
    /// - no segment, at `end` (the hand-back done, the new anchor not yet durable);
    /// - no segment, at `offset` (done).
    ///
    /// Never a next offset below `end`, and never records below `offset` once the log is at
    /// `offset`. A caller that must not go on below `offset` (the Raft adapter, which keeps its
    /// snapshot point durably) compares `next_offset()` with it after every open (and heal) and
    /// calls `restart_at` again if the log came back below it.
    ///
    /// Errors: [`LogError::Invalid`] at once if `offset` is below `next_offset()` (which counts
    /// appends queued and not yet durable); the request is then not queued and changes nothing.
    /// A stopped or closing log refuses it as it refuses appends. A failed file operation stops
    /// the log; a heal (or a reopen) finds one of the outcomes above.
    pub fn restart_at(&self, offset: u64) -> LogResult<Ticket<PrefixRemoval>> {
        self.submit(|state, reply| {
            let next = state.next_offset;
            if offset < next {
                return Err(LogError::Invalid(format!(
                    "restart at offset {offset}: below the log's next offset {next} (a restart \
                     only moves a log forward; truncate_suffix cuts it back)"
                )));
            }
            // Appends queued behind it continue from `offset`, as the writer will.
            state.next_offset = offset;
            Ok(Item::RestartAt { offset, reply })
        })
    }

    /// Read one durable record.
    pub fn read(&self, offset: u64) -> LogResult<ReadRecord> {
        let mut reader = LogReader::new(self.shared.clone(), offset, 16 << 10);
        match reader.next() {
            Some(result) => result,
            None => Err(self.out_of_range(offset)),
        }
    }

    /// Iterate over durable records from `offset` on. The iterator ends at the durable end as
    /// it is when it gets there.
    pub fn reader(&self, offset: u64) -> LogReader {
        LogReader::new(
            self.shared.clone(),
            offset,
            crate::segment::READ_CHUNK_BYTES,
        )
    }

    fn out_of_range(&self, offset: u64) -> LogError {
        let state = self.shared.lock();
        LogError::OutOfRange {
            offset,
            start: state.start_offset(),
            end: state.durable_next,
        }
    }

    /// First offset held.
    pub fn start_offset(&self) -> u64 {
        self.shared.lock().start_offset()
    }

    /// One past the last durable offset.
    pub fn durable_offset(&self) -> u64 {
        self.shared.lock().durable_next
    }

    /// The offset the next append gets.
    pub fn next_offset(&self) -> u64 {
        self.shared.lock().next_offset
    }

    /// The error that stopped the log, if it is stopped.
    pub fn stopped(&self) -> Option<LogError> {
        self.shared.lock().stopped.clone()
    }

    /// Bytes of the log's segment files on disk, as allocated (cheaper than [`Log::stats`]).
    pub fn disk_bytes(&self) -> u64 {
        let state = self.shared.lock();
        state.segments.values().map(|s| s.allocated_bytes).sum()
    }

    /// Bytes an append can still write into the tail segment without allocating (as of the
    /// last durable batch): 0 when the log holds no segment. Records that do not fit either
    /// grow the file by a preallocation step or roll to a new segment, both of which need space.
    pub fn tail_room_bytes(&self) -> u64 {
        let state = self.shared.lock();
        state.segments.values().next_back().map_or(0, |s| {
            s.allocated_bytes
                .min(s.size_bytes)
                .saturating_sub(s.end_position)
        })
    }

    /// Size and per-segment figures.
    pub fn stats(&self) -> LogStats {
        let state = self.shared.lock();
        let segments: Vec<SegmentStats> = state
            .segments
            .values()
            .map(|s| SegmentStats {
                base_offset: s.base,
                next_offset: s.next_offset,
                generation: s.generation,
                size_bytes: s.allocated_bytes,
                used_bytes: s.used_bytes(),
                path: s.path.clone(),
            })
            .collect();
        LogStats {
            start_offset: state.start_offset(),
            durable_offset: state.durable_next,
            next_offset: state.next_offset,
            disk_bytes: segments.iter().map(|s| s.size_bytes).sum(),
            segments,
            stopped: state.stopped.is_some(),
        }
    }

    /// Reopen a stopped log: recover its files as at open, cut everything past the last durable
    /// offset (records whose write or sync failed were never reported durable), verify the tail
    /// and take appends again. Nothing is retried in place: Linux reports a writeback error only
    /// once, so the pages of a failed sync cannot be trusted. Does nothing if the log runs.
    ///
    /// **Rebuild from the log after a heal (and after an open), not from the answers.** A caller
    /// that derives state from the records it appended (a partition owner) must rebuild it from
    /// the log's records after every heal and open, because the log may hold durable records
    /// that the caller never got an `Ok` for:
    /// - after [`Log::open`] following a crash: a group whose sync completed just before the
    ///   crash was never answered;
    /// - after [`Log::open`] following a stop in an earlier process: records whose sync failed
    ///   but which the page cache still shows are written again and kept (see
    ///   `docs/storage-format.md`, "Recovery after a failed sync"), though they were answered
    ///   `Stopped`;
    /// - after a heal: every record kept was published durable, and its append is answered `Ok`
    ///   (a failed idle-seal write after a durable group answers the group `Ok` and stops the
    ///   log), but the answer of the last group may still be on its way to the caller when the
    ///   caller sees the stop and heals.
    ///
    /// Records past the last durable offset (answered `Stopped`, including the part of a group
    /// that a roll's sync covered before a later write failed) are cut by the heal. A log that
    /// holds no segment keeps the offset its anchor names, even past the last durable offset: a
    /// [`Log::restart_at`] whose anchor was written before a later step failed.
    pub fn heal(&self) -> LogResult<()> {
        let _one_heal = self
            .shared
            .heal_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let durable_next = {
            let state = self.shared.lock();
            if state.stopped.is_none() {
                return Ok(());
            }
            state.durable_next
        };
        // The worker that stopped the log may still be finishing its round; once it lets go,
        // the stopped log's writer is gone and nothing schedules the log again (every request
        // is refused while it is stopped).
        self.shared.wait_writer_free();
        let shared = &self.shared;
        let recovered = recover(
            shared.io.as_ref(),
            &shared.dir,
            &shared.options,
            &shared.pool,
            Trust::NothingPastTheEnd,
        )?;
        let mut writer = Writer::start(shared, recovered)?;
        // A log without segments past the durable end is a restart whose anchor became durable
        // before a later step failed (its final directory sync): it holds no record to cut, and
        // its offset must stay, as the disk has it (found by the restart sweeps of
        // crash_every_step and power_loss: EIO at that sync, then the heal failed).
        if writer.next_offset() > durable_next && writer.holds_segment() {
            writer.truncate(shared, durable_next)?;
        }
        {
            let mut state = shared.lock();
            debug_assert!(!state.scheduled && state.pending.items.is_empty());
            state.next_offset = writer.next_offset();
            state.engine = Some(Engine::new(writer, shared.workers.clone()));
            state.stopped = None;
        }
        shared.pool.note_log_healed();
        tracing::info!(dir = %shared.dir.display(), durable_offset = durable_next, "log healed");
        Ok(())
    }

    /// Close the log: pending appends are completed, a seal record is written and synced, and
    /// the log's files are closed.
    pub fn close(self) -> LogResult<()> {
        self.close_inner()
    }

    fn close_inner(&self) -> LogResult<()> {
        let (ticket, claimed, wakers) = {
            let (reply, ticket) = Ticket::new(self.shared.dir.clone());
            let mut state = self.shared.lock();
            if state.closing {
                return Ok(());
            }
            state.closing = true;
            let wakers = state.room_wakers.take();
            if state.stopped.is_some() {
                (None, false, wakers)
            } else {
                state.pending.items.push(Item::Close { reply });
                (Some(ticket), state.claim(), wakers)
            }
        };
        self.shared.schedule(claimed);
        self.shared.wake_room_waiters(wakers);
        let result = ticket.map_or(Ok(()), Ticket::wait);
        // The worker drops the writer (closing the files) before it lets go of the log.
        self.shared.wait_writer_free();
        if self.shared.pool.is_private() {
            // Segments this log handed to its private pool are still being prepared on the
            // pool's thread: a reopen's new private pool would adopt the same files while that
            // thread renames them (found by tests/idle.rs: hand back, close, reopen, append).
            self.shared.pool.flush();
        }
        result
    }

    /// Delete the log: close it, hand every segment to the pool and remove its directory.
    pub fn delete(self) -> LogResult<()> {
        self.close_inner()?;
        let shared = &self.shared;
        let segments: Vec<Segment> = {
            let mut state = shared.lock();
            std::mem::take(&mut state.segments).into_values().collect()
        };
        let io = shared.io.as_ref();
        if !io
            .exists(&shared.dir)
            .map_err(|e| LogError::io("stat log directory", &shared.dir, e))?
        {
            // Never written: the directory was never created (see `Log::open`).
            return Ok(());
        }
        let anchor = shared.dir.join(crate::segment::ANCHOR_FILE_NAME);
        if io
            .exists(&anchor)
            .map_err(|e| LogError::io("stat", &anchor, e))?
        {
            // First: once segments go, highest first, the ones left end below the anchor,
            // which a recovery would rightly call damage.
            io.remove_file(&anchor)
                .map_err(|e| LogError::io("remove anchor", &anchor, e))?;
        }
        // Highest first: a crash part way leaves a shorter log, never one with a gap.
        for segment in segments.iter().rev() {
            shared.pool.enter(
                &segment.path,
                shared.options.size_class,
                segment.generation,
                segment.allocated_bytes,
            )?;
        }
        io.sync_dir(&shared.dir)
            .map_err(|e| LogError::io("sync log directory", &shared.dir, e))?;
        let spares = shared.dir.join(crate::pool::SPARES_DIR_NAME);
        if io
            .exists(&spares)
            .map_err(|e| LogError::io("stat", &spares, e))?
        {
            // A private pool's worker may be preparing the segments that just entered it (it
            // renames `*.incoming` to `*.spare`): let it finish before listing, or a listed
            // name is gone when it is removed.
            shared.pool.flush();
            for name in io
                .read_dir(&spares)
                .map_err(|e| LogError::io("list", &spares, e))?
            {
                let path = spares.join(name);
                io.remove_file(&path)
                    .map_err(|e| LogError::io("remove private spare", &path, e))?;
            }
            io.remove_dir(&spares)
                .map_err(|e| LogError::io("remove spares directory", &spares, e))?;
        }
        // Files a failed round left behind, never published: a segment created by a roll whose
        // batch then failed (its allocation hit a full disk), a segment or an anchor still under
        // its scratch name. Anything else is not the log's: the removal below fails on it.
        for name in io
            .read_dir(&shared.dir)
            .map_err(|e| LogError::io("list", &shared.dir, e))?
        {
            let ours = crate::segment::parse_segment_file_name(&name).is_some()
                || crate::segment::is_scratch_file_name(&name)
                || name == crate::segment::ANCHOR_SCRATCH_FILE_NAME;
            if ours {
                let path = shared.dir.join(&name);
                io.remove_file(&path)
                    .map_err(|e| LogError::io("remove leftover segment", &path, e))?;
            }
        }
        io.remove_dir(&shared.dir)
            .map_err(|e| LogError::io("remove log directory", &shared.dir, e))?;
        if let Some(parent) = shared.dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            io.sync_dir(parent)
                .map_err(|e| LogError::io("sync parent directory", parent, e))?;
        }
        Ok(())
    }

    /// The pool this log takes spares from and returns segments to.
    pub fn pool(&self) -> &SegmentPool {
        &self.shared.pool
    }
}

/// The future of [`Log::append_async`]: queues the batch the first time it finds room (under the
/// log's lock, so offsets are assigned only together with the queued item), otherwise leaves
/// its waker in `State::room_wakers` and removes it when dropped.
struct AppendWhenRoom<'a, 'r> {
    shared: &'a Arc<Shared>,
    records: &'a [Record<'r>],
    batch_bytes: usize,
    leave: u64,
    waker_id: Option<u64>,
}

impl Future for AppendWhenRoom<'_, '_> {
    type Output = LogResult<Ticket<Range<u64>>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let shared = this.shared;
        let mut state = shared.lock();
        if let Err(error) = Log::check_open(shared, &state) {
            if let Some(id) = this.waker_id.take() {
                state.room_wakers.remove(id);
            }
            return Poll::Ready(Err(error));
        }
        if !state.has_room(this.batch_bytes, shared.options.max_pending_bytes) {
            state.room_wakers.register(&mut this.waker_id, cx.waker());
            return Poll::Pending;
        }
        if let Some(id) = this.waker_id.take() {
            state.room_wakers.remove(id);
        }
        let (reply, ticket) = Ticket::new(shared.dir.clone());
        let claimed = state.enqueue_append(this.records, this.batch_bytes, this.leave, reply);
        drop(state);
        shared.schedule(claimed);
        Poll::Ready(Ok(ticket))
    }
}

impl Drop for AppendWhenRoom<'_, '_> {
    fn drop(&mut self) {
        if let Some(id) = self.waker_id.take() {
            self.shared.lock().room_wakers.remove(id);
        }
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        if let Err(e) = self.close_inner() {
            tracing::warn!(dir = %self.shared.dir.display(), error = %e, "closing log on drop");
        }
    }
}
