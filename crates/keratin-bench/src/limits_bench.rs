//! The `limits` benchmark (issue 6).
//!
//! - **Cost of admission**: confirmed publish throughput over TCP (one client, one producer,
//!   up to `in_flight` single-message publishes in flight, 1 KiB, for `duration`) through a
//!   server whose broker asks `NodeLimits` (default settings, every level clear, its sampler
//!   running) before every publish, against the same server whose broker has `OpenGate`. Both
//!   are assembled as `Node` does it (broker + `keratin_server::tcp::serve`, no HTTP port),
//!   since `Node` always turns limits on. On/off alternate (on off, off on, ...); ratio = on /
//!   off, median of per-round ratios. Beside it, the gate's own decision time, called in a
//!   tight loop.
//! - **Reaction time** (root only: it mounts a size-limited tmpfs): a real `Node` on the tmpfs
//!   with levels scaled to it, a client publishing confirmed messages at a steady rate, a
//!   consumer acking, and an in-process probe publishing one message every millisecond through
//!   the broker (no client retry in between). A filler file is `fallocate`d to take free space
//!   past hard: the time until the probe's first `ERR_LIMITED`; then the filler is removed: the
//!   time until the probe's first accepted publish, and until the client's first confirm (its
//!   retry waits for the hint). With the sample interval at 1000 ms (default) and at 100 ms.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use keratin_broker::{
    Broker, BrokerConfig, BrokerError, GateDecision, Message, OpenGate, PublishGate,
};
use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use keratin_limits::LimitsSettings;
use keratin_server::limits::NodeLimits;
use keratin_server::tcp::TcpOptions;
use keratin_server::Node;
use serde_json::json;
use tokio::sync::watch;

use crate::broker_bench::{remove_and_settle, runtime};
use crate::contender::{BenchError, BenchResult};
use crate::net_bench::{loopback_any, node_config, publish_window, QUEUE};
use crate::report::{median, text_table, Report, Row};

/// Limits on may cost at most this fraction of throughput (issue 6): ratio on/off >= 0.98.
const ADMISSION_GOAL: f64 = 0.98;

/// What `keratin-bench limits` runs.
#[derive(Debug, Clone)]
pub struct LimitsBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: PathBuf,
    /// Length of each publish run.
    pub duration: Duration,
    /// Rounds of the admission case.
    pub rounds: usize,
    /// Body bytes of one message.
    pub body_bytes: usize,
    /// Most confirmed publishes in flight at once.
    pub in_flight: usize,
    /// Trials of the reaction-time case per sample interval (0: skip it).
    pub trials: usize,
    /// Sample intervals of the reaction-time case, in milliseconds.
    pub intervals_ms: Vec<u64>,
    /// Size of the tmpfs of the reaction-time case, in MiB.
    pub tmpfs_mib: u64,
}

/// Which publish gate a [`Server`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateKind {
    /// `OpenGate`: no limits.
    Open,
    /// `NodeLimits`: a single node's gate.
    Node,
    /// `NodeLimits` with a cluster's levels attached, every peer heard at normal: what each
    /// publish of a cluster node's partition pays for replica levels when nothing is limited
    /// (issue 15).
    Replicas,
}

/// Every level normal, as a peer would report it.
fn normal_report() -> keratin_limits::NodeReport {
    let thresholds = keratin_limits::Thresholds {
        soft_bytes: 4 << 30,
        hard_bytes: 2 << 30,
        reserve_bytes: Some(1 << 29),
        clear_margin_bytes: 1 << 28,
    };
    keratin_limits::NodeReport {
        filesystems: vec![keratin_limits::FilesystemReport {
            path: "/var/lib/keratin".to_string(),
            free_bytes: 100 << 30,
            total_bytes: 200 << 30,
            spare_bytes: 0,
            input: keratin_limits::LevelInput {
                level: keratin_limits::Level::Normal,
                headroom_bytes: 100 << 30,
                thresholds,
            },
            largest_queues: Vec::new(),
        }],
        memory: None,
        sampled_at_ms: 0,
    }
}

/// A protocol server as `Node` assembles it, with limits on (`NodeLimits`) or off (`OpenGate`).
struct Server {
    broker: Broker,
    addr: std::net::SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    limits: Option<Arc<NodeLimits>>,
}

async fn wait_stop(mut stopped: watch::Receiver<bool>) {
    while !*stopped.borrow() {
        if stopped.changed().await.is_err() {
            return;
        }
    }
}

