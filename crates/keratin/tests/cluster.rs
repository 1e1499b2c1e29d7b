//! Three real `keratin serve` processes on 127.0.0.1 form a cluster; a replicated queue
//! (3 replicas) takes confirmed publishes and acking consumers while nodes are killed, in
//! rounds:
//! 1. `kill -9` the partition's leader (and restart it): the failover time — from the kill to
//!    the first publish confirmed after it — is measured and printed;
//! 2. `SIGSTOP` a follower for 10 s, then `SIGCONT`;
//! 3. `kill -9` two nodes at once (no majority: publishes wait), then restart both.
//!
//! Clients connect to any node and follow "not the leader" answers; the test's publisher and
//! consumer reconnect to another node when theirs dies. After each round it checks, and at
//! the end after draining the queue: **every confirmed message is delivered at least once**,
//! **no acked message is delivered again as new** (`redelivered == false` after its ack was
//! confirmed... acks are fire-and-forget, so a message acked just before a kill may come back,
//! but then flagged `redelivered`), and every body carries a valid checksum and a sequence
//! number that was published. Duplicates of a publish retried after an unknown outcome are
//! not allowed: the publisher is an idempotent producer (one producer id over all its
//! reconnections, the sequence number as its sequence), so **no message is delivered twice as
//! new**; redeliveries of unacked messages after a leader change are flagged `redelivered`.
//!
//! Bounded: each round waits at most 30 s for the cluster to serve again; the whole test
//! takes about a minute. Processes are killed by PID when dropped.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::{body, seq_of, Server};

const QUEUE: &str = "orders";
/// The test publisher's idempotent producer id.
const PRODUCER_ID: u64 = 0x6b65_7261_7469_6e31;
const BODY_BYTES: usize = 256;
const BATCH: u64 = 50;
/// A round's cluster must serve again within this.
const RECOVERY_MAX: Duration = Duration::from_secs(30);

/// One node's fixed addresses and its process while it runs.
struct Node {
    id: u64,
    protocol: SocketAddr,
    http: SocketAddr,
    cluster: SocketAddr,
    dir: PathBuf,
    server: Option<Server>,
}

struct Cluster {
    nodes: BTreeMap<u64, Node>,
    _root: tempfile::TempDir,
}

/// A free port on 127.0.0.1 (bound and released: another process could take it meanwhile,
/// which makes the node fail to start with a clear message).
fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address")
}

impl Cluster {
    fn start() -> Cluster {
        let root = tempfile::tempdir().expect("tempdir");
        let mut nodes = BTreeMap::new();
        for id in 1..=3u64 {
            nodes.insert(
                id,
                Node {
                    id,
                    protocol: free_addr(),
                    http: free_addr(),
                    cluster: free_addr(),
                    dir: root.path().join(format!("node-{id}")),
                    server: None,
                },
            );
        }
        let mut cluster = Cluster { nodes, _root: root };
        for id in 1..=3 {
            cluster.start_node(id);
        }
        cluster
    }

    fn start_node(&mut self, id: u64) {
        let peers: Vec<String> = self
            .nodes
            .values()
            .map(|n| format!("{}={}", n.id, n.cluster))
            .collect();
        let node = self.nodes.get_mut(&id).expect("node");
        let dir = node.dir.to_string_lossy().into_owned();
        let (protocol, http, id_text) = (
            node.protocol.to_string(),
            node.http.to_string(),
            id.to_string(),
        );
        let mut args: Vec<&str> = vec![
            "serve",
            "--data-dir",
            &dir,
            "--listen",
            &protocol,
            "--http",
            &http,
            "--node-id",
            &id_text,
        ];
        for peer in &peers {
            args.push("--peer");
            args.push(peer);
        }
        node.server = Some(Server::start(&args));
    }

    fn kill9(&mut self, id: u64) {
        if let Some(mut server) = self.nodes.get_mut(&id).and_then(|n| n.server.take()) {
            server.kill9();
        }
    }

