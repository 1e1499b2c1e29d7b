//! `LimitsSettings`: the `[limits]` section of the node's settings, its defaults, and
//! `validate()`. The TOML names are the ones operators and scripts rely on (issue 6, "Names");
//! renaming a field is a breaking change. Reading the file and live changes belong to the server.
//!
//! The storage budget (`[storage] max_bytes`) is not here: it belongs to the storage section and
//! reaches this crate as an argument of [`crate::DiskSample::within_budget`].

use serde::{Deserialize, Serialize};

use crate::LimitsError;

const GIB: u64 = 1024 * 1024 * 1024;
const MIB: u64 = 1024 * 1024;

/// Upper bound of `limits.sample_interval_ms`: a level older than a minute no longer describes a
/// disk that a full-speed publisher can fill in seconds.
pub const SAMPLE_INTERVAL_MS_MAX: u64 = 60_000;

/// Upper bound of `limits.max_delay_ms`: a per-batch delay longer than a minute would outlast any
/// sensible publish timeout; past that point rejecting (hard) is the honest answer.
pub const MAX_DELAY_MS_MAX: u64 = 60_000;

/// The `[limits]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSettings {
    /// How often each filesystem and memory are sampled (also sampled after each segment roll).
    pub sample_interval_ms: u64,
    /// The publish delay at the hard threshold; the delay is 0 at soft and grows linearly.
    pub max_delay_ms: u64,
    /// `[limits.disk]`.
    pub disk: DiskSettings,
    /// `[limits.memory]`.
    pub memory: MemorySettings,
}

/// The `[limits.disk]` section. Each threshold is a fraction of the filesystem with an absolute
/// floor, whichever is larger, in *free* bytes. See [`crate::disk`] for small filesystems.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiskSettings {
    /// Soft is entered at or below this fraction of the filesystem free.
    pub soft_fraction: f64,
    /// Soft is entered at or below this many bytes free, if larger than the fraction.
    pub soft_floor_bytes: u64,
    /// Hard is entered at or below this fraction free.
    pub hard_fraction: f64,
    /// Hard is entered at or below this many bytes free, if larger than the fraction.
    pub hard_floor_bytes: u64,
    /// Reserve is entered at or below this fraction free.
    pub reserve_fraction: f64,
    /// Reserve is entered at or below this many bytes free, if larger than the fraction.
    pub reserve_floor_bytes: u64,
    /// A level clears once free space is above its threshold by this fraction of the filesystem.
    pub clear_margin_fraction: f64,
}

/// The `[limits.memory]` section. Thresholds are fractions of the memory limit, in resident bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemorySettings {
    /// A configured limit; the effective limit is the smaller of this and the cgroup's. 0 = none.
    pub limit_bytes: u64,
    /// Soft is entered at or above this fraction of the limit resident.
    pub soft_fraction: f64,
    /// Hard is entered at or above this fraction of the limit resident.
    pub hard_fraction: f64,
    /// A level clears once resident memory is below its threshold by this fraction of the limit.
    pub clear_margin_fraction: f64,
}

impl Default for LimitsSettings {
    fn default() -> Self {
        LimitsSettings {
            sample_interval_ms: 1000,
            max_delay_ms: 50,
            disk: DiskSettings::default(),
            memory: MemorySettings::default(),
        }
    }
}

impl Default for DiskSettings {
    fn default() -> Self {
        DiskSettings {
            soft_fraction: 0.10,
            soft_floor_bytes: 4 * GIB,
            hard_fraction: 0.05,
            hard_floor_bytes: 2 * GIB,
            reserve_fraction: 0.01,
            reserve_floor_bytes: 512 * MIB,
            clear_margin_fraction: 0.01,
        }
    }
}

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            limit_bytes: 0,
            soft_fraction: 0.80,
            hard_fraction: 0.90,
            clear_margin_fraction: 0.05,
        }
    }
}

