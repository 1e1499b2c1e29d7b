"""The :class:`Client` and :func:`connect`: the admin verbs (declare, info, list, purge,
delete, settings) and the routing across cluster nodes on 421 ``ERR_NOT_LEADER``.

Owns the connections to other nodes (opened on demand with the same options), the
remembered leader of each queue, and the bounded loop that follows a 421: to the node it
names, or, when it names none, after a short backoff to the nodes the handshake listed, in
turn, at most :data:`NOT_LEADER_RETRIES_MAX` times within the call's timeout (the Rust
client's ``routing.rs``). Publishing lives in ``publisher.py``, consuming in ``consumer.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from . import _wire as w
from ._connection import Connection, Options, random_producer_id
from .errors import (
    ConnectError,
    KeratinError,
    KeratinTimeoutError,
    NotLeaderError,
)
from .stream import KEEP as _KEEP
from .stream import StreamConsumer, StreamInfo, require_streams
from .tls import TLSArg, resolve

log = logging.getLogger("keratin")

if TYPE_CHECKING:
    from .consumer import Consumer
    from .publisher import BufferedPublisher, DroppedPublish

__all__ = [
    "Client",
    "connect",
    "QueueInfo",
    "NOT_LEADER_RETRIES_MAX",
    "NOT_LEADER_BACKOFF_MIN",
    "NOT_LEADER_BACKOFF_MAX",
]

#: Most times one call follows a 421 before it raises :class:`NotLeaderError`: a leadership
#: move needs one redirect, an election a few backoffs; 128 attempts at 250 ms are about
#: 32 s, just past the default publish timeout, so the count bounds a ping-pong between two
#: nodes that disagree and the timeout bounds everything else (as in the Rust client).
NOT_LEADER_RETRIES_MAX = 128
#: First wait after a 421 that names no leader (seconds).
NOT_LEADER_BACKOFF_MIN = 0.1
#: Longest wait between attempts after 421s without a leader: a quarter of the shortest
#: election timeout (500 ms), so a new leader is noticed within about a quarter second.
NOT_LEADER_BACKOFF_MAX = 0.25
#: Redirects to a named leader made without waiting; later ones (two nodes naming each other
#: while a leadership moves) back off like a 421 without a leader. A move needs one redirect.
NOT_LEADER_IMMEDIATE_MAX = 2
#: Most connections to other nodes one client keeps: a handshake lists at most 64 nodes.
PEERS_MAX = 64
#: Most queues whose leader a client remembers; past it the memory starts over.
LEADER_HINTS_MAX = 1024
#: After a queue's partition leaders could not be read, they are asked again this much later
#: (seconds); meanwhile publishes follow 421s per queue.
LAYOUT_RETRY = 5.0

T = TypeVar("T")
_UNSET: Any = object()


def not_leader_backoff(retry: int, hint_ms: Optional[int]) -> float:
    """The wait (seconds) before attempt ``retry`` (1 for the first retry) after a 421 without
    a leader: doubling from the minimum, at least the server's hint, at most the maximum."""
    doublings = min(max(retry - 1, 0), 8)
    backoff = NOT_LEADER_BACKOFF_MIN * (1 << doublings)
    hint = (hint_ms or 0) / 1000.0
    return min(max(backoff, hint), NOT_LEADER_BACKOFF_MAX)


@dataclass
class QueueInfo:
    """A queue's settings and per-partition counts (``QueueInfoReply``). The counts are those
    of the answering node's copy."""

    queue: str
    settings: w.QueueSettings
    partitions: List[w.PartitionInfo] = field(default_factory=list)

    @property
    def ready(self) -> int:
        """Messages waiting for delivery, over all partitions."""
        return sum(p.ready for p in self.partitions)

    @property
    def inflight(self) -> int:
        """Messages delivered and not yet acknowledged, over all partitions."""
        return sum(p.inflight for p in self.partitions)

    @property
    def bytes(self) -> int:
        """Message bytes held (ready and inflight), over all partitions."""
        return sum(p.bytes for p in self.partitions)


