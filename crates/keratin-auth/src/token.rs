//! API tokens for the HTTP admin API: 256 random bits shown once as `kt_` and 64 hex digits,
//! stored as their SHA-256 digest. A presented token is digested and looked up by digest; the
//! stored digest never gives the token back.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::{AuthError, AuthResult};

const PREFIX: &str = "kt_";

/// A token as shown to its owner, once. Its `Debug` hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(..)")
    }
}

impl ApiToken {
    /// A new random token.
    pub fn generate() -> AuthResult<ApiToken> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|error| AuthError::Random(error.to_string()))?;
        Ok(ApiToken(format!("{PREFIX}{}", hex(&bytes))))
    }

    /// The token's text, to show once.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// Its digest, to store.
    pub fn digest(&self) -> TokenDigest {
        TokenDigest::of(&self.0)
    }
}

/// The SHA-256 digest of a token, as stored (64 hex digits in JSON).
/// Equality is plain (digests are map keys); [`TokenDigest::matches`] is the check in constant
/// time.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    /// The digest of a presented token's text (any text: a wrong one simply matches nothing).
    pub fn of(token: &str) -> TokenDigest {
        TokenDigest(Sha256::digest(token.as_bytes()).into())
    }

    /// True if `token` is the token digested, compared in constant time.
    pub fn matches(&self, token: &str) -> bool {
        TokenDigest::of(token).0.ct_eq(&self.0).into()
    }

    /// True if both are the same digest, compared in constant time.
    pub fn same_as(&self, other: &TokenDigest) -> bool {
        self.0.ct_eq(&other.0).into()
    }

    /// True if `text` looks like a token (the prefix and 64 hex digits): a cheap check
    /// before a lookup.
    pub fn looks_like_token(text: &str) -> bool {
        text.strip_prefix(PREFIX)
            .is_some_and(|rest| rest.len() == 64 && rest.bytes().all(|b| b.is_ascii_hexdigit()))
    }
}

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenDigest({}..)", &hex(&self.0)[..8])
    }
}

impl serde::Serialize for TokenDigest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&hex(&self.0))
    }
}

impl<'de> serde::Deserialize<'de> for TokenDigest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text: String = serde::Deserialize::deserialize(deserializer)?;
        let bytes = unhex(&text)
            .ok_or_else(|| serde::de::Error::custom("a token digest is 64 hex digits (SHA-256)"))?;
        Ok(TokenDigest(bytes))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_its_digest_only() {
        let token = ApiToken::generate().expect("random");
        assert!(TokenDigest::looks_like_token(token.reveal()));
        assert!(!TokenDigest::looks_like_token("kt_short"));
        assert!(!TokenDigest::looks_like_token("Basic abc"));
        let digest = token.digest();
        assert!(digest.matches(token.reveal()));
        let other = ApiToken::generate().expect("random");
        assert!(!digest.matches(other.reveal()));
        assert_ne!(digest, other.digest());
        assert_eq!(format!("{token:?}"), "ApiToken(..)");
        assert!(!format!("{digest:?}").contains(&token.reveal()[3..]));
    }

    #[test]
    fn digests_round_trip_through_json_and_bad_ones_are_refused() {
        let digest = ApiToken::generate().expect("random").digest();
        let json = serde_json::to_string(&digest).expect("json");
        assert_eq!(json.len(), 66);
        let back: TokenDigest = serde_json::from_str(&json).expect("parsed");
        assert_eq!(back, digest);
        assert!(serde_json::from_str::<TokenDigest>("\"abc\"").is_err());
        assert!(serde_json::from_str::<TokenDigest>(&format!("\"{}\"", "g".repeat(64))).is_err());
        assert!(serde_json::from_str::<TokenDigest>(&format!("\"{}\"", "é".repeat(32))).is_err());
    }
}
