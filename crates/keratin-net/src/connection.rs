//! [`Connection`]: the shared handle of one established connection to a peer. It owns the
//! bounded write queue (frames and their byte budget), the table of outstanding calls by request
//! id, the table of heartbeat batches awaiting replies, and the close signal. Reading the socket
//! belongs to `session.rs`, writing it to `writer.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};

use crate::codes;
use crate::error::{NetError, RemoteError};
use crate::frame::{Encoded, Frame, LENGTH_SIZE};
use crate::liveness::Liveness;
use crate::options::TransportOptions;
use crate::{GroupId, NodeId};

/// Heartbeat batches sent on one connection and not yet answered. A batch older than this many
/// newer ones has waited at least 64 ticks (640 ms at the default tick), longer than any sane
/// heartbeat timeout, so its waiters are told and its entry dropped: the table stays bounded even
/// when a peer never answers.
const HEARTBEAT_BATCHES_IN_FLIGHT_MAX: usize = 64;
/// Frames that may sit in the write queue besides calls and replies: pings, pongs, busy
/// refusals and heartbeat batches of one tick each, with room to spare.
const CONTROL_FRAMES_MAX: usize = 1024;

/// Where a call's or a heartbeat's result goes.
pub(crate) type Waiter = oneshot::Sender<Result<Bytes, NetError>>;

/// How the writer should stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseMode {
    Open,
    /// Write what is queued (an `Error` frame, typically), then close.
    Drain,
    Now,
}

/// One frame in the write queue, holding its share of the byte budget until written. It counts
/// itself in the peer's `write_queue_bytes` from creation to drop, so a frame dropped unwritten
/// (a cancelled send, a closed connection) is uncounted as surely as a written one.
pub(crate) struct Outgoing {
    pub(crate) frame: Encoded,
    _budget: OwnedSemaphorePermit,
    liveness: Arc<Liveness>,
}

impl Outgoing {
    fn new(frame: Encoded, budget: OwnedSemaphorePermit, liveness: &Arc<Liveness>) -> Outgoing {
        liveness
            .write_queue_bytes
            .fetch_add(frame.size_bytes(), Ordering::Relaxed);
        Outgoing {
            frame,
            _budget: budget,
            liveness: Arc::clone(liveness),
        }
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        self.liveness
            .write_queue_bytes
            .fetch_sub(self.frame.size_bytes(), Ordering::Relaxed);
    }
}

/// The shared handle of one established connection.
pub(crate) struct Connection {
    pub(crate) peer: NodeId,
    pub(crate) generation: u64,
    pub(crate) liveness: Arc<Liveness>,
    pub(crate) served: Arc<Semaphore>,
    out: mpsc::Sender<Outgoing>,
    write_budget: Arc<Semaphore>,
    calls: Arc<Semaphore>,
    frame_size_bytes_max: u32,
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, Waiter>>,
    batches: Mutex<BTreeMap<u64, HashMap<GroupId, Waiter>>>,
    closed: AtomicBool,
    close_mode: watch::Sender<CloseMode>,
}

impl Connection {
    pub(crate) fn new(
        peer: NodeId,
        generation: u64,
        options: &TransportOptions,
        liveness: Arc<Liveness>,
    ) -> (Connection, mpsc::Receiver<Outgoing>) {
        let frames_max =
            options.calls_in_flight_max + options.served_in_flight_max + CONTROL_FRAMES_MAX;
        let (out, out_rx) = mpsc::channel(frames_max);
        let connection = Connection {
            peer,
            generation,
            liveness,
            served: Arc::new(Semaphore::new(options.served_in_flight_max)),
            out,
            write_budget: Arc::new(Semaphore::new(options.write_queue_bytes_max)),
            calls: Arc::new(Semaphore::new(options.calls_in_flight_max)),
            frame_size_bytes_max: options.frame_size_bytes_max,
            next_id: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            batches: Mutex::new(BTreeMap::new()),
            closed: AtomicBool::new(false),
            close_mode: watch::Sender::new(CloseMode::Open),
        };
        (connection, out_rx)
    }

    pub(crate) fn close_signal(&self) -> watch::Receiver<CloseMode> {
        self.close_mode.subscribe()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Whether a frame of `size_bytes` (prefix included) fits the frame size limit.
    pub(crate) fn fits(&self, size_bytes: usize) -> bool {
        size_bytes <= self.frame_size_bytes_max as usize + LENGTH_SIZE
    }

    /// A frame's share of the write budget: its size, which `fits` bounds by the budget.
    fn budget_for(&self, frame: &Encoded) -> Result<u32, NetError> {
        let size = frame.size_bytes();
        if !self.fits(size) {
            return Err(NetError::TooLarge {
                size_bytes: size.saturating_sub(LENGTH_SIZE) as u64,
                limit_bytes: self.frame_size_bytes_max,
            });
        }
        Ok(u32::try_from(size).unwrap_or(u32::MAX))
    }

    /// Queues a frame, waiting for room in the write queue.
    pub(crate) async fn send(&self, frame: &Frame) -> Result<(), NetError> {
        let frame = frame.encode();
        let size = self.budget_for(&frame)?;
        let budget = Arc::clone(&self.write_budget)
            .acquire_many_owned(size)
            .await
            .map_err(|_| self.closed_error())?;
        self.enqueue(frame, budget).await
    }

    /// Queues a frame only if there is room now.
    pub(crate) fn try_send(&self, frame: &Frame) -> Result<(), NetError> {
        let frame = frame.encode();
        let size = self.budget_for(&frame)?;
        let budget = match Arc::clone(&self.write_budget).try_acquire_many_owned(size) {
            Ok(budget) => budget,
            Err(tokio::sync::TryAcquireError::Closed) => return Err(self.closed_error()),
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                return Err(NetError::Backlogged { to: self.peer })
            }
        };
        match self
            .out
            .try_send(Outgoing::new(frame, budget, &self.liveness))
        {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(NetError::Backlogged { to: self.peer }),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(self.closed_error()),
        }
    }

