//! Log recovery from arbitrary segment files (`keratin-log`), on the simulated disk.
//!
//! The input is the bytes of a log directory's segment files: byte 0 holds flags, the rest is
//! split before every segment magic (`KRTNSEG\0`), one file per piece, named after the base
//! offset its header claims. Flag bit 0 pads each file with zeros to the segment size (as
//! preallocated files are); bit 1 rewrites the header and record checksums first, so that the
//! fuzzer also reaches what lies behind them (generations, offsets, durability claims, seals)
//! instead of stopping at a checksum mismatch.
//!
//! Properties, for any input:
//! - `SegmentHeader::decode` and `check_record` never panic, and a header that decodes encodes
//!   back to the same fields;
//! - `Log::open` never panics: it recovers or reports the damage;
//! - a log that opened reads back every record from its start to its durable end, in order,
//!   with consecutive offsets (or reports damage), and closes;
//! - recovery is idempotent: opening the recovered directory again gives the same records;
//! - the recovered log takes an append at its end, and that record is there after a reopen.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keratin_log::format::{
    check_record, record_checksum, SegmentHeader, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE,
    SEGMENT_MAGIC,
};
use keratin_log::{Io, Log, LogOptions, OpenMode, Record, SimIo, SizeClass};
use libfuzzer_sys::fuzz_target;

/// The smallest full segment the log allows; the small class (metadata logs) is an eighth of
/// it, 32 KiB, which keeps each run cheap.
const FULL_SEGMENT_SIZE_BYTES: u64 = 256 << 10;
/// Files longer than two segments are cut: recovery's cost grows with file size, and what a
/// longer file adds is more of the same.
const FILE_SIZE_BYTES_MAX: usize = 2 * (FULL_SEGMENT_SIZE_BYTES as usize / 8);
/// At most this many files, so that one input cannot make a run slow.
const FILES_MAX: usize = 8;
const FLAG_PAD: u8 = 1;
const FLAG_FIX_CHECKSUMS: u8 = 2;
/// Offset of the base offset in a segment header (docs/storage-format.md, "Segment header").
const HEADER_BASE_OFFSET: usize = 16;

fn options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: FULL_SEGMENT_SIZE_BYTES,
        size_class: SizeClass::Small,
        ..LogOptions::default()
    }
}

/// The pieces of `data` that start with the segment magic (and what comes before the first).
fn split_files(data: &[u8]) -> Vec<&[u8]> {
    let mut starts: Vec<usize> = data
        .windows(SEGMENT_MAGIC.len())
        .enumerate()
        .filter(|(_, window)| *window == SEGMENT_MAGIC)
        .map(|(at, _)| at)
        .collect();
    if starts.first() != Some(&0) {
        starts.insert(0, 0);
    }
    starts.truncate(FILES_MAX);
    let mut files = Vec::new();
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(data.len());
        files.push(&data[start..end]);
    }
    files
}

/// Rewrites the header checksum and the checksum of every record that fits, walking records
/// back to back from the end of the header as recovery does.
fn fix_checksums(file: &mut [u8]) {
    if file.len() < SEGMENT_HEADER_SIZE {
        return;
    }
    let crc = crc32c::crc32c(&file[..SEGMENT_HEADER_SIZE - 4]);
    file[SEGMENT_HEADER_SIZE - 4..SEGMENT_HEADER_SIZE].copy_from_slice(&crc.to_le_bytes());
    let mut at = SEGMENT_HEADER_SIZE;
    while let Some(header) = file.get(at..at + RECORD_HEADER_SIZE) {
        let mut header: [u8; RECORD_HEADER_SIZE] = header.try_into().expect("sliced to size");
        let length = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
        let end = at + RECORD_HEADER_SIZE + length;
        let Some(payload) = file.get(at + RECORD_HEADER_SIZE..end) else {
            return;
        };
        let crc = record_checksum(&header, payload);
        header[..4].copy_from_slice(&crc.to_le_bytes());
        file[at..at + 4].copy_from_slice(&header[..4]);
        at = end;
    }
}

