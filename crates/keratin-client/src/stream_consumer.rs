//! Reading a stream: [`Client::stream_subscribe`] with its [`StreamSubscribeOptions`], and the
//! [`StreamConsumer`], a `Stream` of [`StreamDelivery`] values.
//!
//! Owns the handle's side of a stream subscription: unpacking `StreamDeliver` frames into
//! messages, giving the broker more credit as the application takes them, remembering the
//! positions handed out for [`StreamConsumer::commit`], and cancelling. Routing frames to the
//! consumer by tag and writing the credit belong to `connection.rs`; the requests themselves to
//! `stream.rs`.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_core::Stream;
use keratin_proto::codes::{ERR_CONFLICT, ERR_NOT_FOUND};
use keratin_proto::{
    Cancel, CursorEntry, ErrorBody, Frame, Header, StreamStart, StreamSubscribe,
    STREAM_PARTITIONS_MAX,
};
use tokio::sync::mpsc;

use crate::client::{unexpected, Client};
use crate::connection::{lock, Control, RequestKind, StreamEndReason, StreamEnded, StreamEvent};
use crate::error::ClientError;
use crate::stream_ends::StreamEnds;

/// Default credit of a stream consumer, in messages: what the broker may send ahead of the
/// application, as `keratin consume`'s prefetch (about 1 MiB of 1 KiB messages held here).
pub const STREAM_CREDIT_DEFAULT: u32 = 1000;

/// Largest credit a consumer may ask for: the client holds up to that many messages (in as
/// many frames) for the application, so this bounds one consumer's memory as
/// [`crate::PREFETCH_MAX`] bounds a queue consumer's.
pub const STREAM_CREDIT_MAX: u32 = crate::PREFETCH_MAX;

/// How to read a stream: which one, from where, with which cursor, and how much ahead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSubscribeOptions {
    /// The stream to read.
    pub stream: String,
    /// The named cursor to resume from and commit to; `None` reads without one (nothing is
    /// written on the broker).
    pub cursor: Option<String>,
    /// Share the stream's partitions with the other readers of the same cursor (needs one).
    pub group: bool,
    /// Where to start in a partition the cursor has no position for.
    pub start: StreamStart,
    /// Messages the broker may send before the consumer gives more (1 to
    /// [`STREAM_CREDIT_MAX`]); the consumer gives more as the application takes them.
    pub credit: u32,
    /// The broker commits the delivered positions to the cursor every second and at the end
    /// (needs a cursor): at most a second of messages is read again after a failure.
    pub auto_commit: bool,
    /// The partitions to read; empty reads them all (in a group: those the group assigns).
    pub partitions: Vec<u32>,
}

impl StreamSubscribeOptions {
    /// Reads `stream` from its first message, without a cursor, with the default credit.
    pub fn new(stream: impl Into<String>) -> StreamSubscribeOptions {
        StreamSubscribeOptions {
            stream: stream.into(),
            cursor: None,
            group: false,
            start: StreamStart::First,
            credit: STREAM_CREDIT_DEFAULT,
            auto_commit: false,
            partitions: Vec::new(),
        }
    }

    /// The same options starting at `start`.
    pub fn start(mut self, start: StreamStart) -> StreamSubscribeOptions {
        self.start = start;
        self
    }

    /// The same options reading with the named cursor `cursor`.
    pub fn cursor(mut self, cursor: impl Into<String>) -> StreamSubscribeOptions {
        self.cursor = Some(cursor.into());
        self
    }

    /// The same options with `credit` messages ahead.
    pub fn credit(mut self, credit: u32) -> StreamSubscribeOptions {
        self.credit = credit;
        self
    }

    /// The same options reading only `partitions`.
    pub fn partitions(mut self, partitions: Vec<u32>) -> StreamSubscribeOptions {
        self.partitions = partitions;
        self
    }

    /// Refuses what the broker would refuse with 400, before anything is sent.
    fn check(&self) -> Result<(), ClientError> {
        let invalid = |what: String| Err(ClientError::InvalidArgument(what));
        if self.credit == 0 || self.credit > STREAM_CREDIT_MAX {
            return invalid(format!(
                "stream credit {} is outside 1..={STREAM_CREDIT_MAX}",
                self.credit
            ));
        }
        if self.cursor.is_none() && (self.group || self.auto_commit) {
            return invalid("a group or auto commit needs a cursor name".into());
        }
        if self.partitions.len() > STREAM_PARTITIONS_MAX {
            return invalid(format!(
                "a stream has at most {STREAM_PARTITIONS_MAX} partitions; {} given",
                self.partitions.len()
            ));
        }
        Ok(())
    }
}

