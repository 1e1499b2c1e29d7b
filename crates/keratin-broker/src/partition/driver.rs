//! `LogDriver`: what every owner of a [`PartitionLog`](super::log::PartitionLog) keeps about
//! driving it, kept once: its proposals in sequence order, the role and the step-down grace,
//! where records committed elsewhere may be followed up to, and the stop/heal phase. The
//! owners (queue partitions, stream partitions, cursor logs) keep what is theirs: what a
//! request becomes (prepare), how a committed record changes their state (apply), what a role
//! change means to them (delivery, readers), and the I/O itself (proposing, reading, healing
//! run where the owner runs them). The driver does no I/O and reads no clock: the owner passes
//! `now`, so every rule here is a pure function of the calls made (tests run it with tokio's
//! paused time).
//!
//! - **Proposals.** Each gets the next sequence number; the log reports outcomes
//!   ([`LogEvent::Proposed`](super::log::LogEvent)) possibly out of order, and
//!   [`LogDriver::next_released`] hands them back in sequence order. A committed proposal
//!   that landed past the owner's applied head waits: the records before it were proposed
//!   elsewhere (a predecessor's, the replicated log's own entries) and are followed first.
//! - **Role.** When this node stops leading with proposals whose fate is unknown, those wait
//!   [`STEP_DOWN_GRACE`] for the log to tell; then [`LogDriver::grace_expired`] names them, and
//!   the owner answers them `LeadershipLost` (their proposals stay in the log's hands and are
//!   applied if committed after all).
//! - **Following.** Records committed by another node are read only while nothing of this
//!   owner's is pending, or up to the first offset of its oldest pending proposal once that
//!   one is committed past the head ([`LogDriver::follow_limit`]).
//! - **Stop and heal.** A log that failed is never retried in place: the owner stops, heals
//!   (`PartitionLog::heal`, then a rebuild of its state) and only then proposes again. The
//!   first heal is due at once; after a failed one (or one the disk does not allow yet) the
//!   next is due [`HEAL_RETRY`] later.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{BrokerError, BrokerResult};
use crate::partition::log::Role;

/// How long proposals in the log when this node stops leading wait for their fate before they
/// are answered as unknown: a deposed leader that still reaches the others learns it within a
/// few heartbeats (100 ms each), while one cut off from them learns nothing until the cut
/// heals, and its clients had better try the other nodes.
pub(crate) const STEP_DOWN_GRACE: Duration = Duration::from_millis(500);

/// How long after a failed heal (or one the disk does not allow yet) the next is due: a heal
/// reopens and reads the log, so twice a second at most keeps a failing disk from being
/// hammered while a recovered one is back in half a second.
pub(crate) const HEAL_RETRY: Duration = Duration::from_millis(500);

/// One proposal in the log, with what its owner keeps for it.
#[derive(Debug)]
pub(crate) struct Pending<T> {
    /// Its sequence number (the `Proposal::sequence` the log reports back).
    pub(crate) sequence: u64,
    /// How it ended, once the log said: committed at these offsets, or why not.
    pub(crate) outcome: Option<BrokerResult<Range<u64>>>,
    /// The owner's part: its records and whom to answer.
    pub(crate) item: T,
}

/// Where the log stands for proposing.
#[derive(Debug, Clone)]
pub(crate) enum Phase {
    /// Proposals go to the log.
    Running,
    /// The log failed: nothing is proposed; a heal is due at `heal_at`.
    Stopped {
        /// Why it stopped (requests meanwhile are refused with it).
        error: BrokerError,
        /// When the next heal may start.
        heal_at: Instant,
    },
    /// A heal runs (its answer goes to [`LogDriver::heal_done`]).
    Healing {
        /// Why it stopped.
        error: BrokerError,
    },
}

/// See the module docs. `T` is what the owner keeps per proposal.
#[derive(Debug)]
pub(crate) struct LogDriver<T> {
    pending: VecDeque<Pending<T>>,
    next_sequence: u64,
    role: Role,
    /// When proposals pending at a step-down are answered as unknown.
    grace_at: Option<Instant>,
    /// One past the last offset the log reported committed (by any node).
    committed_up_to: u64,
    phase: Phase,
}

