//! The records of a partition's log and their payloads, byte by byte
//! (`docs/partition-records.md`). Encoding and decoding only: no state, no I/O.
//! All integers are little-endian.

use crate::error::{BrokerError, BrokerResult};

/// Log record type of a message.
pub const ENQUEUE: u8 = 1;
/// Log record type settling messages (acknowledged, dead-lettered or dropped).
pub const SETTLE: u8 = 2;
/// Log record type returning delivered messages to ready, with their delivery counts.
pub const RETURN: u8 = 3;
/// Log record type removing every ready message of some offset ranges.
pub const PURGE: u8 = 4;
/// Log record type holding a copy of an old message moved to the head of the log.
pub const RELOCATE: u8 = 5;
/// Log record type recording the queue settings in force from this point (JSON).
pub const SETTINGS: u8 = 6;
/// Log record type of an offset that holds no partition record: a replicated log's own entry
/// (a new leader's blank entry, a membership change) read back as a record so that offsets
/// stay consecutive. Empty payload; never written by the broker.
pub const NOOP: u8 = 7;
/// Log record type holding the idempotent producers' windows as of this record: a state
/// rebuilt from a log whose prefix was removed takes them from here (space reclaim cuts the
/// log only at such a record, `docs/partition-records.md`, "`PRODUCERS`").
pub const PRODUCERS: u8 = 8;

/// Version byte at the start of a `PRODUCERS` payload without duplicate offsets (written
/// whenever it has none, so that a node that knows only this format reads it).
const PRODUCERS_FORMAT: u8 = 1;
/// Version byte at the start of a `PRODUCERS` payload that lists the duplicate `ENQUEUE`
/// records since the previous one.
const PRODUCERS_FORMAT_DUPLICATES: u8 = 2;

/// Version byte at the start of a message payload.
const MESSAGE_FORMAT: u8 = 1;
/// Version byte of a message payload that opens with its idempotent producer's id and
/// sequence (16 bytes), then continues as format 1.
const MESSAGE_FORMAT_PRODUCER: u8 = 2;

/// An idempotent producer's mark on a message: a partition stores each `(producer, sequence)`
/// once (`partition/producers.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProducerSeq {
    /// The producer's id.
    pub producer: u64,
    /// The message's number in the producer's sequence.
    pub sequence: u64,
}

/// A message as published: routing key, headers and body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    /// Routing key (partition choice); empty for none.
    pub routing_key: String,
    /// Headers, in order.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
    /// Its idempotent producer and sequence, if any.
    pub producer: Option<ProducerSeq>,
}

impl Message {
    /// A message with only a body.
    pub fn new(body: impl Into<Vec<u8>>) -> Message {
        Message {
            routing_key: String::new(),
            headers: Vec::new(),
            body: body.into(),
            producer: None,
        }
    }

    /// The producer mark at the start of an encoded message payload, if it has one.
    pub fn producer_of(payload: &[u8], offset: u64) -> BrokerResult<Option<ProducerSeq>> {
        if payload.first() != Some(&MESSAGE_FORMAT_PRODUCER) {
            return Ok(None);
        }
        let mut r = Reader::new(payload, "message", offset);
        r.u8()?;
        Ok(Some(ProducerSeq {
            producer: r.u64()?,
            sequence: r.u64()?,
        }))
    }

    /// Encode as a message payload.
    pub fn encode(&self, out: &mut Vec<u8>) -> BrokerResult<()> {
        match self.producer {
            Some(mark) => {
                out.push(MESSAGE_FORMAT_PRODUCER);
                out.extend_from_slice(&mark.producer.to_le_bytes());
                out.extend_from_slice(&mark.sequence.to_le_bytes());
            }
            None => out.push(MESSAGE_FORMAT),
        }
        put_str16(out, &self.routing_key, "routing key")?;
        let count = u16::try_from(self.headers.len())
            .map_err(|_| BrokerError::Invalid("more than 65,535 headers".into()))?;
        out.extend_from_slice(&count.to_le_bytes());
        for (key, value) in &self.headers {
            put_str16(out, key, "header name")?;
            let len = u32::try_from(value.len())
                .map_err(|_| BrokerError::Invalid("header value over 4 GiB".into()))?;
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        Ok(())
    }

    /// Decode a message payload.
    pub fn decode(bytes: &[u8], offset: u64) -> BrokerResult<Message> {
        let mut r = Reader::new(bytes, "message", offset);
        let format = r.u8()?;
        let producer = match format {
            MESSAGE_FORMAT => None,
            MESSAGE_FORMAT_PRODUCER => Some(ProducerSeq {
                producer: r.u64()?,
                sequence: r.u64()?,
            }),
            _ => return Err(r.error(format!("message format {format}"))),
        };
        let routing_key = r.str16()?;
        let count = r.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let key = r.str16()?;
            let len = r.u32()? as usize;
            let value = r.string(len)?;
            headers.push((key, value));
        }
        Ok(Message {
            routing_key,
            headers,
            body: r.rest().to_vec(),
            producer,
        })
    }
}

