//! Consumers: [`Consumer`], a `Stream` of [`Delivery`] values of one queue, and the ack/reject
//! of each delivery.
//!
//! Owns the handle's side of the subscriptions: the bounded delivery channels' receiving ends,
//! cancelling (explicitly or on drop), settling deliveries, and in a cluster keeping one
//! subscription on each node that leads a partition of the queue (a node serves a consumer
//! from every partition it leads, `docs/protocol.md` "Subscribe"): at the start from the
//! queue's info, and again when a subscription ends (a partition's leadership moved:
//! `ConsumerEnd` 421; the connection was lost) and every [`LEADERS_RECHECK`] (a leader that
//! stopped answering, a frozen process, keeps its subscription while its partitions move).
//! Routing `Deliver` frames to the right channel and coalescing acks into frames belongs to
//! `connection.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_core::Stream;
use keratin_proto::{Cancel, ErrorBody, Frame, Header, Subscribe};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::client::Client;
use crate::connection::{lock, ConsumerEnded, Control, RequestKind};
use crate::error::ClientError;
use crate::routing::{as_not_leader, not_leader_backoff};

/// Largest prefetch a consumer may ask for: the protocol's bound, which the broker enforces
/// too. The client's delivery channel is as large as the prefetch (the broker never sends more
/// unacknowledged deliveries), so this bounds the memory one consumer can hold.
pub use keratin_proto::PREFETCH_MAX;

/// One message delivered to a consumer. Settle it with [`Delivery::ack`] or
/// [`Delivery::reject`]; a delivery that is never settled stays inflight on the broker until
/// the consumer is cancelled or the connection ends, then returns to ready.
#[derive(Debug)]
pub struct Delivery {
    /// The queue the consumer reads.
    pub queue: String,
    /// The consumer it was delivered to.
    pub consumer_tag: String,
    /// Unique on the connection; what `Ack` and `Reject` name.
    pub delivery_id: u64,
    /// The partition the message lives in.
    pub partition: u32,
    /// Its offset in that partition's log.
    pub offset: u64,
    /// Whether it was delivered before (to any consumer).
    pub redelivered: bool,
    /// Deliveries so far, this one included.
    pub delivery_count: u32,
    /// The routing key it was published with (protocol version 7 on; `None` from an older
    /// node, which does not send it).
    pub routing_key: Option<String>,
    /// Headers as published, plus any the broker added.
    pub headers: Vec<Header>,
    /// The payload.
    pub body: Bytes,
    settle: DeliverySettle,
}

/// The part of a delivery that sends its ack or reject to the connection task.
#[derive(Debug)]
pub(crate) struct DeliverySettle {
    control: mpsc::UnboundedSender<Control>,
    settled: AtomicBool,
}

impl DeliverySettle {
    pub(crate) fn new(control: mpsc::UnboundedSender<Control>) -> DeliverySettle {
        DeliverySettle {
            control,
            settled: AtomicBool::new(false),
        }
    }
}

impl Delivery {
    pub(crate) fn from_frame(
        queue: String,
        deliver: keratin_proto::Deliver,
        settle: DeliverySettle,
    ) -> Delivery {
        Delivery {
            queue,
            consumer_tag: deliver.consumer_tag,
            delivery_id: deliver.delivery_id,
            partition: deliver.partition,
            offset: deliver.offset,
            redelivered: deliver.redelivered,
            delivery_count: deliver.delivery_count,
            routing_key: deliver.routing_key,
            headers: deliver.headers,
            body: deliver.body,
            settle,
        }
    }

    /// Acknowledges the delivery: the broker removes the message. Does not wait: acks queued
    /// in the same turn of the connection task travel in one `Ack` frame, and the broker
    /// answers only unknown ids (with a non-fatal error that the client logs). A second call
    /// (or a call after [`Delivery::reject`]) does nothing.
    ///
    /// Fails only when the connection is gone; the broker then returns the message to ready.
    pub fn ack(&self) -> Result<(), ClientError> {
        self.settle_with(Control::Ack(self.delivery_id))
    }

    /// Rejects the delivery: back to ready with `requeue`, otherwise to the queue's dead-letter
    /// queue (or dropped when it has none). Batched and idempotent like [`Delivery::ack`].
    pub fn reject(&self, requeue: bool) -> Result<(), ClientError> {
        self.settle_with(Control::Reject {
            delivery_id: self.delivery_id,
            requeue,
        })
    }

