//! The node segment pool: reuse across logs never lets a record of a file's earlier life through
//! (including leftovers whose offsets continue the new segment exactly), budget and release hold,
//! two pools never exchange files, generations are retired before they wrap, bad spares are never
//! adopted, and a crash at any step of entering or taking a spare loses nothing durable. A failure
//! means a reused file leaks old records into a log, or the pool loses or invents files.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{payload, record, seed};
use keratin_log::format::{HeaderKind, SegmentHeader, SizeClass, SPARE_BASE};
use keratin_log::{Io, Log, LogOptions, OpenMode, PoolOptions, SegmentPool, SimIo};

const SEGMENT: u64 = 256 << 10;

fn options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: SEGMENT,
        ..LogOptions::default()
    }
}

fn pool_options(budget_bytes: Option<u64>) -> PoolOptions {
    PoolOptions {
        full_segment_size_bytes: SEGMENT,
        budget_bytes,
        background: false,
        ..PoolOptions::default()
    }
}

fn node_pool(io: &Arc<dyn Io>, root: &Path, budget_bytes: Option<u64>) -> SegmentPool {
    io.create_dir_all(root).expect("mkdir");
    let pool = SegmentPool::new(io.clone(), pool_options(budget_bytes));
    pool.add_storage_dir(root).expect("add storage dir");
    pool
}

fn fill(log: &Log, from: u64, count: u64, version: u32, len: usize) {
    for i in from..from + count {
        log.append_sync(&[record(&payload(i, version, len))])
            .expect("append");
    }
}

fn read_all(log: &Log) -> Vec<(u64, Vec<u8>)> {
    log.reader(log.start_offset())
        .map(|r| r.expect("read"))
        .map(|r| (r.offset, r.payload))
        .collect()
}

#[test]
fn reused_file_with_exactly_continuing_offsets_is_never_accepted() {
    let sim = SimIo::new(seed(1));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let root = PathBuf::from("/node");
    let pool = node_pool(&io, &root, None);
    // Log A writes offsets 0.. into its first segment, then lets the segment go.
    let a = Log::open(io.clone(), &root.join("a"), options(), Some(pool.clone())).expect("open a");
    fill(&a, 0, 200, 0, 1000);
    a.roll().expect("roll").wait().expect("roll");
    let removed = a.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    assert!(removed.segments >= 1);
    // Log B's first segment (base 0) is A's old file: its leftovers are offsets 0, 1, 2, ...
    // with valid checksums, exactly continuing B's base.
    let b = Log::open(io.clone(), &root.join("b"), options(), Some(pool.clone())).expect("open b");
    assert_eq!(
        b.stats().segments.len(),
        0,
        "a log takes its first segment lazily"
    );
    fill(&b, 0, 3, 9, 10);
    assert!(
        pool.counters().takes_from_pool >= 1,
        "{:?}",
        pool.counters()
    );
    let stats = b.stats();
    assert_eq!(
        stats.segments[0].generation, 2,
        "a reused file has the next generation"
    );
    assert_eq!(b.next_offset(), 3, "no leftover record of A is part of B");
    drop(b);
    // Crash: B reopens from what is durable; A's leftovers after B's three records stay out.
    let sim = sim.restart();
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool = node_pool(&io, &root, None);
    let b = Log::open(io.clone(), &root.join("b"), options(), Some(pool)).expect("reopen b");
    let records = read_all(&b);
    assert_eq!(records.len(), 3);
    for (offset, body) in records {
        assert_eq!(body, payload(offset, 9, 10));
    }
}

#[test]
fn budget_release_and_figures() {
    let sim = SimIo::new(seed(2));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let root = PathBuf::from("/node");
    let pool = node_pool(&io, &root, Some(2 * SEGMENT));
    let log = Log::open(io.clone(), &root.join("q"), options(), Some(pool.clone())).expect("open");
    fill(&log, 0, 1400, 0, 1000);
    let segments = log.stats().segments.len();
    assert!(segments >= 6, "{segments}");
    log.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    pool.flush();
    let fs = &pool.filesystems()[0];
    assert_eq!(fs.full_count, 2, "the budget keeps two spares: {fs:?}");
    assert_eq!(fs.spare_bytes, 2 * SEGMENT);
    assert_eq!(fs.spares_dir, root.join("spares"));
    let counters = pool.counters();
    assert_eq!(counters.deleted_over_budget as usize, segments - 1 - 2);
    let spares_on_disk = io.read_dir(&root.join("spares")).expect("ls");
    assert_eq!(spares_on_disk.len(), 2, "{spares_on_disk:?}");
    let device = fs.device;
    assert_eq!(pool.spare_bytes(device), 2 * SEGMENT);
    assert_eq!(pool.release(device, SEGMENT).expect("release"), SEGMENT);
    assert_eq!(pool.release(device, 0).expect("release"), SEGMENT);
    assert_eq!(pool.spare_bytes(device), 0);
    assert_eq!(pool.counters().released, 2);
    assert!(io.read_dir(&root.join("spares")).expect("ls").is_empty());
    // The log goes on with fresh files.
    fill(&log, 1400, 300, 0, 1000);
    assert!(pool.counters().takes_fresh > 0);
}

