//! Consumers: [`Consumer`], a `Stream` of [`Delivery`] values for one subscription, and the
//! ack/reject of each delivery.
//!
//! Owns the handle's side of a subscription: the bounded delivery channel's receiving end,
//! cancelling (explicitly or on drop) and settling deliveries. Routing `Deliver` frames to the
//! right channel and coalescing acks into frames belongs to `connection.rs`.

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
use crate::routing::as_not_leader;

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

/// A subscription: a [`Stream`] of [`Delivery`] values. The stream ends when the consumer is
/// cancelled or the connection ends (unacknowledged deliveries then return to ready on the
/// broker). Dropping a `Consumer` cancels it.
///
/// In a cluster, when the node ends the consumer because a partition of its queue moved
/// (`ConsumerEnd` with 421), the consumer subscribes again at the named leader with the same
/// prefetch and the stream goes on; see the crate docs, "Clusters", for the deliveries yielded
/// before the move. If following the move fails, the stream ends and
/// [`Consumer::end_error`] says why.
pub struct Consumer {
    client: Client,
    queue: String,
    prefetch: u32,
    prefetch_bytes: Option<u64>,
    subscription: Subscription,
    moving: Option<Moving>,
    end_error: Option<ClientError>,
    cancelled: bool,
}

/// A resubscription in progress after the node ended the consumer.
type Moving = Pin<Box<dyn Future<Output = Result<Subscription, ClientError>> + Send>>;

/// One subscription on one node's connection.
struct Subscription {
    node: Client,
    tag: String,
    deliveries: mpsc::Receiver<Delivery>,
    ended: ConsumerEnded,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("tag", &self.subscription.tag)
            .field("node_id", &self.subscription.node.node_id())
            .field("moving", &self.moving.is_some())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Starts a consumer on `queue` that holds at most `prefetch` unacknowledged deliveries
    /// (1 to [`PREFETCH_MAX`]). Resolves once the broker answered `SubscribeOk`.
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
        let subscription = self
            .routed(&operation, timeout, |node| async move {
                node.subscribe_once(queue, prefetch, prefetch_bytes).await
            })
            .await?;
        Ok(Consumer {
            client: self.clone(),
            queue: queue.to_owned(),
            prefetch,
            prefetch_bytes,
            subscription,
            moving: None,
            end_error: None,
            cancelled: false,
        })
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

/// Subscribes again after the node ended the consumer with the 421 `body`: at the leader it
/// names (or the known nodes), following further 421s within `request_timeout` and
/// [`crate::NOT_LEADER_RETRIES_MAX`].
async fn resubscribe(
    client: Client,
    queue: String,
    prefetch: u32,
    prefetch_bytes: Option<u64>,
    mut body: ErrorBody,
) -> Result<Subscription, ClientError> {
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
            Ok(subscription) => return Ok(subscription),
            Err(error) => match as_not_leader(&error) {
                Some(refusal) => body = refusal.clone(),
                None => return Err(error),
            },
        }
    }
}

impl Consumer {
    /// The consumer tag (unique on the connection it currently consumes on).
    pub fn tag(&self) -> &str {
        &self.subscription.tag
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The node the consumer currently consumes from (its handshake name).
    pub fn node_id(&self) -> &str {
        self.subscription.node.node_id()
    }

    /// Why the stream ended, when it ended because following a moved partition failed (for
    /// example [`ClientError::NotLeader`] after the retry bound); `None` otherwise.
    pub fn end_error(&self) -> Option<&ClientError> {
        self.end_error.as_ref()
    }

    /// The next delivery, or `None` once the consumer is cancelled or the connection ended.
    /// The same as `StreamExt::next`, without needing the trait.
    pub async fn recv(&mut self) -> Option<Delivery> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Stops the consumer and waits for the broker's answer. Deliveries not yet acknowledged,
    /// including any still buffered in this handle, return to ready.
    pub async fn cancel(mut self) -> Result<(), ClientError> {
        self.cancelled = true;
        let tag = self.subscription.tag.clone();
        let kind = RequestKind::Cancel { tag: tag.clone() };
        let reply = self
            .subscription
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
                operation: format!("cancel consumer {}", self.subscription.tag),
                expected: "Ok",
                got: other.frame_type().name(),
            }),
        }
    }

    /// After the stream of the current subscription ran dry: the resubscription to start
    /// when the node ended it with 421, or `None` when the consumer is over.
    fn start_move(&mut self) -> Option<Moving> {
        let reason = lock(&self.subscription.ended).take()?;
        if as_not_leader(&ClientError::Server(reason.clone())).is_none() {
            tracing::warn!(queue = %self.queue, error = %reason, "the broker ended the consumer");
            self.end_error = Some(ClientError::Server(reason));
            return None;
        }
        tracing::debug!(queue = %self.queue, error = %reason, "consumer moves to the leader");
        Some(Box::pin(resubscribe(
            self.client.clone(),
            self.queue.clone(),
            self.prefetch,
            self.prefetch_bytes,
            reason,
        )))
    }
}

impl Stream for Consumer {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        // Each turn either returns or replaces the subscription after a move; a move that
        // fails ends the stream, so the loop is bounded by the resubscription's own bounds.
        loop {
            if let Some(moving) = self.moving.as_mut() {
                match moving.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(subscription)) => {
                        self.moving = None;
                        self.subscription = subscription;
                    }
                    Poll::Ready(Err(error)) => {
                        self.moving = None;
                        tracing::warn!(queue = %self.queue, %error, "the consumer could not follow its partition");
                        self.end_error = Some(error);
                        return Poll::Ready(None);
                    }
                }
            }
            match self.subscription.deliveries.poll_recv(cx) {
                Poll::Ready(None) => match self.start_move() {
                    Some(moving) => self.moving = Some(moving),
                    None => return Poll::Ready(None),
                },
                other => return other,
            }
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if !self.cancelled {
            // Fails only when the connection is gone, and then the broker cancelled it already.
            let _ = self
                .subscription
                .node
                .control()
                .send(Control::CancelConsumer(self.subscription.tag.clone()));
        }
    }
}
