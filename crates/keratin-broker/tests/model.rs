//! Queue semantics against a plain in-memory model, under proptest.
//!
//! Three queues: `q1` (one partition, dead-lettering to `dlq`, `max_deliveries` 2), `q2` (two
//! partitions, no dead-letter queue) and `dlq`. Random sequences of operations: publish (with
//! or without a routing key), consume a few and settle them (ack, reject with requeue, reject
//! without), hold deliveries, settle or lose a holding consumer, purge, delete and redeclare, and
//! restart (shutdown, reopen on the same directory). The model keeps, per partition, the ready
//! messages in delivery order and the inflight ones with their delivery counts.
//!
//! Checked at every delivery: it is the first ready message of its partition in the model (FIFO
//! for first deliveries, returned messages ahead of newer ones, nothing acked, dropped or purged
//! ever comes back), with the model's body, headers (the dead-letter headers included),
//! delivery count and redelivered flag. Checked after every step: each partition's ready,
//! inflight and live byte figures equal the model's (the test waits for asynchronous work such
//! as dead-lettering to land), and each partition's live state equals the state rebuilt from
//! its log. After a restart every unacknowledged message is ready again; at the end every queue
//! is drained and must hold exactly the model's messages.
//!
//! The real file system in a temporary directory, with 256 KiB segments so that logs roll,
//! reclaim and relocate. A failure prints the shrunk operation sequence; replay with the
//! printed `KERATIN_SEED`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use keratin_broker::{
    Broker, Consumer, Delivery, DeliveryTag, Message, ProducerSeq, QueueSettings,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

const QUEUES: [&str; 3] = ["q1", "q2", "dlq"];

/// Deliveries, dead-letterings and restarts over all cases: printed, so that a run that
/// exercised nothing shows.
static DELIVERIES: AtomicU64 = AtomicU64::new(0);
static DEAD_LETTERS: AtomicU64 = AtomicU64::new(0);
static RESTARTS: AtomicU64 = AtomicU64::new(0);
const DLQ: usize = 2;

fn settings(queue: usize) -> QueueSettings {
    match queue {
        0 => QueueSettings {
            partitions: 1,
            dead_letter: Some("dlq".into()),
            max_deliveries: Some(2),
            ..QueueSettings::default()
        },
        1 => QueueSettings {
            partitions: 2,
            ..QueueSettings::default()
        },
        _ => QueueSettings::default(),
    }
}

#[derive(Debug, Clone, Copy)]
enum Settle {
    Ack,
    Requeue,
    Reject,
}

#[derive(Debug, Clone)]
enum Op {
    Publish {
        queue: usize,
        count: u64,
        key: Option<u8>,
    },
    Consume {
        queue: usize,
        count: usize,
        settle: Settle,
    },
    Hold {
        queue: usize,
        count: usize,
    },
    SettleHeld {
        index: usize,
        settle: Settle,
    },
    LoseHeld {
        index: usize,
    },
    Purge {
        queue: usize,
    },
    /// Publish 48 messages of about 5 KB (most of a segment), then consume and ack everything
    /// ready: with held messages pinning old segments, this makes the log relocate.
    Flood {
        queue: usize,
    },
    Recreate {
        queue: usize,
    },
    Restart,
}

fn settle_strategy() -> impl Strategy<Value = Settle> {
    prop_oneof![
        Just(Settle::Ack),
        Just(Settle::Requeue),
        Just(Settle::Reject)
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, 1..8u64, prop::option::of(0..4u8))
            .prop_map(|(queue, count, key)| Op::Publish { queue, count, key }),
        5 => (0..3usize, 1..6usize, settle_strategy())
            .prop_map(|(queue, count, settle)| Op::Consume { queue, count, settle }),
        2 => (0..3usize, 1..5usize).prop_map(|(queue, count)| Op::Hold { queue, count }),
        2 => (any::<usize>(), settle_strategy())
            .prop_map(|(index, settle)| Op::SettleHeld { index, settle }),
        2 => any::<usize>().prop_map(|index| Op::LoseHeld { index }),
        1 => (0..3usize).prop_map(|queue| Op::Purge { queue }),
        1 => (0..3usize).prop_map(|queue| Op::Flood { queue }),
        1 => (0..3usize).prop_map(|queue| Op::Recreate { queue }),
        1 => Just(Op::Restart),
    ]
}

/// A message in the model: what a delivery must carry, and its delivery count at its last
/// return.
#[derive(Debug, Clone)]
struct Msg {
    seq: u64,
    message: Message,
    count: u32,
    /// Present at a restart: it may have been delivered before, so it comes flagged
    /// `redelivered` (its count is what the log recorded).
    restarted: bool,
}

