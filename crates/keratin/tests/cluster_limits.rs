//! Cluster-wide limits (issue 15, the seed's cluster test): three real `keratin serve`
//! processes on 127.0.0.1, node 3 with its storage on a 256 MiB tmpfs, nodes 1 and 2 on the
//! host's disk (with a 256 MiB storage budget). Queue A has 3 partitions, each with a copy on
//! every node (`--nodes 1,2,3`: partition `p` led by node `p + 1`), queue B 3 partitions
//! pinned to nodes 1 and 2 (led by nodes 1, 2, 1; none on node 3). Then:
//! - B publishes at a paced rate (its rate before the fill);
//! - A is filled with no consumer, one publisher per partition (a routing key of that
//!   partition): nodes 1 and 2 learn node 3's levels from node 3's heartbeat label, slow their
//!   partitions' publishes at soft, and every partition of A (node 3's own too) is refused at
//!   hard with `ERR_LIMITED` (429), reason `disk`, a retry hint, and a message naming node 3
//!   and its path; the time from node 3 reaching hard to each partition's first 429 is
//!   printed;
//! - meanwhile **B keeps publishing at ≥ 0.9 of its rate before the fill** (measured while A
//!   is refused, same run);
//! - no log stopped on any node;
//! - consuming A frees space on node 3 and every partition of A is accepted again by itself;
//! - every message of A confirmed is delivered.
//!
//! Root only (tmpfs): skipped loudly otherwise, a failure under
//! `KERATIN_REQUIRE_PRIVILEGED_TESTS=1`. Bounded: each phase has a deadline, the whole test
//! takes about a minute; the processes are killed by PID and the tmpfs unmounted when dropped.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientError, ClientOptions, OutgoingMessage, QueueSettings};
use support::cluster::Cluster;
use support::{body, seq_of, Tmpfs};

const SMALL_MIB: u64 = 256;
/// A's messages: 64 KiB, in batches of 16 (1 MiB a batch).
const A_BODY_BYTES: usize = 64 * 1024;
const A_BATCH: usize = 16;
/// B's pace: one confirmed batch of 10 small messages every 20 ms (500 messages a second),
/// far below what the cluster can take, so its rate shows whether it is held back at all.
const B_BATCH: usize = 10;
const B_EVERY: Duration = Duration::from_millis(20);
const B_BODY_BYTES: usize = 512;
/// How long B's rate is measured, before the fill and while A is refused.
const B_WINDOW: Duration = Duration::from_secs(3);
const PHASE_MAX: Duration = Duration::from_secs(60);
/// Partitions of a queue whose leaders spread over the three nodes (the reserve test's queue
/// r has one fewer, so that node 3 leads none of them).
const PARTITIONS: u32 = 3;
/// Confirms after its last refusal that count as a partition of A resumed.
const RESUMED_PER_PARTITION: u64 = 4 * A_BATCH as u64;

/// Environment of every node: leader balancing, small segments (the tmpfs holds 64 of them),
/// sampling every 100 ms.
const COMMON: &[(&str, &str)] = &[
    // Partitions go back to their preferred leaders (the first of each replica set): node 3,
    // whose tmpfs syncs fastest, wins most elections, and A needs a leader elsewhere.
    ("KERATIN_CLUSTER__LEADER_BALANCE", "true"),
    ("KERATIN_STORAGE__SEGMENT_BYTES", "4194304"),
    ("KERATIN_LIMITS__SAMPLE_INTERVAL_MS", "100"),
    ("KERATIN_LIMITS__MAX_DELAY_MS", "50"),
];

/// Nodes 1 and 2: a storage budget of 256 MiB on the host's disk, with levels far below what
/// the test writes there (the host's disk, whatever its free space, never limits them).
const BUDGET: &[(&str, &str)] = &[
    ("KERATIN_STORAGE__MAX_BYTES", "268435456"),
    ("KERATIN_LIMITS__DISK__SOFT_FRACTION", "0.05"),
    ("KERATIN_LIMITS__DISK__HARD_FRACTION", "0.03"),
    ("KERATIN_LIMITS__DISK__RESERVE_FRACTION", "0.01"),
    ("KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES", "0"),
    ("KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES", "0"),
    ("KERATIN_LIMITS__DISK__RESERVE_FLOOR_BYTES", "0"),
    ("KERATIN_LIMITS__DISK__CLEAR_MARGIN_FRACTION", "0.005"),
];

/// Node 3's disk levels on its 256 MiB tmpfs: soft at 50 % free (128 MiB), hard at 30 %,
/// reserve at 10 %, no floors.
const SMALL: &[(&str, &str)] = &[
    ("KERATIN_LIMITS__DISK__SOFT_FRACTION", "0.5"),
    ("KERATIN_LIMITS__DISK__HARD_FRACTION", "0.3"),
    ("KERATIN_LIMITS__DISK__RESERVE_FRACTION", "0.1"),
    ("KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES", "0"),
    ("KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES", "0"),
    ("KERATIN_LIMITS__DISK__RESERVE_FLOOR_BYTES", "0"),
    ("KERATIN_LIMITS__DISK__CLEAR_MARGIN_FRACTION", "0.02"),
];

