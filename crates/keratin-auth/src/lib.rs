//! Keratin's access control, with no I/O of its own: the broker stores what this crate
//! decides and checks.
//!
//! - `password`: argon2id password hashes (PHC strings), checked when read back.
//! - `rules`: permissions (`publish`, `consume`, `manage`) on queue name patterns, and the
//!   `admin` flag; deny by default.
//! - `users`: the user table as a state machine of stored changes.
//! - `token`: API tokens for the HTTP API, stored as SHA-256 digests.
//! - `backoff`: failed logins per address slow that address.
//! - `gate`: the login gate, which bounds concurrent password verifications and their queue.
//! - `error`: what went wrong, and what to do.

mod backoff;
mod error;
mod gate;
mod password;
mod rules;
mod token;
mod users;

pub use backoff::{Backoff, BackoffConfig};
pub use error::{AuthError, AuthResult};
pub use gate::{GateConfig, LoginGate};
pub use password::{
    check_password, generate_password, PasswordDigest, DEFAULT_VERIFY_BYTES, MAX_LANES,
    MAX_MEMORY_KIB, MAX_PASSES, MAX_PASSWORD_BYTES,
};
pub use rules::{Grants, Pattern, Permission, Permissions, Rule, MAX_RULES};
pub use token::{ApiToken, TokenDigest};
pub use users::{
    check_user_name, Quota, User, UserChange, UserTable, MAX_TOKENS_PER_USER, MAX_USERS,
};
