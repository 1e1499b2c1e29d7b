//! The async Rust client of Keratin: connect, declare queues, publish with confirms (retrying
//! by itself when the broker says "limited, retry after N ms"), publish buffered with a bounded
//! buffer and a dropped-publish path, and consume as a `Stream` with ack/reject.
//!
//! ```no_run
//! # async fn example() -> Result<(), keratin_client::ClientError> {
//! use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
//! let client = Client::connect("127.0.0.1:5680", ClientOptions::default()).await?;
//! client.declare("orders", QueueSettings::default()).await?;
//! let confirmed = client.publish("orders", OutgoingMessage::new("hello")).await?;
//! let mut consumer = client.subscribe("orders", 100).await?;
//! if let Some(delivery) = consumer.recv().await {
//!     delivery.ack()?;
//! }
//! # let _ = confirmed;
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`client`]: [`Client`], the cloneable handle, connecting and the admin requests.
//! - [`publisher`]: [`Client::publish`]/[`Client::publish_batch`] with retry on
//!   `ERR_LIMITED` hints, and the [`BufferedPublisher`] with its [`DroppedPublishes`].
//! - [`consumer`]: [`Consumer`] (a `Stream` of [`Delivery`]) and ack/reject.
//! - `stream` (private): the stream requests of protocol version 7 on [`Client`]
//!   ([`Client::declare_stream`], [`Client::set_stream`], [`Client::stream_info`],
//!   [`Client::list_streams`], [`Client::delete_stream`], [`Client::commit_cursor`]).
//! - [`stream_consumer`]: [`Client::stream_subscribe`] and the [`StreamConsumer`] (a `Stream`
//!   of [`StreamDelivery`]) with its credit and [`StreamConsumer::commit`].
//! - `stream_ends` (private): a stream consumer's partition ends on their way from the
//!   connection task to the consumer, beside its bounded channel (a group may end a partition
//!   any number of times while the application reads nothing).
//! - [`error`]: [`ClientError`] and [`PublishFailed`].
//! - [`options`]: [`ClientOptions`] with its login [`Credentials`], and [`BufferedOptions`],
//!   with their defaults.
//! - `routing` (private): following `ERR_NOT_LEADER` (421) to the leader a cluster node
//!   names, over connections to the other nodes opened on demand; see "Clusters" below.
//! - `partitioning` (private): a message's partition as the broker computes it, and a queue's
//!   layout (each partition's leader).
//! - `publish_router` (private): confirmed publishing in a cluster, one task per queue with a
//!   lane per partition (order, redirects, backoff, resends).
//! - `connection` (private): the background task that owns the socket, multiplexes requests,
//!   publishes and consumers, sends heartbeats and notices a silent broker.
//!
//! The wire protocol is `docs/protocol.md`; frames and codes come from `keratin-proto`, whose
//! types this crate re-exports where they appear in its API.
//!
//! # Durability
//! [`Client::publish`] resolves only when the broker sent `Confirm` for the message, which it
//! does only after the fsync that covers it: a confirmed message survives a broker crash and a
//! power loss. A buffered message has no such promise: the broker never confirms it, and a
//! client crash loses the messages still in its buffer.
//!
//! # Reconnect behaviour
//! On a single node the client does **not** reconnect by itself. (In a cluster, publishes and
//! consumers go on through the other nodes, and reach a restarted node again through a new
//! connection: see "Clusters".) When the connection is lost
//! (socket error, the broker closes it, a fatal `Error`, or `server_silence_timeout` without a
//! single frame from the broker):
//! - every pending request (declare, info, subscribe, ...) fails with
//!   [`ClientError::ConnectionLost`], and so does every later call on the [`Client`];
//! - every confirmed publish already written fails with [`ClientError::OutcomeUnknown`]: the
//!   message may or may not be durable, and publishing it again can store it twice; confirmed
//!   publishes not yet written fail with [`ClientError::ConnectionLost`] (safe to publish again);
//! - every unsettled buffered message is reported on the [`DroppedPublishes`] path
//!   (`OutcomeUnknown` if it was written, `ConnectionLost` if not) and counted;
//! - every consumer's stream ends; its unacknowledged deliveries return to ready on the broker
//!   and are redelivered (with `redelivered` set) to whoever consumes next.
//!
//! The application connects again with [`Client::connect`] and decides what to republish.
//! [`Client::is_connected`] tells whether a client is still usable.
//!
//! # Clusters
//! A node that does not lead what a request needs answers 421 `ERR_NOT_LEADER`, naming the
//! leader's address when it knows it. The client connects to the other nodes as it needs them
//! (once each, with the same options; one connection per node, shared by every partition the
//! node leads) and:
//! - **admin requests** (declare, info, purge, ...) follow the 421 to the named node; without a
//!   named leader, or after two redirects in a row, they wait (100 ms, doubling, at most
//!   [`NOT_LEADER_BACKOFF_MAX`], at least the node's hint) and try the nodes the handshake
//!   listed in turn, at most [`NOT_LEADER_RETRIES_MAX`] times within `request_timeout`, then
//!   fail with [`ClientError::NotLeader`];
//! - **confirmed publishes** go to the leader of their partition. The client computes each
//!   message's partition as the broker does (routing key CRC32C; else the idempotent
//!   producer's id plus the sequence's block of [`PRODUCER_SEQUENCE_BLOCK`]; messages
//!   without either go to each partition's leader in turn, which stores each in a partition
//!   it leads) from the queue's layout
//!   (`QueueInfo`, once per queue), and keeps each
//!   partition's messages in order: a message refused with 421 or 429, or whose outcome is
//!   unknown (an idempotent producer's 504 or lost connection), is sent again after every
//!   earlier one of its partition was answered and before any later one, after a backoff when
//!   refusals repeat (never in a tight loop). An idempotent producer's message whose outcome is
//!   unknown is sent again to the new leader until `publish_timeout`; it fails as
//!   [`ClientError::OutcomeUnknown`] only then. One task per queue does this
//!   (`publish_router.rs`); on a single node publishes go straight to the connection;
//! - **consumers** subscribe on every node that leads a partition of the queue and follow
//!   leadership (see [`Consumer`]).
//!
//! A 421 changes nothing on the node, so following it never stores a message twice; a message
//! sent again after an unknown outcome is stored once while its partition's window of the
//! producer's sequences still holds the first copy (`docs/cluster.md`, "Idempotent
//! producers").
//!
//! A [`Consumer`] in a cluster holds one subscription per leading node. A node ends its
//! subscription when one of its partitions moves (`ConsumerEnd`, 421); the consumer then
//! (and after a lost connection, and every [`consumer::LEADERS_RECHECK`]) reads the queue's
//! leaders and subscribes where one is missing. Deliveries it yielded before a move stay bound
//! to the old connection: acking or rejecting them sends the ack there, where the node no
//! longer knows the delivery (it answers a non-fatal 404, which the client logs); the new
//! leader delivers those messages again with `redelivered` set, so an application that acked
//! one before the move may see it twice (at-least-once).

