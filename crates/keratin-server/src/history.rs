//! [`FreeSpaceHistory`]: the recent free space of each storage file system, for the dashboard's
//! plot (`history` in `GET /api/v1/status`). It only remembers what the sampler saw; sampling,
//! levels and thresholds belong to [`crate::limits::NodeLimits`].
//!
//! Samples arrive every `sample_interval_ms` (100 ms in tests, more after segment rolls) but a
//! plot a few hundred pixels wide needs far fewer points, so the ring keeps one point per
//! [`HISTORY_BUCKET_MS`] bucket: the latest sample in that bucket, so the newest point is always
//! the current figure.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// How far back the history reaches: the last 10 minutes.
pub const HISTORY_SPAN_MS: u64 = 10 * 60 * 1000;

/// One point per 2 s: 10 minutes in 300 points, about one per pixel of the dashboard's plot.
pub const HISTORY_BUCKET_MS: u64 = 2_000;

/// The most points kept per file system: one per bucket of the span, plus the bucket under way.
pub const HISTORY_POINTS_MAX: usize = (HISTORY_SPAN_MS / HISTORY_BUCKET_MS) as usize + 1;

const _: () = assert!(HISTORY_SPAN_MS.is_multiple_of(HISTORY_BUCKET_MS));

/// A sample of one file system: when (ms since the epoch) and its free bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeSpacePoint {
    /// When the sample was taken, ms since the Unix epoch.
    pub at_ms: u64,
    /// Free bytes as the levels see them (spare files count as free).
    pub free_bytes: u64,
}

/// The recent free space of every storage file system, one bounded ring per device.
#[derive(Debug, Default)]
pub struct FreeSpaceHistory {
    rings: Mutex<BTreeMap<u64, VecDeque<FreeSpacePoint>>>,
}

impl FreeSpaceHistory {
    /// An empty history.
    pub fn new() -> FreeSpaceHistory {
        FreeSpaceHistory::default()
    }

    /// Record a sample of `device`. A sample in the same bucket as the last point replaces it;
    /// points older than [`HISTORY_SPAN_MS`] before `at_ms` are dropped. A sample older than the
    /// last point (the wall clock stepped back) starts the ring again rather than drawing a
    /// line backwards in time.
    pub fn record(&self, device: u64, at_ms: u64, free_bytes: u64) {
        let point = FreeSpacePoint { at_ms, free_bytes };
        let mut rings = self.lock();
        let ring = rings.entry(device).or_default();
        match ring.back_mut() {
            Some(last) if at_ms < last.at_ms => {
                ring.clear();
                ring.push_back(point);
            }
            Some(last) if at_ms / HISTORY_BUCKET_MS == last.at_ms / HISTORY_BUCKET_MS => {
                *last = point;
            }
            _ => ring.push_back(point),
        }
        let oldest_ms = at_ms.saturating_sub(HISTORY_SPAN_MS);
        while ring.front().is_some_and(|p| p.at_ms < oldest_ms) {
            ring.pop_front();
        }
        // One point per bucket over the span bounds the ring; this trims only if the invariant
        // were broken, so memory stays bounded whatever the clock does.
        while ring.len() > HISTORY_POINTS_MAX {
            ring.pop_front();
        }
        debug_assert!(ring
            .iter()
            .zip(ring.iter().skip(1))
            .all(|(a, b)| a.at_ms < b.at_ms));
    }

    /// The points of `device`, oldest first (empty for a device never sampled).
    pub fn points(&self, device: u64) -> Vec<FreeSpacePoint> {
        self.lock()
            .get(&device)
            .map(|ring| ring.iter().copied().collect())
            .unwrap_or_default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, VecDeque<FreeSpacePoint>>> {
        // A panic while holding the lock cannot leave a ring half-updated in a way that matters
        // for a plot, so a poisoned lock is used as is.
        self.rings.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_point_per_bucket_holding_the_latest_sample() {
        let history = FreeSpaceHistory::new();
        history.record(7, 10_000, 500);
        history.record(7, 10_100, 400);
        history.record(7, 11_900, 300);
        history.record(7, 12_000, 200);
        assert_eq!(
            history.points(7),
            vec![
                FreeSpacePoint {
                    at_ms: 11_900,
                    free_bytes: 300
                },
                FreeSpacePoint {
                    at_ms: 12_000,
                    free_bytes: 200
                },
            ]
        );
        assert!(history.points(8).is_empty(), "devices are kept apart");
    }

    #[test]
    fn keeps_ten_minutes_in_a_bounded_ring() {
        let history = FreeSpaceHistory::new();
        let start_ms = 1_700_000_000_000;
        // Twenty minutes of samples every 100 ms.
        for i in 0..12_000 {
            history.record(1, start_ms + i * 100, i);
        }
        let points = history.points(1);
        assert!(points.len() <= HISTORY_POINTS_MAX, "{}", points.len());
        assert!(points.len() >= HISTORY_POINTS_MAX - 1, "{}", points.len());
        let last = points.last().expect("points");
        assert_eq!(last.at_ms, start_ms + 11_999 * 100);
        assert_eq!(last.free_bytes, 11_999);
        assert!(points[0].at_ms >= last.at_ms - HISTORY_SPAN_MS);
    }

    #[test]
    fn a_clock_stepping_back_starts_again() {
        let history = FreeSpaceHistory::new();
        history.record(1, 50_000, 10);
        history.record(1, 52_000, 20);
        history.record(1, 40_000, 30);
        assert_eq!(
            history.points(1),
            vec![FreeSpacePoint {
                at_ms: 40_000,
                free_bytes: 30
            }]
        );
    }
}
