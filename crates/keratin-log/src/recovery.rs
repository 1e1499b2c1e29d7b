//! Recovery: turning the files in a log directory back into a log when it is opened.
//!
//! The rules (docs/storage-format.md, "Recovery"):
//! - a missing or empty directory is an empty log at offset 0 (logs create their directory and
//!   first segment lazily, at the first append);
//! - scratch files (`*.seg.tmp`, `anchor.tmp`) are leftovers of a creation that never finished:
//!   removed;
//! - an anchor (written by a hand-back or a restart) gives the next offset of a log without
//!   segments, which after a restart may lie past every record the log held; with segments, the
//!   segments win, and they must reach the anchor's offset (a hand-back interrupted part way
//!   leaves a suffix of its segments, which still ends there; a restart is a hand-back first and
//!   writes its own anchor only once no segment is left);
//! - a trailing segment whose valid header does not name its own base (a spare header, or another
//!   log's base) was being taken from a pool when the node stopped: it is handed back to the pool;
//! - every segment but the last is sealed: its records must run without a gap up to the next
//!   segment's base, or the log is corrupt;
//! - the last segment ends at its first invalid record (torn length, bad checksum, generation or
//!   offset mismatch), unless a later record in it shows that the data there had been reported
//!   durable: that is corruption, reported with its location and never skipped.
//!   Same-generation leftovers past the cut are zeroed, so that they can never line up with
//!   records appended later;
//! - a segment file may be shorter than its header's size (it grows by preallocation steps):
//!   records end at the end of the file, and recovery never writes past it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{LogError, LogResult};
use crate::format::{
    check_record, decode_anchor, HeaderKind, RecordFault, RecordHeader, SegmentHeader, ANCHOR_SIZE,
    FLAG_SEAL, RECORD_GENERATION_OFFSET, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE,
};
use crate::io::{Io, IoError, IoFile, OpenMode};
use crate::pool::SegmentPool;
use crate::segment::{
    parse_segment_file_name, ChunkReader, IndexBuilder, Segment, ANCHOR_FILE_NAME,
    ANCHOR_SCRATCH_FILE_NAME, READ_CHUNK_BYTES,
};
use crate::LogOptions;

/// What recovery found: the log's segments and where appends continue.
#[derive(Debug)]
pub(crate) struct Recovered {
    pub(crate) segments: BTreeMap<u64, Segment>,
    /// Bytes of leftovers zeroed past the cut of the last segment.
    pub(crate) zeroed_bytes: u64,
    /// The first byte of the last segment that no record proves durable: what lies between it
    /// and the segment's end was read, but only a sync of this process can make it durable
    /// (see `Writer::start`). 0 when even the header is unproven; `None` when there is no
    /// segment.
    pub(crate) unproven_from: Option<u64>,
    /// Where appends continue when there is no segment: the anchor's offset, or 0.
    pub(crate) empty_next_offset: u64,
    /// Whether the log directory exists (a log creates it with its first segment).
    pub(crate) dir_exists: bool,
}

/// Why a segment scan stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScanStop {
    /// No room for another record header before the end of the file.
    End,
    /// A seal record: the log ended here at a clean close or an idle moment.
    Seal,
    /// An invalid record.
    Fault(RecordFault),
}

#[derive(Debug)]
struct Scan {
    stop: ScanStop,
    /// The strongest durability claim of the scanned records (the seal included): every offset
    /// below it was covered by a completed sync when that record was written.
    claim: Option<u64>,
}

/// How far recovery may trust what it reads past the end of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trust {
    /// Opening: what reads show is what the disk holds (or will, before anything new is
    /// reported durable).
    Reads,
    /// Healing after a failed write or sync: the page cache may show bytes the disk does not
    /// hold (a failed sync drops its writes from the durable path, Linux reports it once), so
    /// the whole unused tail of the last segment is zeroed, not only the leftovers reads show.
    NothingPastTheEnd,
}

