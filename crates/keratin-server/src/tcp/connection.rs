//! One protocol connection: the handshake, then a reader loop that dispatches frames and a
//! writer task that owns the socket's sending half.
//!
//! Bounds: at most `publish_frames_inflight_max` publish frames await their outcome (then the
//! reader stops reading: TCP flow control), at most `outbound_frames_max` frames wait to be
//! sent (then deliveries and confirms wait, and a consumer's prefetch stops the broker), and at
//! most `outbound_bytes_max` delivery bytes are taken for the connection and not yet handed to
//! its socket (the broker takes them before it reads a message for one of the connection's
//! consumers; the writer gives them back once the frame is flushed), so a client that never
//! reads holds the server's memory at a fixed size, in frames and in bytes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use futures_util::SinkExt;
use keratin_broker::{
    Broker, BrokerError, ByteBudget, DeliveryPermit, DeliveryTag, Settler, SubscribeOptions,
};
use keratin_proto::codes::{ERR_BAD_REQUEST, ERR_CONFLICT, ERR_INTERNAL, ERR_NOT_FOUND};
use keratin_proto::frame::{
    Ack, Cancel, Close, Confirm, ConsumerEnd, Declare, Deliver, ErrorFrame, Frame, Header, OkReply,
    Publish, PublishError, PublishIdRange, PublishMode, QueueInfoReply, QueueListReply,
    QueueSummary, Reject, SubscribeOk,
};
use keratin_proto::{
    Auth, ClientHello, ErrorBody, FrameCodec, NodeAddress, ServerHello, ServerInfo,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::codec::FramedWrite;

use super::errors::error_body;
use super::incoming::{FrameReader, Incoming};
use super::stream::ProtocolStream;
use super::TcpOptions;
use crate::access::{Grant, Login};
use crate::audit::{AuditEntry, Via};
use crate::convert;
use crate::quota::Admission;
use keratin_auth::Permission;
use keratin_limits::MemoryClaim;
use keratin_proto::codes::ERR_UNAUTHENTICATED;
use keratin_proto::LimitReason;

mod streams;

/// A frame to send, with the delivery budget bytes it holds until it is flushed (none for
/// frames other than `Deliver`).
type Outgoing = (Frame, DeliveryPermit);
type Outbound = mpsc::Sender<Outgoing>;

/// A connection's unacknowledged deliveries by delivery id: the consumer tag and the broker's tag.
type Unacked = HashMap<u64, (Arc<str>, DeliveryTag)>;

/// A consumer of this connection.
struct ConsumerEntry {
    settler: Settler,
    forwarder: JoinHandle<()>,
    prefetch: u32,
    /// The memory of its unacknowledged deliveries' bookkeeping, claimed for its whole prefetch.
    _memory: MemoryClaim,
}

/// Most consumers on one connection. Each costs a forwarder task, a link in every partition of
/// its queue (up to 64, walked on each delivery round) and a delivery channel; 1,024 is far more
/// than a client needs (consumers are per queue) and keeps a connection's consumers under a few
/// MiB even on 64-partition queues.
pub(crate) const CONSUMERS_PER_CONNECTION_MAX: usize = 1024;

/// Most unacknowledged deliveries on one connection, summed over its consumers' prefetch. At
/// [`UNACKED_BOOKKEEPING_BYTES`] each, 262,144 bound a connection's unacked bookkeeping at about
/// 25 MiB whatever its consumers ask for (one consumer may still use the largest prefetch,
/// 65,535).
pub(crate) const PREFETCH_PER_CONNECTION_MAX: u64 = 1 << 18;

/// The bookkeeping of one unacknowledged delivery: an entry in the connection's delivery map and
/// one in its partition's inflight map, about 100 bytes. A consumer claims this much memory per
/// unit of prefetch when it subscribes.
pub(crate) const UNACKED_BOOKKEEPING_BYTES: u64 = 100;

/// What the reader loop keeps.
struct Conn {
    broker: Broker,
    options: Arc<TcpOptions>,
    out: Outbound,
    publish_permits: Arc<Semaphore>,
    /// The node-wide budget of unanswered publish bytes, in KiB permits.
    publish_bytes: Arc<Semaphore>,
    consumers: HashMap<String, ConsumerEntry>,
    /// Stream readers by consumer tag (one tag space with `consumers`).
    readers: HashMap<String, streams::ReaderEntry>,
    /// Unacknowledged deliveries by delivery id: the consumer tag (shared, not copied per
    /// delivery: a tag may be 64 KiB) and the broker's tag.
    deliveries: Arc<Mutex<Unacked>>,
    next_delivery: Arc<AtomicU64>,
    /// Delivery bytes taken for this connection's consumers and not yet flushed to its socket.
    outbound_bytes: Arc<ByteBudget>,
    /// The protocol version agreed in the handshake.
    version: u16,
    /// Who logged in, and what it may do.
    grant: Grant,
    /// The client's address, for the audit trail.
    peer: SocketAddr,
}

pub(super) async fn run<S: ProtocolStream>(
    stream: S,
    peer: SocketAddr,
    broker: Broker,
    options: Arc<TcpOptions>,
    publish_bytes: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    let (stream, leftover, version, grant) = match handshake(stream, peer, &options).await {
        Some(accepted) => accepted,
        None => return,
    };
    tracing::debug!(%peer, "connection open");
    let codec =
        FrameCodec::with_frame_size_bytes_max(options.frame_size_bytes_max).with_version(version);
    let (read_half, write_half) = stream.split_owned();
    let mut frames = FrameReader::new(
        read_half,
        codec.clone(),
        leftover,
        options.memory_claims.clone(),
    );
    let sink = FramedWrite::new(write_half, codec);
    let (out, out_rx) = mpsc::channel(options.outbound_frames_max);
    let writer = tokio::spawn(write_frames(sink, out_rx, options.heartbeat_interval));
    let mut conn = Conn {
        broker,
        publish_permits: Arc::new(Semaphore::new(options.publish_frames_inflight_max)),
        publish_bytes,
        options: options.clone(),
        out,
        consumers: HashMap::new(),
        readers: HashMap::new(),
        deliveries: Arc::new(Mutex::new(HashMap::new())),
        next_delivery: Arc::new(AtomicU64::new(1)),
        outbound_bytes: ByteBudget::new(options.outbound_bytes_max as u64),
        version,
        grant,
        peer,
    };
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(options.idle_timeout, frames.next()) => next,
            _ = stop.changed() => {
                conn.send(Frame::Close(Close { message: "server shutting down".into() })).await;
                break;
            }
        };
        let frame = match next {
            Err(_) => {
                conn.fatal(ErrorBody::new(
                    ERR_BAD_REQUEST,
                    "no frame or heartbeat for too long; closing",
                ))
                .await;
                break;
            }
            Ok(Incoming::Closed) => break,
            Ok(Incoming::Bad(error)) => {
                tracing::debug!(%peer, %error, "bad frame; closing");
                conn.fatal(error.to_error_body()).await;
                break;
            }
            Ok(Incoming::NoMemory {
                size_bytes,
                refused,
            }) => {
                tracing::warn!(%peer, size_bytes, %refused, "no memory for a large frame; closing");
                conn.fatal(frame_refusal(size_bytes, &refused)).await;
                break;
            }
            Ok(Incoming::Frame(frame, claim)) => (frame, claim),
        };
        let (frame, claim) = frame;
        if !conn.dispatch(frame, claim).await {
            break;
        }
    }
    conn.finish().await;
    drop(conn);
    let _ = tokio::time::timeout(options.drain_timeout, writer).await;
    tracing::debug!(%peer, "connection closed");
}

