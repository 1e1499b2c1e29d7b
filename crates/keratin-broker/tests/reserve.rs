//! A partition whose log stopped at the reserve disk level (an outside fill took the space a
//! roll needed) can still free its own space: a purge works and frees the log's segments, acks
//! become durable once the reserve holds what they need, and the queue can be deleted. Runs on
//! the simulated disk with a space limit (so the failing roll is deterministic) and a gate held
//! at reserve. A failure means a stopped partition refused the very operations that free space,
//! or an operation answered `Ok` that a restart does not show.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use keratin_broker::{Broker, GateDecision, Message, PublishGate, QueueSettings};
use keratin_log::{Io, SimIo};

/// A gate whose disk is at reserve (no heal by level) until told otherwise, with `free` bytes.
/// It admits every publish: what is under test is what a stopped log can still do, and the
/// refusal of publishes at reserve is the gate's own business (tested in `keratin-limits`).
#[derive(Debug)]
struct ReserveGate {
    at_reserve: AtomicBool,
    free: AtomicU64,
}

impl Default for ReserveGate {
    fn default() -> Self {
        ReserveGate {
            at_reserve: AtomicBool::new(true),
            free: AtomicU64::new(0),
        }
    }
}

impl PublishGate for ReserveGate {
    fn publish(&self, _device: u64, _batch_bytes: u64) -> GateDecision {
        GateDecision::Admit
    }

    fn may_heal(&self, _device: u64) -> bool {
        !self.at_reserve.load(Ordering::Relaxed)
    }

    fn free_bytes(&self, _device: u64) -> Option<u64> {
        Some(self.free.load(Ordering::Relaxed))
    }
}

async fn open_on(sim: &SimIo, gate: Arc<ReserveGate>) -> Broker {
    let mut config = config_on(Arc::new(sim.clone()), vec![PathBuf::from("/node")]);
    config.gate = gate;
    Broker::open(config).await.expect("open")
}

/// Declare queue `q` while the disk still has room: the gate reports free space for the
/// declare (a metadata record that frees no space is refused when the disk has no room for its
/// log to grow), then none again, as the outside fill leaves it.
async fn declare_before_the_fill(broker: &Broker, gate: &ReserveGate) {
    let free = gate.free.swap(1 << 30, Ordering::Relaxed);
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    gate.free.store(free, Ordering::Relaxed);
}

