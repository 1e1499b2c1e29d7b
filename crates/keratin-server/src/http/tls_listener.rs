//! HTTPS on the admin port: a [`TlsListener`] hands `axum::serve` connections whose TLS
//! handshake is done, so the router, the `ConnectInfo` the auth middleware reads and the
//! graceful shutdown are the plain port's. The certificate is the protocol port's
//! ([`ServerTls`], one `Arc`): a SIGHUP reload reaches both ports at once.
//!
//! Handshakes run in their own tasks (a slow client never holds up the accept loop), each
//! within [`HANDSHAKE_TIMEOUT`]; one that fails (plain HTTP, a client that rejects the
//! certificate, silence) closes the connection and logs at debug level only: it is the
//! client's error, and the client sees its own.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::server::TlsStream;

use crate::tls::ServerTls;

/// How long a new connection has to finish its TLS handshake: the protocol port's
/// `handshake_timeout` default, ample for a round trip or two on any network.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at once; past it new connections are closed at once. Each holds a
/// socket and rustls' buffers (some tens of KiB): 256 keep that to a few MiB, far more than
/// an admin port's clients (the CLI, a dashboard, a metrics scraper) open together.
const HANDSHAKES_MAX: usize = 256;

/// Back-off after a failed `accept` (out of file descriptors and the like), so as not to spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// A TCP listener that yields connections after their TLS handshake.
pub(super) struct TlsListener {
    listener: TcpListener,
    tls: Arc<ServerTls>,
    handshakes: JoinSet<Option<(TlsStream<TcpStream>, SocketAddr)>>,
}

impl TlsListener {
    pub(super) fn new(listener: TcpListener, tls: Arc<ServerTls>) -> TlsListener {
        TlsListener {
            listener,
            tls,
            handshakes: JoinSet::new(),
        }
    }

    fn handshake_start(&mut self, stream: TcpStream, peer: SocketAddr) {
        if self.handshakes.len() >= HANDSHAKES_MAX {
            tracing::debug!(%peer, HANDSHAKES_MAX, "too many TLS handshakes in progress; closing");
            return;
        }
        let _ = stream.set_nodelay(true);
        let acceptor = self.tls.acceptor().clone();
        self.handshakes.spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => Some((stream, peer)),
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "admin port: TLS handshake failed; closing");
                    None
                }
                Err(_) => {
                    tracing::debug!(%peer, "admin port: no TLS handshake in time; closing");
                    None
                }
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    // Both branches are cancel-safe (`TcpListener::accept`, `JoinSet::join_next`): axum drops
    // this future at shutdown, and the handshakes in progress go with the listener.
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => self.handshake_start(stream, peer),
                    Err(error) => {
                        tracing::warn!(%error, "admin port: accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    }
                },
                Some(done) = self.handshakes.join_next(), if !self.handshakes.is_empty() => {
                    if let Ok(Some(connection)) = done {
                        return connection;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}