class Client:
    """A connection to a Keratin node (and, on demand, to the other nodes of its cluster).

    Build it with :func:`keratin.connect`. It does not reconnect by itself: once its
    connection is lost every call raises :class:`~keratin.ConnectionLostError`; connect again
    and decide what to republish.
    """

    def __init__(
        self,
        conn: Connection,
        options: Options,
        producer_id: Optional[int],
        seeds: Sequence[str] = (),
        own_producer: bool = False,
    ) -> None:
        self._conn = conn
        # The addresses given to connect(): known nodes too, for a handshake taken before the
        # node knew its cluster (it then lists itself alone).
        self._seeds = [a for a in seeds if a != conn.address]
        self._options = options
        self._producer_id = producer_id
        # A producer id the application chose: its sequences are the application's too.
        self._own_producer = own_producer
        self._sequence = 0
        self._peers: Dict[str, Connection] = {}
        self._peers_lock = asyncio.Lock()
        self._leaders: Dict[str, str] = {}
        # Per queue: each partition's leader address (None: not known), from the queue's
        # info and the 421s since; None for a queue whose info could not be read (asked again
        # after LAYOUT_RETRY). Shared asks, so that publishes waiting for one keep their order.
        self._layouts: Dict[str, Tuple[float, Optional[List[Optional[str]]]]] = {}
        self._layout_asks: Dict[str, "asyncio.Future[Optional[List[Optional[str]]]]"] = {}
        # Messages without key or producer number sent so far: they go to each partition's
        # leader in turn.
        self._spread = 0

    # ---------------------------------------------------------------------------------------
    # Identity and lifecycle

    @property
    def user(self) -> Optional[str]:
        """The user the node logged this connection in as; ``None`` without a login."""
        return self._conn.user

    @property
    def server_info(self) -> w.ServerInfo:
        """Where to reach this node (its admin address) and the nodes of its cluster."""
        return self._conn.server_info

    @property
    def node_id(self) -> str:
        """The name of the node this client is connected to."""
        return self._conn.node_id

    @property
    def address(self) -> str:
        """The address this client connected to."""
        return self._conn.address

    @property
    def protocol_version(self) -> int:
        """The protocol version both sides speak (6 with a current node)."""
        return self._conn.version

    @property
    def producer_id(self) -> Optional[int]:
        """The idempotent producer id publishes carry; ``None`` when not idempotent."""
        return self._producer_id

    @property
    def options(self) -> Options:
        return self._options

    @property
    def is_connected(self) -> bool:
        """Whether the connection is still usable."""
        return self._conn.is_connected

    async def close(self) -> None:
        """Closes this connection and every connection opened to other nodes. Confirmed
        publishes still in flight fail with :class:`~keratin.OutcomeUnknownError`."""
        peers = list(self._peers.values())
        self._peers.clear()
        await asyncio.gather(*(p.close() for p in peers), self._conn.close(), return_exceptions=True)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _next_sequence(self) -> Optional[int]:
        if self._producer_id is None:
            return None
        if self._own_producer:
            # Numbering from 1 again under an id used before would make every partition that
            # stored those sequences confirm the new messages and drop them.
            raise ValueError(
                "this client publishes as producer_id %d, chosen by the application: give each "
                "message its own sequence, keratin.Message(body, sequence=n), never repeated "
                "under that id" % self._producer_id
            )
        self._sequence += 1
        return self._sequence

    # ---------------------------------------------------------------------------------------
    # Admin verbs

    async def declare(
        self,
        queue: str,
        *,
        partitions: int = 1,
        replicas: Optional[int] = None,
        nodes: Optional[Sequence[int]] = None,
        dead_letter: Optional[str] = None,
        max_deliveries: Optional[int] = None,
        max_messages: Optional[int] = None,
        max_bytes: Optional[int] = None,
        overflow: Optional[str] = None,
    ) -> None:
        """Creates ``queue``, or succeeds when it exists with the same settings
        (:class:`~keratin.ConflictError` when they differ). ``overflow`` is ``"reject"``
        (refuse publishes to a full queue with 429 ``queue_full``, the default) or
        ``"drop_oldest"``; ``nodes`` pins the replicas to those node ids."""
        if overflow is not None:
            w.overflow_number(overflow)
        settings = w.QueueSettings(
            partitions, dead_letter, max_deliveries, max_messages, max_bytes, overflow, replicas
        )
        frame = w.Declare(0, queue, settings, list(nodes or []))
        await self._routed("declare", lambda c: c.request(frame))

    async def delete(self, queue: str) -> None:
        """Removes ``queue`` and all its messages."""
        await self._routed("delete", lambda c: c.request(w.Delete(0, queue)))

    async def purge(self, queue: str) -> None:
        """Removes every ready message of ``queue`` (inflight ones stay until settled)."""
        await self._routed("purge", lambda c: c.request(w.Purge(0, queue)))

    async def info(self, queue: str) -> QueueInfo:
        """The settings and counts of ``queue``."""
        reply = await self._conn.request(w.QueueInfo(0, queue))
        assert isinstance(reply, w.QueueInfoReply), reply
        return QueueInfo(reply.queue, reply.settings, reply.partitions)

    async def list(self) -> List[w.QueueSummary]:
        """Every queue the logged-in user may see, sorted by name."""
        reply = await self._conn.request(w.QueueList(0))
        assert isinstance(reply, w.QueueListReply), reply
        return reply.queues

    async def set_queue_settings(self, queue: str, **changes: Any) -> None:
        """Changes settings of a live queue: each keyword among ``dead_letter``,
        ``max_deliveries``, ``max_messages``, ``max_bytes`` and ``overflow`` is set to its
        value, or cleared when the value is ``None``; the others keep their values.
        Partitions and replicas cannot change."""
        known = ("dead_letter", "max_deliveries", "max_messages", "max_bytes", "overflow")
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise TypeError(
                "set_queue_settings cannot change %s; it changes %s" % (", ".join(unknown), ", ".join(known))
            )
        frame = w.SetQueueSettings(0, queue)
        for name, value in changes.items():
            if name == "overflow" and value is not None:
                w.overflow_number(value)
            kind = w.UPDATE_CLEAR if value is None else w.UPDATE_SET
            setattr(frame, name, w.Update(kind, value))
        await self._routed("set_queue_settings", lambda c: c.request(frame))

    # ---------------------------------------------------------------------------------------
    # Streams (protocol version 7; see stream.py)

    def _stream_conn(self) -> Connection:
        require_streams(self._conn)
        return self._conn

    async def declare_stream(
        self,
        stream: str,
        partitions: int = 1,
        *,
        max_bytes: Optional[int] = None,
        max_age_ms: Optional[int] = None,
        max_messages: Optional[int] = None,
        replicas: Optional[int] = None,
    ) -> None:
        """Creates a stream of ``partitions`` (1 to 64) partitions, or succeeds when it
        exists with the same settings (:class:`~keratin.ConflictError` when they differ, or
        when a queue has the name). The bounds are retention: the oldest segments go once
        the stream holds more bytes or messages (over all partitions) or is older than
        ``max_age_ms``; ``None`` is no bound of that kind. In a cluster ``replicas`` nodes
        (``None``: the cluster's default, 3) hold its partitions and cursor log."""
        settings = w.StreamSettings(partitions, replicas, max_bytes, max_age_ms, max_messages)
        frame = w.StreamDeclare(0, stream, settings)
        conn = self._stream_conn()
        await conn.request(frame)

    async def set_stream(
        self,
        stream: str,
        *,
        max_bytes: Any = _KEEP,
        max_age_ms: Any = _KEEP,
        max_messages: Any = _KEEP,
    ) -> None:
        """Changes a live stream's retention, as :meth:`set_queue_settings` does: a bound
        given a number is set, given ``None`` cleared, and one not given
        (:data:`keratin.KEEP`) keeps its value. Partitions cannot change."""
        frame = w.StreamSet(0, stream)
        for name, value in (("max_bytes", max_bytes), ("max_age_ms", max_age_ms), ("max_messages", max_messages)):
            if value is _KEEP:
                continue
            kind = w.UPDATE_CLEAR if value is None else w.UPDATE_SET
            setattr(frame, name, w.Update(kind, value))
        await self._stream_conn().request(frame)

    async def stream_info(self, stream: str) -> StreamInfo:
        """The stream's settings and per-partition figures (:class:`~keratin.StreamInfo`)."""
        reply = await self._stream_conn().request(w.StreamInfo(0, stream))
        assert isinstance(reply, w.StreamInfoReply)
        return StreamInfo(reply.stream, reply.settings, reply.partitions)

    async def list_streams(self) -> List[w.StreamSummary]:
        """Every stream the user may see, sorted by name."""
        reply = await self._stream_conn().request(w.StreamList(0))
        assert isinstance(reply, w.StreamListReply)
        return reply.streams

    async def delete_stream(self, stream: str) -> None:
        """Removes the stream, its messages and its cursors; its readers are told
        (:class:`~keratin.NotFoundError` from their iteration)."""
        await self._stream_conn().request(w.StreamDelete(0, stream))

    async def commit_cursor(self, stream: str, cursor: str, positions: Dict[int, int]) -> None:
        """Sets cursor ``cursor``'s positions: ``{partition: offset of the next message to
        read}``; other partitions keep theirs. Returns once the node made it durable."""
        if not positions:
            raise ValueError("commit_cursor needs at least one partition's position")
        entries = [w.CursorEntry(p, positions[p]) for p in sorted(positions)]

        async def commit(conn: Connection) -> None:
            require_streams(conn)
            await conn.request(w.CursorCommit(0, stream, cursor, entries))

        # In a cluster the cursor log's leader takes commits (421 elsewhere, followed).
        await self._routed("commit cursor %s of stream %s" % (cursor, stream), commit)

    def stream_subscribe(
        self,
        stream: str,
        cursor: Optional[str] = None,
        start: Any = "first",
        *,
        credit: int = 1000,
        auto_commit: bool = False,
        partitions: Optional[Sequence[int]] = None,
        group: bool = False,
    ) -> StreamConsumer:
        """A reader of ``stream`` (:class:`~keratin.StreamConsumer`): an async iterator of
        :class:`~keratin.StreamDelivery` and an async context manager. With ``cursor`` it
        resumes where that cursor stands in each partition; ``start`` (``"first"``,
        ``"last"``, ``"next"``, ``("offset", n)`` or ``("timestamp", ms)``) says where to
        begin in a partition the cursor has no position for. ``credit`` bounds the messages
        in flight; ``auto_commit`` has the node commit the positions it delivered every
        second and on cancel. ``partitions`` reads only those (default: all). ``group``
        shares the stream's partitions with the other readers of ``cursor`` that pass it (a
        consumer group: each partition is read by one member at a time; a partition handed
        to another member ends here with :class:`~keratin.ConflictError` in
        :attr:`~keratin.StreamConsumer.ended_partitions`)."""
        self._stream_conn()
        return StreamConsumer(
            self, stream, cursor, start, credit, auto_commit,
            None if partitions is None else list(partitions), group,
        )

    # ---------------------------------------------------------------------------------------
    # Publishing and consuming (see publisher.py and consumer.py)

    async def publish(
        self,
        queue: str,
        body: Union[bytes, str],
        *,
        headers: Optional[Any] = None,
        key: Optional[str] = None,
        sequence: Optional[int] = None,
    ) -> None:
        """Publishes one message and returns once the node confirmed it (it is durable:
        synced to disk). Retries by itself after ``ERR_LIMITED`` (429) on the node's
        ``retry_after_ms`` within ``publish_timeout``, then raises
        :class:`~keratin.LimitedError` naming the limit; follows 421 to the leader. A lost
        connection or a missing answer raise :class:`~keratin.OutcomeUnknownError`."""
        from .publisher import Message, publish_messages

        results = await publish_messages(self, queue, [Message(body, headers, key, sequence)], joinable=True)
        if results[0] is not None:
            raise results[0]

    async def publish_batch(self, queue: str, messages: Sequence[Any]) -> None:
        """Publishes ``messages`` (bodies or :class:`~keratin.Message`) in one frame (several
        past the 16 MiB frame limit), each confirmed or retried as :meth:`publish` does.
        Raises :class:`~keratin.PublishBatchError` naming each failed message by index when
        any failed (the others are confirmed)."""
        from .errors import PublishBatchError
        from .publisher import as_message, publish_messages

        batch = [as_message(m) for m in messages]
        if not batch:
            return
        results = await publish_messages(self, queue, batch, joinable=False)
        errors = {i: e for i, e in enumerate(results) if e is not None}
        if errors:
            raise PublishBatchError(errors, len(batch))

    def publisher(
        self,
        queue: str,
        *,
        on_dropped: Optional[Callable[["DroppedPublish"], Any]] = None,
        max_buffered: Optional[int] = None,
    ) -> "BufferedPublisher":
        """A :class:`~keratin.BufferedPublisher` for ``queue``: publishes without waiting for
        confirms, holding at most ``max_buffered`` unsettled messages; ``on_dropped`` gets a
        :class:`~keratin.DroppedPublish` for each message the node refused or whose outcome
        the client cannot know."""
        from .publisher import BUFFERED_MAX_DEFAULT, BufferedPublisher

        return BufferedPublisher(
            self, queue, on_dropped, BUFFERED_MAX_DEFAULT if max_buffered is None else max_buffered
        )

    def consume(self, queue: str, prefetch: int = 100, *, prefetch_bytes: int = 0) -> "Consumer":
        """A :class:`~keratin.Consumer` of ``queue``: an async iterator of
        :class:`~keratin.Delivery` (and an async context manager that cancels it on exit).
        At most ``prefetch`` (1 to 65,535) deliveries are unacknowledged at a time."""
        from .consumer import Consumer

        return Consumer(self, queue, prefetch, prefetch_bytes)

    # ---------------------------------------------------------------------------------------
    # Routing (421)

    def _next_spread(self) -> int:
        """The turn of the next message without key or producer number."""
        turn = self._spread
        self._spread += 1
        return turn

    def _is_own_address(self, addr: str) -> bool:
        if addr == self._conn.address:
            return True
        return any(
            n.node_id == self._conn.node_id and n.server == addr for n in self.server_info.nodes
        )

    async def _node(self, addr: Optional[str]) -> Connection:
        """The connection to ``addr`` (``None``: this one), opened on first use and kept.
        This client's own node, once its connection is lost, is reached like any other node:
        a request routed there (a 421 naming it) needs a live connection."""
        if addr is None:
            return self._conn
        if self._is_own_address(addr):
            if self._conn.is_connected:
                return self._conn
            addr = self._conn.address
        async with self._peers_lock:
            peer = self._peers.get(addr)
            if peer is not None and peer.is_connected:
                return peer
            for name in [a for a, p in self._peers.items() if not p.is_connected]:
                del self._peers[name]
            if len(self._peers) >= PEERS_MAX:
                old = list(self._peers.values())
                self._peers.clear()
                for p in old:
                    asyncio.ensure_future(p.close())
            peer = await Connection.open(addr, self._options)
            self._peers[addr] = peer
            return peer

    async def _node_or_own(self, addr: Optional[str], retry: int, deadline: float) -> Connection:
        """The connection to ``addr``, or after a backoff when it cannot be reached, this one
        (it then names the leader it knows), or, when this one is lost too, any other known
        node that answers."""
        try:
            return await self._node(addr)
        except KeratinError:
            delay = not_leader_backoff(retry, None)
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            return await self._live_node(exclude=addr)

    async def _live_node(self, exclude: Optional[str] = None) -> Connection:
        """This connection while it is up, else the first other known node that accepts one
        (``exclude`` skipped); raises the last failure when none does."""
        if self._conn.is_connected:
            return self._conn
        last: KeratinError = ConnectError("no known node left to ask")
        for addr in self._known_nodes():
            if addr == exclude or self._is_own_address(addr):
                continue
            try:
                return await self._node(addr)
            except KeratinError as e:
                last = e
        raise last

    def _known_nodes(self) -> List[str]:
        """The protocol addresses of the handshake's nodes, then the other addresses given to
        connect(), each once."""
        out: List[str] = []
        for addr in [n.server for n in self.server_info.nodes] + self._seeds:
            if addr not in out:
                out.append(addr)
        return out

    def _fallback_node(self, retry: int) -> Optional[str]:
        """Where attempt ``retry`` goes when no leader is named: this node, then each known
        node, in turn."""
        nodes = self._known_nodes()
        index = retry % (len(nodes) + 1)
        return None if index == 0 else nodes[index - 1]

    def _resend_node(self, failed: Optional[str], retry: int) -> Any:
        """Where to send again a publish whose outcome was unknown at ``failed`` (``None``:
        this connection): the handshake's other nodes in turn, this one only while it is
        connected. ``_UNSET``: no node is left to ask."""
        own_up = failed is not None and self._conn.is_connected
        candidates: List[Optional[str]] = []
        for addr in self._known_nodes():
            if self._is_own_address(addr):
                if own_up and None not in candidates:
                    candidates.append(None)
            elif addr != failed:
                candidates.append(addr)
        if not candidates:
            return _UNSET
        return candidates[max(retry - 1, 0) % len(candidates)]

    def _set_leader_hint(self, queue: str, addr: Optional[str]) -> None:
        if addr is not None and not self._is_own_address(addr):
            if len(self._leaders) >= LEADER_HINTS_MAX and queue not in self._leaders:
                self._leaders.clear()
            self._leaders[queue] = addr
        else:
            self._leaders.pop(queue, None)

    def _leader_hint(self, queue: str) -> Optional[str]:
        return self._leaders.get(queue)

    async def _layout(self, queue: str) -> Optional[List[Optional[str]]]:
        """Each partition's leader address of ``queue`` (``None`` entries: not known), or
        ``None`` when the client publishes without it (a single node, or its info could not
        be read lately). Returns at once once known."""
        if len(self.server_info.nodes) <= 1:
            return None
        known = self._layouts.get(queue)
        if known is not None and (known[1] is not None or time.monotonic() < known[0]):
            return known[1]
        ask = self._layout_asks.get(queue)
        if ask is None:
            ask = asyncio.ensure_future(self._read_layout(queue))
            self._layout_asks[queue] = ask
        try:
            return await asyncio.shield(ask)
        finally:
            if ask.done():
                self._layout_asks.pop(queue, None)

    async def _read_layout(self, queue: str) -> Optional[List[Optional[str]]]:
        async def info(conn: Connection) -> Tuple[Any, str]:
            return await conn.request(w.QueueInfo(0, queue)), conn.address

        try:
            reply, answered = await self._routed("info", info, timeout=min(2.0, self._options.request_timeout))
        except KeratinError as e:
            log.debug("the partition leaders of %s are not known: %s", queue, e)
            self._layouts[queue] = (time.monotonic() + LAYOUT_RETRY, None)
            return None
        leaders: List[Optional[str]] = []
        for partition in getattr(reply, "partitions", []):
            leaders.append(answered if partition.leading else partition.leader_addr)
        if len(self._layouts) >= LEADER_HINTS_MAX and queue not in self._layouts:
            self._layouts.clear()
        self._layouts[queue] = (0.0, leaders or None)
        return leaders or None

    def _set_partition_leader(self, queue: str, partition: int, addr: Optional[str]) -> None:
        known = self._layouts.get(queue)
        if known is not None and known[1] is not None and partition < len(known[1]):
            known[1][partition] = addr

    async def _next_node(
        self,
        operation: str,
        error: NotLeaderError,
        retry: int,
        started: float,
        deadline: float,
        answered_by: Optional[str] = None,
    ) -> Optional[str]:
        """After the 421 ``error`` of attempt ``retry`` (from the node at ``answered_by``):
        the address to try next (``None``: this node). A named leader is tried at once for
        the first :data:`NOT_LEADER_IMMEDIATE_MAX` redirects; after those, or when the node
        named itself, and always when no leader is named, after the backoff: nodes that
        disagree while a leadership moves would otherwise spend every retry in
        milliseconds. Raises once the count or the deadline is reached."""
        if retry > NOT_LEADER_RETRIES_MAX or time.monotonic() >= deadline:
            raise self._not_leader_gave_up(operation, error, retry, started)
        if error.leader_addr is not None:
            if error.leader_addr == answered_by or retry > NOT_LEADER_IMMEDIATE_MAX:
                delay = not_leader_backoff(retry - NOT_LEADER_IMMEDIATE_MAX, error.retry_after_ms)
                await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            return error.leader_addr
        delay = not_leader_backoff(retry, error.retry_after_ms)
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            raise self._not_leader_gave_up(operation, error, retry, started)
        return self._fallback_node(retry)

    @staticmethod
    def _not_leader_gave_up(operation: str, last: NotLeaderError, attempts: int, started: float) -> NotLeaderError:
        return NotLeaderError(
            "%s found no leader after %d attempts in %d ms; last answer: %s"
            % (operation, attempts, int((time.monotonic() - started) * 1000), last.message),
            421,
            reason=last.reason,
            retry_after_ms=last.retry_after_ms,
            leader_addr=last.leader_addr,
        )

    async def _routed(
        self,
        operation: str,
        call: Callable[[Connection], Awaitable[T]],
        timeout: Optional[float] = None,
    ) -> T:
        """Runs ``call`` on this connection and, while it raises 421, again on the node the
        answer names (or the known nodes), within ``timeout`` (default ``request_timeout``)
        and :data:`NOT_LEADER_RETRIES_MAX` attempts."""
        started = time.monotonic()
        deadline = started + (self._options.request_timeout if timeout is None else timeout)
        target = self._conn
        retry = 0
        while True:
            try:
                return await call(target)
            except NotLeaderError as error:
                retry += 1
                addr = await self._next_node(operation, error, retry, started, deadline, target.address)
                target = await self._node_or_own(addr, retry, deadline)


