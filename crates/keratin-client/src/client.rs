//! [`Client`], the cheap, cloneable handle to one connection, and the admin requests.
//!
//! Owns connecting, the request/reply round trip with its `request_timeout`, and the admin
//! verbs (declare, delete, purge, info, list, settings). Publishing lives in `publisher.rs`,
//! consuming in `consumer.rs`, the socket in `connection.rs`.

use std::sync::Arc;

use keratin_proto::{
    Declare, Frame, QueueInfoReply, QueueList, QueueRequest, QueueSettings, QueueSettingsUpdate,
    QueueSummary, ServerInfo, SetQueueSettings,
};
use tokio::net::ToSocketAddrs;
use tokio::sync::{mpsc, oneshot};

use crate::connection::{self, duration_ms, Command, Control, Handle, Ids, RequestKind};
use crate::error::{ClientError, PublishFailed};
use crate::options::ClientOptions;
use crate::publish_router::Routers;
use crate::routing::Peers;

/// A connection to a Keratin broker. Cloning is cheap: every clone shares the one connection
/// and its background task. The connection closes (politely, with `Close`) when the last
/// clone, consumer and buffered publisher is dropped, or at [`Client::close`].
///
/// The client does not reconnect by itself; see the crate docs, "Reconnect behaviour".
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    handle: Handle,
    options: ClientOptions,
    /// Connections to other nodes of the cluster, opened to follow 421s (`routing.rs`).
    peers: Peers,
    /// The publish routers of the queues published to lately (`publish_router.rs`).
    routers: Routers,
    /// Publishes go through the routers: the handshake listed other nodes, or a node answered
    /// 421 (a node listing only itself while it does not know its cluster yet).
    routing: std::sync::atomic::AtomicBool,
    /// The last sequence number given to a message of this client's producer.
    sequences: std::sync::atomic::AtomicU64,
    /// The producer id was the application's (`ClientOptions::producer_id`): its messages
    /// bring their own sequences, the client numbers none.
    own_sequences: bool,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("node_id", &self.handle.node_id)
            .field("name", &self.options.name)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to the broker at `addr` (the default port is 5680), shakes hands with
    /// `options.name`, and starts the background task that owns the socket. TCP connect and
    /// handshake together are limited by `options.connect_timeout`. A refused handshake is
    /// [`ClientError::Refused`] with the broker's message.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        mut options: ClientOptions,
    ) -> Result<Client, ClientError> {
        let own_sequences = options.idempotent && options.producer_id.is_some();
        if options.idempotent && options.producer_id.is_none() {
            // A new producer per client. Connections opened to follow 421s get these options,
            // so a redirected retry carries the same producer id.
            options.producer_id = Some(random_producer_id());
        }
        let handle = connection::open(addr, &options).await?;
        tracing::debug!(node_id = %handle.node_id, "connected to keratin");
        let routing = handle.info.nodes.len() > 1;
        Ok(Client {
            inner: Arc::new(Inner {
                handle,
                options,
                peers: Peers::default(),
                routers: Routers::default(),
                routing: std::sync::atomic::AtomicBool::new(routing),
                sequences: std::sync::atomic::AtomicU64::new(0),
                own_sequences,
            }),
        })
    }

    /// `message` with its sequence number: its own, or the next of this client's producer.
    /// Every publishing entry point numbers its messages before anything else (a retry, a
    /// redirect to another node's connection) so that a message keeps one number. Refused
    /// without one when the application set the producer id: numbered from 1 in every run of
    /// the application, a run's messages would be confirmed as retries of an earlier run's
    /// and dropped.
    #[expect(
        clippy::result_large_err,
        reason = "the refused message is handed back, as every publish path does (publisher.rs)"
    )]
    pub(crate) fn numbered(
        &self,
        mut message: crate::OutgoingMessage,
    ) -> Result<crate::OutgoingMessage, PublishFailed> {
        if self.inner.options.idempotent && message.sequence.is_none() {
            if self.inner.own_sequences {
                return Err(PublishFailed {
                    message,
                    error: own_sequence_missing(),
                });
            }
            let next = self
                .inner
                .sequences
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            message.sequence = Some(next);
        }
        Ok(message)
    }

    /// The broker node's name, from its handshake.
    pub fn node_id(&self) -> &str {
        &self.inner.handle.node_id
    }

    /// Where the node says it and its cluster can be reached: its HTTP admin address and the
    /// cluster's nodes (protocol version 3 on; empty when the node is older).
    pub fn server_info(&self) -> &ServerInfo {
        &self.inner.handle.info
    }

    /// The user the node logged this connection in as, from its handshake: the user of
    /// [`ClientOptions::credentials`], or the identity of the client certificate. `None`
    /// without credentials (or from a node older than protocol version 6).
    pub fn user(&self) -> Option<&str> {
        self.inner.handle.user.as_deref()
    }

    /// The protocol version agreed in the handshake ([`keratin_proto::PROTOCOL_VERSION`], or an
    /// older one the node speaks).
    pub fn protocol_version(&self) -> u16 {
        self.inner.handle.version
    }

    /// The options this client was connected with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// Whether the connection is still up. Once `false`, it stays `false`: connect again.
    pub fn is_connected(&self) -> bool {
        !self.inner.handle.commands.is_closed()
    }

    /// Creates `queue`, or succeeds if it exists with the same settings (409 otherwise).
    /// `settings.replicas` needs protocol version 4 (a node that speaks only an older one
    /// refuses nothing but cannot carry it: the call fails with [`ClientError::Encode`]).
    pub async fn declare(&self, queue: &str, settings: QueueSettings) -> Result<(), ClientError> {
        self.declare_on(queue, settings, &[]).await
    }

    /// [`Client::declare`] with the queue's replicas pinned to `nodes` (a cluster's node ids;
    /// the first is partition 0's preferred leader, the next partitions' rotate over them).
    /// Needs protocol version 5 when `nodes` is not empty (an older node: the call fails with
    /// [`ClientError::Encode`]); `nodes` is ignored when the queue exists.
    pub async fn declare_on(
        &self,
        queue: &str,
        settings: QueueSettings,
        nodes: &[u64],
    ) -> Result<(), ClientError> {
        self.request_ok_routed(format!("declare {queue}"), |request_id| {
            Frame::Declare(Declare {
                request_id,
                queue: queue.to_owned(),
                settings: settings.clone(),
                nodes: nodes.to_vec(),
            })
        })
        .await
    }

    /// Deletes `queue` and all its messages.
    pub async fn delete(&self, queue: &str) -> Result<(), ClientError> {
        self.request_ok_routed(format!("delete {queue}"), |request_id| {
            Frame::Delete(QueueRequest {
                request_id,
                queue: queue.to_owned(),
            })
        })
        .await
    }

    /// Removes every ready message of `queue` (inflight ones stay until settled).
    pub async fn purge(&self, queue: &str) -> Result<(), ClientError> {
        self.request_ok_routed(format!("purge {queue}"), |request_id| {
            Frame::Purge(QueueRequest {
                request_id,
                queue: queue.to_owned(),
            })
        })
        .await
    }

    /// Changes settings of a live queue.
    pub async fn set_queue_settings(
        &self,
        queue: &str,
        update: QueueSettingsUpdate,
    ) -> Result<(), ClientError> {
        self.request_ok_routed(format!("set settings of {queue}"), |request_id| {
            Frame::SetQueueSettings(SetQueueSettings {
                request_id,
                queue: queue.to_owned(),
                update: update.clone(),
            })
        })
        .await
    }

    /// A queue's settings and per-partition counts, with each partition's leader
    /// ([`keratin_proto::PartitionInfo::leading`], `leader`, `leader_addr`).
    pub async fn info(&self, queue: &str) -> Result<QueueInfoReply, ClientError> {
        self.info_at(queue).await.map(|(info, _)| info)
    }

    /// [`Client::info`] and the connection that answered it (the node whose view `leading`
    /// describes).
    pub(crate) async fn info_at(
        &self,
        queue: &str,
    ) -> Result<(QueueInfoReply, Client), ClientError> {
        let operation = format!("info {queue}");
        let timeout = self.inner.options.request_timeout;
        let (reply, node) = self
            .routed(&operation, timeout, |node| {
                let operation = operation.clone();
                async move {
                    let reply = node
                        .request(operation, RequestKind::Plain, |request_id| {
                            Frame::QueueInfo(QueueRequest {
                                request_id,
                                queue: queue.to_owned(),
                            })
                        })
                        .await?;
                    Ok((reply, node))
                }
            })
            .await?;
        match reply {
            Frame::QueueInfoReply(info) => Ok((info, node)),
            other => Err(unexpected(operation, "QueueInfoReply", &other)),
        }
    }

    /// Every queue, sorted by name.
    pub async fn list(&self) -> Result<Vec<QueueSummary>, ClientError> {
        let operation = "list queues".to_owned();
        let reply = self
            .request(operation.clone(), RequestKind::Plain, |request_id| {
                Frame::QueueList(QueueList { request_id })
            })
            .await?;
        match reply {
            Frame::QueueListReply(list) => Ok(list.queues),
            other => Err(unexpected(operation, "QueueListReply", &other)),
        }
    }

    /// Sends `Close`, lets the broker finish the answers it owes (confirms of publishes already
    /// syncing), and waits until the connection is closed. Every clone is closed with it.
    pub async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self
            .inner
            .handle
            .commands
            .send(Command::Close { done })
            .await
            .is_ok()
        {
            // An error means the task already ended: closed either way.
            let _ = closed.await;
        }
    }

    /// [`Client::request_ok`] following 421s to the leader (`routing.rs`).
    async fn request_ok_routed(
        &self,
        operation: String,
        build: impl Fn(u64) -> Frame,
    ) -> Result<(), ClientError> {
        let timeout = self.inner.options.request_timeout;
        let build = &build;
        self.routed(&operation, timeout, |node| {
            let operation = operation.clone();
            async move { node.request_ok(operation, build).await }
        })
        .await
    }

    pub(crate) async fn request_ok(
        &self,
        operation: String,
        build: impl FnOnce(u64) -> Frame,
    ) -> Result<(), ClientError> {
        match self
            .request(operation.clone(), RequestKind::Plain, build)
            .await?
        {
            Frame::Ok(_) => Ok(()),
            other => Err(unexpected(operation, "Ok", &other)),
        }
    }

    /// One request/reply round trip, limited by `request_timeout`. An `Error` reply becomes
    /// [`ClientError::Server`].
    pub(crate) async fn request(
        &self,
        operation: String,
        kind: RequestKind,
        build: impl FnOnce(u64) -> Frame,
    ) -> Result<Frame, ClientError> {
        let request_id = self.ids().request_id();
        let (reply, answer) = oneshot::channel();
        let command = Command::Request {
            request_id,
            frame: build(request_id),
            kind,
            reply,
        };
        let timeout = self.inner.options.request_timeout;
        let round_trip = async {
            self.send_command(command).await?;
            answer.await.map_err(|_| self.lost_error())?
        };
        tokio::time::timeout(timeout, round_trip)
            .await
            .map_err(|_| ClientError::Timeout {
                operation,
                timeout_ms: duration_ms(timeout),
            })?
    }

    pub(crate) async fn send_command(&self, command: Command) -> Result<(), ClientError> {
        self.inner
            .handle
            .commands
            .send(command)
            .await
            .map_err(|_| self.lost_error())
    }

    /// The error for a connection that has ended, with the reason the task recorded.
    pub(crate) fn lost_error(&self) -> ClientError {
        let detail = connection::lock(&self.inner.handle.lost)
            .clone()
            .unwrap_or_else(|| "the connection task ended".to_owned());
        ClientError::ConnectionLost { detail }
    }

    pub(crate) fn commands(&self) -> &mpsc::Sender<Command> {
        &self.inner.handle.commands
    }

    pub(crate) fn ids(&self) -> &Ids {
        &self.inner.handle.ids
    }

    pub(crate) fn peers(&self) -> &Peers {
        &self.inner.peers
    }

    pub(crate) fn routers(&self) -> &Routers {
        &self.inner.routers
    }

    /// Whether publishes go through the per-queue routers (see [`Inner::routing`]).
    pub(crate) fn routes_publishes(&self) -> bool {
        self.inner
            .routing
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// From now on publishes go through the routers: a node answered 421.
    pub(crate) fn route_publishes(&self) {
        self.inner
            .routing
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A handle that does not keep the connection open (a publish router holds one).
    pub(crate) fn downgrade(&self) -> WeakClient {
        WeakClient(Arc::downgrade(&self.inner))
    }

    pub(crate) fn control(&self) -> &mpsc::UnboundedSender<Control> {
        &self.inner.handle.control
    }
}

/// A [`Client`] that does not keep it alive: [`WeakClient::upgrade`] gives it back while a
/// clone lives.
#[derive(Clone)]
pub(crate) struct WeakClient(std::sync::Weak<Inner>);

impl WeakClient {
    pub(crate) fn upgrade(&self) -> Option<Client> {
        self.0.upgrade().map(|inner| Client { inner })
    }
}

pub(crate) fn unexpected(operation: String, expected: &'static str, got: &Frame) -> ClientError {
    ClientError::UnexpectedReply {
        operation,
        expected,
        got: got.frame_type().name(),
    }
}

/// The refusal of a message without a sequence from a producer whose id the application set.
pub(crate) fn own_sequence_missing() -> ClientError {
    ClientError::InvalidArgument(
        "this client's producer id was set in ClientOptions::producer_id, so each message \
         needs a sequence of its own (OutgoingMessage::with_sequence) that never repeats for \
         that id: numbered by the client from 1 again after a restart, messages would be \
         confirmed as retries of earlier ones and dropped. Nothing was sent. Leave \
         producer_id unset for a new producer per client"
            .to_string(),
    )
}

/// A producer id nobody else picks in practice: 64 bits from the standard library's random
/// hash keys (seeded from the OS), the time and the process id.
fn random_producer_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(now);
    hasher.write_u32(std::process::id());
    hasher.finish()
}
