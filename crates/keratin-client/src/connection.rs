//! The background task that owns the socket: the handshake, then one loop that reads frames,
//! writes the handles' commands, sends heartbeats and notices a silent broker.
//!
//! Owns every piece of per-connection state: pending requests (request id → reply), publishes
//! in flight (publish id → waiter), buffered messages waiting for their barrier, and consumers
//! (tag → bounded channel of deliveries). When the connection ends, for any reason, it settles
//! all of them as `lib.rs` ("Reconnect behaviour") promises. What the handles do with the
//! answers (retrying, timeouts) belongs to `client.rs`, `publisher.rs` and `consumer.rs`.
//!
//! One task reads and writes. A write that blocks (the broker is not reading) stops reading too;
//! the broker reads and writes independently, so that stall ends when the broker drains its
//! socket, and `server_silence_timeout` does not fire while frames keep arriving.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use keratin_proto::codes::ERR_BAD_REQUEST;
use keratin_proto::{
    Ack, Auth, Cancel, ClientHello, Close, Frame, Message, ProtoError, Publish, PublishMode,
    QueueList, Reject, ServerHello, ServerInfo, StreamCredit, AUTH_VERSION, PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN, PROTOCOL_VERSION_STREAMS,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, ToSocketAddrs};

/// The connection's byte stream: plain TCP, or TLS over it.
trait ByteStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> ByteStream for S {}
type BoxStream = Box<dyn ByteStream>;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::codec::{Framed, FramedParts};

use crate::consumer::{Delivery, DeliverySettle};
use crate::error::ClientError;
use crate::options::{ClientOptions, Credentials};
use crate::publisher::BufferedEntry;
use crate::stream_ends::StreamEnds;

/// Capacity of a connection's read buffer: deliveries are read this much at a time at most, and
/// their bodies (slices of it) keep a block of this size alive until the last is dropped.
const READ_BUFFER_BYTES: usize = 64 << 10;

/// Commands taken from the command channel in one turn of the loop before the writes are
/// flushed. 256 one-message publishes of 1 KiB are a 256 KiB write: large enough to batch
/// syscalls under load, small enough that reading is never starved for long.
const COMMANDS_PER_TURN_MAX: usize = 256;
/// Bound of the command channel between the handles and the task. With
/// `COMMANDS_PER_TURN_MAX` taken per turn, four turns' worth keeps the task busy while handles
/// wait (backpressure) instead of queueing without limit.
pub(crate) const COMMAND_QUEUE_MAX: usize = 4 * COMMANDS_PER_TURN_MAX;
/// Single publishes (`Client::publish`, the buffered publisher) queued back to back for the
/// same queue and mode are sent as one `Publish` frame marked joinable, of up to this many
/// messages and bytes. The broker still admits and answers each on its own, so this is
/// invisible to callers; it routes and writes one frame instead of many, and the per-frame work
/// on both sides dominated the CPU time of a 1 KiB confirmed publish (measured: twice the
/// confirmed publishes per second with 1,000 in flight). `publish_batch` frames are never
/// joined: they keep their all-or-nothing admission.
const COALESCED_PUBLISH_MESSAGES_MAX: usize = 256;
/// See [`COALESCED_PUBLISH_MESSAGES_MAX`]; far below the largest frame.
const COALESCED_PUBLISH_BYTES_MAX: usize = 256 * 1024;
/// Acks and rejects coalesced into one frame (8 bytes each: 64 KiB per frame at most).
const SETTLES_PER_FRAME_MAX: usize = 8 * 1024;
/// The timer checks heartbeats and silence this many times per (shorter) interval, so a
/// heartbeat goes out at most a quarter interval late.
const TICKS_PER_INTERVAL: u32 = 4;

/// The protocol version the client offers in its handshake: the newest it speaks, streams'
/// version 7 included ([`PROTOCOL_VERSION_STREAMS`]) while `keratin-proto` still names 6 as
/// its [`PROTOCOL_VERSION`]. A node that speaks only an older version refuses it naming its
/// own, and the client connects again in that one (`negotiate`).
pub const PROTOCOL_VERSION_OFFERED: u16 = if PROTOCOL_VERSION > PROTOCOL_VERSION_STREAMS {
    PROTOCOL_VERSION
} else {
    PROTOCOL_VERSION_STREAMS
};

/// Ids chosen by the client: request ids, publish ids and consumer tags, unique on the
/// connection because each comes from one counter that only grows.
#[derive(Debug, Default)]
pub(crate) struct Ids {
    request: AtomicU64,
    publish: AtomicU64,
    consumer: AtomicU64,
}

impl Ids {
    pub(crate) fn request_id(&self) -> u64 {
        self.request.fetch_add(1, Ordering::Relaxed) + 1
    }
    pub(crate) fn publish_id(&self) -> u64 {
        self.publish.fetch_add(1, Ordering::Relaxed) + 1
    }
    pub(crate) fn consumer_tag(&self) -> String {
        format!("c{}", self.consumer.fetch_add(1, Ordering::Relaxed) + 1)
    }
}

/// Why the connection ended, readable by handles that try to use it afterwards.
pub(crate) type LostReason = Arc<Mutex<Option<String>>>;

