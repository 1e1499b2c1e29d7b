//! The groups' network over `keratin-net`: one connection per node pair shared by every group,
//! heartbeats coalesced per node pair (openraft-multi shares connections but does not batch
//! heartbeats, openraft#1959; the transport does both).
//!
//! - `rpc`: the bodies of the Raft requests and replies, byte by byte
//!   (`docs/cluster-protocol.md`, "Raft bodies").
//! - `client`: [`NetworkFactory`] and [`GroupNetwork`], openraft's sending side; `parts`, an
//!   append too large for one body sent as consecutive appends.
//! - `server`: [`Groups`], the node's handler that routes requests to each group's `Raft`.
//! - [`probe`]: the storage probe, which copy of a group's storage a node holds.
//! - [`codes`]: the refusals a group answers with (application codes of `keratin-net`).

mod client;
mod parts;
pub mod probe;
pub mod rpc;
mod server;

pub use client::{Addressing, GroupNetwork, NetworkFactory};
pub use rpc::{CopyStatus, SnapshotWire};
pub use server::{GroupEndpoint, Groups, LabelSink, RaftEndpoint};

/// Refusals of the Raft handler; `keratin-net` application codes (from `APP_CODE_MIN`). The
/// sender maps every one to `Unreachable`: openraft backs off and retries.
pub mod codes {
    use keratin_net::codes::APP_CODE_MIN;

    /// The group is not served on this node (not created yet, or being rebuilt).
    pub const NO_GROUP: u16 = APP_CODE_MIN;
    /// The group's storage failed; it answers nothing until it is rebuilt.
    pub const FENCED: u16 = APP_CODE_MIN + 1;
    /// The body did not decode.
    pub const BAD_BODY: u16 = APP_CODE_MIN + 2;
    /// openraft refused (the group is shutting down, or a fatal error).
    pub const RAFT: u16 = APP_CODE_MIN + 3;
    /// A request kind this node does not know.
    pub const UNKNOWN_KIND: u16 = APP_CODE_MIN + 4;
    /// The node's storage is at its reserve level: a partition group's append with entries is
    /// refused (`Groups::refuse_appends`).
    pub const NO_ROOM: u16 = APP_CODE_MIN + 5;
    /// The request is for another copy of the group's storage than the one this node holds
    /// (its directory was wiped and made again): the old copy's vote and entries are gone.
    pub const OTHER_STORAGE: u16 = APP_CODE_MIN + 6;
    /// The request names no copy and this node's replica holds no membership yet: it waits
    /// until the group's leader records its copy.
    pub const NOT_MEMBER: u16 = APP_CODE_MIN + 7;
}
