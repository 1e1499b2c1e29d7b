//! The failover case of `compare-cluster` (issue 14): a producer at a steady pace that survives
//! the loss of the leader (`FailoverPublisher`: lapin does not reconnect, so the AMQP side opens
//! the next node's connection on a nack, an error or a confirm timeout; async-nats reconnects
//! itself; the Keratin side, `keratin_cluster_peer::KeratinPublisher`, connects to the next node
//! and lets the client follow the 421 to the new leader), the timing from the kill to the first confirm of a publish sent after it
//! (`failover_publish`), and the count of what the queue holds against what was confirmed
//! (`count_messages`, `tally`). The kill, the restart and the table are `cluster_bench`'s.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;

use crate::cluster_bench::{ClusterConfig, ClusterSystem};
use crate::contender::BenchResult;
use crate::keratin_cluster_peer::{count_keratin, node_addrs, KeratinPublisher};

/// A failover confirm not back within this counts as failed and (AMQP) reopens the connection:
/// the recipe's bound (peer-clusters.md), well above the p99.9 of an undisturbed cluster here.
pub(crate) const CONFIRM_TIMEOUT: Duration = Duration::from_secs(1);

/// Failover: publishing at the steady pace before the kill, and again after the first confirm.
const FAILOVER_STEADY: Duration = Duration::from_millis(1500);

/// Failover: the longest wait from the kill for the first confirm (NATS took 4.7 s here).
pub(crate) const FAILOVER_DEADLINE: Duration = Duration::from_secs(60);

/// Failover: most publishes awaiting a confirm; at 1,000/s and a 1 s confirm timeout the
/// publisher never needs more.
const FAILOVER_IN_FLIGHT_MAX: usize = 2_000;

/// Failover: a failed sweep over every node waits this before the next one.
pub(crate) const RECONNECT_PAUSE: Duration = Duration::from_millis(20);

/// Counting: the consumer stops after this long without a delivery.
pub(crate) const COUNT_IDLE: Duration = Duration::from_secs(3);

/// Counting: the longest a count may take.
const COUNT_DEADLINE: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------------
// Counting what a queue holds against what was confirmed.

/// A consumer's count of the failover round's messages against the publisher's confirms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Publishes confirmed.
    pub confirmed: u64,
    /// Confirmed and delivered once.
    pub once: u64,
    /// Confirmed and delivered more than once.
    pub repeated: u64,
    /// Confirmed and never delivered: lost.
    pub missing: u64,
    /// Delivered though never confirmed (nacked, failed or timed out): allowed, at least once.
    pub unconfirmed_present: u64,
}

/// Compares the confirmed sequence numbers with the deliveries counted per sequence number.
pub fn tally(confirmed: &[u64], delivered: &HashMap<u64, u32>) -> Tally {
    let mut result = Tally {
        confirmed: confirmed.len() as u64,
        ..Tally::default()
    };
    let mut confirmed_set = std::collections::HashSet::with_capacity(confirmed.len());
    for seq in confirmed {
        confirmed_set.insert(*seq);
        match delivered.get(seq).copied().unwrap_or(0) {
            0 => result.missing += 1,
            1 => result.once += 1,
            _ => result.repeated += 1,
        }
    }
    result.unconfirmed_present = delivered
        .keys()
        .filter(|seq| !confirmed_set.contains(seq))
        .count() as u64;
    result
}

/// A 1 KiB body whose first 8 bytes carry `seq` (little-endian), for the count.
fn numbered_body(seq: u64, body_bytes: usize) -> Bytes {
    let mut body = vec![0x5a_u8; body_bytes.max(8)];
    body[..8].copy_from_slice(&seq.to_le_bytes());
    Bytes::from(body)
}

fn body_seq(body: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(body.get(..8)?.try_into().ok()?))
}

// ---------------------------------------------------------------------------------------------
// The failover publisher.

/// A confirmed publish of the failover round: (connection generation, sequence, outcome).
pub(crate) type Sent = BoxFuture<'static, (u64, u64, Result<(), String>)>;

/// An AMQP publisher that reopens its connection, node after node, after a failure.
pub(crate) struct AmqpPublisher {
    /// Every node's URI, the leader's first.
    uris: Vec<String>,
    queue: String,
    link: Option<(lapin::Connection, lapin::Channel)>,
    /// Counts connections opened; a failure of an older one leaves the current one alone.
    generation: u64,
    /// The node tried next.
    next_node: usize,
    /// No new sweep before this.
    retry_at: Instant,
}

