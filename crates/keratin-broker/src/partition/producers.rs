//! The idempotent producers of one partition: for each, the sequence numbers of its messages
//! the partition stored recently, so that a retry after an unknown outcome (a lost connection,
//! a lost leader) is confirmed without being stored twice. Kafka's idempotent producer and NATS
//! `Nats-Msg-Id` do the same; here the windows are part of the partition state, applied from
//! `ENQUEUE` records, so every replica holds the same ones and they survive failover and restart
//! (`docs/cluster.md`, "Idempotent producers").
//!
//! Owns the window rules and their bounds. Deciding what to write (refuse a sequence below a
//! window, skip a duplicate) is `prepare`'s; recording a stored sequence is the apply's.
//!
//! Rules, for a producer's sequence `s`:
//! - `s` stored: a duplicate. The apply drops a duplicate `ENQUEUE` (it is in the log, but never
//!   live), so even two attempts that raced past `prepare` are delivered once.
//! - no window for the producer, or `s` at or above its floor and not stored: new. (Below the
//!   highest stored sequence this is a message whose first attempt was refused.)
//! - `s` below the floor: too old. The window no longer knows whether the first attempt was
//!   stored; the publish is refused, never silently confirmed.
//!
//! Bounds (memory follows the number of gaps, not of messages, as in [`RangeSet`]): a window
//! keeps at most [`RANGES_MAX`] ranges of stored sequences, dropping its lowest range and raising
//! the floor past it; a partition keeps at most [`PRODUCERS_MAX`] producers, forgetting the one
//! whose last message is oldest. A forgotten producer is new again: its retries of messages
//! from before are stored again (documented in `docs/cluster.md`). Both rules depend only on
//! the records applied, so the windows rebuilt at replay equal the live ones.

use std::collections::{BTreeSet, HashMap};

use crate::range_set::RangeSet;

/// Most ranges of stored sequences a producer's window keeps. A producer numbering its messages
/// 1, 2, 3, ... and sending them to one partition fills one range; gaps come from refused
/// messages and from sequences sent to other partitions (routing keys).
pub const RANGES_MAX: usize = 64;

/// Most producers a partition keeps a window for.
pub const PRODUCERS_MAX: usize = 1024;

/// What a producer's sequence is to a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not stored: store it.
    New,
    /// Stored already: confirm without storing.
    Duplicate,
    /// Below the window: whether it was stored is no longer known.
    TooOld {
        /// The lowest sequence the window still knows.
        floor: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Window {
    stored: RangeSet,
    /// Sequences below this are no longer known.
    floor: u64,
    /// Offset of the producer's last stored message (the eviction order).
    last_offset: u64,
}

/// One producer's window as a stream checkpoint stores it (`docs/streams.md`,
/// `STREAM_CHECKPOINT`): the windows are rebuilt from it without the records before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowSnapshot {
    /// The producer's id.
    pub producer: u64,
    /// Sequences below this are no longer known.
    pub floor: u64,
    /// Offset of the producer's last stored message.
    pub last_offset: u64,
    /// Stored sequences as half-open ranges `[start, end)`, ascending, disjoint, not touching.
    pub stored: Vec<(u64, u64)>,
}

/// The windows of one partition's producers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProducerWindows {
    windows: HashMap<u64, Window>,
    /// `(last_offset, producer)`: the producer to forget first is the first entry.
    by_age: BTreeSet<(u64, u64)>,
}

impl ProducerWindows {
    /// No producer known.
    pub fn new() -> ProducerWindows {
        ProducerWindows::default()
    }

    /// Number of producers with a window.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// True if no producer has a window.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// What `sequence` of `producer` is to this partition.
    pub fn verdict(&self, producer: u64, sequence: u64) -> Verdict {
        let Some(window) = self.windows.get(&producer) else {
            return Verdict::New;
        };
        if window.stored.contains(sequence) {
            Verdict::Duplicate
        } else if sequence < window.floor {
            Verdict::TooOld {
                floor: window.floor,
            }
        } else {
            Verdict::New
        }
    }

