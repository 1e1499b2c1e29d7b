//! One protocol connection: the handshake, then a reader loop that dispatches frames and a
//! writer task that owns the socket's sending half.
//!
//! Bounds: at most `publish_frames_inflight_max` publish frames await their outcome (then the
//! reader stops reading: TCP flow control), at most `outbound_frames_max` frames wait to be
//! sent (then deliveries and confirms wait, and a consumer's prefetch stops the broker), so a
//! client that never reads holds the server's memory at a fixed size.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use keratin_broker::{Broker, BrokerError, DeliveryTag, Settler};
use keratin_proto::codes::{ERR_BAD_REQUEST, ERR_CONFLICT, ERR_NOT_FOUND};
use keratin_proto::frame::{
    Ack, Cancel, Close, Confirm, Declare, Deliver, ErrorFrame, Frame, Header, OkReply,
    PartitionInfo, Publish, PublishError, PublishIdRange, PublishMode, QueueInfoReply,
    QueueListReply, QueueSummary, Reject, SubscribeOk,
};
use keratin_proto::{ClientHello, ErrorBody, FrameCodec, ServerHello};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::codec::{Framed, FramedParts};

use super::errors::error_body;
use super::TcpOptions;
use crate::convert;

type Outbound = mpsc::Sender<Frame>;

/// A consumer of this connection.
struct ConsumerEntry {
    settler: Settler,
    forwarder: JoinHandle<()>,
}

/// What the reader loop keeps.
struct Conn {
    broker: Broker,
    options: Arc<TcpOptions>,
    out: Outbound,
    publish_permits: Arc<Semaphore>,
    /// The node-wide budget of unanswered publish bytes, in KiB permits.
    publish_bytes: Arc<Semaphore>,
    consumers: HashMap<String, ConsumerEntry>,
    deliveries: Arc<Mutex<HashMap<u64, (String, DeliveryTag)>>>,
    next_delivery: Arc<AtomicU64>,
}

pub(super) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    broker: Broker,
    options: Arc<TcpOptions>,
    publish_bytes: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let (stream, leftover) = match handshake(stream, &options).await {
        Some(pair) => pair,
        None => return,
    };
    tracing::debug!(%peer, "connection open");
    let mut parts = FramedParts::new::<Frame>(
        stream,
        FrameCodec::with_frame_size_bytes_max(options.frame_size_bytes_max),
    );
    parts.read_buf = leftover;
    let (sink, mut frames) = Framed::from_parts(parts).split();
    let (out, out_rx) = mpsc::channel(options.outbound_frames_max);
    let writer = tokio::spawn(write_frames(sink, out_rx, options.heartbeat_interval));
    let mut conn = Conn {
        broker,
        publish_permits: Arc::new(Semaphore::new(options.publish_frames_inflight_max)),
        publish_bytes,
        options: options.clone(),
        out,
        consumers: HashMap::new(),
        deliveries: Arc::new(Mutex::new(HashMap::new())),
        next_delivery: Arc::new(AtomicU64::new(1)),
    };
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(options.idle_timeout, frames.next()) => next,
            _ = stop.changed() => {
                conn.send(Frame::Close(Close { message: "server shutting down".into() })).await;
                break;
            }
        };
        let frame = match next {
            Err(_) => {
                conn.fatal(ErrorBody::new(
                    ERR_BAD_REQUEST,
                    "no frame or heartbeat for too long; closing",
                ))
                .await;
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(error))) => {
                tracing::debug!(%peer, %error, "bad frame; closing");
                conn.fatal(error.to_error_body()).await;
                break;
            }
            Ok(Some(Ok(frame))) => frame,
        };
        if !conn.dispatch(frame).await {
            break;
        }
    }
    conn.finish().await;
    drop(conn);
    let _ = tokio::time::timeout(options.drain_timeout, writer).await;
    tracing::debug!(%peer, "connection closed");
}

