//! An idle empty queue hands its segment back, against the real binary, with the startup
//! settings `storage.idle_release_after_ms` and `storage.commit_workers` given through the
//! environment: publish and consume one message, wait past the idle time, and the queue's
//! partition directory holds no segment file any more (its `disk_bytes` is 0); the queue then
//! takes publishes again, and after a restart every later message is still there and offsets go
//! on (a message published after the hand-back is delivered after the restart, once).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::Server;

const IDLE_MS: &str = "300";

fn start(data: &Path) -> Server {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_keratin"));
    command
        .env("KERATIN_STORAGE__IDLE_RELEASE_AFTER_MS", IDLE_MS)
        .env("KERATIN_STORAGE__COMMIT_WORKERS", "2");
    Server::start_with(
        command,
        &[
            "serve",
            "--data-dir",
            data.to_str().expect("utf-8 path"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    )
}

async fn connect(server: &Server) -> Client {
    Client::connect(
        server.protocol,
        ClientOptions {
            name: "idle-release".into(),
            ..ClientOptions::default()
        },
    )
    .await
    .expect("connect")
}

/// Segment files (`*.seg`) anywhere under `dir`, outside the pool's spares directories.
fn segment_files(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if !path.ends_with("spares") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "seg") {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

async fn disk_bytes(client: &Client, queue: &str) -> u64 {
    let info = client.info(queue).await.expect("info");
    info.partitions.iter().map(|p| p.disk_bytes).sum()
}

async fn consume_one(client: &Client, queue: &str, expected: &[u8]) {
    let mut consumer = client.subscribe(queue, 1).await.expect("subscribe");
    let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.recv())
        .await
        .expect("a delivery within 20 s")
        .expect("delivery");
    assert_eq!(&delivery.body[..], expected);
    delivery.ack().expect("ack");
    consumer.cancel().await.expect("cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_empty_queue_hands_its_segment_back_and_goes_on_after_a_restart() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let queues = data.join("queues");
    let mut server = start(&data);
    let client = connect(&server).await;
    client
        .declare("idle", QueueSettings::default())
        .await
        .expect("declare");
    assert!(
        segment_files(&queues).is_empty(),
        "a declared queue holds no segment before its first publish: {:?}",
        segment_files(&queues)
    );
    client
        .publish("idle", OutgoingMessage::new(b"first".to_vec()))
        .await
        .expect("publish");
    assert_eq!(
        segment_files(&queues).len(),
        1,
        "the first publish creates one segment"
    );
    assert!(disk_bytes(&client, "idle").await > 0);
    consume_one(&client, "idle", b"first").await;

    // Idle and empty: the segment goes back to the pool within the idle time (plus a margin
    // for a loaded machine).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if segment_files(&queues).is_empty() && disk_bytes(&client, "idle").await == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the idle queue still holds {:?} ({} bytes) 20 s after its last message",
            segment_files(&queues),
            disk_bytes(&client, "idle").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // It takes publishes again; this one is kept across a restart.
    client
        .publish("idle", OutgoingMessage::new(b"second".to_vec()))
        .await
        .expect("publish after the hand-back");
    drop(client);
    assert!(server.terminate(Duration::from_secs(30)), "clean shutdown");
    let server = start(&data);
    let client = connect(&server).await;
    let info = client.info("idle").await.expect("info after restart");
    let ready: u64 = info.partitions.iter().map(|p| p.ready).sum();
    assert_eq!(
        ready, 1,
        "only the message published after the hand-back is left"
    );
    consume_one(&client, "idle", b"second").await;
    drop(server);
}
