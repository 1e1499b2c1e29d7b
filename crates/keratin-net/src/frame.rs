//! Frames after the handshake: the [`Frame`] enum, its type numbers, the length-prefixed header,
//! [`Frame::check`] (is a whole frame buffered?) and [`Frame::decode`] / [`Frame::encode`].
//!
//! The layout is specified in `docs/cluster-protocol.md` ("Frame header", "Frames"); the offsets
//! below are derived from those tables. Parsing is two steps as in `keratin-proto`: `check` reads
//! the header only and refuses an oversize length before any buffer grows for the body; `decode`
//! then parses exactly one frame. No input makes either panic.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{FrameError, RemoteError};
use crate::wire::{put_bytes, put_string, string_size, Reader};
use crate::GroupId;

/// Offset of the u32 length prefix (bytes after it: the type byte and the body).
pub const LENGTH_OFFSET: usize = 0;
/// Size of the length prefix.
pub const LENGTH_SIZE: usize = 4;
/// Offset of the u8 frame type.
pub const TYPE_OFFSET: usize = LENGTH_OFFSET + LENGTH_SIZE;
/// Offset of the body.
pub const BODY_OFFSET: usize = TYPE_OFFSET + 1;
/// Size of the frame header (length prefix and type byte).
pub const HEADER_SIZE: usize = BODY_OFFSET;

/// Default and largest frame size limit (the value of `length`): 16 MiB + 64 KiB. One Raft
/// append carrying a single entry must fit however large the entry, and the largest entry holds
/// the largest message of a client frame (16 MiB) plus its record and entry headers; a
/// snapshot sent whole must fit too.
pub const FRAME_SIZE_BYTES_MAX: u32 = (16 << 20) + (64 << 10);

/// Fixed fields of a `Request` body: request_id u64, group u64, kind u8.
const REQUEST_FIXED_SIZE: usize = 8 + 8 + 1;
/// Fixed fields of a `Response` body: request_id u64.
const RESPONSE_FIXED_SIZE: usize = 8;
/// Smallest heartbeat entry: group u64 and an empty `bytes` (u32 length).
const HEARTBEAT_ENTRY_SIZE_MIN: usize = 8 + 4;
/// Smallest heartbeat reply entry: group u64, status u8, an empty `bytes`.
const HEARTBEAT_REPLY_SIZE_MIN: usize = 8 + 1 + 4;

const _: () = assert!(HEADER_SIZE == 5);
const _: () = assert!((FRAME_SIZE_BYTES_MAX as u64) + (LENGTH_SIZE as u64) <= usize::MAX as u64);

/// The longest node label ([`Frame::Label`]): a node's levels per file system and memory take a
/// few hundred bytes; the bound keeps a peer from making every other node hold megabytes.
pub const LABEL_BYTES_MAX: usize = 64 * 1024;

/// Type numbers of protocol version 1 (and 2, which adds `LABEL`). They never change meaning.
mod types {
    pub const REQUEST: u8 = 0x01;
    pub const RESPONSE: u8 = 0x02;
    pub const REFUSAL: u8 = 0x03;
    pub const HEARTBEAT_BATCH: u8 = 0x10;
    pub const HEARTBEAT_REPLIES: u8 = 0x11;
    pub const PING: u8 = 0x20;
    pub const PONG: u8 = 0x21;
    /// Protocol version 2.
    pub const LABEL: u8 = 0x22;
    pub const ERROR: u8 = 0x30;
}

/// One frame of cluster protocol versions 1 and 2 (`Label` is version 2's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A call to the receiver's handler. Answered by `Response` or `Refusal` with the same id.
    Request {
        /// Chosen by the caller, unique among its outstanding requests on the connection.
        request_id: u64,
        /// The Raft group (or 0 for node-level requests); the transport never interprets it.
        group: GroupId,
        /// The request kind; the transport never interprets it.
        kind: u8,
        /// The request payload.
        body: Bytes,
    },
    /// A handler's reply.
    Response {
        /// The request's id.
        request_id: u64,
        /// The reply payload.
        body: Bytes,
    },
    /// A handler's (or the receiving transport's) refusal of a request.
    Refusal {
        /// The request's id.
        request_id: u64,
        /// Why.
        error: RemoteError,
    },
    /// Every pending group heartbeat for the receiver, coalesced into one frame.
    HeartbeatBatch {
        /// Chosen by the sender; the reply echoes it.
        batch_id: u64,
        /// One payload per group; a group appears at most once.
        entries: Vec<(GroupId, Bytes)>,
    },
    /// The per-group replies to one `HeartbeatBatch`.
    HeartbeatReplies {
        /// The batch's id.
        batch_id: u64,
        /// A reply or a refusal per group.
        replies: Vec<(GroupId, Result<Bytes, RemoteError>)>,
    },
    /// Liveness probe; answered by `Pong` with the same nonce.
    Ping {
        /// Opaque to the receiver (the sender's clock, for the round-trip estimate).
        nonce: u64,
    },
    /// Answer to `Ping`.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// The sender's node label (protocol version 2): opaque to the transport, at most
    /// [`LABEL_BYTES_MAX`] bytes, the newest replaces any earlier one. Sent after the handshake,
    /// whenever it changes and with every ping.
    Label {
        /// The label.
        label: Bytes,
    },
    /// A fatal error; the sender closes the connection after it.
    Error(RemoteError),
}

