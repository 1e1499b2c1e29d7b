"""Against the real ``keratin`` binary: round trips (declare, publish, consume, ack, reject,
info, list, purge, delete, settings), every error code a single node can be made to send
(400, 404, 409, 413, 429; 401 and 403 are in test_broker_security.py), ``queue_full`` in
both overflow modes for confirmed and buffered publishes, and idempotent publishing. A
client that drifts from the broker fails here with the broker's own error."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, List

import pytest

import keratin

from .conftest import Broker
from .fake import run


def name(prefix: str) -> str:
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


async def take(consumer: keratin.Consumer, count: int, timeout: float = 5.0) -> List[keratin.Delivery]:
    out: List[keratin.Delivery] = []

    async def collect() -> None:
        async for delivery in consumer:
            out.append(delivery)
            if len(out) == count:
                return

    await asyncio.wait_for(collect(), timeout)
    return out


def test_round_trip_publish_consume_ack(broker: Broker) -> None:
    async def go() -> None:
        q = name("orders")
        async with await keratin.connect(broker.address) as client:
            assert client.user is None
            assert client.protocol_version == 7
            assert any(n.server for n in client.server_info.nodes)
            await client.declare(q, partitions=2)
            await client.declare(q, partitions=2)  # same settings: succeeds again
            await client.publish(q, b"hello", headers={"k": "v"}, key="customer-1")
            await client.publish(q, "world")
            info = await client.info(q)
            assert info.queue == q and info.settings.partitions == 2 and len(info.partitions) == 2
            assert info.ready == 2
            async with client.consume(q, prefetch=10) as consumer:
                got = await take(consumer, 2)
                assert sorted(d.body for d in got) == [b"hello", b"world"]
                hello = next(d for d in got if d.body == b"hello")
                assert hello.headers.get("k") == "v"
                assert not hello.redelivered and hello.delivery_count == 1
                for d in got:
                    await d.ack()
            await asyncio.sleep(0.2)
            info = await client.info(q)
            assert info.ready == 0 and info.inflight == 0
            summaries = {s.queue: s for s in await client.list()}
            assert summaries[q].partitions == 2
            await client.delete(q)
            with pytest.raises(keratin.NotFoundError):
                await client.info(q)

    run(go())


def test_reject_requeues_or_dead_letters(broker: Broker) -> None:
    async def go() -> None:
        q, dlq = name("work"), name("work-dlq")
        async with await keratin.connect(broker.address) as client:
            await client.declare(dlq)
            await client.declare(q, dead_letter=dlq, max_deliveries=5)
            await client.publish(q, b"job")
            async with client.consume(q, prefetch=1) as consumer:
                first = (await take(consumer, 1))[0]
                await first.reject(requeue=True)
                again = (await take(consumer, 1))[0]
                assert again.body == b"job" and again.redelivered and again.delivery_count == 2
                with pytest.raises(keratin.KeratinError, match="already settled"):
                    await first.ack()
                await again.reject(requeue=False)
            async with client.consume(dlq, prefetch=1) as consumer:
                dead = (await take(consumer, 1))[0]
                assert dead.body == b"job"
                await dead.ack()

    run(go())


def test_cancelled_consumer_returns_its_deliveries(broker: Broker) -> None:
    async def go() -> None:
        q = name("cancel")
        async with await keratin.connect(broker.address) as client:
            await client.declare(q)
            await client.publish_batch(q, [b"a", b"b", b"c"])
            consumer = client.consume(q, prefetch=3)
            await take(consumer, 3)
            assert (await client.info(q)).inflight == 3
            await consumer.cancel()
            with pytest.raises(StopAsyncIteration):
                await consumer.__anext__()
            await asyncio.sleep(0.2)
            info = await client.info(q)
            assert info.ready == 3 and info.inflight == 0
            await client.purge(q)
            assert (await client.info(q)).ready == 0

    run(go())


def test_settings_every_one_declared_and_changed(broker: Broker) -> None:
    async def go() -> None:
        q, dlq = name("settings"), name("settings-dlq")
        async with await keratin.connect(broker.address) as client:
            await client.declare(dlq)
            await client.declare(
                q, partitions=3, replicas=1, dead_letter=dlq, max_deliveries=4,
                max_messages=100, max_bytes=1 << 20, overflow="drop_oldest",
            )
            s = (await client.info(q)).settings
            assert (s.partitions, s.dead_letter, s.max_deliveries, s.max_messages, s.max_bytes, s.overflow) == (
                3, dlq, 4, 100, 1 << 20, "drop_oldest",
            )
            await client.set_queue_settings(q, max_messages=50, overflow="reject", dead_letter=None)
            s = (await client.info(q)).settings
            assert (s.max_messages, s.overflow, s.dead_letter, s.max_bytes) == (50, "reject", None, 1 << 20)

    run(go())


def test_error_codes_a_single_node_sends(broker: Broker) -> None:
    async def go() -> None:
        q = name("errors")
        async with await keratin.connect(broker.address) as client:
            with pytest.raises(keratin.NotFoundError) as not_found:
                await client.purge(name("missing"))
            assert not_found.value.code == 404
            with pytest.raises(keratin.BadRequestError) as bad:
                await client.declare(q, partitions=0)
            assert bad.value.code == 400
            with pytest.raises(keratin.BadRequestError):
                await client.declare(q, replicas=3)  # a node alone holds one replica
            await client.declare(q, partitions=1)
            with pytest.raises(keratin.ConflictError) as conflict:
                await client.declare(q, partitions=2)
            assert conflict.value.code == 409
            with pytest.raises(keratin.NotFoundError):
                await client.publish(name("missing"), b"x")
            assert client.is_connected

    run(go())


def test_a_message_larger_than_a_segment_is_413(start_broker: Any) -> None:
    node = start_broker({"KERATIN_STORAGE__SEGMENT_BYTES": "262144"})

    async def go() -> None:
        q = name("big")
        async with await keratin.connect(node.address) as client:
            await client.declare(q)
            with pytest.raises(keratin.TooLargeError) as caught:
                await client.publish(q, b"x" * 300_000)
            assert caught.value.code == 413
            await client.publish(q, b"small")  # the connection is still fine

    run(go())


def test_queue_full_with_overflow_reject_is_429_queue_full(broker: Broker) -> None:
    async def go() -> None:
        q = name("full")
        async with await keratin.connect(broker.address, publish_timeout=0.5) as client:
            await client.declare(q, max_messages=2, overflow="reject")
            await client.publish(q, b"1")
            await client.publish(q, b"2")
            with pytest.raises(keratin.LimitedError) as caught:
                await client.publish(q, b"3")
            error = caught.value
            assert error.code == 429 and error.reason == "queue_full" and error.retry_after_ms is not None
            assert error.timed_out
            assert (await client.info(q)).ready == 2

    run(go())


def test_queue_full_retry_succeeds_once_room_is_made(broker: Broker) -> None:
    async def go() -> None:
        q = name("room")
        async with await keratin.connect(broker.address, publish_timeout=10) as client:
            await client.declare(q, max_messages=1, overflow="reject")
            await client.publish(q, b"1")
            blocked = asyncio.ensure_future(client.publish(q, b"2"))
            await asyncio.sleep(0.3)
            assert not blocked.done()  # retrying on the queue_full hint
            await client.purge(q)
            await asyncio.wait_for(blocked, 8)
            assert (await client.info(q)).ready == 1

    run(go())


def test_queue_full_with_drop_oldest_keeps_the_newest(broker: Broker) -> None:
    async def go() -> None:
        q = name("ring")
        async with await keratin.connect(broker.address) as client:
            await client.declare(q, max_messages=3, overflow="drop_oldest")
            for i in range(6):
                await client.publish(q, b"m%d" % i)
            assert (await client.info(q)).ready == 3
            async with client.consume(q, prefetch=3) as consumer:
                got = await take(consumer, 3)
            assert sorted(d.body for d in got) == [b"m3", b"m4", b"m5"]

    run(go())


def test_buffered_publisher_reports_queue_full_drops(broker: Broker) -> None:
    async def go() -> None:
        q = name("buffered")
        async with await keratin.connect(broker.address) as client:
            await client.declare(q, max_messages=10, overflow="reject")
            dropped: List[keratin.DroppedPublish] = []
            pub = client.publisher(q, on_dropped=dropped.append, max_buffered=16)
            for i in range(40):
                await pub.publish(b"b%d" % i)
            await pub.flush(timeout=10)
            assert pub.unsettled_count == 0
            assert pub.dropped_count == 30 == len(dropped)
            assert {d.reason for d in dropped} == {"queue_full"}
            assert (await client.info(q)).ready == 10

    run(go())


def test_buffered_publisher_into_drop_oldest_drops_nothing(broker: Broker) -> None:
    async def go() -> None:
        q = name("buffered-ring")
        async with await keratin.connect(broker.address) as client:
            await client.declare(q, max_messages=5, overflow="drop_oldest")
            dropped: List[keratin.DroppedPublish] = []
            pub = client.publisher(q, on_dropped=dropped.append)
            for i in range(50):
                await pub.publish(b"r%d" % i)
            await pub.flush(timeout=10)
            assert dropped == [] and pub.dropped_count == 0
            assert (await client.info(q)).ready == 5

    run(go())


def test_an_idempotent_producer_stores_a_sequence_once(broker: Broker) -> None:
    async def go() -> None:
        q = name("idem")
        async with await keratin.connect(broker.address, producer_id=424242) as client:
            assert client.producer_id == 424242
            await client.declare(q)
            await client.publish_batch(q, [keratin.Message(b"once", sequence=1)])
            await client.publish_batch(q, [keratin.Message(b"once", sequence=1)])
            await client.publish_batch(q, [keratin.Message(b"next", sequence=2)])
            await client.publish(q, b"next", sequence=2)
            assert (await client.info(q)).ready == 2
        # A process restarted under the same producer id: a message without a sequence of the
        # application's is refused before it is sent (numbered from 1 again, it would be
        # confirmed and dropped), and one with a new sequence is stored.
        async with await keratin.connect(broker.address, producer_id=424242) as again:
            with pytest.raises(ValueError, match="sequence"):
                await again.publish(q, b"lost?")
            with pytest.raises(ValueError, match="sequence"):
                await again.publish_batch(q, [b"lost?"])
            await again.publish(q, b"third", sequence=3)
            assert (await again.info(q)).ready == 3
        # A random producer id (the default) numbers its messages itself.
        async with await keratin.connect(broker.address) as fresh:
            assert fresh.producer_id not in (None, 424242)
            await fresh.publish(q, b"fourth")
            assert (await fresh.info(q)).ready == 4

    run(go())


def test_many_publishes_in_flight_at_once(broker: Broker) -> None:
    async def go() -> None:
        q = name("many")
        async with await keratin.connect(broker.address) as client:
            await client.declare(q, partitions=4)
            await asyncio.gather(*(client.publish(q, b"p%d" % i, key=str(i)) for i in range(300)))
            assert (await client.info(q)).ready == 300
            received = 0
            async with client.consume(q, prefetch=50) as consumer:
                async for d in consumer:
                    await d.ack()
                    received += 1
                    if received == 300:
                        break

    run(go(), timeout=25)


def test_node_bounds_are_429_with_their_reason(start_broker: Any) -> None:
    node = start_broker({"KERATIN_SERVER__CONSUMERS_MAX": "1", "KERATIN_SERVER__CONNECTIONS_MAX": "2"})

    async def go() -> None:
        q = name("bounds")
        async with await keratin.connect(node.address) as client:
            await client.declare(q)
            async with client.consume(q, prefetch=1):
                with pytest.raises(keratin.LimitedError) as consumers:
                    await client.consume(q, prefetch=1).start()
                assert consumers.value.reason == "consumers" and consumers.value.retry_after_ms is not None
            async with await keratin.connect(node.address):
                with pytest.raises(keratin.LimitedError) as connections:
                    await keratin.connect(node.address)
                assert connections.value.reason == "connections"

    run(go())


def test_a_node_that_stops_ends_consumers_and_requests_clearly(start_broker: Any) -> None:
    node = start_broker()

    async def go() -> None:
        q = name("stopping")
        client = await keratin.connect(node.address)
        await client.declare(q)
        consumer = await client.consume(q, prefetch=1).start()
        await asyncio.get_running_loop().run_in_executor(None, node.stop)
        with pytest.raises(keratin.ConnectionLostError):
            await asyncio.wait_for(consumer.__anext__(), 5)
        assert not client.is_connected
        with pytest.raises(keratin.ConnectionLostError):
            await client.publish(q, b"after")
        with pytest.raises(keratin.ConnectError):
            await keratin.connect(node.address, connect_timeout=2)
        await client.close()

    run(go())
