//! The writer task of one connection (over TCP or TLS, `stream.rs`): drains the bounded write queue in batches into a buffered
//! socket and flushes when the queue is empty (or a batch is full), so many groups' small frames
//! share one write syscall. Large payloads bypass the buffer (`BufWriter` writes them directly),
//! so a payload is never copied twice.

use std::sync::Arc;

use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, watch};

use crate::connection::{CloseMode, Connection, Outgoing};
use crate::stats::{add, Stats};

/// Socket write buffer: 64 KiB holds about 1,500 heartbeat-sized frames, and is the usual
/// socket send-buffer step, so one flush is one or a few `write` calls.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;
/// Frames per batch before a flush even if more are queued, so the peer sees progress under a
/// sustained load: 1,024 frames of 64 bytes fill the buffer once.
const WRITE_BATCH_FRAMES_MAX: usize = 1024;

/// Writes queued frames until the connection closes or the socket fails; returns why it stopped.
pub(crate) async fn run_writer<W: AsyncWrite + Unpin>(
    connection: Arc<Connection>,
    mut queue: mpsc::Receiver<Outgoing>,
    socket: W,
    stats: Arc<Stats>,
) -> Result<(), String> {
    let mut socket = BufWriter::with_capacity(WRITE_BUFFER_BYTES, socket);
    let mut close_signal = connection.close_signal();
    loop {
        let first = tokio::select! {
            biased;
            mode = wait_close(&mut close_signal) => {
                if mode == CloseMode::Drain {
                    drain(&mut queue, &mut socket, &stats).await?;
                    let _ = socket.shutdown().await;
                }
                return Ok(());
            }
            first = queue.recv() => first,
        };
        let Some(first) = first else { return Ok(()) };
        let batch = tokio::select! {
            biased;
            _ = wait_now(&mut close_signal) => return Ok(()),
            batch = write_batch(first, &mut queue, &mut socket, &stats) => batch,
        };
        batch.map_err(|error| format!("write failed: {error}"))?;
    }
}

async fn write_batch<W: AsyncWrite + Unpin>(
    first: Outgoing,
    queue: &mut mpsc::Receiver<Outgoing>,
    socket: &mut BufWriter<W>,
    stats: &Stats,
) -> std::io::Result<()> {
    write_one(first, socket).await?;
    let mut frames = 1;
    let mut yielded = false;
    while frames < WRITE_BATCH_FRAMES_MAX {
        let next = match queue.try_recv() {
            Ok(next) => next,
            // Once per batch, let the tasks that are about to queue (other groups' calls, the
            // handlers' replies) run before flushing: more frames per write, for one scheduler
            // round of latency.
            Err(_) if !yielded => {
                yielded = true;
                tokio::task::yield_now().await;
                continue;
            }
            Err(_) => break,
        };
        write_one(next, socket).await?;
        frames += 1;
    }
    socket.flush().await?;
    add(&stats.frames_written, frames as u64);
    add(&stats.write_batches, 1);
    Ok(())
}

async fn write_one<W: AsyncWrite + Unpin>(
    outgoing: Outgoing,
    socket: &mut BufWriter<W>,
) -> std::io::Result<()> {
    socket.write_all(&outgoing.frame.head).await?;
    if !outgoing.frame.tail.is_empty() {
        socket.write_all(&outgoing.frame.tail).await?;
    }
    Ok(())
}

/// Writes whatever is queued now, bounded by one batch: the `Error` frame before a close.
async fn drain<W: AsyncWrite + Unpin>(
    queue: &mut mpsc::Receiver<Outgoing>,
    socket: &mut BufWriter<W>,
    stats: &Stats,
) -> Result<(), String> {
    if let Ok(first) = queue.try_recv() {
        write_batch(first, queue, socket, stats)
            .await
            .map_err(|error| format!("write failed: {error}"))?;
    }
    Ok(())
}

async fn wait_close(signal: &mut watch::Receiver<CloseMode>) -> CloseMode {
    match signal.wait_for(|mode| *mode != CloseMode::Open).await {
        Ok(mode) => *mode,
        Err(_) => CloseMode::Now,
    }
}

async fn wait_now(signal: &mut watch::Receiver<CloseMode>) {
    let _ = signal.wait_for(|mode| *mode == CloseMode::Now).await;
}
