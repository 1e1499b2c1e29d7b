//! The owner task of one partition: the only code that changes the partition. It turns
//! commands into log records, applies records to the [`PartitionState`] once the log reports them
//! durable (in offset order), and keeps the volatile delivery bookkeeping: which messages are
//! inflight to which consumer, which were returned, where the delivery cursor is.
//!
//! Invariant: every live message below `cursor` is in exactly one of `inflight`, `limbo` (its
//! settle, return or dead-lettering is being written) and `redeliver` (ready again).

mod admission;
mod delivery;
mod reclaim;
mod settle;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use keratin_log::{Log, LogError, LogReader, LogResult, PrefixRemoval, Record};
use tokio::sync::{mpsc, oneshot};

use crate::broker::BrokerInner;
use crate::consumer::{ConsumerLink, Delivery, DeliveryTag};
use crate::error::{BrokerError, BrokerResult};
use crate::gate::{GateDecision, PublishGate};
use crate::partition::state::{Applied, PartitionState};
use crate::queue::{Overflow, PartitionFigures, PartitionHandle, PartitionLimits, QueueSettings};
use crate::record::{
    Message, Outcome, PartitionRecord, Purge, Relocate, Returned, Settled, ENQUEUE, RELOCATE,
};
use crate::Clock;

/// Relocation copies at most this many payload bytes per round, so that one round never holds
/// up the partition for long: 4 MiB is a few milliseconds of disk bandwidth.
const RELOCATE_BATCH_BYTES: usize = 4 << 20;

pub(crate) enum Command {
    /// New settings of a live queue (limits, dead-lettering); the metadata log has them already.
    SetSettings {
        settings: QueueSettings,
        reply: oneshot::Sender<BrokerResult<()>>,
    },
    Publish {
        payloads: Vec<Vec<u8>>,
        timestamp_ms: u64,
        /// Dead-lettering moves existing messages: it never passes the gate.
        internal: bool,
        reply: oneshot::Sender<BrokerResult<Range<u64>>>,
    },
    Subscribe {
        link: Arc<ConsumerLink>,
    },
    Unsubscribe {
        consumer: u64,
    },
    Settle {
        consumer: u64,
        messages: Vec<u64>,
        reject: Option<bool>,
    },
    Kick,
    Purge {
        reply: oneshot::Sender<BrokerResult<u64>>,
    },
    DeadLettered {
        entries: Vec<(u64, u32)>,
        delivered: bool,
    },
    AppendDone {
        sequence: u64,
        result: LogResult<Range<u64>>,
    },
    PrefixRemoved {
        result: LogResult<PrefixRemoval>,
    },
    CheckState {
        reply: oneshot::Sender<BrokerResult<(PartitionState, PartitionState)>>,
    },
    Close {
        reply: oneshot::Sender<BrokerResult<()>>,
    },
    Delete {
        reply: oneshot::Sender<BrokerResult<()>>,
    },
}

/// What to do once an append is applied (or failed).
enum Done {
    Publish(oneshot::Sender<BrokerResult<Range<u64>>>),
    Purge(oneshot::Sender<BrokerResult<u64>>, u64),
    /// Settles, returns and relocations: their effects come from applying them.
    Internal,
}

struct PendingAppend {
    sequence: u64,
    records: Vec<PartitionRecord>,
    result: Option<LogResult<Range<u64>>>,
    done: Done,
}

#[derive(Debug, Clone, Copy)]
struct Inflight {
    consumer: u64,
    delivery_count: u32,
    size_bytes: u32,
}

/// Why a message goes to the dead-letter queue; sent as the `x-death-reason` header.
#[derive(Debug, Clone, Copy)]
enum DeathReason {
    /// Dropped by `drop_oldest` to make room.
    Overflow,
    Rejected,
    MaxDeliveries,
}

impl DeathReason {
    fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::MaxDeliveries => "max_deliveries",
            DeathReason::Overflow => "overflow",
        }
    }
}

/// What the owner knows of its queue.
pub(crate) struct OwnerContext {
    /// The file system holding the partition's log.
    pub(crate) device: u64,
    pub(crate) gate: Arc<dyn PublishGate>,
    pub(crate) queue: String,
    pub(crate) index: u32,
    pub(crate) settings: QueueSettings,
    pub(crate) broker: Weak<BrokerInner>,
    pub(crate) clock: Clock,
    pub(crate) segment_size_bytes: u64,
}

