//! Crash at every step, fail at every step: one appender runs a fixed workload (appends of varied
//! sizes and multi-record batches, automatic and explicit rolls, a truncation inside a segment
//! and one at a segment boundary, a prefix removal, hand-backs of every segment, one with
//! appends queued before and after it, restarts far past the end of a log with two segments,
//! with appends queued before and after it, and of a handed-back log, and a clean close) on the
//! simulated disk. The log starts without a directory (lazy creation at the first append); its
//! segment files grow by preallocation steps (64, 128, 192, 256 KiB) and roll; after a hand-back
//! or a restart the next append creates a segment at the anchor's offset, and the workload ends
//! restarted without a segment. Its
//! sequence of `Io` calls is deterministic, so the test first counts the calls, then replays the
//! workload once per call index `k`:
//!
//! - with a power loss right after call `k`: the log must reopen, every acknowledged record that
//!   no acknowledged truncation or prefix removal took away must read back byte for byte, every
//!   record that reads back must be one that was written at that offset (and not removed by an
//!   acknowledged truncation), the offsets must run without a gap, the next offset must not be
//!   below the end of what was acknowledged (a hand-back keeps it), a restart in flight must
//!   have left the log ending where it ended or empty at its offset, and the log must take a new
//!   append and reopen again;
//! - with call `k` failing with `EIO`: the log stops (every later append gets `Stopped`, durable
//!   records still read), `heal()` (or a reopen when `open` itself failed) brings back every
//!   acknowledged record, and so does a power loss after that.
//!
//! It fails if recovery refuses a state a crash can leave, loses or alters a confirmed record,
//! resurrects a truncated one, returns a record nobody wrote, or if a failed call leaves the log
//! running, unhealable or with different data. A failure message names `k` and the seed; replay
//! the whole loop with `KERATIN_SEED=<seed>` or one step with `KERATIN_STEP=<k>`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use common::gate::{Gate, GatedIo};
use common::{payload, read_all, record, small_options};
use keratin_log::{Io, Log, LogError, PoolOptions, SegmentPool, SimFault, SimIo, Ticket};

const DIR: &str = "/sim/log";

/// One step of the workload.
#[derive(Debug, Clone)]
enum Step {
    /// Append one batch with these payload lengths and wait for it.
    Append(Vec<usize>),
    /// An explicit roll.
    Roll,
    /// Truncate the last three offsets (inside the active segment).
    TruncateInside,
    /// Truncate at the base of the last segment: it goes, the one before becomes active.
    TruncateAtBoundary,
    /// Remove the first segment (cut just past the second segment's base).
    RemovePrefix,
    /// Hand every segment back to the pool.
    HandBack,
    /// Restart the log this far past its next offset.
    RestartPast(u64),
    /// As `HandBackWithPending`, with a restart this far past the next offset instead.
    RestartWithPending(u64),
    /// One append held in its sync, then two appends, a hand-back and one more append queued
    /// behind it: the commit path takes the last four in one round.
    HandBackWithPending,
    /// Close the log.
    Close,
}

/// Payload lengths that cycle through small, medium and large records, so that records straddle
/// sectors and segments fill at uneven positions.
fn lengths(i: usize) -> Vec<usize> {
    const SIZES: [usize; 7] = [120, 2_500, 11_000, 700, 17_000, 60, 6_000];
    let len = SIZES[i % SIZES.len()];
    if i % 5 == 3 {
        // A multi-record batch: three records of different sizes.
        vec![len / 3 + 1, 40, len / 2 + 7]
    } else {
        vec![len]
    }
}

fn appends(from: usize, count: usize) -> impl Iterator<Item = Step> {
    (from..from + count).map(|i| Step::Append(lengths(i)))
}

/// The workload: about 320 KiB before the explicit roll and 270 KiB after the first
/// truncation, so that it rolls on its own twice with 256 KiB segments; it ends with four
/// segments before the boundary truncation and three before the prefix removal.
fn workload() -> Vec<Step> {
    let mut steps: Vec<Step> = appends(0, 60).collect();
    steps.push(Step::Roll);
    steps.extend(appends(60, 6));
    steps.push(Step::TruncateInside);
    steps.extend(appends(66, 50));
    steps.push(Step::TruncateAtBoundary);
    steps.extend(appends(116, 4));
    steps.push(Step::RemovePrefix);
    steps.extend(appends(120, 4));
    steps.push(Step::RestartPast(1_000_000));
    steps.extend(appends(140, 30));
    steps.push(Step::HandBack);
    steps.extend(appends(124, 3));
    steps.push(Step::HandBackWithPending);
    steps.extend(appends(127, 2));
    steps.push(Step::RestartWithPending(5_000));
    steps.extend(appends(130, 2));
    steps.push(Step::HandBack);
    steps.push(Step::RestartPast(70_000));
    steps.push(Step::Close);
    steps
}

