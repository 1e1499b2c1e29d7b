//! Keratin's storage engine: segment logs of generation-stamped records.
//!
//! # Layout
//! - [`format`]: segment header and record layout, byte by byte (`docs/storage-format.md`).
//! - [`io`]: the `Io` seam — every file operation — with the real file system ([`RealIo`]) and a
//!   simulated disk that can fail or crash at any call ([`SimIo`]).
//! - `segment`: one segment file in memory (extent, allocated length, sparse index), the
//!   preallocation steps, file names (segments, anchor) and buffered reads.
//! - `recovery`: from the files in a directory (or none: logs are created lazily) back to a log,
//!   cutting torn tails, reading the anchor of a handed-back log and reporting damage to durable
//!   data.
//! - `commit`: the `Writer`, sole writer of a log's files (group commit, rolls, truncation,
//!   prefix removal), and the round a commit worker runs with it.
//! - `workers`: the commit workers, a bounded set per file system shared by every log of a
//!   pool, each log run by one worker at a time, one round per turn.
//! - `log`: [`Log`], the public API appenders and readers use; `reader`: [`LogReader`].
//! - `pool`: [`SegmentPool`], spare segment files shared by the logs of a node, the node's
//!   commit workers, and the node's log figures (stops, heals, sync latencies).
//! - `sync_stats`: the sync latency histogram ([`SyncHistogramSnapshot`]).
//! - `error`: [`LogError`].
#![deny(missing_docs)]
#![deny(clippy::big_endian_bytes, clippy::host_endian_bytes)]

mod commit;
pub mod error;
pub mod format;
pub mod io;
mod log;
mod pool;
mod reader;
mod recovery;
mod segment;
mod sync_stats;
mod ticket;
mod workers;

pub use error::{LogError, LogResult};
pub use format::SizeClass;
pub use io::{FsStats, Io, IoError, IoFile, OpenMode, RealIo, SimFault, SimIo};
pub use log::{
    Log, LogOptions, LogStats, PrefixRemoval, ReadRecord, Record, SegmentStats,
    DEFAULT_MAX_PENDING_BYTES, DEFAULT_SEGMENT_SIZE_BYTES, MAX_SEGMENT_SIZE_BYTES,
    MIN_SEGMENT_SIZE_BYTES,
};
pub use pool::{
    FilesystemSpares, PoolCounters, PoolOptions, SegmentPool, DEFAULT_BUDGET_FRACTION,
    DEFAULT_BUDGET_MAX_BYTES, DEFAULT_COMMIT_WORKERS_PER_FILESYSTEM, PRIVATE_POOL_SPARES,
    SPARES_DIR_NAME,
};
pub use reader::LogReader;
pub use sync_stats::{SyncHistogramSnapshot, SYNC_BUCKET_COUNT, SYNC_BUCKET_FIRST_MICROS};
pub use ticket::Ticket;
pub use workers::RETAINED_BUFFERS_BYTES_MAX;