/// The format-level checks on one file's bytes.
fn check_format(file: &[u8]) {
    let Some(header) = file.get(..SEGMENT_HEADER_SIZE) else {
        return;
    };
    let header: &[u8; SEGMENT_HEADER_SIZE] = header.try_into().expect("sliced to size");
    if let Ok(decoded) = SegmentHeader::decode(header) {
        // Reserved and padding bytes need not be zero to be valid (docs/storage-format.md:
        // "A header is valid when the magic, the version, the CRC and the class/kind bytes are
        // right"), so the bytes need not come back; the fields must. A cut mark is carried
        // outside `SegmentHeader`.
        let cut_mark = SegmentHeader::cut_mark(header);
        let encoded = match cut_mark {
            Some(cut_offset) => decoded.encode_cutting(cut_offset),
            None => decoded.encode(),
        };
        assert_eq!(SegmentHeader::decode(&encoded).ok(), Some(decoded));
        assert_eq!(SegmentHeader::cut_mark(&encoded), cut_mark);
        let _ = check_record(&file[SEGMENT_HEADER_SIZE..], decoded.generation);
    }
}

/// Every record from the start, as text (errors included), with the offsets it spans.
fn read_all(log: &Log) -> (u64, u64, Vec<String>) {
    let (start, end) = (log.start_offset(), log.durable_offset());
    let mut out = Vec::new();
    let mut expected = start;
    for result in log.reader(start) {
        match result {
            Ok(record) => {
                assert_eq!(record.offset, expected, "records out of order");
                expected += 1;
                out.push(format!(
                    "{} {} {} {} {:?}",
                    record.offset,
                    record.record_type,
                    record.flags,
                    record.timestamp_ms,
                    record.payload
                ));
            }
            Err(error) => {
                out.push(format!("error: {error}"));
                break;
            }
        }
    }
    if !out.last().is_some_and(|last| last.starts_with("error")) {
        assert_eq!(expected, end, "the reader stopped before the durable end");
    }
    (start, end, out)
}

fn open(io: &Arc<SimIo>, dir: &Path) -> Result<Log, keratin_log::LogError> {
    let io: Arc<dyn Io> = io.clone();
    Log::open(io, dir, options(), None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let segment_size = options().segment_size_bytes() as usize;
    let io = Arc::new(SimIo::new(0));
    let dir = PathBuf::from("/fuzz/log");
    io.create_dir_all(&dir).expect("sim mkdir");
    let mut names = std::collections::BTreeSet::new();
    for (index, piece) in split_files(rest).into_iter().enumerate() {
        let mut file = piece[..piece.len().min(FILE_SIZE_BYTES_MAX)].to_vec();
        if flags & FLAG_PAD != 0 && file.len() < segment_size {
            file.resize(segment_size, 0);
        }
        if flags & FLAG_FIX_CHECKSUMS != 0 {
            fix_checksums(&mut file);
        }
        check_format(&file);
        let base = file
            .get(HEADER_BASE_OFFSET..HEADER_BASE_OFFSET + 8)
            .map_or(index as u64, |b| {
                u64::from_le_bytes(b.try_into().expect("8 bytes"))
            });
        let name = format!("{base:020}.seg");
        if !names.insert(name.clone()) {
            continue;
        }
        let handle = io
            .open(&dir.join(name), OpenMode::CreateNew)
            .expect("sim create");
        handle.write_all_at(&file, 0).expect("sim write");
        handle.sync_data().expect("sim sync");
    }
    io.sync_dir(&dir).expect("sim dir sync");

    let Ok(log) = open(&io, &dir) else {
        return; // Damage reported: allowed.
    };
    let first = read_all(&log);
    log.close().expect("a recovered log closes");

    let log = open(&io, &dir).expect("a log that opened once opens again");
    assert_eq!(
        read_all(&log),
        first,
        "a second recovery found something else"
    );
    if first.2.last().is_some_and(|last| last.starts_with("error")) {
        return; // Damage a read reported: the records past it are not the point here.
    }
    let payload = b"appended after recovery";
    let record = Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 7,
        payload,
    };
    let appended = log
        .append_sync(&[record])
        .expect("a recovered log takes an append");
    assert_eq!(appended, first.1..first.1 + 1, "the append's offset");
    log.close().expect("closes after the append");

    let log = open(&io, &dir).expect("opens after the append");
    let (start, end, records) = read_all(&log);
    assert_eq!((start, end), (first.0, first.1 + 1));
    assert_eq!(records[..records.len() - 1], first.2[..]);
    assert!(records
        .last()
        .is_some_and(|last| last.ends_with(&format!("{:?}", payload.to_vec()))));
    log.close().expect("closes");
});
