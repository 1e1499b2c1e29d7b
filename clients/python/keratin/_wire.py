"""The wire codec of protocol version 7 (``docs/protocol.md``): primitives, every frame type
in both directions, and both hellos.

Owns bytes only: no I/O, no asyncio. ``_connection.py`` reads and writes the socket and calls
:func:`decode_frame` on each complete frame body, :func:`decode_server_hello` on the handshake.
All integers are little-endian; every count is checked against the bytes left before anything
is built for it; any bad input raises :class:`~keratin.errors.ProtocolError` (or
:class:`Incomplete` while a hello is still arriving), never anything else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

from .errors import ProtocolError

MAGIC = b"KRTN"
#: The version this client speaks and offers first.
PROTOCOL_VERSION = 7
#: The first version with streams (protocol.md "Stream frames (version 7)") and
#: ``Deliver.routing_key``.
STREAM_VERSION = 7
#: The oldest version a server may ask this client to fall back to.
PROTOCOL_VERSION_MIN = 1
#: Protocol default and maximum of a frame's ``length`` field (16 MiB).
FRAME_SIZE_BYTES_MAX = 16 * 1024 * 1024
#: Frame header: ``length`` u32 plus ``type`` u8.
FRAME_HEADER_BYTES = 5
#: Largest ``ServerHello`` a server may send (a refusal's error body: about 128 KiB); a
#: client buffers at most this many bytes of handshake.
SERVER_HELLO_SIZE_MAX = 4 + 2 + 1 + 2 + (1 + 2 + 65535) + (1 + 4) + (2 + 65535)
#: Bounds of the server info (protocol.md "Server info").
SERVER_INFO_NODES_MAX = 64
SERVER_INFO_FIELD_BYTES_MAX = 255
#: Login field bounds (protocol.md "ClientHello").
AUTH_USER_BYTES_MAX = 255
AUTH_PASSWORD_BYTES_MAX = 1024
AUTH_TOKEN_BYTES_MAX = 255
#: ``Subscribe.prefetch`` range.
PREFETCH_MAX = 65535
#: Stream list bounds (protocol.md "Stream frames"): a count above one is malformed.
STREAM_NODES_MAX = 64
STREAM_PARTITIONS_MAX = 64
STREAM_DELIVER_MESSAGES_MAX = 256

#: ``StreamSubscribe.start.kind`` numbers.
START_FIRST = 0
START_LAST = 1
START_NEXT = 2
START_OFFSET = 3
START_TIMESTAMP = 4
START_NAMES = {
    START_FIRST: "first", START_LAST: "last", START_NEXT: "next",
    START_OFFSET: "offset", START_TIMESTAMP: "timestamp",
}

MECHANISM_NONE = 0
MECHANISM_PLAIN = 1
MECHANISM_EXTERNAL = 2
MECHANISM_TOKEN = 3

MODE_CONFIRMED = 0
MODE_BUFFERED = 1
MODE_JOINABLE = 0x80

OVERFLOW_REJECT = 0
OVERFLOW_DROP_OLDEST = 1
OVERFLOW_NAMES = {OVERFLOW_REJECT: "reject", OVERFLOW_DROP_OLDEST: "drop_oldest"}

UPDATE_KEEP = 0
UPDATE_CLEAR = 1
UPDATE_SET = 2

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Incomplete(Exception):
    """More bytes are needed (only while reading a hello from a stream)."""


# --------------------------------------------------------------------------------------------
# Primitives


class Writer:
    """Appends primitives to a growing buffer."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def u8(self, value: int) -> None:
        self.buf.append(value)

    def u16(self, value: int) -> None:
        self.buf += _U16.pack(value)

    def u32(self, value: int) -> None:
        self.buf += _U32.pack(value)

    def u64(self, value: int) -> None:
        self.buf += _U64.pack(value)

    def boolean(self, value: bool) -> None:
        self.buf.append(1 if value else 0)

    def string(self, value: str, what: str = "string", limit: int = 65535) -> None:
        raw = value.encode("utf-8")
        if len(raw) > limit:
            raise ValueError("%s is %d bytes; at most %d fit" % (what, len(raw), limit))
        self.u16(len(raw))
        self.buf += raw

    def bytes_(self, value: bytes) -> None:
        if len(value) > 0xFFFFFFFF:
            raise ValueError("body of %d bytes does not fit a u32 length" % len(value))
        self.u32(len(value))
        self.buf += value

    def opt(self, value: object, put: Callable[[object], None]) -> None:
        if value is None:
            self.u8(0)
        else:
            self.u8(1)
            put(value)

    def opt_string(self, value: Optional[str]) -> None:
        self.opt(value, self.string)  # type: ignore[arg-type]

    def opt_u32(self, value: Optional[int]) -> None:
        self.opt(value, self.u32)  # type: ignore[arg-type]

    def opt_u64(self, value: Optional[int]) -> None:
        self.opt(value, self.u64)  # type: ignore[arg-type]

    def headers(self, headers: List[Tuple[str, str]]) -> None:
        if len(headers) > 65535:
            raise ValueError("at most 65,535 headers fit a message")
        self.u16(len(headers))
        for name, value in headers:
            self.string(name, "header name")
            self.string(value, "header value")


