//! The owner task of one stream partition on a single node: the only code that appends to its
//! payload log (`docs/streams.md`). It asks the publish gate, skips an idempotent producer's
//! duplicates, writes a checkpoint when one is due, applies what the log commits to the
//! [`StreamPartitionState`], runs retention, and stops and heals the log after a write error
//! (the proposals' order, the role, following and the stop/heal phase are its
//! [`LogDriver`]'s).
//! Readers do not go through it: [`StreamPartition::read`] reads committed records on the
//! blocking pool, so reading is never held up by appends, by the gate or by a stopped log.
//!
//! Order: appends are proposed in arrival order; a slowed append holds the ones after it (a
//! producer's messages keep their order), and a due checkpoint holds new appends until every
//! record proposed before it is applied (it describes the applied state at its offset).
//!
//! On a replicated log (`keratin-raft`) only the leader's owner appends; a follower's owner
//! applies what the leader committed, and a new leader appends only once it applied every
//! record an earlier leader wrote (`partition/follow.rs`). Each replica runs retention on its
//! own copy, never above what it applied.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

use crate::error::{BrokerError, BrokerResult};
use crate::gate::{GateDecision, PublishGate};
use crate::partition::driver::{LogDriver, Pending};
use crate::partition::log::{is_storage_failure, LogEvent, LogEvents, PartitionLog, Proposal};
use crate::partition::producers::Verdict;
use crate::record::Message;
use crate::stream::rebuild::rebuild;
use crate::stream::records::{StreamRecord, StreamSettings, STREAM_CHECKPOINT, STREAM_MESSAGE};
use crate::stream::retention::{decide, Bound, Removal, RetentionBounds, SegmentFacts};
use crate::stream::state::StreamPartitionState;
use crate::stream::CHECKPOINT_INTERVAL_DIVISOR;

mod follow;

/// Most proposals handed to the log and not yet committed; more appends wait in the owner's
/// queue (bounds the submitter's channel and what a stalled disk holds in memory).
const PROPOSALS_IN_FLIGHT_MAX: usize = 64;
/// A retention pass a slowed append started, that removed nothing, is not run again for
/// a slowed append within this time (the timer's passes go on).
const SLOWED_RETENTION_PAUSE: Duration = Duration::from_secs(1);
/// Most messages or bytes one [`StreamPartition::read`] returns.
pub const READ_MESSAGES_MAX: usize = 4096;

/// Where a partition lives and how it is bounded.
#[derive(Debug, Clone)]
pub struct StreamPartitionConfig {
    /// The stream (in errors and logs).
    pub stream: String,
    /// Its index.
    pub index: u32,
    /// Its log's directory (names it in attention items).
    pub dir: std::path::PathBuf,
    /// The file system of its log (the gate's `device`).
    pub device: u64,
    /// Its log's segment size.
    pub segment_bytes: u64,
    /// The stream's settings.
    pub settings: StreamSettings,
    /// Run a retention pass each half segment written (a node's streams do; tests of explicit
    /// passes turn it off).
    pub retention_as_written: bool,
}

/// What an append did with each message, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// Stored at this offset.
    Stored(u64),
    /// An idempotent producer's message stored already: confirmed, not stored again.
    Duplicate,
}

/// One message read from a partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// Its offset.
    pub offset: u64,
    /// When the partition appended it.
    pub timestamp_ms: u64,
    /// The message.
    pub message: Message,
}

/// What a read returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRead {
    /// The position asked for was below the partition's start (retention removed it): the
    /// read started at the start instead, named here as the position asked for.
    pub moved_from: Option<u64>,
    /// The messages, in offset order.
    pub messages: Vec<StreamMessage>,
    /// Where the next read continues.
    pub next: u64,
}

/// A partition's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamPartitionFigures {
    /// Where a read from the first message begins: the offset of the oldest message held, or
    /// the end when it holds none. Records before it that are no messages (a replicated log's
    /// own entries, a checkpoint) are not counted as held.
    pub start: u64,
    /// One past the last committed offset.
    pub end: u64,
    /// Payload bytes appended over the partition's history.
    pub bytes_appended: u64,
    /// Messages held now (between the start and the end).
    pub messages: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// When the oldest message held was appended; `None` when it holds none.
    pub oldest_timestamp_ms: Option<u64>,
    /// Bytes of its log's segments on disk.
    pub disk_bytes: u64,
    /// Segments retention removed since the partition opened, and their bytes.
    pub removed_segments: u64,
    /// Their bytes.
    pub removed_bytes: u64,
    /// The same by the bound that removed them: size, age, count (see [`Bound`]), each
    /// (segments, bytes).
    pub removed_by_bound: [(u64, u64); 3],
    /// Whether the log is stopped (a write failed; healing when the disk allows).
    pub stopped: bool,
    /// Times its log stopped since the partition opened.
    pub stops: u64,
    /// Times its log healed since the partition opened.
    pub heals: u64,
    /// This node leads the partition (always, on a single node).
    pub leading: bool,
    /// The leader's node id, when another node leads and it is known.
    pub leader: Option<u64>,
}

