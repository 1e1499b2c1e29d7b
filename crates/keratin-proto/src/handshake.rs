//! The versioned handshake that opens every connection, before any frame.
//!
//! Owns the magic, the protocol version and the accept/refuse answer. The layout is specified in
//! `docs/protocol.md` ("Handshake"); the offsets below are derived from that table. Frames after
//! the handshake belong to [`crate::codec`].
//!
//! The client sends a [`ClientHello`] and waits; the server answers with a [`ServerHello`]. If
//! the server refuses (another version, a failed login), it closes the connection after the
//! answer. From version 6 the hello carries the client's login ([`Auth`], in `auth.rs`) and the
//! accepted answer the user the server logged the connection in as.
//! A server that receives bytes that are not `KRTN` closes without answering: the peer does not
//! speak this protocol and would not understand the answer.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::auth::{put_auth, read_auth, Auth, AUTH_SIZE_MAX};
use crate::body::{put_error_body, read_error_body};
use crate::error::{Problem, ProtoError};
use crate::error_body::ErrorBody;
use crate::wire::{put_count_u16, put_option, put_string, Reader};

/// The protocol version this crate speaks. See `docs/protocol.md`, "Version changes".
pub const PROTOCOL_VERSION: u16 = 7;

/// The protocol version of streams (issue 18): the stream frames (`StreamDeclare` to
/// `StreamPartitionEnd`) and `Deliver.routing_key`.
pub const PROTOCOL_VERSION_STREAMS: u16 = 7;

const _: () = assert!(PROTOCOL_VERSION >= PROTOCOL_VERSION_STREAMS);

/// The oldest protocol version a server still accepts: version 1 differs only in `Subscribe`,
/// which has no `prefetch_bytes`, and version 2 only in the accepted `ServerHello`, which has no
/// [`ServerInfo`], and versions 1 to 3 have no queue `replicas`, partition leaders or error
/// `leader_addr`, versions 1 to 4 no `Declare.nodes`, and versions 1 to 5 no authentication
/// (their hello logs in as [`Auth::None`]; see `docs/protocol.md`, "Version changes").
pub const PROTOCOL_VERSION_MIN: u16 = 1;

/// The first version whose accepted `ServerHello` carries a [`ServerInfo`].
pub const SERVER_INFO_VERSION: u16 = 3;

/// The first version whose `ClientHello` carries an [`Auth`] and whose accepted `ServerHello`
/// names the logged-in user.
pub const AUTH_VERSION: u16 = 6;

/// Longest `user` in an accepted `ServerHello`: a user name is at most
/// [`crate::auth::AUTH_USER_BYTES_MAX`] bytes, and a certificate's identity is cut to the same.
pub const SERVER_HELLO_USER_BYTES_MAX: usize = 255;

/// Most nodes a [`ServerInfo`] lists: more than any cluster Keratin runs (metadata voters are at
/// most 5), few enough that a hello stays small.
pub const SERVER_INFO_NODES_MAX: usize = 64;

/// Longest address or node name inside a [`ServerInfo`] (a host name and port fit in 255 bytes).
pub const SERVER_INFO_FIELD_BYTES_MAX: usize = 255;

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

/// Largest `ClientHello`: magic, version, a name of 65,535 bytes behind its u16 length, then
/// the largest login (mechanism, user and password at their bounds; 1,284 bytes).
pub const CLIENT_HELLO_SIZE_MAX: usize = CLIENT_NAME_OFFSET + 2 + u16::MAX as usize + AUTH_SIZE_MAX;
/// Largest refused `ServerHello`: an error body with a reason and a message of 65,535 bytes
/// each: code 2, reason 1 + 2 + 65,535, retry hint 1 + 4, message 2 + 65,535.
const SERVER_HELLO_REFUSED_SIZE_MAX: usize =
    SERVER_DETAIL_OFFSET + 2 + (1 + 2 + u16::MAX as usize) + (1 + 4) + (2 + u16::MAX as usize);

/// Largest field of a [`ServerInfo`] on the wire: a u16 length and 255 bytes.
const INFO_FIELD_SIZE_MAX: usize = 2 + SERVER_INFO_FIELD_BYTES_MAX;

