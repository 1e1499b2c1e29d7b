//! Consumers: [`Consumer`], a `Stream` of [`Delivery`] values for one subscription, and the
//! ack/reject of each delivery.
//!
//! Owns the handle's side of a subscription: the bounded delivery channel's receiving end,
//! cancelling (explicitly or on drop) and settling deliveries. Routing `Deliver` frames to the
//! right channel and coalescing acks into frames belongs to `connection.rs`.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_core::Stream;
use keratin_proto::{Cancel, Frame, Header, Subscribe};
use tokio::sync::mpsc;

use crate::client::Client;
use crate::connection::{Control, RequestKind};
use crate::error::ClientError;

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
#[derive(Debug)]
pub struct Consumer {
    client: Client,
    queue: String,
    tag: String,
    deliveries: mpsc::Receiver<Delivery>,
    cancelled: bool,
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
        let tag = self.ids().consumer_tag();
        let capacity = usize::try_from(prefetch).unwrap_or(usize::MAX);
        let (deliveries_tx, deliveries) = mpsc::channel(capacity);
        let kind = RequestKind::Subscribe {
            tag: tag.clone(),
            queue: queue.to_owned(),
            deliveries: deliveries_tx,
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
        let mut consumer = Consumer {
            client: self.clone(),
            queue: queue.to_owned(),
            tag,
            deliveries,
            cancelled: false,
        };
        match reply {
            Frame::SubscribeOk(_) => Ok(consumer),
            other => {
                consumer.cancelled = true;
                Err(ClientError::UnexpectedReply {
                    operation: format!("subscribe {queue}"),
                    expected: "SubscribeOk",
                    got: other.frame_type().name(),
                })
            }
        }
    }
}

impl Consumer {
    /// The consumer tag (unique on the connection).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The next delivery, or `None` once the consumer is cancelled or the connection ended.
    /// The same as `StreamExt::next`, without needing the trait.
    pub async fn recv(&mut self) -> Option<Delivery> {
        self.deliveries.recv().await
    }

    /// Stops the consumer and waits for the broker's answer. Deliveries not yet acknowledged,
    /// including any still buffered in this handle, return to ready.
    pub async fn cancel(mut self) -> Result<(), ClientError> {
        self.cancelled = true;
        let tag = self.tag.clone();
        let kind = RequestKind::Cancel { tag: tag.clone() };
        let reply = self
            .client
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
        self.deliveries.poll_recv(cx)
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if !self.cancelled {
            // Fails only when the connection is gone, and then the broker cancelled it already.
            let _ = self
                .client
                .control()
                .send(Control::CancelConsumer(self.tag.clone()));
        }
    }
}
