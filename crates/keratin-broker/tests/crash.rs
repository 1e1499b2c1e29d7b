//! Crash at every step of a small queue workload on the simulated disk.
//!
//! The workload (one partition per queue, awaited step by step on a current-thread runtime):
//! open a broker, declare `dlq` and `q` (dead-lettering to `dlq`), publish three confirmed
//! batches, consume them, ack some, reject one without requeue (to `dlq`), lose the consumer
//! (its messages return), publish a batch that rolls the log, consume again, ack enough to free
//! the first segment (prefix removal), reject two with requeue, publish once more, consume and
//! ack everything left so that the idle partition hands its segments back to the pool
//! (`idle_release_after` is 20 ms here), publish once more into the handed-back log, shut down.
//! A reference run counts its `Io` calls; then for every call index `k` the workload runs on a
//! fresh `SimIo` that loses power right after call `k`, stopping at the first error, and the
//! broker is reopened on what the disk kept. It must open, and:
//!
//! - every confirmed message that was not acknowledged (or dead-lettered) is delivered again, in
//!   its original order, with its body intact; no message that was never published appears;
//! - an ack is *durable* once the state shows it applied (the owner applies records only after
//!   the sync that covers them; the test waits for the live byte count to drop) or once
//!   `shutdown()` returned; a durable ack never comes back, an ack that was only sent may;
//! - a message dead-lettered durably is in `dlq` and not in `q`; one whose dead-lettering was
//!   under way is in one of them (at least once);
//! - each partition's live state equals the state rebuilt from its log, and the reopened queue
//!   takes and delivers a new message.
//!
//! Acks are fire-and-forget in this API, so each step waits for what it started to become
//! durable (or for the crash) before the next one: that keeps the sequence of `Io` calls a
//! function of the workload. Group commit may still merge two appends issued back to back
//! (a consumer's loss and the next publish), so the test also waits for the disk to go quiet
//! there; and the checks hold whatever the interleaving. The reference run is repeated to see
//! whether the call count is stable, and prints it.
//!
//! A second workload sweeps the same way over `drop_oldest` (`q` keeps at most four messages
//! and dead-letters the oldest to make room): publishes that drop, an ack, publishes that drop
//! again past a segment roll, a drain, shut down. After a crash anywhere: the reopened `q`
//! trims itself to its bound before delivering (a crash between a publish and the drops it
//! owed leaves it over), every confirmed message not acknowledged is in `q` or in `dlq`
//! (dropped; at least once: a drop whose copy reached `dlq` but whose settle did not is
//! dropped again, so `dlq` may hold it twice), `q` holds at most four and in order, and its
//! state equals the one rebuilt from its log.
//!
//! A failure names `k` and the seed; replay with `KERATIN_SEED=<seed>` or one step with
//! `KERATIN_STEP=<k>`.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keratin_broker::{
    Broker, BrokerError, Consumer, Delivery, DeliveryTag, Message, Overflow, QueueSettings,
};
use keratin_log::SimIo;

/// Bodies large enough that twelve messages fill most of a 256 KiB segment and the fourth batch
/// rolls the log.
const BODY_BYTES: usize = 21_000;
/// Messages per published batch.
const BATCH: u64 = 4;
/// How long a step may take without a crash before the test calls it a hang.
const STEP_LIMIT: Duration = Duration::from_secs(10);
/// The workload's idle time before a partition that holds nothing hands its log back.
const IDLE: Duration = Duration::from_millis(20);
/// `q`'s bound in the `drop_oldest` workload.
const DROP_OLDEST_MAX: u64 = 4;

/// Which workload a run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    /// Acks, dead-lettering, returns, prefix removal and hand-back (the module docs).
    Queue,
    /// `q` bounded with `drop_oldest`, dropping into `dlq`.
    DropOldest,
}

fn dirs() -> Vec<PathBuf> {
    vec!["/node".into()]
}

fn message(seq: u64) -> Message {
    Message::new(body(seq, BODY_BYTES))
}

/// Payload bytes of a message as the queue counts them.
fn payload_bytes(m: &Message) -> u64 {
    let mut out = Vec::new();
    m.encode(&mut out).expect("encode");
    out.len() as u64
}