impl Server {
    async fn start(dir: &Path, gate: GateKind) -> BenchResult<Server> {
        std::fs::create_dir_all(dir)?;
        let dirs = vec![dir.to_path_buf()];
        let mut broker_config = BrokerConfig::new(dirs.clone());
        let limits = if gate != GateKind::Open {
            let limits = Arc::new(NodeLimits::new(&dirs, LimitsSettings::default(), 0)?);
            limits.sample();
            if gate == GateKind::Replicas {
                let levels = keratin_cluster::ClusterLevels::new(1);
                for peer in [2, 3] {
                    levels.insert(peer, normal_report());
                }
                limits.attach_cluster(levels);
            }
            broker_config.gate = limits.clone();
            Some(limits)
        } else {
            broker_config.gate = Arc::new(OpenGate);
            None
        };
        let broker = Broker::open(broker_config).await?;
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        if let Some(limits) = &limits {
            limits.attach(&broker);
            limits.sample();
            tasks.push(tokio::spawn(limits.clone().run_sampler(stopped.clone())));
        }
        let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
        let addr = listener.local_addr()?;
        let serve = keratin_server::tcp::serve(
            listener,
            broker.clone(),
            TcpOptions::default(),
            wait_stop(stopped),
        );
        tasks.push(tokio::spawn(async move {
            if let Err(error) = serve.await {
                eprintln!("serve: {error}");
            }
        }));
        Ok(Server {
            broker,
            addr,
            stop,
            tasks,
            limits,
        })
    }

    async fn shutdown(self) -> BenchResult<()> {
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.await?;
        }
        self.broker.shutdown().await?;
        Ok(())
    }
}