/// Read the client's hello and answer it; the bytes read past the hello are returned.
async fn handshake(mut stream: TcpStream, options: &TcpOptions) -> Option<(TcpStream, BytesMut)> {
    let mut buf = BytesMut::with_capacity(256);
    let hello = tokio::time::timeout(options.handshake_timeout, async {
        loop {
            match ClientHello::decode(&mut buf) {
                Ok(Some(hello)) => return Some(hello),
                Ok(None) => {}
                // Bad magic or a malformed hello: not our protocol, close without answering.
                Err(_) => return None,
            }
            if buf.len() > keratin_proto::handshake::CLIENT_HELLO_SIZE_MAX {
                return None;
            }
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()??;
    let answer = ServerHello::answer(&hello, options.node_id.clone());
    let accepted = matches!(answer, ServerHello::Accepted { .. });
    let mut out = BytesMut::new();
    answer.encode(&mut out).ok()?;
    stream.write_all(&out).await.ok()?;
    accepted.then_some((stream, buf))
}

/// The writer task: sends queued frames, flushing when the queue runs dry, and a heartbeat when
/// nothing was sent for a while.
async fn write_frames<S>(
    mut sink: S,
    mut frames: mpsc::Receiver<Frame>,
    heartbeat: std::time::Duration,
) where
    S: futures_util::Sink<Frame> + Unpin,
{
    loop {
        let frame = match tokio::time::timeout(heartbeat, frames.recv()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) => Frame::Heartbeat,
        };
        let closing = matches!(frame, Frame::Close(_)) || is_fatal(&frame);
        if sink.feed(frame).await.is_err() {
            return;
        }
        while let Ok(frame) = frames.try_recv() {
            if sink.feed(frame).await.is_err() {
                return;
            }
        }
        if sink.flush().await.is_err() || closing {
            break;
        }
    }
    let _ = sink.close().await;
}

fn is_fatal(frame: &Frame) -> bool {
    matches!(frame, Frame::Error(ErrorFrame { fatal: true, .. }))
}

impl Conn {
    async fn send(&self, frame: Frame) {
        // The writer is gone only when the socket failed; the reader notices next.
        let _ = self.out.send(frame).await;
    }

    async fn fatal(&self, error: ErrorBody) {
        self.send(Frame::Error(ErrorFrame {
            request_id: None,
            fatal: true,
            error,
        }))
        .await;
    }

    async fn reply(&self, request_id: u64, result: Result<Frame, ErrorBody>) {
        let frame = result.unwrap_or_else(|error| {
            Frame::Error(ErrorFrame {
                request_id: Some(request_id),
                fatal: false,
                error,
            })
        });
        self.send(frame).await;
    }

    /// Wait until every publish received so far has been answered. The protocol promises that
    /// the reply to a request comes after the answers to every publish sent before it on the
    /// same connection: clients use a request as a barrier for buffered publishes.
    async fn publishes_answered(&self) {
        let all = self.options.publish_frames_inflight_max as u32;
        if let Ok(permits) = self.publish_permits.acquire_many(all).await {
            drop(permits);
        }
    }

    /// Handle one frame; false when the connection must end.
    async fn dispatch(&mut self, frame: Frame) -> bool {
        let is_request = !matches!(
            frame,
            Frame::Publish(_) | Frame::Ack(_) | Frame::Reject(_) | Frame::Heartbeat
        );
        if is_request {
            self.publishes_answered().await;
        }
        match frame {
            Frame::Declare(d) => self.declare(d).await,
            Frame::Delete(q) => {
                let result = self.broker.delete(&q.queue).await;
                self.reply(q.request_id, ok(q.request_id, result)).await;
            }
            Frame::Purge(q) => {
                let result = self.broker.purge(&q.queue).await;
                self.reply(q.request_id, ok(q.request_id, result)).await;
            }
            Frame::QueueInfo(q) => {
                let result = self.queue_info(q.request_id, &q.queue);
                self.reply(q.request_id, result).await;
            }
            Frame::QueueList(l) => {
                let queues = self.queue_list();
                self.send(Frame::QueueListReply(QueueListReply {
                    request_id: l.request_id,
                    queues,
                }))
                .await;
            }
            Frame::SetQueueSettings(s) => {
                let result = match self.broker.info(&s.queue) {
                    Ok(info) => {
                        let settings = convert::apply_update(&info.settings, s.update);
                        self.broker
                            .set_queue_settings(&s.queue, settings)
                            .await
                            .map(|_| ())
                    }
                    Err(e) => Err(e),
                };
                self.reply(s.request_id, ok(s.request_id, result)).await;
            }
            Frame::Publish(p) => self.publish(p).await,
            Frame::Subscribe(s) => self.subscribe(s).await,
            Frame::Cancel(c) => self.cancel(c).await,
            Frame::Ack(Ack { delivery_ids }) => self.settle(delivery_ids, None).await,
            Frame::Reject(Reject {
                delivery_ids,
                requeue,
            }) => self.settle(delivery_ids, Some(requeue)).await,
            Frame::Heartbeat => {}
            Frame::Close(_) => return false,
            other => {
                let message = format!(
                    "{} is a server-to-client frame; a client must not send it",
                    other.frame_type().name()
                );
                self.send(Frame::Error(ErrorFrame {
                    request_id: None,
                    fatal: false,
                    error: ErrorBody::new(ERR_BAD_REQUEST, message),
                }))
                .await;
            }
        }
        true
    }

    async fn declare(&self, d: Declare) {
        let settings = convert::settings_from_wire(&d.settings);
        let result = self
            .broker
            .declare(&d.queue, settings)
            .await
            .map(|_| {
                Frame::Ok(OkReply {
                    request_id: d.request_id,
                })
            })
            .map_err(|e| error_body(&e));
        self.reply(d.request_id, result).await;
    }

    fn queue_info(&self, request_id: u64, name: &str) -> Result<Frame, ErrorBody> {
        let info = self.broker.info(name).map_err(|e| error_body(&e))?;
        Ok(Frame::QueueInfoReply(QueueInfoReply {
            request_id,
            queue: info.name.clone(),
            settings: convert::settings_to_wire(&info.settings),
            partitions: info
                .partitions
                .iter()
                .map(|p| PartitionInfo {
                    ready: p.ready,
                    inflight: p.inflight,
                    bytes: p.bytes,
                    disk_bytes: p.disk_bytes,
                })
                .collect(),
        }))
    }

    fn queue_list(&self) -> Vec<QueueSummary> {
        self.broker
            .list()
            .iter()
            .map(|q| QueueSummary {
                queue: q.name.clone(),
                partitions: q.partitions.len() as u32,
                ready: q.ready(),
                inflight: q.inflight(),
                bytes: q.bytes(),
            })
            .collect()
    }

    /// Hand the batch to the broker now (so that publishes keep their order per partition) and
    /// answer it from a task once the outcomes are known. A joinable frame for a queue with
    /// limits is handed over message by message: each is admitted on its own.
    async fn publish(&self, p: Publish) {
        if p.joinable && p.messages.len() > 1 && !self.broker.publishes_may_join(&p.queue) {
            for message in p.messages {
                self.publish_batch(Publish {
                    queue: p.queue.clone(),
                    mode: p.mode,
                    messages: vec![message],
                    joinable: false,
                })
                .await;
            }
            return;
        }
        self.publish_batch(p).await;
    }

    /// Hand one all-or-nothing batch to the broker and answer it from a task.
    async fn publish_batch(&self, p: Publish) {
        let Ok(permit) = self.publish_permits.clone().acquire_owned().await else {
            return;
        };
        let bytes: usize = p.messages.iter().map(|m| m.body.len()).sum();
        let budget = self.options.publish_bytes_inflight_max / super::PUBLISH_PERMIT_BYTES;
        let kib = (bytes / super::PUBLISH_PERMIT_BYTES).clamp(1, budget.max(1)) as u32;
        let Ok(bytes_permit) = self.publish_bytes.clone().acquire_many_owned(kib).await else {
            return;
        };
        let ids: Vec<u64> = p.messages.iter().map(|m| m.publish_id).collect();
        let messages = p
            .messages
            .into_iter()
            .map(convert::message_from_wire)
            .collect();
        let pending = if p.joinable {
            self.broker.publish_dispatch_joined(&p.queue, messages)
        } else {
            self.broker.publish_dispatch(&p.queue, messages)
        };
        let out = self.out.clone();
        let mode = p.mode;
        tokio::spawn(async move {
            let results = pending.wait().await;
            for frame in publish_answers(&ids, results, mode) {
                if out.send(frame).await.is_err() {
                    break;
                }
            }
            drop(permit);
            drop(bytes_permit);
        });
    }

    async fn subscribe(&mut self, s: keratin_proto::frame::Subscribe) {
        if self.consumers.contains_key(&s.consumer_tag) {
            let error = ErrorBody::new(
                ERR_CONFLICT,
                format!(
                    "consumer tag {:?} is in use on this connection",
                    s.consumer_tag
                ),
            );
            self.reply(s.request_id, Err(error)).await;
            return;
        }
        // The broker checks the prefetch against its own bound (it does not know the protocol);
        // it must be the protocol's, or a prefetch a client was allowed would get a 400.
        const _: () = assert!(keratin_broker::MAX_PREFETCH == keratin_proto::PREFETCH_MAX);
        let mut consumer = match self.broker.subscribe(&s.queue, s.prefetch) {
            Ok(consumer) => consumer,
            Err(e) => {
                self.reply(s.request_id, Err(error_body(&e))).await;
                return;
            }
        };
        self.send(Frame::SubscribeOk(SubscribeOk {
            request_id: s.request_id,
            consumer_tag: s.consumer_tag.clone(),
        }))
        .await;
        let settler = consumer.settler();
        let out = self.out.clone();
        let deliveries = self.deliveries.clone();
        let next = self.next_delivery.clone();
        let tag = s.consumer_tag.clone();
        let forwarder = tokio::spawn(async move {
            while let Some(delivery) = consumer.recv().await {
                let delivery_id = next.fetch_add(1, Ordering::Relaxed);
                lock(&deliveries).insert(delivery_id, (tag.clone(), delivery.tag));
                let frame = Frame::Deliver(Deliver {
                    consumer_tag: tag.clone(),
                    delivery_id,
                    partition: delivery.tag.partition,
                    offset: delivery.tag.message,
                    redelivered: delivery.redelivered,
                    delivery_count: delivery.delivery_count,
                    headers: delivery
                        .message
                        .headers
                        .into_iter()
                        .map(|(name, value)| Header { name, value })
                        .collect(),
                    body: delivery.message.body.into(),
                });
                if out.send(frame).await.is_err() {
                    break;
                }
            }
        });
        self.consumers
            .insert(s.consumer_tag, ConsumerEntry { settler, forwarder });
    }

    async fn cancel(&mut self, c: Cancel) {
        let Some(entry) = self.consumers.remove(&c.consumer_tag) else {
            let error = ErrorBody::new(
                ERR_NOT_FOUND,
                format!("no consumer {:?} on this connection", c.consumer_tag),
            );
            self.reply(c.request_id, Err(error)).await;
            return;
        };
        // Ending the forwarder drops the broker consumer: its unsettled deliveries return to
        // ready, ahead of newer messages.
        entry.forwarder.abort();
        lock(&self.deliveries).retain(|_, (tag, _)| *tag != c.consumer_tag);
        self.send(Frame::Ok(OkReply {
            request_id: c.request_id,
        }))
        .await;
    }

    async fn settle(&self, delivery_ids: Vec<u64>, reject: Option<bool>) {
        let mut by_consumer: HashMap<String, Vec<DeliveryTag>> = HashMap::new();
        let mut unknown = Vec::new();
        {
            let mut deliveries = lock(&self.deliveries);
            for id in delivery_ids {
                match deliveries.remove(&id) {
                    Some((tag, delivery)) => by_consumer.entry(tag).or_default().push(delivery),
                    None => unknown.push(id),
                }
            }
        }
        for (tag, tags) in by_consumer {
            if let Some(entry) = self.consumers.get(&tag) {
                match reject {
                    None => entry.settler.ack(&tags),
                    Some(requeue) => entry.settler.reject(&tags, requeue),
                }
            }
        }
        if !unknown.is_empty() {
            let message = format!(
                "unknown delivery ids {unknown:?}: already settled, or never delivered on this connection"
            );
            self.send(Frame::Error(ErrorFrame {
                request_id: None,
                fatal: false,
                error: ErrorBody::new(ERR_NOT_FOUND, message),
            }))
            .await;
        }
    }

    /// End every consumer (their deliveries return to ready) and wait for outstanding publish
    /// answers to be queued.
    async fn finish(&mut self) {
        for (_, entry) in self.consumers.drain() {
            entry.forwarder.abort();
        }
        let all = self.options.publish_frames_inflight_max as u32;
        let _ = tokio::time::timeout(
            self.options.drain_timeout,
            self.publish_permits.acquire_many(all),
        )
        .await;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn ok<T>(request_id: u64, result: Result<T, BrokerError>) -> Result<Frame, ErrorBody> {
    result
        .map(|_| Frame::Ok(OkReply { request_id }))
        .map_err(|e| error_body(&e))
}

/// `Confirm` for the durable messages (confirmed mode only) and one `PublishError` per distinct
/// error, with publish ids merged into ranges.
fn publish_answers(
    ids: &[u64],
    results: Vec<Result<keratin_broker::Receipt, BrokerError>>,
    mode: PublishMode,
) -> Vec<Frame> {
    let mut confirmed = Vec::new();
    let mut failed: Vec<(String, ErrorBody, Vec<u64>)> = Vec::new();
    for (id, result) in ids.iter().zip(results) {
        match result {
            Ok(_) => confirmed.push(*id),
            Err(e) => {
                let key = e.to_string();
                match failed.iter_mut().find(|(k, _, _)| *k == key) {
                    Some((_, _, list)) => list.push(*id),
                    None => failed.push((key, error_body(&e), vec![*id])),
                }
            }
        }
    }
    let mut frames = Vec::new();
    if mode == PublishMode::Confirmed && !confirmed.is_empty() {
        frames.push(Frame::Confirm(Confirm {
            ranges: ranges(&confirmed),
        }));
    }
    for (_, error, list) in failed {
        frames.push(Frame::PublishError(PublishError {
            ranges: ranges(&list),
            error,
        }));
    }
    frames
}

/// Merge ids into inclusive ranges of consecutive ids, in the order given.
fn ranges(ids: &[u64]) -> Vec<PublishIdRange> {
    let mut out: Vec<PublishIdRange> = Vec::new();
    for &id in ids {
        match out.last_mut() {
            Some(r) if r.last.checked_add(1) == Some(id) => r.last = id,
            _ => out.push(PublishIdRange::single(id)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_consecutive_ids() {
        let r = ranges(&[1, 2, 3, 7, 8, 10]);
        assert_eq!(
            r.iter().map(|r| (r.first, r.last)).collect::<Vec<_>>(),
            vec![(1, 3), (7, 8), (10, 10)]
        );
    }
}