/// What became of one message of a confirmed publish.
#[derive(Debug)]
pub(crate) enum PublishOutcome {
    /// The broker sent `Confirm`: the message is durable.
    Confirmed,
    /// The broker sent `PublishError`.
    Failed(keratin_proto::ErrorBody),
    /// Written, then the connection ended without an answer: outcome unknown.
    Lost(String),
    /// Never written (connection already gone, or the frame did not encode): safe to retry.
    NotSent(ClientError),
}

/// Who waits for a publish id.
pub(crate) enum Waiter {
    /// A confirmed publish: resolved by `Confirm` or `PublishError`.
    Confirmed(oneshot::Sender<PublishOutcome>),
    /// A buffered publish: reported only if it fails; settled by a barrier otherwise.
    Buffered(BufferedEntry),
}

/// What a request's reply means beyond being handed back.
pub(crate) enum RequestKind {
    /// Just answer the caller.
    Plain,
    /// Register the consumer before the frame goes out (deliveries may follow the reply at
    /// once) and forget it if the reply is an error.
    Subscribe {
        tag: String,
        queue: String,
        deliveries: mpsc::Sender<Delivery>,
        ended: ConsumerEnded,
    },
    /// Register a stream consumer before the `StreamSubscribe` goes out, as `Subscribe`.
    StreamSubscribe {
        tag: String,
        events: mpsc::Sender<StreamEvent>,
        ended: StreamEnded,
        ends: StreamEnds,
        credit: u32,
    },
    /// Forget the consumer once the broker confirms the cancel.
    Cancel { tag: String },
}

/// What the task hands a stream consumer: whole frames, unpacked by the handle
/// (`stream_consumer.rs`), so that one channel slot holds up to a frame's 256 messages; and a
/// wake token when partition ends wait in its [`StreamEnds`] (`stream_ends.rs`).
#[derive(Debug)]
pub(crate) enum StreamEvent {
    Deliver(keratin_proto::StreamDeliver),
    EndsPending,
}

/// Why the task stopped feeding a stream consumer; `None` while it runs or after a cancel.
pub(crate) type StreamEnded = Arc<Mutex<Option<StreamEndReason>>>;

/// See [`StreamEnded`].
#[derive(Debug, Clone)]
pub(crate) enum StreamEndReason {
    /// The connection ended, for this reason.
    ConnectionLost(String),
    /// The broker sent more messages than the consumer's credit allowed.
    OverCredit,
}

/// A message from a handle to the task, through the bounded command channel.
pub(crate) enum Command {
    /// An admin request, subscribe or cancel.
    Request {
        request_id: u64,
        frame: Frame,
        kind: RequestKind,
        reply: oneshot::Sender<Result<Frame, ClientError>>,
    },
    /// One `Publish` frame; `waiters[i]` waits for `messages[i]`. `joinable`: separate
    /// publishes, which may share a frame with the joinable publishes queued next to them.
    Publish {
        queue: String,
        mode: PublishMode,
        messages: Vec<Message>,
        waiters: Vec<Waiter>,
        joinable: bool,
    },
    /// Send `Close`, finish reading the broker's answers, then end.
    Close { done: oneshot::Sender<()> },
}

/// Messages that must never wait for room: acks, rejects, stream credit and cancels from
/// `Drop`. The channel is unbounded, but what travels on it is bounded by the deliveries handed
/// out (at most the sum of the consumers' prefetch), one stream credit per half of a stream
/// consumer's credit taken by the application, and one cancel per consumer.
#[derive(Debug)]
pub(crate) enum Control {
    Ack(u64),
    Reject {
        delivery_id: u64,
        requeue: bool,
    },
    CancelConsumer(String),
    /// More credit for a stream consumer, from its handle as the application takes messages.
    StreamCredit {
        tag: String,
        credit: u32,
    },
}

struct PendingRequest {
    /// `None` for requests the task makes itself (barriers, cancels from `Drop`).
    reply: Option<oneshot::Sender<Result<Frame, ClientError>>>,
    kind: RequestKind,
}

struct StreamSlot {
    events: mpsc::Sender<StreamEvent>,
    ended: StreamEnded,
    ends: StreamEnds,
    /// Messages the broker may still send: the subscription's credit plus the credit given
    /// since, less the messages received.
    credit_left: u64,
    /// `StreamDeliver` frames put in `events` so far.
    frames_sent: u64,
}

struct ConsumerSlot {
    queue: String,
    deliveries: mpsc::Sender<Delivery>,
    ended: ConsumerEnded,
}

/// Why the broker ended a consumer (`ConsumerEnd`), read by the [`crate::Consumer`] once its
/// delivery stream ran dry; `None` while it runs or when it ended with the connection.
pub(crate) type ConsumerEnded = Arc<Mutex<Option<keratin_proto::ErrorBody>>>;

/// A `QueueList` sent after some buffered messages were written. When its reply arrives, those
/// messages count as accepted; see `publisher.rs` for what this relies on.
struct Barrier {
    request_id: u64,
    covered: Vec<u64>,
}

/// The handles' end of a running connection.
pub(crate) struct Handle {
    pub(crate) commands: mpsc::Sender<Command>,
    pub(crate) control: mpsc::UnboundedSender<Control>,
    pub(crate) ids: Arc<Ids>,
    pub(crate) lost: LostReason,
    pub(crate) node_id: String,
    /// Where the node says it and its cluster are (empty from a node older than version 3).
    pub(crate) info: ServerInfo,
    /// The protocol version agreed in the handshake.
    pub(crate) version: u16,
    /// The user the node logged this connection in as (`None`: no login).
    pub(crate) user: Option<String>,
}

