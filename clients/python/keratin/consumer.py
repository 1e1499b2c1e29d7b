"""Consuming: the :class:`Consumer` (an async iterator of :class:`Delivery`, and an async
context manager that cancels it on exit), ack and reject, and in a cluster one subscription
on each node that leads a partition of the queue, kept as leaders move.

Owns the consumer's bounded delivery buffer: the node sends at most ``prefetch``
unacknowledged deliveries per subscription, so a subscription's un-yielded deliveries never
exceed ``prefetch``; more is a protocol violation and ends the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from . import _wire as w
from ._connection import Connection, _Sink
from .errors import (
    ConnectError,
    ConnectionLostError,
    KeratinError,
    NotFoundError,
    NotLeaderError,
    ProtocolError,
)

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Consumer", "Delivery"]

log = logging.getLogger("keratin")


class Delivery:
    """One delivered message. Settle it with :meth:`ack` or :meth:`reject`; an unsettled
    delivery returns to ready when its consumer or connection ends (and is redelivered with
    ``redelivered`` set)."""

    __slots__ = (
        "body", "headers", "header_list", "key", "redelivered", "delivery_id", "delivery_count",
        "partition", "offset", "queue", "_conn", "_settled",
    )

    def __init__(self, frame: w.Deliver, queue: str, conn: Connection) -> None:
        self.body: bytes = frame.body
        #: Headers as published (the last value of a repeated name), plus any the broker added.
        self.headers: Dict[str, str] = dict(frame.headers)
        #: Every header in order, repeated names included.
        self.header_list: List[Tuple[str, str]] = frame.headers
        #: The routing key the message was published with (``None`` without one, and always
        #: on a connection older than protocol version 7, whose ``Deliver`` does not carry it).
        self.key: Optional[str] = frame.routing_key
        self.redelivered: bool = frame.redelivered
        self.delivery_id: int = frame.delivery_id
        self.delivery_count: int = frame.delivery_count
        self.partition: int = frame.partition
        self.offset: int = frame.offset
        self.queue = queue
        self._conn = conn
        self._settled = False

    def _settle(self, what: str) -> None:
        if self._settled:
            raise KeratinError("delivery %d was already settled; %s does nothing" % (self.delivery_id, what))
        self._settled = True

    async def ack(self) -> None:
        """Acknowledges the delivery: the node removes the message."""
        self._settle("ack")
        await self._conn.send(w.Ack([self.delivery_id]))

    async def reject(self, requeue: bool = True) -> None:
        """Rejects the delivery: back to ready (``requeue=True``), or to the queue's
        dead-letter queue (dropped without one)."""
        self._settle("reject")
        await self._conn.send(w.Reject([self.delivery_id], requeue))

    def __repr__(self) -> str:
        return "Delivery(queue=%r, delivery_id=%d, redelivered=%r, body=%r)" % (
            self.queue, self.delivery_id, self.redelivered, self.body[:64],
        )


class _Subscription(_Sink):
    """One ``Subscribe`` on one connection: counts its un-yielded deliveries against
    ``prefetch``."""

    def __init__(self, consumer: "Consumer", conn: Connection, tag: str) -> None:
        self.consumer = consumer
        self.conn = conn
        self.tag = tag
        self.buffered = 0
        self.ended = False

    def push(self, frame: w.Deliver) -> None:
        if self.buffered >= self.consumer.prefetch:
            raise ProtocolError(
                "%s sent consumer %s more than its prefetch of %d unacknowledged deliveries"
                % (self.conn.address, self.tag, self.consumer.prefetch)
            )
        self.buffered += 1
        self.consumer._items.put_nowait((self, Delivery(frame, self.consumer.queue, self.conn)))

    def end(self, error: KeratinError) -> None:
        self.ended = True
        self.consumer._ended(self, error)


_Item = Tuple[Optional[_Subscription], Union[Delivery, KeratinError, None]]


#: How often a consumer in a cluster reads its queue's leaders again without being told of a
#: move (seconds): a frozen or cut-off node keeps its subscription open while the others elect
#: new leaders for its partitions (the Rust client's ``LEADERS_RECHECK``).
LEADERS_RECHECK = 2.0


class Consumer:
    """``async for delivery in client.consume(queue, prefetch=100)``.

    The consumer subscribes on first use (``async with`` or the first iteration). Iteration
    ends (``StopAsyncIteration``) after :meth:`cancel`; it raises the node's error when a node
    ends the consumer for a reason other than a moved partition, and
    :class:`~keratin.ConnectionLostError` when it cannot go on.

    On a single node it is one subscription. In a cluster it holds one subscription on each
    node that leads a partition of the queue (a node serves a consumer from every partition it
    leads), each with ``prefetch``, and follows leadership: when a node ends its subscription
    because a partition moved (``ConsumerEnd`` 421), its connection is lost, or every
    :data:`LEADERS_RECHECK` seconds, it reads the queue's leaders again and subscribes where
    one is missing. Deliveries of a lost leader that were not acknowledged come again from the
    new leader with ``redelivered`` set; deliveries yielded before a move are bound to the old
    connection, so acking them there is answered with a logged 404 and the new leader delivers
    them again (at-least-once). With no subscription left for ``request_timeout`` iteration
    raises the last error.
    """

    def __init__(self, client: "Client", queue: str, prefetch: int, prefetch_bytes: int = 0) -> None:
        if not 1 <= prefetch <= w.PREFETCH_MAX:
            raise ValueError("prefetch must be 1 to %d, not %d" % (w.PREFETCH_MAX, prefetch))
        if prefetch_bytes < 0:
            raise ValueError("prefetch_bytes must not be negative")
        self._client = client
        self.queue = queue
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self._items: "asyncio.Queue[_Item]" = asyncio.Queue()
        self._subs: List[_Subscription] = []
        self._started = False
        self._finished = False
        self._looking: Optional["asyncio.Task[None]"] = None
        self._look_again = False
        self._recheck: Optional["asyncio.Task[None]"] = None
        self._orphaned_since: Optional[float] = None
        self._waiting_logged = False

    @property
    def tag(self) -> Optional[str]:
        """The consumer tag of the first subscription."""
        return self._subs[0].tag if self._subs else None

    @property
    def node_address(self) -> Optional[str]:
        """The address of the node serving the first subscription now."""
        return self._subs[0].conn.address if self._subs else None

    @property
    def node_addresses(self) -> List[str]:
        """The addresses of the nodes this consumer consumes from now."""
        return [sub.conn.address for sub in self._subs]

    def _cluster(self) -> bool:
        return len(self._client.server_info.nodes) > 1

    async def start(self) -> "Consumer":
        """Subscribes (following 421 to a node that leads a partition of the queue), and in a
        cluster on every other node that leads one."""
        if not self._started:
            self._started = True
            await self._client._routed("subscribe", self._subscribe_on)
            if self._cluster():
                # The other leading nodes, before the first delivery is asked for.
                self._start_look(None)
                if self._looking is not None:
                    await asyncio.shield(self._looking)
                self._recheck = asyncio.ensure_future(self._recheck_loop())
        return self

    async def _subscribe_on(self, conn: Connection) -> _Subscription:
        tag = conn.next_tag()
        sub = _Subscription(self, conn, tag)
        conn.add_consumer(tag, sub)
        # Listed before the reply: a Deliver or ConsumerEnd may follow SubscribeOk at once.
        self._subs.append(sub)
        try:
            await conn.request(w.Subscribe(0, self.queue, self.prefetch, tag, self.prefetch_bytes))
        except BaseException:
            conn.remove_consumer(tag)
            if sub in self._subs:
                self._subs.remove(sub)
            raise
        self._orphaned_since = None
        return sub

    def _has(self, addr: str) -> bool:
        client = self._client
        for sub in self._subs:
            if sub.ended or not sub.conn.is_connected:
                continue
            if sub.conn.address == addr or (
                client._is_own_address(addr) and sub.conn is client._conn
            ):
                return True
        return False

    async def _look(self, named: Optional[str]) -> None:
        """Subscribes at ``named`` (a leader a ``ConsumerEnd`` named) and at every node that
        leads a partition of the queue and has no subscription of this consumer yet."""
        client = self._client
        targets: List[str] = [named] if named else []
        # Each partition's leader as the nodes see it: this connection's node first, then the
        # others until every partition has one (a node that lost its replica knows none).
        leaders: Optional[List[Optional[str]]] = None
        last: Optional[KeratinError] = None
        for addr in [None] + client._known_nodes():
            if leaders is not None and all(leader is not None for leader in leaders):
                break
            try:
                conn = await (client._live_node() if addr is None else client._node(addr))
                reply = await conn.request(w.QueueInfo(0, self.queue))
            except KeratinError as e:
                last = e
                continue
            assert isinstance(reply, w.QueueInfoReply), reply
            seen = [conn.address if p.leading else p.leader_addr for p in reply.partitions]
            if leaders is None or len(leaders) != len(seen):
                leaders = seen
            else:
                leaders = [have or new for have, new in zip(leaders, seen)]
        if leaders is None:
            raise last or NotLeaderError("no node answered for %s" % self.queue, 421)
        missing = any(leader is None for leader in leaders)
        targets.extend(leader for leader in leaders if leader is not None)
        # A node's view can be stale (a replica that moved away): a refusal naming the
        # leader is followed too, each node tried once per look.
        tried: List[str] = []
        while targets:
            addr = targets.pop(0)
            if self._finished or self._has(addr) or addr in tried:
                continue
            tried.append(addr)
            try:
                conn = await client._node(addr)
                if self._finished or self._has(addr):
                    continue
                await self._subscribe_on(conn)
                log.info("consumer of %s also consumes at %s", self.queue, addr)
            except (NotLeaderError, ConnectionLostError, ConnectError) as e:
                log.debug("consumer of %s: not subscribed at %s yet: %s", self.queue, addr, e)
                named = getattr(e, "leader_addr", None)
                if named and named not in tried:
                    targets.append(named)
                missing = True
        if missing:
            raise NotLeaderError("a partition of %s has no reachable leader yet" % self.queue, 421)

    def _start_look(self, named: Optional[str]) -> None:
        if self._finished:
            return
        if self._looking is not None and not self._looking.done():
            self._look_again = True
            return

        async def run() -> None:
            try:
                await self._look(named)
            except KeratinError as e:
                log.debug("consumer of %s: %s", self.queue, e)
                self._check_orphaned(e)
            if self._look_again:
                self._look_again = False
                self._start_look(None)

        self._looking = asyncio.ensure_future(run())

    def _check_orphaned(self, error: KeratinError) -> None:
        """Ends the iteration when the queue is gone, or when no subscription could be kept
        and no node answered for ``request_timeout``. A partition without a leader while the
        nodes answer (a move, an election) is waited for, as long as it takes."""
        if self._subs or self._finished:
            self._orphaned_since = None
            self._waiting_logged = False
            return
        if isinstance(error, NotFoundError):
            self._items.put_nowait((None, error))
            return
        if isinstance(error, NotLeaderError):
            if not self._waiting_logged:
                log.warning("consumer of %s waits for a leader: %s", self.queue, error)
                self._waiting_logged = True
            self._orphaned_since = None
            return
        now = time.monotonic()
        if self._orphaned_since is None:
            self._orphaned_since = now
        elif now - self._orphaned_since > self._client.options.request_timeout:
            self._items.put_nowait((None, error))

    async def _recheck_loop(self) -> None:
        while not self._finished:
            await asyncio.sleep(LEADERS_RECHECK)
            self._start_look(None)

    def _ended(self, sub: _Subscription, error: KeratinError) -> None:
        if self._finished or sub not in self._subs:
            return
        self._subs.remove(sub)
        if isinstance(error, NotLeaderError):
            log.info("consumer %s of %s ended by %s: %s", sub.tag, self.queue, sub.conn.address, error)
            if self._cluster():
                self._start_look(error.leader_addr)
            else:
                self._looking = asyncio.ensure_future(self._resubscribe(error, sub.conn.address))
        elif isinstance(error, ConnectionLostError) and self._cluster():
            log.info("consumer %s of %s lost %s; looking for its partitions' leaders", sub.tag, self.queue, sub.conn.address)
            self._check_orphaned(error)
            self._start_look(None)
        else:
            self._items.put_nowait((None, error))

    async def _resubscribe(self, error: NotLeaderError, answered_by: str) -> None:
        """Subscribes again at the leader the ``ConsumerEnd`` named, bounded like every 421."""
        client = self._client
        started = time.monotonic()
        deadline = started + client.options.request_timeout
        retry = 1
        try:
            addr = await client._next_node("subscribe", error, retry, started, deadline, answered_by)
            target = await client._node_or_own(addr, retry, deadline)
            while True:
                try:
                    await self._subscribe_on(target)
                    log.info("consumer of %s moved to %s", self.queue, target.address)
                    return
                except NotLeaderError as again:
                    retry += 1
                    addr = await client._next_node(
                        "subscribe", again, retry, started, deadline, target.address
                    )
                    target = await client._node_or_own(addr, retry, deadline)
        except KeratinError as e:
            if not self._finished:
                self._items.put_nowait((None, e))

    def __aiter__(self) -> "Consumer":
        return self

    async def __anext__(self) -> Delivery:
        if self._finished:
            raise StopAsyncIteration
        await self.start()
        sub, item = await self._items.get()
        if sub is not None:
            sub.buffered -= 1
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, KeratinError):
            self._finished = True
            self._stop_tasks()
            raise item
        return item

    def _stop_tasks(self) -> None:
        for task in (self._looking, self._recheck):
            if task is not None and not task.done():
                task.cancel()

    async def cancel(self) -> None:
        """Stops the consumer: its unacknowledged deliveries return to ready, and iteration
        ends. Idempotent."""
        if self._finished:
            return
        self._finished = True
        self._stop_tasks()
        subs, self._subs = self._subs, []
        self._items.put_nowait((None, None))
        for sub in subs:
            if sub.ended or not sub.conn.is_connected:
                continue
            await sub.conn.cancel_consumer(sub.tag)

    async def __aenter__(self) -> "Consumer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.cancel()
