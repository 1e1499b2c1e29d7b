//! A cgroup memory limit against the real binary (root; cgroup v1 here): the broker finds the
//! limit through `/proc/self/cgroup`, many connections push large unconfirmed publishes at it,
//! publishes get `ERR_LIMITED` reason `memory` before the limit, the kernel never kills the
//! process (`memory.oom_control` says no OOM kill), and publishes resume once memory falls. A
//! failure means the broker ignored the cgroup, let memory run into the limit, or stayed limited.

mod support;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::*;

const LIMIT_BYTES: u64 = 256 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_pressure_rejects_publishes_before_the_cgroup_limit() {
    if !privileged("memory_pressure_rejects_publishes_before_the_cgroup_limit") {
        return;
    }
    if !std::path::Path::new("/sys/fs/cgroup/memory").is_dir() {
        if std::env::var("KERATIN_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
            panic!("no cgroup v1 memory controller at /sys/fs/cgroup/memory");
        }
        eprintln!("!!! SKIPPING: no cgroup v1 memory controller");
        return;
    }
    let cgroup = MemoryCgroup::create(LIMIT_BYTES);
    let tmp = tempfile::Builder::new()
        .prefix("keratin-mem")
        .tempdir_in("/var/tmp")
        .expect("tmp");
    let data = tmp.path().join("data");
    let config = tmp.path().join("keratin.toml");
    std::fs::write(
        &config,
        format!(
            r#"[storage]
dirs = [{data:?}]
segment_bytes = 8388608

[limits]
sample_interval_ms = 50

[limits.memory]
soft_fraction = 0.15
hard_fraction = 0.22
clear_margin_fraction = 0.03
"#,
            data = data.display().to_string()
        ),
    )
    .expect("config");
    let mut shell = Command::new("sh");
    shell.arg("-c").arg(format!(
        "echo $$ > {}/cgroup.procs && exec {} \"$@\"",
        cgroup.path.display(),
        env!("CARGO_BIN_EXE_keratin")
    ));
    shell.arg("keratin");
    let mut server = Server::start_with(
        shell,
        &[
            "serve",
            "--config",
            config.to_str().expect("utf8"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    );
    let doc = status(server.http);
    assert!(
        doc["memory"]["limit_source"]
            .as_str()
            .unwrap_or("")
            .contains("cgroup"),
        "the limit comes from the cgroup: {doc}"
    );
    assert_eq!(doc["memory"]["limit_bytes"], LIMIT_BYTES, "{doc}");

    let setup = Client::connect(server.protocol, ClientOptions::default())
        .await
        .expect("connect");
    setup
        .declare(
            "mem",
            QueueSettings {
                partitions: 4,
                ..QueueSettings::default()
            },
        )
        .await
        .expect("declare");
    // Many connections, each with a large window of unconfirmed 256 KiB publishes.
    let stop = Arc::new(AtomicBool::new(false));
    let limited = Arc::new(AtomicU64::new(0));
    let confirmed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for connection in 0..16u64 {
        let client = Client::connect(
            server.protocol,
            ClientOptions {
                publish_timeout: Duration::from_millis(200),
                ..ClientOptions::default()
            },
        )
        .await
        .expect("connect");
        for lane in 0..8u64 {
            let client = client.clone();
            let (stop, limited, confirmed) = (stop.clone(), limited.clone(), confirmed.clone());
            tasks.push(tokio::spawn(async move {
                let mut seq = (connection * 8 + lane) << 32;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let message = OutgoingMessage::new(body(seq, 256 * 1024));
                    match client.publish("mem", message).await {
                        Ok(_) => {
                            confirmed.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(failed) => {
                            if failed.error.code_key().as_deref() == Some("429:memory") {
                                limited.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }));
        }
    }
    let started = Instant::now();
    let mut peak_rss = 0;
    while started.elapsed() < Duration::from_secs(30) && limited.load(Ordering::Relaxed) < 20 {
        peak_rss = peak_rss.max(server.rss_bytes());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    eprintln!(
        "confirmed {} publishes, {} rejected for memory, peak RSS {} MiB of a {} MiB limit",
        confirmed.load(Ordering::Relaxed),
        limited.load(Ordering::Relaxed),
        peak_rss >> 20,
        LIMIT_BYTES >> 20
    );
    assert!(server.alive(), "the broker was killed");
    assert_eq!(
        cgroup.oom_kills(),
        0,
        "the kernel killed something in the cgroup"
    );
    assert!(
        limited.load(Ordering::Relaxed) > 0,
        "publishes were rejected with ERR_LIMITED reason memory"
    );
    assert!(
        peak_rss < LIMIT_BYTES,
        "resident memory stayed below the limit"
    );
    // Memory falls once the pressure stops, and publishes resume.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ok = setup
            .publish("mem", OutgoingMessage::new(body(1, 64)))
            .await
            .is_ok();
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "publishes never resumed: {}",
            status(server.http)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(server.terminate(Duration::from_secs(20)), "clean shutdown");
}
