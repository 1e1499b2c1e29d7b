//! The `stream` benchmark (issue 18): a Keratin stream against a NATS JetStream stream with
//! limits retention (`async-nats`) and the raw disk's sequential read, in the same run, on the
//! same file system, as one table of figures and ratios.
//!
//! Keratin runs as a child process (`compare-node`, as in `compare`), so that its resident
//! memory is its own; nats-server is started by `bench/compare.sh` (`MODE=stream`) and reached
//! by address. Each round, for each system in turn (Keratin, NATS, then the raw file):
//!
//! - *publish*: a fresh stream of one partition (one subject), `stream_bytes` of `body_bytes`
//!   messages published with `in_flight` single confirmed publishes in flight on one
//!   connection (Keratin: confirmed after fdatasync; NATS: `PubAck`, after the write to the
//!   page cache);
//! - *read*: the whole stream read from `first` by 1 reader, then by `fan_out` concurrent
//!   readers (each its own connection, each reading all of it), cold (page cache dropped just
//!   before, root only) and warm (right after); neither system's readers write anything
//!   (Keratin readers without a cursor, NATS ordered consumers);
//! - *raw*: `pread` of 1 MiB chunks over a file of the same payload size on the same file
//!   system, cold and warm.
//!
//! Then, Keratin alone: its resident memory (VmRSS, sampled) while `rss_readers` readers read
//! a stream of `rss_bytes` from positions spread over it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use keratin_client::{Client, ClientOptions, StreamSettings, StreamStart, StreamSubscribeOptions};

use crate::broker_bench::runtime;
use crate::compare::{publish_window, KeratinChild};
use crate::contender::BenchResult;
use crate::page_cache::PageCache;
use crate::peers::{Endpoints, Peer, System};
use crate::report::{median, text_table};

/// Publish and fan-out: Keratin / NATS at least this (issue 18).
const GOAL_VS_NATS: f64 = 1.0;
/// Sequential read by one reader: Keratin / raw at least this (issue 18).
const GOAL_READ_VS_RAW: f64 = 0.8;
/// A reader that has not read the whole stream after this long has stalled: the run stops and
/// says so. One deadline per reader, not a timer per message: that would put a timer wheel
/// insert and removal on each of a million messages, in the reader whose cost is measured.
const READ_LIMIT: Duration = Duration::from_secs(900);
/// The memory case's readers stop once nothing arrived for this long (they reached the end).
const RSS_READ_IDLE: Duration = Duration::from_secs(3);
/// How often the memory case samples the node's VmRSS.
const RSS_SAMPLE_INTERVAL: Duration = Duration::from_millis(50);
/// Bytes per `pread` of the raw read and per `pwrite` when the raw file is written.
const RAW_CHUNK_BYTES: usize = 1 << 20;
/// A publish run never ends on time, only on its count: this is a ceiling, not a setting.
const PUBLISH_CEILING: Duration = Duration::from_secs(3600);

/// How the NATS readers consume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsConsumer {
    /// An ordered push consumer (ephemeral, no acks, flow control): the server pushes.
    OrderedPush,
    /// An ordered pull consumer (ephemeral, no acks, pulls of 500 messages).
    OrderedPull,
}

impl NatsConsumer {
    /// Parses `ordered-push` or `ordered-pull`.
    pub fn parse(text: &str) -> Result<NatsConsumer, String> {
        match text.trim() {
            "ordered-push" => Ok(NatsConsumer::OrderedPush),
            "ordered-pull" => Ok(NatsConsumer::OrderedPull),
            other => Err(format!("{other:?}: use ordered-push or ordered-pull")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            NatsConsumer::OrderedPush => "ordered push consumer",
            NatsConsumer::OrderedPull => "ordered pull consumer",
        }
    }
}

/// What `keratin-bench stream` runs.
#[derive(Debug, Clone)]
pub struct StreamBenchConfig {
    /// A fresh directory on the file system under test: Keratin's data and the raw file.
    pub dir: PathBuf,
    /// A Keratin configuration file (disk levels); default the built-in defaults.
    pub keratin_config: Option<PathBuf>,
    /// The NATS server's URL; `None` runs Keratin and raw alone.
    pub nats: Option<String>,
    /// Payload bytes of the stream the publish and read cases build.
    pub stream_bytes: u64,
    /// Body bytes of each message.
    pub body_bytes: usize,
    /// Confirmed publishes in flight.
    pub in_flight: usize,
    /// Rounds; each runs every system once, in the same order.
    pub rounds: usize,
    /// Concurrent readers of the fan-out case.
    pub fan_out: usize,
    /// A Keratin reader's credit, in messages.
    pub credit: u32,
    /// How the NATS readers consume.
    pub nats_consumer: NatsConsumer,
    /// Drop the page cache before the cold reads (needs root; else only warm reads run).
    pub drop_caches: bool,
    /// Payload bytes of the memory case's stream; 0 skips the case.
    pub rss_bytes: u64,
    /// Concurrent readers of the memory case.
    pub rss_readers: usize,
    /// At most this long for the memory case's readers.
    pub rss_duration: Duration,
    /// Where to write the markdown section, besides stdout.
    pub out: Option<PathBuf>,
}

impl StreamBenchConfig {
    fn messages(&self) -> u64 {
        (self.stream_bytes / self.body_bytes as u64).max(1)
    }
}

/// The cache state of a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cache {
    /// `sync` + `drop_caches` just before the read.
    Cold,
    /// Right after the same read, the data in the page cache.
    Warm,
}

