//! [`NodeReport`]: what a cluster node tells the others about its resources (its heartbeat
//! label, `docs/cluster.md`, "Cluster-wide limits"): per data file system and for memory the
//! level, the figures behind it and the thresholds, so that a partition's leader decides a
//! publish on every in-sync copy's resources with the same rule as on its own
//! ([`NodeReport::decide`]). Pure: the server builds reports from its [`crate::Monitor`], the
//! cluster layer carries them.

use serde::{Deserialize, Serialize};

use crate::admission::{Admission, Decision, LevelInput};
use crate::level::Level;

/// One data file system of a node, as it reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilesystemReport {
    /// The storage directory on it.
    pub path: String,
    /// Bytes free (`statvfs`), spares not included.
    pub free_bytes: u64,
    /// The file system's size (or the node's storage budget).
    pub total_bytes: u64,
    /// Bytes of spare segment files, free to the broker.
    pub spare_bytes: u64,
    /// Its level and where it stands between its thresholds.
    #[serde(flatten)]
    pub input: LevelInput,
    /// The queues using the most space on it, largest first (at most
    /// [`LARGEST_QUEUES_REPORTED`]), so that every node can show what fills a peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub largest_queues: Vec<QueueUsage>,
}

/// How many of a file system's largest queues a report names.
pub const LARGEST_QUEUES_REPORTED: usize = 3;

/// A queue's bytes on one file system.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueUsage {
    /// The queue.
    pub queue: String,
    /// Its partitions' bytes there (logs on disk).
    pub bytes: u64,
}

/// A node's memory, as it reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// Resident bytes.
    pub resident_bytes: u64,
    /// The memory limit.
    pub limit_bytes: u64,
    /// Its level and where it stands between its thresholds.
    #[serde(flatten)]
    pub input: LevelInput,
}

/// What a node reports about its resources at one sample.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeReport {
    /// Every data file system (none before the first sample).
    pub filesystems: Vec<FilesystemReport>,
    /// Memory (`None` before the first sample).
    pub memory: Option<MemoryReport>,
    /// When it was sampled, ms since the Unix epoch (the sender's clock).
    pub sampled_at_ms: u64,
}

