//! Stable wire error codes and limit reasons.
//!
//! Owns the numbers that travel in an error body and what each one promises about retrying. The
//! numbers follow HTTP so that operators recognise them; the table with meanings is in
//! `docs/protocol.md` ("Error codes"). How an error body is laid out on the wire belongs to
//! [`crate::error_body`].
//!
//! A code, once published, keeps its meaning forever. A retired code is never reused: add it to
//! [`RETIRED`] and pick a new number instead.

use std::fmt;

/// A wire error code. Any `u16` decodes, so a client can carry (and show) codes newer than itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Code(pub u16);

/// 400: the request or frame is malformed or names an invalid value. Never retry unchanged.
pub const ERR_BAD_REQUEST: Code = Code(400);
/// 401: the connection has not authenticated. Never retry unchanged.
pub const ERR_UNAUTHENTICATED: Code = Code(401);
/// 403: the connection may not do this. Never retry unchanged.
pub const ERR_FORBIDDEN: Code = Code(403);
/// 404: the queue (or consumer tag, or delivery) does not exist.
pub const ERR_NOT_FOUND: Code = Code(404);
/// 409: the request conflicts with current state, for example a declare with other settings.
pub const ERR_CONFLICT: Code = Code(409);
/// 413: a frame, message or batch is larger than the receiver's limit.
pub const ERR_TOO_LARGE: Code = Code(413);
/// 421: this node does not lead the partition (or the cluster's metadata) the request needs;
/// **not applied**. The error body's `leader_addr` names the leader's protocol address when
/// known; otherwise retry after a short backoff on any node.
pub const ERR_NOT_LEADER: Code = Code(421);
/// 429: the publish was refused by a resource or queue limit and **not applied**. Always carries a
/// [`LimitReason`] and `retry_after_ms`; retrying after that delay is always safe.
pub const ERR_LIMITED: Code = Code(429);
/// 500: a bug or unexpected state in the server. The message says what happened.
pub const ERR_INTERNAL: Code = Code(500);
/// 503: the service (for example a stopped log) cannot take the request now. The request was
/// **not applied**; retry with backoff.
pub const ERR_UNAVAILABLE: Code = Code(503);
/// 504: the server could not learn whether the request was applied (for example a sync failed
/// after the records were written). Retrying may apply it twice.
pub const ERR_GATEWAY_TIMEOUT: Code = Code(504);

/// Every code this version of the protocol defines, in numeric order.
pub const KNOWN: [Code; 11] = [
    ERR_BAD_REQUEST,
    ERR_UNAUTHENTICATED,
    ERR_FORBIDDEN,
    ERR_NOT_FOUND,
    ERR_CONFLICT,
    ERR_TOO_LARGE,
    ERR_NOT_LEADER,
    ERR_LIMITED,
    ERR_INTERNAL,
    ERR_UNAVAILABLE,
    ERR_GATEWAY_TIMEOUT,
];

/// Codes that were once used and must never be given a new meaning. Empty in version 1.
pub const RETIRED: [Code; 0] = [];

/// What a client may do after receiving an error with a given code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Retrying the same request cannot succeed (400, 401, 403, 404, 409, 413, 500, unknown codes).
    Never,
    /// The request was not applied; retry after the error's `retry_after_ms` (429).
    AfterHint,
    /// The request was not applied; retry with the client's own backoff (503).
    Backoff,
    /// The request was not applied; send it again to the leader the error names (its
    /// `leader_addr`), or with backoff to any node when none is named (421).
    AtLeader,
    /// The request may or may not have been applied (504). Retrying a publish may duplicate it.
    OutcomeUnknown,
}

impl Code {
    /// The stable symbolic name (`ERR_LIMITED`), or `None` for a code this version does not know.
    pub fn name(self) -> Option<&'static str> {
        let name = match self {
            ERR_BAD_REQUEST => "ERR_BAD_REQUEST",
            ERR_UNAUTHENTICATED => "ERR_UNAUTHENTICATED",
            ERR_FORBIDDEN => "ERR_FORBIDDEN",
            ERR_NOT_FOUND => "ERR_NOT_FOUND",
            ERR_CONFLICT => "ERR_CONFLICT",
            ERR_TOO_LARGE => "ERR_TOO_LARGE",
            ERR_NOT_LEADER => "ERR_NOT_LEADER",
            ERR_LIMITED => "ERR_LIMITED",
            ERR_INTERNAL => "ERR_INTERNAL",
            ERR_UNAVAILABLE => "ERR_UNAVAILABLE",
            ERR_GATEWAY_TIMEOUT => "ERR_GATEWAY_TIMEOUT",
            _ => return None,
        };
        Some(name)
    }

    /// Whether this version of the protocol defines the code.
    pub fn is_known(self) -> bool {
        self.name().is_some()
    }

    /// What a client may do after this error. Unknown codes are [`Retry::Never`]: a client must
    /// not guess that a request it cannot classify is safe to repeat.
    pub fn retry(self) -> Retry {
        match self {
            ERR_LIMITED => Retry::AfterHint,
            ERR_UNAVAILABLE => Retry::Backoff,
            ERR_NOT_LEADER => Retry::AtLeader,
            ERR_GATEWAY_TIMEOUT => Retry::OutcomeUnknown,
            _ => Retry::Never,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{} {name}", self.0),
            None => write!(f, "{}", self.0),
        }
    }
}

