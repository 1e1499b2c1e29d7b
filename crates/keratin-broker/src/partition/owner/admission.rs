//! What gets into a partition: publishes pass the queue limits (`reject`, `drop_oldest`) and
//! the node's publish gate (admit, slow in a per-partition queue, reject), and live settings
//! changes take effect.

use super::*;

impl Owner {
    pub(super) fn publish(
        &mut self,
        payloads: Vec<Vec<u8>>,
        timestamp_ms: u64,
        internal: bool,
        reply: oneshot::Sender<BrokerResult<Range<u64>>>,
    ) {
        if !self.driver.role().leading {
            let _ = reply.send(Err(self.not_leader()));
            return;
        }
        if let Some(stop) = self.stop_error() {
            let _ = reply.send(Err(self.unavailable(stop)));
            return;
        }
        let bytes: u64 = payloads.iter().map(|p| p.len() as u64).sum();
        let count = payloads.len() as u64;
        // Queue limits apply to every publish, dead-lettering included; the resource gate
        // below does not hold back dead-lettering. A publish the limits can never admit is
        // refused here; `drop_oldest` drops only once the gate admitted the publish, at write
        // time (a refused publish must not cost the queue its oldest messages).
        if let Err(error) = self.queue_limits(count, bytes, false) {
            let _ = reply.send(Err(error));
            return;
        }
        if internal {
            self.admit_and_write(payloads, timestamp_ms, reply);
            return;
        }
        let now = Instant::now();
        // Behind a delayed publish, a new one waits too: publishes keep their order.
        let after = self.delayed.back().map_or(now, |d| d.ready_at);
        let decision = if self.ctx.gate.replicas_limited() {
            let replicas = self.in_sync_replicas();
            self.ctx
                .gate
                .publish_replicated(self.ctx.device, bytes, &replicas)
        } else {
            self.ctx.gate.publish(self.ctx.device, bytes)
        };
        match decision {
            GateDecision::Reject {
                reason,
                retry_after_ms,
                message,
            } => {
                let _ = reply.send(Err(BrokerError::Limited {
                    reason,
                    retry_after_ms,
                    message,
                }));
            }
            GateDecision::Slow { delay_ms } => self.delayed.push_back(Delayed {
                ready_at: (now + Duration::from_millis(delay_ms)).max(after),
                payloads,
                timestamp_ms,
                reply,
            }),
            GateDecision::Admit if !self.delayed.is_empty() => self.delayed.push_back(Delayed {
                ready_at: after,
                payloads,
                timestamp_ms,
                reply,
            }),
            GateDecision::Admit => self.admit_and_write(payloads, timestamp_ms, reply),
        }
    }

    /// The other nodes with an in-sync copy of this partition, as its leader sees them (none
    /// for a local log): a publish waits for them, so their levels limit it too.
    fn in_sync_replicas(&self) -> Vec<u64> {
        let status = self.log.as_ref().and_then(|log| log.replication());
        status.map_or_else(Vec::new, |status| {
            status
                .progress
                .iter()
                .filter(|p| p.in_sync && Some(p.node) != status.leader)
                .map(|p| p.node)
                .collect()
        })
    }

    /// A publish the gate admitted: pass the queue limits (dropping the oldest messages when
    /// that makes room), count it as reserved until applied, and write it.
    fn admit_and_write(
        &mut self,
        payloads: Vec<Vec<u8>>,
        timestamp_ms: u64,
        reply: oneshot::Sender<BrokerResult<Range<u64>>>,
    ) {
        let bytes: u64 = payloads.iter().map(|p| p.len() as u64).sum();
        let count = payloads.len() as u64;
        if let Err(error) = self.queue_limits(count, bytes, true) {
            let _ = reply.send(Err(error));
            return;
        }
        self.reserved_count += count;
        self.reserved_bytes += bytes;
        self.write_publish(payloads, timestamp_ms, reply);
    }

    pub(super) fn undrop(&mut self, m: u64) {
        if let Some(size) = self.dropping.remove(&m) {
            self.dropping_bytes = self.dropping_bytes.saturating_sub(u64::from(size));
        }
    }

    pub(super) fn unreserve(&mut self, count: u64, bytes: u64) {
        self.reserved_count = self.reserved_count.saturating_sub(count);
        self.reserved_bytes = self.reserved_bytes.saturating_sub(bytes);
    }

