//! Brokers on a cluster node each: `keratin_broker::Broker` with `ReplicatedLogs` as its
//! partition-log provider, over a `keratin-net` transport on 127.0.0.1 (`tcp::Loopback`). The
//! client addresses the nodes' resolver names are made up (`client-N.test:5680`): nothing
//! dials them, the tests only check that they are the ones reported.

use std::sync::Arc;
use std::time::Duration;

use keratin_broker::{Broker, BrokerConfig, BrokerError, Message, QueueInfo};
use keratin_log::MIN_SEGMENT_SIZE_BYTES;
use keratin_net::{ResolvedCluster, Transport, TransportOptions};
use keratin_raft::network::Groups;
use keratin_raft::partition_log::{ClientAddrs, ReplicatedLogs, ReplicatedLogsSetup};
use keratin_raft::replica::replica_config;
use tokio::net::TcpListener;

/// The client address of node `id`, as every node's resolver names it.
pub fn client_addr(id: u64) -> String {
    format!("client-{id}.test:5680")
}

pub fn client_addrs() -> ClientAddrs {
    Arc::new(|id| Some(client_addr(id)))
}

/// One cluster node: its broker and the transport under it.
pub struct BrokerNode {
    pub broker: Broker,
    pub transport: Transport,
    pub logs: Arc<ReplicatedLogs>,
}

impl BrokerNode {
    /// Shut the broker down (its partitions close their replicas), then the transport.
    pub async fn stop(self) {
        tokio::time::timeout(Duration::from_secs(20), self.broker.shutdown())
            .await
            .expect("broker shutdown within 20 s")
            .expect("broker shutdown");
        self.transport.shutdown();
    }
}

/// The partition-log provider of node `cluster.node_id`, over `transport` and `groups`, its
/// logs on `io`.
pub fn replicated_logs(
    cluster: ResolvedCluster,
    transport: Transport,
    groups: Arc<Groups>,
    client_addrs: ClientAddrs,
) -> ReplicatedLogs {
    ReplicatedLogs::new(ReplicatedLogsSetup {
        node_id: cluster.node_id,
        transport,
        groups,
        raft_config: replica_config("test").expect("config"),
        cluster,
        client_addrs,
    })
}

/// A transport on `listener` serving a new `Groups` handler.
pub fn transport(listener: TcpListener, cluster: ResolvedCluster) -> (Transport, Arc<Groups>) {
    let groups = Arc::new(Groups::new());
    let transport = Transport::start_on(
        listener,
        cluster,
        TransportOptions::default(),
        Arc::clone(&groups) as Arc<dyn keratin_net::Handler>,
    )
    .expect("transport");
    (transport, groups)
}

/// Start node `cluster.node_id`'s broker on `dir`.
pub async fn start(
    dir: &std::path::Path,
    listener: TcpListener,
    cluster: ResolvedCluster,
) -> BrokerNode {
    start_on(dir, None, listener, cluster).await
}

/// [`start`], its storage on `io` when given (a simulated disk), else the real file system.
pub async fn start_on(
    dir: &std::path::Path,
    io: Option<Arc<dyn keratin_log::Io>>,
    listener: TcpListener,
    cluster: ResolvedCluster,
) -> BrokerNode {
    start_resolving(dir, io, listener, cluster, client_addrs()).await
}

/// [`start_on`], client addresses from `client_addrs`.
pub async fn start_resolving(
    dir: &std::path::Path,
    io: Option<Arc<dyn keratin_log::Io>>,
    listener: TcpListener,
    cluster: ResolvedCluster,
    client_addrs: ClientAddrs,
) -> BrokerNode {
    let (transport, groups) = transport(listener, cluster.clone());
    let logs = Arc::new(replicated_logs(
        cluster,
        transport.clone(),
        groups,
        client_addrs,
    ));
    let defaults = BrokerConfig::new(vec![dir.to_path_buf()]);
    let config = BrokerConfig {
        segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        pool_background: false,
        partition_logs: Some(logs.clone()),
        io: io.unwrap_or(defaults.io.clone()),
        ..defaults
    };
    let broker = Broker::open(config).await.expect("broker opens");
    BrokerNode {
        broker,
        transport,
        logs,
    }
}

