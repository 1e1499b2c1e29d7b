"""Reading streams (protocol version 7; ``docs/streams.md``, "Reading"): the
:class:`StreamConsumer` (an async iterator of :class:`StreamDelivery`, and an async context
manager that cancels it on exit), its credit, and its cursor commits.

Owns the reader's bounded buffer: the node sends no more messages than the credit the reader
gave (``StreamSubscribe.credit`` plus every ``StreamCredit``), so the messages received and not
yet yielded never exceed ``credit``; more is a protocol violation and ends the connection.
The reader gives back what the application took once half of ``credit`` is taken, so a
reader that keeps up never waits for credit.

A stream message is never acknowledged: a reader's position is its cursor's, committed by
:meth:`StreamConsumer.commit` (or by the node every second with ``auto_commit``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple, Union

from . import _wire as w
from ._connection import Connection, _Sink
from .errors import (
    ConflictError,
    ConnectionLostError,
    KeratinError,
    NotFoundError,
    ProtocolError,
    StreamsUnsupportedError,
    error_from_body,
)

if TYPE_CHECKING:
    from .client import Client

__all__ = ["StreamConsumer", "StreamDelivery", "StreamInfo", "StreamSummary", "KEEP"]

log = logging.getLogger("keratin")

#: ``set_stream``'s default: the setting keeps its value (``None`` clears it).
KEEP: Any = type("Keep", (), {"__repr__": lambda self: "keratin.KEEP"})()

#: Largest ``credit`` (``StreamSubscribe.credit`` is a u32).
STREAM_CREDIT_MAX = 0xFFFFFFFF

StreamSummary = w.StreamSummary

Start = Union[str, Tuple[str, int]]


def require_streams(conn: Connection) -> None:
    """Raises :class:`~keratin.StreamsUnsupportedError` on a connection older than 7."""
    if conn.version < w.STREAM_VERSION:
        raise StreamsUnsupportedError(
            "the broker speaks protocol %d; streams need %d" % (conn.version, w.STREAM_VERSION)
        )


def start_from(start: Start) -> w.StreamStart:
    """``"first"``, ``"last"``, ``"next"``, ``("offset", n)`` or ``("timestamp", ms)``."""
    if isinstance(start, str):
        for kind in (w.START_FIRST, w.START_LAST, w.START_NEXT):
            if w.START_NAMES[kind] == start:
                return w.StreamStart(kind, 0)
    elif isinstance(start, tuple) and len(start) == 2 and isinstance(start[1], int):
        name, value = start
        if name in ("offset", "timestamp") and 0 <= value < 1 << 64:
            return w.StreamStart(w.START_OFFSET if name == "offset" else w.START_TIMESTAMP, value)
    raise ValueError(
        "start must be 'first', 'last', 'next', ('offset', n) or ('timestamp', ms), not %r" % (start,)
    )


@dataclass
class StreamInfo:
    """A stream's settings and per-partition figures (``StreamInfoReply``), those of the
    answering node's copy."""

    stream: str
    settings: w.StreamSettings
    partitions: List[w.StreamPartitionInfo] = field(default_factory=list)

    @property
    def messages(self) -> int:
        """Messages held, over all partitions."""
        return sum(p.messages for p in self.partitions)

    @property
    def bytes(self) -> int:
        """Their payload bytes, over all partitions."""
        return sum(p.bytes for p in self.partitions)


@dataclass
class StreamDelivery:
    """One message read from a stream. ``moved_from`` is set on the first message read after
    retention moved the reader: the offset it stood at, below the partition's start."""

    partition: int
    offset: int
    timestamp_ms: int
    key: Optional[str]
    headers: Dict[str, str]
    body: bytes
    moved_from: Optional[int] = None
    #: Every header in order, repeated names included.
    header_list: List[Tuple[str, str]] = field(default_factory=list, repr=False)


