//! Framing: the length prefix and type byte around every frame body, the frame size limit,
//! incremental parsing ([`Frame::check`]) and the [`FrameCodec`] for `tokio_util`'s framed I/O.
//!
//! The layout is specified in `docs/protocol.md` ("Frame header"); the offsets below are derived
//! from that table, not copied into comments. Field order inside a body belongs to `body.rs`.
//!
//! Parsing is two steps, as in mini-redis: [`Frame::check`] looks at the header only and says
//! whether a whole frame is buffered (`Incomplete` means "read more", not an error), and
//! [`Frame::decode`] then parses exactly that many bytes. An oversize length prefix is refused
//! by `check` from the prefix alone, before any buffer grows for the body.

use bytes::{BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::body::{decode_body, encode_body};
use crate::error::{Problem, ProtoError};
use crate::frame::{Frame, FrameType};
use crate::handshake::PROTOCOL_VERSION;
use crate::wire::Reader;

/// Offset of the u32 length prefix: the number of bytes after it (type byte and body).
pub const LENGTH_OFFSET: usize = 0;
/// Size of the length prefix.
pub const LENGTH_SIZE: usize = 4;
/// Offset of the u8 frame type.
pub const TYPE_OFFSET: usize = LENGTH_OFFSET + LENGTH_SIZE;
/// Size of the frame type.
pub const TYPE_SIZE: usize = 1;
/// Offset of the body: the first byte after the header.
pub const BODY_OFFSET: usize = TYPE_OFFSET + TYPE_SIZE;
/// Size of the frame header (length prefix and type byte).
pub const HEADER_SIZE: usize = BODY_OFFSET;

/// Default and protocol-wide largest value of a length prefix: 16 MiB = 16 * 1024 * 1024 bytes.
///
/// A receiver buffers at most `LENGTH_SIZE + FRAME_SIZE_BYTES_MAX` bytes of one frame per
/// connection, so this bounds a connection's read buffer; 1,000 connections each sending a full
/// frame hold 16 GiB at worst, which is why a server may configure less
/// ([`FrameCodec::with_frame_size_bytes_max`]).
/// The benchmark's window of 1,000 in-flight 1 KiB messages (about 1.02 MiB with per-message
/// overhead) fits in one frame 15 times over, and one message body can be nearly 16 MiB.
pub const FRAME_SIZE_BYTES_MAX: u32 = 16 * 1024 * 1024;

/// The smallest valid length prefix: a frame with a type byte and an empty body (`Heartbeat`).
const FRAME_SIZE_BYTES_MIN: u32 = TYPE_SIZE as u32;

const _: () = assert!(HEADER_SIZE == 5);
const _: () = assert!(FRAME_SIZE_BYTES_MIN <= FRAME_SIZE_BYTES_MAX);
// The whole frame, prefix included, must be addressable on every supported platform.
const _: () = assert!((FRAME_SIZE_BYTES_MAX as u64) + (LENGTH_SIZE as u64) <= usize::MAX as u64);

/// What [`Frame::check`] found at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameStatus {
    /// A whole frame is buffered; it is `size_bytes` long, length prefix included.
    Complete {
        /// Bytes to hand to [`Frame::decode`].
        size_bytes: usize,
    },
    /// More bytes are needed. Not an error: read more and check again.
    Incomplete,
}

impl Frame {
    /// Looks at the header at the front of `buf` and says whether a whole frame is there.
    ///
    /// Fails, without looking at the body, on a length prefix above `frame_size_bytes_max` (413),
    /// a length of zero, or a type byte [`PROTOCOL_VERSION`] does not define (400). Never
    /// allocates.
    pub fn check(buf: &[u8], frame_size_bytes_max: u32) -> Result<FrameStatus, ProtoError> {
        Frame::check_version(buf, frame_size_bytes_max, PROTOCOL_VERSION)
    }

