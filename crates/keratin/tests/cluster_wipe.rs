//! A replica whose data directory is wiped never costs a confirmed message, and is replaced:
//! three real `keratin serve` processes, a queue of 2 partitions with 3 replicas each.
//!
//! 1. Node C, which leads no partition, is paused (`SIGSTOP`); the other two, A (the leader of
//!    partition 0) and B, confirm [`MESSAGES`] publishes without it.
//! 2. B is killed (`kill -9`) and its whole data directory removed (a replaced disk); A is
//!    killed too. B restarts empty and C resumes (`SIGCONT`): of the copies that hold the
//!    confirmed messages only A's is left, and A is down.
//! 3. After [`ALONE`], A restarts.
//!
//! **Every confirmed message is delivered** (consumers on every node, since a node delivers the
//! partitions it leads). Without storage identities B's empty copy votes as its old self at
//! once: C, which lags by every message, is elected with B's vote and A's copy is cut back when
//! it returns (4,964 of 5,000 lost in the run that found it). The group must instead wait for
//! A: unavailable, never lossy.
//!
//! Then **B is whole again**: the leaders replace its copy (removed as a voter, added back as a
//! learner with its new identity, caught up, promoted), so every partition's leader counts B
//! among its in-sync voters and B's own copy holds every confirmed message (its `ready`
//! counts, read before anything is consumed).
//!
//! Bounded: every wait has a deadline (60 s at most); the test takes about a minute.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::cluster::Cluster;
use support::{body, seq_of};

const QUEUE: &str = "wiped";
const PARTITIONS: u32 = 2;
/// Messages confirmed while C is paused.
const MESSAGES: u64 = 5_000;
const BATCH: u64 = 100;
const BODY_BYTES: usize = 128;
/// The idempotent producer the publishes go as (a retry after a lost answer is stored once).
const PRODUCER_ID: u64 = 0x7769_7065_6400_0001;
/// How long B and C run without A.
const ALONE: Duration = Duration::from_secs(6);
/// Waits for the cluster (a leader, a declare, a replaced copy) end after this.
const WAIT_MAX: Duration = Duration::from_secs(60);

async fn connect(addr: SocketAddr) -> Option<Client> {
    let options = ClientOptions {
        publish_timeout: Duration::from_secs(10),
        producer_id: Some(PRODUCER_ID),
        ..ClientOptions::default()
    };
    Client::connect(addr, options).await.ok()
}

/// Publish `MESSAGES` numbered messages through node `via`, in batches, resending what was not
/// confirmed (the idempotent producer stores a resend once); the confirmed sequence numbers.
async fn publish(via: SocketAddr) -> BTreeSet<u64> {
    let mut confirmed = BTreeSet::new();
    let deadline = Instant::now() + WAIT_MAX;
    let mut client = None;
    let mut next = 0;
    while next < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "only {} of {MESSAGES} confirmed within {WAIT_MAX:?}",
            confirmed.len()
        );
        if client.is_none() {
            client = connect(via).await;
        }
        let Some(c) = client.as_ref() else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let seqs: Vec<u64> = (next..(next + BATCH).min(MESSAGES)).collect();
        let messages = seqs
            .iter()
            .map(|seq| OutgoingMessage::new(body(*seq, BODY_BYTES)).with_sequence(seq + 1))
            .collect();
        let results = c.publish_batch(QUEUE, messages).await;
        let mut all = true;
        for (seq, result) in seqs.iter().zip(results) {
            match result {
                Ok(_) => {
                    confirmed.insert(*seq);
                }
                Err(error) => {
                    all = false;
                    eprintln!("publish {seq}: {}", error.error);
                }
            }
        }
        if all {
            next += BATCH;
        } else {
            client = None;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    confirmed
}