/// [`start`] behind a [`super::faults::FaultyGroups`] handler: the returned faults cut or
/// shape what this node hears from each peer.
pub async fn start_faulty(
    dir: &std::path::Path,
    listener: TcpListener,
    cluster: ResolvedCluster,
) -> (BrokerNode, super::faults::Faults) {
    let groups = Arc::new(Groups::new());
    let faults = super::faults::Faults::default();
    let handler = super::faults::FaultyGroups {
        groups: groups.clone(),
        faults: faults.clone(),
    };
    let transport = Transport::start_on(
        listener,
        cluster.clone(),
        TransportOptions::default(),
        Arc::new(handler) as Arc<dyn keratin_net::Handler>,
    )
    .expect("transport");
    let logs = Arc::new(replicated_logs(
        cluster,
        transport.clone(),
        groups,
        client_addrs(),
    ));
    let defaults = BrokerConfig::new(vec![dir.to_path_buf()]);
    let config = BrokerConfig {
        segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        pool_background: false,
        partition_logs: Some(logs.clone()),
        ..defaults
    };
    let broker = Broker::open(config).await.expect("broker opens");
    let node = BrokerNode {
        broker,
        transport,
        logs,
    };
    (node, faults)
}

/// Polls `check` on `info(name)` every 20 ms until it holds; panics with `what` after `wait`.
pub async fn wait_info(
    broker: &Broker,
    name: &str,
    wait: Duration,
    what: &str,
    check: impl Fn(&QueueInfo) -> bool,
) -> QueueInfo {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let info = broker.info(name).expect("queue info");
        if check(&info) {
            return info;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} not reached in {wait:?}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publish `bodies` one at a time at `broker`, which leads: a publish refused as "not the
/// leader" with no other leader named (a new leader whose lease is not confirmed yet; nothing
/// was written) is sent again, for `wait` at most. Returns the message ids.
pub async fn publish_all(
    broker: &Broker,
    name: &str,
    bodies: &[String],
    wait: Duration,
) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut ids = Vec::new();
    for body in bodies {
        loop {
            let mut results = broker.publish(name, vec![Message::new(body.clone())]).await;
            assert_eq!(results.len(), 1);
            match results.remove(0) {
                Ok(receipt) => {
                    ids.push(receipt.message);
                    break;
                }
                Err(BrokerError::NotLeader { leader: None, .. }) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "publish of {body:?} refused as not the leader for {wait:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(other) => panic!("publish of {body:?}: {other}"),
            }
        }
    }
    ids
}

/// A new group's first leader hands it to the preferred leader within this long (the
/// replica's hand-over watches 3 s at most); a leader agreed on for longer is kept.
const FIRST_HAND_OVER: Duration = Duration::from_secs(3);

/// The node whose broker leads partition 0 of `queue` with every node that has the queue
/// agreeing on it; waits up to `wait` for one. Every replica initializes a new group at once,
/// so the first leader may be any of them, and it hands the group to the preferred leader
/// right after: while the preferred leader is among the nodes asked, an agreed leader other
/// than it is returned only once it has held for [`FIRST_HAND_OVER`] (a group whose
/// preferred leader lost an election since keeps the one elected).
pub async fn agreed_leader(
    nodes: &std::collections::BTreeMap<u64, BrokerNode>,
    queue: &str,
    wait: Duration,
) -> u64 {
    let all: std::collections::BTreeSet<u64> = nodes.keys().copied().collect();
    agreed_leader_among(nodes, &all, queue, wait).await
}

