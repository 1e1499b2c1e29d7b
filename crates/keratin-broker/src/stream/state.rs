//! The state of one stream partition, applied from its payload log's records in offset order
//! (`docs/streams.md`, "Payload log records"). It is small however long the stream: the
//! message count and bytes over the partition's history, the idempotent producers' windows,
//! the settings, and where the last checkpoint is. A node rebuilds it from the last
//! checkpoint (`stream/rebuild.rs`), not from the log's start.
//!
//! Checkpoints describe the applied state at their offset, so the owner writes one only when
//! every record it proposed before is applied (nothing in flight): it holds new appends while
//! a due checkpoint waits for the pipeline to empty, then proposes the checkpoint first. A
//! checkpoint that does not match the state it is applied to is a broken invariant (the log or
//! the owner is wrong): applying it fails with `Corrupt`, and the partition stops instead of
//! rebuilding wrong counts or windows from it later.

use crate::error::{BrokerError, BrokerResult};
use crate::partition::producers::{ProducerWindows, Verdict};
use crate::record::Message;
use crate::stream::records::{Checkpoint, StreamRecord, StreamSettings};

/// What applying a record did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A message: `stored` is false for an idempotent producer's duplicate (never read).
    Message {
        /// True unless a duplicate.
        stored: bool,
    },
    /// Settings, a checkpoint or a no-op: nothing a reader sees.
    Control,
}

/// One stream partition's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPartitionState {
    /// One past the last applied offset.
    next_offset: u64,
    /// Messages appended over the partition's history (duplicates not counted).
    messages: u64,
    /// Their payload bytes.
    bytes: u64,
    producers: ProducerWindows,
    /// The settings of the last `STREAM_SETTINGS` applied, if any.
    settings: Option<StreamSettings>,
    /// Offset of the last checkpoint applied.
    last_checkpoint: Option<u64>,
    /// Payload bytes of the records applied since the last checkpoint (or the start).
    bytes_since_checkpoint: u64,
    /// Timestamp of the newest record applied (0 before any).
    newest_timestamp_ms: u64,
}

impl StreamPartitionState {
    /// The state of a log holding nothing before `start` (a new partition: 0).
    pub fn new(start: u64) -> StreamPartitionState {
        StreamPartitionState {
            next_offset: start,
            messages: 0,
            bytes: 0,
            producers: ProducerWindows::new(),
            settings: None,
            last_checkpoint: None,
            bytes_since_checkpoint: 0,
            newest_timestamp_ms: 0,
        }
    }

    /// The state right after the checkpoint at `offset` (written at `timestamp_ms`), the
    /// records before it unread.
    pub fn from_checkpoint(
        offset: u64,
        timestamp_ms: u64,
        checkpoint: &Checkpoint,
    ) -> BrokerResult<StreamPartitionState> {
        let producers =
            ProducerWindows::from_snapshot(&checkpoint.producers).map_err(|reason| {
                BrokerError::Corrupt {
                    what: "stream checkpoint",
                    offset,
                    reason,
                }
            })?;
        Ok(StreamPartitionState {
            next_offset: offset + 1,
            messages: checkpoint.messages,
            bytes: checkpoint.bytes,
            producers,
            settings: None,
            last_checkpoint: Some(offset),
            bytes_since_checkpoint: 0,
            newest_timestamp_ms: timestamp_ms,
        })
    }

    /// One past the last applied offset.
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Messages appended over the partition's history.
    pub fn messages(&self) -> u64 {
        self.messages
    }

    /// Their payload bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The last settings applied from the log, if any (the metadata log is authoritative).
    pub fn settings(&self) -> Option<StreamSettings> {
        self.settings
    }

    /// Offset of the last checkpoint applied.
    pub fn last_checkpoint(&self) -> Option<u64> {
        self.last_checkpoint
    }

    /// Timestamp of the newest record applied.
    pub fn newest_timestamp_ms(&self) -> u64 {
        self.newest_timestamp_ms
    }

    /// What an idempotent producer's `sequence` is to this partition (the owner skips a
    /// duplicate and refuses one below the window before proposing).
    pub fn verdict(&self, producer: u64, sequence: u64) -> Verdict {
        self.producers.verdict(producer, sequence)
    }

    /// Whether a checkpoint is due: `interval_bytes` of records applied since the last one.
    pub fn checkpoint_due(&self, interval_bytes: u64) -> bool {
        self.bytes_since_checkpoint >= interval_bytes
    }

