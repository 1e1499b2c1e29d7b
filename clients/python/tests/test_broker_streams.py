"""Against the real ``keratin`` binary, streams (protocol version 7, issue 18): declare, info,
list, set and delete; 1,000 keyed messages over 4 partitions read back in each key's order;
a reader resuming from a committed cursor on a new connection; ``auto_commit`` keeping the
position across a cancel; a reader told that its stream was deleted; the routing key on a
queue's ``Deliver``; a consumer group of two readers sharing four partitions. A client that drifts from the broker's stream frames fails here with the
broker's own error (or a ProtocolError naming the frame)."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from typing import Dict, List

import pytest

import keratin

from .conftest import Broker
from .fake import run


def name(prefix: str) -> str:
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


async def read(reader: keratin.StreamConsumer, count: int, timeout: float = 10.0) -> List[keratin.StreamDelivery]:
    out: List[keratin.StreamDelivery] = []

    async def collect() -> None:
        async for delivery in reader:
            out.append(delivery)
            if len(out) == count:
                return

    await asyncio.wait_for(collect(), timeout)
    return out


def test_declare_info_list_set_delete(broker: Broker) -> None:
    async def go() -> None:
        s = name("events")
        async with await keratin.connect(broker.address) as client:
            assert client.protocol_version == 7
            await client.declare_stream(s, partitions=3, max_bytes=1 << 30)
            await client.declare_stream(s, partitions=3, max_bytes=1 << 30)  # same: succeeds
            with pytest.raises(keratin.ConflictError):
                await client.declare_stream(s, partitions=2)
            info = await client.stream_info(s)
            assert info.stream == s and info.settings.partitions == 3
            assert info.settings.max_bytes == 1 << 30 and info.settings.max_age_ms is None
            assert len(info.partitions) == 3 and info.messages == 0
            await client.publish(s, b"one", key="k")
            info = await client.stream_info(s)
            assert info.messages == 1 and info.bytes >= 3
            assert sum(p.next_offset - p.start_offset for p in info.partitions) == 1
            listed = {x.stream: x for x in await client.list_streams()}
            assert listed[s].partitions == 3 and listed[s].messages == 1

            await client.set_stream(s, max_age_ms=60_000)  # max_bytes kept
            settings = (await client.stream_info(s)).settings
            assert settings.max_age_ms == 60_000 and settings.max_bytes == 1 << 30
            await client.set_stream(s, max_bytes=None, max_messages=10)
            settings = (await client.stream_info(s)).settings
            assert (settings.max_bytes, settings.max_age_ms, settings.max_messages) == (None, 60_000, 10)

            await client.delete_stream(s)
            with pytest.raises(keratin.NotFoundError):
                await client.stream_info(s)
            assert s not in {x.stream for x in await client.list_streams()}
            with pytest.raises(keratin.BadRequestError):
                await client.declare_stream(name("bad"), partitions=65)

    run(go())


def test_keyed_messages_come_back_in_each_keys_order(broker: Broker) -> None:
    async def go() -> None:
        s = name("keyed")
        keys = ["customer-%d" % i for i in range(10)]
        async with await keratin.connect(broker.address) as client:
            await client.declare_stream(s, partitions=4)
            # One batch after another: concurrent appends to a stream partition crash it in
            # this broker (see test_concurrent_publishes_to_a_stream below).
            for k in keys:
                await client.publish_batch(
                    s, [keratin.Message(b"%s %d" % (k.encode(), i), key=k) for i in range(100)]
                )
            info = await client.stream_info(s)
            assert info.messages == 1000
            assert sum(1 for p in info.partitions if p.messages) > 1  # the keys spread
            # A small credit: the reader must top it up many times to read everything.
            async with client.stream_subscribe(s, credit=64) as reader:
                got = await read(reader, 1000)
            by_key: Dict[str, List[int]] = defaultdict(list)
            partition_of: Dict[str, set] = defaultdict(set)
            for d in got:
                assert d.key is not None
                key, number = d.body.decode().rsplit(" ", 1)
                assert key == d.key
                by_key[key].append(int(number))
                partition_of[key].add(d.partition)
            assert sorted(by_key) == keys
            for key in keys:
                assert by_key[key] == list(range(100)), key
                assert len(partition_of[key]) == 1  # one key, one partition
            per_partition: Dict[int, List[int]] = defaultdict(list)
            for d in got:
                per_partition[d.partition].append(d.offset)
            for offsets in per_partition.values():
                assert offsets == sorted(offsets)

    run(go())


def test_a_reader_resumes_from_its_committed_cursor(broker: Broker) -> None:
    async def go() -> None:
        s = name("resume")
        async with await keratin.connect(broker.address) as client:
            await client.declare_stream(s, partitions=2)
            await client.publish_batch(s, [keratin.Message(b"m%d" % i, key="k%d" % i) for i in range(20)])
            async with client.stream_subscribe(s, cursor="billing", credit=5) as reader:
                first = await read(reader, 8)
                await reader.commit()
        async with await keratin.connect(broker.address) as client:
            async with client.stream_subscribe(s, cursor="billing", credit=100) as reader:
                rest = await read(reader, 12)
                # Nothing more: the first reader's 8 are not read again.
                with pytest.raises(asyncio.TimeoutError):
                    await read(reader, 1, timeout=0.5)
            assert sorted(d.body for d in first + rest) == sorted(b"m%d" % i for i in range(20))
            # Without the cursor a reader starts where ``start`` says.
            async with client.stream_subscribe(s, start="last", credit=10) as reader:
                last = await read(reader, 2)  # the newest message of each partition
            assert {d.partition for d in last} == {0, 1}

    run(go())


def test_auto_commit_keeps_the_position_across_cancel(broker: Broker) -> None:
    async def go() -> None:
        s = name("auto")
        async with await keratin.connect(broker.address) as client:
            await client.declare_stream(s, partitions=1)
            await client.publish_batch(s, [b"a%d" % i for i in range(10)])
            reader = client.stream_subscribe(s, cursor="tail", credit=100, auto_commit=True)
            assert [d.body for d in await read(reader, 10)] == [b"a%d" % i for i in range(10)]
            await reader.cancel()  # answered after the node's last commit
            await client.publish_batch(s, [b"b%d" % i for i in range(3)])
            async with client.stream_subscribe(s, cursor="tail", credit=100, auto_commit=True) as again:
                assert [d.body for d in await read(again, 3)] == [b"b0", b"b1", b"b2"]
                with pytest.raises(asyncio.TimeoutError):
                    await read(again, 1, timeout=0.5)

            # The node commits what it *sent*: credit 4, one message taken (no top-up yet),
            # so the cursor stands after the 4 sent, not after the 1 taken.
            t = name("sent")
            await client.declare_stream(t, partitions=1)
            await client.publish_batch(t, [b"c%d" % i for i in range(10)])
            reader = client.stream_subscribe(t, cursor="c", credit=4, auto_commit=True)
            assert [d.offset for d in await read(reader, 1)] == [0]
            await asyncio.sleep(0.3)  # the node sent its 4
            await reader.cancel()
            async with client.stream_subscribe(t, cursor="c", credit=100) as again:
                assert [d.offset for d in await read(again, 6)] == list(range(4, 10))
            with pytest.raises(ValueError):
                client.stream_subscribe(s, auto_commit=True)

    run(go())


def test_a_reader_is_told_when_its_stream_is_deleted(broker: Broker) -> None:
    async def go() -> None:
        s = name("doomed")
        async with await keratin.connect(broker.address) as client:
            await client.declare_stream(s, partitions=2)
            await client.publish(s, b"x")
            async with client.stream_subscribe(s) as reader:
                assert [d.body for d in await read(reader, 1)] == [b"x"]
                await client.delete_stream(s)
                with pytest.raises(keratin.NotFoundError):
                    await read(reader, 1)
                assert set(reader.ended_partitions) <= {0, 1} and reader.ended_partitions
            assert client.is_connected

    run(go())


def test_a_queue_delivery_carries_its_routing_key(broker: Broker) -> None:
    async def go() -> None:
        q = name("keyed-queue")
        async with await keratin.connect(broker.address) as client:
            await client.declare(q)
            await client.publish(q, b"with", key="customer-7")
            await client.publish(q, b"without")
            async with client.consume(q) as consumer:
                got = []
                async for d in consumer:
                    got.append(d)
                    await d.ack()
                    if len(got) == 2:
                        break
            assert {d.body: d.key for d in got} == {b"with": "customer-7", b"without": None}

    run(go())


def test_a_group_shares_the_partitions_and_hands_them_over(broker: Broker) -> None:
    """Two readers of one cursor with ``group=True``: the first reads every partition; when
    the second joins, the first is told its partitions 2 and 3 went (409, ConflictError) and
    they leave its positions; what is published after goes to exactly one of them, by
    partition; the first's commit then names only its own partitions."""

    async def go() -> None:
        s = name("grouped")
        async with await keratin.connect(broker.address) as client, await keratin.connect(
            broker.address
        ) as other:
            await client.declare_stream(s, partitions=4)
            await client.publish_batch(s, [keratin.Message(b"%d" % i, key="k%d" % i) for i in range(200)])
            a = client.stream_subscribe(s, cursor="team", group=True, auto_commit=True)
            first = await read(a, 200)
            assert sorted(int(d.body) for d in first) == list(range(200))
            b = other.stream_subscribe(s, cursor="team", group=True, auto_commit=True)
            await b.start()
            for _ in range(100):
                if len(a.ended_partitions) == 2:
                    break
                await asyncio.sleep(0.05)
            assert sorted(a.ended_partitions) == [2, 3]
            assert all(isinstance(e, keratin.ConflictError) for e in a.ended_partitions.values())
            assert set(a.positions) <= {0, 1}

            await client.publish_batch(s, [keratin.Message(b"%d" % i, key="k%d" % i) for i in range(200, 300)])
            info = await client.stream_info(s)
            held = [p.messages for p in info.partitions]
            before = sum(1 for d in first if d.partition < 2)
            to_a = held[0] + held[1] - before
            got_a = await read(a, to_a)
            got_b = await read(b, 100 - to_a)
            assert all(d.partition < 2 for d in got_a) and all(d.partition >= 2 for d in got_b)
            assert sorted(int(d.body) for d in got_a + got_b) == list(range(200, 300))
            await a.commit()  # only partitions 0 and 1: the broker would refuse 2 and 3
            await b.cancel()
            await a.cancel()
            with pytest.raises(ValueError):
                client.stream_subscribe(s, group=True)
            with pytest.raises(ValueError):
                client.stream_subscribe(s, cursor="team", group=True, partitions=[1])

    run(go())


def test_concurrent_publishes_to_a_stream(broker: Broker) -> None:
    async def go() -> None:
        s = name("concurrent")
        async with await keratin.connect(broker.address) as client:
            await client.declare_stream(s, partitions=4)
            for _ in range(5):
                await asyncio.gather(
                    *(
                        client.publish_batch(s, [keratin.Message(b"m", key="k%d" % j) for _ in range(10)])
                        for j in range(10)
                    )
                )
            assert (await client.stream_info(s)).messages == 500

    run(go())
