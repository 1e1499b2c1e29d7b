//! Streams under the node's limits, against the real binary (issue 18):
//! - on a 256 MiB tmpfs (root only; see `support::privileged`), a stream without retention
//!   fills the disk like a queue: its publishes are refused with `ERR_LIMITED` reason `disk`
//!   while reading goes on; a retention change frees the space and publishes resume;
//! - on a 256 MiB tmpfs, a stream whose retention fits the disk takes more than the disk holds
//!   and the node never leaves the normal level;
//! - a cursor's commit survives `kill -9`: the reader resumes after it.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::{
    Client, ClientError, ClientOptions, OutgoingMessage, StreamRetentionUpdate, StreamSettings,
    StreamStart, StreamSubscribeOptions, Update,
};
use support::*;

const BODY_BYTES: usize = 16 * 1024;

/// The tests of this file run one at a time: each drives a broker at full speed.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn connect(addr: SocketAddr) -> Client {
    Client::connect(
        addr,
        ClientOptions {
            name: "stream-limits-test".into(),
            publish_timeout: Duration::from_secs(2),
            ..ClientOptions::default()
        },
    )
    .await
    .expect("connect")
}

fn serve(config: &Path) -> Server {
    Server::start(&[
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ])
}

fn disk_level(http: SocketAddr) -> String {
    status(http)["filesystems"][0]["level"]
        .as_str()
        .unwrap_or("?")
        .to_string()
}

/// The levels the node's first file system went through, sampled every 25 ms until `stop`.
fn watch_levels(http: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut levels: Vec<String> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let level = disk_level(http);
            if levels.last() != Some(&level) {
                levels.push(level);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        levels
    })
}

/// Publishes batches of 16 KiB messages until one is refused or `bytes` are confirmed (or
/// `deadline` passes): the confirmed count and the refusal.
async fn publish(
    client: &Client,
    stream: &str,
    bytes: u64,
    deadline: Duration,
) -> (u64, Option<ClientError>) {
    let started = Instant::now();
    let mut confirmed = 0u64;
    while confirmed * (BODY_BYTES as u64) < bytes && started.elapsed() < deadline {
        let messages = (0..16)
            .map(|i| OutgoingMessage::new(body(confirmed + i, BODY_BYTES)))
            .collect();
        for result in client.publish_batch(stream, messages).await {
            match result {
                Ok(_) => confirmed += 1,
                Err(failed) => return (confirmed, Some(failed.error)),
            }
        }
    }
    (confirmed, None)
}

