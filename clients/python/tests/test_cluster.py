"""Against three real ``keratin`` nodes: a client connected to any node declares, publishes
and consumes wherever the queue's leader is (following 421 by itself), and when the leader is
killed a confirmed publish fails over to the new leader within publish_timeout without
losing any confirmed message. Fails if routing or failover stops working (a NotLeaderError,
a lost message, or a publish slower than its bound).

With the leaders of a queue's three partitions on three nodes, a client connected to one node
publishes to every partition's leader with each routing key's messages in order, and its
consumer receives every partition (it fails when the client follows one leader per queue: the
consumer gets one partition of three, and refused publishes resent behind later ones break
the order of a key)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Dict, List, Set

import pytest

import keratin

from .conftest import Cluster
from .fake import run


async def declared(client: keratin.Client, queue: str) -> None:
    """Declares ``queue`` with 3 replicas, waiting (bounded) for the cluster to have a leader."""
    deadline = time.monotonic() + 15
    while True:
        try:
            await client.declare(queue, replicas=3)
            return
        except (keratin.NotLeaderError, keratin.UnavailableError, keratin.LimitedError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def known(client: keratin.Client, queue: str) -> None:
    """Waits (bounded) until the node ``client`` is connected to has applied the declare: a
    follower that has not yet answers 404 (the metadata reaches it after the leader)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            await client.info(queue)
            return
        except keratin.NotFoundError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def leader_of(client: keratin.Client, queue: str) -> str:
    """The protocol address of the node leading ``queue``'s partition 0 (a leading node
    reports no ``leader_addr`` for itself)."""
    deadline = time.monotonic() + 10
    while True:
        partition = (await client.info(queue)).partitions[0]
        if partition.leading:
            return client.address
        if partition.leader_addr is not None:
            return partition.leader_addr
        # Just declared: the partition's first election may not be over yet.
        assert time.monotonic() < deadline, partition
        await asyncio.sleep(0.1)


async def drain(client: keratin.Client, queue: str, count: int) -> Set[bytes]:
    bodies: Set[bytes] = set()

    async def collect() -> None:
        async with client.consume(queue, prefetch=50) as consumer:
            async for d in consumer:
                bodies.add(d.body)
                await d.ack()
                if len(bodies) == count:
                    return

    await asyncio.wait_for(collect(), 15)
    return bodies


def test_requests_publishes_and_consumers_reach_the_leader_from_any_node(cluster: Cluster) -> None:
    async def go() -> None:
        queue = "routed-%s" % uuid.uuid4().hex[:6]
        addresses = cluster.addresses()
        clients = [await keratin.connect(a) for a in addresses]
        try:
            await declared(clients[0], queue)
            for i, client in enumerate(clients):
                await known(client, queue)
                await client.publish(queue, b"from node %d" % i)
            leader = await leader_of(clients[1], queue)
            assert leader in addresses
            follower = next(c for c in clients if c.address != leader)
            assert await drain(follower, queue, 3) == {b"from node 0", b"from node 1", b"from node 2"}
        finally:
            for client in clients:
                await client.close()

    run(go(), timeout=28)


def test_a_killed_leader_fails_over_without_losing_confirmed_messages(cluster: Cluster) -> None:
    async def go() -> None:
        queue = "failover-%s" % uuid.uuid4().hex[:6]
        client = await keratin.connect(cluster.addresses(), publish_timeout=15)
        try:
            await declared(client, queue)
            confirmed: List[bytes] = []
            for i in range(5):
                body = b"before %d" % i
                await client.publish(queue, body)
                confirmed.append(body)
            leader = await leader_of(client, queue)
            for address in cluster.addresses():
                async with await keratin.connect(address) as each:
                    await known(each, queue)
            cluster.kill9(leader)
            started = time.monotonic()
            for i in range(5):
                body = b"after %d" % i
                await client.publish(queue, body)
                confirmed.append(body)
            elapsed = time.monotonic() - started
            assert elapsed < 15, elapsed
            survivor = next(a for a in cluster.addresses() if a != leader)
            async with await keratin.connect(survivor) as reader:
                # At-least-once: every confirmed message is there (a resend may add a copy).
                got = await drain(reader, queue, len(confirmed))
            assert got == set(confirmed)
        finally:
            await client.close()

    run(go(), timeout=29)


