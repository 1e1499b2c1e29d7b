//! A stream partition's storage on the simulated disk (issue 18, `docs/streams.md`): messages
//! with checkpoints every quarter segment, and retention removing whole old segments by size,
//! crashed after every `Io` call.
//!
//! The workload appends batches of messages (idempotent producers' among them, some resent as
//! duplicates) to a log of 256 KiB segments, writing a checkpoint first whenever one is due,
//! and every few batches runs a retention pass (`stream::decide`, bounded to 512 KiB) and removes
//! the prefix it names. For each call index `k` it runs again with a power loss right after
//! call `k`, then reopens the log and rebuilds the partition (`stream::rebuild`): the rebuild
//! must succeed, must reach every acknowledged record, and must equal the state of applying the
//! records the log holds from offset 0 (the model keeps them all), field by field; and the log
//! must take an append afterwards. A failure names `k`; replay one with `KERATIN_STEP=<k>`.

use std::path::Path;
use std::sync::Arc;

use keratin_broker::partition::local_log::LocalLog;
use keratin_broker::record::{Message, ProducerSeq};
use keratin_broker::stream::{
    decide, rebuild, RetentionBounds, SegmentFacts, StreamPartitionState, StreamRecord,
    CHECKPOINT_INTERVAL_DIVISOR,
};
use keratin_log::{Io, Log, LogOptions, Record, SimIo};

const DIR: &str = "/sim/stream/0";
const SEGMENT: u64 = 256 << 10;
const BATCHES: usize = 70;

fn options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: SEGMENT,
        ..LogOptions::default()
    }
}

/// Every record written, at its offset, with its timestamp and payload.
#[derive(Default)]
struct Model {
    records: Vec<(StreamRecord, u64, Vec<u8>)>,
    /// One past the last acknowledged offset.
    acked: u64,
}

impl Model {
    /// The state of applying records `0..end`.
    fn state(&self, end: u64) -> StreamPartitionState {
        let mut state = StreamPartitionState::new(0);
        for (offset, (record, ts, payload)) in self.records[..end as usize].iter().enumerate() {
            state
                .apply(offset as u64, *ts, payload.len() as u64, record)
                .expect("the model applies");
        }
        state
    }

    /// Retention's facts for the log's segments.
    fn facts(&self, log: &Log) -> Vec<SegmentFacts> {
        let segments = log.stats().segments;
        segments
            .iter()
            .map(|s| {
                let range =
                    s.base_offset as usize..(s.next_offset as usize).max(s.base_offset as usize);
                let in_segment = &self.records
                    [range.start.min(self.records.len())..range.end.min(self.records.len())];
                SegmentFacts {
                    base_offset: s.base_offset,
                    size_bytes: s.size_bytes,
                    newest_timestamp_ms: in_segment.last().map(|(_, ts, _)| *ts),
                    messages_before: self.state(s.base_offset).messages(),
                    checkpointed: in_segment
                        .iter()
                        .any(|(r, _, _)| matches!(r, StreamRecord::Checkpoint(_))),
                }
            })
            .collect()
    }
}

fn body(i: usize) -> Vec<u8> {
    const SIZES: [usize; 6] = [300, 9_000, 1_200, 17_000, 80, 4_000];
    vec![(i % 251) as u8; SIZES[i % SIZES.len()]]
}

/// The batch `i`: one to three messages; every seventh resends the previous batch's first
/// idempotent message (a duplicate).
fn batch(i: usize) -> Vec<Message> {
    let mut out = Vec::new();
    for j in 0..(1 + i % 3) {
        let n = i * 3 + j;
        let mut m = Message::new(body(n));
        if n.is_multiple_of(2) {
            m.producer = Some(ProducerSeq {
                producer: 7,
                sequence: n as u64,
            });
        }
        out.push(m);
    }
    if i % 7 == 6 {
        let mut dup = Message::new(body(0));
        dup.producer = Some(ProducerSeq {
            producer: 7,
            sequence: ((i - 1) * 3) as u64,
        });
        out.push(dup);
    }
    out
}

