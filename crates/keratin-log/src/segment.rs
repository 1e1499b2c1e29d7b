//! `Segment`: what the log knows of one segment file in memory (its durable extent, its allocated
//! length and a sparse index from offsets to byte positions), the preallocation steps a segment
//! file grows by, and `ChunkReader`, the buffered positional reader that recovery and readers use
//! to walk a segment's records.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::format::SEGMENT_HEADER_SIZE;
use crate::io::{IoFile, IoResult};

/// One sparse index entry per this many bytes of records. With 64 MiB segments that is 4,096
/// entries of 8 bytes (32 KiB) per full segment: a 1 GiB backlog costs 512 KiB of index.
pub(crate) const INDEX_INTERVAL_BYTES: u64 = 16 * 1024;

/// The file name of the segment whose first offset is `base`: 20 digits, so that names sort like
/// offsets.
pub(crate) fn segment_file_name(base: u64) -> String {
    format!("{base:020}.seg")
}

/// The base offset named by a segment file name, if it is one.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The anchor of a log that handed its segments back: the next offset (`docs/storage-format.md`,
/// "Anchor").
pub(crate) const ANCHOR_FILE_NAME: &str = "anchor";

/// The name an anchor has while it is being written; recovery deletes it.
pub(crate) const ANCHOR_SCRATCH_FILE_NAME: &str = "anchor.tmp";

/// The first preallocation step of a fresh segment file: an idle or small queue holds 64 KiB,
/// not a whole segment (issue 13: 200 empty queues held 12.8 GB with 64 MiB preallocated each).
pub(crate) const PREALLOCATION_FIRST_STEP_BYTES: u64 = 64 << 10;

/// The largest preallocation step (see [`preallocation_step_max_bytes`]).
pub(crate) const PREALLOCATION_STEP_MAX_BYTES: u64 = 4 << 20;

/// The largest step for segments of `segment_size_bytes`: 4 MiB, or 1/16 of the segment if that
/// is smaller, but never below the first step. Steps double up to it, so a small log wastes at
/// most half of its file, and a busy one holds at most one step (4 MiB) ahead of its writer
/// while a 64 MiB segment takes 22 `fallocate` calls: 64 KiB .. 4 MiB doubling (7), then 4 MiB
/// at a time (15). The 1/16 keeps small segments (the metadata class, 8 MiB) growing in more than
/// a couple of steps.
pub(crate) fn preallocation_step_max_bytes(segment_size_bytes: u64) -> u64 {
    PREALLOCATION_STEP_MAX_BYTES
        .min(segment_size_bytes / 16)
        .max(PREALLOCATION_FIRST_STEP_BYTES)
}

/// The length to preallocate a segment file to so that `needed` bytes fit, when it holds
/// `allocated` now: the next step past `needed` (steps double from the first up to the maximum),
/// never past the segment size. Returns `allocated` when `needed` fits already.
pub(crate) fn preallocation_target(allocated: u64, needed: u64, segment_size_bytes: u64) -> u64 {
    let needed = needed.min(segment_size_bytes);
    if needed <= allocated {
        return allocated;
    }
    let step_max = preallocation_step_max_bytes(segment_size_bytes);
    let mut target = allocated;
    while target < needed {
        let step = target.clamp(PREALLOCATION_FIRST_STEP_BYTES, step_max);
        target = target.saturating_add(step);
    }
    target.min(segment_size_bytes)
}

/// The name a fresh segment file has while it is being prepared; recovery deletes such files.
pub(crate) fn scratch_file_name(base: u64) -> String {
    format!("{base:020}.seg.tmp")
}

/// Whether `name` is a segment's scratch name ([`scratch_file_name`]).
pub(crate) fn is_scratch_file_name(name: &str) -> bool {
    name.strip_suffix(".tmp")
        .is_some_and(|segment| parse_segment_file_name(segment).is_some())
}

/// A sparse index entry: the record at `base + offset_delta` starts at byte `position`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexEntry {
    pub(crate) offset_delta: u32,
    pub(crate) position: u32,
}

