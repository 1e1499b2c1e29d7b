//! Prepare: commands to records, as pure functions of what the owner knows. No I/O, no state
//! change: what these return is proposed to the partition log, and the state machine
//! (`state.rs`) changes only when a record is applied. A replicated partition runs them on its
//! leader only; followers apply what the leader's records say.
//!
//! Owns: the records of a publish, of settles and returns (batched into records of at most
//! [`CONTROL_ENTRIES_MAX`] entries), of a purge (ranges cut around busy messages, totals on the
//! first record), of a settings change, and the queue limits' verdict on a batch. Leaves to the
//! owner: the bookkeeping of what is being written (reservations, `limbo`, `dropping`), picking
//! the messages `drop_oldest` drops, and the figures.

use std::collections::BTreeSet;

use crate::error::BrokerError;
use crate::queue::{Overflow, PartitionLimits, QueueSettings};
use crate::record::{Message, PartitionRecord, Purge, Returned, Settled};

/// Most entries in one SETTLE, RETURN or PURGE record: 4,096 entries of at most 16 bytes are
/// 64 KiB, well inside the smallest segment (256 KiB), so no round of acks is ever too large to
/// write.
pub(crate) const CONTROL_ENTRIES_MAX: usize = 4096;

/// The largest control record: `CONTROL_ENTRIES_MAX` entries of at most 16 bytes, plus its
/// record header and framing, rounded up to a 4 KiB page (64 KiB + 4 KiB). A single node's
/// log keeps this much allocated behind every message it writes (`local_log.rs`), so that
/// the settle records after it are written even on a full disk.
pub(crate) const CONTROL_RECORD_BYTES_MAX: u64 = CONTROL_ENTRIES_MAX as u64 * 16 + 4096;

/// The retry hint of `queue_full`: a consumer frees room at its own pace, so a second is a
/// reasonable first wait; clients back off further on repeated refusals.
pub(crate) const QUEUE_FULL_RETRY_AFTER_MS: u32 = 1000;

/// The ENQUEUE records of a publish, one per payload (the payloads are written as they are;
/// a payload's producer mark was checked when the message was encoded).
pub(crate) fn enqueues(payloads: &[Vec<u8>]) -> Vec<PartitionRecord> {
    payloads
        .iter()
        .map(|p| PartitionRecord::Enqueue {
            size_bytes: p.len() as u32,
            producer: Message::producer_of(p, 0).ok().flatten(),
        })
        .collect()
}

/// SETTLE records of at most `CONTROL_ENTRIES_MAX` entries each, so that a round of many acks
/// never makes a record larger than a segment.
pub(crate) fn settles(settled: &[Settled]) -> Vec<PartitionRecord> {
    settled
        .chunks(CONTROL_ENTRIES_MAX)
        .map(|chunk| PartitionRecord::Settle(chunk.to_vec()))
        .collect()
}

/// RETURN records of at most `CONTROL_ENTRIES_MAX` entries each.
pub(crate) fn returns(returned: &[Returned]) -> Vec<PartitionRecord> {
    returned
        .chunks(CONTROL_ENTRIES_MAX)
        .map(|chunk| PartitionRecord::Return(chunk.to_vec()))
        .collect()
}

/// The SETTINGS record of a live queue's new settings (none if they do not serialize, which
/// plain data never fails to).
pub(crate) fn settings(settings: &QueueSettings) -> Option<PartitionRecord> {
    serde_json::to_vec(settings)
        .ok()
        .map(PartitionRecord::Settings)
}

/// What a purge writes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PurgePlan {
    /// Messages removed: the ids the ranges cover.
    pub(crate) count: u64,
    /// Their bytes.
    pub(crate) bytes: u64,
    /// PURGE records of at most `CONTROL_ENTRIES_MAX` ranges; the totals ride on the first
    /// (applying them is additive). Empty when nothing is ready.
    pub(crate) records: Vec<PartitionRecord>,
}

