//! Dead-lettering across the nodes of a cluster, on three real `keratin serve` processes on
//! 127.0.0.1: the source queue `work` has four partitions on nodes 1 and 2 (leaders 1, 2, 1,
//! 2), its dead-letter queue `dlq` one partition on all three nodes led by node 3, so every
//! dead letter crosses to another node. Consumers connected to nodes 1, 2 and 3 (node 3 leads
//! nothing of `work`; its consumer follows to a leader) reject every delivery: even bodies
//! without requeue (reason `rejected`), odd ones with requeue until `--max-deliveries 2`
//! (reason `max_deliveries`).
//!
//! 1. **Every rejected message reaches the dead-letter queue, once**: consumed from `dlq`, each
//!    body arrives with `x-death-reason`, `x-death-queue: work` and `x-death-count`; none is
//!    missing, none stored twice, and `work` ends empty. Before cross-node dead-lettering the
//!    copies were refused on node 1 and 2 ("not the leader") and the originals dropped: 0 of
//!    200 arrived.
//! 2. **The dead-letter queue's leader killed while dead-lettering is under way** (`kill -9`
//!    node 3 after 600 of 2,000 rejects): the originals are held and retried, and every one
//!    arrives once nodes 1 and 2 elected a new leader of `dlq`; a copy whose first attempt had
//!    an unknown outcome is stored once (the dead-letter copies are an idempotent producer's).
//!
//! Leader balancing is on here (the cluster support turns it off), so that each partition is
//! led by its preferred leader from `--nodes`. Bounded: each wait has a deadline; the
//! processes are killed by PID when dropped.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage};
use support::cluster::Cluster;
use support::{body, seq_of};

const SOURCE: &str = "work";
const DLQ: &str = "dlq";
/// Round 1: messages published and rejected.
const ROUND_1: u64 = 200;
/// Round 2: messages published and rejected around the kill; their sequence numbers start at
/// [`ROUND_2_FIRST`].
const ROUND_2: u64 = 2_000;
const ROUND_2_FIRST: u64 = 10_000;
/// Node 3 is killed once this many round-2 deliveries were rejected.
const KILL_AFTER_REJECTS: u64 = 600;
const BODY_BYTES: usize = 128;
/// Cluster set-up (metadata leader, placement, leader balancing) must be done within this.
const SETTLE_MAX: Duration = Duration::from_secs(60);
/// Every dead letter of a round must arrive within this.
const ARRIVAL_MAX: Duration = Duration::from_secs(60);

/// What the dead-letter queue's reader saw, per body sequence number.
#[derive(Default)]
struct Arrivals {
    /// Each delivery: (redelivered, x-death-reason, x-death-queue, x-death-count).
    seen: BTreeMap<u64, Vec<(bool, String, String, String)>>,
    bad_bodies: u64,
}

fn header(delivery: &keratin_client::Delivery, name: &str) -> String {
    delivery
        .headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.clone())
        .unwrap_or_default()
}

/// Ready and inflight messages of `queue`, summed over its partitions as their leaders see
/// them, and how many partitions no running node leads.
fn depth(cluster: &Cluster, queue: &str) -> (u64, u64) {
    let mut messages = 0;
    let mut partitions_led = BTreeSet::new();
    for id in cluster.nodes.keys().copied() {
        if cluster.nodes[&id].server.is_none() {
            continue;
        }
        for p in cluster.partitions_seen_by(id, queue).unwrap_or_default() {
            if p["leading"] == true {
                partitions_led.insert(p["index"].as_u64().unwrap_or(0));
                messages += p["ready"].as_u64().unwrap_or(0)
                    + p["inflight"].as_u64().unwrap_or(0)
                    + p["dead_letters_held"].as_u64().unwrap_or(0);
            }
        }
    }
    (messages, partitions_led.len() as u64)
}

async fn connect(addr: SocketAddr) -> Option<Client> {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    };
    Client::connect(addr, options).await.ok()
}

/// Consume `queue` (prefetch `prefetch`) through the nodes of `addrs` in turn from `start`,
/// moving on to the next node when one cannot be reached or its consumer ends, and hand each
/// delivery to `handle`, until `stop`.
async fn consume_through_nodes(
    addrs: Arc<Mutex<Vec<SocketAddr>>>,
    start: usize,
    queue: &'static str,
    prefetch: u32,
    stop: Arc<AtomicBool>,
    mut handle: impl FnMut(keratin_client::Delivery),
) {
    let mut turn = start;
    while !stop.load(Ordering::Relaxed) {
        let list = addrs.lock().expect("lock").clone();
        let addr = list[turn % list.len()];
        turn += 1;
        let Some(client) = connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(mut consumer) = client.subscribe(queue, prefetch).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        loop {
            let next = tokio::time::timeout(Duration::from_millis(300), consumer.recv()).await;
            match next {
                Ok(Some(delivery)) => handle(delivery),
                Ok(None) => break,
                Err(_) if stop.load(Ordering::Relaxed) => return,
                Err(_) => continue,
            }
        }
    }
}