/// An encoded frame: `head` holds the header and fixed fields, `tail` the payload of a
/// `Request` or `Response` (shared with the caller's buffer, not copied), empty otherwise.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// Header and every field before the payload.
    pub head: Bytes,
    /// The payload, written right after `head`.
    pub tail: Bytes,
}

impl Encoded {
    /// Bytes on the wire, length prefix included.
    pub fn size_bytes(&self) -> usize {
        self.head.len() + self.tail.len()
    }
}

impl Frame {
    /// The frame's name, as in the spec.
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Request { .. } => "Request",
            Frame::Response { .. } => "Response",
            Frame::Refusal { .. } => "Refusal",
            Frame::HeartbeatBatch { .. } => "HeartbeatBatch",
            Frame::HeartbeatReplies { .. } => "HeartbeatReplies",
            Frame::Ping { .. } => "Ping",
            Frame::Pong { .. } => "Pong",
            Frame::Label { .. } => "Label",
            Frame::Error(_) => "Error",
        }
    }

    /// Looks at the header at the front of `buf`: `Ok(Some(size))` when a whole frame of `size`
    /// bytes (prefix included) is buffered, `Ok(None)` when more bytes are needed.
    ///
    /// Fails from the header alone on a length above `frame_size_bytes_max`, a length of zero
    /// or an unknown type byte. Never allocates.
    pub fn check(buf: &[u8], frame_size_bytes_max: u32) -> Result<Option<usize>, FrameError> {
        let Some(length) = buf.get(LENGTH_OFFSET..TYPE_OFFSET) else {
            return Ok(None);
        };
        let mut length_bytes = [0u8; LENGTH_SIZE];
        length_bytes.copy_from_slice(length);
        let length = u32::from_le_bytes(length_bytes);
        if length > frame_size_bytes_max {
            return Err(FrameError::TooLarge {
                size_bytes: u64::from(length),
                limit_bytes: frame_size_bytes_max,
            });
        }
        if length == 0 {
            return Err(FrameError::ZeroLength);
        }
        let Some(&frame_type) = buf.get(TYPE_OFFSET) else {
            return Ok(None);
        };
        if type_name(frame_type).is_none() {
            return Err(FrameError::UnknownType(frame_type));
        }
        // length <= FRAME_SIZE_BYTES_MAX, so this fits (asserted above).
        let size = LENGTH_SIZE + length as usize;
        Ok((buf.len() >= size).then_some(size))
    }

    /// Size the frame at the front of `buf` will have, once its length prefix is buffered:
    /// how much to reserve before reading its body. `None` before the prefix arrives.
    pub fn pending_size(buf: &[u8]) -> Option<usize> {
        let length = buf.get(LENGTH_OFFSET..TYPE_OFFSET)?;
        let mut length_bytes = [0u8; LENGTH_SIZE];
        length_bytes.copy_from_slice(length);
        usize::try_from(u32::from_le_bytes(length_bytes))
            .ok()?
            .checked_add(LENGTH_SIZE)
    }

    /// Parses exactly one frame, prefix included, as found by [`Frame::check`].
    pub fn decode(frame: Bytes) -> Result<Frame, FrameError> {
        let size = Frame::check(&frame, u32::MAX)?.ok_or(FrameError::Malformed {
            frame: "frame",
            reason: "shorter than its length prefix",
        })?;
        if size != frame.len() {
            return Err(FrameError::Malformed {
                frame: "frame",
                reason: "longer than its length prefix",
            });
        }
        let frame_type = frame[TYPE_OFFSET];
        let name = type_name(frame_type).ok_or(FrameError::UnknownType(frame_type))?;
        let mut body = Reader::new(frame.slice(BODY_OFFSET..), name);
        let decoded = decode_body(frame_type, &mut body)?;
        body.finish()?;
        Ok(decoded)
    }

    /// Encodes the frame. The caller checks [`Encoded::size_bytes`] against its frame size
    /// limit before sending; the length prefix saturates rather than wraps.
    pub fn encode(&self) -> Encoded {
        let (fixed_size, tail) = match self {
            Frame::Request { body, .. } => (REQUEST_FIXED_SIZE, body.clone()),
            Frame::Response { body, .. } => (RESPONSE_FIXED_SIZE, body.clone()),
            _ => (0, Bytes::new()),
        };
        let mut head = BytesMut::with_capacity(HEADER_SIZE + fixed_size.max(64));
        head.put_u32_le(0);
        head.put_u8(self.type_byte());
        self.encode_fields(&mut head);
        let length = head.len() - LENGTH_SIZE + tail.len();
        let length = u32::try_from(length).unwrap_or(u32::MAX);
        head[LENGTH_OFFSET..TYPE_OFFSET].copy_from_slice(&length.to_le_bytes());
        Encoded {
            head: head.freeze(),
            tail,
        }
    }

    /// Encoded size, prefix included, without encoding.
    pub fn size_bytes(&self) -> usize {
        let body = match self {
            Frame::Request { body, .. } => REQUEST_FIXED_SIZE + body.len(),
            Frame::Response { body, .. } => RESPONSE_FIXED_SIZE + body.len(),
            Frame::Refusal { error, .. } => 8 + 2 + string_size(&error.message),
            Frame::HeartbeatBatch { entries, .. } => {
                8 + 4 + entries.iter().map(|(_, p)| 12 + p.len()).sum::<usize>()
            }
            Frame::HeartbeatReplies { replies, .. } => {
                8 + 4 + replies.iter().map(|(_, r)| reply_size(r)).sum::<usize>()
            }
            Frame::Ping { .. } | Frame::Pong { .. } => 8,
            Frame::Label { label } => label.len(),
            Frame::Error(error) => 2 + string_size(&error.message),
        };
        HEADER_SIZE + body
    }

    fn type_byte(&self) -> u8 {
        match self {
            Frame::Request { .. } => types::REQUEST,
            Frame::Response { .. } => types::RESPONSE,
            Frame::Refusal { .. } => types::REFUSAL,
            Frame::HeartbeatBatch { .. } => types::HEARTBEAT_BATCH,
            Frame::HeartbeatReplies { .. } => types::HEARTBEAT_REPLIES,
            Frame::Ping { .. } => types::PING,
            Frame::Pong { .. } => types::PONG,
            Frame::Label { .. } => types::LABEL,
            Frame::Error(_) => types::ERROR,
        }
    }

    fn encode_fields(&self, buf: &mut BytesMut) {
        match self {
            Frame::Request {
                request_id,
                group,
                kind,
                ..
            } => {
                buf.put_u64_le(*request_id);
                buf.put_u64_le(group.0);
                buf.put_u8(*kind);
            }
            Frame::Response { request_id, .. } => buf.put_u64_le(*request_id),
            Frame::Refusal { request_id, error } => {
                buf.put_u64_le(*request_id);
                put_error(buf, error);
            }
            Frame::HeartbeatBatch { batch_id, entries } => {
                buf.put_u64_le(*batch_id);
                buf.put_u32_le(u32::try_from(entries.len()).unwrap_or(u32::MAX));
                for (group, payload) in entries {
                    buf.put_u64_le(group.0);
                    put_bytes(buf, payload);
                }
            }
            Frame::HeartbeatReplies { batch_id, replies } => {
                buf.put_u64_le(*batch_id);
                buf.put_u32_le(u32::try_from(replies.len()).unwrap_or(u32::MAX));
                for (group, reply) in replies {
                    buf.put_u64_le(group.0);
                    put_reply(buf, reply);
                }
            }
            Frame::Ping { nonce } | Frame::Pong { nonce } => buf.put_u64_le(*nonce),
            Frame::Label { label } => buf.put_slice(label),
            Frame::Error(error) => put_error(buf, error),
        }
    }
}