enum Command {
    Append {
        messages: Vec<Message>,
        timestamp_ms: u64,
        reply: oneshot::Sender<BrokerResult<Vec<Appended>>>,
    },
    /// The slowed append at the head of the queue may go now.
    Resume,
    /// A retention pass run for a slowed append is done (`removed`: it freed something).
    SlowedRetentionDone {
        removed: bool,
        delay_ms: u64,
    },
    Settings(StreamSettings),
    Log(LogEvent),
    ProposeFailed {
        sequence: u64,
        error: BrokerError,
    },
    Retention {
        now_ms: u64,
        reply: oneshot::Sender<BrokerResult<Option<Removal>>>,
    },
    RetentionDone {
        result: BrokerResult<Option<(Removal, Held)>>,
        reply: oneshot::Sender<BrokerResult<Option<Removal>>>,
    },
    HealTick,
    Healed {
        result: BrokerResult<(StreamPartitionState, Held)>,
    },
    /// Records another node proposed, read for applying from `from` (`partition/follow.rs`).
    Followed {
        from: u64,
        result: BrokerResult<Vec<follow::Foreign>>,
    },
    /// The state rebuilt after the log restarted past it (a snapshot installed).
    Restarted {
        result: BrokerResult<(StreamPartitionState, Held)>,
    },
    /// The grace after this node stopped leading may have ended (`LogDriver::grace_expired`
    /// tells).
    StepDownGrace,
    Close {
        reply: oneshot::Sender<BrokerResult<()>>,
        /// Delete this node's copy of the log instead of closing it (the stream is deleted).
        delete: bool,
    },
}

/// A handle on one stream partition's owner task.
#[derive(Clone)]
pub struct StreamPartition {
    commands: mpsc::UnboundedSender<Command>,
    log: Arc<dyn PartitionLog>,
    figures: Arc<Mutex<StreamPartitionFigures>>,
    config: Arc<StreamPartitionConfig>,
    /// One past the last applied offset, for readers waiting at the end.
    end: watch::Receiver<u64>,
}

impl std::fmt::Debug for StreamPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPartition")
            .field("stream", &self.config.stream)
            .field("index", &self.config.index)
            .finish()
    }
}

impl StreamPartition {
    /// Rebuilds the partition in `log` (on the blocking pool) and starts its owner task.
    pub async fn open(
        log: Arc<dyn PartitionLog>,
        gate: Arc<dyn PublishGate>,
        config: StreamPartitionConfig,
    ) -> BrokerResult<StreamPartition> {
        config.settings.validate()?;
        let reading = log.clone();
        let (rebuilt, held) = tokio::task::spawn_blocking(move || {
            let rebuilt = rebuild(reading.as_ref())?;
            let held = Held::read(reading.as_ref())?;
            Ok::<_, BrokerError>((rebuilt, held))
        })
        .await
        .map_err(|e| BrokerError::Closed(format!("stream partition rebuild: {e}")))??;
        let (commands, receiver) = mpsc::unbounded_channel();
        let events = commands.clone();
        log.start(LogEvents::new(move |event| {
            let _ = events.send(Command::Log(event));
        }));
        let settings = config.settings;
        let config = Arc::new(config);
        let figures = Arc::new(Mutex::new(StreamPartitionFigures::default()));
        let (end_sender, end) = watch::channel(log.committed_offset());
        let submit = spawn_submitter(log.clone(), commands.clone());
        let owner = Owner {
            submit,
            config: config.clone(),
            settings,
            end: end_sender,
            slowed_retention_after: None,
            held,
            retention_mark: 0,
            log: log.clone(),
            gate,
            state: rebuilt.state,
            commands: commands.clone(),
            figures: figures.clone(),
            waiting: VecDeque::new(),
            slowed: false,
            head_delayed: false,
            driver: LogDriver::new(0),
            inflight_marks: HashSet::new(),
            retention_busy: false,
            closing: None,
            sealed: Arc::new(Mutex::new(BTreeMap::new())),
            following: false,
            restarting: false,
        };
        owner.publish_figures();
        tokio::spawn(owner.run(receiver));
        Ok(StreamPartition {
            commands,
            log,
            figures,
            config,
            end,
        })
    }

    /// Hands `messages` to the owner now (two calls reach it in call order) and returns what
    /// waits for their outcome (as [`StreamPartition::append`]).
    pub fn dispatch(
        &self,
        messages: Vec<Message>,
        timestamp_ms: u64,
    ) -> oneshot::Receiver<BrokerResult<Vec<Appended>>> {
        let (reply, answer) = oneshot::channel();
        if let Err(mpsc::error::SendError(Command::Append { reply, .. })) =
            self.commands.send(Command::Append {
                messages,
                timestamp_ms,
                reply,
            })
        {
            let _ = reply.send(Err(self.closed()));
        }
        answer
    }

    /// Changes the retention the partition's passes use from now on.
    pub fn set_settings(&self, settings: StreamSettings) -> BrokerResult<()> {
        settings.validate()?;
        self.send(Command::Settings(settings))
    }

    /// Its index in the stream.
    pub fn index(&self) -> u32 {
        self.config.index
    }

    /// Watches one past the last applied offset (readers wait on it at the end).
    pub fn watch_end(&self) -> watch::Receiver<u64> {
        self.end.clone()
    }

    /// The offset of the first message appended at or after `timestamp_ms` (the end when
    /// none is): found by the segments' first records, then a scan of one segment (blocking
    /// work on the blocking pool).
    pub async fn offset_at(&self, timestamp_ms: u64) -> BrokerResult<u64> {
        let log = self.log.clone();
        tokio::task::spawn_blocking(move || offset_at(log.as_ref(), timestamp_ms))
            .await
            .map_err(|e| BrokerError::Closed(format!("stream offset lookup: {e}")))?
    }