/// How a message left its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A consumer acknowledged it.
    Acked,
    /// It was sent to the dead-letter queue.
    DeadLettered,
    /// It was dropped (rejected without a dead-letter queue).
    Dropped,
}

impl Outcome {
    fn to_byte(self) -> u8 {
        match self {
            Outcome::Acked => 0,
            Outcome::DeadLettered => 1,
            Outcome::Dropped => 2,
        }
    }

    fn from_byte(byte: u8) -> Option<Outcome> {
        match byte {
            0 => Some(Outcome::Acked),
            1 => Some(Outcome::DeadLettered),
            2 => Some(Outcome::Dropped),
            _ => None,
        }
    }
}

/// One settled message: its id (the offset of its ENQUEUE record), its payload size (so that the
/// byte count needs no per-message memory) and how it left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Message id.
    pub message: u64,
    /// Payload size in bytes.
    pub size_bytes: u32,
    /// Outcome.
    pub outcome: Outcome,
}

/// One message returned to ready with its delivery count so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Returned {
    /// Message id.
    pub message: u64,
    /// Deliveries so far.
    pub delivery_count: u32,
}

/// A purge: every live message id in `ranges` leaves the queue; `count` and `bytes` are their
/// totals (computed by the owner, which knows what is inflight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purge {
    /// Half-open ranges of message ids.
    pub ranges: Vec<(u64, u64)>,
    /// Messages removed.
    pub count: u64,
    /// Their payload bytes.
    pub bytes: u64,
}

/// A message moved to the head of the log, keeping its id (and so its place in delivery order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relocate {
    /// The message's id (its original offset).
    pub message: u64,
    /// Deliveries so far.
    pub delivery_count: u32,
    /// The original message payload, unchanged.
    pub payload: Vec<u8>,
}

/// A decoded partition record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionRecord {
    /// A message; its payload size is the record's.
    Enqueue {
        /// Payload bytes.
        size_bytes: u32,
        /// Its idempotent producer and sequence, from the payload's start.
        producer: Option<ProducerSeq>,
    },
    /// Settled messages.
    Settle(Vec<Settled>),
    /// Messages back to ready.
    Return(Vec<Returned>),
    /// A purge.
    Purge(Purge),
    /// A relocated message.
    Relocate(Relocate),
    /// The queue's settings from here on, as JSON (`QueueSettings`).
    Settings(Vec<u8>),
    /// An offset the replicated log took for its own entry: nothing to apply.
    Noop,
    /// The idempotent producers' windows from here on, replacing what the state had.
    Producers(Producers),
}

/// A `PRODUCERS` record: the windows as of its offset, and where the duplicates since the
/// previous such record lie. A state rebuilt from a log that starts between the two records
/// (a single node's log starts at a segment's base, at or below the record it was cut at)
/// meets those duplicates before any window and takes them for new messages; the list tells it
/// they were never live.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Producers {
    /// The windows, replacing the state's.
    pub windows: Vec<crate::partition::producers::WindowSnapshot>,
    /// Offsets of the duplicate `ENQUEUE` records applied since the previous `PRODUCERS`
    /// record (at or above the log's start then), as half-open ranges: ascending, disjoint,
    /// not touching, below this record's offset.
    pub duplicates: Vec<(u64, u64)>,
}

