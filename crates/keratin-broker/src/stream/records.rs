//! The records of a stream partition's payload log and their payloads, byte by byte
//! (`docs/streams.md`, "Payload log records"). Encoding and decoding only. All integers are
//! little-endian. Record types are distinct from a queue partition's, so a log of one kind read
//! as the other is refused as corrupt.

use serde::{Deserialize, Serialize};

use crate::error::{BrokerError, BrokerResult};
use crate::partition::producers::WindowSnapshot;
use crate::queue::MAX_PARTITIONS;
use crate::record::{Message, Reader, NOOP};

/// Log record type of a stream message (payload: a message, as a queue's `ENQUEUE`).
pub const STREAM_MESSAGE: u8 = 16;
/// Log record type of the stream's retention from this point on (JSON of [`StreamSettings`]).
pub const STREAM_SETTINGS: u8 = 17;
/// Log record type of a partition's state as of this record ([`Checkpoint`]).
pub const STREAM_CHECKPOINT: u8 = 18;

/// Version byte of a checkpoint payload.
const CHECKPOINT_FORMAT: u8 = 1;

/// A stream's settings: its partition count (fixed) and its retention bounds, each optional
/// and for the whole stream (each partition keeps its share, rounded up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamSettings {
    /// Partitions, 1 to [`MAX_PARTITIONS`].
    pub partitions: u32,
    /// Most bytes on disk the stream keeps (retention by size).
    pub max_bytes: Option<u64>,
    /// Oldest message age the stream keeps, in milliseconds (retention by age).
    pub max_age_ms: Option<u64>,
    /// Most messages the stream keeps (retention by count).
    pub max_messages: Option<u64>,
}

impl Default for StreamSettings {
    fn default() -> StreamSettings {
        StreamSettings {
            partitions: 1,
            max_bytes: None,
            max_age_ms: None,
            max_messages: None,
        }
    }
}

impl StreamSettings {
    /// Refuses settings no stream can have, naming the field and its range.
    pub fn validate(&self) -> BrokerResult<()> {
        if self.partitions == 0 || self.partitions > MAX_PARTITIONS {
            return Err(BrokerError::Invalid(format!(
                "a stream has 1 to {MAX_PARTITIONS} partitions, not {}",
                self.partitions
            )));
        }
        for (name, value) in [
            ("max_bytes", self.max_bytes),
            ("max_age_ms", self.max_age_ms),
            ("max_messages", self.max_messages),
        ] {
            if value == Some(0) {
                return Err(BrokerError::Invalid(format!(
                    "{name} of 0 would keep nothing: give at least 1, or none for no bound"
                )));
            }
        }
        Ok(())
    }

    /// Whether any retention bound is set (a stream without one fills like a queue).
    pub fn has_retention(&self) -> bool {
        self.max_bytes.is_some() || self.max_age_ms.is_some() || self.max_messages.is_some()
    }

    /// One partition's share of `max_bytes`, rounded up.
    pub fn partition_max_bytes(&self) -> Option<u64> {
        self.max_bytes
            .map(|b| b.div_ceil(u64::from(self.partitions.max(1))))
    }

    /// One partition's share of `max_messages`, rounded up.
    pub fn partition_max_messages(&self) -> Option<u64> {
        self.max_messages
            .map(|m| m.div_ceil(u64::from(self.partitions.max(1))))
    }
}

/// A partition's state as of a checkpoint record: what rebuilding needs without reading the
/// records before it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Checkpoint {
    /// Messages appended before this record over the partition's whole history (duplicates
    /// not counted).
    pub messages: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// The idempotent producers' windows.
    pub producers: Vec<WindowSnapshot>,
}

/// One record of a stream partition's payload log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamRecord {
    /// A message.
    Message(Message),
    /// The stream's settings from here on.
    Settings(StreamSettings),
    /// The partition's state as of here.
    Checkpoint(Checkpoint),
    /// An offset holding nothing (a replicated log's own entry).
    Noop,
}

impl StreamRecord {
    /// The log record type.
    pub fn record_type(&self) -> u8 {
        match self {
            StreamRecord::Message(_) => STREAM_MESSAGE,
            StreamRecord::Settings(_) => STREAM_SETTINGS,
            StreamRecord::Checkpoint(_) => STREAM_CHECKPOINT,
            StreamRecord::Noop => NOOP,
        }
    }