#[test]
fn default_budget_is_two_percent_capped_at_one_gib() {
    let sim = SimIo::new(3);
    sim.set_space_limit(Some(100 << 20));
    let io: Arc<dyn Io> = Arc::new(sim);
    let root = PathBuf::from("/small");
    io.create_dir_all(&root).expect("mkdir");
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: SEGMENT,
            budget_bytes: None,
            background: false,
            ..PoolOptions::default()
        },
    );
    pool.add_storage_dir(&root).expect("add");
    assert_eq!(pool.filesystems()[0].budget_bytes, (100u64 << 20) * 2 / 100);
    let big = SimIo::new(4);
    let io: Arc<dyn Io> = Arc::new(big);
    io.create_dir_all(&root).expect("mkdir");
    let pool = SegmentPool::new(io.clone(), pool_options(None));
    pool.add_storage_dir(&root).expect("add");
    assert_eq!(
        pool.filesystems()[0].budget_bytes,
        1 << 30,
        "1 TiB sim disk: capped"
    );
}

#[test]
fn two_pools_never_exchange_files() {
    let sim = SimIo::new(seed(5));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let pool1 = node_pool(&io, Path::new("/n1"), None);
    let pool2 = node_pool(&io, Path::new("/n2"), None);
    let a = Log::open(
        io.clone(),
        Path::new("/n1/q"),
        options(),
        Some(pool1.clone()),
    )
    .expect("a");
    fill(&a, 0, 800, 0, 1000);
    a.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    pool1.flush();
    assert!(pool1.spare_bytes(1) > 0);
    let b = Log::open(
        io.clone(),
        Path::new("/n2/q"),
        options(),
        Some(pool2.clone()),
    )
    .expect("b");
    fill(&b, 0, 800, 0, 1000);
    assert_eq!(
        pool2.counters().takes_from_pool,
        0,
        "node 2 never takes node 1's spares"
    );
    for segment in b.stats().segments {
        assert!(segment.path.starts_with("/n2"), "{segment:?}");
    }
    for name in io.read_dir(Path::new("/n1/spares")).expect("ls") {
        assert!(name.ends_with(".spare"), "{name}");
    }
    let n2_spares = io.read_dir(Path::new("/n2/spares")).expect("ls");
    assert!(n2_spares.is_empty(), "{n2_spares:?}");
}

#[test]
fn spares_are_grouped_by_filesystem() {
    let sim = SimIo::new(6);
    sim.set_device(Path::new("/disk2"), 2);
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    io.create_dir_all(Path::new("/disk1")).expect("mkdir");
    io.create_dir_all(Path::new("/disk2")).expect("mkdir");
    let pool = SegmentPool::new(io.clone(), pool_options(None));
    pool.add_storage_dir(Path::new("/disk1")).expect("add");
    pool.add_storage_dir(Path::new("/disk2")).expect("add");
    let a = Log::open(
        io.clone(),
        Path::new("/disk1/q"),
        options(),
        Some(pool.clone()),
    )
    .expect("a");
    fill(&a, 0, 800, 0, 1000);
    a.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    let b = Log::open(
        io.clone(),
        Path::new("/disk2/q"),
        options(),
        Some(pool.clone()),
    )
    .expect("b");
    fill(&b, 0, 600, 0, 1000);
    assert_eq!(
        pool.counters().takes_from_pool,
        0,
        "no spare crosses file systems"
    );
    assert!(pool.spare_bytes(1) > 0);
    assert_eq!(pool.spare_bytes(2), 0);
    // A log on disk 1 takes disk 1's spares.
    let c = Log::open(
        io.clone(),
        Path::new("/disk1/r"),
        options(),
        Some(pool.clone()),
    )
    .expect("c");
    fill(&c, 0, 10, 0, 10);
    assert!(pool.counters().takes_from_pool >= 1);
}

