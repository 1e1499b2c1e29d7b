//! The owner task of a stream's cursor log (see the parent module's docs): what requests
//! become (cursor records, one proposal at a time), applying records to the cursor table in
//! offset order, compaction, and the table's rebuild after a heal. The proposal's order, the
//! role and its step-down grace, following and the stop/heal phase are the
//! [`LogDriver`]'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use keratin_log::ReadRecord;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Request, Shared, CURSOR_LOG_PARTITION};
use crate::error::{BrokerError, BrokerResult};
use crate::partition::driver::{sleep_until, LogDriver};
use crate::partition::log::{is_storage_failure, read_committed, LogEvent, PartitionLog, Proposal};
use crate::record::NOOP;
use crate::stream::cursors::{should_compact, CursorRecord, CursorTable};

/// Records read back from the log per batch (the blocking pool is not held long).
const READ_BATCH_COUNT: usize = 4096;
const READ_BATCH_BYTES: usize = 4 << 20;

/// Who waits for a proposal.
enum Reply {
    Commit(oneshot::Sender<BrokerResult<()>>),
    Delete(oneshot::Sender<BrokerResult<bool>>),
    Expire(oneshot::Sender<BrokerResult<Vec<String>>>, Vec<String>),
    /// The owner's own snapshot.
    Compaction,
}

