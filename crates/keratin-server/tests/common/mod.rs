//! What the server's integration tests share: a node's test configuration.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use keratin_broker::{Broker, BrokerError, Message};
use keratin_net::{ClusterConfig, PeerSpec};
use keratin_server::config::Config;
use keratin_server::Node;
use serde_json::Value;

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
    // Anyone may connect: these tests are not about logins (`access.rs` is).
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    host_disk_limits(&mut config);
    config
}

/// Cluster ports are picked from here: below Linux's ephemeral range (32768 on), so that no
/// outgoing connection (a client's, a peer's) holds a node's port as its local port when the
/// node restarts and binds it again (seen under load: "cannot listen on 127.0.0.1:35087:
/// Address already in use" when a stopped node started again). As `keratin`'s tests do.
const NODE_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A free port on 127.0.0.1 in [`NODE_PORTS`] (bound and released: another process could take
/// it meanwhile, which makes the node fail to start with a clear message).
fn free_node_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(NODE_PORTS.end - NODE_PORTS.start);
    // Another test binary of this run may hold ports too: start elsewhere than it.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = NODE_PORTS.start + u16::try_from(offset).expect("below the span");
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().expect("address");
        }
    }
    panic!("no free port in {NODE_PORTS:?}");
}

/// Cluster configurations of one node per directory in `dirs` (ids from 1, ports chosen by the
/// system on 127.0.0.1 and released for the nodes to bind), named `name`: nodes `1..=formed`
/// form the cluster (each lists them); any others list every node and join it later
/// (`[cluster] join`).
pub fn cluster_configs(dirs: &[tempfile::TempDir], formed: u64, name: &str) -> Vec<Config> {
    let peers: Vec<PeerSpec> = (1..=dirs.len() as u64)
        .map(|id| PeerSpec {
            id,
            addr: free_node_addr(),
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
                // Off: these tests stop and cut chosen leaders; `cluster_balance.rs` turns it
                // on.
                leader_balance: false,
                tls: Default::default(),
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
        .map(|config| tokio::spawn(async move { start_node(&config).await }))
        .collect();
    let mut nodes = Vec::new();
    for handle in starting {
        nodes.push(Some(handle.await.expect("task")));
    }
    nodes
}

/// Start a node of `config`, trying again for up to [`BIND_RETRY`] while one of its ports is
/// still held: a node shut down in this process may hold its listeners a moment longer, and
/// another test binary may have bound a cluster port between its choice and this start.
pub async fn start_node(config: &Config) -> Node {
    let deadline = tokio::time::Instant::now() + BIND_RETRY;
    loop {
        match Node::start(config).await {
            Ok(node) => return node,
            Err(e)
                if e.to_string().contains("in use") && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("node starts: {e}"),
        }
    }
}

/// How long [`start_node`] waits for a held port to be released.
pub const BIND_RETRY: Duration = Duration::from_secs(20);

/// How long the cluster tests wait for a change to show.
pub const WAIT: Duration = Duration::from_secs(60);

/// `method path` on an admin port with `body` (JSON, possibly empty): the status and the
/// answer's body as text.
pub fn http_text(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// `method path` on an admin port, with a JSON body if given: the status and the JSON answer.
pub fn http_body(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let (status, answer) = http_text(addr, method, path, &body);
    (status, serde_json::from_str(&answer).unwrap_or(Value::Null))
}

/// The active attention item of `kind` about `subject` at the node whose admin port is `addr`
/// (`GET /api/v1/attention`), if there is one.
pub fn active_item(addr: SocketAddr, kind: &str, subject: &str) -> Option<Value> {
    let (_, doc) = http(addr, "GET", "/api/v1/attention");
    doc["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .find(|i| i["kind"] == kind && i["subject"] == subject && i["active"] == true)
}

pub fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, Value) {
    http_body(addr, method, path, None)
}

pub fn http_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    http_body(addr, "POST", path, Some(body))
}

pub async fn until<T>(what: &str, check: impl FnMut() -> Option<T>) -> T {
    until_within(what, WAIT, check).await
}

/// `Some` from `check` (polled every 100 ms) within `wait`, or the test fails naming `what`.
pub async fn until_within<T>(
    what: &str,
    wait: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {wait:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn node(nodes: &[Option<Node>], id: u64) -> &Node {
    nodes[(id - 1) as usize].as_ref().expect("node running")
}

/// The leader every running node agrees on.
pub async fn agreed_leader(nodes: &[Option<Node>], queue: &str) -> u64 {
    let mut polls = 0;
    until("a leader the running nodes agree on", || {
        // Nodes holding a replica: one that holds none names the preferred leader.
        let leaders: Vec<Option<u64>> = nodes
            .iter()
            .flatten()
            .filter_map(|n| {
                let p = n.broker().info(queue).ok()?.partitions[0].clone();
                (!p.replicas.is_empty()).then_some(p.leader)
            })
            .collect();
        polls += 1;
        if polls % 50 == 0 {
            eprintln!("leaders seen: {leaders:?}");
        }
        let first = leaders.first().copied().flatten()?;
        leaders
            .iter()
            .all(|l| *l == Some(first))
            .then_some(first)
            .filter(|l| nodes[(*l - 1) as usize].is_some())
    })
    .await
}

pub fn body(n: usize) -> String {
    let mut body = format!("m{n} ");
    body.extend(std::iter::repeat_n('x', 2_000));
    body
}

/// Publish message `n` on whichever node leads, until confirmed or known refused for good.
/// `Err` when its outcome is unknown (the leader lost its leadership with it in flight).
pub async fn publish(nodes: &[Option<Node>], queue: &str, n: usize) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let leader = agreed_leader(nodes, queue).await;
        let broker = node(nodes, leader).broker().clone();
        let mut results = broker.publish(queue, vec![Message::new(body(n))]).await;
        match results.remove(0) {
            Ok(_) => return Ok(()),
            Err(BrokerError::NotLeader { .. }) | Err(BrokerError::Limited { .. }) => {}
            Err(error @ (BrokerError::LeadershipLost { .. } | BrokerError::TimedOut { .. })) => {
                return Err(error.to_string())
            }
            Err(other) => panic!("publish m{n}: {other}"),
        }
        assert!(tokio::time::Instant::now() < deadline, "publish m{n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Take up to `count` deliveries from `broker` (which must lead), acking each if `ack`; the
/// bodies' numbers.
pub async fn take(broker: &Broker, queue: &str, count: usize, ack: bool) -> Vec<usize> {
    let mut consumer = broker
        .subscribe(queue, 50)
        .expect("subscribe at the leader");
    let mut seen = Vec::new();
    while seen.len() < count {
        let next = tokio::time::timeout(Duration::from_secs(3), consumer.recv()).await;
        let Ok(Some(delivery)) = next else { break };
        let text = String::from_utf8_lossy(&delivery.message.body).to_string();
        let n: usize = text[1..text.find(' ').expect("numbered body")]
            .parse()
            .expect("number");
        seen.push(n);
        if ack {
            consumer.ack(&[delivery.tag]);
        }
    }
    seen
}

/// Declare `queue` with `settings` through `node`, again until the cluster takes it (its
/// metadata group elects a leader first) or [`WAIT`] runs out.
pub async fn declare(node: &Node, queue: &str, settings: &keratin_broker::QueueSettings) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while let Err(error) = node.broker().declare(queue, settings.clone()).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "declare {queue}: {error}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The nodes' logs in the test's output (filtered by `RUST_LOG`), and `count` temporary data
/// directories: how every in-process cluster test starts.
pub fn cluster_test_dirs(count: u64) -> Vec<tempfile::TempDir> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    (0..count)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect()
}
