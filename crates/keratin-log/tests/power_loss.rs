//! Crash at every step with power loss, over the moments where fsync ordering matters most:
//! taking spares after segments have entered the pool, rolls (fresh files and spares, on their own
//! mid-batch and explicit), hand-backs (anchor, segments to the pool, the next append at the
//! anchor's offset from a short spare, a reopen after a hand-back), restarts past the end (of a
//! log with two segments, of a log never written, of a handed-back log, and after a reopen), a
//! failed sync followed by a
//! heal or a process restart, and a second power loss at every step of the recovery that follows
//! a first one.
//!
//! `SimIo` crashes are power losses: every write, create and rename not covered by a completed
//! sync (`sync_data` for data, `sync_dir` for names) may be lost, torn by sector, and a failed
//! sync drops its writes from the durable path for good (fsyncgate). Each sweep first counts the
//! `Io` calls of its workload (deterministic: the pool rewrites spare headers inline), then
//! replays it once per call index and crash variant, and checks after the restart:
//!
//! - every acknowledged record not removed by an acknowledged request reads back byte for byte;
//! - every record that reads back is one that was written at its offset, in that log;
//! - the next offset is not below the end of what was acknowledged (a hand-back keeps it); a
//!   restart in flight left the log ending where it ended or empty at its offset, and records
//!   below an acknowledged restart's offset never come back;
//! - the log takes a new append and reopens with it;
//! - no ready spare holds a valid record of its own generation (the next log to take it could
//!   adopt it, or see a false `Corrupt`).
//!
//! A failure names the sweep, the call index and the seed. Replay a sweep with
//! `KERATIN_SEED=<seed>`, one call index with `KERATIN_STEP=<k>`; `KERATIN_CRASH_SEEDS` sets the
//! crash variants per call index (default 2) and `KERATIN_RECOVERY_STRIDE` the stride of first
//! crashes for the crash-during-recovery sweep (default 10). Each sweep prints its call count.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use common::{payload, payload_origin, record};
use keratin_log::format::{
    check_record, HeaderKind, SegmentHeader, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE,
};
use keratin_log::{Io, Log, LogError, LogOptions, PoolOptions, SegmentPool, SimFault, SimIo};

const ROOT: &str = "/node";
const SEGMENT: u64 = 256 << 10;

fn options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: SEGMENT,
        ..LogOptions::default()
    }
}

/// A node pool on `ROOT` that rewrites spare headers inline (a background worker would make the
/// sequence of `Io` calls depend on thread timing).
fn node_pool(io: &Arc<dyn Io>) -> Result<SegmentPool, LogError> {
    let root = Path::new(ROOT);
    if !io
        .exists(root)
        .map_err(|e| LogError::Invalid(e.to_string()))?
    {
        io.create_dir_all(root)
            .map_err(|e| LogError::Invalid(e.to_string()))?;
    }
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: SEGMENT,
            budget_bytes: Some(8 * SEGMENT),
            background: false,
            ..PoolOptions::default()
        },
    );
    pool.add_storage_dir(root)?;
    Ok(pool)
}

fn open_log(io: &Arc<dyn Io>, pool: &SegmentPool, name: &str) -> Result<Log, LogError> {
    Log::open(
        io.clone(),
        &Path::new(ROOT).join(name),
        options(),
        Some(pool.clone()),
    )
}

/// What the workload knows about each log: the records that must read back and the versions
/// written (a record that reads back must carry one of them, at its own offset).
#[derive(Debug, Default, Clone)]
struct Model {
    /// Log name → offset → payload acknowledged there.
    required: BTreeMap<String, BTreeMap<u64, Vec<u8>>>,
    /// Log name → versions whose payloads may appear.
    versions: BTreeMap<String, Vec<u32>>,
    /// Log name → one past its last acknowledged offset: its next offset never goes below.
    next_floor: BTreeMap<String, u64>,
    /// Log name → the offset of its last acknowledged restart: nothing below it comes back.
    start_floor: BTreeMap<String, u64>,
    /// Log name → (its next offset, the restart's offset) of a restart asked for and not yet
    /// acknowledged.
    restarting: BTreeMap<String, (u64, u64)>,
}