class _Reader(_Sink):
    """One ``StreamSubscribe`` on one connection: holds what the node sent and the
    application has not taken yet, at most ``credit`` messages."""

    def __init__(self, consumer: "StreamConsumer", conn: Connection, tag: str) -> None:
        self.consumer = consumer
        self.conn = conn
        self.tag = tag
        self.ended = False

    def push(self, frame: Any) -> None:
        consumer = self.consumer
        if isinstance(frame, w.StreamPartitionEnd):
            consumer._partition_end(frame)
            return
        count = len(frame.messages)
        if count > consumer._credit_left:
            raise ProtocolError(
                "%s sent stream reader %s %d messages with %d credit left"
                % (self.conn.address, self.tag, count, consumer._credit_left)
            )
        consumer._credit_left -= count
        moved_from = frame.moved_from
        if count == 0 and moved_from is not None:
            consumer.moved[frame.partition] = moved_from
        for m in frame.messages:
            delivery = StreamDelivery(
                frame.partition, m.offset, m.timestamp_ms, m.routing_key, dict(m.headers),
                m.body, moved_from, m.headers,
            )
            if moved_from is not None:
                consumer.moved[frame.partition] = moved_from
                moved_from = None
            consumer._items.append(delivery)
        consumer._wake()

    def end(self, error: KeratinError) -> None:
        self.ended = True
        self.consumer._end(error)


