//! Helpers for the broker's integration tests.

#![allow(dead_code)]

pub mod stall_io;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keratin_broker::{Broker, BrokerConfig, Consumer, Delivery, Message};
use keratin_log::{Io, RealIo};

/// 256 KiB segments so that tests roll and reclaim often.
pub const SEGMENT: u64 = 256 << 10;

pub fn config(dir: PathBuf) -> BrokerConfig {
    let mut config = BrokerConfig::new(vec![dir]);
    config.segment_size_bytes = SEGMENT;
    config.pool_background = false;
    config
}

pub fn config_on(io: Arc<dyn Io>, dirs: Vec<PathBuf>) -> BrokerConfig {
    let mut config = BrokerConfig::new(dirs);
    config.segment_size_bytes = SEGMENT;
    config.pool_background = false;
    config.io = io;
    config
}

pub async fn open(dir: &tempfile::TempDir) -> Broker {
    Broker::open(config(dir.path().join("data")))
        .await
        .expect("open broker")
}

pub fn real_io() -> Arc<dyn Io> {
    Arc::new(RealIo::new())
}

/// A body carrying a sequence number and a checksum of itself.
pub fn body(seq: u64, len: usize) -> Vec<u8> {
    let mut b = seq.to_le_bytes().to_vec();
    while b.len() < len.max(12) - 4 {
        b.push((seq as u8).wrapping_add(b.len() as u8));
    }
    let crc = crc32(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// The sequence number of a body made by [`body`], checking its checksum.
pub fn seq_of(body: &[u8]) -> u64 {
    let (data, crc) = body.split_at(body.len() - 4);
    assert_eq!(crc32(data).to_le_bytes(), crc, "body checksum");
    u64::from_le_bytes(data[..8].try_into().expect("8 bytes"))
}

fn crc32(data: &[u8]) -> u32 {
    // FNV-1a is enough to catch a wrong or torn body in a test.
    data.iter().fold(0x811c9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x01000193)
    })
}

pub async fn publish_seq(broker: &Broker, queue: &str, seqs: std::ops::Range<u64>, len: usize) {
    let messages: Vec<Message> = seqs.map(|s| Message::new(body(s, len))).collect();
    for result in broker.publish(queue, messages).await {
        result.expect("publish");
    }
}

pub async fn recv(consumer: &mut Consumer) -> Delivery {
    tokio::time::timeout(Duration::from_secs(10), consumer.recv())
        .await
        .expect("a delivery within 10 s")
        .expect("consumer open")
}

/// Wait briefly and assert nothing more is delivered.
pub async fn assert_idle(consumer: &mut Consumer) {
    let got = tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await;
    assert!(got.is_err(), "unexpected delivery: {got:?}");
}

/// The seed of a randomized test: `KERATIN_SEED` if set, else `default`; printed so that a
/// failure replays.
pub fn seed(default: u64) -> u64 {
    let seed = std::env::var("KERATIN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    eprintln!("seed {seed} (replay with KERATIN_SEED={seed})");
    seed
}

/// Poll `condition` every millisecond until it holds; false if `limit` passes first.
pub async fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
