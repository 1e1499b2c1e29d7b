//! Property tests. The record codec: every record encodes and decodes to itself, a single bit
//! flip anywhere is refused, and arbitrary bytes never panic the record check or the header
//! decoder. The log: random sequences of batch appends (random sizes), reads of random offsets,
//! truncations to random valid offsets, prefix removals, rolls, hand-backs, restarts at offsets
//! at, past and below the end, and reopens are compared with a plain `Vec` model, on `SimIo` and
//! (fewer cases) on the real file system. A failure is a minimal sequence of operations after
//! which the log and the model disagree; replay it with the printed `KERATIN_SEED`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{payload, record, small_options};
use keratin_log::format::{
    check_record, encode_record, HeaderKind, RecordFault, RecordFields, RecordHeader,
    SegmentHeader, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE,
};
use keratin_log::{Io, Log, LogError, RealIo, SimIo, SizeClass};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// A runner whose randomness comes from `KERATIN_SEED` (printed), so that a failure replays.
fn runner(cases: u32, default_seed: u64) -> TestRunner {
    let seed = common::seed(default_seed);
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&seed.wrapping_add(i as u64).to_le_bytes());
    }
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

fn run<S: Strategy>(cases: u32, seed: u64, strategy: S, test: impl Fn(S::Value))
where
    S::Value: std::fmt::Debug,
{
    let result = runner(cases, seed).run(&strategy, |value| {
        test(value);
        Ok(())
    });
    if let Err(error) = result {
        panic!("{error}");
    }
}

// ---------------------------------------------------------------------------------------------
// (i) The codec.