fn type_name(frame_type: u8) -> Option<&'static str> {
    Some(match frame_type {
        types::REQUEST => "Request",
        types::RESPONSE => "Response",
        types::REFUSAL => "Refusal",
        types::HEARTBEAT_BATCH => "HeartbeatBatch",
        types::HEARTBEAT_REPLIES => "HeartbeatReplies",
        types::PING => "Ping",
        types::PONG => "Pong",
        types::LABEL => "Label",
        types::ERROR => "Error",
        _ => return None,
    })
}

fn decode_body(frame_type: u8, body: &mut Reader) -> Result<Frame, FrameError> {
    Ok(match frame_type {
        types::REQUEST => Frame::Request {
            request_id: body.u64()?,
            group: GroupId(body.u64()?),
            kind: body.u8()?,
            body: body.rest(),
        },
        types::RESPONSE => Frame::Response {
            request_id: body.u64()?,
            body: body.rest(),
        },
        types::REFUSAL => Frame::Refusal {
            request_id: body.u64()?,
            error: read_error(body)?,
        },
        types::HEARTBEAT_BATCH => decode_heartbeat_batch(body)?,
        types::HEARTBEAT_REPLIES => decode_heartbeat_replies(body)?,
        types::PING => Frame::Ping { nonce: body.u64()? },
        types::PONG => Frame::Pong { nonce: body.u64()? },
        types::LABEL => {
            let label = body.rest();
            if label.len() > LABEL_BYTES_MAX {
                return Err(body.malformed("label longer than LABEL_BYTES_MAX"));
            }
            Frame::Label { label }
        }
        types::ERROR => Frame::Error(read_error(body)?),
        other => return Err(FrameError::UnknownType(other)),
    })
}

