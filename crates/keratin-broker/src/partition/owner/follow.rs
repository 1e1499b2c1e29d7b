//! Applying records this owner did not propose: a replicated log reports records committed by
//! another node ([`LogEvent::Committed`]) on a follower, or on a new leader catching up on its
//! predecessor's records. The owner reads them back from its log (committed records only) on
//! the blocking pool, in bounded batches, and applies them in offset order exactly as it applies
//! its own. A local log never reports such records, so none of this runs on a single node.
//!
//! Own proposals and foreign records never interleave: foreign records are read only while
//! nothing of this owner's is pending (a log that stops leading fails its pending proposals
//! first), or up to the first offset of this owner's oldest pending proposal once that one is
//! committed (a new leader's proposals land after its predecessor's records and the log's own
//! entries, which are applied first); a read that comes back after the state moved on (a
//! heal's rebuild, a reset) is dropped and read again from the new head.
//!
//! A replicated log whose start moved past the head (a lagging follower that installed the
//! leader's snapshot: the records below hold nothing live) is not read: the state is rebuilt
//! from the log's start instead, as at open; so is one whose start moved past a read while it
//! ran (the read fails, and is no reason to stop the partition).

use super::*;

/// A read of foreign records stops after this many records...
const FOLLOW_BATCH_COUNT: usize = 1024;

/// ...or once it holds this many bytes of record payloads (a RELOCATE carries a message copy).
/// One batch per partition is in memory at a time: 4 MiB, like a relocation round.
const FOLLOW_BATCH_BYTES: usize = 4 << 20;

/// Records read for applying, from `from` on.
pub(crate) struct FollowRead {
    from: u64,
    records: Vec<PartitionRecord>,
    error: Option<BrokerError>,
}

impl Owner {
    /// Read the next batch of foreign records when some are committed and not applied, and
    /// nothing of this owner's is in the way (see the module docs).
    pub(super) fn maybe_follow(&mut self) {
        if self.state.recount_due() {
            self.recount();
        }
        let from = self.state.head();
        let Some(until) = self.driver.follow_limit(from) else {
            return;
        };
        if self.following
            || until <= from
            || self.driver.stopped().is_some()
            || self.log_job.is_some()
        {
            return;
        }
        let Some(log) = self.log.clone() else {
            return;
        };
        if from < log.start_offset() {
            // The log restarted past the head: this replica lagged so far that the leader sent
            // a snapshot (the records below the log's start hold nothing live) instead of the
            // records. Only a rebuild from the log's start makes the state equal the log again.
            if self.driver.is_idle() {
                self.start_log_job(|log| JobDone::Restarted(super::rebuild(log.as_ref(), None)));
            }
            return;
        }
        self.following = true;
        let commands = self.commands.clone();
        tokio::task::spawn_blocking(move || {
            let read = read_committed(log.as_ref(), from, until);
            let _ = commands.send(Command::FollowRead(read));
        });
    }

    /// A PURGE named messages this state never knew (a follower whose log starts past
    /// messages the leader still counted): its byte total is not this state's, and only the
    /// records tell the live bytes. A rebuild from the log recounts them, once nothing of this
    /// owner's is pending (a rebuild replaces the state: see `rebuilt`); until then the live
    /// byte total is short by what the record counted twice, and following goes on.
    fn recount(&mut self) {
        if self.driver.is_idle()
            && !self.following
            && self.driver.stopped().is_none()
            && self.log_job.is_none()
            && self.log.is_some()
        {
            tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, "a purge named messages below the log's start: recounting the live bytes from the log");
            self.start_log_job(|log| JobDone::Restarted(super::rebuild(log.as_ref(), None)));
        }
    }

    /// A batch of foreign records was read: apply it if the state is still where it started.
    pub(super) fn follow_read(&mut self, read: FollowRead) {
        self.following = false;
        if read.from != self.state.head() {
            return;
        }
        // The read ends below every pending proposal: those made since it started got offsets
        // past the committed end it read to, and an older one bounded it (`follow_limit`).
        let end = read.from + read.records.len() as u64;
        if let Some(Pending {
            outcome: Some(Ok(range)),
            ..
        }) = self.driver.oldest()
        {
            if end > range.start {
                tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, end, start = range.start, "records read to apply overlap a pending proposal; reading again");
                return;
            }
        }
        for (offset, record) in (read.from..).zip(&read.records) {
            match self.state.apply(offset, record) {
                Ok(applied) => self.applied(applied),
                Err(error) => {
                    self.out_of_step(offset, &error);
                    return;
                }
            }
        }
        self.state_check_due = true;
        // An own proposal may have waited for these records.
        self.act_on_answers();
        if let Some(error) = read.error {
            if self
                .log
                .as_ref()
                .is_some_and(|log| log.start_offset() > self.state.head())
            {
                // The log restarted past the read (a snapshot from the leader installed
                // meanwhile): `maybe_follow` rebuilds from its new start.
                tracing::info!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "the log restarted past the records being read (a snapshot from the leader); rebuilding from its new start");
                return;
            }
            tracing::error!(queue = %self.ctx.queue, partition = self.ctx.index, %error, "cannot read committed records to apply them");
            self.stop(LogError::Invalid(format!(
                "reading committed records at offset {} failed: {error}",
                self.state.head()
            )));
        }
    }
}