    fn settle_with(&self, control: Control) -> Result<(), ClientError> {
        if self.settle.settled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.settle
            .control
            .send(control)
            .map_err(|_| ClientError::ConnectionLost {
                detail: "the connection ended before the delivery was settled; the broker \
                         returns it to ready"
                    .into(),
            })
    }
}

/// A consumer of one queue: a [`Stream`] of [`Delivery`] values. The stream ends when the
/// consumer is cancelled or cannot go on (see below); unacknowledged deliveries then return to
/// ready on the broker. Dropping a `Consumer` cancels it.
///
/// On a single node it is one subscription. In a cluster it holds one subscription on each
/// node that leads a partition of the queue, each with the consumer's `prefetch` (so at most
/// `prefetch` unacknowledged deliveries per such node), and follows leadership: when a node
/// ends its subscription because a partition moved (`ConsumerEnd` with 421), or its connection
/// is lost, or every [`LEADERS_RECHECK`], the consumer reads the queue's leaders again and
/// subscribes where one is missing. Deliveries of a lost leader that were not acknowledged
/// come again from the new leader with `redelivered` set; see the crate docs, "Clusters", for
/// acks of deliveries yielded before a move. The stream ends when no subscription could be
/// kept for `request_timeout` (or on a single node, when its connection ends), and
/// [`Consumer::end_error`] says why.
pub struct Consumer {
    client: Client,
    queue: String,
    prefetch: u32,
    prefetch_bytes: Option<u64>,
    /// One per node it consumes from.
    subscriptions: Vec<Subscription>,
    /// Where the next poll starts, so that no subscription starves the others.
    next: usize,
    /// A look at the queue's leaders (or a move to a named leader) in progress.
    moving: Option<Moving>,
    /// Another look is wanted once the one in progress is over.
    look_again: bool,
    /// In a cluster: when the leaders are read again.
    recheck: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Looks in a row that found no leader or failed: the backoff's step.
    misses: u32,
    /// Since when the consumer has no subscription.
    orphaned_since: Option<Instant>,
    end_error: Option<ClientError>,
    cancelled: bool,
}

/// How often a consumer in a cluster reads its queue's leaders again without being told of a
/// move: a node that is frozen (or cut off) keeps its subscription open while the others elect
/// new leaders for its partitions; within this long the consumer subscribes at them. One
/// `QueueInfo` per consumer every 2 s costs the cluster nothing measurable.
pub const LEADERS_RECHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// A look at the leaders (or a resubscription at a named leader): the new subscriptions, and
/// whether some partition's leader is still missing.
type Moving = Pin<Box<dyn Future<Output = Result<(Vec<Subscription>, bool), ClientError>> + Send>>;

/// One subscription on one node's connection.
struct Subscription {
    node: Client,
    /// The node's protocol address, when its handshake names it.
    addr: Option<String>,
    tag: String,
    deliveries: mpsc::Receiver<Delivery>,
    ended: ConsumerEnded,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: Vec<&str> = self
            .subscriptions
            .iter()
            .map(|subscription| subscription.node.node_id())
            .collect();
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("nodes", &nodes)
            .field("moving", &self.moving.is_some())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Starts a consumer on `queue` that holds at most `prefetch` unacknowledged deliveries
    /// (1 to [`PREFETCH_MAX`]) per node it consumes from. Resolves once the broker answered
    /// `SubscribeOk` (in a cluster, each node leading a partition of the queue).
    pub async fn subscribe(&self, queue: &str, prefetch: u32) -> Result<Consumer, ClientError> {
        self.subscribe_with_bytes(queue, prefetch, None).await
    }

