//! Declare, delete and settings changes hold no lock across disk I/O, and stay well defined
//! when they race:
//! - concurrent declares of one name agree (same settings: one queue; other settings: one
//!   wins, the rest get `Conflict`), and a delete racing a declare leaves a state that a
//!   restart reads back identically;
//! - the node bounds (`queues_max`, `partitions_max`) count declares in flight, so concurrent
//!   declares never overshoot them; `consumers_max` refuses with `Limited { consumers }`;
//! - declares on a metadata disk whose syncs take 100 ms run side by side and share syncs
//!   (group commit): 20 concurrent declares finish in far less than 20 syncs' time. A lock
//!   held across the sync would serialize them and fail this;
//! - a crash at every step of declare / delete / declare (simulated disk) reopens to a prefix
//!   of the operations, with no more queue directories than declared queues and every queue
//!   usable: the metadata record is durable before logs are created, and a deletion before
//!   files go.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keratin_broker::{Broker, BrokerError, Message, QueueSettings};
use keratin_log::{FsStats, Io, IoError, IoFile, OpenMode, RealIo, SimIo};

type IoResult<T> = Result<T, IoError>;

fn partitions(n: u32) -> QueueSettings {
    QueueSettings {
        partitions: n,
        ..QueueSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_declares_of_one_name_agree() {
    let dir = tempfile::tempdir().expect("tmp");
    let broker = Broker::open(config(dir.path().join("data")))
        .await
        .expect("open");
    let mut tasks = Vec::new();
    for i in 0..8u32 {
        let broker = broker.clone();
        tasks.push(tokio::spawn(async move {
            // Half ask for one partition, half for two: exactly one settings wins.
            broker.declare("same", partitions(1 + i % 2)).await
        }));
    }
    let mut won = BTreeSet::new();
    let mut conflicts = 0;
    for task in tasks {
        match task.await.expect("task") {
            Ok(info) => {
                won.insert(info.settings.partitions);
            }
            Err(BrokerError::Conflict { .. }) => conflicts += 1,
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        won.len(),
        1,
        "every successful declare saw one settings: {won:?}"
    );
    assert_eq!(conflicts, 4, "the other settings conflict");
    assert_eq!(broker.list().len(), 1);
    broker.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_racing_a_declare_is_ordered_and_survives_a_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data");
    let broker = Broker::open(config(data.clone())).await.expect("open");
    for round in 0..20 {
        let name = format!("q{round}");
        let (declared, deleted) = tokio::join!(
            broker.declare(&name, QueueSettings::default()),
            broker.delete(&name)
        );
        declared.expect("declare");
        let exists = broker.info(&name).is_ok();
        match deleted {
            Ok(()) => assert!(!exists, "{name}: deleted after the declare"),
            Err(BrokerError::NotFound(_)) => assert!(exists, "{name}: deleted before"),
            Err(other) => panic!("{name}: {other:?}"),
        }
    }
    let before: Vec<String> = broker.list().into_iter().map(|q| q.name).collect();
    broker.shutdown().await.expect("shutdown");
    let reopened = Broker::open(config(data.clone())).await.expect("reopen");
    let after: Vec<String> = reopened.list().into_iter().map(|q| q.name).collect();
    assert_eq!(before, after, "the restart reads back what was answered");
    // A queue's directory exists once its log wrote (logs create their files lazily), so
    // there are at most as many as queues.
    assert!(
        queue_dirs(&data).len() <= after.len(),
        "no files of a deleted queue are left"
    );
}

fn queue_dirs(storage: &Path) -> Vec<String> {
    std::fs::read_dir(storage.join("queues"))
        .map(|entries| {
            entries
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_declares_never_pass_the_node_bounds() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = config(dir.path().join("data"));
    config.queues_max = 3;
    config.partitions_max = 5;
    let broker = Broker::open(config).await.expect("open");
    let mut tasks = Vec::new();
    for i in 0..12 {
        let broker = broker.clone();
        tasks.push(tokio::spawn(async move {
            broker.declare(&format!("q{i}"), partitions(1)).await
        }));
    }
    let mut ok = 0;
    for task in tasks {
        match task.await.expect("task") {
            Ok(_) => ok += 1,
            Err(BrokerError::NodeFull(message)) => {
                assert!(message.contains("server.queues_max"), "{message}")
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(ok, 3, "exactly queues_max declares succeed");
    let names: Vec<String> = broker.list().into_iter().map(|q| q.name).collect();
    broker.delete(&names[0]).await.expect("delete");
    let refused = broker.declare("wide", partitions(4)).await;
    assert!(
        matches!(&refused, Err(BrokerError::NodeFull(m)) if m.contains("partitions_max")),
        "2 + 4 partitions pass 5: {refused:?}"
    );
    broker
        .declare("narrow", partitions(3))
        .await
        .expect("2 + 3 fit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_are_bounded_per_node() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = config(dir.path().join("data"));
    config.consumers_max = 2;
    let broker = Broker::open(config).await.expect("open");
    broker
        .declare("a", QueueSettings::default())
        .await
        .expect("a");
    broker
        .declare("b", QueueSettings::default())
        .await
        .expect("b");
    let first = broker.subscribe("a", 10).expect("1 of 2");
    let _second = broker.subscribe("b", 10).expect("2 of 2");
    assert_eq!(broker.consumer_count(), 2);
    match broker.subscribe("a", 10) {
        Err(BrokerError::Limited {
            reason,
            retry_after_ms,
            message,
        }) => {
            assert_eq!(reason, "consumers");
            assert!(retry_after_ms > 0);
            assert!(message.contains("server.consumers_max"), "{message}");
        }
        other => panic!("expected a consumers refusal, got {other:?}"),
    }
    drop(first);
    assert_eq!(broker.consumer_count(), 1);
    broker.subscribe("a", 10).expect("room again");
}

/// Real disk, but every `sync_data` of a file under the metadata directory takes `delay`.
#[derive(Debug)]
struct SlowMetaIo {
    real: RealIo,
    meta: PathBuf,
    delay: Duration,
}

#[derive(Debug)]
struct SlowFile {
    file: Arc<dyn IoFile>,
    delay: Option<Duration>,
}

impl IoFile for SlowFile {
    fn read_exact_at(&self, buf: &mut [u8], position: u64) -> IoResult<()> {
        self.file.read_exact_at(buf, position)
    }
    fn write_all_at(&self, buf: &[u8], position: u64) -> IoResult<()> {
        self.file.write_all_at(buf, position)
    }
    fn sync_data(&self) -> IoResult<()> {
        if let Some(delay) = self.delay {
            std::thread::sleep(delay);
        }
        self.file.sync_data()
    }
    fn allocate(&self, len: u64) -> IoResult<()> {
        self.file.allocate(len)
    }
    fn set_len(&self, len: u64) -> IoResult<()> {
        self.file.set_len(len)
    }
    fn len(&self) -> IoResult<u64> {
        self.file.len()
    }
}

impl Io for SlowMetaIo {
    fn open(&self, path: &Path, mode: OpenMode) -> IoResult<Arc<dyn IoFile>> {
        let file = self.real.open(path, mode)?;
        let delay = path.starts_with(&self.meta).then_some(self.delay);
        Ok(Arc::new(SlowFile { file, delay }))
    }
    fn create_dir_all(&self, path: &Path) -> IoResult<()> {
        self.real.create_dir_all(path)
    }
    fn read_dir(&self, path: &Path) -> IoResult<Vec<String>> {
        self.real.read_dir(path)
    }
    fn remove_file(&self, path: &Path) -> IoResult<()> {
        self.real.remove_file(path)
    }
    fn remove_dir(&self, path: &Path) -> IoResult<()> {
        self.real.remove_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> IoResult<()> {
        self.real.rename(from, to)
    }
    fn sync_dir(&self, path: &Path) -> IoResult<()> {
        self.real.sync_dir(path)
    }
    fn device_id(&self, path: &Path) -> IoResult<u64> {
        self.real.device_id(path)
    }
    fn exists(&self, path: &Path) -> IoResult<bool> {
        self.real.exists(path)
    }
    fn fs_stats(&self, path: &Path) -> IoResult<FsStats> {
        self.real.fs_stats(path)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_declares_share_metadata_syncs() {
    const DECLARES: u32 = 20;
    const SYNC: Duration = Duration::from_millis(100);
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data");
    let io = Arc::new(SlowMetaIo {
        real: RealIo::new(),
        meta: data.join("meta"),
        delay: SYNC,
    });
    let broker = Broker::open(config_on(io, vec![data])).await.expect("open");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..DECLARES {
        let broker = broker.clone();
        tasks.push(tokio::spawn(async move {
            broker
                .declare(&format!("q{i}"), QueueSettings::default())
                .await
        }));
    }
    for task in tasks {
        task.await.expect("task").expect("declare");
    }
    let elapsed = started.elapsed();
    eprintln!("{DECLARES} concurrent declares with {SYNC:?} metadata syncs took {elapsed:?}");
    assert!(
        elapsed < SYNC * DECLARES / 2,
        "{DECLARES} declares took {elapsed:?}: they waited for each other's syncs"
    );
    assert_eq!(broker.list().len(), DECLARES as usize);
}

/// Declare `a` and `b`, publish to `a`, delete `a`, declare `c`: every step of it, crashed.
async fn metadata_workload(sim: &SimIo) -> Result<(), BrokerError> {
    let broker = Broker::open(config_on(Arc::new(sim.clone()), vec!["/node".into()])).await?;
    broker.declare("a", QueueSettings::default()).await?;
    broker.declare("b", partitions(2)).await?;
    for result in broker.publish("a", vec![Message::new(b"x".to_vec())]).await {
        result?;
    }
    broker.delete("a").await?;
    broker.declare("c", QueueSettings::default()).await?;
    broker.shutdown().await
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn a_crash_at_every_step_of_declare_and_delete_recovers_a_prefix() {
    let seed = seed(13);
    let reference = SimIo::new(seed);
    current_thread()
        .block_on(metadata_workload(&reference))
        .expect("reference run");
    let steps = reference.steps();
    eprintln!("{steps} io calls in the reference run");
    // The states a prefix of the operations leaves, as the sets of queue names.
    let prefixes: Vec<BTreeSet<&str>> = vec![
        BTreeSet::new(),
        BTreeSet::from(["a"]),
        BTreeSet::from(["a", "b"]),
        BTreeSet::from(["b"]),
        BTreeSet::from(["b", "c"]),
    ];
    let only: Option<u64> = std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok());
    for k in (0..steps).filter(|k| only.is_none_or(|only| only == *k)) {
        let sim = SimIo::new(seed);
        sim.crash_after(k);
        let _ = current_thread().block_on(metadata_workload(&sim));
        let disk = sim.restart();
        current_thread().block_on(async {
            let broker = Broker::open(config_on(Arc::new(disk.clone()), vec!["/node".into()]))
                .await
                .unwrap_or_else(|e| panic!("step {k} (seed {seed}): reopen failed: {e}"));
            let names: BTreeSet<String> = broker.list().into_iter().map(|q| q.name).collect();
            let names: BTreeSet<&str> = names.iter().map(String::as_str).collect();
            assert!(
                prefixes.contains(&names),
                "step {k} (seed {seed}): queues {names:?} are no prefix of the operations"
            );
            let declared = broker.list().len();
            let dirs = disk
                .read_dir(Path::new("/node/queues"))
                .unwrap_or_default()
                .len();
            // Logs create their directories lazily: at most one per declared queue.
            assert!(
                dirs <= declared,
                "step {k} (seed {seed}): {dirs} queue directories for {declared} queues"
            );
            for name in &names {
                for result in broker
                    .publish(name, vec![Message::new(b"y".to_vec())])
                    .await
                {
                    result.unwrap_or_else(|e| panic!("step {k}: {name} takes a publish: {e}"));
                }
            }
            broker.shutdown().await.expect("shutdown");
        });
    }
}

/// Every file under `dir`, at any depth.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// The node's metadata log loses its records (the nemesis zeroed it past its segments'
/// headers: recovery takes zeroes for a torn tail and keeps nothing): the queues' directories
/// are then named by no declaration. The node must not take them for a deleted queue's
/// leftovers: it refuses to start, saying what happened and what to do, and deletes nothing.
/// Before, it removed every queue's files and started empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_log_that_lost_its_records_deletes_no_queue_data() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data");
    let broker = Broker::open(config(data.clone())).await.expect("open");
    broker
        .declare("kept", partitions(1))
        .await
        .expect("declare");
    publish_seq(&broker, "kept", 0..10, 64).await;
    broker.shutdown().await.expect("shutdown");
    let before = queue_dirs(&data);
    assert!(!before.is_empty(), "the queue's directory");

    for file in files_under(&data.join("meta")) {
        let mut bytes = std::fs::read(&file).expect("read");
        if bytes.len() > 64 {
            bytes[64..].fill(0);
            std::fs::write(&file, bytes).expect("zero");
        }
    }
    let refused = match Broker::open(config(data.clone())).await {
        Ok(_) => panic!(
            "opened with the metadata log's records gone; queue directories left: {:?} of {before:?}",
            queue_dirs(&data)
        ),
        Err(error) => error,
    };
    let text = refused.to_string();
    assert!(
        matches!(refused, BrokerError::MetadataLost { kind: "queue", .. }),
        "{text}"
    );
    assert!(
        text.contains("Nothing was deleted") && text.contains("meta"),
        "{text}"
    );
    assert_eq!(queue_dirs(&data), before, "no queue directory removed");
}