    /// Appends `messages` (at `timestamp_ms`), answered once they are durable: each stored at
    /// an offset, or found stored already (an idempotent producer's retry).
    pub async fn append(
        &self,
        messages: Vec<Message>,
        timestamp_ms: u64,
    ) -> BrokerResult<Vec<Appended>> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Append {
            messages,
            timestamp_ms,
            reply,
        })?;
        answer.await.map_err(|_| self.closed())?
    }

    /// Reads up to `max_messages` (at most [`READ_MESSAGES_MAX`]) and about `max_bytes` of
    /// committed messages from `from` (a position below the start is moved to it and said
    /// so). Never waits for appends or the gate; works while the log is stopped.
    pub async fn read(
        &self,
        from: u64,
        max_messages: usize,
        max_bytes: usize,
    ) -> BrokerResult<StreamRead> {
        let log = self.log.clone();
        let max_messages = max_messages.clamp(1, READ_MESSAGES_MAX);
        tokio::task::spawn_blocking(move || read(log.as_ref(), from, max_messages, max_bytes))
            .await
            .map_err(|e| BrokerError::Closed(format!("stream read: {e}")))?
    }

    /// Runs a retention pass at `now_ms`: what it removed.
    pub async fn retention(&self, now_ms: u64) -> BrokerResult<Option<Removal>> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Retention { now_ms, reply })?;
        answer.await.map_err(|_| self.closed())?
    }

    /// Whether this node leads the partition, as its log last reported (always on one node).
    pub(crate) fn is_leading(&self) -> bool {
        self.figures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .leading
    }

    /// The partition's figures (as of its last change).
    pub fn figures(&self) -> StreamPartitionFigures {
        let mut figures = *self.figures.lock().unwrap_or_else(|p| p.into_inner());
        // The oldest message as the owner last published it (u64::MAX: none), within what the
        // log holds and has committed now.
        figures.end = self.log.committed_offset();
        figures.start = figures.start.max(self.log.start_offset()).min(figures.end);
        figures.disk_bytes = self.log.disk_bytes();
        figures
    }

    /// Its log's directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.config.dir
    }

    /// Ends the owner once what is in flight is answered (waiting appends are refused) and
    /// closes the log. Fails, leaving the log open until the last handle goes, while another
    /// handle of this partition still exists.
    pub async fn close(self) -> BrokerResult<()> {
        self.stop(false).await
    }

    /// As [`StreamPartition::close`], then deletes this node's copy of the log (the stream is
    /// deleted).
    pub async fn delete(self) -> BrokerResult<()> {
        self.stop(true).await
    }

    async fn stop(self, delete: bool) -> BrokerResult<()> {
        let StreamPartition {
            commands,
            log,
            config,
            end,
            ..
        } = self;
        drop(end);
        drop(log);
        let (reply, answer) = oneshot::channel();
        commands
            .send(Command::Close { reply, delete })
            .map_err(|_| closed_error(&config))?;
        answer.await.map_err(|_| closed_error(&config))?
    }

    fn send(&self, command: Command) -> BrokerResult<()> {
        self.commands.send(command).map_err(|_| self.closed())
    }

    fn closed(&self) -> BrokerError {
        closed_error(&self.config)
    }
}

fn closed_error(config: &StreamPartitionConfig) -> BrokerError {
    BrokerError::Closed(format!(
        "stream {:?} partition {}",
        config.stream, config.index
    ))
}

/// The task that hands proposals to `log` in the order received; a proposal the log refuses
/// is reported to the owner. Ends when the owner drops its sender.
fn spawn_submitter(
    log: Arc<dyn PartitionLog>,
    commands: mpsc::UnboundedSender<Command>,
) -> mpsc::Sender<Proposal> {
    let (submit, mut proposals) = mpsc::channel::<Proposal>(PROPOSALS_IN_FLIGHT_MAX);
    tokio::spawn(async move {
        while let Some(proposal) = proposals.recv().await {
            let sequence = proposal.sequence;
            if let Err(error) = log.clone().propose(proposal).await {
                let _ = commands.send(Command::ProposeFailed { sequence, error });
            }
        }
    });
    submit
}

/// Closes `log` once this is its last handle: a read in flight holds it for a moment, so
/// this waits up to a second for those.
async fn close_when_unshared(log: Arc<dyn PartitionLog>, delete: bool) -> BrokerResult<()> {
    for _ in 0..20 {
        if Arc::strong_count(&log) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::task::spawn_blocking(move || if delete { log.delete() } else { log.close() })
        .await
        .map_err(|e| BrokerError::Closed(format!("closing a stream partition: {e}")))?
}

/// What retention removed below a partition's start, found from the first checkpoint at or
/// after the start (retention keeps the oldest segment only when it holds one), and the time
/// of the oldest message held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    messages_below: u64,
    bytes_below: u64,
    oldest: Option<Oldest>,
}

/// The oldest message a partition holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Oldest {
    offset: u64,
    timestamp_ms: u64,
}

impl Held {
    /// A message was applied at `offset`: the oldest held, if none was.
    fn saw_message(&mut self, offset: u64, timestamp_ms: u64) {
        self.oldest.get_or_insert(Oldest {
            offset,
            timestamp_ms,
        });
    }

    /// Reads from the start to the first checkpoint (a quarter segment at most; blocking).
    fn read(log: &dyn PartitionLog) -> BrokerResult<Held> {
        let start = log.start_offset();
        let end = log.committed_offset();
        let mut held = Held::default();
        let (mut messages, mut bytes) = (0u64, 0u64);
        for record in log.reader(start) {
            let record = record?;
            if record.offset >= end {
                break;
            }
            match record.record_type {
                STREAM_MESSAGE => {
                    held.saw_message(record.offset, record.timestamp_ms);
                    messages += 1;
                    bytes += record.payload.len() as u64;
                }
                STREAM_CHECKPOINT => {
                    if let StreamRecord::Checkpoint(checkpoint) =
                        StreamRecord::decode(record.record_type, &record.payload, record.offset)?
                    {
                        held.messages_below = checkpoint.messages.saturating_sub(messages);
                        held.bytes_below = checkpoint.bytes.saturating_sub(bytes);
                    }
                    // The oldest message, if none came before the checkpoint, follows it.
                    if held.oldest.is_some() {
                        break;
                    }
                    held.oldest = first_message(log, record.offset + 1, end)?;
                    break;
                }
                _ => {}
            }
        }
        Ok(held)
    }
}

