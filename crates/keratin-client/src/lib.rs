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
//! The client does **not** reconnect by itself in this version. When the connection is lost
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
//! leader's address when it knows it. The client follows that by itself: it opens (once, with
//! the same options) a connection to the named node and sends the refused request there —
//! for a publish only the messages that were refused (a batch is refused per partition).
//! Without a named leader it waits (100 ms, doubling, at most 1 s, at least the node's hint)
//! and tries the node it connected to and the nodes its handshake listed, in turn. A call
//! follows at most [`NOT_LEADER_RETRIES_MAX`] redirects, within `publish_timeout` for a
//! publish and `request_timeout` for other requests, then fails with
//! [`ClientError::NotLeader`]. A 421 changes nothing on the node, so following it never
//! stores a message twice.
//!
//! A [`Consumer`] whose queue's partition moves is ended by the node (`ConsumerEnd`, 421):
//! the consumer subscribes again at the named leader with the same prefetch and keeps
//! yielding deliveries. Deliveries it yielded before the move stay bound to the old
//! connection: acking or rejecting them sends the ack there, where the node no longer knows
//! the delivery (it answers a non-fatal 404, which the client logs); the new leader delivers
//! those messages again with `redelivered` set, so an application that acked one before the
//! move may see it twice (at-least-once).
//!
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
