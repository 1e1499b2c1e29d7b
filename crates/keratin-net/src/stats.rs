//! `Stats`: transport-wide counters (connections, frames, write batches, heartbeats), for
//! metrics and for tests that prove coalescing. Relaxed atomics; read as a [`TransportStats`].

use std::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of the transport's counters since start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransportStats {
    /// Connections accepted on the cluster listener (any outcome of the handshake).
    pub connections_accepted: u64,
    /// Connections dialed that completed the handshake.
    pub connections_dialed: u64,
    /// Handshakes this node refused (wrong magic, version, cluster, node id, direction or
    /// certificate identity).
    pub handshakes_refused: u64,
    /// Accepted connections whose TLS handshake failed (a plaintext dialer, a certificate not
    /// signed by the cluster's CA); always 0 without TLS.
    pub tls_handshakes_failed: u64,
    /// Connections closed for a protocol error (ours to send or the peer's).
    pub protocol_errors: u64,
    /// Frames written.
    pub frames_written: u64,
    /// Write batches: each ends with one flush, so this counts write syscall groups.
    pub write_batches: u64,
    /// Frames read.
    pub frames_read: u64,
    /// `HeartbeatBatch` frames sent.
    pub heartbeat_frames_sent: u64,
    /// Group heartbeats carried by those frames.
    pub heartbeats_sent: u64,
    /// `HeartbeatBatch` frames received.
    pub heartbeat_frames_received: u64,
    /// Requests refused with `codes::BUSY`.
    pub requests_refused_busy: u64,
}

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// The live counters behind [`TransportStats`].
        #[derive(Debug, Default)]
        pub(crate) struct Stats {
            $(pub(crate) $name: AtomicU64,)*
        }

        impl Stats {
            pub(crate) fn snapshot(&self) -> TransportStats {
                TransportStats {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

counters!(
    connections_accepted,
    connections_dialed,
    handshakes_refused,
    tls_handshakes_failed,
    protocol_errors,
    frames_written,
    write_batches,
    frames_read,
    heartbeat_frames_sent,
    heartbeats_sent,
    heartbeat_frames_received,
    requests_refused_busy,
);

/// Adds `count` to a counter.
pub(crate) fn add(counter: &AtomicU64, count: u64) {
    counter.fetch_add(count, Ordering::Relaxed);
}