    /// Like [`Client::subscribe`], and also at most `prefetch_bytes` unacknowledged payload
    /// bytes when given (like AMQP's prefetch-size; a larger message still comes, alone): the
    /// bound to use with large or uneven messages.
    pub async fn subscribe_with_bytes(
        &self,
        queue: &str,
        prefetch: u32,
        prefetch_bytes: Option<u64>,
    ) -> Result<Consumer, ClientError> {
        if prefetch_bytes == Some(0) {
            return Err(ClientError::InvalidArgument(
                "prefetch_bytes 0: expected at least 1, or none for no byte bound".into(),
            ));
        }
        if prefetch == 0 || prefetch > PREFETCH_MAX {
            return Err(ClientError::InvalidArgument(format!(
                "prefetch {prefetch} is outside 1..={PREFETCH_MAX}"
            )));
        }
        let operation = format!("subscribe {queue}");
        let timeout = self.options().request_timeout;
        let first = self
            .routed(&operation, timeout, |node| async move {
                node.subscribe_once(queue, prefetch, prefetch_bytes).await
            })
            .await?;
        let cluster = self.server_info().nodes.len() > 1;
        let mut consumer = Consumer {
            client: self.clone(),
            queue: queue.to_owned(),
            prefetch,
            prefetch_bytes,
            subscriptions: vec![first],
            next: 0,
            moving: None,
            look_again: false,
            recheck: cluster.then(|| Box::pin(tokio::time::sleep(LEADERS_RECHECK))),
            misses: 0,
            orphaned_since: None,
            end_error: None,
            cancelled: false,
        };
        if cluster {
            // The other nodes that lead a partition, before the first delivery is asked for.
            let have = consumer.addresses();
            let (more, _) = look(
                self.clone(),
                queue.to_owned(),
                prefetch,
                prefetch_bytes,
                have,
                None,
            )
            .await
            .unwrap_or_default();
            consumer.add(more);
        }
        Ok(consumer)
    }

    /// One `Subscribe` on this connection.
    async fn subscribe_once(
        &self,
        queue: &str,
        prefetch: u32,
        prefetch_bytes: Option<u64>,
    ) -> Result<Subscription, ClientError> {
        let tag = self.ids().consumer_tag();
        let capacity = usize::try_from(prefetch).unwrap_or(usize::MAX);
        let (deliveries_tx, deliveries) = mpsc::channel(capacity);
        let ended = ConsumerEnded::default();
        let kind = RequestKind::Subscribe {
            tag: tag.clone(),
            queue: queue.to_owned(),
            deliveries: deliveries_tx,
            ended: ended.clone(),
        };
        let frame_tag = tag.clone();
        let frame_queue = queue.to_owned();
        let reply = self
            .request(format!("subscribe {queue}"), kind, move |request_id| {
                Frame::Subscribe(Subscribe {
                    request_id,
                    queue: frame_queue,
                    prefetch,
                    consumer_tag: frame_tag,
                    prefetch_bytes: prefetch_bytes.unwrap_or(0),
                })
            })
            .await?;
        match reply {
            Frame::SubscribeOk(_) => Ok(Subscription {
                node: self.clone(),
                addr: self.own_address().map(str::to_owned),
                tag,
                deliveries,
                ended,
            }),
            other => {
                // Not a consumer the broker knows: nothing to cancel.
                Err(ClientError::UnexpectedReply {
                    operation: format!("subscribe {queue}"),
                    expected: "SubscribeOk",
                    got: other.frame_type().name(),
                })
            }
        }
    }
}

/// Subscribes on each node that leads a partition of `queue` and is not among `have` (their
/// protocol addresses), and first at `named` (a leader a `ConsumerEnd` named) when given:
/// the new subscriptions, and whether a partition's leader is still missing (no leader known,
/// or a node that refused with 421 or could not be reached).
async fn look(
    client: Client,
    queue: String,
    prefetch: u32,
    prefetch_bytes: Option<u64>,
    have: Vec<String>,
    named: Option<String>,
) -> Result<(Vec<Subscription>, bool), ClientError> {
    let mut targets: Vec<String> = named.into_iter().collect();
    let mut missing = false;
    if client.server_info().nodes.len() > 1 {
        let leaders = leaders_of(&client, &queue).await?;
        missing = leaders.iter().any(Option::is_none);
        targets.extend(leaders.into_iter().flatten());
    }
    let mut added: Vec<Subscription> = Vec::new();
    // A node's view can be stale (a replica that moved away): a refusal naming the leader is
    // followed too, each node tried once per look (so at most the cluster's nodes).
    let mut targets: std::collections::VecDeque<String> = targets.into();
    let mut tried: Vec<String> = Vec::new();
    while let Some(addr) = targets.pop_front() {
        let known = |a: &String| *a == addr;
        if have.iter().any(known)
            || tried.iter().any(known)
            || added.iter().any(|s| s.addr.as_ref() == Some(&addr))
        {
            continue;
        }
        tried.push(addr.clone());
        let subscribed = match client.node(Some(&addr)).await {
            Ok(node) => node.subscribe_once(&queue, prefetch, prefetch_bytes).await,
            Err(error) => Err(error),
        };
        match subscribed {
            Ok(subscription) => {
                tracing::debug!(queue = %queue, node = %addr, "consuming from another leader");
                added.push(subscription);
            }
            Err(error) if as_not_leader(&error).is_some() || error.code().is_none() => {
                tracing::debug!(queue = %queue, node = %addr, %error, "not subscribed there yet");
                if let Some(named) = as_not_leader(&error).and_then(ErrorBody::leader_addr) {
                    targets.push_back(named.to_owned());
                }
                missing = true;
            }
            Err(error) => {
                // A refusal that holds everywhere (the queue is gone, the user may not):
                // what the subscriptions made so far do is up to their own ends.
                if added.is_empty() {
                    return Err(error);
                }
                missing = true;
            }
        }
    }
    Ok((added, missing))
}

