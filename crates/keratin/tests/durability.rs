//! Confirmed messages survive `kill -9` of the real `keratin serve` binary, round after round on
//! one data directory on the real disk (4 MiB segments, so the logs roll).
//!
//! Each of 10 rounds starts the broker, runs four confirmed publishers (64 publishes in flight
//! each, 1 KiB bodies carrying a globally unique sequence number and a CRC32C) and a consumer
//! that acks most of what it gets and holds some deliveries unsettled, then SIGKILLs the broker
//! by PID at a seeded moment while the load runs. After round 5 one extra round ends with a clean
//! SIGTERM instead. A last start drains the queue.
//!
//! It fails if a confirmed, unacknowledged message does not come back in the drain; if any
//! delivered body fails its checksum or carries a sequence number never published; if a message
//! acked before the clean stop is delivered again after it (acks are fire-and-forget, so an ack
//! made just before a kill may be lost and its message legitimately comes back once: that is
//! at-least-once, and only those duplicates are allowed); if the drain delivers one message twice;
//! if the queue's declaration is lost; or if any step overruns its deadline.
//!
//! The kill moments come from a seed printed at the start; `KERATIN_SEED=<n>` replays them (the
//! load itself still races the kill differently on every run).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use keratin_client::{
    Client, ClientError, ClientOptions, Delivery, OutgoingMessage, QueueSettings,
};
use support::{body, seq_of, Server};
use tokio::task::JoinSet;

/// Rounds that end with SIGKILL, as issue 5 asks.
const KILL_ROUNDS: u32 = 10;
/// After this kill round, one extra round ends with a clean SIGTERM.
const CLEAN_STOP_AFTER_ROUND: u32 = 5;
/// Concurrent publishers, each on its own connection.
const PUBLISHERS: usize = 4;
/// Confirmed publishes in flight per publisher.
const IN_FLIGHT: usize = 64;
/// 1 KiB bodies: 4 MiB segments roll after about 4,000 messages.
const BODY_BYTES: usize = 1024;
/// Publishes one publisher issues per round at most: 4 × 6,000 × 1 KiB is 24 MiB a round,
/// 240 MiB over the kill rounds, which the final drain reads back in well under 30 s.
const PUBLISHES_PER_ROUND_MAX: u64 = 6_000;
/// The kill comes at a seeded delay in this range, or earlier once the round's publishers
/// issued a seeded share of their budget, so the load is always still running when it lands.
const KILL_DELAY_MS_MIN: u64 = 200;
const KILL_DELAY_MS_MAX: u64 = 2_500;
/// Acks per millisecond the round's consumer makes at most (seeded in this range): well below
/// the publishers' ~30 confirms per ms, so that a backlog of confirmed, unacknowledged messages
/// builds up over the rounds, while acks are still flowing when the kill lands.
const ACKS_PER_MS_MIN: u64 = 2;
const ACKS_PER_MS_MAX: u64 = 12;
/// Acks the round's consumer makes at most.
const ACKS_PER_ROUND_MAX: u64 = 12_000;
/// Deliveries the consumer holds unsettled per round; they return to ready when the broker
/// dies or the consumer goes, and must come back like any unacknowledged message.
const HELD_PER_ROUND_MAX: usize = 32;
/// Prefetch of the round consumer: room for the held deliveries and a window of acks.
const ROUND_PREFETCH: u32 = 256;
/// Prefetch of the final drain.
const DRAIN_PREFETCH: u32 = 1_000;
/// How long one round may take from start to kill, publishers' wind-down included.
const ROUND_DEADLINE: Duration = Duration::from_secs(15);
/// How long the whole drain may take.
const DRAIN_DEADLINE: Duration = Duration::from_secs(40);
/// Silence after which the drain counts as complete once everything expected arrived.
const DRAIN_IDLE: Duration = Duration::from_millis(1_500);
/// A publish that takes longer than this is counted as outcome unknown.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

const QUEUE: &str = "durable";

fn queue_settings() -> QueueSettings {
    QueueSettings {
        partitions: 2,
        dead_letter: Some("durable-dlq".into()),
        max_deliveries: None,
        ..QueueSettings::default()
    }
}

/// splitmix64: a tiny, seedable generator; the test needs no more.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