/// Reads a count and checks that `count` entries of at least `entry_size_min` bytes fit in what
/// is left, before anything is allocated for them.
fn read_count(body: &mut Reader, entry_size_min: usize) -> Result<usize, FrameError> {
    let count = usize::try_from(body.u32()?).map_err(|_| body.malformed("count too large"))?;
    match count.checked_mul(entry_size_min) {
        Some(size) if size <= body.remaining() => Ok(count),
        _ => Err(body.malformed("count larger than the frame can hold")),
    }
}

fn decode_heartbeat_batch(body: &mut Reader) -> Result<Frame, FrameError> {
    let batch_id = body.u64()?;
    let count = read_count(body, HEARTBEAT_ENTRY_SIZE_MIN)?;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        entries.push((GroupId(body.u64()?), body.bytes()?));
    }
    Ok(Frame::HeartbeatBatch { batch_id, entries })
}

fn decode_heartbeat_replies(body: &mut Reader) -> Result<Frame, FrameError> {
    let batch_id = body.u64()?;
    let count = read_count(body, HEARTBEAT_REPLY_SIZE_MIN)?;
    let mut replies = Vec::with_capacity(count);
    for _ in 0..count {
        let group = GroupId(body.u64()?);
        let reply = match body.u8()? {
            0 => Ok(body.bytes()?),
            1 => Err(read_error(body)?),
            _ => return Err(body.malformed("reply status is neither 0 nor 1")),
        };
        replies.push((group, reply));
    }
    Ok(Frame::HeartbeatReplies { batch_id, replies })
}

fn read_error(body: &mut Reader) -> Result<RemoteError, FrameError> {
    Ok(RemoteError {
        code: body.u16()?,
        message: body.string()?,
    })
}

fn put_error(buf: &mut BytesMut, error: &RemoteError) {
    buf.put_u16_le(error.code);
    put_string(buf, &error.message);
}

fn put_reply(buf: &mut BytesMut, reply: &Result<Bytes, RemoteError>) {
    match reply {
        Ok(payload) => {
            buf.put_u8(0);
            put_bytes(buf, payload);
        }
        Err(error) => {
            buf.put_u8(1);
            put_error(buf, error);
        }
    }
}

