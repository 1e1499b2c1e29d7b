//! Time to full on this node (`crate::time_to_full`): each file system's projection from its
//! recent free space, for the status, the metrics and the `disk_filling` attention item.

use std::collections::BTreeSet;

use crate::time_to_full::{
    duration_text, project, Projection, FILLING_CLEARED_BEYOND_MS, FILLING_WITHIN_MS,
};

use super::*;

impl NodeLimits {
    /// Where file system `device` is heading, if its free space has been falling.
    pub fn projection(&self, device: u64) -> Option<Projection> {
        let thresholds = lock(&self.monitor)
            .disks()
            .find(|d| d.device == DeviceId(device))?
            .thresholds;
        project(
            &self.history.points(device),
            now_ms(),
            thresholds.hard_bytes,
            thresholds.reserve_bytes.unwrap_or(0),
        )
    }

    /// Raise `disk_filling` for `fs` when hard is projected within the hour, clear it once the
    /// projection is beyond an hour and a quarter or gone.
    pub(super) fn check_filling(&self, fs: &Filesystem) {
        let projection = self.projection(fs.device);
        let subject = fs.path.display().to_string();
        let mut filling = lock(&self.filling);
        let raised = filling.contains(&fs.device);
        match projection {
            Some(p) if !raised && p.to_hard_ms < FILLING_WITHIN_MS => {
                let message = format!(
                    "{subject} is filling at {:.1} MB/s: the hard level (publishes refused) in \
                     about {}, reserve in {}{}; consume or purge the largest queues (or shorten \
                     the largest streams' retention), or free space on the file system",
                    p.fill_bytes_per_s / 1e6,
                    duration_text(p.to_hard_ms),
                    duration_text(p.to_reserve_ms),
                    self.top_queues_text(fs.device)
                );
                tracing::warn!("{message}");
                self.attention.raise(Raise {
                    kind: AttentionKind::DiskFilling,
                    subject,
                    severity: Severity::Warning,
                    level: None,
                    message,
                });
                filling.insert(fs.device);
            }
            Some(p) if raised && p.to_hard_ms <= FILLING_CLEARED_BEYOND_MS => {}
            _ if raised => {
                tracing::info!(path = %subject, "no longer filling towards the hard level");
                self.attention.clear(AttentionKind::DiskFilling, &subject);
                filling.remove(&fs.device);
            }
            _ => {}
        }
    }
}

/// The devices with an active `disk_filling` item.
pub(super) type Filling = Mutex<BTreeSet<u64>>;

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A node's limits on a temporary directory, sampled once (so its thresholds are known).
    fn limits() -> (tempfile::TempDir, NodeLimits) {
        let dir = tempfile::tempdir().expect("tempdir");
        let limits = NodeLimits::new(&[dir.path().to_path_buf()], LimitsSettings::default(), 0)
            .expect("limits");
        limits.sample();
        (dir, limits)
    }

    /// Two minutes of history ending 80 s ago, free space falling by `per_s` from hard +
    /// `above`. It starts before the sampler's real point (now), so the ring starts over (as
    /// after a clock step back) and holds these points only: a point of the real disk in the
    /// same ring made the fall steep (CI: 18.8 MB/s instead of 1 MiB/s).
    fn record_fall(limits: &NodeLimits, device: u64, above: u64, per_s: u64) {
        let hard = lock(&limits.monitor)
            .disks()
            .find(|d| d.device == DeviceId(device))
            .expect("sampled")
            .thresholds
            .hard_bytes;
        let start = now_ms() - 200_000;
        for i in 0..=60 {
            limits
                .history
                .record(device, start + i * 2_000, hard + above - per_s * i * 2);
        }
    }

    #[test]
    fn a_file_system_filling_within_the_hour_is_raised_then_cleared_when_flat() {
        let (_dir, limits) = limits();
        let fs = limits.filesystems()[0].clone();
        // 1 MiB/s with 600 MiB to go after two minutes: hard in 10 minutes.
        record_fall(&limits, fs.device, 720 * MIB, MIB);
        let projection = limits.projection(fs.device).expect("projected");
        assert!(
            (590_000..=610_000).contains(&projection.to_hard_ms),
            "{projection:?}"
        );
        limits.check_filling(&fs);
        let active: Vec<_> = limits
            .attention()
            .active()
            .into_iter()
            .filter(|i| i.kind == AttentionKind::DiskFilling)
            .collect();
        assert_eq!(active.len(), 1, "{active:?}");
        assert!(
            active[0].message.contains("hard level"),
            "{}",
            active[0].message
        );
        let status = limits.status("n1");
        assert!(
            status["filesystems"][0]["time_to_full"]["to_hard_ms"].as_u64() > Some(0),
            "{status}"
        );
        // Flat (a new stretch starting before the last one, so the ring starts over).
        let start = now_ms() - 250_000;
        for i in 0..=60 {
            limits
                .history
                .record(fs.device, start + i * 2_000, 10_000 * MIB);
        }
        assert_eq!(limits.projection(fs.device), None);
        limits.check_filling(&fs);
        assert!(!filling_raised(&limits));
        assert!(limits.status("n1")["filesystems"][0]["time_to_full"].is_null());
    }

    /// Whether a `disk_filling` item is active. Only that item is these tests': the real disk
    /// under the temporary directory may be at some level of its own (seen: 9.5 % free, soft
    /// by default).
    fn filling_raised(limits: &NodeLimits) -> bool {
        limits
            .attention()
            .active()
            .iter()
            .any(|i| i.kind == AttentionKind::DiskFilling)
    }

    #[test]
    fn a_slow_fill_raises_nothing() {
        let (_dir, limits) = limits();
        let fs = limits.filesystems()[0].clone();
        // 10 KiB/s with 600 MiB to go: hard in 17 hours.
        record_fall(&limits, fs.device, 600 * MIB, 10 * 1024);
        let projection = limits.projection(fs.device).expect("projected");
        assert!(projection.to_hard_ms > FILLING_WITHIN_MS, "{projection:?}");
        limits.check_filling(&fs);
        assert!(!filling_raised(&limits));
    }
}
