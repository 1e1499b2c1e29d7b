//! [`ClusterLevels`]: every node's resource report as this node last heard it. A node's report
//! ([`NodeReport`]) travels as its node label on the cluster transport (`keratin-net`'s `Label`
//! frame): pushed to every peer when a sample changes it, after each handshake, and with every
//! ping. The partition leader's publish gate reads the reports of a partition's in-sync
//! replicas from here (`docs/cluster.md`, "Cluster-wide limits"), and status shows them.
//!
//! The label is JSON: `{"levels": NodeReport}` (`docs/cluster-protocol.md`, "Node label"). A
//! label that does not decode is logged and ignored: the node's previous report stays, as if
//! the label had been lost.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use keratin_limits::NodeReport;
use serde::{Deserialize, Serialize};

/// A node label: what a node tells every peer about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLabel {
    /// Its resources at its last sample.
    pub levels: NodeReport,
}

impl NodeLabel {
    /// The label's bytes.
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("a node label always encodes"))
    }

    /// A label from its bytes.
    pub fn decode(bytes: &[u8]) -> Result<NodeLabel, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A node's report and when it arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeardReport {
    /// The report.
    pub report: NodeReport,
    /// How long ago it arrived (0 for this node's own).
    pub age: Duration,
}

#[derive(Debug)]
struct Heard {
    report: NodeReport,
    at: Instant,
}

/// See the module docs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ClusterLevels {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    own_id: u64,
    reports: RwLock<BTreeMap<u64, Heard>>,
    /// Some peer's last report is at soft or deeper: the gate looks at replicas only then.
    peer_limited: AtomicBool,
}

impl ClusterLevels {
    /// No report yet; `own_id` is this node's id.
    pub fn new(own_id: u64) -> ClusterLevels {
        ClusterLevels {
            inner: Arc::new(Inner {
                own_id,
                reports: RwLock::new(BTreeMap::new()),
                peer_limited: AtomicBool::new(false),
            }),
        }
    }

    /// This node's id.
    pub fn own_id(&self) -> u64 {
        self.inner.own_id
    }

    /// Node `from` sent `label`.
    pub fn heard(&self, from: u64, label: &[u8]) {
        match NodeLabel::decode(label) {
            Ok(label) => self.insert(from, label.levels),
            Err(error) => {
                tracing::warn!(node = from, %error, "a node label did not decode; ignored");
            }
        }
    }

    /// Record `report` as node `id`'s (this node's own too).
    pub fn insert(&self, id: u64, report: NodeReport) {
        let mut reports = self
            .inner
            .reports
            .write()
            .unwrap_or_else(|e| e.into_inner());
        reports.insert(
            id,
            Heard {
                report,
                at: Instant::now(),
            },
        );
        let limited = reports
            .iter()
            .any(|(node, heard)| *node != self.inner.own_id && heard.report.limited());
        self.inner.peer_limited.store(limited, Ordering::Release);
    }

    /// Forget node `id` (removed from the cluster).
    pub fn forget(&self, id: u64) {
        let mut reports = self
            .inner
            .reports
            .write()
            .unwrap_or_else(|e| e.into_inner());
        reports.remove(&id);
        let limited = reports
            .iter()
            .any(|(node, heard)| *node != self.inner.own_id && heard.report.limited());
        self.inner.peer_limited.store(limited, Ordering::Release);
    }

    /// Whether some other node's last report is at soft or deeper (one atomic load).
    pub fn peer_limited(&self) -> bool {
        self.inner.peer_limited.load(Ordering::Acquire)
    }

    /// Node `id`'s last report.
    pub fn get(&self, id: u64) -> Option<HeardReport> {
        let reports = self.inner.reports.read().unwrap_or_else(|e| e.into_inner());
        reports.get(&id).map(|heard| self.heard_report(id, heard))
    }

    /// Every node's last report, by id.
    pub fn all(&self) -> BTreeMap<u64, HeardReport> {
        let reports = self.inner.reports.read().unwrap_or_else(|e| e.into_inner());
        reports
            .iter()
            .map(|(id, heard)| (*id, self.heard_report(*id, heard)))
            .collect()
    }

    fn heard_report(&self, id: u64, heard: &Heard) -> HeardReport {
        HeardReport {
            report: heard.report.clone(),
            age: if id == self.inner.own_id {
                Duration::ZERO
            } else {
                heard.at.elapsed()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use keratin_limits::{FilesystemReport, Level, LevelInput, Thresholds};

    use super::*;

    fn report(level: Level) -> NodeReport {
        NodeReport {
            filesystems: vec![FilesystemReport {
                path: "/data".to_string(),
                free_bytes: 1 << 30,
                total_bytes: 10 << 30,
                spare_bytes: 0,
                input: LevelInput {
                    level,
                    headroom_bytes: 1 << 30,
                    thresholds: Thresholds {
                        soft_bytes: 2 << 30,
                        hard_bytes: 1 << 30,
                        reserve_bytes: Some(1 << 29),
                        clear_margin_bytes: 1 << 20,
                    },
                },
                largest_queues: Vec::new(),
            }],
            memory: None,
            sampled_at_ms: 1,
        }
    }

    #[test]
    fn only_a_limited_peer_turns_the_flag_on() {
        let levels = ClusterLevels::new(1);
        levels.insert(1, report(Level::Hard));
        assert!(
            !levels.peer_limited(),
            "this node's own level is the local gate's"
        );
        let label = NodeLabel {
            levels: report(Level::Soft),
        };
        levels.heard(2, &label.encode());
        assert!(levels.peer_limited());
        assert_eq!(levels.get(2).expect("heard").report.level(), Level::Soft);
        levels.heard(2, b"not json");
        assert_eq!(
            levels.get(2).expect("kept").report.level(),
            Level::Soft,
            "a bad label leaves the last report"
        );
        levels.insert(2, report(Level::Normal));
        assert!(!levels.peer_limited());
        levels.insert(3, report(Level::Reserve));
        levels.forget(3);
        assert!(!levels.peer_limited());
    }
}
