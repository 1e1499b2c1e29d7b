//! A stream partition on a replicated log (`keratin-raft`): roles, and applying records this
//! owner did not propose. On a single node's local log none of this runs: it always leads and
//! reports only its own proposals.
//!
//! - **Roles.** Only the leader's owner appends; a follower's answers appends with
//!   [`BrokerError::NotLeader`] naming the leader. When this node stops leading, appends waiting
//!   for the gate are refused "not the leader"; those in the log are answered by the log when
//!   their fate is known (committed by the successor, or cut: "not the leader"), and any still
//!   unknown after the driver's step-down grace are answered [`BrokerError::LeadershipLost`]
//!   (outcome unknown; an idempotent producer's retry is stored once).
//! - **A new leader catches up first.** Every record below the leadership's first offset
//!   (`Role::from`) may be an earlier leader's; this owner proposes nothing — no message (its
//!   producers' sequences are checked against the state) and no checkpoint (it describes the
//!   state at its offset) — until it has applied them all.
//! - **Following.** Records committed by another node are read back from the log on the
//!   blocking pool, in bounded batches, and applied in offset order exactly like this owner's
//!   own, up to the driver's follow limit (`LogDriver::follow_limit`: the first offset of the
//!   oldest pending proposal once that one is committed past the head). A read that comes
//!   back after the
//!   state moved on (a heal's rebuild) is dropped and read again from the new head.
//! - **A log restarted past the head** (a lagging follower installed the leader's snapshot) is
//!   not read: the state is rebuilt from the log's start, as at open.
//!
//! Checkpoints written by the leader are checked on every replica as they apply: one that does
//! not match the state it follows stops the partition instead of building on a wrong state.

use super::*;
use crate::partition::log::{read_committed, Role};

/// A read of foreign records stops after this many records...
const FOLLOW_BATCH_COUNT: usize = 1024;

/// ...or once it holds this many bytes of payloads (one batch per partition in memory).
const FOLLOW_BATCH_BYTES: usize = 4 << 20;

/// A record another node proposed, read for applying.
#[derive(Debug)]
pub(crate) struct Foreign {
    offset: u64,
    timestamp_ms: u64,
    payload_bytes: u64,
    record: StreamRecord,
}

impl Owner {
    /// The refusal of an append on a node that does not lead.
    pub(super) fn not_leader(&self) -> BrokerError {
        self.driver
            .role()
            .not_leader(&self.config.stream, self.config.index)
    }

    /// Appends may be proposed: the state holds every record an earlier leader wrote, and is
    /// not being rebuilt.
    pub(super) fn caught_up(&self) -> bool {
        self.state.next_offset() >= self.driver.role().from && !self.restarting
    }