impl<T> LogDriver<T> {
    /// A driver of a running log that leads alone (a local log never reports a role), with
    /// `committed_up_to` committed.
    pub(crate) fn new(committed_up_to: u64) -> LogDriver<T> {
        LogDriver {
            pending: VecDeque::new(),
            next_sequence: 0,
            role: Role::alone(),
            grace_at: None,
            committed_up_to,
            phase: Phase::Running,
        }
    }

    // ---- proposals ------------------------------------------------------------------------

    /// Takes a proposal of the owner's and gives its sequence number. Owns the numbering and
    /// the order; leaves the proposing itself (and any refusal because the log is stopped:
    /// see [`LogDriver::stopped`]) to the owner. A proposal made while not leading waits for
    /// its fate only the grace.
    pub(crate) fn propose(&mut self, item: T, now: Instant) -> u64 {
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.pending.push_back(Pending {
            sequence,
            outcome: None,
            item,
        });
        if !self.role.leading && self.grace_at.is_none() {
            self.grace_at = Some(now + STEP_DOWN_GRACE);
        }
        sequence
    }

    /// The log reported how proposal `sequence` ended. False when it is not pending (released
    /// already: a stop drained it).
    pub(crate) fn resolve(&mut self, sequence: u64, outcome: BrokerResult<Range<u64>>) -> bool {
        let Some(index) = self.index_of(sequence) else {
            return false;
        };
        if let Ok(range) = &outcome {
            self.committed_up_to = self.committed_up_to.max(range.end);
        }
        self.pending[index].outcome = Some(outcome);
        if self.pending.iter().all(|p| p.outcome.is_some()) {
            self.grace_at = None;
        }
        true
    }

    /// The oldest proposal, once its outcome is known and it may be acted on: a failure at
    /// once, a commit once every record before it is applied (`head` is one past the owner's
    /// last applied offset; a log commits an owner's proposals past every record before, so
    /// the owner checks the commit starts at its head). Owns the order; leaves applying and
    /// answering to the owner.
    pub(crate) fn next_released(&mut self, head: u64) -> Option<Pending<T>> {
        match &self.pending.front()?.outcome {
            None => return None,
            Some(Ok(range)) if range.start > head => return None,
            Some(_) => {}
        }
        self.pending.pop_front()
    }

    /// The oldest proposal once its outcome is known, wherever it committed: for an owner
    /// whose log stopped (nothing is applied; the heal's rebuild reads what was committed).
    pub(crate) fn next_answered(&mut self) -> Option<Pending<T>> {
        self.pending.front()?.outcome.as_ref()?;
        self.pending.pop_front()
    }