/// Each partition's leader of `queue` (its protocol address; `None`: not known) as the nodes
/// see it: a live node first, then the others of the handshake's list until every partition
/// has one (a node that lost its replica, or is cut off, knows none).
async fn leaders_of(client: &Client, queue: &str) -> Result<Vec<Option<String>>, ClientError> {
    let mut leaders: Option<Vec<Option<String>>> = None;
    let mut last = None;
    let others: Vec<Option<String>> = client
        .server_info()
        .nodes
        .iter()
        .map(|node| Some(node.server.clone()))
        .collect();
    for addr in std::iter::once(None).chain(others) {
        if leaders
            .as_ref()
            .is_some_and(|known| known.iter().all(Option::is_some))
        {
            break;
        }
        let node = match &addr {
            None => client.live_node().await,
            Some(addr) => client.node(Some(addr)).await,
        };
        let seen = match node {
            Ok(node) => node.info_at(queue).await,
            Err(error) => Err(error),
        };
        let (info, answered) = match seen {
            Ok(seen) => seen,
            Err(error) => {
                last = Some(error);
                continue;
            }
        };
        let seen: Vec<Option<String>> = info
            .partitions
            .iter()
            .map(|partition| {
                if partition.leading {
                    answered.own_address().map(str::to_owned)
                } else {
                    partition.leader_addr.clone()
                }
            })
            .collect();
        leaders = Some(match leaders {
            Some(known) if known.len() == seen.len() => known
                .into_iter()
                .zip(seen)
                .map(|(have, new)| have.or(new))
                .collect(),
            _ => seen,
        });
    }
    match (leaders, last) {
        (Some(leaders), _) => Ok(leaders),
        (None, Some(error)) => Err(error),
        (None, None) => Err(ClientError::ConnectionLost {
            detail: format!("no node of the cluster answered for queue {queue}"),
        }),
    }
}

/// Subscribes again after the node ended the consumer with the 421 `body`, on a single node:
/// at the leader it names (or the known nodes), following further 421s within
/// `request_timeout` and [`crate::NOT_LEADER_RETRIES_MAX`].
async fn resubscribe(
    client: Client,
    queue: String,
    prefetch: u32,
    prefetch_bytes: Option<u64>,
    mut body: ErrorBody,
) -> Result<(Vec<Subscription>, bool), ClientError> {
    let operation = format!("subscribe {queue} again after its partition moved");
    let started = Instant::now();
    let deadline = started + client.options().request_timeout;
    let mut retry = 0;
    loop {
        retry += 1;
        let node = client
            .follow_not_leader(&operation, &body, retry, started, deadline)
            .await?;
        match node.subscribe_once(&queue, prefetch, prefetch_bytes).await {
            Ok(subscription) => return Ok((vec![subscription], false)),
            Err(error) => match as_not_leader(&error) {
                Some(refusal) => body = refusal.clone(),
                None => return Err(error),
            },
        }
    }
}

