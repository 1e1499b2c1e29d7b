//! Peers that change at run time (`Transport::add_peer`, `remove_peer`, `peer_addr`): a node
//! added on both sides connects (the lower id dials, whichever side adds first; the other side's
//! refusals in between are retried), a removed node's waiting calls fail at once with
//! `Unreachable` and later ones fail fast, its dialer stops and its inbound connections are
//! refused, and a node that comes back on another port is dialed there. Would fail if a removed
//! peer's call waited for its timeout, if a removed peer reconnected, if `peers_status` kept
//! listing it, or if a changed address kept the old connection.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use keratin_net::{GroupId, NetError, NodeId, Transport};
use tokio::net::TcpListener;

/// A transport that knows only `known` (besides itself).
async fn start_knowing(id: NodeId, known: &[(NodeId, SocketAddr)]) -> (Transport, SocketAddr) {
    let listener = bind().await;
    let addr = listener.local_addr().expect("local address");
    (start_on(listener, id, known), addr)
}

fn start_on(listener: TcpListener, id: NodeId, known: &[(NodeId, SocketAddr)]) -> Transport {
    let mut nodes = vec![(id, listener.local_addr().expect("local address"))];
    nodes.extend_from_slice(known);
    Transport::start_on(
        listener,
        cluster(id, &nodes, "test"),
        fast_options(),
        Echo::new(id),
    )
    .expect("start a transport")
}

async fn round_trip(from: &Transport, to: NodeId) {
    let reply = from
        .call(to, GroupId(7), 1, Bytes::from_static(b"x"), 2 * SECOND)
        .await
        .expect("a round trip");
    assert_eq!(
        reply,
        format!("{to}<-{}:7:1:x", from.node_id()).into_bytes()
    );
}

