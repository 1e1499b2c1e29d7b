//! The disk signal: sampling a filesystem (`statvfs`), the node storage budget, the per-filesystem
//! thresholds, and `DiskLevels`, the per-filesystem level with hysteresis. Which filesystems hold
//! storage, deduplicating them by device, and counting spare files belong to the caller (the
//! server and the segment pool).
//!
//! # Small filesystems
//! Each threshold is `max(fraction × total, floor)` free bytes, clamped to the filesystem's total.
//! The clamp only keeps the arithmetic within the filesystem; it does not change the meaning of a
//! floor. A floor at or above the filesystem's size means the level is *always* entered: with the
//! default floors (soft 4 GiB, hard 2 GiB, reserve 512 MiB) a 128 MiB tmpfs is permanently at
//! reserve and never accepts a publish. That is deliberate — the floors protect real disks — and
//! an operator running on a small filesystem sets the floors to 0 (or to sizes that fit) and lets
//! the fractions decide.

use std::path::Path;

use serde::Serialize;

use crate::level::{fraction_of, Level, Thresholds};
use crate::settings::DiskSettings;
use crate::LimitsError;

/// A filesystem's identity: `st_dev` of a path on it. Storage directories on the same device
/// share one sample and one level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct DeviceId(pub u64);

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Linux's encoding of dev_t: major is bits 8..20 and 32..64, minor bits 0..8 and 20..32.
        let major = ((self.0 >> 8) & 0xfff) | ((self.0 >> 32) & 0xffff_f000);
        let minor = (self.0 & 0xff) | ((self.0 >> 12) & 0xffff_ff00);
        write!(f, "{major}:{minor}")
    }
}

/// One `statvfs` of a filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FilesystemSample {
    /// The device the path lives on.
    pub device: DeviceId,
    /// `f_blocks × f_frsize`.
    pub total_bytes: u64,
    /// `f_bavail × f_frsize`: free bytes available to an unprivileged process. Root's reserved
    /// blocks are not counted, so the levels hold for Keratin whether or not it runs as root.
    pub free_bytes: u64,
}

/// Samples the filesystem holding `path`. Cheap (two system calls); still, run it on the sampling
/// timer, never inside a request.
pub fn sample_filesystem(path: &Path) -> Result<FilesystemSample, LimitsError> {
    let error = |source: rustix::io::Errno| LimitsError::Filesystem {
        path: path.to_path_buf(),
        source: source.into(),
    };
    let stat = rustix::fs::stat(path).map_err(error)?;
    let statvfs = rustix::fs::statvfs(path).map_err(error)?;
    Ok(FilesystemSample {
        #[expect(
            clippy::useless_conversion,
            reason = "st_dev is u64 on some targets only"
        )]
        device: DeviceId(u64::from(stat.st_dev)),
        total_bytes: statvfs.f_blocks.saturating_mul(statvfs.f_frsize),
        free_bytes: statvfs.f_bavail.saturating_mul(statvfs.f_frsize),
    })
}

/// The disk signal of one filesystem, as the levels see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DiskSample {
    /// The filesystem's size (or the budget, see [`DiskSample::within_budget`]).
    pub total_bytes: u64,
    /// Free bytes reported by the filesystem (`f_bavail × f_frsize`).
    pub free_bytes: u64,
    /// Bytes in spare segment files on this filesystem: the node can delete them at once, so
    /// they count as free.
    pub spare_bytes: u64,
}

impl DiskSample {
    /// A sample from a `statvfs` and the pool's spare bytes on that filesystem.
    pub fn new(filesystem: &FilesystemSample, spare_bytes: u64) -> DiskSample {
        DiskSample {
            total_bytes: filesystem.total_bytes,
            free_bytes: filesystem.free_bytes,
            spare_bytes,
        }
    }

    /// Applies the node storage budget (`[storage] max_bytes`, 0 = none), which acts as a
    /// smaller filesystem: total becomes `min(total, max_bytes)` and free becomes
    /// `min(free, max_bytes - used_bytes)`.
    ///
    /// `used_bytes` is everything Keratin's storage occupies, spare files included (spares are
    /// then added back as free by [`DiskSample::effective_free_bytes`]). The budget is per node;
    /// with storage on several filesystems, pass the node-wide `used_bytes` for each, so every
    /// filesystem sees the whole budget's pressure.
    pub fn within_budget(self, max_bytes: u64, used_bytes: u64) -> DiskSample {
        if max_bytes == 0 {
            return self;
        }
        DiskSample {
            total_bytes: self.total_bytes.min(max_bytes),
            free_bytes: self.free_bytes.min(max_bytes.saturating_sub(used_bytes)),
            spare_bytes: self.spare_bytes,
        }
    }

    /// Free bytes counting spares as free, never more than the total.
    pub fn effective_free_bytes(&self) -> u64 {
        self.free_bytes
            .saturating_add(self.spare_bytes)
            .min(self.total_bytes)
    }
}