impl Cache {
    fn name(self) -> &'static str {
        match self {
            Cache::Cold => "cold",
            Cache::Warm => "warm",
        }
    }
}

/// One read of a whole stream by one or more readers.
#[derive(Debug, Clone, Copy)]
struct ReadRun {
    /// Payload bytes received over all readers.
    payload_bytes: u64,
    /// Messages received over all readers.
    messages: u64,
    /// From the first subscription to the last reader's last message.
    elapsed: Duration,
}

impl ReadRun {
    fn mb_per_s(&self) -> f64 {
        self.payload_bytes as f64 / self.elapsed.as_secs_f64() / 1e6
    }
}

/// Every figure of the run, by case and column ("keratin", "nats", "raw"), one per round.
#[derive(Debug, Default)]
struct Figures {
    values: BTreeMap<(String, &'static str), Vec<f64>>,
    notes: Vec<String>,
}

impl Figures {
    fn record(&mut self, case: &str, column: &'static str, value: f64) {
        self.values
            .entry((case.to_string(), column))
            .or_default()
            .push(value);
    }

    fn get(&self, case: &str, column: &'static str) -> &[f64] {
        self.values
            .get(&(case.to_string(), column))
            .map_or(&[], Vec::as_slice)
    }
}

fn publish_case() -> String {
    "publish".into()
}

fn read_case(readers: usize, cache: Cache) -> String {
    format!("read{readers}-{}", cache.name())
}

/// Runs the benchmark and prints (and writes) its table.
pub fn run(config: &StreamBenchConfig) -> BenchResult<()> {
    let cache = PageCache::detect(config.drop_caches);
    let caches: Vec<Cache> = if cache.dropping() {
        vec![Cache::Cold, Cache::Warm]
    } else if !config.drop_caches {
        eprintln!("stream: --no-drop-caches: only warm reads run");
        vec![Cache::Warm]
    } else {
        eprintln!(
            "!!! keratin-bench stream: NOT DROPPING THE PAGE CACHE ({}): only warm reads run",
            cache.describe()
        );
        vec![Cache::Warm]
    };
    std::fs::create_dir_all(&config.dir)?;
    let keratin_dir = config.dir.join("keratin-stream");
    let raw_path = config.dir.join("stream-raw.dat");
    let rt = runtime()?;
    let mut child = KeratinChild::start(&keratin_dir, config.keratin_config.as_deref())?;
    let result = run_all(config, &rt, &mut child, &cache, &caches, &raw_path);
    let stopped = child.stop();
    let _ = std::fs::remove_file(&raw_path);
    let _ = std::fs::remove_dir_all(&keratin_dir);
    // The work directory itself is this run's (main's make_work_dir); empty now.
    let _ = std::fs::remove_dir(&config.dir);
    let figures = result?;
    stopped?;
    let section = markdown(config, &cache, &caches, &figures);
    print!("{section}");
    if let Some(out) = &config.out {
        std::fs::write(out, &section)?;
    }
    Ok(())
}

fn run_all(
    config: &StreamBenchConfig,
    rt: &tokio::runtime::Runtime,
    child: &mut KeratinChild,
    cache: &PageCache,
    caches: &[Cache],
    raw_path: &Path,
) -> BenchResult<Figures> {
    let mut figures = Figures::default();
    let raw_bytes = config.messages() * config.body_bytes as u64;
    write_raw_file(raw_path, raw_bytes)?;
    for round in 1..=config.rounds {
        eprintln!("stream: round {round} of {}: keratin", config.rounds);
        let name = format!("bench-stream-{round}");
        rt.block_on(keratin_round(
            config,
            child.addr(),
            &name,
            cache,
            caches,
            &mut figures,
        ))?;
        if let Some(url) = &config.nats {
            eprintln!("stream: round {round} of {}: nats", config.rounds);
            rt.block_on(nats_round(config, url, &name, cache, caches, &mut figures))?;
        }
        eprintln!("stream: round {round} of {}: raw", config.rounds);
        for &state in caches {
            let run = raw_read(raw_path, raw_bytes, cache, state)?;
            figures.record(&read_case(1, state), "raw", run.mb_per_s());
        }
    }
    if config.rss_bytes > 0 {
        eprintln!(
            "stream: memory with {} readers on a stream of {:.1} GiB",
            config.rss_readers,
            config.rss_bytes as f64 / f64::from(1u32 << 30)
        );
        rss_case(config, rt, child, cache, &mut figures)?;
    }
    Ok(figures)
}

// ---------------------------------------------------------------------------------------------
// Keratin.

async fn keratin_round(
    config: &StreamBenchConfig,
    addr: SocketAddr,
    name: &str,
    cache: &PageCache,
    caches: &[Cache],
    figures: &mut Figures,
) -> BenchResult<()> {
    let endpoints = Endpoints {
        keratin: Some(addr),
        ..Endpoints::default()
    };
    let peer = Peer::connect(System::Keratin, &endpoints, name).await?;
    let Peer::Keratin { client, .. } = &peer else {
        return Err("a Keratin peer is not Keratin's".into());
    };
    let _ = client.delete_stream(name).await;
    client
        .declare_stream(name, StreamSettings::default())
        .await?;
    let rate = publish(config, &peer).await?;
    figures.record(&publish_case(), "keratin", rate);
    let messages = config.messages();
    for readers in [1, config.fan_out] {
        for &state in caches {
            if state == Cache::Cold {
                cache.drop_caches()?;
            }
            let run = keratin_read(addr, name, readers, messages, config.credit).await?;
            figures.record(&read_case(readers, state), "keratin", run.mb_per_s());
        }
    }
    client.delete_stream(name).await?;
    peer.close().await;
    Ok(())
}

/// Publishes the stream's messages; the confirmed messages per second.
async fn publish(config: &StreamBenchConfig, peer: &Peer) -> BenchResult<f64> {
    let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
    let messages = config.messages();
    let (confirmed, elapsed) = publish_window(
        peer,
        &body,
        config.in_flight,
        PUBLISH_CEILING,
        Some(messages),
    )
    .await?;
    if confirmed != messages {
        return Err(format!("{confirmed} of {messages} publishes confirmed").into());
    }
    Ok(confirmed as f64 / elapsed.as_secs_f64())
}

/// `readers` readers, each on its own connection, each reading `messages` from `first`.
async fn keratin_read(
    addr: SocketAddr,
    stream: &str,
    readers: usize,
    messages: u64,
    credit: u32,
) -> BenchResult<ReadRun> {
    let mut clients = Vec::with_capacity(readers);
    for _ in 0..readers {
        clients.push(Client::connect(addr, ClientOptions::default()).await?);
    }
    let began = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let options = StreamSubscribeOptions::new(stream).credit(credit);
            tokio::spawn(async move {
                let consumer = client.stream_subscribe(options).await?;
                let counted = count_keratin(consumer, messages).await;
                client.close().await;
                counted
            })
        })
        .collect();
    join_readers(tasks, began).await
}