/// Read the client's hello, log it in, and answer it; the bytes read past the hello, the
/// agreed protocol version and what the login may do are returned.
async fn handshake<S: ProtocolStream>(
    mut stream: S,
    peer: SocketAddr,
    options: &TcpOptions,
) -> Option<(S, BytesMut, u16, Grant)> {
    let mut buf = BytesMut::with_capacity(256);
    let hello = read_hello(&mut stream, &mut buf, options.handshake_timeout).await?;
    let info = server_info(options, stream.local_addr());
    let mut answer = ServerHello::answer(&hello, options.node_id.clone(), info);
    let mut grant = None;
    if let ServerHello::Accepted { version, user, .. } = &mut answer {
        match login(&hello, peer, &stream, options).await {
            Ok(logged_in) => {
                *user = logged_in.identity().user().map(str::to_string);
                grant = Some(logged_in);
            }
            Err(error) => {
                tracing::info!(%peer, client = hello.client_name, error = error.message(), "login refused");
                audit_login_refused(options, peer, &hello, &error);
                answer = ServerHello::Refused {
                    version: *version,
                    error,
                };
            }
        }
    }
    let mut out = BytesMut::new();
    answer.encode(&mut out).ok()?;
    stream.write_all(&out).await.ok()?;
    match answer {
        ServerHello::Accepted { version, .. } => Some((stream, buf, version, grant?)),
        ServerHello::Refused { .. } => None,
    }
}

/// Log a hello in: what it may do, or the 401 that refuses it.
async fn login<S: ProtocolStream>(
    hello: &ClientHello,
    peer: SocketAddr,
    stream: &S,
    options: &TcpOptions,
) -> Result<Grant, ErrorBody> {
    let Some(access) = &options.access else {
        return Ok(Grant::anyone());
    };
    let presented = presented_login(hello, stream);
    let secret = matches!(presented, Login::Password { .. } | Login::Token(_));
    let on_loopback = stream.local_addr().is_some_and(|a| a.ip().is_loopback());
    if secret && !stream.is_tls() && !on_loopback && !options.insecure {
        return Err(ErrorBody::new(
            ERR_UNAUTHENTICATED,
            "a password or token over plain TCP off loopback would travel in the clear: \
             connect with TLS (the node's server.tls_cert_file; the client's --ca), or start \
             the node with --insecure",
        ));
    }
    let identity = access.login(&presented, peer.ip()).await?;
    Ok(access.grant(identity))
}

/// Record a refused protocol login (folded per source IP by the trail).
fn audit_login_refused(
    options: &TcpOptions,
    peer: SocketAddr,
    hello: &ClientHello,
    error: &ErrorBody,
) {
    let Some(audit) = &options.audit else {
        return;
    };
    let user = match &hello.auth {
        Auth::Plain { user, .. } => Some(user.as_str()),
        _ => None,
    };
    audit.login_refused(Via::Protocol, Some(peer), user, error.message());
}

/// What the hello presents to log in with (a certificate login: the verified certificate's
/// common name).
fn presented_login<S: ProtocolStream>(hello: &ClientHello, stream: &S) -> Login {
    match &hello.auth {
        Auth::None => Login::Nothing,
        Auth::Plain { user, password } => Login::Password {
            user: user.clone(),
            password: password.clone(),
        },
        Auth::Token(token) => Login::Token(token.clone()),
        Auth::External => Login::Certificate(stream.peer_common_name()),
    }
}

