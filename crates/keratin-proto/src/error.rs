//! `ProtoError`: everything that can go wrong while encoding or decoding the protocol.
//!
//! Owns the mapping from a local error to the wire [`ErrorBody`] a receiver answers with. Which
//! connection outcome follows is specified in `docs/protocol.md` ("Malformed input"): every decode
//! error ends the connection, every encode error leaves it untouched.

use std::fmt;

use crate::codes::{Code, ERR_BAD_REQUEST, ERR_INTERNAL, ERR_TOO_LARGE};
use crate::error_body::ErrorBody;

/// An error from encoding or decoding a handshake or a frame.
///
/// Decode errors carry where they happened (which frame or handshake message, the byte offset
/// from the start of its length prefix or magic, and the field) so that a server log line names
/// the exact byte a broken client got wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// A length prefix (when decoding) or an encoded frame (when encoding) exceeds the limit.
    /// Raised from the 4-byte prefix alone, before anything is allocated for the body.
    #[error(
        "frame of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes; split the batch"
    )]
    FrameTooLarge {
        /// The size the prefix announced (or the encoder produced), type byte and body.
        size_bytes: u64,
        /// The limit in force.
        limit_bytes: u32,
    },
    /// A length prefix of zero: every frame has at least its type byte.
    #[error("frame with length 0 at the start of a frame; every frame has a type byte")]
    EmptyFrame,
    /// A frame type this protocol version does not define.
    #[error("unknown frame type 0x{frame_type:02x}; the peer speaks another protocol version")]
    UnknownFrameType {
        /// The type byte received.
        frame_type: u8,
    },
    /// A frame or handshake message whose bytes do not follow the spec.
    #[error("malformed {context} at byte {offset} ({field}): {problem}")]
    Malformed {
        /// The frame type name (`Publish`) or handshake message (`ClientHello`).
        context: &'static str,
        /// Offset of the bad field from the first byte of the frame's length prefix (or magic).
        offset: usize,
        /// The field that is wrong, for example `message.body`.
        field: &'static str,
        /// What is wrong with it.
        problem: Problem,
    },
    /// A value that is well-formed but violates an invariant of its type, found outside a decoder
    /// (the decoder reports the same thing as [`ProtoError::Malformed`] with its location).
    #[error("invalid {field}: {reason}")]
    InvalidValue {
        /// The field that is wrong.
        field: &'static str,
        /// Why it is wrong.
        reason: &'static str,
    },
    /// The handshake did not start with the protocol magic: the peer speaks something else.
    #[error(
        "handshake magic {found:02x?} is not KRTN; the peer does not speak the Keratin protocol"
    )]
    BadMagic {
        /// The four bytes received.
        found: [u8; 4],
    },
    /// The peer asked for a protocol version this side does not speak.
    #[error("protocol version {version} is not supported; this side speaks version {supported}")]
    UnsupportedVersion {
        /// The version the peer sent.
        version: u16,
        /// The version this side speaks.
        supported: u16,
    },
    /// When encoding: a string, byte string or list is longer than its length prefix can say.
    #[error("{field} is {size} long, more than its length prefix allows ({limit})")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Its length in bytes (strings, bodies) or items (lists).
        size: usize,
        /// The largest length the prefix can express.
        limit: usize,
    },
    /// The stream ended in the middle of a frame.
    #[error("connection closed in the middle of a frame ({buffered_bytes} bytes buffered)")]
    UnexpectedEof {
        /// Bytes of the partial frame that had arrived.
        buffered_bytes: usize,
    },
    /// The transport failed. The codec never produces this itself; `tokio_util`'s framed
    /// reader and writer pass socket errors through the codec's error type.
    #[error("transport error: {0}")]
    Io(#[from] std::io::Error),
}

/// What is wrong with a field in a [`ProtoError::Malformed`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// The field (or a count of items) extends past the end of the frame.
    Truncated,
    /// A string is not valid UTF-8.
    InvalidUtf8,
    /// A tag byte (option, bool or enum) has a value the spec does not define.
    InvalidTag(u8),
    /// The value breaks an invariant, for example a publish id range whose first id is after its last.
    InvalidValue(&'static str),
    /// Bytes remain after the last field.
    TrailingBytes(usize),
    /// A string's length is outside the bounds its field allows, for example an empty user
    /// name or a password over 1,024 bytes in a `ClientHello`.
    SizeOutOfBounds {
        /// The length the prefix announced, in bytes.
        size: usize,
        /// The shortest the field may be.
        size_min: usize,
        /// The longest the field may be.
        size_max: usize,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Truncated => f.write_str("extends past the end of the frame"),
            Problem::InvalidUtf8 => f.write_str("string is not valid UTF-8"),
            Problem::InvalidTag(tag) => write!(f, "tag {tag} is not defined"),
            Problem::InvalidValue(reason) => f.write_str(reason),
            Problem::TrailingBytes(count) => write!(f, "{count} bytes after the last field"),
            Problem::SizeOutOfBounds {
                size,
                size_min,
                size_max,
            } => write!(
                f,
                "{size} bytes long; must be {size_min} to {size_max} bytes"
            ),
        }
    }
}

impl ProtoError {
    /// The wire code a receiver answers this error with: 413 for sizes, 500 for transport
    /// failures, 400 for everything else.
    pub fn code(&self) -> Code {
        match self {
            ProtoError::FrameTooLarge { .. } | ProtoError::FieldTooLong { .. } => ERR_TOO_LARGE,
            ProtoError::Io(_) => ERR_INTERNAL,
            _ => ERR_BAD_REQUEST,
        }
    }

    /// The error body a receiver sends in its fatal `Error` frame (or refused handshake) before
    /// it closes the connection.
    pub fn to_error_body(&self) -> ErrorBody {
        ErrorBody::new(self.code(), self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_message_names_location_and_problem() {
        let error = ProtoError::Malformed {
            context: "Publish",
            offset: 23,
            field: "message.body",
            problem: Problem::Truncated,
        };
        assert_eq!(
            error.to_error_body().to_string(),
            "400 ERR_BAD_REQUEST: malformed Publish at byte 23 (message.body): \
             extends past the end of the frame"
        );
    }

    #[test]
    fn sizes_map_to_413() {
        let error = ProtoError::FrameTooLarge {
            size_bytes: 1 << 30,
            limit_bytes: 16 << 20,
        };
        assert_eq!(error.code(), ERR_TOO_LARGE);
    }
}
