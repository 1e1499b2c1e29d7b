//! `Segment`: what the log knows of one segment file in memory (its durable extent and a sparse
//! index from offsets to byte positions), and `ChunkReader`, the buffered positional reader that
//! recovery and readers use to walk a segment's records.

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

/// The name a fresh segment file has while it is being prepared; recovery deletes such files.
pub(crate) fn scratch_file_name(base: u64) -> String {
    format!("{base:020}.seg.tmp")
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
    pub(crate) size_bytes: u64,
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
    ) -> Segment {
        Segment {
            path,
            file,
            base,
            generation,
            size_bytes,
            end_position: SEGMENT_HEADER_SIZE as u64,
            next_offset: base,
            index: Vec::new(),
        }
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
    fn index_builder_spaces_entries() {
        let mut builder = IndexBuilder::new(100, None);
        assert!(builder.record(100, 64).is_some());
        assert!(builder.record(101, 64 + 1000).is_none());
        let entry = builder.record(150, 64 + INDEX_INTERVAL_BYTES).expect("due");
        assert_eq!(entry.offset_delta, 50);
    }
}