class Reader:
    """Reads primitives from ``data``. Running past the end is malformed (a frame body) or
    :class:`Incomplete` (a hello still arriving, ``incomplete=True``)."""

    __slots__ = ("data", "pos", "what", "incomplete")

    def __init__(self, data: bytes, what: str, incomplete: bool = False) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.what = what
        self.incomplete = incomplete

    def fail(self, reason: str) -> ProtocolError:
        return ProtocolError("malformed %s at byte %d: %s" % (self.what, self.pos, reason))

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, size: int, field_name: str) -> memoryview:
        if size > self.left():
            if self.incomplete:
                raise Incomplete()
            raise self.fail("%s needs %d bytes, %d left" % (field_name, size, self.left()))
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def u8(self, field_name: str = "u8") -> int:
        return self.take(1, field_name)[0]

    def u16(self, field_name: str = "u16") -> int:
        return int(_U16.unpack(self.take(2, field_name))[0])

    def u32(self, field_name: str = "u32") -> int:
        return int(_U32.unpack(self.take(4, field_name))[0])

    def u64(self, field_name: str = "u64") -> int:
        return int(_U64.unpack(self.take(8, field_name))[0])

    def boolean(self, field_name: str = "bool") -> bool:
        value = self.u8(field_name)
        if value > 1:
            raise self.fail("%s: bool %d is neither 0 nor 1" % (field_name, value))
        return value == 1

    def string(self, field_name: str = "string", limit: int = 65535) -> str:
        size = self.u16(field_name)
        if size > limit:
            raise self.fail("%s of %d bytes is over its bound of %d" % (field_name, size, limit))
        raw = self.take(size, field_name)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("%s is not UTF-8" % field_name) from None

    def bytes_(self, field_name: str = "bytes") -> bytes:
        size = self.u32(field_name)
        return bytes(self.take(size, field_name))

    def tag(self, field_name: str) -> bool:
        value = self.u8(field_name)
        if value > 1:
            raise self.fail("%s: option tag %d is neither 0 nor 1" % (field_name, value))
        return value == 1

    def opt_string(self, field_name: str, limit: int = 65535) -> Optional[str]:
        return self.string(field_name, limit) if self.tag(field_name) else None

    def opt_u32(self, field_name: str) -> Optional[int]:
        return self.u32(field_name) if self.tag(field_name) else None

    def opt_u64(self, field_name: str) -> Optional[int]:
        return self.u64(field_name) if self.tag(field_name) else None

    def count(self, width: int, item_min_bytes: int, field_name: str) -> int:
        """A list count, refused when its smallest encoding cannot fit the bytes left."""
        n = self.u16(field_name) if width == 2 else self.u32(field_name)
        if n * item_min_bytes > self.left():
            if self.incomplete:
                raise Incomplete()
            raise self.fail(
                "%s count %d cannot fit the %d bytes left" % (field_name, n, self.left())
            )
        return n

    def headers(self) -> List[Tuple[str, str]]:
        n = self.count(2, 4, "headers")
        return [(self.string("header name"), self.string("header value")) for _ in range(n)]

    def end(self) -> None:
        if self.left() != 0:
            raise self.fail("%d bytes after the last field" % self.left())


# --------------------------------------------------------------------------------------------
# Shared structures


@dataclass
class ErrorBody:
    """protocol.md "Error body"."""

    code: int
    message: str
    reason: Optional[str] = None
    retry_after_ms: Optional[int] = None
    leader_addr: Optional[str] = None


def put_error_body(w: Writer, body: ErrorBody, version: int, leader: bool = True) -> None:
    if body.code == 429 and (body.reason is None or body.retry_after_ms is None):
        raise ValueError("a 429 always carries reason and retry_after_ms")
    w.u16(body.code)
    w.opt_string(body.reason)
    w.opt_u32(body.retry_after_ms)
    w.string(body.message, "message")
    if leader and version >= 4:
        w.opt_string(body.leader_addr)


def read_error_body(r: Reader, version: int, leader: bool = True) -> ErrorBody:
    code = r.u16("code")
    reason = r.opt_string("reason")
    retry_after_ms = r.opt_u32("retry_after_ms")
    message = r.string("message")
    leader_addr = r.opt_string("leader_addr") if leader and version >= 4 else None
    if code == 429 and (reason is None or retry_after_ms is None):
        raise r.fail("a 429 without reason or retry_after_ms")
    return ErrorBody(code, message, reason, retry_after_ms, leader_addr)


@dataclass
class QueueSettings:
    """protocol.md "Queue settings". ``overflow`` is ``"reject"`` or ``"drop_oldest"``."""

    partitions: int = 1
    dead_letter: Optional[str] = None
    max_deliveries: Optional[int] = None
    max_messages: Optional[int] = None
    max_bytes: Optional[int] = None
    overflow: Optional[str] = None
    replicas: Optional[int] = None


def overflow_number(name: str) -> int:
    for number, known in OVERFLOW_NAMES.items():
        if known == name:
            return number
    raise ValueError("overflow must be 'reject' or 'drop_oldest', not %r" % (name,))


def put_settings(w: Writer, s: QueueSettings, version: int) -> None:
    w.u32(s.partitions)
    w.opt_string(s.dead_letter)
    w.opt_u32(s.max_deliveries)
    w.opt_u64(s.max_messages)
    w.opt_u64(s.max_bytes)
    w.opt(None if s.overflow is None else overflow_number(s.overflow), w.u8)  # type: ignore
    if version >= 4:
        w.opt_u32(s.replicas)
    elif s.replicas is not None:
        raise ValueError("replicas needs protocol version 4; the server speaks %d" % version)


def read_overflow(r: Reader) -> str:
    number = r.u8("overflow")
    if number not in OVERFLOW_NAMES:
        raise r.fail("overflow %d is neither 0 nor 1" % number)
    return OVERFLOW_NAMES[number]


def read_settings(r: Reader, version: int) -> QueueSettings:
    partitions = r.u32("partitions")
    dead_letter = r.opt_string("dead_letter")
    max_deliveries = r.opt_u32("max_deliveries")
    max_messages = r.opt_u64("max_messages")
    max_bytes = r.opt_u64("max_bytes")
    overflow = read_overflow(r) if r.tag("overflow") else None
    replicas = r.opt_u32("replicas") if version >= 4 else None
    return QueueSettings(
        partitions, dead_letter, max_deliveries, max_messages, max_bytes, overflow, replicas
    )


@dataclass
class PartitionInfo:
    """One partition of a ``QueueInfoReply``."""

    ready: int
    inflight: int
    bytes: int
    disk_bytes: int
    leading: bool = True
    leader: Optional[int] = None
    leader_addr: Optional[str] = None


@dataclass
class QueueSummary:
    """One queue of a ``QueueListReply``."""

    queue: str
    partitions: int
    ready: int
    inflight: int
    bytes: int


@dataclass
class WireMessage:
    """One message of a ``Publish``."""

    publish_id: int
    body: bytes
    routing_key: Optional[str] = None
    headers: List[Tuple[str, str]] = field(default_factory=list)
    sequence: Optional[int] = None


def message_size(m: WireMessage) -> int:
    """An upper bound of the bytes ``m`` takes in a ``Publish``."""
    size = 8 + 1 + 2 + 4 + 9 + len(m.body)
    if m.routing_key is not None:
        size += 2 + len(m.routing_key.encode("utf-8"))
    for name, value in m.headers:
        size += 4 + len(name.encode("utf-8")) + len(value.encode("utf-8"))
    return size