    async fn enqueue(&self, frame: Encoded, budget: OwnedSemaphorePermit) -> Result<(), NetError> {
        self.out
            .send(Outgoing::new(frame, budget, &self.liveness))
            .await
            .map_err(|_| self.closed_error())
    }

    /// One call: a request id, a slot among `calls_in_flight_max`, the request queued, the reply
    /// awaited. The caller bounds the time; dropping the future forgets the request id.
    pub(crate) async fn call(
        &self,
        group: GroupId,
        kind: u8,
        body: Bytes,
    ) -> Result<Bytes, NetError> {
        let _slot = self
            .calls
            .acquire()
            .await
            .map_err(|_| self.closed_error())?;
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (waiter, reply) = oneshot::channel();
        self.register(request_id, waiter)?;
        let _forget = Forget {
            connection: self,
            request_id,
        };
        let request = Frame::Request {
            request_id,
            group,
            kind,
            body,
        };
        self.send(&request).await?;
        reply.await.map_err(|_| self.closed_error())?
    }

    fn register(&self, request_id: u64, waiter: Waiter) -> Result<(), NetError> {
        let mut pending = lock(&self.pending);
        // Checked under the lock `close` drains, so no waiter is left behind after a close.
        if self.is_closed() {
            return Err(self.closed_error());
        }
        pending.insert(request_id, waiter);
        Ok(())
    }

    /// Delivers a `Response` or `Refusal`. An unknown id is a call that gave up; ignored.
    pub(crate) fn resolve(&self, request_id: u64, result: Result<Bytes, RemoteError>) {
        let waiter = lock(&self.pending).remove(&request_id);
        if let Some(waiter) = waiter {
            let result = result.map_err(|error| NetError::Refused {
                to: self.peer,
                error,
            });
            let _ = waiter.send(result);
        }
    }

    /// Registers the waiters of a heartbeat batch about to be sent, and returns its id.
    pub(crate) fn register_batch(
        &self,
        waiters: HashMap<GroupId, Waiter>,
    ) -> Result<u64, NetError> {
        let batch_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut batches = lock(&self.batches);
        if self.is_closed() {
            return Err(self.closed_error());
        }
        batches.insert(batch_id, waiters);
        while batches.len() > HEARTBEAT_BATCHES_IN_FLIGHT_MAX {
            if let Some((_, stale)) = batches.pop_first() {
                for (group, waiter) in stale {
                    let _ = waiter.send(Err(NetError::Superseded {
                        to: self.peer,
                        group,
                    }));
                }
            }
        }
        Ok(batch_id)
    }

    /// Takes back a batch's waiters (its frame could not be queued).
    pub(crate) fn unregister_batch(&self, batch_id: u64) -> HashMap<GroupId, Waiter> {
        lock(&self.batches).remove(&batch_id).unwrap_or_default()
    }

    /// Delivers a `HeartbeatReplies` frame to the groups' waiters.
    pub(crate) fn resolve_batch(
        &self,
        batch_id: u64,
        replies: Vec<(GroupId, Result<Bytes, RemoteError>)>,
    ) {
        let mut waiters = self.unregister_batch(batch_id);
        for (group, reply) in replies {
            if let Some(waiter) = waiters.remove(&group) {
                let reply = reply.map_err(|error| NetError::Refused {
                    to: self.peer,
                    error,
                });
                let _ = waiter.send(reply);
            }
        }
        for (_, waiter) in waiters {
            let error =
                RemoteError::new(codes::NO_REPLY, "the heartbeat reply left this group out");
            let _ = waiter.send(Err(NetError::Refused {
                to: self.peer,
                error,
            }));
        }
    }

    /// Closes the connection: every outstanding call and heartbeat gets `Closed`, queued frames
    /// are dropped (or written first, with `CloseMode::Drain`), waiting senders fail.
    pub(crate) fn close(&self, mode: CloseMode) {
        self.closed.store(true, Ordering::Release);
        self.close_mode.send_if_modified(|current| {
            let stronger = *current == CloseMode::Open || mode == CloseMode::Now;
            if stronger {
                *current = mode;
            }
            stronger
        });
        self.calls.close();
        if mode == CloseMode::Now {
            self.write_budget.close();
        }
        let pending: Vec<Waiter> = lock(&self.pending)
            .drain()
            .map(|(_, waiter)| waiter)
            .collect();
        for waiter in pending {
            let _ = waiter.send(Err(self.closed_error()));
        }
        let batches = std::mem::take(&mut *lock(&self.batches));
        for waiter in batches.into_values().flat_map(HashMap::into_values) {
            let _ = waiter.send(Err(self.closed_error()));
        }
    }

    fn closed_error(&self) -> NetError {
        NetError::Closed { to: self.peer }
    }
}

/// Forgets a call's request id when the call ends, however it ends (reply, error, timeout).
struct Forget<'a> {
    connection: &'a Connection,
    request_id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(&self.connection.pending).remove(&self.request_id);
    }
}

/// Locks a table. A panic while holding one cannot leave a map half-updated in a way that
/// matters here (at worst a waiter is missing and its caller times out).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
