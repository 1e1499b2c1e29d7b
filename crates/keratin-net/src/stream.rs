//! A cluster connection's bytes once established: plain TCP, or TLS over it (`crate::tls`).
//! The session and its writer are generic over [`PeerStream`]; TCP keeps its owned halves (no
//! lock between the reader and the writer), TLS splits with tokio's (one session state, shared).
//! Establishing a connection belongs to `dialer.rs` and `listener.rs`.

use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

/// A connection after its handshake, in either form.
pub(crate) enum Established {
    Plain(TcpStream),
    /// Boxed: a TLS session's state is kilobytes, the TCP stream a few words.
    Tls(Box<TlsStream<TcpStream>>),
}

/// See the module docs.
pub(crate) trait PeerStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The read half, for the session's reading loop.
    type Reader: AsyncRead + Send + Unpin + 'static;
    /// The write half, for the writer task.
    type Writer: AsyncWrite + Send + Unpin + 'static;
    /// The halves.
    fn split_owned(self) -> (Self::Reader, Self::Writer);
}

impl PeerStream for TcpStream {
    type Reader = OwnedReadHalf;
    type Writer = OwnedWriteHalf;

    fn split_owned(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }
}

impl PeerStream for TlsStream<TcpStream> {
    type Reader = ReadHalf<TlsStream<TcpStream>>;
    type Writer = WriteHalf<TlsStream<TcpStream>>;

    fn split_owned(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }
}

/// Whether the first bytes of what should have been a hello or a hello reply look like a TLS
/// record header (handshake `0x16` or alert `0x15`, then major version 3): a peer that speaks
/// TLS where this node does not, or the reverse. Only for a clearer log line.
pub(crate) fn looks_like_tls(first: [u8; 4]) -> bool {
    matches!(first, [0x15 | 0x16, 0x03, ..])
}