# --------------------------------------------------------------------------------------------
# Frames


@dataclass
class Declare:
    request_id: int
    queue: str
    settings: QueueSettings
    nodes: List[int] = field(default_factory=list)
    TYPE = 0x01


@dataclass
class Delete:
    request_id: int
    queue: str
    TYPE = 0x02


@dataclass
class Purge:
    request_id: int
    queue: str
    TYPE = 0x03


@dataclass
class QueueInfo:
    request_id: int
    queue: str
    TYPE = 0x04


@dataclass
class QueueList:
    request_id: int
    TYPE = 0x05


@dataclass
class Update:
    """``update<T>``: ``kind`` is keep (0), clear (1) or set (2, with ``value``)."""

    kind: int = UPDATE_KEEP
    value: object = None


@dataclass
class SetQueueSettings:
    request_id: int
    queue: str
    dead_letter: Update = field(default_factory=Update)
    max_deliveries: Update = field(default_factory=Update)
    max_messages: Update = field(default_factory=Update)
    max_bytes: Update = field(default_factory=Update)
    overflow: Update = field(default_factory=Update)
    TYPE = 0x06


@dataclass
class Publish:
    queue: str
    mode: int
    messages: List[WireMessage]
    producer_id: Optional[int] = None
    TYPE = 0x10


@dataclass
class Subscribe:
    request_id: int
    queue: str
    prefetch: int
    consumer_tag: str
    prefetch_bytes: int = 0
    TYPE = 0x20


@dataclass
class Cancel:
    request_id: int
    consumer_tag: str
    TYPE = 0x21


@dataclass
class Ack:
    delivery_ids: List[int]
    TYPE = 0x22


@dataclass
class Reject:
    delivery_ids: List[int]
    requeue: bool
    TYPE = 0x23


@dataclass
class Ok:
    request_id: int
    TYPE = 0x40


@dataclass
class QueueInfoReply:
    request_id: int
    queue: str
    settings: QueueSettings
    partitions: List[PartitionInfo]
    TYPE = 0x41


@dataclass
class QueueListReply:
    request_id: int
    queues: List[QueueSummary]
    TYPE = 0x42


@dataclass
class SubscribeOk:
    request_id: int
    consumer_tag: str
    TYPE = 0x43


@dataclass
class Confirm:
    ranges: List[Tuple[int, int]]
    TYPE = 0x50


@dataclass
class PublishError:
    ranges: List[Tuple[int, int]]
    error: ErrorBody
    TYPE = 0x51


@dataclass
class Deliver:
    consumer_tag: str
    delivery_id: int
    partition: int
    offset: int
    redelivered: bool
    delivery_count: int
    headers: List[Tuple[str, str]]
    body: bytes
    #: Version 7 and later; absent (``None``) in older versions.
    routing_key: Optional[str] = None
    TYPE = 0x60


@dataclass
class ConsumerEnd:
    consumer_tag: str
    error: ErrorBody
    TYPE = 0x61


@dataclass
class Heartbeat:
    TYPE = 0xF0


@dataclass
class Error:
    request_id: Optional[int]
    fatal: bool
    error: ErrorBody
    TYPE = 0xF1


@dataclass
class Close:
    message: str = ""
    TYPE = 0xF2


Frame = Union[
    Declare, Delete, Purge, QueueInfo, QueueList, SetQueueSettings, Publish, Subscribe,
    Cancel, Ack, Reject, Ok, QueueInfoReply, QueueListReply, SubscribeOk, Confirm,
    PublishError, Deliver, ConsumerEnd, Heartbeat, Error, Close,
    "StreamDeclare", "StreamSet", "StreamInfo", "StreamList", "StreamDelete", "StreamSubscribe",
    "StreamCredit", "CursorCommit", "StreamInfoReply", "StreamListReply", "StreamDeliver",
    "StreamPartitionEnd",
]

FRAME_TYPES: Dict[int, type] = {
    cls.TYPE: cls
    for cls in (
        Declare, Delete, Purge, QueueInfo, QueueList, SetQueueSettings, Publish, Subscribe,
        Cancel, Ack, Reject, Ok, QueueInfoReply, QueueListReply, SubscribeOk, Confirm,
        PublishError, Deliver, ConsumerEnd, Heartbeat, Error, Close,
    )
}


def _put_update(w: Writer, update: Update, put: Callable[[object], None]) -> None:
    if update.kind not in (UPDATE_KEEP, UPDATE_CLEAR, UPDATE_SET):
        raise ValueError("update kind must be 0, 1 or 2")
    w.u8(update.kind)
    if update.kind == UPDATE_SET:
        put(update.value)


def _read_update(r: Reader, name: str, read: Callable[[], object]) -> Update:
    kind = r.u8(name)
    if kind > UPDATE_SET:
        raise r.fail("%s: update tag %d is not 0, 1 or 2" % (name, kind))
    return Update(kind, read() if kind == UPDATE_SET else None)


def _put_ranges(w: Writer, ranges: List[Tuple[int, int]]) -> None:
    w.u32(len(ranges))
    for first, last in ranges:
        if first > last:
            raise ValueError("publish id range %d..%d has first > last" % (first, last))
        w.u64(first)
        w.u64(last)


def _read_ranges(r: Reader) -> List[Tuple[int, int]]:
    out = []
    for _ in range(r.count(4, 16, "ranges")):
        first, last = r.u64("first"), r.u64("last")
        if first > last:
            raise r.fail("publish id range %d..%d has first > last" % (first, last))
        out.append((first, last))
    return out


def _put_ids(w: Writer, ids: List[int]) -> None:
    w.u32(len(ids))
    for i in ids:
        w.u64(i)


def _read_ids(r: Reader) -> List[int]:
    return [r.u64("delivery_id") for _ in range(r.count(4, 8, "delivery_ids"))]