fn seed() -> u64 {
    match std::env::var("KERATIN_SEED") {
        Ok(text) => text.trim().parse().expect("KERATIN_SEED is a u64"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    }
}

/// Everything the test knows about every sequence number.
#[derive(Debug, Default)]
struct Ledger {
    /// Publishes that returned `Ok`: durable, the broker promised.
    confirmed: BTreeSet<u64>,
    /// Seqs whose last delivery was acked (`ack()` returned), with the round and moment of that
    /// ack. A seq delivered again and held instead leaves this map: the broker owes it again.
    acked: BTreeMap<u64, (u32, Instant)>,
    /// When each kill round's SIGKILL was sent, by round.
    killed_at: BTreeMap<u32, Instant>,
    /// The longest time between an ack and the kill that lost it.
    lost_ack_age_max: Duration,
    /// Snapshot of `acked` taken once the clean stop finished: none of these may come back.
    settled_before_clean_stop: BTreeSet<u64>,
    /// Publishes that failed, by error kind.
    failed: BTreeMap<String, u64>,
    /// Deliveries during the rounds, and how many of them were marked redelivered.
    deliveries: u64,
    redelivered: u64,
    /// Deliveries of seqs already acked in an earlier kill round (lost acks; allowed).
    acked_then_delivered: u64,
    /// Everything that breaks a promise; asserted empty at the end.
    violations: Vec<String>,
}

fn lock(ledger: &Mutex<Ledger>) -> MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What every task of the test shares.
#[derive(Clone)]
struct Shared {
    ledger: Arc<Mutex<Ledger>>,
    /// The next sequence number to publish; unique across rounds and publishers.
    next_seq: Arc<AtomicU64>,
    seed: u64,
}

async fn connect(addr: SocketAddr, name: &str) -> Client {
    Client::connect(
        addr,
        ClientOptions {
            name: name.into(),
            publish_timeout: PUBLISH_TIMEOUT,
            ..ClientOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{name}: connect: {e}"))
}

fn error_kind(error: &ClientError) -> String {
    if let Some(key) = error.code_key() {
        return key;
    }
    match error {
        ClientError::OutcomeUnknown { .. } => "outcome-unknown".into(),
        ClientError::ConnectionLost { .. } => "connection-lost".into(),
        ClientError::Io { .. } => "io".into(),
        other => format!("other: {other}"),
    }
}

/// One publisher: keeps `IN_FLIGHT` confirmed publishes going until `stop`, its budget, or the
/// connection's end. Returns how many it issued.
async fn publisher(client: Client, shared: Shared, stop: Arc<AtomicBool>, issued: Arc<AtomicU64>) {
    let mut tasks = JoinSet::new();
    let mut count = 0u64;
    loop {
        while tasks.len() < IN_FLIGHT
            && count < PUBLISHES_PER_ROUND_MAX
            && !stop.load(Ordering::Relaxed)
            && client.is_connected()
        {
            let seq = shared.next_seq.fetch_add(1, Ordering::Relaxed);
            count += 1;
            issued.fetch_add(1, Ordering::Relaxed);
            let client = client.clone();
            tasks.spawn(async move {
                let result = client
                    .publish(QUEUE, OutgoingMessage::new(body(seq, BODY_BYTES)))
                    .await;
                (seq, result.map(|_| ()).map_err(|f| error_kind(&f.error)))
            });
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        let (seq, result) = joined.expect("publish task");
        let mut ledger = lock(&shared.ledger);
        match result {
            Ok(()) => {
                ledger.confirmed.insert(seq);
            }
            Err(kind) => *ledger.failed.entry(kind).or_default() += 1,
        }
    }
}

/// Checks one delivery against the ledger; returns its seq if the body is intact.
fn check_delivery(ledger: &mut Ledger, delivery: &Delivery, published: u64) -> Option<u64> {
    ledger.deliveries += 1;
    ledger.redelivered += u64::from(delivery.redelivered);
    let Some(seq) = seq_of(&delivery.body) else {
        ledger.violations.push(format!(
            "a delivery at partition {} offset {} fails its checksum",
            delivery.partition, delivery.offset
        ));
        return None;
    };
    if delivery.body.len() != BODY_BYTES || seq >= published {
        ledger.violations.push(format!(
            "seq {seq} ({} bytes) was never published",
            delivery.body.len()
        ));
        return None;
    }
    if ledger.settled_before_clean_stop.contains(&seq) {
        ledger.violations.push(format!(
            "seq {seq} was acked before the clean stop and came back (partition {} offset {})",
            delivery.partition, delivery.offset
        ));
    } else if let Some((round, acked_at)) = ledger.acked.get(&seq).copied() {
        ledger.acked_then_delivered += 1;
        if let Some(killed_at) = ledger.killed_at.get(&round).copied() {
            let age = killed_at.saturating_duration_since(acked_at);
            ledger.lost_ack_age_max = ledger.lost_ack_age_max.max(age);
        }
    }
    Some(seq)
}

/// The round's consumer: acks, at most `acks_per_ms`, until `stop`, its budget or the
/// connection's end, holding up to `held_max` deliveries (chosen by seed) unsettled. Returns the
/// held deliveries and the consumer, so that the caller decides when they go back.
async fn consumer(
    client: Client,
    shared: Shared,
    round: u32,
    held_max: usize,
    acks_per_ms: u64,
    stop: Arc<AtomicBool>,
) -> (Vec<Delivery>, Option<keratin_client::Consumer>) {
    let Ok(mut consumer) = client.subscribe(QUEUE, ROUND_PREFETCH).await else {
        return (Vec::new(), None); // The kill came first.
    };
    let mut held = Vec::new();
    let mut acks = 0;
    let started = Instant::now();
    let deadline = started + ROUND_DEADLINE;
    while !stop.load(Ordering::Relaxed) && acks < ACKS_PER_ROUND_MAX && Instant::now() < deadline {
        let allowed = started.elapsed().as_millis() as u64 * acks_per_ms;
        if acks >= allowed {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        let delivery = match tokio::time::timeout(Duration::from_millis(50), consumer.recv()).await
        {
            Ok(Some(delivery)) => delivery,
            Ok(None) => break, // The broker went away.
            Err(_) => continue,
        };
        let published = shared.next_seq.load(Ordering::Relaxed);
        let mut ledger = lock(&shared.ledger);
        let Some(seq) = check_delivery(&mut ledger, &delivery, published) else {
            continue;
        };
        let hold = held.len() < held_max && Rng(seq ^ shared.seed).next().is_multiple_of(8);
        if hold {
            // The broker owes this message again, whatever happened to an earlier ack.
            ledger.acked.remove(&seq);
            held.push(delivery);
        } else if delivery.ack().is_ok() {
            ledger.acked.insert(seq, (round, Instant::now()));
            acks += 1;
        }
    }
    (held, Some(consumer))
}

/// Checks that the queue was declared before and still has its settings.
async fn check_declaration(client: &Client, round: u32) {
    let info = client
        .info(QUEUE)
        .await
        .unwrap_or_else(|e| panic!("round {round}: the queue's declaration was lost: {e}"));
    assert_eq!(
        info.settings,
        queue_settings(),
        "round {round}: settings survive"
    );
    assert_eq!(
        info.partitions.len(),
        2,
        "round {round}: partitions survive"
    );
    client
        .declare(QUEUE, queue_settings())
        .await
        .unwrap_or_else(|e| panic!("round {round}: declaring again with the same settings: {e}"));
}

fn serve_args<'a>(config: &'a str, data: &'a str) -> [&'a str; 9] {
    [
        "serve",
        "--config",
        config,
        "--data-dir",
        data,
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]
}

/// How a round ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Kill { delay_ms: u64, share_percent: u64 },
    Clean,
}

/// One server lifetime under load. Returns how many publishes it confirmed.
async fn round(
    args: &[&str],
    shared: &Shared,
    round: u32,
    ending: Ending,
    acks_per_ms: u64,
) -> u64 {
    let started = Instant::now();
    let confirmed_before = lock(&shared.ledger).confirmed.len() as u64;
    let mut server = Server::start(args);
    let admin = connect(server.protocol, "durability-admin").await;
    if round == 1 {
        admin
            .declare("durable-dlq", QueueSettings::default())
            .await
            .expect("declare dlq");
        admin
            .declare(QUEUE, queue_settings())
            .await
            .expect("declare");
    }
    check_declaration(&admin, round).await;

    let stop_publishers = Arc::new(AtomicBool::new(false));
    let stop_consumer = Arc::new(AtomicBool::new(false));
    let issued = Arc::new(AtomicU64::new(0));
    let mut publishers = JoinSet::new();
    for index in 0..PUBLISHERS {
        let client = connect(server.protocol, &format!("durability-publisher-{index}")).await;
        publishers.spawn(publisher(
            client,
            shared.clone(),
            stop_publishers.clone(),
            issued.clone(),
        ));
    }
    let consumer_client = connect(server.protocol, "durability-consumer").await;
    let held_max = if ending == Ending::Clean {
        0
    } else {
        HELD_PER_ROUND_MAX
    };
    let consuming = tokio::spawn(consumer(
        consumer_client.clone(),
        shared.clone(),
        round,
        held_max,
        acks_per_ms,
        stop_consumer.clone(),
    ));

    match ending {
        Ending::Kill {
            delay_ms,
            share_percent,
        } => {
            let trigger = PUBLISHES_PER_ROUND_MAX * PUBLISHERS as u64 * share_percent / 100;
            let deadline = started + ROUND_DEADLINE;
            loop {
                let confirmed = lock(&shared.ledger).confirmed.len() as u64 - confirmed_before;
                let due = started.elapsed() >= Duration::from_millis(delay_ms)
                    || issued.load(Ordering::Relaxed) >= trigger;
                if due && confirmed > 0 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "round {round}: no publish confirmed within {ROUND_DEADLINE:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            server.kill9();
            lock(&shared.ledger).killed_at.insert(round, Instant::now());
            wind_down(round, &mut publishers, consuming).await;
        }
        Ending::Clean => {
            tokio::time::sleep(Duration::from_millis(800)).await;
            stop_publishers.store(true, Ordering::Relaxed);
            wait_for(round, "publishers", async {
                while publishers.join_next().await.is_some() {}
            })
            .await;
            // Let the consumer take what the publishers left, then stop it.
            tokio::time::sleep(Duration::from_millis(300)).await;
            stop_consumer.store(true, Ordering::Relaxed);
            let (held, consumer) = wait_for(round, "consumer", consuming)
                .await
                .expect("consumer task");
            assert!(held.is_empty());
            // Dropping the consumer sends its Cancel on the same path as, and after, its acks.
            drop(consumer);
            quiesce(&admin, round).await;
            consumer_client.close().await;
            admin.close().await;
            assert!(
                server.terminate(Duration::from_secs(30)),
                "round {round}: SIGTERM must stop the broker cleanly"
            );
            let mut ledger = lock(&shared.ledger);
            ledger.settled_before_clean_stop = ledger.acked.keys().copied().collect();
        }
    }
    let confirmed = lock(&shared.ledger).confirmed.len() as u64 - confirmed_before;
    eprintln!(
        "round {round} ({ending:?}): issued {}, confirmed {confirmed}, in {:?}",
        issued.load(Ordering::Relaxed),
        started.elapsed()
    );
    confirmed
}

async fn wait_for<T>(round: u32, what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(ROUND_DEADLINE, future)
        .await
        .unwrap_or_else(|_| {
            panic!("round {round}: {what} did not finish within {ROUND_DEADLINE:?}")
        })
}

/// After a kill: every publish resolves (confirmed or failed) and the consumer ends promptly.
async fn wind_down(
    round: u32,
    publishers: &mut JoinSet<()>,
    consuming: tokio::task::JoinHandle<(Vec<Delivery>, Option<keratin_client::Consumer>)>,
) {
    wait_for(round, "publishers after the kill", async {
        while let Some(joined) = publishers.join_next().await {
            joined.expect("publisher task");
        }
    })
    .await;
    let (held, _consumer) = wait_for(round, "consumer after the kill", consuming)
        .await
        .expect("consumer task");
    drop(held);
}

/// Waits until nothing is inflight: every ack the consumer sent was applied.
async fn quiesce(admin: &Client, round: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = admin.info(QUEUE).await.expect("info");
        let inflight: u64 = info.partitions.iter().map(|p| p.inflight).sum();
        if inflight == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "round {round}: {inflight} deliveries still inflight after the consumer left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last start: every confirmed message not acked comes back, intact, exactly once.
async fn drain(args: &[&str], shared: &Shared) {
    let started = Instant::now();
    let mut server = Server::start(args);
    eprintln!("final start took {:?}", started.elapsed());
    let client = connect(server.protocol, "durability-drain").await;
    check_declaration(&client, KILL_ROUNDS + 1).await;
    let expected: BTreeSet<u64> = {
        let ledger = lock(&shared.ledger);
        ledger
            .confirmed
            .iter()
            .filter(|seq| !ledger.acked.contains_key(seq))
            .copied()
            .collect()
    };
    let published = shared.next_seq.load(Ordering::Relaxed);
    let mut consumer = client
        .subscribe(QUEUE, DRAIN_PREFETCH)
        .await
        .expect("subscribe");
    let mut seen = BTreeSet::new();
    let mut twice = Vec::new();
    let deadline = Instant::now() + DRAIN_DEADLINE;
    while Instant::now() < deadline {
        let idle = if expected.is_subset(&seen) {
            DRAIN_IDLE
        } else {
            Duration::from_secs(5)
        };
        let Ok(Some(delivery)) = tokio::time::timeout(idle, consumer.recv()).await else {
            break;
        };
        let seq = check_delivery(&mut lock(&shared.ledger), &delivery, published);
        if let Some(seq) = seq {
            if !seen.insert(seq) && twice.len() < 10 {
                twice.push(seq);
            }
        }
        delivery.ack().expect("ack in the drain");
    }
    drop(consumer);
    let missing: Vec<u64> = expected.difference(&seen).copied().collect();
    {
        let ledger = lock(&shared.ledger);
        let unconfirmed_seen = seen.difference(&ledger.confirmed).count();
        let acked_seen = seen.iter().filter(|s| ledger.acked.contains_key(s)).count();
        eprintln!(
            "drain: expected {}, delivered {} distinct in {:?}; of them {} never confirmed \
             (outcome unknown at a kill) and {} acked in a kill round (ack lost to the kill)",
            expected.len(),
            seen.len(),
            started.elapsed(),
            unconfirmed_seen,
            acked_seen,
        );
        assert!(
            missing.is_empty(),
            "{} confirmed, unacknowledged messages are lost, for example {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
        assert!(
            twice.is_empty(),
            "the drain delivered seqs twice: {twice:?}"
        );
        assert!(
            ledger.violations.is_empty(),
            "{} violations, first ones: {:#?}",
            ledger.violations.len(),
            &ledger.violations[..ledger.violations.len().min(10)]
        );
    }
    quiesce(&client, KILL_ROUNDS + 1).await;
    let info = client.info(QUEUE).await.expect("info");
    let ready: u64 = info.partitions.iter().map(|p| p.ready).sum();
    assert_eq!(ready, 0, "the drain took everything: {info:?}");
    client.close().await;
    assert!(server.terminate(Duration::from_secs(30)), "clean stop");
}

fn write_config(dir: &Path) -> String {
    let path = dir.join("keratin.toml");
    std::fs::write(&path, "[storage]\nsegment_bytes = 4194304\n").expect("write config");
    path.to_str().expect("utf-8 path").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_messages_survive_kill_9_under_load() {
    let seed = seed();
    eprintln!("durability seed {seed} (replay the kill moments with KERATIN_SEED={seed})");
    let started = Instant::now();
    // The real disk, not a tmpfs: fsync has to mean something.
    let tmp = tempfile::Builder::new()
        .prefix("keratin-durability-")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp");
    let config = write_config(tmp.path());
    let data = tmp.path().join("data");
    let data = data.to_str().expect("utf-8 path");
    let args = serve_args(&config, data);
    let shared = Shared {
        ledger: Arc::default(),
        next_seq: Arc::new(AtomicU64::new(0)),
        seed,
    };
    let mut rng = Rng(seed);
    let mut confirmed_total = 0;
    for number in 1..=KILL_ROUNDS {
        let ending = Ending::Kill {
            delay_ms: rng.range(KILL_DELAY_MS_MIN, KILL_DELAY_MS_MAX),
            share_percent: rng.range(30, 90),
        };
        let acks_per_ms = rng.range(ACKS_PER_MS_MIN, ACKS_PER_MS_MAX);
        confirmed_total += round(&args, &shared, number, ending, acks_per_ms).await;
        if number == CLEAN_STOP_AFTER_ROUND {
            let acks_per_ms = rng.range(ACKS_PER_MS_MIN, ACKS_PER_MS_MAX);
            confirmed_total += round(&args, &shared, number, Ending::Clean, acks_per_ms).await;
        }
    }
    {
        let ledger = lock(&shared.ledger);
        eprintln!(
            "after {KILL_ROUNDS} kills: published {}, confirmed {confirmed_total}, acked {}, \
             failed {:?}; {} deliveries ({} redelivered, {} of acked seqs), {} settled before \
             the clean stop; the oldest lost ack was made {:?} before its kill",
            shared.next_seq.load(Ordering::Relaxed),
            ledger.acked.len(),
            ledger.failed,
            ledger.deliveries,
            ledger.redelivered,
            ledger.acked_then_delivered,
            ledger.settled_before_clean_stop.len(),
            ledger.lost_ack_age_max,
        );
        let unexpected: Vec<_> = ledger
            .failed
            .keys()
            .filter(|k| !matches!(k.as_str(), "connection-lost" | "outcome-unknown"))
            .collect();
        assert!(
            unexpected.is_empty(),
            "publishes failed only because of the kills: {:?}",
            ledger.failed
        );
        assert!(
            ledger.settled_before_clean_stop.len() > 100,
            "the consumer acked too little before the clean stop to test anything"
        );
    }
    drain(&args, &shared).await;
    eprintln!("durability test took {:?} (seed {seed})", started.elapsed());
}
