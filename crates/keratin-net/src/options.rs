//! [`TransportOptions`]: the transport's bounds and timers, each with the arithmetic behind its
//! default. These are tuning knobs for the node, not cluster configuration: peers may differ.
//! The exception is `tls`, which every node of a cluster sets or none does; it sits here because
//! the options are what the cluster layer passes through to [`crate::Transport::start`].

use std::time::Duration;

use crate::frame::{FRAME_SIZE_BYTES_MAX, HEADER_SIZE};
use crate::tls::ClusterTls;

/// Bounds and timers of a [`crate::Transport`].
#[derive(Debug, Clone)]
pub struct TransportOptions {
    /// Largest frame accepted or sent (the `length` field). Default 16 MiB + 64 KiB, the protocol
    /// maximum: an append of one entry carrying the largest message of a client frame fits.
    pub frame_size_bytes_max: u32,
    /// Outgoing calls in flight per connection; a call beyond it waits (within its timeout) for
    /// a slot. Default 4,096: 2,000 groups each with a couple of outstanding appends.
    pub calls_in_flight_max: usize,
    /// Incoming requests (and heartbeat batches) served at once per connection; beyond it the
    /// transport answers `codes::BUSY` without reading the handler. Default 4,096, the same as
    /// `calls_in_flight_max`, so a peer with equal options is refused only while handlers of
    /// calls it already gave up on are still running.
    pub served_in_flight_max: usize,
    /// Bytes of frames queued for one peer and not yet written. Writers wait (callers within
    /// their timeouts) beyond it, so a peer that stops reading costs at most this much memory.
    /// Default 64 MiB: four largest frames, or 16,000 4 KiB appends.
    pub write_queue_bytes_max: usize,
    /// Heartbeat tick: pending group heartbeats to a peer leave in one frame per tick. Default
    /// 10 ms, a tenth of a typical 100 ms Raft heartbeat interval, so coalescing adds at most
    /// 10 ms to a heartbeat's round trip.
    pub heartbeat_tick: Duration,
    /// How often a connection is pinged for liveness and the round-trip estimate. Default 1 s.
    pub ping_interval: Duration,
    /// A connection that received nothing (not even a pong) for this long is closed and
    /// re-established. Default 5 s: five missed pings.
    pub idle_timeout: Duration,
    /// Bound on a TCP connect. Default 2 s.
    pub connect_timeout: Duration,
    /// Bound on a handshake (hello and reply). Default 2 s.
    pub handshake_timeout: Duration,
    /// First reconnect delay; doubles per failure up to `reconnect_backoff_max`. Default 20 ms.
    pub reconnect_backoff_min: Duration,
    /// Largest reconnect delay. Default 2 s: a restarted peer is found within 2 s of listening.
    pub reconnect_backoff_max: Duration,
    /// Mutual TLS on every cluster connection (`crate::tls`), from the `[cluster]` TLS keys
    /// ([`crate::ClusterTlsConfig`]); `None` (the default): plain TCP. Every node of a cluster
    /// needs the same choice: a TLS node and a plain one never complete a handshake.
    pub tls: Option<ClusterTls>,
}

impl Default for TransportOptions {
    fn default() -> TransportOptions {
        TransportOptions {
            frame_size_bytes_max: FRAME_SIZE_BYTES_MAX,
            calls_in_flight_max: 4096,
            served_in_flight_max: 4096,
            write_queue_bytes_max: 64 * 1024 * 1024,
            heartbeat_tick: Duration::from_millis(10),
            ping_interval: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            handshake_timeout: Duration::from_secs(2),
            reconnect_backoff_min: Duration::from_millis(20),
            reconnect_backoff_max: Duration::from_secs(2),
            tls: None,
        }
    }
}

impl TransportOptions {
    /// Checks the relations between the options; a violation is our (or the embedder's) bug.
    pub(crate) fn assert_valid(&self) {
        assert!(self.frame_size_bytes_max as usize > HEADER_SIZE);
        assert!(self.frame_size_bytes_max <= FRAME_SIZE_BYTES_MAX);
        // One largest frame must always fit in the write queue, or it could never be sent.
        assert!(self.write_queue_bytes_max >= self.frame_size_bytes_max as usize + 4);
        assert!(self.calls_in_flight_max > 0 && self.served_in_flight_max > 0);
        // Semaphores hold at most u32::MAX permits per acquire.
        assert!(self.write_queue_bytes_max <= u32::MAX as usize);
        assert!(self.idle_timeout > self.ping_interval);
        assert!(!self.heartbeat_tick.is_zero() && !self.ping_interval.is_zero());
        assert!(self.reconnect_backoff_min <= self.reconnect_backoff_max);
    }
}