def encode_body(frame: Frame, version: int = PROTOCOL_VERSION) -> bytes:
    """The body of ``frame`` (without the 5-byte header) in protocol ``version``."""
    w = Writer()
    f = frame
    if isinstance(f, Declare):
        w.u64(f.request_id)
        w.string(f.queue, "queue")
        put_settings(w, f.settings, version)
        if version >= 5:
            if len(f.nodes) > 65535:
                raise ValueError("at most 65,535 nodes")
            w.u16(len(f.nodes))
            for node in f.nodes:
                w.u64(node)
        elif f.nodes:
            raise ValueError("pinning nodes needs protocol version 5; the server speaks %d" % version)
    elif isinstance(f, (Delete, Purge, QueueInfo)):
        w.u64(f.request_id)
        w.string(f.queue, "queue")
    elif isinstance(f, (QueueList, Ok)):
        w.u64(f.request_id)
    elif isinstance(f, SetQueueSettings):
        w.u64(f.request_id)
        w.string(f.queue, "queue")
        _put_update(w, f.dead_letter, w.string)  # type: ignore[arg-type]
        _put_update(w, f.max_deliveries, w.u32)  # type: ignore[arg-type]
        _put_update(w, f.max_messages, w.u64)  # type: ignore[arg-type]
        _put_update(w, f.max_bytes, w.u64)  # type: ignore[arg-type]
        _put_update(w, f.overflow, lambda v: w.u8(overflow_number(v)))  # type: ignore
    elif isinstance(f, Publish):
        w.string(f.queue, "queue")
        w.u8(f.mode)
        w.u32(len(f.messages))
        for m in f.messages:
            w.u64(m.publish_id)
            w.opt_string(m.routing_key)
            w.headers(m.headers)
            w.bytes_(m.body)
            if version >= 4:
                w.opt_u64(m.sequence)
        if version >= 4:
            w.opt_u64(f.producer_id)
    elif isinstance(f, Subscribe):
        w.u64(f.request_id)
        w.string(f.queue, "queue")
        w.u32(f.prefetch)
        w.string(f.consumer_tag, "consumer_tag")
        if version >= 2:
            w.u64(f.prefetch_bytes)
    elif isinstance(f, Cancel):
        w.u64(f.request_id)
        w.string(f.consumer_tag, "consumer_tag")
    elif isinstance(f, Ack):
        _put_ids(w, f.delivery_ids)
    elif isinstance(f, Reject):
        _put_ids(w, f.delivery_ids)
        w.boolean(f.requeue)
    elif isinstance(f, QueueInfoReply):
        w.u64(f.request_id)
        w.string(f.queue, "queue")
        put_settings(w, f.settings, version)
        w.u32(len(f.partitions))
        for p in f.partitions:
            for n in (p.ready, p.inflight, p.bytes, p.disk_bytes):
                w.u64(n)
            if version >= 4:
                w.boolean(p.leading)
                w.opt_u64(p.leader)
                w.opt_string(p.leader_addr)
    elif isinstance(f, QueueListReply):
        w.u64(f.request_id)
        w.u32(len(f.queues))
        for q in f.queues:
            w.string(q.queue, "queue")
            w.u32(q.partitions)
            w.u64(q.ready)
            w.u64(q.inflight)
            w.u64(q.bytes)
    elif isinstance(f, SubscribeOk):
        w.u64(f.request_id)
        w.string(f.consumer_tag, "consumer_tag")
    elif isinstance(f, Confirm):
        _put_ranges(w, f.ranges)
    elif isinstance(f, PublishError):
        _put_ranges(w, f.ranges)
        put_error_body(w, f.error, version)
    elif isinstance(f, Deliver):
        w.string(f.consumer_tag, "consumer_tag")
        w.u64(f.delivery_id)
        w.u32(f.partition)
        w.u64(f.offset)
        w.boolean(f.redelivered)
        w.u32(f.delivery_count)
        if version >= STREAM_VERSION:
            w.opt_string(f.routing_key)
        w.headers(f.headers)
        w.bytes_(f.body)
    elif isinstance(f, ConsumerEnd):
        if version < 4:
            raise ValueError("ConsumerEnd needs protocol version 4")
        w.string(f.consumer_tag, "consumer_tag")
        put_error_body(w, f.error, version)
    elif isinstance(f, Heartbeat):
        pass
    elif isinstance(f, Error):
        w.opt_u64(f.request_id)
        w.boolean(f.fatal)
        put_error_body(w, f.error, version)
    elif isinstance(f, Close):
        w.string(f.message, "message")
    elif isinstance(f, STREAM_FRAMES):
        if version < STREAM_VERSION:
            raise ValueError(
                "%s needs protocol version %d; this connection speaks %d"
                % (type(f).__name__, STREAM_VERSION, version)
            )
        _encode_stream_body(w, f)
    else:
        raise TypeError("not a frame: %r" % (frame,))
    return bytes(w.buf)


def encode_frame(frame: Frame, version: int = PROTOCOL_VERSION) -> bytes:
    """``frame`` with its header, refused (``ValueError``) when over the frame size limit."""
    body = encode_body(frame, version)
    length = 1 + len(body)
    if length > FRAME_SIZE_BYTES_MAX:
        raise ValueError(
            "frame of %d bytes is over the 16 MiB frame size limit; split the batch" % length
        )
    return _U32.pack(length) + bytes([frame.TYPE]) + body


def decode_frame(frame_type: int, body: bytes, version: int = PROTOCOL_VERSION) -> Frame:
    """The frame of ``frame_type`` whose body is exactly ``body``."""
    cls = FRAME_TYPES.get(frame_type)
    if cls is None or (frame_type == ConsumerEnd.TYPE and version < 4) or (
        cls in STREAM_FRAMES and version < STREAM_VERSION
    ):
        raise ProtocolError("unknown frame type 0x%02x" % frame_type)
    r = Reader(body, cls.__name__)
    frame = _DECODERS[frame_type](r, version)
    r.end()
    return frame


def _d_declare(r: Reader, v: int) -> Frame:
    request_id, queue = r.u64("request_id"), r.string("queue")
    settings = read_settings(r, v)
    nodes: List[int] = []
    if v >= 5:
        nodes = [r.u64("node") for _ in range(r.count(2, 8, "nodes"))]
    return Declare(request_id, queue, settings, nodes)


def _d_set(r: Reader, v: int) -> Frame:
    return SetQueueSettings(
        r.u64("request_id"),
        r.string("queue"),
        _read_update(r, "dead_letter", lambda: r.string("dead_letter")),
        _read_update(r, "max_deliveries", lambda: r.u32("max_deliveries")),
        _read_update(r, "max_messages", lambda: r.u64("max_messages")),
        _read_update(r, "max_bytes", lambda: r.u64("max_bytes")),
        _read_update(r, "overflow", lambda: read_overflow(r)),
    )