/// What the workload achieved before it stopped: what must and what may survive.
#[derive(Debug, Default)]
struct Outcome {
    declared: BTreeSet<&'static str>,
    /// Publishes that were sent (their messages may survive).
    attempted: BTreeSet<u64>,
    /// Publishes that were confirmed (their messages must survive unless settled).
    confirmed: BTreeSet<u64>,
    /// Acks that were sent.
    acked: BTreeSet<u64>,
    /// Acks known to be durable.
    acked_durable: BTreeSet<u64>,
    /// Messages rejected without requeue (to `dlq`), and those known to be settled in `q`.
    dead: BTreeSet<u64>,
    dead_durable: BTreeSet<u64>,
    /// `q` drops its oldest messages into `dlq` to make room (any published message may be
    /// in `dlq`).
    drops: bool,
    /// Where and why the workload stopped.
    stopped: Option<String>,
}

/// One run of the workload on `sim`; `crash_at` is the call after which the disk loses power.
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

    /// An error is expected only after the crash; before it, it is a bug.
    fn fail<T>(&self, what: &str, error: impl std::fmt::Display) -> Step<T> {
        assert!(
            self.crashed(),
            "{what} failed without a crash (crash_at {:?}, steps {}): {error}",
            self.crash_at,
            self.sim.steps()
        );
        Err(format!("{what}: {error}"))
    }

    /// Wait until `condition` holds; stop (crash) or panic (hang).
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
            // After a crash no delivery may come: look at the crash every 100 ms, not only
            // after STEP_LIMIT.
            match tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await {
                Ok(Some(d)) => out.push(d),
                Ok(None) => return self.fail("receive", "the consumer ended"),
                Err(_) if self.crashed() || started.elapsed() >= STEP_LIMIT => {
                    return self.fail("receive", "no delivery");
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
        let freed: u64 = chosen.iter().map(|d| payload_bytes(&d.message)).sum();
        let target = Self::live_bytes(broker) - freed;
        consumer.ack(&tags);
        self.out.acked.extend(seqs);
        self.wait("ack", || Self::live_bytes(broker) == target)
            .await?;
        self.out.acked_durable.extend(seqs);
        Ok(())
    }

    /// The `drop_oldest` workload (module docs).
    async fn run_drop_oldest(&mut self) -> Step<()> {
        let mut config = config_on(Arc::new(self.sim.clone()), dirs());
        config.idle_release_after = IDLE;
        let broker = match Broker::open(config).await {
            Ok(broker) => broker,
            Err(e) => return self.fail("open", e),
        };
        let bounded = QueueSettings {
            dead_letter: Some("dlq".into()),
            max_messages: Some(DROP_OLDEST_MAX),
            overflow: Some(Overflow::DropOldest),
            ..QueueSettings::default()
        };
        self.out.drops = true;
        for (name, settings) in [("dlq", QueueSettings::default()), ("q", bounded)] {
            if let Err(e) = broker.declare(name, settings).await {
                return self.fail("declare", e);
            }
            self.out.declared.insert(name);
        }
        // 0..4 fill it; 4..6 and 6..8 drop 0..4.
        for range in [0..4, 4..6, 6..8] {
            self.publish(&broker, range).await?;
        }
        // The dropped messages' dead-lettering settles before the acks are counted by bytes.
        self.quiet().await;
        let mut c1 = subscribe(&broker, 2)?;
        let held = self.receive(&mut c1, 2).await?;
        let seqs: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
        assert_eq!(seqs, vec![4, 5], "the oldest kept first");
        self.ack(&broker, &c1, &held, &seqs).await?;
        drop(c1);
        self.quiet().await;
        // 6, 7 and these: the log rolls, and 6..10 go to make room.
        for range in [8..10, 10..12, 12..14] {
            self.publish(&broker, range).await?;
        }
        self.quiet().await;
        let left = broker.info("q").map_or(0, |i| i.ready());
        if left > DROP_OLDEST_MAX {
            return self.fail("bound", format!("{left} ready over the bound"));
        }
        let mut c2 = subscribe(&broker, 64)?;
        let held = self.receive(&mut c2, left as usize).await?;
        let seqs: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
        assert_eq!(seqs, (10..14).collect::<Vec<_>>(), "the newest kept");
        self.ack(&broker, &c2, &held, &seqs).await?;
        if let Err(e) = broker.shutdown().await {
            return self.fail("shutdown", e);
        }
        let acked = self.out.acked.clone();
        self.out.acked_durable.extend(acked);
        Ok(())
    }

    async fn run(&mut self) -> Step<()> {
        let sim = self.sim;
        let mut config = config_on(Arc::new(sim.clone()), dirs());
        config.idle_release_after = IDLE;
        let broker = match Broker::open(config).await {
            Ok(broker) => broker,
            Err(e) => return self.fail("open", e),
        };
        let with_dl = QueueSettings {
            dead_letter: Some("dlq".into()),
            ..QueueSettings::default()
        };
        for (name, settings) in [("dlq", QueueSettings::default()), ("q", with_dl)] {
            if let Err(e) = broker.declare(name, settings).await {
                return self.fail("declare", e);
            }
            self.out.declared.insert(name);
        }
        for b in 0..3 {
            self.publish(&broker, b * BATCH..(b + 1) * BATCH).await?;
        }

        // First consumer: everything, ack 0..3 in two steps, dead-letter 3, then lose it.
        let mut c1 = subscribe(&broker, 64)?;
        let held = self.receive(&mut c1, 12).await?;
        self.ack(&broker, &c1, &held, &[0, 1, 2]).await?;
        let before = Self::live_bytes(&broker);
        let three = held
            .iter()
            .find(|d| seq_of(&d.message.body) == 3)
            .ok_or("3")?;
        let three_bytes = payload_bytes(&three.message);
        c1.reject(&[three.tag], false);
        self.out.dead.insert(3);
        self.wait("dead-letter", || {
            Self::live_bytes(&broker) == before - three_bytes
        })
        .await?;
        self.out.dead_durable.insert(3);
        drop(c1);
        self.quiet().await;
        self.publish(&broker, 12..16).await?;

        // Second consumer: the returned 4..12 first, then 12..16; free the first segment.
        let mut c2 = subscribe(&broker, 64)?;
        let held = self.receive(&mut c2, 12).await?;
        let order: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
        assert_eq!(order, (4..16).collect::<Vec<_>>(), "returned ones first");
        let acks: Vec<u64> = (4..12).chain([13, 14]).collect();
        self.ack(&broker, &c2, &held, &acks).await?;
        let one_segment = || broker.info("q").is_ok_and(|i| i.disk_bytes() <= SEGMENT);
        self.wait("prefix removal", one_segment).await?;
        let requeue: Vec<DeliveryTag> = held
            .iter()
            .filter(|d| [12, 15].contains(&seq_of(&d.message.body)))
            .map(|d| d.tag)
            .collect();
        // Reject and drop together: nothing is redelivered to c2 in between.
        c2.reject(&requeue, true);
        drop(c2);
        self.quiet().await;
        self.publish(&broker, 16..18).await?;

        // Third consumer: everything left, all acked. The partition then holds nothing and
        // hands its segments back; it stays attached and gets the last publish.
        let left = broker.info("q").map_or(0, |i| i.ready());
        let mut c3 = subscribe(&broker, 64)?;
        let held = self.receive(&mut c3, left as usize).await?;
        let seqs: Vec<u64> = held.iter().map(|d| seq_of(&d.message.body)).collect();
        self.ack(&broker, &c3, &held, &seqs).await?;
        self.wait("hand-back", || {
            broker.info("q").is_ok_and(|i| i.disk_bytes() == 0)
        })
        .await?;
        self.publish(&broker, 18..20).await?;
        self.receive(&mut c3, 2).await?;
        if let Err(e) = broker.shutdown().await {
            return self.fail("shutdown", e);
        }
        let acked = self.out.acked.clone();
        self.out.acked_durable.extend(acked);
        Ok(())
    }
}