impl AmqpPublisher {
    /// The channel, opening a connection to the next node that answers if there is none.
    async fn channel(&mut self) -> Option<lapin::Channel> {
        if let Some((_, channel)) = &self.link {
            return Some(channel.clone());
        }
        if Instant::now() < self.retry_at {
            return None;
        }
        for _ in 0..self.uris.len() {
            let uri = self.uris[self.next_node % self.uris.len()].clone();
            self.next_node += 1;
            let open = async {
                let connection =
                    lapin::Connection::connect(&uri, lapin::ConnectionProperties::default())
                        .await?;
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(lapin::options::ConfirmSelectOptions::default())
                    .await?;
                Ok::<_, lapin::Error>((connection, channel))
            };
            if let Ok(Ok((connection, channel))) = tokio::time::timeout(CONFIRM_TIMEOUT, open).await
            {
                self.generation += 1;
                // The node that just answered is tried first again after a failure.
                self.next_node -= 1;
                self.link = Some((connection, channel.clone()));
                return Some(channel);
            }
        }
        self.retry_at = Instant::now() + RECONNECT_PAUSE;
        None
    }

    /// A publish of connection `generation` failed: drop that connection (and move to the next
    /// node) unless a newer one replaced it already.
    fn failed(&mut self, generation: u64) {
        if generation != self.generation {
            return;
        }
        if let Some((connection, _)) = self.link.take() {
            self.next_node += 1;
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(CONFIRM_TIMEOUT, connection.close(200, "reopen")).await;
            });
        }
    }
}

/// The failover round's producer.
pub(crate) enum FailoverPublisher {
    Keratin(KeratinPublisher),
    Amqp(AmqpPublisher),
    Nats {
        client: async_nats::Client,
        context: async_nats::jetstream::Context,
        queue: String,
    },
}

impl FailoverPublisher {
    /// Connects to every node, the leader's first.
    pub(crate) async fn connect(
        config: &ClusterConfig,
        system: ClusterSystem,
        leader: usize,
        queue: &str,
    ) -> BenchResult<FailoverPublisher> {
        let nodes = config.nodes(system)?;
        let mut order: Vec<String> = nodes.to_vec();
        order.rotate_left(leader - 1);
        match system {
            ClusterSystem::RabbitQuorum => {
                let mut publisher = AmqpPublisher {
                    uris: order,
                    queue: queue.to_string(),
                    link: None,
                    generation: 0,
                    next_node: 0,
                    retry_at: Instant::now(),
                };
                publisher
                    .channel()
                    .await
                    .ok_or("rabbitmq-quorum: no node accepted a connection")?;
                Ok(FailoverPublisher::Amqp(publisher))
            }
            ClusterSystem::NatsR3 => {
                let client = async_nats::ConnectOptions::new()
                    .retain_servers_order()
                    .connect(order)
                    .await
                    .map_err(|e| format!("connect to NATS: {e}"))?;
                let mut context = async_nats::jetstream::new(client.clone());
                context.set_timeout(CONFIRM_TIMEOUT);
                Ok(FailoverPublisher::Nats {
                    client,
                    context,
                    queue: queue.to_string(),
                })
            }
            ClusterSystem::KeratinCluster => Ok(FailoverPublisher::Keratin(
                KeratinPublisher::connect(node_addrs(&order)?, queue).await?,
            )),
            ClusterSystem::KeratinSingle => {
                Err("keratin-single: one node has no failover; skipped".into())
            }
        }
    }

    /// Starts publish `seq`, or returns `None` when no connection is open (AMQP, reconnecting).
    async fn send(&mut self, seq: u64, body_bytes: usize) -> Option<Sent> {
        let body = numbered_body(seq, body_bytes);
        match self {
            FailoverPublisher::Keratin(publisher) => publisher.send(seq, body).await,
            FailoverPublisher::Amqp(publisher) => {
                let channel = publisher.channel().await?;
                let (generation, queue) = (publisher.generation, publisher.queue.clone());
                Some(
                    async move {
                        let publish = async {
                            let properties =
                                lapin::BasicProperties::default().with_delivery_mode(2);
                            let confirm = channel
                                .basic_publish(
                                    "",
                                    &queue,
                                    lapin::options::BasicPublishOptions::default(),
                                    &body,
                                    properties,
                                )
                                .await
                                .map_err(|e| e.to_string())?;
                            match confirm.await.map_err(|e| e.to_string())? {
                                lapin::publisher_confirm::Confirmation::Ack(_) => Ok(()),
                                _ => Err("basic.nack".to_string()),
                            }
                        };
                        let outcome = tokio::time::timeout(CONFIRM_TIMEOUT, publish)
                            .await
                            .unwrap_or_else(|_| Err("no confirm within the timeout".into()));
                        (generation, seq, outcome)
                    }
                    .boxed(),
                )
            }
            FailoverPublisher::Nats { context, queue, .. } => {
                let (context, queue) = (context.clone(), queue.clone());
                Some(
                    async move {
                        let publish = async {
                            let ack = context
                                .publish(queue, body)
                                .await
                                .map_err(|e| e.to_string())?;
                            ack.await.map(|_| ()).map_err(|e| e.to_string())
                        };
                        let outcome = tokio::time::timeout(CONFIRM_TIMEOUT, publish)
                            .await
                            .unwrap_or_else(|_| Err("no PubAck within the timeout".into()));
                        (0, seq, outcome)
                    }
                    .boxed(),
                )
            }
        }
    }