/// Largest accepted `ServerHello`: a node id of 65,535 bytes, then the [`ServerInfo`] with an
/// admin address and [`SERVER_INFO_NODES_MAX`] nodes whose fields are all at their longest,
/// then a user of [`SERVER_HELLO_USER_BYTES_MAX`] bytes.
const SERVER_HELLO_ACCEPTED_SIZE_MAX: usize = SERVER_DETAIL_OFFSET
    + (2 + u16::MAX as usize)
    + (1 + INFO_FIELD_SIZE_MAX)
    + 2
    + SERVER_INFO_NODES_MAX * (INFO_FIELD_SIZE_MAX + INFO_FIELD_SIZE_MAX + 1 + INFO_FIELD_SIZE_MAX)
    + (1 + 2 + SERVER_HELLO_USER_BYTES_MAX);

/// Largest `ServerHello`, accepted or refused.
pub const SERVER_HELLO_SIZE_MAX: usize =
    if SERVER_HELLO_REFUSED_SIZE_MAX > SERVER_HELLO_ACCEPTED_SIZE_MAX {
        SERVER_HELLO_REFUSED_SIZE_MAX
    } else {
        SERVER_HELLO_ACCEPTED_SIZE_MAX
    };

const STATUS_ACCEPTED: u8 = 0;
const STATUS_REFUSED: u8 = 1;
const STATUS_COUNT: u8 = 2;

/// The first message on a connection, from the client. `Debug` shows no password or token
/// (see [`Auth`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The protocol version the client speaks.
    pub version: u16,
    /// Names the client in server logs, for example `keratin-cli 0.1.0`.
    pub client_name: String,
    /// How the client logs in; on the wire from [`AUTH_VERSION`] on, always [`Auth::None`]
    /// below it.
    pub auth: Auth,
}

/// What a node tells a client about where to reach it and the other nodes of its cluster
/// (protocol version 3 on). A client given one address learns the rest from it: the CLI reads
/// the admin address here instead of needing `--http`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerInfo {
    /// This node's HTTP admin address as this client can reach it (`host:port`), if it serves one.
    pub admin: Option<String>,
    /// The nodes of the cluster this node knows, itself included; a single node lists itself.
    pub nodes: Vec<NodeAddress>,
}

/// One node of a cluster as a client reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddress {
    /// The node's name (its `node_id` in its own hello).
    pub node_id: String,
    /// Its protocol address, `host:port`.
    pub server: String,
    /// Its HTTP admin address, `host:port`, if it serves one.
    pub admin: Option<String>,
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
        /// Where to reach this node and its cluster; sent from version 3 on, empty below.
        info: ServerInfo,
        /// The user the server logged the connection in as (at most
        /// [`SERVER_HELLO_USER_BYTES_MAX`] bytes); `None` for a connection without a login.
        /// Sent from [`AUTH_VERSION`] on: below it, not sent and decoded as `None`.
        user: Option<String>,
    },
    /// The server closes the connection after this answer.
    Refused {
        /// The version the server speaks, so the client can say which one it needs.
        version: u16,
        /// Why; a 400 for an unsupported version, a 401 for a failed or missing login.
        error: ErrorBody,
    },
}

impl ClientHello {
    /// A hello for this crate's [`PROTOCOL_VERSION`], without a login.
    pub fn new(client_name: impl Into<String>) -> ClientHello {
        ClientHello {
            version: PROTOCOL_VERSION,
            client_name: client_name.into(),
            auth: Auth::None,
        }
    }

    /// The same hello, logging in with `auth`.
    pub fn with_auth(self, auth: Auth) -> ClientHello {
        ClientHello { auth, ..self }
    }

