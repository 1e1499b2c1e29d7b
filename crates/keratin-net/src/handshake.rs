//! The handshake: the dialer's [`Hello`] and the acceptor's [`HelloReply`], the first bytes of a
//! connection in each direction, before any frame. Layout in `docs/cluster-protocol.md`
//! ("Handshake"). Deciding whether to accept a hello (cluster, node ids, direction) belongs to
//! `transport.rs`; this module only encodes and reads.

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::{FrameError, RemoteError};
use crate::wire::put_string;
use crate::NodeId;

/// The four bytes that open every hello and reply: ASCII `KRCL` ("Keratin cluster").
pub const MAGIC: [u8; 4] = *b"KRCL";
/// The cluster protocol version this crate speaks. Version 2 added the `Label` frame.
pub const PROTOCOL_VERSION: u16 = 2;
/// Longest cluster name in a hello, in bytes. Names are short labels (`prod-eu-1`); the bound
/// keeps the unframed hello small (4 + 2 + 8 + 8 + 2 + 255 = 279 bytes at most).
pub const CLUSTER_NAME_BYTES_MAX: usize = 255;

/// Status byte of an accepting [`HelloReply`].
const STATUS_ACCEPTED: u8 = 0;
/// Status byte of a refusing [`HelloReply`].
const STATUS_REFUSED: u8 = 1;

/// What the dialer sends first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The version the dialer speaks.
    pub version: u16,
    /// The dialer's node id.
    pub from: NodeId,
    /// The node id the dialer believes it reached.
    pub to: NodeId,
    /// The dialer's cluster name.
    pub cluster: String,
}

/// The acceptor's answer. After a refusal the acceptor closes the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    /// Accepted: the version both sides now speak; refused: the acceptor's version.
    pub version: u16,
    /// The acceptor's node id.
    pub node_id: NodeId,
    /// `Ok(())` when accepted, else the refusal's code ([`crate::codes`]) and message.
    pub outcome: Result<(), RemoteError>,
}

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> BytesMut {
        let mut buf = BytesMut::with_capacity(24 + 2 + self.cluster.len());
        buf.put_slice(&MAGIC);
        buf.put_u16_le(self.version);
        buf.put_u64_le(self.from);
        buf.put_u64_le(self.to);
        put_string(&mut buf, &self.cluster);
        buf
    }

    /// Reads a hello. Fails on a wrong magic as soon as its four bytes are in, and on a cluster
    /// name above [`CLUSTER_NAME_BYTES_MAX`] before reading it. The caller bounds the time.
    pub async fn read<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Hello, HandshakeReadError> {
        read_magic(reader).await?;
        let version = reader.read_u16_le().await?;
        let from = reader.read_u64_le().await?;
        let to = reader.read_u64_le().await?;
        let cluster = read_string(reader, CLUSTER_NAME_BYTES_MAX).await?;
        Ok(Hello {
            version,
            from,
            to,
            cluster,
        })
    }
}

impl HelloReply {
    /// The reply's bytes.
    pub fn encode(&self) -> BytesMut {
        let mut buf = BytesMut::with_capacity(64);
        buf.put_slice(&MAGIC);
        buf.put_u16_le(self.version);
        match &self.outcome {
            Ok(()) => {
                buf.put_u8(STATUS_ACCEPTED);
                buf.put_u64_le(self.node_id);
            }
            Err(error) => {
                buf.put_u8(STATUS_REFUSED);
                buf.put_u64_le(self.node_id);
                buf.put_u16_le(error.code);
                put_string(&mut buf, &error.message);
            }
        }
        buf
    }

