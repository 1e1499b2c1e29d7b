//! `PublishGate`: what the node's resource limits say about a publish, asked by each partition's
//! owner before it writes a batch. The broker does not sample disks or memory itself: the server
//! implements the gate over `keratin-limits` and its sampler; tests use scripted gates.
//!
//! Only publishes pass the gate. Acks, rejects, returns, dead-lettering of existing messages,
//! purge, delete, relocation and prefix removal never do: they are what frees space.

use std::fmt::Debug;

/// The answer for one publish batch on one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateDecision {
    /// Write it now.
    Admit,
    /// Write it after this delay; the delay holds back this partition's publishes only.
    Slow {
        /// Milliseconds to wait.
        delay_ms: u64,
    },
    /// Do not write it: answer `ERR_LIMITED`. Nothing is applied, so a retry is safe.
    Reject {
        /// `disk` or `memory`.
        reason: String,
        /// When a retry may succeed.
        retry_after_ms: u32,
        /// What happened and what to do, for people.
        message: String,
    },
}

/// The node's resource limits, as partitions see them.
pub trait PublishGate: Send + Sync + Debug {
    /// The decision for a batch of `batch_bytes` bound for a partition on file system `device`.
    fn publish(&self, device: u64, batch_bytes: u64) -> GateDecision;

    /// Whether a publish may depend on other nodes' levels now: some peer of this node is at
    /// soft or deeper. Asked before every publish of a replicated partition, so it must be
    /// cheap; while it is false the leader asks [`PublishGate::publish`] only.
    fn replicas_limited(&self) -> bool {
        false
    }

    /// The decision for a batch of `batch_bytes` bound for a partition on file system `device`
    /// here and with in-sync copies on the nodes `replicas` (this node not among them): the
    /// strictest of this node's answer and each replica's, as its node last reported its
    /// levels (`docs/cluster.md`, "Cluster-wide limits").
    fn publish_replicated(&self, device: u64, batch_bytes: u64, replicas: &[u64]) -> GateDecision {
        let _ = replicas;
        self.publish(device, batch_bytes)
    }

    /// Whether a log stopped by a write error on `device` may be healed now (the file system is
    /// back above its reserve level).
    fn may_heal(&self, device: u64) -> bool;

    /// Free bytes on `device` at the last sample (spare segments counted, since a roll takes
    /// them without allocating), or `None` when unknown. A log stopped at reserve heals when
    /// this holds a new segment: what it writes next (acks, purges, reclaim) then fits.
    fn free_bytes(&self, device: u64) -> Option<u64> {
        let _ = device;
        None
    }

    /// A partition on `device` grew its log by a segment: a good moment to sample again.
    fn segment_rolled(&self, device: u64) {
        let _ = device;
    }
}

/// A gate that admits everything (no limits configured).
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenGate;

impl PublishGate for OpenGate {
    fn publish(&self, _device: u64, _batch_bytes: u64) -> GateDecision {
        GateDecision::Admit
    }

    fn may_heal(&self, _device: u64) -> bool {
        true
    }
}