impl Model {
    /// Append one batch of `lengths` to `log` (called `name`), stamped with `version`; on success
    /// the records are required.
    fn append(
        &mut self,
        log: &Log,
        name: &str,
        version: u32,
        lengths: &[usize],
    ) -> Result<(), LogError> {
        let versions = self.versions.entry(name.into()).or_default();
        if !versions.contains(&version) {
            versions.push(version);
        }
        let first = log.next_offset();
        let bodies: Vec<Vec<u8>> = lengths
            .iter()
            .enumerate()
            .map(|(i, len)| payload(first + i as u64, version, *len))
            .collect();
        let records: Vec<_> = bodies.iter().map(|b| record(b)).collect();
        let offsets = log.append(&records)?.wait()?;
        assert_eq!(offsets, first..first + bodies.len() as u64);
        let floor = self.next_floor.entry(name.into()).or_default();
        *floor = (*floor).max(offsets.end);
        let required = self.required.entry(name.into()).or_default();
        for (i, body) in bodies.into_iter().enumerate() {
            required.insert(first + i as u64, body);
        }
        Ok(())
    }

    /// Hand every segment of `log` back: its records may go from the moment it is asked for;
    /// its offsets stay.
    fn hand_back(&mut self, log: &Log, name: &str) -> Result<(), LogError> {
        self.removing_prefix(name, u64::MAX);
        let removed = log.hand_back()?.wait()?;
        assert!(removed.segments >= 1);
        assert_eq!(log.disk_bytes(), 0);
        Ok(())
    }

    /// Restart `log` at `offset`: its records may go from the moment it is asked for; a crash
    /// leaves it ending where it ended, or empty at `offset`.
    fn restart_at(&mut self, log: &Log, name: &str, offset: u64) -> Result<(), LogError> {
        self.removing_prefix(name, u64::MAX);
        let segments = log.stats().segments.len();
        self.restarting
            .insert(name.into(), (log.next_offset(), offset));
        let removed = log.restart_at(offset)?.wait()?;
        self.restarting.remove(name);
        assert_eq!(removed.segments, segments);
        assert_eq!(log.disk_bytes(), 0);
        assert_eq!(log.start_offset(), offset);
        self.start_floor.insert(name.into(), offset);
        self.next_floor.insert(name.into(), offset);
        Ok(())
    }

    /// After the first check of a recovered log: what it holds is the outcome of the restart in
    /// flight, if one was.
    fn settle(&mut self, name: &str) {
        self.restarting.remove(name);
    }

    /// Records below `before` may go from the moment the removal is asked for.
    fn removing_prefix(&mut self, name: &str, before: u64) {
        if let Some(required) = self.required.get_mut(name) {
            required.retain(|offset, _| *offset >= before);
        }
    }
}

/// Check one log just opened against the model: required records read back, every record is one
/// that was written there, and offsets run without a gap.
fn verify_log(log: &Log, model: &Model, name: &str, context: &str) {
    assert!(log.stopped().is_none(), "{context}: {name} is stopped");
    let floor = model.next_floor.get(name).copied().unwrap_or(0);
    assert!(
        log.next_offset() >= floor,
        "{context}: {name}: next offset {} is below the acknowledged end {floor}",
        log.next_offset()
    );
    let start = log.start_offset();
    let start_floor = model.start_floor.get(name).copied().unwrap_or(0);
    assert!(
        start >= start_floor,
        "{context}: {name}: start {start} is below the acknowledged restart at {start_floor}"
    );
    if let Some(&(end, offset)) = model.restarting.get(name) {
        let durable = log.durable_offset();
        assert!(
            durable == end || durable == offset,
            "{context}: {name}: a restart from {end} to {offset} left a log ending at {durable}"
        );
        if durable != end {
            assert_eq!(
                start, offset,
                "{context}: {name}: records below the restart"
            );
        }
    }
    let mut held = BTreeMap::new();
    for (i, result) in log.reader(start).enumerate() {
        let record = result.unwrap_or_else(|e| panic!("{context}: {name}: read: {e}"));
        assert_eq!(record.offset, start + i as u64, "{context}: {name}: gap");
        let origin = payload_origin(&record.payload);
        let versions = model.versions.get(name).cloned().unwrap_or_default();
        assert!(
            origin.is_some_and(|(o, v)| o == record.offset && versions.contains(&v)),
            "{context}: {name} offset {} holds a record never written there: origin {origin:?}",
            record.offset
        );
        held.insert(record.offset, record.payload);
    }
    assert_eq!(
        start + held.len() as u64,
        log.durable_offset(),
        "{context}: {name}: reading stopped before the durable end"
    );
    for (offset, body) in model.required.get(name).into_iter().flatten() {
        assert!(
            held.get(offset) == Some(body),
            "{context}: {name}: acknowledged offset {offset} is lost or altered (log holds \
             {start}..{})",
            log.durable_offset()
        );
    }
}

