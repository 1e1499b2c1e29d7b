//! Shared helpers of the integration tests: nodes on 127.0.0.1 ephemeral ports, an echo handler,
//! and a deadline so a hung test fails instead of hanging CI.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keratin_net::{
    BoxFuture, GroupId, Handler, NodeId, RemoteError, ResolvedCluster, Transport, TransportOptions,
};
use tokio::net::TcpListener;

pub const SECOND: Duration = Duration::from_secs(1);

/// Replies `node:group:kind:` followed by the body; kind 99 refuses with code 1001, kind 98
/// sleeps for the number of milliseconds in the body first. Heartbeats are echoed per group.
pub struct Echo {
    pub node: NodeId,
    pub heartbeat_batches: AtomicUsize,
    pub heartbeat_sizes: std::sync::Mutex<Vec<usize>>,
    /// Every label received, in order, with the sender.
    pub labels: std::sync::Mutex<Vec<(NodeId, Bytes)>>,
}

impl Echo {
    pub fn new(node: NodeId) -> Arc<Echo> {
        Arc::new(Echo {
            node,
            heartbeat_batches: AtomicUsize::new(0),
            heartbeat_sizes: std::sync::Mutex::new(Vec::new()),
            labels: std::sync::Mutex::new(Vec::new()),
        })
    }
}

impl Handler for Echo {
    fn call(
        &self,
        from: NodeId,
        group: GroupId,
        kind: u8,
        body: Bytes,
    ) -> BoxFuture<Result<Bytes, RemoteError>> {
        let node = self.node;
        Box::pin(async move {
            match kind {
                99 => Err(RemoteError::new(1001, format!("no room on node {node}"))),
                98 => {
                    let ms: u64 = std::str::from_utf8(&body)
                        .ok()
                        .and_then(|t| t.parse().ok())
                        .expect("kind 98 body is a number of ms");
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(body)
                }
                _ => {
                    let mut reply = format!("{node}<-{from}:{group}:{kind}:").into_bytes();
                    reply.extend_from_slice(&body);
                    Ok(Bytes::from(reply))
                }
            }
        })
    }

    fn heartbeats(
        &self,
        _from: NodeId,
        batch: Vec<(GroupId, Bytes)>,
    ) -> BoxFuture<Vec<(GroupId, Result<Bytes, RemoteError>)>> {
        self.heartbeat_batches.fetch_add(1, Ordering::Relaxed);
        self.heartbeat_sizes.lock().expect("lock").push(batch.len());
        Box::pin(std::future::ready(
            batch.into_iter().map(|(g, p)| (g, Ok(p))).collect(),
        ))
    }

    fn label(&self, from: NodeId, label: Bytes) {
        self.labels.lock().expect("lock").push((from, label));
    }
}

impl Echo {
    /// The newest label received from `from`.
    pub fn label_from(&self, from: NodeId) -> Option<Bytes> {
        let labels = self.labels.lock().expect("lock");
        labels
            .iter()
            .rev()
            .find(|(id, _)| *id == from)
            .map(|(_, l)| l.clone())
    }
}

pub async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0")
}

/// Binds `addr` again once the transport that held it let go (within 2 s).
pub async fn bind_again(addr: SocketAddr) -> TcpListener {
    for _ in 0..200 {
        if let Ok(listener) = TcpListener::bind(addr).await {
            return listener;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("could not bind {addr} again");
}

pub fn cluster(node_id: NodeId, nodes: &[(NodeId, SocketAddr)], name: &str) -> ResolvedCluster {
    let peers: BTreeMap<NodeId, SocketAddr> = nodes.iter().copied().collect();
    ResolvedCluster {
        node_id,
        listen: peers[&node_id],
        peers: peers.into_iter().filter(|(id, _)| *id != node_id).collect(),
        name: name.to_string(),
    }
}

pub fn fast_options() -> TransportOptions {
    TransportOptions {
        reconnect_backoff_min: Duration::from_millis(10),
        reconnect_backoff_max: Duration::from_millis(200),
        ..TransportOptions::default()
    }
}

/// Two connected nodes, 1 and 2, with echo handlers.
pub async fn pair(options: TransportOptions) -> (Transport, Transport, Arc<Echo>, Arc<Echo>) {
    let (l1, l2) = (bind().await, bind().await);
    let nodes = [
        (1, l1.local_addr().expect("addr")),
        (2, l2.local_addr().expect("addr")),
    ];
    let (h1, h2) = (Echo::new(1), Echo::new(2));
    let t1 = Transport::start_on(l1, cluster(1, &nodes, "test"), options.clone(), h1.clone())
        .expect("start node 1");
    let t2 = Transport::start_on(l2, cluster(2, &nodes, "test"), options, h2.clone())
        .expect("start node 2");
    t1.wait_connected(2, 5 * SECOND)
        .await
        .expect("1 connects to 2");
    t2.wait_connected(1, 5 * SECOND).await.expect("2 sees 1");
    (t1, t2, h1, h2)
}

/// Runs `test` with a deadline.
pub async fn within<T>(limit: Duration, test: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, test)
        .await
        .expect("test exceeded its deadline")
}

/// Polls `condition` every 10 ms until true or `limit` passes.
pub async fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    condition()
}
