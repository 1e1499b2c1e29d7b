//! A follower never takes an append whose first entry does not follow its previous log id:
//! a leader's stale replication stream reads from the purge point up (`store.rs`), so it can
//! send "entries from 3" with "previous entry: none". The receiver must refuse such a body
//! instead of filling the hole with gap records and acknowledging the entries (openraft's
//! follower only `debug_assert`s it: in a debug build its core panicked and the replica was
//! dead; in a release build the hole was filled and acknowledged). The sender refuses it too
//! (`network::client`, "Non-contiguous appends").
//!
//! Node 2's replica holds the formation's membership; an append with entries 3 and 4 after no
//! previous entry is handed to its node's handler. Fails if it is answered as anything but a
//! malformed body, if the replica stops answering afterwards, or if entry 3 was stored.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use keratin_net::{GroupId, Handler};
use keratin_raft::network::{codes, rpc};
use keratin_raft::{Entry, LeaderId, LogId, NodeAddr, PartitionRecord, Payload, TypeConfig, Vote};
use openraft::raft::AppendEntriesRequest;

const GROUP: GroupId = GroupId(11);

fn entry(index: u64) -> Entry {
    Entry {
        log_id: LogId::new(
            LeaderId {
                term: 1,
                node_id: 1,
            },
            index,
        ),
        payload: Payload::Normal(PartitionRecord::new(1, 0, b"x".to_vec()).expect("record")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_that_skips_entries_is_refused() {
    let mut net = common::tcp::nodes(2).await;
    let listener = net.listeners.remove(&2).expect("node 2's listener");
    let dir = net.dirs[&2].path().join("group");
    let node = common::tcp::start_replica(2, GROUP, &dir, listener, &net).await;
    let members: BTreeMap<u64, NodeAddr> = net.members();
    node.replica
        .raft()
        .initialize(members)
        .await
        .expect("initialize");

    let request: AppendEntriesRequest<TypeConfig> = AppendEntriesRequest {
        // Above any term node 2 reached campaigning alone.
        vote: Vote::new_committed(100, 1),
        prev_log_id: None,
        leader_commit: None,
        entries: vec![entry(3), entry(4)],
    };
    let body = rpc::encode_append(&request, Some(node.replica.storage())).expect("encode");
    let answer = node
        .groups
        .call(1, GROUP, rpc::KIND_APPEND, Bytes::from(body))
        .await;
    match answer {
        Err(refusal) => assert_eq!(
            refusal.code,
            codes::BAD_BODY,
            "refused, but not as a malformed body: {refusal:?}"
        ),
        Ok(reply) => panic!(
            "an append of entries 3 and 4 after no entry was answered {:?}",
            rpc::decode_append_reply(&reply)
        ),
    }
    // The replica still answers, and entry 3 is nowhere.
    let alive = tokio::time::timeout(Duration::from_secs(5), node.replica.raft().is_initialized())
        .await
        .expect("the replica answers within 5 s");
    assert!(matches!(alive, Ok(true)), "the replica stopped: {alive:?}");
    assert!(
        node.replica.logs().entries().next_offset() <= 1,
        "entries were stored past the formation's membership: next offset {}",
        node.replica.logs().entries().next_offset()
    );
    common::tcp::stop_group([(2, node)].into()).await;
}
