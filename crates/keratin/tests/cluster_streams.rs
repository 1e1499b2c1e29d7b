//! A stream on three real `keratin serve` processes on 127.0.0.1 (issue 18): declared through
//! one node, its three partitions and its cursor log replicated on all three, leader balancing
//! on. The keys of the test's messages reach every partition. A client connected to one node
//! publishes keyed messages (following 421 to each partition's leader); a reader with a cursor,
//! connected to another node that does not lead the cursor log, is sent to the node leading it
//! (421) and reads them in order per key, then commits. Then a node that leads a stream
//! partition is killed with `kill -9` (the cursor log's leader, which then leads one): the other two elect new leaders, take more publishes through the
//! cursor log's leader, and a reader with the same cursor on the other node resumes exactly
//! after the committed position, reading every message published after it once, in order per
//! key. The killed node restarts and catches up with the messages
//! published while it was down. Then the cursor log's leader is stopped (SIGSTOP) until the
//! others elect another: once it runs again its reader with a cursor ends every partition with
//! 421 naming the new leader, and subscribing again resumes there from the commit. It fails if
//! a confirmed message is lost, read twice or out of order, if the cursor is lost, or if the
//! cluster does not serve again within 30 s.
//!
//! Before anything is published the stream's partitions must be led by three different nodes
//! within 30 s (the declare rotates preferred leaders, leader balancing hands each partition
//! there), so that the node killed leads one partition and the others go on.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use keratin_client::proto::codes::ERR_NOT_LEADER;
use keratin_client::proto::StreamStart;
use keratin_client::{
    Client, ClientOptions, OutgoingMessage, StreamConsumer, StreamSettings, StreamSubscribeOptions,
};
use support::cluster::Cluster;

const STREAM: &str = "events";
/// The stream's partitions, their leaders on three different nodes.
const PARTITIONS: u32 = 3;
const CURSOR: &str = "billing";
const KEYS: u64 = 5;
/// Messages published before the failover, read and committed before it, then after it.
const FIRST: u64 = 100;
const READ_BEFORE: u64 = 60;
const SECOND: u64 = 40;
/// The cluster serves again within this.
const RECOVERY_MAX: Duration = Duration::from_secs(30);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn connect(cluster: &Cluster, id: u64) -> Client {
    let addr = cluster.nodes[&id].protocol;
    let options = ClientOptions {
        publish_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    };
    Client::connect(addr, options)
        .await
        .unwrap_or_else(|e| panic!("connect to node {id}: {e}"))
}

/// Message `n`: key `n % KEYS`, body its number.
fn message(n: u64) -> OutgoingMessage {
    OutgoingMessage::new(n.to_string().into_bytes()).with_routing_key(format!("k{}", n % KEYS))
}

