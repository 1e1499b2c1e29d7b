"""Every error the client raises: one class per protocol error code (``docs/protocol.md``
"Error codes"), and the client-side failures (lost connection, unknown outcome, bad bytes
from the server, timeouts).

Owns the mapping code -> class (:func:`error_from_body`); the rest of the client only builds
errors through it.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "KeratinError",
    "ServerError",
    "BadRequestError",
    "UnauthorizedError",
    "ForbiddenError",
    "NotFoundError",
    "ConflictError",
    "TooLargeError",
    "NotLeaderError",
    "LimitedError",
    "InternalError",
    "UnavailableError",
    "GatewayTimeoutError",
    "ConnectionLostError",
    "OutcomeUnknownError",
    "ProtocolError",
    "KeratinTimeoutError",
    "LoginUnsupportedError",
    "StreamsUnsupportedError",
    "ConnectError",
    "TLSError",
    "PublishBatchError",
    "error_from_body",
]


class KeratinError(Exception):
    """Base of every error this client raises.

    ``code`` is the protocol error code when the server sent one (``None`` for client-side
    errors); ``reason``, ``retry_after_ms`` and ``leader_addr`` are the error body's fields.
    """

    def __init__(
        self,
        message: str,
        code: Optional[int] = None,
        *,
        reason: Optional[str] = None,
        retry_after_ms: Optional[int] = None,
        leader_addr: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        self.leader_addr = leader_addr

    def __str__(self) -> str:
        if self.code is None:
            return self.message
        extra = ""
        if self.reason is not None:
            extra += " (%s" % self.reason
            if self.retry_after_ms is not None:
                extra += ", retry after %d ms" % self.retry_after_ms
            extra += ")"
        if self.leader_addr is not None:
            extra += " [leader at %s]" % self.leader_addr
        return "%d %s: %s%s" % (self.code, CODE_NAMES.get(self.code, "unknown code"), self.message, extra)


class ServerError(KeratinError):
    """The server refused a request with an error code (also the class of codes this client
    does not know; those are never retried)."""


class BadRequestError(ServerError):
    """400 ``ERR_BAD_REQUEST``: malformed or invalid request; never retry unchanged."""


class UnauthorizedError(ServerError):
    """401 ``ERR_UNAUTHENTICATED``: the login failed or is missing."""


class ForbiddenError(ServerError):
    """403 ``ERR_FORBIDDEN``: the logged-in user lacks the permission (the message names it)."""


class NotFoundError(ServerError):
    """404 ``ERR_NOT_FOUND``: no such queue, consumer tag or delivery id."""


class ConflictError(ServerError):
    """409 ``ERR_CONFLICT``: conflicts with the current state (declare with other settings,
    consumer tag in use, node at its queue bound)."""


class TooLargeError(ServerError):
    """413 ``ERR_TOO_LARGE``: frame, message or batch over a size limit."""


class NotLeaderError(ServerError):
    """421 ``ERR_NOT_LEADER``: this node does not lead what the request needs; not applied.
    The client follows it by itself; you see it only when the bounded retries ran out."""


class LimitedError(ServerError):
    """429 ``ERR_LIMITED``: refused by a resource or queue limit; not applied. ``reason``
    names the limit (``disk``, ``memory``, ``queue_full``, ``connections``, ``consumers``,
    ``quota``) and ``retry_after_ms`` the wait the server asks for. A confirmed publish
    raises it only when retrying on the hints ran out of ``publish_timeout``
    (``timed_out`` is then true)."""

    def __init__(self, message: str, code: Optional[int] = 429, **kwargs: object) -> None:
        self.timed_out = bool(kwargs.pop("timed_out", False))
        super().__init__(message, code, **kwargs)  # type: ignore[arg-type]


class InternalError(ServerError):
    """500 ``ERR_INTERNAL``: a bug or unexpected state in the server; never retried."""


class UnavailableError(ServerError):
    """503 ``ERR_UNAVAILABLE``: the server cannot take the request now; not applied, safe to
    retry with backoff."""


class OutcomeUnknownError(KeratinError):
    """The request may or may not have been applied (a confirmed publish whose connection was
    lost after it was written, or that got no answer within ``publish_timeout``).
    Publishing it again can store it twice unless it carries a producer sequence."""


class GatewayTimeoutError(ServerError, OutcomeUnknownError):
    """504 ``ERR_GATEWAY_TIMEOUT``: the server could not learn whether the request was applied."""


class ConnectionLostError(KeratinError):
    """The connection ended (socket error, the server closed it, a fatal ``Error``, or the
    server was silent for ``server_silence_timeout``). Requests not yet written were not
    applied; the client does not reconnect by itself."""


class ProtocolError(KeratinError):
    """The server sent bytes that are not protocol version 6 (bad magic, malformed frame,
    oversize length, unknown frame type). The connection is closed."""


class KeratinTimeoutError(KeratinError, TimeoutError):
    """No answer within the bound (``connect_timeout``, ``request_timeout``)."""


class ConnectError(KeratinError):
    """Could not open a connection: the address does not answer, refuses TCP, or closed the
    connection before the handshake completed."""


class TLSError(ConnectError):
    """The TLS handshake failed: the server's certificate is not trusted by the given CA or
    does not name the host, the CA or client certificate files are unusable, or a plaintext
    client reached a TLS port (or the reverse)."""


class LoginUnsupportedError(KeratinError):
    """The server speaks a version older than 6 and cannot check a login."""


class StreamsUnsupportedError(KeratinError):
    """The connection agreed on a protocol version older than 7, which has no streams; the
    stream call sent nothing."""


class PublishBatchError(KeratinError):
    """Some messages of :meth:`keratin.Client.publish_batch` failed: ``errors`` maps each
    failed message's index to its error; the other messages were confirmed."""

    def __init__(self, errors: Dict[int, KeratinError], total: int) -> None:
        first = min(errors)
        super().__init__(
            "%d of %d messages failed; message %d: %s" % (len(errors), total, first, errors[first])
        )
        self.errors = errors


CODE_NAMES: Dict[int, str] = {
    400: "ERR_BAD_REQUEST",
    401: "ERR_UNAUTHENTICATED",
    403: "ERR_FORBIDDEN",
    404: "ERR_NOT_FOUND",
    409: "ERR_CONFLICT",
    413: "ERR_TOO_LARGE",
    421: "ERR_NOT_LEADER",
    429: "ERR_LIMITED",
    500: "ERR_INTERNAL",
    503: "ERR_UNAVAILABLE",
    504: "ERR_GATEWAY_TIMEOUT",
}

CODE_CLASSES: Dict[int, Type[ServerError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    413: TooLargeError,
    421: NotLeaderError,
    429: LimitedError,
    500: InternalError,
    503: UnavailableError,
    504: GatewayTimeoutError,
}


def error_from_body(body: object, prefix: str = "") -> ServerError:
    """The exception for a wire error body (a ``keratin._wire.ErrorBody``); an unknown code
    gives a plain :class:`ServerError` that keeps the code and message."""
    code = getattr(body, "code")
    cls = CODE_CLASSES.get(code, ServerError)
    return cls(
        prefix + getattr(body, "message"),
        code,
        reason=getattr(body, "reason"),
        retry_after_ms=getattr(body, "retry_after_ms"),
        leader_addr=getattr(body, "leader_addr"),
    )
