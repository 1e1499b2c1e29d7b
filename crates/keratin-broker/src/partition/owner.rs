//! The owner task of one partition: the only code that changes the partition. It turns
//! commands into log records, applies records to the [`PartitionState`] once the log reports them
//! durable (in offset order), and holds the leader-only delivery bookkeeping
//! ([`DeliveryState`]: which messages are inflight to which consumer, which were returned, where
//! the delivery cursor is). The records themselves come from the pure `prepare` step; the
//! order of its appends' outcomes, the role and its step-down grace, what may be followed and
//! the stop/heal phase are its [`LogDriver`]'s.
//!
//! The owner never waits for the disk on the async worker it runs on: appends wait for room in
//! the log's queue asynchronously (`append`), and every call that reads or syncs files (payload
//! reads for deliveries, relocation and dead-lettering, heals and the rebuild after them, log
//! close, delete and reset) runs as a job on tokio's blocking pool (`disk`), whose answer comes
//! back as a command. (Debug builds' state check and the tests' `CheckState` still read the log
//! in place, see `Owner::run_checks`.) The state machine stays deterministic:
//! records are applied in log order, and a payload read ahead is delivered only if its message
//! is still the next ready one when the read returns.
//!
//! Invariant (kept in `DeliveryState`): every live message below its cursor is in exactly one of
//! `inflight`, `limbo` (its settle, return or dead-lettering is being written) and `redeliver`
//! (ready again).

mod admission;
mod append;
mod checkpoint;
mod dead_letter;
mod delivery;
mod disk;
mod follow;
mod idle;
mod rebuild;
mod reclaim;
mod role;
mod settle;
mod stopped;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use keratin_log::{LogError, LogResult, PrefixRemoval};
use tokio::sync::{mpsc, oneshot};

use crate::broker::BrokerInner;
use crate::consumer::{ConsumerLink, Delivery, DeliveryPermit, DeliveryTag};
use crate::error::{BrokerError, BrokerResult};
use crate::gate::{GateDecision, PublishGate};
use crate::partition::dead_letter::{DeadLetterSink, DeathReason, Dying, HeldCount};
use crate::partition::delivery_state::{DeliveryState, Inflight, Prefetched};
use crate::partition::driver::{sleep_until, LogDriver, Pending, HEAL_RETRY};
use crate::partition::log::{BoxReader, LogEvent, LogEvents, PartitionLog, Proposal, Role};
use crate::partition::prepare::{self, LimitVerdict};
use crate::partition::state::{Applied, PartitionState};
use crate::queue::{
    DeadLetterFailure, Overflow, PartitionFigures, PartitionHandle, PartitionLimits, QueueSettings,
};
use crate::record::{
    Message, Outcome, PartitionRecord, Relocate, Returned, Settled, ENQUEUE, RELOCATE,
};
use crate::Clock;

pub(crate) use append::Submission;
pub(crate) use dead_letter::AttemptDone;
pub(crate) use delivery::ReadBatch;
pub(crate) use disk::{JobDone, RelocationRead};
pub(crate) use follow::FollowRead;
pub(crate) use rebuild::rebuild;

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
    /// A dead-lettering attempt ended (`owner/dead_letter.rs`).
    DeadLetterAttempt(AttemptDone),
    /// What the partition log reports: a proposal's outcome, or commits.
    Log(LogEvent),
    PrefixRemoved {
        result: LogResult<PrefixRemoval>,
    },
    /// The idle hand-back of the log's segments finished.
    HandedBack {
        result: LogResult<PrefixRemoval>,
    },
    /// A delivery read job returned.
    DeliveryRead(ReadBatch),
    /// A relocation read job returned.
    RelocationRead(RelocationRead),
    /// Records committed by another node were read for applying.
    FollowRead(FollowRead),
    /// A job holding the log (heal, reset, state check) returned.
    JobDone(JobDone),
    CheckState {
        reply: oneshot::Sender<BrokerResult<(PartitionState, PartitionState)>>,
    },
    Close {
        reply: oneshot::Sender<BrokerResult<()>>,
    },
    Delete {
        reply: oneshot::Sender<BrokerResult<()>>,
    },
    /// The partition's log is replaced (this node's copy moved: see
    /// `Broker::set_partition_replicas`): end like [`Command::Delete`], handing the consumers
    /// back for the next owner, or ending them if this node led the partition (they follow
    /// the leader elsewhere, as after a step-down).
    Replace {
        reply: oneshot::Sender<BrokerResult<Vec<Arc<ConsumerLink>>>>,
    },
}

