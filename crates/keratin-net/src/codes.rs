//! Stable error codes carried in refusals (handshake refusals, `Refusal` and `Error` frames,
//! heartbeat replies). The numbers are part of the protocol (`docs/cluster-protocol.md`,
//! "Error codes"); a retired code is never reused.
//!
//! Codes below [`APP_CODE_MIN`] belong to the transport. Codes from [`APP_CODE_MIN`] up belong to
//! the application's handler (the Raft adapter), which the transport passes through untouched.

/// The receiving connection already serves as many requests as it may
/// (`TransportOptions::served_in_flight_max`). Transient: retry later.
pub const BUSY: u16 = 1;
/// A heartbeat batch reply said nothing about this group.
pub const NO_REPLY: u16 = 2;
/// The handler's reply does not fit in one frame.
pub const REPLY_TOO_LARGE: u16 = 3;
/// The handler does not serve this (heartbeats, by default).
pub const NOT_SUPPORTED: u16 = 4;

/// Handshake: the first four bytes are not the cluster magic.
pub const BAD_MAGIC: u16 = 10;
/// Handshake: the protocol version is not one this node speaks.
pub const VERSION: u16 = 11;
/// Handshake: the hello names another cluster.
pub const CLUSTER: u16 = 12;
/// Handshake: the hello comes from a node id this node does not know as a peer.
pub const UNKNOWN_NODE: u16 = 13;
/// Handshake: the hello is addressed to another node id than this one.
pub const WRONG_NODE: u16 = 14;
/// Handshake: the dialer has the higher node id; only the lower id of a pair dials.
pub const WRONG_DIRECTION: u16 = 15;
/// Handshake (mutual TLS): the dialer's certificate does not name the node id its hello claims
/// (`node-<id>.keratin`).
pub const WRONG_IDENTITY: u16 = 16;

/// `Error` frame: a frame that does not follow the protocol; the sender closes after it.
pub const PROTOCOL: u16 = 20;
/// `Error` frame: a length prefix above the receiver's frame size limit.
pub const FRAME_TOO_LARGE: u16 = 21;

/// The smallest code an application handler may use in a [`crate::RemoteError`].
pub const APP_CODE_MIN: u16 = 1000;
