//! Measures the transport on loopback: two nodes in one process, an echo handler.
//!
//!     cargo run --release -p keratin-net --example loopback
//!
//! Prints calls/s with one call in flight (round-trip latency), calls/s with many in flight over
//! the one connection (and frames per write batch), and heartbeats per frame and per second with
//! 2,000 groups heartbeating as fast as the tick lets them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use keratin_net::{
    BoxFuture, GroupId, Handler, NodeId, RemoteError, ResolvedCluster, Transport, TransportOptions,
};
use tokio::net::TcpListener;

struct Echo;

impl Handler for Echo {
    fn call(
        &self,
        _: NodeId,
        _: GroupId,
        _: u8,
        body: Bytes,
    ) -> BoxFuture<Result<Bytes, RemoteError>> {
        Box::pin(std::future::ready(Ok(body)))
    }

    fn heartbeats(
        &self,
        _: NodeId,
        batch: Vec<(GroupId, Bytes)>,
    ) -> BoxFuture<Vec<(GroupId, Result<Bytes, RemoteError>)>> {
        Box::pin(std::future::ready(
            batch.into_iter().map(|(g, p)| (g, Ok(p))).collect(),
        ))
    }
}

const RUN: Duration = Duration::from_secs(3);
const TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (l1, l2) = (
        TcpListener::bind("127.0.0.1:0").await?,
        TcpListener::bind("127.0.0.1:0").await?,
    );
    let nodes = BTreeMap::from([(1, l1.local_addr()?), (2, l2.local_addr()?)]);
    let cluster = |id: NodeId| ResolvedCluster {
        node_id: id,
        listen: nodes[&id],
        peers: nodes
            .iter()
            .filter(|(n, _)| **n != id)
            .map(|(n, a)| (*n, *a))
            .collect(),
        name: "bench".to_string(),
    };
    let options = TransportOptions::default();
    let t1 = Transport::start_on(l1, cluster(1), options.clone(), Arc::new(Echo))?;
    let _t2 = Transport::start_on(l2, cluster(2), options, Arc::new(Echo))?;
    t1.wait_connected(2, TIMEOUT).await?;

    let body = Bytes::from(vec![0u8; 64]);
    let started = Instant::now();
    let mut count = 0u64;
    while started.elapsed() < RUN {
        t1.call(2, GroupId(1), 0, body.clone(), TIMEOUT).await?;
        count += 1;
    }
    let rate = count as f64 / started.elapsed().as_secs_f64();
    println!(
        "1 in flight, 64 B: {rate:.0} calls/s, {:.1} us per round trip",
        1e6 / rate
    );

    for in_flight in [64u64, 1024] {
        let before = t1.stats();
        let done = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut workers = tokio::task::JoinSet::new();
        for worker in 0..in_flight {
            let (t1, body, done) = (t1.clone(), body.clone(), Arc::clone(&done));
            workers.spawn(async move {
                while started.elapsed() < RUN {
                    let group = GroupId(worker % 100);
                    t1.call(2, group, 0, body.clone(), TIMEOUT)
                        .await
                        .expect("call");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while workers.join_next().await.is_some() {}
        let after = t1.stats();
        let frames = after.frames_written - before.frames_written;
        let batches = after.write_batches - before.write_batches;
        println!(
            "{in_flight} in flight over one connection, 64 B: {:.0} calls/s, {:.1} frames per write batch",
            done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(),
            frames as f64 / batches.max(1) as f64
        );
    }

    let groups = 2000u64;
    let before = t1.stats();
    let started = Instant::now();
    let mut beats = tokio::task::JoinSet::new();
    for group in 0..groups {
        let t1 = t1.clone();
        beats.spawn(async move {
            let payload = Bytes::from(vec![0u8; 32]);
            while started.elapsed() < RUN {
                t1.heartbeat(2, GroupId(group), payload.clone(), TIMEOUT)
                    .await
                    .expect("heartbeat");
            }
        });
    }
    while beats.join_next().await.is_some() {}
    let after = t1.stats();
    let sent = after.heartbeats_sent - before.heartbeats_sent;
    let frames = after.heartbeat_frames_sent - before.heartbeat_frames_sent;
    println!(
        "{groups} groups heartbeating (32 B, 10 ms tick): {:.0} heartbeats/s in {:.0} frames/s, {:.0} heartbeats per frame",
        sent as f64 / started.elapsed().as_secs_f64(),
        frames as f64 / started.elapsed().as_secs_f64(),
        sent as f64 / frames.max(1) as f64
    );
    Ok(())
}
