//! Node labels (protocol version 2): a label set before the peers connect reaches them after
//! the handshake, a changed label reaches them at once (well within the ping interval), the
//! ping refreshes it, a reconnected peer learns it again, and an oversize label is refused.
//! Would fail if labels went only with pings, were not sent after a handshake, or if the
//! transport accepted a label the receiver must drop.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use keratin_net::{NetError, Transport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_reach_every_peer_at_once_and_again_after_a_reconnect() {
    within(30 * SECOND, async {
        let mut options = fast_options();
        // Long enough that a label seen within it was pushed, not carried by a ping.
        options.ping_interval = Duration::from_secs(3);
        options.idle_timeout = Duration::from_secs(10);
        let (l1, l2) = (bind().await, bind().await);
        let nodes = [
            (1, l1.local_addr().expect("addr")),
            (2, l2.local_addr().expect("addr")),
        ];
        let (h1, h2) = (Echo::new(1), Echo::new(2));
        let t1 = Transport::start_on(l1, cluster(1, &nodes, "test"), options.clone(), h1.clone())
            .expect("start node 1");
        // Before any connection: sent after the handshake.
        t1.set_label(Bytes::from_static(b"first")).expect("label");
        let t2 = Transport::start_on(l2, cluster(2, &nodes, "test"), options.clone(), h2.clone())
            .expect("start node 2");
        assert!(
            eventually(SECOND, || h2.label_from(1).as_deref()
                == Some(&b"first"[..]))
            .await,
            "node 2 learns node 1's label after the handshake"
        );
        assert_eq!(h1.label_from(2), None, "node 2 has no label and sends none");

        // A change is pushed.
        let changed = Instant::now();
        t1.set_label(Bytes::from_static(b"second")).expect("label");
        assert!(
            eventually(SECOND, || h2.label_from(1).as_deref()
                == Some(&b"second"[..]))
            .await,
            "node 2 learns the change"
        );
        assert!(
            changed.elapsed() < Duration::from_secs(1),
            "pushed, not waiting for the next ping ({:?})",
            changed.elapsed()
        );

        // Pings carry it again: more copies arrive with no change.
        let count = || h2.labels.lock().expect("lock").len();
        let before = count();
        assert!(
            eventually(8 * SECOND, || count() > before).await,
            "a ping refreshes the label"
        );

        // Node 2 restarts: its new transport learns the label from the new handshake.
        t2.shutdown();
        drop(t2);
        let h2b = Echo::new(2);
        let l2b = bind_again(nodes[1].1).await;
        let _t2b = Transport::start_on(l2b, cluster(2, &nodes, "test"), options, h2b.clone())
            .expect("restart node 2");
        assert!(
            eventually(5 * SECOND, || h2b.label_from(1).as_deref()
                == Some(&b"second"[..]))
            .await,
            "the restarted node learns the label"
        );

        let oversize = Bytes::from(vec![b'x'; keratin_net::frame::LABEL_BYTES_MAX + 1]);
        assert!(matches!(
            t1.set_label(oversize),
            Err(NetError::LabelTooLarge { .. })
        ));
    })
    .await;
}