/// Read and decode committed records `[from, until)`, at most one batch (blocking).
fn read_committed(log: &dyn PartitionLog, from: u64, until: u64) -> FollowRead {
    let mut read = FollowRead {
        from,
        records: Vec::new(),
        error: None,
    };
    let mut bytes = 0usize;
    let mut reader = log.reader(from);
    let mut expected = from;
    while expected < until && read.records.len() < FOLLOW_BATCH_COUNT && bytes < FOLLOW_BATCH_BYTES
    {
        let record = match reader.next() {
            Some(Ok(record)) => record,
            Some(Err(error)) => {
                read.error = Some(error.into());
                break;
            }
            None => {
                let reason = format!("the log reported records committed up to {until}");
                read.error = Some(disk::corrupt(expected, reason));
                break;
            }
        };
        // Offsets are consecutive: a record at another offset would be applied at the wrong one.
        if record.offset != expected {
            let reason = format!("committed record at offset {} read here", record.offset);
            read.error = Some(disk::corrupt(expected, reason));
            break;
        }
        bytes += record.payload.len();
        match PartitionRecord::decode(record.record_type, &record.payload, record.offset) {
            Ok(decoded) => read.records.push(decoded),
            Err(error) => {
                read.error = Some(error);
                break;
            }
        }
        expected += 1;
    }
    read
}

#[cfg(test)]
mod tests {
    //! An owner over an in-memory replicated log stand-in: records committed by "another
    //! node" are applied in order, and the owner's own proposals follow them. Fails if the
    //! owner ignored foreign commits (its head stays at 0), applied them out of order or
    //! twice (the state differs from the state rebuilt from the log), or proposed at an offset
    //! that was not the next one.

    use super::*;
    use crate::broker::LocalDeadLetters;
    use crate::gate::OpenGate;
    use crate::partition::mem_log::MemLog;
    use crate::record::{Outcome, Settled};

    fn context() -> OwnerContext {
        OwnerContext {
            device: 0,
            gate: Arc::new(OpenGate),
            queue: "q".into(),
            index: 0,
            settings: QueueSettings::default(),
            broker: Weak::new(),
            dead_letters: Arc::new(LocalDeadLetters::new(Weak::new())),
            dead_letter_producer: 1,
            dead_letters_held: HeldCount::default(),
            clock: Arc::new(|| 0),
            segment_size_bytes: 1 << 20,
            publish_timeout: Duration::from_secs(30),
            idle_release_after: Duration::from_secs(30),
        }
    }

    fn payload(body: &str) -> Vec<u8> {
        let mut out = Vec::new();
        Message::new(body).encode(&mut out).expect("encodes");
        out
    }