/// Publishes messages `from..from + count`, each confirmed, retrying through elections.
async fn publish(client: &Client, from: u64, count: u64) {
    for n in from..from + count {
        let deadline = Instant::now() + RECOVERY_MAX;
        loop {
            match client.publish(STREAM, message(n)).await {
                Ok(_) => break,
                Err(error) => {
                    assert!(Instant::now() < deadline, "publish {n}: {error}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// A reader with the test's cursor, starting at the first message where it has no position.
async fn subscribe(client: &Client) -> StreamConsumer {
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let options = StreamSubscribeOptions::new(STREAM)
            .cursor(CURSOR)
            .start(StreamStart::First)
            .credit(32);
        match client.stream_subscribe(options).await {
            Ok(consumer) => return consumer,
            Err(error) => {
                assert!(Instant::now() < deadline, "subscribe: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Reads `count` messages: their numbers in the order read.
async fn read(consumer: &mut StreamConsumer, count: u64) -> Vec<u64> {
    read_placed(consumer, count)
        .await
        .into_iter()
        .map(|(_, _, n)| n)
        .collect()
}

/// Reads `count` messages: (partition, offset, number) in the order read.
async fn read_placed(consumer: &mut StreamConsumer, count: u64) -> Vec<(u32, u64, u64)> {
    let mut numbers = Vec::new();
    while (numbers.len() as u64) < count {
        let delivery = tokio::time::timeout(RECOVERY_MAX, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("read {} of {count} within {RECOVERY_MAX:?}", numbers.len()))
            .unwrap_or_else(|| panic!("the reader ended: {:?}", consumer.end_error()));
        let n: u64 = std::str::from_utf8(&delivery.body)
            .expect("utf-8")
            .parse()
            .expect("a number");
        assert_eq!(delivery.routing_key, Some(format!("k{}", n % KEYS)));
        numbers.push((delivery.partition, delivery.offset, n));
    }
    numbers
}

/// Checks that `numbers` holds each key's messages in publish order.
fn in_order_per_key(numbers: &[u64]) {
    let mut last: BTreeMap<u64, u64> = BTreeMap::new();
    for n in numbers {
        if let Some(before) = last.insert(n % KEYS, *n) {
            assert!(
                before < *n,
                "key {}: {n} after {before}: {numbers:?}",
                n % KEYS
            );
        }
    }
}

/// Waits until the stream's partitions are led by three different nodes (the declare rotates
/// their preferred leaders; leader balancing hands each there), within [`RECOVERY_MAX`]; the
/// leaders by partition.
fn wait_stream_spread(cluster: &Cluster) -> Vec<u64> {
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let leaders = cluster.stream_leaders(STREAM);
        if let Some(leaders) = leaders.as_ref().filter(|l| support::cluster::spread(l)) {
            return leaders.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the stream's partitions not led by three nodes within {RECOVERY_MAX:?}: \
             {leaders:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The node that says it leads the stream's cursor log, among the running ones but `except`
/// (a stopped process would keep the admin request waiting).
fn wait_cursor_leader(cluster: &Cluster, except: Option<u64>) -> u64 {
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let leading: Vec<u64> = cluster
            .nodes
            .keys()
            .copied()
            .filter(|id| Some(*id) != except)
            .filter(|id| {
                cluster
                    .stream_document(*id, STREAM)
                    .is_some_and(|d| d["cursor_log"]["leading"] == true)
            })
            .collect();
        if let [id] = leading[..] {
            return id;
        }
        assert!(
            Instant::now() < deadline,
            "no single cursor log leader within {RECOVERY_MAX:?}: {leading:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_replicated_stream_keeps_its_messages_and_cursor_across_a_leader_kill() {
    // Every partition gets messages: the keys' partitions (`crc32c(key) mod partitions`)
    // cover them all.
    let covered: std::collections::BTreeSet<u32> = (0..KEYS)
        .map(|k| crc32c::crc32c(format!("k{k}").as_bytes()) % PARTITIONS)
        .collect();
    assert_eq!(
        covered.len(),
        PARTITIONS as usize,
        "the keys reach every partition"
    );
    // Leader balancing on: the stream's partitions get leaders on the three nodes.
    let balance = (1..=3)
        .map(|id| (id, vec![("KERATIN_CLUSTER__LEADER_BALANCE", "true")]))
        .collect();
    let mut cluster = Cluster::start_with_env(balance);
    let rt = runtime();
    let (first_home, read_first) = rt.block_on(async {
        let admin = connect(&cluster, 1).await;
        let settings = StreamSettings {
            partitions: PARTITIONS,
            replicas: Some(3),
            ..StreamSettings::default()
        };
        // The metadata group may still be electing its first leader.
        let deadline = Instant::now() + RECOVERY_MAX;
        while let Err(error) = admin.declare_stream(STREAM, settings.clone()).await {
            assert!(Instant::now() < deadline, "declare: {error}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let leaders = wait_stream_spread(&cluster);
        let home = wait_cursor_leader(&cluster, None);
        let publisher_node = if home == 2 { 3 } else { 2 };
        let reader_node = [1, 2, 3]
            .into_iter()
            .find(|id| *id != home && *id != publisher_node)
            .expect("a third node");
        println!(
            "stream partitions led by nodes {leaders:?}; the cursor log by node {home}; \
             publisher on node {publisher_node}, reader on node {reader_node}"
        );
        publish(&connect(&cluster, publisher_node).await, 0, FIRST).await;

        // Connected to a node that does not lead the cursor log: sent on to the one that does.
        let reader_client = connect(&cluster, reader_node).await;
        let mut reader = subscribe(&reader_client).await;
        let placed = read_placed(&mut reader, READ_BEFORE).await;
        // `stream info`'s start is where `--from first` begins: the first message's offset,
        // not the offsets of the replicated log's own entries before it (before: 0, with the
        // first message at 2 or 3).
        let mut first_read: BTreeMap<u32, u64> = BTreeMap::new();
        for (partition, offset, _) in &placed {
            first_read.entry(*partition).or_insert(*offset);
        }
        for (partition, offset) in &first_read {
            let leader = leaders[*partition as usize];
            let document = cluster
                .stream_document(leader, STREAM)
                .expect("stream document");
            assert_eq!(
                document["partitions"][*partition as usize]["start"].as_u64(),
                Some(*offset),
                "partition {partition}'s start as its leader (node {leader}) shows it, against \
                 the first offset read from it: {document}"
            );
        }
        let numbers: Vec<u64> = placed.into_iter().map(|(_, _, n)| n).collect();
        in_order_per_key(&numbers);
        reader.commit().await.expect("commit");
        reader.cancel().await.expect("cancel");
        (home, numbers)
    });

    // The node killed leads a stream partition: the cursor log's leader when it leads one too
    // (kill -9 takes both), else partition 0's leader.
    let leaders = cluster.stream_leaders(STREAM).unwrap_or_default();
    let victim = if leaders.contains(&first_home) {
        first_home
    } else {
        leaders[0]
    };
    let led: Vec<usize> = (0..leaders.len())
        .filter(|p| leaders[*p] == victim)
        .collect();
    cluster.kill9(victim);
    let killed_at = Instant::now();
    let second_home = wait_cursor_leader(&cluster, None);
    assert_ne!(second_home, victim);
    // The publisher on the cursor log's leader, the reader on the other node left.
    let other = [1, 2, 3]
        .into_iter()
        .find(|id| *id != victim && *id != second_home)
        .expect("the other node left");
    rt.block_on(async {
        let client = connect(&cluster, second_home).await;
        publish(&client, FIRST, SECOND).await;
        let published = killed_at.elapsed();
        let reader_client = connect(&cluster, other).await;
        let mut reader = subscribe(&reader_client).await;
        let numbers = read(&mut reader, FIRST - READ_BEFORE + SECOND).await;
        in_order_per_key(&numbers);
        let mut sorted = numbers.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            numbers.len(),
            "a message read twice after the failover: {numbers:?}"
        );
        // The cursor resumed at its committed position: exactly what the first reader had not
        // read, and everything published after the failover.
        let expected: Vec<u64> = (0..FIRST + SECOND)
            .filter(|n| !read_first.contains(n))
            .collect();
        assert_eq!(sorted, expected, "read after the failover");
        let quiet = tokio::time::timeout(Duration::from_millis(500), reader.recv()).await;
        assert!(
            quiet.is_err(),
            "more messages than were published: {quiet:?}"
        );
        reader.cancel().await.expect("cancel");
        let now = cluster.stream_leaders(STREAM);
        println!(
            "node {victim} killed (it led stream partitions {led:?} of {leaders:?}; the \
             cursor log was led by node {first_home}): the cursor log led by node \
             {second_home}, the partitions by {now:?}; {SECOND} published through node \
             {second_home} {published:?} after the kill, read through node {other} from the \
             committed position"
        );
    });

    // The killed node catches up with what was published while it was down.
    cluster.start_node(victim);
    let deadline = Instant::now() + RECOVERY_MAX;
    loop {
        let messages = cluster
            .stream_document(victim, STREAM)
            .and_then(|d| d["messages"].as_u64());
        if messages == Some(FIRST + SECOND) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {victim} holds {messages:?} of {} messages",
            FIRST + SECOND
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The cursor log's leader stops for a while (SIGSTOP) and the others elect another: once
    // it runs again, its reader with a cursor ends every partition with 421 naming the new
    // leader, and subscribing again goes there and resumes from the commit.
    let home = wait_cursor_leader(&cluster, None);
    rt.block_on(async {
        let client = connect(&cluster, home).await;
        let mut reader = subscribe(&client).await;
        let numbers = read(&mut reader, 10).await;
        in_order_per_key(&numbers);
        reader.commit().await.expect("commit");
        cluster.signal(home, "-STOP");
        let next_home = wait_cursor_leader(&cluster, Some(home));
        cluster.signal(home, "-CONT");
        let next_addr = cluster.nodes[&next_home].protocol.to_string();
        let deadline = Instant::now() + RECOVERY_MAX;
        let mut ends = BTreeMap::new();
        while ends.len() < PARTITIONS as usize {
            assert!(
                Instant::now() < deadline,
                "the reader on node {home} did not end after it stopped leading: {ends:?}"
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), reader.recv()).await;
            for (partition, error) in reader.take_partition_ends() {
                assert_eq!(
                    error.code(),
                    ERR_NOT_LEADER,
                    "partition {partition}: {error}"
                );
                ends.insert(partition, error.leader_addr().map(str::to_owned));
            }
        }
        assert!(
            ends.values()
                .all(|addr| addr.as_deref() == Some(next_addr.as_str())),
            "the ends name node {next_home} ({next_addr}): {ends:?}"
        );
        drop(reader);
        let mut again = subscribe(&client).await;
        let more = read(&mut again, FIRST - READ_BEFORE + SECOND - 10).await;
        assert!(
            more.iter().all(|n| !numbers.contains(n)),
            "resumed after the commit: {more:?}"
        );
        again.cancel().await.expect("cancel");
    });
}