fn write_spare(io: &Arc<dyn Io>, path: &Path, generation: u16, len: u64) {
    let file = io.open(path, OpenMode::CreateNew).expect("create");
    file.allocate(len).expect("allocate");
    let header = SegmentHeader {
        size_class: SizeClass::Full,
        kind: HeaderKind::Spare,
        generation,
        base_offset: SPARE_BASE,
        segment_size_bytes: SEGMENT,
    };
    if len >= 64 {
        file.write_all_at(&header.encode(), 0).expect("header");
    }
    file.sync_data().expect("sync");
}

#[test]
fn generation_is_retired_before_it_wraps_and_bad_spares_are_never_adopted() {
    let sim = SimIo::new(seed(7));
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let root = PathBuf::from("/node");
    let spares = root.join("spares");
    io.create_dir_all(&spares).expect("mkdir");
    write_spare(
        &io,
        &spares.join("full-0000000000000001.spare"),
        // Adoption bumps the generation: the log takes it as 65,534.
        65_533,
        SEGMENT,
    );
    write_spare(&io, &spares.join("full-0000000000000002.spare"), 5, 0);
    // Longer than its class's size: never written by a log (files grow up to the size).
    write_spare(
        &io,
        &spares.join("full-0000000000000003.spare"),
        5,
        SEGMENT + 4096,
    );
    write_spare(&io, &spares.join("junk.tmp"), 5, SEGMENT);
    let pool = SegmentPool::new(io.clone(), pool_options(None));
    pool.add_storage_dir(&root).expect("add");
    let names = io.read_dir(&spares).expect("ls");
    assert!(
        names.len() == 1 && names[0].ends_with(".spare"),
        "bad spares deleted, the good one adopted: {names:?}"
    );
    // Use 65,534: the log takes the spare.
    let log = Log::open(io.clone(), &root.join("q"), options(), Some(pool.clone())).expect("open");
    fill(&log, 0, 300, 0, 1000);
    assert_eq!(log.stats().segments[0].generation, 65_534);
    log.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    // Use 65,535: it comes back once more...
    let log2 = Log::open(io.clone(), &root.join("r"), options(), Some(pool.clone())).expect("open");
    fill(&log2, 0, 300, 0, 1000);
    assert_eq!(log2.stats().segments[0].generation, 65_535);
    assert_eq!(pool.counters().retired_generation, 0);
    log2.remove_prefix(u64::MAX)
        .expect("rm")
        .wait()
        .expect("rm");
    // ...and is retired instead of wrapping to 0.
    assert_eq!(pool.counters().retired_generation, 1);
    for name in io.read_dir(&spares).expect("ls") {
        let file = io
            .open(&spares.join(&name), OpenMode::Existing)
            .expect("open");
        let mut bytes = [0u8; 64];
        file.read_exact_at(&mut bytes, 0).expect("read");
        let header = SegmentHeader::decode(&bytes).expect("valid spare");
        assert!(
            header.generation >= 2 && header.generation < 65_535,
            "{header:?}"
        );
    }
}

#[test]
fn private_pool_keeps_at_most_four_spares_beside_the_log() {
    let sim = SimIo::new(8);
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let dir = PathBuf::from("/solo/q");
    let log = Log::open(io.clone(), &dir, options(), None).expect("open");
    fill(&log, 0, 2000, 0, 1000);
    let segments = log.stats().segments.len();
    assert!(segments > 6);
    log.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    log.pool().flush();
    let spares = io.read_dir(&dir.join("spares")).expect("ls");
    assert_eq!(spares.len(), 4, "{spares:?}");
    fill(&log, 2000, 600, 0, 1000);
    assert!(log.pool().counters().takes_from_pool >= 2);
    log.delete().expect("delete");
    assert!(
        !io.exists(&dir).expect("stat"),
        "delete removes the directory"
    );
}

#[test]
fn background_worker_prepares_spares() {
    let sim = SimIo::new(9);
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    io.create_dir_all(Path::new("/bg")).expect("mkdir");
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: SEGMENT,
            budget_bytes: None,
            background: true,
            ..PoolOptions::default()
        },
    );
    pool.add_storage_dir(Path::new("/bg")).expect("add");
    let log = Log::open(
        io.clone(),
        Path::new("/bg/q"),
        options(),
        Some(pool.clone()),
    )
    .expect("o");
    fill(&log, 0, 1200, 0, 1000);
    let removed = log.remove_prefix(u64::MAX).expect("rm").wait().expect("rm");
    pool.flush();
    assert_eq!(pool.filesystems()[0].full_count as usize, removed.segments);
    assert_eq!(pool.counters().entered as usize, removed.segments);
}