/// Node 2 runs alone; `new` (1 or 3) starts alone too. Calls fail fast until both sides add the
/// other; the dialing side (the lower id) adds first so that its first dials are refused.
async fn join(new: NodeId) {
    let (existing, existing_addr) = start_knowing(2, &[]).await;
    let (joining, joining_addr) = start_knowing(new, &[]).await;
    let started = Instant::now();
    assert!(matches!(
        existing
            .call(new, GroupId(1), 0, Bytes::new(), 5 * SECOND)
            .await,
        Err(NetError::UnknownPeer { .. })
    ));
    assert!(matches!(
        joining
            .call(2, GroupId(1), 0, Bytes::new(), 5 * SECOND)
            .await,
        Err(NetError::UnknownPeer { .. })
    ));
    assert!(started.elapsed() < SECOND);

    let (dialer, dialer_peer, dialer_peer_addr, acceptor, acceptor_peer, acceptor_peer_addr) =
        if new < 2 {
            (&joining, 2, existing_addr, &existing, new, joining_addr)
        } else {
            (&existing, new, joining_addr, &joining, 2, existing_addr)
        };
    dialer
        .add_peer(dialer_peer, dialer_peer_addr)
        .expect("add the acceptor");
    assert_eq!(dialer.peer_addr(dialer_peer), Some(dialer_peer_addr));
    // The acceptor does not know the dialer yet: it refuses, the dialer retries.
    assert!(eventually(5 * SECOND, || acceptor.stats().handshakes_refused >= 1).await);
    let down = dialer
        .call(dialer_peer, GroupId(1), 0, Bytes::new(), 5 * SECOND)
        .await;
    assert!(
        matches!(down, Err(NetError::Unreachable { .. })),
        "{down:?}"
    );

    acceptor
        .add_peer(acceptor_peer, acceptor_peer_addr)
        .expect("add the dialer");
    dialer
        .wait_connected(dialer_peer, 5 * SECOND)
        .await
        .expect("the dialer connects");
    acceptor
        .wait_connected(acceptor_peer, 5 * SECOND)
        .await
        .expect("the acceptor sees the dialer");
    round_trip(&existing, new).await;
    round_trip(&joining, 2).await;
    assert_eq!(dialer.stats().connections_dialed, 1);
    assert_eq!(acceptor.stats().connections_dialed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_node_with_a_lower_id_joins() {
    within(20 * SECOND, join(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_node_with_a_higher_id_joins() {
    within(20 * SECOND, join(3)).await;
}

/// `remover` removes `removed` while its call to it sleeps in the handler for 10 s.
async fn remove_during_a_slow_call(remover: &Transport, removed: &Transport) {
    let removed_id = removed.node_id();
    let caller = remover.clone();
    let slow = tokio::spawn(async move {
        let started = Instant::now();
        let result = caller
            .call(
                removed_id,
                GroupId(1),
                98,
                Bytes::from_static(b"10000"),
                20 * SECOND,
            )
            .await;
        (result, started.elapsed())
    });
    // Let the request reach the handler.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(remover.remove_peer(removed_id));
    let (result, elapsed) = slow.await.expect("the calling task");
    assert!(
        matches!(result, Err(NetError::Unreachable { to, .. }) if to == removed_id),
        "{result:?}"
    );
    assert!(elapsed < 2 * SECOND, "the call waited {elapsed:?}");

    let started = Instant::now();
    let later = remover
        .call(removed_id, GroupId(1), 0, Bytes::new(), 5 * SECOND)
        .await;
    assert!(later.is_err(), "{later:?}");
    let heartbeat = remover
        .heartbeat(removed_id, GroupId(1), Bytes::new(), 5 * SECOND)
        .await;
    assert!(heartbeat.is_err(), "{heartbeat:?}");
    assert!(started.elapsed() < SECOND);
    assert!(remover.peers_status().is_empty());
    assert_eq!(remover.peer_status(removed_id), None);
    assert_eq!(remover.peer_addr(removed_id), None);
    assert!(!remover.remove_peer(removed_id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dialing_side_removes_its_peer() {
    within(20 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        remove_during_a_slow_call(&t1, &t2).await;
        // Node 1's dialer stopped: node 2 accepts no new connection, and stays disconnected.
        assert!(eventually(5 * SECOND, || !t2.peer_status(1).unwrap().connected).await);
        let accepted = t2.stats().connections_accepted;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(t2.stats().connections_accepted, accepted);
        assert!(!t2.peer_status(1).unwrap().connected);
        assert_eq!(t1.stats().connections_dialed, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_accepting_side_removes_its_peer() {
    within(20 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        remove_during_a_slow_call(&t2, &t1).await;
        // Node 1 still knows node 2 and keeps dialing; node 2 refuses it like any unknown node.
        let refused = t2.stats().handshakes_refused;
        assert!(
            eventually(5 * SECOND, || t2.stats().handshakes_refused >= refused + 2).await,
            "node 1 stopped dialing"
        );
        for _ in 0..5 {
            assert!(!t1.peer_status(2).unwrap().connected);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let error = t1.peer_status(2).unwrap().last_error.unwrap_or_default();
        assert!(error.contains("is not among the peers"), "{error}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_waiting_for_the_tick_fails_when_its_peer_is_removed() {
    within(20 * SECOND, async {
        // A long tick: once a first heartbeat is answered (a tick just passed), the next one
        // waits about 3 s for its tick, so only the removal can answer it within 2 s.
        let options = keratin_net::TransportOptions {
            heartbeat_tick: 3 * SECOND,
            ..fast_options()
        };
        let (t1, _t2, _, _) = pair(options).await;
        t1.heartbeat(2, GroupId(1), Bytes::new(), 8 * SECOND)
            .await
            .unwrap();
        let caller = t1.clone();
        let waiting = tokio::spawn(async move {
            let started = Instant::now();
            let result = caller
                .heartbeat(2, GroupId(1), Bytes::from_static(b"hb"), 10 * SECOND)
                .await;
            (result, started.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(t1.remove_peer(2));
        let (result, elapsed) = waiting.await.unwrap();
        assert!(
            matches!(result, Err(NetError::Unreachable { to: 2, .. })),
            "{result:?} after {elapsed:?}"
        );
        assert!(elapsed < 2 * SECOND, "the heartbeat waited {elapsed:?}");
        let later = t1.heartbeat(2, GroupId(1), Bytes::new(), SECOND).await;
        assert!(
            matches!(later, Err(NetError::UnknownPeer { to: 2 })),
            "{later:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_back_on_another_port_is_dialed_there() {
    within(20 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        let t1_addr = t1.local_addr();
        let old_addr = t2.local_addr();
        assert_eq!(t1.peer_addr(2), Some(old_addr));
        drop(t2);
        let (t2, new_addr) = start_knowing(2, &[(1, t1_addr)]).await;
        assert_ne!(new_addr, old_addr);

        t1.add_peer(2, new_addr).unwrap();
        assert_eq!(t1.peer_addr(2), Some(new_addr));
        t1.wait_connected(2, 5 * SECOND).await.unwrap();
        t2.wait_connected(1, 5 * SECOND).await.unwrap();
        round_trip(&t1, 2).await;
        round_trip(&t2, 1).await;
        let status = t1.peer_status(2).unwrap();
        assert_eq!(status.addr, new_addr);
        assert!(status.connected);
        assert_eq!(t1.peers_status().len(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_address_drops_the_live_connection() {
    within(20 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        let t1_addr = t1.local_addr();
        // A third transport also claiming to be node 2, on another port: node 1 must drop the
        // connection to the old one and dial the new one.
        let (t2b, new_addr) = start_knowing(2, &[(1, t1_addr)]).await;
        t1.add_peer(2, new_addr).unwrap();
        assert!(eventually(5 * SECOND, || !t2.peer_status(1).unwrap().connected).await);
        t2b.wait_connected(1, 5 * SECOND).await.unwrap();
        round_trip(&t2b, 1).await;
        round_trip(&t1, 2).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_itself_is_refused_and_repeats_are_no_ops() {
    within(20 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        let own = t1.add_peer(1, t1.local_addr());
        assert!(matches!(own, Err(NetError::SelfPeer { id: 1 })), "{own:?}");
        assert!(own.unwrap_err().to_string().contains("node 1"));
        assert!(!t1.remove_peer(42));
        assert_eq!(t1.peer_addr(42), None);

        // The same peer at the same address again: nothing changes, the connection stays.
        t1.add_peer(2, t2.local_addr()).unwrap();
        t2.add_peer(1, t1.local_addr()).unwrap();
        round_trip(&t1, 2).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(t1.stats().connections_dialed, 1);
        assert_eq!(t1.peer_status(2).unwrap().connections_count, 1);
        assert_eq!(t1.peers_status().len(), 1);
    })
    .await;
}
