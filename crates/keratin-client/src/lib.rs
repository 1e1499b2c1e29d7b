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
//! - [`error`]: [`ClientError`] and [`PublishFailed`].
//! - [`options`]: [`ClientOptions`] and [`BufferedOptions`] with their defaults.
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

pub use client::Client;
pub use consumer::{Consumer, Delivery, PREFETCH_MAX};
pub use error::{ClientError, PublishFailed};
pub use options::{BufferedOptions, ClientOptions};
pub use publisher::{
    BufferedPublisher, Confirmed, DroppedPublish, DroppedPublishes, OutgoingMessage,
    RETRY_DELAY_MS_MIN,
};

/// The wire protocol crate, for anything not re-exported here.
pub use keratin_proto as proto;
pub use keratin_proto::{
    Code, ErrorBody, Header, LimitReason, NodeAddress, Overflow, PartitionInfo, QueueInfoReply,
    QueueSettings, QueueSettingsUpdate, QueueSummary, ServerInfo, Update,
};
