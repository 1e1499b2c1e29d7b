//! [`ClientError`], everything that can go wrong in the client, and [`PublishFailed`], a failed
//! publish that hands its message back.
//!
//! Owns the mapping from wire error bodies to client errors (`ClientError::from_body`) and the
//! promise that every `Display` includes the broker's message when the broker sent one. Which
//! codes are retried belongs to `publisher.rs`.

use std::io;

use keratin_proto::codes::{ERR_GATEWAY_TIMEOUT, ERR_LIMITED, ERR_UNAUTHENTICATED};
use keratin_proto::{ErrorBody, LimitReason, ProtoError};

use crate::publisher::OutgoingMessage;

/// Everything that can go wrong in the client. `Display` always includes the broker's message
/// when the broker sent one, so an unknown code is still explained.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// TLS could not be set up: a CA file or server name that cannot be used. (A certificate
    /// the broker presents and the client refuses is an [`ClientError::Io`] of the handshake,
    /// with the verifier's reason.)
    #[error("TLS: {detail}")]
    Tls {
        /// What is wrong.
        detail: String,
    },
    /// Connecting or talking to the socket failed.
    #[error("{context}: {source}")]
    Io {
        /// What the client was doing.
        context: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// TCP connect plus handshake did not finish within `connect_timeout`.
    #[error("connecting to the broker timed out after {timeout_ms} ms")]
    ConnectTimeout {
        /// The configured `connect_timeout`.
        timeout_ms: u64,
    },
    /// The broker refused the handshake: another protocol version, or (code 401) a failed or
    /// missing login, whose `Display` says what to check.
    #[error("{}", refused_display(*.server_version, .error))]
    Refused {
        /// The version the broker speaks.
        server_version: u16,
        /// The broker's code and message.
        error: ErrorBody,
    },
    /// Credentials were given, but the broker speaks only a protocol version older than 6,
    /// which has no login: the client does not connect without the login it was asked to make.
    #[error("the broker speaks protocol version {server_version}, which has no login (version 6 on); connect without credentials or upgrade the node")]
    LoginUnsupported {
        /// The version the broker speaks.
        server_version: u16,
    },
    /// A stream request on a connection to a node that speaks an older protocol than streams
    /// need (version 7, [`keratin_proto::PROTOCOL_VERSION_STREAMS`]). Nothing was sent.
    #[error("the broker speaks protocol version {server_version}, and streams need version {needed}: upgrade the broker node")]
    StreamsUnsupported {
        /// The version agreed with the node.
        server_version: u16,
        /// The version streams need.
        needed: u16,
    },
    /// The broker answered a request, or a publish, with an error that is not retried here:
    /// 400, 404, 409, 413, 500, 503 (not applied: safe to retry later), unknown codes.
    #[error("the broker refused the request: {0}")]
    Server(ErrorBody),
    /// `ERR_LIMITED` (429): a resource or queue limit refused the publish. Nothing of it was
    /// applied, so retrying is always safe. A confirmed publish only returns this once
    /// `publish_timeout` passed while the broker kept refusing (`timed_out: true`); a buffered
    /// publish reports the first refusal (`timed_out: false`), since buffered publishes are not
    /// retried.
    #[error("{}", limited_display(.reason, *.retry_after_ms, .message, *.timed_out, *.timeout_ms))]
    Limited {
        /// Which limit: `disk`, `memory`, `queue_full`, or a reason newer than this client.
        reason: LimitReason,
        /// The broker's last retry hint.
        retry_after_ms: u32,
        /// The broker's message.
        message: String,
        /// Whether the client gave up because `publish_timeout` passed while retrying.
        timed_out: bool,
        /// The `publish_timeout` that passed (0 when `timed_out` is false).
        timeout_ms: u64,
    },
    /// A publish was sent but its outcome is not known: the broker answered 504, the
    /// connection was lost before its `Confirm`, or no answer came within `publish_timeout`.
    /// **The message may or may not be durable; publishing it again can store it twice.**
    #[error("publish outcome unknown (the message may or may not be durable; publishing it again can duplicate it): {detail}")]
    OutcomeUnknown {
        /// The broker's 504, when that is the cause.
        error: Option<ErrorBody>,
        /// What happened, the broker's message included.
        detail: String,
    },
    /// Cluster nodes kept answering 421 `ERR_NOT_LEADER` (no leader, or none reachable) for
    /// as many attempts or as long as the client follows them (see the crate docs,
    /// "Clusters"). Nothing was applied: trying again later is safe.
    #[error("{operation}: no node accepted it as leader after {attempts} attempts in {elapsed_ms} ms (last answer: {last})")]
    NotLeader {
        /// What was attempted, for example `declare orders`.
        operation: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent following the refusals.
        elapsed_ms: u64,
        /// The last 421 received (boxed: it would make every `ClientError` larger).
        last: Box<ErrorBody>,
    },
    /// The connection is gone (lost, closed by the broker, or the broker went silent). Requests
    /// that were waiting fail with this; the client does not reconnect by itself.
    #[error("connection to the broker lost: {detail}")]
    ConnectionLost {
        /// Why, as far as the client knows.
        detail: String,
    },
    /// A request got no answer within `request_timeout`. The connection stays up.
    #[error("{operation} got no answer within {timeout_ms} ms")]
    Timeout {
        /// The request, for example `declare orders`.
        operation: String,
        /// The configured `request_timeout`.
        timeout_ms: u64,
    },
    /// The broker answered with a frame that does not fit the request.
    #[error("{operation}: expected {expected} from the broker, got {got}")]
    UnexpectedReply {
        /// The request.
        operation: String,
        /// The frame type expected.
        expected: &'static str,
        /// The frame type received.
        got: &'static str,
    },
    /// A local protocol problem, for example a client name too long for the handshake or a
    /// handshake answer that does not parse.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtoError),
    /// A frame could not be encoded, for example a message over the 16 MiB frame limit or a
    /// header over 65,535 bytes. Nothing was sent; the connection stays up.
    #[error("could not encode the frame: {0}")]
    Encode(String),
    /// The arguments were invalid (for example a prefetch of 0).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

fn refused_display(server_version: u16, error: &ErrorBody) -> String {
    if error.code() != ERR_UNAUTHENTICATED {
        return format!(
            "the broker (protocol version {server_version}) refused the handshake: {error}"
        );
    }
    // The body shows the broker's retry hint, if it is slowing this address down.
    format!(
        "the broker refused the login: {error}; check --user/--password (KERATIN_USER, \
         KERATIN_PASSWORD), or the token or client certificate given"
    )
}

fn limited_display(
    reason: &LimitReason,
    retry_after_ms: u32,
    message: &str,
    timed_out: bool,
    timeout_ms: u64,
) -> String {
    if timed_out {
        format!(
            "publish timed out after {timeout_ms} ms while the broker kept rejecting it: \
             {reason} limit ({message}); last retry hint {retry_after_ms} ms"
        )
    } else {
        format!(
            "publish rejected by the broker: {reason} limit ({message}); \
             retry after {retry_after_ms} ms"
        )
    }
}

impl ClientError {
    /// The wire code behind this error, if the broker sent one: 429 for [`ClientError::Limited`]
    /// (rejected or timed out while retrying), 504 for an [`ClientError::OutcomeUnknown`] the
    /// broker reported, the broker's code for [`ClientError::Server`] and
    /// [`ClientError::Refused`]. `None` for errors the client found by itself.
    pub fn code(&self) -> Option<u16> {
        match self {
            ClientError::Limited { .. } => Some(ERR_LIMITED.0),
            ClientError::Server(body) | ClientError::Refused { error: body, .. } => {
                Some(body.code().0)
            }
            ClientError::OutcomeUnknown {
                error: Some(body), ..
            } => Some(body.code().0),
            _ => None,
        }
    }

    /// The limit reason (`disk`, `memory`, `queue_full`, ...), when the broker named one. With
    /// [`ClientError::code`] this gives the CLI's `"429:disk"` keys.
    pub fn reason(&self) -> Option<&str> {
        match self {
            ClientError::Limited { reason, .. } => Some(reason.name()),
            ClientError::Server(body) | ClientError::Refused { error: body, .. } => {
                body.reason().map(LimitReason::name)
            }
            ClientError::OutcomeUnknown {
                error: Some(body), ..
            } => body.reason().map(LimitReason::name),
            _ => None,
        }
    }

    /// `"<code>"` or `"<code>:<reason>"` (for example `"429:disk"`), or `None` without a code.
    pub fn code_key(&self) -> Option<String> {
        let code = self.code()?;
        Some(match self.reason() {
            Some(reason) => format!("{code}:{reason}"),
            None => code.to_string(),
        })
    }

    /// Maps a publish's error body: 429 to [`ClientError::Limited`] (not timed out), 504 to
    /// [`ClientError::OutcomeUnknown`], anything else to [`ClientError::Server`].
    pub(crate) fn from_body(body: ErrorBody) -> ClientError {
        if body.code() == ERR_GATEWAY_TIMEOUT {
            return ClientError::OutcomeUnknown {
                detail: body.to_string(),
                error: Some(body),
            };
        }
        match (body.code(), body.reason(), body.retry_after_ms()) {
            (ERR_LIMITED, Some(reason), Some(retry_after_ms)) => ClientError::Limited {
                reason: reason.clone(),
                retry_after_ms,
                message: body.message().to_owned(),
                timed_out: false,
                timeout_ms: 0,
            },
            _ => ClientError::Server(body),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> ClientError {
        ClientError::Io {
            context: context.into(),
            source,
        }
    }
}

/// A publish that failed: the error, and the message handed back so the caller can decide to
/// publish it again (safe unless the error is [`ClientError::OutcomeUnknown`]).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct PublishFailed {
    /// The message that was not confirmed.
    pub message: OutgoingMessage,
    /// Why.
    #[source]
    pub error: ClientError,
}

impl PublishFailed {
    /// See [`ClientError::code`].
    pub fn code(&self) -> Option<u16> {
        self.error.code()
    }

    /// See [`ClientError::reason`].
    pub fn reason(&self) -> Option<&str> {
        self.error.reason()
    }
}

impl From<PublishFailed> for ClientError {
    fn from(failed: PublishFailed) -> ClientError {
        failed.error
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_proto::codes::ERR_UNAVAILABLE;

    #[test]
    fn timed_out_limit_names_the_reason_and_message() {
        let error = ClientError::Limited {
            reason: LimitReason::Disk,
            retry_after_ms: 2000,
            message: "disk at hard level on /data".into(),
            timed_out: true,
            timeout_ms: 30_000,
        };
        assert_eq!(
            error.to_string(),
            "publish timed out after 30000 ms while the broker kept rejecting it: disk limit \
             (disk at hard level on /data); last retry hint 2000 ms"
        );
        assert_eq!(error.code_key().as_deref(), Some("429:disk"));
    }

    #[test]
    fn a_refused_login_says_what_to_check() {
        let body = ErrorBody::new(ERR_UNAUTHENTICATED, "wrong user or password");
        let error = ClientError::Refused {
            server_version: 6,
            error: body.clone().with_retry_after_ms(1500),
        };
        let shown = error.to_string();
        assert!(
            shown.starts_with("the broker refused the login: 401"),
            "{shown}"
        );
        assert!(shown.contains("wrong user or password"), "{shown}");
        assert!(
            shown.contains("--user/--password (KERATIN_USER, KERATIN_PASSWORD)"),
            "{shown}"
        );
        assert!(shown.contains("[retry after 1500 ms]"), "{shown}");
        assert_eq!(error.code(), Some(401));
        let other = ClientError::Refused {
            server_version: 6,
            error: ErrorBody::new(keratin_proto::codes::ERR_BAD_REQUEST, "version 9"),
        };
        assert!(!other.to_string().contains("--user"), "{other}");
        assert!(
            other.to_string().contains("refused the handshake"),
            "{other}"
        );
    }

    #[test]
    fn bodies_map_by_code() {
        let error = ClientError::from_body(ErrorBody::new(ERR_UNAVAILABLE, "log stopped"));
        assert_eq!(error.code_key().as_deref(), Some("503"));
        assert!(error.to_string().contains("log stopped"));
        let error = ClientError::from_body(ErrorBody::new(ERR_GATEWAY_TIMEOUT, "sync failed"));
        assert!(matches!(error, ClientError::OutcomeUnknown { .. }));
        assert_eq!(error.code(), Some(504));
        assert!(error.to_string().contains("sync failed"));
        let error = ClientError::from_body(ErrorBody::limited(LimitReason::Memory, 5, "rss"));
        assert_eq!(error.code_key().as_deref(), Some("429:memory"));
    }
}