/// What to do once an append is applied (or failed).
enum Done {
    Publish(oneshot::Sender<BrokerResult<Range<u64>>>),
    Purge(oneshot::Sender<BrokerResult<u64>>, u64),
    /// Settles, returns and relocations: their effects come from applying them.
    Internal,
}

/// When a pending publish is answered [`BrokerError::TimedOut`] if its outcome has not come
/// by then.
#[derive(Debug, Clone, Copy)]
struct PublishDeadline {
    at: Instant,
    /// The append's sequence number.
    sequence: u64,
}

/// The owner's part of an append in the log (its order and outcome are the driver's: durable
/// at offsets; a storage failure after it was queued, `BrokerError::Log`, may be durable or
/// not; any other error means it never reached the log, or was withdrawn after its publish
/// timed out).
struct Appending {
    records: Vec<PartitionRecord>,
    done: Done,
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
    /// Where dead-lettered messages go (the dead-letter queue may be led by another node).
    pub(crate) dead_letters: Arc<dyn DeadLetterSink>,
    /// The idempotent producer id of this partition's dead-letter copies
    /// (`dead_letter::dead_letter_producer` of the queue's id and the partition's index).
    pub(crate) dead_letter_producer: u64,
    /// The messages the node holds for dead-lettering, over all its partitions.
    pub(crate) dead_letters_held: HeldCount,
    pub(crate) clock: Clock,
    pub(crate) segment_size_bytes: u64,
    /// A publish not confirmed within this answers [`BrokerError::TimedOut`].
    pub(crate) publish_timeout: Duration,
    /// A partition that holds nothing and saw no append for this long hands its log's segments
    /// back to the pool (see `idle.rs`).
    pub(crate) idle_release_after: Duration,
}

struct Owner {
    ctx: OwnerContext,
    /// Shared with the append in flight and the jobs that need the log itself; `None` once
    /// closed, or while a reset replaces it.
    log: Option<Arc<dyn PartitionLog>>,
    state: PartitionState,
    commands: mpsc::UnboundedSender<Command>,
    figures: Arc<PartitionFigures>,
    /// The appends in the log, the role (a local log: this node leads, always), what is
    /// committed, and the stop/heal phase.
    driver: LogDriver<Appending>,
    /// What only a leader has: consumers, inflight, the cursor, read-ahead.
    delivery: DeliveryState,
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
    /// Messages and bytes of publishes written (admitted by the gate and the queue limits) and
    /// not yet applied (or failed): they count toward the limits, or concurrent publishes would
    /// overshoot them.
    reserved_count: u64,
    reserved_bytes: u64,
    /// Messages being removed by `drop_oldest`: they no longer count toward the limits.
    dropping: HashMap<u64, u32>,
    /// Records were applied (or the log healed) since the last trim (see
    /// [`Owner::trim_to_limits`]): a `drop_oldest` partition may hold more than its limit
    /// until then, because publishes were admitted counting on dropping messages that were
    /// not applied yet.
    trim_due: bool,
    /// `act_on_answers` is running: a call made from inside it (an append it caused, refused
    /// at once) returns, and the running loop acts on the answer in its order.
    acting: bool,
    /// Sum of `dropping`'s sizes, kept as it changes (the admission check runs per publish).
    dropping_bytes: u64,
    /// Purges written and not yet applied (or failed). While one is pending, nothing is
    /// delivered or dropped: the state still shows the purged messages live.
    purges: u32,
    /// Messages and bytes named by pending PURGE records: like `dropping`, they no longer count
    /// toward the queue limits.
    purging_count: u64,
    purging_bytes: u64,
    /// Records were applied or the state rebuilt since the last debug check of the state
    /// against its log (see [`Owner::run_checks`]).
    state_check_due: bool,
    /// Rounds that had a debug check due, to space out checks of long logs.
    state_check_rounds: u64,
    /// Appends not yet handed to the log, in order, behind `appending`.
    backlog: VecDeque<Proposal>,
    /// The append being handed to the log (waiting for room in its queue).
    appending: Option<Submission>,
    /// When each pending publish times out unless its outcome came first, in sequence order
    /// (and in time order; the step-down grace is the driver's).
    deadlines: VecDeque<PublishDeadline>,
    /// When the last append was made (the idle hand-back counts from it).
    last_append: Instant,
    /// A read of records committed by another node is out.
    following: bool,
    /// A hand-back is in the log's queue.
    handing_back: bool,
    /// The log was handed back and nothing was appended since.
    handed_back: bool,
    /// The blocking job that holds the log (heal, reset, state check), at most one.
    log_job: Option<tokio::task::JoinHandle<()>>,
    /// Purges waiting for `log_job` to end.
    deferred_purges: Vec<oneshot::Sender<BrokerResult<u64>>>,
    /// State checks asked for, answered at the end of the round (see `run_checks`).
    check_requests: Vec<oneshot::Sender<BrokerResult<(PartitionState, PartitionState)>>>,
    /// Deliveries wait for the log's delivery lease: look again then (`delivery.rs`).
    delivery_lease_retry_at: Option<Instant>,
    /// The sequence of the `PRODUCERS` append waiting or in flight (`checkpoint.rs`).
    checkpoint_sequence: Option<u64>,
    /// Disk bytes when the need for a `PRODUCERS` record was last looked at.
    checkpoint_disk_bytes: u64,
    /// Dead-lettering attempts started: the last one's id (never reused, so that an attempt
    /// from before a reset of the delivery state is told apart).
    dead_letter_attempts: u64,
}

