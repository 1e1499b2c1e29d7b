//! A stream's cursor log on the simulated disk (issue 18, `docs/streams.md`): commits,
//! deletes and compactions, crashed after every `Io` call.
//!
//! The workload commits positions of five cursors (long names, so the 32 KiB segments of the
//! small class fill and the log is compacted several times), deletes one now and then, and
//! compacts when due. For each call index `k` it runs again with a power loss right after call
//! `k`, reopens the cursor log, and checks that the table equals the model after every
//! acknowledged operation, or after those and the one in flight (it may have become durable),
//! never anything else; then that the log takes a commit. A failure names `k`; replay one with
//! `KERATIN_STEP=<k>`.

use std::path::Path;
use std::sync::Arc;

use keratin_broker::stream::{CursorLog, CursorRecord, CursorTable};
use keratin_log::{Io, SimFault, SimIo};

const DIR: &str = "/sim/stream/cursors";
const FULL_SEGMENT: u64 = 256 << 10;
const OPS: usize = 400;

fn name(i: usize) -> String {
    format!("{}-{}", "reader".repeat(30), i % 5)
}

/// Operation `i`, as the record it writes (`None`: delete of a cursor that does not exist).
fn op(i: usize) -> CursorRecord {
    if i % 13 == 12 {
        CursorRecord::Delete { name: name(i) }
    } else {
        let partition = (i % 3) as u32;
        let mut positions = vec![(partition, i as u64 * 10)];
        if i.is_multiple_of(4) {
            positions.push((partition + 1, i as u64));
        }
        CursorRecord::Commit {
            name: name(i),
            positions,
        }
    }
}

#[derive(Default)]
struct Outcome {
    /// Operations acknowledged (a prefix of the workload).
    acked: usize,
    compactions: usize,
}

fn workload(sim: &SimIo) -> Outcome {
    let mut out = Outcome::default();
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let Ok(mut log) = CursorLog::open(io, Path::new(DIR), FULL_SEGMENT, None) else {
        return out;
    };
    for i in 0..OPS {
        let now = 1_000 + i as u64;
        let done = match op(i) {
            CursorRecord::Commit { name, positions } => {
                log.commit(&name, &positions, now).map(|_| ())
            }
            CursorRecord::Delete { name } => log.delete(&name, now).map(|_| ()),
            CursorRecord::Snapshot(_) => unreachable!("the workload writes no snapshot itself"),
        };
        if done.is_err() {
            return out;
        }
        out.acked = i + 1;
        match log.compact_if_due(now) {
            Ok(true) => out.compactions += 1,
            Ok(false) => {}
            Err(_) => return out,
        }
    }
    let _ = log.close();
    out
}

/// The table after the first `n` operations.
fn model(n: usize) -> CursorTable {
    let mut table = CursorTable::new();
    for i in 0..n {
        table.apply(&op(i), 1_000 + i as u64);
    }
    table
}

fn check(k: Option<u64>, sim: SimIo, out: &Outcome) {
    let io: Arc<dyn Io> = Arc::new(sim);
    let mut log = CursorLog::open(io, Path::new(DIR), FULL_SEGMENT, None)
        .unwrap_or_else(|e| panic!("step {k:?}: the cursor log does not reopen: {e}"));
    let table = log.table().clone();
    let acked = model(out.acked);
    let in_flight = model((out.acked + 1).min(OPS));
    assert!(
        table == acked || table == in_flight,
        "step {k:?}: the table is neither the acknowledged one ({} ops) nor with the one in flight",
        out.acked
    );
    log.commit("after", &[(0, 1)], 99_999)
        .unwrap_or_else(|e| panic!("step {k:?}: no commit after the crash: {e}"));
    assert_eq!(log.table().get("after").map(|c| c.positions.len()), Some(1));
    log.close().expect("closes");
}

#[test]
fn a_clean_run_compacts_and_reopens_with_the_same_table() {
    let sim = SimIo::new(3);
    let out = workload(&sim);
    assert_eq!(out.acked, OPS);
    assert!(out.compactions >= 3, "{} compactions", out.compactions);
    let io: Arc<dyn Io> = Arc::new(sim.restart());
    let log = CursorLog::open(io, Path::new(DIR), FULL_SEGMENT, None).expect("reopens");
    assert_eq!(*log.table(), model(OPS));
    assert!(
        log.disk_bytes() <= 2 * (FULL_SEGMENT / 8),
        "{} bytes",
        log.disk_bytes()
    );
}

#[test]
fn a_power_loss_after_any_call_keeps_every_acknowledged_commit() {
    let total = {
        let sim = SimIo::new(3);
        workload(&sim);
        sim.steps()
    };
    let only: Option<u64> = std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok());
    for k in 0..total {
        if only.is_some_and(|o| o != k) {
            continue;
        }
        let sim = SimIo::new(3);
        sim.crash_after(k);
        let out = workload(&sim);
        check(Some(k), sim.restart(), &out);
    }
    eprintln!("{total} crash points checked");
}

/// A failed write or sync (a full disk, `ENOSPC`) at any call stops the cursor log: the
/// operation fails, `heal` brings back a table of the acknowledged operations (or with the
/// failed one, when it was durable before the failure), and commits work again.
#[test]
fn a_failed_call_stops_the_log_and_a_heal_brings_it_back() {
    let total = {
        let sim = SimIo::new(3);
        workload(&sim);
        sim.steps()
    };
    let mut healed = 0;
    for k in (0..total).step_by(3) {
        let sim = SimIo::new(3);
        sim.fail_at(k, SimFault::NoSpace);
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        let Ok(mut log) = CursorLog::open(io, Path::new(DIR), FULL_SEGMENT, None) else {
            continue; // the open itself failed: nothing was acknowledged
        };
        let mut acked = 0;
        let mut failed = false;
        for i in 0..OPS {
            let now = 1_000 + i as u64;
            let done = match op(i) {
                CursorRecord::Commit { name, positions } => {
                    log.commit(&name, &positions, now).map(|_| ())
                }
                CursorRecord::Delete { name } => log.delete(&name, now).map(|_| ()),
                CursorRecord::Snapshot(_) => unreachable!(),
            };
            if done.is_err() {
                failed = true;
                break;
            }
            acked = i + 1;
            if log.compact_if_due(now).is_err() {
                failed = true;
                break;
            }
        }
        if !failed {
            continue;
        }
        log.heal()
            .unwrap_or_else(|e| panic!("fault at {k}: the heal failed: {e}"));
        let table = log.table().clone();
        assert!(
            table == model(acked) || table == model((acked + 1).min(OPS)),
            "fault at {k}: the healed table is not the acknowledged one ({acked} ops)"
        );
        log.commit("after", &[(0, 1)], 99_999)
            .unwrap_or_else(|e| panic!("fault at {k}: no commit after the heal: {e}"));
        log.close().expect("closes");
        healed += 1;
    }
    assert!(healed > 100, "{healed} faults healed");
}
