//! The versioned handshake that opens every connection, before any frame.
//!
//! Owns the magic, the protocol version and the accept/refuse answer. The layout is specified in
//! `docs/protocol.md` ("Handshake"); the offsets below are derived from that table. Frames after
//! the handshake belong to [`crate::codec`].
//!
//! The client sends a [`ClientHello`] and waits; the server answers with a [`ServerHello`]. If
//! the server refuses (another version, a bad magic), it closes the connection after the answer.
//! A server that receives bytes that are not `KRTN` closes without answering: the peer does not
//! speak this protocol and would not understand the answer.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::body::{put_error_body, read_error_body};
use crate::error::{Problem, ProtoError};
use crate::error_body::ErrorBody;
use crate::wire::{put_string, Reader};

/// The protocol version this crate speaks. See `docs/protocol.md`, "Version changes".
pub const PROTOCOL_VERSION: u16 = 2;

/// The oldest protocol version a server still accepts: version 1 differs only in `Subscribe`,
/// which has no `prefetch_bytes` (see `docs/protocol.md`, "Version changes").
pub const PROTOCOL_VERSION_MIN: u16 = 1;

/// The four bytes that open both hello messages.
pub const MAGIC: [u8; 4] = *b"KRTN";

/// Offset of the magic in both hellos.
pub const MAGIC_OFFSET: usize = 0;
/// Size of the magic.
pub const MAGIC_SIZE: usize = MAGIC.len();
/// Offset of the u16 protocol version in both hellos.
pub const VERSION_OFFSET: usize = MAGIC_OFFSET + MAGIC_SIZE;
/// Size of the protocol version.
pub const VERSION_SIZE: usize = 2;
/// Offset of the client name (u16-prefixed string) in a `ClientHello`.
pub const CLIENT_NAME_OFFSET: usize = VERSION_OFFSET + VERSION_SIZE;
/// Offset of the u8 status in a `ServerHello`: 0 accepted, 1 refused.
pub const STATUS_OFFSET: usize = VERSION_OFFSET + VERSION_SIZE;
/// Size of the status.
pub const STATUS_SIZE: usize = 1;
/// Offset of the node id (accepted) or error body (refused) in a `ServerHello`.
pub const SERVER_DETAIL_OFFSET: usize = STATUS_OFFSET + STATUS_SIZE;

/// Largest `ClientHello`: magic, version and a name of 65,535 bytes behind its u16 length.
pub const CLIENT_HELLO_SIZE_MAX: usize = CLIENT_NAME_OFFSET + 2 + u16::MAX as usize;
/// Largest `ServerHello`: a refusal whose error body has a reason and a message of 65,535 bytes
/// each: code 2, reason 1 + 2 + 65,535, retry hint 1 + 4, message 2 + 65,535.
pub const SERVER_HELLO_SIZE_MAX: usize =
    SERVER_DETAIL_OFFSET + 2 + (1 + 2 + u16::MAX as usize) + (1 + 4) + (2 + u16::MAX as usize);

const STATUS_ACCEPTED: u8 = 0;
const STATUS_REFUSED: u8 = 1;
const STATUS_COUNT: u8 = 2;

/// The first message on a connection, from the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The protocol version the client speaks.
    pub version: u16,
    /// Names the client in server logs, for example `keratin-cli 0.1.0`.
    pub client_name: String,
}

/// The server's answer to a [`ClientHello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerHello {
    /// Frames may follow, in `version`.
    Accepted {
        /// The version both sides now speak.
        version: u16,
        /// Names the server node, for example in logs and metrics.
        node_id: String,
    },
    /// The server closes the connection after this answer.
    Refused {
        /// The version the server speaks, so the client can say which one it needs.
        version: u16,
        /// Why; a 400 for an unsupported version.
        error: ErrorBody,
    },
}

