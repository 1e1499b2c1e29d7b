//! Appends too large for one transport frame still replicate. openraft 0.10.0-alpha.37 puts up
//! to `max_payload_entries` entries in one append, whatever their size, and has no "payload too
//! large" answer: an append whose body is over the transport's frame limit (16 MiB) failed as
//! unreachable, was sent again just as large, and the followers never got past it (a queue of
//! 1 MiB messages stopped confirming once 17 of them were proposed together). The network now
//! sends such an append as several consecutive ones (`network::client`, "Large appends"), and
//! the cluster transport's frame limit leaves room for one entry carrying the largest message a
//! client frame can hold.
//!
//! Three replicas on real TCP (`keratin-net` on 127.0.0.1). It fails if a batch of 40 records
//! of 1 MiB, or one record of 16 MiB, is not committed on every node within the wait.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::tcp::{leader_of, start_group, stop_group, ReplicaNode};
use keratin_net::GroupId;
use keratin_raft::replica::ProposeError;
use keratin_raft::PartitionRecord;

const GROUP: GroupId = GroupId(11);
const WAIT: Duration = Duration::from_secs(30);

fn records(count: usize, size: usize) -> Vec<PartitionRecord> {
    (0..count)
        .map(|n| {
            let payload = vec![(n % 251) as u8; size];
            PartitionRecord::new(1, 1_700_000_000_000 + n as u64, payload).expect("record")
        })
        .collect()
}

/// Proposes `records` as one batch on the leader and waits until every node has committed it.
async fn commit_everywhere(nodes: &BTreeMap<u64, ReplicaNode>, records: Vec<PartitionRecord>) {
    let count = records.len() as u64;
    let deadline = tokio::time::Instant::now() + WAIT;
    let offsets = loop {
        let id = leader_of(nodes, WAIT).await;
        let proposed =
            tokio::time::timeout_at(deadline, nodes[&id].replica.propose(records.clone()))
                .await
                .unwrap_or_else(|_| {
                    panic!("{count} records not committed on the leader in {WAIT:?}")
                });
        match proposed {
            Ok(offsets) => break offsets,
            Err(ProposeError::NotLeader { .. }) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(other) => panic!("proposal on node {id}: {other}"),
        }
    };
    assert_eq!(offsets.end - offsets.start, count);
    for (id, node) in nodes {
        let mut committed = node.replica.committed();
        let waited =
            tokio::time::timeout_at(deadline, committed.wait_for(|up_to| *up_to >= offsets.end))
                .await
                .map(|seen| seen.map(|_| ()));
        match waited {
            Ok(alive) => alive.expect("notifier alive"),
            Err(_) => panic!(
                "node {id}: offsets {offsets:?} not committed in {WAIT:?} (committed up to {})",
                *node.replica.committed().borrow()
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn appends_over_the_frame_limit_replicate_in_parts() {
    let mut net = common::tcp::three_nodes().await;
    let nodes = start_group(&mut net, GROUP).await;

    // 40 MiB in one batch: openraft puts up to 300 of them in one append.
    commit_everywhere(&nodes, records(40, 1 << 20)).await;
    // One record as large as the largest message body a client frame can carry.
    commit_everywhere(&nodes, records(1, 16 << 20)).await;

    stop_group(nodes).await;
}
