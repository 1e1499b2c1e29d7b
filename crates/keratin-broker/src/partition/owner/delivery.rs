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

/// A leader whose delivery lease lapsed looks at it again after this long (or on the next
/// command): a new leader's first acknowledgement comes within a heartbeat (100 ms), and a
/// cut-off one turns its role within the rest of its lease (250 ms), so a partition with
/// consumers waiting wakes at most 50 times a second meanwhile.
const LEASE_RETRY_AFTER: Duration = Duration::from_millis(20);

/// What a delivery read job returns.
pub(crate) struct ReadBatch {
    reader: Option<BoxReader>,
    epoch: u64,
    messages: Vec<Prefetched>,
    failed: bool,
}

impl Owner {
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
        self.delivery_lease_retry_at = None;
        // A pending purge names ready messages the state still shows live: delivering one would
        // hand out a message the purge answered as removed (and its segment may soon be gone).
        if self.delivery.consumers.is_empty()
            || self.log.is_none()
            || self.purges > 0
            || !self.may_deliver_now()
        {
            return;
        }
        // A partition holding dead letters while the node holds its most delivers nothing
        // more: each delivery its consumers reject would only add to them.
        if !self.delivery.dead_letters.is_empty() && self.ctx.dead_letters_held.full() {
            return;
        }
        let Some(budget) = self.ctx.broker.upgrade().map(|b| b.delivery_budget()) else {
            return;
        };
        let mut passed_over: Vec<u64> = Vec::new();
        while let Some(front) = self.delivery.prefetched.front() {
            let (m, size_bytes) = (front.id, front.size_bytes);
            if self.delivery.peek_ready(&self.state) != Some(m) {
                self.delivery.prefetched.clear();
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
            let Some(front) = self.delivery.prefetched.pop_front() else {
                return;
            };
            self.delivery.take_ready(m);
            let previous = self.delivery.delivery_count(&self.state, m);
            let delivery_count = previous + 1;
            let delivery = Delivery {
                tag: DeliveryTag {
                    partition: self.ctx.index,
                    message: m,
                },
                // Below the start of this node's leadership, an earlier leader may have
                // delivered it: it is flagged, like a return.
                redelivered: previous > 0 || m < self.delivery.taken_over_at,
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
                self.delivery.redeliver.insert(m);
                continue;
            }
            self.delivery.inflight.insert(
                m,
                Inflight {
                    consumer: link.id,
                    delivery_count,
                    size_bytes,
                },
            );
        }
        if self.delivery.prefetched.is_empty() {
            self.start_delivery_read(&budget);
        }
    }

    /// Whether this node may hand messages out now: it leads, it applied every record of its
    /// predecessors' leaderships (a new leader whose state still misses settles they
    /// committed would deliver acked messages again), and its log's delivery lease holds (a
    /// leader cut off from the others stops before a successor can be elected). A lapsed
    /// lease is looked at again after [`LEASE_RETRY_AFTER`].
    fn may_deliver_now(&mut self) -> bool {
        if !self.driver.role().leading || self.state.head() < self.driver.role().from {
            return false;
        }
        let Some(log) = &self.log else {
            return false;
        };
        let now = Instant::now();
        if log.delivery_lease().holds_at(now) {
            return true;
        }
        self.delivery_lease_retry_at = Some(now + LEASE_RETRY_AFTER);
        false
    }

    /// Read the next ready messages ahead, on the blocking pool, when a consumer could take
    /// one and the node's budget has room.
    fn start_delivery_read(&mut self, budget: &Arc<crate::ByteBudget>) {
        if self.delivery.reading
            || self
                .delivery
                .read_retry_at
                .is_some_and(|at| at > Instant::now())
        {
            return;
        }
        self.delivery.read_retry_at = None;
        if self.delivery.peek_ready(&self.state).is_none()
            || !self.delivery.some_consumer_has_credit()
        {
            return;
        }
        if !budget.room_or_wait(1, &self.commands) {
            return;
        }
        let wanted: Vec<(u64, u64)> = self
            .delivery
            .ready_ids(&self.state, READ_BATCH_COUNT)
            .into_iter()
            .map(|m| (m, self.state.payload_offset(m)))
            .collect();
        let Some(runs) = self.plan_runs(&wanted) else {
            return;
        };
        self.delivery.reading = true;
        let commands = self.commands.clone();
        let epoch = self.delivery.reader_epoch;
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
        self.delivery.reading = false;
        if batch.epoch == self.delivery.reader_epoch && self.delivery.reader.is_none() {
            self.delivery.reader = batch.reader;
        }
        if batch.failed {
            self.delivery.read_retry_at = Some(Instant::now() + READ_RETRY_AFTER);
        }
        // Only a read that starts at the next ready message is of use (anything may have
        // changed while it ran); `deliver` checks each one again as it goes.
        if batch.epoch == self.delivery.reader_epoch
            && batch.messages.first().map(|p| p.id) == self.delivery.peek_ready(&self.state)
        {
            self.delivery.prefetched = batch.messages.into();
        }
    }

    /// The next consumer (round robin) with count credit and, for a message of `known` size
    /// (or at least a byte when unknown), room in its connection budget and byte prefetch.
    /// Takes one unit of count credit from it.
    pub(super) fn pick_consumer(
        &mut self,
        known: Option<u32>,
        passed_over: &[u64],
    ) -> Option<Arc<ConsumerLink>> {
        let n = self.delivery.consumers.len();
        let size = known.unwrap_or(1);
        for i in 0..n {
            let index = (self.delivery.round_robin + i) % n;
            let link = &self.delivery.consumers[index];
            if link.sender.is_closed() || passed_over.contains(&link.id) {
                continue;
            }
            let room = link
                .outbound
                .as_ref()
                .is_none_or(|o| o.room_or_wait(u64::from(size), &self.commands))
                && link.credit.bytes_room(size);
            if room && link.credit.try_acquire() {
                self.delivery.round_robin = index + 1;
                return Some(link.clone());
            }
        }
        None
    }

    /// The payload size of ready message `m`, for `drop_oldest`: from the read-ahead when it
    /// holds `m`, else read here, on the owner's thread. This is the one read left on the
    /// async worker: a queue with `drop_oldest` at its limit, and no consumer reading ahead.
    pub(super) fn ready_size(&mut self, m: u64) -> BrokerResult<u32> {
        if let Some(front) = self.delivery.prefetched.front().filter(|p| p.id == m) {
            let size = front.size_bytes;
            self.delivery.prefetched.pop_front();
            return Ok(size);
        }
        self.delivery.prefetched.clear();
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