async fn count_keratin(
    mut consumer: keratin_client::StreamConsumer,
    messages: u64,
) -> BenchResult<(u64, u64)> {
    let (mut count, mut bytes) = (0u64, 0u64);
    let read = tokio::time::timeout(READ_LIMIT, async {
        while count < messages {
            let Some(delivery) = consumer.recv().await else {
                return false;
            };
            count += 1;
            bytes += delivery.body.len() as u64;
        }
        true
    })
    .await;
    match read {
        Ok(true) => {}
        Ok(false) => {
            let why = consumer
                .end_error()
                .map_or_else(|| "no error".into(), ToString::to_string);
            return Err(format!("keratin reader ended after {count} of {messages}: {why}").into());
        }
        Err(_) => {
            return Err(format!("keratin reader timed out after {count} of {messages}").into())
        }
    }
    consumer.cancel().await?;
    Ok((count, bytes))
}

/// Waits for every reader; the run's totals, timed to the last reader's end.
async fn join_readers(
    tasks: Vec<tokio::task::JoinHandle<BenchResult<(u64, u64)>>>,
    began: Instant,
) -> BenchResult<ReadRun> {
    let mut run = ReadRun {
        payload_bytes: 0,
        messages: 0,
        elapsed: Duration::ZERO,
    };
    for task in tasks {
        let (count, bytes) = task.await.map_err(|e| format!("reader task: {e}"))??;
        run.messages += count;
        run.payload_bytes += bytes;
    }
    run.elapsed = began.elapsed();
    Ok(run)
}

