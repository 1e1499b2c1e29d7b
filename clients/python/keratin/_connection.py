"""One connection to one node: the handshake, the task that reads frames, heartbeats and the
server-silence watchdog, and the bookkeeping that matches answers to what was sent (requests
by ``request_id``, publishes by ``publish_id``, deliveries by ``consumer_tag``).

Owns the socket and every bound on what it holds; retry and routing policy live in
``client.py`` and ``publisher.py``. When the connection ends, every waiter learns why:
requests get :class:`ConnectionLostError`, confirmed publishes :class:`OutcomeUnknownError`
(they were written), buffered ones are reported dropped, and consumers end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import _wire as w
from .errors import (
    ConnectError,
    ConnectionLostError,
    KeratinError,
    KeratinTimeoutError,
    LoginUnsupportedError,
    OutcomeUnknownError,
    ProtocolError,
    TLSError,
    error_from_body,
)

log = logging.getLogger("keratin")

#: Default limit on TCP connect plus TLS plus handshake (Rust: ``CONNECT_TIMEOUT_DEFAULT``).
CONNECT_TIMEOUT_DEFAULT = 5.0
#: Default limit on one admin request.
REQUEST_TIMEOUT_DEFAULT = 10.0
#: Default limit on a confirmed publish, retries on ``ERR_LIMITED`` hints included.
PUBLISH_TIMEOUT_DEFAULT = 30.0
#: A ``Heartbeat`` goes out when nothing was written for this long.
HEARTBEAT_INTERVAL_DEFAULT = 5.0
#: The connection counts as lost after this long without a frame from the server: six
#: heartbeat intervals of a server that heartbeats as often as this client.
SERVER_SILENCE_TIMEOUT_DEFAULT = 30.0
#: The watchdog wakes this many times per heartbeat interval.
TICKS_PER_INTERVAL = 4
#: Bytes asked of the socket per read: frames larger than this arrive over several reads.
READ_CHUNK_BYTES = 64 * 1024
#: Most requests in flight on one connection; a caller past it waits for a slot. 4,096
#: requests of ~100 bytes each hold well under a MiB of futures.
REQUESTS_INFLIGHT_MAX = 4096
#: Most consumers on one connection (the server's own bound, protocol.md "Subscribe").
CONSUMERS_MAX = 1024
#: Bytes of a ``Publish`` frame besides its queue name and messages: header 5, queue length 2,
#: mode 1, message count 4, producer id 9.
JOINED_FRAME_OVERHEAD_BYTES = 5 + 2 + 1 + 4 + 9
#: How often the answer deadlines of joined publishes are checked while any is pending.
DEADLINE_SWEEP_SECONDS = 0.1
#: What a joined publish's future resolves to when its answer deadline passed first.
ANSWER_TIMED_OUT = OutcomeUnknownError("no answer within the publish's deadline")
#: How long :meth:`Connection.close` waits for the server's ``Close`` before dropping the socket.
CLOSE_TIMEOUT = 5.0


@dataclass
class Options:
    """How a connection is opened and how long it waits (see :func:`keratin.connect`)."""

    name: str = "keratin-client (python)"
    connect_timeout: float = CONNECT_TIMEOUT_DEFAULT
    request_timeout: float = REQUEST_TIMEOUT_DEFAULT
    publish_timeout: float = PUBLISH_TIMEOUT_DEFAULT
    heartbeat_interval: float = HEARTBEAT_INTERVAL_DEFAULT
    server_silence_timeout: float = SERVER_SILENCE_TIMEOUT_DEFAULT
    ssl_context: Optional[ssl.SSLContext] = None
    server_name: Optional[str] = None
    mechanism: int = w.MECHANISM_NONE
    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    token: Optional[str] = field(default=None, repr=False)


def split_address(address: str) -> Tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as a pair; a bad one is a ``ValueError`` naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("address %r is not host:port" % (address,))
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class _Sink:
    """What a consumer gives the connection: where its deliveries and its end go."""

    def push(self, frame: w.Deliver) -> None:  # pragma: no cover - interface
        raise KeratinError("a consumer sink must override push")

    def end(self, error: KeratinError) -> None:  # pragma: no cover - interface
        raise KeratinError("a consumer sink must override end")


class BufferedSlot:
    """A buffered message the connection holds until it is settled (``settle(None)``:
    accepted; ``settle(error)``: dropped)."""

    def settle(self, error: Optional[KeratinError]) -> None:  # pragma: no cover - interface
        raise KeratinError("a buffered slot must override settle")


class Connection:
    """One open, handshaken connection. Build it with :meth:`open`."""

    def __init__(
        self,
        address: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello: w.ServerHello,
        leftover: bytes,
        options: Options,
    ) -> None:
        self.address = address
        self.options = options
        self.version = hello.version
        self.node_id = hello.node_id
        self.server_info = hello.info or w.ServerInfo()
        self.user = hello.user
        self._reader = reader
        self._writer = writer
        self._buf = bytearray(leftover)
        self._requests: Dict[int, "asyncio.Future[w.Frame]"] = {}
        self._request_slots = asyncio.Semaphore(REQUESTS_INFLIGHT_MAX)
        self._next_request_id = 1
        self._next_publish_id = 1
        self._confirmed: Dict[int, "asyncio.Future[Optional[KeratinError]]"] = {}
        # Single confirmed publishes queued in this turn of the event loop, per (queue,
        # producer): written together by _flush_joined (publish_joined).
        self._joining: Dict[
            Tuple[str, Optional[int]],
            List[Tuple[w.WireMessage, "asyncio.Future[Optional[KeratinError]]", float]],
        ] = {}
        self._join_scheduled = False
        # Answer deadlines of joined publishes (publish_joined), checked by _sweep_deadlines
        # every DEADLINE_SWEEP_SECONDS while any is pending: one timer per connection, not one
        # per publish.
        self._deadlines: Dict[int, float] = {}
        self._sweep_scheduled = False
        # Buffered publish ids in the order written (ids only grow), for the barrier.
        self._buffered: "OrderedDict[int, BufferedSlot]" = OrderedDict()
        self._barrier_upto: Optional[int] = None
        self._consumers: Dict[str, _Sink] = {}
        self._next_tag = 1
        self._error: Optional[KeratinError] = None
        self._close_sent = False
        self._closed = asyncio.Event()
        now = time.monotonic()
        self._last_received = now
        self._last_written = now
        self._reader_task = asyncio.ensure_future(self._read_loop())
        self._watchdog_task = asyncio.ensure_future(self._watchdog())

    # ---------------------------------------------------------------------------------------
    # Opening

    @classmethod
    async def open(cls, address: str, options: Options, version: int = w.PROTOCOL_VERSION) -> "Connection":
        """Connects to ``address``, within ``options.connect_timeout`` for everything."""
        try:
            return await asyncio.wait_for(cls._open(address, options, version), options.connect_timeout)
        except asyncio.TimeoutError:
            raise KeratinTimeoutError(
                "no accepted handshake from %s within connect_timeout (%.1f s)"
                % (address, options.connect_timeout)
            ) from None

    @classmethod
    async def _open(cls, address: str, options: Options, version: int) -> "Connection":
        host, port = split_address(address)
        hello = w.ClientHello(
            version, options.name, options.mechanism, options.user, options.password, options.token
        )
        raw_hello = w.encode_client_hello(hello)
        try:
            reader, writer = await asyncio.open_connection(
                host,
                port,
                ssl=options.ssl_context,
                server_hostname=(options.server_name or host) if options.ssl_context else None,
            )
        except ssl.SSLError as e:
            raise TLSError("TLS handshake with %s failed: %s" % (address, e)) from e
        except OSError as e:
            raise ConnectError("cannot connect to %s: %s" % (address, e)) from e
        try:
            writer.write(raw_hello)
            server_hello, leftover = await _read_server_hello(reader, address, version)
        except BaseException:
            writer.close()
            raise
        if server_hello.error is not None:
            writer.close()
            body = server_hello.error
            older = server_hello.version
            if body.code == 400 and w.PROTOCOL_VERSION_MIN <= older < version:
                if options.mechanism != w.MECHANISM_NONE and older < 6:
                    raise LoginUnsupportedError(
                        "%s speaks protocol version %d, which cannot carry a login; "
                        "connect without credentials or upgrade the server" % (address, older)
                    )
                log.info("%s speaks protocol version %d; connecting again with it", address, older)
                return await cls._open(address, options, older)
            raise error_from_body(body, "%s refused the connection: " % address)
        return cls(address, reader, writer, server_hello, leftover, options)

    # ---------------------------------------------------------------------------------------
    # State

    @property
    def is_connected(self) -> bool:
        return self._error is None

    @property
    def error(self) -> Optional[KeratinError]:
        """Why the connection ended; ``None`` while it is open."""
        return self._error

    def _check_open(self) -> None:
        if self._error is not None:
            raise ConnectionLostError(
                "the connection to %s is closed: %s" % (self.address, self._error)
            )

    def next_tag(self) -> str:
        tag = "c%d" % self._next_tag
        self._next_tag += 1
        return tag

    # ---------------------------------------------------------------------------------------
    # Writing

    def _write(self, data: bytes) -> None:
        self._check_open()
        self._writer.write(data)
        self._last_written = time.monotonic()

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._lose(ConnectionLostError("writing to %s failed: %s" % (self.address, e)))

    async def send(self, frame: w.Frame) -> None:
        """Writes a frame that has no reply (``Ack``, ``Reject``)."""
        self._write(w.encode_frame(frame, self.version))
        await self._drain()

    async def request(self, frame: Any, timeout: Optional[float] = None) -> w.Frame:
        """Sends ``frame`` (its ``request_id`` is set here) and returns the reply frame; an
        ``Error`` reply is raised as its exception class."""
        bound = self.options.request_timeout if timeout is None else timeout
        async with self._request_slots:
            self._check_open()
            request_id = self._next_request_id
            self._next_request_id += 1
            frame.request_id = request_id
            data = w.encode_frame(frame, self.version)
            future: "asyncio.Future[w.Frame]" = asyncio.get_running_loop().create_future()
            self._requests[request_id] = future
            try:
                self._write(data)
                await self._drain()
                return await asyncio.wait_for(asyncio.shield(future), bound)
            except asyncio.TimeoutError:
                raise KeratinTimeoutError(
                    "no answer from %s to %s within %.1f s"
                    % (self.address, type(frame).__name__, bound)
                ) from None
            finally:
                self._requests.pop(request_id, None)
                if not future.done():
                    future.cancel()

    def publish_ids(self, count: int) -> List[int]:
        first = self._next_publish_id
        self._next_publish_id += count
        return list(range(first, first + count))

    def publish_confirmed(
        self, frame: w.Publish
    ) -> List["asyncio.Future[Optional[KeratinError]]"]:
        """Writes a confirmed ``Publish``; each future resolves to ``None`` (confirmed) or
        the message's error (raised only for a closed connection, before anything is sent)."""
        data = w.encode_frame(frame, self.version)
        self._check_open()
        loop = asyncio.get_running_loop()
        futures = []
        for m in frame.messages:
            future: "asyncio.Future[Optional[KeratinError]]" = loop.create_future()
            self._confirmed[m.publish_id] = future
            futures.append(future)
        self._write(data)
        return futures

    def publish_joined(
        self, queue: str, producer_id: Optional[int], wire: w.WireMessage, deadline: float
    ) -> "asyncio.Future[Optional[KeratinError]]":
        """Queues one confirmed publish, to be written with every other queued in this turn
        of the event loop: one joinable ``Publish`` frame per queue and producer (split at the
        frame size limit) and one socket write for them all, as the Rust client joins
        single publishes. ``wire.publish_id`` is set when it is written. The future resolves
        as :meth:`publish_confirmed`'s do, or to :class:`ConnectionLostError` when the
        connection ended before it was written; a cancelled future is not written. Past
        ``deadline`` (``time.monotonic()``) without an answer it resolves to
        :data:`ANSWER_TIMED_OUT` and the connection forgets the publish."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future: "asyncio.Future[Optional[KeratinError]]" = loop.create_future()
        wire.publish_id = 0
        key = (queue, producer_id)
        batch = self._joining.get(key)
        if batch is None:
            batch = self._joining[key] = []
        batch.append((wire, future, deadline))
        if not self._join_scheduled:
            self._join_scheduled = True
            loop.call_soon(self._flush_joined)
        return future

    def _flush_joined(self) -> None:
        self._join_scheduled = False
        joining, self._joining = self._joining, {}
        parts: List[bytes] = []
        written: List[Tuple[int, "asyncio.Future[Optional[KeratinError]]", float]] = []
        mode = w.MODE_CONFIRMED | w.MODE_JOINABLE
        for (queue, producer_id), batch in joining.items():
            limit = w.FRAME_SIZE_BYTES_MAX - JOINED_FRAME_OVERHEAD_BYTES - len(queue.encode("utf-8"))
            chunk: List[w.WireMessage] = []
            size = 0
            for wire, future, deadline in batch:
                if future.done():
                    continue  # cancelled by its caller before it was written
                need = w.message_size(wire)
                if chunk and size + need > limit:
                    parts.append(w.encode_frame(w.Publish(queue, mode, chunk, producer_id), self.version))
                    chunk, size = [], 0
                wire.publish_id = self._next_publish_id
                self._next_publish_id += 1
                chunk.append(wire)
                size += need
                written.append((wire.publish_id, future, deadline))
            if chunk:
                parts.append(w.encode_frame(w.Publish(queue, mode, chunk, producer_id), self.version))
        if not written:
            return
        if self._error is not None:
            lost = ConnectionLostError(
                "the connection to %s ended before the publish was written: %s"
                % (self.address, self._error)
            )
            for _, future, _ in written:
                future.set_result(lost)
            return
        for publish_id, future, deadline in written:
            self._confirmed[publish_id] = future
            self._deadlines[publish_id] = deadline
        if not self._sweep_scheduled:
            self._sweep_scheduled = True
            asyncio.get_running_loop().call_later(DEADLINE_SWEEP_SECONDS, self._sweep_deadlines)
        try:
            self._write(b"".join(parts))
        except KeratinError as e:
            self._lose(e)
        except (OSError, RuntimeError) as e:
            self._lose(ConnectionLostError("writing to %s failed: %s" % (self.address, e)))

    def _sweep_deadlines(self) -> None:
        """Resolves every joined publish past its answer deadline to ANSWER_TIMED_OUT."""
        self._sweep_scheduled = False
        if self._error is not None:
            self._deadlines.clear()
            return
        now = time.monotonic()
        for publish_id in [i for i, d in self._deadlines.items() if d <= now]:
            del self._deadlines[publish_id]
            future = self._confirmed.pop(publish_id, None)
            if future is not None and not future.done():
                future.set_result(ANSWER_TIMED_OUT)
        if self._deadlines:
            self._sweep_scheduled = True
            asyncio.get_running_loop().call_later(DEADLINE_SWEEP_SECONDS, self._sweep_deadlines)

    def forget_publish(self, publish_id: int) -> None:
        self._confirmed.pop(publish_id, None)
        self._deadlines.pop(publish_id, None)

    def publish_buffered(self, frame: w.Publish, slots: List[BufferedSlot]) -> None:
        """Writes a buffered ``Publish``; each slot settles on a ``PublishError``, on the
        reply to the barrier sent after it, or when the connection ends."""
        data = w.encode_frame(frame, self.version)
        self._check_open()
        for m, slot in zip(frame.messages, slots):
            self._buffered[m.publish_id] = slot
        self._write(data)
        self._send_barrier()

    async def drain(self) -> None:
        await self._drain()

    def _send_barrier(self) -> None:
        """Sends one ``QueueList`` (at most one in flight): its reply comes after the
        answers to every publish written before it (protocol.md, "Connection lifecycle"),
        so every buffered message written before it without a ``PublishError`` was accepted."""
        if self._barrier_upto is not None or not self._buffered or self._error is not None:
            return
        upto = next(reversed(self._buffered))
        request_id = self._next_request_id
        self._next_request_id += 1
        future: "asyncio.Future[w.Frame]" = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: self._barrier_done(upto, f))
        self._requests[request_id] = future
        self._barrier_upto = upto
        self._write(w.encode_frame(w.QueueList(request_id), self.version))

    def _barrier_done(self, upto: int, future: "asyncio.Future[w.Frame]") -> None:
        self._barrier_upto = None
        if future.cancelled() or (future.exception() is not None and self._error is not None):
            return
        while self._buffered:
            publish_id = next(iter(self._buffered))
            if publish_id > upto:
                break
            self._buffered.pop(publish_id).settle(None)
        if self._error is None:
            self._send_barrier()

    def buffered_count(self) -> int:
        return len(self._buffered)

    # ---------------------------------------------------------------------------------------
    # Consumers

    def add_consumer(self, tag: str, sink: _Sink) -> None:
        self._check_open()
        if len(self._consumers) >= CONSUMERS_MAX:
            raise KeratinError("a connection holds at most %d consumers" % CONSUMERS_MAX)
        self._consumers[tag] = sink

    def remove_consumer(self, tag: str) -> None:
        self._consumers.pop(tag, None)

    async def cancel_consumer(self, tag: str) -> None:
        """Cancels consumer ``tag`` on this node (``Cancel``: its unacknowledged deliveries
        return to ready; a stream reader's auto-commit commits first) and stops routing its
        frames. A lost connection or an error answer is logged, not raised: the consumer ends
        either way, and the node cancels it when the connection closes."""
        try:
            await self.request(w.Cancel(0, tag))
        except (ConnectionLostError, KeratinError) as e:
            log.debug("cancel of consumer %s: %s", tag, e)
        finally:
            self.remove_consumer(tag)

    # ---------------------------------------------------------------------------------------
    # Reading

    async def _read_exactly(self, size: int) -> bytes:
        while len(self._buf) < size:
            chunk = await self._reader.read(READ_CHUNK_BYTES)
            if not chunk:
                if self._buf:
                    raise ConnectionLostError(
                        "%s closed the connection in the middle of a frame" % self.address
                    )
                raise ConnectionLostError("%s closed the connection" % self.address)
            self._buf += chunk
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self._read_exactly(w.FRAME_HEADER_BYTES - 1)
                (length,) = struct.unpack("<I", header)
                if length == 0:
                    raise ProtocolError("%s sent a frame of length 0" % self.address)
                if length > w.FRAME_SIZE_BYTES_MAX:
                    raise ProtocolError(
                        "%s announced a frame of %d bytes, over the 16 MiB limit"
                        % (self.address, length)
                    )
                frame_type = (await self._read_exactly(1))[0]
                if frame_type not in w.CLIENT_RECEIVES:
                    raise ProtocolError(
                        "%s sent frame type 0x%02x, which a client does not receive in version %d"
                        % (self.address, frame_type, self.version)
                    )
                body = await self._read_exactly(length - 1)
                frame = w.decode_frame(frame_type, body, self.version)
                self._last_received = time.monotonic()
                self._dispatch(frame)
        except KeratinError as e:
            self._lose(e)
        except (OSError, asyncio.IncompleteReadError) as e:
            self._lose(ConnectionLostError("reading from %s failed: %s" % (self.address, e)))
        except asyncio.CancelledError:
            self._lose(ConnectionLostError("the connection to %s was closed" % self.address))
            raise

    def _dispatch(self, frame: w.Frame) -> None:
        if isinstance(
            frame, (w.Ok, w.QueueInfoReply, w.QueueListReply, w.SubscribeOk, w.StreamInfoReply, w.StreamListReply)
        ):
            future = self._requests.pop(frame.request_id, None)
            if future is not None and not future.done():
                future.set_result(frame)
        elif isinstance(frame, w.Confirm):
            self._settle_ranges(frame.ranges, None)
        elif isinstance(frame, w.PublishError):
            self._settle_ranges(frame.ranges, error_from_body(frame.error))
        elif isinstance(frame, w.Deliver):
            sink = self._consumers.get(frame.consumer_tag)
            if sink is not None:
                sink.push(frame)
            else:
                log.debug("delivery for ended consumer %s ignored", frame.consumer_tag)
        elif isinstance(frame, (w.StreamDeliver, w.StreamPartitionEnd)):
            # Stream readers share the consumers' tags; their sink takes both frames.
            sink = self._consumers.get(frame.consumer_tag)
            if sink is not None:
                sink.push(frame)  # type: ignore[arg-type]
            else:
                log.debug("stream frame for ended reader %s ignored", frame.consumer_tag)
        elif isinstance(frame, w.ConsumerEnd):
            sink = self._consumers.pop(frame.consumer_tag, None)
            if sink is not None:
                sink.end(error_from_body(frame.error))
        elif isinstance(frame, w.Error):
            self._dispatch_error(frame)
        elif isinstance(frame, w.Close):
            if not self._close_sent:
                # Nothing is owed to the server (a client answers no frames): answer at once.
                self._close_sent = True
                try:
                    self._write(w.encode_frame(w.Close(""), self.version))
                except KeratinError:
                    pass
            raise ConnectionLostError(
                "%s closed the connection: %s" % (self.address, frame.message or "no reason given")
            )
        # Heartbeat: receiving it already counted as a sign of life.

    def _dispatch_error(self, frame: w.Error) -> None:
        error = error_from_body(frame.error)
        if frame.request_id is not None:
            future = self._requests.pop(frame.request_id, None)
            if future is not None and not future.done():
                future.set_exception(error)
        if frame.fatal:
            raise ConnectionLostError(
                "%s ended the connection with a fatal error: %s" % (self.address, error)
            )
        if frame.request_id is None:
            # Unknown delivery ids in an Ack/Reject (after a ConsumerEnd), for example.
            log.warning("%s: %s", self.address, error)

    def _settle_ranges(self, ranges: List[Tuple[int, int]], error: Optional[KeratinError]) -> None:
        for first, last in ranges:
            for table in (self._confirmed, self._buffered):
                # A range may be huge (or hostile): walk whichever is smaller.
                if last - first + 1 <= len(table):
                    ids = [i for i in range(first, last + 1) if i in table]
                else:
                    ids = [i for i in table if first <= i <= last]
                if table is self._confirmed and self._deadlines:
                    for publish_id in ids:
                        self._deadlines.pop(publish_id, None)
                for publish_id in ids:
                    slot = table.pop(publish_id)
                    if isinstance(slot, asyncio.Future):
                        if not slot.done():
                            slot.set_result(error)
                    else:
                        slot.settle(error)

    async def _watchdog(self) -> None:
        interval = self.options.heartbeat_interval
        silence = self.options.server_silence_timeout
        tick = min(interval, silence) / TICKS_PER_INTERVAL
        try:
            while self._error is None:
                await asyncio.sleep(tick)
                now = time.monotonic()
                if now - self._last_received >= silence:
                    self._lose(
                        ConnectionLostError(
                            "%s sent nothing for %.1f s (server_silence_timeout)"
                            % (self.address, now - self._last_received)
                        )
                    )
                    return
                if now - self._last_written >= interval:
                    self._write(w.encode_frame(w.Heartbeat(), self.version))
        except KeratinError:
            return

    # ---------------------------------------------------------------------------------------
    # Ending

    def _lose(self, error: KeratinError) -> None:
        """Ends the connection once, telling every waiter why."""
        if self._error is not None:
            return
        self._error = error
        self._closed.set()
        lost: KeratinError = error
        if not isinstance(error, ProtocolError):
            lost = ConnectionLostError("connection to %s lost: %s" % (self.address, error))
            lost.__cause__ = error
        for future in self._requests.values():
            if not future.done():
                future.set_exception(lost)
        self._requests.clear()
        unknown = OutcomeUnknownError(
            "connection to %s lost after the publish was sent (%s); it may or may not be "
            "stored" % (self.address, error)
        )
        for publish in self._confirmed.values():
            if not publish.done():
                publish.set_result(unknown)
        self._confirmed.clear()
        self._deadlines.clear()
        buffered, self._buffered = self._buffered, OrderedDict()
        for slot in buffered.values():
            slot.settle(unknown)
        consumers, self._consumers = self._consumers, {}
        for sink in consumers.values():
            sink.end(lost)
        current = asyncio.current_task() if _loop_running() else None
        for task in (self._watchdog_task, self._reader_task):
            if task is not current and not task.done():
                task.cancel()
        try:
            self._writer.close()
        except RuntimeError:
            pass

    async def close(self) -> None:
        """Sends ``Close``, waits (bounded) for the server to answer what it owes and close,
        then drops the socket. Idempotent."""
        if self._error is None:
            try:
                self._close_sent = True
                self._write(w.encode_frame(w.Close("client closing"), self.version))
                await self._drain()
                await asyncio.wait_for(self._closed.wait(), CLOSE_TIMEOUT)
            except (asyncio.TimeoutError, KeratinError):
                pass
            self._lose(ConnectionLostError("the client closed the connection"))
        for task in (self._reader_task, self._watchdog_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(self._reader_task, self._watchdog_task, return_exceptions=True)
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (asyncio.TimeoutError, OSError, RuntimeError, ssl.SSLError):
            pass


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


async def _read_server_hello(
    reader: asyncio.StreamReader, address: str, offered: int
) -> Tuple[w.ServerHello, bytes]:
    """Reads a ``ServerHello`` of at most ``SERVER_HELLO_SIZE_MAX`` bytes; returns it and the
    bytes that followed it."""
    buf = bytearray()
    while True:
        try:
            chunk = await reader.read(READ_CHUNK_BYTES)
        except ssl.SSLError as e:
            raise TLSError("TLS handshake with %s failed: %s" % (address, e)) from e
        except OSError as e:
            raise ConnectError("reading the handshake from %s failed: %s" % (address, e)) from e
        if not chunk:
            hint = ""
            if not buf:
                hint = (
                    " (a node that requires TLS closes a plaintext connection; one that does "
                    "not speak the Keratin protocol may too)"
                )
            raise ConnectError(
                "%s closed the connection during the handshake after %d bytes%s"
                % (address, len(buf), hint)
            )
        buf += chunk
        if len(buf) >= 4 and bytes(buf[:4]) != w.MAGIC:
            raise ProtocolError(
                "%s answered with %r, not the KRTN magic: it does not speak the Keratin protocol"
                % (address, bytes(buf[:4]))
            )
        try:
            hello, size = w.decode_server_hello(bytes(buf), offered, partial=True)
        except w.Incomplete:
            if len(buf) > w.SERVER_HELLO_SIZE_MAX:
                raise ProtocolError(
                    "%s sent a handshake of over %d bytes without completing it"
                    % (address, w.SERVER_HELLO_SIZE_MAX)
                ) from None
            continue
        return hello, bytes(buf[size:])


def random_producer_id() -> int:
    """A random 63-bit producer id, never 0."""
    return (int.from_bytes(os.urandom(8), "little") >> 1) or 1
