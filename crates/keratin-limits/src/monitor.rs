//! `Monitor`: the node's limits state — one `DiskLevels` per filesystem device and one
//! `MemoryLevels` — fed samples by the caller, answering admission questions and reporting level
//! changes. It has no threads and no clock: the caller samples on its timer (and after each
//! segment roll) and passes `now_ms`. Logging the changes, raising attention items and exporting
//! metrics belong to the server.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::admission::{Admission, Decision, LevelInput, OperationClass};
use crate::disk::{DeviceId, DiskLevels, DiskSample};
use crate::level::{Level, Thresholds};
use crate::memory::{MemoryLevels, MemorySample};
use crate::memory_limit::LimitSource;
use crate::settings::LimitsSettings;
use crate::LimitsError;

/// A level change, for the log and an attention item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "resource", rename_all = "lowercase")]
pub enum LevelChange {
    /// A filesystem changed level.
    Disk {
        /// The filesystem.
        device: DeviceId,
        /// The level before the sample.
        from: Level,
        /// The level after it.
        to: Level,
        /// Effective free bytes (spares included) in the sample.
        free_bytes: u64,
        /// The filesystem's total (or the budget) in the sample.
        total_bytes: u64,
        /// When the sample was taken.
        at_ms: u64,
    },
    /// Memory changed level.
    Memory {
        /// The level before the sample.
        from: Level,
        /// The level after it.
        to: Level,
        /// Resident bytes in the sample.
        resident_bytes: u64,
        /// The limit in the sample.
        limit_bytes: u64,
        /// When the sample was taken.
        at_ms: u64,
    },
}

impl LevelChange {
    /// The level before the change.
    pub fn from(&self) -> Level {
        match self {
            LevelChange::Disk { from, .. } | LevelChange::Memory { from, .. } => *from,
        }
    }

    /// The level after the change.
    pub fn to(&self) -> Level {
        match self {
            LevelChange::Disk { to, .. } | LevelChange::Memory { to, .. } => *to,
        }
    }
}

impl std::fmt::Display for LevelChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LevelChange::Disk {
                device,
                from,
                to,
                free_bytes,
                total_bytes,
                ..
            } => write!(
                f,
                "disk on device {device} went from {from} to {to} level \
                 ({free_bytes} of {total_bytes} bytes free)"
            ),
            LevelChange::Memory {
                from,
                to,
                resident_bytes,
                limit_bytes,
                ..
            } => write!(
                f,
                "memory went from {from} to {to} level \
                 ({resident_bytes} bytes resident, limit {limit_bytes} bytes)"
            ),
        }
    }
}

/// One filesystem as the status output shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiskStatus {
    /// The filesystem.
    pub device: DeviceId,
    /// Its level.
    pub level: Level,
    /// The last sample (total, free, spare bytes).
    pub sample: DiskSample,
    /// The thresholds of the last sample, as free bytes.
    pub thresholds: Thresholds,
    /// When the last sample was taken; a stale value means the sampler is stuck.
    pub sampled_at_ms: u64,
}

/// Memory as the status output shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryStatus {
    /// Its level.
    pub level: Level,
    /// The last sample (resident and limit bytes).
    pub sample: MemorySample,
    /// Where the limit came from.
    pub limit_source: LimitSource,
    /// When the last sample was taken.
    pub sampled_at_ms: u64,
}

#[derive(Debug, Clone)]
struct DiskState {
    levels: DiskLevels,
    sampled_at_ms: u64,
}

#[derive(Debug, Clone)]
struct MemoryState {
    levels: MemoryLevels,
    limit_source: LimitSource,
    sampled_at_ms: u64,
}

/// The node's limits state. See the module docs.
#[derive(Debug, Clone)]
pub struct Monitor {
    settings: LimitsSettings,
    admission: Admission,
    disks: BTreeMap<DeviceId, DiskState>,
    memory: Option<MemoryState>,
}

impl Monitor {
    /// A monitor with no samples yet; `settings` are validated first.
    pub fn new(settings: LimitsSettings) -> Result<Monitor, LimitsError> {
        settings.validate()?;
        let admission = Admission::new(&settings);
        Ok(Monitor {
            settings,
            admission,
            disks: BTreeMap::new(),
            memory: None,
        })
    }

    /// Applies new settings (a live change). Levels keep their state; thresholds apply from the
    /// next sample of each resource, the delay and retry rule at once.
    pub fn set_settings(&mut self, settings: LimitsSettings) -> Result<(), LimitsError> {
        settings.validate()?;
        for state in self.disks.values_mut() {
            state.levels.set_settings(settings.disk.clone());
        }
        if let Some(state) = &mut self.memory {
            state.levels.set_settings(settings.memory.clone());
        }
        self.admission = Admission::new(&settings);
        self.settings = settings;
        Ok(())
    }

    /// The settings in force.
    pub fn settings(&self) -> &LimitsSettings {
        &self.settings
    }

