//! A peer that dies and comes back on the same address is reconnected to without help, whichever
//! side of the pair died (the dialer redials with backoff; the acceptor takes the restarted
//! dialer's new connection). Calls in between fail fast with `Unreachable` or `Closed`, never
//! hang. Would fail if the dialer gave up, if a dead connection stayed installed, or if the
//! liveness view kept saying "connected".

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use keratin_net::{GroupId, NetError, Transport};
use tokio::net::TcpListener;

fn start(listener: TcpListener, id: u64, nodes: &[(u64, SocketAddr)]) -> Transport {
    Transport::start_on(
        listener,
        cluster(id, nodes, "test"),
        fast_options(),
        Echo::new(id),
    )
    .expect("start")
}

async fn call_ok(from: &Transport, to: u64) {
    let reply = from.call(to, GroupId(1), 0, Bytes::new(), 2 * SECOND).await;
    assert!(reply.is_ok(), "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_accepting_peer_dies_and_comes_back() {
    within(30 * SECOND, async {
        let (l1, l2) = (bind().await, bind().await);
        let nodes = [(1, l1.local_addr().unwrap()), (2, l2.local_addr().unwrap())];
        let t1 = start(l1, 1, &nodes);
        let t2 = start(l2, 2, &nodes);
        t1.wait_connected(2, 5 * SECOND).await.unwrap();
        call_ok(&t1, 2).await;

        drop(t2);
        assert!(eventually(5 * SECOND, || !t1.peer_status(2).unwrap().connected).await);
        let down = t1.call(2, GroupId(1), 0, Bytes::new(), SECOND).await;
        assert!(
            matches!(down, Err(NetError::Unreachable { .. })),
            "{down:?}"
        );
        assert!(
            eventually(5 * SECOND, || t1
                .peer_status(2)
                .unwrap()
                .last_error
                .is_some())
            .await
        );

        let t2 = start(bind_again(nodes[1].1).await, 2, &nodes);
        t1.wait_connected(2, 5 * SECOND).await.unwrap();
        call_ok(&t1, 2).await;
        t2.wait_connected(1, 5 * SECOND).await.unwrap();
        call_ok(&t2, 1).await;
        let status = t1.peer_status(2).unwrap();
        assert!(
            status.connected && status.last_error.is_none(),
            "{status:?}"
        );
        assert_eq!(status.connections_count, 2);
        assert_eq!(t1.stats().connections_dialed, 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dialing_peer_dies_and_comes_back() {
    within(30 * SECOND, async {
        let (l1, l2) = (bind().await, bind().await);
        let nodes = [(1, l1.local_addr().unwrap()), (2, l2.local_addr().unwrap())];
        let t1 = start(l1, 1, &nodes);
        let t2 = start(l2, 2, &nodes);
        t2.wait_connected(1, 5 * SECOND).await.unwrap();
        call_ok(&t2, 1).await;

        // A call in flight when the peer dies ends with Closed, not a hang.
        let t2_clone = t2.clone();
        let slow = tokio::spawn(async move {
            t2_clone
                .call(1, GroupId(1), 98, Bytes::from_static(b"5000"), 10 * SECOND)
                .await
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        t1.shutdown();
        drop(t1);
        assert_eq!(slow.await.unwrap(), Err(NetError::Closed { to: 1 }));
        assert!(eventually(5 * SECOND, || !t2.peer_status(1).unwrap().connected).await);

        let t1 = start(bind_again(nodes[0].1).await, 1, &nodes);
        t2.wait_connected(1, 5 * SECOND).await.unwrap();
        call_ok(&t2, 1).await;
        call_ok(&t1, 2).await;
        assert_eq!(t2.stats().connections_accepted, 2);
        assert_eq!(t2.peer_status(1).unwrap().connections_count, 2);
    })
    .await;
}
