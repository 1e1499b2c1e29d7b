//! A follower's owner reads what it has just applied from memory, not back from the file.
//!
//! On a follower the partition owner reads every committed entry right after the state machine
//! applied it, and an applied entry used to leave the log view's memory at that moment: every
//! record was read back from the segment file it had just been written to (issue 14's publish
//! profile: `read_committed` 16 % of a follower's CPU, about 1.1 KB read per 1 KiB message).
//! While a replica follows, the view now holds applied entries until a committed reader took
//! them, within `HOLD_BYTES_MAX`; a leader holds nothing.
//!
//! Three replicas on real TCP. It fails if a follower's view does not hold the committed
//! entries its reader has not taken, keeps them after the reader took them, holds more than
//! the bound when nobody reads, or if the leader holds applied entries.

mod common;

use std::time::Duration;

use common::tcp::{leader_of, start_group, stop_group};
use keratin_net::GroupId;
use keratin_raft::replica::ProposeError;
use keratin_raft::PartitionRecord;
use keratin_raft::HOLD_BYTES_MAX;

const GROUP: GroupId = GroupId(12);
const WAIT: Duration = Duration::from_secs(20);
const RECORD_BYTES: usize = 1024;

fn records(count: usize) -> Vec<PartitionRecord> {
    (0..count)
        .map(|n| {
            PartitionRecord::new(1, 1_700_000_000_000, vec![(n % 251) as u8; RECORD_BYTES])
                .expect("record")
        })
        .collect()
}

/// Until `check` holds (polling), within [`WAIT`].
async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_following_replica_holds_applied_entries_until_its_reader_took_them() {
    let mut net = common::tcp::three_nodes().await;
    let nodes = start_group(&mut net, GROUP).await;
    let leader = leader_of(&nodes, WAIT).await;
    let followers: Vec<u64> = nodes.keys().copied().filter(|id| *id != leader).collect();
    // What the forwarder of a replicated partition log does on each role.
    nodes[&leader].replica.hold_for_reader(false);
    for id in &followers {
        nodes[id].replica.hold_for_reader(true);
    }

    // 200 records of 1 KiB, committed and applied everywhere.
    let mut end = 0;
    for _ in 0..4 {
        match nodes[&leader].replica.propose(records(50)).await {
            Ok(offsets) => end = offsets.end,
            Err(ProposeError::NotLeader { .. }) => panic!("leadership moved during the test"),
            Err(other) => panic!("proposal: {other}"),
        }
    }
    for (id, node) in &nodes {
        let mut committed = node.replica.committed();
        tokio::time::timeout(WAIT, committed.wait_for(|up_to| *up_to >= end))
            .await
            .unwrap_or_else(|_| panic!("node {id}: {end} not committed"))
            .expect("notifier");
    }
    let written = 200 * RECORD_BYTES;
    until("the leader lets applied entries go", || {
        nodes[&leader].replica.tail_bytes() < RECORD_BYTES
    })
    .await;
    for id in &followers {
        let held = nodes[id].replica.tail_bytes();
        assert!(
            held >= written,
            "follower {id} holds {held} bytes of the {written} its reader has not taken"
        );
        // The owner's read: every committed record, from memory.
        let reader = nodes[id].replica.reader(0);
        let read = tokio::task::block_in_place(|| {
            reader
                .map(|record| record.expect("read").payload.len())
                .filter(|len| *len >= RECORD_BYTES)
                .count()
        });
        assert_eq!(read, 200, "follower {id} read every record");
        // The applied watch moves entry by entry; the view lets a batch go once the whole batch
        // is applied (and durable), so this can trail the reader by one batch.
        let node = &nodes[id];
        until(
            &format!("follower {id} lets go of what its reader took"),
            || node.replica.tail_bytes() < RECORD_BYTES,
        )
        .await;
    }

    // Nobody reads: a follower holds at most the bound (plus the batch in flight).
    for _ in 0..(2 * HOLD_BYTES_MAX / (100 * RECORD_BYTES)) {
        match nodes[&leader].replica.propose(records(100)).await {
            Ok(offsets) => end = offsets.end,
            Err(other) => panic!("proposal: {other}"),
        }
    }
    for id in &followers {
        let mut committed = nodes[id].replica.committed();
        tokio::time::timeout(WAIT, committed.wait_for(|up_to| *up_to >= end))
            .await
            .expect("committed")
            .expect("notifier");
        let node = &nodes[id];
        until("the bound holds", || {
            node.replica.tail_bytes() <= HOLD_BYTES_MAX + 100 * (RECORD_BYTES + 64)
        })
        .await;
        // A follower that becomes leader lets them go.
        node.replica.hold_for_reader(false);
        until(
            &format!("follower {id} lets go once the hold ended"),
            || node.replica.tail_bytes() < RECORD_BYTES,
        )
        .await;
    }
    stop_group(nodes).await;
}