impl Consumer {
    /// The consumer tag of its first subscription (unique on the connection it consumes on).
    pub fn tag(&self) -> &str {
        self.subscriptions
            .first()
            .map_or("", |subscription| subscription.tag.as_str())
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The node the consumer's first subscription consumes from (its handshake name).
    pub fn node_id(&self) -> &str {
        self.subscriptions
            .first()
            .map_or(self.client.node_id(), |subscription| {
                subscription.node.node_id()
            })
    }

    /// The names of the nodes the consumer consumes from now, one per subscription.
    pub fn node_ids(&self) -> Vec<&str> {
        self.subscriptions
            .iter()
            .map(|subscription| subscription.node.node_id())
            .collect()
    }

    /// Why the stream ended, when it ended because the consumer could not go on (for example
    /// [`ClientError::NotLeader`] after the retry bound, or the broker's refusal); `None`
    /// otherwise.
    pub fn end_error(&self) -> Option<&ClientError> {
        self.end_error.as_ref()
    }

    /// The next delivery, or `None` once the consumer is cancelled or cannot go on.
    /// The same as `StreamExt::next`, without needing the trait.
    pub async fn recv(&mut self) -> Option<Delivery> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Stops the consumer and waits for the brokers' answers. Deliveries not yet acknowledged,
    /// including any still buffered in this handle, return to ready.
    pub async fn cancel(mut self) -> Result<(), ClientError> {
        self.cancelled = true;
        let mut result = Ok(());
        for subscription in std::mem::take(&mut self.subscriptions) {
            if let Err(error) = subscription.cancel().await {
                if result.is_ok() {
                    result = Err(error);
                }
            }
        }
        result
    }

    /// The protocol addresses of the nodes it has a subscription on.
    fn addresses(&self) -> Vec<String> {
        self.subscriptions
            .iter()
            .filter_map(|subscription| subscription.addr.clone())
            .collect()
    }

    /// Keeps the new subscriptions, except one on a node it consumes from already (its own
    /// cancel is sent).
    fn add(&mut self, subscriptions: Vec<Subscription>) {
        for subscription in subscriptions {
            let duplicate = subscription.addr.is_some()
                && self
                    .subscriptions
                    .iter()
                    .any(|have| have.addr == subscription.addr);
            if duplicate {
                let _ = subscription
                    .node
                    .control()
                    .send(Control::CancelConsumer(subscription.tag.clone()));
            } else {
                self.subscriptions.push(subscription);
            }
        }
    }

    fn is_cluster(&self) -> bool {
        self.recheck.is_some()
    }

    /// Starts a look at the leaders (first at `named`, a leader a 421 named), or asks for
    /// another once the one in progress is over.
    fn start_look(&mut self, named: Option<&ErrorBody>) {
        if self.moving.is_some() {
            self.look_again = true;
            return;
        }
        let client = self.client.clone();
        let (queue, prefetch, prefetch_bytes) =
            (self.queue.clone(), self.prefetch, self.prefetch_bytes);
        if !self.is_cluster() {
            if let Some(body) = named {
                self.moving = Some(Box::pin(resubscribe(
                    client,
                    queue,
                    prefetch,
                    prefetch_bytes,
                    body.clone(),
                )));
            }
            return;
        }
        let have = self.addresses();
        let named = named.and_then(|body| body.leader_addr().map(str::to_owned));
        self.moving = Some(Box::pin(look(
            client,
            queue,
            prefetch,
            prefetch_bytes,
            have,
            named,
        )));
    }

    /// A subscription's stream ran dry: why, and what to do about it.
    fn subscription_ended(&mut self, subscription: Subscription) {
        let reason = lock(&subscription.ended).take();
        match reason {
            Some(reason) if as_not_leader(&ClientError::Server(reason.clone())).is_some() => {
                tracing::debug!(queue = %self.queue, error = %reason, "a partition moved; following it");
                self.start_look(Some(&reason));
            }
            Some(reason) => {
                tracing::warn!(queue = %self.queue, error = %reason, "the broker ended the consumer");
                self.end_error = Some(ClientError::Server(reason));
                for other in std::mem::take(&mut self.subscriptions) {
                    let _ = other
                        .node
                        .control()
                        .send(Control::CancelConsumer(other.tag.clone()));
                }
            }
            None if self.is_cluster() => {
                tracing::debug!(queue = %self.queue, node = ?subscription.addr, "lost a node; looking for its partitions' leaders");
                self.start_look(None);
            }
            None => {}
        }
    }

    /// The look in progress finished with `result`.
    fn look_done(&mut self, result: Result<(Vec<Subscription>, bool), ClientError>) {
        self.moving = None;
        let missing = match result {
            Ok((subscriptions, missing)) => {
                self.add(subscriptions);
                // A node answered and the queue is there: a partition without a leader (a
                // move, an election) is waited for as long as it takes, not ended as orphaned.
                self.orphaned_since = None;
                missing
            }
            Err(error) => {
                tracing::debug!(queue = %self.queue, %error, "could not read the queue's leaders");
                if !self.is_cluster() || self.subscriptions.is_empty() {
                    self.end_error = Some(error);
                }
                true
            }
        };
        if missing {
            self.misses = self.misses.saturating_add(1);
            let delay = not_leader_backoff(self.misses, None);
            if let Some(recheck) = self.recheck.as_mut() {
                recheck.as_mut().reset(Instant::now() + delay);
            }
        } else {
            self.misses = 0;
        }
        if std::mem::take(&mut self.look_again) {
            self.start_look(None);
        }
    }

    /// Whether the consumer is over: no subscription, nothing in progress, and either on a
    /// single node, or in a cluster where no node answered a look at the leaders for
    /// `request_timeout` (while the nodes answer, a partition without a leader is waited for).
    fn is_over(&mut self) -> bool {
        if !self.subscriptions.is_empty() {
            self.orphaned_since = None;
            return false;
        }
        if self.end_error.is_some() && self.moving.is_none() && !self.is_cluster() {
            return true;
        }
        if !self.is_cluster() {
            return self.moving.is_none();
        }
        let since = *self.orphaned_since.get_or_insert_with(Instant::now);
        if since.elapsed() < self.client.options().request_timeout {
            // A look at the leaders is in progress, or due when the recheck fires.
            return false;
        }
        if self.end_error.is_none() {
            self.end_error = Some(ClientError::ConnectionLost {
                detail: format!(
                    "no node serving queue {} could be subscribed at for {} ms",
                    self.queue,
                    crate::connection::duration_ms(self.client.options().request_timeout)
                ),
            });
        }
        true
    }
}

impl Subscription {
    async fn cancel(self) -> Result<(), ClientError> {
        let tag = self.tag.clone();
        let kind = RequestKind::Cancel { tag: tag.clone() };
        let reply = self
            .node
            .request(format!("cancel consumer {tag}"), kind, move |request_id| {
                Frame::Cancel(Cancel {
                    request_id,
                    consumer_tag: tag,
                })
            })
            .await?;
        match reply {
            Frame::Ok(_) => Ok(()),
            other => Err(ClientError::UnexpectedReply {
                operation: format!("cancel consumer {}", self.tag),
                expected: "Ok",
                got: other.frame_type().name(),
            }),
        }
    }
}

impl Stream for Consumer {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        // Each turn returns, or removes an ended subscription, or finishes a look, or restarts
        // the recheck timer: bounded by the subscriptions and the looks' own bounds.
        loop {
            if let Some(moving) = self.moving.as_mut() {
                if let Poll::Ready(result) = moving.as_mut().poll(cx) {
                    self.look_done(result);
                    continue;
                }
            }
            let count = self.subscriptions.len();
            let mut ended = None;
            for k in 0..count {
                let index = (self.next + k) % count;
                match self.subscriptions[index].deliveries.poll_recv(cx) {
                    Poll::Ready(Some(delivery)) => {
                        self.next = index + 1;
                        return Poll::Ready(Some(delivery));
                    }
                    Poll::Ready(None) => {
                        ended = Some(index);
                        break;
                    }
                    Poll::Pending => {}
                }
            }
            if let Some(index) = ended {
                let subscription = self.subscriptions.remove(index);
                self.subscription_ended(subscription);
                continue;
            }
            if let Some(recheck) = self.recheck.as_mut() {
                if recheck.as_mut().poll(cx).is_ready() {
                    recheck.as_mut().reset(Instant::now() + LEADERS_RECHECK);
                    self.start_look(None);
                    continue;
                }
            }
            if self.is_over() {
                if let Some(error) = &self.end_error {
                    tracing::warn!(queue = %self.queue, %error, "the consumer ends");
                }
                return Poll::Ready(None);
            }
            return Poll::Pending;
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if !self.cancelled {
            for subscription in &self.subscriptions {
                // Fails only when the connection is gone, and then the broker cancelled it.
                let _ = subscription
                    .node
                    .control()
                    .send(Control::CancelConsumer(subscription.tag.clone()));
            }
        }
    }
}
