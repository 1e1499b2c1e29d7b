//! How broker errors travel on the wire: each `BrokerError` maps to one stable code
//! (`keratin_proto::codes`), and the message says what happened and what to do.

use keratin_broker::BrokerError;
use keratin_proto::codes::{
    ERR_BAD_REQUEST, ERR_CONFLICT, ERR_GATEWAY_TIMEOUT, ERR_INTERNAL, ERR_NOT_FOUND, ERR_TOO_LARGE,
    ERR_UNAVAILABLE,
};
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
    let code = match error {
        BrokerError::NotFound(_) => ERR_NOT_FOUND,
        // The node holds as many queues or partitions as it may: a state conflict, not a
        // malformed request; it succeeds once queues are deleted.
        BrokerError::Conflict { .. } | BrokerError::NodeFull(_) => ERR_CONFLICT,
        BrokerError::Invalid(_) => ERR_BAD_REQUEST,
        BrokerError::TooLarge(_) => ERR_TOO_LARGE,
        // Refused before anything was written: not applied, safe to retry later.
        BrokerError::Unavailable { .. } | BrokerError::Closed(_) => ERR_UNAVAILABLE,
        // Written, then the log failed: the outcome is unknown.
        BrokerError::OutcomeUnknown { .. } | BrokerError::TimedOut { .. } => ERR_GATEWAY_TIMEOUT,
        _ => ERR_INTERNAL,
    };
    ErrorBody::new(code, error.to_string())
}
