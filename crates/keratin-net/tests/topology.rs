//! Three nodes: each pair shares exactly one connection, dialed by its lower id (node 1 dials 2
//! and 3, node 2 dials 3), and every node calls every other. Also the limits a caller meets
//! before any byte is sent: a request above the frame size limit fails at once with `TooLarge`.
//! Would fail if a pair held two connections, if a node dialed a lower id, or if an oversize
//! request reached the wire.

mod common;

use std::net::SocketAddr;

use bytes::Bytes;
use common::*;
use keratin_net::{GroupId, NetError, Transport, TransportOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_one_connection_per_pair() {
    within(20 * SECOND, async {
        let listeners = [bind().await, bind().await, bind().await];
        let nodes: Vec<(u64, SocketAddr)> = listeners
            .iter()
            .zip(1..)
            .map(|(listener, id)| (id, listener.local_addr().unwrap()))
            .collect();
        let transports: Vec<Transport> = listeners
            .into_iter()
            .zip(1..)
            .map(|(listener, id)| {
                Transport::start_on(
                    listener,
                    cluster(id, &nodes, "test"),
                    fast_options(),
                    Echo::new(id),
                )
                .unwrap()
            })
            .collect();
        for (from, transport) in (1..).zip(&transports) {
            for to in 1..=3u64 {
                if to == from {
                    continue;
                }
                transport.wait_connected(to, 5 * SECOND).await.unwrap();
                let reply = transport
                    .call(to, GroupId(to * 10), 1, Bytes::new(), SECOND)
                    .await
                    .unwrap();
                assert_eq!(reply, format!("{to}<-{from}:{}:1:", to * 10).into_bytes());
            }
        }
        let dialed_accepted: Vec<(u64, u64)> = transports
            .iter()
            .map(|t| (t.stats().connections_dialed, t.stats().connections_accepted))
            .collect();
        assert_eq!(dialed_accepted, vec![(2, 0), (1, 1), (0, 2)]);
        for transport in &transports {
            for status in transport.peers_status() {
                assert!(
                    status.connected && status.connections_count == 1,
                    "{status:?}"
                );
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_request_fails_before_the_wire() {
    within(20 * SECOND, async {
        let options = TransportOptions {
            frame_size_bytes_max: 1024,
            write_queue_bytes_max: 64 * 1024,
            ..fast_options()
        };
        let (t1, t2, _, _) = pair(options).await;
        let body = Bytes::from(vec![0u8; 1024]);
        match t1.call(2, GroupId(1), 0, body.clone(), SECOND).await {
            Err(NetError::TooLarge {
                size_bytes,
                limit_bytes: 1024,
            }) => assert_eq!(size_bytes, 1 + 17 + 1024),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(matches!(
            t1.heartbeat(2, GroupId(1), body, SECOND).await,
            Err(NetError::TooLarge { .. })
        ));
        // A request that just fits (length 1 + 17 + 1006 = 1024) whose echo does not (the reply
        // prefix "2<-1:100:0:" is 11 bytes: 1 + 8 + 11 + 1006 = 1026): the peer refuses it, and
        // the connection stays up.
        let fits = Bytes::from(vec![0u8; 1006]);
        match t1.call(2, GroupId(100), 0, fits, SECOND).await {
            Err(NetError::Refused { error, .. }) => {
                assert_eq!(error.code, keratin_net::codes::REPLY_TOO_LARGE)
            }
            other => panic!("expected REPLY_TOO_LARGE, got {other:?}"),
        }
        t1.call(2, GroupId(1), 0, Bytes::new(), SECOND)
            .await
            .unwrap();
        assert_eq!(t2.stats().protocol_errors, 0);
    })
    .await;
}
