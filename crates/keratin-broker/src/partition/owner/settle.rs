//! How messages leave or come back: acks (one round's acks in few SETTLE records), rejects,
//! returns of a lost consumer's deliveries, dead-lettering, and purge.

use super::*;

impl Owner {
    pub(super) fn settle(&mut self, consumer: u64, messages: Vec<u64>, reject: Option<bool>) {
        let mut acks = Vec::new();
        let mut returns = Vec::new();
        let mut dead = Vec::new();
        let mut settled = 0u32;
        let mut settled_sizes = Vec::new();
        for m in messages {
            let Some(entry) = self.delivery.inflight.get(&m).copied() else {
                continue;
            };
            if entry.consumer != consumer {
                continue;
            }
            self.delivery.inflight.remove(&m);
            self.delivery.limbo.insert(m, entry.size_bytes);
            settled += 1;
            settled_sizes.push(entry.size_bytes);
            match reject {
                None => acks.push(Settled {
                    message: m,
                    size_bytes: entry.size_bytes,
                    outcome: Outcome::Acked,
                }),
                Some(true) => self.sort_return(m, entry, &mut returns, &mut dead),
                Some(false) => dead.push((m, entry, DeathReason::Rejected)),
            }
        }
        // Acks of one round of commands become one SETTLE record (see `flush_acks`).
        self.acks.extend(acks);
        self.write_returns(returns);
        self.dead_letter(dead);
        // The credit comes back only now, after returned messages are ready again: they go
        // out before newer ones. Other partitions of the queue are woken if they were waiting.
        if let Some(link) = self.delivery.consumers.iter().find(|c| c.id == consumer) {
            let bytes = settled_sizes.iter().map(|s| link.credit.charge(*s)).sum();
            let bytes_freed = link.credit.release_bytes(bytes);
            if link.credit.release(settled) || bytes_freed {
                if let Some(queue) = link.queue.upgrade() {
                    queue.kick_all();
                }
            }
        }
    }

    /// Write the acks gathered in this round as one SETTLE record: a consumer acking message by
    /// message costs one record per round, not one per ack.
    pub(super) fn flush_acks(&mut self) {
        if self.acks.is_empty() {
            return;
        }
        let acks = std::mem::take(&mut self.acks);
        self.write_settles(acks);
    }

    /// Settles as records of at most `CONTROL_ENTRIES_MAX` entries each (`prepare::settles`).
    pub(super) fn write_settles(&mut self, settled: Vec<Settled>) {
        for record in prepare::settles(&settled) {
            self.append_control(record);
        }
    }

    pub(super) fn sort_return(
        &self,
        m: u64,
        entry: Inflight,
        returns: &mut Vec<Returned>,
        dead: &mut Vec<(u64, Inflight, DeathReason)>,
    ) {
        let exhausted = self
            .ctx
            .settings
            .max_deliveries
            .is_some_and(|max| entry.delivery_count >= max);
        if exhausted {
            dead.push((m, entry, DeathReason::MaxDeliveries));
        } else {
            returns.push(Returned {
                message: m,
                delivery_count: entry.delivery_count,
            });
        }
    }

    /// Returned messages are ready again at once, ahead of newer ones; the RETURN record only
    /// makes their delivery counts durable.
    pub(super) fn write_returns(&mut self, returns: Vec<Returned>) {
        if returns.is_empty() {
            return;
        }
        for r in &returns {
            self.delivery.limbo.remove(&r.message);
            self.delivery.redeliver.insert(r.message);
            self.delivery
                .counts_pending
                .insert(r.message, r.delivery_count);
        }
        for record in prepare::returns(&returns) {
            self.append_control(record);
        }
    }

    /// A consumer went away: its inflight messages are ready again, ahead of newer ones.
    pub(super) fn unsubscribe(&mut self, consumer: u64) {
        let theirs = self.delivery.unsubscribe(consumer);
        let mut returns = Vec::new();
        let mut dead = Vec::new();
        for (m, entry) in theirs {
            self.delivery.limbo.insert(m, entry.size_bytes);
            self.sort_return(m, entry, &mut returns, &mut dead);
        }
        self.write_returns(returns);
        self.dead_letter(dead);
    }

