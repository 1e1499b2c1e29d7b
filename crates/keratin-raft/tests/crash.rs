//! Power loss and failures at every step of the storage workload openraft drives: votes,
//! appends (batches that roll segments), a committed id, a truncation and re-append under a new
//! term, purges (one removing a whole segment, one past the log's end, which restarts the entry
//! log there, followed by an append at the purge point), and before that purge the snapshot
//! meta it follows (a follower's snapshot install: meta kept, purge past the end, append), all
//! on the simulated disk (`SimIo`). The test counts the `Io` calls
//! of the workload, then replays it once per call index `k`:
//!
//! - power loss right after call `k`, reopen on what the disk kept: every entry reported
//!   flushed (and not taken away by a truncation or purge the workload started) reads back
//!   equal; every entry that reads back was appended at that index and not removed by a
//!   completed truncation; entries run without a gap after the purge point; the vote is the
//!   last one saved without a fence or a later one (a vote never goes back); the purge point is
//!   not below the last completed purge; the snapshot meta is one the workload kept, not older
//!   than the last one kept, and covers any purge past the end that survived (it is durable
//!   first); the committed id is not past the last entry; the store
//!   takes a new append and it survives a reopen;
//! - call `k` failing with `EIO`, then with `ENOSPC`: no storage call ever returns an error
//!   (openraft would treat it as fatal), the fence trips, no flush is reported after the
//!   failure for an append made after it, and after `GroupLogs::heal` a new store holds the
//!   same guarantees as above, also after a power loss that follows.
//!
//! The two logs of a group have their own commit workers and the committed id is written
//! without waiting, so the order of `Io` calls between the logs can vary a little between runs:
//! the sweep still covers every call index, and every check holds for any order. A failure
//! names `k`, the fault and the seed; replay with `KERATIN_SEED=<seed>` and
//! `KERATIN_STEP=<k>`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use keratin_log::{LogOptions, SimFault, SimIo, MIN_SEGMENT_SIZE_BYTES};
use keratin_raft::{
    Entry, GroupLogs, LeaderId, LogId, LogStore, Membership, NodeAddr, PartitionRecord, Payload,
    RaftError, SnapshotMeta, StoredMembership, TypeConfig, Vote,
};
use openraft::storage::{IOFlushed, RaftLogReader, RaftLogStorage};
use openraft::type_config::TypeConfigExt;

const DIR: &str = "/sim/partition";

