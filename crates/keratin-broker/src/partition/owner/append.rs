//! Writing records: each append gets a sequence number and a `PendingAppend` at once, and is
//! handed to the log in sequence order, one at a time, without blocking the owner: the log's
//! queue may have no room (`max_pending_bytes`), and waiting for room is a future the owner
//! polls beside its commands. The log reports each proposal's outcome as
//! [`LogEvent::Proposed`] (for a local log, from a small task awaiting its ticket); the owner
//! applies answers in sequence order. A publish not confirmed within the publish timeout
//! is answered [`BrokerError::TimedOut`]; one still waiting for room is withdrawn (never
//! written), so a stalled disk holds no more publishes in memory than arrive in one timeout.

use std::task::{Context, Poll, Waker};

use crate::partition::log::Proposing;

use super::*;

/// The proposal being handed to the log (waiting for room in its queue), with its sequence.
pub(crate) struct Submission {
    sequence: u64,
    proposing: Proposing,
}

/// What handing a proposal to the log gave: its sequence and whether the log took it.
pub(crate) type Submitted = (u64, BrokerResult<()>);

/// The proposal in flight, if any; never resolves without one.
pub(super) async fn next_submitted(appending: &mut Option<Submission>) -> Submitted {
    match appending {
        Some(submission) => (submission.sequence, submission.proposing.as_mut().await),
        None => std::future::pending().await,
    }
}

impl Owner {
    /// Append records and remember what to do once they are durable.
    pub(super) fn append(
        &mut self,
        records: Vec<PartitionRecord>,
        payloads: Vec<Vec<u8>>,
        done: Done,
    ) {
        let timestamp_ms = (self.ctx.clock)();
        self.append_at(records, payloads, done, timestamp_ms);
    }

    /// Append one control record (settle, return, settings): its effects come from applying
    /// it.
    pub(super) fn append_control(&mut self, record: PartitionRecord) {
        let payload = record.encode();
        self.append(vec![record], vec![payload], Done::Internal);
    }

    pub(super) fn append_at(
        &mut self,
        records: Vec<PartitionRecord>,
        payloads: Vec<Vec<u8>>,
        done: Done,
        timestamp_ms: u64,
    ) {
        // A stopped partition writes nothing: its state is rebuilt from the log when it heals,
        // and nothing may be appended behind a gap between the two.
        let refused = match (self.log(), self.stop_error()) {
            (Ok(_), Some(stop)) => Some(self.unavailable(stop)),
            (Ok(_), None) => None,
            (Err(e), _) => Some(e),
        };
        if let Some(error) = refused {
            self.fail(records, done, error);
            return;
        }
        let now = Instant::now();
        let publish = matches!(done, Done::Publish(_));
        let types = records.iter().map(PartitionRecord::record_type).collect();
        let sequence = self.driver.propose(Appending { records, done }, now);
        if publish {
            self.deadlines.push_back(PublishDeadline {
                at: now + self.ctx.publish_timeout,
                sequence,
            });
        }
        self.last_append = now;
        self.handed_back = false;
        let batch = Proposal {
            sequence,
            types,
            payloads,
            timestamp_ms,
        };
        if self.appending.is_none() && self.backlog.is_empty() {
            self.start_submission(batch);
        } else {
            self.backlog.push_back(batch);
        }
    }

    /// Hand a batch to the log. It usually has room: the first poll queues the records and
    /// the answer is handled at once; otherwise the owner polls it beside its commands.
    /// Returns false when the batch is a `PRODUCERS` record that waits for the state to catch
    /// up (`checkpoint.rs`): it goes back to the front of the backlog.
    fn start_submission(&mut self, mut batch: Proposal) -> bool {
        if self.checkpoint_sequence == Some(batch.sequence) {
            match self.fill_checkpoint(&mut batch) {
                super::checkpoint::Checkpoint::Ready => {}
                super::checkpoint::Checkpoint::Wait => {
                    self.backlog.push_front(batch);
                    return false;
                }
                super::checkpoint::Checkpoint::Drop => {
                    let error = self.not_leader();
                    self.resolve(batch.sequence, Err(error));
                    return true;
                }
            }
        }
        let Some(log) = self.log.clone() else {
            let error = BrokerError::Closed(format!("queue {:?}", self.ctx.queue));
            self.resolve(batch.sequence, Err(error));
            return true;
        };
        let sequence = batch.sequence;
        let mut proposing = log.propose(batch);
        let mut cx = Context::from_waker(Waker::noop());
        match proposing.as_mut().poll(&mut cx) {
            Poll::Ready(result) => self.submitted((sequence, result)),
            // Polled again (with the task's waker) as the loop's next `select!`.
            Poll::Pending => {
                self.appending = Some(Submission {
                    sequence,
                    proposing,
                })
            }
        }
        true
    }

    /// Hand the backlog to the log, in order, until one has to wait for room (or for the
    /// state, a `PRODUCERS` record).
    pub(super) fn submit_backlog(&mut self) {
        while self.appending.is_none() {
            let Some(batch) = self.backlog.pop_front() else {
                break;
            };
            if !self.start_submission(batch) {
                break;
            }
        }
    }

    /// A proposal reached the log's queue (its outcome comes as `LogEvent::Proposed`) or was
    /// refused by it.
    pub(super) fn submitted(&mut self, (sequence, result): Submitted) {
        let error = match result {
            Ok(()) => return,
            Err(BrokerError::Log(error)) => {
                // Only a log that stopped stops the partition; a refused request does not.
                if error.is_stopped() {
                    self.stop(error.clone());
                }
                match error {
                    LogError::RecordTooLarge { .. } => BrokerError::TooLarge(error.to_string()),
                    LogError::Invalid(_) => BrokerError::Invalid(error.to_string()),
                    other => self.unavailable(other),
                }
            }
            // Not the leader: nothing was written, the log runs on.
            Err(other) => other,
        };
        self.resolve(sequence, Err(error));
    }

