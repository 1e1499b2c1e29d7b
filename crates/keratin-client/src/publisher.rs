//! Publishing: confirmed publishes with retry on `ERR_LIMITED` hints ([`Client::publish`],
//! [`Client::publish_batch`]) and the [`BufferedPublisher`] with its [`DroppedPublishes`] path.
//!
//! Owns the retry policy (which codes are retried, the delay, the deadline) and the buffered
//! publisher's bound and settling rule. The connection task (`connection.rs`) only matches
//! answers to publish ids.
//!
//! # When a buffered message is settled
//! `docs/protocol.md` gives buffered messages no completion signal: the broker sends no
//! `Confirm`, only a `PublishError` for a message that fails. A buffered message therefore
//! holds its slot in the bounded buffer (and the client keeps a copy of it for the dropped
//! path) until one of:
//! - a `PublishError` names it: it is reported on [`DroppedPublishes`];
//! - the reply to a *barrier* arrives: after writing buffered messages the connection task
//!   sends one `QueueList` (at most one in flight) and, when its reply comes back, counts every
//!   buffered message written before it as accepted;
//! - the connection ends: it is reported with [`ClientError::OutcomeUnknown`] if it was
//!   written, [`ClientError::ConnectionLost`] if not.
//!
//! Each message is settled exactly once; one the connection task lets go without settling it
//! (a bug) is still reported, as `OutcomeUnknown`, when its entry is dropped.
//!
//! The barrier rests on the one ordering the protocol guarantees (`docs/protocol.md`,
//! "Connection lifecycle"): the reply to a request comes after the answers (`Confirm`,
//! `PublishError`) to every `Publish` the server received before it on the same connection.
//! Should a `PublishError` still arrive after its barrier (a server breaking that rule), it is
//! counted in `dropped_count` and logged, but the message is no longer held, so it cannot be
//! handed back.

#![expect(
    clippy::result_large_err,
    reason = "a failed publish hands its message back (about 170 bytes); it follows a network \
              round trip, so moving it costs nothing measurable, and boxing would cost an \
              allocation on every failure the CLI counts"
)]

use std::hash::{BuildHasher, Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The least time an attempt is given for its answer, even when it was sent just before the
/// publish timeout ran out (a retry on a hint can be): a second is far more than a broker needs
/// to answer, and far less than the publish timeouts callers choose.
pub(crate) const ATTEMPT_ANSWER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

use bytes::Bytes;
use futures_core::Stream;
use keratin_proto::codes::{ERR_LIMITED, ERR_NOT_LEADER};
use keratin_proto::{ErrorBody, Header, Message, PublishMode, FRAME_SIZE_BYTES_MAX};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::client::Client;
use crate::connection::{duration_ms, Command, PublishOutcome, Waiter};
use crate::error::{ClientError, PublishFailed};
use crate::options::BufferedOptions;
use crate::publish_router::{Pending, Submission};

/// The smallest delay before retrying after `ERR_LIMITED`, whatever the hint says: a hint of 0
/// would otherwise turn a full disk into a busy loop of publishes.
pub const RETRY_DELAY_MS_MIN: u64 = 10;
/// Frame overhead of a `Publish` besides its queue name and messages: header 5, queue length
/// 2, mode 1, message count 4.
const PUBLISH_FRAME_OVERHEAD_BYTES: usize = 5 + 2 + 1 + 4 + 9;
/// Overhead of one message besides its routing key, headers and body: publish id 8, routing
/// key tag 1 and length 2, header count 2, body length 4, sequence tag 1 and value 8.
const MESSAGE_OVERHEAD_BYTES: usize = 8 + 1 + 2 + 2 + 4 + 9;
/// Largest buffered capacity: permits are counted in `u32` by `Semaphore::acquire_many`.
const BUFFERED_CAPACITY_MAX: usize = u32::MAX as usize;

/// A message to publish.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutgoingMessage {
    /// Chooses the partition; messages without one are spread over partitions.
    pub routing_key: Option<String>,
    /// Application headers.
    pub headers: Vec<Header>,
    /// The payload.
    pub body: Bytes,
    /// Its number in the producer's sequence (idempotent producers, [`ClientOptions`]'s
    /// `idempotent`); `None`: the client numbers it when it is first published, and keeps the
    /// number on every retry.
    pub sequence: Option<u64>,
}