fn fields() -> impl Strategy<Value = RecordFields> {
    (
        any::<u64>(),
        any::<u16>(),
        any::<u8>(),
        any::<u8>(),
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(
            |(offset, generation, record_type, flags, timestamp_ms, durable_distance)| {
                RecordFields {
                    offset,
                    generation,
                    record_type,
                    flags,
                    timestamp_ms,
                    durable_distance,
                }
            },
        )
}

#[test]
fn record_roundtrip_and_generation_check() {
    run(
        512,
        1,
        (fields(), vec(any::<u8>(), 0..3000)),
        |(f, body)| {
            let mut buf = Vec::new();
            encode_record(&mut buf, &f, &body);
            assert_eq!(buf.len(), RECORD_HEADER_SIZE + body.len());
            let header = check_record(&buf, f.generation).expect("valid");
            assert_eq!(
                (
                    header.offset,
                    header.generation,
                    header.record_type,
                    header.flags
                ),
                (f.offset, f.generation, f.record_type, f.flags)
            );
            assert_eq!(
                (
                    header.timestamp_ms,
                    header.durable_distance,
                    header.length as usize
                ),
                (f.timestamp_ms, f.durable_distance, body.len())
            );
            assert_eq!(&buf[RECORD_HEADER_SIZE..], &body[..]);
            let other = f.generation.wrapping_add(1);
            assert_eq!(
                check_record(&buf, other),
                Err(RecordFault::Generation {
                    found: f.generation
                })
            );
            // Trailing bytes do not change the verdict.
            buf.extend_from_slice(&[0xee; 40]);
            assert_eq!(check_record(&buf, f.generation), Ok(header));
        },
    );
}

#[test]
fn a_single_bit_flip_is_always_refused() {
    let strategy = (
        fields(),
        vec(any::<u8>(), 0..600),
        any::<prop::sample::Index>(),
        0..8u8,
    );
    run(1024, 2, strategy, |(f, body, at, bit)| {
        let mut buf = Vec::new();
        encode_record(&mut buf, &f, &body);
        let at = at.index(buf.len());
        buf[at] ^= 1 << bit;
        assert!(
            check_record(&buf, f.generation).is_err(),
            "flip of bit {bit} at byte {at} accepted"
        );
    });
}

#[test]
fn arbitrary_bytes_never_panic_the_decoders() {
    let strategy = (vec(any::<u8>(), 0..200), any::<u16>(), any::<[u8; 32]>());
    run(2048, 3, strategy, |(bytes, generation, header_bytes)| {
        if let Ok(header) = check_record(&bytes, generation) {
            assert!(header.encoded_size() <= bytes.len() as u64);
        }
        let mut segment_header = [0u8; SEGMENT_HEADER_SIZE];
        segment_header[..32].copy_from_slice(&header_bytes);
        segment_header[32..].copy_from_slice(&header_bytes);
        let _ = RecordHeader::parse(&header_bytes);
        let _ = RecordHeader::peek_generation(&bytes);
        if let Ok(decoded) = SegmentHeader::decode(&segment_header) {
            assert_eq!(SegmentHeader::decode(&decoded.encode()), Ok(decoded));
        }
        // A valid magic and checksum in front of random fields: still no panic.
        segment_header[..8].copy_from_slice(b"KRTNSEG\0");
        let crc = crc32c_of(&segment_header[..60]);
        segment_header[60..].copy_from_slice(&crc.to_le_bytes());
        let _ = SegmentHeader::decode(&segment_header);
        let _ = SegmentHeader::cut_mark(&segment_header);
    });
}

/// CRC32C (Castagnoli), bitwise: the tests do not depend on the crate the log uses.
fn crc32c_of(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for byte in bytes {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn segment_header_roundtrip() {
    let strategy = (
        any::<bool>(),
        any::<bool>(),
        any::<u16>(),
        any::<u64>(),
        any::<u64>(),
    );
    run(
        512,
        4,
        strategy,
        |(small, spare, generation, base, size)| {
            let header = SegmentHeader {
                size_class: if small {
                    SizeClass::Small
                } else {
                    SizeClass::Full
                },
                kind: if spare {
                    HeaderKind::Spare
                } else {
                    HeaderKind::Segment
                },
                generation,
                base_offset: base,
                segment_size_bytes: size,
            };
            let bytes = header.encode();
            assert_eq!(SegmentHeader::decode(&bytes), Ok(header));
            assert_eq!(SegmentHeader::cut_mark(&bytes), None);
            let cutting = header.encode_cutting(base / 2);
            assert_eq!(SegmentHeader::decode(&cutting), Ok(header));
            assert_eq!(SegmentHeader::cut_mark(&cutting), Some(base / 2));
        },
    );
}

// ---------------------------------------------------------------------------------------------
// (ii) The log against a model.

#[derive(Debug, Clone)]
enum Op {
    /// Append one batch with these payload lengths.
    Append(Vec<usize>),
    /// Read an offset picked from the log's range (and a little outside it).
    Read(u64),
    /// Truncate to an offset picked from the log's range.
    Truncate(u64),
    /// Remove the prefix below an offset picked from the log's range.
    RemovePrefix(u64),
    Roll,
    /// Hand every segment back to the pool: the model keeps its end and holds nothing.
    HandBack,
    /// Restart at an offset picked at the end, past it (near and far), or below it (refused).
    RestartAt(u64),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let length = prop_oneof![0usize..300, 300usize..24_000];
    prop_oneof![
        6 => vec(length, 1..5).prop_map(Op::Append),
        3 => any::<u64>().prop_map(Op::Read),
        1 => any::<u64>().prop_map(Op::Truncate),
        1 => any::<u64>().prop_map(Op::RemovePrefix),
        1 => Just(Op::Roll),
        1 => Just(Op::HandBack),
        1 => any::<u64>().prop_map(Op::RestartAt),
        1 => Just(Op::Reopen),
    ]
}

/// The model: the log's first offset and its records in order.
#[derive(Debug, Default)]
struct Model {
    start: u64,
    records: Vec<Vec<u8>>,
    version: u32,
}

impl Model {
    fn end(&self) -> u64 {
        self.start + self.records.len() as u64
    }

    /// An offset in `start..=end`, picked by `pick`.
    fn pick(&self, pick: u64) -> u64 {
        self.start + pick % (self.records.len() as u64 + 1)
    }
}

fn apply(log: &Log, model: &mut Model, op: &Op) {
    match op {
        Op::Append(lengths) => {
            model.version += 1;
            let first = model.end();
            let bodies: Vec<Vec<u8>> = lengths
                .iter()
                .enumerate()
                .map(|(i, len)| payload(first + i as u64, model.version, *len))
                .collect();
            let records: Vec<_> = bodies.iter().map(|b| record(b)).collect();
            let offsets = log.append_sync(&records).expect("append");
            assert_eq!(offsets, first..first + bodies.len() as u64);
            model.records.extend(bodies);
        }
        Op::Read(pick) => {
            // Below the start too, when a prefix was removed.
            let offset = pick % (model.end() + 1);
            match log.read(offset) {
                Ok(r) => {
                    assert!(
                        offset >= model.start && offset < model.end(),
                        "read {offset}"
                    );
                    assert_eq!(r.payload, model.records[(offset - model.start) as usize]);
                    assert_eq!(r.offset, offset);
                }
                Err(LogError::OutOfRange { .. }) => {
                    assert!(
                        offset < model.start || offset >= model.end(),
                        "read {offset}"
                    );
                }
                Err(e) => panic!("read {offset}: {e}"),
            }
        }
        Op::Truncate(pick) => {
            let offset = model.pick(*pick);
            log.truncate_suffix(offset)
                .expect("submit")
                .wait()
                .expect("truncate");
            model.records.truncate((offset - model.start) as usize);
        }
        Op::RemovePrefix(pick) => {
            let before = model.pick(*pick);
            let bases: Vec<u64> = log.stats().segments.iter().map(|s| s.base_offset).collect();
            // Whole segments whose successor starts at or below `before`; never the last.
            let removed = bases.windows(2).filter(|w| w[1] <= before).count();
            if bases.is_empty() {
                // A log that was never written holds no segment: nothing to remove.
                let done = log.remove_prefix(before).expect("submit").wait();
                assert_eq!(done.expect("remove prefix").segments, 0);
                return;
            }
            let done = log
                .remove_prefix(before)
                .expect("submit")
                .wait()
                .expect("remove prefix");
            assert_eq!(done.segments, removed, "bases {bases:?}, before {before}");
            let new_start = bases[removed];
            model.records.drain(..(new_start - model.start) as usize);
            model.start = new_start;
        }
        Op::Roll => log.roll().expect("submit").wait().expect("roll"),
        Op::HandBack => {
            let segments = log.stats().segments.len();
            let done = log.hand_back().expect("submit").wait().expect("hand back");
            assert_eq!(done.segments, segments);
            assert_eq!(log.disk_bytes(), 0);
            assert_eq!(log.tail_room_bytes(), 0);
            model.start = model.end();
            model.records.clear();
        }
        Op::RestartAt(pick) => {
            let end = model.end();
            let offset = match pick % 4 {
                0 => end,
                1 => end + 1 + (pick >> 2) % 1_000,
                2 => end + 1_000_000,
                _ => end.saturating_sub(1 + (pick >> 2) % 10),
            };
            if offset < end {
                let refused = log.restart_at(offset);
                assert!(
                    matches!(refused, Err(LogError::Invalid(_))),
                    "restart at {offset} below {end}: {:?}",
                    refused.map(|_| ())
                );
                assert!(log.stopped().is_none());
                return;
            }
            let segments = log.stats().segments.len();
            let done = log
                .restart_at(offset)
                .expect("submit")
                .wait()
                .expect("restart");
            assert_eq!(done.segments, segments);
            assert_eq!(log.disk_bytes(), 0);
            model.start = offset;
            model.records.clear();
        }
        // The caller closes and reopens the log.
        Op::Reopen => {}
    }
}

fn check(log: &Log, model: &Model) {
    assert_eq!(log.start_offset(), model.start);
    assert_eq!(log.next_offset(), model.end());
    assert_eq!(log.durable_offset(), model.end());
}

fn check_all(log: &Log, model: &Model) {
    check(log, model);
    let records = common::read_all(log, "model");
    let payloads: Vec<Vec<u8>> = records.into_iter().map(|r| r.payload).collect();
    assert_eq!(payloads, model.records);
}

fn run_model(io: Arc<dyn Io>, dir: PathBuf, ops: &[Op]) {
    let open = || Log::open(io.clone(), &dir, small_options(), None).expect("open");
    let mut log = open();
    let mut model = Model::default();
    for op in ops {
        apply(&log, &mut model, op);
        if matches!(op, Op::Reopen) {
            log.close().expect("close");
            log = open();
        }
        check(&log, &model);
    }
    check_all(&log, &model);
    log.close().expect("close");
    let log = open();
    check_all(&log, &model);
}

#[test]
fn log_matches_the_model_on_sim_io() {
    run(48, 5, (any::<u64>(), vec(op(), 1..40)), |(seed, ops)| {
        let io: Arc<dyn Io> = Arc::new(SimIo::new(seed));
        run_model(io, PathBuf::from("/sim/model"), &ops);
    });
}

#[test]
fn log_matches_the_model_on_the_real_file_system() {
    run(8, 6, vec(op(), 1..25), |ops| {
        let tmp = tempfile::tempdir().expect("tempdir");
        run_model(Arc::new(RealIo::new()), tmp.path().join("log"), &ops);
    });
}