/// A request whose outcome is unknown when the workload stopped.
#[derive(Debug, Clone, Copy)]
enum InFlight {
    Truncate(u64),
    RemovePrefix(u64),
    /// A hand-back: a crash may leave its segments, a suffix of them, or none.
    HandBack,
    /// A restart from `end` (the next offset when it was asked for) to `offset`: a crash may
    /// leave the segments, a suffix of them (ending at `end`), none at `end`, or none at
    /// `offset`.
    Restart {
        end: u64,
        offset: u64,
    },
}

/// What the appender knows: what must read back, and what may.
#[derive(Debug, Clone, Default)]
struct Tracker {
    /// Offset → the payload acknowledged there last.
    acked: BTreeMap<u64, Vec<u8>>,
    /// Offset → every payload submitted there that no acknowledged truncation removed.
    allowed: BTreeMap<u64, Vec<Vec<u8>>>,
    /// The start offset after the last acknowledged prefix removal: removed segments must not
    /// come back.
    start_floor: u64,
    /// One past the last acknowledged offset (an acknowledged truncation lowers it): the next
    /// offset of a recovered log is never below it.
    next_floor: u64,
    /// Version stamped into the next payloads, so that rewrites of an offset differ.
    version: u32,
    in_flight: Option<InFlight>,
    /// `Io` calls made when each workload step ended (to find where two runs differ).
    trace: Vec<u64>,
}

impl Tracker {
    /// The records that must read back whatever happened to the request in flight.
    fn required(&self) -> BTreeMap<u64, Vec<u8>> {
        let mut required = self.acked.clone();
        match self.in_flight {
            Some(InFlight::Truncate(offset)) => required.retain(|o, _| *o < offset),
            Some(InFlight::RemovePrefix(before)) => required.retain(|o, _| *o >= before),
            Some(InFlight::HandBack) | Some(InFlight::Restart { .. }) => required.clear(),
            None => {}
        }
        required
    }

    /// The lowest next offset a recovered log may have.
    fn next_floor(&self) -> u64 {
        match self.in_flight {
            Some(InFlight::Truncate(offset)) => self.next_floor.min(offset),
            _ => self.next_floor,
        }
    }

    fn truncated(&mut self, offset: u64) {
        self.acked.retain(|o, _| *o < offset);
        self.allowed.retain(|o, _| *o < offset);
        self.next_floor = offset;
    }

    /// An acknowledged hand-back: nothing is held, the offsets go on.
    fn handed_back(&mut self, log: &Log) {
        self.acked.clear();
        self.start_floor = log.start_offset();
        self.in_flight = None;
    }

    /// An acknowledged restart at `offset`: nothing below it may come back, and the offsets go
    /// on from it.
    fn restarted(&mut self, log: &Log, offset: u64) {
        assert_eq!(log.start_offset(), offset);
        self.acked.clear();
        self.start_floor = offset;
        self.next_floor = offset;
        self.in_flight = None;
    }

    /// After a recovery, exactly what the log holds is durable: it becomes the new truth.
    fn reset_to(&mut self, log: &Log, context: &str) {
        let records = read_all(log, context);
        self.acked = records
            .iter()
            .map(|r| (r.offset, r.payload.clone()))
            .collect();
        self.allowed = records
            .into_iter()
            .map(|r| (r.offset, vec![r.payload]))
            .collect();
        self.start_floor = log.start_offset();
        self.next_floor = log.next_offset();
        self.in_flight = None;
    }

    /// Append one batch and wait; the acknowledged records become required.
    fn append(&mut self, log: &Log, lengths: &[usize]) -> Result<(), LogError> {
        let submitted = self.submit(log, lengths)?;
        self.confirm(submitted)
    }

