//! `Log::restart_at`: a log that continues far past its end (a Raft follower that installed a
//! snapshot past its log's end), on the simulated disk and the real file system:
//!
//! - after a restart past the end the log holds no segment, start, durable and next offsets are
//!   the new offset, reads below it are `OutOfRange`, `disk_bytes()` is 0 and the segments are in
//!   the pool as spares; the next append creates a segment at the new offset, and a reopen keeps
//!   it (with and without records after it);
//! - a restart at the next offset is a hand-back;
//! - an offset below the next offset is refused with `Invalid` and changes nothing (the log
//!   runs on);
//! - it runs after the appends queued before it, and appends queued after it get the new
//!   offsets;
//! - it works on a log never written (no directory yet) and on a log that was handed back.
//!
//! It fails if the restart loses the new offset (at once or across a reopen), leaves a record
//! below it readable, leaks a segment (not handed to the pool) or stops the log on a refusal.

mod common;

use common::{on_both, payload, read_all, record, small_options, Env};
use keratin_log::{Log, LogError};

const FAR: u64 = 5_000_000;

fn fill(log: &Log, count: u64, len: usize) {
    for _ in 0..count {
        let offset = log.next_offset();
        log.append_sync(&[record(&payload(offset, 1, len))])
            .expect("append");
    }
}

fn offsets(log: &Log) -> (u64, u64, u64) {
    (log.start_offset(), log.durable_offset(), log.next_offset())
}

fn assert_out_of_range(log: &Log, offset: u64, context: &str) {
    let result = log.read(offset);
    assert!(
        matches!(result, Err(LogError::OutOfRange { .. })),
        "{context}: read of {offset} gave {result:?}"
    );
}

/// After a restart at `offset`: nothing held, every offset `offset`.
fn assert_empty_at(log: &Log, offset: u64, context: &str) {
    assert_eq!(offsets(log), (offset, offset, offset), "{context}");
    let stats = log.stats();
    assert!(stats.segments.is_empty(), "{context}: {stats:?}");
    assert_eq!((stats.disk_bytes, log.disk_bytes()), (0, 0), "{context}");
    assert_eq!(log.tail_room_bytes(), 0, "{context}");
    assert!(read_all(log, context).is_empty(), "{context}");
}

#[test]
fn restart_past_the_end_drops_every_record_and_continues_there() {
    on_both(|env| {
        let options = small_options();
        let log = env.open(&options);
        fill(&log, 300, 1000);
        let segments = log.stats().segments.len();
        assert!(segments >= 2);
        let disk = log.disk_bytes();
        let entered = log.pool().counters().entered;
        let removed = log
            .restart_at(FAR)
            .expect("submit")
            .wait()
            .expect("restart");
        assert_eq!((removed.segments, removed.bytes), (segments, disk));
        assert_empty_at(&log, FAR, env.name());
        // Spares are prepared on the pool's thread: wait for them.
        log.pool().flush();
        assert_eq!(
            log.pool().counters().entered - entered,
            segments as u64,
            "{}: every segment entered the pool",
            env.name()
        );
        for offset in [0, 299, 300, FAR - 1, FAR] {
            assert_out_of_range(&log, offset, env.name());
        }
        // The next append creates a segment at the new offset, from a spare.
        fill(&log, 5, 10);
        let stats = log.stats();
        assert_eq!(stats.segments.len(), 1);
        assert_eq!(stats.segments[0].base_offset, FAR);
        assert_eq!(offsets(&log), (FAR, FAR + 5, FAR + 5));
        assert!(log.pool().counters().takes_from_pool >= 1);
        assert_out_of_range(&log, FAR - 1, env.name());
        log.close().expect("close");
        let log = env.open(&options);
        let records = read_all(&log, env.name());
        assert_eq!(
            records.iter().map(|r| r.offset).collect::<Vec<_>>(),
            (FAR..FAR + 5).collect::<Vec<_>>()
        );
        for r in &records {
            assert_eq!(r.payload, payload(r.offset, 1, 10));
        }
    });
}

