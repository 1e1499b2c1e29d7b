"""Publishing: confirmed publishes with retry on ``ERR_LIMITED`` hints, redirects on 421 and
resends of idempotent messages after an unknown outcome (:func:`publish_messages`, behind
``Client.publish`` and ``Client.publish_batch``), and the :class:`BufferedPublisher` with its
dropped-publish callback.

Owns the retry policy (which outcomes are retried, the delay, the deadline) and the buffered
publisher's bound and settling rule. ``_connection.py`` only matches answers to publish ids.

A buffered message gets no ``Confirm`` (protocol.md, "Publish"): it holds its slot until a
``PublishError`` names it (dropped, reported with its reason), the reply to a barrier
``QueueList`` sent after it arrives (accepted: the protocol answers every publish before a
later request's reply), or its connection ends (dropped, outcome unknown).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _wire as w
from ._connection import ANSWER_TIMED_OUT, BufferedSlot, Connection
from ._partitions import partition_of
from .errors import (
    ConnectionLostError,
    KeratinError,
    KeratinTimeoutError,
    LimitedError,
    NotLeaderError,
    OutcomeUnknownError,
    TooLargeError,
)

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Message", "BufferedPublisher", "DroppedPublish", "RETRY_DELAY_MS_MIN"]

log = logging.getLogger("keratin")

#: The smallest delay before retrying after ``ERR_LIMITED``, whatever the hint says: a hint
#: of 0 would otherwise turn a full disk into a busy loop of publishes.
RETRY_DELAY_MS_MIN = 10
#: Up to this fraction is added to a retry delay, so many clients do not retry in step.
RETRY_JITTER_FRACTION = 0.2
#: The least time an attempt gets for its answer even when sent just before the publish
#: timeout ran out (a retry on a hint can be): a node answers a refusal at once.
ATTEMPT_ANSWER_GRACE = 1.0
#: Bytes of a ``Publish`` besides its queue name and messages: header 5, queue length 2,
#: mode 1, message count 4, producer id 9.
PUBLISH_FRAME_OVERHEAD_BYTES = 5 + 2 + 1 + 4 + 9
#: Default bound of a buffered publisher: 10,000 unsettled messages of 1 KiB hold about
#: 10 MiB of bodies and cover ~1 s of a 10k msg/s producer's round trips (Rust default).
BUFFERED_MAX_DEFAULT = 10_000
#: Most times a buffered message follows a 421 to a new leader before it is dropped.
BUFFERED_REDIRECTS_MAX = 8
#: Most buffered messages joined into one frame.
BUFFERED_FRAME_MESSAGES_MAX = 256

Headers = Union[None, Mapping[str, str], Sequence[Tuple[str, str]]]


@dataclass
class Message:
    """A message to publish. ``headers`` is a mapping or a list of ``(name, value)`` pairs;
    ``key`` (the routing key) chooses the partition; ``sequence`` overrides the number of
    this message in its idempotent producer's sequence (see :func:`keratin.connect`)."""

    body: Union[bytes, str]
    headers: Headers = None
    key: Optional[str] = None
    sequence: Optional[int] = None

    def body_bytes(self) -> bytes:
        return self.body.encode("utf-8") if isinstance(self.body, str) else bytes(self.body)

    def header_pairs(self) -> List[Tuple[str, str]]:
        if self.headers is None:
            return []
        if isinstance(self.headers, Mapping):
            return [(str(k), str(v)) for k, v in self.headers.items()]
        return [(str(k), str(v)) for k, v in self.headers]


def as_message(item: Any) -> Message:
    """``item`` as a :class:`Message` (bodies as bytes or str are wrapped)."""
    if isinstance(item, Message):
        return item
    if isinstance(item, (bytes, bytearray, memoryview, str)):
        return Message(item if isinstance(item, str) else bytes(item))
    raise TypeError("publish takes bytes, str or keratin.Message, not %s" % type(item).__name__)


@dataclass
class _Attempt:
    index: int
    message: Message
    wire: w.WireMessage
    target: Optional[str]
    attempts: int = 1
    redirects: int = 0
    resends: int = 0
    #: The message's partition, when the client knows it (a cluster whose queue info it read).
    partition: Optional[int] = None


def _wire_message(client: "Client", message: Message) -> w.WireMessage:
    if message.sequence is None and client.producer_id is not None:
        message.sequence = client._next_sequence()
    return w.WireMessage(0, message.body_bytes(), message.key, message.header_pairs(), message.sequence)


