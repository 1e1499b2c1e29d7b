//! Three real `keratin serve` processes on 127.0.0.1 form a cluster with leader balancing on;
//! a replicated queue of 3 partitions (3 replicas each), whose leaders the declare spreads
//! over the three nodes, takes confirmed publishes and acking consumers while nodes are
//! killed, in rounds. Each round's victim leads a partition (the test waits, between rounds,
//! until balancing has spread the leaders over the three nodes again), and a failover time is
//! that of the victim's partitions: from the fault to their first confirm of a publish sent
//! after it (a confirm of an earlier publish can still arrive just after the fault; the
//! partitions the victim did not lead confirm at once). The publisher's messages have no
//! routing key and its idempotent producer numbers them, so each one's partition is known:
//! `(producer id + sequence / 64) mod 3`, as the client and the broker route it.
//! 1. `kill -9` the leader of partition 0 (and restart it);
//! 2. `SIGSTOP` the leader of partition 1 for 10 s, then `SIGCONT`: its partition fails over,
//!    and it is a paused follower of the two others; every partition confirms meanwhile;
//! 3. `kill -9` nodes 1 and 3 at once (no majority: publishes wait), then restart both;
//!    every partition confirms again;
//! 5. (listed after 4, runs last) wipe the data directory of a node that follows partition 2
//!    and restart it (it rebuilds every partition from the leaders' snapshots and logs); then
//!    kill the other follower of partition 2 (every partition's confirms need the rebuilt
//!    one), restart it, and kill partition 2's leader (the two others elect leaders for what
//!    it led);
//! 4. (root and iptables only) cut the leader of partition 2 off the other two nodes: iptables
//!    rules on loopback drop every packet between cluster ports except the two others'
//!    connection, for at least 5 s and until the others serve; then the exact rules are
//!    deleted. A raw protocol probe connected only to the cut node (it follows no redirect; the
//!    node routes its keyless publishes to the partitions it leads) publishes every 200 ms
//!    from before the cut to the heal: it must see confirms before the cut, and **no publish
//!    sent after the cut is ever confirmed or delivered** (a minority leader cannot commit).
//!    The failover figure is that of the cut node's partitions. Without root the round is
//!    skipped loudly, and fails the test under `KERATIN_REQUIRE_PRIVILEGED_TESTS=1`.
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
//! Confirmed and delivered messages are counted per partition; a confirmed message never
//! delivered is reported with its partition.
//!
//! Bounded: each round waits at most 30 s for the cluster to serve again (and for the leaders
//! to spread); the whole test takes about a minute. Processes are killed by PID when dropped, iptables rules deleted by
//! their exact spec when dropped.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_client::proto::{
    ClientHello, ErrorFrame, Frame, FrameStatus, Publish, PublishMode, ServerHello,
    FRAME_SIZE_BYTES_MAX,
};
use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::cluster::Cluster;
use support::{body, seq_of, with_buffer, IptablesRules};

const QUEUE: &str = "orders";
/// The queue's partitions, their leaders on three different nodes.
const PARTITIONS: usize = 3;
/// The test publisher's idempotent producer id.
const PRODUCER_ID: u64 = 0x6b65_7261_7469_6e31;
const BODY_BYTES: usize = 256;
const BATCH: u64 = 50;
/// A round's cluster must serve again within this.
const RECOVERY_MAX: Duration = Duration::from_secs(30);
/// The network cut lasts at least this long (and until the others serve).
const CUT_MIN: Duration = Duration::from_secs(5);
/// The probe's bodies carry sequence numbers from here on, apart from the publisher's.
const PROBE_BASE: u64 = 1 << 40;
/// The probe publishes one message this often.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// After it stops publishing, the probe still reads answers this long.
const PROBE_LINGER: Duration = Duration::from_secs(3);
/// The probe's thread ends after this whatever happens.
const PROBE_RUN_MAX: Duration = Duration::from_secs(120);

impl Cluster {
    /// The leader of each of the queue's partitions, by index, once the running nodes agree
    /// (an election may still be settling), for [`RECOVERY_MAX`] at most.
    fn wait_queue_leaders(&self) -> Vec<u64> {
        self.wait_leaders(QUEUE, "agreed leaders", RECOVERY_MAX, |_| true)
    }

    /// Waits until the queue's partitions are led by three different nodes (leader balancing
    /// hands a partition back to its preferred leader once that node is back and the
    /// partition's current leader has led it a while), for [`RECOVERY_MAX`] at most; how long
    /// that took.
    fn wait_spread(&self) -> Duration {
        let started = Instant::now();
        self.wait_leaders(
            QUEUE,
            "leaders on three nodes",
            RECOVERY_MAX,
            support::cluster::spread,
        );
        started.elapsed()
    }

    /// The partitions of the queue that node `id` says it leads.
    fn led_by(&self, id: u64) -> Vec<usize> {
        self.partitions_seen_by(id, QUEUE)
            .unwrap_or_default()
            .iter()
            .enumerate()
            .filter(|(_, p)| p["leading"] == true)
            .map(|(index, _)| index)
            .collect()
    }