#[test]
fn restart_survives_a_reopen_before_any_append() {
    on_both(|env| {
        let options = small_options();
        let log = env.open(&options);
        fill(&log, 10, 500);
        log.restart_at(FAR)
            .expect("submit")
            .wait()
            .expect("restart");
        log.close().expect("close");
        let log = env.open(&options);
        assert_empty_at(&log, FAR, &format!("{}, reopened", env.name()));
        assert_out_of_range(&log, 9, env.name());
        fill(&log, 3, 100);
        assert_eq!(log.stats().segments[0].base_offset, FAR);
        assert_eq!(offsets(&log), (FAR, FAR + 3, FAR + 3));
    });
}

#[test]
fn restart_at_the_next_offset_is_a_hand_back() {
    on_both(|env| {
        let log = env.open(&small_options());
        fill(&log, 40, 2000);
        let segments = log.stats().segments.len();
        let removed = log.restart_at(40).expect("submit").wait().expect("restart");
        assert_eq!(removed.segments, segments);
        assert_empty_at(&log, 40, env.name());
        fill(&log, 1, 10);
        assert_eq!(log.stats().segments[0].base_offset, 40);
    });
}

#[test]
fn restart_below_the_next_offset_is_refused_and_changes_nothing() {
    on_both(|env| {
        let log = env.open(&small_options());
        fill(&log, 20, 100);
        let before = log.stats();
        for offset in [0, 10, 19] {
            match log.restart_at(offset) {
                Err(LogError::Invalid(message)) => assert!(
                    message.contains(&offset.to_string()) && message.contains("20"),
                    "{}: unclear refusal: {message}",
                    env.name()
                ),
                other => panic!(
                    "{}: restart_at({offset}) below 20 gave {:?}",
                    env.name(),
                    other.map(|_| ())
                ),
            }
        }
        assert!(log.stopped().is_none());
        assert_eq!(log.stats(), before);
        // The log runs on.
        fill(&log, 1, 100);
        assert_eq!(read_all(&log, env.name()).len(), 21);
        // Offsets queued but not yet durable count: a restart below them is refused too.
        let ticket = log.append(&[record(b"queued")]).expect("append");
        assert!(matches!(log.restart_at(21), Err(LogError::Invalid(_))));
        assert_eq!(ticket.wait().expect("durable"), 21..22);
        assert!(log.stopped().is_none());
    });
}

#[test]
fn restart_runs_after_the_appends_queued_before_it() {
    on_both(|env| {
        let log = env.open(&small_options());
        let bodies: Vec<Vec<u8>> = (0..50).map(|i| payload(i, 1, 3000)).collect();
        let tickets: Vec<_> = bodies
            .iter()
            .map(|b| log.append(&[record(b)]).expect("append"))
            .collect();
        let restart = log.restart_at(1_000).expect("restart");
        // Appends queued after it get offsets from the new one and go to a segment there.
        assert_eq!(log.next_offset(), 1_000);
        let after = log.append(&[record(b"after")]).expect("append after");
        for (i, ticket) in tickets.into_iter().enumerate() {
            assert_eq!(ticket.wait().expect("durable"), i as u64..i as u64 + 1);
        }
        let removed = restart.wait().expect("restart");
        assert!(removed.segments >= 1);
        assert_eq!(after.wait().expect("after"), 1_000..1_001);
        assert_eq!(offsets(&log), (1_000, 1_001, 1_001));
        assert_eq!(log.stats().segments[0].base_offset, 1_000);
        assert_eq!(log.read(1_000).expect("read").payload, b"after");
        assert_out_of_range(&log, 49, env.name());
    });
}