/// Why a publish was limited. Travels as a string so that a client keeps (and shows) reasons that
/// a newer server adds; see [`LimitReason::Unknown`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LimitReason {
    /// A filesystem holding the partition (on any in-sync replica) is at or past its hard level.
    Disk,
    /// The node's resident memory is at or past its hard level.
    Memory,
    /// The queue reached its `max_messages` or `max_bytes` with overflow `reject`.
    QueueFull,
    /// The node holds `server.connections_max` connections (a refused handshake).
    Connections,
    /// The node holds `server.consumers_max` consumers (a refused subscribe).
    Consumers,
    /// The publishing user is past its publish quota on this node (bytes or messages per
    /// second; added without a version change: older clients see `Unknown("quota")`).
    Quota,
    /// A reason this version does not know, kept verbatim. Never holds one of the known names:
    /// [`LimitReason::from_name`] maps those to their variants.
    Unknown(String),
}

impl LimitReason {
    /// The stable wire name: `disk`, `memory`, `queue_full`, `connections`, `consumers`,
    /// `quota`, or the unknown name verbatim.
    pub fn name(&self) -> &str {
        match self {
            LimitReason::Disk => "disk",
            LimitReason::Memory => "memory",
            LimitReason::QueueFull => "queue_full",
            LimitReason::Connections => "connections",
            LimitReason::Consumers => "consumers",
            LimitReason::Quota => "quota",
            LimitReason::Unknown(name) => name,
        }
    }

    /// Parses a wire name. Never fails: names this version does not know become `Unknown`.
    pub fn from_name(name: &str) -> LimitReason {
        match name {
            "disk" => LimitReason::Disk,
            "memory" => LimitReason::Memory,
            "queue_full" => LimitReason::QueueFull,
            "connections" => LimitReason::Connections,
            "consumers" => LimitReason::Consumers,
            "quota" => LimitReason::Quota,
            other => LimitReason::Unknown(other.to_owned()),
        }
    }
}

impl fmt::Display for LimitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_are_sorted_unique_and_never_retired() {
        assert!(KNOWN.windows(2).all(|pair| pair[0] < pair[1]));
        assert!(KNOWN.iter().all(|code| !RETIRED.contains(code)));
        assert!(KNOWN.iter().all(|code| code.is_known()));
    }

    #[test]
    fn retry_classes_match_the_design() {
        assert_eq!(ERR_LIMITED.retry(), Retry::AfterHint);
        assert_eq!(ERR_GATEWAY_TIMEOUT.retry(), Retry::OutcomeUnknown);
        assert_eq!(ERR_UNAVAILABLE.retry(), Retry::Backoff);
        assert_eq!(ERR_NOT_LEADER.retry(), Retry::AtLeader);
        assert_eq!(ERR_NOT_LEADER.to_string(), "421 ERR_NOT_LEADER");
        assert_eq!(Code(599).retry(), Retry::Never);
        assert_eq!(ERR_LIMITED.to_string(), "429 ERR_LIMITED");
        assert_eq!(Code(599).to_string(), "599");
    }

    #[test]
    fn limit_reason_names_roundtrip_and_keep_unknown_ones() {
        for reason in [
            LimitReason::Disk,
            LimitReason::Memory,
            LimitReason::QueueFull,
            LimitReason::Connections,
            LimitReason::Consumers,
            LimitReason::Quota,
        ] {
            assert_eq!(LimitReason::from_name(reason.name()), reason);
        }
        let future = LimitReason::from_name("tenants");
        assert_eq!(future, LimitReason::Unknown("tenants".to_owned()));
        assert_eq!(future.to_string(), "tenants");
    }
}