impl OutgoingMessage {
    /// A message with `body`, no routing key and no headers.
    pub fn new(body: impl Into<Bytes>) -> OutgoingMessage {
        OutgoingMessage {
            routing_key: None,
            headers: Vec::new(),
            body: body.into(),
            sequence: None,
        }
    }

    /// Sets the message's sequence number for its idempotent producer (see
    /// [`ClientOptions`]'s `producer_id`).
    pub fn with_sequence(mut self, sequence: u64) -> OutgoingMessage {
        self.sequence = Some(sequence);
        self
    }

    /// Sets the routing key.
    pub fn with_routing_key(mut self, routing_key: impl Into<String>) -> OutgoingMessage {
        self.routing_key = Some(routing_key.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push(Header {
            name: name.into(),
            value: value.into(),
        });
        self
    }

    fn to_wire(&self, publish_id: u64) -> Message {
        Message {
            publish_id,
            routing_key: self.routing_key.clone(),
            headers: self.headers.clone(),
            body: self.body.clone(),
            sequence: self.sequence,
        }
    }

    /// An upper bound of the message's encoded size, to split batches below the frame limit.
    fn size_bytes(&self) -> usize {
        let key = self.routing_key.as_ref().map_or(0, String::len);
        let headers: usize = self
            .headers
            .iter()
            .map(|header| 4 + header.name.len() + header.value.len())
            .sum();
        MESSAGE_OVERHEAD_BYTES + key + headers + self.body.len()
    }
}

/// A confirmed publish: the broker synced the message to disk before it said so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confirmed {
    /// The publish id of the attempt the broker confirmed.
    pub publish_id: u64,
    /// Attempts it took: 1, plus one per `ERR_LIMITED` retry and per `ERR_NOT_LEADER`
    /// redirect.
    pub attempts: u32,
}

/// How one attempt of the direct path ended: answered (the message's index and result),
/// refused with `ERR_LIMITED` (to retry after the hint here), or refused with 421, to hand
/// over to the publish router (`publish_router.rs`).
enum AttemptAnswer {
    Done(usize, Result<Confirmed, PublishFailed>),
    Limited(Attempt, ErrorBody),
    Routed(Attempt, ErrorBody),
}

struct Attempt {
    index: usize,
    message: OutgoingMessage,
    attempts: u32,
}

impl Attempt {
    fn first(index: usize, message: OutgoingMessage) -> Attempt {
        Attempt {
            index,
            message,
            attempts: 1,
        }
    }
}

