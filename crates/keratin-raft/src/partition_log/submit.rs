//! The ordered submitter of a [`ReplicatedLog`] and the outcome of each proposal.

use super::forward::stopped;
use super::*;

/// A proposal on its way to the submitter.
pub(super) struct Submission {
    pub(super) sequence: u64,
    pub(super) records: Vec<PartitionRecord>,
}

/// What the log's tasks need to turn openraft's answers into the broker's.
#[derive(Clone)]
pub(super) struct Answers {
    pub(super) id: u64,
    pub(super) queue: String,
    pub(super) partition: u32,
    pub(super) client_addrs: ClientAddrs,
    pub(super) fence: Fence,
    pub(super) events: LogEvents,
}

impl Answers {
    /// The refusal of a write openraft did not take, naming `leader` unless that is this node
    /// (a deposed leader's own vote: clients sent back here would loop).
    pub(super) fn not_leader(&self, leader: Option<u64>) -> BrokerError {
        let leader = leader.filter(|leader| *leader != self.id);
        BrokerError::NotLeader {
            queue: self.queue.clone(),
            partition: self.partition,
            leader,
            addr: leader.and_then(|id| (self.client_addrs)(id)),
        }
    }

    /// A write openraft answered with an error, `committed` entries of the same proposal
    /// before it having been committed.
    ///
    /// Only a refusal before anything was appended (`ForwardToLeader` on the proposal's first
    /// entry) is "not the leader": nothing was written, and any client may send it again. An
    /// entry openraft discarded when this node adopted another leader's log
    /// (`LogEntryDiscarded`) may have been committed by that leader or may still be by a later
    /// one (openraft: "commit status unknown"), and a proposal whose first entries were
    /// committed is stored in part: both are answered as unknown
    /// ([`BrokerError::LeadershipLost`], 504), which only an idempotent producer resends.
    pub(super) fn write_error(
        &self,
        error: ClientWriteError<TypeConfig>,
        committed: usize,
    ) -> BrokerError {
        match error {
            // A leader without a lease answers with no leader named: itself, as far as a
            // client can tell, once its lease is back.
            ClientWriteError::ForwardToLeader(forward) if committed == 0 => {
                self.not_leader(forward.leader_id)
            }
            ClientWriteError::ForwardToLeader(forward)
            | ClientWriteError::LogEntryDiscarded(forward) => {
                let leader = forward.leader_id.filter(|leader| *leader != self.id);
                let now = match leader.and_then(|id| (self.client_addrs)(id).map(|a| (id, a))) {
                    Some((id, addr)) => format!("node {id} at {addr} leads it now"),
                    None => match leader {
                        Some(id) => format!("node {id} leads it now"),
                        None => "no leader is known here".to_string(),
                    },
                };
                BrokerError::LeadershipLost {
                    queue: self.queue.clone(),
                    partition: self.partition,
                    why: format!(
                        "this node's copy dropped the publish's records from {} on when it \
                         took the new leader's log, {committed} before them were committed, \
                         and that leader may still commit the rest; {now}",
                        if committed == 0 {
                            "the first"
                        } else {
                            "the next"
                        }
                    ),
                }
            }
            other => BrokerError::Invalid(format!(
                "partition {} of {:?}: the replica refused a write: {other}",
                self.partition, self.queue
            )),
        }
    }

    /// The group stopped under a proposal: its storage fenced, or the `Raft` shut down. The
    /// records may be committed.
    pub(super) fn stopped(&self, fatal: &Fatal<TypeConfig>) -> BrokerError {
        BrokerError::Log(match self.fence.reason() {
            Some(reason) => fenced_error(reason),
            None => LogError::Invalid(format!(
                "partition {} of {:?}: its Raft group stopped on node {} ({fatal}); the \
                 proposal may or may not be committed",
                self.partition, self.queue, self.id
            )),
        })
    }
}

/// The one submitter: hands proposals to openraft in their order, without waiting for one to
/// commit before the next; each outcome is awaited on a task of its own.
pub(super) async fn submit(
    answers: Answers,
    raft: ReplicaRaft,
    mut queue: mpsc::Receiver<Submission>,
    mut stop: watch::Receiver<bool>,
) {
    let in_flight = Arc::new(Semaphore::new(PROPOSALS_IN_FLIGHT_MAX));
    loop {
        let submission = tokio::select! {
            biased;
            () = stopped(&mut stop) => return,
            submission = queue.recv() => match submission {
                Some(submission) => submission,
                None => return,
            },
        };
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let Submission { sequence, records } = submission;
        let count = records.len() as u64;
        match raft.client_write_many(records).await {
            Err(fatal) => answers.events.send(LogEvent::Proposed {
                sequence,
                result: Err(answers.stopped(&fatal)),
            }),
            Ok(results) => {
                let answers = answers.clone();
                tokio::spawn(async move {
                    let result = outcome(&answers, results, count).await;
                    drop(permit);
                    answers.events.send(LogEvent::Proposed { sequence, result });
                });
            }
        }
    }
}

/// Per-entry answers of one proposal, in order.
pub(super) type WriteResults =
    BoxStream<'static, Result<WriteResult<TypeConfig>, Fatal<TypeConfig>>>;

/// The offsets of a proposal of `count` records once every one is committed, or why not.
pub(super) async fn outcome(
    answers: &Answers,
    mut results: WriteResults,
    count: u64,
) -> BrokerResult<Range<u64>> {
    let mut offsets = crate::replica::Offsets::default();
    let mut committed = 0usize;
    while let Some(result) = results.next().await {
        // The first failure decides (a deposed leader's entries behind a cut one are cut
        // too); what it means depends on whether entries before it were committed.
        let written = result
            .map_err(|fatal| answers.stopped(&fatal))?
            .map_err(|error| answers.write_error(error, committed))?;
        offsets.push(written.log_id.index);
        committed += 1;
    }
    Ok(offsets.finish(count))
}
