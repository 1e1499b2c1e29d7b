"""Consuming: the :class:`Consumer` (an async iterator of :class:`Delivery`, and an async
context manager that cancels it on exit), ack and reject, and subscribing again at the new
leader when the node ends the consumer with ``ConsumerEnd`` 421.

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
from .errors import ConnectionLostError, KeratinError, NotLeaderError, ProtocolError

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


class Consumer:
    """``async for delivery in client.consume(queue, prefetch=100)``.

    The consumer subscribes on first use (``async with`` or the first iteration). Iteration
    ends (``StopAsyncIteration``) after :meth:`cancel`; it raises
    :class:`~keratin.ConnectionLostError` when the connection is lost (unacknowledged
    deliveries return to ready on the node) and the node's error when it ends the consumer
    for another reason. A consumer whose partition moves to another node subscribes again at
    the new leader by itself; deliveries yielded before the move are bound to the old
    connection, so acking them there is answered with a logged 404 and the new leader
    delivers them again (at-least-once).
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
        self._current: Optional[_Subscription] = None
        self._started = False
        self._finished = False
        self._resubscribing: Optional["asyncio.Task[None]"] = None

    @property
    def tag(self) -> Optional[str]:
        """The consumer tag of the current subscription."""
        return self._current.tag if self._current else None

    @property
    def node_address(self) -> Optional[str]:
        """The address of the node serving this consumer now."""
        return self._current.conn.address if self._current else None

    async def start(self) -> "Consumer":
        """Subscribes (following 421 to the node that leads a partition of the queue)."""
        if not self._started:
            self._started = True
            await self._client._routed("subscribe", self._subscribe_on)
        return self

    async def _subscribe_on(self, conn: Connection) -> _Subscription:
        tag = conn.next_tag()
        sub = _Subscription(self, conn, tag)
        conn.add_consumer(tag, sub)
        # Current before the reply: a Deliver or ConsumerEnd may follow SubscribeOk at once.
        self._current = sub
        try:
            await conn.request(w.Subscribe(0, self.queue, self.prefetch, tag, self.prefetch_bytes))
        except BaseException:
            conn.remove_consumer(tag)
            raise
        return sub

    def _ended(self, sub: _Subscription, error: KeratinError) -> None:
        if self._finished or sub is not self._current:
            return
        if isinstance(error, NotLeaderError):
            log.info("consumer %s of %s ended by %s: %s", sub.tag, self.queue, sub.conn.address, error)
            self._resubscribing = asyncio.ensure_future(self._resubscribe(error, sub.conn.address))
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
            raise item
        return item

    async def cancel(self) -> None:
        """Stops the consumer: its unacknowledged deliveries return to ready, and iteration
        ends. Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self._resubscribing is not None and not self._resubscribing.done():
            self._resubscribing.cancel()
        sub = self._current
        self._items.put_nowait((None, None))
        if sub is None or sub.ended or not sub.conn.is_connected:
            return
        try:
            await sub.conn.request(w.Cancel(0, sub.tag))
        except (ConnectionLostError, KeratinError) as e:
            log.debug("cancel of %s: %s", sub.tag, e)
        finally:
            sub.conn.remove_consumer(sub.tag)

    async def __aenter__(self) -> "Consumer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.cancel()
