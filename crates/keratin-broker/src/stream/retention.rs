//! Which whole old segments a stream partition's retention removes (`docs/streams.md`,
//! "Retention"). Pure: the owner gathers the facts (its log's segments, the message counts at
//! their heads, the time) and removes the prefix this returns; every replica decides for its own
//! copy.
//!
//! Rules, oldest segment first, never the tail (the segment being written):
//! - size: remove while the partition's bytes on disk exceed its share of `max_bytes`;
//! - age: remove while the oldest segment's newest record is older than `max_age`;
//! - count: remove while the messages held exceed its share of `max_messages`.
//!
//! So after a pass the partition holds at most its share of `max_bytes` plus the tail, and
//! whatever a bound keeps it keeps whole: a reader never finds half a segment. One rule comes
//! before the bounds: the oldest segment kept must hold a checkpoint (every full segment holds
//! several), so a pass that would start the log at a segment without one removes less.

/// What retention knows of one segment of a partition's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentFacts {
    /// Its first offset.
    pub base_offset: u64,
    /// Bytes of its file on disk.
    pub size_bytes: u64,
    /// Timestamp of its newest record; `None` when it holds none (age keeps it).
    pub newest_timestamp_ms: Option<u64>,
    /// Messages the partition appended before this segment's first offset, over its whole
    /// history (a checkpoint's `messages` at the segment's head; 0 for the log's first
    /// segment ever).
    pub messages_before: u64,
    /// Whether it holds a checkpoint: the oldest segment retention leaves must, so that the
    /// partition can be rebuilt without the segments before it (`stream/rebuild.rs`).
    pub checkpointed: bool,
}

/// One partition's bounds (its shares of the stream's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetentionBounds {
    /// Most bytes on disk.
    pub max_bytes: Option<u64>,
    /// Oldest age kept, in milliseconds.
    pub max_age_ms: Option<u64>,
    /// Most messages held.
    pub max_messages: Option<u64>,
}

/// The bound that removed a segment (the first that applies, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bound {
    /// `max_bytes`.
    Size,
    /// `max_age`.
    Age,
    /// `max_messages`.
    Count,
}

impl Bound {
    /// Its name in metrics (`bound` label) and logs.
    pub fn name(self) -> &'static str {
        match self {
            Bound::Size => "size",
            Bound::Age => "age",
            Bound::Count => "count",
        }
    }
}

/// What a retention pass removes: every record below `before`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    /// The new first offset (the base of the oldest segment kept).
    pub before: u64,
    /// Each removed segment's bound and bytes, oldest first.
    pub segments: Vec<(Bound, u64)>,
}

impl Removal {
    /// Bytes removed.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|(_, b)| b).sum()
    }
}

