//! Faults the log must see through: a file from another log whose records continue this log's
//! offsets exactly (only the generation tells them apart), torn tails, bit flips in sealed
//! segments, in the last segment, after a clean close, in a segment header and under a reader,
//! a failed fsync (stop, durable reads, heal), ENOSPC on a roll, and a failed fsync followed by a
//! power loss (fsyncgate). Scenarios that need no crash run on `SimIo` and on the real file
//! system. A failure means the log accepted a stranger's records, returned bytes that were never
//! written or damaged ones, skipped damage to durable data, or reported as durable a record whose
//! sync failed.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{
    flip_byte, on_both, payload, payload_origin, read_all, read_file, record, record_positions,
    segment_path, small_options, write_new_file, Env,
};
use keratin_log::format::{SegmentHeader, SEGMENT_HEADER_SIZE};
use keratin_log::{Io, Log, LogError, SimFault, SimIo};

fn open_at(io: &Arc<dyn Io>, dir: &Path) -> Result<Log, LogError> {
    Log::open(io.clone(), dir, small_options(), None)
}

fn append_each(log: &Log, offsets: std::ops::Range<u64>, version: u32, len: usize) {
    for offset in offsets {
        let body = payload(offset, version, len);
        assert_eq!(
            log.append_sync(&[record(&body)]).expect("append"),
            offset..offset + 1
        );
    }
}