/// What an accepted handshake gives.
struct Accepted {
    framed: Framed<BoxStream, keratin_proto::FrameCodec>,
    node_id: String,
    info: ServerInfo,
    version: u16,
    user: Option<String>,
}

/// Connects, shakes hands and spawns the task. Must be called inside a tokio runtime.
pub(crate) async fn open(
    addr: impl ToSocketAddrs,
    options: &ClientOptions,
) -> Result<Handle, ClientError> {
    let timeout_ms = duration_ms(options.connect_timeout);
    check_credentials(options)?;
    let Accepted {
        framed,
        node_id,
        info,
        version,
        user,
    } = tokio::time::timeout(options.connect_timeout, negotiate(addr, options))
        .await
        .map_err(|_| ClientError::ConnectTimeout { timeout_ms })??;
    let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE_MAX);
    let (control_tx, control) = mpsc::unbounded_channel();
    let ids = Arc::new(Ids::default());
    let lost: LostReason = Arc::default();
    let now = Instant::now();
    let connection = Connection {
        framed,
        commands,
        control,
        control_tx: control_tx.clone(),
        ids: Arc::clone(&ids),
        lost: Arc::clone(&lost),
        requests: HashMap::new(),
        publishes: HashMap::new(),
        buffered_written: Vec::new(),
        barrier: None,
        consumers: HashMap::new(),
        stream_consumers: HashMap::new(),
        heartbeat_interval: options.heartbeat_interval,
        server_silence_timeout: options.server_silence_timeout,
        producer_id: options.producer_id.filter(|_| options.idempotent),
        last_read: now,
        last_write: now,
        closing: false,
        close_done: Vec::new(),
    };
    tokio::spawn(connection.run());
    Ok(Handle {
        commands: commands_tx,
        control: control_tx,
        ids,
        lost,
        node_id,
        info,
        version,
        user,
    })
}

/// Refuses a certificate login without a certificate to present, before connecting: the
/// broker's 401 would not say that the certificate was missing on this side.
fn check_credentials(options: &ClientOptions) -> Result<(), ClientError> {
    let has_client_cert = options
        .tls
        .as_ref()
        .is_some_and(|tls| tls.has_client_cert());
    if options.credentials == Some(Credentials::Certificate) && !has_client_cert {
        return Err(ClientError::InvalidArgument(
            "a login by certificate needs TLS with a client certificate \
             (ClientTls::with_client_cert)"
                .into(),
        ));
    }
    Ok(())
}

/// Shakes hands in [`PROTOCOL_VERSION_OFFERED`]; a node that refuses it (400) because it speaks an older
/// version it still shares with us (a rolling upgrade) gets a second connection in that version.
async fn negotiate(
    addr: impl ToSocketAddrs,
    options: &ClientOptions,
) -> Result<Accepted, ClientError> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|error| ClientError::io("resolve the broker's address", error))?
        .collect();
    match handshake(&addrs, options, PROTOCOL_VERSION_OFFERED).await {
        Err(ClientError::Refused {
            server_version,
            error,
        }) if error.code() == ERR_BAD_REQUEST
            && (PROTOCOL_VERSION_MIN..PROTOCOL_VERSION_OFFERED).contains(&server_version) =>
        {
            tracing::debug!(
                server_version,
                "the broker speaks an older protocol; using it"
            );
            handshake(&addrs, options, server_version).await
        }
        result => result,
    }
}

async fn handshake(
    addrs: &[SocketAddr],
    options: &ClientOptions,
    version: u16,
) -> Result<Accepted, ClientError> {
    // Checked before connecting: after a node refused our version, there is no point in a
    // second connection that cannot carry the login.
    let auth = options
        .credentials
        .as_ref()
        .map_or(Auth::None, Credentials::to_auth);
    if version < AUTH_VERSION && auth != Auth::None {
        return Err(ClientError::LoginUnsupported {
            server_version: version,
        });
    }
    let tcp = TcpStream::connect(addrs)
        .await
        .map_err(|error| ClientError::io("connect to the broker", error))?;
    tcp.set_nodelay(true)
        .map_err(|error| ClientError::io("set TCP_NODELAY", error))?;
    let mut stream: BoxStream = match &options.tls {
        None => Box::new(tcp),
        Some(tls) => {
            let peer = tcp
                .peer_addr()
                .map_err(|error| ClientError::io("read the broker's address", error))?;
            let tls_stream = tls
                .connector()
                .connect(tls.name_for(peer), tcp)
                .await
                .map_err(|error| {
                    ClientError::io(
                        format!("TLS handshake with the broker at {peer} (is it serving TLS, and is its certificate from the CA given?)"),
                        error,
                    )
                })?;
            Box::new(tls_stream)
        }
    };
    let mut hello = BytesMut::new();
    ClientHello {
        version,
        client_name: options.name.clone(),
        auth,
    }
    .encode(&mut hello)?;
    stream
        .write_all(&hello)
        .await
        .map_err(|error| ClientError::io("send the handshake", error))?;
    let mut read_buf = BytesMut::with_capacity(256);
    let answer = loop {
        if let Some(answer) = ServerHello::decode(&mut read_buf)? {
            break answer;
        }
        let read = stream
            .read_buf(&mut read_buf)
            .await
            .map_err(|error| ClientError::io("read the broker's handshake", error))?;
        if read == 0 {
            return Err(ClientError::ConnectionLost {
                detail: "the broker closed the connection during the handshake".into(),
            });
        }
    };
    match answer {
        ServerHello::Accepted {
            node_id,
            info,
            version: agreed,
            user,
        } => {
            // Frames the broker pipelined behind its hello stay in the read buffer. A fresh
            // one of READ_BUFFER_BYTES, not the handshake's: once frames are split off a buffer,
            // `BytesMut` regrows it to the capacity it started with, so the handshake's 256
            // bytes meant a reallocation and a short read every few deliveries.
            let codec = keratin_proto::FrameCodec::new().with_version(agreed);
            let mut parts = FramedParts::new::<Frame>(stream, codec);
            let mut frames_buf = BytesMut::with_capacity(READ_BUFFER_BYTES.max(read_buf.len()));
            frames_buf.extend_from_slice(&read_buf);
            parts.read_buf = frames_buf;
            Ok(Accepted {
                framed: Framed::from_parts(parts),
                node_id,
                info,
                version: agreed,
                user,
            })
        }
        ServerHello::Refused { version, error } => Err(ClientError::Refused {
            server_version: version,
            error,
        }),
    }
}