    /// Messages and bytes that count toward the queue limits: live ones, plus admitted
    /// publishes not applied yet, minus those being dropped to make room or purged.
    pub(super) fn queue_usage(&self) -> (u64, u64) {
        let leaving_count = self.dropping.len() as u64 + self.purging_count;
        let leaving_bytes = self.dropping_bytes + self.purging_bytes;
        (
            (self.state.live_count() + self.reserved_count).saturating_sub(leaving_count),
            (self.state.live_bytes() + self.reserved_bytes).saturating_sub(leaving_bytes),
        )
    }

    pub(super) fn over_limits(&self, count: u64, bytes: u64) -> bool {
        prepare::over_limits(&self.limits, (count, bytes))
    }

    /// Below both limits: a small publish fits again. A partition marked full when it refused a
    /// publish stays full until then, so `full` means "refusing now", not "refused once".
    pub(super) fn has_room(&self) -> bool {
        prepare::has_room(&self.limits, self.queue_usage())
    }

    /// Admit a batch of `count` messages and `bytes` under the queue limits: all or nothing
    /// (the verdict is `prepare::limit_verdict`). With `drop_oldest` the oldest ready messages
    /// make room (only when `drop` is set; without it the call only checks that they could),
    /// and so do the messages of earlier publishes not yet applied: what they owe is dropped
    /// once they are applied (`trim_to_limits`). Inflight ones are never dropped, so a batch
    /// that does not fit beside them is refused like `reject`.
    pub(super) fn queue_limits(&mut self, count: u64, bytes: u64, drop: bool) -> BrokerResult<()> {
        if !self.limits.is_set() {
            return Ok(());
        }
        // Everything not inflight or leaving is ready, and droppable; so are the messages of
        // publishes admitted before this one and not yet applied: they are older than this
        // batch, and ready when applied (`trim_to_limits` drops what is owed in the round
        // that applies them, before any delivery). While a purge is pending nothing is
        // droppable (the ready messages are leaving with it, and no longer count).
        let droppable = || {
            (self.purges == 0).then(|| {
                let (ready_count, ready_bytes) = self.ready_amount();
                (
                    ready_count + self.reserved_count,
                    ready_bytes + self.reserved_bytes,
                )
            })
        };
        match prepare::limit_verdict(&self.limits, self.queue_usage(), (count, bytes), droppable) {
            LimitVerdict::Fits => {
                self.figures.full.store(0, Ordering::Relaxed);
                Ok(())
            }
            LimitVerdict::NeverFits => {
                Err(prepare::never_fits_error((count, bytes), &self.ctx.queue))
            }
            LimitVerdict::Full => {
                self.figures.full.store(1, Ordering::Relaxed);
                self.figures.rejected_full.fetch_add(1, Ordering::Relaxed);
                Err(prepare::queue_full_error(
                    &self.limits,
                    &self.ctx.queue,
                    self.ctx.index,
                ))
            }
            LimitVerdict::FitsAfterDrop if drop => self.drop_oldest(count, bytes),
            LimitVerdict::FitsAfterDrop => Ok(()),
        }
    }

    /// The ready messages and their bytes: live ones not inflight or leaving.
    fn ready_amount(&self) -> prepare::Amount {
        let (busy_count, busy_bytes) = self.delivery.busy();
        (
            self.state.live_count().saturating_sub(busy_count),
            self.state.live_bytes().saturating_sub(busy_bytes),
        )
    }

    /// Remove the oldest ready messages until `count` more messages and `bytes` fit.
    pub(super) fn drop_oldest(&mut self, count: u64, bytes: u64) -> BrokerResult<()> {
        // The ready messages a pending purge names still look live: none may be picked.
        if self.purges > 0 {
            return Ok(());
        }
        let mut dropped: Vec<Dying> = Vec::new();
        loop {
            let (used_count, used_bytes) = self.queue_usage();
            if !self.over_limits(used_count + count, used_bytes + bytes) {
                break;
            }
            let Some(m) = self.delivery.peek_ready(&self.state) else {
                break;
            };
            let size = match self.ready_size(m) {
                Ok(size) => size,
                Err(error) => {
                    // All or nothing: the messages picked so far are ready again (first in
                    // line), and the publish is refused.
                    for picked in dropped {
                        self.delivery.limbo.remove(&picked.message);
                        self.undrop(picked.message);
                        self.delivery.redeliver.insert(picked.message);
                    }
                    return Err(error);
                }
            };
            // Dropping a message a consumer holds would lose it under that consumer.
            assert!(
                !self.delivery.inflight.contains_key(&m) && !self.delivery.limbo.contains_key(&m),
                "queue {:?} partition {}: drop_oldest picked message {m}, which is inflight or leaving",
                self.ctx.queue,
                self.ctx.index
            );
            self.delivery.take_ready(m);
            self.delivery.limbo.insert(m, size);
            self.dropping.insert(m, size);
            self.dropping_bytes += u64::from(size);
            let delivery_count = self.state.delivery_count(m);
            dropped.push(Dying {
                message: m,
                entry: Inflight {
                    consumer: 0,
                    delivery_count,
                    size_bytes: size,
                },
                reason: DeathReason::Overflow,
            });
        }
        for d in &dropped {
            self.delivery.counts_pending.remove(&d.message);
        }
        self.figures
            .overflowed
            .fetch_add(dropped.len() as u64, Ordering::Relaxed);
        self.dead_letter(dropped);
        Ok(())
    }

