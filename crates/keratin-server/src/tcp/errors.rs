//! How broker errors travel on the wire: each `BrokerError` maps to one stable code
//! (`keratin_proto::codes`), and the message says what happened and what to do.

use keratin_broker::BrokerError;
use keratin_log::LogError;
use keratin_proto::codes::{
    ERR_BAD_REQUEST, ERR_CONFLICT, ERR_GATEWAY_TIMEOUT, ERR_INTERNAL, ERR_NOT_FOUND, ERR_TOO_LARGE,
    ERR_UNAVAILABLE,
};

/// The retry hint of a 421 that names no leader: about one Raft election timeout, after which
/// a leader is usually known (the client backs off on its own too, growing from its start).
pub const NOT_LEADER_RETRY_AFTER_MS: u32 = 100;
/// The retry hint of a request refused because a log stopped at a full disk: about the limits
/// sampler's period, after which freed space shows.
pub const FULL_DISK_RETRY_AFTER_MS: u32 = 1_000;
use keratin_proto::{ErrorBody, LimitReason};

/// The wire error for a broker error.
pub fn error_body(error: &BrokerError) -> ErrorBody {
    if let BrokerError::Limited {
        reason,
        retry_after_ms,
        message,
    } = error
    {
        return ErrorBody::limited(
            LimitReason::from_name(reason),
            *retry_after_ms,
            message.clone(),
        );
    }
    if let BrokerError::NotLeader { addr, .. } = error {
        let body = ErrorBody::not_leader(addr.clone(), error.to_string());
        return match addr {
            Some(_) => body,
            None => body.with_retry_after_ms(NOT_LEADER_RETRY_AFTER_MS),
        };
    }
    if let BrokerError::Log(LogError::Stopped { source, .. }) = error {
        if source.is_no_space() {
            // A log that stopped for want of space is a full disk, not a fault of the node:
            // refused as a publish is at the hard level, with the time the sampler needs to
            // see space come back.
            return ErrorBody::limited(
                LimitReason::Disk,
                FULL_DISK_RETRY_AFTER_MS,
                format!(
                    "{error}; the disk is full: delete or purge queues or free space, then retry"
                ),
            );
        }
    }
    if let BrokerError::MetadataUnavailable { retry_after_ms, .. } = error {
        return ErrorBody::new(ERR_UNAVAILABLE, error.to_string())
            .with_retry_after_ms(*retry_after_ms);
    }
    let code = match error {
        BrokerError::NotFound(_) | BrokerError::StreamNotFound(_) => ERR_NOT_FOUND,
        // The node holds as many queues or partitions as it may: a state conflict, not a
        // malformed request; it succeeds once queues are deleted.
        BrokerError::Conflict { .. }
        | BrokerError::NameTaken { .. }
        | BrokerError::NodeFull(_)
        | BrokerError::HeldByGroupMember(_) => ERR_CONFLICT,
        BrokerError::Invalid(_) => ERR_BAD_REQUEST,
        BrokerError::TooLarge(_) => ERR_TOO_LARGE,
        // Refused before anything was written: not applied, safe to retry later.
        BrokerError::Unavailable { .. } | BrokerError::Closed(_) => ERR_UNAVAILABLE,
        // Written, then the log failed: the outcome is unknown.
        BrokerError::OutcomeUnknown { .. }
        | BrokerError::TimedOut { .. }
        | BrokerError::LeadershipLost { .. }
        | BrokerError::Unreachable { .. } => ERR_GATEWAY_TIMEOUT,
        _ => ERR_INTERNAL,
    };
    ErrorBody::new(code, error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_proto::codes::ERR_NOT_LEADER;

    #[test]
    fn not_leader_maps_to_421_with_the_leaders_address() {
        let error = BrokerError::NotLeader {
            queue: "orders".into(),
            partition: 2,
            leader: Some(3),
            addr: Some("10.0.0.3:5680".into()),
        };
        let body = error_body(&error);
        assert_eq!(body.code(), ERR_NOT_LEADER);
        assert_eq!(body.leader_addr(), Some("10.0.0.3:5680"));
        assert_eq!(body.retry_after_ms(), None);
        assert!(body.message().contains("orders"), "{}", body.message());
    }

    #[test]
    fn a_log_stopped_at_a_full_disk_is_limited_not_internal() {
        let full = BrokerError::Log(LogError::Stopped {
            dir: "/data/meta".into(),
            op: "preallocate",
            source: keratin_log::IoError::from(std::io::Error::from_raw_os_error(28)),
        });
        let body = error_body(&full);
        assert_eq!(body.code(), keratin_proto::codes::ERR_LIMITED);
        assert_eq!(body.retry_after_ms(), Some(FULL_DISK_RETRY_AFTER_MS));
        assert!(body.message().contains("free space"), "{}", body.message());
        let failed = BrokerError::Log(LogError::Stopped {
            dir: "/data/meta".into(),
            op: "write",
            source: keratin_log::IoError::from(std::io::Error::from_raw_os_error(5)),
        });
        assert_eq!(error_body(&failed).code(), ERR_INTERNAL);
    }

    #[test]
    fn metadata_unavailable_is_503_with_a_retry_hint() {
        let error = BrokerError::MetadataUnavailable {
            queue: "orders".into(),
            why: "no metadata leader".into(),
            retry_after_ms: 1_000,
        };
        let body = error_body(&error);
        assert_eq!(body.code(), ERR_UNAVAILABLE);
        assert_eq!(body.retry_after_ms(), Some(1_000));
        assert!(body.message().contains("orders"), "{}", body.message());
    }

    #[test]
    fn not_leader_without_a_leader_gets_a_retry_hint_and_no_address() {
        let error = BrokerError::NotLeader {
            queue: "orders".into(),
            partition: 0,
            leader: None,
            addr: None,
        };
        let body = error_body(&error);
        assert_eq!(body.code(), ERR_NOT_LEADER);
        assert_eq!(body.leader_addr(), None);
        assert_eq!(body.retry_after_ms(), Some(NOT_LEADER_RETRY_AFTER_MS));
    }
}
