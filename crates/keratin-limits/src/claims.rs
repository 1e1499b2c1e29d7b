//! `MemoryClaims`: memory that a connection, a frame or a consumer is about to take, admitted
//! against the memory limit before it is taken.
//!
//! The memory level follows resident memory, sampled once per `sample_interval_ms`. Publishes
//! grow memory a batch at a time, and their budget is fixed; some other takers grow it in steps
//! that a sample sees too late: a new connection, a 16 MiB frame that arrives slowly, a
//! consumer's bookkeeping for its whole prefetch. A thousand of them between two samples pass
//! the limit before the level says hard. So each claims its bytes first, and a claim is granted
//! only when it would not take memory past the limit:
//!
//! ```text
//! granted  ⇔  resident + budgets + claimed + bytes ≤ limit
//! ```
//!
//! where `resident` is the last sample, `budgets` the memory the node's fixed budgets may take
//! at any moment (unanswered publishes, deliveries not yet sent, relocation reads: they wait for
//! their budget rather than claim), and `claimed` the bytes of every claim still held. A claim
//! is held until its memory is given back ([`MemoryClaim`] releases it when dropped).
//!
//! The ceiling is the limit, not the hard level: at hard, the memory level already refuses
//! publishes one by one with a retry hint, and what claims memory there (a consumer's
//! connection and prefetch, an ack frame) is what drains the node. The rule counts bytes in
//! use twice (in `resident`, and in `claimed` or `budgets`): under load it refuses early, by at
//! most the claimed and budgeted bytes, and it never lets a claim through because a sample had
//! not seen the ones before it. Before the first sample nothing is known and every claim is
//! granted.
//!
//! A refused claim carries the retry hint of memory at hard, as a refused publish does.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Whether a claim of `bytes` fits: `held` is what memory holds or may hold without a claim
/// (`resident + budgets`), `claimed` what other claims hold, and `ceiling` the memory limit.
/// Sums that overflow do not fit.
pub fn claim_fits(held_bytes: u64, claimed_bytes: u64, bytes: u64, ceiling_bytes: u64) -> bool {
    held_bytes
        .checked_add(claimed_bytes)
        .and_then(|sum| sum.checked_add(bytes))
        .is_some_and(|total| total <= ceiling_bytes)
}

/// The node's claims: what they hold, and the last memory sample they are decided against.
/// Shared by every connection (cheap atomics, no lock).
#[derive(Debug)]
pub struct MemoryClaims {
    /// Bytes held by granted claims not yet dropped.
    claimed_bytes: AtomicU64,
    /// Resident bytes at the last sample.
    resident_bytes: AtomicU64,
    /// Memory the node's fixed budgets may take at any moment.
    budgets_bytes: AtomicU64,
    /// The memory limit at the last sample; `u64::MAX` before the first.
    ceiling_bytes: AtomicU64,
    /// The retry hint for a refused claim.
    retry_after_ms: AtomicU64,
    /// Claims refused since the node started (metrics).
    refused: AtomicU64,
}

impl Default for MemoryClaims {
    fn default() -> Self {
        MemoryClaims {
            claimed_bytes: AtomicU64::new(0),
            resident_bytes: AtomicU64::new(0),
            budgets_bytes: AtomicU64::new(0),
            ceiling_bytes: AtomicU64::new(u64::MAX),
            retry_after_ms: AtomicU64::new(crate::admission::RETRY_AFTER_MS_MIN),
            refused: AtomicU64::new(0),
        }
    }
}

/// What a claim was refused against, for the refusal's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRefused {
    /// The bytes asked for.
    pub bytes: u64,
    /// Resident bytes at the last sample.
    pub resident_bytes: u64,
    /// Memory the node's fixed budgets may take.
    pub budgets_bytes: u64,
    /// Bytes held by other claims.
    pub claimed_bytes: u64,
    /// The memory limit.
    pub ceiling_bytes: u64,
    /// When a retry may succeed.
    pub retry_after_ms: u64,
}

impl fmt::Display for ClaimRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
        write!(
            f,
            "{:.1} MiB more could take memory past its limit of {:.1} MiB ({:.1} MiB resident, \
             {:.1} MiB kept for unanswered publishes, unsent deliveries and reclaim, {:.1} MiB \
             claimed by connections, large frames and consumers)",
            mib(self.bytes),
            mib(self.ceiling_bytes),
            mib(self.resident_bytes),
            mib(self.budgets_bytes),
            mib(self.claimed_bytes),
        )
    }
}

/// A granted claim; its bytes are given back when it is dropped.
#[derive(Debug)]
pub struct MemoryClaim {
    claims: Arc<MemoryClaims>,
    bytes: u64,
}

