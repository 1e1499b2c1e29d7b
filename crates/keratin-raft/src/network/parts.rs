//! Large appends in parts. openraft 0.10.0-alpha.37 puts up to `max_payload_entries` entries in
//! one append whatever their size, and has no "payload too large" answer to make it send fewer:
//! an append of many large entries (a queue of 1 MiB messages) would not fit the transport's
//! frame, fail as unreachable, and be sent again just as large, for good. So the sending side
//! cuts an append whose body is over [`APPEND_PART_BYTES`] into consecutive appends (each one's
//! previous entry the last of the part before), sends them one after the other, and answers
//! openraft for the whole ([`Combined`]). An entry larger than the budget goes alone (the
//! cluster transport's frame limit leaves room for the largest message of a client frame).

use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse};

use super::rpc::append_entry_bytes;
use crate::types::TypeConfig;

/// Most entry bytes in one append sent as a part (8 MiB: half the transport's frame limit, so a
/// part stays well inside it and a follower's write of it stays short).
pub(crate) const APPEND_PART_BYTES: usize = 8 << 20;

/// `rpc` as the appends to send, in order: itself when its entries fit in `budget` bytes (or it
/// has one entry or none), otherwise consecutive parts of at most `budget` entry bytes, each
/// with at least one entry.
pub(crate) fn split(
    rpc: AppendEntriesRequest<TypeConfig>,
    budget: usize,
) -> Vec<AppendEntriesRequest<TypeConfig>> {
    let total: usize = rpc.entries.iter().map(append_entry_bytes).sum();
    if total <= budget || rpc.entries.len() <= 1 {
        return vec![rpc];
    }
    let AppendEntriesRequest {
        vote,
        prev_log_id,
        leader_commit,
        entries,
    } = rpc;
    let mut parts = Vec::new();
    let mut prev = prev_log_id;
    let mut part = Vec::new();
    let mut part_bytes = 0;
    let mut close = |part: Vec<_>, prev: &mut Option<_>| {
        let last = part.last().map(|entry: &crate::types::Entry| entry.log_id);
        parts.push(AppendEntriesRequest {
            vote,
            prev_log_id: *prev,
            // A part never tells the follower that entries past it are committed: the
            // follower's commit stays within what it has received.
            leader_commit: std::cmp::min(leader_commit, last),
            entries: part,
        });
        *prev = last;
    };
    for entry in entries {
        let bytes = append_entry_bytes(&entry);
        if !part.is_empty() && part_bytes + bytes > budget {
            close(std::mem::take(&mut part), &mut prev);
            part_bytes = 0;
        }
        part_bytes += bytes;
        part.push(entry);
    }
    close(part, &mut prev);
    parts
}

/// The answer to openraft for an append sent in parts, built from the parts' replies in order.
#[derive(Debug, Default)]
pub(crate) struct Combined {
    /// The last entry of the parts the follower took so far.
    matched: Option<crate::types::LogId>,
    parts_done: usize,
}

impl Combined {
    /// Take the reply to the next part (`last`: that part's last entry). `Some` ends the
    /// exchange with openraft's answer; `None` means send the next part.
    pub(crate) fn reply(
        &mut self,
        reply: AppendEntriesResponse<TypeConfig>,
        last: Option<crate::types::LogId>,
    ) -> Option<AppendEntriesResponse<TypeConfig>> {
        let first = self.parts_done == 0;
        self.parts_done += 1;
        match reply {
            AppendEntriesResponse::Success => {
                self.matched = last;
                None
            }
            // The follower took a prefix of this part: so much of the whole is matched.
            AppendEntriesResponse::PartialSuccess(matching) => {
                Some(AppendEntriesResponse::PartialSuccess(matching))
            }
            // Only the first part's previous entry is the leader's claim; a later one is the
            // part before, which the follower just took: report what it took.
            AppendEntriesResponse::Conflict if first => Some(AppendEntriesResponse::Conflict),
            AppendEntriesResponse::Conflict => {
                Some(AppendEntriesResponse::PartialSuccess(self.matched))
            }
            AppendEntriesResponse::HigherVote(vote) => {
                Some(AppendEntriesResponse::HigherVote(vote))
            }
        }
    }