    /// Appends the hello to `dst`. Fails, leaving `dst` as it was, on a name over 65,535 bytes,
    /// a login field out of its bounds, or a login in a version before [`AUTH_VERSION`], which
    /// cannot carry it.
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), ProtoError> {
        if self.version < AUTH_VERSION && self.auth != Auth::None {
            return Err(ProtoError::InvalidValue {
                field: "auth",
                reason: "protocol versions before 6 cannot carry a login",
            });
        }
        let start = dst.len();
        dst.put_slice(&MAGIC);
        dst.put_u16_le(self.version);
        put_string(dst, "client_name", &self.client_name)
            .and_then(|()| {
                if self.version >= AUTH_VERSION {
                    put_auth(dst, &self.auth)
                } else {
                    Ok(())
                }
            })
            .inspect_err(|_| dst.truncate(start))
    }

    /// Takes a whole hello from the front of `src`, or returns `None` if more bytes are needed.
    /// A wrong magic fails as soon as four bytes are present.
    pub fn decode(src: &mut BytesMut) -> Result<Option<ClientHello>, ProtoError> {
        decode_incremental(src, "ClientHello", CLIENT_HELLO_SIZE_MAX, |r| {
            let version = read_magic_and_version(r)?;
            Ok(ClientHello {
                version,
                client_name: r.string("client_name")?,
                auth: if version >= AUTH_VERSION {
                    read_auth(r)?
                } else {
                    Auth::None
                },
            })
        })
    }
}

impl ServerHello {
    /// The server's answer to `hello`: accepted in the client's version if it is from
    /// [`PROTOCOL_VERSION_MIN`] to [`PROTOCOL_VERSION`], else refused with a 400 that names
    /// both versions.
    /// `info` goes out only to a client of version 3 or later. The login is not looked at: the
    /// answer names no `user`. A server that checks logins answers a failed one with a
    /// [`ServerHello::Refused`] of code 401, and a good one with its own `Accepted` naming the
    /// user.
    pub fn answer(
        hello: &ClientHello,
        node_id: impl Into<String>,
        info: ServerInfo,
    ) -> ServerHello {
        if (PROTOCOL_VERSION_MIN..=PROTOCOL_VERSION).contains(&hello.version) {
            let info = if hello.version >= SERVER_INFO_VERSION {
                info
            } else {
                ServerInfo::default()
            };
            return ServerHello::Accepted {
                version: hello.version,
                node_id: node_id.into(),
                info,
                user: None,
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
    /// Like `info` below version 3, `user` is left out below [`AUTH_VERSION`].
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), ProtoError> {
        let start = dst.len();
        dst.put_slice(&MAGIC);
        let result = match self {
            ServerHello::Accepted {
                version,
                node_id,
                info,
                user,
            } => {
                dst.put_u16_le(*version);
                dst.put_u8(STATUS_ACCEPTED);
                put_string(dst, "node_id", node_id)
                    .and_then(|()| {
                        if *version >= SERVER_INFO_VERSION {
                            put_server_info(dst, info)
                        } else {
                            Ok(())
                        }
                    })
                    .and_then(|()| {
                        if *version >= AUTH_VERSION {
                            put_option(dst, user.as_ref(), |dst, user| {
                                put_bounded(dst, "user", user, SERVER_HELLO_USER_BYTES_MAX)
                            })
                        } else {
                            Ok(())
                        }
                    })
            }
            ServerHello::Refused { version, error } => {
                dst.put_u16_le(*version);
                dst.put_u8(STATUS_REFUSED);
                put_error_body(dst, error, false)
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
                    info: if version >= SERVER_INFO_VERSION {
                        read_server_info(r)?
                    } else {
                        ServerInfo::default()
                    },
                    user: if version >= AUTH_VERSION {
                        r.option("user", |r| {
                            r.string_sized("user", 0, SERVER_HELLO_USER_BYTES_MAX)
                        })?
                    } else {
                        None
                    },
                }),
                _ => Ok(ServerHello::Refused {
                    version,
                    error: read_error_body(r, false)?,
                }),
            }
        })
    }
}

fn put_server_info(dst: &mut BytesMut, info: &ServerInfo) -> Result<(), ProtoError> {
    if info.nodes.len() > SERVER_INFO_NODES_MAX {
        return Err(ProtoError::FieldTooLong {
            field: "nodes",
            size: info.nodes.len(),
            limit: SERVER_INFO_NODES_MAX,
        });
    }
    put_option(dst, info.admin.as_ref(), |dst, admin| {
        put_info_field(dst, "admin", admin)
    })?;
    put_count_u16(dst, "nodes", info.nodes.len())?;
    for node in &info.nodes {
        put_info_field(dst, "nodes.node_id", &node.node_id)?;
        put_info_field(dst, "nodes.server", &node.server)?;
        put_option(dst, node.admin.as_ref(), |dst, admin| {
            put_info_field(dst, "nodes.admin", admin)
        })?;
    }
    Ok(())
}

