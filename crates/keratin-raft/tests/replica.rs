//! `Replica`, the broker's view of a partition group, on three nodes joined by real TCP
//! (`keratin-net` on 127.0.0.1): batches proposed on the leader commit at consecutive offsets;
//! a follower refuses a proposal naming the leader and its address; every node's committed
//! reader returns the same records (the adapter's blank and membership entries skipped) and
//! stops at the committed offset; after the leader is stopped, a new one commits more, and the
//! old leader started again from its directory reads the same records as the others. It fails
//! if a committed record is lost, moved or reordered on any node.

mod common;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::tcp::{leader_of, Loopback, ReplicaNode as Node};
use keratin_log::RealIo;
use keratin_net::{GroupId, Transport, TransportOptions};
use keratin_raft::network::Groups;
use keratin_raft::replica::{replica_config, ProposeError, Replica};
use keratin_raft::{GroupLogs, PartitionRecord};
use tokio::net::TcpListener;

const GROUP: GroupId = GroupId(7);
const WAIT: Duration = Duration::from_secs(10);
/// Longer than a leader's lease (`ELECTION_TIMEOUT_MAX_MS`).
const LEASE_RUN_OUT: Duration =
    Duration::from_millis(keratin_raft::replica::ELECTION_TIMEOUT_MAX_MS + 500);

async fn start(id: u64, dir: &Path, listener: TcpListener, net: &Loopback) -> Node {
    let groups = Arc::new(Groups::new());
    let cluster = net.cluster(id);
    let transport = Transport::start_on(
        listener,
        cluster,
        TransportOptions::default(),
        Arc::clone(&groups) as Arc<dyn keratin_net::Handler>,
    )
    .expect("transport");
    let logs =
        GroupLogs::open(Arc::new(RealIo::new()), dir, common::options(), None).expect("logs");
    let config = replica_config("test").expect("config");
    let replica = Replica::start(id, GROUP, logs, config, transport.clone(), &groups)
        .await
        .expect("replica");
    Node {
        transport,
        groups,
        replica,
    }
}

async fn stop(id: u64, node: Node) {
    node.transport.shutdown();
    let logs = node.replica.shutdown(&node.groups).await;
    common::tcp::close_logs(&format!("node {id}"), logs).await;
}

/// Every node of `net` by id, with its cluster address: the voters of the group's formation.
fn voters_of(net: &Loopback) -> BTreeMap<u64, String> {
    net.addrs
        .iter()
        .map(|(id, addr)| (*id, addr.to_string()))
        .collect()
}

/// Every replica of `nodes` forms the group with `voters`, at once.
async fn form_all(nodes: &BTreeMap<u64, Node>, voters: &BTreeMap<u64, String>) {
    let forming = nodes.values().map(|node| node.replica.form(voters));
    for formed in futures_util::future::join_all(forming).await {
        formed.expect("form the group");
    }
}

fn batch(first: u64, count: u64) -> Vec<PartitionRecord> {
    (first..first + count)
        .map(|n| {
            let payload = format!("record {n}").into_bytes();
            PartitionRecord::new((n % 6 + 1) as u8, 1_700_000_000_000 + n, payload).expect("record")
        })
        .collect()
}

/// Proposes `batches` batches of `size` records from the leader of the moment (a proposal
/// refused with NotLeader was not appended: sent again); returns each batch's offsets.
async fn propose(
    nodes: &BTreeMap<u64, Node>,
    first: u64,
    batches: u64,
    size: u64,
) -> Vec<(Range<u64>, Vec<PartitionRecord>)> {
    let mut committed = Vec::new();
    for b in 0..batches {
        let records = batch(first + b * size, size);
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let id = leader_of(nodes, WAIT).await;
            match nodes[&id].replica.propose(records.clone()).await {
                Ok(offsets) => {
                    assert_eq!(offsets.end - offsets.start, size);
                    committed.push((offsets, records));
                    break;
                }
                Err(ProposeError::NotLeader { .. }) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "batch {b} not taken"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(other) => panic!("batch {b} on node {id}: {other}"),
            }
        }
    }
    committed
}