def _d_publish(r: Reader, v: int) -> Frame:
    queue = r.string("queue")
    mode = r.u8("mode")
    if mode & 0x7F > MODE_BUFFERED:
        raise r.fail("publish mode %d is not confirmed or buffered" % mode)
    messages = []
    for _ in range(r.count(4, 8 + 1 + 2 + 4, "messages")):
        publish_id = r.u64("publish_id")
        key = r.opt_string("routing_key")
        headers = r.headers()
        body = r.bytes_("body")
        sequence = r.opt_u64("sequence") if v >= 4 else None
        messages.append(WireMessage(publish_id, body, key, headers, sequence))
    producer_id = r.opt_u64("producer_id") if v >= 4 else None
    return Publish(queue, mode, messages, producer_id)


def _d_subscribe(r: Reader, v: int) -> Frame:
    request_id, queue = r.u64("request_id"), r.string("queue")
    prefetch, tag = r.u32("prefetch"), r.string("consumer_tag")
    prefetch_bytes = r.u64("prefetch_bytes") if v >= 2 else 0
    return Subscribe(request_id, queue, prefetch, tag, prefetch_bytes)


def _d_info_reply(r: Reader, v: int) -> Frame:
    request_id, queue = r.u64("request_id"), r.string("queue")
    settings = read_settings(r, v)
    partitions = []
    for _ in range(r.count(4, 32 if v < 4 else 35, "partitions")):
        counts = [r.u64(n) for n in ("ready", "inflight", "bytes", "disk_bytes")]
        if v >= 4:
            leading = r.boolean("leading")
            leader, addr = r.opt_u64("leader"), r.opt_string("leader_addr")
        else:
            leading, leader, addr = True, None, None
        ready, inflight, size, disk = counts
        partitions.append(PartitionInfo(ready, inflight, size, disk, leading, leader, addr))
    return QueueInfoReply(request_id, queue, settings, partitions)


def _d_list_reply(r: Reader, v: int) -> Frame:
    request_id = r.u64("request_id")
    queues = []
    for _ in range(r.count(4, 2 + 4 + 24, "queues")):
        name = r.string("queue")
        queues.append(QueueSummary(name, r.u32(), r.u64(), r.u64(), r.u64()))
    return QueueListReply(request_id, queues)


def _d_deliver(r: Reader, v: int) -> Frame:
    tag, delivery_id = r.string("consumer_tag"), r.u64("delivery_id")
    partition, offset = r.u32("partition"), r.u64("offset")
    redelivered, count = r.boolean("redelivered"), r.u32("delivery_count")
    key = r.opt_string("routing_key") if v >= STREAM_VERSION else None
    headers = r.headers()
    body = r.bytes_("body")
    return Deliver(tag, delivery_id, partition, offset, redelivered, count, headers, body, key)


_DECODERS: Dict[int, Callable[[Reader, int], Frame]] = {
    Declare.TYPE: _d_declare,
    Delete.TYPE: lambda r, v: Delete(r.u64("request_id"), r.string("queue")),
    Purge.TYPE: lambda r, v: Purge(r.u64("request_id"), r.string("queue")),
    QueueInfo.TYPE: lambda r, v: QueueInfo(r.u64("request_id"), r.string("queue")),
    QueueList.TYPE: lambda r, v: QueueList(r.u64("request_id")),
    SetQueueSettings.TYPE: _d_set,
    Publish.TYPE: _d_publish,
    Subscribe.TYPE: _d_subscribe,
    Cancel.TYPE: lambda r, v: Cancel(r.u64("request_id"), r.string("consumer_tag")),
    Ack.TYPE: lambda r, v: Ack(_read_ids(r)),
    Reject.TYPE: lambda r, v: Reject(_read_ids(r), r.boolean("requeue")),
    Ok.TYPE: lambda r, v: Ok(r.u64("request_id")),
    QueueInfoReply.TYPE: _d_info_reply,
    QueueListReply.TYPE: _d_list_reply,
    SubscribeOk.TYPE: lambda r, v: SubscribeOk(r.u64("request_id"), r.string("consumer_tag")),
    Confirm.TYPE: lambda r, v: Confirm(_read_ranges(r)),
    PublishError.TYPE: lambda r, v: PublishError(_read_ranges(r), read_error_body(r, v)),
    Deliver.TYPE: _d_deliver,
    ConsumerEnd.TYPE: lambda r, v: ConsumerEnd(r.string("consumer_tag"), read_error_body(r, v)),
    Heartbeat.TYPE: lambda r, v: Heartbeat(),
    Error.TYPE: lambda r, v: Error(r.opt_u64("request_id"), r.boolean("fatal"), read_error_body(r, v)),
    Close.TYPE: lambda r, v: Close(r.string("message")),
}


# --------------------------------------------------------------------------------------------
# Stream frames (version 7; protocol.md "Stream frames (version 7)")


@dataclass
class StreamSettings:
    """protocol.md "Stream settings". An absent bound is no bound of that kind."""

    partitions: int = 1
    replicas: Optional[int] = None
    max_bytes: Optional[int] = None
    max_age_ms: Optional[int] = None
    max_messages: Optional[int] = None


def put_stream_settings(w: Writer, s: StreamSettings) -> None:
    w.u32(s.partitions)
    w.opt_u32(s.replicas)
    w.opt_u64(s.max_bytes)
    w.opt_u64(s.max_age_ms)
    w.opt_u64(s.max_messages)


def read_stream_settings(r: Reader) -> StreamSettings:
    return StreamSettings(
        r.u32("partitions"),
        r.opt_u32("replicas"),
        r.opt_u64("max_bytes"),
        r.opt_u64("max_age_ms"),
        r.opt_u64("max_messages"),
    )


@dataclass
class StreamStart:
    """``StreamSubscribe.start``: ``kind`` one of the ``START_*`` numbers; ``value`` the
    offset (3) or the time in ms since the Unix epoch (4), 0 for the others."""

    kind: int = START_FIRST
    value: int = 0


@dataclass
class CursorEntry:
    """One partition's position in a ``CursorCommit``: the offset of the next message."""

    partition: int
    offset: int