impl Client {
    /// Publishes one message and resolves when the broker confirmed it: the message is durable
    /// (synced to disk). Retries by itself after `ERR_LIMITED` (429): the same message under a
    /// new publish id, after the broker's `retry_after_ms` (at least [`RETRY_DELAY_MS_MIN`],
    /// plus 0–20% jitter, so never earlier than asked), for as long as `publish_timeout`
    /// allows. Then it fails with [`ClientError::Limited`] `{ timed_out: true, .. }`, naming
    /// the limit and reason.
    ///
    /// In a cluster the message goes to its partition's leader, in order with the other
    /// messages of its partition, following 421s, and an idempotent producer's message whose
    /// outcome is unknown is sent again (see the crate docs, "Clusters").
    ///
    /// Nothing else is retried. A 503 and other refusals are [`ClientError::Server`] (503: not
    /// applied, safe to publish again later). A 504, a connection lost after sending, or no
    /// answer within `publish_timeout`, are [`ClientError::OutcomeUnknown`] (unless sent again
    /// as above): the message may or may not be durable, and publishing it again can store it
    /// twice.
    pub async fn publish(
        &self,
        queue: &str,
        message: OutgoingMessage,
    ) -> Result<Confirmed, PublishFailed> {
        let message = self.numbered(message)?;
        if self.routes_publishes() {
            let mut results = self.publish_routed(queue, vec![message], true).await;
            return match results.pop() {
                Some(result) => result,
                None => unreachable!("one result per message"),
            };
        }
        // The first attempt without the batch path's vectors (results, attempts, waiters,
        // frame lists: five allocations per message, a measurable share of a 1 KiB publish);
        // a message refused with ERR_LIMITED continues on the batch path, which retries it.
        let timeout = self.options().publish_timeout;
        let deadline = Instant::now() + timeout;
        let answer_deadline = deadline.max(Instant::now() + ATTEMPT_ANSWER_GRACE);
        let publish_id = self.ids().publish_id();
        let (waiter, answer) = oneshot::channel();
        let wire = message.to_wire(publish_id);
        self.publish_frame(
            queue,
            PublishMode::Confirmed,
            vec![wire],
            vec![Waiter::Confirmed(waiter)],
            true,
        )
        .await;
        let attempt = Attempt::first(0, message);
        let mut results = vec![None];
        let pending = match self
            .attempt_answer(answer_deadline, answer, attempt, publish_id)
            .await
        {
            AttemptAnswer::Done(_, result) => return result,
            AttemptAnswer::Limited(attempt, body) => {
                self.publish_retry_wait(vec![(attempt, body)], deadline, &mut results)
                    .await
            }
            AttemptAnswer::Routed(attempt, body) => {
                self.publish_hand_over(queue, vec![(attempt, body)], deadline, true, &mut results)
                    .await;
                Vec::new()
            }
        };
        let mut results = self
            .publish_attempts(queue, pending, results, deadline, true)
            .await;
        match results.pop() {
            Some(result) => result,
            None => unreachable!("publish_attempts answers every message"),
        }
    }

    /// Publishes `messages` in one `Publish` frame (several if they exceed the 16 MiB frame
    /// limit) and answers each one as [`Client::publish`] does, in order. Messages refused with
    /// `ERR_LIMITED` are retried together, after the longest hint among them. In a cluster the
    /// batch is split by partition, each partition's share sent to its leader in one frame.
    pub async fn publish_batch(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
    ) -> Vec<Result<Confirmed, PublishFailed>> {
        self.publish_messages(queue, messages, false).await
    }

    /// `publish_batch`, or with `joinable` single publishes that may share a frame.
    async fn publish_messages(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
        joinable: bool,
    ) -> Vec<Result<Confirmed, PublishFailed>> {
        let mut numbered = Vec::with_capacity(messages.len());
        let mut refused = false;
        for message in messages {
            match self.numbered(message) {
                Ok(message) => numbered.push(message),
                Err(failed) => {
                    refused = true;
                    numbered.push(failed.message);
                }
            }
        }
        if refused {
            // Nothing of the batch is sent: one frame, one outcome for all.
            return numbered
                .into_iter()
                .map(|message| {
                    Err(PublishFailed {
                        message,
                        error: crate::client::own_sequence_missing(),
                    })
                })
                .collect();
        }
        let messages = numbered;
        if self.routes_publishes() {
            return self.publish_routed(queue, messages, joinable).await;
        }
        let deadline = Instant::now() + self.options().publish_timeout;
        let results = messages.iter().map(|_| None).collect();
        let pending = messages
            .into_iter()
            .enumerate()
            .map(|(index, message)| Attempt::first(index, message))
            .collect();
        self.publish_attempts(queue, pending, results, deadline, joinable)
            .await
    }

    /// `messages` through the router of `queue` (`publish_router.rs`), each answered in order.
    async fn publish_routed(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
        joinable: bool,
    ) -> Vec<Result<Confirmed, PublishFailed>> {
        let deadline = Instant::now() + self.options().publish_timeout;
        let (items, answers): (Vec<Pending>, Vec<_>) = messages
            .into_iter()
            .map(|message| Pending::new(message, deadline, 0, None, None))
            .unzip();
        self.submit(queue, Submission { items, joinable }).await;
        let mut results = Vec::with_capacity(answers.len());
        for answer in answers {
            results.push(answer.await.unwrap_or_else(|_| router_gone()));
        }
        results
    }

