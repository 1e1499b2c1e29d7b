"""The client's behaviour over fake nodes: every protocol code maps to its exception class;
confirmed publishes retry on 429 hints and give up with LimitedError naming the limit; 421
is followed to the named leader (requests, publishes, consumers) or, without one, to the
handshake's nodes with backoff, bounded; idempotent publishes are sent again elsewhere after
a lost connection; buffered publishes report drops with their reason; logins, version
fallback, heartbeats, Close."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, List, Optional

import pytest

import keratin
from keratin import _wire as w

from .fake import FakeConn, FakeNode, default_handler, run

CODES = {
    400: keratin.BadRequestError,
    401: keratin.UnauthorizedError,
    403: keratin.ForbiddenError,
    404: keratin.NotFoundError,
    409: keratin.ConflictError,
    413: keratin.TooLargeError,
    421: keratin.NotLeaderError,
    429: keratin.LimitedError,
    500: keratin.InternalError,
    503: keratin.UnavailableError,
    504: keratin.GatewayTimeoutError,
    599: keratin.ServerError,
}


def body_for(code: int, leader: Any = None) -> w.ErrorBody:
    if code == 429:
        return w.ErrorBody(429, "limited", "queue_full", 5)
    return w.ErrorBody(code, "code %d" % code, leader_addr=leader)


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_error_code_raises_its_class(code: int) -> None:
    async def go() -> None:
        node = FakeNode()

        async def refuse(conn: FakeConn, frame: Any) -> None:
            await conn.send(w.Error(frame.request_id, False, body_for(code)))

        node.on("Delete", refuse)
        address = await node.start()
        client = await keratin.connect(address, request_timeout=0.5)
        with pytest.raises(CODES[code]) as caught:
            await client.delete("q")
        error = caught.value
        assert type(error) is CODES[code]
        assert error.code == code and isinstance(error, keratin.KeratinError)
        assert ("code %d" % code) in str(error) or code == 429
        if code == 429:
            assert error.reason == "queue_full" and error.retry_after_ms == 5
        assert client.is_connected  # a non-fatal Error keeps the connection
        await client.close()
        await node.stop()

    run(go())


def test_a_504_is_an_outcome_unknown() -> None:
    assert issubclass(keratin.GatewayTimeoutError, keratin.OutcomeUnknownError)


def test_a_refused_login_is_unauthorized_and_a_user_is_reported() -> None:
    async def go() -> None:
        node = FakeNode(user="bob")
        address = await node.start()
        client = await keratin.connect(address, user="bob", password="pw")
        assert client.user == "bob"
        assert node.hellos[0].mechanism == w.MECHANISM_PLAIN and node.hellos[0].password == "pw"
        await client.close()
        node.refuse = w.ErrorBody(401, "login failed", retry_after_ms=1000)
        with pytest.raises(keratin.UnauthorizedError) as caught:
            await keratin.connect(address, token="kt_x")
        assert caught.value.retry_after_ms == 1000
        assert node.hellos[1].mechanism == w.MECHANISM_TOKEN
        await node.stop()

    run(go())


def test_an_older_node_is_spoken_to_in_its_version_and_refuses_logins() -> None:
    async def go() -> None:
        node = FakeNode()
        node.accept_versions = (1, 5)
        address = await node.start()
        client = await keratin.connect(address)
        assert client.protocol_version == 5
        assert [h.version for h in node.hellos] == [w.PROTOCOL_VERSION, 5]
        await client.declare("q")
        await client.close()
        with pytest.raises(keratin.LoginUnsupportedError):
            await keratin.connect(address, user="bob", password="pw")
        await node.stop()

    run(go())


def test_confirmed_publish_retries_on_429_hints_until_confirmed() -> None:
    async def go() -> None:
        node = FakeNode()
        refusals: List[int] = []

        async def limited_twice(conn: FakeConn, frame: Any) -> None:
            if len(refusals) < 2:
                refusals.append(1)
                ids = [m.publish_id for m in frame.messages]
                await conn.send(
                    w.PublishError([(min(ids), max(ids))], w.ErrorBody(429, "disk full", "disk", 50))
                )
            else:
                await default_handler(conn, frame)

        node.on("Publish", limited_twice)
        address = await node.start()
        client = await keratin.connect(address, publish_timeout=5)
        started = time.monotonic()
        await client.publish("q", b"hello", headers={"k": "v"}, key="r")
        assert time.monotonic() - started >= 0.1  # waited out two hints of 50 ms
        publishes = node.received("Publish")
        assert len(publishes) == 3
        # The same message and sequence each time, under new publish ids.
        sequences = {p.messages[0].sequence for p in publishes}
        assert len(sequences) == 1 and None not in sequences
        assert len({p.messages[0].publish_id for p in publishes}) == 3
        assert publishes[0].messages[0].headers == [("k", "v")]
        assert publishes[0].messages[0].routing_key == "r"
        assert publishes[0].producer_id == client.producer_id
        await client.close()
        await node.stop()

    run(go())


def test_confirmed_publish_gives_up_with_limited_error_naming_the_limit() -> None:
    async def go() -> None:
        node = FakeNode()

        async def always_full(conn: FakeConn, frame: Any) -> None:
            ids = [m.publish_id for m in frame.messages]
            await conn.send(
                w.PublishError([(min(ids), max(ids))], w.ErrorBody(429, "queue q is full", "queue_full", 100))
            )

        node.on("Publish", always_full)
        address = await node.start()
        client = await keratin.connect(address, publish_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(keratin.LimitedError) as caught:
            await client.publish("q", b"x")
        elapsed = time.monotonic() - started
        assert 0.4 <= elapsed < 2.0, elapsed
        assert caught.value.reason == "queue_full" and caught.value.retry_after_ms == 100
        assert caught.value.timed_out
        assert len(node.received("Publish")) >= 3
        await client.close()
        await node.stop()

    run(go())


def test_publish_batch_names_each_failed_message() -> None:
    async def go() -> None:
        node = FakeNode()

        async def refuse_second(conn: FakeConn, frame: Any) -> None:
            ids = [m.publish_id for m in frame.messages]
            await conn.send(w.Confirm([(ids[0], ids[0]), (ids[2], ids[2])]))
            await conn.send(w.PublishError([(ids[1], ids[1])], w.ErrorBody(413, "too big")))

        node.on("Publish", refuse_second)
        address = await node.start()
        client = await keratin.connect(address)
        with pytest.raises(keratin.PublishBatchError) as caught:
            await client.publish_batch("q", [b"a", keratin.Message(b"b", key="k"), "c"])
        assert list(caught.value.errors) == [1]
        assert isinstance(caught.value.errors[1], keratin.TooLargeError)
        assert node.received("Publish")[0].mode == w.MODE_CONFIRMED  # not joinable
        await client.close()
        await node.stop()

    run(go())


async def two_nodes() -> "tuple[FakeNode, FakeNode]":
    a, b = FakeNode("a"), FakeNode("b")
    await a.start()
    await b.start()
    nodes = [w.NodeAddress("a", a.address), w.NodeAddress("b", b.address)]
    a.nodes = b.nodes = nodes
    return a, b


def test_requests_and_publishes_follow_421_to_the_named_leader() -> None:
    async def go() -> None:
        a, b = await two_nodes()

        async def not_leader(conn: FakeConn, frame: Any) -> None:
            body = w.ErrorBody(421, "led by b", leader_addr=b.address)
            if isinstance(frame, w.Publish):
                ids = [m.publish_id for m in frame.messages]
                await conn.send(w.PublishError([(min(ids), max(ids))], body))
            else:
                await conn.send(w.Error(frame.request_id, False, body))

        for name in ("Declare", "Publish", "Subscribe"):
            a.on(name, not_leader)
        client = await keratin.connect(a.address)
        await client.declare("q", partitions=2, max_messages=10, overflow="drop_oldest")
        declared = b.received("Declare")
        assert len(declared) == 1 and declared[0].settings.overflow == "drop_oldest"
        await client.publish("q", b"one")
        await client.publish("q", b"two")
        # The leader is remembered: the second publish went straight to b.
        assert len(a.received("Publish")) == 1
        assert [p.messages[0].body for p in b.received("Publish")] == [b"one", b"two"]
        async with client.consume("q", prefetch=5) as consumer:
            assert consumer.node_address == b.address
        await client.close()
        await a.stop()
        await b.stop()

    run(go())


def subscribe_delivering(deliver: w.Deliver, end: Optional[w.ErrorBody] = None) -> Any:
    """A fake node's ``Subscribe`` answer: accepted, then ``deliver`` (its consumer tag
    replaced by the subscription's), then, with ``end``, the consumer ended with that error."""

    async def handler(conn: FakeConn, frame: Any) -> None:
        await conn.send(w.SubscribeOk(frame.request_id, frame.consumer_tag))
        await conn.send(dataclasses.replace(deliver, consumer_tag=frame.consumer_tag))
        if end is not None:
            await conn.send(w.ConsumerEnd(frame.consumer_tag, end))

    return handler


