//! Leading and following: on a replicated log only the leader's owner proposes records and
//! delivers; a follower's owner applies what the leader committed (`follow.rs`) and answers
//! publishes and purges with [`BrokerError::NotLeader`] naming the leader. A local log always
//! leads (it never sends a role).
//!
//! When this node stops leading, what only a leader has goes: its consumers are ended with the
//! new leader's address (they subscribe again there), its inflight bookkeeping is dropped (the
//! new leader delivers those messages again, flagged `redelivered`), and publishes held back by
//! slowing are answered "not the leader". Proposals already in the log are answered by the log
//! when their fate is known (committed by the next leader, or cut: "not the leader"); a
//! publish whose fate is not known within the driver's step-down grace (a leader cut off from the
//! others learns nothing until the cut heals) is answered [`BrokerError::LeadershipLost`]
//! (outcome unknown, 504) then, and its proposal stays in the log's hands, like one past its
//! publish timeout. When it starts leading, delivery starts from the oldest live message, and every
//! message below the leadership's first offset is flagged `redelivered`; it starts only once the
//! state applied every record below that offset (its predecessors' settles included) and while
//! the log's delivery lease holds (`delivery.rs`).

use super::*;
use crate::partition::log::is_storage_failure;

impl Owner {
    /// The refusal of a request only the leader serves.
    pub(super) fn not_leader(&self) -> BrokerError {
        self.driver
            .role()
            .not_leader(&self.ctx.queue, self.ctx.index)
    }

    /// The log reported a role.
    pub(super) fn role_changed(&mut self, role: Role) {
        tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, leading = role.leading, leader = ?role.leader, "partition role");
        let before = self.driver.set_role(role, Instant::now());
        self.figures.set_role(self.driver.role().clone());
        if before.leading && !self.driver.role().leading {
            self.step_down();
        } else if self.driver.role().leading {
            self.take_over();
        }
    }

    /// This node no longer leads: drop the leader's bookkeeping (see the module docs).
    fn step_down(&mut self) {
        let reason = self.not_leader();
        for link in std::mem::take(&mut self.delivery.consumers) {
            link.end(reason.clone());
        }
        for delayed in std::mem::take(&mut self.delayed) {
            let _ = delayed.reply.send(Err(reason.clone()));
        }
        self.acks.clear();
        self.reset_delivery();
    }

    /// This node's copy of the partition is being replaced (it moved: `Command::Replace`):
    /// every publish and purge still waiting is answered now, since this owner ends without
    /// answering them otherwise. Those in the log whose fate is not known are answered as
    /// [`BrokerError::LeadershipLost`] (they may be committed: an idempotent producer's retry
    /// is stored once), those held back by slowing as "not the leader" (never proposed).
    pub(super) fn answer_moved(&mut self) {
        let lost = BrokerError::LeadershipLost {
            queue: self.ctx.queue.clone(),
            partition: self.ctx.index,
            why: "this node's copy of the partition moved to other nodes".to_string(),
        };
        for pending in self.driver.pending_mut() {
            // An outcome known but not answered yet (an earlier append is still out) is told
            // as it is: durable is confirmed, refused is refused.
            let outcome = match &pending.outcome {
                Some(Ok(range)) => Ok(range.clone()),
                Some(Err(error)) if !is_storage_failure(error) => Err(error.clone()),
                Some(Err(_)) | None => Err(lost.clone()),
            };
            match std::mem::replace(&mut pending.item.done, Done::Internal) {
                Done::Publish(reply) => {
                    let _ = reply.send(outcome);
                }
                Done::Purge(reply, count) => {
                    let _ = reply.send(outcome.map(|_| count));
                }
                Done::Internal => {}
            }
        }
        let refusal = self.not_leader();
        for delayed in std::mem::take(&mut self.delayed) {
            let _ = delayed.reply.send(Err(refusal.clone()));
        }
    }

    /// This node leads from `role.from` on: deliver every live message again, from the oldest.
    /// Below `role.from` an earlier leader may have delivered them; below the head this owner
    /// started at (kept in `taken_over_at`), this node may have, before a restart or through
    /// the owner this one replaced, while leading the same term.
    fn take_over(&mut self) {
        self.reset_delivery();
        self.delivery.taken_over_at = self.driver.role().from.max(self.delivery.taken_over_at);
    }

    /// Forget inflight, returns, the cursor and read-ahead; consumers stay.
    fn reset_delivery(&mut self) {
        self.forget_dead_letters();
        let consumers = std::mem::take(&mut self.delivery.consumers);
        let epoch = self.delivery.reader_epoch + 1;
        let taken_over_at = self.delivery.taken_over_at;
        self.delivery = DeliveryState {
            consumers,
            reader_epoch: epoch,
            cursor: self.state.start(),
            taken_over_at,
            ..DeliveryState::default()
        };
    }
}
