//! `SyncHistogram`: how long the commit workers' syncs (`sync_data` of segments, `sync_dir` of
//! log directories) take, in fixed power-of-two buckets of atomics. Recording one sync is a few
//! relaxed atomic adds and no allocation, so every sync is measured. The [`crate::SegmentPool`]
//! holds one, shared by every log of a node; metrics read it with
//! [`crate::SegmentPool::sync_histogram`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bound of the first bucket: 8 µs, below any real device's fdatasync.
pub const SYNC_BUCKET_FIRST_MICROS: u64 = 8;

/// Finite buckets: 8 µs << 21 = 16.8 s is the last bound; a slower sync lands in the overflow
/// bucket (`+Inf`).
pub const SYNC_BUCKET_COUNT: usize = 22;

const _: () = assert!(SYNC_BUCKET_FIRST_MICROS.is_power_of_two());
const _: () = assert!(
    SYNC_BUCKET_COUNT < 40,
    "bounds must fit in u64 microseconds"
);

/// The exponent of [`SYNC_BUCKET_FIRST_MICROS`].
const FIRST_SHIFT: u32 = SYNC_BUCKET_FIRST_MICROS.trailing_zeros();

/// Sync latencies since the pool was created.
#[derive(Debug, Default)]
pub(crate) struct SyncHistogram {
    /// Syncs per bucket (not cumulative); the last one is the overflow bucket.
    buckets: [AtomicU64; SYNC_BUCKET_COUNT + 1],
    sum_nanos: AtomicU64,
}

/// The bucket of a sync that took `elapsed`: the first whose bound is at least the duration
/// rounded up to whole microseconds.
fn bucket_index(elapsed: Duration) -> usize {
    let micros = u64::try_from(elapsed.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX);
    // The smallest k with micros <= 2^k (k = 0 for 0 and 1 µs).
    let k = u64::BITS - micros.saturating_sub(1).leading_zeros();
    let index = k.saturating_sub(FIRST_SHIFT) as usize;
    index.min(SYNC_BUCKET_COUNT)
}

impl SyncHistogram {
    /// Count one sync that took `elapsed`.
    pub(crate) fn record(&self, elapsed: Duration) {
        self.buckets[bucket_index(elapsed)].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The figures now. Concurrent syncs may land between two loads; each figure is exact.
    pub(crate) fn snapshot(&self) -> SyncHistogramSnapshot {
        let mut counts = [0u64; SYNC_BUCKET_COUNT + 1];
        for (count, bucket) in counts.iter_mut().zip(&self.buckets) {
            *count = bucket.load(Ordering::Relaxed);
        }
        SyncHistogramSnapshot {
            counts,
            sum_nanos: self.sum_nanos.load(Ordering::Relaxed),
        }
    }
}

/// Sync latencies of the logs sharing a pool, for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncHistogramSnapshot {
    /// Syncs per bucket, not cumulative: bucket `i < SYNC_BUCKET_COUNT` holds syncs of at most
    /// [`SyncHistogramSnapshot::bound_micros`]`(i)` and more than the bound before; the last
    /// bucket holds the slower ones.
    pub counts: [u64; SYNC_BUCKET_COUNT + 1],
    /// Total time of all syncs, in nanoseconds.
    pub sum_nanos: u64,
}

impl SyncHistogramSnapshot {
    /// The upper bound of finite bucket `index`, in microseconds.
    pub fn bound_micros(index: usize) -> u64 {
        assert!(
            index < SYNC_BUCKET_COUNT,
            "bucket {index} has no finite bound"
        );
        SYNC_BUCKET_FIRST_MICROS << index
    }

    /// Syncs counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// `(upper bound in seconds, cumulative count)` per finite bucket, as Prometheus wants them;
    /// the `+Inf` bucket is [`SyncHistogramSnapshot::count`].
    pub fn cumulative_seconds(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        (0..SYNC_BUCKET_COUNT)
            .map(|index| {
                total += self.counts[index];
                (Self::bound_micros(index) as f64 / 1e6, total)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_durations_up_to_their_bound() {
        let micros = Duration::from_micros;
        assert_eq!(bucket_index(Duration::ZERO), 0);
        assert_eq!(bucket_index(micros(8)), 0);
        assert_eq!(bucket_index(Duration::from_nanos(8_001)), 1);
        assert_eq!(bucket_index(micros(16)), 1);
        assert_eq!(bucket_index(micros(17)), 2);
        assert_eq!(bucket_index(micros(1_000)), 7); // 1024 µs
        let last = SyncHistogramSnapshot::bound_micros(SYNC_BUCKET_COUNT - 1);
        assert_eq!(bucket_index(micros(last)), SYNC_BUCKET_COUNT - 1);
        assert_eq!(bucket_index(micros(last + 1)), SYNC_BUCKET_COUNT);
        assert_eq!(bucket_index(Duration::MAX), SYNC_BUCKET_COUNT);
    }

    #[test]
    fn snapshot_counts_and_sums_what_was_recorded() {
        let histogram = SyncHistogram::default();
        for micros in [5, 100, 100, 3_000_000] {
            histogram.record(Duration::from_micros(micros));
        }
        let snapshot = histogram.snapshot();
        assert_eq!(snapshot.count(), 4);
        assert_eq!(snapshot.sum_nanos, 3_000_205_000);
        let cumulative = snapshot.cumulative_seconds();
        assert_eq!(cumulative[0], (8e-6, 1));
        assert_eq!(cumulative[4].1, 3, "128 µs bucket holds both 100 µs syncs");
        assert_eq!(cumulative.last().map(|c| c.1), Some(4));
    }
}