    /// Hands the attempts refused with 421 to the router of `queue`, and from now on routes
    /// every publish: a node that answers 421 is part of a cluster.
    async fn publish_hand_over(
        &self,
        queue: &str,
        routed: Vec<(Attempt, ErrorBody)>,
        deadline: Instant,
        joinable: bool,
        results: &mut [Option<Result<Confirmed, PublishFailed>>],
    ) {
        if routed.is_empty() {
            return;
        }
        self.route_publishes();
        let mut items = Vec::with_capacity(routed.len());
        let mut answers = Vec::with_capacity(routed.len());
        for (attempt, body) in routed {
            let (item, answer) = Pending::new(
                attempt.message,
                deadline,
                attempt.attempts,
                None,
                Some(body),
            );
            items.push(item);
            answers.push((attempt.index, answer));
        }
        self.submit(queue, Submission { items, joinable }).await;
        for (index, answer) in answers {
            results[index] = Some(answer.await.unwrap_or_else(|_| router_gone()));
        }
    }

    /// Sends `pending` and waits for their answers, retrying those refused with
    /// `ERR_LIMITED` until `deadline` and handing those refused with 421 to the router;
    /// `results[attempt.index]` gets each one's outcome.
    async fn publish_attempts(
        &self,
        queue: &str,
        mut pending: Vec<Attempt>,
        mut results: Vec<Option<Result<Confirmed, PublishFailed>>>,
        deadline: Instant,
        joinable: bool,
    ) -> Vec<Result<Confirmed, PublishFailed>> {
        let mut routed: Vec<(Attempt, ErrorBody)> = Vec::new();
        while !pending.is_empty() {
            // An attempt sent just before the deadline still gets its answer: the broker answers
            // a refused publish at once, and reporting it as an unknown outcome would be false.
            let answer_deadline = deadline.max(Instant::now() + ATTEMPT_ANSWER_GRACE);
            let messages = pending.iter().map(|attempt| &attempt.message);
            let waiting = self.publish_send_messages(queue, messages, joinable).await;
            let mut limited: Vec<(Attempt, ErrorBody)> = Vec::new();
            for (attempt, (publish_id, answer)) in pending.into_iter().zip(waiting) {
                match self
                    .attempt_answer(answer_deadline, answer, attempt, publish_id)
                    .await
                {
                    AttemptAnswer::Done(index, result) => results[index] = Some(result),
                    AttemptAnswer::Limited(attempt, body) => limited.push((attempt, body)),
                    AttemptAnswer::Routed(attempt, body) => routed.push((attempt, body)),
                }
            }
            pending = self
                .publish_retry_wait(limited, deadline, &mut results)
                .await;
        }
        self.publish_hand_over(queue, routed, deadline, joinable, &mut results)
            .await;
        results
            .into_iter()
            .map(|result| match result {
                Some(result) => result,
                None => unreachable!("every attempt ends answered or retried"),
            })
            .collect()
    }

