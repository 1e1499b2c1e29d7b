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

    /// Hand ready messages to consumers with credit, round robin.
    pub(super) fn deliver(&mut self) {
        // A pending purge names ready messages the state still shows live: delivering one would
        // hand out a message the purge answered as removed (and its segment may soon be gone).
        if self.consumers.is_empty() || self.log.is_none() || self.purges > 0 {
            return;
        }
        while let Some(m) = self.peek_ready() {
            let Some(link) = self.pick_consumer() else {
                return;
            };
            let (message, size_bytes) = match self.read_message(m) {
                Ok(read) => read,
                Err(error) => {
                    tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, message = m, %error, "cannot read a message for delivery");
                    link.credit.release(1);
                    return;
                }
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
                message,
            };
            if link.sender.try_send(delivery).is_err() {
                link.credit.release(1);
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

    pub(super) fn pick_consumer(&mut self) -> Option<Arc<ConsumerLink>> {
        let n = self.consumers.len();
        for i in 0..n {
            let index = (self.round_robin + i) % n;
            let link = &self.consumers[index];
            if !link.sender.is_closed() && link.credit.try_acquire() {
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
