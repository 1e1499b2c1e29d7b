//! Dead-lettering, the owner's side: a message rejected without requeue, past
//! `max_deliveries`, or removed by `drop_oldest` is held (in `limbo`, and in
//! `DeliveryState::dead_letters`) until the dead-letter queue confirmed its copy, and only then
//! settled as dead-lettered: at least once, whichever node leads the dead-letter queue. One
//! attempt at a time per partition, the oldest held messages first; a failed attempt's
//! messages are held again, ahead of the others, and tried again after a pause that doubles
//! per failure in a row (bounds and pauses: `partition/dead_letter.rs`). Every copy carries
//! the mark of this partition's dead-letter producer with the original's offset as its
//! sequence, so that a retry after an unknown outcome is stored once.
//!
//! A queue without a dead-letter queue drops what it would dead-letter (settled as dropped),
//! and so do held messages once the queue's `dead_letter` is unset. The payload of a held
//! message that cannot be read makes it ready again.

use super::*;
use crate::partition::dead_letter::{dead_letter_mark, Dying};

/// What a dead-lettering attempt returns to the owner.
pub(crate) struct AttemptDone {
    id: u64,
    /// Each message of the attempt, in order, with what became of its copy.
    outcomes: Vec<(Dying, AttemptOutcome)>,
}

enum AttemptOutcome {
    /// The dead-letter queue stored the copy.
    Stored,
    /// The copy is not stored, or its outcome is unknown: hold the original, retry.
    Failed(BrokerError),
    /// The original's payload could not be read: ready again.
    Unread,
}

/// What an attempt needs besides its messages.
struct Attempt {
    id: u64,
    target: String,
    queue: String,
    producer: u64,
    sink: Arc<dyn DeadLetterSink>,
    commands: mpsc::UnboundedSender<Command>,
    /// The payloads' bytes in the node's delivery budget, given back when the attempt ends.
    permit: crate::BytePermit,
}

