//! Streams (`docs/streams.md`, issue 18): append-only partitioned logs that keep their messages
//! after they are read, bounded by retention, read from durable cursors.
//!
//! Built so far, pure (no I/O, no clock: time comes in as an argument) but for `rebuild`:
//! - `records`: the payload log's records ([`StreamRecord`]: messages, settings, checkpoints)
//!   and [`StreamSettings`], byte by byte.
//! - `retention`: which whole old segments a partition's retention removes ([`decide`]).
//! - `cursors`: the cursor log's records ([`CursorRecord`]), the table they build
//!   ([`CursorTable`]) and when the cursor log is compacted ([`should_compact`]);
//!   `cursor_log`: [`CursorLog`], the owner of a stream's cursor log over any partition log
//!   (a single node's local log, or a replicated one): commits, roles, compaction, heal.
//! - `partition`: [`StreamPartition`], the owner task of one partition: appends through the
//!   gate, checkpoints, retention passes, stop and heal; reads beside it; on a replicated log
//!   (`partition/follow.rs`) roles, and the records another node's owner proposed.
//! - `state`: [`StreamPartitionState`], one partition's state applied from its records
//!   (counts over its history, producer windows, checkpoints); `rebuild`: that state from a
//!   partition log's last checkpoint ([`rebuild()`]), blocking.
//!
//! - `groups`: [`Groups`], a stream's consumer groups on one node: range assignment in join
//!   order and two-step handovers ([`GroupMember`]).
//! - `live`: [`Stream`], a declared stream on a node: its partitions, its cursor log, routing
//!   and figures. The broker declares, opens, deletes and times retention for them
//!   (`broker/streams.rs`).
//!
//! In a cluster (`docs/streams.md`, "In a cluster") the broker opens a stream's partitions and
//! cursor log on replicated logs, all on one set of nodes; the node leading the cursor log
//! serves its readers.

pub mod cursor_log;
pub mod cursors;
pub mod groups;
pub mod live;
pub mod partition;
pub mod rebuild;
pub mod records;
pub mod retention;
pub mod state;

pub use cursor_log::CursorLog;
pub use cursors::{
    should_compact, CursorRecord, CursorState, CursorTable, CURSORS_MAX, CURSOR_NAME_MAX,
};
pub use groups::{range_assignment, GroupInfo, GroupMember, Groups, GROUP_MEMBERS_MAX};
pub use live::{Removed, Stream, StreamInfo};
pub use partition::{
    Appended, StreamMessage, StreamPartition, StreamPartitionConfig, StreamPartitionFigures,
    StreamRead,
};
pub use rebuild::{rebuild, Rebuilt};
pub use records::{Checkpoint, StreamRecord, StreamSettings};
pub use retention::{decide, Bound, Removal, RetentionBounds, SegmentFacts};
pub use state::{Applied, StreamPartitionState};

/// A checkpoint is written after this fraction of a segment of records (a quarter), so a
/// rebuild reads at most about one segment and a quarter.
pub const CHECKPOINT_INTERVAL_DIVISOR: u64 = 4;