fn options(publish_timeout: Duration) -> ClientOptions {
    ClientOptions {
        publish_timeout,
        ..ClientOptions::default()
    }
}

async fn connect(addr: SocketAddr, publish_timeout: Duration) -> Client {
    let deadline = Instant::now() + PHASE_MAX;
    loop {
        match Client::connect(addr, options(publish_timeout)).await {
            Ok(client) => return client,
            Err(error) => {
                assert!(Instant::now() < deadline, "connect to {addr}: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Each queue's first partition: (replicas, leader), as the nodes holding it see it (a node
/// with no replica of a queue lists none).
fn placements(cluster: &Cluster) -> BTreeMap<String, (Vec<u64>, Option<u64>)> {
    let mut placed: BTreeMap<String, (Vec<u64>, Option<u64>)> = BTreeMap::new();
    for id in 1..=3 {
        let Some(document) = cluster.cluster_document(id) else {
            continue;
        };
        for queue in document["queues"].as_array().into_iter().flatten() {
            let Some(partition) = queue["partitions"].as_array().and_then(|p| p.first()) else {
                continue;
            };
            let replicas: Vec<u64> = partition["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(serde_json::Value::as_u64)
                .collect();
            let Some(name) = queue["name"].as_str() else {
                continue;
            };
            if replicas.is_empty() {
                continue;
            }
            let entry = placed.entry(name.to_owned()).or_default();
            entry.0 = replicas;
            if partition["leading"] == true {
                entry.1 = Some(id);
            }
        }
    }
    placed
}

/// Declares `name` with `partitions` partitions, each with a replica on every node of `nodes`
/// (again, while the cluster forms), then waits until partition `p` is led by `nodes[p mod
/// n]`, its preferred leader (the declare rotates them; leader balancing hands each partition
/// there), within [`PHASE_MAX`]; the leaders by partition.
async fn declare_pinned(
    cluster: &Cluster,
    admin: &Client,
    name: &str,
    nodes: &[u64],
    partitions: u32,
) -> Vec<u64> {
    let preferred: Vec<u64> = (0..partitions as usize)
        .map(|p| nodes[p % nodes.len()])
        .collect();
    let settings = QueueSettings {
        partitions,
        ..QueueSettings::default()
    };
    let deadline = Instant::now() + PHASE_MAX;
    loop {
        if let Err(error) = admin.declare_on(name, settings.clone(), nodes).await {
            eprintln!("declare {name}: {error} (the cluster may still be forming)");
        }
        let placed = placements(cluster);
        if let Some((replicas, _)) = placed.get(name) {
            assert_eq!(replicas, nodes, "{name} is on the nodes named, in order");
            let leaders = tokio::task::block_in_place(|| cluster.leaders(name));
            if leaders.as_ref() == Some(&preferred) {
                return preferred;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{name} not led by nodes {preferred:?}: {placed:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A routing key for each of `partitions` partitions, by index: `key-N` with the least `N`
/// whose CRC32C falls there (the client and the broker route a key to `crc32c(key) mod
/// partitions`).
fn keys_by_partition(partitions: u32) -> Vec<String> {
    (0..partitions)
        .map(|p| {
            (0u32..)
                .map(|n| format!("key-{n}"))
                .find(|key| crc32c::crc32c(key.as_bytes()) % partitions == p)
                .expect("a key for every partition")
        })
        .collect()
}

/// Node `id`'s level of its first file system, from its own status document.
fn disk_level(cluster: &Cluster, id: u64) -> Option<String> {
    let status = std::panic::catch_unwind(|| support::status(cluster.nodes[&id].http)).ok()?;
    status["filesystems"][0]["level"]
        .as_str()
        .map(str::to_owned)
}

/// Confirmed messages per second B's paced publisher reached over `window`.
async fn b_rate(client: &Client, queue: &str, window: Duration, next_seq: &mut u64) -> f64 {
    let started = Instant::now();
    let mut confirmed = 0u64;
    let mut tick = tokio::time::interval(B_EVERY);
    while started.elapsed() < window {
        tick.tick().await;
        let batch: Vec<OutgoingMessage> = (0..B_BATCH)
            .map(|_| {
                *next_seq += 1;
                OutgoingMessage::new(body(*next_seq, B_BODY_BYTES))
            })
            .collect();
        for result in client.publish_batch(queue, batch).await {
            match result {
                Ok(_) => confirmed += 1,
                Err(failed) => panic!("B's publish failed: {}", failed.error),
            }
        }
    }
    confirmed as f64 / started.elapsed().as_secs_f64()
}

/// What A's publisher saw.
#[derive(Default)]
struct ALedger {
    confirmed: BTreeSet<u64>,
    /// The first `ERR_LIMITED` (reason, retry hint, message) and when it came.
    first_limited: Option<(String, u32, String, Instant)>,
    limited: u64,
    /// Confirms after the last refusal (A resumed).
    confirmed_after_limited: u64,
    next_seq: u64,
    /// By partition, where the publisher chose it with a routing key: the first
    /// `ERR_LIMITED` (reason, retry hint, message, when), and the confirms after the
    /// partition's last refusal.
    first_limited_by_partition: BTreeMap<usize, (String, u32, String, Instant)>,
    confirmed_after_limited_by_partition: BTreeMap<usize, u64>,
}

/// Publishes A's batches to partition `partition` (with its routing key `keys[partition]`)
/// until `stop`, retrying refused ones after their hint. Its messages are numbered `k ×
/// keys.len() + partition`: a number's partition is its remainder.
async fn a_publisher(
    client: Client,
    queue: String,
    keys: Vec<String>,
    partition: usize,
    ledger: Arc<Mutex<ALedger>>,
    stop: Arc<AtomicBool>,
) {
    let partitions = keys.len() as u64;
    let partition_of = |seq: u64| (seq % partitions) as usize;
    let mut next = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let seqs: Vec<u64> = (next..next + A_BATCH as u64)
            .map(|k| k * partitions + partition as u64)
            .collect();
        next += A_BATCH as u64;
        let batch: Vec<OutgoingMessage> = seqs
            .iter()
            .map(|seq| {
                OutgoingMessage::new(body(*seq, A_BODY_BYTES))
                    .with_routing_key(keys[partition].clone())
            })
            .collect();
        let mut wait = Duration::ZERO;
        for (seq, result) in seqs
            .iter()
            .copied()
            .zip(client.publish_batch(&queue, batch).await)
        {
            let mut ledger = ledger.lock().expect("lock");
            match result {
                Ok(_) => {
                    ledger.confirmed.insert(seq);
                    if ledger.limited > 0 {
                        ledger.confirmed_after_limited += 1;
                    }
                    if ledger
                        .first_limited_by_partition
                        .contains_key(&partition_of(seq))
                    {
                        *ledger
                            .confirmed_after_limited_by_partition
                            .entry(partition_of(seq))
                            .or_default() += 1;
                    }
                }
                Err(failed) => match failed.error {
                    ClientError::Limited {
                        reason,
                        retry_after_ms,
                        message,
                        ..
                    } => {
                        ledger.limited += 1;
                        ledger.confirmed_after_limited = 0;
                        ledger
                            .confirmed_after_limited_by_partition
                            .insert(partition_of(seq), 0);
                        let first = (
                            reason.name().to_owned(),
                            retry_after_ms,
                            message,
                            Instant::now(),
                        );
                        ledger
                            .first_limited_by_partition
                            .entry(partition_of(seq))
                            .or_insert_with(|| first.clone());
                        if ledger.first_limited.is_none() {
                            ledger.first_limited = Some(first);
                        }
                        wait = wait.max(Duration::from_millis(u64::from(retry_after_ms)));
                    }
                    other => panic!("A's publish of {seq} failed: {other}"),
                },
            }
        }
        tokio::time::sleep(wait).await;
    }
}

/// Consumes and acks A's messages until `stop`; every sequence number delivered.
async fn a_consumer(
    client: Client,
    queue: String,
    delivered: Arc<Mutex<BTreeSet<u64>>>,
    stop: Arc<AtomicBool>,
) {
    let mut consumer = client.subscribe(&queue, 64).await.expect("subscribe to A");
    while !stop.load(Ordering::Relaxed) {
        let Ok(Some(delivery)) =
            tokio::time::timeout(Duration::from_millis(300), consumer.recv()).await
        else {
            continue;
        };
        let seq = seq_of(&delivery.body).expect("A's body checksum");
        delivered.lock().expect("lock").insert(seq);
        delivery.ack().expect("ack");
    }
}

/// Waits until every sequence number of `confirmed` is in `delivered`, within [`PHASE_MAX`].
async fn wait_all_delivered(
    confirmed: &BTreeSet<u64>,
    delivered: &Mutex<BTreeSet<u64>>,
    queue: &str,
) {
    let deadline = Instant::now() + PHASE_MAX;
    loop {
        let missing = confirmed
            .difference(&delivered.lock().expect("lock"))
            .count();
        if missing == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{missing} of {} confirmed messages of {queue} never delivered",
            confirmed.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// No node stopped a log (a write or sync failed).
fn assert_no_log_stopped(cluster: &Cluster) {
    for id in 1..=3 {
        let stops = support::metric(cluster.nodes[&id].http, "keratin_log_stops_total", "");
        assert_eq!(stops, 0.0, "node {id} stopped a log");
    }
}

/// A 256 MiB tmpfs for node 3 (unmounted when the second value drops, before the directory).
fn small_tmpfs() -> (tempfile::TempDir, Tmpfs) {
    let small = tempfile::tempdir().expect("tempdir");
    let tmpfs = Tmpfs::mount(small.path(), SMALL_MIB);
    (small, tmpfs)
}

/// Nodes 1 and 2 with their budgets on the host's disk, node 3 on the tmpfs at `small`.
fn start_cluster(small: &std::path::Path) -> Cluster {
    start_cluster_in(small, None)
}

/// [`start_cluster`], node 3 in the memory `cgroup` if given.
fn start_cluster_in(small: &std::path::Path, cgroup: Option<std::path::PathBuf>) -> Cluster {
    let host: Vec<(&'static str, &'static str)> = COMMON.iter().chain(BUDGET).copied().collect();
    let small_env: Vec<(&'static str, &'static str)> =
        COMMON.iter().chain(SMALL).copied().collect();
    let mut cluster = Cluster::new(BTreeMap::from([
        (1, host.clone()),
        (2, host),
        (3, small_env),
    ]));
    let node3 = cluster.nodes.get_mut(&3).expect("node 3");
    node3.dir = small.join("node-3");
    node3.cgroup = cgroup;
    for id in 1..=3 {
        cluster.start_node(id);
    }
    cluster
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn a_full_node_limits_only_the_partitions_with_a_copy_on_it() {
    if !support::privileged("a_full_node_limits_only_the_partitions_with_a_copy_on_it") {
        return;
    }
    let (small, _tmpfs) = small_tmpfs();
    // Declared after the mount: dropped first, so the processes end before the unmount.
    let cluster = start_cluster(small.path());
    runtime().block_on(async {
        let node1 = cluster.nodes[&1].protocol;
        let admin = connect(node1, Duration::from_secs(10)).await;
        let (queue_a, queue_b) = ("a".to_string(), "b".to_string());
        let a_leaders = declare_pinned(&cluster, &admin, &queue_a, &[1, 2, 3], PARTITIONS).await;
        let b_leaders = declare_pinned(&cluster, &admin, &queue_b, &[1, 2], PARTITIONS).await;
        eprintln!("A = {queue_a} led by {a_leaders:?}, B = {queue_b} led by {b_leaders:?}");
        let a_keys = keys_by_partition(PARTITIONS);

        // B's rate before the fill.
        let b_client = connect(node1, Duration::from_secs(10)).await;
        let mut b_seq = 0u64;
        let before = b_rate(&b_client, &queue_b, B_WINDOW, &mut b_seq).await;

        // Fill A with no consumer until it is refused.
        let a_ledger = Arc::new(Mutex::new(ALedger::default()));
        let a_stop = Arc::new(AtomicBool::new(false));
        // One publisher per partition, each with its own connection through node 1.
        let mut a_tasks = Vec::new();
        for partition in 0..PARTITIONS as usize {
            a_tasks.push(tokio::spawn(a_publisher(
                connect(node1, Duration::from_millis(300)).await,
                queue_a.clone(),
                a_keys.clone(),
                partition,
                a_ledger.clone(),
                a_stop.clone(),
            )));
        }
        // Every partition of A has a copy on node 3: every one is refused, whichever node
        // leads it (node 3 itself leads one).
        let mut hard_at = None;
        let deadline = Instant::now() + PHASE_MAX;
        let first_limited = loop {
            if hard_at.is_none() && disk_level(&cluster, 3).as_deref() == Some("hard") {
                hard_at = Some(Instant::now());
            }
            let firsts = a_ledger
                .lock()
                .expect("lock")
                .first_limited_by_partition
                .clone();
            if firsts.len() == PARTITIONS as usize {
                break firsts;
            }
            assert!(
                Instant::now() < deadline,
                "not every partition of A was refused (refused: {:?}); node 3 at {:?}, {} \
                 confirmed",
                firsts.keys().collect::<Vec<_>>(),
                disk_level(&cluster, 3),
                a_ledger.lock().expect("lock").confirmed.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // Refusals that do not name node 3, checked at the end (the rest of the test still
        // runs and shows what else goes wrong).
        let mut unnamed = Vec::new();
        for (partition, (reason, retry_after_ms, message, limited_at)) in &first_limited {
            let leader = a_leaders[*partition];
            eprintln!(
                "A's partition {partition} (led by node {leader}) refused: {reason}, retry \
                 after {retry_after_ms} ms: {message}"
            );
            assert_eq!(reason, "disk", "partition {partition}: {message}");
            assert!(
                *retry_after_ms >= 100,
                "partition {partition}: a retry hint: {retry_after_ms}"
            );
            if !message.contains("node 3") {
                unnamed.push(format!("partition {partition} (led by node {leader}): {message}"));
            }
            assert!(
                message.contains(&small.path().display().to_string()),
                "partition {partition}: the message names node 3's path: {message}"
            );
            match hard_at {
                Some(hard_at) => eprintln!(
                    "partition {partition}: node 3 at hard (its status, polled every 20 ms) to \
                     the first 429 as the client reports it (after its own retries within \
                     its 300 ms publish timeout): {} ms",
                    limited_at.saturating_duration_since(hard_at).as_millis()
                ),
                None => eprintln!(
                    "partition {partition}: its first 429 came before node 3's status showed \
                     hard"
                ),
            }
        }
        // The leaders with a replica on node 3 slow A's publishes at its soft level.
        let delayed: Vec<f64> = [1, 2]
            .iter()
            .map(|id| {
                support::metric(
                    cluster.nodes[id].http,
                    "keratin_publishes_limited_by_replica_total",
                    "decision=\"delayed\"",
                )
            })
            .collect();
        eprintln!("nodes 1 and 2 delayed {delayed:?} batches for node 3's soft level");
        assert!(
            delayed.iter().all(|n| *n > 0.0),
            "A's publishes were slowed on both leaders with a copy on node 3 before being \
             refused: {delayed:?}"
        );
        // Every node shows what fills node 3: node 1's status names A as the largest queue
        // on node 3's file system (from node 3's label; counted every 5 s there).
        let deadline = Instant::now() + PHASE_MAX;
        loop {
            let status = support::status(cluster.nodes[&1].http);
            let node3 = status["cluster"]["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|n| n["id"] == 3)
                .cloned()
                .unwrap_or_default();
            let largest = &node3["levels"]["filesystems"][0]["largest_queues"][0];
            if largest["queue"] == queue_a.as_str() && largest["bytes"].as_u64() > Some(64 << 20) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node 1 does not show A as node 3's largest queue: {node3}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // B while A is refused.
        let during = b_rate(&b_client, &queue_b, B_WINDOW, &mut b_seq).await;
        let ratio = during / before;
        eprintln!("B: {before:.0} msg/s before the fill, {during:.0} msg/s while A is refused: {ratio:.2}x");
        assert!(ratio >= 0.9, "B slowed to {ratio:.2}x of its rate before the fill");
        assert!(
            a_ledger.lock().expect("lock").limited > 0,
            "A is still refused while B was measured"
        );

        assert_no_log_stopped(&cluster);

        // Consume A: node 3 frees space and A's publisher is accepted again by itself.
        let delivered = Arc::new(Mutex::new(BTreeSet::new()));
        let c_stop = Arc::new(AtomicBool::new(false));
        let c_task = tokio::spawn(a_consumer(
            connect(node1, Duration::from_secs(10)).await,
            queue_a.clone(),
            delivered.clone(),
            c_stop.clone(),
        ));
        let deadline = Instant::now() + PHASE_MAX;
        loop {
            let resumed = a_ledger
                .lock()
                .expect("lock")
                .confirmed_after_limited_by_partition
                .clone();
            if resumed.len() == PARTITIONS as usize
                && resumed.values().all(|n| *n >= RESUMED_PER_PARTITION)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "A never resumed on every partition (confirms after the last refusal, by \
                 partition: {resumed:?}); node 3 at {:?}, {} delivered",
                disk_level(&cluster, 3),
                delivered.lock().expect("lock").len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        a_stop.store(true, Ordering::Relaxed);
        for task in a_tasks {
            task.await.expect("A's publisher");
        }
        // Every confirmed message of A is delivered.
        let confirmed = a_ledger.lock().expect("lock").confirmed.clone();
        wait_all_delivered(&confirmed, &delivered, "A").await;
        c_stop.store(true, Ordering::Relaxed);
        c_task.await.expect("A's consumer");
        let by_partition: Vec<usize> = (0..PARTITIONS as u64)
            .map(|p| confirmed.iter().filter(|seq| *seq % PARTITIONS as u64 == p).count())
            .collect();
        eprintln!(
            "A: {} confirmed ({by_partition:?} by partition), all delivered; {} refusals",
            confirmed.len(),
            a_ledger.lock().expect("lock").limited
        );
        assert!(
            unnamed.is_empty(),
            "refusals that do not name node 3: {unnamed:#?}"
        );
    });
}

/// Partition `index` of `queue` as node `id` sees it.
fn partition_on(
    cluster: &Cluster,
    id: u64,
    queue: &str,
    index: usize,
) -> Option<serde_json::Value> {
    cluster.partitions_seen_by(id, queue)?.get(index).cloned()
}

/// The in-sync set of each partition of `queue` as its leader in `leaders` (by partition) sees
/// it; `Null` where the leader does not answer.
fn in_sync_sets(cluster: &Cluster, queue: &str, leaders: &[u64]) -> Vec<serde_json::Value> {
    leaders
        .iter()
        .enumerate()
        .map(|(index, leader)| {
            partition_on(cluster, *leader, queue, index)
                .map(|p| p["in_sync"].clone())
                .unwrap_or_default()
        })
        .collect()
}

/// Node 3 filled from outside to its reserve level: it refuses new entries for the partitions
/// it follows and leaves their in-sync sets, while a queue of two partitions with three
/// replicas each, led by nodes 1 and 2, keeps confirming on the other two in both, and
/// consuming, acknowledging, purging, declaring and deleting keep working; once the filler is
/// removed it catches up and is back in sync in both partitions, holding what they committed
/// meanwhile. No log stops anywhere.
#[test]
fn a_follower_at_reserve_leaves_the_in_sync_set_and_catches_up_after() {
    if !support::privileged("a_follower_at_reserve_leaves_the_in_sync_set_and_catches_up_after") {
        return;
    }
    let (small, _tmpfs) = small_tmpfs();
    let cluster = start_cluster(small.path());
    runtime().block_on(async {
        let node1 = cluster.nodes[&1].protocol;
        let admin = connect(node1, Duration::from_secs(10)).await;
        let queue = "r".to_string();
        // Two partitions, led by nodes 1 and 2: node 3 follows both (a third would be led
        // by node 3, not a follower).
        let leaders = declare_pinned(&cluster, &admin, &queue, &[1, 2, 3], PARTITIONS - 1).await;
        eprintln!("queue {queue}, led by nodes {leaders:?} (by partition)");

        // A publisher that never stops confirming: small batches, as fast as they confirm.
        let ledger = Arc::new(Mutex::new(ALedger::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = tokio::spawn(small_publisher(
            connect(node1, Duration::from_secs(10)).await,
            queue.clone(),
            ledger.clone(),
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;

        // Fill node 3's tmpfs from outside to below its reserve level (10 % of 256 MiB).
        let (free, _) = support::free_and_total(small.path());
        let filler = small.path().join("filler");
        let keep = 12 << 20;
        let status = std::process::Command::new("fallocate")
            .args(["-l", &(free - keep).to_string()])
            .arg(&filler)
            .status()
            .expect("fallocate");
        assert!(status.success(), "fallocate");
        let filled = Instant::now();
        let deadline = filled + PHASE_MAX;
        while disk_level(&cluster, 3).as_deref() != Some("reserve") {
            assert!(Instant::now() < deadline, "node 3 never reached reserve");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // It leaves every partition's in-sync set (it falls behind) while the publishes keep
        // confirming.
        let confirmed_at_reserve = ledger.lock().expect("lock").confirmed.len();
        loop {
            let in_sync = in_sync_sets(&cluster, &queue, &leaders);
            let out = in_sync.iter().all(|set| {
                set.as_array().is_some_and(|set| {
                    !set.is_empty() && !set.contains(&serde_json::Value::from(3))
                })
            });
            if out {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node 3 never left every in-sync set (by partition): {in_sync:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let left = filled.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let confirmed_out = ledger.lock().expect("lock").confirmed.len();
        assert!(
            confirmed_out > confirmed_at_reserve,
            "publishes kept confirming on the other two ({confirmed_at_reserve} -> {confirmed_out})"
        );
        assert_eq!(
            ledger.lock().expect("lock").limited,
            0,
            "nothing was refused"
        );
        // Consuming, acknowledging, purging and metadata changes go on with the two nodes
        // that have room (a new queue of two replicas is placed on them).
        let mut consumer = admin.subscribe(&queue, 16).await.expect("subscribe");
        for _ in 0..16 {
            let delivery = tokio::time::timeout(PHASE_MAX, consumer.recv())
                .await
                .expect("a delivery in time")
                .expect("a delivery");
            delivery.ack().expect("ack while node 3 is at reserve");
        }
        drop(consumer);
        admin
            .purge(&queue)
            .await
            .expect("purge while node 3 is at reserve");
        let two = QueueSettings {
            replicas: Some(2),
            ..QueueSettings::default()
        };
        admin
            .declare("meta", two)
            .await
            .expect("declare while node 3 is at reserve");
        admin
            .delete("meta")
            .await
            .expect("delete while node 3 is at reserve");

        // The filler goes: node 3 catches up and is back in sync.
        std::fs::remove_file(&filler).expect("remove the filler");
        let freed = Instant::now();
        let deadline = freed + PHASE_MAX;
        loop {
            let in_sync = in_sync_sets(&cluster, &queue, &leaders);
            if in_sync.iter().all(|set| {
                set.as_array()
                    .is_some_and(|set| set.contains(&serde_json::Value::from(3)))
            }) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node 3 never came back in every in-sync set (by partition): {in_sync:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let back = freed.elapsed();
        stop.store(true, Ordering::Relaxed);
        publisher.await.expect("publisher");
        // Node 3 holds what the others confirmed meanwhile, in every partition.
        let mut offsets = Vec::new();
        for (index, leader) in leaders.iter().enumerate() {
            let leader_offset = partition_on(&cluster, *leader, &queue, index)
                .expect("leader's view")["committed_offset"]
                .as_u64()
                .expect("offset");
            let deadline = Instant::now() + PHASE_MAX;
            loop {
                let offset = partition_on(&cluster, 3, &queue, index)
                    .and_then(|p| p["committed_offset"].as_u64())
                    .unwrap_or(0);
                if offset >= leader_offset {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "partition {index}: node 3 at {offset} of {leader_offset}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            offsets.push(leader_offset);
        }
        assert_no_log_stopped(&cluster);
        eprintln!(
            "node 3 at reserve: out of every in-sync set {:.1} s after the fill, back {:.1} s \
             after the filler went; {} confirmed; node 3 holds committed offsets {offsets:?} (by \
             partition)",
            left.as_secs_f64(),
            back.as_secs_f64(),
            ledger.lock().expect("lock").confirmed.len()
        );
    });
}

/// Publishes small batches of 4 as fast as they confirm until `stop`; a refusal is counted.
async fn small_publisher(
    client: Client,
    queue: String,
    ledger: Arc<Mutex<ALedger>>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let first = {
            let mut ledger = ledger.lock().expect("lock");
            let first = ledger.next_seq;
            ledger.next_seq += 4;
            first
        };
        let batch: Vec<OutgoingMessage> = (first..first + 4)
            .map(|seq| OutgoingMessage::new(body(seq, B_BODY_BYTES)))
            .collect();
        for (seq, result) in (first..).zip(client.publish_batch(&queue, batch).await) {
            let mut ledger = ledger.lock().expect("lock");
            match result {
                Ok(_) => {
                    ledger.confirmed.insert(seq);
                }
                Err(failed) => {
                    ledger.limited += 1;
                    eprintln!("publish of {seq} failed: {}", failed.error);
                }
            }
        }
    }
}

/// Memory: node 3 runs in a 512 MiB cgroup v1 memory group (its limit comes from it). Queues
/// are placed while it is normal: A of 3 partitions with a copy on every node (led by nodes
/// 1, 2, 3), B of 3 partitions on nodes 1 and 2. Then its memory thresholds are lowered live
/// below its resident size (`keratin settings set` on node 3), which puts it at hard at its
/// next sample as load would. Every partition of A, node 3's own included, is refused with
/// `429 memory` naming node 3, while every partition of B keeps confirming; once the settings
/// are reset, every partition of A is accepted again.
#[test]
fn a_node_short_of_memory_limits_only_its_partitions() {
    let test = "a_node_short_of_memory_limits_only_its_partitions";
    if !support::memory_cgroups(test) {
        return;
    }
    let cgroup = support::MemoryCgroup::create(512 << 20);
    let (small, _tmpfs) = small_tmpfs();
    let cluster = start_cluster_in(small.path(), Some(cgroup.path.clone()));
    runtime().block_on(async {
        let node1 = cluster.nodes[&1].protocol;
        let admin = connect(node1, Duration::from_secs(10)).await;
        let (queue_a, queue_b) = ("a", "b");
        let a_leaders = declare_pinned(&cluster, &admin, queue_a, &[1, 2, 3], PARTITIONS).await;
        let b_leaders = declare_pinned(&cluster, &admin, queue_b, &[1, 2], PARTITIONS).await;
        eprintln!("A led by {a_leaders:?}, B led by {b_leaders:?} (by partition)");
        let keys = keys_by_partition(PARTITIONS);
        let limit = support::status(cluster.nodes[&3].http)["memory"]["limit_bytes"]
            .as_u64()
            .expect("limit");
        assert_eq!(limit, 512 << 20, "node 3 takes its limit from the cgroup");

        // Node 3's thresholds below its resident size (its own, not the cluster's): hard at
        // its next sample.
        let (ok, out) = cluster.cli(
            3,
            &[
                "settings",
                "set",
                "--node",
                "limits.memory.soft_fraction=0.002",
                "limits.memory.hard_fraction=0.003",
                "limits.memory.clear_margin_fraction=0.001",
            ],
        );
        assert!(ok, "settings set: {out}");
        let deadline = Instant::now() + PHASE_MAX;
        while support::status(cluster.nodes[&3].http)["memory"]["level"] != "hard" {
            assert!(Instant::now() < deadline, "node 3 never at memory hard");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // Every partition of A has a copy on node 3 (and node 3 leads one): each is refused.
        let client = connect(node1, Duration::from_millis(300)).await;
        let mut unnamed = Vec::new();
        for (partition, key) in keys.iter().enumerate() {
            let deadline = Instant::now() + PHASE_MAX;
            let refusal = loop {
                let message = OutgoingMessage::new(body(1, B_BODY_BYTES)).with_routing_key(key);
                match client.publish(queue_a, message).await {
                    Err(failed) => match failed.error {
                        ClientError::Limited {
                            reason, message, ..
                        } => break (reason.name().to_owned(), message),
                        other => panic!("A's publish to partition {partition}: {other}"),
                    },
                    Ok(_) => {
                        assert!(
                            Instant::now() < deadline,
                            "A's partition {partition} never refused"
                        );
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            };
            eprintln!(
                "A's partition {partition} (led by node {}) refused: {refusal:?}",
                a_leaders[partition]
            );
            assert_eq!(refusal.0, "memory", "partition {partition}: {}", refusal.1);
            if !refusal.1.contains("node 3") {
                unnamed.push(format!("partition {partition}: {}", refusal.1));
            }
        }
        assert!(
            unnamed.is_empty(),
            "refusals that do not name node 3: {unnamed:#?}"
        );
        for seq in 0..21 {
            let key = &keys[(seq % u64::from(PARTITIONS)) as usize];
            let message = OutgoingMessage::new(body(seq, B_BODY_BYTES)).with_routing_key(key);
            client
                .publish(queue_b, message)
                .await
                .unwrap_or_else(|failed| panic!("B is not limited: {}", failed.error));
        }

        let (ok, out) = cluster.cli(
            3,
            &[
                "settings",
                "reset",
                "--node",
                "limits.memory.soft_fraction",
                "limits.memory.hard_fraction",
                "limits.memory.clear_margin_fraction",
            ],
        );
        assert!(ok, "settings reset: {out}");
        for (partition, key) in keys.iter().enumerate() {
            let deadline = Instant::now() + PHASE_MAX;
            let message = || OutgoingMessage::new(body(2, B_BODY_BYTES)).with_routing_key(key);
            while client.publish(queue_a, message()).await.is_err() {
                assert!(
                    Instant::now() < deadline,
                    "A's partition {partition} never accepted again"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        assert_eq!(cgroup.oom_kills(), 0, "node 3 was never OOM-killed");
    });
}

/// Bytes of each partition of `queue` on node `id`'s disk, by partition (0 where it holds no
/// replica).
fn disk_bytes_on(cluster: &Cluster, id: u64, queue: &str) -> Option<Vec<u64>> {
    let http = cluster.nodes[&id].http;
    let text =
        std::panic::catch_unwind(|| support::http_get(http, &format!("/api/v1/queues/{queue}")))
            .ok()?;
    let document: serde_json::Value = serde_json::from_str(&text[text.find('{')?..]).ok()?;
    document["partitions"]
        .as_array()?
        .iter()
        .map(|p| p["disk_bytes"].as_u64())
        .collect()
}

/// Replicas move off the small node under load: queue A, 3 partitions pinned to nodes 1 and 3
/// (led by nodes 1, 3, 1), confirms publishes all along while `keratin queue move a
/// --partition P --from 3 --to 2 --wait 60` runs for each partition in turn (node 2 joins as a
/// learner, catches up, takes node 3's place; node 3's copy retires and its files go), node 3's
/// leadership of partition 1 included. Publishes keep confirming during every move, and every
/// confirmed message is delivered afterwards.
#[test]
fn a_replica_moves_off_the_small_node_under_load_and_nothing_is_lost() {
    if !support::privileged("a_replica_moves_off_the_small_node_under_load_and_nothing_is_lost") {
        return;
    }
    let (small, _tmpfs) = small_tmpfs();
    let cluster = start_cluster(small.path());
    runtime().block_on(async {
        let node1 = cluster.nodes[&1].protocol;
        let admin = connect(node1, Duration::from_secs(10)).await;
        let queue = "a".to_string();
        let leaders = declare_pinned(&cluster, &admin, &queue, &[1, 3], PARTITIONS).await;
        eprintln!("queue {queue}, led by nodes {leaders:?} (by partition)");

        let ledger = Arc::new(Mutex::new(ALedger::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = tokio::spawn(small_publisher(
            connect(node1, Duration::from_secs(10)).await,
            queue.clone(),
            ledger.clone(),
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let on_3 = disk_bytes_on(&cluster, 3, &queue).unwrap_or_default();
        assert!(
            on_3.len() == PARTITIONS as usize && on_3.iter().all(|bytes| *bytes > 0),
            "node 3 holds every partition's replica before the moves: {on_3:?}"
        );

        let mut took = Vec::new();
        let mut confirmed_during = Vec::new();
        for partition in 0..PARTITIONS {
            let confirmed_before = ledger.lock().expect("lock").confirmed.len();
            let started = Instant::now();
            let partition_text = partition.to_string();
            let (ok, out) = tokio::task::block_in_place(|| {
                cluster.cli(
                    1,
                    &[
                        "queue",
                        "move",
                        &queue,
                        "--partition",
                        &partition_text,
                        "--from",
                        "3",
                        "--to",
                        "2",
                        "--wait",
                        "60",
                    ],
                )
            });
            took.push(started.elapsed());
            eprintln!("{out}");
            assert!(ok, "queue move of partition {partition}: {out}");
            assert!(out.contains("node 2 holds the replica"), "{out}");
            let during = ledger.lock().expect("lock").confirmed.len() - confirmed_before;
            assert!(
                during > 0,
                "publishes confirmed while partition {partition}'s replica moved"
            );
            confirmed_during.push(during);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, Ordering::Relaxed);
        publisher.await.expect("publisher");

        // Every partition's replicas are 1 and 2 now, and node 3's copies are gone.
        for partition in 0..PARTITIONS as usize {
            let mut replicas: Vec<u64> = partition_on(&cluster, 1, &queue, partition)
                .expect("node 1's view")["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(serde_json::Value::as_u64)
                .collect();
            replicas.sort_unstable();
            assert_eq!(
                replicas,
                vec![1, 2],
                "partition {partition}: node 2 in node 3's place"
            );
        }
        let deadline = Instant::now() + PHASE_MAX;
        let gone = |bytes: Option<Vec<u64>>| bytes.is_some_and(|b| b.iter().all(|n| *n == 0));
        while !gone(disk_bytes_on(&cluster, 3, &queue)) {
            assert!(
                Instant::now() < deadline,
                "node 3 still holds {:?} bytes of A",
                disk_bytes_on(&cluster, 3, &queue)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // Every confirmed message is delivered.
        let delivered = Arc::new(Mutex::new(BTreeSet::new()));
        let c_stop = Arc::new(AtomicBool::new(false));
        let consumer = tokio::spawn(a_consumer(
            connect(node1, Duration::from_secs(10)).await,
            queue.clone(),
            delivered.clone(),
            c_stop.clone(),
        ));
        let confirmed = ledger.lock().expect("lock").confirmed.clone();
        wait_all_delivered(&confirmed, &delivered, "A").await;
        c_stop.store(true, Ordering::Relaxed);
        consumer.await.expect("consumer");
        assert_no_log_stopped(&cluster);
        let failed = ledger.lock().expect("lock").limited;
        eprintln!(
            "moves off node 3 under load, by partition: {took:?}; {confirmed_during:?} confirmed \
             during them, {} in all, all delivered; {failed} publishes failed (retried by \
             nobody: not confirmed)",
            confirmed.len()
        );
    });
}