class StreamConsumer:
    """``async for delivery in client.stream_subscribe("events", cursor="billing")``.

    Subscribes on first use (``async with`` or the first iteration). Iteration ends
    (``StopAsyncIteration``) after :meth:`cancel`; it raises
    :class:`~keratin.ConnectionLostError` when the connection is lost, and
    :class:`~keratin.NotFoundError` when the stream is deleted (the node ends every partition
    with ``StreamPartitionEnd`` 404). Another partition end is recorded in
    :attr:`ended_partitions` and logged, and the other partitions go on: 409 in a group, the
    partition was handed to another member (it leaves :attr:`positions`: that member commits
    it now; messages of it received before are still yielded); 421, the node stopped leading
    the stream's cursor log (subscribe again: the new one resumes from the cursor's commit).
    """

    def __init__(
        self,
        client: "Client",
        stream: str,
        cursor: Optional[str],
        start: Start,
        credit: int,
        auto_commit: bool,
        partitions: Optional[List[int]],
        group: bool = False,
    ) -> None:
        if not 1 <= credit <= STREAM_CREDIT_MAX:
            raise ValueError("credit must be 1 to %d, not %d" % (STREAM_CREDIT_MAX, credit))
        if auto_commit and cursor is None:
            raise ValueError("auto_commit needs a cursor: a reader without one keeps no position")
        if group and cursor is None:
            raise ValueError("a group needs a cursor: its members share the cursor's partitions")
        if group and partitions:
            raise ValueError("a group member reads the partitions its group assigns: pass no partitions")
        if partitions is not None and len(partitions) > w.STREAM_PARTITIONS_MAX:
            raise ValueError("a stream has at most %d partitions" % w.STREAM_PARTITIONS_MAX)
        self._client = client
        self.stream = stream
        self.cursor = cursor
        self.start_position = start_from(start)
        self.credit = credit
        self.auto_commit = auto_commit
        self.partitions = list(partitions) if partitions else []
        self.group = group
        # Per partition handed to another group member: its messages still in ``_items``
        # from before, yielded without becoming a position again.
        self._handed_over: Dict[int, int] = {}
        #: Per partition, the offset after the last message yielded (what :meth:`commit` sends).
        self.positions: Dict[int, int] = {}
        #: Per partition, the last ``moved_from`` the node reported.
        self.moved: Dict[int, int] = {}
        #: Partitions the node stopped reading, with its reason.
        self.ended_partitions: Dict[int, KeratinError] = {}
        self._items: Deque[StreamDelivery] = collections.deque()
        self._error: Optional[KeratinError] = None
        self._event = asyncio.Event()
        self._reader: Optional[_Reader] = None
        self._credit_left = 0
        self._taken = 0
        self._started = False
        self._finished = False

    @property
    def tag(self) -> Optional[str]:
        """The consumer tag of the subscription."""
        return self._reader.tag if self._reader else None

    async def start(self) -> "StreamConsumer":
        """Subscribes (``StreamSubscribe``). In a cluster the node leading the stream's cursor
        log serves its readers: another node answers 421 naming it, and the subscription is
        made there (on a connection to that node, which the reader then uses)."""
        if self._started:
            return self
        self._started = True
        try:
            await self._client._routed("subscribe to stream %s" % self.stream, self._subscribe_on)
        except BaseException:
            self._finished = True
            raise
        return self

    async def _subscribe_on(self, conn: Connection) -> None:
        require_streams(conn)
        tag = conn.next_tag()
        reader = _Reader(self, conn, tag)
        conn.add_consumer(tag, reader)
        # Current before the reply: a StreamDeliver may follow SubscribeOk at once.
        self._reader = reader
        self._credit_left = self.credit
        frame = w.StreamSubscribe(
            0, self.stream, tag, self.cursor, self.group, self.start_position, self.credit,
            self.auto_commit, self.partitions,
        )
        try:
            await conn.request(frame)
        except BaseException:
            conn.remove_consumer(tag)
            self._reader = None
            raise

    def _wake(self) -> None:
        self._event.set()

    def _end(self, error: KeratinError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _partition_end(self, frame: w.StreamPartitionEnd) -> None:
        error = error_from_body(
            frame.error, "stream %s partition %d ended: " % (self.stream, frame.partition)
        )
        self.ended_partitions[frame.partition] = error
        if isinstance(error, ConflictError):
            self.positions.pop(frame.partition, None)
            left = sum(1 for d in self._items if d.partition == frame.partition)
            if left:
                self._handed_over[frame.partition] = left
            log.info("stream reader %s: %s", self.tag, error)
            return
        if isinstance(error, NotFoundError):
            self._end(error)
        else:
            log.warning("stream reader %s: %s", self.tag, error)

    def __aiter__(self) -> "StreamConsumer":
        return self

    async def __anext__(self) -> StreamDelivery:
        if self._finished:
            raise StopAsyncIteration
        await self.start()
        while not self._items:
            if self._finished:
                raise StopAsyncIteration
            if self._error is not None:
                self._finished = True
                if self._reader is not None:
                    self._reader.conn.remove_consumer(self._reader.tag)
                raise self._error
            self._event.clear()
            await self._event.wait()
        delivery = self._items.popleft()
        left = self._handed_over.get(delivery.partition)
        if left is None:
            self.positions[delivery.partition] = delivery.offset + 1
        elif left > 1:
            self._handed_over[delivery.partition] = left - 1
        else:
            del self._handed_over[delivery.partition]
        self._taken += 1
        await self._top_up()
        return delivery

    async def _top_up(self) -> None:
        """Gives back the credit of the messages taken once half of ``credit`` is taken."""
        reader = self._reader
        if reader is None or self._taken < max(1, self.credit // 2):
            return
        if reader.ended or not reader.conn.is_connected:
            return
        taken, self._taken = self._taken, 0
        self._credit_left += taken
        try:
            await reader.conn.send(w.StreamCredit(reader.tag, taken))
        except KeratinError as e:
            # The delivery in hand is still the application's; a lost connection ends the
            # reader through its sink, and the next iteration raises it.
            log.debug("credit for stream reader %s not sent: %s", reader.tag, e)

    async def commit(self) -> None:
        """Commits to the cursor, per partition, the offset after the last message yielded
        (``CursorCommit``); returns once the node made it durable. Nothing to commit (no
        message yielded) sends nothing."""
        if self.cursor is None:
            raise KeratinError("a reader without a cursor has no position to commit")
        if self.positions:
            await self._client.commit_cursor(self.stream, self.cursor, dict(self.positions))

    async def cancel(self) -> None:
        """Stops reading (``Cancel``); with ``auto_commit`` the node commits the delivered
        positions before it answers. Iteration ends. Idempotent."""
        if self._finished:
            return
        self._finished = True
        self._wake()
        reader = self._reader
        if reader is None or reader.ended or not reader.conn.is_connected:
            return
        await reader.conn.cancel_consumer(reader.tag)

    async def __aenter__(self) -> "StreamConsumer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.cancel()
