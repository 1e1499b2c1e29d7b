"""Streams against the fake node: what the client puts in each stream frame (subscribe,
set, commit), how a reader gives credit back (once half is taken, exactly what was taken),
what it commits (the offset after the last message yielded, per partition), how it takes a
partition's end, a node that sends past the credit, and a connection older than version 7
(nothing sent, a clear error). A reader that hoards or leaks credit, or commits the wrong
offsets, fails here without a broker."""

from __future__ import annotations

import asyncio
from typing import Any, List

import pytest

import keratin
from keratin import _wire as w

from .fake import FakeConn, FakeNode, run


def batch(tag: str, partition: int, offsets: List[int], moved_from: Any = None) -> w.StreamDeliver:
    messages = [w.StreamMessage(o, 1_700_000_000_000 + o, "k%d" % o, [("h", "v")], b"m%d" % o) for o in offsets]
    return w.StreamDeliver(tag, partition, moved_from, messages)


async def until(condition: Any, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def test_stream_calls_on_an_older_connection_send_nothing() -> None:
    async def go() -> None:
        node = FakeNode()
        node.accept_versions = (1, 6)
        address = await node.start()
        async with await keratin.connect(address) as client:
            assert client.protocol_version == 6
            calls = [
                client.declare_stream("s"),
                client.set_stream("s", max_bytes=1),
                client.stream_info("s"),
                client.list_streams(),
                client.delete_stream("s"),
                client.commit_cursor("s", "c", {0: 1}),
            ]
            for call in calls:
                with pytest.raises(keratin.StreamsUnsupportedError, match="speaks protocol 6; streams need 7"):
                    await call
            with pytest.raises(keratin.StreamsUnsupportedError):
                client.stream_subscribe("s")
            await client.list()  # the connection still works
        assert [type(f).__name__ for f in node.frames if type(f).__name__ != "Close"] == ["QueueList"]
        await node.stop()

    run(go())


def test_declare_set_info_list_frames() -> None:
    async def go() -> None:
        node = FakeNode()

        async def info(conn: FakeConn, frame: w.StreamInfo) -> None:
            p = w.StreamPartitionInfo(3, 10, 7, 70, 4096, 1_700_000_000_000)
            await conn.send(w.StreamInfoReply(frame.request_id, frame.stream, w.StreamSettings(2), [p, p]))

        async def listing(conn: FakeConn, frame: w.StreamList) -> None:
            await conn.send(w.StreamListReply(frame.request_id, [w.StreamSummary("s", 2, 14, 140)]))

        node.on("StreamInfo", info)
        node.on("StreamList", listing)
        address = await node.start()
        async with await keratin.connect(address) as client:
            await client.declare_stream("s", partitions=2, max_age_ms=1000)
            await client.set_stream("s", max_bytes=5, max_age_ms=None)
            got = await client.stream_info("s")
            assert got.messages == 14 and got.bytes == 140 and got.partitions[0].start_offset == 3
            assert [x.stream for x in await client.list_streams()] == ["s"]
            await client.commit_cursor("s", "c", {3: 30, 1: 10})
            await client.delete_stream("s")
        declare = node.received("StreamDeclare")[0]
        assert declare.settings == w.StreamSettings(2, None, None, 1000, None) and declare.nodes == []
        update = node.received("StreamSet")[0]
        assert update.max_bytes == w.Update(w.UPDATE_SET, 5)
        assert update.max_age_ms == w.Update(w.UPDATE_CLEAR)
        assert update.max_messages == w.Update(w.UPDATE_KEEP)
        commit = node.received("CursorCommit")[0]
        assert commit.entries == [w.CursorEntry(1, 10), w.CursorEntry(3, 30)]  # ascending
        assert node.received("StreamDelete")[0].stream == "s"
        await node.stop()

    run(go())


def test_subscribe_fields_and_start_positions() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        async with await keratin.connect(address) as client:
            starts = ["first", "last", "next", ("offset", 7), ("timestamp", 1_700_000_000_000)]
            for start in starts:
                reader = client.stream_subscribe(
                    "s", cursor="c", start=start, credit=10, auto_commit=True, partitions=[2, 0]
                )
                await reader.start()
                await reader.cancel()
            for bad in ("middle", ("offset", -1), ("since", 3), 5):
                with pytest.raises(ValueError):
                    client.stream_subscribe("s", start=bad)
            with pytest.raises(ValueError):
                client.stream_subscribe("s", credit=0)
            with pytest.raises(ValueError):
                client.stream_subscribe("s", auto_commit=True)  # no cursor
        subs = node.received("StreamSubscribe")
        assert [(x.start.kind, x.start.value) for x in subs] == [
            (w.START_FIRST, 0), (w.START_LAST, 0), (w.START_NEXT, 0),
            (w.START_OFFSET, 7), (w.START_TIMESTAMP, 1_700_000_000_000),
        ]
        first = subs[0]
        assert (first.stream, first.cursor, first.group, first.credit, first.auto_commit) == ("s", "c", False, 10, True)
        assert first.partitions == [2, 0]
        assert len(node.received("Cancel")) == len(starts)
        await node.stop()

    run(go())


def test_credit_is_given_back_once_half_is_taken_and_commit_sends_last_plus_one() -> None:
    async def go() -> None:
        node = FakeNode()

        async def subscribe(conn: FakeConn, frame: w.StreamSubscribe) -> None:
            await conn.send(w.SubscribeOk(frame.request_id, frame.consumer_tag))
            await conn.send(batch(frame.consumer_tag, 0, [0, 1, 2], moved_from=None))
            await conn.send(batch(frame.consumer_tag, 1, [5, 7], moved_from=4))
            await conn.send(batch(frame.consumer_tag, 0, [3, 4, 5]))

        node.on("StreamSubscribe", subscribe)
        address = await node.start()
        async with await keratin.connect(address) as client:
            async with client.stream_subscribe("s", cursor="c", credit=8) as reader:
                got = []
                async for d in reader:
                    got.append(d)
                    if len(got) == 3:
                        # Three of 8 taken: under half, nothing given back yet.
                        await asyncio.sleep(0.05)
                        assert node.received("StreamCredit") == []
                    if len(got) == 8:
                        break
                await until(lambda: len(node.received("StreamCredit")) == 2)
                credits = node.received("StreamCredit")
                assert [c.credit for c in credits] == [4, 4]
                assert all(c.consumer_tag == reader.tag for c in credits)
                await reader.commit()
        assert [(d.partition, d.offset) for d in got] == [
            (0, 0), (0, 1), (0, 2), (1, 5), (1, 7), (0, 3), (0, 4), (0, 5),
        ]
        five = got[3]
        assert (five.key, five.headers, five.body, five.timestamp_ms) == ("k5", {"h": "v"}, b"m5", 1_700_000_000_005)
        assert five.moved_from == 4 and got[4].moved_from is None and got[0].moved_from is None
        commit = node.received("CursorCommit")[0]
        assert (commit.stream, commit.cursor) == ("s", "c")
        assert commit.entries == [w.CursorEntry(0, 6), w.CursorEntry(1, 8)]
        await node.stop()

    run(go())


def test_a_node_sending_past_the_credit_ends_the_connection() -> None:
    async def go() -> None:
        node = FakeNode()

        async def subscribe(conn: FakeConn, frame: w.StreamSubscribe) -> None:
            await conn.send(w.SubscribeOk(frame.request_id, frame.consumer_tag))
            await conn.send(batch(frame.consumer_tag, 0, [0, 1, 2]))

        node.on("StreamSubscribe", subscribe)
        address = await node.start()
        client = await keratin.connect(address)
        reader = client.stream_subscribe("s", credit=2)
        with pytest.raises(keratin.ProtocolError, match="3 messages with 2 credit left"):
            async for _ in reader:
                pass
        assert not client.is_connected
        await client.close()
        await node.stop()

    run(go())


def test_partition_ends() -> None:
    async def go() -> None:
        node = FakeNode()

        async def subscribe(conn: FakeConn, frame: w.StreamSubscribe) -> None:
            tag = frame.consumer_tag
            await conn.send(w.SubscribeOk(frame.request_id, tag))
            await conn.send(batch(tag, 0, [0]))
            moved = w.ErrorBody(409, "partition 1 was assigned to another member")
            await conn.send(w.StreamPartitionEnd(tag, 1, moved))
            await conn.send(batch(tag, 0, [1]))
            for p in (0, 1):
                await conn.send(w.StreamPartitionEnd(tag, p, w.ErrorBody(404, "stream s was deleted")))

        node.on("StreamSubscribe", subscribe)
        address = await node.start()
        async with await keratin.connect(address) as client:
            async with client.stream_subscribe("s") as reader:
                got = []
                with pytest.raises(keratin.NotFoundError, match="was deleted"):
                    async for d in reader:
                        got.append(d.offset)
                assert got == [0, 1]  # the 409 of partition 1 did not stop partition 0
                assert isinstance(reader.ended_partitions[0], keratin.NotFoundError)
                with pytest.raises(StopAsyncIteration):
                    await reader.__anext__()
            assert client.is_connected
        await node.stop()

    run(go())


def test_a_lost_connection_ends_a_reader() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        client = await keratin.connect(address)
        reader = await client.stream_subscribe("s").start()
        node.drop_connections()
        with pytest.raises(keratin.ConnectionLostError):
            async for _ in reader:
                pass
        await client.close()
        await node.stop()

    run(go())


def test_a_queue_delivery_carries_its_key_in_version_7_only() -> None:
    async def go() -> None:
        for version, key in ((7, "k"), (6, None)):
            node = FakeNode()
            node.accept_versions = (1, version)

            async def subscribe(conn: FakeConn, frame: w.Subscribe) -> None:
                await conn.send(w.SubscribeOk(frame.request_id, frame.consumer_tag))
                await conn.send(w.Deliver(frame.consumer_tag, 1, 0, 0, False, 1, [], b"x", "k"))

            node.on("Subscribe", subscribe)
            address = await node.start()
            async with await keratin.connect(address) as client:
                async with client.consume("q") as consumer:
                    async for d in consumer:
                        assert d.key == key
                        break
            await node.stop()

    run(go())


def test_stream_codec_bounds() -> None:
    # A count over its bound is malformed at the count, before any item is read.
    body = w.encode_body(w.StreamDeliver("c", 0, None, []))
    over = body[:-4] + (257).to_bytes(4, "little")
    with pytest.raises(keratin.ProtocolError, match="over its bound of 256"):
        w.decode_frame(w.StreamDeliver.TYPE, over)
    with pytest.raises(ValueError):
        w.encode_frame(w.StreamSubscribe(1, "s", "c", partitions=list(range(65))))
    with pytest.raises(ValueError):
        w.encode_frame(w.CursorCommit(1, "s", "c", [w.CursorEntry(p, 0) for p in range(65)]))
    with pytest.raises(ValueError):
        w.encode_frame(w.StreamSubscribe(1, "s", "c", start=w.StreamStart(w.START_LAST, 3)))
    # Start kind 5, and a value with kind 0 to 2, are malformed.
    good = w.encode_body(w.StreamSubscribe(1, "s", "c"))
    kind_at = 8 + 3 + 3 + 1 + 1
    with pytest.raises(keratin.ProtocolError, match="start kind 5"):
        w.decode_frame(w.StreamSubscribe.TYPE, good[:kind_at] + b"\x05" + good[kind_at + 1 :])
    with_value = good[: kind_at + 1] + (9).to_bytes(8, "little") + good[kind_at + 9 :]
    with pytest.raises(keratin.ProtocolError, match="must be 0"):
        w.decode_frame(w.StreamSubscribe.TYPE, with_value)
    # A stream frame is an unknown type below version 7, both ways.
    with pytest.raises(keratin.ProtocolError, match="unknown frame type"):
        w.decode_frame(w.StreamList.TYPE, (1).to_bytes(8, "little"), version=6)
    with pytest.raises(ValueError, match="needs protocol version 7"):
        w.encode_frame(w.StreamList(1), version=6)
    # Deliver's routing key is on the wire in version 7 only.
    deliver = w.Deliver("c", 1, 0, 0, False, 1, [], b"x", "k")
    assert len(w.encode_body(deliver, 7)) == len(w.encode_body(deliver, 6)) + 1 + 2 + 1
    assert w.decode_frame(w.Deliver.TYPE, w.encode_body(deliver, 6), version=6).routing_key is None
