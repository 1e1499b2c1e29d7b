//! Heartbeat coalescing: 1,000 groups' heartbeats to one peer leave in one `HeartbeatBatch`
//! frame per tick (counted by both sides), each caller gets its own group's reply, and a newer
//! heartbeat of a group replaces the waiting one. Would fail if heartbeats went one frame per
//! group, if replies were routed to the wrong group, or if a superseded caller hung.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use keratin_net::{GroupId, NetError};

const GROUPS: u64 = 1_000;

/// Polls every future until all are done, each once per pass, in order.
async fn poll_all<F: Future<Output = ()> + Unpin>(mut futures: Vec<F>) {
    let mut done = vec![false; futures.len()];
    std::future::poll_fn(|cx| {
        for (future, done) in futures.iter_mut().zip(done.iter_mut()) {
            if !*done && Pin::new(future).poll(cx).is_ready() {
                *done = true;
            }
        }
        if done.iter().all(|done| *done) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_groups_share_one_frame_per_tick() {
    within(30 * SECOND, async {
        let mut options = fast_options();
        options.heartbeat_tick = Duration::from_millis(200);
        let (t1, _t2, _h1, h2) = pair(options).await;
        for round in 1..=3u64 {
            // Every caller enqueues on its first poll, so polling them all once in one pass
            // leaves all 1,000 heartbeats before the same tick.
            let beats: Vec<_> = (0..GROUPS)
                .map(|group| {
                    let t1 = t1.clone();
                    Box::pin(async move {
                        let payload = Bytes::from(format!("{round}/{group}"));
                        let reply = t1
                            .heartbeat(2, GroupId(group), payload.clone(), 5 * SECOND)
                            .await;
                        assert_eq!(reply, Ok(payload));
                    })
                })
                .collect();
            poll_all(beats).await;
            let stats = t1.stats();
            println!(
                "round {round}: {} heartbeats in {} frames ({:.0} per frame)",
                stats.heartbeats_sent,
                stats.heartbeat_frames_sent,
                stats.heartbeats_sent as f64 / stats.heartbeat_frames_sent as f64
            );
            assert_eq!(stats.heartbeats_sent, GROUPS * round);
            // One frame per round; one more in the whole test if a tick fell inside a pass.
            assert!(stats.heartbeat_frames_sent <= round + 1, "{stats:?}");
        }
        let sizes = h2.heartbeat_sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>() as u64, 3 * GROUPS);
        assert_eq!(h2.heartbeat_batches.load(Ordering::Relaxed), sizes.len());
        assert_eq!(_t2.stats().heartbeat_frames_received as usize, sizes.len());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_heartbeat_of_a_group_replaces_the_waiting_one() {
    within(20 * SECOND, async {
        let mut options = fast_options();
        options.heartbeat_tick = Duration::from_secs(1);
        let (t1, _t2, _, _) = pair(options).await;
        // join! polls in order, and each enqueues on its first poll: "a" then "b", same tick.
        let (a, b) = tokio::join!(
            t1.heartbeat(2, GroupId(9), Bytes::from_static(b"a"), 5 * SECOND),
            t1.heartbeat(2, GroupId(9), Bytes::from_static(b"b"), 5 * SECOND),
        );
        assert_eq!(
            a,
            Err(NetError::Superseded {
                to: 2,
                group: GroupId(9)
            })
        );
        assert_eq!(b, Ok(Bytes::from_static(b"b")));
        let late = t1
            .heartbeat(2, GroupId(9), Bytes::new(), Duration::from_millis(1))
            .await;
        assert_eq!(
            late,
            Err(NetError::TimedOut {
                to: 2,
                timeout_ms: 1
            })
        );
        assert!(matches!(
            t1.heartbeat(7, GroupId(9), Bytes::new(), SECOND).await,
            Err(NetError::UnknownPeer { to: 7 })
        ));
    })
    .await;
}