@dataclass
class StreamPartitionInfo:
    """One partition of a ``StreamInfoReply`` (the answering node's copy)."""

    start_offset: int
    next_offset: int
    messages: int
    bytes: int
    disk_bytes: int
    oldest_timestamp_ms: Optional[int] = None
    leading: bool = True
    leader: Optional[int] = None
    leader_addr: Optional[str] = None


@dataclass
class StreamSummary:
    """One stream of a ``StreamListReply``."""

    stream: str
    partitions: int
    messages: int
    bytes: int


@dataclass
class StreamMessage:
    """One message of a ``StreamDeliver``."""

    offset: int
    timestamp_ms: int
    routing_key: Optional[str]
    headers: List[Tuple[str, str]]
    body: bytes


@dataclass
class StreamDeclare:
    request_id: int
    stream: str
    settings: StreamSettings
    nodes: List[int] = field(default_factory=list)
    TYPE = 0x07


@dataclass
class StreamSet:
    request_id: int
    stream: str
    max_bytes: Update = field(default_factory=Update)
    max_age_ms: Update = field(default_factory=Update)
    max_messages: Update = field(default_factory=Update)
    TYPE = 0x08


@dataclass
class StreamInfo:
    request_id: int
    stream: str
    TYPE = 0x09


@dataclass
class StreamList:
    request_id: int
    TYPE = 0x0A


@dataclass
class StreamDelete:
    request_id: int
    stream: str
    TYPE = 0x0B


@dataclass
class StreamSubscribe:
    request_id: int
    stream: str
    consumer_tag: str
    cursor: Optional[str] = None
    group: bool = False
    start: StreamStart = field(default_factory=StreamStart)
    credit: int = 0
    auto_commit: bool = False
    partitions: List[int] = field(default_factory=list)
    TYPE = 0x24


@dataclass
class StreamCredit:
    consumer_tag: str
    credit: int
    TYPE = 0x25


@dataclass
class CursorCommit:
    request_id: int
    stream: str
    cursor: str
    entries: List[CursorEntry] = field(default_factory=list)
    TYPE = 0x26


@dataclass
class StreamInfoReply:
    request_id: int
    stream: str
    settings: StreamSettings
    partitions: List[StreamPartitionInfo]
    TYPE = 0x44


@dataclass
class StreamListReply:
    request_id: int
    streams: List[StreamSummary]
    TYPE = 0x45


@dataclass
class StreamDeliver:
    consumer_tag: str
    partition: int
    moved_from: Optional[int]
    messages: List[StreamMessage]
    TYPE = 0x62


@dataclass
class StreamPartitionEnd:
    consumer_tag: str
    partition: int
    error: ErrorBody
    TYPE = 0x63


STREAM_FRAMES = (
    StreamDeclare, StreamSet, StreamInfo, StreamList, StreamDelete, StreamSubscribe,
    StreamCredit, CursorCommit, StreamInfoReply, StreamListReply, StreamDeliver,
    StreamPartitionEnd,
)
#: Smallest encodings of list items, for the count checks: a partition info is at least 44
#: bytes, a stream summary 22, a stream message 8 + 8 + 1 + 2 + 4.
_STREAM_PARTITION_INFO_MIN = 44
_STREAM_SUMMARY_MIN = 2 + 4 + 8 + 8
_STREAM_MESSAGE_MIN = 8 + 8 + 1 + 2 + 4


def _put_bounded(w: Writer, what: str, count: int, bound: int, width: int = 2) -> None:
    if count > bound:
        raise ValueError("%s lists %d items; at most %d fit a stream frame" % (what, count, bound))
    if width == 2:
        w.u16(count)
    else:
        w.u32(count)


def _read_bounded(r: Reader, width: int, bound: int, item_min_bytes: int, what: str) -> int:
    """A list count of a stream frame, refused above its bound before anything is read."""
    start = r.pos
    n = r.u16(what) if width == 2 else r.u32(what)
    if n > bound:
        r.pos = start
        raise r.fail("%s count %d is over its bound of %d" % (what, n, bound))
    if n * item_min_bytes > r.left():
        raise r.fail("%s count %d cannot fit the %d bytes left" % (what, n, r.left()))
    return n


def _encode_stream_body(w: Writer, f: Frame) -> None:
    if isinstance(f, StreamDeclare):
        w.u64(f.request_id)
        w.string(f.stream, "stream")
        put_stream_settings(w, f.settings)
        _put_bounded(w, "nodes", len(f.nodes), STREAM_NODES_MAX)
        for node in f.nodes:
            w.u64(node)
    elif isinstance(f, StreamSet):
        w.u64(f.request_id)
        w.string(f.stream, "stream")
        for update in (f.max_bytes, f.max_age_ms, f.max_messages):
            _put_update(w, update, w.u64)  # type: ignore[arg-type]
    elif isinstance(f, (StreamInfo, StreamDelete)):
        w.u64(f.request_id)
        w.string(f.stream, "stream")
    elif isinstance(f, StreamList):
        w.u64(f.request_id)
    elif isinstance(f, StreamSubscribe):
        if f.start.kind not in START_NAMES:
            raise ValueError("start kind %d is not 0 to 4" % f.start.kind)
        if f.start.kind < START_OFFSET and f.start.value != 0:
            raise ValueError("start %s takes no value" % START_NAMES[f.start.kind])
        w.u64(f.request_id)
        w.string(f.stream, "stream")
        w.string(f.consumer_tag, "consumer_tag")
        w.opt_string(f.cursor)
        w.boolean(f.group)
        w.u8(f.start.kind)
        w.u64(f.start.value)
        w.u32(f.credit)
        w.boolean(f.auto_commit)
        _put_bounded(w, "partitions", len(f.partitions), STREAM_PARTITIONS_MAX)
        for partition in f.partitions:
            w.u32(partition)
    elif isinstance(f, StreamCredit):
        w.string(f.consumer_tag, "consumer_tag")
        w.u32(f.credit)
    elif isinstance(f, CursorCommit):
        w.u64(f.request_id)
        w.string(f.stream, "stream")
        w.string(f.cursor, "cursor")
        _put_bounded(w, "entries", len(f.entries), STREAM_PARTITIONS_MAX)
        for entry in f.entries:
            w.u32(entry.partition)
            w.u64(entry.offset)
    elif isinstance(f, StreamInfoReply):
        w.u64(f.request_id)
        w.string(f.stream, "stream")
        put_stream_settings(w, f.settings)
        _put_bounded(w, "partitions", len(f.partitions), STREAM_PARTITIONS_MAX)
        for p in f.partitions:
            for n in (p.start_offset, p.next_offset, p.messages, p.bytes, p.disk_bytes):
                w.u64(n)
            w.opt_u64(p.oldest_timestamp_ms)
            w.boolean(p.leading)
            w.opt_u64(p.leader)
            w.opt_string(p.leader_addr)
    elif isinstance(f, StreamListReply):
        w.u64(f.request_id)
        w.u32(len(f.streams))
        for s in f.streams:
            w.string(s.stream, "stream")
            w.u32(s.partitions)
            w.u64(s.messages)
            w.u64(s.bytes)
    elif isinstance(f, StreamDeliver):
        w.string(f.consumer_tag, "consumer_tag")
        w.u32(f.partition)
        w.opt_u64(f.moved_from)
        _put_bounded(w, "messages", len(f.messages), STREAM_DELIVER_MESSAGES_MAX, width=4)
        for m in f.messages:
            w.u64(m.offset)
            w.u64(m.timestamp_ms)
            w.opt_string(m.routing_key)
            w.headers(m.headers)
            w.bytes_(m.body)
    elif isinstance(f, StreamPartitionEnd):
        w.string(f.consumer_tag, "consumer_tag")
        w.u32(f.partition)
        put_error_body(w, f.error, STREAM_VERSION)
    else:  # pragma: no cover - encode_body hands only stream frames here
        raise TypeError("not a stream frame: %r" % (f,))