    /// Waits for the answer to one attempt until `answer_deadline`.
    async fn attempt_answer(
        &self,
        answer_deadline: Instant,
        answer: oneshot::Receiver<PublishOutcome>,
        attempt: Attempt,
        publish_id: u64,
    ) -> AttemptAnswer {
        let outcome = match tokio::time::timeout_at(answer_deadline, answer).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => PublishOutcome::NotSent(self.lost_error()),
            Err(_) => PublishOutcome::Lost(format!(
                "no Confirm within publish_timeout ({} ms)",
                duration_ms(self.options().publish_timeout)
            )),
        };
        // On a single node an unknown outcome is the caller's to judge (no other node could be
        // asked); a 421 means a cluster after all, whose router takes the message.
        let result = match outcome {
            PublishOutcome::Confirmed => Ok(Confirmed {
                publish_id,
                attempts: attempt.attempts,
            }),
            PublishOutcome::Failed(body) if body.code() == ERR_LIMITED => {
                return AttemptAnswer::Limited(attempt, body);
            }
            PublishOutcome::Failed(body) if body.code() == ERR_NOT_LEADER => {
                return AttemptAnswer::Routed(attempt, body);
            }
            PublishOutcome::Failed(body) => Err(ClientError::from_body(body)),
            PublishOutcome::Lost(detail) => Err(ClientError::OutcomeUnknown {
                error: None,
                detail,
            }),
            PublishOutcome::NotSent(error) => Err(error),
        };
        let index = attempt.index;
        AttemptAnswer::Done(
            index,
            result.map_err(|error| PublishFailed {
                message: attempt.message,
                error,
            }),
        )
    }

    /// Waits out the longest hint among `limited` and returns them as the next attempts, or,
    /// when the deadline comes first, waits until it and fails them as timed out.
    async fn publish_retry_wait(
        &self,
        limited: Vec<(Attempt, ErrorBody)>,
        deadline: Instant,
        results: &mut [Option<Result<Confirmed, PublishFailed>>],
    ) -> Vec<Attempt> {
        let Some(hint_ms) = limited
            .iter()
            .filter_map(|(_, body)| body.retry_after_ms())
            .max()
        else {
            return Vec::new();
        };
        let delay = retry_delay(u64::from(hint_ms), jitter_seed(&limited));
        if Instant::now() + delay < deadline {
            tokio::time::sleep(delay).await;
            return limited
                .into_iter()
                .map(|(attempt, _)| Attempt {
                    attempts: attempt.attempts + 1,
                    ..attempt
                })
                .collect();
        }
        tokio::time::sleep_until(deadline).await;
        let timeout_ms = duration_ms(self.options().publish_timeout);
        for (attempt, body) in limited {
            let mut error = ClientError::from_body(body);
            if let ClientError::Limited {
                timed_out,
                timeout_ms: limit_timeout_ms,
                ..
            } = &mut error
            {
                *timed_out = true;
                *limit_timeout_ms = timeout_ms;
            }
            let index = attempt.index;
            results[index] = Some(Err(PublishFailed {
                message: attempt.message,
                error,
            }));
        }
        Vec::new()
    }

    /// Sends one attempt of each of `messages` on this connection under new publish ids, in
    /// as few frames as fit, and returns each one's publish id and answer, in order.
    pub(crate) async fn publish_send_messages<'a>(
        &self,
        queue: &str,
        messages: impl Iterator<Item = &'a OutgoingMessage>,
        joinable: bool,
    ) -> Vec<(u64, oneshot::Receiver<PublishOutcome>)> {
        let mut waiting = Vec::with_capacity(messages.size_hint().0);
        let mut frame_messages = Vec::new();
        let mut frame_waiters = Vec::new();
        let mut frame_size_bytes = PUBLISH_FRAME_OVERHEAD_BYTES + queue.len();
        let frame_limit = usize::try_from(FRAME_SIZE_BYTES_MAX).unwrap_or(usize::MAX);
        for message in messages {
            let size_bytes = message.size_bytes();
            if !frame_messages.is_empty() && frame_size_bytes + size_bytes > frame_limit {
                let messages = std::mem::take(&mut frame_messages);
                let waiters = std::mem::take(&mut frame_waiters);
                self.publish_frame(queue, PublishMode::Confirmed, messages, waiters, joinable)
                    .await;
                frame_size_bytes = PUBLISH_FRAME_OVERHEAD_BYTES + queue.len();
            }
            frame_size_bytes += size_bytes;
            let publish_id = self.ids().publish_id();
            let (waiter, answer) = oneshot::channel();
            frame_messages.push(message.to_wire(publish_id));
            frame_waiters.push(Waiter::Confirmed(waiter));
            waiting.push((publish_id, answer));
        }
        if !frame_messages.is_empty() {
            self.publish_frame(
                queue,
                PublishMode::Confirmed,
                frame_messages,
                frame_waiters,
                joinable,
            )
            .await;
        }
        waiting
    }

    /// Hands one frame to the connection task. If the task is gone the waiters are dropped
    /// with the command, and their receivers report the lost connection.
    async fn publish_frame(
        &self,
        queue: &str,
        mode: PublishMode,
        messages: Vec<Message>,
        waiters: Vec<Waiter>,
        joinable: bool,
    ) {
        let command = Command::Publish {
            queue: queue.to_owned(),
            mode,
            messages,
            waiters,
            joinable,
        };
        // Without waiting while there is room: see `Client::submit` on the order of publishes.
        let unsent = match self.commands().try_send(command) {
            Ok(()) => None,
            Err(mpsc::error::TrySendError::Full(command)) => self
                .commands()
                .send(command)
                .await
                .err()
                .map(|mpsc::error::SendError(command)| command),
            Err(mpsc::error::TrySendError::Closed(command)) => Some(command),
        };
        if let Some(command) = unsent {
            // Confirmed waiters see their sender dropped and report the lost connection;
            // buffered messages go to the dropped path.
            let Command::Publish { waiters, .. } = command else {
                return;
            };
            for waiter in waiters {
                if let Waiter::Buffered(entry) = waiter {
                    entry.drop_with(self.lost_error());
                }
            }
        }
    }

    /// A publisher of buffered (unconfirmed) messages to `queue`, and the receiving end of its
    /// dropped-publish path. See [`BufferedPublisher`].
    pub fn buffered_publisher(
        &self,
        queue: &str,
        options: BufferedOptions,
    ) -> (BufferedPublisher, DroppedPublishes) {
        let capacity = options.capacity.clamp(1, BUFFERED_CAPACITY_MAX);
        let (dropped_tx, dropped_rx) = mpsc::channel(capacity);
        let sink = Arc::new(DroppedSink {
            dropped: dropped_tx,
            dropped_count: AtomicU64::new(0),
            unreported_count: AtomicU64::new(0),
        });
        let publisher = BufferedPublisher {
            client: self.clone(),
            queue: queue.to_owned(),
            slots: Arc::new(Semaphore::new(capacity)),
            capacity,
            sink: Arc::clone(&sink),
        };
        let dropped = DroppedPublishes {
            receiver: dropped_rx,
            sink,
        };
        (publisher, dropped)
    }
}