    /// Every part was taken.
    pub(crate) fn done(self) -> AppendEntriesResponse<TypeConfig> {
        AppendEntriesResponse::Success
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Entry, LeaderId, LogId, PartitionRecord, Payload, Vote};

    fn log_id(index: u64) -> LogId {
        LogId::new(
            LeaderId {
                term: 2,
                node_id: 1,
            },
            index,
        )
    }

    fn entry(index: u64, size: usize) -> Entry {
        Entry {
            log_id: log_id(index),
            payload: Payload::Normal(PartitionRecord::new(1, 0, vec![7; size]).expect("record")),
        }
    }

    fn request(sizes: &[usize]) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(2, 1),
            prev_log_id: Some(log_id(9)),
            leader_commit: Some(log_id(100)),
            entries: sizes
                .iter()
                .enumerate()
                .map(|(n, size)| entry(10 + n as u64, *size))
                .collect(),
        }
    }

    #[test]
    fn an_append_within_the_budget_goes_whole() {
        let parts = split(request(&[100, 100, 100]), 10_000);
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].entries.len(), 3);
        assert_eq!(parts[0].leader_commit, Some(log_id(100)));
    }

    #[test]
    fn a_large_append_goes_in_consecutive_parts_within_the_budget() {
        let budget = 1_000;
        let parts = split(request(&[400, 400, 400, 3_000, 10, 10]), budget);
        let counts: Vec<usize> = parts.iter().map(|p| p.entries.len()).collect();
        // Two of 400 fit; the 3,000-byte entry goes alone; the small ones follow together.
        assert_eq!(counts, vec![2, 1, 1, 2]);
        let mut prev = Some(log_id(9));
        let mut next = 10;
        for part in &parts {
            assert_eq!(part.prev_log_id, prev);
            for entry in &part.entries {
                assert_eq!(entry.log_id.index, next);
                next += 1;
            }
            let last = part.entries.last().map(|e| e.log_id);
            assert!(part.leader_commit <= last, "a part commits past itself");
            let bytes: usize = part.entries.iter().map(append_entry_bytes).sum();
            assert!(bytes <= budget || part.entries.len() == 1);
            prev = last;
        }
        assert_eq!(next, 16);
        assert_eq!(parts.last().unwrap().leader_commit, Some(log_id(15)));
    }

    #[test]
    fn replies_combine_into_one_answer() {
        let mut all = Combined::default();
        assert!(all
            .reply(AppendEntriesResponse::Success, Some(log_id(11)))
            .is_none());
        assert!(all
            .reply(AppendEntriesResponse::Success, Some(log_id(12)))
            .is_none());
        assert!(matches!(all.done(), AppendEntriesResponse::Success));

        let mut conflict_first = Combined::default();
        assert!(matches!(
            conflict_first.reply(AppendEntriesResponse::Conflict, Some(log_id(11))),
            Some(AppendEntriesResponse::Conflict)
        ));

        let mut conflict_later = Combined::default();
        assert!(conflict_later
            .reply(AppendEntriesResponse::Success, Some(log_id(11)))
            .is_none());
        assert!(matches!(
            conflict_later.reply(AppendEntriesResponse::Conflict, Some(log_id(12))),
            Some(AppendEntriesResponse::PartialSuccess(Some(id))) if id == log_id(11)
        ));

        let mut higher = Combined::default();
        let vote = Vote::new(5, 3);
        assert!(matches!(
            higher.reply(AppendEntriesResponse::HigherVote(vote), None),
            Some(AppendEntriesResponse::HigherVote(v)) if v == vote
        ));
    }
}