struct Owner {
    ctx: OwnerContext,
    log: Option<Log>,
    state: PartitionState,
    commands: mpsc::UnboundedSender<Command>,
    figures: Arc<PartitionFigures>,
    pending: VecDeque<PendingAppend>,
    next_sequence: u64,
    stopped: Option<LogError>,
    consumers: Vec<Arc<ConsumerLink>>,
    round_robin: usize,
    cursor: u64,
    reader: Option<LogReader>,
    inflight: HashMap<u64, Inflight>,
    limbo: HashMap<u64, u32>,
    redeliver: BTreeSet<u64>,
    /// Delivery counts of returned messages whose RETURN record is not applied yet.
    counts_pending: HashMap<u64, u32>,
    reclaim_busy: bool,
    reclaim_due: bool,
    /// Publishes held back by slowing, in arrival order, each with when it may be written.
    delayed: VecDeque<Delayed>,
    /// Disk bytes at the last look, to notice a roll.
    disk_bytes: u64,
    /// Acks received in this round of commands, written as one record at its end.
    acks: Vec<Settled>,
    /// This partition's share of the queue limits.
    limits: PartitionLimits,
    /// Messages and bytes of publishes admitted by the queue limits and not yet applied (or
    /// failed): they count toward the limits, or concurrent publishes would overshoot them.
    reserved_count: u64,
    reserved_bytes: u64,
    /// Messages being removed by `drop_oldest`: they no longer count toward the limits.
    dropping: HashMap<u64, u32>,
    /// Sum of `dropping`'s sizes, kept as it changes (the admission check runs per publish).
    dropping_bytes: u64,
    /// PURGE records written and not yet applied (or failed).
    purges: u32,
}

/// A publish waiting out its slowing delay.
struct Delayed {
    ready_at: Instant,
    payloads: Vec<Vec<u8>>,
    timestamp_ms: u64,
    reply: oneshot::Sender<BrokerResult<Range<u64>>>,
}

/// Most entries in one SETTLE, RETURN or PURGE record: 4,096 entries of at most 16 bytes are
/// 64 KiB, well inside the smallest segment (256 KiB), so no round of acks is ever too large to
/// write.
const CONTROL_ENTRIES_MAX: usize = 4096;

/// A delivery or drop reuses its reader across at most this many records in between (control
/// records, settled messages) instead of opening a new one at the payload.
const READER_SKIP_MAX: u64 = 256;

/// The retry hint of `queue_full`: a consumer frees room at its own pace, so a second is a
/// reasonable first wait; clients back off further on repeated refusals.
const QUEUE_FULL_RETRY_AFTER_MS: u32 = 1000;

/// A stopped log is offered a heal this often (when the gate says its file system is back
/// above reserve).
const HEAL_INTERVAL: Duration = Duration::from_millis(500);

/// Start the owner task of a partition whose log was opened and whose state was rebuilt.
pub(crate) fn spawn(ctx: OwnerContext, log: Log, state: PartitionState) -> PartitionHandle {
    let (commands, receiver) = mpsc::unbounded_channel();
    let figures = Arc::new(PartitionFigures::default());
    let index = ctx.index;
    let mut owner = Owner {
        ctx,
        log: Some(log),
        state,
        commands: commands.clone(),
        figures: figures.clone(),
        pending: VecDeque::new(),
        next_sequence: 0,
        stopped: None,
        consumers: Vec::new(),
        round_robin: 0,
        cursor: 0,
        reader: None,
        inflight: HashMap::new(),
        limbo: HashMap::new(),
        redeliver: BTreeSet::new(),
        counts_pending: HashMap::new(),
        reclaim_busy: false,
        reclaim_due: true,
        delayed: VecDeque::new(),
        disk_bytes: 0,
        acks: Vec::new(),
        limits: PartitionLimits {
            max_messages: None,
            max_bytes: None,
            overflow: Overflow::Reject,
        },
        reserved_count: 0,
        reserved_bytes: 0,
        dropping: HashMap::new(),
        dropping_bytes: 0,
        purges: 0,
    };
    owner.limits = owner.ctx.settings.partition_limits();
    // Figures are right from the start, before the task first runs.
    owner.publish_figures();
    tokio::spawn(owner.run(receiver));
    PartitionHandle {
        index,
        commands,
        figures,
    }
}

