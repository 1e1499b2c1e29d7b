//! What the server's integration tests share: a node's test configuration.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::path::Path;

use keratin_net::{ClusterConfig, PeerSpec};
use keratin_server::config::Config;
use keratin_server::Node;

/// Tiny disk thresholds: these tests must not slow down or fail because the host's disk
/// happens to be 90% full (the defaults put soft at 10% free).
pub fn host_disk_limits(config: &mut Config) {
    let disk = &mut config.limits.disk;
    disk.soft_fraction = 0.002;
    disk.hard_fraction = 0.001;
    disk.reserve_fraction = 0.0005;
    disk.soft_floor_bytes = 256 << 20;
    disk.hard_floor_bytes = 128 << 20;
    disk.reserve_floor_bytes = 64 << 20;
}

/// A node storing in `dir/data` with 1 MiB segments, on ports chosen by the system on
/// 127.0.0.1, with [`host_disk_limits`].
pub fn node_config(dir: &Path) -> Config {
    let mut config = Config::default();
    config.storage.dirs = vec![dir.join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    host_disk_limits(&mut config);
    config
}

/// Cluster configurations of one node per directory in `dirs` (ids from 1, ports chosen by the
/// system on 127.0.0.1 and released for the nodes to bind), named `name`: nodes `1..=formed`
/// form the cluster (each lists them); any others list every node and join it later
/// (`[cluster] join`).
pub fn cluster_configs(dirs: &[tempfile::TempDir], formed: u64, name: &str) -> Vec<Config> {
    let peers: Vec<PeerSpec> = (1..=dirs.len() as u64)
        .map(|id| {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr: SocketAddr = listener.local_addr().expect("addr");
            PeerSpec { id, addr }
        })
        .collect();
    (1..=dirs.len() as u64)
        .zip(dirs)
        .map(|(id, dir)| {
            let mut config = node_config(dir.path());
            let join = id > formed;
            config.cluster = Some(ClusterConfig {
                node_id: id,
                listen: join.then_some(peers[(id - 1) as usize].addr),
                peers: if join {
                    peers.clone()
                } else {
                    peers[..formed as usize].to_vec()
                },
                name: name.into(),
                join,
            });
            config
        })
        .collect()
}

/// Start a node of each configuration, all at once (a cluster's nodes wait for each other).
pub async fn start_all(configs: &[Config]) -> Vec<Option<Node>> {
    let starting: Vec<_> = configs
        .iter()
        .cloned()
        .map(|config| tokio::spawn(async move { Node::start(&config).await }))
        .collect();
    let mut nodes = Vec::new();
    for handle in starting {
        nodes.push(Some(handle.await.expect("task").expect("node starts")));
    }
    nodes
}