impl Msg {
    fn payload_bytes(&self) -> u64 {
        let mut out = Vec::new();
        self.message.encode(&mut out).expect("encode");
        out.len() as u64
    }
}

#[derive(Debug, Default, Clone)]
struct Part {
    /// Ready messages by delivery order: the order of arrival in the partition (publishes and
    /// dead-lettering are sequential here, so it is also the order of message ids).
    ready: BTreeMap<u64, Msg>,
    /// Order key of the next arrival.
    arrivals: u64,
    /// Inflight messages by sequence number: order key, message, delivery count.
    inflight: BTreeMap<u64, (u64, Msg, u32)>,
}

impl Part {
    fn arrive(&mut self, msg: Msg) {
        self.ready.insert(self.arrivals, msg);
        self.arrivals += 1;
    }

    fn bytes(&self) -> u64 {
        let ready: u64 = self.ready.values().map(Msg::payload_bytes).sum();
        let inflight: u64 = self
            .inflight
            .values()
            .map(|(_, m, _)| m.payload_bytes())
            .sum();
        ready + inflight
    }
}

#[derive(Debug, Default)]
struct Model {
    parts: [Vec<Part>; 3],
    acked: BTreeSet<u64>,
    next_seq: u64,
}

impl Model {
    fn new() -> Model {
        let mut model = Model::default();
        for q in 0..3 {
            model.parts[q] = vec![Part::default(); settings(q).partitions as usize];
        }
        model
    }

    fn ready(&self, queue: usize) -> usize {
        self.parts[queue].iter().map(|p| p.ready.len()).sum()
    }

    /// A delivery came from `queue`: check it against the model and move it to inflight.
    fn delivered(&mut self, queue: usize, d: &Delivery) {
        let seq = seq_of(&d.message.body);
        assert!(!self.acked.contains(&seq), "acked message {seq} came back");
        let part = &mut self.parts[queue][d.tag.partition as usize];
        let (order, msg) = part
            .ready
            .pop_first()
            .unwrap_or_else(|| panic!("{}: delivery of {seq} with nothing ready", QUEUES[queue]));
        assert_eq!(
            msg.seq, seq,
            "{} partition {}: the first ready message comes first",
            QUEUES[queue], d.tag.partition
        );
        // A dead-letter copy carries its source partition's dead-letter mark (the model
        // knows its size, not the producer id the broker derives from the queue's id).
        let mut got = d.message.clone();
        if msg.message.producer.is_some() {
            assert!(got.producer.is_some(), "the dead-letter mark of {seq}");
            got.producer = msg.message.producer;
        }
        assert_eq!(got, msg.message, "body and headers of {seq}");
        assert_eq!(d.delivery_count, msg.count + 1, "delivery count of {seq}");
        assert_eq!(
            d.redelivered,
            msg.count > 0 || msg.restarted,
            "redelivered flag of {seq}"
        );
        part.inflight.insert(seq, (order, msg, d.delivery_count));
        DELIVERIES.fetch_add(1, Ordering::Relaxed);
    }

    /// Settle inflight `seq` of `queue` (partition `partition`) as a consumer would.
    fn settle(&mut self, queue: usize, partition: usize, seq: u64, settle: Option<Settle>) {
        let (order, mut msg, delivery_count) = self.parts[queue][partition]
            .inflight
            .remove(&seq)
            .expect("inflight in the model");
        let max = settings(queue).max_deliveries;
        let reason = match settle {
            Some(Settle::Ack) => {
                self.acked.insert(seq);
                return;
            }
            Some(Settle::Reject) => "rejected",
            // A requeue or a lost consumer: back to ready unless deliveries are exhausted.
            Some(Settle::Requeue) | None => {
                if max.is_some_and(|max| delivery_count >= max) {
                    "max_deliveries"
                } else {
                    msg.count = delivery_count;
                    self.parts[queue][partition].ready.insert(order, msg);
                    return;
                }
            }
        };
        if settings(queue).dead_letter.is_none() {
            return;
        }
        let headers = &mut msg.message.headers;
        headers.push(("x-death-reason".into(), reason.into()));
        headers.push(("x-death-queue".into(), QUEUES[queue].into()));
        headers.push(("x-death-count".into(), delivery_count.to_string()));
        msg.message.producer = Some(ProducerSeq {
            producer: 0,
            sequence: 0,
        });
        msg.count = 0;
        msg.restarted = false;
        self.parts[DLQ][0].arrive(msg);
        DEAD_LETTERS.fetch_add(1, Ordering::Relaxed);
    }

    fn restart(&mut self) {
        for part in self.parts.iter_mut().flatten() {
            for (_, (order, msg, _)) in std::mem::take(&mut part.inflight) {
                part.ready.insert(order, msg);
            }
            for msg in part.ready.values_mut() {
                msg.restarted = true;
            }
        }
    }
}