pub(crate) fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

struct Connection {
    framed: Framed<BoxStream, keratin_proto::FrameCodec>,
    commands: mpsc::Receiver<Command>,
    control: mpsc::UnboundedReceiver<Control>,
    control_tx: mpsc::UnboundedSender<Control>,
    ids: Arc<Ids>,
    lost: LostReason,
    requests: HashMap<u64, PendingRequest>,
    publishes: HashMap<u64, Waiter>,
    /// Buffered publish ids written since the last barrier was sent.
    buffered_written: Vec<u64>,
    barrier: Option<Barrier>,
    consumers: HashMap<String, ConsumerSlot>,
    stream_consumers: HashMap<String, StreamSlot>,
    heartbeat_interval: Duration,
    server_silence_timeout: Duration,
    /// The idempotent producer this connection's publishes belong to, if any.
    producer_id: Option<u64>,
    last_read: Instant,
    last_write: Instant,
    /// `Close` was sent: write nothing more, read until the broker closes.
    closing: bool,
    close_done: Vec<oneshot::Sender<()>>,
}

/// The loop ends with the reason the connection ended.
type Ended = String;

impl Connection {
    async fn run(mut self) {
        let detail = self.serve().await;
        tracing::debug!(%detail, "keratin connection ended");
        self.settle_everything(detail);
    }

