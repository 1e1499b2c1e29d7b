//! The three drivers of `compare` (issue 9): one connection to one broker, speaking its own
//! protocol through its own client crate, behind one enum so that every workload is written once.
//!
//! - Keratin: `keratin-client`, single confirmed publishes (confirmed after fsync), consumer
//!   acks per delivery.
//! - RabbitMQ: `lapin` (AMQP 0-9-1), a durable queue (`x-queue-type` classic or quorum), a
//!   channel in confirm mode, persistent messages (`delivery_mode` 2) to the default exchange,
//!   `basic.qos` prefetch and one `basic.ack` per delivery.
//! - NATS JetStream: `async-nats`, a stream with file storage and discard policy `new` on one
//!   subject, `publish` awaited to its `PubAck`, a durable pull consumer with explicit acks.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};

use crate::contender::BenchResult;

/// A broker under comparison, and how its queue is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum System {
    /// Keratin in its default durable mode.
    Keratin,
    /// RabbitMQ, durable classic queue, persistent messages, publisher confirms.
    RabbitClassic,
    /// RabbitMQ, quorum queue, publisher confirms.
    RabbitQuorum,
    /// NATS JetStream, file storage.
    Nats,
}

impl System {
    /// Every system, in the table's column order.
    pub const ALL: [System; 4] = [
        System::Keratin,
        System::RabbitClassic,
        System::RabbitQuorum,
        System::Nats,
    ];

    /// The name used on the command line and in the table.
    pub fn name(self) -> &'static str {
        match self {
            System::Keratin => "keratin",
            System::RabbitClassic => "rabbitmq-classic",
            System::RabbitQuorum => "rabbitmq-quorum",
            System::Nats => "nats",
        }
    }

    /// Parses a name of [`System::name`].
    pub fn parse(text: &str) -> Result<System, String> {
        System::ALL
            .into_iter()
            .find(|s| s.name() == text.trim())
            .ok_or_else(|| {
                format!(
                    "unknown system {text:?}; use keratin, rabbitmq-classic, rabbitmq-quorum or nats"
                )
            })
    }

    /// Whether a confirm from this system means the message was fsynced, as stated in
    /// docs/benchmarks.md (issue 9).
    pub fn confirm_meaning(self) -> &'static str {
        match self {
            System::Keratin => "fsynced (fdatasync of the segment before the confirm)",
            System::RabbitClassic => {
                "fsynced, in batches: RabbitMQ confirms a persistent message in a durable queue \
                 once it is persisted to disk (its stores fsync every few hundred ms or when idle), \
                 or once every queue has delivered and had it acked, whichever comes first"
            }
            System::RabbitQuorum => {
                "fsynced: the Raft log entry is fsynced on a majority (here the one node) before \
                 the confirm"
            }
            System::Nats => {
                "NOT fsynced: in 2.9 the PubAck follows the write to the OS page cache; \
                 JetStream fsyncs its file store every sync_interval, 2 min by default"
            }
        }
    }
}

/// Where the brokers listen.
#[derive(Debug, Clone, Default)]
pub struct Endpoints {
    /// Keratin's protocol address.
    pub keratin: Option<SocketAddr>,
    /// An AMQP URI, like `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub amqp: Option<String>,
    /// A NATS URL, like `nats://127.0.0.1:4222`.
    pub nats: Option<String>,
}

/// One connection to one broker, bound to one queue (a stream on one subject for NATS).
pub enum Peer {
    /// Keratin's client.
    Keratin {
        /// The connection.
        client: Client,
        /// The queue.
        queue: String,
    },
    /// A RabbitMQ connection with one channel in confirm mode.
    Amqp {
        /// Kept open for the channel's lifetime.
        connection: lapin::Connection,
        /// The channel.
        channel: lapin::Channel,
        /// The queue.
        queue: String,
    },
    /// A NATS connection and its JetStream context.
    Nats {
        /// The core connection (for flushing acks).
        client: async_nats::Client,
        /// The JetStream context.
        context: async_nats::jetstream::Context,
        /// The stream's name, also its one subject.
        queue: String,
    },
}