    /// Every pending proposal, oldest first, taken out (a stop: their outcomes are unknown;
    /// an owner that ends).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Pending<T>> + '_ {
        self.grace_at = None;
        self.pending.drain(..)
    }

    /// The pending proposals, oldest first, for the owner's part of them.
    pub(crate) fn pending_mut(&mut self) -> impl Iterator<Item = &mut Pending<T>> {
        self.pending.iter_mut()
    }

    /// The pending proposal `sequence`, if it is.
    pub(crate) fn get_mut(&mut self, sequence: u64) -> Option<&mut Pending<T>> {
        let index = self.index_of(sequence)?;
        self.pending.get_mut(index)
    }

    /// The oldest pending proposal.
    pub(crate) fn oldest(&self) -> Option<&Pending<T>> {
        self.pending.front()
    }

    /// The sequence number the next proposal gets.
    pub(crate) fn next_sequence(&self) -> u64 {
        self.next_sequence
    }

    /// How many proposals are pending.
    pub(crate) fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is pending.
    pub(crate) fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }

    fn index_of(&self, sequence: u64) -> Option<usize> {
        let front = self.pending.front()?.sequence;
        let index = usize::try_from(sequence.checked_sub(front)?).ok()?;
        (index < self.pending.len()).then_some(index)
    }

    // ---- role -----------------------------------------------------------------------------

    /// This node's role, as the log last reported it.
    pub(crate) fn role(&self) -> &Role {
        &self.role
    }

    /// The log reported `role`. Owns the step-down grace: armed when this node stops leading
    /// with proposals whose fate is unknown, dropped when it leads again. Returns the role
    /// before, for what the change means to the owner (delivery, readers), which it keeps.
    pub(crate) fn set_role(&mut self, role: Role, now: Instant) -> Role {
        let before = std::mem::replace(&mut self.role, role);
        if self.role.leading {
            self.grace_at = None;
        } else if before.leading && self.pending.iter().any(|p| p.outcome.is_none()) {
            self.grace_at = Some(now + STEP_DOWN_GRACE);
        }
        before
    }

    /// When the step-down grace ends, if it runs.
    pub(crate) fn grace_at(&self) -> Option<Instant> {
        self.grace_at
    }

    /// The sequences of the proposals whose fate the grace did not learn, once it is over at
    /// `now` (empty before): the owner answers them `LeadershipLost`, and they stay pending
    /// (the log still reports them, and a commit is applied).
    pub(crate) fn grace_expired(&mut self, now: Instant) -> Vec<u64> {
        if self.grace_at.is_none_or(|at| at > now) {
            return Vec::new();
        }
        self.grace_at = None;
        self.pending
            .iter()
            .filter(|p| p.outcome.is_none())
            .map(|p| p.sequence)
            .collect()
    }

    // ---- following ------------------------------------------------------------------------

    /// The log reported every record below `up_to` committed.
    pub(crate) fn committed(&mut self, up_to: u64) {
        self.committed_up_to = self.committed_up_to.max(up_to);
    }

    /// One past the last offset the log reported committed.
    pub(crate) fn committed_up_to(&self) -> u64 {
        self.committed_up_to
    }

    /// Sets what is committed after the log was replaced by an empty one (a reset: it may go
    /// down).
    pub(crate) fn reset_committed(&mut self, up_to: u64) {
        self.committed_up_to = up_to;
    }

    /// Where records committed elsewhere may be applied up to now: the committed end while
    /// nothing of this owner's is pending, the first offset of its oldest pending proposal
    /// once that is committed past `head`, else nowhere.
    pub(crate) fn follow_limit(&self, head: u64) -> Option<u64> {
        match self.pending.front() {
            None => Some(self.committed_up_to),
            Some(Pending {
                outcome: Some(Ok(range)),
                ..
            }) if range.start > head => Some(range.start),
            Some(_) => None,
        }
    }

    /// The records to follow from `head` now, if any (the owner reads them in batches).
    pub(crate) fn follow_due(&self, head: u64) -> Option<Range<u64>> {
        let until = self.follow_limit(head)?;
        (until > head).then_some(head..until)
    }

    // ---- stop and heal --------------------------------------------------------------------

    /// Why the log is stopped (or healing), if it is.
    pub(crate) fn stopped(&self) -> Option<&BrokerError> {
        match &self.phase {
            Phase::Running => None,
            Phase::Stopped { error, .. } | Phase::Healing { error } => Some(error),
        }
    }

    /// The log failed with `error`. True when it was running (a new stop, for the owner's
    /// counting and logging); its first heal is due at once. A stop while stopped or healing
    /// keeps the phase and takes the latest error.
    pub(crate) fn stop(&mut self, error: BrokerError, now: Instant) -> bool {
        match &mut self.phase {
            Phase::Running => {
                self.phase = Phase::Stopped {
                    error,
                    heal_at: now,
                };
                true
            }
            Phase::Stopped { error: stopped, .. } | Phase::Healing { error: stopped } => {
                *stopped = error;
                false
            }
        }
    }

    /// When the next heal is due, while stopped and not healing.
    pub(crate) fn heal_at(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Stopped { heal_at, .. } => Some(*heal_at),
            _ => None,
        }
    }

    /// Whether a heal runs.
    pub(crate) fn is_healing(&self) -> bool {
        matches!(self.phase, Phase::Healing { .. })
    }

    /// Whether a heal is due at `now`.
    pub(crate) fn heal_due(&self, now: Instant) -> bool {
        self.heal_at().is_some_and(|at| at <= now)
    }

    /// A heal may not run yet (the disk has no room for what follows it): due again
    /// [`HEAL_RETRY`] after `now`.
    pub(crate) fn heal_later(&mut self, now: Instant) {
        if let Phase::Stopped { heal_at, .. } = &mut self.phase {
            *heal_at = now + HEAL_RETRY;
        }
    }

    /// A heal starts (the owner runs it). Nothing happens unless stopped.
    pub(crate) fn heal_started(&mut self) {
        if let Phase::Stopped { error, .. } = &self.phase {
            self.phase = Phase::Healing {
                error: error.clone(),
            };
        }
    }

    /// A heal (or a reset, which leaves a fresh log) ended: running again if it worked, else
    /// stopped with the next heal due [`HEAL_RETRY`] after `now`. The stop's error stays what
    /// requests are refused with.
    pub(crate) fn heal_done(&mut self, result: Result<(), ()>, now: Instant) {
        let error = match &self.phase {
            Phase::Running => return,
            Phase::Stopped { error, .. } | Phase::Healing { error } => error.clone(),
        };
        self.phase = match result {
            Ok(()) => Phase::Running,
            Err(()) => Phase::Stopped {
                error,
                heal_at: now + HEAL_RETRY,
            },
        };
    }
}

