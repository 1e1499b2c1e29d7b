//! The memory signal: resident bytes from `/proc/self/statm`, the memory thresholds, and
//! `MemoryLevels`, the memory level with hysteresis. Discovering the limit belongs to
//! [`crate::memory_limit`].
//!
//! Memory has no reserve level: nothing the node does at reserve (acknowledging, purging,
//! reclaiming) needs memory that publishes would have taken. It clears with a longer margin than
//! disk because allocators hand freed pages back to the kernel lazily, so resident memory falls
//! late.

use std::path::Path;

use serde::Serialize;

use crate::level::{fraction_of, Level, Thresholds};
use crate::settings::MemorySettings;
use crate::LimitsError;

/// The kernel's page size, which `/proc/self/statm` counts in.
pub fn page_size_bytes() -> u64 {
    // usize → u64 is lossless on every target Rust supports.
    rustix::param::page_size() as u64
}

/// Resident memory of this process: the second field of `<proc_dir>/self/statm`, in pages, times
/// `page_size_bytes`.
pub fn read_resident_bytes(proc_dir: &Path, page_size_bytes: u64) -> Result<u64, LimitsError> {
    let path = proc_dir.join("self").join("statm");
    let text = std::fs::read_to_string(&path).map_err(|source| LimitsError::Read {
        path: path.clone(),
        source,
    })?;
    parse_statm_resident_bytes(&text, page_size_bytes)
        .map_err(|reason| LimitsError::Parse { path, reason })
}

/// Parses `/proc/self/statm` (`size resident shared text lib data dt`, in pages) into resident
/// bytes.
pub fn parse_statm_resident_bytes(text: &str, page_size_bytes: u64) -> Result<u64, String> {
    let field = text
        .split_ascii_whitespace()
        .nth(1)
        .ok_or_else(|| format!("expected at least two fields, got {:?}", text.trim()))?;
    let pages = field
        .parse::<u64>()
        .map_err(|_| format!("resident pages is not a number: {field:?}"))?;
    pages
        .checked_mul(page_size_bytes)
        .ok_or_else(|| format!("{pages} pages of {page_size_bytes} bytes overflow"))
}

/// One sample of the memory signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemorySample {
    /// Resident bytes of the process.
    pub resident_bytes: u64,
    /// The limit in force (see [`crate::MemoryLimit`]).
    pub limit_bytes: u64,
}

impl MemorySample {
    /// Bytes left before the limit: `limit - resident`, 0 past the limit.
    pub fn headroom_bytes(&self) -> u64 {
        self.limit_bytes.saturating_sub(self.resident_bytes)
    }
}

impl MemorySettings {
    /// The thresholds for `limit_bytes`, as headroom: soft is entered once resident reaches
    /// `soft_fraction × limit`, i.e. headroom falls to `limit - soft_fraction × limit`.
    pub fn thresholds(&self, limit_bytes: u64) -> Thresholds {
        let headroom = |fraction: f64| limit_bytes - fraction_of(fraction, limit_bytes);
        Thresholds::new(
            headroom(self.soft_fraction),
            headroom(self.hard_fraction),
            None,
            fraction_of(self.clear_margin_fraction, limit_bytes),
        )
    }
}

/// The memory level with hysteresis, fed one [`MemorySample`] at a time.
#[derive(Debug, Clone)]
pub struct MemoryLevels {
    settings: MemorySettings,
    level: Level,
    sample: MemorySample,
    thresholds: Thresholds,
}

impl MemoryLevels {
    /// Levels evaluated from the first sample.
    ///
    /// `settings` must have passed [`crate::LimitsSettings::validate`]; unordered thresholds
    /// are a bug in the caller and panic.
    pub fn new(settings: MemorySettings, sample: MemorySample) -> MemoryLevels {
        let thresholds = settings.thresholds(sample.limit_bytes);
        let level = Level::Normal.after_sample(&thresholds, sample.headroom_bytes());
        MemoryLevels {
            settings,
            level,
            sample,
            thresholds,
        }
    }

    /// Feeds a sample; returns the new level (never `Reserve`).
    pub fn observe(&mut self, sample: MemorySample) -> Level {
        self.thresholds = self.settings.thresholds(sample.limit_bytes);
        self.level = self
            .level
            .after_sample(&self.thresholds, sample.headroom_bytes());
        self.sample = sample;
        debug_assert!(self.level < Level::Reserve);
        self.level
    }

    /// Replaces the settings (a live settings change); they apply from the next sample.
    pub fn set_settings(&mut self, settings: MemorySettings) {
        self.settings = settings;
    }

    /// The current level.
    pub fn level(&self) -> Level {
        self.level
    }

    /// The last sample.
    pub fn sample(&self) -> MemorySample {
        self.sample
    }

    /// The thresholds of the last sample, as headroom bytes.
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// The level and position of memory, for [`crate::Admission::decide`].
    pub fn input(&self) -> crate::LevelInput {
        crate::LevelInput {
            level: self.level,
            headroom_bytes: self.sample.headroom_bytes(),
            thresholds: self.thresholds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statm_resident_is_the_second_field_in_pages() {
        assert_eq!(
            parse_statm_resident_bytes("1000 250 30 4 0 60 0\n", 4096),
            Ok(250 * 4096)
        );
        assert!(parse_statm_resident_bytes("1000\n", 4096).is_err());
        assert!(parse_statm_resident_bytes("1000 x 3\n", 4096).is_err());
        assert!(parse_statm_resident_bytes("1 18446744073709551615 0", 4096).is_err());
    }

    #[test]
    fn thresholds_are_fractions_of_the_limit_as_headroom() {
        let thresholds = MemorySettings::default().thresholds(1000);
        assert_eq!(thresholds.soft_bytes, 200);
        assert_eq!(thresholds.hard_bytes, 100);
        assert_eq!(thresholds.clear_margin_bytes, 50);
        assert_eq!(thresholds.reserve_bytes, None);
    }

    #[test]
    fn memory_enters_at_the_fraction_and_clears_below_it_by_the_margin() {
        let settings = MemorySettings::default();
        let sample = |resident_bytes| MemorySample {
            resident_bytes,
            limit_bytes: 1000,
        };
        let mut levels = MemoryLevels::new(settings, sample(799));
        assert_eq!(levels.level(), Level::Normal);
        assert_eq!(levels.observe(sample(800)), Level::Soft);
        assert_eq!(levels.observe(sample(2000)), Level::Hard);
        assert_eq!(levels.observe(sample(851)), Level::Hard);
        assert_eq!(levels.observe(sample(849)), Level::Soft);
        assert_eq!(levels.observe(sample(750)), Level::Soft);
        assert_eq!(levels.observe(sample(749)), Level::Normal);
    }
}