/// Which of a node's resources a decision came from, for the message a client reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource<'a> {
    /// This file system.
    Disk(&'a FilesystemReport),
    /// Memory.
    Memory(&'a MemoryReport),
}

impl NodeReport {
    /// The deepest level among its file systems and memory.
    pub fn level(&self) -> Level {
        self.filesystems
            .iter()
            .map(|fs| fs.input.level)
            .chain(self.memory.iter().map(|m| m.input.level))
            .max()
            .unwrap_or(Level::Normal)
    }

    /// At soft or deeper somewhere: a publish with a copy on this node may be slowed or refused.
    pub fn limited(&self) -> bool {
        self.level() >= Level::Soft
    }

    /// A data file system at the reserve level, if any: the node then takes no new entries
    /// for the partitions it follows (it leaves their in-sync sets), so they are not limited
    /// by it either.
    pub fn at_reserve(&self) -> Option<&FilesystemReport> {
        self.filesystems
            .iter()
            .find(|fs| fs.input.level == Level::Reserve)
    }

    /// The decision for a batch of `batch_bytes` with a copy on this node, under `admission`.
    /// A node with several data file systems is judged by all of them: the report does not say
    /// which one holds a given partition, and one full file system on a node is worth knowing
    /// about early.
    pub fn decide(&self, admission: &Admission, batch_bytes: u64) -> Decision {
        admission.decide(
            self.filesystems.iter().map(|fs| fs.input),
            self.memory.as_ref().map(|m| m.input),
            batch_bytes,
        )
    }

    /// The resource behind a rejection for `reason`: the deepest one of that kind (the one
    /// with the least headroom among equals).
    pub fn culprit(&self, decision: &Decision) -> Option<Resource<'_>> {
        let Decision::Reject { reason, .. } = decision else {
            return self.slowest();
        };
        match reason {
            crate::Reason::Disk => self
                .filesystems
                .iter()
                .max_by_key(|fs| (fs.input.level, std::cmp::Reverse(fs.input.headroom_bytes)))
                .map(Resource::Disk),
            crate::Reason::Memory => self.memory.as_ref().map(Resource::Memory),
        }
    }

    fn slowest(&self) -> Option<Resource<'_>> {
        let disk = self
            .filesystems
            .iter()
            .filter(|fs| fs.input.level >= Level::Soft)
            .min_by_key(|fs| fs.input.headroom_bytes)
            .map(Resource::Disk);
        disk.or_else(|| {
            self.memory
                .as_ref()
                .filter(|m| m.input.level >= Level::Soft)
                .map(Resource::Memory)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::level::Thresholds;
    use crate::settings::LimitsSettings;
    use crate::Reason;

    const MIB: u64 = 1024 * 1024;

    fn thresholds() -> Thresholds {
        Thresholds {
            soft_bytes: 100 * MIB,
            hard_bytes: 50 * MIB,
            reserve_bytes: Some(10 * MIB),
            clear_margin_bytes: MIB,
        }
    }

    fn fs(path: &str, level: Level, headroom_mib: u64) -> FilesystemReport {
        FilesystemReport {
            path: path.to_string(),
            free_bytes: headroom_mib * MIB,
            total_bytes: 1024 * MIB,
            spare_bytes: 0,
            input: LevelInput {
                level,
                headroom_bytes: headroom_mib * MIB,
                thresholds: thresholds(),
            },
            largest_queues: Vec::new(),
        }
    }

    fn admission() -> Admission {
        Admission::new(&LimitsSettings::default())
    }

    #[test]
    fn a_report_survives_its_json_form() {
        let report = NodeReport {
            filesystems: vec![fs("/data", Level::Soft, 75)],
            memory: Some(MemoryReport {
                resident_bytes: 100 * MIB,
                limit_bytes: 512 * MIB,
                input: LevelInput {
                    level: Level::Normal,
                    headroom_bytes: 412 * MIB,
                    thresholds: Thresholds {
                        reserve_bytes: None,
                        ..thresholds()
                    },
                },
            }),
            sampled_at_ms: 1_700_000_000_000,
        };
        let json = serde_json::to_string(&report).expect("encode");
        assert!(json.contains("\"level\":\"soft\""), "{json}");
        assert_eq!(
            serde_json::from_str::<NodeReport>(&json).expect("decode"),
            report
        );
    }

    #[test]
    fn a_node_is_decided_like_the_local_one() {
        let admission = admission();
        let normal = NodeReport {
            filesystems: vec![fs("/a", Level::Normal, 500)],
            ..NodeReport::default()
        };
        assert_eq!(normal.decide(&admission, 1024), Decision::Admit);
        assert!(!normal.limited());
        let soft = NodeReport {
            filesystems: vec![fs("/a", Level::Normal, 500), fs("/b", Level::Soft, 75)],
            ..NodeReport::default()
        };
        assert!(soft.limited());
        match soft.decide(&admission, 1024) {
            Decision::Slow { delay_ms } => assert!(delay_ms > 0),
            other => panic!("a soft file system slows: {other:?}"),
        }
        let hard = NodeReport {
            filesystems: vec![fs("/a", Level::Soft, 75), fs("/b", Level::Hard, 40)],
            ..NodeReport::default()
        };
        let decision = hard.decide(&admission, 1024);
        assert!(matches!(
            decision,
            Decision::Reject {
                reason: Reason::Disk,
                level: Level::Hard,
                ..
            }
        ));
        match hard.culprit(&decision) {
            Some(Resource::Disk(fs)) => assert_eq!(fs.path, "/b"),
            other => panic!("the hard file system is named: {other:?}"),
        }
    }

    #[test]
    fn the_stricter_decision_wins() {
        let reject = |reason, level, retry_after_ms| Decision::Reject {
            reason,
            level,
            retry_after_ms,
        };
        let slow = |delay_ms| Decision::Slow { delay_ms };
        assert_eq!(Decision::Admit.stricter(Decision::Admit), Decision::Admit);
        assert_eq!(Decision::Admit.stricter(slow(5)), slow(5));
        assert_eq!(slow(9).stricter(slow(5)), slow(9));
        assert_eq!(
            slow(9).stricter(reject(Reason::Memory, Level::Hard, 100)),
            reject(Reason::Memory, Level::Hard, 100)
        );
        assert_eq!(
            reject(Reason::Memory, Level::Hard, 400).stricter(reject(
                Reason::Disk,
                Level::Hard,
                200
            )),
            reject(Reason::Disk, Level::Hard, 400)
        );
    }
}