    /// [`Frame::check`] in protocol `version`: a type byte that `version` does not define
    /// (one a later version added, such as a stream frame before version 7) is unknown.
    pub fn check_version(
        buf: &[u8],
        frame_size_bytes_max: u32,
        version: u16,
    ) -> Result<FrameStatus, ProtoError> {
        let Some(length) = buf.get(LENGTH_OFFSET..TYPE_OFFSET) else {
            return Ok(FrameStatus::Incomplete);
        };
        let mut length_bytes = [0u8; LENGTH_SIZE];
        length_bytes.copy_from_slice(length);
        let length = u32::from_le_bytes(length_bytes);
        if length > frame_size_bytes_max {
            return Err(ProtoError::FrameTooLarge {
                size_bytes: u64::from(length),
                limit_bytes: frame_size_bytes_max,
            });
        }
        if length < FRAME_SIZE_BYTES_MIN {
            return Err(ProtoError::EmptyFrame);
        }
        let Some(&type_byte) = buf.get(TYPE_OFFSET) else {
            return Ok(FrameStatus::Incomplete);
        };
        if FrameType::from_u8_in(type_byte, version).is_none() {
            return Err(ProtoError::UnknownFrameType {
                frame_type: type_byte,
            });
        }
        let size_bytes = usize::try_from(length)
            .ok()
            .and_then(|length| length.checked_add(LENGTH_SIZE))
            .ok_or(ProtoError::FrameTooLarge {
                size_bytes: u64::from(length),
                limit_bytes: frame_size_bytes_max,
            })?;
        if buf.len() < size_bytes {
            return Ok(FrameStatus::Incomplete);
        }
        Ok(FrameStatus::Complete { size_bytes })
    }

    /// Parses one whole frame, length prefix included, as [`Frame::check`] measured it.
    ///
    /// `frame` must hold exactly one frame: a length prefix that disagrees with `frame.len()` is
    /// an error, as is any field that runs past the end or any byte left over.
    pub fn decode(frame: Bytes) -> Result<Frame, ProtoError> {
        Frame::decode_version(frame, PROTOCOL_VERSION)
    }

    /// [`Frame::decode`] in protocol `version` (a field added in a later version is absent in
    /// an earlier one, and takes its default).
    pub fn decode_version(frame: Bytes, version: u16) -> Result<Frame, ProtoError> {
        let status = Frame::check_version(&frame, u32::MAX, version)?;
        let FrameStatus::Complete { size_bytes } = status else {
            return Err(ProtoError::Malformed {
                context: "frame",
                offset: frame.len(),
                field: "length",
                problem: Problem::Truncated,
            });
        };
        if size_bytes != frame.len() {
            return Err(ProtoError::Malformed {
                context: "frame",
                offset: size_bytes,
                field: "length",
                problem: Problem::TrailingBytes(frame.len() - size_bytes),
            });
        }
        let frame_type = frame
            .get(TYPE_OFFSET)
            .copied()
            .and_then(|byte| FrameType::from_u8_in(byte, version))
            .ok_or(ProtoError::EmptyFrame)?; // Unreachable: check() verified the type byte.
        let mut reader = Reader::new(frame, BODY_OFFSET, frame_type.name());
        let decoded = decode_body(frame_type, &mut reader, version)?;
        reader.finish()?;
        Ok(decoded)
    }

    /// Appends the frame, header included, to `dst`.
    ///
    /// Fails if a field is too long for its prefix or the frame would exceed
    /// `frame_size_bytes_max`; `dst` is then left as it was, so the connection stays usable.
    pub fn encode(&self, dst: &mut BytesMut, frame_size_bytes_max: u32) -> Result<(), ProtoError> {
        self.encode_version(dst, frame_size_bytes_max, PROTOCOL_VERSION)
    }

    /// [`Frame::encode`] in protocol `version`; a frame type `version` does not define, or a
    /// request's field that `version` cannot carry (set to anything but its default), is an
    /// error. A reply's field an older version lacks is left out (for example `Deliver`'s
    /// `routing_key` before version 7).
    pub fn encode_version(
        &self,
        dst: &mut BytesMut,
        frame_size_bytes_max: u32,
        version: u16,
    ) -> Result<(), ProtoError> {
        let start = dst.len();
        let result = self.encode_unchecked(dst, start, frame_size_bytes_max, version);
        if result.is_err() {
            dst.truncate(start);
        }
        result
    }