/// A segment as readers see it: only records that are durable.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    pub(crate) path: PathBuf,
    pub(crate) file: Arc<dyn IoFile>,
    pub(crate) base: u64,
    pub(crate) generation: u16,
    /// The segment's size from its header: records never pass it.
    pub(crate) size_bytes: u64,
    /// The file's length: what it holds on disk (preallocated ahead of the records, at most
    /// `size_bytes` for files this code writes; older files are `size_bytes` long).
    pub(crate) allocated_bytes: u64,
    /// One past the last byte of the last durable record.
    pub(crate) end_position: u64,
    /// One past the offset of the last durable record (`base` when empty).
    pub(crate) next_offset: u64,
    pub(crate) index: Vec<IndexEntry>,
}

impl Segment {
    pub(crate) fn new(
        path: PathBuf,
        file: Arc<dyn IoFile>,
        base: u64,
        generation: u16,
        size_bytes: u64,
        allocated_bytes: u64,
    ) -> Segment {
        Segment {
            path,
            file,
            base,
            generation,
            size_bytes,
            allocated_bytes,
            end_position: SEGMENT_HEADER_SIZE as u64,
            next_offset: base,
            index: Vec::new(),
        }
    }

    /// A byte position at or past the end of every durable record before `end`: the position
    /// of the first indexed record at or past `end`, or the durable end. (At most one index
    /// interval and one record past what those records need.)
    pub(crate) fn position_bound(&self, end: u64) -> u64 {
        let delta = end.saturating_sub(self.base);
        let at = self
            .index
            .partition_point(|entry| u64::from(entry.offset_delta) < delta);
        self.index.get(at).map_or(self.end_position, |entry| {
            u64::from(entry.position).min(self.end_position)
        })
    }

    /// The byte position of the indexed record at or before `offset`, and that record's offset.
    pub(crate) fn lookup(&self, offset: u64) -> (u64, u64) {
        let delta = offset.saturating_sub(self.base);
        let at = self
            .index
            .partition_point(|entry| u64::from(entry.offset_delta) <= delta);
        match at.checked_sub(1).and_then(|i| self.index.get(i)) {
            Some(entry) => (
                u64::from(entry.position),
                self.base + u64::from(entry.offset_delta),
            ),
            None => (SEGMENT_HEADER_SIZE as u64, self.base),
        }
    }

    /// Drop index entries at or past `offset` (after a truncation).
    pub(crate) fn truncate_index(&mut self, offset: u64) {
        let delta = offset.saturating_sub(self.base);
        self.index
            .retain(|entry| u64::from(entry.offset_delta) < delta);
    }

    /// Used bytes: header plus durable records.
    pub(crate) fn used_bytes(&self) -> u64 {
        self.end_position
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Where records of this segment can lie: the end of the file or the segment size, whichever
    /// is smaller (bytes past the end of the file read as zeros: no record).
    pub(crate) fn record_limit(&self) -> u64 {
        self.allocated_bytes.min(self.size_bytes)
    }
}

/// Builds a sparse index while records are appended or scanned in order.
#[derive(Debug, Clone)]
pub(crate) struct IndexBuilder {
    base: u64,
    last_indexed_position: Option<u64>,
}

impl IndexBuilder {
    pub(crate) fn new(base: u64, last_indexed_position: Option<u64>) -> IndexBuilder {
        IndexBuilder {
            base,
            last_indexed_position,
        }
    }