impl Reply {
    fn done(self, shared: &Shared) {
        match self {
            Reply::Commit(reply) => drop(reply.send(Ok(()))),
            Reply::Delete(reply) => drop(reply.send(Ok(true))),
            Reply::Expire(reply, names) => drop(reply.send(Ok(names))),
            Reply::Compaction => {
                shared.compactions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn failed(self, error: BrokerError) {
        match self {
            Reply::Commit(reply) => drop(reply.send(Err(error))),
            Reply::Delete(reply) => drop(reply.send(Err(error))),
            Reply::Expire(reply, _) => drop(reply.send(Err(error))),
            Reply::Compaction => {
                tracing::warn!(%error, "a cursor log's compaction was not written; the next write tries again")
            }
        }
    }
}

/// The owner's part of its proposal in the log.
struct Pending {
    records: Vec<CursorRecord>,
    timestamp_ms: u64,
    /// Whom to answer; `None` once the step-down grace answered it as unknown.
    reply: Option<Reply>,
}

/// See the module docs.
pub(super) struct Owner {
    stream: String,
    log: Arc<dyn PartitionLog>,
    segment_bytes: u64,
    shared: Arc<Shared>,
    /// The next offset to apply: every record below it is in the table.
    applied: u64,
    /// The proposal (one at a time), the role, what is committed, stop and heal.
    driver: LogDriver<Pending>,
    /// Bytes of records applied since the last snapshot record, and that snapshot's size.
    since_snapshot: u64,
    last_snapshot_bytes: u64,
    /// The highest offset below which this copy was asked to give its segments back.
    floor: u64,
    removal: Option<JoinHandle<()>>,
    /// The latest time a request brought (a snapshot's timestamp).
    now_ms: u64,
    /// `applied` when the last compaction was proposed: one that failed is not proposed again
    /// before another record is applied.
    compaction_tried_at: Option<u64>,
}

impl Owner {
    /// The owner with its table read from `log`.
    pub(super) async fn open(
        stream: &str,
        log: Arc<dyn PartitionLog>,
        segment_bytes: u64,
        shared: Arc<Shared>,
    ) -> BrokerResult<Owner> {
        let mut owner = Owner {
            stream: stream.to_string(),
            applied: log.start_offset(),
            driver: LogDriver::new(log.committed_offset()),
            log,
            segment_bytes,
            shared,
            since_snapshot: 0,
            last_snapshot_bytes: 0,
            floor: 0,
            removal: None,
            now_ms: 0,
            compaction_tried_at: None,
        };
        owner.rebuild().await?;
        Ok(owner)
    }

    /// Runs until the handle goes and nothing is pending.
    pub(super) async fn run(
        mut self,
        mut requests: mpsc::Receiver<Request>,
        mut events: mpsc::UnboundedReceiver<LogEvent>,
    ) {
        let mut closing = false;
        loop {
            if self.driver.stopped().is_none() {
                if let Some(due) = self.driver.follow_due(self.applied) {
                    if let Err(error) = self.catch_up_until(due.end).await {
                        self.stop(error);
                    }
                    self.release().await;
                    continue;
                }
            }
            if self.driver.is_idle() {
                if closing {
                    break;
                }
                if self.compaction_due() {
                    self.propose_compaction().await;
                    continue;
                }
            }
            // A follower refuses requests at once, even with a proposal of its leadership
            // still pending; a leader takes one at a time.
            let one_at_a_time = self.driver.is_idle() || !self.driver.role().leading;
            let accepting = !closing && one_at_a_time && self.may_take_requests();
            let grace_at = self.driver.grace_at();
            let heal_at = self.driver.heal_at().filter(|_| self.driver.is_idle());
            tokio::select! {
                biased;
                event = events.recv() => match event {
                    Some(event) => self.on_event(event).await,
                    // The log dropped its listener: nothing more comes from it.
                    None => break,
                },
                _ = sleep_until(grace_at), if grace_at.is_some() => self.grace_over(),
                _ = sleep_until(heal_at), if heal_at.is_some() => self.heal().await,
                request = requests.recv(), if accepting => match request {
                    Some(request) => self.on_request(request).await,
                    None => closing = true,
                },
            }
        }
        let closed = BrokerError::Closed(format!("stream {:?}'s cursor log", self.stream));
        for pending in self.driver.drain() {
            if let Some(reply) = pending.item.reply {
                reply.failed(closed.clone());
            }
        }
        if let Some(removal) = self.removal.take() {
            let _ = removal.await;
        }
    }

    /// Requests can be served: a follower refuses them at once; a leader takes them once it
    /// applied every record committed before, its predecessors' included.
    fn may_take_requests(&self) -> bool {
        let role = self.driver.role();
        !role.leading
            || self.driver.stopped().is_some()
            || (self.applied >= self.driver.committed_up_to() && self.applied >= role.from)
    }

    async fn on_request(&mut self, request: Request) {
        let (records, reply, now_ms) = match request {
            Request::Commit {
                name,
                positions,
                now_ms,
                reply,
            } => {
                let Some(reply) = self.ready(reply).await else {
                    return;
                };
                let checked = self.table().check_commit(&name, &positions);
                if let Err(error) = checked {
                    let _ = reply.send(Err(error));
                    return;
                }
                let record = CursorRecord::Commit { name, positions };
                (vec![record], Reply::Commit(reply), now_ms)
            }
            Request::Delete {
                name,
                now_ms,
                reply,
            } => {
                let Some(reply) = self.ready(reply).await else {
                    return;
                };
                if self.table().get(&name).is_none() {
                    let _ = reply.send(Ok(false));
                    return;
                }
                (
                    vec![CursorRecord::Delete { name }],
                    Reply::Delete(reply),
                    now_ms,
                )
            }
            Request::Expire {
                now_ms,
                expiry_ms,
                reply,
            } => {
                let Some(reply) = self.ready(reply).await else {
                    return;
                };
                let names = self.table().expired(now_ms, expiry_ms);
                if names.is_empty() {
                    let _ = reply.send(Ok(names));
                    return;
                }
                let records = names
                    .iter()
                    .map(|name| CursorRecord::Delete { name: name.clone() })
                    .collect();
                (records, Reply::Expire(reply, names), now_ms)
            }
        };
        self.now_ms = self.now_ms.max(now_ms);
        self.propose(records, reply, now_ms).await;
    }

    /// The reply back if a proposal may be made now: this node leads and its log runs (healed
    /// first if a write stopped it); else it is answered why not.
    async fn ready<T>(
        &mut self,
        reply: oneshot::Sender<BrokerResult<T>>,
    ) -> Option<oneshot::Sender<BrokerResult<T>>> {
        let role = self.driver.role();
        if !role.leading {
            let _ = reply.send(Err(role.not_leader(&self.stream, CURSOR_LOG_PARTITION)));
            return None;
        }
        if self.driver.heal_due(Instant::now()) {
            self.heal().await;
        }
        if let Some(error) = self.driver.stopped() {
            let _ = reply.send(Err(error.clone()));
            return None;
        }
        Some(reply)
    }

    async fn propose(&mut self, records: Vec<CursorRecord>, reply: Reply, timestamp_ms: u64) {
        let types = records.iter().map(CursorRecord::record_type).collect();
        let payloads = records.iter().map(CursorRecord::encode).collect();
        let pending = Pending {
            records,
            timestamp_ms,
            reply: Some(reply),
        };
        let proposal = Proposal {
            sequence: self.driver.propose(pending, Instant::now()),
            types,
            payloads,
            timestamp_ms,
        };
        let sequence = proposal.sequence;
        if let Err(error) = self.log.clone().propose(proposal).await {
            // Refused: nothing was written; a stopped log's refusal stops the owner too.
            if is_storage_failure(&error) {
                self.stop(error.clone());
            }
            self.driver.resolve(sequence, Err(error));
            self.release().await;
        }
    }

    async fn on_event(&mut self, event: LogEvent) {
        match event {
            LogEvent::Proposed { sequence, result } => {
                if let Err(error) = &result {
                    if is_storage_failure(error) {
                        self.stop(error.clone());
                    }
                }
                self.driver.resolve(sequence, result);
                self.release().await;
            }
            LogEvent::Role(role) => {
                tracing::info!(stream = %self.stream, leading = role.leading, leader = ?role.leader,
                               from = role.from, "stream cursor log role");
                *self.shared.role.lock().unwrap_or_else(|p| p.into_inner()) = role.clone();
                self.driver.set_role(role, Instant::now());
            }
            LogEvent::Committed { up_to } => self.driver.committed(up_to),
            LogEvent::Stopped { error } => self.stop(BrokerError::Log(error)),
        }
    }

    /// Acts on the proposal whose outcome is known: a commit at the table's head is applied,
    /// then answered (one past the head waits for the records before it, which the run loop
    /// follows first); a failure is answered as is. With the log stopped, a commit is answered
    /// without applying it: the table comes back with the heal, which reads it.
    async fn release(&mut self) {
        loop {
            let released = match self.driver.stopped() {
                None => self.driver.next_released(self.applied),
                Some(_) => self.driver.next_answered(),
            };
            let Some(released) = released else {
                return;
            };
            let pending = released.item;
            match released.outcome {
                Some(Ok(range)) => {
                    assert_eq!(
                        range.end - range.start,
                        pending.records.len() as u64,
                        "the log committed a cursor proposal at a range of another length"
                    );
                    if self.applied == range.start {
                        for (offset, record) in range.zip(&pending.records) {
                            let bytes = record.encode().len() as u64;
                            self.apply(offset, pending.timestamp_ms, bytes, record);
                        }
                    }
                    if let Some(reply) = pending.reply {
                        reply.done(&self.shared);
                    }
                }
                Some(Err(error)) => {
                    if let Some(reply) = pending.reply {
                        reply.failed(error);
                    }
                }
                None => {}
            }
        }
    }

    /// The step-down grace ended: the proposal whose fate the log did not tell is answered as
    /// unknown (it stays the log's: applied if committed after all).
    fn grace_over(&mut self) {
        let lost = (self.driver.role()).leadership_lost(&self.stream, CURSOR_LOG_PARTITION);
        for sequence in self.driver.grace_expired(Instant::now()) {
            let pending = self.driver.get_mut(sequence);
            if let Some(reply) = pending.and_then(|p| p.item.reply.take()) {
                reply.failed(lost.clone());
            }
        }
    }

    fn table(&self) -> std::sync::RwLockReadGuard<'_, CursorTable> {
        self.shared.table.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies the record at `offset`, the next one.
    fn apply(&mut self, offset: u64, timestamp_ms: u64, bytes: u64, record: &CursorRecord) {
        assert_eq!(
            offset, self.applied,
            "cursor log records applied out of order (a gap would lose commits)"
        );
        self.shared
            .table
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .apply(record, timestamp_ms);
        self.applied = offset + 1;
        if matches!(record, CursorRecord::Snapshot(_)) {
            self.since_snapshot = 0;
            self.last_snapshot_bytes = bytes;
            self.remove_below(offset);
        } else {
            self.since_snapshot += bytes;
        }
    }

    /// Gives this copy's segments below the snapshot at `offset` back (in the background; one
    /// removal at a time, a later snapshot removes what a skipped one would have).
    fn remove_below(&mut self, offset: u64) {
        if offset <= self.floor || self.removal.as_ref().is_some_and(|r| !r.is_finished()) {
            return;
        }
        self.floor = offset;
        match self.log.remove_prefix(offset) {
            Ok(removing) => {
                let stream = self.stream.clone();
                self.removal = Some(tokio::spawn(async move {
                    if let Err(error) = removing.await {
                        tracing::warn!(stream, %error, "giving a cursor log's compacted segments back failed; the next compaction tries again");
                    }
                }));
            }
            Err(error) => {
                tracing::debug!(stream = %self.stream, %error, "a cursor log's compacted segments stay");
            }
        }
    }

    /// Reads and applies the committed records up to `until` (blocking reads, in batches). A
    /// log that restarted past the table (a snapshot of the group installed) is applied from
    /// its new start, into an empty table.
    async fn catch_up_until(&mut self, until: u64) -> BrokerResult<()> {
        while self.applied < until {
            let log = self.log.clone();
            let from = self.applied;
            let read = tokio::task::spawn_blocking(move || {
                read_committed(
                    log.as_ref(),
                    "cursor log",
                    from..until,
                    READ_BATCH_COUNT,
                    READ_BATCH_BYTES,
                )
            })
            .await
            .map_err(|e| BrokerError::Closed(format!("cursor log read: {e}")))?;
            match read {
                Ok(records) => self.apply_read(records)?,
                Err(error) => {
                    let start = self.log.start_offset();
                    if start <= self.applied {
                        return Err(error);
                    }
                    tracing::info!(stream = %self.stream, from = self.applied, start,
                                   "the cursor log restarted past this node's table; reading it from its start");
                    self.restart_at(start);
                }
            }
        }
        Ok(())
    }

    fn apply_read(&mut self, records: Vec<ReadRecord>) -> BrokerResult<()> {
        for record in records {
            if record.record_type == NOOP && record.payload.is_empty() {
                // A replicated log's own entry (an election's blank, a membership change): it
                // takes an offset and changes no cursor.
                assert_eq!(
                    record.offset, self.applied,
                    "cursor log records applied out of order"
                );
                self.applied += 1;
                continue;
            }
            let decoded = CursorRecord::decode(record.record_type, &record.payload, record.offset)?;
            self.apply(
                record.offset,
                record.timestamp_ms,
                record.payload.len() as u64,
                &decoded,
            );
        }
        Ok(())
    }

    /// An empty table that continues at `start`.
    fn restart_at(&mut self, start: u64) {
        *self.shared.table.write().unwrap_or_else(|p| p.into_inner()) = CursorTable::new();
        self.applied = start;
        self.since_snapshot = 0;
        self.last_snapshot_bytes = 0;
    }

    /// The table read again from the log's start to its committed end.
    async fn rebuild(&mut self) -> BrokerResult<()> {
        self.restart_at(self.log.start_offset());
        self.driver.committed(self.log.committed_offset());
        let until = self.log.committed_offset();
        self.catch_up_until(until).await
    }

    fn stop(&mut self, error: BrokerError) {
        let shown = error.to_string();
        if self.driver.stop(error, Instant::now()) {
            tracing::warn!(stream = %self.stream, error = %shown, "a stream's cursor log stopped; healing it");
        }
    }

    /// Heals a stopped log and reads the table again from what is durable (a write that failed
    /// after its sync is in the log, so it is in the table too).
    async fn heal(&mut self) {
        self.driver.heal_started();
        let log = self.log.clone();
        let healed = tokio::task::spawn_blocking(move || log.heal())
            .await
            .map_err(|e| BrokerError::Closed(format!("cursor log heal: {e}")))
            .and_then(|r| r.map_err(BrokerError::Log));
        let result = match healed {
            Ok(()) => self.rebuild().await,
            Err(error) => Err(error),
        };
        match result {
            Ok(()) => {
                tracing::info!(stream = %self.stream, "a stream's cursor log healed");
                self.driver.heal_done(Ok(()), Instant::now());
            }
            Err(error) => {
                tracing::warn!(stream = %self.stream, %error, "healing a stream's cursor log failed; trying again");
                self.driver.heal_done(Err(()), Instant::now());
            }
        }
    }

    /// Whether the leader should write a snapshot now (cheap checks first: the snapshot is only
    /// encoded once enough was written since the last one).
    fn compaction_due(&self) -> bool {
        if !self.driver.role().leading
            || self.driver.stopped().is_some()
            || self.applied < self.driver.committed_up_to()
            || self.compaction_tried_at == Some(self.applied)
            || self.since_snapshot <= self.last_snapshot_bytes.saturating_mul(4)
        {
            return false;
        }
        let segments = self.log.space().segment_bases.len();
        if segments <= 2 && self.since_snapshot <= self.segment_bytes / 8 {
            return false;
        }
        let snapshot_bytes = self.table().snapshot().encode().len() as u64;
        should_compact(
            self.since_snapshot,
            segments,
            snapshot_bytes,
            self.segment_bytes,
        )
    }

    async fn propose_compaction(&mut self) {
        self.compaction_tried_at = Some(self.applied);
        let snapshot = self.table().snapshot();
        self.propose(vec![snapshot], Reply::Compaction, self.now_ms)
            .await;
    }
}
