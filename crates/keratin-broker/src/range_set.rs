//! `RangeSet`: a set of `u64` kept as sorted, disjoint, non-adjacent half-open ranges. Partitions
//! use it for the offsets that no longer hold a live message, so that memory follows the number
//! of gaps (out-of-order settles), not the number of messages.

use std::collections::BTreeMap;

/// A set of `u64` stored as ranges `[start, end)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    /// start -> end; ranges never touch or overlap.
    ranges: BTreeMap<u64, u64>,
    len: u64,
}

impl RangeSet {
    /// An empty set.
    pub fn new() -> RangeSet {
        RangeSet::default()
    }

    /// Number of values in the set.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True if no value is in the set.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of ranges (the memory it takes is proportional to this).
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }

    /// True if `value` is in the set.
    pub fn contains(&self, value: u64) -> bool {
        self.ranges
            .range(..=value)
            .next_back()
            .is_some_and(|(_, end)| value < *end)
    }

    /// Insert `[start, end)`; returns how many values were new.
    pub fn insert_range(&mut self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        let mut new_start = start;
        let mut new_end = end;
        let mut covered = 0;
        // Merge with a range that starts before `start` and reaches it.
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back() {
            if e >= start {
                new_start = s;
                new_end = new_end.max(e);
                covered += e.min(end).saturating_sub(start);
                self.ranges.remove(&s);
            }
        }
        // Merge with every range that starts inside `[start, end]`.
        let inside: Vec<(u64, u64)> = self
            .ranges
            .range(start..=end)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in inside {
            covered += e.min(end) - s;
            new_end = new_end.max(e);
            self.ranges.remove(&s);
        }
        self.ranges.insert(new_start, new_end);
        let added = (end - start) - covered;
        self.len += added;
        added
    }

    /// Insert one value; returns true if it was new.
    pub fn insert(&mut self, value: u64) -> bool {
        self.insert_range(value, value + 1) == 1
    }

    /// The smallest value `>= from` that is NOT in the set.
    pub fn next_absent(&self, from: u64) -> u64 {
        match self.ranges.range(..=from).next_back() {
            Some((_, &end)) if from < end => end,
            _ => from,
        }
    }

    /// The ranges of values NOT in the set within `[start, end)`, in order.
    pub fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = self.next_absent(start);
        while at < end {
            let next_present = self
                .ranges
                .range(at..)
                .next()
                .map_or(end, |(&s, _)| s.min(end));
            out.push((at, next_present));
            at = self.next_absent(next_present);
        }
        out
    }

    /// Iterate over the ranges.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&s, &e)| (s, e))
    }

    /// Forget every value below `below` (used when a log's prefix is removed).
    pub fn forget_below(&mut self, below: u64) {
        let starts: Vec<u64> = self.ranges.range(..below).map(|(&s, _)| s).collect();
        for s in starts {
            if let Some(e) = self.ranges.remove(&s) {
                if e > below {
                    self.ranges.insert(below, e);
                    self.len -= below - s;
                } else {
                    self.len -= e - s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn behaves_like_a_btreeset(ops in proptest::collection::vec((0u64..200, 1u64..20), 0..60), forget in 0u64..220) {
            let mut set = RangeSet::new();
            let mut model = BTreeSet::new();
            for (start, len) in ops {
                let added = set.insert_range(start, start + len);
                let before = model.len();
                model.extend(start..start + len);
                prop_assert_eq!(added as usize, model.len() - before);
            }
            prop_assert_eq!(set.len() as usize, model.len());
            for v in 0..230 {
                prop_assert_eq!(set.contains(v), model.contains(&v));
                let absent = (v..).find(|x| !model.contains(x)).unwrap();
                prop_assert_eq!(set.next_absent(v), absent);
            }
            let gaps: Vec<u64> = set.gaps(10, 150).into_iter().flat_map(|(s, e)| s..e).collect();
            let model_gaps: Vec<u64> = (10..150).filter(|v| !model.contains(v)).collect();
            prop_assert_eq!(gaps, model_gaps);
            // Ranges never touch.
            let ranges: Vec<_> = set.iter().collect();
            for pair in ranges.windows(2) {
                prop_assert!(pair[0].1 < pair[1].0);
            }
            set.forget_below(forget);
            model.retain(|v| *v >= forget);
            prop_assert_eq!(set.len() as usize, model.len());
        }
    }
}
