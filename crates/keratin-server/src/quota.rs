//! Publish quotas per user on this node (issue 16; the seed's open question): token buckets of
//! bytes and messages per second, each holding one second of its rate. A publish that finds
//! enough tokens goes at once; one whose deficit clears within [`MAX_QUOTA_DELAY`] is delayed
//! by it, like soft slowing (the connection reads nothing meanwhile, so the client feels it as
//! back-pressure); a longer deficit is refused with `ERR_LIMITED` reason `quota` and the time
//! it needs as `retry_after_ms` (Kafka's `throttle_time_ms` idea). Consuming and acknowledging
//! are never counted.
//!
//! The buckets are in memory: a restart refills them. Bounded by the users (at most
//! `keratin_auth::MAX_USERS`); a user whose quota changes gets a full bucket of the new rates.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keratin_auth::Quota;

/// The longest delay a quota imposes before it refuses instead.
pub const MAX_QUOTA_DELAY: Duration = Duration::from_millis(500);

/// What a quota says about one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Go now.
    Now,
    /// Go after this delay (the tokens are taken).
    After(Duration),
    /// Refused; enough tokens will be there after this long (nothing is taken).
    Refused(Duration),
}

/// One user's buckets.
#[derive(Debug, Clone)]
struct Bucket {
    quota: Quota,
    bytes: f64,
    messages: f64,
    refilled: Instant,
}

/// What quotas did to one user's publishes on this node, since the node started (metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QuotaFigures {
    /// Publishes delayed.
    pub delayed: u64,
    /// Publishes refused (`ERR_LIMITED` reason `quota`).
    pub refused: u64,
    /// Seconds of delay imposed, summed.
    pub delay_s: f64,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Quotas {
    buckets: Mutex<HashMap<Arc<str>, Bucket>>,
    figures: Mutex<HashMap<Arc<str>, QuotaFigures>>,
}

impl Quotas {
    /// Decide a publish of `messages` messages of `bytes` body bytes by `user` under `quota`.
    pub fn admit(
        &self,
        user: &Arc<str>,
        quota: Quota,
        messages: u64,
        bytes: u64,
        now: Instant,
    ) -> Admission {
        if quota.is_unlimited() {
            return Admission::Now;
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let bucket = buckets.entry(user.clone()).or_insert_with(|| Bucket {
            quota,
            bytes: quota.bytes_per_s.unwrap_or(0) as f64,
            messages: quota.messages_per_s.unwrap_or(0) as f64,
            refilled: now,
        });
        if bucket.quota != quota {
            *bucket = Bucket {
                quota,
                bytes: quota.bytes_per_s.unwrap_or(0) as f64,
                messages: quota.messages_per_s.unwrap_or(0) as f64,
                refilled: now,
            };
        }
        let elapsed = now.saturating_duration_since(bucket.refilled).as_secs_f64();
        bucket.refilled = now;
        let mut wait = 0.0f64;
        if let Some(rate) = quota.bytes_per_s {
            let rate = rate as f64;
            bucket.bytes = (bucket.bytes + rate * elapsed).min(rate);
            wait = wait.max(deficit_s(bucket.bytes, bytes as f64, rate));
        }
        if let Some(rate) = quota.messages_per_s {
            let rate = rate as f64;
            bucket.messages = (bucket.messages + rate * elapsed).min(rate);
            wait = wait.max(deficit_s(bucket.messages, messages as f64, rate));
        }
        let wait = Duration::from_secs_f64(wait);
        if wait > MAX_QUOTA_DELAY {
            return Admission::Refused(wait);
        }
        // Taken in full (the bucket may go below zero for a batch larger than a second's
        // worth): the rate holds on average.
        if quota.bytes_per_s.is_some() {
            bucket.bytes -= bytes as f64;
        }
        if quota.messages_per_s.is_some() {
            bucket.messages -= messages as f64;
        }
        if wait.is_zero() {
            Admission::Now
        } else {
            Admission::After(wait)
        }
    }

    /// Decide a publish as [`Quotas::admit`] does, and count the decision in the user's
    /// figures.
    pub fn admit_counted(
        &self,
        user: &Arc<str>,
        quota: Quota,
        messages: u64,
        bytes: u64,
    ) -> Admission {
        let admission = self.admit(user, quota, messages, bytes, Instant::now());
        if admission != Admission::Now {
            let mut figures = self.figures.lock().unwrap_or_else(|e| e.into_inner());
            let entry = figures.entry(user.clone()).or_default();
            match admission {
                Admission::After(delay) => {
                    entry.delayed += 1;
                    entry.delay_s += delay.as_secs_f64();
                }
                Admission::Refused(_) => entry.refused += 1,
                Admission::Now => {}
            }
        }
        admission
    }

    /// Every user's figures, by name.
    pub fn figures(&self) -> Vec<(Arc<str>, QuotaFigures)> {
        let figures = self.figures.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<_> = figures.iter().map(|(u, f)| (u.clone(), *f)).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Forget the buckets and figures of users no longer in `keep` (deleted users).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.buckets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|user, _| keep(user));
        self.figures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|user, _| keep(user));
    }
}