/// [`agreed_leader`] among the nodes `ids` of `nodes` only (the others are not asked).
pub async fn agreed_leader_among(
    nodes: &std::collections::BTreeMap<u64, BrokerNode>,
    ids: &std::collections::BTreeSet<u64>,
    queue: &str,
    wait: Duration,
) -> u64 {
    let deadline = tokio::time::Instant::now() + wait;
    let mut agreed_since: Option<(u64, tokio::time::Instant)> = None;
    loop {
        let infos: std::collections::BTreeMap<u64, _> = nodes
            .iter()
            .filter(|(id, _)| ids.contains(id))
            .filter_map(|(id, node)| {
                let info = node.broker.info(queue).ok()?;
                Some((*id, info.partitions[0].clone()))
            })
            .collect();
        let leading: Vec<u64> = infos
            .iter()
            .filter(|(_, p)| p.leading)
            .map(|(id, _)| *id)
            .collect();
        let agreed = match leading[..] {
            [id] if infos.values().all(|p| p.leader == Some(id)) => Some(id),
            _ => None,
        };
        let preferred = infos
            .values()
            .find_map(|p| p.preferred_leader)
            .filter(|p| ids.contains(p));
        if let Some(id) = settled(agreed, preferred, &mut agreed_since) {
            return id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader among {ids:?} in {wait:?}: {infos:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The leader to use once `agreed` (the leader every node asked agrees on, if any) is
/// `preferred` (the group's preferred leader, when it is among the nodes asked) or has held for
/// [`FIRST_HAND_OVER`]; `since` keeps the agreed leader and when it was first seen, between
/// calls.
pub fn settled(
    agreed: Option<u64>,
    preferred: Option<u64>,
    since: &mut Option<(u64, tokio::time::Instant)>,
) -> Option<u64> {
    let now = tokio::time::Instant::now();
    let Some(id) = agreed else {
        *since = None;
        return None;
    };
    let first_seen = match *since {
        Some((held, first_seen)) if held == id => first_seen,
        _ => now,
    };
    *since = Some((id, first_seen));
    let keep = preferred.is_none_or(|p| p == id) || now - first_seen >= FIRST_HAND_OVER;
    keep.then_some(id)
}

/// Declare `queue` (id `queue_id`, one partition on nodes 1, 2 and 3, replicas 3) on every
/// broker of `nodes`, as the metadata group's applier does on each node.
pub async fn declare_everywhere(
    nodes: &std::collections::BTreeMap<u64, BrokerNode>,
    queue_id: u64,
    queue: &str,
) {
    let settings = three_replicas();
    for node in nodes.values() {
        node.broker
            .declare_replicated(queue_id, queue, settings.clone(), vec![vec![1, 2, 3]])
            .await
            .expect("declare");
    }
}

/// Settings of a queue with three replicas.
pub fn three_replicas() -> keratin_broker::QueueSettings {
    keratin_broker::QueueSettings {
        replicas: Some(3),
        ..keratin_broker::QueueSettings::default()
    }
}

/// Bytes of a [`body`].
pub const BODY_BYTES: usize = 1_000;

/// A [`BODY_BYTES`] message body starting with `prefix` and `n` (for counting what arrived).
pub fn body(prefix: &str, n: usize) -> String {
    let mut body = format!("{prefix} {n} ");
    body.extend(std::iter::repeat_n('x', BODY_BYTES - body.len()));
    body
}

/// Where a test opens one group of queue or stream 9 ("events") under `dir`: index `index`, in
/// directory `dir/name`, on nodes 1 to 3, with `size_class`, its segments from a pool of its
/// own on `io`.
pub fn place_in(
    dir: &std::path::Path,
    io: Arc<dyn keratin_log::Io>,
    index: u32,
    name: &str,
    size_class: keratin_log::SizeClass,
) -> keratin_broker::partition::log::PartitionPlace {
    let pool = keratin_log::SegmentPool::new(
        io.clone(),
        keratin_log::PoolOptions {
            full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
            budget_bytes: Some(0),
            background: false,
            commit_workers_per_filesystem: 1,
        },
    );
    pool.add_storage_dir(dir).expect("pool directory");
    keratin_broker::partition::log::PartitionPlace {
        io,
        pool,
        segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        size_class,
        queue_id: 9,
        queue: "events".into(),
        index,
        dir: dir.join(name),
        replicas: vec![1, 2, 3],
        formation: None,
    }
}