pub(crate) fn recover(
    io: &dyn Io,
    dir: &Path,
    options: &LogOptions,
    pool: &SegmentPool,
    trust: Trust,
) -> LogResult<Recovered> {
    let Some(listing) = list_dir(io, dir)? else {
        return Ok(Recovered {
            segments: BTreeMap::new(),
            zeroed_bytes: 0,
            unproven_from: None,
            empty_next_offset: 0,
            dir_exists: false,
        });
    };
    let bases = listing.bases;
    let mut opened: Vec<OpenedSegment> = Vec::new();
    // From the last segment back: trailing segments with a foreign header are handed back one
    // at a time; a foreign header anywhere else is corruption.
    for &base in bases.iter().rev() {
        let path = dir.join(crate::segment::segment_file_name(base));
        let trailing = opened.is_empty();
        match open_segment(io, &path, base, options)? {
            Opened::Valid(file, header, cut, allocated) => {
                opened.push((file, header, cut, allocated, path))
            }
            Opened::Foreign(reason) if trailing => {
                tracing::warn!(path = %path.display(), %reason, "returning a trailing segment that does not belong to this log");
                pool.enter_foreign(&path, options.size_class)?;
            }
            Opened::Foreign(reason) => return Err(corrupt(&path, 0, base, reason)),
        }
    }
    opened.reverse();
    let mut segments = BTreeMap::new();
    let mut zeroed_bytes = 0;
    let mut unproven_from = None;
    let count = opened.len();
    for (i, (file, header, cut, allocated, path)) in opened.into_iter().enumerate() {
        let mut segment = Segment::new(
            path,
            file,
            header.base_offset,
            header.generation,
            header.segment_size_bytes,
            allocated,
        );
        let scan = scan_segment(&mut segment)?;
        // A segment that is not the last is sealed: whatever stopped its scan, the next
        // segment's base must follow its last record (checked below, against the next one).
        if i + 1 == count {
            // A truncation mark means a zeroing was under way, and its writes may have been
            // dropped by a failed sync in an earlier process while reads show zeros: the disk
            // can still hold the records it was destroying anywhere up to the old end.
            let trust = if cut.is_some() {
                Trust::NothingPastTheEnd
            } else {
                trust
            };
            zeroed_bytes = settle_tail(&segment, &header, &scan, cut, trust)?;
            if cut.is_some() || zeroed_bytes > 0 {
                clear_cut_mark(&segment, &header)?;
            }
            unproven_from = Some(unproven_position(&segment, scan.claim)?);
        }
        if let Some((_, previous)) = segments.last_key_value() {
            check_continuity(previous, &segment)?;
        }
        segments.insert(segment.base, segment);
    }
    let empty_next_offset = match listing.anchor {
        Some(anchor) => {
            check_anchor(&dir.join(ANCHOR_FILE_NAME), anchor, &segments)?;
            anchor
        }
        None => 0,
    };
    Ok(Recovered {
        segments,
        zeroed_bytes,
        unproven_from,
        empty_next_offset,
        dir_exists: true,
    })
}

/// A hand-back makes its anchor durable before it removes any segment, lowest first: segments
/// that survive it are a suffix of the log, which ends at the anchor's offset. A restart is such
/// a hand-back followed by an anchor at its offset, written only once every segment is gone.
/// Segments that end below the anchor thus lost durable records.
fn check_anchor(path: &Path, anchor: u64, segments: &BTreeMap<u64, Segment>) -> LogResult<()> {
    let Some((_, last)) = segments.last_key_value() else {
        return Ok(());
    };
    if last.next_offset >= anchor {
        return Ok(());
    }
    Err(corrupt(
        &last.path,
        last.end_position,
        last.next_offset,
        format!(
            "the log's records end at offset {} but its anchor ({}) says offsets below {anchor} \
             were written: durable records are missing",
            last.next_offset,
            path.display()
        ),
    ))
}

/// The first byte of the last segment that no record's claim proves durable. A claim is written
/// only after a sync of this log completed without error, so what it covers reached the disk.
/// What lies past it was read through the page cache: after a failed sync in an earlier process
/// (fsyncgate) the disk may never get it, and a sync now would succeed without writing it.
/// The header is proven only by a claim past the segment's base (records are written after it).
fn unproven_position(segment: &Segment, claim: Option<u64>) -> LogResult<u64> {
    let claim = claim.unwrap_or(0);
    if claim <= segment.base {
        return Ok(0);
    }
    if claim >= segment.next_offset {
        return Ok(segment.end_position);
    }
    crate::reader::locate(segment, claim)
}

/// What a log directory holds.
struct Listing {
    /// The base offsets of its segment files, sorted.
    bases: Vec<u64>,
    /// The next offset its anchor names, if it has one.
    anchor: Option<u64>,
}