// ---------------------------------------------------------------------------------------------
// NATS JetStream.

async fn nats_round(
    config: &StreamBenchConfig,
    url: &str,
    name: &str,
    cache: &PageCache,
    caches: &[Cache],
    figures: &mut Figures,
) -> BenchResult<()> {
    let endpoints = Endpoints {
        nats: Some(url.to_string()),
        ..Endpoints::default()
    };
    let peer = Peer::connect(System::Nats, &endpoints, name).await?;
    let Peer::Nats { context, .. } = &peer else {
        return Err("a NATS peer is not NATS's".into());
    };
    let _ = context.delete_stream(name).await;
    create_nats_stream(context, name).await?;
    let rate = publish(config, &peer).await?;
    figures.record(&publish_case(), "nats", rate);
    let messages = config.messages();
    for readers in [1, config.fan_out] {
        for &state in caches {
            if state == Cache::Cold {
                cache.drop_caches()?;
            }
            let run = nats_read(url, name, readers, messages, config.nats_consumer).await?;
            figures.record(&read_case(readers, state), "nats", run.mb_per_s());
        }
    }
    context
        .delete_stream(name)
        .await
        .map_err(|e| format!("delete stream {name}: {e}"))?;
    peer.close().await;
    Ok(())
}

/// A stream with limits retention (no limit set: it keeps everything), file storage, one
/// subject: what a Keratin stream without retention is.
async fn create_nats_stream(
    context: &async_nats::jetstream::Context,
    name: &str,
) -> BenchResult<()> {
    use async_nats::jetstream::stream;
    let config = stream::Config {
        name: name.to_string(),
        subjects: vec![name.to_string()],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    };
    context
        .create_stream(config)
        .await
        .map_err(|e| format!("create stream {name}: {e}"))?;
    Ok(())
}

async fn nats_read(
    url: &str,
    stream: &str,
    readers: usize,
    messages: u64,
    kind: NatsConsumer,
) -> BenchResult<ReadRun> {
    let mut clients = Vec::with_capacity(readers);
    for _ in 0..readers {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| format!("connect to NATS at {url}: {e}"))?;
        clients.push(client);
    }
    let began = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let stream = stream.to_string();
            tokio::spawn(async move { nats_reader(client, &stream, messages, kind).await })
        })
        .collect();
    join_readers(tasks, began).await
}

async fn nats_reader(
    client: async_nats::Client,
    stream: &str,
    messages: u64,
    kind: NatsConsumer,
) -> BenchResult<(u64, u64)> {
    use async_nats::jetstream::consumer::{pull, push, DeliverPolicy};
    let context = async_nats::jetstream::new(client.clone());
    let handle = context
        .get_stream(stream)
        .await
        .map_err(|e| format!("stream {stream}: {e}"))?;
    let consumer_error = |e: &dyn std::fmt::Display| format!("consumer on {stream}: {e}");
    match kind {
        NatsConsumer::OrderedPush => {
            let config = push::OrderedConfig {
                deliver_subject: client.new_inbox(),
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            };
            let consumer = handle
                .create_consumer(config)
                .await
                .map_err(|e| consumer_error(&e))?;
            let stream = consumer.messages().await.map_err(|e| consumer_error(&e))?;
            count_nats(stream, messages).await
        }
        NatsConsumer::OrderedPull => {
            let config = pull::OrderedConfig {
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            };
            let consumer = handle
                .create_consumer(config)
                .await
                .map_err(|e| consumer_error(&e))?;
            let stream = consumer.messages().await.map_err(|e| consumer_error(&e))?;
            count_nats(stream, messages).await
        }
    }
}

