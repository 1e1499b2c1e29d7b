//! The error body that travels in `Error` and `PublishError` frames and in a refused handshake.
//!
//! Owns the invariant that `ERR_LIMITED` always carries a reason and a retry hint. The numbers and
//! their retry classes belong to [`crate::codes`]; the byte layout to `docs/protocol.md`
//! ("Error body").

use std::fmt;

use crate::codes::{Code, LimitReason, ERR_LIMITED, ERR_NOT_LEADER};
use crate::error::ProtoError;

/// A wire error: a stable [`Code`], an optional [`LimitReason`], an optional retry hint and a
/// message for humans. `Display` always includes the message, so a client that does not know the
/// code still shows what happened.
///
/// The fields are private so that the `ERR_LIMITED` invariant holds for every value: build one with
/// [`ErrorBody::new`], [`ErrorBody::limited`] or [`ErrorBody::from_parts`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorBody {
    code: Code,
    reason: Option<LimitReason>,
    retry_after_ms: Option<u32>,
    message: String,
    leader_addr: Option<String>,
}

impl ErrorBody {
    /// An error without reason or retry hint.
    ///
    /// # Panics
    /// If `code` is [`ERR_LIMITED`]: that code must carry a reason and a hint, so use
    /// [`ErrorBody::limited`]. Passing it here is a bug in the caller, not bad input.
    pub fn new(code: Code, message: impl Into<String>) -> ErrorBody {
        assert!(
            code != ERR_LIMITED,
            "ERR_LIMITED needs a reason and retry_after_ms: use ErrorBody::limited"
        );
        ErrorBody {
            code,
            reason: None,
            retry_after_ms: None,
            message: message.into(),
            leader_addr: None,
        }
    }

    /// An `ERR_NOT_LEADER` (421) error naming the leader's protocol address (`host:port`) when
    /// it is known. Nothing of the request was applied; the client sends it again there.
    pub fn not_leader(leader_addr: Option<String>, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            code: ERR_NOT_LEADER,
            reason: None,
            retry_after_ms: None,
            message: message.into(),
            leader_addr,
        }
    }

    /// An `ERR_LIMITED` (429) error. Retrying the refused publish after `retry_after_ms` is always
    /// safe, because nothing of it was applied.
    pub fn limited(
        reason: LimitReason,
        retry_after_ms: u32,
        message: impl Into<String>,
    ) -> ErrorBody {
        ErrorBody {
            code: ERR_LIMITED,
            reason: Some(reason),
            retry_after_ms: Some(retry_after_ms),
            message: message.into(),
            leader_addr: None,
        }
    }

    /// Builds a body from decoded parts, rejecting an `ERR_LIMITED` without reason or hint.
    pub fn from_parts(
        code: Code,
        reason: Option<LimitReason>,
        retry_after_ms: Option<u32>,
        message: String,
    ) -> Result<ErrorBody, ProtoError> {
        if code == ERR_LIMITED && (reason.is_none() || retry_after_ms.is_none()) {
            return Err(ProtoError::InvalidValue {
                field: "error.code",
                reason: "ERR_LIMITED without reason or retry_after_ms",
            });
        }
        Ok(ErrorBody {
            code,
            reason,
            retry_after_ms,
            message,
            leader_addr: None,
        })
    }

    /// Adds the leader's protocol address (`host:port`), sent in protocol version 4 and later.
    pub fn with_leader_addr(mut self, leader_addr: Option<String>) -> ErrorBody {
        self.leader_addr = leader_addr;
        self
    }

    /// The leader's protocol address (`host:port`) an `ERR_NOT_LEADER` names, if known.
    pub fn leader_addr(&self) -> Option<&str> {
        self.leader_addr.as_deref()
    }

    /// Adds a retry hint, for example to a 503 while a log heals.
    pub fn with_retry_after_ms(mut self, retry_after_ms: u32) -> ErrorBody {
        self.retry_after_ms = Some(retry_after_ms);
        self
    }

    /// The stable code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// Why the request was limited; always `Some` for `ERR_LIMITED`.
    pub fn reason(&self) -> Option<&LimitReason> {
        self.reason.as_ref()
    }

    /// How long to wait before retrying; always `Some` for `ERR_LIMITED`.
    pub fn retry_after_ms(&self) -> Option<u32> {
        self.retry_after_ms
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.code)?;
        if let Some(reason) = &self.reason {
            write!(f, " ({reason})")?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(retry_after_ms) = self.retry_after_ms {
            write!(f, " [retry after {retry_after_ms} ms]")?;
        }
        if let Some(leader_addr) = &self.leader_addr {
            write!(f, " [leader at {leader_addr}]")?;
        }
        Ok(())
    }
}

impl std::error::Error for ErrorBody {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::{Code, ERR_NOT_FOUND};

    #[test]
    fn display_always_shows_the_message_even_for_unknown_codes() {
        let body = ErrorBody::new(Code(599), "the frobnicator is out of frobs");
        assert_eq!(body.to_string(), "599: the frobnicator is out of frobs");
        let body = ErrorBody::new(ERR_NOT_FOUND, "queue orders does not exist");
        assert_eq!(
            body.to_string(),
            "404 ERR_NOT_FOUND: queue orders does not exist"
        );
    }

    #[test]
    fn limited_carries_reason_and_hint() {
        let body = ErrorBody::limited(LimitReason::QueueFull, 250, "queue orders is full");
        assert_eq!(
            body.to_string(),
            "429 ERR_LIMITED (queue_full): queue orders is full [retry after 250 ms]"
        );
        assert_eq!(body.reason(), Some(&LimitReason::QueueFull));
        assert_eq!(body.retry_after_ms(), Some(250));
    }

    #[test]
    fn from_parts_refuses_limited_without_hint() {
        let result = ErrorBody::from_parts(ERR_LIMITED, Some(LimitReason::Disk), None, "x".into());
        assert!(matches!(result, Err(ProtoError::InvalidValue { .. })));
        let result = ErrorBody::from_parts(ERR_LIMITED, None, Some(5), "x".into());
        assert!(result.is_err());
    }

    #[test]
    fn not_leader_names_the_leader() {
        let body = ErrorBody::not_leader(Some("h:1".into()), "partition 0 of q is led elsewhere");
        assert_eq!(body.code(), ERR_NOT_LEADER);
        assert_eq!(body.leader_addr(), Some("h:1"));
        assert_eq!(
            body.to_string(),
            "421 ERR_NOT_LEADER: partition 0 of q is led elsewhere [leader at h:1]"
        );
    }

    #[test]
    #[should_panic(expected = "ERR_LIMITED needs a reason")]
    fn new_refuses_limited() {
        let _ = ErrorBody::new(ERR_LIMITED, "x");
    }
}