/// The first message in `from..end` (blocking).
fn first_message(log: &dyn PartitionLog, from: u64, end: u64) -> BrokerResult<Option<Oldest>> {
    for record in log.reader(from) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        if record.record_type == STREAM_MESSAGE {
            return Ok(Some(Oldest {
                offset: record.offset,
                timestamp_ms: record.timestamp_ms,
            }));
        }
    }
    Ok(None)
}

/// The first offset at or after `timestamp_ms` (blocking; see [`StreamPartition::offset_at`]).
fn offset_at(log: &dyn PartitionLog, timestamp_ms: u64) -> BrokerResult<u64> {
    let start = log.start_offset();
    let end = log.committed_offset();
    let space = log.space();
    // The last segment whose first record is older than the time: the first message at or
    // after it is there or at the next segment's base.
    let mut from = start;
    for &base in &space.segment_bases {
        let base = base.max(start);
        if base >= end {
            break;
        }
        match log.reader(base).next() {
            Some(record) => {
                if record?.timestamp_ms >= timestamp_ms {
                    break;
                }
                from = base;
            }
            None => break,
        }
    }
    for record in log.reader(from) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        if record.record_type == STREAM_MESSAGE && record.timestamp_ms >= timestamp_ms {
            return Ok(record.offset);
        }
    }
    Ok(end)
}

/// Reads committed messages from `from` (blocking).
fn read(
    log: &dyn PartitionLog,
    from: u64,
    max_messages: usize,
    max_bytes: usize,
) -> BrokerResult<StreamRead> {
    let start = log.start_offset();
    let end = log.committed_offset();
    let (position, moved_from) = if from < start {
        (start, Some(from))
    } else {
        (from, None)
    };
    let mut out = StreamRead {
        moved_from,
        messages: Vec::new(),
        next: position,
    };
    if position >= end {
        return Ok(out);
    }
    let mut bytes = 0usize;
    for record in log.reader(position) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        out.next = record.offset + 1;
        if record.record_type != STREAM_MESSAGE {
            continue;
        }
        bytes += record.payload.len();
        let message = Message::decode(&record.payload, record.offset)?;
        out.messages.push(StreamMessage {
            offset: record.offset,
            timestamp_ms: record.timestamp_ms,
            message,
        });
        if out.messages.len() >= max_messages || bytes >= max_bytes {
            break;
        }
    }
    Ok(out)
}

/// An append waiting for the gate or for a checkpoint.
struct Waiting {
    messages: Vec<Message>,
    timestamp_ms: u64,
    reply: oneshot::Sender<BrokerResult<Vec<Appended>>>,
}

/// The owner's part of a proposal in flight (its order and outcome are the driver's).
struct Inflight {
    records: Vec<(StreamRecord, Vec<u8>)>,
    timestamp_ms: u64,
    /// What each message of the append became: `None` for a record written, in order.
    outcome: Vec<Option<Appended>>,
    /// Whom to answer; `None` once the step-down grace answered it as unknown.
    reply: Option<oneshot::Sender<BrokerResult<Vec<Appended>>>>,
}

struct Owner {
    /// Hands proposals to the log one after another, in the order given (a spawned task
    /// per proposal would reach the log in whatever order the tasks ran).
    submit: mpsc::Sender<Proposal>,
    config: Arc<StreamPartitionConfig>,
    /// The stream's retention now (`config.settings` as opened, then changes).
    settings: StreamSettings,
    end: watch::Sender<u64>,
    /// A slowed append's retention pass removed nothing: none again before this.
    slowed_retention_after: Option<tokio::time::Instant>,
    /// What lies below the start (retention removed it), for the figures of what is held.
    held: Held,
    /// `state.bytes()` when the last pass of its own started: a pass runs each half segment
    /// written, so a fast writer does not outrun the timer's passes by more than that.
    retention_mark: u64,
    log: Arc<dyn PartitionLog>,
    gate: Arc<dyn PublishGate>,
    state: StreamPartitionState,
    commands: mpsc::UnboundedSender<Command>,
    figures: Arc<Mutex<StreamPartitionFigures>>,
    /// Appends in arrival order, not yet proposed.
    waiting: VecDeque<Waiting>,
    /// The head of `waiting` sleeps on the gate's delay.
    slowed: bool,
    /// The head of `waiting` was slowed once already: after its delay it goes unless the gate
    /// refuses it (slowing delays an append once, as it does a queue's publish).
    head_delayed: bool,
    /// The proposals in flight, the role, what is committed, stop and heal.
    driver: LogDriver<Inflight>,
    /// Idempotent producers' marks proposed and not applied yet (so a retry racing its first
    /// attempt is a duplicate too).
    inflight_marks: HashSet<(u64, u64)>,
    retention_busy: bool,
    /// A close waiting for what is in flight.
    /// Where to answer the close, and whether the log is deleted rather than closed.
    closing: Option<(oneshot::Sender<BrokerResult<()>>, bool)>,
    /// Facts of sealed segments (they never change), by base offset, so a retention pass
    /// reads only segments it has not seen.
    sealed: Arc<Mutex<BTreeMap<u64, Sealed>>>,
    /// A read of records to follow is running.
    following: bool,
    /// A rebuild after the log restarted past the state is running.
    restarting: bool,
}

/// What retention read of a sealed segment.
#[derive(Debug, Clone, Copy)]
struct Sealed {
    newest_timestamp_ms: Option<u64>,
    checkpointed: bool,
}

