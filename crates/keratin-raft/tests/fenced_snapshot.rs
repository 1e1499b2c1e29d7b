//! A snapshot is never kept while the store is fenced. Once the fence trips, truncations and
//! purges reach only the in-memory view; a snapshot's meta written to the state log then would
//! stand over a log that was never cut: after a restart the replica finds a snapshot whose
//! last entry disagrees with (or lies past) the entries on disk, and openraft refuses to start
//! it (its log-order check), so the replica never returns without a repair.
//!
//! On the simulated disk: ten entries of term 1 are flushed; the fence trips (a failed append);
//! the fenced store truncates after entry 4 (in memory only) and a snapshot up to entry 7 of
//! term 2 (a new leader's) is offered to the keeper. Fails if the keeper reports it kept, or if
//! the healed store's keeper holds it.

use std::path::Path;
use std::sync::Arc;

use keratin_log::{LogOptions, SimFault, SimIo, MIN_SEGMENT_SIZE_BYTES};
use keratin_raft::{
    Entry, GroupLogs, LeaderId, LogId, PartitionRecord, Payload, SnapshotMeta, StoredMembership,
    TypeConfig, Vote,
};
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::TypeConfigExt;

fn log_id(term: u64, index: u64) -> LogId {
    LogId::new(
        LeaderId {
            term,
            node_id: term,
        },
        index,
    )
}

fn entry(term: u64, index: u64) -> Entry {
    Entry {
        log_id: log_id(term, index),
        payload: Payload::Normal(PartitionRecord::new(1, index, vec![7; 32]).expect("record")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_store_keeps_no_snapshot() {
    let io = SimIo::new(15);
    let options = LogOptions {
        full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        ..LogOptions::default()
    };
    let logs = GroupLogs::open(Arc::new(io.clone()), Path::new("/p"), options, None).expect("open");
    let mut store = logs.store().expect("store");
    let fence = store.fence();
    let keeper = store.snapshot_keeper();
    store
        .save_vote(&Vote::new_committed(1, 1))
        .await
        .expect("vote");
    let (tx, rx) = TypeConfig::oneshot();
    store
        .append((0..10).map(|i| entry(1, i)), IOFlushed::signal(tx))
        .await
        .expect("append");
    assert!(matches!(rx.await, Ok(Ok(()))), "the first ten are flushed");

    // The next write fails: the append trips the fence.
    io.fail_at(io.steps(), SimFault::Eio);
    store
        .append([entry(1, 10)], IOFlushed::noop())
        .await
        .expect("append");
    for _ in 0..500 {
        if fence.is_tripped() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(fence.is_tripped(), "the failed append trips the fence");

    // A new leader's log: cut after entry 4 (the view only), a snapshot up to its entry 7.
    store
        .truncate_after(Some(log_id(1, 4)))
        .await
        .expect("truncate");
    let meta = SnapshotMeta {
        last_log_id: Some(log_id(2, 7)),
        last_membership: StoredMembership::default(),
    };
    let kept = keeper.save(meta.clone()).await;
    assert!(kept.is_err(), "a fenced store reported a snapshot kept");
    drop(store);

    logs.heal().expect("heal");
    let healed = logs.store().expect("a store on the healed logs");
    let on_disk = healed.snapshot_keeper().current().await;
    assert_eq!(
        on_disk, None,
        "the snapshot offered while fenced is on disk, over the uncut entries 5 to 9 of term 1"
    );
}
