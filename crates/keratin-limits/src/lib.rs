//! Keratin's resource limits: disk and memory signals, levels with hysteresis, and the pure
//! admission decision for publishes. No threads, no clocks, no I/O outside the samplers: the
//! server samples on its timer, feeds the [`Monitor`], and asks it before applying a publish.
//!
//! # Layout
//! - [`settings`]: `LimitsSettings`, the `[limits]` TOML section, its defaults and validation.
//! - [`level`]: `Level::{Normal, Soft, Hard, Reserve}` and the hysteresis rule (`Thresholds`).
//! - [`disk`]: `statvfs` sampling, the storage budget, disk thresholds, `DiskLevels`.
//! - [`memory`]: resident memory from `statm`, memory thresholds, `MemoryLevels`.
//! - [`memory_limit`]: the memory limit from cgroups v1/v2, configuration or physical memory.
//! - [`claims`]: `MemoryClaims`, memory a connection, frame or consumer claims before it takes
//!   it, granted only if it would not take memory past hard.
//! - [`admission`]: `Admission::decide` (admit, slow, reject with a retry hint) and
//!   `OperationClass` (what each level allows).
//! - [`monitor`]: `Monitor`, the per-node state: levels per device and memory, level changes.
//! - [`report`]: `NodeReport`, what a cluster node tells the others about its resources, and
//!   the decision for a copy on that node.
//! - [`error`]: the crate's error, `LimitsError`.
#![deny(missing_docs)]

pub mod admission;
pub mod claims;
pub mod disk;
pub mod error;
pub mod level;
pub mod memory;
pub mod memory_limit;
pub mod monitor;
pub mod report;
pub mod settings;

pub use admission::{Admission, Decision, LevelInput, OperationClass, Reason};
pub use claims::{ClaimRefused, MemoryClaim, MemoryClaims};
pub use disk::{sample_filesystem, DeviceId, DiskLevels, DiskSample, FilesystemSample};
pub use error::LimitsError;
pub use level::{Level, Thresholds};
pub use memory::{read_resident_bytes, MemoryLevels, MemorySample};
pub use memory_limit::{discover_limit, LimitSource, MemoryLimit, SystemRoots};
pub use monitor::{DiskStatus, LevelChange, MemoryStatus, Monitor};
pub use report::{
    FilesystemReport, MemoryReport, NodeReport, QueueUsage, Resource, LARGEST_QUEUES_REPORTED,
};
pub use settings::{DiskSettings, LimitsSettings, MemorySettings};
