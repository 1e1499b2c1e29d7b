//! Keeping the log small and the partition writable: prefix removal below the lowest live
//! payload, relocation of old live messages, and healing a log stopped by a write error.

use super::*;

/// Space reclaim waits for a `PRODUCERS` record below the lowest live payload while the last
/// one lies fewer segments below it than this; the leader writes one per segment, so it lags
/// by one segment at most while it can write them.
const CHECKPOINT_LAG_SEGMENTS_MAX: usize = 4;

impl Owner {
    /// Heal a log stopped by a write error once its file system has room again, or at reserve
    /// once what it writes next fits (see `stopped.rs`).
    pub(super) fn maybe_heal(&mut self) {
        if !self.driver.is_idle() || !self.driver.heal_due(Instant::now()) {
            return;
        }
        if !self.may_heal_now() {
            return;
        }
        self.heal_now();
    }

    /// Heal the stopped log, then rebuild the state from the log, as at open (a job on the
    /// blocking pool: both read and sync files). Healing cuts the log back to its last durable
    /// offset; a group that was durable but answered as failed (a write failed after its sync)
    /// stays in the log without having been applied, so only a rebuild makes the state equal
    /// the log again (else every later record would be refused as out of order). A partition
    /// stopped because its state fell out of step with a running log heals the same way
    /// (`Log::heal` does nothing on a running log). The partition stays stopped (appends are
    /// refused) until the job's answer is taken in `heal_done`.
    pub(super) fn heal_now(&mut self) {
        let started = self.start_log_job(|log| {
            let healed = log
                .heal()
                .map_err(BrokerError::from)
                .and_then(|()| rebuild(log.as_ref(), None));
            JobDone::Healed(healed)
        });
        if started {
            self.driver.heal_started();
        }
    }

