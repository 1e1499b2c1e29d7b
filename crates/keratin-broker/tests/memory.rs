//! Memory does not grow per queued message: 1,000,000 messages published (confirmed) and never
//! delivered add at most 16 MiB of resident memory. Bodies stay on disk, ready messages are a
//! range of offsets, and the log keeps only a sparse index. The test warms up first (the same
//! batch sizes, so that the allocator and the runtime reach their steady state), reads VmRSS
//! from `/proc/self/status`, publishes, and reads it again. It fails if the broker or the log
//! keeps anything per message (a 16-byte entry per message is already 16 MB), or if publishing
//! leaks buffers.

mod common;

use std::time::Instant;

use common::*;
use keratin_broker::{Broker, Message, QueueSettings};

/// Messages that must fit in the memory bound.
const MESSAGES: u64 = 1_000_000;
/// Confirmed publishes of this many messages each.
const BATCH: u64 = 1_000;
/// Warm-up messages before the first reading.
const WARM_UP: u64 = 20_000;
/// The bound of the issue: 16 MB, read as 16 MiB.
const RSS_GROWTH_MAX_BYTES: u64 = 16 << 20;

/// Resident set size of this process, from the `VmRSS` line of `/proc/self/status`.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("a VmRSS line");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

async fn publish_range(broker: &Broker, from: u64, to: u64) {
    let mut seq = from;
    while seq < to {
        let end = (seq + BATCH).min(to);
        // 32-byte bodies: the message payload is a few bytes more (format, key, header count).
        let messages: Vec<Message> = (seq..end).map(|s| Message::new(body(s, 32))).collect();
        for result in broker.publish("q", messages).await {
            result.expect("publish");
        }
        seq = end;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_queued_messages_fit_in_16_mib() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Production-sized segments: the index per segment is what a real node keeps.
    let mut config = config(tmp.path().join("data"));
    config.segment_size_bytes = keratin_log::DEFAULT_SEGMENT_SIZE_BYTES;
    let broker = Broker::open(config).await.expect("open");
    broker
        .declare("q", QueueSettings::default())
        .await
        .expect("declare");
    publish_range(&broker, 0, WARM_UP).await;
    let before = rss_bytes();
    let started = Instant::now();
    publish_range(&broker, WARM_UP, WARM_UP + MESSAGES).await;
    let after = rss_bytes();
    let info = broker.info("q").expect("info");
    assert_eq!(info.ready(), WARM_UP + MESSAGES, "every message is queued");
    let growth = after.saturating_sub(before);
    eprintln!(
        "RSS {} KiB before, {} KiB after {MESSAGES} queued messages: +{} KiB \
         ({:.1} bytes per message; published in {:.1?}; {} MiB on disk)",
        before >> 10,
        after >> 10,
        growth >> 10,
        growth as f64 / MESSAGES as f64,
        started.elapsed(),
        info.disk_bytes() >> 20,
    );
    assert!(
        growth <= RSS_GROWTH_MAX_BYTES,
        "{MESSAGES} queued messages added {} KiB of resident memory; the bound is {} KiB",
        growth >> 10,
        RSS_GROWTH_MAX_BYTES >> 10
    );
    broker.shutdown().await.expect("shutdown");
}
