//! What the server's integration tests share: a node's test configuration.

#![allow(dead_code)]

use std::path::Path;

use keratin_server::config::Config;

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