/// A publish waiting out its slowing delay. It holds no reservation: the gate and the queue
/// limits decide again when its time comes (and only then may `drop_oldest` make room for it).
struct Delayed {
    ready_at: Instant,
    payloads: Vec<Vec<u8>>,
    timestamp_ms: u64,
    reply: oneshot::Sender<BrokerResult<Range<u64>>>,
}

/// A delivery or drop reuses its reader across at most this many records in between (control
/// records, settled messages) instead of opening a new one at the payload.
const READER_SKIP_MAX: u64 = 256;

/// Debug builds check the state against its log after every round while the log holds at most
/// this many records: at about 1 µs per record read and applied, a millisecond per round.
const STATE_CHECK_RECORDS_MAX: u64 = 1024;

/// Beyond `STATE_CHECK_RECORDS_MAX` records, debug builds check every this many due rounds per
/// `STATE_CHECK_RECORDS_MAX` records in the log.
const STATE_CHECK_INTERVAL: u64 = 64;

/// Start the owner task of a partition whose log was opened and whose state was rebuilt.
pub(crate) fn spawn(
    ctx: OwnerContext,
    log: Arc<dyn PartitionLog>,
    state: PartitionState,
    figures: Option<Arc<PartitionFigures>>,
) -> PartitionHandle {
    let (commands, receiver) = mpsc::unbounded_channel();
    let events = commands.clone();
    log.start(LogEvents::new(move |event| {
        let _ = events.send(Command::Log(event));
    }));
    // A partition whose owner is replaced keeps its figures (counters carry on).
    let figures = figures.unwrap_or_default();
    let index = ctx.index;
    // Every message already in the log may have been delivered (by this node before a
    // restart, or by the owner this one replaces): its next delivery is flagged `redelivered`,
    // as a new leader flags what lies below its first offset.
    let taken_over_at = state.head();
    let mut owner = Owner {
        ctx,
        log: Some(log),
        state,
        commands: commands.clone(),
        figures: figures.clone(),
        driver: LogDriver::new(0),
        delivery: DeliveryState {
            taken_over_at,
            ..DeliveryState::default()
        },
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
        // A rebuilt `drop_oldest` partition may hold more than its limit: a crash after a
        // publish's records and before the drops it owed. Trimmed before the first delivery.
        trim_due: true,
        acting: false,
        dropping_bytes: 0,
        purges: 0,
        purging_count: 0,
        purging_bytes: 0,
        state_check_due: false,
        state_check_rounds: 0,
        backlog: VecDeque::new(),
        appending: None,
        deadlines: VecDeque::new(),
        last_append: Instant::now(),
        following: false,
        handing_back: false,
        handed_back: false,
        log_job: None,
        deferred_purges: Vec::new(),
        check_requests: Vec::new(),
        delivery_lease_retry_at: None,
        checkpoint_sequence: None,
        checkpoint_disk_bytes: u64::MAX,
        dead_letter_attempts: 0,
    };
    owner.limits = owner.ctx.settings.partition_limits();
    // Figures are right from the start, before the task first runs.
    owner.publish_figures();
    tokio::spawn(owner.run(receiver));
    PartitionHandle::new(index, commands, figures)
}