/// The segment files and the anchor in `dir`, or `None` if `dir` does not exist; scratch files
/// are removed.
fn list_dir(io: &dyn Io, dir: &Path) -> LogResult<Option<Listing>> {
    let names = match io.read_dir(dir) {
        Ok(names) => names,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(LogError::io("list log directory", dir, e)),
    };
    let mut bases = Vec::new();
    let mut anchor = None;
    let mut removed_scratch = false;
    for name in names {
        if let Some(base) = parse_segment_file_name(&name) {
            bases.push(base);
        } else if name == ANCHOR_FILE_NAME {
            anchor = Some(read_anchor(io, &dir.join(&name))?);
        } else if name.ends_with(".seg.tmp") || name == ANCHOR_SCRATCH_FILE_NAME {
            let path = dir.join(&name);
            io.remove_file(&path)
                .map_err(|e| LogError::io("remove scratch segment", &path, e))?;
            removed_scratch = true;
        }
    }
    if removed_scratch {
        io.sync_dir(dir)
            .map_err(|e| LogError::io("sync log directory", dir, e))?;
    }
    bases.sort_unstable();
    Ok(Some(Listing { bases, anchor }))
}

/// The next offset an anchor file names. A damaged anchor is an error: its offset cannot be
/// guessed, and starting again at 0 would hand out offsets the log's readers have seen.
fn read_anchor(io: &dyn Io, path: &Path) -> LogResult<u64> {
    let file = io
        .open(path, OpenMode::Existing)
        .map_err(|e| LogError::io("open anchor", path, e))?;
    let len = file
        .len()
        .map_err(|e| LogError::io("stat anchor", path, e))?;
    let mut bytes = vec![0u8; usize::try_from(len.min(ANCHOR_SIZE as u64 + 1)).unwrap_or(0)];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| LogError::io("read anchor", path, e))?;
    decode_anchor(&bytes).map_err(|e| corrupt(path, 0, 0, format!("anchor: {e}")))
}

/// A segment recovery keeps: its file, header, truncation mark, file length and path.
type OpenedSegment = (Arc<dyn IoFile>, SegmentHeader, Option<u64>, u64, PathBuf);

enum Opened {
    /// A segment of this log, with the truncation mark of its header and the file's length.
    Valid(Arc<dyn IoFile>, SegmentHeader, Option<u64>, u64),
    /// A file that holds no record of this log: a spare header, another base, or too short to
    /// hold a header (a creation that never finished).
    Foreign(String),
}

fn open_segment(io: &dyn Io, path: &Path, base: u64, options: &LogOptions) -> LogResult<Opened> {
    let file = io
        .open(path, OpenMode::Existing)
        .map_err(|e| LogError::io("open segment", path, e))?;
    let mut bytes = [0u8; SEGMENT_HEADER_SIZE];
    match file.read_exact_at(&mut bytes, 0) {
        Ok(()) => {}
        Err(IoError::ShortRead { read }) => {
            return Ok(Opened::Foreign(format!(
                "file of {read} bytes has no header"
            )))
        }
        Err(e) => return Err(LogError::io("read segment header", path, e)),
    }
    let header = SegmentHeader::decode(&bytes)
        .map_err(|e| corrupt(path, 0, base, format!("segment header: {e}")))?;
    if header.kind == HeaderKind::Spare {
        return Ok(Opened::Foreign("the header is a spare's".into()));
    }
    if header.base_offset != base {
        return Ok(Opened::Foreign(format!(
            "the header names base {} instead of {base}",
            header.base_offset
        )));
    }
    let expected_size = options.segment_size_bytes();
    let file_len = file
        .len()
        .map_err(|e| LogError::io("stat segment", path, e))?;
    // The file may be shorter than the segment (preallocation steps; rule change 1.2) or, written
    // by nothing this code does, longer: records never pass the segment size either way.
    if header.segment_size_bytes != expected_size {
        return Err(corrupt(
            path,
            0,
            base,
            format!(
                "segment of {} bytes (file {file_len} bytes) in a log of {expected_size}-byte \
                 segments",
                header.segment_size_bytes
            ),
        ));
    }
    Ok(Opened::Valid(
        file,
        header,
        SegmentHeader::cut_mark(&bytes),
        file_len,
    ))
}

