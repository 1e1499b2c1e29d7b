//! Three nodes in one process joined by real TCP: each node one `keratin-net` transport on
//! 127.0.0.1 with `Groups` as its handler, and 16 Raft groups (as 16 partitions would be) on the
//! same three nodes, each over its own entry logs on a temporary directory.
//!
//! Every group starts on node 1 alone and grows to three voters through `add_learner` and
//! `change_membership` over the network, so node 1 leads all 16. Checks: every group commits
//! writes; the node pair shares one connection whatever the number of groups (accepts and dials
//! counted); node 1's heartbeats leave coalesced (16 groups' heartbeats every 50 ms cannot fit
//! in one frame each when frames leave at most every 10 ms); after node 1 is stopped (transport
//! closed, its Rafts shut down, its logs closed), every group elects a leader among the
//! survivors and commits more, with every acknowledged write present on both; node 1 started
//! again from its directories catches up in every group. It fails if a committed write is lost,
//! if no leader emerges within the bounds, or if the connection count or coalescing do not hold.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::tcp::Loopback;
use keratin_log::RealIo;
use keratin_net::{GroupId, Transport, TransportOptions};
use keratin_raft::network::{Groups, NetworkFactory, RaftEndpoint};
use keratin_raft::{
    GroupLogs, NodeAddr, PartitionRecord, RecordStateMachine, RecordsImage, StorageId, TypeConfig,
};
use openraft::Config;
use tokio::net::TcpListener;

type Raft = openraft::Raft<TypeConfig, RecordStateMachine>;

const GROUPS: std::ops::RangeInclusive<u64> = 1..=16;

struct Group {
    raft: Raft,
    machine: RecordStateMachine,
    logs: GroupLogs,
    /// This node's copy of the group's storage.
    storage: StorageId,
}

struct Node {
    transport: Transport,
    groups: BTreeMap<u64, Group>,
}

fn config() -> Arc<Config> {
    let config = Config {
        heartbeat_interval: 50,
        election_timeout_min: 300,
        election_timeout_max: 600,
        ..Config::default()
    };
    Arc::new(config.validate().expect("config"))
}

fn group_dir(base: &Path, group: u64) -> PathBuf {
    base.join(format!("group-{group}"))
}

async fn start(id: u64, dir: &Path, listener: TcpListener, net: &Loopback) -> Node {
    let handler = Arc::new(Groups::new());
    let cluster = net.cluster(id);
    let transport = Transport::start_on(
        listener,
        cluster,
        TransportOptions::default(),
        Arc::clone(&handler) as Arc<dyn keratin_net::Handler>,
    )
    .expect("transport");
    let mut groups = BTreeMap::new();
    for group in GROUPS {
        let path = group_dir(dir, group);
        std::fs::create_dir_all(&path).expect("group directory");
        let logs =
            GroupLogs::open(Arc::new(RealIo::new()), &path, common::options(), None).expect("logs");
        let store = logs.store().expect("store");
        let fence = store.fence();
        let storage = store.storage();
        let machine = RecordStateMachine::new();
        let network =
            NetworkFactory::<RecordsImage>::new(transport.clone(), GroupId(group), fence.clone());
        let raft = Raft::new(id, config(), network, store, machine.clone())
            .await
            .expect("raft");
        handler.insert(
            GroupId(group),
            Arc::new(RaftEndpoint::new(raft.clone(), fence, storage)),
        );
        groups.insert(
            group,
            Group {
                raft,
                machine,
                logs,
                storage,
            },
        );
    }
    Node { transport, groups }
}

async fn stop(id: u64, node: Node) {
    node.transport.shutdown();
    for (group, g) in node.groups {
        g.raft.shutdown().await.expect("shutdown");
        drop(g.raft);
        common::tcp::close_logs(&format!("node {id} group {group}"), g.logs).await;
    }
}

