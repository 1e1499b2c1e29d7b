//! `Liveness`: the per-peer view read by `cluster status` and attention items: connected or
//! not, last contact, round-trip estimate, the last connection error. Written by the peer's
//! connection tasks with relaxed atomics, read as a [`PeerStatus`] snapshot without locks
//! (except for the rare error text).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::NodeId;

/// A snapshot of one peer's liveness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    /// The peer's node id.
    pub id: NodeId,
    /// Its configured address.
    pub addr: SocketAddr,
    /// Whether a handshaken connection is up now.
    pub connected: bool,
    /// When the last frame (of any type) arrived from the peer; `None` if never.
    pub last_contact: Option<Instant>,
    /// Round-trip estimate from pings (moving average over about 8 pings); `None` before the
    /// first pong.
    pub rtt: Option<Duration>,
    /// Connections established with the peer since start (dialed or accepted).
    pub connections_count: u64,
    /// Bytes queued for the peer and not yet written.
    pub write_queue_bytes: usize,
    /// The last connection error (refused handshake, connect failure, protocol error), if any
    /// since the last successful handshake.
    pub last_error: Option<String>,
}

/// The writable side of one peer's liveness.
#[derive(Debug)]
pub(crate) struct Liveness {
    epoch: Instant,
    connected: AtomicBool,
    /// Microseconds since `epoch`, plus one; 0 means never.
    last_contact_us: AtomicU64,
    /// Microseconds; 0 means no estimate yet.
    rtt_us: AtomicU64,
    connections_count: AtomicU64,
    pub(crate) write_queue_bytes: AtomicUsize,
    last_error: Mutex<Option<String>>,
}

impl Liveness {
    pub(crate) fn new(epoch: Instant) -> Liveness {
        Liveness {
            epoch,
            connected: AtomicBool::new(false),
            last_contact_us: AtomicU64::new(0),
            rtt_us: AtomicU64::new(0),
            connections_count: AtomicU64::new(0),
            write_queue_bytes: AtomicUsize::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// Microseconds since the transport started: the clock pings carry.
    pub(crate) fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    pub(crate) fn touch(&self) {
        self.last_contact_us
            .store(self.now_us().saturating_add(1), Ordering::Relaxed);
    }

    pub(crate) fn connected(&self) {
        self.connected.store(true, Ordering::Relaxed);
        self.connections_count.fetch_add(1, Ordering::Relaxed);
        self.touch();
        *self.error_slot() = None;
    }

    pub(crate) fn disconnected(&self) {
        self.connected.store(false, Ordering::Relaxed);
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Folds a pong's round trip into the estimate: new = (7 * old + sample) / 8, as TCP's SRTT.
    /// Only the connection's reader calls this, so load-then-store does not lose updates.
    pub(crate) fn pong(&self, ping_sent_us: u64) {
        let sample = self.now_us().saturating_sub(ping_sent_us).max(1);
        let old = self.rtt_us.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old.saturating_mul(7).saturating_add(sample) / 8
        };
        self.rtt_us.store(new.max(1), Ordering::Relaxed);
    }

    pub(crate) fn set_error(&self, error: String) {
        *self.error_slot() = Some(error);
    }

    pub(crate) fn error(&self) -> Option<String> {
        self.error_slot().clone()
    }

    fn error_slot(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A panic while holding this lock cannot leave the Option half-written.
        self.last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn status(&self, id: NodeId, addr: SocketAddr) -> PeerStatus {
        let last_contact_us = self.last_contact_us.load(Ordering::Relaxed);
        let rtt_us = self.rtt_us.load(Ordering::Relaxed);
        PeerStatus {
            id,
            addr,
            connected: self.is_connected(),
            last_contact: (last_contact_us > 0)
                .then(|| self.epoch + Duration::from_micros(last_contact_us - 1)),
            rtt: (rtt_us > 0).then(|| Duration::from_micros(rtt_us)),
            connections_count: self.connections_count.load(Ordering::Relaxed),
            write_queue_bytes: self.write_queue_bytes.load(Ordering::Relaxed),
            last_error: self.error(),
        }
    }
}