/// Walk the records of a segment from its start, filling in its extent and index.
fn scan_segment(segment: &mut Segment) -> LogResult<Scan> {
    let limit = segment.record_limit();
    let mut reader = ChunkReader::new(segment.file.clone(), limit, READ_CHUNK_BYTES);
    let mut position = SEGMENT_HEADER_SIZE as u64;
    let mut expected = segment.base;
    let mut index = IndexBuilder::new(segment.base, None);
    let mut claim: Option<u64> = None;
    let stop = loop {
        if position + RECORD_HEADER_SIZE as u64 > limit {
            break ScanStop::End;
        }
        let read_error = |e| LogError::io("read segment", segment.path.clone(), e);
        let window = reader
            .window(position, READ_CHUNK_BYTES.min(RECORD_HEADER_SIZE))
            .map_err(read_error)?;
        let length = u64::from(u32::from_le_bytes([
            window[4], window[5], window[6], window[7],
        ]));
        let total = RECORD_HEADER_SIZE as u64 + length;
        if position + total > limit {
            break ScanStop::Fault(RecordFault::TornLength);
        }
        let window = reader
            .window(position, total as usize)
            .map_err(read_error)?;
        let header = match check_record(window, segment.generation) {
            Ok(header) => header,
            Err(fault) => break ScanStop::Fault(fault),
        };
        if header.offset != expected {
            break ScanStop::Fault(RecordFault::Offset {
                found: header.offset,
            });
        }
        claim = claim.max(header.durable_before());
        if header.flags & FLAG_SEAL != 0 {
            break ScanStop::Seal;
        }
        if let Some(entry) = index.record(expected, position) {
            segment.index.push(entry);
        }
        position += total;
        expected += 1;
    };
    segment.end_position = position;
    segment.next_offset = expected;
    Ok(Scan { stop, claim })
}

fn check_continuity(previous: &Segment, next: &Segment) -> LogResult<()> {
    if previous.next_offset == next.base {
        return Ok(());
    }
    let reason = if previous.next_offset < next.base {
        format!(
            "records end at offset {} but the next segment starts at {}: a record of a sealed \
             segment is damaged",
            previous.next_offset, next.base
        )
    } else {
        format!(
            "records run to offset {} past the next segment's base {}",
            previous.next_offset, next.base
        )
    };
    Err(corrupt(
        &previous.path,
        previous.end_position,
        previous.next_offset,
        reason,
    ))
}

/// Decide what the stop of the last segment means: the end of what was written (a torn tail,
/// cut and zeroed) or damage to data that was reported durable (an error). `cut` is the offset of
/// a truncation that was in progress: records from it on were being destroyed, so their claims
/// count only below it.
fn settle_tail(
    segment: &Segment,
    header: &SegmentHeader,
    scan: &Scan,
    cut: Option<u64>,
    trust: Trust,
) -> LogResult<u64> {
    let cut_position = segment.end_position;
    let look_from = match scan.stop {
        ScanStop::End => return Ok(0),
        ScanStop::Seal => cut_position + RECORD_HEADER_SIZE as u64,
        ScanStop::Fault(_) => cut_position + 1,
    };
    let ahead = look_ahead(segment, look_from)?;
    if let (ScanStop::Fault(fault), Some(claim)) = (scan.stop, ahead.claim) {
        if claim.durable_before.min(cut.unwrap_or(u64::MAX)) > segment.next_offset {
            return Err(corrupt(
                &segment.path,
                cut_position,
                segment.next_offset,
                format!(
                    "{fault}; a later record (offset {} at byte {}) shows that offsets below {} \
                     had been reported durable",
                    claim.offset, claim.position, claim.durable_before
                ),
            ));
        }
    }
    // After a failed sync the zeros must reach past whatever the disk may hold, not only past
    // what reads show (found by crash_every_step: EIO on the sync of a truncation's zeroing,
    // heal, append, crash: the old records were back behind the new one, and claimed).
    let zero_end = match trust {
        Trust::Reads => ahead.extent,
        // Never past the end of the file: a segment never shrinks, so the disk holds nothing
        // there, and writing there would allocate (and could fail for want of space).
        Trust::NothingPastTheEnd => segment.record_limit().max(ahead.extent),
    };
    if zero_end <= look_from {
        return Ok(0);
    }
    let zero_from = match scan.stop {
        ScanStop::Seal => look_from,
        _ => cut_position,
    };
    // The zeroing gets a truncation mark, as a truncation does: if its writes or its sync fail,
    // reads in this process (or in the next one, after a restart without a power loss) show
    // zeros the disk may never get, while the disk keeps leftovers that could line up with
    // records appended later. The mark is durable before the zeroing starts; a recovery that
    // finds it zeroes the whole unused tail (issue 12: found by
    // leftover_whose_zeroing_failed_never_lines_up_after_a_restart). The caller clears it.
    if cut.is_none() {
        write_cut_mark(segment, header, segment.next_offset)?;
    }
    zero_range(segment, zero_from, zero_end)?;
    tracing::warn!(
        segment = %segment.path().display(),
        position = zero_from,
        bytes = zero_end - zero_from,
        "recovery cut a torn tail and zeroed its leftovers"
    );
    Ok(zero_end - zero_from)
}

#[derive(Debug, Clone, Copy)]
struct Claim {
    durable_before: u64,
    offset: u64,
    position: u64,
}

