//! `LogError`, the one error type of the storage engine.

use std::path::PathBuf;

use crate::io::IoError;

/// An error of the storage engine. Each variant says what happened and where; the `Display`
/// text says what to do where the caller can do something.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// A file operation failed (outside the write path, which stops the log instead).
    #[error("{op} {path}: {source}")]
    Io {
        /// What the log was doing.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error of the `Io` call.
        source: IoError,
    },
    /// The log stopped after a failed write or sync and takes no more appends until
    /// [`crate::Log::heal`] reopens it. Records reported durable before the failure are intact and
    /// readable.
    #[error(
        "log {dir} stopped after a failed {op}: {source}; appends are refused until it is healed \
         (free space or fix the device, then heal)"
    )]
    Stopped {
        /// The log's directory.
        dir: PathBuf,
        /// The call that failed (`write`, `sync`, `create segment`, ...).
        op: &'static str,
        /// Its error.
        source: IoError,
    },
    /// Data that was reported durable does not read back as written.
    #[error(
        "corrupt log data in {segment} at byte {position} (offset {offset}): {reason}; the data \
         was reported durable, so it is not skipped: restore this log from a replica or backup"
    )]
    Corrupt {
        /// The segment file.
        segment: PathBuf,
        /// Byte position inside the file.
        position: u64,
        /// The offset expected there.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The offset is below the log's first offset (removed by prefix removal) or not yet durable.
    #[error("offset {offset} is not in the log (it holds offsets {start}..{end})")]
    OutOfRange {
        /// The offset asked for.
        offset: u64,
        /// First offset held.
        start: u64,
        /// One past the last durable offset.
        end: u64,
    },
    /// A record is larger than a segment can hold.
    #[error(
        "record of {size_bytes} bytes does not fit a segment of {segment_size_bytes} bytes; \
         use a larger segment size or smaller records"
    )]
    RecordTooLarge {
        /// Encoded size of the record.
        size_bytes: u64,
        /// Segment size of this log.
        segment_size_bytes: u64,
    },
    /// Bad options or arguments.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The log was closed.
    #[error("log {dir} is closed")]
    Closed {
        /// The log's directory.
        dir: PathBuf,
    },
}

impl LogError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: IoError) -> LogError {
        LogError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// True if the log stopped and needs [`crate::Log::heal`].
    pub fn is_stopped(&self) -> bool {
        matches!(self, LogError::Stopped { .. })
    }
}

/// Result type of the storage engine.
pub type LogResult<T> = Result<T, LogError>;
