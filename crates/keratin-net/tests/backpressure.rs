//! Bounded memory when a peer stops reading: a raw peer completes the handshake and never reads
//! again. 200 calls of 1 MiB each would queue 200 MiB if buffering were unbounded; here the
//! write queue stays within `write_queue_bytes_max` (4 MiB) and every caller gets `TimedOut`
//! within its timeout. Would fail if the queue grew past its bound or a caller waited past its
//! timeout.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use keratin_net::handshake::{Hello, HelloReply, PROTOCOL_VERSION};
use keratin_net::{GroupId, NetError, Transport, TransportOptions};
use tokio::io::AsyncWriteExt;

const QUEUE_BYTES_MAX: usize = 4 * 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_costs_bounded_memory() {
    within(30 * SECOND, async {
        let (l1, raw) = (bind().await, bind().await);
        let nodes = [
            (1, l1.local_addr().unwrap()),
            (2, raw.local_addr().unwrap()),
        ];
        let options = TransportOptions {
            frame_size_bytes_max: 2 * 1024 * 1024,
            write_queue_bytes_max: QUEUE_BYTES_MAX,
            idle_timeout: Duration::from_secs(60),
            ..fast_options()
        };
        let t1 =
            Transport::start_on(l1, cluster(1, &nodes, "test"), options, Echo::new(1)).unwrap();
        // Node 2 is this raw socket: it accepts node 1's hello and then never reads.
        let (mut stream, _) = raw.accept().await.unwrap();
        let hello = Hello::read(&mut stream).await.unwrap();
        assert_eq!((hello.from, hello.to), (1, 2));
        let reply = HelloReply {
            version: PROTOCOL_VERSION,
            node_id: 2,
            outcome: Ok(()),
        };
        stream.write_all(&reply.encode()).await.unwrap();
        t1.wait_connected(2, 5 * SECOND).await.unwrap();

        let queue_bytes_seen_max = Arc::new(AtomicUsize::new(0));
        let sampler = {
            let (t1, seen) = (t1.clone(), Arc::clone(&queue_bytes_seen_max));
            tokio::spawn(async move {
                loop {
                    let queued = t1.peer_status(2).unwrap().write_queue_bytes;
                    seen.fetch_max(queued, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        let body = Bytes::from(vec![7u8; 1024 * 1024]);
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let mut calls = tokio::task::JoinSet::new();
        for group in 0..200 {
            let (t1, body) = (t1.clone(), body.clone());
            calls.spawn(async move { t1.call(2, GroupId(group), 0, body, timeout).await });
        }
        while let Some(result) = calls.join_next().await {
            assert_eq!(
                result.unwrap(),
                Err(NetError::TimedOut {
                    to: 2,
                    timeout_ms: 300
                })
            );
        }
        let elapsed = started.elapsed();
        assert!(
            elapsed < Duration::from_secs(3),
            "callers waited {elapsed:?}"
        );
        sampler.abort();
        let seen = queue_bytes_seen_max.load(Ordering::Relaxed);
        let now = t1.peer_status(2).unwrap().write_queue_bytes;
        println!("write queue peaked at {seen} bytes (bound {QUEUE_BYTES_MAX}); {now} now");
        assert!(
            seen <= QUEUE_BYTES_MAX && now <= QUEUE_BYTES_MAX,
            "{seen} {now}"
        );
        assert!(seen > 0);
        // Heartbeats to the stuck peer fail fast or time out; they do not queue without bound.
        let beat = t1
            .heartbeat(2, GroupId(1), Bytes::new(), Duration::from_millis(200))
            .await;
        assert!(
            matches!(
                beat,
                Err(NetError::Backlogged { .. } | NetError::TimedOut { .. })
            ),
            "{beat:?}"
        );
        // When the stuck peer goes away, its queued frames are dropped and uncounted.
        drop(stream);
        assert!(
            eventually(5 * SECOND, || t1.peer_status(2).unwrap().write_queue_bytes
                == 0)
            .await
        );
    })
    .await;
}
