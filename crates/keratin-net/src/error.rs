//! The crate's errors: [`NetError`] for everything a caller of the transport sees,
//! [`RemoteError`] for what a peer's handler refused with, and [`FrameError`] for bytes that do
//! not follow `docs/cluster-protocol.md`. Configuration errors live in [`crate::config`].

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::GroupId;
use crate::NodeId;

/// A refusal from the other side: a stable [`crate::codes`] number and a message for humans.
///
/// Handlers return it for requests they refuse (for example a transient "no room" from a
/// follower whose disk is at its reserve); the caller gets it as [`NetError::Refused`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("code {code}: {message}")]
pub struct RemoteError {
    /// A [`crate::codes`] number; application codes are `>= codes::APP_CODE_MIN`.
    pub code: u16,
    /// What happened and what to do, for logs and operators.
    pub message: String,
}

impl RemoteError {
    /// A refusal with `code` and `message`.
    pub fn new(code: u16, message: impl Into<String>) -> RemoteError {
        RemoteError {
            code,
            message: message.into(),
        }
    }
}

/// Why a call, a heartbeat or starting the transport failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// No connection to the peer: never established, lost, or refused at the handshake. The
    /// transport keeps reconnecting in the background; retry later.
    #[error("node {to} is unreachable: {reason}")]
    Unreachable {
        /// The peer.
        to: NodeId,
        /// The last connection error, or "not connected yet".
        reason: String,
    },
    /// No reply within the caller's timeout (which includes waiting for a slot when
    /// `calls_in_flight_max` calls are outstanding, and for room in the write queue).
    #[error("call to node {to} timed out after {timeout_ms} ms")]
    TimedOut {
        /// The peer.
        to: NodeId,
        /// The caller's timeout.
        timeout_ms: u64,
    },
    /// The peer's handler (or its transport, for [`crate::codes::BUSY`]) refused.
    #[error("node {to} refused: {error}")]
    Refused {
        /// The peer.
        to: NodeId,
        /// Its code and message.
        error: RemoteError,
    },
    /// The connection broke a protocol rule; it is closed and will be re-established.
    #[error("protocol error with node {peer}: {reason}")]
    Protocol {
        /// The peer.
        peer: NodeId,
        /// What was wrong.
        reason: String,
    },
    /// The connection closed before the reply arrived (the peer died, or was replaced by a
    /// newer connection, or this transport shut down). The request may or may not have run.
    #[error("connection to node {to} closed before the reply")]
    Closed {
        /// The peer.
        to: NodeId,
    },
    /// A newer heartbeat for the same group replaced this one before it was sent.
    #[error("heartbeat for group {group} to node {to} superseded by a newer one")]
    Superseded {
        /// The peer.
        to: NodeId,
        /// The group.
        group: GroupId,
    },
    /// The write queue to the peer is full: it reads slower than we write. Transient.
    #[error("write queue to node {to} is full (the peer reads slower than this node writes); retry later")]
    Backlogged {
        /// The peer.
        to: NodeId,
    },
    /// The node id is not a peer (not in the cluster configuration nor added since, or removed
    /// since, or this node itself).
    #[error("node {to} is not a peer of this node")]
    UnknownPeer {
        /// The id asked for.
        to: NodeId,
    },
    /// `Transport::add_peer` was given this node's own id: a node is not its own peer.
    #[error("node {id} is this node itself; a node cannot be its own peer (check the id given to add-node)")]
    SelfPeer {
        /// The id given (this node's).
        id: NodeId,
    },
    /// The request does not fit in one frame.
    #[error("request of {size_bytes} bytes exceeds the frame size limit of {limit_bytes} bytes")]
    TooLarge {
        /// Frame length the request would need.
        size_bytes: u64,
        /// The limit (`TransportOptions::frame_size_bytes_max`).
        limit_bytes: u32,
    },
    /// A node label over [`crate::frame::LABEL_BYTES_MAX`] (`Transport::set_label`).
    #[error("a node label of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes")]
    LabelTooLarge {
        /// The label's size.
        size_bytes: usize,
        /// The limit.
        limit_bytes: usize,
    },
    /// A mutual-TLS file (`cluster.tls_cert_file`, `tls_key_file`, `tls_ca_file`) cannot be
    /// used: at [`crate::ClusterTls::load`], or at a reload, which then changes nothing.
    #[error("cluster TLS {what} {}: {reason}", path.display())]
    Tls {
        /// `certificate file`, `key file` or `CA file`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The cluster listen address could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The operating system's error.
        reason: String,
    },
}

impl NetError {
    pub(crate) fn bind(addr: SocketAddr, error: &io::Error) -> NetError {
        NetError::Bind {
            addr,
            reason: error.to_string(),
        }
    }
}

/// Bytes that do not follow `docs/cluster-protocol.md`. Never a panic: every decoder returns
/// this for any input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// A length prefix above the receiver's limit, refused before anything is buffered.
    #[error("frame length {size_bytes} exceeds the limit of {limit_bytes} bytes")]
    TooLarge {
        /// The length prefix read.
        size_bytes: u64,
        /// The receiver's limit.
        limit_bytes: u32,
    },
    /// A length prefix of zero (every frame has a type byte).
    #[error("frame length 0 (every frame has a type byte)")]
    ZeroLength,
    /// A type byte version 1 does not define.
    #[error("unknown frame type 0x{0:02x}")]
    UnknownType(u8),
    /// A body that does not match its type's layout.
    #[error("malformed {frame} frame: {reason}")]
    Malformed {
        /// The frame type's name.
        frame: &'static str,
        /// What was wrong.
        reason: &'static str,
    },
    /// The first four bytes are not the cluster magic `KRCL`.
    #[error("magic {0:02x?} is not KRCL: the peer does not speak the Keratin cluster protocol (is a client pointed at the cluster port?)")]
    BadMagic([u8; 4]),
    /// A handshake field that does not follow the protocol.
    #[error("bad handshake: {0}")]
    Handshake(String),
}

impl FrameError {
    /// The [`crate::codes`] number an `Error` frame carries for this error.
    pub fn code(&self) -> u16 {
        match self {
            FrameError::TooLarge { .. } => crate::codes::FRAME_TOO_LARGE,
            _ => crate::codes::PROTOCOL,
        }
    }
}