def test_losing_the_connected_leader_sends_idempotent_publishes_to_the_others(cluster: Cluster) -> None:
    async def go() -> None:
        queue = "lost-%s" % uuid.uuid4().hex[:6]
        async with await keratin.connect(cluster.addresses()) as setup:
            await declared(setup, queue)
            leader = await leader_of(setup, queue)
        # Every node has applied the declare (a follower answers 404 until it has).
        for address in cluster.addresses():
            async with await keratin.connect(address) as each:
                await known(each, queue)
        # Connected to the leader itself, and told of the other nodes.
        others = [a for a in cluster.addresses() if a != leader]
        client = await keratin.connect([leader] + others, publish_timeout=15)
        try:
            assert client.address == leader
            await client.publish(queue, b"before")
            cluster.kill9(leader)
            await client.publish(queue, b"after")  # sent again elsewhere, stored once
            assert not client.is_connected
            async with await keratin.connect(others) as reader:
                assert await drain(reader, queue, 2) == {b"before", b"after"}
        finally:
            await client.close()

    run(go(), timeout=29)


def test_a_consumer_follows_its_partition_when_the_leader_replica_moves(cluster: Cluster) -> None:
    async def go() -> None:
        queue = "moving-%s" % uuid.uuid4().hex[:6]
        first = cluster.nodes[1]
        async with await keratin.connect(first.address) as setup:
            deadline = time.monotonic() + 15
            while True:
                try:
                    await setup.declare(queue, nodes=[1, 2])  # replicas on nodes 1 and 2
                    break
                except (keratin.NotLeaderError, keratin.UnavailableError, keratin.BadRequestError,
                        keratin.LimitedError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.3)
            leader = await leader_of(setup, queue)
        leader_id = next(i for i, n in cluster.nodes.items() if n.address == leader)
        assert leader_id in (1, 2)
        client = await keratin.connect(leader)
        try:
            await client.publish(queue, b"before the move")
            bodies: List[bytes] = []
            async with client.consume(queue, prefetch=10) as consumer:
                async for d in consumer:
                    bodies.append(d.body)
                    await d.ack()
                    break
                assert consumer.node_address == leader
                move = ("queue", "move", queue, "--partition", "0", "--from", str(leader_id), "--to", "3", "--wait", "20")
                await asyncio.get_running_loop().run_in_executor(None, lambda: first.cli(*move))
                await client.publish(queue, b"after the move")
                async for d in consumer:
                    bodies.append(d.body)
                    await d.ack()
                    if d.body == b"after the move":
                        break
                # It consumes at the new leader (the old node may keep an idle subscription:
                # its copy moved away without ending it).
                assert any(address != leader for address in consumer.node_addresses)
            assert bodies[0] == b"before the move" and bodies[-1] == b"after the move"
        finally:
            await client.close()

    run(go(), timeout=29)