    fn encode_unchecked(
        &self,
        dst: &mut BytesMut,
        start: usize,
        frame_size_bytes_max: u32,
        version: u16,
    ) -> Result<(), ProtoError> {
        if self.frame_type().since() > version {
            return Err(ProtoError::InvalidValue {
                field: "type",
                reason: "the frame type needs a later protocol version than the connection's",
            });
        }
        dst.put_u32_le(0); // Patched below, once the body's size is known.
        dst.put_u8(self.frame_type() as u8);
        encode_body(self, dst, version)?;
        let size_bytes = dst.len() - start - LENGTH_SIZE;
        let length = u32::try_from(size_bytes)
            .ok()
            .filter(|length| *length <= frame_size_bytes_max)
            .ok_or(ProtoError::FrameTooLarge {
                size_bytes: u64::try_from(size_bytes).unwrap_or(u64::MAX),
                limit_bytes: frame_size_bytes_max,
            })?;
        let prefix = start + LENGTH_OFFSET..start + TYPE_OFFSET;
        dst[prefix].copy_from_slice(&length.to_le_bytes());
        Ok(())
    }
}

/// Encodes and decodes frames for `tokio_util::codec::{FramedRead, FramedWrite}`. Holds no I/O:
/// it only moves bytes between a buffer and [`Frame`] values.
///
/// Any decode error ends the stream (`tokio_util` stops after the first error), which matches
/// the protocol: the receiver answers a fatal `Error` and closes (`docs/protocol.md`, "Malformed
/// input").
#[derive(Debug, Clone)]
pub struct FrameCodec {
    frame_size_bytes_max: u32,
    /// The protocol version the connection agreed in its handshake.
    version: u16,
}

impl FrameCodec {
    /// A codec with the protocol's limit, [`FRAME_SIZE_BYTES_MAX`].
    pub fn new() -> FrameCodec {
        FrameCodec::with_frame_size_bytes_max(FRAME_SIZE_BYTES_MAX)
    }

    /// A codec that refuses (decoding) or will not produce (encoding) frames whose length prefix
    /// exceeds `frame_size_bytes_max`. A peer must be configured with a limit no larger than
    /// this side's, or its large frames end the connection with 413.
    ///
    /// # Panics
    /// If `frame_size_bytes_max` is below 1, the size of the smallest frame.
    pub fn with_frame_size_bytes_max(frame_size_bytes_max: u32) -> FrameCodec {
        assert!(
            frame_size_bytes_max >= FRAME_SIZE_BYTES_MIN,
            "a frame size limit below {FRAME_SIZE_BYTES_MIN} refuses every frame"
        );
        FrameCodec {
            frame_size_bytes_max,
            version: PROTOCOL_VERSION,
        }
    }

    /// This codec speaking protocol `version` (the one agreed in the handshake) instead of
    /// [`PROTOCOL_VERSION`].
    pub fn with_version(mut self, version: u16) -> FrameCodec {
        self.version = version;
        self
    }

    /// The protocol version this codec speaks.
    pub fn version(&self) -> u16 {
        self.version
    }

    /// The limit on a length prefix.
    pub fn frame_size_bytes_max(&self) -> u32 {
        self.frame_size_bytes_max
    }
}

impl Default for FrameCodec {
    fn default() -> FrameCodec {
        FrameCodec::new()
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = ProtoError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, ProtoError> {
        match Frame::check_version(src, self.frame_size_bytes_max, self.version)? {
            FrameStatus::Complete { size_bytes } => {
                let frame = src.split_to(size_bytes).freeze();
                Frame::decode_version(frame, self.version).map(Some)
            }
            // No reserve for the announced size: the buffer grows only with bytes that actually
            // arrive, so a peer that announces 16 MiB and then stalls costs its bytes, not 16 MiB.
            FrameStatus::Incomplete => Ok(None),
        }
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, ProtoError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() => Ok(None),
            None => Err(ProtoError::UnexpectedEof {
                buffered_bytes: src.len(),
            }),
        }
    }
}