    async fn serve(&mut self) -> Ended {
        let tick_period =
            self.heartbeat_interval.min(self.server_silence_timeout) / TICKS_PER_INTERVAL;
        let mut tick = tokio::time::interval(tick_period.max(Duration::from_millis(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let turn = tokio::select! {
                frame = self.framed.next() => self.on_read(frame).await,
                command = self.commands.recv(), if !self.closing => self.on_command(command).await,
                Some(control) = self.control.recv(), if !self.closing => {
                    self.on_control(control).await
                }
                _ = tick.tick() => self.on_tick().await,
            };
            if let Err(ended) = turn {
                return ended;
            }
            if let Err(error) = SinkExt::<Frame>::flush(&mut self.framed).await {
                return format!("writing to the broker failed: {error}");
            }
        }
    }

    async fn on_read(&mut self, frame: Option<Result<Frame, ProtoError>>) -> Result<(), Ended> {
        match frame {
            Some(Ok(frame)) => {
                self.last_read = Instant::now();
                self.on_frame(frame).await
            }
            Some(Err(error)) => Err(format!("the broker's bytes did not parse: {error}")),
            None if self.closing => Err("the connection was closed".into()),
            None => Err("the broker closed the connection".into()),
        }
    }

    async fn on_command(&mut self, command: Option<Command>) -> Result<(), Ended> {
        let Some(command) = command else {
            // Every handle is gone: nobody can use the connection any more.
            return self.start_close("every client handle was dropped").await;
        };
        let mut taken = 1;
        let mut next = Some(command);
        while let Some(command) = next.take() {
            let command = match command {
                Command::Publish {
                    queue,
                    mode,
                    mut messages,
                    mut waiters,
                    joinable: true,
                } => {
                    let mut bytes: usize = messages.iter().map(message_bytes).sum();
                    while taken < COMMANDS_PER_TURN_MAX {
                        let Ok(queued) = self.commands.try_recv() else {
                            break;
                        };
                        taken += 1;
                        match queued {
                            Command::Publish {
                                queue: other_queue,
                                mode: other_mode,
                                messages: other_messages,
                                waiters: other_waiters,
                                joinable: true,
                            } if other_queue == queue
                                && other_mode == mode
                                && messages.len() + other_messages.len()
                                    <= COALESCED_PUBLISH_MESSAGES_MAX
                                && bytes
                                    + other_messages.iter().map(message_bytes).sum::<usize>()
                                    <= COALESCED_PUBLISH_BYTES_MAX =>
                            {
                                bytes += other_messages.iter().map(message_bytes).sum::<usize>();
                                messages.extend(other_messages);
                                waiters.extend(other_waiters);
                            }
                            other => {
                                next = Some(other);
                                break;
                            }
                        }
                    }
                    Command::Publish {
                        queue,
                        mode,
                        messages,
                        waiters,
                        joinable: true,
                    }
                }
                other => other,
            };
            if let Err(ended) = self.command(command).await {
                // A command taken to try joining it with the one before was never written.
                if let Some(command) = next.take() {
                    settle_unsent_command(command, &ended);
                }
                return Err(ended);
            }
            if next.is_none() && taken < COMMANDS_PER_TURN_MAX {
                if let Ok(command) = self.commands.try_recv() {
                    taken += 1;
                    next = Some(command);
                }
            }
        }
        Ok(())
    }

    async fn command(&mut self, command: Command) -> Result<(), Ended> {
        // An ack queued before a `Consumer::cancel` must reach the broker before the `Cancel`,
        // or the cancel would return the acknowledged message to ready.
        if let Err(ended) = self.drain_control().await {
            settle_unsent_command(command, &ended);
            return Err(ended);
        }
        if self.closing {
            settle_unsent_command(command, "the connection is closing");
            return Ok(());
        }
        match command {
            Command::Request {
                request_id,
                frame,
                kind,
                reply,
            } => {
                self.send_request(request_id, frame, kind, Some(reply))
                    .await
            }
            Command::Publish {
                queue,
                mode,
                messages,
                waiters,
                joinable,
            } => {
                self.send_publish(queue, mode, messages, waiters, joinable)
                    .await
            }
            Command::Close { done } => {
                self.close_done.push(done);
                self.start_close("closed by the application").await
            }
        }
    }

    async fn send_request(
        &mut self,
        request_id: u64,
        frame: Frame,
        kind: RequestKind,
        reply: Option<oneshot::Sender<Result<Frame, ClientError>>>,
    ) -> Result<(), Ended> {
        if let RequestKind::Subscribe {
            tag,
            queue,
            deliveries,
            ended,
        } = &kind
        {
            let slot = ConsumerSlot {
                queue: queue.clone(),
                deliveries: deliveries.clone(),
                ended: ended.clone(),
            };
            self.consumers.insert(tag.clone(), slot);
        }
        if let RequestKind::StreamSubscribe {
            tag,
            events,
            ended,
            ends,
            credit,
        } = &kind
        {
            let slot = StreamSlot {
                events: events.clone(),
                ended: ended.clone(),
                ends: ends.clone(),
                credit_left: u64::from(*credit),
                frames_sent: 0,
            };
            self.stream_consumers.insert(tag.clone(), slot);
        }
        match self.write(frame).await? {
            Ok(()) => {
                self.requests
                    .insert(request_id, PendingRequest { reply, kind });
            }
            Err(error) => {
                if let RequestKind::Subscribe { tag, .. }
                | RequestKind::StreamSubscribe { tag, .. } = &kind
                {
                    self.consumers.remove(tag);
                    self.stream_consumers.remove(tag);
                }
                if let Some(reply) = reply {
                    let _ = reply.send(Err(ClientError::Encode(error.to_string())));
                }
            }
        }
        Ok(())
    }

    async fn send_publish(
        &mut self,
        queue: String,
        mode: PublishMode,
        messages: Vec<Message>,
        waiters: Vec<Waiter>,
        joinable: bool,
    ) -> Result<(), Ended> {
        assert_eq!(messages.len(), waiters.len(), "one waiter per message");
        let ids: Vec<u64> = messages.iter().map(|message| message.publish_id).collect();
        let frame = Frame::Publish(Publish {
            queue,
            mode,
            messages,
            joinable,
            producer_id: self.producer_id,
        });
        let written = match self.write(frame).await {
            Ok(written) => written,
            Err(ended) => {
                // The socket failed while flushing the frames queued before this one, so this
                // one was never written: its messages are safe to publish again.
                for waiter in waiters {
                    let lost = ClientError::ConnectionLost {
                        detail: ended.clone(),
                    };
                    settle_unsent(waiter, lost, &ended);
                }
                return Err(ended);
            }
        };
        if let Err(error) = written {
            let detail = error.to_string();
            for waiter in waiters {
                settle_unsent(waiter, ClientError::Encode(detail.clone()), &detail);
            }
            return Ok(());
        }
        for (publish_id, waiter) in ids.into_iter().zip(waiters) {
            if matches!(waiter, Waiter::Buffered(_)) {
                self.buffered_written.push(publish_id);
            }
            let previous = self.publishes.insert(publish_id, waiter);
            assert!(previous.is_none(), "publish id {publish_id} reused");
        }
        self.start_barrier().await
    }

    /// Sends a barrier covering the buffered messages written so far, unless one is in flight
    /// (the next one starts when it returns).
    async fn start_barrier(&mut self) -> Result<(), Ended> {
        if self.barrier.is_some() || self.buffered_written.is_empty() || self.closing {
            return Ok(());
        }
        let request_id = self.ids.request_id();
        let frame = Frame::QueueList(QueueList { request_id });
        // A QueueList always encodes.
        let _ = self.write(frame).await?;
        self.barrier = Some(Barrier {
            request_id,
            covered: std::mem::take(&mut self.buffered_written),
        });
        Ok(())
    }

    async fn on_control(&mut self, first: Control) -> Result<(), Ended> {
        let mut acks = Vec::new();
        let mut rejects: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        let mut cancels = Vec::new();
        let mut credits = Vec::new();
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(control) = next {
            match control {
                Control::Ack(delivery_id) => acks.push(delivery_id),
                Control::Reject {
                    delivery_id,
                    requeue,
                } => rejects[usize::from(requeue)].push(delivery_id),
                Control::CancelConsumer(tag) => cancels.push(tag),
                Control::StreamCredit { tag, credit } => credits.push((tag, credit)),
            }
            taken += 1;
            next = if taken < SETTLES_PER_FRAME_MAX {
                self.control.try_recv().ok()
            } else {
                None
            };
        }
        if !acks.is_empty() {
            let _ = self.write(Frame::Ack(Ack { delivery_ids: acks })).await?;
        }
        for (requeue, delivery_ids) in [false, true].into_iter().zip(rejects) {
            if !delivery_ids.is_empty() {
                let frame = Frame::Reject(Reject {
                    delivery_ids,
                    requeue,
                });
                let _ = self.write(frame).await?;
            }
        }
        for (tag, credit) in credits {
            // Credit for a consumer cancelled since is not sent: the broker would answer 404.
            if let Some(slot) = self.stream_consumers.get_mut(&tag) {
                // Counted before it is written: the broker sends against it only after.
                slot.credit_left += u64::from(credit);
                let frame = Frame::StreamCredit(StreamCredit {
                    consumer_tag: tag,
                    credit,
                });
                self.write(frame)
                    .await?
                    .map_err(|error| error.to_string())?;
            }
        }
        for tag in cancels {
            self.cancel_consumer(tag).await?;
        }
        Ok(())
    }

    async fn drain_control(&mut self) -> Result<(), Ended> {
        while let Ok(control) = self.control.try_recv() {
            self.on_control(control).await?;
        }
        Ok(())
    }

    /// Cancels a consumer whose handle is gone. Its unacknowledged deliveries return to ready.
    async fn cancel_consumer(&mut self, tag: String) -> Result<(), Ended> {
        let queue_consumer = self.consumers.remove(&tag).is_some();
        let stream_consumer = self.stream_consumers.remove(&tag).is_some();
        if !queue_consumer && !stream_consumer {
            return Ok(());
        }
        let request_id = self.ids.request_id();
        let frame = Frame::Cancel(Cancel {
            request_id,
            consumer_tag: tag.clone(),
        });
        self.send_request(request_id, frame, RequestKind::Cancel { tag }, None)
            .await
    }

    async fn on_tick(&mut self) -> Result<(), Ended> {
        let now = Instant::now();
        if now.duration_since(self.last_read) >= self.server_silence_timeout {
            return Err(format!(
                "no frame from the broker for {} ms (server_silence_timeout)",
                duration_ms(self.server_silence_timeout)
            ));
        }
        if !self.closing && now.duration_since(self.last_write) >= self.heartbeat_interval {
            let _ = self.write(Frame::Heartbeat).await?;
        }
        // Callers that timed out dropped their receivers; forget their requests.
        self.requests.retain(|_, pending| {
            pending
                .reply
                .as_ref()
                .is_none_or(|reply| !reply.is_closed())
        });
        Ok(())
    }

    /// Queues a frame for writing. The outer error ends the connection (the socket failed);
    /// the inner one is an encoding error that leaves the connection usable.
    async fn write(&mut self, frame: Frame) -> Result<Result<(), ProtoError>, Ended> {
        match SinkExt::<Frame>::feed(&mut self.framed, frame).await {
            Ok(()) => {
                self.last_write = Instant::now();
                Ok(Ok(()))
            }
            Err(ProtoError::Io(error)) => Err(format!("writing to the broker failed: {error}")),
            Err(error) => Ok(Err(error)),
        }
    }

    async fn start_close(&mut self, why: &str) -> Result<(), Ended> {
        if self.closing {
            return Ok(());
        }
        // Acks, rejects and cancels queued before the close still go out: nothing is sent
        // after `Close`.
        self.drain_control().await?;
        let frame = Frame::Close(Close {
            message: why.to_owned(),
        });
        let _ = self.write(frame).await?;
        self.closing = true;
        Ok(())
    }

    async fn on_frame(&mut self, frame: Frame) -> Result<(), Ended> {
        match frame {
            Frame::Ok(ok) => self.on_reply(ok.request_id, Frame::Ok(ok)).await,
            Frame::QueueInfoReply(reply) => {
                self.on_reply(reply.request_id, Frame::QueueInfoReply(reply))
                    .await
            }
            Frame::QueueListReply(reply) => {
                self.on_reply(reply.request_id, Frame::QueueListReply(reply))
                    .await
            }
            Frame::SubscribeOk(reply) => {
                self.on_reply(reply.request_id, Frame::SubscribeOk(reply))
                    .await
            }
            Frame::StreamInfoReply(reply) => {
                self.on_reply(reply.request_id, Frame::StreamInfoReply(reply))
                    .await
            }
            Frame::StreamListReply(reply) => {
                self.on_reply(reply.request_id, Frame::StreamListReply(reply))
                    .await
            }
            Frame::StreamDeliver(deliver) => self.on_stream_deliver(deliver).await,
            Frame::StreamPartitionEnd(end) => self.on_stream_partition_end(end).await,
            Frame::Confirm(confirm) => {
                for range in confirm.ranges {
                    for publish_id in range.first..=range.last {
                        self.on_confirm(publish_id);
                    }
                }
                Ok(())
            }
            Frame::PublishError(failed) => {
                for range in &failed.ranges {
                    for publish_id in range.first..=range.last {
                        self.on_publish_error(publish_id, &failed.error);
                    }
                }
                Ok(())
            }
            Frame::Deliver(deliver) => self.on_deliver(deliver).await,
            Frame::ConsumerEnd(end) => {
                // Dropping the slot closes the consumer's stream once it has taken the
                // deliveries already queued; the reason tells it where to go next.
                if let Some(slot) = self.consumers.remove(&end.consumer_tag) {
                    *lock(&slot.ended) = Some(end.error);
                }
                Ok(())
            }
            Frame::Heartbeat => Ok(()),
            Frame::Error(error) => self.on_error_frame(error).await,
            Frame::Close(close) => {
                tracing::info!(message = %close.message, "the broker is closing the connection");
                self.start_close("answering the broker's Close").await?;
                // Remember the broker's words for whoever asks after the end.
                *lock(&self.lost) = Some(format!(
                    "the broker closed the connection: {}",
                    close.message
                ));
                Ok(())
            }
            other => Err(format!(
                "the broker sent a {} frame, which only clients send",
                other.frame_type().name()
            )),
        }
    }

    async fn on_reply(&mut self, request_id: u64, frame: Frame) -> Result<(), Ended> {
        if self
            .barrier
            .as_ref()
            .is_some_and(|barrier| barrier.request_id == request_id)
        {
            return self.on_barrier_done().await;
        }
        let Some(pending) = self.requests.remove(&request_id) else {
            tracing::debug!(request_id, "reply for a request nobody waits for");
            return Ok(());
        };
        if let RequestKind::Cancel { tag } = &pending.kind {
            self.consumers.remove(tag);
            self.stream_consumers.remove(tag);
        }
        if let Some(reply) = pending.reply {
            let _ = reply.send(Ok(frame));
        }
        Ok(())
    }

    async fn on_barrier_done(&mut self) -> Result<(), Ended> {
        if let Some(barrier) = self.barrier.take() {
            for publish_id in barrier.covered {
                // Still present means no PublishError came before the barrier's reply: the
                // message counts as accepted and its buffer slot is released.
                if let Some(Waiter::Buffered(entry)) = self.publishes.remove(&publish_id) {
                    entry.accept();
                }
            }
        }
        self.start_barrier().await
    }

    fn on_confirm(&mut self, publish_id: u64) {
        match self.publishes.remove(&publish_id) {
            Some(Waiter::Confirmed(waiter)) => {
                let _ = waiter.send(PublishOutcome::Confirmed);
            }
            Some(Waiter::Buffered(entry)) => {
                // The protocol sends no Confirm for buffered messages; take it as accepted.
                entry.accept();
            }
            None => tracing::debug!(publish_id, "Confirm for an unknown publish id"),
        }
    }

    fn on_publish_error(&mut self, publish_id: u64, error: &keratin_proto::ErrorBody) {
        match self.publishes.remove(&publish_id) {
            Some(Waiter::Confirmed(waiter)) => {
                let _ = waiter.send(PublishOutcome::Failed(error.clone()));
            }
            Some(Waiter::Buffered(entry)) => entry.drop_with(ClientError::from_body(error.clone())),
            None => tracing::warn!(
                publish_id,
                %error,
                "PublishError for a publish id no longer tracked (a buffered message already \
                 settled by its barrier)"
            ),
        }
    }

    async fn on_deliver(&mut self, deliver: keratin_proto::Deliver) -> Result<(), Ended> {
        let delivery_id = deliver.delivery_id;
        let Some(slot) = self.consumers.get(&deliver.consumer_tag) else {
            // A consumer cancelled a moment ago: the cancel returns this delivery to ready.
            tracing::debug!(tag = %deliver.consumer_tag, "delivery for an unknown consumer");
            return Ok(());
        };
        let settle = DeliverySettle::new(self.control_tx.clone());
        let delivery = Delivery::from_frame(slot.queue.clone(), deliver, settle);
        match slot.deliveries.try_send(delivery) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(delivery)) => {
                // The broker sent more than `prefetch` unacknowledged deliveries; hand this one
                // back rather than grow without bound.
                tracing::warn!(tag = %delivery.consumer_tag, "delivery beyond prefetch; requeued");
                let frame = Frame::Reject(Reject {
                    delivery_ids: vec![delivery_id],
                    requeue: true,
                });
                self.write(frame).await?.map_err(|error| error.to_string())
            }
            Err(mpsc::error::TrySendError::Closed(delivery)) => {
                self.cancel_consumer(delivery.consumer_tag.clone()).await
            }
        }
    }

