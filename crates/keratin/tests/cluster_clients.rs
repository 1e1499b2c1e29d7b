//! The cluster as a client meets it: three real `keratin serve` processes with the leaders of a
//! queue's partitions on three different nodes (preferred leaders rotated over the nodes at
//! declare, leader balancing on, the test waits until every node names that spread), and the
//! CLI and the Rust client connected to a node that leads only some partitions, or none:
//!
//! - **publishing reaches every partition's leader while leaders move**: from the declare of
//!   `z` on, while the balancer moves its leaders to their preferred nodes, runs of
//!   `keratin publish z --count 3000` through node 2 (which ends up leading one of `z`'s three
//!   partitions) confirm every message, each run within 3 s and 1 s of client CPU. It fails
//!   when the client remembers one leader per queue and follows each 421 at once: while nodes
//!   disagree about a leader it spins ("no node accepted it as leader after 129 attempts in
//!   155 ms") or crawls;
//! - **one routing key keeps its order through any node**: 20,000 messages with one key
//!   through node 3, which leads none of `rq`'s partitions, started just after the key's
//!   leader was stopped (`SIGSTOP` for 3 s, so its in-flight publishes are refused only when
//!   it resumes), read back in publish order. It fails when publish calls overtake each other
//!   on their way to the connection (the async runtime's budget made a `send` yield: message
//!   127 stored after 999), or refused publishes are sent again behind later ones;
//! - **a consumer receives every partition**: `keratin consume z` through node 2 receives
//!   everything published to `z`, and `keratin consume rq` through node 3 (leading nothing)
//!   1,000 keyless messages. It fails when a consumer subscribes on one node only: it gets
//!   that node's partitions (a third of `z`; for `rq` one partition of two) and then idles;
//! - **unacknowledged deliveries of a lost leader come back flagged**: a Rust consumer through
//!   node 2 leaves partition 2's deliveries (led by node 3) unacknowledged; node 3 is killed
//!   with `kill -9`; the consumer follows the partition to its new leader and gets them again
//!   with `redelivered` set, and every message once acked.
//!
//! - **a purge and a delete work through any node**: `queue purge pq` (leaders on nodes 1, 2,
//!   3) through node 2 and `POST /api/v1/queues/rq/purge` through node 3 (leading none of
//!   `rq`) purge every partition within 5 s, and `queue delete pq` through node 3 removes it
//!   everywhere. It failed when a node purged only the partitions it leads and answered 421
//!   for the next: the CLI, following the leaders, gave up after 43 redirects in 10 s.
//!
//! A message stored twice is allowed (at least once); the tests print how many. Keyless
//! sequences of a producer go to the partitions in blocks of 64, so a partition's window
//! covers the producer's last 4,096 there (`docs/cluster.md`, "Idempotent producers"), yet
//! the kill below still read 14 and 39 of 100,000 back twice in two runs with blocks (7 with one sequence per
//! partition in turn): window coverage is not what stores those twice; not yet explained.

//! - `a_publish_resends_to_the_new_leader_after_a_kill`: `kill -9` of a partition's leader while
//!   `keratin publish` (100,000 messages) runs through another node: every message is
//!   confirmed (unknown outcomes are sent again, as the idempotent producer's, to the new
//!   leader within `--timeout-ms`) and each is read back. It fails when the CLI gives up on
//!   the publishes in flight at the kill (`outcome_unknown`, "connection reset by peer"), or
//!   crawls past its timeout.
//!
//! Bounded: every wait has a deadline; each test takes well under a minute. Processes are
//! killed by PID when dropped.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage};
use serde_json::Value;
use support::cluster::Cluster;