    /// Record that the message at `offset` stored `sequence` of `producer`; returns false (and
    /// changes nothing) when the sequence was stored already: the caller drops that message. A
    /// sequence below the window's floor (stored by a leader whose window was trimmed
    /// differently) is kept and leaves the ranges as they are.
    /// Offsets must grow from call to call (records are applied in log order).
    pub fn record(&mut self, producer: u64, sequence: u64, offset: u64) -> bool {
        if let Some(window) = self.windows.get_mut(&producer) {
            if window.stored.contains(sequence) {
                return false;
            }
            debug_assert!(offset >= window.last_offset, "records apply in log order");
            self.by_age.remove(&(window.last_offset, producer));
            // Below the floor the window knows nothing (every sequence there is "too old"): a
            // record another leader stored there is kept, and the window does not grow below
            // its floor (a checkpoint carries only ranges at or above it).
            if sequence >= window.floor {
                window.stored.insert(sequence);
            }
            window.last_offset = offset;
            trim(window);
            self.by_age.insert((offset, producer));
            return true;
        }
        if self.windows.len() >= PRODUCERS_MAX {
            self.forget_oldest();
        }
        let mut stored = RangeSet::new();
        stored.insert(sequence);
        self.windows.insert(
            producer,
            Window {
                stored,
                floor: 0,
                last_offset: offset,
            },
        );
        self.by_age.insert((offset, producer));
        true
    }

    /// Forgets the windows of producers whose last stored message lies below `start` (the
    /// log's records below it are gone, and with them what a rebuild would learn of them).
    pub fn forget_below(&mut self, start: u64) {
        while let Some(&(last_offset, producer)) = self.by_age.first() {
            if last_offset >= start {
                break;
            }
            self.by_age.remove(&(last_offset, producer));
            self.windows.remove(&producer);
        }
    }

    /// Every window, by producer id (so equal windows give equal snapshots).
    pub fn snapshot(&self) -> Vec<WindowSnapshot> {
        let mut out: Vec<WindowSnapshot> = self
            .windows
            .iter()
            .map(|(&producer, w)| WindowSnapshot {
                producer,
                floor: w.floor,
                last_offset: w.last_offset,
                stored: w.stored.iter().collect(),
            })
            .collect();
        out.sort_unstable_by_key(|w| w.producer);
        out
    }

    /// The windows a [`snapshot`](Self::snapshot) describes; `Err` names what breaks the
    /// bounds or the shape (a damaged checkpoint must not become a wrong verdict).
    pub fn from_snapshot(snapshot: &[WindowSnapshot]) -> Result<ProducerWindows, String> {
        if snapshot.len() > PRODUCERS_MAX {
            return Err(format!(
                "{} producers, more than the {PRODUCERS_MAX} a partition keeps",
                snapshot.len()
            ));
        }
        let mut out = ProducerWindows::new();
        for w in snapshot {
            if w.stored.is_empty() || w.stored.len() > RANGES_MAX {
                return Err(format!(
                    "producer {} has {} ranges (1 to {RANGES_MAX})",
                    w.producer,
                    w.stored.len()
                ));
            }
            let mut stored = RangeSet::new();
            let mut prev_end = None;
            for &(start, end) in &w.stored {
                if start >= end || prev_end.is_some_and(|p| start <= p) || start < w.floor {
                    return Err(format!(
                        "producer {}: range {start}..{end} is empty, out of order or below \
                         the floor {}",
                        w.producer, w.floor
                    ));
                }
                stored.insert_range(start, end);
                prev_end = Some(end);
            }
            let window = Window {
                stored,
                floor: w.floor,
                last_offset: w.last_offset,
            };
            if out.windows.insert(w.producer, window).is_some() {
                return Err(format!("producer {} appears twice", w.producer));
            }
            out.by_age.insert((w.last_offset, w.producer));
        }
        Ok(out)
    }

    fn forget_oldest(&mut self) {
        if let Some((offset, producer)) = self.by_age.pop_first() {
            let forgotten = self.windows.remove(&producer);
            debug_assert!(
                forgotten.is_some_and(|w| w.last_offset == offset),
                "by_age mirrors the windows"
            );
        }
    }
}