    /// What the partition log reported. A proposal's storage failure (`BrokerError::Log`)
    /// stops the partition when it is acted on in order; any other failure means leadership
    /// moved while it was in flight: answered as is, "not the leader" (nothing written) or
    /// unknown (a retry at the new leader is safe with an idempotent producer); the log runs
    /// on, and records of it that were committed after all are applied like any other's
    /// (`follow.rs`).
    pub(super) fn log_event(&mut self, event: LogEvent) {
        match event {
            LogEvent::Proposed { sequence, result } => self.resolve(sequence, result),
            LogEvent::Committed { up_to } => self.driver.committed(up_to),
            LogEvent::Role(role) => self.role_changed(role),
            LogEvent::Stopped { error } => {
                if self.driver.stopped().is_none() {
                    tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "this node's copy of the partition log failed; healing it");
                    self.stop(error);
                }
            }
        }
    }

    /// Record how append `sequence` ended, then act on every answered append at the front, in
    /// order.
    fn resolve(&mut self, sequence: u64, outcome: BrokerResult<Range<u64>>) {
        if self.driver.resolve(sequence, outcome) {
            self.act_on_answers();
        }
    }

    /// Act on every answered append at the front, in order. A proposal committed past the
    /// state's head waits: the records before it were proposed elsewhere (a predecessor's, or
    /// the replicated log's own entries) and are applied first (`follow.rs`).
    pub(super) fn act_on_answers(&mut self) {
        // Applying may append (`drop_oldest` settles what a publish owes), and an append the
        // log refuses at once is resolved in place: acting on it here, nested, would answer
        // later appends before the one being applied. The running loop reaches it in order.
        if self.acting {
            return;
        }
        self.acting = true;
        self.act_on_answers_in_order();
        self.acting = false;
        // Deadlines of answered appends go now: kept to their time, a busy partition would
        // hold one per append of the last `publish_timeout`.
        let next = self
            .driver
            .oldest()
            .map_or(self.driver.next_sequence(), |p| p.sequence);
        while self.deadlines.front().is_some_and(|d| d.sequence < next) {
            self.deadlines.pop_front();
        }
    }

    /// The loop of `act_on_answers`: the driver releases answered appends in order.
    fn act_on_answers_in_order(&mut self) {
        while let Some(Pending {
            sequence,
            outcome,
            item,
        }) = self.driver.next_released(self.state.head())
        {
            if self.checkpoint_sequence == Some(sequence) {
                self.checkpoint_sequence = None;
            }
            match outcome {
                Some(Ok(range)) => self.apply(range, item.records, item.done),
                Some(Err(BrokerError::Log(error))) => {
                    self.stop(error.clone());
                    // The records reached the log's queue: a crash before the failure could
                    // leave them durable, so the caller cannot know.
                    let error = BrokerError::OutcomeUnknown {
                        queue: self.ctx.queue.clone(),
                        partition: self.ctx.index,
                        source: error,
                    };
                    self.fail(item.records, item.done, error);
                }
                Some(Err(error)) => self.fail(item.records, item.done, error),
                None => {}
            }
        }
    }

    /// Answer the publishes whose fate is not known in time: those pending when this node
    /// stopped leading, once the driver's step-down grace is over, as
    /// [`BrokerError::LeadershipLost`]; those past their publish timeout as
    /// [`BrokerError::TimedOut`].
    pub(super) fn expire_publishes(&mut self) {
        let now = Instant::now();
        let lost = (self.driver.role()).leadership_lost(&self.ctx.queue, self.ctx.index);
        for sequence in self.driver.grace_expired(now) {
            if self.answer_unknown(sequence, lost.clone()) {
                tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, "a publish in flight when this node stopped leading is answered as unknown");
            }
        }
        while let Some(&PublishDeadline { at, sequence }) = self.deadlines.front() {
            if at > now {
                break;
            }
            self.deadlines.pop_front();
            let error = BrokerError::TimedOut {
                queue: self.ctx.queue.clone(),
                partition: self.ctx.index,
                timeout_ms: self.ctx.publish_timeout.as_millis() as u64,
            };
            if self.answer_unknown(sequence, error) {
                tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, "a publish was not confirmed within the publish timeout");
            }
        }
    }

    /// Answer publish `sequence` with `error` now, if its outcome is not known yet; true if it
    /// was answered. One still waiting for room in the log's queue is withdrawn (never
    /// written); one in the log's queue stays there (it may yet become durable, and is then
    /// applied like any record).
    fn answer_unknown(&mut self, sequence: u64, error: BrokerError) -> bool {
        let Some(pending) = self.driver.get_mut(sequence) else {
            return false;
        };
        if pending.outcome.is_some() {
            // Answered, waiting only for an earlier append's answer.
            return false;
        }
        // Answered now: the appends before it may wait for the disk much longer.
        let Done::Publish(reply) = std::mem::replace(&mut pending.item.done, Done::Internal) else {
            return false;
        };
        let _ = reply.send(Err(error.clone()));
        // Not in the log's queue yet: withdrawn. Its entry still waits for its turn, so that
        // its reservation is given back in order.
        if let Some(at) = self.backlog.iter().position(|b| b.sequence == sequence) {
            self.backlog.remove(at);
            self.resolve(sequence, Err(error));
        }
        true
    }
}
