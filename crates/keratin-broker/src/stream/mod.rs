//! Streams (`docs/streams.md`, issue 18): append-only partitioned logs that keep their messages
//! after they are read, bounded by retention, read from durable cursors.
//!
//! Built so far, all pure (no I/O, no clock: time comes in as an argument):
//! - `records`: the payload log's records ([`StreamRecord`]: messages, settings, checkpoints)
//!   and [`StreamSettings`], byte by byte.
//! - `retention`: which whole old segments a partition's retention removes ([`decide`]).
//! - `cursors`: the cursor log's records ([`CursorRecord`]), the table they build
//!   ([`CursorTable`]) and when the cursor log is compacted ([`should_compact`]).
//!
//! Not built yet (`docs/streams.md`, "Build order"): the partition owner that appends, writes
//! checkpoints and runs retention; readers; the protocol, clients and CLI; replication.

pub mod cursors;
pub mod records;
pub mod retention;

pub use cursors::{should_compact, CursorRecord, CursorTable, CURSORS_MAX, CURSOR_NAME_MAX};
pub use records::{Checkpoint, StreamRecord, StreamSettings};
pub use retention::{decide, Bound, Removal, RetentionBounds, SegmentFacts};