/// Seconds until `tokens` reach `need` at `rate` per second; a need over one second's worth
/// (the bucket's size) waits only for a full bucket, or it could never go.
fn deficit_s(tokens: f64, need: f64, rate: f64) -> f64 {
    let need = need.min(rate);
    if tokens >= need {
        0.0
    } else {
        (need - tokens) / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(messages: u64) -> Quota {
        Quota {
            bytes_per_s: None,
            messages_per_s: Some(messages),
        }
    }

    #[test]
    fn a_bucket_admits_its_rate_delays_a_short_deficit_and_refuses_a_long_one() {
        let quotas = Quotas::default();
        let user: Arc<str> = "app".into();
        let start = Instant::now();
        // A full bucket: one second's worth goes at once.
        assert_eq!(
            quotas.admit(&user, quota(100), 100, 0, start),
            Admission::Now
        );
        // Empty: 10 more need 100 ms, a delay.
        let Admission::After(delay) = quotas.admit(&user, quota(100), 10, 0, start) else {
            panic!("a short deficit is a delay");
        };
        assert!((delay.as_millis() as i64 - 100).abs() <= 2, "{delay:?}");
        // Now 10 below zero: 60 more need 700 ms, refused, nothing taken.
        let Admission::Refused(wait) = quotas.admit(&user, quota(100), 60, 0, start) else {
            panic!("a long deficit is refused");
        };
        assert!((wait.as_millis() as i64 - 700).abs() <= 2, "{wait:?}");
        // After that wait the same publish goes.
        let later = start + wait;
        assert!(matches!(
            quotas.admit(&user, quota(100), 60, 0, later),
            Admission::Now | Admission::After(_)
        ));
        // Other users and unlimited users are not affected.
        let other: Arc<str> = "other".into();
        assert_eq!(
            quotas.admit(&other, quota(100), 100, 0, start),
            Admission::Now
        );
        assert_eq!(
            quotas.admit(&other, Quota::default(), 1_000_000, 1 << 30, start),
            Admission::Now
        );
    }

    #[test]
    fn over_a_long_run_the_admitted_rate_is_the_quota() {
        // Publishes of 7 messages offered every 5 ms (1,400/s) against 500/s, for 20 s of
        // simulated time; refused ones retry after their hint.
        let quotas = Quotas::default();
        let user: Arc<str> = "app".into();
        let start = Instant::now();
        let mut now = start;
        let mut admitted = 0u64;
        let end = start + Duration::from_secs(20);
        while now < end {
            match quotas.admit(&user, quota(500), 7, 0, now) {
                Admission::Now => {
                    admitted += 7;
                    now += Duration::from_millis(5);
                }
                Admission::After(delay) => {
                    admitted += 7;
                    now += delay.max(Duration::from_millis(5));
                }
                Admission::Refused(wait) => now += wait,
            }
        }
        // Less the full bucket the user starts with (one second's worth, a burst).
        let rate = (admitted - 500) as f64 / 20.0;
        assert!((rate - 500.0).abs() / 500.0 < 0.02, "{rate}/s");
    }

    #[test]
    fn a_batch_larger_than_a_second_still_goes_and_the_average_holds() {
        let quotas = Quotas::default();
        let user: Arc<str> = "app".into();
        let limit = Quota {
            bytes_per_s: Some(1_000),
            messages_per_s: None,
        };
        let start = Instant::now();
        assert_eq!(quotas.admit(&user, limit, 1, 3_000, start), Admission::Now);
        // 2,000 below zero: the next byte waits about 2 s, refused.
        let Admission::Refused(wait) = quotas.admit(&user, limit, 1, 1, start) else {
            panic!("the debt is paid first");
        };
        assert!(wait >= Duration::from_millis(1_990), "{wait:?}");
    }
}