    /// A heal job returned.
    pub(super) fn heal_done(&mut self, healed: BrokerResult<PartitionState>) {
        match healed {
            // Nothing was appended while stopped, so nothing is pending.
            Ok(state) if self.driver.stopped().is_some() && self.driver.is_idle() => {
                self.rebuilt(state);
                self.healed();
            }
            // Not taken (appends pending): heal again after the pause.
            Ok(_) => self.driver.heal_done(Err(()), Instant::now()),
            Err(error) => {
                // Its answer woke the owner: without the driver's pause the next heal would
                // start at once.
                self.driver.heal_done(Err(()), Instant::now());
                tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "heal failed; will retry");
            }
        }
    }

    /// A rebuild after the log restarted past the head returned (`follow.rs`).
    pub(super) fn restart_done(&mut self, rebuilt: BrokerResult<PartitionState>) {
        match rebuilt {
            Ok(state) if self.driver.stopped().is_none() && self.driver.is_idle() => {
                tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, start = state.start(), head = state.head(), "state rebuilt from the log (after a snapshot from the leader, or to recount a purge)");
                self.rebuilt(state);
            }
            // Stopped or proposing meanwhile: the next follow looks again.
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "rebuild from the log failed");
                self.stop(LogError::Invalid(format!(
                    "rebuilding the partition from its log (after a snapshot from the leader, or to recount a purge) failed: {error}"
                )));
            }
        }
    }

    /// Take the state rebuilt from the log. Nothing is pending (a heal waits for that), so the
    /// rebuilt state only adds what the log holds beyond the old one: messages enqueued at or
    /// above the old head (above the delivery cursor, so they are ready in id order) and the
    /// effects of settles, returns and purges whose answers failed. Ready messages those
    /// removed leave `redeliver`; inflight ones stay until their consumer settles them (a
    /// settle of a message that is gone changes nothing).
    fn rebuilt(&mut self, state: PartitionState) {
        assert!(self.driver.is_idle(), "rebuilt with appends pending");
        assert!(
            state.head() >= self.state.head(),
            "the healed log lost applied records"
        );
        self.state = state;
        self.delivery.rebuilt(&self.state);
        self.state_check_due = true;
    }

    /// Free disk: remove whole segments below every live payload, and move the few old live
    /// messages that pin mostly dead segments to the head, so that disk use stays within
    /// 2 × live bytes + 2 segments whatever the ack pattern.
    pub(super) fn maybe_reclaim(&mut self) {
        // A pending purge settles messages the state still shows live: relocation waits for it.
        if self.reclaim_busy
            || !self.reclaim_due
            || self.driver.stopped().is_some()
            || self.purges > 0
        {
            return;
        }
        self.reclaim_due = false;
        let Some(log) = self.log.as_ref() else {
            return;
        };
        let space = log.space();
        let bases = &space.segment_bases;
        let pin = self.state.pinned_offset();
        if bases.len() >= 2 && bases[1] <= pin {
            let Some(cut) = self.reclaim_cut(pin, bases) else {
                // The producers' windows have no record to rebuild from yet below the pin:
                // the leader writes one per segment (`checkpoint.rs`); applying it asks again.
                return;
            };
            if bases[1] > cut {
                return;
            }
            match log.remove_prefix(cut) {
                Ok(ticket) => {
                    self.reclaim_busy = true;
                    let commands = self.commands.clone();
                    tokio::spawn(async move {
                        let result = ticket.await;
                        let _ = commands.send(Command::PrefixRemoved { result });
                    });
                }
                Err(error) => self.stop(error),
            }
            return;
        }
        let bound = 2 * self.state.live_bytes() + 2 * self.ctx.segment_size_bytes;
        // Relocation writes records: the leader's to do.
        if self.driver.role().leading
            && space.disk_bytes > bound
            && bases.len() > 2
            && self.relocation_fits()
        {
            let first = (bases[0], bases[1]);
            self.relocate(first);
        }
    }

    /// Where to cut the log below `pin` (the lowest live payload) so that the producers'
    /// windows survive (`PartitionState::window_cut`); `None` to wait for a `PRODUCERS` record.
    /// When the last one lies [`CHECKPOINT_LAG_SEGMENTS_MAX`] segments or more below the pin
    /// (none can be written: a window too large for a record, a leader that writes none),
    /// the log is cut at the pin all the same and the windows of what lies below are forgotten
    /// at the next rebuild: a late retry may be stored twice, but the disk never fills for it.
    fn reclaim_cut(&self, pin: u64, bases: &[u64]) -> Option<u64> {
        let cut = self.state.window_cut(pin);
        let from = cut.unwrap_or(self.state.start());
        let lag = bases
            .iter()
            .filter(|base| **base > from && **base <= pin)
            .count();
        if lag < CHECKPOINT_LAG_SEGMENTS_MAX {
            return cut;
        }
        tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, pin, last_producers_record = ?cut, "no PRODUCERS record for {lag} segments below the lowest live message: reclaiming there; a restart forgets the producers' windows of what goes");
        Some(pin)
    }

    /// Copy the live payloads stored in `[start, end)` to the head of the log.
    pub(super) fn relocate(&mut self, (start, end): (u64, u64)) {
        let mut ids: Vec<u64> = self
            .state
            .live_ranges(start, end)
            .into_iter()
            .flat_map(|(s, e)| s..e)
            .filter(|id| self.state.payload_offset(*id) == *id)
            .take(1 << 16)
            .collect();
        ids.extend(self.state.relocated_payloads_in(start, end));
        // A message whose settle is being written is leaving: a copy written after its SETTLE
        // record would bring it back (found by the adversarial space test: acked messages were
        // delivered again).
        // (Acks waiting for this round's SETTLE record are in `limbo` too.)
        ids.retain(|id| !self.delivery.limbo.contains_key(id));
        ids.sort_unstable();
        let wanted: Vec<(u64, u64)> = ids
            .into_iter()
            .map(|id| (id, self.state.payload_offset(id)))
            .collect();
        self.start_relocation_read(wanted);
    }

    pub(super) fn prefix_removed(&mut self, result: LogResult<PrefixRemoval>) {
        self.reclaim_busy = false;
        match result {
            Ok(removed) => {
                if let Some(log) = &self.log {
                    self.state.forget_below(log.start_offset());
                }
                if removed.segments > 0 {
                    self.reclaim_due = true;
                }
            }
            Err(error) => {
                tracing::error!(queue = %self.ctx.queue, %error, "space reclaim failed");
                self.stop(error);
            }
        }
    }
}