/// The delay before retrying after a hint of `hint_ms`: at least [`RETRY_DELAY_MS_MIN`], then
/// spread over `[1.0, 1.2] × hint` (1.1 × hint ± 10%) so that many publishers refused at once
/// do not come back at once, and none comes back earlier than the broker asked.
pub(crate) fn retry_delay(hint_ms: u64, seed: u64) -> Duration {
    let base_ms = hint_ms.max(RETRY_DELAY_MS_MIN);
    // seed % 2001 is 0..=2000, i.e. 0.0% to 20.0% in steps of 0.01%.
    let jitter_ms = base_ms.saturating_mul(seed % 2001) / 10_000;
    Duration::from_millis(base_ms.saturating_add(jitter_ms))
}

/// The answer of a message whose router let it go unanswered: never happens (a pending message
/// answers as it is dropped), but a missing answer must not panic the caller.
fn router_gone() -> Result<Confirmed, PublishFailed> {
    Err(PublishFailed {
        message: OutgoingMessage::default(),
        error: ClientError::OutcomeUnknown {
            error: None,
            detail: "the client's publish router stopped without answering".into(),
        },
    })
}

fn jitter_seed(limited: &[(Attempt, ErrorBody)]) -> u64 {
    // RandomState is seeded per process from the OS; hashing the time adds variation per call.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    std::time::SystemTime::now().hash(&mut hasher);
    limited.len().hash(&mut hasher);
    hasher.finish()
}

/// A message that a [`BufferedPublisher`] could not publish, and why.
#[derive(Debug)]
pub struct DroppedPublish {
    /// The message, as handed to [`BufferedPublisher::send`].
    pub message: OutgoingMessage,
    /// Why it was dropped: [`ClientError::Limited`] (429, not retried), [`ClientError::Server`]
    /// (for example 503), [`ClientError::OutcomeUnknown`] (504, or the connection ended after
    /// it was written), [`ClientError::ConnectionLost`] (never written). Use
    /// [`ClientError::code`] and [`ClientError::reason`] to count them.
    pub error: ClientError,
}

