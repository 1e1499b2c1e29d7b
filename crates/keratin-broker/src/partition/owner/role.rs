//! Leading and following: on a replicated log only the leader's owner proposes records and
//! delivers; a follower's owner applies what the leader committed (`follow.rs`) and answers
//! publishes and purges with [`BrokerError::NotLeader`] naming the leader. A local log always
//! leads (it never sends a role).
//!
//! When this node stops leading, what only a leader has goes: its consumers are ended with the
//! new leader's address (they subscribe again there), its inflight bookkeeping is dropped (the
//! new leader delivers those messages again, flagged `redelivered`), and publishes held back by
//! slowing are answered "not the leader". Proposals already in the log are failed by the log
//! itself. When it starts leading, delivery starts from the oldest live message, and every
//! message below the leadership's first offset is flagged `redelivered`.

use super::*;

impl Owner {
    /// The refusal of a request only the leader serves.
    pub(super) fn not_leader(&self) -> BrokerError {
        self.role.not_leader(&self.ctx.queue, self.ctx.index)
    }

    /// The log reported a role.
    pub(super) fn role_changed(&mut self, role: Role) {
        let was_leading = self.role.leading;
        tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, leading = role.leading, leader = ?role.leader, "partition role");
        self.role = role;
        self.figures.set_role(self.role.clone());
        if was_leading && !self.role.leading {
            self.step_down();
        } else if self.role.leading {
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

    /// This node leads from `role.from` on: deliver every live message again, from the oldest.
    fn take_over(&mut self) {
        self.reset_delivery();
        self.delivery.taken_over_at = self.role.from;
    }

    /// Forget inflight, returns, the cursor and read-ahead; consumers stay.
    fn reset_delivery(&mut self) {
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
