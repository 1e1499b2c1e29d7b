//! `RaftError`, the one error type of the adapter.
//!
//! It never reaches openraft: storage methods trip the group's [`crate::Fence`] with it and
//! answer openraft `Ok` (see the crate docs, "Failures"). It reaches the owner of the group
//! through [`crate::Fence::reason`] and from the constructors.

use keratin_log::LogError;

/// An error of the replication adapter.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RaftError {
    /// The partition's entry log or the group's state log failed (a stopped log, a failed read).
    #[error("{what}: {source}")]
    Log {
        /// What the adapter was doing.
        what: &'static str,
        /// The log's error; `LogError::Stopped` means: free space or fix the device, then
        /// rebuild the group (see [`crate::Fence`]).
        source: LogError,
    },
    /// A record of a replicated log does not decode (durable data that reads back valid but is
    /// not an entry of the replicated log format, `docs/storage-format.md`).
    #[error(
        "record at offset {offset} is not a valid replicated-log record: {reason}; restore this \
         replica from the others"
    )]
    Format {
        /// The record's offset (its Raft log index).
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// openraft asked for something the adapter cannot do without a change to the segment log.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A leader's replication stream asked to send from an entry this node purged (see
    /// `network::client`, "Stale streams").
    #[error(
        "entries from {next} were purged on this node (its log starts at {floor}): the follower \
         needs the snapshot, not this append"
    )]
    Purged {
        /// The first entry the append would have carried.
        next: u64,
        /// The first entry this node holds.
        floor: u64,
    },
    /// An append whose first entry does not follow its previous log id by one (see
    /// `network::client`, "Non-contiguous appends").
    #[error(
        "an append's first entry is {first} but the entry after its previous log id is {next}: \
         not sent, the leader starts again from the follower's position"
    )]
    NotContiguous {
        /// The first entry's index.
        first: u64,
        /// The index that must follow the previous log id.
        next: u64,
    },
    /// Bad arguments (a reserved record type, an oversize membership).
    #[error("invalid argument: {0}")]
    Invalid(String),
}

impl RaftError {
    /// Whether this is a log's report that data it reported durable does not read back (a
    /// flipped bit, a zeroed range with records after it): the copy is damaged, not the
    /// device failing.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            RaftError::Log {
                source: LogError::Corrupt { .. },
                ..
            }
        )
    }

    pub(crate) fn log(what: &'static str, source: LogError) -> RaftError {
        RaftError::Log { what, source }
    }
}