    /// The checkpoint of this state (to be written at [`next_offset`](Self::next_offset),
    /// with nothing else in flight).
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            messages: self.messages,
            bytes: self.bytes,
            producers: self.producers.snapshot(),
        }
    }

    /// Applies the committed record at `offset`, written at `timestamp_ms`, of `payload_bytes`
    /// bytes. Offsets come in order without gaps (a replicated log reads its own entries back
    /// as `NOOP`s).
    pub fn apply(
        &mut self,
        offset: u64,
        timestamp_ms: u64,
        payload_bytes: u64,
        record: &StreamRecord,
    ) -> BrokerResult<Applied> {
        if offset != self.next_offset {
            return Err(BrokerError::Corrupt {
                what: "stream record",
                offset,
                reason: format!(
                    "applied out of order: the partition expected offset {}",
                    self.next_offset
                ),
            });
        }
        let applied = match record {
            StreamRecord::Message(message) => Applied::Message {
                stored: self.apply_message(offset, message, payload_bytes),
            },
            StreamRecord::Settings(settings) => {
                self.settings = Some(*settings);
                Applied::Control
            }
            StreamRecord::Checkpoint(checkpoint) => {
                let mine = self.checkpoint();
                if *checkpoint != mine {
                    return Err(BrokerError::Corrupt {
                        what: "stream checkpoint",
                        offset,
                        reason: format!(
                            "it does not match the state it follows ({} messages, {} bytes, {} \
                             producers; the state has {}, {}, {})",
                            checkpoint.messages,
                            checkpoint.bytes,
                            checkpoint.producers.len(),
                            mine.messages,
                            mine.bytes,
                            mine.producers.len()
                        ),
                    });
                }
                self.last_checkpoint = Some(offset);
                self.bytes_since_checkpoint = 0;
                Applied::Control
            }
            StreamRecord::Noop => Applied::Control,
        };
        if !matches!(record, StreamRecord::Checkpoint(_)) {
            self.bytes_since_checkpoint += payload_bytes;
        }
        self.newest_timestamp_ms = self.newest_timestamp_ms.max(timestamp_ms);
        self.next_offset = offset + 1;
        Ok(applied)
    }

    fn apply_message(&mut self, offset: u64, message: &Message, payload_bytes: u64) -> bool {
        if let Some(mark) = message.producer {
            if !self.producers.record(mark.producer, mark.sequence, offset) {
                return false;
            }
        }
        self.messages += 1;
        self.bytes += payload_bytes;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::ProducerSeq;
    use proptest::prelude::*;

    fn message(producer: Option<(u64, u64)>, body: &[u8]) -> StreamRecord {
        StreamRecord::Message(Message {
            producer: producer.map(|(producer, sequence)| ProducerSeq { producer, sequence }),
            ..Message::new(body.to_vec())
        })
    }

    fn apply(state: &mut StreamPartitionState, record: &StreamRecord, ts: u64) -> Applied {
        let bytes = record.encode().expect("encodes").len() as u64;
        state
            .apply(state.next_offset(), ts, bytes, record)
            .expect("applies")
    }

    #[test]
    fn messages_count_and_duplicates_do_not() {
        let mut state = StreamPartitionState::new(0);
        assert_eq!(
            apply(&mut state, &message(Some((1, 1)), b"a"), 5),
            Applied::Message { stored: true }
        );
        assert_eq!(
            apply(&mut state, &message(Some((1, 1)), b"a"), 6),
            Applied::Message { stored: false }
        );
        assert_eq!(
            apply(&mut state, &message(None, b"bb"), 7),
            Applied::Message { stored: true }
        );
        assert_eq!(state.messages(), 2);
        assert_eq!(state.next_offset(), 3);
        assert_eq!(state.newest_timestamp_ms(), 7);
        assert_eq!(state.verdict(1, 1), Verdict::Duplicate);
    }

    #[test]
    fn a_checkpoint_must_match_the_state_it_follows() {
        let mut state = StreamPartitionState::new(0);
        apply(&mut state, &message(Some((1, 1)), b"a"), 1);
        let good = StreamRecord::Checkpoint(state.checkpoint());
        let mut other = state.clone();
        apply(&mut other, &good, 2);
        assert_eq!(other.last_checkpoint(), Some(1));
        let bad = StreamRecord::Checkpoint(Checkpoint {
            messages: 99,
            ..state.checkpoint()
        });
        let err = state.apply(1, 2, 30, &bad).expect_err("refused");
        assert!(
            matches!(err, BrokerError::Corrupt { offset: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn records_apply_in_order_only() {
        let mut state = StreamPartitionState::new(10);
        let err = state
            .apply(11, 0, 1, &StreamRecord::Noop)
            .expect_err("a gap");
        assert!(matches!(err, BrokerError::Corrupt { offset: 11, .. }));
        state
            .apply(10, 0, 0, &StreamRecord::Noop)
            .expect("in order");
    }

    proptest! {
        /// Rebuilding from any checkpoint gives the state applying everything gives.
        #[test]
        fn a_state_rebuilt_from_any_checkpoint_equals_the_whole(
            ops in proptest::collection::vec((proptest::option::of((0u64..3, 0u64..20)), 0usize..50, any::<bool>()), 1..120),
        ) {
            let mut whole = StreamPartitionState::new(0);
            let mut log: Vec<(StreamRecord, u64)> = Vec::new();
            for (i, (producer, len, checkpoint)) in ops.into_iter().enumerate() {
                let record = if checkpoint {
                    StreamRecord::Checkpoint(whole.checkpoint())
                } else {
                    message(producer, &vec![7; len])
                };
                apply(&mut whole, &record, i as u64);
                log.push((record, i as u64));
            }
            for (at, (record, ts)) in log.iter().enumerate() {
                let StreamRecord::Checkpoint(cp) = record else { continue };
                let mut rebuilt = StreamPartitionState::from_checkpoint(at as u64, *ts, cp).expect("valid");
                for (record, ts) in &log[at + 1..] {
                    apply(&mut rebuilt, record, *ts);
                }
                prop_assert_eq!(rebuilt.messages(), whole.messages());
                prop_assert_eq!(rebuilt.bytes(), whole.bytes());
                prop_assert_eq!(rebuilt.next_offset(), whole.next_offset());
                prop_assert_eq!(rebuilt.checkpoint(), whole.checkpoint());
            }
        }
    }
}