/// Consume `work` through `addrs[start]` (then the others in turn) and reject every delivery
/// (see the module docs), counting the round-2 rejects, until `stop`.
async fn rejecter(
    addrs: Arc<Mutex<Vec<SocketAddr>>>,
    start: usize,
    round_2_rejects: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    consume_through_nodes(addrs, start, SOURCE, 32, stop, |delivery| {
        let seq = seq_of(&delivery.body).unwrap_or(1);
        if delivery.reject(seq % 2 == 1).is_ok() && seq >= ROUND_2_FIRST {
            round_2_rejects.fetch_add(1, Ordering::Relaxed);
        }
    })
    .await;
}

/// Consume `dlq` through the nodes of `addrs` in turn, acking each delivery, until `stop`.
async fn dead_letter_reader(
    addrs: Arc<Mutex<Vec<SocketAddr>>>,
    arrivals: Arc<Mutex<Arrivals>>,
    stop: Arc<AtomicBool>,
) {
    consume_through_nodes(addrs, 0, DLQ, 256, stop, |delivery| {
        {
            let mut arrivals = arrivals.lock().expect("lock");
            match seq_of(&delivery.body) {
                Some(seq) => arrivals.seen.entry(seq).or_default().push((
                    delivery.redelivered,
                    header(&delivery, "x-death-reason"),
                    header(&delivery, "x-death-queue"),
                    header(&delivery, "x-death-count"),
                )),
                None => arrivals.bad_bodies += 1,
            }
        }
        let _ = delivery.ack();
    })
    .await;
}

/// Publish `seqs` to `work` through `addr` in batches of 50, confirmed (the client is an
/// idempotent producer and follows each partition's leader).
async fn publish(addr: SocketAddr, seqs: std::ops::Range<u64>) {
    let client = connect(addr).await.expect("connect to publish");
    let all: Vec<u64> = seqs.collect();
    for chunk in all.chunks(50) {
        let messages: Vec<OutgoingMessage> = chunk
            .iter()
            .map(|seq| OutgoingMessage::new(body(*seq, BODY_BYTES)))
            .collect();
        for (seq, result) in chunk
            .iter()
            .zip(client.publish_batch(SOURCE, messages).await)
        {
            if let Err(error) = result {
                panic!("publish of {seq} failed: {}", error.error);
            }
        }
    }
}

