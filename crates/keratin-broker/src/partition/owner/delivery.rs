//! Handing ready messages to consumers with credit, in id order, and reading payloads from the
//! log wherever they live (original offset or relocated copy), ahead, off the async workers.

use super::*;

/// A delivery read reads at most this many messages...
const READ_BATCH_COUNT: usize = 256;

/// ...and stops once it holds this many payload bytes (one message larger than this is read
/// alone). Each partition with consumers holds at most one read batch outside the node's
/// delivery budget.
const READ_BATCH_BYTES: usize = 256 << 10;

/// A failed delivery read is tried again after this long (or on the next command).
const READ_RETRY_AFTER: Duration = Duration::from_millis(100);

/// A message read ahead for delivery.
pub(crate) struct Prefetched {
    pub(super) id: u64,
    message: Message,
    pub(super) size_bytes: u32,
}

/// What a delivery read job returns.
pub(crate) struct ReadBatch {
    reader: Option<LogReader>,
    epoch: u64,
    messages: Vec<Prefetched>,
    failed: bool,
}

impl Owner {
    /// The next ready message in delivery order, without taking it.
    pub(super) fn peek_ready(&mut self) -> Option<u64> {
        while let Some(&m) = self.redeliver.first() {
            if self.state.is_live(m) {
                return Some(m);
            }
            // Returned after its settle became durable but was answered as failed: the state
            // rebuilt at the heal knows it is gone.
            self.redeliver.remove(&m);
            self.counts_pending.remove(&m);
        }
        self.state.next_live(self.cursor)
    }

    pub(super) fn take_ready(&mut self, m: u64) {
        if !self.redeliver.remove(&m) {
            self.cursor = m + 1;
        }
    }

    /// Hand ready messages to consumers with credit, round robin, while the delivery budgets
    /// have room: the node's (bytes read and not yet handed to a socket), the consumer's
    /// connection's, and the consumer's byte prefetch. A consumer without room is passed over
    /// for this round; without node room the partition waits to be kicked when bytes come back.
    /// Nothing is dropped: a message that does not fit stays ready.
    ///
    /// Payloads come from `prefetched`, read ahead by a job on the blocking pool; one is
    /// delivered only while its message is still the next ready one (not acked, purged or
    /// overtaken by a returned message meanwhile), else the read-ahead is dropped and read
    /// again.
    pub(super) fn deliver(&mut self) {
        // A pending purge names ready messages the state still shows live: delivering one would
        // hand out a message the purge answered as removed (and its segment may soon be gone).
        if self.consumers.is_empty() || self.log.is_none() || self.purges > 0 {
            return;
        }
        let Some(budget) = self.ctx.broker.upgrade().map(|b| b.delivery_budget()) else {
            return;
        };
        let mut passed_over: Vec<u64> = Vec::new();
        while let Some(front) = self.prefetched.front() {
            let (m, size_bytes) = (front.id, front.size_bytes);
            if self.peek_ready() != Some(m) {
                self.prefetched.clear();
                break;
            }
            let size = u64::from(size_bytes);
            if !budget.room_or_wait(size, &self.commands) {
                return;
            }
            let Some(link) = self.pick_consumer(Some(size_bytes), &passed_over) else {
                return;
            };
            let Some(node) = budget.take_or_wait(size, &self.commands) else {
                link.credit.release(1);
                return;
            };
            let outbound = match &link.outbound {
                Some(outbound) => match outbound.take_or_wait(size, &self.commands) {
                    Some(permit) => Some(permit),
                    None => {
                        link.credit.release(1);
                        passed_over.push(link.id);
                        continue;
                    }
                },
                None => None,
            };
            if !link.credit.try_acquire_bytes(size_bytes) {
                link.credit.release(1);
                passed_over.push(link.id);
                continue;
            }
            let Some(front) = self.prefetched.pop_front() else {
                return;
            };
            self.take_ready(m);
            let previous = self
                .state
                .delivery_count(m)
                .max(self.counts_pending.get(&m).copied().unwrap_or(0));
            let delivery_count = previous + 1;
            let delivery = Delivery {
                tag: DeliveryTag {
                    partition: self.ctx.index,
                    message: m,
                },
                redelivered: previous > 0,
                delivery_count,
                message: front.message,
                permit: DeliveryPermit {
                    node: Some(node),
                    outbound,
                },
            };
            if link.sender.try_send(delivery).is_err() {
                link.credit.release(1);
                link.credit.release_bytes(link.credit.charge(size_bytes));
                self.redeliver.insert(m);
                continue;
            }
            self.inflight.insert(
                m,
                Inflight {
                    consumer: link.id,
                    delivery_count,
                    size_bytes,
                },
            );
        }
        if self.prefetched.is_empty() {
            self.start_delivery_read(&budget);
        }
    }