fn seed() -> u64 {
    let seed = std::env::var("KERATIN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0014);
    eprintln!("seed {seed} (replay with KERATIN_SEED={seed})");
    seed
}

fn options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        // No idle seal records: fewer calls that race the workload's next step.
        seal_when_idle: false,
        ..LogOptions::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn log_id(term: u64, index: u64) -> LogId {
    LogId::new(
        LeaderId {
            term,
            node_id: term,
        },
        index,
    )
}

/// One step of the workload.
#[derive(Debug, Clone, Copy)]
enum Step {
    Vote(u64),
    /// `count` entries of the term, `len` payload bytes each.
    Append {
        term: u64,
        count: u64,
        len: usize,
    },
    Committed(u64),
    /// Keep entries up to this index.
    TruncateAfter(u64),
    /// Purge up to this index (past the end: the log's last index plus the value).
    Purge(u64),
    PurgePastEnd(u64),
    /// Keep a snapshot's meta (the state machine's `SnapshotKeeper`) at the same index as the
    /// `PurgePastEnd` with the same value that follows it: a follower's snapshot install.
    KeepSnapshot(u64),
}

/// About 300 KiB of entries before the first purge: the 256 KiB entry log rolls once, so that
/// the purge at 200 removes the first segment.
fn workload() -> Vec<Step> {
    use Step::*;
    vec![
        Vote(1),
        Append {
            term: 1,
            count: 1,
            len: 0,
        },
        Append {
            term: 1,
            count: 5,
            len: 300,
        },
        Committed(3),
        Append {
            term: 1,
            count: 3,
            len: 5_000,
        },
        Vote(2),
        TruncateAfter(6),
        Append {
            term: 2,
            count: 4,
            len: 100,
        },
        Purge(3),
        Append {
            term: 2,
            count: 100,
            len: 1_500,
        },
        Append {
            term: 2,
            count: 100,
            len: 1_500,
        },
        Committed(150),
        Purge(200),
        Vote(3),
        Append {
            term: 3,
            count: 2,
            len: 10,
        },
        KeepSnapshot(20),
        PurgePastEnd(20),
        Append {
            term: 3,
            count: 3,
            len: 10,
        },
    ]
}

/// What the workload knows: what must read back, and what may.
#[derive(Debug, Default)]
struct Model {
    /// Index → entry reported flushed and not since put at risk by a truncation or purge.
    acked: BTreeMap<u64, Entry>,
    /// Index → every entry appended there that no completed truncation removed.
    allowed: BTreeMap<u64, Vec<Entry>>,
    /// The last vote saved while the store was not fenced, and every vote saved.
    acked_vote: Option<Vote>,
    votes: Vec<Vote>,
    /// The last purge completed while not fenced.
    acked_purged: Option<LogId>,
    /// Every snapshot meta the workload kept, and the last one kept while not fenced.
    snapshots: Vec<LogId>,
    acked_snapshot: Option<LogId>,
    /// The index the purge past the end purges up to, once that purge started.
    past_end: Option<u64>,
    /// The last index of the workload's view.
    last: Option<LogId>,
    /// Whether the fence tripped and when.
    fenced: bool,
}

fn entry(term: u64, index: u64, len: usize) -> Entry {
    if len == 0 {
        return Entry {
            log_id: log_id(term, index),
            payload: Payload::Blank,
        };
    }
    let mut payload = format!("entry {index} term {term} ").into_bytes();
    payload.resize(len.max(payload.len()), b'.');
    Entry {
        log_id: log_id(term, index),
        payload: Payload::Normal(PartitionRecord::new(1, index, payload).expect("record type")),
    }
}

async fn run_step(store: &mut LogStore, step: Step, model: &mut Model) {
    let fence = store.fence();
    let next = model.last.map_or(0, |l| l.index + 1);
    match step {
        Step::Vote(term) => {
            let vote = Vote::new_committed(term, term);
            model.votes.push(vote);
            store.save_vote(&vote).await.expect("save_vote never fails");
            if !fence.is_tripped() {
                model.acked_vote = Some(vote);
            }
        }
        Step::Append { term, count, len } => {
            let entries: Vec<Entry> = (next..next + count).map(|i| entry(term, i, len)).collect();
            for e in &entries {
                model
                    .allowed
                    .entry(e.log_id.index)
                    .or_default()
                    .push(e.clone());
            }
            let fenced_before = fence.is_tripped();
            let (tx, rx) = TypeConfig::oneshot();
            store
                .append(entries.clone(), IOFlushed::signal(tx))
                .await
                .expect("append never fails");
            model.last = entries.last().map(|e| e.log_id);
            if let Ok(Ok(())) = rx.await {
                assert!(
                    !fenced_before,
                    "a flush reported for an append made while fenced"
                );
                for e in entries {
                    model.acked.insert(e.log_id.index, e);
                }
            }
        }
        Step::Committed(index) => {
            let committed = model.acked.get(&index).map(|e| e.log_id);
            store
                .save_committed(committed)
                .await
                .expect("save_committed never fails");
        }
        Step::TruncateAfter(index) => {
            let keep = model.allowed[&index].last().expect("entry").log_id;
            // Entries past the cut are at risk from the moment it starts.
            model.acked.retain(|i, _| *i <= index);
            store
                .truncate_after(Some(keep))
                .await
                .expect("truncate_after never fails");
            model.last = Some(keep);
            if !fence.is_tripped() {
                model.allowed.retain(|i, _| *i <= index);
            }
        }
        Step::KeepSnapshot(index) => {
            let upto = log_id(
                model.last.expect("entries").leader_id.term,
                next - 1 + index,
            );
            model.snapshots.push(upto);
            let kept = store.snapshot_keeper().save(snapshot_meta(upto)).await;
            match kept {
                Ok(()) if !fence.is_tripped() => model.acked_snapshot = Some(upto),
                Ok(()) => {}
                // The state machine trips the group's fence when it cannot keep a snapshot
                // (`replica/notifier.rs`): openraft never learns of it, so nothing is purged.
                Err(e) => fence.trip(RaftError::Invalid(format!("keep the snapshot: {e}"))),
            }
        }
        Step::Purge(index) | Step::PurgePastEnd(index) => {
            if let Step::PurgePastEnd(_) = step {
                model.past_end = Some(next - 1 + index);
            }
            let upto = match step {
                Step::Purge(_) => model.allowed[&index].last().expect("entry").log_id,
                _ => log_id(
                    model.last.expect("entries").leader_id.term,
                    next - 1 + index,
                ),
            };
            model.acked.retain(|i, _| *i > upto.index);
            store.purge(upto).await.expect("purge never fails");
            if model.last.is_none_or(|l| l.index < upto.index) {
                model.last = Some(upto);
            }
            if !fence.is_tripped() {
                model.acked_purged = Some(upto);
            }
        }
    }
    model.fenced = fence.is_tripped();
}

/// A snapshot's meta up to `last`, with a one-node membership.
fn snapshot_meta(last: LogId) -> SnapshotMeta {
    let membership = Membership::new(
        vec![std::collections::BTreeSet::from([1])],
        BTreeMap::from([(1, NodeAddr::new("127.0.0.1:5690"))]),
    )
    .expect("membership");
    SnapshotMeta {
        last_log_id: Some(last),
        last_membership: StoredMembership::new(None, membership),
    }
}

fn run_workload(store: &mut LogStore, model: &mut Model) {
    runtime().block_on(async {
        for step in workload() {
            run_step(store, step, model).await;
        }
    });
}

/// Check a store opened (or healed) after the workload against the model, then append one more
/// entry (the model learns it), reopen and find it.
fn check_store(io: &SimIo, logs: GroupLogs, model: &mut Model, what: &str) {
    let mut store = logs
        .store()
        .unwrap_or_else(|e| panic!("{what}: store: {e}"));
    let rt = runtime();
    let last = rt.block_on(async {
        let state = store.get_log_state().await.expect("log state");
        assert!(
            state.last_purged_log_id >= model.acked_purged,
            "{what}: purge point {:?} below the completed {:?}",
            state.last_purged_log_id,
            model.acked_purged
        );
        let mut reader = store.get_log_reader().await;
        let entries = reader.try_get_log_entries(0..u64::MAX).await.expect("read");
        let purged_next = state.last_purged_log_id.map_or(0, |p| p.index + 1);
        for (position, e) in entries.iter().enumerate() {
            let index = e.log_id.index;
            assert_eq!(
                index,
                purged_next + position as u64,
                "{what}: entries have a gap"
            );
            assert!(
                model.allowed.get(&index).is_some_and(|a| a.contains(e)),
                "{what}: entry at {index} was never appended there (or was truncated): {e:?}"
            );
        }
        for (index, e) in &model.acked {
            if *index < purged_next {
                continue;
            }
            let found = entries.get((index - purged_next) as usize);
            assert_eq!(found, Some(e), "{what}: flushed entry {index} lost");
        }
        let last = entries
            .last()
            .map(|e| e.log_id)
            .or(state.last_purged_log_id);
        assert_eq!(state.last_log_id, last, "{what}: last log id");
        // The snapshot meta: never one the workload did not keep, never older than the last
        // one kept, and always covering a purge past the end (kept durably first).
        let snapshot = store
            .snapshot_keeper()
            .current()
            .await
            .and_then(|meta| meta.last_log_id);
        if let Some(kept) = snapshot {
            assert!(
                model.snapshots.contains(&kept),
                "{what}: snapshot {kept:?} was never kept"
            );
        }
        assert!(
            snapshot >= model.acked_snapshot,
            "{what}: snapshot {snapshot:?} below the kept {:?}",
            model.acked_snapshot
        );
        if let (Some(past_end), Some(purged)) = (model.past_end, state.last_purged_log_id) {
            if purged.index >= past_end {
                assert!(
                    snapshot.is_some_and(|s| s.index >= purged.index),
                    "{what}: purged past the end up to {purged:?} without a snapshot there \
                     ({snapshot:?})"
                );
            }
        }
        let vote = reader.read_vote().await.expect("vote");
        if let Some(acked) = model.acked_vote {
            let vote = vote.unwrap_or_else(|| panic!("{what}: vote {acked:?} lost"));
            assert!(model.votes.contains(&vote), "{what}: unknown vote {vote:?}");
            assert!(
                vote.leader_id.term >= acked.leader_id.term,
                "{what}: vote went back from {acked:?} to {vote:?}"
            );
        }
        let committed = store.read_committed().await.expect("committed");
        assert!(
            committed.map(|c| c.index) <= last.map(|l| l.index),
            "{what}: committed {committed:?} past the last entry {last:?}"
        );
        // The store takes a new entry and reports it flushed.
        let next = last.map_or(0, |l| l.index + 1);
        let extra = entry(9, next, 64);
        let (tx, rx) = TypeConfig::oneshot();
        store
            .append([extra.clone()], IOFlushed::signal(tx))
            .await
            .expect("append");
        assert!(
            matches!(rx.await, Ok(Ok(()))),
            "{what}: the new append was not flushed: {:?}",
            store.fence().reason()
        );
        extra
    });
    drop(store);
    drop(rt);
    close(logs, what);
    let logs = GroupLogs::open(Arc::new(io.clone()), Path::new(DIR), options(), None)
        .unwrap_or_else(|e| panic!("{what}: reopen after the new append: {e}"));
    let store = logs.store().expect("store");
    let found = runtime().block_on(async {
        store
            .reader()
            .try_get_log_entries(last.log_id.index..last.log_id.index + 1)
            .await
            .expect("read")
    });
    assert_eq!(
        found,
        vec![last.clone()],
        "{what}: the new entry after a reopen"
    );
    model
        .allowed
        .entry(last.log_id.index)
        .or_default()
        .push(last.clone());
    model.acked.insert(last.log_id.index, last);
    drop(store);
    close(logs, what);
}

fn close(mut logs: GroupLogs, what: &str) {
    for _ in 0..1000 {
        match logs.try_close() {
            Ok(_) => return,
            Err(again) => logs = again,
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("{what}: logs still held");
}

fn open(io: &SimIo) -> GroupLogs {
    GroupLogs::open(Arc::new(io.clone()), Path::new(DIR), options(), None).expect("open")
}

fn steps_wanted() -> Option<u64> {
    std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok())
}

fn count_steps(seed: u64) -> u64 {
    let io = SimIo::new(seed);
    let logs = open(&io);
    let mut store = logs.store().expect("store");
    let mut model = Model::default();
    run_workload(&mut store, &mut model);
    assert!(
        !model.fenced,
        "the workload fails without a fault: {:?}",
        store.fence().reason()
    );
    // The workload does what it says: the log rolled and the purge at 200 removed the first
    // segment (a log's last segment is never removed), and the purge past the end restarted
    // the log at the purge point: the entries after it are the only records left.
    let entries = logs.entries();
    let purged = runtime().block_on(async {
        store
            .get_log_state()
            .await
            .expect("log state")
            .last_purged_log_id
    });
    let purged_next = purged.map_or(0, |p| p.index + 1);
    assert!(purged_next > 0, "nothing was purged");
    assert_eq!(
        entries.start_offset(),
        purged_next,
        "the log restarts at the purge point past its end"
    );
    let last = model.last.expect("entries").index;
    for offset in purged_next..=last {
        let record = entries
            .read(offset)
            .expect("read an entry after the restart");
        assert!(
            keratin_raft::entry_format::decode_entry(&record)
                .expect("decode")
                .is_some(),
            "offset {offset} holds a gap record"
        );
    }
    drop(store);
    close(logs, "dry run");
    let steps = io.steps();
    eprintln!("workload: {steps} Io calls");
    steps
}

#[test]
fn power_loss_at_every_step() {
    let seed = seed();
    let steps = count_steps(seed);
    for k in steps_wanted().map_or(0..steps, |k| k..k + 1) {
        let what = format!("power loss after call {k} (seed {seed})");
        let io = SimIo::new(seed.wrapping_add(k));
        io.crash_after(k);
        let mut model = Model::default();
        // A crash during open leaves nothing flushed: the model stays empty.
        if let Ok(logs) = GroupLogs::open(Arc::new(io.clone()), Path::new(DIR), options(), None) {
            if let Ok(mut store) = logs.store() {
                run_workload(&mut store, &mut model);
            }
        }
        let io = io.restart();
        let logs = GroupLogs::open(Arc::new(io.clone()), Path::new(DIR), options(), None)
            .unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
        check_store(&io, logs, &mut model, &what);
    }
}

fn fault_sweep(fault: SimFault) {
    let seed = seed();
    let steps = count_steps(seed);
    let mut fenced_runs = 0;
    let mut not_reached = 0;
    for k in steps_wanted().map_or(0..steps, |k| k..k + 1) {
        let what = format!("{fault:?} at call {k} (seed {seed})");
        let io = SimIo::new(seed.wrapping_add(k));
        io.fail_at(k, fault);
        let mut model = Model::default();
        // The fault may hit opening itself (an error to the owner, not to openraft): then the
        // owner opens again, and the workload runs on a disk without a fault.
        let logs = GroupLogs::open(Arc::new(io.clone()), Path::new(DIR), options(), None)
            .unwrap_or_else(|_| open(&io));
        // The fault may hit the write of the copy's storage identity as the store is built (an
        // error to the owner too): the owner heals the logs and builds it again.
        let mut store = logs.store().unwrap_or_else(|_| {
            logs.heal()
                .unwrap_or_else(|e| panic!("{what}: heal after a failed store: {e}"));
            logs.store()
                .unwrap_or_else(|e| panic!("{what}: store: {e}"))
        });
        run_workload(&mut store, &mut model);
        let fence = store.fence();
        drop(store);
        if io.steps() <= k {
            // This run made fewer calls than the counted one (the two logs' calls interleave
            // differently): the fault is still armed and would hit the checks. A power loss
            // clears it; the workload's guarantees must hold after one.
            not_reached += 1;
            close(logs, &what);
            let io = io.restart();
            let logs = open(&io);
            check_store(
                &io,
                logs,
                &mut model,
                &format!("{what} (not reached), power loss"),
            );
            continue;
        }
        if model.fenced {
            fenced_runs += 1;
            assert!(fence.reason().is_some(), "{what}: fenced without a reason");
        }
        logs.heal().unwrap_or_else(|e| panic!("{what}: heal: {e}"));
        check_store(&io, logs, &mut model, &format!("{what}, healed"));
        // And a power loss after all that.
        let io = io.restart();
        let logs = open(&io);
        check_store(
            &io,
            logs,
            &mut model,
            &format!("{what}, healed, power loss"),
        );
    }
    eprintln!(
        "{fault:?}: {fenced_runs} of {steps} runs fenced, {not_reached} ended before the fault"
    );
    assert!(fenced_runs > 0, "no fault stopped a log");
}

#[test]
fn eio_at_every_step_fences_then_heals() {
    fault_sweep(SimFault::Eio);
}

#[test]
fn no_space_at_every_step_fences_then_heals() {
    fault_sweep(SimFault::NoSpace);
}