/// A purge of the ready messages: the live ranges with the `busy` ids (inflight, leaving) cut
/// out; `ready_bytes` is the live bytes less the busy messages'. The ranges are authoritative:
/// the count is taken from them, so it cannot underflow.
pub(crate) fn purge(
    live_ranges: Vec<(u64, u64)>,
    busy: &BTreeSet<u64>,
    ready_bytes: u64,
) -> PurgePlan {
    let ranges = split_around(live_ranges, busy);
    let count: u64 = ranges.iter().map(|(start, end)| end - start).sum();
    if count == 0 {
        return PurgePlan {
            count: 0,
            bytes: 0,
            records: Vec::new(),
        };
    }
    let mut totals = Some((count, ready_bytes));
    let records = ranges
        .chunks(CONTROL_ENTRIES_MAX)
        .map(|chunk| {
            let (count_part, bytes_part) = totals.take().unwrap_or((0, 0));
            PartitionRecord::Purge(Purge {
                ranges: chunk.to_vec(),
                count: count_part,
                bytes: bytes_part,
            })
        })
        .collect();
    PurgePlan {
        count,
        bytes: ready_bytes,
        records,
    }
}

/// Cut the message ids in `busy` out of `ranges`.
pub(crate) fn split_around(ranges: Vec<(u64, u64)>, busy: &BTreeSet<u64>) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        let mut at = start;
        for &b in busy.range(start..end) {
            if at < b {
                out.push((at, b));
            }
            at = b + 1;
        }
        if at < end {
            out.push((at, end));
        }
    }
    out
}

/// The queue limits' verdict on a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitVerdict {
    /// It fits as things are.
    Fits,
    /// It fits once the oldest droppable messages are dropped (`drop_oldest`).
    FitsAfterDrop,
    /// It does not fit now: refuse as `queue_full`.
    Full,
    /// It exceeds the limits on its own: it never fits.
    NeverFits,
}

/// Messages and bytes.
pub(crate) type Amount = (u64, u64);

/// Judge a batch of `batch` (messages, bytes) against `limits`, where `used` is what counts
/// now (live, plus admitted and not applied, less what is leaving). `droppable` gives what
/// `drop_oldest` may drop (the ready messages, and those of earlier publishes admitted and not
/// yet applied: all but the inflight ones), or `None` when nothing may be dropped now (a purge
/// is pending); it is asked only when the answer depends on it. All or nothing.
pub(crate) fn limit_verdict(
    limits: &PartitionLimits,
    used: Amount,
    batch: Amount,
    droppable: impl FnOnce() -> Option<Amount>,
) -> LimitVerdict {
    if !limits.is_set() || !over_limits(limits, (used.0 + batch.0, used.1 + batch.1)) {
        return LimitVerdict::Fits;
    }
    if over_limits(limits, batch) {
        return LimitVerdict::NeverFits;
    }
    if limits.overflow == Overflow::Reject {
        return LimitVerdict::Full;
    }
    let Some((ready_count, ready_bytes)) = droppable() else {
        return LimitVerdict::Full;
    };
    let kept = (
        used.0.saturating_sub(ready_count) + batch.0,
        used.1.saturating_sub(ready_bytes) + batch.1,
    );
    if over_limits(limits, kept) {
        LimitVerdict::Full
    } else {
        LimitVerdict::FitsAfterDrop
    }
}

/// `amount` (messages, bytes) is over a limit.
pub(crate) fn over_limits(limits: &PartitionLimits, (count, bytes): Amount) -> bool {
    limits.max_messages.is_some_and(|max| count > max)
        || limits.max_bytes.is_some_and(|max| bytes > max)
}

/// Below both limits: a small publish fits again.
pub(crate) fn has_room(limits: &PartitionLimits, (count, bytes): Amount) -> bool {
    !(limits.max_messages.is_some_and(|max| count >= max)
        || limits.max_bytes.is_some_and(|max| bytes >= max))
}

/// The refusal of a batch that does not fit now.
pub(crate) fn queue_full_error(limits: &PartitionLimits, queue: &str, index: u32) -> BrokerError {
    let what = match (limits.max_messages, limits.max_bytes) {
        (Some(m), Some(b)) => format!("max_messages {m} or max_bytes {b} per partition"),
        (Some(m), None) => format!("max_messages {m} per partition"),
        (None, Some(b)) => format!("max_bytes {b} per partition"),
        (None, None) => "its limit".into(),
    };
    BrokerError::Limited {
        reason: "queue_full".into(),
        retry_after_ms: QUEUE_FULL_RETRY_AFTER_MS,
        message: format!(
            "queue {queue:?} partition {index} is full ({what}); consume messages or raise the \
             limit; retry after {QUEUE_FULL_RETRY_AFTER_MS} ms"
        ),
    }
}