fn put_info_field(dst: &mut BytesMut, field: &'static str, text: &str) -> Result<(), ProtoError> {
    put_bounded(dst, field, text, SERVER_INFO_FIELD_BYTES_MAX)
}

/// Writes a string that may be at most `size_max` bytes long.
fn put_bounded(
    dst: &mut BytesMut,
    field: &'static str,
    text: &str,
    size_max: usize,
) -> Result<(), ProtoError> {
    if text.len() > size_max {
        return Err(ProtoError::FieldTooLong {
            field,
            size: text.len(),
            limit: size_max,
        });
    }
    put_string(dst, field, text)
}

fn read_server_info(r: &mut Reader) -> Result<ServerInfo, ProtoError> {
    let admin = r.option("admin", |r| read_info_field(r, "admin"))?;
    // Smallest node: two empty strings and an absent admin address.
    let nodes = r.list_u16("nodes", 2 + 2 + 1, |r| {
        Ok(NodeAddress {
            node_id: read_info_field(r, "nodes.node_id")?,
            server: read_info_field(r, "nodes.server")?,
            admin: r.option("nodes.admin", |r| read_info_field(r, "nodes.admin"))?,
        })
    })?;
    if nodes.len() > SERVER_INFO_NODES_MAX {
        return Err(r.error("nodes", Problem::InvalidValue("more than 64 nodes")));
    }
    Ok(ServerInfo { admin, nodes })
}

