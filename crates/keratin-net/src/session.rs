//! One connection's life after its handshake: install it in the peer's slot, start its writer,
//! read and dispatch frames (replies to our calls, requests for our handler, heartbeats, pings,
//! labels)
//! until the socket ends, a protocol error, the idle timeout, shutdown or the peer's retirement
//! (removed, or moved to another address); then close it so every waiter learns. Serving
//! requests belongs to `serve.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{debug, info, warn};

use crate::connection::{CloseMode, Connection};
use crate::context::{wait_shutdown, Context};
use crate::error::{FrameError, RemoteError};
use crate::frame::Frame;
use crate::peer::{wait_retired, Peer};
use crate::serve::{serve_heartbeats, serve_request};
use crate::stats::add;
use crate::stream::{Established, PeerStream};
use crate::writer::run_writer;

/// Read chunk: at least this much room is made before each read, 64 KiB like the write buffer,
/// and at most the rest of the frame being read, so an oversize prefix never grows the buffer.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// How long the writer gets to send an `Error` frame before the socket is dropped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);

/// Why reading stopped.
enum ReadEnd {
    /// Shutdown, replaced by a newer connection, the peer retired, or the peer closed cleanly.
    Closed,
    /// The socket failed or went idle.
    Lost(String),
    /// The peer broke the protocol; we tell it with an `Error` frame.
    Protocol(FrameError),
    /// The peer sent an `Error` frame.
    PeerError(RemoteError),
}

/// Runs an established connection to `peer` until it ends; returns after it is closed and
/// removed from the peer's slot.
pub(crate) async fn run_session(context: Arc<Context>, peer: Arc<Peer>, stream: Established) {
    match stream {
        Established::Plain(stream) => run_session_on(context, peer, stream).await,
        Established::Tls(stream) => run_session_on(context, peer, *stream).await,
    }
}

async fn run_session_on<S: PeerStream>(context: Arc<Context>, peer: Arc<Peer>, stream: S) {
    let generation = context.next_generation();
    let (read, write) = stream.split_owned();
    let (connection, queue) = Connection::new(
        peer.id,
        generation,
        &context.options,
        Arc::clone(&peer.liveness),
    );
    let connection = Arc::new(connection);
    peer.install(Arc::clone(&connection));
    info!(peer = peer.id, addr = %peer.addr, "cluster peer connected");
    let writer = tokio::spawn(run_writer(
        Arc::clone(&connection),
        queue,
        write,
        Arc::clone(&context.stats),
    ));
    // The peer learns this node's label at once, not at the next ping.
    if let Some(label) = context.label_frame() {
        let _ = connection.try_send(&label);
    }
    let end = read_frames(&context, &peer, &connection, read).await;
    let mode = match end {
        ReadEnd::Closed => CloseMode::Now,
        ReadEnd::Lost(reason) => {
            info!(peer = peer.id, %reason, "cluster connection lost");
            peer.liveness.set_error(reason);
            CloseMode::Now
        }
        ReadEnd::Protocol(error) => {
            warn!(peer = peer.id, %error, "cluster peer broke the protocol; closing");
            add(&context.stats.protocol_errors, 1);
            peer.liveness.set_error(format!("protocol error: {error}"));
            let _ = connection.try_send(&Frame::Error(RemoteError::new(
                error.code(),
                error.to_string(),
            )));
            CloseMode::Drain
        }
        ReadEnd::PeerError(error) => {
            warn!(peer = peer.id, %error, "cluster peer closed with an error");
            add(&context.stats.protocol_errors, 1);
            peer.liveness.set_error(format!("peer reported: {error}"));
            CloseMode::Now
        }
    };
    peer.uninstall(generation);
    connection.close(mode);
    match tokio::time::timeout(DRAIN_TIMEOUT, writer).await {
        Ok(Ok(Err(reason))) => debug!(peer = peer.id, %reason, "cluster writer stopped"),
        Ok(_) => {}
        Err(_) => connection.close(CloseMode::Now),
    }
}