impl Encoder<&Frame> for FrameCodec {
    type Error = ProtoError;

    fn encode(&mut self, frame: &Frame, dst: &mut BytesMut) -> Result<(), ProtoError> {
        frame.encode_version(dst, self.frame_size_bytes_max, self.version)
    }
}

impl Encoder<Frame> for FrameCodec {
    type Error = ProtoError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), ProtoError> {
        frame.encode_version(dst, self.frame_size_bytes_max, self.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Ack, OkReply};

    fn encoded(frame: &Frame) -> BytesMut {
        let mut dst = BytesMut::new();
        frame.encode(&mut dst, FRAME_SIZE_BYTES_MAX).unwrap();
        dst
    }

    #[test]
    fn heartbeat_is_a_bare_header() {
        assert_eq!(&encoded(&Frame::Heartbeat)[..], &[1, 0, 0, 0, 0xf0]);
    }

    #[test]
    fn check_waits_for_the_whole_frame() {
        let bytes = encoded(&Frame::Ok(OkReply { request_id: 7 }));
        for cut in 0..bytes.len() {
            assert_eq!(
                Frame::check(&bytes[..cut], FRAME_SIZE_BYTES_MAX).unwrap(),
                FrameStatus::Incomplete
            );
        }
        let status = Frame::check(&bytes, FRAME_SIZE_BYTES_MAX).unwrap();
        assert_eq!(status, FrameStatus::Complete { size_bytes: 13 });
    }

    #[test]
    fn oversize_prefix_is_refused_from_four_bytes() {
        let prefix = (FRAME_SIZE_BYTES_MAX + 1).to_le_bytes();
        let error = Frame::check(&prefix, FRAME_SIZE_BYTES_MAX).unwrap_err();
        assert_eq!(error.code(), crate::codes::ERR_TOO_LARGE);
        let mut codec = FrameCodec::with_frame_size_bytes_max(64);
        let mut src = BytesMut::from(&65u32.to_le_bytes()[..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(ProtoError::FrameTooLarge { .. })
        ));
        assert!(src.capacity() < 64, "no buffer grew for the refused frame");
    }

    #[test]
    fn zero_length_and_unknown_type_are_refused_early() {
        assert!(matches!(
            Frame::check(&[0, 0, 0, 0], FRAME_SIZE_BYTES_MAX),
            Err(ProtoError::EmptyFrame)
        ));
        assert!(matches!(
            Frame::check(&[200, 0, 0, 0, 0x7e], FRAME_SIZE_BYTES_MAX),
            Err(ProtoError::UnknownFrameType { frame_type: 0x7e })
        ));
    }

    #[test]
    fn encode_over_the_limit_leaves_dst_untouched() {
        let frame = Frame::Ack(Ack {
            delivery_ids: vec![1; 100],
        });
        let mut dst = BytesMut::from(&b"xy"[..]);
        let error = frame.encode(&mut dst, 64).unwrap_err();
        assert!(matches!(error, ProtoError::FrameTooLarge { .. }));
        assert_eq!(&dst[..], b"xy");
    }

    #[test]
    fn trailing_bytes_inside_a_frame_are_refused() {
        let mut bytes = encoded(&Frame::Ok(OkReply { request_id: 7 })).to_vec();
        bytes[0] += 1;
        bytes.push(0);
        let error = Frame::decode(Bytes::from(bytes)).unwrap_err();
        assert!(matches!(
            error,
            ProtoError::Malformed {
                problem: Problem::TrailingBytes(1),
                offset: 13,
                ..
            }
        ));
    }

    #[test]
    fn eof_mid_frame_is_reported() {
        let mut codec = FrameCodec::new();
        let mut src = BytesMut::from(&[5u8, 0, 0][..]);
        assert!(matches!(
            codec.decode_eof(&mut src),
            Err(ProtoError::UnexpectedEof { buffered_bytes: 3 })
        ));
    }
}
