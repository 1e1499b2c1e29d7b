//! Time to full: for a storage file system, the projected time until its free space reaches
//! the hard and the reserve level, from how fast free space fell over the last few minutes
//! ([`project`], pure). The fall is the node's net write rate (appended minus reclaimed bytes)
//! plus whatever else writes to the file system, which is what fills it. Shown on the
//! dashboard, in `GET /api/v1/status` and `/metrics`, and as a `disk_filling` attention item
//! under an hour; never used for admission (levels alone decide publishes).
//!
//! Nothing is projected while free space is flat or growing, or from too little history: a
//! projection needs [`POINTS_MIN`] points over at least [`SPAN_MIN_MS`] within the last
//! [`WINDOW_MS`], and a fall of at least [`RATE_MIN_BYTES_PER_S`].

use crate::history::FreeSpacePoint;

/// The history a projection looks at: the last five minutes.
pub const WINDOW_MS: u64 = 5 * 60 * 1000;

/// A projection needs points over at least half a minute...
pub const SPAN_MIN_MS: u64 = 30_000;

/// ... and at least this many of them (the history keeps one per 2 s).
pub const POINTS_MIN: usize = 5;

/// Below this fall (1 KiB/s, about 84 MiB a day) free space counts as flat.
pub const RATE_MIN_BYTES_PER_S: f64 = 1024.0;

/// A `disk_filling` item is raised when hard is projected within this long...
pub const FILLING_WITHIN_MS: u64 = 60 * 60 * 1000;

/// ... and cleared once it is projected beyond this (or not at all), so a rate that wavers
/// around the hour does not raise and clear every sample.
pub const FILLING_CLEARED_BEYOND_MS: u64 = 75 * 60 * 1000;

/// Where a file system is heading.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Projection {
    /// How fast free space falls, bytes per second (always above [`RATE_MIN_BYTES_PER_S`]).
    pub fill_bytes_per_s: f64,
    /// Until free space reaches the hard level's threshold (0: already there).
    pub to_hard_ms: u64,
    /// Until it reaches the reserve level's threshold (0: already there).
    pub to_reserve_ms: u64,
}

/// Projects `points` (oldest first, the newest is the current figure) at `now_ms` towards the
/// thresholds `hard_bytes` and `reserve_bytes` (free bytes): `None` when free space is flat or
/// growing, or the history is too short (module docs).
pub fn project(
    points: &[FreeSpacePoint],
    now_ms: u64,
    hard_bytes: u64,
    reserve_bytes: u64,
) -> Option<Projection> {
    let since_ms = now_ms.saturating_sub(WINDOW_MS);
    let recent: Vec<&FreeSpacePoint> = points.iter().filter(|p| p.at_ms >= since_ms).collect();
    let (first, last) = (recent.first()?, recent.last()?);
    if recent.len() < POINTS_MIN || last.at_ms.saturating_sub(first.at_ms) < SPAN_MIN_MS {
        return None;
    }
    // Least squares over the window: a burst or one odd sample moves the slope less than a
    // difference of two points would.
    let n = recent.len() as f64;
    let t0 = first.at_ms;
    let xs: Vec<f64> = recent
        .iter()
        .map(|p| (p.at_ms - t0) as f64 / 1000.0)
        .collect();
    let ys: Vec<f64> = recent.iter().map(|p| p.free_bytes as f64).collect();
    let mean_x = xs.iter().sum::<f64>() / n;
    let mean_y = ys.iter().sum::<f64>() / n;
    let covariance: f64 = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| (x - mean_x) * (y - mean_y))
        .sum();
    let variance: f64 = xs.iter().map(|x| (x - mean_x).powi(2)).sum();
    if variance <= 0.0 {
        return None;
    }
    let fill_bytes_per_s = -covariance / variance;
    if !fill_bytes_per_s.is_finite() || fill_bytes_per_s < RATE_MIN_BYTES_PER_S {
        return None;
    }
    let until = |threshold: u64| -> u64 {
        let left = last.free_bytes.saturating_sub(threshold) as f64;
        (left / fill_bytes_per_s * 1000.0).min(u64::MAX as f64) as u64
    };
    Some(Projection {
        fill_bytes_per_s,
        to_hard_ms: until(hard_bytes),
        to_reserve_ms: until(reserve_bytes),
    })
}

/// A duration for people: `42 s`, `17 min`, `3.5 h`, `6 d`.
pub fn duration_text(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        7200..=172_799 => format!("{:.1} h", s as f64 / 3600.0),
        _ => format!("{} d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn falling(points: u64, every_ms: u64, from: u64, per_s: u64) -> Vec<FreeSpacePoint> {
        (0..points)
            .map(|i| FreeSpacePoint {
                at_ms: 1_000_000 + i * every_ms,
                free_bytes: from - per_s * i * every_ms / 1000,
            })
            .collect()
    }

    #[test]
    fn a_steady_fall_projects_the_time_to_each_level() {
        // 1 MiB/s for two minutes, 600 MiB free at the end.
        let points = falling(61, 2_000, 720 * MIB, MIB);
        let now = points.last().expect("points").at_ms;
        let p = project(&points, now, 100 * MIB, 20 * MIB).expect("projected");
        assert!((p.fill_bytes_per_s - MIB as f64).abs() < 1.0, "{p:?}");
        assert_eq!(p.to_hard_ms, 500_000, "500 MiB at 1 MiB/s");
        assert_eq!(p.to_reserve_ms, 580_000);
        // Past hard already: 0.
        let p = project(&points, now, 700 * MIB, 20 * MIB).expect("projected");
        assert_eq!(p.to_hard_ms, 0);
    }

    #[test]
    fn flat_growing_or_short_histories_project_nothing() {
        let flat = falling(61, 2_000, 720 * MIB, 0);
        let now = flat.last().expect("points").at_ms;
        assert_eq!(project(&flat, now, MIB, MIB), None, "flat");
        let mut growing = falling(61, 2_000, 720 * MIB, MIB);
        growing.reverse();
        for (i, p) in growing.iter_mut().enumerate() {
            p.at_ms = 1_000_000 + i as u64 * 2_000;
        }
        assert_eq!(project(&growing, now, MIB, MIB), None, "growing");
        let short = falling(10, 2_000, 720 * MIB, MIB);
        let now_short = short.last().expect("points").at_ms;
        assert_eq!(
            project(&short, now_short, MIB, MIB),
            None,
            "18 s of history"
        );
        let slow = falling(61, 2_000, 720 * MIB, 512);
        assert_eq!(
            project(&slow, now, MIB, MIB),
            None,
            "512 B/s counts as flat"
        );
        // Only the last five minutes count: an old fall followed by a flat stretch is flat.
        let mut old_then_flat = falling(100, 2_000, 720 * MIB, MIB);
        let floor = old_then_flat.last().expect("points").free_bytes;
        let start = old_then_flat.last().expect("points").at_ms;
        old_then_flat.extend((1..=160).map(|i| FreeSpacePoint {
            at_ms: start + i * 2_000,
            free_bytes: floor,
        }));
        let now = old_then_flat.last().expect("points").at_ms;
        assert_eq!(project(&old_then_flat, now, MIB, MIB), None);
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration_text(42_000), "42 s");
        assert_eq!(duration_text(17 * 60_000), "17 min");
        assert_eq!(duration_text(3 * 3_600_000 + 1_800_000), "3.5 h");
        assert_eq!(duration_text(6 * 86_400_000), "6 d");
    }
}
