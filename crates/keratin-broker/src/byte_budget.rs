//! `ByteBudget`: bytes of deliveries held in memory, counted against a capacity. Partition
//! owners (synchronous state machines) take from it without waiting; whoever drops the
//! [`BytePermit`] gives the bytes back and kicks the owners that found it full, so deliveries
//! wait for room instead of piling up in memory.
//!
//! The broker holds one node-wide budget (every delivery read from disk and not yet handed to
//! the socket); a server adds one per connection (its outbound bytes), so that one stalled
//! connection cannot take the whole node's budget. A request larger than the capacity is
//! clamped to it: such a message goes out alone, never deadlocks.
//!
//! Async tasks (stream readers) wait for room with [`ByteBudget::take`] instead of registering
//! an owner to kick.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, Notify};

use crate::partition::owner::Command;

/// A byte budget; see the module documentation.
#[derive(Debug)]
pub struct ByteBudget {
    capacity_bytes: u64,
    used_bytes: AtomicU64,
    /// Owners to kick when bytes come back: at most one entry per partition owner (deduplicated
    /// by channel), so bounded by the node's partitions.
    waiters: Mutex<Vec<mpsc::UnboundedSender<Command>>>,
    /// Whether `waiters` may be non-empty. Takes and releases that find room (every delivery,
    /// on every partition and connection) touch only the atomics; the lock is for the rare
    /// wait. No lost wake-up: a waiter sets this flag, then checks `used_bytes` again; a release
    /// lowers `used_bytes`, then reads this flag (all `SeqCst`), so at least one of the two sees
    /// the other's write.
    has_waiters: AtomicBool,
    /// Tasks waiting in [`ByteBudget::take`] are woken through this, and only when
    /// `has_task_waiters` is set (the same no-lost-wake-up argument as `has_waiters`: the task
    /// enables its wake-up, sets the flag, then tries again).
    released: Notify,
    has_task_waiters: AtomicBool,
}

impl ByteBudget {
    /// A budget of `capacity_bytes` (at least 1).
    pub fn new(capacity_bytes: u64) -> Arc<ByteBudget> {
        Arc::new(ByteBudget {
            capacity_bytes: capacity_bytes.max(1),
            used_bytes: AtomicU64::new(0),
            waiters: Mutex::new(Vec::new()),
            has_waiters: AtomicBool::new(false),
            released: Notify::new(),
            has_task_waiters: AtomicBool::new(false),
        })
    }

    /// The capacity.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes taken and not given back.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Acquire)
    }

    /// What a request of `bytes` takes: clamped to the capacity, so that a message larger than
    /// the whole budget can still go out (alone).
    fn charge(&self, bytes: u64) -> u64 {
        bytes.clamp(1, self.capacity_bytes)
    }

    fn fits(&self, used: u64, bytes: u64) -> bool {
        used.saturating_add(self.charge(bytes)) <= self.capacity_bytes
    }

    /// Take `bytes` if they fit now.
    pub fn try_take(self: &Arc<Self>, bytes: u64) -> Option<BytePermit> {
        let charge = self.charge(bytes);
        self.used_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                self.fits(used, bytes).then_some(used + charge)
            })
            .ok()
            .map(|_| BytePermit {
                budget: self.clone(),
                bytes: charge,
            })
    }

    /// Take `bytes`, waiting until they fit (cancel-safe: a dropped wait holds nothing).
    pub async fn take(self: &Arc<Self>, bytes: u64) -> BytePermit {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            self.has_task_waiters.store(true, Ordering::SeqCst);
            if let Some(permit) = self.try_take(bytes) {
                return permit;
            }
            released.await;
        }
    }

    /// Take `bytes` if they fit; otherwise register `waker` to be kicked when bytes come back.
    pub(crate) fn take_or_wait(
        self: &Arc<Self>,
        bytes: u64,
        waker: &mpsc::UnboundedSender<Command>,
    ) -> Option<BytePermit> {
        if let Some(permit) = self.try_take(bytes) {
            return Some(permit);
        }
        self.register(waker);
        // A release between the failed take and the registration did not see the flag: try
        // once more (a kick that then finds room is harmless).
        self.try_take(bytes)
    }

    /// True if `bytes` fit now; otherwise `waker` is registered as by [`Self::take_or_wait`].
    pub(crate) fn room_or_wait(&self, bytes: u64, waker: &mpsc::UnboundedSender<Command>) -> bool {
        let room = || self.fits(self.used_bytes.load(Ordering::SeqCst), bytes);
        if room() {
            return true;
        }
        self.register(waker);
        room()
    }

    fn register(&self, waker: &mpsc::UnboundedSender<Command>) {
        let mut waiters = lock(&self.waiters);
        if !waiters.iter().any(|w| w.same_channel(waker)) {
            waiters.push(waker.clone());
        }
        self.has_waiters.store(true, Ordering::SeqCst);
    }

    fn release(&self, bytes: u64) {
        let _ = self
            .used_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                Some(used.saturating_sub(bytes))
            });
        // A load first: releases on the queue delivery path touch the flag's cache line only
        // to read it while no task waits.
        if self.has_task_waiters.load(Ordering::SeqCst)
            && self.has_task_waiters.swap(false, Ordering::SeqCst)
        {
            self.released.notify_waiters();
        }
        if !self.has_waiters.load(Ordering::SeqCst) {
            return;
        }
        let waiters = {
            let mut waiters = lock(&self.waiters);
            self.has_waiters.store(false, Ordering::SeqCst);
            std::mem::take(&mut *waiters)
        };
        for waiter in waiters {
            // A closed channel is an owner that is gone: nothing to wake.
            let _ = waiter.send(Command::Kick);
        }
    }
}

/// Bytes taken from a [`ByteBudget`]; given back when dropped.
#[derive(Debug)]
pub struct BytePermit {
    budget: Arc<ByteBudget>,
    bytes: u64,
}

impl BytePermit {
    /// The bytes this permit holds (the request clamped to the budget's capacity).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for BytePermit {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_up_to_the_capacity_and_clamps_an_oversize_request() {
        let budget = ByteBudget::new(100);
        let (waker, mut kicks) = mpsc::unbounded_channel();
        let a = budget.take_or_wait(60, &waker).expect("fits");
        assert!(budget.take_or_wait(60, &waker).is_none(), "over capacity");
        assert!(kicks.try_recv().is_err());
        drop(a);
        assert!(
            matches!(kicks.try_recv(), Ok(Command::Kick)),
            "waiter kicked"
        );
        assert_eq!(budget.used_bytes(), 0);
        let big = budget.take_or_wait(1_000, &waker).expect("alone, clamped");
        assert_eq!(big.bytes(), 100);
        assert!(!budget.room_or_wait(1, &waker));
        drop(big);
        assert!(budget.room_or_wait(1_000, &waker));
    }

    #[tokio::test]
    async fn a_task_waits_for_room_and_is_woken_by_a_release() {
        let budget = ByteBudget::new(100);
        let held = budget.take(80).await;
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.take(50).await.bytes() }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "no room yet");
        drop(held);
        let taken = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("woken by the release")
            .expect("task");
        assert_eq!(taken, 50);
        assert_eq!(
            budget.used_bytes(),
            0,
            "its permit was dropped with the task's result"
        );
        let oversize = budget.take(1_000).await;
        assert_eq!(oversize.bytes(), 100, "clamped: goes out alone");
    }
}
