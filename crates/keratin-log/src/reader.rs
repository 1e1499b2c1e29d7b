//! `LogReader`: iterating over durable records, verifying each one as it is read.

use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{LogError, LogResult};
use crate::format::{check_record, RECORD_HEADER_SIZE};
use crate::log::{ReadRecord, Shared};
use crate::recovery::corrupt;
use crate::segment::{ChunkReader, Segment};

/// Where a reader is inside one segment.
#[derive(Debug)]
struct Cursor {
    base: u64,
    generation: u16,
    path: PathBuf,
    chunks: ChunkReader,
    /// Byte position of the record with offset `offset`.
    position: u64,
    offset: u64,
    /// One past the last durable offset of the segment when the cursor was last refreshed.
    end_offset: u64,
}

/// An iterator over durable records from an offset on; see [`crate::Log::reader`].
#[derive(Debug)]
pub struct LogReader {
    shared: Arc<Shared>,
    next: u64,
    /// It ends before this offset ([`LogReader::until`]).
    end: u64,
    chunk_bytes: usize,
    cursor: Option<Cursor>,
}

impl LogReader {
    pub(crate) fn new(shared: Arc<Shared>, offset: u64, chunk_bytes: usize) -> LogReader {
        LogReader {
            shared,
            next: offset,
            end: u64::MAX,
            chunk_bytes,
            cursor: None,
        }
    }

    /// This reader, ending before offset `end`, and reading no more of a segment file than the
    /// records before `end` need (within one index interval): a reader of a few records near
    /// the durable end does not read the file up to it, one chunk of it at a time.
    pub fn until(mut self, end: u64) -> LogReader {
        self.end = end;
        self
    }

    /// The offset the next call to `next` returns.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// Point the cursor at the segment holding `self.next`; `None` at the durable end.
    fn refresh(&mut self) -> Option<LogResult<()>> {
        let state = self.shared.lock();
        let start = state.start_offset();
        if self.next < start {
            return Some(Err(LogError::OutOfRange {
                offset: self.next,
                start,
                end: state.durable_next,
            }));
        }
        if self.next >= state.durable_next || self.next >= self.end {
            return None;
        }
        let (_, segment) = state.segments.range(..=self.next).next_back()?;
        if self.next >= segment.next_offset {
            return None;
        }
        let end_offset = segment.next_offset.min(self.end);
        let limit = if self.end < segment.next_offset {
            segment.position_bound(self.end)
        } else {
            segment.end_position
        };
        match &mut self.cursor {
            Some(cursor) if cursor.base == segment.base && cursor.offset == self.next => {
                cursor.end_offset = end_offset;
                cursor.chunks.set_limit(limit);
            }
            _ => {
                let (position, offset) = segment.lookup(self.next);
                self.cursor = Some(Cursor {
                    base: segment.base,
                    generation: segment.generation,
                    path: segment.path.clone(),
                    chunks: ChunkReader::new(segment.file.clone(), limit, self.chunk_bytes),
                    position,
                    offset,
                    end_offset,
                });
            }
        }
        Some(Ok(()))
    }

    /// Read the record at the cursor and step past it.
    fn step(&mut self) -> LogResult<ReadRecord> {
        let cursor = self
            .cursor
            .as_mut()
            .ok_or_else(|| LogError::Invalid("reader has no cursor".into()))?;
        let position = cursor.position;
        let (header, window) = read_record_at(
            &mut cursor.chunks,
            &cursor.path,
            cursor.generation,
            position,
            cursor.offset,
        )?;
        let total = window.len();
        let record = ReadRecord {
            offset: header.offset,
            record_type: header.record_type,
            flags: header.flags,
            timestamp_ms: header.timestamp_ms,
            payload: window[RECORD_HEADER_SIZE..total].to_vec(),
        };
        cursor.position += total as u64;
        cursor.offset += 1;
        Ok(record)
    }

    /// A corruption seen while the segment was being removed is not one: the file was reused.
    fn explain(&self, error: LogError) -> LogError {
        if let LogError::Corrupt { .. } = error {
            let state = self.shared.lock();
            let start = state.start_offset();
            if self.next < start {
                return LogError::OutOfRange {
                    offset: self.next,
                    start,
                    end: state.durable_next,
                };
            }
        }
        error
    }
}

impl Iterator for LogReader {
    type Item = LogResult<ReadRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let cursor_ready = self
            .cursor
            .as_ref()
            .is_some_and(|c| c.offset <= self.next && self.next < c.end_offset);
        if !cursor_ready {
            if let Err(error) = self.refresh()? {
                return Some(Err(error));
            }
        }
        loop {
            let result = self.step();
            match result {
                Ok(record) if record.offset == self.next => {
                    self.next += 1;
                    return Some(Ok(record));
                }
                Ok(_) => continue,
                Err(error) => {
                    let error = self.explain(error);
                    self.cursor = None;
                    return Some(Err(error));
                }
            }
        }
    }
}

/// The byte position of the record with `offset` in a segment (used to cut a log there).
pub(crate) fn locate(segment: &Segment, offset: u64) -> LogResult<u64> {
    let (mut position, mut at) = segment.lookup(offset);
    let mut chunks = ChunkReader::new(segment.file.clone(), segment.end_position, 64 << 10);
    while at < offset {
        let (_, record) =
            read_record_at(&mut chunks, &segment.path, segment.generation, position, at)?;
        position += record.len() as u64;
        at += 1;
    }
    Ok(position)
}

/// The record at `position`, checked (checksum, generation, and offset `expected`): its header
/// and its whole encoded bytes. Readers and truncation walk records with it.
fn read_record_at<'a>(
    chunks: &'a mut ChunkReader,
    path: &std::path::Path,
    generation: u16,
    position: u64,
    expected: u64,
) -> LogResult<(crate::format::RecordHeader, &'a [u8])> {
    let read_error = |e| LogError::io("read segment", path, e);
    let window = chunks
        .window(position, RECORD_HEADER_SIZE)
        .map_err(read_error)?;
    let length = u32::from_le_bytes([window[4], window[5], window[6], window[7]]);
    let total = RECORD_HEADER_SIZE + length as usize;
    let window = chunks.window(position, total).map_err(read_error)?;
    match check_record(window, generation) {
        Ok(header) if header.offset == expected => Ok((header, &window[..total])),
        Ok(header) => Err(corrupt(
            path,
            position,
            expected,
            format!("found offset {}", header.offset),
        )),
        Err(fault) => Err(corrupt(path, position, expected, fault.to_string())),
    }
}