impl Owner {
    /// Hold `entries` until their copies are confirmed; settle them as dropped when the queue
    /// has no dead-letter queue, and drop those `drop_oldest` removed while the node holds
    /// [`HELD_MAX`](crate::partition::dead_letter::HELD_MAX) dead letters already (counted as
    /// failures: the attention item says so).
    pub(super) fn dead_letter(&mut self, entries: Vec<Dying>) {
        if entries.is_empty() {
            return;
        }
        if self.ctx.settings.dead_letter.is_none() {
            self.drop_dying(entries);
            return;
        }
        let (kept, dropped): (Vec<Dying>, Vec<Dying>) = if self.ctx.dead_letters_held.full() {
            entries
                .into_iter()
                .partition(|d| d.reason != DeathReason::Overflow)
        } else {
            (entries, Vec::new())
        };
        if !dropped.is_empty() {
            tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, dropped = dropped.len(), "the node holds its most dead letters waiting for their dead-letter queues; messages drop_oldest removes are dropped, not dead-lettered");
            self.figures
                .count_dead_letter_drops(dropped.len() as u64, DeadLetterFailure::Unavailable);
            self.drop_dying(dropped);
        }
        self.delivery
            .dead_letters
            .hold(&self.ctx.dead_letters_held, kept);
        self.maybe_dead_letter();
    }

    /// Settle `dying` as dropped.
    fn drop_dying(&mut self, dying: Vec<Dying>) {
        let settled = dying
            .iter()
            .map(|d| Settled {
                message: d.message,
                size_bytes: d.entry.size_bytes,
                outcome: Outcome::Dropped,
            })
            .collect();
        self.write_settles(settled);
    }

    /// Start an attempt if one is due: this node leads, its log is not stopped, no attempt is
    /// out, the pause after a failure is over, the sink is open and the node's delivery budget
    /// has room for the payloads (else the owner is kicked when bytes come back).
    pub(super) fn maybe_dead_letter(&mut self) {
        if self.delivery.dead_letters.is_empty()
            || !self.driver.role().leading
            || self.driver.stopped().is_some()
            || self.log.is_none()
        {
            return;
        }
        let Some(target) = self.ctx.settings.dead_letter.clone() else {
            // Unset meanwhile: held messages go as rejects do without a dead-letter queue.
            let waiting = self.delivery.dead_letters.take_waiting();
            self.drop_dying(waiting);
            return;
        };
        let now = Instant::now();
        if !self.delivery.dead_letters.due(now) {
            return;
        }
        if !self.ctx.dead_letters.is_open() {
            self.delivery.dead_letters.retry(Vec::new(), now);
            return;
        }
        let Some(budget) = self.ctx.broker.upgrade().map(|b| b.delivery_budget()) else {
            return;
        };
        let Some(permit) =
            budget.take_or_wait(self.delivery.dead_letters.next_bytes(), &self.commands)
        else {
            return;
        };
        self.dead_letter_attempts += 1;
        let id = self.dead_letter_attempts;
        let dying = self.delivery.dead_letters.start(id);
        // The messages are in `limbo`: their payloads stay where they are (relocation, purge
        // and prefix removal leave them) until their SETTLE is applied, so the attempt reads
        // them on the blocking pool while the owner goes on.
        let wanted: Vec<(u64, u64)> = dying
            .iter()
            .map(|d| (d.message, self.state.payload_offset(d.message)))
            .collect();
        let runs = self.plan_runs(&wanted);
        let attempt = Attempt {
            id,
            target,
            queue: self.ctx.queue.clone(),
            producer: self.ctx.dead_letter_producer,
            sink: self.ctx.dead_letters.clone(),
            commands: self.commands.clone(),
            permit,
        };
        tokio::spawn(attempt.run(dying, runs));
    }

    /// An attempt ended: settle the originals whose copies are stored, hold the others again
    /// (or make them ready, if unread). An attempt from before the delivery state was reset
    /// (this node stopped leading) is ignored: its messages are no longer held here.
    pub(super) fn dead_letter_done(&mut self, done: AttemptDone) {
        if !self.delivery.dead_letters.finish(done.id) {
            return;
        }
        let mut stored = Vec::new();
        let mut failed = Vec::new();
        let mut errors = Vec::new();
        let mut unread = Vec::new();
        let mut refused = Vec::new();
        let alone = done.outcomes.len() == 1;
        for (dying, outcome) in done.outcomes {
            match outcome {
                AttemptOutcome::Stored => stored.push(Settled {
                    message: dying.message,
                    size_bytes: dying.entry.size_bytes,
                    outcome: Outcome::DeadLettered,
                }),
                // A message the dead-letter queue can never take as it is (larger than its
                // limits or a record), alone in its attempt: kept, it would be tried forever
                // ahead of every other one. Dropped, counted and logged.
                AttemptOutcome::Failed(
                    error @ (BrokerError::Invalid(_) | BrokerError::TooLarge(_)),
                ) if alone => {
                    tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, message = dying.message, %error, "the dead-letter queue can never take this message; it is dropped");
                    refused.push(dying);
                    errors.push(Err::<(), _>(error));
                }
                AttemptOutcome::Failed(error) => {
                    failed.push(dying);
                    errors.push(Err::<(), _>(error));
                }
                AttemptOutcome::Unread => unread.push(dying.message),
            }
        }
        self.not_dead_lettered(unread);
        self.write_settles(stored);
        self.figures.count_dead_letter_failures(&errors);
        self.drop_dying(refused);
        if failed.is_empty() {
            self.delivery.dead_letters.succeeded();
            return;
        }
        // The dead-letter queue's limits refused the batch (full, or the batch larger than
        // they allow): as many as fit go one by one. A batch the limits can never admit is
        // tried again at once, one message at a time.
        let never_fits = errors
            .iter()
            .any(|e| matches!(e, Err(BrokerError::Invalid(_) | BrokerError::TooLarge(_))));
        let full = errors
            .iter()
            .any(|e| matches!(e, Err(BrokerError::Limited { .. })));
        if never_fits || full {
            self.delivery.dead_letters.shrink();
        }
        let count = failed.len();
        let pause = if never_fits && !alone {
            self.delivery.dead_letters.retry(failed, Instant::now());
            self.delivery.dead_letters.retry_now();
            Duration::ZERO
        } else {
            self.delivery.dead_letters.retry(failed, Instant::now())
        };
        if let Some(Err(error)) = errors.first() {
            let target = self.ctx.settings.dead_letter.clone().unwrap_or_default();
            tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, dead_letter = %target, failed = count, held = self.delivery.dead_letters.len(), retry_in_ms = pause.as_millis() as u64, %error, "dead-lettering failed; the messages stay in the queue and are tried again");
        }
    }

    /// The delivery state is being reset (this node stopped or started leading): the held
    /// messages stay live, and those `drop_oldest` removed count toward the limits again (no
    /// SETTLE of theirs is coming from this leadership).
    pub(super) fn forget_dead_letters(&mut self) {
        let overflowed: Vec<u64> = self
            .delivery
            .dead_letters
            .iter()
            .filter(|d| d.reason == DeathReason::Overflow)
            .map(|d| d.message)
            .collect();
        for m in overflowed {
            self.undrop(m);
        }
    }

    /// Messages whose payload could not be read for dead-lettering are ready again.
    fn not_dead_lettered(&mut self, unread: Vec<u64>) {
        for m in unread {
            self.delivery.limbo.remove(&m);
            self.undrop(m);
            self.delivery.redeliver.insert(m);
        }
    }
}