    /// The log reported a role: what only a leader has (appends waiting for the gate) goes
    /// at a step-down; the driver's grace answers those in the log.
    pub(super) fn role_changed(&mut self, role: Role) {
        tracing::info!(stream = %self.config.stream, partition = self.config.index,
                       leading = role.leading, leader = ?role.leader, from = role.from,
                       "stream partition role");
        let before = self.driver.set_role(role, tokio::time::Instant::now());
        if before.leading && !self.driver.role().leading {
            let refusal = self.not_leader();
            self.fail_waiting(|| refusal.clone());
        }
        if let Some(at) = self.driver.grace_at() {
            let commands = self.commands.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let _ = commands.send(Command::StepDownGrace);
            });
        }
        self.publish_figures();
        self.pump();
        self.maybe_follow();
    }

    /// The grace after stepping down may have ended: appends whose fate is still unknown are
    /// answered so (their proposals stay in the log's hands, and are applied if committed).
    pub(super) fn step_down_grace(&mut self) {
        let lost = (self.driver.role()).leadership_lost(&self.config.stream, self.config.index);
        for sequence in self.driver.grace_expired(tokio::time::Instant::now()) {
            let pending = self.driver.get_mut(sequence);
            if let Some(reply) = pending.and_then(|p| p.item.reply.take()) {
                let _ = reply.send(Err(lost.clone()));
            }
        }
    }

    /// Reads the next batch of foreign records when some are committed and not applied and
    /// nothing of this owner's is in the way; rebuilds the state when the log restarted past
    /// it.
    pub(super) fn maybe_follow(&mut self) {
        if self.following || self.restarting || self.driver.stopped().is_some() {
            return;
        }
        let Some(Range {
            start: from,
            end: until,
        }) = self.driver.follow_due(self.state.next_offset())
        else {
            return;
        };
        let log = self.log.clone();
        let commands = self.commands.clone();
        if from < log.start_offset() {
            // The log restarted past the head: only a rebuild from its start makes the state
            // equal the log again (nothing of this owner's is pending: follow_limit).
            tracing::info!(stream = %self.config.stream, partition = self.config.index, from,
                           start = log.start_offset(),
                           "the log restarted past the applied state; rebuilding it");
            self.restarting = true;
            tokio::task::spawn_blocking(move || {
                let result = rebuild(log.as_ref())
                    .map(|rebuilt| rebuilt.state)
                    .and_then(|state| Ok((state, Held::read(log.as_ref())?)));
                let _ = commands.send(Command::Restarted { result });
            });
            return;
        }
        self.following = true;
        tokio::task::spawn_blocking(move || {
            let result = read_foreign(log.as_ref(), from, until);
            let _ = commands.send(Command::Followed { from, result });
        });
    }

    /// A batch of foreign records read from `from`: applied, unless the state moved meanwhile.
    pub(super) fn followed(&mut self, from: u64, result: BrokerResult<Vec<Foreign>>) {
        self.following = false;
        if self.driver.stopped().is_some() || from != self.state.next_offset() {
            self.maybe_follow();
            return;
        }
        let records = match result {
            Ok(records) => records,
            Err(_) if from < self.log.start_offset() => {
                // The log restarted past the read while it ran: rebuild (maybe_follow).
                self.maybe_follow();
                return;
            }
            Err(error) => {
                tracing::warn!(stream = %self.config.stream, partition = self.config.index, %error, "reading committed records to follow failed; the partition stops");
                self.stop(error);
                return;
            }
        };
        for foreign in records {
            if let Err(error) = self.state.apply(
                foreign.offset,
                foreign.timestamp_ms,
                foreign.payload_bytes,
                &foreign.record,
            ) {
                // A broken invariant (a checkpoint that does not match, a gap): stop rather
                // than build on a wrong state; the heal rebuilds from the log.
                tracing::error!(stream = %self.config.stream, partition = self.config.index, %error, "a record committed by another node does not apply; the partition stops");
                self.stop(error);
                return;
            }
            if foreign.record.record_type() == STREAM_MESSAGE {
                self.held.saw_message(foreign.offset, foreign.timestamp_ms);
            }
        }
        self.apply_ready();
    }

    /// The state rebuilt after the log restarted past it.
    pub(super) fn restarted(&mut self, result: BrokerResult<(StreamPartitionState, Held)>) {
        self.restarting = false;
        if self.driver.stopped().is_some() {
            // The log stopped meanwhile: its heal rebuilds from what it holds then.
            return;
        }
        match result {
            Ok((state, held)) => {
                self.state = state;
                self.held = held;
                self.apply_ready();
            }
            Err(error) => {
                tracing::warn!(stream = %self.config.stream, partition = self.config.index, %error, "rebuilding after the log restarted failed; the partition stops");
                self.stop(error);
            }
        }
    }
}