    /// Send messages to the dead-letter queue through the dead-letter sink (then settle them as
    /// dead-lettered), or drop them when the queue has none.
    pub(super) fn dead_letter(&mut self, entries: Vec<(u64, Inflight, DeathReason)>) {
        if entries.is_empty() {
            return;
        }
        let target = self.ctx.settings.dead_letter.clone();
        let sink = self.ctx.dead_letters.clone();
        let (Some(target), true) = (target, sink.is_open()) else {
            let settled = entries.iter().map(|(m, e, _)| (*m, e.size_bytes)).collect();
            self.dead_lettered(settled, false);
            return;
        };
        // The messages are in `limbo`: their payloads stay where they are (relocation, purge
        // and prefix removal leave them) until their SETTLE is applied, so the task reads them
        // on the blocking pool while the owner goes on.
        let wanted: Vec<(u64, u64)> = entries
            .iter()
            .map(|(m, _, _)| (*m, self.state.payload_offset(*m)))
            .collect();
        let runs = self.plan_runs(&wanted);
        let commands = self.commands.clone();
        let queue = self.ctx.queue.clone();
        let figures = self.figures.clone();
        tokio::spawn(async move {
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
            let mut messages = Vec::with_capacity(entries.len());
            let mut settled = Vec::with_capacity(entries.len());
            let mut unread = Vec::new();
            let mut payloads = match read {
                Ok(read) => {
                    if let Some(error) = &read.error {
                        tracing::error!(%queue, %error, "cannot read messages to dead-letter them");
                    }
                    read.payloads.into_iter()
                }
                Err(error) => {
                    tracing::error!(%queue, %error, "cannot read messages to dead-letter them");
                    Vec::new().into_iter()
                }
            };
            for (m, entry, reason) in entries {
                let message = payloads
                    .next()
                    .filter(|(id, _, _)| *id == m)
                    .and_then(|(_, _, payload)| Message::decode(&payload, m).ok());
                let Some(mut message) = message else {
                    unread.push(m);
                    continue;
                };
                message
                    .headers
                    .push(("x-death-reason".into(), reason.as_str().into()));
                message
                    .headers
                    .push(("x-death-queue".into(), queue.clone()));
                message
                    .headers
                    .push(("x-death-count".into(), entry.delivery_count.to_string()));
                messages.push(message);
                settled.push((m, entry.size_bytes));
            }
            let delivered = if messages.is_empty() {
                true
            } else {
                let results = sink.publish(&target, messages).await;
                figures.count_dead_letter_failures(&results);
                let delivered = results.iter().all(Result::is_ok);
                if !delivered {
                    tracing::warn!(%queue, dead_letter = %target, "dead-lettering failed; the messages are dropped");
                }
                delivered
            };
            let _ = commands.send(Command::DeadLettered {
                entries: settled,
                delivered,
                unread,
            });
        });
    }

    /// Messages whose payload could not be read for dead-lettering are ready again.
    pub(super) fn not_dead_lettered(&mut self, unread: Vec<u64>) {
        for m in unread {
            self.delivery.limbo.remove(&m);
            self.undrop(m);
            self.delivery.redeliver.insert(m);
        }
    }

    pub(super) fn dead_lettered(&mut self, entries: Vec<(u64, u32)>, delivered: bool) {
        let outcome = if delivered {
            Outcome::DeadLettered
        } else {
            Outcome::Dropped
        };
        let settled: Vec<Settled> = entries
            .into_iter()
            .map(|(message, size_bytes)| Settled {
                message,
                size_bytes,
                outcome,
            })
            .collect();
        if settled.is_empty() {
            return;
        }
        self.write_settles(settled);
    }

    pub(super) fn purge(&mut self, reply: oneshot::Sender<BrokerResult<u64>>) {
        if !self.role.leading {
            let _ = reply.send(Err(self.not_leader()));
            return;
        }
        // A purge frees space: a stopped log does it without a write, or heals first.
        let reply = match self.stopped {
            Some(_) => match self.purge_stopped(reply) {
                Some(reply) => reply,
                None => return,
            },
            None => reply,
        };
        // Inflight and leaving messages stay. Only live ones count: an entry of a message
        // that is no longer live would make the totals disagree with the ranges.
        let busy: BTreeSet<u64> = self
            .delivery
            .inflight
            .keys()
            .chain(self.delivery.limbo.keys())
            .copied()
            .filter(|m| self.state.is_live(*m))
            .collect();
        let busy_bytes: u64 = self
            .delivery
            .inflight
            .iter()
            .map(|(m, e)| (m, e.size_bytes))
            .chain(self.delivery.limbo.iter().map(|(m, s)| (m, *s)))
            .filter(|(m, _)| self.state.is_live(**m))
            .map(|(_, s)| u64::from(s))
            .sum();
        let ready_bytes = self.state.live_bytes().saturating_sub(busy_bytes);
        let live_ranges = self.state.live_ranges(0, self.state.head());
        let plan = prepare::purge(live_ranges, &busy, ready_bytes);
        // The ranges are authoritative (a count taken from them cannot underflow); a live count
        // that disagrees is a bug in the state machine, caught in debug builds.
        debug_assert_eq!(
            plan.count + busy.len() as u64,
            self.state.live_count(),
            "the live count disagrees with the live ranges"
        );
        if plan.count == 0 {
            let _ = reply.send(Ok(0));
            return;
        }
        self.purging_count += plan.count;
        self.purging_bytes += plan.bytes;
        let last = plan.records.len().saturating_sub(1);
        let mut reply = Some(reply);
        // Counted once: the last record's answer (or failure) ends the purge.
        self.purges += 1;
        for (i, record) in plan.records.into_iter().enumerate() {
            let payload = record.encode();
            let done = match (i == last, reply.take()) {
                (true, Some(reply)) => Done::Purge(reply, plan.count),
                (_, other) => {
                    reply = other;
                    Done::Internal
                }
            };
            self.append(vec![record], vec![payload], done);
        }
    }
}