    fn failed(&mut self, generation: u64) {
        match self {
            FailoverPublisher::Keratin(publisher) => publisher.failed(generation),
            FailoverPublisher::Amqp(publisher) => publisher.failed(generation),
            FailoverPublisher::Nats { .. } => {}
        }
    }

    /// Connections opened (AMQP), the first included.
    pub(crate) fn connections(&self) -> u64 {
        match self {
            FailoverPublisher::Keratin(publisher) => publisher.connections(),
            FailoverPublisher::Amqp(publisher) => publisher.generation,
            FailoverPublisher::Nats { .. } => 1,
        }
    }

    pub(crate) async fn close(self) {
        match self {
            FailoverPublisher::Keratin(publisher) => publisher.close().await,
            FailoverPublisher::Amqp(publisher) => {
                if let Some((connection, _)) = publisher.link {
                    let _ =
                        tokio::time::timeout(CONFIRM_TIMEOUT, connection.close(200, "bye")).await;
                }
            }
            FailoverPublisher::Nats { client, .. } => {
                let _ = tokio::time::timeout(CONFIRM_TIMEOUT, client.flush()).await;
            }
        }
    }
}

/// What the failover producer saw.
#[derive(Debug, Default)]
pub(crate) struct PublishLog {
    /// Sequence numbers confirmed, in confirm order.
    pub(crate) confirmed: Vec<u64>,
    /// Kill to the first confirm of a publish sent after the kill.
    pub(crate) recovery: Option<Duration>,
    /// Nacks, errors and timeouts.
    pub(crate) failures: u64,
    /// The first failure's words.
    pub(crate) first_failure: Option<String>,
}

/// Publishes at `rate` for [`FAILOVER_STEADY`], calls `kill`, goes on until the first confirm of
/// a publish sent after the kill (or [`FAILOVER_DEADLINE`]), then [`FAILOVER_STEADY`] more,
/// and waits for every publish in flight.
pub(crate) async fn failover_publish(
    publisher: &mut FailoverPublisher,
    body_bytes: usize,
    rate: u32,
    kill: impl FnOnce() -> BenchResult<Instant>,
) -> BenchResult<PublishLog> {
    let mut log = PublishLog::default();
    let mut kill = Some(kill);
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let began = Instant::now();
    let (mut started, mut sent) = (0u64, 0u64);
    let mut killed: Option<(Instant, u64)> = None;
    let mut stop_at: Option<Instant> = None;
    let mut pending: FuturesUnordered<Sent> = FuturesUnordered::new();
    loop {
        let now = Instant::now();
        if stop_at.is_some_and(|at| now >= at) && pending.is_empty() {
            break;
        }
        if killed.is_none() && now.duration_since(began) >= FAILOVER_STEADY {
            if let Some(kill) = kill.take() {
                killed = Some((kill()?, sent));
            }
        }
        if let Some((at, _)) = killed {
            if log.recovery.is_none() && stop_at.is_none() && at.elapsed() >= FAILOVER_DEADLINE {
                stop_at = Some(Instant::now());
            }
        }
        tokio::select! {
            _ = ticker.tick(), if stop_at.is_none_or(|at| Instant::now() < at) => {
                let due = (began.elapsed().as_secs_f64() * f64::from(rate)) as u64 + 1;
                while started < due && pending.len() < FAILOVER_IN_FLIGHT_MAX {
                    // A message not sent (no connection) is skipped, not queued: the pace holds.
                    started += 1;
                    if let Some(future) = publisher.send(sent, body_bytes).await {
                        pending.push(future);
                        sent += 1;
                    } else {
                        break;
                    }
                }
            }
            Some((generation, seq, outcome)) = pending.next(), if !pending.is_empty() => {
                match outcome {
                    Ok(()) => {
                        log.confirmed.push(seq);
                        if let Some((at, first_after)) = killed {
                            if log.recovery.is_none() && seq >= first_after {
                                log.recovery = Some(at.elapsed());
                                stop_at = Some(Instant::now() + FAILOVER_STEADY);
                            }
                        }
                    }
                    Err(error) => {
                        log.failures += 1;
                        log.first_failure.get_or_insert(error);
                        publisher.failed(generation);
                    }
                }
            }
            else => {}
        }
    }
    Ok(log)
}

