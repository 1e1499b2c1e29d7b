//! `LimitsError`: everything in this crate that can fail — a bad setting, a failed `statvfs`, a
//! proc or cgroup file that cannot be read or parsed. The decisions themselves never fail.

use std::path::PathBuf;

/// An error from validating limits settings or from reading the system's resource signals.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// A setting is out of range. `key` is the full TOML key (`limits.disk.soft_fraction`).
    #[error("invalid setting {key} = {value}: expected {expected}")]
    InvalidSetting {
        /// The full dotted TOML key.
        key: &'static str,
        /// The rejected value, as written.
        value: String,
        /// What the key accepts.
        expected: &'static str,
    },
    /// `statvfs` or `stat` failed on a storage path.
    #[error(
        "cannot sample filesystem of {path}: {source}; check that the storage directory exists"
    )]
    Filesystem {
        /// The storage path that was sampled.
        path: PathBuf,
        /// The error from the kernel.
        source: std::io::Error,
    },
    /// A proc or cgroup file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file that failed.
        path: PathBuf,
        /// The error from the kernel.
        source: std::io::Error,
    },
    /// A proc or cgroup file had content this crate does not understand.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// The file that failed.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
}