/// What the handshake tells a client about where to reach this node: its admin address and the
/// cluster's nodes, this one first (this node alone outside a cluster). A bound address on an
/// unspecified IP (`0.0.0.0`, `::`) is told as the IP the client reached (`local`) with the
/// bound port: an address the client can reach, unlike the wildcard. Peers whose entry would
/// break the protocol's bounds (a field over 255 bytes, more than 64 nodes) are left out.
fn server_info(options: &TcpOptions, local: Option<SocketAddr>) -> ServerInfo {
    let reachable = |bound: SocketAddr| match local {
        Some(local) if bound.ip().is_unspecified() => {
            SocketAddr::new(local.ip(), bound.port()).to_string()
        }
        _ => bound.to_string(),
    };
    let admin = options.admin_addr.map(reachable);
    let server = options
        .server_addr
        .map(reachable)
        .or(local.map(|a| a.to_string()));
    let mut nodes: Vec<NodeAddress> = server
        .map(|server| NodeAddress {
            node_id: options.node_id.clone(),
            server,
            admin: admin.clone(),
        })
        .into_iter()
        .collect();
    if let Some(peers) = &options.peers {
        let fits = |text: &str| text.len() <= keratin_proto::SERVER_INFO_FIELD_BYTES_MAX;
        for peer in (peers.0)() {
            if nodes.len() >= keratin_proto::SERVER_INFO_NODES_MAX {
                break;
            }
            let ok = fits(&peer.node_id)
                && fits(&peer.server)
                && peer.admin.as_deref().is_none_or(fits)
                && nodes.iter().all(|n| n.server != peer.server);
            if ok {
                nodes.push(peer);
            }
        }
    }
    ServerInfo {
        admin: admin.clone(),
        nodes,
    }
}