/// Consume and ack on every node until every sequence of `wanted` arrived or `WAIT_MAX`
/// passed; the distinct sequence numbers delivered.
async fn drain(addrs: Vec<SocketAddr>, wanted: &BTreeSet<u64>) -> BTreeSet<u64> {
    let (sender, mut deliveries) = tokio::sync::mpsc::unbounded_channel();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for addr in addrs {
        let sender = sender.clone();
        let stop = stop.clone();
        // A node delivers the partitions it leads: one consumer per node, subscribing again
        // when its subscription ends (a leader change).
        tasks.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Some(client) = connect(addr).await else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                let Ok(mut consumer) = client.subscribe(QUEUE, 256).await else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                loop {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    let next =
                        tokio::time::timeout(Duration::from_millis(300), consumer.recv()).await;
                    match next {
                        Ok(Some(delivery)) => {
                            let _ = sender.send(seq_of(&delivery.body));
                            let _ = delivery.ack();
                        }
                        Ok(None) => break,
                        Err(_) => {}
                    }
                }
            }
        }));
    }
    drop(sender);
    let mut delivered = BTreeSet::new();
    let mut bad = 0u64;
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    while !wanted.is_subset(&delivered) {
        match tokio::time::timeout_at(deadline, deliveries.recv()).await {
            Ok(Some(Some(seq))) => {
                delivered.insert(seq);
            }
            Ok(Some(None)) => bad += 1,
            Ok(None) | Err(_) => break,
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    assert_eq!(bad, 0, "bodies with a bad checksum");
    delivered
}

/// Waits until every partition's leader counts node `id` among its in-sync voters and node
/// `id`'s own copy holds `count` ready messages; how long that took, or what was seen last.
fn wait_whole(cluster: &Cluster, running: &[u64], id: u64, count: u64) -> Result<Duration, String> {
    let started = Instant::now();
    let deadline = started + WAIT_MAX;
    loop {
        let leaders: Vec<Option<Vec<serde_json::Value>>> = running
            .iter()
            .map(|n| cluster.partitions_seen_by(*n, QUEUE))
            .collect();
        let in_sync = (0..PARTITIONS as usize).all(|i| {
            leaders.iter().flatten().any(|view| {
                view.get(i).is_some_and(|p| {
                    p["leading"] == true
                        && p["in_sync"]
                            .as_array()
                            .is_some_and(|set| set.contains(&serde_json::Value::from(id)))
                })
            })
        });
        let own = cluster.partitions_seen_by(id, QUEUE);
        let ready: u64 = own
            .iter()
            .flatten()
            .map(|p| p["ready"].as_u64().unwrap_or(0))
            .sum();
        if in_sync && ready == count {
            return Ok(started.elapsed());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "after {WAIT_MAX:?}: node {id} in every leader's in-sync set: {in_sync}; its \
                 copy holds {ready} of {count} ready messages; the leaders see {leaders:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_wiped_replica_costs_no_confirmed_message_and_is_replaced() {
    let mut cluster = Cluster::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let all: Vec<u64> = vec![1, 2, 3];
    runtime.block_on(async {
        let deadline = Instant::now() + WAIT_MAX;
        loop {
            if let Some(client) = connect(cluster.nodes[&1].protocol).await {
                let settings = QueueSettings {
                    partitions: PARTITIONS,
                    replicas: Some(3),
                    ..QueueSettings::default()
                };
                match client.declare(QUEUE, settings).await {
                    Ok(()) => break,
                    Err(error) => eprintln!("declare: {error}"),
                }
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never took the declare"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let leaders = cluster.wait_leaders(QUEUE, "agreed leaders", WAIT_MAX, |_| true);
    // C leads nothing (two partitions, three nodes); A leads partition 0; B is the third.
    let c = *all
        .iter()
        .find(|id| !leaders.contains(id))
        .expect("a node that leads no partition");
    let a = leaders[0];
    let b = *all.iter().find(|id| **id != a && **id != c).expect("B");
    println!("leaders by partition {leaders:?}: A = node {a}, B = node {b}, C = node {c} (paused)");

    cluster.signal(c, "-STOP");
    let confirmed = runtime.block_on(publish(cluster.nodes[&a].protocol));
    assert_eq!(confirmed.len() as u64, MESSAGES);
    println!(
        "{} confirmed by A and B while C was paused",
        confirmed.len()
    );

    cluster.kill9(b);
    std::fs::remove_dir_all(&cluster.nodes[&b].dir).expect("wipe B's data directory");
    cluster.kill9(a);
    cluster.start_node(b);
    cluster.signal(c, "-CONT");
    std::thread::sleep(ALONE);
    cluster.start_node(a);

    let leaders = cluster.wait_leaders(QUEUE, "agreed leaders", WAIT_MAX, |_| true);
    println!("with A back, leaders by partition {leaders:?}");
    let whole = wait_whole(&cluster, &all, b, MESSAGES);
    let addrs: Vec<SocketAddr> = all.iter().map(|id| cluster.nodes[id].protocol).collect();
    let delivered = runtime.block_on(drain(addrs, &confirmed));
    let lost: Vec<u64> = confirmed.difference(&delivered).copied().collect();
    assert!(
        lost.is_empty(),
        "{} of {} confirmed messages lost (first: {:?})",
        lost.len(),
        confirmed.len(),
        &lost[..lost.len().min(10)]
    );
    let whole = whole.unwrap_or_else(|seen| panic!("node {b}'s copy was not replaced: {seen}"));
    println!("node {b} (wiped) in sync with every message {whole:?} after A's leaders agreed");
}

/// The files under `dir`, recursively.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The queue names node `id`'s cluster document lists.
fn queues_seen_by(cluster: &Cluster, id: u64) -> BTreeSet<String> {
    cluster
        .cluster_document(id)
        .and_then(|doc| doc["queues"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|q| q["name"].as_str().map(str::to_string))
        .collect()
}

/// A node whose copy of the cluster metadata is damaged (one flipped bit in a durable record of
/// its entries log, with records after it) still starts: the copy is moved to
/// `<storage>/damaged/cluster-meta-<ms>`, an empty one takes its place and is rebuilt from the
/// other nodes, so the node learns the queues declared before and while it was down, and it
/// raises `damaged_copies` until the operator removes the moved copy. Failed before with the
/// node refusing to start (`... checksum mismatch ... reported durable ...`).
#[test]
fn a_node_whose_cluster_metadata_is_damaged_starts_and_catches_up() {
    const MARKER: &str = "marker-queue-whose-record-is-damaged";
    let mut cluster = Cluster::start();
    let mut before: BTreeSet<String> = [MARKER.to_string()].into();
    cluster.cli_until_ok(1, &["queue", "declare", MARKER], WAIT_MAX);
    for n in 0..3 {
        let name = format!("after-marker-{n}");
        cluster.cli_until_ok(1, &["queue", "declare", &name], WAIT_MAX);
        before.insert(name);
    }
    let deadline = Instant::now() + WAIT_MAX;
    while !queues_seen_by(&cluster, 3).is_superset(&before) {
        assert!(Instant::now() < deadline, "node 3 never applied {before:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    cluster.kill9(3);
    let meta = cluster.nodes[&3].dir.join("cluster-meta");
    let flipped = files_under(&meta).into_iter().any(|file| {
        if !file.to_string_lossy().contains("entries") {
            return false;
        }
        let mut bytes = std::fs::read(&file).expect("read");
        let Some(at) = bytes
            .windows(MARKER.len())
            .position(|w| w == MARKER.as_bytes())
        else {
            return false;
        };
        bytes[at + MARKER.len() / 2] ^= 0x04;
        std::fs::write(&file, bytes).expect("write");
        true
    });
    assert!(
        flipped,
        "no entries file under {} holds {MARKER}",
        meta.display()
    );
    cluster.cli_until_ok(1, &["queue", "declare", "while-down"], WAIT_MAX);
    before.insert("while-down".to_string());

    cluster.start_node(3);
    let deadline = Instant::now() + WAIT_MAX;
    loop {
        let seen = queues_seen_by(&cluster, 3);
        if seen.is_superset(&before) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 3 lacks {:?} after its start",
            before.difference(&seen).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let damaged = cluster.nodes[&3].dir.join("damaged");
    let moved: Vec<String> = std::fs::read_dir(&damaged)
        .expect("a damaged directory")
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        matches!(&moved[..], [name] if name.starts_with("cluster-meta-")),
        "{moved:?}"
    );
    let http = cluster.nodes[&3].http;
    let raised = |active_only: bool| {
        let text = support::http_get(http, "/api/v1/attention");
        let doc: serde_json::Value =
            serde_json::from_str(&text[text.find('{').expect("json")..]).expect("json");
        doc["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .any(|item| {
                item["kind"] == "damaged_copies" && (!active_only || item["active"] == true)
            })
    };
    let deadline = Instant::now() + WAIT_MAX;
    while !raised(true) {
        assert!(
            Instant::now() < deadline,
            "no damaged_copies item on node 3"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A declare through node 3 works: it is a full member again.
    cluster.cli_until_ok(3, &["queue", "declare", "through-node-3"], WAIT_MAX);
}
