//! A follower whose storage fails heals without a restart of its node. Three in-process
//! brokers; node 3 keeps its data on a simulated disk. While it follows, its next disk call
//! fails (EIO): its replica's fence trips and the replica stops. Its partition owner proposes
//! nothing, so only a "the log stopped" event from the log can make it heal: it must stop the
//! partition, heal it (the replica is rebuilt on the healed logs and catches up from the
//! leader), and carry the partition again: with the other follower down, publishes at the
//! leader are confirmed only with its acknowledgement. Fails if the follower's replica stays
//! down (before: until the node restarted), or if a message is missing on it afterwards.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::brokers::{agreed_leader, publish_all, wait_info, BrokerNode};
use keratin_log::{Io, SimFault, SimIo};
use keratin_raft::partition_log::partition_group;

const QUEUE: &str = "heal";
const QUEUE_ID: u64 = 9;
const WAIT: Duration = Duration::from_secs(20);
/// The node whose disk is simulated.
const SIM_NODE: u64 = 3;

fn bodies(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| format!("{prefix} {n}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_whose_disk_failed_heals_without_a_restart() {
    let sim = SimIo::new(7);
    let mut net = common::tcp::three_nodes().await;
    let mut nodes: BTreeMap<u64, BrokerNode> = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let node = if id == SIM_NODE {
            let io: Arc<dyn Io> = Arc::new(sim.clone());
            let dir = std::path::Path::new("/sim/node");
            io.create_dir_all(dir).expect("sim dir");
            common::brokers::start_on(dir, Some(io), listener, net.cluster(id)).await
        } else {
            common::brokers::start(net.dirs[&id].path(), listener, net.cluster(id)).await
        };
        nodes.insert(id, node);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    // Node 3 must follow: while it leads, node 1 starts an election (bounded).
    let group = partition_group(QUEUE_ID, 0).expect("group");
    let mut leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    for _ in 0..10 {
        if leader != SIM_NODE {
            break;
        }
        nodes[&1]
            .logs
            .raft(group)
            .expect("node 1's replica")
            .trigger()
            .elect(false)
            .await
            .expect("election triggered");
        tokio::time::sleep(Duration::from_millis(500)).await;
        leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    }
    assert_ne!(leader, SIM_NODE, "node 3 kept leading through 10 elections");
    let first = bodies("first", 20);
    publish_all(&nodes[&leader].broker, QUEUE, &first, WAIT).await;
    wait_info(
        &nodes[&SIM_NODE].broker,
        QUEUE,
        WAIT,
        "node 3 has the first 20",
        |info| info.partitions[0].ready == 20,
    )
    .await;

    // Its next disk call fails; the leader's next publishes reach it and trip its fence.
    sim.fail_at(sim.steps(), SimFault::Eio);
    let second = bodies("second", 20);
    publish_all(&nodes[&leader].broker, QUEUE, &second, WAIT).await;
    let info = wait_info(
        &nodes[&SIM_NODE].broker,
        QUEUE,
        WAIT,
        "node 3 stopped and healed its partition, and holds all 40",
        |info| {
            let p = &info.partitions[0];
            p.stops >= 1 && p.heals >= 1 && !p.stopped && p.ready == 40
        },
    )
    .await;
    eprintln!("node 3 after its heal: {:?}", info.partitions[0]);

    // It carries the partition: with the other follower down, confirms need it.
    let other = (1..=3)
        .find(|id| *id != leader && *id != SIM_NODE)
        .expect("the other follower");
    nodes.remove(&other).expect("other").stop().await;
    let third = bodies("third", 10);
    publish_all(&nodes[&leader].broker, QUEUE, &third, WAIT).await;
    wait_info(
        &nodes[&SIM_NODE].broker,
        QUEUE,
        WAIT,
        "node 3 holds all 50",
        |info| info.partitions[0].ready == 50,
    )
    .await;
    for (_, node) in nodes {
        node.stop().await;
    }
}
