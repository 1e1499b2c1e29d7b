//! The owner's blocking work, on tokio's blocking pool: payload reads (deliveries, relocation,
//! dead-lettering), and the jobs that hold the log itself (heal and the rebuild after it, the
//! reset of a stopped log, the state check against the log), at most one at a time. Each
//! answers with a command; the owner acts on the answer only if it still applies. Closing and
//! deleting the log end the owner: it waits for its jobs, then closes off the workers.

use keratin_log::ReadRecord;

use super::*;

/// One reader and the payloads it reads, in order, each at or a little past the previous one.
pub(crate) struct Run {
    reader: BoxReader,
    /// (message id, offset of its payload record).
    items: Vec<(u64, u64)>,
}

/// What [`read_runs`] read.
pub(crate) struct RunsRead {
    /// The last reader, to read on from where it stopped.
    pub(super) reader: Option<BoxReader>,
    /// (message id, payload offset, payload), in the order asked.
    pub(super) payloads: Vec<(u64, u64, Vec<u8>)>,
    /// Why reading stopped before the end, if it did.
    pub(super) error: Option<BrokerError>,
}

/// What a relocation read job returns.
pub(crate) struct RelocationRead {
    epoch: u64,
    payloads: Vec<(u64, u64, Vec<u8>)>,
    failed: bool,
    /// The round's share of the node's relocation budget, given back once the copies are
    /// handed to the log (or dropped).
    _permit: crate::byte_budget::BytePermit,
}

/// What a job holding the log returns.
pub(crate) enum JobDone {
    /// A heal, then a rebuild of the state from the healed log.
    Healed(BrokerResult<PartitionState>),
    /// A rebuild of the state from a replicated log that restarted past the state's head (a
    /// snapshot installed from the leader), or to recount a purge's bytes: see `follow.rs`.
    Restarted(BrokerResult<PartitionState>),
    /// A stopped log that held no delivered message was replaced by an empty one.
    Reset {
        /// The fresh log, or the old one if it could not be taken, or none.
        log: Option<Arc<dyn PartitionLog>>,
        result: BrokerResult<()>,
        count: u64,
        reply: oneshot::Sender<BrokerResult<u64>>,
    },
}

pub(super) fn corrupt(at: u64, reason: String) -> BrokerError {
    BrokerError::Corrupt {
        what: "partition",
        offset: at,
        reason,
    }
}

/// The message payload a record holds: an ENQUEUE's payload or a RELOCATE's copy.
pub(super) fn payload_of(record: ReadRecord, at: u64) -> BrokerResult<Vec<u8>> {
    match record.record_type {
        ENQUEUE => Ok(record.payload),
        RELOCATE => match PartitionRecord::decode(RELOCATE, &record.payload, at)? {
            PartitionRecord::Relocate(relocate) => Ok(relocate.payload),
            _ => Err(corrupt(at, "relocation expected".into())),
        },
        other => Err(corrupt(at, format!("record type {other} holds no message"))),
    }
}

/// Read the payloads of `runs` (blocking), until `max_bytes` are read (at least one payload).
pub(super) fn read_runs(runs: Vec<Run>, max_bytes: usize) -> RunsRead {
    let mut out = RunsRead {
        reader: None,
        payloads: Vec::new(),
        error: None,
    };
    let mut bytes = 0usize;
    'runs: for Run { mut reader, items } in runs {
        for (id, at) in items {
            if bytes >= max_bytes {
                out.reader = Some(reader);
                break 'runs;
            }
            match read_at(&mut reader, at) {
                Ok(payload) => {
                    bytes += payload.len();
                    out.payloads.push((id, at, payload));
                }
                Err(error) => {
                    out.error = Some(error);
                    break 'runs;
                }
            }
        }
        out.reader = Some(reader);
    }
    out
}

/// Step `reader` to `at` (at or after its position) and read the payload there.
fn read_at(reader: &mut BoxReader, at: u64) -> BrokerResult<Vec<u8>> {
    while reader.next_offset() < at {
        match reader.next() {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(BrokerError::Log(e)),
            None => return Err(corrupt(at, "live message past the durable end".into())),
        }
    }
    if reader.next_offset() != at {
        return Err(corrupt(at, "reader past the payload".into()));
    }
    match reader.next() {
        Some(Ok(record)) => payload_of(record, at),
        Some(Err(e)) => Err(BrokerError::Log(e)),
        None => Err(corrupt(at, "live message past the durable end".into())),
    }
}

impl Owner {
    /// Readers for payloads at `wanted` (id, offset): the cached reader when the first lies a
    /// little ahead of it (a fresh reader reads a whole chunk), and a new reader wherever the
    /// next payload lies behind or far ahead of the previous one.
    pub(super) fn plan_runs(&mut self, wanted: &[(u64, u64)]) -> Option<Vec<Run>> {
        let log = self.log.clone()?;
        let mut runs: Vec<Run> = Vec::new();
        let mut cached = self.delivery.reader.take();
        for &(id, at) in wanted {
            if let Some(run) = runs.last_mut() {
                let last = run.items.last().map_or(0, |(_, at)| *at);
                if at > last && at - last <= READER_SKIP_MAX {
                    run.items.push((id, at));
                    continue;
                }
            }
            let reader = match cached.take() {
                Some(reader)
                    if at
                        .checked_sub(reader.next_offset())
                        .is_some_and(|gap| gap <= READER_SKIP_MAX) =>
                {
                    reader
                }
                _ => log.reader(at),
            };
            runs.push(Run {
                reader,
                items: vec![(id, at)],
            });
        }
        (!runs.is_empty()).then_some(runs)
    }

