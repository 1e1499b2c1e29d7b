//! `Admission`: the pure decision whether a publish batch is admitted, slowed or rejected, and
//! `OperationClass`: which kinds of write each level allows. Both are functions of the last
//! sample only; sampling runs on its own timer and never inside a request. Per-queue limits
//! (`queue_full`) belong to the broker.
//!
//! # The delay curve
//! At soft, a publish batch waits `max_delay_ms × (soft − h) / (soft − hard)`, rounded down,
//! where `h` is the resource's headroom (free disk bytes, or memory limit minus resident bytes)
//! minus the batch's bytes, clamped to `[0, max_delay_ms]`. So the delay is 0 at the soft
//! threshold, `max_delay_ms` at the hard threshold, linear and monotone in between. With several
//! resources at soft, the longest delay applies.
//!
//! # The retry hint
//! A rejected publish carries `retry_after_ms`, the time after which a retry may succeed. A level
//! changes only on a sample, so the hint is one sample interval for disk at hard and two for disk
//! at reserve (clearing reserve needs more space freed than clearing hard) and for memory at hard
//! (resident memory falls late). It is never below [`RETRY_AFTER_MS_MIN`]. When several resources
//! reject, the reason is `disk` if any disk rejects (freeing disk is what the operator must do,
//! and a disk limit is the one that stops logs), and the hint is the longest of their hints.

use serde::{Deserialize, Serialize};

use crate::level::{Level, Thresholds};
use crate::settings::LimitsSettings;

/// The smallest retry hint: with a very short sample interval, a client retrying more than ten
/// times a second per partition only adds load to a node that is already short.
pub const RETRY_AFTER_MS_MIN: u64 = 100;

/// What a resource looks like to the admission decision: its level and where it stands between
/// its thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LevelInput {
    /// The level, with hysteresis.
    pub level: Level,
    /// Bytes left before the resource runs out, as of the last sample.
    pub headroom_bytes: u64,
    /// The thresholds, as headroom bytes.
    pub thresholds: Thresholds,
}

/// Why a publish was rejected; sent to the client as `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// A filesystem holding the partition is at hard or reserve.
    Disk,
    /// Node memory is at hard.
    Memory,
}

impl Reason {
    /// The stable wire and metrics name: `disk` or `memory`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Disk => "disk",
            Reason::Memory => "memory",
        }
    }
}

/// The answer for one publish batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Decision {
    /// Apply it now.
    Admit,
    /// Apply it after `delay_ms`; the delay applies to this partition only.
    Slow {
        /// How long to wait before applying the batch.
        delay_ms: u64,
    },
    /// Do not apply it: answer `ERR_LIMITED`. Nothing was applied, so a retry is safe.
    Reject {
        /// Which resource is short.
        reason: Reason,
        /// The deepest level among the rejecting resources of `reason`, for the message.
        level: Level,
        /// When a retry may succeed.
        retry_after_ms: u64,
    },
}

impl Decision {
    /// The stricter of two decisions for the same batch (a partition whose copies live in
    /// several places is limited by the worst of them): a rejection over a delay over an
    /// admission; between two rejections the reason and level as in [`Admission::decide`] and
    /// the longer hint; between two delays the longer.
    pub fn stricter(self, other: Decision) -> Decision {
        match (self, other) {
            (
                Decision::Reject {
                    reason,
                    level,
                    retry_after_ms,
                },
                Decision::Reject {
                    reason: other_reason,
                    level: other_level,
                    retry_after_ms: other_ms,
                },
            ) => {
                let (reason, level) =
                    Admission::reject_reason(reason, level, other_reason, other_level);
                Decision::Reject {
                    reason,
                    level,
                    retry_after_ms: retry_after_ms.max(other_ms),
                }
            }
            (reject @ Decision::Reject { .. }, _) | (_, reject @ Decision::Reject { .. }) => reject,
            (Decision::Slow { delay_ms }, Decision::Slow { delay_ms: other }) => Decision::Slow {
                delay_ms: delay_ms.max(other),
            },
            (slow @ Decision::Slow { .. }, Decision::Admit)
            | (Decision::Admit, slow @ Decision::Slow { .. }) => slow,
            (Decision::Admit, Decision::Admit) => Decision::Admit,
        }
    }
}

/// The admission rule, built from the settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    max_delay_ms: u64,
    sample_interval_ms: u64,
}

impl Admission {
    /// The rule for validated `settings`.
    pub fn new(settings: &LimitsSettings) -> Admission {
        Admission {
            max_delay_ms: settings.max_delay_ms,
            sample_interval_ms: settings.sample_interval_ms,
        }
    }