    #[tokio::test]
    async fn records_committed_elsewhere_are_applied_in_order_before_own_proposals() {
        let log = Arc::new(MemLog::default());
        let handle = spawn(context(), log.clone(), PartitionState::new(0), None);
        // ENQUEUE payloads are the messages themselves: committed as such, reported with the
        // SETTLE that follows them.
        let encoded: Vec<(u8, Vec<u8>)> = ["a", "bb", "ccc"]
            .iter()
            .map(|body| (crate::record::ENQUEUE, payload(body)))
            .collect();
        log.push(&encoded);
        log.commit_foreign(&[PartitionRecord::Settle(vec![Settled {
            message: 0,
            size_bytes: payload("a").len() as u32,
            outcome: Outcome::Acked,
        }])]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (live, rebuilt) = loop {
            let (live, rebuilt) = handle.state().await.expect("state");
            if live.head() == 4 || Instant::now() > deadline {
                break (live, rebuilt);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        assert_eq!(live.head(), 4, "the foreign records were not applied");
        assert_eq!(live, rebuilt);
        assert_eq!(live.live_count(), 2);
        // As leader now, the owner's own proposal comes next.
        let reply = handle.dispatch(vec![payload("d")], 0, false);
        let range = reply.await.expect("answered").expect("committed");
        assert_eq!(range, 4..5);
        let (live, rebuilt) = handle.state().await.expect("state");
        assert_eq!((live.head(), live.live_count()), (5, 3));
        assert_eq!(live, rebuilt);
    }

    /// A follower's log restarts at 6 (the leader's snapshot) while the owner reads the
    /// records committed elsewhere: the read stops at 2 with an error. The owner rebuilds from
    /// the new start instead of stopping the partition (it stopped and healed before: a
    /// stop, refused appends and an error in the log, for a normal event of a follower).
    #[tokio::test]
    async fn a_log_restarting_under_a_follow_read_is_rebuilt_without_a_stop() {
        let log = Arc::new(MemLog::default());
        let figures = Arc::new(crate::queue::PartitionFigures::default());
        let handle = spawn(
            context(),
            log.clone(),
            PartitionState::new(0),
            Some(figures.clone()),
        );
        let enqueues = |bodies: &[&str]| -> Vec<(u8, Vec<u8>)> {
            bodies
                .iter()
                .map(|body| (crate::record::ENQUEUE, payload(body)))
                .collect()
        };
        log.push(&enqueues(&["a", "bb", "ccc"]));
        log.restart_during_next_read(2, 6);
        log.commit_foreign(&[PartitionRecord::Noop]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while log.start_offset() != 6 {
            assert!(
                Instant::now() < deadline,
                "the owner never read the records"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Two more after the snapshot, at 6 and 7.
        let range = log.push(&enqueues(&["d", "e"]));
        assert_eq!(range, 6..8);
        log.commit_foreign(&[]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (live, rebuilt) = loop {
            let (live, rebuilt) = handle.state().await.expect("state");
            if live.head() == 8 || Instant::now() > deadline {
                break (live, rebuilt);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        assert_eq!(
            live.head(),
            8,
            "the records after the new start were not applied"
        );
        assert_eq!((live.start(), live.live_count()), (6, 2));
        assert_eq!(live, rebuilt);
        assert_eq!(
            figures.stops.load(Ordering::Relaxed),
            0,
            "the partition stopped for a restart of its log"
        );
    }

    /// A follower rebuilt from a log whose start lies past messages the leader still knows
    /// (their payloads below it, as after a snapshot) applies the leader's PURGE naming them:
    /// the record's byte total covers bytes this state never counted. The owner recounts
    /// from its log; before, its live byte total stayed short (saturating) and differed from
    /// the state rebuilt from the same log (seen in CI: queue "r", 156702 bytes live against
    /// 158834 rebuilt, and the debug check's panic).
    #[tokio::test]
    async fn a_purge_naming_messages_below_the_start_is_recounted() {
        let log = Arc::new(MemLog::default());
        let bodies = ["a", "bb", "ccc", "dddd"];
        let encoded: Vec<(u8, Vec<u8>)> = bodies
            .iter()
            .map(|body| (crate::record::ENQUEUE, payload(body)))
            .collect();
        log.push(&encoded);
        log.restart(2);
        let state = super::super::rebuild(log.as_ref(), None).expect("rebuilt");
        assert_eq!((state.start(), state.live_count()), (2, 2));
        let handle = spawn(context(), log.clone(), state, None);
        let size = |i: usize| payload(bodies[i]).len() as u64;
        log.commit_foreign(&[PartitionRecord::Purge(crate::record::Purge {
            ranges: vec![(0, 3)],
            count: 3,
            bytes: size(0) + size(1) + size(2),
        })]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (live, rebuilt) = loop {
            let (live, rebuilt) = handle.state().await.expect("state");
            let settled = live.head() == 5 && !live.recount_due();
            if settled || Instant::now() > deadline {
                break (live, rebuilt);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        assert_eq!(live.head(), 5, "the purge was not applied");
        assert_eq!(live.live_count(), 1, "message 3 is live");
        assert_eq!(
            live.live_bytes(),
            size(3),
            "the live bytes were not recounted"
        );
        assert_eq!(live, rebuilt);
    }
}