impl PartitionRecord {
    /// The log record type of this record.
    pub fn record_type(&self) -> u8 {
        match self {
            PartitionRecord::Enqueue { .. } => ENQUEUE,
            PartitionRecord::Settle(_) => SETTLE,
            PartitionRecord::Return(_) => RETURN,
            PartitionRecord::Purge(_) => PURGE,
            PartitionRecord::Relocate(_) => RELOCATE,
            PartitionRecord::Settings(_) => SETTINGS,
            PartitionRecord::Noop => NOOP,
            PartitionRecord::Producers(_) => PRODUCERS,
        }
    }

    /// Encode the payload of a control record (an ENQUEUE's payload is the message itself).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            PartitionRecord::Enqueue { .. } => {}
            PartitionRecord::Settle(entries) => {
                out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                for e in entries {
                    out.extend_from_slice(&e.message.to_le_bytes());
                    out.extend_from_slice(&e.size_bytes.to_le_bytes());
                    out.push(e.outcome.to_byte());
                }
            }
            PartitionRecord::Return(entries) => {
                out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                for e in entries {
                    out.extend_from_slice(&e.message.to_le_bytes());
                    out.extend_from_slice(&e.delivery_count.to_le_bytes());
                }
            }
            PartitionRecord::Purge(purge) => {
                out.extend_from_slice(&purge.count.to_le_bytes());
                out.extend_from_slice(&purge.bytes.to_le_bytes());
                out.extend_from_slice(&(purge.ranges.len() as u32).to_le_bytes());
                for (start, end) in &purge.ranges {
                    out.extend_from_slice(&start.to_le_bytes());
                    out.extend_from_slice(&end.to_le_bytes());
                }
            }
            PartitionRecord::Settings(json) => out.extend_from_slice(json),
            PartitionRecord::Noop => {}
            PartitionRecord::Producers(producers) => {
                let duplicates = &producers.duplicates;
                out.push(if duplicates.is_empty() {
                    PRODUCERS_FORMAT
                } else {
                    PRODUCERS_FORMAT_DUPLICATES
                });
                crate::partition::producers::encode_windows(&producers.windows, &mut out);
                if !duplicates.is_empty() {
                    out.extend_from_slice(&(duplicates.len() as u32).to_le_bytes());
                    for (start, end) in duplicates {
                        out.extend_from_slice(&start.to_le_bytes());
                        out.extend_from_slice(&end.to_le_bytes());
                    }
                }
            }
            PartitionRecord::Relocate(relocate) => {
                out.extend_from_slice(&relocate.message.to_le_bytes());
                out.extend_from_slice(&relocate.delivery_count.to_le_bytes());
                out.extend_from_slice(&relocate.payload);
            }
        }
        out
    }

    /// Decode a record of the partition log.
    pub fn decode(record_type: u8, payload: &[u8], offset: u64) -> BrokerResult<PartitionRecord> {
        let mut r = Reader::new(payload, "partition", offset);
        let record = match record_type {
            ENQUEUE => PartitionRecord::Enqueue {
                size_bytes: u32::try_from(payload.len()).map_err(|_| r.error("size".into()))?,
                producer: Message::producer_of(payload, offset)?,
            },
            SETTLE => {
                let count = r.count(13)?;
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    let message = r.u64()?;
                    let size_bytes = r.u32()?;
                    let byte = r.u8()?;
                    let outcome = Outcome::from_byte(byte)
                        .ok_or_else(|| r.error(format!("outcome {byte}")))?;
                    entries.push(Settled {
                        message,
                        size_bytes,
                        outcome,
                    });
                }
                PartitionRecord::Settle(entries)
            }
            RETURN => {
                let count = r.count(12)?;
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    entries.push(Returned {
                        message: r.u64()?,
                        delivery_count: r.u32()?,
                    });
                }
                PartitionRecord::Return(entries)
            }
            PURGE => {
                let count = r.u64()?;
                let bytes = r.u64()?;
                let n = r.count(16)?;
                let mut ranges = Vec::with_capacity(n);
                for _ in 0..n {
                    ranges.push((r.u64()?, r.u64()?));
                }
                PartitionRecord::Purge(Purge {
                    ranges,
                    count,
                    bytes,
                })
            }
            RELOCATE => PartitionRecord::Relocate(Relocate {
                message: r.u64()?,
                delivery_count: r.u32()?,
                payload: r.rest().to_vec(),
            }),
            SETTINGS => PartitionRecord::Settings(r.rest().to_vec()),
            NOOP => PartitionRecord::Noop,
            PRODUCERS => {
                let format = r.u8()?;
                if format != PRODUCERS_FORMAT && format != PRODUCERS_FORMAT_DUPLICATES {
                    return Err(r.error(format!(
                        "format {format}, expected {PRODUCERS_FORMAT} or \
                         {PRODUCERS_FORMAT_DUPLICATES}"
                    )));
                }
                let windows = crate::partition::producers::decode_windows(&mut r)?;
                let mut duplicates = Vec::new();
                if format == PRODUCERS_FORMAT_DUPLICATES {
                    let n = r.count(16)?;
                    if n == 0 {
                        return Err(r.error("format 2 with no duplicate range".into()));
                    }
                    let mut below = 0u64;
                    for _ in 0..n {
                        let (start, end) = (r.u64()?, r.u64()?);
                        // Ascending, disjoint, not touching, and below the record itself.
                        if start >= end || (!duplicates.is_empty() && start <= below) {
                            return Err(r.error(format!(
                                "duplicate range {start}..{end} out of order or empty"
                            )));
                        }
                        if end > offset {
                            return Err(r.error(format!(
                                "duplicate range {start}..{end} past the record's own offset"
                            )));
                        }
                        below = end;
                        duplicates.push((start, end));
                    }
                }
                PartitionRecord::Producers(Producers {
                    windows,
                    duplicates,
                })
            }
            other => return Err(r.error(format!("unknown record type {other}"))),
        };
        if record_type != ENQUEUE && record_type != RELOCATE && !r.rest().is_empty() {
            return Err(r.error("trailing bytes".into()));
        }
        Ok(record)
    }
}