    /// The payload. A message too large for its length fields is refused (`Invalid`).
    pub fn encode(&self) -> BrokerResult<Vec<u8>> {
        let mut out = Vec::new();
        match self {
            StreamRecord::Message(m) => m.encode(&mut out)?,
            StreamRecord::Settings(s) => {
                out = serde_json::to_vec(s).map_err(|e| {
                    BrokerError::Invalid(format!("stream settings do not encode: {e}"))
                })?
            }
            StreamRecord::Checkpoint(c) => encode_checkpoint(c, &mut out)?,
            StreamRecord::Noop => {}
        }
        Ok(out)
    }

    /// The record of `record_type` with `payload`, read at `offset` (named in errors).
    pub fn decode(record_type: u8, payload: &[u8], offset: u64) -> BrokerResult<StreamRecord> {
        match record_type {
            STREAM_MESSAGE => Ok(StreamRecord::Message(Message::decode(payload, offset)?)),
            STREAM_SETTINGS => {
                let settings: StreamSettings =
                    serde_json::from_slice(payload).map_err(|e| BrokerError::Corrupt {
                        what: "stream settings",
                        offset,
                        reason: e.to_string(),
                    })?;
                settings.validate().map_err(|e| BrokerError::Corrupt {
                    what: "stream settings",
                    offset,
                    reason: e.to_string(),
                })?;
                Ok(StreamRecord::Settings(settings))
            }
            STREAM_CHECKPOINT => Ok(StreamRecord::Checkpoint(decode_checkpoint(
                payload, offset,
            )?)),
            NOOP if payload.is_empty() => Ok(StreamRecord::Noop),
            NOOP => Err(BrokerError::Corrupt {
                what: "noop",
                offset,
                reason: format!("{} payload bytes, expected none", payload.len()),
            }),
            other => Err(BrokerError::Corrupt {
                what: "stream record",
                offset,
                reason: format!("record type {other} is not a stream record"),
            }),
        }
    }
}

fn encode_checkpoint(c: &Checkpoint, out: &mut Vec<u8>) -> BrokerResult<()> {
    // The counts must fit the encoding's (`encode_windows`); the windows' own rules are the
    // reader's to check.
    u32::try_from(c.producers.len())
        .map_err(|_| BrokerError::Invalid("too many producers in a checkpoint".into()))?;
    if c.producers
        .iter()
        .any(|w| u16::try_from(w.stored.len()).is_err())
    {
        return Err(BrokerError::Invalid(
            "too many ranges in a producer window".into(),
        ));
    }
    out.push(CHECKPOINT_FORMAT);
    out.extend_from_slice(&c.messages.to_le_bytes());
    out.extend_from_slice(&c.bytes.to_le_bytes());
    crate::partition::producers::encode_windows(&c.producers, out);
    Ok(())
}