    /// Submit one batch without waiting.
    fn submit(&mut self, log: &Log, lengths: &[usize]) -> Result<Submitted, LogError> {
        self.version += 1;
        let first = log.next_offset();
        let bodies: Vec<Vec<u8>> = lengths
            .iter()
            .enumerate()
            .map(|(i, len)| payload(first + i as u64, self.version, *len))
            .collect();
        for (i, body) in bodies.iter().enumerate() {
            let allowed = self.allowed.entry(first + i as u64).or_default();
            allowed.push(body.clone());
        }
        let records: Vec<_> = bodies.iter().map(|b| record(b)).collect();
        let ticket = log.append(&records)?;
        Ok(Submitted {
            ticket,
            first,
            bodies,
        })
    }

    /// Wait for a submitted batch; once acknowledged, its records are required.
    fn confirm(&mut self, submitted: Submitted) -> Result<(), LogError> {
        let Submitted {
            ticket,
            first,
            bodies,
        } = submitted;
        let offsets = ticket.wait()?;
        assert_eq!(offsets, first..first + bodies.len() as u64);
        self.next_floor = self.next_floor.max(offsets.end);
        for (i, body) in bodies.into_iter().enumerate() {
            self.acked.insert(first + i as u64, body);
        }
        Ok(())
    }

    /// A hand-back (`restart_past` `None`) or a restart with appends queued before and after it
    /// (see [`Step::HandBackWithPending`]).
    fn hand_back_with_pending(
        &mut self,
        log: &Log,
        gate: &Gate,
        restart_past: Option<u64>,
    ) -> Result<(), LogError> {
        gate.close();
        let result = self.hand_back_with_pending_gated(log, gate, restart_past);
        gate.open();
        result
    }

    fn hand_back_with_pending_gated(
        &mut self,
        log: &Log,
        gate: &Gate,
        restart_past: Option<u64>,
    ) -> Result<(), LogError> {
        let held = self.submit(log, &[900])?;
        // A failure before the sync stops the log instead: nothing is held then.
        let limit = std::time::Duration::from_secs(10);
        if !gate.wait_for_held_sync(limit, || log.stopped().is_some()) {
            gate.open();
            return self.confirm(held).and(Err(log.stopped().expect("stopped")));
        }
        let before = self.submit(log, &[1_500, 20]);
        let end = log.next_offset();
        let restart = restart_past.map(|past| end + past);
        let hand_back = match restart {
            Some(offset) => log.restart_at(offset),
            None => log.hand_back(),
        };
        let after = self.submit(log, &[700]);
        gate.open();
        self.confirm(held)?;
        self.confirm(before?)?;
        let hand_back = hand_back?;
        self.in_flight = Some(match restart {
            Some(offset) => InFlight::Restart { end, offset },
            None => InFlight::HandBack,
        });
        hand_back.wait()?;
        match restart {
            Some(offset) => self.restarted(log, offset),
            None => self.handed_back(log),
        }
        self.confirm(after?)
    }
}

/// A batch submitted and not yet acknowledged.
struct Submitted {
    ticket: Ticket<std::ops::Range<u64>>,
    first: u64,
    bodies: Vec<Vec<u8>>,
}

/// How a run of the workload ended.
struct Run {
    /// The log, unless `open` failed or `close` consumed it.
    log: Option<Log>,
    /// The first error and the index of the workload step that got it (`None`: `open`).
    error: Option<(Option<usize>, LogError)>,
}

/// Open the log with a pool that rewrites spare headers inline: a background worker would make
/// the sequence of `Io` calls depend on thread timing.
fn open(io: &SimIo) -> Result<Log, LogError> {
    open_gated(io, Arc::new(Gate::default()))
}

fn open_gated(io: &SimIo, gate: Arc<Gate>) -> Result<Log, LogError> {
    let io: Arc<dyn Io> = Arc::new(GatedIo {
        inner: io.clone(),
        gate,
    });
    let options = small_options();
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: options.full_segment_size_bytes,
            budget_bytes: Some(4 * options.full_segment_size_bytes),
            background: false,
            ..PoolOptions::default()
        },
    );
    Log::open(io, Path::new(DIR), options, Some(pool))
}