/// Waits until every sequence number of `wanted` arrived in the dead-letter queue, for
/// [`ARRIVAL_MAX`] at most; the ones missing then.
fn wait_arrivals(arrivals: &Mutex<Arrivals>, wanted: &BTreeSet<u64>) -> BTreeSet<u64> {
    let deadline = Instant::now() + ARRIVAL_MAX;
    loop {
        let missing: BTreeSet<u64> = {
            let arrivals = arrivals.lock().expect("lock");
            wanted
                .iter()
                .filter(|seq| !arrivals.seen.contains_key(seq))
                .copied()
                .collect()
        };
        if missing.is_empty() || Instant::now() >= deadline {
            return missing;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every message of `wanted` arrived with the right headers, and none was stored twice (two
/// deliveries not flagged `redelivered`).
fn check_round(arrivals: &Mutex<Arrivals>, wanted: &BTreeSet<u64>, round: &str) {
    let missing = wait_arrivals(arrivals, wanted);
    let arrivals = arrivals.lock().expect("lock");
    let arrived = wanted.len() - missing.len();
    println!(
        "{round}: {arrived} of {} rejected messages reached {DLQ}",
        wanted.len()
    );
    assert!(
        missing.is_empty(),
        "{round}: {arrived} of {} rejected messages reached {DLQ}; missing (first 10) {:?}",
        wanted.len(),
        missing.iter().take(10).collect::<Vec<_>>()
    );
    assert_eq!(
        arrivals.bad_bodies, 0,
        "{round}: bodies with a bad checksum"
    );
    let mut stored_twice = Vec::new();
    for seq in wanted {
        let deliveries = &arrivals.seen[seq];
        let (reason, count) = if seq % 2 == 0 {
            ("rejected", "1")
        } else {
            ("max_deliveries", "2")
        };
        for (_, got_reason, got_queue, got_count) in deliveries {
            assert_eq!(
                (got_reason.as_str(), got_queue.as_str(), got_count.as_str()),
                (reason, SOURCE, count),
                "{round}: x-death headers of {seq}"
            );
        }
        if deliveries.iter().filter(|d| !d.0).count() > 1 {
            stored_twice.push(*seq);
        }
    }
    assert!(
        stored_twice.is_empty(),
        "{round}: {} dead letters stored twice (first 10: {:?})",
        stored_twice.len(),
        stored_twice.iter().take(10).collect::<Vec<_>>()
    );
}

/// Waits until `work` holds nothing on its leaders: no original was kept back or lost in
/// between (every one was settled once its copy was stored).
fn wait_source_empty(cluster: &Cluster, round: &str) {
    let deadline = Instant::now() + ARRIVAL_MAX;
    loop {
        let (messages, led) = depth(cluster, SOURCE);
        if messages == 0 && led == 4 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{round}: {SOURCE} still holds {messages} messages ({led} of 4 partitions led)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn dead_letters_reach_a_queue_led_elsewhere_and_survive_its_leader_killed() {
    let balance = vec![("KERATIN_CLUSTER__LEADER_BALANCE", "true")];
    let envs = (1..=3).map(|id| (id, balance.clone())).collect();
    let mut cluster = Cluster::start_with_env(envs);
    cluster.cli_until_ok(
        1,
        &["queue", "declare", DLQ, "--nodes", "3,1,2"],
        SETTLE_MAX,
    );
    cluster.cli_until_ok(
        1,
        &[
            "queue",
            "declare",
            SOURCE,
            "--partitions",
            "4",
            "--nodes",
            "1,2",
            "--dead-letter",
            DLQ,
            "--max-deliveries",
            "2",
        ],
        SETTLE_MAX,
    );
    // Leader balancing moves each partition to its preferred leader.
    cluster.wait_leaders(DLQ, "leader on node 3", SETTLE_MAX, |l| l == [3]);
    cluster.wait_leaders(SOURCE, "leaders on nodes 1, 2, 1, 2", SETTLE_MAX, |l| {
        l == [1, 2, 1, 2]
    });
    let addrs: BTreeMap<u64, SocketAddr> = cluster
        .nodes
        .iter()
        .map(|(id, n)| (*id, n.protocol))
        .collect();
    let node_addr = |id: u64| addrs[&id];
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let source_addrs = Arc::new(Mutex::new(vec![node_addr(1), node_addr(2), node_addr(3)]));
    let dlq_addrs = Arc::new(Mutex::new(vec![node_addr(1), node_addr(2), node_addr(3)]));
    let stop = Arc::new(AtomicBool::new(false));
    let round_2_rejects = Arc::new(AtomicU64::new(0));
    let arrivals = Arc::new(Mutex::new(Arrivals::default()));
    let mut tasks = Vec::new();
    for start in 0..3 {
        tasks.push(runtime.spawn(rejecter(
            source_addrs.clone(),
            start,
            round_2_rejects.clone(),
            stop.clone(),
        )));
    }
    tasks.push(runtime.spawn(dead_letter_reader(
        dlq_addrs.clone(),
        arrivals.clone(),
        stop.clone(),
    )));

    // Round 1: every dead letter crosses from node 1 or 2 to node 3.
    runtime.block_on(publish(node_addr(3), 0..ROUND_1));
    check_round(&arrivals, &(0..ROUND_1).collect(), "round 1");
    wait_source_empty(&cluster, "round 1");

    // Round 2: the dead-letter queue's leader is killed while dead letters go to it.
    let publishing = runtime.spawn(publish(
        node_addr(1),
        ROUND_2_FIRST..ROUND_2_FIRST + ROUND_2,
    ));
    let deadline = Instant::now() + ARRIVAL_MAX;
    while round_2_rejects.load(Ordering::Relaxed) < KILL_AFTER_REJECTS {
        assert!(
            Instant::now() < deadline,
            "round 2: only {} rejects",
            round_2_rejects.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed_at = Instant::now();
    cluster.kill9(3);
    let arrived_at_kill = arrivals
        .lock()
        .expect("lock")
        .seen
        .range(ROUND_2_FIRST..)
        .count();
    println!(
        "round 2: node 3 killed after {} rejects, {arrived_at_kill} dead letters arrived by then",
        round_2_rejects.load(Ordering::Relaxed)
    );
    for addrs in [&source_addrs, &dlq_addrs] {
        *addrs.lock().expect("lock") = vec![node_addr(1), node_addr(2)];
    }
    runtime
        .block_on(publishing)
        .expect("round 2's publisher ended");
    check_round(
        &arrivals,
        &(ROUND_2_FIRST..ROUND_2_FIRST + ROUND_2).collect(),
        "round 2",
    );
    println!(
        "round 2: every dead letter arrived {:?} after the kill",
        killed_at.elapsed()
    );
    wait_source_empty(&cluster, "round 2");

    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = runtime.block_on(task);
    }
}