    /// Read payloads for relocation on the blocking pool; `relocation_read` writes the copies.
    /// The round's bytes come from the node's relocation budget first; when other partitions'
    /// rounds hold it, reclaim waits for their release's kick and looks again.
    pub(super) fn start_relocation_read(&mut self, wanted: Vec<(u64, u64)>) {
        if wanted.is_empty() {
            return;
        }
        let Some(budget) = self.ctx.broker.upgrade().map(|b| b.relocation_budget()) else {
            return;
        };
        let Some(permit) = budget.take_or_wait(RELOCATE_BATCH_BYTES as u64, &self.commands) else {
            self.reclaim_due = true;
            return;
        };
        let Some(runs) = self.plan_runs(&wanted) else {
            return;
        };
        // The reader went into the job: reclaim waits until the copies are applied (or failed).
        self.reclaim_busy = true;
        let commands = self.commands.clone();
        let epoch = self.delivery.reader_epoch;
        let queue = self.ctx.queue.clone();
        tokio::task::spawn_blocking(move || {
            let read = read_runs(runs, RELOCATE_BATCH_BYTES);
            if let Some(error) = &read.error {
                tracing::error!(%queue, %error, "cannot read messages to relocate them");
            }
            let _ = commands.send(Command::RelocationRead(RelocationRead {
                epoch,
                payloads: read.payloads,
                failed: read.error.is_some(),
                _permit: permit,
            }));
        });
    }

    /// Payloads to relocate were read: copy those still live where they were read.
    pub(super) fn relocation_read(&mut self, read: RelocationRead) {
        self.reclaim_busy = false;
        // A purge written meanwhile may name these messages (a copy applied after it could
        // bring one back), a heal may have rebuilt the state: reclaim looks again later.
        if read.epoch != self.delivery.reader_epoch
            || self.purges > 0
            || self.driver.stopped().is_some()
        {
            self.reclaim_due = true;
            return;
        }
        let mut records = Vec::new();
        let mut payloads = Vec::new();
        let mut bytes = 0usize;
        for (id, at, payload) in read.payloads {
            // Settled, being settled or dropped meanwhile, or moved: no copy.
            if !self.state.is_live(id)
                || self.delivery.limbo.contains_key(&id)
                || self.state.payload_offset(id) != at
            {
                continue;
            }
            // The durable count travels with the copy: the RETURN records that set it may lie
            // in the segments about to be removed. A RETURN written and not yet applied lies
            // before the copy too, so its count travels as well.
            let pending = self.delivery.counts_pending.get(&id).copied().unwrap_or(0);
            let record = PartitionRecord::Relocate(Relocate {
                message: id,
                delivery_count: self.state.delivery_count(id).max(pending),
                payload,
            });
            let encoded = record.encode();
            bytes += encoded.len();
            records.push(record);
            payloads.push(encoded);
        }
        if records.is_empty() {
            if read.failed {
                tracing::debug!(queue = %self.ctx.queue, "relocation read failed; reclaim tries again later");
            }
            return;
        }
        tracing::debug!(queue = %self.ctx.queue, partition = self.ctx.index, count = records.len(), bytes, "relocating old live messages");
        // Reclaim waits until the copies are applied (or failed); then it runs again.
        self.reclaim_busy = true;
        self.append(records, payloads, Done::Internal);
    }

    /// Run `job` on the blocking pool with the log; its answer comes back as `JobDone`.
    pub(super) fn start_log_job(
        &mut self,
        job: impl FnOnce(Arc<dyn PartitionLog>) -> JobDone + Send + 'static,
    ) -> bool {
        if self.log_job.is_some() {
            return false;
        }
        let Some(log) = self.log.clone() else {
            return false;
        };
        let commands = self.commands.clone();
        self.log_job = Some(tokio::task::spawn_blocking(move || {
            let done = job(log);
            let _ = commands.send(Command::JobDone(done));
        }));
        true
    }