fn subscribe(broker: &Broker, prefetch: u32) -> Step<Consumer> {
    broker.subscribe("q", prefetch).map_err(|e| e.to_string())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Run `which` on a fresh disk; returns the disk and what happened.
fn workload(which: Workload, seed: u64, crash_at: Option<u64>) -> (SimIo, Outcome) {
    let sim = SimIo::new(seed);
    if let Some(k) = crash_at {
        sim.crash_after(k);
    }
    let mut run = Run {
        sim: &sim,
        crash_at,
        out: Outcome::default(),
    };
    // The runtime goes with the broker's tasks (and their logs) before the disk restarts.
    let result = runtime().block_on(async {
        match which {
            Workload::Queue => run.run().await,
            Workload::DropOldest => run.run_drop_oldest().await,
        }
    });
    let mut out = run.out;
    out.stopped = result.err();
    (sim, out)
}

/// Everything ready in `queue`, in delivery order.
async fn drain(broker: &Broker, queue: &str) -> Vec<Delivery> {
    let ready = broker.info(queue).expect("info").ready();
    let mut consumer = broker
        .subscribe(queue, u32::try_from(ready.max(1)).expect("small"))
        .expect("subscribe");
    let mut out = Vec::new();
    for _ in 0..ready {
        out.push(recv(&mut consumer).await);
    }
    let info = broker.info(queue).expect("info");
    assert_eq!(
        (info.ready(), info.inflight()),
        (0, ready),
        "{queue}: all delivered"
    );
    // Settle them, so that what is published next is delivered next.
    let tags: Vec<DeliveryTag> = out.iter().map(|d| d.tag).collect();
    consumer.ack(&tags);
    let empty = wait_until(STEP_LIMIT, || {
        broker.info(queue).is_ok_and(|i| i.bytes() == 0)
    })
    .await;
    assert!(empty, "{queue}: acks applied");
    out
}

/// Reopen the disk the crash left and check it against the outcome.
fn check(k: u64, seed: u64, disk: SimIo, out: &Outcome) {
    let ctx = format!("k={k} seed={seed} ({:?})", out.stopped);
    runtime().block_on(async {
        let broker = Broker::open(config_on(Arc::new(disk), dirs()))
            .await
            .unwrap_or_else(|e| panic!("{ctx}: the broker must reopen: {e}"));
        for name in &out.declared {
            assert!(broker.info(name).is_ok(), "{ctx}: declared {name} is gone");
        }
        if out.drops && broker.info("q").is_ok() {
            // A crash between a publish and the drops it owed leaves `q` over its bound: it
            // trims before delivering, and the trimmed messages reach `dlq` before they leave.
            let bound = DROP_OLDEST_MAX * payload_bytes(&message(0));
            let trimmed = wait_until(STEP_LIMIT, || {
                broker.info("q").is_ok_and(|i| i.bytes() <= bound)
            })
            .await;
            assert!(
                trimmed,
                "{ctx}: q not trimmed to its bound after reopening: {:?}",
                broker
                    .info("q")
                    .map(|i| (i.ready(), i.inflight(), i.bytes()))
            );
        }
        let q: Vec<Delivery> = match broker.info("q") {
            Ok(_) => drain(&broker, "q").await,
            Err(BrokerError::NotFound(_)) => Vec::new(),
            Err(e) => panic!("{ctx}: {e}"),
        };
        let seqs: Vec<u64> = q.iter().map(|d| seq_of(&d.message.body)).collect();
        for d in &q {
            let seq = seq_of(&d.message.body);
            assert_eq!(
                d.message.body,
                body(seq, BODY_BYTES),
                "{ctx}: body of {seq}"
            );
        }
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{ctx}: original order, no duplicate: {seqs:?}"
        );
        let got: BTreeSet<u64> = seqs.iter().copied().collect();
        assert!(
            got.is_subset(&out.attempted),
            "{ctx}: {got:?} never published"
        );
        let gone: BTreeSet<u64> = out
            .acked_durable
            .union(&out.dead_durable)
            .copied()
            .collect();
        assert!(
            got.is_disjoint(&gone),
            "{ctx}: settled messages came back: {got:?}"
        );
        let dead: Vec<Delivery> = match broker.info("dlq") {
            Ok(_) => drain(&broker, "dlq").await,
            Err(_) => Vec::new(),
        };
        let dead_seqs: BTreeSet<u64> = dead.iter().map(|d| seq_of(&d.message.body)).collect();
        if out.drops {
            // Dead-lettering is at least once: a crash after the copy in `dlq` is durable and
            // before the original's settle leaves it in `q`, over the bound, and the reopened
            // partition drops it again. Once per crash, so twice at most here.
            for seq in &dead_seqs {
                let copies = dead
                    .iter()
                    .filter(|d| seq_of(&d.message.body) == *seq)
                    .count();
                assert!(copies <= 2, "{ctx}: {seq} in dlq {copies} times");
            }
        } else {
            assert_eq!(dead_seqs.len(), dead.len(), "{ctx}: dlq duplicates");
        }
        let may_be_dead = if out.drops { &out.attempted } else { &out.dead };
        assert!(
            dead_seqs.is_subset(may_be_dead),
            "{ctx}: dlq holds {dead_seqs:?}"
        );
        if out.drops {
            assert!(
                got.len() as u64 <= DROP_OLDEST_MAX,
                "{ctx}: q holds {seqs:?}, over its bound"
            );
        }
        assert!(
            out.dead_durable.is_subset(&dead_seqs),
            "{ctx}: dead-lettered lost"
        );
        for seq in &out.confirmed {
            let settled = out.acked.contains(seq) || out.dead.contains(seq);
            if !settled {
                let dropped = out.drops && dead_seqs.contains(seq);
                assert!(
                    got.contains(seq) || dropped,
                    "{ctx}: confirmed {seq} lost; got {seqs:?}, dlq {dead_seqs:?}"
                );
            }
            if out.dead.contains(seq) {
                assert!(
                    got.contains(seq) || dead_seqs.contains(seq),
                    "{ctx}: {seq} in neither q nor dlq"
                );
            }
        }
        for name in ["q", "dlq"] {
            if let Ok(states) = broker.check_states(name).await {
                for (live, rebuilt) in states {
                    assert_eq!(live, rebuilt, "{ctx}: {name} state rebuilt from the log");
                }
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
fn crash_at_every_step_of_a_queue_workload() {
    sweep(Workload::Queue, 20);
}

#[test]
fn crash_at_every_step_of_a_drop_oldest_workload() {
    sweep(Workload::DropOldest, 14);
}

/// Crash after every `Io` call of `which`, whose reference run confirms `confirmed`
/// messages, and check each.
fn sweep(which: Workload, confirmed: usize) {
    let seed = seed(0x6b72_6173);
    let started = Instant::now();
    // The reference: no crash. Run it a few times to see whether its call count is stable.
    let totals: Vec<u64> = (0..3)
        .map(|_| {
            let (sim, out) = workload(which, seed, None);
            assert!(out.stopped.is_none(), "reference run: {:?}", out.stopped);
            assert_eq!(out.confirmed.len(), confirmed);
            sim.steps()
        })
        .collect();
    let total = totals.iter().copied().max().expect("runs");
    if totals.iter().any(|&t| t != total) {
        eprintln!("note: the workload's Io call count varies between runs: {totals:?}");
    }
    let only: Option<u64> = std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok());
    let steps: Vec<u64> = match only {
        Some(k) => vec![k],
        None => (0..total).collect(),
    };
    let mut stops = std::collections::BTreeMap::<String, u64>::new();
    for &k in &steps {
        let step_started = Instant::now();
        let (sim, out) = workload(which, seed, Some(k));
        let stage = out
            .stopped
            .as_deref()
            .map_or("completed", |s| s.split(':').next().unwrap_or(s))
            .to_string();
        *stops.entry(stage).or_default() += 1;
        check(k, seed, sim.restart(), &out);
        if step_started.elapsed() > Duration::from_secs(2) {
            eprintln!(
                "slow crash point k={k} ({:?}): {:.1?}",
                out.stopped,
                step_started.elapsed()
            );
        }
    }
    eprintln!(
        "{which:?}: {} crash points over {totals:?} Io calls in {:.1?}; stopped at: {stops:?}",
        steps.len(),
        started.elapsed()
    );
}
