//! Power loss at every step of a queue workload with consumers, acks, purges and reclaim.
//!
//! `SimIo` crashes are power losses: every write, create and rename that no completed sync
//! covered may be lost or torn (see `keratin_log::io::sim`). The workload (one queue, awaited
//! step by step on a current-thread runtime): publish three confirmed batches; a consumer takes
//! them all and acks four; it is lost (the rest return); a purge removes every ready message; two
//! larger batches roll the log; a second consumer acks the first of them, so that the first
//! segment holds only settled messages and is reclaimed; it is lost; a second purge; one more
//! batch; shutdown. A reference run counts the `Io` calls; then for every call index `k` the
//! workload runs on a fresh disk that loses power right after call `k`, stopping at the first
//! error, and the broker reopens on what the disk kept. It must open, and the queue must deliver
//! exactly what the model allows:
//!
//! - **required**: every confirmed message that no ack and no purge was sent for;
//! - **forbidden**: every message whose ack was applied (the live byte count dropped) or whose
//!   purge was answered, and every message never published;
//! - messages come in publish order, once each, with their bodies intact; each partition's
//!   live state equals the state rebuilt from its log; the queue takes and delivers a new
//!   message.
//!
//! A failure names `k` and the seed; replay with `KERATIN_SEED=<seed>` or one step with
//! `KERATIN_STEP=<k>`. The test prints its call count (a few hundred calls, a few seconds in
//! the test profile).

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keratin_broker::{
    Broker, BrokerError, Consumer, Delivery, DeliveryTag, Message, QueueSettings,
};
use keratin_log::SimIo;

/// Twelve small messages take a small part of a segment; the larger ones after the first purge
/// (two batches of four) roll the 256 KiB log once.
const SMALL_BODY_BYTES: usize = 3_000;
const LARGE_BODY_BYTES: usize = 40_000;
/// How long a step may take without a crash before the test calls it a hang.
const STEP_LIMIT: Duration = Duration::from_secs(10);

fn dirs() -> Vec<PathBuf> {
    vec!["/node".into()]
}

fn body_bytes(seq: u64) -> usize {
    if (12..20).contains(&seq) {
        LARGE_BODY_BYTES
    } else {
        SMALL_BODY_BYTES
    }
}

fn message(seq: u64) -> Message {
    Message::new(body(seq, body_bytes(seq)))
}

/// What the workload achieved before it stopped.
#[derive(Debug, Default)]
struct Outcome {
    declared: bool,
    attempted: BTreeSet<u64>,
    confirmed: BTreeSet<u64>,
    /// Acks sent, and those known applied (durable).
    acked: BTreeSet<u64>,
    acked_durable: BTreeSet<u64>,
    /// Messages ready when a purge was sent, and those of purges that were answered.
    purged: BTreeSet<u64>,
    purged_durable: BTreeSet<u64>,
    /// Where the workload stopped.
    stopped: Option<String>,
}

struct Run<'a> {
    sim: &'a SimIo,
    crash_at: Option<u64>,
    out: Outcome,
}

type Step<T> = Result<T, String>;