impl Owner {
    async fn run(mut self, mut receiver: mpsc::UnboundedReceiver<Command>) {
        while let Some(command) = receiver.recv().await {
            match command {
                Command::Append {
                    messages,
                    timestamp_ms,
                    reply,
                } => {
                    if !self.driver.role().leading {
                        let _ = reply.send(Err(self.not_leader()));
                        continue;
                    }
                    if let Some(stopped) = self.driver.stopped() {
                        // Refused at once: the log heals in the background.
                        let _ = reply.send(Err(BrokerError::Unavailable {
                            queue: self.config.stream.clone(),
                            partition: self.config.index,
                            source: keratin_log::LogError::Invalid(format!(
                                "the log stopped after a write failed ({stopped}); it heals \
                                 once the disk has room, retry then"
                            )),
                        }));
                        continue;
                    }
                    self.waiting.push_back(Waiting {
                        messages,
                        timestamp_ms,
                        reply,
                    });
                    self.pump();
                }
                Command::Resume => {
                    self.slowed = false;
                    self.pump();
                }
                Command::SlowedRetentionDone { removed, delay_ms } => {
                    if removed {
                        // Room was made: ask the gate again now, afresh.
                        self.slowed = false;
                        self.head_delayed = false;
                        self.pump();
                    } else {
                        self.slowed_retention_after =
                            Some(tokio::time::Instant::now() + SLOWED_RETENTION_PAUSE);
                        self.resume_after(delay_ms);
                    }
                }
                Command::Settings(settings) => {
                    self.settings = settings;
                }
                Command::Log(event) => self.on_log(event),
                Command::ProposeFailed { sequence, error } => self.failed(sequence, error),
                Command::Retention { now_ms, reply } => self.retention(now_ms, reply),
                Command::RetentionDone { result, reply } => {
                    self.retention_busy = false;
                    if let Ok(Some((removal, held))) = &result {
                        self.held = *held;
                        {
                            let mut figures = self.lock_figures();
                            figures.removed_segments += removal.segments.len() as u64;
                            figures.removed_bytes += removal.bytes();
                            for (bound, bytes) in &removal.segments {
                                let by = &mut figures.removed_by_bound[bound_index(*bound)];
                                by.0 += 1;
                                by.1 += bytes;
                            }
                        }
                        self.publish_figures();
                    }
                    let _ = reply.send(result.map(|r| r.map(|(removal, _)| removal)));
                }
                Command::HealTick => self.try_heal(),
                Command::Healed { result } => self.healed(result),
                Command::Followed { from, result } => self.followed(from, result),
                Command::Restarted { result } => self.restarted(result),
                Command::StepDownGrace => self.step_down_grace(),
                Command::Close { reply, delete } => {
                    let stream = self.config.stream.clone();
                    self.fail_waiting(|| BrokerError::Closed(format!("stream {stream:?}")));
                    self.closing = Some((reply, delete));
                }
            }
            // Closing waits for what is in flight: proposals, a retention pass, a heal.
            if self.closing.is_some()
                && self.driver.is_idle()
                && !self.retention_busy
                && !self.driver.is_healing()
                && !self.following
                && !self.restarting
            {
                break;
            }
        }
        let Some((reply, delete)) = self.closing.take() else {
            return;
        };
        // The submitter ends with its channel and lets go of the log.
        let Owner { log, submit, .. } = self;
        drop(submit);
        let _ = reply.send(close_when_unshared(log, delete).await);
    }

    fn lock_figures(&self) -> std::sync::MutexGuard<'_, StreamPartitionFigures> {
        self.figures.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish_figures(&self) {
        {
            let mut figures = self.lock_figures();
            figures.bytes_appended = self.state.bytes();
            figures.messages = self
                .state
                .messages()
                .saturating_sub(self.held.messages_below);
            figures.bytes = self.state.bytes().saturating_sub(self.held.bytes_below);
            figures.oldest_timestamp_ms = self.held.oldest.map(|oldest| oldest.timestamp_ms);
            figures.start = self.held.oldest.map_or(u64::MAX, |oldest| oldest.offset);
            let role = self.driver.role();
            figures.stopped = self.driver.stopped().is_some();
            figures.leading = role.leading;
            figures.leader = if role.leading { None } else { role.leader };
        }
        self.end.send_if_modified(|end| {
            let next = self.state.next_offset();
            let changed = *end != next;
            *end = next;
            changed
        });
    }