async fn read_frames<R: AsyncRead + Unpin>(
    context: &Context,
    peer: &Peer,
    connection: &Arc<Connection>,
    mut read: R,
) -> ReadEnd {
    let mut buffer = BytesMut::with_capacity(READ_CHUNK_BYTES);
    let mut shutdown = context.shutdown_signal();
    let mut closed = connection.close_signal();
    // Checked here and not only by `Peer::retire`, which closes the connection it finds: a
    // connection installed just after the retirement is closed by this branch.
    let mut retired = peer.standing_signal();
    let mut ping = tokio::time::interval(context.options.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_read = Instant::now();
    loop {
        let frame = loop {
            match Frame::check(&buffer, context.options.frame_size_bytes_max) {
                Err(error) => return ReadEnd::Protocol(error),
                Ok(Some(size)) => break buffer.split_to(size).freeze(),
                Ok(None) => {}
            }
            reserve(&mut buffer);
            tokio::select! {
                _ = wait_shutdown(&mut shutdown) => return ReadEnd::Closed,
                _ = closed.wait_for(|mode| *mode != CloseMode::Open) => return ReadEnd::Closed,
                _ = wait_retired(&mut retired) => return ReadEnd::Closed,
                _ = ping.tick() => {
                    if last_read.elapsed() > context.options.idle_timeout {
                        return ReadEnd::Lost(format!(
                            "nothing received for {} ms (idle timeout)",
                            context.options.idle_timeout.as_millis()
                        ));
                    }
                    let _ = connection.try_send(&Frame::Ping { nonce: peer.liveness.now_us() });
                    // Refreshed with every ping, so a label lost with a connection (or one
                    // a peer dropped) is back within a ping interval.
                    if let Some(label) = context.label_frame() {
                        let _ = connection.try_send(&label);
                    }
                }
                read_result = read.read_buf(&mut buffer) => match read_result {
                    Ok(0) if buffer.is_empty() => return ReadEnd::Closed,
                    Ok(0) => return ReadEnd::Lost("connection closed in the middle of a frame".to_string()),
                    Ok(_) => last_read = Instant::now(),
                    Err(error) => return ReadEnd::Lost(format!("read failed: {error}")),
                },
            }
        };
        add(&context.stats.frames_read, 1);
        peer.liveness.touch();
        let frame = match Frame::decode(frame) {
            Ok(frame) => frame,
            Err(error) => return ReadEnd::Protocol(error),
        };
        if let Some(end) = dispatch(context, peer, connection, frame) {
            return end;
        }
    }
}

/// Makes room for the next read: up to the rest of the current frame (known from its prefix,
/// which `Frame::check` has already bounded), at least one chunk.
fn reserve(buffer: &mut BytesMut) {
    let wanted = Frame::pending_size(buffer)
        .map_or(READ_CHUNK_BYTES, |size| size.saturating_sub(buffer.len()))
        .clamp(1, READ_CHUNK_BYTES);
    buffer.reserve(wanted);
}

fn dispatch(
    context: &Context,
    peer: &Peer,
    connection: &Arc<Connection>,
    frame: Frame,
) -> Option<ReadEnd> {
    match frame {
        Frame::Request {
            request_id,
            group,
            kind,
            body,
        } => serve_request(context, peer.id, connection, request_id, group, kind, body),
        Frame::Response { request_id, body } => connection.resolve(request_id, Ok(body)),
        Frame::Refusal { request_id, error } => connection.resolve(request_id, Err(error)),
        Frame::HeartbeatBatch { batch_id, entries } => {
            serve_heartbeats(context, peer.id, connection, batch_id, entries);
        }
        Frame::HeartbeatReplies { batch_id, replies } => {
            connection.resolve_batch(batch_id, replies)
        }
        Frame::Ping { nonce } => {
            let _ = connection.try_send(&Frame::Pong { nonce });
        }
        Frame::Pong { nonce } => peer.liveness.pong(nonce),
        Frame::Label { label } => context.handler.label(peer.id, label),
        Frame::Error(error) => return Some(ReadEnd::PeerError(error)),
    }
    None
}