/// What ends the owner.
enum Exit {
    Close(oneshot::Sender<BrokerResult<()>>),
    Delete(oneshot::Sender<BrokerResult<()>>),
    Replace(
        oneshot::Sender<BrokerResult<Vec<Arc<ConsumerLink>>>>,
        Vec<Arc<ConsumerLink>>,
    ),
}

/// What woke the owner.
enum Event {
    Command(Command),
    /// The append in flight reached the log's queue (or was refused).
    Submitted(append::Submitted),
    Timer,
}

impl Owner {
    async fn run(mut self, mut receiver: mpsc::UnboundedReceiver<Command>) {
        let exit = loop {
            let wake_at = self.wake_at();
            let event = tokio::select! {
                command = receiver.recv() => match command {
                    Some(command) => Event::Command(command),
                    None => break None,
                },
                submitted = append::next_submitted(&mut self.appending) => Event::Submitted(submitted),
                () = sleep_until(wake_at) => Event::Timer,
            };
            let mut exit = match event {
                Event::Command(command) => self.handle(command),
                Event::Submitted(submitted) => {
                    self.appending = None;
                    self.submitted(submitted);
                    self.submit_backlog();
                    None
                }
                Event::Timer => None,
            };
            // Take everything already queued before delivering: acks and confirms batch up.
            while exit.is_none() {
                match receiver.try_recv() {
                    Ok(command) => exit = self.handle(command),
                    Err(_) => break,
                }
            }
            if exit.is_some() {
                break exit;
            }
            self.flush_acks();
            self.release_delayed();
            self.expire_publishes();
            self.maybe_heal();
            self.maybe_follow();
            // A `PRODUCERS` record held back until the state caught up may go now.
            self.submit_backlog();
            // Before delivering (a message owed to `drop_oldest` must not become inflight):
            // what a trim skipped while the log was stopped is owed still after its heal.
            self.trim_to_limits();
            self.maybe_dead_letter();
            self.deliver();
            self.maybe_reclaim();
            self.maybe_checkpoint();
            self.maybe_hand_back();
            self.publish_figures();
            self.run_checks();
        };
        if let Some(exit) = exit {
            self.finish(exit).await;
        }
    }

    /// Debug builds: the state equals the state rebuilt from the log, after every round that
    /// applied records or rebuilt the state (see [`Owner::run_checks`]). Rebuilding reads the
    /// whole log, so a round checks only while the log holds at most `STATE_CHECK_RECORDS_MAX`
    /// records; beyond, one due round in `STATE_CHECK_INTERVAL` per `STATE_CHECK_RECORDS_MAX`
    /// records checks (else long tests would turn quadratic).
    fn debug_check_wanted(&mut self) -> bool {
        self.state_check_due = false;
        self.state_check_rounds += 1;
        let Some(log) = &self.log else {
            return false;
        };
        let records = log.committed_offset().saturating_sub(log.start_offset());
        // Beyond the small-log bound, the interval grows with the log: a check then costs at
        // most 1,024 / 64 = 16 record reads per round, amortized.
        let interval = (records / STATE_CHECK_RECORDS_MAX).max(1) * STATE_CHECK_INTERVAL;
        records <= STATE_CHECK_RECORDS_MAX || self.state_check_rounds.is_multiple_of(interval)
    }

