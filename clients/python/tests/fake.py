"""An in-process fake Keratin node for unit tests: speaks the server side of protocol v7 with
the client's own codec, answers every request by default, and lets a test replace the answer
to any frame (``on``) or the whole connection (``raw``)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Awaitable, Callable, Dict, List, Optional

from keratin import _wire as w

Handler = Callable[["FakeConn", Any], Awaitable[None]]


class FakeConn:
    def __init__(self, node: "FakeNode", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.node = node
        self.reader = reader
        self.writer = writer
        self.hello: Optional[w.ClientHello] = None
        # The version the handshake agreed on: frames go both ways in its layouts.
        self.version = w.PROTOCOL_VERSION

    async def send(self, frame: Any) -> None:
        self.writer.write(w.encode_frame(frame, self.version))
        await self.writer.drain()

    async def read_frame(self) -> Any:
        (length,) = struct.unpack("<I", await self.reader.readexactly(4))
        data = await self.reader.readexactly(length)
        return w.decode_frame(data[0], data[1:], self.version)

    async def read_client_hello(self) -> w.ClientHello:
        head = await self.reader.readexactly(8)
        name_len = struct.unpack("<H", head[6:8])[0]
        rest = await self.reader.readexactly(name_len)
        raw = head + rest
        version = struct.unpack("<H", head[4:6])[0]
        if version >= 6:
            mech = await self.reader.readexactly(1)
            raw += mech
            if mech[0] == w.MECHANISM_PLAIN:
                for _ in range(2):
                    n = await self.reader.readexactly(2)
                    raw += n + await self.reader.readexactly(struct.unpack("<H", n)[0])
            elif mech[0] == w.MECHANISM_TOKEN:
                n = await self.reader.readexactly(2)
                raw += n + await self.reader.readexactly(struct.unpack("<H", n)[0])
        self.hello = w.decode_client_hello(raw)
        return self.hello


class FakeNode:
    """A fake node on 127.0.0.1. ``frames`` records every frame received, by type name."""

    def __init__(self, node_id: str = "fake", user: Optional[str] = None) -> None:
        self.node_id = node_id
        self.user = user
        self.nodes: List[w.NodeAddress] = []
        self.handlers: Dict[str, Handler] = {}
        self.raw: Optional[Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]] = None
        self.refuse: Optional[w.ErrorBody] = None
        self.accept_versions = (1, w.PROTOCOL_VERSION)
        self.frames: List[Any] = []
        self.hellos: List[w.ClientHello] = []
        self.conns: List[FakeConn] = []
        self.server: Optional[asyncio.AbstractServer] = None
        self.address = ""
        self._tasks: List["asyncio.Task[None]"] = []

    def on(self, frame_type: str, handler: Handler) -> None:
        self.handlers[frame_type] = handler

    def received(self, frame_type: str) -> List[Any]:
        return [f for f in self.frames if type(f).__name__ == frame_type]

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.address = "127.0.0.1:%d" % port
        return self.address

    async def stop(self) -> None:
        for conn in self.conns:
            conn.writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def drop_connections(self) -> None:
        for conn in self.conns:
            conn.writer.transport.abort()  # type: ignore[attr-defined]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            if self.raw is not None:
                await self.raw(reader, writer)
                return
            conn = FakeConn(self, reader, writer)
            self.conns.append(conn)
            hello = await conn.read_client_hello()
            self.hellos.append(hello)
            low, high = self.accept_versions
            if self.refuse is not None or not low <= hello.version <= high:
                body = self.refuse or w.ErrorBody(400, "version %d not spoken; this node speaks %d" % (hello.version, high))
                writer.write(w.encode_server_hello(w.ServerHello(high, error=body)))
                await writer.drain()
                writer.close()
                return
            conn.version = hello.version
            info = w.ServerInfo(None, self.nodes or [w.NodeAddress(self.node_id, self.address)])
            writer.write(w.encode_server_hello(w.ServerHello(hello.version, self.node_id, info, self.user)))
            await writer.drain()
            while True:
                frame = await conn.read_frame()
                self.frames.append(frame)
                name = type(frame).__name__
                handler = self.handlers.get(name, default_handler)
                await handler(conn, frame)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def default_handler(conn: FakeConn, frame: Any) -> None:
    if isinstance(frame, (w.Declare, w.Delete, w.Purge, w.SetQueueSettings, w.Cancel)):
        await conn.send(w.Ok(frame.request_id))
    elif isinstance(frame, w.QueueList):
        await conn.send(w.QueueListReply(frame.request_id, []))
    elif isinstance(frame, w.QueueInfo):
        await conn.send(
            w.QueueInfoReply(frame.request_id, frame.queue, w.QueueSettings(), [w.PartitionInfo(0, 0, 0, 0)])
        )
    elif isinstance(frame, w.Publish):
        if frame.mode & 0x7F == w.MODE_CONFIRMED and frame.messages:
            ids = [m.publish_id for m in frame.messages]
            await conn.send(w.Confirm([(min(ids), max(ids))]))
    elif isinstance(frame, (w.Subscribe, w.StreamSubscribe)):
        await conn.send(w.SubscribeOk(frame.request_id, frame.consumer_tag))
    elif isinstance(frame, (w.StreamDeclare, w.StreamSet, w.StreamDelete, w.CursorCommit)):
        await conn.send(w.Ok(frame.request_id))
    elif isinstance(frame, w.Close):
        await conn.send(w.Close(""))
        conn.writer.close()


def run(coro: Awaitable[Any], timeout: float = 20.0) -> Any:
    """Runs a test coroutine, bounded: a hang fails the test instead of the suite."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())