/// Reads the committed records of `from..until` (at most a batch; blocking).
fn read_foreign(log: &dyn PartitionLog, from: u64, until: u64) -> BrokerResult<Vec<Foreign>> {
    let records = read_committed(
        log,
        "stream partition",
        from..until,
        FOLLOW_BATCH_COUNT,
        FOLLOW_BATCH_BYTES,
    )?;
    records
        .into_iter()
        .map(|record| {
            let decoded = StreamRecord::decode(record.record_type, &record.payload, record.offset)?;
            Ok(Foreign {
                offset: record.offset,
                timestamp_ms: record.timestamp_ms,
                payload_bytes: record.payload.len() as u64,
                record: decoded,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::OpenGate;
    use crate::partition::driver::STEP_DOWN_GRACE;
    use crate::partition::mem_log::MemLog;
    use crate::record::ProducerSeq;
    use crate::stream::records::Checkpoint;

    const LEADER_ADDR: &str = "127.0.0.1:5690";

    fn config() -> StreamPartitionConfig {
        StreamPartitionConfig {
            stream: "s".into(),
            index: 0,
            dir: std::path::PathBuf::from("s/0"),
            device: 1,
            segment_bytes: 64 << 10,
            settings: StreamSettings::default(),
            retention_as_written: false,
        }
    }

    async fn open(log: &Arc<MemLog>) -> StreamPartition {
        let log: Arc<dyn PartitionLog> = log.clone();
        StreamPartition::open(log, Arc::new(OpenGate), config())
            .await
            .expect("opens")
    }

    fn following(leader: u64) -> Role {
        Role {
            leading: false,
            leader: Some(leader),
            addr: Some(LEADER_ADDR.into()),
            from: 0,
        }
    }

    fn leading_from(from: u64) -> Role {
        Role {
            leading: true,
            leader: Some(1),
            addr: None,
            from,
        }
    }

    fn message(i: u64, producer: Option<(u64, u64)>) -> Message {
        let mut m = Message::new(format!("m{i}").into_bytes());
        m.producer = producer.map(|(producer, sequence)| ProducerSeq { producer, sequence });
        m
    }

    fn encode(records: &[StreamRecord]) -> Vec<(u8, Vec<u8>)> {
        records
            .iter()
            .map(|r| (r.record_type(), r.encode().expect("encodes")))
            .collect()
    }

    /// Waits (bounded) until `done` holds.
    async fn until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not in 5 s: {what}");
    }

    async fn read_all(partition: &StreamPartition) -> Vec<(u64, Vec<u8>)> {
        let read = partition.read(0, 4096, usize::MAX).await.expect("reads");
        read.messages
            .into_iter()
            .map(|m| (m.offset, m.message.body))
            .collect()
    }

    #[tokio::test]
    async fn a_follower_applies_the_leaders_records_and_refuses_appends() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(following(2));
        let refused = partition.append(vec![message(0, None)], 5).await;
        match refused {
            Err(BrokerError::NotLeader { leader, addr, .. }) => {
                assert_eq!((leader, addr.as_deref()), (Some(2), Some(LEADER_ADDR)));
            }
            other => panic!("a follower refuses appends: {other:?}"),
        }
        // The leader's records: two messages, its checkpoint of them, one more.
        let mut leader = StreamPartitionState::new(0);
        let mut records = Vec::new();
        for i in 0..2 {
            let record = StreamRecord::Message(message(i, Some((7, i + 1))));
            let bytes = record.encode().expect("encodes").len() as u64;
            leader.apply(i, 100, bytes, &record).expect("applies");
            records.push(record);
        }
        records.push(StreamRecord::Checkpoint(leader.checkpoint()));
        records.push(StreamRecord::Noop);
        records.push(StreamRecord::Message(message(4, Some((7, 3)))));
        log.commit_foreign_encoded(&encode(&records), 100);
        let end = partition.watch_end();
        until("the follower applied the records", || *end.borrow() == 5).await;
        let figures = partition.figures();
        assert_eq!(figures.messages, 3);
        assert!(!figures.leading);
        assert_eq!(figures.leader, Some(2));
        assert!(!figures.stopped, "the leader's checkpoint matched");
        assert_eq!(
            read_all(&partition).await,
            vec![
                (0, b"m0".to_vec()),
                (1, b"m1".to_vec()),
                (4, b"m4".to_vec())
            ]
        );
    }

    #[tokio::test]
    async fn a_checkpoint_that_does_not_match_the_followers_state_stops_it() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(following(2));
        let wrong = Checkpoint {
            messages: 9,
            bytes: 9,
            producers: Vec::new(),
        };
        let records = [
            StreamRecord::Message(message(0, None)),
            StreamRecord::Checkpoint(wrong),
        ];
        log.commit_foreign_encoded(&encode(&records), 100);
        until("the partition stopped", || partition.figures().stopped).await;
        assert_eq!(
            *partition.watch_end().borrow(),
            1,
            "nothing past the record before"
        );
    }

    #[tokio::test]
    async fn a_new_leader_appends_only_after_its_predecessors_records() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(following(2));
        let first = [
            StreamRecord::Message(message(0, Some((7, 1)))),
            StreamRecord::Message(message(1, Some((7, 2)))),
        ];
        log.commit_foreign_encoded(&encode(&first), 100);
        let end = partition.watch_end();
        until("the first records applied", || *end.borrow() == 2).await;
        // Elected with the predecessor's last records (2 and 3) in its log, not committed yet.
        log.set_role(leading_from(4));
        let retry = partition.dispatch(vec![message(3, Some((7, 3)))], 200);
        let new = partition.dispatch(vec![message(4, Some((7, 4)))], 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            *end.borrow(),
            2,
            "nothing proposed before the predecessor's records"
        );
        let rest = [
            StreamRecord::Noop,
            StreamRecord::Message(message(3, Some((7, 3)))),
        ];
        log.commit_foreign_encoded(&encode(&rest), 150);
        let retry = retry.await.expect("answered").expect("appended");
        assert_eq!(
            retry,
            vec![Appended::Duplicate],
            "stored by the predecessor"
        );
        let new = new.await.expect("answered").expect("appended");
        assert_eq!(new, vec![Appended::Stored(4)]);
        assert_eq!(partition.figures().messages, 4);
    }

    #[tokio::test]
    async fn a_leaders_proposal_applies_after_records_committed_before_it() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(leading_from(0));
        log.hold_proposals();
        let mine = partition.dispatch(vec![message(9, None)], 200);
        until("the proposal is in the log", || log.held_count() == 1).await;
        // The log's own entries and records committed before it land first.
        let before = [StreamRecord::Noop, StreamRecord::Noop];
        log.commit_foreign_encoded(&encode(&before), 100);
        log.settle_held(None);
        let mine = mine.await.expect("answered").expect("appended");
        assert_eq!(mine, vec![Appended::Stored(2)]);
        assert_eq!(read_all(&partition).await, vec![(2, b"m9".to_vec())]);
    }

    #[tokio::test]
    async fn a_proposal_refused_as_not_leader_is_answered_and_the_partition_runs_on() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.hold_proposals();
        let refused = partition.dispatch(vec![message(0, Some((7, 1)))], 200);
        until("the proposal is in the log", || log.held_count() == 1).await;
        log.settle_held(Some(following(2).not_leader("s", 0)));
        match refused.await.expect("answered") {
            Err(BrokerError::NotLeader { .. }) => {}
            other => panic!("answered as the log did: {other:?}"),
        }
        assert!(!partition.figures().stopped);
        // The producer's retry is new: the refused proposal took no offset.
        let retried = partition
            .append(vec![message(0, Some((7, 1)))], 300)
            .await
            .expect("appended");
        assert_eq!(retried, vec![Appended::Stored(0)]);
    }

    /// A producer's retry of a message still in flight is answered once the first attempt's
    /// outcome is known, never before: answered "duplicate" at once, it was confirmed while the
    /// first attempt could still fail, and when that one was refused the confirmed message was
    /// stored nowhere. After the refusal the retry is stored.
    #[tokio::test]
    async fn a_retry_of_a_message_in_flight_waits_for_the_first_attempts_outcome() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.hold_proposals();
        let first = partition.dispatch(vec![message(0, Some((7, 1)))], 200);
        until("the first attempt is in the log", || log.held_count() == 1).await;
        let mut retry = partition.dispatch(vec![message(0, Some((7, 1)))], 300);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            matches!(
                retry.try_recv(),
                Err(tokio::sync::oneshot::error::TryRecvError::Empty)
            ),
            "the retry was answered while the first attempt was in flight"
        );
        log.settle_held(Some(following(2).not_leader("s", 0)));
        assert!(matches!(
            first.await.expect("answered"),
            Err(BrokerError::NotLeader { .. })
        ));
        let retried = retry.await.expect("answered").expect("appended");
        assert_eq!(retried, vec![Appended::Stored(0)], "the retry is stored");
        assert_eq!(read_all(&partition).await, vec![(0, b"m0".to_vec())]);
    }

    #[tokio::test]
    async fn appends_in_flight_when_leadership_is_lost_are_answered_after_a_grace() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(leading_from(0));
        log.hold_proposals();
        let in_flight = partition.dispatch(vec![message(0, None)], 200);
        until("the proposal is in the log", || log.held_count() == 1).await;
        let started = tokio::time::Instant::now();
        log.set_role(following(2));
        match in_flight.await.expect("answered") {
            Err(BrokerError::LeadershipLost { why, .. }) => {
                assert!(why.contains("node 2"), "{why}");
            }
            other => panic!("outcome unknown after the grace: {other:?}"),
        }
        assert!(started.elapsed() >= STEP_DOWN_GRACE);
        // Its successor committed it after all: applied, though already answered.
        log.settle_held(None);
        let end = partition.watch_end();
        until("the committed proposal applied", || *end.borrow() == 1).await;
        assert!(!partition.figures().stopped);
    }

    #[tokio::test]
    async fn a_followers_failed_storage_stops_and_heals_and_it_follows_on() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(following(2));
        log.commit_foreign_encoded(&encode(&[StreamRecord::Message(message(0, None))]), 100);
        let end = partition.watch_end();
        until("the first record applied", || *end.borrow() == 1).await;
        log.fail_storage();
        until("stopped", || partition.figures().stopped).await;
        until("healed", || partition.figures().heals == 1).await;
        assert!(!partition.figures().stopped);
        log.commit_foreign_encoded(&encode(&[StreamRecord::Message(message(1, None))]), 100);
        until("followed after the heal", || *end.borrow() == 2).await;
        assert_eq!(partition.figures().stops, 1);
    }

    #[tokio::test]
    async fn a_follower_whose_log_restarted_past_it_rebuilds_from_the_log() {
        let log = Arc::new(MemLog::default());
        let partition = open(&log).await;
        log.set_role(following(2));
        log.commit_foreign_encoded(&encode(&[StreamRecord::Message(message(0, None))]), 100);
        let end = partition.watch_end();
        until("the first record applied", || *end.borrow() == 1).await;
        // It lagged so far that the leader sent a snapshot: its log starts at 20 now, with the
        // leader's checkpoint there.
        log.restart(20);
        let checkpoint = Checkpoint {
            messages: 15,
            bytes: 150,
            producers: Vec::new(),
        };
        let records = [
            StreamRecord::Checkpoint(checkpoint),
            StreamRecord::Message(message(21, None)),
        ];
        log.commit_foreign_encoded(&encode(&records), 100);
        until("rebuilt and followed", || *end.borrow() == 22).await;
        let read = partition.read(0, 10, usize::MAX).await.expect("reads");
        assert_eq!(read.moved_from, Some(0));
        let offsets: Vec<u64> = read.messages.iter().map(|m| m.offset).collect();
        assert_eq!(offsets, vec![21]);
        assert!(!partition.figures().stopped);
    }
}
