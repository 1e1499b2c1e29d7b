//! How messages leave or come back: acks (one round's acks in few SETTLE records), rejects,
//! returns of a lost consumer's deliveries, and purge; what is dead-lettered goes on to
//! `dead_letter.rs`.

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
                Some(false) => dead.push(Dying {
                    message: m,
                    entry,
                    reason: DeathReason::Rejected,
                }),
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
        dead: &mut Vec<Dying>,
    ) {
        let exhausted = self
            .ctx
            .settings
            .max_deliveries
            .is_some_and(|max| entry.delivery_count >= max);
        if exhausted {
            dead.push(Dying {
                message: m,
                entry,
                reason: DeathReason::MaxDeliveries,
            });
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

    pub(super) fn purge(&mut self, reply: oneshot::Sender<BrokerResult<u64>>) {
        if !self.driver.role().leading {
            let _ = reply.send(Err(self.not_leader()));
            return;
        }
        // A purge frees space: a stopped log does it without a write, or heals first.
        let reply = match self.driver.stopped() {
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

#[cfg(test)]
mod tests {
    //! A leader whose log refuses an ack's SETTLE while the owner still takes itself for the
    //! leader (openraft refuses writes during a leadership transfer and while its lease has
    //! lapsed, before the role change reaches the owner): the acked message is ready again,
    //! and its next delivery must say it was delivered before. Fails if it comes back as new
    //! (`redelivered` false, delivery count 1): a consumer then takes a message it acked for
    //! one it never saw.

    use std::sync::Arc;
    use std::time::Duration;

    use crate::error::{BrokerError, BrokerResult};
    use crate::partition::log::{PartitionLog, PartitionLogs, PartitionPlace, Role};
    use crate::partition::mem_log::MemLog;
    use crate::record::Message;
    use crate::{Broker, BrokerConfig, QueueSettings};

    /// Every replicated partition of the test's broker is the one `MemLog`.
    struct OneLog(Arc<MemLog>);

    impl PartitionLogs for OneLog {
        fn open(&self, _place: &PartitionPlace) -> BrokerResult<Arc<dyn PartitionLog>> {
            Ok(self.0.clone())
        }
    }

    #[tokio::test]
    async fn an_acked_message_whose_settle_the_log_refuses_comes_again_flagged_redelivered() {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = Arc::new(MemLog::default());
        let mut config = BrokerConfig::new(vec![dir.path().join("data")]);
        config.pool_background = false;
        config.partition_logs = Some(Arc::new(OneLog(log.clone())));
        let broker = Broker::open(config).await.expect("broker opens");
        broker
            .declare_replicated(7, "q", QueueSettings::default(), vec![vec![1, 2, 3]])
            .await
            .expect("declared");
        // This node leads from offset 0: a message published now is one it alone delivered.
        log.set_role(Role {
            leading: true,
            leader: Some(1),
            addr: None,
            from: 0,
        });
        let published = broker.publish("q", vec![Message::new("m")]).await;
        assert!(published.iter().all(Result::is_ok), "{published:?}");
        let mut consumer = broker.subscribe("q", 10).expect("subscribed");
        let within = Duration::from_secs(5);
        let first = tokio::time::timeout(within, consumer.recv())
            .await
            .expect("delivered within 5 s")
            .expect("consumer open");
        assert!(!first.redelivered);
        assert_eq!(first.delivery_count, 1);
        log.hold_proposals();
        consumer.ack(&[first.tag]);
        let deadline = tokio::time::Instant::now() + within;
        while log.held_count() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the ack's SETTLE was never proposed"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The log refuses it (nothing written), the owner's role unchanged.
        log.settle_held(Some(BrokerError::NotLeader {
            queue: "q".into(),
            partition: 0,
            leader: None,
            addr: None,
        }));
        let again = tokio::time::timeout(within, consumer.recv())
            .await
            .expect("the message whose settle was refused is delivered again within 5 s")
            .expect("consumer open");
        assert_eq!(again.tag, first.tag);
        assert!(
            again.redelivered && again.delivery_count == 2,
            "an acked message came again as new: redelivered {}, delivery count {}",
            again.redelivered,
            again.delivery_count
        );
    }
}
