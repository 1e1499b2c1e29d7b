//! A follower names its leader's client address as soon as the node learns it. Three
//! in-process brokers whose address resolver knows no client address at first (as on a node
//! whose peers have not answered its `HELLO` yet, right after the cluster starts): a follower
//! then names the leader without its address. Once the addresses are known, the follower's
//! partition names the leader's address within a second, with nothing else happening in the
//! group (no election, no publish). Before the fix, the role was sent again only when the
//! leader changed, so its "not the leader" answers named no address until then (seen: a
//! client publishing right after a cluster started got 421 without an address for 5 s).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::brokers::{agreed_leader, client_addr, wait_info, BrokerNode};

const QUEUE: &str = "addressed";
const QUEUE_ID: u64 = 5;
const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_names_the_leaders_address_once_it_is_known() {
    let known = Arc::new(AtomicBool::new(false));
    let mut net = common::tcp::three_nodes().await;
    let mut nodes: BTreeMap<u64, BrokerNode> = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let known = known.clone();
        let resolver: keratin_raft::partition_log::ClientAddrs =
            Arc::new(move |id| known.load(Ordering::SeqCst).then(|| client_addr(id)));
        let node = common::brokers::start_resolving(
            net.dirs[&id].path(),
            None,
            listener,
            net.cluster(id),
            resolver,
        )
        .await;
        nodes.insert(id, node);
    }
    common::brokers::declare_everywhere(&nodes, QUEUE_ID, QUEUE).await;
    let leader = agreed_leader(&nodes, QUEUE, WAIT).await;
    let follower = *nodes.keys().find(|id| **id != leader).expect("a follower");
    let info = wait_info(
        &nodes[&follower].broker,
        QUEUE,
        WAIT,
        "the follower names the leader",
        |info| info.partitions[0].leader == Some(leader),
    )
    .await;
    assert_eq!(info.partitions[0].leader_addr, None, "no address known yet");
    // The addresses become known; nothing else happens in the group.
    known.store(true, Ordering::SeqCst);
    wait_info(
        &nodes[&follower].broker,
        QUEUE,
        Duration::from_secs(1),
        "the follower names the leader's address",
        |info| info.partitions[0].leader_addr.as_deref() == Some(&client_addr(leader)),
    )
    .await;
    for (_, node) in nodes {
        node.stop().await;
    }
}