/// How long a NATS publish waits for its `PubAck` before it counts as failed.
const NATS_ACK_TIMEOUT: Duration = Duration::from_secs(10);

fn missing(system: System, flag: &str) -> String {
    format!("no address for {}: pass {flag}", system.name())
}

impl Peer {
    /// Connects to `system` and binds the connection to `queue` (which need not exist yet).
    pub async fn connect(system: System, endpoints: &Endpoints, queue: &str) -> BenchResult<Peer> {
        let queue = queue.to_string();
        match system {
            System::Keratin => {
                let addr = endpoints
                    .keratin
                    .ok_or_else(|| missing(system, "--keratin"))?;
                let client = Client::connect(addr, ClientOptions::default()).await?;
                Ok(Peer::Keratin { client, queue })
            }
            System::RabbitClassic | System::RabbitQuorum => {
                let uri = endpoints
                    .amqp
                    .as_deref()
                    .ok_or_else(|| missing(system, "--amqp"))?;
                let connection =
                    lapin::Connection::connect(uri, lapin::ConnectionProperties::default())
                        .await
                        .map_err(|e| format!("connect to RabbitMQ at {uri}: {e}"))?;
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(lapin::options::ConfirmSelectOptions::default())
                    .await?;
                Ok(Peer::Amqp {
                    connection,
                    channel,
                    queue,
                })
            }
            System::Nats => {
                let url = endpoints
                    .nats
                    .as_deref()
                    .ok_or_else(|| missing(system, "--nats"))?;
                let client = async_nats::connect(url)
                    .await
                    .map_err(|e| format!("connect to NATS at {url}: {e}"))?;
                let mut context = async_nats::jetstream::new(client.clone());
                context.set_timeout(NATS_ACK_TIMEOUT);
                Ok(Peer::Nats {
                    client,
                    context,
                    queue,
                })
            }
        }
    }

    /// Creates the queue (stream) fresh; `max_bytes` caps a NATS stream (the fill case), with
    /// discard policy `new` so that a full stream refuses publishes instead of dropping.
    pub async fn declare(&self, system: System, max_bytes: Option<i64>) -> BenchResult<()> {
        self.declare_replicated(system, max_bytes, None).await
    }

    /// A Keratin queue of `partitions` partitions with `replicas` copies of each (`None`: a
    /// queue of one node), created fresh; the other systems have no partitioned queue here.
    pub async fn declare_partitioned(
        &self,
        partitions: u32,
        replicas: Option<usize>,
    ) -> BenchResult<()> {
        let Peer::Keratin { client, queue } = self else {
            return Err("only a Keratin queue is declared with partitions here".into());
        };
        let replicas = replicas
            .map(|r| u32::try_from(r).map_err(|_| format!("{r} replicas is too many")))
            .transpose()?;
        let settings = QueueSettings {
            partitions,
            replicas,
            ..QueueSettings::default()
        };
        client.declare(queue, settings).await?;
        Ok(())
    }