/// One message read from a stream. Nothing is acknowledged: a reader's position is its
/// cursor's, set by [`StreamConsumer::commit`] (or the broker's auto commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDelivery {
    /// The partition it lives in.
    pub partition: u32,
    /// Its offset in that partition's log (offsets only grow; they may skip numbers).
    pub offset: u64,
    /// When the leader appended it, in ms since the Unix epoch.
    pub timestamp_ms: u64,
    /// The routing key it was published with.
    pub routing_key: Option<String>,
    /// Headers as published.
    pub headers: Vec<Header>,
    /// The payload.
    pub body: Bytes,
    /// Set on the first message of a partition's frame when the reader's position (this
    /// offset) lay below the partition's start, which retention had moved: the messages in
    /// between are gone, and the reader was moved to the start.
    pub moved_from: Option<u64>,
}

/// A stream subscription: a [`Stream`] of [`StreamDelivery`] values in offset order per
/// partition. It ends when cancelled, when the connection ends, when the broker sends more
/// than the credit, or when the stream is deleted ([`StreamConsumer::end_error`] says why).
/// Dropping it cancels it on the broker.
pub struct StreamConsumer {
    client: Client,
    tag: String,
    stream: String,
    cursor: Option<String>,
    credit: u32,
    events: mpsc::Receiver<StreamEvent>,
    ended: StreamEnded,
    /// Partition ends waiting beside `events` (`stream_ends.rs`).
    ends: StreamEnds,
    /// `StreamDeliver` frames taken out of `events` so far.
    frames_received: u64,
    /// Messages of frames received, not yet taken by the application.
    ready: VecDeque<StreamDelivery>,
    /// Messages taken since credit was last given back.
    taken: u32,
    /// Per partition, the offset after the last message handed out: what `commit` writes.
    positions: BTreeMap<u32, u64>,
    /// Partitions the broker stopped sending, with why (`StreamPartitionEnd`).
    partition_ends: Vec<(u32, ErrorBody)>,
    /// Per partition handed to another group member, its messages still in `ready` from
    /// before the handover: handed out, but no longer this consumer's position to commit.
    handed_over: BTreeMap<u32, usize>,
    end_error: Option<ClientError>,
    cancelled: bool,
}

impl std::fmt::Debug for StreamConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConsumer")
            .field("stream", &self.stream)
            .field("tag", &self.tag)
            .field("cursor", &self.cursor)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Starts reading a stream; resolves once the broker answered `SubscribeOk`. Needs
    /// protocol version 7 ([`ClientError::StreamsUnsupported`] otherwise, without sending).
    ///
    /// In a cluster the node leading the stream's cursor log serves its readers; another node
    /// answers 421 naming it, and the client subscribes there (as it follows a publish's
    /// 421): the consumer reads, commits and gives credit on that node's connection.
    pub async fn stream_subscribe(
        &self,
        options: StreamSubscribeOptions,
    ) -> Result<StreamConsumer, ClientError> {
        options.check()?;
        self.check_streams()?;
        let operation = format!("subscribe to stream {}", options.stream);
        let timeout = self.options().request_timeout;
        let options = &options;
        self.routed(&operation, timeout, |node| async move {
            node.check_streams()?;
            node.stream_subscribe_here(options.clone()).await
        })
        .await
    }

    /// Subscribes on this connection's node only.
    async fn stream_subscribe_here(
        &self,
        options: StreamSubscribeOptions,
    ) -> Result<StreamConsumer, ClientError> {
        let tag = self.ids().consumer_tag();
        // Each frame carries at least one message of the credit (the connection task counts
        // it), and at most one wake token for the partition ends is in: the broker can never
        // fill this while it keeps to the credit.
        let capacity = usize::try_from(options.credit).unwrap_or(usize::MAX) + 1;
        let (events_tx, events) = mpsc::channel(capacity);
        let ended = StreamEnded::default();
        let ends = StreamEnds::default();
        let kind = RequestKind::StreamSubscribe {
            tag: tag.clone(),
            events: events_tx,
            ended: ended.clone(),
            ends: ends.clone(),
            credit: options.credit,
        };
        let operation = format!("subscribe to stream {}", options.stream);
        let frame = StreamSubscribe {
            request_id: 0,
            stream: options.stream.clone(),
            consumer_tag: tag.clone(),
            cursor: options.cursor.clone(),
            group: options.group,
            start: options.start,
            credit: options.credit,
            auto_commit: options.auto_commit,
            partitions: options.partitions.clone(),
        };
        let reply = self
            .request(operation.clone(), kind, move |request_id| {
                Frame::StreamSubscribe(StreamSubscribe {
                    request_id,
                    ..frame
                })
            })
            .await?;
        match reply {
            Frame::SubscribeOk(_) => Ok(StreamConsumer {
                client: self.clone(),
                tag,
                stream: options.stream,
                cursor: options.cursor,
                credit: options.credit,
                events,
                ended,
                ends,
                frames_received: 0,
                ready: VecDeque::new(),
                taken: 0,
                positions: BTreeMap::new(),
                partition_ends: Vec::new(),
                handed_over: BTreeMap::new(),
                end_error: None,
                cancelled: false,
            }),
            other => Err(unexpected(operation, "SubscribeOk", &other)),
        }
    }
}