def _d_stream_declare(r: Reader, v: int) -> Frame:
    request_id, stream = r.u64("request_id"), r.string("stream")
    settings = read_stream_settings(r)
    n = _read_bounded(r, 2, STREAM_NODES_MAX, 8, "nodes")
    return StreamDeclare(request_id, stream, settings, [r.u64("node") for _ in range(n)])


def _d_stream_set(r: Reader, v: int) -> Frame:
    request_id, stream = r.u64("request_id"), r.string("stream")
    updates = [_read_update(r, name, lambda: r.u64(name)) for name in ("max_bytes", "max_age_ms", "max_messages")]
    return StreamSet(request_id, stream, *updates)


def _d_stream_subscribe(r: Reader, v: int) -> Frame:
    request_id, stream = r.u64("request_id"), r.string("stream")
    tag, cursor = r.string("consumer_tag"), r.opt_string("cursor")
    group = r.boolean("group")
    kind = r.u8("start.kind")
    if kind not in START_NAMES:
        raise r.fail("start kind %d is not 0 to 4" % kind)
    value = r.u64("start.value")
    if kind < START_OFFSET and value != 0:
        raise r.fail("start %s with value %d (must be 0)" % (START_NAMES[kind], value))
    credit, auto_commit = r.u32("credit"), r.boolean("auto_commit")
    n = _read_bounded(r, 2, STREAM_PARTITIONS_MAX, 4, "partitions")
    partitions = [r.u32("partition") for _ in range(n)]
    return StreamSubscribe(
        request_id, stream, tag, cursor, group, StreamStart(kind, value), credit, auto_commit, partitions
    )


def _d_cursor_commit(r: Reader, v: int) -> Frame:
    request_id, stream, cursor = r.u64("request_id"), r.string("stream"), r.string("cursor")
    n = _read_bounded(r, 2, STREAM_PARTITIONS_MAX, 12, "entries")
    entries = [CursorEntry(r.u32("partition"), r.u64("offset")) for _ in range(n)]
    return CursorCommit(request_id, stream, cursor, entries)


def _d_stream_info_reply(r: Reader, v: int) -> Frame:
    request_id, stream = r.u64("request_id"), r.string("stream")
    settings = read_stream_settings(r)
    partitions = []
    for _ in range(_read_bounded(r, 2, STREAM_PARTITIONS_MAX, _STREAM_PARTITION_INFO_MIN, "partitions")):
        counts = [r.u64(n) for n in ("start_offset", "next_offset", "messages", "bytes", "disk_bytes")]
        oldest = r.opt_u64("oldest_timestamp_ms")
        leading = r.boolean("leading")
        leader, addr = r.opt_u64("leader"), r.opt_string("leader_addr")
        partitions.append(StreamPartitionInfo(*counts, oldest, leading, leader, addr))  # type: ignore[misc]
    return StreamInfoReply(request_id, stream, settings, partitions)


def _d_stream_list_reply(r: Reader, v: int) -> Frame:
    request_id = r.u64("request_id")
    streams = []
    for _ in range(r.count(4, _STREAM_SUMMARY_MIN, "streams")):
        name = r.string("stream")
        streams.append(StreamSummary(name, r.u32("partitions"), r.u64("messages"), r.u64("bytes")))
    return StreamListReply(request_id, streams)


def _d_stream_deliver(r: Reader, v: int) -> Frame:
    tag, partition = r.string("consumer_tag"), r.u32("partition")
    moved_from = r.opt_u64("moved_from")
    messages = []
    for _ in range(_read_bounded(r, 4, STREAM_DELIVER_MESSAGES_MAX, _STREAM_MESSAGE_MIN, "messages")):
        offset, timestamp_ms = r.u64("offset"), r.u64("timestamp_ms")
        key = r.opt_string("routing_key")
        headers = r.headers()
        messages.append(StreamMessage(offset, timestamp_ms, key, headers, r.bytes_("body")))
    return StreamDeliver(tag, partition, moved_from, messages)


_STREAM_DECODERS: Dict[int, Callable[[Reader, int], Frame]] = {
    StreamDeclare.TYPE: _d_stream_declare,
    StreamSet.TYPE: _d_stream_set,
    StreamInfo.TYPE: lambda r, v: StreamInfo(r.u64("request_id"), r.string("stream")),
    StreamList.TYPE: lambda r, v: StreamList(r.u64("request_id")),
    StreamDelete.TYPE: lambda r, v: StreamDelete(r.u64("request_id"), r.string("stream")),
    StreamSubscribe.TYPE: _d_stream_subscribe,
    StreamCredit.TYPE: lambda r, v: StreamCredit(r.string("consumer_tag"), r.u32("credit")),
    CursorCommit.TYPE: _d_cursor_commit,
    StreamInfoReply.TYPE: _d_stream_info_reply,
    StreamListReply.TYPE: _d_stream_list_reply,
    StreamDeliver.TYPE: _d_stream_deliver,
    StreamPartitionEnd.TYPE: lambda r, v: StreamPartitionEnd(
        r.string("consumer_tag"), r.u32("partition"), read_error_body(r, v)
    ),
}


