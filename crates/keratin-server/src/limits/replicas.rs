//! A cluster node's limits beyond itself (`docs/cluster.md`, "Cluster-wide limits"): the
//! report this node tells the others after every sample ([`NodeLimits::node_report`]), and the
//! publish decision of a partition this node leads from its own levels and those its in-sync
//! replicas' nodes reported ([`NodeLimits::decide_replicated`]). A partition with no copy on a
//! limited node is never asked about it: only the leader's in-sync replicas count, and a node
//! at its reserve level not even then (it refuses new entries, so it is leaving the in-sync
//! sets; the others confirm without it).

use keratin_limits::{
    FilesystemReport, MemoryReport, NodeReport, QueueUsage, Resource, LARGEST_QUEUES_REPORTED,
};

use super::*;

/// A node's report names its largest queues as counted at most this long ago.
const LARGEST_QUEUES_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// How strict a decision is, for picking the one that limits a publish: a rejection (for disk
/// before memory, the deeper level first) over a delay (the longer first) over an admission.
fn strictness(decision: &Decision) -> (u8, u8, Level, u64) {
    match decision {
        Decision::Admit => (0, 0, Level::Normal, 0),
        Decision::Slow { delay_ms } => (1, 0, Level::Normal, *delay_ms),
        Decision::Reject { reason, level, .. } => (2, u8::from(*reason == Reason::Disk), *level, 0),
    }
}

impl NodeLimits {
    /// Judge the publishes of the partitions this node leads by the levels their replicas'
    /// nodes report too (a cluster node).
    pub fn attach_cluster(&self, levels: ClusterLevels) {
        let _ = self.cluster_levels.set(levels);
    }

    /// Every node's reported levels, on a cluster node.
    pub fn cluster_levels(&self) -> Option<&ClusterLevels> {
        self.cluster_levels.get()
    }

    /// Changes after every sample round of [`NodeLimits::run_sampler`].
    pub fn samples(&self) -> watch::Receiver<u64> {
        self.sampled.subscribe()
    }

    /// This node's resources at the last sample, as it reports them to the other nodes.
    pub fn node_report(&self) -> NodeReport {
        let mut largest = self.largest_queues();
        let monitor = lock(&self.monitor);
        let filesystems = self
            .filesystems
            .iter()
            .zip(largest.iter_mut())
            .filter_map(|(fs, largest)| {
                let status = monitor.disks().find(|d| d.device == DeviceId(fs.device))?;
                Some(FilesystemReport {
                    path: fs.path.display().to_string(),
                    free_bytes: status.sample.free_bytes,
                    total_bytes: status.sample.total_bytes,
                    spare_bytes: status.sample.spare_bytes,
                    input: monitor.disk_input(DeviceId(fs.device))?,
                    largest_queues: std::mem::take(largest),
                })
            })
            .collect();
        let memory = monitor.memory().and_then(|status| {
            Some(MemoryReport {
                resident_bytes: status.sample.resident_bytes,
                limit_bytes: status.sample.limit_bytes,
                input: monitor.memory_input()?,
            })
        });
        NodeReport {
            filesystems,
            memory,
            sampled_at_ms: now_ms(),
        }
    }

    /// Each file system's largest queues, counted again once the last count is
    /// [`LARGEST_QUEUES_EVERY`] old (listing every queue costs; a report goes out every sample).
    fn largest_queues(&self) -> Vec<Vec<QueueUsage>> {
        let mut cached = lock(&self.largest_queues);
        if let Some((at, largest)) = cached.as_ref() {
            if at.elapsed() < LARGEST_QUEUES_EVERY {
                return largest.clone();
            }
        }
        // Not under the monitor's lock: the queues' figures come from the broker.
        let largest: Vec<Vec<QueueUsage>> = self
            .filesystems
            .iter()
            .map(|fs| {
                self.top_queues(fs.device, LARGEST_QUEUES_REPORTED)
                    .into_iter()
                    .map(|(name, stream, bytes)| QueueUsage {
                        queue: if stream {
                            format!("{name} (stream)")
                        } else {
                            name
                        },
                        bytes,
                    })
                    .collect()
            })
            .collect();
        *cached = Some((std::time::Instant::now(), largest.clone()));
        largest
    }