fn decode_checkpoint(payload: &[u8], offset: u64) -> BrokerResult<Checkpoint> {
    let mut r = Reader::new(payload, "stream checkpoint", offset);
    let format = r.u8()?;
    if format != CHECKPOINT_FORMAT {
        return Err(r.error(format!("format {format}, expected {CHECKPOINT_FORMAT}")));
    }
    let messages = r.u64()?;
    let bytes = r.u64()?;
    let producers = crate::partition::producers::decode_windows(&mut r)?;
    r.end()?;
    Ok(Checkpoint {
        messages,
        bytes,
        producers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::producers::ProducerWindows;
    use crate::record::ProducerSeq;
    use proptest::prelude::*;

    fn roundtrip(record: &StreamRecord) -> StreamRecord {
        let payload = record.encode().expect("encodes");
        StreamRecord::decode(record.record_type(), &payload, 9).expect("decodes")
    }

    #[test]
    fn each_record_reads_back_as_written() {
        let message = Message {
            routing_key: "k".into(),
            headers: vec![("h".into(), "v".into())],
            body: b"body".to_vec(),
            producer: Some(ProducerSeq {
                producer: 7,
                sequence: 3,
            }),
        };
        let settings = StreamSettings {
            partitions: 3,
            max_bytes: Some(1 << 30),
            max_age_ms: Some(3_600_000),
            max_messages: None,
        };
        let mut windows = ProducerWindows::new();
        windows.record(7, 1, 10);
        windows.record(7, 3, 11);
        windows.record(9, 1, 12);
        let checkpoint = Checkpoint {
            messages: 12,
            bytes: 4096,
            producers: windows.snapshot(),
        };
        for record in [
            StreamRecord::Message(message),
            StreamRecord::Settings(settings),
            StreamRecord::Checkpoint(checkpoint),
            StreamRecord::Noop,
        ] {
            assert_eq!(roundtrip(&record), record);
        }
    }

    #[test]
    fn a_checkpoint_rebuilds_the_same_windows() {
        let mut windows = ProducerWindows::new();
        for (p, s, o) in [(1, 1, 0), (1, 2, 1), (1, 5, 2), (2, 9, 3), (1, 6, 4)] {
            windows.record(p, s, o);
        }
        let snapshot = windows.snapshot();
        let rebuilt = ProducerWindows::from_snapshot(&snapshot).expect("valid");
        assert_eq!(rebuilt, windows);
    }

    /// A queue's records in a stream log, or the reverse, are corrupt, never misread.
    #[test]
    fn a_queue_record_is_not_a_stream_record() {
        for queue_type in 1..=6u8 {
            let err = StreamRecord::decode(queue_type, b"", 4).expect_err("refused");
            assert!(
                matches!(err, BrokerError::Corrupt { offset: 4, .. }),
                "{err}"
            );
        }
        let err = crate::record::PartitionRecord::decode(STREAM_MESSAGE, b"\x01", 5)
            .expect_err("a queue refuses a stream message");
        assert!(matches!(err, BrokerError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn damaged_checkpoints_and_settings_are_corrupt() {
        let good = StreamRecord::Checkpoint(Checkpoint {
            messages: 1,
            bytes: 2,
            producers: vec![WindowSnapshot {
                producer: 1,
                floor: 0,
                last_offset: 0,
                stored: vec![(1, 2)],
            }],
        })
        .encode()
        .expect("encodes");
        // Every truncation and a trailing byte.
        for len in 0..good.len() {
            assert!(StreamRecord::decode(STREAM_CHECKPOINT, &good[..len], 0).is_err());
        }
        let mut long = good.clone();
        long.push(0);
        assert!(StreamRecord::decode(STREAM_CHECKPOINT, &long, 0).is_err());
        // A window whose range is empty (start == end) breaks the window rules.
        let bad = StreamRecord::Checkpoint(Checkpoint {
            messages: 0,
            bytes: 0,
            producers: vec![WindowSnapshot {
                producer: 1,
                floor: 0,
                last_offset: 0,
                stored: vec![(2, 2)],
            }],
        })
        .encode()
        .expect("encodes");
        assert!(StreamRecord::decode(STREAM_CHECKPOINT, &bad, 0).is_err());
        assert!(StreamRecord::decode(STREAM_SETTINGS, br#"{"partitions":0}"#, 0).is_err());
        assert!(StreamRecord::decode(NOOP, b"x", 0).is_err());
    }

    #[test]
    fn settings_are_validated_and_shared_out_rounded_up() {
        let s = StreamSettings {
            partitions: 3,
            max_bytes: Some(10),
            max_age_ms: None,
            max_messages: Some(7),
        };
        s.validate().expect("valid");
        assert_eq!(s.partition_max_bytes(), Some(4));
        assert_eq!(s.partition_max_messages(), Some(3));
        assert!(s.has_retention());
        assert!(!StreamSettings::default().has_retention());
        for bad in [
            StreamSettings {
                partitions: MAX_PARTITIONS + 1,
                ..StreamSettings::default()
            },
            StreamSettings {
                max_age_ms: Some(0),
                ..StreamSettings::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(BrokerError::Invalid(_))));
        }
    }

    proptest! {
        /// Arbitrary bytes under any type decode to a record or a `Corrupt` error, never a
        /// panic.
        #[test]
        fn arbitrary_payloads_never_panic(record_type in 0u8..=40, payload in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = StreamRecord::decode(record_type, &payload, 0);
        }

        /// Windows built from any record sequence survive a checkpoint.
        #[test]
        fn windows_survive_a_checkpoint(ops in proptest::collection::vec((0u64..5, 0u64..300), 0..400)) {
            let mut windows = ProducerWindows::new();
            for (offset, (producer, sequence)) in ops.into_iter().enumerate() {
                windows.record(producer, sequence, offset as u64);
            }
            let record = StreamRecord::Checkpoint(Checkpoint { messages: 1, bytes: 1, producers: windows.snapshot() });
            let StreamRecord::Checkpoint(read) = roundtrip(&record) else { panic!("a checkpoint") };
            prop_assert_eq!(ProducerWindows::from_snapshot(&read.producers).expect("valid"), windows);
        }
    }
}
