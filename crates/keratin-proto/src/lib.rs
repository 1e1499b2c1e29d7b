//! Keratin's wire protocol: the handshake, the frames, their byte encoding and the stable error
//! codes. No I/O and no async runtime: the server and the client move bytes, this crate gives
//! them meaning. The byte-by-byte specification is `docs/protocol.md`; the code derives its
//! offsets and sizes from the tables there, and `tests/roundtrip.rs` checks the spec's example
//! bytes against the encoder. `tests/vectors.rs` writes and checks `docs/protocol-vectors.json`,
//! the test vectors the Python client's tests read too.
//!
//! # Layout
//! - [`handshake`]: `ClientHello`/`ServerHello`, the magic and [`PROTOCOL_VERSION`].
//! - [`auth`]: [`Auth`], the login a `ClientHello` carries (version 6 on), and its bounds.
//! - [`frame`]: the [`Frame`] enum, its [`FrameType`] numbers and the struct each frame carries.
//! - [`stream`]: the structs of the stream frames of version 7 ([`PROTOCOL_VERSION_STREAMS`])
//!   and their bounds.
//! - [`codec`]: the frame header, the size limit, [`Frame::check`]/[`Frame::decode`]/
//!   [`Frame::encode`] and the `tokio_util` [`FrameCodec`].
//! - [`codes`]: stable error [`Code`]s (HTTP numbers), their retry classes, [`LimitReason`].
//! - [`error_body`]: [`ErrorBody`], the code + reason + retry hint + message sent on the wire.
//! - [`error`]: [`ProtoError`], everything that goes wrong while encoding or decoding.
//! - `body` (private): the field order of every frame body.
//! - `stream_body` (private): the field order of the stream frames' bodies.
//! - `wire` (private): primitive encodings (integers, strings, options, counted lists).
//!
//! # Malformed input
//! Decoding never panics. A truncated frame is `Incomplete` (read more). Every decode error ends
//! the connection: the receiver sends `Error { fatal: true }` with [`ProtoError::to_error_body`]
//! (413 for an oversize length prefix, 400 for anything else) and closes. Encoding errors leave
//! the output buffer and the connection untouched.

#![deny(missing_docs)]
#![deny(clippy::big_endian_bytes, clippy::host_endian_bytes)]

pub mod auth;
mod body;
pub mod codec;
pub mod codes;
pub mod error;
pub mod error_body;
pub mod frame;
pub mod handshake;
pub mod stream;
mod stream_body;
mod wire;

pub use auth::Auth;
pub use codec::{FrameCodec, FrameStatus, FRAME_SIZE_BYTES_MAX};
pub use codes::{Code, LimitReason, Retry};
pub use error::{Problem, ProtoError};
pub use error_body::ErrorBody;
pub use frame::*;
pub use handshake::{
    ClientHello, NodeAddress, ServerHello, ServerInfo, AUTH_VERSION, PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN, PROTOCOL_VERSION_STREAMS, SERVER_INFO_FIELD_BYTES_MAX,
    SERVER_INFO_NODES_MAX,
};
pub use stream::*;
