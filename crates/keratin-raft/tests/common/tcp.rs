//! Three nodes on 127.0.0.1 for the tests that use the real network (`keratin-net`): their
//! directories, listeners bound before any node starts (so every address is known), and the
//! pieces every such test needs.

use std::collections::BTreeMap;
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
                (*id, NodeAddr { addr })
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