/// Runs the workload until it ends or the disk crashes; the model holds what was written.
fn workload(sim: &SimIo, model: &mut Model) {
    let io: Arc<dyn Io> = Arc::new(sim.clone());
    let Ok(log) = Log::open(io, Path::new(DIR), options(), None) else {
        return;
    };
    let mut state = StreamPartitionState::new(0);
    for i in 0..BATCHES {
        let ts = 1_000 + i as u64;
        let mut records: Vec<StreamRecord> = Vec::new();
        if state.checkpoint_due(SEGMENT / CHECKPOINT_INTERVAL_DIVISOR) {
            records.push(StreamRecord::Checkpoint(state.checkpoint()));
        }
        records.extend(batch(i).into_iter().map(StreamRecord::Message));
        let payloads: Vec<Vec<u8>> = records
            .iter()
            .map(|r| r.encode().expect("encodes"))
            .collect();
        let base = state.next_offset();
        // What was handed to the log is in the model before the outcome is known: a crash
        // may leave it durable.
        for (record, payload) in records.iter().zip(&payloads) {
            model.records.push((record.clone(), ts, payload.clone()));
        }
        let log_records: Vec<Record<'_>> = records
            .iter()
            .zip(&payloads)
            .map(|(r, p)| Record {
                record_type: r.record_type(),
                flags: 0,
                timestamp_ms: ts,
                payload: p,
            })
            .collect();
        let Ok(range) = log.append_sync(&log_records) else {
            return;
        };
        assert_eq!(range.start, base, "offsets follow the state");
        for (offset, (record, payload)) in (base..).zip(records.iter().zip(&payloads)) {
            state
                .apply(offset, ts, payload.len() as u64, record)
                .expect("applies");
        }
        model.acked = range.end;
        if i % 9 == 8 {
            let facts = model.facts(&log);
            let bounds = RetentionBounds {
                max_bytes: Some(512 << 10),
                ..RetentionBounds::default()
            };
            if let Some(removal) = decide(&facts, state.messages(), &bounds, ts) {
                let Ok(ticket) = log.remove_prefix(removal.before) else {
                    return;
                };
                if ticket.wait().is_err() {
                    return;
                }
            }
        }
    }
    let _ = log.close();
}

/// Reopens what `sim` left, rebuilds, checks, and appends once more.
fn check(k: Option<u64>, sim: SimIo, model: &Model) -> u64 {
    let io: Arc<dyn Io> = Arc::new(sim);
    let log = Log::open(io.clone(), Path::new(DIR), options(), None)
        .unwrap_or_else(|e| panic!("step {k:?}: the log does not reopen: {e}"));
    let end = log.next_offset();
    let start = log.start_offset();
    assert!(
        end >= model.acked,
        "step {k:?}: acknowledged records lost ({end} < {})",
        model.acked
    );
    let local = Arc::new(LocalLog::new(log, io.clone(), SEGMENT));
    let rebuilt = rebuild(local.as_ref())
        .unwrap_or_else(|e| panic!("step {k:?}: the rebuild failed (log {start}..{end}): {e}"));
    let expected = model.state(end);
    let state = &rebuilt.state;
    assert_eq!(state.next_offset(), end, "step {k:?}");
    assert_eq!(
        state.messages(),
        expected.messages(),
        "step {k:?}: message count"
    );
    assert_eq!(state.bytes(), expected.bytes(), "step {k:?}: bytes");
    assert_eq!(
        state.checkpoint(),
        expected.checkpoint(),
        "step {k:?}: producer windows"
    );
    assert_eq!(
        state.last_checkpoint(),
        expected.last_checkpoint(),
        "step {k:?}"
    );
    // The log takes a new record after the crash, and the state follows it.
    drop(local);
    let log = Log::open(io, Path::new(DIR), options(), None).expect("reopens");
    let record = StreamRecord::Message(Message::new(b"after".to_vec()));
    let payload = record.encode().expect("encodes");
    let appended = log
        .append_sync(&[Record {
            record_type: record.record_type(),
            flags: 0,
            timestamp_ms: 9_999,
            payload: &payload,
        }])
        .unwrap_or_else(|e| panic!("step {k:?}: no append after the crash: {e}"));
    assert_eq!(appended.start, end, "step {k:?}");
    let mut state = rebuilt.state.clone();
    state
        .apply(end, 9_999, payload.len() as u64, &record)
        .expect("the next record applies");
    log.close().expect("closes");
    rebuilt.records_read
}

fn steps() -> u64 {
    let sim = SimIo::new(1);
    let mut model = Model::default();
    workload(&sim, &mut model);
    assert_eq!(
        model.acked as usize,
        model.records.len(),
        "the clean run acknowledges all"
    );
    sim.steps()
}

#[test]
fn a_clean_run_rebuilds_from_the_last_checkpoint_after_retention() {
    let sim = SimIo::new(1);
    let mut model = Model::default();
    workload(&sim, &mut model);
    let total = model.records.len() as u64;
    let read = check(None, sim.restart(), &model);
    // Retention removed segments and the rebuild read only the tail's records.
    assert!(
        read > 0 && read < total / 2,
        "read {read} of {total} records"
    );
    let io: Arc<dyn Io> = Arc::new(sim.restart());
    let log = Log::open(io, Path::new(DIR), options(), None).expect("reopens");
    assert!(log.start_offset() > 0, "retention removed a prefix");
    let bytes = log
        .stats()
        .segments
        .iter()
        .map(|s| s.size_bytes)
        .sum::<u64>();
    assert!(
        bytes <= (512 << 10) + SEGMENT,
        "{bytes} bytes kept: at most the bound plus the tail"
    );
}

#[test]
fn a_power_loss_after_any_call_rebuilds_every_acknowledged_record() {
    let total = steps();
    let only: Option<u64> = std::env::var("KERATIN_STEP")
        .ok()
        .and_then(|s| s.parse().ok());
    for k in 0..total {
        if only.is_some_and(|o| o != k) {
            continue;
        }
        let sim = SimIo::new(1);
        sim.crash_after(k);
        let mut model = Model::default();
        workload(&sim, &mut model);
        check(Some(k), sim.restart(), &model);
    }
    eprintln!("{total} crash points checked");
}
