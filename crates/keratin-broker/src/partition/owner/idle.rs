//! The idle hand-back: a partition that holds nothing (no live message, nothing inflight or
//! being settled, purged or relocated, nothing waiting for the log) and saw no append for
//! `idle_release_after` hands its log's segments back to the node's pool, so that an idle
//! queue costs almost no disk. The log keeps its next offset (in a durable anchor); the next
//! append creates a segment there.
//!
//! Why a racing append is safe: the hand-back is a request in the log's queue like an append.
//! An append made after it is queued behind it, gets the next offset, and creates the segment
//! the hand-back left out; one made before it is durable before the hand-back runs (the log
//! hands back only segments whose records are all durable). The owner only forgets offsets
//! below the log's start once the hand-back answers, which it does in every order with the
//! append's answer (`forget_below` of the log's start, which never passes a live payload: the
//! records appended meanwhile lie at or above it).

use super::*;

impl Owner {
    /// True when the partition holds nothing that needs its log's records, and nothing is on
    /// its way to or from the log.
    fn holds_nothing(&self) -> bool {
        self.state.live_count() == 0
            && self.delivery.is_quiet()
            && self.dropping.is_empty()
            && self.driver.is_idle()
            && self.backlog.is_empty()
            && self.appending.is_none()
            && self.acks.is_empty()
            && self.delayed.is_empty()
            && self.purges == 0
            && self.reserved_count == 0
            && !self.reclaim_busy
            && self.driver.stopped().is_none()
            && self.log_job.is_none()
            && !self.following
            && self.driver.committed_up_to() <= self.state.head()
    }

    /// When the idle hand-back is due, if the partition is idle and has not handed back yet.
    pub(super) fn idle_at(&self) -> Option<Instant> {
        if self.handed_back || self.handing_back || self.log.is_none() || !self.holds_nothing() {
            return None;
        }
        Some(self.last_append + self.ctx.idle_release_after)
    }

    /// Hand the log's segments back to the pool once the partition has been idle long enough.
    pub(super) fn maybe_hand_back(&mut self) {
        let Some(at) = self.idle_at() else {
            return;
        };
        if at > Instant::now() {
            return;
        }
        let Some(log) = self.log.as_ref() else {
            return;
        };
        // Nothing to give back: mark the idle period handled.
        if log.disk_bytes() == 0 {
            self.handed_back = true;
            return;
        }
        match log.hand_back() {
            Ok(ticket) => {
                tracing::debug!(queue = %self.ctx.queue, partition = self.ctx.index, "idle: handing the log's segments back to the pool");
                self.handing_back = true;
                self.handed_back = true;
                // Readers hold the files being handed back.
                self.delivery.forget_reader();
                let commands = self.commands.clone();
                tokio::spawn(async move {
                    let result = ticket.await;
                    let _ = commands.send(Command::HandedBack { result });
                });
            }
            Err(error) => {
                if error.is_stopped() {
                    self.stop(error);
                } else {
                    // Try again after another idle period, not on the next round (the timer
                    // would fire at once and spin).
                    self.last_append = Instant::now();
                    tracing::warn!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "idle hand-back refused");
                }
            }
        }
    }

    /// The hand-back answered: offsets below the log's start are gone from the log.
    pub(super) fn handed_back(&mut self, result: LogResult<PrefixRemoval>) {
        self.handing_back = false;
        match result {
            Ok(removed) => {
                if let Some(log) = &self.log {
                    self.state.forget_below(log.start_offset());
                    // No record below the log's start is left: the windows only such records
                    // held go, unless a `PRODUCERS` record at or above it holds them all.
                    self.state.forget_producers_below(log.start_offset());
                    self.state_check_due = true;
                }
                tracing::debug!(queue = %self.ctx.queue, partition = self.ctx.index, segments = removed.segments, bytes = removed.bytes, "idle log handed back");
            }
            Err(error) => {
                tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "idle hand-back failed");
                if error.is_stopped() {
                    self.stop(error);
                }
            }
        }
    }
}