    fn signal(&self, id: u64, signal: &str) {
        let pid = self.nodes[&id].server.as_ref().expect("running").pid;
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    fn live(&self) -> Vec<SocketAddr> {
        self.nodes
            .values()
            .filter(|n| n.server.is_some())
            .map(|n| n.protocol)
            .collect()
    }

    /// The node leading the queue's partition, as the nodes' cluster documents say.
    fn leader(&self) -> Option<u64> {
        for node in self.nodes.values().filter(|n| n.server.is_some()) {
            let Ok(text) =
                std::panic::catch_unwind(|| support::http_get(node.http, "/api/v1/cluster"))
            else {
                continue;
            };
            let Some(json) = text.find('{').map(|at| &text[at..]) else {
                continue;
            };
            let Ok(document) = serde_json::from_str::<serde_json::Value>(json) else {
                continue;
            };
            let leads = document["queues"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|q| q["name"] == QUEUE)
                .flat_map(|q| q["partitions"].as_array().cloned().unwrap_or_default())
                .any(|p| p["leading"].as_bool() == Some(true));
            if leads {
                return Some(node.id);
            }
        }
        None
    }
}

/// What the load saw: confirmed and acked sequence numbers, deliveries.
#[derive(Default)]
struct Ledger {
    confirmed: BTreeSet<u64>,
    /// Confirm times, to measure failover.
    confirm_times: Vec<Instant>,
    acked: BTreeSet<u64>,
    /// Deliveries of a message after its ack was sent, not flagged redelivered.
    acked_then_new: Vec<u64>,
    delivered: BTreeMap<u64, u32>,
    /// Deliveries not flagged redelivered, per sequence number: with an idempotent producer a
    /// message is stored once, so at most one.
    delivered_new: BTreeMap<u64, u32>,
    bad_bodies: u64,
    publish_retries: u64,
    /// Sequence numbers published again after a failed attempt (the idempotent producer
    /// stores them once all the same).
    retried: BTreeSet<u64>,
}

async fn connect_any(addrs: &[SocketAddr], start: usize) -> Option<Client> {
    for k in 0..addrs.len() {
        let addr = addrs[(start + k) % addrs.len()];
        let options = ClientOptions {
            publish_timeout: Duration::from_secs(5),
            // One idempotent producer over every reconnection, numbering its messages by
            // their sequence numbers: a retry after a lost answer is stored once.
            producer_id: Some(PRODUCER_ID),
            ..ClientOptions::default()
        };
        if let Ok(client) = Client::connect(addr, options).await {
            return Some(client);
        }
    }
    None
}

/// Publish batches of numbered bodies until `stop`, reconnecting to another node on failure
/// and publishing again what was not confirmed.
async fn publisher(
    addrs: Arc<Mutex<Vec<SocketAddr>>>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut next = 0u64;
    let mut turn = 0usize;
    let mut client: Option<Client> = None;
    let mut unconfirmed: Vec<u64> = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if client.is_none() {
            let list = addrs.lock().expect("lock").clone();
            turn += 1;
            client = connect_any(&list, turn).await;
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        }
        let Some(c) = client.as_ref() else { continue };
        if unconfirmed.is_empty() {
            unconfirmed = (next..next + BATCH).collect();
            next += BATCH;
        }
        let messages: Vec<OutgoingMessage> = unconfirmed
            .iter()
            .map(|seq| OutgoingMessage::new(body(*seq, BODY_BYTES)).with_sequence(*seq + 1))
            .collect();
        let results = c.publish_batch(QUEUE, messages).await;
        let mut failed = Vec::new();
        let mut lost = false;
        {
            let mut ledger = ledger.lock().expect("lock");
            for (seq, result) in unconfirmed.iter().zip(results) {
                match result {
                    Ok(_) => {
                        ledger.confirmed.insert(*seq);
                        ledger.confirm_times.push(Instant::now());
                    }
                    Err(_) => failed.push(*seq),
                }
            }
            if !failed.is_empty() {
                ledger.publish_retries += failed.len() as u64;
                ledger.retried.extend(failed.iter().copied());
                lost = true;
            }
        }
        unconfirmed = failed;
        if lost {
            client = None;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Consume and ack until `stop`, resubscribing elsewhere when the stream ends.
async fn consumer(
    addrs: Arc<Mutex<Vec<SocketAddr>>>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut turn = 7usize;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let list = addrs.lock().expect("lock").clone();
        turn += 1;
        let Some(client) = connect_any(&list, turn).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(mut consumer) = client.subscribe(QUEUE, 64).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        loop {
            let next = tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await;
            let delivery = match next {
                Ok(Some(delivery)) => delivery,
                Ok(None) => break,
                Err(_) => {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    continue;
                }
            };
            let mut ledger = ledger.lock().expect("lock");
            match seq_of(&delivery.body) {
                Some(seq) => {
                    *ledger.delivered.entry(seq).or_default() += 1;
                    if !delivery.redelivered {
                        *ledger.delivered_new.entry(seq).or_default() += 1;
                    }
                    if ledger.acked.contains(&seq) && !delivery.redelivered {
                        ledger.acked_then_new.push(seq);
                    }
                    if delivery.ack().is_ok() {
                        ledger.acked.insert(seq);
                    }
                }
                None => ledger.bad_bodies += 1,
            }
        }
    }
}

/// Waits until a publish is confirmed after `since`; how long that took.
fn wait_confirm_after(ledger: &Mutex<Ledger>, since: Instant) -> Duration {
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let first = ledger
            .lock()
            .expect("lock")
            .confirm_times
            .iter()
            .find(|t| **t > since)
            .copied();
        if let Some(at) = first {
            return at - since;
        }
        assert!(
            Instant::now() < deadline,
            "no publish confirmed within {RECOVERY_MAX:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check(ledger: &Ledger, round: &str) {
    let confirmed = ledger.confirmed.len();
    let delivered = ledger.delivered.len();
    let duplicates: u32 = ledger.delivered.values().map(|n| n - 1).sum();
    println!(
        "{round}: confirmed {confirmed}, distinct delivered {delivered}, acked {}, duplicate \
         deliveries {duplicates}, publish retries {}",
        ledger.acked.len(),
        ledger.publish_retries
    );
    assert_eq!(ledger.bad_bodies, 0, "{round}: bodies with a bad checksum");
    let stored_twice: Vec<u64> = ledger
        .delivered_new
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(seq, _)| *seq)
        .take(10)
        .collect();
    assert!(
        stored_twice.is_empty(),
        "{round}: messages of the idempotent producer delivered as new twice: {stored_twice:?}"
    );
    assert!(
        ledger.acked_then_new.is_empty(),
        "{round}: acked messages delivered again as new: {:?}",
        &ledger.acked_then_new[..ledger.acked_then_new.len().min(10)]
    );
}

#[test]
fn confirmed_messages_survive_leader_kills_pauses_and_lost_majorities() {
    let mut cluster = Cluster::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let addrs = Arc::new(Mutex::new(cluster.live()));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // Declare on node 2: the metadata group takes it wherever it is led.
    runtime.block_on(async {
        let deadline = Instant::now() + RECOVERY_MAX;
        loop {
            let client = connect_any(&[cluster.nodes[&2].protocol], 0).await;
            let settings = QueueSettings::default();
            if let Some(client) = client {
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
    let tasks = [
        runtime.spawn(publisher(addrs.clone(), ledger.clone(), stop.clone())),
        runtime.spawn(consumer(addrs.clone(), ledger.clone(), stop.clone())),
    ];
    let load_started = Instant::now();
    wait_confirm_after(&ledger, load_started);
    std::thread::sleep(Duration::from_secs(2));

    // Round 1: kill -9 the leader.
    let leader = cluster.leader().expect("a leader");
    let killed_at = Instant::now();
    cluster.kill9(leader);
    *addrs.lock().expect("lock") = cluster.live();
    let failover = wait_confirm_after(&ledger, killed_at);
    println!("round 1: leader node {leader} killed; failover (kill to first confirm) {failover:?}");
    cluster.start_node(leader);
    *addrs.lock().expect("lock") = cluster.live();
    std::thread::sleep(Duration::from_secs(2));
    check(&ledger.lock().expect("lock"), "round 1");

    // Round 2: SIGSTOP a follower for 10 s.
    let leader = cluster.leader().expect("a leader");
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    cluster.signal(follower, "-STOP");
    let paused_at = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    cluster.signal(follower, "-CONT");
    let confirmed_while_paused = ledger
        .lock()
        .expect("lock")
        .confirm_times
        .iter()
        .filter(|t| **t > paused_at)
        .count();
    println!("round 2: follower node {follower} stopped 10 s; {confirmed_while_paused} confirmed meanwhile");
    check(&ledger.lock().expect("lock"), "round 2");

    // Round 3: kill -9 two nodes, restart them.
    let survivors: Vec<u64> = vec![1, 3];
    for id in &survivors {
        cluster.kill9(*id);
    }
    *addrs.lock().expect("lock") = cluster.live();
    std::thread::sleep(Duration::from_secs(1));
    let restarted_at = Instant::now();
    for id in &survivors {
        cluster.start_node(*id);
    }
    *addrs.lock().expect("lock") = cluster.live();
    let back = wait_confirm_after(&ledger, restarted_at);
    println!(
        "round 3: nodes 1 and 3 killed and restarted; serving again {back:?} after the restart"
    );
    std::thread::sleep(Duration::from_secs(2));

    // Drain: stop publishing, let the consumer take everything, then check.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    runtime.block_on(async {
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    });
    let drain_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drain = runtime.spawn(consumer(addrs.clone(), ledger.clone(), drain_stop.clone()));
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let missing = {
            let ledger = ledger.lock().expect("lock");
            ledger
                .confirmed
                .iter()
                .filter(|seq| !ledger.delivered.contains_key(seq))
                .count()
        };
        if missing == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{missing} confirmed messages never delivered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drain_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    runtime.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(5), drain).await;
    });
    let ledger = ledger.lock().expect("lock");
    check(&ledger, "drained");
    let published_max = ledger.confirmed.iter().max().copied().unwrap_or(0) + BATCH;
    assert!(
        ledger.delivered.keys().all(|seq| *seq < published_max),
        "a delivered sequence number was never published"
    );
    println!("failover {:.2} s", failover.as_secs_f64());
}
