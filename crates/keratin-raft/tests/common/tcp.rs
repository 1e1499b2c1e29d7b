//! Three nodes on 127.0.0.1 for the tests that use the real network (`keratin-net`): their
//! directories, listeners bound before any node starts (so every address is known), and the
//! pieces every such test needs.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use keratin_net::ResolvedCluster;
use keratin_raft::{GroupLogs, NodeAddr};
use tokio::net::TcpListener;

/// Nodes 1 to N: a temporary directory and a bound listener each.
pub struct Loopback {
    pub dirs: BTreeMap<u64, tempfile::TempDir>,
    pub listeners: BTreeMap<u64, TcpListener>,
    pub addrs: BTreeMap<u64, SocketAddr>,
}

pub async fn three_nodes() -> Loopback {
    nodes(3).await
}

/// Nodes 1 to `count`, each in every node's peer list.
pub async fn nodes(count: u64) -> Loopback {
    let mut loopback = Loopback {
        dirs: BTreeMap::new(),
        listeners: BTreeMap::new(),
        addrs: BTreeMap::new(),
    };
    for id in 1..=count {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        loopback
            .addrs
            .insert(id, listener.local_addr().expect("address"));
        loopback.listeners.insert(id, listener);
        loopback
            .dirs
            .insert(id, tempfile::tempdir().expect("temporary directory"));
    }
    loopback
}

impl Loopback {
    /// Node `id`'s cluster configuration.
    pub fn cluster(&self, id: u64) -> ResolvedCluster {
        ResolvedCluster {
            node_id: id,
            listen: self.addrs[&id],
            peers: self.addrs.clone(),
            name: "test".into(),
        }
    }

    /// Every node with its cluster address, as a Raft membership names them.
    pub fn members(&self) -> BTreeMap<u64, NodeAddr> {
        self.addrs
            .iter()
            .map(|(id, addr)| {
                let addr = addr.to_string();
                (*id, NodeAddr::new(addr))
            })
            .collect()
    }

    /// A listener on node `id`'s address again (a restarted node), once the stopped
    /// transport's listener has gone: it closes with the transport's tasks, a moment after
    /// the shutdown (a bind at once failed with "address in use" under load). 10 s at most.
    pub async fn rebind(&self, id: u64) -> TcpListener {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match TcpListener::bind(self.addrs[&id]).await {
                Ok(listener) => return listener,
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("rebind node {id}: {e}"),
            }
        }
    }
}

/// Close `logs` once the shut-down `Raft`'s tasks let go of them (at most 5 s).
pub async fn close_logs(what: &str, mut logs: GroupLogs) {
    for _ in 0..500 {
        match logs.try_close() {
            Ok(closed) => return closed.expect("close logs"),
            Err(again) => logs = again,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: logs still held 5 s after shutdown");
}

/// A replica of one group on a node of a [`Loopback`], with its own transport.
pub struct ReplicaNode {
    pub transport: keratin_net::Transport,
    pub groups: std::sync::Arc<keratin_raft::network::Groups>,
    pub replica: keratin_raft::replica::Replica,
}

/// Start node `id`'s replica of `group` on `listener`, its logs in `dir` (default options).
pub async fn start_replica(
    id: u64,
    group: keratin_net::GroupId,
    dir: &std::path::Path,
    listener: TcpListener,
    net: &Loopback,
) -> ReplicaNode {
    use std::sync::Arc;
    let groups = Arc::new(keratin_raft::network::Groups::new());
    let transport = keratin_net::Transport::start_on(
        listener,
        net.cluster(id),
        keratin_net::TransportOptions::default(),
        Arc::clone(&groups) as Arc<dyn keratin_net::Handler>,
    )
    .expect("transport");
    let logs = GroupLogs::open(
        Arc::new(keratin_log::RealIo::new()),
        dir,
        keratin_log::LogOptions::default(),
        None,
    )
    .expect("logs");
    let config = keratin_raft::replica::replica_config("test").expect("config");
    let replica =
        keratin_raft::replica::Replica::start(id, group, logs, config, transport.clone(), &groups)
            .await
            .expect("replica");
    ReplicaNode {
        transport,
        groups,
        replica,
    }
}

/// Start the replicas of `group` on every node of `net` and form the group with all of them,
/// as the nodes of a formation do (`Replica::form`).
pub async fn start_group(
    net: &mut Loopback,
    group: keratin_net::GroupId,
) -> BTreeMap<u64, ReplicaNode> {
    let mut nodes = BTreeMap::new();
    for (id, listener) in std::mem::take(&mut net.listeners) {
        let dir = net.dirs[&id].path().join("group");
        nodes.insert(id, start_replica(id, group, &dir, listener, net).await);
    }
    form(&nodes, net).await;
    agreed_leader(&nodes, Duration::from_secs(30)).await;
    nodes
}

/// Waits until every replica of `nodes` names the same leader (every forming replica
/// campaigns: the first leader seen may still lose to a later candidate until all heard it).
pub async fn agreed_leader(nodes: &BTreeMap<u64, ReplicaNode>, wait: Duration) -> u64 {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let mut leaders = BTreeSet::new();
        for node in nodes.values() {
            leaders.insert(node.replica.leader().await);
        }
        if let [Some(leader)] = leaders.into_iter().collect::<Vec<_>>()[..] {
            return leader;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replicas named no common leader in {wait:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every replica of `nodes` forms the group with all of them (at once, as a formation does).
pub async fn form(nodes: &BTreeMap<u64, ReplicaNode>, net: &Loopback) {
    let voters: BTreeMap<u64, String> = net
        .addrs
        .iter()
        .filter(|(id, _)| nodes.contains_key(id))
        .map(|(id, addr)| (*id, addr.to_string()))
        .collect();
    let forming = nodes.values().map(|node| node.replica.form(&voters));
    for formed in futures_util::future::join_all(forming).await {
        formed.expect("form the group");
    }
}

/// The node that leads, within `wait`.
pub async fn leader_of(nodes: &BTreeMap<u64, ReplicaNode>, wait: Duration) -> u64 {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        for (id, node) in nodes {
            if node.replica.leader().await == Some(*id) {
                return *id;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader in {wait:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stop every node and close its logs.
pub async fn stop_group(nodes: BTreeMap<u64, ReplicaNode>) {
    for (id, node) in nodes {
        node.transport.shutdown();
        let logs = node.replica.shutdown(&node.groups).await;
        close_logs(&format!("node {id}"), logs).await;
    }
}