/// The cluster must elect, apply declares and spread leaders within this.
const SETTLE_MAX: Duration = Duration::from_secs(30);
/// What publishing 3,000 messages through a node that leads one partition of three may take,
/// leader moves included: about 0.1 s here without a move, an election costs a few hundred
/// ms; the client that followed one leader per queue took 4.5 s once the leaders had spread.
const PUBLISH_3000_MAX: Duration = Duration::from_secs(3);
/// The client CPU those 3,000 publishes may use: about 35 ms here; the client that followed
/// one leader per queue, ping-ponging between the leaders, used 2.3 s.
const PUBLISH_3000_CPU_MAX: Duration = Duration::from_secs(1);

/// Three nodes that hand each partition back to its preferred leader (the first node of its
/// replica list; `--nodes 1,2,3` rotates it over the partitions).
fn balanced_cluster() -> Cluster {
    let envs = (1..=3)
        .map(|id| (id, vec![("KERATIN_CLUSTER__LEADER_BALANCE", "true")]))
        .collect();
    Cluster::start_with_env(envs)
}

impl Cluster {
    /// `keratin ARGS --server <node id> --json` in `dir`: whether it exited 0, its stdout's
    /// last JSON object, and stderr.
    fn cli_json(&self, id: u64, args: &[&str]) -> (bool, Value, String) {
        let output = Command::new(env!("CARGO_BIN_EXE_keratin"))
            .args(args)
            .args(["--server", &self.nodes[&id].protocol.to_string(), "--json"])
            .current_dir(self.root.path())
            .stdin(Stdio::null())
            .output()
            .expect("run keratin");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let json = stdout
            .lines()
            .rev()
            .find_map(|line| serde_json::from_str(line).ok())
            .unwrap_or(Value::Null);
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.success(), json, stderr)
    }

    /// Each partition's leader as node `id` names it in `queue info`.
    fn leaders_seen_by(&self, id: u64, queue: &str) -> Option<Vec<Option<u64>>> {
        let (ok, info, _) = self.cli_json(id, &["queue", "info", queue]);
        if !ok {
            return None;
        }
        let partitions = info["partitions"].as_array()?;
        Some(partitions.iter().map(|p| p["leader"].as_u64()).collect())
    }

    /// Waits until `queue`'s partitions are led by `expected` (by partition), as the running
    /// nodes that hold a copy agree, within [`SETTLE_MAX`].
    fn wait_spread_on(&self, queue: &str, expected: &[u64]) {
        self.wait_leaders(queue, "the expected leaders", SETTLE_MAX, |now| {
            now == expected
        });
    }

    /// Whether every running node names `expected` as the leaders of `queue`'s partitions.
    fn leaders_agree(&self, queue: &str, expected: &[u64]) -> bool {
        let want: Vec<Option<u64>> = expected.iter().copied().map(Some).collect();
        self.nodes
            .iter()
            .filter(|(_, node)| node.server.is_some())
            .all(|(id, _)| self.leaders_seen_by(*id, queue).as_ref() == Some(&want))
    }

    /// Declares `queue` (3 replicas, preferred leaders rotated from node 1) and waits until
    /// the leaders of its partitions are nodes `leaders` (one per partition).
    fn declare_spread(&self, queue: &str, leaders: &[u64]) {
        let partitions = leaders.len().to_string();
        self.cli_until_ok(
            1,
            &[
                "queue",
                "declare",
                queue,
                "--partitions",
                &partitions,
                "--replicas",
                "3",
                "--nodes",
                "1,2,3",
            ],
            SETTLE_MAX,
        );
        self.wait_spread_on(queue, leaders);
    }
}