#[test]
fn restart_of_a_log_never_written() {
    on_both(|env| {
        let io = env.io();
        let dir = env.dir();
        let log = env.open(&small_options());
        // At 0 nothing is to be done: still no directory.
        let removed = log.restart_at(0).expect("submit").wait().expect("at 0");
        assert_eq!(removed.segments, 0);
        assert!(!io.exists(&dir).expect("stat"), "{}", env.name());
        let removed = log
            .restart_at(FAR)
            .expect("submit")
            .wait()
            .expect("restart");
        assert_eq!(removed.segments, 0);
        assert_empty_at(&log, FAR, env.name());
        assert!(io.exists(&dir.join("anchor")).expect("stat"));
        log.close().expect("close");
        let log = env.open(&small_options());
        assert_empty_at(&log, FAR, &format!("{}, reopened", env.name()));
        fill(&log, 2, 10);
        assert_eq!(log.stats().segments[0].base_offset, FAR);
    });
}

#[test]
fn restart_of_a_handed_back_log() {
    on_both(|env| {
        let options = small_options();
        let log = env.open(&options);
        fill(&log, 30, 100);
        log.hand_back().expect("submit").wait().expect("hand back");
        assert_empty_at(&log, 30, env.name());
        // Still at the anchor's offset: refused below, a no-op at it, a restart past it.
        assert!(matches!(log.restart_at(29), Err(LogError::Invalid(_))));
        let removed = log.restart_at(30).expect("submit").wait().expect("at 30");
        assert_eq!(removed.segments, 0);
        assert_empty_at(&log, 30, env.name());
        let removed = log
            .restart_at(FAR)
            .expect("submit")
            .wait()
            .expect("restart");
        assert_eq!(removed.segments, 0);
        assert_empty_at(&log, FAR, env.name());
        // A second restart further on replaces the anchor again.
        log.restart_at(FAR + 7)
            .expect("submit")
            .wait()
            .expect("again");
        assert_empty_at(&log, FAR + 7, env.name());
        log.close().expect("close");
        let log = env.open(&options);
        assert_empty_at(&log, FAR + 7, &format!("{}, reopened", env.name()));
        fill(&log, 1, 10);
        assert_eq!(offsets(&log), (FAR + 7, FAR + 8, FAR + 8));
    });
}

#[test]
fn restart_after_a_restart_with_records_and_a_reopen() {
    on_both(|env: &Env| {
        let options = small_options();
        let log = env.open(&options);
        fill(&log, 5, 100);
        log.restart_at(100).expect("submit").wait().expect("first");
        fill(&log, 400, 1000);
        let segments = log.stats().segments.len();
        assert!(segments >= 2, "{}", env.name());
        log.close().expect("close");
        // Segments written after the first restart win over its anchor, which stays true.
        let log = env.open(&options);
        assert_eq!(offsets(&log), (100, 500, 500));
        let removed = log.restart_at(FAR).expect("submit").wait().expect("second");
        assert_eq!(removed.segments, segments);
        assert_empty_at(&log, FAR, env.name());
        log.close().expect("close");
        let log = env.open(&options);
        assert_empty_at(&log, FAR, &format!("{}, reopened", env.name()));
    });
}

#[test]
fn a_stopped_or_closing_log_refuses_a_restart() {
    let env = Env::Sim(keratin_log::SimIo::new(3));
    let log = env.open(&small_options());
    fill(&log, 3, 10);
    let Env::Sim(sim) = &env else { unreachable!() };
    // The next sync fails: the append is answered `Stopped`, and so is a restart after it.
    sim.fail_at(sim.steps() + 1, keratin_log::SimFault::Eio);
    let append = log.append(&[record(b"x")]).expect("append");
    let _ = append.wait();
    let _ = log.append(&[record(b"y")]).map(|t| t.wait());
    assert!(log.stopped().is_some());
    assert!(matches!(log.restart_at(FAR), Err(e) if e.is_stopped()));
    log.heal().expect("heal");
    log.restart_at(FAR)
        .expect("submit")
        .wait()
        .expect("restart after heal");
    assert_empty_at(&log, FAR, "healed");
}