/// No ready spare may hold a valid record of the generation its header names: the next log to
/// take it writes that generation, and a leftover could then pass as its record or as a claim.
fn check_spares(sim: &SimIo, io: &Arc<dyn Io>, context: &str) {
    let spares = Path::new(ROOT).join(keratin_log::SPARES_DIR_NAME);
    if !io.exists(&spares).expect("stat") {
        return;
    }
    for name in io.read_dir(&spares).expect("list spares") {
        let path = spares.join(&name);
        assert!(name.ends_with(".spare"), "{context}: {name} left in spares");
        let bytes = sim.read_file(&path).expect("spare file");
        let header_bytes: &[u8; SEGMENT_HEADER_SIZE] =
            bytes[..SEGMENT_HEADER_SIZE].try_into().expect("header");
        let header = SegmentHeader::decode(header_bytes)
            .unwrap_or_else(|e| panic!("{context}: {name}: header: {e}"));
        assert_eq!(header.kind, HeaderKind::Spare, "{context}: {name}");
        let mut position = SEGMENT_HEADER_SIZE;
        while position + RECORD_HEADER_SIZE <= bytes.len() {
            if let Ok(found) = check_record(&bytes[position..], header.generation) {
                panic!(
                    "{context}: spare {name} of generation {} holds a valid record of that \
                     generation at byte {position} (offset {})",
                    header.generation, found.offset
                );
            }
            position += 1;
        }
    }
}

/// After a power loss: open the pool and every log of the model, verify, append, reopen, verify.
fn check_node(sim: &SimIo, model: &Model, names: &[&str], context: &str) {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let root = Path::new(ROOT);
    if !io.exists(root).expect("stat") {
        assert!(
            model.required.values().all(BTreeMap::is_empty),
            "{context}: the node directory vanished with acknowledged records"
        );
        return;
    }
    let pool = node_pool(&io).unwrap_or_else(|e| panic!("{context}: pool: {e}"));
    check_spares(sim, &io, context);
    let mut model = model.clone();
    for name in names {
        let dir = root.join(name);
        if !io.exists(&dir).expect("stat") {
            assert!(
                model.required.get(*name).is_none_or(BTreeMap::is_empty),
                "{context}: {name} vanished with acknowledged records"
            );
            continue;
        }
        let log =
            open_log(&io, &pool, name).unwrap_or_else(|e| panic!("{context}: open {name}: {e}"));
        verify_log(&log, &model, name, context);
        model.settle(name);
        model
            .append(&log, name, 900, &[777, 20])
            .unwrap_or_else(|e| panic!("{context}: {name}: append after recovery: {e}"));
        log.close()
            .unwrap_or_else(|e| panic!("{context}: {name}: close after recovery: {e}"));
        let log =
            open_log(&io, &pool, name).unwrap_or_else(|e| panic!("{context}: reopen {name}: {e}"));
        verify_log(&log, &model, name, &format!("{context}, reopened"));
    }
}

/// Crash variants per call index: `KERATIN_CRASH_SEEDS`, or the sweep's default.
fn crash_seeds_per_step(default: u64) -> u64 {
    std::env::var("KERATIN_CRASH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn steps_to_try(total: u64) -> Vec<u64> {
    match std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(step) => vec![step],
        None => (0..total).collect(),
    }
}