def _frame_limit(queue: str) -> int:
    return w.FRAME_SIZE_BYTES_MAX - PUBLISH_FRAME_OVERHEAD_BYTES - len(queue.encode("utf-8"))


def _chunks(attempts: List[_Attempt], limit: int) -> List[List[_Attempt]]:
    """``attempts`` split so each chunk's frame stays under the frame size limit."""
    chunks: List[List[_Attempt]] = []
    current: List[_Attempt] = []
    size = 0
    for attempt in attempts:
        need = w.message_size(attempt.wire)
        if current and size + need > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(attempt)
        size += need
    if current:
        chunks.append(current)
    return chunks


async def publish_messages(
    client: "Client", queue: str, messages: List[Message], joinable: bool
) -> List[Optional[KeratinError]]:
    """Publishes ``messages`` confirmed and returns each one's outcome (``None``: confirmed),
    retrying within ``publish_timeout`` as ``Client.publish`` describes."""
    deadline = time.monotonic() + client.options.publish_timeout
    results: List[Optional[KeratinError]] = [None] * len(messages)
    limit = _frame_limit(queue)
    pending: List[_Attempt] = []
    hint = client._leader_hint(queue)
    numbered = [(index, message, _wire_message(client, message)) for index, message in enumerate(messages)]
    # In a cluster each message goes to its partition's leader (numbered first: the number
    # picks the partition of a message without a key).
    layout = await client._layout(queue)
    for index, message, wire in numbered:
        if w.message_size(wire) > limit:
            results[index] = TooLargeError(
                "message %d of %d bytes does not fit the 16 MiB frame size limit"
                % (index, len(wire.body)),
                413,
            )
            continue
        partition = None
        target = hint
        if layout is not None:
            partition = partition_of(wire.routing_key, client.producer_id, wire.sequence, len(layout))
            # Without key or producer number the broker chooses, among the partitions the node
            # it reaches leads: such messages go to each partition's leader in turn.
            leader = layout[partition] if partition is not None else layout[client._next_spread() % len(layout)]
            if leader is not None:
                target = leader
                if client._is_own_address(target):
                    target = None
        pending.append(_Attempt(index, message, wire, target, partition=partition))
    while pending:
        answers = await _send_round(client, queue, pending, joinable, deadline, limit)
        limited: List[Tuple[_Attempt, LimitedError]] = []
        moved: List[Tuple[_Attempt, NotLeaderError]] = []
        unknown: List[Tuple[_Attempt, KeratinError]] = []
        for attempt, outcome, timed_out in answers:
            resendable = attempt.wire.sequence is not None and not timed_out
            if outcome is None:
                results[attempt.index] = None
            elif isinstance(outcome, LimitedError):
                limited.append((attempt, outcome))
            elif isinstance(outcome, NotLeaderError):
                moved.append((attempt, outcome))
            elif isinstance(outcome, (OutcomeUnknownError, ConnectionLostError)) and resendable:
                unknown.append((attempt, outcome))
            else:
                results[attempt.index] = outcome
        if not (limited or moved or unknown):
            break
        pending = await _retry_limited(limited, deadline, results)
        pending += await _redirect(client, queue, moved, deadline, results)
        pending += _resend_unknown(client, unknown, deadline, results)
    return results