/// Every committed record of `expected`, read on `node` in offset order, with nothing else but
/// skipped adapter entries in between.
async fn check_reads(id: u64, node: &Node, expected: &BTreeMap<u64, PartitionRecord>) {
    let last = *expected.keys().next_back().expect("records");
    let mut committed = node.replica.committed();
    tokio::time::timeout(WAIT, committed.wait_for(|up_to| *up_to > last))
        .await
        .unwrap_or_else(|_| panic!("node {id}: offset {last} not committed in {WAIT:?}"))
        .expect("notifier alive");
    let mut reader = node.replica.reader(0);
    let read: BTreeMap<u64, PartitionRecord> = tokio::task::block_in_place(|| {
        reader
            .by_ref()
            .map(|record| {
                let record = record.expect("read");
                let partition =
                    PartitionRecord::new(record.record_type, record.timestamp_ms, record.payload)
                        .expect("a broker record type");
                (record.offset, partition)
            })
            .collect()
    });
    if &read != expected {
        let first_diff = read
            .iter()
            .zip(expected.iter())
            .find(|(a, b)| a != b)
            .map(|(a, b)| format!("read {:?} expected {:?}", a.0, b.0));
        panic!(
            "node {id} reads {} records, expected {}; first difference: {first_diff:?}; \
             read keys {:?}..{:?}, expected keys {:?}..{:?}",
            read.len(),
            expected.len(),
            read.keys().next(),
            read.keys().next_back(),
            expected.keys().next(),
            expected.keys().next_back()
        );
    }
    assert!(reader.next_offset() > last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_commit_read_and_survive_the_loss_of_the_leader() {
    let mut net = common::tcp::three_nodes().await;
    let addrs = net.addrs.clone();
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        nodes.insert(id, start(id, net.dirs[&id].path(), listener, &net).await);
    }
    let voters = voters_of(&net);
    form_all(&nodes, &voters).await;

    let mut expected = BTreeMap::new();
    for (offsets, records) in propose(&nodes, 0, 40, 25).await {
        expected.extend(offsets.zip(records));
    }
    // A follower refuses, naming the leader and its cluster address. (Under load leadership
    // may move meanwhile: a proposal that was taken is simply one more committed batch.)
    let first_leader = leader_of(&nodes, WAIT).await;
    let follower = *nodes
        .keys()
        .find(|id| **id != first_leader)
        .expect("a follower");
    let extra = batch(5_000, 1);
    match nodes[&follower].replica.propose(extra.clone()).await {
        Err(ProposeError::NotLeader {
            leader: Some(leader),
            addr,
        }) => {
            assert_ne!(leader, follower);
            assert_eq!(addr, Some(addrs[&leader].to_string()));
        }
        Err(ProposeError::NotLeader { leader: None, .. }) => {}
        Ok(offsets) => expected.extend(offsets.zip(extra)),
        Err(other) => panic!("a follower's proposal: {other}"),
    }
    for (id, node) in &nodes {
        check_reads(*id, node, &expected).await;
    }

    let first_leader = leader_of(&nodes, WAIT).await;
    let old = nodes.remove(&first_leader).expect("leader");
    stop(first_leader, old).await;
    for (offsets, records) in propose(&nodes, 1_000, 20, 25).await {
        assert!(offsets.start > *expected.keys().next_back().expect("records"));
        expected.extend(offsets.zip(records));
    }
    for (id, node) in &nodes {
        check_reads(*id, node, &expected).await;
    }

    let listener = net.rebind(first_leader).await;
    let restarted = start(first_leader, net.dirs[&first_leader].path(), listener, &net).await;
    check_reads(first_leader, &restarted, &expected).await;
    nodes.insert(first_leader, restarted);
    for (id, node) in nodes {
        stop(id, node).await;
    }
}

/// A replica started after its group formed holds nothing: it answers only requests addressed
/// to its own copy, and the leader records that copy (a membership change) to address it. With
/// the third voter down, the leader's lease and every commit need the late replica, so the
/// leader must be able to reach it before the change is committed: it addresses the copy its
/// storage probe found. Before, the late replica refused every request "holds no membership
/// yet", the leader's lease ran out, and nothing committed while the other node was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_started_late_makes_a_majority_while_another_is_down() {
    let mut net = common::tcp::three_nodes().await;
    let voters = voters_of(&net);
    let mut listeners = std::mem::take(&mut net.listeners);
    let late_listener = listeners.remove(&3).expect("node 3's listener");
    let mut nodes = BTreeMap::new();
    for (id, listener) in listeners {
        nodes.insert(id, start(id, net.dirs[&id].path(), listener, &net).await);
    }
    form_all(&nodes, &voters).await;
    let mut expected = BTreeMap::new();
    for (offsets, records) in propose(&nodes, 0, 4, 25).await {
        expected.extend(offsets.zip(records));
    }

    let leader = leader_of(&nodes, WAIT).await;
    let down = if leader == 1 { 2 } else { 1 };
    let stopped = nodes.remove(&down).expect("the follower");
    stop(down, stopped).await;
    // The leader's lease (a quorum's acknowledgements within the longest election timeout)
    // runs out before node 3 starts: it is regained only through node 3.
    tokio::time::sleep(LEASE_RUN_OUT).await;
    let late = start(3, net.dirs[&3].path(), late_listener, &net).await;
    let formation = late.replica.form(&voters).await.expect("node 3 joins");
    assert!(
        matches!(formation, keratin_raft::replica::Formation::Joined { .. }),
        "node 3 started after the group formed: {formation:?}"
    );
    nodes.insert(3, late);
    for (offsets, records) in propose(&nodes, 1_000, 4, 25).await {
        expected.extend(offsets.zip(records));
    }
    check_reads(3, &nodes[&3], &expected).await;
    for (id, node) in nodes {
        stop(id, node).await;
    }
}

