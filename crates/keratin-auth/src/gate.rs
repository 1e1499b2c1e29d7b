//! The login gate: every password login passes here. An argon2id verification takes ~19 MiB
//! and tens of milliseconds of a core, so a login flood must neither run them all at once
//! (memory) nor queue them without end (memory and time), nor let one address guess fast:
//! - at most `concurrent` verifications run at once, on the blocking pool;
//! - at most `max_waiting` logins wait for one; past that a login is refused at once
//!   ([`AuthError::Busy`]), with no verification;
//! - an address with repeated failures waits before its next try is verified
//!   ([`AuthError::TooManyFailures`], see `backoff.rs`);
//! - an unknown user costs the same verification as a known one (against a stand-in hash), so
//!   the answer's timing tells no names apart.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::backoff::{Backoff, BackoffConfig};
use crate::error::{AuthError, AuthResult};
use crate::password::{generate_password, PasswordDigest};

/// How the gate bounds logins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateConfig {
    /// Verifications at once.
    pub concurrent: usize,
    /// Logins waiting for a verification slot, at most.
    pub max_waiting: usize,
    /// The retry hint of a login refused because too many wait.
    pub busy_retry: Duration,
    /// How failures slow an address.
    pub backoff: BackoffConfig,
}

impl Default for GateConfig {
    fn default() -> GateConfig {
        GateConfig {
            concurrent: 2,
            max_waiting: 64,
            busy_retry: Duration::from_secs(1),
            backoff: BackoffConfig::default(),
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct LoginGate {
    config: GateConfig,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    backoff: Mutex<Backoff>,
    /// Verified against for unknown users (made on first need).
    stand_in: Arc<OnceLock<PasswordDigest>>,
}

/// Gives back a waiting place when dropped (also when the login's future is dropped).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl LoginGate {
    /// A gate.
    pub fn new(config: GateConfig) -> LoginGate {
        assert!(
            config.concurrent > 0,
            "a gate verifies at least one login at once"
        );
        LoginGate {
            slots: Arc::new(Semaphore::new(config.concurrent)),
            waiting: AtomicUsize::new(0),
            backoff: Mutex::new(Backoff::new(config.backoff)),
            stand_in: Arc::new(OnceLock::new()),
            config,
        }
    }

    /// Verify `password` from `from` against `digest` (`None`: an unknown user, refused after a
    /// verification like any other). Ok once verified; the errors say why not.
    pub async fn verify(
        &self,
        from: IpAddr,
        digest: Option<&PasswordDigest>,
        password: &str,
    ) -> AuthResult<()> {
        let wait = self.backoff().wait(from, Instant::now());
        if !wait.is_zero() {
            return Err(AuthError::TooManyFailures { retry_after: wait });
        }
        // Take a place only below the bound: a login refused as busy never counts, so the
        // count is exactly the logins waiting for or in a verification.
        let bound = self.config.max_waiting + self.config.concurrent;
        if self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .is_err()
        {
            return Err(AuthError::Busy {
                retry_after: self.config.busy_retry,
            });
        }
        let _waiting = Waiting(&self.waiting);
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| AuthError::Busy {
                retry_after: self.config.busy_retry,
            })?;
        let digest = digest.cloned();
        let stand_in = self.stand_in.clone();
        let password = password.to_owned();
        let verified = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            match digest {
                Some(digest) => Ok(digest.verify(&password)),
                None => {
                    let stand_in = match stand_in.get() {
                        Some(d) => d.clone(),
                        None => {
                            let made = PasswordDigest::hash(&generate_password()?)?;
                            stand_in.get_or_init(|| made).clone()
                        }
                    };
                    let _ = stand_in.verify(&password);
                    Ok(false)
                }
            }
        })
        .await
        .map_err(|error| AuthError::Hashing(format!("the verification task failed: {error}")))??;
        let mut backoff = self.backoff();
        if verified {
            backoff.succeeded(from);
            Ok(())
        } else {
            backoff.failed(from, Instant::now());
            Err(AuthError::LoginFailed)
        }
    }

    /// Logins waiting for or in a verification now.
    pub fn in_flight(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    fn backoff(&self) -> std::sync::MutexGuard<'_, Backoff> {
        // A panic while holding it leaves only counters behind: keep using them.
        self.backoff
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest() -> PasswordDigest {
        static DIGEST: OnceLock<PasswordDigest> = OnceLock::new();
        DIGEST
            .get_or_init(|| PasswordDigest::hash("password1").expect("hashed"))
            .clone()
    }

    fn addr(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn right_and_wrong_passwords_and_unknown_users() {
        let gate = LoginGate::new(GateConfig::default());
        let d = digest();
        gate.verify(addr(1), Some(&d), "password1")
            .await
            .expect("the right one");
        assert_eq!(
            gate.verify(addr(1), Some(&d), "password2").await,
            Err(AuthError::LoginFailed)
        );
        assert_eq!(
            gate.verify(addr(1), None, "password1").await,
            Err(AuthError::LoginFailed),
            "an unknown user is refused like a wrong password"
        );
        assert_eq!(gate.in_flight(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn repeated_failures_slow_their_address_only() {
        let gate = LoginGate::new(GateConfig::default());
        let d = digest();
        for _ in 0..4 {
            assert_eq!(
                gate.verify(addr(1), Some(&d), "wrong-one").await,
                Err(AuthError::LoginFailed)
            );
        }
        match gate.verify(addr(1), Some(&d), "password1").await {
            Err(AuthError::TooManyFailures { retry_after }) => {
                assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_millis(500));
            }
            other => panic!("expected a wait, got {other:?}"),
        }
        gate.verify(addr(2), Some(&d), "password1")
            .await
            .expect("another address logs in");
    }

    /// A flood: 300 logins at once with two verification slots and 16 waiting places. Most
    /// are refused at once as busy; no more than two verify at a time; the rest verify.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_is_bounded_by_slots_and_waiting_places() {
        let gate = Arc::new(LoginGate::new(GateConfig {
            concurrent: 2,
            max_waiting: 16,
            backoff: BackoffConfig {
                free_failures: u32::MAX,
                ..BackoffConfig::default()
            },
            ..GateConfig::default()
        }));
        let d = digest();
        let mut logins = tokio::task::JoinSet::new();
        for i in 0..300u32 {
            let (gate, d) = (gate.clone(), d.clone());
            logins.spawn(async move {
                let from = IpAddr::from((0x7f00_0000 + i).to_be_bytes());
                gate.verify(from, Some(&d), "wrong-one").await
            });
        }
        let (mut busy, mut failed, mut peak) = (0, 0, 0);
        while let Some(outcome) = logins.join_next().await {
            peak = peak.max(gate.in_flight());
            match outcome.expect("joined") {
                Err(AuthError::Busy { .. }) => busy += 1,
                Err(AuthError::LoginFailed) => failed += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(busy + failed, 300);
        assert!(
            failed >= 18,
            "the slots and the waiting places were used: {failed}"
        );
        assert!(busy > 0, "the flood was cut short");
        assert!(
            peak <= 18,
            "at most slots + waiting places in flight: {peak}"
        );
        assert_eq!(gate.in_flight(), 0);
        assert_eq!(gate.slots.available_permits(), 2);
    }
}
