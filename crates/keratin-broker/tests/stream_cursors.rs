//! A stream's cursor log on the simulated disk (issue 18, `docs/streams.md`): commits,
//! deletes and compactions through its owner over a single node's partition log, crashed
//! after every `Io` call.
//!
//! The workload commits positions of five cursors (long names, so the 32 KiB segments of the
//! small class fill and the owner compacts the log several times), and deletes one now and
//! then. For each call index `k` it runs again with a power loss right after call `k`, reopens
//! the cursor log, and checks that the table equals the model after every acknowledged
//! operation, or after those and the one in flight (it may have become durable), never
//! anything else; then that the log takes a commit. A failure names `k`; replay one with
//! `KERATIN_STEP=<k>`.

use std::path::Path;
use std::sync::Arc;

use keratin_broker::stream::cursor_log::{open_local, CursorLog};
use keratin_broker::stream::{CursorRecord, CursorState, CursorTable};
use keratin_broker::BrokerResult;
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

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

async fn open(sim: &SimIo) -> BrokerResult<CursorLog> {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let log = open_local(io, Path::new(DIR), FULL_SEGMENT, None)?;
    CursorLog::start("events", log, FULL_SEGMENT / 8).await
}

async fn run_op(log: &CursorLog, i: usize) -> BrokerResult<()> {
    let now = 1_000 + i as u64;
    match op(i) {
        CursorRecord::Commit { name, positions } => log.commit(&name, &positions, now).await,
        CursorRecord::Delete { name } => log.delete(&name, now).await.map(|_| ()),
        CursorRecord::Snapshot(_) => unreachable!("the workload writes no snapshot itself"),
    }
}

#[derive(Default)]
struct Outcome {
    /// Operations acknowledged (a prefix of the workload).
    acked: usize,
    compactions: u64,
}

async fn workload(sim: &SimIo) -> Outcome {
    let mut out = Outcome::default();
    let Ok(log) = open(sim).await else {
        return out;
    };
    for i in 0..OPS {
        if run_op(&log, i).await.is_err() {
            break;
        }
        out.acked = i + 1;
    }
    out.compactions = log.figures().compactions;
    let _ = log.close().await;
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

/// The table's cursors but `except`, as (name, state).
fn entries(table: &CursorTable, except: &str) -> Vec<(String, CursorState)> {
    table
        .iter()
        .filter(|(name, _)| *name != except)
        .map(|(name, state)| (name.to_string(), state.clone()))
        .collect()
}

async fn check(k: Option<u64>, sim: SimIo, out: &Outcome) {
    let log = open(&sim)
        .await
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
        .await
        .unwrap_or_else(|e| panic!("step {k:?}: no commit after the crash: {e}"));
    assert_eq!(log.get("after").map(|c| c.positions.len()), Some(1));
    log.close().await.expect("closes");
}

#[test]
fn a_clean_run_compacts_and_reopens_with_the_same_table() {
    runtime().block_on(async {
        let sim = SimIo::new(3);
        let out = workload(&sim).await;
        assert_eq!(out.acked, OPS);
        assert!(out.compactions >= 3, "{} compactions", out.compactions);
        let log = open(&sim.restart()).await.expect("reopens");
        assert_eq!(*log.table(), model(OPS));
        let disk = log.figures().disk_bytes;
        assert!(disk <= 2 * (FULL_SEGMENT / 8), "{disk} bytes");
        log.close().await.expect("closes");
    });
}

#[test]
fn a_power_loss_after_any_call_keeps_every_acknowledged_commit() {
    let rt = runtime();
    let total = {
        let sim = SimIo::new(3);
        rt.block_on(workload(&sim));
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
        let out = rt.block_on(workload(&sim));
        rt.block_on(check(Some(k), sim.restart(), &out));
    }
    eprintln!("{total} crash points checked");
}

/// A failed write or sync (a full disk, `ENOSPC`) at any call stops the cursor log: the
/// operation fails (or, in a compaction, no one), the owner heals the log, its table is that
/// of the acknowledged operations (or with the failed one, when it was durable before the
/// failure), and commits work again.
#[test]
fn a_failed_call_stops_the_log_and_a_heal_brings_it_back() {
    let rt = runtime();
    let total = {
        let sim = SimIo::new(3);
        rt.block_on(workload(&sim));
        sim.steps()
    };
    let mut healed = 0;
    for k in (0..total).step_by(3) {
        rt.block_on(async {
            let sim = SimIo::new(3);
            sim.fail_at(k, SimFault::NoSpace);
            let Ok(log) = open(&sim).await else {
                return; // the open itself failed: nothing was acknowledged
            };
            let mut acked = 0;
            let mut failed = false;
            for i in 0..OPS {
                if run_op(&log, i).await.is_err() {
                    failed = true;
                    break;
                }
                acked = i + 1;
            }
            if failed {
                log.commit("after", &[(0, 1)], 99_999)
                    .await
                    .unwrap_or_else(|e| panic!("fault at {k}: no commit after the heal: {e}"));
                let table = log.table().clone();
                assert!(
                    entries(&table, "after") == entries(&model(acked), "after")
                        || entries(&table, "after")
                            == entries(&model((acked + 1).min(OPS)), "after"),
                    "fault at {k}: the healed table is not the acknowledged one ({acked} ops)"
                );
                healed += 1;
            } else {
                // The fault hit a compaction (or nothing the workload waits for): healed
                // behind the commits, which all went on.
                assert_eq!(*log.table(), model(OPS), "fault at {k}");
            }
            let table = log.table().clone();
            if let Err(error) = log.close().await {
                // The fault hit the close's own writes: what was acknowledged is durable.
                let reopened = open(&sim)
                    .await
                    .unwrap_or_else(|e| panic!("fault at {k}: no reopen after {error}: {e}"));
                assert_eq!(
                    *reopened.table(),
                    table,
                    "fault at {k}: reopened after {error}"
                );
                reopened.close().await.expect("closes");
            }
        });
    }
    assert!(healed > 100, "{healed} faults healed");
}