/// Bytes of one producer's window in the encoding below, before its ranges.
const WINDOW_HEAD_BYTES: usize = 8 + 8 + 8 + 2;

/// Appends `windows` as a queue's `PRODUCERS` record and a stream's `STREAM_CHECKPOINT` hold
/// them (`docs/partition-records.md`, `docs/streams.md`): a `u32` producer count, then per
/// producer its id, floor and last offset (`u64` each), a `u16` range count and the ranges
/// (two `u64` each), all little-endian. The counts must fit their types (windows of a
/// [`ProducerWindows`] do: [`PRODUCERS_MAX`], [`RANGES_MAX`]).
pub(crate) fn encode_windows(windows: &[WindowSnapshot], out: &mut Vec<u8>) {
    debug_assert!(u32::try_from(windows.len()).is_ok());
    out.extend_from_slice(&(windows.len() as u32).to_le_bytes());
    for w in windows {
        debug_assert!(u16::try_from(w.stored.len()).is_ok());
        out.extend_from_slice(&w.producer.to_le_bytes());
        out.extend_from_slice(&w.floor.to_le_bytes());
        out.extend_from_slice(&w.last_offset.to_le_bytes());
        out.extend_from_slice(&(w.stored.len() as u16).to_le_bytes());
        for &(start, end) in &w.stored {
            out.extend_from_slice(&start.to_le_bytes());
            out.extend_from_slice(&end.to_le_bytes());
        }
    }
}

/// Reads windows written by [`encode_windows`], checked against the windows' own rules
/// (bounds, order: [`ProducerWindows::from_snapshot`]): damaged bytes never become a wrong
/// verdict.
pub(crate) fn decode_windows(
    r: &mut crate::record::Reader<'_>,
) -> crate::error::BrokerResult<Vec<WindowSnapshot>> {
    let count = r.count(WINDOW_HEAD_BYTES)?;
    let mut windows = Vec::with_capacity(count);
    for _ in 0..count {
        let producer = r.u64()?;
        let floor = r.u64()?;
        let last_offset = r.u64()?;
        let runs = usize::from(r.u16()?);
        let mut stored = Vec::with_capacity(runs.min(RANGES_MAX));
        for _ in 0..runs {
            stored.push((r.u64()?, r.u64()?));
        }
        windows.push(WindowSnapshot {
            producer,
            floor,
            last_offset,
            stored,
        });
    }
    ProducerWindows::from_snapshot(&windows).map_err(|reason| r.error(reason))?;
    Ok(windows)
}