impl StreamConsumer {
    /// The consumer tag (unique on its connection).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The stream read.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The next message, or `None` once the consumer ended. The same as `StreamExt::next`.
    pub async fn recv(&mut self) -> Option<StreamDelivery> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Per partition, the offset of the next message to read: one past the last message
    /// handed out. What [`StreamConsumer::commit`] writes.
    pub fn positions(&self) -> Vec<CursorEntry> {
        self.positions
            .iter()
            .map(|(&partition, &offset)| CursorEntry { partition, offset })
            .collect()
    }

    /// The partitions the broker stopped sending to this consumer, with why: 409 reassigned
    /// to another member of a group (its position leaves [`Self::positions`]: the other
    /// member commits it now; messages of it received before are still handed out), 404 the
    /// stream deleted, 421 its leader moved (with `leader_addr`). Taken: a second call returns
    /// only later ends. A partition that ended more than once before the consumer took its
    /// ends in (a group handing it away and back while the application read nothing) is
    /// reported once, with its latest end.
    pub fn take_partition_ends(&mut self) -> Vec<(u32, ErrorBody)> {
        std::mem::take(&mut self.partition_ends)
    }

    /// Why the consumer ended, when the broker or the connection ended it; `None` while it
    /// runs or after a cancel.
    pub fn end_error(&self) -> Option<&ClientError> {
        self.end_error.as_ref()
    }

    /// Commits the positions handed out so far (per partition, the offset after the last
    /// message yielded) to the consumer's cursor, and waits until the broker wrote them
    /// durably. Nothing handed out yet: nothing to commit, `Ok` without a request. Fails with
    /// [`ClientError::InvalidArgument`] for a consumer without a cursor. Frames already
    /// received are taken in first, so a partition the group handed to another member in the
    /// meantime is not committed (the broker would refuse the commit with 409).
    pub async fn commit(&mut self) -> Result<(), ClientError> {
        while let Ok(event) = self.events.try_recv() {
            self.on_event(event);
        }
        let Some(cursor) = &self.cursor else {
            return Err(ClientError::InvalidArgument(format!(
                "stream consumer {} reads {} without a cursor: nothing to commit to \
                 (subscribe with a cursor name)",
                self.tag, self.stream
            )));
        };
        let entries = self.positions();
        if entries.is_empty() {
            return Ok(());
        }
        self.client
            .commit_cursor(&self.stream, cursor, &entries)
            .await
    }

    /// Stops the consumer and waits for the broker's answer. Messages received but not yet
    /// taken are dropped; a cursor keeps what was committed.
    pub async fn cancel(mut self) -> Result<(), ClientError> {
        self.cancelled = true;
        let tag = self.tag.clone();
        let operation = format!("cancel stream consumer {tag}");
        let kind = RequestKind::Cancel { tag: tag.clone() };
        let reply = self
            .client
            .request(operation.clone(), kind, move |request_id| {
                Frame::Cancel(Cancel {
                    request_id,
                    consumer_tag: tag,
                })
            })
            .await?;
        match reply {
            Frame::Ok(_) => Ok(()),
            other => Err(unexpected(operation, "Ok", &other)),
        }
    }

