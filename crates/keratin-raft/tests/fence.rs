//! What openraft sees of a fenced store, and what a rebuilt one sees. On the simulated disk: ten
//! entries are flushed, the next `Io` call fails, and the append that hits it trips the fence.
//! While fenced, every storage call answers `Ok` and works on the in-memory view only: a
//! truncation hides the durable entries past it (they are still on disk), the entries appended
//! after it are read from the view and never reported flushed, a vote is visible to readers but
//! not written. After `GroupLogs::heal`, a new store shows exactly what is durable: the ten
//! entries and the vote saved before the failure. It fails if a stale disk entry shows through
//! the view, if a fenced append is reported flushed, or if anything the fenced store accepted
//! reaches the disk.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keratin_log::{LogOptions, SimFault, SimIo, MIN_SEGMENT_SIZE_BYTES};
use keratin_raft::{Entry, GroupLogs, LeaderId, LogId, PartitionRecord, Payload, TypeConfig, Vote};
use openraft::storage::{IOFlushed, RaftLogReader, RaftLogStorage};
use openraft::type_config::TypeConfigExt;

fn entry(term: u64, index: u64) -> Entry {
    let payload = format!("entry {index} of term {term}").into_bytes();
    Entry {
        log_id: LogId::new(
            LeaderId {
                term,
                node_id: term,
            },
            index,
        ),
        payload: Payload::Normal(PartitionRecord::new(1, index, payload).expect("record")),
    }
}

#[tokio::test]
async fn a_fenced_store_answers_from_its_view_and_a_rebuilt_one_from_the_disk() {
    let io = SimIo::new(14);
    let options = LogOptions {
        full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        ..LogOptions::default()
    };
    let logs = GroupLogs::open(Arc::new(io.clone()), Path::new("/p"), options, None).expect("open");
    let mut store = logs.store().expect("store");
    let fence = store.fence();
    store
        .save_vote(&Vote::new_committed(1, 1))
        .await
        .expect("vote");
    let first: Vec<Entry> = (0..10).map(|i| entry(1, i)).collect();
    let (tx, rx) = TypeConfig::oneshot();
    store
        .append(first.clone(), IOFlushed::signal(tx))
        .await
        .expect("append");
    assert!(matches!(rx.await, Ok(Ok(()))), "the first ten are flushed");

    io.fail_at(io.steps(), SimFault::Eio);
    let (tx, rx) = TypeConfig::oneshot();
    store
        .append((10..15).map(|i| entry(1, i)), IOFlushed::signal(tx))
        .await
        .expect("an append never fails");
    tokio::time::timeout(Duration::from_secs(5), fence.tripped())
        .await
        .expect("the failed write trips the fence");
    assert!(
        rx.await.is_err(),
        "the failed append is never reported flushed"
    );

    // Fenced: truncate below the durable end, append under a new term, vote.
    store
        .truncate_after(Some(first[7].log_id))
        .await
        .expect("truncate");
    let second: Vec<Entry> = (8..12).map(|i| entry(2, i)).collect();
    let (tx, rx) = TypeConfig::oneshot();
    store
        .append(second.clone(), IOFlushed::signal(tx))
        .await
        .expect("append");
    assert!(
        rx.await.is_err(),
        "an append made while fenced is never flushed"
    );
    store
        .save_vote(&Vote::new_committed(2, 2))
        .await
        .expect("vote");
    store
        .save_committed(Some(second[3].log_id))
        .await
        .expect("committed");

    let mut reader = store.get_log_reader().await;
    let view = reader.try_get_log_entries(0..100).await.expect("read");
    let expected: Vec<Entry> = first[..8].iter().chain(&second).cloned().collect();
    assert_eq!(
        view, expected,
        "the view: eight durable entries, then the fenced ones"
    );
    assert_eq!(
        reader.read_vote().await.expect("vote"),
        Some(Vote::new_committed(2, 2))
    );
    let state = store.get_log_state().await.expect("state");
    assert_eq!(state.last_log_id, Some(second[3].log_id));

    // Rebuild: the owner drops the store (its Raft is shut down), heals and builds a new one.
    drop(reader);
    drop(store);
    logs.heal().expect("heal");
    let mut store = logs.store().expect("store after heal");
    let mut reader = store.get_log_reader().await;
    let durable = reader.try_get_log_entries(0..100).await.expect("read");
    assert_eq!(durable, first, "exactly the flushed entries");
    assert_eq!(
        reader.read_vote().await.expect("vote"),
        Some(Vote::new_committed(1, 1)),
        "the vote saved while fenced never reached the disk"
    );
    assert!(store.read_committed().await.expect("committed") <= Some(first[9].log_id));
    assert!(!store.fence().is_tripped(), "a new store has a new fence");
}