/// One publish run through a fresh server: confirmed messages per second, and the level seen.
fn admission_run(
    config: &LimitsBenchConfig,
    dir: &Path,
    gate: GateKind,
) -> BenchResult<(f64, String)> {
    let rt = runtime()?;
    let out = rt.block_on(async {
        let server = Server::start(dir, gate).await?;
        let client = Client::connect(server.addr, ClientOptions::default()).await?;
        client.declare(QUEUE, QueueSettings::default()).await?;
        let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
        publish_window(&client, &body, config.in_flight, Duration::from_millis(100)).await?;
        let (confirmed, elapsed) =
            publish_window(&client, &body, config.in_flight, config.duration).await?;
        let level = server.limits.as_ref().map_or_else(
            || "off".to_string(),
            |l| {
                let snapshot = l.snapshot();
                let disk: Vec<&str> = snapshot
                    .filesystems
                    .iter()
                    .map(|f| f.level.as_str())
                    .collect();
                format!(
                    "disk {} memory {}",
                    disk.join(","),
                    snapshot.memory_level.as_str()
                )
            },
        );
        client.close().await;
        server.shutdown().await?;
        Ok::<_, BenchError>((confirmed as f64 / elapsed.as_secs_f64().max(1e-9), level))
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(out)
}

/// Nanoseconds per decision of `gate`, called `calls` times in a loop on one thread.
fn gate_ns(gate: &dyn PublishGate, device: u64, calls: u32) -> f64 {
    let began = Instant::now();
    let mut admitted = 0u32;
    for _ in 0..calls {
        if matches!(
            gate.publish(std::hint::black_box(device), std::hint::black_box(1024)),
            GateDecision::Admit
        ) {
            admitted += 1;
        }
    }
    std::hint::black_box(admitted);
    began.elapsed().as_nanos() as f64 / f64::from(calls.max(1))
}

/// Nanoseconds per decision as a cluster node's partition leader asks it: whether any peer
/// is limited, then the replica-aware decision if so (with `replicas` in sync) or the plain
/// one.
fn replica_gate_ns(gate: &dyn PublishGate, device: u64, replicas: &[u64], calls: u32) -> f64 {
    let began = Instant::now();
    let mut admitted = 0u32;
    for _ in 0..calls {
        let decision = if gate.replicas_limited() {
            gate.publish_replicated(std::hint::black_box(device), 1024, replicas)
        } else {
            gate.publish(std::hint::black_box(device), std::hint::black_box(1024))
        };
        if matches!(decision, GateDecision::Admit) {
            admitted += 1;
        }
    }
    std::hint::black_box(admitted);
    began.elapsed().as_nanos() as f64 / f64::from(calls.max(1))
}

fn admission(config: &LimitsBenchConfig, report: &mut Report) -> BenchResult<()> {
    eprintln!(
        "limits: confirmed publish with limits on vs off, {} round(s)",
        config.rounds
    );
    let mut on = Vec::new();
    let mut off = Vec::new();
    let mut replicas = Vec::new();
    let mut levels = Vec::new();
    for round in 0..config.rounds {
        // Each kind first, middle and last in turn: A B C, B C A, C A B, ...
        let mut order = [GateKind::Node, GateKind::Open, GateKind::Replicas];
        order.rotate_left(round % 3);
        for gate in order {
            let dir = config.dir.join(format!("admission-{round}-{gate:?}"));
            let (rate, level) = admission_run(config, &dir, gate)?;
            match gate {
                GateKind::Node => {
                    on.push(rate);
                    levels.push(level);
                }
                GateKind::Open => off.push(rate),
                GateKind::Replicas => replicas.push(rate),
            }
        }
        eprintln!(
            "  round {}: on {:.0} msg/s, off {:.0} msg/s, ratio {:.3}; with replica levels {:.0} \
             msg/s, ratio to on {:.3}",
            round + 1,
            on[round],
            off[round],
            on[round] / off[round].max(1e-9),
            replicas[round],
            replicas[round] / on[round].max(1e-9)
        );
    }
    let ratios: Vec<f64> = on.iter().zip(&off).map(|(a, b)| a / b.max(1e-9)).collect();
    let mb = |rate: f64| rate * config.body_bytes as f64 / 1e6;
    report.rows.push(Row {
        case: format!("publish+confirm {} B, limits on / off", config.body_bytes),
        keratin: format!("on {:.0} msg/s {:.2} MB/s", median(&on), mb(median(&on))),
        reference: format!("off {:.0} msg/s {:.2} MB/s", median(&off), mb(median(&off))),
        ratio: median(&ratios),
        round_ratios: ratios.clone(),
        goal: Some(ADMISSION_GOAL),
        note: format!(
            "1 client, 1 producer, up to {} single-message publishes in flight, {} s per run; \
             on = NodeLimits gate (default settings, sampler every 1000 ms), off = OpenGate; \
             levels seen with limits on: {}",
            config.in_flight,
            config.duration.as_secs_f64(),
            levels.join("; ")
        ),
    });
    let replica_ratios: Vec<f64> = replicas
        .iter()
        .zip(&on)
        .map(|(a, b)| a / b.max(1e-9))
        .collect();
    report.rows.push(Row {
        case: format!(
            "publish+confirm {} B, replica levels (peers all normal) / single-node gate",
            config.body_bytes
        ),
        keratin: format!(
            "replicas {:.0} msg/s {:.2} MB/s",
            median(&replicas),
            mb(median(&replicas))
        ),
        reference: format!(
            "single {:.0} msg/s {:.2} MB/s",
            median(&on),
            mb(median(&on))
        ),
        ratio: median(&replica_ratios),
        round_ratios: replica_ratios.clone(),
        goal: Some(ADMISSION_GOAL),
        note: "issue 15: the NodeLimits gate with a cluster's levels attached (two peers heard \
               at normal), as a cluster node's partition leader asks it before every publish, \
               against the same gate alone; same runs as the row above"
            .to_string(),
    });
    // The decision itself, without the disk: a gate over the bench directory's file system.
    let gate_dir = config.dir.join("gate");
    std::fs::create_dir_all(&gate_dir)?;
    let limits = NodeLimits::new(
        std::slice::from_ref(&gate_dir),
        LimitsSettings::default(),
        0,
    )?;
    limits.sample();
    let device = std::fs::metadata(&gate_dir)?.dev();
    let calls = 2_000_000;
    let (limits_ns, open_ns) = (
        gate_ns(&limits, device, calls),
        gate_ns(&OpenGate, device, calls),
    );
    // The same gate on a cluster node: peers all normal (the check is one atomic load), then
    // one peer at soft that is not among the partition's replicas (the leader then asks the
    // replica-aware decision, which finds nothing to limit).
    let levels = keratin_cluster::ClusterLevels::new(1);
    levels.insert(2, normal_report());
    levels.insert(3, normal_report());
    limits.attach_cluster(levels.clone());
    let replicas_normal_ns = replica_gate_ns(&limits, device, &[2, 3], calls);
    let mut soft = normal_report();
    soft.filesystems[0].input.level = keratin_limits::Level::Soft;
    levels.insert(4, soft);
    let replicas_soft_elsewhere_ns = replica_gate_ns(&limits, device, &[2, 3], calls);
    remove_and_settle(&gate_dir)?;
    report.diagnostics.push(format!(
        "gate decision, {calls} calls on one thread: NodeLimits {limits_ns:.1} ns, OpenGate \
         {open_ns:.1} ns per publish request; on a cluster node (issue 15), peers all normal \
         {replicas_normal_ns:.1} ns, a peer outside the partition at soft \
         {replicas_soft_elsewhere_ns:.1} ns (2 in-sync replicas looked up)"
    ));
    report.json_cases.push(json!({
        "case": "admission",
        "on_per_s": on,
        "off_per_s": off,
        "replicas_per_s": replicas,
        "ratios": ratios,
        "replica_ratios": replica_ratios,
        "gate_ns": {
            "node_limits": limits_ns,
            "open": open_ns,
            "replicas_normal": replicas_normal_ns,
            "replicas_soft_elsewhere": replicas_soft_elsewhere_ns,
        },
    }));
    Ok(())
}

/// Whether this process runs as root (it may mount a tmpfs).
pub fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A tmpfs mounted at a path of our own, unmounted (by that path) when dropped.
pub(crate) struct Tmpfs {
    pub(crate) path: PathBuf,
}

impl Tmpfs {
    pub(crate) fn mount(path: &Path, mib: u64) -> BenchResult<Tmpfs> {
        std::fs::create_dir_all(path)?;
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m,mode=0755")])
            .arg("keratin-bench")
            .arg(path)
            .status()?;
        if !status.success() {
            return Err(format!("mount tmpfs at {}: {status}", path.display()).into());
        }
        Ok(Tmpfs {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // A node's worker threads may close their last files a moment after its shutdown
        // (seen with the cluster case's three nodes): try for 2 s, then detach it lazily.
        let umount = |lazy: bool| {
            let mut command = std::process::Command::new("umount");
            if lazy {
                command.arg("-l");
            }
            command
                .arg(&self.path)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let mut unmounted = false;
        for _ in 0..20 {
            if umount(false) {
                unmounted = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if !unmounted && !umount(true) {
            eprintln!("limits: umount {} failed", self.path.display());
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Free bytes for unprivileged users, and total bytes, of the file system at `path`.
pub(crate) fn free_total(path: &Path) -> BenchResult<(u64, u64)> {
    let st = rustix::fs::statvfs(path)?;
    Ok((st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))
}

/// Levels scaled to a small file system: soft below 50% free, hard below 40%, reserve 10%.
pub(crate) fn tmpfs_settings(interval_ms: u64) -> LimitsSettings {
    let mut settings = LimitsSettings {
        sample_interval_ms: interval_ms,
        ..LimitsSettings::default()
    };
    settings.disk.soft_fraction = 0.5;
    settings.disk.soft_floor_bytes = 0;
    settings.disk.hard_fraction = 0.4;
    settings.disk.hard_floor_bytes = 0;
    settings.disk.reserve_fraction = 0.1;
    settings.disk.reserve_floor_bytes = 0;
    settings
}

/// Milliseconds since `base`, as a stamp (0 = never).
pub(crate) fn stamp(base: Instant) -> u64 {
    u64::try_from(base.elapsed().as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// What the probe and the load saw, as microsecond stamps since `base`.
#[derive(Default)]
struct Seen {
    probe_ok: AtomicU64,
    probe_limited: AtomicU64,
    client_confirm: AtomicU64,
    stop: AtomicBool,
}

/// Poll until `stamp_of()` is at or after `since`, for at most `limit`: the stamp, or None.
pub(crate) async fn wait_stamp(
    stamp_of: impl Fn() -> u64,
    since: u64,
    limit: Duration,
) -> Option<u64> {
    let began = Instant::now();
    loop {
        let seen = stamp_of();
        if seen >= since {
            return Some(seen);
        }
        if began.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_micros(250)).await;
    }
}

/// One sample interval's trials: (to first rejection, to first accepted probe, to first client
/// confirm), in milliseconds, per trial; and the time `fallocate` took.
#[derive(Debug, Default)]
struct Reaction {
    reject_ms: Vec<f64>,
    accept_ms: Vec<f64>,
    client_ms: Vec<f64>,
    fill_ms: Vec<f64>,
    retry_hint_ms: u64,
}

async fn reaction_trials(
    config: &LimitsBenchConfig,
    mount: &Path,
    interval_ms: u64,
) -> BenchResult<Reaction> {
    let data = mount.join(format!("data-{interval_ms}"));
    let mut node_cfg = node_config(&data);
    node_cfg.limits = tmpfs_settings(interval_ms);
    node_cfg.storage.segment_bytes = 4 << 20;
    let node = Node::start(&node_cfg).await?;
    let client = Client::connect(node.protocol_addr(), ClientOptions::default()).await?;
    client.declare(QUEUE, QueueSettings::default()).await?;
    let base = Instant::now();
    let seen = Arc::new(Seen::default());
    let mut tasks = tokio::task::JoinSet::new();
    // Load: a client publishing 500 confirmed messages/s (retrying ERR_LIMITED by itself).
    {
        let client = client.clone();
        let seen = seen.clone();
        let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
        tasks.spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(2));
            let mut pending = futures_util::stream::FuturesUnordered::new();
            loop {
                tokio::select! {
                    _ = ticker.tick() => {
                        if seen.stop.load(Ordering::Relaxed) {
                            break;
                        }
                        if pending.len() < 1000 {
                            pending.push(client.publish(QUEUE, OutgoingMessage::new(body.clone())));
                        }
                    }
                    Some(result) = futures_util::StreamExt::next(&mut pending), if !pending.is_empty() => {
                        if result.is_ok() {
                            seen.client_confirm.store(stamp(base), Ordering::Relaxed);
                        }
                    }
                }
            }
            Ok::<(), BenchError>(())
        });
    }
    // A consumer acking everything: consuming is never limited, and it lets space be reclaimed.
    {
        let mut consumer = client.subscribe(QUEUE, 1000).await?;
        let seen = seen.clone();
        tasks.spawn(async move {
            while !seen.stop.load(Ordering::Relaxed) {
                match tokio::time::timeout(Duration::from_millis(50), consumer.recv()).await {
                    Ok(Some(delivery)) => delivery.ack()?,
                    Ok(None) => break,
                    Err(_) => {}
                }
            }
            Ok(())
        });
    }
    // The probe: one publish through the broker every millisecond, answered at once.
    {
        let broker = node.broker().clone();
        let probe_seen = seen.clone();
        let body = vec![0x5a_u8; config.body_bytes];
        let hint = Arc::new(AtomicU64::new(0));
        let hint_out = hint.clone();
        tasks.spawn(async move {
            let seen = probe_seen;
            while !seen.stop.load(Ordering::Relaxed) {
                let results = broker
                    .publish(QUEUE, vec![Message::new(body.clone())])
                    .await;
                for result in results {
                    match result {
                        Ok(_) => seen.probe_ok.store(stamp(base), Ordering::Relaxed),
                        Err(BrokerError::Limited { retry_after_ms, .. }) => {
                            seen.probe_limited.store(stamp(base), Ordering::Relaxed);
                            hint_out.store(u64::from(retry_after_ms), Ordering::Relaxed);
                        }
                        Err(error) => return Err(format!("probe publish: {error}").into()),
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(())
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut reaction = Reaction::default();
        let filler = mount.join("filler");
        let outcome: BenchResult<()> = async {
            for trial in 0..config.trials {
                // A phase unrelated to the sampler's.
                let jitter = (trial as u64 * 373 + 101) % interval_ms.max(1);
                tokio::time::sleep(Duration::from_millis(300 + jitter)).await;
                if seen.probe_limited.load(Ordering::Relaxed)
                    > seen.probe_ok.load(Ordering::Relaxed)
                {
                    return Err("the probe is still limited before the fill".into());
                }
                let (free, total) = free_total(mount)?;
                let target_free = total * 28 / 100;
                let fill = free.saturating_sub(target_free);
                let began_fill = Instant::now();
                let file = std::fs::File::create(&filler)?;
                rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, fill)?;
                drop(file);
                let t0 = stamp(base);
                reaction
                    .fill_ms
                    .push(began_fill.elapsed().as_secs_f64() * 1e3);
                let limit = Duration::from_millis(interval_ms * 5 + 2000);
                let rejected = wait_stamp(|| seen.probe_limited.load(Ordering::Relaxed), t0, limit)
                    .await
                    .ok_or("no rejection after the fill")?;
                reaction.reject_ms.push((rejected - t0) as f64 / 1e3);
                // Again a phase unrelated to the sampler's (the rejection came right after a
                // sample).
                let jitter = (trial as u64 * 619 + 37) % interval_ms.max(1);
                tokio::time::sleep(Duration::from_millis(100 + jitter)).await;
                std::fs::remove_file(&filler)?;
                let t1 = stamp(base);
                let accepted = wait_stamp(|| seen.probe_ok.load(Ordering::Relaxed), t1, limit)
                    .await
                    .ok_or("no accepted publish after the filler was removed")?;
                reaction.accept_ms.push((accepted - t1) as f64 / 1e3);
                let confirmed = wait_stamp(
                    || seen.client_confirm.load(Ordering::Relaxed),
                    t1,
                    limit + Duration::from_secs(5),
                )
                .await
                .ok_or("no client confirm after the filler was removed")?;
                reaction.client_ms.push((confirmed - t1) as f64 / 1e3);
                eprintln!(
                    "  interval {interval_ms} ms, trial {}: filled {} MiB in {:.1} ms; first \
                     429 after {:.1} ms; first accepted {:.1} ms after the delete, client \
                     confirm {:.1} ms",
                    trial + 1,
                    fill >> 20,
                    reaction.fill_ms[trial],
                    reaction.reject_ms[trial],
                    reaction.accept_ms[trial],
                    reaction.client_ms[trial],
                );
            }
            Ok(())
        }
        .await;
        let _ = std::fs::remove_file(&filler);
        seen.stop.store(true, Ordering::Relaxed);
        while let Some(joined) = tasks.join_next().await {
            joined??;
        }
        reaction.retry_hint_ms = hint.load(Ordering::Relaxed);
        client.close().await;
        node.shutdown().await?;
        outcome?;
        Ok(reaction)
    }
}

fn reaction(config: &LimitsBenchConfig, report: &mut Report) -> BenchResult<()> {
    if config.trials == 0 {
        return Ok(());
    }
    if !is_root() {
        report
            .diagnostics
            .push("reaction times: skipped; they need root (to mount a size-limited tmpfs)".into());
        return Ok(());
    }
    let mount = config.dir.join("tmpfs");
    let tmpfs = Tmpfs::mount(&mount, config.tmpfs_mib)?;
    let mut rows = vec![[
        "sample interval",
        "hard crossed -> first 429 (ms)",
        "space freed -> first accepted (ms)",
        "-> client's first confirm (ms)",
        "trials",
    ]
    .map(String::from)
    .to_vec()];
    let rt = runtime()?;
    let mut cases = Vec::new();
    let mut result = Ok(());
    for &interval_ms in &config.intervals_ms {
        eprintln!(
            "limits: reaction times on a {} MiB tmpfs, sample interval {interval_ms} ms, {} trial(s)",
            config.tmpfs_mib, config.trials
        );
        match rt.block_on(reaction_trials(config, &tmpfs.path, interval_ms)) {
            Ok(r) => {
                let spread = |v: &[f64]| {
                    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
                    let max = v.iter().copied().fold(0.0, f64::max);
                    format!("{:.0} (min {min:.0}, max {max:.0})", median(v))
                };
                rows.push(vec![
                    format!("{interval_ms} ms (retry hint {} ms)", r.retry_hint_ms),
                    spread(&r.reject_ms),
                    spread(&r.accept_ms),
                    spread(&r.client_ms),
                    r.reject_ms.len().to_string(),
                ]);
                cases.push(json!({
                    "sample_interval_ms": interval_ms,
                    "retry_hint_ms": r.retry_hint_ms,
                    "reject_ms": r.reject_ms,
                    "accept_ms": r.accept_ms,
                    "client_confirm_ms": r.client_ms,
                    "fill_ms": r.fill_ms,
                }));
            }
            Err(error) => {
                result = Err(error);
                break;
            }
        }
    }
    drop(rt);
    drop(tmpfs);
    result?;
    report.diagnostics.push(format!(
        "reaction times on a {} MiB tmpfs (soft < 50% free, hard < 40%, reserve 10%, 4 MiB \
         segments; filler fallocated to 28% free; medians of the trials; probe = one \
         in-process publish per ms; client = 500 confirmed publishes/s with its own retry):",
        config.tmpfs_mib
    ));
    report.diagnostics.push(text_table(&rows));
    report
        .json_cases
        .push(json!({"case": "reaction", "intervals": cases}));
    Ok(())
}

/// Run every case and gather the report.
pub fn run(config: &LimitsBenchConfig) -> BenchResult<Report> {
    let mut report = Report::default();
    admission(config, &mut report)?;
    reaction(config, &mut report)?;
    crate::limits_cluster::cluster_reaction(
        &config.dir,
        config.trials,
        config.tmpfs_mib,
        &mut report,
    )?;
    Ok(report)
}