/// Shared by a publisher, its [`DroppedPublishes`] and its messages in flight.
#[derive(Debug)]
pub(crate) struct DroppedSink {
    dropped: mpsc::Sender<DroppedPublish>,
    dropped_count: AtomicU64,
    unreported_count: AtomicU64,
}

/// A buffered message the connection task holds until it is settled: accepted
/// ([`BufferedEntry::accept`]) or dropped ([`BufferedEntry::drop_with`]), exactly once. An
/// entry let go without either is reported as dropped with an unknown outcome, so that no path
/// of the connection task can lose a message silently.
pub(crate) struct BufferedEntry {
    /// `None` once settled.
    message: Option<OutgoingMessage>,
    sink: Arc<DroppedSink>,
    /// Released (dropped) with the entry: that is what frees a slot in the buffer.
    _slot: OwnedSemaphorePermit,
}

impl BufferedEntry {
    /// Counts the message as accepted by the broker: nothing is reported.
    pub(crate) fn accept(mut self) {
        self.message = None;
    }

    /// Reports the message as dropped. Never waits: if nobody reads the dropped path and it is
    /// full, the message is only counted (and logged).
    pub(crate) fn drop_with(mut self, error: ClientError) {
        self.report(error);
    }

    fn report(&mut self, error: ClientError) {
        let Some(message) = self.message.take() else {
            return;
        };
        self.sink.dropped_count.fetch_add(1, Ordering::Relaxed);
        let report = DroppedPublish { message, error };
        if let Err(error) = self.sink.dropped.try_send(report) {
            self.sink.unreported_count.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %error.into_inner().error, "dropped publish not reported: the dropped path is full or closed");
        }
    }
}

impl Drop for BufferedEntry {
    fn drop(&mut self) {
        if self.message.is_some() {
            tracing::warn!("a buffered message was let go unsettled; reporting it as dropped");
            self.report(ClientError::OutcomeUnknown {
                error: None,
                detail: "the client lost track of this buffered message".into(),
            });
        }
    }
}

/// Publishes without waiting for confirms (`PublishMode::Buffered`). The broker sends no
/// `Confirm` for these; a message that fails (any code, including 429: buffered publishes are
/// **not** retried) is reported on [`DroppedPublishes`] and counted. See the module docs of
/// `publisher.rs`, "When a buffered message is settled", for what counts as done and what that
/// relies on.
///
/// At most `capacity` messages are unsettled at once; [`BufferedPublisher::send`] waits for a
/// slot (backpressure). Nothing here survives a crash of the client: unsettled messages live
/// only in its memory.
#[derive(Debug)]
pub struct BufferedPublisher {
    client: Client,
    queue: String,
    slots: Arc<Semaphore>,
    capacity: usize,
    sink: Arc<DroppedSink>,
}

impl BufferedPublisher {
    /// Sends one message, waiting while the buffer is full. Returns once the message is handed
    /// to the connection; failures come later on [`DroppedPublishes`]. Fails at once, handing the
    /// message back, when the connection is already gone.
    pub async fn send(&self, message: OutgoingMessage) -> Result<(), PublishFailed> {
        let slot = match Arc::clone(&self.slots).acquire_owned().await {
            Ok(slot) => slot,
            Err(_) => unreachable!("the buffer's semaphore is never closed"),
        };
        if !self.client.is_connected() {
            return Err(PublishFailed {
                message,
                error: self.client.lost_error(),
            });
        }
        let message = self.client.numbered(message)?;
        let publish_id = self.client.ids().publish_id();
        let wire = message.to_wire(publish_id);
        let entry = BufferedEntry {
            message: Some(message),
            sink: Arc::clone(&self.sink),
            _slot: slot,
        };
        // If the connection ends between the check above and here, the task's shutdown reports
        // the entry on the dropped path (or it is dropped with the command and counted below).
        self.client
            .publish_frame(
                &self.queue,
                PublishMode::Buffered,
                vec![wire],
                vec![Waiter::Buffered(entry)],
                true,
            )
            .await;
        Ok(())
    }