fn read_info_field(r: &mut Reader, field: &'static str) -> Result<String, ProtoError> {
    let text = r.string(field)?;
    if text.len() > SERVER_INFO_FIELD_BYTES_MAX {
        return Err(r.error(field, Problem::InvalidValue("longer than 255 bytes")));
    }
    Ok(text)
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
        assert_eq!(&dst[..], b"KRTN\x07\x00\x03\x00cli\x00");
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
            auth: Auth::None,
        };
        let answer = ServerHello::answer(&hello, "node-1", ServerInfo::default());
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
    fn server_info_bounds_are_enforced_both_ways() {
        let node = NodeAddress {
            node_id: "n".repeat(SERVER_INFO_FIELD_BYTES_MAX),
            server: "s".repeat(SERVER_INFO_FIELD_BYTES_MAX),
            admin: Some("a".repeat(SERVER_INFO_FIELD_BYTES_MAX)),
        };
        let largest = ServerHello::Accepted {
            version: PROTOCOL_VERSION,
            node_id: "i".repeat(usize::from(u16::MAX)),
            info: ServerInfo {
                admin: Some("a".repeat(SERVER_INFO_FIELD_BYTES_MAX)),
                nodes: vec![node.clone(); SERVER_INFO_NODES_MAX],
            },
            user: Some("u".repeat(SERVER_HELLO_USER_BYTES_MAX)),
        };
        let mut dst = BytesMut::new();
        largest.encode(&mut dst).unwrap();
        assert_eq!(dst.len(), SERVER_HELLO_ACCEPTED_SIZE_MAX);
        assert!(dst.len() <= SERVER_HELLO_SIZE_MAX);
        assert_eq!(ServerHello::decode(&mut dst).unwrap(), Some(largest));

        let too_many = ServerHello::Accepted {
            version: PROTOCOL_VERSION,
            node_id: "n".into(),
            info: ServerInfo {
                admin: None,
                nodes: vec![node.clone(); SERVER_INFO_NODES_MAX + 1],
            },
            user: None,
        };
        assert!(too_many.encode(&mut BytesMut::new()).is_err());
        let too_long = ServerInfo {
            admin: Some("a".repeat(SERVER_INFO_FIELD_BYTES_MAX + 1)),
            nodes: Vec::new(),
        };
        let mut dst = BytesMut::new();
        assert!(ServerHello::answer(&ClientHello::new("c"), "n", too_long)
            .encode(&mut dst)
            .is_err());
        assert!(dst.is_empty(), "a failed encode leaves dst as it was");

        // A server that sends a field over 255 bytes (by hand: the encoder refuses) is refused.
        let mut dst = BytesMut::from(&b"KRTN\x03\x00\x00\x01\x00n\x01"[..]);
        dst.put_u16_le(256);
        dst.put_slice(&[b'a'; 256]);
        dst.put_u16_le(0);
        assert!(ServerHello::decode(&mut dst).is_err());
        // And one that lists 65 nodes.
        let mut dst = BytesMut::from(&b"KRTN\x03\x00\x00\x01\x00n\x00"[..]);
        dst.put_u16_le(65);
        for _ in 0..65 {
            dst.put_slice(b"\x00\x00\x00\x00\x00");
        }
        assert!(ServerHello::decode(&mut dst).is_err());
    }

    #[test]
    fn largest_hellos_fit_their_bounds() {
        let hello = ClientHello::new("n".repeat(usize::from(u16::MAX))).with_auth(Auth::Plain {
            user: "u".repeat(crate::auth::AUTH_USER_BYTES_MAX),
            password: "p".repeat(crate::auth::AUTH_PASSWORD_BYTES_MAX),
        });
        let mut dst = BytesMut::new();
        hello.encode(&mut dst).unwrap();
        assert_eq!(dst.len(), CLIENT_HELLO_SIZE_MAX);
        assert_eq!(ClientHello::decode(&mut dst).unwrap(), Some(hello));
        let long = "m".repeat(usize::from(u16::MAX));
        let error = ErrorBody::limited(crate::LimitReason::Unknown(long.clone()), 1, long);
        let answer = ServerHello::Refused { version: 1, error };
        let mut dst = BytesMut::new();
        answer.encode(&mut dst).unwrap();
        assert_eq!(dst.len(), SERVER_HELLO_REFUSED_SIZE_MAX);
        assert!(dst.len() <= SERVER_HELLO_SIZE_MAX);
        assert_eq!(ServerHello::decode(&mut dst).unwrap(), Some(answer));
    }

    fn one_node_info() -> ServerInfo {
        ServerInfo {
            admin: Some("h:2".into()),
            nodes: vec![NodeAddress {
                node_id: "n".into(),
                server: "h:1".into(),
                admin: None,
            }],
        }
    }

    #[test]
    fn server_accepts_its_version_and_tells_where_it_is() {
        let answer = ServerHello::answer(&ClientHello::new("cli"), "node-1", one_node_info());
        let mut dst = BytesMut::new();
        answer.encode(&mut dst).unwrap();
        let expected: &[u8] = b"KRTN\x07\x00\x00\x06\x00node-1\
            \x01\x03\x00h:2\
            \x01\x00\x01\x00n\x03\x00h:1\x00\
            \x00";
        assert_eq!(&dst[..], expected);
        for cut in 0..dst.len() {
            let mut partial = BytesMut::from(&dst[..cut]);
            assert_eq!(ServerHello::decode(&mut partial).unwrap(), None);
        }
        assert_eq!(ServerHello::decode(&mut dst).unwrap(), Some(answer));
    }

    #[test]
    fn older_clients_get_the_hello_of_their_version() {
        for version in [1, 2] {
            let hello = ClientHello {
                version,
                client_name: "old".into(),
                auth: Auth::None,
            };
            let answer = ServerHello::answer(&hello, "node-1", one_node_info());
            let mut dst = BytesMut::new();
            answer.encode(&mut dst).unwrap();
            let mut expected = vec![version as u8, 0, 0, 6, 0];
            expected.extend_from_slice(b"node-1");
            assert_eq!(&dst[4..], &expected[..], "no server info below version 3");
            let decoded = ServerHello::decode(&mut dst).unwrap().unwrap();
            assert!(
                matches!(&decoded, ServerHello::Accepted { info, .. } if *info == ServerInfo::default())
            );
        }
    }
}