/// Run the workload until its first error.
fn run(io: &SimIo, tracker: &mut Tracker) -> Run {
    let gate = Arc::new(Gate::default());
    let log = match open_gated(io, gate.clone()) {
        Ok(log) => log,
        Err(e) => {
            return Run {
                log: None,
                error: Some((None, e)),
            }
        }
    };
    for (index, step) in workload().into_iter().enumerate() {
        let result = match step {
            Step::Append(lengths) => tracker.append(&log, &lengths),
            Step::Roll => log.roll().and_then(|t| t.wait()),
            Step::TruncateInside | Step::TruncateAtBoundary => {
                let stats = log.stats();
                let last_base = stats.segments.last().expect("a segment").base_offset;
                let offset = if matches!(step, Step::TruncateInside) {
                    let offset = log.next_offset() - 3;
                    assert!(
                        offset > last_base,
                        "the workload truncates inside a segment"
                    );
                    offset
                } else {
                    assert!(
                        last_base > stats.start_offset,
                        "the workload has two segments"
                    );
                    last_base
                };
                tracker.in_flight = Some(InFlight::Truncate(offset));
                let result = log.truncate_suffix(offset).and_then(|t| t.wait());
                if result.is_ok() {
                    tracker.truncated(offset);
                    tracker.in_flight = None;
                }
                result
            }
            Step::RemovePrefix => {
                let stats = log.stats();
                assert!(stats.segments.len() > 2, "the workload has three segments");
                let before = stats.segments[1].base_offset + 1;
                tracker.in_flight = Some(InFlight::RemovePrefix(before));
                let result = log.remove_prefix(before).and_then(|t| t.wait());
                if let Ok(removed) = &result {
                    assert_eq!(removed.segments, 1);
                    tracker.start_floor = log.start_offset();
                    let floor = tracker.start_floor;
                    tracker.acked.retain(|o, _| *o >= floor);
                    tracker.in_flight = None;
                }
                result.map(|_| ())
            }
            Step::HandBack => {
                tracker.in_flight = Some(InFlight::HandBack);
                let result = log.hand_back().and_then(|t| t.wait());
                if let Ok(removed) = &result {
                    assert!(
                        removed.segments >= 1,
                        "the workload hands back a written log"
                    );
                    assert_eq!(log.disk_bytes(), 0);
                    tracker.handed_back(&log);
                }
                result.map(|_| ())
            }
            Step::HandBackWithPending => tracker.hand_back_with_pending(&log, &gate, None),
            Step::RestartWithPending(past) => {
                tracker.hand_back_with_pending(&log, &gate, Some(past))
            }
            Step::RestartPast(past) => {
                let end = log.next_offset();
                let offset = end + past;
                let segments = log.stats().segments.len();
                tracker.in_flight = Some(InFlight::Restart { end, offset });
                let result = log.restart_at(offset).and_then(|t| t.wait());
                if let Ok(removed) = &result {
                    assert_eq!(removed.segments, segments);
                    assert_eq!(log.disk_bytes(), 0);
                    tracker.restarted(&log, offset);
                }
                result.map(|_| ())
            }
            Step::Close => {
                // A failed idle-seal write after the last group stops the log while that group
                // is answered as durable (it is): the stop shows in `stopped()`, and closing a
                // stopped log has nothing to write.
                if let Some(stop) = log.stopped() {
                    return Run {
                        log: Some(log),
                        error: Some((Some(index), stop)),
                    };
                }
                return Run {
                    log: None,
                    error: log.close().err().map(|e| (Some(index), e)),
                };
            }
        };
        tracker.trace.push(io.steps());
        if let Err(error) = result {
            return Run {
                log: Some(log),
                error: Some((Some(index), error)),
            };
        }
    }
    unreachable!("the workload ends with a close")
}