/// Zero `path` from the first occurrence of `marker` to its end; whether it was found.
fn zero_from(path: &Path, marker: &[u8]) -> bool {
    let mut bytes = std::fs::read(path).expect("read segment");
    let Some(at) = bytes.windows(marker.len()).position(|w| w == marker) else {
        return false;
    };
    bytes[at..].fill(0);
    std::fs::write(path, bytes).expect("write segment");
    true
}

/// A follower's log loses its durable tail while it is down (its `entries` segment zeroed from
/// a record on: the bytes rotted, or the disk lost what it reported flushed): it restarts with
/// less than it acknowledged. The leader must catch it up again and go on committing. Before,
/// the leader's openraft core panicked ("follower log reversion is not allowed"), the group
/// died on the leader's node while it still reported leading, and nothing committed there
/// (found by the nemesis, `docs/reliability.md`, finding 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_that_lost_its_log_tail_is_caught_up_and_the_leader_lives_on() {
    let mut net = common::tcp::three_nodes().await;
    let voters = voters_of(&net);
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        nodes.insert(id, start(id, net.dirs[&id].path(), listener, &net).await);
    }
    form_all(&nodes, &voters).await;
    let mut expected = BTreeMap::new();
    for (offsets, records) in propose(&nodes, 0, 8, 25).await {
        expected.extend(offsets.zip(records));
    }
    let leader = leader_of(&nodes, WAIT).await;
    let follower = *nodes.keys().find(|id| **id != leader).expect("a follower");
    check_reads(follower, &nodes[&follower], &expected).await;
    let stopped = nodes.remove(&follower).expect("the follower");
    stop(follower, stopped).await;

    let entries = net.dirs[&follower].path().join("entries");
    let zeroed = common::files_under(&entries)
        .iter()
        .any(|path| zero_from(path, b"record 150"));
    assert!(zeroed, "record 150 not found in {}", entries.display());

    let listener = net.rebind(follower).await;
    let restarted = start(follower, net.dirs[&follower].path(), listener, &net).await;
    nodes.insert(follower, restarted);
    for (offsets, records) in propose(&nodes, 1_000, 8, 25).await {
        expected.extend(offsets.zip(records));
    }
    // Every replica holds every record, the zeroed one's included: with the other follower
    // stopped now, the leader commits only with the one that lost its tail.
    check_reads(follower, &nodes[&follower], &expected).await;
    let other = *nodes
        .keys()
        .find(|id| **id != leader && **id != follower)
        .expect("the other follower");
    let stopped = nodes.remove(&other).expect("the other follower");
    stop(other, stopped).await;
    for (offsets, records) in propose(&nodes, 2_000, 4, 25).await {
        expected.extend(offsets.zip(records));
    }
    for (id, node) in &nodes {
        check_reads(*id, node, &expected).await;
    }
    for (id, node) in nodes {
        stop(id, node).await;
    }
}