/// The position and offset a `Corrupt` error names, or a panic saying what came instead.
fn corrupt_at(result: Result<impl std::fmt::Debug, LogError>, what: &str) -> (PathBuf, u64, u64) {
    match result {
        Err(LogError::Corrupt {
            segment,
            position,
            offset,
            ..
        }) => (segment, position, offset),
        other => panic!("{what}: expected Corrupt, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// (a) The seed's constructed case.

/// Log B holds offsets 0..5; a file copied from log A holds A's records 5..11 (valid checksums,
/// generation 1) and is put into B's directory as B's segment 5 with its header rewritten to
/// generation `1 + generation_step`. Returns B's next offset after opening it.
fn adopt_foreign_segment(env: &Env, name: &str, generation_step: u16) -> (Log, Arc<dyn Io>) {
    let io = env.io();
    let dir_a = env.dir().join(format!("{name}-a"));
    let dir_b = env.dir().join(format!("{name}-b"));
    let a = open_at(&io, &dir_a).expect("open A");
    append_each(&a, 0..5, 1, 300);
    a.roll().expect("submit").wait().expect("roll A");
    append_each(&a, 5..11, 1, 300);
    a.close().expect("close A");
    let b = open_at(&io, &dir_b).expect("open B");
    append_each(&b, 0..5, 2, 300);
    b.close().expect("close B");

    let mut bytes = read_file(io.as_ref(), &segment_path(&dir_a, 5));
    let header_bytes: &[u8; SEGMENT_HEADER_SIZE] =
        bytes[..SEGMENT_HEADER_SIZE].try_into().expect("header");
    let mut header = SegmentHeader::decode(header_bytes).expect("A's header");
    assert_eq!((header.base_offset, header.generation), (5, 1));
    header.generation += generation_step;
    bytes[..SEGMENT_HEADER_SIZE].copy_from_slice(&header.encode());
    write_new_file(io.as_ref(), &segment_path(&dir_b, 5), &bytes);
    (
        open_at(&io, &dir_b).expect("open B with the copied file"),
        io,
    )
}

#[test]
fn foreign_records_continuing_the_offsets_exactly_are_never_accepted() {
    on_both(|env| {
        let (b, io) = adopt_foreign_segment(env, "newer", 1);
        assert_eq!(
            b.next_offset(),
            5,
            "{}: B took records of A's file: the generation check is missing",
            env.name()
        );
        assert!(matches!(b.read(5), Err(LogError::OutOfRange { .. })));
        let records = read_all(&b, env.name());
        assert!(records
            .iter()
            .all(|r| payload_origin(&r.payload) == Some((r.offset, 2))));
        // B writes its own offset 5 over A's first record; A's later leftovers stay foreign.
        append_each(&b, 5..6, 3, 40);
        b.close().expect("close");
        let b = open_at(&io, &env.dir().join("newer-b")).expect("reopen B");
        assert_eq!(b.next_offset(), 6, "{}", env.name());
        assert_eq!(b.read(5).expect("read").payload, payload(5, 3, 40));

        // The control: the same construction with an equal generation is accepted, so the test
        // above can fail if the generation check goes away.
        let (same, _) = adopt_foreign_segment(env, "same", 0);
        assert_eq!(same.next_offset(), 11, "{}: control", env.name());
        assert_eq!(same.read(5).expect("read").payload, payload(5, 1, 300));
    });
}

// ---------------------------------------------------------------------------------------------
// (b) Torn tails.

#[test]
fn torn_tail_after_unsynced_appends_loses_only_unacknowledged_records() {
    let base = common::seed(11);
    for round in 0..64u64 {
        let seed = base.wrapping_add(round);
        let sim = SimIo::new(seed);
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        let dir = PathBuf::from("/sim/torn");
        let log = open_at(&io, &dir).expect("open");
        let mut acked: Vec<(u64, Vec<u8>)> = Vec::new();
        for offset in 0..8u64 {
            let body = payload(offset, 0, 100 + (offset as usize * 613) % 1900);
            log.append_sync(&[record(&body)]).expect("append");
            acked.push((offset, body));
        }
        // Queue appends without waiting and crash within the next few calls: some batches are
        // written but not synced, and the crash tears them sector by sector.
        sim.crash_after(sim.steps() + round % 5);
        let mut tickets = Vec::new();
        for i in 0..6u64 {
            let offset = 8 + i;
            let body = payload(
                offset,
                1,
                200 + (i as usize * 997 + round as usize * 31) % 3000,
            );
            let Ok(ticket) = log.append(&[record(&body)]) else {
                break;
            };
            tickets.push((offset, body, ticket));
        }
        for (offset, body, ticket) in tickets {
            if ticket.wait().is_ok() {
                acked.push((offset, body));
            }
        }
        let sim = sim.restart();
        drop(log);
        let io: Arc<dyn Io> = Arc::new(sim);
        let context = format!("seed {seed} (KERATIN_SEED={base}, round {round})");
        let log = open_at(&io, &dir).unwrap_or_else(|e| panic!("{context}: open: {e}"));
        let records = read_all(&log, &context);
        for r in &records {
            let origin = payload_origin(&r.payload);
            assert!(
                origin.is_some_and(|(offset, _)| offset == r.offset),
                "{context}: offset {} holds bytes nobody wrote there: {origin:?}",
                r.offset
            );
        }
        for (offset, body) in &acked {
            let found = records.get(*offset as usize);
            assert!(
                found.is_some_and(|r| r.payload == *body),
                "{context}: acknowledged {offset} lost"
            );
        }
        let next = log.next_offset();
        append_each(&log, next..next + 1, 9, 77);
    }
}

// ---------------------------------------------------------------------------------------------
// (c) Bit flips.

#[test]
fn flip_in_a_sealed_segment_is_corruption_at_its_place() {
    on_both(|env| {
        let log = env.open(&small_options());
        append_each(&log, 0..150, 0, 2000);
        assert!(log.stats().segments.len() > 1);
        log.close().expect("close");
        let positions = record_positions(&[2000; 150]);
        let first = segment_path(&env.dir(), 0);
        flip_byte(env.io().as_ref(), &first, positions[5] + 40, 0x04);
        let result = Log::open(env.io(), &env.dir(), small_options(), None);
        let (segment, position, offset) = corrupt_at(result, env.name());
        assert_eq!(
            (segment, position, offset),
            (first, positions[5], 5),
            "{}",
            env.name()
        );
    });
}

#[test]
fn flip_in_the_last_segment_before_later_batches_is_corruption() {
    // SimIo: a power loss, so only the later batches' claims (not a seal) show the damage.
    let sim = SimIo::new(common::seed(21));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let dir = PathBuf::from("/sim/flip-last");
    let log = open_at(&io, &dir).expect("open");
    append_each(&log, 0..20, 0, 500);
    let sim = sim.restart();
    drop(log);
    let positions = record_positions(&[500; 20]);
    let path = segment_path(&dir, 0);
    sim.corrupt(&path, positions[10] + 7, 0x20);
    let io: Arc<dyn Io> = Arc::new(sim);
    let (segment, position, offset) = corrupt_at(open_at(&io, &dir), "sim");
    assert_eq!((segment, position, offset), (path, positions[10], 10));

    // The real file system, after a clean close: the later records and the seal claim it.
    let tmp = tempfile::tempdir().expect("tempdir");
    let env = Env::Real(tmp);
    let log = env.open(&small_options());
    append_each(&log, 0..20, 0, 500);
    log.close().expect("close");
    let path = segment_path(&env.dir(), 0);
    flip_byte(env.io().as_ref(), &path, positions[10] + 7, 0x20);
    let result = Log::open(env.io(), &env.dir(), small_options(), None);
    assert_eq!(corrupt_at(result, "real"), (path, positions[10], 10));
}

#[test]
fn flip_in_the_last_batch_after_a_clean_close_is_corruption() {
    on_both(|env| {
        let log = env.open(&small_options());
        let bodies: Vec<Vec<u8>> = (0..5).map(|o| payload(o, 0, 300)).collect();
        let records: Vec<_> = bodies.iter().map(|b| record(b)).collect();
        log.append_sync(&records).expect("append");
        log.close().expect("close");
        // Only the seal claims the last record of the batch.
        let positions = record_positions(&[300; 5]);
        let path = segment_path(&env.dir(), 0);
        flip_byte(env.io().as_ref(), &path, positions[4] + 100, 0x01);
        let result = Log::open(env.io(), &env.dir(), small_options(), None);
        let (segment, position, offset) = corrupt_at(result, env.name());
        assert_eq!((segment, position, offset), (path, positions[4], 4));
    });
}

#[test]
fn flip_in_the_header_of_a_sealed_segment_is_corruption() {
    on_both(|env| {
        let log = env.open(&small_options());
        append_each(&log, 0..150, 0, 2000);
        log.close().expect("close");
        let first = segment_path(&env.dir(), 0);
        flip_byte(env.io().as_ref(), &first, 17, 0x02);
        let result = Log::open(env.io(), &env.dir(), small_options(), None);
        let (segment, position, _) = corrupt_at(result, env.name());
        assert_eq!((segment, position), (first, 0), "{}", env.name());
    });
}

#[test]
fn reading_a_flipped_record_is_an_error_never_wrong_bytes() {
    on_both(|env| {
        let log = env.open(&small_options());
        append_each(&log, 0..10, 0, 700);
        let positions = record_positions(&[700; 10]);
        let path = segment_path(&env.dir(), 0);
        match env {
            Env::Sim(sim) => sim.corrupt(&path, positions[3] + 200, 0x40),
            Env::Real(_) => flip_byte(env.io().as_ref(), &path, positions[3] + 200, 0x40),
        }
        let (segment, position, offset) = corrupt_at(log.read(3), env.name());
        assert_eq!((segment, position, offset), (path, positions[3], 3));
        assert_eq!(log.read(2).expect("read").payload, payload(2, 0, 700));
        // Reaching 4 may mean walking over 3 (the index is sparse): an error, or the right bytes.
        match log.read(4) {
            Ok(r) => assert_eq!(r.payload, payload(4, 0, 700)),
            Err(e) => assert!(matches!(e, LogError::Corrupt { .. }), "{e:?}"),
        }
        let mut reader = log.reader(0);
        for offset in 0..3 {
            let r = reader.next().expect("a record").expect("intact");
            assert_eq!(r.payload, payload(offset, 0, 700));
        }
        assert!(matches!(reader.next(), Some(Err(LogError::Corrupt { .. }))));
    });
}

// ---------------------------------------------------------------------------------------------
// (d) fsync failure and ENOSPC: stopped, durable reads, heal.

/// A log with `count` acknowledged records whose next batch's `sync_data` fails with EIO; the
/// batch's ticket error is checked. Returns the disk and the stopped log.
fn log_with_failed_sync(seed: u64, dir: &Path, count: u64) -> (SimIo, Log) {
    let sim = SimIo::new(seed);
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let log = open_at(&io, dir).expect("open");
    append_each(&log, 0..count, 0, 900);
    // One appender, log idle: the next batch is one write, then its sync.
    sim.fail_at(sim.steps() + 1, SimFault::Eio);
    let bodies: Vec<Vec<u8>> = (count..count + 3).map(|o| payload(o, 1, 900)).collect();
    let records: Vec<_> = bodies.iter().map(|b| record(b)).collect();
    let error = log.append_sync(&records).expect_err("the sync failed");
    assert!(error.is_stopped(), "{error:?}");
    assert!(log.stopped().is_some());
    (sim, log)
}

#[test]
fn failed_fsync_stops_the_log_and_heal_brings_back_every_durable_record() {
    let dir = PathBuf::from("/sim/fsync");
    let (sim, log) = log_with_failed_sync(common::seed(31), &dir, 10);
    let refused = log.append(&[record(b"later")]);
    assert!(matches!(&refused, Err(e) if e.is_stopped()));
    assert_eq!(log.durable_offset(), 10);
    for offset in 0..10 {
        assert_eq!(
            log.read(offset).expect("durable read").payload,
            payload(offset, 0, 900)
        );
    }
    assert!(matches!(log.read(10), Err(LogError::OutOfRange { .. })));
    log.heal().expect("heal");
    assert_eq!((log.next_offset(), log.durable_offset()), (10, 10));
    assert!(matches!(log.read(10), Err(LogError::OutOfRange { .. })));
    append_each(&log, 10..12, 2, 900);
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = open_at(&io, &dir).expect("reopen");
    let records = read_all(&log, "after heal and crash");
    assert_eq!(records.len(), 12);
    for r in &records {
        let version = if r.offset < 10 { 0 } else { 2 };
        assert_eq!(r.payload, payload(r.offset, version, 900));
    }
}

/// Appends that leave room behind them keep it allocated for the appends after them: on a file
/// system that fills up, the append that cannot have its room fails (the log stops), and after
/// the heal, which needs no space, small appends (a queue's acks) are written into the room
/// without allocating. Without the room, the tail segment's allocation ends wherever the last
/// preallocation step did, and the small appends fail with the disk full.
#[test]
fn appends_leaving_room_keep_it_allocated_for_the_others() {
    const LEAVE: u64 = 16 << 10;
    let sim = SimIo::new(common::seed(43));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let dir = PathBuf::from("/sim/leaving");
    let log = open_at(&io, &dir).expect("open");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let leaving = |offset: u64| {
        let body = payload(offset, 0, 2000);
        runtime.block_on(async {
            log.append_async_leaving(&[record(&body)], LEAVE)
                .await?
                .wait()
        })
    };
    // A few segments' worth, then a disk that fills part way through one.
    let mut next = 0;
    while log.stats().segments.len() < 3 {
        leaving(next).expect("append");
        assert!(log.tail_room_bytes() >= LEAVE, "the room is allocated");
        next += 1;
    }
    sim.set_space_limit(Some(sim.used_bytes() + (40 << 10)));
    let error = loop {
        match leaving(next) {
            Ok(_) => next += 1,
            Err(error) => break error,
        }
        assert!(next < 10_000, "the disk never filled");
    };
    assert!(error.is_stopped(), "{error:?}");
    log.heal().expect("a heal needs no space");
    assert!(
        log.tail_room_bytes() >= LEAVE,
        "the room behind the last durable append: {}",
        log.tail_room_bytes()
    );
    // Seven small appends of 2,000 bytes (under 16 KiB with their headers) fit the room.
    append_each(&log, next..next + 7, 1, 2000);
    assert_eq!(log.next_offset(), next + 7);
    sim.set_space_limit(None);
}

#[test]
fn enospc_on_a_roll_stops_the_log_until_space_returns() {
    let sim = SimIo::new(common::seed(41));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let dir = PathBuf::from("/sim/nospace");
    let log = open_at(&io, &dir).expect("open");
    append_each(&log, 0..100, 0, 2000);
    assert_eq!(log.stats().segments.len(), 1);
    // Room for less than a segment: writes inside the preallocated one go on, the roll fails.
    sim.set_space_limit(Some(sim.used_bytes() + (64 << 10)));
    let mut acked = 100;
    let error = loop {
        let body = payload(acked, 0, 2000);
        match log.append_sync(&[record(&body)]) {
            Ok(_) => acked += 1,
            Err(error) => break error,
        }
        assert!(acked < 200, "the roll never failed");
    };
    match &error {
        LogError::Stopped { source, .. } => assert!(source.is_no_space(), "{error:?}"),
        other => panic!("expected Stopped, got {other:?}"),
    }
    assert!(matches!(log.append(&[record(b"x")]), Err(e) if e.is_stopped()));
    assert_eq!(
        log.read(acked - 1).expect("durable read").payload,
        payload(acked - 1, 0, 2000)
    );
    sim.set_space_limit(None);
    log.heal().expect("heal");
    assert_eq!(log.next_offset(), acked);
    append_each(&log, acked..acked + 60, 1, 2000);
    assert!(
        log.stats().segments.len() >= 2,
        "the roll happened after the heal"
    );
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = open_at(&io, &dir).expect("reopen");
    let records = read_all(&log, "after ENOSPC, heal and crash");
    assert_eq!(records.len() as u64, acked + 60);
    for r in &records {
        let version = if r.offset < acked { 0 } else { 1 };
        assert_eq!(
            r.payload,
            payload(r.offset, version, 2000),
            "offset {}",
            r.offset
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (e) fsyncgate: a failed sync's data is never reported, even though reads could still see it.

#[test]
fn failed_fsync_then_power_loss_reports_nothing_of_the_failed_batch() {
    let dir = PathBuf::from("/sim/fsyncgate");
    // Without a heal: the failed batch is gone after the crash.
    let (sim, log) = log_with_failed_sync(common::seed(51), &dir, 10);
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = open_at(&io, &dir).expect("reopen");
    let records = read_all(&log, "crash after failed sync");
    assert_eq!(records.len(), 10, "a record of the failed batch came back");

    // With a heal first: the page cache still shows the failed batch; heal must not report it,
    // and what is appended after the heal must not line up with its leftovers.
    let (sim, log) = log_with_failed_sync(common::seed(52), &dir, 10);
    log.heal().expect("heal");
    assert_eq!(log.durable_offset(), 10, "heal reported the failed batch");
    append_each(&log, 10..11, 2, 40);
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = open_at(&io, &dir).expect("reopen");
    let records = read_all(&log, "heal, append, crash");
    assert_eq!(records.len(), 11);
    assert_eq!(records[10].payload, payload(10, 2, 40));
}

// ---------------------------------------------------------------------------------------------
// (f) A failed idle-seal write after a group is durable: the answer must say what is true.

/// The group's sync completed and readers see its records; the seal written after it fails.
/// The group is answered as durable (it is), and the log stops for the seal's failure: every
/// later append gets `Stopped` until a heal.
#[test]
fn failed_seal_write_answers_the_durable_group_as_durable_and_then_stops() {
    let dir = PathBuf::from("/sim/seal");
    let sim = SimIo::new(common::seed(61));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let log = open_at(&io, &dir).expect("open");
    append_each(&log, 0..5, 0, 700);
    // One appender, log idle: the group is one write, one sync, then the idle seal's write.
    sim.fail_at(sim.steps() + 2, SimFault::Eio);
    let bodies: Vec<Vec<u8>> = (5..8).map(|o| payload(o, 1, 700)).collect();
    let records: Vec<_> = bodies.iter().map(|b| record(b)).collect();
    let answer = log.append_sync(&records);
    assert_eq!(
        answer.expect("the group is durable: its answer must be Ok"),
        5..8
    );
    assert_eq!(log.durable_offset(), 8);
    for (offset, body) in (5..8).zip(&bodies) {
        assert_eq!(&log.read(offset).expect("durable read").payload, body);
    }
    let stop = log.stopped().expect("the failed seal write stops the log");
    assert!(stop.is_stopped(), "{stop:?}");
    let refused = log.append(&[record(b"later")]);
    assert!(matches!(&refused, Err(e) if e.is_stopped()));
    log.heal().expect("heal");
    assert_eq!(log.durable_offset(), 8, "heal keeps the durable group");
    append_each(&log, 8..9, 2, 700);
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = open_at(&io, &dir).expect("reopen");
    assert_eq!(read_all(&log, "seal failure, heal, crash").len(), 9);
}

// ---------------------------------------------------------------------------------------------
// (g) A failed sync, then a process restart (the page cache survives) or a heal, then a power
// loss: what was acknowledged after the restart or heal must survive.

/// The log stops on a failed sync; the process exits and starts again (no power loss: the page
/// cache still shows the failed batch, but the disk will never hold it, and a later sync of the
/// file succeeds without writing it). The reopened log takes appends; after a power loss
/// every record acknowledged since the restart reads back, and the log opens.
#[test]
fn restart_after_a_failed_fsync_then_power_loss_keeps_every_later_acknowledged_record() {
    let dir = PathBuf::from("/sim/restart-after-eio");
    let (sim, log) = log_with_failed_sync(common::seed(71), &dir, 10);
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let log = open_at(&io, &dir).expect("reopen after the stop (process restart)");
    let kept = log.next_offset();
    assert!(
        kept == 10 || kept == 13,
        "the reopened log holds 0..{kept}: neither the durable records nor all of the batch"
    );
    append_each(&log, kept..kept + 3, 2, 900);
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = open_at(&io, &dir).expect("open after the power loss");
    let records = read_all(&log, "failed sync, restart, append, power loss");
    assert_eq!(records.len() as u64, kept + 3, "acknowledged records lost");
    for r in &records {
        let version = match r.offset {
            o if o < 10 => 0,
            o if o < kept => 1,
            _ => 2,
        };
        assert_eq!(
            r.payload,
            payload(r.offset, version, 900),
            "offset {}",
            r.offset
        );
    }
}

/// An explicit roll takes a spare from the pool (rename, real header) and the sync that covers
/// the header fails: the header exists only in the page cache. The heal keeps the segment (no
/// record of it was reported durable, none is cut); appends go into it and are acknowledged;
/// after a power loss they must read back (issue 12, item 8).
#[test]
fn pool_segment_whose_first_sync_failed_keeps_later_acknowledged_records() {
    let sim = SimIo::new(common::seed(81));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let root = PathBuf::from("/sim/node");
    io.create_dir_all(&root).expect("mkdir");
    let pool = keratin_log::SegmentPool::new(
        io.clone(),
        keratin_log::PoolOptions {
            full_segment_size_bytes: small_options().full_segment_size_bytes,
            budget_bytes: None,
            background: false,
            ..keratin_log::PoolOptions::default()
        },
    );
    pool.add_storage_dir(&root).expect("pool");
    let dir = root.join("q");
    let open = |io: &Arc<dyn Io>, pool: &keratin_log::SegmentPool| {
        Log::open(io.clone(), &dir, small_options(), Some(pool.clone()))
    };
    let log = open(&io, &pool).expect("open");
    append_each(&log, 0..200, 0, 2000);
    let before = log.stats().segments.last().expect("segment").base_offset;
    log.remove_prefix(before)
        .expect("submit")
        .wait()
        .expect("remove");
    assert!(pool.filesystems()[0].full_count >= 1, "a spare is ready");
    let next = log.next_offset();
    // The roll: device id, rename, open, header write; then the segment's sync fails.
    sim.fail_at(sim.steps() + 4, SimFault::Eio);
    let error = log
        .roll()
        .expect("submit")
        .wait()
        .expect_err("the sync failed");
    assert!(error.is_stopped(), "{error:?}");
    log.heal().expect("heal");
    assert_eq!(log.next_offset(), next);
    append_each(&log, next..next + 5, 1, 2000);
    let sim = sim.restart();
    drop(log);
    let io: Arc<dyn Io> = Arc::new(sim);
    let pool = keratin_log::SegmentPool::new(
        io.clone(),
        keratin_log::PoolOptions {
            full_segment_size_bytes: small_options().full_segment_size_bytes,
            budget_bytes: None,
            background: false,
            ..keratin_log::PoolOptions::default()
        },
    );
    pool.add_storage_dir(&root)
        .expect("pool after the power loss");
    let log = open(&io, &pool).expect("open after the power loss");
    assert_eq!(
        log.next_offset(),
        next + 5,
        "records acknowledged after the heal were lost"
    );
    for offset in next..next + 5 {
        assert_eq!(
            log.read(offset).expect("read").payload,
            payload(offset, 1, 2000)
        );
    }
}

/// Recovery cuts a damaged tail and zeroes a same-generation leftover after it; that zeroing's
/// writes fail or its sync does (EIO at every call of the recovery). The process restarts (the
/// page cache shows zeros the disk may never get), reopens, appends a record exactly as long as
/// the cut one, and loses power: the leftover must not come back as the next offset, lined up
/// behind a record it never followed.
#[test]
fn leftover_whose_zeroing_failed_never_lines_up_after_a_restart() {
    let dir = PathBuf::from("/sim/leftover");
    let options = keratin_log::LogOptions {
        seal_when_idle: false,
        ..small_options()
    };
    let open = |io: &Arc<dyn Io>| Log::open(io.clone(), &dir, options.clone(), None);
    // A disk whose log holds 0..5, then record 5 damaged and record 6 intact behind it.
    let damaged_disk = || {
        let sim = SimIo::new(common::seed(91));
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        let log = open(&io).expect("open");
        for offset in 0..5 {
            log.append_sync(&[record(&payload(offset, 0, 700))])
                .expect("append");
        }
        let (five, six) = (payload(5, 0, 1000), payload(6, 0, 300));
        log.append_sync(&[record(&five), record(&six)])
            .expect("append");
        let sim = sim.restart();
        drop(log);
        let positions = record_positions(&[700, 700, 700, 700, 700, 1000, 300]);
        sim.corrupt(&segment_path(&dir, 0), positions[5] + 100, 0xff);
        sim
    };
    let recovery_calls = {
        let sim = damaged_disk();
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        let log = open(&io).expect("recovery cuts the damaged tail");
        assert_eq!(log.next_offset(), 5);
        sim.steps()
    };
    for k in 0..recovery_calls {
        let sim = damaged_disk();
        sim.fail_at(k, SimFault::Eio);
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        let first = open(&io).map(|log| log.next_offset());
        // The process restarts on the same disk and page cache.
        let log = open(&io).unwrap_or_else(|e| panic!("EIO at call {k} ({first:?}): reopen: {e}"));
        assert_eq!(log.next_offset(), 5, "EIO at call {k}");
        log.append_sync(&[record(&payload(5, 1, 1000))])
            .expect("append after the restart");
        let sim = sim.restart();
        drop(log);
        let io: Arc<dyn Io> = Arc::new(sim);
        let log =
            open(&io).unwrap_or_else(|e| panic!("EIO at call {k}: open after power loss: {e}"));
        assert_eq!(
            log.next_offset(),
            6,
            "EIO at call {k} ({first:?}): the leftover record 6 came back behind a new record 5"
        );
        assert_eq!(log.read(5).expect("read").payload, payload(5, 1, 1000));
    }
}
