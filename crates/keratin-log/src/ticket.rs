//! `Ticket`: the answer to a request handed to the commit workers, waited for by blocking or by
//! `.await`.
//!
//! A small one-shot slot of our own rather than an async runtime's channel: a commit worker is a
//! plain thread that answers directly (waking a task is cheap), and `Ticket::wait` must work
//! anywhere — including inside an async runtime's worker (as `Log::close` and `Drop` do), where
//! a runtime's blocking receive would panic.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use crate::error::{LogError, LogResult};

#[derive(Debug)]
enum Slot<T> {
    Waiting(Option<Waker>),
    Ready(LogResult<T>),
    /// The sender went away without answering (the log's writer is gone).
    Dropped,
    Taken,
}

#[derive(Debug)]
struct Shared<T> {
    slot: Mutex<Slot<T>>,
    ready: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Slot<T>> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fill(&self, value: Slot<T>) {
        let waker = {
            let mut slot = self.lock();
            match std::mem::replace(&mut *slot, value) {
                Slot::Waiting(waker) => waker,
                // Answered already: keep the first answer.
                previous => {
                    *slot = previous;
                    None
                }
            }
        };
        self.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The sending half, queued with the request.
#[derive(Debug)]
pub(crate) struct Reply<T> {
    shared: Option<Arc<Shared<T>>>,
}

impl<T> Reply<T> {
    /// Answer; the result is dropped if the ticket is gone.
    pub(crate) fn send(mut self, result: LogResult<T>) {
        if let Some(shared) = self.shared.take() {
            shared.fill(Slot::Ready(result));
        }
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            shared.fill(Slot::Dropped);
        }
    }
}

/// A request's outcome, delivered by a commit worker once the disk has answered. For an
/// append it resolves only after the `fdatasync` that covers the records.
#[derive(Debug)]
pub struct Ticket<T> {
    shared: Arc<Shared<T>>,
    dir: PathBuf,
}

impl<T> Ticket<T> {
    pub(crate) fn new(dir: PathBuf) -> (Reply<T>, Ticket<T>) {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot::Waiting(None)),
            ready: Condvar::new(),
        });
        (
            Reply {
                shared: Some(shared.clone()),
            },
            Ticket { shared, dir },
        )
    }

    fn take(slot: &mut Slot<T>, dir: &std::path::Path) -> Option<LogResult<T>> {
        match std::mem::replace(slot, Slot::Taken) {
            Slot::Ready(result) => Some(result),
            Slot::Dropped | Slot::Taken => Some(Err(LogError::Closed {
                dir: dir.to_path_buf(),
            })),
            waiting @ Slot::Waiting(_) => {
                *slot = waiting;
                None
            }
        }
    }

    /// Block the calling thread until the outcome is known. Inside an async runtime prefer
    /// `.await`: this blocks the worker thread (it does not panic).
    pub fn wait(self) -> LogResult<T> {
        let mut slot = self.shared.lock();
        loop {
            if let Some(result) = Self::take(&mut slot, &self.dir) {
                return result;
            }
            slot = self
                .shared
                .ready
                .wait(slot)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl<T> Future for Ticket<T> {
    type Output = LogResult<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut slot = this.shared.lock();
        if let Some(result) = Self::take(&mut slot, &this.dir) {
            return Poll::Ready(result);
        }
        *slot = Slot::Waiting(Some(cx.waker().clone()));
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_gets_the_answer_or_closed() {
        let (reply, ticket) = Ticket::<u32>::new(PathBuf::from("/x"));
        std::thread::spawn(move || reply.send(Ok(7)));
        assert_eq!(ticket.wait().expect("answer"), 7);
        let (reply, ticket) = Ticket::<u32>::new(PathBuf::from("/x"));
        drop(reply);
        assert!(matches!(ticket.wait(), Err(LogError::Closed { .. })));
    }
}
