//! Calls over the single connection of a node pair: both directions share one TCP connection
//! (counted by the listener's accepts), 10,000 concurrent calls across 100 groups all get their
//! own reply, refusals carry the handler's code and message, and slow handlers give `TimedOut`.
//! Would fail if either side dialed (two accepts), if replies were matched to the wrong request,
//! or if a call could hang past its timeout.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use keratin_net::{GroupId, NetError};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_directions_share_one_connection() {
    within(20 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        let reply = t1
            .call(2, GroupId(7), 3, Bytes::from_static(b"hi"), SECOND)
            .await
            .unwrap();
        assert_eq!(&reply[..], b"2<-1:7:3:hi");
        let reply = t2
            .call(1, GroupId(8), 4, Bytes::from_static(b"yo"), SECOND)
            .await
            .unwrap();
        assert_eq!(&reply[..], b"1<-2:8:4:yo");
        for _ in 0..10 {
            t1.call(2, GroupId(1), 0, Bytes::new(), SECOND)
                .await
                .unwrap();
            t2.call(1, GroupId(1), 0, Bytes::new(), SECOND)
                .await
                .unwrap();
        }
        let (s1, s2) = (t1.stats(), t2.stats());
        assert_eq!(
            (s1.connections_dialed, s1.connections_accepted),
            (1, 0),
            "{s1:?}"
        );
        assert_eq!(
            (s2.connections_dialed, s2.connections_accepted),
            (0, 1),
            "{s2:?}"
        );
        let status = t1.peer_status(2).unwrap();
        assert!(
            status.connected && status.last_contact.is_some(),
            "{status:?}"
        );
        assert_eq!(status.connections_count, 1);
        // The first ping leaves when the connection starts; its pong gives the estimate.
        assert!(eventually(5 * SECOND, || t1.peer_status(2).unwrap().rtt.is_some()).await);
        assert!(t1.peer_status(2).unwrap().rtt.unwrap() < SECOND);
        assert!(matches!(
            t1.call(3, GroupId(1), 0, Bytes::new(), SECOND).await,
            Err(NetError::UnknownPeer { to: 3 })
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_concurrent_calls_across_a_hundred_groups() {
    within(60 * SECOND, async {
        let (t1, t2, _, _) = pair(fast_options()).await;
        let started = Instant::now();
        let mut calls = tokio::task::JoinSet::new();
        for index in 0..10_000u64 {
            let (t1, t2) = (t1.clone(), t2.clone());
            calls.spawn(async move {
                let group = GroupId(index % 100);
                let body = Bytes::from(index.to_string());
                // Half each way, all on the one connection.
                let (transport, to, me) = if index % 2 == 0 { (t1, 2, 1) } else { (t2, 1, 2) };
                let reply = transport.call(to, group, 5, body, 30 * SECOND).await.unwrap();
                assert_eq!(reply, format!("{to}<-{me}:{}:5:{index}", group.0).into_bytes());
            });
        }
        while let Some(result) = calls.join_next().await {
            result.unwrap();
        }
        let elapsed = started.elapsed();
        let (s1, s2) = (t1.stats(), t2.stats());
        println!(
            "10,000 concurrent calls in {elapsed:?}: {:.0} calls/s; node 1 wrote {} frames in {} batches",
            10_000.0 / elapsed.as_secs_f64(),
            s1.frames_written,
            s1.write_batches
        );
        assert_eq!(s1.connections_dialed + s2.connections_accepted, 2);
        assert!(s1.write_batches < s1.frames_written, "no write coalescing: {s1:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_timeouts_are_typed() {
    within(20 * SECOND, async {
        let (t1, _t2, _, _) = pair(fast_options()).await;
        match t1.call(2, GroupId(1), 99, Bytes::new(), SECOND).await {
            Err(NetError::Refused { to: 2, error }) => {
                assert_eq!(error.code, 1001);
                assert_eq!(error.message, "no room on node 2");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let started = Instant::now();
        let slow = t1.call(
            2,
            GroupId(1),
            98,
            Bytes::from_static(b"2000"),
            Duration::from_millis(100),
        );
        assert_eq!(
            slow.await,
            Err(NetError::TimedOut {
                to: 2,
                timeout_ms: 100
            })
        );
        assert!(started.elapsed() < Duration::from_millis(1000));
        // The connection is still fine after a timed-out call; its late reply is dropped.
        let reply = t1
            .call(2, GroupId(1), 98, Bytes::from_static(b"10"), SECOND)
            .await
            .unwrap();
        assert_eq!(&reply[..], b"10");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_peer_refuses_with_busy_instead_of_queueing() {
    within(20 * SECOND, async {
        let mut options = fast_options();
        options.served_in_flight_max = 4;
        let (t1, _t2, _, _) = pair(options).await;
        let mut slow = Vec::new();
        for _ in 0..4 {
            let t1 = t1.clone();
            slow.push(tokio::spawn(async move {
                t1.call(2, GroupId(1), 98, Bytes::from_static(b"500"), 5 * SECOND)
                    .await
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        match t1.call(2, GroupId(1), 0, Bytes::new(), SECOND).await {
            Err(NetError::Refused { error, .. }) => {
                assert_eq!(error.code, keratin_net::codes::BUSY)
            }
            other => panic!("expected BUSY, got {other:?}"),
        }
        for call in slow {
            call.await.unwrap().unwrap();
        }
        t1.call(2, GroupId(1), 0, Bytes::new(), SECOND)
            .await
            .unwrap();
    })
    .await;
}