fn put_str16(out: &mut Vec<u8>, s: &str, what: &str) -> BrokerResult<()> {
    let len = u16::try_from(s.len())
        .map_err(|_| BrokerError::Invalid(format!("{what} longer than 65,535 bytes")))?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// A bounds-checked little-endian reader over an untrusted payload.
/// Reads a record payload field by field; every error is `BrokerError::Corrupt` naming the
/// record and the byte. Shared with the stream records (`stream/`).
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
    offset: u64,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8], what: &'static str, offset: u64) -> Reader<'a> {
        Reader {
            bytes,
            at: 0,
            what,
            offset,
        }
    }

    pub(crate) fn error(&self, reason: String) -> BrokerError {
        BrokerError::Corrupt {
            what: self.what,
            offset: self.offset,
            reason: format!("{reason} (at byte {})", self.at),
        }
    }

    pub(crate) fn take(&mut self, n: usize) -> BrokerResult<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| self.error(format!("truncated: {n} more bytes expected")))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    pub(crate) fn u8(&mut self) -> BrokerResult<u8> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u16(&mut self) -> BrokerResult<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self) -> BrokerResult<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(crate) fn u64(&mut self) -> BrokerResult<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A u32 count of entries of `entry_bytes` each, checked against what remains.
    pub(crate) fn count(&mut self, entry_bytes: usize) -> BrokerResult<usize> {
        let count = self.u32()? as usize;
        let needed = count.checked_mul(entry_bytes);
        if needed.is_none_or(|n| n > self.bytes.len() - self.at) {
            return Err(self.error(format!("{count} entries do not fit")));
        }
        Ok(count)
    }

    pub(crate) fn string(&mut self, len: usize) -> BrokerResult<String> {
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.error("invalid UTF-8".into()))
    }

    pub(crate) fn str16(&mut self) -> BrokerResult<String> {
        let len = usize::from(self.u16()?);
        self.string(len)
    }

    /// Fails unless every byte was read.
    pub(crate) fn end(&self) -> BrokerResult<()> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(self.error(format!("{} bytes past the end", self.bytes.len() - self.at)))
        }
    }

    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let rest = &self.bytes[self.at..];
        self.at = self.bytes.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn message_roundtrip() {
        let message = Message {
            routing_key: "key".into(),
            headers: vec![("a".into(), "b".into())],
            body: b"body".to_vec(),
            producer: None,
        };
        let mut out = Vec::new();
        message.encode(&mut out).expect("encode");
        assert_eq!(Message::decode(&out, 0).expect("decode"), message);
        assert_eq!(Message::producer_of(&out, 0).expect("reads"), None);
    }

    /// A producer's mark opens the payload (format 2); the ENQUEUE record carries it.
    #[test]
    fn a_producer_mark_travels_in_the_payload() {
        let mark = ProducerSeq {
            producer: 0xfeed,
            sequence: 42,
        };
        let message = Message {
            producer: Some(mark),
            ..Message::new("body")
        };
        let mut out = Vec::new();
        message.encode(&mut out).expect("encode");
        assert_eq!(out[0], MESSAGE_FORMAT_PRODUCER);
        assert_eq!(Message::decode(&out, 0).expect("decode"), message);
        assert_eq!(
            PartitionRecord::decode(ENQUEUE, &out, 7).expect("decode"),
            PartitionRecord::Enqueue {
                size_bytes: out.len() as u32,
                producer: Some(mark),
            }
        );
        assert!(
            Message::producer_of(&out[..9], 0).is_err(),
            "a cut mark is corrupt"
        );
    }

    #[test]
    fn control_records_roundtrip() {
        let records = [
            PartitionRecord::Settle(vec![Settled {
                message: 5,
                size_bytes: 100,
                outcome: Outcome::DeadLettered,
            }]),
            PartitionRecord::Return(vec![Returned {
                message: 9,
                delivery_count: 3,
            }]),
            PartitionRecord::Purge(Purge {
                ranges: vec![(1, 4), (7, 9)],
                count: 4,
                bytes: 400,
            }),
            PartitionRecord::Relocate(Relocate {
                message: 2,
                delivery_count: 1,
                payload: b"xyz".to_vec(),
            }),
            PartitionRecord::Producers(Producers::default()),
            PartitionRecord::Producers(Producers {
                windows: vec![crate::partition::producers::WindowSnapshot {
                    producer: 7,
                    floor: 2,
                    last_offset: 40,
                    stored: vec![(2, 5), (9, 10)],
                }],
                duplicates: Vec::new(),
            }),
            PartitionRecord::Producers(Producers {
                windows: vec![crate::partition::producers::WindowSnapshot {
                    producer: 7,
                    floor: 2,
                    last_offset: 40,
                    stored: vec![(2, 5), (9, 10)],
                }],
                duplicates: vec![(41, 43), (45, 46)],
            }),
        ];
        for record in records {
            let bytes = record.encode();
            let back = PartitionRecord::decode(record.record_type(), &bytes, 50).expect("decode");
            assert_eq!(back, record);
        }
    }

    /// A `PRODUCERS` record whose windows break their rules, or with bytes past its end, is
    /// corrupt (a damaged record must not become a wrong verdict).
    #[test]
    fn damaged_producers_records_are_corrupt() {
        let good = PartitionRecord::Producers(Producers {
            windows: vec![crate::partition::producers::WindowSnapshot {
                producer: 7,
                floor: 0,
                last_offset: 3,
                stored: vec![(1, 2)],
            }],
            duplicates: vec![(2, 3)],
        })
        .encode();
        for len in 0..good.len() {
            assert!(PartitionRecord::decode(PRODUCERS, &good[..len], 3).is_err());
        }
        let mut long = good.clone();
        long.push(0);
        assert!(PartitionRecord::decode(PRODUCERS, &long, 3).is_err());
        let below_floor = PartitionRecord::Producers(Producers {
            windows: vec![crate::partition::producers::WindowSnapshot {
                producer: 7,
                floor: 5,
                last_offset: 3,
                stored: vec![(1, 2)],
            }],
            duplicates: Vec::new(),
        })
        .encode();
        assert!(PartitionRecord::decode(PRODUCERS, &below_floor, 3).is_err());
        // Duplicate ranges out of order, touching, empty, or at the record's own offset.
        for duplicates in [
            vec![(1, 2), (0, 1)],
            vec![(0, 1), (1, 2)],
            vec![(1, 1)],
            vec![(2, 4)],
        ] {
            let bad = PartitionRecord::Producers(Producers {
                windows: Vec::new(),
                duplicates: duplicates.clone(),
            })
            .encode();
            assert!(
                PartitionRecord::decode(PRODUCERS, &bad, 3).is_err(),
                "{duplicates:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(kind in 0u8..9, bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = PartitionRecord::decode(kind, &bytes, 0);
            let _ = Message::decode(&bytes, 0);
        }
    }
}