/// Publish 2000-byte messages until the disk limit stops the log at a roll (the gate is at
/// reserve with no free bytes all along: an outside fill). Returns the confirmed sequence
/// numbers.
async fn fill_until_stopped(sim: &SimIo, broker: &Broker, gate: &ReserveGate) -> Vec<u64> {
    // Room for what is there and a few segments more.
    sim.set_space_limit(Some(sim.used_bytes() + 3 * SEGMENT + 64 * 1024));
    let mut confirmed = Vec::new();
    for seq in 0..100_000u64 {
        let result = broker
            .publish("q", vec![Message::new(body(seq, 2000))])
            .await
            .remove(0);
        match result {
            Ok(_) => confirmed.push(seq),
            Err(_) => break,
        }
    }
    // Stopped at least once: it may have healed since (its tail keeps room for a settle
    // record, so a heal is allowed at reserve).
    assert!(broker.info("q").expect("info").partitions[0].stops >= 1);
    assert!(confirmed.len() > 200, "{} confirmed", confirmed.len());
    assert!(gate.at_reserve.load(Ordering::Relaxed));
    confirmed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_stopped_at_reserve_can_be_purged_and_frees_its_space() {
    let sim = SimIo::new(seed(21));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    declare_before_the_fill(&broker, &gate).await;
    let confirmed = fill_until_stopped(&sim, &broker, &gate).await;
    let disk_before = broker.info("q").expect("info").disk_bytes();
    let purged = broker
        .purge("q")
        .await
        .expect("purge of a stopped partition");
    assert_eq!(purged, confirmed.len() as u64);
    let info = broker.info("q").expect("info");
    assert_eq!(info.ready(), 0);
    assert!(
        wait_until(Duration::from_secs(5), || {
            broker.info("q").expect("info").disk_bytes() <= SEGMENT
        })
        .await,
        "the purge freed no segment: {disk_before} bytes before, {} after",
        broker.info("q").expect("info").disk_bytes()
    );
    // Once the disk has room the queue takes publishes again, and nothing purged comes back.
    sim.set_space_limit(None);
    gate.at_reserve.store(false, Ordering::Relaxed);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let result = broker
            .publish("q", vec![Message::new(body(7_000_000, 100))])
            .await
            .remove(0);
        if result.is_ok() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{result:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt);
    }
    broker.shutdown().await.expect("shutdown");
    let broker = open_on(&sim, gate).await;
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    let d = recv(&mut consumer).await;
    assert_eq!(seq_of(&d.message.body), 7_000_000);
    assert_idle(&mut consumer).await;
    let info = broker.info("q").expect("info");
    assert_eq!(info.ready() + info.inflight(), 1);
    drop(consumer);
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_on_a_partition_stopped_at_reserve_are_durable_when_the_reserve_holds_a_segment() {
    let sim = SimIo::new(seed(22));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    declare_before_the_fill(&broker, &gate).await;
    let confirmed = fill_until_stopped(&sim, &broker, &gate).await;
    // Still at reserve, but the reserve holds a few segments (its usual state: the reserve is
    // the space kept for acks, purges and reclaim).
    sim.set_space_limit(Some(sim.used_bytes() + 4 * SEGMENT));
    gate.free.store(4 * SEGMENT, Ordering::Relaxed);
    ack_the_first_half_and_restart(&sim, broker, gate, &confirmed, "at reserve").await;
}

/// Acks are durable on a disk full to its last byte: every message written keeps room for the
/// largest settle record allocated behind it, so the heal (which needs no space) is allowed at
/// once and the acks are written into that room. Before, the tail segment ended wherever its
/// last preallocation step did, and the acks waited until a purge, a delete or outside
/// cleanup freed space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_on_a_disk_full_to_its_last_byte_are_durable() {
    let sim = SimIo::new(seed(23));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    declare_before_the_fill(&broker, &gate).await;
    let confirmed = fill_until_stopped(&sim, &broker, &gate).await;
    // Not one byte more: the outside fill took everything.
    sim.set_space_limit(Some(sim.used_bytes()));
    gate.free.store(0, Ordering::Relaxed);
    ack_the_first_half_and_restart(&sim, broker, gate, &confirmed, "on a full disk").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_stopped_at_reserve_can_be_deleted() {
    let sim = SimIo::new(seed(23));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    declare_before_the_fill(&broker, &gate).await;
    fill_until_stopped(&sim, &broker, &gate).await;
    let used_before = sim.used_bytes();
    broker.delete("q").await.expect("delete at reserve");
    assert!(broker.list().is_empty());
    assert!(!sim.exists(Path::new("/node/queues/1")).expect("exists"));
    // The segments went to the pool; at soft and deeper the node's sampler releases spares.
    broker.pool().release(1, 0).expect("release spares");
    assert!(
        sim.used_bytes() < used_before,
        "the delete freed nothing: {used_before} bytes before, {} after",
        sim.used_bytes()
    );
    broker.shutdown().await.expect("shutdown");
    let broker = open_on(&sim, gate).await;
    assert!(broker.list().is_empty());
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_stopped_at_reserve_with_a_delivery_out_can_be_purged() {
    let sim = SimIo::new(seed(24));
    let gate = Arc::new(ReserveGate::default());
    let broker = open_on(&sim, gate.clone()).await;
    declare_before_the_fill(&broker, &gate).await;
    let confirmed = fill_until_stopped(&sim, &broker, &gate).await;
    let mut consumer = broker.subscribe("q", 1).expect("subscribe");
    let out = recv(&mut consumer).await;
    // The delivered message stays; the purge is a PURGE record written after a heal, which
    // needs no space, into the room left in the tail segment.
    let purged = broker
        .purge("q")
        .await
        .expect("purge of a stopped partition with a delivery out");
    assert_eq!(purged, confirmed.len() as u64 - 1);
    consumer.ack(&[out.tag]);
    drop(consumer);
    assert!(
        wait_until(Duration::from_secs(5), || {
            let info = broker.info("q").expect("info");
            info.ready() + info.inflight() == 0
        })
        .await
    );
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt);
    }
    broker.shutdown().await.expect("shutdown");
    let broker = open_on(&sim, gate).await;
    assert_eq!(
        broker.info("q").expect("info").ready(),
        0,
        "after a restart"
    );
    broker.shutdown().await.expect("shutdown");
}

/// Acks the first half of `confirmed` (rejecting the rest with requeue) until the acks are
/// durable, within 10 s, then restarts the broker and checks that they survived. A settle that
/// fails on a stopped log returns the message; it comes again and is acked again.
async fn ack_the_first_half_and_restart(
    sim: &SimIo,
    broker: Broker,
    gate: Arc<ReserveGate>,
    confirmed: &[u64],
    when: &str,
) {
    let acked = confirmed.len() / 2;
    let mut consumer = broker.subscribe("q", 100).expect("subscribe");
    let mut seen = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while broker.info("q").expect("info").ready() + broker.info("q").expect("info").inflight()
        > (confirmed.len() - acked) as u64
        || seen < acked
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "acks {when} never became durable: {:?}",
            broker.info("q").expect("info")
        );
        let d = match tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await {
            Ok(Some(d)) => d,
            _ => continue,
        };
        let seq = seq_of(&d.message.body);
        if seq < acked as u64 {
            seen = seen.max(seq as usize + 1);
            consumer.ack(&[d.tag]);
        } else {
            consumer.reject(&[d.tag], true);
        }
    }
    drop(consumer);
    broker.shutdown().await.expect("shutdown");
    let broker = open_on(sim, gate).await;
    assert_eq!(
        broker.info("q").expect("info").ready(),
        (confirmed.len() - acked) as u64,
        "the acks survive a restart"
    );
    broker.shutdown().await.expect("shutdown");
}