async def _send_round(
    client: "Client",
    queue: str,
    pending: List[_Attempt],
    joinable: bool,
    deadline: float,
    limit: int,
) -> List[Tuple[_Attempt, Optional[KeratinError], bool]]:
    """Sends every attempt to its target and waits for each answer (bounded)."""
    answer_deadline = max(deadline, time.monotonic() + ATTEMPT_ANSWER_GRACE)
    by_target: Dict[Optional[str], List[_Attempt]] = {}
    for attempt in pending:
        by_target.setdefault(attempt.target, []).append(attempt)
    waiting: List[
        Tuple[_Attempt, Connection, Optional[int], "asyncio.Future[Optional[KeratinError]]"]
    ] = []
    answers: List[Tuple[_Attempt, Optional[KeratinError], bool]] = []
    mode = w.MODE_CONFIRMED | (w.MODE_JOINABLE if joinable else 0)
    for target, attempts in by_target.items():
        try:
            conn = await client._node(target)
        except KeratinError as e:
            if target is None:
                answers.extend((a, e, False) for a in attempts)
                continue
            # The named node is unreachable (it may have just failed): after a backoff, ask
            # this one again, which names the leader it knows then (the Rust node_or_own).
            from .client import not_leader_backoff

            client._set_leader_hint(queue, None)
            retry = max(max(a.redirects for a in attempts), 1)
            delay = not_leader_backoff(retry, None)
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            try:
                conn = await client._live_node(exclude=target)
            except KeratinError as lost:
                answers.extend((a, lost, False) for a in attempts)
                continue
        if joinable:
            # Single publishes: joined with the others of this turn of the event loop into
            # one frame and one write (Connection.publish_joined); the id is set when written.
            try:
                futures = [
                    conn.publish_joined(queue, client.producer_id, a.wire, answer_deadline)
                    for a in attempts
                ]
            except ConnectionLostError as e:
                answers.extend((a, e, False) for a in attempts)
                continue
            waiting.extend((a, conn, None, f) for a, f in zip(attempts, futures))
            await conn.drain()
            continue
        for chunk in _chunks(attempts, limit):
            ids = conn.publish_ids(len(chunk))
            for attempt, publish_id in zip(chunk, ids):
                attempt.wire.publish_id = publish_id
            frame = w.Publish(queue, mode, [a.wire for a in chunk], client.producer_id)
            try:
                futures = conn.publish_confirmed(frame)
            except ConnectionLostError as e:
                # Not written (ConnectionLostError): an idempotent message goes again elsewhere.
                answers.extend((a, e, False) for a in chunk)
                continue
            waiting.extend(zip(chunk, [conn] * len(chunk), ids, futures))
        await conn.drain()
    if all(publish_id is None for _, _, publish_id, _ in waiting):
        # Joined publishes only: their connection resolves them by the answer deadline.
        for _, _, _, future in waiting:
            if not future.done():
                await future
    elif waiting:
        timeout = max(0.0, answer_deadline - time.monotonic())
        await asyncio.wait([f for _, _, _, f in waiting], timeout=timeout)
    for attempt, conn, publish_id, future in waiting:
        if future.done() and future.result() is ANSWER_TIMED_OUT:
            answers.append((attempt, _no_confirm(client, conn), True))
        elif future.done():
            answers.append((attempt, future.result(), False))
        else:
            conn.forget_publish(attempt.wire.publish_id if publish_id is None else publish_id)
            future.cancel()
            answers.append((attempt, _no_confirm(client, conn), True))
    return answers


def _no_confirm(client: "Client", conn: Connection) -> OutcomeUnknownError:
    return OutcomeUnknownError(
        "no Confirm from %s within publish_timeout (%.1f s); the message may or may not be "
        "stored" % (conn.address, client.options.publish_timeout)
    )


async def _retry_limited(
    limited: List[Tuple[_Attempt, LimitedError]],
    deadline: float,
    results: List[Optional[KeratinError]],
) -> List[_Attempt]:
    """Waits out the longest hint among ``limited`` and returns them to send again; when the
    deadline comes first, waits until it and fails them with the limit that held them."""
    if not limited:
        return []
    hint_ms = max(e.retry_after_ms or 0 for _, e in limited)
    delay = max(hint_ms, RETRY_DELAY_MS_MIN) / 1000.0
    delay *= 1.0 + random.random() * RETRY_JITTER_FRACTION
    now = time.monotonic()
    if now + delay > deadline:
        await asyncio.sleep(max(0.0, deadline - now))
        for attempt, e in limited:
            results[attempt.index] = LimitedError(
                "still limited after %d attempts within publish_timeout: %s"
                % (attempt.attempts, e.message),
                429,
                reason=e.reason,
                retry_after_ms=e.retry_after_ms,
                timed_out=True,
            )
        return []
    await asyncio.sleep(delay)
    for attempt, _ in limited:
        attempt.attempts += 1
    return [a for a, _ in limited]


