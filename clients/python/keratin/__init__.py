"""Keratin's asyncio client: connect, declare queues, publish with confirms (retrying by
itself when the broker says "limited, retry after N ms"), publish buffered with a bounded
buffer and a dropped-publish callback, and consume as an async iterator with ack/reject.

Standard library only (asyncio, ssl, struct); speaks protocol version 7
(``docs/protocol.md``).

Layout:

- ``client``: :class:`Client`, :func:`connect`, the admin verbs, routing on 421.
- ``publisher``: confirmed publishing with retries; :class:`BufferedPublisher`.
- ``consumer``: :class:`Consumer`, :class:`Delivery`.
- ``stream``: :class:`StreamConsumer`, :class:`StreamDelivery`, :class:`StreamInfo` (streams,
  protocol version 7).
- ``errors``: one exception class per protocol error code, and client-side errors.
- ``tls``: :class:`TLS`.
- ``_connection`` (private): the socket, the reader task, heartbeats, bookkeeping.
- ``_wire`` (private): the byte codec of every frame and hello.
"""

from ._wire import (
    NodeAddress,
    PartitionInfo,
    QueueSettings,
    QueueSummary,
    ServerInfo,
    StreamPartitionInfo,
    StreamSettings,
    StreamSummary,
)
from .client import (
    NOT_LEADER_BACKOFF_MAX,
    NOT_LEADER_BACKOFF_MIN,
    NOT_LEADER_RETRIES_MAX,
    Client,
    QueueInfo,
    connect,
)
from .consumer import Consumer, Delivery
from .errors import (
    BadRequestError,
    ConflictError,
    ConnectError,
    ConnectionLostError,
    ForbiddenError,
    GatewayTimeoutError,
    InternalError,
    KeratinError,
    KeratinTimeoutError,
    LimitedError,
    LoginUnsupportedError,
    StreamsUnsupportedError,
    NotFoundError,
    NotLeaderError,
    OutcomeUnknownError,
    ProtocolError,
    PublishBatchError,
    ServerError,
    TLSError,
    TooLargeError,
    UnauthorizedError,
    UnavailableError,
)
from .publisher import RETRY_DELAY_MS_MIN, BufferedPublisher, DroppedPublish, Message
from .stream import KEEP, StreamConsumer, StreamDelivery, StreamInfo
from .tls import TLS

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "connect",
    "Client",
    "QueueInfo",
    "QueueSettings",
    "PartitionInfo",
    "QueueSummary",
    "ServerInfo",
    "NodeAddress",
    "Message",
    "BufferedPublisher",
    "DroppedPublish",
    "Consumer",
    "Delivery",
    "KEEP",
    "StreamConsumer",
    "StreamDelivery",
    "StreamInfo",
    "StreamSettings",
    "StreamPartitionInfo",
    "StreamSummary",
    "TLS",
    "RETRY_DELAY_MS_MIN",
    "NOT_LEADER_RETRIES_MAX",
    "NOT_LEADER_BACKOFF_MIN",
    "NOT_LEADER_BACKOFF_MAX",
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
    "ConnectError",
    "TLSError",
    "LoginUnsupportedError",
    "StreamsUnsupportedError",
    "PublishBatchError",
]