    /// Read the next ready messages ahead, on the blocking pool, when a consumer could take
    /// one and the node's budget has room.
    fn start_delivery_read(&mut self, budget: &Arc<crate::ByteBudget>) {
        if self.reading || self.read_retry_at.is_some_and(|at| at > Instant::now()) {
            return;
        }
        self.read_retry_at = None;
        if self.peek_ready().is_none() || !self.some_consumer_has_credit() {
            return;
        }
        if !budget.room_or_wait(1, &self.commands) {
            return;
        }
        let wanted: Vec<(u64, u64)> = self
            .ready_ids(READ_BATCH_COUNT)
            .into_iter()
            .map(|m| (m, self.state.payload_offset(m)))
            .collect();
        let Some(runs) = self.plan_runs(&wanted) else {
            return;
        };
        self.reading = true;
        let commands = self.commands.clone();
        let epoch = self.reader_epoch;
        let queue = self.ctx.queue.clone();
        tokio::task::spawn_blocking(move || {
            let read = disk::read_runs(runs, READ_BATCH_BYTES);
            let mut messages = Vec::with_capacity(read.payloads.len());
            let mut error = read.error;
            for (id, _, payload) in read.payloads {
                let size_bytes = payload.len() as u32;
                match Message::decode(&payload, id) {
                    Ok(message) => messages.push(Prefetched {
                        id,
                        message,
                        size_bytes,
                    }),
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            if let Some(error) = &error {
                tracing::error!(%queue, %error, "cannot read messages for delivery");
            }
            let _ = commands.send(Command::DeliveryRead(ReadBatch {
                reader: read.reader,
                epoch,
                messages,
                failed: error.is_some(),
            }));
        });
    }

    /// A delivery read returned: its payloads wait in `prefetched` for the round's delivery.
    pub(super) fn delivery_read(&mut self, batch: ReadBatch) {
        self.reading = false;
        if batch.epoch == self.reader_epoch && self.reader.is_none() {
            self.reader = batch.reader;
        }
        if batch.failed {
            self.read_retry_at = Some(Instant::now() + READ_RETRY_AFTER);
        }
        // Only a read that starts at the next ready message is of use (anything may have
        // changed while it ran); `deliver` checks each one again as it goes.
        if batch.epoch == self.reader_epoch
            && batch.messages.first().map(|p| p.id) == self.peek_ready()
        {
            self.prefetched = batch.messages.into();
        }
    }

    /// The next `limit` ready messages in delivery order, without taking them.
    fn ready_ids(&mut self, limit: usize) -> Vec<u64> {
        let mut ids = Vec::with_capacity(limit.min(64));
        let state = &self.state;
        ids.extend(
            self.redeliver
                .iter()
                .copied()
                .filter(|m| state.is_live(*m))
                .take(limit),
        );
        let mut from = self.cursor;
        while ids.len() < limit {
            let Some(m) = self.state.next_live(from) else {
                break;
            };
            ids.push(m);
            from = m + 1;
        }
        ids
    }

    /// Whether a consumer could take a delivery now (a count credit is free). Only looks: a
    /// credit taken and given back here could make another partition of the queue find the
    /// consumer full and wait for a kick that never comes.
    fn some_consumer_has_credit(&self) -> bool {
        self.consumers
            .iter()
            .any(|link| !link.sender.is_closed() && link.credit.has_credit())
    }

    /// The next consumer (round robin) with count credit and, for a message of `known` size
    /// (or at least a byte when unknown), room in its connection budget and byte prefetch.
    /// Takes one unit of count credit from it.
    pub(super) fn pick_consumer(
        &mut self,
        known: Option<u32>,
        passed_over: &[u64],
    ) -> Option<Arc<ConsumerLink>> {
        let n = self.consumers.len();
        let size = known.unwrap_or(1);
        for i in 0..n {
            let index = (self.round_robin + i) % n;
            let link = &self.consumers[index];
            if link.sender.is_closed() || passed_over.contains(&link.id) {
                continue;
            }
            let room = link
                .outbound
                .as_ref()
                .is_none_or(|o| o.room_or_wait(u64::from(size), &self.commands))
                && link.credit.bytes_room(size);
            if room && link.credit.try_acquire() {
                self.round_robin = index + 1;
                return Some(link.clone());
            }
        }
        None
    }

    /// The payload size of ready message `m`, for `drop_oldest`: from the read-ahead when it
    /// holds `m`, else read here, on the owner's thread. This is the one read left on the
    /// async worker: a queue with `drop_oldest` at its limit, and no consumer reading ahead.
    pub(super) fn ready_size(&mut self, m: u64) -> BrokerResult<u32> {
        if let Some(front) = self.prefetched.front().filter(|p| p.id == m) {
            let size = front.size_bytes;
            self.prefetched.pop_front();
            return Ok(size);
        }
        self.prefetched.clear();
        let at = self.state.payload_offset(m);
        let log = self.log()?;
        let mut reader = log.reader(at);
        let record = match reader.next() {
            Some(Ok(record)) => record,
            Some(Err(e)) => return Err(BrokerError::Log(e)),
            None => {
                return Err(disk::corrupt(
                    at,
                    "live message past the durable end".into(),
                ))
            }
        };
        Ok(disk::payload_of(record, at)?.len() as u32)
    }
}
