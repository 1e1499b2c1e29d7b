//! Resource limits against the real binary on size-limited tmpfs file systems (root only; see
//! `support::privileged`). A confirmed publisher at full speed with no consumer fills a 128 MiB
//! tmpfs: publishes are slowed at soft, then fail with ERR_LIMITED reason `disk`; free space never
//! falls below the reserve; no log stops; memory stays flat; consuming everything frees the space
//! and publishes resume within 2 s without flapping; every confirmed message is delivered, checked
//! by sequence number and checksum. Also: two storage file systems (only the full one is
//! limited), a file system filled by another program (logs stop, the broker stays up, heals by
//! itself), starting on a file system already past hard, and the client's behaviour on hints.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::{BufferedOptions, Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::*;
use tokio::task::JoinSet;

const BODY_BYTES: usize = 16 * 1024;

/// The tests of this file run one at a time: each drives a broker at full speed, and four at
/// once on two cores turn timing margins (publish timeouts, the 2 s resume) into noise.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn connect(addr: SocketAddr, publish_timeout: Duration) -> Client {
    Client::connect(
        addr,
        ClientOptions {
            name: "limits-test".into(),
            publish_timeout,
            ..ClientOptions::default()
        },
    )
    .await
    .expect("connect")
}

/// What a publisher run saw.
#[derive(Debug, Default)]
struct Published {
    confirmed: BTreeSet<u64>,
    errors: std::collections::BTreeMap<String, u64>,
    next_seq: u64,
}

/// Publish confirmed messages, `in_flight` at once, until `stop_after_limited` publishes
/// failed with 429 or `deadline` passes.
async fn publish_until_limited(
    client: &Client,
    queue: &str,
    first_seq: u64,
    in_flight: usize,
    stop_after_limited: u64,
    deadline: Duration,
    routing_key: Option<&str>,
) -> Published {
    let started = Instant::now();
    let mut out = Published {
        next_seq: first_seq,
        ..Published::default()
    };
    let mut tasks = JoinSet::new();
    let limited = Arc::new(AtomicU64::new(0));
    loop {
        while tasks.len() < in_flight
            && limited.load(Ordering::Relaxed) < stop_after_limited
            && started.elapsed() < deadline
        {
            let seq = out.next_seq;
            out.next_seq += 1;
            let client = client.clone();
            let queue = queue.to_string();
            let limited = limited.clone();
            let key = routing_key.map(str::to_string);
            tasks.spawn(async move {
                let mut message = OutgoingMessage::new(body(seq, BODY_BYTES));
                if let Some(key) = key {
                    message = message.with_routing_key(key);
                }
                let result = client.publish(&queue, message).await;
                let key = result.as_ref().err().map(|f| {
                    f.error
                        .code_key()
                        .unwrap_or_else(|| format!("other: {}", f.error))
                });
                if key.as_deref().is_some_and(|k| k.starts_with("429")) {
                    limited.fetch_add(1, Ordering::Relaxed);
                }
                (seq, key)
            });
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        let (seq, error) = joined.expect("publish task");
        match error {
            None => {
                out.confirmed.insert(seq);
            }
            Some(key) => *out.errors.entry(key).or_default() += 1,
        }
    }
    out
}

/// Consume and ack until `expected` distinct confirmed messages were seen (or 60 s).
async fn drain(client: &Client, queue: &str, expected: &BTreeSet<u64>) -> BTreeSet<u64> {
    let mut consumer = client.subscribe(queue, 500).await.expect("subscribe");
    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !expected.is_subset(&seen) && Instant::now() < deadline {
        let Ok(Some(delivery)) =
            tokio::time::timeout(Duration::from_secs(5), consumer.recv()).await
        else {
            break;
        };
        let seq = seq_of(&delivery.body).expect("every delivered body passes its checksum");
        seen.insert(seq);
        delivery.ack().expect("ack");
    }
    seen
}

/// Poll the status document in the background and record the level sequence of filesystem 0.
fn watch_levels(http: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut levels: Vec<String> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let doc = status(http);
            let level = doc["filesystems"][0]["level"]
                .as_str()
                .unwrap_or("?")
                .to_string();
            if levels.last() != Some(&level) {
                levels.push(level);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        levels
    })
}

/// Track the smallest free space seen on `path`.
fn watch_free(path: &Path, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let mut min_free = u64::MAX;
        while !stop.load(Ordering::Relaxed) {
            min_free = min_free.min(free_and_total(&path).0);
            std::thread::sleep(Duration::from_millis(5));
        }
        min_free
    })
}