    /// Reads a reply; the refusal message may be up to `u16::MAX` bytes.
    pub async fn read<R: AsyncRead + Unpin>(
        reader: &mut R,
    ) -> Result<HelloReply, HandshakeReadError> {
        read_magic(reader).await?;
        let version = reader.read_u16_le().await?;
        let status = reader.read_u8().await?;
        let node_id = reader.read_u64_le().await?;
        let outcome = match status {
            STATUS_ACCEPTED => Ok(()),
            STATUS_REFUSED => {
                let code = reader.read_u16_le().await?;
                let message = read_string(reader, usize::from(u16::MAX)).await?;
                Err(RemoteError { code, message })
            }
            other => {
                return Err(HandshakeReadError::Bad(FrameError::Handshake(format!(
                    "reply status {other} is neither 0 (accepted) nor 1 (refused)"
                ))))
            }
        };
        Ok(HelloReply {
            version,
            node_id,
            outcome,
        })
    }
}

/// Why reading a hello or a reply failed.
#[derive(Debug)]
pub enum HandshakeReadError {
    /// The socket failed or closed early.
    Io(std::io::Error),
    /// The bytes do not follow the protocol.
    Bad(FrameError),
}

impl From<std::io::Error> for HandshakeReadError {
    fn from(error: std::io::Error) -> HandshakeReadError {
        HandshakeReadError::Io(error)
    }
}

impl std::fmt::Display for HandshakeReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeReadError::Io(error) => write!(f, "handshake read failed: {error}"),
            HandshakeReadError::Bad(error) => write!(f, "{error}"),
        }
    }
}

async fn read_magic<R: AsyncRead + Unpin>(reader: &mut R) -> Result<(), HandshakeReadError> {
    let mut magic = [0u8; 4];
    reader.read_exact(&mut magic).await?;
    if magic != MAGIC {
        return Err(HandshakeReadError::Bad(FrameError::BadMagic(magic)));
    }
    Ok(())
}

async fn read_string<R: AsyncRead + Unpin>(
    reader: &mut R,
    size_max: usize,
) -> Result<String, HandshakeReadError> {
    let size = usize::from(reader.read_u16_le().await?);
    if size > size_max {
        return Err(HandshakeReadError::Bad(FrameError::Handshake(format!(
            "string of {size} bytes exceeds the limit of {size_max}"
        ))));
    }
    let mut bytes = vec![0u8; size];
    reader.read_exact(&mut bytes).await?;
    String::from_utf8(bytes).map_err(|_| {
        HandshakeReadError::Bad(FrameError::Handshake("string is not UTF-8".to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hello_and_replies_roundtrip() {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            from: 1,
            to: 2,
            cluster: "prod".to_string(),
        };
        let bytes = hello.encode();
        assert_eq!(&bytes[..4], b"KRCL");
        assert_eq!(Hello::read(&mut &bytes[..]).await.unwrap(), hello);
        for outcome in [
            Ok(()),
            Err(RemoteError::new(crate::codes::CLUSTER, "other cluster")),
        ] {
            let reply = HelloReply {
                version: 1,
                node_id: 2,
                outcome,
            };
            let bytes = reply.encode();
            assert_eq!(HelloReply::read(&mut &bytes[..]).await.unwrap(), reply);
        }
    }

    #[test]
    fn hello_bytes_match_the_spec_example() {
        // docs/cluster-protocol.md, "Examples": node 1 to node 2 of cluster "prod".
        let hello = Hello {
            version: 1,
            from: 1,
            to: 2,
            cluster: "prod".to_string(),
        };
        let expected: Vec<u8> = vec![
            0x4b, 0x52, 0x43, 0x4c, // KRCL
            1, 0, // version
            1, 0, 0, 0, 0, 0, 0, 0, // from
            2, 0, 0, 0, 0, 0, 0, 0, // to
            4, 0, b'p', b'r', b'o', b'd', // cluster
        ];
        assert_eq!(&hello.encode()[..], &expected[..]);
    }

    #[tokio::test]
    async fn wrong_magic_is_refused_after_four_bytes() {
        let mut bytes: &[u8] = b"GET / HTTP/1.1\r\n";
        assert!(matches!(
            Hello::read(&mut bytes).await,
            Err(HandshakeReadError::Bad(_))
        ));
    }
}