/// Consumes everything in `queue` from node `node` and counts the deliveries per sequence
/// number, until [`COUNT_IDLE`] passes without one.
pub(crate) async fn count_messages(
    config: &ClusterConfig,
    system: ClusterSystem,
    node: usize,
    queue: &str,
) -> BenchResult<HashMap<u64, u32>> {
    let url = config.nodes(system)?[node - 1].clone();
    let mut delivered: HashMap<u64, u32> = HashMap::new();
    let began = Instant::now();
    let mut count = |body: &[u8]| {
        if let Some(seq) = body_seq(body) {
            *delivered.entry(seq).or_default() += 1;
        }
    };
    match system {
        ClusterSystem::RabbitQuorum => {
            let connection =
                lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                    .await
                    .map_err(|e| format!("connect to {url}: {e}"))?;
            let channel = connection.create_channel().await?;
            channel
                .basic_qos(1000, lapin::options::BasicQosOptions::default())
                .await?;
            let mut consumer = channel
                .basic_consume(
                    queue,
                    "kcount",
                    lapin::options::BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await?;
            while began.elapsed() < COUNT_DEADLINE {
                match tokio::time::timeout(COUNT_IDLE, consumer.next()).await {
                    Ok(Some(delivery)) => count(&delivery?.data),
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = connection.close(200, "counted").await;
        }
        ClusterSystem::NatsR3 => {
            use async_nats::jetstream::consumer;
            let client = async_nats::connect(url.as_str())
                .await
                .map_err(|e| format!("connect to {url}: {e}"))?;
            let context = async_nats::jetstream::new(client.clone());
            let stream = context
                .get_stream(queue)
                .await
                .map_err(|e| format!("stream {queue}: {e}"))?;
            let config = consumer::pull::Config {
                durable_name: Some("kcount".into()),
                ack_policy: consumer::AckPolicy::Explicit,
                max_ack_pending: 10_000,
                ..Default::default()
            };
            let pull: consumer::PullConsumer = stream
                .get_or_create_consumer("kcount", config)
                .await
                .map_err(|e| format!("consumer on {queue}: {e}"))?;
            let mut messages = pull
                .stream()
                .max_messages_per_batch(1000)
                .messages()
                .await
                .map_err(|e| format!("pull from {queue}: {e}"))?;
            while began.elapsed() < COUNT_DEADLINE {
                match tokio::time::timeout(COUNT_IDLE, messages.next()).await {
                    Ok(Some(message)) => {
                        let message = message.map_err(|e| format!("pull from {queue}: {e}"))?;
                        count(&message.payload);
                        message
                            .ack()
                            .await
                            .map_err(|e| format!("ack on {queue}: {e}"))?;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = client.flush().await;
        }
        ClusterSystem::KeratinCluster => {
            let addr = node_addrs(std::slice::from_ref(&url))?[0];
            count_keratin(addr, queue, began + COUNT_DEADLINE, count).await?;
        }
        ClusterSystem::KeratinSingle => {
            return Err("keratin-single: one node has no failover to count".into())
        }
    }
    Ok(delivered)
}

/// What one failover round saw.
#[derive(Debug, Clone, Default)]
pub struct FailoverOutcome {
    /// The node killed (the queue's leader).
    pub leader: usize,
    /// Kill to the first confirm of a publish sent after it; `None`: none within the deadline.
    pub recovery: Option<Duration>,
    /// The count.
    pub tally: Tally,
    /// Nacks, errors and timeouts the producer saw.
    pub failures: u64,
    /// The first of them.
    pub first_failure: Option<String>,
    /// Connections the producer opened, the first included.
    pub connections: u64,
    /// Restart of the killed node until the queue had every member online again.
    pub rejoin: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_tells_lost_repeated_and_extra_messages_apart() {
        let delivered: HashMap<u64, u32> = [(1, 1), (2, 2), (4, 1), (9, 1)].into_iter().collect();
        assert_eq!(
            tally(&[1, 2, 3, 4], &delivered),
            Tally {
                confirmed: 4,
                once: 2,
                repeated: 1,
                missing: 1,
                unconfirmed_present: 1,
            }
        );
        assert_eq!(tally(&[], &HashMap::new()), Tally::default());
    }

    #[test]
    fn a_numbered_body_carries_its_sequence() {
        let body = numbered_body(0x0102_0304_0506_0708, 1024);
        assert_eq!(body.len(), 1024);
        assert_eq!(body_seq(&body), Some(0x0102_0304_0506_0708));
        assert_eq!(body_seq(&body[..7]), None);
    }
}