def queue_info_led_by(leader: Callable[[], Optional[str]]) -> Any:
    """A fake node's ``QueueInfo`` answer: one partition, led by the address ``leader()``
    names when asked (``None``: no leader known)."""

    async def handler(conn: FakeConn, frame: Any) -> None:
        partition = w.PartitionInfo(0, 0, 0, 0, leading=False, leader_addr=leader())
        await conn.send(w.QueueInfoReply(frame.request_id, frame.queue, w.QueueSettings(), [partition]))

    return handler


async def consume_bodies(client: keratin.Client, queue: str, count: int) -> List[bytes]:
    """The bodies of the first ``count`` deliveries of ``queue``, each acknowledged; leaving
    the block cancels the consumer."""
    bodies: List[bytes] = []
    async with client.consume(queue, prefetch=10) as consumer:
        async for delivery in consumer:
            bodies.append(delivery.body)
            await delivery.ack()
            if len(bodies) == count:
                break
    return bodies


def test_421_without_a_leader_backs_off_over_the_known_nodes_and_is_bounded() -> None:
    async def go() -> None:
        a, b = await two_nodes()

        async def no_leader(conn: FakeConn, frame: Any) -> None:
            await conn.send(w.Error(frame.request_id, False, w.ErrorBody(421, "election", retry_after_ms=10)))

        a.on("Purge", no_leader)
        b.on("Purge", no_leader)
        client = await keratin.connect(a.address, request_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(keratin.NotLeaderError, match="found no leader"):
            await client.purge("q")
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 2.5, elapsed
        # Both nodes were asked, in turn, with backoff (not a busy loop).
        assert 1 <= len(b.received("Purge")) <= 8
        assert 2 <= len(a.received("Purge")) <= 9
        await client.close()
        await a.stop()
        await b.stop()

    run(go())


def test_a_consumer_waits_out_a_partition_without_a_leader_while_the_nodes_answer() -> None:
    """A leader move or an election can leave a partition without a leader for longer than
    ``request_timeout``; while the nodes answer, the consumer keeps looking and resumes at the
    new leader instead of ending."""

    async def go() -> None:
        a, b = await two_nodes()
        leader_from = time.monotonic() + 4.5  # nine request timeouts without a leader

        leader_later = queue_info_led_by(lambda: b.address if time.monotonic() >= leader_from else None)
        a.on("Subscribe", subscribe_delivering(w.Deliver("", 1, 0, 0, False, 1, [], b"from a"), end=w.ErrorBody(421, "stepped down")))
        a.on("QueueInfo", leader_later)
        b.on("QueueInfo", leader_later)
        b.on("Subscribe", subscribe_delivering(w.Deliver("", 7, 0, 0, True, 2, [], b"from b")))
        client = await keratin.connect(a.address, request_timeout=0.5)
        assert await consume_bodies(client, "q", 2) == [b"from a", b"from b"]
        await client.close()
        await a.stop()
        await b.stop()

    run(go())


def test_a_consumer_ended_with_421_subscribes_again_at_the_leader() -> None:
    async def go() -> None:
        a, b = await two_nodes()

        moved = w.ErrorBody(421, "moved", leader_addr=b.address)
        a.on("Subscribe", subscribe_delivering(w.Deliver("", 1, 0, 0, False, 1, [], b"from a"), end=moved))
        # After the move a names b as the partition's leader (the consumer reads the leaders
        # again and would subscribe at a node that says it leads).
        a.on("QueueInfo", queue_info_led_by(lambda: b.address))
        b.on("Subscribe", subscribe_delivering(w.Deliver("", 7, 0, 0, True, 2, [("h", "v")], b"from b")))
        client = await keratin.connect(a.address)
        assert await consume_bodies(client, "q", 2) == [b"from a", b"from b"]
        assert b.received("Subscribe")[0].prefetch == 10
        assert [f.delivery_ids for f in b.received("Ack")] == [[7]]
        assert len(b.received("Cancel")) == 1  # leaving the block cancels at the new leader
        await client.close()
        await a.stop()
        await b.stop()

    run(go())


def test_a_lost_connection_sends_an_idempotent_publish_again_elsewhere() -> None:
    async def go() -> None:
        a, b = await two_nodes()

        async def drop(conn: FakeConn, frame: Any) -> None:
            conn.writer.transport.abort()  # type: ignore[attr-defined]

        a.on("Publish", drop)
        client = await keratin.connect(a.address, publish_timeout=5)
        await client.publish("q", b"once")
        sent_a = a.received("Publish")[0]
        sent_b = b.received("Publish")[0]
        assert sent_a.messages[0].sequence == sent_b.messages[0].sequence
        assert sent_a.producer_id == sent_b.producer_id == client.producer_id
        await client.close()
        await a.stop()
        await b.stop()

    run(go())


def test_a_lost_connection_is_an_unknown_outcome_on_a_single_node() -> None:
    async def go() -> None:
        node = FakeNode()

        async def drop(conn: FakeConn, frame: Any) -> None:
            conn.writer.transport.abort()  # type: ignore[attr-defined]

        node.on("Publish", drop)
        address = await node.start()
        client = await keratin.connect(address, idempotent=False)
        assert client.producer_id is None
        with pytest.raises(keratin.OutcomeUnknownError):
            await client.publish("q", b"x")
        assert node.received("Publish")[0].producer_id is None
        with pytest.raises(keratin.ConnectionLostError):
            await client.declare("q")
        await client.close()
        await node.stop()

    run(go())


def test_buffered_publisher_reports_drops_with_their_reason_and_stays_bounded() -> None:
    async def go() -> None:
        node = FakeNode()

        async def refuse_odd(conn: FakeConn, frame: Any) -> None:
            for m in frame.messages:
                if m.body[0] % 2:
                    await conn.send(
                        w.PublishError([(m.publish_id, m.publish_id)], w.ErrorBody(429, "full", "queue_full", 10))
                    )

        node.on("Publish", refuse_odd)
        address = await node.start()
        client = await keratin.connect(address)
        dropped: List[keratin.DroppedPublish] = []
        pub = client.publisher("q", on_dropped=dropped.append, max_buffered=4)
        for i in range(20):
            await pub.publish(bytes([i]))
            assert pub.unsettled_count <= 4
        await pub.flush(timeout=5)
        assert pub.unsettled_count == 0
        assert pub.dropped_count == 10
        assert sorted(d.message.body_bytes()[0] for d in dropped) == list(range(1, 20, 2))
        assert {d.reason for d in dropped} == {"queue_full"}
        assert all(isinstance(d.error, keratin.LimitedError) for d in dropped)
        modes = {p.mode for p in node.received("Publish")}
        assert modes == {w.MODE_BUFFERED | w.MODE_JOINABLE}
        await client.close()
        await node.stop()

    run(go())


def test_buffered_messages_are_dropped_as_unknown_when_the_connection_ends() -> None:
    async def go() -> None:
        node = FakeNode()

        async def never_answer(conn: FakeConn, frame: Any) -> None:
            return None

        node.on("QueueList", never_answer)
        address = await node.start()
        client = await keratin.connect(address)
        dropped: List[keratin.DroppedPublish] = []
        pub = client.publisher("q", on_dropped=dropped.append)
        for i in range(3):
            await pub.publish(b"m%d" % i)
        await asyncio.sleep(0.1)
        assert pub.unsettled_count == 3  # no barrier reply: nothing is known yet
        node.drop_connections()
        await pub.flush(timeout=2)
        assert len(dropped) == 3
        assert all(isinstance(d.error, keratin.OutcomeUnknownError) for d in dropped)
        with pytest.raises(keratin.ConnectionLostError):
            await pub.publish(b"after the end")
        await client.close()
        await node.stop()

    run(go())


def test_an_idle_client_sends_heartbeats() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        client = await keratin.connect(address, heartbeat_interval=0.1, server_silence_timeout=5)
        await asyncio.sleep(0.5)
        assert len(node.received("Heartbeat")) >= 2
        await client.close()
        await node.stop()

    run(go())


def test_close_from_the_server_ends_the_connection_with_its_reason() -> None:
    async def go() -> None:
        node = FakeNode()

        async def closing(conn: FakeConn, frame: Any) -> None:
            await conn.send(w.Close("server shutting down"))

        node.on("QueueInfo", closing)
        address = await node.start()
        client = await keratin.connect(address)
        with pytest.raises(keratin.ConnectionLostError, match="server shutting down"):
            await client.info("q")
        assert not client.is_connected
        await client.close()
        await node.stop()

    run(go())


def test_a_consumer_past_its_prefetch_is_a_protocol_error() -> None:
    async def go() -> None:
        node = FakeNode()

        async def flood(conn: FakeConn, frame: Any) -> None:
            await conn.send(w.SubscribeOk(frame.request_id, frame.consumer_tag))
            for i in range(3):
                await conn.send(w.Deliver(frame.consumer_tag, i + 1, 0, i, False, 1, [], b"x"))

        node.on("Subscribe", flood)
        address = await node.start()
        client = await keratin.connect(address)
        consumer = client.consume("q", prefetch=2)
        await consumer.start()
        await asyncio.sleep(0.2)
        assert not client.is_connected
        assert isinstance(client._conn.error, keratin.ProtocolError)
        await client.close()
        await node.stop()

    run(go())


def test_connect_tries_each_address_in_turn() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        dead = FakeNode()
        dead_address = await dead.start()
        await dead.stop()
        client = await keratin.connect([dead_address, address])
        assert client.address == address
        await client.close()
        with pytest.raises(keratin.ConnectError):
            await keratin.connect([dead_address])
        await node.stop()

    run(go())


def test_bad_arguments_are_refused_before_sending() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        async with await keratin.connect(address) as client:
            with pytest.raises(ValueError):
                client.consume("q", prefetch=0)
            with pytest.raises(ValueError):
                client.consume("q", prefetch=70000)
            with pytest.raises(ValueError):
                await client.declare("q", overflow="explode")
            with pytest.raises(TypeError):
                await client.set_queue_settings("q", partitions=3)
            await client.set_queue_settings("q", max_messages=5, dead_letter=None)
            sent = node.received("SetQueueSettings")[0]
            assert sent.max_messages == w.Update(w.UPDATE_SET, 5)
            assert sent.dead_letter == w.Update(w.UPDATE_CLEAR, None)
            assert sent.overflow == w.Update(w.UPDATE_KEEP, None)
        with pytest.raises(ValueError):
            await keratin.connect(address, user="u")
        with pytest.raises(ValueError):
            await keratin.connect(address, user="u", password="p", token="t")
        await node.stop()

    run(go())


def test_two_nodes_naming_each_other_are_retried_with_backoff_not_in_a_busy_loop() -> None:
    async def go() -> None:
        a, b = await two_nodes()

        def naming(other: FakeNode) -> Any:
            async def handler(conn: FakeConn, frame: Any) -> None:
                body = w.ErrorBody(421, "led elsewhere", leader_addr=other.address)
                await conn.send(w.Error(frame.request_id, False, body))

            return handler

        a.on("Subscribe", naming(b))
        b.on("Subscribe", naming(a))
        client = await keratin.connect(a.address, request_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(keratin.NotLeaderError, match="found no leader"):
            await client.consume("q", prefetch=1).start()
        assert time.monotonic() - started >= 0.9
        attempts = len(a.received("Subscribe")) + len(b.received("Subscribe"))
        # Two immediate redirects, then at most one attempt per 100-250 ms backoff.
        assert 4 <= attempts <= 12, attempts
        await client.close()
        await a.stop()
        await b.stop()

    run(go())


def test_concurrent_publishes_are_joined_into_one_joinable_frame() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        client = await keratin.connect(address)
        await asyncio.gather(*(client.publish("q", b"m%d" % i) for i in range(50)))
        await client.publish("other", b"alone")
        publishes = node.received("Publish")
        # The 50 publishes of one turn of the event loop went as one frame; ids are unique.
        assert len(publishes) == 2
        first = publishes[0]
        assert first.queue == "q" and len(first.messages) == 50
        assert first.mode == w.MODE_CONFIRMED | w.MODE_JOINABLE
        assert sorted(m.body for m in first.messages) == sorted(b"m%d" % i for i in range(50))
        ids = [m.publish_id for p in publishes for m in p.messages]
        assert len(set(ids)) == len(ids)
        await client.close()
        await node.stop()

    run(go())


def test_a_joined_publish_without_an_answer_ends_unknown_at_its_deadline() -> None:
    async def go() -> None:
        node = FakeNode()

        async def silent(conn: FakeConn, frame: Any) -> None:
            pass  # never confirms (heartbeats keep the connection alive)

        node.on("Publish", silent)
        address = await node.start()
        client = await keratin.connect(address, publish_timeout=0.3, idempotent=False)
        started = time.monotonic()
        with pytest.raises(keratin.OutcomeUnknownError, match="no Confirm"):
            await client.publish("q", b"x")
        waited = time.monotonic() - started
        # The answer grace (1 s) bounds it from below, the deadline sweep (0.1 s) from above.
        assert 0.9 <= waited < 2.0, waited
        # The connection forgot the publish and still works.
        node.on("Publish", default_handler)
        await client.publish("q", b"y")
        await client.close()
        await node.stop()

    run(go())


def test_a_publish_cancelled_before_it_is_written_is_not_sent() -> None:
    async def go() -> None:
        node = FakeNode()
        address = await node.start()
        client = await keratin.connect(address)
        doomed = asyncio.ensure_future(client.publish("q", b"never"))
        await asyncio.sleep(0)  # the publish is queued for this turn's frame...
        doomed.cancel()  # ...and cancelled before the frame is written
        kept = asyncio.ensure_future(client.publish("q", b"kept"))
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await kept
        bodies = [m.body for p in node.received("Publish") for m in p.messages]
        assert bodies == [b"kept"]
        await client.close()
        await node.stop()

    run(go())