/// Reads `count` messages from the start of `stream` (checking each body's checksum).
async fn read_from_first(client: &Client, stream: &str, count: usize) {
    let mut reader = client
        .stream_subscribe(StreamSubscribeOptions::new(stream).start(StreamStart::First))
        .await
        .expect("subscribe");
    for _ in 0..count {
        let delivery = tokio::time::timeout(Duration::from_secs(10), reader.recv())
            .await
            .expect("a message within 10 s")
            .expect("the reader goes on");
        assert!(seq_of(&delivery.body).is_some(), "an intact body");
    }
    reader.cancel().await.expect("cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_retention_is_limited_for_disk_and_resumes_after_a_retention_change() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged(
        "a_stream_without_retention_is_limited_for_disk_and_resumes_after_a_retention_change",
    ) {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let _fs = Tmpfs::mount(&data, 256);
    let config = small_fs_config(tmp.path(), &[&data], 0.40, 0.25, 0.10);
    let server = serve(&config);
    let client = connect(server.protocol).await;
    client
        .declare_stream("events", StreamSettings::default())
        .await
        .expect("declare");
    let (confirmed, refused) =
        publish(&client, "events", 512 << 20, Duration::from_secs(120)).await;
    let refused = refused.unwrap_or_else(|| {
        panic!("a 256 MiB file system took 512 MiB ({confirmed} messages) without a refusal")
    });
    assert_eq!(refused.reason(), Some("disk"), "{refused}");
    assert!(
        confirmed * (BODY_BYTES as u64) > 64 << 20,
        "refused only once the disk is well used: {confirmed} messages"
    );
    // Reading is never refused by a level.
    read_from_first(&client, "events", 100).await;
    // Retention that fits the disk frees it; publishes resume.
    client
        .set_stream(
            "events",
            StreamRetentionUpdate {
                max_bytes: Update::Set(32 << 20),
                ..StreamRetentionUpdate::default()
            },
        )
        .await
        .expect("set retention");
    let resumed = Instant::now();
    loop {
        let (more, refused) = publish(&client, "events", 1 << 20, Duration::from_secs(5)).await;
        if refused.is_none() && more > 0 {
            break;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(30),
            "publishes resume within 30 s of the retention change: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let info = client.stream_info("events").await.expect("info");
    let disk: u64 = info.partitions.iter().map(|p| p.disk_bytes).sum();
    assert!(
        disk < 64 << 20,
        "retention removed the old segments: {disk} bytes"
    );
    assert!(info.partitions[0].start_offset > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_retention_fits_never_leaves_normal() {
    let _serial = ONE_AT_A_TIME.lock().await;
    if !privileged("a_stream_whose_retention_fits_never_leaves_normal") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let _fs = Tmpfs::mount(&data, 256);
    let config = small_fs_config(tmp.path(), &[&data], 0.40, 0.25, 0.10);
    let server = serve(&config);
    let client = connect(server.protocol).await;
    client
        .declare_stream(
            "metrics",
            StreamSettings {
                partitions: 2,
                max_bytes: Some(48 << 20),
                ..StreamSettings::default()
            },
        )
        .await
        .expect("declare");
    let stop = Arc::new(AtomicBool::new(false));
    let levels = watch_levels(server.http, stop.clone());
    // 384 MiB through a 256 MiB file system.
    let (confirmed, refused) =
        publish(&client, "metrics", 384 << 20, Duration::from_secs(240)).await;
    stop.store(true, Ordering::Relaxed);
    let levels = levels.join().expect("levels");
    assert!(
        refused.is_none(),
        "never refused: {refused:?} after {confirmed}"
    );
    assert_eq!(
        confirmed * (BODY_BYTES as u64),
        384 << 20,
        "everything confirmed within the deadline"
    );
    assert_eq!(levels, vec!["normal".to_string()], "the level never moved");
    read_from_first(&client, "metrics", 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_cursor_survives_kill_9() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let data_arg = data.to_str().expect("utf8").to_string();
    let args = [
        "serve",
        "--data-dir",
        data_arg.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ];
    let mut server = Server::start(&args);
    let client = connect(server.protocol).await;
    client
        .declare_stream("s", StreamSettings::default())
        .await
        .expect("declare");
    let messages = (0..100)
        .map(|i| OutgoingMessage::new(body(i, 64)))
        .collect();
    for result in client.publish_batch("s", messages).await {
        result.expect("publish");
    }
    let mut reader = client
        .stream_subscribe(
            StreamSubscribeOptions::new("s")
                .cursor("c")
                .start(StreamStart::First)
                .credit(40),
        )
        .await
        .expect("subscribe");
    let mut last = 0;
    for _ in 0..40 {
        let delivery = reader.recv().await.expect("a message");
        last = seq_of(&delivery.body).expect("intact");
    }
    assert_eq!(last, 39);
    reader.commit().await.expect("commit");
    server.kill9();
    drop(client);
    let server = Server::start(&args);
    let client = connect(server.protocol).await;
    let mut reader = client
        .stream_subscribe(
            StreamSubscribeOptions::new("s")
                .cursor("c")
                .start(StreamStart::First),
        )
        .await
        .expect("subscribe again");
    let first = tokio::time::timeout(Duration::from_secs(10), reader.recv())
        .await
        .expect("within 10 s")
        .expect("a message");
    assert_eq!(seq_of(&first.body), Some(40), "resumed after the commit");
}
