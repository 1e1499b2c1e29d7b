//! A connection's byte stream: plain TCP, or TLS over it (`crate::tls`). The connection task
//! is generic over it; TCP keeps its owned halves (no lock between reader and writer), TLS
//! splits with tokio's (one session state, shared).

use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

/// See the module docs.
pub(crate) trait ProtocolStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The read half.
    type Reader: AsyncRead + Send + Unpin + 'static;
    /// The write half.
    type Writer: AsyncWrite + Send + Unpin + 'static;
    /// The local address the client reached.
    fn local_addr(&self) -> Option<SocketAddr>;
    /// True over TLS.
    fn is_tls(&self) -> bool;
    /// The subject common name of the client certificate the TLS handshake verified, if any.
    fn peer_common_name(&self) -> Option<String>;
    /// The halves, for the reading loop and the writer task.
    fn split_owned(self) -> (Self::Reader, Self::Writer);
}

impl ProtocolStream for TcpStream {
    type Reader = OwnedReadHalf;
    type Writer = OwnedWriteHalf;

    fn local_addr(&self) -> Option<SocketAddr> {
        TcpStream::local_addr(self).ok()
    }

    fn is_tls(&self) -> bool {
        false
    }

    fn peer_common_name(&self) -> Option<String> {
        None
    }

    fn split_owned(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }
}

impl ProtocolStream for TlsStream<TcpStream> {
    type Reader = ReadHalf<TlsStream<TcpStream>>;
    type Writer = WriteHalf<TlsStream<TcpStream>>;

    fn local_addr(&self) -> Option<SocketAddr> {
        self.get_ref().0.local_addr().ok()
    }

    fn is_tls(&self) -> bool {
        true
    }

    fn peer_common_name(&self) -> Option<String> {
        let end_entity = self.get_ref().1.peer_certificates()?.first()?;
        crate::tls::peer_common_name(end_entity)
    }

    fn split_owned(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }
}
