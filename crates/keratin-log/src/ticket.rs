//! `Ticket`: the answer to a request handed to the commit thread, waited for by blocking or by
//! `.await`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::error::{LogError, LogResult};

/// A request's outcome, delivered by the commit thread once the disk has answered. For an
/// append it resolves only after the `fdatasync` that covers the records.
#[derive(Debug)]
pub struct Ticket<T> {
    rx: oneshot::Receiver<LogResult<T>>,
    dir: std::path::PathBuf,
}

pub(crate) type Reply<T> = oneshot::Sender<LogResult<T>>;

impl<T> Ticket<T> {
    pub(crate) fn new(dir: std::path::PathBuf) -> (Reply<T>, Ticket<T>) {
        let (tx, rx) = oneshot::channel();
        (tx, Ticket { rx, dir })
    }

    /// Block the calling thread until the outcome is known. Do not call it from inside an async
    /// runtime: `.await` the ticket there instead.
    pub fn wait(self) -> LogResult<T> {
        let dir = self.dir;
        self.rx
            .blocking_recv()
            .unwrap_or(Err(LogError::Closed { dir }))
    }
}

impl<T> Future for Ticket<T> {
    type Output = LogResult<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(result)) => Poll::Ready(result),
            Poll::Ready(Err(_)) => Poll::Ready(Err(LogError::Closed {
                dir: self.dir.clone(),
            })),
            Poll::Pending => Poll::Pending,
        }
    }
}