    /// The decision for a batch of `batch_bytes` on a partition on `device` here with in-sync
    /// copies on `replicas`: the strictest of this node's and each replica's (as its node last
    /// reported), explained with the node and file system that limit it.
    pub(super) fn decide_replicated(
        &self,
        device: u64,
        batch_bytes: u64,
        replicas: &[u64],
    ) -> GateDecision {
        let (local, admission) = {
            let monitor = lock(&self.monitor);
            (
                monitor.decide(&[DeviceId(device)], batch_bytes),
                monitor.admission(),
            )
        };
        let Some(levels) = self.cluster_levels.get() else {
            return self.answer(device, local);
        };
        let mut strictest: Option<(u64, NodeReport, Decision)> = None;
        for &node in replicas {
            let Some(heard) = levels.get(node) else {
                continue;
            };
            // At reserve it refuses new entries: it is leaving the in-sync set (as after a
            // fault) and holds nothing back; the others confirm without it.
            if heard.report.at_reserve().is_some() {
                continue;
            }
            let decision = heard.report.decide(&admission, batch_bytes);
            let stricter = match &strictest {
                None => strictness(&decision) > strictness(&local),
                Some((_, _, so_far)) => strictness(&decision) > strictness(so_far),
            };
            if stricter {
                strictest = Some((node, heard.report, decision));
            }
        }
        match strictest {
            None => self.answer(device, local),
            Some((node, report, decision)) => self.answer_for_replica(node, &report, decision),
        }
    }