impl LimitsSettings {
    /// Checks every key; the error names the first bad key, its value and the expected form.
    pub fn validate(&self) -> Result<(), LimitsError> {
        check(
            (1..=SAMPLE_INTERVAL_MS_MAX).contains(&self.sample_interval_ms),
            "limits.sample_interval_ms",
            self.sample_interval_ms,
            "an interval in milliseconds from 1 to 60000",
        )?;
        check(
            self.max_delay_ms <= MAX_DELAY_MS_MAX,
            "limits.max_delay_ms",
            self.max_delay_ms,
            "a delay in milliseconds from 0 to 60000",
        )?;
        self.disk.validate()?;
        self.memory.validate()
    }
}

impl DiskSettings {
    /// Checks the `[limits.disk]` keys.
    pub fn validate(&self) -> Result<(), LimitsError> {
        check_fraction("limits.disk.soft_fraction", self.soft_fraction)?;
        check_fraction("limits.disk.hard_fraction", self.hard_fraction)?;
        check_fraction("limits.disk.reserve_fraction", self.reserve_fraction)?;
        check_fraction(
            "limits.disk.clear_margin_fraction",
            self.clear_margin_fraction,
        )?;
        // Ordering fractions and floors separately makes max(fraction × total, floor) ordered
        // for every filesystem size: reserve <= hard <= soft.
        check(
            self.hard_fraction <= self.soft_fraction,
            "limits.disk.hard_fraction",
            self.hard_fraction,
            "a fraction no larger than limits.disk.soft_fraction",
        )?;
        check(
            self.reserve_fraction <= self.hard_fraction,
            "limits.disk.reserve_fraction",
            self.reserve_fraction,
            "a fraction no larger than limits.disk.hard_fraction",
        )?;
        check(
            self.hard_floor_bytes <= self.soft_floor_bytes,
            "limits.disk.hard_floor_bytes",
            self.hard_floor_bytes,
            "bytes no larger than limits.disk.soft_floor_bytes",
        )?;
        check(
            self.reserve_floor_bytes <= self.hard_floor_bytes,
            "limits.disk.reserve_floor_bytes",
            self.reserve_floor_bytes,
            "bytes no larger than limits.disk.hard_floor_bytes",
        )?;
        // Otherwise soft could never clear: free space cannot exceed the whole filesystem.
        check(
            self.soft_fraction + self.clear_margin_fraction < 1.0,
            "limits.disk.clear_margin_fraction",
            self.clear_margin_fraction,
            "a fraction below 1 - limits.disk.soft_fraction",
        )
    }
}

impl MemorySettings {
    /// Checks the `[limits.memory]` keys.
    pub fn validate(&self) -> Result<(), LimitsError> {
        check_fraction("limits.memory.soft_fraction", self.soft_fraction)?;
        check_fraction("limits.memory.hard_fraction", self.hard_fraction)?;
        check_fraction(
            "limits.memory.clear_margin_fraction",
            self.clear_margin_fraction,
        )?;
        check(
            self.soft_fraction <= self.hard_fraction,
            "limits.memory.soft_fraction",
            self.soft_fraction,
            "a fraction no larger than limits.memory.hard_fraction",
        )?;
        // Otherwise soft could never clear: resident memory cannot fall below zero.
        check(
            self.clear_margin_fraction < self.soft_fraction,
            "limits.memory.clear_margin_fraction",
            self.clear_margin_fraction,
            "a fraction below limits.memory.soft_fraction",
        )
    }
}

fn check_fraction(key: &'static str, value: f64) -> Result<(), LimitsError> {
    // `contains` is false for NaN, so NaN is rejected here too.
    check(
        (0.0..=1.0).contains(&value),
        key,
        value,
        "a fraction from 0.0 to 1.0",
    )
}

fn check(
    ok: bool,
    key: &'static str,
    value: impl ToString,
    expected: &'static str,
) -> Result<(), LimitsError> {
    if ok {
        Ok(())
    } else {
        Err(LimitsError::InvalidSetting {
            key,
            value: value.to_string(),
            expected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        LimitsSettings::default()
            .validate()
            .expect("defaults validate");
    }

    #[test]
    fn nan_fraction_is_rejected() {
        let mut settings = LimitsSettings::default();
        settings.memory.hard_fraction = f64::NAN;
        let error = settings.validate().expect_err("NaN rejected").to_string();
        assert!(
            error.contains("limits.memory.hard_fraction = NaN"),
            "{error}"
        );
    }
}