async def _redirect(
    client: "Client",
    queue: str,
    moved: List[Tuple[_Attempt, NotLeaderError]],
    deadline: float,
    results: List[Optional[KeratinError]],
) -> List[_Attempt]:
    """Sends 421-refused messages to the leader named (remembered for the queue), or after a
    backoff to the next known node; gives up after the bounded count or the deadline."""
    from .client import NOT_LEADER_IMMEDIATE_MAX, NOT_LEADER_RETRIES_MAX, not_leader_backoff

    out: List[_Attempt] = []
    waits: List[float] = []
    for attempt, e in moved:
        attempt.redirects += 1
        if attempt.redirects > NOT_LEADER_RETRIES_MAX or time.monotonic() >= deadline:
            results[attempt.index] = NotLeaderError(
                "publish found no leader after %d attempts: %s" % (attempt.redirects, e.message),
                421,
                leader_addr=e.leader_addr,
                retry_after_ms=e.retry_after_ms,
            )
            continue
        if e.leader_addr is not None:
            answered_by = attempt.target or client._conn.address
            if e.leader_addr == answered_by or attempt.redirects > NOT_LEADER_IMMEDIATE_MAX:
                # Leadership in transit (a node naming itself, or nodes naming each other).
                waits.append(not_leader_backoff(attempt.redirects - NOT_LEADER_IMMEDIATE_MAX, e.retry_after_ms))
            if attempt.partition is not None:
                client._set_partition_leader(queue, attempt.partition, e.leader_addr)
            else:
                client._set_leader_hint(queue, e.leader_addr)
            attempt.target = e.leader_addr
        else:
            waits.append(not_leader_backoff(attempt.redirects, e.retry_after_ms))
            attempt.target = client._fallback_node(attempt.redirects)
        out.append(attempt)
    if waits:
        await asyncio.sleep(max(0.0, min(max(waits), deadline - time.monotonic())))
    return out


def _resend_unknown(
    client: "Client",
    unknown: List[Tuple[_Attempt, KeratinError]],
    deadline: float,
    results: List[Optional[KeratinError]],
) -> List[_Attempt]:
    """Idempotent messages whose outcome is unknown (504, connection lost after sending) go
    again, with the same sequence, to another node of the cluster: the partition stores a
    sequence once. Without another node (or time) the unknown outcome is the result."""
    from .client import NOT_LEADER_RETRIES_MAX, _UNSET

    out: List[_Attempt] = []
    for attempt, e in unknown:
        attempt.resends += 1
        node = _UNSET
        if attempt.resends <= NOT_LEADER_RETRIES_MAX and time.monotonic() < deadline:
            node = client._resend_node(attempt.target, attempt.resends)
        if node is _UNSET:
            results[attempt.index] = e
            continue
        attempt.target = node
        out.append(attempt)
    return out


# --------------------------------------------------------------------------------------------
# Buffered publishing


@dataclass
class DroppedPublish:
    """A buffered message that was not stored, or whose outcome is unknown: ``error`` says
    why (its ``code`` and, for 429, ``reason`` name the limit), ``reason`` repeats the limit
    reason (``queue_full``, ``disk``, ...; ``None`` for other errors)."""

    queue: str
    message: Message
    error: KeratinError
    reason: Optional[str] = field(default=None)


class _Slot(BufferedSlot):
    __slots__ = ("publisher", "message", "wire", "redirects")

    def __init__(self, publisher: "BufferedPublisher", message: Message, wire: w.WireMessage) -> None:
        self.publisher = publisher
        self.message = message
        self.wire = wire
        self.redirects = 0

    def settle(self, error: Optional[KeratinError]) -> None:
        self.publisher._settle(self, error)