    fn resume_after(&self, delay_ms: u64) {
        let commands = self.commands.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            let _ = commands.send(Command::Resume);
        });
    }

    /// A slowed append on a stream with retention: a pass runs first (its removal may bring
    /// the level back), unless one found nothing to remove a moment ago.
    fn retention_before_slowing(&mut self, delay_ms: u64) -> bool {
        let paused = self
            .slowed_retention_after
            .is_some_and(|after| tokio::time::Instant::now() < after);
        if !self.settings.has_retention() || self.retention_busy || paused {
            return false;
        }
        let (reply, answer) = oneshot::channel();
        // The newest message's time stands for now: the owner has no clock, and an age
        // bound then removes no more than the timer's pass would.
        let now_ms = self.state.newest_timestamp_ms();
        self.retention(now_ms, reply);
        let commands = self.commands.clone();
        tokio::spawn(async move {
            let removed = matches!(answer.await, Ok(Ok(Some(_))));
            let _ = commands.send(Command::SlowedRetentionDone { removed, delay_ms });
        });
        true
    }

    /// Proposes what waits, in order, as far as the gate, a due checkpoint and the log allow.
    fn pump(&mut self) {
        while !self.slowed && self.driver.stopped().is_none() {
            let Some(head) = self.waiting.front() else {
                return;
            };
            if self.driver.pending_count() >= PROPOSALS_IN_FLIGHT_MAX {
                return; // the next commit pumps again
            }
            if !self.caught_up() {
                return; // the follow that catches up pumps again
            }
            if head.messages.iter().any(|m| {
                m.producer.is_some_and(|mark| {
                    self.inflight_marks
                        .contains(&(mark.producer, mark.sequence))
                })
            }) {
                // A retry of a message in flight: its verdict waits for the first attempt's
                // outcome (stored: a duplicate; refused or lost: new), which pumps again.
                // Answered "duplicate" now, it would be confirmed before anything is durable.
                return;
            }
            let interval = self.config.segment_bytes / CHECKPOINT_INTERVAL_DIVISOR;
            let checkpoint_due = self.state.checkpoint_due(interval);
            if checkpoint_due && !self.driver.is_idle() {
                return; // the checkpoint waits for the state to catch up
            }
            let bytes: u64 = head.messages.iter().map(|m| m.body.len() as u64).sum();
            match self.gate.publish(self.config.device, bytes) {
                GateDecision::Admit => {}
                GateDecision::Slow { .. } if self.head_delayed => {}
                GateDecision::Slow { delay_ms } => {
                    self.slowed = true;
                    self.head_delayed = true;
                    if !self.retention_before_slowing(delay_ms) {
                        self.resume_after(delay_ms);
                    }
                    return;
                }
                GateDecision::Reject {
                    reason,
                    retry_after_ms,
                    message,
                } => {
                    let head = self.waiting.pop_front().expect("a head");
                    self.head_delayed = false;
                    let _ = head.reply.send(Err(BrokerError::Limited {
                        reason,
                        retry_after_ms,
                        message,
                    }));
                    continue;
                }
            }
            let head = self.waiting.pop_front().expect("a head");
            self.head_delayed = false;
            self.propose(head, checkpoint_due);
        }
    }

    fn propose(&mut self, append: Waiting, checkpoint: bool) {
        let mut records = Vec::new();
        if checkpoint {
            debug_assert!(
                self.driver.is_idle(),
                "a checkpoint follows applied records"
            );
            records.push(StreamRecord::Checkpoint(self.state.checkpoint()));
        }
        let mut outcome = Vec::with_capacity(append.messages.len());
        let mut marks = Vec::new();
        for message in append.messages {
            if let Some(mark) = message.producer {
                let key = (mark.producer, mark.sequence);
                debug_assert!(
                    !self.inflight_marks.contains(&key),
                    "a retry of a message in flight waits in `pump`"
                );
                // Twice in one append: the second copy is answered with the first's proposal.
                let verdict = if marks.contains(&key) {
                    Verdict::Duplicate
                } else {
                    self.state.verdict(mark.producer, mark.sequence)
                };
                match verdict {
                    Verdict::New => marks.push(key),
                    Verdict::Duplicate => {
                        outcome.push(Some(Appended::Duplicate));
                        continue;
                    }
                    Verdict::TooOld { floor } => {
                        let _ = append.reply.send(Err(BrokerError::Invalid(format!(
                            "producer {} sequence {} is below the sequences stream {:?} \
                             partition {} still knows (from {floor}): whether it was stored is \
                             no longer known, so it is refused",
                            mark.producer, mark.sequence, self.config.stream, self.config.index
                        ))));
                        return;
                    }
                }
            }
            outcome.push(None);
            records.push(StreamRecord::Message(message));
        }
        let mut encoded = Vec::with_capacity(records.len());
        for record in records {
            match record.encode() {
                Ok(payload) => encoded.push((record, payload)),
                Err(error) => {
                    let _ = append.reply.send(Err(error));
                    return;
                }
            }
        }
        if encoded.is_empty() {
            // Every message was a duplicate: nothing to write.
            let outcome = outcome
                .into_iter()
                .map(|o| o.expect("duplicates only"))
                .collect();
            let _ = append.reply.send(Ok(outcome));
            return;
        }
        self.inflight_marks.extend(marks);
        let types = encoded.iter().map(|(r, _)| r.record_type()).collect();
        let payloads = encoded.iter().map(|(_, p)| p.clone()).collect();
        let inflight = Inflight {
            records: encoded,
            timestamp_ms: append.timestamp_ms,
            outcome,
            reply: Some(append.reply),
        };
        let sequence = self.driver.propose(inflight, tokio::time::Instant::now());
        let proposal = Proposal {
            sequence,
            types,
            payloads,
            timestamp_ms: append.timestamp_ms,
        };
        if let Err(error) = self.submit.try_send(proposal) {
            // Bounded by PROPOSALS_IN_FLIGHT_MAX, and the submitter lives as long as the
            // owner: neither full nor closed.
            let error = BrokerError::Closed(format!(
                "stream {:?} partition {} submitter: {error}",
                self.config.stream, self.config.index
            ));
            self.failed(sequence, error);
        }
    }

    fn on_log(&mut self, event: LogEvent) {
        match event {
            LogEvent::Proposed { sequence, result } => match result {
                Ok(range) => self.committed(sequence, range),
                Err(error) => self.failed(sequence, error),
            },
            LogEvent::Role(role) => self.role_changed(role),
            LogEvent::Committed { up_to } => {
                self.driver.committed(up_to);
                self.maybe_follow();
            }
            LogEvent::Stopped { error } => self.stop(BrokerError::Log(error)),
        }
    }

    /// The log committed proposal `sequence` at `range`: it and every committed proposal
    /// after it are applied once all before them are (the driver releases them in proposal
    /// order; the log's reports may arrive out of order).
    fn committed(&mut self, sequence: u64, range: Range<u64>) {
        if self.driver.resolve(sequence, Ok(range)) {
            self.apply_ready();
        }
        // Otherwise it failed already (the log stopped): the heal's rebuild has it.
    }

    /// Acts on the proposals the driver releases, in order: a commit is applied and answered,
    /// a refusal answered. One that lands past the state's end waits for the records before it
    /// (another leader's, or a replicated log's own entries) to be followed first.
    fn apply_ready(&mut self) {
        while let Some(Pending { item, outcome, .. }) =
            self.driver.next_released(self.state.next_offset())
        {
            match outcome {
                Some(Ok(range)) => {
                    assert_eq!(
                        range.start,
                        self.state.next_offset(),
                        "a log commits proposals past every record applied, in proposal order"
                    );
                    if !self.apply_committed(item, range) {
                        return;
                    }
                }
                Some(Err(error)) => self.refused(item, error),
                None => {}
            }
        }
        self.publish_figures();
        self.retention_as_written();
        self.pump();
        self.maybe_follow();
    }

    /// A retention pass each half segment written (stream with retention only), besides the
    /// broker's timer: the bound holds within about a segment whatever the publish rate.
    fn retention_as_written(&mut self) {
        let written = self.state.bytes().saturating_sub(self.retention_mark);
        if !self.config.retention_as_written
            || !self.settings.has_retention()
            || self.retention_busy
            || written < self.config.segment_bytes / 2
        {
            return;
        }
        self.retention_mark = self.state.bytes();
        let (reply, _answer) = oneshot::channel();
        // The newest message's time stands for now, as for a slowed append's pass.
        self.retention(self.state.newest_timestamp_ms(), reply);
    }

    /// Applies the released proposal at `range` and answers it; false when the partition
    /// stopped.
    fn apply_committed(&mut self, mut done: Inflight, range: Range<u64>) -> bool {
        assert_eq!(
            range.end - range.start,
            done.records.len() as u64,
            "a proposal commits as many records as it holds"
        );
        let mut offsets = Vec::with_capacity(done.records.len());
        for ((record, payload), offset) in done.records.iter().zip(range.clone()) {
            if let StreamRecord::Message(Message {
                producer: Some(mark),
                ..
            }) = record
            {
                self.inflight_marks.remove(&(mark.producer, mark.sequence));
            }
            if let Err(error) =
                self.state
                    .apply(offset, done.timestamp_ms, payload.len() as u64, record)
            {
                // A broken invariant: stop rather than build on a wrong state.
                tracing::error!(stream = %self.config.stream, partition = self.config.index, %error, "a committed record does not apply; the partition stops");
                if let Some(reply) = done.reply.take() {
                    let _ = reply.send(Err(BrokerError::Closed(format!(
                        "stream {:?} partition {} (stopped: {error})",
                        self.config.stream, self.config.index
                    ))));
                }
                self.stop(error);
                return false;
            }
            if record.record_type() != STREAM_CHECKPOINT {
                offsets.push(offset);
            }
            if record.record_type() == STREAM_MESSAGE {
                self.held.saw_message(offset, done.timestamp_ms);
            }
        }
        let mut offsets = offsets.into_iter();
        let outcome = done
            .outcome
            .iter()
            .map(|o| {
                o.unwrap_or_else(|| Appended::Stored(offsets.next().expect("an offset per record")))
            })
            .collect();
        if let Some(reply) = done.reply.take() {
            // A publisher that reads the stream's figures once answered counts its messages.
            self.publish_figures();
            let _ = reply.send(Ok(outcome));
        }
        true
    }

    /// Proposal `sequence` failed: a storage failure stops the partition; a refusal (a
    /// replicated log that does not lead any more) is answered in its order, and the log runs
    /// on: what it committed comes as commits, the successor's records and this proposal's if it
    /// took an offset that was committed after all (`LeadershipLost`: unknown).
    fn failed(&mut self, sequence: u64, error: BrokerError) {
        if is_storage_failure(&error) {
            self.stop(error);
        } else if self.driver.resolve(sequence, Err(error)) {
            self.apply_ready();
        }
    }

    /// A released proposal that was refused: answered, its producers' marks forgotten.
    fn refused(&mut self, mut refused: Inflight, error: BrokerError) {
        for (record, _) in &refused.records {
            if let StreamRecord::Message(Message {
                producer: Some(mark),
                ..
            }) = record
            {
                self.inflight_marks.remove(&(mark.producer, mark.sequence));
            }
        }
        if let Some(reply) = refused.reply.take() {
            let _ = reply.send(Err(error));
        }
    }

    /// The log failed: every append in flight has an unknown outcome, waiting ones are refused,
    /// and the log heals when the gate allows (then the state is rebuilt from it).
    fn stop(&mut self, error: BrokerError) {
        let source = match &error {
            BrokerError::Log(e) => e.clone(),
            other => keratin_log::LogError::Invalid(other.to_string()),
        };
        for Pending { mut item, .. } in self.driver.drain() {
            if let Some(reply) = item.reply.take() {
                let _ = reply.send(Err(BrokerError::OutcomeUnknown {
                    queue: self.config.stream.clone(),
                    partition: self.config.index,
                    source: source.clone(),
                }));
            }
        }
        self.inflight_marks.clear();
        let stream = self.config.stream.clone();
        let index = self.config.index;
        self.fail_waiting(|| BrokerError::Unavailable {
            queue: stream.clone(),
            partition: index,
            source: source.clone(),
        });
        let shown = error.to_string();
        let now = tokio::time::Instant::now();
        if self.driver.stop(error, now) {
            tracing::warn!(stream = %self.config.stream, partition = self.config.index, error = %shown, "stream partition log stopped; healing when the disk allows");
            // A stream partition's first heal waits a retry too: the stop stays visible in the
            // figures meanwhile, and one a record that does not apply caused is not rebuilt
            // past at once.
            self.driver.heal_later(now);
        }
        self.lock_figures().stops += 1;
        self.publish_figures();
        self.schedule_heal();
    }

    fn fail_waiting(&mut self, error: impl Fn() -> BrokerError) {
        for waiting in self.waiting.drain(..) {
            let _ = waiting.reply.send(Err(error()));
        }
        self.slowed = false;
        self.head_delayed = false;
    }

    /// A heal tick when the driver's next heal is due.
    fn schedule_heal(&self) {
        let Some(at) = self.driver.heal_at() else {
            return;
        };
        let commands = self.commands.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let _ = commands.send(Command::HealTick);
        });
    }

    fn try_heal(&mut self) {
        let now = tokio::time::Instant::now();
        if self.driver.heal_at().is_none() {
            return; // running, or a heal runs
        }
        if !self.driver.heal_due(now) {
            self.schedule_heal();
            return;
        }
        // A rebuild after a restart of the log is still reading it: its result is dropped
        // (`follow.rs`), and the heal's own rebuild starts after it.
        if self.restarting || !self.gate.may_heal(self.config.device) {
            self.driver.heal_later(now);
            self.schedule_heal();
            return;
        }
        self.driver.heal_started();
        let log = self.log.clone();
        let commands = self.commands.clone();
        tokio::task::spawn_blocking(move || {
            let result = log
                .heal()
                .map_err(BrokerError::from)
                .and_then(|()| rebuild(log.as_ref()).map(|r| r.state))
                .and_then(|state| Ok((state, Held::read(log.as_ref())?)));
            let _ = commands.send(Command::Healed { result });
        });
    }

    fn healed(&mut self, result: BrokerResult<(StreamPartitionState, Held)>) {
        let now = tokio::time::Instant::now();
        match result {
            Ok((state, held)) => {
                tracing::info!(stream = %self.config.stream, partition = self.config.index, "stream partition log healed; appends resume");
                self.state = state;
                self.held = held;
                self.driver.heal_done(Ok(()), now);
                self.lock_figures().heals += 1;
                self.publish_figures();
                self.pump();
                self.maybe_follow();
            }
            Err(error) => {
                tracing::warn!(stream = %self.config.stream, partition = self.config.index, %error, "stream partition heal failed; trying again");
                self.driver.heal_done(Err(()), now);
                self.schedule_heal();
            }
        }
    }

    /// Decides on the segments' facts (read on the blocking pool) and removes the prefix.
    fn retention(&mut self, now_ms: u64, reply: oneshot::Sender<BrokerResult<Option<Removal>>>) {
        let settings = self.settings;
        if !settings.has_retention() || self.retention_busy {
            let _ = reply.send(Ok(None));
            return;
        }
        self.retention_busy = true;
        let bounds = RetentionBounds {
            max_bytes: settings.partition_max_bytes(),
            max_age_ms: settings.max_age_ms,
            max_messages: settings.partition_max_messages(),
        };
        let log = self.log.clone();
        let segment_bytes = self.config.segment_bytes;
        let commands = self.commands.clone();
        let sealed = self.sealed.clone();
        // A replica removes only what it applied (a follower may lag behind its log's
        // commits); on a single node every committed record is applied.
        let applied = self.state.next_offset();
        tokio::task::spawn_blocking(move || {
            let result = (|| {
                let facts = segment_facts(log.as_ref(), segment_bytes, &sealed)?;
                let end = log.committed_offset().min(applied);
                let Some(removal) = decide(&facts, end, &bounds, now_ms) else {
                    return Ok(None);
                };
                if removal.before > applied {
                    return Ok(None);
                }
                let removing = log.remove_prefix(removal.before)?;
                futures_block_on(removing)?;
                Ok(Some((removal, Held::read(log.as_ref())?)))
            })();
            let _ = commands.send(Command::RetentionDone { result, reply });
        });
    }
}