async def connect(
    address: Union[str, Sequence[str]],
    *,
    user: Optional[str] = None,
    password: Optional[str] = None,
    token: Optional[str] = None,
    external: bool = False,
    tls: TLSArg = None,
    producer_id: Optional[int] = None,
    idempotent: bool = True,
    name: str = "keratin-client (python)",
    publish_timeout: float = 30.0,
    request_timeout: float = 10.0,
    connect_timeout: float = 5.0,
    heartbeat_interval: float = 5.0,
    server_silence_timeout: float = 30.0,
) -> Client:
    """Connects to a Keratin node and returns a :class:`Client`.

    ``address`` is ``"host:port"`` or a list of them (the nodes of a cluster, tried in turn
    until one accepts). Log in with ``user`` and ``password``, with an API ``token``, or with
    the TLS client certificate (``external=True``, with ``tls=keratin.TLS(cert_file=...,
    key_file=...)``); without any, no login. ``tls`` is ``True`` (the system's roots), an
    :class:`ssl.SSLContext` or a :class:`keratin.TLS`. Publishes carry ``producer_id`` (a
    random one when ``None`` and ``idempotent``), and each message a sequence number from 1,
    so a publish sent again after a lost connection is stored once. All times in seconds.
    """
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("connect needs at least one address")
    options = _options(
        user, password, token, external, tls, name,
        publish_timeout, request_timeout, connect_timeout, heartbeat_interval, server_silence_timeout,
    )
    own_producer = producer_id is not None and idempotent
    if producer_id is None and idempotent:
        producer_id = random_producer_id()
    if not idempotent:
        producer_id = None
    failures: List[str] = []
    last: Optional[KeratinError] = None
    for addr in addresses:
        try:
            conn = await Connection.open(addr, options)
        except (ConnectError, KeratinTimeoutError) as e:
            failures.append("%s: %s" % (addr, e))
            last = e
            continue
        return Client(conn, options, producer_id, addresses, own_producer)
    if len(addresses) == 1 and last is not None:
        raise last
    raise ConnectError("no node accepted a connection: " + "; ".join(failures))