async fn leader_of(nodes: &BTreeMap<u64, Node>, group: u64) -> u64 {
    for _ in 0..200 {
        for (id, node) in nodes {
            if node.groups[&group].raft.current_leader().await == Some(*id) {
                return *id;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "group {group}: no leader among {:?} after 10 s",
        nodes.keys()
    );
}

/// `count` writes to `group`, 50 in flight, each sent to the group's leader; offset ->
/// payload. A write refused with "forward to leader" (an election, or a leader whose lease ran
/// out under load) was not appended: it is sent again to the leader of the moment, for at most
/// 10 s. Any other error fails the test.
async fn write(
    nodes: &BTreeMap<u64, Node>,
    group: u64,
    first: usize,
    count: usize,
) -> BTreeMap<u64, Vec<u8>> {
    let rafts: Arc<BTreeMap<u64, Raft>> = Arc::new(
        nodes
            .iter()
            .map(|(id, node)| (*id, node.groups[&group].raft.clone()))
            .collect(),
    );
    let mut acked = BTreeMap::new();
    for chunk in (first..first + count).step_by(50) {
        let mut writes = Vec::new();
        for n in chunk..(chunk + 50).min(first + count) {
            let rafts = Arc::clone(&rafts);
            let payload = format!("group {group} message {n}").into_bytes();
            writes.push(tokio::spawn(async move {
                let record = PartitionRecord::new(1, 1_700_000_000_000 + n as u64, payload.clone())
                    .expect("record");
                (write_one(&rafts, group, n, record).await, payload)
            }));
        }
        for write in writes {
            let (offset, payload) = write.await.expect("write task");
            assert!(
                acked.insert(offset, payload).is_none(),
                "offset {offset} twice"
            );
        }
    }
    acked
}

async fn write_one(
    rafts: &BTreeMap<u64, Raft>,
    group: u64,
    n: usize,
    record: PartitionRecord,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        for (id, raft) in rafts {
            if raft.current_leader().await != Some(*id) {
                continue;
            }
            match raft.client_write(record.clone()).await {
                Ok(response) => return response.log_id.index,
                Err(openraft::errors::RaftError::APIError(
                    openraft::errors::ClientWriteError::ForwardToLeader(_),
                )) => {}
                Err(e) => panic!("group {group}, write {n} on node {id}: {e}"),
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "group {group}, write {n}: no leader took it within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn check_has(id: u64, group: &Group, acked: &BTreeMap<u64, Vec<u8>>) {
    let last = *acked.keys().next_back().expect("writes");
    group
        .raft
        .wait(Some(Duration::from_secs(10)))
        .applied_index_at_least(Some(last), "applied the acknowledged writes")
        .await
        .unwrap_or_else(|e| panic!("node {id}: {e}"));
    let records = group.machine.records();
    for (offset, payload) in acked {
        let record = records
            .get(offset)
            .unwrap_or_else(|| panic!("node {id}: acknowledged write at {offset} missing"));
        assert_eq!(
            record.payload(),
            payload.as_slice(),
            "node {id}, offset {offset}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_groups_share_one_connection_per_pair_and_survive_a_node() {
    let mut net = common::tcp::three_nodes().await;
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        nodes.insert(id, start(id, net.dirs[&id].path(), listener, &net).await);
    }
    let members = net.members();
    for group in GROUPS {
        let raft = &nodes[&1].groups[&group].raft;
        let alone: BTreeMap<u64, NodeAddr> = [(1, members[&1].clone())].into();
        raft.initialize(alone).await.expect("initialize");
        assert_eq!(
            leader_of(&nodes, group).await,
            1,
            "a group of one elects its node"
        );
        // The initial membership commits with the new leader's first entry.
        raft.wait(Some(Duration::from_secs(10)))
            .applied_index_at_least(Some(1), "the leader's first entry")
            .await
            .unwrap_or_else(|e| panic!("group {group}: {e}"));
        for id in [2, 3] {
            // A learner is added with its copy: a replica that holds no membership answers
            // only requests addressed to it.
            let storage = nodes[&id].groups[&group].storage;
            let learner = NodeAddr::with_storage(members[&id].addr.clone(), storage);
            raft.add_learner(id, learner, true)
                .await
                .unwrap_or_else(|e| panic!("group {group}: add learner {id}: {e}"));
        }
        raft.change_membership([1, 2, 3], false)
            .await
            .unwrap_or_else(|e| panic!("group {group}: change membership: {e}"));
    }

    let mut acked = BTreeMap::new();
    for group in GROUPS {
        acked.insert(group, write(&nodes, group, 0, 100).await);
    }
    // One connection per node pair, whatever the number of groups: 3 pairs, each dialed once
    // by its lower id and accepted once by its higher id.
    let dialed: u64 = nodes
        .values()
        .map(|n| n.transport.stats().connections_dialed)
        .sum();
    let accepted: u64 = nodes
        .values()
        .map(|n| n.transport.stats().connections_accepted)
        .sum();
    assert_eq!((dialed, accepted), (3, 3), "one connection per node pair");
    // Over a few heartbeat rounds, node 1 (leading every group) sends 16 groups' heartbeats
    // per 50 ms to each peer, in frames that leave at most every 10 ms.
    let before = nodes[&1].transport.stats();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = nodes[&1].transport.stats();
    let heartbeats = after.heartbeats_sent - before.heartbeats_sent;
    let frames = after.heartbeat_frames_sent - before.heartbeat_frames_sent;
    assert!(heartbeats >= 100, "only {heartbeats} heartbeats in 500 ms");
    assert!(
        frames * 2 < heartbeats,
        "{heartbeats} heartbeats in {frames} frames: not coalesced"
    );

    // Stop node 1, the leader of every group.
    let victim = 1;
    let stopped = nodes.remove(&victim).expect("victim");
    stop(victim, stopped).await;
    for group in GROUPS {
        let leader = leader_of(&nodes, group).await;
        assert_ne!(leader, victim);
        let more = write(&nodes, group, 100, 50).await;
        acked.get_mut(&group).expect("group").extend(more);
        for (id, node) in &nodes {
            check_has(*id, &node.groups[&group], &acked[&group]).await;
        }
    }

    // Back from its directories on the same address: it catches up in both groups.
    let listener = net.rebind(victim).await;
    let restarted = start(victim, net.dirs[&victim].path(), listener, &net).await;
    for group in GROUPS {
        check_has(victim, &restarted.groups[&group], &acked[&group]).await;
    }
    nodes.insert(victim, restarted);
    for (id, node) in nodes {
        stop(id, node).await;
    }
}