impl Attempt {
    /// Read the payloads, add the `x-death-*` headers and the dead-letter mark, publish the
    /// copies through the sink, and answer the owner.
    async fn run(self, dying: Vec<Dying>, runs: Option<Vec<disk::Run>>) {
        let read = match runs {
            Some(runs) => {
                tokio::task::spawn_blocking(move || disk::read_runs(runs, usize::MAX)).await
            }
            None => Ok(disk::RunsRead {
                reader: None,
                payloads: Vec::new(),
                error: Some(BrokerError::Closed("log".into())),
            }),
        };
        let mut payloads = match read {
            Ok(read) => {
                if let Some(error) = &read.error {
                    tracing::error!(queue = %self.queue, %error, "cannot read messages to dead-letter them");
                }
                read.payloads.into_iter()
            }
            Err(error) => {
                tracing::error!(queue = %self.queue, %error, "cannot read messages to dead-letter them");
                Vec::new().into_iter()
            }
        };
        let mut messages = Vec::with_capacity(dying.len());
        let mut sent = Vec::with_capacity(dying.len());
        let mut outcomes = Vec::with_capacity(dying.len());
        for d in dying {
            let message = payloads
                .next()
                .filter(|(id, _, _)| *id == d.message)
                .and_then(|(_, _, payload)| Message::decode(&payload, d.message).ok());
            match message {
                Some(message) => {
                    messages.push(self.copy_of(message, &d));
                    sent.push(d);
                }
                None => outcomes.push((d, AttemptOutcome::Unread)),
            }
        }
        if !messages.is_empty() {
            let count = messages.len();
            let mut results = self.sink.publish(&self.target, messages).await.into_iter();
            for d in sent {
                let outcome = match results.next() {
                    Some(Ok(())) => AttemptOutcome::Stored,
                    Some(Err(error)) => AttemptOutcome::Failed(error),
                    None => AttemptOutcome::Failed(BrokerError::Closed(format!(
                        "the dead-letter sink answered fewer than {count} messages"
                    ))),
                };
                outcomes.push((d, outcome));
            }
        }
        drop(self.permit);
        let _ = self.commands.send(Command::DeadLetterAttempt(AttemptDone {
            id: self.id,
            outcomes,
        }));
    }

    /// The dead-letter copy of `message`: its routing key, headers and body, the `x-death-*`
    /// headers, and this partition's dead-letter mark in place of any producer mark it had.
    fn copy_of(&self, mut message: Message, dying: &Dying) -> Message {
        message
            .headers
            .push(("x-death-reason".into(), dying.reason.as_str().into()));
        message
            .headers
            .push(("x-death-queue".into(), self.queue.clone()));
        message.headers.push((
            "x-death-count".into(),
            dying.entry.delivery_count.to_string(),
        ));
        message.producer = Some(dead_letter_mark(self.producer, dying.message));
        message
    }
}