impl Run<'_> {
    fn crashed(&self) -> bool {
        self.crash_at.is_some_and(|k| self.sim.steps() > k)
    }

    fn fail<T>(&self, what: &str, error: impl std::fmt::Display) -> Step<T> {
        assert!(
            self.crashed(),
            "{what} failed without a crash (crash_at {:?}, steps {}): {error}",
            self.crash_at,
            self.sim.steps()
        );
        Err(format!("{what}: {error}"))
    }

    async fn wait(&self, what: &str, mut condition: impl FnMut() -> bool) -> Step<()> {
        let met = wait_until(STEP_LIMIT, || self.crashed() || condition()).await;
        if self.crashed() && !condition() {
            return Err(format!("{what}: crashed"));
        }
        assert!(met, "{what}: no progress in {STEP_LIMIT:?} without a crash");
        Ok(())
    }

    /// Wait until the disk sees no call for a few milliseconds: fire-and-forget writes done.
    async fn quiet(&self) {
        let mut last = self.sim.steps();
        let mut still = 0;
        while still < 5 {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let now = self.sim.steps();
            if now == last {
                still += 1;
            } else {
                (last, still) = (now, 0);
            }
        }
    }

    async fn publish(&mut self, broker: &Broker, seqs: std::ops::Range<u64>) -> Step<()> {
        self.out.attempted.extend(seqs.clone());
        let messages: Vec<Message> = seqs.clone().map(message).collect();
        let results = broker.publish("q", messages).await;
        for (seq, result) in seqs.zip(results) {
            match result {
                Ok(_) => {
                    self.out.confirmed.insert(seq);
                }
                Err(e) => return self.fail("publish", e),
            }
        }
        Ok(())
    }

    async fn receive(&self, consumer: &mut Consumer, count: usize) -> Step<Vec<Delivery>> {
        let mut out = Vec::with_capacity(count);
        let started = Instant::now();
        while out.len() < count {
            // Short waits: after the crash nothing more comes, and the step ends at once.
            match tokio::time::timeout(Duration::from_millis(5), consumer.recv()).await {
                Ok(Some(d)) => out.push(d),
                Ok(None) => return self.fail("receive", "consumer ended"),
                Err(_) if self.crashed() => return Err("receive: crashed".into()),
                Err(_) if started.elapsed() > STEP_LIMIT => {
                    return self.fail("receive", "no delivery")
                }
                Err(_) => {}
            }
        }
        Ok(out)
    }

    fn live_bytes(broker: &Broker) -> u64 {
        broker.info("q").map_or(0, |i| i.bytes())
    }

    /// Ack `seqs` (delivered as `held`) and wait until the acks are applied, hence durable.
    async fn ack(
        &mut self,
        broker: &Broker,
        consumer: &Consumer,
        held: &[Delivery],
        seqs: &[u64],
    ) -> Step<()> {
        let chosen: Vec<&Delivery> = held
            .iter()
            .filter(|d| seqs.contains(&seq_of(&d.message.body)))
            .collect();
        let tags: Vec<DeliveryTag> = chosen.iter().map(|d| d.tag).collect();
        let mut freed = 0;
        for d in &chosen {
            let mut encoded = Vec::new();
            d.message.encode(&mut encoded).expect("encode");
            freed += encoded.len() as u64;
        }
        let target = Self::live_bytes(broker) - freed;
        consumer.ack(&tags);
        self.out.acked.extend(seqs);
        self.wait("ack", || Self::live_bytes(broker) == target)
            .await?;
        self.out.acked_durable.extend(seqs);
        Ok(())
    }

    /// Purge the queue: every confirmed message not acked is ready at this point of the
    /// workload (its consumer was lost and the disk went quiet).
    async fn purge(&mut self, broker: &Broker) -> Step<()> {
        let ready: BTreeSet<u64> = self
            .out
            .attempted
            .difference(&self.out.acked)
            .copied()
            .filter(|s| !self.out.purged.contains(s))
            .collect();
        self.out.purged.extend(&ready);
        match broker.purge("q").await {
            Ok(count) => {
                assert_eq!(count, ready.len() as u64, "purge count (ready: {ready:?})");
                self.out.purged_durable.extend(ready);
                Ok(())
            }
            Err(e) => self.fail("purge", e),
        }
    }

    async fn run(&mut self) -> Step<()> {
        let broker = match Broker::open(config_on(Arc::new(self.sim.clone()), dirs())).await {
            Ok(broker) => broker,
            Err(e) => return self.fail("open", e),
        };
        if let Err(e) = broker.declare("q", QueueSettings::default()).await {
            return self.fail("declare", e);
        }
        self.out.declared = true;
        for b in 0..3 {
            self.publish(&broker, b * 4..(b + 1) * 4).await?;
        }
        // First consumer: everything; ack 0..4; lose it (4..12 return); purge them.
        let mut c1 = subscribe(&broker)?;
        let held = self.receive(&mut c1, 12).await?;
        self.ack(&broker, &c1, &held, &[0, 1, 2, 3]).await?;
        drop(c1);
        self.quiet().await;
        self.purge(&broker).await?;
        // Two large batches roll the log; acking the first of them leaves only settled
        // messages in the first segment: it is reclaimed.
        self.publish(&broker, 12..16).await?;
        self.publish(&broker, 16..20).await?;
        let mut c2 = subscribe(&broker)?;
        let held = self.receive(&mut c2, 8).await?;
        let order: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
        assert_eq!(order, (12..20).collect::<Vec<_>>(), "delivery order");
        let disk_before = broker.info("q").map_or(0, |i| i.disk_bytes());
        self.ack(&broker, &c2, &held, &[12, 13, 14, 15, 16, 17])
            .await?;
        self.wait("reclaim", || {
            broker.info("q").is_ok_and(|i| i.disk_bytes() < disk_before)
        })
        .await?;
        // Lose it (18 and 19 return), purge them, publish once more.
        drop(c2);
        self.quiet().await;
        self.purge(&broker).await?;
        self.publish(&broker, 20..24).await?;
        if let Err(e) = broker.shutdown().await {
            return self.fail("shutdown", e);
        }
        Ok(())
    }
}