fn reply_size(reply: &Result<Bytes, RemoteError>) -> usize {
    8 + 1
        + match reply {
            Ok(payload) => 4 + payload.len(),
            Err(error) => 2 + string_size(&error.message),
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(frame: Frame) {
        let encoded = frame.encode();
        assert_eq!(encoded.size_bytes(), frame.size_bytes(), "{frame:?}");
        let mut wire = BytesMut::new();
        wire.put_slice(&encoded.head);
        wire.put_slice(&encoded.tail);
        let size = Frame::check(&wire, FRAME_SIZE_BYTES_MAX).unwrap();
        assert_eq!(size, Some(wire.len()));
        assert_eq!(
            Frame::check(&wire[..wire.len() - 1], FRAME_SIZE_BYTES_MAX).unwrap(),
            None
        );
        assert_eq!(Frame::decode(wire.freeze()).unwrap(), frame);
    }

    #[test]
    fn every_frame_roundtrips() {
        let error = RemoteError::new(1001, "no room: disk at reserve");
        roundtrip(Frame::Request {
            request_id: 7,
            group: GroupId(42),
            kind: 3,
            body: Bytes::from_static(b"append"),
        });
        roundtrip(Frame::Response {
            request_id: 7,
            body: Bytes::new(),
        });
        roundtrip(Frame::Refusal {
            request_id: 9,
            error: error.clone(),
        });
        roundtrip(Frame::HeartbeatBatch {
            batch_id: 1,
            entries: vec![
                (GroupId(1), Bytes::from_static(b"a")),
                (GroupId(2), Bytes::new()),
            ],
        });
        roundtrip(Frame::HeartbeatReplies {
            batch_id: 1,
            replies: vec![
                (GroupId(1), Ok(Bytes::from_static(b"ok"))),
                (GroupId(2), Err(error.clone())),
            ],
        });
        roundtrip(Frame::Ping { nonce: 5 });
        roundtrip(Frame::Pong { nonce: 5 });
        roundtrip(Frame::Label {
            label: Bytes::from_static(b"{\"level\":\"normal\"}"),
        });
        roundtrip(Frame::Label {
            label: Bytes::new(),
        });
        roundtrip(Frame::Error(error));
    }

    #[test]
    fn a_label_over_the_limit_is_malformed() {
        let frame = Frame::Label {
            label: Bytes::from(vec![b'x'; LABEL_BYTES_MAX + 1]),
        };
        let encoded = frame.encode();
        let mut wire = BytesMut::new();
        wire.put_slice(&encoded.head);
        wire.put_slice(&encoded.tail);
        assert!(matches!(
            Frame::decode(wire.freeze()),
            Err(FrameError::Malformed { frame: "Label", .. })
        ));
    }

    #[test]
    fn request_bytes_match_the_spec_example() {
        // docs/cluster-protocol.md, "Examples": request 1, group 7, kind 2, body "hi".
        let frame = Frame::Request {
            request_id: 1,
            group: GroupId(7),
            kind: 2,
            body: Bytes::from_static(b"hi"),
        };
        let encoded = frame.encode();
        let mut wire = encoded.head.to_vec();
        wire.extend_from_slice(&encoded.tail);
        let expected: Vec<u8> = vec![
            0x14, 0, 0, 0,    // length 20 = 1 + 17 + 2
            0x01, // Request
            1, 0, 0, 0, 0, 0, 0, 0, // request_id
            7, 0, 0, 0, 0, 0, 0, 0, // group
            2, // kind
            b'h', b'i',
        ];
        assert_eq!(wire, expected);
    }

    #[test]
    fn heartbeat_batch_bytes_match_the_spec_example() {
        // docs/cluster-protocol.md, "Examples": batch 9, group 3 -> "a", group 4 -> empty.
        let frame = Frame::HeartbeatBatch {
            batch_id: 9,
            entries: vec![
                (GroupId(3), Bytes::from_static(b"a")),
                (GroupId(4), Bytes::new()),
            ],
        };
        let encoded = frame.encode();
        assert!(encoded.tail.is_empty());
        let expected: Vec<u8> = vec![
            0x26, 0, 0, 0,    // length 38
            0x10, // HeartbeatBatch
            9, 0, 0, 0, 0, 0, 0, 0, // batch_id
            2, 0, 0, 0, // count
            3, 0, 0, 0, 0, 0, 0, 0, // group 3
            1, 0, 0, 0, b'a', // payload
            4, 0, 0, 0, 0, 0, 0, 0, // group 4
            0, 0, 0, 0, // empty payload
        ];
        assert_eq!(&encoded.head[..], &expected[..]);
    }

    #[test]
    fn oversize_length_is_refused_from_the_prefix_alone() {
        let prefix = (FRAME_SIZE_BYTES_MAX + 1).to_le_bytes();
        assert!(matches!(
            Frame::check(&prefix, FRAME_SIZE_BYTES_MAX),
            Err(FrameError::TooLarge { .. })
        ));
        assert_eq!(
            Frame::check(&[0, 0, 0, 0], 100),
            Err(FrameError::ZeroLength)
        );
        assert_eq!(
            Frame::check(&[1, 0, 0, 0, 0xee], 100),
            Err(FrameError::UnknownType(0xee))
        );
    }

    #[test]
    fn a_count_larger_than_the_frame_is_refused_before_allocation() {
        let mut wire = BytesMut::new();
        wire.put_u32_le(1 + 8 + 4);
        wire.put_u8(types::HEARTBEAT_BATCH);
        wire.put_u64_le(1);
        wire.put_u32_le(u32::MAX);
        assert!(matches!(
            Frame::decode(wire.freeze()),
            Err(FrameError::Malformed { .. })
        ));
    }
}