/// Sleeps until `at`, or for ever without one: an owner's `select!` arm for the driver's next
/// instant (the grace's end, a heal's retry) or its own.
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    //! The driver alone, with tokio's paused time: fails if outcomes were released out of
    //! sequence order or past the applied head, if the grace answered a proposal early, late
    //! or after the log told its fate, if following passed the oldest pending proposal, or if a
    //! heal was retried at once after a failure.

    use super::*;

    fn lost() -> BrokerError {
        BrokerError::NotLeader {
            queue: "q".into(),
            partition: 0,
            leader: Some(2),
            addr: None,
        }
    }

    fn following() -> Role {
        Role {
            leading: false,
            leader: Some(2),
            addr: None,
            from: 0,
        }
    }

    fn storage() -> BrokerError {
        BrokerError::Log(keratin_log::LogError::Invalid("disk".into()))
    }

    #[tokio::test(start_paused = true)]
    async fn outcomes_out_of_order_are_released_in_sequence_order() {
        let mut driver = LogDriver::new(0);
        let now = Instant::now();
        let a = driver.propose("a", now);
        let b = driver.propose("b", now);
        let c = driver.propose("c", now);
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(driver.resolve(c, Ok(3..4)));
        assert!(driver.resolve(b, Err(lost())));
        assert!(driver.next_released(0).is_none(), "a is not answered yet");
        assert!(driver.resolve(a, Ok(0..3)));
        let first = driver.next_released(0).expect("a");
        assert_eq!(
            (first.item, first.outcome.expect("known").ok()),
            ("a", Some(0..3))
        );
        // The owner applied 0..3: the head is 3.
        let second = driver.next_released(3).expect("b");
        assert_eq!(second.item, "b");
        assert!(second.outcome.expect("known").is_err());
        let third = driver.next_released(3).expect("c");
        assert_eq!(
            (third.item, third.outcome.expect("known").ok()),
            ("c", Some(3..4))
        );
        assert!(driver.next_released(4).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_commit_past_the_head_waits_for_the_records_before_it() {
        let mut driver = LogDriver::new(0);
        let now = Instant::now();
        let a = driver.propose("a", now);
        let b = driver.propose("b", now);
        driver.resolve(b, Err(lost()));
        driver.resolve(a, Ok(5..7));
        assert_eq!(driver.committed_up_to(), 7);
        assert!(driver.next_released(3).is_none(), "records 3..5 come first");
        assert_eq!(driver.follow_limit(3), Some(5));
        assert_eq!(driver.follow_due(3), Some(3..5));
        let first = driver.next_released(5).expect("a, at the head");
        assert_eq!((first.sequence, first.item), (0, "a"));
        let second = driver.next_released(7).expect("b, failed");
        assert!(second.outcome.expect("known").is_err());
        assert!(driver.is_idle());
        assert_eq!(driver.follow_limit(7), Some(7));
        assert_eq!(driver.follow_due(7), None);
    }

    #[tokio::test(start_paused = true)]
    async fn following_stops_below_the_oldest_pending_proposal() {
        let mut driver = LogDriver::new(0);
        let now = Instant::now();
        driver.committed(10);
        assert_eq!(driver.follow_due(4), Some(4..10));
        let a = driver.propose((), now);
        assert_eq!(
            driver.follow_limit(4),
            None,
            "its offsets are not known yet"
        );
        driver.resolve(a, Ok(12..13));
        assert_eq!(driver.follow_due(4), Some(4..12));
        assert!(
            driver.resolve(a, Ok(12..13)),
            "still pending until released"
        );
        assert!(!driver.resolve(99, Ok(0..1)), "unknown sequence");
    }

    #[tokio::test(start_paused = true)]
    async fn proposals_pending_at_a_step_down_are_named_after_the_grace() {
        let mut driver = LogDriver::new(0);
        let start = Instant::now();
        let a = driver.propose((), start);
        let b = driver.propose((), start);
        driver.resolve(b, Ok(1..2));
        driver.set_role(following(), start);
        assert_eq!(driver.grace_at(), Some(start + STEP_DOWN_GRACE));
        tokio::time::advance(STEP_DOWN_GRACE - Duration::from_millis(1)).await;
        assert!(driver.grace_expired(Instant::now()).is_empty(), "too early");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            driver.grace_expired(Instant::now()),
            vec![a],
            "b's fate is known"
        );
        assert_eq!(driver.grace_at(), None, "once");
        assert_eq!(driver.pending_count(), 2, "still the log's to report");
    }

    #[tokio::test(start_paused = true)]
    async fn the_grace_ends_when_the_log_tells_or_this_node_leads_again() {
        let mut driver = LogDriver::new(0);
        let now = Instant::now();
        let a = driver.propose((), now);
        driver.set_role(following(), now);
        assert!(driver.grace_at().is_some());
        driver.resolve(a, Err(lost()));
        assert_eq!(driver.grace_at(), None, "every fate is known");

        let b = driver.propose((), now);
        assert!(driver.grace_at().is_some(), "proposed while following");
        let before = driver.set_role(Role::alone(), now);
        assert!(!before.leading);
        assert_eq!(driver.grace_at(), None, "leads again");
        tokio::time::advance(STEP_DOWN_GRACE * 2).await;
        assert!(driver.grace_expired(Instant::now()).is_empty());
        assert!(driver.get_mut(b).is_some());
        assert!(driver.set_role(following(), Instant::now()).leading);
        assert!(driver.grace_at().is_some(), "a step-down with b unknown");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_heal_is_retried_after_the_pause_never_at_once() {
        let mut driver: LogDriver<()> = LogDriver::new(0);
        let start = Instant::now();
        assert!(driver.stopped().is_none());
        assert!(driver.stop(storage(), start), "a new stop");
        assert!(!driver.stop(storage(), start), "counted once");
        assert!(driver.heal_due(start), "the first heal is due at once");
        driver.heal_started();
        assert!(driver.is_healing());
        assert!(driver.stopped().is_some(), "refused while healing");
        assert!(!driver.heal_due(start));
        driver.heal_done(Err(()), start);
        assert!(!driver.heal_due(start), "not retried in place");
        assert_eq!(driver.heal_at(), Some(start + HEAL_RETRY));
        tokio::time::advance(HEAL_RETRY).await;
        assert!(driver.heal_due(Instant::now()));
        driver.heal_later(Instant::now());
        assert!(!driver.heal_due(Instant::now()), "the disk said not yet");
        tokio::time::advance(HEAL_RETRY).await;
        driver.heal_started();
        driver.heal_done(Ok(()), Instant::now());
        assert!(matches!(driver.phase, Phase::Running));
        assert!(driver.stopped().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_drains_every_pending_proposal_in_order() {
        let mut driver = LogDriver::new(0);
        let now = Instant::now();
        for item in ["a", "b", "c"] {
            driver.propose(item, now);
        }
        driver.resolve(1, Ok(0..1));
        driver.set_role(following(), now);
        let drained: Vec<_> = driver.drain().map(|p| p.item).collect();
        assert_eq!(drained, ["a", "b", "c"]);
        assert_eq!(driver.grace_at(), None);
        assert_eq!(driver.propose("d", now), 3, "numbers never repeat");
    }
}
