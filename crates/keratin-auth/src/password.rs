//! Password hashes: argon2id PHC strings (`$argon2id$v=19$m=19456,t=2,p=1$salt$hash`), made
//! with argon2's default cost (19 MiB, 2 passes, 1 lane: OWASP's recommended minimum) and a
//! random 16-byte salt. A stored hash is checked when read: argon2id only, and a cost within
//! bounds, so that a damaged or foreign record can neither pass nor make a login allocate
//! gigabytes (verification uses the cost the hash names).

use argon2::password_hash::phc::PasswordHash;
use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use argon2::{Argon2, Params};

use crate::error::{AuthError, AuthResult};

/// The most memory a stored hash may ask a verification for: 64 MiB.
pub const MAX_MEMORY_KIB: u32 = 64 * 1024;
/// The most passes a stored hash may ask for.
pub const MAX_PASSES: u32 = 8;
/// The most lanes a stored hash may ask for.
pub const MAX_LANES: u32 = 4;
/// The longest password accepted: longer ones are refused before any hashing.
pub const MAX_PASSWORD_BYTES: usize = 1024;
/// The memory one verification at the default cost takes (argon2's default m_cost).
pub const DEFAULT_VERIFY_BYTES: u64 = Params::DEFAULT_M_COST as u64 * 1024;

/// An argon2id hash of a password, as stored. Its `Debug` shows no part of it.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PasswordDigest(String);

impl std::fmt::Debug for PasswordDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PasswordDigest(..)")
    }
}

impl PasswordDigest {
    /// Hash `password` at the default cost with a new random salt (blocking: ~19 MiB and tens
    /// of milliseconds; run it off the async workers).
    pub fn hash(password: &str) -> AuthResult<PasswordDigest> {
        check_password(password)?;
        let hash = Argon2::default()
            .hash_password(password.as_bytes())
            .map_err(|error| AuthError::Hashing(error.to_string()))?;
        Ok(PasswordDigest(hash.to_string()))
    }

    /// A stored hash, checked: an argon2id PHC string within the cost bounds.
    pub fn parse(phc: &str) -> Result<PasswordDigest, String> {
        let hash = PasswordHash::new(phc).map_err(|error| format!("not a PHC string: {error}"))?;
        if hash.algorithm.as_str() != "argon2id" {
            return Err(format!(
                "algorithm {:?}, expected argon2id",
                hash.algorithm.as_str()
            ));
        }
        let params = Params::try_from(&hash).map_err(|error| format!("parameters: {error}"))?;
        if params.m_cost() > MAX_MEMORY_KIB
            || params.t_cost() > MAX_PASSES
            || params.p_cost() > MAX_LANES
        {
            return Err(format!(
                "cost m={} KiB, t={}, p={} past the bounds ({MAX_MEMORY_KIB} KiB, {MAX_PASSES}, {MAX_LANES})",
                params.m_cost(),
                params.t_cost(),
                params.p_cost()
            ));
        }
        if hash.salt.is_none() || hash.hash.is_none() {
            return Err("no salt or no hash".into());
        }
        Ok(PasswordDigest(phc.to_owned()))
    }

    /// True if `password` is the one hashed (blocking, like [`PasswordDigest::hash`]).
    pub fn verify(&self, password: &str) -> bool {
        if password.len() > MAX_PASSWORD_BYTES {
            return false;
        }
        match PasswordHash::new(&self.0) {
            Ok(hash) => Argon2::default()
                .verify_password(password.as_bytes(), &hash)
                .is_ok(),
            Err(_) => false,
        }
    }

    /// The PHC string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for PasswordDigest {
    type Error = String;

    fn try_from(phc: String) -> Result<PasswordDigest, String> {
        PasswordDigest::parse(&phc)
    }
}

impl From<PasswordDigest> for String {
    fn from(digest: PasswordDigest) -> String {
        digest.0
    }
}

/// Check a new password: 8 to 1024 bytes.
pub fn check_password(password: &str) -> AuthResult<()> {
    if password.len() < 8 || password.len() > MAX_PASSWORD_BYTES {
        return Err(AuthError::Invalid(format!(
            "a password has 8 to {MAX_PASSWORD_BYTES} bytes (this one has {})",
            password.len()
        )));
    }
    Ok(())
}

/// A new random password: 24 characters of letters and digits (about 143 bits).
pub fn generate_password() -> AuthResult<String> {
    const ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789";
    let mut out = String::with_capacity(24);
    while out.len() < 24 {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|error| AuthError::Random(error.to_string()))?;
        // Rejection sampling keeps every character equally likely.
        let limit = 256 - 256 % ALPHABET.len();
        for byte in bytes {
            if (byte as usize) < limit && out.len() < 24 {
                out.push(ALPHABET[byte as usize % ALPHABET.len()] as char);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_verifies_its_password_only() {
        let digest = PasswordDigest::hash("correct horse").expect("hashed");
        assert!(digest
            .as_str()
            .starts_with("$argon2id$v=19$m=19456,t=2,p=1$"));
        assert!(digest.verify("correct horse"));
        assert!(!digest.verify("correct horsE"));
        assert!(!digest.verify(""));
        let again = PasswordDigest::hash("correct horse").expect("hashed");
        assert_ne!(digest, again, "a new salt each time");
        assert_eq!(format!("{digest:?}"), "PasswordDigest(..)");
    }

    #[test]
    fn a_stored_hash_round_trips_through_json() {
        let digest = PasswordDigest::hash("correct horse").expect("hashed");
        let json = serde_json::to_string(&digest).expect("json");
        let back: PasswordDigest = serde_json::from_str(&json).expect("parsed");
        assert!(back.verify("correct horse"));
    }

    #[test]
    fn stored_hashes_that_cannot_be_trusted_are_refused() {
        // Another algorithm, a cost past the bounds (1 GiB), no hash, not PHC.
        let argon2i = "$argon2i$v=19$m=19456,t=2,p=1$c29tZXNhbHRzb21lc2FsdA$\
                       ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGk";
        assert!(PasswordDigest::parse(argon2i)
            .unwrap_err()
            .contains("argon2id"));
        let huge = "$argon2id$v=19$m=1048576,t=2,p=1$c29tZXNhbHRzb21lc2FsdA$\
                    ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGk";
        assert!(PasswordDigest::parse(huge).unwrap_err().contains("bounds"));
        let bare = "$argon2id$v=19$m=19456,t=2,p=1$c29tZXNhbHRzb21lc2FsdA";
        assert!(PasswordDigest::parse(bare).is_err());
        assert!(PasswordDigest::parse("hunter2").is_err());
        assert!(serde_json::from_str::<PasswordDigest>("\"hunter2\"").is_err());
    }

    #[test]
    fn passwords_too_short_or_too_long_are_refused_before_hashing() {
        assert!(PasswordDigest::hash("short").is_err());
        assert!(PasswordDigest::hash(&"x".repeat(MAX_PASSWORD_BYTES + 1)).is_err());
        let digest = PasswordDigest::hash("long enough").expect("hashed");
        assert!(!digest.verify(&"x".repeat(MAX_PASSWORD_BYTES + 1)));
    }

    #[test]
    fn generated_passwords_are_long_random_and_accepted() {
        let a = generate_password().expect("random");
        let b = generate_password().expect("random");
        assert_eq!(a.len(), 24);
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_alphanumeric()));
        check_password(&a).expect("a generated password passes the rules");
    }
}