    /// Hands a frame of messages to its stream consumer, or ends the consumer if the broker
    /// sent more than its credit (rather than dropping messages or holding more than the
    /// bound the application chose).
    async fn on_stream_deliver(
        &mut self,
        deliver: keratin_proto::StreamDeliver,
    ) -> Result<(), Ended> {
        let tag = deliver.consumer_tag.clone();
        let Some(slot) = self.stream_consumers.get_mut(&tag) else {
            tracing::debug!(%tag, "stream frame for an unknown consumer");
            return Ok(());
        };
        let count = deliver.messages.len() as u64;
        let why = if count > slot.credit_left {
            tracing::warn!(%tag, count, credit_left = slot.credit_left,
                           "the broker sent more than the stream consumer's credit");
            Some(StreamEndReason::OverCredit)
        } else {
            // The channel holds the credit in frames (each has a message) plus one token:
            // `Full` is a broker over its credit too.
            match slot.events.try_send(StreamEvent::Deliver(deliver)) {
                Ok(()) => {
                    slot.credit_left -= count;
                    slot.frames_sent += 1;
                    return Ok(());
                }
                Err(mpsc::error::TrySendError::Full(_)) => Some(StreamEndReason::OverCredit),
                Err(mpsc::error::TrySendError::Closed(_)) => None,
            }
        };
        if let Some(why) = why {
            *lock(&slot.ended) = Some(why);
        }
        self.cancel_consumer(tag).await
    }