impl MemoryClaim {
    /// The bytes this claim holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for MemoryClaim {
    fn drop(&mut self) {
        self.claims
            .claimed_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl MemoryClaims {
    /// Claims that grant everything until the first [`MemoryClaims::observe`].
    pub fn new() -> Arc<MemoryClaims> {
        Arc::new(MemoryClaims::default())
    }

    /// Sets the memory the node's fixed budgets may take at any moment (publish and delivery
    /// bytes, each held about twice); claims fit beside it.
    pub fn set_budgets(&self, budgets_bytes: u64) {
        self.budgets_bytes.store(budgets_bytes, Ordering::Release);
    }

    /// Takes a memory sample: `resident_bytes`, the `limit_bytes`, and the `retry_after_ms` of
    /// a refusal.
    pub fn observe(&self, resident_bytes: u64, limit_bytes: u64, retry_after_ms: u64) {
        self.resident_bytes.store(resident_bytes, Ordering::Release);
        self.ceiling_bytes.store(limit_bytes, Ordering::Release);
        self.retry_after_ms.store(retry_after_ms, Ordering::Release);
    }

    /// Claims `bytes`, granted by the rule in the module docs; a refusal takes nothing and is
    /// counted in [`MemoryClaims::refused`].
    pub fn claim(self: &Arc<Self>, bytes: u64) -> Result<MemoryClaim, ClaimRefused> {
        let claimed = self.claim_again(bytes);
        if claimed.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        claimed
    }

    /// [`MemoryClaims::claim`] for a taker that waits and tries again: its refusals are not
    /// counted again.
    pub fn claim_again(self: &Arc<Self>, bytes: u64) -> Result<MemoryClaim, ClaimRefused> {
        let resident_bytes = self.resident_bytes.load(Ordering::Acquire);
        let budgets_bytes = self.budgets_bytes.load(Ordering::Acquire);
        let held_bytes = resident_bytes.saturating_add(budgets_bytes);
        let ceiling_bytes = self.ceiling_bytes.load(Ordering::Acquire);
        let mut claimed_bytes = self.claimed_bytes.load(Ordering::Acquire);
        loop {
            if !claim_fits(held_bytes, claimed_bytes, bytes, ceiling_bytes) {
                return Err(ClaimRefused {
                    bytes,
                    resident_bytes,
                    budgets_bytes,
                    claimed_bytes,
                    ceiling_bytes,
                    retry_after_ms: self.retry_after_ms.load(Ordering::Acquire),
                });
            }
            // Claims race: the sum is checked and taken in one step.
            match self.claimed_bytes.compare_exchange_weak(
                claimed_bytes,
                claimed_bytes + bytes,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Ok(MemoryClaim {
                        claims: self.clone(),
                        bytes,
                    })
                }
                Err(now) => claimed_bytes = now,
            }
        }
    }

    /// Bytes held by granted claims.
    pub fn claimed_bytes(&self) -> u64 {
        self.claimed_bytes.load(Ordering::Acquire)
    }

    /// Claims refused since the node started (a taker that waits and tries again counts once).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_fits_up_to_the_ceiling_and_not_a_byte_past() {
        assert!(claim_fits(600, 300, 100, 1000));
        assert!(!claim_fits(600, 300, 101, 1000));
        assert!(!claim_fits(u64::MAX, 1, 0, u64::MAX));
        assert!(claim_fits(0, 0, 0, 0));
    }

    #[test]
    fn everything_is_granted_before_the_first_sample() {
        let claims = MemoryClaims::new();
        let claim = claims.claim(1 << 40).expect("granted");
        assert_eq!(claims.claimed_bytes(), 1 << 40);
        drop(claim);
        assert_eq!(claims.claimed_bytes(), 0);
    }

    #[test]
    fn held_claims_count_against_the_next_and_dropping_one_gives_its_bytes_back() {
        let claims = MemoryClaims::new();
        claims.set_budgets(100);
        claims.observe(400, 1000, 200);
        let first = claims.claim(300).expect("400 + 100 + 300 ≤ 1000");
        let refused = claims.claim(201).expect_err("400 + 100 + 300 + 201 > 1000");
        assert_eq!(
            refused,
            ClaimRefused {
                bytes: 201,
                resident_bytes: 400,
                budgets_bytes: 100,
                claimed_bytes: 300,
                ceiling_bytes: 1000,
                retry_after_ms: 200,
            }
        );
        assert_eq!(claims.refused(), 1);
        assert!(claims.claim_again(201).is_err());
        assert_eq!(claims.refused(), 1, "a retry is not counted again");
        let second = claims.claim(200).expect("exactly at the ceiling");
        drop(first);
        assert_eq!(claims.claimed_bytes(), 200);
        claims.claim(300).expect("room again");
        drop(second);
    }

    #[test]
    fn racing_claims_never_pass_the_ceiling_together() {
        let claims = MemoryClaims::new();
        claims.observe(0, 1000, 100);
        let granted: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let claims = claims.clone();
                    scope.spawn(move || {
                        (0..100)
                            .filter_map(|_| claims.claim(7).ok())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("thread"))
                .collect()
        });
        assert_eq!(granted.len(), 1000 / 7);
        assert_eq!(claims.claimed_bytes(), 7 * (1000 / 7));
    }

    #[test]
    fn the_refusal_says_what_it_was_refused_against() {
        let text = ClaimRefused {
            bytes: 16 << 20,
            resident_bytes: 300 << 20,
            budgets_bytes: 100 << 20,
            claimed_bytes: 48 << 20,
            ceiling_bytes: 460 << 20,
            retry_after_ms: 2000,
        }
        .to_string();
        assert_eq!(
            text,
            "16.0 MiB more could take memory past its limit of 460.0 MiB (300.0 MiB resident, \
             100.0 MiB kept for unanswered publishes, unsent deliveries and reclaim, 48.0 MiB \
             claimed by connections, large frames and consumers)"
        );
    }
}