    /// Called for each record in order; returns an entry when one is due.
    pub(crate) fn record(&mut self, offset: u64, position: u64) -> Option<IndexEntry> {
        let due = match self.last_indexed_position {
            None => true,
            Some(last) => position >= last + INDEX_INTERVAL_BYTES,
        };
        if !due {
            return None;
        }
        // Segments are at most 4 GiB (checked in LogOptions) and hold fewer than 2^32 records
        // (each takes at least a 32-byte header), so both fit.
        let offset_delta = u32::try_from(offset - self.base).ok()?;
        let position32 = u32::try_from(position).ok()?;
        self.last_indexed_position = Some(position);
        Some(IndexEntry {
            offset_delta,
            position: position32,
        })
    }
}

/// How many bytes a [`ChunkReader`] reads at a time. Large enough that a sequential scan is
/// bandwidth-bound, small enough that opening many logs at once stays cheap in memory.
pub(crate) const READ_CHUNK_BYTES: usize = 1 << 20;

/// Buffered positional reads over one file, bounded by `limit` (the segment size).
#[derive(Debug)]
pub(crate) struct ChunkReader {
    file: Arc<dyn IoFile>,
    limit: u64,
    chunk_bytes: usize,
    buf: Vec<u8>,
    buf_start: u64,
}

impl ChunkReader {
    /// A reader of `file` that never reads at or past `limit`, `chunk_bytes` at a time.
    pub(crate) fn new(file: Arc<dyn IoFile>, limit: u64, chunk_bytes: usize) -> ChunkReader {
        ChunkReader {
            file,
            limit,
            chunk_bytes,
            buf: Vec::new(),
            buf_start: 0,
        }
    }

    /// Move the limit (readers follow the durable end of a segment as it grows). Bytes already
    /// buffered lie below the old limit and stay valid.
    pub(crate) fn set_limit(&mut self, limit: u64) {
        if limit < self.limit {
            self.buf.clear();
        }
        self.limit = limit;
    }

    /// Bytes from `position`: at least `len` of them, or all up to the limit if fewer remain.
    pub(crate) fn window(&mut self, position: u64, len: usize) -> IoResult<&[u8]> {
        let available_to_limit = self.limit.saturating_sub(position);
        let want = (len as u64).min(available_to_limit) as usize;
        let buf_end = self.buf_start + self.buf.len() as u64;
        if position < self.buf_start || position + want as u64 > buf_end {
            let read_len = want
                .max(self.chunk_bytes)
                .min(usize::try_from(available_to_limit).unwrap_or(usize::MAX));
            self.buf.resize(read_len, 0);
            self.file.read_exact_at(&mut self.buf, position)?;
            self.buf_start = position;
        }
        let start = (position - self.buf_start) as usize;
        let end = self.buf.len();
        Ok(&self.buf[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_roundtrip() {
        assert_eq!(segment_file_name(42), "00000000000000000042.seg");
        assert_eq!(
            parse_segment_file_name(&segment_file_name(u64::MAX)),
            Some(u64::MAX)
        );
        assert_eq!(parse_segment_file_name("42.seg"), None);
        assert_eq!(parse_segment_file_name(&scratch_file_name(1)), None);
    }

    #[test]
    fn preallocation_steps_double_to_the_cap_and_stop_at_the_segment_size() {
        let size = 64 << 20;
        let mut allocated = 0;
        let mut steps = Vec::new();
        while allocated < size {
            allocated = preallocation_target(allocated, allocated + 1, size);
            steps.push(allocated);
        }
        assert_eq!(steps[..3], [64 << 10, 128 << 10, 256 << 10]);
        assert_eq!(steps.len(), 22, "{steps:?}");
        assert!(steps.windows(2).all(|w| w[1] - w[0] <= 4 << 20));
        assert_eq!(preallocation_target(100, 50, size), 100);
        // A large need skips steps; the segment size caps it.
        assert_eq!(preallocation_target(64 << 10, 300 << 10, size), 512 << 10);
        assert_eq!(preallocation_target(0, 1, 32 << 10), 32 << 10);
        assert_eq!(preallocation_target(0, size + 1, size), size);
        // Small segments: steps of at most 1/16, never below the first step.
        assert_eq!(preallocation_step_max_bytes(8 << 20), 512 << 10);
        assert_eq!(preallocation_step_max_bytes(256 << 10), 64 << 10);
    }

    #[test]
    fn index_builder_spaces_entries() {
        let mut builder = IndexBuilder::new(100, None);
        assert!(builder.record(100, 64).is_some());
        assert!(builder.record(101, 64 + 1000).is_none());
        let entry = builder.record(150, 64 + INDEX_INTERVAL_BYTES).expect("due");
        assert_eq!(entry.offset_delta, 50);
    }
}