/// The client's hello, or `None` for a peer that is not speaking the protocol, closes, or is
/// too slow.
async fn read_hello<S: ProtocolStream>(
    stream: &mut S,
    buf: &mut BytesMut,
    timeout: std::time::Duration,
) -> Option<ClientHello> {
    tokio::time::timeout(timeout, async {
        loop {
            match ClientHello::decode(buf) {
                Ok(Some(hello)) => return Some(hello),
                Ok(None) => {}
                // Bad magic or a malformed hello: not our protocol, close without answering.
                Err(_) => return None,
            }
            if buf.len() > keratin_proto::handshake::CLIENT_HELLO_SIZE_MAX {
                return None;
            }
            match stream.read_buf(buf).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()?
}

/// Refuse a connection the node has no room for: read its hello, answer it refused with
/// `error` (the client shows it, for example 429 `connections`), and close.
pub(super) async fn refuse<S: ProtocolStream>(
    mut stream: S,
    options: Arc<TcpOptions>,
    error: ErrorBody,
) {
    let mut buf = BytesMut::with_capacity(256);
    if read_hello(&mut stream, &mut buf, options.handshake_timeout)
        .await
        .is_none()
    {
        return;
    }
    let answer = ServerHello::Refused {
        version: keratin_proto::PROTOCOL_VERSION,
        error,
    };
    let mut out = BytesMut::new();
    if answer.encode(&mut out).is_ok() {
        let _ = stream.write_all(&out).await;
    }
}

/// The writer task: sends queued frames, flushing when the queue runs dry, and a heartbeat when
/// nothing was sent for a while. The delivery budget bytes of the frames fed are given back
/// only after the flush: until then their encoded bytes sit in the sink's buffer.
async fn write_frames<W: tokio::io::AsyncWrite + Send + Unpin>(
    mut sink: FramedWrite<W, FrameCodec>,
    mut frames: mpsc::Receiver<Outgoing>,
    heartbeat: std::time::Duration,
) {
    // Bounded by the outbound channel: at most `outbound_frames_max` frames are fed per flush.
    let mut fed: Vec<DeliveryPermit> = Vec::new();
    loop {
        let (frame, permit) = match tokio::time::timeout(heartbeat, frames.recv()).await {
            Ok(Some(outgoing)) => outgoing,
            Ok(None) => break,
            Err(_) => (Frame::Heartbeat, DeliveryPermit::default()),
        };
        let closing = matches!(frame, Frame::Close(_)) || is_fatal(&frame);
        if sink.feed(frame).await.is_err() {
            return;
        }
        fed.push(permit);
        while let Ok((frame, permit)) = frames.try_recv() {
            if sink.feed(frame).await.is_err() {
                return;
            }
            fed.push(permit);
        }
        if SinkExt::<Frame>::flush(&mut sink).await.is_err() || closing {
            break;
        }
        fed.clear();
        shrink_retained(sink.write_buffer_mut());
    }
    let _ = SinkExt::<Frame>::close(&mut sink).await;
}

/// Buffer capacity a connection keeps between frames. A frame larger than this (up to the frame
/// size limit, 16 MiB) grows the buffer while it passes; keeping that capacity afterwards would
/// let each idle connection hold its largest frame's size (48 connections after one 8 MB
/// publish each held 384 MB). Reallocating for the next large frame is a copy, small next to
/// receiving or sending it.
const BUFFER_RETAINED_BYTES: usize = 64 << 10;

/// Give back a buffer's capacity beyond [`BUFFER_RETAINED_BYTES`], keeping its bytes (the start
/// of the next frame, when reading).
pub(super) fn shrink_retained(buf: &mut BytesMut) {
    if buf.capacity() > BUFFER_RETAINED_BYTES && buf.len() <= BUFFER_RETAINED_BYTES / 2 {
        let mut small = BytesMut::with_capacity(BUFFER_RETAINED_BYTES / 2);
        small.extend_from_slice(buf);
        *buf = small;
    }
}

/// The answer to a subscribe whose prefetch's bookkeeping found no memory: 429 `memory`.
fn consumer_refusal(prefetch: u32, refused: &keratin_limits::ClaimRefused) -> ErrorBody {
    let retry_after_ms = u32::try_from(refused.retry_after_ms).unwrap_or(u32::MAX);
    ErrorBody::limited(
        LimitReason::Memory,
        retry_after_ms,
        format!(
            "a consumer with prefetch {prefetch} was refused: {refused}; retry after \
             {retry_after_ms} ms, or subscribe with a smaller prefetch"
        ),
    )
}

/// The answer to a large frame that found no memory: 429 `memory`, and the connection closes
/// (the frame's body is still in the socket, unread).
fn frame_refusal(size_bytes: usize, refused: &keratin_limits::ClaimRefused) -> ErrorBody {
    let retry_after_ms = u32::try_from(refused.retry_after_ms).unwrap_or(u32::MAX);
    ErrorBody::limited(
        LimitReason::Memory,
        retry_after_ms,
        format!(
            "a frame of {size_bytes} bytes waited {} s for memory and was not read: {refused}; \
             the connection is closed; reconnect and retry after {retry_after_ms} ms, or send \
             smaller batches",
            super::incoming::FRAME_CLAIM_WAIT.as_secs()
        ),
    )
}

fn is_fatal(frame: &Frame) -> bool {
    matches!(frame, Frame::Error(ErrorFrame { fatal: true, .. }))
}

impl Conn {
    async fn send(&self, frame: Frame) {
        // The writer is gone only when the socket failed; the reader notices next.
        let _ = self.out.send((frame, DeliveryPermit::default())).await;
    }

    async fn fatal(&self, error: ErrorBody) {
        self.send(Frame::Error(ErrorFrame {
            request_id: None,
            fatal: true,
            error,
        }))
        .await;
    }

    async fn reply(&self, request_id: u64, result: Result<Frame, ErrorBody>) {
        let frame = result.unwrap_or_else(|error| {
            Frame::Error(ErrorFrame {
                request_id: Some(request_id),
                fatal: false,
                error,
            })
        });
        self.send(frame).await;
    }

    /// Wait until every publish received so far has been answered. The protocol promises that
    /// the reply to a request comes after the answers to every publish sent before it on the
    /// same connection: clients use a request as a barrier for buffered publishes.
    async fn publishes_answered(&self) {
        let all = self.options.publish_frames_inflight_max as u32;
        if let Ok(permits) = self.publish_permits.acquire_many(all).await {
            drop(permits);
        }
    }

    /// Handle one frame, holding the memory `claim` of a large one until its bytes are let go
    /// (a publish's when it is answered); false when the connection must end.
    async fn dispatch(&mut self, frame: Frame, claim: Option<MemoryClaim>) -> bool {
        let is_request = !matches!(
            frame,
            Frame::Publish(_)
                | Frame::Ack(_)
                | Frame::Reject(_)
                | Frame::Heartbeat
                | Frame::StreamCredit(_)
        );
        if is_request {
            self.publishes_answered().await;
        }
        if let Some((request_id, refused)) =
            self.refused(&frame).or_else(|| self.stream_refused(&frame))
        {
            self.audit_refused(&frame, &refused);
            self.reply(request_id, Err(refused)).await;
            return true;
        }
        match frame {
            Frame::Declare(d) => {
                let (request_id, queue) = (d.request_id, d.queue.clone());
                let result = self.declare(d).await;
                self.audited("queue.declare", &queue, &result);
                self.reply(request_id, result).await;
            }
            Frame::Delete(q) => {
                let result = match self.caught_up(&q.queue).await {
                    Ok(()) => ok(q.request_id, self.broker.delete(&q.queue).await),
                    Err(error) => Err(error),
                };
                self.audited("queue.delete", &q.queue, &result);
                self.reply(q.request_id, result).await;
            }
            Frame::Purge(q) => {
                let result = match self.caught_up(&q.queue).await {
                    Ok(()) => ok(q.request_id, self.broker.purge(&q.queue).await),
                    Err(error) => Err(error),
                };
                self.audited("queue.purge", &q.queue, &result);
                self.reply(q.request_id, result).await;
            }
            Frame::QueueInfo(q) => {
                let result = match self.caught_up(&q.queue).await {
                    Ok(()) => self.queue_info(q.request_id, &q.queue),
                    Err(error) => Err(error),
                };
                self.reply(q.request_id, result).await;
            }
            Frame::QueueList(l) => {
                let queues = self.queue_list();
                self.send(Frame::QueueListReply(QueueListReply {
                    request_id: l.request_id,
                    queues,
                }))
                .await;
            }
            Frame::SetQueueSettings(s) => {
                let update = s.update;
                let result = match self.caught_up(&s.queue).await {
                    Ok(()) => ok(
                        s.request_id,
                        self.broker
                            .update_queue_settings(&s.queue, |current| {
                                Ok(convert::apply_update(current, update))
                            })
                            .await,
                    ),
                    Err(error) => Err(error),
                };
                self.audited("queue.settings", &s.queue, &result);
                self.reply(s.request_id, result).await;
            }
            Frame::Publish(p) => self.publish(p, claim.map(Arc::new)).await,
            Frame::Subscribe(s) => self.subscribe(s).await,
            Frame::Cancel(c) => self.cancel(c).await,
            Frame::Ack(Ack { delivery_ids }) => self.settle(delivery_ids, None).await,
            Frame::Reject(Reject {
                delivery_ids,
                requeue,
            }) => self.settle(delivery_ids, Some(requeue)).await,
            Frame::Heartbeat => {}
            Frame::Close(_) => return false,
            stream if stream.frame_type().is_stream() => {
                if let Err(other) = self.stream_frame(stream).await {
                    self.client_sent_server_frame(other).await;
                }
            }
            other => self.client_sent_server_frame(other).await,
        }
        true
    }

    /// Answer a frame only a server sends.
    async fn client_sent_server_frame(&self, other: Frame) {
        let message = format!(
            "{} is a server-to-client frame; a client must not send it",
            other.frame_type().name()
        );
        self.send(Frame::Error(ErrorFrame {
            request_id: None,
            fatal: false,
            error: ErrorBody::new(ERR_BAD_REQUEST, message),
        }))
        .await;
    }

    /// The 403 of a request this connection's user may not make, with the request's id; a
    /// publish it may not make is answered with a `PublishError` here. `None`: allowed (or
    /// not a request on a queue).
    fn refused(&self, frame: &Frame) -> Option<(u64, ErrorBody)> {
        let (request_id, queue, permission) = match frame {
            Frame::Declare(d) => (d.request_id, &d.queue, Permission::Manage),
            Frame::Delete(q) | Frame::Purge(q) => (q.request_id, &q.queue, Permission::Manage),
            Frame::SetQueueSettings(s) => (s.request_id, &s.queue, Permission::Manage),
            Frame::Subscribe(s) => (s.request_id, &s.queue, Permission::Consume),
            Frame::QueueInfo(q) => {
                if self.grant.sees(&q.queue) {
                    return None;
                }
                let refused = self.grant.check(&q.queue, Permission::Consume).err()?;
                return Some((q.request_id, refused));
            }
            _ => return None,
        };
        let refused = self.grant.check(queue, permission).err()?;
        Some((request_id, refused))
    }

    /// Whether a request on `queue` may go on: see `Broker::catch_up_for` (a map lookup while
    /// the queue is known here; in a cluster, a catch-up with the cluster's metadata before
    /// "not found"). The error is the request's answer.
    async fn caught_up(&self, queue: &str) -> Result<(), ErrorBody> {
        self.broker
            .catch_up_for(queue)
            .await
            .map_err(|e| error_body(&e))
    }

    /// Declare; the caller records and answers it.
    async fn declare(&self, d: Declare) -> Result<Frame, ErrorBody> {
        let settings = convert::settings_from_wire(&d.settings);
        self.broker
            .declare_on(&d.queue, settings, d.nodes)
            .await
            .map(|_| {
                Frame::Ok(OkReply {
                    request_id: d.request_id,
                })
            })
            .map_err(|e| error_body(&e))
    }

    /// Record a manage verb's outcome in the audit trail.
    fn audited<T>(&self, action: &str, queue: &str, result: &Result<T, ErrorBody>) {
        let Some(audit) = &self.options.audit else {
            return;
        };
        let outcome = match result {
            Ok(_) => Ok(()),
            Err(error) => Err((error.code().0, error.message())),
        };
        let entry = AuditEntry::new(Via::Protocol, action, Some(queue))
            .by(self.grant.identity().user(), Some(self.peer))
            .with_outcome(outcome);
        audit.record(entry);
    }

    /// Record the refusal of a manage verb (other requests' refusals are not audited).
    fn audit_refused(&self, frame: &Frame, refused: &ErrorBody) {
        let (action, queue) = match frame {
            Frame::Declare(d) => ("queue.declare", &d.queue),
            Frame::Delete(q) => ("queue.delete", &q.queue),
            Frame::Purge(q) => ("queue.purge", &q.queue),
            Frame::SetQueueSettings(s) => ("queue.settings", &s.queue),
            _ => return,
        };
        self.audited::<()>(action, queue, &Err(refused.clone()));
    }

    fn queue_info(&self, request_id: u64, name: &str) -> Result<Frame, ErrorBody> {
        let info = self.broker.info(name).map_err(|e| error_body(&e))?;
        Ok(Frame::QueueInfoReply(QueueInfoReply {
            request_id,
            queue: info.name.clone(),
            settings: convert::settings_to_wire(&info.settings),
            partitions: info
                .partitions
                .iter()
                .map(convert::partition_info_to_wire)
                .collect(),
        }))
    }

    /// The queues this connection's user may do anything on.
    fn queue_list(&self) -> Vec<QueueSummary> {
        self.broker
            .list()
            .iter()
            .filter(|q| self.grant.sees(&q.name))
            .map(|q| QueueSummary {
                queue: q.name.clone(),
                partitions: q.partitions.len() as u32,
                ready: q.ready(),
                inflight: q.inflight(),
                bytes: q.bytes(),
            })
            .collect()
    }

    /// Hand the batch to the broker now (so that publishes keep their order per partition) and
    /// answer it from a task once the outcomes are known. A joinable frame for a queue with
    /// limits is handed over message by message: each is admitted on its own.
    async fn publish(&self, p: Publish, claim: Option<Arc<MemoryClaim>>) {
        if let Err(refused) = self.grant.check(&p.queue, Permission::Publish) {
            self.refuse_publish(&p, refused).await;
            return;
        }
        if let Err(refused) = self.quota(&p).await {
            self.refuse_publish(&p, refused).await;
            return;
        }
        // Before the broker routes it: a publish to a queue declared elsewhere a moment ago
        // waits here (reading nothing more, so the connection's publishes keep their order).
        if let Err(refused) = self.caught_up(&p.queue).await {
            self.refuse_publish(&p, refused).await;
            return;
        }
        if p.joinable && p.messages.len() > 1 && !self.broker.publishes_may_join(&p.queue) {
            for message in p.messages {
                self.publish_batch(
                    Publish {
                        queue: p.queue.clone(),
                        mode: p.mode,
                        messages: vec![message],
                        joinable: false,
                        producer_id: p.producer_id,
                    },
                    claim.clone(),
                )
                .await;
            }
            return;
        }
        self.publish_batch(p, claim).await;
    }

    /// Answer every message of `p` with `error`.
    async fn refuse_publish(&self, p: &Publish, error: ErrorBody) {
        let ids: Vec<u64> = p.messages.iter().map(|m| m.publish_id).collect();
        self.send(Frame::PublishError(PublishError {
            ranges: ranges(&ids),
            error,
        }))
        .await;
    }

    /// Hold a publish to its user's quota on this node: at once, after a short delay (the
    /// connection reads nothing meanwhile: back-pressure, like soft slowing), or the 429
    /// `quota` that refuses it with the time it needs.
    async fn quota(&self, p: &Publish) -> Result<(), ErrorBody> {
        let (Some(access), Some((user, quota))) = (&self.options.access, self.grant.quota()) else {
            return Ok(());
        };
        let bytes: u64 = p.messages.iter().map(|m| m.body.len() as u64).sum();
        let messages = p.messages.len() as u64;
        match access.quotas().admit_counted(&user, quota, messages, bytes) {
            Admission::Now => Ok(()),
            Admission::After(delay) => {
                tokio::time::sleep(delay).await;
                Ok(())
            }
            Admission::Refused(wait) => {
                let retry_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX).max(1);
                Err(ErrorBody::limited(
                    LimitReason::Quota,
                    retry_ms,
                    format!(
                        "user {user} is past its publish quota on this node ({}); retry after \
                         {retry_ms} ms",
                        quota_text(quota)
                    ),
                ))
            }
        }
    }

    /// Hand one all-or-nothing batch to the broker and answer it from a task, which holds the
    /// frame's memory `claim` until the answer.
    async fn publish_batch(&self, p: Publish, claim: Option<Arc<MemoryClaim>>) {
        let Ok(permit) = self.publish_permits.clone().acquire_owned().await else {
            return;
        };
        let bytes: usize = p.messages.iter().map(|m| m.body.len()).sum();
        let budget = self.options.publish_bytes_inflight_max / super::PUBLISH_PERMIT_BYTES;
        let kib = (bytes / super::PUBLISH_PERMIT_BYTES).clamp(1, budget.max(1)) as u32;
        let Ok(bytes_permit) = self.publish_bytes.clone().acquire_many_owned(kib).await else {
            return;
        };
        let ids: Vec<u64> = p.messages.iter().map(|m| m.publish_id).collect();
        let producer_id = p.producer_id;
        let messages = p
            .messages
            .into_iter()
            .map(|m| convert::message_from_wire(m, producer_id))
            .collect();
        let pending = if p.joinable {
            self.broker.publish_dispatch_joined(&p.queue, messages)
        } else {
            self.broker.publish_dispatch(&p.queue, messages)
        };
        let out = self.out.clone();
        let mode = p.mode;
        tokio::spawn(async move {
            let results = pending.wait().await;
            for frame in publish_answers(&ids, results, mode) {
                if out.send((frame, DeliveryPermit::default())).await.is_err() {
                    break;
                }
            }
            drop(permit);
            drop(bytes_permit);
            drop(claim);
        });
    }

    async fn subscribe(&mut self, s: keratin_proto::frame::Subscribe) {
        // Consumers the broker ended (their forwarder told the client with `ConsumerEnd`) free
        // their tag and their share of the connection's bounds.
        self.consumers
            .retain(|_, entry| !entry.forwarder.is_finished());
        if let Err(error) = self.consumer_room(s.prefetch) {
            self.reply(s.request_id, Err(error)).await;
            return;
        }
        let memory = match self
            .options
            .memory_claims
            .claim(u64::from(s.prefetch) * UNACKED_BOOKKEEPING_BYTES)
        {
            Ok(claim) => claim,
            Err(refused) => {
                self.reply(s.request_id, Err(consumer_refusal(s.prefetch, &refused)))
                    .await;
                return;
            }
        };
        if self.consumers.contains_key(&s.consumer_tag)
            || self.readers.contains_key(&s.consumer_tag)
        {
            let error = ErrorBody::new(
                ERR_CONFLICT,
                format!(
                    "consumer tag {:?} is in use on this connection",
                    s.consumer_tag
                ),
            );
            self.reply(s.request_id, Err(error)).await;
            return;
        }
        // The broker checks the prefetch against its own bound (it does not know the protocol);
        // it must be the protocol's, or a prefetch a client was allowed would get a 400.
        const _: () = assert!(keratin_broker::MAX_PREFETCH == keratin_proto::PREFETCH_MAX);
        if let Err(error) = self.caught_up(&s.queue).await {
            self.reply(s.request_id, Err(error)).await;
            return;
        }
        let options = SubscribeOptions {
            prefetch: s.prefetch,
            prefetch_bytes: (s.prefetch_bytes > 0).then_some(s.prefetch_bytes),
            outbound: Some(self.outbound_bytes.clone()),
        };
        let mut consumer = match self.broker.subscribe_with(&s.queue, options) {
            Ok(consumer) => consumer,
            Err(e) => {
                self.reply(s.request_id, Err(error_body(&e))).await;
                return;
            }
        };
        self.send(Frame::SubscribeOk(SubscribeOk {
            request_id: s.request_id,
            consumer_tag: s.consumer_tag.clone(),
        }))
        .await;
        let settler = consumer.settler();
        let out = self.out.clone();
        let deliveries = self.deliveries.clone();
        let next = self.next_delivery.clone();
        let tag: Arc<str> = Arc::from(s.consumer_tag.as_str());
        let version = self.version;
        let forwarder = tokio::spawn(async move {
            while let Some(mut delivery) = consumer.recv().await {
                let permit = std::mem::take(&mut delivery.permit);
                let delivery_id = next.fetch_add(1, Ordering::Relaxed);
                lock(&deliveries).insert(delivery_id, (tag.clone(), delivery.tag));
                let frame = Frame::Deliver(Deliver {
                    consumer_tag: tag.to_string(),
                    delivery_id,
                    partition: delivery.tag.partition,
                    offset: delivery.tag.message,
                    redelivered: delivery.redelivered,
                    delivery_count: delivery.delivery_count,
                    // On the wire from protocol version 7 (the codec leaves it out before).
                    routing_key: (!delivery.message.routing_key.is_empty())
                        .then(|| delivery.message.routing_key.clone()),
                    headers: delivery
                        .message
                        .headers
                        .into_iter()
                        .map(|(name, value)| Header { name, value })
                        .collect(),
                    body: delivery.message.body.into(),
                });
                if out.send((frame, permit)).await.is_err() {
                    return;
                }
            }
            if let Some(reason) = consumer.end_reason() {
                lock(&deliveries).retain(|_, (owner, _)| *owner != tag);
                let frame = consumer_end_frame(&tag, &reason, version);
                let _ = out.send((frame, DeliveryPermit::default())).await;
            }
        });
        self.consumers.insert(
            s.consumer_tag,
            ConsumerEntry {
                settler,
                forwarder,
                prefetch: s.prefetch,
                _memory: memory,
            },
        );
    }

    /// Whether one more consumer with `prefetch` fits this connection's bounds
    /// ([`CONSUMERS_PER_CONNECTION_MAX`], [`PREFETCH_PER_CONNECTION_MAX`]).
    fn consumer_room(&self, prefetch: u32) -> Result<(), ErrorBody> {
        if self.consumers.len() + self.readers.len() >= CONSUMERS_PER_CONNECTION_MAX {
            return Err(ErrorBody::new(
                ERR_BAD_REQUEST,
                format!(
                    "this connection has {CONSUMERS_PER_CONNECTION_MAX} consumers, the most \
                     allowed; cancel one or open another connection"
                ),
            ));
        }
        let used: u64 = self.consumers.values().map(|c| u64::from(c.prefetch)).sum();
        if used + u64::from(prefetch) > PREFETCH_PER_CONNECTION_MAX {
            return Err(ErrorBody::new(
                ERR_BAD_REQUEST,
                format!(
                    "prefetch {prefetch}: this connection's consumers already have {used} of \
                     the {PREFETCH_PER_CONNECTION_MAX} unacknowledged deliveries one connection \
                     may hold; lower the prefetch or open another connection"
                ),
            ));
        }
        Ok(())
    }

    async fn cancel(&mut self, c: Cancel) {
        if self.stop_reader(&c.consumer_tag).await {
            self.send(Frame::Ok(OkReply {
                request_id: c.request_id,
            }))
            .await;
            return;
        }
        let Some(entry) = self.consumers.remove(&c.consumer_tag) else {
            let error = ErrorBody::new(
                ERR_NOT_FOUND,
                format!("no consumer {:?} on this connection", c.consumer_tag),
            );
            self.reply(c.request_id, Err(error)).await;
            return;
        };
        // Ending the forwarder drops the broker consumer: its unsettled deliveries return to
        // ready, ahead of newer messages.
        entry.forwarder.abort();
        lock(&self.deliveries).retain(|_, (tag, _)| **tag != *c.consumer_tag);
        self.send(Frame::Ok(OkReply {
            request_id: c.request_id,
        }))
        .await;
    }

    async fn settle(&self, delivery_ids: Vec<u64>, reject: Option<bool>) {
        let mut by_consumer: HashMap<Arc<str>, Vec<DeliveryTag>> = HashMap::new();
        let mut unknown = Vec::new();
        {
            let mut deliveries = lock(&self.deliveries);
            for id in delivery_ids {
                match deliveries.remove(&id) {
                    Some((tag, delivery)) => by_consumer.entry(tag).or_default().push(delivery),
                    None => unknown.push(id),
                }
            }
        }
        for (tag, tags) in by_consumer {
            if let Some(entry) = self.consumers.get(&*tag) {
                match reject {
                    None => entry.settler.ack(&tags),
                    Some(requeue) => entry.settler.reject(&tags, requeue),
                }
            }
        }
        if !unknown.is_empty() {
            let message = format!(
                "unknown delivery ids {unknown:?}: already settled, or never delivered on this connection"
            );
            self.send(Frame::Error(ErrorFrame {
                request_id: None,
                fatal: false,
                error: ErrorBody::new(ERR_NOT_FOUND, message),
            }))
            .await;
        }
    }

    /// End every consumer (their deliveries return to ready) and wait for outstanding publish
    /// answers to be queued.
    async fn finish(&mut self) {
        for (_, entry) in self.consumers.drain() {
            entry.forwarder.abort();
        }
        self.stop_readers().await;
        let all = self.options.publish_frames_inflight_max as u32;
        let _ = tokio::time::timeout(
            self.options.drain_timeout,
            self.publish_permits.acquire_many(all),
        )
        .await;
    }
}

/// How the client learns that the broker ended its consumer `tag` (a partition's leadership
/// moved): `ConsumerEnd` from version 4 on, a non-fatal `Error` without request id naming the
/// tag before (docs/protocol.md, "ConsumerEnd").
fn consumer_end_frame(tag: &str, reason: &BrokerError, version: u16) -> Frame {
    let error = error_body(reason);
    if version >= CONSUMER_END_VERSION {
        return Frame::ConsumerEnd(ConsumerEnd {
            consumer_tag: tag.to_owned(),
            error,
        });
    }
    let message = format!("consumer {tag:?} ended: {error}");
    let error = ErrorBody::from_parts(error.code(), None, error.retry_after_ms(), message)
        .unwrap_or_else(|_| ErrorBody::new(ERR_INTERNAL, format!("consumer {tag:?} ended")));
    Frame::Error(ErrorFrame {
        request_id: None,
        fatal: false,
        error,
    })
}

/// The first protocol version with the `ConsumerEnd` frame.
const CONSUMER_END_VERSION: u16 = 4;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn ok<T>(request_id: u64, result: Result<T, BrokerError>) -> Result<Frame, ErrorBody> {
    result
        .map(|_| Frame::Ok(OkReply { request_id }))
        .map_err(|e| error_body(&e))
}

/// `Confirm` for the durable messages (confirmed mode only) and one `PublishError` per distinct
/// error, with publish ids merged into ranges.
fn publish_answers(
    ids: &[u64],
    results: Vec<Result<keratin_broker::Receipt, BrokerError>>,
    mode: PublishMode,
) -> Vec<Frame> {
    let mut confirmed = Vec::new();
    let mut failed: Vec<(String, ErrorBody, Vec<u64>)> = Vec::new();
    for (id, result) in ids.iter().zip(results) {
        match result {
            Ok(_) => confirmed.push(*id),
            Err(e) => {
                let key = e.to_string();
                match failed.iter_mut().find(|(k, _, _)| *k == key) {
                    Some((_, _, list)) => list.push(*id),
                    None => failed.push((key, error_body(&e), vec![*id])),
                }
            }
        }
    }
    let mut frames = Vec::new();
    if mode == PublishMode::Confirmed && !confirmed.is_empty() {
        frames.push(Frame::Confirm(Confirm {
            ranges: ranges(&confirmed),
        }));
    }
    for (_, error, list) in failed {
        frames.push(Frame::PublishError(PublishError {
            ranges: ranges(&list),
            error,
        }));
    }
    frames
}

/// A quota as people read it: `1000 messages/s, 1048576 bytes/s`.
fn quota_text(quota: keratin_auth::Quota) -> String {
    let mut parts = Vec::new();
    if let Some(messages) = quota.messages_per_s {
        parts.push(format!("{messages} messages/s"));
    }
    if let Some(bytes) = quota.bytes_per_s {
        parts.push(format!("{bytes} bytes/s"));
    }
    parts.join(", ")
}

/// Merge ids into inclusive ranges of consecutive ids, in the order given.
fn ranges(ids: &[u64]) -> Vec<PublishIdRange> {
    let mut out: Vec<PublishIdRange> = Vec::new();
    for &id in ids {
        match out.last_mut() {
            Some(r) if r.last.checked_add(1) == Some(id) => r.last = id,
            _ => out.push(PublishIdRange::single(id)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_ended_by_a_leader_move_is_told_with_421_and_the_address() {
        let reason = BrokerError::NotLeader {
            queue: "orders".into(),
            partition: 0,
            leader: Some(2),
            addr: Some("10.0.0.2:5680".into()),
        };
        let Frame::ConsumerEnd(end) = consumer_end_frame("c1", &reason, 4) else {
            panic!("version 4 gets ConsumerEnd");
        };
        assert_eq!(end.consumer_tag, "c1");
        assert_eq!(end.error.code(), keratin_proto::codes::ERR_NOT_LEADER);
        assert_eq!(end.error.leader_addr(), Some("10.0.0.2:5680"));
        let Frame::Error(error) = consumer_end_frame("c1", &reason, 3) else {
            panic!("version 3 gets a non-fatal Error");
        };
        assert!(!error.fatal);
        assert_eq!(error.request_id, None);
        assert_eq!(error.error.code(), keratin_proto::codes::ERR_NOT_LEADER);
        assert!(error.error.message().contains("\"c1\""), "{}", error.error);
        assert!(
            error.error.message().contains("10.0.0.2:5680"),
            "{}",
            error.error
        );
    }

    #[test]
    fn ranges_merge_consecutive_ids() {
        let r = ranges(&[1, 2, 3, 7, 8, 10]);
        assert_eq!(
            r.iter().map(|r| (r.first, r.last)).collect::<Vec<_>>(),
            vec![(1, 3), (7, 8), (10, 10)]
        );
    }

    #[test]
    fn server_info_names_addresses_the_client_can_reach() {
        let addr = |text: &str| text.parse::<SocketAddr>().unwrap();
        let options = TcpOptions {
            node_id: "n1".into(),
            server_addr: Some(addr("0.0.0.0:5680")),
            admin_addr: Some(addr("0.0.0.0:5681")),
            ..TcpOptions::default()
        };
        // A wildcard bind is told as the address the client reached, with the bound port.
        let info = server_info(&options, Some(addr("10.1.2.3:5680")));
        assert_eq!(info.admin.as_deref(), Some("10.1.2.3:5681"));
        assert_eq!(
            info.nodes,
            vec![NodeAddress {
                node_id: "n1".into(),
                server: "10.1.2.3:5680".into(),
                admin: Some("10.1.2.3:5681".into()),
            }]
        );
        // A specific bind is told as bound.
        let options = TcpOptions {
            server_addr: Some(addr("127.0.0.2:7000")),
            admin_addr: Some(addr("127.0.0.3:7001")),
            ..options
        };
        let info = server_info(&options, Some(addr("127.0.0.2:7000")));
        assert_eq!(info.admin.as_deref(), Some("127.0.0.3:7001"));
        assert_eq!(info.nodes[0].server, "127.0.0.2:7000");
        // A cluster node lists its peers after itself, skipping itself and any entry that
        // would break the protocol's bounds.
        let peers = TcpOptions {
            peers: Some(crate::tcp::ClusterPeers(std::sync::Arc::new(|| {
                vec![
                    NodeAddress {
                        node_id: "n2".into(),
                        server: "127.0.0.2:5682".into(),
                        admin: Some("127.0.0.2:5683".into()),
                    },
                    NodeAddress {
                        node_id: "self again".into(),
                        server: "127.0.0.2:7000".into(),
                        admin: None,
                    },
                    NodeAddress {
                        node_id: "x".repeat(256),
                        server: "127.0.0.4:1".into(),
                        admin: None,
                    },
                ]
            }))),
            ..options.clone()
        };
        let info = server_info(&peers, Some(addr("127.0.0.2:7000")));
        let servers: Vec<&str> = info.nodes.iter().map(|n| n.server.as_str()).collect();
        assert_eq!(servers, vec!["127.0.0.2:7000", "127.0.0.2:5682"]);
        assert_eq!(info.nodes[1].admin.as_deref(), Some("127.0.0.2:5683"));
        // No admin port: none advertised.
        let options = TcpOptions {
            admin_addr: None,
            ..options
        };
        assert_eq!(server_info(&options, None).admin, None);
    }
}
