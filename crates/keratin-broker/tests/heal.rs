//! A partition whose log stops on a write error (the file system filled up under it) answers
//! 503-class errors, keeps serving consumers, and heals itself once the gate says the file
//! system has room again — with no restart and no confirmed message lost. Runs on the simulated
//! disk with a space limit, so the failing roll is deterministic. A failure means a stopped
//! partition never recovered, recovered with a confirmed message missing, or took a write while
//! stopped.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keratin_broker::{Broker, BrokerError, GateDecision, Message, PublishGate, QueueSettings};
use keratin_log::SimIo;

/// A gate that admits every publish and lets logs heal only when told to.
#[derive(Debug, Default)]
struct ScriptedGate {
    room: AtomicBool,
}

impl PublishGate for ScriptedGate {
    fn publish(&self, _device: u64, _batch_bytes: u64) -> GateDecision {
        GateDecision::Admit
    }

    fn may_heal(&self, _device: u64) -> bool {
        self.room.load(Ordering::Relaxed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_partition_heals_itself_when_space_returns() {
    let sim = SimIo::new(seed(5));
    let gate = Arc::new(ScriptedGate::default());
    let mut config = config_on(Arc::new(sim.clone()), vec![PathBuf::from("/node")]);
    config.gate = gate.clone();
    let broker = Broker::open(config).await.expect("open");
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    // Room for what is there and less than a segment: the log stops once a message's
    // allocation (with the room for a settle record it keeps behind it) no longer fits.
    sim.set_space_limit(Some(sim.used_bytes() + 192 * 1024));
    let mut confirmed = Vec::new();
    let mut failure = None;
    for seq in 0..10_000u64 {
        let result = broker
            .publish("q", vec![Message::new(body(seq, 2000))])
            .await
            .remove(0);
        match result {
            Ok(_) => confirmed.push(seq),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let failure = failure.expect("the full disk stops the log");
    assert!(
        matches!(
            failure,
            BrokerError::OutcomeUnknown { .. } | BrokerError::Unavailable { .. }
        ),
        "{failure}"
    );
    assert!(broker.info("q").expect("info").partitions[0].stops >= 1);
    // While the disk is full: publishes are refused, consumers are served. The log may have
    // healed already (its tail keeps room for a settle record, so a heal is allowed at
    // reserve); the publish, as large as the one that failed, then stops it again, its
    // allocation failing before any write.
    let refused = broker
        .publish("q", vec![Message::new(body(99_999, 2000))])
        .await
        .remove(0);
    assert!(
        matches!(
            refused,
            Err(BrokerError::Unavailable { .. } | BrokerError::OutcomeUnknown { .. })
        ),
        "{refused:?}"
    );
    let mut consumer = broker.subscribe("q", 10).expect("subscribe");
    let first = recv(&mut consumer).await;
    assert_eq!(seq_of(&first.message.body), confirmed[0]);
    consumer.reject(&[first.tag], true);
    drop(consumer);
    // Space returns: the owner heals the log by itself.
    sim.set_space_limit(None);
    gate.room.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(10);
    let healed_seq = 1_000_000;
    loop {
        let result = broker
            .publish("q", vec![Message::new(body(healed_seq, 100))])
            .await
            .remove(0);
        if result.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "never healed: {result:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!broker.info("q").expect("info").partitions[0].stopped);
    let mut consumer = broker.subscribe("q", 1000).expect("subscribe");
    let mut seen = Vec::new();
    while seen.len() < confirmed.len() + 1 {
        let d = recv(&mut consumer).await;
        seen.push(seq_of(&d.message.body));
        consumer.ack(&[d.tag]);
    }
    let mut expected = confirmed.clone();
    expected.push(healed_seq);
    assert_eq!(
        seen, expected,
        "every confirmed message, in order, then the new one"
    );
    for (live, rebuilt) in broker.check_states("q").await.expect("states") {
        assert_eq!(live, rebuilt);
    }
    broker.shutdown().await.expect("shutdown");
}

/// A log whose heal keeps failing (the disk refuses every call) retries once per heal
/// interval, not in a loop. Found by the crash sweep: the heal ran as a job whose answer woke
/// the owner, which started the next heal at once, so a dead disk spun a core and filled the
/// blocking pool with heal jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_that_keeps_failing_waits_between_attempts() {
    let sim = SimIo::new(seed(7));
    let broker = Broker::open(config_on(
        Arc::new(sim.clone()),
        vec![PathBuf::from("/node")],
    ))
    .await
    .expect("open");
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    publish_seq(&broker, "q", 0..4, 100).await;
    sim.crash_now();
    let failed = broker
        .publish("q", vec![Message::new(body(4, 100))])
        .await
        .remove(0);
    assert!(failed.is_err(), "a publish on a dead disk: {failed:?}");
    assert!(broker.info("q").expect("info").partitions[0].stopped);
    // Each heal attempt makes a few refused calls; over 2 s at one attempt per 500 ms that is
    // a handful of attempts. A loop makes thousands.
    let before = sim.steps();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls = sim.steps() - before;
    assert!(
        calls <= 60,
        "{calls} Io calls in 2 s on a dead disk: the heal retries without a pause"
    );
    assert!(broker.info("q").expect("info").partitions[0].stopped);
}