    /// [`Peer::declare`] on a cluster: `replicas` members (Keratin queue `replicas`, RabbitMQ
    /// quorum queue `x-quorum-initial-group-size`, NATS stream `num_replicas`); `None` keeps
    /// the broker's default (one node's queue or stream; a quorum queue on every cluster node).
    pub async fn declare_replicated(
        &self,
        system: System,
        max_bytes: Option<i64>,
        replicas: Option<usize>,
    ) -> BenchResult<()> {
        match self {
            Peer::Keratin { client, queue } => {
                let replicas = replicas
                    .map(|r| u32::try_from(r).map_err(|_| format!("{r} replicas is too many")))
                    .transpose()?;
                let settings = QueueSettings {
                    replicas,
                    ..QueueSettings::default()
                };
                client.declare(queue, settings).await?;
            }
            Peer::Amqp { channel, queue, .. } => {
                let kind = if system == System::RabbitQuorum {
                    "quorum"
                } else {
                    "classic"
                };
                let mut arguments = lapin::types::FieldTable::default();
                arguments.insert(
                    "x-queue-type".into(),
                    lapin::types::AMQPValue::LongString(kind.into()),
                );
                if let (Some(replicas), System::RabbitQuorum) = (replicas, system) {
                    let size = i32::try_from(replicas)
                        .map_err(|_| format!("{replicas} replicas is too many"))?;
                    arguments.insert(
                        "x-quorum-initial-group-size".into(),
                        lapin::types::AMQPValue::LongInt(size),
                    );
                }
                let options = lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                };
                channel.queue_declare(queue, options, arguments).await?;
            }
            Peer::Nats { context, queue, .. } => {
                use async_nats::jetstream::stream;
                let config = stream::Config {
                    name: queue.clone(),
                    subjects: vec![queue.clone()],
                    storage: stream::StorageType::File,
                    discard: stream::DiscardPolicy::New,
                    // Acked messages leave the stream, as they leave a queue.
                    retention: stream::RetentionPolicy::WorkQueue,
                    max_bytes: max_bytes.unwrap_or(-1),
                    num_replicas: replicas.unwrap_or_default(),
                    ..Default::default()
                };
                context
                    .create_stream(config)
                    .await
                    .map_err(|e| format!("create stream {queue}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Deletes the queue (stream) and what it holds.
    pub async fn delete(&self) -> BenchResult<()> {
        match self {
            Peer::Keratin { client, queue } => client.delete(queue).await?,
            Peer::Amqp { channel, queue, .. } => {
                channel
                    .queue_delete(queue, lapin::options::QueueDeleteOptions::default())
                    .await?;
            }
            Peer::Nats { context, queue, .. } => {
                context
                    .delete_stream(queue)
                    .await
                    .map_err(|e| format!("delete stream {queue}: {e}"))?;
            }
        }
        Ok(())
    }

    /// One durable publish, awaited to its confirm (Keratin confirm, AMQP basic.ack, NATS
    /// PubAck). The error is the broker's or the client's words.
    pub async fn publish(&self, body: Bytes) -> Result<(), String> {
        match self {
            Peer::Keratin { client, queue } => client
                .publish(queue, OutgoingMessage::new(body))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Peer::Amqp { channel, queue, .. } => {
                let properties = lapin::BasicProperties::default().with_delivery_mode(2);
                let confirm = channel
                    .basic_publish(
                        "",
                        queue,
                        lapin::options::BasicPublishOptions::default(),
                        &body,
                        properties,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                match confirm.await.map_err(|e| e.to_string())? {
                    lapin::publisher_confirm::Confirmation::Ack(_) => Ok(()),
                    lapin::publisher_confirm::Confirmation::Nack(_) => {
                        Err("basic.nack from the broker".into())
                    }
                    lapin::publisher_confirm::Confirmation::NotRequested => {
                        Err("the channel is not in confirm mode".into())
                    }
                }
            }
            Peer::Nats { context, queue, .. } => {
                let ack = context
                    .publish(queue.clone(), body)
                    .await
                    .map_err(|e| e.to_string())?;
                ack.await.map(|_| ()).map_err(|e| e.to_string())
            }
        }
    }

    /// Whether the broker has told this connection to stop publishing (AMQP
    /// `connection.blocked`); only RabbitMQ has such a signal.
    pub fn blocked(&self) -> bool {
        match self {
            Peer::Amqp { connection, .. } => connection.status().blocked(),
            _ => false,
        }
    }

    /// Consumes and acks (one ack per delivery) up to `count` messages with `prefetch`
    /// unacked at most, giving up when nothing arrives for `idle`: the messages consumed.
    pub async fn consume(&self, count: u64, prefetch: u32, idle: Duration) -> BenchResult<u64> {
        let mut consumed = 0u64;
        match self {
            Peer::Keratin { client, queue } => {
                let mut consumer = client.subscribe(queue, prefetch).await?;
                while consumed < count {
                    match tokio::time::timeout(idle, consumer.recv()).await {
                        Ok(Some(delivery)) => {
                            delivery.ack()?;
                            consumed += 1;
                        }
                        Ok(None) => return Err("the Keratin consumer ended".into()),
                        Err(_) => break,
                    }
                }
                consumer.cancel().await?;
            }
            Peer::Amqp { channel, queue, .. } => {
                let prefetch = u16::try_from(prefetch).unwrap_or(u16::MAX);
                channel
                    .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
                    .await?;
                let mut consumer = channel
                    .basic_consume(
                        queue,
                        "kbench",
                        lapin::options::BasicConsumeOptions::default(),
                        lapin::types::FieldTable::default(),
                    )
                    .await?;
                // One basic.ack per delivery, sent without waiting for the previous one to be
                // written (lapin resolves an ack once its frame is on the socket): waiting for
                // each in turn would measure lapin's I/O thread round trip, not the broker.
                let mut acks = FuturesUnordered::new();
                while consumed < count {
                    while let Some(Some(sent)) = acks.next().now_or_never() {
                        sent?;
                    }
                    match tokio::time::timeout(idle, consumer.next()).await {
                        Ok(Some(delivery)) => {
                            let acker = delivery?.acker;
                            acks.push(async move {
                                acker.ack(lapin::options::BasicAckOptions::default()).await
                            });
                            consumed += 1;
                        }
                        Ok(None) => return Err("the AMQP consumer ended".into()),
                        Err(_) => break,
                    }
                }
                while let Some(sent) = acks.next().await {
                    sent?;
                }
                channel
                    .basic_cancel("kbench", lapin::options::BasicCancelOptions::default())
                    .await?;
            }
            Peer::Nats {
                client,
                context,
                queue,
            } => {
                use async_nats::jetstream::consumer;
                let stream = context
                    .get_stream(queue)
                    .await
                    .map_err(|e| format!("stream {queue}: {e}"))?;
                let config = consumer::pull::Config {
                    durable_name: Some("kbench".into()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    max_ack_pending: i64::from(prefetch),
                    ..Default::default()
                };
                let pull: consumer::PullConsumer = stream
                    .get_or_create_consumer("kbench", config)
                    .await
                    .map_err(|e| format!("consumer on {queue}: {e}"))?;
                let mut messages = pull
                    .stream()
                    .max_messages_per_batch(prefetch as usize)
                    .messages()
                    .await
                    .map_err(|e| format!("pull from {queue}: {e}"))?;
                while consumed < count {
                    match tokio::time::timeout(idle, messages.next()).await {
                        Ok(Some(message)) => {
                            message
                                .map_err(|e| format!("pull from {queue}: {e}"))?
                                .ack()
                                .await
                                .map_err(|e| format!("ack on {queue}: {e}"))?;
                            consumed += 1;
                        }
                        Ok(None) => return Err("the NATS pull consumer ended".into()),
                        Err(_) => break,
                    }
                }
                client
                    .flush()
                    .await
                    .map_err(|e| format!("flush acks: {e}"))?;
            }
        }
        Ok(consumed)
    }

    /// Closes the connection.
    pub async fn close(self) {
        match self {
            Peer::Keratin { client, .. } => client.close().await,
            Peer::Amqp { connection, .. } => {
                // A close refused by a broker that is going away changes nothing here.
                let _ = connection.close(200, "bye").await;
            }
            Peer::Nats { client, .. } => {
                // The connection closes when dropped; a failed flush loses only acks of a
                // consumer that has finished.
                let _ = client.flush().await;
            }
        }
    }
}