def _options(
    user: Optional[str],
    password: Optional[str],
    token: Optional[str],
    external: bool,
    tls: TLSArg,
    name: str,
    publish_timeout: float,
    request_timeout: float,
    connect_timeout: float,
    heartbeat_interval: float,
    server_silence_timeout: float,
) -> Options:
    logins = sum([user is not None or password is not None, token is not None, external])
    if logins > 1:
        raise ValueError("log in with one of user/password, token or external, not several")
    if (user is None) != (password is None):
        raise ValueError("a password login needs both user and password")
    for what, value in (
        ("publish_timeout", publish_timeout),
        ("request_timeout", request_timeout),
        ("connect_timeout", connect_timeout),
        ("heartbeat_interval", heartbeat_interval),
        ("server_silence_timeout", server_silence_timeout),
    ):
        if not value > 0:
            raise ValueError("%s must be positive, not %r" % (what, value))
    ssl_context, server_name = resolve(tls)
    if external and ssl_context is None:
        raise ValueError("a certificate login (external=True) needs tls with a client certificate")
    mechanism = w.MECHANISM_NONE
    if user is not None:
        mechanism = w.MECHANISM_PLAIN
    elif token is not None:
        mechanism = w.MECHANISM_TOKEN
    elif external:
        mechanism = w.MECHANISM_EXTERNAL
    return Options(
        name=name,
        connect_timeout=connect_timeout,
        request_timeout=request_timeout,
        publish_timeout=publish_timeout,
        heartbeat_interval=heartbeat_interval,
        server_silence_timeout=server_silence_timeout,
        ssl_context=ssl_context,
        server_name=server_name,
        mechanism=mechanism,
        user=user,
        password=password,
        token=token,
    )