    /// The gate's answer when node `node`'s copy limits the publish: counted like this node's
    /// own, and explained with that node and its file system.
    fn answer_for_replica(
        &self,
        node: u64,
        report: &NodeReport,
        decision: Decision,
    ) -> GateDecision {
        match decision {
            Decision::Admit => GateDecision::Admit,
            Decision::Slow { delay_ms } => {
                let memory = matches!(report.culprit(&decision), Some(Resource::Memory(_)));
                self.counters.delayed(memory);
                self.counters
                    .delayed_for_replica
                    .fetch_add(1, Ordering::Relaxed);
                GateDecision::Slow { delay_ms }
            }
            Decision::Reject {
                reason,
                level,
                retry_after_ms,
            } => {
                self.counters.rejected(reason);
                self.counters
                    .rejected_for_replica
                    .fetch_add(1, Ordering::Relaxed);
                let message = match report.culprit(&decision) {
                    Some(Resource::Disk(fs)) => format!(
                        "disk at {level} level on node {node}, {} ({} MiB free, hard level at {} \
                         MiB), which holds an in-sync copy of this partition; publishing resumes \
                         once space is freed there; retry after {retry_after_ms} ms",
                        fs.path,
                        mib(fs.free_bytes.saturating_add(fs.spare_bytes)),
                        mib(fs.input.thresholds.hard_bytes)
                    ),
                    Some(Resource::Memory(memory)) => format!(
                        "memory at {level} level on node {node} ({} MiB resident of a {} MiB \
                         limit), which holds an in-sync copy of this partition; publishing \
                         resumes once its memory falls; retry after {retry_after_ms} ms",
                        mib(memory.resident_bytes),
                        mib(memory.limit_bytes)
                    ),
                    None => format!(
                        "{reason} at {level} level on node {node}, which holds an in-sync copy \
                         of this partition; retry after {retry_after_ms} ms",
                        reason = reason.as_str()
                    ),
                };
                GateDecision::Reject {
                    reason: reason.as_str().to_string(),
                    retry_after_ms: u32::try_from(retry_after_ms).unwrap_or(u32::MAX),
                    message,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use keratin_limits::{LevelInput, Thresholds};

    use super::*;

    const MIB: u64 = 1 << 20;

    fn report(level: Level, headroom_mib: u64) -> NodeReport {
        NodeReport {
            filesystems: vec![FilesystemReport {
                path: "/peer/data".to_string(),
                free_bytes: headroom_mib * MIB,
                total_bytes: 1024 * MIB,
                spare_bytes: 0,
                input: LevelInput {
                    level,
                    headroom_bytes: headroom_mib * MIB,
                    thresholds: Thresholds {
                        soft_bytes: 200 * MIB,
                        hard_bytes: 100 * MIB,
                        reserve_bytes: Some(20 * MIB),
                        clear_margin_bytes: MIB,
                    },
                },
                largest_queues: Vec::new(),
            }],
            memory: None,
            sampled_at_ms: 1,
        }
    }

    /// A gate over a temporary directory (the host's disk, far from any level), with peers 2
    /// to 5 reporting normal, soft, hard and reserve.
    fn gate() -> (tempfile::TempDir, NodeLimits, u64) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut settings = LimitsSettings::default();
        settings.disk.soft_fraction = 0.0;
        settings.disk.hard_fraction = 0.0;
        settings.disk.reserve_fraction = 0.0;
        settings.disk.soft_floor_bytes = 0;
        settings.disk.hard_floor_bytes = 0;
        settings.disk.reserve_floor_bytes = 0;
        let limits = NodeLimits::new(&[dir.path().to_path_buf()], settings, 0).expect("limits");
        limits.sample();
        let device = limits.filesystems()[0].device;
        let levels = ClusterLevels::new(1);
        limits.attach_cluster(levels.clone());
        assert!(!limits.replicas_limited(), "no peer heard yet");
        levels.insert(2, report(Level::Normal, 500));
        assert!(!limits.replicas_limited());
        levels.insert(3, report(Level::Soft, 150));
        levels.insert(4, report(Level::Hard, 50));
        levels.insert(5, report(Level::Reserve, 10));
        assert!(limits.replicas_limited());
        (dir, limits, device)
    }

    #[test]
    fn the_strictest_in_sync_replica_decides() {
        let (_dir, limits, device) = gate();
        assert_eq!(
            limits.publish_replicated(device, 1024, &[]),
            GateDecision::Admit
        );
        assert_eq!(
            limits.publish_replicated(device, 1024, &[2]),
            GateDecision::Admit
        );
        match limits.publish_replicated(device, 1024, &[2, 3]) {
            GateDecision::Slow { delay_ms } => assert!(delay_ms > 0),
            other => panic!("a replica at soft slows: {other:?}"),
        }
        match limits.publish_replicated(device, 1024, &[3, 4]) {
            GateDecision::Reject {
                reason, message, ..
            } => {
                assert_eq!(reason, "disk");
                assert!(
                    message.contains("node 4") && message.contains("/peer/data"),
                    "{message}"
                );
            }
            other => panic!("a replica at hard refuses: {other:?}"),
        }
        assert_eq!(
            limits.publish_replicated(device, 1024, &[2, 5]),
            GateDecision::Admit,
            "a replica at reserve takes no entries: it does not hold the partition back"
        );
        assert_eq!(
            limits.publish_replicated(device, 1024, &[9]),
            GateDecision::Admit,
            "a node never heard from does not limit"
        );
        assert_eq!(
            limits.counters.rejected_for_replica.load(Ordering::Relaxed),
            1
        );
        assert_eq!(
            limits.counters.delayed_for_replica.load(Ordering::Relaxed),
            1
        );
    }

    #[test]
    fn the_report_tells_this_node_s_file_systems() {
        let (dir, limits, _device) = gate();
        let report = limits.node_report();
        assert_eq!(report.filesystems.len(), 1);
        let fs = &report.filesystems[0];
        let canonical = std::fs::canonicalize(dir.path()).expect("canonical");
        assert_eq!(fs.path, canonical.display().to_string());
        assert_eq!(fs.input.level, Level::Normal);
        assert!(fs.total_bytes > 0 && fs.free_bytes > 0);
        assert!(report.memory.is_some(), "memory was sampled");
    }
}
