//! Keratin's node-to-node transport: the bytes that carry Raft traffic between cluster nodes.
//! It knows nothing of Raft or queues; the Raft adapter (`keratin-raft`) serializes openraft's
//! RPCs into the bodies it sends and serves.
//!
//! - One TCP connection per node pair, shared by every group: the node with the lower id dials,
//!   the higher one accepts; a handshake checks magic, version, cluster name and node ids.
//! - Multiplexed calls ([`Transport::call`]): request ids, many in flight, a bounded number per
//!   connection, per-call timeouts, typed errors ([`NetError`]); the peer serves them with a
//!   [`Handler`], concurrently and bounded.
//! - Write coalescing: one writer task per connection drains a bounded queue into a buffered
//!   socket and flushes when the queue is empty.
//! - Heartbeat coalescing ([`Transport::heartbeat`]): all groups' heartbeats to a peer leave in
//!   one frame per tick; the peer answers them all in one frame.
//! - Liveness ([`Transport::peer_status`]): connected, last contact, round-trip estimate.
//! - Mutual TLS (optional, [`ClusterTls`] in [`TransportOptions::tls`]): every connection
//!   verifies both certificates against the cluster's CA, and each names its node
//!   (`node-<id>.keratin`); [`Transport::reload_tls`] swaps the certificate for new connections.
//! - Peers that change at run time ([`Transport::add_peer`], [`Transport::remove_peer`]): the
//!   peers given at start are the first set; the cluster layer adds and removes nodes of a live
//!   cluster with the same rules (the lower id dials, an unknown node's hello is refused).
//!
//! The wire format is specified byte by byte in `docs/cluster-protocol.md`.
//!
//! # How the Raft adapter is expected to use it
//!
//! - Start one [`Transport`] per node from the `[cluster]` section ([`ClusterConfig`]), with a
//!   [`Handler`] that routes `(group, kind, body)` to the group's `Raft` instance.
//! - Append-entries with entries, votes and snapshot chunks are [`Transport::call`]s; `kind`
//!   says which RPC, `group` which Raft group (the metadata group is one of them).
//! - Heartbeats (append-entries without entries) go through [`Transport::heartbeat`]; the peer's
//!   [`Handler::heartbeats`] gets every group's payload from one frame and answers per group.
//! - A follower without room refuses with a [`RemoteError`] whose code is an application code
//!   (`>= codes::APP_CODE_MIN`); the leader sees [`NetError::Refused`] and maps it to a
//!   transient network error, never to a storage error.
//! - [`NetError::Unreachable`], [`NetError::TimedOut`], [`NetError::Closed`] and
//!   [`NetError::Backlogged`] are all "unreachable for now" to openraft.
//!
//! # Layout
//!
//! - [`config`]: `ClusterConfig` (the `[cluster]` section), `PeerSpec` (`ID=ADDR`), checks.
//! - [`transport`]: `Transport`, the public API; `options`: its bounds and timers.
//! - [`handler`]: the `Handler` trait the application implements.
//! - [`frame`], [`handshake`]: the wire format (no I/O besides reading a hello); `wire.rs`: fields.
//! - [`tls`]: `ClusterTls`, the certificates and the naming rule; `stream.rs`: a connection's
//!   bytes over TCP or TLS.
//! - `listener.rs`, `dialer.rs`: establishing connections; `session.rs`: reading one;
//!   `writer.rs`: writing one; `connection.rs`: its shared state; `serve.rs`: serving requests;
//!   `heartbeat.rs`: the coalescing ticker; `peer.rs`: per-peer state; `context.rs`: what all
//!   tasks share.
//! - [`liveness`], [`stats`]: what operators and tests read; [`codes`]: stable error codes.

#![deny(missing_docs)]

pub mod codes;
pub mod config;
mod connection;
mod context;
mod dialer;
pub mod error;
pub mod frame;
pub mod handler;
pub mod handshake;
mod heartbeat;
mod listener;
pub mod liveness;
pub mod options;
mod peer;
mod serve;
mod session;
pub mod stats;
mod stream;
pub mod tls;
pub mod transport;
mod wire;
mod writer;

pub use config::{
    parse_peer_list, ClusterConfig, ClusterTlsConfig, ClusterTlsFiles, ConfigError, PeerSpec,
    ResolvedCluster,
};
pub use error::{FrameError, NetError, RemoteError};
pub use handler::{BoxFuture, Handler};
pub use liveness::PeerStatus;
pub use options::TransportOptions;
pub use stats::TransportStats;
pub use tls::ClusterTls;
pub use transport::Transport;

/// A node's id in the cluster (at least 1).
pub type NodeId = u64;

/// A Raft group's id. The transport carries it and never interprets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId(pub u64);

impl std::fmt::Display for GroupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