/// The segments `segments` (oldest first, the last being the tail) lose to `bounds` at
/// `now_ms`, with `messages_total` messages appended over the partition's history; `None`
/// when nothing goes.
pub fn decide(
    segments: &[SegmentFacts],
    messages_total: u64,
    bounds: &RetentionBounds,
    now_ms: u64,
) -> Option<Removal> {
    let (_tail, old) = segments.split_last()?;
    let mut bytes: u64 = segments.iter().map(|s| s.size_bytes).sum();
    let mut removed = Vec::new();
    for (i, segment) in old.iter().enumerate() {
        debug_assert!(
            segments[i + 1].base_offset > segment.base_offset,
            "segments in offset order"
        );
        let held = messages_total.saturating_sub(segment.messages_before);
        let bound = if bounds.max_bytes.is_some_and(|max| bytes > max) {
            Bound::Size
        } else if bounds.max_age_ms.is_some_and(|age| {
            segment
                .newest_timestamp_ms
                .is_some_and(|t| t.saturating_add(age) < now_ms)
        }) {
            Bound::Age
        } else if bounds.max_messages.is_some_and(|max| held > max) {
            Bound::Count
        } else {
            break;
        };
        removed.push((bound, segment.size_bytes));
        bytes -= segment.size_bytes;
    }
    while !removed.is_empty() && !segments[removed.len()].checkpointed {
        removed.pop();
    }
    if removed.is_empty() {
        return None;
    }
    Some(Removal {
        before: segments[removed.len()].base_offset,
        segments: removed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    /// `n` full segments of 64 MiB, 1,000 messages each, a second apart, then a tail.
    fn segments(n: u64) -> Vec<SegmentFacts> {
        (0..=n)
            .map(|i| SegmentFacts {
                base_offset: i * 1_000,
                size_bytes: if i == n { MIB } else { 64 * MIB },
                newest_timestamp_ms: Some(1_000 * (i + 1)),
                messages_before: i * 1_000,
                checkpointed: true,
            })
            .collect()
    }

    #[test]
    fn nothing_goes_without_bounds_or_with_room() {
        let segs = segments(4);
        assert_eq!(
            decide(&segs, 4_500, &RetentionBounds::default(), 10_000),
            None
        );
        let roomy = RetentionBounds {
            max_bytes: Some(1 << 40),
            max_age_ms: Some(1 << 40),
            max_messages: Some(1 << 40),
        };
        assert_eq!(decide(&segs, 4_500, &roomy, 10_000), None);
        assert_eq!(decide(&[], 0, &roomy, 0), None);
    }

    #[test]
    fn size_keeps_the_partition_within_its_share_plus_the_tail() {
        let segs = segments(4); // 4 × 64 MiB + 1 MiB
        let bounds = RetentionBounds {
            max_bytes: Some(130 * MIB),
            ..RetentionBounds::default()
        };
        let removal = decide(&segs, 4_500, &bounds, 0).expect("removes");
        // 257 MiB → 193 → 129: two segments go.
        assert_eq!(removal.before, 2_000);
        assert_eq!(removal.segments, vec![(Bound::Size, 64 * MIB); 2]);
        assert_eq!(removal.bytes(), 128 * MIB);
    }

    #[test]
    fn the_tail_is_never_removed() {
        let segs = segments(2);
        let bounds = RetentionBounds {
            max_bytes: Some(1),
            max_age_ms: Some(1),
            max_messages: Some(1),
        };
        let removal = decide(&segs, 2_500, &bounds, u64::MAX).expect("removes");
        assert_eq!(removal.before, 2_000, "up to the tail's base, not past it");
        assert_eq!(removal.segments.len(), 2);
        assert_eq!(decide(&segs[2..], 2_500, &bounds, u64::MAX), None);
    }

    #[test]
    fn age_removes_segments_whose_newest_record_is_too_old() {
        let segs = segments(4); // newest timestamps 1 s, 2 s, 3 s, 4 s, tail 5 s
        let bounds = RetentionBounds {
            max_age_ms: Some(2_000),
            ..RetentionBounds::default()
        };
        // At 5.5 s the segments whose newest is before 3.5 s go: 1 s, 2 s, 3 s.
        let removal = decide(&segs, 4_500, &bounds, 5_500).expect("removes");
        assert_eq!(removal.before, 3_000);
        assert!(removal.segments.iter().all(|(b, _)| *b == Bound::Age));
        // A segment without a timestamp stops age there.
        let mut unknown = segs.clone();
        unknown[1].newest_timestamp_ms = None;
        assert_eq!(
            decide(&unknown, 4_500, &bounds, 5_500)
                .expect("removes")
                .before,
            1_000
        );
    }

    #[test]
    fn the_oldest_segment_kept_holds_a_checkpoint() {
        let mut segs = segments(4);
        let bounds = RetentionBounds {
            max_bytes: Some(130 * MIB),
            ..RetentionBounds::default()
        };
        segs[2].checkpointed = false;
        // The bound would start the log at segment 2, which has no checkpoint: only 1 goes.
        let removal = decide(&segs, 4_500, &bounds, 0).expect("removes");
        assert_eq!(removal.before, 1_000);
        segs[1].checkpointed = false;
        assert_eq!(decide(&segs, 4_500, &bounds, 0), None);
    }

    #[test]
    fn count_keeps_at_least_the_share() {
        let segs = segments(4);
        let bounds = RetentionBounds {
            max_messages: Some(1_600),
            ..RetentionBounds::default()
        };
        // 4,500 held; removing a segment of 1,000 while more than 1,600 are held: 4,500 →
        // 3,500 → 2,500 → 1,500.
        let removal = decide(&segs, 4_500, &bounds, 0).expect("removes");
        assert_eq!(removal.before, 3_000);
        assert!(removal.segments.iter().all(|(b, _)| *b == Bound::Count));
    }

    proptest! {
        /// After a pass: the tail stays; the kept bytes exceed the size bound only by what the
        /// tail adds; every removed segment broke a bound when it went; the first kept one
        /// (unless it is the tail) breaks none.
        #[test]
        fn a_pass_honours_every_bound(
            sizes in proptest::collection::vec(1u64..100, 1..12),
            counts in proptest::collection::vec(0u64..50, 12),
            checkpointed in proptest::collection::vec(proptest::bool::weighted(0.8), 12),
            max_bytes in proptest::option::of(1u64..600),
            max_age in proptest::option::of(1u64..20),
            max_messages in proptest::option::of(1u64..400),
            now in 0u64..30,
        ) {
            let mut before = 0;
            let segs: Vec<SegmentFacts> = sizes.iter().enumerate().map(|(i, &size)| {
                let facts = SegmentFacts {
                    base_offset: i as u64 * 100,
                    size_bytes: size,
                    newest_timestamp_ms: Some(i as u64 + 1),
                    messages_before: before,
                    checkpointed: checkpointed[i],
                };
                before += counts[i];
                facts
            }).collect();
            let total = before;
            let bounds = RetentionBounds { max_bytes, max_age_ms: max_age, max_messages };
            let removed = decide(&segs, total, &bounds, now).map_or(0, |r| {
                assert_eq!(r.before, segs[r.segments.len()].base_offset);
                r.segments.len()
            });
            prop_assert!(removed < segs.len(), "the tail stays");
            if removed > 0 {
                prop_assert!(segs[removed].checkpointed, "the log starts at a checkpointed segment");
            }
            let kept = &segs[removed..];
            let kept_bytes: u64 = kept.iter().map(|s| s.size_bytes).sum();
            if let (Some(max), Some((tail, rest)), true) = (max_bytes, kept.split_last(), checkpointed.iter().all(|c| *c)) {
                if !rest.is_empty() {
                    prop_assert!(kept_bytes <= max, "more than the bound with an old segment left");
                } else {
                    prop_assert!(kept_bytes == tail.size_bytes);
                }
            }
            // Without the checkpoint rule the bounds hold as below; with it the pass may stop
            // early, at a segment that still breaks one.
            if kept.len() > 1 && checkpointed.iter().all(|c| *c) {
                let first = kept[0];
                let held = total - first.messages_before;
                prop_assert!(max_bytes.is_none_or(|m| kept_bytes <= m));
                prop_assert!(max_age.is_none_or(|a| first.newest_timestamp_ms.unwrap() + a >= now));
                prop_assert!(max_messages.is_none_or(|m| held <= m));
            }
        }
    }
}
