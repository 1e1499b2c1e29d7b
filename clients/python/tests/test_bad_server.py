"""A server that sends bad bytes (garbage, a bad ServerHello, an oversize or zero length,
an unknown frame type, a malformed body, a truncated frame, a handshake that never ends) or
nothing at all gets a clear exception within a bounded time, never a hang. Each test runs
under ``run``'s 20 s bound and asserts a much tighter one."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any, Awaitable, Callable

import pytest

import keratin
from keratin import _wire as w

from .fake import FakeNode, run

Raw = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def connect_raw(raw: Raw, **kwargs: Any) -> keratin.Client:
    node = FakeNode()
    node.raw = raw
    address = await node.start()
    try:
        return await keratin.connect(address, **kwargs)
    finally:
        await node.stop()


def hello_then(payload: bytes) -> Raw:
    """A server that accepts the handshake, then sends ``payload`` once the client asks."""

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        info = w.ServerInfo(None, [])
        writer.write(w.encode_server_hello(w.ServerHello(6, "bad", info)))
        await writer.drain()
        await reader.read(1024)
        writer.write(payload)
        await writer.drain()
        await asyncio.sleep(5)

    return raw


async def request_against(payload: bytes) -> BaseException:
    node = FakeNode()
    node.raw = hello_then(payload)
    address = await node.start()
    try:
        client = await keratin.connect(address, request_timeout=5)
        started = time.monotonic()
        with pytest.raises(keratin.KeratinError) as caught:
            await client.list()
        assert time.monotonic() - started < 2, "took too long to notice"
        assert not client.is_connected
        await client.close()
        return caught.value
    finally:
        await node.stop()


def test_garbage_instead_of_a_hello_is_a_protocol_error() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    with pytest.raises(keratin.ProtocolError, match="KRTN"):
        run(connect_raw(raw))


def test_a_server_that_says_nothing_times_out_at_connect_timeout() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    started = time.monotonic()
    with pytest.raises(keratin.KeratinTimeoutError, match="connect_timeout"):
        run(connect_raw(raw, connect_timeout=0.5))
    assert time.monotonic() - started < 3


def test_a_server_that_closes_at_once_is_a_connect_error() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    with pytest.raises(keratin.ConnectError, match="handshake"):
        run(connect_raw(raw))


def test_a_bad_server_hello_status_is_a_protocol_error() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"KRTN\x06\x00\x07")
        await writer.drain()
        await asyncio.sleep(5)

    with pytest.raises(keratin.ProtocolError, match="status 7"):
        run(connect_raw(raw))


def test_a_server_hello_with_too_many_nodes_is_a_protocol_error() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"KRTN\x06\x00\x00\x01\x00n\x00" + struct.pack("<H", 65))
        await writer.drain()
        await asyncio.sleep(5)

    with pytest.raises(keratin.ProtocolError, match="65 nodes"):
        run(connect_raw(raw))


def test_a_handshake_that_never_completes_is_refused_past_its_bound() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # An accepted hello whose node_id claims 65,535 bytes, then an endless admin string.
        writer.write(b"KRTN\x06\x00\x00" + struct.pack("<H", 65535) + b"n" * 65535 + b"\x01\xff\xff")
        for _ in range(200):
            writer.write(b"a" * 4096)
            await writer.drain()
        await asyncio.sleep(5)

    with pytest.raises(keratin.ProtocolError):
        run(connect_raw(raw, connect_timeout=5))


def test_an_oversize_length_is_a_protocol_error() -> None:
    error = run(request_against(struct.pack("<I", w.FRAME_SIZE_BYTES_MAX + 1)))
    assert isinstance(error, keratin.ProtocolError) and "16 MiB" in str(error)


def test_a_zero_length_is_a_protocol_error() -> None:
    error = run(request_against(struct.pack("<I", 0)))
    assert isinstance(error, keratin.ProtocolError) and "length 0" in str(error)


def test_an_unknown_frame_type_is_a_protocol_error() -> None:
    error = run(request_against(b"\x01\x00\x00\x00\x7f"))
    assert isinstance(error, keratin.ProtocolError) and "0x7f" in str(error)


def test_a_request_frame_sent_to_the_client_is_a_protocol_error() -> None:
    error = run(request_against(w.encode_frame(w.QueueList(1))))
    assert isinstance(error, keratin.ProtocolError) and "0x05" in str(error)


def test_a_malformed_body_is_a_protocol_error() -> None:
    # Reject-style bool of 2 inside an Error frame: request_id absent, fatal = 2.
    body = b"\x00\x02" + b"\x90\x01\x00\x00\x00\x00\x00"
    frame = struct.pack("<I", 1 + len(body)) + b"\xf1" + body
    error = run(request_against(frame))
    assert isinstance(error, keratin.ProtocolError) and "bool" in str(error)


def test_bytes_after_the_last_field_are_a_protocol_error() -> None:
    frame = w.encode_frame(w.Ok(1))
    frame = struct.pack("<I", len(frame) - 4 + 1) + frame[4:] + b"\x00"
    error = run(request_against(frame))
    assert isinstance(error, keratin.ProtocolError) and "after the last field" in str(error)


def test_a_429_without_its_hint_is_a_protocol_error() -> None:
    body = b"\x00\x00" + struct.pack("<H", 429) + b"\x00\x00" + b"\x00\x00" + b"\x00"
    frame = struct.pack("<I", 1 + len(body)) + b"\xf1" + body
    error = run(request_against(frame))
    assert isinstance(error, keratin.ProtocolError) and "429" in str(error)


def test_a_truncated_frame_then_close_is_a_lost_connection() -> None:
    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(w.encode_server_hello(w.ServerHello(6, "bad", w.ServerInfo())))
        await writer.drain()
        await reader.read(1024)
        writer.write(w.encode_frame(w.Ok(1))[:7])
        await writer.drain()
        writer.close()

    async def go() -> None:
        node = FakeNode()
        node.raw = raw
        address = await node.start()
        client = await keratin.connect(address)
        with pytest.raises(keratin.ConnectionLostError, match="middle of a frame"):
            await client.list()
        await client.close()
        await node.stop()

    run(go())


def test_a_silent_server_is_noticed_at_server_silence_timeout() -> None:
    async def go() -> None:
        node = FakeNode()
        node.raw = hello_then(b"")
        address = await node.start()
        client = await keratin.connect(address, server_silence_timeout=0.5, request_timeout=10)
        started = time.monotonic()
        with pytest.raises(keratin.ConnectionLostError, match="server_silence_timeout"):
            await client.list()
        assert time.monotonic() - started < 2
        await client.close()
        await node.stop()

    run(go())


def test_a_request_without_answer_times_out_at_request_timeout() -> None:
    async def go() -> None:
        node = FakeNode()

        async def ignore(conn: Any, frame: Any) -> None:
            return None

        node.on("QueueInfo", ignore)
        address = await node.start()
        client = await keratin.connect(address, request_timeout=0.3)
        with pytest.raises(keratin.KeratinTimeoutError, match="QueueInfo"):
            await client.info("q")
        assert client.is_connected
        await client.close()
        await node.stop()

    run(go())