/// The sequence numbers in `path` (one per line), in file order.
fn read_seqs(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .expect("read seqs")
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// Places where a sequence number follows a larger one, as `(before, after)`.
fn inversions(seqs: &[u64]) -> Vec<(u64, u64)> {
    seqs.windows(2)
        .filter(|pair| pair[1] < pair[0])
        .map(|pair| (pair[0], pair[1]))
        .collect()
}

fn client_options() -> ClientOptions {
    ClientOptions {
        name: "cluster-clients-test".into(),
        request_timeout: Duration::from_secs(10),
        publish_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    }
}

/// `keratin ARGS --server <node id> --json`, as [`Cluster::cli_json`], with the CPU time the
/// process used (user and system) and how long it ran.
fn cli_measured(
    cluster: &Cluster,
    id: u64,
    args: &[&str],
) -> (bool, Value, String, Duration, Duration) {
    let cpu_before = children_cpu();
    let started = Instant::now();
    let (ok, json, stderr) = cluster.cli_json(id, args);
    (
        ok,
        json,
        stderr,
        started.elapsed(),
        children_cpu().saturating_sub(cpu_before),
    )
}

/// CPU time (user and system) process `pid` used so far (`/proc/PID/stat`, in clock ticks of
/// 10 ms).
fn process_cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let ticks: u64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|field| field.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// CPU time (user and system) of this process's children that ended and were waited for.
fn children_cpu() -> Duration {
    // SAFETY: `usage` is a writable rusage; getrusage only writes it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid `who` and a valid pointer.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    assert_eq!(rc, 0, "getrusage");
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

#[test]
fn publishers_and_consumers_reach_every_partition_from_any_node() {
    let started = Instant::now();
    let mut cluster = balanced_cluster();
    // z and pq: partitions 0, 1, 2 preferred on nodes 1, 2, 3; rq: partitions 0, 1 on nodes
    // 1, 2, so node 3 leads none of rq's. Publishing to z starts at once: the balancer moves the
    // leaders to their preferred nodes while it runs.
    for (queue, partitions) in [("z", "3"), ("rq", "2"), ("pq", "3")] {
        cluster.cli_until_ok(
            1,
            &[
                "queue",
                "declare",
                queue,
                "--partitions",
                partitions,
                "--replicas",
                "3",
                "--nodes",
                "1,2,3",
            ],
            SETTLE_MAX,
        );
    }
    let mut published = 0u64;
    let mut runs_after_spread = 0;
    let mut spread_at = None;
    while runs_after_spread < 2 {
        assert!(
            started.elapsed() < SETTLE_MAX * 2,
            "z's leaders did not spread over nodes 1, 2, 3: {:?}",
            cluster.leaders_seen_by(1, "z")
        );
        let start_seq = published.to_string();
        let (ok, summary, stderr, took, cpu) = cli_measured(
            &cluster,
            2,
            &[
                "publish",
                "z",
                "--count",
                "3000",
                "--size",
                "256",
                "--timeout-ms",
                "15000",
                "--start-seq",
                &start_seq,
            ],
        );
        eprintln!(
            "publish z through node 2 (leaders {:?}): {summary} in {took:?}, client CPU {cpu:?}",
            cluster.leaders_seen_by(2, "z")
        );
        assert!(
            ok && summary["confirmed"] == 3000 && summary["failed"] == 0,
            "publishing through node 2 while z's leaders move: {summary} {stderr}"
        );
        assert!(
            took < PUBLISH_3000_MAX && cpu < PUBLISH_3000_CPU_MAX,
            "3,000 publishes through node 2 took {took:?} and {cpu:?} of client CPU"
        );
        published += 3000;
        if spread_at.is_none() && cluster.leaders_agree("z", &[1, 2, 3]) {
            spread_at = Some(started.elapsed());
        }
        if spread_at.is_some() {
            runs_after_spread += 1;
        }
    }
    eprintln!("z's leaders spread after {spread_at:?}");
    cluster.wait_spread_on("z", &[1, 2, 3]);
    keyless_publishes_reach_every_leader(&cluster, published);
    published += KEYLESS_COUNT;
    cluster.wait_spread_on("rq", &[1, 2]);
    purge_and_delete_through_any_node(&cluster);

    // One routing key through node 3, which leads none of rq's partitions, started just
    // after the key's leader (node 2) was stopped: the client sends to node 2 while the
    // others elect a new leader; node 2 answers (421) only when it resumes 3 s later, and the
    // client sends those publishes again to the new leader, before anything later. Read back
    // through any node.
    let sent = cluster.root.path().join("rq-sent");
    cluster.signal(2, "-STOP");
    let mut publish = spawn_publish(
        &cluster,
        3,
        &["rq", "--count", "20000", "--routing-key", "one-key"],
        &sent,
    );
    std::thread::sleep(Duration::from_secs(3));
    cluster.signal(2, "-CONT");
    let (ok, summary, stderr) = wait_cli(&mut publish, Duration::from_secs(40));
    eprintln!("publish rq with one key through node 3, node 2 stopped 3 s: {summary}");
    assert!(
        ok && summary["confirmed"] == 20000 && summary["failed"] == 0,
        "publishing one key through a node that leads nothing: {summary} {stderr}"
    );
    let read = cluster.root.path().join("rq-read");
    let read_arg = read.to_string_lossy().into_owned();
    let (ok, summary, stderr) = cluster.cli_json(
        1,
        &[
            "consume",
            "rq",
            "--count",
            "20000",
            "--idle-exit-ms",
            "5000",
            "--record-seqs",
            &read_arg,
        ],
    );
    eprintln!("consume rq through node 1: {summary}");
    let read_seqs = read_seqs(&read);
    let inverted = inversions(&read_seqs);
    assert!(
        inverted.is_empty(),
        "one key read back out of order ({} inversions, first {:?})",
        inverted.len(),
        &inverted[..inverted.len().min(8)]
    );
    assert!(ok, "{summary} {stderr}");
    assert_eq!(
        read_seqs,
        read_seqs_sorted(&sent),
        "every message of the key, in order"
    );

    // Consumers through a node that leads one partition of three, and one that leads none.
    let (ok, summary, stderr) = cluster.cli_json(2, &["consume", "z", "--idle-exit-ms", "3000"]);
    eprintln!("consume z through node 2: {summary}");
    // Every message at least once (a few may be stored twice: see the module docs).
    let distinct =
        summary["received"].as_u64().unwrap_or(0) - summary["duplicates"].as_u64().unwrap_or(0);
    assert!(
        ok && distinct == published,
        "a consumer through node 2 receives every partition of z ({published}): {summary} {stderr}"
    );
    let (ok, summary, stderr) = cluster.cli_json(1, &["publish", "rq", "--count", "1000"]);
    assert!(ok && summary["confirmed"] == 1000, "{summary} {stderr}");
    let (ok, summary, stderr) = cluster.cli_json(3, &["consume", "rq", "--idle-exit-ms", "3000"]);
    eprintln!("consume rq through node 3: {summary}");
    assert!(
        ok && summary["received"] == 1000,
        "a consumer through node 3 (leading nothing) receives every partition of rq: {summary} {stderr}"
    );

    unacked_deliveries_come_back_flagged(&mut cluster);
    eprintln!("test took {:?}", started.elapsed());
}

/// Messages of [`keyless_publishes_reach_every_leader`].
const KEYLESS_COUNT: u64 = 3000;

/// The messages each partition of `queue` holds ready, as its leader counts them.
fn ready_by_partition(cluster: &Cluster, queue: &str) -> Vec<u64> {
    let infos: BTreeMap<u64, Value> = (1..=3)
        .map(|id| {
            let (ok, info, stderr) = cluster.cli_json(id, &["queue", "info", queue]);
            assert!(ok, "queue info {queue} on node {id}: {info} {stderr}");
            (id, info)
        })
        .collect();
    let partitions = infos[&1]["partitions"].as_array().expect("partitions");
    (0..partitions.len())
        .map(|p| {
            let leader = partitions[p]["leader"].as_u64().expect("a leader");
            infos[&leader]["partitions"][p]["ready"]
                .as_u64()
                .expect("ready")
        })
        .collect()
}

/// A publisher that is no idempotent producer sends messages without a routing key (the
/// broker chooses their partition) through node 3, which leads one of `z`'s three
/// partitions: every message is confirmed within [`PUBLISH_3000_MAX`], and each partition's
/// leader gets its share (a third, within 10 %), the client spreading them over the leaders
/// and each leader storing them in a partition it leads. Bodies numbered from `first`.
fn keyless_publishes_reach_every_leader(cluster: &Cluster, first: u64) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let before = ready_by_partition(cluster, "z");
    let node3: SocketAddr = cluster.nodes[&3].protocol;
    let took = runtime.block_on(async {
        let options = ClientOptions {
            idempotent: false,
            ..client_options()
        };
        let client = Client::connect(node3, options)
            .await
            .expect("connect to node 3");
        let messages = (first..first + KEYLESS_COUNT)
            .map(|seq| OutgoingMessage::new(support::body(seq, 256)))
            .collect();
        let began = Instant::now();
        for result in client.publish_batch("z", messages).await {
            result.expect("confirmed");
        }
        let took = began.elapsed();
        client.close().await;
        took
    });
    let after = ready_by_partition(cluster, "z");
    let added: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    eprintln!(
        "{KEYLESS_COUNT} keyless messages through node 3 in {took:?}, by partition {added:?}"
    );
    assert_eq!(added.iter().sum::<u64>(), KEYLESS_COUNT, "{added:?}");
    assert!(
        added.iter().all(|&n| n * 10 >= KEYLESS_COUNT * 3),
        "each of z's partitions gets a third of the keyless messages: {added:?}"
    );
    assert!(
        took < PUBLISH_3000_MAX,
        "{KEYLESS_COUNT} keyless publishes through node 3 took {took:?}"
    );
}

/// What a purge of a queue through a node that leads only some of its partitions, or none,
/// may take: milliseconds when every partition's leader answers at once. The purge that
/// bounced between the leaders (each node purging its own partitions, then answering 421 for
/// the next one's) never finished within the CLI's request timeout.
const PURGE_MAX: Duration = Duration::from_secs(5);

/// `queue purge` and `queue delete` through nodes that do not lead the partitions they reach:
/// `pq`'s leaders are nodes 1, 2, 3 and the CLI purges it through node 2 (leading one of the
/// three), the admin API purges `rq` through node 3 (leading none of its two) and answers how
/// many messages went, and the CLI deletes `pq` through node 3. Leaves `rq` empty.
fn purge_and_delete_through_any_node(cluster: &Cluster) {
    cluster.wait_spread_on("pq", &[1, 2, 3]);
    let (ok, summary, stderr) = cluster.cli_json(1, &["publish", "pq", "--count", "3000"]);
    assert!(ok && summary["confirmed"] == 3000, "{summary} {stderr}");
    let ready = |id: u64, queue: &str| -> Option<Vec<u64>> {
        let (ok, info, _) = cluster.cli_json(id, &["queue", "info", queue]);
        let partitions = info["partitions"].as_array().filter(|_| ok)?;
        partitions.iter().map(|p| p["ready"].as_u64()).collect()
    };
    // Node 1 sees the partitions it follows once it applied their records.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let before = ready(1, "pq");
        if before
            .as_ref()
            .is_some_and(|r| r.iter().all(|&n| n > 0) && r.iter().sum::<u64>() == 3000)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "3,000 keyless messages over pq's three partitions: {before:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let asked = Instant::now();
    let (ok, summary, stderr) = cluster.cli_json(2, &["queue", "purge", "pq"]);
    let took = asked.elapsed();
    eprintln!("purge pq through node 2: {summary} in {took:?}");
    assert!(
        ok && took < PURGE_MAX,
        "purging pq (leaders 1, 2, 3) through node 2 took {took:?}: {summary} {stderr}"
    );
    // Each node's replica of each partition applies the purge.
    let deadline = Instant::now() + Duration::from_secs(5);
    for id in 1..=3 {
        while ready(id, "pq") != Some(vec![0, 0, 0]) {
            assert!(
                Instant::now() < deadline,
                "pq after the purge, as node {id} sees it: {:?}",
                ready(id, "pq")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    let (ok, summary, stderr) = cluster.cli_json(1, &["publish", "rq", "--count", "500"]);
    assert!(ok && summary["confirmed"] == 500, "{summary} {stderr}");
    let asked = Instant::now();
    let (status, body) = http_post(cluster.nodes[&3].http, "/api/v1/queues/rq/purge");
    let took = asked.elapsed();
    eprintln!("POST /api/v1/queues/rq/purge on node 3: {status} {body} in {took:?}");
    let answer: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    assert!(
        status == 200 && answer["purged"] == 500 && took < PURGE_MAX,
        "purging rq (leaders 1, 2) through node 3's admin API: {status} {body} in {took:?}"
    );

    let (ok, summary, stderr) = cluster.cli_json(3, &["queue", "delete", "pq"]);
    assert!(ok, "deleting pq through node 3: {summary} {stderr}");
    let deadline = Instant::now() + Duration::from_secs(5);
    for id in 1..=3 {
        while ready(id, "pq").is_some() {
            assert!(
                Instant::now() < deadline,
                "node {id} still has pq after its delete"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `POST path` (no body) to an admin API: the status code and the body.
fn http_post(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Starts `keratin publish ARGS --size 64 --timeout-ms 20000 --record-seqs <sent> --server
/// <node id> --json` in the background (the caller waits with [`wait_cli`]).
fn spawn_publish(cluster: &Cluster, id: u64, args: &[&str], sent: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_keratin"))
        .arg("publish")
        .args(args)
        .args(["--size", "64", "--timeout-ms", "20000", "--record-seqs"])
        .arg(sent)
        .args([
            "--server",
            &cluster.nodes[&id].protocol.to_string(),
            "--json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start keratin publish")
}

/// Waits for `child` (a `keratin ... --json`) at most `within`, killing it past that: whether
/// it exited 0, its last JSON object on stdout, and stderr.
fn wait_cli(child: &mut std::process::Child, within: Duration) -> (bool, Value, String) {
    let deadline = Instant::now() + within;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let cpu = process_cpu(child.id());
            let _ = child.kill();
            let _ = child.wait();
            panic!("keratin ran past {within:?}, having used {cpu:?} of CPU");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut stdout = String::new();
    let mut stderr = String::new();
    use std::io::Read;
    if let Some(out) = child.stdout.as_mut() {
        let _ = out.read_to_string(&mut stdout);
    }
    if let Some(err) = child.stderr.as_mut() {
        let _ = err.read_to_string(&mut stderr);
    }
    let ok = child.wait().expect("wait").success();
    let json = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or(Value::Null);
    (ok, json, stderr)
}

fn read_seqs_sorted(path: &Path) -> Vec<u64> {
    let mut seqs = read_seqs(path);
    seqs.sort_unstable();
    seqs
}

/// 300 messages into z; a Rust consumer through node 2 acks partitions 0 and 1 and holds
/// partition 2's (led by node 3); node 3 is killed: partition 2's messages come again from
/// its new leader, flagged `redelivered`, and every message ends acked once.
fn unacked_deliveries_come_back_flagged(cluster: &mut Cluster) {
    const COUNT: u64 = 300;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let node2: SocketAddr = cluster.nodes[&2].protocol;
    let node3: SocketAddr = cluster.nodes[&3].protocol;
    let (client, mut consumer) = runtime.block_on(async {
        let publisher = Client::connect(node3, client_options())
            .await
            .expect("connect to node 3");
        let messages = (0..COUNT)
            .map(|seq| OutgoingMessage::new(support::body(1_000_000 + seq, 64)))
            .collect();
        for result in publisher.publish_batch("z", messages).await {
            result.expect("confirmed");
        }
        publisher.close().await;
        let client = Client::connect(node2, client_options())
            .await
            .expect("connect to node 2");
        let consumer = client.subscribe("z", 1000).await.expect("subscribe");
        (client, consumer)
    });
    let mut acked: BTreeSet<u64> = BTreeSet::new();
    let mut held: BTreeMap<u64, keratin_client::Delivery> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    runtime.block_on(async {
        while (acked.len() + held.len()) < COUNT as usize {
            let delivery = tokio::time::timeout_at(deadline.into(), consumer.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "before the kill, the consumer through node 2 got {} of {COUNT} \
                         (acked {}, held {})",
                        acked.len() + held.len(),
                        acked.len(),
                        held.len()
                    )
                })
                .expect("the consumer runs");
            let seq = support::seq_of(&delivery.body).expect("intact body");
            if delivery.partition == 2 {
                held.insert(seq, delivery);
            } else {
                delivery.ack().expect("ack");
                acked.insert(seq);
            }
        }
    });
    assert!(!held.is_empty(), "partition 2 delivered some of the 300");
    let held_seqs: BTreeSet<u64> = held.keys().copied().collect();
    cluster.kill9(3);
    drop(held);
    let mut redelivered = BTreeSet::new();
    runtime.block_on(async {
        while acked.len() < COUNT as usize {
            let delivery = tokio::time::timeout_at(deadline.into(), consumer.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "after node 3's kill the consumer got back {} of the {} held",
                        redelivered.len(),
                        held_seqs.len()
                    )
                })
                .expect("the consumer follows partition 2 to its new leader");
            let seq = support::seq_of(&delivery.body).expect("intact body");
            if held_seqs.contains(&seq) {
                assert!(
                    delivery.redelivered,
                    "seq {seq}, held unacked at the killed leader, came back without redelivered"
                );
                redelivered.insert(seq);
            }
            delivery.ack().expect("ack");
            acked.insert(seq);
        }
        client.close().await;
    });
    assert_eq!(redelivered, held_seqs, "every held delivery came back");
}

#[test]
fn a_publish_resends_to_the_new_leader_after_a_kill() {
    let started = Instant::now();
    let mut cluster = balanced_cluster();
    cluster.declare_spread("z", &[1, 2, 3]);
    eprintln!("leaders spread after {:?}", started.elapsed());
    let sent = cluster.root.path().join("sent");
    let mut publish = spawn_publish(&cluster, 2, &["z", "--count", "100000"], &sent);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        publish.try_wait().expect("wait").is_none(),
        "the publish still runs when the leader is killed"
    );
    let killed_at = Instant::now();
    cluster.kill9(1);
    let deadline = Instant::now() + Duration::from_secs(45);
    while publish.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let cpu = process_cpu(publish.id());
            let _ = publish.kill();
            let _ = publish.wait();
            panic!(
                "keratin publish (--timeout-ms 20000) still ran 45 s after the kill, having \
                 used {cpu:?} of CPU"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = publish.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary: Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or(Value::Null);
    eprintln!(
        "publish with node 1 killed: {summary} ({:?} after the kill)",
        killed_at.elapsed()
    );
    assert!(
        output.status.success() && summary["confirmed"] == 100000 && summary["failed"] == 0,
        "every message confirmed despite the kill: {summary} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (ok, summary, stderr) =
        cluster.cli_json(2, &["consume", "z", "--idle-exit-ms", "3000", "--verify"]);
    eprintln!("consume z through node 2: {summary}");
    // Every confirmed message at least once (a few may be stored twice: see the module docs).
    let distinct =
        summary["received"].as_u64().unwrap_or(0) - summary["duplicates"].as_u64().unwrap_or(0);
    assert!(
        ok && distinct == 100000 && summary["corrupt"] == 0,
        "each confirmed message read back: {summary} {stderr}"
    );
    eprintln!("test took {:?}", started.elapsed());
}
