//! `/metrics`: the node's figures in the Prometheus text format. A fresh registry is filled from
//! the current state at each scrape (one registry per node, nothing static, so several nodes in
//! one process stay apart).

use std::sync::atomic::Ordering;

use keratin_broker::Broker;
use keratin_log::{SyncHistogramSnapshot, SYNC_BUCKET_COUNT};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::limits::{LimitsSnapshot, NodeLimits};

mod streams;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FsLabels {
    path: String,
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeResourceLabels {
    node: String,
    resource: String,
    path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    device: String,
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueReasonLabels {
    queue: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabels {
    queue: String,
    partition: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    queue: String,
    partition: String,
    replica: String,
}

fn gauge_family<L>(registry: &mut Registry, name: &str, help: &str) -> Family<L, Gauge>
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Gauge>::default();
    registry.register(name, help, family.clone());
    family
}

fn gauge(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let g = Gauge::<i64>::default();
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
    registry.register(name, help, g);
}

fn set(g: &Gauge, value: u64) {
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
}

/// The commit threads' sync latencies, already counted by the log's fixed buckets: encoded as
/// a Prometheus histogram without observing anything again.
#[derive(Debug)]
struct SyncLatency(SyncHistogramSnapshot);

impl EncodeMetric for SyncLatency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // Non-cumulative counts per bound; the encoder sums them and writes `f64::MAX` as +Inf.
        let buckets: Vec<(f64, u64)> = (0..=SYNC_BUCKET_COUNT)
            .map(|index| {
                let bound = if index < SYNC_BUCKET_COUNT {
                    SyncHistogramSnapshot::bound_micros(index) as f64 / 1e6
                } else {
                    f64::MAX
                };
                (bound, self.0.counts[index])
            })
            .collect();
        encoder.encode_histogram::<NoLabelSet>(
            self.0.sum_nanos as f64 / 1e9,
            self.0.count(),
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The metrics text of a node.
pub fn render(broker: &Broker, limits: &NodeLimits, access: &crate::access::Access) -> String {
    let mut registry = Registry::with_prefix("keratin");
    register_access(&mut registry, access);
    let snapshot = limits.snapshot();
    let level = gauge_family::<FsLabels>(
        &mut registry,
        "disk_level",
        "Disk level per file system: 0 normal, 1 soft, 2 hard, 3 reserve",
    );
    let free = gauge_family::<FsLabels>(&mut registry, "disk_free_bytes", "Free bytes (statvfs)");
    let total = gauge_family::<FsLabels>(&mut registry, "disk_total_bytes", "Total bytes");
    let spare = gauge_family::<FsLabels>(
        &mut registry,
        "disk_spare_bytes",
        "Bytes in spare segment files (free on demand)",
    );
    for fs in &snapshot.filesystems {
        let labels = FsLabels {
            path: fs.path.clone(),
            device: fs.device.to_string(),
        };
        set(&level.get_or_create(&labels), fs.level as u64);
        set(&free.get_or_create(&labels), fs.free_bytes);
        set(&total.get_or_create(&labels), fs.total_bytes);
        set(&spare.get_or_create(&labels), fs.spare_bytes);
    }
    register_time_to_full(&mut registry, limits, &snapshot);
    let damaged = gauge_family::<PathLabels>(
        &mut registry,
        "damaged_copies",
        "Copies (of partitions, of the cluster metadata) found damaged at start and moved aside into this damaged/ directory \
         (rebuilt from their other replicas; the operator removes them)",
    );
    for (dir, copies) in limits.damaged_copies() {
        let labels = PathLabels {
            path: dir.display().to_string(),
        };
        set(&damaged.get_or_create(&labels), copies as u64);
    }
    gauge(
        &mut registry,
        "memory_resident_bytes",
        "Resident memory of the broker",
        snapshot.memory_resident_bytes,
    );
    gauge(
        &mut registry,
        "memory_limit_bytes",
        "The memory limit the levels are computed from",
        snapshot.memory_limit_bytes,
    );
    gauge(
        &mut registry,
        "memory_level",
        "Memory level: 0 normal, 1 soft, 2 hard",
        snapshot.memory_level as u64,
    );
    let claims = limits.memory_claims();
    gauge(
        &mut registry,
        "memory_claimed_bytes",
        "Memory claimed by open connections, large frames being read and consumers' prefetch \
         bookkeeping (admitted only below the hard level)",
        claims.claimed_bytes(),
    );
    let claims_refused = Counter::<u64>::default();
    claims_refused.inc_by(claims.refused());
    registry.register(
        "memory_claims_refused",
        "Connections, subscribes and large frames refused or held back because their memory would \
         pass the hard level (a large frame held back counts once, whether it then goes on or not)",
        claims_refused,
    );
    let deliveries = broker.delivery_budget();
    gauge(
        &mut registry,
        "delivery_budget_used_bytes",
        "Delivery bytes held in memory: read for consumers, not yet flushed to their sockets",
        deliveries.used_bytes(),
    );
    gauge(
        &mut registry,
        "delivery_budget_bytes",
        "The node-wide bound on delivery bytes held in memory (server.delivery_bytes_max)",
        deliveries.capacity_bytes(),
    );
    let delayed = Family::<ReasonLabels, Counter>::default();
    registry.register(
        "publishes_delayed",
        "Publish batches delayed by slowing, by reason",
        delayed.clone(),
    );
    let rejected = Family::<ReasonLabels, Counter>::default();
    registry.register(
        "publishes_rejected",
        "Publish batches rejected with ERR_LIMITED, by reason",
        rejected.clone(),
    );
    let c = &limits.counters;
    for (reason, d, r) in [
        ("disk", &c.delayed_disk, &c.rejected_disk),
        ("memory", &c.delayed_memory, &c.rejected_memory),
    ] {
        let labels = ReasonLabels {
            reason: reason.into(),
        };
        delayed
            .get_or_create(&labels)
            .inc_by(d.load(Ordering::Relaxed));
        rejected
            .get_or_create(&labels)
            .inc_by(r.load(Ordering::Relaxed));
    }
    let queues = broker.list();
    rejected
        .get_or_create(&ReasonLabels {
            reason: "queue_full".into(),
        })
        .inc_by(
            queues
                .iter()
                .flat_map(|q| &q.partitions)
                .map(|p| p.rejected_full)
                .sum(),
        );
    let pool = broker.pool();
    register_log_figures(&mut registry, broker, &queues);
    register_replication(&mut registry, &queues);
    register_cluster_levels(&mut registry, limits);
    streams::register_streams(&mut registry, broker);
    let spares = gauge_family::<PoolLabels>(
        &mut registry,
        "pool_spares",
        "Spare segment files per file system and size class",
    );
    for fs in pool.filesystems() {
        for (class, count) in [("full", fs.full_count), ("small", fs.small_count)] {
            let labels = PoolLabels {
                device: fs.device.to_string(),
                class: class.into(),
            };
            set(&spares.get_or_create(&labels), count);
        }
    }
    let counters = pool.counters();
    for (name, help, value) in [
        (
            "pool_takes_from_pool",
            "Segments served from a spare",
            counters.takes_from_pool,
        ),
        (
            "pool_takes_fresh",
            "Segments created fresh (no spare)",
            counters.takes_fresh,
        ),
        (
            "pool_releases",
            "Spares deleted under disk pressure",
            counters.released,
        ),
        (
            "pool_released_bytes",
            "Bytes of spares deleted under disk pressure",
            counters.released_bytes,
        ),
        (
            "pool_retired_generation",
            "Files retired before their generation wrapped",
            counters.retired_generation,
        ),
    ] {
        let c = Counter::<u64>::default();
        c.inc_by(value);
        registry.register(name, help, c);
    }
    let ready =
        gauge_family::<QueueLabels>(&mut registry, "queue_ready_messages", "Ready messages");
    let inflight = gauge_family::<QueueLabels>(
        &mut registry,
        "queue_inflight_messages",
        "Inflight messages",
    );
    let bytes = gauge_family::<QueueLabels>(&mut registry, "queue_bytes", "Live message bytes");
    let disk = gauge_family::<QueueLabels>(
        &mut registry,
        "queue_disk_bytes",
        "Bytes of the queue's logs",
    );
    let full_rejects = Family::<QueueReasonLabels, Counter>::default();
    registry.register(
        "queue_publishes_rejected",
        "Publish batches a queue refused for its own limits, by queue",
        full_rejects.clone(),
    );
    let overflowed = Family::<QueueLabels, Counter>::default();
    registry.register(
        "queue_overflowed",
        "Messages drop_oldest removed to make room, by queue",
        overflowed.clone(),
    );
    let dead_letter_failures = Family::<QueueReasonLabels, Counter>::default();
    registry.register(
        "dead_letter_failures",
        "Dead-letter copies the dead-letter queue did not store, by queue and reason (not_found, \
         queue_full, unavailable, other): each failed attempt of a message (the original stays \
         in the queue and is tried again), and each drop_oldest removal dropped because the node \
         held its most dead letters",
        dead_letter_failures.clone(),
    );
    let dead_letters_held = gauge_family::<QueueLabels>(
        &mut registry,
        "queue_dead_letters_held",
        "Messages held until their dead-letter queue confirms their copies (not ready, not \
         inflight), on the partitions this node leads",
    );
    for q in queues {
        for (reason, count) in q.dead_letter_failures() {
            dead_letter_failures
                .get_or_create(&QueueReasonLabels {
                    queue: q.name.clone(),
                    reason: reason.as_str().into(),
                })
                .inc_by(count);
        }
        let labels = QueueLabels {
            queue: q.name.clone(),
        };
        full_rejects
            .get_or_create(&QueueReasonLabels {
                queue: q.name.clone(),
                reason: "queue_full".into(),
            })
            .inc_by(q.partitions.iter().map(|p| p.rejected_full).sum());
        overflowed
            .get_or_create(&labels)
            .inc_by(q.partitions.iter().map(|p| p.overflowed).sum());
        set(&ready.get_or_create(&labels), q.ready());
        set(&inflight.get_or_create(&labels), q.inflight());
        set(&bytes.get_or_create(&labels), q.bytes());
        set(&disk.get_or_create(&labels), q.disk_bytes());
        set(
            &dead_letters_held.get_or_create(&labels),
            q.partitions.iter().map(|p| p.dead_letters_held).sum(),
        );
    }
    let mut out = String::new();
    if encode(&mut out, &registry).is_err() {
        out.push_str("# error encoding metrics\n");
    }
    out
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserDecisionLabels {
    user: String,
    decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserLabels {
    user: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

/// Logins and publish quotas: logins accepted and refused, verifications in flight, and per
/// user the publishes its quota delayed or refused and the delay it imposed (users whose
/// quota never acted have no series).
fn register_access(registry: &mut Registry, access: &crate::access::Access) {
    let logins = Family::<OutcomeLabels, Counter<u64>>::default();
    registry.register(
        "logins",
        "Logins (protocol handshakes and HTTP requests presenting a password or token) by outcome",
        logins.clone(),
    );
    let (ok, refused) = access.login_counts();
    for (outcome, count) in [("ok", ok), ("refused", refused)] {
        logins
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .inc_by(count);
    }
    gauge(
        registry,
        "logins_in_flight",
        "Password logins waiting for or in an argon2 verification now",
        access.logins_in_flight() as u64,
    );
    let decisions = Family::<UserDecisionLabels, Counter<u64>>::default();
    registry.register(
        "quota_publishes",
        "Publishes a user's quota delayed or refused (429 reason quota) on this node",
        decisions.clone(),
    );
    let delay = Family::<UserLabels, Counter<f64, std::sync::atomic::AtomicU64>>::default();
    registry.register_with_unit(
        "quota_delay",
        "Delay a user's quota imposed on its publishes on this node",
        Unit::Seconds,
        delay.clone(),
    );
    for (user, figures) in access.quotas().figures() {
        for (decision, count) in [("delayed", figures.delayed), ("refused", figures.refused)] {
            decisions
                .get_or_create(&UserDecisionLabels {
                    user: user.to_string(),
                    decision: decision.into(),
                })
                .inc_by(count);
        }
        delay
            .get_or_create(&UserLabels {
                user: user.to_string(),
            })
            .inc_by(figures.delay_s);
    }
}

/// The replicated partitions on this node: replicas, leader changes, and on the leader the
/// in-sync count and each replica's lag (only the leader knows them). Partitions that are not
/// replicated here have no series.
fn register_replication(registry: &mut Registry, queues: &[keratin_broker::QueueInfo]) {
    let replicas = gauge_family::<PartitionLabels>(
        registry,
        "partition_replicas",
        "Replicas of a replicated partition held on this node (the group's voters)",
    );
    let in_sync = gauge_family::<PartitionLabels>(
        registry,
        "partition_in_sync_replicas",
        "Replicas in sync with the partition's leader (on the leader only): at most 1,000 \
         entries behind and heard from within 5 s",
    );
    let lag = gauge_family::<ReplicaLabels>(
        registry,
        "partition_replica_lag_entries",
        "Entries of the leader's log a replica does not hold yet (on the leader only)",
    );
    let changes = Family::<PartitionLabels, Counter>::default();
    registry.register(
        "partition_leader_changes",
        "Times the partition's leader changed to another node, as this node saw it",
        changes.clone(),
    );
    for queue in queues {
        for p in queue.partitions.iter().filter(|p| !p.replicas.is_empty()) {
            let labels = PartitionLabels {
                queue: queue.name.clone(),
                partition: p.index.to_string(),
            };
            set(&replicas.get_or_create(&labels), p.replicas.len() as u64);
            changes.get_or_create(&labels).inc_by(p.leader_changes);
            if !p.leading {
                continue;
            }
            set(&in_sync.get_or_create(&labels), p.in_sync.len() as u64);
            for (replica, entries) in &p.replica_lag {
                let labels = ReplicaLabels {
                    queue: queue.name.clone(),
                    partition: p.index.to_string(),
                    replica: replica.to_string(),
                };
                set(&lag.get_or_create(&labels), *entries);
            }
        }
    }
}

/// Time to full per file system, only while its free space falls (`time_to_full.rs`): the fill
/// rate and the projected seconds to the hard and reserve levels.
fn register_time_to_full(registry: &mut Registry, limits: &NodeLimits, snapshot: &LimitsSnapshot) {
    let rate = gauge_family::<FsLabels>(
        registry,
        "disk_fill_bytes_per_second",
        "How fast free space fell over the last 5 minutes (absent while flat or growing)",
    );
    let to_hard = gauge_family::<FsLabels>(
        registry,
        "disk_time_to_hard_seconds",
        "Projected time until the hard level at that rate (absent while flat or growing)",
    );
    let to_reserve = gauge_family::<FsLabels>(
        registry,
        "disk_time_to_reserve_seconds",
        "Projected time until the reserve level at that rate (absent while flat or growing)",
    );
    for fs in &snapshot.filesystems {
        let Some(projection) = limits.projection(fs.device) else {
            continue;
        };
        let labels = FsLabels {
            path: fs.path.clone(),
            device: fs.device.to_string(),
        };
        set(
            &rate.get_or_create(&labels),
            projection.fill_bytes_per_s.round() as u64,
        );
        set(
            &to_hard.get_or_create(&labels),
            projection.to_hard_ms / 1000,
        );
        set(
            &to_reserve.get_or_create(&labels),
            projection.to_reserve_ms / 1000,
        );
    }
}

/// In a cluster: every node's levels as it last reported them (this node's included), labelled
/// by node, and the publishes this node's partitions delayed or refused for another node's
/// level (an in-sync replica's).
fn register_cluster_levels(registry: &mut Registry, limits: &NodeLimits) {
    let Some(levels) = limits.cluster_levels() else {
        return;
    };
    let level = gauge_family::<NodeResourceLabels>(
        registry,
        "cluster_node_level",
        "Each node's level per file system and for memory, as it last reported: 0 normal, 1 soft, 2 hard, 3 reserve",
    );
    let free = gauge_family::<NodeResourceLabels>(
        registry,
        "cluster_node_free_bytes",
        "Each node's free bytes per file system (spares included) and memory headroom, as it last reported",
    );
    for (node, heard) in levels.all() {
        let resources = heard
            .report
            .filesystems
            .iter()
            .map(|fs| ("disk", fs.path.clone(), fs.input))
            .chain(
                heard
                    .report
                    .memory
                    .iter()
                    .map(|m| ("memory", String::new(), m.input)),
            );
        for (resource, path, input) in resources {
            let labels = NodeResourceLabels {
                node: node.to_string(),
                resource: resource.to_string(),
                path,
            };
            level.get_or_create(&labels).set(input.level as i64);
            free.get_or_create(&labels)
                .set(i64::try_from(input.headroom_bytes).unwrap_or(i64::MAX));
        }
    }
    let limited = Family::<DecisionLabels, Counter>::default();
    registry.register(
        "publishes_limited_by_replica",
        "Publish batches delayed or rejected for an in-sync replica's node level (also counted in publishes_delayed / publishes_rejected)",
        limited.clone(),
    );
    let counters = &limits.counters;
    for (decision, value) in [
        ("delayed", &counters.delayed_for_replica),
        ("rejected", &counters.rejected_for_replica),
    ] {
        limited
            .get_or_create(&DecisionLabels {
                decision: decision.to_string(),
            })
            .inc_by(value.load(Ordering::Relaxed));
    }
}

/// Log stops and heals (every log of the node shares the pool that counts them), the partitions
/// stopped now, and the sync latency histogram.
fn register_log_figures(
    registry: &mut Registry,
    broker: &Broker,
    queues: &[keratin_broker::QueueInfo],
) {
    let pool = broker.pool();
    let counters = pool.counters();
    for (name, help, value) in [
        (
            "log_stops",
            "Logs (partitions and the metadata log) stopped by a failed write or sync",
            counters.log_stops,
        ),
        (
            "log_heals",
            "Stopped logs reopened by a heal",
            counters.log_heals,
        ),
    ] {
        let c = Counter::<u64>::default();
        c.inc_by(value);
        registry.register(name, help, c);
    }
    let stopped = queues
        .iter()
        .flat_map(|q| &q.partitions)
        .filter(|p| p.stopped)
        .count();
    gauge(
        registry,
        "partitions_stopped",
        "Partitions whose log is stopped now (refusing publishes until healed)",
        stopped as u64,
    );
    registry.register_with_unit(
        "log_fsync",
        "Time of each sync (fdatasync of a segment, fsync of a log directory) by the commit threads",
        Unit::Seconds,
        SyncLatency(pool.sync_histogram()),
    );
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use keratin_broker::{PartitionInfo, QueueInfo, QueueSettings};

    use super::*;

    fn partition(index: u32, leading: bool, replicated: bool) -> PartitionInfo {
        PartitionInfo {
            index,
            dir: "/data/q".into(),
            ready: 0,
            inflight: 0,
            bytes: 0,
            disk_bytes: 0,
            stopped: false,
            stops: 0,
            heals: 0,
            full: false,
            rejected_full: 0,
            overflowed: 0,
            dead_letter_failures: BTreeMap::new(),
            dead_letters_held: 0,
            leading,
            leader: Some(1),
            leader_addr: None,
            replicas: if replicated {
                vec![1, 2, 3]
            } else {
                Vec::new()
            },
            preferred_leader: None,
            in_sync: if leading { vec![1, 2] } else { Vec::new() },
            replica_lag: if leading {
                BTreeMap::from([(1, 0), (2, 1), (3, 2_500)])
            } else {
                BTreeMap::new()
            },
            leader_changes: 2,
            leaderless_ms: None,
            committed_offset: Some(10),
        }
    }

    #[test]
    fn replication_series_come_from_replicated_partitions_and_lag_from_the_leader() {
        let queues = vec![
            QueueInfo {
                name: "orders".into(),
                settings: QueueSettings::default(),
                partitions: vec![partition(0, true, true), partition(1, false, true)],
            },
            QueueInfo {
                name: "local".into(),
                settings: QueueSettings::default(),
                partitions: vec![partition(0, true, false)],
            },
        ];
        let mut registry = Registry::with_prefix("keratin");
        register_replication(&mut registry, &queues);
        let mut text = String::new();
        encode(&mut text, &registry).expect("encode");
        for line in [
            r#"keratin_partition_replicas{queue="orders",partition="0"} 3"#,
            r#"keratin_partition_replicas{queue="orders",partition="1"} 3"#,
            r#"keratin_partition_in_sync_replicas{queue="orders",partition="0"} 2"#,
            r#"keratin_partition_replica_lag_entries{queue="orders",partition="0",replica="3"} 2500"#,
            r#"keratin_partition_replica_lag_entries{queue="orders",partition="0",replica="1"} 0"#,
            r#"keratin_partition_leader_changes_total{queue="orders",partition="1"} 2"#,
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        assert!(
            !text.contains(r#"keratin_partition_in_sync_replicas{queue="orders",partition="1"}"#),
            "only the leader knows the in-sync set:\n{text}"
        );
        assert!(
            !text.contains(r#"queue="local""#),
            "a local partition has no series:\n{text}"
        );
    }
}