#[derive(Debug)]
struct LookAhead {
    /// The strongest durability claim of a valid record past the cut.
    claim: Option<Claim>,
    /// One past the last byte of any valid record past the cut.
    extent: u64,
}

/// Scan every byte position past the cut for valid records of this segment's generation. The
/// generation comparison filters nearly every position before any checksum is computed.
fn look_ahead(segment: &Segment, from: u64) -> LogResult<LookAhead> {
    let limit = segment.record_limit();
    let mut reader = ChunkReader::new(segment.file.clone(), limit, READ_CHUNK_BYTES);
    let mut ahead = LookAhead {
        claim: None,
        extent: from,
    };
    let read_error = |e| LogError::io("read segment", segment.path.clone(), e);
    let generation = segment.generation.to_le_bytes();
    let mut position = from;
    while position + RECORD_HEADER_SIZE as u64 <= limit {
        let window = reader
            .window(position, RECORD_HEADER_SIZE)
            .map_err(read_error)?;
        // Skip straight to the next position whose generation field matches: a tight scan over
        // the buffered bytes (recovery's look-ahead used to cost ~0.4 s per open, one call per
        // byte; found by the storage benchmark).
        let candidates = window.len().saturating_sub(RECORD_HEADER_SIZE) + 1;
        let skip = (0..candidates).find(|&i| {
            window[i + RECORD_GENERATION_OFFSET] == generation[0]
                && window[i + RECORD_GENERATION_OFFSET + 1] == generation[1]
        });
        let Some(skip) = skip else {
            position += candidates as u64;
            continue;
        };
        position += skip as u64;
        let window = reader
            .window(position, RECORD_HEADER_SIZE)
            .map_err(read_error)?;
        debug_assert_eq!(
            RecordHeader::peek_generation(window),
            Some(segment.generation)
        );
        let header_bytes: &[u8; RECORD_HEADER_SIZE] = window[..RECORD_HEADER_SIZE]
            .try_into()
            .map_err(|_| corrupt(&segment.path, position, 0, "short window".into()))?;
        let header = RecordHeader::parse(header_bytes);
        let total = header.encoded_size();
        if position + total > limit {
            position += 1;
            continue;
        }
        let window = reader
            .window(position, total as usize)
            .map_err(read_error)?;
        if check_record(window, segment.generation).is_ok() {
            ahead.extent = ahead.extent.max(position + total);
            if let Some(durable_before) = header.durable_before() {
                if ahead
                    .claim
                    .is_none_or(|c| c.durable_before < durable_before)
                {
                    ahead.claim = Some(Claim {
                        durable_before,
                        offset: header.offset,
                        position,
                    });
                }
            }
        }
        position += 1;
    }
    Ok(ahead)
}

/// Write and sync `segment`'s header with a truncation mark at `cut`.
fn write_cut_mark(segment: &Segment, header: &SegmentHeader, cut: u64) -> LogResult<()> {
    segment
        .file
        .write_all_at(&header.encode_cutting(cut), 0)
        .map_err(|e| LogError::io("write truncation mark", segment.path.clone(), e))?;
    segment
        .file
        .sync_data()
        .map_err(|e| LogError::io("sync truncation mark", segment.path.clone(), e))
}

/// Finish a truncation (an interrupted one, or the zeroing of this recovery): once the tail is
/// settled (leftovers zeroed and synced), write the header without its truncation mark, so that
/// later records' claims count again.
fn clear_cut_mark(segment: &Segment, header: &SegmentHeader) -> LogResult<()> {
    segment
        .file
        .write_all_at(&header.encode(), 0)
        .map_err(|e| LogError::io("clear truncation mark", segment.path.clone(), e))?;
    segment
        .file
        .sync_data()
        .map_err(|e| LogError::io("sync segment", segment.path.clone(), e))
}

/// Overwrite `[from, to)` of a segment with zeros and sync it.
pub(crate) fn zero_range(segment: &Segment, from: u64, to: u64) -> LogResult<()> {
    let zeros = vec![0u8; READ_CHUNK_BYTES];
    let mut position = from;
    while position < to {
        let len = ((to - position) as usize).min(zeros.len());
        segment
            .file
            .write_all_at(&zeros[..len], position)
            .map_err(|e| LogError::io("zero segment tail", segment.path.clone(), e))?;
        position += len as u64;
    }
    segment
        .file
        .sync_data()
        .map_err(|e| LogError::io("sync segment", segment.path.clone(), e))
}

pub(crate) fn corrupt(path: &Path, position: u64, offset: u64, reason: String) -> LogError {
    LogError::Corrupt {
        segment: path.to_path_buf(),
        position,
        offset,
        reason,
    }
}
