//! The `limits` benchmark's cluster case (issue 15, root only): how fast a partition's leader
//! reacts to a follower's disk. Three `Node`s in process on 127.0.0.1, node 3's storage on a
//! size-limited tmpfs (levels scaled to it, sampled every 100 ms), nodes 1 and 2 on the bench
//! directory. A queue of three replicas led by node 1 or 2 (leader balancing puts leaders on
//! the first of each rotated replica set), and a probe publishing one message every
//! millisecond through the leader's broker (answered at once, no client retry in between). A
//! filler file is `fallocate`d on node 3's tmpfs past its hard level (short of reserve): the
//! time until the probe's first `ERR_LIMITED`; the filler is removed: the time until the
//! probe's first accepted publish. The goal is at most two heartbeat intervals (the label
//! rides every ping, 1 s) plus one sample interval; the ratio printed is that bound over the
//! median (at least 1 meets it).

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_broker::{BrokerError, Message, QueueSettings};
use keratin_net::{ClusterConfig, PeerSpec};
use keratin_server::Node;
use serde_json::json;

use crate::broker_bench::runtime;
use crate::contender::BenchResult;
use crate::limits_bench::{free_total, is_root, stamp, tmpfs_settings, wait_stamp, Tmpfs};
use crate::net_bench::node_config;
use crate::report::{median, Report, Row};

/// Sample interval on node 3.
const SAMPLE_MS: u64 = 100;
/// The transport's ping interval, which also carries every node's label.
const HEARTBEAT_MS: u64 = 1000;
/// Queues declared to find one led off node 3.
const CANDIDATES: usize = 6;
const WAIT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Probe {
    ok: AtomicU64,
    limited: AtomicU64,
    /// Probe publishes answered "not the leader" (leadership moved: the figures are void).
    not_leader: AtomicU64,
    /// The first refusal's message, to show it names node 3.
    message: std::sync::Mutex<Option<String>>,
    stop: AtomicBool,
}

fn free_port() -> BenchResult<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

async fn start_nodes(dir: &Path, small: &Path) -> BenchResult<Vec<Node>> {
    let peers: Vec<PeerSpec> = (1..=3)
        .map(|id| {
            Ok(PeerSpec {
                id,
                addr: free_port()?,
            })
        })
        .collect::<BenchResult<_>>()?;
    let mut starting = Vec::new();
    for id in 1..=3u64 {
        let data = if id == 3 {
            small.join("node-3")
        } else {
            dir.join(format!("node-{id}"))
        };
        let mut config = node_config(&data);
        config.storage.segment_bytes = 4 << 20;
        if id == 3 {
            config.limits = tmpfs_settings(SAMPLE_MS);
        }
        config.cluster = Some(ClusterConfig {
            node_id: id,
            listen: None,
            peers: peers.clone(),
            name: "bench-limits".into(),
            join: false,
            leader_balance: true,
            tls: Default::default(),
        });
        starting.push(tokio::spawn(async move { Node::start(&config).await }));
    }
    let mut nodes = Vec::new();
    for handle in starting {
        nodes.push(handle.await??);
    }
    Ok(nodes)
}