impl ClientHello {
    /// A hello for this crate's [`PROTOCOL_VERSION`].
    pub fn new(client_name: impl Into<String>) -> ClientHello {
        ClientHello {
            version: PROTOCOL_VERSION,
            client_name: client_name.into(),
        }
    }

    /// Appends the hello to `dst`; fails (leaving `dst` as it was) on a name over 65,535 bytes.
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), ProtoError> {
        let start = dst.len();
        dst.put_slice(&MAGIC);
        dst.put_u16_le(self.version);
        put_string(dst, "client_name", &self.client_name).inspect_err(|_| dst.truncate(start))
    }

    /// Takes a whole hello from the front of `src`, or returns `None` if more bytes are needed.
    /// A wrong magic fails as soon as four bytes are present.
    pub fn decode(src: &mut BytesMut) -> Result<Option<ClientHello>, ProtoError> {
        decode_incremental(src, "ClientHello", CLIENT_HELLO_SIZE_MAX, |r| {
            Ok(ClientHello {
                version: read_magic_and_version(r)?,
                client_name: r.string("client_name")?,
            })
        })
    }
}

impl ServerHello {
    /// The server's answer to `hello`: accepted in the client's version if it is from
    /// [`PROTOCOL_VERSION_MIN`] to [`PROTOCOL_VERSION`], else refused with a 400 that names
    /// both versions.
    pub fn answer(hello: &ClientHello, node_id: impl Into<String>) -> ServerHello {
        if (PROTOCOL_VERSION_MIN..=PROTOCOL_VERSION).contains(&hello.version) {
            return ServerHello::Accepted {
                version: hello.version,
                node_id: node_id.into(),
            };
        }
        let error = ProtoError::UnsupportedVersion {
            version: hello.version,
            supported: PROTOCOL_VERSION,
        };
        ServerHello::Refused {
            version: PROTOCOL_VERSION,
            error: error.to_error_body(),
        }
    }

    /// Appends the answer to `dst`; fails (leaving `dst` as it was) on an overlong string.
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), ProtoError> {
        let start = dst.len();
        dst.put_slice(&MAGIC);
        let result = match self {
            ServerHello::Accepted { version, node_id } => {
                dst.put_u16_le(*version);
                dst.put_u8(STATUS_ACCEPTED);
                put_string(dst, "node_id", node_id)
            }
            ServerHello::Refused { version, error } => {
                dst.put_u16_le(*version);
                dst.put_u8(STATUS_REFUSED);
                put_error_body(dst, error)
            }
        };
        result.inspect_err(|_| dst.truncate(start))
    }

    /// Takes a whole answer from the front of `src`, or returns `None` if more bytes are needed.
    pub fn decode(src: &mut BytesMut) -> Result<Option<ServerHello>, ProtoError> {
        decode_incremental(src, "ServerHello", SERVER_HELLO_SIZE_MAX, |r| {
            let version = read_magic_and_version(r)?;
            match r.tag("status", STATUS_COUNT)? {
                STATUS_ACCEPTED => Ok(ServerHello::Accepted {
                    version,
                    node_id: r.string("node_id")?,
                }),
                _ => Ok(ServerHello::Refused {
                    version,
                    error: read_error_body(r)?,
                }),
            }
        })
    }
}

fn read_magic_and_version(r: &mut Reader) -> Result<u16, ProtoError> {
    let found = r.magic("magic")?;
    if found != MAGIC {
        return Err(ProtoError::BadMagic { found });
    }
    r.u16("version")
}