/// Keeps `window` within [`RANGES_MAX`] ranges: the lowest go, and the floor rises past them.
fn trim(window: &mut Window) {
    while window.stored.range_count() > RANGES_MAX {
        let Some((_, end)) = window.stored.iter().next() else {
            return;
        };
        window.floor = window.floor.max(end);
        window.stored.forget_below(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_retry_is_a_duplicate_and_a_refused_message_is_new() {
        let mut windows = ProducerWindows::new();
        assert_eq!(windows.verdict(7, 1), Verdict::New);
        assert!(windows.record(7, 1, 100));
        assert!(windows.record(7, 3, 101)); // 2 was refused (a full queue)
        assert_eq!(windows.verdict(7, 1), Verdict::Duplicate);
        assert_eq!(windows.verdict(7, 3), Verdict::Duplicate);
        assert_eq!(windows.verdict(7, 2), Verdict::New, "never stored: new");
        assert_eq!(
            windows.verdict(8, 1),
            Verdict::New,
            "windows are per producer"
        );
        assert!(!windows.record(7, 3, 102), "a duplicate that raced prepare");
    }

    #[test]
    fn a_full_window_forgets_its_lowest_range_and_refuses_below_it() {
        let mut windows = ProducerWindows::new();
        // Every other sequence: one range each.
        for i in 0..=RANGES_MAX as u64 {
            assert!(windows.record(1, 10 + 2 * i, i));
        }
        // The lowest range (10) went; 11 was never stored but is below the floor now.
        assert_eq!(windows.verdict(1, 10), Verdict::TooOld { floor: 11 });
        assert_eq!(windows.verdict(1, 9), Verdict::TooOld { floor: 11 });
        assert_eq!(windows.verdict(1, 11), Verdict::New);
        assert_eq!(windows.verdict(1, 12), Verdict::Duplicate);
    }

    #[test]
    fn a_sequence_below_the_floor_applied_from_the_log_keeps_the_window_valid() {
        // Another leader's window (trimmed elsewhere) stored sequence 10 after this copy's
        // floor passed it, next to a range starting at the floor: applying that record keeps
        // the message and leaves a window that a checkpoint can carry (no range below the
        // floor).
        let mut windows = ProducerWindows::new();
        for i in 0..=RANGES_MAX as u64 {
            assert!(windows.record(1, 10 + 2 * i, i));
        }
        let offset = RANGES_MAX as u64 + 1;
        assert!(windows.record(1, 11, offset), "at the floor: new");
        assert_eq!(windows.verdict(1, 10), Verdict::TooOld { floor: 11 });
        assert!(windows.record(1, 10, offset + 1), "a stored record is kept");
        let rebuilt = ProducerWindows::from_snapshot(&windows.snapshot())
            .unwrap_or_else(|e| panic!("the window no longer makes a valid snapshot: {e}"));
        assert_eq!(rebuilt, windows);
        assert_eq!(windows.verdict(1, 10), Verdict::TooOld { floor: 11 });
    }

    #[test]
    fn the_producer_whose_last_message_is_oldest_is_forgotten_first() {
        let mut windows = ProducerWindows::new();
        for producer in 0..PRODUCERS_MAX as u64 {
            windows.record(producer, 1, producer);
        }
        windows.record(0, 2, PRODUCERS_MAX as u64); // producer 0 is recent again
        windows.record(u64::MAX, 1, PRODUCERS_MAX as u64 + 1);
        assert_eq!(windows.len(), PRODUCERS_MAX);
        assert_eq!(windows.verdict(0, 1), Verdict::Duplicate);
        assert_eq!(
            windows.verdict(1, 1),
            Verdict::New,
            "producer 1 was the oldest"
        );
        assert_eq!(windows.verdict(2, 1), Verdict::Duplicate);
    }

    proptest! {
        /// Against a model that remembers everything: a duplicate verdict is always right, a new
        /// verdict is right unless the producer was forgotten, and nothing stored is ever
        /// called new while its producer has a window and it is at or above the floor.
        #[test]
        fn verdicts_agree_with_a_model_that_remembers_everything(
            ops in proptest::collection::vec((0u64..4, 0u64..300), 1..2_000)
        ) {
            let mut windows = ProducerWindows::new();
            let mut stored = std::collections::HashSet::new();
            for (offset, (producer, sequence)) in ops.into_iter().enumerate() {
                let verdict = windows.verdict(producer, sequence);
                let was_stored = stored.contains(&(producer, sequence));
                match verdict {
                    Verdict::Duplicate => prop_assert!(was_stored),
                    Verdict::New => prop_assert!(!was_stored),
                    Verdict::TooOld { floor } => prop_assert!(sequence < floor),
                }
                if verdict == Verdict::New {
                    prop_assert!(windows.record(producer, sequence, offset as u64));
                    stored.insert((producer, sequence));
                }
                for window in windows.windows.values() {
                    prop_assert!(window.stored.range_count() <= RANGES_MAX);
                }
            }
        }

        /// The windows are a function of the records applied: applying the same records again
        /// (a replay at restart, a follower) gives the same windows.
        #[test]
        fn replay_rebuilds_the_same_windows(
            ops in proptest::collection::vec((0u64..2_000, 0u64..100), 1..3_000)
        ) {
            let mut live = ProducerWindows::new();
            let mut log = Vec::new();
            for (offset, (producer, sequence)) in ops.into_iter().enumerate() {
                if live.verdict(producer, sequence) == Verdict::New {
                    live.record(producer, sequence, offset as u64);
                    log.push((producer, sequence, offset as u64));
                }
            }
            let mut replayed = ProducerWindows::new();
            for (producer, sequence, offset) in log {
                replayed.record(producer, sequence, offset);
            }
            prop_assert_eq!(live, replayed);
        }
    }
}