fn sim_seed(base: u64, step: u64, variant: u64) -> u64 {
    base ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ variant
}

/// The logs a workload has open, by name, so that a sweep can heal them after its error.
type OpenLogs = Vec<(String, Log)>;

/// A workload over the node: runs until its first error, recording what was acknowledged.
type Workload = fn(&SimIo, &mut Model, &mut OpenLogs) -> Result<(), LogError>;

/// Close the log named `name` (taken out of `logs`).
fn close_log(logs: &mut OpenLogs, name: &str) -> Result<(), LogError> {
    let index = logs
        .iter()
        .position(|(n, _)| n == name)
        .expect("the workload closes a log it opened");
    let (_, log) = logs.remove(index);
    log.close()
}

/// The open log named `name`.
fn log_of<'a>(logs: &'a OpenLogs, name: &str) -> &'a Log {
    &logs.iter().find(|(n, _)| n == name).expect("open log").1
}

/// Count the workload's `Io` calls (checking that a clean run passes the checks).
fn count_calls(name: &str, base: u64, workload: Workload, logs: &[&str]) -> u64 {
    let sim = SimIo::new(base);
    let mut model = Model::default();
    workload(&sim, &mut model, &mut Vec::new())
        .unwrap_or_else(|e| panic!("{name}: clean run failed: {e}"));
    let calls = sim.steps();
    check_node(&sim.restart(), &model, logs, &format!("{name}: clean run"));
    calls
}

