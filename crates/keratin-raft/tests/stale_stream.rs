//! A leader's replication stream that asks to send from an entry the leader purged is refused
//! before anything is sent (`network::client`, "Stale streams"). openraft 0.10.0-alpha.37 can
//! keep such a stream going after a wiped follower installed the snapshot: its reads of the
//! purged entries come back empty, it sends appends without entries that the follower accepts,
//! and it never turns to the core's new command, so the follower receives nothing more (issue
//! 14's cluster test, round 5: the wiped follower stayed 857,674 entries behind for 30 s). The
//! refusal ends the stream's session; openraft then resets the follower's progress and sends
//! from its real position.
//!
//! The same stream with entries: its reads of the purged entries are raised to the purge
//! point, so it would send entry 599 after entry 565; that append is refused unsent too (the
//! receiver refuses it as well: `tests/contiguous.rs`).
//!
//! The client here has no peer to reach: a refusal for the purge names it, any other answer
//! (the transport's "not connected") means the append would have gone out. It fails without
//! the checks in `GroupNetwork::append_entries`.

mod common;

use std::sync::Arc;

use keratin_log::RealIo;
use keratin_net::{GroupId, Transport, TransportOptions};
use keratin_raft::network::{Groups, NetworkFactory};
use keratin_raft::replica::AppliedImage;
use keratin_raft::{
    Entry, GroupLogs, LeaderId, LogId, NodeAddr, PartitionRecord, Payload, TypeConfig, Vote,
};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::AppendEntriesRequest;
use openraft::storage::RaftLogStorage;

fn log_id(index: u64) -> LogId {
    LogId::new(
        LeaderId {
            term: 3,
            node_id: 1,
        },
        index,
    )
}

fn append(prev: Option<u64>, entries: Vec<Entry>) -> AppendEntriesRequest<TypeConfig> {
    AppendEntriesRequest {
        vote: Vote::new_committed(3, 1),
        prev_log_id: prev.map(log_id),
        leader_commit: Some(log_id(600)),
        entries,
    }
}

#[tokio::test]
async fn an_append_from_below_the_purge_point_is_refused_unsent() {
    let mut net = common::tcp::three_nodes().await;
    let listener = net.listeners.remove(&1).expect("listener");
    let transport = Transport::start_on(
        listener,
        net.cluster(1),
        TransportOptions::default(),
        Arc::new(Groups::new()) as Arc<dyn keratin_net::Handler>,
    )
    .expect("transport");
    // Node 2 never starts: whatever reaches the transport fails as "not connected".
    let dir = net.dirs[&1].path().join("group");
    std::fs::create_dir_all(&dir).expect("group directory");
    let logs =
        GroupLogs::open(Arc::new(RealIo::new()), &dir, common::options(), None).expect("logs");
    let mut store = logs.store().expect("store");
    let view = store.reader();
    // The leader's snapshot covers 0..=598: its log starts at 599.
    store.purge(log_id(598)).await.expect("purge");
    assert_eq!(view.floor(), 599);

    let mut factory =
        NetworkFactory::<AppliedImage>::new(transport.clone(), GroupId(7), store.fence())
            .with_log_view(view);
    let target = NodeAddr::new(net.addrs[&2].to_string());
    let mut client = factory.new_client(2, &target).await;
    let option = RPCOption::new(std::time::Duration::from_millis(100));

    // A stale stream: entries since 565, all purged here, so it sends none.
    let refused = client
        .append_entries(append(Some(565), Vec::new()), option.clone())
        .await
        .expect_err("refused");
    assert!(
        refused.to_string().contains("purged on this node"),
        "the stale append was not refused for the purge: {refused}"
    );
    // From nothing at all: also below the start.
    let refused = client
        .append_entries(append(None, Vec::new()), option.clone())
        .await
        .expect_err("refused");
    assert!(
        refused.to_string().contains("purged on this node"),
        "{refused}"
    );

    // At the purge point (the follower matched the snapshot), and with entries, the append goes
    // out: here it fails only because node 2 is not there.
    let sent = client
        .append_entries(append(Some(598), Vec::new()), option.clone())
        .await
        .expect_err("no node 2");
    assert!(!sent.to_string().contains("purged"), "{sent}");
    let entry = Entry {
        log_id: log_id(599),
        payload: Payload::Normal(PartitionRecord::new(1, 0, b"m".to_vec()).expect("record")),
    };
    // A stale stream whose read was raised to the purge point: entry 599 after entry 565.
    // Not sent: the follower would hold 599 without 566 to 598 (it must not fill the hole).
    let refused = client
        .append_entries(append(Some(565), vec![entry.clone()]), option.clone())
        .await
        .expect_err("refused");
    assert!(
        refused.to_string().contains("not sent"),
        "an append of 599 after 565 was not refused unsent: {refused}"
    );
    let sent = client
        .append_entries(append(Some(598), vec![entry]), option.clone())
        .await
        .expect_err("no node 2");
    assert!(!sent.to_string().contains("purged"), "{sent}");

    // The heartbeat client never refuses: heartbeats carry no stream's position.
    let mut heartbeats = factory.new_heartbeat_client(2, &target).await;
    let sent = heartbeats
        .append_entries(append(Some(565), Vec::new()), option)
        .await
        .expect_err("no node 2");
    assert!(!sent.to_string().contains("purged"), "{sent}");

    drop(client);
    drop(heartbeats);
    drop(factory);
    drop(store);
    transport.shutdown();
    common::tcp::close_logs("node 1", logs).await;
}
