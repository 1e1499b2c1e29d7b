//! Failed logins per address: after a few free failures, each further try from the address
//! waits twice as long as the one before (capped), so a password guesser gets a handful of
//! tries a minute; a success or a quiet spell clears the address. The table is bounded: when
//! full, stale addresses go first, then the quietest.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How failed logins slow an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// Failures that cost nothing (typos).
    pub free_failures: u32,
    /// The wait after the first failure past the free ones; doubled by each further one.
    pub first_wait: Duration,
    /// The longest wait.
    pub max_wait: Duration,
    /// An address without a failure for this long starts afresh.
    pub forget_after: Duration,
    /// The most addresses remembered.
    pub max_addresses: usize,
}

impl Default for BackoffConfig {
    fn default() -> BackoffConfig {
        BackoffConfig {
            free_failures: 3,
            first_wait: Duration::from_millis(500),
            max_wait: Duration::from_secs(30),
            forget_after: Duration::from_secs(600),
            max_addresses: 65_536,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
}

/// See the module docs.
#[derive(Debug)]
pub struct Backoff {
    config: BackoffConfig,
    addresses: HashMap<IpAddr, Failures>,
}

impl Backoff {
    /// An empty table.
    pub fn new(config: BackoffConfig) -> Backoff {
        Backoff {
            config,
            addresses: HashMap::new(),
        }
    }

    /// How long `from` must still wait before its next try is verified (zero: go ahead).
    pub fn wait(&self, from: IpAddr, now: Instant) -> Duration {
        let Some(failures) = self.addresses.get(&from) else {
            return Duration::ZERO;
        };
        let Some(past_free) = failures.count.checked_sub(self.config.free_failures) else {
            return Duration::ZERO;
        };
        if past_free == 0 {
            return Duration::ZERO;
        }
        let doublings = (past_free - 1).min(31);
        let wait = self
            .config
            .first_wait
            .saturating_mul(1u32 << doublings)
            .min(self.config.max_wait);
        (failures.last + wait).saturating_duration_since(now)
    }

    /// A login from `from` failed.
    pub fn failed(&mut self, from: IpAddr, now: Instant) {
        if !self.addresses.contains_key(&from) && self.addresses.len() >= self.config.max_addresses
        {
            self.make_room(now);
        }
        let entry = self.addresses.entry(from).or_insert(Failures {
            count: 0,
            last: now,
        });
        if now.saturating_duration_since(entry.last) >= self.config.forget_after {
            entry.count = 0;
        }
        entry.count = entry.count.saturating_add(1);
        entry.last = now;
    }

    /// A login from `from` succeeded: it starts afresh.
    pub fn succeeded(&mut self, from: IpAddr) {
        self.addresses.remove(&from);
    }

    /// Addresses remembered.
    pub fn len(&self) -> usize {
        self.addresses.len()
    }

    /// True if none is.
    pub fn is_empty(&self) -> bool {
        self.addresses.is_empty()
    }

    /// Drop the stale addresses; if none was, the one quiet for longest.
    fn make_room(&mut self, now: Instant) {
        let forget_after = self.config.forget_after;
        self.addresses
            .retain(|_, f| now.saturating_duration_since(f.last) < forget_after);
        if self.addresses.len() < self.config.max_addresses {
            return;
        }
        if let Some(quietest) = self
            .addresses
            .iter()
            .min_by_key(|(_, f)| f.last)
            .map(|(address, _)| *address)
        {
            self.addresses.remove(&quietest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn failures_past_the_free_ones_double_the_wait_up_to_the_cap() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        let start = Instant::now();
        let mut now = start;
        for _ in 0..3 {
            backoff.failed(addr(1), now);
            assert_eq!(backoff.wait(addr(1), now), Duration::ZERO, "free failures");
        }
        let mut expected = Duration::from_millis(500);
        for _ in 0..10 {
            backoff.failed(addr(1), now);
            assert_eq!(
                backoff.wait(addr(1), now),
                expected.min(Duration::from_secs(30))
            );
            assert_eq!(
                backoff.wait(addr(2), now),
                Duration::ZERO,
                "another address"
            );
            now += expected.min(Duration::from_secs(30));
            assert_eq!(backoff.wait(addr(1), now), Duration::ZERO, "waited it out");
            expected *= 2;
        }
        backoff.succeeded(addr(1));
        assert!(backoff.is_empty());
    }

    #[test]
    fn a_quiet_address_starts_afresh() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        let now = Instant::now();
        for _ in 0..6 {
            backoff.failed(addr(1), now);
        }
        assert!(backoff.wait(addr(1), now) > Duration::ZERO);
        let later = now + Duration::from_secs(601);
        backoff.failed(addr(1), later);
        assert_eq!(
            backoff.wait(addr(1), later),
            Duration::ZERO,
            "one failure counted"
        );
    }

    #[test]
    fn the_table_stays_bounded_under_many_addresses() {
        let mut backoff = Backoff::new(BackoffConfig {
            max_addresses: 100,
            ..BackoffConfig::default()
        });
        let start = Instant::now();
        for i in 0..10_000u32 {
            let address = IpAddr::from(i.to_be_bytes());
            backoff.failed(address, start + Duration::from_millis(u64::from(i)));
            assert!(backoff.len() <= 100);
        }
        // The newest addresses are the ones kept.
        let newest = IpAddr::from(9_999u32.to_be_bytes());
        for _ in 0..4 {
            backoff.failed(newest, start + Duration::from_secs(10));
        }
        assert!(backoff.wait(newest, start + Duration::from_secs(10)) > Duration::ZERO);
    }
}
