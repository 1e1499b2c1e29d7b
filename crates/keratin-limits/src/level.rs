//! `Level` and the hysteresis rule shared by disk and memory.
//!
//! Both signals are expressed as *headroom*: the bytes left before the resource runs out (effective
//! free bytes on a filesystem; limit minus resident bytes for memory). A level's threshold is a
//! headroom in bytes. Sampling and the threshold arithmetic belong to `disk` and `memory`; what a
//! level allows belongs to `admission`.

use serde::{Deserialize, Serialize};

/// How short a resource is. Ordered from healthy to critical: `Normal < Soft < Hard < Reserve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Above every threshold.
    Normal,
    /// At or past soft: spares are released and publishes slow down.
    Soft,
    /// At or past hard: publishes are rejected with a retry hint.
    Hard,
    /// At or past reserve (disk only): only writes that free space or keep the node safe.
    Reserve,
}

impl Level {
    /// Every level, from healthy to critical.
    pub const ALL: [Level; 4] = [Level::Normal, Level::Soft, Level::Hard, Level::Reserve];

    /// The stable name used in status output, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Normal => "normal",
            Level::Soft => "soft",
            Level::Hard => "hard",
            Level::Reserve => "reserve",
        }
    }

    /// The next healthier level; `Normal` stays `Normal`.
    fn shallower(self) -> Level {
        match self {
            Level::Normal | Level::Soft => Level::Normal,
            Level::Hard => Level::Soft,
            Level::Reserve => Level::Hard,
        }
    }

    /// The level after a sample with `headroom_bytes`, starting from `self`.
    ///
    /// A level is entered as soon as headroom falls to or below its threshold, so a sample can
    /// jump several levels deeper at once. A level clears only once headroom is above its
    /// threshold by more than `clear_margin_bytes`; levels clear deepest first, so one sample can
    /// also clear several levels, stopping at the first one whose margin is not yet passed.
    pub fn after_sample(self, thresholds: &Thresholds, headroom_bytes: u64) -> Level {
        let entered = thresholds.entered(headroom_bytes);
        if entered >= self {
            return entered;
        }
        let mut level = self;
        while level > entered {
            let threshold_bytes = thresholds.threshold_bytes(level).unwrap_or(0);
            let clear_bytes = threshold_bytes.saturating_add(thresholds.clear_margin_bytes);
            if headroom_bytes <= clear_bytes {
                break;
            }
            level = level.shallower();
        }
        level
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The thresholds of one resource, as headroom in bytes.
///
/// Invariant (asserted by [`Thresholds::new`]): `reserve <= hard <= soft`, so a deeper level is
/// always entered with less headroom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thresholds {
    /// Soft is entered at or below this headroom.
    pub soft_bytes: u64,
    /// Hard is entered at or below this headroom.
    pub hard_bytes: u64,
    /// Reserve is entered at or below this headroom; `None` for memory, which has no reserve.
    pub reserve_bytes: Option<u64>,
    /// A level clears only when headroom exceeds its threshold by more than this.
    pub clear_margin_bytes: u64,
}

impl Thresholds {
    /// Thresholds from their parts; panics if they are not ordered `reserve <= hard <= soft`,
    /// which validated settings guarantee.
    pub fn new(
        soft_bytes: u64,
        hard_bytes: u64,
        reserve_bytes: Option<u64>,
        clear_margin_bytes: u64,
    ) -> Thresholds {
        assert!(
            hard_bytes <= soft_bytes,
            "hard {hard_bytes} above soft {soft_bytes}"
        );
        if let Some(reserve_bytes) = reserve_bytes {
            assert!(
                reserve_bytes <= hard_bytes,
                "reserve {reserve_bytes} above hard {hard_bytes}"
            );
        }
        Thresholds {
            soft_bytes,
            hard_bytes,
            reserve_bytes,
            clear_margin_bytes,
        }
    }

    /// The threshold of `level`, or `None` for `Normal` (and for `Reserve` without a reserve).
    pub fn threshold_bytes(&self, level: Level) -> Option<u64> {
        match level {
            Level::Normal => None,
            Level::Soft => Some(self.soft_bytes),
            Level::Hard => Some(self.hard_bytes),
            Level::Reserve => self.reserve_bytes,
        }
    }

    /// The deepest level whose threshold `headroom_bytes` is at or below, ignoring hysteresis.
    pub fn entered(&self, headroom_bytes: u64) -> Level {
        if self
            .reserve_bytes
            .is_some_and(|reserve_bytes| headroom_bytes <= reserve_bytes)
        {
            Level::Reserve
        } else if headroom_bytes <= self.hard_bytes {
            Level::Hard
        } else if headroom_bytes <= self.soft_bytes {
            Level::Soft
        } else {
            Level::Normal
        }
    }
}

/// `fraction × total_bytes`, rounded down. Fractions are validated to lie in `[0, 1]`, so the
/// result never exceeds `total_bytes`. Precision: f64 holds integers exactly up to 2^53 bytes
/// (8 PiB); above that the product is off by at most a few bytes per PiB.
pub(crate) fn fraction_of(fraction: f64, total_bytes: u64) -> u64 {
    // `as` from f64 saturates and maps NaN to 0; `min` keeps a rounding excess within the total.
    let bytes = (fraction * total_bytes as f64).floor() as u64;
    bytes.min(total_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_named() {
        assert!(Level::Normal < Level::Soft && Level::Soft < Level::Hard);
        assert!(Level::Hard < Level::Reserve);
        let names: Vec<_> = Level::ALL.iter().map(|level| level.as_str()).collect();
        assert_eq!(names, ["normal", "soft", "hard", "reserve"]);
    }

    #[test]
    fn fraction_of_rounds_down_and_stays_within_total() {
        assert_eq!(fraction_of(0.10, 1000), 100);
        assert_eq!(fraction_of(1.0, u64::MAX), u64::MAX);
        assert_eq!(fraction_of(0.0, u64::MAX), 0);
        assert_eq!(fraction_of(0.333, 10), 3);
    }

    #[test]
    fn without_reserve_memory_never_enters_reserve() {
        let thresholds = Thresholds::new(20, 10, None, 5);
        assert_eq!(thresholds.entered(0), Level::Hard);
        assert_eq!(Level::Normal.after_sample(&thresholds, 0), Level::Hard);
    }
}