    /// Decides a publish batch of `batch_bytes` on a partition whose storage lives on `disks`
    /// (every filesystem holding a copy), with `memory` the node's memory (`None` before the
    /// first memory sample). Any resource at hard or deeper rejects; otherwise any at soft slows.
    pub fn decide(
        &self,
        disks: impl IntoIterator<Item = LevelInput>,
        memory: Option<LevelInput>,
        batch_bytes: u64,
    ) -> Decision {
        let mut reject: Option<(Reason, Level, u64)> = None;
        let mut delay_ms = 0;
        let resources = disks
            .into_iter()
            .map(|input| (Reason::Disk, input))
            .chain(memory.map(|input| (Reason::Memory, input)));
        for (reason, input) in resources {
            if OperationClass::Publish.allowed_at(input.level) {
                delay_ms = delay_ms.max(self.delay_ms(&input, batch_bytes));
                continue;
            }
            let retry_after_ms = self.retry_after_ms(reason, input.level);
            reject = Some(match reject {
                None => (reason, input.level, retry_after_ms),
                Some((first, level, hint_ms)) => {
                    let (reason, level) = Self::reject_reason(first, level, reason, input.level);
                    (reason, level, hint_ms.max(retry_after_ms))
                }
            });
        }
        match reject {
            Some((reason, level, retry_after_ms)) => Decision::Reject {
                reason,
                level,
                retry_after_ms,
            },
            None if delay_ms > 0 => Decision::Slow { delay_ms },
            None => Decision::Admit,
        }
    }

    /// Disk wins over memory; between two of the same reason, the deeper level is reported.
    fn reject_reason(
        first: Reason,
        first_level: Level,
        next: Reason,
        next_level: Level,
    ) -> (Reason, Level) {
        match (first, next) {
            (Reason::Disk, Reason::Memory) => (first, first_level),
            (Reason::Memory, Reason::Disk) => (next, next_level),
            _ => (first, first_level.max(next_level)),
        }
    }

    /// The delay for one resource (see the module docs); 0 unless its level is `Soft`.
    pub fn delay_ms(&self, input: &LevelInput, batch_bytes: u64) -> u64 {
        if input.level != Level::Soft {
            return 0;
        }
        let soft_bytes = input.thresholds.soft_bytes;
        let hard_bytes = input.thresholds.hard_bytes;
        let headroom_bytes = input.headroom_bytes.saturating_sub(batch_bytes);
        if headroom_bytes >= soft_bytes {
            return 0;
        }
        if headroom_bytes <= hard_bytes {
            return self.max_delay_ms;
        }
        // hard < headroom < soft, so the span is positive and the quotient below max_delay_ms.
        let span_bytes = u128::from(soft_bytes - hard_bytes);
        let depth_bytes = u128::from(soft_bytes - headroom_bytes);
        let delay_ms = u128::from(self.max_delay_ms) * depth_bytes / span_bytes;
        u64::try_from(delay_ms).unwrap_or(self.max_delay_ms)
    }

    /// The retry hint for a publish rejected by `reason` at `level` (see the module docs).
    pub fn retry_after_ms(&self, reason: Reason, level: Level) -> u64 {
        let intervals = match (reason, level) {
            (Reason::Disk, Level::Reserve) | (Reason::Memory, _) => 2,
            (Reason::Disk, _) => 1,
        };
        self.sample_interval_ms
            .saturating_mul(intervals)
            .max(RETRY_AFTER_MS_MIN)
    }
}

/// A kind of operation, for deciding what may write at each level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum OperationClass {
    /// Publishing new messages: slowed at soft, rejected at hard and reserve.
    Publish,
    /// Consuming and other reads: never limited.
    Consume,
    /// Acknowledging, rejecting, settling and dead-lettering existing messages: never limited,
    /// because they are what lets space be reclaimed.
    Settle,
    /// Purging a queue: never limited; it frees space.
    Purge,
    /// Deleting a queue: never limited; it frees space.
    Delete,
    /// Metadata, coordination and admin reads and writes: never limited; they are small and keep
    /// the node manageable.
    Metadata,
    /// Recovering logs at startup and healing stopped logs: never limited.
    Recovery,
    /// Removing settled segments and relocating old messages: never limited; the reserve exists
    /// so that it always has room (compaction needs disk).
    Reclaim,
    /// Replication catch-up on a follower: continues until reserve, where the follower leaves
    /// the in-sync set as it would after a fault.
    ReplicaCatchUp,
}

impl OperationClass {
    /// Every class.
    pub const ALL: [OperationClass; 9] = [
        OperationClass::Publish,
        OperationClass::Consume,
        OperationClass::Settle,
        OperationClass::Purge,
        OperationClass::Delete,
        OperationClass::Metadata,
        OperationClass::Recovery,
        OperationClass::Reclaim,
        OperationClass::ReplicaCatchUp,
    ];

    /// Whether this class may proceed at `level` (the deepest level among the resources it
    /// touches). A publish allowed at soft is still slowed by [`Admission::decide`].
    pub fn allowed_at(self, level: Level) -> bool {
        match self {
            OperationClass::Publish => level < Level::Hard,
            OperationClass::ReplicaCatchUp => level < Level::Reserve,
            OperationClass::Consume
            | OperationClass::Settle
            | OperationClass::Purge
            | OperationClass::Delete
            | OperationClass::Metadata
            | OperationClass::Recovery
            | OperationClass::Reclaim => true,
        }
    }
}