/// A queue of three replicas led by node 1 or 2, and its leader's index in `nodes`.
async fn queue_led_off_node_3(nodes: &[Node]) -> BenchResult<(String, usize)> {
    let settings = QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    };
    let deadline = Instant::now() + WAIT;
    let mut refused = None;
    loop {
        for n in 0..CANDIDATES {
            let name = format!("probe{n}");
            if let Err(error) = nodes[0].broker().declare(&name, settings.clone()).await {
                refused = Some(error.to_string());
            }
            // Led by its preferred leader, node 1 or 2 (balancing would move it there).
            for (index, node) in nodes.iter().enumerate().take(2) {
                let leads = node.broker().info(&name).is_ok_and(|info| {
                    info.partitions
                        .first()
                        .is_some_and(|p| p.leading && p.preferred_leader == Some(index as u64 + 1))
                });
                if leads {
                    return Ok((name, index));
                }
            }
        }
        if Instant::now() > deadline {
            return Err(match refused {
                // The bench's nodes 1 and 2 use the file system under test with default
                // limits: a disk already past soft refuses a queue of 3 replicas.
                Some(error) => format!("no queue led by node 1 or 2; the last declare: {error}"),
                None => format!("no queue led by node 1 or 2 within {WAIT:?}"),
            }
            .into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Milliseconds from node 3 past hard to the leader's first 429, and from the space freed to
/// its first accepted publish, per trial.
async fn trials(
    dir: &Path,
    small: &Path,
    count: usize,
) -> BenchResult<(Vec<f64>, Vec<f64>, String)> {
    let nodes = start_nodes(dir, small).await?;
    let (queue, leader) = queue_led_off_node_3(&nodes).await?;
    let base = Instant::now();
    let probe = Arc::new(Probe::default());
    let task = {
        let broker = nodes[leader].broker().clone();
        let probe = probe.clone();
        let queue = queue.clone();
        tokio::spawn(async move {
            while !probe.stop.load(Ordering::Relaxed) {
                for result in broker
                    .publish(&queue, vec![Message::new(vec![0x5a_u8; 1024])])
                    .await
                {
                    match result {
                        Ok(_) => probe.ok.store(stamp(base), Ordering::Relaxed),
                        Err(BrokerError::Limited { message, .. }) => {
                            probe.limited.store(stamp(base), Ordering::Relaxed);
                            let mut first = probe.message.lock().unwrap_or_else(|e| e.into_inner());
                            first.get_or_insert(message);
                        }
                        Err(BrokerError::NotLeader { .. }) => {
                            probe.not_leader.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => return Err(format!("probe publish: {other}")),
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(())
        })
    };
    let filler = small.join("filler");
    let mut reject_ms = Vec::new();
    let mut accept_ms = Vec::new();
    let outcome: BenchResult<()> = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        for trial in 0..count {
            // A phase unrelated to node 3's sampler.
            let jitter = (trial as u64 * 373 + 101) % SAMPLE_MS;
            tokio::time::sleep(Duration::from_millis(500 + jitter)).await;
            // Node 3 counts only while the leader has it in sync (a replica still catching up
            // after the declaration holds nothing back, and is not asked about).
            let deadline = Instant::now() + WAIT;
            while !nodes[leader].broker().info(&queue).is_ok_and(|info| {
                info.partitions
                    .first()
                    .is_some_and(|p| p.in_sync.contains(&3))
            }) {
                if Instant::now() > deadline {
                    return Err("node 3 never in sync with the leader".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let (free, total) = free_total(small)?;
            // Hard at 40 % free, reserve at 10 %: leave 28 %.
            let fill = free.saturating_sub(total * 28 / 100);
            let file = std::fs::File::create(&filler)?;
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, fill)?;
            drop(file);
            let t0 = stamp(base);
            let limit = Duration::from_millis(2 * HEARTBEAT_MS + SAMPLE_MS) * 5;
            let rejected = wait_stamp(|| probe.limited.load(Ordering::Relaxed), t0, limit)
                .await
                .ok_or_else(|| {
                    format!(
                        "no 429 after node 3 was filled ({} probe publishes met no leader)",
                        probe.not_leader.load(Ordering::Relaxed)
                    )
                })?;
            reject_ms.push((rejected - t0) as f64 / 1e3);
            let jitter = (trial as u64 * 619 + 37) % SAMPLE_MS;
            tokio::time::sleep(Duration::from_millis(200 + jitter)).await;
            std::fs::remove_file(&filler)?;
            let t1 = stamp(base);
            let accepted = wait_stamp(|| probe.ok.load(Ordering::Relaxed), t1, limit)
                .await
                .ok_or("no accepted publish after node 3's filler went")?;
            accept_ms.push((accepted - t1) as f64 / 1e3);
            eprintln!(
                "  cluster trial {}: node 3 past hard -> leader's first 429 {:.1} ms; freed -> \
                 first accepted {:.1} ms",
                trial + 1,
                reject_ms[trial],
                accept_ms[trial]
            );
        }
        Ok(())
    }
    .await;
    let _ = std::fs::remove_file(&filler);
    probe.stop.store(true, Ordering::Relaxed);
    task.await??;
    for node in nodes {
        node.shutdown().await?;
    }
    outcome?;
    let message = probe
        .message
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default();
    Ok((reject_ms, accept_ms, message))
}

/// Adds the cluster reaction rows to `report` (see the module docs).
pub(crate) fn cluster_reaction(
    dir: &Path,
    trial_count: usize,
    tmpfs_mib: u64,
    report: &mut Report,
) -> BenchResult<()> {
    if trial_count == 0 {
        return Ok(());
    }
    if !is_root() {
        report.diagnostics.push(
            "cluster reaction times: skipped; they need root (to mount a size-limited tmpfs)"
                .into(),
        );
        return Ok(());
    }
    eprintln!(
        "limits: cluster reaction times, node 3 on a {tmpfs_mib} MiB tmpfs, {trial_count} trial(s)"
    );
    let base = dir.join("cluster");
    std::fs::create_dir_all(&base)?;
    let tmpfs = Tmpfs::mount(&dir.join("cluster-tmpfs"), tmpfs_mib)?;
    let rt = runtime()?;
    let result = rt.block_on(trials(&base, &tmpfs.path, trial_count));
    drop(rt);
    drop(tmpfs);
    let _ = std::fs::remove_dir_all(&base);
    let (reject_ms, accept_ms, message) = result?;
    let bound = (2 * HEARTBEAT_MS + SAMPLE_MS) as f64;
    let note = format!(
        "three nodes in process, node 3 on a {tmpfs_mib} MiB tmpfs sampled every {SAMPLE_MS} ms \
         (levels at 50/40/10 % free), a probe publishing through the leader (node 1 or 2) every \
         ms; goal: at most 2 heartbeat intervals ({HEARTBEAT_MS} ms each) + 1 sample interval \
         = {bound:.0} ms; ratio = that bound / the median; the first 429 said: {message}"
    );
    for (case, values) in [
        (
            "cluster: follower past hard -> leader's first 429",
            &reject_ms,
        ),
        (
            "cluster: follower's space freed -> first accepted",
            &accept_ms,
        ),
    ] {
        let ratios: Vec<f64> = values.iter().map(|ms| bound / ms.max(0.001)).collect();
        report.rows.push(Row {
            case: case.to_string(),
            keratin: format!("{:.0} ms median", median(values)),
            reference: format!("bound {bound:.0} ms"),
            ratio: bound / median(values).max(0.001),
            round_ratios: ratios,
            goal: Some(1.0),
            note: note.clone(),
        });
    }
    report.json_cases.push(json!({
        "case": "cluster_reaction",
        "sample_interval_ms": SAMPLE_MS,
        "heartbeat_ms": HEARTBEAT_MS,
        "reject_ms": reject_ms,
        "accept_ms": accept_ms,
    }));
    Ok(())
}