async fn count_nats<S, E>(mut stream: S, messages: u64) -> BenchResult<(u64, u64)>
where
    S: Stream<Item = Result<async_nats::jetstream::Message, E>> + Unpin,
    E: std::fmt::Display,
{
    let (mut count, mut bytes) = (0u64, 0u64);
    let read = tokio::time::timeout(READ_LIMIT, async {
        while count < messages {
            match stream.next().await {
                Some(Ok(message)) => {
                    count += 1;
                    bytes += message.payload.len() as u64;
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("the consumer ended".to_string()),
            }
        }
        Ok(())
    })
    .await;
    match read {
        Ok(Ok(())) => Ok((count, bytes)),
        Ok(Err(e)) => Err(format!("nats reader after {count} of {messages}: {e}").into()),
        Err(_) => Err(format!("nats reader timed out after {count} of {messages}").into()),
    }
}

// ---------------------------------------------------------------------------------------------
// The raw file.

/// A file of `len` bytes, written and synced (as the streams are on disk before they are read).
fn write_raw_file(path: &Path, len: u64) -> BenchResult<()> {
    let _ = std::fs::remove_file(path);
    let fd = crate::raw::preallocated_file(path, len)?;
    let chunk = vec![0x5a_u8; RAW_CHUNK_BYTES];
    let mut position = 0u64;
    while position < len {
        let want = (len - position).min(chunk.len() as u64) as usize;
        crate::raw::pwrite_all(&fd, &chunk[..want], position)?;
        position += want as u64;
    }
    rustix::fs::fdatasync(&fd)?;
    Ok(())
}

fn raw_read(path: &Path, len: u64, cache: &PageCache, state: Cache) -> BenchResult<ReadRun> {
    if state == Cache::Cold {
        cache.drop_caches()?;
    }
    let mut buf = vec![0u8; RAW_CHUNK_BYTES];
    let began = Instant::now();
    let read = crate::raw::pread_file(path, len, &mut buf)?;
    Ok(ReadRun {
        payload_bytes: read,
        messages: 0,
        elapsed: began.elapsed(),
    })
}

// ---------------------------------------------------------------------------------------------
// Memory with many readers.

/// VmRSS of `pid`, in bytes.
fn vm_rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

/// Samples `pid`'s VmRSS until `stop`; the largest seen.
fn sample_peak_rss(pid: u32, stop: &AtomicBool) -> u64 {
    let mut peak = 0u64;
    while !stop.load(Ordering::Relaxed) {
        peak = peak.max(vm_rss_bytes(pid).unwrap_or(0));
        std::thread::sleep(RSS_SAMPLE_INTERVAL);
    }
    peak.max(vm_rss_bytes(pid).unwrap_or(0))
}

fn rss_case(
    config: &StreamBenchConfig,
    rt: &tokio::runtime::Runtime,
    child: &KeratinChild,
    cache: &PageCache,
    figures: &mut Figures,
) -> BenchResult<()> {
    let name = "bench-stream-rss";
    let addr = child.addr();
    let pid = child.pid();
    let rss_config = StreamBenchConfig {
        stream_bytes: config.rss_bytes,
        ..config.clone()
    };
    let (end_offset, publish_rate) = rt.block_on(async {
        let client = Client::connect(addr, ClientOptions::default()).await?;
        let _ = client.delete_stream(name).await;
        client
            .declare_stream(name, StreamSettings::default())
            .await?;
        client.close().await;
        let endpoints = Endpoints {
            keratin: Some(addr),
            ..Endpoints::default()
        };
        let peer = Peer::connect(System::Keratin, &endpoints, name).await?;
        let rate = publish(&rss_config, &peer).await?;
        let Peer::Keratin { client, .. } = &peer else {
            return Err::<_, crate::contender::BenchError>("not Keratin".into());
        };
        let info = client.stream_info(name).await?;
        let end = info.partitions.first().map_or(0, |p| p.next_offset);
        peer.close().await;
        Ok((end, rate))
    })?;
    std::thread::sleep(Duration::from_secs(2));
    let idle = vm_rss_bytes(pid).unwrap_or(0);
    cache.drop_caches()?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || sample_peak_rss(pid, &stop))
    };
    let read = rt.block_on(rss_readers(addr, name, end_offset, config));
    stop.store(true, Ordering::Relaxed);
    let peak = sampler.join().map_err(|_| "the RSS sampler panicked")?;
    let read = read?;
    rt.block_on(async {
        let client = Client::connect(addr, ClientOptions::default()).await?;
        client.delete_stream(name).await?;
        client.close().await;
        Ok::<_, crate::contender::BenchError>(())
    })?;
    figures.record("rss-idle", "keratin", idle as f64);
    figures.record("rss-peak", "keratin", peak as f64);
    figures.notes.push(format!(
        "memory case: stream of {:.2} GB payload ({} offsets) built at {:.0} msg/s; {} readers \
         from offsets spread evenly over it read {:.2} GB in {:.1} s ({:.0} MB/s together), \
         page cache {} before they started",
        rss_config.messages() as f64 * config.body_bytes as f64 / 1e9,
        end_offset,
        publish_rate,
        config.rss_readers,
        read.payload_bytes as f64 / 1e9,
        read.elapsed.as_secs_f64(),
        read.mb_per_s(),
        if cache.dropping() { "dropped" } else { "warm" },
    ));
    Ok(())
}