    /// Leaves a partition's end for its stream consumer beside the channel (any number of
    /// them fit: `stream_ends.rs`) and wakes the handle with a token if none is in yet.
    async fn on_stream_partition_end(
        &mut self,
        end: keratin_proto::StreamPartitionEnd,
    ) -> Result<(), Ended> {
        let tag = end.consumer_tag.clone();
        let Some(slot) = self.stream_consumers.get(&tag) else {
            tracing::debug!(%tag, "stream frame for an unknown consumer");
            return Ok(());
        };
        let handle_gone = {
            let mut ends = lock(&slot.ends);
            if !ends.record(end, slot.frames_sent) {
                return Ok(());
            }
            match slot.events.try_send(StreamEvent::EndsPending) {
                Ok(()) => {
                    ends.token_sent();
                    false
                }
                // Frames are in the channel: the handle takes the ends in after them.
                Err(mpsc::error::TrySendError::Full(_)) => false,
                Err(mpsc::error::TrySendError::Closed(_)) => true,
            }
        };
        if handle_gone {
            self.cancel_consumer(tag).await?;
        }
        Ok(())
    }

    async fn on_error_frame(&mut self, error: keratin_proto::ErrorFrame) -> Result<(), Ended> {
        let body = error.error;
        match error.request_id {
            Some(request_id)
                if self
                    .barrier
                    .as_ref()
                    .is_some_and(|barrier| barrier.request_id == request_id) =>
            {
                self.on_barrier_done().await?;
            }
            Some(request_id) => match self.requests.remove(&request_id) {
                Some(pending) => {
                    if let RequestKind::Subscribe { tag, .. }
                    | RequestKind::StreamSubscribe { tag, .. }
                    | RequestKind::Cancel { tag } = &pending.kind
                    {
                        self.consumers.remove(tag);
                        self.stream_consumers.remove(tag);
                    }
                    if let Some(reply) = pending.reply {
                        let _ = reply.send(Err(ClientError::Server(body.clone())));
                    }
                }
                None => tracing::debug!(request_id, %body, "error for an unknown request"),
            },
            None if !error.fatal => tracing::warn!(%body, "the broker reported an error"),
            None => {}
        }
        if error.fatal {
            return Err(format!("the broker ended the connection: {body}"));
        }
        Ok(())
    }