fn subscribe(broker: &Broker) -> Step<Consumer> {
    broker.subscribe("q", 64).map_err(|e| e.to_string())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn workload(seed: u64, crash_at: Option<u64>) -> (SimIo, Outcome) {
    let sim = SimIo::new(seed);
    if let Some(k) = crash_at {
        sim.crash_after(k);
    }
    let mut run = Run {
        sim: &sim,
        crash_at,
        out: Outcome::default(),
    };
    let result = runtime().block_on(run.run());
    let mut out = run.out;
    out.stopped = result.err();
    (sim, out)
}

/// Everything ready in the queue, in delivery order, then settled.
async fn drain(broker: &Broker) -> Vec<Delivery> {
    let ready = broker.info("q").expect("info").ready();
    let mut consumer = broker
        .subscribe("q", u32::try_from(ready.max(1)).expect("small"))
        .expect("subscribe");
    let mut out = Vec::new();
    for _ in 0..ready {
        out.push(recv(&mut consumer).await);
    }
    let tags: Vec<DeliveryTag> = out.iter().map(|d| d.tag).collect();
    consumer.ack(&tags);
    let empty = wait_until(STEP_LIMIT, || {
        broker.info("q").is_ok_and(|i| i.bytes() == 0)
    })
    .await;
    assert!(empty, "acks applied");
    out
}

fn check(at: &str, disk: SimIo, out: &Outcome) {
    let ctx = format!("{at}; workload stopped: {:?}", out.stopped);
    runtime().block_on(async {
        let broker = Broker::open(config_on(Arc::new(disk), dirs()))
            .await
            .unwrap_or_else(|e| panic!("{ctx}: the broker must reopen: {e}"));
        let delivered = match broker.info("q") {
            Ok(_) => drain(&broker).await,
            Err(BrokerError::NotFound(_)) => {
                assert!(!out.declared, "{ctx}: the declared queue is gone");
                Vec::new()
            }
            Err(e) => panic!("{ctx}: {e}"),
        };
        let seqs: Vec<u64> = delivered.iter().map(|d| seq_of(&d.message.body)).collect();
        for d in &delivered {
            let seq = seq_of(&d.message.body);
            assert_eq!(
                d.message.body,
                body(seq, body_bytes(seq)),
                "{ctx}: body of {seq}"
            );
        }
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{ctx}: publish order, once each: {seqs:?}"
        );
        let got: BTreeSet<u64> = seqs.iter().copied().collect();
        let never: Vec<&u64> = got.difference(&out.attempted).collect();
        assert!(never.is_empty(), "{ctx}: {never:?} never published");
        let settled: BTreeSet<u64> = out
            .acked_durable
            .union(&out.purged_durable)
            .copied()
            .collect();
        let back: Vec<&u64> = got.intersection(&settled).collect();
        assert!(
            back.is_empty(),
            "{ctx}: acked or purged messages came back: {back:?}"
        );
        let required: BTreeSet<u64> = out
            .confirmed
            .iter()
            .copied()
            .filter(|s| !out.acked.contains(s) && !out.purged.contains(s))
            .collect();
        let lost: Vec<&u64> = required.difference(&got).collect();
        assert!(
            lost.is_empty(),
            "{ctx}: confirmed {lost:?} lost; delivered {seqs:?}"
        );
        if let Ok(states) = broker.check_states("q").await {
            for (live, rebuilt) in states {
                assert_eq!(live, rebuilt, "{ctx}: state rebuilt from the log");
            }
        }
        if broker.info("q").is_ok() {
            for result in broker.publish("q", vec![message(1_000)]).await {
                result.unwrap_or_else(|e| panic!("{ctx}: publish after recovery: {e}"));
            }
            let mut consumer = broker.subscribe("q", 1).expect("subscribe");
            let d = recv(&mut consumer).await;
            assert_eq!(
                seq_of(&d.message.body),
                1_000,
                "{ctx}: new message delivered"
            );
        }
        broker.shutdown().await.expect("shutdown");
    });
}

#[test]
fn power_loss_at_every_step_of_a_queue_workload_with_purges_and_reclaim() {
    let seed = seed(0x70_6f77_6572);
    let started = Instant::now();
    let totals: Vec<u64> = (0..2)
        .map(|_| {
            let (sim, out) = workload(seed, None);
            assert!(out.stopped.is_none(), "reference run: {:?}", out.stopped);
            assert_eq!(out.confirmed.len(), 24);
            sim.steps()
        })
        .collect();
    let total = totals.iter().copied().max().expect("runs");
    if totals.iter().any(|&t| t != total) {
        eprintln!("note: the workload's Io call count varies between runs: {totals:?}");
    }
    let steps: Vec<u64> = match std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(k) => vec![k],
        None => (0..total).collect(),
    };
    // Crash outcomes per call index (`KERATIN_CRASH_SEEDS`, default 3): each power loss tears
    // the unsynced sectors its own way.
    let variants: u64 = std::env::var("KERATIN_CRASH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let mut stops = std::collections::BTreeMap::<String, u64>::new();
    let mut runs = 0;
    for &k in &steps {
        for variant in 0..variants {
            let run_seed = seed ^ k ^ (variant << 32);
            let (sim, out) = workload(run_seed, Some(k));
            let stage = out
                .stopped
                .as_deref()
                .map_or("completed", |s| s.split(':').next().unwrap_or(s))
                .to_string();
            *stops.entry(stage).or_default() += 1;
            let at = format!(
                "power loss after call {k}, variant {variant} (replay: KERATIN_SEED={seed} \
                 KERATIN_STEP={k})"
            );
            check(&at, sim.restart(), &out);
            runs += 1;
        }
    }
    eprintln!(
        "queue workload with purges and reclaim: {total} Io calls, {runs} power losses in \
         {:.1?}; stopped at: {stops:?}",
        started.elapsed()
    );
}