FRAME_TYPES.update({cls.TYPE: cls for cls in STREAM_FRAMES})
_DECODERS.update(_STREAM_DECODERS)
#: Frame types a client may receive (server to client, and both ways).
CLIENT_RECEIVES = frozenset(t for t in FRAME_TYPES if t >= 0x40)


# --------------------------------------------------------------------------------------------
# Handshake


@dataclass
class ClientHello:
    """protocol.md "ClientHello". ``mechanism`` 0 none, 1 plain, 2 external, 3 token."""

    version: int
    client_name: str
    mechanism: int = MECHANISM_NONE
    user: Optional[str] = None
    password: Optional[str] = None
    token: Optional[str] = None


def _check_login(what: str, value: Optional[str], limit: int) -> str:
    if value is None:
        raise ValueError("%s is missing" % what)
    size = len(value.encode("utf-8"))
    if not 1 <= size <= limit:
        raise ValueError("%s must be 1 to %d bytes, not %d" % (what, limit, size))
    return value


def encode_client_hello(hello: ClientHello) -> bytes:
    w = Writer()
    w.buf += MAGIC
    w.u16(hello.version)
    w.string(hello.client_name, "client name")
    if hello.version >= 6:
        w.u8(hello.mechanism)
        if hello.mechanism == MECHANISM_PLAIN:
            w.string(_check_login("user", hello.user, AUTH_USER_BYTES_MAX))
            w.string(_check_login("password", hello.password, AUTH_PASSWORD_BYTES_MAX))
        elif hello.mechanism == MECHANISM_TOKEN:
            w.string(_check_login("token", hello.token, AUTH_TOKEN_BYTES_MAX))
        elif hello.mechanism not in (MECHANISM_NONE, MECHANISM_EXTERNAL):
            raise ValueError("login mechanism %d is not 0 to 3" % hello.mechanism)
    elif hello.mechanism != MECHANISM_NONE:
        raise ValueError("a login needs protocol version 6; this hello is version %d" % hello.version)
    return bytes(w.buf)


def decode_client_hello(data: bytes) -> ClientHello:
    """A complete ``ClientHello`` (used by tests and fake servers)."""
    r = Reader(data, "ClientHello")
    if bytes(r.take(4, "magic")) != MAGIC:
        raise r.fail("magic is not KRTN")
    version, name = r.u16("version"), r.string("client_name")
    hello = ClientHello(version, name)
    if version >= 6:
        hello.mechanism = r.u8("mechanism")
        if hello.mechanism == MECHANISM_PLAIN:
            hello.user = r.string("user", AUTH_USER_BYTES_MAX)
            hello.password = r.string("password", AUTH_PASSWORD_BYTES_MAX)
        elif hello.mechanism == MECHANISM_TOKEN:
            hello.token = r.string("token", AUTH_TOKEN_BYTES_MAX)
        elif hello.mechanism > MECHANISM_TOKEN:
            raise r.fail("login mechanism %d is not 0 to 3" % hello.mechanism)
    r.end()
    return hello


@dataclass
class NodeAddress:
    """One node of the server info."""

    node_id: str
    server: str
    admin: Optional[str] = None


@dataclass
class ServerInfo:
    """protocol.md "Server info": where to reach this node and its cluster."""

    admin: Optional[str] = None
    nodes: List[NodeAddress] = field(default_factory=list)


@dataclass
class ServerHello:
    """protocol.md "ServerHello": accepted (``error`` None) or refused."""

    version: int
    node_id: str = ""
    info: Optional[ServerInfo] = None
    user: Optional[str] = None
    error: Optional[ErrorBody] = None

    @property
    def accepted(self) -> bool:
        return self.error is None


def encode_server_hello(hello: ServerHello) -> bytes:
    w = Writer()
    w.buf += MAGIC
    w.u16(hello.version)
    if hello.error is not None:
        w.u8(1)
        put_error_body(w, hello.error, hello.version, leader=False)
        return bytes(w.buf)
    w.u8(0)
    w.string(hello.node_id, "node_id")
    if hello.version >= 3:
        info = hello.info or ServerInfo()
        w.opt_string(info.admin)
        w.u16(len(info.nodes))
        for node in info.nodes:
            w.string(node.node_id)
            w.string(node.server)
            w.opt_string(node.admin)
    if hello.version >= 6:
        w.opt_string(hello.user)
    return bytes(w.buf)


def decode_server_hello(data: bytes, offered: int = PROTOCOL_VERSION, partial: bool = False) -> Tuple[ServerHello, int]:
    """The ``ServerHello`` at the start of ``data`` and its size. With ``partial`` a hello that
    is not complete yet raises :class:`Incomplete`; a refused hello is read in the layout of
    ``offered`` when it names a newer version."""
    r = Reader(data, "ServerHello", incomplete=partial)
    magic = bytes(r.take(4, "magic"))
    if magic != MAGIC:
        raise r.fail("magic is %r, not KRTN: the peer does not speak the Keratin protocol" % magic)
    version = r.u16("version")
    status = r.u8("status")
    if status == 1:
        error = read_error_body(r, version, leader=False)
        return ServerHello(version, error=error), r.pos
    if status != 0:
        raise r.fail("status %d is neither 0 nor 1" % status)
    if not PROTOCOL_VERSION_MIN <= version <= offered:
        raise r.fail("accepted version %d, but the client offered %d" % (version, offered))
    limit = SERVER_INFO_FIELD_BYTES_MAX
    node_id = r.string("node_id")
    info = None
    if version >= 3:
        admin = r.opt_string("info.admin", limit)
        count = r.u16("info.nodes")
        if count > SERVER_INFO_NODES_MAX:
            raise r.fail("info.nodes lists %d nodes, over the bound of 64" % count)
        nodes = [
            NodeAddress(r.string("node_id", limit), r.string("server", limit), r.opt_string("admin", limit))
            for _ in range(count)
        ]
        info = ServerInfo(admin, nodes)
    user = r.opt_string("user", 255) if version >= 6 else None
    return ServerHello(version, node_id, info, user), r.pos