    /// Settles everything still waiting, as the crate docs promise for a lost connection.
    fn settle_everything(mut self, detail: String) {
        let detail = {
            let mut lost = lock(&self.lost);
            lost.get_or_insert(detail).clone()
        };
        for (_, pending) in self.requests.drain() {
            if let Some(reply) = pending.reply {
                let _ = reply.send(Err(ClientError::ConnectionLost {
                    detail: detail.clone(),
                }));
            }
        }
        for (_, waiter) in self.publishes.drain() {
            match waiter {
                Waiter::Confirmed(waiter) => {
                    let _ = waiter.send(PublishOutcome::Lost(detail.clone()));
                }
                Waiter::Buffered(entry) => entry.drop_with(ClientError::OutcomeUnknown {
                    error: None,
                    detail: format!(
                        "buffered message written, then the connection ended: {detail}"
                    ),
                }),
            }
        }
        self.consumers.clear();
        for (_, slot) in self.stream_consumers.drain() {
            lock(&slot.ended)
                .get_or_insert_with(|| StreamEndReason::ConnectionLost(detail.clone()));
        }
        self.commands.close();
        while let Ok(command) = self.commands.try_recv() {
            settle_unsent_command(command, &detail);
        }
        for done in self.close_done.drain(..) {
            let _ = done.send(());
        }
    }
}

fn settle_unsent_command(command: Command, detail: &str) {
    let lost = || ClientError::ConnectionLost {
        detail: detail.to_owned(),
    };
    match command {
        Command::Request { reply, .. } => {
            let _ = reply.send(Err(lost()));
        }
        Command::Publish { waiters, .. } => {
            for waiter in waiters {
                settle_unsent(waiter, lost(), detail);
            }
        }
        Command::Close { done } => {
            let _ = done.send(());
        }
    }
}

fn settle_unsent(waiter: Waiter, error: ClientError, detail: &str) {
    match waiter {
        Waiter::Confirmed(waiter) => {
            let _ = waiter.send(PublishOutcome::NotSent(error));
        }
        Waiter::Buffered(entry) => {
            tracing::debug!(%detail, "buffered message not sent");
            entry.drop_with(error);
        }
    }
}

/// Locks a slot shared with the task (the lost reason, a consumer's end). A poisoned lock
/// still holds a valid `Option`: each is written whole.
pub(crate) fn lock<T>(slot: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The bytes a message adds to a `Publish` frame, near enough for the coalescing bound.
fn message_bytes(message: &Message) -> usize {
    message.body.len()
        + message.routing_key.as_ref().map_or(0, String::len)
        + message
            .headers
            .iter()
            .map(|h| h.name.len() + h.value.len())
            .sum::<usize>()
        + 32
}