//! # Streams
//! Streams (issue 18, `docs/streams.md`) keep their messages after they are read. They need
//! protocol version 7: the client offers [`PROTOCOL_VERSION_OFFERED`], and on a connection to
//! a node that agreed on an older version every stream call fails with
//! [`ClientError::StreamsUnsupported`] without sending anything. Publish to a stream with
//! [`Client::publish`] and the stream's name; a message's routing key
//! ([`OutgoingMessage::with_routing_key`]) picks its partition (same key, same partition, in
//! order). A [`StreamConsumer`] gives the broker credit back as the application takes
//! messages (half the credit at a time), so at most `credit` messages wait in the client.
//! In a cluster [`Client::stream_subscribe`] follows a 421 to the node leading the stream's
//! cursor log, which serves its readers. A running stream consumer does not follow a move: a
//! partition's end (421 with the new node's address, also when the cursor log's leader moved)
//! is reported by [`StreamConsumer::take_partition_ends`]; subscribe again to resume from the
//! cursor's commit.
//!
//! # Logins
//! With [`ClientOptions::credentials`] the client logs in in its handshake (protocol version 6):
//! a password, an API token or its TLS client certificate ([`ClientTls::with_client_cert`]).
//! A refused login is [`ClientError::Refused`] with code 401 (and the broker's retry hint when
//! it slows down repeated failures); a request the user may not make fails with
//! [`ClientError::Server`], code 403. [`Client::user`] names the user the broker logged the
//! connection in as. Connections opened to follow a leader log in with the same credentials. A
//! broker older than version 6 cannot check a login, so the client does not connect to it with
//! credentials ([`ClientError::LoginUnsupported`]).
//!
//! # Heartbeats
//! The client sends a `Heartbeat` whenever it has written nothing for `heartbeat_interval`
//! (default 5 s). It does not answer the broker's heartbeats (the protocol asks for no answer);
//! any frame from the broker counts as a sign of life.

#![deny(missing_docs)]

pub mod client;
mod connection;
pub mod consumer;
pub mod error;
pub mod options;
mod partitioning;
mod publish_router;
pub mod publisher;
mod routing;
mod stream;
pub mod stream_consumer;
mod stream_ends;
pub mod tls;

pub use client::Client;
pub use connection::PROTOCOL_VERSION_OFFERED;
pub use consumer::{Consumer, Delivery, PREFETCH_MAX};
pub use error::{ClientError, PublishFailed};
pub use options::{BufferedOptions, ClientOptions, Credentials};
pub use partitioning::PRODUCER_SEQUENCE_BLOCK;
pub use publisher::{
    BufferedPublisher, Confirmed, DroppedPublish, DroppedPublishes, OutgoingMessage,
    RETRY_DELAY_MS_MIN,
};
pub use routing::{NOT_LEADER_BACKOFF_MAX, NOT_LEADER_BACKOFF_MIN, NOT_LEADER_RETRIES_MAX};
pub use stream_consumer::{
    StreamConsumer, StreamDelivery, StreamSubscribeOptions, STREAM_CREDIT_DEFAULT,
    STREAM_CREDIT_MAX,
};
pub use tls::ClientTls;

/// The wire protocol crate, for anything not re-exported here.
pub use keratin_proto as proto;
pub use keratin_proto::{
    Code, ErrorBody, Header, LimitReason, NodeAddress, Overflow, PartitionInfo, QueueInfoReply,
    QueueSettings, QueueSettingsUpdate, QueueSummary, ServerInfo, Update,
};
pub use keratin_proto::{
    CursorEntry, StreamInfoReply, StreamPartitionInfo, StreamRetentionUpdate, StreamSettings,
    StreamStart, StreamSummary, PROTOCOL_VERSION_STREAMS,
};
