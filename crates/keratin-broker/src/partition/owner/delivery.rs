//! Handing ready messages to consumers with credit, in id order, and reading payloads from the
//! log wherever they live (original offset or relocated copy).

use super::*;

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
    pub(super) fn deliver(&mut self) {
        // A pending purge names ready messages the state still shows live: delivering one would
        // hand out a message the purge answered as removed (and its segment may soon be gone).
        if self.consumers.is_empty() || self.log.is_none() || self.purges > 0 {
            return;
        }
        let Some(budget) = self.ctx.broker.upgrade().map(|b| b.delivery_budget()) else {
            return;
        };
        // A message read whose bytes did not fit a consumer: kept for the next one this round
        // (its size is then known before anything is taken).
        let mut held: Option<(u64, Message, u32)> = None;
        let mut passed_over: Vec<u64> = Vec::new();
        while let Some(m) = self.peek_ready() {
            if held.as_ref().is_some_and(|(id, _, _)| *id != m) {
                held = None;
            }
            let known = held.as_ref().map(|(_, _, size)| *size);
            if !budget.room_or_wait(known.map_or(1, u64::from), &self.commands) {
                return;
            }
            let Some(link) = self.pick_consumer(known, &passed_over) else {
                return;
            };
            let (message, size_bytes) = match held.take() {
                Some((_, message, size)) => (message, size),
                None => match self.read_message(m) {
                    Ok(read) => read,
                    Err(error) => {
                        tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, message = m, %error, "cannot read a message for delivery");
                        link.credit.release(1);
                        return;
                    }
                },
            };
            let size = u64::from(size_bytes);
            let Some(node) = budget.take_or_wait(size, &self.commands) else {
                // Read blind (size unknown) into a budget that others filled meanwhile: the
                // payload is dropped, the message stays ready.
                link.credit.release(1);
                return;
            };
            let outbound = match &link.outbound {
                Some(outbound) => match outbound.take_or_wait(size, &self.commands) {
                    Some(permit) => Some(permit),
                    None => {
                        link.credit.release(1);
                        passed_over.push(link.id);
                        held = Some((m, message, size_bytes));
                        continue;
                    }
                },
                None => None,
            };
            if !link.credit.try_acquire_bytes(size_bytes) {
                link.credit.release(1);
                passed_over.push(link.id);
                held = Some((m, message, size_bytes));
                continue;
            }
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
                message,
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

    /// The message payload of live message `m` (as counted in live bytes), wherever it is.
    pub(super) fn read_payload(&mut self, m: u64) -> BrokerResult<Vec<u8>> {
        let at = self.state.payload_offset(m);
        let log = self
            .log
            .as_ref()
            .ok_or_else(|| BrokerError::Closed("log".into()))?;
        // Reuse the buffered reader when the payload lies a little ahead of it (the next live
        // message after some control records): a fresh reader reads a whole chunk.
        let skip = self
            .reader
            .as_ref()
            .and_then(|r| at.checked_sub(r.position()))
            .filter(|gap| *gap <= READER_SKIP_MAX);
        if let (Some(gap), Some(reader)) = (skip, self.reader.as_mut()) {
            for _ in 0..gap {
                if !matches!(reader.next(), Some(Ok(_))) {
                    break;
                }
            }
        }
        if self.reader.as_ref().is_none_or(|r| r.position() != at) {
            self.reader = Some(log.reader(at));
        }
        let reader = self
            .reader
            .as_mut()
            .ok_or_else(|| BrokerError::Closed("reader".into()))?;
        let corrupt = |reason: String| BrokerError::Corrupt {
            what: "partition",
            offset: at,
            reason,
        };
        let record = match reader.next() {
            Some(Ok(record)) => record,
            Some(Err(e)) => {
                self.reader = None;
                return Err(BrokerError::Log(e));
            }
            None => {
                self.reader = None;
                return Err(corrupt("live message past the durable end".into()));
            }
        };
        match record.record_type {
            ENQUEUE => Ok(record.payload),
            RELOCATE => match PartitionRecord::decode(RELOCATE, &record.payload, at)? {
                PartitionRecord::Relocate(relocate) => Ok(relocate.payload),
                _ => Err(corrupt("relocation expected".into())),
            },
            other => Err(corrupt(format!("record type {other} holds no message"))),
        }
    }

    /// Live message `m`, decoded, with its payload size.
    pub(super) fn read_message(&mut self, m: u64) -> BrokerResult<(Message, u32)> {
        let payload = self.read_payload(m)?;
        let size = payload.len() as u32;
        Ok((Message::decode(&payload, m)?, size))
    }
}