impl Owner {
    async fn run(mut self, mut receiver: mpsc::UnboundedReceiver<Command>) {
        loop {
            let wake_at = self.wake_at();
            let command = tokio::select! {
                command = receiver.recv() => match command {
                    Some(command) => Some(command),
                    None => break,
                },
                () = sleep_until(wake_at) => None,
            };
            let mut exit = match command {
                Some(command) => self.handle(command),
                None => false,
            };
            // Take everything already queued before delivering: acks and confirms batch up.
            while !exit {
                match receiver.try_recv() {
                    Ok(command) => exit = self.handle(command),
                    Err(_) => break,
                }
            }
            if exit {
                break;
            }
            self.flush_acks();
            self.release_delayed();
            self.maybe_heal();
            self.deliver();
            self.maybe_reclaim();
            self.publish_figures();
        }
    }

    /// When the loop must wake without a command: the first delayed publish, or the next heal
    /// attempt of a stopped log.
    fn wake_at(&self) -> Option<Instant> {
        let delayed = self.delayed.front().map(|d| d.ready_at);
        let heal = self
            .stopped
            .as_ref()
            .map(|_| Instant::now() + HEAL_INTERVAL);
        match (delayed, heal) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn log(&self) -> BrokerResult<&Log> {
        self.log
            .as_ref()
            .ok_or_else(|| BrokerError::Closed(format!("queue {:?}", self.ctx.queue)))
    }

    fn unavailable(&self, source: LogError) -> BrokerError {
        BrokerError::Unavailable {
            queue: self.ctx.queue.clone(),
            partition: self.ctx.index,
            source,
        }
    }

    /// Handle one command; true when the owner must exit.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Publish {
                payloads,
                timestamp_ms,
                internal,
                reply,
            } => self.publish(payloads, timestamp_ms, internal, reply),
            Command::Subscribe { link } => self.consumers.push(link),
            Command::Unsubscribe { consumer } => self.unsubscribe(consumer),
            Command::Settle {
                consumer,
                messages,
                reject,
            } => self.settle(consumer, messages, reject),
            Command::Kick => {}
            Command::SetSettings { settings, reply } => {
                self.set_settings(settings);
                let _ = reply.send(Ok(()));
            }
            Command::Purge { reply } => self.purge(reply),
            Command::DeadLettered { entries, delivered } => self.dead_lettered(entries, delivered),
            Command::AppendDone { sequence, result } => self.append_done(sequence, result),
            Command::PrefixRemoved { result } => self.prefix_removed(result),
            Command::CheckState { reply } => {
                let _ = reply.send(self.check_state());
            }
            Command::Close { reply } => {
                let _ = reply.send(self.close(false));
                return true;
            }
            Command::Delete { reply } => {
                let _ = reply.send(self.close(true));
                return true;
            }
        }
        false
    }

    /// Append records and remember what to do once they are durable.
    fn append(&mut self, records: Vec<PartitionRecord>, payloads: Vec<Vec<u8>>, done: Done) {
        let timestamp_ms = (self.ctx.clock)();
        self.append_at(records, payloads, done, timestamp_ms);
    }

    fn append_at(
        &mut self,
        records: Vec<PartitionRecord>,
        payloads: Vec<Vec<u8>>,
        done: Done,
        timestamp_ms: u64,
    ) {
        let result = match self.log() {
            Ok(log) => {
                let log_records: Vec<Record<'_>> = records
                    .iter()
                    .zip(&payloads)
                    .map(|(record, payload)| Record {
                        record_type: record.record_type(),
                        flags: 0,
                        timestamp_ms,
                        payload,
                    })
                    .collect();
                log.append(&log_records).map_err(|e| match e {
                    LogError::RecordTooLarge { .. } => BrokerError::TooLarge(e.to_string()),
                    LogError::Invalid(_) => BrokerError::Invalid(e.to_string()),
                    other => self.unavailable(other),
                })
            }
            Err(e) => Err(e),
        };
        let ticket = match result {
            Ok(ticket) => ticket,
            Err(error) => {
                // Only a log that stopped stops the partition; a refused request does not.
                if let BrokerError::Unavailable { source, .. } = &error {
                    if source.is_stopped() {
                        self.stop(source.clone());
                    }
                }
                self.fail(records, done, error);
                return;
            }
        };
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.pending.push_back(PendingAppend {
            sequence,
            records,
            result: None,
            done,
        });
        let commands = self.commands.clone();
        tokio::spawn(async move {
            let result = ticket.await;
            let _ = commands.send(Command::AppendDone { sequence, result });
        });
    }

    fn append_done(&mut self, sequence: u64, result: LogResult<Range<u64>>) {
        let Some(front) = self.pending.front().map(|p| p.sequence) else {
            return;
        };
        let Some(entry) = sequence
            .checked_sub(front)
            .and_then(|i| self.pending.get_mut(i as usize))
        else {
            return;
        };
        entry.result = Some(result);
        while self.pending.front().is_some_and(|p| p.result.is_some()) {
            let Some(entry) = self.pending.pop_front() else {
                break;
            };
            match entry.result {
                Some(Ok(range)) => self.apply(range, entry.records, entry.done),
                Some(Err(error)) => {
                    self.stop(error.clone());
                    // The records reached the log's queue: a crash before the failure could
                    // leave them durable, so the caller cannot know.
                    let error = BrokerError::OutcomeUnknown {
                        queue: self.ctx.queue.clone(),
                        partition: self.ctx.index,
                        source: error,
                    };
                    self.fail(entry.records, entry.done, error);
                }
                None => {}
            }
        }
    }

    /// The records of `range` are durable: apply them, then answer.
    fn apply(&mut self, range: Range<u64>, records: Vec<PartitionRecord>, done: Done) {
        for (offset, record) in range.clone().zip(&records) {
            if let PartitionRecord::Enqueue { size_bytes } = record {
                self.unreserve(1, u64::from(*size_bytes));
            }
            match self.state.apply(offset, record) {
                Ok(applied) => self.applied(applied),
                Err(error) => {
                    tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "state machine refused a record");
                }
            }
        }
        match done {
            Done::Publish(reply) => {
                // Figures first: a caller that reads them after its answer sees its effect.
                self.publish_figures();
                let _ = reply.send(Ok(range));
            }
            Done::Purge(reply, count) => {
                self.purges = self.purges.saturating_sub(1);
                self.reclaim_due = true;
                self.publish_figures();
                let _ = reply.send(Ok(count));
            }
            Done::Internal => {}
        }
    }

    /// Volatile consequences of an applied record.
    fn applied(&mut self, applied: Applied) {
        match applied {
            Applied::Enqueued { .. } => {}
            Applied::Relocated { .. } => {
                self.reclaim_busy = false;
                self.reclaim_due = true;
            }
            Applied::Settings => {}
            Applied::Settled(messages) => {
                for m in messages {
                    self.limbo.remove(&m);
                    self.undrop(m);
                }
                self.reclaim_due = true;
            }
            Applied::Returned(messages) => {
                for m in messages {
                    self.counts_pending.remove(&m);
                }
            }
            Applied::Purged(ranges) => {
                for (start, end) in ranges {
                    let gone: Vec<u64> = self.redeliver.range(start..end).copied().collect();
                    for m in gone {
                        self.redeliver.remove(&m);
                        self.counts_pending.remove(&m);
                    }
                }
                self.reclaim_due = true;
            }
        }
    }

    /// An append failed (the log stopped): nothing of it was applied.
    fn fail(&mut self, records: Vec<PartitionRecord>, done: Done, error: BrokerError) {
        for record in &records {
            if let PartitionRecord::Enqueue { size_bytes } = record {
                self.unreserve(1, u64::from(*size_bytes));
            }
        }
        // Messages whose settle or return was being written are ready again.
        for record in &records {
            let messages: Vec<u64> = match record {
                PartitionRecord::Settle(entries) => entries.iter().map(|e| e.message).collect(),
                PartitionRecord::Return(entries) => entries.iter().map(|e| e.message).collect(),
                _ => Vec::new(),
            };
            for m in messages {
                self.undrop(m);
                if self.limbo.remove(&m).is_some() {
                    self.redeliver.insert(m);
                }
            }
        }
        if records
            .iter()
            .any(|r| matches!(r, PartitionRecord::Relocate(_)))
        {
            self.reclaim_busy = false;
        }
        // Figures first (a stopped log shows as stopped), then the answer.
        self.publish_figures();
        match done {
            Done::Publish(reply) => {
                let _ = reply.send(Err(error));
            }
            Done::Purge(reply, _) => {
                self.purges = self.purges.saturating_sub(1);
                let _ = reply.send(Err(error));
            }
            Done::Internal => {}
        }
    }

    /// The live state, and the state rebuilt from the log's records up to the same point.
    fn check_state(&mut self) -> BrokerResult<(PartitionState, PartitionState)> {
        let log = self.log()?;
        // A prefix removal running in the log's commit thread can take the records from under
        // the rebuild (OutOfRange at the old start; found by the model test): read again from
        // the new start. Removals only move the start forward, a few times per reclaim round.
        let mut attempts = 0;
        let rebuilt = loop {
            let start = log.start_offset();
            match rebuild(log, Some(self.state.head())) {
                Err(BrokerError::Log(LogError::OutOfRange { .. }))
                    if attempts < 8 && log.start_offset() != start =>
                {
                    attempts += 1;
                }
                result => break result?,
            }
        };
        // A prefix removal can finish in the log before its `PrefixRemoved` reaches this task:
        // the live state then still covers offsets the log no longer holds, and the two differ
        // only in `start` and the forgotten part of `dead`. Compare from the log's start (the
        // model test caught the spurious mismatch right after a flood of acks).
        let mut live = self.state.clone();
        live.forget_below(rebuilt.start());
        Ok((live, rebuilt))
    }

    fn close(&mut self, delete: bool) -> BrokerResult<()> {
        if !delete {
            self.flush_acks();
        }
        self.consumers.clear();
        self.reader = None;
        let Some(log) = self.log.take() else {
            return Ok(());
        };
        if delete {
            log.delete()?;
        } else {
            log.close()?;
        }
        Ok(())
    }

    /// The log stopped with `error`: refuse appends until [`Owner::maybe_heal`] reopens it.
    /// Each stop is counted once, for attention items and metrics.
    fn stop(&mut self, error: LogError) {
        if self.stopped.is_none() {
            self.figures.stops.fetch_add(1, Ordering::Relaxed);
        }
        self.stopped = Some(error);
    }

    fn publish_figures(&mut self) {
        let f = &self.figures;
        let busy = (self.inflight.len() + self.limbo.len()) as u64;
        f.ready.store(
            self.state.live_count().saturating_sub(busy),
            Ordering::Relaxed,
        );
        f.inflight
            .store(self.inflight.len() as u64, Ordering::Relaxed);
        f.live_bytes
            .store(self.state.live_bytes(), Ordering::Relaxed);
        if let Some(log) = &self.log {
            let disk_bytes = log.disk_bytes();
            if disk_bytes > self.disk_bytes {
                self.ctx.gate.segment_rolled(self.ctx.device);
            }
            self.disk_bytes = disk_bytes;
            f.disk_bytes.store(disk_bytes, Ordering::Relaxed);
        }
        f.stopped
            .store(u64::from(self.stopped.is_some()), Ordering::Relaxed);
        if f.full.load(Ordering::Relaxed) != 0 && self.has_room() {
            f.full.store(0, Ordering::Relaxed);
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Rebuild a partition's state by applying its log's records from the start, up to `until`
/// (exclusive) or the durable end.
pub(crate) fn rebuild(log: &Log, until: Option<u64>) -> BrokerResult<PartitionState> {
    let start = log.start_offset();
    let end = until.unwrap_or_else(|| log.durable_offset());
    let mut state = PartitionState::new(start);
    for record in log.reader(start) {
        let record = record?;
        if record.offset >= end {
            break;
        }
        let decoded = PartitionRecord::decode(record.record_type, &record.payload, record.offset)?;
        state.apply(record.offset, &decoded)?;
    }
    Ok(state)
}