def test_stream_readers_and_commits_reach_the_cursor_logs_leader_from_any_node(cluster: Cluster) -> None:
    """A stream declared with 3 replicas; a reader with a cursor subscribes through each node
    (two of them answer 421 naming the node leading the cursor log, and the client subscribes
    there), reads every message, commits through its own node's client (421 followed), and a
    later reader with the same cursor gets only what was published after the commit."""

    async def go() -> None:
        stream = "stream-%s" % uuid.uuid4().hex[:6]
        clients = [await keratin.connect(a) for a in cluster.addresses()]
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    await clients[0].declare_stream(stream, partitions=2, replicas=3)
                    break
                except (keratin.NotLeaderError, keratin.UnavailableError, keratin.LimitedError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.3)
            for i in range(9):
                await clients[i % 3].publish(stream, b"m%d" % i, key="k%d" % (i % 4))

            async def read(client: keratin.Client, cursor: str, count: int) -> List[bytes]:
                got: List[bytes] = []
                async with client.stream_subscribe(stream, cursor=cursor, credit=16) as reader:
                    async for delivery in reader:
                        got.append(delivery.body)
                        if len(got) == count:
                            await reader.commit()
                            return got
                return got

            for i, client in enumerate(clients):
                got = await asyncio.wait_for(read(client, "c%d" % i, 9), 10)
                assert sorted(got) == sorted(b"m%d" % n for n in range(9)), (i, got)
            await clients[1].publish(stream, b"late", key="k0")
            for i, client in enumerate(clients):
                got = await asyncio.wait_for(read(client, "c%d" % i, 1), 10)
                assert got == [b"late"], (i, got)
        finally:
            for client in clients:
                await client.close()

    run(go(), timeout=29)


async def spread_leaders(cluster: Cluster, queue: str) -> None:
    """Declares ``queue`` with 3 partitions whose preferred leaders are nodes 1, 2 and 3, and
    waits (bounded) until every node names them as the leaders (leader balancing hands each
    partition to its preferred leader once that one is caught up)."""
    async with await keratin.connect(cluster.nodes[1].address) as setup:
        deadline = time.monotonic() + 15
        while True:
            try:
                await setup.declare(queue, partitions=3, replicas=3, nodes=[1, 2, 3])
                break
            except (keratin.NotLeaderError, keratin.UnavailableError, keratin.LimitedError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
    deadline = time.monotonic() + 30
    views: Dict[int, Any] = {}
    while True:
        for i, node in cluster.nodes.items():
            try:
                async with await keratin.connect(node.address) as each:
                    info = await each.info(queue)
                    views[i] = [p.leader for p in info.partitions]
            except keratin.KeratinError as e:
                views[i] = str(e)
        if all(view == [1, 2, 3] for view in views.values()):
            return
        assert time.monotonic() < deadline, "leaders did not spread: %r" % views
        await asyncio.sleep(0.3)


def test_a_client_on_one_node_publishes_and_consumes_every_partition_in_key_order(
    balanced_cluster: Cluster,
) -> None:
    async def go() -> None:
        queue = "spread-%s" % uuid.uuid4().hex[:6]
        await spread_leaders(balanced_cluster, queue)
        keys = ["key-%d" % k for k in range(6)]
        per_key = 100
        client = await keratin.connect(balanced_cluster.nodes[2].address)
        try:
            started = time.monotonic()
            # Pipelined: each publish is sent before the earlier ones are confirmed.
            publishes = [
                client.publish(queue, b"%s:%d" % (key.encode(), n), key=key)
                for n in range(per_key)
                for key in keys
            ]
            await asyncio.gather(*publishes)
            took = time.monotonic() - started
            assert took < 10, "600 publishes through node 2 took %.1f s" % took
            got: Dict[str, List[int]] = {key: [] for key in keys}
            partitions: Set[int] = set()

            async def consume() -> None:
                async with client.consume(queue, prefetch=200) as consumer:
                    received = 0
                    async for d in consumer:
                        key, n = d.body.decode().split(":")
                        got[key].append(int(n))
                        partitions.add(d.partition)
                        await d.ack()
                        received += 1
                        if received == per_key * len(keys):
                            return

            try:
                await asyncio.wait_for(consume(), 15)
            except asyncio.TimeoutError:
                raise AssertionError(
                    "the consumer on node 2 got %d of %d, from partitions %r"
                    % (sum(len(v) for v in got.values()), per_key * len(keys), sorted(partitions))
                ) from None
            assert partitions == {0, 1, 2}
            for key, seqs in got.items():
                assert seqs == list(range(per_key)), "%s out of order: %r" % (key, seqs)
        finally:
            await client.close()

    run(go(), timeout=55)