    /// Drop what earlier admissions owe: a `drop_oldest` partition whose live messages plus
    /// the publishes admitted and not yet applied exceed its limit drops its oldest ready
    /// messages until they fit. Runs when records were applied, before they are answered, and
    /// in the round after a heal, before delivering. A partition that does not lead, or whose
    /// log is stopped, leaves it (the trim is due again when records are applied, and after a
    /// heal).
    pub(super) fn trim_to_limits(&mut self) {
        if !std::mem::take(&mut self.trim_due)
            || self.limits.overflow != Overflow::DropOldest
            || !self.driver.role().leading
            || self.driver.stopped().is_some()
        {
            return;
        }
        let (count, bytes) = self.queue_usage();
        if !self.over_limits(count, bytes) {
            return;
        }
        if let Err(error) = self.drop_oldest(0, 0) {
            tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "dropping the oldest messages to the limit failed; tried again when records are next applied");
        }
    }

    /// New settings of a live queue: recorded in the partition's log, in force at once.
    /// Lowering a `drop_oldest` limit below the current depth trims ready messages.
    pub(super) fn set_settings(&mut self, settings: QueueSettings) {
        if settings.dead_letter != self.ctx.settings.dead_letter {
            // Held dead letters go to the new dead-letter queue (or are dropped) at once.
            self.delivery.dead_letters.retry_now();
        }
        self.limits = settings.partition_limits();
        self.ctx.settings = settings;
        // Only the leader writes: every replica learns the settings from the metadata.
        if !self.driver.role().leading {
            return;
        }
        if let Some(record) = prepare::settings(&self.ctx.settings) {
            self.append_control(record);
        }
        if self.limits.overflow == Overflow::DropOldest {
            if let Err(error) = self.drop_oldest(0, 0) {
                tracing::warn!(queue = %self.ctx.queue, %error, "trimming to the new limit failed");
            }
        }
        let (count, bytes) = self.queue_usage();
        let full = u64::from(self.over_limits(count, bytes));
        self.figures.full.store(full, Ordering::Relaxed);
    }

    /// Write the delayed publishes whose time has come; the gate is asked again, since the
    /// level may have reached hard meanwhile.
    pub(super) fn release_delayed(&mut self) {
        let now = Instant::now();
        while self.delayed.front().is_some_and(|d| d.ready_at <= now) {
            let Some(d) = self.delayed.pop_front() else {
                break;
            };
            if let Some(stop) = self.stop_error() {
                let error = self.unavailable(stop);
                let _ = d.reply.send(Err(error));
                continue;
            }
            let bytes: u64 = d.payloads.iter().map(|p| p.len() as u64).sum();
            match self.ctx.gate.publish(self.ctx.device, bytes) {
                GateDecision::Reject {
                    reason,
                    retry_after_ms,
                    message,
                } => {
                    let _ = d.reply.send(Err(BrokerError::Limited {
                        reason,
                        retry_after_ms,
                        message,
                    }));
                }
                GateDecision::Admit | GateDecision::Slow { .. } => {
                    self.admit_and_write(d.payloads, d.timestamp_ms, d.reply)
                }
            }
        }
    }

    pub(super) fn write_publish(
        &mut self,
        payloads: Vec<Vec<u8>>,
        timestamp_ms: u64,
        reply: oneshot::Sender<BrokerResult<Range<u64>>>,
    ) {
        let records = prepare::enqueues(&payloads);
        self.append_at(records, payloads, Done::Publish(reply), timestamp_ms);
    }
}