/// Check a log just opened or healed against what the appender knows.
fn verify(log: &Log, tracker: &Tracker, context: &str) {
    assert!(log.stopped().is_none(), "{context}: log is stopped");
    assert_eq!(
        log.next_offset(),
        log.durable_offset(),
        "{context}: an open log has nothing pending"
    );
    let start = log.start_offset();
    assert!(
        start >= tracker.start_floor,
        "{context}: start {start} is below {}: removed segments came back",
        tracker.start_floor
    );
    assert!(
        log.next_offset() >= tracker.next_floor(),
        "{context}: next offset {} is below {}: acknowledged offsets would be handed out again",
        log.next_offset(),
        tracker.next_floor()
    );
    if let Some(InFlight::Restart { end, offset }) = tracker.in_flight {
        // Before, a suffix of the segments (ending at `end`), none at `end`, or none at
        // `offset`: never a lower end, never records below `offset` once it is the end.
        let durable = log.durable_offset();
        assert!(
            durable == end || durable == offset,
            "{context}: a restart from {end} to {offset} left a log ending at {durable}"
        );
        if durable != end {
            assert_eq!(start, offset, "{context}: records below a restart's offset");
        }
    }
    let records = read_all(log, context);
    for record in &records {
        let allowed = tracker.allowed.get(&record.offset);
        assert!(
            allowed.is_some_and(|a| a.contains(&record.payload)),
            "{context}: offset {} holds a record that was never written there (or was \
             truncated away): origin {:?}",
            record.offset,
            common::payload_origin(&record.payload)
        );
    }
    for (offset, body) in tracker.required() {
        let index = offset.checked_sub(start).map(|i| i as usize);
        let found = index.and_then(|i| records.get(i));
        assert!(
            found.is_some_and(|r| r.payload == *body),
            "{context}: acknowledged offset {offset} is lost or altered (log holds {start}..{})",
            start + records.len() as u64
        );
    }
}

/// After recovery: take the recovered state as the truth, append, reopen, compare.
fn append_and_reopen(log: Log, tracker: &mut Tracker, reopen: impl Fn() -> Log, context: &str) {
    tracker.reset_to(&log, context);
    tracker
        .append(&log, &[333, 5])
        .unwrap_or_else(|e| panic!("{context}: append after recovery: {e}"));
    log.close()
        .unwrap_or_else(|e| panic!("{context}: close after recovery: {e}"));
    let log = reopen();
    verify(
        &log,
        tracker,
        &format!("{context}, reopened after a new append"),
    );
    assert_eq!(read_all(&log, context).len(), tracker.acked.len());
}

fn base_seed() -> u64 {
    common::seed(0x6b65_7261_7469_6e00)
}