    /// Waits until every message sent so far is settled: reported as dropped, or written and
    /// followed by a barrier reply (see the module docs for what that relies on). Sends made
    /// while flushing wait for it. Fails when the connection has ended; the unsettled messages
    /// are then on the dropped path.
    pub async fn flush(&self) -> Result<(), ClientError> {
        let all = u32::try_from(self.capacity).unwrap_or(u32::MAX);
        match self.slots.acquire_many(all).await {
            Ok(slots) => drop(slots),
            Err(_) => unreachable!("the buffer's semaphore is never closed"),
        }
        if self.client.is_connected() {
            Ok(())
        } else {
            Err(self.client.lost_error())
        }
    }

    /// Messages dropped so far (reported or not).
    pub fn dropped_count(&self) -> u64 {
        self.sink.dropped_count.load(Ordering::Relaxed)
    }

    /// Messages sent and not yet settled.
    pub fn unsettled_count(&self) -> usize {
        self.capacity - self.slots.available_permits()
    }

    /// The queue published to.
    pub fn queue(&self) -> &str {
        &self.queue
    }
}

/// The dropped-publish path of a [`BufferedPublisher`]: a [`Stream`] (and [`Self::recv`]) of
/// [`DroppedPublish`]. Bounded by the publisher's capacity; if it is full because nobody reads
/// it, further drops are only counted ([`Self::unreported_count`]) and logged.
#[derive(Debug)]
pub struct DroppedPublishes {
    receiver: mpsc::Receiver<DroppedPublish>,
    sink: Arc<DroppedSink>,
}

impl DroppedPublishes {
    /// The next dropped message, or `None` once the publisher and every message it sent are gone.
    pub async fn recv(&mut self) -> Option<DroppedPublish> {
        self.receiver.recv().await
    }

    /// A dropped message if one is ready, without waiting.
    pub fn try_recv(&mut self) -> Option<DroppedPublish> {
        self.receiver.try_recv().ok()
    }

    /// Messages dropped so far, reported or not.
    pub fn dropped_count(&self) -> u64 {
        self.sink.dropped_count.load(Ordering::Relaxed)
    }

    /// Drops that could not be reported because this path was full.
    pub fn unreported_count(&self) -> u64 {
        self.sink.unreported_count.load(Ordering::Relaxed)
    }
}

impl Stream for DroppedPublishes {
    type Item = DroppedPublish;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<DroppedPublish>> {
        self.receiver.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delay_never_undercuts_the_hint_and_stays_within_20_percent() {
        for seed in [0, 1, 999, 2000, 2001, u64::MAX] {
            let delay = retry_delay(1000, seed);
            assert!(delay >= Duration::from_millis(1000), "{delay:?}");
            assert!(delay <= Duration::from_millis(1200), "{delay:?}");
        }
        assert_eq!(retry_delay(0, 0), Duration::from_millis(RETRY_DELAY_MS_MIN));
        assert_eq!(retry_delay(1000, 2000), Duration::from_millis(1200));
    }

    #[test]
    fn size_estimate_covers_the_encoding() {
        let message = OutgoingMessage::new(&b"hi"[..])
            .with_routing_key("k")
            .with_header("k", "v")
            .with_sequence(u64::MAX);
        let mut dst = bytes::BytesMut::new();
        let frame = keratin_proto::Frame::Publish(keratin_proto::Publish {
            queue: "q".into(),
            mode: PublishMode::Confirmed,
            messages: vec![message.to_wire(7)],
            joinable: true,
            producer_id: Some(u64::MAX),
        });
        frame.encode(&mut dst, FRAME_SIZE_BYTES_MAX).unwrap();
        assert!(dst.len() <= PUBLISH_FRAME_OVERHEAD_BYTES + 1 + message.size_bytes());
    }
}