    /// Compare the live state with the state rebuilt from the log, for the debug check (due
    /// after rounds that applied records) and for `CheckState` requests (tests). This reads the
    /// log on the owner's thread, before the next command: the one disk read left on the async
    /// worker, and only in debug builds and tests (release builds never run the debug check).
    /// Running it in place keeps the order of disk calls a function of the commands, as the
    /// fault-injection tests need. Not while a job holds the log (a heal or reset changes it):
    /// a later round checks.
    pub(super) fn run_checks(&mut self) {
        if self.log_job.is_some() {
            return;
        }
        // A state waiting for its recount (see `follow.rs`) is known to be short of bytes: the
        // check waits for the recount.
        let debug = cfg!(debug_assertions)
            && self.state_check_due
            && !self.state.recount_due()
            && self.debug_check_wanted();
        if !debug && self.check_requests.is_empty() {
            return;
        }
        let result = match &self.log {
            None => Err(BrokerError::Closed(format!("queue {:?}", self.ctx.queue))),
            Some(log) => check_state(log.as_ref(), self.state.clone()),
        };
        if debug {
            match &result {
                Ok((live, rebuilt)) => assert_eq!(
                    live, rebuilt,
                    "queue {:?} partition {}: the state differs from the state rebuilt from its \
                     log",
                    self.ctx.queue, self.ctx.index
                ),
                // A failed read (a fault a test injected) gives no verdict.
                Err(error) => {
                    tracing::debug!(queue = %self.ctx.queue, %error, "state check skipped");
                }
            }
        }
        for reply in self.check_requests.drain(..) {
            let _ = reply.send(result.clone());
        }
    }

    /// A job holding the log ended.
    pub(super) fn job_done(&mut self, done: JobDone) {
        self.log_job = None;
        match done {
            JobDone::Healed(result) => self.heal_done(result),
            JobDone::Restarted(result) => self.restart_done(result),
            JobDone::Reset {
                log,
                result,
                count,
                reply,
            } => self.reset_done(log, result, count, reply),
        }
        for reply in std::mem::take(&mut self.deferred_purges) {
            match self.stop_error() {
                // A heal or reset was just tried: it did not help.
                Some(stop) => {
                    let error = self.unavailable(stop);
                    let _ = reply.send(Err(error));
                }
                _ => self.purge(reply),
            }
        }
    }

    /// End the owner: a close writes this round's acks and what waits for room, then closes the
    /// log (its queue drains, a seal is synced); a delete drops them and deletes the log. The
    /// blocking part runs on the blocking pool; the owner waits for it without holding a worker.
    pub(super) async fn finish(mut self, exit: Exit) {
        self.delivery.consumers.clear();
        self.delivery.reader = None;
        self.delivery.prefetched.clear();
        let delete = matches!(exit, Exit::Delete(_) | Exit::Replace(..));
        if delete {
            self.backlog.clear();
            self.appending = None;
        } else {
            self.flush_acks();
            loop {
                if self.appending.is_some() {
                    let submitted = append::next_submitted(&mut self.appending).await;
                    self.appending = None;
                    self.submitted(submitted);
                }
                self.submit_backlog();
                if self.appending.is_none() && self.backlog.is_empty() {
                    break;
                }
            }
        }
        if let Some(job) = self.log_job.take() {
            let _ = job.await;
        }
        // Closing or deleting syncs and removes files: on the blocking pool. A log still
        // shared elsewhere (a bug) fails the close; the last holder's drop closes it.
        let result = match self.log.take() {
            None => Ok(()),
            Some(log) => {
                tokio::task::spawn_blocking(move || if delete { log.delete() } else { log.close() })
                    .await
                    .map_err(|e| BrokerError::Closed(format!("closing the log: {e}")))
                    .and_then(|r| r)
            }
        };
        match exit {
            Exit::Close(reply) | Exit::Delete(reply) => {
                let _ = reply.send(result);
            }
            Exit::Replace(reply, consumers) => {
                let _ = reply.send(result.map(|()| consumers));
            }
        }
    }
}

/// The live state, and the state rebuilt from the log's records up to the same point
/// (blocking: reads the log).
fn check_state(
    log: &dyn PartitionLog,
    mut live: PartitionState,
) -> BrokerResult<(PartitionState, PartitionState)> {
    // A prefix removal or hand-back running in the log can take the records from under the
    // rebuild (OutOfRange at the old start; found by the model test): read again from the new
    // start. Removals only move the start forward, a few times per reclaim round.
    // A segment being handed to the pool (prefix removal, hand-back) can even be reused by
    // another log before this log's start moves past it: its records then read as corrupt
    // for a moment (the model test met it). Corruption that persists is reported.
    let mut attempts = 0;
    let rebuilt = loop {
        let start = log.start_offset();
        match rebuild(log, Some(live.head())) {
            Err(BrokerError::Log(LogError::OutOfRange { .. }))
                if attempts < 8 && log.start_offset() != start =>
            {
                attempts += 1;
            }
            Err(BrokerError::Log(LogError::Corrupt { .. })) if attempts < 8 => {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            result => break result?,
        }
    };
    // The log moved on while the job waited or read: a prefix removal or hand-back took
    // records the copy of the state still holds live (settled since). No verdict.
    if rebuilt.start() > live.pinned_offset() {
        return Err(BrokerError::Log(LogError::OutOfRange {
            offset: live.pinned_offset(),
            start: rebuilt.start(),
            end: live.head(),
        }));
    }
    // A prefix removal can finish in the log before its `PrefixRemoved` reaches the owner: the
    // live state then still covers offsets the log no longer holds, and the two differ only in
    // `start` and the forgotten part of `dead`. Compare from the log's start (the model test
    // caught the spurious mismatch right after a flood of acks).
    live.forget_below(rebuilt.start());
    Ok((live, rebuilt))
}
