//! The errors of access control: what was wrong, and what to do about it.

use std::time::Duration;

/// What went wrong in access control.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A user name, password, pattern or token that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// The user name or password is wrong (the two are not told apart).
    #[error("login failed: unknown user or wrong password")]
    LoginFailed,
    /// Too many failed logins from this address lately: it must wait before trying again.
    #[error("too many failed logins from this address: retry in {} ms", retry_after.as_millis())]
    TooManyFailures {
        /// How long until the next try is verified.
        retry_after: Duration,
    },
    /// Every password verification slot is taken and the queue for them is full (a login
    /// flood): the login is refused without a verification.
    #[error("the broker is verifying too many logins at once: retry in {} ms", retry_after.as_millis())]
    Busy {
        /// A hint for the retry.
        retry_after: Duration,
    },
    /// The operating system gave no random bytes.
    #[error("no random bytes from the operating system: {0}")]
    Random(String),
    /// Hashing or verifying could not run (a failed blocking task, a hasher error): a fault
    /// of the broker, not of the credentials.
    #[error("password hashing failed: {0}")]
    Hashing(String),
}

/// A result of access control.
pub type AuthResult<T> = Result<T, AuthError>;