/// Each segment's facts for retention (blocking). A sealed segment is read once, then its
/// facts are cached: from its base to its first checkpoint (a quarter of a segment at most),
/// and its last record for its newest timestamp; the tail is read every pass. Counts are in
/// offsets (`docs/streams.md`, "Retention": a checkpoint per quarter segment counts too);
/// sizes are the segment size but for the tail, which holds the rest.
fn segment_facts(
    log: &dyn PartitionLog,
    segment_bytes: u64,
    sealed: &Mutex<BTreeMap<u64, Sealed>>,
) -> BrokerResult<Vec<SegmentFacts>> {
    let space = log.space();
    let end = log.committed_offset();
    let start = log.start_offset();
    let bases = &space.segment_bases;
    let old = bases.len().saturating_sub(1) as u64;
    let mut cache = sealed.lock().unwrap_or_else(|p| p.into_inner());
    cache.retain(|base, _| bases.contains(base));
    let mut facts = Vec::with_capacity(bases.len());
    for (i, &base) in bases.iter().enumerate() {
        let tail = i + 1 == bases.len();
        let next = bases.get(i + 1).copied().unwrap_or(end);
        let known = if tail {
            None
        } else {
            cache.get(&base).copied()
        };
        let seen = match known {
            Some(seen) => seen,
            None => {
                let seen = read_segment(log, base.max(start), next)?;
                if !tail {
                    cache.insert(base, seen);
                }
                seen
            }
        };
        let size_bytes = if tail {
            space.disk_bytes.saturating_sub(old * segment_bytes)
        } else {
            segment_bytes
        };
        facts.push(SegmentFacts {
            base_offset: base,
            size_bytes,
            newest_timestamp_ms: seen.newest_timestamp_ms,
            messages_before: base,
            checkpointed: seen.checkpointed,
        });
    }
    Ok(facts)
}

/// Reads `from..next` up to its first checkpoint, and its last record.
fn read_segment(log: &dyn PartitionLog, from: u64, next: u64) -> BrokerResult<Sealed> {
    let mut checkpointed = false;
    for record in log.reader(from) {
        let record = record?;
        if record.offset >= next {
            break;
        }
        if record.record_type == STREAM_CHECKPOINT {
            checkpointed = true;
            break;
        }
    }
    let mut newest_timestamp_ms = None;
    if next > from {
        if let Some(record) = log.reader(next - 1).next() {
            let record = record?;
            if record.offset == next - 1 {
                newest_timestamp_ms = Some(record.timestamp_ms);
            }
        }
    }
    Ok(Sealed {
        newest_timestamp_ms,
        checkpointed,
    })
}

/// The index of `bound` in [`StreamPartitionFigures::removed_by_bound`].
pub fn bound_index(bound: Bound) -> usize {
    match bound {
        Bound::Size => 0,
        Bound::Age => 1,
        Bound::Count => 2,
    }
}

/// Waits for a log future from a blocking thread.
fn futures_block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Handle::current().block_on(future)
}