    /// Takes in one event from the connection task, then the partition ends due after it.
    fn on_event(&mut self, event: StreamEvent) {
        match event {
            StreamEvent::Deliver(deliver) => {
                self.frames_received += 1;
                let mut moved_from = deliver.moved_from;
                for message in deliver.messages {
                    self.ready.push_back(StreamDelivery {
                        partition: deliver.partition,
                        offset: message.offset,
                        timestamp_ms: message.timestamp_ms,
                        routing_key: message.routing_key,
                        headers: message.headers,
                        body: message.body,
                        moved_from: moved_from.take(),
                    });
                }
            }
            StreamEvent::EndsPending => lock(&self.ends).token_taken(),
        }
        self.take_in_ends();
    }

    /// Takes in the partition ends the broker sent after the frames received so far.
    fn take_in_ends(&mut self) {
        let due = lock(&self.ends).take_due(self.frames_received);
        for end in due {
            self.on_partition_end(end);
        }
    }

    fn on_partition_end(&mut self, end: keratin_proto::StreamPartitionEnd) {
        tracing::debug!(stream = %self.stream, partition = end.partition, error = %end.error,
                        "the broker stopped sending a partition");
        if end.error.code() == ERR_CONFLICT {
            // Handed to another member of the group, which reads on from the cursor's commit:
            // this consumer's position there is no longer one to commit (the broker refuses
            // it, and it would move the other member's cursor back).
            self.positions.remove(&end.partition);
            let left = self
                .ready
                .iter()
                .filter(|d| d.partition == end.partition)
                .count();
            if left > 0 {
                self.handed_over.insert(end.partition, left);
            }
        }
        if end.error.code() == ERR_NOT_FOUND && self.end_error.is_none() {
            // The stream is gone: every partition ends, nothing more will come.
            self.end_error = Some(ClientError::Server(end.error.clone()));
            self.events.close();
        }
        self.partition_ends.push((end.partition, end.error));
    }

    /// Hands `delivery` to the application: its position is remembered, and once half the
    /// credit was taken, that much is given back to the broker.
    fn hand_out(&mut self, delivery: StreamDelivery) -> StreamDelivery {
        match self.handed_over.get_mut(&delivery.partition) {
            Some(left) => {
                *left -= 1;
                if *left == 0 {
                    self.handed_over.remove(&delivery.partition);
                }
            }
            None => {
                self.positions
                    .insert(delivery.partition, delivery.offset.saturating_add(1));
            }
        }
        self.taken += 1;
        if self.taken >= self.credit.div_ceil(2) {
            let control = Control::StreamCredit {
                tag: self.tag.clone(),
                credit: self.taken,
            };
            // Fails only when the connection is gone; the stream then ends by itself.
            let _ = self.client.control().send(control);
            self.taken = 0;
        }
        delivery
    }
}

impl Stream for StreamConsumer {
    type Item = StreamDelivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<StreamDelivery>> {
        // Each turn hands out a message or takes in one event; at most one event without
        // messages (the ends' wake token) is in the channel, so the loop ends.
        loop {
            if let Some(delivery) = self.ready.pop_front() {
                return Poll::Ready(Some(self.hand_out(delivery)));
            }
            match self.events.poll_recv(cx) {
                Poll::Ready(Some(event)) => self.on_event(event),
                Poll::Ready(None) => {
                    // Ends the broker sent last wait beside the closed channel.
                    self.take_in_ends();
                    if self.end_error.is_none() {
                        let reason = lock(&self.ended).take();
                        self.end_error = reason.map(|reason| match reason {
                            StreamEndReason::ConnectionLost(detail) => {
                                ClientError::ConnectionLost { detail }
                            }
                            StreamEndReason::OverCredit => ClientError::UnexpectedReply {
                                operation: format!("read stream {}", self.stream),
                                expected: "at most the consumer's credit in messages",
                                got: "StreamDeliver",
                            },
                        });
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for StreamConsumer {
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