/// `rss_readers` readers, reader i from offset i × end / readers, each until the end (nothing
/// for a while) or the case's time is up.
async fn rss_readers(
    addr: SocketAddr,
    stream: &str,
    end_offset: u64,
    config: &StreamBenchConfig,
) -> BenchResult<ReadRun> {
    let readers = config.rss_readers.max(1);
    let deadline = tokio::time::Instant::now() + config.rss_duration;
    let began = Instant::now();
    let tasks: Vec<_> = (0..readers)
        .map(|i| {
            let start = end_offset * i as u64 / readers as u64;
            let options = StreamSubscribeOptions::new(stream)
                .credit(config.credit)
                .start(StreamStart::Offset(start));
            tokio::spawn(async move {
                let client = Client::connect(addr, ClientOptions::default()).await?;
                let mut consumer = client.stream_subscribe(options).await?;
                let (mut count, mut bytes) = (0u64, 0u64);
                loop {
                    let wait = RSS_READ_IDLE.min(deadline - tokio::time::Instant::now());
                    match tokio::time::timeout(wait, consumer.recv()).await {
                        Ok(Some(delivery)) => {
                            count += 1;
                            bytes += delivery.body.len() as u64;
                        }
                        Ok(None) => return Err("a memory-case reader ended".into()),
                        Err(_) => break,
                    }
                }
                consumer.cancel().await?;
                client.close().await;
                Ok((count, bytes))
            })
        })
        .collect();
    join_readers(tasks, began).await
}

// ---------------------------------------------------------------------------------------------
// The table.

/// One row: both figures' medians, the median of the per-round ratios, the goal.
struct Line {
    case: String,
    keratin: String,
    reference: String,
    ratio: Option<(f64, Vec<f64>)>,
    goal: Option<f64>,
}

fn ratios(keratin: &[f64], reference: &[f64]) -> Option<(f64, Vec<f64>)> {
    let per_round: Vec<f64> = keratin
        .iter()
        .zip(reference)
        .filter(|(_, r)| **r > 0.0)
        .map(|(k, r)| k / r)
        .collect();
    (!per_round.is_empty()).then(|| (median(&per_round), per_round))
}

fn compare_line(
    figures: &Figures,
    case: &str,
    label: String,
    reference: &'static str,
    unit: &str,
    goal: Option<f64>,
) -> Option<Line> {
    let k = figures.get(case, "keratin");
    let r = figures.get(case, reference);
    if k.is_empty() || r.is_empty() {
        return None;
    }
    Some(Line {
        case: label,
        keratin: format!("{:.0} {unit}", median(k)),
        reference: format!("{reference} {:.0} {unit}", median(r)),
        ratio: ratios(k, r),
        goal,
    })
}