    /// When the loop must wake without a command: the first delayed publish, the next
    /// dead-lettering attempt after a failed one, the next heal attempt of a stopped log, the
    /// first publish deadline or the end of the step-down grace, a delivery read retry, a look
    /// at a lapsed delivery lease, or the idle hand-back.
    fn wake_at(&self) -> Option<Instant> {
        let delayed = self.delayed.front().map(|d| d.ready_at);
        // A stopped log waits for a failed heal's pause, else polls the gate.
        let now = Instant::now();
        let heal = self
            .driver
            .heal_at()
            .map(|at| if at > now { at } else { now + HEAL_RETRY });
        let deadline = self.deadlines.front().map(|d| d.at);
        // A trim owed with nothing else to wake the owner (a rebuilt partition over its limit,
        // `trim_due` at spawn) runs at once; `trim_to_limits` clears it either way.
        let trim = (self.trim_due && self.limits.overflow == Overflow::DropOldest).then_some(now);
        // The next dead-lettering attempt after a failed one.
        let dead_letter = self.delivery.dead_letters.wake_at(now);
        [
            delayed,
            dead_letter,
            heal,
            deadline,
            self.driver.grace_at(),
            trim,
            self.delivery.read_retry_at,
            self.delivery_lease_retry_at,
            self.idle_at(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn log(&self) -> BrokerResult<&Arc<dyn PartitionLog>> {
        self.log
            .as_ref()
            .ok_or_else(|| BrokerError::Closed(format!("queue {:?}", self.ctx.queue)))
    }

    /// Why the log stopped, while it is stopped (or healing): every stop of this owner is its
    /// log's error, `BrokerError::Log`.
    fn stop_error(&self) -> Option<LogError> {
        self.driver.stopped().map(|error| match error {
            BrokerError::Log(error) => error.clone(),
            other => LogError::Invalid(other.to_string()),
        })
    }

    fn unavailable(&self, source: LogError) -> BrokerError {
        BrokerError::Unavailable {
            queue: self.ctx.queue.clone(),
            partition: self.ctx.index,
            source,
        }
    }

    /// Handle one command; `Some` when the owner must exit.
    fn handle(&mut self, command: Command) -> Option<Exit> {
        match command {
            Command::Publish {
                payloads,
                timestamp_ms,
                internal,
                reply,
            } => self.publish(payloads, timestamp_ms, internal, reply),
            Command::Subscribe { link } => self.delivery.consumers.push(link),
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
            Command::DeadLetterAttempt(done) => self.dead_letter_done(done),
            Command::Log(event) => self.log_event(event),
            Command::PrefixRemoved { result } => self.prefix_removed(result),
            Command::HandedBack { result } => self.handed_back(result),
            Command::DeliveryRead(batch) => self.delivery_read(batch),
            Command::RelocationRead(read) => self.relocation_read(read),
            Command::FollowRead(read) => self.follow_read(read),
            Command::JobDone(done) => self.job_done(done),
            Command::CheckState { reply } => self.check_requests.push(reply),
            Command::Close { reply } => return Some(Exit::Close(reply)),
            Command::Delete { reply } => return Some(Exit::Delete(reply)),
            Command::Replace { reply } => {
                self.answer_moved();
                let consumers = if self.driver.role().leading {
                    let reason = Role {
                        leading: false,
                        leader: None,
                        addr: None,
                        from: 0,
                    }
                    .not_leader(&self.ctx.queue, self.ctx.index);
                    for link in std::mem::take(&mut self.delivery.consumers) {
                        link.end(reason.clone());
                    }
                    Vec::new()
                } else {
                    std::mem::take(&mut self.delivery.consumers)
                };
                return Some(Exit::Replace(reply, consumers));
            }
        }
        None
    }

    /// The records of `range` are durable: apply them, then answer.
    fn apply(&mut self, range: Range<u64>, records: Vec<PartitionRecord>, done: Done) {
        for (offset, record) in range.clone().zip(&records) {
            self.unbook(record);
            match self.state.apply(offset, record) {
                Ok(applied) => self.applied(applied),
                Err(error) => {
                    self.out_of_step(offset, &error);
                    break;
                }
            }
        }
        self.state_check_due = true;
        // Before answering: the figures a publisher reads after its confirm show the drops it
        // owed, and nothing applied here is delivered before the drops owed by it are picked.
        self.trim_due = true;
        self.trim_to_limits();
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

    /// The state machine refused the durable record at `offset`: the state no longer follows
    /// the log. That is a bug (debug builds stop here); a release build stops the partition, and
    /// the heal rebuilds the state from the log, which holds the record (so answering its
    /// publish as confirmed stays true).
    fn out_of_step(&mut self, offset: u64, error: &BrokerError) {
        tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, offset, %error, "state machine refused a durable record; stopping the partition to rebuild its state from the log");
        if cfg!(debug_assertions) {
            panic!(
                "queue {:?} partition {}: state machine refused the durable record at offset \
                 {offset}: {error}",
                self.ctx.queue, self.ctx.index
            );
        }
        self.stop(LogError::Invalid(format!(
            "partition state out of step with its log at offset {offset} ({error}); it is \
             rebuilt from the log at the next heal"
        )));
    }

    /// A record is applied or failed: it no longer needs the bookkeeping of its writing. A
    /// settle's messages leave `limbo` and `dropping` whether or not the state still had them
    /// live (a purge or a settle applied before may have taken them): an entry left there would
    /// count as busy for good.
    fn unbook(&mut self, record: &PartitionRecord) {
        match record {
            PartitionRecord::Enqueue { size_bytes, .. } => {
                self.unreserve(1, u64::from(*size_bytes))
            }
            PartitionRecord::Settle(entries) => {
                for entry in entries {
                    self.delivery.limbo.remove(&entry.message);
                    self.undrop(entry.message);
                }
            }
            PartitionRecord::Purge(purge) => {
                self.purging_count = self.purging_count.saturating_sub(purge.count);
                self.purging_bytes = self.purging_bytes.saturating_sub(purge.bytes);
            }
            _ => {}
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
            Applied::Settings | Applied::Nothing | Applied::Duplicate { .. } => {}
            // Space reclaim may cut the log here now.
            Applied::Checkpointed => self.reclaim_due = true,
            Applied::Settled(messages) => {
                // A count still pending (a return, or a refused settle, not written) goes with
                // its message.
                for m in messages {
                    self.delivery.counts_pending.remove(&m);
                }
                self.reclaim_due = true;
            }
            Applied::Returned(messages) => {
                // A later return of the same message may still be on its way to the log: its
                // count stays pending until the state has caught up with it.
                for m in messages {
                    let durable = self.state.delivery_count(m);
                    let caught_up = self
                        .delivery
                        .counts_pending
                        .get(&m)
                        .is_some_and(|&c| c <= durable);
                    if caught_up || !self.state.is_live(m) {
                        self.delivery.counts_pending.remove(&m);
                    }
                }
            }
            Applied::Purged(ranges) => {
                self.delivery.purged(&ranges);
                self.reclaim_due = true;
            }
        }
    }

    /// An append failed (the log stopped): nothing of it was applied.
    fn fail(&mut self, records: Vec<PartitionRecord>, done: Done, error: BrokerError) {
        for record in &records {
            match record {
                PartitionRecord::Enqueue { size_bytes, .. } => {
                    self.unreserve(1, u64::from(*size_bytes))
                }
                PartitionRecord::Purge(purge) => {
                    self.purging_count = self.purging_count.saturating_sub(purge.count);
                    self.purging_bytes = self.purging_bytes.saturating_sub(purge.bytes);
                }
                _ => {}
            }
        }
        // Messages whose settle or return was being written are ready again. A settled one
        // that a consumer held (all but those `drop_oldest` took from the ready ones) was
        // delivered, and no RETURN record says so: its next delivery counts this one and is
        // flagged redelivered (a log refuses writes while the owner still leads: during a
        // leadership transfer, or with its lease lapsed).
        for record in &records {
            let messages: Vec<(u64, bool)> = match record {
                PartitionRecord::Settle(entries) => {
                    entries.iter().map(|e| (e.message, true)).collect()
                }
                PartitionRecord::Return(entries) => {
                    entries.iter().map(|e| (e.message, false)).collect()
                }
                _ => Vec::new(),
            };
            for (m, settled) in messages {
                let delivered = settled && !self.dropping.contains_key(&m);
                self.undrop(m);
                if self.delivery.limbo.remove(&m).is_some() {
                    if delivered {
                        self.delivery.count_delivery(&self.state, m);
                    }
                    self.delivery.redeliver.insert(m);
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

    /// The log stopped with `error`: refuse appends until [`Owner::maybe_heal`] reopens it.
    /// Each stop is counted once, for attention items and metrics.
    fn stop(&mut self, error: LogError) {
        if self.driver.stop(BrokerError::Log(error), Instant::now()) {
            self.figures.stops.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn publish_figures(&mut self) {
        let f = &self.figures;
        let busy = self.delivery.busy_count();
        f.ready.store(
            self.state.live_count().saturating_sub(busy),
            Ordering::Relaxed,
        );
        f.inflight
            .store(self.delivery.inflight.len() as u64, Ordering::Relaxed);
        f.dead_letters_held
            .store(self.delivery.dead_letters.len() as u64, Ordering::Relaxed);
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
        f.stopped.store(
            u64::from(self.driver.stopped().is_some()),
            Ordering::Relaxed,
        );
        if f.full.load(Ordering::Relaxed) != 0 && self.has_room() {
            f.full.store(0, Ordering::Relaxed);
        }
    }
}
