//! What a partition whose log stopped can still do to free space, at every disk level: when
//! it may heal at reserve, and a purge that needs no write at all.
//!
//! Healing itself needs no free space: recovery reads, renames and removes, and the cut of the
//! unsynced tail writes inside the tail segment's allocated part. What matters is what the
//! partition writes after the heal. At reserve the gate refuses publishes, so that is acks,
//! returns, purges and prefix removal: control records of at most [`CONTROL_RECORD_BYTES_MAX`]
//! bytes. They fit if the tail segment's allocated room (`Log::tail_room_bytes`: segments grow
//! in preallocation steps, and a step needs space as a new segment does) still holds one
//! control record, or if the file system holds a new segment (the reserve is the space kept
//! for exactly these writes). Either way a heal at reserve ends in a running log or in a stop that leaves
//! less than that room, so it cannot turn into a stop-heal loop driven by control records.
//! Relocation, which copies payloads and so needs space to free space, waits at reserve until a
//! segment fits ([`Owner::relocation_fits`]).

use super::*;

use crate::partition::prepare::CONTROL_RECORD_BYTES_MAX;

impl Owner {
    /// Whether a stopped log may be healed now: the gate says its file system is back above
    /// reserve, or (at reserve) what the partition writes next fits without taking space the
    /// file system does not have (see the module docs).
    pub(super) fn may_heal_now(&self) -> bool {
        self.room_for_a_segment() || self.tail_room_bytes() >= CONTROL_RECORD_BYTES_MAX
    }

    /// Whether relocation may copy live messages to the head now. It needs space to free
    /// space: at reserve without room for a new segment, a copy that does not fit the tail
    /// segment would stop the log again, and then acks could not be written either (found by
    /// the purge-with-a-delivery-out test at reserve). It waits until the reserve holds a
    /// segment; prefix removal, which only frees, goes on.
    pub(super) fn relocation_fits(&self) -> bool {
        self.room_for_a_segment() || self.tail_room_bytes() >= RELOCATE_BATCH_BYTES as u64 + 4096
    }

    /// The gate says the file system is above reserve, or that it holds a new segment.
    fn room_for_a_segment(&self) -> bool {
        self.ctx.gate.may_heal(self.ctx.device)
            || self
                .ctx
                .gate
                .free_bytes(self.ctx.device)
                .is_some_and(|free| free >= self.ctx.segment_size_bytes)
    }

    /// Bytes an append can still write into the log's tail segment without allocating (its
    /// allocated, unwritten part: segments grow in preallocation steps, and a step needs
    /// space like a new segment does).
    fn tail_room_bytes(&self) -> u64 {
        self.log.as_ref().map_or(0, |log| log.tail_room_bytes())
    }

    /// A purge asked of a stopped log. Returns the reply when the ordinary purge (a PURGE
    /// record) must go on: the log healed. Otherwise answers it, now or after a job:
    /// - a job holds the log (a heal, a state check): the purge waits for it;
    /// - every live message is ready (none is delivered or being settled): the purge leaves
    ///   nothing, so the log is deleted whole and a fresh one starts, with no record written
    ///   (see [`Owner::purge_by_reset`]);
    /// - else the log is healed at once, whatever the level (a heal needs no space), and the
    ///   purge runs again after it; the PURGE record then fits unless the tail segment is full
    ///   and the file system too, in which case the purge fails as unavailable.
    pub(super) fn purge_stopped(
        &mut self,
        reply: oneshot::Sender<BrokerResult<u64>>,
    ) -> Option<oneshot::Sender<BrokerResult<u64>>> {
        let stop = self.stop_error()?;
        if !self.driver.is_idle() {
            let _ = reply.send(Err(self.unavailable(stop)));
            return None;
        }
        if self.log_job.is_some() {
            self.deferred_purges.push(reply);
            return None;
        }
        if self.delivery.inflight.is_empty()
            && self.delivery.limbo.is_empty()
            && self.acks.is_empty()
        {
            self.purge_by_reset(reply);
            return None;
        }
        // A heal needs no space: heal whatever the level.
        self.heal_now();
        self.deferred_purges.push(reply);
        None
    }

    /// The log healed: appends resume, readers start over, reclaim looks again.
    pub(super) fn healed(&mut self) {
        tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, "log healed; writes resume");
        self.driver.heal_done(Ok(()), Instant::now());
        self.figures.heals.fetch_add(1, Ordering::Relaxed);
        self.delivery.forget_reader();
        self.reclaim_busy = false;
        self.reclaim_due = true;
        // A trim skipped while stopped (or a drop whose SETTLE failed) is owed still.
        self.trim_due = true;
    }

    /// Purge a stopped log that holds no delivered message: delete the log (its segments go to
    /// the pool, or are removed over its budget; no write needs new space) and open a fresh,
    /// empty one in the same directory, which takes a spare the deletion just made (or the
    /// space it freed), as a job on the blocking pool. Message ids start again at 0: nothing
    /// refers to the old ones, since no message was delivered and unsettled. A crash part way
    /// leaves a shorter log (segments go highest first) or an empty one: at worst some purged
    /// messages come back, as when a crash interrupts a purge written as several records;
    /// nothing is answered before the fresh log is open. Until then the partition has no log:
    /// its requests fail as closed or unavailable.
    fn purge_by_reset(&mut self, reply: oneshot::Sender<BrokerResult<u64>>) {
        let count = self.state.live_count();
        // The broker is going away: no new log.
        if self.ctx.broker.upgrade().is_none() {
            let _ = reply.send(Err(BrokerError::Closed(format!(
                "queue {:?}",
                self.ctx.queue
            ))));
            return;
        }
        let Some(log) = self.log.take() else {
            let _ = reply.send(Err(BrokerError::Closed(format!(
                "queue {:?}",
                self.ctx.queue
            ))));
            return;
        };
        self.delivery.forget_reader();
        let commands = self.commands.clone();
        self.log_job = Some(tokio::task::spawn_blocking(move || {
            let (log, result) = log.reset();
            let _ = commands.send(Command::JobDone(JobDone::Reset {
                log,
                result,
                count,
                reply,
            }));
        }));
    }

    /// A reset job returned.
    pub(super) fn reset_done(
        &mut self,
        log: Option<Arc<dyn PartitionLog>>,
        result: BrokerResult<()>,
        count: u64,
        reply: oneshot::Sender<BrokerResult<u64>>,
    ) {
        self.log = log;
        match result {
            Ok(()) => {
                self.state = PartitionState::new(0);
                self.driver.reset_committed(0);
                self.delivery.reset();
                self.dropping.clear();
                self.dropping_bytes = 0;
                self.disk_bytes = 0;
                self.healed();
                self.publish_figures();
                tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, count, "stopped partition purged by replacing its log");
                let _ = reply.send(Ok(count));
            }
            Err(error) => {
                tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "purging a stopped partition failed");
                self.publish_figures();
                let _ = reply.send(Err(error));
            }
        }
    }
}
