//! The forwarder task of a [`ReplicatedLog`]: commits and role changes to the owner.

use super::*;
use crate::store::LogStoreReader;

/// Forwards the replica's commits and changes of leadership to the owner, until stopped or the
/// group is gone. When the replica's storage fails (its fence trips) it tells the owner this
/// node no longer leads and shuts the `Raft` down: the proposals in flight end with the
/// storage error (outcome unknown), so the owner stops the partition and heals it (`heal`
/// rebuilds the replica), instead of waiting for entries that will never be flushed.
///
/// A role naming a leader whose client address the node does not know yet (its `HELLO` has
/// not been answered) is looked at again every [`ADDRESS_POLL`] until the address is known,
/// and sent again then: the owner's "not the leader" answers name it from then on.
pub(super) async fn forward(
    answers: Answers,
    raft: ReplicaRaft,
    view: LogStoreReader,
    mut committed: watch::Receiver<u64>,
    mut stop: watch::Receiver<bool>,
    mut seen: (bool, Option<u64>, Option<String>),
) {
    let mut metrics = raft.metrics();
    let mut elected = Elected::default();
    // openraft sends no metrics while a cut-off leader waits, so the quorum check
    // (`quorum_lost`) is also made when the last acknowledgement comes of age.
    let mut check_at = {
        let now = metrics.borrow_watched();
        let elected_at = elected.observe(&now);
        check_time(&now, elected_at)
    };
    let mut address_at = address_time(&seen);
    // Commits made before the owner started (it rebuilt its state from what was committed when
    // the log opened).
    let up_to = *committed.borrow_and_update();
    if up_to > 0 {
        answers.events.send(LogEvent::Committed { up_to });
    }
    loop {
        tokio::select! {
            biased;
            () = stopped(&mut stop) => return,
            () = answers.fence.tripped() => {
                if let Some(reason) = answers.fence.reason() {
                    answers.events.send(LogEvent::Stopped { error: fenced_error(reason) });
                }
                if seen != (false, None, None) {
                    answers.events.send(LogEvent::Role(Role {
                        leading: false,
                        leader: None,
                        addr: None,
                        from: 0,
                    }));
                }
                if let Err(error) = raft.shutdown().await {
                    tracing::warn!(queue = %answers.queue, partition = answers.partition, %error, "shutting a fenced replica down");
                }
                return;
            }
            changed = committed.changed() => {
                if changed.is_err() {
                    return;
                }
                let up_to = *committed.borrow_and_update();
                answers.events.send(LogEvent::Committed { up_to });
                continue;
            }
            changed = metrics.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = sleep_until(check_at) => {}
            () = sleep_until(address_at) => {}
        }
        let now = metrics.borrow_watched();
        let elected_at = elected.observe(&now);
        check_at = check_time(&now, elected_at);
        let role = role_of(answers.id, &now, elected_at, &answers.client_addrs);
        drop(now);
        let now_seen = (role.leading, role.leader, role.addr.clone());
        if now_seen != seen {
            view.set_hold(!now_seen.0);
            seen = now_seen;
            answers.events.send(LogEvent::Role(role));
        }
        address_at = address_time(&seen);
    }
}

/// When this node was elected, as far as the forwarder saw it: the first metrics that showed
/// it leading under its current vote (a leader never acknowledged by a majority is cut off
/// once that is [`QUORUM_LOST_AFTER`] old).
#[derive(Default)]
struct Elected(Option<(crate::types::Vote, tokio::time::Instant)>);

impl Elected {
    /// Since when `metrics` show this node leading under the same vote, if they do.
    fn observe(&mut self, metrics: &RaftMetrics<TypeConfig>) -> Option<tokio::time::Instant> {
        if !metrics.state.is_leader() || metrics.current_leader != Some(metrics.id) {
            self.0 = None;
            return None;
        }
        match &self.0 {
            Some((vote, at)) if *vote == metrics.vote => Some(*at),
            _ => {
                let at = tokio::time::Instant::now();
                self.0 = Some((metrics.vote, at));
                Some(at)
            }
        }
    }
}

/// A follower's leader address unknown is looked at again this often.
const ADDRESS_POLL: Duration = Duration::from_millis(200);

/// When to look for the leader's address again: while a leader other than this node is named
/// without one.
fn address_time(seen: &(bool, Option<u64>, Option<String>)) -> Option<tokio::time::Instant> {
    match seen {
        (false, Some(_), None) => Some(tokio::time::Instant::now() + ADDRESS_POLL),
        _ => None,
    }
}

/// When to check the quorum again ([`quorum_check_in`] from now).
fn check_time(
    metrics: &RaftMetrics<TypeConfig>,
    elected_at: Option<tokio::time::Instant>,
) -> Option<tokio::time::Instant> {
    quorum_check_in(metrics, elected_at).map(|wait| tokio::time::Instant::now() + wait)
}

/// Sleeps until `at`; never resolves for `None`.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Resolves once `stop` is set (or its sender gone), holding no borrow of the value.
pub(super) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}