fn level_rank(level: &str) -> u8 {
    match level {
        "normal" => 0,
        "soft" => 1,
        "hard" => 2,
        "reserve" => 3,
        _ => 9,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filling_a_tmpfs_slows_then_rejects_then_resumes() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged("filling_a_tmpfs_slows_then_rejects_then_resumes") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let fs = Tmpfs::mount(&data, 128);
    let (_, total) = free_and_total(&fs.path);
    let config = small_fs_config(tmp.path(), &[&data], 0.40, 0.25, 0.10);
    let reserve_bytes = total / 10;
    let mut server = Server::start(&[
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);
    // Long enough that a publish slowed at soft, or held while the machine is busy, is never
    // mistaken for a failure; a publish rejected at hard still ends after this, as a 429.
    let client = connect(server.protocol, Duration::from_secs(5)).await;
    client
        .declare("fill", QueueSettings::default())
        .await
        .expect("declare");
    let stop = Arc::new(AtomicBool::new(false));
    let levels = watch_levels(server.http, stop.clone());
    let min_free = watch_free(&data, stop.clone());
    let rss_before = server.rss_bytes();

    let published =
        publish_until_limited(&client, "fill", 0, 32, 50, Duration::from_secs(90), None).await;
    eprintln!(
        "confirmed {} messages, errors {:?}",
        published.confirmed.len(),
        published.errors
    );
    assert!(
        published.errors.get("429:disk").copied().unwrap_or(0) >= 1,
        "publishes must fail with ERR_LIMITED reason disk: {:?}",
        published.errors
    );
    assert_eq!(
        published
            .errors
            .keys()
            .filter(|k| !k.starts_with("429:disk"))
            .count(),
        0,
        "only disk limits, no other failure: {:?}",
        published.errors
    );
    let delayed = metric(server.http, "keratin_publishes_delayed_total", "disk");
    assert!(delayed > 0.0, "publishes were slowed between soft and hard");
    let info = client.info("fill").await.expect("info");
    assert!(!info.partitions.is_empty());
    let doc = status(server.http);
    let level = doc["filesystems"][0]["level"]
        .as_str()
        .unwrap_or("?")
        .to_string();
    assert!(
        level_rank(&level) >= 2,
        "at hard or deeper after the fill: {doc}"
    );
    let queues: serde_json::Value =
        serde_json::from_str(&http_get(server.http, "/api/v1/queues")).expect("json");
    for p in queues["queues"][0]["partitions"]
        .as_array()
        .expect("partitions")
    {
        assert_eq!(p["stopped"], false, "no log stopped: {p}");
    }
    let rss_after = server.rss_bytes();
    assert!(
        rss_after < rss_before + (64 << 20),
        "memory stays flat: {} -> {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );

    // A confirmed publish at hard retries on the hint and succeeds once space is freed.
    let patient = connect(server.protocol, Duration::from_secs(20)).await;
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let result = patient
            .publish("fill", OutgoingMessage::new(body(u64::MAX - 1, 64)))
            .await;
        (result.map(|c| c.attempts), started.elapsed())
    });
    // Buffered publishes at hard are reported on the dropped path with the reason.
    let (buffered, mut dropped) =
        client.buffered_publisher("fill", BufferedOptions { capacity: 16 });
    buffered
        .send(OutgoingMessage::new(body(u64::MAX - 2, 64)))
        .await
        .expect("send buffered");
    let _ = buffered.flush().await;
    let report = tokio::time::timeout(Duration::from_secs(10), dropped.recv())
        .await
        .expect("a dropped report")
        .expect("dropped path open");
    assert_eq!(report.error.code_key().as_deref(), Some("429:disk"));

    // Drain: every confirmed message comes back intact; space is reclaimed.
    let seen = drain(&client, "fill", &published.confirmed).await;
    let missing: Vec<_> = published.confirmed.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "confirmed messages lost: {missing:?}");
    let drained_at = Instant::now();
    // The next accepted publish comes within 2 s of the drain.
    let probe = connect(server.protocol, Duration::from_millis(100)).await;
    let resumed_after = loop {
        let result = probe
            .publish("fill", OutgoingMessage::new(body(u64::MAX - 3, 64)))
            .await;
        if result.is_ok() {
            break drained_at.elapsed();
        }
        assert!(
            drained_at.elapsed() < Duration::from_secs(10),
            "publishes never resumed"
        );
    };
    eprintln!("publishes resumed {resumed_after:?} after the drain");
    assert!(
        resumed_after <= Duration::from_secs(2),
        "resumed after {resumed_after:?}"
    );
    let (attempts, waited) = waiting.await.expect("patient publisher");
    let attempts = attempts.expect("the patient publish succeeds once space returns");
    assert!(
        attempts > 1,
        "it was retried on the hint ({attempts} attempts, {waited:?})"
    );

    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let levels = levels.join().expect("levels");
    let min_free = min_free.join().expect("free");
    eprintln!("levels seen: {levels:?}; least free {} MiB", min_free >> 20);
    assert!(
        min_free >= reserve_bytes,
        "free space fell below the reserve"
    );
    // No flapping: up to the peak, then down, never back up.
    let ranks: Vec<u8> = levels.iter().map(|l| level_rank(l)).collect();
    let peak = ranks
        .iter()
        .position(|r| *r == *ranks.iter().max().unwrap_or(&0))
        .unwrap_or(0);
    assert!(
        ranks[..=peak].windows(2).all(|w| w[0] < w[1]),
        "flapped on the way up: {levels:?}"
    );
    assert!(
        ranks[peak..].windows(2).all(|w| w[0] > w[1]),
        "flapped on the way down: {levels:?}"
    );
    assert_eq!(levels.last().map(String::as_str), Some("normal"));
    assert!(server.alive());
    assert!(server.terminate(Duration::from_secs(20)), "clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_full_file_system_is_limited() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged("only_the_full_file_system_is_limited") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let _fa = Tmpfs::mount(&a, 64);
    let _fb = Tmpfs::mount(&b, 64);
    let config = small_fs_config(tmp.path(), &[&a, &b], 0.40, 0.25, 0.10);
    let server = Server::start(&[
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);
    let client = connect(server.protocol, Duration::from_millis(800)).await;
    client
        .declare(
            "two",
            QueueSettings {
                partitions: 2,
                ..QueueSettings::default()
            },
        )
        .await
        .expect("declare");
    let queues: serde_json::Value =
        serde_json::from_str(&http_get(server.http, "/api/v1/queues/two")).expect("json");
    let dirs: Vec<String> = queues["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .map(|p| p["dir"].as_str().unwrap_or("").to_string())
        .collect();
    assert_ne!(
        dirs[0], dirs[1],
        "partitions spread over both file systems: {dirs:?}"
    );
    // Routing keys go to partition crc32c(key) % partitions: find one key per partition.
    let key_for = |partition: u32| {
        (0..1000)
            .map(|i| format!("k{i}"))
            .find(|k| crc32c::crc32c(k.as_bytes()) % 2 == partition)
            .expect("a key")
    };
    let on_a = dirs
        .iter()
        .position(|d| d.starts_with(&a.display().to_string()))
        .expect("a partition on a") as u32;
    let full_key = key_for(on_a);
    let other_key = key_for(1 - on_a);
    // Fill through one key only: its partition's file system reaches hard.
    let filled = publish_until_limited(
        &client,
        "two",
        0,
        16,
        20,
        Duration::from_secs(60),
        Some(&full_key),
    )
    .await;
    assert!(
        filled.errors.get("429:disk").copied().unwrap_or(0) >= 1,
        "{:?}",
        filled.errors
    );
    let doc = status(server.http);
    let levels: Vec<&str> = doc["filesystems"]
        .as_array()
        .expect("filesystems")
        .iter()
        .map(|f| f["level"].as_str().unwrap_or("?"))
        .collect();
    assert!(
        levels.contains(&"normal") && levels.iter().any(|l| level_rank(l) >= 2),
        "one file system limited, the other not: {doc}"
    );
    // The partition on the other file system keeps taking publishes.
    for i in 0..20 {
        client
            .publish(
                "two",
                OutgoingMessage::new(body(2_000_000 + i, 64)).with_routing_key(other_key.clone()),
            )
            .await
            .expect("the other file system is not limited");
    }
    let rejected = client
        .publish(
            "two",
            OutgoingMessage::new(body(3_000_000, 64)).with_routing_key(full_key.clone()),
        )
        .await
        .expect_err("the full file system's partition is limited");
    assert_eq!(rejected.error.code_key().as_deref(), Some("429:disk"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_fill_stops_logs_and_they_heal_by_themselves() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged("an_external_fill_stops_logs_and_they_heal_by_themselves") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let _fs = Tmpfs::mount(&data, 128);
    // Floors at zero and low fractions: the broker's own limits do not trigger before the
    // other program fills the disk.
    let config = small_fs_config(tmp.path(), &[&data], 0.02, 0.01, 0.005);
    let mut server = Server::start(&[
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);
    let client = connect(server.protocol, Duration::from_millis(500)).await;
    client
        .declare("ext", QueueSettings::default())
        .await
        .expect("declare");
    // A few messages before the fill: the queue itself uses little of the file system.
    let mut before = Published::default();
    for seq in 0..200u64 {
        client
            .publish("ext", OutgoingMessage::new(body(seq, BODY_BYTES)))
            .await
            .expect("publish before the fill");
        before.confirmed.insert(seq);
    }
    before.next_seq = 200;
    // Another program fills the file system to 100% while we publish.
    let filler = data.join("filler.bin");
    let dd = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "count=200"])
        .arg(format!("of={}", filler.display()))
        .stderr(std::process::Stdio::null())
        .status()
        .expect("dd");
    assert!(!dd.success(), "dd stops at a full file system");
    assert_eq!(free_and_total(&data).0, 0, "the file system is full");
    let during = publish_until_limited(
        &client,
        "ext",
        before.next_seq,
        8,
        5,
        Duration::from_secs(20),
        None,
    )
    .await;
    eprintln!(
        "during the fill: {} confirmed, {:?}",
        during.confirmed.len(),
        during.errors
    );
    assert!(server.alive(), "the broker stays up");
    assert!(
        during
            .errors
            .keys()
            .any(|k| k.starts_with("503") || k.starts_with("504") || k.starts_with("429")),
        "publishes fail while the disk is full: {:?}",
        during.errors
    );
    std::fs::remove_file(&filler).expect("remove filler");
    // It heals by itself: publishes resume without a restart.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if client
            .publish("ext", OutgoingMessage::new(body(9_000_000, 64)))
            .await
            .is_ok()
        {
            break;
        }
        assert!(Instant::now() < deadline, "the logs never healed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut all: BTreeSet<u64> = before.confirmed.clone();
    all.extend(during.confirmed.iter().copied());
    let seen = drain(&client, "ext", &all).await;
    let missing: Vec<_> = all.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "confirmed messages lost: {missing:?}");
    assert!(server.terminate(Duration::from_secs(20)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starting_past_hard_serves_consumers_and_rejects_publishes() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged("starting_past_hard_serves_consumers_and_rejects_publishes") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let _fs = Tmpfs::mount(&data, 128);
    let config = small_fs_config(tmp.path(), &[&data], 0.40, 0.25, 0.10);
    let args = [
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ];
    let confirmed = {
        let mut server = Server::start(&args);
        let client = connect(server.protocol, Duration::from_millis(500)).await;
        client
            .declare("full", QueueSettings::default())
            .await
            .expect("declare");
        let p = publish_until_limited(&client, "full", 0, 8, 1, Duration::from_secs(3), None).await;
        assert!(server.terminate(Duration::from_secs(20)));
        p.confirmed
    };
    // Another file takes the file system past hard (not to 100%: the reserve is left).
    let (free, total) = free_and_total(&data);
    let keep_free = total * 15 / 100;
    let filler = data.join("filler.bin");
    let f = std::fs::File::create(&filler).expect("filler");
    f.set_len(0).expect("len");
    let status_dd = std::process::Command::new("fallocate")
        .args(["-l", &(free - keep_free).to_string()])
        .arg(&filler)
        .status()
        .expect("fallocate");
    assert!(status_dd.success());
    let server = Server::start(&args);
    let doc = status(server.http);
    assert!(
        level_rank(doc["filesystems"][0]["level"].as_str().unwrap_or("?")) >= 2,
        "{doc}"
    );
    let client = connect(server.protocol, Duration::from_millis(300)).await;
    let rejected = client
        .publish("full", OutgoingMessage::new(body(5_000_000, 64)))
        .await
        .expect_err("publishes are rejected past hard");
    assert_eq!(rejected.error.code_key().as_deref(), Some("429:disk"));
    let seen = drain(&client, "full", &confirmed).await;
    assert!(confirmed.is_subset(&seen), "consumers drain everything");
    std::fs::remove_file(&filler).expect("remove filler");
    let deadline = Instant::now() + Duration::from_secs(10);
    while client
        .publish("full", OutgoingMessage::new(body(5_000_001, 64)))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "publishes never resumed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