/// A consumer whose prefetch equals what it holds, so that it receives nothing more.
struct Held {
    queue: usize,
    consumer: Consumer,
    deliveries: Vec<Delivery>,
}

struct Harness {
    dir: std::path::PathBuf,
    broker: Broker,
    model: Model,
    held: Vec<Held>,
}

fn body_len(seq: u64) -> usize {
    // Mostly small, some up to 6 KB: logs roll every few dozen operations.
    16 + (seq.wrapping_mul(2_654_435_761) % 97) as usize * ((seq % 3) as usize * 30 + 1)
}

impl Harness {
    async fn open(dir: &Path) -> Broker {
        Broker::open(config(dir.to_path_buf()))
            .await
            .expect("open broker")
    }

    async fn declare(&self, queue: usize) {
        self.broker
            .declare(QUEUES[queue], settings(queue))
            .await
            .expect("declare");
    }

    async fn apply(&mut self, op: &Op) {
        match *op {
            Op::Publish { queue, count, key } => self.publish(queue, count, key, 0).await,
            Op::Flood { queue } => {
                self.publish(queue, 48, None, 5_000).await;
                let ready = self.model.ready(queue);
                if let Some(held) = self.take(queue, ready).await {
                    self.settle_held(held, Some(Settle::Ack));
                }
            }
            Op::Consume {
                queue,
                count,
                settle,
            } => {
                if let Some(held) = self.take(queue, count).await {
                    self.settle_held(held, Some(settle));
                }
            }
            Op::Hold { queue, count } => {
                if let Some(held) = self.take(queue, count).await {
                    self.held.push(held);
                }
            }
            Op::SettleHeld { index, settle } => {
                if !self.held.is_empty() {
                    let held = self.held.remove(index % self.held.len());
                    self.settle_held(held, Some(settle));
                }
            }
            Op::LoseHeld { index } => {
                if !self.held.is_empty() {
                    let held = self.held.remove(index % self.held.len());
                    self.settle_held(held, None);
                }
            }
            Op::Purge { queue } => {
                let purged = self.broker.purge(QUEUES[queue]).await.expect("purge");
                assert_eq!(purged as usize, self.model.ready(queue), "purged count");
                for part in &mut self.model.parts[queue] {
                    part.ready.clear();
                }
            }
            Op::Recreate { queue } => {
                self.broker.delete(QUEUES[queue]).await.expect("delete");
                // Consumers of a deleted queue see the end of their stream; dropping them
                // afterwards returns nothing.
                self.held.retain(|h| h.queue != queue);
                self.declare(queue).await;
                self.model.parts[queue] =
                    vec![Part::default(); settings(queue).partitions as usize];
            }
            Op::Restart => {
                self.broker.shutdown().await.expect("shutdown");
                self.held.clear();
                self.broker = Harness::open(&self.dir).await;
                self.model.restart();
                RESTARTS.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    async fn publish(&mut self, queue: usize, count: u64, key: Option<u8>, padding: usize) {
        let seqs = self.model.next_seq..self.model.next_seq + count;
        self.model.next_seq += count;
        let messages: Vec<Message> = seqs
            .clone()
            .map(|seq| Message {
                routing_key: key.map(|k| format!("k{k}")).unwrap_or_default(),
                headers: vec![("n".into(), seq.to_string())],
                body: body(seq, body_len(seq) + padding),
                producer: None,
            })
            .collect();
        let results = self.broker.publish(QUEUES[queue], messages.clone()).await;
        for ((seq, message), result) in seqs.zip(messages).zip(results) {
            let receipt = result.expect("publish");
            let part = &mut self.model.parts[queue][receipt.partition as usize];
            let msg = Msg {
                seq,
                message,
                count: 0,
                restarted: false,
            };
            part.arrive(msg);
        }
    }

    /// Subscribe with a prefetch of what will be received, and receive it.
    async fn take(&mut self, queue: usize, count: usize) -> Option<Held> {
        let count = count.min(self.model.ready(queue));
        if count == 0 {
            return None;
        }
        let mut consumer = self
            .broker
            .subscribe(QUEUES[queue], count as u32)
            .expect("subscribe");
        let mut deliveries = Vec::with_capacity(count);
        for _ in 0..count {
            let d = recv(&mut consumer).await;
            self.model.delivered(queue, &d);
            deliveries.push(d);
        }
        Some(Held {
            queue,
            consumer,
            deliveries,
        })
    }

    /// Settle everything `held` holds (`None`: lose the consumer), then drop it; both happen
    /// before any partition runs again (a current-thread runtime), so nothing more reaches it.
    fn settle_held(&mut self, held: Held, settle: Option<Settle>) {
        let tags: Vec<DeliveryTag> = held.deliveries.iter().map(|d| d.tag).collect();
        match settle {
            Some(Settle::Ack) => held.consumer.ack(&tags),
            Some(Settle::Requeue) => held.consumer.reject(&tags, true),
            Some(Settle::Reject) => held.consumer.reject(&tags, false),
            None => {}
        }
        // The broker settles in the order of the tags, and a lost consumer's messages in id
        // order; both are delivery order here (one partition dead-letters).
        for d in &held.deliveries {
            let seq = seq_of(&d.message.body);
            self.model
                .settle(held.queue, d.tag.partition as usize, seq, settle);
        }
        drop(held.consumer);
    }

    /// Wait until the broker's figures equal the model's, then compare live and rebuilt states.
    async fn check(&self, step: usize, op: &Op) {
        let matches = |broker: &Broker| {
            QUEUES.iter().enumerate().all(|(q, name)| {
                let info = broker.info(name).expect("info");
                info.partitions
                    .iter()
                    .zip(&self.model.parts[q])
                    .all(|(p, m)| {
                        (p.ready, p.inflight, p.bytes)
                            == (m.ready.len() as u64, m.inflight.len() as u64, m.bytes())
                    })
            })
        };
        if !wait_until(Duration::from_secs(2), || matches(&self.broker)).await {
            for (q, name) in QUEUES.iter().enumerate() {
                let info = self.broker.info(name).expect("info");
                for (p, m) in info.partitions.iter().zip(&self.model.parts[q]) {
                    eprintln!(
                        "{name}/{}: broker ready {} inflight {} bytes {}; model {} {} {}",
                        p.index,
                        p.ready,
                        p.inflight,
                        p.bytes,
                        m.ready.len(),
                        m.inflight.len(),
                        m.bytes()
                    );
                }
            }
            panic!("step {step} {op:?}: the broker's figures differ from the model's");
        }
        for name in QUEUES {
            for (live, rebuilt) in self.broker.check_states(name).await.expect("states") {
                assert_eq!(
                    live, rebuilt,
                    "step {step} {op:?}: {name} rebuilt from its log"
                );
            }
        }
    }

    /// Drain every queue; it must hold exactly the model's messages.
    async fn drain(&mut self) {
        self.held.clear();
        // Dropping the holders returned their messages (and may dead-letter some).
        let lost: Vec<(usize, usize, u64)> = (0..3)
            .flat_map(|q| {
                self.model.parts[q]
                    .iter()
                    .enumerate()
                    .flat_map(move |(p, part)| part.inflight.keys().map(move |&seq| (q, p, seq)))
            })
            .collect();
        for (q, p, seq) in lost {
            self.model.settle(q, p, seq, None);
        }
        self.check(usize::MAX, &Op::Restart).await;
        for queue in 0..3 {
            let count = self.model.ready(queue);
            if let Some(held) = self.take(queue, count).await {
                self.settle_held(held, Some(Settle::Ack));
            }
        }
        self.check(usize::MAX, &Op::Restart).await;
        for (q, name) in QUEUES.iter().enumerate() {
            let info = self.broker.info(name).expect("info");
            assert_eq!(
                (info.ready(), info.inflight(), info.bytes()),
                (0, 0, 0),
                "{name}"
            );
            assert_eq!(self.model.ready(q), 0);
        }
    }
}

async fn run_case(ops: Vec<Op>) {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("data");
    let broker = Harness::open(&dir).await;
    let mut h = Harness {
        dir,
        broker,
        model: Model::new(),
        held: Vec::new(),
    };
    for q in [DLQ, 0, 1] {
        h.declare(q).await;
    }
    for (step, op) in ops.iter().enumerate() {
        h.apply(op).await;
        h.check(step, op).await;
    }
    h.drain().await;
    h.broker.shutdown().await.expect("shutdown");
}

#[test]
fn queues_behave_like_the_model() {
    let seed = seed(0x6d6f_6465);
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&seed.wrapping_add(i as u64).to_le_bytes());
    }
    let config = Config {
        cases: std::env::var("KERATIN_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(96),
        failure_persistence: None,
        max_shrink_iters: 100,
        max_shrink_time: 120_000,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    let strategy = prop::collection::vec(op_strategy(), 1..60);
    let result = runner.run(&strategy, |ops| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(run_case(ops));
        Ok(())
    });
    if let Err(error) = result {
        panic!("{error} (seed {seed})");
    }
    eprintln!(
        "{} deliveries, {} dead-letterings, {} restarts",
        DELIVERIES.load(Ordering::Relaxed),
        DEAD_LETTERS.load(Ordering::Relaxed),
        RESTARTS.load(Ordering::Relaxed)
    );
}