/// Crash outcomes tried per call index (`KERATIN_CRASH_SEEDS`, default 3): a crash tears each
/// unsynced sector its own way, so one call index hides several states.
fn crash_seeds_per_step() -> u64 {
    std::env::var("KERATIN_CRASH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

fn sim_seed(base: u64, step: u64) -> u64 {
    base ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The call indexes to try: all of them, or the one `KERATIN_STEP` names.
fn steps_to_try(total: u64) -> Vec<u64> {
    match std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(step) => vec![step],
        None => (0..total).collect(),
    }
}

/// The number of `Io` calls of the whole workload, with a check that it is deterministic.
fn count_steps(base: u64) -> u64 {
    let count = |seed| {
        let io = SimIo::new(seed);
        let mut tracker = Tracker::default();
        let run = run(&io, &mut tracker);
        assert!(
            run.error.is_none(),
            "fault-free run failed: {:?}",
            run.error
        );
        let steps = io.steps();
        let log = open(&io).expect("reopen after the fault-free run");
        verify(&log, &tracker, "fault-free run");
        (steps, tracker.trace)
    };
    let (steps, trace) = count(base);
    for attempt in 0..3 {
        let (again, other) = count(base ^ attempt);
        let differs = trace.iter().zip(&other).position(|(a, b)| a != b);
        assert_eq!(
            (steps, differs),
            (again, None),
            "the workload's calls are not deterministic (steps after each workload step: \
             {trace:?} vs {other:?})"
        );
    }
    steps
}

fn context(kind: &str, k: u64, base: u64, error: &Option<(Option<usize>, LogError)>) -> String {
    let at = match error {
        Some((Some(index), e)) => format!("workload step {index} failed: {e}"),
        Some((None, e)) => format!("open failed: {e}"),
        None => "workload completed".into(),
    };
    format!("{kind} at call {k} (replay: KERATIN_SEED={base} KERATIN_STEP={k}; {at})")
}

#[test]
fn crash_after_every_call_and_reopen() {
    let started = Instant::now();
    let base = base_seed();
    let total = count_steps(base);
    eprintln!("workload: {total} Io calls");
    let (mut failed_runs, mut clean_runs) = (0, 0);
    let crash_points = steps_to_try(total)
        .into_iter()
        .flat_map(|k| (0..crash_seeds_per_step()).map(move |variant| (k, variant)));
    for (k, variant) in crash_points {
        let seed = sim_seed(base, k) ^ variant;
        let io = SimIo::new(seed);
        io.crash_after(k);
        let mut tracker = Tracker::default();
        let run = run(&io, &mut tracker);
        let context = context("crash", k, base, &run.error);
        let context = format!("{context}, crash variant {variant}");
        match &run.error {
            Some(_) => failed_runs += 1,
            None => clean_runs += 1,
        }
        drop(run.log);
        let io = io.restart();
        let log = open(&io).unwrap_or_else(|e| panic!("{context}: recovery failed: {e}"));
        verify(&log, &tracker, &context);
        let reopen = || open(&io).unwrap_or_else(|e| panic!("{context}: second reopen: {e}"));
        append_and_reopen(log, &mut tracker, reopen, &context);
    }
    eprintln!(
        "crashed {failed_runs} runs mid-workload, {clean_runs} after it, in {:?}",
        started.elapsed()
    );
    if std::env::var("KERATIN_STEP").is_err() {
        // Only a crash after the very last call leaves the workload complete.
        assert_eq!(
            clean_runs,
            crash_seeds_per_step(),
            "the crashes hit the workload"
        );
    }
}

#[test]
fn fail_every_call_with_eio_then_heal() {
    fail_every_call_then_heal(SimFault::Eio, "EIO");
}

/// `ENOSPC` at every call: at a preallocation step, a segment creation, an anchor, a rename...
/// The log stops as for `EIO` (nothing retried in place) and heals once space is back.
#[test]
fn fail_every_call_with_no_space_then_heal() {
    fail_every_call_then_heal(SimFault::NoSpace, "ENOSPC");
}

fn fail_every_call_then_heal(fault: SimFault, name: &str) {
    let started = Instant::now();
    let base = base_seed();
    let total = count_steps(base);
    eprintln!("workload: {total} Io calls");
    let mut healed = 0;
    for k in steps_to_try(total) {
        let seed = sim_seed(base, k);
        let io = SimIo::new(seed);
        io.fail_at(k, fault);
        let mut tracker = Tracker::default();
        let run = run(&io, &mut tracker);
        let context = context(name, k, base, &run.error);
        let error = run.error.as_ref().map(|(_, e)| e.clone());
        let log = match (run.log, error) {
            (Some(log), Some(error)) => {
                check_stopped(&log, &error, &tracker, &context);
                log.heal()
                    .unwrap_or_else(|e| panic!("{context}: heal failed: {e}"));
                healed += 1;
                log
            }
            // `open` or `close` failed: nothing to heal, open again on the same disk.
            (None, Some(_)) => open(&io).unwrap_or_else(|e| panic!("{context}: reopen: {e}")),
            (_, None) => panic!("{context}: a failed call went unnoticed"),
        };
        verify(&log, &tracker, &format!("{context}, healed"));
        tracker.reset_to(&log, &context);
        tracker
            .append(&log, &[444])
            .unwrap_or_else(|e| panic!("{context}: append after heal: {e}"));
        // A power loss after the heal keeps everything acknowledged since.
        let io = io.restart();
        drop(log);
        let log = open(&io).unwrap_or_else(|e| panic!("{context}: open after heal+crash: {e}"));
        verify(&log, &tracker, &format!("{context}, healed then crashed"));
    }
    eprintln!(
        "{name}: healed {healed} stopped logs in {:?}",
        started.elapsed()
    );
    assert!(healed > 0);
}

/// A log whose write path failed is stopped, says so with a typed error, and still serves every
/// durable record.
fn check_stopped(log: &Log, error: &LogError, tracker: &Tracker, context: &str) {
    assert!(error.is_stopped(), "{context}: the error is not `Stopped`");
    let stop = log
        .stopped()
        .unwrap_or_else(|| panic!("{context}: log is not stopped"));
    assert!(stop.is_stopped(), "{context}: the stop reason is {stop:?}");
    let refused = log.append(&[record(b"after the failure")]);
    assert!(
        matches!(&refused, Err(e) if e.is_stopped()),
        "{context}: an append after the failure got {:?}",
        refused.map(|_| ())
    );
    let durable = log.durable_offset();
    for (offset, body) in tracker.required() {
        if offset < durable && offset >= log.start_offset() {
            let read = log
                .read(offset)
                .unwrap_or_else(|e| panic!("{context}: durable read of {offset}: {e}"));
            assert_eq!(read.payload, body, "{context}: offset {offset}");
        }
    }
}