impl DiskSettings {
    /// The thresholds for a filesystem of `total_bytes`, as free bytes. See the module docs for
    /// floors larger than the filesystem.
    pub fn thresholds(&self, total_bytes: u64) -> Thresholds {
        let threshold = |fraction: f64, floor_bytes: u64| {
            fraction_of(fraction, total_bytes)
                .max(floor_bytes)
                .min(total_bytes)
        };
        Thresholds::new(
            threshold(self.soft_fraction, self.soft_floor_bytes),
            threshold(self.hard_fraction, self.hard_floor_bytes),
            Some(threshold(self.reserve_fraction, self.reserve_floor_bytes)),
            fraction_of(self.clear_margin_fraction, total_bytes),
        )
    }
}

/// The level of one filesystem with hysteresis, fed one [`DiskSample`] at a time.
#[derive(Debug, Clone)]
pub struct DiskLevels {
    settings: DiskSettings,
    level: Level,
    sample: DiskSample,
    thresholds: Thresholds,
}

impl DiskLevels {
    /// Levels for a filesystem, evaluated from its first sample: a node that starts on a full
    /// disk is at the right level from the start, not `Normal` until the next sample.
    ///
    /// `settings` must have passed [`crate::LimitsSettings::validate`]; unordered thresholds
    /// are a bug in the caller and panic.
    pub fn new(settings: DiskSettings, sample: DiskSample) -> DiskLevels {
        let thresholds = settings.thresholds(sample.total_bytes);
        let level = Level::Normal.after_sample(&thresholds, sample.effective_free_bytes());
        DiskLevels {
            settings,
            level,
            sample,
            thresholds,
        }
    }

    /// Feeds a sample; returns the new level. Thresholds follow the sample's total, so a
    /// resized filesystem or a changed budget takes effect at once.
    pub fn observe(&mut self, sample: DiskSample) -> Level {
        self.thresholds = self.settings.thresholds(sample.total_bytes);
        self.level = self
            .level
            .after_sample(&self.thresholds, sample.effective_free_bytes());
        self.sample = sample;
        self.level
    }

    /// Replaces the settings (a live settings change); they apply from the next sample.
    pub fn set_settings(&mut self, settings: DiskSettings) {
        self.settings = settings;
    }

    /// The current level.
    pub fn level(&self) -> Level {
        self.level
    }

    /// The last sample.
    pub fn sample(&self) -> DiskSample {
        self.sample
    }

    /// The thresholds of the last sample, as free bytes.
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// The level and position of this filesystem, for [`crate::Admission::decide`].
    pub fn input(&self) -> crate::LevelInput {
        crate::LevelInput {
            level: self.level,
            headroom_bytes: self.sample.effective_free_bytes(),
            thresholds: self.thresholds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn defaults_on_a_large_disk_use_the_fractions() {
        let thresholds = DiskSettings::default().thresholds(1000 * GIB);
        assert_eq!(thresholds.soft_bytes, 100 * GIB);
        assert_eq!(thresholds.hard_bytes, 50 * GIB);
        assert_eq!(thresholds.reserve_bytes, Some(10 * GIB));
        assert_eq!(thresholds.clear_margin_bytes, 10 * GIB);
    }

    #[test]
    fn defaults_on_a_small_disk_use_the_floors() {
        let thresholds = DiskSettings::default().thresholds(20 * GIB);
        assert_eq!(thresholds.soft_bytes, 4 * GIB);
        assert_eq!(thresholds.hard_bytes, 2 * GIB);
        assert_eq!(thresholds.reserve_bytes, Some(GIB / 2));
    }

    #[test]
    fn floors_larger_than_a_tmpfs_keep_it_at_reserve() {
        let total_bytes = 128 << 20;
        let sample = DiskSample {
            total_bytes,
            free_bytes: total_bytes,
            spare_bytes: 0,
        };
        let levels = DiskLevels::new(DiskSettings::default(), sample);
        assert_eq!(levels.level(), Level::Reserve);
        assert_eq!(levels.thresholds().soft_bytes, total_bytes);
    }

    #[test]
    fn budget_acts_as_a_smaller_filesystem() {
        let sample = DiskSample {
            total_bytes: 100 * GIB,
            free_bytes: 60 * GIB,
            spare_bytes: GIB,
        };
        let budgeted = sample.within_budget(10 * GIB, 8 * GIB);
        assert_eq!(budgeted.total_bytes, 10 * GIB);
        assert_eq!(budgeted.free_bytes, 2 * GIB);
        assert_eq!(budgeted.effective_free_bytes(), 3 * GIB);
        assert_eq!(sample.within_budget(0, 8 * GIB), sample);
        // The filesystem is fuller than the budget: the filesystem's free bytes win.
        let full = DiskSample {
            free_bytes: GIB / 2,
            ..sample
        }
        .within_budget(10 * GIB, 8 * GIB);
        assert_eq!(full.free_bytes, GIB / 2);
    }

    #[test]
    fn device_id_prints_major_minor() {
        assert_eq!(DeviceId((8 << 8) | 1).to_string(), "8:1");
        assert_eq!(DeviceId((259 << 8) | 3).to_string(), "259:3");
        // makedev(4096, 256): both halves use their high bits.
        assert_eq!(DeviceId((1 << 44) | (1 << 20)).to_string(), "4096:256");
    }
}
