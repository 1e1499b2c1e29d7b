//! The node metadata log heals after a write error, like a partition's log: one failed write
//! on it must not block declare, delete, queue settings and node settings until a restart. And
//! deleting a queue works at every disk level, reserve included: it frees space, so it never
//! waits for space to come back. Runs on the simulated disk with a scripted gate. A failure
//! means a metadata operation stayed refused after its log could have healed, or a delete was
//! refused at reserve.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keratin_broker::{Broker, BrokerError, GateDecision, PublishGate, QueueSettings};
use keratin_log::{SimFault, SimIo};

/// A gate that admits every publish while the disk has room, and says the disk is at reserve
/// (no publish, no heal) when told to.
#[derive(Debug, Default)]
struct ReserveGate {
    at_reserve: AtomicBool,
}

impl PublishGate for ReserveGate {
    fn publish(&self, _device: u64, _batch_bytes: u64) -> GateDecision {
        if self.at_reserve.load(Ordering::Relaxed) {
            GateDecision::Reject {
                reason: "disk".into(),
                retry_after_ms: 1000,
                message: "disk at reserve".into(),
            }
        } else {
            GateDecision::Admit
        }
    }

    fn may_heal(&self, _device: u64) -> bool {
        !self.at_reserve.load(Ordering::Relaxed)
    }
}

async fn open_on(sim: &SimIo, gate: Arc<ReserveGate>) -> Broker {
    let mut config = config_on(Arc::new(sim.clone()), vec![PathBuf::from("/node")]);
    config.gate = gate;
    Broker::open(config).await.expect("open")
}

fn overrides(value: u64) -> BTreeMap<String, serde_json::Value> {
    BTreeMap::from([("limits.sample_interval_ms".to_string(), value.into())])
}

/// Make the next write of the metadata log fail with EIO: once the disk has been quiet for a
/// while (a confirmed publish's log can still be finishing its round), the broker is idle, so
/// the next `Io` call is the metadata commit worker's write of the node settings record.
async fn fail_one_metadata_write(sim: &SimIo, broker: &Broker) -> BrokerError {
    let mut last = sim.steps();
    let mut still = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while still < 10 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = sim.steps();
        (last, still) = if now == last {
            (last, still + 1)
        } else {
            (now, 0)
        };
    }
    sim.fail_at(sim.steps(), SimFault::Eio);
    broker
        .set_node_settings(overrides(1))
        .await
        .expect_err("the injected EIO fails the metadata write")
}

/// Retry `op` until it succeeds or `limit` passes; the last error on timeout.
async fn eventually<T, F, Fut>(limit: Duration, mut op: F) -> Result<T, BrokerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BrokerError>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_operations_work_again_after_a_failed_metadata_write() {
    let sim = SimIo::new(seed(12));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    broker
        .declare("keep", QueueSettings::default())
        .await
        .expect("declare");
    broker
        .declare("doomed", QueueSettings::default())
        .await
        .expect("declare");
    let error = fail_one_metadata_write(&sim, &broker).await;
    eprintln!("injected: {error}");
    let stopped = broker.metadata_log();
    assert!(stopped.stopped && stopped.stops == 1, "{stopped:?}");
    // Like a partition's log, it heals by itself once the gate allows, with no write waiting.
    assert!(
        wait_until(Duration::from_secs(3), || {
            let log = broker.metadata_log();
            !log.stopped && log.heals == 1
        })
        .await,
        "the metadata log never healed by itself: {:?}",
        broker.metadata_log()
    );
    // Nothing is wrong with the disk any more: each kind of metadata write must work again.
    let limit = Duration::from_secs(3);
    eventually(limit, || broker.declare("fresh", QueueSettings::default()))
        .await
        .expect("declare after a failed metadata write");
    eventually(limit, || broker.delete("doomed"))
        .await
        .expect("delete after a failed metadata write");
    eventually(limit, || broker.set_node_settings(overrides(2)))
        .await
        .expect("node settings after a failed metadata write");
    let settings = QueueSettings {
        max_messages: Some(10),
        ..QueueSettings::default()
    };
    eventually(limit, || {
        broker.set_queue_settings("keep", settings.clone())
    })
    .await
    .expect("queue settings after a failed metadata write");
    broker.shutdown().await.expect("shutdown");
    // What the healed log took is durable: a restart reads it back.
    let broker = open_on(&sim, gate).await;
    let names: Vec<String> = broker.list().into_iter().map(|q| q.name).collect();
    assert_eq!(names, ["fresh", "keep"]);
    assert_eq!(broker.info("keep").expect("keep").settings, settings);
    assert_eq!(
        broker.node_settings().await.expect("node settings"),
        overrides(2)
    );
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_heals_only_when_the_gate_allows_but_delete_works_at_reserve() {
    let sim = SimIo::new(seed(13));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    broker
        .declare("doomed", QueueSettings::default())
        .await
        .expect("declare");
    publish_seq(&broker, "doomed", 0..50, 1000).await;
    gate.at_reserve.store(true, Ordering::Relaxed);
    fail_one_metadata_write(&sim, &broker).await;
    // At reserve a declare (which grows the node) waits for room; deleting never does.
    let refused = broker.declare("fresh", QueueSettings::default()).await;
    assert!(
        refused.is_err(),
        "declare at reserve on a stopped metadata log"
    );
    broker
        .delete("doomed")
        .await
        .expect("delete at reserve after a failed metadata write");
    assert!(broker.list().is_empty());
    gate.at_reserve.store(false, Ordering::Relaxed);
    broker
        .declare("fresh", QueueSettings::default())
        .await
        .expect("declare once the disk has room");
    broker.shutdown().await.expect("shutdown");
    let broker = open_on(&sim, gate).await;
    let names: Vec<String> = broker.list().into_iter().map(|q| q.name).collect();
    assert_eq!(names, ["fresh"]);
    broker.shutdown().await.expect("shutdown");
}