/// Crash after every call of `workload` (power loss), restart, check.
fn crash_sweep(name: &str, default_seed: u64, variants: u64, workload: Workload, logs: &[&str]) {
    let started = Instant::now();
    let base = common::seed(default_seed);
    let total = count_calls(name, base, workload, logs);
    let mut runs = 0u64;
    for k in steps_to_try(total) {
        for variant in 0..crash_seeds_per_step(variants) {
            let sim = SimIo::new(sim_seed(base, k, variant));
            sim.crash_after(k);
            let mut model = Model::default();
            let outcome = workload(&sim, &mut model, &mut Vec::new());
            let context = format!(
                "{name}: crash after call {k} variant {variant} (replay: KERATIN_SEED={base} \
                 KERATIN_STEP={k}; workload: {outcome:?})"
            );
            check_node(&sim.restart(), &model, logs, &context);
            runs += 1;
        }
    }
    eprintln!(
        "{name}: {total} Io calls, {runs} power losses checked in {:?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// Taking spares after segments have entered the pool.

/// Log `a` fills three segments and gives two back (they enter the pool as spares); log `b`
/// then rolls through them (takes), mid-batch and explicitly.
fn take_spares_workload(
    sim: &SimIo,
    model: &mut Model,
    logs: &mut OpenLogs,
) -> Result<(), LogError> {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool = node_pool(&io)?;
    logs.push(("a".into(), open_log(&io, &pool, "a")?));
    logs.push(("b".into(), open_log(&io, &pool, "b")?));
    let (a, b) = (log_of(logs, "a"), log_of(logs, "b"));
    for _ in 0..20 {
        model.append(a, "a", 1, &[30_000])?;
    }
    let before = a.stats().segments.last().map_or(0, |s| s.base_offset);
    model.removing_prefix("a", before);
    a.remove_prefix(before)?.wait()?;
    for _ in 0..2 {
        for _ in 0..8 {
            model.append(b, "b", 2, &[30_000])?;
        }
        // Many small records in one batch roll mid-batch; a record inside one sector survives a
        // torn write whole, which is what a stale record in a spare needs.
        model.append(b, "b", 2, &[150; 200])?;
    }
    b.roll()?.wait()?;
    model.append(b, "b", 2, &[5_000])?;
    close_log(logs, "b")?;
    close_log(logs, "a")?;
    Ok(())
}

#[test]
fn power_loss_at_every_step_of_taking_spares() {
    // A stale spare needs the take's rename lost (one in two), the header sector old (one in
    // three) and a record's sector new, at one of two takes: four variants per call, and a
    // default seed under which the sweep found it (issue 12, item 6).
    crash_sweep("take spares", 3, 4, take_spares_workload, &["a", "b"]);
}

// ---------------------------------------------------------------------------------------------
// Rolls: fresh segments (scratch file, preallocation, rename), rolls mid-batch and explicit
// ones, an explicit roll of an empty segment (nothing to do), then rolls into spares.

fn rolls_workload(sim: &SimIo, model: &mut Model, logs: &mut OpenLogs) -> Result<(), LogError> {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool = node_pool(&io)?;
    logs.push(("r".into(), open_log(&io, &pool, "r")?));
    let r = log_of(logs, "r");
    for i in 0..14 {
        // About 40 KiB per step: a roll on its own every six or seven steps, some mid-batch.
        let lengths: &[usize] = if i % 4 == 3 {
            &[12_000, 300, 25_000, 3_000]
        } else {
            &[40_000]
        };
        model.append(r, "r", 1, lengths)?;
        if i == 9 {
            r.roll()?.wait()?;
            // Empty: nothing to roll.
            r.roll()?.wait()?;
        }
    }
    let before = r.stats().segments.last().map_or(0, |s| s.base_offset);
    model.removing_prefix("r", before);
    r.remove_prefix(before)?.wait()?;
    for _ in 0..8 {
        model.append(r, "r", 2, &[45_000])?;
    }
    r.roll()?.wait()?;
    model.append(r, "r", 2, &[100; 30])?;
    close_log(logs, "r")?;
    Ok(())
}

#[test]
fn power_loss_at_every_step_of_rolls() {
    crash_sweep("rolls", 0x726f_6c6c, 2, rolls_workload, &["r"]);
}

// ---------------------------------------------------------------------------------------------
// Hand-backs: lazy creation, growth through every preallocation step and a roll, a hand-back
// (anchor, then every segment to the pool), the next append at the anchor's offset (a short
// spare taken from the pool), a hand-back then a reopen, a second hand-back replacing the anchor.

fn hand_back_workload(sim: &SimIo, model: &mut Model, logs: &mut OpenLogs) -> Result<(), LogError> {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool = node_pool(&io)?;
    logs.push(("h".into(), open_log(&io, &pool, "h")?));
    logs.push(("k".into(), open_log(&io, &pool, "k")?));
    let h = log_of(logs, "h");
    for _ in 0..10 {
        // 64, 128, 192, 256 KiB, then a roll into a fresh file.
        model.append(h, "h", 1, &[30_000])?;
    }
    model.hand_back(h, "h")?;
    model.append(h, "h", 2, &[5_000, 40])?;
    let k = log_of(logs, "k");
    model.append(k, "k", 3, &[20_000])?;
    model.hand_back(k, "k")?;
    close_log(logs, "k")?;
    logs.push(("k".into(), open_log(&io, &pool, "k")?));
    let k = log_of(logs, "k");
    model.append(k, "k", 4, &[300])?;
    let h = log_of(logs, "h");
    model.hand_back(h, "h")?;
    close_log(logs, "h")?;
    close_log(logs, "k")?;
    Ok(())
}

#[test]
fn power_loss_at_every_step_of_hand_backs() {
    crash_sweep(
        "hand-backs",
        0x6861_6e64,
        2,
        hand_back_workload,
        &["h", "k"],
    );
}

#[test]
fn eio_at_every_step_of_hand_backs_then_heal_or_restart_then_power_loss() {
    eio_sweep(
        "hand-backs, EIO, heal, reopen",
        0x6b65_6570,
        hand_back_workload,
        &["h", "k"],
    );
}

// ---------------------------------------------------------------------------------------------
// Restarts: a log with two segments restarted far past its end (segments to the pool lowest
// first, then the anchor), the next append at the new offset from a spare, a reopen and a second
// restart of a log with one segment; a log never written restarted (directory and anchor only),
// reopened, written, handed back and restarted again (the anchor replaced).

fn restart_workload(sim: &SimIo, model: &mut Model, logs: &mut OpenLogs) -> Result<(), LogError> {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool = node_pool(&io)?;
    logs.push(("s".into(), open_log(&io, &pool, "s")?));
    logs.push(("t".into(), open_log(&io, &pool, "t")?));
    let s = log_of(logs, "s");
    for _ in 0..10 {
        model.append(s, "s", 1, &[30_000])?;
    }
    model.restart_at(s, "s", 5_000_000)?;
    model.append(s, "s", 2, &[5_000, 40])?;
    let t = log_of(logs, "t");
    model.restart_at(t, "t", 1_000)?;
    close_log(logs, "t")?;
    close_log(logs, "s")?;
    logs.push(("s".into(), open_log(&io, &pool, "s")?));
    let s = log_of(logs, "s");
    model.restart_at(s, "s", 6_000_000)?;
    logs.push(("t".into(), open_log(&io, &pool, "t")?));
    let t = log_of(logs, "t");
    model.append(t, "t", 3, &[300, 20_000])?;
    model.hand_back(t, "t")?;
    model.restart_at(t, "t", 2_000)?;
    model.append(t, "t", 4, &[100])?;
    close_log(logs, "s")?;
    close_log(logs, "t")?;
    Ok(())
}

#[test]
fn power_loss_at_every_step_of_restarts() {
    crash_sweep("restarts", 0x7273_7472, 2, restart_workload, &["s", "t"]);
}

#[test]
fn eio_at_every_step_of_restarts_then_heal_or_restart_then_power_loss() {
    eio_sweep(
        "restarts, EIO, heal, reopen",
        0x7273_6569,
        restart_workload,
        &["s", "t"],
    );
}

// ---------------------------------------------------------------------------------------------
// A failed call (EIO) at every step, then a heal or a process restart, then a reopen, then a
// power loss.

/// After the failed call: heal each stopped log (`heal` true) or not, append to every running
/// one, then restart the process (drop every log; the page cache survives), reopen, verify,
/// append, and lose power.
fn after_eio(
    sim: &SimIo,
    model: &mut Model,
    logs: OpenLogs,
    heal: bool,
    names: &[&str],
    context: &str,
) {
    for (name, log) in &logs {
        if log.stopped().is_none() {
            continue;
        }
        if !heal {
            let refused = log.append(&[record(b"refused")]);
            assert!(
                matches!(&refused, Err(e) if e.is_stopped()),
                "{context}: {name}: an append to a stopped log got {:?}",
                refused.map(|_| ())
            );
            continue;
        }
        log.heal()
            .unwrap_or_else(|e| panic!("{context}: {name}: heal: {e}"));
        verify_log(log, model, name, &format!("{context}, healed"));
        model.settle(name);
        model
            .append(log, name, 800, &[640, 9_000])
            .unwrap_or_else(|e| panic!("{context}: {name}: append after heal: {e}"));
    }
    drop(logs);
    // The process restarts: same disk, same page cache.
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool = node_pool(&io).unwrap_or_else(|e| panic!("{context}: pool after restart: {e}"));
    for name in names {
        if !io.exists(&Path::new(ROOT).join(name)).expect("stat") {
            continue;
        }
        let log = open_log(&io, &pool, name)
            .unwrap_or_else(|e| panic!("{context}: {name}: reopen after the stop: {e}"));
        verify_log(&log, model, name, &format!("{context}, reopened"));
        model.settle(name);
        model
            .append(&log, name, 801, &[700, 13_000])
            .unwrap_or_else(|e| panic!("{context}: {name}: append after reopen: {e}"));
    }
    check_node(
        &sim.restart(),
        model,
        names,
        &format!("{context}, then power loss"),
    );
}

fn eio_sweep(name: &str, default_seed: u64, workload: Workload, names: &[&str]) {
    let started = Instant::now();
    let base = common::seed(default_seed);
    let total = count_calls(name, base, workload, names);
    let mut runs = 0u64;
    for k in steps_to_try(total) {
        for heal in [true, false] {
            let sim = SimIo::new(sim_seed(base, k, u64::from(heal)));
            sim.fail_at(k, SimFault::Eio);
            let mut model = Model::default();
            let mut logs = Vec::new();
            let outcome = workload(&sim, &mut model, &mut logs);
            let context = format!(
                "{name}: EIO at call {k}, {} (replay: KERATIN_SEED={base} KERATIN_STEP={k}; \
                 workload: {outcome:?})",
                if heal { "heal" } else { "no heal" }
            );
            after_eio(&sim, &mut model, logs, heal, names, &context);
            runs += 1;
        }
    }
    eprintln!(
        "{name}: {total} Io calls, {runs} failed calls healed or restarted in {:?}",
        started.elapsed()
    );
}

#[test]
fn eio_at_every_step_then_heal_or_restart_then_power_loss() {
    eio_sweep(
        "EIO, heal, reopen",
        0x6865_616c,
        take_spares_workload,
        &["a", "b"],
    );
}

// ---------------------------------------------------------------------------------------------
// A second power loss at every step of the recovery that follows a first one; and EIO at that
// step, a process restart, and then a power loss.

/// Recovery as a node runs it at start: the pool adopts its spares, every log opens.
fn recover_node(io: &Arc<dyn Io>, names: &[&str]) -> Result<(), LogError> {
    let pool = node_pool(io)?;
    let mut logs = Vec::new();
    for name in names {
        if io
            .exists(&Path::new(ROOT).join(name))
            .map_err(|e| LogError::Invalid(e.to_string()))?
        {
            logs.push(open_log(io, &pool, name)?);
        }
    }
    for log in logs {
        log.close()?;
    }
    Ok(())
}

/// The stride of first crashes: `KERATIN_RECOVERY_STRIDE` or 10 (each first crash costs a full
/// recovery per recovery call, twice: about 0.7 s in the test profile).
fn recovery_stride() -> usize {
    std::env::var("KERATIN_RECOVERY_STRIDE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10)
        .max(1)
}

#[test]
fn power_loss_at_every_step_of_recovery_after_a_power_loss() {
    let started = Instant::now();
    let name = "crash during recovery";
    let names = ["a", "b"];
    let workload: Workload = take_spares_workload;
    let base = common::seed(0x7265_636f);
    let total = count_calls(name, base, workload, &names);
    // The disk after the first power loss, rebuilt the same way each time (same seed).
    let first_crash = |k: u64| {
        let sim = SimIo::new(sim_seed(base, k, 0));
        sim.crash_after(k);
        let mut model = Model::default();
        let _ = workload(&sim, &mut model, &mut Vec::new());
        (sim.restart(), model)
    };
    let (mut runs, mut recovery_calls) = (0u64, 0u64);
    for k in steps_to_try(total).into_iter().step_by(recovery_stride()) {
        let (sim, _) = first_crash(k);
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        recover_node(&io, &names).unwrap_or_else(|e| panic!("{name}: first crash at {k}: {e}"));
        let calls = sim.steps();
        recovery_calls += calls;
        for j in 0..calls {
            let (sim, model) = first_crash(k);
            sim.crash_after(j);
            let io: Arc<dyn Io> = Arc::new(sim.clone());
            let outcome = recover_node(&io, &names);
            drop(io);
            let context = format!(
                "{name}: first crash after call {k}, second after recovery call {j} (replay: \
                 KERATIN_SEED={base} KERATIN_STEP={k}; recovery: {outcome:?})"
            );
            check_node(&sim.restart(), &model, &names, &context);
            // The same recovery call fails with EIO instead; the process restarts (the page
            // cache survives: reads may show zeros or headers the disk never got), recovers,
            // takes appends, and then the power goes.
            let (sim, mut model) = first_crash(k);
            sim.fail_at(j, SimFault::Eio);
            let io: Arc<dyn Io> = Arc::new(sim.clone());
            let outcome = recover_node(&io, &names);
            drop(io);
            let context = format!(
                "{name}: first crash after call {k}, EIO at recovery call {j} (replay: \
                 KERATIN_SEED={base} KERATIN_STEP={k}; recovery: {outcome:?})"
            );
            after_eio(&sim, &mut model, Vec::new(), false, &names, &context);
            runs += 2;
        }
    }
    eprintln!(
        "{name}: {total} workload calls, {recovery_calls} recovery calls, {runs} second power \
         losses (half of them after EIO at that call and a process restart) checked in {:?}",
        started.elapsed()
    );
}