    /// Wait until node `id` names a leader of each of the queue's partitions (its replicas
    /// run and hear their leaders), for [`RECOVERY_MAX`] at most.
    fn wait_knows_leader(&self, id: u64) {
        let deadline = Instant::now() + RECOVERY_MAX;
        loop {
            let knows = self.partitions_seen_by(id, QUEUE).is_some_and(|ps| {
                ps.len() == PARTITIONS && ps.iter().all(|p| p["leader"].as_u64().is_some())
            });
            if knows {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} names no leader: {:?}",
                self.cluster_document(id)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait until each partition's leader counts node `id` in the partition's in-sync set,
    /// for [`RECOVERY_MAX`] at most.
    fn wait_in_sync(&self, id: u64) {
        let deadline = Instant::now() + RECOVERY_MAX;
        loop {
            let views: Vec<(u64, Option<serde_json::Value>)> = self
                .leaders(QUEUE)
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(index, leader)| {
                    let seen = self.partitions_seen_by(*leader, QUEUE);
                    (*leader, seen.and_then(|ps| ps.get(index).cloned()))
                })
                .collect();
            let synced = views.len() == PARTITIONS
                && views.iter().all(|(_, p)| {
                    p.as_ref().is_some_and(|p| {
                        p["in_sync"]
                            .as_array()
                            .is_some_and(|set| set.contains(&serde_json::Value::from(id)))
                    })
                });
            if synced {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the leaders never all counted node {id} in sync: {views:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every node reaches every other, all name the same leader of each of the
    /// queue's partitions, and only that leader says it leads; how long that took.
    fn wait_converged(&self) -> Duration {
        let started = Instant::now();
        let deadline = started + RECOVERY_MAX;
        loop {
            let mut views = Vec::new();
            for id in self.nodes.keys() {
                let Some(document) = self.cluster_document(*id) else {
                    break;
                };
                let reaches_all = document["nodes"]
                    .as_array()
                    .is_some_and(|ns| ns.len() == 3 && ns.iter().all(|n| n["reachable"] == true));
                let partitions = self.partitions_seen_by(*id, QUEUE).unwrap_or_default();
                views.push((*id, reaches_all, partitions));
            }
            let converged = views.len() == 3
                && views
                    .iter()
                    .all(|(_, reaches_all, ps)| *reaches_all && !ps.is_empty())
                && (0..views[0].2.len()).all(|i| {
                    let leader = &views[0].2[i]["leader"];
                    !leader.is_null()
                        && views.iter().all(|(id, _, ps)| {
                            ps.get(i).is_some_and(|p| {
                                p["leader"] == *leader && (p["leading"] == true) == (*leader == *id)
                            })
                        })
                });
            if converged {
                return started.elapsed();
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not converge within {RECOVERY_MAX:?}: {views:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// What the load saw: confirmed and acked sequence numbers, deliveries.
#[derive(Default)]
struct Ledger {
    confirmed: BTreeSet<u64>,
    /// Each confirm: when its batch was sent, when the confirm came, the message's partition
    /// (to measure failover per partition).
    confirms: Vec<Confirm>,
    acked: BTreeSet<u64>,
    /// Deliveries of a message after its ack was sent, not flagged redelivered.
    acked_then_new: Vec<u64>,
    delivered: BTreeMap<u64, u32>,
    /// Deliveries not flagged redelivered, per sequence number: with an idempotent producer a
    /// message is stored once, so at most one.
    delivered_new: BTreeMap<u64, u32>,
    /// Where each sequence number was delivered: (partition, offset, delivery count) of each
    /// delivery, to tell a message stored twice (two offsets) from one delivered again.
    delivered_at: BTreeMap<u64, Vec<DeliveredAt>>,
    bad_bodies: u64,
    publish_retries: u64,
    /// Sequence numbers published again after a failed attempt (the idempotent producer
    /// stores them once all the same).
    retried: BTreeSet<u64>,
    /// The cut round's probe: sequence numbers it sent, those it sent after the cut (never to
    /// be delivered: the cut node could not commit them), those confirmed (to be delivered).
    probe_sent: BTreeSet<u64>,
    probe_forbidden: BTreeSet<u64>,
    probe_confirmed: BTreeSet<u64>,
    /// Each failed batch: when it was sent, when it failed, its connection's node and the
    /// first error.
    publish_failures: Vec<(Instant, Instant, String)>,
}

/// One delivery of a message: its partition, offset, delivery count and
/// `consumer tag#delivery id`.
type DeliveredAt = (u32, u64, u32, String);

/// One confirmed publish of the test's publisher.
struct Confirm {
    sent: Instant,
    confirmed: Instant,
    partition: usize,
}

/// The partition the publisher's message `seq` goes to: it has no routing key and is sent
/// with sequence `seq + 1` by the idempotent producer [`PRODUCER_ID`], so both the client and
/// the broker route it to `(producer id + sequence / block) mod partitions`.
fn partition_of(seq: u64) -> usize {
    let block = PRODUCER_ID.wrapping_add((seq + 1) / keratin_client::PRODUCER_SEQUENCE_BLOCK);
    (block % PARTITIONS as u64) as usize
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
        let sent = Instant::now();
        let results = c.publish_batch(QUEUE, messages).await;
        let mut failed = Vec::new();
        let mut lost = false;
        {
            let mut ledger = ledger.lock().expect("lock");
            for (seq, result) in unconfirmed.iter().zip(results) {
                match result {
                    Ok(_) => {
                        ledger.confirmed.insert(*seq);
                        ledger.confirms.push(Confirm {
                            sent,
                            confirmed: Instant::now(),
                            partition: partition_of(*seq),
                        });
                    }
                    Err(error) => {
                        if failed.is_empty() {
                            let node = c.node_id().to_string();
                            let why = format!("via node {node}: {}", error.error);
                            ledger.publish_failures.push((sent, Instant::now(), why));
                        }
                        failed.push(*seq);
                    }
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
        eprintln!("consumer: subscribed via node {}", client.node_id());
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
                    ledger.delivered_at.entry(seq).or_default().push((
                        delivery.partition,
                        delivery.offset,
                        delivery.delivery_count,
                        format!("{}#{}", delivery.consumer_tag, delivery.delivery_id),
                    ));
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

/// Waits until each of `partitions` (every partition when empty) has a publish confirmed
/// after `since`; how long after `since` the last of them came.
fn wait_confirm_after(ledger: &Mutex<Ledger>, since: Instant, partitions: &[usize]) -> Duration {
    wait_confirm(ledger, since, partitions, |c| c.confirmed > since)
}

/// Waits until each of `partitions` (every partition when empty) has a confirmed publish
/// *sent* after `since`; how long after `since` the last of those first confirms came: the
/// failover of those partitions when `since` is when their leader was lost.
fn wait_confirm_sent_after(
    ledger: &Mutex<Ledger>,
    since: Instant,
    partitions: &[usize],
) -> Duration {
    wait_confirm(ledger, since, partitions, |c| c.sent > since)
}

/// Waits until each of `partitions` (all when empty) has a confirm that `pick` accepts; the
/// time after `since` of the latest partition's first one.
fn wait_confirm(
    ledger: &Mutex<Ledger>,
    since: Instant,
    partitions: &[usize],
    pick: impl Fn(&Confirm) -> bool,
) -> Duration {
    let all: Vec<usize> = (0..PARTITIONS).collect();
    let partitions = if partitions.is_empty() {
        &all[..]
    } else {
        partitions
    };
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let firsts: Vec<Option<Instant>> = {
            let ledger = ledger.lock().expect("lock");
            partitions
                .iter()
                .map(|p| {
                    ledger
                        .confirms
                        .iter()
                        .find(|c| c.partition == *p && pick(c))
                        .map(|c| c.confirmed)
                })
                .collect()
        };
        if let Some(firsts) = firsts.iter().copied().collect::<Option<Vec<Instant>>>() {
            let last = firsts.into_iter().max().unwrap_or(since);
            return last.saturating_duration_since(since);
        }
        assert!(
            Instant::now() < deadline,
            "partitions {partitions:?}: not every one confirmed a publish within              {RECOVERY_MAX:?} (first confirms by partition: {firsts:?})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The publisher's confirmed and distinct delivered messages per partition, and the
/// confirmed ones never delivered (the probe's are counted apart: the broker chose their
/// partitions).
fn by_partition(ledger: &Ledger) -> Vec<(usize, usize, usize)> {
    let mut counts = vec![(0, 0, 0); PARTITIONS];
    for seq in &ledger.confirmed {
        counts[partition_of(*seq)].0 += 1;
        if !ledger.delivered.contains_key(seq) {
            counts[partition_of(*seq)].2 += 1;
        }
    }
    for seq in ledger.delivered.keys().filter(|seq| **seq < PROBE_BASE) {
        counts[partition_of(*seq)].1 += 1;
    }
    counts
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
    println!(
        "{round}: by partition (confirmed, distinct delivered): {:?}",
        by_partition(ledger)
    );
    assert_eq!(ledger.bad_bodies, 0, "{round}: bodies with a bad checksum");
    let stored_twice: Vec<(u64, Option<&Vec<DeliveredAt>>)> = ledger
        .delivered_new
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(seq, _)| (*seq, ledger.delivered_at.get(seq)))
        .take(10)
        .collect();
    assert!(
        stored_twice.is_empty(),
        "{round}: messages of the idempotent producer delivered as new twice (sequence number, \
         each delivery's partition, offset, delivery count, consumer tag # delivery id): \
         {stored_twice:?}"
    );
    assert!(
        ledger.acked_then_new.is_empty(),
        "{round}: acked messages delivered again as new: {:?}",
        &ledger.acked_then_new[..ledger.acked_then_new.len().min(10)]
    );
    let minority_writes: Vec<u64> = ledger
        .probe_forbidden
        .iter()
        .filter(|seq| ledger.delivered.contains_key(seq))
        .map(|seq| seq - PROBE_BASE)
        .take(10)
        .collect();
    assert!(
        minority_writes.is_empty(),
        "{round}: publishes sent to the cut node after the cut were delivered (probe ids \
         {minority_writes:?}): the minority leader committed them"
    );
}

/// Local ports of the established TCP connections of process `pid` to port `remote_port`
/// (read from `/proc`: the process's socket inodes, the namespace's TCP tables).
fn connections_to(pid: u32, remote_port: u16) -> Vec<u16> {
    let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let port = |address: &str| u16::from_str_radix(address.rsplit(':').next()?, 16).ok();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode; st 01 = established.
            if fields.len() > 9
                && fields[3] == "01"
                && inodes.contains(fields[9])
                && port(fields[2]) == Some(remote_port)
            {
                ports.extend(port(fields[1]));
            }
        }
    }
    ports
}

/// Cuts node `cut` off the two others. Every node listens on 127.0.0.1 and the lower id of a
/// pair dials the higher one's cluster port, so ports alone cannot tell the cut node's
/// outgoing connections from the two others' (both may go to the same port). The rules
/// therefore drop every packet from or to any cluster port, except those of the two others'
/// connection as it stands now (its dialer's local port, read from `/proc`): accepted first,
/// then the drop below them. All on `INPUT`: on loopback every packet passes it, so a dropped
/// packet vanishes as on a cut cable (the sender's TCP sees no error and retransmits).
fn cut_off(cluster: &Cluster, cut: u64) -> IptablesRules {
    let others: Vec<u64> = (1..=3).filter(|id| *id != cut).collect();
    let (dialer, acceptor) = (others[0], others[1]);
    let acceptor_port = cluster.nodes[&acceptor].cluster.port();
    let dialer_pid = cluster.nodes[&dialer].server.as_ref().expect("running").pid;
    let deadline = Instant::now() + Duration::from_secs(10);
    let kept = loop {
        let ports = connections_to(dialer_pid, acceptor_port);
        if !ports.is_empty() {
            break ports;
        }
        assert!(
            Instant::now() < deadline,
            "node {dialer} has no cluster connection to node {acceptor} to keep through the cut"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let loopback = |extra: &[String]| -> Vec<String> {
        let mut spec: Vec<String> = ["-p", "tcp", "-s", "127.0.0.1", "-d", "127.0.0.1"]
            .map(String::from)
            .to_vec();
        spec.extend_from_slice(extra);
        spec
    };
    let mut rules = IptablesRules::default();
    for port in &kept {
        let (port, acceptor_port) = (port.to_string(), acceptor_port.to_string());
        let forth = [
            "--sport".into(),
            port.clone(),
            "--dport".into(),
            acceptor_port.clone(),
        ];
        let back = ["--sport".into(), acceptor_port, "--dport".into(), port];
        rules.insert(1, &loopback(&forth), "ACCEPT");
        rules.insert(1, &loopback(&back), "ACCEPT");
    }
    let ports: Vec<String> = cluster
        .nodes
        .values()
        .map(|n| n.cluster.port().to_string())
        .collect();
    let drop = [
        "-m".into(),
        "multiport".into(),
        "--ports".into(),
        ports.join(","),
    ];
    rules.insert(2 * kept.len() + 1, &loopback(&drop), "DROP");
    println!(
        "round 4: node {cut} cut off (cluster ports {}; kept node {dialer} -> node {acceptor} \
         from local ports {kept:?})",
        ports.join(",")
    );
    rules
}

/// What the probe saw, by publish id (its body's sequence number is `PROBE_BASE` + id).
#[derive(Debug, Default)]
struct ProbeLog {
    /// When each publish was sent (taken before writing it).
    sent: BTreeMap<u64, Instant>,
    confirmed: BTreeMap<u64, Instant>,
    /// `PublishError` answers: code and message.
    refused: BTreeMap<u64, String>,
    connections: u32,
    /// The nodes the last handshake listed (where a client goes when no leader is named).
    handshake_nodes: Vec<String>,
    /// Connection failures and connection-level errors.
    troubles: Vec<String>,
}

/// A raw protocol client of one node: it publishes a message every `PROBE_INTERVAL` and
/// records the answers, following no "not the leader" answer and reconnecting only there,
/// so every confirm it gets comes from that node.
struct Probe {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<ProbeLog>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Probe {
    fn start(addr: SocketAddr) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(ProbeLog::default()));
        let thread = {
            let (stop, log) = (stop.clone(), log.clone());
            std::thread::spawn(move || probe_run(addr, &stop, &log))
        };
        Probe {
            stop,
            log,
            thread: Some(thread),
        }
    }

    /// Waits until some publish is confirmed; false after `timeout`.
    fn wait_confirmed(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.log.lock().expect("lock").confirmed.is_empty() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Stops publishing now.
    fn stop_publishing(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Waits for the thread (it reads late answers for `PROBE_LINGER`) and returns the log.
    fn finish(mut self) -> ProbeLog {
        self.stop_publishing();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        std::mem::take(&mut *self.log.lock().expect("lock"))
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The probe's thread: connects (again) to `addr` until told to stop, then reads answers for
/// `PROBE_LINGER` more; never longer than `PROBE_RUN_MAX`.
fn probe_run(addr: SocketAddr, stop: &AtomicBool, log: &Mutex<ProbeLog>) {
    let end = Instant::now() + PROBE_RUN_MAX;
    let mut next_id = 1u64;
    let mut stopped_at: Option<Instant> = None;
    let lingered = |stopped_at: &mut Option<Instant>| {
        if stop.load(Ordering::Relaxed) && stopped_at.is_none() {
            *stopped_at = Some(Instant::now());
        }
        Instant::now() > end || stopped_at.is_some_and(|at| at.elapsed() > PROBE_LINGER)
    };
    while !lingered(&mut stopped_at) {
        if stopped_at.is_some() {
            // Nothing more to send, and the connection is gone: its answers are lost.
            return;
        }
        let (mut stream, mut buf, version) = match probe_connect(addr) {
            Ok((stream, buf, version, nodes)) => {
                log.lock().expect("lock").handshake_nodes = nodes;
                (stream, buf, version)
            }
            Err(trouble) => {
                log.lock().expect("lock").troubles.push(trouble);
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        log.lock().expect("lock").connections += 1;
        let mut next_send = Instant::now();
        let mut chunk = vec![0u8; 64 * 1024];
        let trouble = loop {
            if lingered(&mut stopped_at) {
                return;
            }
            if stopped_at.is_none() && Instant::now() >= next_send {
                let id = next_id;
                next_id += 1;
                let frame = Frame::Publish(Publish {
                    queue: QUEUE.into(),
                    mode: PublishMode::Confirmed,
                    messages: vec![keratin_client::proto::Message {
                        publish_id: id,
                        routing_key: None,
                        headers: Vec::new(),
                        body: body(PROBE_BASE + id, BODY_BYTES).into(),
                        sequence: None,
                    }],
                    joinable: false,
                    producer_id: None,
                });
                let mut encoded = Default::default();
                frame
                    .encode_version(&mut encoded, FRAME_SIZE_BYTES_MAX, version)
                    .expect("encode the probe's publish");
                log.lock().expect("lock").sent.insert(id, Instant::now());
                if let Err(error) = stream.write_all(&encoded) {
                    break format!("write: {error}");
                }
                next_send = Instant::now() + PROBE_INTERVAL;
            }
            match stream.read(&mut chunk) {
                Ok(0) => break "closed by the node".to_string(),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => break format!("read: {e}"),
            }
            let mut fatal = None;
            while let Ok(FrameStatus::Complete { size_bytes }) =
                Frame::check(&buf, FRAME_SIZE_BYTES_MAX)
            {
                let bytes: Vec<u8> = buf.drain(..size_bytes).collect();
                let frame = match Frame::decode_version(bytes.into(), version) {
                    Ok(frame) => frame,
                    Err(error) => {
                        fatal = Some(format!("undecodable frame: {error}"));
                        break;
                    }
                };
                let mut log = log.lock().expect("lock");
                match frame {
                    Frame::Confirm(confirm) => {
                        for range in confirm.ranges {
                            for id in range.first..=range.last {
                                log.confirmed.insert(id, Instant::now());
                            }
                        }
                    }
                    Frame::PublishError(refused) => {
                        let why = format!("{} {}", refused.error.code().0, refused.error.message());
                        for range in refused.ranges {
                            for id in range.first..=range.last {
                                log.refused.insert(id, why.clone());
                            }
                        }
                    }
                    Frame::Error(ErrorFrame {
                        fatal: true, error, ..
                    }) => {
                        fatal = Some(format!(
                            "fatal error {}: {}",
                            error.code().0,
                            error.message()
                        ));
                    }
                    Frame::Error(ErrorFrame { error, .. }) => {
                        log.troubles
                            .push(format!("error {}: {}", error.code().0, error.message()));
                    }
                    _ => {}
                }
            }
            if let Some(fatal) = fatal {
                break fatal;
            }
        };
        log.lock().expect("lock").troubles.push(trouble);
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A raw connection to `addr` after the handshake: the stream (reads time out after 50 ms),
/// the bytes read past the hello, the protocol version agreed, the nodes the handshake listed.
fn probe_connect(addr: SocketAddr) -> Result<(TcpStream, Vec<u8>, u16, Vec<String>), String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .map_err(|e| format!("read timeout: {e}"))?;
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| format!("write timeout: {e}"))?;
    let mut hello = Default::default();
    ClientHello::new("cluster-cut-probe")
        .encode(&mut hello)
        .map_err(|e| format!("hello: {e}"))?;
    stream
        .write_all(&hello)
        .map_err(|e| format!("send hello: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let (answer, rest) = with_buffer(&buf, ServerHello::decode);
        match answer.map_err(|e| format!("ServerHello: {e}"))? {
            Some(ServerHello::Accepted { version, info, .. }) => {
                let nodes = info
                    .nodes
                    .iter()
                    .map(|n| format!("{} at {}", n.node_id, n.server))
                    .collect();
                return Ok((stream, rest, version, nodes));
            }
            Some(refused) => return Err(format!("handshake refused: {refused:?}")),
            None => {}
        }
        if Instant::now() > deadline {
            return Err("no ServerHello within 5 s".into());
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err("closed during the handshake".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(format!("read ServerHello: {e}")),
        }
    }
}

/// Round 4: cuts the leader of partition 2 off the others (see the module comment); returns
/// the failover of the partitions it led, from the cut to their first confirm of a publish
/// sent after it.
fn cut_round(cluster: &Cluster, ledger: &Mutex<Ledger>) -> Duration {
    let leaders = cluster.wait_queue_leaders();
    let cut = leaders[2];
    let led = cluster.led_by(cut);
    let others: Vec<u64> = (1..=3).filter(|id| *id != cut).collect();
    let probe = Probe::start(cluster.nodes[&cut].protocol);
    // The probe works and the node leads: it confirms before the cut.
    assert!(
        probe.wait_confirmed(Duration::from_secs(10)),
        "round 4: the probe on node {cut} got no confirm before the cut: {:?}",
        probe.log.lock().expect("lock")
    );

    let mut rules = cut_off(cluster, cut);
    let cut_at = Instant::now();
    let deadline = cut_at + RECOVERY_MAX;
    let (elected, new_leaders) = loop {
        let led_now: Vec<Vec<usize>> = others.iter().map(|id| cluster.led_by(*id)).collect();
        let new_leaders: Option<Vec<u64>> = led
            .iter()
            .map(|p| {
                let at = led_now.iter().position(|ps| ps.contains(p))?;
                Some(others[at])
            })
            .collect();
        if let Some(new_leaders) = new_leaders {
            break (cut_at.elapsed(), new_leaders);
        }
        assert!(
            Instant::now() < deadline,
            "round 4: nodes {others:?} elected no leader of partitions {led:?} within \
             {RECOVERY_MAX:?} of the cut"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let failover = wait_confirm_sent_after(ledger, cut_at, &led);
    if let Some(left) = CUT_MIN.checked_sub(cut_at.elapsed()) {
        std::thread::sleep(left);
    }
    let cut_still_leads = !cluster.led_by(cut).is_empty();
    let dropped = rules.dropped_packets();
    probe.stop_publishing();
    let held = cut_at.elapsed();
    let failures = rules.remove();
    assert!(
        failures.is_empty(),
        "round 4: iptables rules not removed: {failures:?}"
    );
    assert!(dropped > 0, "round 4: the cut dropped no packet");
    let converged = cluster.wait_converged();
    let log = probe.finish();

    let after_cut: Vec<u64> = log
        .sent
        .iter()
        .filter(|(_, sent)| **sent >= cut_at)
        .map(|(id, _)| *id)
        .collect();
    let minority_confirms: Vec<(u64, Duration)> = after_cut
        .iter()
        .filter_map(|id| {
            Some((
                *id,
                log.confirmed.get(id)?.saturating_duration_since(cut_at),
            ))
        })
        .collect();
    let confirmed_before = log
        .confirmed
        .keys()
        .filter(|id| !after_cut.contains(id))
        .count();
    let refused_after = after_cut
        .iter()
        .filter(|id| log.refused.contains_key(id))
        .count();
    let mut refusals: BTreeMap<&str, usize> = BTreeMap::new();
    for id in &after_cut {
        if let Some(why) = log.refused.get(id) {
            *refusals.entry(why.as_str()).or_default() += 1;
        }
    }
    println!(
        "round 4: node {cut} cut off {held:?} (leaders by partition {leaders:?}; {dropped} \
         packets dropped; it still said it leads at the end: {cut_still_leads}); its \
         partitions {led:?} led by nodes {new_leaders:?} after {elected:?}; failover (cut to \
         their first confirm of a publish sent after it) {failover:?}; converged \
         {converged:?} after the heal"
    );
    println!(
        "round 4: probe on node {cut}: {} connections (its handshake lists {:?}), \
         {confirmed_before} confirmed before the cut; of {} sent after it {} confirmed, \
         {refused_after} refused ({refusals:?}), {} unanswered",
        log.connections,
        log.handshake_nodes,
        after_cut.len(),
        minority_confirms.len(),
        after_cut
            .len()
            .saturating_sub(minority_confirms.len() + refused_after)
    );
    let failures: Vec<String> = ledger
        .lock()
        .expect("lock")
        .publish_failures
        .iter()
        .filter(|(_, failed, _)| *failed > cut_at)
        .map(|(sent, failed, why)| {
            let at = |t: Instant| match t.checked_duration_since(cut_at) {
                Some(after) => after.as_secs_f64(),
                None => -(cut_at - t).as_secs_f64(),
            };
            format!(
                "sent {:+.2} s, failed {:+.2} s, {why}",
                at(*sent),
                at(*failed)
            )
        })
        .collect();
    println!(
        "round 4: publisher's failed batches after the cut (times from the cut): {failures:#?}"
    );
    assert!(
        minority_confirms.is_empty(),
        "round 4: the cut node {cut} confirmed publishes sent after the cut (probe id, confirm \
         time after the cut): {minority_confirms:?}; probe log: {log:?}"
    );
    assert!(
        !after_cut.is_empty(),
        "round 4: the probe sent nothing during the cut: {log:?}"
    );
    let mut ledger = ledger.lock().expect("lock");
    ledger
        .probe_sent
        .extend(log.sent.keys().map(|id| PROBE_BASE + id));
    ledger
        .probe_forbidden
        .extend(after_cut.iter().map(|id| PROBE_BASE + id));
    ledger
        .probe_confirmed
        .extend(log.confirmed.keys().map(|id| PROBE_BASE + id));
    failover
}

/// The two tests that run a cluster under load take turns: side by side on two cores they
/// slowed each other's rebuilds past their bounds.
static HEAVY: Mutex<()> = Mutex::new(());

#[test]
fn confirmed_messages_survive_leader_kills_pauses_and_lost_majorities() {
    let _turn = HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    // Decided first, so that a machine that forbids skipping fails at once.
    let cut_round_runs = support::iptables("cluster round 4 (network cut, iptables)");
    // Leader balancing on, as users run it: the declare spreads the partitions' leaders over
    // the three nodes, and a node that comes back gets its preferred leadership back.
    let balance = (1..=3)
        .map(|id| (id, vec![("KERATIN_CLUSTER__LEADER_BALANCE", "true")]))
        .collect();
    let mut cluster = Cluster::start_with_env(balance);
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
            let settings = QueueSettings {
                partitions: PARTITIONS as u32,
                replicas: Some(3),
                ..QueueSettings::default()
            };
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
        // Every node's handshake lists the three nodes (with the addresses a client dials), so
        // a client given one address can reach any other: the way out when its node is cut off.
        let listing_deadline = Instant::now() + RECOVERY_MAX;
        for (id, node) in &cluster.nodes {
            loop {
                let listed: BTreeSet<String> = match connect_any(&[node.protocol], 0).await {
                    Some(client) => client
                        .server_info()
                        .nodes
                        .iter()
                        .map(|n| n.server.clone())
                        .collect(),
                    None => BTreeSet::new(),
                };
                let all: BTreeSet<String> = cluster
                    .nodes
                    .values()
                    .map(|n| n.protocol.to_string())
                    .collect();
                if listed == all {
                    break;
                }
                assert!(
                    Instant::now() < listing_deadline,
                    "node {id}'s handshake lists {listed:?}, not {all:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    let tasks = [
        runtime.spawn(publisher(addrs.clone(), ledger.clone(), stop.clone())),
        runtime.spawn(consumer(addrs.clone(), ledger.clone(), stop.clone())),
    ];
    let load_started = Instant::now();
    let spread_leaders = cluster.wait_leaders(
        QUEUE,
        "leaders on three nodes",
        RECOVERY_MAX,
        support::cluster::spread,
    );
    println!(
        "leaders by partition {spread_leaders:?} after {:?}",
        load_started.elapsed()
    );
    wait_confirm_after(&ledger, load_started, &[]);

    // Round 1: kill -9 the leader of partition 0 (and whatever else it leads).
    let leaders = cluster.wait_queue_leaders();
    let victim = leaders[0];
    let led = cluster.led_by(victim);
    let killed_at = Instant::now();
    cluster.kill9(victim);
    *addrs.lock().expect("lock") = cluster.live();
    let failover = wait_confirm_sent_after(&ledger, killed_at, &led);
    println!(
        "round 1: node {victim} killed (leaders by partition {leaders:?}); failover of \
         partitions {led:?} (kill to their first confirm of a publish sent after it) \
         {failover:?}"
    );
    cluster.start_node(victim);
    *addrs.lock().expect("lock") = cluster.live();
    let spread_again = cluster.wait_spread();
    println!("round 1: node {victim} back, leaders on three nodes again after {spread_again:?}");
    check(&ledger.lock().expect("lock"), "round 1");

    // Round 2: SIGSTOP the leader of partition 1 for 10 s: its partitions fail over, and it is
    // a paused follower of the others. Every partition confirms while it is paused.
    let leaders = cluster.wait_queue_leaders();
    let paused = leaders[1];
    let led = cluster.led_by(paused);
    cluster.signal(paused, "-STOP");
    let paused_at = Instant::now();
    // The test's clients reconnect to running nodes only (a handshake with the paused node
    // would wait out the client's connect timeout).
    addrs
        .lock()
        .expect("lock")
        .retain(|addr| *addr != cluster.nodes[&paused].protocol);
    let paused_failover = wait_confirm_sent_after(&ledger, paused_at, &led);
    if let Some(left) = Duration::from_secs(10).checked_sub(paused_at.elapsed()) {
        std::thread::sleep(left);
    }
    let confirmed_while_paused: Vec<usize> = {
        let ledger = ledger.lock().expect("lock");
        (0..PARTITIONS)
            .map(|p| {
                ledger
                    .confirms
                    .iter()
                    .filter(|c| c.partition == p && c.sent > paused_at)
                    .count()
            })
            .collect()
    };
    cluster.signal(paused, "-CONT");
    *addrs.lock().expect("lock") = cluster.live();
    println!(
        "round 2: node {paused} stopped 10 s (leaders by partition {leaders:?}); failover of \
         partitions {led:?} {paused_failover:?}; confirmed meanwhile by partition \
         {confirmed_while_paused:?}"
    );
    assert!(
        confirmed_while_paused.iter().all(|n| *n > 0),
        "round 2: a partition confirmed nothing while node {paused} was paused: \
         {confirmed_while_paused:?}"
    );
    check(&ledger.lock().expect("lock"), "round 2");

    // Round 3: kill -9 two nodes, restart them.
    let leaders = cluster.wait_queue_leaders();
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
    let back = wait_confirm_after(&ledger, restarted_at, &[]);
    let spread_again = cluster.wait_spread();
    println!(
        "round 3: nodes 1 and 3 killed and restarted (leaders by partition {leaders:?}); every \
         partition confirms again {back:?} after the restart, leaders on three nodes again \
         {spread_again:?} after"
    );
    check(&ledger.lock().expect("lock"), "round 3");

    // Round 4: cut the leader of partition 2 off the other two nodes.
    let cut_failover = cut_round_runs.then(|| {
        let failover = cut_round(&cluster, &ledger);
        let spread_again = cluster.wait_spread();
        println!("round 4: leaders on three nodes again {spread_again:?} after the heal");
        check(&ledger.lock().expect("lock"), "round 4");
        failover
    });

    // Round 5: wipe the data directory of a node that follows partition 2 and restart it: it
    // rebuilds every partition from the leaders' snapshots and logs. Then it must carry the
    // partitions: with the other follower of partition 2 down, every partition's confirms
    // need its acks; with partition 2's leader down, it and the other node elect leaders for
    // what that node led, and every confirmed message is still delivered.
    let leaders = cluster.wait_queue_leaders();
    let leader = leaders[2];
    let mut followers = cluster.nodes.keys().copied().filter(|id| *id != leader);
    let (wiped, other) = (
        followers.next().expect("a follower"),
        followers.next().expect("another follower"),
    );
    cluster.kill9(wiped);
    std::fs::remove_dir_all(&cluster.nodes[&wiped].dir).expect("wipe the follower's data");
    *addrs.lock().expect("lock") = cluster.live();
    let wiped_at = Instant::now();
    cluster.start_node(wiped);
    *addrs.lock().expect("lock") = cluster.live();
    cluster.wait_knows_leader(wiped);
    let rejoined = wiped_at.elapsed();
    // Rebuilt: every leader counts it in sync (the publisher kept the leaders busy meanwhile;
    // a fixed pause left it 126,000 entries behind once under a loaded CI machine).
    cluster.wait_in_sync(wiped);
    let in_sync = wiped_at.elapsed();
    cluster.kill9(other);
    *addrs.lock().expect("lock") = cluster.live();
    let other_down = Instant::now();
    let with_wiped = wait_confirm_sent_after(&ledger, other_down, &[]);
    cluster.start_node(other);
    *addrs.lock().expect("lock") = cluster.live();
    cluster.wait_knows_leader(other);
    std::thread::sleep(Duration::from_secs(2));
    let led = cluster.led_by(leader);
    cluster.kill9(leader);
    *addrs.lock().expect("lock") = cluster.live();
    let leader_down = Instant::now();
    let without_leader = wait_confirm_sent_after(&ledger, leader_down, &led);
    cluster.start_node(leader);
    *addrs.lock().expect("lock") = cluster.live();
    println!(
        "round 5: node {wiped} wiped and restarted (leaders by partition {leaders:?}), names \
         the leaders after {rejoined:?}, in sync after {in_sync:?}; with node {other} down, \
         every partition confirms again after {with_wiped:?} (they need node {wiped}); with \
         node {leader} down (leading partitions {led:?}), after {without_leader:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    check(&ledger.lock().expect("lock"), "round 5");

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
                .chain(&ledger.probe_confirmed)
                .filter(|seq| !ledger.delivered.contains_key(seq))
                .count()
        };
        if missing == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{missing} confirmed messages never delivered; by partition (confirmed, delivered, \
             missing): {:?}",
            by_partition(&ledger.lock().expect("lock"))
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
        ledger
            .delivered
            .keys()
            .all(|seq| *seq < published_max || ledger.probe_sent.contains(seq)),
        "a delivered sequence number was never published"
    );
    println!("failover {:.2} s", failover.as_secs_f64());
    match cut_failover {
        Some(cut) => println!("cut failover {:.2} s", cut.as_secs_f64()),
        None => println!("cut failover: round 4 skipped (needs root and iptables)"),
    }
}

/// Placement leaves out a node at the soft disk level: node 3 starts with a soft floor far
/// above any disk's free space, so it is at soft at once and its `HELLO` says so. Once node 1
/// has heard it, a queue with 3 replicas is refused with `ERR_LIMITED` (reason disk) naming
/// node 3, and one with 2 replicas is declared (on nodes 1 and 2).
#[test]
fn a_node_at_soft_gets_no_new_replicas() {
    let cluster = Cluster::start_with_env(BTreeMap::from([(
        3,
        vec![("KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES", "1125899906842624")],
    )]));
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let level = cluster.cluster_document(1).and_then(|document| {
            document["nodes"]
                .as_array()?
                .iter()
                .find(|n| n["id"] == 3)
                .and_then(|n| n["info"]["level"].as_str().map(str::to_owned))
        });
        if level.as_deref() == Some("soft") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 1 never heard node 3 is at soft: {level:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = connect_any(&[cluster.nodes[&1].protocol], 0)
            .await
            .expect("connect to node 1");
        let three = QueueSettings {
            replicas: Some(3),
            ..QueueSettings::default()
        };
        let refused = client
            .declare("three", three)
            .await
            .expect_err("three replicas with a node at soft");
        let text = refused.to_string();
        assert!(
            text.contains("node 3 at soft") && text.contains("fewer replicas"),
            "{text}"
        );
        // ERR_LIMITED, reason disk (a declare's refusal comes as the server's error body).
        match &refused {
            keratin_client::ClientError::Limited { reason, .. } => {
                assert_eq!(reason.name(), "disk", "{refused:?}")
            }
            keratin_client::ClientError::Server(body) => {
                assert_eq!(
                    body.code(),
                    keratin_client::proto::codes::ERR_LIMITED,
                    "{refused:?}"
                );
                assert_eq!(
                    body.reason().map(|r| r.name().to_owned()).as_deref(),
                    Some("disk"),
                    "{refused:?}"
                );
            }
            other => panic!("not ERR_LIMITED: {other:?}"),
        }
        let two = QueueSettings {
            replicas: Some(2),
            ..QueueSettings::default()
        };
        client.declare("two", two).await.expect("two replicas");
    });
}

/// The operator's verbs on real processes: a fourth node started with `--join` is admitted
/// with `keratin cluster add-node 4=ADDR --wait` (replicas move onto it), then node 1 is
/// removed with `keratin cluster remove-node 1 --wait` and stopped; `cluster status` shows it
/// removed and out of the metadata group, and every confirmed message is still delivered by
/// the three nodes left.
#[test]
fn nodes_are_added_and_removed_with_the_cli() {
    let _turn = HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    let mut cluster = Cluster::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let queues = ["moves-a", "moves-b", "moves-c"];
    let addrs = cluster.live();
    runtime.block_on(async {
        let client = connect_any(&addrs, 0).await.expect("connect");
        let settings = QueueSettings {
            replicas: Some(3),
            ..QueueSettings::default()
        };
        for (q, queue) in (0u64..).zip(queues) {
            // The metadata group may still be electing its first leader.
            let deadline = Instant::now() + RECOVERY_MAX;
            while let Err(error) = client.declare(queue, settings.clone()).await {
                assert!(Instant::now() < deadline, "declare {queue}: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            for seq in 0..50 {
                // `connect_any`'s producer id is the test's: the sequences are too.
                let message =
                    OutgoingMessage::new(body(seq, BODY_BYTES)).with_sequence(q * 50 + seq + 1);
                client.publish(queue, message).await.expect("confirmed");
            }
        }
    });
    cluster.start_joining(4);
    let new = format!("4={}", cluster.nodes[&4].cluster);
    let (ok, text) = cluster.cli(1, &["cluster", "add-node", &new, "--wait", "60"]);
    assert!(ok, "add-node: {text}");
    assert!(
        text.contains("every planned replica is on the new node"),
        "{text}"
    );
    // 9 replicas over 4 nodes: node 4 takes 2.
    assert_eq!(
        text.matches(",4").count() + text.matches(" 4,").count(),
        2,
        "{text}"
    );
    let (ok, text) = cluster.cli(2, &["cluster", "remove-node", "1", "--wait", "60"]);
    assert!(ok, "remove-node: {text}");
    assert!(text.contains("it can be stopped"), "{text}");
    let (ok, text) = cluster.cli(2, &["cluster", "status", "--json"]);
    assert!(ok, "status: {text}");
    let document: serde_json::Value = serde_json::from_str(&text).expect("status json");
    assert_eq!(
        document["meta_voters"],
        serde_json::json!([2, 3, 4]),
        "{text}"
    );
    let one = document["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == 1)
        .expect("node 1");
    assert_eq!(one["removed"], true, "{text}");
    for queue in queues {
        for p in document["queues"]
            .as_array()
            .expect("queues")
            .iter()
            .filter(|q| q["name"] == queue)
            .flat_map(|q| q["partitions"].as_array().cloned().unwrap_or_default())
        {
            assert!(
                !p["replicas"]
                    .as_array()
                    .expect("replicas")
                    .contains(&1.into()),
                "{queue}: {p}"
            );
        }
    }
    assert!(cluster
        .nodes
        .get_mut(&1)
        .and_then(|n| n.server.as_mut())
        .expect("node 1")
        .terminate(Duration::from_secs(10)));
    cluster.nodes.get_mut(&1).expect("node 1").server = None;
    let addrs = cluster.live();
    runtime.block_on(async {
        for queue in queues {
            let client = connect_any(&addrs, 0).await.expect("connect");
            let mut consumer = client.subscribe(queue, 50).await.expect("subscribe");
            let mut seen = BTreeSet::new();
            while seen.len() < 50 {
                let next = tokio::time::timeout(Duration::from_secs(10), consumer.recv()).await;
                let Ok(Some(delivery)) = next else { break };
                seen.insert(seq_of(&delivery.body).expect("numbered body"));
                delivery.ack().expect("ack");
            }
            assert_eq!(
                seen.len(),
                50,
                "{queue}: every confirmed message after the moves"
            );
        }
    });
}