/// The refusal of a batch that can never fit.
pub(crate) fn never_fits_error(batch: Amount, queue: &str) -> BrokerError {
    let (count, bytes) = batch;
    BrokerError::Invalid(format!(
        "a batch of {count} messages and {bytes} bytes can never fit queue {queue:?}'s limits; \
         send smaller batches"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Outcome;

    fn limits(max_messages: Option<u64>, overflow: Overflow) -> PartitionLimits {
        PartitionLimits {
            max_messages,
            max_bytes: None,
            overflow,
        }
    }

    #[test]
    fn split_around_cuts_busy_ids_out() {
        let busy: BTreeSet<u64> = [2, 3, 7].into_iter().collect();
        assert_eq!(
            split_around(vec![(0, 5), (6, 9)], &busy),
            vec![(0, 2), (4, 5), (6, 7), (8, 9)]
        );
    }

    #[test]
    fn enqueues_carry_each_payload_size() {
        let records = enqueues(&[vec![0; 3], vec![0; 5]]);
        assert_eq!(
            records,
            vec![
                PartitionRecord::Enqueue {
                    size_bytes: 3,
                    producer: None
                },
                PartitionRecord::Enqueue {
                    size_bytes: 5,
                    producer: None
                }
            ]
        );
    }

    #[test]
    fn settles_and_returns_are_batched_by_the_entry_bound() {
        let settled: Vec<Settled> = (0..CONTROL_ENTRIES_MAX as u64 * 2 + 1)
            .map(|message| Settled {
                message,
                size_bytes: 1,
                outcome: Outcome::Acked,
            })
            .collect();
        let sizes: Vec<usize> = settles(&settled)
            .iter()
            .map(|r| match r {
                PartitionRecord::Settle(entries) => entries.len(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(sizes, vec![CONTROL_ENTRIES_MAX, CONTROL_ENTRIES_MAX, 1]);
        let returned = [Returned {
            message: 4,
            delivery_count: 2,
        }];
        assert_eq!(
            returns(&returned),
            vec![PartitionRecord::Return(returned.to_vec())]
        );
        assert!(settles(&[]).is_empty() && returns(&[]).is_empty());
    }

    #[test]
    fn purge_cuts_busy_messages_and_puts_totals_on_the_first_record() {
        // Ranges alternate live and dead, so that there are more than one record's worth.
        let n = CONTROL_ENTRIES_MAX as u64 + 2;
        let live: Vec<(u64, u64)> = (0..n).map(|i| (i * 2, i * 2 + 1)).collect();
        let busy: BTreeSet<u64> = [0].into_iter().collect();
        let plan = purge(live, &busy, 99);
        assert_eq!((plan.count, plan.bytes), (n - 1, 99));
        assert_eq!(plan.records.len(), 2);
        let totals: Vec<(u64, u64)> = plan
            .records
            .iter()
            .map(|r| match r {
                PartitionRecord::Purge(p) => (p.count, p.bytes),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(totals[0], (n - 1, 99));
        assert!(totals[1..].iter().all(|t| *t == (0, 0)));
        let nothing = purge(vec![(3, 4)], &[3].into_iter().collect(), 0);
        assert!(nothing.records.is_empty() && nothing.count == 0);
    }

    #[test]
    fn limits_reject_drop_oldest_and_never_fits() {
        let reject = limits(Some(10), Overflow::Reject);
        let no_ready = || None;
        assert_eq!(
            limit_verdict(&reject, (9, 0), (1, 0), no_ready),
            LimitVerdict::Fits
        );
        assert_eq!(
            limit_verdict(&reject, (10, 0), (1, 0), no_ready),
            LimitVerdict::Full
        );
        assert_eq!(
            limit_verdict(&reject, (0, 0), (11, 0), no_ready),
            LimitVerdict::NeverFits
        );
        let drop = limits(Some(10), Overflow::DropOldest);
        // Four ready messages can go: a batch of four fits after dropping, five does not.
        assert_eq!(
            limit_verdict(&drop, (10, 0), (4, 0), || Some((4, 0))),
            LimitVerdict::FitsAfterDrop
        );
        assert_eq!(
            limit_verdict(&drop, (10, 0), (5, 0), || Some((4, 0))),
            LimitVerdict::Full
        );
        // A pending purge: nothing may be dropped.
        assert_eq!(
            limit_verdict(&drop, (10, 0), (1, 0), no_ready),
            LimitVerdict::Full
        );
        let unset = limits(None, Overflow::Reject);
        assert_eq!(
            limit_verdict(&unset, (u64::MAX / 2, 0), (1, 0), no_ready),
            LimitVerdict::Fits
        );
        assert!(has_room(&reject, (9, 0)) && !has_room(&reject, (10, 0)));
    }
}