fn lines(config: &StreamBenchConfig, caches: &[Cache], figures: &Figures) -> Vec<Line> {
    let mut out = Vec::new();
    out.extend(compare_line(
        figures,
        &publish_case(),
        format!(
            "confirmed publish {} B, {} in flight",
            config.body_bytes, config.in_flight
        ),
        "nats",
        "msg/s",
        Some(GOAL_VS_NATS),
    ));
    for readers in [1, config.fan_out] {
        for &state in caches {
            out.extend(compare_line(
                figures,
                &read_case(readers, state),
                format!(
                    "fan-out read, {readers} reader{}, {}",
                    if readers == 1 { "" } else { "s" },
                    state.name()
                ),
                "nats",
                "MB/s",
                Some(GOAL_VS_NATS),
            ));
        }
    }
    for &state in caches {
        out.extend(compare_line(
            figures,
            &read_case(1, state),
            format!("sequential read, 1 reader, {}", state.name()),
            "raw",
            "MB/s",
            Some(GOAL_READ_VS_RAW),
        ));
    }
    let idle = figures.get("rss-idle", "keratin");
    let peak = figures.get("rss-peak", "keratin");
    if let (Some(idle), Some(peak)) = (idle.first(), peak.first()) {
        out.push(Line {
            case: format!(
                "RSS, {} readers, {:.1} GiB stream",
                config.rss_readers,
                config.rss_bytes as f64 / f64::from(1u32 << 30)
            ),
            keratin: format!("peak {:.1} MB", peak / 1e6),
            reference: format!("keratin idle before {:.1} MB", idle / 1e6),
            ratio: None,
            goal: None,
        });
    }
    out
}

fn markdown(
    config: &StreamBenchConfig,
    cache: &PageCache,
    caches: &[Cache],
    figures: &Figures,
) -> String {
    let mut rows = vec![[
        "case",
        "keratin",
        "reference",
        "ratio",
        "goal",
        "",
        "rounds",
    ]
    .map(String::from)
    .to_vec()];
    for line in lines(config, caches, figures) {
        let (ratio, rounds) =
            line.ratio
                .as_ref()
                .map_or(("-".into(), String::new()), |(r, all)| {
                    let all: Vec<String> = all.iter().map(|x| format!("{x:.2}")).collect();
                    (format!("{r:.2}"), all.join(" "))
                });
        let verdict = match (line.goal, line.ratio.as_ref()) {
            (Some(goal), Some((r, _))) if *r >= goal => "met",
            (Some(_), Some(_)) => "MISSED",
            _ => "",
        };
        rows.push(vec![
            line.case,
            line.keratin,
            line.reference,
            ratio,
            line.goal.map_or("-".into(), |g| format!(">= {g:.1}")),
            verdict.into(),
            rounds,
        ]);
    }
    let gib = config.stream_bytes as f64 / f64::from(1u32 << 30);
    let mut out = format!(
        "Settings: a stream of {gib:.2} GiB ({} messages of {} B), one partition / one subject, \
         {} round(s) (keratin, nats, raw in turn; medians; ratio = median of per-round ratios);\n\
         publish: {} confirmed publishes in flight on one connection; reads from `first` by 1 and \
         by {} readers, each on its own connection reading all of it; MB/s = 10^6 B of payload \
         per second, summed over readers;\n\
         Keratin readers: no cursor, credit {}; NATS readers: {} (`async-nats`), stream with \
         limits retention, file storage; raw: `pread` of 1 MiB chunks of a file of the same \
         payload size.\nPage cache: {}.\n\n",
        config.messages(),
        config.body_bytes,
        config.rounds,
        config.in_flight,
        config.fan_out,
        config.credit,
        config.nats_consumer.name(),
        cache.describe(),
    );
    out.push_str("```\n");
    out.push_str(&text_table(&rows));
    out.push_str("```\n");
    let mut per_round = String::new();
    for ((case, column), values) in &figures.values {
        if case.starts_with("rss") {
            continue;
        }
        let values: Vec<String> = values.iter().map(|v| format!("{v:.0}")).collect();
        per_round.push_str(&format!("- {case} {column}: {}\n", values.join(" ")));
    }
    if !per_round.is_empty() {
        out.push_str("\nPer-round figures (msg/s for publish, MB/s for reads):\n");
        out.push_str(&per_round);
    }
    if let Some(nats_vs_raw) = ratios(
        figures.get(&read_case(1, Cache::Warm), "nats"),
        figures.get(&read_case(1, Cache::Warm), "raw"),
    ) {
        out.push_str(&format!(
            "- for comparison, nats / raw, 1 reader, warm: {:.2}\n",
            nats_vs_raw.0
        ));
    }
    for note in &figures.notes {
        out.push_str(&format!("- {note}\n"));
    }
    out
}