class BufferedPublisher:
    """Publishes to one queue without waiting for confirms (``client.publisher(queue)``).

    :meth:`publish` waits only for room: at most ``max_buffered`` messages are unsettled at
    a time. A message the node refuses (a 429 ``queue_full``, say), or whose outcome the
    client cannot know because its connection ended, is counted in :attr:`dropped_count` and
    handed to ``on_dropped`` as a :class:`DroppedPublish` (a coroutine function is run as a
    task). A buffered message is **not** durable when ``publish`` returns, and a client crash
    loses the messages still buffered; :meth:`flush` waits until every message is settled.
    """

    def __init__(
        self,
        client: "Client",
        queue: str,
        on_dropped: Optional[Callable[[DroppedPublish], Any]],
        max_buffered: int,
    ) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be at least 1")
        self._client = client
        self.queue = queue
        self._on_dropped = on_dropped
        self.max_buffered = max_buffered
        self._room = asyncio.Semaphore(max_buffered)
        self._unsettled = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._pending: List[_Slot] = []
        self._write_scheduled = False
        self.dropped_count = 0
        self._tasks: "set[asyncio.Task[Any]]" = set()

    @property
    def unsettled_count(self) -> int:
        """Messages handed to :meth:`publish` and not yet settled."""
        return self._unsettled

    async def publish(
        self, body: Union[bytes, str, Message], *, headers: Headers = None, key: Optional[str] = None
    ) -> None:
        """Buffers one message and returns once there was room for it (never waits for a
        confirm). Publishes made in one event-loop turn share a frame."""
        if not self._client.is_connected:
            raise ConnectionLostError(
                "the client's connection is closed (%s); connect again" % self._client._conn.error
            )
        message = body if isinstance(body, Message) else Message(body, headers, key)
        wire = _wire_message(self._client, message)
        if w.message_size(wire) > _frame_limit(self.queue):
            raise TooLargeError("message of %d bytes does not fit the 16 MiB frame size limit" % len(wire.body), 413)
        await self._room.acquire()
        self._unsettled += 1
        self._idle.clear()
        self._pending.append(_Slot(self, message, wire))
        if not self._write_scheduled:
            self._write_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_pending)
        if len(self._pending) >= BUFFERED_FRAME_MESSAGES_MAX:
            self._write_pending()
        await self._client._conn.drain()

    def _write_pending(self) -> None:
        self._write_scheduled = False
        pending, self._pending = self._pending, []
        if pending:
            self._send(pending, self._client._leader_hint(self.queue))

    def _send(self, slots: List[_Slot], target: Optional[str]) -> None:
        conn = self._client._conn
        if target is not None:
            peer = self._client._peers.get(target)
            if peer is not None and peer.is_connected:
                conn = peer
            else:
                task = asyncio.ensure_future(self._send_to_new_peer(slots, target))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
        for chunk in _chunks_slots(slots, _frame_limit(self.queue)):
            ids = conn.publish_ids(len(chunk))
            for slot, publish_id in zip(chunk, ids):
                slot.wire.publish_id = publish_id
            frame = w.Publish(
                self.queue, w.MODE_BUFFERED | w.MODE_JOINABLE, [s.wire for s in chunk], self._client.producer_id
            )
            try:
                conn.publish_buffered(frame, list(chunk))
            except KeratinError as e:
                for slot in chunk:
                    self._settle(slot, ConnectionLostError("not sent: %s" % e))

    async def _send_to_new_peer(self, slots: List[_Slot], target: str) -> None:
        from .client import not_leader_backoff

        try:
            await self._client._node(target)
        except KeratinError:
            # Unreachable (it may have just failed): after a backoff, this node names the
            # leader it knows then.
            self._client._set_leader_hint(self.queue, None)
            retry = max(max(s.redirects for s in slots), 1)
            await asyncio.sleep(not_leader_backoff(retry, None))
            self._send(slots, None)
            return
        self._send(slots, target)

    def _settle(self, slot: _Slot, error: Optional[KeratinError]) -> None:
        if isinstance(error, NotLeaderError) and slot.redirects < BUFFERED_REDIRECTS_MAX:
            slot.redirects += 1
            if error.leader_addr is not None:
                self._client._set_leader_hint(self.queue, error.leader_addr)
            self._send([slot], error.leader_addr)
            return
        self._unsettled -= 1
        self._room.release()
        if self._unsettled == 0:
            self._idle.set()
        if error is None:
            return
        self.dropped_count += 1
        dropped = DroppedPublish(self.queue, slot.message, error, error.reason)
        if self._on_dropped is None:
            log.warning("buffered publish to %s dropped: %s", self.queue, error)
            return
        try:
            result = self._on_dropped(dropped)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except Exception:  # the application's callback must not break the connection
            log.exception("on_dropped callback raised")

    async def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until every message handed to :meth:`publish` is settled: accepted by the
        node, or reported to ``on_dropped``. Bounded by ``timeout`` (default
        ``publish_timeout``): :class:`~keratin.KeratinTimeoutError` after it."""
        self._write_pending()
        bound = self._client.options.publish_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self._idle.wait(), bound)
        except asyncio.TimeoutError:
            raise KeratinTimeoutError(
                "%d buffered messages to %s still unsettled after %.1f s"
                % (self._unsettled, self.queue, bound)
            ) from None
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _chunks_slots(slots: List[_Slot], limit: int) -> List[List[_Slot]]:
    chunks: List[List[_Slot]] = []
    current: List[_Slot] = []
    size = 0
    for slot in slots:
        need = w.message_size(slot.wire)
        if current and (size + need > limit or len(current) >= BUFFERED_FRAME_MESSAGES_MAX):
            chunks.append(current)
            current, size = [], 0
        current.append(slot)
        size += need
    if current:
        chunks.append(current)
    return chunks