/// Runs `read` over the buffered bytes, at most `size_max` of them. A hello has no length
/// prefix, but every field in it is self-delimiting and bounded (u16-prefixed strings), so "ran
/// past the end of the buffer" means "read more", and a hello never needs more than `size_max`.
fn decode_incremental<T>(
    src: &mut BytesMut,
    context: &'static str,
    size_max: usize,
    read: impl FnOnce(&mut Reader) -> Result<T, ProtoError>,
) -> Result<Option<T>, ProtoError> {
    if src.len() < MAGIC_SIZE {
        // Refuse a wrong magic as soon as its first bytes disagree.
        if !MAGIC.starts_with(src) {
            let mut found = [0u8; MAGIC_SIZE];
            found[..src.len()].copy_from_slice(src);
            return Err(ProtoError::BadMagic { found });
        }
        return Ok(None);
    }
    // Copy no more than one hello: frames pipelined behind it stay in `src`.
    let candidate = &src[..src.len().min(size_max)];
    let mut reader = Reader::new(Bytes::copy_from_slice(candidate), MAGIC_OFFSET, context);
    match read(&mut reader) {
        Ok(hello) => {
            src.advance(reader.position());
            Ok(Some(hello))
        }
        Err(ProtoError::Malformed {
            problem: Problem::Truncated,
            ..
        }) => Ok(None),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::ERR_BAD_REQUEST;

    #[test]
    fn client_hello_layout_and_roundtrip() {
        let mut dst = BytesMut::new();
        ClientHello::new("cli").encode(&mut dst).unwrap();
        assert_eq!(&dst[..], b"KRTN\x02\x00\x03\x00cli");
        for cut in 0..dst.len() {
            let mut partial = BytesMut::from(&dst[..cut]);
            assert_eq!(ClientHello::decode(&mut partial).unwrap(), None);
        }
        dst.put_u8(0xf0); // The first byte of the next frame stays buffered.
        let hello = ClientHello::decode(&mut dst).unwrap().unwrap();
        assert_eq!(hello, ClientHello::new("cli"));
        assert_eq!(&dst[..], &[0xf0]);
    }

    #[test]
    fn wrong_magic_fails_at_the_first_wrong_byte() {
        let mut src = BytesMut::from(&b"GE"[..]);
        assert!(matches!(
            ClientHello::decode(&mut src),
            Err(ProtoError::BadMagic { .. })
        ));
    }

    #[test]
    fn server_refuses_other_versions() {
        let hello = ClientHello {
            version: 9,
            client_name: "future".into(),
        };
        let answer = ServerHello::answer(&hello, "node-1");
        let ServerHello::Refused { version, error } = &answer else {
            panic!("expected a refusal, got {answer:?}");
        };
        assert_eq!(*version, PROTOCOL_VERSION);
        assert_eq!(error.code(), ERR_BAD_REQUEST);
        let mut dst = BytesMut::new();
        answer.encode(&mut dst).unwrap();
        assert_eq!(ServerHello::decode(&mut dst).unwrap(), Some(answer));
        assert!(dst.is_empty());
    }

    #[test]
    fn largest_hellos_fit_their_bounds() {
        let hello = ClientHello::new("n".repeat(usize::from(u16::MAX)));
        let mut dst = BytesMut::new();
        hello.encode(&mut dst).unwrap();
        assert_eq!(dst.len(), CLIENT_HELLO_SIZE_MAX);
        let long = "m".repeat(usize::from(u16::MAX));
        let error = ErrorBody::limited(crate::LimitReason::Unknown(long.clone()), 1, long);
        let answer = ServerHello::Refused { version: 1, error };
        let mut dst = BytesMut::new();
        answer.encode(&mut dst).unwrap();
        assert_eq!(dst.len(), SERVER_HELLO_SIZE_MAX);
        assert_eq!(ServerHello::decode(&mut dst).unwrap(), Some(answer));
    }

    #[test]
    fn server_accepts_its_version() {
        let answer = ServerHello::answer(&ClientHello::new("cli"), "node-1");
        let mut dst = BytesMut::new();
        answer.encode(&mut dst).unwrap();
        assert_eq!(&dst[..], b"KRTN\x02\x00\x00\x06\x00node-1");
        assert_eq!(ServerHello::decode(&mut dst).unwrap(), Some(answer));
    }
}