    /// Feeds a sample of `device`. The first sample of a device reports a change from `Normal`
    /// when it starts past a threshold, so starting on a full disk is logged.
    pub fn observe_disk(
        &mut self,
        device: DeviceId,
        sample: DiskSample,
        now_ms: u64,
    ) -> Option<LevelChange> {
        let (from, to) = match self.disks.get_mut(&device) {
            Some(state) => {
                state.sampled_at_ms = now_ms;
                (state.levels.level(), state.levels.observe(sample))
            }
            None => {
                let levels = DiskLevels::new(self.settings.disk.clone(), sample);
                let to = levels.level();
                self.disks.insert(
                    device,
                    DiskState {
                        levels,
                        sampled_at_ms: now_ms,
                    },
                );
                (Level::Normal, to)
            }
        };
        (from != to).then(|| LevelChange::Disk {
            device,
            from,
            to,
            free_bytes: sample.effective_free_bytes(),
            total_bytes: sample.total_bytes,
            at_ms: now_ms,
        })
    }

    /// Feeds a memory sample, with the source of its limit for the status output.
    pub fn observe_memory(
        &mut self,
        sample: MemorySample,
        limit_source: LimitSource,
        now_ms: u64,
    ) -> Option<LevelChange> {
        let (from, to) = match &mut self.memory {
            Some(state) => {
                state.limit_source = limit_source;
                state.sampled_at_ms = now_ms;
                (state.levels.level(), state.levels.observe(sample))
            }
            None => {
                let levels = MemoryLevels::new(self.settings.memory.clone(), sample);
                let to = levels.level();
                self.memory = Some(MemoryState {
                    levels,
                    limit_source,
                    sampled_at_ms: now_ms,
                });
                (Level::Normal, to)
            }
        };
        (from != to).then_some(LevelChange::Memory {
            from,
            to,
            resident_bytes: sample.resident_bytes,
            limit_bytes: sample.limit_bytes,
            at_ms: now_ms,
        })
    }

    /// Stops tracking a device that no longer holds storage.
    pub fn forget_disk(&mut self, device: DeviceId) {
        self.disks.remove(&device);
    }

    /// Decides a publish batch on a partition stored on `devices`. A device never sampled
    /// contributes nothing, so sample every storage filesystem before serving.
    pub fn decide(&self, devices: &[DeviceId], batch_bytes: u64) -> Decision {
        let disks = self.disk_states(devices).map(|state| state.levels.input());
        let memory = self.memory.as_ref().map(|state| state.levels.input());
        self.admission.decide(disks, memory, batch_bytes)
    }

    /// Whether `class` may proceed on a partition stored on `devices`, given the deepest level
    /// among those filesystems and memory.
    pub fn allows(&self, class: OperationClass, devices: &[DeviceId]) -> bool {
        class.allowed_at(self.level(devices))
    }

    /// The deepest level among `devices` and memory.
    pub fn level(&self, devices: &[DeviceId]) -> Level {
        let memory = self
            .memory
            .as_ref()
            .map_or(Level::Normal, |state| state.levels.level());
        self.disk_states(devices)
            .map(|state| state.levels.level())
            .fold(memory, Level::max)
    }

    /// The admission rule in force.
    pub fn admission(&self) -> Admission {
        self.admission
    }

    /// One filesystem's level and position, as the admission decision sees it; `None` if it
    /// was never sampled.
    pub fn disk_input(&self, device: DeviceId) -> Option<LevelInput> {
        self.disks.get(&device).map(|state| state.levels.input())
    }

    /// Memory's level and position, `None` before the first memory sample.
    pub fn memory_input(&self) -> Option<LevelInput> {
        self.memory.as_ref().map(|state| state.levels.input())
    }

    /// The level of one filesystem, `None` if it was never sampled.
    pub fn disk_level(&self, device: DeviceId) -> Option<Level> {
        self.disks.get(&device).map(|state| state.levels.level())
    }

    /// The memory level, `None` before the first memory sample.
    pub fn memory_level(&self) -> Option<Level> {
        self.memory.as_ref().map(|state| state.levels.level())
    }

    /// Every filesystem, ordered by device, for the status output.
    pub fn disks(&self) -> impl Iterator<Item = DiskStatus> + '_ {
        self.disks.iter().map(|(device, state)| DiskStatus {
            device: *device,
            level: state.levels.level(),
            sample: state.levels.sample(),
            thresholds: state.levels.thresholds(),
            sampled_at_ms: state.sampled_at_ms,
        })
    }

    /// Memory, for the status output; `None` before the first memory sample.
    pub fn memory(&self) -> Option<MemoryStatus> {
        self.memory.as_ref().map(|state| MemoryStatus {
            level: state.levels.level(),
            sample: state.levels.sample(),
            limit_source: state.limit_source.clone(),
            sampled_at_ms: state.sampled_at_ms,
        })
    }

    fn disk_states<'a>(&'a self, devices: &'a [DeviceId]) -> impl Iterator<Item = &'a DiskState> {
        devices.iter().filter_map(|device| self.disks.get(device))
    }
}
