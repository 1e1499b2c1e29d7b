//! [`PendingEnds`]: a stream consumer's partition ends on their way from the connection task to
//! the consumer's handle, kept beside its event channel rather than in it.
//!
//! The channel holds at most the consumer's credit in `StreamDeliver` frames (each carries at
//! least one message of the credit) plus one wake token. Partition ends are not bounded by the
//! credit: a consumer group hands a partition away (409) and back any number of times while the
//! application reads nothing, and each hand-over ends the partition again. So ends wait here,
//! at most one per partition (the latest: an end supersedes an earlier one of its partition,
//! whose effect it repeats), each with the number of frames the task had put in the channel
//! before it, so that the handle takes an end in only after the messages that came before it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use keratin_proto::StreamPartitionEnd;

/// Shared by the connection task (which records) and the consumer's handle (which takes).
pub(crate) type StreamEnds = Arc<Mutex<PendingEnds>>;

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct PendingEnds {
    /// Per partition, its latest end not yet taken, and how many frames the task had sent to
    /// the channel before it.
    by_partition: BTreeMap<u32, (u64, StreamPartitionEnd)>,
    /// A wake token is in the channel and not yet taken (so one more is not needed).
    token_sent: bool,
}

impl PendingEnds {
    /// Records `end`, which the broker sent after the task had put `frames_sent` frames in the
    /// channel. True if the handle must be woken with a token (none is in the channel yet);
    /// the caller then calls [`PendingEnds::token_sent`] once the token is in.
    pub(crate) fn record(&mut self, end: StreamPartitionEnd, frames_sent: u64) -> bool {
        self.by_partition.insert(end.partition, (frames_sent, end));
        !self.token_sent
    }

    /// A wake token went into the channel.
    pub(crate) fn token_sent(&mut self) {
        self.token_sent = true;
    }

    /// The handle took the wake token out of the channel.
    pub(crate) fn token_taken(&mut self) {
        self.token_sent = false;
    }

    /// The ends due once the handle took `frames_received` frames out of the channel, in the
    /// order the broker sent them.
    pub(crate) fn take_due(&mut self, frames_received: u64) -> Vec<StreamPartitionEnd> {
        let due: Vec<u32> = self
            .by_partition
            .iter()
            .filter(|(_, (after, _))| *after <= frames_received)
            .map(|(&partition, _)| partition)
            .collect();
        let mut ends: Vec<(u64, StreamPartitionEnd)> = due
            .into_iter()
            .filter_map(|partition| self.by_partition.remove(&partition))
            .collect();
        ends.sort_by_key(|(after, _)| *after);
        ends.into_iter().map(|(_, end)| end).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_proto::codes::{ERR_CONFLICT, ERR_NOT_FOUND};
    use keratin_proto::ErrorBody;

    fn end(partition: u32, code: keratin_proto::Code) -> StreamPartitionEnd {
        StreamPartitionEnd {
            consumer_tag: "t".into(),
            partition,
            error: ErrorBody::new(code, format!("end {partition}")),
        }
    }

    #[test]
    fn keeps_the_latest_end_of_a_partition_and_one_token() {
        let mut ends = PendingEnds::default();
        assert!(
            ends.record(end(1, ERR_CONFLICT), 0),
            "the first wakes the handle"
        );
        ends.token_sent();
        for frames in 1..1000 {
            assert!(!ends.record(end(1, ERR_CONFLICT), frames), "a token is in");
        }
        assert!(!ends.record(end(2, ERR_NOT_FOUND), 5));
        assert_eq!(ends.by_partition.len(), 2, "bounded by the partitions");
        // Partition 1's latest end came after 999 frames: not due after 5.
        let due = ends.take_due(5);
        assert_eq!(due.len(), 1);
        assert_eq!((due[0].partition, due[0].error.code()), (2, ERR_NOT_FOUND));
        ends.token_taken();
        assert!(ends.take_due(998).is_empty());
        let due = ends.take_due(999);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].partition, 1);
        assert!(ends.take_due(u64::MAX).is_empty(), "taken once");
        assert!(ends.record(end(3, ERR_CONFLICT), 1000), "no token in: wake");
    }

    #[test]
    fn due_ends_come_in_the_order_sent() {
        let mut ends = PendingEnds::default();
        ends.record(end(7, ERR_CONFLICT), 2);
        ends.record(end(3, ERR_CONFLICT), 4);
        ends.record(end(5, ERR_CONFLICT), 3);
        let order: Vec<u32> = ends.take_due(4).iter().map(|e| e.partition).collect();
        assert_eq!(order, vec![7, 5, 3]);
    }
}