/// The pool workload replayed for the crash test: log A fills and gives segments back (enter),
/// log B rolls through them (take), then A is deleted.
fn pool_workload(io: &Arc<dyn Io>, acked: &mut Vec<(String, u64, Vec<u8>)>) -> Result<(), String> {
    let root = Path::new("/node");
    io.create_dir_all(root).map_err(|e| e.to_string())?;
    let pool = SegmentPool::new(io.clone(), pool_options(None));
    pool.add_storage_dir(root).map_err(|e| e.to_string())?;
    let a = Log::open(io.clone(), &root.join("a"), options(), Some(pool.clone()))
        .map_err(|e| e.to_string())?;
    let b = Log::open(io.clone(), &root.join("b"), options(), Some(pool.clone()))
        .map_err(|e| e.to_string())?;
    for i in 0..24u64 {
        let body = payload(i, 1, 30_000);
        a.append_sync(&[record(&body)]).map_err(|e| e.to_string())?;
        acked.push(("a".into(), i, body));
    }
    // Records below the cut may go as soon as the removal is asked for.
    acked.retain(|(log, offset, _)| log != "a" || *offset >= 20);
    a.remove_prefix(20)
        .map_err(|e| e.to_string())?
        .wait()
        .map_err(|e| e.to_string())?;
    for i in 0..20u64 {
        let body = payload(i, 2, 30_000);
        b.append_sync(&[record(&body)]).map_err(|e| e.to_string())?;
        acked.push(("b".into(), i, body));
    }
    b.close().map_err(|e| e.to_string())?;
    // A log being deleted may lose any of its records (highest segments first).
    acked.retain(|(log, _, _)| log != "a");
    a.delete().map_err(|e| e.to_string())?;
    Ok(())
}

fn check_after_crash(sim: &SimIo, acked: &[(String, u64, Vec<u8>)], k: u64) {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let root = Path::new("/node");
    if !io.exists(root).expect("stat") {
        assert!(acked.is_empty(), "step {k}: root vanished with acked data");
        return;
    }
    let pool = SegmentPool::new(io.clone(), pool_options(None));
    pool.add_storage_dir(root)
        .unwrap_or_else(|e| panic!("step {k}: pool: {e}"));
    for name in ["a", "b"] {
        let dir = root.join(name);
        if !io.exists(&dir).expect("stat") {
            assert!(
                acked.iter().all(|(l, _, _)| l != name),
                "step {k}: {name} vanished"
            );
            continue;
        }
        let log = Log::open(io.clone(), &dir, options(), Some(pool.clone()))
            .unwrap_or_else(|e| panic!("step {k}: open {name}: {e}"));
        for (log_name, offset, body) in acked.iter().filter(|(l, _, _)| l == name) {
            let got = log
                .read(*offset)
                .unwrap_or_else(|e| panic!("step {k}: {log_name} offset {offset}: {e}"));
            assert_eq!(&got.payload, body, "step {k}: {log_name} offset {offset}");
        }
        for record in log.reader(log.start_offset()) {
            let record = record.unwrap_or_else(|e| panic!("step {k}: {name}: {e}"));
            let version = if name == "a" { 1 } else { 2 };
            assert_eq!(
                record.payload,
                payload(record.offset, version, 30_000),
                "step {k}"
            );
        }
        log.append_sync(&[record(b"after")])
            .unwrap_or_else(|e| panic!("step {k}: append after crash: {e}"));
    }
    // Every file left in spares/ is a valid, adoptable spare.
    for name in io.read_dir(&root.join("spares")).expect("ls") {
        assert!(name.ends_with(".spare"), "step {k}: {name} left in spares");
    }
}

#[test]
fn crash_at_every_step_of_enter_and_take() {
    let base_seed = seed(11);
    let counting = SimIo::new(base_seed);
    let io: Arc<dyn Io> = Arc::new(counting.clone());
    let mut acked = Vec::new();
    pool_workload(&io, &mut acked).expect("clean run");
    let steps = counting.steps();
    assert!(steps > 100, "{steps}");
    for k in 0..steps {
        let sim = SimIo::new(base_seed.wrapping_add(k));
        sim.crash_after(k);
        let io: Arc<dyn Io> = Arc::new(sim.clone());
        let mut acked = Vec::new();
        let _ = pool_workload(&io, &mut acked);
        drop(io);
        let restarted = sim.restart();
        check_after_crash(&restarted, &acked, k);
    }
}
